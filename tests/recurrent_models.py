"""Tiny generated models with the traits of issue 16 item 4: recurrent and dynamic-shape exports.

* :func:`cnn_lstm_reader` -- a CNN+LSTM text/captcha reader at opset 12 with a dynamic width: static
  QDQ leaves the LSTM (about half the weight bytes) in FP32.
* :func:`concat_axis_mobilenet` -- a MobileNetV3-style classifier at opset 11 with its weights in
  ``Constant`` nodes whose flatten builds the Reshape target with ``Concat(axis=-1)`` of shape values:
  ORT's ``SymbolicShapeInference._infer_Concat`` asserts ``axis == 0`` on it, so ``quant_pre_process``
  fails, and plain ``quantize_static`` keeps the Constant weights float.

Seeded numpy, a few kB each; the tests are in ``tests/test_recurrent.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LSTM_NODE = "lstm_1"
CONCAT_NODE = "flatten/concat"
FUSED_ACTIVATION = "act1"
"""The ``com.microsoft`` QuickGelu of :func:`concat_axis_mobilenet` with ``fused=True``."""
MOBILENET_WEIGHTED = ("conv1", "dw", "se/conv1", "se/conv2", "pw", "fc/matmul", "fc/add")
"""The nodes of :func:`concat_axis_mobilenet` that read a weight as input 1 (each needs its DequantizeLinear)."""


def _f32(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def cnn_lstm_reader(
    folder: Path, seed: int = 0, n: int = 8, widths: tuple[int, ...] = (12, 20), hidden: int = 32
) -> tuple[Path, Path]:
    """A Conv stem, then an LSTM over the image's columns (the width is dynamic), then a per-step classifier.

    ``[N, 1, 8, width]`` -> two 3x3 Convs (32 channels) -> MaxPool over the height -> ``[width, N, 64]``
    steps -> ``LSTM`` (hidden 32, about 54 % of the weight bytes) -> MatMul/Add -> ``[N, width, 40]``.
    The calibration data is a folder with one file per width (``n`` samples each). Returns (model, data).
    """
    rng = np.random.default_rng(seed)
    classes, features = 40, 32 * 2
    inits = [
        _f32("conv1_w", rng.normal(0, 0.4, (32, 1, 3, 3))),
        _f32("conv1_b", rng.normal(0, 0.1, 32)),
        _f32("conv2_w", rng.normal(0, 0.08, (32, 32, 3, 3))),
        _f32("conv2_b", rng.normal(0, 0.1, 32)),
        _f32("lstm_W", rng.normal(0, 0.15, (1, 4 * hidden, features))),
        _f32("lstm_R", rng.normal(0, 0.15, (1, 4 * hidden, hidden))),
        _f32("lstm_B", rng.normal(0, 0.1, (1, 8 * hidden))),
        _f32("fc_w", rng.normal(0, 0.3, (hidden, classes))),
        _f32("fc_b", rng.normal(0, 0.1, classes)),
        numpy_helper.from_array(np.array([0, 0, -1], np.int64), "steps_shape"),
    ]
    conv = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}
    nodes = [
        helper.make_node("Conv", ["image", "conv1_w", "conv1_b"], ["c1"], name="conv_1", **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu_1"),
        helper.make_node("Conv", ["r1", "conv2_w", "conv2_b"], ["c2"], name="conv_2", **conv),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu_2"),
        helper.make_node("MaxPool", ["r2"], ["pooled"], name="pool", kernel_shape=[4, 1], strides=[4, 1]),
        helper.make_node("Transpose", ["pooled"], ["columns"], name="to_steps", perm=[3, 0, 1, 2]),
        helper.make_node("Reshape", ["columns", "steps_shape"], ["steps"], name="flatten_steps"),
        helper.make_node(
            "LSTM", ["steps", "lstm_W", "lstm_R", "lstm_B"], ["y"], name=LSTM_NODE, hidden_size=hidden
        ),
        helper.make_node("Squeeze", ["y"], ["y_steps"], name="squeeze_direction", axes=[1]),
        helper.make_node("MatMul", ["y_steps", "fc_w"], ["fc"], name="fc"),
        helper.make_node("Add", ["fc", "fc_b"], ["step_logits"], name="fc_add"),
        helper.make_node("Transpose", ["step_logits"], ["logits"], name="to_batch", perm=[1, 0, 2]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn_lstm_reader",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", "width", classes])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], producer_name="keras2onnx")
    model.ir_version = 7
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "reader.onnx"
    onnx.save(model, str(path))
    data = folder / "reader_calib"
    data.mkdir(exist_ok=True)
    for w in widths:
        np.savez(data / f"width{w}.npz", image=rng.random((n, 1, 8, w)).astype(np.float32))
    return path, data


def _mobilenet_nodes(rng: np.random.Generator, fused: bool) -> list[onnx.NodeProto]:
    """The graph of :func:`concat_axis_mobilenet`: Constant weights, then the blocks, then the flatten."""

    def const(name: str, arr, dtype=np.float32) -> onnx.NodeProto:
        value = numpy_helper.from_array(np.asarray(arr, dtype=dtype), name)
        return helper.make_node("Constant", [], [name], name=f"{name}_const", value=value)

    shapes = {"conv1": (8, 3, 3, 3), "dw": (8, 1, 3, 3), "se1": (4, 8, 1, 1), "se2": (8, 4, 1, 1), "pw": (16, 8, 1, 1)}
    consts = [const(f"{k}_w", rng.normal(0, 0.4, s)) for k, s in shapes.items()]
    consts += [const(f"{k}_b", rng.normal(0, 0.1, s[0])) for k, s in shapes.items()]
    consts += [const("fc_w", rng.normal(0, 0.4, (16, 10))), const("fc_b", rng.normal(0, 0.1, 10))]
    consts += [const("minus_one", [-1], np.int64), const("zero", [0], np.int64), const("one", [1], np.int64)]
    hard_sigmoid = {"alpha": 1 / 6, "beta": 0.5}
    if fused:  # an activation ORT's optimizer fused: ONNX shape inference does not know the op
        stem = [helper.make_node("QuickGelu", ["c1"], ["a1"], name=FUSED_ACTIVATION, domain="com.microsoft")]
    else:  # hard-swish at opset 11: HardSigmoid * x
        stem = [
            helper.make_node("HardSigmoid", ["c1"], ["hs1"], name="hswish1/hsig", **hard_sigmoid),
            helper.make_node("Mul", ["c1", "hs1"], ["a1"], name="hswish1/mul"),
        ]
    return [
        *consts,
        helper.make_node("Conv", ["x", "conv1_w", "conv1_b"], ["c1"], name="conv1", pads=[1] * 4, strides=[2, 2]),
        *stem,
        helper.make_node("Conv", ["a1", "dw_w", "dw_b"], ["dw_out"], name="dw", pads=[1] * 4, group=8),
        helper.make_node("Relu", ["dw_out"], ["a2"], name="dw_relu"),
        helper.make_node("GlobalAveragePool", ["a2"], ["se_pool"], name="se/pool"),
        helper.make_node("Conv", ["se_pool", "se1_w", "se1_b"], ["se1"], name="se/conv1"),
        helper.make_node("Relu", ["se1"], ["se1_relu"], name="se/relu"),
        helper.make_node("Conv", ["se1_relu", "se2_w", "se2_b"], ["se2"], name="se/conv2"),
        helper.make_node("HardSigmoid", ["se2"], ["se_gate"], name="se/hsig", **hard_sigmoid),
        helper.make_node("Mul", ["a2", "se_gate"], ["a3"], name="se/mul"),
        helper.make_node("Conv", ["a3", "pw_w", "pw_b"], ["pw_out"], name="pw"),
        helper.make_node("GlobalAveragePool", ["pw_out"], ["pool"], name="pool"),
        helper.make_node("Shape", ["pool"], ["pool_shape"], name="flatten/shape"),
        helper.make_node("Slice", ["pool_shape", "zero", "one"], ["batch"], name="flatten/slice"),
        helper.make_node("Concat", ["batch", "minus_one"], ["flat_shape"], name=CONCAT_NODE, axis=-1),
        helper.make_node("Reshape", ["pool", "flat_shape"], ["flat"], name="flatten/reshape"),
        helper.make_node("MatMul", ["flat", "fc_w"], ["fc"], name="fc/matmul"),
        helper.make_node("Add", ["fc", "fc_b"], ["logits"], name="fc/add"),
    ]


def concat_axis_mobilenet(folder: Path, seed: int = 0, n: int = 16, fused: bool = False) -> tuple[Path, Path]:
    """A MobileNetV3-style block at opset 11, weights in ``Constant`` nodes, a flatten that trips ORT's
    symbolic shape inference.

    Conv (stride 2) + hard-swish, a depthwise Conv, a squeeze-excite block, a 1x1 Conv, global pooling,
    then ``Reshape(pool, Concat(Slice(Shape(pool), 0, 1), [-1], axis=-1))`` and the classifier. Every
    input of that Concat is a 1-D value ORT's ``SymbolicShapeInference`` tracks, and ``_infer_Concat``
    asserts ``axis == 0`` there. ``fused``: the stem's activation is ORT's contrib ``QuickGelu`` (as in a
    model saved after ORT's optimizer), which ONNX shape inference cannot type, so everything after it
    needs the symbolic inference -- or another way to its types. Returns (model, calibration data).
    """
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        _mobilenet_nodes(rng, fused),
        "mobilenet_v3_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
    )
    opsets = [helper.make_opsetid("", 11)] + ([helper.make_opsetid("com.microsoft", 1)] if fused else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="paddle2onnx")
    model.ir_version = 6
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("mobilenet_fused.onnx" if fused else "mobilenet.onnx")
    onnx.save(model, str(path))
    data = folder / "mobilenet_calib.npz"
    np.savez(data, x=rng.random((n, 3, 16, 16)).astype(np.float32))
    return path, data
