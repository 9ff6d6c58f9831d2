"""``qdebug bench``: a fair deployment comparison of FP32 and quantized variants.

Every variant is built from the same normalized FP32 model
(:func:`qdebug.pipeline.prepare`): dynamic quantization (QInt8 weights),
static QDQ from the cached calibration ranges (one per calibration method),
selective static from a :class:`~qdebug.records.Proposal`, optionally the
QOperator format; per-channel weights on request. Then, for each variant:

* the task metric and the output SQNR vs FP32 on the evaluation set
  (:class:`~qdebug.evaluate.Evaluator`, in this process, not timed);
* latency, throughput, peak RSS and Python-side allocations, measured in a
  process of its own (:mod:`qdebug.bench_child`), one variant after another,
  on byte-identical input batches written once by this process, with the
  same provider, threads and batch shape for all of them.

The machine is part of the result: CPU model, the INT8-relevant instruction
set flags, the ORT version and provider, with a warning when INT8 speed-ups
are unlikely on this CPU (no VNNI/AMX on x86, no dot-product on Arm).

The records below are the ``bench.json`` schema (``BENCH_SCHEMA_VERSION``);
they are plain frozen dataclasses like :mod:`qdebug.records` and load with
:func:`load_bench`. This module imports onnx/onnxruntime only inside
functions, so the TUI can read a bench file without loading the runtime.
"""

# No ``from __future__ import annotations`` here: report_io.from_jsonable resolves
# string annotations in qdebug.records' namespace only, so these records keep real ones.

import contextlib
import datetime as _dt
import html
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from qdebug import __version__
from qdebug.errors import ExitCode, QDebugError
from qdebug.files import record_path
from qdebug.formatting import ACCURACY_METRICS
from qdebug.graph.ops import DYNAMIC_Q, INTEGER_OPS
from qdebug.progress import Progress, no_progress

BENCH_SCHEMA_VERSION = 1
"""Version of the ``bench.json`` layout; :func:`load_bench` refuses others."""

KINDS = ("fp32", "dynamic", "static", "selective", "qoperator")
"""Variant kinds ``--variants`` accepts."""

X86_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "amx_tile", "avx512bw", "avx2")
"""x86 flags that decide ORT's INT8 kernels, reported when present (in this order)."""
X86_FAST = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
"""x86 flags with an int8 dot-product instruction (VNNI) or matrix unit (AMX)."""
ARM_INT8_FLAGS = ("asimddp", "i8mm", "sve", "sve2")
ARM_FAST = frozenset({"asimddp", "i8mm"})


# ============================================================================ records


@dataclass(frozen=True)
class LatencyStats:
    """Latency of the batches of one size over every timed pass, in milliseconds per batch."""

    batch_size: int
    batches: int
    """Timed batches behind these numbers (percentiles need many: p99 of 20 batches is nearly the max)."""
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    throughput: float
    """Samples per second: ``batch_size * batches / (total time of these batches)``."""


@dataclass(frozen=True)
class MachineInfo:
    """Where the numbers were measured: INT8 speed depends on it more than on the model."""

    cpu_model: str
    arch: str
    logical_cpus: int
    cpus_available: int
    """CPUs this process may run on (affinity/cgroup), which ORT's default thread count follows."""
    int8_flags: tuple[str, ...]
    """INT8-relevant ISA flags present (x86: avx512_vnni, avx_vnni, amx_int8, amx_tile, avx512bw, avx2;
    Arm: asimddp, i8mm, sve, sve2)."""
    os: str
    python: str
    ort_version: str
    providers: tuple[str, ...]
    """Providers every session was created with, in priority order."""
    threads: int
    """Intra-op threads (0: ORT's choice, one per physical core)."""
    warning: str = ""
    """Why INT8 variants may not be faster here (empty when the CPU has INT8 dot-product support)."""


@dataclass(frozen=True)
class WorstLayer:
    """A node that adds much error (from a variant's per-layer report)."""

    node: str
    op_type: str
    introduced_db: float
    """Accumulated SQNR at the node's input minus at its output (see ``NodeRecord.introduced_db``)."""
    accumulated_sqnr_db: float
    added_noise_db: float = math.nan
    """The noise the node adds (``NodeRecord.added_noise_db``): what ranks the worst layers."""


@dataclass(frozen=True)
class VariantResult:
    """One model variant: how it was built, how fast, how big, how accurate."""

    name: str
    """``fp32``, ``dynamic``, ``static`` (``static-<method>`` with several methods), ``selective``,
    ``qoperator``."""
    kind: str
    method: str = ""
    """Calibration method of static variants (empty for fp32 and dynamic)."""
    quant_format: str = ""
    """``QDQ``, ``QOperator``, ``dynamic`` or empty (fp32)."""
    per_channel: bool = False
    model_path: str = ""
    model_bytes: int = 0
    """Size of the .onnx file on disk."""
    excluded_nodes: int = 0
    """Nodes kept in float (selective variant)."""
    full: LatencyStats | None = None
    """Full batches (``batch_size`` samples); ``None`` when the variant failed."""
    tail: LatencyStats | None = None
    """The smaller last batch, timed separately (never padded); ``None`` when the data divides evenly."""
    tail_sizes: tuple[int, ...] = ()
    """Sizes of the batches timed as the tail (several when data files differ in size; ``tail`` then
    reports their mean size)."""
    speedup: float = math.nan
    """FP32 p50 / this p50 on full batches (> 1: faster than FP32)."""
    peak_rss_mb: float = math.nan
    """Peak resident memory of the variant's own process (VmHWM): interpreter, ORT, inputs, session, runs."""
    rss_before_session_mb: float = math.nan
    """RSS once the interpreter, ORT and the input batches are loaded, before the session: a floor
    common to all variants."""
    session_rss_mb: float = math.nan
    """``peak_rss_mb - rss_before_session_mb``: what creating and running this model's session added."""
    alloc_bytes_per_batch: float = math.nan
    """Largest Python-side (tracemalloc) allocation peak within one batch of the loop, bytes, with the
    measurement's own floor removed. An input buffer allocated per batch would show here in full."""
    alloc_bytes_mean: float = math.nan
    alloc_net_bytes_per_batch: float = math.nan
    """Python-side memory still held per batch after the loop (a leak would show here)."""
    binding: str = ""
    """``iobinding`` (outputs in preallocated buffers), ``iobinding-ort-outputs`` or ``session.run``."""
    providers_used: tuple[str, ...] = ()
    metric_value: float = math.nan
    """The task metric (:attr:`BenchReport.metric`) on the evaluation set."""
    output_sqnr_db: float = math.nan
    """Worst SQNR over the model outputs vs FP32 (``inf`` for FP32 itself)."""
    layer_report: str = ""
    """Per-layer report of this variant (a qdebug analysis report, ``qdebug tui`` opens it); dynamic only."""
    worst_layers: tuple[WorstLayer, ...] = ()
    """The nodes adding the most error, from ``layer_report``."""
    notes: tuple[str, ...] = ()
    error: str = ""
    """Why the variant has no numbers (it failed to build, load or run); empty on success."""


