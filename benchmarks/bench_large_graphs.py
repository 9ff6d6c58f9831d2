"""Benchmark: ``qdebug analyze`` and ``qdebug propose`` end to end on generated graphs of 800-3,200 nodes.

The "large graphs" model of docs/benchmarks.md (8-node residual blocks on ``[B, 16]``, from
``bench_quantize.make_chain``), 32 calibration and 64 evaluation samples. Each command runs as a child
process (``python -m qdebug``): analyze with ``--no-cache`` (calibration included), then propose on its
report. Reported: wall time and peak RSS of each child, and for propose the seconds spent re-quantizing --
every call of ``qdebug.quant.quantize.quantize_static_model`` and ``quantize_dynamic_model`` (the frontier's dynamic
variant), timed inside the child by a wrapper installed before qdebug's other modules import them (:data:`RUNNER`;
no profiler: cProfile had slowed ORT's pure-Python quantizer about 2.5x more than the rest) -- as a share of
its wall time.

Targets (issue 18 part 1): at 3,200 nodes analyze <= 90 s and propose's re-quantization <= 10 % of its wall
time; growth from 800 to 3,200 nodes no worse than linear. A second table breaks analyze down by stage (the
same wrappers, :data:`STAGE_LABELS`), with each stage's growth from the smallest size to the largest.

Usage:
  python benchmarks/bench_large_graphs.py --sizes 800,1600,3200 [--max-evaluations 12]
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quantize import chain_data, make_chain  # noqa: E402

RUNNER = """
import atexit, json, sys, time
import qdebug.quant.quantize as q
spent = {"static": 0.0, "dynamic": 0.0, "static_calls": 0, "dynamic_calls": 0}
def timed(kind, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[kind] += time.perf_counter() - start
            spent[kind + "_calls"] += 1
    return wrapper
q.quantize_static_model = timed("static", q.quantize_static_model)
q.quantize_dynamic_model = timed("dynamic", q.quantize_dynamic_model)
spent.update(per_sample=0.0, per_sample_calls=0)
import qdebug.pipeline as pipeline
pipeline._per_sample = timed("per_sample", pipeline._per_sample)
import qdebug.analysis.graph_engine as engine
import qdebug.analysis.measure as measure
STAGES = [(pipeline, "_prepared"), (pipeline, "_quantized_model"), (pipeline, "measure_layers"),
          (engine, "optimize_for_capture"), (engine, "build_reduction_model"), (engine, "open_sliced"),
          (measure, "_plain_check"), (pipeline, "_task_metric"), (pipeline, "save_report")]
for module, name in STAGES:
    spent.update({"stage:" + name: 0.0, "stage:" + name + "_calls": 0})
    setattr(module, name, timed("stage:" + name, getattr(module, name)))
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(spent)))
from qdebug.cli.main import entry
sys.argv[0] = "qdebug"
entry()
"""
"""The child of a timed command: qdebug's CLI with the two quantization entry points, analyze's per-sample
drill-down and analyze's stages (:data:`STAGE_LABELS`) wrapped (the first argument: where to write the seconds
spent in them)."""

STAGE_LABELS = {
    "_prepared": "prepare (load, normalize, calibrate)",
    "_quantized_model": "quantize",
    "measure_layers": "capture (all of it)",
    "optimize_for_capture": "capture: ORT optimizes each side (FP32, QDQ, fake-quant)",
    "build_reduction_model": "capture: merged reduction models built",
    "open_sliced": "capture: merged models opened (sliced)",
    "_plain_check": "capture: un-instrumented QDQ session (then scored on)",
    "_task_metric": "task metric on the evaluation set",
    "save_report": "report written",
}
"""analyze's stages the child times, in the breakdown's order."""


def _child(argv: list[str], cwd: Path, timing: Path | None = None) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of ``python -m qdebug argv`` (``timing``: through
    :data:`RUNNER`, which writes the quantizations' seconds there). The peak is this child's own
    (``wait4``), not the largest of every child so far."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    how = ["-c", RUNNER, str(timing)] if timing else ["-m", "qdebug"]
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, *how, *argv], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        if proc.returncode not in (0, 6):
            err.seek(0)
            print(err.read().decode(errors="replace")[-2000:], file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, proc.returncode


def measure(nodes: int, tmp: Path, budget: int) -> dict:
    model = tmp / f"chain{nodes}.onnx"
    onnx.save(make_chain(nodes // 8), model)
    calib = chain_data(tmp / "calib.npz", 32)
    evaluation = chain_data(tmp / "eval.npz", 64, seed=3)
    report = tmp / f"report{nodes}.json"
    a_timing = tmp / "analyze.json"
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
        a_timing,
    )
    a_spent = json.loads(a_timing.read_text()) if a_timing.is_file() else {}
    flips = _flips(report)
    proposal = tmp / f"proposal{nodes}.json"
    timing = tmp / "quantize.json"
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
        timing,
    )
    trials = json.loads(proposal.read_text())["evaluations"] if proposal.is_file() else 0
    spent = json.loads(timing.read_text()) if timing.is_file() else {}
    return {
        "nodes": nodes,
        "analyze_s": a_wall,
        "analyze_rss": a_rss,
        "analyze_rc": a_rc,
        "per_sample_s": a_spent.get("per_sample", math.nan),
        "flips": flips,
        "propose_s": p_wall,
        "propose_rss": p_rss,
        "propose_rc": p_rc,
        "trials": trials,
        "static_s": spent.get("static", math.nan),
        "static_calls": spent.get("static_calls", 0),
        "dynamic_s": spent.get("dynamic", math.nan),
        **{f"stage:{k}": float(a_spent.get(f"stage:{k}", math.nan)) for k in STAGE_LABELS},
    }


def _flips(report: Path) -> int:
    """How many evaluation samples the report's static model flips (what its per-sample section drills into)."""
    if not report.is_file():
        return 0
    section = json.loads(report.read_text()).get("per_sample") or {}
    return sum(int(v.get("flipped", 0)) for v in section.get("variants", []))


