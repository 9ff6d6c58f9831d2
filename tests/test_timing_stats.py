"""Percentiles of bench's and verify's timings: the suite only checked p50 <= p95 <= p99, which holds when
every percentile is the median."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest

from qdebug.bench import latency_stats
from qdebug.runtime.capture import SessionConfig
from tests.models import small_cnn


def test_latency_stats_tail_percentiles():
    ns = [k * 1_000_000 for k in range(1, 101)]  # 1..100 ms
    s = latency_stats(ns, 4)
    assert s.p50_ms == pytest.approx(50.5)
    assert s.p95_ms == pytest.approx(95.05)
    assert s.p99_ms == pytest.approx(99.01)
    assert s.throughput == pytest.approx(4 * 100 / 5.050)


def test_time_sessions_reports_the_95th_percentile_of_the_runs(tmp_path, monkeypatch):
    """Each timed run takes k ms (k = 1..20, a fake clock): p50, p95 and the mean follow exactly."""
    import qdebug.runtime.timing as verify_mod

    model = onnx.load(str(small_cnn(tmp_path / "m.onnx")))
    feeds = {"input": np.zeros((2, 1, 8, 8), np.float32)}
    clock = {"t": 0.0, "calls": 0}

    def fake_perf_counter():
        # called twice per timed run (before, after): the k-th run lasts k ms
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:
            clock["t"] += (clock["calls"] // 2) * 1e-3
        return clock["t"]

    # only verify's view of the clock is replaced (time.perf_counter itself is left alone)
    monkeypatch.setattr(verify_mod, "time", types.SimpleNamespace(perf_counter=fake_perf_counter))
    timings = verify_mod.time_sessions({"m": model}, feeds, SessionConfig(intra_op_threads=1), runs=20, warmup=0)
    t = timings["m"]
    expected = np.arange(1, 21, dtype=float)
    assert t.runs == 20
    assert t.p50_ms == pytest.approx(np.percentile(expected, 50))
    assert t.p95_ms == pytest.approx(np.percentile(expected, 95))
    assert t.mean_ms == pytest.approx(expected.mean())
    assert t.throughput == pytest.approx(2 / (expected.mean() / 1e3))


def test_time_sessions_keeps_each_interleaved_rounds_median_paired_across_the_models(tmp_path, monkeypatch):
    """With a fake clock where FP32's runs take 4 ms and the other model's 1 ms, then (a load spike in round
    2) 8 and 4 ms: each model has one median per round, in order, and the per-round speed-up is 4x then 2x --
    the ratio a p50 over all runs would blur."""
    import qdebug.runtime.timing as timing_mod
    from qdebug.records.verify import speed_ratio

    model = onnx.load(str(small_cnn(tmp_path / "m.onnx")))
    feeds = {"input": np.zeros((2, 1, 8, 8), np.float32)}
    per_round = {0: {"fp32": 4e-3, "int8": 1e-3}, 1: {"fp32": 8e-3, "int8": 4e-3}, 2: {"fp32": 4e-3, "int8": 1e-3}}
    state = {"t": 0.0, "calls": 0}
    order = [name for r in range(3) for name in ("fp32", "int8") for _ in range(timing_mod.CHUNK_RUNS)]

    def fake_perf_counter():
        state["calls"] += 1
        if state["calls"] % 2 == 0:  # the end of the k-th timed run
            k = state["calls"] // 2 - 1
            state["t"] += per_round[k // (2 * timing_mod.CHUNK_RUNS)][order[k]]
        return state["t"]

    monkeypatch.setattr(timing_mod, "time", types.SimpleNamespace(perf_counter=fake_perf_counter))
    runs = 3 * timing_mod.CHUNK_RUNS
    t = timing_mod.time_sessions(
        {"fp32": model, "int8": model}, feeds, SessionConfig(intra_op_threads=1), runs=runs, warmup=0
    )
    assert t["fp32"].rounds_ms == pytest.approx((4.0, 8.0, 4.0))
    assert t["int8"].rounds_ms == pytest.approx((1.0, 4.0, 1.0))
    ratio = speed_ratio(t["fp32"].rounds_ms, t["int8"].rounds_ms)
    assert ratio is not None and ratio.rounds == 3
    assert (ratio.median, ratio.low, ratio.high) == pytest.approx((4.0, 2.0, 4.0))


def test_speed_ratio_says_faster_or_slower_only_where_every_round_does():
    """The median of the per-round ratios and their range; faster or slower only when the whole range is on
    one side of 1; no ratio from one round, or from rounds not timed together (other counts)."""
    from qdebug.records.verify import speed_ratio

    faster = speed_ratio((2.0, 2.2, 2.0, 2.4), (1.0, 1.0, 1.6, 1.2))
    assert faster is not None and faster.median == pytest.approx(2.0) and faster.low == pytest.approx(1.25)
    assert faster.verdict == "faster" and faster.show() == "2.00x (1.25-2.20)"
    noisy = speed_ratio((2.0, 1.0, 2.0), (1.0, 2.0, 1.0))
    assert noisy is not None and noisy.verdict == "within the noise" and noisy.median == pytest.approx(2.0)
    assert speed_ratio((1.0, 1.0), (2.0, 4.0)).verdict == "slower"
    assert speed_ratio((1.0,), (2.0,)) is None
    assert speed_ratio((1.0, 1.0, 1.0), (2.0, 2.0)) is None
    assert speed_ratio((), ()) is None


def test_a_slow_model_runs_fewer_times_per_round_and_every_round_holds_every_model(tmp_path, monkeypatch):
    """With ``round_seconds=1``: a model whose warm-up runs take 0.4 s gets 2 runs per round (1 s / 0.4 s), its
    warm-up stopping once it has taken a second; one at 10 ms keeps CHUNK_RUNS per round; both have one median
    per round, so their ratio still pairs round by round. Without ``round_seconds`` nothing changes."""
    import qdebug.runtime.timing as timing_mod

    model = onnx.load(str(small_cnn(tmp_path / "m.onnx")))
    feeds = {"input": np.zeros((2, 1, 8, 8), np.float32)}
    cost = {"slow": 0.4, "fast": 0.01}
    state = {"t": 0.0, "open": False, "current": "slow"}

    def fake_perf_counter():
        if state["open"]:
            state["t"] += cost[state["current"]]
        state["open"] = not state["open"]
        return state["t"]

    monkeypatch.setattr(timing_mod, "time", types.SimpleNamespace(perf_counter=fake_perf_counter))
    calls = {"slow": 0, "fast": 0}
    real_bound = timing_mod._bound_runs

    def counted(sessions, inputs, *, fresh_outputs):
        bound = real_bound(sessions, inputs, fresh_outputs=fresh_outputs)

        def wrap(name):
            def run():
                state["current"] = name
                calls[name] += 1
                bound[name]()

            return run

        return {name: wrap(name) for name in bound}

    monkeypatch.setattr(timing_mod, "_bound_runs", counted)
    runs = 2 * timing_mod.CHUNK_RUNS
    t = timing_mod.time_sessions(
        {"slow": model, "fast": model}, feeds, SessionConfig(intra_op_threads=1), runs=runs, warmup=5, round_seconds=1.0
    )
    assert t["slow"].runs == 2 * 2 and t["fast"].runs == runs
    assert len(t["slow"].rounds_ms) == len(t["fast"].rounds_ms) == 2
    assert calls["slow"] == 3 + 4  # warm-up cut after 3 runs (1.2 s), then 2 rounds of 2
    assert t["slow"].p50_ms == pytest.approx(400.0) and t["fast"].p50_ms == pytest.approx(10.0)
    calls.update(slow=0, fast=0)
    plain = timing_mod.time_sessions(
        {"slow": model, "fast": model}, feeds, SessionConfig(intra_op_threads=1), runs=runs, warmup=5
    )
    assert plain["slow"].runs == plain["fast"].runs == runs and calls["slow"] == 5 + runs
