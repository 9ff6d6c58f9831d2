"""The records a capture produces: per tensor, per node and per weight.

A capture fills one :class:`TensorAcc` per FP32 tensor (both engines write
into the same accumulators); :func:`tensor_records` turns them into
:class:`~qdebug.records.TensorRecord`. :func:`node_records` then derives each
node's error from its tensors (the error a node *introduces* is the drop in
accumulated SQNR from its worst input to its worst output), and
:func:`weight_records` compares each FP32 initializer with its dequantized
integer counterpart, which needs no data at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx

from qdebug.evaluation.metrics import (
    ErrorAccumulator,
    HistogramAccumulator,
    QuantGrid,
    SummaryAccumulator,
    TensorErrorAccumulator,
    grid_for,
    range_edges,
)
from qdebug.graph.match import GraphIndex, Pairing
from qdebug.records import NodeRecord, QuantParams, TensorRecord, WeightRecord
from qdebug.records.report import SQNR_CAP_DB, from_exact_input  # noqa: F401 -- re-exported: they moved to the records


class TensorAcc:
    """Accumulators of one FP32 tensor."""

    def __init__(self, quant: QuantParams | None, fallback: tuple[float, float] | None) -> None:
        edges = _edges(quant, fallback)
        self.summary = SummaryAccumulator()
        self.acc = TensorErrorAccumulator(edges)
        self.local = TensorErrorAccumulator(edges) if quant is not None else None
        self.fakequant = ErrorAccumulator() if quant is not None else None
        self.head = ErrorAccumulator() if quant is not None else None
        """The accumulated error over the fake-quant view's samples only (like-for-like kernel gap)."""
        self.deferred_edges = edges is None

    def ensure_edges(self, ref: np.ndarray, lo: float | None = None, hi: float | None = None) -> None:
        """Fix histogram edges from the first batch for tensors with neither a grid nor a calibrated range."""
        if not self.deferred_edges:
            return
        self.deferred_edges = False
        if lo is None or hi is None:
            finite = ref[np.isfinite(ref)]
            if not finite.size:
                return
            lo, hi = float(finite.min()), float(finite.max())
        if math.isfinite(lo) and math.isfinite(hi) and self.acc.histogram is None:
            self.acc.histogram = HistogramAccumulator(range_edges(lo, hi))


def _edges(quant: QuantParams | None, rng: tuple[float, float] | None) -> np.ndarray | QuantGrid | None:
    # a user's QDQ model may hold an infinite scale (ORT's quantize_static on an -inf attention mask)
    if quant is not None and math.isfinite(quant.scale) and quant.scale > 0:
        return grid_for(quant)
    if rng is not None and math.isfinite(rng[0]) and math.isfinite(rng[1]):
        return range_edges(rng[0], rng[1])
    return None


def _alias_note(name: str, aliases: dict[str, str] | None) -> str:
    source = (aliases or {}).get(name)
    return f"same values as {source} (data movement): its statistics, measured once" if source else ""


def tensor_records(
    fp32: onnx.ModelProto,
    pairing: Pairing,
    accs: dict[str, TensorAcc],
    skipped: dict[str, str],
    aliases: dict[str, str] | None = None,
) -> list[TensorRecord]:
    index = GraphIndex(fp32)
    depth = node_depths(fp32)
    out = []
    for p in pairing.tensors:
        a = accs[p.fp32]
        summary = a.summary.result()
        if summary.count == 0:
            if p.fp32 not in skipped and p.note:
                skipped[p.fp32] = p.note
            continue
        producer = index.producer.get(p.fp32)
        acc_stats = a.acc.result() if (a.acc is not None and p.qdq is not None and _has_data(a.acc)) else None
        local = a.local.result() if (a.local is not None and _has_data(a.local)) else None
        hist = a.acc.histogram_result() if (a.acc is not None and _has_data(a.acc)) else None
        out.append(
            TensorRecord(
                name=p.fp32,
                producer=producer.name if producer is not None else None,
                consumers=tuple(n.name for n in index.consumers.get(p.fp32, [])),
                depth=depth.get(producer.name, 0) if producer is not None else 0,
                summary=summary,
                quant=p.quant,
                local=local,
                accumulated=acc_stats,
                histogram=hist,
                quantized_name=p.dequant or p.qdq,
                note=p.note or skipped.get(p.fp32, "") or _alias_note(p.fp32, aliases),
                accumulated_fakequant=(
                    a.fakequant.result() if a.fakequant is not None and a.fakequant.count else None
                ),
                folded_into=p.folded_into,
            )
        )
    return out


def _has_data(acc: TensorErrorAccumulator) -> bool:
    return acc.error.result().count + acc.error.result().nonfinite > 0


