"""Plain-text formatting of report numbers and node names for tables (CLI, verify/bench summaries, TUI).

The TUI has its own number variants (``+inf``, no ``-0.0``) tuned for its columns; node names are
shortened the same way everywhere (:func:`table_names`). Standard library only: the light layer
(``--help``, the TUI, the record schemas) imports this module.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterable, Sequence

ACCURACY_METRICS = ("top1", "top1_agreement", "exact_match")
"""Metrics that are shares of samples: shown in percent, their drops in points."""


def fmt_db(x: float) -> str:
    """A dB value: 1 decimal, ``inf``/``-inf`` spelled out, ``-`` for nan (undefined)."""
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.1f}"


def fmt_metric(name: str, x: float) -> str:
    """A task metric value: percent for accuracies, else 4 significant digits."""
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if name in ACCURACY_METRICS:
        return f"{100 * x:.2f}%"
    return f"{x + 0.0:.4g}"  # + 0.0: a metric of -0.0 printed as "-0"


def metric_title(spec: str) -> str:
    """A metric as a person reads it in a line: a user's hook (``path/to/metrics.py:mask_iou``,
    ``pkg.metrics:mask_iou``) by its function's name, a built-in by its own. The full spec stays in the
    files, where it is needed to score again; a 60-character path in every progress line is not."""
    head, sep, tail = spec.rpartition(":")
    return tail if sep and head and tail.isidentifier() else spec


def fmt_size(n: int) -> str:
    """Bytes on disk as :func:`fmt_binary_size` writes them, ``-`` when unknown (0 or less).

    Binary units everywhere: bench had printed kB/MB while verify printed KiB/MiB, so one model's size
    read as two different numbers (23.8 kB against 23.2 KiB).
    """
    return "-" if n <= 0 else fmt_binary_size(n)


def fmt_binary_size(n: int) -> str:
    """A model size in KiB below 1 MiB, else MiB: ``49.0 KiB``, ``1.23 MiB`` (verify's and bench's tables, their
    notes too)."""
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


# --------------------------------------------------------------------------- node names

NAME_SEPARATORS = "/.:"
"""Where a common prefix may end: exported names are paths (``/bert/encoder/layer.5/output``,
``jax2tf_get_logits_/pjit_get_logits_/Dense_0``, ``scope:op``); cutting elsewhere would split a word
(``conv1`` and ``conv10`` share ``conv1`` but not a component)."""

ELLIPSIS = "…"

MIN_NAME_WIDTH = 12
"""Names are never cut shorter than this: below it a shortened name says nothing."""


def cells(text: str) -> int:
    """Terminal cells ``text`` takes: wide (CJK) characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _fit(chars: Iterable[str], budget: int) -> str:
    """The leading characters of ``chars`` that fit in ``budget`` cells."""
    out, used = [], 0
    for ch in chars:
        w = cells(ch)
        if used + w > budget:
            break
        out.append(ch)
        used += w
    return "".join(out)


def _split(text: str, width: int, head: int) -> str:
    """``text`` in ``width`` cells as ``head`` cells of its start, ``…``, and as much of its end as fits."""
    tail = _fit(reversed(text), width - 1 - head)[::-1]
    return _fit(text, width - 1 - cells(tail)) + ELLIPSIS + tail


