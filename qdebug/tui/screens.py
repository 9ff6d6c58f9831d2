"""Screens: the main layer screen, the bench screen and the modal dialogs (help, text, export path).

The main screen owns the :class:`~qdebug.tui.model.LayerModel`: it reacts to
the widgets' messages, changes the model and redraws. Long work (verify) runs
in a thread worker that reports progress and honours cancellation.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Label, OptionList, Select, Static
from textual.worker import Worker, WorkerState, get_current_worker

from qdebug.errors import QDebugError
from qdebug.output.files import atomic_write_text, check_outputs_spare_inputs
from qdebug.output.report_io import dumps
from qdebug.records import Proposal
from qdebug.tui.bench_widgets import BenchChart, BenchTable
from qdebug.tui.benchview import MISMATCH, bench_hint, machine_line, model_mismatch, note_lines, title_line
from qdebug.tui.findings import FindingsPanel
from qdebug.tui.messages import VerifyProgress
from qdebug.tui.model import COLUMN_KEYS, COLUMNS, Column, LayerModel, TuiContext, column, recipe_notice
from qdebug.tui.samples import SamplesScreen
from qdebug.tui.samples_model import SamplesModel
from qdebug.tui.widgets import (
    DepthChart,
    DetailPanel,
    ExclusionPanel,
    FilterBar,
    NodeDetail,
    NodeTable,
    SummaryBar,
    VerifyPanel,
)

if TYPE_CHECKING:
    from qdebug.records.bench import BenchReport

VERIFY_UNAVAILABLE = (
    "verify is unavailable: the report's model or data are not reachable from here, or the model file "
    "changed since the analysis (run `qdebug tui` where they are, or use `qdebug verify`)"
)

PROGRESS_INTERVAL_S = 0.1
"""Least time between two progress updates from the verify worker."""

HELP_ROWS: tuple[tuple[str, str], ...] = (
    ("↑ ↓  click", "select a node (the detail panel follows)"),
    ("x  space", "exclude / include the node (keep it in FP32)"),
    ("[", "jump to the worst producer (lowest accumulated SQNR)"),
    ("]", "jump to the worst consumer"),
    ("tab  enter", "focus the neighbour / exclusion list; enter jumps"),
    ("f", "findings: the report's notes, each with the nodes it names"),
    ("f: enter", "jump to the nodes the finding names (again: the next)"),
    ("f: x space", "exclude the finding's nodes (again: include them)"),
    ("s", "sort by the next column"),
    ("r", "reverse the sort"),
    (f"1 … {len(COLUMNS)}", "sort by that column, from its top (again: reverse), or click it"),
    ("/", "fuzzy-filter by name (enter / esc: back to table)"),
    ("o", "pick the op-type filter from a list (type to search, enter picks)"),
    ("O", "back to all op types"),
    ("e", "export the exclusion set as a proposal JSON"),
    ("c", "copy the quantize_static snippet (and show it)"),
    ("v", "verify the set (needs the model and data)"),
    ("b", "bench results: variants, machine, metric vs latency (--bench)"),
    ("i", "flipped samples: which inputs flip, where each diverges, what it clips"),
    ("esc", "cancel a running verify; else back to the table"),
    ("?", "this help"),
    ("q", "quit"),
)


def summary_lines(result: Any) -> list[str]:
    """The result lines of a verify callable's result (its ``summary_lines()``, else ``str``)."""
    fn = getattr(result, "summary_lines", None)
    if callable(fn):
        return [str(line) for line in fn()]
    return [str(result)]


DEBOUNCE_NODES = 1000
"""Reports with at least this many nodes refresh the table when the filter typing pauses, not per key."""
DEBOUNCE_S = 0.25


