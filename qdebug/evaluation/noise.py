"""How sure an evaluation set lets a gate be: paired bootstrap intervals, McNemar's exact test, and the
number of samples that would decide an undecided gate.

A 60-image evaluation set cannot tell a 1-point drop from noise, so verify judges its gates by intervals,
not by point estimates alone:

* **Paired bootstrap.** The evaluation units (samples; evaluation batches for a custom metric without a
  per-sample form) are drawn with replacement, the same draws for FP32, static and selective, and every
  metric is recomputed on each draw from its per-unit parts (:class:`Resampled`: hits per sample, or a
  sample's signal and noise energies, so a resampled SQNR is one of resampled sums, never a mean of
  per-sample dB). The drop, the recovered fraction and the SQNR of every draw are functions of those
  values, and their interval at confidence ``c`` is the ``(1 - c) / 2`` and ``(1 + c) / 2`` quantiles
  of the draws (order statistics: no interpolation across an infinite value). Pairing is what makes
  60 samples informative: a selective model that agrees with FP32 on all but two samples has an
  interval two samples wide, whatever the accuracy's own spread. The draws come from a fixed seed
  (:data:`SEED`): the same data give the same interval on every run and machine.
* **McNemar's exact test** (top-1): of the samples where FP32 and the selective model disagree on being
  right, ``b`` favour FP32 and ``c`` the selective model; the two-sided p-value of ``b`` successes in
  ``b + c`` trials at 1/2 (``scipy.stats.binomtest``) says whether the two differ at all.
* **Samples to decide.** An interval that straddles a threshold narrows as ``1/sqrt(n)``: with the
  observed difference and spread, ``n * (half width / distance to the threshold)**2`` units would put the
  threshold outside it (the half on the threshold's side).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

SEED = 20240619
"""Seed of every bootstrap draw: intervals are deterministic."""
RESAMPLES = 2000
"""Bootstrap draws for metrics recomputed from per-unit sums (vectorized: milliseconds)."""
HOOK_RESAMPLES = 400
"""Bootstrap draws for a custom metric re-called on resampled batches (one call per draw and variant)."""
DEFAULT_CONFIDENCE = 0.95
_CELLS = 1 << 21
"""Index cells drawn at once (draws x units): bounds the memory of a bootstrap over a large set."""


class Resampled(Protocol):
    """A metric's value split over evaluation units, so that a resample of the units can be rescored."""

    @property
    def units(self) -> int:
        """How many units (samples, or batches) the value is made of."""
        ...

    @property
    def resamples(self) -> int:
        """How many draws this kind of value affords (:data:`RESAMPLES` or :data:`HOOK_RESAMPLES`)."""
        ...

    def resampled(self, draws: np.ndarray) -> np.ndarray:
        """The metric on each row of ``draws`` (``[k, units]`` unit indices): ``[k]`` values."""
        ...


@dataclass(frozen=True)
class Interval:
    """A point estimate and its bootstrap interval at ``confidence``."""

    estimate: float
    low: float
    high: float
    confidence: float

    def pair(self) -> tuple[float, float]:
        """``(low, high)``, as the JSON records store it."""
        return (self.low, self.high)


@dataclass(frozen=True)
class McNemar:
    """McNemar's exact test of two classifiers on the same samples."""

    first_only: int
    """Samples the first (FP32) gets right and the second (selective) wrong."""
    second_only: int
    """Samples the second gets right and the first wrong."""
    p_value: float
    """Two-sided exact binomial p-value of ``first_only`` in ``first_only + second_only`` at 1/2 (1.0 when
    they never disagree)."""


