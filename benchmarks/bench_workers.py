#!/usr/bin/env python3
"""Benchmark ``propose --workers N`` and ``--ray`` (issue 18 part 3): wall time, and the same answer.

Usage::

    python benchmarks/bench_workers.py [--runs 3] [--samples 2000] [--configs default,all,evals] [--no-ray]

On a generated detector with two planted culprits (``fixtures/planted.py``, ``two_culprits``, ``bench``
size: 62 nodes, 64x64 images, its class-agreement metric) and an evaluation set of ``--samples`` fresh
images drawn the way the fixture draws them, the report is made once (not timed), then ``qdebug propose``
runs as a user runs it (a fresh process each time, this checkout on ``PYTHONPATH``) in three settings:

* ``default``: candidates screened on 256 samples, the answer, static, the neighbours and dynamic on all of
  them, the frontier timed (20 runs per point);
* ``all``: ``--screen-samples 0``: every candidate scored on every sample;
* ``evals``: ``--screen-samples 0 --time-runs 0``: the evaluations alone (no frontier).

each with ``--workers 1`` (ORT's own thread count), ``--workers 1 --threads 1``, ``--workers 2`` and (unless
``--no-ray``, or Ray is missing) ``--ray auto --workers 2``, which starts a local 2-CPU Ray instance, inside
the timed run, and shuts it down. Reported: the median wall time of ``--runs`` runs, the ratio to
``--workers 1``, and whether nodes, overrides, evaluation count and metrics equal ``--workers 1``'s.

Then one wide round alone (``--round N``, default 8): full static and N - 1 variants with one node FP32 each,
scored on the whole set through :class:`qdebug.runtime.parallel.Pool` with 1 worker (ORT's threads) and 2 workers (one
thread each): what the rounds of independent candidates gain (leave-one-out, the set scored after a screened
search, verify's and bench's variants).

Prints markdown tables (for ``docs/benchmarks.md``) and the machine on stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "default": [],
    "all": ["--screen-samples", "0"],
    "evals": ["--screen-samples", "0", "--time-runs", "0"],
}
MODES = {
    "--workers 1": ["--workers", "1"],
    "--workers 1 --threads 1": ["--workers", "1", "--threads", "1"],
    "--workers 2": ["--workers", "2"],
    "--ray auto --workers 2": ["--ray", "auto", "--workers", "2"],
}


def _planted():
    spec = importlib.util.spec_from_file_location("planted", ROOT / "fixtures" / "planted.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("planted", module)
    spec.loader.exec_module(module)
    return sys.modules["planted"]


def _evaluation_set(planted, folder: Path, samples: int, seed: int = 2024) -> Path:
    """``samples`` fresh images as ``two_culprits`` draws them (objects, exposure over two decades)."""
    rng = np.random.default_rng(seed)
    img, _ = planted._detector_images(rng, samples, 64, 4, 6)
    img = (img * np.exp(rng.uniform(math.log(0.01), 0.0, (samples, 1, 1, 1)))).astype(np.float32)
    path = folder / f"eval{samples}.npz"
    np.savez(path, images=img)
    return path


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "-"


def _run(args: list[str], env: dict, out: Path) -> tuple[float, dict]:
    cmd = [sys.executable, "-m", "qdebug", "propose", *args, "-o", str(out), "-q"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 6):
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return seconds, json.loads(out.read_text())


def _answer(p: dict) -> tuple:
    frontier = tuple((f["label"], f["metric"]) for f in p.get("frontier", ()))
    return (tuple(p["nodes_to_exclude"]), json.dumps(p["tensor_overrides"]), p["evaluations"],
            p["static_metric"], p["expected_metric"], frontier)  # fmt: skip


def candidate_models(prep, n: int) -> list:
    """Full static and ``n - 1`` variants of ``prep``'s model with one Conv/Add/Concat node FP32 each."""
    from qdebug.quant.quantize import QuantSpec, quantize_static_model

    names = [node.name for node in prep.normalized.graph.node if node.op_type in ("Conv", "Add", "Concat")]
    specs = [QuantSpec.of(prep.settings)] + [QuantSpec.of(prep.settings, nodes_to_exclude=(m,)) for m in names[: n - 1]]
    return [quantize_static_model(prep.normalized, prep.ranges, spec, load_check=False) for spec in specs]


