"""Overhead of qdebug bench's timing harness vs a bare ``session.run`` loop.

Both loops run the same model, on the same session, over the same full batches
(the smaller last batch is left out of both). Repetitions are interleaved in
ABBA order (harness, bare, bare, harness, ...) so drift (thermal, other load)
hits both alike. Per repetition each loop gives

* the median of its per-batch times (the harness's own timer: refill the bound
  inputs + ``run_with_iobinding``; the bare loop: ``perf_counter_ns`` around
  ``session.run(None, feeds)``), and
* its wall time per batch (the whole pass, the harness's bookkeeping included),

and the table reports the median over repetitions and the ratio harness/bare.
The target is a ratio within 1.05: the harness must not make a model look
slower than the plainest loop a user could write.

usage:
  python benchmarks/bench_harness_overhead.py [--model fixtures/cnn/model.onnx]
      [--data fixtures/cnn/eval.npz] [--batch-size 32] [--reps 21] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qdebug.runtime.bench_child import Harness, make_session  # noqa: E402


def bare_pass(session, output_names, feed_list) -> tuple[np.ndarray, int]:
    """One pass of the plainest loop: ``session.run`` per batch; (per-batch ns, wall ns)."""
    times = np.zeros(len(feed_list), dtype=np.int64)
    clock = time.perf_counter_ns
    start = clock()
    for i, feeds in enumerate(feed_list):
        t0 = clock()
        session.run(output_names, feeds)
        times[i] = clock() - t0
    return times, clock() - start


def harness_pass(harness: Harness) -> tuple[np.ndarray, int]:
    """One timed pass of the bench harness; (per-batch ns, wall ns of its loop, bookkeeping included)."""
    full, _ = harness.time(1)
    return full, harness.last_wall_ns


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "fixtures" / "cnn" / "model.onnx"))
    ap.add_argument("--data", default=str(ROOT / "fixtures" / "cnn" / "eval.npz"))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=21, help="repetitions of each loop (interleaved)")
    ap.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (default 1: least scheduler noise)"
    )
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args(argv)

    session = make_session(args.model, ["CPUExecutionProvider"], args.threads)
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    with np.load(args.data) as z:
        arrays = {n: np.ascontiguousarray(z[n]) for n in inputs}
    n = len(arrays[inputs[0]])
    bs = args.batch_size
    batches = [{k: v[i : i + bs] for k, v in arrays.items()} for i in range(0, n - bs + 1, bs)]
    if not batches:
        raise SystemExit(f"{args.data} has fewer than {bs} samples")

    harness = Harness(session, batches)
    harness.warmup(args.warmup)
    for _ in range(args.warmup):
        bare_pass(session, outputs, batches)

    h_med, b_med, h_wall, b_wall, h_mean, b_mean = [], [], [], [], [], []
    for rep in range(args.reps):
        order = ("h", "b") if rep % 2 == 0 else ("b", "h")
        for which in order:
            if which == "h":
                times, wall = harness_pass(harness)
                h_med.append(float(np.median(times)))
                h_mean.append(float(np.mean(times)))
                h_wall.append(wall / len(batches))
            else:
                times, wall = bare_pass(session, outputs, batches)
                b_med.append(float(np.median(times)))
                b_mean.append(float(np.mean(times)))
                b_wall.append(wall / len(batches))

    def ms(x: float) -> str:
        return f"{x / 1e6:.4f}"

    hm, bm = statistics.median(h_med), statistics.median(b_med)
    hw, bw = statistics.median(h_wall), statistics.median(b_wall)
    ha, ba = statistics.median(h_mean), statistics.median(b_mean)
    model = Path(args.model).resolve()
    shown = model.relative_to(ROOT) if model.is_relative_to(ROOT) else model
    print(
        f"model `{shown}`, "
        f"batch {bs}, {len(batches)} batches per pass, {args.reps} interleaved repetitions, "
        f"threads {args.threads}, harness binding `{harness.mode}`, ORT "
        f"{__import__('onnxruntime').__version__}, {platform.processor() or platform.machine()}"
    )
    print()
    print("| measure | harness (ms/batch) | bare session.run (ms/batch) | harness / bare |")
    print("|---|---:|---:|---:|")
    print(f"| median of per-batch times | {ms(hm)} | {ms(bm)} | {hm / bm:.3f} |")
    print(f"| mean of per-batch times | {ms(ha)} | {ms(ba)} | {ha / ba:.3f} |")
    print(f"| wall time per batch (whole pass) | {ms(hw)} | {ms(bw)} | {hw / bw:.3f} |")
    ratio = max(hm / bm, hw / bw)
    print()
    print(f"{'within' if ratio <= 1.05 else 'OVER'} the 5% target (worst ratio {ratio:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
