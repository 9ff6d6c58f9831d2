"""The normalized model as a graph: producers, consumers and the patterns to exclude whole.

A ``networkx.DiGraph`` of the model (nodes = ONNX nodes, edges = tensors) gives
the small structural patterns a proposal must keep FP32 whole or not at all,
so that no Q/DQ ping-pong is left inside them: decomposed LayerNorm/GELU
(fork-join regions of element-wise ops) and attention cores
(``MatMul -> scale -> Softmax -> MatMul``). :class:`Structure` computes all of
it once per model, plus which nodes an exclusion can change at all
(:func:`excludable_nodes`) and :meth:`Structure.unit_for`, the set of nodes
that keeps one tensor float under ORT's rewrite.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import networkx as nx
import onnx
from onnx import TensorProto

from qdebug.graph.match import GraphIndex
from qdebug.graph.ops import GLUE_OPS, WEIGHTED_OPS
from qdebug.graph.reduce import elem_types
from qdebug.quant.calibrate import op_types_to_quantize
from qdebug.records import NodeRecord

PATTERN_MAX_NODES = 12
"""Largest fork-join region taken as one decomposed pattern (a LayerNorm is 9 nodes, a GELU 5)."""
RESIDUAL_BRANCH_NODES = 8
"""A fork-join whose join reads the fork tensor directly around a longer branch is a residual."""


def model_graph(model: onnx.ModelProto) -> nx.DiGraph:
    """Nodes = ONNX nodes (by normalized name), edges = tensors from producer to consumer.

    Node attributes: ``op_type``, ``index`` (topological position), ``inputs``,
    ``outputs``, ``weighted`` (a Conv/MatMul/Gemm with an initializer input).
    Edge attribute ``tensors``: the tensor names carried.
    """
    g = nx.DiGraph()
    inits = {i.name for i in model.graph.initializer}
    g.graph["initializers"] = frozenset(inits)
    producer: dict[str, str] = {}
    for index, node in enumerate(model.graph.node):
        weighted = node.op_type in WEIGHTED_OPS and any(i in inits for i in node.input[1:] if i)
        g.add_node(
            node.name,
            op_type=node.op_type,
            index=index,
            inputs=tuple(node.input),
            outputs=tuple(node.output),
            weighted=weighted,
        )
        for i in node.input:
            if i and i in producer:
                src = producer[i]
                if g.has_edge(src, node.name):
                    g.edges[src, node.name]["tensors"] += (i,)
                else:
                    g.add_edge(src, node.name, tensors=(i,))
        for o in node.output:
            if o:
                producer[o] = node.name
    return g


def _bounded(g: nx.DiGraph, start: str, allowed: set[str], depth: int, reverse: bool = False) -> set[str]:
    """Nodes reachable from ``start`` (itself included) through ``allowed`` nodes within ``depth`` hops."""
    seen = {start}
    queue = deque([(start, 0)])
    while queue:
        node, d = queue.popleft()
        if d == depth:
            continue
        nxt = g.predecessors(node) if reverse else g.successors(node)
        for n in nxt:
            if n in allowed and n not in seen:
                seen.add(n)
                queue.append((n, d + 1))
    return seen


def _classify(g: nx.DiGraph, nodes: Iterable[str]) -> str:
    ops = {g.nodes[n]["op_type"] for n in nodes}
    if "Softmax" in ops and "MatMul" in ops:
        return "attention"
    if "ReduceMean" in ops and ({"Sqrt", "Pow", "Div", "Reciprocal"} & ops):
        return "layernorm"
    if ops & {"Erf", "Tanh"}:
        return "gelu"
    return "pattern"


def find_patterns(g: nx.DiGraph) -> list[tuple[str, frozenset[str]]]:
    """Decomposed patterns: (kind, nodes), each to be excluded whole or not at all.

    * fork-join regions of non-weighted nodes (a tensor read by two branches
      that meet again within a few nodes): a LayerNorm or GELU written as
      element-wise ops, a SiLU, a decomposed Softmax. A join that reads the fork
      tensor directly around a long branch is a residual connection, not a
      pattern; regions larger than :data:`PATTERN_MAX_NODES` are ignored.
    * attention cores: ``MatMul(q, k) -> [scale/mask] -> Softmax -> MatMul(., v)``.

    Overlapping regions, and regions chained through the fork tensor (the
    ``x - mean`` of a LayerNorm is the fork of its variance branch), are merged.
    """
    glue = {n for n in g.nodes if not g.nodes[n]["weighted"]}
    down: dict[str, set[str]] = {}
    up: dict[str, set[str]] = {}

    def below(n: str) -> set[str]:
        if n not in down:
            down[n] = _bounded(g, n, glue, PATTERN_MAX_NODES)
        return down[n]

    def above(n: str) -> set[str]:
        if n not in up:
            up[n] = _bounded(g, n, glue, PATTERN_MAX_NODES, reverse=True)
        return up[n]

    def fork_join(a: str, b: str, direct_ok: bool) -> set[str] | None:
        common = below(a) & below(b)
        if not common:
            return None
        join = min(common, key=lambda n: g.nodes[n]["index"])
        region = (below(a) | below(b)) & above(join)
        if len(region) > PATTERN_MAX_NODES:
            return None
        if not direct_ok and join in (a, b):  # the join reads the fork tensor itself: residual?
            other = b if join == a else a
            if len((below(other) & above(join)) - {join}) > RESIDUAL_BRANCH_NODES:
                return None
        return region

    forks: list[list[str]] = []
    for node in g.nodes:
        if g.out_degree(node) >= 2:
            forks.append([s for s in g.successors(node) if s in glue])
    # graph inputs read by several nodes fork too
    produced = {o for n in g.nodes for o in g.nodes[n]["outputs"]}
    readers: dict[str, list[str]] = {}
    for n in glue:
        for i in g.nodes[n]["inputs"]:
            if i and i not in produced and i not in g.graph["initializers"]:
                readers.setdefault(i, []).append(n)
    forks.extend(sorted(r, key=lambda n: g.nodes[n]["index"]) for r in readers.values())
    regions: list[set[str]] = []
    for succ in forks:
        for i, a in enumerate(succ):
            for b in succ[i + 1 :]:
                region = fork_join(a, b, direct_ok=False)
                if region is not None:
                    regions.append(region)
    regions.extend(_attention_cores(g))
    merged = _merge_regions(g, regions)
    return [(_classify(g, r), frozenset(r)) for r in merged]


def _attention_cores(g: nx.DiGraph) -> list[set[str]]:
    out = []
    for s in g.nodes:
        if g.nodes[s]["op_type"] != "Softmax":
            continue
        region = {s}
        up, node = None, s
        for _ in range(4):
            preds = list(g.predecessors(node))
            if len(preds) != 1:
                break
            node = preds[0]
            op = g.nodes[node]["op_type"]
            if op == "MatMul" and not g.nodes[node]["weighted"]:
                up = node
                break
            if op not in GLUE_OPS:
                break
            region.add(node)
        down = None
        frontier = [s]
        for _ in range(3):
            nxt = [c for f in frontier for c in g.successors(f)]
            hit = [c for c in nxt if g.nodes[c]["op_type"] == "MatMul" and not g.nodes[c]["weighted"]]
            if hit:
                down = hit[0]
                break
            frontier = [c for c in nxt if g.nodes[c]["op_type"] in ("Cast", "Dropout", "Identity")]
            region.update(frontier)
        if up is not None and down is not None:
            out.append(region | {up, down})
    return out


def _merge_regions(g: nx.DiGraph, regions: list[set[str]]) -> list[set[str]]:
    merged: list[set[str]] = []
    for r in sorted(regions, key=lambda r: min(g.nodes[n]["index"] for n in r)):
        r = set(r)
        changed = True
        while changed:
            changed = False
            for m in merged:
                touching = bool(m & r) or any(
                    p in m for n in r for p in g.predecessors(n) if _is_fork_of(g, p, r)
                )
                if touching and len(m | r) <= 2 * PATTERN_MAX_NODES:
                    merged.remove(m)
                    r |= m
                    changed = True
                    break
        merged.append(r)
    return sorted(merged, key=lambda r: min(g.nodes[n]["index"] for n in r))


def _is_fork_of(g: nx.DiGraph, producer: str, region: set[str]) -> bool:
    """True when ``producer`` feeds two or more nodes of ``region`` (it is the region's fork)."""
    return sum(1 for s in g.successors(producer) if s in region) >= 2


def excludable_nodes(report_nodes: Sequence[NodeRecord]) -> list[str]:
    """Nodes whose exclusion changes anything: ORT quantizes their op type and did quantize them (the
    report's ``excludable``; worked out here for reports written before it was recorded)."""
    ops = set(op_types_to_quantize())

    def excludable(n: NodeRecord) -> bool:
        if n.excludable is not None:
            return n.excludable
        return n.quantized and n.op_type in ops and not n.domain.startswith("com.")

    return [n.name for n in report_nodes if excludable(n)]


class Structure:
    """Everything about the normalized model the units need (computed once)."""

    def __init__(self, model: onnx.ModelProto, report_nodes: Sequence[NodeRecord]) -> None:
        self.model = model
        self.graph = model_graph(model)
        self.index = GraphIndex(model)
        self.excludable = set(excludable_nodes(report_nodes))
        self.order = {n.name: i for i, n in enumerate(model.graph.node)}
        self.patterns = find_patterns(self.graph)
        self.pattern_of: dict[str, int] = {}
        for k, (_, nodes) in enumerate(self.patterns):
            for n in nodes:
                self.pattern_of.setdefault(n, k)
        # float tensors only: ORT never quantizes token ids or shapes, and a unit keyed by one had
        # explained a Gather kept FP32 as "keeps ids float" (an int64 input)
        types = elem_types(model)  # a tensor of unknown type is assumed float
        floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
        self.activations = {
            t
            for n in model.graph.node
            for t in list(n.input) + list(n.output)
            if t and t not in self.index.inits and types.get(t, TensorProto.FLOAT) in floats
        }
        self.producers = {o: n.name for n in model.graph.node for o in n.output if o}

    def unit_for(self, tensor: str) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """(kind, nodes, tensors) keeping ``tensor`` float: producer, quantized consumers, their patterns."""
        members = set()
        producer = self.index.producer.get(tensor)
        if producer is not None:
            members.add(producer.name)
        members.update(c.name for c in self.index.consumers.get(tensor, []))
        kind = "tensor"
        tensors = {tensor}
        for m in list(members):
            k = self.pattern_of.get(m)
            if k is not None:
                pkind, pnodes = self.patterns[k]
                members |= pnodes
                kind = pkind
                tensors |= {o for p in pnodes for o in self.graph.nodes[p]["outputs"] if o}
        nodes = tuple(sorted((m for m in members if m in self.excludable), key=self.order.__getitem__))
        tensors = {t for t in tensors if t in self.activations and t not in self.index.outputs}
        return (
            kind,
            nodes,
            tuple(sorted(tensors, key=lambda t: self.order.get(self.producers.get(t, ""), -1))),
        )
