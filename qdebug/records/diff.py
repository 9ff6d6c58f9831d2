"""The ``diff.json`` schema: two analysis reports compared node by node (``qdebug diff A.json B.json``).

Plain frozen dataclasses like the rest of :mod:`qdebug.records` (standard library and :mod:`qdebug.output.formatting`
only, for the plain-text lines both the CLI and the Markdown summary print). Every value is
copied out of the two reports, so the layout does not depend on the report's and has its own version
(:data:`DIFF_SCHEMA_VERSION`). Deltas are always ``B - A``; for SQNR a positive delta is better, for
added noise and KL a negative one. The engine that pairs the reports and fills these records is
:mod:`qdebug.diff`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qdebug.output.formatting import ACCURACY_METRICS, fmt_db, fmt_metric

DIFF_SCHEMA_VERSION = 1
"""Version of the ``diff.json`` layout; :func:`qdebug.diff.load_diff` refuses others."""

VERDICTS = ("worse", "better", "same", "unscored")
"""What :attr:`NodeChange.verdict` may say."""

SAME_DB = 0.1
"""A change of at most this many dB counts as ``same`` (the tables print one decimal); re-exported as
:data:`qdebug.diff.SAME_DB`. The comparison of several reports uses it too: a tensor whose best local SQNR
beats the runner-up's by no more than this is a tie (:class:`TensorBest`)."""

NEGLIGIBLE_NOISE_DB = -60.0
"""Added noise at or below this (noise a millionth of the signal's energy) is negligible: a change between
two such values is ``same``, however many dB it spans. INT8 rounding adds -30 to -50 dB (a full-range
uniform 8-bit signal reaches about -50); -60 dB is ten times less noise than the best 8-bit step can add,
so below it no quantization step is involved, only float rounding: float32 round-off sits near -140 dB, and
a node whose output was exact (-inf) and now carries -155.6 dB of it had been called ``worse`` (ΔAdd +inf
in the TUI), one going from -80.6 to -82.5 dB ``better``. The analysis notes draw the same line
(:data:`qdebug.analysis.notes.NEGLIGIBLE_SQNR_DB`)."""


def negligible_noise(a_db: float, b_db: float) -> bool:
    """Whether both sides' added noise is at or below :data:`NEGLIGIBLE_NOISE_DB` (``-inf`` included): their
    difference is float rounding, not a change (``False`` when either is undefined)."""
    return a_db <= NEGLIGIBLE_NOISE_DB and b_db <= NEGLIGIBLE_NOISE_DB


def negligible_sqnr(a_db: float, b_db: float) -> bool:
    """The same line for an SQNR: both sides at or above ``-NEGLIGIBLE_NOISE_DB`` (60 dB; ``inf`` included)."""
    return a_db >= -NEGLIGIBLE_NOISE_DB and b_db >= -NEGLIGIBLE_NOISE_DB


@dataclass(frozen=True)
class ReportSide:
    """Where one of the two reports came from."""

    path: str
    model_path: str
    model_sha256: str
    qdebug_version: str
    ort_version: str
    created: str
    samples: int
    """Samples of the layer-wise capture."""
    nodes: int
    """Nodes in the report (the normalized FP32 model's)."""


@dataclass(frozen=True)
class SettingChange:
    """A setting the two reports were made with differently (both values as text)."""

    setting: str
    """``method``, ``per_channel``, ``activation_type``, ``weight_type``, ``ort_version``, ``calib``,
    ``eval``, ``metric``, ``model``..."""
    a: str
    b: str


@dataclass(frozen=True)
class TaskSide:
    """One report's task metric (higher is better)."""

    name: str
    fp32: float
    quantized: float
    samples: int
    data: str
    """``eval`` or ``calib``."""


@dataclass(frozen=True)
class OutputChange:
    """A model output's SQNR in both reports (outputs paired by name, else by position)."""

    name_a: str
    name_b: str
    sqnr_a_db: float
    sqnr_b_db: float
    delta_db: float
    """``sqnr_b_db - sqnr_a_db``: positive means B is closer to FP32."""


