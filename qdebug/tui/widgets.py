"""The widgets of the main screen. Each one renders part of a :class:`LayerModel`.

Widgets never change the model: they post their own small dataclass messages
(``NodeTable.NodeHighlighted``, ``DetailPanel.JumpRequested``...) and the
screen, which owns the model, acts on them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import DataTable, Input, Label, OptionList, ProgressBar, Select, Static
from textual.widgets.data_table import ColumnKey, RowKey
from textual.widgets.option_list import Option

from qdebug.output.formatting import shorten
from qdebug.records import KERNEL_GAP_DB, ErrorStats, NodeRecord, Report, TensorRecord
from qdebug.records.profile import CAUSES, NodeLatency
from qdebug.tui import charts
from qdebug.tui.compare import Baseline, change_text, change_value, judge
from qdebug.tui.model import (
    CELL_TEXT,
    COLUMN_KEYS,
    COLUMNS,
    DELTA_FIELDS,
    FINDING_REASON,
    HAND_REASON,
    PROFILE_KEYS,
    Column,
    LayerModel,
    TableLayout,
    fmt_db,
    fmt_metric,
    fmt_metric_delta,
    fmt_num,
    fmt_small,
    frontier_line,
    table_layout,
)

if TYPE_CHECKING:
    pass

EXCLUDED_MARK = "✗"


# --------------------------------------------------------------------------- styles


def sqnr_style(x: float) -> str:
    """Colour of an SQNR value: red below 20 dB, yellow below 30 dB, green above; nan dimmed."""
    if math.isnan(x):
        return "dim"
    if x < 20:
        return "bold red"
    if x < 30:
        return "yellow"
    return "green"


def introduced_style(x: float) -> str:
    """Colour of an introduced-error value: red above 3 dB, yellow above 1 dB."""
    if math.isnan(x):
        return "dim"
    if x > 3:
        return "bold red"
    if x > 1:
        return "yellow"
    return ""


def added_style(x: float) -> str:
    """Colour of an added-noise value (dB re. signal): red above -20 dB, yellow above -30 dB.

    The same thresholds as :func:`sqnr_style`: a node adding -20 dB of noise
    alone takes a clean signal to 20 dB SQNR.
    """
    if math.isnan(x) or x == -math.inf:
        return "dim"
    if x > -20:
        return "bold red"
    if x > -30:
        return "yellow"
    return ""


CHANGE_STYLES = {"worse": "bold red", "better": "green", "same": "dim", "": "dim"}
"""Colour of a change against the baseline, by :func:`qdebug.tui.compare.judge`: the diff's verdicts."""


def db_text(x: float, style: str, suffix: str = "") -> Text:
    """A right-aligned dB cell."""
    return Text(fmt_db(x) + suffix, style=style, justify="right")


# --------------------------------------------------------------------------- header


