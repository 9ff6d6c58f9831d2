"""Contracts of the per-sample drill-down's shared graph walk: sample_tensors builds the FP32
graph's index and node depths once for all samples, and node_records uses the ones it is given -- with the
numbers node_records computes on its own."""

from __future__ import annotations

import math

import numpy as np

from qdebug.analysis import build, per_sample
from qdebug.graph.match import pair_models
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.runtime.capture import SessionConfig
from tests.conftest import FIXTURES

CNN = FIXTURES / "cnn"


def _counted(monkeypatch, module, name, calls):
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)


def test_the_graph_is_walked_once_for_all_samples(tmp_path, monkeypatch):
    prep = prepare(CNN / "model.onnx", CNN / "calib.npz", tmp_path, AnalyzeOptions(use_cache=False))
    qproto = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(), load_check=False)
    pairing = pair_models(prep.normalized, qproto)
    x = np.load(CNN / "calib.npz")["input"]
    samples = [per_sample.SampleInput(i, {"input": x[i : i + 1]}, {"input": 0}, whole=True) for i in range(4)]
    calls: list[str] = []
    for module in (per_sample, build):
        for name in ("GraphIndex", "node_depths"):
            _counted(monkeypatch, module, name, calls)
    shape, measured = per_sample.sample_tensors(prep.normalized, qproto, pairing, samples, SessionConfig())
    assert sorted(calls) == ["per_sample.GraphIndex", "per_sample.node_depths"]  # once, not once per sample
    assert len(measured) == 4 and shape.names
    monkeypatch.undo()
    # the shared index and depths give the numbers node_records derives on its own
    fresh = per_sample.layout(prep.normalized, per_sample.measured_pairs(prep.normalized, pairing))
    assert fresh == shape
    added = [v for m in measured for v in m.added_noise_db if not math.isnan(v)]
    assert added


def test_the_per_sample_added_noise_is_node_records_own_number(tmp_path):
    """added_noise_by_output (what each flipped sample's drill-down computes) gives, per node output, the
    added_noise_db node_records derives -- on the cnn and transformer fixtures' reports (folded Relus, tensors
    with no accumulated error, residual adds), and with half of the tensors' numbers dropped."""
    import onnx

    from qdebug.cli.main import main
    from qdebug.graph.match import GraphIndex
    from qdebug.output.report_io import load_report

    for name in ("cnn", "transformer"):
        out = tmp_path / f"{name}.json"
        assert main(["analyze", str(FIXTURES / name / "model.onnx"), "--calib", str(FIXTURES / name / "calib.npz"),
                     "-o", str(out), "-q", "--no-cache"]) == 0
        report = load_report(out)
        fp32 = onnx.load(report.normalized_model)
        for tensors in (report.tensors, report.tensors[::2]):
            index = GraphIndex(fp32)
            want = {o: n.added_noise_db for n in build.node_records(fp32, tensors, set(), {}) for o in n.outputs}
            got = build.added_noise_by_output(fp32, tensors, index)
            assert got.keys() == want.keys()
            assert all(got[o] == want[o] or (math.isnan(got[o]) and math.isnan(want[o])) for o in want)
            assert any(math.isfinite(v) for v in got.values())


def test_clip_rates_in_bulk_are_clip_rate_of_each_tensor(monkeypatch):
    """per_sample.clip_rates (the drill-down's bulk path): clip_rate's number for every tensor, exactly --
    per-tensor scales of every zero-point type and none, per-channel ones, NaN and inf values, empty
    tensors, float16 data -- whole and with the joined chunks cut small."""
    from qdebug.graph.reduce import FakeQuant

    rng = np.random.default_rng(5)
    items = []
    for k in range(60):
        x = rng.normal(0, 1 + k % 7, size=rng.integers(0, 40, size=rng.integers(1, 4))).astype(np.float32)
        if k % 9 == 0 and x.size:
            x.flat[0] = np.nan
        if k % 11 == 0 and x.size:
            x.flat[-1] = np.inf
        kind = k % 6
        if kind == 0:
            fq = FakeQuant(np.float32(0.01 * (k + 1)), np.uint8(128))
        elif kind == 1:
            fq = FakeQuant(np.array(0.02, np.float32), np.array(3, np.int8))
        elif kind == 2:
            fq = FakeQuant(np.float32(0.001), np.array(30000, np.uint16))
        elif kind == 3:
            fq = FakeQuant(np.float32(0.05), None)
        elif kind == 4 and x.ndim > 1:
            n = x.shape[0]
            fq = FakeQuant(np.linspace(0.01, 0.1, n).astype(np.float32), np.zeros(n, np.int8), axis=0)
        else:
            x = x.astype(np.float16)
            fq = FakeQuant(np.float32(0.03), np.uint8(0))
        items.append((x, fq) if k % 13 else None)
    expected = [math.nan if i is None else per_sample.clip_rate(*i) for i in items]

    def same(got):
        return len(got) == len(expected) and all(
            (math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, expected, strict=True)
        )

    assert any(0 < e < 1 for e in expected)  # some clip, some do not
    assert same(per_sample.clip_rates(items))
    monkeypatch.setattr(per_sample, "CLIP_CHUNK", 25)
    assert same(per_sample.clip_rates(items))
