"""The indexed quantizer and calibrator (qdebug/quant/fast_quantize.py) build exactly what ORT's plain path builds.

Every comparison runs qdebug's own entry point twice, once on the fast path and once inside
``fast_quantize.plain_path()`` (ORT's ``QDQQuantizer`` / ``ONNXQuantizer`` over ORT's own ``ONNXModel``,
the code ``quantize_static`` runs), and compares ``SerializeToString(deterministic=True)`` -- or, where
ORT refuses, the error. Inputs: the task fixtures, every robustness model, and generated graphs of
several sizes; options: each one qdebug passes (per-channel, 16-bit types and the opset upgrade they
need, per-tensor overrides of type, range, axis and reduce_range, exclusions, removable activations
kept, the QOperator format). Then: the calibrator's augmented model and ranges, the scan counts that
keep the fast path linear, and the fallbacks (a changed ORT function, an index out of step, the
environment switch), each with its note.

Every test here proves the fast path against the ORT and onnx sources it was verified on, so the whole file
is skipped, naming the functions that changed, on any other release (tests/verified_ort.py;
``QDEBUG_STRICT_SOURCES=1`` runs it anyway). What holds on every release -- a changed source gives ORT's
plain path with one note and no warning, the swaps are put back -- is tests/test_fast_quantize_guards.py.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import itertools
import json
import uuid
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import qdq_quantizer, quant_utils
from onnxruntime.quantization.onnx_model import ONNXModel

from qdebug.errors import QDebugError
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant import fast_quantize
from qdebug.quant.calibrate import _dump_tensors_data, calibrate
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.records import TensorOverride
from qdebug.records.report import ExtraOption
from tests.conftest import FIXTURES, ROOT
from tests.verified_ort import verified_sources

pytestmark = verified_sources

_spec = importlib.util.spec_from_file_location("bench_quantize", ROOT / "benchmarks" / "bench_quantize.py")
assert _spec is not None and _spec.loader is not None
bench_quantize = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_quantize)

WEIGHTED = ("Conv", "MatMul", "Gemm")


def _outcome(model: onnx.ModelProto, ranges, spec: QuantSpec, fmt: str) -> bytes | str:
    try:
        return quantize_static_model(model, ranges, spec, quant_format=fmt).SerializeToString(deterministic=True)
    except QDebugError as e:
        return f"error: {e}"


def _both(model: onnx.ModelProto, ranges, spec: QuantSpec, fmt: str = "QDQ") -> tuple[bytes | str, bytes | str]:
    fast = _outcome(model, ranges, spec, fmt)
    with fast_quantize.plain_path():
        plain = _outcome(model, ranges, spec, fmt)
    return fast, plain


def _weights(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(weight, op type) of the Conv/MatMul/Gemm nodes reading a weight of rank >= 2 as input 1."""
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.op_type in WEIGHTED and ranks.get(n.input[1], 0) >= 2]
    return [(n.input[1], n.op_type) for n in nodes]


def _specs(model: onnx.ModelProto, ranges) -> list[tuple[str, QuantSpec, str]]:
    """Every option qdebug passes ORT's quantizer, on tensors and nodes of ``model``."""
    seen = ranges.minmax()
    activations = [o for n in model.graph.node for o in n.output if o in seen and n.op_type in WEIGHTED + ("Add",)]
    activations = activations or [t for t in seen if t not in {i.name for i in model.graph.initializer}]
    weights = _weights(model)
    overrides: list[TensorOverride] = []
    if activations:
        overrides.append(TensorOverride(activations[0], quant_type="QUInt16"))
        lo, hi = seen[activations[-1]]
        if len(activations) > 1 and hi > lo:
            overrides.append(TensorOverride(activations[-1], rmin=lo / 2, rmax=hi / 2))
    if weights:
        w, op = weights[0]
        overrides.append(TensorOverride(w, axis=0 if op == "Conv" else 1))
        if len(weights) > 1:
            overrides.append(TensorOverride(weights[1][0], reduce_range=True))
    quantizable = [n.name for n in model.graph.node if n.op_type in WEIGHTED + ("Add", "Mul", "Relu", "Concat")]
    fields = QuantSpec.__dataclass_fields__  # the base settings' options, where QuantSpec spells them
    base = [
        (label, QuantSpec(**{field: value}), "QDQ")
        for label, field, value in [
            ("reduce_range", "reduce_range", True),
            ("op types", "op_types", ("MatMul", "Conv", "Gemm")),
            ("nodes to quantize", "nodes_to_quantize", tuple(quantizable[1::2])),
        ]
        if field in fields
    ]
    return base + [
        ("default", QuantSpec(), "QDQ"),
        ("per-channel", QuantSpec(per_channel=True), "QDQ"),
        ("16-bit", QuantSpec(activation_type="QUInt16", weight_type="QInt16"), "QDQ"),
        ("s8 activations", QuantSpec(activation_type="QInt8", weight_type="QInt8"), "QDQ"),
        ("exclusions", QuantSpec(nodes_to_exclude=tuple(quantizable[::3])), "QDQ"),
        ("keep activations", QuantSpec(keep_removable_activations=True), "QDQ"),
        ("overrides", QuantSpec(tensor_overrides=tuple(overrides)), "QDQ"),
        ("overrides per-channel", QuantSpec(per_channel=True, tensor_overrides=tuple(overrides[:2])), "QDQ"),
        ("QOperator", QuantSpec(), "QOperator"),
        ("QOperator per-channel", QuantSpec(per_channel=True, nodes_to_exclude=tuple(quantizable[:1])), "QOperator"),
    ]


def _prepared(model: Path, calib: Path, tmp: Path):
    return prepare(model, calib, tmp, AnalyzeOptions(upgrade_opset=True, use_cache=False))


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(fast_quantize, "_NOTES", [])
    monkeypatch.delenv(fast_quantize.PLAIN_ENV, raising=False)


@pytest.fixture
def indexed_runs(monkeypatch):
    """How many quantizations ran over an IndexedModel (its end-of-run check counts them)."""
    runs = []
    original = fast_quantize.IndexedModel.check_in_step

    def counted(self, *args):
        runs.append(self)
        return original(self, *args)

    monkeypatch.setattr(fast_quantize.IndexedModel, "check_in_step", counted)
    return runs


def test_this_ort_has_the_sources_the_fast_path_was_verified_on():
    """Skipped (the file's mark) on a release that changed a replaced function, naming them; with
    ``QDEBUG_STRICT_SOURCES=1`` it fails instead, for the developer re-verifying that release
    (docs/design-notes.md, "Re-verifying a new ORT")."""
    assert fast_quantize.current_sources() == fast_quantize.VERIFIED_SOURCES
    assert fast_quantize.fast_path_problem() is None

def test_the_sources_quick_reading_is_inspects_and_a_wrong_one_only_defers_to_inspect(monkeypatch):
    """The digests are read off code objects' line numbers (no tokenizing): that text is exactly
    ``inspect.getsource``'s for every verified entry, and where it were not, inspect's would decide."""
    for label in fast_quantize.VERIFIED_SOURCES:
        fn = fast_quantize._relied_on_one(label)
        assert fast_quantize._code_lines_source(fn) == inspect.getsource(fn), label
    truth = {label: fast_quantize._digest(inspect.getsource(fast_quantize._relied_on_one(label)))
             for label in fast_quantize.VERIFIED_SOURCES}
    monkeypatch.setattr(fast_quantize, "_HASHES", {})
    monkeypatch.setattr(fast_quantize, "_code_lines_source", lambda fn: "not the source")
    assert fast_quantize.current_sources() == truth
    changed = dict(fast_quantize.VERIFIED_SOURCES, **{"ONNXModel.get_initializer": "0" * 16})
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", changed)
    monkeypatch.setattr(fast_quantize, "_HASHES", {})
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    monkeypatch.delenv(fast_quantize.PLAIN_ENV, raising=False)
    assert "ONNXModel.get_initializer" in (fast_quantize.fast_path_problem("quantizer") or "")



@pytest.mark.parametrize("fixture", ["transformer", "cnn"])
def test_task_fixtures_quantize_byte_identically_for_every_option(fixture, tmp_path, indexed_runs):
    prep = _prepared(FIXTURES / fixture / "model.onnx", FIXTURES / fixture / "calib.npz", tmp_path)
    for label, spec, fmt in _specs(prep.normalized, prep.ranges):
        fast, plain = _both(prep.normalized, prep.ranges, spec, fmt)
        assert isinstance(fast, bytes), (label, fast)
        assert fast == plain, label
    assert len(indexed_runs) >= len(_specs(prep.normalized, prep.ranges))
    assert fast_quantize.notes() == ()


ROBUSTNESS = sorted(p.stem for p in (FIXTURES / "robustness").glob("*.onnx"))


@pytest.mark.parametrize("name", ROBUSTNESS)
def test_robustness_models_quantize_byte_identically_or_fail_alike(name, tmp_path):
    calib = FIXTURES / "robustness" / f"{name}_calib.npz"
    try:
        prep = _prepared(FIXTURES / "robustness" / f"{name}.onnx", calib, tmp_path)
    except QDebugError as e:  # refused before quantization (already quantized, unknown op...): nothing to compare
        pytest.skip(f"not quantized by qdebug: {e}")
    built = {}
    for label, spec, fmt in _specs(prep.normalized, prep.ranges):
        fast, plain = _both(prep.normalized, prep.ranges, spec, fmt)
        assert fast == plain, label
        built[label] = isinstance(fast, bytes)
    assert built["default"], "the default quantization of a prepared model succeeds"
    fast, plain = _dynamic_both(prep.normalized_path, tmp_path, {})
    assert fast == plain, "dynamic"
    assert fast_quantize.notes() == ()


@pytest.mark.parametrize("blocks", [4, 15, 30])
def test_generated_graphs_quantize_byte_identically(blocks, tmp_path, indexed_runs):
    model = bench_quantize.make_chain(blocks, variety=True, seed=blocks)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    specs = _specs(prep.normalized, prep.ranges)
    if blocks > 4:  # the large ones on the options that take other code paths (the small one on all)
        specs = [s for s in specs if s[0] in ("default", "16-bit", "exclusions", "overrides", "QOperator")]
    for label, spec, fmt in specs:
        fast, plain = _both(prep.normalized, prep.ranges, spec, fmt)
        assert isinstance(fast, bytes), (label, fast)
        assert fast == plain, label
    assert indexed_runs and all(m.rebuilds <= 4 for m in indexed_runs), [m.rebuilds for m in indexed_runs]


@pytest.fixture
def round_trips(monkeypatch):
    """The shape-inference round trips made (one entry each), with nothing kept from other tests."""
    trips: list[int] = []
    real = fast_quantize.reloaded_with_shape_infer
    monkeypatch.setattr(fast_quantize, "reloaded_with_shape_infer", lambda m: trips.append(1) or real(m))
    monkeypatch.setattr(fast_quantize, "_INFERRED", {})
    monkeypatch.setattr(fast_quantize, "_OFFERED", {})
    return trips


def test_the_quantizers_shape_inference_round_trip_runs_once_per_model_content(tmp_path, monkeypatch, round_trips):
    """ORT's quantizer shape-infers its input through a save / infer_shapes_path / load round trip; the fast
    path makes it once per model content (fast_quantize.shape_inferred) and every build still equals ORT's
    plain path -- also after the model changed between builds, for a model already carrying ORT's mark, and
    above the size kept."""
    import copy

    from onnx import numpy_helper

    model = bench_quantize.make_chain(3, seed=7)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    trips = round_trips
    spec = QuantSpec()
    first, plain = _both(prep.normalized, prep.ranges, spec)
    assert isinstance(first, bytes) and first == plain
    for _ in range(2):
        assert _outcome(prep.normalized, prep.ranges, spec, "QDQ") == first
    assert len(trips) == 1  # ORT's plain path makes its own (not counted: its module holds the function)

    changed = copy.deepcopy(prep.normalized)
    weight = next(t for t in changed.graph.initializer if len(t.dims) == 2)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 2, weight.name))
    fast, plain = _both(changed, prep.ranges, spec)
    assert fast == plain and fast != first and len(trips) == 2

    marked = copy.deepcopy(prep.normalized)
    quant_utils.add_infer_metadata(marked)
    assert fast_quantize.shape_inferred(marked) == marked and len(trips) == 2
    fast, plain = _both(marked, prep.ranges, spec)
    assert isinstance(fast, bytes) and fast == plain

    monkeypatch.setattr(fast_quantize, "INFERRED_MAX_BYTES", 0)
    assert _outcome(prep.normalized, prep.ranges, spec, "QDQ") == first
    assert _outcome(prep.normalized, prep.ranges, spec, "QDQ") == first
    assert len(trips) == 4