@dataclass(frozen=True)
class BenchReport:
    """The ``bench.json`` file."""

    schema_version: int
    kind: str
    """Always ``"bench"``."""
    qdebug_version: str
    created: str
    model: str
    model_sha256: str
    normalized_model: str
    calib: str
    eval: str
    metric: str
    """Task metric name (higher is better): ``top1``, ``top1_agreement``, ``exact_match``, ``output_sqnr_db``
    or a hook."""
    samples: int
    """Evaluation samples (every timed pass runs all of them)."""
    batch_size: int
    runs: int
    """Timed passes over the evaluation set per variant."""
    warmup: int
    """Untimed runs of every batch shape before timing."""
    machine: MachineInfo
    variants: tuple[VariantResult, ...]
    proposal: str | None = None
    notes: tuple[str, ...] = ()

    def variant(self, name: str) -> VariantResult:
        """Look up a variant by name (KeyError if absent)."""
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)


@dataclass(frozen=True)
class BenchOptions:
    """Options of :func:`run_bench` (the flags of ``qdebug bench``)."""

    variants: tuple[str, ...] | None = None
    """Variants to measure (None: fp32, dynamic, static, and selective when a proposal is given -- as the
    CLI does without --variants)."""
    methods: tuple[str, ...] = ()
    """Calibration methods, one static variant each (empty: the proposal's method, else minmax)."""
    per_channel: bool = False
    activation_type: str | None = None
    """Activation type of the static variants (None: the proposal's, else QUInt8)."""
    weight_type: str | None = None
    """Weight type of the static variants (None: the proposal's, else QInt8)."""
    dynamic_ops: tuple[str, ...] = ()
    """Op types ``quantize_dynamic`` quantizes (empty: ORT's default set)."""
    batch_size: int | None = None
    max_samples: int | None = None
    """Calibration samples (the evaluation set is used whole)."""
    metric: str | None = None
    upgrade_opset: bool = False
    inline_constant_if: bool = False
    use_cache: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0
    runs: int = 5
    warmup: int = 3
    alloc_batches: int = 20
    """Batches in the separate tracemalloc loop."""
    dynamic_layers: bool = True
    """Also measure the dynamic variant's per-layer error vs FP32 (a report ``qdebug tui`` opens)."""
    timeout_s: float = 600.0
    """Seconds a measuring process may take to start and warm up, for one timed pass, or to write its
    result; past that it is killed and its variant reported with an error (a hang must not stall CI)."""


# ============================================================================ machine


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(CPU model, flag set) from ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    model = ""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def int8_flags(arch: str, flags: set[str]) -> tuple[str, ...]:
    """The INT8-relevant flags present, in a fixed order."""
    wanted = ARM_INT8_FLAGS if _is_arm(arch) else X86_INT8_FLAGS
    return tuple(f for f in wanted if f in flags)


def _is_arm(arch: str) -> bool:
    return arch.lower().startswith(("arm", "aarch64"))


def int8_warning(arch: str, flags: set[str] | None, providers: Sequence[str]) -> str:
    """A warning when INT8 variants are unlikely to beat FP32 on this CPU (empty if they may).

    Only the CPU provider is judged: other providers run INT8 on their own hardware.
    ``flags=None`` means the flags could not be read.
    """
    if not providers or providers[0] != "CPUExecutionProvider":
        return ""
    if flags is None:
        return "could not read the CPU flags: cannot tell whether INT8 kernels are accelerated on this CPU"
    if _is_arm(arch):
        if flags & ARM_FAST:
            return ""
        return (
            "this Arm CPU has no int8 dot-product instructions (asimddp/i8mm): INT8 variants are likely "
            "no faster than FP32"
        )
    if flags & X86_FAST:
        return ""
    have = "AVX-512BW" if "avx512bw" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return (
        f"this CPU has no VNNI/AMX (only {have}): ORT's INT8 kernels emulate the int8 dot product, so INT8 "
        "variants are often no faster, and dynamic quantization can be several times slower, than FP32"
    )


def machine_info(providers: Sequence[str], threads: int, cpuinfo: str = "/proc/cpuinfo") -> MachineInfo:
    """Describe the CPU, OS and ORT this benchmark runs on."""
    import onnxruntime

    arch = platform.machine()
    model, flags_read = "", None
    try:
        model, flags = parse_cpuinfo(Path(cpuinfo).read_text(errors="replace"))
        flags_read = flags if flags else None
    except OSError:
        pass
    if not model:
        model = platform.processor() or arch
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 0
    return MachineInfo(
        cpu_model=model,
        arch=arch,
        logical_cpus=os.cpu_count() or 0,
        cpus_available=available,
        int8_flags=int8_flags(arch, flags_read or set()),
        os=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
        ort_version=onnxruntime.__version__,
        providers=tuple(providers),
        threads=threads,
        warning=int8_warning(arch, flags_read, providers),
    )


# ============================================================================ statistics


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


# ============================================================================ variants


@dataclass(frozen=True)
class _Built:
    name: str
    kind: str
    method: str
    quant_format: str
    per_channel: bool
    path: Path | None
    excluded: int = 0
    notes: tuple[str, ...] = ()
    error: str = ""


