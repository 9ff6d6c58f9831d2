"""Propose which nodes to keep out of quantization -- and prove it on the evaluation set.

The analysis report says where error *enters*; this module turns that into the
smallest mixed-precision configuration that meets a target, by evaluating
candidates on the evaluation data. The pieces, in order:

1. **Graph.** A ``networkx.DiGraph`` of the normalized model (nodes = ONNX
   nodes, edges = tensors) gives producers, consumers and small structural
   patterns: decomposed LayerNorm/GELU (fork-join regions of element-wise ops)
   and attention cores (``MatMul -> scale -> Softmax -> MatMul``).
2. **Blame.** Each node's introduced error (``NodeRecord.introduced_db``) is
   attributed to a *tensor*: to the node's output when its own Q/DQ (local
   SQNR) or weight quantization explains the error at its output, else to its
   inputs -- an error far larger than what the node's own quantization adds is
   error from upstream made visible (typically outlier channels that a
   per-tensor SQNR hides until a LayerNorm or projection amplifies them).
3. **Units.** ORT keeps a tensor float only if *no* neighbour quantizes it: a
   quantized consumer rewires every consumer, an excluded one included, to the
   DequantizeLinear output. So a candidate is a *unit*: the tensor's producer
   plus all its quantized consumers (plus the whole pattern when one of them
   is inside a decomposed pattern, so that no Q/DQ ping-pong is left inside it).
   Every built variant is checked in the rewritten graph, and a unit whose
   tensor still got a Q/DQ pair is closed by excluding the offending consumer.
4. **Search.** Variants are re-quantized from the *cached* calibration ranges
   (never a recalibration; see ``benchmarks/bench_propose.py``) and scored with
   :class:`~qdebug.evaluate.Evaluator`; identical variants are scored once. The
   ranked units are bisected (monotone prefix search). When even all ranked
   units within ``max_nodes`` miss the target, the search turns greedy: it
   adopts the shortest prefix that captures half of their gain, *re-ranks given
   what is already excluded* (a short layer capture of the current variant,
   which reveals error the first ranking masked) and repeats until the target
   is met or the gain stalls. If the cap blocks it, the growth is retried
   without the cap (pruning often brings the result under it); if the blamed
   units cannot reach the target at all, once more over every quantized tensor.
   Units, then single nodes, that turn out unnecessary are then pruned while
   the evaluation budget (``2*ceil(log2 L) + 10`` for ``L`` candidate nodes by
   default) lasts.
5. **Cheaper alternatives** when allowed: per-channel weights for the whole
   model (tried first, kept if it helps), and 16-bit activations
   (``TensorQuantOverrides``) on a unit's tensors instead of FP32 nodes --
   all units at once, then unit by unit. The cheapest option that meets the
   target is kept: per-channel < int16 < fp32, and each reason says which.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdebug.errors import ExitCode, QDebugError
from qdebug.formatting import ACCURACY_METRICS
from qdebug.graph.ops import GLUE_OPS, WEIGHTED_OPS
from qdebug.progress import Progress
from qdebug.records import (
    SCHEMA_VERSION,
    NodeReason,
    NodeRecord,
    Proposal,
    Report,
    TensorOverride,
    WeightRecord,
)

if TYPE_CHECKING:
    import networkx as nx
    import onnx

    from qdebug.calibrate import Ranges
    from qdebug.evaluate import EvalResult, Evaluator


ACTIONS = ("fp32", "int16", "per-channel")
"""What ``--allow`` accepts: keep nodes FP32, 16-bit activations, per-channel weights."""

MIN_INTRODUCED_DB = 0.5
"""Nodes introducing less error than this are not candidates."""
HARMLESS_SQNR_DB = 30.0
"""A node whose output is still this accurate (accumulated SQNR) is not blamed for its own output."""
INPUT_DRIVEN_MARGIN_DB = 6.0
"""Error at a node's output this far above what its own Q/DQ and weights add is blamed on its inputs."""
PATTERN_MAX_NODES = 12
"""Largest fork-join region taken as one decomposed pattern (a LayerNorm is 9 nodes, a GELU 5)."""
RESIDUAL_BRANCH_NODES = 8
"""A fork-join whose join reads the fork tensor directly around a longer branch is a residual."""
RERANK_SAMPLES = 32
"""Calibration samples used by one re-ranking capture."""


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ProposeOptions:
    """Options of :func:`propose` (the flags of ``qdebug propose``)."""

    target_drop: float | None = None
    """Allowed drop of the task metric vs FP32: percentage points for the accuracy metrics
    (top1, top1_agreement, exact_match), else raw units."""
    target_sqnr: float | None = None
    """Instead: worst output SQNR (dB) the selective model must reach."""
    max_nodes: int | None = None
    """Most nodes the proposal may keep out of quantization (None: no limit)."""
    allow: tuple[str, ...] = ("fp32",)
    metric: str | None = None
    """Task metric (default: the report's, else top1 when the data has labels)."""
    eval_max_samples: int | None = None
    """Score candidates on at most this many evaluation samples (faster search, noisier metric)."""
    max_evaluations: int | None = None
    """Evaluation budget (None: ``2*ceil(log2 L) + 10`` for ``L`` candidate nodes)."""
    rerank_samples: int = RERANK_SAMPLES
    use_cache: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0


@dataclass(frozen=True)
class Target:
    """What a candidate must reach."""

    metric: str
    kind: str
    """``drop`` (task metric vs FP32) or ``sqnr`` (worst output SQNR)."""
    threshold: float
    fp32: float
    noise: float
    """Smallest change of :meth:`value` that counts as a gain (one or two samples for accuracies)."""

    def value(self, result: EvalResult) -> float:
        """The number compared with the threshold."""
        return result.output_sqnr_db if self.kind == "sqnr" else result.value

    def met(self, result: EvalResult) -> bool:
        """True when ``result`` reaches the threshold."""
        v = self.value(result)
        return not math.isnan(v) and v >= self.threshold - 1e-12

    def describe(self) -> str:
        """One line for the CLI and the reasons."""
        if self.kind == "sqnr":
            return f"worst output SQNR >= {self.threshold:.1f} dB"
        if self.metric in ACCURACY_METRICS:
            return f"{self.metric} >= {100 * self.threshold:.2f}% (FP32 {100 * self.fp32:.2f}%)"
        return f"{self.metric} >= {self.threshold:.4g} (FP32 {self.fp32:.4g})"


@dataclass(frozen=True)
class Unit:
    """One candidate: the nodes to keep FP32 so that some tensors stay float.

    Excluding a single node rarely keeps anything float in ORT (a quantized
    neighbour re-quantizes the shared tensor), so candidates are tensors with
    their whole neighbourhood, or whole decomposed patterns.
    """

    key: str
    """The tensor kept float (or ``pattern:<first node>``)."""
    kind: str
    """``tensor``, ``layernorm``, ``gelu``, ``attention`` or ``pattern``."""
    nodes: tuple[str, ...]
    """Excludable nodes (ORT quantizes their op type and did quantize them), topological order."""
    tensors: tuple[str, ...]
    """Float activations this unit keeps float: what 16-bit overrides would cover instead."""
    score: float
    """Introduced error (dB) blamed on this unit."""
    blamed: str
    """The node whose introduced error is blamed here."""
    why: str


