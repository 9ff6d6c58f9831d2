"""Benchmark: qdebug analyze vs the inference floor vs ORT's qdq_loss_debug.

Each measurement runs in its own subprocess so peak RSS (ru_maxrss of the
child) is its own. In one run, on the same models and samples:

  floor   plain FP32 + QDQ inference over the samples (sessions created once)
  floor/w the same, with batches side by side on one single-threaded run per
          core (the scheme qdebug's capture uses), for a like-for-like ratio
  qdebug  `qdebug analyze --quantized Q` (capture + metrics; no calibration)
  ortdbg  onnxruntime.quantization.qdq_loss_debug: collect_activations for
          both models, create_activation_matching, compute_activation_error

Usage:
  python benchmarks/bench_analyze.py --models cnn,transformer,resnet,bert --n 32,128 --n-big 1000
Writes a markdown table to stdout (copy it into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time, numpy as np
mode, model, qmodel, data_dir, out = sys.argv[1:6]
c0 = os.times()
files = sorted(__import__('pathlib').Path(data_dir).glob('*.npz'))
def batches():
    for f in files:
        with np.load(f) as z:
            yield {k: z[k] for k in z.files if k != 'labels'}
t0 = time.perf_counter()
if mode == 'floor':
    import onnxruntime as ort
    s1 = ort.InferenceSession(model, providers=['CPUExecutionProvider'])
    s2 = ort.InferenceSession(qmodel, providers=['CPUExecutionProvider'])
    for feeds in batches():
        s1.run(None, feeds); s2.run(None, feeds)
elif mode == 'floorw':
    import os, onnxruntime as ort
    from concurrent.futures import ThreadPoolExecutor
    o = ort.SessionOptions(); o.intra_op_num_threads = 1
    s1 = ort.InferenceSession(model, o, providers=['CPUExecutionProvider'])
    s2 = ort.InferenceSession(qmodel, o, providers=['CPUExecutionProvider'])
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as ex:
        for _ in ex.map(lambda f: (s1.run(None, f), s2.run(None, f)), batches()): pass
elif mode == 'qdebug':
    from qdebug.cli.main import main
    rc = main(['analyze', model, '--calib', data_dir, '--quantized', qmodel, '-o', out + '.report.json', '-q',
               '--batch-size', '16'])
    assert rc == 0, rc
elif mode == 'ortdbg':
    import logging
    logging.getLogger().setLevel(logging.ERROR)
    from onnxruntime.quantization.qdq_loss_debug import (collect_activations, compute_activation_error,
        create_activation_matching, modify_model_output_intermediate_tensors)
    class R:
        def __init__(self): self.it = batches()
        def get_next(self): return next(self.it, None)
        def __iter__(self): return self.it
    import tempfile, os
    d = tempfile.mkdtemp()
    fa, qa = os.path.join(d, 'f.onnx'), os.path.join(d, 'q.onnx')
    modify_model_output_intermediate_tensors(model, fa)
    modify_model_output_intermediate_tensors(qmodel, qa)
    f_act = collect_activations(fa, R())
    q_act = collect_activations(qa, R())
    err = compute_activation_error(create_activation_matching(q_act, f_act))
dt = time.perf_counter() - t0
# VmHWM is this process's own peak (ru_maxrss can be inherited from the parent across exec)
rss = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024
c1 = os.times()
cpu = (c1.user - c0.user) + (c1.system - c0.system)  # this process's CPU time over the same span, all threads
json.dump({'seconds': dt, 'rss_mb': rss, 'cpu_s': cpu}, open(out, 'w'))
"""


def write_batches(calib: Path, n: int, dest: Path, batch: int = 16) -> None:
    """Split (and tile, if needed) a calibration file into N samples as one .npz per batch."""
    dest.mkdir(parents=True, exist_ok=True)
    with np.load(calib) as z:
        arrays = {k: z[k] for k in z.files if k != "labels"}
    have = len(next(iter(arrays.values())))
    reps = -(-n // have)
    tiled = {k: np.concatenate([v] * reps)[:n] for k, v in arrays.items()}
    for i, start in enumerate(range(0, n, batch)):
        np.savez(dest / f"b{i:05d}.npz", **{k: v[start : start + batch] for k, v in tiled.items()})


def quantize(model: Path, calib_dir: Path, out: Path) -> None:
    """Default static QDQ model (what a user would have)."""
    import contextlib

    from qdebug.cli.main import main

    args = ["analyze", str(model), "--calib", str(calib_dir), "-o", str(out.parent / "q.report.json")]
    with contextlib.redirect_stdout(sys.stderr):  # keep the analysis summary out of the table on stdout
        rc = main([*args, "-q", "--max-samples", "32"])
    assert rc == 0
    (out.parent / "q.report_files" / "quantized.onnx").rename(out)


def run_child(mode: str, model: Path, qmodel: Path, data: Path, timeout: float = 1800) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(model), str(qmodel), str(data), out],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"rc {proc.returncode}: {tail[:80]}"}
    return json.loads(Path(out).read_text())


