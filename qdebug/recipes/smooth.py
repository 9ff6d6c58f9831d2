"""SmoothQuant (Xiao et al. 2023): move activation outliers into the weights of the MatMuls that read them.

A Transformer's hidden states carry a few channels 10-100x larger than the rest; a per-tensor INT8 scale
sized for them leaves the other channels a handful of levels. Since ``X @ W == (X / s) @ (s * W)`` for any
per-channel ``s`` (``s`` scaling W's rows), the outliers can be divided out of X and multiplied into W,
where the weight quantizer copes better. ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` splits the range
between the two; ``alpha`` says how much goes to the weights.

The transform inserts no node: ``1/s`` is folded into whatever computes X -- a LayerNormalization's scale
and bias, a decomposed layer norm's final ``Mul(gamma) -> Add(beta)``, or a MatMul/Gemm's weight columns
and bias -- so X itself is computed smaller and the FP32 model's outputs stay what they were. An
activation that something else reads too (the residual Add of a post-LN block) or that nothing can absorb
the division is left alone and named in a note.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from qdebug.recipes.base import Transformed
from qdebug.recipes.stats import Graph, as_float, graph_order

SCALE_MIN, SCALE_MAX = 1e-5, 1e5
"""Bounds of a smoothing factor: a channel never scaled beyond what float32 weights keep exact enough."""
NAMES_SHOWN = 5
"""Tensors a note names before it says how many more."""


@dataclass(frozen=True)
class SmoothSite:
    """An activation SmoothQuant can rescale: every reader a MatMul/Gemm with a constant weight, and a
    producer that absorbs the division."""

    tensor: str
    """The activation X (the tensor whose statistics are needed)."""
    producer: str
    """The node computing X (a LayerNormalization, the decomposed norm's Add, a MatMul/Gemm or its bias Add)."""
    readers: tuple[str, ...]
    """The MatMul/Gemm nodes reading X, whose weight rows take the outliers."""


@dataclass(frozen=True)
class _Scaled:
    """One initializer to rescale along ``axis``: by ``s`` (a reader's weight) or by ``1/s`` (the producer)."""

    name: str
    axis: int
    divide: bool


@dataclass(frozen=True)
class _Plan:
    """A site and the rewrites that smooth it."""

    site: SmoothSite
    channels: int
    readers: tuple[_Scaled, ...]
    absorbers: tuple[_Scaled, ...]
    nodes: tuple[str, ...]
    """Every node whose initializers change (the producer side and the readers)."""


def smoothable(model: onnx.ModelProto) -> list[SmoothSite]:
    """The activations :func:`smooth` would rescale, in graph order (the model is only read)."""
    plans, _ = _analyse(Graph(model))
    return [p.site for p in plans]


def smooth(model: onnx.ModelProto, act_absmax: Mapping[str, np.ndarray], *, alpha: float = 0.5) -> Transformed:
    """A copy of ``model`` with each smoothable activation divided by ``s`` and its readers' weights
    multiplied by it; ``act_absmax`` maps each site's tensor to its per-channel max |x| (last axis).

    An equivalence transform: the FP32 outputs change only by float rounding. Sites missing from
    ``act_absmax`` or whose channel count differs are left alone, with a note.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant's alpha must lie in [0, 1] (got {alpha})")
    graph = Graph(model)
    plans, skipped = _analyse(graph)
    arrays: dict[str, np.ndarray] = {}
    done: list[_Plan] = []
    for plan in plans:
        a = as_float(act_absmax, plan.site.tensor)
        if a is None or a.shape[0] != plan.channels:
            why = "no activation statistics" if a is None else "statistics of another channel count"
            skipped.append((why, plan.site.tensor))
            continue
        scales = _scales(a, _weight_absmax(graph, plan), alpha)
        for r in plan.readers:
            _rescale(graph, arrays, r, scales)
        for r in plan.absorbers:
            _rescale(graph, arrays, r, scales)
        done.append(plan)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _write(out, graph, arrays)
    changed = tuple(n.name for n in model.graph.node if any(n.name in p.nodes for p in done))
    notes = []
    if done:
        tensors = _names([p.site.tensor for p in done])
        notes.append(f"SmoothQuant (alpha={alpha:g}) rescaled {len(done)} activation(s): {tensors}")
    notes.extend(_skip_notes(graph, skipped))
    return Transformed(model=out, changed=changed, notes=tuple(notes))


def _scales(act: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)``, clamped; 1 where a channel is all zeros on either side."""
    zero = (act <= 0) | (weight <= 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.power(act, alpha) / np.power(weight, 1.0 - alpha)
    s = np.where(zero | ~np.isfinite(s), 1.0, s)
    return np.clip(s, SCALE_MIN, SCALE_MAX)


def _weight_absmax(graph: Graph, plan: _Plan) -> np.ndarray:
    """max |W_j,n| over every reader's weight row j (the readers share X's scale, as Q, K and V do)."""
    out = np.zeros(plan.channels)
    for r in plan.readers:
        w = np.abs(np.asarray(graph.array(r.name), dtype=np.float64))
        out = np.maximum(out, np.moveaxis(w, r.axis, 0).reshape(plan.channels, -1).max(axis=1))
    return out


def _rescale(graph: Graph, arrays: dict[str, np.ndarray], r: _Scaled, scales: np.ndarray) -> None:
    """Multiply (or divide) initializer ``r.name`` by ``scales`` along its axis, into ``arrays``."""
    if r.name not in arrays:
        arrays[r.name] = np.asarray(graph.array(r.name), dtype=np.float64)
    x = arrays[r.name]
    if x.size == 1 and scales.shape[0] != 1:  # a scalar gamma/beta becomes a per-channel vector, rank kept
        x = np.full((*x.shape[:-1], scales.shape[0]) if x.ndim else (scales.shape[0],), x.reshape(-1)[0])
    shape = [1] * x.ndim
    shape[r.axis] = scales.shape[0]
    arrays[r.name] = x / scales.reshape(shape) if r.divide else x * scales.reshape(shape)


def _write(model: onnx.ModelProto, graph: Graph, arrays: dict[str, np.ndarray]) -> None:
    """Replace the rewritten initializers of ``model`` in place (same names, order and dtypes)."""
    for t in model.graph.initializer:
        if t.name in arrays:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(graph.inits[t.name].data_type)
            t.CopyFrom(onnx.numpy_helper.from_array(arrays[t.name].astype(dtype), t.name))


def _analyse(graph: Graph) -> tuple[list[_Plan], list[tuple[str, str]]]:
    """Every smoothable site, and every candidate (an activation a constant-weight MatMul/Gemm reads as A)
    left alone, with why."""
    plans: list[_Plan] = []
    skipped: list[tuple[str, str]] = []
    candidates = {
        n.input[0]
        for n in graph.graph.node
        if n.input and n.input[0] not in graph.inits and _reader_weight(graph, n, n.input[0])
    }
    for tensor in graph_order(graph, candidates):
        plan = _plan(graph, tensor)
        if isinstance(plan, str):
            skipped.append((plan, tensor))
        else:
            plans.append(plan)
    return plans, skipped


def _plan(graph: Graph, tensor: str) -> _Plan | str:
    """The rewrites smoothing ``tensor``, or why it cannot be smoothed."""
    if tensor in graph.outputs:
        return "it is a graph output (scaling it would change the model's output)"
    readers = graph.readers.get(tensor, [])
    scaled = [_reader_weight(graph, node, tensor) for node, _ in readers]
    if not all(scaled):
        return "a node other than a MatMul/Gemm with a constant weight reads it too (a residual Add)"
    weights = tuple(s for s in scaled if s is not None)
    channels = {np.asarray(graph.array(w.name)).shape[w.axis] for w in weights}
    if len(channels) != 1:
        return "its readers' weights disagree on its channel count"
    k = channels.pop()
    producer = graph.producer.get(tensor)
    absorbers = _absorbers(graph, tensor, k) if producer is not None else None
    if producer is None or absorbers is None:
        return "no LayerNormalization, Mul/Add or MatMul/Gemm with constant weights computes it"
    nodes = (*absorbers[1], *(node.name for node, _ in readers))
    site = SmoothSite(tensor, producer.name, tuple(dict.fromkeys(node.name for node, _ in readers)))
    return _Plan(site, k, weights, absorbers[0], tuple(dict.fromkeys(nodes)))


def _reader_weight(graph: Graph, node: onnx.NodeProto, tensor: str) -> _Scaled | None:
    """The weight of a MatMul/Gemm reading ``tensor`` as A whose rows (the K axis) may be scaled, else None."""
    if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[0] != tensor:
        return None
    if node.op_type == "Gemm" and _int_attr(node, "transA"):
        return None
    w = graph.array(node.input[1])
    if w is None or w.ndim != 2 or not _floating(w) or not graph.only_reader(node.input[1], node):
        return None
    axis = 1 if node.op_type == "Gemm" and _int_attr(node, "transB") else 0
    return _Scaled(node.input[1], axis, divide=False)


def _absorbers(graph: Graph, tensor: str, k: int) -> tuple[tuple[_Scaled, ...], tuple[str, ...]] | None:
    """The initializers to divide by ``s`` so that the node computing ``tensor`` computes ``tensor / s``, and
    the nodes they belong to; None when the producer cannot absorb it."""
    node = graph.producer[tensor]
    if node.op_type == "LayerNormalization" and node.output[0] == tensor:
        params = [_vector(graph, name, node, k) for name in node.input[1:3] if name]
        return None if None in params else (tuple(p for p in params if p), (node.name,))
    if node.op_type in ("MatMul", "Gemm"):
        return _linear(graph, node, k)
    if node.op_type == "Mul":
        return _affine_tail(graph, node, k)
    if node.op_type != "Add":
        return None
    beta, rest = _constant_and_other(graph, node, k)
    if beta is None or rest is None or not graph.only_reader(rest, node) or rest in graph.outputs:
        return None
    inner = graph.producer.get(rest)
    if inner is None:
        return None
    if inner.op_type == "Mul":
        found = _affine_tail(graph, inner, k)
    elif inner.op_type in ("MatMul", "Gemm"):
        found = _linear(graph, inner, k)
    else:
        return None
    return None if found is None else ((*found[0], beta), (*found[1], node.name))


def _affine_tail(graph: Graph, node: onnx.NodeProto, k: int) -> tuple[tuple[_Scaled, ...], tuple[str, ...]] | None:
    """A ``Mul`` by a constant gamma (a decomposed layer norm's last-but-one step): gamma absorbs ``1/s``."""
    gamma, _ = _constant_and_other(graph, node, k)
    return None if gamma is None else ((gamma,), (node.name,))


def _linear(graph: Graph, node: onnx.NodeProto, k: int) -> tuple[tuple[_Scaled, ...], tuple[str, ...]] | None:
    """A MatMul/Gemm with a constant 2-D weight: its output columns (and a Gemm's bias C) absorb ``1/s``."""
    if len(node.input) < 2 or node.input[0] == node.input[1]:
        return None
    w = graph.array(node.input[1])
    if w is None or w.ndim != 2 or not _floating(w) or not graph.only_reader(node.input[1], node):
        return None
    axis = 0 if node.op_type == "Gemm" and _int_attr(node, "transB") else 1
    if w.shape[axis] != k:
        return None
    found = [_Scaled(node.input[1], axis, divide=True)]
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        bias = _vector(graph, node.input[2], node, k)
        if bias is None:
            return None
        found.append(bias)
    return tuple(found), (node.name,)


def _constant_and_other(graph: Graph, node: onnx.NodeProto, k: int) -> tuple[_Scaled | None, str | None]:
    """For a binary Mul/Add: its per-channel constant input (read only by it) and its other input."""
    if len(node.input) != 2:
        return None, None
    for i in (1, 0):
        v = _vector(graph, node.input[i], node, k)
        if v is not None and node.input[1 - i] not in graph.inits:
            return v, node.input[1 - i]
    return None, None


def _vector(graph: Graph, name: str, node: onnx.NodeProto, k: int) -> _Scaled | None:
    """``name`` as a per-channel constant of ``node`` along the last axis (shape [k], [1, .., k] or a
    scalar), read by no other node; None otherwise."""
    v = graph.array(name)
    if v is None or not _floating(v) or not graph.only_reader(name, node):
        return None
    if v.size == 1 or (v.ndim >= 1 and v.shape[-1] == k and v.size == k):
        return _Scaled(name, max(v.ndim, 1) - 1, divide=True)
    return None


def _floating(a: np.ndarray) -> bool:
    """Whether a weight is floating point (an integer weight cannot carry a fractional scale)."""
    return np.issubdtype(a.dtype, np.floating)


def _int_attr(node: onnx.NodeProto, name: str) -> int:
    """An integer attribute of ``node``, 0 when absent (transA/transB)."""
    return next((int(a.i) for a in node.attribute if a.name == name), 0)


def _names(tensors: list[str]) -> str:
    """Up to :data:`NAMES_SHOWN` names, then how many more."""
    shown = ", ".join(tensors[:NAMES_SHOWN])
    return shown + (f" and {len(tensors) - NAMES_SHOWN} more" if len(tensors) > NAMES_SHOWN else "")


def _skip_notes(graph: Graph, skipped: list[tuple[str, str]]) -> list[str]:
    """One note per reason an activation was left alone: the count and the first names."""
    by_reason: dict[str, list[str]] = {}
    for why, tensor in skipped:
        by_reason.setdefault(why, []).append(tensor)
    return [
        f"SmoothQuant left {len(ts)} activation(s) alone, {why}: {_names(list(graph_order(graph, ts)))}"
        for why, ts in by_reason.items()
    ]
