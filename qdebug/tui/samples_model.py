"""The samples screen's view model: plain Python over a report's per-sample drill-down (no Textual).

:class:`SamplesModel` orders the flipped samples of :attr:`Report.per_sample` by a column (the screen's
table), and lays out one sample's divergence along depth: per tensor its SQNR for that sample, the noise its
producer adds, its clip rate, and the same tensor's SQNR over the whole capture (the report's) for
comparison, with a bar per tensor. Like :mod:`qdebug.tui.model`, it never imports textual, onnx or
onnxruntime.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from qdebug.output.formatting import fmt_db, shorten
from qdebug.records import Report
from qdebug.records.samples import EFFECT_ORDER, SampleDetail, SampleFlip, SampleSection

BAR_WIDTH = 10
"""Cells of a tensor's SQNR bar (full: the best SQNR of the sample, empty: its worst)."""

NAME_WIDTH = 24
"""Most cells a tensor name takes in either table: longer ones lose their middle to ``…``. Uncut, one
long name pushed the SQNR, added-noise and clip columns off a 120-column screen."""

INPUT_WIDTH = 20
"""Most cells of the input cell (``eval.npz[335]``); a longer one loses its middle, never its row."""

_SLICE = re.compile(r"^(?P<file>.*)\[(?P<start>\d+):\d+\]$")
"""A batch origin ``eval.npz[320:336]`` as :mod:`qdebug.data.dataset` names it: the file and its slice."""


@dataclass(frozen=True)
class SampleColumn:
    """One column of the flipped-samples table."""

    key: str
    label: str
    descending: bool
    """The first sort on this column puts the largest first."""


SAMPLE_COLUMNS = (
    SampleColumn("rank", "rank", False),
    SampleColumn("index", "sample", False),
    SampleColumn("input", "input", False),
    SampleColumn("change", "change", False),
    SampleColumn("sqnr", "out SQNR", False),
    SampleColumn("worst", "diverges most at", False),
    SampleColumn("clip", "max clip", True),
)
"""The table's columns; ``rank`` is the section's own order (worst first)."""


@dataclass(frozen=True)
class SampleRow:
    """One flipped sample as the table shows it."""

    rank: int
    flip: SampleFlip
    cells: tuple[str, ...]
    """One per :data:`SAMPLE_COLUMNS`."""
    worst_added: float
    """The added noise of the tensor it diverges most at (``nan``: not measured)."""
    max_clip: float
    """Its highest clip rate over the tensors (``nan``: not measured)."""


@dataclass(frozen=True)
class DivergenceRow:
    """One tensor of a sample's divergence along depth."""

    tensor: str
    node: str
    depth: int
    sqnr_db: float
    added_noise_db: float
    clip_rate: float
    report_sqnr_db: float
    """The tensor's accumulated SQNR over the whole capture (the report's; ``nan`` when not recorded)."""
    bar: str
    worst: bool
    """Among the sample's three tensors of most added noise."""


