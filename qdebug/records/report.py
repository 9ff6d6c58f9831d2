"""Frozen records passed between pipeline stages and stored in the report.

Every stage is a function over these types; no ``dict[str, dict]`` crosses a
module boundary. The :class:`Report` is the product: the TUI, ``propose`` and
``verify`` all start from it, so every field here is part of the versioned
schema documented in ``docs/report-schema.md``.

Float fields may hold ``inf``/``-inf``/``nan``: an exact match has SQNR
``+inf`` dB (not an epsilon-clamped number), and the JSON encoding writes
these as the strings ``"inf"``, ``"-inf"`` and ``"nan"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SCHEMA_VERSION = 3
"""Bumped on any incompatible change of the report layout (proposal and verify files share it).

Readers migrate the versions :mod:`qdebug.report_io` knows (2: ``TensorRecord.folded_into`` derived from
the tensor's note, as version 2's readers did) and refuse any other with the reason."""


METHODS = ("minmax", "entropy", "percentile", "distribution")
"""Calibration methods (``--method``; a proposal's ``method``)."""

QUANT_TYPES = ("QUInt8", "QInt8", "QUInt16", "QInt16")
"""Quantization types qdebug builds models with (names of ``onnxruntime.quantization.QuantType``)."""


@dataclass(frozen=True)
class ErrorStats:
    """Error of a candidate tensor against a reference, accumulated over all samples.

    SQNR is ``10*log10(sum(ref**2) / sum((ref-cand)**2))`` over every element of
    every sample: ``+inf`` when the noise is exactly zero, ``-inf`` when the
    signal is zero but the noise is not, ``nan`` when both are zero (undefined;
    such a tensor is never ranked as a worst layer).
    """

    sqnr_db: float
    mse: float
    cosine: float
    """Cosine similarity of the flattened tensors over all samples; ``nan`` if either is all-zero."""
    max_abs: float
    kl: float
    """KL(P_ref || P_cand) in nats over shared bins aligned to the quantization grid (see schema doc)."""
    count: int
    """Number of finite element pairs that entered the sums."""
    nonfinite: int = 0
    """Element pairs skipped because the reference or candidate was NaN/Inf (reported, never propagated)."""


@dataclass(frozen=True)
class TensorSummary:
    """FP32 distribution statistics of a tensor over all samples."""

    min: float
    max: float
    mean: float
    std: float
    count: int


@dataclass(frozen=True)
class Histogram:
    """FP32 and quantized value histograms over shared bin edges (for KL and the TUI)."""

    edges: tuple[float, ...]
    """``len(edges) == len(ref_counts) + 1``; the outer bins catch values beyond the range."""
    ref_counts: tuple[int, ...]
    cand_counts: tuple[int, ...]


@dataclass(frozen=True)
class QuantParams:
    """Quantization parameters of one Q/DQ pair (per-tensor, or the first channel's when per-axis)."""

    scale: float
    zero_point: int
    qtype: str
    """ONNX element type name of the quantized tensor: ``uint8``, ``int8``, ``uint16``, ``int16``..."""
    axis: int | None = None
    """Channel axis when per-axis; ``None`` when per-tensor."""
    channels: int = 1


@dataclass(frozen=True)
class TensorRecord:
    """One float tensor of the FP32 model and what quantization did to it."""

    name: str
    producer: str | None
    """Normalized name of the producing node; ``None`` for graph inputs and initializers."""
    consumers: tuple[str, ...]
    depth: int
    """Topological depth of the producer (graph inputs are 0)."""
    summary: TensorSummary | None
    quant: QuantParams | None
    """``None`` when the QDQ model does not quantize this tensor."""
    local: ErrorStats | None
    """Pre-Q vs post-DQ inside the QDQ model: the error this tensor's own Q/DQ adds."""
    accumulated: ErrorStats | None
    """FP32 tensor vs its counterpart in the QDQ model: all error up to this point."""
    histogram: Histogram | None
    quantized_name: str | None = None
    """Name of the paired tensor in the quantized model (the DQ output when quantized)."""
    accumulated_fakequant: ErrorStats | None = None
    """FP32 vs the same DQ output computed un-optimized (float fake-quant arithmetic).

    Differs from ``accumulated`` when the deployed integer kernels compute
    something else than the QDQ graph's float semantics -- e.g. u8s8 int8
    MatMul/Conv saturating 16-bit intermediates on x86 CPUs without VNNI.
    """
    note: str = ""
    """Why a field is missing (e.g. removed activation, not captured inside a subgraph): for people, never parsed."""
    folded_into: str | None = None
    """The Relu/Clip node (normalized name) that consumed this tensor and that ORT folded into the quantization
    range of its own output (asymmetric activations): this tensor then has no Q/DQ and no counterpart of its
    own, and the activation's output shows the error of this tensor's producer. ``None`` otherwise.
    Written by the pairing (:func:`qdebug.graph.match.pair_models`); read through :func:`folded_into`."""


@dataclass(frozen=True)
class NodeRecord:
    """One node of the normalized FP32 model."""

    name: str
    original_name: str
    """The name in the user's model (``""`` for nodes that had none)."""
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    depth: int
    quantized: bool
    """True when the QDQ model quantizes at least one of the node's inputs or outputs."""
    local_sqnr_db: float
    """Worst local SQNR among the node's float outputs (``nan`` when none is quantized)."""
    accumulated_sqnr_db: float
    """Worst accumulated SQNR among the node's float outputs."""
    introduced_db: float
    """Accumulated SQNR at the node's worst float input minus at its worst output: the error it adds.

    Positive means the node makes things worse; this is what ranks nodes, so that
    nodes merely downstream of a bad one are not blamed.
    """
    kl: float
    """Largest accumulated KL (FP32 vs quantized distribution) over the node's float outputs."""
    domain: str = ""
    added_noise_db: float = float("nan")
    """Noise the node adds, relative to the signal: ``10*log10(NSR_out - NSR_in)`` (``NSR = 10**(-SQNR/10)``).

    ``-inf`` when it adds none. Unlike ``introduced_db`` (a ratio), this is additive
    across nodes, so a drop from 56 to 36 dB near the input (-36 dB added) ranks
    far below a drop from 26 to 5 dB (-5 dB added): the summary ranks by it.
    """
    excludable: bool | None = None
    """Whether listing the node in ``nodes_to_exclude`` changes the quantized model: ORT quantizes its op
    type and did quantize it (a Div whose output is quantized for its consumer is ``quantized`` but not
    excludable). What propose, verify and the TUI count as "quantizable"; ``None`` in older reports."""


def rank_nodes(nodes: Iterable[NodeRecord]) -> list[NodeRecord]:
    """Nodes worst first: by the noise they add (linear, additive), then by introduced dB; nodes adding
    none (``-inf``) or unscored (``nan``) are left out. The one ranking of the summary, the CSV's order and
    bench's worst layers (bench had ranked by introduced dB, which put a node behind an exact input first)."""
    scored = [n for n in nodes if not math.isnan(n.added_noise_db) and n.added_noise_db > -math.inf]
    return sorted(scored, key=lambda n: (-n.added_noise_db, -n.introduced_db))


@dataclass(frozen=True)
class WeightRecord:
    """A quantized initializer: FP32 weight vs the dequantized integer weight."""

    name: str
    node: str
    error: ErrorStats
    quant: QuantParams
    channel_sqnr_db: tuple[float, ...] = ()
    """Per-channel SQNR when quantized per channel."""


@dataclass(frozen=True)
class OutputMetric:
    """Model-level error of one graph output, on the evaluation (or calibration) data."""

    name: str
    error: ErrorStats


@dataclass(frozen=True)
class TaskMetric:
    """The task metric (higher is better) of the FP32 and the quantized model."""

    name: str
    """``top1`` (vs labels), ``top1_agreement`` / ``exact_match`` (vs FP32), ``output_sqnr_db``
    or ``module:function``."""
    fp32: float
    quantized: float
    samples: int
    data: str
    """Which data set it was measured on: ``eval`` or ``calib``."""
    quantized_fakequant: float = float("nan")
    """The quantized model's metric with ORT's optimizations off (float QDQ semantics, no integer kernels).

    Far above ``quantized`` means the deployed integer kernels, not the quantization
    parameters, lose the accuracy (see ``TensorRecord.accumulated_fakequant``).
    """
    fakequant_samples: int = 0
    """Samples ``quantized_fakequant`` was measured on (the first ``--fakequant-samples`` of the data)."""
    quantized_same_samples: float = float("nan")
    """The deployed quantized model's metric over those same samples: compare it, not ``quantized``,
    with ``quantized_fakequant``."""


@dataclass(frozen=True)
class ModelInfo:
    """Where a model came from and how to recognise it again."""

    path: str
    sha256: str
    opset: int
    nodes: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class AnalysisConfig:
    """The options the analysis ran with; propose/verify reuse them."""

    method: str = "minmax"
    per_channel: bool = False
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    batch_size: int | None = None
    max_samples: int | None = None
    calib: str | None = None
    eval: str | None = None
    metric: str | None = None
    fakequant_samples: int | None = None
    """Samples the fake-quant view (``accumulated_fakequant``, ``task.quantized_fakequant``) ran on."""
    quantized_given: bool = False
    """True when the user supplied the QDQ model (``--quantized``) instead of qdebug building it."""
    upgrade_opset: bool = False
    """The model was converted to a newer opset (``--upgrade-opset``); propose/verify do the same."""
    inline_constant_if: bool = False
    """If nodes with a constant condition were inlined (``--inline-constant-if``); propose/verify repeat it."""
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (input, axis; None: fed whole) the analysis was run with; propose repeats
    them (the other inputs' axes are read off the model, the same way each time)."""


@dataclass(frozen=True)
class NotCaptured:
    """A float tensor of the FP32 model that has no error numbers, and why."""

    name: str
    reason: str


@dataclass(frozen=True)
class Report:
    """The analysis report: the product of ``qdebug analyze``.

    ``nodes`` are ordered topologically; ``tensors`` likewise by producer.
    """

    schema_version: int
    qdebug_version: str
    ort_version: str
    created: str
    model: ModelInfo
    normalized_model: str
    """Path of the normalized FP32 model (the base for every later quantization)."""
    quantized_model: ModelInfo
    config: AnalysisConfig
    calibration_cache: str | None
    samples: int
    """Samples that went through the layer-wise capture."""
    nodes: tuple[NodeRecord, ...]
    tensors: tuple[TensorRecord, ...]
    weights: tuple[WeightRecord, ...]
    outputs: tuple[OutputMetric, ...]
    task: TaskMetric | None
    deployed_gap: float
    """Max |difference| between instrumented and un-instrumented quantized outputs (0.0 = bit-identical)."""
    not_captured: tuple[NotCaptured, ...] = ()
    notes: tuple[str, ...] = ()
    """What qdebug did that the user should know (normalization steps, fallbacks)."""
    name_map: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """(normalized node name, original node name) for nodes whose name was changed."""
    ranges: tuple[tuple[str, float, float], ...] = ()
    """Calibration ranges (tensor, lowest, highest) the quantized model was built from (empty with --quantized)."""

    def node(self, name: str) -> NodeRecord:
        """Look up a node by normalized name (KeyError if absent)."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def tensor(self, name: str) -> TensorRecord:
        """Look up a tensor by name (KeyError if absent)."""
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


KERNEL_GAP_DB = 3.0
"""Deployed-vs-fake-quant gap (dB) above which a tensor's integer kernel is blamed (analysis notes, TUI)."""


def folded_into(nodes: Sequence[NodeRecord], tensors: Sequence[TensorRecord]) -> dict[str, str]:
    """Activation node -> the producer ORT folded it into (from :attr:`TensorRecord.folded_into` of its input).

    The activation then shows that producer's Q/DQ error and is not quantized itself; the notes, the
    kernel-gap attribution and the summary's labels all read this one map, in node order. The activation
    must read the tensor and a node of ``nodes`` produce it.
    """
    source = {t.folded_into: t.name for t in tensors if t.folded_into is not None}
    producer = {o: n.name for n in nodes for o in n.outputs if o}
    out = {}
    for node in nodes:  # in node order, as the notes list them
        src = source.get(node.name)
        if src is not None and src in node.inputs and src in producer:
            out[node.name] = producer[src]
    return out


SQNR_CAP_DB = 120.0
"""SQNRs above this count as exact when computing the error a node introduces."""


def from_exact_input(node: NodeRecord) -> bool:
    """Whether ``node.introduced_db`` is the cap rather than a measurement: every float input of the node
    counted as exact (SQNR >= :data:`SQNR_CAP_DB`, or no input carrying error), so the value is 120 dB
    minus the output's SQNR.

    Such a number is large for any node whose own quantization loses anything (a MatMul reading an exact
    one-hot tensor "introduced 85.5 dB" at a harmless 34.5 dB output) and reads as the worst layer; the
    summary shows these as from an exact input. Read off the record itself (``introduced_db`` is then
    exactly ``120 - accumulated_sqnr_db``), so reports written before this check are read the same way.
    """
    out = node.accumulated_sqnr_db
    if not (math.isfinite(out) and out < SQNR_CAP_DB and math.isfinite(node.introduced_db)):
        return False
    return math.isclose(node.introduced_db, SQNR_CAP_DB - out, rel_tol=0.0, abs_tol=1e-9)
