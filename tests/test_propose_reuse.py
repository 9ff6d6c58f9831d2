"""propose takes analyze's static model instead of quantizing it again, only when it is provably the same
(qdebug/propose/reuse.py), and its answer does not change either way."""

from __future__ import annotations

import json
import shutil

import pytest

from qdebug.cli.main import main
from qdebug.output.report_io import load_report
from qdebug.propose import reuse, search
from qdebug.quant import quantize
from tests.conftest import fixture_path


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reuse")
    model = fixture_path("transformer", "model.onnx")
    calib = fixture_path("transformer", "calib.npz")
    out = tmp / "report.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
        assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 0
    return tmp, out


def _propose(report, out, monkeypatch, target: str = "1") -> tuple[dict, list]:
    """propose's proposal (``--target-drop target``), and the specs search.build quantized."""
    built = []
    original = quantize.quantize_model

    def counted(model, ranges, spec, *args, **kwargs):
        built.append(spec)
        return original(model, ranges, spec, *args, **kwargs)

    monkeypatch.setattr(search, "quantize_model", counted)
    argv = ["propose", str(report), "--target-drop", target, "--max-evaluations", "6", "--recipes", "none"]
    code = main([*argv, "-o", str(out), "-q"])
    assert code in (0, 6)
    return json.loads(out.read_text()), built


def _static_builds(built, report) -> int:
    """How many times the report's own static model was quantized."""
    from qdebug.quant.quantize import QuantSpec

    static = QuantSpec.of(load_report(report).config.quant)
    return sum(1 for s in built if s == static)


def test_the_static_model_is_taken_from_analyze_and_the_answer_is_the_same(analyzed, monkeypatch):
    tmp, report = analyzed
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
    reused, built = _propose(report, tmp / "p1.json", monkeypatch)
    assert _static_builds(built, report) == 0
    monkeypatch.setattr(reuse, "analyzed_static", lambda *a: None)
    monkeypatch.setattr("qdebug.propose.run.analyzed_static", lambda *a: None)
    fresh, built = _propose(report, tmp / "p2.json", monkeypatch)
    assert _static_builds(built, report) == 1
    for key in (
        "nodes_to_exclude",
        "tensor_overrides",
        "per_channel",
        "evaluations",
        "expected_metric",
        "static_metric",
    ):
        assert reused[key] == fresh[key], key
    assert [p["metric"] for p in reused["frontier"]] == [p["metric"] for p in fresh["frontier"]]


def test_a_changed_model_file_or_other_ranges_are_not_reused(analyzed, tmp_path, monkeypatch):
    tmp, report = analyzed
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
    loaded = load_report(report)
    files = tmp_path / "report_files"
    shutil.copytree(report.parent / "report_files", files)
    path = files / "quantized.onnx"
    normalized = report.parent / "report_files" / "normalized.onnx"
    from qdebug.quant.calibrate import Ranges
    from qdebug.quant.quantize import QuantSpec

    ranges = Ranges(loaded.config.method, "k", None, None, False)
    monkeypatch.setattr(Ranges, "minmax", lambda self: {n: (lo, hi) for n, lo, hi in loaded.ranges})
    spec = QuantSpec.of(loaded.config.quant)
    import dataclasses

    moved = dataclasses.replace(loaded, quantized_model=dataclasses.replace(loaded.quantized_model, path=str(path)))
    assert reuse.analyzed_static(moved, normalized, ranges, spec) == path.read_bytes()
    path.write_bytes(path.read_bytes() + b"\0")  # edited: no longer the file the report names
    assert reuse.analyzed_static(moved, normalized, ranges, spec) is None
    shutil.copy(report.parent / "report_files" / "quantized.onnx", path)
    assert reuse.analyzed_static(moved, normalized, ranges, dataclasses.replace(spec, per_channel=True)) is None
    first = loaded.ranges[0]
    other = dataclasses.replace(moved, ranges=((first[0], first[1], first[2] * 2), *loaded.ranges[1:]))
    assert reuse.analyzed_static(other, normalized, ranges, spec) is None
    older = dataclasses.replace(moved, ort_version="1.0.0")
    assert reuse.analyzed_static(older, normalized, ranges, spec) is None
    given = dataclasses.replace(moved, config=dataclasses.replace(loaded.config, quantized_given=True))
    assert reuse.analyzed_static(given, normalized, ranges, spec) is None  # the user's --quantized model
    other_model = tmp_path / "normalized.onnx"
    other_model.write_bytes(normalized.read_bytes() + b"\0")  # propose's normalized model is not analyze's
    assert reuse.analyzed_static(moved, other_model, ranges, spec) is None
    assert reuse.analyzed_static(moved, normalized, ranges, spec) == path.read_bytes()  # each check alone


def test_a_static_answer_from_analyzes_model_is_the_proposal_a_fresh_build_gives(analyzed, monkeypatch):
    """A target the static model meets: the answer is the adopted model itself, and the proposal (its nodes,
    per-channel setting, snippet and reasons) is the one a fresh quantization gives."""
    tmp, report = analyzed
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
    reused, built = _propose(report, tmp / "s1.json", monkeypatch, target="100")
    assert _static_builds(built, report) == 0 and reused["nodes_to_exclude"] == []
    monkeypatch.setattr("qdebug.propose.run.analyzed_static", lambda *a: None)
    fresh, built = _propose(report, tmp / "s2.json", monkeypatch, target="100")
    assert _static_builds(built, report) == 1
    for key in ("nodes_to_exclude", "tensor_overrides", "per_channel", "snippet", "reasons", "expected_metric"):
        assert reused[key] == fresh[key], key