class MainScreen(Screen):
    """Node table, depth overview, detail, exclusion set and verify progress."""

    BINDINGS = [
        Binding("x,space", "toggle_exclusion", "Exclude"),
        Binding("left_square_bracket", "jump('up')", "Producer", key_display="["),
        Binding("right_square_bracket", "jump('down')", "Consumer", key_display="]"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse", show=False),
        *(
            Binding(str(i + 1), f"sort({key!r})", column(key).label, show=False)
            for i, key in enumerate(COLUMN_KEYS)
        ),
        # the comparison columns (--against) come after the 8 above: 9 and 0 sort by them
        Binding("9", "sort_column(8)", "ΔAdd", show=False),
        Binding("0", "sort_column(9)", "ΔAcc", show=False),
        Binding("slash", "focus_filter", "Filter", key_display="/", show=False),
        # not in the footer (full at 80 columns): the header's "N findings (f)" shows the key
        Binding("f", "findings", "Findings", show=False),
        Binding("o", "pick_op", "Op", show=False),
        Binding("e", "export", "Export"),
        Binding("c", "copy_snippet", "Snippet"),
        Binding("v", "verify", "Verify"),
        Binding("escape", "escape", "Cancel", show=False),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "app.quit", "Quit"),
        Binding("O", "all_ops", "All ops", key_display="O"),  # last: at 80 columns it must not push out ? and q
        # one key, two actions: with a bench file "b" opens it (and shows last in the footer, so
        # help and quit stay visible at 80 columns), without one it says how to make one
        # (check_action enables exactly one of them)
        Binding("b", "bench", "Bench"),
        Binding("b", "bench_missing", "Bench", show=False),
        # like b: in the footer only when the report has the per-sample drill-down
        Binding("i", "samples", "Samples"),
        Binding("i", "samples_missing", "Samples", show=False),
    ]

    def __init__(self, model: LayerModel, context: TuiContext) -> None:
        super().__init__()
        self.model = model
        self.context = context
        """The session's files, bench results and verify callable (handed over by the app)."""
        self.selected: str | None = None
        self._finding_jump: tuple[int, int] | None = None
        """(finding, position in its linked nodes) of the last jump from the findings pane."""
        self.verify_state: str = "idle"
        """``idle``, ``running``, ``done``, ``cancelled`` or ``failed`` (for the tests and the panel)."""
        self.verify_result: Any = None
        self.last_export: Path | None = None
        self._verify_worker: Worker | None = None
        self._filter_timer: Any = None
        self._op_list_from_key = False
        """``o`` opened the op-type list: when it closes, the table gets the focus back."""
        """A filter refresh waiting for the typing to pause (large reports only)."""

    def _notify(self, message: str, **kwargs: Any) -> None:
        """Notify without markup: messages carry node names and paths, which may contain brackets."""
        self.notify(message, markup=False, **kwargs)

    # ----------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        """Header, table + overview on the left, detail + exclusions on the right, footer."""
        yield SummaryBar(self.model.report, self.model.baseline, id="summary")
        with Horizontal(id="body"):
            with Vertical(id="left"):
                yield FilterBar(self.model.op_types(), id="filters")
                yield NodeTable(id="nodes")
                yield FindingsPanel(self.model, id="findings")
                yield DepthChart(self.model.depth_profile(), id="depth")
            with Vertical(id="right"):
                yield DetailPanel(self.model, id="detail")
                yield ExclusionPanel(self.model, id="exclusion")
                yield VerifyPanel(id="verify")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        """Fill the table, select the most sensitive node, warn about proposal mismatches."""
        self.query_one(VerifyPanel).display = False
        self.query_one(FindingsPanel).display = False  # f opens it; the header counts the findings
        self.refresh_table()
        table = self.query_one(NodeTable)
        self._show(table.current)
        table.focus()
        m = self.model
        if m.unknown_proposal_nodes:
            names = ", ".join(m.unknown_proposal_nodes[:5])
            count = len(m.unknown_proposal_nodes)
            self._notify(
                f"the proposal names {count} node(s) not in the report, ignored: {names}",
                severity="warning",
                timeout=10,
            )
        recipe = m.proposal.recipe if m.proposal is not None else None
        if recipe is not None:
            self._notify(recipe_notice(recipe.steps or (recipe.name,)), timeout=10)
        if m.sha_mismatch:
            self._notify(
                "the proposal was made for another model (SHA-256 differs)", severity="warning", timeout=10
            )
        bench = self.context.bench
        if bench is not None and model_mismatch(m.report, bench):
            self._notify(MISMATCH, title="bench", severity="warning", timeout=10)
        if m.baseline is not None and m.baseline.warning():
            self._notify(m.baseline.warning(), title="baseline", severity="warning", timeout=12)

    # ----------------------------------------------------------------- redraw

    @property
    def table(self) -> NodeTable:
        """The node table."""
        return self.query_one(NodeTable)

    def refresh_table(self) -> None:
        """Rebuild the table from the model, keeping the selection when it is still shown."""
        rows = self.model.rows()
        self.table.show(self.model, rows, self.selected)
        self.query_one(FilterBar).set_count(len(rows), len(self.model.report.nodes))
        if not rows:
            self._show(None)
        self.query_one(DepthChart).refresh()

    def _show(self, name: str | None) -> None:
        self.selected = name if name is not None else self.selected
        self.query_one(DetailPanel).show_node(name)
        depth = self.model.node(name).depth if name is not None else -1
        self.query_one(DepthChart).selected_depth = depth

    # ----------------------------------------------------------------- widget messages

    def on_node_table_node_highlighted(self, event: NodeTable.NodeHighlighted) -> None:
        """Follow the cursor in the detail panel and the depth chart."""
        if event.node != self.selected or self.query_one(NodeDetail).node != event.node:
            self._show(event.node)

    def on_node_table_sort_requested(self, event: NodeTable.SortRequested) -> None:
        """A header click sorts by that column (again: reverses)."""
        self.action_sort(event.column)

    def on_filter_bar_changed(self, event: FilterBar.Changed) -> None:
        """Apply the name and op filters."""
        if event.query == self.model.name_query and event.op == self.model.op_filter:
            return
        self.model.name_query = event.query
        if event.op != self.model.op_filter:
            self.model.op_filter = event.op
            self.refresh_bindings()  # O (all ops) shows in the footer while an op filter is set
        if len(self.model.report.nodes) < DEBOUNCE_NODES:
            self.refresh_table()
            return
        # rebuilding a 5,000-row table took 2.6 s per keystroke: wait until the typing pauses
        if self._filter_timer is not None:
            self._filter_timer.stop()
        self._filter_timer = self.set_timer(DEBOUNCE_S, self._filtered)

    def _filtered(self) -> None:
        self._filter_timer = None
        self.refresh_table()

    @on(Input.Submitted, "#name-filter")
    def _filter_done(self) -> None:
        if self._filter_timer is not None:  # enter applies a pending filter at once
            self._filter_timer.stop()
            self._filtered()
        self.table.focus()

    def on_detail_panel_jump_requested(self, event: DetailPanel.JumpRequested) -> None:
        """Jump to the neighbour picked in the detail panel."""
        self.select_node(event.node)

    def on_exclusion_panel_jump_requested(self, event: ExclusionPanel.JumpRequested) -> None:
        """Jump to the node picked in the exclusion list."""
        self.select_node(event.node)

    def on_findings_panel_jump_requested(self, event: FindingsPanel.JumpRequested) -> None:
        """Jump to the next node the picked finding names (the pane keeps the focus)."""
        finding = self.model.findings[event.index]
        linked = finding.linked
        if not linked:
            self._notify(f"finding {event.index + 1} names no node of the report", timeout=4)
            return
        last = self._finding_jump
        again = last is not None and last[0] == event.index and self.table.current == linked[last[1]]
        k = (last[1] + 1) % len(linked) if again and last is not None else 0
        self._finding_jump = (event.index, k)
        self.select_node(linked[k], focus=False)
        if len(linked) > 1:
            self._notify(
                f"{linked[k]}: {k + 1} of the {len(linked)} nodes finding {event.index + 1} names (enter: the next)",
                timeout=4,
            )

    def select_node(self, name: str, focus: bool = True) -> None:
        """Select ``name`` in the table (clearing the filters if they hide it) and focus the table (unless
        ``focus`` is False: the findings pane keeps it)."""
        self.selected = name
        if name in self.table.rows:  # already shown: move there (a rebuild took 1-1.7 s at 2,000 nodes)
            self.table.move_cursor(row=self.table.get_row_index(name), scroll=True)
        else:
            if not any(n.name == name for n in self.model.rows()):
                self.model.clear_filters()
                self.query_one(FilterBar).set_filters("", None)
                self.refresh_bindings()
                self._notify(f"filters cleared to show {name}", timeout=3)
            self.refresh_table()
        self._show(name)
        if focus:
            self.table.focus()

    # ----------------------------------------------------------------- actions

    def action_toggle_exclusion(self) -> None:
        """Exclude or include the node under the cursor (or the highlighted entry of the exclusion list), or
        on the findings pane the nodes of the highlighted finding."""
        name = self.table.current
        listed = self.query_one("#exclusions", OptionList)
        findings = self.query_one(FindingsPanel)
        if self.app.focused is findings.entries and findings.highlighted is not None:
            self.toggle_finding(findings.highlighted)
            return
        if self.app.focused is listed and listed.highlighted is not None:
            name = listed.get_option_at_index(listed.highlighted).id
        if name is None:
            self._notify("no node selected", severity="warning")
            return
        self._exclusions_changed((name,), self.model.toggle(name))

    def toggle_finding(self, index: int) -> None:
        """Exclude the nodes finding ``index`` advises excluding, or include them again when all are."""
        finding = self.model.findings[index]
        if not finding.targets:
            what = "no node the quantizer touches" if finding.linked else "no node of the report"
            self._notify(f"finding {index + 1} names {what}: nothing to exclude", severity="warning", timeout=4)
            return
        excluded, changed = self.model.toggle_finding(index)
        self._exclusions_changed(changed, excluded)
        names = ", ".join(changed)
        if excluded:
            self._notify(f"excluded {names} (finding {index + 1}); v verifies the set", timeout=6)
        else:
            self._notify(f"included {names} again (finding {index + 1})", timeout=4)

    def _exclusions_changed(self, names: tuple[str, ...], excluded: bool) -> None:
        """Redraw what shows the exclusion of ``names`` (now ``excluded``)."""
        if self.model.sort_key == "excluded":
            self.refresh_table()
        else:
            for name in names:
                self.table.set_excluded(name, excluded)
        self.query_one(ExclusionPanel).refresh_set()
        self.query_one(NodeDetail).refresh(layout=True)
        findings = self.query_one(FindingsPanel)
        if findings.display:
            findings.refresh_marks()

    def action_findings(self) -> None:
        """Open the findings pane (focused) or close it."""
        findings = self.query_one(FindingsPanel)
        if findings.display:
            findings.display = False
            self.set_class(False, "-findings")
            self.table.focus()
            return
        if not self.model.findings:
            self._notify("the report has no notes", timeout=3)
            return
        findings.refresh_marks()
        findings.display = True
        self.set_class(True, "-findings")  # below 110 columns the pane takes the detail's rows
        if findings.entries.highlighted is None:
            findings.entries.highlighted = 0
        findings.entries.focus()

    def action_jump(self, direction: str) -> None:
        """Jump to the worst producer (``up``) or consumer (``down``) of the selected node."""
        name = self.table.current
        if name is None:
            return
        nodes = self.model.predecessors(name) if direction == "up" else self.model.successors(name)
        target = self.model.worst(nodes)
        if target is None:
            what = (
                "producer (graph input or weights only)" if direction == "up" else "consumer (graph output)"
            )
            self._notify(f"{name} has no {what}", timeout=3)
            return
        self.select_node(target.name)

    def action_sort(self, key: str) -> None:
        """Sort by column ``key`` (the current column again: reverse)."""
        self.model.set_sort(key)
        self._resorted()

    def _resorted(self) -> None:
        """Show the new order from its top, the cursor on the first row: a sort is asked for to see what
        comes first (9, ΔAdd, had kept the cursor on the selected node far down, the new top off screen).
        A refresh for another reason (a filter, an exclusion while sorted by X) keeps the selection."""
        rows = self.model.rows()
        if rows:
            self.selected = rows[0].name
        self.refresh_table()
        if rows:
            self._show(rows[0].name)  # the cursor may not move (the first row already had it): no event

    def action_sort_column(self, index: int) -> None:
        """Sort by the table's column ``index`` (0-based; the keys 9 and 0 reach the comparison columns)."""
        columns = self.model.columns()
        if index < len(columns):
            self.action_sort(columns[index].key)

    def action_cycle_sort(self) -> None:
        """Sort by the next column."""
        self.model.cycle_sort()
        self._resorted()

    def action_reverse_sort(self) -> None:
        """Reverse the sort direction."""
        self.model.set_sort(self.model.sort_key, not self.model.descending)
        self._resorted()

    def action_focus_filter(self) -> None:
        """Focus the name filter."""
        self.query_one("#name-filter", Input).focus()

    def action_pick_op(self) -> None:
        """Open the op-type list of the filter bar, focused (type to search, enter picks, esc keeps the filter).

        ``o`` had stepped through the op types one press at a time: 27 presses back to all ops on a model
        of 26 op types. Once the list closes, the table has the focus again.
        """
        select = self.query_one("#op-filter", Select)
        select.focus()
        select.expanded = True
        self._op_list_from_key = True

    def on_descendant_focus(self, event: events.DescendantFocus) -> None:
        """The op-type list opened by ``o`` gives the focus back to its Select when it closes: on to the table."""
        select = self.query_one("#op-filter", Select)
        if self._op_list_from_key and event.widget is select and not select.expanded:
            self._op_list_from_key = False
            self.table.focus()

    def action_all_ops(self) -> None:
        """Drop the op-type filter (``O``; the footer offers it only while one is set)."""
        self.model.op_filter = None
        self.query_one(FilterBar).set_filters(self.model.name_query, None)
        self.refresh_table()
        self.refresh_bindings()

    def action_escape(self) -> None:
        """Cancel a running verify; otherwise leave the filter input or the findings pane."""
        if self.verify_state == "running" and self._verify_worker is not None:
            self._verify_worker.cancel()
            return
        if isinstance(self.focused, Input) or self.focused is self.query_one(FindingsPanel).entries:
            self.table.focus()

    def action_help(self) -> None:
        """Show the key bindings."""
        self.app.push_screen(HelpScreen(self.model.columns()))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``bench`` when a bench file is loaded, ``bench_missing`` when not (both on ``b``)."""
        if action == "bench":
            return self.context.bench is not None
        if action == "all_ops":
            return self.model.op_filter is not None
        if action == "bench_missing":
            return self.context.bench is None
        if action in ("samples", "samples_missing"):
            return (self.model.report.per_sample is not None) == (action == "samples")
        if action == "sort_column":  # 9 and 0: only with the comparison columns
            return bool(parameters) and int(parameters[0]) < len(self.model.columns())  # type: ignore[call-overload]
        return True

    def action_samples(self) -> None:
        """Show the flipped samples and where each diverges."""
        section = self.model.report.per_sample
        if section is None:
            self.action_samples_missing()
            return
        self.app.push_screen(SamplesScreen(SamplesModel(section, self.model.report)))

    def action_samples_missing(self) -> None:
        """Say that the report has no per-sample drill-down, and how to get one."""
        self._notify(
            "this report has no per-sample drill-down (written before it, or the metric gives no result per "
            "sample): re-run qdebug analyze",
            title="samples",
            severity="warning",
            timeout=8,
        )

    def action_bench(self) -> None:
        """Show the bench results (with a warning line when they are for another model)."""
        bench = self.context.bench
        if bench is None:
            self.action_bench_missing()
            return
        self.app.push_screen(BenchScreen(bench, mismatch=model_mismatch(self.model.report, bench)))

    def action_bench_missing(self) -> None:
        """Say how to make a bench file and open it."""
        self._notify(
            bench_hint(self.model.report, self.context.report_path),
            title="bench",
            severity="warning",
            timeout=12,
        )

    # ----------------------------------------------------------------- export

    def action_export(self) -> None:
        """Ask for a path (default next to the report) and write the proposal there."""
        self.app.push_screen(ExportDialog(str(self.context.export_path)), self._export_to)

    def _export_to(self, path: str | None) -> None:
        if not path:
            return
        self.export(path)

    def export(self, path: str | Path) -> Proposal | None:
        """Write the current exclusion set as a proposal to ``path``; errors become notifications."""
        proposal = self.model.to_proposal()
        report = self.model.report
        try:  # never over a file this session read, the model or the files the report points at
            try:  # typed in the dialog: "~/p.json" had made a directory named "~"
                path = Path(path).expanduser()
            except RuntimeError:  # "~nosuchuser/p.json" had closed the app with a traceback
                raise QDebugError(f"cannot expand {path}: no such user's home directory") from None
            spared = {
                "the report": self.context.report_path,
                "the model": report.model.path,
                "the normalized model": report.normalized_model,
                "the quantized model": report.quantized_model.path,
                "the calibration data": report.config.calib,
                "the evaluation data": report.config.eval,
                "the calibration cache": report.calibration_cache,
                **self.context.inputs,
            }
            check_outputs_spare_inputs({"the export": path}, spared)
            _refuse_foreign_file(path)
            atomic_write_text(path, dumps(proposal))
        except QDebugError as e:  # the hints name flags (-o) this app does not have
            self._notify(f"{e.message} -- choose another path", title="export failed", severity="error", timeout=10)
            return None
        self.last_export = Path(path)
        n = len(proposal.nodes_to_exclude)
        self._notify(
            f"wrote {path} ({n} node{'s' if n != 1 else ''} excluded)", title="proposal exported", timeout=8
        )
        if n == 0 and not proposal.tensor_overrides:
            self._notify("the proposal excludes no node (full static quantization)", severity="warning")
        return proposal

    def action_copy_snippet(self) -> None:
        """Copy the ``quantize_static`` snippet to the clipboard and show it."""
        snippet = self.model.to_proposal().snippet
        self.app.copy_to_clipboard(snippet)
        self.app.push_screen(
            TextDialog(
                "quantize_static snippet",
                snippet,
                "copied to the clipboard (OSC 52) · ↑ ↓ ← → scroll · esc closes",
                code=True,
            )
        )

    # ----------------------------------------------------------------- verify

    def action_verify(self) -> None:
        """Run the verify callable on the current set in a thread, with progress and cancel."""
        if self.context.verify_fn is None:
            self._notify(VERIFY_UNAVAILABLE, title="verify", severity="warning", timeout=8)
            return
        if self.verify_state == "running":
            self._notify("verify is already running (esc cancels)", severity="warning")
            return
        self.verify_state = "running"
        self.verify_result = None
        self.query_one(VerifyPanel).start()
        self.set_class(True, "-verify")  # below 110 columns the panel takes rows of its own
        self._verify_worker = self._run_verify(self.model.to_proposal())

    @work(thread=True, exclusive=True, exit_on_error=False, group="verify", name="verify")
    def _run_verify(self, proposal: Proposal) -> Any:
        worker = get_current_worker()
        verify_fn = self.context.verify_fn
        assert verify_fn is not None

        last = [float("-inf")]  # the first report always shows

        def progress(fraction: float, text: str) -> None:
            # throttled: a chatty callable must not flood the UI's message queue
            now = time.monotonic()
            if worker.is_cancelled or (now - last[0] < PROGRESS_INTERVAL_S and fraction < 1.0):
                return
            last[0] = now
            self.post_message(VerifyProgress(float(fraction), str(text)))

        return verify_fn(proposal, progress, lambda: worker.is_cancelled)

    def on_verify_progress(self, event: VerifyProgress) -> None:
        """Move the progress bar."""
        if self.verify_state == "running":
            self.query_one(VerifyPanel).progress(event.fraction, event.text)

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """Show the verify outcome: result dialog, cancellation or the error."""
        if event.worker is not self._verify_worker:
            return
        panel = self.query_one(VerifyPanel)
        if event.state == WorkerState.SUCCESS:
            self.verify_state = "done"
            self.verify_result = event.worker.result
            lines = summary_lines(self.verify_result)
            panel.finish("done", lines, "bold green")
            self.app.push_screen(TextDialog("verify result", "\n".join(lines)))
        elif event.state == WorkerState.CANCELLED:
            self.verify_state = "cancelled"
            panel.finish("cancelled", [], "yellow")
            self._notify("verify cancelled", severity="warning")
        elif event.state == WorkerState.ERROR:
            self.verify_state = "failed"
            err = event.worker.error
            if isinstance(err, QDebugError):
                message = err.one_line()
                details = message
            else:
                message = f"{type(err).__name__}: {err}"
                details = "".join(traceback.format_exception(err)) if err is not None else message
            panel.finish("failed", [message], "bold red")
            self._notify(message, title="verify failed", severity="error", timeout=10)
            self.app.push_screen(TextDialog("verify failed", details))


class BenchScreen(Screen[None]):
    """``qdebug bench`` results: run and machine, one row per variant, metric vs p50 latency."""

    BINDINGS = [
        Binding("escape,b,q", "close", "Back"),
    ]

    def __init__(self, bench: BenchReport, mismatch: bool = False) -> None:
        super().__init__()
        self.bench = bench
        self.mismatch = mismatch

    def compose(self) -> ComposeResult:
        """Header lines, variant table, chart, notes (scrolling together when short of rows), footer."""
        head = Text()
        head.append(title_line(self.bench), style="bold")
        head.append("\n" + machine_line(self.bench), style="dim")
        if self.bench.machine.warning:
            head.append("\nwarning: " + self.bench.machine.warning, style="yellow")
        if self.mismatch:
            head.append("\nwarning: " + MISMATCH, style="bold yellow")
        with VerticalScroll(id="bench-body"):
            yield Static(head, id="bench-head")
            yield BenchTable(self.bench, id="bench-table")
            yield BenchChart(self.bench, id="bench-chart")
            notes = note_lines(self.bench)
            yield Static(Text("\n".join(notes), style="dim"), id="bench-notes")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        """Hide an empty notes block; focus the scrolling body (arrows and page keys scroll it)."""
        self.query_one("#bench-notes").display = bool(note_lines(self.bench))
        self.query_one("#bench-body").focus()

    def action_close(self) -> None:
        """Back to the node table."""
        self.dismiss(None)


class HelpScreen(ModalScreen[None]):
    """The key bindings."""

    BINDINGS = [
        Binding("escape,question_mark,q", "close", "Close"),
    ]

    def __init__(self, columns: tuple[Column, ...] = COLUMNS) -> None:
        super().__init__()
        self.columns = columns
        """The node table's columns (the comparison ones with a baseline), each with its key."""

    def compose(self) -> ComposeResult:
        """A two-column table of keys."""
        t = Text()
        for key, text in HELP_ROWS:
            t.append(f"{key:>10}  ", style="bold cyan")
            t.append(text + "\n")
        t.append("\ncolumns\n", style="bold")
        for i, col in enumerate(self.columns):
            t.append(f"{(i + 1) % 10} {col.label:>8}  ", style="bold cyan")
            t.append(col.title + "\n")
        t.append(
            "\nThe table starts sorted by added noise, worst (highest) first: the noise\n"
            "a node adds relative to the signal, 10·log10(NSR_out - NSR_in) with\n"
            "NSR = 10^(-SQNR/10); -inf: it adds none. Noise powers add up along the\n"
            "graph, so this compares nodes by their share of the final error, where\n"
            "introduced dB (an SQNR ratio) is large for any node near the clean input.\n"
            "Non-finite values (+inf: exact, -inf, nan: undefined) sort after the numbers.",
            style="dim",
        )
        with Vertical(id="dialog"):
            yield Label(Text("qdebug keys", style="bold"), id="dialog-title")
            yield VerticalScroll(Static(t))
            yield Label(Text("↑ ↓ scroll · esc / ? closes", style="dim"))

    def action_close(self) -> None:
        """Close."""
        self.dismiss(None)


