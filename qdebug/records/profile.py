"""The ``profile.json`` schema: per-node latency of an FP32 model and its static INT8 model, read from ONNX
Runtime's own profiler (``qdebug profile``).

Plain frozen dataclasses like the rest of :mod:`qdebug.records` (standard library only), so a saved profile
can be shown without onnx or onnxruntime. The times are ORT's kernel durations, booked to the user's nodes
through the optimized graph (:mod:`qdebug.runtime.profile` does the run and the mapping); the wall times are
whole ``session.run`` calls measured alongside, so the two can be checked against each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROFILE_SCHEMA_VERSION = 1
"""Version of the ``profile.json`` layout."""

ORT_INSERTED = "ORT-inserted"
"""What a kernel that computes none of the user's nodes is listed as (layout changes ORT adds, e.g. the
NCHWc ``ReorderInput``/``ReorderOutput`` or the NHWC ``Transpose`` around an integer Conv)."""

CAUSES: dict[str, str] = {
    "unfolded-batchnorm": "a BatchNormalization wrapped in Q/DQ runs in float between integer kernels: fold "
    "it into the Conv before quantizing (onnxruntime.quantization.shape_inference.quant_pre_process does)",
    "no-integer-kernel": "ORT has no integer kernel for this op: it runs DQ -> float op -> Q between "
    "quantized neighbours; exclude it (nodes_to_exclude) with its neighbours, or replace the op",
    "qdq-overhead": "its integer kernel is faster, but the Q/DQ kernels around it (a graph output's "
    "DequantizeLinear not counted) cost more than that saves, and at least 2 % of the INT8 model's kernel "
    "time: leave it in float (nodes_to_exclude) or quantize a larger region so the Q/DQ pairs cancel",
}
"""Why a node loses time in the INT8 model: the name in :attr:`NodeLatency.cause`, and its explanation."""

SORT_KEYS = ("saved", "lost", "fp32", "int8")
"""What ``--sort`` orders the node table by."""


@dataclass(frozen=True)
class KernelRecord:
    """One kernel of ORT's optimized graph, averaged over the timed runs."""

    name: str
    """ORT's node name in the optimized graph (the profiler's event name without ``_kernel_time``)."""
    op_type: str
    """The kernel's op, e.g. ``QLinearConv``, ``FusedConv``, ``ReorderOutput``."""
    provider: str
    ms_per_run: float
    integer: bool
    """Whether the kernel reads an 8/16-bit integer tensor (an integer kernel) rather than float only."""
    nodes: tuple[str, ...]
    """The user's nodes this kernel computes (fused ones included); empty: :data:`ORT_INSERTED`."""
    booked_to: str
    """The node its time counts for: the one whose op it runs (``Conv`` for a ``FusedConv`` of
    Conv+BatchNormalization+Relu); the others were fused into it. Empty when ORT inserted the kernel."""
    inside: str = ""
    """For a kernel of an If branch or a Loop/Scan body (:attr:`ModelProfile.subgraph_kernels`): the
    If/Loop/Scan kernel that ran it, whose node it is booked to. Empty for a kernel of the main graph."""


@dataclass(frozen=True)
class ModelProfile:
    """One model's session: where the time of a run goes."""

    path: str
    sha256: str
    runs: int
    """Timed ``session.run`` calls (the warm-up run is profiled, but left out of every number)."""
    wall_p50_ms: float
    """Median wall time of a whole ``session.run`` (``time.perf_counter``), profiler on."""
    wall_mean_ms: float
    model_run_ms: float
    """ORT's own ``model_run`` duration per run (mean): the kernels and the executor's work between them."""
    kernel_ms: float
    """The sum of the main graph's kernel durations per run (mean). They run one after the other within a
    run (sequential executor), so this is at most :attr:`model_run_ms`, itself at most :attr:`wall_mean_ms`.
    The kernels of If/Loop/Scan bodies are not in it: their parent's duration holds them."""
    inserted_ms: float
    """Of :attr:`kernel_ms`, the kernels ORT inserted (layout changes), per run."""
    run_wall_ms: tuple[float, ...]
    """Each timed run's wall time, in order: with :attr:`run_kernel_ms` it shows whether a slow run was
    slow in its kernels or between them (load, a preemption)."""
    run_kernel_ms: tuple[float, ...]
    """Each timed run's sum of kernel durations, in the same order."""
    kernels: tuple[KernelRecord, ...]
    """The main graph's kernels: every total and node row is made of these."""
    subgraph_kernels: tuple[KernelRecord, ...] = ()
    """Kernels an If/Loop/Scan kernel ran in its branches or body, per run, each booked to that node as
    detail: their time is inside the parent kernel's already, so they count in no total and no row."""


