"""The per-sample drill-down: which evaluation samples flip, and why (``Report.per_sample``,
``VerifyResult.per_sample``).

:func:`per_sample_section` reads every variant's task result per evaluation sample off the
:class:`~qdebug.evaluation.evaluate.Evaluator` (:meth:`~qdebug.evaluation.evaluate.Evaluator.sample_results`), lists
the samples whose result flips against FP32's (the rule per kind of result: :mod:`qdebug.records.samples`), finds each
one's input (global index, the batch's origin and the row in it), and runs the worst few again on their own
through the FP32 and one quantized model with every paired tensor exposed
(:func:`qdebug.analysis.per_sample.sample_tensors`): per tensor, that sample's SQNR, the noise each node
adds for it, and its clip rate against the calibrated ranges.

analyze computes it on the data it scores its task metric on (the evaluation data, else the calibration
data the capture ran on) for the static model; verify on its evaluation data for the static and the
selective model, measuring the selective model's remaining flips.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from qdebug.analysis.graph_engine import OptimizedSides
from qdebug.analysis.per_sample import SampleInput, cut, sample_tensors
from qdebug.data import Batch, fixed_batch
from qdebug.errors import QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator, SampleResults
from qdebug.graph.match import Pairing
from qdebug.records.samples import (
    EFFECT_ORDER,
    SAMPLES_VERSION,
    VALUE_WORST_SHARE,
    SampleDetail,
    SampleFlip,
    SampleSection,
    VariantSamples,
)
from qdebug.runtime.capture import SessionConfig

DEFAULT_FLIP_DETAILS = 20
"""Flipped samples measured tensor by tensor (``--flip-details``): the worst ones, each run on its own."""

LISTED = 200
"""Flips listed per variant in the file (all of them are counted, and readable off the results)."""

RULES = {
    "class": "the predicted class differs from FP32's{labels}",
    "hit": "the sample's non-float outputs no longer all equal FP32's",
    "value": (
        f"no result flips: the worst {100 * VALUE_WORST_SHARE:g}% of the samples (at least one) by their drop "
        "below FP32's own per-sample value, among those that dropped"
    ),
}


@dataclass(frozen=True)
class DetailTarget:
    """The quantized model whose flips are measured tensor by tensor, paired with the FP32 model."""

    variant: str
    model: onnx.ModelProto
    pairing: Pairing
    sides: OptimizedSides | None = None
    """The capture's optimized sides, when it kept them (the samples then run through those)."""
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The capture's alias tensors (name -> the tensor whose statistics it shares)."""


def per_sample_section(
    evaluator: Evaluator,
    variants: Sequence[tuple[str, EvalResult]],
    fp32: onnx.ModelProto,
    config: SessionConfig,
    *,
    data: str = "eval",
    batches: Iterable[Batch] | None = None,
    target: DetailTarget | None = None,
    details: int = DEFAULT_FLIP_DETAILS,
    notes: list[str] | None = None,
) -> SampleSection | None:
    """Per-sample results of FP32 and ``variants`` (name, result), their flips, and the worst flips of
    ``target`` measured tensor by tensor (at most ``details``; 0: none).

    ``batches``: the evaluation batches, for an evaluator built from outputs (no batches of its own: analyze
    without evaluation data re-reads its calibration data). ``data``: ``eval`` or ``calib``. None, with a
    note in ``notes``, when the metric gives nothing per sample -- or when the drill-down fails (a custom
    metric's ``per_sample`` that does not add up, ORT refusing the instrumented model): it must not fail the
    command it adds to.
    """
    notes = notes if notes is not None else []
    try:
        return _section(evaluator, variants, fp32, config, data, batches, target, details, notes)
    except QDebugError as e:
        notes.append(f"per-sample drill-down skipped: {e.one_line()}")
        return None


def _section(
    evaluator: Evaluator,
    variants: Sequence[tuple[str, EvalResult]],
    fp32: onnx.ModelProto,
    config: SessionConfig,
    data: str,
    batches: Iterable[Batch] | None,
    target: DetailTarget | None,
    details: int,
    notes: list[str],
) -> SampleSection | None:
    """The body of :func:`per_sample_section`."""
    reference = evaluator.sample_results(None)
    if reference is None:
        notes.append(
            f"per-sample drill-down skipped: metric {evaluator.metric_name} gives no result per sample (a "
            "custom metric needs a per_sample form; an output without a batch axis has none)"
        )
        return None
    labels = _labels(evaluator)
    columns: list[tuple[str, SampleResults, np.ndarray, list[int]]] = []
    for name, result in variants:
        res = evaluator.sample_results(result)
        if res is None or res.kind != reference.kind or res.values.shape != reference.values.shape:
            continue
        sqnr = _output_sqnr(evaluator, result)
        columns.append((name, res, sqnr, flipped(reference.kind, reference.values, res.values, labels, sqnr)))
    if not columns:
        return None
    wanted: list[int] = []
    if target is not None and details > 0:
        order = next((f for n, _, _, f in columns if n == target.variant), [])
        wanted = order[:details]
    origins, inputs = sample_inputs(evaluator, batches, set(wanted), notes)
    section_notes: list[str] = []
    variant_records = []
    for name, res, sqnr, order in columns:
        flips = tuple(_flip(i, reference, res, labels, sqnr, origins) for i in order[:LISTED])
        variant_records.append(VariantSamples(name, _plain(res), len(order), flips))
    detail_records: tuple[SampleDetail, ...] = ()
    tensors: tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]] = ((), (), ())
    if target is not None and wanted:
        if len(inputs) < len(wanted):
            section_notes.append("some flipped samples could not be found again in the data: not measured")
        spec_batch = fixed_batch(evaluator.data.specs)
        shape, measured = sample_tensors(
            fp32,
            target.model,
            target.pairing,
            [inputs[i] for i in wanted if i in inputs],
            config,
            fixed_batch=spec_batch,
            sides=target.sides,
            aliases=target.aliases,
        )
        tensors = (shape.names, shape.nodes, shape.depths)
        detail_records = tuple(
            SampleDetail(m.index, target.variant, m.sqnr_db, m.added_noise_db, m.clip_rate, m.output_sqnr_db, m.copies)
            for m in measured
        )
        if spec_batch > 1:
            section_notes.append(
                f"the model's batch dimension is fixed at {spec_batch}: each measured sample ran as {spec_batch} "
                "copies of itself"
            )
    rule = RULES[reference.kind].format(
        labels=" (with labels: lost = FP32 right -> wrong, gained = wrong -> right, changed = wrong -> another "
        "wrong class)"
        if labels is not None
        else ""
    )
    return SampleSection(
        version=SAMPLES_VERSION,
        metric=evaluator.metric_name,
        kind=reference.kind,
        data=data,
        samples=int(reference.values.size),
        rule=rule,
        fp32=_plain(reference),
        labels=tuple(int(x) for x in labels) if labels is not None else None,
        variants=tuple(variant_records),
        listed=LISTED,
        tensors=tensors[0],
        tensor_nodes=tensors[1],
        tensor_depths=tensors[2],
        details=detail_records,
        detail_variant=target.variant if target is not None and detail_records else "",
        notes=tuple(section_notes),
    )