def _cleaning_case(unused_inputs: bool, repeat: str, subgraph: bool) -> onnx.ModelProto:
    """A graph with used and unused initializers (some also graph inputs), optionally a repeated initializer
    or input name, optionally a node holding a subgraph."""
    from onnx import TensorProto, helper, numpy_helper

    def init(name: str, value: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.full((2,), value, np.float32), name)

    inits = [init("w0", 1), init("dead0", 2), init("w1", 3), init("dead1", 4), init("dead2", 5)]
    if repeat == "initializer":
        inits += [init("w1", 3), init("dead1", 4)]
    nodes = [helper.make_node("Add", ["x", "w0"], ["a"], name="add0")]
    nodes.append(helper.make_node("Mul", ["a", "w1"], ["y"], name="mul"))
    nodes.append(helper.make_node("Softmax", ["a"], ["s"], name="soft", axis=0))  # an attribute, no subgraph
    if subgraph:
        b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])
        branch = helper.make_graph(  # ORT's helper cleans a subgraph's unused initializers too
            [helper.make_node("Identity", ["a"], ["b"])], "g", [], [b], [init("sub_dead", 6)]
        )
        nodes.append(helper.make_node("If", ["cond"], ["z"], name="if", then_branch=branch, else_branch=branch))
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "dead1", "dead2", "w0")]
    if repeat == "input":
        vi.append(helper.make_tensor_value_info("dead2", TensorProto.FLOAT, [2]))
    vi = vi if unused_inputs else vi[:1]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]
    return helper.make_model(helper.make_graph(nodes, "clean", vi, outputs, inits))


@pytest.mark.parametrize("unused_inputs", [False, True])
@pytest.mark.parametrize("repeat", ["", "initializer", "input"])
@pytest.mark.parametrize("subgraph", [False, True])
@pytest.mark.parametrize("indexed_first", [False, True])
def test_unused_initializers_are_cleaned_as_orts_helper_cleans_them(unused_inputs, repeat, subgraph, indexed_first):
    """IndexedModel.clean_initializers: ORT's _clean_initializers_helper's graph and names, the same bytes,
    on graphs it takes the one-pass way and graphs it leaves to ORT (a subgraph, a repeated name); with the
    index not built yet (the clean-up reads the graph itself) and built (it takes what the index check read:
    the names, and whether a node holds a subgraph)."""
    import copy

    from onnxruntime.quantization.onnx_model import _clean_initializers_helper

    def outcome(clean, model):
        try:
            return clean(model)[1], model.SerializeToString(deterministic=True)
        except ValueError as e:  # ORT's list.remove can fail on repeated names; it must fail alike
            return f"error: {e}"

    model = _cleaning_case(unused_inputs, repeat, subgraph)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    repeated = repeat == "initializer" or (repeat == "input" and unused_inputs)
    assert fast_quantize._plainly_cleanable(ours.graph) == (not subgraph and not repeated)
    indexed = fast_quantize.IndexedModel(ours)
    if indexed_first:
        assert indexed.readers("a") and indexed.get_initializer("w0") is not None
        checked = []
        real = fast_quantize.IndexedModel._check_nodes
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fast_quantize.IndexedModel, "_check_nodes", lambda *a: checked.append(1) or real(*a))
            got = outcome(lambda m: indexed.clean_initializers(), ours)
        assert checked == [1]
    else:
        got = outcome(lambda m: indexed.clean_initializers(), ours)
    assert got == outcome(lambda m: _clean_initializers_helper(m.graph, m), theirs)
    if not repeated:
        assert {t.name for t in ours.graph.initializer} == {"w0", "w1"}
        assert indexed.get_initializer("dead0") is None and indexed.get_initializer("w1") is not None
        rebuilds = indexed.rebuilds
        indexed.check_in_step()  # the index followed the deletions: in step, and not rebuilt
        assert indexed.rebuilds == rebuilds and indexed._ni == len(ours.graph.initializer)


def _direct(model: onnx.ModelProto, ranges, extra: dict, fast: bool) -> bytes:
    """ORT's QDQQuantizer (indexed or not) with ``extra`` options qdebug's QuantSpec does not spell (yet)."""
    import copy

    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import QuantType, update_opset_version

    from qdebug.quant.calibrate import op_types_to_quantize

    work = update_opset_version(copy.deepcopy(model), QuantType.QInt8, QuantType.QUInt8,
                                tensor_quant_overrides=extra.get("TensorQuantOverrides"))
    cls = fast_quantize.indexed(QDQQuantizer) if fast else QDQQuantizer
    scope = fast_quantize.installed() if fast else fast_quantize.plain_path()
    with scope:
        q = cls(work, False, False, QuantType.QInt8, QuantType.QUInt8, copy.deepcopy(ranges.tensors), [], [],
                op_types_to_quantize(), copy.deepcopy(extra))
        q.quantize_model()
        if fast:
            q.model.check_in_step()
    return q.model.model.SerializeToString(deterministic=True)


def test_orts_other_rewiring_paths_are_byte_identical_too(tmp_path):
    """Options qdebug does not pass today but ORT rewires with other ONNXModel methods: a tensor converted
    to 16 bits for some of its readers (``replace_input_of_nodes``) and dedicated Q/DQ pairs per reader
    (``replace_node_input``)."""
    from onnxruntime.quantization.quant_utils import QuantType

    model = bench_quantize.make_chain(6, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    g = prep.normalized.graph

    def convert(tensor: str, some: bool) -> dict:
        readers = sorted(n.name for n in g.node if tensor in n.input)
        assert len(readers) >= 2
        to = {"quant_type": QuantType.QUInt16, **({"recv_nodes": set(readers[:1])} if some else {})}
        return {"TensorQuantOverrides": {tensor: [{"quant_type": QuantType.QUInt8, "convert": to}]}}

    options = [
        convert("b2/proj.out", some=True),  # two readers, one of them converted
        convert("b2/ln.out", some=True),  # a graph output too
        convert("b3/proj.out", some=False),
        {"DedicatedQDQPair": True},
        {"AddQDQPairToWeight": True, "QDQKeepRemovableActivations": True},
        {"UseQDQContribOps": True},  # the Q/DQ nodes made in place carry the domain
    ]
    marks = [b"_convert", b"_convert", b"_convert", b"_DequantizeLinear_Output_2", b"b0.w1_QuantizeLinear_Output",
             b"com.microsoft"]  # fmt: skip
    for extra, mark in zip(options, marks, strict=True):
        fast = _direct(prep.normalized, prep.ranges, extra, True)
        assert fast == _direct(prep.normalized, prep.ranges, extra, False), extra
        assert mark in fast, extra  # the option took its own path


def test_qdq_nodes_made_in_place_are_orts_and_a_float_zero_point_fails_alike():
    """The indexed quantizer's Q/DQ node makers give ORT's node list, for each maker, with and without the
    contrib domain and an axis; where ORT's check refuses a float zero point both raise the same error and
    leave the same nodes behind (ORT adds the Q node of a pair before the DQ node fails)."""
    from onnx import numpy_helper
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import QuantType

    def run(fast: bool, domain: bool, zp: str):
        model = bench_quantize.make_chain(1)
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array(0, np.uint8), "zp8"),
            numpy_helper.from_array(np.array(0.5, np.float32), "zpf"),
            numpy_helper.from_array(np.array(0.1, np.float32), "sc"),
        ])  # fmt: skip
        cls = fast_quantize.indexed(QDQQuantizer) if fast else QDQQuantizer
        scope = fast_quantize.installed() if fast else fast_quantize.plain_path()
        with scope:
            q = cls(model, False, False, QuantType.QInt8, QuantType.QUInt8, None, [], [], ["MatMul"],
                    {"UseQDQContribOps": domain})  # fmt: skip
            error = None
            try:
                q._create_qdq_nodes("x", "x_q", "x_Q", "x_q", "x_dq", "x_DQ", "sc", zp)
                q._create_q_node("x", "x_q2", "x_Q2", "sc", zp)
                q._create_dq_node("x_q2", "x_dq2", "x_DQ2", "sc", zp)
                q._create_dq_node("x_q2", "x_dq3", "x_DQ3", "sc", zp, axis=0)
            except Exception as e:
                error = (type(e), str(e))
        return error, [n.SerializeToString(deterministic=True) for n in q.model.model.graph.node]

    for domain, zp in itertools.product((False, True), ("zp8", "zpf")):
        fast = run(True, domain, zp)
        assert fast == run(False, domain, zp), (domain, zp)
        assert (fast[0] is not None) == (zp == "zpf")


def _sort_case(order: list[int], cyclic: bool = False) -> onnx.ModelProto:
    """A small graph exercising every branch of ORT's topological sort: a Constant (no inputs), an empty
    optional input, a node reading one tensor twice, an initializer that is also a graph input (sorted
    once: counted twice, it would free ``add`` and ``sub`` before ``neg``), nodes freed by one sorted input;
    its nodes listed in ``order``; ``cyclic``: two nodes feed each other."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Constant", [], ["c"], name="const", value=numpy_helper.from_array(np.ones(2, np.float32))),
        helper.make_node("Neg", ["x"], ["n"], name="neg"),
        helper.make_node("Add", ["x", "w"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "a"], ["m"], name="square"),
        helper.make_node("Clip", ["m", "", "c"], ["k"], name="clip"),
        helper.make_node("Sub", ["w", "x"], ["s"], name="sub"),
        helper.make_node("Sum", ["k", "y" if cyclic else "s", "n"], ["z"], name="out"),
        helper.make_node("Identity", ["z"], ["y"], name="tail"),
    ]
    w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    graph = helper.make_graph(
        [nodes[k] for k in order], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "w")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [w],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 4, 3, 1, 2, 5, 0], [5, 2, 0, 1, 3, 7, 4, 6]])
def test_the_indexed_topological_sort_is_orts(order):
    """The same node list as ORT's ``topological_sort`` (byte for byte) from three orders, none of them
    ORT's; a list already in ORT's order is left in place (the same node objects); a cycle fails with ORT's
    assertion."""
    expected = _sort_case(order)
    ONNXModel(expected).topological_sort()
    got = _sort_case(order)
    before = list(got.graph.node)
    fast_quantize.IndexedModel(got).topological_sort()
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    assert any(a is not b for a, b in zip(before, got.graph.node, strict=True))  # none of these is in order
    again = copy.deepcopy(expected)
    before = list(again.graph.node)
    fast_quantize.IndexedModel(again).topological_sort()  # in ORT's order already: left as it is
    assert all(a is b for a, b in zip(before, again.graph.node, strict=True))
    assert again.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    for sort in (ONNXModel.topological_sort, fast_quantize.IndexedModel.topological_sort):
        model = _sort_case(order, cyclic=True)
        with pytest.raises(AssertionError, match="not a DAG"):
            sort(fast_quantize.IndexedModel(model) if sort is not ONNXModel.topological_sort else ONNXModel(model))


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 4, 3, 1, 2, 5, 0]])
@pytest.mark.parametrize("change", ["", "indexed node", "list rewritten"])
def test_the_sort_after_a_clean_up_takes_its_reading_only_while_nothing_changed(order, change):
    """After a clean-up that read the nodes itself (the dynamic quantizer rewrote the list), the sort takes
    each node's inputs and outputs from that reading while the list is the one read and nothing changed
    through the index; after a change it reads the nodes again. Either way, ORT's order."""
    from onnx import helper

    def changed(model: onnx.ModelProto, im: fast_quantize.IndexedModel) -> None:
        if change == "indexed node":
            im.add_node(helper.make_node("Identity", ["y"], ["y2"], name="extra"))
        elif change == "list rewritten":
            nodes = list(model.graph.node)
            model.graph.ClearField("node")
            model.graph.node.extend(nodes)

    expected = _sort_case(order)
    ONNXModel(expected).topological_sort()
    got = _sort_case(order)
    im = fast_quantize.IndexedModel(got)
    nodes = list(got.graph.node)
    got.graph.ClearField("node")
    got.graph.node.extend(nodes)  # as ORT's dynamic quantizer does before its clean-up
    im.clean_initializers()
    assert im._slots_read() is not None
    changed(got, im)
    if change:
        assert im._slots_read() is None
        if change != "list rewritten":
            changed(expected, fast_quantize.IndexedModel(expected))
            ONNXModel(expected).topological_sort()
    im.topological_sort()
    assert got.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)