class SummaryBar(Widget):
    """Model, analysis settings, FP32 vs quantized task metric and output SQNR, wrapped to the width; with a
    baseline, a line on what the comparison columns compare against."""

    def __init__(self, report: Report, baseline: Baseline | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.report = report
        self.baseline = baseline
        self.set_class(baseline is not None, "-compare")  # one line more may show

    def render(self) -> Text:
        """The header for the current width."""
        return summary_text(self.report, self.content_size.width or None, self.baseline)

    def get_content_height(self, container, viewport, width: int) -> int:
        """As many lines as the fields need at ``width``."""
        return len(summary_text(self.report, width, self.baseline).plain.split("\n"))


def summary_fields(report: Report) -> tuple[list[Text], list[Text]]:
    """The header's fields: (model and settings, results); each field is kept whole on one line."""
    m = report.model
    cfg = report.config
    name = m.path.rsplit("/", 1)[-1] or "(unnamed model)"
    head = Text.assemble(("qdebug ", "bold"), (name, "bold cyan"))
    per_channel = " per-channel" if cfg.per_channel else ""
    setup = [
        head,
        Text(f"opset {m.opset}", style="dim"),
        Text(f"{len(report.nodes)} nodes", style="dim"),
        Text(f"{report.samples} samples", style="dim"),
        Text(f"{cfg.method} {cfg.activation_type}/{cfg.weight_type}{per_channel}", style="dim"),
    ]
    results: list[Text] = []
    task = report.task
    if task is not None and task.name == SQNR_METRIC:
        results.extend(_sqnr_metric_fields(report))
    elif task is not None:
        delta = task.quantized - task.fp32
        t = Text(f"{task.name} ({task.data}, {task.samples}): ")
        t.append(f"FP32 {fmt_metric(task.name, task.fp32)}", style="bold")
        t.append(" → ")
        t.append(f"{quant_label(report)} {fmt_metric(task.name, task.quantized)}", style="bold")
        t.append(f" ({fmt_metric_delta(task.name, delta)})", style="bold red" if delta < 0 else "green")
        results.append(t)
        if not math.isnan(task.quantized_fakequant):
            fq = Text("fake-quant ")
            fq.append(fmt_metric(task.name, task.quantized_fakequant), style="bold")
            if task.fakequant_samples and task.fakequant_samples < task.samples:
                same = fmt_metric(task.name, task.quantized_same_samples)
                label = quant_label(report)
                fq.append(f" vs {label} {same} on the first {task.fakequant_samples}", style="dim")
            results.append(fq)
    else:
        results.append(Text("no task metric", style="dim"))
    for out in report.outputs:
        if not out.error.count:  # an integer output (ArgMax): nothing was compared, "nan dB" said nothing
            continue
        o = Text(f"{out.name} SQNR ")
        o.append(f"{fmt_db(out.error.sqnr_db)} dB", style=sqnr_style(out.error.sqnr_db))
        results.append(o)
    if report.deployed_gap:
        results.append(Text(f"deployed gap {report.deployed_gap:.3g}", style="yellow"))
    if report.notes:  # analyze's diagnoses: f opens them (the findings pane)
        k = len(report.notes)
        results.append(Text(f"{k} finding{'s' if k != 1 else ''} (f)", style="bold yellow"))
    if report.per_sample is not None and report.per_sample.variants:  # i opens the samples screen
        k = report.per_sample.variants[-1].flipped
        results.append(Text(f"{k} flipped sample{'s' if k != 1 else ''} (i)", style="bold yellow"))
    return setup, results


SQNR_METRIC = "output_sqnr_db"
"""The task metric of a model without labels: the output SQNR against FP32, whose own value is +inf."""


def _sqnr_metric_fields(report: Report) -> list[Text]:
    """``output SQNR (eval, 500): INT8 32.41 dB`` (and the fake-quant value): FP32 is the reference, so
    ``FP32 inf → INT8 32.41 (-inf)`` compared it with itself and called the result a drop of -inf."""
    task = report.task
    assert task is not None
    t = Text(f"output SQNR ({task.data}, {task.samples}): ")
    t.append(f"{quant_label(report)} {fmt_metric(task.name, task.quantized)} dB", style="bold")
    fields = [t]
    if not math.isnan(task.quantized_fakequant):
        fq = Text("fake-quant ")
        fq.append(f"{fmt_metric(task.name, task.quantized_fakequant)} dB", style="bold")
        if task.fakequant_samples and task.fakequant_samples < task.samples:
            same = fmt_metric(task.name, task.quantized_same_samples)
            fq.append(f" vs {quant_label(report)} {same} dB on the first {task.fakequant_samples}", style="dim")
        fields.append(fq)
    return fields


def comparison_fields(baseline: Baseline) -> list[Text]:
    """The header's comparison group: the baseline, the settings that differ (baseline value first), how many
    nodes paired and how they changed."""
    head = Text.assemble(("vs ", "bold"), (baseline.label, "bold yellow"), (" (Δ = this − baseline)", "dim"))
    fields = [head, *(Text(s) for s in baseline.settings_text())]
    if not baseline.settings_text():
        fields.append(Text("same settings", style="dim"))
    paired = Text(baseline.pairing_line(), style="bold yellow" if baseline.warning() else "dim")
    fields.append(paired)
    fields.append(Text(baseline.tally_line()))
    return fields


def summary_text(report: Report, width: int | None = None, baseline: Baseline | None = None) -> Text:
    """The header text of ``report``: settings, then results, then (with a baseline) the comparison, each
    group wrapped at fields to ``width``.

    ``None``: no wrapping (one line per group). A field wider than ``width`` is
    cut with an ellipsis by the widget.
    """
    t = Text(no_wrap=True, overflow="ellipsis")
    groups = list(zip(summary_fields(report), (" · ", " │ "), strict=True))
    if baseline is not None:
        groups.append((comparison_fields(baseline), " · "))
    for i, (fields, sep) in enumerate(groups):
        if i:
            t.append("\n")
        used = 0
        for j, field in enumerate(fields):
            if j and width is not None and used + len(sep) + field.cell_len > width:
                t.append("\n")
                used = 0
            elif j:
                t.append(sep, style="dim")
                used += len(sep)
            t.append_text(field)
            used += field.cell_len
    return t


# --------------------------------------------------------------------------- filters


class FilterBar(Horizontal):
    """Fuzzy name search and op-type select above the table."""

    @dataclass
    class Changed(Message):
        """The user changed the name query or the op filter."""

        query: str
        op: str | None
        """``None``: every op type."""

    def __init__(self, op_types: tuple[str, ...], **kwargs) -> None:
        super().__init__(**kwargs)
        self._ops = op_types

    def compose(self) -> ComposeResult:
        """An input and a select, both one line high."""
        yield Input(placeholder="fuzzy filter by name  (/)", id="name-filter", compact=True)
        yield Select(
            [(Text(op), op) for op in self._ops],  # op types come from the model: never markup
            prompt="all ops  (o)",
            id="op-filter",
            compact=True,
        )
        yield Static(id="row-count")

    def set_count(self, shown: int, total: int) -> None:
        """Show how many nodes pass the filters."""
        style = "bold yellow" if shown < total else "dim"
        self.query_one("#row-count", Static).update(Text(f"{shown}/{total}", style=style))

    @property
    def query(self) -> str:
        """The current name query."""
        return self.query_one("#name-filter", Input).value

    @property
    def op(self) -> str | None:
        """The current op filter (``None`` for all)."""
        sel = self.query_one("#op-filter", Select)
        return None if sel.is_blank() else str(sel.value)

    def set_filters(self, query: str, op: str | None) -> None:
        """Show ``query`` and ``op`` (posts ``Changed`` only through the child widgets' own events)."""
        inp = self.query_one("#name-filter", Input)
        if inp.value != query:
            inp.value = query
        sel = self.query_one("#op-filter", Select)
        if op is None:
            if not sel.is_blank():
                sel.clear()
        elif sel.value != op:
            sel.value = op

    @on(Input.Changed, "#name-filter")
    @on(Select.Changed, "#op-filter")
    def _changed(self, event: Message) -> None:
        event.stop()
        self.post_message(self.Changed(self.query, self.op))


# --------------------------------------------------------------------------- table


class NodeTable(DataTable):
    """The node table; its row keys are node names.

    Column widths follow the table's width (see :func:`~qdebug.tui.model.table_layout`):
    numbers are never cut; op types are abbreviated and names cut in the middle
    only when the whole row would not fit.
    """

    @dataclass
    class NodeHighlighted(Message):
        """The cursor moved to ``node`` (keyboard or mouse)."""

        node: str

    @dataclass
    class SortRequested(Message):
        """The user clicked the header of column ``column``."""

        column: str

    def __init__(self, **kwargs) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, cell_padding=0, **kwargs)
        self._shown: tuple[LayerModel, list[NodeRecord]] | None = None
        self.column_layout: TableLayout | None = None
        """The column layout the table was last drawn with."""
        self._layout_key: tuple[LayerModel, int | None] | None = None
        self._layout: TableLayout | None = None
        self._cells: dict[str, tuple[bool, tuple[Text, ...]]] = {}
        """Each node's (excluded, row cells) for :attr:`column_layout`: built once, not per sort or filter."""

    def _available(self) -> int | None:
        """Cells for the columns (the vertical scrollbar's share excluded); ``None`` before layout."""
        width = self.size.width
        if width <= 0:
            return None
        return width - self.styles.scrollbar_size_vertical

    def _table_layout(self, model: LayerModel) -> TableLayout:
        """:func:`table_layout` of every node at the current width (measuring 5,000 names per sort: cached)."""
        key = (model, self._available())
        if self._layout is None or self._layout_key != key:
            self._layout = table_layout(model.report.nodes, key[1], model.extra_cells())
            self._layout_key = key
        return self._layout

    def _row(self, model: LayerModel, n: NodeRecord, layout: TableLayout) -> tuple[Text, ...]:
        """The cells of node ``n`` (rebuilt when its exclusion changed since they were built)."""
        excluded = model.is_excluded(n.name)
        cached = self._cells.get(n.name)
        if cached is None or cached[0] != excluded:
            cached = self._cells[n.name] = (excluded, row_cells(n, excluded, layout, model))
        return cached[1]

    def _mark_row(self, model: LayerModel, n: NodeRecord, excluded: bool, layout: TableLayout) -> None:
        """Redraw the cells of a shown row that show its exclusion (the mark, the name's colour)."""
        cells = row_cells(n, excluded, layout, model)
        self._cells[n.name] = (excluded, cells)
        for key in ("excluded", "name"):
            self.update_cell(n.name, key, cells[COLUMN_KEYS.index(key)])

    def show(self, model: LayerModel, rows: list[NodeRecord], selected: str | None) -> None:
        """Show ``rows`` in this order, keeping the cursor on ``selected`` when shown.

        When only the order changed (a sort) the rows are reordered in place; otherwise (a filter, a new
        layout) the table is refilled from cells built once per node and layout.
        """
        layout = self._table_layout(model)
        previous = self._shown[0] if self._shown is not None else None
        if layout != self.column_layout or model is not previous:
            self._cells = {}
        columns = model.columns()
        same_columns = layout == self.column_layout and model is previous and len(self.columns) == len(columns)
        self._shown = (model, rows)
        self.column_layout = layout
        if same_columns and len(rows) == self.row_count and all(n.name in self.rows for n in rows):
            for col in columns:
                self.columns[ColumnKey(col.key)].label = _header(model, col, layout)
            for n in rows:  # an exclusion changed since the row was drawn (sorted by X, say)
                excluded = model.is_excluded(n.name)
                if self._cells.get(n.name, (None,))[0] != excluded:
                    self._mark_row(model, n, excluded, layout)
            position = {n.name: i for i, n in enumerate(rows)}
            self.sort("name", key=lambda cell: position[cell.node])  # refreshes the header too
            # from the top, as after a refill: the cursor row is then scrolled into view
            self.scroll_x = self.scroll_y = self.scroll_target_x = self.scroll_target_y = 0
        else:
            self.clear(columns=True)
            for col in columns:
                self.add_column(_header(model, col, layout), key=col.key, width=layout.widths[col.key])
            for n in rows:
                self.add_row(*self._row(model, n, layout), key=n.name)
        if rows:
            row = self.get_row_index(selected) if selected is not None and selected in self.rows else 0
            # move first, then scroll: move_cursor scrolls to the row the cursor is leaving (the cursor's
            # watcher then scrolls only when the row index changed)
            self.move_cursor(row=row, scroll=False)
            self.move_cursor(row=row, scroll=True)

    def _update_dimensions(self, new_rows: Iterable[RowKey]) -> None:
        """Textual's DataTable measures every cell of each added row (8 measures per row, each asking the
        terminal its size) to size auto-width columns; every column here has a fixed width and every row
        one line, so that measuring changed nothing and took about 1 s per 2,000-node refill. The virtual
        size is still computed from the columns and rows."""
        if not any(c.auto_width for c in self.columns.values()):
            new_rows = ()
        super()._update_dimensions(new_rows)

    def on_resize(self) -> None:
        """Lay the columns out again when the width changes what fits."""
        if self._shown is None:
            return
        model, rows = self._shown
        if self._table_layout(model) != self.column_layout:
            self.show(model, rows, self.current)

    def set_excluded(self, name: str, excluded: bool) -> None:
        """Update the exclusion mark of one row (no-op when the row is filtered out)."""
        if name in self.rows and self._shown is not None and self.column_layout is not None:
            model = self._shown[0]
            self._mark_row(model, model.node(name), excluded, self.column_layout)

    @property
    def current(self) -> str | None:
        """The node under the cursor, or ``None`` for an empty table."""
        if self.row_count == 0:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key
        return str(key.value)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        """Translate the row key into a node name."""
        event.stop()
        # an empty table (a filter matching nothing) highlights no row: row_key is None then
        if event.row_key is not None and event.row_key.value is not None:
            self.post_message(self.NodeHighlighted(str(event.row_key.value)))

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        """A header click asks the screen to sort."""
        event.stop()
        if event.column_key.value is not None:
            self.post_message(self.SortRequested(str(event.column_key.value)))


