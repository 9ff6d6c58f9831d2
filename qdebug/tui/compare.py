"""The TUI's baseline: another report of the same model, shown as comparison columns (``--against``).

``qdebug tui B.json --against A.json`` shows B with A as its baseline: the pairing and the deltas are
:func:`qdebug.diff.compare`'s (``qdebug diff A.json B.json``), so the TUI and ``qdebug diff`` never
disagree about which node is which or by how much it changed. ``qdebug tui diff.json`` opens report B of
a ``qdebug diff --json`` file with its A as the baseline, from the numbers the diff file holds (A need not
be at hand).

Plain Python, like :mod:`qdebug.tui.model`: no ``textual``, ``onnx`` or ``onnxruntime`` here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from qdebug.diff import SAME_DB, compare, load_diff
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.report_io import load_report
from qdebug.records import Report
from qdebug.records.diff import (
    COMPARISON_KIND,
    NEGLIGIBLE_TEXT,
    DiffReport,
    NodeChange,
    fmt_delta,
    negligible_change,
)


@dataclass(frozen=True)
class Baseline:
    """The shown report (the diff's B) compared with its baseline (the diff's A)."""

    diff: DiffReport
    """``qdebug diff baseline shown``: deltas are shown minus baseline."""

    @cached_property
    def _changes(self) -> dict[str, NodeChange]:
        return {c.name_b: c for c in self.diff.nodes}

    def change(self, node: str) -> NodeChange | None:
        """The paired node's change (``None``: the node has no counterpart in the baseline)."""
        return self._changes.get(node)

    @property
    def path(self) -> str:
        """The baseline report's file, as given."""
        return self.diff.a.path

    @property
    def label(self) -> str:
        """The baseline's file name (what the header and the title call it)."""
        return Path(self.diff.a.path).name or self.diff.a.path

    @property
    def same_model(self) -> bool:
        """Whether both reports are of the same model file (by content)."""
        return self.diff.a.model_sha256 == self.diff.b.model_sha256

    def pairing_line(self) -> str:
        """``30 of 32 nodes paired (2 by structure), 2 only here, 1 only in the baseline``."""
        d = self.diff
        line = f"{len(d.nodes)} of {d.b.nodes} nodes paired"
        moved = d.by_structure()
        if moved:
            line += f" ({moved} by structure)"
        if d.only_in_b or d.only_in_a:
            line += f", {len(d.only_in_b)} only here, {len(d.only_in_a)} only in the baseline"
        return line

    def tally_line(self) -> str:
        """``3 worse, 2 better, 27 same`` (and ``unscored`` when some are)."""
        c = self.diff.counts()
        text = f"{c['worse']} worse, {c['better']} better, {c['same']} same"
        return text + (f", {c['unscored']} unscored" if c["unscored"] else "")

    def settings_text(self) -> list[str]:
        """Each setting that differs, baseline value first: ``method percentile → minmax``."""
        return [f"{s.setting} {s.a} → {s.b}" for s in self.diff.settings]

    def warning(self) -> str:
        """What the user must know before reading the columns (empty: same model, every node paired)."""
        d = self.diff
        if self.same_model and not d.only_in_a and not d.only_in_b:
            return ""
        what = "is of another model" if not self.same_model else "does not pair every node"
        return f"baseline {self.path} {what}: {self.pairing_line()}; unpaired nodes show a blank Δ"


def fmt_change(x: float) -> str:
    """A delta cell: ``+1.2``, ``-0.4``, ``0.0``, ``+inf``; ``nan`` when a side is undefined (the TUI
    spells nan out, :func:`qdebug.records.diff.fmt_delta` writes ``-``)."""
    return "nan" if math.isnan(x) else fmt_delta(x)


def judge(delta: float, up_is_worse: bool) -> str:
    """``worse``, ``better`` or ``same`` for one delta, by the diff verdict's threshold (:data:`SAME_DB`);
    ``""`` when undefined (nan: a side has no number). A change between negligible values is judged on
    :func:`change_value` (0: ``same``), as the diff's verdict judges it."""
    if math.isnan(delta):
        return ""
    if abs(delta) <= SAME_DB:
        return "same"
    return "worse" if (delta > 0) == up_is_worse else "better"