@dataclass(frozen=True)
class NodeChange:
    """One node present in both reports, and how its error changed from A to B."""

    name_a: str
    name_b: str
    op_type: str
    paired_by: str
    """``name`` (the same user-given name and op type) or ``structure`` (see :mod:`qdebug.diff`)."""
    depth_a: int
    depth_b: int
    added_noise_a_db: float
    added_noise_b_db: float
    added_noise_delta_db: float
    """Change of the noise the node adds (``NodeRecord.added_noise_db``); negative is better."""
    accumulated_sqnr_a_db: float
    accumulated_sqnr_b_db: float
    accumulated_sqnr_delta_db: float
    """Change of the node's worst accumulated SQNR; positive is better."""
    local_sqnr_a_db: float
    local_sqnr_b_db: float
    local_sqnr_delta_db: float
    introduced_a_db: float
    introduced_b_db: float
    kl_a: float
    kl_b: float
    kl_delta: float
    """Change of the largest accumulated KL (nats); negative is better."""
    noise_change: float
    """The ranking key: the added noise in linear terms (``10**(dB/10)``, relative to the signal), B minus
    A; positive is worse. A 4 dB change at -100 dB is 1e-10 here, a 1 dB change at -10 dB 0.026: the
    nodes whose change matters come first. ``nan`` when either side's added noise is undefined."""
    verdict: str
    """One of :data:`VERDICTS`: by the added-noise delta (more than :data:`SAME_DB` either way; ``same``
    where both sides are below :data:`NEGLIGIBLE_NOISE_DB`), else by the accumulated SQNR delta when the
    added noise is undefined; ``unscored`` when neither is."""
    quantized_a: bool = True
    quantized_b: bool = True


@dataclass(frozen=True)
class TensorChange:
    """One float tensor present in both reports (paired through its producer, or as a graph input)."""

    name_a: str
    name_b: str
    paired_by: str
    """``name`` when both reports call it the same, else ``structure``."""
    accumulated_sqnr_a_db: float
    accumulated_sqnr_b_db: float
    accumulated_sqnr_delta_db: float
    local_sqnr_a_db: float
    local_sqnr_b_db: float
    local_sqnr_delta_db: float
    kl_a: float
    kl_b: float
    kl_delta: float


