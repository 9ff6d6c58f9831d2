"""Known-answer checks on the committed fixtures, and what analyze says about them."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from qdebug.cli.analyze import rank_nodes
from qdebug.cli.main import main
from qdebug.output.report_io import load_report
from tests.conftest import FIXTURES, analyze_args, fixture_path


def _manifest() -> dict:
    return json.loads(fixture_path("manifest.json").read_text())


def test_fixture_known_answers_hold():
    """The generator's --check: accuracies under ORT match the manifest (no torch needed)."""
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_fixtures"] = module  # dataclasses need their module registered
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("make_fixtures", None)
    failures = module.check()
    assert failures == []


@pytest.fixture(scope="module")
def transformer_report(tmp_path_factory):
    base = fixture_path("transformer")
    out = tmp_path_factory.mktemp("tr") / "report.json"
    code = main(
        [
            "analyze",
            str(base / "model.onnx"),
            "--calib",
            str(base / "calib.npz"),
            "--eval",
            str(base / "eval.npz"),
            "-o",
            str(out),
            "-q",
        ]
    )
    assert code == 0
    return load_report(out)


def test_transformer_report_shows_the_drop(transformer_report):
    task = transformer_report.task
    assert task.name == "top1" and task.data == "eval" and task.samples == 500
    expected = _manifest()["fixtures"]["transformer"]
    assert task.fp32 == pytest.approx(expected["fp32_top1"], abs=0.005)
    assert task.fp32 - task.quantized >= 0.05
    # the drop comes from the quantization parameters, not from the kernels: fake-quant agrees
    assert abs(task.quantized_fakequant - task.quantized) <= 0.02


def test_transformer_responsible_nodes_rank_at_the_top(transformer_report):
    """The nodes the generator needs to keep FP32 to recover are among the worst-ranked."""
    responsible = set(_manifest()["fixtures"]["transformer"]["selective"]["nodes_to_exclude"])
    top = [n.name for n in rank_nodes(transformer_report)[:5]]
    assert len(responsible & set(top)) >= 2, top
    by_introduced = sorted(
        (n for n in transformer_report.nodes if math.isfinite(n.introduced_db)),
        key=lambda n: -n.introduced_db,
    )
    assert by_introduced[0].name in responsible
    # the outlier residual stream has the worst local SQNR of all quantized activations
    local = sorted(
        (t for t in transformer_report.tensors if t.local is not None and math.isfinite(t.local.sqnr_db)),
        key=lambda t: t.local.sqnr_db,
    )
    assert local[0].producer in responsible


def test_graph_and_numpy_engines_agree(tmp_path):
    reports = {}
    for engine in ("graph", "numpy"):
        out = tmp_path / f"{engine}.json"
        assert main(analyze_args("transformer", out, "--engine", engine, "--max-samples", "48")) == 0
        reports[engine] = load_report(out)
    g, n = reports["graph"], reports["numpy"]
    assert not any("numpy engine" in note for note in g.notes)
    compared = 0
    for tg in g.tensors:
        tn = n.tensor(tg.name)
        for a, b in (
            (tg.accumulated, tn.accumulated),
            (tg.local, tn.local),
            (tg.accumulated_fakequant, tn.accumulated_fakequant),
        ):
            assert (a is None) == (b is None), tg.name
            if a is None or not math.isfinite(b.sqnr_db):
                continue
            assert a.sqnr_db == pytest.approx(b.sqnr_db, abs=0.02), tg.name
            assert a.max_abs == pytest.approx(b.max_abs, rel=1e-4, abs=1e-6), tg.name
            assert a.cosine == pytest.approx(b.cosine, abs=1e-4), tg.name
            assert a.count == b.count
            compared += 1
        assert tg.summary.min == pytest.approx(tn.summary.min, rel=1e-6, abs=1e-6)
        assert tg.summary.mean == pytest.approx(tn.summary.mean, rel=1e-3, abs=1e-4)
        assert tg.summary.std == pytest.approx(tn.summary.std, rel=1e-3, abs=1e-4)
    assert compared > 100


def test_cnn_fixture_quantizes_without_loss(tmp_path):
    base = fixture_path("cnn")
    out = tmp_path / "cnn.json"
    assert (
        main(
            [
                "analyze",
                str(base / "model.onnx"),
                "--calib",
                str(base / "calib.npz"),
                "--eval",
                str(base / "eval.npz"),
                "-o",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    report = load_report(out)
    assert abs(report.task.fp32 - report.task.quantized) <= 0.02
    assert {n.op_type for n in report.nodes} >= {"Conv", "BatchNormalization", "Relu", "Add", "Gemm"}
    assert report.weights and all(w.error.sqnr_db > 20 for w in report.weights if w.quant.qtype == "int8")