def parse_variants(text: str) -> tuple[str, ...]:
    """``fp32,dynamic,static`` -> a tuple of kinds (unknown or repeated kinds refused)."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise QDebugError(
            f"unknown variant(s) {unknown or [text]} in --variants",
            f"use a comma-separated list of {', '.join(KINDS)}",
            ExitCode.USAGE,
        )
    if len(set(kinds)) != len(kinds):
        raise QDebugError(f"--variants repeats a variant: {text}", "name each variant once", ExitCode.USAGE)
    return kinds


def parse_methods(text: str) -> tuple[str, ...]:
    """``minmax,entropy`` -> a tuple of calibration methods (unknown ones refused)."""
    from qdebug.calibrate import METHODS

    methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise QDebugError(
            f"unknown calibration method(s) {unknown or [text]} in --method",
            f"use a comma-separated list of {', '.join(METHODS)}",
            ExitCode.USAGE,
        )
    return methods


def _settings_of(options: BenchOptions, proposal: Any, notes: list[str]) -> BenchOptions:
    """``options`` with the calibration method and types filled in: the proposal's, else the defaults.

    Every static variant and the selective one share them, so the table
    compares exclusions, not settings; flags given explicitly win, and a
    selective model then built with other settings than the proposal's is noted.
    """
    recorded = proposal is not None
    methods = options.methods or ((proposal.method,) if recorded and proposal.method else ("minmax",))
    activation = options.activation_type or (proposal.activation_type if recorded else "") or "QUInt8"
    weight = options.weight_type or (proposal.weight_type if recorded else "") or "QInt8"
    if recorded and "selective" in options.variants:
        used = {"method": methods[0], "activation type": activation, "weight type": weight}
        made = {"method": proposal.method, "activation type": proposal.activation_type}
        made["weight type"] = proposal.weight_type
        differ = [f"{k} {used[k]} (proposal: {made[k]})" for k in used if made[k] and made[k] != used[k]]
        if differ:
            notes.append(
                f"the selective model is built with {', '.join(differ)}: its scales differ from the "
                "proposal's model"
            )
    # the report's per-channel setting is the base of every variant, as its types are (a per-channel
    # report's static variants had been built per-tensor, and the selective one credited with the gap)
    per_channel = options.per_channel or bool(recorded and proposal.base_per_channel)
    return replace(
        options, methods=methods, activation_type=activation, weight_type=weight, per_channel=per_channel
    )


def _build_variants(
    prep: Any, ranges: dict[str, Any], options: BenchOptions, proposal: Any, workdir: Path, progress: Progress
) -> list[_Built]:
    from qdebug.quantize import QuantSpec, quantize_dynamic_model, quantize_static_model

    several = len(options.methods) > 1
    built: list[_Built] = []
    plan: list[tuple[str, str]] = []  # (kind, method)
    for kind in options.variants:
        if kind in ("static", "qoperator"):
            plan.extend((kind, m) for m in options.methods)
        elif kind == "selective":
            plan.append((kind, options.methods[0]))
        else:
            plan.append((kind, ""))
    for i, (kind, method) in enumerate(plan):
        progress("build", i, len(plan))
        if kind == "fp32":
            built.append(_Built("fp32", kind, "", "", False, prep.normalized_path))
            continue
        name = f"{kind}-{method}" if several and kind in ("static", "qoperator") else kind
        path = workdir / f"{name}.onnx"
        try:
            if kind == "dynamic":
                quantize_dynamic_model(
                    prep.normalized_path,
                    path,
                    op_types=options.dynamic_ops or None,
                    per_channel=options.per_channel,
                )
                # the op types only when --dynamic-ops chose them ("ORT's default op types" told nothing)
                notes = (f"op types: {','.join(options.dynamic_ops)}",) if options.dynamic_ops else ()
                built.append(_Built(name, kind, "", "dynamic", options.per_channel, path, notes=notes))
            elif kind in ("static", "qoperator"):
                spec = QuantSpec(
                    per_channel=options.per_channel,
                    activation_type=options.activation_type,
                    weight_type=options.weight_type,
                )
                fmt = "QOperator" if kind == "qoperator" else "QDQ"
                quantize_static_model(prep.normalized, ranges[method], spec, path, quant_format=fmt)
                built.append(_Built(name, kind, method, fmt, options.per_channel, path))
            else:  # selective
                spec = QuantSpec(
                    per_channel=proposal.per_channel,
                    activation_type=options.activation_type,
                    weight_type=options.weight_type,
                    nodes_to_exclude=tuple(proposal.nodes_to_exclude),
                    tensor_overrides=tuple(proposal.tensor_overrides),
                )
                quantize_static_model(prep.normalized, ranges[method], spec, path)
                notes = []
                if proposal.per_channel != options.per_channel:
                    mode = ("per-channel", "per-tensor") if proposal.per_channel else ("per-tensor", "per-channel")
                    flag = "--per-channel" if proposal.per_channel else "no --per-channel"
                    notes.append(
                        f"{mode[0]} weights as in the proposal, where the static variants are {mode[1]}: it "
                        f"differs from static by more than its exclusions ({flag} compares like for like)"
                    )
                if proposal.tensor_overrides:
                    notes.append(
                        f"{len(proposal.tensor_overrides)} tensor override(s) (e.g. 16-bit activations)"
                    )
                built.append(
                    _Built(
                        name,
                        kind,
                        method,
                        "QDQ",
                        proposal.per_channel,
                        path,
                        excluded=len(proposal.nodes_to_exclude),
                        notes=tuple(notes),
                    )
                )
        except QDebugError as e:
            if kind == "selective" and "not in the model" in e.message:
                raise  # a proposal for another model is the user's error, not a variant failure
            if e.code == ExitCode.OUTPUT:
                raise  # a full disk fails every later write too: not one variant's failure
            built.append(_Built(name, kind, method, "", options.per_channel, None, error=e.one_line()))
    progress("build", len(plan), len(plan))
    return built


# ============================================================================ child processes


def write_batches(batches: Sequence[Any], input_names: Sequence[str], path: Path) -> None:
    """Write the evaluation batches once, for every variant's process to read back identically."""
    arrays = {
        f"b{i}_{j}": np.asarray(b.feeds[n], order="C")
        for i, b in enumerate(batches)
        for j, n in enumerate(input_names)
    }
    np.savez(path, **arrays)


def child_spec(
    model: Path, inputs: Path, input_names: Sequence[str], batches: int, options: BenchOptions, result: Path
) -> dict[str, Any]:
    """What :func:`qdebug.bench_child.measure` reads: the model, the batches and the loop settings."""
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
    import json

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
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return [sys.executable, "-m", "qdebug.bench_child", str(spec_path), *(["--serve"] if serve else [])], env


