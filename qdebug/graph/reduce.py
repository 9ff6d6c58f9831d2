"""One merged model that computes the error reductions inside ONNX Runtime.

Copying every activation out of ORT and reducing it in numpy costs more than
the inference itself (DESIGN.md measured 16-18 ms per sample of copying
alone). Instead, the reference graph and the candidate graph are put side by
side in one model (reference tensors prefixed ``r/``, candidate ``c/``, graph
inputs shared), and the model computes, per batch and per tensor:

* ``ref``: element count, ``sum(r^2)`` and, optionally, ``min``, ``max`` and
  ``sum`` of the reference (mean and variance follow from the sums);
* ``acc`` (accumulated error, reference vs candidate): with ``d = r - c``,
  ``sum(d^2)``, ``sum(c^2)``, ``max(d)`` and ``min(d)`` (``sum(r*c)`` follows
  from the three sums of squares and ``max|d|`` from the extremes, so the only
  temporary written is ``d``);
* ``local`` (the tensor's own quantization error): the same statistics for
  ``r`` against ``DequantizeLinear(QuantizeLinear(r))`` with the QDQ model's
  scale and zero-point for that tensor;
* a systematic subsample (every k-th element, about as many as the
  ``qdbg/subsample`` input asks for) of each side, which is all that leaves ORT besides the sums: the
  KL histograms and the TUI's histograms are built from it.

Each statistic is one vector output (one entry per pair of its group), so a
batch returns a handful of small arrays. The sums are float32 within a batch
and accumulated in float64 across batches by the caller, which recomputes a
pair exactly in numpy when its batch sums are not finite.

Speed and memory come from three choices, all measured on the BERT benchmark
model (docs/benchmarks.md):

* the caller passes models ORT has *already optimized* (fused, constant
  folded) and the merged model runs with optimizations off, so ORT keeps the
  node order given here; :func:`schedule` orders nodes by demand -- each
  pair's producers, then its reductions -- so a tensor dies right after it is
  reduced and peak memory is a few tensors, not every activation;
* every candidate tensor reaches the reductions through one ``Identity``:
  ORT duplicates a DequantizeLinear once per consumer, which had made it
  recompute each instrumented DQ three times;
* only ``d`` and the local error are written; everything else only reads.

Pure and deterministic: the inputs are not mutated and the same arguments give
byte-identical models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SUBSAMPLE_INPUT = "qdbg/subsample"
"""Graph input (int64 scalar): about how many elements per tensor a run copies out (every k-th element)."""

GROUPS = ("ref", "acc", "local")
"""Statistic groups of a merged model: ``ref`` (count, ref2, rmin, rmax, rsum), ``acc`` and ``local``
(noise2, cand2, dmax, dmin); see the module docstring."""


def dot_from_sums(ref2: float, cand2: float, noise2: float) -> float:
    """``sum(r*c)`` from the sums of squares: ``(sum r^2 + sum c^2 - sum (r-c)^2) / 2``."""
    return 0.5 * (ref2 + cand2 - noise2)


def moments_from_sums(n: int, total: float, total_sq: float) -> tuple[float, float]:
    """(mean, sum of squared deviations) from a count, a sum and a sum of squares (float64)."""
    mean = total / n if n else 0.0
    return mean, max(total_sq - total * mean, 0.0)


@dataclass(frozen=True, eq=False)
class FakeQuant:
    """Quantization parameters applied to a reference tensor to measure its own Q/DQ error."""

    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int | None = None
    domain: str = ""
    """Domain of the model's own Q/DQ ops (``com.microsoft`` for contrib 16-bit Q/DQ)."""


@dataclass(frozen=True, eq=False)
class PairSpec:
    """One reference tensor and what to compare it with; names as in the source models."""

    key: str
    ref: str
    """Tensor of the reference model (or a graph input)."""
    cand: str | None = None
    """Tensor of the candidate model standing for ``ref``; None: no accumulated error."""
    local: FakeQuant | None = None
    """Q/DQ applied to ``ref`` for the local error; None: the tensor is not quantized."""