def flipped(
    kind: str, fp32: np.ndarray, values: np.ndarray, labels: np.ndarray | None, output_sqnr: np.ndarray
) -> list[int]:
    """The flipped samples' indices, worst first (the rule of :mod:`qdebug.records.samples`)."""
    n = fp32.size
    sqnr_key = np.where(np.isnan(output_sqnr), np.inf, output_sqnr)
    if kind == "value":
        drop = np.where(np.isnan(values), np.inf, fp32 - values)  # a nan result counts as the worst
        dropped = np.flatnonzero(drop > 0)
        k = max(1, math.ceil(VALUE_WORST_SHARE * n))
        ranked = sorted(dropped.tolist(), key=lambda i: (-drop[i], i))
        return ranked[:k]
    changed = np.flatnonzero(fp32 != values)
    effects = [_effect(kind, fp32[i], values[i], labels[i] if labels is not None else None) for i in changed]
    keyed = sorted(
        zip(changed.tolist(), effects, strict=True),
        key=lambda t: (EFFECT_ORDER.get(t[1], 9), sqnr_key[t[0]], t[0]),
    )
    return [i for i, _ in keyed]


def _effect(kind: str, fp32: float, value: float, label: int | None) -> str:
    if kind == "hit":
        return "lost"
    if kind == "value":
        return "worse"
    if label is None:
        return "changed"
    if fp32 == label:
        return "lost"
    return "gained" if value == label else "changed"


def _labels(evaluator: Evaluator) -> np.ndarray | None:
    """One label per sample for top1 (the labels are class indices only there)."""
    if evaluator.metric_name != "top1" or evaluator.labels is None:
        return None
    flat = np.concatenate([np.asarray(lab).reshape(-1) for lab in evaluator.labels])
    return flat.astype(np.int64) if flat.size == evaluator.samples else None


def _output_sqnr(evaluator: Evaluator, result: EvalResult) -> np.ndarray:
    """Each sample's worst float output SQNR against FP32 (dB; nan when the outputs have no batch axis)."""
    values = evaluator.sqnr_values(result)
    if values is None or values.units != evaluator.samples or not values.signal.shape[0]:
        return np.full(evaluator.samples, np.nan)
    return values.resampled(np.arange(values.units).reshape(-1, 1))  # one draw per sample: its own SQNR


def _plain(res: SampleResults) -> tuple[float, ...]:
    """The results as the record holds them: floats (a class index too), as the file reads back."""
    return tuple(float(x) for x in res.values.tolist())


def _flip(
    index: int,
    reference: SampleResults,
    res: SampleResults,
    labels: np.ndarray | None,
    sqnr: np.ndarray,
    origins: list[tuple[str, int]],
) -> SampleFlip:
    f, v = reference.values[index], res.values[index]
    label = int(labels[index]) if labels is not None else None
    origin, row = origins[index] if index < len(origins) else ("", index)
    return SampleFlip(
        index=index,
        origin=origin,
        row=row,
        label=label,
        fp32=float(f),
        result=float(v),
        effect=_effect(reference.kind, f, v, label),
        output_sqnr_db=float(sqnr[index]),
    )


def sample_inputs(
    evaluator: Evaluator, batches: Iterable[Batch] | None, wanted: set[int], notes: list[str]
) -> tuple[list[tuple[str, int]], dict[int, SampleInput]]:
    """One pass over the evaluation batches: (origin, row) of every sample, and the batch of each ``wanted``
    one. The evaluator's own batches when it holds them, else ``batches``."""
    source = evaluator.batches if evaluator.batches else batches
    origins: list[tuple[str, int]] = []
    inputs: dict[int, SampleInput] = {}
    if source is None:
        return origins, inputs
    start = 0
    sizes = list(evaluator.sizes)
    for k, batch in enumerate(source):
        if k < len(sizes) and batch.size != sizes[k]:
            notes.append(
                "per-sample drill-down: the data gave other batches than the evaluation saw (a hook that yields "
                "other samples on each call?): the flipped samples' inputs were not measured"
            )
            return origins[:start], {}
        origins.extend((batch.origin, r) for r in range(batch.size))
        for i in range(start, start + batch.size):
            if i in wanted:
                inputs[i] = cut(i, batch.feeds, i - start, batch.size, batch.axes)
        start += batch.size
        del batch
    return origins, inputs