class SamplesModel:
    """The flipped samples of one variant (the last in the section: the static model of a report), sorted."""

    def __init__(self, section: SampleSection, report: Report | None = None) -> None:
        self.section = section
        self.variant = section.variants[-1] if section.variants else None
        self.sort_key = "rank"
        self.descending = False
        accumulated = {}
        for t in report.tensors if report is not None else ():
            if t.accumulated is not None:
                accumulated[t.name] = t.accumulated.sqnr_db
        self.report_sqnr = accumulated
        self._rows = [self._row(k, f) for k, f in enumerate(self.variant.flips if self.variant else ())]

    def title(self) -> str:
        """The screen's head line: what flipped, how many, on what data."""
        s = self.section
        if self.variant is None:
            return "no quantized variant in the drill-down"
        return f"{s.count_line(self.variant.name)} ({s.metric}, {s.data} data)"

    def _row(self, rank: int, flip: SampleFlip) -> SampleRow:
        index, where, change, sqnr, worst, clipped = self.section.flip_cells(flip)
        detail = self.section.detail(flip.index)
        worst_added, max_clip = math.nan, math.nan
        if detail is not None:
            top = self.section.worst_tensors(detail, 1)
            worst_added = top[0].added_noise_db if top else math.nan
            worst = top[0].tensor if top else "-"
            rates = [c for c in detail.clip_rate if not math.isnan(c)]
            max_clip = max(rates) if rates else math.nan
        clip = "-" if math.isnan(max_clip) else f"{100 * max_clip:.1f}%"
        worst = shorten(worst, NAME_WIDTH)
        cells = (str(rank + 1), index, input_label(flip), short_change(self.section, flip), sqnr, worst, clip)
        return SampleRow(rank + 1, flip, cells, worst_added, max_clip)

    def rows(self) -> list[SampleRow]:
        """The flipped samples in the current order (unknowns last in either direction)."""
        key = self.sort_key

        def value(r: SampleRow) -> tuple:
            f = r.flip
            if key == "rank":
                v: object = r.rank
            elif key == "index":
                v = f.index
            elif key == "input":
                v = (f.origin, f.row)
            elif key == "change":
                v = (EFFECT_ORDER.get(f.effect, 9), f.effect)
            elif key == "sqnr":
                v = f.output_sqnr_db
            elif key == "worst":
                v = r.worst_added
            else:
                v = r.max_clip
            missing = isinstance(v, float) and math.isnan(v)
            return (missing, v if not missing else 0.0)

        known = sorted((r for r in self._rows if not value(r)[0]), key=value, reverse=self.descending)
        return known + [r for r in self._rows if value(r)[0]]

    def set_sort(self, key: str) -> None:
        """Sort by ``key`` (the current key again: reverse)."""
        if key == self.sort_key:
            self.descending = not self.descending
            return
        self.sort_key = key
        self.descending = next(c.descending for c in SAMPLE_COLUMNS if c.key == key)

    def cycle_sort(self) -> None:
        """Sort by the next column."""
        keys = [c.key for c in SAMPLE_COLUMNS]
        self.set_sort(keys[(keys.index(self.sort_key) + 1) % len(keys)])

    def detail(self, index: int) -> SampleDetail | None:
        """The tensor-by-tensor measurement of sample ``index`` (None: not among the measured ones)."""
        return self.section.detail(index)

    def divergence(self, index: int) -> list[DivergenceRow]:
        """Sample ``index``'s tensors in topological order, each with its bar ([] when not measured)."""
        detail = self.detail(index)
        if detail is None:
            return []
        rows = self.section.divergence(detail)
        finite = [r.sqnr_db for r in rows if math.isfinite(r.sqnr_db)]
        lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
        worst = {r.tensor for r in self.section.worst_tensors(detail, 3)}
        out = []
        for r in rows:
            out.append(
                DivergenceRow(
                    r.tensor,
                    r.node,
                    r.depth,
                    r.sqnr_db,
                    r.added_noise_db,
                    r.clip_rate,
                    self.report_sqnr.get(r.tensor, math.nan),
                    sqnr_bar(r.sqnr_db, lo, hi),
                    r.tensor in worst,
                )
            )
        return out

    def detail_head(self, index: int) -> str:
        """What the detail pane says above the tensors: the flip, and the re-run's own output SQNR."""
        flip = next((r.flip for r in self._rows if r.flip.index == index), None)
        if flip is None:
            return ""
        head = f"#{flip.index}  {flip.where()}  {self.section.change(flip)}"
        detail = self.detail(index)
        if detail is None:
            return head + "\nnot measured tensor by tensor: only the worst flips are (analyze --flip-details N)"
        copies = f" (as {detail.copies} copies: fixed batch)" if detail.copies > 1 else ""
        rerun = f"run again on its own{copies}: output SQNR {fmt_db(detail.output_sqnr_db)} dB"
        clipped = self.section.most_clipped(detail)
        clip = f"; clips most at {clipped.tensor} ({100 * clipped.clip_rate:.1f}%)" if clipped else "; no value clipped"
        return f"{head}\n{rerun}{clip}"


def input_label(flip: SampleFlip, width: int = INPUT_WIDTH) -> str:
    """The table's input cell: the row in the file, ``eval.npz[335]``, when the batch names its slice (its
    start plus the row in the batch); else :meth:`SampleFlip.where`. Cut in the middle to ``width``.

    ``eval.npz[320:336] row 15`` was wider than the column had room for at 80 columns, and the pane's edge cut
    it to ``row 1``: a wrong row that read as a right one.
    """
    m = _SLICE.match(flip.origin.rsplit("/", 1)[-1])
    label = f"{m['file']}[{int(m['start']) + flip.row}]" if m else flip.where()
    return shorten(label, width)


def short_change(section: SampleSection, flip: SampleFlip) -> str:
    """The table's change cell: ``9→4 lost`` (a class), ``lost`` (a hit), ``-0.31`` (a value's drop)."""
    if section.kind == "class":
        return f"{int(flip.fp32)}→{int(flip.result)} {flip.effect}"
    if section.kind == "hit" or section.metric == "output_sqnr_db":
        return flip.effect
    return f"{flip.result - flip.fp32:+.4g}"


def sqnr_bar(sqnr: float, lo: float, hi: float, width: int = BAR_WIDTH) -> str:
    """A tensor's SQNR as a bar between the sample's worst (``lo``: empty) and best (``hi``: full) tensor;
    ``+inf`` (exact) is full, ``nan`` blank."""
    if math.isnan(sqnr):
        return " " * width
    frac = 1.0 if sqnr == math.inf or hi <= lo else max(0.0, min(1.0, (sqnr - lo) / (hi - lo)))
    full = round(frac * width)
    return "█" * full + "░" * (width - full)
