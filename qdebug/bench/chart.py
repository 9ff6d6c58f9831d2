"""The ``--chart`` SVG: task metric vs p50 latency per batch, one dot per variant.

A standalone SVG written by hand (no plotting library): it must open in a
browser or a CI artifact viewer without anything installed, and it only
needs dots, whiskers, ticks and a legend. It reads the ``bench.json`` records
only.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

from qdebug.output.formatting import ACCURACY_METRICS, fmt_size
from qdebug.records.bench import BenchReport, VariantResult

_COLORS = {
    "fp32": "#4c72b0",
    "dynamic": "#dd8452",
    "static": "#55a868",
    "selective": "#c44e52",
    "qoperator": "#8172b3",
}
"""Dot colour of each variant kind (the same kind has the same colour in every chart)."""


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values from at or below ``lo`` to at or above ``hi`` (steps of 1, 2, 2.5 or 5 x 10^k)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def _fmt_tick(x: float) -> str:
    """A tick label: at most 6 significant digits, no trailing zeros."""
    return f"{x:.6g}"


def _metric_scale(name: str) -> tuple[float, str]:
    """(factor, axis label) of a metric: accuracies in percent, the rest as they are."""
    if name in ACCURACY_METRICS:
        return 100.0, f"{name} (%)"
    if name == "output_sqnr_db":
        return 1.0, "output SQNR vs FP32 (dB)"
    return 1.0, name


def chart_svg(report: BenchReport, width: int = 760, height: int = 460) -> str:
    """Accuracy (task metric) vs p50 latency per batch, one dot per variant, as a standalone SVG.

    A whisker runs from p50 to p95. A non-finite metric (FP32's output SQNR is
    ``+inf``) is drawn on the top edge and labelled with the symbol.
    """
    scale, ylabel = _metric_scale(report.metric)
    pts = [v for v in report.variants if v.full is not None]
    left, right, top, bottom = 70, 250, 58, 62
    xticks = _x_ticks(pts)
    yticks, y_min, y_max = _y_ticks(pts, scale)
    x_max = xticks[-1] if xticks else 1.0
    plot = _Plot(left, top, width - left - right, height - top - bottom, x_max, y_min, y_max)
    out = _header(report, ylabel, width, height, plot)
    out.extend(_grid(plot, xticks, yticks, ylabel))
    out.extend(_marks(pts, plot, scale))
    machine = report.machine
    if machine.warning:
        out.append(
            f'<text x="{left}" y="{height - 6}" fill="#b00" font-size="11">warning: INT8 speed-ups unlikely '
            f"on this CPU (INT8 flags: {html.escape(', '.join(machine.int8_flags) or 'none')}; no VNNI/AMX)</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class _Plot:
    """The plot area (pixels) and its axis ranges: where a (latency, metric) point lands."""

    left: int
    top: int
    pw: int
    ph: int
    x_max: float
    y_min: float
    y_max: float

    def px(self, x: float) -> float:
        """The x pixel of a latency, clipped to the plot area."""
        return self.left + self.pw * min(1.0, max(0.0, x / self.x_max if self.x_max > 0 else 0.0))

    def py(self, y: float) -> float:
        """The y pixel of a metric value; +inf and nan on the top edge, -inf on the bottom one."""
        top, ph, y_min, y_max = self.top, self.ph, self.y_min, self.y_max
        if not math.isfinite(y):
            return float(top) if y > 0 or math.isnan(y) else float(top + ph)
        return top + ph * (1.0 - (y - y_min) / (y_max - y_min if y_max > y_min else 1.0))


def _x_ticks(pts: list[VariantResult]) -> list[float]:
    """Latency ticks from 0 to the slowest p95, but at most 3x the slowest p50."""
    p50_hi = max((v.full.p50_ms for v in pts if v.full), default=1.0)
    p95_hi = max((v.full.p95_ms for v in pts if v.full), default=1.0)
    # whiskers beyond 3x the slowest p50 (noise spikes) are clipped at the edge, marked with an arrow
    return nice_ticks(0.0, min(p95_hi, 3.0 * p50_hi) * 1.02)


def _y_ticks(pts: list[VariantResult], scale: float) -> tuple[list[float], float, float]:
    """(ticks, axis minimum, axis maximum) of the metric, padded around the finite values."""
    finite = [v.metric_value * scale for v in pts if math.isfinite(v.metric_value)]
    y_lo, y_hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = (y_hi - y_lo) * 0.1 or max(abs(y_hi) * 0.05, 1.0)
    yticks = nice_ticks(y_lo - pad, y_hi + pad)
    if scale == 100.0 and yticks:  # accuracies: stay within 0..100 %
        yticks = [t for t in yticks if 0.0 <= t <= 100.0] or yticks
    y_min, y_max = (yticks[0], yticks[-1]) if yticks else (y_lo - pad, y_hi + pad)
    return yticks, y_min, y_max


def _header(report: BenchReport, ylabel: str, width: int, height: int, plot: _Plot) -> list[str]:
    """The SVG element, the title, the run's machine line and the plot frame."""
    e = html.escape
    machine = report.machine
    provider = machine.providers[0] if machine.providers else ""
    left, top = plot.left, plot.top
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="22" font-size="15" font-weight="bold">'
        f"{e(ylabel)} vs latency per batch of {report.batch_size}</text>",
        f'<text x="{left}" y="40" fill="#555">{e(machine.cpu_model)} · {e(provider)} · threads '
        f"{machine.threads or 'auto'} · ORT {e(machine.ort_version)} · {report.samples} samples</text>",
        f'<rect x="{left}" y="{top}" width="{plot.pw}" height="{plot.ph}" fill="none" stroke="#888"/>',
    ]