def _header(model: LayerModel, col: Column, layout: TableLayout | None = None) -> Text:
    """Column ``col``'s header label, with the sort arrow on the sort column.

    The name column says which prefix its names lost (``Node▲ jax2tf_get_…/``), cut to the column.
    """
    label = Text(col.label)
    if col.key == model.sort_key:
        label.append("▼" if model.descending else "▲", style="bold")
    if col.key == "name" and layout is not None and layout.prefix:
        room = layout.widths["name"] - 1 - label.cell_len - 1
        if room >= 4:
            label.append(" " + shorten(layout.prefix, room), style="dim")
    label.justify = "right" if col.numeric or col.key == "excluded" else "left"
    return label


class _NameCell(Text):
    """A name cell that knows its node: :meth:`NodeTable.show` reorders the rows by it."""

    def __init__(self, text: str, node: str, style: str) -> None:
        super().__init__(text, style=style)
        self.node = node


def _mark(excluded: bool) -> Text:
    return Text(EXCLUDED_MARK if excluded else "", style="bold magenta", justify="right")


def _name_cell(n: NodeRecord, excluded: bool, layout: TableLayout) -> Text:
    style = "bold magenta" if excluded else ("" if n.quantized else "dim")
    return _NameCell(layout.name(n.name), n.name, style)