@dataclass(frozen=True, eq=False)
class ReductionModel:
    """The merged model and how to read its outputs."""

    model: onnx.ModelProto
    keys: Mapping[str, tuple[str, ...]]
    """Per group (``ref``, ``acc``, ``local``): the pair keys, in output-vector order."""
    ref_outputs: Mapping[str, str]
    """Graph outputs of the reference model: merged-model name (``r/<name>``) -> original name."""
    cand_outputs: Mapping[str, str]
    samples: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per pair key: subsample output names by side (``r``, ``c``, ``l``)."""
    outputs: tuple[str, ...] = ()
    """Every graph output of the merged model, for ``session.run`` (kept when ``model`` is dropped)."""

    def stats(self, values: Mapping[str, np.ndarray]) -> dict[str, dict[str, dict[str, float]]]:
        """Group -> pair key -> statistic -> value, from one batch's outputs."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for group, keys in self.keys.items():
            names = [n for n in values if n.startswith(f"qdbg/{group}/")]
            cols = {n.rsplit("/", 1)[1]: values[n] for n in names}
            out[group] = {k: {s: float(v[i]) for s, v in cols.items()} for i, k in enumerate(keys)}
        return out


def _prefixed(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """A copy of ``model`` with every node and tensor name prefixed, the graph inputs (shared by both
    sides of the merged model; an initializer listed as an input is renamed) excepted; subgraphs
    included.

    Not ``onnx.compose.add_prefix``: it renames a subgraph before it has seen the outer graph's
    initializers, so a branch reading an outer weight kept the old name and ORT refused the merged
    model ("nodes must be topologically sorted").
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = {i.name for i in out.graph.input} - {t.name for t in out.graph.initializer}

    def rename(name: str) -> str:
        return name if not name or name in keep else prefix + name

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            if node.name:
                node.name = prefix + node.name
            for names in (node.input, node.output):
                for i, name in enumerate(names):
                    names[i] = rename(name)
            for attr in node.attribute:
                if attr.HasField("g"):
                    visit(attr.g)
                for sub in attr.graphs:
                    visit(sub)
        for info in (*graph.input, *graph.output, *graph.value_info):
            info.name = rename(info.name)
        for tensor in graph.initializer:
            tensor.name = rename(tensor.name)
        for sparse in graph.sparse_initializer:
            sparse.values.name = rename(sparse.values.name)
            sparse.indices.name = rename(sparse.indices.name)

    visit(out.graph)
    return out


def _opset_map(*models: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in models:
        for imp in m.opset_import:
            dom = "" if imp.domain == "ai.onnx" else imp.domain
            out[dom] = max(out.get(dom, 0), int(imp.version))
    return out


def compatible(ref: onnx.ModelProto, cand: onnx.ModelProto) -> bool:
    """Both models share the default-domain opset (so merging does not change either's semantics)."""
    a = {"" if i.domain == "ai.onnx" else i.domain: i.version for i in ref.opset_import}
    b = {"" if i.domain == "ai.onnx" else i.domain: i.version for i in cand.opset_import}
    return a.get("") == b.get("") and not ref.functions and not cand.functions


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type shape inference (or the graph's signature) declares."""
    out = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


class _Builder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.n = 0

    def name(self, stem: str) -> str:
        self.n += 1
        return f"qdbg/{stem}_{self.n}"

    def const(self, stem: str, value: np.ndarray) -> str:
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], stem: str, **attrs) -> str:
        out = self.name(stem)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out


def schedule(
    models: Sequence[Sequence[onnx.NodeProto]], groups: Sequence[Sequence[onnx.NodeProto]]
) -> list[onnx.NodeProto]:
    """One topological order that keeps few tensors alive.

    ``groups`` are the reduction nodes of each pair, in the order the pairs
    should be reduced. For each group, the nodes of ``models`` it needs that
    have not run yet are emitted first (in their model's order), then the
    group itself; whatever no group needs comes last. So each model advances
    only as far as the next reduction requires, and ORT (which follows this
    order when graph optimizations are off) frees a tensor as soon as its
    reductions have run.
    """
    model_nodes = [n for nodes in models for n in nodes]
    producer = {o: i for i, n in enumerate(model_nodes) for o in n.output if o}
    emitted = [False] * len(model_nodes)
    order: list[onnx.NodeProto] = []

    def need(tensor: str) -> None:
        start = producer.get(tensor)
        if start is None or emitted[start]:
            return
        stack: list[tuple[int, bool]] = [(start, False)]
        while stack:
            i, expanded = stack.pop()
            if emitted[i]:
                continue
            if expanded:
                emitted[i] = True
                order.append(model_nodes[i])
                continue
            stack.append((i, True))
            for x in reversed(_node_inputs(model_nodes[i])):
                j = producer.get(x)
                if j is not None and not emitted[j]:
                    stack.append((j, False))

    for group in groups:
        for node in group:
            for x in node.input:
                need(x)
        order.extend(group)
    for i, node in enumerate(model_nodes):
        if not emitted[i]:
            for x in _node_inputs(node):
                need(x)
            emitted[i] = True
            order.append(node)
    return order


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """Inputs of a node, including names its subgraphs read from the outer scope."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            local = {i.name for i in g.input} | {i.name for i in g.initializer}
            for sub in g.node:
                local.update(sub.output)
            for sub in g.node:
                names.extend(x for x in _node_inputs(sub) if x not in local)
    return names


class _Reductions:
    """The reduction nodes of one merged model, pair by pair: each pair's scalars go to columns (one output
    per group and statistic), its subsamples to outputs of their own, its nodes to one schedule group."""

    def __init__(
        self, ref: onnx.ModelProto, cand: onnx.ModelProto, ref_types: Mapping[str, int], cand_types: Mapping[str, int]
    ) -> None:
        b = self.b = _Builder()
        self.one = b.const("shape1", np.array([1], dtype=np.int64))
        self.minus1 = b.const("flat", np.array([-1], dtype=np.int64))
        self.zero = b.const("zero", np.array([0], dtype=np.int64))
        self.big = b.const("end", np.array([np.iinfo(np.int64).max], dtype=np.int64))
        self.one_i = b.const("one", np.array(1, dtype=np.int64))
        self.inputs = {i.name for i in ref.graph.input}
        self.types = {"r": dict(ref_types), "c": dict(cand_types)}
        self.stack_scalars = _opset_map(ref, cand).get("", 0) >= 11
        self.columns: dict[tuple[str, str], list[str]] = {}
        self.keys: dict[str, list[str]] = {g: [] for g in GROUPS}
        self.samples: dict[str, dict[str, str]] = {}
        self.groups: list[list[onnx.NodeProto]] = []

    def side(self, name: str, which: str) -> str:
        """A tensor's name in the merged model (graph inputs are shared, the rest prefixed)."""
        return name if name in self.inputs else f"{which}/{name}"

    def as_float(self, name: str, which: str) -> str:
        known = self.types[which].get(name)
        value = self.side(name, which)
        return value if known == TensorProto.FLOAT else self.b.op("Cast", [value], "f", to=TensorProto.FLOAT)

    def emit(self, group: str, key: str, stats: dict[str, str]) -> None:
        self.keys[group].append(key)
        for stat, name in stats.items():
            # scalars are stacked by one ConcatFromSequence per column (opset >= 11); a Reshape to [1]
            # per scalar before a Concat cost ~2,000 tiny kernels per run on the BERT benchmark model
            self.columns.setdefault((group, stat), []).append(
                name if self.stack_scalars else self.b.op("Reshape", [name, self.one], stat + "1")
            )

    def compare(self, rv: str, cv: str) -> dict[str, str]:
        b = self.b
        d = b.op("Sub", [rv, cv], "d")
        return {
            "noise2": b.op("ReduceSumSquare", [d], "noise2", keepdims=0),
            "cand2": b.op("ReduceSumSquare", [cv], "cand2", keepdims=0),
            "dmax": b.op("ReduceMax", [d], "dmax", keepdims=0),
            "dmin": b.op("ReduceMin", [d], "dmin", keepdims=0),
        }

    def sample(self, value: str, step: str) -> str:
        b = self.b
        return b.op("Slice", [b.op("Reshape", [value, self.minus1], "flat"), self.zero, self.big, self.zero, step], "s")

    def add(self, p: PairSpec, ref_stats: bool, with_samples: bool, reference: bool = True) -> None:
        """One pair's reductions: the reference's own statistics (``reference``), its error against the
        candidate and against its local fake-quant, and the subsamples of each."""
        b = self.b
        first = len(b.nodes)
        if not reference and p.cand is None and p.local is None:  # nothing left to compute for this pair
            self.groups.append([])
            return
        rv = self.as_float(p.ref, "r")
        size = b.op("Size", [rv], "size") if reference or with_samples else ""
        if reference:
            stats = {
                "count": b.op("Cast", [size], "count", to=TensorProto.FLOAT),
                "ref2": b.op("ReduceSumSquare", [rv], "ref2", keepdims=0),
            }
            if ref_stats:
                stats["rmin"] = b.op("ReduceMin", [rv], "rmin", keepdims=0)
                stats["rmax"] = b.op("ReduceMax", [rv], "rmax", keepdims=0)
                stats["rsum"] = b.op("ReduceSum", [rv], "rsum", keepdims=0)
            self.emit("ref", p.key, stats)
        # every (size // target + 1)-th element: at least 1 and at most ``target`` elements; Add, not Max,
        # because Max takes no int64 before opset 12. Each side is sampled right after its reductions, so
        # the candidate is freed before the local error's tensors exist (the live set is smaller).
        step = None
        if with_samples:
            k1 = b.op("Add", [b.op("Div", [size, SUBSAMPLE_INPUT], "k"), self.one_i], "k1")
            step = b.op("Reshape", [k1, self.one], "step")
            self.samples[p.key] = {}
        if p.cand is not None:
            # one consumer only: ORT would otherwise duplicate a DequantizeLinear per consumer
            cv = b.op("Identity", [self.as_float(p.cand, "c")], "c")
            self.emit("acc", p.key, self.compare(rv, cv))
            if step is not None:
                self.samples[p.key]["c"] = self.sample(cv, step)
        if p.local is not None:
            fq = _fake_quant(b, rv, p.local)
            self.emit("local", p.key, self.compare(rv, fq))
            if step is not None:
                self.samples[p.key]["l"] = self.sample(fq, step)
        if step is not None and reference:
            self.samples[p.key]["r"] = self.sample(rv, step)
        self.groups.append(b.nodes[first:])

    def stacked_outputs(self) -> list[onnx.ValueInfoProto]:
        """Stack each column into one output (its nodes come after every group in the schedule)."""
        b = self.b
        outputs = []
        for (group, stat), cols in self.columns.items():
            name = f"qdbg/{group}/{stat}"
            if self.stack_scalars:
                seq = b.op("SequenceConstruct", cols, "seq")
                b.nodes.append(helper.make_node("ConcatFromSequence", [seq], [name], name=name, axis=0, new_axis=1))
            else:
                b.nodes.append(helper.make_node("Concat", cols, [name], name=name, axis=0))
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [len(cols)]))
        for sides in self.samples.values():
            outputs.extend(onnx.ValueInfoProto(name=s) for s in sides.values())
        return outputs


