"""The proposal file's records: what ``propose`` (or the TUI) hands to ``verify`` and ``bench``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qdebug.records.report import QuantSettings


@dataclass(frozen=True)
class TensorOverride:
    """A per-tensor quantization override (ORT ``TensorQuantOverrides``): 16-bit activations, a clipped
    range, per-channel or reduced-range weights for one node -- the per-node fixes propose tries before
    keeping a node FP32."""

    tensor: str
    quant_type: str = ""
    """``QUInt16``/``QInt16``/``QUInt8``/``QInt8`` (names of ``onnxruntime.quantization.QuantType``);
    ``""``: the base quantization's type."""
    rmin: float | None = None
    """With ``rmax``: the range this activation is quantized over instead of its calibrated one (a range
    clipped to where nearly all values lie, so a few outliers stop costing every other value its levels)."""
    rmax: float | None = None
    axis: int | None = None
    """Per-channel quantization of this weight along ``axis`` (one node's weights, not the whole model's)."""
    reduce_range: bool | None = None
    """7-bit weights: u8s8 integer kernels on x86 CPUs without VNNI cannot saturate their 16-bit sums."""

    def describe(self) -> str:
        """What the override changes, in a few words (``16-bit``, ``range [-3, 5]``, ``per-channel``)."""
        parts = []
        if self.quant_type:
            parts.append({"QUInt16": "16-bit", "QInt16": "16-bit"}.get(self.quant_type, self.quant_type))
        if self.rmin is not None and self.rmax is not None:
            parts.append(f"range [{self.rmin:.4g}, {self.rmax:.4g}]")
        if self.axis is not None:
            parts.append(f"per-channel (axis {self.axis})")
        if self.reduce_range:
            parts.append("7-bit (reduce_range)")
        return ", ".join(parts) or "no change"

    def options(self) -> dict[str, object]:
        """The ``TensorQuantOverrides`` entry of this override as JSON values (only the keys it sets): the
        vocabulary of ORT's own per-tensor options, so a proposal reads as "your config plus these"."""
        out: dict[str, object] = {}
        if self.quant_type:
            out["quant_type"] = self.quant_type
        if self.rmin is not None and self.rmax is not None:
            out["rmin"] = self.rmin
            out["rmax"] = self.rmax
        if self.axis is not None:
            out["axis"] = self.axis
        if self.reduce_range:
            out["reduce_range"] = True
        return out


def merge_tensor_overrides(
    user: Mapping[str, Sequence[Mapping[str, object]]] | None, overrides: Sequence[TensorOverride]
) -> dict[str, list[dict[str, object]]]:
    """The user's ``TensorQuantOverrides`` (JSON values) with a proposal's ``overrides`` merged in: for a
    tensor both name, the proposal's keys win in the first (per-tensor, or first channel's) entry and the
    user's other keys stay; every other tensor keeps the user's entries as given."""
    merged = {name: [dict(e) for e in entries] for name, entries in (user or {}).items()}
    for o in overrides:
        mine = o.options()
        entries = merged.get(o.tensor)
        merged[o.tensor] = [{**entries[0], **mine}, *entries[1:]] if entries else [mine]
    return merged


@dataclass(frozen=True)
class NodeReason:
    """Why one node is in a proposal, with the numbers behind it."""

    node: str
    original_name: str
    op_type: str
    action: str
    """``fp32`` (kept out of quantization), ``int16`` (16-bit activations), ``per-channel`` (the whole
    model's weights when ``node`` is empty, else that node's), ``clip`` (a clipped activation range),
    ``reduce-range`` (7-bit weights) or ``calib-flipped`` (ranges widened by the flipped evaluation samples;
    the whole model's when ``node`` is empty): the per-node fixes keep the node INT8."""
    reason: str
    introduced_db: float = float("nan")
    local_sqnr_db: float = float("nan")
    region: int = -1
    """Index of the connected sensitive region the node belongs to (-1: none)."""


@dataclass(frozen=True)
class FrontierPoint:
    """One configuration propose measured on the evaluation set and timed with verify's harness: a point
    of the accuracy-vs-latency trade-off it reports next to its answer."""

    label: str
    """``fp32``, ``static`` (full INT8), ``proposal``, ``smaller`` (the best that changes less than the
    proposal), ``larger`` (the best that changes more), ``dynamic`` (``quantize_dynamic``)."""
    changed: str
    """What differs from full static INT8, in words (``3 nodes FP32 + 1 clipped``)."""
    nodes_fp32: int
    metric: float
    output_sqnr_db: float
    met: bool
    p50_ms: float
    p95_ms: float
    rounds_ms: tuple[float, ...] = ()
    """Its interleaved rounds' median latencies, paired with FP32's (:func:`~qdebug.records.verify.speed_ratio`)."""