def shorten(name: str, width: int) -> str:
    """``name`` cut to ``width`` cells by replacing its middle with ``…``.

    The middle, not the end: exported names share their start (the scope) and differ in the last
    components (``Dense_0/einsum/Einsum``), so cutting the end made every row read the same. Cells,
    not characters: a name of wide characters cut by characters overflowed its column.
    """
    if cells(name) <= width:
        return name
    if width <= 1:
        return ELLIPSIS[:width]
    return _split(name, width, (width - 1) // 2)


def fold_name(name: str, width: int, lines: int) -> list[str]:
    """``name`` as at most ``lines`` lines of ``width`` cells, for a table column too narrow for it on one.

    Each line ends just after a separator (or a space, in ``a -> b``) where one falls in its second half,
    so components stay whole (``layer0/attn/`` over ``v_matmul``); a name that would then need more than
    ``lines`` lines is cut at the width instead. Cutting the name to one line instead had dropped what
    told rows apart: ``layer0/attn/v_matmul`` became ``lay…v_matmul``, its layer index gone. A name
    longer than ``lines * width`` cells is the caller's to shorten first (:func:`table_names`).
    """
    width = max(width, 1)

    def folded(breaks: str) -> list[str]:
        out, rest = [], name
        while cells(rest) > width:
            head = _fit(rest, width) or rest[0]
            cut = max((i + 1 for i, ch in enumerate(head) if ch in breaks), default=0)
            cut = cut if cut > len(head) // 2 else len(head)
            out.append(rest[:cut].rstrip(" "))
            rest = rest[cut:].lstrip(" ")
        return [*out, rest]

    at_separators = folded(NAME_SEPARATORS + " ")
    return at_separators if len(at_separators) <= lines else folded("")


def common_prefix(names: Sequence[str], separators: str = NAME_SEPARATORS) -> str:
    """The longest start all ``names`` share that ends just after a separator, or ``""``.

    Only whole components are dropped (``model.conv1`` and ``model.conv10`` share ``model.``), each
    name keeps something after the prefix (a name equal to it is not emptied), and a prefix of
    separators only (the leading ``/`` of ``/conv1/Conv``) is no prefix: dropping it gains nothing.
    """
    if not names:
        return ""
    first, last = min(names), max(names)  # the common prefix of all is that of the extremes
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    shortest = min(len(x) for x in names)
    n = min(n, shortest - 1)  # every name keeps at least one character after the prefix
    while n > 0 and first[n - 1] not in separators:
        n -= 1
    prefix = first[:n]
    return prefix if any(ch not in separators for ch in prefix) else ""


def _first_difference(a: str, b: str) -> int:
    """Index of the first character where ``a`` and ``b`` differ (the shorter length if one starts the other)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _around(name: str, width: int, lo: int, hi: int) -> str:
    """``name`` in ``width`` cells as ``start…middle…end``, the middle showing indices ``lo`` to ``hi``.

    For names that differ deep inside (a head and a tail of ``width`` cells do not tell them apart):
    the middle shows where they differ, as much of it as fits.
    """
    budget = width - 2  # two ellipses
    window = max(1, min(hi - lo + 1, budget - 2))
    side = budget - window
    head = _fit(name, max(1, side // 2))
    lo = max(lo, len(head))
    middle = _fit(name[lo:], budget - cells(head) - 1)[:window]
    tail = _fit(reversed(name[lo + len(middle) :]), budget - cells(head) - cells(middle))[::-1]
    return head + ELLIPSIS + middle + ELLIPSIS + tail


def _collisions(shown: dict[str, str]) -> dict[str, list[str]]:
    """Names that share their shown text with another name, by that text."""
    by_text: dict[str, list[str]] = {}
    for name, text in shown.items():
        by_text.setdefault(text, []).append(name)
    return {text: group for text, group in by_text.items() if len(group) > 1}


def _show_differences(shown: dict[str, str], width: int, rounds: int = 4) -> None:
    """Give colliding names (``shown``: name -> text, updated) a middle showing where they differ.

    Each round, a name still equal to others adds where it differs from them to the span its middle
    must show; names fixed in one round can meet others in the next, hence a few rounds.
    """
    spans: dict[str, set[int]] = {}
    for _ in range(rounds):
        clashes = _collisions(shown)
        if not clashes:
            return
        for group in clashes.values():
            for n in group:
                if cells(n) > width:
                    at = spans.setdefault(n, set())
                    at.update(_first_difference(n, other) for other in group if other != n)
                    shown[n] = _around(n, width, min(at), max(at))


def distinct_shortened(names: Sequence[str], width: int) -> list[str]:
    """:func:`shorten` of each name, made distinct where middle elision made distinct names equal.

    Rows of one table must stay distinguishable. Colliding names first try another split of start and
    end (the same for all of them: more of the end, say), checked against every name shown; those
    still equal then show, between two ``…``, the part where they differ from the names they collide
    with. Distinct whenever ``width`` has room for that part; a few cells cannot hold many names at all.
    """
    shown = {n: shorten(n, width) for n in dict.fromkeys(names)}
    clash = [n for group in _collisions(shown).values() for n in group]
    if clash and width > 2:
        clashing = set(clash)
        others = {text for n, text in shown.items() if n not in clashing}
        default = (width - 1) // 2
        for head in sorted(range(width - 1), key=lambda h: (abs(h - default), h)):
            trial = [n if cells(n) <= width else _split(n, width, head) for n in clash]
            if len(set(trial)) == len(clash) and not others.intersection(trial):
                shown.update(zip(clash, trial, strict=True))
                break
        else:
            _show_differences(shown, width)
    return [shown[n] for n in names]


def table_names(names: Sequence[str], width: int) -> tuple[str, list[str]]:
    """``(prefix, shown)``: the names one table column shows in ``width`` cells, and what they all start with.

    Names that all fit are shown whole (``prefix`` is ``""``). Otherwise the prefix common to the
    table (:func:`common_prefix`) is dropped -- the caller says once what it was
    (:func:`prefix_note`) -- and what still does not fit is cut in the middle, keeping rows distinct.
    """
    width = max(width, 1)
    if all(cells(n) <= width for n in names):
        return "", list(names)
    prefix = common_prefix(names)
    return prefix, distinct_shortened([n[len(prefix) :] for n in names], width)


def prefix_note(prefix: str, full: str = "--wide") -> str:
    """The line a table prints above itself when it dropped ``prefix`` from its names.

    ``full``: where the user finds the full names (a flag, or a file).
    """
    return f"node names below are under {prefix}  (full names: {full})"


def table_overhead(others: Sequence[int]) -> int:
    """Cells a rich table (default box) takes besides its name column's content.

    ``others``: the content widths of the other columns; each column takes 3 more cells (a border and
    two padding cells), plus the closing border.
    """
    return sum(others) + 3 * (len(others) + 1) + 1


def name_column_width(total: int, others: Sequence[int], minimum: int = MIN_NAME_WIDTH) -> int:
    """Cells left for the name column of a rich table ``total`` cells wide.

    Giving the names only what the other columns leave keeps rich from squeezing (and cutting again)
    a name that was already shortened.
    """
    return max(minimum, total - table_overhead(others))
