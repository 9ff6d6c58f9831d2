"""``analyze --method minmax,entropy,percentile`` in one run (issue 19 item 4): what the methods share runs
once, and each report is the report of that method's own run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import qdebug.analysis.graph_engine as graph_engine
import qdebug.pipeline as pipeline
import qdebug.prepare as prepare
from qdebug.analysis import measure_layers
from qdebug.analysis.reference import SharedReference
from qdebug.cli.main import main
from qdebug.data import model_input_specs, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.match import pair_models
from qdebug.output.report_io import load_report
from qdebug.runtime.capture import SessionConfig
from tests.conftest import fixture_path

METHODS = ("minmax", "entropy", "percentile")

DIFFERS = {("created",), ("normalized_model",), ("quantized_model", "path"), ("calibration_cache",)}
"""What legitimately differs between a report of the shared run and one of a run of its own: when it was made
and where its files are (each report keeps its own ``<stem>_files/``; the runs here have calibration caches
of their own: the same file name, the same key, in other folders)."""


def _transformer_args(*extra: str) -> list[str]:
    """``analyze`` of the transformer fixture on a part of its data, in small batches (several chunks and
    batches), with evaluation data, the fake-quant view and the per-sample drill-down."""
    base = fixture_path("transformer")
    return [
        "analyze", str(base / "model.onnx"), "--calib", str(base / "calib.npz"), "--eval", str(base / "eval.npz"),
        "--max-samples", "48", "--batch-size", "16", "--fakequant-samples", "16", "--flip-details", "2", "-q",
        *extra,
    ]


def _same(a: Any, b: Any, where: tuple = ()) -> list[str]:
    """Where two loaded reports differ beyond float tolerance (``DIFFERS`` left out)."""
    if where in DIFFERS:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{'/'.join(map(str, where))}: keys {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in _same(a[k], b[k], (*where, k))]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{'/'.join(map(str, where))}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _same(x, y, (*where, i))]
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        if math.isnan(a) and math.isnan(b) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9):
            return []
    elif a == b:
        return []
    return [f"{'/'.join(map(str, where))}: {a!r} vs {b!r}"]


def test_each_report_of_a_shared_run_is_the_report_of_its_own_run(tmp_path, monkeypatch, capsys):
    """Three methods in one run against each in a run of its own (each with a calibration cache of its own,
    so that both calibrate): every tensor's and node's numbers, the notes, the task metric and the
    per-sample section are the same; only the time stamp and the paths differ. The quantized models are
    byte for byte the same, and stderr says which stages ran once."""
    for method in METHODS:
        monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / f"cache-{method}"))
        assert main(_transformer_args("--method", method, "-o", str(tmp_path / f"alone.{method}.json"))) == 0
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / "cache-shared"))
    capsys.readouterr()
    args = [a for a in _transformer_args("--method", ",".join(METHODS), "-o", str(tmp_path / "r.json")) if a != "-q"]
    assert main(args) == 0
    captured = capsys.readouterr()
    compared = 0
    for method in METHODS:
        alone = json.loads((tmp_path / f"alone.{method}.json").read_text())
        shared = json.loads((tmp_path / f"r.{method}.json").read_text())
        assert _same(alone, shared) == [], method
        assert alone["config"]["method"] == shared["config"]["method"] == method
        assert alone["quantized_model"]["sha256"] == shared["quantized_model"]["sha256"]
        assert Path(alone["calibration_cache"]).name == Path(shared["calibration_cache"]).name
        assert shared["per_sample"] is not None and shared["task"]["data"] == "eval"
        compared += len(shared["tensors"])
        assert (tmp_path / f"r.{method}_files" / "quantized.onnx").is_file()
        assert (tmp_path / f"r.{method}_files" / "normalized.onnx").read_bytes() == (
            tmp_path / f"alone.{method}_files" / "normalized.onnx"
        ).read_bytes()
    assert compared > 150
    err = captured.err
    assert "shared by the 3 methods, run once: the model loaded and normalized, the data opened" in err
    assert "run once: the FP32 outputs of the 500 evaluation samples" in err
    assert "run once: the FP32 side of the capture (the reference's reductions), recorded" in err
    assert err.count("capture: its FP32 side read back from the first method's capture") == 2
    assert [line for line in err.splitlines() if line.startswith("method ")] == [
        "method minmax (1/3)", "method entropy (2/3)", "method percentile (3/3)"
    ]
    assert "biggest margin first" in captured.out  # the per-tensor best-method table
    capsys.readouterr()
    assert main(_transformer_args("--method", ",".join(METHODS), "-o", str(tmp_path / "q.json"))) == 0
    quiet = capsys.readouterr().err.splitlines()  # -q: which method runs and where its report went, only
    assert quiet == [line for m in METHODS for line in (f"method {m} ({METHODS.index(m) + 1}/3)",
                                                        f"report written to {tmp_path / f'q.{m}.json'}")]


def test_what_the_methods_share_runs_once(tmp_path, monkeypatch):
    """One load and normalization, one FP32 pass over the evaluation data, three calibrations (one per
    method), and the reference's reductions in the first method's merged models only: the next methods'
    merged models have no ``ref`` outputs and fewer nodes. Their capture sessions are opened once each
    (the first method's fake-quant session is reopened after its first run sized the chunks)."""
    counts = {"load": 0, "evaluator": 0, "calibrate": []}
    load, evaluator, calibrate = prepare.load_model, pipeline.Evaluator, prepare.calibrate
    built: list[tuple[bool, int, int]] = []
    sessions: list[int | None] = []
    build, make = graph_engine.build_reduction_model, graph_engine.make_session

    def counted_load(*a, **k):
        counts["load"] += 1
        return load(*a, **k)

    class CountedEvaluator(evaluator):
        def __init__(self, *a, **k):
            counts["evaluator"] += 1
            super().__init__(*a, **k)

    def counted_calibrate(*a, **k):
        counts["calibrate"].append(a[3])
        return calibrate(*a, **k)

    def spy_build(*a, **k):
        model = build(*a, **k)
        refs = sum(1 for o in model.model.graph.output if o.name.startswith("qdbg/ref/"))
        built.append((k.get("reference", True), refs, len(model.model.graph.node)))
        return model

    def spy_make(path, config, **k):
        sessions.append(k.get("threads"))
        return make(path, config, **k)

    monkeypatch.setattr(prepare, "load_model", counted_load)
    monkeypatch.setattr(pipeline, "Evaluator", CountedEvaluator)
    monkeypatch.setattr(prepare, "calibrate", counted_calibrate)
    monkeypatch.setattr(graph_engine, "build_reduction_model", spy_build)
    monkeypatch.setattr(graph_engine, "make_session", spy_make)
    # two capture workers, so that the first run sizes the chunks and turns them into one (the fixture's
    # runs are too small for two), whatever the machine's cores
    assert main(_transformer_args("--method", ",".join(METHODS), "--threads", "2", "-o", str(tmp_path / "r.json"))) == 0
    assert counts["load"] == 1 and counts["evaluator"] == 1
    assert counts["calibrate"] == list(METHODS)
    assert [b[0] for b in built] == [True, True, False, False, False, False]  # (main, fake-quant) per method
    first_main, first_fq = built[0], built[1]
    for main_model, fq_model in (built[2:4], built[4:6]):
        assert main_model[1] == fq_model[1] == 0  # no reference reductions of their own
        assert main_model[2] < 0.8 * first_main[2] and fq_model[2] < first_fq[2]
    assert first_main[1] > 0 and first_fq[1] > 0
    # the first fake-quant session single-threaded (then reopened with ORT's threads, or kept where that would
    # cost more than its rows win back: timed), every later session opened once, settled
    assert sessions in ([1, None, None, None, None, None, None], [1, None, None, None, None, None])


def test_a_capture_whose_data_is_not_the_recorded_one_is_measured_in_full(tmp_path):
    """The reference read back only where each chunk's feeds are the recorded ones: a capture of other data
    (here: other calibration samples, as a data hook that yields other samples would give) is measured
    in full, and gives the numbers of a capture without sharing; one of the same data reads it back and
    gives them too."""
    base = fixture_path("transformer")
    report = _report(tmp_path)
    fp32 = onnx.load(report.normalized_model)
    qdq = onnx.load(report.quantized_model.path)
    pairing = pair_models(fp32, qdq)
    specs = model_input_specs(fp32)
    rng = np.random.default_rng(0)
    other = tmp_path / "other.npz"
    np.savez(other, input=rng.normal(0, 1, (32, 8, 8)).astype(np.float32))
    config = SessionConfig()

    def measured(source: Path, shared: SharedReference | None):
        data = open_data(source, specs, batch_size=16, max_samples=32)
        return measure_layers(fp32, qdq, pairing, data, config, fakequant_samples=16, shared=shared)

    shared = SharedReference()
    first = measured(base / "calib.npz", shared)
    assert shared.complete and shared.replayed == 0
    again = measured(base / "calib.npz", shared)
    assert shared.replayed == 1 and again.tensors == first.tensors
    elsewhere = measured(other, shared)
    assert shared.refused == 1 and shared.replayed == 1
    assert elsewhere.tensors == measured(other, None).tensors
    assert elsewhere.tensors != first.tensors


def test_a_capture_of_another_model_tensors_or_data_length_is_measured_in_full(tmp_path):
    """The reference is read back only for the recorded FP32 proto, the recorded scored tensors and as
    many chunks: a capture of an FP32 model with other weights (same tensor names), of fewer tensors, or of
    more or fewer samples than recorded gives the numbers of a capture without sharing."""
    import dataclasses

    from onnx import numpy_helper

    base = fixture_path("transformer")
    report = _report(tmp_path)
    fp32 = onnx.load(report.normalized_model)
    qdq = onnx.load(report.quantized_model.path)
    pairing = pair_models(fp32, qdq)
    specs = model_input_specs(fp32)
    config = SessionConfig()

    def measured(model, pairs, samples: int, shared: SharedReference | None):
        data = open_data(base / "calib.npz", specs, batch_size=16, max_samples=samples)
        return measure_layers(model, qdq, pairs, data, config, fakequant_samples=16, shared=shared).tensors

    def recorded() -> SharedReference:
        shared = SharedReference()
        measured(fp32, pairing, 32, shared)
        assert shared.complete
        return shared

    other = onnx.ModelProto()
    other.CopyFrom(fp32)
    weight = next(i for i in other.graph.initializer if len(i.dims) == 2)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 1.5, weight.name))
    fewer_tensors = dataclasses.replace(pairing, tensors=pairing.tensors[::2])
    for model, pairs, samples in ((other, pairing, 32), (fp32, fewer_tensors, 32), (fp32, pairing, 48)):
        shared = recorded()
        assert measured(model, pairs, samples, shared) == measured(model, pairs, samples, None)
        assert shared.replayed == 0
    shared = recorded()
    assert measured(fp32, pairing, 16, shared) == measured(fp32, pairing, 16, None)
    assert (shared.replayed, shared.refused) == (0, 1)  # one chunk of the two recorded: not read back