@dataclass(frozen=True)
class Trial:
    """One evaluated candidate."""

    step: str
    """``baseline``, ``per-channel``, ``candidates``, ``bisect``, ``gallop``, ``prune``, ``int16``."""
    nodes: tuple[str, ...]
    overrides: tuple[str, ...]
    per_channel: bool
    value: float
    output_sqnr_db: float
    met: bool
    """The target is reached (regardless of ``max_nodes``)."""
    qdq_pairs: int
    """QuantizeLinear nodes in the variant (activations and weights)."""
    quantize_seconds: float
    eval_seconds: float


@dataclass(frozen=True)
class ProposeResult:
    """The proposal plus how it was found."""

    proposal: Proposal
    met: bool
    target: Target
    candidates: int
    """``L``: distinct excludable nodes over all ranked candidate units."""
    units: tuple[Unit, ...]
    """The first ranking."""
    trials: tuple[Trial, ...]
    reranks: int
    """Layer captures made to re-rank given what is already excluded (not task-metric evaluations)."""
    max_evaluations: int
    seconds: float
    proposal_path: str | None = None
    notes: tuple[str, ...] = ()
    """What the user should know about how the proposal was made (printed by the CLI)."""

    @property
    def evaluations(self) -> int:
        """Task-metric evaluations made (each one variant scored on the evaluation set)."""
        return len(self.trials)


# ----------------------------------------------------------------------------- graph


def model_graph(model: onnx.ModelProto) -> nx.DiGraph:
    """Nodes = ONNX nodes (by normalized name), edges = tensors from producer to consumer.

    Node attributes: ``op_type``, ``index`` (topological position), ``inputs``,
    ``outputs``, ``weighted`` (a Conv/MatMul/Gemm with an initializer input).
    Edge attribute ``tensors``: the tensor names carried.
    """
    import networkx as nx

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


# ----------------------------------------------------------------------------- blame and units


def excludable_nodes(report_nodes: Sequence[NodeRecord]) -> list[str]:
    """Nodes whose exclusion changes anything: ORT quantizes their op type and did quantize them (the
    report's ``excludable``; worked out here for reports written before it was recorded)."""
    from qdebug.calibrate import op_types_to_quantize

    ops = set(op_types_to_quantize())

    def excludable(n: NodeRecord) -> bool:
        if n.excludable is not None:
            return n.excludable
        return n.quantized and n.op_type in ops and not n.domain.startswith("com.")

    return [n.name for n in report_nodes if excludable(n)]


def _own_error_db(node: NodeRecord, weight_db: dict[str, float]) -> float:
    """SQNR of what the node's own quantization adds: its outputs' Q/DQ and its weights (inf: nothing)."""
    own = node.local_sqnr_db if not math.isnan(node.local_sqnr_db) else math.inf
    return min(own, weight_db.get(node.name, math.inf))


def blame_tensors(
    nodes: Sequence[NodeRecord],
    weights: Sequence[WeightRecord],
    activations: set[str],
    float_tensors: set[str] | frozenset[str] = frozenset(),
) -> dict[str, tuple[float, str, str]]:
    """Attribute each node's introduced error to a tensor: tensor -> (dB, node, why).

    Output-driven: the node's own Q/DQ or weights explain the error at its
    output, and that output is not already harmlessly accurate (accumulated
    SQNR below :data:`HARMLESS_SQNR_DB`). Input-driven: the error at the output
    is far beyond what the node's own quantization adds, so it is upstream
    error made visible; it goes to the node's activation inputs -- and through
    inputs that are already float (``float_tensors``) on to the nearest ones
    that are not.
    """
    by_name = {n.name: n for n in nodes}
    producers = {o: n.name for n in nodes for o in n.outputs if o}
    weight_db: dict[str, float] = {}
    for w in weights:
        weight_db[w.node] = min(weight_db.get(w.node, math.inf), w.error.sqnr_db)
    out: dict[str, tuple[float, str, str]] = {}

    def give(tensor: str, score: float, node: str, why: str, hops: int = 0) -> None:
        if tensor in float_tensors:
            src = producers.get(tensor)
            if src is not None and hops < 6:
                for i in by_name[src].inputs:
                    if i in activations:
                        give(i, score, node, why, hops + 1)
            return
        old = out.get(tensor)
        if old is None or score > old[0]:
            out[tensor] = (score, node, why)

    for n in nodes:
        intro = n.introduced_db
        if math.isnan(intro) or intro < MIN_INTRODUCED_DB:
            continue
        own = _own_error_db(n, weight_db)
        acc = n.accumulated_sqnr_db
        if not math.isnan(acc) and acc + INPUT_DRIVEN_MARGIN_DB < own:
            why = (
                f"{n.name} ({n.op_type}) introduces {intro:.1f} dB of error (SQNR {acc:.1f} dB at its "
                f"output) although its own quantization is at {_db(own)}: upstream error made visible"
            )
            for i in n.inputs:
                if i in activations:
                    give(i, intro, n.name, why)
        elif math.isnan(acc) or acc < HARMLESS_SQNR_DB:
            why = f"{n.name} ({n.op_type}) introduces {intro:.1f} dB of error (SQNR {_db(acc)} at its output)"
            for o in n.outputs:
                if o in activations:
                    give(o, intro, n.name, why)
    return out


def _db(x: float) -> str:
    return "-" if math.isnan(x) else ("inf dB" if math.isinf(x) else f"{x:.1f} dB")


class Structure:
    """Everything about the normalized model the units need (computed once)."""

    def __init__(self, model: onnx.ModelProto, report_nodes: Sequence[NodeRecord]) -> None:
        from onnx import TensorProto

        from qdebug.graph.match import GraphIndex
        from qdebug.graph.reduce import elem_types

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


def rank_units(
    structure: Structure,
    nodes: Sequence[NodeRecord],
    weights: Sequence[WeightRecord],
    excluded: frozenset[str] = frozenset(),
    overridden: frozenset[str] = frozenset(),
    *,
    widen: bool = False,
) -> list[Unit]:
    """Candidate units, worst first, given what is already excluded/overridden.

    ``widen`` (the fallback when the blamed units stall) adds every other
    tensor that some excludable node quantizes, after the blamed ones, ordered
    by its producer's local SQNR (worst first).
    """
    float_now = {t for t in structure.activations if _is_float(structure, t, excluded)} | set(overridden)
    blame = blame_tensors(nodes, weights, structure.activations, float_now)
    local = {n.name: n.local_sqnr_db for n in nodes}
    units: dict[tuple[str, ...], Unit] = {}

    def add(tensor: str, score: float, node: str, why: str) -> None:
        kind, members, tensors = structure.unit_for(tensor)
        if not members or (excluded and set(members) <= excluded):
            return
        old = units.get(members)
        if old is None or old.score < score:
            key = tensor if kind == "tensor" else f"pattern:{members[0]}"
            units[members] = Unit(key, kind, members, tensors, score, node, why)

    for tensor, (score, node, why) in blame.items():
        if tensor in structure.activations:
            add(tensor, score, node, why)
    ranked = sorted(
        units.values(),
        key=lambda u: (
            -u.score,
            len(u.nodes),
            _nan_last(local.get(u.blamed, math.nan)),
            structure.order[u.nodes[0]],
        ),
    )
    if not widen:
        return ranked
    blamed = set(units)
    for tensor in sorted(
        structure.activations, key=lambda t: structure.order.get(structure.producers.get(t, ""), -1)
    ):
        if tensor in float_now or tensor in blame:
            continue
        producer = structure.producers.get(tensor)
        quality = local.get(producer, math.nan) if producer else math.nan
        add(
            tensor,
            0.0,
            producer or tensor,
            f"widened search: local SQNR {_db(quality)} at {producer or tensor}",
        )
    rest = [u for k, u in units.items() if k not in blamed]
    rest.sort(
        key=lambda u: (_nan_last(local.get(u.blamed, math.nan)), len(u.nodes), structure.order[u.nodes[0]])
    )
    return ranked + rest


