"""Layer-wise error of a QDQ model against its FP32 model, streamed batch by batch.

Three sessions, because instrumentation changes numerics (DESIGN.md):

* the FP32 model with every float intermediate as an output;
* the QDQ model, optimized as deployed, with only DequantizeLinear outputs
  (and un-quantized counterparts) exposed -- ORT keeps its integer fusions
  (QLinearConv...), so the *accumulated* error is measured on deployed kernels;
* the QDQ model un-optimized (fake-quant), exposing pre-Q and post-DQ values:
  the *local* error of each tensor's own quantization.

Each batch's tensors go into streaming accumulators and are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from qdebug.capture import SessionConfig, Tap, make_session, run_session
from qdebug.data import DataSet
from qdebug.graph.match import GraphIndex, Pairing, subgraph_tensors
from qdebug.graph.reduce import (
    PAIR_STATS,
    REF_STATS,
    PairSpec,
    build_reduction_model,
    compatible,
    dot_from_sums,
    moments_from_sums,
)
from qdebug.metrics import (
    ErrorAccumulator,
    SummaryAccumulator,
    TensorErrorAccumulator,
    grid_edges_for,
    range_edges,
)
from qdebug.records import ErrorStats, NodeRecord, NotCaptured, QuantParams, TensorRecord, WeightRecord

SQNR_CAP_DB = 120.0
"""SQNRs above this count as exact when computing the error a node introduces."""

Progress = Callable[[str, int, int | None], None]


@dataclass(frozen=True, eq=False)
class LayerErrors:
    """The per-tensor results of :func:`measure_layers`."""

    tensors: tuple[TensorRecord, ...]
    not_captured: tuple[NotCaptured, ...]
    samples: int
    deployed_gap: float
    outputs: ModelOutputs
    engine: str
    local_samples: int = 0
    """Samples that went through the fake-quant pass (local error, kernel view)."""


class _TensorAcc:
    """Accumulators of one FP32 tensor."""

    def __init__(self, quant: QuantParams | None, fallback: tuple[float, float] | None) -> None:
        edges = _edges(quant, fallback)
        self.summary = SummaryAccumulator()
        self.acc = TensorErrorAccumulator(edges)
        self.local = TensorErrorAccumulator(edges) if quant is not None else None
        self.fakequant = ErrorAccumulator() if quant is not None else None
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
        if math.isfinite(lo) and math.isfinite(hi) and self.acc.error.count == 0:
            self.acc = TensorErrorAccumulator(range_edges(lo, hi))


def _edges(quant: QuantParams | None, rng: tuple[float, float] | None) -> np.ndarray | None:
    if quant is not None and quant.scale > 0:
        return grid_edges_for(quant)
    if rng is not None and math.isfinite(rng[0]) and math.isfinite(rng[1]):
        return range_edges(rng[0], rng[1])
    return None


@dataclass(frozen=True, eq=False)
class ModelOutputs:
    """Per-batch graph outputs seen during the capture (reused as the task metric when eval == calib)."""

    reference: list[dict[str, np.ndarray]]
    deployed: list[dict[str, np.ndarray]]
    fakequant: list[dict[str, np.ndarray]]
    labels: list[np.ndarray] | None


def measure_layers(
    fp32: onnx.ModelProto,
    qdq: onnx.ModelProto,
    pairing: Pairing,
    data: DataSet,
    config: SessionConfig,
    ranges: dict[str, tuple[float, float]] | None = None,
    progress: Progress | None = None,
    *,
    engine: str = "auto",
    local_samples: int | None = None,
) -> LayerErrors:
    """Stream ``data`` through the models and accumulate every tensor's error.

    ``engine="graph"`` computes the reductions inside ORT on merged models
    (:mod:`qdebug.graph.reduce`); ``"numpy"`` copies every tensor out and reduces
    it in numpy (exact float64, slower); ``"auto"`` uses the graph engine when
    both models share an opset and every paired tensor has a known float type.
    ``local_samples`` limits the second, un-optimized fake-quant pass (local error and
    the kernel view) to the first batches covering that many samples; ``None``: all.
    """
    ranges = ranges or {}
    accs = {p.fp32: _TensorAcc(p.quant, ranges.get(p.fp32)) for p in pairing.tensors}
    skipped: dict[str, str] = {}
    types = _elem_types(fp32)
    for p in pairing.tensors:
        t = types.get(p.fp32)
        if t is not None and t not in _FLOAT_TYPES:
            skipped[p.fp32] = (
                f"{onnx.TensorProto.DataType.Name(t).lower()} tensor: not a float tensor, not scored"
            )
    scored = [p for p in pairing.tensors if p.fp32 not in skipped]
    use_graph = engine == "graph" or (
        engine == "auto" and compatible(fp32, qdq) and all(types.get(p.fp32) in _FLOAT_TYPES for p in scored)
    )
    numpy_path = _NumpyPath(fp32, qdq, scored, config)
    graph_path = _GraphPath(fp32, qdq, scored, config) if use_graph else None
    plain = Tap(qdq, [], config, optimize=True, what="quantized model")
    outputs = ModelOutputs([], [], [], [] if data.has_labels else None)
    samples = 0
    gap = 0.0
    local_done = 0
    for index, batch in enumerate(data.batches()):
        local = local_samples is None or local_done < local_samples
        if graph_path is not None:
            ref_out, dep_out, fq_out = graph_path.run(batch.feeds, accs, numpy_path, skipped, local)
        else:
            ref_out, dep_out, fq_out = numpy_path.run(batch.feeds, accs, scored, skipped, local)
        if local:
            local_done += batch.size
        if index == 0:
            gap = _deployed_gap(plain.run(batch.feeds), dep_out, plain.graph_outputs)
            del plain
        outputs.reference.append(ref_out)
        outputs.deployed.append(dep_out)
        if fq_out is not None:
            outputs.fakequant.append(fq_out)
        if outputs.labels is not None and batch.labels is not None:
            outputs.labels.append(batch.labels)
        samples += batch.size
        if progress:
            progress("capture", samples, data.n_samples)

    records = _tensor_records(fp32, pairing, accs, skipped)
    not_captured = [NotCaptured(name, reason) for name, reason in sorted(skipped.items())]
    for name, where in subgraph_tensors(fp32):
        not_captured.append(
            NotCaptured(name, f"inside {where}: ORT cannot expose subgraph tensors as graph outputs")
        )
    engine_used = "graph" if graph_path is not None else "numpy"
    return LayerErrors(tuple(records), tuple(not_captured), samples, gap, outputs, engine_used, local_done)


_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type shape inference found."""
    out = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