@dataclass(frozen=True)
class DiffReport:
    """The ``diff.json`` file: B compared with A."""

    schema_version: int
    kind: str
    """Always ``"diff"``."""
    qdebug_version: str
    created: str
    a: ReportSide
    b: ReportSide
    settings: tuple[SettingChange, ...]
    """Every setting that differs (empty: the same settings)."""
    task_a: TaskSide | None
    task_b: TaskSide | None
    outputs: tuple[OutputChange, ...]
    nodes: tuple[NodeChange, ...]
    """Paired nodes, biggest change first (by ``abs(noise_change)``, then the accumulated SQNR delta, then
    B's node order)."""
    tensors: tuple[TensorChange, ...]
    """Paired float tensors, in B's order."""
    only_in_a: tuple[str, ...] = ()
    """Nodes of A with no counterpart in B (removed, or changed beyond recognition)."""
    only_in_b: tuple[str, ...] = ()
    """Nodes of B with no counterpart in A (added)."""
    notes: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        """How many paired nodes got worse, better, stayed the same or could not be scored."""
        out = dict.fromkeys(VERDICTS, 0)
        for n in self.nodes:
            out[n.verdict] = out.get(n.verdict, 0) + 1
        return out

    def by_structure(self) -> int:
        """Paired nodes whose names moved (paired by structure)."""
        return sum(1 for n in self.nodes if n.paired_by == "structure")

    def task_drop(self, side: str) -> float:
        """FP32 minus quantized metric of report ``side`` (``"a"``/``"b"``); ``nan`` without a task."""
        task = self.task_a if side == "a" else self.task_b
        if task is None or not (math.isfinite(task.fp32) and math.isfinite(task.quantized)):
            return math.nan
        return task.fp32 - task.quantized

    def header_lines(self) -> list[str]:
        """What the CLI prints above the node table (and the Markdown summary holds): both reports, the
        settings that differ, the task metric, the outputs' SQNR and the tally of the paired nodes."""
        lines = [f"A: {_side_text(self.a)}", f"B: {_side_text(self.b)}"]
        if self.settings:
            lines.append("settings that differ: " + "; ".join(f"{s.setting} {s.a} -> {s.b}" for s in self.settings))
        else:
            lines.append("same model and settings")
        lines += [t for t in (self.task_line(),) if t]
        lines += [
            f"output {o.name_b}: SQNR A {fmt_db(o.sqnr_a_db)} dB, B {fmt_db(o.sqnr_b_db)} dB "
            f"({fmt_delta(o.delta_db, fine=True)})"
            for o in self.outputs
        ]
        c = self.counts()
        lines.append(
            f"{len(self.nodes)} nodes paired ({self.by_structure()} by structure), {len(self.only_in_a)} only in A, "
            f"{len(self.only_in_b)} only in B: {c['worse']} worse, {c['better']} better, {c['same']} same"
            + (f", {c['unscored']} unscored" if c["unscored"] else "")
        )
        return lines

    def task_line(self) -> str:
        """``top1: A FP32 91.00% quantized 85.00% (drop 6.00 points); B ...`` (empty without a task)."""
        parts = []
        for label, task, side in (("A", self.task_a, "a"), ("B", self.task_b, "b")):
            if task is None:
                continue
            drop = self.task_drop(side)
            share = task.name in ACCURACY_METRICS
            text = f"{label} FP32 {fmt_metric(task.name, task.fp32)} quantized {fmt_metric(task.name, task.quantized)}"
            if not math.isnan(drop):
                text += f" (drop {drop * (100 if share else 1):.2f}{' points' if share else ''})"
            parts.append(f"{text} on {task.samples} {task.data} samples")
        if not parts:
            return ""
        a, b = self.task_a, self.task_b
        name = b.name if b is not None else a.name  # type: ignore[union-attr]
        if a is not None and b is not None and a.name == b.name:
            share = a.name in ACCURACY_METRICS
            d = (b.quantized - a.quantized) * (100 if share else 1)
            parts.append(f"quantized B - A {fmt_delta(d, 2, fine=True)}{' points' if share else ''}")
        return f"{name}: " + "; ".join(parts)

    def table_rows(self, top: int = 0) -> list[tuple[NodeChange, tuple[str, ...]]]:
        """The first ``top`` paired nodes (0: all) with their cells under :data:`TABLE_COLUMNS` (the node's
        name left to the caller, which fits it to its width)."""
        shown = self.nodes[:top] if top else self.nodes
        return [(n, _cells(n)) for n in shown]


TABLE_COLUMNS = ("node", "op", "added noise dB", "Δ", "accum. SQNR dB", "Δ", "local SQNR Δ", "KL Δ", "B vs A")
"""The node table of ``qdebug diff`` (and of its Markdown): values as ``A -> B``, deltas ``B - A``."""


def node_label(n: NodeChange) -> str:
    """The node's name in B, with its name in A when it moved (``a -> b``)."""
    return n.name_b if n.name_a == n.name_b else f"{n.name_a} -> {n.name_b}"


def fmt_delta(x: float, digits: int = 1, fine: bool = False) -> str:
    """A signed change: ``+1.2``, ``-0.4``, ``0.0``, ``+inf``; ``-`` when undefined. ``fine``: a change that
    rounds to 0 at ``digits`` but is not 0 keeps its sign and two significant digits (``-0.04``), for a
    line that states one delta (an output's SQNR ``5.4 dB, B 5.3 dB (0.0)`` had hidden -0.04)."""
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    if round(x, digits) == 0:
        return f"{x:+.2g}" if fine and x != 0 else f"{0:.{digits}f}"
    return f"{x:+.{digits}f}"


