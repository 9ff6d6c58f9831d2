"""BatchNormalization folded into the Conv that feeds it.

An inference-mode BatchNormalization is a per-channel affine map, so the Conv before it can absorb it:
``W' = W * gamma / sqrt(var + eps)`` per output channel and ``b' = (b - mean) * gamma / sqrt(var + eps) + beta``.
Left in the graph, ORT's quantizer puts the BN between Q/DQ pairs (quantized twice, run as a float kernel);
ORT's documented ``quant_pre_process`` folds it with its graph optimizer, which renames nodes. Here the
Conv keeps its name and takes the BN's output name, so the user's ``nodes_to_exclude`` and everything
downstream still match.

The small graph helpers at the bottom (:func:`read_counts`, :func:`fresh_name`, ...) are shared with
:mod:`qdebug.recipes.equalize`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from qdebug.recipes.base import Transformed

DEFAULT_EPSILON = 1e-5
"""BatchNormalization's ``epsilon`` when the attribute is absent (the ONNX default)."""
FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
"""Weight element types a transform rewrites (others, bfloat16 or quantized, are left alone)."""
MAX_NAMED = 5
"""Nodes a note names before it says "and N more" (a note is one line)."""


@dataclass(frozen=True)
class _Fold:
    """One BatchNormalization that can be folded: the Conv before it and the arrays involved."""

    conv: onnx.NodeProto
    bn: onnx.NodeProto
    weight: np.ndarray
    bias: np.ndarray | None


def fold_batchnorm(model: onnx.ModelProto) -> Transformed:
    """A copy of ``model`` with every foldable inference-mode BatchNormalization folded into its Conv.

    A BN is folded when its input is a Conv's (or ConvTranspose's) output that nothing else reads and that
    is no graph output, and the Conv's weight (and bias) are initializers only that Conv reads -- otherwise
    rewriting them would change another node too. Two BNs in a row both fold (the maps are kept up to date
    after each fold). Each BN left in place is named in a note with the reason.
    """
    out = copy_model(model)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    producers = producer_map(graph)
    counts = read_counts(graph)
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input}
    folded: list[str] = []
    removed: list[str] = []
    skipped: dict[str, list[str]] = {}
    for bn in [n for n in graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]:
        found = _foldable(bn, producers, counts, outputs, inputs, inits)
        if isinstance(found, str):
            skipped.setdefault(found, []).append(bn.name or bn.output[0])
            continue
        gone = [*bn.input[1:5], bn.input[0]]
        removed.append(bn.name or bn.output[0])
        folded.append(found.conv.name or found.conv.output[0])
        _apply(graph, found, inits, counts)
        producers[bn.output[0]] = found.conv  # a BN right after this one folds into the same Conv
        drop_unread_initializers(graph, gone)
        drop_dangling_value_info(graph, gone)
        inits = {t.name: t for t in graph.initializer}  # the new bias, if one was added
    if not folded:
        return Transformed(model=out, notes=_skip_notes(skipped))
    notes = (
        f"folded {len(removed)} BatchNormalization node(s) into the Conv before each "
        f"({', '.join(named(removed))}); the Convs keep their names",
        *_skip_notes(skipped),
    )
    return Transformed(model=out, changed=tuple(dict.fromkeys(folded)), removed=tuple(removed), notes=notes)


def _foldable(
    bn: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    counts: Counter[str],
    outputs: set[str],
    inputs: set[str],
    inits: dict[str, onnx.TensorProto],
) -> _Fold | str:
    """The fold of ``bn``, or why it cannot be folded (a phrase for the note)."""
    if attr(bn, "training_mode", 0) or any(o for o in bn.output[1:]) or not attr(bn, "spatial", 1):
        return "it runs in training mode (or per activation, spatial=0)"
    conv = producers.get(bn.input[0])
    if conv is None or conv.op_type not in ("Conv", "ConvTranspose") or conv.domain not in ("", "ai.onnx"):
        return "its input is not a Conv's output"
    if counts[bn.input[0]] != 1 or bn.input[0] in outputs:
        return "the Conv's output is also read elsewhere"
    params = [inits.get(n) for n in bn.input[1:5]]
    if len(params) != 4 or any(p is None or p.data_type not in FLOAT_TYPES for p in params) or any(
        n in inputs for n in bn.input[1:5]
    ):
        return "its scale, bias, mean or variance is not a float constant"
    weight = sole_initializer(conv, 1, counts, inits, inputs)
    bias = sole_initializer(conv, 2, counts, inits, inputs) if len(conv.input) > 2 and conv.input[2] else None
    if weight is None or (len(conv.input) > 2 and conv.input[2] and bias is None):
        return "the Conv's weight or bias is not a float constant read by that Conv only"
    w = numpy_helper.to_array(weight)
    if w.ndim < 3 or any(numpy_helper.to_array(p).shape != (_out_channels(conv, w),) for p in params):  # type: ignore[arg-type]
        return "its channel count does not match the Conv's"
    return _Fold(conv, bn, w, numpy_helper.to_array(bias) if bias is not None else None)


