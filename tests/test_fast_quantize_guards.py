"""What holds on every onnxruntime / onnx release, verified or not (tests/test_fast_quantize.py proves the fast
path itself, on the verified release only): a changed upstream source gives ORT's plain model with one quiet
note and no warning; ORT's functions and methods are put back after the blocks that swap them, whatever
happens inside and in whatever order threads leave them; a private ORT name gone from a release leaves
``import qdebug...`` working, on the plain path; the ORT calls whose signatures changed across the supported
range take the arguments each release accepts; a too-old release is refused in one line at start.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import onnx
import pytest
from onnxruntime.quantization import calibrate as ort_calibrate
from onnxruntime.quantization import quant_utils

from qdebug import versions
from qdebug.errors import ExitCode, QDebugError
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant import fast_quantize
from qdebug.quant.quantize import QuantSpec, quantize_dynamic_model, quantize_static_model, updated_opset
from tests.conftest import FIXTURES, ROOT

CNN = FIXTURES / "cnn"


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """No note, reason or digest carried over from another test (each is kept once per process)."""
    monkeypatch.setattr(fast_quantize, "_NOTES", [])
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    monkeypatch.delenv(fast_quantize.PLAIN_ENV, raising=False)


def _upstream_changed(monkeypatch, label: str = "ONNXModel.replace_input_of_all_nodes") -> None:
    """What an upstream release changing one verified function looks like to qdebug."""
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", dict(fast_quantize.VERIFIED_SOURCES, **{label: "0" * 16}))


def test_a_changed_upstream_source_gives_orts_plain_model_and_one_quiet_note(tmp_path, monkeypatch, recwarn):
    prep = prepare(CNN / "model.onnx", CNN / "calib.npz", tmp_path, AnalyzeOptions(use_cache=False))
    with fast_quantize.plain_path():
        plain = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True))
        plain_dynamic = quantize_dynamic_model(prep.normalized_path, tmp_path / "plain.dyn.onnx")
    _upstream_changed(monkeypatch)
    built = [quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True)) for _ in range(2)]
    dynamic = quantize_dynamic_model(prep.normalized_path, tmp_path / "dyn.onnx")
    for model in built:
        assert model.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    assert (tmp_path / "dyn.onnx").read_bytes() == (tmp_path / "plain.dyn.onnx").read_bytes()
    assert dynamic.SerializeToString(deterministic=True) == plain_dynamic.SerializeToString(deterministic=True)
    assert fast_quantize.notes() == (fast_quantize.fallback_note(),)
    assert not [w for w in recwarn if "quantiz" in str(w.message).lower()], [str(w.message) for w in recwarn]
    (line,) = fast_quantize.notes()
    assert "\n" not in line and "minutes" in line and "ORT's own quantizer ran" in line
    assert "VERIFIED_SOURCES" not in line and "tests/" not in line and "re-verify" not in line


def test_a_changed_upstream_source_is_one_line_of_each_commands_notes(tmp_path, monkeypatch, capsys):
    """Through the CLI (analyze, propose, verify): the report carries the line once, analyze and verify
    print it once each (propose reads it in the report and does not repeat it), stderr shows no Python
    warning, and the developers' advice appears nowhere."""
    from qdebug.cli.main import main
    from qdebug.output.report_io import load_report

    changed = {"MinMaxCalibrater.augment_graph": "0" * 16, "quant_utils.find_by_name": "0" * 16}
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", dict(fast_quantize.VERIFIED_SOURCES, **changed))
    data = ["--calib", str(CNN / "calib.npz"), "--eval", str(CNN / "eval.npz")]
    report, proposal = tmp_path / "r.json", tmp_path / "p.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        argv = ["analyze", str(CNN / "model.onnx"), *data, "-o", str(report), "-q", "--fakequant-samples", "0"]
        assert main(argv) == 0
        argv = ["propose", str(report), "-o", str(proposal), "-q", "--max-evaluations", "2", "--time-runs", "0"]
        assert main(argv) in (0, 6)
        argv = ["verify", str(CNN / "model.onnx"), *data, "--proposal", str(proposal), "-q", "--runs", "0"]
        assert main(argv) in (0, 6, 8)
    out, err = capsys.readouterr()
    line = fast_quantize.fallback_note()
    assert load_report(report).notes.count(line) == 1
    assert " ".join((out + err).split()).count(line) == 2, out + err  # Rich wraps analyze's summary
    assert "Warning" not in err and "VERIFIED_SOURCES" not in out + err and "test_fast_quantize" not in out + err


def test_the_calibrators_swap_is_put_back_after_an_exception(monkeypatch):
    monkeypatch.setattr(fast_quantize, "use_fast_path", lambda what="quantizer": True)  # the swap, on any ORT
    cls = ort_calibrate.MinMaxCalibrater
    original = cls.__dict__["augment_graph"]
    with pytest.raises(RuntimeError, match="inside"):
        with fast_quantize.fast_calibrator_augmentation():
            assert cls.__dict__["augment_graph"] is fast_quantize._augment_in_scope
            raise RuntimeError("inside")
    assert cls.__dict__["augment_graph"] is original
    assert fast_quantize._AUGMENT_SWAP == []


