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
from dataclasses import dataclass, field, replace

from qdebug.records.profile import ProfileReport
from qdebug.records.samples import SampleSection

SCHEMA_VERSION = 3
"""Bumped on any incompatible change of the report layout (proposal and verify files share it).

Readers migrate the versions :mod:`qdebug.output.report_io` knows (2: ``TensorRecord.folded_into`` derived from
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
class ExtraOption:
    """One ``extra_options`` entry of ORT's quantizer, its value as JSON holds it: quantization types by
    name (``"QUInt16"``), arrays as numbers or lists, sets as sorted lists (qdebug converts them back to
    ORT's objects when it quantizes, and the snippet spells them as ORT wants them)."""

    key: str
    value: object = None


@dataclass(frozen=True)
class SpecializedInput:
    """A graph input the model was specialized on: it held one value in every calibration and evaluation
    sample, and an ``If`` whose condition reads it was replaced by the branch that value takes
    (``--inline-constant-if``). The quantized model is valid for that value only, so propose, verify and
    bench inline the same branch and refuse data holding another value."""

    name: str
    value: str
    """The value as JSON text (``16000``, ``[1, 2]``): exact for integers and floats alike."""
    dtype: str
    """Its numpy dtype (``int64``), with which ``value`` is compared to the data."""
    ifs: tuple[str, ...] = ()
    """The If nodes whose taken branch it decided (normalized names)."""


@dataclass(frozen=True)
class QuantSettings:
    """Everything of a ``quantize_static`` call that decides the static model, besides the data.

    The one record of the quantization settings: ``analyze`` records it in the report
    (:attr:`AnalysisConfig.quant`), ``propose`` in the proposal (:attr:`Proposal.quant`), and every
    variant propose, verify and bench build is these settings plus that variant's own changes
    (exclusions, per-tensor overrides, per-channel weights). A user's ``--config`` or ``--preset`` fills
    it (:mod:`qdebug.quant.config`); the defaults are qdebug's (``cpu-u8s8``).
    """

    method: str = "minmax"
    """Calibration method (``calibrate_method``), qdebug's name: minmax, entropy, percentile, distribution."""
    per_channel: bool = False
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    upgrade_opset: bool = False
    """Normalization converts a model below opset 10 first (``--upgrade-opset``; not an ORT option)."""
    inline_constant_if: bool = False
    """Normalization inlines the taken branch of constant-condition If nodes (not an ORT option)."""
    specialized_inputs: tuple[SpecializedInput, ...] = ()
    """The inputs whose one value in the data decided an If's branch, inlined (``inline_constant_if``):
    later runs inline the same branches and refuse data that holds another value. Empty in settings
    recorded before it (and whenever no such If was inlined)."""
    reduce_range: bool = False
    """7-bit weights (``reduce_range``): u8s8 kernels on x86 CPUs without VNNI cannot saturate."""
    op_types: tuple[str, ...] = ()
    """``op_types_to_quantize`` (empty: every op type ORT can quantize, ``quantize_static``'s default); also
    the op types calibration collects ranges for, as ``quantize_static`` calibrates."""
    nodes_to_quantize: tuple[str, ...] = ()
    """Only these nodes are quantized when not empty (normalized names)."""
    nodes_to_exclude: tuple[str, ...] = ()
    """The user's own exclusions: every variant excludes them, and a proposal's exclusions are added."""
    extra_options: tuple[ExtraOption, ...] = ()
    """ORT ``extra_options`` (sorted by key), e.g. ``ActivationSymmetric``, ``CalibPercentile``, the user's
    ``TensorQuantOverrides`` (a proposal's per-tensor overrides are merged in, the proposal's keys winning)."""
    source: str = ""
    """Where the settings came from: ``""`` (qdebug's defaults and flags), ``preset tensorrt``, a config
    file's path, or ``read off <model>``; ``+ flags`` when flags changed them."""

    def extra(self, key: str, default: object = None) -> object:
        """The value of one ``extra_options`` key (``default`` when absent)."""
        return next((o.value for o in self.extra_options if o.key == key), default)

    def extra_dict(self) -> dict[str, object]:
        """``extra_options`` as a plain dict (JSON values)."""
        return {o.key: o.value for o in self.extra_options}

    def with_extra(self, key: str, value: object) -> QuantSettings:
        """These settings with one ``extra_options`` key set (kept sorted)."""
        items = {**self.extra_dict(), key: value}
        return replace(self, extra_options=tuple(ExtraOption(k, items[k]) for k in sorted(items)))

    def without_source(self) -> QuantSettings:
        """The same settings with ``source`` blank: what two settings are compared by."""
        return replace(self, source="")


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
    quant_settings: QuantSettings | None = None
    """Every quantization setting (:class:`QuantSettings`), the user's config included; ``method`` ...
    ``inline_constant_if`` above repeat its fields for older readers. ``None`` in reports written before it
    was recorded: :attr:`quant` rebuilds it from those fields."""

    @property
    def quant(self) -> QuantSettings:
        """The quantization settings the report's model was made with (older reports: from the fields)."""
        if self.quant_settings is not None:
            return self.quant_settings
        return QuantSettings(
            method=self.method,
            per_channel=self.per_channel,
            activation_type=self.activation_type,
            weight_type=self.weight_type,
            upgrade_opset=self.upgrade_opset,
            inline_constant_if=self.inline_constant_if,
        )


def config_fields(settings: QuantSettings) -> dict[str, object]:
    """The :class:`AnalysisConfig` keyword arguments that record ``settings`` (the flat fields and the record)."""
    return {
        "method": settings.method,
        "per_channel": settings.per_channel,
        "activation_type": settings.activation_type,
        "weight_type": settings.weight_type,
        "upgrade_opset": settings.upgrade_opset,
        "inline_constant_if": settings.inline_constant_if,
        "quant_settings": settings,
    }


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
    per_sample: SampleSection | None = None
    """The per-sample drill-down (:mod:`qdebug.records.samples`): each sample's FP32 and static result, the
    samples that flip, and for the worst of them their divergence along the graph; ``None`` in reports
    written before it, and when the metric gives nothing per sample."""
    kernel_gap_nodes: tuple[str, ...] | None = None
    """The nodes where the deployed integer kernels' gap opens, largest gap first: what analyze's kernel-gap
    note names, by its rule over the samples the fake-quant view saw (:func:`qdebug.analysis.notes.kernel_gap_starts`);
    ``()`` where it opens nowhere or there was no fake-quant view. propose's whole-model 7-bit fix reads it, so
    the fix and the note count the same nodes. ``None`` in reports written before it."""
    profile: ProfileReport | None = None
    """Where the time of a run goes, node by node, in the FP32 and the quantized model (``analyze --profile``:
    ORT's profiler, :mod:`qdebug.runtime.profile`); ``None`` when not asked for."""

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