def test_the_fast_path_does_not_scan(tmp_path, monkeypatch):
    """What keeps it linear: no initializer list is scanned by name, and ORT's per-node input replacement
    runs about once per rewired reader (the plain path: once per node of the graph per rewired tensor)."""
    model = bench_quantize.make_chain(30, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    replaced = [0]
    plain_replace = ONNXModel.replace_node_input

    def replace(node, old, new):
        replaced[0] += 1
        return plain_replace(node, old, new)

    scans = _spied_plain_find(monkeypatch)
    monkeypatch.setattr(ONNXModel, "replace_node_input", staticmethod(replace))
    quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    nodes = len(prep.normalized.graph.node)
    assert all(scans), "every find_by_name on the graph's initializers was answered from the index"
    assert 0 < replaced[0] <= 3 * nodes
    replaced[0] = 0
    with fast_quantize.plain_path():
        quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    assert replaced[0] > 50 * nodes
    assert scans.count(False) > nodes  # the plain path scans the initializers, the spy sees it


def test_find_by_name_is_orts_own_outside_the_call_and_for_other_lists(tmp_path):
    model = bench_quantize.make_chain(3)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    seen = []
    original = qdq_quantizer.QDQQuantizer.quantize_model

    def spy(self):
        seen.append(qdq_quantizer.find_by_name)
        other = [onnx.helper.make_tensor("a", onnx.TensorProto.FLOAT, [1], [1.0])]
        assert qdq_quantizer.find_by_name("a", other) is other[0]  # a plain list: scanned as before
        assert qdq_quantizer.find_by_name("b", other) is None
        return original(self)

    qdq_quantizer.QDQQuantizer.quantize_model = spy
    try:
        quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    finally:
        qdq_quantizer.QDQQuantizer.quantize_model = original
    assert seen == [fast_quantize.find_by_name]
    assert qdq_quantizer.find_by_name is quant_utils.find_by_name is fast_quantize._PLAIN_FIND_BY_NAME
    assert not fast_quantize._ACTIVE


def test_a_changed_ort_function_falls_back_to_the_plain_path_with_a_note(tmp_path, monkeypatch, indexed_runs):
    prep = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp_path)
    with fast_quantize.plain_path():
        plain = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True))
    changed = dict(fast_quantize.VERIFIED_SOURCES, **{"ONNXModel.replace_input_of_all_nodes": "0" * 16})
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", changed)
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    assert "replace_input_of_all_nodes" in (fast_quantize.fast_path_problem("quantizer") or "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note, never a warning
        model = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True))
    assert model.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    assert not indexed_runs
    assert fast_quantize.notes() == (fast_quantize.fallback_note(),)
    # the calibrator's augmentation is checked on its own function: still fast, no second note
    augmented, real = [], fast_quantize.augment_graph
    monkeypatch.setattr(fast_quantize, "augment_graph", lambda self: augmented.append(self) or real(self))
    calibrate(prep.normalized_path, "x", prep.calib, use_cache=False)
    assert augmented and fast_quantize.notes() == (fast_quantize.fallback_note(),)


def test_an_index_out_of_step_is_caught_and_the_model_rebuilt_on_the_plain_path(tmp_path, monkeypatch):
    """Something changing a node behind the index (here: a wrapper around one of ORT's steps rewiring a
    residual Add to read the graph input) is found by the end-of-run check: the model is built again on
    the plain path, with a note, and is what the plain path gives."""
    model = bench_quantize.make_chain(3)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    original = qdq_quantizer.QDQQuantizer._quantize_bias_tensors

    def behind_the_index(self):
        original(self)
        node = next(n for n in self.model.model.graph.node if n.name == "b2/res")
        node.input[1] = "x"  # a direct write: no ONNXModel method sees it

    monkeypatch.setattr(qdq_quantizer.QDQQuantizer, "_quantize_bias_tensors", behind_the_index)
    with fast_quantize.plain_path():
        plain = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note, never a warning
        model = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    assert model.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    (text,) = fast_quantize.notes()
    assert "fell out of step" in text and "b2/res" in text


def test_the_node_check_compares_again_after_any_change_made_through_the_index(monkeypatch):
    """check_in_step does not compare a node list it found in step with nothing changed through the index
    since (the end-of-run check after the clean-up of initializers); after an indexed change it compares
    again, and finds a node changed behind the index."""
    from onnx import helper

    im = fast_quantize.IndexedModel(bench_quantize.make_chain(2))
    compared = []
    original = fast_quantize.IndexedModel._check_nodes
    monkeypatch.setattr(
        fast_quantize.IndexedModel, "_check_nodes", lambda self, c, *r: compared.append(1) or original(self, c, *r)
    )
    assert im.readers("x")  # builds the index
    im.check_in_step()
    im.check_in_step()
    assert len(compared) == 1
    im.add_node(helper.make_node("Identity", ["x"], ["x_copy"], name="extra"))
    im.check_in_step()
    assert len(compared) == 2
    im.replace_input_of_all_nodes("x_copy", "x_copy2")
    next(n for n in im.model.graph.node if n.name == "b1/res").input[1] = "x"  # a direct write
    with pytest.raises(fast_quantize.IndexOutOfStep, match="b1/res"):
        im.check_in_step()


def test_the_initializer_check_compares_again_after_any_change_made_through_the_index(monkeypatch):
    """Likewise for the initializer list: compared once while nothing changes through the index, still in
    step (and not compared again) after the clean-up's own deletions, compared again after an indexed
    change -- and then a rename made behind the index is caught."""
    from onnx import numpy_helper

    model = bench_quantize.make_chain(2)
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "dead"))
    im = fast_quantize.IndexedModel(model)
    compared = []
    original = fast_quantize.IndexedModel._check_inits
    monkeypatch.setattr(
        fast_quantize.IndexedModel, "_check_inits", lambda self, c, *r: compared.append(1) or original(self, c, *r)
    )
    assert im.get_initializer("dead") is not None  # builds the index
    im.check_in_step()
    im.check_in_step()
    assert len(compared) == 1
    im.clean_initializers()  # its own check compares nothing new; its deletions keep the index in step
    assert im.get_initializer("dead") is None and len(compared) == 1
    im.check_in_step()
    assert len(compared) == 1
    im.add_initializer(numpy_helper.from_array(np.zeros(2, np.float32), "extra"))
    next(t for t in model.graph.initializer if t.name != "extra").name = "renamed"  # a direct write
    with pytest.raises(fast_quantize.IndexOutOfStep, match="initializer list"):
        im.check_in_step()
    assert len(compared) == 2


@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("tamper", ["", "rename", "rename to another's", "rename back and forth"])
def test_the_initializer_check_agrees_with_a_full_comparison(repeated, tamper):
    """The initializer check's quick form (one lookup per initializer) raises exactly where comparing the
    index's map of name -> initializers with the list's does, with unique and with repeated names."""
    from onnx import numpy_helper

    model = bench_quantize.make_chain(2)
    if repeated:
        model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), model.graph.initializer[0].name))
    im = fast_quantize.IndexedModel(model)
    assert im.get_initializer("nothing") is None  # builds the index
    inits = model.graph.initializer
    if tamper == "rename":
        inits[1].name = "renamed"
    elif tamper == "rename to another's":
        inits[1].name = inits[2].name
    elif tamper == "rename back and forth":  # two names swapped between two initializers
        inits[1].name, inits[2].name = inits[2].name, inits[1].name

    def full() -> bool:
        expected: dict[str, list[int]] = {}
        for t in inits:
            expected.setdefault(t.name, []).append(id(t))
        indexed = {name: [id(t) for t in ts] for name, ts in im._by_name.items() if ts}
        return expected == indexed and len(im._ilive) == len(inits)

    try:
        im._check_inits(inits)
        quick = True
    except fast_quantize.IndexOutOfStep:
        quick = False
    assert quick == full() == (tamper == "")


def test_the_environment_switch_runs_the_plain_path_without_a_note(tmp_path, monkeypatch, indexed_runs):
    model = bench_quantize.make_chain(2)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    monkeypatch.setenv(fast_quantize.PLAIN_ENV, "1")
    quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    assert not indexed_runs and fast_quantize.notes() == ()


# --- the calibrator -----------------------------------------------------------------------------------


