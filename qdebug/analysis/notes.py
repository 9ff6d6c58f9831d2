"""Every note an analysis report can carry about its own measurement, in one place.

A note is one sentence for the user: what the numbers cannot show by
themselves and what to do about it. ``qdebug analyze`` writes them in this
order (:func:`qdebug.pipeline._analyze`); the notes about the model file and
the data come from :mod:`qdebug.prepare` and :mod:`qdebug.data`, the
evaluation metric's scope from :func:`qdebug.evaluate.metric_scope_note`.

* how the QDQ model was built: :func:`quantizer_notes`;
* how the capture ran: :func:`capture_notes`, :func:`instrumentation_notes`;
* where the deployed integer kernels lose more than fake-quant: :func:`kernel_gap_notes`;
* ranges one scale cannot serve: :func:`concat_range_notes`, :func:`collapsed_range_notes`;
* what ORT folded or left in float: :func:`folded_activation_notes`, :func:`structure_notes`;
* evaluation values outside the calibrated range: :func:`eval_range_notes`.

A note that advises keeping a node out of quantization fires only on measured loss: a tensor whose own
Q/DQ loses nothing -- a constant (a detector's stride, range [8, 8]), an exactly representable tensor (a
one-hot of 0/1: local SQNR inf), a tensor ORT does not quantize -- is never named, and a consumer's error
counts only where its own quantization cannot explain it. Those notes had told users to exclude nodes
that lose nothing (three on one detector).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

import numpy as np
import onnx

from qdebug.analysis.build import SQNR_CAP_DB
from qdebug.analysis.measure import LayerErrors
from qdebug.calibrate import Ranges
from qdebug.evaluate import Evaluator
from qdebug.formatting import fmt_db, fmt_size
from qdebug.graph.load import PER_CHANNEL_OPSET, WeightBytes, default_opset, weight_bytes
from qdebug.graph.match import is_qdq_model
from qdebug.graph.ops import PERMUTATION_OPS
from qdebug.quantize import float16_exclusions, nonfinite_range_exclusions
from qdebug.records import (
    KERNEL_GAP_DB,
    ErrorStats,
    NodeRecord,
    QuantParams,
    TensorRecord,
    WeightRecord,
    folded_into,
)

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


def kernel_gap_notes(
    tensors: tuple[TensorRecord, ...],
    same_samples: dict[str, ErrorStats] | None = None,
    limit: int = 3,
    skip: Collection[str] = (),
    nodes: Sequence[NodeRecord] = (),
) -> list[str]:
    """Notes naming where ORT's deployed integer kernels start to lose much more than fake-quant.

    ``same_samples`` holds the deployed error over the samples the fake-quant
    view saw (:attr:`LayerErrors.deployed_head`), so both sides of the gap
    cover the same data; without it the full-run ``accumulated`` is used.
    ``skip``: tensors not to count (e.g. a Reshape of a tensor already counted).
    With ``nodes``, a gap its producer's inputs already carry is inherited, not
    started there: the note names the nodes where the gap first opens (it had
    named a LeakyRelu and a Split three nodes below the Conv whose u8s8 kernel
    lost the precision, and told the user to keep those out of INT8).
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
        return []
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
        """The part of ``t``'s gap its producer adds (all of it without node records)."""
        before = [upstream(i) for i in inputs_of.get(t.producer or "", ())]
        return gap - max(before, default=0.0)

    starts = sorted(
        ((opened(g, t), g, t, d) for g, t, d in gaps.values() if opened(g, t) > KERNEL_GAP_DB),
        key=lambda s: -s[0],
    ) or sorted(((g, g, t, d) for g, t, d in gaps.values()), key=lambda s: -s[0])
    shown = starts[:limit]
    folded = folded_into(nodes, tensors)

    def origin(t: TensorRecord) -> tuple[str | None, str]:
        """The node whose kernel made ``t`` (the producer an activation was folded into), and how to say it."""
        src = folded.get(t.producer or "")
        if src is not None:  # a Relu ORT folded into its producer's output Q: the producer's kernel
            return src, f" (from {src}, {t.producer} folded into it)"
        return t.producer, f" (from {t.producer})" if t.producer else ""

    where = ", ".join(
        f"{t.name}{origin(t)[1]}: {d.sqnr_db:.1f} dB deployed vs "
        f"{fmt_db(t.accumulated_fakequant.sqnr_db)} dB fake-quant"
        for _, _, t, d in shown
    )
    inherited = len(gaps) - len(starts)
    rest = f"; {inherited} tensor(s) downstream inherit it" if nodes and inherited > 0 else ""
    producers = ", ".join(dict.fromkeys(o for o in (origin(t)[0] for _, _, t, _ in shown) if o)) or "those nodes"
    return [
        f"{KERNEL_GAP_START} at {len(gaps)} tensor(s); "
        f"the gap opens at {where}{rest}. On x86 CPUs without VNNI, ORT's u8s8 MatMul/Conv kernels can "
        "saturate their 16-bit intermediates (ORT's documented U8S8 saturation, a kernel limit, not the "
        f"model's fault). {KERNEL_GAP_FIX}, or keep {producers} out of INT8"
    ]


