"""Diagnoses as candidates: the tensors analyze's own findings point at, tried before the ranked search.

The ranking blames nodes by the error they *introduce*, and some culprits introduce little where they
sit: a Concat that joins box coordinates ([1, 320]) with sigmoid scores ([0, 1]) under one scale wipes the
scores out, but the error shows in whatever reads them. analyze names these patterns in its notes; here
the same measurements (from the report's tensor records) become units that the search tries on their
own first, so a detector fixed by one Concat comes back as that one Concat.
"""

from __future__ import annotations

import math

from qdebug.propose.blame import Unit
from qdebug.propose.structure import Structure
from qdebug.records import NodeRecord, Report, TensorRecord
from qdebug.records.report import from_exact_input

CONCAT_RANGE_RATIO = 50.0
"""Concat inputs whose ranges differ by more than this share one scale badly (as analyze's note says)."""
COLLAPSED_SHARE = 0.5
"""A tensor with this share of its values in one quantization step has lost them (as analyze's note)."""
OUTLIER_RATIO = 30.0
"""A range this many standard deviations wide is set by a few outliers (a residual stream's hot channels)."""
HURT_DB = 10.0
"""...when a consumer then introduces at least this much error (the damage shows downstream)."""
MAX_DIAGNOSED = 8
"""Most diagnosed units tried before the ranking (the worst first)."""


def diagnosed_units(structure: Structure, report: Report) -> list[Unit]:
    """Units keeping float what the report's measurements single out, worst first, at most
    :data:`MAX_DIAGNOSED`: mixed-range Concats, tensors collapsed into one quantization step, and
    tensors whose range a few outliers set."""
    tensors = {t.name: t for t in report.tensors}
    nodes = {n.name: n for n in report.nodes}
    found: list[tuple[float, str, str]] = []  # (severity, tensor, why)
    for node in structure.model.graph.node:
        out = tensors.get(node.output[0]) if node.op_type == "Concat" and node.output else None
        if out is not None and out.quant is not None and _lossy(out):  # one shared scale that loses
            hit = _mixed_concat(node.name, [tensors[i] for i in node.input if i in tensors])
            if hit is not None:
                found.append((hit[0], node.output[0], hit[1]))
    for t in tensors.values():
        hit = _collapsed(t, nodes) or _outliers(t, nodes)
        if hit is not None:
            found.append((hit[0], t.name, hit[1]))
    units: dict[tuple[str, ...], Unit] = {}
    for severity, tensor, why in sorted(found, key=lambda f: -f[0]):
        if tensor not in structure.activations:
            continue
        kind, members, kept = structure.unit_for(tensor)
        if members and members not in units:
            key = tensor if kind == "tensor" else f"pattern:{members[0]}"
            units[members] = Unit(key, kind, members, kept, severity, members[0], f"diagnosed: {why}")
    return list(units.values())[:MAX_DIAGNOSED]


def _span(t: TensorRecord) -> float:
    """Width of the range a uint8 scale must cover (0 included, as ORT's calibration does)."""
    assert t.summary is not None
    return max(t.summary.max, 0.0) - min(t.summary.min, 0.0)


def _mixed_concat(name: str, parts: list[TensorRecord]) -> tuple[float, str] | None:
    spans = [(_span(t), t) for t in parts if t.summary is not None]
    spans = [(s, t) for s, t in spans if math.isfinite(s) and s > 0]
    if len(spans) < 2:
        return None
    (lo, small), hi = min(spans, key=lambda x: x[0]), max(s for s, _ in spans)
    if hi <= CONCAT_RANGE_RATIO * lo:
        return None
    return hi / lo, f"Concat {name} joins ranges {hi / lo:.0f}x apart: one scale wipes out {small.name}"


def _collapsed(t: TensorRecord, nodes: dict[str, NodeRecord]) -> tuple[float, str] | None:
    h, q = t.histogram, t.quant
    if h is None or q is None or t.summary is None or not (math.isfinite(q.scale) and q.scale > 0):
        return None
    if not _lossy(t):
        return None
    total = sum(h.ref_counts)
    if not total or max(h.ref_counts) < COLLAPSED_SHARE * total:
        return None
    hurt = _worst_consumer(t, nodes)
    if hurt is None:
        return None
    share = max(h.ref_counts) / total
    return 100 * share, f"{share:.0%} of {t.name}'s values share one quantization step; {hurt} then loses"


def _outliers(t: TensorRecord, nodes: dict[str, NodeRecord]) -> tuple[float, str] | None:
    s = t.summary
    if s is None or t.quant is None or not _lossy(t) or not (s.std > 0):
        return None
    ratio = max(abs(s.min - s.mean), abs(s.max - s.mean)) / s.std
    if ratio < OUTLIER_RATIO:
        return None
    hurt = _worst_consumer(t, nodes)
    if hurt is None:
        return None
    return ratio, f"{t.name}'s range is set by outliers ({ratio:.0f} standard deviations); {hurt} then loses"


def _lossy(t: TensorRecord) -> bool:
    """Its own Q/DQ loses something measurable: not a constant, not exactly representable (inf dB)."""
    if t.summary is not None and t.summary.min == t.summary.max:
        return False
    return t.local is not None and math.isfinite(t.local.sqnr_db)


def _worst_consumer(t: TensorRecord, nodes: dict[str, NodeRecord]) -> str | None:
    hurt = [nodes[c] for c in t.consumers if c in nodes and math.isfinite(nodes[c].introduced_db)]
    # a capped number from exact inputs is no damage (analyze's notes read it the same way)
    hurt = [n for n in hurt if n.introduced_db >= HURT_DB and not from_exact_input(n)]
    if not hurt:
        return None
    worst = max(hurt, key=lambda n: n.introduced_db)
    return f"{worst.name} ({worst.op_type}) introduces {worst.introduced_db:.1f} dB"
