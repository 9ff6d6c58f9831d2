"""The TUI's view model: plain Python over a :class:`~qdebug.records.Report`.

Everything the terminal UI decides - row order, filters, the exclusion set,
graph neighbours, the comparison columns against a baseline report
(:mod:`qdebug.tui.compare`), the findings (the report's notes and the names they
mention), the exported :class:`~qdebug.records.Proposal` and its
``quantize_static`` snippet - lives here, so it is unit-testable without
Textual; so does :class:`TuiContext`, the session's run state (files, bench
results, the verify callable) that the app hands to its main screen. This
module must never import ``textual``, ``onnxruntime`` or ``onnx`` (a test
checks ``sys.modules``): the snippet comes from :mod:`qdebug.output.snippet`, which is
pure text.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdebug.output.formatting import (
    ACCURACY_METRICS,
    MIN_NAME_WIDTH,  # names are never cut shorter (the table scrolls sideways instead)
    cells,
    common_prefix,
    distinct_shortened,
    shorten,
)
from qdebug.output.snippet import quantize_snippet
from qdebug.records import (
    SCHEMA_VERSION,
    FrontierPoint,
    NodeReason,
    NodeRecord,
    Proposal,
    Report,
    TensorRecord,
    WeightRecord,
)
from qdebug.records.profile import NodeLatency
from qdebug.records.verify import speed_ratio
from qdebug.tui.compare import Baseline, change_text, change_value, judge
from qdebug.tui.findings_model import (  # noqa: F401 -- match_names re-exported: the findings' old home
    Finding,
    is_excludable,
    match_names,
    note_findings,
)
from qdebug.vocabulary import RUN_TIME_OPS, quantizer_of

if TYPE_CHECKING:
    from qdebug.records.bench import BenchReport
    from qdebug.records.diff import NodeChange

HAND_REASON = "excluded by hand in the TUI"
"""Reason text of nodes the user excluded in the TUI (followed by their numbers)."""

VerifyFn = Callable[[Proposal, Callable[[float, str], None], Callable[[], bool]], Any]
"""``verify_fn(proposal, progress, cancelled) -> result`` where ``result.summary_lines() -> list[str]``.

Called in a worker thread; ``progress(fraction, text)`` may be called from
that thread; ``cancelled()`` turns True when the user presses escape, and the
callable should then return soon (its result is discarded).
"""


@dataclass(frozen=True)
class TuiContext:
    """What one TUI session was started with, besides the report: the main screen reads it.

    The app builds it once and hands it to :class:`~qdebug.tui.screens.MainScreen`: the screen
    reads its run state here rather than from the App, so it can be built without this App and
    ``screens`` does not import ``app``.
    """

    report_path: str | None
    """The report's file (``None``: built in memory); the export must never overwrite it."""
    export_path: Path
    """Where ``e`` proposes to write the proposal."""
    inputs: dict[str, str | Path | None] = field(default_factory=dict)
    """Files this session read (proposal, bench results): the export must never overwrite them."""
    bench: BenchReport | None = None
    """``qdebug bench`` results shown by ``b`` (``None``: ``b`` says how to make them)."""
    verify_fn: VerifyFn | None = None
    """Runs verify on the current set (``None``: the report's model or data are not reachable)."""


@dataclass(frozen=True)
class Column:
    """One column of the node table and how it sorts."""

    key: str
    label: str
    numeric: bool
    descending: bool
    """Default direction on first selection: worst first (high introduced dB, low SQNR)."""
    title: str = ""
    """What the column means (help screen)."""


COLUMNS: tuple[Column, ...] = (
    Column("name", "Node", numeric=False, descending=False, title="node name (normalized model)"),
    Column("op", "Op", numeric=False, descending=False, title="op type"),
    Column("local", "Local", numeric=True, descending=False, title="local SQNR, dB: error of its own Q/DQ"),
    Column(
        "accumulated",
        "Accum",
        numeric=True,
        descending=False,
        title="accumulated SQNR, dB: FP32 vs quantized",
    ),
    Column(
        "added",
        "Added",
        numeric=True,
        descending=True,
        title="added noise, dB re. signal: what the node adds (sums over nodes)",
    ),
    Column(
        "introduced", "Intro", numeric=True, descending=True, title="introduced dB: SQNR drop across the node"
    ),
    Column("kl", "KL", numeric=True, descending=True, title="KL divergence FP32 -> quantized, nats"),
    Column("excluded", "X", numeric=False, descending=True, title="excluded (kept in FP32)"),
)
COLUMN_KEYS: tuple[str, ...] = tuple(c.key for c in COLUMNS)
DEFAULT_SORT = "added"

