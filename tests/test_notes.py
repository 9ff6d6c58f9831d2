"""Analysis notes fire on measured loss only (issue 16 item 2).

Each false-positive pattern found on exported models gets a generated fixture that must stay silent: a
constant stride tensor ([8, 8], exact after Q/DQ) read by an Add and a Concat (a YOLO head), a one-hot
tensor of exact 0/1 read by a MatMul (a byte classifier). Each true pattern still fires: an additive -1e9
mask before a Softmax, a residual stream whose range a hot channel sets, a Concat of pixel box coordinates
with sigmoid scores. A node whose inputs are exact shows its "introduced" error as such in the summary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.output.report_io import load_report
from qdebug.records import Report
from tests.models import masked_attention, save_graph


def _f32(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def _analyze(tmp_path: Path, model: Path, calib: dict[str, np.ndarray], *extra: str) -> Report:
    """``qdebug analyze`` through the real CLI on a generated model; the report it wrote."""
    np.savez(tmp_path / "calib.npz", **calib)
    out = tmp_path / "report.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "calib.npz"), "-o", str(out), "-q", *extra]
    assert main(args) == 0
    return load_report(out)


def yolo_strides(path: Path, seed: int = 0) -> Path:
    """A detector head's decode: ``xy = sigmoid(h) * stride`` with ``stride`` a run-time constant of 8
    (``ConstantOfShape`` of a dynamic shape, which nothing folds) and the anchors ``Concat(stride, 16)``:
    the stride tensor's range is [8, 8], every value in one quantization step, and exact after Q/DQ."""
    rng = np.random.default_rng(seed)
    eight = helper.make_tensor("eight", TensorProto.FLOAT, [1], [8.0])
    sixteen = helper.make_tensor("sixteen", TensorProto.FLOAT, [1], [16.0])
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="head/matmul"),
        helper.make_node("Sigmoid", ["h"], ["s"], name="head/sigmoid"),
        helper.make_node("Shape", ["h"], ["shp"], name="head/shape"),
        helper.make_node("ConstantOfShape", ["shp"], ["stride"], name="head/stride", value=eight),
        helper.make_node("ConstantOfShape", ["shp"], ["big"], name="head/big", value=sixteen),
        helper.make_node("Mul", ["s", "stride"], ["xy"], name="head/mul"),
        helper.make_node("Add", ["stride", "xy"], ["pos"], name="head/add_2"),
        helper.make_node("Concat", ["stride", "big"], ["anchors"], name="head/concat_23", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "yolo_strides",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6])],
        [
            helper.make_tensor_value_info("pos", TensorProto.FLOAT, ["N", 8, 6]),
            helper.make_tensor_value_info("anchors", TensorProto.FLOAT, ["N", 8, 12]),
        ],
        [_f32("w", rng.normal(0, 0.5, (6, 6)))],
    )
    return save_graph(graph, path)


