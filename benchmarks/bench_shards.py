#!/usr/bin/env python3
"""Benchmark: one candidate at a time, scored whole or sharded over the workers (issue 18 part 3).

propose's search is mostly a chain of decisions: a step waits for the score before it. Rounds of independent
candidates (``bench_workers.py``) cannot help there; sharding can: with ``--workers N`` and a built-in metric,
a set of at least 512 samples is cut into ``min(N, samples // 256)`` runs of whole batches, each scored on a
worker, the parts merged (:mod:`qdebug.runtime.parallel`). This scores ``--candidates`` models (full static, then one
node FP32 each) **one after the other**, each waiting for the last, on the planted ``two_culprits`` detector
(``bench`` size) with ``--samples`` fresh images and the built-in ``output_sqnr_db`` metric (the fixture's own
class-agreement hook reads every batch at once and is never sharded), through ``Pool(workers=1)`` (this
process, ORT's threads), ``Pool(workers=2)`` (2 shards, one thread each) and, with Ray installed, a local
2-CPU Ray instance (2 actors; started before the clock). Reported: median seconds of ``--runs`` runs, the
ratio to one worker, and whether every value equals one worker's (to 1e-9 relative: the parts' sums of
squares are added in another order).

Usage:
  python benchmarks/bench_shards.py [--runs 3] [--samples 2000] [--candidates 6] [--no-ray]
Prints a markdown table and the machine on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_workers import _evaluation_set, _load, _planted, candidate_models  # noqa: E402


def _models(rec, tmpdir: Path, n: int):
    from qdebug.prepare import AnalyzeOptions, prepare

    prep = prepare(rec.model, rec.calib, tmpdir / "prep", AnalyzeOptions())
    return prep, candidate_models(prep, n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    has_ray = importlib.util.find_spec("ray") is not None and not args.no_ray
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-shards-") as tmp:
        tmpdir = Path(tmp)
        os.environ["QDEBUG_CACHE_DIR"] = str(tmpdir / "cache")
        from qdebug.data import open_data
        from qdebug.evaluation.evaluate import Evaluator
        from qdebug.runtime.capture import SessionConfig
        from qdebug.runtime.parallel import Pool

        planted = _planted()
        rec = planted.make("two_culprits", tmpdir / "model", "bench")
        evaluation = _evaluation_set(planted, tmpdir / "model", args.samples)
        prep, models = _models(rec, tmpdir, args.candidates)
        data = open_data(evaluation, prep.calib.specs)
        evaluator = Evaluator(prep.normalized, data, SessionConfig(), "output_sqnr_db")
        modes = [("`Pool(workers=1)` (this process, ORT's threads)", {"workers": 1}),
                 ("`Pool(workers=2)` (2 shards, one thread each)", {"workers": 2})]  # fmt: skip
        if has_ray:
            modes.append(("`Pool(ray='auto', workers=2)` (local 2-CPU Ray, 2 shards)", {"ray": "auto", "workers": 2}))
        rows, reference = [], None
        for label, kw in modes:
            times, values = [], []
            for _ in range(args.runs):  # a fresh pool each run: it remembers results by model hash
                with Pool([evaluator], **kw) as pool:
                    pool.score(evaluator, prep.normalized)  # workers up and holding their shard: the chain alone
                    warm = pool.scored
                    t0 = time.perf_counter()
                    values = [pool.score(evaluator, m, numbers_only=True).value for m in models]
                    times.append(time.perf_counter() - t0)
                    tasks = pool.scored - warm
                print(f"{label:60s}: {times[-1]:6.2f} s (load {_load()})", file=sys.stderr)
            median = statistics.median(times)
            reference = reference or (median, values)
            same = all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(values, reference[1], strict=True))
            rows.append((label, median, min(times), max(times), reference[0] / median, same, tasks))
    print(f"| {args.candidates} candidates one after the other, {args.samples} samples | median s ({args.runs} runs) "
          "| min-max s | speed-up | same values | tasks run |")  # fmt: skip
    print("|---|---:|---:|---:|---|---:|")
    for label, median, lo, hi, ratio, same, tasks in rows:
        print(f"| {label} | {median:.2f} | {lo:.2f}-{hi:.2f} | {ratio:.2f}x | {'yes' if same else 'NO'} | {tasks} |")
    import onnxruntime

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\nmachine: {cpu}, {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), Python "
          f"{platform.python_version()}, onnxruntime {onnxruntime.__version__}; load average at the end {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
