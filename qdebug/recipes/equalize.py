"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization Through Weight Equalization and Bias
Correction", section 4.1).

Per-tensor INT8 gives every output channel of a weight the same step; when one channel's weights span 100x
the range of another's, the small channel keeps only a few levels. For ``Conv1 -> act -> Conv2`` with an
activation that commutes with positive scaling (``relu(x * s) == relu(x) * s`` for ``s > 0``; LeakyRelu and
PRelu too, whatever their slopes), dividing Conv1's output channel ``i`` by ``s_i`` and multiplying Conv2's
input channel ``i`` by ``s_i`` leaves the FP32 outputs unchanged. ``s_i = sqrt(r1_i / r2_i)`` makes both
ranges ``sqrt(r1_i * r2_i)``, which is what evens out the channels of each weight.

:func:`relax_relu6` is the paper's ReLU6 -> ReLU replacement (its section 5.1 does the same to MobileNetV2):
not equivalent where an activation exceeds 6, so the caller checks it on the user's data.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from qdebug.recipes.base import Transformed
from qdebug.recipes.fold import (
    attr,
    copy_model,
    drop_unread_initializers,
    first,
    named,
    producer_map,
    read_counts,
    set_initializer,
    sole_initializer,
)

CONVERGED = 1e-3
"""A pass whose largest ``|log s_i|`` is below this changed nothing worth another pass."""
NOT_COMMUTING = frozenset(
    "Clip HardSwish HardSigmoid Sigmoid Tanh Elu Selu Celu Gelu Softplus Softsign Mish ThresholdedRelu "
    "Relu LeakyRelu PRelu".split()
)
"""Activations a user would expect equalization to pass; those not in ``through`` are named in a note."""


@dataclass(frozen=True)
class _Pair:
    """Two Convs equalized together: Conv1's output channels are Conv2's input channels."""

    conv1: str
    conv2: str
    w1: str
    b1: str | None
    w2: str
    depthwise2: bool
    """Conv2 is depthwise: its input channel ``i`` is its output channel ``i`` (axis 0 of its weight)."""


def equalize(
    model: onnx.ModelProto,
    *,
    iterations: int = 20,
    through: Collection[str] = ("Relu", "LeakyRelu", "PRelu"),
) -> Transformed:
    """A copy of ``model`` with every ``Conv -> [activation in through] -> Conv`` chain equalized.

    Chains of three or more Convs share weights between pairs, so the pairs are rescaled in passes until
    no scale moves by more than 0.1 % (or ``iterations`` passes): each pass keeps the FP32 outputs as they
    were. Pairs held apart by an activation that does not commute with scaling are named in a note.
    """
    if iterations < 1:
        raise ValueError(f"iterations must be at least 1, not {iterations}")
    out = copy_model(model)
    graph = out.graph
    pairs, blocked = _find_pairs(graph, set(through))
    notes = _blocked_note(blocked)
    if not pairs:
        return Transformed(model=out, notes=notes)
    inits = {t.name: t for t in graph.initializer}
    names = sorted({n for p in pairs for n in (p.w1, p.b1, p.w2) if n})
    arrays = {n: numpy_helper.to_array(inits[n]).astype(np.float64) for n in names}
    before = _widest_spread(pairs, arrays)
    moved: set[int] = set()
    largest = 0.0
    for _ in range(iterations):
        steps = [_equalize_pair(pair, arrays) for pair in pairs]
        moved |= {i for i, step in enumerate(steps) if step > 0}
        largest = max(largest, *steps)
        if max(steps) < CONVERGED:
            break
    if largest < CONVERGED:
        balanced = "cross-layer equalization found the Conv pairs' channel ranges already balanced"
        return Transformed(model=out, notes=(*notes, balanced))
    for n in names:
        set_initializer(graph, n, arrays[n].astype(numpy_helper.to_array(inits[n]).dtype))
    done = [pairs[i] for i in sorted(moved)]
    changed = {c for p in done for c in (p.conv1, p.conv2)}
    shown = ", ".join(first(f"'{p.conv1}'->'{p.conv2}'" for p in done))
    after = _widest_spread(pairs, arrays)
    summary = (
        f"cross-layer equalization rescaled {len(done)} Conv pair(s) ({shown}); the widest spread of a rescaled "
        f"Conv's per-channel weight ranges (largest / median) went from {before:.3g} to {after:.3g}"
    )
    order = tuple(n.name for n in graph.node if n.name in changed)
    return Transformed(model=out, changed=order, notes=(summary, *notes))


def _find_pairs(graph: onnx.GraphProto, through: set[str]) -> tuple[list[_Pair], list[str]]:
    """The Conv pairs that can be equalized, in graph order, and those an activation holds apart."""
    counts = read_counts(graph)
    readers = _reader_map(graph)
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input}
    inits = {t.name: t for t in graph.initializer}
    pairs: list[_Pair] = []
    blocked: list[str] = []
    for conv1 in graph.node:
        if not _is_conv(conv1):
            continue
        act, conv2 = _next_conv(conv1, readers, counts, outputs)
        if conv2 is None:
            continue
        if act is not None and act.op_type not in through:
            if act.op_type in NOT_COMMUTING:
                blocked.append(f"'{conv1.name}'->'{conv2.name}' ({act.op_type})")
            continue
        pair = _pair(conv1, conv2, counts, inits, inputs)
        if pair is not None:
            pairs.append(pair)
    return pairs, blocked


