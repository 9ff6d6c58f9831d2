"""Tests of the streaming metric accumulators: hand-computed values, edge cases, properties."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qdebug.evaluation import metrics
from qdebug.evaluation.metrics import (
    ErrorAccumulator,
    HistogramAccumulator,
    SummaryAccumulator,
    TensorErrorAccumulator,
    grid_edges,
    grid_edges_for,
    kl_divergence,
    qtype_range,
    range_edges,
)
from qdebug.records import QuantParams

PROPS = settings(max_examples=50, deadline=None)


def _err(ref, cand) -> ErrorAccumulator:
    acc = ErrorAccumulator()
    acc.update(np.asarray(ref, dtype=np.float64), np.asarray(cand, dtype=np.float64))
    return acc


def _qdq(x: np.ndarray, scale: float, zp: int, qmin: int, qmax: int) -> np.ndarray:
    """Quantize-dequantize as ONNX QuantizeLinear/DequantizeLinear do (round half to even, saturate)."""
    q = np.clip(np.round(x / scale) + zp, qmin, qmax)
    return ((q - zp) * scale).astype(x.dtype)


# --------------------------------------------------------------------------- ErrorAccumulator


def test_hand_computed_values() -> None:
    s = _err([1, 2, 3], [1, 2, 4]).result()
    assert s.sqnr_db == pytest.approx(10 * math.log10(14 / 1))
    assert s.mse == pytest.approx(1 / 3)
    assert s.cosine == pytest.approx(17 / math.sqrt(14 * 21))
    assert s.max_abs == 1.0
    assert s.count == 3 and s.nonfinite == 0
    assert math.isnan(s.kl)


def test_identical_tensors() -> None:
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    acc = TensorErrorAccumulator(range_edges(-3, 3))
    acc.update(x, x.copy())
    s = acc.result()
    assert s.sqnr_db == math.inf
    assert s.cosine == 1.0
    assert s.mse == 0.0 and s.max_abs == 0.0
    assert s.kl == 0.0
    assert s.count == 20


def test_zero_signal_with_noise_is_minus_inf() -> None:
    s = _err([0, 0, 0], [0, 1, 0]).result()
    assert s.sqnr_db == -math.inf
    assert s.mse == pytest.approx(1 / 3)
    assert math.isnan(s.cosine)


def test_both_zero_is_nan() -> None:
    s = _err([0.0, 0.0], [0.0, 0.0]).result()
    assert math.isnan(s.sqnr_db)
    assert math.isnan(s.cosine)
    assert s.mse == 0.0 and s.max_abs == 0.0 and s.count == 2


def test_no_samples_is_nan() -> None:
    s = ErrorAccumulator().result()
    assert all(math.isnan(v) for v in (s.sqnr_db, s.mse, s.cosine, s.max_abs, s.kl))
    assert s.count == 0
    empty = _err(np.zeros(0), np.zeros(0)).result()
    assert empty.count == 0 and math.isnan(empty.sqnr_db)


def test_nonfinite_counted_and_excluded() -> None:
    ref = np.array([1, np.nan, 2, 3, np.inf, 5], dtype=np.float32)
    cand = np.array([1, 7, 2, 4, 1, -np.inf], dtype=np.float32)
    ref_before, cand_before = ref.copy(), cand.copy()
    s = _err(ref, cand).result()
    assert s.nonfinite == 3 and s.count == 3
    assert s.sqnr_db == pytest.approx(10 * math.log10(14))
    assert s.max_abs == 1.0
    np.testing.assert_array_equal(ref, ref_before)
    np.testing.assert_array_equal(cand, cand_before)


def test_all_nonfinite() -> None:
    s = _err([np.nan, np.inf], [1.0, 2.0]).result()
    assert s.count == 0 and s.nonfinite == 2 and math.isnan(s.sqnr_db)


def test_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="shape"):
        ErrorAccumulator().update(np.zeros((2, 3)), np.zeros(6))


def test_dtypes_and_noncontiguous_inputs() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((30, 40))
    y = x + 0.01 * rng.standard_normal((30, 40))
    ref = _err(x.T, y.T).result()  # non-contiguous float64
    for dt in (np.float16, np.float32):
        a = ErrorAccumulator()
        a.update(x.astype(dt), y.astype(dt))
        s = a.result()
        assert s.count == 1200
        assert s.sqnr_db == pytest.approx(ref.sqnr_db, abs=0.5 if dt == np.float16 else 0.01)


def test_negative_cosine_and_clamp() -> None:
    assert _err([1, 2], [-1, -2]).result().cosine == -1.0
    x = np.random.default_rng(2).standard_normal(10_000) * 1e-3 + 5
    assert _err(x, x).result().cosine == 1.0


def test_streaming_across_chunks_of_a_large_array() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(3 * metrics._CHUNK + 17).astype(np.float32)
    y = x + rng.standard_normal(x.size).astype(np.float32) * np.float32(0.1)
    x[5] = np.nan
    y[metrics._CHUNK + 3] = np.inf
    s = _err(x, y).result()
    ok = np.isfinite(x) & np.isfinite(y)
    r, c = x[ok].astype(np.float64), y[ok].astype(np.float64)
    assert s.nonfinite == 2 and s.count == x.size - 2
    assert s.sqnr_db == pytest.approx(10 * math.log10(np.sum(r**2) / np.sum((r - c) ** 2)), rel=1e-12)
    assert s.max_abs == np.max(np.abs(r - c))


# --------------------------------------------------------------------------- property tests

_VALUES = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)
_PAIRS = st.integers(0, 120).flatmap(
    lambda n: st.tuples(
        hnp.arrays(np.float32, n, elements=_VALUES),
        hnp.arrays(np.float32, n, elements=_VALUES),
    )
)


def _chunks(a: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    points = sorted({min(c, a.size) for c in cuts})
    return np.split(a, points)


def _assert_err_close(a: ErrorAccumulator, b: ErrorAccumulator, scale: float) -> None:
    tol = 1e-9 * max(scale, 1.0)
    assert a.count == b.count and a.nonfinite == b.nonfinite
    assert a.max_abs == b.max_abs
    for f in ("sum_ref2", "sum_noise2", "sum_cand2", "sum_dot"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-9, abs=tol), f


@PROPS
@given(_PAIRS, st.lists(st.integers(0, 120), max_size=6))
def test_streaming_equals_one_shot(pair, cuts) -> None:
    ref, cand = pair
    one = _err(ref, cand)
    streamed = ErrorAccumulator()
    for r, c in zip(_chunks(ref, cuts), _chunks(cand, cuts), strict=True):
        streamed.update(r, c)
    scale = float(np.sum(ref.astype(np.float64) ** 2) + np.sum(cand.astype(np.float64) ** 2))
    _assert_err_close(one, streamed, scale)
    a, b = one.result(), streamed.result()
    if math.isfinite(a.sqnr_db):
        assert a.sqnr_db == pytest.approx(b.sqnr_db, rel=1e-9, abs=1e-9)
    else:
        assert a.sqnr_db == b.sqnr_db or (math.isnan(a.sqnr_db) and math.isnan(b.sqnr_db))


@PROPS
@given(st.lists(_PAIRS, min_size=3, max_size=3))
def test_merge_associative_order_independent_and_pure(pairs) -> None:
    accs = [_err(r, c) for r, c in pairs]
    snapshots = [copy.copy(a) for a in accs]
    x, y, z = accs
    left = x.merge(y).merge(z)
    right = x.merge(y.merge(z))
    swapped = z.merge(x).merge(y)
    scale = sum(a.sum_ref2 + a.sum_cand2 for a in accs)
    _assert_err_close(left, right, scale)
    _assert_err_close(left, swapped, scale)
    for a, s in zip(accs, snapshots, strict=True):  # inputs untouched
        assert all(getattr(a, f) == getattr(s, f) for f in ErrorAccumulator.__slots__)
    both = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    _assert_err_close(left, _err(*both), scale)


@PROPS
@given(
    hnp.arrays(np.float64, st.integers(0, 150), elements=st.floats(-1e4, 1e4)), st.lists(st.integers(0, 150))
)
def test_summary_streaming_and_merge(x, cuts) -> None:
    parts = _chunks(x, cuts)
    streamed = SummaryAccumulator()
    accs = []
    for p in parts:
        streamed.update(p)
        a = SummaryAccumulator()
        a.update(p)
        accs.append(a)
    merged = SummaryAccumulator()
    for a in reversed(accs):
        before = (a.count, a.mean, a.m2)
        merged = merged.merge(a)
        assert (a.count, a.mean, a.m2) == before
    for s in (streamed.result(), merged.result()):
        assert s.count == x.size
        if x.size:
            assert s.min == x.min() and s.max == x.max()
            assert s.mean == pytest.approx(x.mean(), rel=1e-9, abs=1e-9)
            assert s.std == pytest.approx(x.std(), rel=1e-7, abs=1e-7)
        else:
            assert math.isnan(s.mean) and math.isnan(s.std)


def test_summary_large_mean_is_stable_and_skips_nonfinite() -> None:
    x = 1e9 + np.random.default_rng(4).standard_normal(50_000)
    acc = SummaryAccumulator()
    acc.update(np.append(x, [np.nan, -np.inf]))
    s = acc.result()
    assert acc.nonfinite == 2 and s.count == x.size
    assert s.std == pytest.approx(x.std(), rel=1e-6)
    assert s.mean == pytest.approx(x.mean(), rel=1e-15)


# --------------------------------------------------------------------------- grids and histograms


@pytest.mark.parametrize(
    ("scale", "zp", "qmin", "qmax"),
    [(0.02, 131, 0, 255), (0.05, 0, -128, 127), (0.1, 3, 0, 15)],
    ids=["uint8-asym", "int8-sym", "uint4"],
)
def test_grid_edges_centred_on_dequantized_levels(scale, zp, qmin, qmax) -> None:
    edges = grid_edges(scale, zp, qmin, qmax)
    assert edges.size == qmax - qmin + 2
    centers = (edges[:-1] + edges[1:]) / 2
    np.testing.assert_allclose(centers, (np.arange(qmin, qmax + 1) - zp) * scale, rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.diff(edges), scale, rtol=1e-9)


@pytest.mark.parametrize(("qmin", "qmax"), [(0, 65535), (-32768, 32767), (-32767, 32767), (0, 1000)])
@pytest.mark.parametrize("max_bins", [256, 100])
def test_grid_edges_grouping(qmin, qmax, max_bins) -> None:
    scale, zp = 1e-3, (qmin + qmax) // 2
    edges = grid_edges(scale, zp, qmin, qmax, max_bins)
    assert 1 <= edges.size - 1 <= max_bins
    levels_at_edges = edges / scale + zp + 0.5  # each edge sits on a level boundary
    np.testing.assert_allclose(levels_at_edges, np.round(levels_at_edges), atol=1e-6)
    assert levels_at_edges[0] == pytest.approx(qmin, abs=1e-6)
    assert levels_at_edges[-1] == pytest.approx(qmax + 1, abs=1e-6)
    assert np.all(np.diff(edges) > 0)


def test_grid_edges_for_quant_params() -> None:
    np.testing.assert_array_equal(
        grid_edges_for(QuantParams(scale=0.1, zero_point=-3, qtype="int8")), grid_edges(0.1, -3, -128, 127)
    )
    assert qtype_range("UINT16") == (0, 65535)
    with pytest.raises(ValueError, match="grid"):
        qtype_range("float8e4m3fn")


def test_grid_edges_rejects_bad_input() -> None:
    for args in [(0.0, 0, 0, 255), (float("nan"), 0, 0, 255), (0.1, 0, 5, 4)]:
        with pytest.raises(ValueError):
            grid_edges(*args)


def test_range_edges() -> None:
    e = range_edges(-1.0, 3.0, 8)
    np.testing.assert_allclose(e, np.linspace(-1, 3, 9))
    for v in (0.0, 7.5, -1e30):
        d = range_edges(v, v, 16)
        assert d.size == 17 and np.all(np.diff(d) > 0) and d[0] < v < d[-1]
    with pytest.raises(ValueError):
        range_edges(2.0, 1.0)
    with pytest.raises(ValueError):
        range_edges(0.0, math.inf)


def _reference_counts(edges: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.bincount(np.searchsorted(edges, x, side="right"), minlength=edges.size + 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "edges",
    [
        grid_edges(0.03, 128, 0, 255),
        grid_edges(1e-4, 0, -32767, 32767),
        np.array([-2.0, -0.5, 0.1, 0.2, 3.0]),
    ],
    ids=["uniform", "narrow-last", "non-uniform"],
)
def test_histogram_counts_match_searchsorted(edges, dtype) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(70_000) * 2).astype(dtype)  # > one histogram step, with overflow both sides
    y = (x * dtype(0.9)).astype(dtype)
    h = HistogramAccumulator(edges)
    h.update(x, y)
    # float64: exact at this size; float32 inputs are binned in float32 arithmetic, so a value within
    # ~1e-4 of a bin width from an edge may land in the neighbouring bin (a handful out of 70k)
    allowed = 0 if dtype == np.float64 else 20
    for counts, values in ((h.ref_counts, x), (h.cand_counts, y)):
        assert np.abs(counts - _reference_counts(edges, values)).sum() <= allowed
    assert h.ref_counts.sum() == x.size and h.cand_counts.sum() == x.size
    assert h.ref_counts[0] > 0 and h.ref_counts[-1] > 0


@PROPS
@given(_PAIRS, st.lists(st.integers(0, 120), max_size=4))
def test_histogram_counts_everything_and_streams(pair, cuts) -> None:
    ref, cand = pair
    edges = range_edges(-100.0, 100.0, 16)
    one = HistogramAccumulator(edges)
    one.update(ref, cand)
    assert one.ref_counts.sum() == ref.size and one.cand_counts.sum() == ref.size
    parts = [HistogramAccumulator(edges) for _ in _chunks(ref, cuts)]
    for h, r, c in zip(parts, _chunks(ref, cuts), _chunks(cand, cuts), strict=True):
        h.update(r, c)
    merged = parts[0]
    for h in parts[1:]:
        before = h.ref_counts.copy()
        merged = merged.merge(h)
        np.testing.assert_array_equal(h.ref_counts, before)
    np.testing.assert_array_equal(merged.ref_counts, one.ref_counts)
    np.testing.assert_array_equal(merged.cand_counts, one.cand_counts)


def test_histogram_nonfinite_and_record() -> None:
    edges = np.array([0.0, 1.0, 2.0])
    h = HistogramAccumulator(edges)
    h.update(np.array([-5, 0.5, 1.5, 9, np.nan, 1.0]), np.array([0.5, 0.5, 0.5, 0.5, 0.5, np.inf]))
    assert h.nonfinite == 2
    rec = h.result()
    assert rec.edges == (-math.inf, 0.0, 1.0, 2.0, math.inf)
    assert len(rec.edges) == len(rec.ref_counts) + 1
    assert rec.ref_counts == (1, 1, 1, 1) and rec.cand_counts == (0, 4, 0, 0)


def test_histogram_merge_needs_same_edges() -> None:
    with pytest.raises(ValueError, match="edges"):
        HistogramAccumulator([0.0, 1.0]).merge(HistogramAccumulator([0.0, 2.0]))
    with pytest.raises(ValueError):
        HistogramAccumulator([1.0, 1.0])


# --------------------------------------------------------------------------- KL


def test_kl_definition() -> None:
    assert kl_divergence([1, 2, 3], [1, 2, 3]) == 0.0
    assert kl_divergence([2, 4, 6], [1, 2, 3]) == 0.0
    assert math.isnan(kl_divergence([0, 0], [1, 1]))
    p = np.array([0.5, 0.5, 0.0]) + metrics.KL_EPS
    q = np.array([0.25, 0.25, 0.5]) + metrics.KL_EPS
    p, q = p / p.sum(), q / q.sum()
    assert kl_divergence([1, 1, 0], [1, 1, 2]) == pytest.approx(float(np.sum(p * np.log(p / q))))
    assert math.isfinite(kl_divergence([1, 0], [0, 1]))
    assert math.isnan(HistogramAccumulator([0.0, 1.0]).kl())


@pytest.mark.parametrize(("zp", "qmin", "qmax"), [(128, 0, 255), (0, -128, 127), (30000, 0, 65535)])
def test_kl_of_in_range_rounding_is_zero_but_clipping_is_not(zp, qmin, qmax) -> None:
    rng = np.random.default_rng(6)
    x = rng.standard_normal(100_000).astype(np.float32)
    # the whole data range is representable: rounding only, no clipping
    scale = float(np.abs(x).max()) / min(qmax - zp, zp - qmin) * 1.01
    acc = TensorErrorAccumulator(grid_edges(scale, zp, qmin, qmax))
    acc.update(x, _qdq(x, scale, zp, qmin, qmax))
    local = acc.result()
    assert local.kl < 1e-6
    assert math.isfinite(local.sqnr_db) and local.sqnr_db > 20

    tight = scale / 8  # the same grid shape, range 8x too small: heavy clipping
    clipped = TensorErrorAccumulator(grid_edges(tight, zp, qmin, qmax))
    clipped.update(x, _qdq(x, tight, zp, qmin, qmax))
    assert clipped.result().kl > 0.01


def test_naive_bins_would_penalise_rounding() -> None:
    """Why the bins are grid-aligned: uniform bins finer than the grid see rounding as a large KL."""
    x = np.random.default_rng(7).standard_normal(50_000)
    scale = 10 / 255  # covers +-5 sigma: no clipping
    y = _qdq(x, scale, 128, 0, 255)
    naive = HistogramAccumulator(range_edges(-5, 5, 1024))
    naive.update(x, y)
    aligned = HistogramAccumulator(grid_edges(scale, 128, 0, 255))
    aligned.update(x, y)
    assert aligned.kl() < 1e-6 < 0.1 < naive.kl()


def test_tensor_error_accumulator_merge_and_histogram() -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal(1000)
    y = x + 0.05 * rng.standard_normal(1000)
    edges = range_edges(-4, 4, 32)
    a, b, whole = TensorErrorAccumulator(edges), TensorErrorAccumulator(edges), TensorErrorAccumulator(edges)
    a.update(x[:300], y[:300])
    b.update(x[300:], y[300:])
    whole.update(x, y)
    m = b.merge(a)
    assert m.histogram_result() == whole.histogram_result()
    assert m.result().kl == whole.result().kl and m.result().count == 1000
    assert TensorErrorAccumulator().histogram_result() is None
    with pytest.raises(ValueError):
        a.merge(TensorErrorAccumulator())


def test_a_value_and_its_own_rounding_share_a_bin_at_ties() -> None:
    """0.5 at scale float32(1/255) is 127.49999 steps in float32: QuantizeLinear rounds it to 127, while the
    edge arithmetic (0.5 * 255 + 1.5) had put it in level 128's bin -- a local KL of 0.32 nats at 56 dB
    on the transformer fixture, whose inputs are multiples of 1/16. Binning by level agrees with ORT."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from qdebug.evaluation.metrics import grid_for

    x = (np.arange(17, dtype=np.float32) / 16).repeat(8)
    quant = QuantParams(scale=float(np.float32(1 / 255)), zero_point=0, qtype="uint8")
    graph = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.size])],
        [
            helper.make_tensor("s", TensorProto.FLOAT, [], [quant.scale]),
            helper.make_tensor("z", TensorProto.UINT8, [], [0]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rounded = session.run(None, {"x": x})[0]  # ORT's own rounding
    assert (rounded[x == 0.5] < 0.5).all(), "ORT rounds 0.5 down here: the case this test is about"
    by_level = HistogramAccumulator(grid_for(quant))
    by_level.update(x, rounded)
    np.testing.assert_array_equal(by_level.ref_counts, by_level.cand_counts)
    assert by_level.kl() == 0.0
    by_edges = HistogramAccumulator(grid_edges_for(quant))  # the edge arithmetic, for contrast
    by_edges.update(x, rounded)
    assert by_edges.kl() > 0.1


def test_level_bins_match_the_edges_away_from_ties() -> None:
    """Binning by level gives the edge binning's counts wherever no value sits on an edge, grouped 16-bit
    grids with a narrower last bin and both overflow bins included."""
    from qdebug.evaluation.metrics import QuantGrid

    rng = np.random.default_rng(5)
    for grid in (QuantGrid(0.02, 128, 0, 255), QuantGrid(0.01, -3, -128, 127), QuantGrid(1e-3, 0, 0, 999, 3)):
        levels = rng.integers(grid.qmin - 20, grid.qmax + 20, 4000)
        x = ((levels - grid.zero_point + rng.uniform(-0.45, 0.45, levels.size)) * grid.scale).astype(np.float32)
        by_level, by_edges = HistogramAccumulator(grid), HistogramAccumulator(grid.edges())
        by_level.update(x, x)
        by_edges.update(x, x)
        np.testing.assert_array_equal(by_level.ref_counts, by_edges.ref_counts)
        assert by_level.ref_counts[0] > 0 and by_level.ref_counts[-1] > 0


# ErrorAccumulator.add_sums (how the graph engine feeds in-ORT sums) had no direct test: keeping the last
# batch's max-abs instead of the largest passed tests/test_metrics.py.
def test_add_sums_per_batch_equals_update_per_batch():
    rng = np.random.default_rng(0)
    by_update, by_sums = ErrorAccumulator(), ErrorAccumulator()
    for scale in (3.0, 0.5, 1.0):  # the largest error comes in the first batch
        r = rng.normal(0, 1, 500)
        c = r + rng.normal(0, 0.05 * scale, 500)
        by_update.update(r, c)
        d = r - c
        by_sums.add_sums(float(r @ r), float(d @ d), float(c @ c), float(r @ c), float(np.abs(d).max()), r.size)
    a, b = by_update.result(), by_sums.result()
    assert b.count == a.count == 1500
    assert b.max_abs == pytest.approx(a.max_abs, rel=1e-12)
    assert b.sqnr_db == pytest.approx(a.sqnr_db, rel=1e-9)
    assert b.mse == pytest.approx(a.mse, rel=1e-9)
    assert b.cosine == pytest.approx(a.cosine, rel=1e-9)
