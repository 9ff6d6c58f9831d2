"""Timing each variant in a process of its own, and the latency statistics of what it measured.

Each variant runs in a fresh interpreter (:mod:`qdebug.runtime.bench_child`) so
that its peak RSS is its own and no variant's allocations or thread pools
slow another. All of them read byte-identical input batches, written once
here. The processes stay open and the timed passes go round robin, so a
slow-down of the machine during the run spreads over every variant instead
of landing on the ones timed last.

A measuring process's result is the JSON dict :mod:`qdebug.runtime.bench_child`
writes (``ok``, ``error``, ``full_ns``, ``tail_ns``, ``peak_rss``, ...).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from qdebug.bench.options import BenchOptions
from qdebug.data import Batch
from qdebug.progress import Progress, no_progress
from qdebug.records.bench import LatencyStats


def latency_stats(ns: Sequence[int] | np.ndarray, batch_size: int) -> LatencyStats | None:
    """Percentiles (linear interpolation) and throughput of per-batch times given in nanoseconds."""
    arr = np.asarray(ns, dtype=np.float64) / 1e6
    if arr.size == 0:
        return None
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    total_s = float(arr.sum()) / 1e3
    return LatencyStats(
        batch_size=int(batch_size),
        batches=int(arr.size),
        p50_ms=float(p50),
        p95_ms=float(p95),
        p99_ms=float(p99),
        mean_ms=float(arr.mean()),
        min_ms=float(arr.min()),
        max_ms=float(arr.max()),
        throughput=batch_size * arr.size / total_s if total_s > 0 else math.nan,
    )


def write_batches(batches: Sequence[Batch], input_names: Sequence[str], path: Path) -> None:
    """Write the evaluation batches once, for every variant's process to read back identically, with the
    samples of each (``rows``): the child cannot tell them from the arrays when an input's batch axis is
    not axis 0 (a streaming model's state ``[2, batch, 128]``)."""
    arrays = {
        f"b{i}_{j}": np.asarray(b.feeds[n], order="C")
        for i, b in enumerate(batches)
        for j, n in enumerate(input_names)
    }
    np.savez(path, rows=np.array([b.size for b in batches], np.int64), **arrays)


def child_spec(
    model: Path, inputs: Path, input_names: Sequence[str], batches: int, options: BenchOptions, result: Path
) -> dict[str, Any]:
    """What :func:`qdebug.runtime.bench_child.measure` reads: the model, the batches and the loop settings."""
    return {
        "model": str(model),
        "inputs": str(inputs),
        "input_names": list(input_names),
        "batches": int(batches),
        "providers": list(options.providers),
        "threads": int(options.threads),
        "runs": int(options.runs),
        "warmup": int(options.warmup),
        "alloc_batches": int(options.alloc_batches),
        "result": str(result),
    }


def run_child(spec: dict[str, Any], workdir: Path, name: str) -> dict[str, Any]:
    """Measure one variant in a fresh interpreter; returns its result dict (``ok`` False on failure)."""
    spec_path = workdir / f"{name}.spec.json"
    result_path = Path(spec["result"])
    spec_path.write_text(json.dumps(spec))
    cmd, env = _child_command(spec_path)
    proc = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not result_path.is_file():
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [""]
        return {
            "ok": False,
            "error": f"measuring process exited with code {proc.returncode}: {tail[0][:300]}",
        }
    return json.loads(result_path.read_text())


def _child_command(spec_path: Path, serve: bool = False) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a measuring process: this interpreter, with this qdebug first on
    its path (a different installed qdebug must not be the one measured)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the qdebug package
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return [sys.executable, "-m", "qdebug.runtime.bench_child", str(spec_path), *(["--serve"] if serve else [])], env


HANDOVER_PAUSE_S = 0.005
"""Pause between two variants' passes: ORT's intra-op threads spin for a moment after a run, and the
next variant must not share the cores with them."""


class _ChildLines:
    """A measuring process's replies, read by a thread so that waiting for one can time out.

    A child that hangs (a provider deadlock, a model that never returns) had blocked bench forever: each
    wait for ``ready``, ``done`` or the exit now gives up after ``timeout`` seconds.
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _pump(self, stream: IO[str]) -> None:
        """Queue every line of ``stream``, then ``None`` for its end."""
        try:
            for line in stream:
                self._lines.put(line.strip())
        except (OSError, ValueError):  # the pipe closed under us: the process is gone
            pass
        self._lines.put(None)

    def next(self, timeout: float) -> str | None:
        """The next reply; ``""`` at end of output; ``None`` when none came within ``timeout`` s."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            return None
        return "" if line is None else line


def run_children_interleaved(
    specs: dict[str, dict[str, Any]],
    workdir: Path,
    runs: int,
    progress: Progress = no_progress,
    timeout: float = 600.0,
) -> dict[str, dict[str, Any]]:
    """Measure every variant in its own process, the timed passes handed out round robin.

    The processes start one after another (each has its session and warm-up
    done before the next starts, so no start-up overlaps another's), then pass
    ``r`` runs every variant once, starting with a different variant each
    pass. A slow-down of the machine during the run then spreads over all
    variants instead of landing on the ones timed last. A process that fails
    is reported as that variant's error; the others go on, as they do when a
    process does not answer within ``timeout`` seconds (start and warm-up,
    one pass, or writing its result): that one is killed.
    """
    procs: dict[str, subprocess.Popen] = {}
    replies: dict[str, _ChildLines] = {}
    errors: dict[str, str] = {}
    logs: dict[str, IO[str]] = {}
    try:
        for name, spec in specs.items():
            spec_path = workdir / f"{name}.spec.json"
            spec_path.write_text(json.dumps(spec))
            cmd, env = _child_command(spec_path, serve=True)
            logs[name] = open(workdir / f"{name}.stderr", "w+")  # noqa: SIM115  (closed in finally)
            proc = subprocess.Popen(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logs[name], text=True
            )
            procs[name] = proc
            replies[name] = _ChildLines(proc)
            answer = replies[name].next(timeout)
            if answer != "ready":
                errors[name] = "did not start" if answer is not None else f"did not start within {timeout:g} s"
                if answer is None:
                    proc.kill()
        live = [n for n in procs if n not in errors]
        for r in range(runs):
            progress("time", r, runs)
            for name in live[r % len(live) :] + live[: r % len(live)] if live else []:
                if name in errors:
                    continue
                proc = procs[name]
                try:
                    proc.stdin.write("pass\n")  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
                    answer = replies[name].next(timeout)
                except OSError:
                    answer = ""
                if answer is None:
                    errors[name] = f"did not finish a timed pass within {timeout:g} s"
                    proc.kill()
                elif answer != "done":
                    errors[name] = "stopped while timing"
                time.sleep(HANDOVER_PAUSE_S)
        progress("time", runs, runs)
        for proc in procs.values():
            with contextlib.suppress(OSError):
                proc.stdin.write("finish\n")  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
        for name, proc in procs.items():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                errors.setdefault(name, f"did not write its result within {timeout:g} s")
        results: dict[str, dict[str, Any]] = {}
        for name, spec in specs.items():
            path = Path(spec["result"])
            result = json.loads(path.read_text()) if path.is_file() else None
            if result is None or (name in errors and result.get("ok")):
                logs[name].seek(0)
                tail = (logs[name].read().strip().splitlines() or [""])[-1]
                code = procs[name].returncode if name in procs else None
                what = errors.get(name, "wrote no result")
                result = {"ok": False, "error": f"measuring process {what} (exit code {code}): {tail[:300]}"}
            results[name] = result
        return results
    finally:  # an error or Ctrl-C: no measuring process outlives the run, no log stays open
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()


def declared_shape_notes(results: dict[str, dict[str, Any]]) -> list[str]:
    """The measuring processes' notes on a wrongly declared output shape (``declared_shapes``), each once.

    Every variant keeps the FP32 model's graph outputs, so every process finds the same declaration
    wrong: the report says it once rather than once per variant.
    """
    return list(dict.fromkeys(n for r in results.values() for n in r.get("declared_shapes", ())))


def tail_stats(ns: list[int], size: int, sizes: list[int]) -> LatencyStats | None:
    """Statistics of the smaller batches (``size`` 0: of several sizes, reported at their mean size)."""
    if not ns:
        return None
    if size:
        return latency_stats(ns, size)
    # several smaller sizes (one per data file): throughput over their mean size
    return latency_stats(ns, int(round(sum(sizes) / len(sizes))))
