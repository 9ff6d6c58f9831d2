"""Tiny models built in the tests themselves (the committed fixtures live in fixtures/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def save_graph(graph: onnx.GraphProto, path: Path, *, opsets: dict[str, int] | None = None) -> Path:
    """Save ``graph`` as a model (opset 17 unless told, IR 8: what this ORT accepts) at ``path``."""
    imports = [helper.make_opsetid(domain, version) for domain, version in (opsets or {"": 17}).items()]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    onnx.save(model, str(path))
    return Path(path)


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr, dtype=np.float32), name)


def small_cnn(path: Path, *, unnamed: bool = True, opset: int = 17, seed: int = 0) -> Path:
    """Conv-Relu-Conv-BN-Add-Relu-GAP-Flatten-Gemm with two unnamed nodes."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.5, (4, 1, 3, 3))),
        _init("b1", np.zeros(4)),
        _init("w2", rng.normal(0, 0.3, (4, 4, 3, 3))),
        _init("b2", np.zeros(4)),
        _init("fc_w", rng.normal(0, 0.3, (4, 10))),
        _init("fc_b", np.zeros(10)),
        _init("bn_s", np.ones(4)),
        _init("bn_b", np.zeros(4)),
        _init("bn_m", np.zeros(4)),
        _init("bn_v", np.ones(4)),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c2", "bn_s", "bn_b", "bn_m", "bn_v"], ["bn2"], name="bn2"),
        helper.make_node("Add", ["bn2", "r1"], ["add"], name="res_add"),
        helper.make_node("Relu", ["add"], ["r2"], name="" if unnamed else "relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"], name="" if unnamed else "gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "small_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def small_data(path: Path, n: int = 40, seed: int = 1, labels: bool = True) -> Path:
    """Random images for small_cnn."""
    rng = np.random.default_rng(seed)
    arrays = {"input": rng.random((n, 1, 8, 8)).astype(np.float32)}
    if labels:
        arrays["labels"] = rng.integers(0, 10, n)
    np.savez(path, **arrays)
    return path