@dataclass(frozen=True)
class RecipeRecord:
    """The whole-model recipe a proposal is built on (:mod:`qdebug.vocabulary` names it): the
    transformed FP32 model that ORT's quantizer quantizes instead of the user's, and what changed in it."""

    name: str
    """The registry's key of the recipe chosen (``fold-bn``, ``equalize``, ``smooth``, ``bias-correction``)."""
    steps: tuple[str, ...] = ()
    """The transforms applied, in order (``equalize`` folds BatchNormalization first)."""
    params: tuple[tuple[str, float], ...] = ()
    """Their parameters (SmoothQuant's ``alpha``)."""
    fp32_model: str | None = None
    """The transformed FP32 model the selective model is quantized from (``None``: not written)."""
    fp32_sha256: str = ""
    changed: tuple[str, ...] = ()
    """Nodes whose weights or biases the recipe rewrote."""
    removed: tuple[str, ...] = ()
    """Nodes it removed (BatchNormalization folded into its Conv)."""
    screened_metric: float = float("nan")
    """The recipe's full static INT8 model's metric on the screening samples."""
    notes: tuple[str, ...] = ()
    """What the transforms did and skipped, one line each."""

    def spec_changes(self) -> dict[str, object]:
        """What it changes in the base quantization settings (:func:`qdebug.vocabulary.spec_changes`)."""
        from qdebug.vocabulary import spec_changes

        return spec_changes(self.steps or (self.name,), self.params)

    @property
    def reduce_range(self) -> bool:
        """Whether it quantizes weights to 7 bits (dynamic and mixed, where the CPU's u8s8 kernels saturate)."""
        return bool(dict(self.params).get("reduce_range"))

    @property
    def quantizer(self) -> str:
        """How ORT builds the model (``static``, ``dynamic`` or ``mixed``: :data:`qdebug.vocabulary.QUANTIZERS`)."""
        from qdebug.vocabulary import quantizer_of

        return quantizer_of(self.steps or (self.name,))


@dataclass(frozen=True)
class Proposal:
    """A mixed-precision proposal: the input of ``verify``/``bench`` and the TUI's export format."""

    schema_version: int
    kind: str
    """Always ``"proposal"`` (so a report is not mistaken for a proposal)."""
    model_path: str
    model_sha256: str
    """SHA-256 of the user's FP32 model the proposal was made for."""
    normalized_model: str
    """Normalized model the node names refer to (identical names to the user's model where it had names)."""
    nodes_to_exclude: tuple[str, ...]
    tensor_overrides: tuple[TensorOverride, ...] = ()
    per_channel: bool = False
    reasons: tuple[NodeReason, ...] = ()
    metric: str = ""
    fp32_metric: float = float("nan")
    static_metric: float = float("nan")
    expected_metric: float = float("nan")
    """Metric of the selective model measured during the search (``nan`` if not evaluated)."""
    evaluations: int = 0
    search_seconds: float = 0.0
    source: str = "propose"
    """``propose`` or ``tui`` (hand-made in the TUI)."""
    quantized_model: str | None = None
    """Path of the selectively quantized model written by ``propose``."""
    snippet: str = ""
    """Ready-to-paste Python calling ``onnxruntime.quantization.quantize_static`` with this proposal."""
    quantizable_nodes: int = 0
    qdq_pairs_delta: int | None = None
    """Q/DQ pairs the proposal removes (negative) or adds (positive) vs full static quantization (``None``
    when not measured: the TUI exports a list without quantizing it)."""
    method: str = ""
    """Calibration method the proposal was made with (``""``: not recorded; verify then uses its flags)."""
    activation_type: str = ""
    """Activation quantization type of the base quantization (``""``: not recorded)."""
    weight_type: str = ""
    """Weight quantization type of the base quantization (``""``: not recorded)."""
    base_per_channel: bool | None = None
    """Per-channel weights in the base quantization -- the report's setting, what verify's and bench's
    static variants use; ``per_channel`` is the selective model's, which propose may have turned on
    (``None``: not recorded; the flags decide). A per-channel report's static baseline had been rebuilt
    per-tensor, crediting an empty proposal with 98.7 % recovery."""
    calibration_key: str = ""
    """Key of the calibration ranges the proposal was made with (a hash of the normalized model, the
    calibration data's content and sample count, the method and ORT's version; ``""``: not recorded).
    verify and bench say so when theirs differs: the selective model's scales then differ too."""
    calib_max_samples: int | None = None
    """``--max-samples`` of that calibration (None: every sample); verify and bench use it by default."""
    eval_samples: int = 0
    """Evaluation samples the metrics above were measured on (fewer than the data holds with
    ``--eval-max-samples``; 0: not recorded)."""
    frontier: tuple[FrontierPoint, ...] = ()
    """The verified frontier (empty: not timed, ``--time-runs 0``): FP32, static, the proposal and a few
    neighbours, each scored and timed alike on one evaluation batch."""
    drop_interval: tuple[float, float] = (float("nan"), float("nan"))
    """95 % paired-bootstrap interval of ``fp32_metric - expected_metric`` over the evaluation samples
    (points for the accuracy metrics; ``Evaluator.drop_interval``): how far the search's own evaluation
    set can tell the drop from noise. ``nan`` bounds: not measured (older files, the TUI's exports)."""
    quant_settings: QuantSettings | None = None
    """The base quantization the proposal changes -- the report's settings, the user's config included
    (``method``, ``activation_type``, ``weight_type`` and ``base_per_channel`` repeat its fields for older
    readers): the selective model is these settings plus ``nodes_to_exclude``, ``tensor_overrides`` and
    ``per_channel``. ``None`` in proposals written before it was recorded (and the TUI's): :attr:`quant`
    rebuilds it from those fields."""
    stage_seconds: tuple[tuple[str, float], ...] = ()
    """propose's wall seconds per stage (prepare, calibrate, recipes, search, re-rank, frontier), in order."""
    recipe: RecipeRecord | None = None
    """The whole-model recipe the selective model is built on (``None``: the user's FP32 model, plain static
    INT8 plus the per-node changes): its transformed FP32 model is what verify and bench quantize."""

    @property
    def quant(self) -> QuantSettings:
        """The base quantization settings (older proposals: from the fields, defaults where unrecorded)."""
        if self.quant_settings is not None:
            return self.quant_settings
        return QuantSettings(
            method=self.method or "minmax",
            per_channel=bool(self.base_per_channel),
            activation_type=self.activation_type or "QUInt8",
            weight_type=self.weight_type or "QInt8",
        )