def _augmented(model_path: Path, tmp: Path, fast: bool, **extra) -> tuple[bytes, str]:
    """The augmented model ORT's MinMax calibrator writes (uuid4 made deterministic), and the error class
    if its session then fails to load it."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from qdebug.quant.calibrate import op_types_to_quantize

    counter = itertools.count()
    real = uuid.uuid4
    uuid.uuid4 = lambda: uuid.UUID(int=next(counter))  # type: ignore[assignment]
    try:
        scope = fast_quantize.fast_calibrator_augmentation() if fast else fast_quantize.plain_path()
        error = ""
        with scope:
            out = tmp / f"aug_{fast}.onnx"
            try:
                create_calibrator(
                    model_path, op_types_to_quantize(), augmented_model_path=str(out),
                    calibrate_method=CalibrationMethod.MinMax, extra_options=extra,
                )
            except Exception as e:  # noqa: BLE001 -- ORT's, compared between the paths
                error = e.__class__.__name__
    finally:
        uuid.uuid4 = real  # type: ignore[assignment]
    return onnx.load(str(out)).SerializeToString(deterministic=True), error


CALIBRATED = [
    ("transformer", FIXTURES / "transformer" / "model.onnx"),
    ("cnn", FIXTURES / "cnn" / "model.onnx"),
    *[(n, FIXTURES / "robustness" / f"{n}.onnx") for n in ("detect_concat", "multi_io", "input_as_output", "gru")],
]


@pytest.mark.parametrize(("name", "path"), CALIBRATED, ids=[c[0] for c in CALIBRATED])
def test_the_calibrators_augmented_model_is_node_for_node_orts(name, path, tmp_path):
    fast = _augmented(path, tmp_path, True)
    assert fast == _augmented(path, tmp_path, False) and fast[1] == ""


@pytest.mark.parametrize("opset", [17, 18])
def test_the_augmented_model_matches_for_generated_graphs_and_per_channel_axes(opset, tmp_path):
    model = bench_quantize.make_chain(12, variety=True)
    model.opset_import[0].version = opset  # per-channel axes: an attribute below 18, an input from 18
    onnx.save(model, tmp_path / "m.onnx")
    assert _augmented(tmp_path / "m.onnx", tmp_path, True) == _augmented(tmp_path / "m.onnx", tmp_path, False)
    fast = _augmented(tmp_path / "m.onnx", tmp_path, True, per_channel=True)
    assert fast == _augmented(tmp_path / "m.onnx", tmp_path, False, per_channel=True)


def test_a_tensor_named_like_another_tensors_reduction_takes_orts_own_augmentation(tmp_path):
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("Relu", ["a"], ["a_ReduceMin_Reshape"], name="r2"),
        helper.make_node("Add", ["a_ReduceMin_Reshape", "a"], ["y"], name="add"),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", vi[:1], vi[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(onnx.shape_inference.infer_shapes(model), tmp_path / "m.onnx")
    fast = _augmented(tmp_path / "m.onnx", tmp_path, True)
    assert fast == _augmented(tmp_path / "m.onnx", tmp_path, False)
    assert fast[1] == "Fail"  # ORT's own augmentation defines a_ReduceMin_Reshape twice: its session refuses it


def test_calibrated_ranges_are_the_same_on_both_paths(tmp_path):
    model = bench_quantize.make_chain(20, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    fast = calibrate(prep.normalized_path, "x", prep.calib, use_cache=False)
    with fast_quantize.plain_path():
        plain = calibrate(prep.normalized_path, "x", prep.calib, use_cache=False)
    assert json.dumps(_dump_tensors_data(fast.tensors)) == json.dumps(_dump_tensors_data(plain.tensors))
    assert np.isfinite([v for lo_hi in fast.minmax().values() for v in lo_hi]).all()


def _state(tensors) -> list:
    """Everything a ``TensorsData`` holds, as comparable values (arrays with their dtypes)."""
    out = [tensors.calibration_method, list(tensors.data)]
    for td in tensors.data.values():
        out.append(sorted((k, repr(v.dtype), v.tolist()) if isinstance(v, np.ndarray) else (k, repr(type(v)), repr(v))
                          for k, v in vars(td).items()))
    return out


def test_the_quantizers_private_ranges_are_a_deep_copy_sharing_nothing(tmp_path):
    from onnxruntime.quantization.calibrate import TensorData

    model = bench_quantize.make_chain(6, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    ranges = calibrate(prep.normalized_path, "x", prep.calib, use_cache=False)
    name = next(iter(ranges.tensors.data))
    edges = np.linspace(-1, 1, 5, dtype=np.float32)
    ranges.tensors.data["with_hist"] = TensorData(
        lowest=np.float32(-1), highest=np.array([1], np.float32), hist=np.arange(4), hist_edges=edges, bins=4
    )
    copied = ranges.private_tensors()
    assert _state(copied) == _state(copy.deepcopy(ranges.tensors))
    assert copied is not ranges.tensors and copied.data is not ranges.tensors.data
    for key, td in ranges.tensors.data.items():
        twin = copied.data[key]
        assert twin is not td and vars(twin)["_attrs"] is not vars(td)["_attrs"]
        for attr, value in vars(td).items():
            if isinstance(value, np.ndarray):
                assert not np.shares_memory(value, vars(twin)[attr])
    before = _state(ranges.tensors)
    copied[name] = TensorData(lowest=np.float32(-9), highest=np.float32(9))  # what ORT's adjust_tensor_ranges does
    copied.data["with_hist"].hist_edges[0] = 42.0
    copied.data["with_hist"]._attrs.append("avg")
    assert _state(ranges.tensors) == before
    # a shape it does not know (an object array) is deep-copied as before
    ranges.tensors.data["odd"] = TensorData(lowest=np.float32(0), highest=np.float32(1))
    ranges.tensors.data["odd"].hist = np.array([object()], dtype=object)
    odd = ranges.private_tensors()
    assert odd.data["odd"].hist[0] is not ranges.tensors.data["odd"].hist[0]
    assert _state(odd)[:2] == _state(ranges.tensors)[:2]


def test_a_fallback_to_the_plain_path_is_a_note_of_the_report(tmp_path, monkeypatch, indexed_runs):
    """The fallback's note reaches the user where they read notes (report.json and analyze's summary), as
    one line that says what it costs them, and nothing else: no warning, no developers' advice."""
    from qdebug.cli.main import main
    from qdebug.output.report_io import load_report

    changed = dict(fast_quantize.VERIFIED_SOURCES, **{"ONNXModel.replace_input_of_all_nodes": "0" * 16})
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", changed)
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        argv = ["analyze", str(FIXTURES / "cnn" / "model.onnx"), "--calib", str(FIXTURES / "cnn" / "calib.npz"),
                "-o", str(out), "-q", "--fakequant-samples", "0", "--flip-details", "0"]
        assert main(argv) == 0
    notes = [n for n in load_report(out).notes if "quantizer" in n]
    assert notes == [fast_quantize.fallback_note()]
    assert "VERIFIED_SOURCES" not in notes[0] and "test_fast_quantize" not in notes[0]


# --- the dynamic quantizer ----------------------------------------------------------------------------

DYNAMIC_OPTIONS = [
    ("default", {}),
    ("per-channel", {"per_channel": True}),
    ("MatMul only", {"op_types": ("MatMul",)}),
]


def _dynamic_both(model_path: Path, tmp: Path, options: dict) -> tuple[bytes | str, bytes | str]:
    """qdebug's dynamic quantization of ``model_path`` on the fast path and on ORT's plain ``quantize_dynamic``
    (the bytes written, or the error)."""
    from qdebug.quant.quantize import quantize_dynamic_model

    out = []
    for scope in (contextlib.nullcontext(), fast_quantize.plain_path()):
        path = tmp / f"dyn-{uuid.uuid4().hex}.onnx"
        try:
            with scope:
                quantize_dynamic_model(model_path, path, **options)
            out.append(path.read_bytes())
        except QDebugError as e:
            out.append(f"error: {e}")
    return out[0], out[1]


def test_the_dynamic_model_returned_without_a_file_is_the_one_written(tmp_path, indexed_runs):
    """Without an output path the fast dynamic path returns the model unwritten (propose's frontier): it is
    what ORT's quantize_dynamic writes, byte for byte, as is the plain path's read-back."""
    from qdebug.quant.quantize import quantize_dynamic_model

    model = bench_quantize.make_chain(6, variety=True, seed=2)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    written, plain = _dynamic_both(prep.normalized_path, tmp_path, {})
    assert isinstance(written, bytes) and written == plain
    runs = len(indexed_runs)
    returned = quantize_dynamic_model(prep.normalized_path)
    assert len(indexed_runs) > runs  # the fast path ran
    assert returned.SerializeToString() == written
    with fast_quantize.plain_path():
        assert quantize_dynamic_model(prep.normalized_path).SerializeToString() == written
    assert not list(tmp_path.glob("**/dynamic.onnx"))


@pytest.mark.parametrize("fixture", ["transformer", "cnn"])
def test_dynamic_quantization_is_byte_identical_to_orts_quantize_dynamic(fixture, tmp_path, indexed_runs):
    prep = _prepared(FIXTURES / fixture / "model.onnx", FIXTURES / fixture / "calib.npz", tmp_path)
    for label, options in DYNAMIC_OPTIONS:
        fast, plain = _dynamic_both(prep.normalized_path, tmp_path, options)
        assert isinstance(fast, bytes), (label, fast)
        assert fast == plain, label
    assert len({id(m) for m in indexed_runs}) == len(DYNAMIC_OPTIONS)
    assert fast_quantize.notes() == ()


@pytest.mark.parametrize("blocks", [4, 40])
def test_generated_graphs_quantize_dynamically_byte_identically(blocks, tmp_path, indexed_runs):
    model = bench_quantize.make_chain(blocks, variety=True, seed=blocks)
    onnx.save(model, tmp_path / "m.onnx")
    for label, options in DYNAMIC_OPTIONS[: 3 if blocks == 4 else 1]:
        fast, plain = _dynamic_both(tmp_path / "m.onnx", tmp_path, options)
        assert isinstance(fast, bytes), (label, fast)
        assert fast == plain, label
    assert indexed_runs and all(m.rebuilds <= 4 for m in indexed_runs), [m.rebuilds for m in indexed_runs]


def _spied_plain_find(monkeypatch) -> list[bool]:
    """ORT's ``find_by_name`` replaced, wherever ORT's modules hold it, by a spy recording for each call
    whether it scanned a plain list (True) or a graph's initializer container (False)."""
    for part in ("quantizer", "dynamic quantizer", "calibrator"):  # checked (and cached) on ORT's own sources
        assert fast_quantize.fast_path_problem(part) is None
    scans: list[bool] = []
    plain_find = fast_quantize._PLAIN_FIND_BY_NAME

    def find(name, items):
        scans.append(isinstance(items, list))
        return plain_find(name, items)

    for module in fast_quantize._ort_modules():
        if getattr(module, "find_by_name", None) is plain_find:
            monkeypatch.setattr(module, "find_by_name", find)
    monkeypatch.setattr(fast_quantize, "_PLAIN_FIND_BY_NAME", find)
    return scans


def test_the_dynamic_fast_path_does_not_scan_the_initializers_or_new_nodes(tmp_path, monkeypatch):
    model = bench_quantize.make_chain(30, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    scans = _spied_plain_find(monkeypatch)
    from qdebug.quant.quantize import quantize_dynamic_model

    with fast_quantize.plain_path():
        quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "p.onnx")
    assert scans.count(False) > 3 * 30  # ORT's own path: several scans of the initializers per MatMul
    assert scans.count(True) >= 30  # and one of the nodes made so far per MatMul (quantizer.new_nodes)
    scans.clear()
    quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "d.onnx")
    assert not scans, "every find_by_name on the initializers or the new nodes was answered from an index"
    assert onnx.load(tmp_path / "d.onnx").SerializeToString() == onnx.load(tmp_path / "p.onnx").SerializeToString()


def test_a_changed_quantize_dynamic_falls_back_for_the_dynamic_path_only(tmp_path, monkeypatch, indexed_runs):
    model = bench_quantize.make_chain(4, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    with fast_quantize.plain_path():
        _, plain = _dynamic_both(tmp_path / "m.onnx", tmp_path, {})
    changed = dict(fast_quantize.VERIFIED_SOURCES, **{"quantize.quantize_dynamic": "0" * 16})
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", changed)
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    assert fast_quantize.fast_path_problem("quantizer") is None  # the static path is not concerned
    from qdebug.quant.quantize import quantize_dynamic_model

    assert "quantize_dynamic" in (fast_quantize.fast_path_problem("dynamic quantizer") or "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note, never a warning
        quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "d.onnx")
    assert (tmp_path / "d.onnx").read_bytes() == plain
    assert not indexed_runs
    assert fast_quantize.notes() == (fast_quantize.fallback_note(),)


def test_a_changed_calibrator_function_leaves_the_quantizer_and_dynamic_quantizer_fast(monkeypatch):
    """Each path falls back on the sources it relies on only: a changed ``augment_graph`` concerns the
    calibrator, not the static or dynamic quantizer."""
    changed = dict(fast_quantize.VERIFIED_SOURCES, **{"MinMaxCalibrater.augment_graph": "0" * 16})
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", changed)
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    assert fast_quantize.fast_path_problem("quantizer") is None
    assert fast_quantize.fast_path_problem("dynamic quantizer") is None
    assert "MinMaxCalibrater.augment_graph" in (fast_quantize.fast_path_problem("calibrator") or "")


def test_a_dynamic_index_out_of_step_is_caught_and_the_model_rebuilt_on_the_plain_path(tmp_path, monkeypatch):
    """Something changing the graph behind the dynamic quantizer's index (here: a wrapper around one of
    ORT's steps renaming a weight in place, and its readers) is found by the check: the model is written
    again by ORT's own ``quantize_dynamic``, with a note, and is what it writes."""
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer

    from qdebug.quant.quantize import quantize_dynamic_model

    onnx.save(bench_quantize.make_chain(3), tmp_path / "m.onnx")
    original = ONNXQuantizer._dequantize_outputs

    def behind_the_index(self):
        original(self)
        weight = self.model.model.graph.initializer[0]  # not the last: the list looks untouched to the tripwire
        old, weight.name = weight.name, weight.name + "_moved"  # direct writes: no ONNXModel method sees them
        for node in self.new_nodes:
            node.input[:] = [weight.name if i == old else i for i in node.input]

    monkeypatch.setattr(ONNXQuantizer, "_dequantize_outputs", behind_the_index)
    with fast_quantize.plain_path():
        quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "plain.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a note, never a warning
        quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "d.onnx")
    assert (tmp_path / "d.onnx").read_bytes() == (tmp_path / "plain.onnx").read_bytes()
    (text,) = fast_quantize.notes()
    assert "dynamic quantizer" in text and "fell out of step" in text and "initializer list changed" in text