def _next_conv(
    conv1: onnx.NodeProto,
    readers: dict[str, list[onnx.NodeProto]],
    counts: Counter[str],
    outputs: set[str],
) -> tuple[onnx.NodeProto | None, onnx.NodeProto | None]:
    """The (activation or None, Conv) that alone reads ``conv1``'s output; (None, None) when there is none."""
    y = conv1.output[0]
    nxt = _sole_reader(y, readers, counts, outputs)
    if nxt is None:
        return None, None
    if _is_conv(nxt):
        return None, nxt if nxt.input[0] == y else None
    if len(nxt.input) < 1 or nxt.input[0] != y or len(nxt.output) != 1:
        return None, None
    conv2 = _sole_reader(nxt.output[0], readers, counts, outputs)
    if conv2 is None or not _is_conv(conv2) or conv2.input[0] != nxt.output[0]:
        return None, None
    return nxt, conv2


def _pair(
    conv1: onnx.NodeProto,
    conv2: onnx.NodeProto,
    counts: Counter[str],
    inits: dict[str, onnx.TensorProto],
    inputs: set[str],
) -> _Pair | None:
    """The pair when both weights (and Conv1's bias) are constants only their Conv reads and the groups fit."""
    w1 = sole_initializer(conv1, 1, counts, inits, inputs)
    w2 = sole_initializer(conv2, 1, counts, inits, inputs)
    has_b1 = len(conv1.input) > 2 and bool(conv1.input[2])
    b1 = sole_initializer(conv1, 2, counts, inits, inputs) if has_b1 else None
    if w1 is None or w2 is None or (has_b1 and b1 is None) or len(w1.dims) < 3 or len(w2.dims) != len(w1.dims):
        return None
    m = w1.dims[0]
    g1, g2 = attr(conv1, "group", 1), attr(conv2, "group", 1)
    if not (g1 == 1 or (g1 == m and w1.dims[1] == 1)):
        return None
    plain2 = g2 == 1 and w2.dims[1] == m
    depthwise2 = g2 == m and w2.dims[0] == m and w2.dims[1] == 1
    if not (plain2 or depthwise2):
        return None
    b1_name = b1.name if b1 is not None else None
    return _Pair(conv1.name, conv2.name, w1.name, b1_name, w2.name, depthwise2 and not plain2)


def _equalize_pair(pair: _Pair, arrays: dict[str, np.ndarray]) -> float:
    """Rescale one pair's channels in ``arrays``; the largest ``|log s_i|`` it applied (0: nothing moved)."""
    w1, w2 = arrays[pair.w1], arrays[pair.w2]
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1)
    axis2 = 0 if pair.depthwise2 else 1
    r2 = np.abs(np.moveaxis(w2, axis2, 0)).reshape(w2.shape[axis2], -1).max(axis=1)
    ok = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
    s = np.ones_like(r1)
    s[ok] = np.sqrt(r1[ok] / r2[ok])
    step = float(np.abs(np.log(s)).max(initial=0.0))
    if step == 0.0:
        return 0.0
    shape1 = (-1,) + (1,) * (w1.ndim - 1)
    arrays[pair.w1] = w1 / s.reshape(shape1)
    if pair.b1 is not None:
        arrays[pair.b1] = arrays[pair.b1] / s
    shape2 = [1] * w2.ndim
    shape2[axis2] = -1
    arrays[pair.w2] = w2 * s.reshape(shape2)
    return step


def _widest_spread(pairs: list[_Pair], arrays: dict[str, np.ndarray]) -> float:
    """The largest :func:`range_spread` among the Convs whose output channels the pairs rescale (each pair's
    Conv1). A chain's last Conv is left out: CLE rescales its input channels only, so its own spread is
    whatever it was, and a max/min ratio would let one near-zero channel hide the gain."""
    return max((_spread(_channel_ranges(arrays[n])) for n in dict.fromkeys(p.w1 for p in pairs)), default=1.0)

def _channel_ranges(w: np.ndarray) -> np.ndarray:
    """Each output channel's largest absolute weight (axis 0 of a Conv weight)."""
    return np.abs(w.astype(np.float64)).reshape(w.shape[0], -1).max(axis=1)


def range_spread(model: onnx.ModelProto) -> dict[str, float]:
    """Each Conv with a constant weight -> max over its output channels / median over them of the channels'
    largest absolute weight: how many times wider per-tensor INT8's step is than the typical channel needs."""
    inits = {t.name: t for t in model.graph.initializer}
    spread: dict[str, float] = {}
    for node in model.graph.node:
        if not _is_conv(node) or len(node.input) < 2 or node.input[1] not in inits:
            continue
        spread[node.name or node.output[0]] = _spread(_channel_ranges(numpy_helper.to_array(inits[node.input[1]])))
    return spread


