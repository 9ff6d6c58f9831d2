"""Benchmark: qdebug analyze + propose on exported models of six families: five real ones shipped inside PyPI
wheels, and a generated transformer.

The models are the ones real users quantize, taken from wheels that ship them (``pip download --no-deps``,
once, into ``--wheels``): a DB text detector, an SVTR text-line recognizer and a MobileNetV3 text-direction
classifier (PP-OCRv4 / PP-OCR v2, from ``rapidocr_onnxruntime``), a CNN captcha reader (``ddddocr``'s
``common.onnx``) and an audio CNN with a constant-Q front end that transcribes notes (``basic-pitch``'s
``nmp.onnx``). No sentence-embedding transformer ships in a wheel, so the sixth is generated with its traits
(:func:`encoder`: MiniLM-L6's shape, and the outlier channels of trained transformers' LayerNorms). No data
ships with them, and none can be downloaded here, so each gets generated inputs of its own kind, preprocessed
as its package does: text lines and text blocks rendered with Pillow's default font (``pip install pillow``),
captcha-like words, chords of harmonic tones, and token ids as a WordPiece tokenizer writes them. The task
metric is the quantized model's agreement with FP32 on its own output, read as the package reads it: the
detector's text mask (IoU at 0.3), the recognizer's greedy CTC decoding (share of lines decoded identically),
the classifier's label, the captcha reader's string, the note transcription's frames (F1 at 0.5), the
sentence embedding (cosine).

For each: FP32 / full static INT8 / the proposal's metric, what propose answered (recipe, nodes kept FP32,
overrides), its evaluations and wall time, and the frontier's p50 vs FP32 (median of the interleaved rounds).

Usage:
  python benchmarks/bench_families.py [--families det,rec,cls,captcha,audio,transformer] [--calib 32] [--eval 64]
      [--wheels ~/.cache/qdebug/wheels] [--keep DIR] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()

WHEELS = {
    "rapidocr_onnxruntime==1.4.4": {
        "det": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "rec": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "cls": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
    },
    "ddddocr==1.6.1": {"captcha": "ddddocr/common.onnx"},
    "basic-pitch==0.4.0": {"audio": "basic_pitch/saved_models/icassp_2022/nmp.onnx"},
}
"""Which wheel ships which family's model (pinned: the numbers below are for these files)."""

TITLES = {
    "det": "DB text detector (PP-OCRv4 det, 320x320)",
    "rec": "SVTR text-line recognizer (PP-OCRv4 rec, 48x320)",
    "cls": "MobileNetV3 direction classifier (PP-OCR v2 cls)",
    "captcha": "CNN captcha reader (ddddocr common)",
    "audio": "audio CNN, constant-Q front end (basic-pitch nmp)",
    "transformer": "6-layer sentence-embedding transformer (generated, MiniLM-shaped)",
}
METRICS = {"det": "mask_iou", "rec": "ctc_lines", "cls": "label_agreement", "captcha": "string_agreement",
           "audio": "note_f1", "transformer": "embedding_cosine"}  # fmt: skip
WORDS = "the quick brown fox jumps over lazy dog 0123456789 ONNX Runtime INT8 qdebug model layer tensor".split()


# ----------------------------------------------------------------------------- the models