def branch_reads_outer_weight(path: Path, seed: int = 0) -> Path:
    """MatMul-Relu, then an ``If`` on the input's sign whose else branch multiplies by a weight of the
    *outer* graph (exporters write this for weights shared by branches), then MatMul."""
    rng = np.random.default_rng(seed)

    def branch(tag: str, weight: str) -> onnx.GraphProto:
        nodes = [
            helper.make_node("MatMul", ["r", weight], [f"m_{tag}"], name=f"mm_{tag}"),
            helper.make_node("Add", [f"m_{tag}", f"b_{tag}"], [f"o_{tag}"], name=f"add_{tag}"),
        ]
        out = [helper.make_tensor_value_info(f"o_{tag}", TensorProto.FLOAT, ["N", 16])]
        inits = [_init(f"b_{tag}", np.zeros(16)), _init(f"w_{tag}", rng.normal(0, 0.3, (16, 16)))]
        return helper.make_graph(nodes, f"g_{tag}", [], out, inits)

    nodes = [
        helper.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
        helper.make_node("Relu", ["a"], ["r"], name="relu0"),
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"], name="positive"),
        helper.make_node(
            "If",
            ["c"],
            ["i"],
            name="branch",
            then_branch=branch("then", "w_then"),
            else_branch=branch("else", "w_outer"),
        ),
        helper.make_node("MatMul", ["i", "w1"], ["y"], name="mm1"),
    ]
    inits = [
        _init("w0", rng.normal(0, 0.3, (16, 16))),
        _init("w1", rng.normal(0, 0.3, (16, 16))),
        _init("w_outer", rng.normal(0, 0.3, (16, 16))),
        _init("zero", np.array(0.0)),
    ]
    graph = helper.make_graph(
        nodes,
        "branch_reads_outer_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def masked_attention(
    path: Path, *, nan_mask: bool = False, additive: float | None = None, seed: int = 0
) -> Path:
    """Causal self-attention whose mask puts -inf in the scores: ``Where(mask, scores, -inf)`` as PyTorch's
    ``masked_fill`` exports it, or (``nan_mask``) the broken ``scores + (1 - mask) * -inf``, NaN where
    the mask is 1 (0 * inf), or (``additive``) ``scores + (1 - mask) * additive`` (e.g. -1e9)."""
    rng = np.random.default_rng(seed)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    inits = [_init("wq", rng.normal(0, 0.4, (8, 8))), _init("wo", rng.normal(0, 0.4, (8, 8)))]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
        helper.make_node("Transpose", ["x"], ["xt"], name="k_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "xt"], ["scores"], name="qk"),
    ]
    if nan_mask or additive is not None:
        inits += [
            _init("keep", causal.astype(np.float32)),
            _init("one", np.array(1.0)),
            _init("ninf", np.array(-np.inf if additive is None else additive)),
        ]
        nodes += [
            helper.make_node("Sub", ["one", "keep"], ["drop"], name="mask_inv"),
            helper.make_node("Mul", ["drop", "ninf"], ["madd"], name="mask_mul"),
            helper.make_node("Add", ["scores", "madd"], ["masked"], name="mask_add"),
        ]
    else:
        inits += [numpy_helper.from_array(causal, "keep"), _init("ninf", np.array(-np.inf))]
        nodes.append(helper.make_node("Where", ["keep", "scores", "ninf"], ["masked"], name="mask_where"))
    nodes += [
        helper.make_node("Softmax", ["masked"], ["p"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["p", "x"], ["ctx"], name="pv"),
        helper.make_node("MatMul", ["ctx", "wo"], ["y"], name="o_proj"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def sequence_split(path: Path, seed: int = 0) -> Path:
    """MatMul, SplitToSequence, ConcatFromSequence, Relu, MatMul: a sequence-typed value mid-graph."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("SplitToSequence", ["h"], ["parts"], name="split", axis=1, keepdims=1),
        helper.make_node("ConcatFromSequence", ["parts"], ["cat"], name="concat", axis=1),
        helper.make_node("Relu", ["cat"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "sequence_split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [_init("w", rng.normal(0, 0.3, (8, 8))), _init("w2", rng.normal(0, 0.3, (8, 4)))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def embedding_classifier(path: Path, vocab: int = 50, seed: int = 0) -> Path:
    """Token ids [N, 8] -> Gather from a [vocab, 16] table -> LayerNorm -> mean -> MatMul -> 3 logits."""
    rng = np.random.default_rng(seed)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["N", 8])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])
    inits = [
        _init("emb", rng.standard_normal((vocab, 16)).astype(np.float32)),
        _init("gamma", np.ones(16, np.float32)),
        _init("beta", np.zeros(16, np.float32)),
        _init("w", rng.standard_normal((16, 3)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "input_ids"], ["e"], name="embed"),
        helper.make_node("LayerNormalization", ["e", "gamma", "beta"], ["ln"], name="ln", axis=-1),
        helper.make_node("ReduceMean", ["ln"], ["pooled"], name="pool", axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "w"], ["logits"], name="cls"),
    ]
    return save_graph(helper.make_graph(nodes, "embedding_classifier", [ids], [out], inits), path)


def pooled_audio_classifier(folder: Path, seed: int = 0) -> tuple[Path, Path, Path]:
    """(model, calib, eval): 1-D conv branches (Conv/Relu/ConvTranspose and Conv/Tanh), Concat, a mean over
    time, then a Gemm head. The mean averages upstream noise away, so the head *introduces* less than
    nothing, yet its own weights and Q/DQ are what keep the output below ~43 dB."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return _init(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))

    x = helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["N", 1, 64])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])
    inits = [w("c1w", 8, 1, 5), w("c1b", 8), w("c2w", 8, 8, 3), w("c2b", 8), w("ctw", 8, 8, 4), w("ctb", 8)]
    inits += [w("c3w", 8, 1, 3), w("c3b", 8), w("fcw", 16, 5), w("fcb", 5)]
    nodes = [
        helper.make_node("Conv", ["audio", "c1w", "c1b"], ["a1"], name="conv1", pads=[2, 2], strides=[2]),
        helper.make_node("Relu", ["a1"], ["a1r"], name="relu1"),
        helper.make_node("Conv", ["a1r", "c2w", "c2b"], ["a2"], name="conv2", pads=[1, 1], strides=[2]),
        helper.make_node("Relu", ["a2"], ["a2r"], name="relu2"),
        helper.make_node("ConvTranspose", ["a2r", "ctw", "ctb"], ["up"], name="deconv", strides=[2], pads=[1, 1]),
        helper.make_node("Conv", ["audio", "c3w", "c3b"], ["b1"], name="conv_b", pads=[1, 1], strides=[2]),
        helper.make_node("Tanh", ["b1"], ["b1t"], name="tanh_b"),
        helper.make_node("Concat", ["up", "b1t"], ["cat"], name="concat", axis=1),
        helper.make_node("ReduceMean", ["cat"], ["pool"], name="pool", axes=[2], keepdims=0),
        helper.make_node("Gemm", ["pool", "fcw", "fcb"], ["logits"], name="fc"),
    ]
    folder.mkdir(parents=True, exist_ok=True)
    model = save_graph(helper.make_graph(nodes, "audio", [x], [y], inits), folder / "model.onnx")
    np.savez(folder / "calib.npz", audio=rng.standard_normal((24, 1, 64)).astype(np.float32))
    np.savez(folder / "eval.npz", audio=rng.standard_normal((24, 1, 64)).astype(np.float32))
    return model, folder / "calib.npz", folder / "eval.npz"
