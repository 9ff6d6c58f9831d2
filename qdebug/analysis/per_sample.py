"""The per-sample drill-down's second pass: a few flipped samples, each on its own, through both models.

The capture (:mod:`.measure`) sums every tensor's error over all samples; a flipped sample needs its own
numbers. :func:`sample_tensors` runs each chosen sample alone through the FP32 model and the quantized
model with every paired tensor as an extra output (the :class:`~qdebug.runtime.capture.Tap` sessions the numpy
engine uses) and measures, per tensor, the accumulated SQNR of that sample (:class:`ErrorAccumulator`),
the noise each node adds for it (:func:`~.build.added_noise_by_output` over those SQNRs, as the report's nodes
are built) and its clip rate: the share of its FP32 values that the tensor's Q/DQ cannot represent (they fall
outside the calibrated range). Only a handful of samples run, one at a time, so memory stays at one
sample's tensors.

A model with a fixed batch dimension B takes only batches of B: the sample then runs as B copies of itself
(the statistics of B equal copies are the sample's own).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qdebug.analysis.build import added_noise_by_output, node_depths
from qdebug.analysis.graph_engine import OptimizedSides
from qdebug.analysis.measure import data_dependent_shapes
from qdebug.analysis.numpy_engine import local_fake_quant, quant_params
from qdebug.data import Axes, join_rows, take_rows
from qdebug.evaluation.evaluate import worst_output_sqnr
from qdebug.evaluation.metrics import ErrorAccumulator
from qdebug.graph.match import GraphIndex, Pairing, TensorPair
from qdebug.graph.reduce import FakeQuant
from qdebug.records import TensorRecord
from qdebug.runtime.capture import SessionConfig, Tap, make_session, run_session


@dataclass(frozen=True)
class SampleInput:
    """One sample to measure: its global index and its feeds, cut out of its batch (:func:`cut`)."""

    index: int
    feeds: Mapping[str, np.ndarray]
    axes: Axes
    """Each input's batch axis (None: fed whole, as in the batch)."""
    whole: bool = False
    """The feeds are a whole batch of one sample (nothing was cut: it is fed as it came)."""


def cut(index: int, feeds: Mapping[str, np.ndarray], row: int, size: int, axes: Axes) -> SampleInput:
    """Sample ``row`` of a batch of ``size`` (each input cut on its batch axis): only that sample is kept."""
    if size == 1:
        return SampleInput(index, dict(feeds), dict(axes), whole=True)
    return SampleInput(index, take_rows(feeds, row, row + 1, axes), dict(axes))


@dataclass(frozen=True)
class SampleTensors:
    """One sample's numbers, one entry per tensor of :attr:`TensorLayout.names`."""

    index: int
    sqnr_db: tuple[float, ...]
    added_noise_db: tuple[float, ...]
    clip_rate: tuple[float, ...]
    output_sqnr_db: float
    copies: int


@dataclass(frozen=True)
class TensorLayout:
    """The tensors measured, in topological order, with their producer and depth."""

    names: tuple[str, ...]
    nodes: tuple[str, ...]
    depths: tuple[int, ...]


def measured_pairs(fp32: onnx.ModelProto, pairing: Pairing) -> list[TensorPair]:
    """The pairs a sample can be compared on: both models have the tensor, and its shape does not depend on
    the data (after NonZero the models may keep other elements)."""
    shaped = data_dependent_shapes(fp32)
    return [p for p in pairing.tensors if p.qdq is not None and p.fp32 not in shaped]


def layout(
    fp32: onnx.ModelProto, pairs: Sequence[TensorPair], graph: tuple[GraphIndex, dict[str, int]] | None = None
) -> TensorLayout:
    """Names, producers and depths of ``pairs``' FP32 tensors (``graph``: ``fp32``'s index and node depths,
    when the caller has them)."""
    index, depth = graph if graph is not None else (GraphIndex(fp32), node_depths(fp32))
    nodes, depths = [], []
    for p in pairs:
        producer = index.producer.get(p.fp32)
        nodes.append(producer.name if producer is not None else "")
        depths.append(depth.get(producer.name, 0) if producer is not None else 0)
    return TensorLayout(tuple(p.fp32 for p in pairs), tuple(nodes), tuple(depths))


def one_sample(sample: SampleInput, fixed_batch: int) -> tuple[dict[str, np.ndarray], int]:
    """The sample's feeds, as ``fixed_batch`` copies of itself when the model's batch dimension is fixed; and
    the copies."""
    if fixed_batch > 1 and not sample.whole:
        return join_rows([sample.feeds] * fixed_batch, sample.axes), fixed_batch
    return dict(sample.feeds), 1


