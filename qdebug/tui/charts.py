"""Unicode block charts as plain strings (no Textual): sparklines, histograms, a scatter plot.

Kept apart from the widgets so the arithmetic (bucketing, scaling, where the
caret goes) is unit-tested on strings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BLOCKS = " ▁▂▃▄▅▆▇█"
"""Nine fill levels of one character cell, empty to full."""


def buckets(n: int, width: int) -> list[range]:
    """Split ``n`` values over ``width`` columns: the index range each column shows.

    With more values than columns a column covers several values; with fewer,
    a value is repeated over several columns. Every value lands in at least
    one column.
    """
    if n <= 0 or width <= 0:
        return []
    out = []
    for c in range(width):
        start = c * n // width
        end = max(start + 1, (c + 1) * n // width)
        out.append(range(start, end))
    return out


def column_of(index: int, n: int, width: int) -> int:
    """The first column that shows value ``index`` (see :func:`buckets`); -1 if out of range."""
    for c, r in enumerate(buckets(n, width)):
        if index in r:
            return c
    return -1


def _levels(fracs: Sequence[float], height: int, keep_nonzero: Sequence[bool] | None = None) -> list[str]:
    """Rows (top first) drawing each fraction in ``[0, 1]`` as a column ``height`` cells tall."""
    steps = height * 8
    rows = [[" "] * len(fracs) for _ in range(height)]
    for c, f in enumerate(fracs):
        level = round(min(max(f, 0.0), 1.0) * steps)
        if level == 0 and keep_nonzero is not None and keep_nonzero[c]:
            level = 1
        for r in range(height):  # r = 0 is the bottom row
            fill = min(max(level - 8 * r, 0), 8)
            rows[height - 1 - r][c] = BLOCKS[fill]
    return ["".join(r) for r in rows]


def sparkline(
    values: Sequence[float],
    width: int,
    height: int = 1,
    reduce: Callable[[Sequence[float]], float] = min,
) -> list[str]:
    """Draw finite ``values`` as a block chart ``width`` columns wide (rows top first).

    Columns covering several values show ``reduce`` of them (default: the
    worst, i.e. the minimum SQNR). The chart spans the values' own min..max,
    with the minimum drawn as the lowest visible block.
    """
    cols = [reduce([values[i] for i in r]) for r in buckets(len(values), width)]
    if not cols:
        return [""] * height
    lo, hi = min(cols), max(cols)
    span = hi - lo
    fracs = [1.0 if span == 0 else (v - lo) / span for v in cols]
    steps = height * 8
    fracs = [(1 + f * (steps - 1)) / steps for f in fracs]  # never empty: the bottom shows the minimum
    return _levels(fracs, height)


def histogram(
    ref: Sequence[int], cand: Sequence[int], width: int, height: int = 1
) -> tuple[list[str], list[str]]:
    """Two block charts of the same bins, on one shared scale so the shapes compare.

    Bins are summed into ``width`` columns (at most one column per bin); any
    non-empty column shows at least the lowest block, so outliers in the
    outer bins stay visible.
    """
    n = min(len(ref), len(cand))
    width = min(width, n)
    cols = buckets(n, width)
    r = [sum(ref[i] for i in b) for b in cols]
    c = [sum(cand[i] for i in b) for b in cols]
    top = max([*r, *c, 0])
    if top <= 0:
        return [" " * width] * height, [" " * width] * height
    return (
        _levels([v / top for v in r], height, [v > 0 for v in r]),
        _levels([v / top for v in c], height, [v > 0 for v in c]),
    )


def caret(index: int, n: int, width: int) -> str:
    """A line with ``^`` under the column that shows value ``index`` of ``n``."""
    col = column_of(index, n, width)
    if col < 0:
        return ""
    return " " * col + "^"


# --------------------------------------------------------------------------- scatter (bench chart)

SEVERAL = "*"
"""The mark of a cell two or more points fall into."""


@dataclass(frozen=True)
class Point:
    """One point of :func:`scatter`: ``mark`` (one cell) at ``(x, y)``, ``label`` written next to it."""

    x: float
    y: float
    """``+inf`` is drawn on the top edge, ``-inf`` on the bottom one; ``nan`` is not drawn."""
    mark: str
    label: str = ""


@dataclass(frozen=True)
class Scatter:
    """A text scatter plot: its lines and where each point's mark and label landed."""

    lines: list[str]
    spans: list[tuple[int, int, int, int]]
    """``(line, start, end, point index)`` of every drawn mark and label, for colouring."""
    x_range: tuple[float, float]
    y_range: tuple[float, float]


def nice_step(span: float, steps: int = 2) -> float:
    """A round step (1, 2, 2.5 or 5 x 10^k) that covers ``span`` in at most about ``steps`` steps."""
    raw = span / max(steps, 1)
    if not math.isfinite(raw) or raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))


