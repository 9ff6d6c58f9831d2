"""Large merged capture models opened as slices of their nodes (qdebug.graph.segment, capture.SegmentedSession):
the slices compute what the whole model computes, bit for bit, and analyze's reports are unchanged."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.graph import segment
from qdebug.runtime import capture
from qdebug.runtime.capture import SegmentedSession, SessionConfig, make_session, open_sliced
from tests.conftest import FIXTURES, analyze_args


@pytest.fixture(autouse=True)
def _slice_small_models(monkeypatch):
    """These tests slice small models: the threshold below which slicing costs more than it saves is off
    (:func:`test_a_model_under_the_threshold_is_opened_whole` checks it)."""
    monkeypatch.setattr(segment, "SLICED_FROM", 1)


def test_a_model_under_the_threshold_is_opened_whole(monkeypatch):
    """Slicing is planned only from SLICED_FROM slices' worth of nodes: under it, writing the slices costs
    more than their start-up saves (the 9,200-node fake-quant model of an 800-node graph opened 1.19x slower)."""
    monkeypatch.setattr(segment, "SLICED_FROM", 8)
    model = _stacking_model()
    body = len(model.graph.node) - 3
    assert segment.plan(model, body // 8 + 1) is None
    assert segment.plan(model, body // 8) is not None
    assert segment.SLICED_FROM * segment.SEGMENT_NODES == 16_000


def _stacking_model() -> onnx.ModelProto:
    """Relu/Add chains whose per-node sums end in both kinds of stacking tail, an If reading outer-scope
    values, an int64 value handed across slices, and a QDQ pair (uint8 across a slice boundary)."""
    nodes, inits, sums = [], [], []
    prev = "x"
    for i in range(12):
        inits.append(numpy_helper.from_array(np.array(0.1 * (i + 1), np.float32), f"c{i}"))
        nodes.append(helper.make_node("Add", [prev, f"c{i}"], [f"a{i}"], name=f"add{i}"))
        nodes.append(helper.make_node("Relu", [f"a{i}"], [f"r{i}"], name=f"relu{i}"))
        nodes.append(helper.make_node("ReduceSum", [f"r{i}"], [f"s{i}"], name=f"sum{i}", keepdims=0))
        sums.append(f"s{i}")
        prev = f"r{i}"
    inits += [
        numpy_helper.from_array(np.array(0.05, np.float32), "qs"),
        numpy_helper.from_array(np.array(128, np.uint8), "qz"),
        numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    nodes += [
        helper.make_node("QuantizeLinear", [prev, "qs", "qz"], ["q"], name="q"),
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Relu", ["r0"], ["late0"], name="late0"),
        helper.make_node("Relu", ["late0"], ["late1"], name="late1"),
        helper.make_node("DequantizeLinear", ["q", "qs", "qz"], ["dq"], name="dq"),
        helper.make_node("Reshape", ["dq", "flat"], ["flat_dq"], name="reshape"),
        helper.make_node("Reshape", ["late1", "flat"], ["flat_late"], name="reshape_late"),
        helper.make_node("ReduceSum", ["x"], ["total"], name="total", keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["cond"], name="cond"),
    ]
    then = helper.make_graph(
        [helper.make_node("Mul", ["flat_dq", "c3"], ["t"], name="then_mul")], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
    )  # fmt: skip
    other = helper.make_graph(
        [helper.make_node("Sub", ["flat_dq", "flat_late"], ["t2"], name="else_sub")], "else", [],
        [helper.make_tensor_value_info("t2", TensorProto.FLOAT, None)],
    )  # fmt: skip
    nodes.append(helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then, else_branch=other))
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    nodes.append(helper.make_node("Unsqueeze", ["s0", "axis0"], ["u0"], name="u0"))
    nodes.append(helper.make_node("Unsqueeze", ["s5", "axis0"], ["u5"], name="u5"))
    nodes.append(helper.make_node("Concat", ["u0", "u5"], ["pair"], name="pair", axis=0))
    nodes.append(helper.make_node("SequenceConstruct", sums, ["seq"], name="seq"))
    nodes.append(helper.make_node("ConcatFromSequence", ["seq"], ["stacked"], name="stacked", axis=0, new_axis=1))
    outputs = [
        helper.make_tensor_value_info(n, t, None)
        for n, t in (("branch", TensorProto.FLOAT), ("shape", TensorProto.INT64), ("pair", TensorProto.FLOAT),
                     ("stacked", TensorProto.FLOAT), ("r3", TensorProto.FLOAT))
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _whole(path, feeds, names):
    return dict(zip(names, make_session(path, SessionConfig(), optimize=False).run(names, feeds), strict=True))


@pytest.mark.parametrize("size", [2, 5, 13])
@pytest.mark.parametrize("sign", [1.0, -1.0])  # both branches of the If
def test_slices_compute_what_the_whole_model_computes(tmp_path, size, sign):
    model = _stacking_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    feeds = {"x": sign * np.abs(np.random.default_rng(0).normal(size=(3, 8))).astype(np.float32)}
    names = [o.name for o in model.graph.output]
    sliced = open_sliced(path, lambda p: make_session(p, SessionConfig(), optimize=False), size=size)
    assert isinstance(sliced, SegmentedSession)
    assert len(sliced.sessions) == -(-(len(model.graph.node) - 3) // size)  # the 3 stacking nodes run in numpy
    assert [i.name for i in sliced.get_inputs()] == ["x"]
    got = dict(zip(names, capture.run_session(sliced, names, feeds).values(), strict=True))
    want = _whole(path, feeds, names)
    for name in names:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_the_plan_hands_on_only_what_later_slices_read_and_drops_it_after_its_last_reader():
    model = _stacking_model()
    plan = segment.plan(model, 5)
    assert plan is not None
    assert [s.output for s in plan.stacks] == ["pair", "stacked"]
    assert plan.stacks[1].new_axis and plan.stacks[1].parts == tuple(f"s{i}" for i in range(12))
    covered = [i for s in plan.slices for i in range(s.start, s.stop)]
    assert covered == list(range(len(model.graph.node) - 3))
    produced_before: set[str] = {"x"}
    for part in plan.slices:
        nodes = model.graph.node[part.start : part.stop]
        assert set(part.inputs) <= produced_before  # a topological order: only earlier values are read
        mine = {o for n in nodes for o in n.output}
        assert not set(part.inputs) & mine
        produced_before |= set(part.outputs)
    # the If's branches read flat_dq, c3 and late1 from the outer graph: the If's slice is fed them
    if_slice = next(s for s in plan.slices if any(n.op_type == "If" for n in model.graph.node[s.start : s.stop]))
    assert {"flat_dq", "flat_late"} <= set(if_slice.inputs) | {
        o for n in model.graph.node[if_slice.start : if_slice.stop] for o in n.output
    }
    assert "c3" in if_slice.initializers
    dropped = [n for s in plan.slices for n in s.last_read]
    assert len(dropped) == len(set(dropped)) and not set(dropped) & set(plan.outputs)


def test_a_model_that_fits_in_one_slice_or_cannot_be_fed_is_not_planned():
    model = _stacking_model()
    assert segment.plan(model, 10_000) is None
    overridable = onnx.ModelProto()
    overridable.CopyFrom(model)
    overridable.graph.input.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, []))
    assert segment.plan(overridable, 2) is None  # an input with a default: a slice could not tell


def test_a_sequence_handed_between_slices_opens_the_model_whole(tmp_path):
    """Only tensors can type a slice's inputs: a sequence crossing a cut falls back to one session."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r0"),
        helper.make_node("SequenceConstruct", ["a", "x"], ["seq"], name="seq"),
        helper.make_node("Relu", ["x"], ["b"], name="r1"),
        helper.make_node("Relu", ["b"], ["c"], name="r2"),
        helper.make_node("ConcatFromSequence", ["seq"], ["y"], name="cat", axis=0),
        helper.make_node("Add", ["y", "y"], ["z"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("z", "c")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "seq.onnx"
    onnx.save(model, path)
    opened = open_sliced(path, lambda p: make_session(p, SessionConfig(), optimize=False), size=2)
    assert isinstance(opened, ort.InferenceSession)
    x = np.ones((2, 2), np.float32)
    assert opened.run(["z"], {"x": x})[0].shape == (4, 2)


@pytest.mark.parametrize(
    "fixture",
    ["cnn", "transformer", "robustness/if_subgraph", "robustness/loop", "robustness/int64_inputs",
     "robustness/mixed_fp16", "robustness/detect_concat"],
)  # fmt: skip
def test_analyze_reports_the_same_numbers_with_the_capture_models_sliced(fixture, tmp_path, monkeypatch):
    """The merged capture models cut into slices of a few nodes (hundreds of sessions) give the report the
    single sessions give, number for number."""
    if "/" in fixture:
        folder, name = fixture.split("/")
        model, calib = FIXTURES / folder / f"{name}.onnx", FIXTURES / folder / f"{name}_calib.npz"
        argv = lambda out: ["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q", "--no-cache"]  # noqa: E731
    else:
        argv = lambda out: analyze_args(fixture, out, "--no-cache")  # noqa: E731
    opened = []
    real = SegmentedSession.__init__

    def counted(self, *args, **kwargs):
        real(self, *args, **kwargs)
        opened.append(len(self.sessions))

    monkeypatch.setattr(SegmentedSession, "__init__", counted)
    monkeypatch.setattr(segment, "SEGMENT_NODES", 10**9)
    assert main(argv(tmp_path / "whole.json")) == 0
    assert opened == []
    monkeypatch.setattr(segment, "SEGMENT_NODES", 101 if fixture == "transformer" else 7)
    assert main(argv(tmp_path / "sliced.json")) == 0
    assert opened and min(opened) > 1  # the capture models ran as slices
    whole, sliced = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "sliced"))
    for key in ("tensors", "nodes", "outputs", "task", "per_sample", "deployed_gap", "weights", "notes"):
        assert sliced.get(key) == whole.get(key), key


def test_a_slice_onnx_runtime_refuses_opens_the_model_whole(tmp_path, monkeypatch):
    """Slicing only ever saves time: a slice ORT will not load falls back to one session over the model."""
    model = _stacking_model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    opened = []

    def open_one(p):
        opened.append(p.name)
        if "slice1" in p.name:
            raise capture.QDebugError("ONNX Runtime cannot load the model: a cut it cannot type")
        return make_session(p, SessionConfig(), optimize=False)

    session = open_sliced(path, open_one, size=5)
    assert isinstance(session, ort.InferenceSession) and opened[-1] == "m.onnx"
    assert opened[:2] == ["m.slice0.onnx", "m.slice1.onnx"]
