"""A model's nodes cut into consecutive slices, each a small model of its own: a plan, and each slice's model.

ONNX Runtime's session start-up costs more per node the larger the graph, and far more on analyze's merged
capture models (thousands of graph outputs, tens of thousands of small initializers) than on plain graphs: 59 us
per node at 24,000 nodes and 76 us at 96,000, against 10-22 us for bare Relu graphs of 4,000-64,000 nodes.
The 96,000-node main capture model of a 3,200-node graph opened in 7.3 s as one session and 3.9 s as slices of
2,000 nodes (``benchmarks/bench_session_init.py``, docs/benchmarks.md); writing the slices costs ~7 us per
node, so small models and plain graphs are not sliced (:data:`SLICED_FROM`). A session that runs with graph
optimizations off computes exactly what its nodes say, node by node, so slices run one after the other
compute the same values (:class:`qdebug.runtime.capture.SegmentedSession` runs them).

The slices follow the model's node order (a topological order), so each slice reads only graph inputs,
its own initializers and values of earlier slices. The trailing nodes that only stack values into graph
outputs (``Concat``, ``SequenceConstruct`` + ``ConcatFromSequence``: the merged models' statistic vectors,
one entry per instrumented tensor) are not run by ORT at all: fed the thousands of values from every
slice, ORT's run took 5 s where the slices took 0.35 s; the runner stacks them with numpy instead (a
copy, bit for bit).

Pure: the model is read, never changed; the same model and size give the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import onnx
from onnx import helper

SEGMENT_NODES = 2000
"""Nodes per slice (the measured optimum lay between 1,000 and 3,000 on the capture models); the
environment variable ``QDEBUG_SLICE_NODES`` overrides it (``0``: never slice)."""

SLICE_ENV = "QDEBUG_SLICE_NODES"

SLICED_FROM = 8
"""A model is sliced only from this many slices' worth of nodes (16,000 at the default size): writing the
slices costs about 7 us per node, so the 9,200-node fake-quant model of an 800-node graph opened 1.19x slower
sliced, the 24,000-node main model 0.79x, the 96,000-node one 0.54x (docs/benchmarks.md)."""


def slice_nodes() -> int:
    """Nodes per slice: ``QDEBUG_SLICE_NODES`` when set to a whole number (0: never slice), else
    :data:`SEGMENT_NODES`."""
    import os

    value = os.environ.get(SLICE_ENV, "").strip()
    return int(value) if value.isdigit() else SEGMENT_NODES


@dataclass(frozen=True)
class Stack:
    """A graph output assembled from values of the slices: ``np.stack`` (``new_axis``) or
    ``np.concatenate`` of ``parts`` on ``axis``, as the node it stands for computes it."""

    output: str
    parts: tuple[str, ...]
    axis: int
    new_axis: bool


@dataclass(frozen=True)
class Slice:
    """One slice: ``nodes[start:stop]`` of the model, what it reads and what it hands on."""

    start: int
    stop: int
    inputs: tuple[str, ...]
    """Graph inputs and values of earlier slices its nodes read (subgraphs' outer-scope reads included)."""
    outputs: tuple[str, ...]
    """Its values that a later slice, a stack or the graph's outputs read."""
    initializers: tuple[str, ...]
    last_read: tuple[str, ...]
    """Values of earlier slices read for the last time here (the runner drops them after it)."""


@dataclass(frozen=True)
class Plan:
    slices: tuple[Slice, ...]
    stacks: tuple[Stack, ...]
    inputs: tuple[str, ...]
    """The model's graph inputs."""
    outputs: tuple[str, ...]
    """The model's graph outputs."""


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every value ``node`` reads: its inputs and what its subgraphs read from the enclosing scopes."""
    reads = [i for i in node.input if i]
    for attr in node.attribute:
        for graph in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            reads.extend(_outer_reads(graph))
    return reads


def _outer_reads(graph: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads that it does not define itself (inputs, initializers or node outputs)."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    out = []
    for node in graph.node:
        out.extend(r for r in node_reads(node) if r not in defined)
        defined.update(o for o in node.output if o)
    return out


def plan(model: onnx.ModelProto, size: int = SEGMENT_NODES) -> Plan | None:
    """The slices of ``model``'s main graph, at most ``size`` nodes each; None when the model has fewer than
    :data:`SLICED_FROM` slices' worth of nodes, or has what a slice could not be fed or hand on: a graph
    input with an initializer or of no tensor type (a sequence), sparse initializers, an initializer read as
    a graph output or stacked (no slice computes it)."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    inputs = tuple(i.name for i in g.input)
    if g.sparse_initializer or inits & set(inputs) or inits & {o.name for o in g.output}:
        return None
    if any(not i.type.HasField("tensor_type") for i in g.input):
        return None
    nodes = list(g.node)
    body, stacks = _split_tail(nodes, {o.name for o in g.output})
    if len(body) <= size or len(body) < SLICED_FROM * size or inits & {p for s in stacks for p in s.parts}:
        return None
    outputs = tuple(o.name for o in g.output)
    bounds = [(s, min(s + size, len(body))) for s in range(0, len(body), size)]
    made: dict[str, int] = {}
    for k, (start, stop) in enumerate(bounds):
        for node in body[start:stop]:
            made.update((o, k) for o in node.output if o)
    last: dict[str, int] = {}
    reads_of = []
    for k, (start, stop) in enumerate(bounds):
        reads = list(dict.fromkeys(r for node in body[start:stop] for r in node_reads(node)))
        reads_of.append(reads)
        for r in reads:
            last[r] = k
    wanted = set(outputs) | {p for s in stacks for p in s.parts}
    slices = []
    for k, (start, stop) in enumerate(bounds):
        reads = reads_of[k]
        mine = [o for node in body[start:stop] for o in node.output if o]
        slices.append(
            Slice(
                start,
                stop,
                tuple(r for r in reads if r not in inits and made.get(r, -1) != k),
                tuple(o for o in mine if o in wanted or last.get(o, k) > k),
                tuple(r for r in reads if r in inits),
                tuple(r for r in reads if last[r] == k and made.get(r, -1) < k and r not in inits and r not in wanted),
            )
        )
    return Plan(tuple(slices), tuple(stacks), inputs, outputs)


def _split_tail(nodes: list[onnx.NodeProto], outputs: set[str]) -> tuple[list[onnx.NodeProto], list[Stack]]:
    """The nodes before the trailing stacking nodes, and those nodes as :class:`Stack` records (each one's
    output a graph output no other node reads)."""
    stacks: list[Stack] = []
    end = len(nodes)
    while end > 0:
        node = nodes[end - 1]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.domain or len(node.output) != 1 or node.output[0] not in outputs:
            break
        if node.op_type == "Concat":
            stacks.append(Stack(node.output[0], tuple(node.input), int(attrs.get("axis", 0)), False))
            end -= 1
            continue
        if node.op_type == "ConcatFromSequence" and end >= 2:
            seq = nodes[end - 2]
            if seq.op_type == "SequenceConstruct" and not seq.domain and list(seq.output) == [node.input[0]]:
                parts = tuple(seq.input)
                stacks.append(Stack(node.output[0], parts, int(attrs["axis"]), bool(attrs.get("new_axis", 0))))
                end -= 2
                continue
        break
    body = nodes[:end]
    stacked = {s.output for s in stacks}
    read = {r for node in body for r in node_reads(node)} | {p for s in stacks for p in s.parts}
    if stacked & read or any(not p for s in stacks for p in s.parts):
        return nodes, []  # a stacked value read again, or an empty part: leave the tail to ORT
    return body, stacks[::-1]


def slice_model(
    model: onnx.ModelProto, plan_: Plan, k: int, types: Mapping[str, int], initializers: Mapping[str, onnx.TensorProto]
) -> onnx.ModelProto:
    """Slice ``k`` of ``plan_`` as a model: its nodes, its initializers, its inputs typed by ``types``
    (element types; shapes left unknown: nothing is fused with optimizations off), its outputs untyped
    (ORT infers them)."""
    part = plan_.slices[k]
    g = model.graph
    graph = helper.make_graph(
        g.node[part.start : part.stop],
        f"{g.name or 'graph'}_slice{k}",
        [helper.make_tensor_value_info(n, types[n], None) for n in part.inputs],
        [onnx.ValueInfoProto(name=n) for n in part.outputs],
        [initializers[n] for n in part.initializers],
    )
    out = helper.make_model(graph, opset_imports=list(model.opset_import), producer_name="qdebug")
    out.ir_version = model.ir_version
    out.functions.extend(model.functions)
    return out


def input_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the model's graph inputs."""
    return {i.name: i.type.tensor_type.elem_type for i in model.graph.input if i.type.HasField("tensor_type")}


def tensor_type_of(ort_type: str) -> int | None:
    """The ONNX element type of an ORT type string (``tensor(uint8)``), None for anything else (a sequence).
    ORT spells the element types as ONNX's ``TensorProto`` names, lower-cased."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        return None
    value = getattr(onnx.TensorProto, ort_type[7:-1].upper(), None)
    return value if isinstance(value, int) and value else None
