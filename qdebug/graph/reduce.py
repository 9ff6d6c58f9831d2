"""One merged model that computes the error reductions inside ONNX Runtime.

Copying every activation out of ORT and reducing it in numpy costs more than
the inference itself (DESIGN.md measured 16-18 ms per sample of copying
alone). Instead, the reference graph and the candidate graph are put side by
side in one model (reference tensors prefixed ``r/``, candidate ``c/``, graph
inputs shared), and for every tensor pair the model computes, per batch:

* ``sum(r^2)``, ``sum((r-c)^2)``, ``sum(c^2)``, ``max|r-c|``, element count (``sum(r*c)``
  follows from the three sums of squares, which needs no ``r*c`` temporary);
* the reference's ``min``, ``max`` and ``sum`` (mean and variance follow from the sums);
* a systematic subsample (every k-th element, at most ~``SUBSAMPLE`` per tensor
  per batch) of both sides, which is all that leaves ORT: the KL histograms and
  the TUI's histograms are built from it.

Each statistic is one vector output (one entry per pair), so a batch returns a
handful of small arrays. The sums are float32 within a batch and accumulated
in float64 across batches. A pair whose batch sums are not finite (NaN/Inf in
the data) is recomputed exactly by the caller's numpy path.

Pure and deterministic: the inputs are not mutated and the same arguments give
byte-identical models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SUBSAMPLE = 4096
"""Elements per tensor per batch copied out for histograms (every k-th element)."""

PAIR_STATS = ("ref2", "noise2", "cand2", "maxabs", "count")
REF_STATS = ("rmin", "rmax", "rsum")


def dot_from_sums(ref2: float, cand2: float, noise2: float) -> float:
    """``sum(r*c)`` from the sums of squares: ``(sum r^2 + sum c^2 - sum (r-c)^2) / 2``."""
    return 0.5 * (ref2 + cand2 - noise2)


def moments_from_sums(n: int, total: float, total_sq: float) -> tuple[float, float]:
    """(mean, sum of squared deviations) from a count, a sum and a sum of squares (float64)."""
    mean = total / n if n else 0.0
    return mean, max(total_sq - total * mean, 0.0)


@dataclass(frozen=True)
class PairSpec:
    """One (reference, candidate) pair to reduce; names as in the source models."""

    key: str
    ref: str
    cand: str
    ref_side: str
    """``r`` when ``ref`` lives in the reference model, ``c`` when in the candidate model."""
    cand_side: str = "c"
    clip: tuple[float, float] | None = None
    """Bounds applied to the reference first (a Relu/Clip ORT folded into the quantization)."""


@dataclass(frozen=True, eq=False)
class ReductionModel:
    """The merged model and how to read its outputs."""

    model: onnx.ModelProto
    pairs: tuple[PairSpec, ...]
    ref_outputs: tuple[str, ...]
    """Graph outputs of the reference model, as named in the merged model (``r/<name>``)."""
    cand_outputs: tuple[str, ...]
    sample_outputs: tuple[tuple[str, str], ...]
    """Per pair: the (reference, candidate) subsample output names."""


def _prefixed(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    return onnx.compose.add_prefix(model, prefix, rename_inputs=False)


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
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def op(self, op_type: str, inputs: Sequence[str], stem: str, **attrs) -> str:
        out = self.name(stem)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out


def _interleave(
    rnodes: list[onnx.NodeProto], cnodes: list[onnx.NodeProto], extra: list[onnx.NodeProto]
) -> list[onnx.NodeProto]:
    """One topological order that keeps few tensors alive.

    Appending the reductions after both models would keep every activation of
    both models alive until the end (peak memory = all activations). Instead the
    two models advance in step (merged by their relative position) and each
    reduction node is placed as soon as its inputs exist, so ORT can free a
    tensor right after its pair is reduced.
    """
    base = sorted(
        [(i / max(len(rnodes), 1), 0, i, n) for i, n in enumerate(rnodes)]
        + [(j / max(len(cnodes), 1), 1, j, n) for j, n in enumerate(cnodes)],
        key=lambda t: (t[0], t[1], t[2]),
    )
    produced_by_extra = {o for n in extra for o in n.output}
    waiting: dict[str, list[int]] = {}
    missing: list[int] = []
    for k, n in enumerate(extra):
        deps = {i for i in n.input if i}
        missing.append(len(deps))
        for d in deps:
            waiting.setdefault(d, []).append(k)
    order: list[onnx.NodeProto] = []
    ready = [k for k, m in enumerate(missing) if m == 0]
    available: set[str] = set()

    def release(name: str) -> None:
        if name in available:
            return
        available.add(name)
        for k in waiting.get(name, []):
            missing[k] -= 1
            if missing[k] == 0:
                ready.append(k)

    def drain() -> None:
        while ready:
            k = ready.pop()
            order.append(extra[k])
            for o in extra[k].output:
                release(o)

    # graph inputs and initializers (not produced by any node) are available from the start
    produced = {o for n in rnodes + cnodes for o in n.output} | produced_by_extra
    for name in list(waiting):
        if name not in produced:
            release(name)
    drain()
    for *_, node in base:
        order.append(node)
        for o in node.output:
            release(o)
        drain()
    return order


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    out = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


def build_reduction_model(
    ref: onnx.ModelProto,
    cand: onnx.ModelProto,
    pairs: Sequence[PairSpec],
    *,
    subsample: int = SUBSAMPLE,
    with_ref_stats: bool = True,
) -> ReductionModel:
    """Merge ``ref`` and ``cand`` and add the reductions for ``pairs`` (see module docstring)."""
    r = _prefixed(ref, "r/")
    c = _prefixed(cand, "c/")
    b = _Builder()
    one = b.const("shape1", np.array([1], dtype=np.int64))
    minus1 = b.const("flat", np.array([-1], dtype=np.int64))
    zero = b.const("zero", np.array([0], dtype=np.int64))
    big = b.const("end", np.array([np.iinfo(np.int64).max], dtype=np.int64))
    target = b.const("target", np.array(subsample, dtype=np.int64))
    one_i = b.const("one", np.array(1, dtype=np.int64))
    inputs = {i.name for i in ref.graph.input}

    def side(name: str, which: str) -> str:
        return name if name in inputs else f"{which}/{name}"

    columns: dict[str, list[str]] = {s: [] for s in PAIR_STATS + REF_STATS}
    samples = []
    ref_types = _elem_types(ref)
    cand_types = _elem_types(cand)

    def as_float(name: str, which: str, original: str) -> str:
        known = (ref_types if which == "r" else cand_types).get(original)
        return name if known == TensorProto.FLOAT else b.op("Cast", [name], "f", to=TensorProto.FLOAT)

    for p in pairs:
        rv = as_float(side(p.ref, p.ref_side), p.ref_side, p.ref)
        cv = as_float(side(p.cand, p.cand_side), p.cand_side, p.cand)
        if p.clip is not None:
            lo, hi = p.clip
            if np.isfinite(lo):
                rv = b.op("Max", [rv, b.const("lo", np.array(lo, dtype=np.float32))], "clip")
            if np.isfinite(hi):
                rv = b.op("Min", [rv, b.const("hi", np.array(hi, dtype=np.float32))], "clip")
        d = b.op("Sub", [rv, cv], "d")
        # sum(r*c) is derived from the three sums of squares (no r*c temporary); see ReductionModel docs
        stats = {
            "ref2": b.op("ReduceSumSquare", [rv], "ref2", keepdims=0),
            "noise2": b.op("ReduceSumSquare", [d], "noise2", keepdims=0),
            "cand2": b.op("ReduceSumSquare", [cv], "cand2", keepdims=0),
            "maxabs": b.op("ReduceMax", [b.op("Abs", [d], "ad")], "maxabs", keepdims=0),
        }
        size = b.op("Size", [rv], "size")
        stats["count"] = b.op("Cast", [size], "count", to=TensorProto.FLOAT)
        if with_ref_stats:
            stats["rmin"] = b.op("ReduceMin", [rv], "rmin", keepdims=0)
            stats["rmax"] = b.op("ReduceMax", [rv], "rmax", keepdims=0)
            stats["rsum"] = b.op("ReduceSum", [rv], "rsum", keepdims=0)
        for key, name in stats.items():
            columns[key].append(b.op("Reshape", [name, one], key + "1"))
        step = b.op("Reshape", [b.op("Max", [b.op("Div", [size, target], "k"), one_i], "k1"), one], "step")
        rflat = b.op("Reshape", [rv, minus1], "rflat")
        cflat = b.op("Reshape", [cv, minus1], "cflat")
        samples.append(
            (
                b.op("Slice", [rflat, zero, big, zero, step], "rs"),
                b.op("Slice", [cflat, zero, big, zero, step], "cs"),
            )
        )
    outputs = []
    for key, cols in columns.items():
        if not cols:
            continue
        name = f"qdbg/out/{key}"
        b.nodes.append(helper.make_node("Concat", cols, [name], name=name, axis=0))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [len(cols)]))
    for rs, cs in samples:
        outputs.append(onnx.ValueInfoProto(name=rs))
        outputs.append(onnx.ValueInfoProto(name=cs))
    ref_outputs = tuple(o.name for o in r.graph.output)
    cand_outputs = tuple(o.name for o in c.graph.output)
    for o in list(r.graph.output) + list(c.graph.output):
        outputs.append(onnx.ValueInfoProto(name=o.name))
    graph = helper.make_graph(
        _interleave(list(r.graph.node), list(c.graph.node), b.nodes),
        "qdebug_reductions",
        list(ref.graph.input),
        outputs,
        list(r.graph.initializer) + list(c.graph.initializer) + b.inits,
    )
    graph.sparse_initializer.extend(list(r.graph.sparse_initializer) + list(c.graph.sparse_initializer))
    opsets = [helper.make_opsetid(dom, ver) for dom, ver in sorted(_opset_map(ref, cand).items())]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="qdebug")
    model.ir_version = max(ref.ir_version, cand.ir_version)
    return ReductionModel(model, tuple(pairs), ref_outputs, cand_outputs, tuple(samples))
