"""The qdebug terminal UI: a thin Textual view over a saved analysis report.

Entry points: :func:`run_tui` (called by ``qdebug tui``), :class:`QDebugApp`
(built from a :class:`~qdebug.records.Report` object, for tests and embedding)
and :func:`save_screenshot` (an SVG of the app, rendered headless).

This module never imports onnxruntime or onnx: verify runs through the
``verify_fn`` callable the caller passes in. The app builds the session's
:class:`~qdebug.tui.model.TuiContext` and hands it to the main screen, which
reads its run state from there (not from the app).
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from textual.app import App
from textual.screen import Screen

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import atomic_write_text
from qdebug.output.report_io import load_bench, load_proposal, load_report
from qdebug.records import Proposal, Report
from qdebug.tui.compare import Baseline
from qdebug.tui.model import LayerModel, TuiContext, VerifyFn
from qdebug.tui.screens import MainScreen

if TYPE_CHECKING:
    from qdebug.records.bench import BenchReport

def default_export_path(report_path: str | Path | None) -> Path:
    """Where ``e`` writes by default: ``<report stem>.proposal.json`` next to the report."""
    if report_path is None:
        return Path("qdebug.proposal.json")
    p = Path(report_path)
    return p.with_name(f"{p.stem}.proposal.json")


class QDebugApp(App[Any]):
    """Browse a report's nodes by sensitivity, pick nodes to keep in FP32, export a proposal."""

    CSS_PATH = "qdebug.tcss"
    TITLE = "qdebug"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (110, "-wide")]

    def __init__(
        self,
        report: Report,
        proposal: Proposal | None = None,
        verify_fn: VerifyFn | None = None,
        report_path: str | None = None,
        *,
        export_path: str | Path | None = None,
        bench: BenchReport | None = None,
        inputs: dict[str, str | Path | None] | None = None,
        baseline: Baseline | None = None,
    ) -> None:
        super().__init__()
        self.report = report
        self.proposal = proposal
        self.context = TuiContext(
            report_path=report_path,
            export_path=Path(export_path) if export_path is not None else default_export_path(report_path),
            inputs=dict(inputs or {}),
            bench=bench,
            verify_fn=verify_fn,
        )
        """The session's run state; the main screen keeps it."""
        self.model = LayerModel(report, proposal, baseline)
        name = report.model.path.rsplit("/", 1)[-1]
        self.sub_title = name if baseline is None else f"{name} vs {baseline.label}"

    def get_default_screen(self) -> Screen:
        """The main layer screen."""
        return MainScreen(self.model, self.context)

    @property
    def main_screen(self) -> MainScreen:
        """The main screen (also while a dialog is on top)."""
        for screen in self.screen_stack:
            if isinstance(screen, MainScreen):
                return screen
        raise LookupError("main screen not mounted")


def load_bench_results(path: str | Path) -> BenchReport:
    """Load a ``bench.json`` written by ``qdebug bench -o`` (QDebugError for a missing/invalid file).

    :func:`qdebug.output.report_io.load_bench` reads it into :mod:`qdebug.records.bench` records, without onnx.
    """
    return load_bench(path)


def run_tui(
    report_path: str,
    proposal_path: str | None = None,
    verify_fn: VerifyFn | None = None,
    bench_path: str | None = None,
    baseline: Baseline | None = None,
) -> int:
    """Load the report (and proposal, and bench results), run the app, return the exit code.

    ``baseline``: the report compared against (:func:`qdebug.tui.compare.load_baseline`), for the comparison
    columns. :class:`~qdebug.errors.QDebugError` from loading propagates (the CLI prints it as one line).
    """
    report = load_report(report_path)
    proposal = load_proposal(proposal_path) if proposal_path else None
    bench = load_bench_results(bench_path) if bench_path else None
    inputs = {
        "the proposal": proposal_path,
        "the bench results": bench_path,
        "the baseline report": baseline.path if baseline is not None else None,
    }
    app = QDebugApp(
        report, proposal, verify_fn, report_path=report_path, bench=bench, inputs=inputs, baseline=baseline
    )
    app.run()
    code = app.return_code
    return int(ExitCode.OK) if not code else int(ExitCode.INTERNAL)


def save_screenshot(
    report_path: str | Path,
    svg_path: str | Path,
    size: tuple[int, int] = (120, 40),
    proposal_path: str | Path | None = None,
    bench_path: str | Path | None = None,
    baseline: Baseline | None = None,
) -> Path:
    """Run the app headless on a report at ``size`` (columns, rows) and write an SVG screenshot.

    Returns the written path. Useful for the README and for bug reports.
    """
    report = load_report(report_path)
    proposal = load_proposal(proposal_path) if proposal_path else None
    bench = load_bench_results(bench_path) if bench_path else None
    app = QDebugApp(report, proposal, report_path=str(report_path), bench=bench, baseline=baseline)

    async def auto_pilot(pilot: Any) -> None:
        await pilot.pause()
        await pilot.wait_for_scheduled_animations()
        await pilot.pause()
        if app.return_code:  # the app failed while starting: no screenshot of a crash (it exited 0)
            return
        app.exit(app.export_screenshot(title=f"qdebug {Path(report_path).name}"))

    svg = app.run(headless=True, size=size, auto_pilot=auto_pilot)
    if app.return_code or not isinstance(svg, str):
        raise QDebugError(
            "the TUI failed before it could draw the screenshot (its error is above)",
            "report it with the report file attached",
            ExitCode.INTERNAL,
        )
    atomic_write_text(svg_path, portable_svg(svg))
    return Path(svg_path)


_SVG_TEXT = re.compile(
    r'(<text class="[^"]*" )x="([0-9.]+)"( y="[0-9.]+" )textLength="([0-9.]+)"([^>]*)>([^<]*)</text>'
)
_NBSP = "&#160;"


def portable_svg(svg: str) -> str:
    """Textual's SVG with the spaces at the ends of each text run moved into its position.

    Textual writes one ``<text>`` per styled run and keeps its spaces as
    ``&#160;``. Some renderers (librsvg's ``rsvg-convert``, which turns the
    screenshot into a PNG) drop leading and trailing white space of a run, so
    ``"model.onnx" + "  opset 17"`` shows as ``model.onnxopset 17``. Shifting
    ``x`` by the leading spaces and dropping both ends draws the same picture
    in every renderer; runs of spaces only are removed (their background is a
    separate ``<rect>``).
    """

    def fix(m: re.Match[str]) -> str:
        start, x, y, length, rest, body = m.groups()
        cells = cell_len(html.unescape(body))
        if cells == 0:
            return m.group(0)
        cell = float(length) / cells
        stripped = body
        lead = 0
        while stripped.startswith(_NBSP):
            stripped = stripped[len(_NBSP) :]
            lead += 1
        trail = 0
        while stripped.endswith(_NBSP):
            stripped = stripped[: -len(_NBSP)]
            trail += 1
        if not stripped:
            return ""
        if not lead and not trail:
            return m.group(0)
        new_x = float(x) + lead * cell
        new_length = float(length) - (lead + trail) * cell
        return f'{start}x="{new_x:g}"{y}textLength="{new_length:g}"{rest}>{stripped}</text>'

    return _SVG_TEXT.sub(fix, svg)