HANDOVER_PAUSE_S = 0.005
"""Pause between two variants' passes: ORT's intra-op threads spin for a moment after a run, and the
next variant must not share the cores with them."""


class _ChildLines:
    """A measuring process's replies, read by a thread so that waiting for one can time out.

    A child that hangs (a provider deadlock, a model that never returns) had blocked bench forever: each
    wait for ``ready``, ``done`` or the exit now gives up after ``timeout`` seconds.
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading

        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._reader.start()

    def _pump(self, stream: Any) -> None:
        try:
            for line in stream:
                self._lines.put(line.strip())
        except (OSError, ValueError):  # the pipe closed under us: the process is gone
            pass
        self._lines.put(None)

    def next(self, timeout: float) -> str | None:
        """The next reply; ``""`` at end of output; ``None`` when none came within ``timeout`` s."""
        import queue

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
    import json

    procs: dict[str, subprocess.Popen] = {}
    replies: dict[str, _ChildLines] = {}
    errors: dict[str, str] = {}
    logs: dict[str, Any] = {}
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


# ============================================================================ the benchmark


def run_bench(
    model: str | Path,
    calib: str | Path,
    *,
    eval_data: str | Path | None = None,
    proposal: str | Path | None = None,
    output: str | Path = "qdebug-bench.json",
    chart: str | Path | None = None,
    options: BenchOptions | None = None,
    progress: Progress = no_progress,
) -> BenchReport:
    """Build, evaluate and time every variant; write ``output`` (JSON) and ``chart`` (SVG); return the report.

    The variants' models go to ``<output stem>_files/``. A variant that fails to
    build or run is kept in the report with its ``error``; the others go on.
    A run that fails as a whole (or is interrupted) leaves no ``_files/`` behind.
    """
    from qdebug.files import artifacts_dir, removed_on_failure

    inputs = [model, calib, eval_data, proposal]
    with removed_on_failure(artifacts_dir(Path(output)), [output, chart], inputs):
        return _run_bench(model, calib, eval_data, proposal, output, chart, options, progress)


def _run_bench(
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    proposal: str | Path | None,
    output: str | Path,
    chart: str | Path | None,
    options: BenchOptions | None,
    progress: Progress,
) -> BenchReport:
    """The body of :func:`run_bench`."""
    import onnx

    unknown_ops = [op for op in (options.dynamic_ops if options else ()) if not onnx.defs.has(op)]
    if unknown_ops:
        raise QDebugError(
            f"--dynamic-ops names op type(s) that ONNX does not define: {unknown_ops}",
            "use ONNX op type names such as MatMul,Gemm,Conv",
            ExitCode.USAGE,
        )

    from qdebug.calibrate import calibrate
    from qdebug.capture import SessionConfig, check_providers
    from qdebug.data import data_notes, open_data
    from qdebug.evaluate import Evaluator, metric_scope_note
    from qdebug.files import artifacts_dir, atomic_write_text, check_outputs_spare_inputs, check_writable, sha256_file
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.report_io import dumps

    options = options or BenchOptions()
    if options.variants is None:
        default = ("fp32", "dynamic", "static") + (("selective",) if proposal is not None else ())
        options = replace(options, variants=default)
    if not options.variants:
        raise QDebugError(
            "no variants to benchmark", f"pass --variants with some of {', '.join(KINDS)}", ExitCode.USAGE
        )
    if options.runs < 1 or options.warmup < 0:
        raise QDebugError(
            f"--runs must be >= 1 and --warmup >= 0 (got {options.runs}, {options.warmup})",
            "pass sensible counts",
            ExitCode.USAGE,
        )
    check_providers(options.providers)
    out = Path(output)
    check_writable(out)
    if chart is not None:
        check_writable(chart, "--chart")
    check_outputs_spare_inputs(
        {"the bench result": out, "the chart": chart},
        {
            "the model": model,
            "the calibration data": calib,
            "the evaluation data": eval_data,
            "the proposal": proposal,
        },
    )
    prop = None
    if "selective" in options.variants:
        if proposal is None:
            raise QDebugError(
                "the selective variant needs a proposal",
                "pass --proposal proposal.json (from qdebug propose)",
                ExitCode.USAGE,
            )
        from qdebug.report_io import load_proposal

        prop = load_proposal(proposal)
        model_sha = sha256_file(Path(model)) if Path(model).is_file() else ""
        if prop.model_sha256 and model_sha and prop.model_sha256 != model_sha:
            raise QDebugError(
                f"proposal {proposal} was made for another model (SHA-256 {prop.model_sha256[:12]}...)",
                f"pass the model the proposal was made for ({prop.model_path})",
                ExitCode.INPUT,
            )
    notes: list[str] = []
    options = _settings_of(options, prop, notes)
    if prop is not None and options.max_samples is None and prop.calib_max_samples is not None:
        options = replace(options, max_samples=prop.calib_max_samples)  # the proposal's calibration
    workdir = artifacts_dir(out)
    needs_ranges = any(k in ("static", "selective", "qoperator") for k in options.variants)
    aopts = AnalyzeOptions(
        method=options.methods[0],
        per_channel=options.per_channel,
        activation_type=options.activation_type,
        weight_type=options.weight_type,
        batch_size=options.batch_size,
        max_samples=options.max_samples,
        metric=options.metric,
        upgrade_opset=options.upgrade_opset,
        inline_constant_if=options.inline_constant_if,
        use_cache=options.use_cache,
        providers=options.providers,
        threads=options.threads,
    )
    check = None
    if prop is not None:
        from qdebug.prepare import check_proposal

        def check(normalized: Any) -> None:  # before calibration: a wrong proposal costs no data pass
            check_proposal(prop, model_sha or prop.model_sha256, model, normalized)

    prep = prepare(model, calib, workdir, aopts, need_ranges=needs_ranges, progress=progress, check=check)
    notes.extend(prep.notes)
    if prop is not None and prep.ranges is not None and options.methods[0] == (prop.method or "minmax"):
        from qdebug.prepare import calibration_notes

        notes.extend(calibration_notes(prop, prep.ranges))
    if prop is not None:
        from qdebug.prepare import base_setting_notes

        notes.extend(base_setting_notes(prop, options.per_channel))
    ranges: dict[str, Any] = {}
    if needs_ranges:
        ranges[options.methods[0]] = prep.ranges
        normalized_sha = sha256_file(prep.normalized_path)
        for method in options.methods[1:]:
            ranges[method] = calibrate(
                prep.normalized_path,
                normalized_sha,
                prep.calib,
                method,
                use_cache=options.use_cache,
                providers=options.providers,
            )

    config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
    if eval_data is not None:
        eval_set = open_data(
            eval_data, prep.calib.specs, batch_size=options.batch_size, what="evaluation data"
        )
    else:
        eval_set = open_data(calib, prep.calib.specs, batch_size=options.batch_size)
        notes.append("no --eval data: the metric and the timings use the calibration data")
    notes.extend(data_notes(prep.calib, eval_set if eval_data is not None else None, prep.normalized))
    evaluator = Evaluator(prep.normalized, eval_set, config, options.metric)
    notes.extend(n for n in [metric_scope_note(evaluator)] if n)
    batch_sizes = [b.size for b in evaluator.batches]
    full_size = max(batch_sizes)
    if options.batch_size is not None and full_size < options.batch_size:
        notes.append(f"the evaluation set has fewer samples than --batch-size: batches of {full_size}")

    built = _build_variants(prep, ranges, options, prop, workdir, progress)

    scores: dict[str, tuple[float, float]] = {}
    layer_reports: dict[str, Any] = {}
    for i, b in enumerate(built):
        progress("evaluate", i, len(built))
        if b.error or b.path is None:
            continue
        if b.kind == "fp32":
            scores[b.name] = (evaluator.fp32_value, math.inf)
            continue
        try:
            result = evaluator.score(onnx.load(str(b.path)), what=f"{b.name} model")
        except QDebugError as e:
            built[i] = _replace_error(b, e.one_line())
            continue
        scores[b.name] = (result.value, result.output_sqnr_db)
        if b.kind == "dynamic" and options.dynamic_layers:
            from qdebug.records import TaskMetric

            task = TaskMetric(
                result.metric,
                result.fp32_value,
                result.value,
                result.samples,
                "eval" if eval_data is not None else "calib",
            )
            try:
                layer_reports[b.name] = dynamic_layer_report(
                    prep, b.path, workdir / f"{b.name}.report.json", config, task, result.outputs, progress
                )
            except QDebugError as e:
                notes.append(f"no per-layer report for {b.name}: {e.one_line()}")
    progress("evaluate", len(built), len(built))

    measured: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-") as tmp:
        tmpdir = Path(tmp)
        inputs_path = tmpdir / "inputs.npz"
        write_batches(evaluator.batches, evaluator.input_names, inputs_path)
        todo = [b for b in built if not b.error and b.path is not None]
        specs = {
            b.name: child_spec(
                b.path.resolve(),
                inputs_path,
                evaluator.input_names,
                len(evaluator.batches),
                options,
                tmpdir / f"{b.name}.result.json",
            )
            for b in todo
        }
        measured = run_children_interleaved(specs, tmpdir, options.runs, progress, options.timeout_s)

    variants = [_variant_result(b, scores.get(b.name), measured.get(b.name)) for b in built]
    variants = [_with_layers(v, layer_reports.get(v.name), workdir) for v in variants]
    fp32 = next((v for v in variants if v.kind == "fp32" and v.full is not None), None)
    if fp32 is not None:
        variants = [_with_speedup(v, fp32.full.p50_ms) for v in variants]  # type: ignore[union-attr]
    machine = machine_info(options.providers, options.threads)
    report = BenchReport(
        schema_version=BENCH_SCHEMA_VERSION,
        kind="bench",
        qdebug_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=prep.model.path,
        model_sha256=prep.model.sha256,
        normalized_model=str(prep.normalized_path.resolve()),
        calib=record_path(calib),
        eval=record_path(eval_data if eval_data is not None else calib),
        metric=evaluator.metric_name,
        samples=evaluator.samples,
        batch_size=full_size,
        runs=options.runs,
        warmup=options.warmup,
        machine=machine,
        variants=tuple(variants),
        proposal=record_path(proposal) if proposal is not None else None,
        notes=tuple(notes),
    )
    atomic_write_text(out, dumps(report))
    if chart is not None:
        atomic_write_text(chart, chart_svg(report))
    return report


def _replace_error(b: _Built, error: str) -> _Built:
    return replace(b, error=error)


def _with_layers(v: VariantResult, report: Any, workdir: Path) -> VariantResult:
    if report is None:
        return v
    path = (workdir / f"{v.name}.report.json").resolve()
    return replace(v, layer_report=str(path), worst_layers=worst_layers(report))


def _with_speedup(v: VariantResult, fp32_p50: float) -> VariantResult:
    if v.full is None or not v.full.p50_ms > 0:
        return v
    return replace(v, speedup=fp32_p50 / v.full.p50_ms)


def _variant_result(b: _Built, score: tuple[float, float] | None, m: dict[str, Any] | None) -> VariantResult:
    from qdebug.graph.load import stored_size

    size = stored_size(b.path) if b.path is not None and b.path.is_file() else 0
    common = dict(
        name=b.name,
        kind=b.kind,
        method=b.method,
        quant_format=b.quant_format,
        per_channel=b.per_channel,
        model_path=str(b.path.resolve()) if b.path is not None else "",
        model_bytes=size,
        excluded_nodes=b.excluded,
    )
    error = b.error or (m.get("error", "") if m is not None and not m.get("ok") else "")
    if error or m is None or score is None:
        return VariantResult(**common, notes=b.notes, error=error or "not measured")  # type: ignore[arg-type]
    tail_sizes = m["tail_sizes"]
    tail_size = tail_sizes[0] if len(tail_sizes) == 1 else 0
    notes = list(b.notes) + list(m["notes"])
    if len(tail_sizes) > 1:
        notes.append(f"smaller batches of {len(tail_sizes)} sizes {tail_sizes} timed together as the tail")
    mb = 1024.0 * 1024.0
    return VariantResult(
        **common,  # type: ignore[arg-type]
        full=latency_stats(m["full_ns"], m["full_size"]),
        tail=_tail_stats(m["tail_ns"], tail_size, tail_sizes),
        tail_sizes=tuple(tail_sizes),
        peak_rss_mb=m["peak_rss"] / mb,
        rss_before_session_mb=m["rss_before_session"] / mb,
        session_rss_mb=(m["peak_rss"] - m["rss_before_session"]) / mb,
        alloc_bytes_per_batch=float(m["alloc_peak_max"]),
        alloc_bytes_mean=float(m["alloc_peak_mean"]),
        alloc_net_bytes_per_batch=float(m["alloc_net"]),
        binding=m["mode"],
        providers_used=tuple(m["providers"]),
        metric_value=score[0],
        output_sqnr_db=score[1],
        notes=tuple(notes),
    )


def _tail_stats(ns: list[int], size: int, sizes: list[int]) -> LatencyStats | None:
    if not ns:
        return None
    if size:
        return latency_stats(ns, size)
    # several smaller sizes (one per data file): throughput over their mean size
    return latency_stats(ns, int(round(sum(sizes) / len(sizes))))


def load_bench(path: str | Path) -> BenchReport:
    """Load and validate a ``bench.json`` file."""
    from qdebug.report_io import load_record

    report = load_record(BenchReport, path, "bench result", BENCH_SCHEMA_VERSION)
    if report.kind != "bench":
        raise QDebugError(
            f"{path} is not a qdebug bench result (kind {report.kind!r})", "pass a bench.json", ExitCode.INPUT
        )
    return report


# ============================================================================ dynamic per-layer error


def pair_dynamic(fp32: Any, dyn: Any) -> tuple[Any, set[str]]:
    """Pair FP32 tensors with a dynamic-quantized model's tensors by graph position.

    ``quantize_dynamic`` leaves most nodes as they are and replaces a quantized
    Conv/MatMul ``N`` by ``DynamicQuantizeLinear`` on its activation input, an
    integer op (``ConvInteger``/``MatMulInteger``) on the int8 weight, then a
    ``Cast`` and a rescaling ``Mul`` (and an ``Add`` for a bias; a Gemm becomes
    such a MatMul plus Add). Nodes are
    matched in topological order: an unchanged node by op type and the
    counterparts of its activation inputs; a quantized one by the integer op
    whose ``DynamicQuantizeLinear`` reads the counterpart of ``N``'s input,
    followed through the Cast/Mul/bias-Add chain to the float tensor standing
    for ``N``'s output. Names are not used.

    Returns ``(pairing, quantized)``: a :class:`~qdebug.graph.match.Pairing`
    without dequant/quant parameters (activations have no fixed Q/DQ pair: they
    are quantized per batch at run time, so only the accumulated error is
    measured), and the names of the FP32 nodes replaced by integer ops.
    """
    from qdebug.graph.match import GraphIndex, Pairing, TensorPair, WeightPair

    fi, di = GraphIndex(fp32), GraphIndex(dyn)
    tensor_map: dict[str, str] = {}
    for idx, name in enumerate(fi.inputs):
        if idx < len(di.inputs):
            tensor_map[name] = di.inputs[idx]
    fp_inits = set(fi.inits)
    used: set[int] = set()
    node_map: list[tuple[str, str]] = []
    unmatched: list[str] = []
    quantized: list[str] = []
    weights: list[Any] = []
    notes: dict[str, str] = {}
    dyn_nodes = list(dyn.graph.node)

    def float_source(t: str) -> str:
        p = di.producer.get(t)
        return p.input[0] if p is not None and p.op_type == DYNAMIC_Q else t

    for node in fp32.graph.node:
        positions = [i for i, n in enumerate(node.input) if n and n not in fp_inits]
        expected = tuple(tensor_map.get(node.input[i]) for i in positions)
        if None in expected:
            unmatched.append(node.name)
            _note_outputs(node, notes, "an input has no counterpart in the dynamic model")
            continue
        cand = None
        for c in dyn_nodes:
            if id(c) in used or c.op_type != node.op_type:
                continue
            if tuple(c.input[i] if i < len(c.input) else None for i in positions) == expected:
                cand = c
                break
        if cand is not None:
            used.add(id(cand))
            node_map.append((node.name, cand.name))
            for j, out in enumerate(node.output):
                if out and j < len(cand.output) and cand.output[j]:
                    dequantized = _dequantized(cand.output[j], di)
                    tensor_map[out] = dequantized or cand.output[j]
                    if dequantized and node.name not in quantized:  # e.g. a Gather of an int8 table
                        quantized.append(node.name)
            continue
        for c in dyn_nodes:
            if id(c) in used or c.op_type not in INTEGER_OPS.get(node.op_type, ()):
                continue
            if len(positions) == 1 and float_source(c.input[0]) == expected[0]:
                cand = c
                break
        if cand is None:
            unmatched.append(node.name)
            _note_outputs(
                node, notes, f"node {node.name} ({node.op_type}) has no counterpart in the dynamic model"
            )
            continue
        used.add(id(cand))
        node_map.append((node.name, cand.name))
        quantized.append(node.name)
        has_bias = node.op_type in ("Conv", "Gemm") and len(node.input) > 2 and bool(node.input[2])
        out, scale_mul = _follow_rescale(cand, di, set(tensor_map.values()), has_bias)
        if node.output and node.output[0]:
            tensor_map[node.output[0]] = out
        w = _weight_pair(node, cand, scale_mul, fi, di, WeightPair)
        if w is not None:
            weights.append(w)

    pairs = []
    order = list(fi.inputs) + [o for n in fp32.graph.node for o in n.output if o and o not in fi.inits]
    for name in dict.fromkeys(order):
        q = tensor_map.get(name)
        pairs.append(TensorPair(name, q, None, None, notes.get(name, "" if q else "no counterpart")))
    outputs = tuple((f, di.outputs[i]) for i, f in enumerate(fi.outputs) if i < len(di.outputs))
    pairing = Pairing(tuple(pairs), tuple(weights), tuple(node_map), tuple(unmatched), outputs)
    return pairing, set(quantized)


def _dequantized(tensor: str, di: Any) -> str | None:
    """The float tensor standing for ``tensor`` when its only reader is a DequantizeLinear, else None.

    ``quantize_dynamic`` keeps a Gather (an embedding lookup) as it is but makes its table int8 and puts a
    DequantizeLinear after it: the Gather's own output is integer, and pairing the FP32 output with it had
    given -42 dB and blamed the embedding for all the error.
    """
    readers = di.consumers.get(tensor, [])
    if len(readers) == 1 and readers[0].op_type == "DequantizeLinear" and readers[0].input[0] == tensor:
        return readers[0].output[0]
    return None


def _note_outputs(node: Any, notes: dict[str, str], text: str) -> None:
    for out in node.output:
        if out:
            notes[out] = text


def _follow_rescale(integer_op: Any, di: Any, activations: set[str], has_bias: bool) -> tuple[str, Any]:
    """From an integer op's output, through Cast / rescaling Mul / bias Add, to the float tensor."""
    t = integer_op.output[0]
    scale_mul = None
    for _ in range(4):
        cons = di.consumers.get(t, [])
        if len(cons) != 1:
            break
        c = cons[0]
        others = [i for i in c.input if i and i != t]
        if c.op_type == "Cast":
            t = c.output[0]
        elif (
            c.op_type == "Mul" and scale_mul is None and others and all(o not in activations for o in others)
        ):
            scale_mul = c
            t = c.output[0]
        elif c.op_type == "Add" and has_bias and others and all(o in di.inits for o in others):
            has_bias = False
            t = c.output[0]
        else:
            break
    return t, scale_mul