def scatter_range(
    values: Sequence[float], cap: float | None = None, zero: float = 0.0
) -> tuple[float, float]:
    """A round axis range around the finite ``values`` (never empty).

    It starts at 0 when the smallest value is at most ``zero`` times the
    largest (latencies: 0.4, so ratios read true when the spread is large),
    else just below the smallest (close values stay apart). ``cap`` limits the
    top (100 for percentages) when no value exceeds it.
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if lo >= 0 and lo <= zero * hi:
        lo = 0.0
    margin = (hi - lo) * 0.1 or (abs(hi) * 0.05 if hi else 1.0)
    step = nice_step(hi - lo + 2 * margin, 4)
    top = math.ceil((hi + margin) / step - 1e-9) * step
    bottom = 0.0 if lo == 0.0 else math.floor((lo - margin) / step + 1e-9) * step
    if lo >= 0 > bottom:
        bottom = 0.0
    if cap is not None and top > cap >= hi:
        top = cap
    return round(bottom, 12), round(top, 12)


def scatter(
    points: Sequence[Point],
    width: int,
    height: int,
    fmt_x: Callable[[float], str] = lambda v: f"{v:.3g}",
    fmt_y: Callable[[float], str] = lambda v: f"{v:.4g}",
    y_cap: float | None = None,
    x_zero: float = 0.4,
) -> Scatter:
    """Draw ``points`` in ``width`` x ``height`` cells: y and x axes with 3 labels each.

    ``height`` counts the plot rows only; the x axis and its labels add two
    lines. Both axes span their values with a margin, rounded
    (:func:`scatter_range`): x starts at 0 when the smallest x is at most
    ``x_zero`` times the largest, y is capped at ``y_cap`` (100 for
    percentages). Points sharing a cell are drawn as
    :data:`SEVERAL`. Each label goes right of its mark where the cells are
    free, else left of it, else nowhere (a legend has to name the marks).
    """
    drawn = [(i, p) for i, p in enumerate(points) if math.isfinite(p.x) and not math.isnan(p.y)]
    x_lo, x_hi = scatter_range([p.x for _, p in drawn], zero=x_zero)
    y_lo, y_hi = scatter_range([p.y for _, p in drawn], cap=y_cap)
    height = max(height, 2)
    y_labels = {0: fmt_y(y_hi), (height - 1) // 2: fmt_y((y_lo + y_hi) / 2), height - 1: fmt_y(y_lo)}
    margin = max(len(s) for s in y_labels.values())
    w = max(width - margin - 2, 8)
    grid = [[" "] * w for _ in range(height)]
    owner: dict[tuple[int, int], int] = {}
    for i, p in drawn:
        col = round(min(max((p.x - x_lo) / (x_hi - x_lo), 0.0), 1.0) * (w - 1))
        if math.isinf(p.y):
            row = 0 if p.y > 0 else height - 1
        else:
            row = round((y_hi - p.y) / (y_hi - y_lo) * (height - 1))
            row = min(max(row, 0), height - 1)
        if (row, col) in owner:
            grid[row][col] = SEVERAL
            owner[(row, col)] = -1
        else:
            grid[row][col] = p.mark[:1] or "●"
            owner[(row, col)] = i
    spans: list[tuple[int, int, int, int]] = []
    for (row, col), i in owner.items():
        if i < 0:
            continue
        spans.append((row, margin + 2 + col, margin + 3 + col, i))
    for (row, col), i in sorted(owner.items(), key=lambda kv: kv[1]):
        label = points[i].label if i >= 0 else ""
        n = len(label)
        for start in (col + 2, col - 1 - n):  # one blank cell between the mark and its label
            if not label or start < 0 or start + n > w:
                continue
            around = range(max(start - 1, 0), min(start + n + 1, w))  # and one after it
            if all(grid[row][j] == " " for j in around if j != col):
                grid[row][start : start + n] = list(label)
                spans.append((row, margin + 2 + start, margin + 2 + start + n, i))
                break
    lines = []
    for r in range(height):
        if r in y_labels:
            lines.append(f"{y_labels[r]:>{margin}} ┤" + "".join(grid[r]))
        else:
            lines.append(" " * margin + " │" + "".join(grid[r]))
    ticks = {0: fmt_x(x_lo), (w - 1) // 2: fmt_x((x_lo + x_hi) / 2), w - 1: fmt_x(x_hi)}
    axis = ["─"] * w
    for c in ticks:
        axis[c] = "┬"
    lines.append(" " * margin + " └" + "".join(axis))
    under = [" "] * w
    free = 0  # first column a label may start in
    for c, text in sorted(ticks.items()):
        n = len(text)
        start = 0 if c == 0 else (w - n if c == w - 1 else c - n // 2)
        if start >= free and start + n <= w:
            under[start : start + n] = list(text)
            free = start + n + 1
    lines.append(" " * (margin + 2) + "".join(under).rstrip())
    return Scatter(lines, sorted(spans), (x_lo, x_hi), (y_lo, y_hi))
