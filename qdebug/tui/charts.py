"""Unicode block charts as plain strings (no Textual): sparklines and histograms.

Kept apart from the widgets so the arithmetic (bucketing, scaling, where the
caret goes) is unit-tested on strings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