def _grid(plot: _Plot, xticks: list[float], yticks: list[float], ylabel: str) -> list[str]:
    """Grid lines, tick labels and the two axis titles."""
    left, top, pw, ph = plot.left, plot.top, plot.pw, plot.ph
    out = []
    for t in xticks:
        x = plot.px(t)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#eee"/>')
        out.append(f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle">{_fmt_tick(t)}</text>')
    for t in yticks:
        y = plot.py(t)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt_tick(t)}</text>')
    out.append(
        f'<text x="{left + pw / 2:.0f}" y="{top + ph + 36}" text-anchor="middle">'
        "ms per batch (dot: p50, whisker to p95, ▸ beyond the axis) — left is faster</text>"
    )
    out.append(
        f'<text x="18" y="{top + ph / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 18 {top + ph / 2:.0f})">{html.escape(ylabel)} — up is better</text>'
    )
    return out


def _marks(pts: list[VariantResult], plot: _Plot, scale: float) -> list[str]:
    """Each variant's whisker, dot and number label in the plot, and its legend entry on the right."""
    e = html.escape
    left, top, pw, ph = plot.left, plot.top, plot.pw, plot.ph
    out = []
    placed: list[tuple[float, float, float, float]] = []
    for i, v in enumerate(pts):
        full = v.full
        assert full is not None
        color = _COLORS.get(v.kind, "#333")
        y = plot.py(v.metric_value * scale)
        x50, x95 = plot.px(full.p50_ms), plot.px(full.p95_ms)
        out.append(
            f'<line x1="{x50:.1f}" y1="{y:.1f}" x2="{x95:.1f}" y2="{y:.1f}" stroke="{color}" '
            'stroke-width="2" stroke-opacity="0.6"/>'
        )
        if full.p95_ms > plot.x_max:
            out.append(f'<text x="{x95 - 8:.1f}" y="{y + 4:.1f}" fill="{color}">▸</text>')
        out.append(
            f'<circle cx="{x50:.1f}" cy="{y:.1f}" r="5" fill="{color}">'
            f"<title>{e(_point_title(v, scale))}</title></circle>"
        )
        lx, ly = _place_label(str(i + 1), x50, y, placed, (left, top, left + pw, top + ph))
        out.append(f'<text x="{lx:.1f}" y="{ly:.1f}" fill="{color}" font-weight="bold">{i + 1}</text>')
        ly = top + 12 + 34 * i
        value = v.metric_value * scale
        metric = "∞" if math.isinf(value) else f"{value:.4g}{'%' if scale == 100.0 else ''}"
        speed = f", ×{v.speedup:.2f} vs FP32" if math.isfinite(v.speedup) else ""
        lx0 = left + pw + 14
        out.append(f'<text x="{lx0}" y="{ly}" fill="{color}" font-weight="bold">{i + 1} {e(v.name)}</text>')
        out.append(
            f'<text x="{lx0 + 12}" y="{ly + 15}" fill="#444" font-size="11">'
            f"{full.p50_ms:.3g} ms{speed} · {metric}</text>"
        )
    return out


def _place_label(
    text: str, x: float, y: float, placed: list[tuple[float, float, float, float]], box: tuple[float, ...]
) -> tuple[float, float]:
    """Put a short label next to a dot where it overlaps no earlier label (greedy, 8 candidate spots)."""
    w, h = 7.5 * len(text) + 2, 13.0
    candidates = [
        (8, -6),
        (8, 14),
        (-8 - w, -6),
        (-8 - w, 14),
        (-w / 2, -10),
        (-w / 2, 22),
        (8, -20),
        (8, 28),
    ]
    best = None
    for dx, dy in candidates:
        lx, ly = x + dx, y + dy
        rect = (lx, ly - h + 3, lx + w, ly + 3)
        inside = rect[0] >= box[0] and rect[1] >= box[1] - 14 and rect[2] <= box[2] and rect[3] <= box[3]
        clear = all(rect[2] <= r[0] or rect[0] >= r[2] or rect[3] <= r[1] or rect[1] >= r[3] for r in placed)
        if clear and inside:
            best = (lx, ly, rect)
            break
        if best is None and clear:
            best = (lx, ly, rect)
    if best is None:
        dx, dy = candidates[len(placed) % len(candidates)]
        best = (x + dx, y + dy, (x + dx, y + dy - h + 3, x + dx + w, y + dy + 3))
    placed.append(best[2])
    return best[0], best[1]


def _point_title(v: VariantResult, scale: float) -> str:
    """The tooltip of a variant's dot: its exact numbers."""
    assert v.full is not None
    return (
        f"{v.name}: p50 {v.full.p50_ms:.3f} ms, p95 {v.full.p95_ms:.3f} ms, "
        f"metric {v.metric_value * scale:.4g}, {fmt_size(v.model_bytes)}"
    )