COMPARE_COLUMNS: tuple[Column, ...] = (
    Column(
        "added_delta",
        "ΔAdd",
        numeric=True,
        descending=True,
        title="added noise minus the baseline's, dB: + is worse (blank: not in the baseline)",
    ),
    Column(
        "accumulated_delta",
        "ΔAcc",
        numeric=True,
        descending=False,
        title="accumulated SQNR minus the baseline's, dB: - is worse",
    ),
)
"""Columns a loaded baseline (``--against``) adds after :data:`COLUMNS`: after them, so that the keys 1-8
keep their columns whether or not a baseline is loaded."""

PROFILE_COLUMNS: tuple[Column, ...] = (
    Column(
        "int8_ms",
        "INT8 ms",
        numeric=True,
        descending=True,
        title="the node's INT8 time per run, its Q/DQ kernels included (analyze --profile)",
    ),
    Column(
        "lost_ms",
        "Lost ms",
        numeric=True,
        descending=True,
        title="INT8 time (with its Q/DQ) minus FP32 time per run: + INT8 loses time here, - it saves some",
    ),
)
"""Columns a report made with ``analyze --profile`` adds last: where INT8 saves or loses time, node by node."""
PROFILE_KEYS = frozenset(c.key for c in PROFILE_COLUMNS)

DELTA_FIELDS: dict[str, tuple[str, bool]] = {
    "added_delta": ("added_noise_delta_db", True),
    "accumulated_delta": ("accumulated_sqnr_delta_db", False),
}
"""Comparison column -> (its :class:`~qdebug.records.diff.NodeChange` field, whether up is worse)."""


def column(key: str) -> Column:
    """The column with ``key``, comparison columns included (KeyError for an unknown key)."""
    for c in COLUMNS + COMPARE_COLUMNS + PROFILE_COLUMNS:
        if c.key == key:
            return c
    raise KeyError(key)


# --------------------------------------------------------------------------- formatting


def fmt_db(x: float, digits: int = 1) -> str:
    """A dB value for display: ``+inf``, ``-inf``, ``nan`` spelled out, else fixed-point."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    text = f"{x:.{digits}f}"
    return text[1:] if text.startswith("-") and not text.strip("-0.") else text  # no "-0.0"


def fmt_num(x: float) -> str:
    """A general float (KL, MSE, scale) in 4 significant digits; non-finite spelled out."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def fmt_small(x: float) -> str:
    """A small non-negative number (KL in nats) in at most 6 characters: ``0.0106``, ``6.0e-3``, ``0``."""
    if math.isnan(x) or math.isinf(x) or x < 0:
        return fmt_num(x)
    if x == 0:
        return "0"
    if 0.01 <= x < 1000:
        return f"{x:.3g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt_metric(name: str, x: float) -> str:
    """A task metric value: percent for accuracies (as the CLI prints it), else 4 significant digits."""
    if math.isnan(x):
        return "-"
    if name in ACCURACY_METRICS:
        return f"{100 * x:.2f}%"
    return f"{x + 0.0:.4g}"  # + 0.0: a metric of -0.0 printed as "-0"


def fmt_metric_delta(name: str, d: float) -> str:
    """A signed metric difference: percentage points for accuracies."""
    if math.isnan(d):
        return "-"
    if name in ACCURACY_METRICS:
        return f"{100 * d:+.2f} pts"
    return f"{d:+.4g}"


# --------------------------------------------------------------------------- table layout


CELL_TEXT = {
    "local": lambda n: fmt_db(n.local_sqnr_db),
    "accumulated": lambda n: fmt_db(n.accumulated_sqnr_db),
    "added": lambda n: fmt_db(n.added_noise_db),
    "introduced": lambda n: fmt_db(n.introduced_db),
    "kl": lambda n: fmt_small(n.kl),
}
"""How each numeric column writes a node's value in the table."""

_OP_ABBREVIATIONS = (("Normalization", "Norm"), ("Average", "Avg"))
MAX_OP_WIDTH = 14
"""Longest op type shown when the table is short of space (custom ops beyond it end in ``…``)."""


def short_op(op: str) -> str:
    """``op`` with standard abbreviations (``LayerNormalization`` -> ``LayerNorm``)."""
    for long, short in _OP_ABBREVIATIONS:
        op = op.replace(long, short)
    return op


def middle_ellipsis(text: str, width: int) -> str:
    """``text`` cut to ``width`` cells by replacing its middle with ``…`` (:func:`qdebug.output.formatting.shorten`,
    the one shortening every table uses)."""
    return shorten(text, width)