def node_depths(model: onnx.ModelProto) -> dict[str, int]:
    """Topological depth of every node (1 + deepest producer of its inputs; graph inputs are 0)."""
    producer_depth: dict[str, int] = {}
    depths = {}
    for node in model.graph.node:
        d = 1 + max((producer_depth.get(i, 0) for i in node.input if i), default=0)
        depths[node.name] = d
        for o in node.output:
            producer_depth[o] = d
    return depths


def _worst(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else math.nan


def _nsr_db(sqnr: float) -> float:
    """Noise-to-signal in dB with SQNR capped at :data:`SQNR_CAP_DB` (exact counts as the cap)."""
    return -min(sqnr, SQNR_CAP_DB)


def node_records(
    fp32: onnx.ModelProto,
    tensors: tuple[TensorRecord, ...],
    quantized_nodes: set[str],
    name_map: dict[str, str],
    *,
    index: GraphIndex | None = None,
    depth: Mapping[str, int] | None = None,
) -> tuple[NodeRecord, ...]:
    """Per-node error: worst output SQNRs and the error the node introduces.

    ``index`` and ``depth`` (:class:`GraphIndex` and :func:`node_depths` of ``fp32``) are built here unless
    given: a caller that builds records for many samples of one model builds them once (the per-sample
    drill-down had built both for every flipped sample: 14 indexes of a 3,200-node graph per analyze).

    ``introduced_db`` = accumulated SQNR at the node's worst float input minus
    at its worst float output (both capped at 120 dB, so an exact input counts
    as 120 dB). Positive: the node makes the error worse. From an exact input
    the value is only the cap minus the output's SQNR (:func:`from_exact_input`
    tells those apart; displays mark them instead of printing the number).
    """
    from qdebug.quant.calibrate import op_types_to_quantize

    ops = set(op_types_to_quantize())
    by_name = {t.name: t for t in tensors}
    index = index if index is not None else GraphIndex(fp32)
    depth = depth if depth is not None else node_depths(fp32)
    out = []
    for node in fp32.graph.node:
        outs = [by_name[o] for o in node.output if o in by_name]
        acc_out = _worst([t.accumulated.sqnr_db for t in outs if t.accumulated])
        acc_in = _worst([_upstream_sqnr(i, by_name, index) for i in node.input if i and i not in index.inits])
        local = _worst([t.local.sqnr_db for t in outs if t.local])
        introduced, added = _introduced_added(acc_out, acc_in)
        # accumulated, not local: binned by level, a tensor's own Q/DQ leaves KL at ~0 unless it clips, and
        # the column read 0 everywhere; the shift from FP32 at the node's output is what KL should show here
        kls = [t.accumulated.kl for t in outs if t.accumulated and not math.isnan(t.accumulated.kl)]
        out.append(
            NodeRecord(
                name=node.name,
                original_name=name_map.get(node.name, node.name),
                op_type=node.op_type,
                inputs=tuple(node.input),
                outputs=tuple(node.output),
                depth=depth[node.name],
                quantized=node.name in quantized_nodes,
                local_sqnr_db=local,
                accumulated_sqnr_db=acc_out,
                introduced_db=introduced,
                kl=max(kls) if kls else math.nan,
                domain=node.domain,
                added_noise_db=added,
                excludable=_excludable(node, quantized_nodes, ops),
            )
        )
    return tuple(out)


def _excludable(node: onnx.NodeProto, quantized_nodes: set[str], ops: set[str]) -> bool:
    """ORT quantizes the node's op type (default domain) and did quantize it: excluding it changes the model."""
    return node.name in quantized_nodes and node.op_type in ops and not node.domain.startswith("com.")


def _introduced_added(acc_out: float, acc_in: float) -> tuple[float, float]:
    """(introduced_db, added_noise_db) of a node from the accumulated SQNRs at its worst output and input."""
    if math.isnan(acc_out):
        return math.nan, math.nan
    in_db = SQNR_CAP_DB if math.isnan(acc_in) else acc_in
    introduced = _nsr_db(acc_out) - _nsr_db(in_db)
    delta = 10 ** (_nsr_db(acc_out) / 10) - 10 ** (_nsr_db(in_db) / 10)
    return introduced, 10 * math.log10(delta) if delta > 0 else -math.inf


def added_noise_by_output(
    fp32: onnx.ModelProto, tensors: tuple[TensorRecord, ...], index: GraphIndex
) -> dict[str, float]:
    """Per output tensor of each node, the node's ``added_noise_db`` exactly as :func:`node_records` derives
    it, without building the rest of every record: the per-sample drill-down needs only this number, once per
    flipped sample, and whole records cost it about 0.1 s a sample at 3,200 nodes."""
    by_name = {t.name: t for t in tensors}
    out: dict[str, float] = {}
    for node in fp32.graph.node:
        outs = [by_name[o] for o in node.output if o in by_name]
        acc_out = _worst([t.accumulated.sqnr_db for t in outs if t.accumulated])
        acc_in = _worst([_upstream_sqnr(i, by_name, index) for i in node.input if i and i not in index.inits])
        added = _introduced_added(acc_out, acc_in)[1]
        for o in node.output:
            out[o] = added
    return out


def _upstream_sqnr(tensor: str, by_name: dict[str, TensorRecord], index: GraphIndex, hops: int = 4) -> float:
    """Accumulated SQNR of ``tensor``, or of the nearest upstream tensors that have one.

    A tensor with no quantized counterpart (e.g. a Conv output whose Relu ORT
    folded away) would otherwise look exact and make its consumer look guilty
    of all the error the pair introduced.
    """
    rec = by_name.get(tensor)
    if rec is not None and rec.accumulated is not None:
        return rec.accumulated.sqnr_db
    producer = index.producer.get(tensor)
    if producer is None or hops == 0:
        return math.nan
    return _worst(
        [_upstream_sqnr(i, by_name, index, hops - 1) for i in producer.input if i and i not in index.inits]
    )


def quantized_node_names(qdq: onnx.ModelProto, pairing: Pairing) -> set[str]:
    """FP32 nodes whose QDQ counterpart computes on quantized values: ORT quantizes their op type and they
    read or write a Q/DQ tensor.

    Touching Q/DQ is not enough: a float LSTM, Cast, ReduceMean or contrib op reads the DQ output its
    quantized producer left, and its output is quantized for a quantized consumer -- the same pattern a
    quantized node has, so only the op type tells them apart (ORT runs no integer kernel for an op
    outside its quantizer's registries). Every node touching Q/DQ had counted: an LSTM showed as quantized
    and the recurrent-op note was never written.
    """
    from qdebug.quant.calibrate import op_types_to_quantize

    ops = set(op_types_to_quantize())
    qi = GraphIndex(qdq)
    qnodes = {n.name: n for n in qdq.graph.node}
    out = set()
    for fname, qname in pairing.node_map:
        node = qnodes.get(qname)
        if node is None or node.op_type not in ops:
            continue
        reads = any(qi.producer.get(i) is not None and qi.is_dq(qi.producer[i]) for i in node.input if i)
        writes = any(any(qi.is_q(c) for c in qi.consumers.get(o, [])) for o in node.output if o)
        if reads or writes:
            out.add(fname)
    return out


def weight_records(fp32: onnx.ModelProto, qdq: onnx.ModelProto, pairing: Pairing) -> tuple[WeightRecord, ...]:
    """FP32 initializer vs dequantized integer initializer, per tensor and per channel."""
    fi, qi = GraphIndex(fp32), GraphIndex(qdq)
    out = []
    for w in pairing.weights:
        ref = fi.const_array(w.fp32)
        q = qi.const_array(w.quantized)
        scale = qi.const_array(w.scale)
        zp = qi.const_array(w.zero_point) if w.zero_point else None
        if ref is None or q is None or scale is None or ref.dtype.kind != "f":
            continue
        deq = _dequantize(q, scale, zp, w.axis)
        if deq.shape != ref.shape:
            continue
        acc = ErrorAccumulator()
        acc.update(ref, deq)
        channel = ()
        if w.axis is not None and scale.size > 1:
            channel = tuple(_channel_sqnr(ref, deq, w.axis))
        quant = QuantParams(
            scale=float(scale.ravel()[0]),
            zero_point=int(zp.ravel()[0]) if zp is not None else 0,
            qtype=str(q.dtype),
            axis=w.axis,
            channels=int(scale.size),
        )
        out.append(WeightRecord(w.fp32, w.node, acc.result(), quant, channel))
    return tuple(out)


def _dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int | None) -> np.ndarray:
    qf = q.astype(np.float64)
    z = zp.astype(np.float64) if zp is not None else np.zeros_like(scale, dtype=np.float64)
    s = scale.astype(np.float64)
    if axis is not None and s.size > 1:
        shape = [1] * q.ndim
        shape[axis] = -1
        s = s.reshape(shape)
        z = z.reshape(shape)
    return (qf - z) * s


def _channel_sqnr(ref: np.ndarray, deq: np.ndarray, axis: int) -> list[float]:
    out = []
    for c in range(ref.shape[axis]):
        acc = ErrorAccumulator()
        acc.update(np.take(ref, c, axis=axis), np.take(deq, c, axis=axis))
        out.append(acc.result().sqnr_db)
    return out
