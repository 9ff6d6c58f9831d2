"""Group-testing minimization: shrink a set that meets the target to a subset-minimal one.

Pruning one member at a time costs one evaluation per member: on a 115-node answer to a detector whose
whole fix was one Concat, the budget ran out long before the Concat was reached, and the user was handed
44 % of the model in FP32. :func:`minimal_subset` is QuickXplain (Junker, AAAI 2004): it splits the
candidates in halves, keeps a half whenever the other one suffices with what is already kept, and
recurses, so ``k`` necessary members among ``n`` cost about ``k * log2(n / k) + k`` evaluations (one
necessary member among 262: 12). The result is minimal for single removals: dropping any one member
misses the target (given a monotone target; the search's noise margin and cache keep a noisy one sane).

Members earlier in the list are preferred: a half is dropped only after the earlier half was tried on its
own, so the likeliest culprits (analyze's diagnoses, then the ranking) go first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class _Spent(Exception):
    """The evaluation budget ran out inside the minimization."""


def minimal_subset(items: Sequence[T], meets: Callable[[list[T]], bool | None]) -> tuple[list[T], bool]:
    """A subset of ``items`` (which meets the target) that still meets it and loses no member needlessly.

    ``meets(subset)`` scores a subset: True/False, or None when the budget is spent. Returns the subset
    (in the order of ``items``) and whether the minimization finished; when the budget ran out, the
    smallest subset seen to meet the target is returned (``items`` itself at worst).
    """
    items = list(items)
    seen: list[list[T]] = [items]

    def test(subset: list[T]) -> bool:
        ok = meets(subset)
        if ok is None:
            raise _Spent
        if ok:
            seen.append(subset)
        return ok

    def split(background: list[T], added: bool, cands: list[T]) -> list[T]:
        if added and test(background):
            return []
        if len(cands) == 1:
            return cands
        half = len(cands) // 2
        first, second = cands[:half], cands[half:]
        keep_second = split(background + first, bool(first), second)
        keep_first = split(background + keep_second, bool(keep_second), first)
        return keep_first + keep_second

    if len(items) <= 1:
        return items, True
    try:
        found = split([], False, items)
    except _Spent:
        smallest = min(seen, key=len)
        return [x for x in items if x in smallest], False
    return [x for x in items if x in found], True