@dataclass(frozen=True)
class TableLayout:
    """Column widths of the node table for a given width (each includes a one-cell gap)."""

    widths: dict[str, int]
    short_ops: bool
    """Op types are abbreviated (``LayerNorm``) because the full names do not fit."""
    prefix: str = ""
    """Start common to every node name, dropped from the name column because the names did not fit
    (the column header says it; the detail pane shows the full name)."""
    renamed: tuple[tuple[str, str], ...] = ()
    """(name, shown) for the few names that plain middle elision would have made equal to another
    (:func:`~qdebug.output.formatting.distinct_shortened`); a tuple, so layouts still compare cheaply."""

    @property
    def total(self) -> int:
        """Width of all columns together."""
        return sum(self.widths.values())

    @cached_property
    def _renamed(self) -> dict[str, str]:
        return dict(self.renamed)

    def name(self, name: str) -> str:
        """A node name as the table shows it: the common prefix dropped, cut in the middle to fit."""
        if name in self._renamed:
            return self._renamed[name]
        if self.prefix and name.startswith(self.prefix):
            name = name[len(self.prefix) :]
        return shorten(name, self.widths["name"] - 1)

    def op(self, op: str) -> str:
        """An op type as the table shows it."""
        op = short_op(op) if self.short_ops else op
        width = self.widths["op"] - 1
        return op if len(op) <= width else op[: max(width - 1, 0)] + "…"


def table_layout(
    nodes: Sequence[NodeRecord],
    available: int | None = None,
    extra: Sequence[tuple[Column, Callable[[NodeRecord], str]]] = (),
) -> TableLayout:
    """Widths that show every number in full and give the names what is left of ``available`` cells.

    Numeric columns are as wide as their longest value (or label plus sort
    arrow) plus a gap. When the natural widths do not fit, the prefix common to
    all names is dropped first, then op types are abbreviated, then names cut
    in the middle (kept distinct). ``None``: natural widths. ``extra``: numeric
    columns after :data:`COLUMNS`, each with its cell text
    (:meth:`LayerModel.extra_cells`: the comparison columns).
    """
    widths: dict[str, int] = {}
    texts = [(c, CELL_TEXT[c.key]) for c in COLUMNS if c.numeric] + list(extra)
    for col, fmt in texts:
        widths[col.key] = 1 + max([len(col.label) + 1, *(len(fmt(n)) for n in nodes)])
    widths["excluded"] = 2
    fixed = sum(widths.values())
    name_w = 1 + max([len("Node"), *(cells(n.name) for n in nodes)])
    op_w = 1 + max([len("Op"), *(len(n.op_type) for n in nodes)])
    short_w = 1 + max([len("Op"), *(len(short_op(n.op_type)) for n in nodes)])
    short_ops = False
    prefix = ""
    if available is not None and fixed + op_w + name_w > available:
        prefix = common_prefix([n.name for n in nodes])
        name_w = 1 + max([len("Node"), *(cells(n.name) - cells(prefix) for n in nodes)])
    if available is not None and fixed + op_w + name_w > available:
        short_ops = True
        op_w = min(short_w, MAX_OP_WIDTH + 1)
        name_w = max(min(name_w, available - fixed - op_w), MIN_NAME_WIDTH + 1)
    widths["name"] = name_w
    widths["op"] = op_w
    return TableLayout(
        widths={c.key: widths[c.key] for c in (*COLUMNS, *(c for c, _ in extra))},
        short_ops=short_ops,
        prefix=prefix,
        renamed=_renamed([n.name[len(prefix) :] for n in nodes], prefix, name_w - 1),
    )


def _renamed(stripped: list[str], prefix: str, width: int) -> tuple[tuple[str, str], ...]:
    """The (full name, shown) pairs where keeping rows distinct changed plain middle elision."""
    shown = distinct_shortened(stripped, width)
    return tuple(
        (prefix + name, s) for name, s in zip(stripped, shown, strict=True) if s != shorten(name, width)
    )


# --------------------------------------------------------------------------- fuzzy search


_SEPARATORS = "/._-:"


def fuzzy_score(query: str, text: str) -> int | None:
    """Score how well ``query`` matches ``text`` as a case-insensitive fuzzy search.

    Whitespace splits the query into terms that must all match. A term matches
    when its characters occur in order in ``text`` (a subsequence). Consecutive
    characters and characters at the start of a name segment (after ``/``,
    ``.``, ``_``, ``-``, ``:``) score higher. Returns ``None`` when a term does not
    match; an empty query matches everything with score 0.
    """
    total = 0
    low = text.lower()
    for term in query.lower().split():
        score = _term_score(term, low)
        if score is None:
            return None
        total += score
    return total


