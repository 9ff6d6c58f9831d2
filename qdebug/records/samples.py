"""The per-sample drill-down of ``report.json`` and ``verify.json``: which evaluation samples flip, and why.

Frozen records like the rest of :mod:`qdebug.records`, standard library only (the TUI and the CLI
printers read them without onnx or numpy). :mod:`qdebug.evaluation.samples` computes them; the section is
``Report.per_sample`` (analyze: the static model) and ``VerifyResult.per_sample`` (verify: static and
selective). It carries its own :attr:`SampleSection.version`: a file written before the section has
``per_sample: null`` and loads unchanged.

What "flips" means depends on what the metric says per sample (:attr:`SampleSection.kind`):

* ``class`` (top1, top1_agreement): the predicted class differs from FP32's. With labels each flip is
  ``lost`` (FP32 right, now wrong), ``gained`` (FP32 wrong, now right) or ``changed`` (wrong before and
  after, another class); without labels every flip is ``changed``.
* ``hit`` (exact_match): the sample's non-float outputs no longer all equal FP32's (``lost``).
* ``value`` (output_sqnr_db, a custom metric's ``per_sample``): no value flips, so the worst
  :data:`VALUE_WORST_SHARE` of the samples by their drop below FP32's own per-sample value are listed, those
  that dropped at all (``worse``).

Flips are ordered worst first: ``lost`` before ``changed`` before ``gained``, then by the sample's worst
output SQNR against FP32 (lowest first); ``value`` flips by their drop (largest first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qdebug.output.formatting import fmt_db, fmt_metric, metric_title

SAMPLES_VERSION = 1
"""Version of the ``per_sample`` section (bumped on any incompatible change of its layout)."""

VALUE_WORST_SHARE = 0.05
"""``value`` metrics: the share of the samples listed (the worst by their drop below FP32), at least one."""

EFFECT_ORDER = {"lost": 0, "changed": 1, "worse": 1, "gained": 2}
"""Worst first: a sample FP32 got right and the quantized model gets wrong leads."""


@dataclass(frozen=True)
class SampleFlip:
    """One evaluation sample whose task result flipped against FP32's."""

    index: int
    """Global index of the sample in evaluation order (0-based; for an ``.npz`` file, its row)."""
    origin: str
    """The batch it came from, as the data names it (file and slice, e.g. ``eval.npz[32:48]``)."""
    row: int
    """Its row inside that batch: ``origin``'s slice start plus ``row`` is its row in the file."""
    label: int | None
    """Its label (``None`` without labels)."""
    fp32: float
    """FP32's result: the predicted class (``class``), 1/0 (``hit``) or the value (``value``)."""
    result: float
    """The variant's result, in the same unit."""
    effect: str
    """``lost``, ``gained``, ``changed`` (see the module docstring) or ``worse`` (a ``value`` drop)."""
    output_sqnr_db: float
    """The sample's worst float output SQNR against FP32 (dB; ``nan``: no float output to compare)."""

    def where(self) -> str:
        """``eval.npz[32:48] row 5``: how to find the input."""
        return f"{self.origin.rsplit('/', 1)[-1]} row {self.row}"


@dataclass(frozen=True)
class SampleDetail:
    """A flipped sample run again on its own through both models with every paired tensor as an output."""

    index: int
    """The flipped sample (:attr:`SampleFlip.index`)."""
    variant: str
    """The quantized variant it was measured on (``static``, ``selective``)."""
    sqnr_db: tuple[float, ...]
    """Per tensor of :attr:`SampleSection.tensors`: FP32 vs the quantized model's value, this sample only."""
    added_noise_db: tuple[float, ...]
    """Per tensor: the noise its producer adds for this sample, ``10*log10(NSR_out - NSR_in)`` as
    ``NodeRecord.added_noise_db`` defines it (``-inf``: none; ``nan``: unknown, e.g. a graph input)."""
    clip_rate: tuple[float, ...]
    """Per tensor: the share of this sample's FP32 values outside the range the tensor's Q/DQ represents
    (its calibrated ``[rmin, rmax]``, widened to hold 0 as ORT does); ``nan`` where not quantized."""
    output_sqnr_db: float
    """The worst float output SQNR of this re-run (a check: it repeats :attr:`SampleFlip.output_sqnr_db`
    unless the kernels round otherwise at this batch size)."""
    copies: int = 1
    """Copies of the sample in the batch it ran in (a model with a fixed batch dimension B takes B)."""