_CELL_STYLE = {
    "local": lambda n: sqnr_style(n.local_sqnr_db),
    "accumulated": lambda n: sqnr_style(n.accumulated_sqnr_db),
    "added": lambda n: added_style(n.added_noise_db),
    "introduced": lambda n: introduced_style(n.introduced_db),
    "kl": lambda n: "dim" if math.isnan(n.kl) else "",
}


def row_cells(
    n: NodeRecord, excluded: bool, layout: TableLayout | None = None, model: LayerModel | None = None
) -> tuple[Text, ...]:
    """The cells of one node row, in the order of ``model``'s columns (:meth:`LayerModel.columns`;
    without a model :data:`~qdebug.tui.model.COLUMNS`, the comparison columns need its baseline)."""
    layout = layout or table_layout((n,), extra=model.extra_cells() if model is not None else ())
    cells = []
    for col in model.columns() if model is not None else COLUMNS:
        if model is not None and col.key in DELTA_FIELDS:
            style = CHANGE_STYLES[model.judgement(col.key, n)]
            cells.append(Text(model.cell_text(col.key, n), style=style, justify="right"))
        elif col.key == "name":
            cells.append(_name_cell(n, excluded, layout))
        elif col.key == "op":
            cells.append(Text(layout.op(n.op_type), style="cyan"))
        elif col.key == "excluded":
            cells.append(_mark(excluded))
        elif model is not None and col.key in PROFILE_KEYS:  # red where INT8 loses time, green where it saves
            lost = model.latency("lost_ms", n) if col.key == "lost_ms" else math.nan
            style = "red" if lost > 0 else "green" if lost < 0 else ""
            cells.append(Text(model.cell_text(col.key, n), style=style, justify="right"))
        else:
            cells.append(Text(CELL_TEXT[col.key](n), style=_CELL_STYLE[col.key](n), justify="right"))
    return tuple(cells)


