"""Benchmark: qdebug analyze + propose on real exported models of five families, shipped inside PyPI wheels.

The models are the ones real users quantize, taken from wheels that ship them (``pip download --no-deps``,
once, into ``--wheels``): a DB text detector, an SVTR text-line recognizer and a MobileNetV3 text-direction
classifier (PP-OCRv4 / PP-OCR v2, from ``rapidocr_onnxruntime``), a CNN captcha reader (``ddddocr``'s
``common.onnx``) and an audio CNN with a constant-Q front end that transcribes notes (``basic-pitch``'s
``nmp.onnx``). No data ships with them, and none can be downloaded here, so each gets generated inputs of its
own kind, preprocessed as its package does: text lines and text blocks rendered with Pillow's default font
(``pip install pillow``), captcha-like words, and chords of harmonic tones. The task metric is the quantized
model's agreement with FP32 on its own output, read as the package reads it: the detector's text mask (IoU
at 0.3), the recognizer's greedy CTC decoding (share of lines decoded identically), the classifier's label,
the captcha reader's string, the note transcription's frames (F1 at 0.5).

For each: FP32 / full static INT8 / the proposal's metric, what propose answered (recipe, nodes kept FP32,
overrides), its evaluations and wall time, and the frontier's p50 vs FP32 (median of the interleaved rounds).

Usage:
  python benchmarks/bench_families.py [--families det,rec,cls,captcha,audio] [--calib 32] [--eval 64]
      [--wheels ~/.cache/qdebug/wheels] [--keep DIR] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
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
}
METRICS = {"det": "mask_iou", "rec": "ctc_lines", "cls": "label_agreement", "captcha": "string_agreement",
           "audio": "note_f1"}  # fmt: skip
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
    return out


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