def _term_score(term: str, text: str) -> int | None:
    if term in text:  # a substring beats any scattered match
        i = text.index(term)
        bonus = 2 if i == 0 or text[i - 1] in _SEPARATORS else 0
        return 3 * len(term) + bonus + 10
    score = 0
    pos = 0
    prev = -2
    for ch in term:
        i = text.find(ch, pos)
        if i < 0:
            return None
        score += 1
        if i == prev + 1:
            score += 2
        if i == 0 or text[i - 1] in _SEPARATORS:
            score += 2
        prev = i
        pos = i + 1
    return score


# --------------------------------------------------------------------------- sorting


def _numeric_sort(nodes: Sequence[NodeRecord], value, descending: bool) -> list[NodeRecord]:
    """Finite values by direction, then the infinities, then nan (ties keep topological order).

    Non-finite values are edge cases (an exact match, an undefined ratio): they
    never crowd out the finite numbers at the top, whatever the direction.
    """
    finite = [n for n in nodes if math.isfinite(value(n))]
    infinite = [n for n in nodes if math.isinf(value(n))]
    nans = [n for n in nodes if math.isnan(value(n))]
    finite.sort(key=value, reverse=descending)
    infinite.sort(key=value, reverse=descending)
    return finite + infinite + nans


_VALUES = {
    "local": lambda n: n.local_sqnr_db,
    "accumulated": lambda n: n.accumulated_sqnr_db,
    "added": lambda n: n.added_noise_db,
    "introduced": lambda n: n.introduced_db,
    "kl": lambda n: n.kl,
}


# --------------------------------------------------------------------------- findings


FINDING_REASON = "named by the analysis note"
"""Reason text of nodes excluded from the findings pane (followed by the note)."""


# --------------------------------------------------------------------------- the model