def _wide_round(rec, evaluation: Path, tmpdir: Path, n: int, runs: int) -> list[tuple[str, float, float, bool]]:
    """Full static and ``n - 1`` one-node-FP32 variants scored as one round: 1 worker, then 2."""
    os.environ["QDEBUG_CACHE_DIR"] = str(tmpdir / "cache")
    from qdebug.data import open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.runtime.capture import SessionConfig
    from qdebug.runtime.parallel import Pool

    prep = prepare(rec.model, rec.calib, tmpdir / "wide", AnalyzeOptions())
    assert prep.ranges is not None
    evaluator = Evaluator(prep.normalized, open_data(evaluation, prep.calib.specs), SessionConfig(), rec.metric)
    models = candidate_models(prep, n)
    import onnx

    warms = []
    for i in range(2):  # other bytes than the round's candidates, one per worker
        warms.append(onnx.ModelProto())
        warms[-1].CopyFrom(models[0])
        warms[-1].doc_string = f"warm-up {i}"
    out, reference = [], None
    for label, workers in (("`Pool(workers=1)` (this process, ORT's threads)", 1), ("`Pool(workers=2)`", 2)):
        times = []
        for _ in range(runs):
            with Pool([evaluator], workers=workers) as pool:
                pool.map(evaluator, warms[:workers])  # workers started and holding the evaluator: the round alone
                t0 = time.perf_counter()
                values = [r.value for r in pool.map(evaluator, models)]
                times.append(time.perf_counter() - t0)
            print(f"round    {label:26s}: {times[-1]:6.2f} s (load {_load()})", file=sys.stderr)
        median = statistics.median(times)
        reference = reference or (median, values)
        out.append((label, median, reference[0] / median, values == reference[1]))
    return out


def main() -> int:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per setting (median)")
    ap.add_argument("--samples", type=int, default=2000, help="evaluation samples")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of the modes to run")
    ap.add_argument("--no-ray", action="store_true", help="leave the Ray path out")
    ap.add_argument("--round", type=int, default=8, help="candidates of the wide round (0: skip it)")
    args = ap.parse_args()
    has_ray = importlib.util.find_spec("ray") is not None and not args.no_ray
    modes = [m for m in args.modes.split(",") if m in MODES and (has_ray or "--ray" not in m)]
    planted = _planted()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-workers-") as tmp:
        tmpdir = Path(tmp)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env["QDEBUG_CACHE_DIR"] = str(tmpdir / "cache")
        rec = planted.make("two_culprits", tmpdir / "model", "bench")
        evaluation = _evaluation_set(planted, tmpdir / "model", args.samples)
        report = tmpdir / "report.json"
        cmd = [sys.executable, "-m", "qdebug", "analyze", rec.model, "--calib", rec.calib, "--eval", str(evaluation),
               "--metric", rec.metric, "-o", str(report), "-q"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        base = [str(report), "--target-drop", str(rec.target_drop)]
        for config in args.configs.split(","):
            reference = None
            baseline = None
            for mode in modes:
                times, answers = [], []
                for r in range(args.runs):
                    seconds, p = _run([*base, *CONFIGS[config], *MODES[mode]], env, tmpdir / f"{config}-{r}.json")
                    times.append(seconds)
                    answers.append(_answer(p))
                    print(f"{config:8s} {mode:26s} run {r + 1}: {seconds:6.2f} s (load {_load()})", file=sys.stderr)
                median = statistics.median(times)
                if reference is None:
                    reference, baseline = answers[0], median
                same = all(a == reference for a in answers)
                rows.append((config, mode, median, min(times), max(times), baseline / median, same, answers[0]))
        wide = _wide_round(rec, evaluation, tmpdir, args.round, args.runs) if args.round > 0 else []
    print(f"| setting | mode | median s ({args.runs} runs) | min-max s | speed-up vs `--workers 1` | same answer |")
    print("|---|---|---|---|---|---|")
    for config, mode, median, lo, hi, ratio, same, _ in rows:
        print(f"| {config} | `{mode}` | {median:.2f} | {lo:.2f}-{hi:.2f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
    if wide:
        print(f"\n| one round of {args.round} candidates on {args.samples} samples | median s ({args.runs} runs) | "
              "speed-up | same scores |")  # fmt: skip
        print("|---|---|---|---|")
        for label, median, ratio, same in wide:
            print(f"| {label} | {median:.2f} | {ratio:.2f}x | {'yes' if same else 'NO'} |")
    answer = rows[0][7] if rows else None
    if answer is not None:
        print(f"\nanswer: nodes {list(answer[0])}, {answer[2]} evaluations, static {answer[3]:.4f}, "
              f"selective {answer[4]:.4f}")  # fmt: skip
    import onnxruntime

    ray_version = "-"
    if has_ray:
        import ray

        ray_version = ray.__version__
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"machine: {cpu}, {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), Python "
          f"{platform.python_version()}, onnxruntime {onnxruntime.__version__}, ray {ray_version}; "
          f"{args.samples} evaluation samples; load average at the end {_load()}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