def test_the_module_functions_swap_is_put_back_after_an_exception():
    modules = fast_quantize._ort_modules()
    before = {(m.__name__, name): getattr(m, name, None) for m in modules for name, _, _ in fast_quantize._swaps()}
    with pytest.raises(RuntimeError, match="inside"):
        with fast_quantize.installed():
            assert quant_utils.find_by_name is fast_quantize.find_by_name
            raise RuntimeError("inside")
    after = {(m.__name__, name): getattr(m, name, None) for m in modules for name, _, _ in fast_quantize._swaps()}
    assert after == before and quant_utils.find_by_name is fast_quantize._PLAIN_FIND_BY_NAME
    assert fast_quantize._DEPTH == [0] and not fast_quantize._ACTIVE


def test_threads_interleaving_the_calibrators_blocks_leave_orts_method_and_only_they_get_the_fast_one(monkeypatch):
    """A opens, B opens, A closes (B still gets the fast augmentation; a thread outside every block gets ORT's),
    B closes: ORT's method is back. Without the lock and the count, B saved A's stand-in as "the original"."""
    monkeypatch.setattr(fast_quantize, "use_fast_path", lambda what="quantizer": True)
    cls = ort_calibrate.MinMaxCalibrater
    calls: list[str] = []

    def orts(self):
        calls.append(f"ort:{self}")

    monkeypatch.setattr(cls, "augment_graph", orts)
    monkeypatch.setattr(fast_quantize, "augment_graph", lambda self: calls.append(f"fast:{self}"))
    a_in, b_in, a_out, b_may_leave = (threading.Event() for _ in range(4))
    errors: list[BaseException] = []

    def a():
        with fast_quantize.fast_calibrator_augmentation():
            a_in.set()
            b_in.wait(10)
            cls.augment_graph("a")
        a_out.set()

    def b():
        a_in.wait(10)
        with fast_quantize.fast_calibrator_augmentation():
            b_in.set()
            a_out.wait(10)
            cls.augment_graph("b")  # still swapped after A left
            outside = threading.Thread(target=lambda: cls.augment_graph("outside"))
            outside.start()
            outside.join(10)
            b_may_leave.wait(10)

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # surfaced below
                errors.append(e)

        return run

    threads = [threading.Thread(target=guarded(f)) for f in (a, b)]
    for t in threads:
        t.start()
    a_out.wait(10)
    b_may_leave.set()
    for t in threads:
        t.join(10)
    assert not errors
    assert calls == ["fast:a", "fast:b", "ort:outside"]
    assert cls.__dict__["augment_graph"] is orts and fast_quantize._AUGMENT_SWAP == []


def test_a_function_missing_from_the_installed_release_counts_as_changed(monkeypatch):
    monkeypatch.setattr(fast_quantize, "_HASHES", {})
    monkeypatch.delattr(quant_utils, "update_opset_version", raising=False)
    assert fast_quantize.current_sources()["quant_utils.update_opset_version"] == "missing"
    assert fast_quantize.fast_path_problem("quantizer") is not None  # it names the first few changed
    assert fast_quantize.verification_gap() is not None
    assert fast_quantize.use_fast_path() is False and fast_quantize.notes() == (fast_quantize.fallback_note(),)


