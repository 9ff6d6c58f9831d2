"""Every note an analysis report can carry about its own measurement, in one place.

A note is one sentence for the user: what the numbers cannot show by
themselves and what to do about it. ``qdebug analyze`` writes them in this
order (:func:`qdebug.pipeline._analyze`); the notes about the model file and
the data come from :mod:`qdebug.prepare` and :mod:`qdebug.data`, the
evaluation metric's scope from :func:`qdebug.evaluation.evaluate.metric_scope_note`.

* how the QDQ model was built: :func:`quantizer_notes` (in :mod:`qdebug.analysis.model_notes`);
* how the capture ran: :func:`capture_notes` (model_notes), :func:`instrumentation_notes`;
* where the deployed integer kernels lose more than fake-quant: :func:`kernel_gap_notes`;
* ranges one scale cannot serve: :func:`concat_range_notes`, :func:`collapsed_range_notes`;
* what ORT folded or left in float: :func:`folded_activation_notes`, :func:`structure_notes` (model_notes);
* evaluation values outside the calibrated range: :func:`eval_range_notes`.

This module holds the notes that diagnose measured loss and :func:`headline_notes`;
:mod:`qdebug.analysis.model_notes` holds those that describe how the model was built, re-exported here.

A note that advises keeping a node out of quantization fires only on measured loss: a tensor whose own
Q/DQ loses nothing -- a constant (a detector's stride, range [8, 8]), an exactly representable tensor (a
one-hot of 0/1: local SQNR inf), a tensor ORT does not quantize -- is never named, and a consumer's error
counts only where its own quantization cannot explain it. Those notes had told users to exclude nodes
that lose nothing (three on one detector).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qdebug.analysis.build import SQNR_CAP_DB
from qdebug.analysis.measure import LayerErrors
from qdebug.analysis.model_notes import (  # re-exported: the notes on how the model was built
    FLOAT_SIZE_SHARE,
    FLOAT_WEIGHT_SHARE,
    FLOAT_WEIGHTS_START,
    RECURRENT_OPS,
    RECURRENT_START,
    capture_notes,
    float_size_note,
    float_weight_notes,
    folded_activation_notes,
    quantizer_notes,
    structure_notes,
)
from qdebug.evaluation.evaluate import Evaluator
from qdebug.graph.ops import PERMUTATION_OPS
from qdebug.output.formatting import fmt_db
from qdebug.records import (
    KERNEL_GAP_DB,
    ErrorStats,
    NodeRecord,
    QuantParams,
    TensorRecord,
    WeightRecord,
    folded_into,
)

__all__ = [
    "COLLAPSED_SHARE",
    "COLLAPSE_HARMLESS_DB",
    "COLLAPSE_INTRODUCED_DB",
    "COLLAPSE_MARGIN_DB",
    "CONCAT_RANGE_RATIO",
    "EVAL_OVERSHOOT_SHARE",
    "EVAL_OVERSHOOT_STEPS",
    "FLOAT_SIZE_SHARE",
    "FLOAT_WEIGHTS_START",
    "FLOAT_WEIGHT_SHARE",
    "GapStart",
    "KERNEL_GAP_FIX",
    "KERNEL_GAP_START",
    "NEGLIGIBLE_SQNR_DB",
    "RECURRENT_OPS",
    "RECURRENT_START",
    "capture_notes",
    "collapsed_range_notes",
    "concat_range_notes",
    "eval_range_notes",
    "float_size_note",
    "float_weight_notes",
    "folded_activation_notes",
    "headline_notes",
    "instrumentation_notes",
    "kernel_gap_nodes",
    "kernel_gap_notes",
    "kernel_gap_starts",
    "quantizer_notes",
    "structure_notes",
]

NEGLIGIBLE_SQNR_DB = 60.0
"""A deployed SQNR above this loses nothing a task notices (8-bit tensors sit at 30-50 dB): the kernel-gap
and instrumentation notes do not fire there, however wide the gap to a near-exact fake-quant value."""


def _capped_gap(better: float, deployed: float) -> float:
    """``better - deployed`` with ``better`` capped at :data:`SQNR_CAP_DB` (exact counts as the cap, as in
    ``introduced_db``), and 0 where the deployed side loses nothing measurable (at or above
    :data:`NEGLIGIBLE_SQNR_DB`): 130 against 100 dB is no kernel problem, inf against 25 dB is one (it had
    been skipped as an infinite gap). ``nan`` when either side is undefined or deployed is ``-inf``."""
    if math.isnan(better) or math.isnan(deployed) or deployed == -math.inf:
        return math.nan
    if deployed >= NEGLIGIBLE_SQNR_DB:
        return 0.0
    return min(better, SQNR_CAP_DB) - deployed


KERNEL_GAP_START = "deployed INT8 kernels lose more than the QDQ graph's own rounding explains"


def headline_notes(notes: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(headline, rest)``: the notes on what the deployed model does not quantize or loses in ORT's kernels
    -- the float LSTM and its share of the weights, the kernel gap and its fix -- apart from the others, so a
    summary can put them next to the metric they explain instead of after the table."""
    starts = (KERNEL_GAP_START, RECURRENT_START, FLOAT_WEIGHTS_START)
    first = [n for n in notes if n.startswith(starts)]
    return first, [n for n in notes if not n.startswith(starts)]