@dataclass(frozen=True)
class NodeLatency:
    """One user node: its time per run in FP32 and INT8, and why the INT8 one may be slower."""

    name: str
    op_type: str
    fp32_ms: float
    """Time per run of the FP32 kernel booked to this node (0 when fused into another's, or absent)."""
    int8_ms: float
    """Time per run of the INT8 model's kernel booked to this node, Q/DQ kernels around it not included."""
    qdq_ms: float
    """Q/DQ kernels that survived ORT's fusion around this node (its input DequantizeLinear, its output
    QuantizeLinear, float weights dequantized on every run), per run."""
    fp32_kernel: str
    """The FP32 kernel's op, ``fused into NODE``, or ``-`` when the node is not in the FP32 model."""
    int8_kernel: str
    """The INT8 kernel's op, ``fused into NODE``, ``removed`` (the quantizer dropped it, e.g. a Relu
    absorbed by the Q range), or ``-`` when no INT8 model was profiled."""
    integer: bool
    """Whether the INT8 kernel is an integer one (False for a float op between Q/DQ)."""
    cause: str = ""
    """A key of :data:`CAUSES`, or empty."""
    output_dq_ms: float = 0.0
    """Of :attr:`qdq_ms`, the DequantizeLinear that writes a graph output from this node's quantized
    result: the INT8 model pays it wherever its quantized region ends, so it is never ``qdq-overhead``."""

    @property
    def saved_ms(self) -> float:
        """FP32 time minus INT8 time with its Q/DQ: positive when INT8 is faster here."""
        return self.fp32_ms - self.int8_ms - self.qdq_ms

    @property
    def explanation(self) -> str:
        """The cause in one line (empty when none)."""
        return CAUSES.get(self.cause, "")


@dataclass(frozen=True)
class ProfileReport:
    """The ``profile.json`` file."""

    schema_version: int
    kind: str
    """Always ``"profile"``."""
    qdebug_version: str
    ort_version: str
    created: str
    data: str
    batches: int
    """Distinct batches the timed runs cycle through."""
    provider: str
    threads: int
    """Intra-op threads asked for (0: ORT's choice)."""
    fp32: ModelProfile
    int8: ModelProfile | None
    nodes: tuple[NodeLatency, ...]
    """Every user node (the FP32 model's, then any only the INT8 model has), Q/DQ nodes left out: their
    time is in :attr:`NodeLatency.qdq_ms`."""
    verdict: str
    notes: tuple[str, ...] = ()


def sorted_nodes(nodes: tuple[NodeLatency, ...], key: str) -> list[NodeLatency]:
    """The nodes ordered for the table: ``saved`` most saved first, ``lost`` most lost first, ``fp32`` and
    ``int8`` slowest first (ties keep the model's order)."""
    if key not in SORT_KEYS:
        raise ValueError(f"unknown sort key {key!r}")
    by = {
        "saved": lambda n: -n.saved_ms,
        "lost": lambda n: n.saved_ms,
        "fp32": lambda n: -n.fp32_ms,
        "int8": lambda n: -(n.int8_ms + n.qdq_ms),
    }[key]
    return sorted(nodes, key=by)


def verdict_line(fp32_p50_ms: float, int8_p50_ms: float, nodes: tuple[NodeLatency, ...]) -> str:
    """``static INT8 is X ms slower/faster than FP32 per run; top causes: ...``: the measured p50 wall
    difference, then the three nodes that lose the most time (with their cause when one is known)."""
    diff = int8_p50_ms - fp32_p50_ms
    if not math.isfinite(diff):
        head = "static INT8 could not be compared with FP32"
    else:
        word = "slower" if diff > 0 else "faster"
        head = (
            f"static INT8 is {abs(diff):.3f} ms {word} than FP32 per run "
            f"(p50 {int8_p50_ms:.3f} vs {fp32_p50_ms:.3f} ms)"
        )
    losers = [n for n in sorted_nodes(nodes, "lost") if n.saved_ms < 0][:3]
    if not losers:
        return f"{head}; no node is slower in INT8"
    parts = [f"{n.name} ({n.cause or n.op_type}, {-n.saved_ms:.3f} ms)" for n in losers]
    return f"{head}; top causes: {', '.join(parts)}"