def build_reduction_model(
    ref: onnx.ModelProto,
    cand: onnx.ModelProto,
    pairs: Sequence[PairSpec],
    *,
    ref_stats: bool = True,
    with_samples: bool = True,
    ref_types: Mapping[str, int] | None = None,
    cand_types: Mapping[str, int] | None = None,
    keep_outputs: tuple[Sequence[str], Sequence[str]] | None = None,
    reference: bool = True,
) -> ReductionModel:
    """Merge ``ref`` and ``cand`` and add the reductions for ``pairs`` (see module docstring).

    ``ref_types``/``cand_types`` give element types when the models lack them
    (ORT's optimized models carry few value_info); a tensor of unknown or
    non-float32 type is cast to float32 first. ``ref_stats=False`` leaves out
    the reference's min/max/sum; ``with_samples=False`` the subsamples (and the
    ``qdbg/subsample`` input). ``keep_outputs`` names the (reference,
    candidate) graph outputs to keep (default: all); instrumented models pass
    their original outputs so the tensors they expose are not copied out.
    ``reference=False`` leaves out the reference's own reductions (the ``ref`` group) and its subsamples:
    a caller that already has them from a run of the same reference over the same inputs (another
    method's capture, :class:`~qdebug.analysis.reference.SharedReference`) pays only for the
    comparisons; the reference graph still runs, as each comparison reads its tensors.
    """
    r = _prefixed(ref, "r/")
    c = _prefixed(cand, "c/")
    red = _Reductions(ref, cand, ref_types or elem_types(ref), cand_types or elem_types(cand))
    for p in pairs:
        red.add(p, ref_stats, with_samples, reference)
    tail_start = len(red.b.nodes)
    outputs = red.stacked_outputs()
    if keep_outputs is None:
        keep_outputs = ([o.name for o in ref.graph.output], [o.name for o in cand.graph.output])
    ref_outputs = {red.side(n, "r"): n for n in keep_outputs[0]}
    cand_outputs = {red.side(n, "c"): n for n in keep_outputs[1]}
    seen = {o.name for o in outputs}
    for name in [*ref_outputs, *cand_outputs]:
        if name not in seen:
            outputs.append(onnx.ValueInfoProto(name=name))
            seen.add(name)
    nodes = schedule([list(r.graph.node), list(c.graph.node)], red.groups) + red.b.nodes[tail_start:]
    graph = helper.make_graph(
        nodes,
        "qdebug_reductions",
        [*ref.graph.input]
        + ([helper.make_tensor_value_info(SUBSAMPLE_INPUT, TensorProto.INT64, [])] if with_samples else []),
        outputs,
        list(r.graph.initializer) + list(c.graph.initializer) + red.b.inits,
    )
    graph.sparse_initializer.extend(list(r.graph.sparse_initializer) + list(c.graph.sparse_initializer))
    opsets = [helper.make_opsetid(dom, ver) for dom, ver in sorted(_opset_map(ref, cand).items())]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qdebug")
    model.ir_version = max(ref.ir_version, cand.ir_version)
    return ReductionModel(
        model,
        {g: tuple(k) for g, k in red.keys.items()},
        ref_outputs,
        cand_outputs,
        red.samples,
        tuple(o.name for o in model.graph.output),
    )


def _fake_quant(b: _Builder, value: str, fq: FakeQuant) -> str:
    """``DequantizeLinear(QuantizeLinear(value))`` with ``fq``'s parameters, as ORT's QDQ model does it."""
    # the reference was cast to float32, so the scale must be too (a float16 model has float16 scales)
    scale = b.const("scale", np.asarray(fq.scale, dtype=np.float32))
    args = [scale]
    if fq.zero_point is not None:
        args.append(b.const("zp", np.asarray(fq.zero_point)))
    attrs: dict = {"axis": fq.axis} if fq.axis is not None else {}
    if fq.domain:
        attrs["domain"] = fq.domain
    q = b.op("QuantizeLinear", [value, *args], "q", **attrs)
    # one consumer, as for candidates: ORT would give each consumer its own copy of the DequantizeLinear
    return b.op("Identity", [b.op("DequantizeLinear", [q, *args], "dq", **attrs)], "fq")