@dataclass(frozen=True)
class GapStart:
    """A tensor where the deployed integer kernels start to lose much more than fake-quant."""

    opened: float
    """The part of the gap its producer adds (dB): the whole gap minus the largest its inputs carry."""
    gap: float
    tensor: TensorRecord
    deployed: ErrorStats
    node: str | None
    """The node whose kernel made the tensor: its producer, or the producer an activation was folded into."""
    via: str
    """How to say it: `` (from conv1)``, `` (from conv1, relu1 folded into it)``, or empty."""


def kernel_gap_starts(
    tensors: Sequence[TensorRecord],
    same_samples: dict[str, ErrorStats] | None = None,
    skip: Collection[str] = (),
    nodes: Sequence[NodeRecord] = (),
) -> tuple[list[GapStart], int]:
    """Where the deployed kernels' gap opens, the largest first, and how many tensors show a gap at all.

    ``same_samples`` holds the deployed error over the samples the fake-quant view saw
    (:attr:`LayerErrors.deployed_head`), so both sides of the gap cover the same data; without it the
    full-run ``accumulated`` is used. ``skip``: tensors not to count (e.g. a Reshape of a tensor already
    counted). With ``nodes``, a gap its producer's inputs already carry is inherited, not started there (a
    LeakyRelu and a Split three nodes below the Conv whose u8s8 kernel lost the precision had been named);
    without them, or when no tensor opens one, every gap counts as a start.
    """
    gaps: dict[str, tuple[float, TensorRecord, ErrorStats]] = {}
    measured: dict[str, float] = {}
    for t in tensors:
        deployed = (same_samples or {}).get(t.name, t.accumulated)
        if deployed is None or t.accumulated_fakequant is None:
            continue
        gap = _capped_gap(t.accumulated_fakequant.sqnr_db, deployed.sqnr_db)
        if not math.isfinite(gap):
            continue
        measured[t.name] = gap
        if gap > KERNEL_GAP_DB and t.name not in skip:
            gaps[t.name] = (gap, t, deployed)
    if not gaps:
        return [], 0
    inputs_of = {n.name: n.inputs for n in nodes}
    producer_of = {o: n.name for n in nodes for o in n.outputs}

    seen: dict[tuple[str, int], float] = {}

    def upstream(name: str, hops: int = 6) -> float:
        """The gap a tensor carries; through tensors without both views (an activation ORT folded into its
        producer), the largest of the nearest ones above it (memoized: wide fan-in would be exponential)."""
        if name in measured:
            return measured[name]
        if hops == 0 or name not in producer_of:
            return 0.0
        key = (name, hops)
        if key not in seen:
            seen[key] = max((upstream(i, hops - 1) for i in inputs_of[producer_of[name]]), default=0.0)
        return seen[key]

    def opened(gap: float, t: TensorRecord) -> float:
        before = [upstream(i) for i in inputs_of.get(t.producer or "", ())]
        return gap - max(before, default=0.0)

    folded = folded_into(nodes, tensors)

    def start(o: float, g: float, t: TensorRecord, d: ErrorStats) -> GapStart:
        src = folded.get(t.producer or "")
        if src is not None:  # a Relu ORT folded into its producer's output Q: the producer's kernel
            return GapStart(o, g, t, d, src, f" (from {src}, {t.producer} folded into it)")
        return GapStart(o, g, t, d, t.producer, f" (from {t.producer})" if t.producer else "")

    starts = [start(opened(g, t), g, t, d) for g, t, d in gaps.values() if opened(g, t) > KERNEL_GAP_DB]
    if not starts:
        starts = [start(g, g, t, d) for g, t, d in gaps.values()]
    return sorted(starts, key=lambda s: -s.opened), len(gaps)


