"""Benchmark: ORT's quantizer with Python's cyclic collector on and paused (``qdebug.quant.quantize.collector_paused``).

The 3,200-node chain of ``bench_quantize.make_chain``, per-channel weights, built from cached ranges by
``quantize_static_model`` (the answer propose builds on the "large graphs" model). The pause is undone around
the call to time the collector's share: runs alternate paused / collecting, with ``--live`` extra small Python
objects alive in the process (propose holds a report's records; the collector walks every live object).

Usage:
  python benchmarks/bench_collector.py [--live 0,1000000] [--runs 4]
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quantize import chain_data, make_chain  # noqa: E402

import qdebug.quant.quantize as quantize  # noqa: E402
from qdebug.prepare import AnalyzeOptions, prepare  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", default="0,1000000", help="extra live Python objects, comma-separated")
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "chain.onnx"
        onnx.save(make_chain(400), model)
        prep = prepare(model, chain_data(Path(tmp) / "calib.npz", 8), Path(tmp) / "w", AnalyzeOptions(use_cache=False))
        spec = dataclasses.replace(quantize.QuantSpec(), per_channel=True)
        paused = quantize.collector_paused
        print("| extra live objects | collector paused (qdebug) | collecting | paused/collecting |")
        print("|---:|---:|---:|---:|")
        for live in (int(n) for n in args.live.split(",")):
            junk = [{"a": [i, str(i)], "b": (i,)} for i in range(live)]
            times: dict[str, list[float]] = {"paused": [], "collecting": []}
            for _ in range(args.runs):
                for mode in times:
                    quantize.collector_paused = paused if mode == "paused" else contextlib.nullcontext
                    start = time.perf_counter()
                    quantize.quantize_static_model(prep.normalized, prep.ranges, spec, load_check=False)
                    times[mode].append(time.perf_counter() - start)
            quantize.collector_paused = paused
            p, c = (statistics.median(times[m]) for m in ("paused", "collecting"))
            print(f"| {live:,} | {p:.2f} s | {c:.2f} s | {p / c:.2f} |")
            del junk
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