def _graph_outputs(values: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    return {n: values[n] for n in names if n in values}


class _NumpyPath:
    """Copy every tensor out of ORT and reduce it in float64 numpy (exact; also the NaN fallback)."""

    def __init__(
        self, fp32: onnx.ModelProto, qdq: onnx.ModelProto, scored: list, config: SessionConfig
    ) -> None:
        self.fp32, self.qdq, self.config, self.scored = fp32, qdq, config, scored
        self._taps: tuple[Tap, Tap, Tap] | None = None

    def taps(self) -> tuple[Tap, Tap, Tap]:
        """The three instrumented sessions, created on first use."""
        if self._taps is None:
            pairs = [p for p in self.scored if p.qdq is not None]
            local = [n for p in pairs if p.dequant is not None for n in (p.qdq, p.dequant)]
            self._taps = (
                Tap(self.fp32, [p.fp32 for p in self.scored], self.config, what="instrumented FP32 model"),
                Tap(
                    self.qdq,
                    [p.dequant or p.qdq for p in pairs],
                    self.config,
                    what="instrumented quantized model",
                ),
                Tap(self.qdq, local, self.config, optimize=False, what="fake-quant quantized model"),
            )
        return self._taps

    def run(self, feeds, accs: dict[str, _TensorAcc], pairs: list, skipped: dict[str, str], local: bool = True):
        """One batch through the three sessions; updates ``accs`` for ``pairs``; returns graph outputs.

        ``local=False`` skips the fake-quant session (its outputs are then None).
        """
        fp_tap, dep_tap, fq_tap = self.taps()
        f = fp_tap.run(feeds)
        d = dep_tap.run(feeds)
        for p in pairs:
            ref = f.get(p.fp32)
            if ref is None or ref.dtype.kind != "f":
                if ref is not None:
                    skipped.setdefault(p.fp32, f"{ref.dtype} tensor: not a float tensor, not scored")
                continue
            a = accs[p.fp32]
            a.summary.update(ref)
            a.ensure_edges(ref)
            if p.qdq is None:
                continue
            cand = d.get(p.dequant or p.qdq)
            if cand is None or cand.shape != ref.shape:
                skipped.setdefault(p.fp32, "quantized counterpart has another shape: not compared")
                continue
            a.acc.update(ref, cand)
        dep_out = _graph_outputs(d, dep_tap.graph_outputs)
        del d
        if not local:
            return _graph_outputs(f, fp_tap.graph_outputs), dep_out, None
        q = fq_tap.run(feeds)
        for p in pairs:
            if p.dequant is None:
                continue
            a = accs[p.fp32]
            pre, post = q.get(p.qdq), q.get(p.dequant)
            if (
                a.local is None
                or pre is None
                or post is None
                or pre.dtype.kind != "f"
                or pre.shape != post.shape
            ):
                continue
            ref = f.get(p.fp32)
            if a.fakequant is not None and ref is not None and ref.shape == post.shape:
                a.fakequant.update(ref, post)
            if p.folded is not None:
                pre = np.clip(pre, p.folded[0], p.folded[1])
            a.local.update(pre, post)
        return _graph_outputs(f, fp_tap.graph_outputs), dep_out, _graph_outputs(q, fq_tap.graph_outputs)


class _GraphPath:
    """Reductions computed inside ORT on two merged models (deployed, and fake-quant)."""

    def __init__(
        self, fp32: onnx.ModelProto, qdq: onnx.ModelProto, scored: list, config: SessionConfig
    ) -> None:
        acc_specs = [
            PairSpec(p.fp32, p.fp32, p.dequant or p.qdq or p.fp32, "r", "c" if p.qdq is not None else "r")
            for p in scored
        ]
        self.scored = scored
        self.local_pairs = [p for p in scored if p.qdq is not None and p.dequant is not None]
        local_specs = []
        for p in self.local_pairs:
            local_specs.append(PairSpec(p.fp32, p.qdq, p.dequant, "c", "c", p.folded))
            local_specs.append(PairSpec(p.fp32, p.fp32, p.dequant, "r", "c"))
        self.deployed = build_reduction_model(fp32, qdq, acc_specs)
        self.fakequant = build_reduction_model(fp32, qdq, local_specs, with_ref_stats=False)
        self.dep_sess = make_session(self.deployed.model, config, what="instrumented models", arena=False)
        self.fq_sess = make_session(
            self.fakequant.model, config, optimize=False, what="fake-quant models", arena=False
        )
        self.dep_names = [o.name for o in self.dep_sess.get_outputs()]
        self.fq_names = [o.name for o in self.fq_sess.get_outputs()]
        self.inputs = [i.name for i in self.dep_sess.get_inputs()]

    def run(
        self, feeds, accs: dict[str, _TensorAcc], numpy_path: _NumpyPath, skipped: dict[str, str], local: bool = True
    ):
        """One batch; pairs whose in-graph sums are not finite are recomputed by the numpy path.

        ``local=False`` skips the fake-quant pass (local error, kernel view); its outputs are then None.
        """
        out = run_session(self.dep_sess, self.dep_names, feeds, "the instrumented models")
        bad = []
        for i, p in enumerate(self.scored):
            col = {k: float(out[f"qdbg/out/{k}"][i]) for k in PAIR_STATS + REF_STATS}
            if not all(math.isfinite(v) for v in col.values()):
                bad.append(p)
                continue
            a = accs[p.fp32]
            n = int(col["count"])
            mean, m2 = moments_from_sums(n, col["rsum"], col["ref2"])
            a.summary.add_moments(n, mean, m2, col["rmin"], col["rmax"])
            rs, cs = self.deployed.sample_outputs[i]
            a.ensure_edges(out[rs], col["rmin"], col["rmax"])
            if p.qdq is not None:
                dot = dot_from_sums(col["ref2"], col["cand2"], col["noise2"])
                a.acc.error.add_sums(col["ref2"], col["noise2"], col["cand2"], dot, col["maxabs"], n)
                if a.acc.histogram is not None:
                    a.acc.histogram.update(out[rs], out[cs])
        ref_out = {name[2:]: out[name] for name in self.deployed.ref_outputs}
        dep_out = {name[2:]: out[name] for name in self.deployed.cand_outputs}
        del out
        if not local:
            if bad:
                numpy_path.run(feeds, accs, bad, skipped, local=False)
            return ref_out, dep_out, None
        q = run_session(self.fq_sess, self.fq_names, feeds, "the fake-quant models")
        for j, p in enumerate(self.local_pairs):
            if p in bad:
                continue
            a = accs[p.fp32]
            for k, target in ((2 * j, a.local), (2 * j + 1, a.fakequant)):
                col = {s: float(q[f"qdbg/out/{s}"][k]) for s in PAIR_STATS}
                if not all(math.isfinite(v) for v in col.values()):
                    if p not in bad:
                        bad.append(p)
                    continue
                if target is None:
                    continue
                err = target.error if isinstance(target, TensorErrorAccumulator) else target
                dot = dot_from_sums(col["ref2"], col["cand2"], col["noise2"])
                err.add_sums(col["ref2"], col["noise2"], col["cand2"], dot, col["maxabs"], int(col["count"]))
                if isinstance(target, TensorErrorAccumulator) and target.histogram is not None:
                    rs, cs = self.fakequant.sample_outputs[k]
                    target.histogram.update(q[rs], q[cs])
        fq_out = {name[2:]: q[name] for name in self.fakequant.cand_outputs}
        if bad:
            _, _, _ = numpy_path.run(feeds, accs, bad, skipped)
        return ref_out, dep_out, fq_out


KERNEL_GAP_DB = 3.0
"""Deployed-vs-fake-quant SQNR difference above which the report calls out the kernels."""


def kernel_gap_notes(tensors: tuple[TensorRecord, ...], limit: int = 3) -> list[str]:
    """Notes naming tensors where ORT's deployed integer kernels lose much more than fake-quant."""
    gaps = []
    for t in tensors:
        if t.accumulated is None or t.accumulated_fakequant is None:
            continue
        gap = t.accumulated_fakequant.sqnr_db - t.accumulated.sqnr_db
        if math.isfinite(gap) and gap > KERNEL_GAP_DB:
            gaps.append((gap, t))
    if not gaps:
        return []
    gaps.sort(key=lambda g: -g[0])
    worst = ", ".join(
        f"{t.name} ({t.accumulated.sqnr_db:.1f} dB deployed vs {t.accumulated_fakequant.sqnr_db:.1f} dB fake-quant)"
        for _, t in gaps[:limit]
    )
    return [
        f"deployed INT8 kernels lose more than the QDQ graph's own rounding explains at {len(gaps)} tensor(s), "
        f"worst: {worst}. On x86 CPUs without VNNI, u8s8 MatMul/Conv kernels can saturate 16-bit "
        "intermediates (ORT's documented U8S8 saturation): re-quantize with --weight-type QUInt8 (U8U8) or "
        "keep those nodes out of INT8"
    ]


CONCAT_RANGE_RATIO = 50.0
"""Concat inputs whose quantization ranges differ by more than this share one scale badly."""


def _qspan(t: TensorRecord) -> float:
    """Width of the range a uint8 scale must cover (min/max with 0 included, as ORT's calibration does)."""
    assert t.summary is not None
    return max(t.summary.max, 0.0) - min(t.summary.min, 0.0)


def concat_range_notes(fp32: onnx.ModelProto, tensors: tuple[TensorRecord, ...]) -> list[str]:
    """Notes naming Concat outputs whose inputs' ranges differ by > :data:`CONCAT_RANGE_RATIO`.

    One scale for the concatenated tensor is sized by the widest input, so a narrow
    input (0-1 class scores next to pixel box coordinates) keeps only a few levels.
    """
    by_name = {t.name: t for t in tensors}
    notes = []
    for node in fp32.graph.node:
        if node.op_type != "Concat" or not node.output or node.output[0] not in by_name:
            continue
        parts = [by_name[i] for i in node.input if i in by_name and by_name[i].summary is not None]
        spans = [(_qspan(t), t) for t in parts if math.isfinite(_qspan(t)) and _qspan(t) > 0]
        if len(spans) < 2:
            continue
        lo_span, small = min(spans, key=lambda x: x[0])
        hi_span = max(x[0] for x in spans)
        if hi_span <= CONCAT_RANGE_RATIO * lo_span:
            continue
        out = by_name[node.output[0]]
        detail = ""
        if out.quant is not None and out.quant.scale > 0:
            detail = (
                f"; its shared scale {out.quant.scale:.4g} leaves {small.name} about "
                f"{lo_span / out.quant.scale:.1f} quantization level(s)"
            )
        if out.local is not None:
            detail += f"; local SQNR of {out.name}: {out.local.sqnr_db:.1f} dB"
        ranges = ", ".join(f"{t.name} [{t.summary.min:.4g}, {t.summary.max:.4g}]" for t in parts if t.summary)
        notes.append(
            f"Concat {node.name} joins inputs whose ranges differ by {hi_span / lo_span:.0f}x ({ranges}): "
            f"one scale for {out.name} wipes out the small one{detail}. Keep {out.name} in float (exclude "
            f"{node.name} and its quantized neighbours), give it 16-bit activations, or concatenate after "
            "dequantizing"
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
    recurrent = ("LSTM", "GRU", "RNN")
    rnn = [n for n in fp32.graph.node if n.op_type in recurrent and n.name not in quantized_nodes]
    if rnn:
        names = ", ".join(f"{n.name} ({n.op_type})" for n in rnn)
        notes.append(
            f"recurrent node(s) {names} stay FP32: ORT's static quantizer does not quantize LSTM/GRU/RNN "
            "(quantize_dynamic turns LSTM into DynamicQuantizeLSTM); their outputs are still measured, and "
            "the error reaching them comes from upstream quantized nodes"
        )
    return notes


def _deployed_gap(
    plain: dict[str, np.ndarray], instrumented: dict[str, np.ndarray], outputs: list[str]
) -> float:
    gap = 0.0
    for name in outputs:
        a, b = plain.get(name), instrumented.get(name)
        if a is None or b is None or a.dtype.kind != "f" or a.shape != b.shape:
            continue
        gap = max(gap, float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0)
    return gap


def _tensor_records(
    fp32: onnx.ModelProto, pairing: Pairing, accs: dict[str, _TensorAcc], skipped: dict[str, str]
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
                note=p.note or skipped.get(p.fp32, ""),
                accumulated_fakequant=(
                    a.fakequant.result() if a.fakequant is not None and a.fakequant.count else None
                ),
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
) -> tuple[NodeRecord, ...]:
    """Per-node error: worst output SQNRs and the error the node introduces.

    ``introduced_db`` = accumulated SQNR at the node's worst float input minus
    at its worst float output (both capped at 120 dB, so an exact input counts
    as 120 dB). Positive: the node makes the error worse.
    """
    by_name = {t.name: t for t in tensors}
    index = GraphIndex(fp32)
    depth = node_depths(fp32)
    out = []
    for node in fp32.graph.node:
        outs = [by_name[o] for o in node.output if o in by_name]
        acc_out = _worst([t.accumulated.sqnr_db for t in outs if t.accumulated])
        acc_in = _worst([_upstream_sqnr(i, by_name, index) for i in node.input if i and i not in index.inits])
        local = _worst([t.local.sqnr_db for t in outs if t.local])
        if math.isnan(acc_out):
            introduced = added = math.nan
        else:
            in_db = SQNR_CAP_DB if math.isnan(acc_in) else acc_in
            introduced = _nsr_db(acc_out) - _nsr_db(in_db)
            delta = 10 ** (_nsr_db(acc_out) / 10) - 10 ** (_nsr_db(in_db) / 10)
            added = 10 * math.log10(delta) if delta > 0 else -math.inf
        kls = [t.local.kl for t in outs if t.local and not math.isnan(t.local.kl)]
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
            )
        )
    return tuple(out)


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
    """FP32 nodes whose QDQ counterpart reads or writes a Q/DQ tensor."""
    qi = GraphIndex(qdq)
    qnodes = {n.name: n for n in qdq.graph.node}
    out = set()
    for fname, qname in pairing.node_map:
        node = qnodes.get(qname)
        if node is None:
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


__all__ = [
    "LayerErrors",
    "concat_range_notes",
    "structure_notes",
    "measure_layers",
    "node_records",
    "quantized_node_names",
    "weight_records",
    "node_depths",
    "ErrorStats",
]