def kernel_gap_nodes(
    tensors: Sequence[TensorRecord],
    same_samples: dict[str, ErrorStats] | None = None,
    skip: Collection[str] = (),
    nodes: Sequence[NodeRecord] = (),
) -> tuple[str, ...]:
    """The nodes :func:`kernel_gap_starts` says the gap opens at (its first producer each), largest gap first:
    the report's ``kernel_gap_nodes``, computed with the note's arguments."""
    starts, _ = kernel_gap_starts(tensors, same_samples, skip, nodes)
    return tuple(dict.fromkeys(s.node for s in starts if s.node))


def kernel_gap_notes(
    tensors: tuple[TensorRecord, ...],
    same_samples: dict[str, ErrorStats] | None = None,
    limit: int = 3,
    skip: Collection[str] = (),
    nodes: Sequence[NodeRecord] = (),
) -> list[str]:
    """Notes naming where ORT's deployed integer kernels start to lose much more than fake-quant
    (:func:`kernel_gap_starts`: the nodes where the gap first opens, and how many tensors inherit it)."""
    starts, gapped = kernel_gap_starts(tensors, same_samples, skip, nodes)
    if not starts:
        return []
    shown = starts[:limit]
    where = ", ".join(
        f"{s.tensor.name}{s.via}: {s.deployed.sqnr_db:.1f} dB deployed vs "
        f"{fmt_db(s.tensor.accumulated_fakequant.sqnr_db)} dB fake-quant"  # type: ignore[union-attr]
        for s in shown
    )
    inherited = gapped - len(starts)
    rest = f"; {inherited} tensor(s) downstream inherit it" if nodes and inherited > 0 else ""
    producers = ", ".join(dict.fromkeys(s.node for s in shown if s.node)) or "those nodes"
    return [
        f"{KERNEL_GAP_START} at {gapped} tensor(s); "
        f"the gap opens at {where}{rest}. On x86 CPUs without VNNI, ORT's u8s8 MatMul/Conv kernels can "
        "saturate their 16-bit intermediates (ORT's documented U8S8 saturation, a kernel limit, not the "
        f"model's fault). {KERNEL_GAP_FIX}, or keep {producers} out of INT8"
    ]


KERNEL_GAP_FIX = (
    "Fixes that keep INT8: re-quantize with --weight-type QUInt8 (U8U8 kernels do not saturate), or give "
    "the nodes 7-bit weights (reduce_range: `qdebug propose` tries it for the whole model where the gap opens "
    "at several weighted nodes, else per node; --allow reduce-range, on by default)"
)
"""The kernel-gap note's advice (ORT's saturation fixes, cheapest to the model first)."""


CONCAT_RANGE_RATIO = 50.0
"""Concat inputs whose quantization ranges differ by more than this share one scale badly."""


def _qspan(t: TensorRecord) -> float:
    """Width of the range a uint8 scale must cover (min/max with 0 included, as ORT's calibration does)."""
    assert t.summary is not None
    return max(t.summary.max, 0.0) - min(t.summary.min, 0.0)


