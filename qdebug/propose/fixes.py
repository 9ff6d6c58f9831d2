"""Per-node fixes cheaper than FP32: what keeps a culprit's integer kernels and still removes its error.

A node kept FP32 costs Q/DQ pairs at its boundary and a float kernel; often a smaller change does the
job, and each is one ``TensorQuantOverrides`` entry built from what the report already holds (no
recalibration):

- ``clip``: the unit's activations quantized over the range that holds nearly all of their calibration
  values (from the cached histogram), so a few outliers stop costing every other value its levels;
- ``per-channel``: per-channel weights for the unit's weighted nodes only (one scale per output
  channel), when the model's weights are per-tensor;
- ``reduce-range``: 7-bit weights for the unit's weighted nodes, for the integer-kernel gap analyze
  measures (u8s8 kernels on x86 CPUs without VNNI saturate their 16-bit sums), only where it measured one;
- ``calib-flipped`` (opt-in): the unit's ranges widened by the static model's flipped evaluation samples
  (:mod:`qdebug.propose.flipped`, measured once per run), where the evaluation data leaves the calibrated ranges.

:func:`fix_for` returns ``None`` where a fix does not apply, so the search spends no evaluation on it.
:func:`whole_reduce_range` is the reduce-range fix for every weighted node at once, tried right after the
baseline (before per-channel weights) when analyze measured the kernel gap at several nodes.
:func:`whole_percentile` is the clip fix for the whole model: every activation whose percentile range (ORT's
percentile calibration, one more cached pass) is much narrower than the run's own, clipped to it -- the
calibration method chosen per tensor, for a loss spread over every layer by a few extreme calibration values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import onnx

from qdebug.propose.blame import Unit
from qdebug.propose.flipped import KIND as CALIB_FLIPPED
from qdebug.propose.flipped import FlippedRanges
from qdebug.propose.search import Fix
from qdebug.propose.structure import Structure
from qdebug.records import KERNEL_GAP_DB, Report, TensorOverride, TensorRecord

CLIP_KEEP = 0.9999
"""Share of a tensor's calibration values the clipped range keeps (the rest saturate)."""
CLIP_MIN_GAIN = 2.0
"""A clipped range must be at least this many times narrower than the calibrated one to be worth a try."""


def fix_for(
    unit: Unit,
    kind: str,
    structure: Structure,
    report: Report,
    per_channel: bool,
    flipped: FlippedRanges | None = None,
) -> Fix | None:
    """The ``kind`` fix of ``unit`` (``clip``, ``per-channel``, ``reduce-range``, ``calib-flipped``), or
    ``None`` where it does not apply (no histogram to clip, no weights, already per-channel, no kernel gap
    measured, no range of the unit's that ``flipped`` widens)."""
    if kind == CALIB_FLIPPED:
        return flipped.fix(unit, structure) if flipped is not None else None
    tensors = {t.name: t for t in report.tensors}
    if kind == "clip":
        return _clip(unit, tensors)
    weights = _weights(unit, structure)
    if not weights:
        return None
    if kind == "per-channel" and not per_channel:
        overrides = tuple(TensorOverride(w, axis=axis) for w, axis in weights)
        why = f"per-channel weights for {', '.join(n for n in unit.nodes if _weighted(structure, n))}"
        return Fix(unit, kind, overrides, why)
    if kind == "reduce-range" and _kernel_gap(unit, tensors):
        overrides = tuple(TensorOverride(w, reduce_range=True) for w, _ in weights)
        why = "7-bit weights (reduce_range) where analyze measured the integer kernels losing to fake-quant"
        return Fix(unit, kind, overrides, why)
    return None


WHOLE_GAP_NODES = 2
"""Weighted nodes with a measured kernel gap from which 7-bit weights for the whole model are tried."""