def byte_onehot(path: Path, seed: int = 0) -> Path:
    """A byte classifier's embedding: ``OneHot(bytes)`` (exact 0/1, one value in eight is 1) read by a
    MatMul, and ``Cast(Equal(bytes, 3))`` (0/1 again) read by a second MatMul; both one-hot tensors are
    quantized for their MatMul and exact after Q/DQ (SQNR inf)."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("OneHot", ["bytes", "depth", "onoff"], ["onehot"], name="embed/onehot", axis=-1),
        helper.make_node("MatMul", ["onehot", "emb"], ["e"], name="embed/einsum"),
        helper.make_node("Equal", ["bytes", "three"], ["is3"], name="embed/equal"),
        helper.make_node("Cast", ["is3"], ["flag"], name="embed/cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["flag", "last"], ["flag1"], name="embed/unsqueeze"),
        helper.make_node("MatMul", ["flag1", "wflag"], ["f"], name="embed/flag_matmul"),
        helper.make_node("Add", ["e", "f"], ["y"], name="embed/add"),
    ]
    inits = [
        numpy_helper.from_array(np.array(8, np.int64), "depth"),
        _f32("onoff", [0.0, 1.0]),
        _f32("emb", rng.normal(0, 0.5, (8, 4))),
        numpy_helper.from_array(np.array(3, np.int64), "three"),
        numpy_helper.from_array(np.array([-1], np.int64), "last"),
        _f32("wflag", rng.normal(0, 0.5, (1, 4))),
    ]
    graph = helper.make_graph(
        nodes,
        "byte_onehot",
        [helper.make_tensor_value_info("bytes", TensorProto.INT64, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 4])],
        inits,
    )
    return save_graph(graph, path)


def hot_residual(path: Path, seed: int = 0) -> Path:
    """A residual stream with one hot channel (~1000, as in large transformers) read by a projection that
    ignores that channel: the range the hot channel sets puts every other value in one step, the stream's
    SQNR looks fine (the hot channel carries the energy), and the projection's output is lost."""
    rng = np.random.default_rng(seed)
    hot = np.zeros(8, np.float32)
    hot[0] = 1000.0
    w = rng.normal(0, 0.5, (8, 8)).astype(np.float32)
    w[0] = 0.0  # the projection reads the ordinary channels only
    nodes = [
        helper.make_node("MatMul", ["x", "w_in"], ["h"], name="block/fc"),
        helper.make_node("Add", ["h", "hot"], ["resid"], name="block/residual"),
        helper.make_node("MatMul", ["resid", "w_out"], ["y"], name="block/proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "hot_residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [_f32("w_in", rng.normal(0, 0.5, (8, 8))), _f32("hot", hot), _f32("w_out", w)],
    )
    return save_graph(graph, path)


def box_concat(path: Path, seed: int = 0) -> Path:
    """A detector's output: box coordinates in pixels ([1, 320]) concatenated with sigmoid scores ([0, 1])
    under one scale, which leaves the scores about one quantization level."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w_box"], ["b"], name="box/matmul"),
        helper.make_node("Sigmoid", ["b"], ["b01"], name="box/sigmoid"),
        helper.make_node("Mul", ["b01", "px"], ["bpx"], name="box/scale"),
        helper.make_node("Add", ["bpx", "one"], ["boxes"], name="box/to_pixels"),
        helper.make_node("MatMul", ["x", "w_cls"], ["c"], name="cls/matmul"),
        helper.make_node("Sigmoid", ["c"], ["scores"], name="cls/sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["detections"], name="head/concat", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "box_concat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("detections", TensorProto.FLOAT, ["N", 7])],
        [
            _f32("w_box", rng.normal(0, 2.0, (8, 4))),
            _f32("px", [319.0]),
            _f32("one", [1.0]),
            _f32("w_cls", rng.normal(0, 0.5, (8, 3))),
        ],
    )
    return save_graph(graph, path)


# --------------------------------------------------------------------------- analyzed once per module


@pytest.fixture(scope="module")
def analyzed(tmp_path_factory) -> dict[str, tuple[Report, str, Path]]:
    """Each generated model analyzed once: ``name -> (report, summary printed on stdout, model path)``."""
    import contextlib
    import io

    rng = np.random.default_rng(0)
    cases = {
        "yolo": (yolo_strides, {"x": rng.normal(0, 1, (16, 8, 6)).astype(np.float32)}),
        "onehot": (byte_onehot, {"bytes": rng.integers(0, 8, (16, 16)).astype(np.int64)}),
        "residual": (hot_residual, {"x": rng.normal(0, 1, (32, 8)).astype(np.float32)}),
        "mask": (
            lambda p: masked_attention(p, additive=-1e9),
            {"x": rng.normal(0, 1, (16, 6, 8)).astype(np.float32)},
        ),
        "boxes": (box_concat, {"x": rng.normal(0, 1, (32, 8)).astype(np.float32)}),
    }
    out = {}
    for name, (make, calib) in cases.items():
        root = tmp_path_factory.mktemp(name)
        model = make(root / "model.onnx")
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            report = _analyze(root, model, calib, "--no-cache")
        out[name] = (report, stdout.getvalue(), model)
    return out


def _collapse_notes(report: Report) -> list[str]:
    return [n for n in report.notes if "one quantization step" in n]


def _summary_row(summary: str, node: str) -> str:
    return next(line for line in summary.splitlines() if f" {node} " in line)


# --------------------------------------------------------------------------- false positives stay silent


def test_a_constant_stride_is_no_collapsed_range(analyzed):
    """A stride tensor of 8 (range [8, 8], exact after Q/DQ) has all its values in one step because it has
    one value: the note had told the user to keep the stride's producer and the Concat reading it FP32."""
    report, summary, _ = analyzed["yolo"]
    stride = report.tensor("stride")
    assert stride.quant is not None and stride.summary.min == stride.summary.max == 8.0  # the premise
    assert max(stride.histogram.ref_counts) == sum(stride.histogram.ref_counts)
    assert _collapse_notes(report) == []
    assert not any("head/add_2" in n or "head/concat_23" in n for n in report.notes)


def test_an_exact_onehot_is_no_collapsed_range(analyzed):
    """One-hot 0/1 (from OneHot, and from Cast of a comparison): most values share the zero step, exactly;
    the MatMul reading it loses only what its own rounding does. No note names them."""
    report, _, _ = analyzed["onehot"]
    for name in ("onehot", "flag1"):
        t = report.tensor(name)
        assert t.quant is not None and t.local.sqnr_db == np.inf  # the premise: quantized, and exact
    assert _collapse_notes(report) == []
    assert not any("embed/cast" in n or "embed/einsum" in n for n in report.notes)


def test_introduced_from_an_exact_input_is_not_printed_as_a_number(analyzed):
    """The MatMul reading the exact one-hot "introduced 76.7 dB" (120 dB cap minus its 43.3 dB output): the
    summary says it comes from an exact input, and explains that once; the report keeps the number."""
    from qdebug.analysis.build import SQNR_CAP_DB, from_exact_input

    report, summary, _ = analyzed["onehot"]
    node = report.node("embed/einsum")
    assert node.introduced_db == pytest.approx(SQNR_CAP_DB - node.accumulated_sqnr_db)
    assert from_exact_input(node)
    row = _summary_row(summary, "embed/einsum")
    assert "(exact input)" in row and f"{node.introduced_db:.1f}" not in row
    assert summary.count("(exact input): the node's float inputs are exact") == 1
    add = report.node("embed/add")  # reads two lossy MatMul outputs: a measured drop, printed
    assert not from_exact_input(add) and f"{add.introduced_db:.1f}" in _summary_row(summary, "embed/add")


def test_from_exact_input_reads_the_record():
    """Only the cap identity counts: a measured drop, an exact output, or an unscored node is not it."""
    from qdebug.analysis.build import from_exact_input
    from qdebug.records import NodeRecord

    def node(acc: float, introduced: float) -> NodeRecord:
        return NodeRecord("n", "n", "MatMul", ("a",), ("b",), 1, True, 40.0, acc, introduced, 0.0)

    assert from_exact_input(node(34.5, 85.5))
    assert not from_exact_input(node(34.5, 10.0))
    assert not from_exact_input(node(np.inf, 0.0))
    assert not from_exact_input(node(np.nan, np.nan))


# --------------------------------------------------------------------------- true ones still fire


@pytest.mark.parametrize(
    ("case", "tensor", "producer", "consumer"),
    [("mask", "masked", "mask_add", "softmax"), ("residual", "resid", "block/residual", "block/proj")],
)
def test_a_range_set_by_outliers_is_still_named(analyzed, case, tensor, producer, consumer):
    """-1e9 mask values before a Softmax, a hot channel in a residual stream: the other values share one
    step, the tensor's SQNR looks fine, and the consumer's output is lost beyond its own rounding."""
    report, _, _ = analyzed[case]
    (note,) = _collapse_notes(report)
    assert note.startswith(f"{tensor}: ")
    assert f"keep {producer} and {consumer} out of quantization" in note
    assert "does not explain" in note and "introduces" not in note  # no capped number in the sentence


def test_the_collapse_needs_a_consumer_its_own_rounding_cannot_explain(analyzed):
    """With the projection's weights as poor as its output, its loss is its own: no note."""
    import dataclasses

    from qdebug.analysis import collapsed_range_notes
    from qdebug.records import ErrorStats, QuantParams, WeightRecord

    report, _, _ = analyzed["residual"]
    assert collapsed_range_notes(report.tensors, report.nodes, report.weights)
    proj = report.node("block/proj")
    poor = ErrorStats(
        count=64, nonfinite=0, sqnr_db=proj.accumulated_sqnr_db + 1, mse=1.0, cosine=0.5, max_abs=1.0, kl=0.0
    )
    bad = WeightRecord("w_out", "block/proj", poor, QuantParams(0.01, 0, "int8"))
    assert collapsed_range_notes(report.tensors, report.nodes, (bad,)) == []
    harmless = dataclasses.replace(proj, accumulated_sqnr_db=35.0)
    nodes = tuple(harmless if n.name == proj.name else n for n in report.nodes)
    assert collapsed_range_notes(report.tensors, nodes, report.weights) == []


def test_a_mixed_range_concat_is_still_named(analyzed):
    report, _, _ = analyzed["boxes"]
    (note,) = [n for n in report.notes if n.startswith("Concat head/concat joins inputs")]
    assert "boxes [" in note and "scores [" in note and "quantization level(s)" in note


def test_the_concat_note_needs_a_shared_scale_that_loses(analyzed):
    """No note without the output's Q/DQ (no shared scale), with an exact output, or when the narrow input
    is a constant the shared grid holds exactly; a constant off the grid still loses and is named."""
    import dataclasses

    from qdebug.analysis import concat_range_notes
    from qdebug.records import TensorSummary

    report, _, model = analyzed["boxes"]
    fp32 = onnx.load(model)

    def notes(**changed) -> list[str]:
        tensors = tuple(changed.get(t.name, t) for t in report.tensors)
        return concat_range_notes(fp32, tensors)

    out, scores = report.tensor("detections"), report.tensor("scores")
    assert len(notes()) == 1
    assert notes(detections=dataclasses.replace(out, quant=None)) == []
    exact = dataclasses.replace(out.local, sqnr_db=np.inf)
    assert notes(detections=dataclasses.replace(out, local=exact)) == []

    def constant(value: float):
        return dataclasses.replace(scores, summary=TensorSummary(value, value, value, 0.0, scores.summary.count))

    on_grid = 2 * out.quant.scale  # two levels above the zero point (0 here): exact
    assert out.quant.zero_point == 0
    assert notes(scores=constant(on_grid)) == []
    (off,) = notes(scores=constant(1.4 * out.quant.scale))
    assert "leaves scores about 1.4 quantization level(s)" in off


# --------------------------------------------------------------------------- the other note families


def test_kernel_gap_needs_a_deployed_loss(analyzed):
    """Fake-quant 130 dB against deployed 100 dB loses nothing; an exact fake-quant value against 25 dB
    deployed is a kernel problem (it had been skipped as an infinite gap)."""
    import dataclasses

    from qdebug.analysis import kernel_gap_notes

    report, _, _ = analyzed["boxes"]
    rec = report.tensor("scores")

    def gap(fakequant: float, deployed: float) -> list[str]:
        t = dataclasses.replace(
            rec,
            accumulated=dataclasses.replace(rec.accumulated, sqnr_db=deployed),
            accumulated_fakequant=dataclasses.replace(rec.accumulated, sqnr_db=fakequant),
        )
        return kernel_gap_notes((t,))

    assert gap(130.0, 100.0) == []
    assert gap(np.inf, 90.0) == []
    (note,) = gap(np.inf, 25.0)
    assert "25.0 dB deployed vs inf dB fake-quant" in note
    assert gap(35.0, 25.0) and gap(35.0, 33.0) == []


def test_instrumentation_note_needs_a_deployed_loss():
    from types import SimpleNamespace

    from qdebug.analysis import instrumentation_notes

    assert instrumentation_notes(SimpleNamespace(first_batch_sqnr=(100.0, 140.0))) == []
    assert instrumentation_notes(SimpleNamespace(first_batch_sqnr=(np.inf, np.inf))) == []
    assert instrumentation_notes(SimpleNamespace(first_batch_sqnr=(13.0, np.inf)))
    assert instrumentation_notes(SimpleNamespace(first_batch_sqnr=(13.0, 39.7)))


def test_eval_range_note_ignores_an_overshoot_that_rounds_like_any_value(analyzed):
    """An evaluation value less than half a step past the top level rounds to it with an ordinary rounding
    error: no clipping to report. A value well past it is clipped and named."""
    from types import SimpleNamespace

    from qdebug.analysis import eval_range_notes

    report, _, _ = analyzed["boxes"]
    rec = report.tensor("detections")
    top = (255 - rec.quant.zero_point) * rec.quant.scale

    def notes(value: float) -> list[str]:
        batch = {"detections": np.full((4, 7), 1.0, np.float32)}
        batch["detections"][0, 0] = value
        ev = SimpleNamespace(output_names=["detections"], reference=[batch], sizes=[4], samples=4)
        return eval_range_notes(ev, report.tensors, report.nodes)

    assert notes(top + 0.4 * rec.quant.scale) == []
    (note,) = notes(2 * top)
    assert "on 1 of 4 samples" in note


def test_eval_range_note_advises_only_on_a_material_overshoot(analyzed):
    """The demo's logits overshot their calibrated range by 1.6 quantization steps on 8 of 500 samples and the
    note advised keeping the Gemm FP32, which changed no prediction: an overshoot under EVAL_OVERSHOOT_STEPS
    steps clips about as much as rounding costs, and gets no note. Six steps still do, with the advice."""
    from types import SimpleNamespace

    from qdebug.analysis import eval_range_notes
    from qdebug.analysis.notes import EVAL_OVERSHOOT_STEPS

    report, _, _ = analyzed["boxes"]
    rec = report.tensor("detections")
    scale = rec.quant.scale
    top = max((255 - rec.quant.zero_point) * scale, rec.summary.max)

    def notes(steps: float, samples: int = 2) -> list[str]:
        batch = {"detections": np.full((8, 7), 1.0, np.float32)}
        batch["detections"][:samples, 0] = top + steps * scale
        ev = SimpleNamespace(output_names=["detections"], reference=[batch], sizes=[8], samples=8)
        return eval_range_notes(ev, report.tensors, report.nodes)

    assert EVAL_OVERSHOOT_STEPS == 4.0
    assert notes(1.6) == [] and notes(3.5, samples=8) == []  # every sample, still a small clip
    (note,) = notes(6.0)
    assert "on 2 of 8 samples" in note and "up to 6 quantization steps past the range" in note
    assert note.endswith("keep head/concat FP32")


def test_eval_range_note_on_class_scores_needs_a_changed_prediction(analyzed):
    """Where the metric reads the argmax of the output (top1_agreement on scores), a clip that changes no
    sample's class costs it nothing: the demo's logits overshot their range by 14 steps at the bottom (the
    least likely classes) and keeping the Gemm FP32, as the note advised, changed no prediction. A clip that
    merges the two top scores of a sample changes its class and is still named."""
    from types import SimpleNamespace

    from qdebug.analysis import eval_range_notes

    report, _, _ = analyzed["boxes"]
    rec = report.tensor("detections")
    scale = rec.quant.scale
    lo = min((0 - rec.quant.zero_point) * scale, rec.summary.min)
    hi = max((255 - rec.quant.zero_point) * scale, rec.summary.max)

    def notes(**at: float) -> list[str]:
        batch = {"detections": np.full((8, 7), 1.0, np.float32)}
        for col, value in at.items():
            batch["detections"][0, int(col[1:])] = value
        ev = SimpleNamespace(
            output_names=["detections"], reference=[batch], sizes=[8], samples=8,
            metric_name="top1_agreement", _indices=False,
        )
        return eval_range_notes(ev, report.tensors, report.nodes)

    assert notes(c0=lo - 20 * scale) == []  # far below, on a class no argmax reads
    assert notes(c2=hi + 20 * scale) == []  # far above, still the sample's class after the clip
    (note,) = notes(c2=hi + 1 * scale, c3=hi + 20 * scale)  # both clip to hi: class 3 becomes class 2
    assert "on 1 of 8 samples" in note and note.endswith("keep head/concat FP32")