def _median_row(runs: list[dict]) -> dict:
    """Per key, the median over the runs of one size (the first run's value where it is not a number)."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="800,1600,3200")
    ap.add_argument("--max-evaluations", type=int, default=12)
    ap.add_argument("--runs", type=int, default=1, help="runs per size, interleaved; medians reported")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in sizes}
    for _ in range(args.runs):  # sizes interleaved: a slow spell of the machine hits every size alike
        for n in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                runs[n].append(measure(n, Path(tmp), args.max_evaluations))
            print(runs[n][-1], file=sys.stderr)
    rows = [_median_row(runs[n]) for n in sizes]
    machine = platform.processor() or platform.machine()
    print(f"machine: {machine}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"median of {args.runs} run(s) per size")  # fmt: skip
    print("\n| nodes | analyze wall | of which per-sample drill-down (flipped samples) | analyze peak RSS "
          "| propose wall | evaluations | static quantizations | dynamic | re-quantization share of propose |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        spent = r["static_s"] + r["dynamic_s"]
        share = spent / r["propose_s"] if r["propose_s"] else float("nan")
        print(
            f"| {r['nodes']:,} | {r['analyze_s']:.1f} s | {r['per_sample_s']:.1f} s ({r['flips']}) "
            f"| {r['analyze_rss']:.0f} MiB | {r['propose_s']:.1f} s "
            f"| {r['trials']} | {r['static_calls']}: {r['static_s']:.2f} s | {r['dynamic_s']:.2f} s "
            f"| {100 * share:.1f} % |"
        )
    first, last = rows[0], rows[-1]
    print(f"\nwhere analyze's time goes (medians; growth {first['nodes']:,} -> {last['nodes']:,} nodes):\n")
    print("| stage | " + " | ".join(f"{r['nodes']:,} nodes" for r in rows) + " | growth |")
    print("|---|" + "---:|" * (len(rows) + 1))
    stages = [(f"stage:{k}", label) for k, label in STAGE_LABELS.items()]
    stages.insert(stages.index(("stage:_task_metric", STAGE_LABELS["_task_metric"])) + 1,
                  ("per_sample_s", "per-sample drill-down"))  # fmt: skip
    for key, label in stages:
        cells = " | ".join(f"{r[key]:.2f} s" for r in rows)
        growth = last[key] / first[key] if min(first[key], last[key]) > 0.05 else math.nan
        print(f"| {label} | {cells} | {growth:.1f}x |" if growth == growth else f"| {label} | {cells} | - |")
    if len(rows) > 1:
        same = [r["analyze_s"] - r["per_sample_s"] for r in (first, last)]
        print(
            f"\nanalyze growth {first['nodes']:,} -> {last['nodes']:,} nodes ({last['nodes'] / first['nodes']:.0f}x): "
            f"{last['analyze_s'] / first['analyze_s']:.2f}x; without the per-sample drill-down (it runs only "
            f"where samples flip) {same[1] / same[0]:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
