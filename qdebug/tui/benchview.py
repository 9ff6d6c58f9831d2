"""The bench screen's text, as plain Python (no Textual) over a ``bench.json``.

``qdebug tui REPORT --bench bench.json`` loads a :class:`~qdebug.records.bench.BenchReport`
(written by ``qdebug bench -o``); ``b`` shows it: one row per variant, the
machine it was measured on, and task metric vs p50 latency as a text scatter
plot (:func:`~qdebug.tui.charts.scatter`). Everything here only reads the
records' fields; it imports neither Textual nor onnx/onnxruntime (the bench
records live in :mod:`qdebug.records.bench`, standard library only).
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from qdebug.output.formatting import fmt_size, metric_title
from qdebug.records import Report
from qdebug.tui.charts import Point
from qdebug.tui.model import ACCURACY_METRICS, fmt_db, fmt_metric

if TYPE_CHECKING:
    from qdebug.records.bench import BenchReport, VariantResult

MARKS = "123456789abcdefghijklmnopqrstuvwxyz"
"""The chart mark of the n-th variant (also the table's ``#`` column)."""

KIND_STYLES = {
    "fp32": "bold #6f9bd8",
    "dynamic": "bold #e8925a",
    "static": "bold #67b77a",
    "selective": "bold #e06469",
    "qoperator": "bold #a493d6",
}
"""Colour of each variant kind in the table and the chart (the SVG chart's hues, lighter)."""

BENCH_COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "variant"),
    ("metric", "metric"),  # relabelled with the bench's metric name
    ("sqnr", "SQNR"),
    ("p50", "p50 ms"),
    ("p95", "p95 ms"),
    ("throughput", "samples/s"),
    ("rss", "RSS MiB"),
    ("size", "size"),
    ("speedup", "×FP32"),
)
"""(key, header) of the variant table's columns: name (after its chart mark), task metric, worst
output SQNR vs FP32 (dB), latency per batch, throughput, peak RSS, size on disk, speed-up vs FP32
(80 columns wide with the usual variant names)."""


def mark(index: int) -> str:
    """The one-cell mark of the variant at ``index`` (``?`` past 35 variants)."""
    return MARKS[index] if 0 <= index < len(MARKS) else "?"


def kind_style(kind: str) -> str:
    """The style of a variant kind (bold default for unknown kinds)."""
    return KIND_STYLES.get(kind, "bold")


def fmt_ms(x: float) -> str:
    """Milliseconds as ``qdebug bench`` prints them (3 decimals below 10 ms)."""
    if not math.isfinite(x):
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def fmt_rate(x: float) -> str:
    """Samples per second: whole numbers from 100 up, else 3 significant digits."""
    if not math.isfinite(x):
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def fmt_speedup(x: float) -> str:
    """FP32 p50 / this p50 (``-`` when unknown)."""
    return f"{x:.2f}x" if math.isfinite(x) else "-"


def variant_cells(bench: BenchReport, index: int) -> dict[str, str]:
    """The table cells of variant ``index``, keyed like :data:`BENCH_COLUMNS`; a failed variant says so."""
    v = bench.variants[index]
    cells = {key: "" for key, _ in BENCH_COLUMNS}
    cells["name"] = f"{mark(index)} {v.name}"
    cells["size"] = fmt_size(v.model_bytes)
    if v.error or v.full is None:
        cells["metric"] = "failed"
        return cells
    f = v.full
    cells.update(
        metric=fmt_metric(bench.metric, v.metric_value),
        sqnr=fmt_db(v.output_sqnr_db),
        p50=fmt_ms(f.p50_ms),
        p95=fmt_ms(f.p95_ms),
        throughput=fmt_rate(f.throughput),
        rss=f"{v.peak_rss_mb:.0f}" if math.isfinite(v.peak_rss_mb) else "-",
        speedup=fmt_speedup(v.speedup),
    )
    return cells


def title_line(bench: BenchReport) -> str:
    """Model, samples, batch, passes, metric (and proposal) of the run."""
    name = bench.model.rsplit("/", 1)[-1] or "(unnamed model)"
    text = (
        f"bench {name} · {bench.samples} samples in batches of {bench.batch_size} · "
        f"{bench.runs} timed passes, {bench.warmup} warm-up · metric {bench.metric}"
    )
    if bench.proposal:
        text += f" · proposal {Path(bench.proposal).name}"
    return text