def draws(units: int, resamples: int, seed: int = SEED) -> Iterator[np.ndarray]:
    """Bootstrap draws of ``units`` indices with replacement, ``resamples`` rows in all, in chunks that
    hold at most :data:`_CELLS` indices (the same rows, in the same order, whatever the chunking)."""
    rng = np.random.default_rng(seed)
    per_chunk = max(1, _CELLS // max(units, 1))
    done = 0
    while done < resamples:
        k = min(per_chunk, resamples - done)
        yield rng.integers(0, units, size=(k, units))
        done += k


def bootstrap(values: Sequence[Resampled], resamples: int | None = None, seed: int = SEED) -> np.ndarray:
    """``[len(values), resamples]``: every value rescored on the same draws (a paired bootstrap).

    ``resamples`` defaults to the fewest any of ``values`` affords. All must share their units.
    """
    units = {v.units for v in values}
    if len(units) != 1:
        raise ValueError(f"a paired bootstrap needs the same units in every value (got {sorted(units)})")
    n = units.pop()
    count = resamples if resamples is not None else min(v.resamples for v in values)
    chunks = [np.stack([v.resampled(d) for v in values]) for d in draws(n, count, seed)]
    return np.concatenate(chunks, axis=1)


def interval(draws_of: np.ndarray, estimate: float, confidence: float) -> Interval:
    """The percentile interval of a statistic's bootstrap draws (NaN draws left out; ``nan`` bounds when
    none is left)."""
    x = np.asarray(draws_of, dtype=np.float64)
    x = x[~np.isnan(x)]
    if not x.size:
        return Interval(float(estimate), math.nan, math.nan, confidence)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(x, [tail, 1.0 - tail], method="inverted_cdf")
    return Interval(float(estimate), float(low), float(high), confidence)


def mcnemar(first: np.ndarray, second: np.ndarray) -> McNemar:
    """McNemar's exact test of whether two classifiers' hits (boolean, one per sample) differ."""
    from scipy.stats import binomtest  # scipy is slow to import: only when a test is asked for

    a, b = np.asarray(first, dtype=bool), np.asarray(second, dtype=bool)
    first_only, second_only = int(np.sum(a & ~b)), int(np.sum(~a & b))
    trials = first_only + second_only
    p = 1.0 if trials == 0 else float(binomtest(first_only, trials, 0.5).pvalue)
    return McNemar(first_only, second_only, min(p, 1.0))


def samples_to_decide(iv: Interval, threshold: float, units: int) -> int | None:
    """Units that would put ``threshold`` outside the interval, if the estimate and its spread held (the
    half-width on the threshold's side shrinks as ``1/sqrt(n)``); None when the estimate is at the
    threshold (no count decides it) or the interval is unknown."""
    gap = abs(iv.estimate - threshold)
    half = iv.high - iv.estimate if threshold > iv.estimate else iv.estimate - iv.low
    if not (math.isfinite(gap) and math.isfinite(half)) or gap <= 1e-12 * max(1.0, abs(threshold)):
        return None
    needed = math.ceil(units * (max(half, 0.0) / gap) ** 2)
    return max(needed, units + 1)


@dataclass(frozen=True)
class PairedNoise:
    """The intervals of verify's numbers: FP32, static and selective rescored on the same draws."""

    confidence: float
    resamples: int
    units: int
    """Units drawn: evaluation samples, or batches (:attr:`samples` over :attr:`units` samples each)."""
    samples: int
    drop: Interval | None = None
    """FP32 minus selective, times ``scale`` (points for the accuracy metrics); None without an FP32 value."""
    static_drop: Interval | None = None
    """FP32 minus static, times ``scale``."""
    recovery: Interval | None = None
    """``(sel - static) / (fp32 - static)``; a draw in which static lost nothing counts as ``+inf`` when the
    selective model keeps the lower of the two levels there and ``-inf`` when not (the rule verify then
    judges by), so the bounds stay order statistics. The estimate is ``nan`` when static lost nothing."""
    margin: Interval | None = None
    """Selective minus the lower of FP32 and static, times ``scale``: the gate when static lost nothing."""
    mcnemar: McNemar | None = None
    """FP32 vs selective, for a metric of one hit per sample (top-1)."""
    sqnr: Interval | None = None
    """The selective model's worst output SQNR (dB), when a target asks for it."""
    sqnr_units: int = 0

    @property
    def per_unit(self) -> float:
        """Samples per unit drawn (1 for samples)."""
        return self.samples / self.units if self.units else 1.0


def paired_noise(
    values: tuple[Resampled, Resampled, Resampled],
    estimates: tuple[float, float, float],
    *,
    confidence: float,
    scale: float = 1.0,
    samples: int | None = None,
    hits: tuple[np.ndarray, np.ndarray] | None = None,
) -> PairedNoise:
    """The drop, recovery and margin intervals of (FP32, static, selective) ``values`` on one set of draws.

    ``estimates`` are the three point values (the intervals' estimates); ``hits``, FP32's and the
    selective model's per-sample hits, add McNemar's test.
    """
    f, s, q = bootstrap(values)
    fe, se, qe = estimates
    gap = f - s
    with np.errstate(divide="ignore", invalid="ignore"):
        lost = np.where(gap > 1e-12, (q - s) / np.where(gap > 1e-12, gap, 1.0), 0.0)
    kept = np.where(q >= np.minimum(s, f) - 1e-12, np.inf, -np.inf)
    recovery = np.where(gap > 1e-12, lost, kept)
    recovered = (qe - se) / (fe - se) if math.isfinite(fe) and math.isfinite(se) and fe - se > 1e-12 else math.nan
    units = values[0].units
    return PairedNoise(
        confidence=confidence,
        resamples=int(f.size),
        units=units,
        samples=units if samples is None else samples,
        drop=interval(scale * (f - q), scale * (fe - qe), confidence),
        static_drop=interval(scale * (f - s), scale * (fe - se), confidence),
        recovery=interval(recovery, recovered, confidence),
        margin=interval(scale * (q - np.minimum(s, f)), scale * (qe - min(se, fe)), confidence),
        mcnemar=None if hits is None else mcnemar(*hits),
    )


def single_interval(value: Resampled, estimate: float, confidence: float) -> Interval:
    """The bootstrap interval of one variant's value (the selective model's output SQNR)."""
    return interval(bootstrap([value])[0], estimate, confidence)
