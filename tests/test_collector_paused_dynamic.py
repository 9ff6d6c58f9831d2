"""Contracts of quantize.collector_paused's second use: ORT's dynamic quantizer (both its fast
and its plain path) also runs with Python's cyclic collector off, and the caller's state is restored."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.quant import fast_quantize, quantize


def _matmul_model(path):
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [w],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)


@pytest.mark.parametrize("plain", [False, True])
def test_the_dynamic_quantizer_runs_with_the_collector_paused(tmp_path, monkeypatch, plain):
    _matmul_model(tmp_path / "m.onnx")
    seen = []
    for name in ("_dynamic_indexed", "_dynamic_plain"):
        real = getattr(quantize, name)

        def spy(*args, _real=real, **kwargs):
            seen.append(gc.isenabled())
            return _real(*args, **kwargs)

        monkeypatch.setattr(quantize, name, spy)
    assert gc.isenabled()
    if plain:
        with fast_quantize.plain_path():
            quantize.quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "d.onnx")
    else:
        quantize.quantize_dynamic_model(tmp_path / "m.onnx", tmp_path / "d.onnx")
    assert seen == [False] and gc.isenabled()
    assert any(n.op_type == "DynamicQuantizeLinear" for n in onnx.load(str(tmp_path / "d.onnx")).graph.node)