def _usable(q: QuantParams | None) -> bool:
    """A Q/DQ pair with a scale the notes can reason with (a user's model may hold an infinite one)."""
    return q is not None and math.isfinite(q.scale) and q.scale > 0


def _requantized(value: float, q: QuantParams) -> float | None:
    """``value`` after QuantizeLinear/DequantizeLinear with ``q`` (round half to even, saturating);
    ``None`` for types without integer levels (float8)."""
    try:
        info = np.iinfo(np.dtype(q.qtype))
    except TypeError:
        return None
    level = min(max(float(np.rint(value / q.scale)) + q.zero_point, info.min), info.max)
    return (level - q.zero_point) * q.scale


def _exact_on_grid(t: TensorRecord, q: QuantParams) -> bool:
    """A constant tensor (a stride, an anchor) whose one value lands on ``q``'s grid: that scale loses none
    of it, however coarse it is."""
    s = t.summary
    if s is None or s.min != s.max:
        return False
    back = _requantized(s.min, q)
    return back is not None and abs(back - s.min) <= 1e-6 * max(abs(s.min), q.scale)


def concat_range_notes(fp32: onnx.ModelProto, tensors: tuple[TensorRecord, ...]) -> list[str]:
    """Notes naming Concat outputs whose inputs' ranges differ by > :data:`CONCAT_RANGE_RATIO`.

    One scale for the concatenated tensor is sized by the widest input, so a narrow
    input (0-1 class scores next to pixel box coordinates) keeps only a few levels. Only where that scale
    exists and loses something: the output quantized (no shared scale otherwise), its local SQNR finite
    (an exact concatenation wipes nothing out), and the narrow input not a constant the grid holds exactly.
    """
    by_name = {t.name: t for t in tensors}
    notes = []
    for node in fp32.graph.node:
        if node.op_type != "Concat" or not node.output or node.output[0] not in by_name:
            continue
        out = by_name[node.output[0]]
        if not _usable(out.quant) or out.local is None or not math.isfinite(out.local.sqnr_db):
            continue
        assert out.quant is not None
        parts = [by_name[i] for i in node.input if i in by_name and by_name[i].summary is not None]
        spans = [(_qspan(t), t) for t in parts if math.isfinite(_qspan(t)) and _qspan(t) > 0]
        lossy = [(span, t) for span, t in spans if not _exact_on_grid(t, out.quant)]
        if len(spans) < 2 or not lossy:
            continue
        lo_span, small = min(lossy, key=lambda x: x[0])
        hi_span = max(x[0] for x in spans)
        if hi_span <= CONCAT_RANGE_RATIO * lo_span:
            continue
        detail = (
            f"; its shared scale {out.quant.scale:.4g} leaves {small.name} about "
            f"{lo_span / out.quant.scale:.1f} quantization level(s); local SQNR of {out.name}: "
            f"{out.local.sqnr_db:.1f} dB"
        )
        ranges = ", ".join(f"{t.name} [{t.summary.min:.4g}, {t.summary.max:.4g}]" for t in parts if t.summary)
        notes.append(
            f"Concat {node.name} joins inputs whose ranges differ by {hi_span / lo_span:.0f}x ({ranges}): "
            f"one scale for {out.name} wipes out the small one{detail}. Keep {out.name} in float (exclude "
            f"{node.name} and its quantized neighbours), give it 16-bit activations, or concatenate after "
            "dequantizing"
        )
    return notes


COLLAPSED_SHARE = 0.5
"""A quantized tensor with at least this share of its values in one quantization step has lost them."""

COLLAPSE_INTRODUCED_DB = 20.0
"""...when a consumer then introduces at least this much error (the damage shows downstream)..."""

COLLAPSE_HARMLESS_DB = 30.0
"""...to below this SQNR at its output (above it the consumer has lost nothing worth keeping it FP32)..."""

