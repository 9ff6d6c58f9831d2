"""Latency in the search (:mod:`qdebug.propose.latency`): each candidate's time per run estimated from the
report's profile (``analyze --profile``), and the met candidate estimated clearly faster than the smallest
offered as the answer. The estimates are sums over the profile's own numbers, so the tests hold on any CPU."""

from __future__ import annotations

import math

import pytest

from qdebug.cli.main import main
from qdebug.output.report_io import load_report
from qdebug.propose import ProposeOptions, propose
from qdebug.propose.latency import LatencyModel, cheapest
from qdebug.propose.search import Trial
from tests.conftest import planted as _planted


def _trial(nodes, qdq_pairs, met=True, overrides=(), per_channel=False):
    return Trial("t", tuple(nodes), tuple(overrides), per_channel, 0.95 if met else 0.5, math.nan, met, qdq_pairs, 0, 0)


class _Search:  # what cheapest reads of a Search
    def __init__(self, trials, max_nodes=None):
        self.trials, self.equivalents, self.max_nodes = list(trials), [], max_nodes

    def fits(self, trial):
        return self.max_nodes is None or len(trial.nodes) <= self.max_nodes


# a chain a -> b -> c: INT8 kernels 1 ms, FP32 1.2 ms, a Q/DQ pair 0.5 ms. Keeping b alone FP32 cuts the
# quantized chain in two (5 pairs); keeping b and c FP32 leaves one quantized region (3 pairs)
LATENCY = LatencyModel({"a": 1.2, "b": 1.2, "c": 1.2}, {"a": 1.0, "b": 1.0, "c": 1.0}, 0.5)


def test_a_candidate_is_estimated_from_its_kernels_and_its_qdq_pairs():
    assert LATENCY.estimate([], 4) == pytest.approx(3.0 + 2.0)
    assert LATENCY.estimate(["b"], 5) == pytest.approx(1.0 + 1.2 + 1.0 + 2.5)
    assert LATENCY.estimate(["b", "c"], 3) == pytest.approx(1.0 + 2.4 + 1.5)
    assert LATENCY.fp32_total == pytest.approx(3.6)
    assert LATENCY.estimate(["renamed"], 3) is None  # a node the profile never saw: no estimate
    assert LATENCY.of_trial(_trial(["b"], 5, overrides=("b",))) is None  # 16-bit runs as float: not timed


def test_the_met_candidate_estimated_clearly_faster_is_offered_and_nothing_else():
    smallest, region = _trial(["b"], 5), _trial(["b", "c"], 3)
    cheaper_but_missed = _trial(["a", "b", "c"], 0, met=False)
    found = cheapest(_Search([_trial([], 4, met=False), smallest, region, cheaper_but_missed]), LATENCY, smallest)
    assert found is not None and found[0] is region
    assert found[1:] == pytest.approx((4.9, 5.7))
    # not when --max-nodes leaves it out, nor when it is less than SPEED_MARGIN faster
    assert cheapest(_Search([smallest, region], max_nodes=1), LATENCY, smallest) is None
    close = _trial(["b", "c"], 4)  # 5.4 against 5.7: within 10 %
    assert cheapest(_Search([smallest, close]), LATENCY, smallest) is None
    assert cheapest(_Search([smallest, region]), LATENCY, region) is None  # the answer is the cheapest already


def test_the_profiles_model_adds_up_to_the_profiled_static_model_and_propose_takes_the_cheaper_answer(
    tmp_path, monkeypatch
):
    """On a profiled report, full static INT8's estimate is the profile's INT8 kernels plus its Q/DQ kernels
    exactly; when a met candidate is estimated cheaper than the smallest (forced here: which one is depends on
    the CPU's timings), it is the answer, with the note saying why, and the proposal keeps its nodes FP32."""
    import qdebug.propose.run as run_mod

    rec = _planted().make("two_culprits", tmp_path / "d", "small")  # met by 4 nodes, then by its 2
    report = tmp_path / "r.json"
    args = ["analyze", rec.model, "--calib", rec.calib, "--eval", rec.eval, "--metric", rec.metric]
    assert main([*args, "--profile", "3", "-o", str(report), "-q"]) == 0
    profile = load_report(report).profile
    assert profile is not None and profile.int8 is not None
    chosen = {}

    def forced(search, latency, answer):
        static = search.trials[0]
        assert latency.estimate([], static.qdq_pairs) == pytest.approx(
            sum(n.int8_ms + n.qdq_ms for n in profile.nodes)
        )
        larger = [t for t in search.trials if t.met and len(t.nodes) > len(answer.nodes) and not t.overrides]
        if not larger:
            return None
        chosen["trial"] = max(larger, key=lambda t: len(t.nodes))
        return chosen["trial"], 1.0, 2.0

    monkeypatch.setattr(run_mod, "cheapest", forced)
    result = propose(report, options=ProposeOptions(target_drop=rec.target_drop, time_runs=0, recipes=()))
    assert "trial" in chosen, "the search met the target with one set only"
    assert set(result.proposal.nodes_to_exclude) == set(chosen["trial"].nodes)
    assert any("estimated at 1 ms per run against 2" in n for n in result.notes), result.notes


def test_a_profile_of_another_graph_gives_no_latency_model(tmp_path):
    """The profile is of the report's model; a search on a recipe's model (BatchNormalization folded away)
    cannot be estimated from it: a profiled FP32 node missing from the search's graph turns the model off."""
    rec = _planted().make("two_culprits", tmp_path / "d", "small")
    report = tmp_path / "r.json"
    args = ["analyze", rec.model, "--calib", rec.calib, "--eval", rec.eval, "--metric", rec.metric]
    assert main([*args, "--profile", "2", "-o", str(report), "-q"]) == 0
    profile = load_report(report).profile
    static = _trial([], 10, met=False)
    graph = [n.name for n in profile.nodes if n.fp32_kernel != "-"]
    assert LatencyModel.of(profile, static, graph) is not None
    assert LatencyModel.of(profile, static, graph[1:]) is None