def models(wheels: Path, families: list[str]) -> dict[str, Path]:
    """Each family's model file, taken out of its wheel (downloaded with pip once)."""
    wheels.mkdir(parents=True, exist_ok=True)
    out = {}
    for spec, members in WHEELS.items():
        wanted = {f: m for f, m in members.items() if f in families}
        if not wanted:
            continue
        name = spec.split("==")[0].replace("-", "_")
        found = sorted(wheels.glob(f"{name}-{spec.split('==')[1]}-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(wheels)],
                           check=True)  # fmt: skip
            found = sorted(wheels.glob(f"{name}-{spec.split('==')[1]}-*.whl"))
        with zipfile.ZipFile(found[0]) as z:
            for family, member in wanted.items():
                path = wheels / f"{family}.onnx"
                if not path.is_file():
                    path.write_bytes(z.read(member))
                out[family] = path
    if "transformer" in families:  # generated, deterministic: written once beside the wheels' models
        path = wheels / "transformer.onnx"
        out["transformer"] = path if path.is_file() else encoder(path)
    return out


# ----------------------------------------------------------------------------- the generated transformer

VOCAB, SEQ = 4000, 32


def encoder(
    path: Path,
    seed: int = 7,
    layers: int = 6,
    d: int = 384,
    heads: int = 6,
    ffn: int = 1536,
    vocab: int = VOCAB,
    seq: int = SEQ,
    outl: int = 4,
    gain: tuple[float, float] = (20.0, 40.0),
) -> Path:
    """A 6-layer sentence-embedding encoder shaped like MiniLM-L6 (d 384, FFN 1536, word and position
    embeddings, exported-style attention mask, Reshape/Transpose heads, Erf GELU, masked mean pooling, L2
    normalization), generated: no transformer ships in a wheel here. Its weights are random; the trait that
    breaks per-tensor INT8 is planted as it is measured in trained ones: ``outl`` hidden channels whose
    LayerNorm gain is ``gain`` (20-40x, either sign) in every block, the rows of the MatMuls reading them as
    much smaller, so FP32 computes what gain 1 would and each LayerNorm output's range is set by them."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    inits: list[Any] = []

    def const(name: str, v: Any, dt: Any = np.float32) -> str:
        inits.append(numpy_helper.from_array(np.asarray(v, dtype=dt), name))
        return name

    def op(t: str, ins: list[str], name: str, **a: Any) -> str:
        nodes.append(helper.make_node(t, list(ins), [name], name=name, **a))
        return name

    def lin(x: str, din: int, dout: int, name: str, scale_rows: Any = None, gain_: float = 1.0) -> str:
        w = rng.standard_normal((din, dout)).astype(np.float32) * np.float32(gain_ / math.sqrt(din))
        if scale_rows is not None:
            w = w / scale_rows[:, None]
        m = op("MatMul", [x, const(f"{name}.weight", w.astype(np.float32))], f"{name}/MatMul")
        return op("Add", [m, const(f"{name}.bias", 0.02 * rng.standard_normal(dout))], f"{name}/Add")

    ch = np.sort(rng.choice(d, outl, replace=False))  # the same channels in every block, as in trained ones

    def ln(x: str, name: str, outliers: bool = True) -> tuple[str, np.ndarray]:
        g = (1.0 + 0.05 * rng.standard_normal(d)).astype(np.float32)
        if outliers:
            g[ch] = rng.uniform(*gain, outl) * rng.choice([-1, 1], outl)
        b = (0.02 * rng.standard_normal(d)).astype(np.float32)
        return op(
            "LayerNormalization",
            [x, const(f"{name}.weight", g), const(f"{name}.bias", b)],
            name,
            axis=-1,
            epsilon=1e-12,
        ), g

    # embeddings: word + position, then LayerNorm (BERT)
    we = op(
        "Gather",
        [const("embeddings.word_embeddings.weight", 0.05 * rng.standard_normal((vocab, d))), "input_ids"],
        "embeddings/word_embeddings/Gather",
        axis=0,
    )
    pos = const("embeddings.position_embeddings", 0.02 * rng.standard_normal((1, seq, d)))
    h = op("Add", [we, pos], "embeddings/Add")
    h, _ = ln(h, "embeddings/LayerNorm", outliers=False)
    # the attention mask, as exporters write it: (1 - mask) * -10000, broadcast over heads and queries
    m = op("Cast", ["attention_mask"], "extended_mask/Cast", to=TensorProto.FLOAT)
    m = op("Unsqueeze", [m, const("extended_mask.axes", [1, 2], np.int64)], "extended_mask/Unsqueeze")
    m = op("Sub", [const("extended_mask.one", 1.0), m], "extended_mask/Sub")
    mask = op("Mul", [m, const("extended_mask.neg", -10000.0)], "extended_mask/Mul")
    hd = d // heads
    split = const("attention.split_shape", [0, 0, heads, hd], np.int64)
    merge = const("attention.merge_shape", [0, 0, d], np.int64)
    for i in range(layers):
        p = f"encoder/layer.{i}"
        a, g = ln(h, f"{p}/attention/LayerNorm")

        def headed(x: str, name: str, perm: list[int]) -> str:
            r = op("Reshape", [x, split], f"{name}/Reshape")
            return op("Transpose", [r], f"{name}/Transpose", perm=perm)

        q = headed(lin(a, d, d, f"{p}/attention/query", g), f"{p}/attention/query", [0, 2, 1, 3])
        k = headed(lin(a, d, d, f"{p}/attention/key", g), f"{p}/attention/key", [0, 2, 3, 1])
        v = headed(lin(a, d, d, f"{p}/attention/value", g), f"{p}/attention/value", [0, 2, 1, 3])
        s = op("MatMul", [q, k], f"{p}/attention/scores/MatMul")
        s = op("Div", [s, const(f"{p}/attention.sqrt_d", math.sqrt(hd))], f"{p}/attention/scores/Div")
        s = op("Add", [s, mask], f"{p}/attention/scores/Add")
        s = op("Softmax", [s], f"{p}/attention/Softmax", axis=-1)
        c = op("MatMul", [s, v], f"{p}/attention/context/MatMul")
        c = op("Transpose", [c], f"{p}/attention/context/Transpose", perm=[0, 2, 1, 3])
        c = op("Reshape", [c, merge], f"{p}/attention/context/Reshape")
        o = lin(c, d, d, f"{p}/attention/output/dense", gain_=0.5)
        h = op("Add", [h, o], f"{p}/attention/output/Add")
        a, g = ln(h, f"{p}/ffn/LayerNorm")
        f = lin(a, d, ffn, f"{p}/intermediate/dense", g)
        t = op("Div", [f, const(f"{p}/gelu.sqrt2", math.sqrt(2.0))], f"{p}/intermediate/gelu/Div")
        t = op("Erf", [t], f"{p}/intermediate/gelu/Erf")
        t = op("Add", [t, const(f"{p}/gelu.one", 1.0)], f"{p}/intermediate/gelu/Add")
        t = op("Mul", [f, t], f"{p}/intermediate/gelu/Mul")
        t = op("Mul", [t, const(f"{p}/gelu.half", 0.5)], f"{p}/intermediate/gelu/Mul_1")
        o = lin(t, ffn, d, f"{p}/output/dense", gain_=0.5)
        h = op("Add", [h, o], f"{p}/output/Add")
    h, _ = ln(h, "encoder/final_LayerNorm", outliers=False)
    # mean pooling over the tokens the mask keeps, then L2 normalization (sentence-transformers)
    mf = op("Cast", ["attention_mask"], "pooling/Cast", to=TensorProto.FLOAT)
    mf = op("Unsqueeze", [mf, const("pooling.axes", [2], np.int64)], "pooling/Unsqueeze")
    s = op(
        "ReduceSum",
        [op("Mul", [h, mf], "pooling/Mul"), const("pooling.seq_axis", [1], np.int64)],
        "pooling/ReduceSum",
        keepdims=0,
    )
    n = op("ReduceSum", [mf, const("pooling.seq_axis2", [1], np.int64)], "pooling/count", keepdims=0)
    n = op("Max", [n, const("pooling.min_count", 1e-9)], "pooling/clamp")
    e = op("Div", [s, n], "pooling/Div")
    nodes.append(helper.make_node("LpNormalization", [e], ["sentence_embedding"], name="normalize", axis=-1, p=2))
    graph = helper.make_graph(
        nodes,
        "sentence_encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", seq]),
        ],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", d])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="bench-families")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def tokens(n: int, seed: int, vocab: int = VOCAB, seq: int = SEQ) -> dict[str, np.ndarray]:
    """Token ids as a WordPiece tokenizer writes them ([CLS] ... [SEP], Zipf-distributed words, 6-32 long,
    zero-padded) and their attention mask."""
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((n, seq), np.int64), np.zeros((n, seq), np.int64)
    for i in range(n):
        length = int(rng.integers(6, seq + 1))
        words = np.minimum(rng.zipf(1.3, length - 2) + 100, vocab - 1)
        ids[i, :length] = [101, *words, 102]
        mask[i, :length] = 1
    return {"input_ids": ids, "attention_mask": mask}


# ----------------------------------------------------------------------------- generated inputs


def _font(size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size)


def _line(rng: np.random.Generator, k: int = 3) -> str:
    return " ".join(rng.choice(WORDS, k))


def _text_image(rng: np.random.Generator, w: int, h: int, text: str, size: int, grey: bool = False) -> np.ndarray:
    from PIL import Image, ImageDraw

    bg = tuple(int(x) for x in rng.integers(170, 256, 3))
    fg = tuple(int(x) for x in rng.integers(0, 90, 3))
    im = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(im)
    d.text((int(rng.integers(2, 12)), int(rng.integers(0, max(1, h - size - 2)))), text, fill=fg, font=_font(size))
    a = np.asarray(im.convert("L") if grey else im, np.float32)
    return a + rng.normal(0, 6, a.shape).astype(np.float32)


def _ocr_norm(img: np.ndarray) -> np.ndarray:  # PP-OCR rec / cls: (x / 255 - 0.5) / 0.5, CHW
    return ((img / 255.0 - 0.5) / 0.5).transpose(2, 0, 1).astype(np.float32)


def data(family: str, n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` generated inputs of ``family``'s kind, preprocessed as its package preprocesses them."""
    rng = np.random.default_rng(seed)
    if family == "transformer":
        return tokens(n, seed)
    if family == "rec":
        return {"x": np.stack([_ocr_norm(_text_image(rng, 320, 48, _line(rng), 26)) for _ in range(n)])}
    if family == "cls":  # half the lines upside down: what the classifier tells apart
        imgs = [_text_image(rng, 192, 48, _line(rng, 2), 24) for _ in range(n)]
        imgs = [im[::-1, ::-1] if i % 2 else im for i, im in enumerate(imgs)]
        return {"x": np.stack([_ocr_norm(im) for im in imgs])}
    if family == "det":  # a few text lines on a page, ImageNet normalization (PP-OCR det)
        from PIL import Image, ImageDraw

        mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        out = []
        for _ in range(n):
            im = Image.new("RGB", (320, 320), tuple(int(x) for x in rng.integers(180, 256, 3)))
            d = ImageDraw.Draw(im)
            for _ in range(int(rng.integers(3, 7))):
                size = int(rng.integers(14, 30))
                xy = (int(rng.integers(0, 120)), int(rng.integers(0, 300 - size)))
                d.text(xy, _line(rng, 2), fill=tuple(int(x) for x in rng.integers(0, 80, 3)), font=_font(size))
            a = np.asarray(im, np.float32) / 255.0
            out.append(((a - mean) / std).transpose(2, 0, 1).astype(np.float32))
        return {"x": np.stack(out)}
    if family == "captcha":  # ddddocr: grey, height 64, (x / 255 - 0.5) / 0.5; batch 1
        word = lambda: "".join(rng.choice(list("abcdefghkmnpqrstuvwxyz23456789"), 5))  # noqa: E731
        imgs = [_text_image(rng, 160, 64, word(), 40, grey=True) for _ in range(n)]
        return {"input1": np.stack([((im / 255.0 - 0.5) / 0.5)[None] for im in imgs]).astype(np.float32)}
    if family == "audio":  # basic-pitch: 43,844 samples at 22,050 Hz; chords of harmonic tones
        t = np.arange(43844) / 22050.0
        out = []
        for _ in range(n):
            y = np.zeros_like(t)
            for _ in range(int(rng.integers(1, 4))):
                f0 = 440.0 * 2 ** ((int(rng.integers(40, 80)) - 69) / 12)
                on, off = rng.uniform(0, 1.0), rng.uniform(1.0, 2.0)
                env = ((t > on) & (t < off)) * np.exp(-3 * np.clip(t - on, 0, None))
                y += sum(env * np.sin(2 * np.pi * f0 * h * t) / h for h in (1, 2, 3))
            y = y / max(np.abs(y).max(), 1e-6) * rng.uniform(0.2, 0.9) + rng.normal(0, 0.003, t.shape)
            out.append(y.astype(np.float32)[:, None])
        return {"serving_default_input_2:0": np.stack(out)}
    raise ValueError(family)


# ----------------------------------------------------------------------------- metrics (qdebug module:function hooks)


def _pairs(reference: list[dict], candidate: list[dict]):
    for ref, cand in zip(reference, candidate, strict=True):
        for k, r in ref.items():
            yield k, np.asarray(r), np.asarray(cand[k])


def mask_iou(reference: list[dict], candidate: list[dict], labels: Any = None) -> float:
    """The text mask's IoU with FP32's (probability map above 0.3, DB's threshold)."""
    inter = union = 0
    for _, r, c in _pairs(reference, candidate):
        a, b = r > 0.3, c > 0.3
        inter += int((a & b).sum())
        union += int((a | b).sum())
    return inter / union if union else 1.0


def _ctc(probs: np.ndarray) -> list[tuple[int, ...]]:
    out = []
    for seq in probs.argmax(-1):
        keep = [int(x) for i, x in enumerate(seq) if x != 0 and (i == 0 or x != seq[i - 1])]
        out.append(tuple(keep))
    return out


def ctc_lines(reference: list[dict], candidate: list[dict], labels: Any = None) -> float:
    """Share of lines whose greedy CTC decoding equals FP32's."""
    same = total = 0
    for _, r, c in _pairs(reference, candidate):
        for a, b in zip(_ctc(r), _ctc(c), strict=True):
            same += a == b
            total += 1
    return same / total if total else 1.0


def label_agreement(reference: list[dict], candidate: list[dict], labels: Any = None) -> float:
    """Share of inputs whose argmax label equals FP32's."""
    same = total = 0
    for _, r, c in _pairs(reference, candidate):
        same += int((r.argmax(-1) == c.argmax(-1)).sum())
        total += r.shape[0]
    return same / total if total else 1.0


def string_agreement(reference: list[dict], candidate: list[dict], labels: Any = None) -> float:
    """Share of captchas read as the same string: the greedy CTC decoding of the ``[steps, batch, classes]``
    logits, as ddddocr reads them."""
    same = total = 0
    for _, r, c in _pairs(reference, candidate):
        for a, b in zip(_ctc(r.transpose(1, 0, 2)), _ctc(c.transpose(1, 0, 2)), strict=True):
            same += a == b
            total += 1
    return same / total if total else 1.0


def note_f1(reference: list[dict], candidate: list[dict], labels: Any = None) -> float:
    """F1 of the note and onset frames above 0.5 against FP32's (the 88-key outputs)."""
    tp = fp = fn = 0
    for _, r, c in _pairs(reference, candidate):
        if r.shape[-1] != 88:
            continue
        a, b = r > 0.5, c > 0.5
        tp += int((a & b).sum())
        fp += int((~a & b).sum())
        fn += int((a & ~b).sum())
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 1.0


def embedding_cosine(reference: list[dict], candidate: list[dict], labels: Any = None) -> float:
    """Mean cosine between each sentence's embedding and FP32's."""
    total = count = 0.0
    for _, r, c in _pairs(reference, candidate):
        r, c = r.reshape(len(r), -1), c.reshape(len(c), -1)
        nr, nc = np.linalg.norm(r, axis=1), np.linalg.norm(c, axis=1)
        total += float(((r * c).sum(1) / np.maximum(nr * nc, 1e-12)).sum())
        count += len(r)
    return total / count if count else 1.0


# ----------------------------------------------------------------------------- the run


def _cli(args: list[str], cwd: Path, timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "qdebug", *args], cwd=cwd, capture_output=True, text=True,
                           timeout=timeout, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return 124, time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    return p.returncode, time.perf_counter() - t0, " | ".join((p.stderr or "").strip().splitlines()[-2:])


def run_family(family: str, model: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "calib.npz", **data(family, args.calib, 1))
    np.savez(work / "eval.npz", **data(family, args.eval, 2))
    metric = f"{HERE}:{METRICS[family]}"
    row: dict[str, Any] = {"family": family, "title": TITLES[family]}
    common = ["--calib", "calib.npz", "--eval", "eval.npz", "--metric", metric]
    rc, secs, err = _cli(["analyze", str(model), *common, "-o", "report.json", "-q"], work, args.timeout)
    row["analyze"] = {"rc": rc, "seconds": round(secs, 1), "stderr": err}
    if rc != 0:
        return row
    cmd = ["propose", "report.json", "--target-drop", "0.01", "-o", "proposal.json", "-q", "--accept-no-speedup"]
    rc, secs, err = _cli(cmd, work, args.timeout)
    row["propose"] = {"rc": rc, "seconds": round(secs, 1), "stderr": err}
    path = work / "proposal.json"
    if path.is_file():
        p = json.loads(path.read_text())
        front = {f["label"]: f for f in p.get("frontier", [])}
        fp32 = front.get("fp32")
        ratio = {k: round(fp32["p50_ms"] / v["p50_ms"], 2) for k, v in front.items() if fp32 and v["p50_ms"] > 0}
        row.update(
            quantizable=p.get("quantizable_nodes"),
            fp32=p.get("fp32_metric"),
            static=p.get("static_metric"),
            proposal=p.get("expected_metric"),
            recipe="+".join((p.get("recipe") or {}).get("steps") or []),
            nodes_fp32=len(p.get("nodes_to_exclude", [])),
            overrides=len(p.get("tensor_overrides", [])),
            evaluations=p.get("evaluations"),
            speed=ratio,
            stages=p.get("stage_seconds"),
        )
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| family | quantizable nodes | metric FP32 / static / proposal | answer | evaluations | analyze s | "
        "propose s | p50 vs FP32: static, proposal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "fp32" not in r:
            stage = "propose" if "propose" in r else "analyze"
            lines.append(f"| {r['title']} | - | - | {stage} rc {r[stage]['rc']}: {r[stage]['stderr']} | | | | |")
            continue
        answer = (f"recipe {r['recipe']}, " if r["recipe"] else "") + f"{r['nodes_fp32']} FP32"
        answer += f" + {r['overrides']} overrides" if r["overrides"] else ""
        answer += f" (exit {r['propose']['rc']})"
        sp = r["speed"]
        lines.append(
            f"| {r['title']} | {r['quantizable']} | {r['fp32']:.3f} / {r['static']:.3f} / {r['proposal']:.3f} | "
            f"{answer} | {r['evaluations']} | {r['analyze']['seconds']} | {r['propose']['seconds']} | "
            f"{sp.get('static', '-')}x, {sp.get('proposal', '-')}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(TITLES))
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--eval", type=int, default=64)
    ap.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "qdebug" / "wheels")
    ap.add_argument("--keep", type=Path, default=None, help="work folder to keep (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    paths = models(args.wheels, families)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-families-"))
    rows = []
    for family in families:
        t0 = time.perf_counter()
        rows.append(run_family(family, paths[family], root / family, args))
        print(f"[{family}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