def _spread(ranges: np.ndarray) -> float:
    """max / median of per-channel ranges; 1 for an all-zero weight, inf when most channels are zero."""
    med, top = float(np.median(ranges)), float(ranges.max(initial=0.0))
    return top / med if med > 0 else (math.inf if top > 0 else 1.0)


def relax_relu6(model: onnx.ModelProto) -> Transformed:
    """A copy of ``model`` whose ``Clip(min=0, max=6)`` between two Convs are Relu, so :func:`equalize` can
    rescale through them. NOT equivalent where an activation exceeds 6: check the result on data.

    The Relu keeps the Clip's name; the bounds it no longer reads (initializers, Constant nodes) go.
    """
    out = copy_model(model)
    graph = out.graph
    opset = _opset(out)
    counts = read_counts(graph)
    readers = _reader_map(graph)
    producers = producer_map(graph)
    outputs = {o.name for o in graph.output}
    changed: list[str] = []
    bounds: list[str] = []
    for node in graph.node:
        if node.op_type != "Clip" or node.domain not in ("", "ai.onnx") or not node.output:
            continue
        src = producers.get(node.input[0])
        nxt = _sole_reader(node.output[0], readers, counts, outputs)
        if src is None or not _is_conv(src) or nxt is None or not _is_conv(nxt) or nxt.input[0] != node.output[0]:
            continue
        if _clip_bounds(node, opset, graph, producers) != (0.0, 6.0):
            continue
        bounds.extend(i for i in node.input[1:] if i)
        node.CopyFrom(onnx.helper.make_node("Relu", [node.input[0]], [node.output[0]], name=node.name))
        changed.append(node.name)
    if not changed:
        return Transformed(model=out)
    removed = _drop_unread_constants(graph, bounds)
    drop_unread_initializers(graph, bounds)
    note = (
        f"replaced {len(changed)} Clip(0, 6) between Convs by Relu ({', '.join(named(changed))}) so that "
        "equalization can rescale through them; outputs change wherever an activation there exceeds 6"
    )
    return Transformed(model=out, changed=tuple(changed), removed=removed, notes=(note,))


def _clip_bounds(
    node: onnx.NodeProto, opset: int, graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]
) -> tuple[float, float] | None:
    """A Clip's (min, max): attributes before opset 11, constant inputs since; None when not constant."""
    if opset < 11:
        return float(attr(node, "min", -math.inf)), float(attr(node, "max", math.inf))
    found: list[float] = []
    for i, default in ((1, -math.inf), (2, math.inf)):
        if len(node.input) <= i or not node.input[i]:
            found.append(default)
            continue
        value = _constant(node.input[i], graph, producers)
        if value is None or value.size != 1:
            return None
        found.append(float(value.reshape(())))
    return found[0], found[1]


def _constant(name: str, graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> np.ndarray | None:
    """The value of tensor ``name`` when an initializer or a Constant node holds it (and no input overrides)."""
    if name in {i.name for i in graph.input}:
        return None
    for t in graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    node = producers.get(name)
    if node is None or node.op_type != "Constant":
        return None
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_float", "value_int"):
            return np.asarray(onnx.helper.get_attribute_value(a))
    return None


def _drop_unread_constants(graph: onnx.GraphProto, names: list[str]) -> tuple[str, ...]:
    """Remove the Constant nodes producing ``names`` that nothing reads any more; their names."""
    counts = read_counts(graph)
    outputs = {o.name for o in graph.output}
    gone = [
        n
        for n in graph.node
        if n.op_type == "Constant" and n.output[0] in names and not counts[n.output[0]] and n.output[0] not in outputs
    ]
    removed = tuple(n.name or n.output[0] for n in gone)
    for n in gone:
        graph.node.remove(n)
    return removed


def _blocked_note(blocked: list[str]) -> tuple[str, ...]:
    """The note naming pairs an activation that does not commute with scaling holds apart."""
    if not blocked:
        return ()
    return (
        f"cross-layer equalization left {len(blocked)} Conv pair(s) alone because the activation between them "
        f"does not commute with per-channel scaling: {', '.join(first(blocked))}",
    )


def _is_conv(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is an ONNX Conv (not a contrib or quantized one)."""
    return node.op_type == "Conv" and node.domain in ("", "ai.onnx") and len(node.input) >= 2


def _reader_map(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """The top-level nodes reading each tensor."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in dict.fromkeys(n.input):
            if i:
                readers.setdefault(i, []).append(n)
    return readers


def _sole_reader(
    name: str, readers: dict[str, list[onnx.NodeProto]], counts: Counter[str], outputs: set[str]
) -> onnx.NodeProto | None:
    """The one node reading ``name`` once, when nothing else reads it (subgraphs, graph outputs); else None."""
    found = readers.get(name, [])
    if len(found) != 1 or counts[name] != 1 or name in outputs:
        return None
    return found[0]


def _opset(model: onnx.ModelProto) -> int:
    """The model's default-domain opset (Clip's bounds moved from attributes to inputs in opset 11)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
