"""The samples screen (``i``): the evaluation samples whose result flips, and where each diverges.

Left, the flipped samples of the report's per-sample drill-down in a sortable table (``s`` the next column,
``r`` reverse, a header click sorts by it); right, the highlighted sample along depth: one row per tensor
in topological order with its SQNR for that sample as a bar, the noise its producer adds, its clip rate
against the calibrated range and the tensor's SQNR over the whole capture (the report's), the three tensors
of most added noise marked. The order and the rows come from :class:`~qdebug.tui.samples_model.SamplesModel`.

Below :data:`SIDE_BY_SIDE` columns the two are stacked, samples on top: side by side at 80 or 120 columns
each table had half the width, and the divergence's SQNR, added noise and clip columns sat off screen,
reachable only by an unadvertised tab and right arrow.
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from qdebug.output.formatting import fmt_db, shorten
from qdebug.tui.samples_model import NAME_WIDTH, SAMPLE_COLUMNS, SamplesModel

DIVERGENCE_COLUMNS = ("tensor", "SQNR dB", "added dB", "clip", "report SQNR", "", "depth")
"""The numbers first, after the (shortened) name: they fit 80 columns; the bar and the depth may scroll."""

SIDE_BY_SIDE = 160
"""Columns from which the samples and the divergence tables sit side by side (each has room then)."""


class SamplesScreen(Screen[None]):
    """Flipped samples (sortable), and the highlighted one's divergence along depth."""

    DEFAULT_CSS = """
    #samples-head { height: auto; padding: 0 1; background: $panel; }
    #samples-body { height: 1fr; }
    #flips { width: 1fr; }
    #sample-pane { width: 1fr; border-left: solid $primary-darken-2; }
    #sample-head { height: auto; padding: 0 1; }
    #divergence { height: 1fr; }
    SamplesScreen.-stacked #samples-body { layout: vertical; }
    SamplesScreen.-stacked #flips { width: 100%; height: auto; max-height: 40%; min-height: 4; }
    SamplesScreen.-stacked #sample-pane {
        width: 100%; height: 1fr; border-left: none; border-top: solid $primary-darken-2;
    }
    """

    HORIZONTAL_BREAKPOINTS = [(0, "-stacked"), (SIDE_BY_SIDE, "-side")]

    BINDINGS = [
        Binding("escape,i,q", "close", "Back"),
        Binding("s", "cycle_sort", "Sort"),
        Binding("r", "reverse_sort", "Reverse"),
        Binding("tab", "other_table", "Samples/tensors", key_display="tab"),
    ]

    def __init__(self, model: SamplesModel) -> None:
        super().__init__()
        self.model = model
        self.shown: int | None = None
        """The sample whose divergence the right pane shows (for the tests)."""

    def compose(self) -> ComposeResult:
        """Head line, the samples table | the divergence pane, footer."""
        head = Text(self.model.title(), style="bold")
        head.append("\n" + self.model.section.rule, style="dim")
        yield Static(head, id="samples-head")
        with Horizontal(id="samples-body"):
            yield DataTable(id="flips", cursor_type="row", zebra_stripes=True)
            with Vertical(id="sample-pane"):
                yield Static(id="sample-head")
                yield DataTable(id="divergence", cursor_type="row")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        """Fill the tables; the worst sample first."""
        flips = self.query_one("#flips", DataTable)
        for col in SAMPLE_COLUMNS:
            flips.add_column(col.label, key=col.key)
        divergence = self.query_one("#divergence", DataTable)
        for label in DIVERGENCE_COLUMNS:
            divergence.add_column(label)
        self.refresh_rows()
        flips.focus()

    @property
    def flips(self) -> DataTable:
        """The flipped-samples table."""
        return self.query_one("#flips", DataTable)

    def refresh_rows(self, top: bool = False) -> None:
        """Rebuild the samples table in the model's order, keeping the highlighted sample (``top``: a new
        order, the cursor on its first row, as the node table's sort keys do)."""
        table = self.flips
        keep = None if top else self.shown
        table.clear()
        rows = self.model.rows()
        for row in rows:
            table.add_row(*row.cells, key=str(row.flip.index))
        if not rows:
            self.query_one("#sample-head", Static).update(Text("no sample flipped", style="dim"))
            return
        indices = [r.flip.index for r in rows]
        target = keep if keep in indices else indices[0]
        table.move_cursor(row=indices.index(target))
        self.show_sample(target)

    def show_sample(self, index: int) -> None:
        """Show sample ``index``'s divergence along depth in the right pane."""
        self.shown = index
        self.query_one("#sample-head", Static).update(Text(self.model.detail_head(index)))
        table = self.query_one("#divergence", DataTable)
        table.clear()
        for r in self.model.divergence(index):
            style = "bold red" if r.worst else ""
            clip = "-" if math.isnan(r.clip_rate) else f"{100 * r.clip_rate:.1f}%"
            table.add_row(
                Text(shorten(r.tensor, NAME_WIDTH), style=style),
                fmt_db(r.sqnr_db),
                Text(fmt_db(r.added_noise_db), style=style),
                Text(clip, style="yellow" if clip not in ("-", "0.0%") else ""),
                fmt_db(r.report_sqnr_db),
                Text(r.bar, style="cyan"),
                str(r.depth),
            )

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Follow the cursor of the samples table."""
        if event.data_table is self.flips and event.row_key.value is not None:
            index = int(event.row_key.value)
            if index != self.shown:
                self.show_sample(index)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """A header click on the samples table sorts by that column (again: reverses)."""
        if event.data_table is self.flips and event.column_key.value is not None:
            self.model.set_sort(str(event.column_key.value))
            self.refresh_rows(top=True)

    def action_cycle_sort(self) -> None:
        """Sort by the next column."""
        self.model.cycle_sort()
        self.refresh_rows(top=True)

    def action_reverse_sort(self) -> None:
        """Reverse the order."""
        self.model.descending = not self.model.descending
        self.refresh_rows(top=True)

    def action_other_table(self) -> None:
        """Focus the other table (its arrows then move and scroll it): samples <-> tensors."""
        divergence = self.query_one("#divergence", DataTable)
        (self.flips if divergence.has_focus else divergence).focus()

    def action_close(self) -> None:
        """Back to the node table."""
        self.dismiss(None)
