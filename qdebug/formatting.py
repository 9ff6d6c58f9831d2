"""Plain-text formatting of report numbers for tables (CLI and verify/bench summaries).

The TUI has its own variants (``+inf``, no ``-0.0``) tuned for its columns.
"""

from __future__ import annotations

import math

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


def fmt_size(n: int) -> str:
    """Bytes on disk in kB/MB/GB, 3 significant digits (``-`` when unknown: 0 or less)."""
    if n <= 0:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"