NEGLIGIBLE_TEXT = "~0"
"""A delta cell between two negligible values (:func:`negligible_change`): ``-inf -> -155.6`` dB of added
noise is no ``+inf`` change."""


def negligible_change(n: NodeChange, field: str) -> bool:
    """Whether delta ``field`` of ``n`` (``added_noise_delta_db``, ``accumulated_sqnr_delta_db``,
    ``local_sqnr_delta_db``) changes between two negligible values (:func:`negligible_noise`,
    :func:`negligible_sqnr`): float rounding, not a change."""
    if field == "added_noise_delta_db":
        return negligible_noise(n.added_noise_a_db, n.added_noise_b_db)
    if field == "accumulated_sqnr_delta_db":
        return negligible_sqnr(n.accumulated_sqnr_a_db, n.accumulated_sqnr_b_db)
    if field == "local_sqnr_delta_db":
        return negligible_sqnr(n.local_sqnr_a_db, n.local_sqnr_b_db)
    return False


def delta_text(n: NodeChange, field: str) -> str:
    """A delta cell of ``n``: :data:`NEGLIGIBLE_TEXT` where it changes between two negligible values (not
    ``+inf`` for -inf -> -155.6 dB of added noise), else :func:`fmt_delta`."""
    d = getattr(n, field)
    return NEGLIGIBLE_TEXT if d != 0 and not math.isnan(d) and negligible_change(n, field) else fmt_delta(d)


def _kl_delta(x: float) -> str:
    if x == 0:
        return "0"
    if math.isnan(x) or math.isinf(x):
        return fmt_delta(x)
    return f"{x:+.3g}"


def _cells(n: NodeChange) -> tuple[str, ...]:
    return (
        n.op_type,
        f"{fmt_db(n.added_noise_a_db)} -> {fmt_db(n.added_noise_b_db)}",
        delta_text(n, "added_noise_delta_db"),
        f"{fmt_db(n.accumulated_sqnr_a_db)} -> {fmt_db(n.accumulated_sqnr_b_db)}",
        delta_text(n, "accumulated_sqnr_delta_db"),
        delta_text(n, "local_sqnr_delta_db"),
        _kl_delta(n.kl_delta),
        n.verdict,
    )


def _side_text(s: ReportSide) -> str:
    return f"{s.path} (model {s.model_path}, {s.nodes} nodes, {s.samples} samples, ORT {s.ort_version})"


COMPARISON_KIND = "comparison"
"""``kind`` of the file ``qdebug diff`` writes for three or more reports."""


@dataclass(frozen=True)
class TensorBest:
    """One float tensor across several reports (paired with the first report's), and which does best."""

    name: str
    """The first report's name for it."""
    local_sqnr_db: tuple[float, ...]
    """Per report: the SQNR of the tensor's own quantization (its range, its method)."""
    accumulated_sqnr_db: tuple[float, ...]
    """Per report: the SQNR against FP32 with everything upstream quantized too."""
    best: int
    """The report whose own quantization of this tensor is closest to FP32 (highest local SQNR; ties: the
    first); -1 when the tensor is not quantized in any."""
    margin_db: float
    """Best local SQNR minus the best outside :attr:`leaders` (the runner-up); where every report leads (a
    tie), best minus second best, at most :data:`SAME_DB`; nan with fewer than two numbers."""
    leaders: tuple[int, ...] = ()
    """The reports whose local SQNR is within :data:`SAME_DB` of the best (``best`` among them): minmax and
    entropy tied at the top, 0.72 dB above percentile, lead together (the comparison had given the tensor a
    margin of 0 and counted it for no one). Empty in files written before the field: then ``best`` alone,
    where ``margin_db`` is not 0."""

    def leading(self) -> tuple[int, ...]:
        """:attr:`leaders`, or for an older file ``(best,)`` (none on its 0-margin ties)."""
        if self.leaders:
            return self.leaders
        return (self.best,) if self.best >= 0 and self.margin_db != 0 else ()

    def tied(self, reports: int) -> bool:
        """Whether every one of ``reports`` reports leads: no report quantizes this tensor measurably best."""
        lead = self.leading()
        return len(lead) == reports or (not lead and self.margin_db == 0)