def model_paths(name: str, work: Path) -> tuple[Path, Path]:
    """(model, calib) for a fixture or a generated benchmark model."""
    if name in ("cnn", "transformer"):
        base = ROOT / "fixtures" / name
        return base / "model.onnx", base / "calib.npz"
    gen = work / "gen"
    if not (gen / name / "model.onnx").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "make_bench_models.py"), str(gen), "--n", "32"],
            check=True,
            stdout=sys.stderr,
        )
    return gen / name / "model.onnx", gen / name / "calib.npz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="cnn,transformer,resnet,bert")
    ap.add_argument("--n", default="32,128")
    ap.add_argument("--n-big", type=int, default=1000)
    ap.add_argument("--skip-ortdbg", action="store_true")
    args = ap.parse_args()
    ns = [int(x) for x in args.n.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            model, calib = model_paths(name, work)
            qmodel = work / f"{name}.qdq.onnx"
            for n in ns + ([args.n_big] if args.n_big else []):
                data = work / f"{name}_{n}"
                write_batches(calib, n, data)
                if not qmodel.exists():
                    quantize(model, data, qmodel)
                floor = run_child("floor", model, qmodel, data)
                floorw = run_child("floorw", model, qmodel, data)
                qd = run_child("qdebug", model, qmodel, data)
                od = (
                    run_child("ortdbg", model, qmodel, data)
                    if (n != args.n_big and not args.skip_ortdbg)
                    else {}
                )
                rows.append((name, n, floor, floorw, qd, od))
                print(name, n, floor, floorw, qd, od, file=sys.stderr, flush=True)
    print(
        "| model | N | floor s | qdebug s | qdebug/floor | floor/w s | qdebug/(floor/w) | qdebug RSS MB "
        "| ORT qdq_loss_debug s | RSS MB | speed-up | RSS ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, n, fl, flw, qd, od in rows:

        def g(d, k):
            return f"{d[k]:.2f}" if k in d else d.get("error", "-")

        ratio = f"{qd['seconds'] / fl['seconds']:.2f}" if "seconds" in qd and "seconds" in fl else "-"
        ratio_w = f"{qd['seconds'] / flw['seconds']:.2f}" if "seconds" in qd and "seconds" in flw else "-"
        sp = f"{od['seconds'] / qd['seconds']:.1f}x" if "seconds" in od and "seconds" in qd else "-"
        rr = f"{od['rss_mb'] / qd['rss_mb']:.1f}x" if "rss_mb" in od and "rss_mb" in qd else "-"
        print(
            f"| {name} | {n} | {g(fl, 'seconds')} | {g(qd, 'seconds')} | {ratio} | {g(flw, 'seconds')} | {ratio_w} "
            f"| {g(qd, 'rss_mb')} | {g(od, 'seconds')} | {g(od, 'rss_mb')} | {sp} | {rr} |"
        )
    # CPU time bounds the wall time from below: on C cores a run cannot take less than CPU / C
    cores = len(os.sched_getaffinity(0))
    print(f"\nCPU seconds (user + sys, all threads) and the wall-time bound they set on {cores} core(s):\n")
    print("| model | N | floor CPU s | floor/w CPU s | qdebug CPU s | qdebug CPU / cores, against the floor's wall |")
    print("|---|---|---|---|---|---|")
    for name, n, fl, flw, qd, _ in rows:
        if "cpu_s" in qd and "seconds" in fl:
            bound = f"{qd['cpu_s'] / cores:.2f} s = {qd['cpu_s'] / cores / fl['seconds']:.2f}x"
            cpus = (fl.get("cpu_s", float("nan")), flw.get("cpu_s", float("nan")), qd["cpu_s"])
            print(f"| {name} | {n} | {cpus[0]:.2f} | {cpus[1]:.2f} | {cpus[2]:.2f} | {bound} |")


if __name__ == "__main__":
    main()