@dataclass(frozen=True)
class TensorDivergence:
    """One row of a flipped sample's divergence along depth (:meth:`SampleSection.divergence`)."""

    tensor: str
    node: str
    depth: int
    sqnr_db: float
    added_noise_db: float
    clip_rate: float


@dataclass(frozen=True)
class VariantSamples:
    """One quantized variant's per-sample results and its flips."""

    name: str
    """``static`` or ``selective``."""
    results: tuple[float, ...]
    """One result per evaluation sample, in evaluation order (a class index as a float: ``9.0``)."""
    flipped: int
    """How many samples flipped (every one, also beyond the listed ``flips``)."""
    flips: tuple[SampleFlip, ...]
    """The flipped samples, worst first, at most :attr:`SampleSection.listed`."""

    def effects(self) -> dict[str, int]:
        """How many of the *listed* flips have each effect."""
        out: dict[str, int] = {}
        for f in self.flips:
            out[f.effect] = out.get(f.effect, 0) + 1
        return out

    def flipped_indices(self, fp32: tuple[float, ...], kind: str) -> set[int]:
        """Every flipped sample (read off the results, so none is missed beyond the listed ones); for
        ``value`` metrics the listed ones."""
        if kind == "value":
            return {f.index for f in self.flips}
        return {i for i, (a, b) in enumerate(zip(fp32, self.results, strict=True)) if a != b}


@dataclass(frozen=True)
class RecalibratedVariant:
    """One variant rebuilt from the widened ranges (``verify --calib-add-flipped``)."""

    name: str
    before: float
    """Its metric from the cached ranges."""
    after: float
    """Its metric from the widened ranges."""
    flipped_before: int
    flipped_after: int
    recovered: int
    """Of the samples added to the calibration, how many no longer flip."""


@dataclass(frozen=True)
class Recalibration:
    """``verify --calib-add-flipped``: the cached ranges widened by the flipped samples' own activation ranges,
    the variants rebuilt from them and scored again."""

    samples_added: int
    """Flipped samples (of the static model) whose activation ranges were added, worst first."""
    tensors_widened: int
    """Calibrated tensors whose range grew."""
    widened: tuple[tuple[str, float, float, float, float], ...]
    """The tensors whose range grew most (relative to its width): ``(tensor, low, high, new low, new high)``."""
    variants: tuple[RecalibratedVariant, ...]
    note: str = ""

    def lines(self, metric: str) -> list[str]:
        """What the widened ranges did, one line per variant."""
        head = f"calibration + the {self.samples_added} flipped samples: {self.tensors_widened} tensor ranges widened"
        if self.widened:
            t, lo, hi, nlo, nhi = self.widened[0]
            head += f" (most: {t} [{lo:.4g}, {hi:.4g}] -> [{nlo:.4g}, {nhi:.4g}])"
        out = [head]
        for v in self.variants:
            out.append(
                f"  {v.name}: {fmt_metric(metric, v.before)} -> {fmt_metric(metric, v.after)}; flips "
                f"{v.flipped_before} -> {v.flipped_after} ({v.recovered} of the {self.samples_added} added recover)"
            )
        if self.note:
            out.append(f"  note: {self.note}")
        return out