class LayerModel:
    """Sorting, filtering, exclusion and export over one report (and an optional proposal).

    The model is mutable (the user changes the sort, the filters and the
    exclusion set); the report and proposal records it wraps never change.
    """

    def __init__(self, report: Report, proposal: Proposal | None = None, baseline: Baseline | None = None) -> None:
        self.report = report
        self.proposal = proposal
        self.baseline = baseline
        """The report compared against (``--against``): adds :data:`COMPARE_COLUMNS` (``None``: none)."""
        self.sort_key: str = DEFAULT_SORT
        self.descending: bool = column(DEFAULT_SORT).descending
        self.name_query: str = ""
        self.op_filter: str | None = None
        self._index = {n.name: i for i, n in enumerate(report.nodes)}
        self._nodes = {n.name: n for n in report.nodes}
        self._tensors = {t.name: t for t in report.tensors}
        self._weights = {w.name: w for w in report.weights}
        self._latency = {n.name: n for n in report.profile.nodes} if report.profile is not None else {}
        self._producer: dict[str, str] = {}
        self._consumers: dict[str, list[str]] = {}
        for n in report.nodes:
            for out in n.outputs:
                if out:
                    self._producer[out] = n.name
            for inp in n.inputs:
                if inp:
                    users = self._consumers.setdefault(inp, [])
                    if n.name not in users:
                        users.append(n.name)
        self._proposal_reasons: dict[str, NodeReason] = {}
        self.unknown_proposal_nodes: tuple[str, ...] = ()
        """Nodes the loaded proposal names that the report does not have (dropped; the UI warns)."""
        self._excluded: set[str] = set()
        self._by_finding: dict[str, int] = {}
        """Excluded nodes that ``x`` on a finding excluded -> that finding's index (their reason is its note)."""
        if proposal is not None:
            self._proposal_reasons = {r.node: r for r in proposal.reasons}
            self._excluded = {n for n in proposal.nodes_to_exclude if n in self._nodes}
            self.unknown_proposal_nodes = tuple(n for n in proposal.nodes_to_exclude if n not in self._nodes)

    # ----------------------------------------------------------------- lookups

    def node(self, name: str) -> NodeRecord:
        """The node called ``name`` (KeyError if absent)."""
        return self._nodes[name]

    def has_node(self, name: str) -> bool:
        """Whether the report has a node called ``name``."""
        return name in self._nodes

    def tensor(self, name: str) -> TensorRecord | None:
        """The tensor record of ``name``, or ``None`` (weights, tensors without numbers)."""
        return self._tensors.get(name)

    def producer(self, tensor: str) -> str | None:
        """The node producing ``tensor`` (``None`` for graph inputs, weights and constants)."""
        return self._producer.get(tensor)

    def weight(self, name: str) -> WeightRecord | None:
        """The quantized-weight record of initializer ``name``, or ``None``."""
        return self._weights.get(name)

    # ----------------------------------------------------------------- columns and the baseline

    def columns(self) -> tuple[Column, ...]:
        """The node table's columns: :data:`COLUMNS`, :data:`COMPARE_COLUMNS` with a baseline, then
        :data:`PROFILE_COLUMNS` when the report has a profile."""
        compare = COMPARE_COLUMNS if self.baseline is not None else ()
        return COLUMNS + compare + (PROFILE_COLUMNS if self._latency else ())

    def column_keys(self) -> tuple[str, ...]:
        """The keys of :meth:`columns`, in table order."""
        return tuple(c.key for c in self.columns())

    def column(self, key: str) -> Column:
        """Column ``key`` of this table (KeyError for a comparison column without a baseline)."""
        for c in self.columns():
            if c.key == key:
                return c
        raise KeyError(key)

    def change(self, name: str) -> NodeChange | None:
        """How node ``name`` changed from the baseline (``None``: no baseline, or the node has no
        counterpart there)."""
        return self.baseline.change(name) if self.baseline is not None else None

    def delta(self, key: str, node: NodeRecord) -> float:
        """The node's value in comparison column ``key`` (``nan``: unpaired, or a side is undefined), as the
        table sorts it: 0 between two negligible values (:func:`~qdebug.tui.compare.change_value`)."""
        change = self.change(node.name)
        return math.nan if change is None else change_value(change, DELTA_FIELDS[key][0])

    def judgement(self, key: str, node: NodeRecord) -> str:
        """``worse``/``better``/``same`` of the node's delta in column ``key``; ``""`` when it has none."""
        return judge(self.delta(key, node), DELTA_FIELDS[key][1])

    def cell_text(self, key: str, node: NodeRecord) -> str:
        """Node ``node``'s text in numeric column ``key``: blank in a comparison column when unpaired, ``~0``
        between two negligible values (:func:`~qdebug.tui.compare.change_text`)."""
        if key in DELTA_FIELDS:
            change = self.change(node.name)
            return "" if change is None else change_text(change, DELTA_FIELDS[key][0])
        if key in PROFILE_KEYS:
            v = self.latency(key, node)
            return "" if math.isnan(v) else f"{v:+.3f}" if key == "lost_ms" else f"{v:.3f}"
        return CELL_TEXT[key](node)

    def node_latency(self, name: str) -> NodeLatency | None:
        """The profile's times of node ``name`` (None: no profile, or no kernel of its own)."""
        return self._latency.get(name)

    def latency(self, key: str, node: NodeRecord) -> float:
        """The node's number in profile column ``key`` (ms per run; ``nan``: the profile has no kernel of it)."""
        nl = self._latency.get(node.name)
        if nl is None:
            return math.nan
        return nl.int8_ms + nl.qdq_ms if key == "int8_ms" else -nl.saved_ms

    def extra_cells(self) -> tuple[tuple[Column, Callable[[NodeRecord], str]], ...]:
        """The columns after :data:`COLUMNS` with their cell text (for :func:`table_layout`)."""
        def text(key: str) -> Callable[[NodeRecord], str]:
            return lambda n: self.cell_text(key, n)

        return tuple((c, text(c.key)) for c in self.columns()[len(COLUMNS) :])

    def op_types(self) -> tuple[str, ...]:
        """Distinct op types of the report, sorted."""
        return tuple(sorted({n.op_type for n in self.report.nodes}))

    @property
    def sha_mismatch(self) -> bool:
        """True when the loaded proposal was made for another model than the report's."""
        return (
            self.proposal is not None
            and bool(self.proposal.model_sha256)
            and self.proposal.model_sha256 != self.report.model.sha256
        )

    # ----------------------------------------------------------------- order and filters

    def set_sort(self, key: str, descending: bool | None = None) -> None:
        """Sort by column ``key``; selecting the current column again reverses the direction."""
        col = self.column(key)
        if descending is None:
            descending = (not self.descending) if key == self.sort_key else col.descending
        self.sort_key = key
        self.descending = descending

    def cycle_sort(self) -> str:
        """Sort by the next column (in table order) with its default direction; returns its key."""
        keys = self.column_keys()
        i = (keys.index(self.sort_key) + 1) % len(keys)
        self.set_sort(keys[i], self.column(keys[i]).descending)
        return self.sort_key

    def cycle_op_filter(self) -> str | None:
        """Step the op-type filter: all -> first op -> ... -> last op -> all; returns the new filter."""
        ops = self.op_types()
        if self.op_filter is None or self.op_filter not in ops:
            self.op_filter = ops[0] if ops else None
        else:
            i = ops.index(self.op_filter) + 1
            self.op_filter = ops[i] if i < len(ops) else None
        return self.op_filter

    def clear_filters(self) -> None:
        """Show every node again."""
        self.name_query = ""
        self.op_filter = None

    def ordered(self) -> list[NodeRecord]:
        """All nodes in the current sort order (filters ignored)."""
        nodes = list(self.report.nodes)  # topological: the tie-breaker
        key = self.sort_key
        if key in _VALUES:
            return _numeric_sort(nodes, _VALUES[key], self.descending)
        if key in DELTA_FIELDS:  # unpaired nodes (nan) last, like undefined values
            return _numeric_sort(nodes, lambda n: self.delta(key, n), self.descending)
        if key in PROFILE_KEYS:  # nodes without a kernel of their own (nan) last
            return _numeric_sort(nodes, lambda n: self.latency(key, n), self.descending)
        if key == "name":
            return sorted(nodes, key=lambda n: n.name.lower(), reverse=self.descending)
        if key == "op":
            return sorted(nodes, key=lambda n: n.op_type.lower(), reverse=self.descending)
        if key == "excluded":
            # excluded first when descending; within each group the default (sensitivity) order
            base = _numeric_sort(nodes, _VALUES[DEFAULT_SORT], column(DEFAULT_SORT).descending)
            return sorted(base, key=lambda n: n.name in self._excluded, reverse=self.descending)
        raise KeyError(key)

    def matches(self, node: NodeRecord) -> bool:
        """Whether ``node`` passes the op-type and the fuzzy name filter."""
        if self.op_filter is not None and node.op_type != self.op_filter:
            return False
        if self.name_query.strip():
            text = node.name if not node.original_name else f"{node.name} {node.original_name}"
            return fuzzy_score(self.name_query, text) is not None
        return True

    def rows(self) -> list[NodeRecord]:
        """The nodes the table shows, in order."""
        return [n for n in self.ordered() if self.matches(n)]

    # ----------------------------------------------------------------- neighbours

    def predecessors(self, name: str) -> tuple[NodeRecord, ...]:
        """Producers of the node's inputs, in input order (graph inputs and weights have none)."""
        seen: list[str] = []
        for inp in self._nodes[name].inputs:
            p = self._producer.get(inp)
            if p is not None and p != name and p not in seen:
                seen.append(p)
        return tuple(self._nodes[p] for p in seen)

    def successors(self, name: str) -> tuple[NodeRecord, ...]:
        """Consumers of the node's outputs, in topological order."""
        seen: set[str] = set()
        for out in self._nodes[name].outputs:
            seen.update(c for c in self._consumers.get(out, ()) if c != name)
        return tuple(sorted((self._nodes[c] for c in seen), key=lambda n: self._index[n.name]))

    @staticmethod
    def worst(nodes: Iterable[NodeRecord]) -> NodeRecord | None:
        """The node with the lowest accumulated SQNR (nan counts as best; first wins ties)."""
        best: NodeRecord | None = None
        for n in nodes:
            v = n.accumulated_sqnr_db
            if best is None:
                best = n
            elif not math.isnan(v) and (math.isnan(best.accumulated_sqnr_db) or v < best.accumulated_sqnr_db):
                best = n
        return best

    # ----------------------------------------------------------------- exclusion

    @property
    def excluded(self) -> tuple[str, ...]:
        """The exclusion set in table (sort) order."""
        return tuple(n.name for n in self.ordered() if n.name in self._excluded)

    def is_excluded(self, name: str) -> bool:
        """Whether node ``name`` is in the exclusion set."""
        return name in self._excluded

    def toggle(self, name: str) -> bool:
        """Add or remove node ``name`` from the exclusion set; returns True when now excluded."""
        if name not in self._nodes:
            raise KeyError(name)
        self._by_finding.pop(name, None)
        if name in self._excluded:
            self._excluded.discard(name)
            return False
        self._excluded.add(name)
        return True

    @cached_property
    def findings(self) -> tuple[Finding, ...]:
        """The report's notes with the nodes and tensors each names (:func:`note_findings`)."""
        return note_findings(self.report)

    def finding_of(self, name: str) -> int | None:
        """The finding whose ``x`` excluded ``name`` (``None``: excluded otherwise, or not excluded)."""
        return self._by_finding.get(name)

    def toggle_finding(self, index: int) -> tuple[bool, tuple[str, ...]]:
        """Exclude the nodes finding ``index`` advises excluding (its :attr:`Finding.targets`), or, when all of
        them are excluded already, include them again; returns (now excluded, the nodes that changed)."""
        targets = self.findings[index].targets
        if targets and all(n in self._excluded for n in targets):
            for n in targets:
                self._excluded.discard(n)
                self._by_finding.pop(n, None)
            return False, targets
        changed = tuple(n for n in targets if n not in self._excluded)
        for n in changed:
            self._excluded.add(n)
            self._by_finding[n] = index
        return True, changed

    @property
    def run_time(self) -> bool:
        """Whether the loaded proposal's recipe is ``quantize_dynamic``: its quantizable nodes are the ones it
        quantizes at run time, every other node of its model staying float."""
        recipe = self.proposal.recipe if self.proposal is not None else None
        return recipe is not None and quantizer_of(recipe.steps or (recipe.name,)) == "dynamic"

    def _counts(self, name: str) -> bool:
        node = self._nodes[name]
        return node.op_type in RUN_TIME_OPS if self.run_time else is_excludable(node)

    @property
    def quantizable(self) -> int:
        """Nodes whose exclusion changes the quantized model (the denominator of the share), counted as
        propose and verify count them: the report's ``excludable`` (``quantized`` in older reports, which
        also counted nodes quantized only for a consumer's sake); under a dynamic recipe, the proposal's
        count of the nodes ``quantize_dynamic`` quantizes."""
        if self.run_time and self.proposal is not None and self.proposal.quantizable_nodes:
            return self.proposal.quantizable_nodes
        return sum(1 for n in self.report.nodes if is_excludable(n))

    def excluded_share(self) -> float:
        """Excluded quantizable nodes as a fraction of all quantizable nodes (0.0 when none)."""
        q = self.quantizable
        if q == 0:
            return 0.0
        return min(1.0, sum(1 for n in self._excluded if self._counts(n)) / q)

    def reason(self, name: str) -> NodeReason:
        """Why ``name`` is excluded: the loaded proposal's reason, the note of the finding that excluded it, or a
        hand-exclusion reason."""
        r = self._proposal_reasons.get(name)
        if r is not None and r.action == "fp32":
            return r
        n = self._nodes[name]
        finding = self._by_finding.get(name)
        text = (
            f"{FINDING_REASON}: {self.findings[finding].text}"
            if finding is not None
            else f"{HAND_REASON} (added noise {fmt_db(n.added_noise_db)} dB, "
            f"introduced {fmt_db(n.introduced_db)} dB, "
            f"local SQNR {fmt_db(n.local_sqnr_db)} dB, accumulated SQNR {fmt_db(n.accumulated_sqnr_db)} dB)"
        )
        return NodeReason(
            node=n.name,
            original_name=n.original_name,
            op_type=n.op_type,
            action="fp32",
            reason=text,
            introduced_db=n.introduced_db,
            local_sqnr_db=n.local_sqnr_db,
        )

    def proposal_reason(self, name: str) -> NodeReason | None:
        """The loaded proposal's own reason for ``name`` (any action), if it has one."""
        return self._proposal_reasons.get(name)

    # ----------------------------------------------------------------- overview

    def depth_profile(self) -> list[float]:
        """Worst accumulated SQNR (dB) at each topological depth ``0..max depth``.

        Non-finite values are made drawable: ``+inf`` (exact) becomes the best
        finite value of the report, ``-inf`` the worst, and a depth with no
        number (nan, or no node) repeats the previous depth's value.
        """
        if not self.report.nodes:
            return []
        finite = [n.accumulated_sqnr_db for n in self.report.nodes if math.isfinite(n.accumulated_sqnr_db)]
        hi = max(finite) if finite else 0.0
        lo = min(finite) if finite else 0.0
        depth_max = max(n.depth for n in self.report.nodes)
        worst: list[float | None] = [None] * (depth_max + 1)
        for n in self.report.nodes:
            v = n.accumulated_sqnr_db
            if math.isnan(v):
                continue
            v = hi if v == math.inf else lo if v == -math.inf else v
            d = max(n.depth, 0)
            cur = worst[d]
            worst[d] = v if cur is None else min(cur, v)
        out: list[float] = []
        prev = hi
        for v in worst:
            prev = prev if v is None else v
            out.append(prev)
        return out

    # ----------------------------------------------------------------- export

    def to_proposal(self) -> Proposal:
        """The current exclusion set as a ``source="tui"`` proposal, with its snippet."""
        report = self.report
        nodes = self.excluded
        reasons = [self.reason(n) for n in nodes]
        overrides = ()
        per_channel = report.config.per_channel
        if self.proposal is not None:
            # the TUI edits only the exclusion set; 16-bit overrides and per-channel weights of a loaded
            # proposal are kept (per-channel had been dropped: verify then measured another model)
            overrides = self.proposal.tensor_overrides
            per_channel = self.proposal.per_channel
            reasons += [r for r in self.proposal.reasons if r.action != "fp32" and r.node not in nodes]
        task = report.task
        proposal = Proposal(
            schema_version=SCHEMA_VERSION,
            kind="proposal",
            model_path=report.model.path,
            model_sha256=report.model.sha256,
            normalized_model=report.normalized_model,
            nodes_to_exclude=nodes,
            tensor_overrides=overrides,
            per_channel=per_channel,
            reasons=tuple(reasons),
            metric=task.name if task is not None else "",
            fp32_metric=task.fp32 if task is not None else math.nan,
            static_metric=task.quantized if task is not None else math.nan,
            source="tui",
            quantizable_nodes=self.quantizable,
            # so `qdebug verify --proposal` rebuilds the same base quantization as the report's
            method=report.config.method,
            activation_type=report.config.activation_type,
            weight_type=report.config.weight_type,
            base_per_channel=report.config.per_channel,
            quant_settings=report.config.quant,  # the user's config, so verify rebuilds their quantization
            # a loaded proposal's whole-model recipe stays: its nodes are toggled on the recipe's model
            recipe=self.proposal.recipe if self.proposal is not None else None,
            # the cache file is named by the ranges' key
            calibration_key=Path(report.calibration_cache).stem if report.calibration_cache else "",
            calib_max_samples=report.config.max_samples,
        )
        return dataclasses.replace(proposal, snippet=proposal_snippet(report, proposal))