COLLAPSE_MARGIN_DB = 6.0
"""...and at least this far below what the consumer's own quantization (its output Q/DQ, its weights)
explains: a MatMul reading an exact one-hot tensor falls from "120" to 43 dB by its own rounding alone."""


def _lossy(t: TensorRecord) -> bool:
    """Its own Q/DQ loses something measurable: quantized with a usable scale, not a constant (one value
    needs one step: a stride of 8 has no "other values" to erase), local SQNR finite (exact 0/1 is inf)."""
    if not _usable(t.quant) or t.summary is None or t.summary.min == t.summary.max:
        return False
    return t.local is not None and math.isfinite(t.local.sqnr_db)


def _own_sqnr(nodes: Sequence[NodeRecord], weights: Sequence[WeightRecord]) -> dict[str, float]:
    """Per node, the SQNR of what its own quantization adds: its outputs' Q/DQ and its weights (inf: none)."""
    own = {n.name: n.local_sqnr_db if not math.isnan(n.local_sqnr_db) else math.inf for n in nodes}
    for w in weights:
        if w.node in own and not math.isnan(w.error.sqnr_db):
            own[w.node] = min(own[w.node], w.error.sqnr_db)
    return own


def _damaged_consumer(t: TensorRecord, by_node: dict[str, NodeRecord], own: dict[str, float]) -> NodeRecord | None:
    """The consumer of ``t`` that introduces the most error beyond what its own quantization explains;
    ``None`` when none loses measurably (:data:`COLLAPSE_INTRODUCED_DB` and the two after it).

    ``introduced_db`` is measured from the consumer's worst input, so an error its other inputs bring is
    not put on ``t``."""
    found = []
    for name in t.consumers:
        c = by_node.get(name)
        if c is None or not (math.isfinite(c.accumulated_sqnr_db) and math.isfinite(c.introduced_db)):
            continue
        if (
            c.introduced_db >= COLLAPSE_INTRODUCED_DB
            and c.accumulated_sqnr_db < COLLAPSE_HARMLESS_DB
            and c.accumulated_sqnr_db + COLLAPSE_MARGIN_DB < own.get(c.name, math.inf)
        ):
            found.append(c)
    return max(found, key=lambda c: c.introduced_db, default=None)


def _excludable(n: NodeRecord | None) -> bool:
    """Listing ``n`` in nodes_to_exclude changes the model (older reports: it is quantized)."""
    return n is not None and (n.excludable if n.excludable is not None else n.quantized)


def collapsed_range_notes(
    tensors: tuple[TensorRecord, ...],
    nodes: tuple[NodeRecord, ...],
    weights: Sequence[WeightRecord] = (),
) -> list[str]:
    """Notes naming tensors whose range is set by a few huge values (an additive mask of -1e9): most values
    share one quantization step, which SQNR hides (the huge values carry nearly all the energy), and the
    error first shows in a consumer (the Softmax), which the ranking would blame instead.

    Only on measured loss (:func:`_lossy`, :func:`_damaged_consumer`): a constant or exactly represented
    tensor also has its values in one or two steps, and a MatMul reading it "introduced 85.5 dB" by its own
    rounding from an exact input; the note had told users to keep both out of quantization. ``weights``
    (the report's) let a consumer's own weight error count as explained.
    """
    by_node = {n.name: n for n in nodes}
    own = _own_sqnr(nodes, weights)
    notes = []
    for t in tensors:
        h, q = t.histogram, t.quant
        if h is None or q is None or not _lossy(t):
            continue
        total = sum(h.ref_counts)
        if not total or max(h.ref_counts) < COLLAPSED_SHARE * total:
            continue
        hit = _damaged_consumer(t, by_node, own)
        if hit is None:
            continue
        assert t.summary is not None and t.accumulated is not None
        keep = [n for n in dict.fromkeys((t.producer, hit.name)) if n and _excludable(by_node.get(n))]
        what = " and ".join(keep) if keep else f"the nodes that quantize {t.name}"
        notes.append(
            f"{t.name}: {max(h.ref_counts) / total:.0%} of its values fall in one quantization step (scale "
            f"{q.scale:.3g} for the range [{t.summary.min:.3g}, {t.summary.max:.3g}]), although its SQNR looks "
            f"{fmt_db(t.accumulated.sqnr_db)} dB (the largest values carry the energy); {hit.name} "
            f"({hit.op_type}) reading it falls to {hit.accumulated_sqnr_db:.1f} dB SQNR, which its own "
            f"quantization ({fmt_db(own.get(hit.name, math.inf))} dB) does not explain. A range set by outliers "
            f"such as mask values of -1e9 erases the other values: keep {what} out of quantization"
        )
    return notes


