"""Recurrent and dynamic-shape exports end to end (issue 16 item 4): what stays float and how much of the
model that is, the kernel gap's fixes, and a model ORT's symbolic shape inference cannot read.

Fixtures from ``tests/recurrent_models.py``; every command runs through the real CLI, writing under
``tmp_path`` only.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from qdebug.analysis.notes import (
    FLOAT_WEIGHTS_START,
    KERNEL_GAP_START,
    RECURRENT_START,
    float_size_note,
    kernel_gap_notes,
)
from qdebug.cli.main import main
from qdebug.graph.load import load_model, weight_bytes
from qdebug.output.report_io import dumps, load_bench, load_report
from qdebug.records import SCHEMA_VERSION, ErrorStats, Proposal, TensorRecord
from tests.kernels import u8s8_saturates
from tests.recurrent_models import (
    CONCAT_NODE,
    FUSED_ACTIVATION,
    LSTM_NODE,
    MOBILENET_WEIGHTED,
    cnn_lstm_reader,
    concat_axis_mobilenet,
)

LSTM_BYTES = (128 * 64 + 128 * 32 + 256) * 4
"""W [1, 128, 64], R [1, 128, 32] and B [1, 256] of the reader's LSTM, float32: 49.0 KiB."""
READER_BYTES = (32 * 9 + 32 + 32 * 32 * 9 + 32 + 32 * 40 + 40) * 4 + LSTM_BYTES + 3 * 8
"""Every weight of the reader, its int64 Reshape target included: 91.6 KiB."""