def proposal_snippet(report: Report, proposal: Proposal) -> str:
    """The ``quantize_static`` snippet of ``proposal``, from what ``report`` recorded.

    It is :func:`qdebug.output.snippet.quantize_snippet`, as ``qdebug propose`` writes
    it: a reader for the report's calibration data (its sample limit and input
    names) and the user's model, or the normalized one when an excluded node
    was renamed by normalization. Two things ``propose`` reads from the model
    are not in the report, and the TUI never loads the model: the float16 nodes
    ORT must be told to skip (a mixed-precision model needs them added to
    ``nodes_to_exclude``), and a fixed batch dimension (the reader feeds one
    sample at a time; set ``batch=`` to it).
    """
    cfg = report.config
    renamed = {new for new, old in report.name_map if new != old}
    normalized = proposal.normalized_model or report.normalized_model
    model = normalized if any(n in renamed for n in proposal.nodes_to_exclude) else report.model.path
    prelude = ""
    if proposal.recipe is not None and proposal.recipe.fp32_model:
        model = proposal.recipe.fp32_model  # the transformed FP32 model the proposal's recipe wrote
        prelude = (
            f"# recipe {'+'.join(proposal.recipe.steps) or proposal.recipe.name}: the model below is your FP32 "
            "model transformed by qdebug propose (saved with the proposal); quantize it, not the original\n"
        )
    return prelude + quantize_snippet(
        model,
        proposal.nodes_to_exclude,
        method=cfg.method,
        per_channel=proposal.per_channel,
        activation_type=cfg.activation_type,
        weight_type=cfg.weight_type,
        tensor_overrides=proposal.tensor_overrides,
        calib_hint=cfg.calib or "calib.npz",
        batch=1,
        max_samples=cfg.max_samples,
        inputs=report.model.inputs,
        settings=cfg.quant,
        quantizer=proposal.recipe.quantizer if proposal.recipe is not None else "static",
        reduce_range=proposal.recipe is not None and proposal.recipe.reduce_range,
    )