def change_value(change: NodeChange, field: str) -> float:
    """The delta ``field`` of ``change`` as the table sorts and colours it: 0 where it changes between two
    negligible values (-inf -> -155.6 dB of added noise had sorted first as +inf, "worst")."""
    d = getattr(change, field)
    return 0.0 if not math.isnan(d) and negligible_change(change, field) else d


def change_text(change: NodeChange, field: str) -> str:
    """The delta cell of ``change``: :data:`~qdebug.records.diff.NEGLIGIBLE_TEXT` (``~0``) between two
    negligible values that differ, else :func:`fmt_change` (``qdebug diff`` prints the same)."""
    d = getattr(change, field)
    if d != 0 and not math.isnan(d) and negligible_change(change, field):
        return NEGLIGIBLE_TEXT
    return fmt_change(d)


def baseline_from_reports(shown: Report, shown_path: str, baseline: Report, baseline_path: str) -> Baseline:
    """``shown`` compared with ``baseline``, as ``qdebug diff baseline shown`` pairs them."""
    return Baseline(compare(baseline, shown, baseline_path, shown_path))


def load_baseline(shown: Report, shown_path: str, against: str | Path) -> Baseline:
    """Load the ``--against`` report and compare ``shown`` with it; a file that is not a report is a one-line
    :class:`QDebugError` naming the flag (exit code :attr:`ExitCode.INPUT`). Only an analysis report is a
    baseline: a diff file is opened by itself (``qdebug tui diff.json``), a comparison of several reports
    holds no one baseline."""
    kind = file_kind(against) if Path(against).is_file() else None
    if kind == "diff":
        raise QDebugError(
            f"--against: {against} is a qdebug diff, not a report: it holds both reports' numbers already",
            f"open it as `qdebug tui {against}` (its B against its A), or pass --against the report qdebug "
            "analyze wrote",
            ExitCode.INPUT,
        )
    if kind == COMPARISON_KIND:
        raise QDebugError(
            f"--against: {against} is a comparison of several reports, not one report",
            "pass --against one of the reports it compares (qdebug analyze --method a,b writes one per method)",
            ExitCode.INPUT,
        )
    try:
        baseline = load_report(against)
    except QDebugError as e:
        raise QDebugError(f"--against: {e.message}", e.hint, e.code) from None
    return baseline_from_reports(shown, shown_path, baseline, str(against))


def file_kind(path: str | Path) -> str | None:
    """The ``kind`` a qdebug JSON file says it is (``None``: no kind, or not readable -- the loader of the
    expected kind then says what is wrong)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    kind = data.get("kind") if isinstance(data, dict) else None
    return kind if isinstance(kind, str) else None


def open_diff(path: str | Path) -> tuple[str, Baseline]:
    """``(report B's path, the baseline)`` of a ``qdebug diff --json`` file.

    B's path is the one the diff recorded, taken as it is when it exists, else next to the diff file (a diff
    written with relative paths and opened from elsewhere).
    """
    diff = load_diff(path)
    recorded = Path(diff.b.path)
    candidates = [recorded] if recorded.is_absolute() else [recorded, Path(path).parent / recorded]
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise QDebugError(
            f"diff {path} compares report {diff.b.path}, which is not found (looked in "
            f"{' and '.join(str(p.parent) or '.' for p in candidates)})",
            f"open the report itself: qdebug tui REPORT.json --against {diff.a.path}",
            ExitCode.INPUT,
        )
    return str(found), Baseline(diff)


def check_diff_matches(baseline: Baseline, report: Report, report_path: str, diff_path: str) -> None:
    """The report opened must still be the diff's B (the deltas hold B's numbers): same model, same analysis
    (its ``created`` stamp), every paired node present."""
    d = baseline.diff
    names = {n.name for n in report.nodes}
    same = (d.b.model_sha256, d.b.created, d.b.nodes) == (report.model.sha256, report.created, len(report.nodes))
    if not same or any(c.name_b not in names for c in d.nodes):
        raise QDebugError(
            f"report {report_path} changed since diff {diff_path} was made from it (re-analyzed or edited)",
            f"re-run qdebug diff {d.a.path} {report_path} --json, or open qdebug tui {report_path} --against "
            f"{d.a.path}",
            ExitCode.INPUT,
        )
