"""Contracts of graph_engine.OptimizedSides.moved and per_sample's reading of the sides: a scratch
lacking a side gives no sides and leaves no directory behind; a complete one is moved (weights files
included) and deleted by cleanup; a pair the capture did not measure (an integer tensor) does not make the
drill-down give up the sides -- its numbers are nan, as from the Taps."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from qdebug.analysis import measure_layers, per_sample
from qdebug.analysis.graph_engine import OptimizedSides
from qdebug.graph.match import pair_models
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.runtime.capture import SessionConfig
from tests.test_per_sample_sides import sessions_opened


def _sides_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("qdebug-sides-*"))


def test_a_scratch_lacking_a_side_gives_no_sides_and_no_directory(tmp_path):
    (tmp_path / "fp32-optimized.onnx").write_bytes(b"model")
    (tmp_path / "fp32-optimized.data").write_bytes(b"weights")
    before = _sides_dirs()
    assert OptimizedSides.moved(tmp_path, frozenset({"a"}), frozenset({"b"})) is None
    assert _sides_dirs() == before


def test_a_complete_scratch_is_moved_with_its_weights_and_cleaned_up(tmp_path):
    for tag in OptimizedSides.TAGS:
        (tmp_path / f"{tag}.onnx").write_bytes(b"model")
    (tmp_path / "qdq-optimized.data").write_bytes(b"weights")  # one side with a weights file, one without
    sides = OptimizedSides.moved(tmp_path, frozenset({"a"}), frozenset({"b"}))
    assert sides is not None and sides.fp32.is_file() and sides.qdq.is_file()
    assert (sides.qdq.parent / "qdq-optimized.data").read_bytes() == b"weights"
    assert not any(tmp_path.iterdir())  # moved, not copied
    assert (sides.fp32_names, sides.qdq_names) == (frozenset({"a"}), frozenset({"b"}))
    sides.cleanup()
    assert not sides.fp32.parent.exists()


def _argmax_model(tmp: Path):
    """MatMul -> ArgMax (an int64 tensor both models have, which the capture does not measure) -> Cast -> Mul."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (8, 8)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("ArgMax", ["h"], ["am"], name="argmax", axis=1, keepdims=1),
        helper.make_node("Cast", ["am"], ["amf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["h", "amf"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], [w],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp / "m.onnx")
    np.savez(tmp / "c.npz", x=rng.normal(0, 1, (16, 8)).astype(np.float32))
    prep = prepare(tmp / "m.onnx", tmp / "c.npz", tmp / "work", AnalyzeOptions(use_cache=False))
    qproto = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(), load_check=False)
    return prep, qproto, pair_models(prep.normalized, qproto)


def test_an_unmeasured_integer_pair_keeps_the_drill_down_on_the_sides(tmp_path, monkeypatch):
    prep, qproto, pairing = _argmax_model(tmp_path)
    layers = measure_layers(prep.normalized, qproto, pairing, prep.calib, SessionConfig(), keep_sides=True)
    sides = layers.sides
    assert sides is not None and "am" not in sides.fp32_names  # the capture skipped the integer tensor
    batch = next(iter(prep.calib.batches()))
    samples = [per_sample.cut(i, batch.feeds, i, batch.size, batch.axes) for i in range(2)]
    opened = sessions_opened(monkeypatch)
    args = (prep.normalized, qproto, pairing, samples, SessionConfig())
    shape, through_sides = per_sample.sample_tensors(*args, sides=sides, aliases=layers.aliases)
    assert opened == [False, False]  # the sides, not the Taps
    monkeypatch.undo()
    _, through_taps = per_sample.sample_tensors(*args)
    k = shape.names.index("am")
    for m, n in zip(through_sides, through_taps, strict=True):
        assert math.isnan(m.sqnr_db[k]) and math.isnan(n.sqnr_db[k])
        same = [j for j in range(len(shape.names)) if j != k]
        assert all(
            (math.isnan(m.sqnr_db[j]) and math.isnan(n.sqnr_db[j]))
            or math.isclose(m.sqnr_db[j], n.sqnr_db[j], rel_tol=1e-9, abs_tol=1e-9)
            for j in same
        )
    sides.cleanup()