def recipe_notice(steps: Sequence[str]) -> str:
    """What the TUI says of a proposal built on a recipe: a transform's FP32 model is what gets quantized; a
    dynamic or mixed recipe quantizes the user's model as it is, in its own way."""
    quantizer = quantizer_of(tuple(steps))
    if quantizer == "static":
        return (
            f"the proposal is built on recipe {'+'.join(steps)}: its transformed FP32 model is what gets "
            "quantized, and an exported proposal keeps it"
        )
    how = "quantize_dynamic" if quantizer == "dynamic" else "quantize_static, then quantize_dynamic on its MatMuls"
    return (
        f"the proposal is built on recipe {'+'.join(steps)}: ORT's {how} quantizes your FP32 model as it is (the "
        "excluded nodes stay float), and an exported proposal keeps it"
    )


def frontier_line(frontier: Sequence[FrontierPoint]) -> str:
    """The proposal's verified frontier in one line: each point's speed against FP32 as propose's table gives
    it (the median of the interleaved rounds' ratios; the p50s' in older files), and whether it meets the
    target (``speed vs FP32: proposal 1.08x · static 1.10x · dynamic 1.25x met``)."""
    fp32 = next((f for f in frontier if f.label == "fp32"), None)
    if fp32 is None:
        return ""
    def ratio(f: FrontierPoint) -> str:  # propose's own figure: the median of the interleaved rounds' ratios
        paired = speed_ratio(fp32.rounds_ms, f.rounds_ms)
        return f"{paired.median:.2f}x" if paired is not None else f"{fp32.p50_ms / f.p50_ms:.2f}x"

    parts = [f"{f.label} {ratio(f)}{' met' if f.met else ''}" for f in frontier if f.label != "fp32" and f.p50_ms > 0]
    return "speed vs FP32: " + " · ".join(parts) if parts else ""