def test_an_opset_9_model_is_upgraded_alike_by_the_dynamic_fast_path(tmp_path):
    """``quantize_dynamic`` upgrades a model below opset 10 to 11 before quantizing (ORT's quantizer refuses
    it otherwise): the fast path's replay of its body does the same, byte for byte."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Relu", ["h"], ["y"], name="relu"),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)]), tmp_path / "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast, plain = _dynamic_both(tmp_path / "m.onnx", tmp_path, {})
    assert isinstance(fast, bytes), fast
    assert fast == plain
    assert [o.version for o in onnx.load_from_string(fast).opset_import if o.domain in ("", "ai.onnx")] == [11]


def test_the_collector_is_paused_inside_the_quantizer_and_restored_after(tmp_path, monkeypatch):
    """ORT's quantizer runs with Python's cyclic collector off (it walked propose's live records every few
    hundred allocations), and the collector is the caller's again afterwards, also after an error."""
    import gc

    from qdebug.quant import quantize

    seen = []
    real = quant_utils.update_opset_version

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    fast_quantize.current_sources()  # ORT's digests read before the spy stands in for its function
    monkeypatch.setattr(quant_utils, "update_opset_version", spy)
    prep = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp_path)
    assert gc.isenabled()
    quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        with quantize.collector_paused():
            pass
        assert not gc.isenabled()  # it was off: left off
    finally:
        gc.enable()
    with pytest.raises(RuntimeError), quantize.collector_paused():
        raise RuntimeError("quantizer failed")
    assert gc.isenabled()


def test_the_collector_comes_back_after_the_quantizer_is_freed(tmp_path, monkeypatch):
    """The collector is switched back on once ORT's quantizer and qdebug's index are freed: the first
    allocation after that runs a collection over every young object still alive (24 ms at 3,200 nodes
    with the quantizer still referenced)."""
    import gc
    import weakref

    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    made = []
    real_quantize = QDQQuantizer.quantize_model

    def spy(self):
        assert isinstance(self.model, fast_quantize.IndexedModel)
        made.append((weakref.ref(self), weakref.ref(self.model)))
        return real_quantize(self)

    monkeypatch.setattr(QDQQuantizer, "quantize_model", spy)
    alive_at_enable = []
    real_enable = gc.enable

    def enable():
        alive_at_enable.append([r() is not None for pair in made for r in pair])
        real_enable()

    monkeypatch.setattr(gc, "enable", enable)
    prep = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp_path)
    alive_at_enable.clear()
    made.clear()
    quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    assert len(made) == 1 and made[0][1]() is None
    assert alive_at_enable == [[False, False]]


def _orts_channels(data, axis, quant_type, symmetric, reduce_range, min_real_range):
    """ORT's own per-channel loop (QDQQuantizer._calc_initializer_quant_params' branch)."""
    zps, scales = [], []
    for i in range(data.shape[axis]):
        zp, scale = quant_utils.compute_data_quant_params(
            data.take(i, axis).ravel(), quant_type, symmetric, reduce_range=reduce_range,
            min_real_range=min_real_range,
        )
        zps.append(zp)
        scales.append(scale)
    return np.asarray(zps), np.asarray(scales)


def _channel_cases():
    rng = np.random.default_rng(7)
    w = rng.normal(size=(8, 5, 3)).astype(np.float32)
    w[1] = 0.0  # a zero channel: ORT's tiny-scale branch (scale 1, zero point 0)
    w[2] = np.abs(w[2])  # all positive
    w[3] = -np.abs(w[3])  # all negative
    w[4] *= 1e-30  # scales below float32's tiny
    w[5] *= 3e4
    w[6] = -0.0
    yield w
    yield rng.uniform(-1, 3, size=(16, 16)).astype(np.float32)
    yield (rng.standard_cauchy(size=(4, 6, 2, 2)) * 10).astype(np.float32)  # outliers


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_channel_parameters_are_orts_bit_for_bit(axis):
    types = [onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16]
    for data, quant_type, symmetric, reduce_range, real in itertools.product(
        _channel_cases(), types, (True, False), (False, True), (None, 0.0, 1e-4, 5.0)
    ):
        ax = axis % data.ndim
        ours = fast_quantize.channel_quant_params(data, ax, quant_type, symmetric, reduce_range, real)
        theirs = _orts_channels(data, ax, quant_type, symmetric, reduce_range, real)
        label = (data.shape, ax, quant_type, symmetric, reduce_range, real)
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, label
            assert a.tobytes() == b.tobytes(), label


def test_per_channel_weights_skip_orts_loop_and_build_the_same_model(tmp_path, monkeypatch):
    """The vectorized branches really run (ORT's loop computes no initializer of the chain: neither its
    per-channel weights nor its per-tensor LayerNorm and Add initializers), and the model is byte-identical
    with per-channel, reduce_range and a minimum real range."""
    model = bench_quantize.make_chain(3)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    calls = []
    original = quant_utils.compute_data_quant_params

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(qdq_quantizer, "compute_data_quant_params", counted)
    channels = sum(t.dims[1] for t in prep.normalized.graph.initializer if len(t.dims) == 2)  # MatMul: axis 1
    for extra in ({}, {"MinimumRealRange": 1e-3}):
        options = tuple(ExtraOption(k, v) for k, v in extra.items())
        spec = QuantSpec(per_channel=True, reduce_range=True, base_extra=options)
        calls.clear()
        fast = _outcome(prep.normalized, prep.ranges, spec, "QDQ")
        on_fast = len(calls)
        with fast_quantize.plain_path():
            plain = _outcome(prep.normalized, prep.ranges, spec, "QDQ")
        assert isinstance(fast, bytes) and fast == plain, extra
        assert channels and on_fast == 0 and len(calls) > channels, (on_fast, len(calls), channels)


def _weight_cases():
    """(weight, quant type, zero points, scales, axis) as ORT's per-channel branch gets them, and beyond:
    float16 weights, float64 scales, ties at .5, zero and huge channels, every axis, 1-4 dimensions."""
    rng = np.random.default_rng(11)
    types = [onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16]
    for k in range(400):
        shape = tuple(int(d) for d in rng.integers(1, 6, size=int(rng.integers(1, 5))))
        w = rng.standard_normal(shape) * 10.0 ** int(rng.integers(-5, 5))
        if k % 5 == 1:
            w = np.round(w * 4) / 4  # halves: round-half-to-even decides
        if k % 7 == 2:
            w[...] = 0.0
        w = w.astype(np.float16 if k % 3 == 0 and np.abs(w).max() < 6e4 else np.float32)
        axis = int(rng.integers(-len(shape), len(shape)))
        quant_type = types[k % 4]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(quant_type)
        scale_dtype = np.float64 if k % 2 else np.float32
        scale = (np.abs(rng.standard_normal(shape[axis])) * 10.0 ** int(rng.integers(-4, 2)) + 1e-8).astype(scale_dtype)
        if k % 11 == 3:
            scale[...] = 0.125  # exact divisions
        info = np.iinfo(dtype)
        zero_point = rng.integers(info.min, info.max, size=shape[axis], endpoint=True).astype(dtype)
        yield onnx.numpy_helper.from_array(w, f"w{k}"), quant_type, zero_point, scale, axis


def test_per_channel_weights_are_quantized_to_orts_bytes_in_one_pass():
    """qdebug's ``quantize_onnx_initializer`` gives ORT's initializer byte for byte, with the bulk pass taken
    for every plain per-channel case; NaN, block-wise, per-tensor and odd arguments are ORT's own call."""
    plain = fast_quantize._PLAIN_QUANTIZE_INITIALIZER
    bulk = 0
    for weight, quant_type, zero_point, scale, axis in _weight_cases():
        ours = fast_quantize.quantize_onnx_initializer(weight, quant_type, zero_point, scale, axis, "q")
        theirs = plain(weight, quant_type, zero_point, scale, axis, "q")
        assert ours.SerializeToString() == theirs.SerializeToString(), (weight.name, axis, quant_type)
        bulk += fast_quantize.channel_quantized(weight, quant_type, zero_point, scale, axis, 0) is not None
    assert bulk == 400
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    s, z = np.full(4, 0.5, np.float32), np.zeros(4, np.int8)
    nan = w.copy()
    nan[0, 0] = np.nan
    left_to_ort = [
        (onnx.numpy_helper.from_array(nan, "n"), onnx.TensorProto.INT8, z, s, 1, 0),  # NaN's cast
        (onnx.numpy_helper.from_array(w, "w"), onnx.TensorProto.INT8, z, s, None, 0),  # per tensor
        (onnx.numpy_helper.from_array(w, "w"), onnx.TensorProto.INT8, z[:1], s[:1], 0, 2),  # block-wise
        (onnx.numpy_helper.from_array(w, "w"), onnx.TensorProto.INT4, z, s, 1, 0),  # 4-bit: ORT packs
        (onnx.numpy_helper.from_array(w, "w"), onnx.TensorProto.INT8, z, s[:3], 1, 0),  # scales too few
        (onnx.numpy_helper.from_array(w, "w"), onnx.TensorProto.INT8, z, list(s), 1, 0),  # not an array
        (onnx.numpy_helper.from_array(w, "w"), onnx.TensorProto.INT8, z, s, 2, 0),  # axis out of range
    ]
    for args in left_to_ort:
        assert fast_quantize.channel_quantized(*args) is None, args[1:]


def test_the_bulk_weight_quantization_runs_inside_the_call_only(tmp_path, monkeypatch):
    """Inside qdebug's quantizer ORT's modules call the bulk ``quantize_onnx_initializer`` (ORT's own never
    sees a per-channel weight of the chain), and hold ORT's own function again after."""
    model = bench_quantize.make_chain(3)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    axes = []
    plain = fast_quantize._PLAIN_QUANTIZE_INITIALIZER

    def spy(weight, quant_type, zero_point, scale, axis=None, quant_weight_name=None, block_size=0):
        axes.append(axis)
        return plain(weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size)

    fast_quantize.current_sources()  # ORT's digests read before the spy stands in for its function
    monkeypatch.setattr(fast_quantize, "_PLAIN_QUANTIZE_INITIALIZER", spy)
    for module in (qdq_quantizer, quant_utils):
        monkeypatch.setattr(module, "quantize_onnx_initializer", spy)
    monkeypatch.setattr(fast_quantize, "PREQUANTIZE_MAX_BYTES", 0)  # the per-tensor weights go to ORT's
    quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True))
    assert axes and all(a is None for a in axes)  # only the per-tensor weights (biases, norms) reach ORT's
    assert qdq_quantizer.quantize_onnx_initializer is spy
    axes.clear()
    with fast_quantize.plain_path():
        quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True))
    assert any(a is not None for a in axes)  # ORT's plain path quantizes each channel itself


