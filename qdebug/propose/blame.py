"""Blame: which tensor each node's introduced error belongs to, and the candidate units, worst first.

Each node's introduced error (``NodeRecord.introduced_db``) is attributed to a
*tensor*: to the node's output when its own Q/DQ (local SQNR) or weight
quantization explains the error at its output, else to its inputs -- an error
far larger than what the node's own quantization adds is error from upstream
made visible (typically outlier channels that a per-tensor SQNR hides until a
LayerNorm or projection amplifies them).

ORT keeps a tensor float only if *no* neighbour quantizes it: a quantized
consumer rewires every consumer, an excluded one included, to the
DequantizeLinear output. So a candidate is a :class:`Unit`: the tensor's
producer plus all its quantized consumers (plus the whole pattern when one of
them is inside a decomposed pattern). :func:`rank_units` orders them, given
what a plan already keeps float, for the search to try.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qdebug.propose.structure import Structure
from qdebug.records import NodeRecord, WeightRecord

MIN_INTRODUCED_DB = 0.5
"""Nodes introducing less error than this are not candidates."""
HARMLESS_SQNR_DB = 30.0
"""A node whose output is still this accurate (accumulated SQNR) is not blamed for its own output."""
INPUT_DRIVEN_MARGIN_DB = 6.0
"""Error at a node's output this far above what its own Q/DQ and weights add is blamed on its inputs."""


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