def _weight_pair(node: Any, integer_op: Any, scale_mul: Any, fi: Any, di: Any, weight_pair: type) -> Any:
    """The FP32 weight and its int8 initializer, scale and zero point (None when not found)."""
    if node.op_type not in INTEGER_OPS or len(node.input) < 2 or node.input[1] not in fi.inits:
        return None
    if integer_op.op_type not in ("ConvInteger", "MatMulInteger") or len(integer_op.input) < 2:
        return None
    wq = integer_op.input[1]
    zp = integer_op.input[3] if len(integer_op.input) > 3 and integer_op.input[3] in di.inits else None
    scale = None
    if scale_mul is not None:
        for i in scale_mul.input:
            if i in di.inits:
                scale = i
            prod = di.producer.get(i)
            if prod is not None and prod.op_type == "Mul":
                scale = next((x for x in prod.input if x in di.inits), scale)
    if wq not in di.inits or scale is None:
        return None
    axis = 0 if node.op_type == "Conv" else 1
    return weight_pair(node.input[1], node.name, wq, scale, zp, axis)


def dynamic_layer_report(
    prep: Any,
    dyn_path: Path,
    out_path: Path,
    config: Any,
    task: Any,
    outputs: tuple[Any, ...],
    progress: Progress = no_progress,
) -> Any:
    """Per-layer accumulated error of the dynamic model vs FP32, as an analysis :class:`Report`.

    Streams the calibration data (like ``analyze``) through the instrumented
    FP32 and dynamic models; writes the report to ``out_path`` (``qdebug tui``
    opens it) and returns it.
    """
    import onnx
    import onnxruntime

    from qdebug.analysis import measure_layers, node_records, weight_records
    from qdebug.prepare import model_info
    from qdebug.records import SCHEMA_VERSION, AnalysisConfig, Report
    from qdebug.report_io import save_report

    dyn = onnx.load(str(dyn_path))
    pairing, quantized = pair_dynamic(prep.normalized, dyn)
    ranges = prep.ranges.minmax() if prep.ranges is not None else {}
    # a dynamic model has no Q/DQ pairs: there is no fake-quant view to run
    layers = measure_layers(
        prep.normalized, dyn, pairing, prep.calib, config, ranges, progress, fakequant_samples=0
    )
    nodes = node_records(prep.normalized, layers.tensors, quantized, prep.name_map)
    notes = list(prep.notes) + [
        "dynamic quantization: activations are quantized per batch at run time, so there is no fixed "
        "Q/DQ pair per tensor: only the accumulated error (FP32 vs dynamic model) is measured, "
        "paired by graph position",
    ]
    if pairing.unmatched:
        notes.append(f"{len(pairing.unmatched)} FP32 node(s) have no counterpart in the dynamic model")
    report = Report(
        schema_version=SCHEMA_VERSION,
        qdebug_version=__version__,
        ort_version=onnxruntime.__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=prep.model,
        normalized_model=str(prep.normalized_path.resolve()),
        quantized_model=model_info(dyn_path, dyn),
        config=AnalysisConfig(method="dynamic", calib=record_path(prep.calib.source)),
        calibration_cache=None,
        samples=layers.samples,
        nodes=nodes,
        tensors=layers.tensors,
        weights=weight_records(prep.normalized, dyn, pairing),
        outputs=outputs,
        task=task,
        deployed_gap=layers.deployed_gap,
        not_captured=layers.not_captured,
        notes=tuple(notes),
        name_map=tuple(sorted(prep.name_map.items())),
    )
    save_report(report, out_path)
    return report