def _apply(graph: onnx.GraphProto, fold: _Fold, inits: dict[str, onnx.TensorProto], counts: Counter[str]) -> None:
    """Rewrite the Conv's weight and bias in place of the BN and remove the BN from ``graph``."""
    gamma, beta, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in fold.bn.input[1:5])
    eps = attr(fold.bn, "epsilon", DEFAULT_EPSILON)
    scale = gamma / np.sqrt(var + eps)
    w = _scale_outputs(fold.conv, fold.weight.astype(np.float64), scale)
    b = fold.bias.astype(np.float64) if fold.bias is not None else np.zeros_like(scale)
    b = (b - mean) * scale + beta
    conv = fold.conv
    set_initializer(graph, conv.input[1], w.astype(fold.weight.dtype))
    if fold.bias is not None:
        set_initializer(graph, conv.input[2], b.astype(fold.bias.dtype))
    else:
        name = fresh_name(graph, f"{conv.input[1]}_bias")
        graph.initializer.append(numpy_helper.from_array(b.astype(fold.weight.dtype), name))
        while len(conv.input) < 3:
            conv.input.append("")
        conv.input[2] = name
        counts[name] += 1
    for n in fold.bn.input:
        counts[n] -= 1
    conv.output[0] = fold.bn.output[0]
    graph.node.remove(fold.bn)


def _out_channels(conv: onnx.NodeProto, w: np.ndarray) -> int:
    """A Conv's output channels: axis 0 of its weight; a ConvTranspose's: axis 1 times ``group``."""
    return w.shape[0] if conv.op_type == "Conv" else w.shape[1] * attr(conv, "group", 1)


def _scale_outputs(conv: onnx.NodeProto, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``w`` with output channel ``o`` multiplied by ``scale[o]``. A ConvTranspose's weight is
    ``(C_in, C_out / group, k...)``, its output channel ``o`` being ``(o // (C_out / group), o % (C_out / group))``
    over (group, axis 1)."""
    if conv.op_type == "Conv":
        return w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    group = attr(conv, "group", 1)
    grouped = w.reshape(group, w.shape[0] // group, *w.shape[1:])
    return (grouped * scale.reshape(group, 1, w.shape[1], *(1,) * (w.ndim - 2))).reshape(w.shape)


def _skip_notes(skipped: dict[str, list[str]]) -> tuple[str, ...]:
    """One note per reason BatchNormalization nodes were left in place."""
    return tuple(
        f"BatchNormalization {', '.join(named(names))} left in place: {why}" for why, names in skipped.items()
    )


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A deep copy: transforms rewrite the copy, never the caller's model."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    """The value of ``node``'s attribute ``name``, or ``default`` when absent."""
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs ``node``'s attributes hold (If branches, Loop/Scan bodies)."""
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _all_inputs(nodes: Iterable[onnx.NodeProto]) -> Iterator[str]:
    """Every input name of ``nodes`` and of the nodes in their subgraphs (which read outer names too)."""
    for n in nodes:
        yield from (i for i in n.input if i)
        for g in _subgraphs(n):
            yield from _all_inputs(g.node)
            yield from (o.name for o in g.output)


def read_counts(graph: onnx.GraphProto) -> Counter[str]:
    """How many node inputs read each tensor, subgraphs included (a tensor read once is safe to rewrite)."""
    return Counter(_all_inputs(graph.node))


def producer_map(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """The node producing each tensor of ``graph``."""
    return {o: n for n in graph.node for o in n.output if o}


def sole_initializer(
    node: onnx.NodeProto,
    index: int,
    counts: Counter[str],
    inits: dict[str, onnx.TensorProto],
    inputs: set[str],
) -> onnx.TensorProto | None:
    """``node``'s input ``index`` when it is a float initializer only ``node`` reads (so rewriting it changes
    nothing else) and no graph input can override it; else None."""
    if len(node.input) <= index:
        return None
    name = node.input[index]
    t = inits.get(name)
    if t is None or t.data_type not in FLOAT_TYPES or name in inputs or counts[name] != 1:
        return None
    return t


def set_initializer(graph: onnx.GraphProto, name: str, value: np.ndarray) -> None:
    """Replace the initializer ``name`` by ``value``, keeping its place in the list (deterministic output)."""
    for t in graph.initializer:
        if t.name == name:
            t.CopyFrom(numpy_helper.from_array(value, name))
            return
    raise KeyError(name)


def fresh_name(graph: onnx.GraphProto, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... -- the first name no tensor or node of ``graph`` uses."""
    used = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o.name for o in graph.output}
    used |= {v.name for v in graph.value_info} | {n.name for n in graph.node}
    used |= {o for n in graph.node for o in n.output} | set(_all_inputs(graph.node))
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    return name


def drop_unread_initializers(graph: onnx.GraphProto, names: Iterable[str]) -> None:
    """Remove those of the initializers ``names`` that no node and no graph output reads any more (a folded
    BN's parameters); initializers the transform did not touch stay, read or not."""
    read = set(_all_inputs(graph.node)) | {o.name for o in graph.output}
    gone = set(names) - read
    keep = [t for t in graph.initializer if t.name not in gone]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)


def drop_dangling_value_info(graph: onnx.GraphProto, names: Iterable[str]) -> None:
    """Remove the value_info entries of those tensors ``names`` that no longer exist (no node produces them,
    no graph input or initializer holds them): a stale shape would mislead shape inference."""
    present = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    present |= {t.name for t in graph.initializer}
    gone = set(names) - present
    keep = [v for v in graph.value_info if v.name not in gone]
    if len(keep) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(keep)


def first(items: Iterable[str]) -> list[str]:
    """Up to :data:`MAX_NAMED` items, then "and N more" (a note stays one line)."""
    items = list(items)
    return items[:MAX_NAMED] + ([f"and {len(items) - MAX_NAMED} more"] if len(items) > MAX_NAMED else [])


def named(names: Iterable[str]) -> list[str]:
    """Up to :data:`MAX_NAMED` quoted names, then "and N more"."""
    return first(f"'{n}'" for n in names)
