"""Benchmark: a per-channel static build with ORT's per-channel weight loop vs qdebug's one-pass quantization.

The "large graphs" chain (``bench_quantize.make_chain``) is calibrated once; then
``qdebug.quant.quantize.quantize_static_model(..., QuantSpec(per_channel=True), load_check=False)`` -- what propose
runs for a per-channel candidate -- is timed ``--runs`` times in each mode, interleaved in one process:

  loop      ``fast_quantize.channel_quantized`` switched off: every weight goes to ORT's own
            ``quantize_onnx_initializer`` (one ``quantize_nparray`` per channel)
  one pass  qdebug's bulk quantization of each per-channel weight

Both must give the same bytes (checked). The rest of the fast path (indexed graph, vector scales) is on in
both modes.

Usage:
  python benchmarks/bench_channel_quant.py --nodes 3200 --runs 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=3200)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    from bench_quantize import BLOCK_NODES, chain_data, make_chain

    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quant import fast_quantize
    from qdebug.quant.calibrate import calibrate
    from qdebug.quant.quantize import QuantSpec, quantize_static_model

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx.save(make_chain(args.nodes // BLOCK_NODES), tmp / "chain.onnx")
        prep = prepare(
            tmp / "chain.onnx", chain_data(tmp / "calib.npz"), tmp / "w", AnalyzeOptions(), need_ranges=False
        )
        ranges = calibrate(prep.normalized_path, "bench", prep.calib, use_cache=False)
        one_pass = fast_quantize.channel_quantized
        seconds: dict[str, list[float]] = {"loop": [], "one pass": []}
        built: dict[str, bytes] = {}
        try:
            for _ in range(args.runs):
                for mode in seconds:
                    fast_quantize.channel_quantized = one_pass if mode == "one pass" else (lambda *a: None)
                    start = time.perf_counter()
                    model = quantize_static_model(
                        prep.normalized, ranges, QuantSpec(per_channel=True), load_check=False
                    )
                    seconds[mode].append(time.perf_counter() - start)
                    built[mode] = model.SerializeToString(deterministic=True)
        finally:
            fast_quantize.channel_quantized = one_pass
    loop, bulk = (statistics.median(v) for v in seconds.values())
    print(
        f"machine: {platform.machine()}, Python {platform.python_version()}; {args.nodes} nodes, median of {args.runs}"
    )
    print()
    print("| per-channel build | median s | min-max s |")
    print("|---|---:|---:|")
    for mode, values in seconds.items():
        print(f"| {mode} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |")
    print()
    print(f"one pass / loop: {bulk / loop:.2f}x; identical bytes: {built['loop'] == built['one pass']}")
    return 0 if built["loop"] == built["one pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