def sample_tensors(
    fp32: onnx.ModelProto,
    quantized: onnx.ModelProto,
    pairing: Pairing,
    samples: Sequence[SampleInput],
    config: SessionConfig,
    *,
    fixed_batch: int = 1,
    sides: OptimizedSides | None = None,
    aliases: Mapping[str, str] | None = None,
) -> tuple[TensorLayout, list[SampleTensors]]:
    """Each of ``samples`` through both models on its own: per tensor its SQNR, the noise its producer
    adds and its clip rate (see the module docstring).

    ``sides`` (the capture's optimized sides, :class:`~.graph_engine.OptimizedSides`) with the capture's
    ``aliases``: the samples run through those files, opened as they are, instead of both models optimized
    again with every tensor as an output -- the values the capture measured, and one start-up of an
    optimized QDQ model fewer; a tensor the capture measured as an alias of another (a Reshape's output)
    takes that one's numbers, as in the report. Without them, or when they lack a tensor the capture
    measured, :class:`~qdebug.runtime.capture.Tap` sessions over both models."""
    pairs = measured_pairs(fp32, pairing)
    graph = (GraphIndex(fp32), node_depths(fp32))  # once, not per sample: each is a walk of the whole graph
    shape = layout(fp32, pairs, graph)
    if not samples or not pairs:
        return shape, []
    fq = local_fake_quant(quantized, pairs)
    fp_tap: Tap | _SideRun
    q_tap: Tap | _SideRun
    read = _read_from_sides(pairs, sides, aliases or {}, pairing) if sides is not None else None
    if sides is not None and read is not None:
        fp_tap = _SideRun(sides.fp32, fp32, config, "FP32 model")
        q_tap = _SideRun(sides.qdq, fp32, config, "quantized model")
    else:
        read = {p.fp32: (p.fp32, str(p.dequant or p.qdq)) for p in pairs}
        fp_tap = Tap(fp32, [p.fp32 for p in pairs], config, what="instrumented FP32 model")
        q_tap = Tap(quantized, [p.dequant or p.qdq for p in pairs], config, what="instrumented quantized model")
    outputs = fp_tap.graph_outputs
    out = []
    for sample in samples:
        feeds, copies = one_sample(sample, fixed_batch)
        ref, cand = fp_tap.run(feeds), q_tap.run(feeds)
        stats, clipping = {}, []
        for p in pairs:
            r_name, c_name = read.get(p.fp32, ("", ""))  # "": not measured, its numbers nan
            r, c = ref.get(r_name), cand.get(c_name)
            ok = isinstance(r, np.ndarray) and isinstance(c, np.ndarray) and r.dtype.kind == "f"
            if ok and r.shape == c.shape:
                acc = ErrorAccumulator()
                acc.update(r, c)
                stats[p.fp32] = acc.result()
            quant = fq.get(r_name)
            clipping.append((r, quant) if ok and quant is not None else None)
        clip = clip_rates(clipping)
        sqnr = tuple(stats[p.fp32].sqnr_db if p.fp32 in stats else math.nan for p in pairs)
        added = _added_noise(fp32, pairs, stats, graph)
        output_sqnr = worst_output_sqnr([ref], [cand], outputs)
        out.append(SampleTensors(sample.index, sqnr, added, tuple(clip), output_sqnr, copies))
        del ref, cand
    return shape, out


class _SideRun:
    """A capture side's optimized file run as it is (graph optimizations off): graph inputs among the
    tensors asked for are served from the feeds, as :class:`~qdebug.runtime.capture.Tap` serves them."""

    def __init__(self, path: Path, fp32: onnx.ModelProto, config: SessionConfig, what: str) -> None:
        self.session = make_session(
            path, config, optimize=False, what=f"{what} as the capture optimized it", arena=False, mem_pattern=False
        )
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.graph_outputs = [o.name for o in fp32.graph.output]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**feeds, **run_session(self.session, self.output_names, feeds)}


def _read_from_sides(
    pairs: Sequence[TensorPair], sides: OptimizedSides, aliases: Mapping[str, str], pairing: Pairing
) -> dict[str, tuple[str, str]] | None:
    """Per pair's FP32 tensor, the (FP32, quantized) tensors of ``sides`` its numbers are read from: its own,
    or its alias source's. A pair the capture did not measure (not a float tensor...) reads nothing (its
    numbers are nan, as they are from the Taps). None when ``sides`` lacks a tensor the capture measured."""
    by_fp32 = {p.fp32: p for p in pairing.tensors}
    read: dict[str, tuple[str, str]] = {}
    for p in pairs:
        source = by_fp32.get(aliases.get(p.fp32, p.fp32))
        if source is None or source.qdq is None:
            return None
        r_name, c_name = source.fp32, source.dequant or source.qdq
        if r_name not in sides.fp32_names:
            continue  # not measured by the capture
        if c_name not in sides.qdq_names:
            return None
        read[p.fp32] = (r_name, c_name)
    return read