class TextDialog(ModalScreen[None]):
    """A scrollable block of text (snippet, verify result, error) with a title."""

    BINDINGS = [Binding("escape,q,enter", "close", "Close")]

    def __init__(self, title: str, body: str, footnote: str = "esc closes", code: bool = False) -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.footnote = footnote
        self.code = code
        """Lines are shown whole and scroll sideways: wrapped at 80 columns, the snippet's continuation
        lines started at column 0 and its indentation no longer read as Python."""

    def compose(self) -> ComposeResult:
        """Title, body, footnote."""
        with Vertical(id="dialog"):
            yield Label(Text(self.title_text, style="bold"), id="dialog-title")
            with VerticalScroll(classes="code" if self.code else ""):
                body = Text(self.body, no_wrap=self.code, overflow="ignore" if self.code else None)
                yield Static(body, id="dialog-body", classes="code" if self.code else "")
            yield Label(Text(self.footnote, style="dim"))

    def action_close(self) -> None:
        """Close."""
        self.dismiss(None)


class ExportDialog(ModalScreen[str | None]):
    """Ask where to write the proposal; returns the path or ``None`` (cancelled)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, default_path: str) -> None:
        super().__init__()
        self.default_path = default_path

    def compose(self) -> ComposeResult:
        """Prompt and path input."""
        with Vertical(id="dialog", classes="small"):
            yield Label(Text("Export proposal to", style="bold"), id="dialog-title")
            yield Input(value=self.default_path, id="export-path")
            yield Label(Text("enter writes · esc cancels", style="dim"))

    @on(Input.Submitted, "#export-path")
    def _submit(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        """Close without writing."""
        self.dismiss(None)


def _refuse_foreign_file(path: Path) -> None:
    """An existing file at ``path`` is replaced only if it is a qdebug proposal (an earlier export): a
    typo in the dialog had silently replaced whatever file was there (the data, any JSON)."""
    if not path.is_file():
        return
    import json

    try:
        with open(path, encoding="utf-8") as f:
            kind = json.load(f).get("kind")
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        kind = None
    if kind != "proposal":
        raise QDebugError(f"{path} exists and is not a qdebug proposal: not replaced")