def _nan_last(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _is_float(structure: Structure, tensor: str, excluded: frozenset[str]) -> bool:
    """Whether no excludable neighbour is left to quantize ``tensor`` (static view of ORT's rule)."""
    if not excluded:
        return False
    producer = structure.index.producer.get(tensor)
    around = ([producer.name] if producer is not None else []) + [
        c.name for c in structure.index.consumers.get(tensor, [])
    ]
    quantizers = [n for n in around if n in structure.excludable]
    return bool(quantizers) and all(n in excluded for n in quantizers)


# ----------------------------------------------------------------------------- search


class Search:
    """Evaluates variants (cached by configuration) within a budget and keeps the trace."""

    def __init__(
        self,
        normalized: onnx.ModelProto,
        ranges: Ranges,
        base_spec: Any,
        evaluator: Evaluator,
        target: Target,
        structure: Structure,
        budget: int,
        int16_type: str,
        progress: Progress,
        max_nodes: int | None = None,
    ) -> None:
        self.normalized = normalized
        self.ranges = ranges
        self.base_spec = base_spec
        self.evaluator = evaluator
        self.target = target
        self.structure = structure
        self.budget = budget
        self.int16_type = int16_type
        self.progress = progress
        self.trials: list[Trial] = []
        self.cache: dict[tuple, Trial] = {}
        """Trials by resolved configuration (nodes after closing leaks, overrides, per-channel)."""
        self.equivalents: list[Trial] = []
        """Trials answered from an equal model scored under another list (no evaluation spent): the final
        choice considers them too, since their list may be the one that fits ``--max-nodes``."""
        self.by_model: dict[str, Trial] = {}
        """Trials by the sha256 of the quantized model they scored: equal models are scored once."""
        self.resolved: dict[tuple, tuple] = {}
        """Asked configuration -> resolved one: a repeated candidate is neither re-quantized nor re-scored."""
        self.per_channel = base_spec.per_channel
        self.max_nodes = max_nodes
        self.held = 0
        """Evaluations the growth may not spend (released before the answer is refined)."""

    @property
    def left(self) -> int:
        """Evaluations left in the budget (less those held back for refining the answer)."""
        return self.budget - len(self.trials) - self.held

    def spec(self, nodes: Iterable[str], overrides: Iterable[str], per_channel: bool | None = None) -> Any:
        """The QuantSpec of a variant."""
        return dataclasses.replace(
            self.base_spec,
            per_channel=self.per_channel if per_channel is None else per_channel,
            nodes_to_exclude=tuple(sorted(set(nodes), key=self.structure.order.__getitem__)),
            tensor_overrides=tuple(TensorOverride(t, self.int16_type) for t in sorted(set(overrides))),
        )

    def build(
        self,
        nodes: Iterable[str],
        overrides: Iterable[str] = (),
        per_channel: bool | None = None,
        keep_float: Iterable[str] = (),
    ) -> tuple[Any, onnx.ModelProto, float]:
        """Quantize a variant from the cached ranges; close leaks so ``keep_float`` tensors stay float."""
        from qdebug.graph.match import GraphIndex
        from qdebug.quantize import quantize_static_model

        start = time.perf_counter()
        nodes = set(nodes)
        keep = set(keep_float)
        for _ in range(4):
            spec = self.spec(nodes, overrides, per_channel)
            model = quantize_static_model(self.normalized, self.ranges, spec)
            if not keep:
                break
            index = GraphIndex(model)
            extra = set()
            for t in keep:
                dq = index.dequant_of(t)
                if dq is None:
                    continue
                for consumer in index.consumers.get(dq[0], []):
                    if consumer.name in self.structure.excludable and consumer.name not in nodes:
                        extra.add(consumer.name)
            if not extra:
                break
            nodes |= extra
        return spec, model, time.perf_counter() - start

    def evaluate(
        self,
        step: str,
        nodes: Iterable[str],
        overrides: Iterable[str] = (),
        per_channel: bool | None = None,
        keep_float: Iterable[str] = (),
    ) -> Trial | None:
        """Score one variant (``None`` when the budget is spent); identical variants are scored once."""
        nodes, overrides, keep_float = frozenset(nodes), frozenset(overrides), frozenset(keep_float)
        pc = self.per_channel if per_channel is None else per_channel
        asked = (nodes, overrides, pc, keep_float)
        known = self.resolved.get(asked)
        if known is not None and known in self.cache:
            return self.cache[known]
        if self.left <= 0:
            return None
        spec, model, qsec = self.build(nodes, overrides, pc, keep_float)
        key = (spec.nodes_to_exclude, tuple(o.tensor for o in spec.tensor_overrides), spec.per_channel)
        self.resolved[asked] = key
        if key in self.cache:
            return self.cache[key]
        # the same model from another list: excluding a node next to an excluded one often changes nothing
        # in ORT's rewrite (review: 5 of 16 evaluations on a depthwise CNN re-scored identical models)
        digest = hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()
        same = self.by_model.get(digest)
        if same is not None:
            trial = dataclasses.replace(same, step=step, nodes=key[0], overrides=key[1], per_channel=key[2])
            self.cache[key] = trial
            self.equivalents.append(trial)
            return trial
        result = self.evaluator.score(model, what="candidate quantized model")
        qdq = sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear")
        trial = Trial(
            step=step,
            nodes=key[0],
            overrides=key[1],
            per_channel=key[2],
            value=result.value,
            output_sqnr_db=result.output_sqnr_db,
            met=self.target.met(result),
            qdq_pairs=qdq,
            quantize_seconds=qsec,
            eval_seconds=result.seconds,
        )
        self.trials.append(trial)
        self.cache[key] = trial
        self.by_model[digest] = trial
        self.progress("search", len(self.trials), self.budget)
        return trial

    def fits(self, trial: Trial) -> bool:
        """Whether a trial keeps at most ``max_nodes`` nodes FP32."""
        return self.max_nodes is None or len(trial.nodes) <= self.max_nodes

    def score(self, trial: Trial) -> float:
        """The target's number for a trial (``-inf`` for nan)."""
        v = trial.output_sqnr_db if self.target.kind == "sqnr" else trial.value
        return -math.inf if math.isnan(v) else v


@dataclass(frozen=True)
class Plan:
    """A candidate configuration: units kept FP32 and units given 16-bit activations."""

    fp32: tuple[Unit, ...] = ()
    int16: tuple[Unit, ...] = ()

    def nodes(self) -> set[str]:
        """Nodes to exclude."""
        return {n for u in self.fp32 for n in u.nodes}

    def overrides(self) -> set[str]:
        """Tensors to quantize with 16 bits."""
        return {t for u in self.int16 for t in u.tensors if t not in self.nodes_tensors()}

    def nodes_tensors(self) -> set[str]:
        """Tensors the FP32 units keep float (no point in overriding them)."""
        return {u.key for u in self.fp32 if u.kind == "tensor"}

    def keep_float(self) -> set[str]:
        """Tensors whose Q/DQ must be gone in the rewritten graph (leaks: exclude the neighbour too)."""
        return self.nodes_tensors()

    def units(self) -> tuple[Unit, ...]:
        """All units, FP32 ones first."""
        return self.fp32 + self.int16

    def with_units(self, units: Sequence[Unit], action: str) -> Plan:
        """A copy of this plan with ``units`` added under ``action``."""
        if action == "int16":
            return Plan(self.fp32, self.int16 + tuple(units))
        return Plan(self.fp32 + tuple(units), self.int16)


def _evaluate_plan(search: Search, step: str, plan: Plan) -> Trial | None:
    return search.evaluate(step, plan.nodes(), plan.overrides(), keep_float=plan.keep_float())


def _covers(plan: Plan, u: Unit, action: str) -> bool:
    """True when ``u`` adds nothing to ``plan`` under ``action``."""
    if action == "fp32":
        return set(u.nodes) <= plan.nodes()
    return set(u.tensors) <= ({t for x in plan.int16 for t in x.tensors} | plan.nodes_tensors())


def run_search(
    search: Search,
    initial: list[Unit],
    rerank: Callable[[Plan, bool], list[Unit]],
    allow: Sequence[str],
    max_nodes: int | None,
    widened: list[Unit] | None = None,
) -> tuple[Plan, Trial | None, int]:
    """Baseline, per-channel, then grow / prune / cheapen; returns (plan, met trial or None, re-ranks).

    Per-channel weights alone are tried first (the cheapest change). When they
    do not meet the target, the exclusions are searched *without* them: adopted
    as soon as they helped a little, they had steered the search to larger
    sets (7 nodes at 91.0 % where 2 nodes give 92.4 % without). Only when that
    search fails, and per-channel helped, is it run again with per-channel on.
    """
    base = search.evaluate("baseline", ())
    assert base is not None
    if base.met:
        return Plan(), base, 0
    pc_helped: Trial | None = None
    if "per-channel" in allow and not search.per_channel:
        pc = search.evaluate("per-channel", (), per_channel=True)
        if pc is not None and pc.met:
            search.per_channel = True
            return Plan(), pc, 0
        if pc is not None and search.score(pc) > search.score(base) + search.target.noise:
            pc_helped = pc
    if "fp32" not in allow and "int16" not in allow:
        return Plan(), None, 0
    action = "fp32" if "fp32" in allow else "int16"
    cap = max_nodes if action == "fp32" else None
    plan, met, reranks = _exclusions(search, initial, rerank, action, cap, base, widened)
    if met is None and pc_helped is not None and search.left > 0:
        search.per_channel = True
        plan, met, more = _exclusions(search, initial, rerank, action, cap, pc_helped, widened)
        reranks += more
    singles = action == "fp32" and bool(widened)
    search.held = 0  # the evaluations held back are for the refinement below
    if met is not None:  # the pairs leave the single-unit tries their budget
        plan, met = _prune(search, plan, action, met, reserve=SINGLE_TRIES if singles else 0)
        if action == "fp32" and "int16" in allow:
            plan, met = _cheapen(search, plan, met)
        if plan.int16:
            plan, met = _prune_overrides(search, plan, met)
    if singles and widened and search.left > 0:
        answered = met is not None and search.fits(met)
        if not answered or len(plan.nodes()) > 1:
            # smaller than the answer (a region of an unblamed tensor can hold several nodes), within the cap
            room = len(met.nodes) - 1 if answered and met is not None else cap
            blamed = {u.nodes for u in initial}
            unblamed = [u for u in widened if u.nodes not in blamed][:SINGLE_TRIES]
            single = _single_unit(search, unblamed, room)
            if single is not None:
                plan, met = single
    return plan, met, reranks


SINGLE_TRIES = 4
"""Units outside the blamed ranking tried alone after the search (one evaluation each)."""


def _exclusions(
    search: Search,
    initial: list[Unit],
    rerank: Callable[[Plan, bool], list[Unit]],
    action: str,
    cap: int | None,
    cur: Trial,
    widened: list[Unit] | None,
) -> tuple[Plan, Trial | None, int]:
    """Grow a plan from ``cur``: within ``cap`` first; if that fails, without the cap (pruning often brings a
    larger answer under it); if the blamed units cannot reach the target at all, over ``widened`` (every
    quantized tensor)."""
    plan, met, reranks = _grow(search, initial, rerank, action, cap, cur)
    if met is None and cap is not None and search.left > 0:
        plan, met, more = _grow(search, initial, rerank, action, None, cur)
        reranks += more
    if met is None and widened and search.left > 0:
        plan, met, more = _grow(search, widened, rerank, action, None, cur, widen=True)
        reranks += more
    return plan, met, reranks


def _single_unit(search: Search, ranking: list[Unit], cap: int | None) -> tuple[Plan, Trial] | None:
    """The first unit of ``ranking`` that meets the target alone, within the budget left; ``None`` if none.

    The ranking blames nodes by the error they *introduce*; a node after an
    averaging step (a pooled Gemm head) introduces less than nothing although
    its own weights and Q/DQ limit the output, so the growth never tries it.
    On a 1-D conv model the search kept 4 of 6 nodes FP32 for 43 dB, and
    reported the target missed with ``--max-nodes 1``, while the Gemm alone
    gave 43.2 dB. So after the search, when its answer has several nodes or
    misses, the first :data:`SINGLE_TRIES` units it never blamed (worst local
    SQNR first) are tried alone.
    """
    for u in ranking:
        if search.left <= 0:
            return None
        if cap is not None and len(u.nodes) > cap:
            continue
        plan = Plan().with_units([u], "fp32")
        trial = _evaluate_plan(search, "single", plan)
        # the nodes scored, not the unit's: closing a leak can add a consumer to the unit's list
        if trial is not None and trial.met and search.fits(trial) and (cap is None or len(trial.nodes) <= cap):
            return plan, trial
    return None


def _grow(
    search: Search,
    ranking: list[Unit],
    rerank: Callable[[Plan, bool], list[Unit]],
    action: str,
    cap: int | None,
    cur: Trial,
    widen: bool = False,
) -> tuple[Plan, Trial | None, int]:
    """Bisect the ranked units; when all of them miss the target, adopt the gain and re-rank (greedy)."""
    plan = Plan()
    reranks = 0
    reranked_for: Plan | None = None
    while search.left > 0:
        cands: list[Unit] = []
        for u in ranking:
            trial_plan = plan.with_units([*cands, u], action)
            if cap is not None and len(trial_plan.nodes()) > cap and action == "fp32":
                room = cap - len(plan.with_units(cands, action).nodes())
                if room <= 0:
                    continue
                u = _cut_to(u, room)  # a region over the cap: where it starts may fit and help alone
                trial_plan = plan.with_units([*cands, u], action)
            if not _covers(plan.with_units(cands, action), u, action) and (
                cap is None or len(trial_plan.nodes()) <= cap
            ):
                cands.append(u)
        if cands:
            full = _evaluate_plan(search, "candidates", plan.with_units(cands, action))
            if full is None:
                break
            if full.met:
                k = _bisect(search, plan, cands, action, len(cands))
                plan = plan.with_units(cands[:k], action)
                return plan, _evaluate_plan(search, "bisect", plan) or full, reranks
            gain = search.score(full) - search.score(cur)
            if gain > search.target.noise:
                k, trial = _gallop(search, plan, cands, action, search.score(cur) + gain / 2, full)
                plan, cur = plan.with_units(cands[:k], action), trial
                if trial.met:
                    return plan, trial, reranks
                reranked_for = None  # progress: the ranking is re-made for the new plan below
        if reranked_for == plan:
            break  # nothing left to try, or stalled even after re-ranking
        ranking = rerank(plan, widen)
        reranks += 1
        reranked_for = plan
    return plan, None, reranks


def _cut_to(u: Unit, room: int) -> Unit:
    """``u`` cut to its first ``room`` nodes (topological order: where the float region starts), for a
    ``--max-nodes`` cap its whole region does not fit.

    The cap had dropped such regions whole: on the transformer fixture with
    ``--max-nodes 1`` the proposal was empty (83.6 %), while keeping the
    region's first node, the embedding Add, in FP32 gives 92.4 %.
    """
    if len(u.nodes) <= room:
        return u
    nodes = u.nodes[:room]
    why = f"{u.why}; cut to {', '.join(nodes)} to fit --max-nodes"
    return dataclasses.replace(u, key=f"node:{nodes[0]}", kind="node", nodes=nodes, tensors=(), why=why)


def _bisect(search: Search, plan: Plan, cands: list[Unit], action: str, hi: int, lo: int = 0) -> int:
    """Smallest prefix length in (lo, hi] that meets the target (``hi`` is known to meet it)."""
    while hi - lo > 1 and search.left > 0:
        mid = (lo + hi) // 2
        t = _evaluate_plan(search, "bisect", plan.with_units(cands[:mid], action))
        if t is None:
            break
        if t.met:
            hi = mid
        else:
            lo = mid
    return hi


def _gallop(
    search: Search, plan: Plan, cands: list[Unit], action: str, wanted: float, full: Trial
) -> tuple[int, Trial]:
    """Smallest prefix 1, 2, 4, ... reaching ``wanted`` (half the gain of all candidates), or all of them."""
    k = 1
    while k < len(cands) and search.left > 0:
        t = _evaluate_plan(search, "gallop", plan.with_units(cands[:k], action))
        if t is None:
            break
        if t.met:
            k2 = _bisect(search, plan, cands, action, k, k // 2)
            return k2, _evaluate_plan(search, "bisect", plan.with_units(cands[:k2], action)) or t
        if search.score(t) >= wanted:
            return k, t
        k *= 2
    return len(cands), full


def _prune(search: Search, plan: Plan, action: str, met: Trial, reserve: int = 0) -> tuple[Plan, Trial]:
    """Drop units (least important first), then single nodes, that the target turns out not to need."""
    units = list(plan.units())
    for u in reversed(list(units)):
        if search.left <= 0 or len(units) <= 1:
            break
        rest = [x for x in units if x is not u]
        t = _evaluate_plan(search, "prune", Plan().with_units(rest, action))
        if t is not None and t.met:
            units, met = rest, t
    plan = Plan().with_units(units, action)
    if action != "fp32":
        return plan, met
    # single nodes, last units first: often a unit's neighbour is needed, its blamed node not (or vice versa)
    nodes = list(met.nodes)
    dropped: set[str] = set()
    alone: dict[str, float] = {}  # the score without each node that could not go alone
    for n in dict.fromkeys(n for u in reversed(units) for n in reversed(u.nodes) if n in nodes):
        if search.left <= 0 or len(nodes) - len(dropped) <= 1:
            break
        trial = search.evaluate("prune", [m for m in nodes if m not in dropped and m != n])
        if trial is not None and trial.met:
            dropped.add(n)
            met = trial
        elif trial is not None:
            alone[n] = search.score(trial)
    dropped |= _prune_pairs(search, [n for n in nodes if n not in dropped], alone, reserve)
    if dropped:
        met = search.evaluate("prune", [n for n in nodes if n not in dropped]) or met
        kept = [dataclasses.replace(u, nodes=tuple(x for x in u.nodes if x not in dropped)) for u in units]
        plan = Plan(fp32=tuple(u for u in kept if u.nodes))
    return plan, met


PAIR_PRUNE_MAX_NODES = 8
"""Answers up to this size are also pruned by pairs (at most 28 evaluations, within the budget)."""


def _prune_pairs(search: Search, nodes: list[str], alone: dict[str, float], reserve: int = 0) -> set[str]:
    """Nodes that can go two at a time although neither can go alone.

    Two branches feeding one Concat: keeping either one FP32 leaves the Concat
    mixing a float and a quantized input, and the target is missed, while
    dropping both meets it (review: 5 nodes proposed where 3 meet the same
    target, and --max-nodes 3 reported as missed). Pairs are tried in the
    order of how close each node's removal alone came to the target
    (``alone``: the score without it), so the budget goes to the likely ones
    first; each success is kept and the pairs go on from there. ``reserve``
    evaluations are left for what comes after.
    """
    if len(nodes) < 3 or len(nodes) > PAIR_PRUNE_MAX_NODES:
        return set()
    near = sorted((n for n in nodes if n in alone), key=lambda n: -alone[n])
    pairs = sorted(
        ((a, b) for i, a in enumerate(near) for b in near[i + 1 :]), key=lambda p: -(alone[p[0]] + alone[p[1]])
    )
    dropped: set[str] = set()
    for a, b in pairs:
        if search.left <= reserve:
            break
        if a in dropped or b in dropped or len(nodes) - len(dropped) <= 2:
            continue
        trial = search.evaluate("prune", [n for n in nodes if n not in dropped | {a, b}])
        if trial is not None and trial.met:
            dropped |= {a, b}
    return dropped


def _cheapen(search: Search, plan: Plan, met: Trial) -> tuple[Plan, Trial]:
    """Replace FP32 units by 16-bit activations where the target still holds (weights stay 8-bit).

    All units at once first (one evaluation); then, budget allowing, one unit at
    a time from the least important.
    """
    if search.left <= 0 or not plan.fp32:
        return plan, met
    every = Plan(int16=plan.fp32)
    t = _evaluate_plan(search, "int16", every)
    if t is not None and t.met:
        return every, t
    if len(plan.fp32) == 1:
        return plan, met
    for u in reversed(plan.fp32):
        if search.left <= 0:
            break
        mixed = Plan(tuple(x for x in plan.fp32 if x is not u), plan.int16 + (u,))
        t = _evaluate_plan(search, "int16", mixed)
        if t is not None and t.met:
            plan, met = mixed, t
    return plan, met


def _prune_overrides(search: Search, plan: Plan, met: Trial) -> tuple[Plan, Trial]:
    """Drop 16-bit tensors the target turns out not to need, one at a time (last first).

    A unit turned 16-bit carries every tensor of its region (an attention block: 5), where one is often
    enough (review: 16-bit on the scores alone gave 92.6 % where all five gave 91.8 %).
    """
    tensors = sorted(plan.overrides(), key=lambda t: [t in u.tensors for u in plan.int16].index(True))
    if len(tensors) <= 1:
        return plan, met
    dropped: set[str] = set()
    for t in reversed(tensors):
        if search.left <= 0 or len(tensors) - len(dropped) <= 1:
            break
        keep = [x for x in tensors if x not in dropped and x != t]
        trial = search.evaluate("prune", plan.nodes(), keep, keep_float=plan.keep_float())
        if trial is not None and trial.met:
            dropped.add(t)
            met = trial
    if not dropped:
        return plan, met
    int16 = tuple(dataclasses.replace(u, tensors=tuple(x for x in u.tensors if x not in dropped)) for u in plan.int16)
    return Plan(plan.fp32, tuple(u for u in int16 if u.tensors)), met


# ----------------------------------------------------------------------------- entry point


def make_target(metric: str, fp32: float, samples: int, options: ProposeOptions) -> Target:
    """The target from the flags (default: a 1-point drop, or 30 dB output SQNR for an SQNR metric)."""
    accuracy = metric in ACCURACY_METRICS
    if options.target_sqnr is not None:
        if not math.isfinite(options.target_sqnr):
            raise QDebugError(
                f"--target-sqnr must be a finite number (got {options.target_sqnr})",
                "pass the required output SQNR in dB",
                ExitCode.USAGE,
            )
        return Target(metric, "sqnr", float(options.target_sqnr), fp32, 0.1)
    if not math.isfinite(fp32):
        if options.target_drop is not None:
            raise QDebugError(
                f"metric {metric} has no finite FP32 value, so --target-drop has nothing to drop from",
                "pass --target-sqnr DB instead",
                ExitCode.USAGE,
            )
        return Target(metric, "sqnr", 30.0, fp32, 0.1)
    drop = 1.0 if options.target_drop is None else float(options.target_drop)
    if not drop >= 0 or not math.isfinite(drop):
        raise QDebugError(
            f"--target-drop must be >= 0 (got {drop})", "pass the allowed drop in points", ExitCode.USAGE
        )
    if accuracy:
        return Target(metric, "drop", fp32 - drop / 100.0, fp32, 1.5 / max(samples, 1))
    return Target(metric, "drop", fp32 - drop, fp32, 1e-9 + 1e-6 * abs(fp32))


REFINE_EVALS = 6
"""Evaluations the default budget holds back from the growth for refining its answer: pairs of nodes that
only go together, and units tried alone (both had found smaller answers the budget left no room for)."""


def default_budget(candidate_nodes: int) -> int:
    """``2*ceil(log2 L) + 10`` evaluations for ``L`` candidate nodes, plus :data:`REFINE_EVALS`."""
    return 2 * math.ceil(math.log2(max(candidate_nodes, 2))) + 10 + REFINE_EVALS


def _check_allow(allow: Sequence[str]) -> tuple[str, ...]:
    out = tuple(dict.fromkeys(a.strip() for a in allow if a.strip()))
    bad = [a for a in out if a not in ACTIONS]
    if bad or not out:
        raise QDebugError(
            f"--allow got {', '.join(bad) or 'nothing'}",
            f"use a comma list of {', '.join(ACTIONS)}",
            ExitCode.USAGE,
        )
    if "fp32" not in out and "int16" not in out and "per-channel" not in out:
        raise QDebugError(
            "--allow needs fp32, int16 or per-channel", "e.g. --allow fp32,int16", ExitCode.USAGE
        )
    return out


def check_report_model(report: Report, model: str | Path | None) -> Path:
    """The model file the report was made from (or ``model``), refusing another model (hash mismatch)."""
    from qdebug.files import sha256_file

    path = Path(model) if model is not None else Path(report.model.path)
    if not path.is_file():
        raise QDebugError(
            f"model file {path} (recorded in the report) not found",
            "pass the FP32 model with --model",
            ExitCode.INPUT,
        )
    sha = sha256_file(path)
    if sha != report.model.sha256:
        raise QDebugError(
            f"{path} is not the model the report was made from "
            f"(sha256 {sha[:12]}... vs {report.model.sha256[:12]}...)",
            "re-run qdebug analyze on this model, or pass the original model with --model",
            ExitCode.INPUT,
        )
    return path


def rerank_limit(specs: Sequence[Any], wanted: int, available: int | None) -> int:
    """Samples a re-rank capture reads: ``wanted``, at most the report's calibration samples, and whole
    batches of a fixed batch dimension (a model fixed at 3 had failed: 32 samples fill no batches of 3,
    and the advice to pass --max-samples named a flag propose does not have)."""
    from qdebug.data import fixed_batch

    n = min(wanted, available) if available else wanted
    batch = fixed_batch(specs)
    return max(batch, n - n % batch) if batch > 1 else n


def selective_model_path(output: str | Path) -> Path:
    """Where the selectively quantized model of a proposal goes: ``<stem>.selective.onnx`` next to it."""
    out = Path(output)
    return out.with_name(f"{out.stem}.selective.onnx")


def propose(
    report: Report | str | Path,
    *,
    output: str | Path | None = "proposal.json",
    options: ProposeOptions | None = None,
    model: str | Path | None = None,
    calib: str | Path | None = None,
    eval_data: str | Path | None = None,
    progress: Progress | None = None,
) -> ProposeResult:
    """Search the smallest mixed-precision proposal that meets the target; write it (and its model).

    Args:
        report: the analysis report (or its path).
        output: proposal path; the selective model goes next to it as ``<stem>.selective.onnx`` and
            the normalized model into ``<stem>_files/``. ``None``: write nothing (a temp dir is used).
        options: see :class:`ProposeOptions`.
        model: the FP32 model (default: the path in the report); must hash like the report's model.
        calib: calibration data (default: the report's); ranges come from the cache when present.
        eval_data: evaluation data (default: the report's, else the calibration data).
        progress: callback(stage, done, total).

    The proposal is written even when the target is not met (``result.met`` is then False).

    """
    import tempfile

    from qdebug.files import check_outputs_spare_inputs, check_writable
    from qdebug.report_io import load_report

    start = time.perf_counter()
    options = options or ProposeOptions()
    progress = progress or (lambda stage, done, total: None)
    source = report
    if not isinstance(report, Report):
        report = load_report(report)
    allow = _check_allow(options.allow)
    if options.max_nodes is not None and options.max_nodes < 0:
        raise QDebugError("--max-nodes must be >= 0", "pass a node count", ExitCode.USAGE)
    model_path = check_report_model(report, model)
    calib_src = calib if calib is not None else report.config.calib
    if calib_src is None:
        raise QDebugError("the report records no calibration data", "pass --calib", ExitCode.INPUT)
    eval_src = eval_data if eval_data is not None else (report.config.eval or calib_src)
    if output is not None:
        check_writable(output)
        check_outputs_spare_inputs(
            {"the proposal": output, "the selective model": selective_model_path(Path(output))},
            {
                "the report": source if isinstance(source, (str, Path)) else None,
                "the model": model_path,
                "the calibration data": calib_src,
                "the evaluation data": eval_src,
            },
        )
    with tempfile.TemporaryDirectory(prefix="qdebug-propose-") as tmp:
        from qdebug.files import artifacts_dir, removed_on_failure

        workdir = artifacts_dir(Path(output)) if output is not None else Path(tmp)
        outputs = [output, selective_model_path(output)] if output is not None else []
        inputs = [source if isinstance(source, (str, Path)) else None, model_path, calib_src, eval_src]
        with removed_on_failure(workdir if output is not None else None, outputs, inputs):
            return _propose(
                report, model_path, calib_src, eval_src, workdir, output, options, allow, progress, start
            )


def _propose(
    report: Report,
    model_path: Path,
    calib_src: str | Path,
    eval_src: str | Path,
    workdir: Path,
    output: str | Path | None,
    options: ProposeOptions,
    allow: tuple[str, ...],
    progress: Progress,
    start: float,
) -> ProposeResult:
    from qdebug.capture import SessionConfig
    from qdebug.data import data_notes, open_data
    from qdebug.evaluate import Evaluator, metric_scope_note
    from qdebug.files import atomic_write_text
    from qdebug.graph.load import save_model
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quantize import QuantSpec
    from qdebug.report_io import dumps

    cfg = report.config
    aopts = AnalyzeOptions(
        method=cfg.method,
        per_channel=cfg.per_channel,
        activation_type=cfg.activation_type,
        weight_type=cfg.weight_type,
        batch_size=cfg.batch_size,
        max_samples=cfg.max_samples,
        metric=options.metric or cfg.metric,
        upgrade_opset=cfg.upgrade_opset,
        inline_constant_if=cfg.inline_constant_if,
        use_cache=options.use_cache,
        providers=options.providers,
        threads=options.threads,
    )
    progress("prepare", 0, None)
    prep = prepare(model_path, calib_src, workdir, aopts, progress=progress)
    assert prep.ranges is not None
    names = {n.name for n in prep.normalized.graph.node}
    missing = [n.name for n in report.nodes if n.name not in names]
    if missing:
        raise QDebugError(
            f"the report's nodes do not match the normalized model "
            f"({len(missing)} missing: {missing[0]!r}...)",
            "re-run qdebug analyze with this qdebug version",
            ExitCode.INPUT,
        )
    config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
    eval_set = open_data(
        eval_src,
        prep.calib.specs,
        batch_size=cfg.batch_size,
        max_samples=options.eval_max_samples,
        what="evaluation data",
        limit_flag="--eval-max-samples",
    )
    evaluator = Evaluator(prep.normalized, eval_set, config, options.metric or cfg.metric)
    input_notes = data_notes(prep.calib, eval_set, prep.normalized)
    input_notes += [n for n in [metric_scope_note(evaluator)] if n]
    target = make_target(evaluator.metric_name, evaluator.fp32_value, evaluator.samples, options)

    structure = Structure(prep.normalized, report.nodes)
    initial = rank_units(structure, report.nodes, report.weights)
    candidate_nodes = len({n for u in initial for n in u.nodes})
    budget = options.max_evaluations or default_budget(candidate_nodes)
    base_spec = QuantSpec(
        per_channel=cfg.per_channel, activation_type=cfg.activation_type, weight_type=cfg.weight_type
    )
    int16_type = "QInt16" if cfg.activation_type == "QInt8" else "QUInt16"
    search = Search(
        prep.normalized,
        prep.ranges,
        base_spec,
        evaluator,
        target,
        structure,
        budget,
        int16_type,
        progress,
        options.max_nodes,
    )
    if options.max_evaluations is None:
        search.held = REFINE_EVALS
    limit = rerank_limit(prep.calib.specs, options.rerank_samples, prep.calib.n_samples)
    opened: list[Any] = []  # opened on the first re-rank: a search that needs none reads no data for it

    def rerank(plan: Plan, widen: bool) -> list[Unit]:
        progress("re-rank", 0, None)
        if not opened:
            opened.append(
                open_data(calib_src, prep.calib.specs, batch_size=cfg.batch_size, max_samples=limit)
            )
        nodes, weights = _capture_nodes(search, plan, opened[0], config, prep.ranges, prep.name_map)
        excluded, overridden = frozenset(plan.nodes()), frozenset(plan.overrides())
        return rank_units(structure, nodes, weights, excluded, overridden, widen=widen)

    widened = rank_units(structure, report.nodes, report.weights, widen=True)
    plan, met, reranks = run_search(search, initial, rerank, allow, options.max_nodes, widened)
    plan, final = _final(search, plan, met)
    spec, selective, _ = search.build(final.nodes, final.overrides, final.per_channel)
    if spec.per_channel and not report.config.per_channel:
        from qdebug.graph.match import qdq_settings

        final = _without_per_channel(search, final, bool(qdq_settings(selective).per_channel))
        if not final.per_channel:
            spec, selective, _ = search.build(final.nodes, final.overrides, False)
    static = search.trials[0]
    seconds = time.perf_counter() - start
    sel_path = selective_model_path(output) if output is not None else None
    proposal = Proposal(
        schema_version=SCHEMA_VERSION,
        kind="proposal",
        model_path=str(model_path.resolve()),
        model_sha256=report.model.sha256,
        normalized_model=str(prep.normalized_path.resolve())
        if output is not None
        else report.normalized_model,
        nodes_to_exclude=spec.nodes_to_exclude,
        tensor_overrides=spec.tensor_overrides,
        per_channel=spec.per_channel,
        reasons=_reasons(report, plan, spec, target, static, final, search.trials),
        metric=target.metric if target.kind == "drop" else "output_sqnr_db",
        fp32_metric=target.fp32 if target.kind == "drop" else math.inf,
        static_metric=_tval(target, static),
        expected_metric=_tval(target, final),
        evaluations=len(search.trials),
        search_seconds=seconds,
        source="propose",
        quantized_model=str(sel_path.resolve()) if sel_path is not None else None,
        snippet=_snippet(report, model_path, prep, spec, calib_src),
        quantizable_nodes=len(structure.excludable),
        qdq_pairs_delta=final.qdq_pairs - static.qdq_pairs,
        method=cfg.method,
        activation_type=cfg.activation_type,
        weight_type=cfg.weight_type,
        base_per_channel=cfg.per_channel,
        calibration_key=prep.ranges.key if prep.ranges is not None else "",
        calib_max_samples=cfg.max_samples,
        eval_samples=search.evaluator.samples,
    )
    if output is not None and sel_path is not None:
        save_model(selective, sel_path)
        atomic_write_text(output, dumps(proposal))
    return ProposeResult(
        proposal=proposal,
        met=final.met and search.fits(final),
        target=target,
        candidates=candidate_nodes,
        units=tuple(initial),
        trials=tuple(search.trials),
        reranks=reranks,
        max_evaluations=budget,
        seconds=seconds,
        proposal_path=str(output) if output is not None else None,
        notes=(*input_notes, *_notes(report), *_nothing_quantized(final, static)),
    )


def _nothing_quantized(final: Trial, static: Trial) -> tuple[str, ...]:
    """A note when the selective model keeps no Q/DQ pair: "MET" then means "do not quantize" (a proposal
    keeping every quantizable node FP32 had been reported as met without a word)."""
    if final.qdq_pairs > 0 or static.qdq_pairs == 0:
        return ()
    return (
        "the selective model has no quantization left (0 Q/DQ pairs, static has "
        f"{static.qdq_pairs}): on this target, quantizing this model does not pay; try a looser "
        "--target-drop or 16-bit activations (--allow fp32,int16), or keep the model FP32",
    )


def _notes(report: Report) -> tuple[str, ...]:
    if not report.config.quantized_given:
        return ()
    return (
        "the report analyzed a quantized model given with --quantized; here the static baseline and every "
        f"candidate are rebuilt from qdebug's own calibration ({report.config.method}, "
        f"{'per-channel' if report.config.per_channel else 'per-tensor'} weights, "
        f"{report.config.activation_type}/{report.config.weight_type}), so 'static' can differ from that file",
    )


def _snippet(report: Report, model_path: Path, prep: Any, spec: Any, calib_src: str | Path) -> str:
    """The quantize_static snippet; on the normalized model when an excluded node had no (unique) name."""
    from qdebug.data import fixed_batch
    from qdebug.quantize import float16_exclusions, quantize_snippet

    # float16 nodes are excluded from every variant qdebug builds; plain ORT needs them spelled out
    excluded = tuple(spec.nodes_to_exclude)
    excluded += tuple(n for n in float16_exclusions(prep.normalized) if n not in excluded)
    renamed = {new for new, old in prep.name_map.items() if new != old}
    target_model = prep.normalized_path if any(n in renamed for n in excluded) else model_path
    return quantize_snippet(
        str(Path(target_model).resolve()),
        excluded,
        method=report.config.method,
        per_channel=spec.per_channel,
        activation_type=report.config.activation_type,
        weight_type=report.config.weight_type,
        tensor_overrides=spec.tensor_overrides,
        calib_hint=str(calib_src),
        batch=fixed_batch(prep.calib.specs),  # a fixed batch dimension accepts nothing else
        max_samples=report.config.max_samples,
        inputs=[s.name for s in prep.calib.specs],
    )


def _tval(target: Target, trial: Trial) -> float:
    return trial.output_sqnr_db if target.kind == "sqnr" else trial.value


def _without_per_channel(search: Search, final: Trial, in_effect: bool) -> Trial:
    """``final`` without per-channel weights when they do not earn their place.

    Per-channel is adopted before the exclusions are searched; once they are
    found it may change nothing (no weight with more than one scale is left)
    or even hurt (on a depthwise CNN the final set scored 41.2 dB with it and
    43.9 dB without). One more evaluation decides: the set without it is kept
    when it meets the target as well, or scores at least as high.
    """
    if not in_effect:  # the same model either way: no evaluation needed
        return dataclasses.replace(final, per_channel=False)
    plain = search.evaluate("without per-channel", final.nodes, final.overrides, per_channel=False)
    if plain is None:  # the budget is spent
        return final
    if (plain.met and final.met) or (plain.met, search.score(plain)) >= (final.met, search.score(final)):
        return plain
    return final


def _final(search: Search, plan: Plan, met: Trial | None) -> tuple[Plan, Trial]:
    """The met trial if it fits ``max_nodes``; else the best trial that fits (fewest nodes among equals)."""
    if met is not None and search.fits(met):
        return plan, met
    fitting = [t for t in [*search.trials, *search.equivalents] if search.fits(t)]
    best = max(fitting, key=lambda t: (t.met, search.score(t), -len(t.nodes) - len(t.overrides)))
    nodes, overrides = set(best.nodes), set(best.overrides)
    fp32 = tuple(u for u in plan.fp32 if set(u.nodes) <= nodes)
    int16 = tuple(u for u in plan.int16 if set(u.tensors) & overrides)
    return Plan(fp32, int16), best


def _reasons(
    report: Report,
    plan: Plan,
    spec: Any,
    target: Target,
    static: Trial,
    final: Trial,
    trials: Sequence[Trial] = (),
) -> tuple[NodeReason, ...]:
    """One reason per excluded node (and per 16-bit unit), with the numbers behind it."""
    by_name = {n.name: n for n in report.nodes}
    producer_of = {o: n.name for n in report.nodes for o in n.outputs}
    measured = f"measured: {_fmt(target, static)} -> {_fmt(target, final)}; target {target.describe()}"
    out: list[NodeReason] = []
    placed: set[str] = set()

    def reason(node: str, action: str, text: str, region: int = -1) -> NodeReason:
        rec = by_name.get(node)
        return NodeReason(
            node=node,
            original_name=rec.original_name if rec else node,
            op_type=rec.op_type if rec else "",
            action=action,
            reason=f"{text}; {measured}",
            introduced_db=rec.introduced_db if rec else math.nan,
            local_sqnr_db=rec.local_sqnr_db if rec else math.nan,
            region=region,
        )

    for k, u in enumerate(plan.fp32):
        keeps = (
            f"keeps {u.key} float"
            if u.kind == "tensor"
            else "the start of a region cut to fit --max-nodes"
            if u.kind == "node"
            else f"keeps the {u.kind} region float"
        )
        for n in u.nodes:
            if n in spec.nodes_to_exclude and n not in placed:
                placed.add(n)
                if u.kind != "tensor":
                    role = "part of the region"
                elif producer_of.get(u.key) == n:
                    role = "produces it"
                else:
                    role = "reads it, would re-quantize it"
                if n == u.blamed:
                    role += ", its introduced error is blamed here"
                out.append(reason(n, "fp32", f"{keeps} ({role}); {u.why}", k))
    for n in spec.nodes_to_exclude:
        if n not in placed:
            out.append(reason(n, "fp32", "neighbour kept FP32 so that a tensor stays float in ORT's rewrite"))
    for k, u in enumerate(plan.int16, start=len(plan.fp32)):
        out.append(
            reason(
                u.blamed,
                "int16",
                f"16-bit activations on {', '.join(u.tensors)} instead of keeping {', '.join(u.nodes)} FP32 "
                f"(cheaper: weights stay 8-bit, no FP32 kernels); {u.why}",
                k,
            )
        )
    if spec.per_channel and not report.config.per_channel:
        # its own step's gain, not the whole proposal's (which credited it with the exclusions' gain too)
        alone = next((t for t in trials if t.step == "per-channel"), None)
        gain = f"{_fmt(target, static)} -> {_fmt(target, alone)} alone" if alone is not None else measured
        out.append(
            NodeReason(
                "",
                "",
                "",
                "per-channel",
                f"per-channel weights for the whole model improved the metric: {gain}; "
                f"target {target.describe()}",
            )
        )
    return tuple(out)


def _fmt(target: Target, trial: Trial) -> str:
    v = _tval(target, trial)
    if target.kind == "sqnr":
        return f"{v:.1f} dB"
    if target.metric in ACCURACY_METRICS:
        return f"{100 * v:.2f}%"
    return f"{v:.4g}"


def _capture_nodes(
    search: Search, plan: Plan, data: Any, config: Any, ranges: Ranges, name_map: dict[str, str]
) -> tuple[tuple[NodeRecord, ...], tuple[WeightRecord, ...]]:
    """Node records of the current variant: a short layer capture on a few calibration samples."""
    from qdebug.analysis import measure_layers, node_records, quantized_node_names, weight_records
    from qdebug.graph.match import pair_models

    _, model, _ = search.build(plan.nodes(), plan.overrides(), keep_float=plan.keep_float())
    pairing = pair_models(search.normalized, model)
    # re-ranking needs local and accumulated error only, not the fake-quant view
    layers = measure_layers(
        search.normalized, model, pairing, data, config, ranges.minmax(), fakequant_samples=0
    )
    qnodes = quantized_node_names(model, pairing)
    nodes = node_records(search.normalized, layers.tensors, qnodes, name_map)
    return nodes, weight_records(search.normalized, model, pairing)