@dataclass(frozen=True)
class Comparison:
    """The file ``qdebug diff A B C ...`` writes: several reports of one model (e.g. one per calibration
    method, ``analyze --method minmax,entropy,percentile``), tensor by tensor."""

    schema_version: int
    kind: str
    """Always ``"comparison"``."""
    qdebug_version: str
    created: str
    labels: tuple[str, ...]
    """What tells the reports apart: their method when that differs, else their file names."""
    sides: tuple[ReportSide, ...]
    tasks: tuple[TaskSide | None, ...]
    tensors: tuple[TensorBest, ...]
    """Tensors paired in every report, biggest margin first."""
    wins: tuple[int, ...]
    """Per report: the tensors it quantizes best, by more than :data:`SAME_DB` over the runner-up; a tensor
    two reports lead together counts for both (:attr:`TensorBest.leaders`), a tie of all for none."""
    notes: tuple[str, ...] = ()
    ties: int = 0
    """Tensors every report leads (within :data:`SAME_DB` of each other): no method wins them. 0 in files
    written before the field."""
    shared: tuple[int, ...] = ()
    """Per report: how many of its :attr:`wins` it shares with another report (empty in older files)."""

    def best_task(self) -> int:
        """The report with the highest quantized task metric (-1 without one)."""
        values = [t.quantized if t is not None and math.isfinite(t.quantized) else -math.inf for t in self.tasks]
        return int(max(range(len(values)), key=values.__getitem__)) if any(v > -math.inf for v in values) else -1


COMPARISON_COLUMNS = ("tensor", "best", "margin dB", "local SQNR dB", "accumulated SQNR dB")
"""Columns of the comparison table (one cell per report, ``/``-separated, in the last two)."""


def comparison_header(c: Comparison) -> list[str]:
    """What each report reaches, and how many tensors each quantizes best."""
    lines = []
    best_task = c.best_task()
    for i, (label, side, task) in enumerate(zip(c.labels, c.sides, c.tasks, strict=True)):
        metric = ""
        if task is not None and math.isfinite(task.quantized):
            best = " (best)" if i == best_task else ""
            metric = f"{task.name} {fmt_metric(task.name, task.quantized)}{best}, "
        shared = c.shared[i] if i < len(c.shared) else 0
        also = f", {shared} of them shared" if shared else ""
        lines.append(f"{label}: {metric}best on {c.wins[i]} of {len(c.tensors)} tensors{also} ({side.path})")
    if c.ties:
        lines.append(
            f"tied on {c.ties} of {len(c.tensors)} tensors (every local SQNR within {SAME_DB:g} dB of the best)"
        )
    return lines


def comparison_rows(c: Comparison, top: int = 10) -> list[tuple[str, ...]]:
    """The ``top`` tensors whose best report wins by the most (0: all), as :data:`COMPARISON_COLUMNS`."""
    rows = c.tensors if top == 0 else c.tensors[:top]

    def many(values: tuple[float, ...]) -> str:
        return " / ".join(fmt_db(v) for v in values)

    def best(t: TensorBest) -> str:
        if t.tied(len(c.labels)):
            return "tied"
        return ", ".join(c.labels[i] for i in t.leading()) or c.labels[t.best]

    return [(t.name, best(t), fmt_db(t.margin_db), many(t.local_sqnr_db), many(t.accumulated_sqnr_db)) for t in rows]