def test_an_unwritable_report_of_a_later_method_fails_before_any_work(tmp_path):
    """Every method's report path is checked first: the second one's being a directory fails at once,
    leaving no report of the first method either."""
    (tmp_path / "r.entropy.json").mkdir()
    args = _transformer_args("--method", "minmax,entropy", "-o", str(tmp_path / "r.json"))
    assert main(args) == ExitCode.OUTPUT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.entropy.json"]


def test_a_method_that_fails_leaves_the_reports_before_it_whole_and_nothing_of_its_own(tmp_path, monkeypatch):
    """As when each method ran on its own: the reports written before the failure stay, whole; the failing
    method leaves neither its report nor its ``_files/``; the next methods do not run."""

    def failing(*a, **k):
        if a[3] == "entropy":
            raise QDebugError("calibration failed (planted)", "none", ExitCode.MODEL)
        return calibrate(*a, **k)

    calibrate = prepare.calibrate
    monkeypatch.setattr(prepare, "calibrate", failing)
    assert main(_transformer_args("--method", ",".join(METHODS), "-o", str(tmp_path / "r.json"))) == ExitCode.MODEL
    assert load_report(tmp_path / "r.minmax.json").config.method == "minmax"
    assert (tmp_path / "r.minmax_files" / "quantized.onnx").is_file()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if "entropy" in p.name or "percentile" in p.name)
    assert leftovers == []


def _report(tmp_path: Path):
    out = tmp_path / "base.json"
    assert main(_transformer_args("--method", "minmax", "-o", str(out))) == 0
    return load_report(out)
