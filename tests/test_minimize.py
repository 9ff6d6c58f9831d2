"""Group-testing minimization (QuickXplain): the answer it finds and what it costs."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from qdebug.propose.minimize import minimal_subset


def _counting(necessary: set[int]):
    calls: list[list[int]] = []

    def meets(subset: list[int]) -> bool:
        calls.append(subset)
        return necessary <= set(subset)

    return meets, calls


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 300), st.data())
def test_minimal_subset_finds_exactly_the_necessary_members(n, data):
    k = data.draw(st.integers(1, min(n, 6)))
    necessary = set(data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k, unique=True)))
    meets, calls = _counting(necessary)
    found, complete = minimal_subset(list(range(n)), meets)
    assert complete and set(found) == necessary and found == sorted(found)  # the input's order is kept
    # k necessary among n: about k * log2(n / k) + k tests, never one per member (one-at-a-time pruning)
    assert len(calls) <= 2 * k * (math.ceil(math.log2(max(n, 2))) + 1)


def test_one_culprit_among_262_costs_a_dozen_evaluations():
    """The detector of issue 15: 115 nodes kept FP32 where one Concat is the whole fix."""
    meets, calls = _counting({200})
    assert minimal_subset(list(range(262)), meets) == ([200], True)
    assert len(calls) <= 2 * math.ceil(math.log2(262))


def test_a_culprit_at_the_front_is_found_fastest():
    meets, front = _counting({0})
    minimal_subset(list(range(128)), meets)
    meets, back = _counting({127})
    minimal_subset(list(range(128)), meets)
    assert len(front) <= len(back)


def test_a_spent_budget_returns_the_smallest_set_seen_to_meet():
    necessary = {3, 40}
    budget = [6]

    def meets(subset):
        if budget[0] == 0:
            return None
        budget[0] -= 1
        return necessary <= set(subset)

    found, complete = minimal_subset(list(range(64)), meets)
    assert not complete
    assert necessary <= set(found) and len(found) < 64  # it met the target, and is smaller than the input