def _run(argv: list[str | Path], capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def reader(tmp_path):
    return cnn_lstm_reader(tmp_path / "reader")


def _analyze(model: Path, data: Path, out: Path, capsys, *extra: str):
    code, stdout, err = _run(["analyze", model, "--calib", data, "-o", out, "-q", *extra], capsys)
    assert code == 0, err
    return load_report(out), stdout


# --- the float LSTM and its share of the weights ----------------------------------------------------


def test_weight_bytes_split_float_from_quantized_weights(reader):
    model, _ = reader
    w = weight_bytes(onnx.load(str(model)))
    assert w.total == READER_BYTES and w.floating == READER_BYTES - 24  # the int64 shape is no float weight
    assert w.by_node[0] == (LSTM_NODE, "LSTM", LSTM_BYTES) and w.of(LSTM_NODE) == LSTM_BYTES


def test_analyze_says_the_lstm_stays_fp32_with_its_share_of_the_weights(reader, tmp_path, capsys):
    model, data = reader
    report, stdout = _analyze(model, data, tmp_path / "r.json", capsys)
    assert not report.node(LSTM_NODE).quantized
    (note,) = [n for n in report.notes if n.startswith(RECURRENT_START)]
    assert f"{LSTM_NODE} (LSTM) stay FP32 and keep 49.0 KiB of the model's 91.6 KiB of weights float (54%" in note
    qdq = weight_bytes(onnx.load(report.quantized_model.path))
    assert qdq.of(LSTM_NODE) == LSTM_BYTES  # the LSTM's weights are in the quantized model as they were
    assert "49.0 KiB of them float" in note and "ORT's static quantizer does not quantize" in note
    # the summary says it next to the metric, before the table of worst nodes
    assert stdout.index(f"note: {RECURRENT_START}") < stdout.index("worst ")
    assert not any(n.startswith(FLOAT_WEIGHTS_START) for n in report.notes)  # nothing else big stays float


def test_per_channel_reader_has_no_kernel_gap_on_a_vnni_cpu(reader, tmp_path, capsys):
    """On a CPU with VNNI the u8s8 kernels do not saturate: the kernel-gap note stays silent (it had been
    the user's only pointer on a CPU without VNNI, where per-channel lost 0.81 -> 0.26)."""
    if u8s8_saturates():  # asked of the kernels, not of /proc/cpuinfo (tests/kernels.py says why)
        pytest.skip("this machine's u8s8 kernels saturate (x86 without VNNI): a kernel gap may be real here")
    model, data = reader
    report, _ = _analyze(model, data, tmp_path / "r.json", capsys, "--per-channel")
    assert not any(n.startswith(KERNEL_GAP_START) for n in report.notes)
    assert report.task.quantized == pytest.approx(report.task.quantized_same_samples)
    assert abs(report.task.quantized_fakequant - report.task.quantized_same_samples) < 0.5  # dB: no gap


def _gap_tensor(fakequant: float, deployed: float) -> TensorRecord:
    def stats(sqnr: float) -> ErrorStats:
        return ErrorStats(sqnr_db=sqnr, mse=1e-3, cosine=0.99, max_abs=0.1, kl=0.0, count=64)

    return TensorRecord(
        name="c2",
        producer="conv_2",
        consumers=("relu_2",),
        depth=2,
        summary=None,
        quant=None,
        local=None,
        accumulated=stats(deployed),
        histogram=None,
        accumulated_fakequant=stats(fakequant),
    )


def test_the_kernel_gap_note_names_the_fixes_that_keep_int8():
    (note,) = kernel_gap_notes((_gap_tensor(38.0, 12.0),))
    assert note.startswith(KERNEL_GAP_START) and "c2 (from conv_2): 12.0 dB deployed vs 38.0 dB fake-quant" in note
    assert "--weight-type QUInt8 (U8U8" in note and "reduce_range" in note and "--allow reduce-range" in note
    assert "ORT's documented U8S8 saturation" in note and "keep conv_2 out of INT8" in note
    assert kernel_gap_notes((_gap_tensor(38.0, 37.5),)) == []  # no gap, no note


def test_float_size_note_only_where_float_weights_dominate():
    from qdebug.graph.load import WeightBytes

    lstm = WeightBytes(total=54_000_000, floating=26_000_000, by_node=((LSTM_NODE, "LSTM", 26_000_000),))
    note = float_size_note(lstm)
    assert note is not None and note.startswith("24.80 MiB of its 51.50 MiB of weights stay float (48%)")
    assert f"{LSTM_NODE} (LSTM, 24.80 MiB)" in note and "does not quantize LSTM" in note
    assert float_size_note(WeightBytes(total=54_000_000, floating=1_000_000)) is None


def _empty_proposal(model: Path, out: Path) -> Path:
    """A proposal that keeps nothing FP32: verify's selective column is the static model again."""
    proposal = Proposal(SCHEMA_VERSION, "proposal", str(model), load_model(model).sha256, "", ())
    out.write_text(dumps(proposal))
    return out


def test_verify_and_bench_say_how_much_of_each_size_is_float(reader, tmp_path, capsys):
    model, data = reader
    proposal = _empty_proposal(model, tmp_path / "p.json")
    out = tmp_path / "v.json"
    argv = ["verify", model, "--calib", data, "--proposal", proposal, "-o", out, "-q", "--runs", "2"]
    code, stdout, err = _run([*argv, "--target-sqnr", "20"], capsys)
    assert code == 0, err
    v = {c["name"]: c for c in json.loads(out.read_text())["variants"]}
    assert v["fp32"]["float_weight_bytes"] == READER_BYTES - 24 and v["fp32"]["weight_bytes"] == READER_BYTES
    assert v["static"]["float_weight_bytes"] == LSTM_BYTES  # only the LSTM stays float
    assert v["static"]["weight_bytes"] < v["fp32"]["weight_bytes"]
    row = next(line for line in stdout.splitlines() if line.startswith("float weights"))
    assert "(100%)" in row and "49.0 KiB (8" in row  # 50,176 B of the static model's weights
    assert "note: static: 49.0 KiB of its" in stdout and f"{LSTM_NODE} (LSTM, 49.0 KiB)" in stdout

    bench = tmp_path / "b.json"
    bargv = ["bench", model, "--calib", data, "-o", bench, "-q", "--runs", "2", "--variants", "fp32,static,dynamic"]
    code, stdout, err = _run(bargv, capsys)
    assert code == 0, err
    b = {x.name: x for x in load_bench(bench).variants}
    assert b["static"].float_weight_bytes == LSTM_BYTES and b["fp32"].float_weight_bytes == READER_BYTES - 24
    assert b["dynamic"].float_weight_bytes < LSTM_BYTES / 10  # quantize_dynamic's LSTM has int8 weights
    assert any("49.0 KiB of its" in n and "LSTM" in n for n in b["static"].notes)
    assert not any("stay float" in n for n in b["dynamic"].notes)
    assert "float wts" in stdout and "49.0 KiB 8" in stdout  # KiB, as verify prints it
    _older_files_still_load(out, bench, tmp_path)


def _older_files_still_load(verify_json: Path, bench_json: Path, tmp_path: Path) -> None:
    """A verify.json and a bench.json written before the float-weight fields load, and show no such row."""
    from qdebug.output.report_io import from_jsonable
    from qdebug.records.verify import VerifyResult

    data = json.loads(verify_json.read_text())
    for v in data["variants"]:
        del v["weight_bytes"], v["float_weight_bytes"]
    old = from_jsonable(VerifyResult, data)
    assert old.variant("static").float_weight_bytes is None
    assert not any(line.startswith("float weights") for line in old.summary_lines())
    data = json.loads(bench_json.read_text())
    for v in data["variants"]:
        del v["weight_bytes"], v["float_weight_bytes"]
    (tmp_path / "old_bench.json").write_text(json.dumps(data))
    assert load_bench(tmp_path / "old_bench.json").variant("static").float_weight_bytes is None


# --- a Concat ORT's symbolic shape inference asserts on, weights in Constant nodes ------------------


def _symbolic_failure(model: onnx.ModelProto) -> BaseException | None:
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    try:
        SymbolicShapeInference.infer_shapes(model)
    except Exception as e:
        return e
    return None


def _weights_dequantized(qdq: onnx.ModelProto) -> set[str]:
    """The nodes whose weight (input 1) is a DequantizeLinear of an integer initializer."""
    ints = {t.name for t in qdq.graph.initializer if t.data_type not in (onnx.TensorProto.FLOAT,)}
    dq = {n.output[0] for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in ints}
    return {n.name for n in qdq.graph.node if len(n.input) > 1 and n.input[1] in dq}


def test_plain_ort_still_trips_on_the_concat(tmp_path):
    model, _ = concat_axis_mobilenet(tmp_path)
    error = _symbolic_failure(onnx.load(str(model)))
    if error is None:
        pytest.skip("this onnxruntime's SymbolicShapeInference reads a Concat(axis=-1) of shape values now")
    assert isinstance(error, AssertionError)


def test_analyze_quantizes_every_weight_and_says_what_it_changed(tmp_path, capsys):
    model, data = concat_axis_mobilenet(tmp_path)
    report, _ = _analyze(model, data, tmp_path / "r.json", capsys)
    qdq = onnx.load(report.quantized_model.path)
    assert _weights_dequantized(qdq) == set(MOBILENET_WEIGHTED)
    assert weight_bytes(qdq).floating < weight_bytes(onnx.load(str(model))).floating / 3  # int8 weights
    (constants,) = [n for n in report.notes if n.startswith("turned 15 Constant node(s) into initializers")]
    assert "quantize_static run on the original model keeps such weights float" in constants
    (concat,) = [n for n in report.notes if "Concat node(s) of 1-D shape values" in n]
    assert CONCAT_NODE in concat and "quant_pre_process fails on the original model" in concat
    normalized = onnx.load(report.normalized_model)
    assert _symbolic_failure(normalized) is None  # what the note promises: the normalized model passes it
    axis = next(a.i for n in normalized.graph.node if n.name == CONCAT_NODE for a in n.attribute)
    assert axis == 0
    assert all(math.isfinite(o.error.sqnr_db) for o in report.outputs)


def test_a_model_onnx_cannot_type_goes_through_the_symbolic_inference(tmp_path, capsys):
    """With an ORT contrib op ONNX shape inference leaves everything after it untyped; ORT's quantizer then
    failed on the depthwise Conv's bias ("Unable to get valid quantization scale for input 'a1'")."""
    model, data = concat_axis_mobilenet(tmp_path, fused=True)
    report, _ = _analyze(model, data, tmp_path / "r.json", capsys)
    assert "shape inference completed (ORT symbolic)" in report.notes
    assert _weights_dequantized(onnx.load(report.quantized_model.path)) == set(MOBILENET_WEIGHTED)


def test_when_the_symbolic_inference_fails_too_the_types_come_from_ort(tmp_path, capsys, monkeypatch):
    """The last fallback: the Concat left as it was, ORT's symbolic inference fails (named, with its node),
    and the untyped tensors' types are read from an ORT session over the model."""
    import qdebug.graph.shapes as shapes

    monkeypatch.setattr(shapes, "_concat_axes_for_symbolic", lambda *args: None)
    model, data = concat_axis_mobilenet(tmp_path, fused=True)
    report, _ = _analyze(model, data, tmp_path / "r.json", capsys)
    (failed,) = [n for n in report.notes if n.startswith("ORT symbolic shape inference failed")]
    assert f"AssertionError in SymbolicShapeInference._infer_Concat at Concat node '{CONCAT_NODE}'" in failed
    (typed,) = [n for n in report.notes if n.startswith("read the types of")]
    assert "from an ONNX Runtime session" in typed
    qdq = onnx.load(report.quantized_model.path)
    assert _weights_dequantized(qdq) == set(MOBILENET_WEIGHTED)
    act = next(n for n in qdq.graph.node if n.name == FUSED_ACTIVATION)
    assert any(n.op_type == "QuantizeLinear" and n.input[0] == act.output[0] for n in qdq.graph.node)


def test_calibration_data_of_the_fixtures_runs(tmp_path):
    """The fixtures' known answer: ORT runs both on their data (dynamic width included)."""
    import onnxruntime as ort

    model, data = cnn_lstm_reader(tmp_path / "r")
    s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    for f in sorted(data.glob("*.npz")):
        x = np.load(f)["image"]
        assert s.run(None, {"image": x})[0].shape == (len(x), x.shape[3], 40)
    model, data = concat_axis_mobilenet(tmp_path / "m", fused=True)
    s = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    assert s.run(None, {"x": np.load(data)["x"][:4]})[0].shape == (4, 10)
