"""Benchmark: ``analyze --method minmax,entropy,percentile`` -- one run per method vs one shared run.

Two models, each analyzed for the three methods in a child process (wall time of the whole command,
interpreter start and imports included, a fresh calibration cache each time, so every method calibrates):

  demo    the bundled transformer demo (qdebug/demo_data: 128 calibration, 500 evaluation samples)
  chain   the "large graphs" model of benchmarks/bench_quantize.py (``make_chain``, 100 blocks: 800 nodes;
          32 calibration, 64 evaluation samples)

and up to three ways of running them:

  before    ``qdebug analyze --method minmax,entropy,percentile`` of an earlier qdebug (``--before DIR``: a
            copy of its source, e.g. ``git archive <commit> qdebug | tar -x -C DIR``), which ran one whole
            analysis per method
  separate  this qdebug's ``qdebug.pipeline.analyze`` once per method, one after the other (what
            ``analyze --method a,b,c`` did before the methods shared a run, without the comparison table)
  shared    this qdebug's ``qdebug analyze --method minmax,entropy,percentile`` (one prelude, one FP32
            evaluation, the FP32 side of the capture recorded once: :func:`qdebug.pipeline.analyze_methods`)

Both give the same reports (tests/test_methods_shared.py). Each cell is the median of ``--repeat`` runs;
``--stages`` also prints, per run, where the time went (one line per stage, summed over the methods).

Usage:
  python benchmarks/bench_methods.py --repeat 3 [--before /tmp/qdebug-before --modes before,shared]
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = ("minmax", "entropy", "percentile")

SEPARATE = """
import sys
from pathlib import Path
from qdebug.pipeline import analyze
from qdebug.prepare import AnalyzeOptions
from qdebug.cli.analyze import method_output
model, calib, eval_data, out = sys.argv[1:5]
for method in sys.argv[5].split(","):
    analyze(model, calib, eval_data=eval_data, output=method_output(out, method),
            options=AnalyzeOptions(method=method))
"""

STAGES = """
import collections, functools, json, sys, time
import qdebug.pipeline as P
import qdebug.prepare as R
import qdebug.evaluation.evaluate as E
spent = collections.defaultdict(float)
def timed(owner, name, label):
    f = getattr(owner, name, None)
    if f is None:
        return
    @functools.wraps(f)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t
    setattr(owner, name, wrapper)
for name, label in (("prelude", "prelude"), ("calibrate", "calibrate")):
    timed(R, name, label)
for name, label in (("_built_model", "quantize"), ("measure_layers", "capture"), ("_task_metric", "task metric"),
                    ("_per_sample", "per-sample"), ("save_report", "save")):
    timed(P, name, label)
timed(E.Evaluator, "__init__", "  of which FP32 references")
import atexit
atexit.register(lambda: print("STAGES " + json.dumps(spent), file=sys.stderr))
"""


def _data(tmp: Path) -> dict[str, tuple[Path, Path, Path]]:
    """(model, calib, eval) of each benchmark model."""
    import onnx

    from benchmarks.bench_quantize import chain_data, make_chain
    from qdebug.cli.demo import demo_files

    onnx.save(make_chain(100), tmp / "chain.onnx")
    chain = (tmp / "chain.onnx", chain_data(tmp / "chain-calib.npz"), chain_data(tmp / "chain-eval.npz", n=64, seed=2))
    return {"demo": demo_files(), "chain": chain}


def _command(mode: str, files: tuple[Path, Path, Path], out: Path, stages: bool) -> list[str]:
    model, calib, eval_data = map(str, files)
    prefix = STAGES if stages else ""
    if mode not in ("before", "separate", "shared"):
        raise SystemExit(f"unknown mode {mode!r}: before, separate or shared")
    if mode == "separate":
        return [sys.executable, "-c", prefix + SEPARATE, model, calib, eval_data, str(out), ",".join(METHODS)]
    cli = "from qdebug.cli.main import main; raise SystemExit(main(sys.argv[1:]))"
    return [sys.executable, "-c", prefix + "import sys\n" + cli, "analyze", model, "--calib", calib, "--eval",
            eval_data, "--method", ",".join(METHODS), "-o", str(out), "-q"]


def run_once(
    mode: str, files: tuple[Path, Path, Path], tmp: Path, stages: bool, before: Path | None = None
) -> tuple[float, dict]:
    """Wall seconds of one child, and its stage times (with ``stages``)."""
    work = Path(tempfile.mkdtemp(dir=tmp))
    source = before if mode == "before" else ROOT
    if source is None:
        raise SystemExit("mode before needs --before DIR (a copy of the earlier qdebug's source)")
    env = {**os.environ, "QDEBUG_CACHE_DIR": str(work / "cache"), "PYTHONPATH": str(source)}
    start = time.perf_counter()
    command = _command(mode, files, work / "r.json", stages)
    # from the scratch folder: ``python -c`` imports from its working directory first
    done = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    line = next((s for s in done.stderr.splitlines() if s.startswith("STAGES ")), None)
    return wall, json.loads(line[7:]) if line else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median)")
    parser.add_argument("--models", default="demo,chain", help="demo, chain or both")
    parser.add_argument("--modes", default="separate,shared", help="separate, shared or both")
    parser.add_argument("--stages", action="store_true", help="print each run's time per stage on stderr")
    parser.add_argument("--before", type=Path, default=None, help="source folder of the earlier qdebug (mode before)")
    args = parser.parse_args(argv)
    import onnxruntime

    modes = args.modes.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-methods-") as tmp:
        data = _data(Path(tmp))
        for name in args.models.split(","):
            row: dict = {"model": name}
            runs: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(args.repeat):  # the modes take turns: a change of load hits them alike
                for mode in modes:
                    wall, spent = run_once(mode, data[name], Path(tmp), args.stages, args.before)
                    runs[mode].append(wall)
                    if args.stages:
                        parts = ", ".join(f"{k} {v:.2f}" for k, v in spent.items())
                        print(f"{name} {mode}: {wall:.2f} s ({parts})", file=sys.stderr, flush=True)
            for mode in modes:
                row[mode] = statistics.median(runs[mode])
                row[f"{mode}_runs"] = runs[mode]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    head = "| model | " + " | ".join(f"{m} (3 methods)" for m in modes) + (" | saved |" if len(modes) == 2 else " |")
    print(head)
    print("|---" + "|---:" * (len(modes) + (len(modes) == 2)) + "|")
    for r in rows:
        cells = " | ".join(f"{r[m]:.2f} s" for m in modes)
        saved = f" | {100 * (1 - r[modes[1]] / r[modes[0]]):.0f} %" if len(modes) == 2 else ""
        print(f"| {r['model']} | {cells}{saved} |")
    print(
        f"\nonnxruntime {onnxruntime.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} cores; wall time of the whole command, median of {args.repeat}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
