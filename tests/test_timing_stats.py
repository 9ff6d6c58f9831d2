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
