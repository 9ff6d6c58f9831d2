"""Benchmark: symmetric against asymmetric activations on the planted kinds, with plain ONNX Runtime.

Symmetric or asymmetric activations are a whole-model choice where the provider runs both as integer
kernels. propose starts from ORT's CPU default, asymmetric uint8 activations; this measures,
on every planted kind that misses with static INT8, whether a symmetric range (``ActivationSymmetric``, int8
or uint8) or int8 asymmetric activations would be a better start: top1 (agreement with FP32) of each, full
static INT8, MinMax, per-tensor, with plain ``quantize_static``.

Usage:
  python benchmarks/bench_symmetric.py [--size small] [--kinds equalize_depthwise,...]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("equalize_depthwise", "smooth_outliers", "bias_shift", "long_tail", "no_small_set", "outlier_residual",
         "detector_concat", "decomposed_layernorm")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from onnxruntime.quantization import QuantType

    from fixtures import planted

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=planted.SIZES)
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # ORT's "consider pre-processing" on every call
    variants = {
        "uint8 asymmetric (ORT's CPU default)": {},
        "int8 asymmetric": {"activation_type": QuantType.QInt8},
        "int8 symmetric": {"activation_type": QuantType.QInt8, "extra_options": {"ActivationSymmetric": True}},
        "uint8 symmetric": {"extra_options": {"ActivationSymmetric": True}},
    }
    print("| kind | FP32 | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    with tempfile.TemporaryDirectory(prefix="bench-symmetric-") as tmp:
        for kind in args.kinds.split(","):
            rec = planted.make(kind, Path(tmp) / kind, args.size)
            cells = [planted.score(rec, rec.model)]
            for i, extra in enumerate(variants.values()):
                options = {k: dict(v) if isinstance(v, dict) else v for k, v in extra.items()}  # quantize pops them
                cells.append(planted.score(rec, planted.quantize(rec, Path(tmp) / f"{kind}.{i}.onnx", **options)))
            print(f"| {kind} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