def instrumentation_notes(layers: LayerErrors) -> list[str]:
    """A note when instrumenting the quantized model changed how ORT runs it, not just what it exposes.

    Exposing DequantizeLinear outputs keeps ORT's usual integer fusions, but not every one: with int8
    activations (S8S8, ActivationSymmetric), ORT stops fusing a Conv whose DQ output is a graph output,
    so the instrumented model computed in float what the deployed one computes in int8. The per-layer
    numbers then miss the deployed loss (39.7 dB per layer against 13.0 dB at the deployed output, a
    17.5-point drop no layer explained, and no note).
    """
    if layers.first_batch_sqnr is None:
        return []
    deployed, instrumented = layers.first_batch_sqnr
    gap = _capped_gap(instrumented, deployed)  # 140 against 100 dB misses nothing worth a note
    if not math.isfinite(gap) or gap <= KERNEL_GAP_DB:
        return []
    return [
        f"the deployed quantized model's outputs are worse than the instrumented one's ({deployed:.1f} against "
        f"{fmt_db(instrumented)} dB SQNR on the first batch): exposing its tensors changed how ORT fuses its integer "
        "kernels (int8 activations, S8S8, do this), so the per-layer numbers describe un-fused kernels and "
        "miss part of the deployed loss (uint8 activations, ORT's default, keep the fusions)"
    ]


EVAL_OVERSHOOT_STEPS = 4.0
"""An evaluation overshoot past the calibrated range matters from this many quantization steps of the
tensor's own scale: a value clipped by ``k`` steps is off by ``k`` steps, against the half step every value
may round by, so below 4 the few clipped values carry errors of the same order as the rounding that all
values carry (and the output's measured error already holds that rounding). Not the bar for a top1 metric
on logits: see :func:`eval_range_notes`."""

EVAL_OVERSHOOT_SHARE = 0.01
"""... and by at least this share of the representable range: 4 steps of an int16 scale are 0.006% of the
range, which clipping cannot make matter (for 8-bit types the 4 steps, 1.6% of the range, decide)."""


def _clip_changes_no_class(evaluator: Evaluator, name: str, lo: float, hi: float) -> bool:
    """True where the task metric reads a class from output ``name`` (the argmax of a ``[batch, classes]``
    scores output, top1 or top1_agreement) and clipping FP32's own values to ``[lo, hi]`` changes no
    sample's class: the clip costs that metric nothing. False where it changes one, or where the metric reads
    no class from ``name`` (an SQNR, exact_match, a custom metric, another output): nothing to judge it by."""
    if getattr(evaluator, "metric_name", None) not in ("top1", "top1_agreement"):
        return False
    if getattr(evaluator, "_indices", True) or evaluator.output_names[0] != name:
        return False
    for batch in evaluator.reference:
        arr = batch[name]
        if arr.ndim != 2:
            return False
        if not np.array_equal(np.argmax(arr, axis=1), np.argmax(np.clip(arr, lo, hi), axis=1)):
            return False
    return True