def machine_line(bench: BenchReport) -> str:
    """The machine the numbers were measured on, as ``qdebug bench`` prints it."""
    m = bench.machine
    flags = ", ".join(m.int8_flags) or "none"
    provider = m.providers[0] if m.providers else "?"
    return (
        f"machine: {m.cpu_model} ({m.arch}, {m.cpus_available} CPUs available) · INT8 flags: {flags} · "
        f"ORT {m.ort_version} · {provider} · threads {m.threads or 'auto'}"
    )


def note_lines(bench: BenchReport) -> list[str]:
    """The last-batch timings, failed variants' errors, the dynamic model's worst layers, the run's notes."""
    lines: list[str] = []
    tails = [v for v in bench.variants if v.tail is not None]
    if tails:
        size = tails[0].tail.batch_size if tails[0].tail is not None else 0
        lines.append(
            f"last batch ({size} samples, timed separately, not padded): "
            + "  ".join(f"{v.name} p50 {fmt_ms(v.tail.p50_ms)} ms" for v in tails if v.tail is not None)
        )
    for v in bench.variants:
        if v.error:
            lines.append(f"{v.name} failed: {v.error}")
    for v in bench.variants:
        if v.worst_layers:
            worst = ", ".join(
                f"{w.node} (adds {fmt_db(w.added_noise_db)} dB noise, SQNR {fmt_db(w.accumulated_sqnr_db)} dB)"
                for w in v.worst_layers[:3]
            )
            lines.append(f"{v.name}: worst layers by added noise: {worst}")
    lines.extend(bench.notes)
    return lines


def model_mismatch(report: Report, bench: BenchReport) -> bool:
    """True when the bench results were measured on another model than the report's (SHA-256 differs)."""
    return (
        bool(bench.model_sha256) and bool(report.model.sha256) and bench.model_sha256 != report.model.sha256
    )


MISMATCH = "the bench results are for another model (SHA-256 differs from the report's)"


def metric_scale(name: str) -> tuple[float, str]:
    """Multiplier and unit of the chart's y axis: accuracies in percent."""
    return (100.0, "%") if name in ACCURACY_METRICS else (1.0, "")


def chart_points(bench: BenchReport) -> list[Point]:
    """One point per variant that has timings: (p50 ms, task metric), marked like the table."""
    scale, _ = metric_scale(bench.metric)
    points = []
    for i, v in enumerate(bench.variants):
        if v.full is None or v.error:
            continue
        points.append(Point(v.full.p50_ms, v.metric_value * scale, mark(i), v.name))
    return points


def chart_variants(bench: BenchReport) -> list[VariantResult]:
    """The variants :func:`chart_points` draws, in the same order."""
    return [v for v in bench.variants if v.full is not None and not v.error]


def chart_caption(bench: BenchReport) -> str:
    """The chart's title: what the axes are and which way is better."""
    _, unit = metric_scale(bench.metric)
    metric = f"{metric_title(bench.metric)} ({unit})" if unit else bench.metric
    return f"{metric} vs p50 ms per batch of {bench.batch_size}: up is more accurate, left is faster"


def chart_footnotes(bench: BenchReport) -> list[str]:
    """What the chart cannot show: non-finite metrics, variants without timings."""
    notes = []
    for v in bench.variants:
        if v.full is None or v.error:
            notes.append(f"{v.name}: no timings, not drawn")
        elif math.isinf(v.metric_value):
            edge = "top" if v.metric_value > 0 else "bottom"
            notes.append(f"{v.name}: metric {fmt_db(v.metric_value)}, drawn on the {edge} edge")
        elif math.isnan(v.metric_value):
            notes.append(f"{v.name}: no metric, not drawn")
    return notes


def bench_hint(report: Report, report_path: str | None = None) -> str:
    """How to make a bench file for ``report``'s model and open it here (the report's paths filled in)."""
    q = shlex.quote
    model = q(report.model.path) if report.model.path else "MODEL.onnx"
    calib = q(report.config.calib) if report.config.calib else "CALIB"
    evald = q(report.config.eval) if report.config.eval else "EVAL"
    tui = q(report_path) if report_path else "REPORT"
    return (
        f"no bench results loaded: run `qdebug bench {model} --calib {calib} --eval {evald} -o bench.json`, "
        f"then `qdebug tui {tui} --bench bench.json`"
    )