def test_new_nodes_lookups_are_orts_first_match():
    nodes = fast_quantize.NamedList()
    make = onnx.helper.make_node
    nodes.append(make("Mul", ["a"], ["b"], name="m"))
    nodes += [make("Mul", ["a"], ["c"], name="n"), make("Mul", ["a"], ["d"], name="m")]
    assert fast_quantize.find_by_name("m", nodes) is nodes[0]
    assert fast_quantize.find_by_name("x", nodes) is None
    nodes.extend([make("Add", ["a"], ["e"], name="x")])
    assert fast_quantize.find_by_name("x", nodes) is nodes[3]
    nodes.pop(0)  # any other change drops the index
    assert fast_quantize.find_by_name("m", nodes) is nodes[1]
    nodes[0] = make("Add", ["a"], ["f"], name="y")
    assert fast_quantize.find_by_name("n", nodes) is None
    assert fast_quantize.find_by_name("y", nodes) is nodes[0]
    nodes[1].name = "z"  # renamed behind the list: seen when the old name is asked for
    assert fast_quantize.find_by_name("m", nodes) is None
    assert fast_quantize.find_by_name("z", nodes) is nodes[1]
    plain = list(nodes)
    assert [fast_quantize.find_by_name(n, nodes) for n in "xyzm"] == [
        quant_utils.find_by_name(n, plain) for n in "xyzm"
    ]


# --- the shape-inference round trip with onnx's external-data steps in one pass -----------------------


def _round_trip_model() -> onnx.ModelProto:
    """Weights on each side of onnx's external-data threshold (991 bytes of raw data is
    ``sys.getsizeof`` 1024), one in ``float_data`` (never moved), an int64 shape a Reshape reads, a
    Constant-node weight and an output whose shape only inference gives."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    big = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w_big")
    edge_bytes = bytes(range(256)) * 3 + bytes(223)
    edge = onnx.TensorProto(name="edge", data_type=TensorProto.UINT8, dims=[991], raw_data=edge_bytes)
    below = onnx.TensorProto(name="below", data_type=TensorProto.UINT8, dims=[990], raw_data=bytes(990))
    listed = helper.make_tensor("w_list", TensorProto.FLOAT, [16, 16], rng.standard_normal(256).tolist())
    shape = numpy_helper.from_array(np.array([4, 64], dtype=np.int64), "shape")
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones((16, 16), np.float32)))
    nodes = [
        const,
        helper.make_node("MatMul", ["x", "w_big"], ["h"], name="mm"),
        helper.make_node("MatMul", ["h", "w_list"], ["h2"], name="mm2"),
        helper.make_node("MatMul", ["h2", "c"], ["h3"], name="mm3"),
        helper.make_node("Reshape", ["h3", "shape"], ["y"], name="reshape"),
        helper.make_node("Cast", ["edge"], ["e"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Cast", ["below"], ["b"], name="cast2", to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 16])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "e", "b")],
        [big, edge, below, listed, shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "source", ["planted", "cnn", "transformer", "chain", "robustness/detect_concat.onnx", "robustness/lstm.onnx"]
)
def test_the_round_trip_in_one_pass_is_orts_byte_for_byte(source, monkeypatch):
    """``reloaded_with_shape_infer`` gives what ORT's ``save_and_reload_model_with_shape_infer`` gives,
    byte for byte, and moves the same tensors out of the model file (so inference reads the same)."""
    if source == "planted":
        model = _round_trip_model()
    elif source == "chain":
        model = bench_quantize.make_chain(6, variety=True)
    elif "/" in source:
        model = onnx.load(FIXTURES / source)
    else:
        model = onnx.load(FIXTURES / source / "model.onnx")
    before = model.SerializeToString()
    seen: list[list[str]] = []
    plain_infer = onnx.shape_inference.infer_shapes_path

    def spy(path, out="", *args):
        moved = onnx.load(path, load_external_data=False)
        seen.append(sorted(t.name for t in moved.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL))
        return plain_infer(path, out, *args)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes_path", spy)
    ours = fast_quantize.reloaded_with_shape_infer(model)
    theirs = fast_quantize._PLAIN_RELOAD(model)
    assert ours.SerializeToString() == theirs.SerializeToString()
    assert len(seen) == 2 and seen[0] == seen[1]
    assert model.SerializeToString() == before  # the input is not touched
    if source == "planted":
        assert seen[0] == ["edge", "w_big"]
        assert {v.name for v in ours.graph.value_info} >= {"h", "h3"}


def test_the_round_trip_leaves_subgraphs_external_tensors_and_changed_sources_to_ort(monkeypatch):
    calls = []
    monkeypatch.setattr(fast_quantize, "_PLAIN_RELOAD", lambda m: calls.append(m) or m)
    for name in ("if_subgraph.onnx", "loop.onnx"):
        model = onnx.load(FIXTURES / "robustness" / name)
        assert fast_quantize.reloaded_with_shape_infer(model) is model
    external = _round_trip_model()
    external.graph.initializer[0].data_location = onnx.TensorProto.EXTERNAL
    assert fast_quantize.reloaded_with_shape_infer(external) is external
    changed = dict(fast_quantize.VERIFIED_SOURCES, **{"external_data_helper.save_external_data": "0" * 16})
    monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", changed)
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    monkeypatch.delenv(fast_quantize.PLAIN_ENV, raising=False)
    model = _round_trip_model()
    assert fast_quantize.reloaded_with_shape_infer(model) is model
    assert len(calls) == 4
    assert fast_quantize.fast_path_problem("quantizer") is None  # onnx's helpers concern the round trip only
    with fast_quantize.plain_path():
        label = "external_data_helper.save_external_data"
        restored = dict(changed, **{label: fast_quantize._source_hash(label)})
        monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", restored)
        monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
        assert fast_quantize.reloaded_with_shape_infer(model) is model  # plain_path() asks for ORT's
    assert len(calls) == 5


def test_the_dynamic_quantizers_second_round_trip_is_the_one_pass_one(tmp_path, monkeypatch, indexed_runs):
    """``ONNXQuantizer.__init__`` re-infers shapes after its Gemm rewrite through the swapped function, and the
    model is still ORT's ``quantize_dynamic``'s, byte for byte."""
    model = bench_quantize.make_chain(4, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    calls = []
    ours = fast_quantize.reloaded_with_shape_infer
    monkeypatch.setattr(fast_quantize, "reloaded_with_shape_infer", lambda m: calls.append(1) or ours(m))
    fast, plain = _dynamic_both(tmp_path / "m.onnx", tmp_path, {})
    assert isinstance(fast, bytes) and fast == plain
    assert calls == [1]


# --- per-tensor weights quantized in bulk ------------------------------------------------------------------


def _gemm_chain(tmp: Path) -> tuple[onnx.ModelProto, Path]:
    """Two Gemm layers with biases, the second's weight tiny next to its bias: ORT enlarges that weight's
    scale (``_adjust_weight_quant_params_for_bias_tensors``) between computing it and quantizing the weight."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b0"),
        numpy_helper.from_array((rng.standard_normal((8, 8)) * 1e-6).astype(np.float32), "w1"),
        numpy_helper.from_array((rng.standard_normal(8) * 1e3).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["h0"], name="g0"),
        helper.make_node("Relu", ["h0"], ["r0"], name="relu"),
        helper.make_node("Gemm", ["r0", "w1", "b1"], ["h1"], name="g1"),
        helper.make_node("MatMul", ["h1", "w2"], ["y"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp / "gemm.onnx"
    onnx.save(model, path)
    calib = tmp / "gemm_calib.npz"
    np.savez(calib, x=rng.standard_normal((16, 8)).astype(np.float32))
    return model, calib


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(),
        QuantSpec(weight_type="QUInt8"),
        QuantSpec(activation_type="QUInt16", weight_type="QInt16"),
        QuantSpec(reduce_range=True),
        QuantSpec(
            tensor_overrides=(TensorOverride("w2", reduce_range=True), TensorOverride("w0", quant_type="QUInt8"))
        ),
    ],
    ids=["s8", "u8", "16-bit", "reduce_range", "overrides"],
)
def test_per_tensor_weights_quantized_in_bulk_are_orts_and_a_rescaled_weight_is_left_to_ort(
    tmp_path, monkeypatch, spec
):
    _, calib = _gemm_chain(tmp_path)
    prep = _prepared(tmp_path / "gemm.onnx", calib, tmp_path / "w")
    asked: dict[str, bool] = {}
    real_take = fast_quantize._taken_prequantized

    def take(weight, *args):
        found = real_take(weight, *args)
        asked[weight.name] = found is not None
        return found

    monkeypatch.setattr(fast_quantize, "_taken_prequantized", take)
    fast, plain = _both(prep.normalized, prep.ranges, spec)
    assert isinstance(fast, bytes) and fast == plain
    signed = spec.weight_type in ("QInt8", "QInt16")  # ORT rescales a symmetric weight: it quantizes it itself
    assert asked == {"w0": True, "w1": not signed, "w2": True}


def test_bulk_quantization_keeps_to_its_caps(tmp_path, monkeypatch):
    _, calib = _gemm_chain(tmp_path)
    prep = _prepared(tmp_path / "gemm.onnx", calib, tmp_path / "w")
    taken: list[str] = []
    real_take = fast_quantize._taken_prequantized
    monkeypatch.setattr(fast_quantize, "_taken_prequantized", lambda w, *a: (r := real_take(w, *a)) is not None
                        and taken.append(w.name) or r)
    monkeypatch.setattr(fast_quantize, "PREQUANTIZE_MAX_BYTES", 8 * 8 * 4)  # room for one weight
    monkeypatch.setattr(fast_quantize, "_PREQUANTIZE_CHUNK", 1)  # one weight per chunk
    fast, plain = _both(prep.normalized, prep.ranges, QuantSpec())
    assert fast == plain and taken == ["w0"]
    monkeypatch.setattr(fast_quantize, "PREQUANTIZE_MAX_BYTES", 1 << 20)
    monkeypatch.setattr(fast_quantize, "PREQUANTIZE_MAX_ELEMENTS", 63)
    taken.clear()
    fast, plain = _both(prep.normalized, prep.ranges, QuantSpec())
    assert fast == plain and not taken


def test_dynamic_weights_answered_in_bulk_are_orts(tmp_path, monkeypatch):
    """The dynamic quantizer's per-weight ``quantize_data`` is answered from one bulk pass over the graph's
    weights (looked up by the weights' bytes and the options), and the model is ORT's byte for byte -- with
    two weights of equal bytes among them, and the weights above the size cap left to ORT."""
    from onnx import numpy_helper

    model = bench_quantize.make_chain(6, variety=True, seed=5)
    weights = [t for t in model.graph.initializer if list(t.dims) == [16, 16]]
    weights[2].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weights[1]), weights[2].name))
    onnx.save(model, tmp_path / "m.onnx")
    monkeypatch.setattr(fast_quantize, "PREQUANTIZE_MAX_ELEMENTS", 256)  # the 48x16 weights are ORT's
    tables: list[dict] = []
    real = fast_quantize._weights_quantized
    monkeypatch.setattr(fast_quantize, "_weights_quantized", lambda *a: tables.append(real(*a)) or tables[-1])
    answered: list[int] = []
    real_quantize_data = fast_quantize.quantize_data

    def counted(data, *args, **kwargs):
        out = real_quantize_data(data, *args, **kwargs)  # the first call makes the table
        answered.append(data.size if any(data.tobytes() in t for t in tables) else -data.size)
        return out

    monkeypatch.setattr(fast_quantize, "quantize_data", counted)
    fast, plain = _dynamic_both(tmp_path / "m.onnx", tmp_path, {})
    assert isinstance(fast, bytes) and fast == plain
    assert len(tables) == 1  # one bulk pass (its graph holds the Gemm weights ORT transposed too)
    assert numpy_helper.to_array(weights[1]).tobytes() in tables[0]  # both equal weights' entry
    assert sorted(set(answered)) == [-768, 256]