def eval_range_notes(
    evaluator: Evaluator,
    tensors: Sequence[TensorRecord],
    nodes: Sequence[NodeRecord] = (),
    limit: int = 3,
) -> list[str]:
    """Notes naming model outputs whose evaluation values fall outside what quantization can represent
    *and* outside everything calibration saw: the calibration set does not cover the evaluation data, and
    those values are clipped (a regression head reached 2x its calibrated range on 5 of 160 samples, its
    error was 20x, and nothing said why; the report's per-tensor numbers are measured on calibration data).

    Only beyond half a quantization step past the outermost level: up to there a value rounds to that level
    with no more error than any value inside the range (a last-digit overshoot is no clipping). And only
    where the farthest value overshoots materially, by :data:`EVAL_OVERSHOOT_STEPS` steps of the tensor's
    scale and :data:`EVAL_OVERSHOOT_SHARE` of its range: a smaller clip costs about what rounding costs, and
    its advice (recalibrate, or keep the producer FP32) would change nothing. The note says how many steps
    the values overshoot by. Where the task metric reads a class from the output (top1, top1_agreement on a
    scores output), clipping FP32's own values to the range must also change a prediction: the bundled
    demo's logits overshoot by 1.6 steps at the top and 14 at the bottom, on the least likely classes, which
    no argmax reads; the note told the user to keep the Gemm FP32, and doing so changed nothing (top1 83.4%
    and 81 flipped samples either way).
    """
    by_name = {t.name: t for t in tensors}
    node_of = {n.name: n for n in nodes}
    producer_of = {o: n.name for n in nodes for o in n.outputs}

    def computing(name: str | None) -> str | None:
        """The node that computes the values: through Reshape/Transpose/... (which only move them) to the
        node above ("keep flat FP32" for a Reshape could not change what reached it)."""
        for _ in range(8):
            node = node_of.get(name or "")
            if node is None or node.op_type not in PERMUTATION_OPS or not node.inputs:
                break
            name = producer_of.get(node.inputs[0], name)
            if name == node.name:
                break
        return name

    found = []
    for name in evaluator.output_names:
        rec = by_name.get(name)
        if rec is None or not _usable(rec.quant) or rec.summary is None or rec.quant.axis is not None:
            continue
        try:
            info = np.iinfo(np.dtype(rec.quant.qtype))
        except TypeError:  # float8 and other non-integer types
            continue
        lo = min((info.min - rec.quant.zero_point) * rec.quant.scale, rec.summary.min)
        hi = max((info.max - rec.quant.zero_point) * rec.quant.scale, rec.summary.max)
        scale = rec.quant.scale
        material = max(EVAL_OVERSHOOT_STEPS * scale, EVAL_OVERSHOOT_SHARE * (hi - lo))
        outside = far = overshoot = 0
        for batch, size in zip(evaluator.reference, evaluator.sizes, strict=True):
            arr = batch[name]
            if arr.dtype.kind != "f" or arr.size == 0:
                continue
            beyond = (arr < lo - scale / 2) | (arr > hi + scale / 2)
            if not beyond.any():
                continue
            values = arr[beyond].astype(np.float64)
            far = max(far, float(np.max(np.abs(values))))
            overshoot = max(overshoot, float(np.max(np.maximum(lo - values, values - hi))))
            if arr.ndim and arr.shape[0] == size:  # batch-major: count the samples
                outside += int(beyond.reshape(size, -1).any(axis=1).sum())
            else:  # no batch axis to read samples from (a fixed batch reshaped away): the whole batch
                outside += size
        if not outside or overshoot < material:  # a smaller clip costs what rounding costs: no advice to give
            continue
        if _clip_changes_no_class(evaluator, name, lo, hi):
            continue
        found.append((outside, name, lo, hi, far, overshoot / scale, computing(rec.producer)))
    found.sort(key=lambda f: -f[0])
    return [
        f"evaluation data drives output {name!r} outside its calibrated range [{lo:.4g}, {hi:.4g}] on "
        f"{n} of {evaluator.samples} samples (|value| up to {far:.4g}; up to {steps:.0f} quantization steps "
        "past the range): quantization clips those values, and the report's per-tensor numbers, measured on "
        "the calibration data, do not show it; calibrate on data that covers the evaluation range, or keep "
        f"{producer or 'its producer'} FP32"
        for n, name, lo, hi, far, steps, producer in found[:limit]
    ]
