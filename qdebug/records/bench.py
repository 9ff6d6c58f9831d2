"""The ``bench.json`` schema: what ``qdebug bench`` measured, per variant and for the machine.

Plain frozen dataclasses, standard library only, like the rest of :mod:`qdebug.records`: the TUI reads
a bench file through :func:`qdebug.output.report_io.load_bench` without loading onnx or onnxruntime. The
command that writes them is :mod:`qdebug.bench`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

BENCH_SCHEMA_VERSION = 1
"""Version of the ``bench.json`` layout; :func:`qdebug.output.report_io.load_bench` refuses others."""

KINDS = ("fp32", "dynamic", "static", "selective", "qoperator")
"""Variant kinds ``--variants`` accepts."""


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
    """Size of the model on disk (the .onnx file and its external-data files)."""
    weight_bytes: int | None = None
    """Bytes of its weights (initializers and Constant values), from their shapes; ``None`` in files
    written before it."""
    float_weight_bytes: int | None = None
    """How many of ``weight_bytes`` are float (Q/DQ scales left out): the part of ``model_bytes``
    quantization did not shrink (a static CNN+LSTM reader keeps its LSTM float); ``None`` in older files."""
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
