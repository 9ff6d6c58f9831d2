"""Contracts of pipeline._quantizer_faults_named: the quantizer is named only for a model qdebug
built, only when the capture failed with ExitCode.MODEL, and only for qdebug's own errors."""

from __future__ import annotations

import pytest

import qdebug.pipeline as pipeline
import qdebug.quant.quantize as quantize
from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from tests.conftest import FIXTURES

CNN = FIXTURES / "cnn"
QUANTIZER_FAULT = "ONNX Runtime's quantizer wrote a model"


@pytest.fixture
def capture_fails(monkeypatch):
    """The capture raises what the test sets; ORT's trial load (faked) refuses any QDQ model and records
    every model it is asked about."""
    trials: list = []

    def fake_load_error(model):
        trials.append(model)
        return "fake: cannot load" if any(n.op_type == "DequantizeLinear" for n in model.graph.node) else None

    raised: list = []

    def failing_capture(*args, **kwargs):
        raise raised[0]

    monkeypatch.setattr(quantize, "_ort_load_error", fake_load_error)
    monkeypatch.setattr(pipeline, "measure_layers", failing_capture)
    return trials, raised


def _analyze(tmp_path, *extra):
    return ["analyze", str(CNN / "model.onnx"), "--calib", str(CNN / "calib.npz"), "-o", str(tmp_path / "r.json"),
            "-q", "--no-cache", *extra]  # fmt: skip


def test_the_users_own_quantized_model_is_never_blamed_on_the_quantizer(tmp_path, capture_fails, capsys):
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quant.quantize import QuantSpec, quantize_static_model

    (tmp_path / "w").mkdir()
    prep = prepare(CNN / "model.onnx", CNN / "calib.npz", tmp_path / "w", AnalyzeOptions(use_cache=False))
    users = tmp_path / "users_q.onnx"
    quantize_static_model(prep.normalized, prep.ranges, QuantSpec(), users, load_check=False)
    trials, raised = capture_fails
    trials.clear()
    raised.append(QDebugError("ONNX Runtime cannot load the instrumented model", "", ExitCode.MODEL))
    code = main(_analyze(tmp_path, "--quantized", str(users)))
    err = capsys.readouterr().err
    assert code == ExitCode.MODEL
    assert "cannot load the instrumented model" in err and QUANTIZER_FAULT not in err
    assert trials == []  # no diagnosis: qdebug did not build that model


def test_a_capture_failing_on_the_data_is_reported_as_is_without_a_trial_load(tmp_path, capture_fails, capsys):
    trials, raised = capture_fails
    raised.append(QDebugError("calibration input x has the wrong shape", "", ExitCode.DATA))
    code = main(_analyze(tmp_path))
    err = capsys.readouterr().err
    assert code == ExitCode.DATA and "wrong shape" in err and QUANTIZER_FAULT not in err
    assert trials == []


def test_an_unexpected_exception_in_the_capture_is_not_turned_into_the_quantizers_fault(tmp_path, capture_fails):
    trials, raised = capture_fails
    raised.append(RuntimeError("a bug in the capture"))
    try:
        main(_analyze(tmp_path))
    except RuntimeError:
        pass
    assert trials == []


def test_a_built_model_ort_refuses_in_the_capture_is_named_as_the_quantizers(tmp_path, capture_fails, capsys):
    """The positive case, with the same fake: the diagnosis runs and names the quantizer."""
    trials, raised = capture_fails
    raised.append(QDebugError("ONNX Runtime cannot load the instrumented model", "", ExitCode.MODEL))
    code = main(_analyze(tmp_path))
    err = capsys.readouterr().err
    assert code == ExitCode.MODEL and QUANTIZER_FAULT in err
    assert len(trials) == 2  # the quantized model, then the FP32 one


def _quantized_sessions(monkeypatch) -> list[str]:
    """Every optimized session analyze opens over the plain quantized model (what each was for)."""
    import qdebug.evaluation.evaluate as evaluate
    import qdebug.runtime.capture as capture

    opened: list[str] = []
    real = capture.make_session

    def spy(model, config, *, what="model", fake_quant=False, optimize=True, **kwargs):
        if what == "quantized model" and not fake_quant and optimize:
            opened.append(what)
        return real(model, config, what=what, fake_quant=fake_quant, optimize=optimize, **kwargs)

    for module in (capture, evaluate, pipeline):
        monkeypatch.setattr(module, "make_session", spy)
    return opened


def test_the_capture_check_and_the_evaluation_share_one_session_of_the_quantized_model(tmp_path, monkeypatch):
    import json

    opened = _quantized_sessions(monkeypatch)
    assert main(_analyze(tmp_path, "--eval", str(CNN / "eval.npz"), "--flip-details", "0")) == 0
    assert opened == ["quantized model"]  # the check's, scored on: not one for each
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["deployed_gap"] == 0.0 and report["task"]["data"] == "eval" and report["task"]["samples"] == 500
    opened.clear()
    assert main(_analyze(tmp_path)) == 0  # no evaluation data: the check opens its own, as before
    assert opened == ["quantized model"]
