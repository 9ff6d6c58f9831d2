"""Benchmark: peak memory of the evaluator against the evaluation-set size (issue 18, part 2).

A detection-shaped model -- input ``[1, 4, W]``, a 1x1 Conv to 84 channels, a Sigmoid, output
``[1, 84, W]`` (W = 8400: the YOLOv8 head's shape, 2.7 MiB of float32 per sample) -- is scored the way
verify and propose score it: the FP32 references once (:class:`qdebug.evaluation.evaluate.Evaluator`), then the static
INT8 model (``Evaluator.score``), then the paired-bootstrap interval of its drop. The evaluation data is a
hook (``module:function``) that generates each sample from its index, so the set costs no disk of its own.

Each size runs in a fresh child process, which reports its own peak RSS (``ru_maxrss``) and the bytes the
stores spilled to disk; the table gives the peak at each size and its ratio to the smallest size's.
Targets (issue 18): at 5,000 samples, within 1.2x of the figure at 500.

Usage:
  python benchmarks/bench_eval_memory.py --sizes 500,5000 [--width 8400] [--spill-mb 256]
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHANNELS_IN, CHANNELS_OUT = 4, 84


def make_model(width: int):
    """The detection-shaped FP32 model (input ``x [1, 4, width]``, output ``y [1, 84, width]``)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.5, (CHANNELS_OUT, CHANNELS_IN, 1)).astype(np.float32)
    b = rng.normal(0, 0.1, CHANNELS_OUT).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", kernel_shape=[1]),
            helper.make_node("Sigmoid", ["c"], ["y"], name="sigmoid"),
        ],
        "detector_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS_IN, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CHANNELS_OUT, width])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def samples():
    """The hook: ``QDEBUG_BENCH_SAMPLES`` samples of ``[1, 4, QDEBUG_BENCH_WIDTH]``, each from its index."""
    n = int(os.environ["QDEBUG_BENCH_SAMPLES"])
    width = int(os.environ["QDEBUG_BENCH_WIDTH"])
    for i in range(n):
        rng = np.random.default_rng(i)
        yield {"x": rng.normal(0, 1, (1, CHANNELS_IN, width)).astype(np.float32)}


def child(n: int, width: int, folder: Path) -> dict:
    """One size, in this process: what the evaluator holds and how long it took."""
    import resource

    import onnx

    from qdebug.data import open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quant.quantize import QuantSpec, quantize_static_model
    from qdebug.runtime.capture import SessionConfig

    model_path = folder / "model.onnx"
    onnx.save(make_model(width), model_path)
    os.environ["QDEBUG_BENCH_SAMPLES"] = "16"
    os.environ["QDEBUG_BENCH_WIDTH"] = str(width)
    hook = f"{Path(__file__).resolve()}:samples"
    prep = prepare(model_path, hook, folder / "calib_files", AnalyzeOptions())
    static = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    os.environ["QDEBUG_BENCH_SAMPLES"] = str(n)
    start = time.perf_counter()
    evaluator = Evaluator(prep.normalized, open_data(hook, prep.calib.specs, what="evaluation data"), SessionConfig())
    built = time.perf_counter() - start
    result = evaluator.score(static)
    lo, hi = evaluator.drop_interval(result)
    scored = time.perf_counter() - start - built
    return {
        "samples": evaluator.samples,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "held_mb": (evaluator.reference.held_bytes + evaluator.batches.feeds.held_bytes) / 2**20,
        "spilled_mb": (evaluator.reference.spilled_bytes + evaluator.batches.feeds.spilled_bytes) / 2**20,
        "reference_mb": n * CHANNELS_OUT * width * 4 / 2**20,
        "build_s": built,
        "score_s": scored,
        "sqnr_db": result.output_sqnr_db,
        "drop": [lo, hi],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="500,5000")
    ap.add_argument("--width", type=int, default=8400)
    ap.add_argument("--spill-mb", type=float, default=None, help="QDEBUG_SPILL_MB for the children")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(child(args.child, args.width, Path(tmp))))
        return 0
    env = dict(os.environ)
    if args.spill_mb is not None:
        env["QDEBUG_SPILL_MB"] = str(args.spill_mb)
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(n), "--width", str(args.width)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{n}: {rows[-1]}", file=sys.stderr)
    base = rows[0]["peak_rss_mb"]
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} cores, Python {platform.python_version()}")
    budget = env.get("QDEBUG_SPILL_MB", "default")
    print(f"spill budget: {budget} MiB; output [1, {CHANNELS_OUT}, {args.width}] float32\n")
    print("| samples | FP32 references | held in memory | spilled to disk | peak RSS | vs smallest | references s "
          "| score s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['samples']:,} | {r['reference_mb']:,.0f} MiB | {r['held_mb']:,.0f} MiB | {r['spilled_mb']:,.0f} MiB "
            f"| {r['peak_rss_mb']:,.0f} MiB | {r['peak_rss_mb'] / base:.2f}x | {r['build_s']:.1f} "
            f"| {r['score_s']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