def whole_reduce_range(structure: Structure, report: Report) -> Fix | None:
    """7-bit weights for every weighted node at once -- ORT's own advice for u8s8 kernels on x86 CPUs without
    VNNI -- when analyze measured the integer kernels' gap opening at :data:`WHOLE_GAP_NODES` or more weighted
    nodes (:func:`~qdebug.analysis.notes.kernel_gap_starts`: where it opens, not the tensors downstream that
    inherit it), and the weights are neither 7-bit already nor U8U8 (which does not saturate). One evaluation
    that keeps every node INT8, where the per-node fix spends one per unit (on a chain of 800 MatMuls without
    VNNI the gap opened at 41 of them). None otherwise: one node's gap is the per-node fix's. The nodes are the
    report's ``kernel_gap_nodes``, the ones analyze's kernel-gap note names (same rule, same samples)."""
    from qdebug.analysis.notes import kernel_gap_nodes

    settings = report.config.quant
    if settings.reduce_range or settings.weight_type == "QUInt8":
        return None
    opened = report.kernel_gap_nodes
    if opened is None:  # a report from before the field: the rule over the full run's deployed error
        opened = kernel_gap_nodes(report.tensors, nodes=report.nodes)
    weighted = tuple(n.name for n in structure.model.graph.node if _in_graph_weighted(structure, n.name))
    gaps = [n for n in opened if _in_graph_weighted(structure, n)]
    if len(gaps) < WHOLE_GAP_NODES:
        return None
    weights = _weights(Unit("model", "model", weighted, (), 0.0, "", ""), structure)
    overrides = tuple(TensorOverride(w, reduce_range=True) for w in dict.fromkeys(w for w, _ in weights))
    if not overrides:
        return None
    why = (
        f"7-bit weights (reduce_range) for the whole model: analyze measured the deployed integer kernels "
        f"losing to fake-quant, the gap opening at {len(gaps)} weighted node(s) "
        f"({', '.join(gaps[:3])}{'...' if len(gaps) > 3 else ''}): the u8s8 saturation of x86 CPUs without VNNI"
    )
    unit = Unit("reduce-range", "model", (), (), 0.0, "", "every weight of the model")
    return Fix(unit, "reduce-range", overrides, why)


def _clip(unit: Unit, tensors: dict[str, TensorRecord]) -> Fix | None:
    overrides, spans = [], []
    for name in unit.tensors or (unit.key,):
        t = tensors.get(name)
        clipped = _clipped_range(t) if t is not None else None
        if clipped is not None:
            overrides.append(TensorOverride(name, rmin=clipped[0], rmax=clipped[1]))
            spans.append(f"{name} to [{clipped[0]:.4g}, {clipped[1]:.4g}]")
    if not overrides:
        return None
    why = f"range clipped to {CLIP_KEEP:.2%} of its calibration values: {'; '.join(spans)}"
    return Fix(unit, "clip", tuple(overrides), why)


def _clipped_range(t: TensorRecord) -> tuple[float, float] | None:
    """The narrowest histogram-bin range holding :data:`CLIP_KEEP` of the values (0 kept inside, as ORT
    does), when it is at least :data:`CLIP_MIN_GAIN` times narrower than the calibrated range."""
    h, q = t.histogram, t.quant
    if h is None or q is None or t.summary is None or not h.ref_counts:
        return None
    total = sum(h.ref_counts)
    if total <= 0:
        return None
    tail = (1.0 - CLIP_KEEP) / 2 * total
    lo, seen = 0, 0
    while lo < len(h.ref_counts) - 1 and seen + h.ref_counts[lo] <= tail:
        seen += h.ref_counts[lo]
        lo += 1
    hi, seen = len(h.ref_counts) - 1, 0
    while hi > lo and seen + h.ref_counts[hi] <= tail:
        seen += h.ref_counts[hi]
        hi -= 1
    rmin, rmax = min(h.edges[lo], 0.0), max(h.edges[hi + 1], 0.0)
    full = max(t.summary.max, 0.0) - min(t.summary.min, 0.0)
    if not (math.isfinite(rmin) and math.isfinite(rmax)) or rmax <= rmin or full < CLIP_MIN_GAIN * (rmax - rmin):
        return None
    return float(rmin), float(rmax)


def _in_graph_weighted(structure: Structure, node: str) -> bool:
    return node in structure.graph and _weighted(structure, node)


def _weighted(structure: Structure, node: str) -> bool:
    return bool(structure.graph.nodes[node]["weighted"])