@dataclass(frozen=True)
class SampleSection:
    """Per evaluation sample, FP32's and each quantized variant's task result; the samples that flip; and,
    for the worst of them, where along the graph each diverges and whether it left the calibrated ranges."""

    version: int
    """:data:`SAMPLES_VERSION` of the writer."""
    metric: str
    kind: str
    """``class``, ``hit`` or ``value`` (the module docstring says what flips for each)."""
    data: str
    """``eval`` or ``calib``: the data the task metric was scored on."""
    samples: int
    rule: str
    """The flip rule applied, in words."""
    fp32: tuple[float, ...]
    """FP32's result per sample."""
    labels: tuple[int, ...] | None
    variants: tuple[VariantSamples, ...]
    listed: int
    """Most flips listed per variant (the rest are counted in ``flipped`` and readable off ``results``)."""
    tensors: tuple[str, ...] = ()
    """The tensors the details measure (paired FP32 float tensors, topological order)."""
    tensor_nodes: tuple[str, ...] = ()
    """Each tensor's producer (``""`` for a graph input)."""
    tensor_depths: tuple[int, ...] = ()
    details: tuple[SampleDetail, ...] = ()
    """The worst flips of :attr:`detail_variant`, measured again on their own (at most ``--flip-details``)."""
    detail_variant: str = ""
    notes: tuple[str, ...] = ()
    recalibrated: Recalibration | None = None
    """``verify --calib-add-flipped``: the variants rebuilt with the flipped samples added to the calibration
    ranges (``None`` unless asked)."""

    def variant(self, name: str) -> VariantSamples:
        """The ``static``/``selective`` variant (KeyError if absent)."""
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def detail(self, index: int) -> SampleDetail | None:
        """The per-tensor measurement of sample ``index``, if it has one."""
        return next((d for d in self.details if d.index == index), None)

    def divergence(self, detail: SampleDetail) -> list[TensorDivergence]:
        """``detail`` as one row per tensor, in topological order."""
        return [
            TensorDivergence(t, n, d, s, a, c)
            for t, n, d, s, a, c in zip(
                self.tensors,
                self.tensor_nodes,
                self.tensor_depths,
                detail.sqnr_db,
                detail.added_noise_db,
                detail.clip_rate,
                strict=True,
            )
        ]

    def worst_tensors(self, detail: SampleDetail, k: int = 3) -> list[TensorDivergence]:
        """The ``k`` tensors where the sample diverges most: its producer adds the most noise for this
        sample (ties and unknowns by the lower SQNR)."""
        rows = [r for r in self.divergence(detail) if not math.isnan(r.added_noise_db) and r.added_noise_db > -math.inf]
        rows.sort(key=lambda r: (-r.added_noise_db, _key(r.sqnr_db)))
        return rows[:k]

    def most_clipped(self, detail: SampleDetail) -> TensorDivergence | None:
        """The tensor with the highest clip rate for this sample (None when nothing clipped)."""
        rows = [r for r in self.divergence(detail) if not math.isnan(r.clip_rate) and r.clip_rate > 0]
        return max(rows, key=lambda r: r.clip_rate) if rows else None

    def flip_cells(self, flip: SampleFlip) -> tuple[str, str, str, str, str, str]:
        """``(sample, input, change, output SQNR, diverges most at, clipped)`` of one flip, as text (the CLI
        line and the Markdown table); the last two ``-`` for a flip not measured tensor by tensor."""
        detail = self.detail(flip.index)
        worst, clipped = "-", "-"
        if detail is not None:
            top = self.worst_tensors(detail, 1)
            worst = f"{top[0].tensor} (added noise {fmt_db(top[0].added_noise_db)} dB)" if top else "-"
            most = self.most_clipped(detail)
            if most is not None:
                clipped = f"{100 * most.clip_rate:.1f}% of {most.tensor}"
            elif any(not math.isnan(c) for c in detail.clip_rate):
                clipped = "nothing"  # else no tensor has a fixed range (a dynamic model): "-"
        sqnr = "-" if math.isnan(flip.output_sqnr_db) else f"{fmt_db(flip.output_sqnr_db)} dB"
        return (f"#{flip.index}", flip.where(), self.change(flip), sqnr, worst, clipped)

    def flip_line(self, flip: SampleFlip) -> str:
        """One line for a flipped sample: where it is, what changed, where it diverges most, what clipped."""
        index, where, change, sqnr, worst, clipped = self.flip_cells(flip)
        parts = [f"{index:<6} {where}", change]
        if sqnr != "-":
            parts.append(f"output SQNR {sqnr}")
        if worst != "-":
            parts.append(f"diverges most at {worst}")
        if clipped != "-":
            parts.append("no value clipped" if clipped == "nothing" else f"clips {clipped}")
        return "  ".join(parts)

    def change(self, flip: SampleFlip) -> str:
        """``FP32 9 -> 4, lost (label 9)``: what the flip changed."""
        if self.kind == "class":
            label = f" (label {flip.label})" if flip.label is not None else ""
            return f"FP32 {int(flip.fp32)} -> {int(flip.result)}, {flip.effect}{label}"
        if self.kind == "hit":
            return "an output differs from FP32's"
        if self.metric == "output_sqnr_db":  # FP32's own value is the cap: the drop below it says nothing
            return f"among the worst {100 * VALUE_WORST_SHARE:g}% by output SQNR"
        return f"FP32 {flip.fp32:.4g} -> {flip.result:.4g} (drop {flip.fp32 - flip.result:.4g})"

    def worst_share(self) -> str:
        """``worst 5%``: what a ``value`` metric lists in place of flips (:data:`VALUE_WORST_SHARE`).

        Said wherever such a list is counted or compared: "5 of static's 5 recovered, 0 still flip" read
        as a measurement, though the list is a quantile of fixed size whatever the model does.
        """
        return f"worst {100 * VALUE_WORST_SHARE:g}%"

    def count_line(self, name: str) -> str:
        """``static: 81 of 500 samples flip (75 lost, 4 changed, 2 gained)``; for a ``value`` metric
        ``static: 25 of 500 samples listed, its worst 5% by output_sqnr_db (not flips)``."""
        v = self.variant(name)
        if self.kind == "value":
            listed = f"{v.flipped} of {self.samples} samples listed"
            return f"{name}: {listed}, its {self.worst_share()} by {metric_title(self.metric)} (not flips)"
        effects = v.effects()
        split = ", ".join(f"{effects[e]} {e}" for e in sorted(effects, key=lambda e: EFFECT_ORDER.get(e, 9)))
        listed = f"; {len(v.flips)} listed" if len(v.flips) < v.flipped else ""
        return f"{name}: {v.flipped} of {self.samples} samples flip" + (f" ({split}{listed})" if split else "")

    def comparison_line(self) -> str:
        """verify: how many of static's flips the selective model recovers, and how many it adds ("" without
        both variants); for a ``value`` metric, how the two variants' worst samples overlap."""
        try:
            static, sel = self.variant("static"), self.variant("selective")
        except KeyError:
            return ""
        a, b = static.flipped_indices(self.fp32, self.kind), sel.flipped_indices(self.fp32, self.kind)
        if self.kind == "value":
            return (
                f"selective vs static, each one's {self.worst_share()}: {len(a & b)} samples in both, "
                f"{len(a - b)} only in static's, {len(b - a)} only in selective's"
            )
        return (
            f"selective vs static: {len(a - b)} of static's {len(a)} recovered, {len(a & b)} still flip, "
            f"{len(b - a)} new"
        )

    def summary_lines(self, top: int = 5) -> list[str]:
        """The CLI summary: the count per variant and the ``top`` worst flips of the last variant (the
        static model in analyze, the selective one in verify), one line each."""
        scored = f"{metric_title(self.metric)} per sample vs FP32, {self.samples} {self.data} samples"
        head = f"worst samples ({scored}; no value flips)" if self.kind == "value" else f"flipped samples ({scored})"
        lines = [head + ":"]
        lines += [f"  {self.count_line(v.name)}" for v in self.variants]
        comparison = self.comparison_line()
        if comparison:
            lines.append(f"  {comparison}")
        last = self.variants[-1] if self.variants else None
        if last is not None and last.flips and top > 0:
            shown = last.flips[:top]
            lines.append(f"  the {len(shown)} worst ({last.name}):")
            lines += [f"    {self.flip_line(f)}" for f in shown]
        if self.recalibrated is not None:
            lines += [f"  {line}" for line in self.recalibrated.lines(self.metric)]
        return lines


def _key(x: float) -> float:
    """Sort key of an SQNR: lowest first, ``nan`` last."""
    return math.inf if math.isnan(x) else x