KERNEL_GAP_FIX = (
    "Fixes that keep INT8: re-quantize with --weight-type QUInt8 (U8U8 kernels do not saturate), or give "
    "the nodes 7-bit weights (reduce_range: `qdebug propose` tries it per node where this gap opens, "
    "--allow reduce-range, on by default)"
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


def folded_activation_notes(nodes: tuple[NodeRecord, ...], tensors: tuple[TensorRecord, ...]) -> list[str]:
    """One note for the activations ORT folded into their producer's output quantization.

    The error of that Q/DQ then shows at the activation (ranked by the summary, but not excludable
    itself), while the producer shows no numbers at all: a walk-through saw a Relu ranked worst and
    propose keep a LayerNormalization the summary never named.
    """
    pairs = [f"{src} -> {act}" for act, src in folded_into(nodes, tensors).items()]
    if not pairs:
        return []
    shown = ", ".join(pairs[:4]) + ("..." if len(pairs) > 4 else "")
    return [
        f"ORT folded {len(pairs)} activation(s) into the quantization of their producer's output ({shown}): "
        "that Q/DQ's error shows at the activation, which cannot be kept FP32 by itself; keep the producer FP32 "
        "to remove it"
    ]


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


def structure_notes(fp32: onnx.ModelProto, qdq: onnx.ModelProto, quantized_nodes: set[str]) -> list[str]:
    """What ORT's static quantizer leaves in float by construction: subgraphs and recurrent ops."""
    notes = []

    def count(graph: onnx.GraphProto, op: str | None = None) -> int:
        total = 0
        for n in graph.node:
            total += op is None or n.op_type == op
            for attr in n.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    total += count(sub, op)
        return total

    q_inside = sum(
        count(sub, "QuantizeLinear")
        for n in qdq.graph.node
        for attr in n.attribute
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
    )
    constants = {i.name for i in fp32.graph.initializer}
    for node in fp32.graph.node:
        subs = [
            (attr.name, sub)
            for attr in node.attribute
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
        ]
        if not subs:
            continue
        inner = sum(count(g) for _, g in subs)
        if q_inside == 0:
            extra = ""
            if node.op_type == "If" and node.input and node.input[0] in constants:
                extra = "; its condition is a constant: --inline-constant-if inlines the taken branch"
            elif node.op_type == "If":
                extra = (
                    "; its condition is computed at run time, so it cannot be inlined"
                    " (with a constant condition, --inline-constant-if inlines the taken branch)"
                )
            notes.append(
                f"{node.op_type} node {node.name} holds {inner} node(s) in {', '.join(a for a, _ in subs)} "
                f"that stay FP32: ORT's quantizer inserts no QuantizeLinear/DequantizeLinear inside subgraphs{extra}; "
                "their tensors are listed in not_captured"
            )
    return notes + float_weight_notes(fp32, qdq, quantized_nodes)


RECURRENT_OPS = ("LSTM", "GRU", "RNN")
RECURRENT_START = "recurrent node(s)"
FLOAT_WEIGHTS_START = "the quantized model keeps"
"""Ops ORT's static (QDQ) quantizer never quantizes; ``quantize_dynamic`` has an integer LSTM only."""

FLOAT_WEIGHT_SHARE = 0.1
"""Float weights of nodes other than the recurrent ones are named when they hold this share of the model's
weights: below it, what stays float does not change the model's size or speed much."""


def float_weight_notes(fp32: onnx.ModelProto, qdq: onnx.ModelProto, quantized_nodes: set[str]) -> list[str]:
    """Which big ops the quantized model keeps in float, and how much of the model's weights that is.

    A CNN+LSTM reader's static QDQ model keeps its LSTM in float (ORT quantizes no LSTM in QDQ), and with
    it half the model's weight bytes: the summary had named the LSTM but not what it weighs, so the
    quantized model's size read as "quantized". Bytes are what the report can say without timing; how
    much of the run time the float ops take is ``qdebug bench``'s to measure.
    """
    before, after = weight_bytes(fp32), weight_bytes(qdq)
    if not before.total:
        return []
    notes = []
    rnn = [n for n in fp32.graph.node if n.op_type in RECURRENT_OPS and n.name not in quantized_nodes]
    if rnn:
        held = sum(after.of(n.name) for n in rnn)
        names = ", ".join(f"{n.name} ({n.op_type})" for n in rnn)
        each = [f"{n.name} {fmt_size(after.of(n.name))}" for n in rnn if after.of(n.name)]
        share = (
            f" and keep {fmt_size(held)} of the model's {fmt_size(before.total)} of weights float "
            f"({held / before.total:.0%}{': ' + ', '.join(each) if len(each) > 1 else ''}; "
            f"the quantized model's weights are {fmt_size(after.total)}, "
            f"{fmt_size(after.floating)} of them float)"
            if held
            else ""
        )
        notes.append(
            f"{RECURRENT_START} {names} stay FP32{share}: ORT's static quantizer does not quantize "
            "LSTM/GRU/RNN (quantize_dynamic turns LSTM into DynamicQuantizeLSTM, int8 weights); their outputs "
            "are still measured, and the error reaching them comes from the quantized nodes upstream"
        )
    big = [
        (name, op, b)
        for name, op, b in after.by_node
        if op not in RECURRENT_OPS and b >= FLOAT_WEIGHT_SHARE * before.total
    ]
    if big:
        shown = ", ".join(f"{name} ({op}, {fmt_size(b)})" for name, op, b in big[:4])
        kept = sum(b for *_, b in big)
        notes.append(
            f"{FLOAT_WEIGHTS_START} {fmt_size(kept)} of the model's {fmt_size(before.total)} of weights "
            f"float in {shown}{'...' if len(big) > 4 else ''}: those nodes are not quantized (excluded, or an op "
            "ORT's quantizer leaves float), so they add to its size and run float kernels"
        )
    return notes


FLOAT_SIZE_SHARE = 0.25
"""A quantized variant whose weights are at least this share float gets a note naming what stays float."""


def float_size_note(weights: WeightBytes, size: Callable[[int], str] = fmt_size) -> str | None:
    """verify's and bench's note on a quantized variant whose size is largely float weights, or ``None``
    (the caller says which variant; ``size`` writes bytes in its table's unit).

    The size column compares files; a static CNN+LSTM reader is half its FP32 size because the LSTM's
    weights stay float, and nothing had said so ("26 MB of 54 MB stays float" is what the user needs).
    """
    if not weights.total or weights.floating < FLOAT_SIZE_SHARE * weights.total:
        return None
    shown = ", ".join(f"{name} ({op}, {size(b)})" for name, op, b in weights.by_node[:3])
    more = f" and {len(weights.by_node) - 3} more" if len(weights.by_node) > 3 else ""
    why = (
        "; ORT's static quantizer does not quantize LSTM/GRU/RNN (quantize_dynamic has DynamicQuantizeLSTM)"
        if any(op in RECURRENT_OPS for _, op, _ in weights.by_node[:3])
        else ""
    )
    return (
        f"{size(weights.floating)} of its {size(weights.total)} of weights stay float "
        f"({weights.floating / weights.total:.0%}), so its size is not that of a quantized model: "
        f"{shown}{more}{why}"
    )


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
    with no more error than any value inside the range (a last-digit overshoot is no clipping).
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
        half = rec.quant.scale / 2
        outside = far = 0
        for batch, size in zip(evaluator.reference, evaluator.sizes, strict=True):
            arr = batch[name]
            if arr.dtype.kind != "f" or arr.size == 0:
                continue
            beyond = (arr < lo - half) | (arr > hi + half)
            if not beyond.any():
                continue
            far = max(far, float(np.max(np.abs(arr[beyond]))))
            if arr.ndim and arr.shape[0] == size:  # batch-major: count the samples
                outside += int(beyond.reshape(size, -1).any(axis=1).sum())
            else:  # no batch axis to read samples from (a fixed batch reshaped away): the whole batch
                outside += size
        if outside:
            found.append((outside, name, lo, hi, far, computing(rec.producer)))
    found.sort(key=lambda f: -f[0])
    return [
        f"evaluation data drives output {name!r} outside its calibrated range [{lo:.4g}, {hi:.4g}] on "
        f"{n} of {evaluator.samples} samples (|value| up to {far:.4g}): quantization clips those values, "
        "and the report's per-tensor numbers, measured on the calibration data, do not show it; calibrate "
        f"on data that covers the evaluation range, or keep {producer or 'its producer'} FP32"
        for n, name, lo, hi, far, producer in found[:limit]
    ]


def quantizer_notes(
    normalized: onnx.ModelProto,
    qproto: onnx.ModelProto,
    ranges: Ranges,
    *,
    per_channel: bool,
    method: str,
    activation_type: str,
) -> list[str]:
    """Notes on how qdebug built the QDQ model from ``normalized`` and its calibrated ``ranges``.

    What ORT's quantizer was made to do differently from a plain ``quantize_static`` call (an opset
    conversion, nodes kept out of quantization) must reach the user, who will call ORT themselves; so must a
    calibration method that is known to clip, reused cached ranges, and a model ORT quantized nothing of.
    """
    notes = []
    if per_channel and default_opset(normalized) < PER_CHANNEL_OPSET:
        notes.append(
            f"per-channel weights need DequantizeLinear's axis (opset {PER_CHANNEL_OPSET}): the quantized model "
            f"was converted from opset {default_opset(normalized)} with onnx.version_converter (ORT would "
            "otherwise write a model it cannot load)"
        )
    half = float16_exclusions(normalized)
    if half:
        notes.append(
            f"kept {len(half)} node(s) that compute in float16 out of quantization ({', '.join(half[:6])}"
            f"{'...' if len(half) > 6 else ''}): ORT's quantizer writes an invalid model (float16 scales) for "
            "them; every qdebug variant excludes them, add them to nodes_to_exclude when you call ORT yourself"
        )
    unbounded, why = nonfinite_range_exclusions(normalized, ranges)
    if unbounded:
        nodes = ", ".join(unbounded[:6]) + ("..." if len(unbounded) > 6 else "")
        tensors = ", ".join(why[:4]) + ("..." if len(why) > 4 else "")
        notes.append(
            f"kept {len(unbounded)} node(s) out of quantization ({nodes}) because tensor(s) they read or "
            f"write have a calibrated range that is not finite ({tensors}: an -inf mask or a division by "
            "zero?): ORT's quantizer fails or writes an infinite scale for them; every qdebug variant "
            "excludes them, add them to nodes_to_exclude when you call ORT yourself"
        )
    if method == "distribution" and activation_type in ("QUInt8", "QInt8"):
        notes.append(
            "--method distribution: ORT's Distribution calibrator is meant for float8 types; with 8-bit "
            "integers its ranges often clip (the CNN fixture: top-1 98 % -> 20 %, the same with ORT's "
            "quantize_static): compare with --method minmax, entropy or percentile"
        )
    if ranges.from_cache:
        notes.append(f"calibration ranges reused from cache {ranges.cache_path}")
    if not is_qdq_model(qproto):
        notes.append(
            "ORT inserted no QuantizeLinear/DequantizeLinear nodes: nothing in the main graph was quantized "
            "(is the network inside If/Loop subgraphs?)"
        )
    return notes


def capture_notes(layers: LayerErrors, requested_engine: str, eval_given: bool) -> list[str]:
    """Notes on how the capture ran: a fake-quant view over fewer samples than the main pass, and the numpy
    engine chosen by ``--engine auto`` (slower, and a sign the two models differ in opset or types).

    ``eval_given``: with evaluation data the fake-quant task metric is scored on all of it, so only
    ``accumulated_fakequant`` is limited to the first samples.
    """
    notes = []
    if 0 < layers.fakequant_samples < layers.samples:
        what = "accumulated_fakequant" + ("" if eval_given else ", the fake-quant task metric")
        notes.append(
            f"the fake-quant view ({what}) ran on the first "
            f"{layers.fakequant_samples} of {layers.samples} calibration samples (--fakequant-samples, "
            "rounded up to whole batches)"
        )
    if layers.engine == "numpy" and requested_engine == "auto":
        notes.append(
            "layer capture used the numpy engine (models differ in opset or tensor types are unknown)"
        )
    return notes