def worst_layers(report: Any, top: int = 5) -> tuple[WorstLayer, ...]:
    """The ``top`` quantized nodes of a report by the noise they add, as the analysis summary ranks them.

    Only nodes the variant quantized: a LayerNormalization after a quantized MatMul amplifies the error it
    receives and "adds" noise by that measure, but nothing about it can be changed in that variant (a
    walk-through saw bench name one that dynamic quantization never touches).
    """
    from qdebug.records import rank_nodes

    ranked = [n for n in rank_nodes(report.nodes) if n.quantized]
    return tuple(
        WorstLayer(n.name, n.op_type, n.introduced_db, n.accumulated_sqnr_db, n.added_noise_db)
        for n in ranked[:top]
    )


# ============================================================================ chart

_COLORS = {
    "fp32": "#4c72b0",
    "dynamic": "#dd8452",
    "static": "#55a868",
    "selective": "#c44e52",
    "qoperator": "#8172b3",
}


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values from at or below ``lo`` to at or above ``hi`` (steps of 1, 2, 2.5 or 5 x 10^k)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _fmt_tick(x: float) -> str:
    return f"{x:.6g}"


def _metric_scale(name: str) -> tuple[float, str]:
    if name in ACCURACY_METRICS:
        return 100.0, f"{name} (%)"
    if name == "output_sqnr_db":
        return 1.0, "output SQNR vs FP32 (dB)"
    return 1.0, name


