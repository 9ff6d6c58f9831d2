"""The bench screen's widgets: the variants table and the metric-vs-latency chart (a bench.json view)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text
from textual.widget import Widget
from textual.widgets import DataTable

from qdebug.tui import charts
from qdebug.tui.benchview import (
    BENCH_COLUMNS,
    chart_caption,
    chart_footnotes,
    chart_points,
    chart_variants,
    kind_style,
    metric_scale,
    variant_cells,
)
from qdebug.tui.widgets import sqnr_style

if TYPE_CHECKING:
    from qdebug.records.bench import BenchReport


class BenchTable(DataTable):
    """One row per bench variant (row keys: variant names); each name starts with its chart mark."""

    def __init__(self, bench: BenchReport, **kwargs) -> None:
        super().__init__(cursor_type="none", zebra_stripes=True, **kwargs)
        self.can_focus = False  # nothing to pick: the keys scroll the screen instead
        self.bench = bench

    def on_mount(self) -> None:
        """Fill the table."""
        for key, header in BENCH_COLUMNS:
            label = self.bench.metric if key == "metric" else header
            self.add_column(Text(label, justify="left" if key == "name" else "right"), key=key)
        for i, v in enumerate(self.bench.variants):
            cells = variant_cells(self.bench, i)
            row = []
            for key, _ in BENCH_COLUMNS:
                text = cells[key]
                if key == "name":
                    row.append(Text(text, style=kind_style(v.kind)))
                elif text == "failed":
                    row.append(Text(text, style="bold red", justify="right"))
                elif key == "sqnr":
                    row.append(Text(text, style=sqnr_style(v.output_sqnr_db), justify="right"))
                else:
                    row.append(Text(text, justify="right"))
            self.add_row(*row, key=v.name)


class BenchChart(Widget):
    """Task metric vs p50 latency, one mark per variant (its number in the table), labelled by name."""

    def __init__(self, bench: BenchReport, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bench = bench

    def chart(self, width: int, height: int) -> charts.Scatter:
        """The scatter plot for a ``width`` x ``height`` widget (title, axis and footnotes included)."""
        scale, unit = metric_scale(self.bench.metric)
        rows = max(height - 4 - len(chart_footnotes(self.bench)), 3)
        return charts.scatter(
            chart_points(self.bench),
            width,
            rows,
            fmt_x=lambda v: f"{v:.3g}",
            fmt_y=lambda v: f"{v:.4g}{unit}",
            y_cap=100.0 if scale == 100.0 else None,
        )

    def render(self) -> Text:
        """Caption, plot, x axis, its unit, footnotes."""
        width, height = max(self.content_size.width, 20), max(self.content_size.height, 6)
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(chart_caption(self.bench), style="bold")
        t.append("\n")
        if not chart_points(self.bench):
            t.append("no variant has timings to draw", style="dim")
            for note in chart_footnotes(self.bench):
                t.append("\n" + note, style="dim")
            return t
        plot = self.chart(width, height)
        variants = chart_variants(self.bench)
        by_line: dict[int, list[tuple[int, int, int]]] = {}
        for line, start, end, i in plot.spans:
            by_line.setdefault(line, []).append((start, end, i))
        for n, line in enumerate(plot.lines):
            pos = 0
            for start, end, i in sorted(by_line.get(n, [])):
                t.append(line[pos:start])
                t.append(line[start:end], style=kind_style(variants[i].kind))
                pos = end
            t.append(line[pos:])
            t.append("\n")
        t.append(" " * 2 + "p50 ms per batch", style="dim")
        if any(c == charts.SEVERAL for line in plot.lines for c in line):
            t.append(f" · {charts.SEVERAL}: several variants in one cell", style="dim")
        for note in chart_footnotes(self.bench):
            t.append("\n" + note, style="dim")
        return t