def test_the_clean_up_takes_the_names_the_index_check_read(tmp_path, monkeypatch, indexed_runs):
    """The clean-up of initializers reads the nodes' input and output names off the index check's own pass
    over the graph: the names a fresh scan gives, and the model still ORT's."""
    model = bench_quantize.make_chain(4, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    seen = []
    real = fast_quantize.clean_initializers

    def spy(graph, removed=None, read=None):
        fresh = ({n for node in graph.node for n in node.input}, {n for node in graph.node for n in node.output})
        inits = [t.name for t in graph.initializer]
        seen.append((read.reads, read.writes) == fresh and read.initializers == inits and read.subgraph is False)
        return real(graph, removed, read)

    monkeypatch.setattr(fast_quantize, "clean_initializers", spy)
    fast, plain = _both(prep.normalized, prep.ranges, QuantSpec())
    assert isinstance(fast, bytes) and fast == plain
    assert seen == [True]


def test_quantized_weights_are_made_as_numpy_helper_makes_them():
    """integer_tensor (the quantized weight's tensor): from_array's message for the 8- and 16-bit integer
    types at their extremes, of every rank and empty, named or not; data of a dtype other than its ONNX type's
    is from_array's own (it types the tensor by the dtype)."""
    from onnx import TensorProto, numpy_helper

    types = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16,
             TensorProto.UINT16: np.uint16}  # fmt: skip
    for data_type, dtype in types.items():
        info = np.iinfo(dtype)
        values = np.array([info.min, 0, 1, info.max] * 3, dtype)
        for data in (values.reshape(3, 4), values.reshape(2, 3, 2), values[:1].reshape(()), values[:0]):
            for name in ("w_quantized", ""):
                ours = fast_quantize.integer_tensor(data, name, data_type)
                assert ours.SerializeToString() == numpy_helper.from_array(data, name).SerializeToString()
    other = np.arange(4, dtype=np.int32)
    ours = fast_quantize.integer_tensor(other, "w", TensorProto.INT8)
    assert ours.data_type == TensorProto.INT32 and ours == numpy_helper.from_array(other, "w")


def _weights_model() -> onnx.ModelProto:
    """MatMuls over weights of several kinds: plain, overridden (scale and zero point; symmetry), constant,
    holding a NaN, and a float16 one nothing reads."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {
        "w": rng.normal(size=(4, 3)).astype(np.float32),
        "w_over": rng.normal(size=(4, 3)).astype(np.float32),
        "w_sym": rng.normal(size=(4, 3)).astype(np.float32),
        "w_const": np.full((4, 3), 0.5, np.float32),
        "w_nan": np.array([[1, np.nan, 2]] * 4, np.float32),
        "w_half": rng.normal(size=(4, 3)).astype(np.float16),
    }
    read = [k for k in weights if k != "w_half"]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", k], [f"y_{k}"], name=f"mm_{k}") for k in read], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(f"y_{k}", TensorProto.FLOAT, [2, 3]) for k in read],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("reduce_range", [False, True])
def test_the_dynamic_quantizers_weights_are_made_as_orts_method_makes_them(reduce_range, monkeypatch):
    """quantize_initializer_impl (the indexed ONNXQuantizer's): ORT's names, tensors and errors, appended in
    ORT's order -- for 8- and 16-bit types, kept float weights, a constant weight and one holding a NaN (ORT's
    assertion) -- with weights that have overrides, and float16 ones, left to ORT's own method; the tensors
    made in place are indexed where they are."""
    import copy

    from onnx import TensorProto
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, QuantType

    extra = {"TensorQuantOverrides": {"w_over": [{"scale": np.float32(0.05), "zero_point": np.int8(3)}],
                                      "w_sym": [{"symmetric": False}]}}  # fmt: skip

    def quantizer(cls):
        return cls(_weights_model(), False, reduce_range, QuantizationMode.IntegerOps, False, QuantType.QInt8,
                   QuantType.QUInt8, None, [], [], ["MatMul"], copy.deepcopy(extra))  # fmt: skip

    def outcome(q, name, qtype, keep):
        try:
            return q.quantize_initializer_impl(q.model.get_initializer(name), qtype, True, keep)
        except Exception as e:  # noqa: BLE001 -- compared with ORT's
            return repr(e)

    plain = []
    real = fast_quantize._PLAIN_QUANTIZE_INITIALIZER_IMPL
    monkeypatch.setattr(
        fast_quantize, "_PLAIN_QUANTIZE_INITIALIZER_IMPL", lambda *a: plain.append(a[1].name) or real(*a)
    )
    with fast_quantize.installed():
        ours, theirs = quantizer(fast_quantize.indexed(ONNXQuantizer)), quantizer(ONNXQuantizer)
        results = []
        for name in ("w", "w_over", "w_sym", "w_const", "w_nan", "w_half"):
            for qtype in (TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16):
                for keep in (False, True):
                    mine = outcome(ours, name, qtype, keep)
                    assert mine == outcome(theirs, name, qtype, keep), (name, qtype, keep)
                    results.append(mine)
        assert isinstance(ours.model, fast_quantize.IndexedModel)
        ours.model.check_in_step()
    assert sorted(set(plain)) == ["w_half", "w_over", "w_sym"]
    assert sum("scale issue" in str(r) for r in results) == 6  # w_nan: ORT's assertion, through ours
    mine = [t.SerializeToString() for t in ours.model.model.graph.initializer]
    assert mine == [t.SerializeToString() for t in theirs.model.model.graph.initializer]


def test_float32_tensors_are_read_as_numpy_helper_reads_them(tmp_path, monkeypatch):
    """float32_array: to_array's array (values, dtype, shape, read-only flag) for float32 tensors in raw_data
    and in float_data, of every rank and empty; tensors stored elsewhere (external data, a segment) and of
    other types are to_array's own, errors included. The swapped tensor_proto_to_array raises ORT's error for
    an integer tensor, and ORT's modules hold ORT's function again once the quantizer is done."""
    from onnx import TensorProto, external_data_helper, helper, numpy_helper
    from onnxruntime.quantization import base_quantizer

    def outcome(read, tensor):
        try:
            a = read(tensor)
            return a.dtype, a.shape, a.tobytes(), a.flags.writeable
        except Exception as e:  # noqa: BLE001 -- compared with to_array's
            return repr(e)

    values = np.array([1.5, -0.0, np.finfo(np.float32).tiny, 3e38, np.nan, -np.inf], np.float32)
    tensors = []
    for data in (values.reshape(2, 3), values.reshape(3, 1, 2), values[:1].reshape(()), values[:0]):
        tensors.append(numpy_helper.from_array(data, "raw"))
        tensors.append(helper.make_tensor("floats", TensorProto.FLOAT, data.shape, data.ravel().tolist()))
    tensors.append(numpy_helper.from_array(np.array([1.5, -2, 0.25], np.float16), "half"))
    tensors.append(numpy_helper.from_array(np.arange(4, dtype=np.int8), "int8"))
    segmented = numpy_helper.from_array(values, "segmented")
    segmented.segment.begin = 0
    tensors.append(segmented)
    external = numpy_helper.from_array(values, "external")
    external_data_helper.set_external_data(external, "w.bin")
    (tmp_path / "w.bin").write_bytes(values.tobytes())
    external.ClearField("raw_data")
    for tensor in tensors:
        assert outcome(fast_quantize.float32_array, tensor) == outcome(numpy_helper.to_array, tensor), tensor.name
        theirs = outcome(fast_quantize._PLAIN_TENSOR_PROTO_TO_ARRAY, tensor)
        assert outcome(fast_quantize.tensor_proto_to_array, tensor) == theirs, tensor.name
    assert "Only float type is supported" in str(outcome(fast_quantize.tensor_proto_to_array, tensors[-2]))
    monkeypatch.chdir(tmp_path)  # the external file's path is relative: to_array looks it up from here
    ours, theirs = outcome(fast_quantize.float32_array, external), outcome(numpy_helper.to_array, external)
    assert ours == theirs and ours[2] == values.tobytes()
    with fast_quantize.installed():
        assert base_quantizer.tensor_proto_to_array is fast_quantize.tensor_proto_to_array
    assert base_quantizer.tensor_proto_to_array is fast_quantize._PLAIN_TENSOR_PROTO_TO_ARRAY


def test_find_by_name_answers_for_the_list_it_is_given_after_the_model_is_replaced():
    """The swapped find_by_name answers from the index for the list the index was built over, and for the
    graph's list: after an indexed model's proto is replaced, both the old list and the new one get ORT's
    answer (the first element of that name in that list), and a None list is ORT's error."""
    from onnx import numpy_helper

    def tensor(name: str, value: float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.full(2, value, np.float32), name)

    old, new = bench_quantize.make_chain(2), bench_quantize.make_chain(2)
    old.graph.initializer.append(tensor("extra", 1))
    new.graph.initializer.extend([tensor("extra", 2), tensor("extra", 3)])
    with fast_quantize.installed():
        im = fast_quantize.IndexedModel(old)
        with pytest.raises(TypeError):  # before the index is built as after
            fast_quantize.find_by_name("extra", None)
        old_list = old.graph.initializer
        assert fast_quantize.find_by_name("extra", old_list) is im.get_initializer("extra")  # the index built
        im.model = new
        for items in (old_list, new.graph.initializer, old_list):
            assert fast_quantize.find_by_name("extra", items) == fast_quantize._PLAIN_FIND_BY_NAME("extra", items)
            assert fast_quantize.find_by_name("nothing", items) is None
        assert numpy_helper.to_array(fast_quantize.find_by_name("extra", new.graph.initializer))[0] == 2
        with pytest.raises(TypeError):
            fast_quantize.find_by_name("extra", None)


def test_what_is_read_of_the_input_model_is_kept_for_its_content_only(tmp_path, monkeypatch):
    """quantize_static_model reads its input model's node names, names and float16 exclusions once per
    content: a second build of the same content reads nothing again, and the same object changed in place
    (a node renamed) is read afresh -- the new name is excludable, the old one refused."""
    from qdebug.quant import quantize

    prep = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp_path)
    model = copy.deepcopy(prep.normalized)
    reads = []
    real = quantize._Facts.__init__
    monkeypatch.setattr(quantize._Facts, "__init__", lambda self, m: reads.append(1) or real(self, m))
    monkeypatch.setattr(quantize, "_FACTS", {})
    first = quantize_static_model(model, prep.ranges, QuantSpec())
    assert quantize_static_model(model, prep.ranges, QuantSpec()) == first and len(reads) == 1
    node = next(n for n in model.graph.node if n.op_type == "Conv")
    old, node.name = node.name, node.name + "_renamed"
    quantize_static_model(model, prep.ranges, QuantSpec(nodes_to_exclude=(node.name,)))
    assert len(reads) == 2
    with pytest.raises(QDebugError, match="not in the model"):
        quantize_static_model(model, prep.ranges, QuantSpec(nodes_to_exclude=(old,)))


