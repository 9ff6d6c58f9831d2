"""Contracts of qdebug.graph.segment / capture.SegmentedSession: contracts tests/test_segment.py
leaves open -- the size knob, the plan's boundaries and minimal hand-over, stacking axes, nested subgraphs,
local functions, external weights, slices with nothing to hand on, and values freed after their last reader."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.graph import segment
from qdebug.runtime.capture import SegmentedSession, SessionConfig, make_session, open_sliced


@pytest.fixture(autouse=True)
def _slice_small_models(monkeypatch):
    """These tests slice small models: the threshold below which slicing costs more than it saves is off
    (:func:`test_a_model_under_the_threshold_is_opened_whole` checks it)."""
    monkeypatch.setattr(segment, "SLICED_FROM", 1)


def _open_one(p):
    return make_session(p, SessionConfig(), optimize=False)


def _model(nodes, outputs, inits=(), inputs=None, functions=(), opset=13):
    graph = helper.make_graph(
        nodes,
        "g",
        inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("local", 1)])
    model.ir_version = 8
    model.functions.extend(functions)
    return model


def _chain(n, prefix="r", start="x"):
    return [helper.make_node("Relu", [start if i == 0 else f"{prefix}{i - 1}"], [f"{prefix}{i}"], name=f"{prefix}{i}")
            for i in range(n)]  # fmt: skip


def _same(path, model, feeds, size):
    """open_sliced(size) is a SegmentedSession and gives the whole model's outputs bit for bit."""
    names = [o.name for o in model.graph.output]
    sliced = open_sliced(path, _open_one, size=size)
    assert isinstance(sliced, SegmentedSession)
    got = sliced.run(names, feeds)
    want = _open_one(path).run(names, feeds)
    for name, g, w in zip(names, got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(g, w, err_msg=name)
    return sliced


X = {"x": np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)}


def test_qdebug_slice_nodes_sets_the_size_and_zero_never_slices(tmp_path, monkeypatch):
    model = _model(_chain(6), ["r5"])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    monkeypatch.setenv(segment.SLICE_ENV, "2")
    assert segment.slice_nodes() == 2
    opened = open_sliced(path, _open_one)
    assert isinstance(opened, SegmentedSession) and len(opened.sessions) == 3
    monkeypatch.setenv(segment.SLICE_ENV, "0")
    assert segment.slice_nodes() == 0
    assert isinstance(open_sliced(path, _open_one), ort.InferenceSession)  # 0: never sliced
    monkeypatch.setenv(segment.SLICE_ENV, "many")
    assert segment.slice_nodes() == segment.SEGMENT_NODES


def test_a_body_of_exactly_size_nodes_is_one_slice_so_not_planned():
    model = _model(_chain(6), ["r5"])
    assert segment.plan(model, 6) is None
    found = segment.plan(model, 5)
    assert found is not None and [(s.start, s.stop) for s in found.slices] == [(0, 5), (5, 6)]


def test_a_sparse_initializer_is_not_planned():
    model = _model(_chain(6), ["r5"])
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([1.0], np.float32), "sp"),
        numpy_helper.from_array(np.array([0], np.int64)),
        [4],
    )
    model.graph.sparse_initializer.append(sparse)
    assert segment.plan(model, 2) is None


def test_a_slice_hands_on_exactly_what_later_slices_stacks_and_outputs_read():
    """Nothing more than needed crosses a cut (each extra output is held until its last reader)."""
    nodes = _chain(8) + [helper.make_node("Add", ["r1", "r6"], ["s"], name="s")]
    model = _model(nodes, ["s", "r3"])
    found = segment.plan(model, 3)
    assert found is not None
    assert [s.outputs for s in found.slices] == [("r1", "r2"), ("r3", "r5"), ("s",)]
    assert [set(s.last_read) for s in found.slices] == [{"x"}, {"r2"}, {"r1", "r5"}]


def test_stacking_tails_keep_their_axis_and_new_axis(tmp_path):
    """Concat on axis 1 and ConcatFromSequence on axis -1 without new_axis, stacked in numpy as ORT would."""
    nodes = _chain(6) + [
        helper.make_node("Concat", ["r1", "r4"], ["cat1"], name="cat1", axis=1),
        helper.make_node("SequenceConstruct", ["r2", "r5", "r0"], ["seq"], name="seq"),
        helper.make_node("ConcatFromSequence", ["seq"], ["cfs"], name="cfs", axis=-1, new_axis=0),
    ]
    model = _model(nodes, ["cat1", "cfs"])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    found = segment.plan(model, 2)
    assert found is not None
    assert [(s.output, s.axis, s.new_axis) for s in found.stacks] == [("cat1", 1, False), ("cfs", -1, False)]
    sliced = _same(path, model, X, 2)
    assert len(sliced.sessions) == 3  # the three stacking nodes ran in numpy


