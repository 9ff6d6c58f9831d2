#!/usr/bin/env python3
"""Benchmark ``qdebug propose``: re-quantization from cached ranges, search cost, vs a naive baseline.

Usage::

    python benchmarks/bench_propose.py [--fixture transformer] [--repeat 10]

Measures on a committed fixture:

1. one re-quantization from the cached calibration ranges
   (``quantize_static_model``: ORT's ``QDQQuantizer`` fed deep-copied ranges)
   vs one fresh ``onnxruntime.quantization.quantize_static`` call with the
   same settings (which recalibrates every time) -- the issue's target is >= 10x.
   The fresh call costs calibration + the same quantizer work, so the ratio
   grows with the calibration set; it is measured on the fixture's small set
   and on a larger one (the fixture's samples tiled to ``--big-calib``);
2. the total wall time of ``propose`` (analysis report made first, not timed),
   its evaluations and the nodes it keeps FP32, for two targets;
3. the naive baseline: exclude the top-k nodes by local SQNR, k = 1, 2, ...
   until the same target is met (or every quantizable node is excluded).

Prints a markdown table (for ``docs/benchmarks.md``) on stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _NpzReader:
    """A CalibrationDataReader over an .npz (one sample per call, like the snippet qdebug prints)."""

    def __init__(self, path: Path) -> None:
        data = np.load(path)
        names = [k for k in data.files if k != "labels"]
        n = len(data[names[0]])
        self._items = iter([{k: data[k][i : i + 1] for k in names} for i in range(n)])

    def get_next(self):  # noqa: D102
        return next(self._items, None)


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixture", default="transformer")
    p.add_argument("--repeat", type=int, default=10, help="re-quantizations timed (median)")
    p.add_argument("--fresh-repeat", type=int, default=3, help="fresh quantize_static calls timed (median)")
    p.add_argument(
        "--big-calib", type=int, default=1024, help="samples of the larger calibration set (tiled)"
    )
    args = p.parse_args()

    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from qdebug.data import open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.pipeline import analyze
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.propose import ProposeOptions, excludable_nodes, propose
    from qdebug.quant.quantize import QuantSpec, quantize_static_model, quiet_ort_logging
    from qdebug.runtime.capture import SessionConfig

    folder = ROOT / "fixtures" / args.fixture
    model, calib, evaluation = folder / "model.onnx", folder / "calib.npz", folder / "eval.npz"
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-") as tmp:
        os.environ["QDEBUG_CACHE_DIR"] = str(Path(tmp) / "cache")
        tmpdir = Path(tmp)
        report = analyze(model, calib, eval_data=evaluation, output=tmpdir / "report.json")
        task = report.task
        assert task is not None
        prep = prepare(model, calib, tmpdir / "prep", AnalyzeOptions())  # ranges from the cache
        assert prep.ranges is not None and prep.ranges.from_cache
        some = tuple(n.name for n in report.nodes if n.op_type == "MatMul")[:3]
        spec = QuantSpec(nodes_to_exclude=some)

        cached = _median_time(lambda: quantize_static_model(prep.normalized, prep.ranges, spec), args.repeat)

        big = tmpdir / "calib_big.npz"
        data = np.load(calib)
        reps = max(1, math.ceil(args.big_calib / len(data["input"])))
        np.savez(big, **{k: np.concatenate([data[k]] * reps)[: args.big_calib] for k in data.files})

        def fresh(path: Path = calib) -> None:
            with quiet_ort_logging():
                quantize_static(
                    str(prep.normalized_path),
                    str(tmpdir / "fresh.onnx"),
                    _NpzReader(path),
                    quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    per_channel=False,
                    calibrate_method=CalibrationMethod.MinMax,
                    nodes_to_exclude=list(some),
                )

        fresh_s = _median_time(fresh, args.fresh_repeat)
        fresh_big = _median_time(lambda: fresh(big), args.fresh_repeat)
        n_calib = len(data["input"])
        rows.append(("one re-quantization from cached ranges (median)", f"{1e3 * cached:.0f} ms"))
        rows.append(
            (
                f"one fresh `quantize_static` call, recalibrating on the fixture's {n_calib} samples",
                f"{1e3 * fresh_s:.0f} ms ({fresh_s / cached:.1f}x slower)",
            )
        )
        rows.append(
            (
                f"one fresh `quantize_static` call, recalibrating on {args.big_calib} samples",
                f"{1e3 * fresh_big:.0f} ms ({fresh_big / cached:.1f}x slower)",
            )
        )

        lost = 100 * (task.fp32 - task.quantized)
        rows.append(
            (
                f"{task.name}: FP32 / full static ({task.samples} eval samples)",
                f"{100 * task.fp32:.2f}% / {100 * task.quantized:.2f}% (lost {lost:.1f} points)",
            )
        )
        targets = [("90% recovery", max(0.0, 0.1 * lost)), ("1-point drop", 1.0)]
        evaluator = Evaluator(
            prep.normalized, open_data(evaluation, prep.calib.specs, what="eval"), SessionConfig()
        )
        quantizable = set(excludable_nodes(report.nodes))
        ranked = sorted(
            (n for n in report.nodes if n.name in quantizable and not math.isnan(n.local_sqnr_db)),
            key=lambda n: n.local_sqnr_db,
        )
        for label, drop in targets:
            t0 = time.perf_counter()
            result = propose(
                report, output=tmpdir / f"p{drop:.2f}.json", options=ProposeOptions(target_drop=drop)
            )
            wall = time.perf_counter() - t0
            prop = result.proposal
            evals = result.evaluations
            qs = sum(t.quantize_seconds for t in result.trials)
            es = sum(t.eval_seconds for t in result.trials)
            bound = 2 * math.ceil(math.log2(max(result.candidates, 2))) + 10
            rows.append(
                (
                    f"propose, target {label} (drop <= {drop:.2f} points)",
                    f"{'met' if result.met else 'NOT met'}: {100 * prop.expected_metric:.2f}%, "
                    f"{len(prop.nodes_to_exclude)}/{prop.quantizable_nodes} nodes FP32, "
                    f"{evals} evaluations (bound {bound}, L={result.candidates}), {result.reranks} re-ranks, "
                    f"wall {wall:.1f} s (re-quantize {qs:.1f} s, evaluate {es:.1f} s)",
                )
            )
            threshold = task.fp32 - drop / 100
            k_needed, base_evals, base_value = None, 0, math.nan
            t0 = time.perf_counter()
            for k in range(1, len(ranked) + 1):
                q = quantize_static_model(
                    prep.normalized,
                    prep.ranges,
                    QuantSpec(nodes_to_exclude=tuple(n.name for n in ranked[:k])),
                )
                base_value = evaluator.score(q).value
                base_evals += 1
                if base_value >= threshold:
                    k_needed = k
                    break
            base_wall = time.perf_counter() - t0
            rows.append(
                (
                    "naive top-k by local SQNR, same target",
                    (
                        f"k = {k_needed} nodes FP32 ({100 * base_value:.2f}%)"
                        if k_needed
                        else f"not met even with all {len(ranked)} nodes"
                    )
                    + f", {base_evals} evaluations, {base_wall:.1f} s",
                )
            )

    print(f"## propose ({args.fixture} fixture)\n")
    cpu = platform.processor() or platform.machine()
    print(f"onnxruntime {ort.__version__}, {cpu}, {os.cpu_count()} CPUs; times are medians\n")
    print("| measurement | result |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
