"""The stage clock propose times its stages with (:class:`qdebug.progress.StageClock`)."""

from __future__ import annotations

from qdebug.progress import DETAIL, StageClock, no_progress, stage_seconds


def test_each_stage_gets_the_time_until_the_next_call_and_a_stage_that_comes_back_adds_up():
    now = [0.0]
    seen = []
    clock = StageClock(lambda *a: seen.append(a), clock=lambda: now[0])
    for t, stage in [(1.0, "prepare"), (3.0, "recipes"), (4.0, f"search{DETAIL}1 changed"), (6.0, "re-rank"),
                     (6.5, f"search{DETAIL}2 changed")]:  # fmt: skip
        now[0] = t
        clock(stage, 0, None)
    now[0] = 9.0
    assert clock.seconds() == (("prepare", 2.0), ("recipes", 1.0), ("search", 4.5), ("re-rank", 0.5))
    assert [s for s, _, _ in seen][2] == f"search{DETAIL}1 changed"  # passed on as given
    assert stage_seconds(clock) == (("prepare", 2.0), ("recipes", 1.0), ("search", 4.5), ("re-rank", 0.5))
    assert stage_seconds(no_progress) == ()
