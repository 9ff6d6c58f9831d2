"""``verify --calib-add-flipped``: add the flipped samples to the calibration, from the cached ranges only.

The samples the static model gets wrong are often the ones whose activations left the calibrated ranges.
:func:`calib_add_flipped` runs those samples (the static model's flips, worst first, at most
:data:`MAX_ADDED`) through the FP32 model with every calibrated tensor exposed, widens each cached range to
hold their values (``[min(low, their min), max(high, their max)]``: what MinMax calibration over calibration
data + those samples gives, and for the other methods the cached result widened by them), rebuilds the
variants from the widened ranges -- ORT's quantizer adjusts them as it does the cached ones -- and scores
them again on the evaluation set.

The samples come from the evaluation set itself, so the recovery measured there is optimistic (an upper
bound): the note says so; to keep it, add such inputs to the calibration data and verify on held-out data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from qdebug.analysis.per_sample import one_sample
from qdebug.data import fixed_batch
from qdebug.evaluation.evaluate import Evaluator
from qdebug.evaluation.samples import flipped, sample_inputs
from qdebug.quant.calibrate import Ranges
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.records.samples import RecalibratedVariant, Recalibration, SampleSection
from qdebug.runtime.capture import SessionConfig, Tap

MAX_ADDED = 200
"""Flipped samples added at most (the worst first)."""

SHOWN = 5
"""Widened tensors named in the record (the most widened first)."""

LEAK_NOTE = (
    "the added samples are evaluation samples, so this recovery is measured on the data it was calibrated on "
    "(an upper bound): add such inputs to the calibration data and verify on held-out data"
)


def sample_ranges(
    fp32: onnx.ModelProto, names: Sequence[str], samples: Sequence, config: SessionConfig, batch: int = 1
) -> dict[str, tuple[float, float]]:
    """Per tensor of ``names``, the finite (lowest, highest) of its FP32 values over ``samples``
    (:class:`~qdebug.analysis.per_sample.SampleInput` s, each run on its own)."""
    inputs = {i.name for i in fp32.graph.input}
    graph_names = {o for n in fp32.graph.node for o in n.output} | inputs
    wanted = [n for n in names if n in graph_names]
    tap = Tap(fp32, wanted, config, what="instrumented FP32 model")
    out: dict[str, tuple[float, float]] = {}
    for sample in samples:
        feeds, _ = one_sample(sample, batch)
        values = tap.run(feeds)
        for name in wanted:
            v = values.get(name)
            if not isinstance(v, np.ndarray) or v.dtype.kind != "f":
                continue
            finite = v[np.isfinite(v)]
            if not finite.size:
                continue
            lo, hi = float(finite.min()), float(finite.max())
            old = out.get(name)
            out[name] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
    return out


def growth(ranges: Ranges, seen: Mapping[str, tuple[float, float]]) -> list[tuple[str, float, float, float, float]]:
    """The tensors of ``ranges`` whose range ``seen`` widens, ``(tensor, low, high, new low, new high)``, the
    most widened (relative to the old width) first: what :func:`widened` changes, without copying the ranges
    (``propose --allow calib-flipped`` turns it into per-tensor range overrides)."""
    grown = []
    for name, (lo, hi) in seen.items():
        if name not in ranges.tensors:
            continue
        td = ranges.tensors[name]
        wider = _wider(td, lo, hi)
        if wider is None:
            continue
        old_lo, old_hi = td.range_value
        low, high = float(np.min(old_lo)), float(np.max(old_hi))
        grown.append((name, low, high, float(np.min(wider[0])), float(np.max(wider[1]))))
    grown.sort(key=lambda g: -((g[4] - g[3]) - (g[2] - g[1])) / max(g[2] - g[1], 1e-30))  # relative growth
    return grown


def _wider(td: object, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray] | None:
    """``td``'s (low, high) widened to hold ``[lo, hi]``, in its own dtypes; None when that changes nothing."""
    old_lo, old_hi = td.range_value  # type: ignore[attr-defined]
    lo_type, hi_type = np.asarray(old_lo).dtype, np.asarray(old_hi).dtype
    new_lo = np.minimum(old_lo, np.asarray(lo, dtype=lo_type)).astype(lo_type)
    new_hi = np.maximum(old_hi, np.asarray(hi, dtype=hi_type)).astype(hi_type)
    if np.array_equal(new_lo, old_lo) and np.array_equal(new_hi, old_hi):
        return None
    return new_lo, new_hi


def widened(ranges: Ranges, seen: Mapping[str, tuple[float, float]]) -> tuple[Ranges, list[tuple]]:
    """``ranges`` with each tensor's range widened to hold ``seen``; and the widened tensors
    (:func:`growth`)."""
    tensors = ranges.private_tensors()
    for name, (lo, hi) in seen.items():
        wider = _wider(tensors[name], lo, hi) if name in tensors else None
        if wider is not None:
            tensors[name].lowest, tensors[name].highest = wider
    # the key names these ranges: a model built from them must never be mistaken for the cached one's
    key = ranges.key + "+flipped"
    rebuilt = dataclasses.replace(ranges, tensors=tensors, key=key, cache_path=None, from_cache=False)
    return rebuilt, growth(ranges, seen)


def calib_add_flipped(
    evaluator: Evaluator,
    section: SampleSection,
    fp32: onnx.ModelProto,
    ranges: Ranges,
    specs: Sequence[tuple[str, QuantSpec, float]],
    config: SessionConfig,
    *,
    limit: int = MAX_ADDED,
) -> Recalibration | None:
    """The static model's flipped samples added to the calibration ranges; ``specs`` (variant name, its
    spec, its metric from the cached ranges) rebuilt from them and scored again. None when nothing flipped
    or the samples cannot be found again in the data."""
    try:
        static = section.variant("static")
    except KeyError:
        return None
    if not static.flipped:
        return None
    added = [f.index for f in static.flips[:limit]]
    _, inputs = sample_inputs(evaluator, None, set(added), [])
    found = [inputs[i] for i in added if i in inputs]
    if not found:
        return None
    seen = sample_ranges(fp32, list(ranges.tensors.keys()), found, config, fixed_batch(evaluator.data.specs))
    rebuilt, grown = widened(ranges, seen)
    fp32_results = np.asarray(section.fp32, dtype=np.float64)
    labels = np.asarray(section.labels) if section.labels is not None else None
    out = []
    for name, spec, before in specs:
        model = quantize_static_model(fp32, rebuilt, spec)
        result = evaluator.score(model, what=f"{name} model from the widened ranges")
        res = evaluator.sample_results(result)
        after_flips = set()
        if res is not None and res.kind == section.kind:
            sqnr = np.full(res.values.size, np.nan)
            after_flips = set(flipped(section.kind, fp32_results, res.values, labels, sqnr))
        try:
            flipped_before = section.variant(name).flipped
        except KeyError:
            flipped_before = 0
        recovered = sum(1 for i in added if i not in after_flips)
        out.append(RecalibratedVariant(name, before, result.value, flipped_before, len(after_flips), recovered))
    note = LEAK_NOTE
    if len(found) < len(added):
        note += f"; {len(added) - len(found)} flipped samples could not be found again in the data"
    if not math.isfinite(sum(v.after for v in out)):
        note += "; a metric without a finite value"
    return Recalibration(len(found), len(grown), tuple(grown[:SHOWN]), tuple(out), note)