def test_private_ort_names_gone_from_a_release_leave_qdebug_importable_on_the_plain_path(tmp_path):
    """A release without one of the private classes fast_quantize imports (ORT's qdq_quantizer moves them
    now and then): ``import qdebug...`` still works, the fast path is off with the one note, and analyze
    runs to the end on ORT's plain path, no traceback, no warning."""
    code = f"""
import sys, warnings
warnings.simplefilter("error")
import onnxruntime.quantization.qdq_quantizer as q
kept = q.QDQScaleZpInitializers
del q.QDQScaleZpInitializers  # gone while qdebug imports it; ORT's own code needs it back after
from qdebug.quant import fast_quantize as f
q.QDQScaleZpInitializers = kept
assert f._IMPORT_PROBLEM and "QDQScaleZpInitializers" in f._IMPORT_PROBLEM, f._IMPORT_PROBLEM
assert f.use_fast_path() is False and f.use_fast_path("calibrator") is False
assert f.use_fast_path("dynamic quantizer") is False
assert f.notes() == (f.fallback_note(),) and f.verification_gap()
from qdebug.cli.main import main
code = main(["analyze", {str(CNN / "model.onnx")!r}, "--calib", {str(CNN / "calib.npz")!r}, "-o",
             {str(tmp_path / "r.json")!r}, "-q", "--fakequant-samples", "0"])
from qdebug.output.report_io import load_report
assert code == 0, code
assert load_report({str(tmp_path / "r.json")!r}).notes.count(f.fallback_note()) == 1
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "QDEBUG_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr


def test_the_opset_update_takes_the_arguments_each_release_accepts(monkeypatch):
    model = onnx.load(CNN / "model.onnx")
    seen: list[tuple] = []

    def weight_only(model, weight_type):  # ORT 1.24's signature
        seen.append((weight_type,))
        return model

    def full(model, weight_type, activation_type=None, tensor_quant_overrides=None, block_size=0):  # 1.26 on
        seen.append((weight_type, activation_type, tensor_quant_overrides))
        return model

    monkeypatch.setattr(quant_utils, "update_opset_version", weight_only, raising=False)
    assert updated_opset(model, "w", "a", {"t": []}) is model
    monkeypatch.setattr(quant_utils, "update_opset_version", full, raising=False)
    assert updated_opset(model, "w", "a", {"t": []}) is model
    monkeypatch.delattr(quant_utils, "update_opset_version", raising=False)  # ORT 1.20: none
    assert updated_opset(model, "w", "a", {"t": []}) is model
    assert seen == [("w",), ("w", "a", {"t": []})]


def test_the_calibrator_gets_its_providers_with_or_without_the_keyword():
    from qdebug.quant.calibrate import _created_calibrator

    class Calibrator:
        execution_providers = ["CPUExecutionProvider"]

        def set_execution_providers(self, providers):
            self.execution_providers = providers

    def old(model, ops, **kwargs):  # ORT 1.20's create_calibrator: no providers
        assert "providers" not in kwargs
        return Calibrator()

    def new(model, ops, providers=None, **kwargs):
        made = Calibrator()
        made.execution_providers = providers or made.execution_providers
        return made

    wanted = ["FooExecutionProvider", "CPUExecutionProvider"]
    for create in (old, new):
        assert _created_calibrator(create, "m.onnx", [], providers=wanted).execution_providers == wanted
        assert _created_calibrator(create, "m.onnx", [], providers=None).execution_providers == ["CPUExecutionProvider"]


def test_where_orts_conv_integer_lacks_int8_weights_the_dynamic_model_keeps_conv_float(tmp_path, monkeypatch):
    """ORT 1.20 to 1.23 write ConvInteger with int8 weights in quantize_dynamic's default model and have no
    kernel for it: there the dynamic model leaves Conv out (and loads), with a note; elsewhere nothing changes."""
    import onnxruntime as ort

    from qdebug.quant import quantize

    monkeypatch.setattr(quantize, "_CONV_INTEGER_RUNS", [False])
    model = quantize_dynamic_model(CNN / "model.onnx", tmp_path / "d.onnx")
    ops = {n.op_type for n in model.graph.node}
    assert "Conv" in ops and "ConvInteger" not in ops
    ort.InferenceSession(str(tmp_path / "d.onnx"), providers=["CPUExecutionProvider"])
    fp32 = onnx.load(CNN / "model.onnx")
    note = quantize.dynamic_conv_note(fp32)
    assert note is not None and "ConvInteger" in note and "\n" not in note
    assert quantize.dynamic_conv_note(fp32, ("MatMul",)) is None  # the user chose the op types
    monkeypatch.setattr(quantize, "_CONV_INTEGER_RUNS", [True])
    assert quantize.dynamic_conv_note(fp32) is None
    monkeypatch.setattr(quantize, "_CONV_INTEGER_RUNS", [])
    assert quantize.int8_conv_integer_runs() in (True, False)  # asked of the installed ORT


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("1.20.1", (1, 20, 1)),
        ("1.16", (1, 16, 0)),
        ("1.33.0.dev20260101", (1, 33, 0)),
        ("2.0.0rc1", (2, 0, 0)),
        ("x", None),
    ],
)
def test_versions_are_read_as_releases(text, parsed):
    assert versions.parse(text) == parsed


def test_a_release_older_than_the_floor_is_refused_in_one_line(monkeypatch, capsys):
    from qdebug.cli.main import main

    monkeypatch.setitem(versions.MINIMUM, "onnxruntime", (99, 0, 0))
    with pytest.raises(QDebugError) as caught:
        versions.check_installed()
    assert caught.value.code == ExitCode.USAGE
    argv = ["analyze", str(CNN / "model.onnx"), "--calib", str(CNN / "calib.npz"), "-o", "r.json", "-q"]
    assert main(argv) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(
        r"qdebug: error: onnxruntime \S+ is older than 99\.0\.0, .*pip install -U 'onnxruntime>=99\.0\.0'", err
    )
    assert not Path("r.json").exists()
    assert main(["diff", "--help"]) == 0  # the report readers are not refused (they run no ORT)


def test_the_floors_are_pyprojects():
    """pyproject.toml's dependencies declare the releases the version check and docs/versions.md name."""
    text = (ROOT / "pyproject.toml").read_text()
    for name, floor in versions.MINIMUM.items():
        declared = re.search(rf'"{name}>=([0-9.]+)"', text)
        assert declared is not None, name
        assert versions.parse(declared.group(1)) == floor, (name, declared.group(1), floor)
    table = (ROOT / "docs" / "versions.md").read_text()
    assert all(f"{name} >= {'.'.join(map(str, floor))}" in table for name, floor in versions.MINIMUM.items())