def _weights(unit: Unit, structure: Structure) -> list[tuple[str, int]]:
    """(weight initializer, per-channel axis) of the unit's weighted nodes: the output-channel axis as
    ORT quantizes it (Conv 0, ConvTranspose 1, Gemm by transB, MatMul the last)."""
    out = []
    wanted = {n for n in unit.nodes if _weighted(structure, n)}
    for node in (n for n in structure.model.graph.node if n.name in wanted):
        if len(node.input) < 2 or node.input[1] not in structure.index.inits:
            continue
        weight = structure.index.inits[node.input[1]]
        axis = _channel_axis(node, len(weight.dims))
        if axis is not None:
            out.append((weight.name, axis))
    return out


def _channel_axis(node: onnx.NodeProto, rank: int) -> int | None:
    if rank < 2:
        return None
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans_b else 1
    return rank - 1  # MatMul: [in, out]


def _kernel_gap(unit: Unit, tensors: dict[str, TensorRecord]) -> bool:
    """Whether analyze measured the deployed kernels losing to fake-quant on the unit's tensors."""
    for name in (*unit.tensors, unit.key):
        t = tensors.get(name)
        if t is None or t.accumulated is None or t.accumulated_fakequant is None:
            continue
        gap = t.accumulated_fakequant.sqnr_db - t.accumulated.sqnr_db
        if math.isfinite(gap) and gap > KERNEL_GAP_DB:
            return True
    return False


PERCENTILE = 99.99
"""The percentile :func:`whole_percentile` calibrates at (ORT's ``CalibPercentile``; its default, 99.999, keeps
a tail of 1 value in 100,000: a stuck pixel in every few images is more)."""
WHOLE_CLIP_MIN_GAIN = 1.25
"""A range :func:`whole_percentile` clips must be this many times wider than its percentile range. Lower than a
unit's :data:`CLIP_MIN_GAIN`: a few extreme values pass through every layer, each range a little narrower
downstream, and the fix is one evaluation that the task metric judges as a whole (on the planted ``long_tail``
the input's range is 512x its percentile range, the layers' 1.2-1.7x; clipping the input alone misses)."""


def whole_percentile(
    run_ranges: Mapping[str, tuple[float, float]],
    percentile_ranges: Mapping[str, tuple[float, float]],
    percentile: float = PERCENTILE,
) -> Fix | None:
    """Every activation's percentile range where it is at least :data:`WHOLE_CLIP_MIN_GAIN` times narrower than
    the run's calibrated one (0 kept inside, as ORT does), as one clip fix; None where no range is. Where a few
    extreme calibration values set every min-max range (a corrupt image, a stuck sensor cell), the ordinary
    values keep a few levels in every layer and no small set of nodes kept FP32 recovers them; the tensors
    whose values are not long-tailed keep their own range (choosing the method per tensor, not per model)."""
    clipped = []
    for name, (lo, hi) in run_ranges.items():
        p = percentile_ranges.get(name)
        if p is None:
            continue
        rmin, rmax = min(p[0], 0.0), max(p[1], 0.0)
        full = max(hi, 0.0) - min(lo, 0.0)
        if math.isfinite(rmin) and math.isfinite(rmax) and rmax > rmin and full >= WHOLE_CLIP_MIN_GAIN * (rmax - rmin):
            clipped.append((name, rmin, rmax, full / (rmax - rmin)))
    if not clipped:
        return None
    clipped.sort(key=lambda row: -row[3])
    overrides = tuple(TensorOverride(name, rmin=rmin, rmax=rmax) for name, rmin, rmax, _ in clipped)
    worst = clipped[0]
    why = (
        f"{len(clipped)} of {len(run_ranges)} activation ranges clipped to their {percentile:g} % percentile range, "
        f"{worst[3]:.0f}x narrower at most ({worst[0]} to [{worst[1]:.4g}, {worst[2]:.4g}]): a few extreme "
        "calibration values had set them"
    )
    unit = Unit("percentile", "model", (), tuple(name for name, *_ in clipped), 0.0, "", "the long-tailed ranges")
    return Fix(unit, "clip", overrides, why)