# --------------------------------------------------------------------------- depth overview


class DepthChart(Widget):
    """Worst accumulated SQNR along topological depth, with a caret under the selected node's depth.

    Draws a title line, as many chart rows as the height allows, and the caret line.
    """

    selected_depth: reactive[int] = reactive(-1)

    def __init__(self, profile: list[float], **kwargs) -> None:
        super().__init__(**kwargs)
        self.profile = profile

    def render(self) -> Text:
        """Title line, the chart, and the caret line."""
        width = max(self.size.width, 1)
        t = Text()
        n = len(self.profile)
        if n == 0:
            return Text("no nodes", style="dim")
        lo, hi = min(self.profile), max(self.profile)
        t.append("accumulated SQNR by depth ", style="bold")
        t.append(f"{fmt_db(hi)} → {fmt_db(lo)} dB", style="dim")
        d = self.selected_depth
        if 0 <= d < n:
            t.append(f"  ^ depth {d}: {fmt_db(self.profile[d])} dB", style="bold magenta")
        t.append("\n")
        chart_width = min(width, n * max(1, width // n))
        rows = max(1, self.size.height - 2)
        for row in charts.sparkline(self.profile, chart_width, rows):
            t.append(row, style="cyan")
            t.append("\n")
        if 0 <= d < n:
            t.append(charts.caret(d, n, chart_width), style="bold magenta")
        return t


# --------------------------------------------------------------------------- detail


class NodeList(OptionList):
    """A list of nodes (option ids are node names); Enter or a click picks one."""

    def show(self, entries: list[tuple[str, Text]], empty: str) -> None:
        """Replace the options by ``(node, text)`` entries, or one disabled ``empty`` line."""
        highlighted = self.highlighted
        self.clear_options()
        if entries:
            self.add_options([Option(text, id=node) for node, text in entries])
            self.highlighted = min(highlighted or 0, len(entries) - 1)
        else:
            self.add_option(Option(Text(empty, style="dim"), disabled=True))

    @property
    def highlighted_node(self) -> str | None:
        """The node under the list's cursor."""
        option = self.highlighted_option
        return option.id if option is not None else None


class NodeDetail(Widget):
    """Text description of one node: metrics, tensors with histograms, quantization."""

    node: reactive[str | None] = reactive(None, layout=True)

    def __init__(self, model: LayerModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model
        self._text: tuple[tuple[str, int, bool], Text] | None = None
        """The last text and what it was built for: Textual renders an auto-height widget several times
        per change (its height, then its lines), each had rebuilt the text and its histograms."""

    def render(self) -> Text:
        """Everything about the node, laid out for the widget's width."""
        if self.node is None or not self.model.has_node(self.node):
            return Text("no node selected (the filter matches nothing?)", style="dim")
        width = max(self.size.width, 20)
        key = (self.node, width, self.model.is_excluded(self.node))  # the rest of the text never changes
        if self._text is None or self._text[0] != key:
            self._text = (key, node_detail_text(self.model, self.model.node(self.node), width))
        return self._text[1].copy()


def _stats_line(t: Text, label: str, s: ErrorStats | None) -> None:
    t.append(f" {label:<5} ", style="dim")
    if s is None:
        t.append("—\n", style="dim")
        return
    t.append(f"SQNR {fmt_db(s.sqnr_db)} dB", style=sqnr_style(s.sqnr_db))
    t.append(f"  cos {fmt_num(s.cosine)}\n")
    t.append(f"       mse {fmt_num(s.mse)}  max|Δ| {fmt_num(s.max_abs)}", style="dim")
    if s.nonfinite:
        t.append(f"  {s.nonfinite} non-finite skipped", style="yellow")
    t.append("\n")


def quant_label(report: Report) -> str:
    """What the quantized model is called in the header: INT16 for 16-bit activations, else INT8."""
    return "INT16" if "16" in report.config.activation_type else "INT8"


def _tensor_block(t: Text, tensor: TensorRecord, width: int) -> None:
    t.append("output ", style="bold")
    t.append(tensor.name + "\n", style="bold cyan")
    if tensor.summary is not None:
        s = tensor.summary
        t.append(" range ", style="dim")
        span = f"[{fmt_num(s.min)}, {fmt_num(s.max)}]"
        moments = f"μ {fmt_num(s.mean)}  σ {fmt_num(s.std)}"
        sep = "  " if 7 + len(span) + 2 + len(moments) <= width else "\n       "
        t.append(f"{span}{sep}{moments}\n")
    if tensor.quant is not None:
        q = tensor.quant
        t.append(" quant ", style="dim")
        axis = f"  axis {q.axis} ({q.channels} ch)" if q.axis is not None else ""
        t.append(f"scale {fmt_num(q.scale)}  zp {q.zero_point}  {q.qtype}{axis}\n")
    else:
        t.append(" quant ", style="dim")
        t.append("not quantized\n", style="dim")
    _stats_line(t, "local", tensor.local)
    _stats_line(t, "accum", tensor.accumulated)
    fq = tensor.accumulated_fakequant
    if fq is not None:
        t.append("       fake-quant ", style="dim")
        t.append(f"SQNR {fmt_db(fq.sqnr_db)} dB\n", style=sqnr_style(fq.sqnr_db))
        acc = tensor.accumulated.sqnr_db if tensor.accumulated is not None else math.nan
        gap = fq.sqnr_db - acc
        if math.isfinite(gap) and gap > KERNEL_GAP_DB:
            # the deployed integer kernels, not the Q/DQ parameters, lose the accuracy here
            t.append(f"       integer kernels lose {gap:.1f} dB\n", style="yellow")
    kl_line(t, tensor)
    h = tensor.histogram
    if h is not None and h.ref_counts:
        bar_w = max(8, width - 7)
        ref, cand = charts.histogram(h.ref_counts, h.cand_counts, bar_w, height=2)
        for i, row in enumerate(ref):
            t.append(" FP32 " if i == len(ref) - 1 else "      ", style="dim")
            t.append(row + "\n", style="green")
        for i, row in enumerate(cand):
            label = (tensor.quant.qtype.upper() if tensor.quant is not None else "QUANT")[:5]
            t.append(f" {label:<5}" if i == len(cand) - 1 else "      ", style="dim")
            t.append(row + "\n", style="magenta")
        finite = [e for e in h.edges if math.isfinite(e)]  # the outer edges may be ±inf (overflow bins)
        lo, hi = (fmt_num(finite[0]), fmt_num(finite[-1])) if finite else ("", "")
        span = len(ref[0]) if ref else bar_w
        gap = max(1, span - len(lo) - len(hi))
        t.append("      " + lo + " " * gap + hi + "\n", style="dim")
    if tensor.note:
        t.append(f" note: {tensor.note}\n", style="italic dim")


def kl_line(t: Text, tensor: TensorRecord) -> None:
    """The tensor's two KLs, each named: ``KL local 0 · accum 1.41 nats`` (36 cells at most: one line of
    the 41-column detail panel).

    It showed the local KL unnamed under the node's ``KL 1.411``, which is the accumulated one: two
    different numbers read as one that disagreed with itself.
    """
    parts = [
        f"{label} {fmt_small(s.kl)}"
        for label, s in (("local", tensor.local), ("accum", tensor.accumulated))
        if s is not None and not math.isnan(s.kl)
    ]
    if parts:
        t.append(" KL ", style="dim")
        t.append(" · ".join(parts) + " nats\n")


_VERDICT_STYLES = {"worse": "bold red", "better": "bold green", "same": "dim", "unscored": "dim"}


def _baseline_block(t: Text, model: LayerModel, n: NodeRecord) -> None:
    """The node in the baseline: its verdict, then each number as ``baseline → this (Δ)``."""
    assert model.baseline is not None
    c = model.change(n.name)
    t.append(f"vs {model.baseline.label}: ", style="dim")
    if c is None:
        t.append("no counterpart there (added, or changed beyond recognition)\n", style="dim")
        return
    t.append(c.verdict + "\n", style=_VERDICT_STYLES.get(c.verdict, ""))
    rows = (
        ("added noise", c.added_noise_a_db, c.added_noise_b_db, "added_noise_delta_db", True),
        ("accum SQNR ", c.accumulated_sqnr_a_db, c.accumulated_sqnr_b_db, "accumulated_sqnr_delta_db", False),
        ("local SQNR ", c.local_sqnr_a_db, c.local_sqnr_b_db, "local_sqnr_delta_db", False),
    )
    for label, a, b, field, up_is_worse in rows:  # ~0, dim, between two negligible values (not +inf, red)
        t.append(f" {label} ", style="dim")
        t.append(f"{fmt_db(a)} → {fmt_db(b)} dB ")
        t.append(f"({change_text(c, field)})\n", style=CHANGE_STYLES[judge(change_value(c, field), up_is_worse)])
    t.append(" KL ", style="dim")
    t.append(f"{fmt_num(c.kl_a)} → {fmt_num(c.kl_b)}\n")
    if c.name_a != c.name_b:
        t.append(f" there: {c.name_a} (paired by {c.paired_by})\n", style="dim")


def _latency_block(t: Text, nl: NodeLatency | None) -> None:
    """A profiled node's time per run in FP32 and INT8 (its Q/DQ kernels apart) and, where INT8 loses time
    there, the cause with what to do about it (``analyze --profile``)."""
    if nl is None:
        return
    t.append("time/run   ", style="dim")
    t.append(f"FP32 {nl.fp32_ms:.3f} ms · INT8 {nl.int8_ms + nl.qdq_ms:.3f} ms (Q/DQ {nl.qdq_ms:.3f}) · ")
    t.append(f"{nl.int8_kernel}{'' if nl.integer else ' (float)'}\n", style="cyan" if nl.integer else "yellow")
    if nl.cause:
        t.append(f"INT8 loses {-nl.saved_ms:.3f} ms here: {nl.cause}", style="bold red")
        t.append(f" -- {CAUSES.get(nl.cause, '')}\n", style="red")


def node_detail_text(model: LayerModel, n: NodeRecord, width: int) -> Text:
    """The detail text of node ``n`` for a panel ``width`` cells wide."""
    t = Text(no_wrap=False, overflow="fold")
    t.append(n.name + "\n", style="bold")
    t.append(n.op_type, style="cyan")
    t.append(f" · depth {n.depth} · ")
    t.append("quantized" if n.quantized else "not quantized", style="" if n.quantized else "dim")
    if n.original_name and n.original_name != n.name:
        t.append(f" · was {n.original_name}", style="dim")
    if model.is_excluded(n.name):
        t.append(" · EXCLUDED", style="bold magenta")
    t.append("\n")
    t.append("added noise ", style="dim")
    t.append(f"{fmt_db(n.added_noise_db)} dB\n", style=added_style(n.added_noise_db) or "bold")
    t.append("introduced  ", style="dim")
    t.append(f"{fmt_db(n.introduced_db)} dB", style=introduced_style(n.introduced_db) or "bold")
    t.append("  KL accum ", style="dim")  # the node's is its outputs' largest accumulated KL (kl_line)
    t.append(fmt_small(n.kl) + "\n")  # as the table's KL column writes it
    t.append("SQNR local ", style="dim")
    t.append(f"{fmt_db(n.local_sqnr_db)} dB", style=sqnr_style(n.local_sqnr_db))
    t.append(" · accum ", style="dim")
    t.append(f"{fmt_db(n.accumulated_sqnr_db)} dB\n", style=sqnr_style(n.accumulated_sqnr_db))
    _latency_block(t, model.node_latency(n.name))
    if model.baseline is not None:
        _baseline_block(t, model, n)
    r = model.proposal_reason(n.name)
    if r is not None:
        t.append(f"proposal ({r.action}): {r.reason}\n", style="magenta")
    t.append("\n")
    for out in n.outputs:
        tensor = model.tensor(out)
        if tensor is None:
            t.append("output ", style="bold")
            t.append(f"{out}: no numbers\n", style="dim")
        else:
            _tensor_block(t, tensor, width)
    t.append("inputs\n", style="bold")
    for inp in n.inputs:
        if not inp:
            continue
        t.append(f" {inp}\n", style="")
        t.append("   ")
        tensor = model.tensor(inp)
        weight = model.weight(inp)
        if tensor is not None and tensor.accumulated is not None:
            s = tensor.accumulated.sqnr_db
            t.append(f"accum {fmt_db(s)} dB", style=sqnr_style(s))
            if tensor.local is not None:
                t.append(f"  local {fmt_db(tensor.local.sqnr_db)} dB", style="dim")
        elif weight is not None:
            s = weight.error.sqnr_db
            per = f" per-axis {weight.quant.axis}" if weight.quant.axis is not None else ""
            t.append(f"weight {fmt_db(s)} dB {weight.quant.qtype}{per}", style=sqnr_style(s))
        elif model.producer(inp) is not None or inp in model.report.model.inputs:
            t.append("no numbers", style="dim")
        else:
            t.append("weight/constant, no numbers", style="dim")
        t.append("\n")
    return t


class DetailPanel(VerticalScroll):
    """The selected node's detail and its neighbours (Enter on a neighbour jumps to it)."""

    @dataclass
    class JumpRequested(Message):
        """The user picked neighbour ``node``."""

        node: str

    def __init__(self, model: LayerModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model

    def compose(self) -> ComposeResult:
        """Detail text, then the neighbour list."""
        yield NodeDetail(self.model, id="node-detail")
        yield Label(Text("neighbours  ([ / ] worst, enter jumps)"), classes="section")
        yield NodeList(id="neighbours", compact=True)

    def show_node(self, name: str | None) -> None:
        """Describe node ``name`` (``None``: nothing selected)."""
        self.query_one(NodeDetail).node = name
        self.query_one(NodeDetail).refresh(layout=True)
        entries = []
        if name is not None:
            for arrow, nodes in (("←", self.model.predecessors(name)), ("→", self.model.successors(name))):
                for n in nodes:
                    t = Text(f"{arrow} ")
                    t.append(n.name)
                    t.append(f" {n.op_type} ", style="cyan")
                    t.append(f"{fmt_db(n.accumulated_sqnr_db)} dB", style=sqnr_style(n.accumulated_sqnr_db))
                    entries.append((n.name, t))
        self.query_one("#neighbours", NodeList).show(entries, "(no neighbours)")

    @on(OptionList.OptionSelected, "#neighbours")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(self.JumpRequested(event.option.id))


# --------------------------------------------------------------------------- exclusions


class ExclusionPanel(Vertical):
    """The exclusion set, its size and share, and each node's reason (Enter jumps to a node)."""

    @dataclass
    class JumpRequested(Message):
        """The user picked excluded node ``node``."""

        node: str

    def __init__(self, model: LayerModel, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = model

    def compose(self) -> ComposeResult:
        """Title, proposal line, list."""
        yield Static(id="exclusion-title")
        yield NodeList(id="exclusions", compact=True)

    def on_mount(self) -> None:
        """Fill from the model."""
        self.refresh_set()

    def refresh_set(self) -> None:
        """Redraw from the model's current exclusion set."""
        m = self.model
        names = m.excluded
        t = Text()
        counted = sum(1 for n in names if m.node(n).quantized)  # the share's numerator
        t.append(f"Excluded {counted}", style="bold magenta" if names else "bold")
        t.append(f"/{m.quantizable} quantizable ({100 * m.excluded_share():.1f}%)")
        if len(names) > counted:  # kept FP32 anyway: excluding them changes nothing
            t.append(f" + {len(names) - counted} not quantized", style="dim")
        p = m.proposal
        if p is not None:
            t.append("\nproposal" if p.source == "propose" else f"\nproposal ({p.source})", style="dim")
            if p.metric:
                t.append(f": {p.metric} {fmt_metric(p.metric, p.static_metric)}", style="dim")
                if not math.isnan(p.expected_metric):
                    t.append(f" → {fmt_metric(p.metric, p.expected_metric)}", style="dim")
            if p.frontier:
                t.append("\n" + frontier_line(p.frontier), style="dim")
        self.query_one("#exclusion-title", Static).update(t)
        entries = []
        for name in names:
            r = m.reason(name)
            line = Text(f"{EXCLUDED_MARK} ", style="bold magenta")
            line.append(name, style="bold")
            line.append(f" {r.op_type}", style="cyan")
            finding = m.finding_of(name)
            if finding is not None and r.reason.startswith(FINDING_REASON):
                gist = f"finding {finding + 1} · added noise {fmt_db(m.node(name).added_noise_db)} dB"
            elif r.reason.startswith(HAND_REASON):
                gist = f"by hand · added noise {fmt_db(m.node(name).added_noise_db)} dB"
            else:
                gist = r.reason.split("; ")[0].split(" (")[0]  # the whole reason is in the detail panel
            line.append("\n  " + gist, style="dim")
            entries.append((name, line))
        self.query_one("#exclusions", NodeList).show(entries, "none: x / space excludes the selected node")

    @on(OptionList.OptionSelected, "#exclusions")
    def _picked(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        if event.option.id is not None:
            self.post_message(self.JumpRequested(event.option.id))


# --------------------------------------------------------------------------- findings


# --------------------------------------------------------------------------- verify


class VerifyPanel(Vertical):
    """Progress of a running verify (escape cancels) and the last result."""

    def compose(self) -> ComposeResult:
        """Status line, progress bar, result text."""
        yield Static("verify", id="verify-status")
        yield ProgressBar(total=1.0, show_eta=False, id="verify-progress")
        yield Static(id="verify-result")

    def start(self) -> None:
        """Show the panel with an empty bar."""
        self.display = True
        self.query_one("#verify-status", Static).update(
            Text("verify: starting…  (esc cancels)", style="bold")
        )
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=1.0, progress=0.0)
        self.query_one("#verify-result", Static).update("")

    def progress(self, fraction: float, text: str) -> None:
        """Move the bar to ``fraction`` (0..1) and show ``text``."""
        # NaN passes min/max unchanged and sent the bar into a RecursionError
        fraction = min(max(fraction, 0.0), 1.0) if math.isfinite(fraction) else 0.0
        self.query_one(ProgressBar).update(progress=fraction)
        self.query_one("#verify-status", Static).update(Text(f"verify: {text}  (esc cancels)", style="bold"))

    def finish(self, status: str, lines: list[str], style: str = "") -> None:
        """Show the outcome (``status``) and the result lines; hide the bar."""
        self.query_one(ProgressBar).display = False
        self.query_one("#verify-status", Static).update(Text(f"verify: {status}", style=style or "bold"))
        self.query_one("#verify-result", Static).update(Text("\n".join(lines)))


# --------------------------------------------------------------------------- bench screen