def test_a_concat_from_sequence_of_another_sequence_is_not_mistaken_for_a_stack(tmp_path):
    """Only the SequenceConstruct that builds the stacked sequence makes a stack's parts."""
    nodes = _chain(6) + [
        helper.make_node("SequenceConstruct", ["r1", "r2"], ["seq_a"], name="seq_a"),
        helper.make_node("Relu", ["r5"], ["late"], name="late"),
        helper.make_node("SequenceConstruct", ["r3", "late"], ["seq_b"], name="seq_b"),
        helper.make_node("ConcatFromSequence", ["seq_a"], ["y"], name="y", axis=0),
    ]
    model = _model(nodes, ["y", "late"])
    found = segment.plan(model, 3)
    assert found is None or all(s.parts != ("r3", "late") for s in found.stacks)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    names = ["y", "late"]
    got = open_sliced(path, _open_one, size=3).run(names, X)
    for g, w in zip(got, _open_one(path).run(names, X), strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_nested_subgraph_reading_an_earlier_slice_is_fed_it(tmp_path):
    """An If inside an If's branch reads r1 (made two slices earlier): the outer If's slice is fed r1."""
    inner_then = helper.make_graph([helper.make_node("Neg", ["r1"], ["it"], name="in_neg")], "it", [],
                                   [helper.make_tensor_value_info("it", TensorProto.FLOAT, None)])  # fmt: skip
    inner_else = helper.make_graph([helper.make_node("Abs", ["r1"], ["ie"], name="in_abs")], "ie", [],
                                   [helper.make_tensor_value_info("ie", TensorProto.FLOAT, None)])  # fmt: skip
    outer_then = helper.make_graph(
        [helper.make_node("If", ["cond"], ["ot"], name="inner_if", then_branch=inner_then, else_branch=inner_else)],
        "ot", [], [helper.make_tensor_value_info("ot", TensorProto.FLOAT, None)],
    )  # fmt: skip
    outer_else = helper.make_graph([helper.make_node("Identity", ["r4"], ["oe"], name="oe")], "oe", [],
                                   [helper.make_tensor_value_info("oe", TensorProto.FLOAT, None)])  # fmt: skip
    nodes = _chain(6) + [
        helper.make_node("ReduceSum", ["x"], ["total"], name="total", keepdims=0),
        helper.make_node("Less", ["total", "zero"], ["cond"], name="cond"),
        helper.make_node("If", ["cond"], ["y"], name="outer_if", then_branch=outer_then, else_branch=outer_else),
    ]
    inits = [numpy_helper.from_array(np.array(1e9, np.float32), "zero")]  # cond always true: the nested If runs
    model = _model(nodes, ["y", "r5"], inits)
    found = segment.plan(model, 3)
    assert found is not None
    assert "r1" in found.slices[-1].inputs and "r1" in found.slices[0].outputs
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    _same(path, model, X, 3)


def test_a_model_with_local_functions_is_still_sliced(tmp_path):
    fn = helper.make_function(
        "local", "Twice", ["a"], ["b"], [helper.make_node("Add", ["a", "a"], ["b"])], [helper.make_opsetid("", 13)]
    )
    nodes = [helper.make_node("Twice", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"], name=f"t{i}", domain="local")
             for i in range(6)]  # fmt: skip
    model = _model(nodes, ["t5"], functions=[fn])
    model.ir_version = 7
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    found = segment.plan(model, 2)
    piece = segment.slice_model(model, found, 1, {"x": TensorProto.FLOAT, "t1": TensorProto.FLOAT}, {})
    assert piece.ir_version == 7 and list(piece.opset_import) == list(model.opset_import)
    assert [f.name for f in piece.functions] == ["Twice"]
    _same(path, model, X, 2)


def test_external_weights_are_found_from_the_slices(tmp_path):
    """Slices are written next to the model, so its external data (named relative to its folder) loads."""
    inits = [numpy_helper.from_array(np.full((4,), i + 1, np.float32), f"w{i}") for i in range(6)]
    nodes = [
        helper.make_node("Mul", ["x" if i == 0 else f"m{i - 1}", f"w{i}"], [f"m{i}"], name=f"m{i}") for i in range(6)
    ]
    model = _model(nodes, ["m5"], inits)
    path = tmp_path / "sub" / "m.onnx"
    path.parent.mkdir()
    onnx.save(
        model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=0
    )
    _same(path, onnx.load(str(path)), X, 2)


def test_a_slice_whose_values_nobody_reads_opens_no_session(tmp_path):
    nodes = _chain(4) + _chain(4, prefix="dead", start="x") + [helper.make_node("Neg", ["r3"], ["y"], name="neg")]
    model = _model(nodes, ["y"])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    found = segment.plan(model, 4)
    assert found is not None and found.slices[1].outputs == ()
    sliced = _same(path, model, X, 4)
    assert sliced.sessions[1] is None and sliced.sessions[0] is not None


class _Watched:
    """A slice's session whose outputs are watched: the runner must let go of each after its last reader."""

    def __init__(self, session, k, seen):
        self.session, self.k, self.seen = session, k, seen

    def run(self, names, feeds):
        gc.collect()
        self.seen.append((self.k, {n for n, ref in self.seen_refs().items() if ref() is not None}))
        out = self.session.run(names, feeds)
        for n, v in zip(names, out, strict=True):
            _Watched.refs[n] = weakref.ref(v)
        return out

    def seen_refs(self):
        return dict(_Watched.refs)

    refs: dict = {}


def test_values_are_freed_after_their_last_reader(tmp_path):
    nodes = _chain(12)
    model = _model(nodes, ["r11"])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    sliced = open_sliced(path, _open_one, size=2)
    assert isinstance(sliced, SegmentedSession)
    seen: list = []
    _Watched.refs = {}
    sliced.sessions = [_Watched(s, k, seen) for k, s in enumerate(sliced.sessions)]
    (y,) = sliced.run(["r11"], X)
    np.testing.assert_array_equal(y, np.maximum(X["x"], 0))
    # when slice k runs, it holds its own input (made by k-1) and the previous call's outputs list keeps
    # k-1's; everything made two or more slices earlier is gone
    for k, alive in seen:
        made_earlier = {f"r{2 * j + 1}" for j in range(k - 1)}
        assert not alive & made_earlier, (k, alive)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


def test_a_capture_session_with_graph_optimizations_on_is_never_sliced(tmp_path, monkeypatch):
    """When the sides could not be optimized beforehand (a > 2 GB model: optimize_for_capture gives None), the
    main session runs ORT's optimizer: a fusion across two slices would be lost, so it opens whole."""
    from qdebug.analysis import graph_engine
    from qdebug.cli.main import main
    from tests.conftest import analyze_args

    opened: list = []
    real = graph_engine.make_session

    def spy(path, config, **kw):
        opened.append((path.name, kw.get("optimize", True)))
        return real(path, config, **kw)

    monkeypatch.setattr(graph_engine, "make_session", spy)
    monkeypatch.setattr(graph_engine, "optimize_for_capture", lambda *a, **k: None)
    monkeypatch.setattr(segment, "SEGMENT_NODES", 7)
    assert main(analyze_args("cnn", tmp_path / "r.json", "--no-cache")) == 0
    assert ("main.onnx", True) in opened
    assert not [name for name, optimize in opened if optimize and ".slice" in name]
    assert any(".slice" in name for name, optimize in opened if not optimize)  # the fake-quant model still is


def test_an_initializer_that_is_a_graph_output_is_returned(tmp_path):
    """A model with a constant output (an initializer listed as a graph output): analyze on such a model
    fails with 'ONNX Runtime failed while running the fake-quant models' once its capture models are sliced."""
    inits = [numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "k")]
    model = _model(_chain(6), ["r5", "k"], inits)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    r5, k = open_sliced(path, _open_one, size=2).run(["r5", "k"], X)  # sliced or whole: either is a fix
    np.testing.assert_array_equal(k, [1.0, 2.0])
    np.testing.assert_array_equal(r5, np.maximum(X["x"], 0))


def test_a_sequence_graph_input_opens_the_model_whole(tmp_path):
    nodes = _chain(4) + [
        helper.make_node("SequenceAt", ["s", "zero"], ["s0"], name="at"),
        helper.make_node("Add", ["r3", "s0"], ["y"], name="add"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
              helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [3, 4])]  # fmt: skip
    model = _model(nodes, ["y"], [numpy_helper.from_array(np.array(0, np.int64), "zero")], inputs=inputs)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    opened = open_sliced(path, _open_one, size=2)
    feeds = {**X, "s": [np.ones((3, 4), np.float32)]}
    np.testing.assert_array_equal(opened.run(["y"], feeds)[0], np.maximum(X["x"], 0) + 1)


def test_an_explicit_size_of_zero_never_slices(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_model(_chain(6), ["r5"], []), path)
    assert isinstance(open_sliced(path, _open_one, size=0), ort.InferenceSession)
    assert isinstance(open_sliced(path, _open_one, size=2), SegmentedSession)


def test_analyze_a_model_with_a_constant_output_with_its_capture_models_sliced(tmp_path, monkeypatch):
    """An initializer listed as a graph output: no slice computes it, so such a capture model opens whole
    (it had failed the capture with a KeyError turned into 'ONNX Runtime failed while running ...')."""
    from qdebug.cli.main import main
    from tests.conftest import FIXTURES

    model = onnx.load(str(FIXTURES / "cnn" / "model.onnx"))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "const_out"))
    model.graph.output.append(helper.make_tensor_value_info("const_out", TensorProto.FLOAT, [2]))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    monkeypatch.setattr(segment, "SEGMENT_NODES", 7)
    argv = ["analyze", str(path), "--calib", str(FIXTURES / "cnn" / "calib.npz"), "-o", str(tmp_path / "r.json")]
    assert main([*argv, "-q", "--no-cache"]) == 0
