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

Each test depends on the answers before it, so the tests run one after another. What can run ahead is a
guess: before each test, :func:`minimal_subset` can name (``lookahead``) the tests that would come next
if it met the target and if it did not, found by replaying the algorithm over the answers known so far.
Workers left idle score those ahead (:meth:`qdebug.propose.search.Search.prefetch`); the answer and the
tests counted are those of the plain run, whatever was guessed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class _Spent(Exception):
    """The evaluation budget ran out inside the minimization."""


class _Unknown(Exception):
    """A replay reached a test whose answer it does not know (:func:`_next_tests`)."""

    def __init__(self, subset: list) -> None:
        super().__init__()
        self.subset = subset


def minimal_subset(
    items: Sequence[T],
    meets: Callable[[list[T]], bool | None],
    lookahead: Callable[[list[list[T]]], None] | None = None,
    depth: int = 2,
) -> tuple[list[T], bool]:
    """A subset of ``items`` (which meets the target) that still meets it and loses no member needlessly.

    ``meets(subset)`` scores a subset: True/False, or None when the budget is spent. Returns the subset
    (in the order of ``items``) and whether the minimization finished; when the budget ran out, the
    smallest subset seen to meet the target is returned (``items`` itself at worst). ``lookahead``, called
    before each test with that test's subset and the tests of the ``depth - 1`` steps after it whatever their
    outcomes (depth 2: the one if it meets the target, the one if it does not), is a hint only: what it does
    changes neither the tests made nor the result.
    """
    items = list(items)
    seen: list[list[T]] = [items]
    position = {id(x): i for i, x in enumerate(items)}
    answers: dict[tuple[int, ...], bool] = {}

    def key(subset: list[T]) -> tuple[int, ...]:
        return tuple(position[id(x)] for x in subset)

    def test(subset: list[T]) -> bool:
        if lookahead is not None:
            lookahead(_next_tests(items, answers, key, subset, depth))
        ok = meets(subset)
        if ok is None:
            raise _Spent
        answers[key(subset)] = bool(ok)
        if ok:
            seen.append(subset)
        return ok

    if len(items) <= 1:
        return items, True
    try:
        found = _quickxplain(items, test)
    except _Spent:
        smallest = min(seen, key=len)
        return [x for x in items if x in smallest], False
    return [x for x in items if x in found], True


def _quickxplain(items: list[T], test: Callable[[list[T]], bool]) -> list[T]:
    """QuickXplain's recursion over ``items`` with ``test`` as the oracle: the members kept."""

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

    return split([], False, items)


def _next_tests(
    items: list[T],
    answers: dict[tuple[int, ...], bool],
    key: Callable[[list[T]], tuple[int, ...]],
    now: list[T],
    depth: int = 2,
) -> list[list[T]]:
    """``now``, then breadth first the tests of the next ``depth - 1`` steps for every outcome (the one if it
    meets the target first), none past the end: the recursion replayed over the answers known so far."""
    out, seen = [now], {key(now)}
    level = [(now, answers)]
    for _ in range(depth - 1):
        nxt = []
        for test, known in level:
            for outcome in (True, False):
                assumed = {**known, key(test): outcome}
                following = _first_unknown(items, assumed, key)
                if following is not None:
                    nxt.append((following, assumed))
                    if key(following) not in seen:
                        seen.add(key(following))
                        out.append(following)
        level = nxt
    return out


def _first_unknown(
    items: list[T], known: dict[tuple[int, ...], bool], key: Callable[[list[T]], tuple[int, ...]]
) -> list[T] | None:
    """The first test the recursion makes whose answer ``known`` lacks (None: it ends without one)."""

    def oracle(subset: list[T]) -> bool:
        k = key(subset)
        if k not in known:
            raise _Unknown(subset)
        return known[k]

    try:
        _quickxplain(items, oracle)
    except _Unknown as e:
        return e.subset
    return None
