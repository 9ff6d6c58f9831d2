"""Benchmark: ``qdebug analyze`` and ``qdebug propose`` end to end on generated graphs of 800-3,200 nodes.

The "large graphs" model of docs/benchmarks.md (8-node residual blocks on ``[B, 16]``, from
``bench_quantize.make_chain``), 32 calibration and 64 evaluation samples. Each command runs as a child
process (``python -m qdebug``): analyze with ``--no-cache`` (calibration included), then propose on its
report. Reported: wall time and peak RSS of each child, and for propose the seconds spent re-quantizing
(the cumulative time of ``qdebug.quantize.quantize_static_model``, read from a cProfile of the child: the
profiler slows Python a little, the share is of the profiled wall time) as a share of its wall time.

Targets (issue 18 part 1): at 3,200 nodes analyze <= 90 s and propose's re-quantization <= 10 % of its wall
time; growth from 800 to 3,200 nodes no worse than linear.

Usage:
  python benchmarks/bench_large_graphs.py --sizes 800,1600,3200 [--max-evaluations 12]
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quantize import chain_data, make_chain  # noqa: E402


def _child(argv: list[str], cwd: Path, profile: Path | None = None) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of ``python -m qdebug argv`` (under cProfile into ``profile``)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prof = ["-m", "cProfile", "-o", str(profile)] if profile else []
    proc = subprocess.run(
        [sys.executable, *prof, "-m", "qdebug", *argv], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 6):
        print(proc.stderr[-2000:], file=sys.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) / 1024, proc.returncode


def measure(nodes: int, tmp: Path, budget: int) -> dict:
    model = tmp / f"chain{nodes}.onnx"
    onnx.save(make_chain(nodes // 8), model)
    calib = chain_data(tmp / "calib.npz", 32)
    evaluation = chain_data(tmp / "eval.npz", 64, seed=3)
    report = tmp / f"report{nodes}.json"
    a_wall, a_rss, a_rc = _child(
        [
            "analyze",
            str(model),
            "--calib",
            str(calib),
            "--eval",
            str(evaluation),
            "-o",
            str(report),
            "--no-cache",
            "-q",
        ],
        tmp,
    )
    proposal = tmp / f"proposal{nodes}.json"
    profile = tmp / "propose.prof"
    p_wall, p_rss, p_rc = _child(
        [
            "propose",
            str(report),
            "--model",
            str(model),
            "--calib",
            str(calib),
            "--eval",
            str(evaluation),
            "-o",
            str(proposal),
            "--max-evaluations",
            str(budget),
            "--accept-no-speedup",
            "-q",
        ],
        tmp,
        profile,
    )
    quantize = 0.0
    trials = json.loads(proposal.read_text())["evaluations"] if proposal.is_file() else 0
    if profile.is_file():
        stats = pstats.Stats(str(profile))
        quantize = max(
            (
                v[3]
                for (path, _, name), v in stats.stats.items()  # type: ignore[attr-defined]
                if name == "quantize_static_model" and path.endswith("quantize.py")
            ),
            default=0.0,
        )
    return {
        "nodes": nodes,
        "analyze_s": a_wall,
        "analyze_rss": a_rss,
        "analyze_rc": a_rc,
        "propose_s": p_wall,
        "propose_rss": p_rss,
        "propose_rc": p_rc,
        "trials": trials,
        "quantize_s": quantize,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="800,1600,3200")
    ap.add_argument("--max-evaluations", type=int, default=12)
    args = ap.parse_args()
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(n, Path(tmp), args.max_evaluations))
        print(rows[-1], file=sys.stderr)
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("\n| nodes | analyze wall | analyze peak RSS | propose wall (profiled) | evaluations | re-quantization "
          "| share of propose |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        share = r["quantize_s"] / r["propose_s"] if r["propose_s"] else float("nan")
        print(
            f"| {r['nodes']:,} | {r['analyze_s']:.1f} s | {r['analyze_rss']:.0f} MiB | {r['propose_s']:.1f} s "
            f"| {r['trials']} | {r['quantize_s']:.1f} s | {100 * share:.1f} % |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