@pytest.mark.parametrize("case", ["no gemm", "gemm", "gemm in a subgraph"])
def test_gemm_replacement_is_orts_and_leaves_a_graph_without_gemm_alone(case):
    """IndexedModel.replace_gemm_with_matmul: ORT's graph and transposed names; a graph with no Gemm and no
    subgraph is left as it is (its nodes the same objects), where ORT copies every node out and back."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "w")
    gemm = helper.make_node("Gemm", ["x", "w"], ["g"], name="gemm", transB=1)
    soft = helper.make_node("Softmax", ["x"], ["s"], name="soft", axis=1)
    nodes = [soft, helper.make_node("MatMul", ["x", "w2"], ["m"], name="mm")]
    if case == "gemm":
        nodes.append(gemm)
    elif case == "gemm in a subgraph":
        out = helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 3])
        branch = helper.make_graph([gemm], "b", [], [out])
        nodes.append(helper.make_node("If", ["c"], ["z"], name="if", then_branch=branch, else_branch=branch))
    w2 = numpy_helper.from_array(np.ones((2, 2), np.float32), "w2")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 2])], [w, w2])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    ours_model, theirs_model = copy.deepcopy(model), copy.deepcopy(model)
    first = ours_model.graph.node[0]
    ours = fast_quantize.IndexedModel(ours_model).replace_gemm_with_matmul()
    theirs = ONNXModel(theirs_model).replace_gemm_with_matmul()
    assert ours == theirs and ours_model.SerializeToString() == theirs_model.SerializeToString()
    assert (ours_model.graph.node[0] is first) == (case == "no gemm")
    assert any(n.op_type == "Gemm" for n in model.graph.node) == (case == "gemm")
    if case == "gemm":
        assert ours == {"w_Transposed": "w"}


def test_a_shape_inferred_copy_saved_by_one_process_is_taken_by_the_next(tmp_path, round_trips):
    """save_inferred / offer_inferred: the copy kept for a model's content, saved with its key, versions and
    sha256, is taken by a later build of that content instead of the round trip -- the same model as ORT's
    plain path -- and is not taken when the file changed, when another onnx / ORT / qdebug made it, or for
    another content (the round trip runs)."""
    model = bench_quantize.make_chain(4, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    trips = round_trips
    saved = tmp_path / "files" / fast_quantize.INFERRED_FILE
    assert not fast_quantize.save_inferred(prep.normalized, saved)  # nothing kept yet: nothing written
    first = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    assert len(trips) == 1 and fast_quantize.save_inferred(prep.normalized, saved)

    def build_in_a_new_process() -> bytes:
        fast_quantize._INFERRED.clear()
        return quantize_static_model(prep.normalized, prep.ranges, QuantSpec()).SerializeToString()

    assert fast_quantize.offer_inferred(saved)
    assert build_in_a_new_process() == first.SerializeToString() and len(trips) == 1  # taken: no round trip
    with fast_quantize.plain_path():
        assert quantize_static_model(prep.normalized, prep.ranges, QuantSpec()) == first
    assert build_in_a_new_process() == first.SerializeToString() and len(trips) == 2  # an offer is taken once

    data = saved.read_bytes()
    saved.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # changed after it was offered
    assert fast_quantize.offer_inferred(saved)
    assert build_in_a_new_process() == first.SerializeToString() and len(trips) == 3
    saved.write_bytes(data)
    with pytest.MonkeyPatch.context() as other_versions:
        other_versions.setattr(fast_quantize, "_versions", lambda: {"onnx": "0", "onnxruntime": "0", "qdebug": "0"})
        assert not fast_quantize.offer_inferred(saved)  # made by other versions
    assert fast_quantize.offer_inferred(saved)
    other = copy.deepcopy(prep.normalized)
    other.graph.node[0].name += "_other"
    fast_quantize._INFERRED.clear()
    quantize_static_model(other, prep.ranges, QuantSpec())  # another content: its own round trip
    assert len(trips) == 4
    assert not fast_quantize.offer_inferred(tmp_path / "missing.onnx")


def test_propose_takes_the_shape_inferred_model_analyze_saved(tmp_path, monkeypatch):
    """analyze saves the normalized model as its quantizer shape-inferred it next to its static model, and
    propose's first static build takes it (in a fresh process nothing else is kept)."""
    from qdebug.cli.main import main

    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    model = bench_quantize.make_chain(4, variety=True)
    onnx.save(model, tmp_path / "m.onnx")
    calib = bench_quantize.chain_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert main(["analyze", str(tmp_path / "m.onnx"), "--calib", str(calib), "-o", str(report), "-q"]) == 0
    files = tmp_path / "r_files"
    assert (files / fast_quantize.INFERRED_FILE).is_file() and (files / f"{fast_quantize.INFERRED_FILE}.json").is_file()
    fast_quantize._INFERRED.clear()  # what a new process starts with
    taken = []
    real = fast_quantize._offered_copy
    monkeypatch.setattr(fast_quantize, "_offered_copy", lambda key: taken.append(real(key)) or taken[-1])
    # A target no INT8 model reaches (200 dB output SQNR) makes propose build static models on any CPU: with
    # the default top1_agreement target, a VNNI CPU's static model may already meet it, and propose then
    # builds nothing (the AVX2 kernels' saturation is what made static miss it there).
    argv = ["propose", str(report), "--model", str(tmp_path / "m.onnx"), "--calib", str(calib), "-o",
            str(tmp_path / "p.json"), "--target-sqnr", "200", "--max-evaluations", "4", "--time-runs", "0",
            "-q"]  # fmt: skip
    assert main(argv) in (0, 6)
    assert taken and isinstance(taken[0], onnx.ModelProto)


@pytest.mark.parametrize("fixture", ["cnn", "chain"])
def test_the_names_the_index_check_read_are_the_quantized_models(fixture, tmp_path, monkeypatch):
    """The checks after the quantizer take the result's names from the clean-up's index check where it
    hands them over: the same inputs, initializers, outputs in order and producers as a fresh read of the
    result, for every option (ORT's QOperator path and the plain path read afresh)."""
    from qdebug.quant import quantize

    if fixture == "chain":
        onnx.save(bench_quantize.make_chain(4, variety=True), tmp_path / "m.onnx")
        prep = _prepared(tmp_path / "m.onnx", bench_quantize.chain_data(tmp_path / "c.npz"), tmp_path / "w")
    else:
        prep = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp_path)
    taken = []
    real = quantize._Names.of.__func__

    def compared(cls, model, read=None):
        names = real(cls, model, read)
        fresh = quantize._Names(model)
        assert (names.inputs, names.initializers, names.written) == (fresh.inputs, fresh.initializers, fresh.written)
        assert names.producer.keys() == fresh.producer.keys()
        assert all(names.producer[k] == fresh.producer[k] for k in fresh.producer)
        taken.append(read is not None)
        return names

    monkeypatch.setattr(quantize._Names, "of", classmethod(compared))
    specs = _specs(prep.normalized, prep.ranges)
    for label, spec, fmt in specs:
        fast, plain = _both(prep.normalized, prep.ranges, spec, fmt)
        assert fast == plain, label
    assert taken[1::2] == [False] * len(specs)  # the plain path reads afresh
    assert taken[0::2] == [fmt == "QDQ" for _, _, fmt in specs]  # every fast QDQ build hands its reading over


@pytest.mark.parametrize("change", ["", "indexed node", "node behind the index", "initializer behind the index",
                                    "indexed initializer"])  # fmt: skip
def test_the_names_read_at_the_clean_up_are_handed_over_only_while_nothing_changed(change):
    """IndexedModel.final_names: the clean-up's reading while the graph's lists are the ones it read and
    nothing changed through the index since; None after any change (the names are then read again)."""
    from onnx import helper, numpy_helper

    model = bench_quantize.make_chain(2)
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "dead"))
    im = fast_quantize.IndexedModel(model)
    assert im.readers(model.graph.node[0].input[0]) and im.get_initializer("dead") is not None
    assert im.final_names() is None  # nothing read yet
    im.clean_initializers()
    if change == "indexed node":
        im.add_node(helper.make_node("Identity", [model.graph.node[0].output[0]], ["extra"], name="extra"))
    elif change == "node behind the index":
        model.graph.node.append(helper.make_node("Identity", [model.graph.node[0].output[0]], ["extra"]))
    elif change == "initializer behind the index":
        model.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "extra"))
    elif change == "indexed initializer":
        im.add_initializer(numpy_helper.from_array(np.ones(2, np.float32), "extra"))
    read = im.final_names()
    if change:
        assert read is None
    else:
        assert read is not None and read.initializers == [t.name for t in model.graph.initializer]
        assert read.written == [o for n in model.graph.node for o in n.output] and "dead" not in read.initializers


def test_the_sources_are_checked_alike_while_qdebugs_stand_ins_are_swapped_in(monkeypatch):
    """The verified sources read inside installed() -- where ORT's modules hold qdebug's find_by_name,
    quantize_data, tensor_proto_to_array... -- are ORT's own functions': the first check of a process may
    run there, and reading the stand-ins' sources would turn the fast path off for the whole process."""
    monkeypatch.setattr(fast_quantize, "_HASHES", {})
    monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
    with fast_quantize.installed():
        assert quant_utils.tensor_proto_to_array is fast_quantize.tensor_proto_to_array
        assert fast_quantize.current_sources() == fast_quantize.VERIFIED_SOURCES
        assert fast_quantize.fast_path_problem() is None
        assert fast_quantize.fast_path_problem("dynamic quantizer") is None


def test_biases_are_quantized_as_orts_method_quantizes_them(caplog):
    """quantize_bias_static_impl (the indexed QDQQuantizer's): ORT's names, tensors, scale data and warning,
    appended in ORT's order, for a bias, a zero one, beta 0, one past int32 (ORT's warning) and per-channel
    weight scales; float16 biases, an explicit bias-scale dtype and a missing bias are ORT's own method
    (its error alike); the tensors made in place are indexed where they are."""
    import copy
    import logging

    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import QuantType

    biases = {"b": np.array([0.5, -1.25, 3.0], np.float32), "b_zero": np.zeros(3, np.float32),
              "b_huge": np.array([1e12, -1e12, 1.0], np.float32),
              "b_half": np.array([0.5, 1, 2], np.float16)}  # fmt: skip
    graph = helper.make_graph(
        [], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])], [],
        [numpy_helper.from_array(v, k) for k, v in biases.items()],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])

    def quantizer(cls):
        return cls(copy.deepcopy(model), False, False, QuantType.QInt8, QuantType.QUInt8, None, [], [], [], {})

    def outcome(q, *args):
        try:
            with caplog.at_level(logging.WARNING):
                caplog.clear()
                out = q.quantize_bias_static_impl(*args)
                return (*out[:3], out[3].dtype, out[3].tobytes(), *out[4:]), [r.getMessage() for r in caplog.records]
        except Exception as e:  # noqa: BLE001 -- compared with ORT's
            return repr(e)

    scalar, channels = np.array(0.02, np.float32), np.array([0.1, 0.2, 0.4], np.float32)
    cases = [("b", scalar, scalar, 1.0, None), ("b_zero", scalar, scalar, 1.0, None), ("b", scalar, scalar, 0.0, None),
             ("b_huge", scalar, np.array(1e-6, np.float32), 1.0, None), ("b", scalar, channels, 1.0, None),
             ("b_half", scalar, scalar, 1.0, None), ("b", scalar, scalar, 1.0, np.float32),
             ("missing", scalar, scalar, 1.0, None)]  # fmt: skip
    ours, theirs = quantizer(fast_quantize.indexed(QDQQuantizer)), quantizer(QDQQuantizer)
    plain = []
    real = fast_quantize._PLAIN_QUANTIZE_BIAS_IMPL
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            fast_quantize, "_PLAIN_QUANTIZE_BIAS_IMPL", lambda q, name, *a: plain.append(name) or real(q, name, *a)
        )
        results = []
        for case in cases:
            results.append(outcome(ours, *case))
            assert results[-1] == outcome(theirs, *case), case
    assert plain == ["b_half", "b", "missing"]
    assert "exceeds the range of a int32" in str(results[3]) and "scale" not in str(results[0][1])
    assert isinstance(ours.model, fast_quantize.IndexedModel)
    ours.model.check_in_step()
    mine = [t.SerializeToString() for t in ours.model.model.graph.initializer]
    assert mine == [t.SerializeToString() for t in theirs.model.model.graph.initializer]


def test_dynamic_exclusions_and_7_bit_weights_are_byte_identical_to_orts(tmp_path, indexed_runs):
    """The dynamic and mixed recipes pass nodes_to_exclude and reduce_range (7-bit weights, where the CPU's u8s8
    kernels saturate) to quantize_dynamic: the fast path writes what ORT's own does with them."""
    prep = _prepared(FIXTURES / "transformer" / "model.onnx", FIXTURES / "transformer" / "calib.npz", tmp_path)
    matmuls = [n.name for n in prep.normalized.graph.node if n.op_type == "MatMul"][:2]
    options = {"reduce_range": True, "nodes_to_exclude": tuple(matmuls)}
    fast, plain = _dynamic_both(prep.normalized_path, tmp_path, options)
    assert isinstance(fast, bytes) and fast == plain
    excluded = onnx.load_model_from_string(fast)
    assert {n.name for n in excluded.graph.node if n.op_type == "MatMul"} >= set(matmuls)  # left float
