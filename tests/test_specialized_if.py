"""An If specialized on the user's data (issue 35 item 4).

A streaming VAD export takes a scalar ``sr`` (16000 in every sample) and holds its whole network in both
branches of ``If(Equal(sr, 16000))``. ORT's quantizer quantizes no subgraph, so analyze had reported that
nothing was quantized. With ``--inline-constant-if`` the branch that ``sr`` takes in every calibration and
evaluation sample is inlined (one note says so, and that the model is valid for that rate only), the
specialization is recorded in the settings, and propose, verify and bench repeat it and refuse data in
which a sample holds another rate -- before calibrating. Without the flag one note names the If, the input,
its value and the flag. An If whose condition input varies in the data is left alone.
Fixtures: ``tests/streaming_models.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.load import load_model, normalize
from qdebug.output.report_io import dumps, from_jsonable, load_proposal, load_report, to_jsonable
from qdebug.records.report import QuantSettings, SpecializedInput
from qdebug.specialize import DataSource, InputScan
from tests.streaming_models import stream_data, streaming_vad_rate_if

NOTE = (
    "inlined the then_branch of If 'rate_switch' (its condition reads input sr, 16000 in every calibration "
    "and evaluation sample): the quantized model is valid only for sr = 16000"
)
REFUSAL = (
    "qdebug: error: {what} {file} has sr = 8000, but the model was specialized on sr = 16000 when it was "
    "analyzed (--inline-constant-if inlined the branch of If 'rate_switch' that value takes) -- give data "
    "whose sr is 16000 in every sample, or run qdebug analyze on data with sr = 8000 for a model of its own"
)


@pytest.fixture
def vad(tmp_path: Path) -> tuple[Path, Path]:
    """The model switching on ``sr`` and a folder of 12 one-chunk files, all at 16 kHz."""
    model = streaming_vad_rate_if(tmp_path / "vad_rate_if.onnx")
    return model, stream_data(model, tmp_path / "d")


def _with_rate(data: Path, folder: Path, index: int, rate: int = 8000) -> Path:
    """A copy of ``data`` whose file ``index`` holds ``sr = rate``."""
    folder.mkdir()
    for f in sorted(data.glob("*.npz")):
        arrays = dict(np.load(f))
        if f.name == f"chunk_{index:03d}.npz":
            arrays["sr"] = np.array(rate, np.int64)
        np.savez(folder / f.name, **arrays)
    return folder


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([*argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def _main_graph_ops(path: str | Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_an_if_on_an_input_the_data_holds_constant_is_inlined_quantized_and_repeated(
    vad, tmp_path, capsys, monkeypatch
):
    """analyze quantizes the network (Q/DQ in the main graph, records for its nodes) and says so in one
    note; the inlined FP32 model gives the original's outputs; propose and verify repeat the specialization;
    data with one file at 8 kHz is refused by propose, verify and bench with one line, before calibrating."""
    model, data = vad
    report_path, proposal = tmp_path / "r.json", tmp_path / "p.json"
    code, _, err = _run(
        capsys,
        "analyze",
        str(model),
        "--calib",
        str(data),
        "-o",
        str(report_path),
        "--no-cache",
        "--inline-constant-if",
        "-q",
    )
    assert code == 0 and "Traceback" not in err, err
    report = load_report(report_path)
    assert [n for n in report.notes if "rate_switch" in n] == [NOTE]
    assert report.config.quant.specialized_inputs == (SpecializedInput("sr", "16000", "int64", ("rate_switch",)),)
    assert report.nodes and {"Gemm", "MatMul", "Tanh"} <= {n.op_type for n in report.nodes}
    static_ops = _main_graph_ops(report.quantized_model.path)
    assert {"QuantizeLinear", "DequantizeLinear"} <= static_ops and "If" not in static_ops
    normalized_ops = _main_graph_ops(report.normalized_model)
    assert "If" not in normalized_ops and "Equal" not in normalized_ops  # the condition's nodes went with it

    # the inlined FP32 model computes what the user's model does on the data
    original = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    inlined = ort.InferenceSession(report.normalized_model, providers=["CPUExecutionProvider"])
    for f in sorted(data.glob("*.npz")):
        feeds = dict(np.load(f))
        for want, got in zip(original.run(None, feeds), inlined.run(None, feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)

    code, _, err = _run(
        capsys,
        "propose",
        str(report_path),
        "-o",
        str(proposal),
        "-q",
        "--no-cache",
        "--target-sqnr",
        "38",
        "--accept-no-speedup",
    )
    assert code in (0, ExitCode.TARGET_NOT_MET) and "Traceback" not in err, err
    assert load_proposal(proposal).quant.specialized_inputs == report.config.quant.specialized_inputs
    code, _, err = _run(
        capsys,
        "verify",
        str(model),
        "--proposal",
        str(proposal),
        "--calib",
        str(data),
        "--no-cache",
        "--runs",
        "2",
        "--target-sqnr",
        "30",
        "-q",
    )
    assert code in (0, ExitCode.TARGET_NOT_MET) and "Traceback" not in err, err

    # later data with one file at 8 kHz: refused before any calibration runs
    import qdebug.prepare

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before the data's sr was checked")

    monkeypatch.setattr(qdebug.prepare, "calibrate", no_calibration)
    bad = _with_rate(data, tmp_path / "d8", 5)
    chunk = bad / "chunk_005.npz"
    runs = {
        "calibration data": ["propose", str(report_path), "--calib", str(bad), "-o", str(tmp_path / "p2.json")],
        "evaluation data": [
            "verify",
            str(model),
            "--proposal",
            str(proposal),
            "--calib",
            str(data),
            "--eval",
            str(bad),
        ],
    }
    runs["bench"] = [
        "bench",
        str(model),
        "--calib",
        str(bad),
        "--proposal",
        str(proposal),
        "-o",
        str(tmp_path / "b.json"),
    ]
    for what, argv in runs.items():
        code, _, err = _run(capsys, *argv, "-q", "--no-cache")
        expected = REFUSAL.format(what="calibration data" if what == "bench" else what, file=chunk)
        assert code == ExitCode.DATA and err == expected + "\n", (what, err)
    assert not (tmp_path / "p2.json").exists() and not (tmp_path / "b.json").exists()


def test_without_the_flag_one_note_names_the_if_the_input_its_value_and_the_flag(vad, tmp_path, capsys):
    """Nothing is inlined: one note says what the flag would do; the report says nothing was quantized and
    does not call the condition one computed at run time."""
    model, data = vad
    out = tmp_path / "r.json"
    code, printed, err = _run(capsys, "analyze", str(model), "--calib", str(data), "-o", str(out), "--no-cache", "-q")
    assert code == 0 and "Traceback" not in err, err
    # the headline had read "quantized inf dB", a perfect quantization, of a model with nothing quantized
    assert "outputs equal FP32's: nothing in it was quantized" in printed and "inf dB" not in printed.splitlines()[0]
    report = load_report(out)
    named = [n for n in report.notes if "sr, 16000" in n]
    assert named == [
        "the condition of If 'rate_switch' reads only input sr, 16000 in every calibration and evaluation "
        "sample: its branches stay FP32 because ORT quantizes no subgraph; re-run with --inline-constant-if to "
        "inline the then_branch of If 'rate_switch' and quantize it (the quantized model is then valid only "
        "for sr = 16000)"
    ]
    assert report.config.quant.specialized_inputs == ()
    assert "QuantizeLinear" not in _main_graph_ops(report.quantized_model.path)
    assert any("nothing in the main graph was quantized" in n for n in report.notes)
    structure = next(n for n in report.notes if n.startswith("If node rate_switch holds"))
    assert "computed at run time" not in structure and "--inline-constant-if" in structure


def test_an_if_whose_condition_input_varies_is_left_alone(vad, tmp_path, capsys):
    """One evaluation file at 8 kHz: sr is not one value in the data, so the If stays (no specialization,
    no note claiming one), whatever the flag says."""
    model, data = vad
    varied = _with_rate(data, tmp_path / "d8", 7)
    out = tmp_path / "r.json"
    code, _, err = _run(
        capsys,
        "analyze",
        str(model),
        "--calib",
        str(data),
        "--eval",
        str(varied),
        "-o",
        str(out),
        "--no-cache",
        "--inline-constant-if",
        "-q",
    )
    assert code == 0 and "Traceback" not in err, err
    report = load_report(out)
    assert report.config.quant.specialized_inputs == ()
    assert not [n for n in report.notes if "sr, 16000" in n or "inlined the" in n]
    assert "If" in _main_graph_ops(report.normalized_model)


def _nested(path: Path) -> Path:
    """``If(Equal(sr, 16000))`` whose then branch holds ``If(Greater(sr, gate))`` (``gate`` another input)
    around ``y = x * 2``; every else branch gives ``y = x``."""

    def branch(name: str, nodes: list[onnx.NodeProto], out: str) -> onnx.GraphProto:
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2])])

    identity = branch("same", [helper.make_node("Identity", ["x"], ["x_out"], name="keep")], "x_out")
    double = branch("double", [helper.make_node("Mul", ["x", "two"], ["x2"], name="double")], "x2")
    inner = helper.make_node("If", ["open"], ["inner_y"], name="inner", then_branch=double, else_branch=identity)
    then = branch("then", [helper.make_node("Greater", ["sr", "gate"], ["open"], name="gate_open"), inner], "inner_y")
    identity2 = branch("same2", [helper.make_node("Identity", ["x"], ["x_out2"], name="keep2")], "x_out2")
    graph = helper.make_graph(
        [
            helper.make_node("Equal", ["sr", "rate"], ["is_16k"], name="is_16k"),
            helper.make_node("If", ["is_16k"], ["y"], name="outer", then_branch=then, else_branch=identity2),
        ],
        "nested",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
            helper.make_tensor_value_info("gate", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [
            numpy_helper.from_array(np.array(16000, np.int64), "rate"),
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def test_nested_ifs_surface_and_are_decided_by_every_input_their_condition_reads(tmp_path):
    """The inner If surfaces once the outer one is inlined, and is inlined too when ``gate`` holds one value;
    when ``gate`` varies the inner one stays (and no note names it)."""
    loaded = load_model(_nested(tmp_path / "nested.onnx"))
    values = {"sr": np.array(16000, np.int64), "gate": np.array(8000, np.int64)}
    asked: list[str] = []

    def value(name: str) -> np.ndarray | None:
        asked.append(name)
        return values.get(name)

    norm = normalize(loaded, inline_constant_if=True, input_value=value)
    assert [(d.node, d.branch, d.inlined) for d in norm.data_ifs] == [
        ("outer", "then_branch", True),
        ("inner", "then_branch", True),
    ]
    assert [n.op_type for n in norm.proto.graph.node] == ["Mul"] and asked == ["sr", "sr", "gate"]
    x = np.array([1.5, -2.0], np.float32)
    feeds = {"x": x, **values}
    got = ort.InferenceSession(norm.proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(got[0], x * 2)
    notes = [n for n in norm.notes if "inlined the" in n]
    assert notes == [
        "inlined the then_branch of If 'outer' and the then_branch of If 'inner' (their conditions read inputs "
        "sr and gate, 16000 and 8000 in every calibration and evaluation sample): the quantized model is valid "
        "only for sr = 16000 and gate = 8000"
    ]

    del values["gate"]  # gate varies: the inner If is left as it is
    norm = normalize(loaded, inline_constant_if=True, input_value=value)
    assert [(d.node, d.inlined) for d in norm.data_ifs] == [("outer", True)]
    assert [n.op_type for n in norm.proto.graph.node] == ["Greater", "If"]
    assert not any("gate" in n for n in norm.notes)


def test_the_scan_reads_the_samples_the_command_reads(vad, tmp_path):
    """Only the samples counted (``--max-samples``) decide, in calibration and evaluation data alike; a
    batched input never qualifies; a recorded value the data contradicts is refused with its file."""
    model, data = vad
    proto = onnx.load(str(model))
    late = _with_rate(data, tmp_path / "late", 9)
    assert InputScan(proto, [DataSource("calibration data", late, 6)]).value("sr") == 16000
    assert InputScan(proto, [DataSource("calibration data", late)]).value("sr") is None
    both = [DataSource("calibration data", data), DataSource("evaluation data", late, 6, "--eval-max-samples")]
    assert InputScan(proto, both).value("sr") == 16000
    assert InputScan(proto, [DataSource("calibration data", data)]).value("state") is None
    with pytest.raises(QDebugError) as e:
        InputScan(proto, [DataSource("evaluation data", late)]).require(
            SpecializedInput("sr", "16000", "int64", ("rate_switch",))
        )
    assert e.value.code == ExitCode.DATA and "late/chunk_009.npz has sr = 8000" in e.value.one_line()


def test_settings_recorded_before_the_specialization_still_load():
    """Older reports and proposals have no ``specialized_inputs``: they load with none; new ones round-trip."""
    settings = QuantSettings(inline_constant_if=True)
    old = {k: v for k, v in to_jsonable(settings).items() if k != "specialized_inputs"}
    assert from_jsonable(QuantSettings, old) == settings
    new = dataclasses.replace(settings, specialized_inputs=(SpecializedInput("sr", "16000", "int64", ("rs",)),))
    assert from_jsonable(QuantSettings, to_jsonable(new)) == new and '"specialized_inputs"' in dumps(new)