def chart_svg(report: BenchReport, width: int = 760, height: int = 460) -> str:
    """Accuracy (task metric) vs p50 latency per batch, one dot per variant, as a standalone SVG.

    A whisker runs from p50 to p95. A non-finite metric (FP32's output SQNR is
    ``+inf``) is drawn on the top edge and labelled with the symbol.
    """
    scale, ylabel = _metric_scale(report.metric)
    pts = [v for v in report.variants if v.full is not None]
    left, right, top, bottom = 70, 250, 58, 62
    pw, ph = width - left - right, height - top - bottom
    p50_hi = max((v.full.p50_ms for v in pts if v.full), default=1.0)
    p95_hi = max((v.full.p95_ms for v in pts if v.full), default=1.0)
    # whiskers beyond 3x the slowest p50 (noise spikes) are clipped at the edge, marked with an arrow
    xticks = nice_ticks(0.0, min(p95_hi, 3.0 * p50_hi) * 1.02)
    x_max = xticks[-1] if xticks else 1.0
    finite = [v.metric_value * scale for v in pts if math.isfinite(v.metric_value)]
    y_lo, y_hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = (y_hi - y_lo) * 0.1 or max(abs(y_hi) * 0.05, 1.0)
    yticks = nice_ticks(y_lo - pad, y_hi + pad)
    if scale == 100.0 and yticks:  # accuracies: stay within 0..100 %
        yticks = [t for t in yticks if 0.0 <= t <= 100.0] or yticks
    y_min, y_max = (yticks[0], yticks[-1]) if yticks else (y_lo - pad, y_hi + pad)

    def px(x: float) -> float:
        return left + pw * min(1.0, max(0.0, x / x_max if x_max > 0 else 0.0))

    def py(y: float) -> float:
        if not math.isfinite(y):
            return float(top) if y > 0 or math.isnan(y) else float(top + ph)
        return top + ph * (1.0 - (y - y_min) / (y_max - y_min if y_max > y_min else 1.0))

    e = html.escape
    machine = report.machine
    provider = machine.providers[0] if machine.providers else ""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="15" font-weight="bold">'
        f"{e(ylabel)} vs latency per batch of {report.batch_size}</text>",
        f'<text x="{left}" y="40" fill="#555">{e(machine.cpu_model)} · {e(provider)} · threads '
        f"{machine.threads or 'auto'} · ORT {e(machine.ort_version)} · {report.samples} samples</text>",
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>',
    ]
    for t in xticks:
        x = px(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt_tick(t)}</text>')
    for t in yticks:
        y = py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt_tick(t)}</text>')
    out.append(
        f'<text x="{left + pw / 2:.0f}" y="{top + ph + 36}" text-anchor="middle">'
        "ms per batch (dot: p50, whisker to p95, ▸ beyond the axis) — left is faster</text>"
    )
    out.append(
        f'<text x="18" y="{top + ph / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 18 {top + ph / 2:.0f})">{e(ylabel)} — up is better</text>'
    )
    placed: list[tuple[float, float, float, float]] = []
    for i, v in enumerate(pts):
        full = v.full
        assert full is not None
        color = _COLORS.get(v.kind, "#333")
        y = py(v.metric_value * scale)
        x50, x95 = px(full.p50_ms), px(full.p95_ms)
        out.append(
            f'<line x1="{x50:.1f}" y1="{y:.1f}" x2="{x95:.1f}" y2="{y:.1f}" stroke="{color}" '
            'stroke-width="2" stroke-opacity="0.6"/>'
        )
        if full.p95_ms > x_max:
            out.append(f'<text x="{x95 - 8:.1f}" y="{y + 4:.1f}" fill="{color}">▸</text>')
        out.append(
            f'<circle cx="{x50:.1f}" cy="{y:.1f}" r="5" fill="{color}">'
            f"<title>{e(_point_title(v, scale))}</title></circle>"
        )
        lx, ly = _place_label(str(i + 1), x50, y, placed, (left, top, left + pw, top + ph))
        out.append(f'<text x="{lx:.1f}" y="{ly:.1f}" fill="{color}" font-weight="bold">{i + 1}</text>')
        ly = top + 12 + 34 * i
        value = v.metric_value * scale
        metric = "∞" if math.isinf(value) else f"{value:.4g}{'%' if scale == 100.0 else ''}"
        speed = f", ×{v.speedup:.2f} vs FP32" if math.isfinite(v.speedup) else ""
        lx0 = left + pw + 14
        out.append(f'<text x="{lx0}" y="{ly}" fill="{color}" font-weight="bold">{i + 1} {e(v.name)}</text>')
        out.append(
            f'<text x="{lx0 + 12}" y="{ly + 15}" fill="#444" font-size="11">'
            f"{full.p50_ms:.3g} ms{speed} · {metric}</text>"
        )
    if machine.warning:
        out.append(
            f'<text x="{left}" y="{height - 6}" fill="#b00" font-size="11">warning: INT8 speed-ups unlikely '
            f"on this CPU (INT8 flags: {e(', '.join(machine.int8_flags) or 'none')}; no VNNI/AMX)</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _place_label(
    text: str, x: float, y: float, placed: list[tuple[float, float, float, float]], box: tuple[float, ...]
) -> tuple[float, float]:
    """Put a short label next to a dot where it overlaps no earlier label (greedy, 8 candidate spots)."""
    w, h = 7.5 * len(text) + 2, 13.0
    candidates = [
        (8, -6),
        (8, 14),
        (-8 - w, -6),
        (-8 - w, 14),
        (-w / 2, -10),
        (-w / 2, 22),
        (8, -20),
        (8, 28),
    ]
    best = None
    for dx, dy in candidates:
        lx, ly = x + dx, y + dy
        rect = (lx, ly - h + 3, lx + w, ly + 3)
        inside = rect[0] >= box[0] and rect[1] >= box[1] - 14 and rect[2] <= box[2] and rect[3] <= box[3]
        clear = all(rect[2] <= r[0] or rect[0] >= r[2] or rect[3] <= r[1] or rect[1] >= r[3] for r in placed)
        if clear and inside:
            best = (lx, ly, rect)
            break
        if best is None and clear:
            best = (lx, ly, rect)
    if best is None:
        dx, dy = candidates[len(placed) % len(candidates)]
        best = (x + dx, y + dy, (x + dx, y + dy - h + 3, x + dx + w, y + dy + 3))
    placed.append(best[2])
    return best[0], best[1]


def _point_title(v: VariantResult, scale: float) -> str:
    assert v.full is not None
    return (
        f"{v.name}: p50 {v.full.p50_ms:.3f} ms, p95 {v.full.p95_ms:.3f} ms, "
        f"metric {v.metric_value * scale:.4g}, {v.model_bytes / 1e6:.2f} MB"
    )
