"""Streaming error metrics: accumulators with ``update``, ``merge`` and ``result``.

Every accumulator sees one batch at a time, keeps only a few float64 sums (or a
fixed histogram), and never holds a tensor. ``merge`` returns a new accumulator
and leaves both inputs untouched, so partial results from several workers or
data shards combine in any order. This module imports numpy only.

Definitions (quoted in ``docs/report-schema.md``). ``r`` is the reference
tensor (FP32 model, or pre-Q value), ``c`` the candidate (QDQ model, or post-DQ
value); sums run over every finite element pair of every sample, in float64.

* **SQNR** (dB) = ``10*log10(sum(r**2) / sum((r-c)**2))``, with the edge cases
  explicit, never an epsilon clamp: noise zero and signal > 0 -> ``+inf``;
  signal zero and noise > 0 -> ``-inf``; both zero, or no samples -> ``nan``.
* **MSE** = ``sum((r-c)**2) / count``; ``nan`` when ``count == 0``.
* **cosine** = ``sum(r*c) / sqrt(sum(r**2) * sum(c**2))``, clamped to
  ``[-1, 1]`` against rounding; ``nan`` when either side is all-zero (two
  identical all-zero tensors included: the angle is undefined) or no samples.
* **max-abs** = ``max(|r-c|)``; ``nan`` when ``count == 0``.
* **KL** = ``KL(P_r || P_c) = sum_k p_k * ln(p_k / q_k)`` in nats, where ``P_r``
  and ``P_c`` are histograms of the reference and candidate values over the
  *same* bins (plus two overflow bins, below the first and above the last
  edge, so no value is dropped). Smoothing: each histogram is normalised to
  probabilities, :data:`KL_EPS` (``1e-6``) is added to every bin, and it is
  normalised again, so an empty candidate bin costs a large but finite
  amount; identical histograms give exactly ``0.0``; no data gives ``nan``.
  Clamped at ``0.0`` against rounding.

  **Binning.** For a quantized tensor the bins are aligned to its quantization
  grid (:func:`grid_edges`): bin ``k`` is centred on the dequantized level
  ``(q - zero_point) * scale`` and spans half a step either side, for every
  ``q`` in ``[qmin, qmax]``; with more than ``max_bins`` levels (16-bit) runs of
  consecutive levels share a bin, still split on level boundaries. Why: with
  naive fixed bins (e.g. 128 over min..max) the quantized values pile onto a
  comb of spikes while the FP32 values spread smoothly, so KL mostly measures
  the coarseness of the grid and is large for every quantized tensor. With
  grid-aligned bins a value and its own rounding land in the same bin, so
  rounding costs nothing, and KL measures what rounding does not explain:
  clipping (reference mass in the overflow bins, candidate mass piled on the
  outermost levels) and distribution shift from upstream error. For tensors
  without a grid, :func:`range_edges` gives uniform bins over a range.

* **Non-finite values.** An element pair where the reference or the candidate
  is NaN or +-Inf is skipped by every sum and histogram and counted in
  ``nonfinite``: reported, never propagated into the metrics.
  :class:`SummaryAccumulator` (one tensor) skips and counts non-finite
  elements likewise.

Binning is half-open, ``[e_k, e_k+1)``. For uniform edges the bin index is
computed arithmetically (``floor((x - e_0) / width)``, then ``np.bincount``),
in float32 for float32 inputs (float64 otherwise), so a value within about
``1e-4`` of a bin width from an edge may land in the neighbouring bin; other
edges use ``np.searchsorted`` (exact, ~15x slower). Grid-aligned edges sit
half-way between levels, where dequantized values never are, so this
touches reference values only, and negligibly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from qdebug.records import ErrorStats, Histogram, QuantParams, TensorSummary

__all__ = [
    "KL_EPS",
    "ErrorAccumulator",
    "HistogramAccumulator",
    "SummaryAccumulator",
    "TensorErrorAccumulator",
    "QuantGrid",
    "grid_edges",
    "grid_edges_for",
    "grid_for",
    "kl_divergence",
    "qtype_range",
    "range_edges",
]

KL_EPS = 1e-6
"""Probability mass added to every bin of both histograms before KL (then renormalised)."""

_CHUNK = 8192
"""Elements per step of the BLAS-based sums: float64 temporaries stay in cache (whole 1M-element arrays
measured ~4x slower), and OpenBLAS computes a dot product of <= 10000 elements on the calling thread.
Longer dots are split over its thread pool, which stalls badly when other work (ORT's own threads,
another process) holds the cores: measured 20-70 ns/element instead of ~3."""

_HIST_CHUNK = 1 << 16
"""Elements per step of the histogram (no BLAS involved; longer steps amortise the per-call overhead)."""

_NAN = math.nan


def _flat(x: np.ndarray) -> np.ndarray:
    """Flattened view (a copy only when ``x`` is not contiguous)."""
    return np.asarray(x).reshape(-1)


def _pair(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = np.asarray(ref)
    c = np.asarray(cand)
    if r.shape != c.shape:
        raise ValueError(f"reference shape {r.shape} != candidate shape {c.shape}")
    return _flat(r), _flat(c)


def _f64(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float64 else x.astype(np.float64)


def _finite_pairs(r: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """Drop pairs where either side is NaN/Inf; return the rest and how many were dropped."""
    ok = np.isfinite(r)
    ok &= np.isfinite(c)
    kept = int(np.count_nonzero(ok))
    if kept == r.size:
        return r, c, 0
    return r[ok], c[ok], r.size - kept


def _sqnr_db(signal: float, noise: float, count: int) -> float:
    if count == 0:
        return _NAN
    if noise == 0.0:
        return math.inf if signal > 0.0 else _NAN
    if signal == 0.0:
        return -math.inf
    # log difference, not log of the ratio: the ratio may overflow for tiny noise
    return 10.0 * (math.log10(signal) - math.log10(noise))


def _cosine(dot: float, rr: float, cc: float) -> float:
    if rr == 0.0 or cc == 0.0:
        return _NAN
    denom = math.sqrt(rr * cc)
    if not math.isfinite(denom) or denom == 0.0:  # product overflowed/underflowed
        denom = math.sqrt(rr) * math.sqrt(cc)
    return min(1.0, max(-1.0, dot / denom))


class ErrorAccumulator:
    """Streaming error of a candidate tensor against a reference (SQNR, MSE, cosine, max-abs).

    Attributes hold the raw float64 sums, so callers can inspect or combine
    them: ``sum_ref2`` = sum(r**2), ``sum_noise2`` = sum((r-c)**2),
    ``sum_cand2`` = sum(c**2), ``sum_dot`` = sum(r*c), ``max_abs``,
    ``count`` (finite pairs) and ``nonfinite`` (skipped pairs).
    """

    __slots__ = ("sum_ref2", "sum_noise2", "sum_cand2", "sum_dot", "max_abs", "count", "nonfinite")

    def __init__(self) -> None:
        self.sum_ref2 = 0.0
        self.sum_noise2 = 0.0
        self.sum_cand2 = 0.0
        self.sum_dot = 0.0
        self.max_abs = 0.0
        self.count = 0
        self.nonfinite = 0

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        """Add one batch: ``ref`` and ``cand`` of the same shape, any real dtype (inputs are not modified)."""
        r_all, c_all = _pair(ref, cand)
        ref2 = noise2 = cand2 = dot = 0.0
        max_abs = self.max_abs
        count = nonfinite = 0
        dot_ = np.dot
        isfinite = math.isfinite
        for start in range(0, r_all.size, _CHUNK):
            r = _f64(r_all[start : start + _CHUNK])
            c = _f64(c_all[start : start + _CHUNK])
            rr = float(dot_(r, r))
            cc = float(dot_(c, c))
            if not (isfinite(rr) and isfinite(cc)):
                # NaN/Inf somewhere (or a float64 overflow of the squares): slow path
                r, c, dropped = _finite_pairs(r, c)
                if dropped:
                    nonfinite += dropped
                    rr = float(dot_(r, r))
                    cc = float(dot_(c, c))
                if r.size == 0:
                    continue
            d = r - c
            ref2 += rr
            cand2 += cc
            noise2 += float(dot_(d, d))
            dot += float(dot_(r, c))
            np.abs(d, out=d)
            max_abs = max(max_abs, float(d.max()))
            count += r.size
        self.sum_ref2 += ref2
        self.sum_noise2 += noise2
        self.sum_cand2 += cand2
        self.sum_dot += dot
        self.max_abs = max_abs
        self.count += count
        self.nonfinite += nonfinite

    def add_sums(
        self, ref2: float, noise2: float, cand2: float, dot: float, max_abs: float, count: int
    ) -> None:
        """Add one batch given as its sums (computed elsewhere, e.g. inside ORT); all must be finite."""
        self.sum_ref2 += ref2
        self.sum_noise2 += noise2
        self.sum_cand2 += cand2
        self.sum_dot += dot
        self.max_abs = max(self.max_abs, max_abs)
        self.count += count

    def merge(self, other: ErrorAccumulator) -> ErrorAccumulator:
        """Return a new accumulator holding both; ``self`` and ``other`` are unchanged."""
        if not isinstance(other, ErrorAccumulator):
            raise TypeError(f"cannot merge ErrorAccumulator with {type(other).__name__}")
        out = ErrorAccumulator()
        out.sum_ref2 = self.sum_ref2 + other.sum_ref2
        out.sum_noise2 = self.sum_noise2 + other.sum_noise2
        out.sum_cand2 = self.sum_cand2 + other.sum_cand2
        out.sum_dot = self.sum_dot + other.sum_dot
        out.max_abs = max(self.max_abs, other.max_abs)
        out.count = self.count + other.count
        out.nonfinite = self.nonfinite + other.nonfinite
        return out

    def result(self, kl: float = _NAN) -> ErrorStats:
        """The metrics so far (definitions in the module docstring); ``kl`` is passed through."""
        n = self.count
        return ErrorStats(
            sqnr_db=_sqnr_db(self.sum_ref2, self.sum_noise2, n),
            mse=self.sum_noise2 / n if n else _NAN,
            cosine=_cosine(self.sum_dot, self.sum_ref2, self.sum_cand2) if n else _NAN,
            max_abs=self.max_abs if n else _NAN,
            kl=float(kl),
            count=n,
            nonfinite=self.nonfinite,
        )


class SummaryAccumulator:
    """Streaming min/max/mean/std (population, ``ddof=0``) of one tensor.

    Each chunk's mean and sum of squared deviations are computed in float64
    with two passes and combined with Chan et al.'s parallel update, which
    stays accurate for data with a large mean (no ``E[x^2] - E[x]^2``).
    Non-finite elements are skipped and counted in ``nonfinite``
    (``TensorSummary`` has no field for it).
    """

    __slots__ = ("count", "mean", "m2", "min", "max", "nonfinite")

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0
        """Sum of squared deviations from the mean."""
        self.min = math.inf
        self.max = -math.inf
        self.nonfinite = 0

    def _combine(self, n: int, mean: float, m2: float, lo: float, hi: float) -> None:
        if n == 0:
            return
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * (n / total)
        self.m2 += m2 + delta * delta * (self.count * n / total)
        self.count = total
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)

    def update(self, x: np.ndarray) -> None:
        """Add one batch of any shape and real dtype (not modified)."""
        flat = _flat(x)
        for start in range(0, flat.size, _CHUNK):
            a = _f64(flat[start : start + _CHUNK])
            s = float(a.sum())
            if not math.isfinite(s):
                ok = np.isfinite(a)
                kept = int(np.count_nonzero(ok))
                if kept < a.size:
                    self.nonfinite += a.size - kept
                    a = a[ok]
                    if a.size == 0:
                        continue
                    s = float(a.sum())
            mean = s / a.size
            d = a - mean
            self._combine(a.size, mean, float(np.dot(d, d)), float(a.min()), float(a.max()))

    def add_moments(self, n: int, mean: float, m2: float, lo: float, hi: float) -> None:
        """Add one batch given as its count, mean, sum of squared deviations, min and max (all finite)."""
        self._combine(n, mean, max(m2, 0.0), lo, hi)

    def merge(self, other: SummaryAccumulator) -> SummaryAccumulator:
        """Return a new accumulator holding both; ``self`` and ``other`` are unchanged."""
        if not isinstance(other, SummaryAccumulator):
            raise TypeError(f"cannot merge SummaryAccumulator with {type(other).__name__}")
        out = SummaryAccumulator()
        out._combine(self.count, self.mean, self.m2, self.min, self.max)
        out._combine(other.count, other.mean, other.m2, other.min, other.max)
        out.nonfinite = self.nonfinite + other.nonfinite
        return out

    def result(self) -> TensorSummary:
        """Min, max, mean and population std of the finite elements; all ``nan`` when there were none."""
        n = self.count
        if n == 0:
            return TensorSummary(min=_NAN, max=_NAN, mean=_NAN, std=_NAN, count=0)
        return TensorSummary(
            min=self.min, max=self.max, mean=self.mean, std=math.sqrt(max(self.m2, 0.0) / n), count=n
        )


# --------------------------------------------------------------------------- histograms and KL

_QTYPE_RANGES = {
    "uint8": (0, 255),
    "int8": (-128, 127),
    "uint16": (0, 65535),
    "int16": (-32768, 32767),
    "uint4": (0, 15),
    "int4": (-8, 7),
}


def qtype_range(qtype: str) -> tuple[int, int]:
    """Full integer range ``(qmin, qmax)`` of an ONNX quantized element type name (``uint8``, ``int8``...).

    The full type range, not ORT's restricted symmetric/reduced range: every
    value a DequantizeLinear can output then has its own bin. Raises
    ``ValueError`` for types without an integer grid (e.g. float8).
    """
    try:
        return _QTYPE_RANGES[qtype.lower()]
    except KeyError:
        raise ValueError(f"no integer quantization grid for element type {qtype!r}") from None


def grid_edges(scale: float, zero_point: int, qmin: int, qmax: int, max_bins: int = 256) -> np.ndarray:
    """Bin edges aligned to a quantization grid (float64, strictly increasing).

    Bin ``k`` is centred on the dequantized level ``(qmin + k - zero_point) * scale``
    with edges half a step either side, so ``len(edges) == qmax - qmin + 2``.
    With more than ``max_bins`` levels, ``g = ceil(levels / max_bins)``
    consecutive levels share a bin (edges on level boundaries, the last bin
    may hold fewer levels): at most ``max_bins`` bins.
    """
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    qmin, qmax, zero_point = int(qmin), int(qmax), int(zero_point)
    if qmax < qmin:
        raise ValueError(f"qmax {qmax} < qmin {qmin}")
    if max_bins < 1:
        raise ValueError(f"max_bins must be >= 1, got {max_bins}")
    levels = qmax - qmin + 1
    group = -(-levels // max_bins)
    bounds = np.append(np.arange(qmin, qmax + 1, group, dtype=np.float64), float(qmax + 1))
    return (bounds - (zero_point + 0.5)) * float(scale)


def grid_edges_for(quant: QuantParams, max_bins: int = 256) -> np.ndarray:
    """:func:`grid_edges` for a Q/DQ pair, over the full range of its element type.

    For per-axis quantization ``quant`` holds the first channel's scale, so
    the bins are aligned for that channel only.
    """
    qmin, qmax = qtype_range(quant.qtype)
    return grid_edges(quant.scale, quant.zero_point, qmin, qmax, max_bins)


@dataclass(frozen=True)
class QuantGrid:
    """A quantization grid as histogram bins: values are binned by the level they quantize to.

    Binning by edges half a step either side of each level puts a value and
    its own rounding in the same bin only if the edge arithmetic agrees with
    the quantizer's: it did not at ties (0.5 at scale 1/255 is 127.49999 steps
    in float32, which ORT rounds to 127, while ``0.5 * 255 + 1.5`` fell in
    level 128's bin), and 3 % of the transformer's inputs at 0.5 gave a
    local KL of 0.32 nats for 56 dB of SQNR. So the bin of a value is
    ``rint(x / scale) + zero_point`` in float32, as QuantizeLinear computes it.
    """

    scale: float
    zero_point: int
    qmin: int
    qmax: int
    group: int = 1
    """Consecutive levels per bin (more than ``max_bins`` levels, e.g. 16-bit)."""

    def edges(self) -> np.ndarray:
        """The bins' edges, half a step outside the levels (as :func:`grid_edges`)."""
        bounds = np.append(np.arange(self.qmin, self.qmax + 1, self.group, dtype=np.float64), self.qmax + 1.0)
        return (bounds - (self.zero_point + 0.5)) * self.scale

    def index(self, x: np.ndarray) -> np.ndarray:
        """Bin indices 0..nbins+1 of finite values (0 and nbins+1: below ``qmin`` and above ``qmax``)."""
        level = np.rint(np.divide(x.astype(np.float32, copy=False), np.float32(self.scale)))
        levels = self.qmax - self.qmin + 1
        nbins = -(-levels // self.group)
        level -= np.float32(self.qmin - self.zero_point)  # 0 at qmin
        above = level >= levels  # above qmax: the overflow bin even when the last bin is narrower
        if self.group > 1:
            np.floor_divide(level, np.float32(self.group), out=level)
        level += np.float32(1.0)
        np.clip(level, 0.0, float(nbins), out=level)
        idx = level.astype(np.intp)
        idx[above] = nbins + 1
        return idx


def grid_for(quant: QuantParams, max_bins: int = 256) -> QuantGrid:
    """The :class:`QuantGrid` of a Q/DQ pair, over the full range of its element type (per-axis: the first
    channel's scale)."""
    qmin, qmax = qtype_range(quant.qtype)
    if not (math.isfinite(quant.scale) and quant.scale > 0.0):
        raise ValueError(f"scale must be finite and > 0, got {quant.scale!r}")
    return QuantGrid(float(quant.scale), int(quant.zero_point), qmin, qmax, -(-(qmax - qmin + 1) // max_bins))


def range_edges(lo: float, hi: float, bins: int = 128) -> np.ndarray:
    """``bins`` uniform bins over ``[lo, hi]`` for tensors without a quantization grid.

    A degenerate range (``lo == hi``, e.g. a constant tensor, or too narrow to
    split in float64) is widened to ``mid +- max(|mid|, 1) * 1e-3`` so edges
    stay strictly increasing and the constant lies inside.
    """
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"range must be finite, got [{lo}, {hi}]")
    if hi < lo:
        raise ValueError(f"hi {hi} < lo {lo}")
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    edges = np.linspace(lo, hi, bins + 1)
    if not np.all(np.diff(edges) > 0.0):
        mid = lo + (hi - lo) / 2.0
        half = max(abs(mid), 1.0) * 1e-3
        edges = np.linspace(mid - half, mid + half, bins + 1)
    return edges


def kl_divergence(p_counts: np.ndarray, q_counts: np.ndarray, eps: float = KL_EPS) -> float:
    """KL(P || Q) in nats of two count vectors over the same bins, smoothed as in the module docstring.

    ``nan`` when either has no counts; identical distributions give exactly ``0.0``.
    """
    p = np.asarray(p_counts, dtype=np.float64)
    q = np.asarray(q_counts, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"count vectors differ in shape: {p.shape} vs {q.shape}")
    sp, sq = float(p.sum()), float(q.sum())
    if sp <= 0.0 or sq <= 0.0:
        return _NAN
    p = p / sp + eps
    p /= p.sum()
    q = q / sq + eps
    q /= q.sum()
    return max(0.0, float(np.dot(p, np.log(p) - np.log(q))))


class HistogramAccumulator:
    """Reference and candidate value histograms over fixed edges, plus two overflow bins.

    ``edges`` are finite and strictly increasing (``E`` edges, ``E - 1`` bins).
    Counts have ``E + 1`` entries: index 0 counts values ``< edges[0]``,
    index ``k`` (1..E-1) counts ``[edges[k-1], edges[k])``, index ``E``
    counts values ``>= edges[-1]``. Pairs with a NaN/Inf on either side are
    skipped and counted in ``nonfinite`` (the same pairs
    :class:`ErrorAccumulator` skips), so both histograms count the same
    elements.
    """

    __slots__ = (
        "edges",
        "ref_counts",
        "cand_counts",
        "nonfinite",
        "_uniform",
        "_inv_w",
        "_offset",
        "_narrow_last",
        "_f32_ok",
        "grid",
    )

    def __init__(self, edges: np.ndarray | QuantGrid) -> None:
        self.grid = edges if isinstance(edges, QuantGrid) else None
        """Bins by quantization level when set (see :class:`QuantGrid`); by the edges otherwise."""
        if self.grid is not None:
            edges = self.grid.edges()
        e = np.array(edges, dtype=np.float64).reshape(-1)
        if e.size < 2 or not np.all(np.isfinite(e)) or not np.all(np.diff(e) > 0.0):
            raise ValueError("histogram edges must be >= 2 finite, strictly increasing values")
        e.setflags(write=False)
        self.edges = e
        nbins = e.size - 1
        self.ref_counts = np.zeros(nbins + 2, dtype=np.int64)
        self.cand_counts = np.zeros(nbins + 2, dtype=np.int64)
        self.nonfinite = 0
        # Fast path: all bins of one width, except perhaps a narrower last one (grouped 16-bit grids).
        d = np.diff(e)
        w = float(d[0])
        self._uniform = bool(np.allclose(d[:-1], w, rtol=1e-6, atol=0.0) and d[-1] <= w * (1 + 1e-6))
        self._narrow_last = bool(self._uniform and d[-1] < w * (1 - 1e-6))
        if self._uniform:
            full = nbins - 1 if self._narrow_last else nbins
            w = float(e[full] - e[0]) / full
        self._inv_w = 1.0 / w
        self._offset = 1.0 - float(e[0]) * self._inv_w
        # float32 arithmetic is exact enough (2**-12 of a bin) only while |edge|/width stays small
        self._f32_ok = bool(max(abs(e[0]), abs(e[-1])) * self._inv_w < 4096.0)

    @property
    def nbins(self) -> int:
        """Number of in-range bins (``len(edges) - 1``), overflow bins not included."""
        return self.edges.size - 1

    def _index(self, x: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """Bin indices 0..nbins+1 of finite values ``x`` (``raw``: the same values, for the edge check)."""
        top = self.nbins + 1
        if self.grid is not None:
            return self.grid.index(raw)
        if not self._uniform:
            return np.searchsorted(self.edges, x, side="right")
        t = np.multiply(x, x.dtype.type(self._inv_w))
        t += x.dtype.type(self._offset)
        np.clip(t, 0.0, float(top), out=t)
        idx = t.astype(np.intp)
        if self._narrow_last:
            idx[raw >= self.edges[-1]] = top
        return idx

    def _work(self, x: np.ndarray) -> np.ndarray:
        if x.dtype == np.float32 and self._f32_ok:
            return x
        return _f64(x)

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        """Count one batch of reference and candidate values (same shape; inputs not modified)."""
        r_all, c_all = _pair(ref, cand)
        n = self.nbins + 2
        for start in range(0, r_all.size, _HIST_CHUNK):
            r = self._work(r_all[start : start + _HIST_CHUNK])
            c = self._work(c_all[start : start + _HIST_CHUNK])
            if not (np.isfinite(r).all() and np.isfinite(c).all()):
                r, c, dropped = _finite_pairs(r, c)
                self.nonfinite += dropped
                if r.size == 0:
                    continue
            self.ref_counts += np.bincount(self._index(r, r), minlength=n)
            self.cand_counts += np.bincount(self._index(c, c), minlength=n)

    def merge(self, other: HistogramAccumulator) -> HistogramAccumulator:
        """Return a new accumulator holding both (edges must be identical); inputs unchanged."""
        if not isinstance(other, HistogramAccumulator):
            raise TypeError(f"cannot merge HistogramAccumulator with {type(other).__name__}")
        if not np.array_equal(self.edges, other.edges):
            raise ValueError("cannot merge histograms with different edges")
        out = HistogramAccumulator(self.grid if self.grid is not None else self.edges)
        out.ref_counts = self.ref_counts + other.ref_counts
        out.cand_counts = self.cand_counts + other.cand_counts
        out.nonfinite = self.nonfinite + other.nonfinite
        return out

    def kl(self) -> float:
        """KL(P_ref || P_cand) in nats over all bins, overflow bins included (``nan`` without data)."""
        return kl_divergence(self.ref_counts, self.cand_counts)

    def result(self) -> Histogram:
        """The histogram record: ``edges`` are ``(-inf, *edges, +inf)`` so every count has its bin.

        ``len(result.edges) == len(result.ref_counts) + 1`` and the outermost
        bins, ``[-inf, edges[0])`` and ``[edges[-1], +inf)``, are the overflow bins.
        """
        return Histogram(
            edges=(-math.inf, *(float(v) for v in self.edges), math.inf),
            ref_counts=tuple(int(v) for v in self.ref_counts),
            cand_counts=tuple(int(v) for v in self.cand_counts),
        )


class TensorErrorAccumulator:
    """An :class:`ErrorAccumulator` plus an optional :class:`HistogramAccumulator` for the KL field.

    Without ``edges`` the ``kl`` of :meth:`result` is ``nan``.
    """

    __slots__ = ("error", "histogram")

    def __init__(self, edges: np.ndarray | QuantGrid | None = None) -> None:
        self.error = ErrorAccumulator()
        self.histogram = HistogramAccumulator(edges) if edges is not None else None

    def update(self, ref: np.ndarray, cand: np.ndarray) -> None:
        """Add one batch to both accumulators."""
        self.error.update(ref, cand)
        if self.histogram is not None:
            self.histogram.update(ref, cand)

    def merge(self, other: TensorErrorAccumulator) -> TensorErrorAccumulator:
        """Return a new accumulator holding both; inputs unchanged (both must have a histogram or neither)."""
        if not isinstance(other, TensorErrorAccumulator):
            raise TypeError(f"cannot merge TensorErrorAccumulator with {type(other).__name__}")
        if (self.histogram is None) != (other.histogram is None):
            raise ValueError("cannot merge an accumulator with a histogram and one without")
        out = TensorErrorAccumulator()
        out.error = self.error.merge(other.error)
        if self.histogram is not None and other.histogram is not None:
            out.histogram = self.histogram.merge(other.histogram)
        return out

    def result(self) -> ErrorStats:
        """ErrorStats with ``kl`` from the histogram (``nan`` without one)."""
        stats = self.error.result()
        if self.histogram is None:
            return stats
        return replace(stats, kl=self.histogram.kl())

    def histogram_result(self) -> Histogram | None:
        """The histogram record, or ``None`` without edges."""
        return self.histogram.result() if self.histogram is not None else None