def _added_noise(
    fp32: onnx.ModelProto, pairs: Sequence[TensorPair], stats: dict, graph: tuple[GraphIndex, dict[str, int]]
) -> tuple[float, ...]:
    """Per tensor, the noise its producer adds for this sample: :func:`added_noise_by_output` over the sample's
    accumulated SQNRs, exactly as the report's ``added_noise_db`` is derived from all samples' ones
    (``graph``: ``fp32``'s index and node depths, built once for every sample)."""
    records = tuple(
        TensorRecord(p.fp32, None, (), 0, None, None, None, stats[p.fp32], None) for p in pairs if p.fp32 in stats
    )
    by_output = added_noise_by_output(fp32, records, graph[0])
    return tuple(by_output.get(p.fp32, math.nan) for p in pairs)


CLIP_CHUNK = 1 << 22
"""Values :func:`clip_rates` quantizes at once (16 MB of float32): tensors are joined up to this many."""


def clip_rates(items: Sequence[tuple[np.ndarray, FakeQuant] | None]) -> list[float]:
    """:func:`clip_rate` of each ``(x, fq)`` (nan for None), the same numbers, with the per-tensor ones done
    in bulk: a flipped sample of a 3,200-node graph has 2,800 small tensors, and one call per tensor was a fifth
    of the drill-down. Tensors with one scale and zero point of the same type are joined (up to
    :data:`CLIP_CHUNK` values), quantized in one pass -- each value with its own tensor's scale and zero point,
    the same float32 operations -- and their saturated and non-NaN values counted per tensor; the counts are
    integers, so the shares are :func:`clip_rate`'s exactly."""
    out = [math.nan] * len(items)
    groups: dict[np.dtype, list[int]] = {}
    for k, item in enumerate(items):
        if item is None:
            continue
        x, fq = item
        if np.size(fq.scale) == 1 and np.size(x) and (fq.zero_point is None or np.size(fq.zero_point) == 1):
            zp = np.asarray(fq.zero_point) if fq.zero_point is not None else np.zeros((), np.uint8)
            groups.setdefault(zp.dtype, []).append(k)
        else:
            out[k] = clip_rate(x, fq)
    for dtype, ks in groups.items():
        start = 0
        while start < len(ks):
            stop, size = start, 0
            while stop < len(ks) and (stop == start or size + np.size(items[ks[stop]][0]) <= CLIP_CHUNK):
                size += np.size(items[ks[stop]][0])
                stop += 1
            _clip_chunk(items, ks[start:stop], np.iinfo(dtype), out)
            start = stop
    return out


def _clip_chunk(items: Sequence[Any], ks: Sequence[int], info: np.iinfo, out: list[float]) -> None:
    """:func:`clip_rates` of the per-tensor items ``ks``, whose zero points share the integer type ``info``."""
    xs = [np.asarray(items[k][0], dtype=np.float32).ravel() for k in ks]
    lengths = np.array([x.size for x in xs])
    scales = np.array([np.asarray(items[k][1].scale, dtype=np.float32).reshape(()) for k in ks], dtype=np.float32)
    zps = np.array(
        [0 if items[k][1].zero_point is None else np.asarray(items[k][1].zero_point).reshape(()) for k in ks]
    ).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.rint(np.concatenate(xs) / np.repeat(scales, lengths)) + np.repeat(zps, lengths)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    seen = np.add.reduceat(~np.isnan(q), starts, dtype=np.int64)
    clipped = np.add.reduceat((q < info.min) | (q > info.max), starts, dtype=np.int64)
    for k, total, c in zip(ks, seen.tolist(), clipped.tolist(), strict=True):
        out[k] = float(c) / total if total else math.nan


def clip_rate(x: np.ndarray, fq: FakeQuant) -> float:
    """Share of ``x``'s values that QuantizeLinear with ``fq`` saturates (they lie beyond the range its
    levels represent), among the non-NaN ones; computed as :func:`~.numpy_engine.fake_quantize` rounds."""
    x32, scale, zp = quant_params(x, fq)
    info = np.iinfo(zp.dtype)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = np.rint(x32 / scale) + zp.astype(np.float32)
    seen = ~np.isnan(q)
    total = int(seen.sum())
    if not total:
        return math.nan
    return float(((q < info.min) | (q > info.max)).sum()) / total
