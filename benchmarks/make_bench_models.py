#!/usr/bin/env python3
"""Generate the benchmark models (not committed): a ResNet-style CNN and a BERT-style encoder.

Usage::

    python benchmarks/make_bench_models.py OUT_DIR [--n-calib 128] [--seed 0]

writes ``OUT_DIR/resnet/{model.onnx,calib.npz}`` and ``OUT_DIR/bert/{model.onnx,calib.npz}``.

Why generated: the benchmarks measure speed and memory on models of a realistic size and
graph shape, which needs no trained weights, only weights that keep activations in the
ranges of a trained network (He init, BatchNorm statistics measured on the calibration
images, BERT's N(0, 0.02) init with LayerNorm).  Only numpy, onnx and onnxruntime are used,
and everything is seeded, so two runs with the same arguments write the same files.

The calibration files follow qdebug's data contract: one key per model input, batch on
axis 0, exact dtypes.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` with fixed zip timestamps, so reruns give identical bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for key, array in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.array(array, order="C"), allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


class GraphBuilder:
    """Collects named nodes and initializers; each node's output is ``<name>_out`` by default."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}

    def init(self, name: str, array: np.ndarray | float | int) -> str:
        """Add (or replace) an initializer; floats are stored as float32."""
        arr = np.asarray(array)
        self.inits[name] = np.array(arr.astype(np.float32) if arr.dtype.kind == "f" else arr, order="C")
        return name

    def node(
        self, op: str, inputs: Sequence[str], name: str, outputs: Sequence[str] | None = None, **attrs: Any
    ) -> str:
        """Add a named node and return its first output."""
        outs = list(outputs) if outputs is not None else [f"{name}_out"]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, **attrs))
        return outs[0]

    def model(
        self,
        name: str,
        inputs: Sequence[onnx.ValueInfoProto],
        outputs: Sequence[onnx.ValueInfoProto],
        doc: str,
    ) -> onnx.ModelProto:
        """Finish as an opset-17 model."""
        inits = [numpy_helper.from_array(a, n) for n, a in self.inits.items()]
        graph = helper.make_graph(self.nodes, name, list(inputs), list(outputs), inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="qdebug-bench",
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        return model


def vinfo(name: str, shape: Sequence[int | str], elem: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """Typed value info; string dims are symbolic."""
    return helper.make_tensor_value_info(name, elem, list(shape))


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    """CPU session over an in-memory model."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------------------------
# ResNet-style CNN
# --------------------------------------------------------------------------------------------


def smooth_images(rng: np.random.Generator, n: int, size: int = 224) -> np.ndarray:
    """ImageNet-normalized images with natural-image-like spatial correlation.

    White noise would give every conv an unrealistically flat, high-variance input; blurred
    low-resolution noise plus a little grain keeps the statistics closer to photographs.
    """
    low = rng.random((n, 3, size // 8, size // 8), dtype=np.float32)
    img = low.repeat(8, axis=2).repeat(8, axis=3)
    for axis in (2, 3):  # box blur of width 9 along each spatial axis
        pad = [(0, 0)] * 4
        pad[axis] = (4, 4)
        c = np.cumsum(np.pad(img, pad, mode="edge"), axis=axis, dtype=np.float32)
        c = np.concatenate([np.zeros_like(c.take([0], axis=axis)), c], axis=axis)
        img = (c.take(np.arange(9, size + 9), axis=axis) - c.take(np.arange(0, size), axis=axis)) / 9.0
    img = np.clip(img + rng.normal(0.0, 0.03, img.shape).astype(np.float32), 0.0, 1.0)
    return ((img - IMAGENET_MEAN[:, None, None]) / IMAGENET_STD[:, None, None]).astype(np.float32)


def build_resnet(
    rng: np.random.Generator, width: int, blocks: Sequence[int]
) -> tuple[GraphBuilder, list[str]]:
    """Stem, basic blocks (Conv-BN-Relu-Conv-BN + skip, 1x1 downsample where shapes change), GAP, Gemm.

    Returns the builder and the BatchNormalization node names in graph order; BN statistics are
    placeholders until ``fit_batchnorm`` measures them.
    """
    g = GraphBuilder()
    bns: list[str] = []

    def conv_bn(x: str, cin: int, cout: int, k: int, stride: int, name: str, gamma: float) -> str:
        w = rng.standard_normal((cout, cin, k, k)).astype(np.float32) * math.sqrt(2.0 / (cin * k * k))
        y = g.node(
            "Conv",
            [x, g.init(f"{name}.conv.weight", w)],
            f"{name}/conv",
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
        )
        bn = f"{name}/bn"
        bns.append(bn)
        scale = g.init(f"{name}.bn.weight", gamma * rng.uniform(0.8, 1.2, cout))
        bias = g.init(f"{name}.bn.bias", rng.normal(0.0, 0.05, cout))
        mean, var = (
            g.init(f"{name}.bn.running_mean", np.zeros(cout)),
            g.init(f"{name}.bn.running_var", np.ones(cout)),
        )
        return g.node("BatchNormalization", [y, scale, bias, mean, var], bn, epsilon=1e-5)

    x = conv_bn("input", 3, width, 7, 2, "stem", 1.0)
    x = g.node("Relu", [x], "stem/relu")
    x = g.node("MaxPool", [x], "stem/maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = width
    for s, count in enumerate(blocks):
        cout = width * 2**s
        for b in range(count):
            stride = 2 if (s > 0 and b == 0) else 1
            name = f"stage{s + 1}/block{b + 1}"
            h = g.node("Relu", [conv_bn(x, cin, cout, 3, stride, f"{name}/1", 1.0)], f"{name}/1/relu")
            h = conv_bn(h, cout, cout, 3, 1, f"{name}/2", 0.3)  # small last gamma, as trained ResNets have
            skip = (
                conv_bn(x, cin, cout, 1, stride, f"{name}/downsample", 1.0)
                if (stride != 1 or cin != cout)
                else x
            )
            x = g.node("Relu", [g.node("Add", [skip, h], f"{name}/add")], f"{name}/relu")
            cin = cout
    x = g.node("GlobalAveragePool", [x], "head/gap")
    x = g.node("Flatten", [x], "head/flatten")
    w = rng.standard_normal((1000, cin)).astype(np.float32) / math.sqrt(cin)
    g.node(
        "Gemm",
        [x, g.init("head.fc.weight", w), g.init("head.fc.bias", np.zeros(1000))],
        "head/gemm",
        outputs=["logits"],
        transB=1,
    )
    return g, bns


def fit_batchnorm(g: GraphBuilder, bns: Sequence[str], images: np.ndarray) -> None:
    """Set each BN's running mean/var to its input's statistics on ``images``, in graph order.

    Earlier BNs are fitted first, so every layer sees normalized inputs as in a trained model.
    """
    for bn in bns:
        node = next(n for n in g.nodes if n.name == bn)
        model = g.model("probe", [vinfo("input", ["N", 3, 224, 224])], [vinfo(node.input[0], [])], "")
        (act,) = session(model).run(None, {"input": images})
        g.init(node.input[3], act.mean(axis=(0, 2, 3)))
        g.init(node.input[4], act.var(axis=(0, 2, 3)) + 1e-5)


def make_resnet(out: Path, n_calib: int, seed: int, width: int, blocks: Sequence[int]) -> onnx.ModelProto:
    """ResNet-style CNN on 3x224x224 inputs plus calib.npz of ``n_calib`` images."""
    rng = np.random.default_rng(seed)
    g, bns = build_resnet(rng, width, blocks)
    fit_batchnorm(g, bns, smooth_images(np.random.default_rng(seed + 1), 8))
    model = g.model(
        "bench_resnet",
        [vinfo("input", ["N", 3, 224, 224])],
        [vinfo("logits", ["N", 1000])],
        "ResNet-style benchmark CNN (random He-init weights, fitted BN statistics).",
    )
    onnx.checker.check_model(model, full_check=True)
    (out / "resnet").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "resnet" / "model.onnx"))
    save_npz(out / "resnet" / "calib.npz", {"input": smooth_images(np.random.default_rng(seed + 2), n_calib)})
    return model


# --------------------------------------------------------------------------------------------
# BERT-style encoder
# --------------------------------------------------------------------------------------------


def build_bert(
    rng: np.random.Generator, layers: int, hidden: int, heads: int, vocab: int, max_pos: int
) -> GraphBuilder:
    """Post-LN BERT encoder as exported: Gather embeddings, additive mask, GELU as Erf, pooler.

    Weights use BERT's N(0, 0.02) init, LayerNorm gamma 1 / beta 0, zero biases.
    """
    g = GraphBuilder()
    dh, ffn = hidden // heads, 4 * hidden

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def linear(x: str, din: int, dout: int, name: str) -> str:
        y = g.node("MatMul", [x, g.init(f"{name}.weight", normal(din, dout))], f"{name}/matmul")
        return g.node("Add", [y, g.init(f"{name}.bias", np.zeros(dout))], f"{name}/add")

    def layer_norm(x: str, name: str) -> str:
        return g.node(
            "LayerNormalization",
            [x, g.init(f"{name}.weight", np.ones(hidden)), g.init(f"{name}.bias", np.zeros(hidden))],
            name,
            axis=-1,
            epsilon=1e-12,
        )

    g.init("const/heads_shape", np.array([0, 0, heads, dh], np.int64))
    g.init("const/merge_shape", np.array([0, 0, hidden], np.int64))
    g.init("const/sqrt_dh", np.float32(math.sqrt(dh)))
    g.init("const/sqrt2", np.float32(math.sqrt(2.0)))
    g.init("const/one", np.float32(1.0))
    g.init("const/half", np.float32(0.5))

    # Embeddings: word + position (position ids sliced to the dynamic sequence length).
    words = g.node(
        "Gather", [g.init("embeddings.word", normal(vocab, hidden)), "input_ids"], "embeddings/word_gather"
    )
    shape = g.node("Shape", ["input_ids"], "embeddings/shape")
    seq = g.node(
        "Gather", [shape, g.init("const/idx1", np.array([1], np.int64))], "embeddings/seq_len", axis=0
    )
    pos_ids = g.node(
        "Slice",
        [
            g.init("embeddings.position_ids", np.arange(max_pos, dtype=np.int64)[None]),
            g.init("const/zero1", np.array([0], np.int64)),
            seq,
            g.init("const/axis1", np.array([1], np.int64)),
        ],
        "embeddings/position_slice",
    )
    pos = g.node(
        "Gather",
        [g.init("embeddings.position", normal(max_pos, hidden)), pos_ids],
        "embeddings/position_gather",
    )
    x = layer_norm(g.node("Add", [words, pos], "embeddings/add"), "embeddings/ln")

    # Additive mask: (1 - mask) * -10000, broadcast to [N, 1, 1, S].
    m = g.node("Cast", ["attention_mask"], "mask/cast", to=TensorProto.FLOAT)
    m = g.node("Sub", [g.init("const/one_f", np.float32(1.0)), m], "mask/invert")
    m = g.node("Mul", [m, g.init("const/neg", np.float32(-10000.0))], "mask/scale")
    mask = g.node("Unsqueeze", [m, g.init("const/axes12", np.array([1, 2], np.int64))], "mask/unsqueeze")

    for i in range(layers):
        p = f"layer{i}"
        heads_t = {}
        for nm, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
            y = g.node(
                "Reshape",
                [linear(x, hidden, hidden, f"{p}/attn/{nm}"), "const/heads_shape"],
                f"{p}/attn/{nm}_reshape",
            )
            heads_t[nm] = g.node("Transpose", [y], f"{p}/attn/{nm}_transpose", perm=perm)
        s = g.node("MatMul", [heads_t["q"], heads_t["k"]], f"{p}/attn/qk_matmul")
        s = g.node("Div", [s, "const/sqrt_dh"], f"{p}/attn/scale_div")
        s = g.node("Add", [s, mask], f"{p}/attn/mask_add")
        a = g.node("Softmax", [s], f"{p}/attn/softmax", axis=-1)
        c = g.node("MatMul", [a, heads_t["v"]], f"{p}/attn/av_matmul")
        c = g.node("Transpose", [c], f"{p}/attn/context_transpose", perm=[0, 2, 1, 3])
        c = g.node("Reshape", [c, "const/merge_shape"], f"{p}/attn/context_reshape")
        c = linear(c, hidden, hidden, f"{p}/attn/out")
        x = layer_norm(g.node("Add", [c, x], f"{p}/attn_residual"), f"{p}/attn_ln")
        u = linear(x, hidden, ffn, f"{p}/ffn/fc1")
        t = g.node("Div", [u, "const/sqrt2"], f"{p}/ffn/gelu_div")
        t = g.node("Erf", [t], f"{p}/ffn/gelu_erf")
        t = g.node("Add", [t, "const/one"], f"{p}/ffn/gelu_add")
        t = g.node("Mul", [u, t], f"{p}/ffn/gelu_mul")
        t = g.node("Mul", [t, "const/half"], f"{p}/ffn/gelu_mul_half")
        f = linear(t, ffn, hidden, f"{p}/ffn/fc2")
        x = layer_norm(g.node("Add", [f, x], f"{p}/ffn_residual"), f"{p}/ffn_ln")

    cls = g.node("Gather", [x, g.init("const/idx0", np.array(0, np.int64))], "pooler/cls_gather", axis=1)
    pooled = g.node(
        "Tanh",
        [
            g.node(
                "Gemm",
                [
                    cls,
                    g.init("pooler.weight", normal(hidden, hidden)),
                    g.init("pooler.bias", np.zeros(hidden)),
                ],
                "pooler/gemm",
            )
        ],
        "pooler/tanh",
    )
    g.node(
        "Gemm",
        [pooled, g.init("classifier.weight", normal(hidden, 2)), g.init("classifier.bias", np.zeros(2))],
        "classifier/gemm",
        outputs=["logits"],
    )
    return g


def token_batch(rng: np.random.Generator, n: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    """[CLS] tokens [SEP] [PAD]... with random lengths, and the matching attention mask (int64)."""
    ids = rng.integers(1000, vocab, (n, seq), dtype=np.int64)
    lengths = rng.integers(seq // 4, seq + 1, n)
    pos = np.arange(seq)[None, :]
    ids[:, 0] = 101
    ids[pos == (lengths[:, None] - 1)] = 102
    mask = (pos < lengths[:, None]).astype(np.int64)
    return {"input_ids": ids * mask, "attention_mask": mask}


def make_bert(
    out: Path, n_calib: int, seed: int, layers: int, hidden: int, heads: int, seq: int, vocab: int
) -> onnx.ModelProto:
    """BERT-style encoder with int64 input_ids / attention_mask [N, S] plus calib.npz at length ``seq``."""
    g = build_bert(np.random.default_rng(seed), layers, hidden, heads, vocab, max_pos=max(512, seq))
    model = g.model(
        "bench_bert",
        [
            vinfo("input_ids", ["N", "S"], TensorProto.INT64),
            vinfo("attention_mask", ["N", "S"], TensorProto.INT64),
        ],
        [vinfo("logits", ["N", 2])],
        f"BERT-style benchmark encoder: {layers} layers, hidden {hidden}, {heads} heads (random init).",
    )
    onnx.checker.check_model(model, full_check=True)
    (out / "bert").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / "bert" / "model.onnx"))
    save_npz(out / "bert" / "calib.npz", token_batch(np.random.default_rng(seed + 1), n_calib, seq, vocab))
    return model


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, write both models, and smoke-run each on two calibration samples."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory to write resnet/ and bert/ into")
    parser.add_argument("--n-calib", type=int, default=128, help="samples in each calib.npz (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="+", choices=("resnet", "bert"), default=["resnet", "bert"])
    parser.add_argument(
        "--resnet-width", type=int, default=32, help="stem width; stages double it (default 32)"
    )
    parser.add_argument("--resnet-blocks", default="1,2,2,1", help="basic blocks per stage (default 1,2,2,1)")
    parser.add_argument("--bert-layers", type=int, default=4)
    parser.add_argument("--bert-hidden", type=int, default=256)
    parser.add_argument("--bert-heads", type=int, default=4)
    parser.add_argument("--bert-seq", type=int, default=128)
    parser.add_argument("--bert-vocab", type=int, default=8192)
    args = parser.parse_args(argv)
    if args.n_calib < 1:
        parser.error("--n-calib must be >= 1")
    made: dict[str, onnx.ModelProto] = {}
    if "resnet" in args.models:
        blocks = [int(b) for b in args.resnet_blocks.split(",")]
        made["resnet"] = make_resnet(args.out_dir, args.n_calib, args.seed, args.resnet_width, blocks)
    if "bert" in args.models:
        made["bert"] = make_bert(
            args.out_dir,
            args.n_calib,
            args.seed,
            args.bert_layers,
            args.bert_hidden,
            args.bert_heads,
            args.bert_seq,
            args.bert_vocab,
        )
    for name, model in made.items():
        with np.load(args.out_dir / name / "calib.npz") as data:
            feed = {k: data[k][:2] for k in data.files}
        logits = session(model).run(None, feed)[0]
        print(
            f"{name}: {len(model.graph.node)} nodes, logits {logits.shape}, "
            f"-> {args.out_dir / name}/{{model.onnx,calib.npz}}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
