"""Tiny generated models with the traits of real exported models that break ONNX Runtime's quantizer.

Each generator writes an ``.onnx`` file (seeded numpy, a few kB) and its calibration data; the
tests in ``tests/test_quantizer_bugs.py`` check both that plain ORT still trips on the trait and
that qdebug works around it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SHARED_BIAS = "bias"
"""The bias initializer every Conv of :func:`shared_bias_cnn` reads."""
COLLIDING = f"{SHARED_BIAS}0"
"""The activation whose name ORT's first copy of the shared bias takes (``f"{name}{k}"``, k from 0)."""


def _f32(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def shared_bias_cnn(folder: Path, seed: int = 0, n: int = 24) -> tuple[Path, Path]:
    """A tf2onnx-style NHWC audio CNN whose three Convs share one all-zero bias initializer.

    tf2onnx (and jax2tf) fold equal constants into one initializer, so every Conv reads the same
    ``bias``. ORT's ``QDQQuantizer._dup_initializer`` gives each further reader a copy named
    ``bias0``, ``bias1``... checking only *initializer* names -- and the last Conv's output is
    called ``bias0``: the NCHW->NHWC Transpose reading it is rewired to the bias, and ORT
    refuses the quantized model ("Invalid attribute perm {0, 2, 3, 1}, input shape = {4}").
    Returns (model, calibration data).
    """
    rng = np.random.default_rng(seed)
    inits = [
        _f32("w1", rng.normal(0, 0.5, (4, 1, 3, 3))),
        _f32("w2", rng.normal(0, 0.3, (4, 4, 3, 3))),
        _f32("w3", rng.normal(0, 0.3, (4, 4, 3, 3))),
        _f32(SHARED_BIAS, np.zeros(4)),
        _f32("fc_w", rng.normal(0, 0.3, (4, 6))),
        _f32("fc_b", rng.normal(0, 0.1, 6)),
    ]
    conv = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}
    nodes = [
        helper.make_node("Transpose", ["spectrogram"], ["nchw"], name="Transpose__5", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w1", SHARED_BIAS], ["c1"], name="conv2d/Conv2D", **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="conv2d/Relu"),
        helper.make_node("Conv", ["r1", "w2", SHARED_BIAS], ["c2"], name="conv2d_1/Conv2D", **conv),
        helper.make_node("Relu", ["c2"], ["r2"], name="conv2d_1/Relu"),
        helper.make_node("Conv", ["r2", "w3", SHARED_BIAS], [COLLIDING], name="conv2d_2/Conv2D", **conv),
        helper.make_node("Transpose", [COLLIDING], ["nhwc"], name="Transpose__9", perm=[0, 2, 3, 1]),
        helper.make_node("Relu", ["nhwc"], ["r3"], name="conv2d_2/Relu"),
        helper.make_node("ReduceMean", ["r3"], ["pooled"], name="global_pool", axes=[1, 2], keepdims=0),
        helper.make_node("Gemm", ["pooled", "fc_w", "fc_b"], ["logits"], name="dense/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "tf2onnx_audio_cnn",
        [helper.make_tensor_value_info("spectrogram", TensorProto.FLOAT, ["N", 8, 8, 1])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 6])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="tf2onnx")
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "audio_cnn.onnx"
    onnx.save(model, str(path))
    data = folder / "audio_calib.npz"
    np.savez(data, spectrogram=rng.random((n, 8, 8, 1)).astype(np.float32))
    return path, data


SOFTMAX_OUT = "softmax_9.tmp_0"
"""The CRNN's output (Paddle-style name), the Softmax's output."""


def crnn_recognizer(folder: Path, seed: int = 0, n: int = 12, width: int = 16) -> tuple[Path, Path]:
    """A CRNN-style text recognizer head at opset 12 with its weights in ``Constant`` nodes.

    Conv-Relu-MaxPool collapses the height, then ``Squeeze`` *without axes* (legal up to opset 12)
    drops the unit dimensions of a tensor whose width is dynamic: ONNX shape inference cannot tell
    its rank (the width might be 1 too), nor that of anything after it. The per-timestep classifier
    ends in ``Softmax(axis=2)`` over the classes of ``[1, T, C]``. Converting the model to opset 13
    (per-channel weights) or 21 (16-bit types) makes ``onnx.version_converter`` keep the opset-12
    meaning of a Softmax of unknown rank by rewriting it as Shape/Flatten/Softmax/Reshape, the
    Softmax writing the new tensor ``softmax_9.tmp_0_intermediate``. Returns (model, calibration data).
    """
    rng = np.random.default_rng(seed)

    def const(name: str, arr: np.ndarray) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], name=f"{name}_const", value=_f32(name, arr))

    nodes = [
        const("conv_w", rng.normal(0, 0.5, (8, 1, 3, 3))),
        const("conv_b", rng.normal(0, 0.1, 8)),
        const("fc_w", rng.normal(0, 0.4, (8, 10))),
        const("fc_b", rng.normal(0, 0.1, 10)),
        helper.make_node("Conv", ["image", "conv_w", "conv_b"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"], name="relu"),
        helper.make_node("MaxPool", ["relu"], ["pool"], name="pool", kernel_shape=[8, 1], strides=[8, 1]),
        helper.make_node("Squeeze", ["pool"], ["seq"], name="squeeze"),  # no axes: rank unknown to ONNX
        helper.make_node("Transpose", ["seq"], ["steps"], name="transpose"),  # no perm: reversed
        helper.make_node("MatMul", ["steps", "fc_w"], ["fc"], name="fc"),
        helper.make_node("Add", ["fc", "fc_b"], ["logits"], name="fc_add"),
        helper.make_node("Unsqueeze", ["logits"], ["scores"], name="unsqueeze", axes=[0]),  # [N=1, T, C]
        helper.make_node("Softmax", ["scores"], [SOFTMAX_OUT], name="softmax_9", axis=2),
    ]
    graph = helper.make_graph(
        nodes,
        "crnn_rec",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, [1, 1, 8, "width"])],
        [helper.make_tensor_value_info(SOFTMAX_OUT, TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], producer_name="paddle2onnx")
    model.ir_version = 7
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "crnn_rec.onnx"
    onnx.save(model, str(path))
    data = folder / "crnn_calib.npz"
    np.savez(data, image=rng.random((n, 1, 8, width)).astype(np.float32))
    return path, data
