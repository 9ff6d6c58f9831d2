"""Task metric of a candidate model against the FP32 model, on un-instrumented sessions.

The FP32 reference outputs are computed once and kept (model outputs are
small next to activations), so ``propose`` can score many candidates for the
cost of one candidate pass each.

Metrics (higher is better):

* ``top1`` -- accuracy of argmax(first output) vs the data's ``labels``; a first
  output that already holds class indices (an integer ``[batch]`` tensor, from an
  ArgMax inside the model) is compared with the labels as it is;
* ``top1_agreement`` -- share of samples whose predicted class (argmax, or the
  model's own class index) matches FP32's (no labels);
* ``exact_match`` -- share of samples whose non-float outputs (integers, bool,
  strings) all equal FP32's (the default when no output is float and the first
  is not one class index per sample: token ids, strings);
* ``output_sqnr_db`` -- SQNR vs FP32 of the worst float output (each output over all its samples);
* ``module:function`` -- ``function(reference, candidate, labels) -> float``
  where reference/candidate are lists (one per batch) of dicts output -> array.

:meth:`Evaluator.sample_values` splits a scored value over its evaluation units, for the paired bootstrap
of :mod:`qdebug.evaluation.noise`: per-sample hits for ``top1`` and ``exact_match``; per-prediction agreement for
``top1_agreement`` (one unit per sample, or one per batch whose predictions are positions of one sample);
per-sample signal and noise energies of every float output for ``output_sqnr_db`` (a resample's SQNR is
that of its summed energies). A custom metric function may carry an optional per-sample form,
``function.per_sample(reference, candidate, labels) -> list[float]``, one value per sample whose mean is
the metric; without it the hook itself is re-called on resampled lists of evaluation batches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from qdebug.data import DataSet, load_hook, output_batch_axes
from qdebug.data.rows import Batch
from qdebug.data.store import ArrayStore
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.metrics import ErrorAccumulator
from qdebug.evaluation.noise import DEFAULT_CONFIDENCE, HOOK_RESAMPLES, RESAMPLES, bootstrap, interval
from qdebug.output.formatting import ACCURACY_METRICS
from qdebug.records import SQNR_CAP_DB, OutputMetric
from qdebug.runtime.capture import SessionConfig, make_session, run_session

BUILTIN = ("top1", "top1_agreement", "exact_match", "output_sqnr_db")


def _check_hook_form(metric: str) -> None:
    """Refuse a metric that is neither built in nor a hook, naming both forms: a misspelled or guessed name
    (``top5``) had been read as a malformed hook ("is not module:function"), which said nothing of the metrics
    qdebug has."""
    module, _, func = metric.rpartition(":")
    if not module or not func:
        raise QDebugError(
            f"unknown metric {metric!r}: the built-in metrics are auto, {', '.join(BUILTIN)}",
            "pass one of them, or your own as package.module:function or path/to/file.py:function",
            ExitCode.USAGE,
        )


@dataclass(frozen=True)
class EvalResult:
    """Score of one candidate model."""

    metric: str
    value: float
    fp32_value: float
    outputs: tuple[OutputMetric, ...]
    samples: int
    seconds: float
    values: RatioValues | SqnrValues | None = field(default=None, compare=False, repr=False)
    """The metric split over its evaluation units (:meth:`Evaluator.sample_values`), kept in place of the
    outputs: per-sample numbers, so a result's size does not grow with the outputs' (None: a custom metric,
    whose split is asked of its hook on demand)."""
    sqnr: SqnrValues | None = field(default=None, compare=False, repr=False)
    """The float outputs' per-unit energies (``--target-sqnr``'s gate), whatever the metric."""
    classes: np.ndarray | None = field(default=None, compare=False, repr=False)
    """The predicted class per sample (top1, top1_agreement with one prediction per sample)."""
    kept: Sequence[dict[str, np.ndarray]] | None = field(default=None, compare=False, repr=False)
    """A custom metric's view of the outputs (one dict per batch, in a store): its hook reads them all."""
    accumulators: tuple[ErrorAccumulator, ...] = field(default=(), compare=False, repr=False)
    """The outputs' raw error sums (in ``outputs`` order), so results on shards of the set merge exactly."""

    @property
    def output_sqnr_db(self) -> float:
        """Worst SQNR over the model outputs."""
        vals = [o.error.sqnr_db for o in self.outputs if not math.isnan(o.error.sqnr_db)]
        return min(vals) if vals else math.nan


def _classifier_shaped(arr: np.ndarray) -> bool:
    return arr.ndim == 2 and arr.shape[1] > 1 and arr.dtype.kind == "f"


def _class_indices(arr: np.ndarray, rows: int) -> bool:
    """An output that already holds one predicted class per sample (``[batch]`` or ``[batch, 1]`` integers)."""
    return arr.dtype.kind in "iu" and arr.shape in ((rows,), (rows, 1))


def _predicted(arr: np.ndarray, indices: bool) -> np.ndarray:
    """One class per sample: the indices the model already computed, or the argmax of its scores."""
    return arr.reshape(-1) if indices else np.argmax(arr, axis=1)


def _exact_kind(arr: np.ndarray) -> bool:
    """Outputs compared for equality by ``exact_match``: anything but float (integers, bool, strings)."""
    return arr.dtype.kind not in "fc"


def _rows(outputs: dict[str, np.ndarray]) -> int:
    """A batch's sample count read off its outputs (axis 0 of the first non-scalar one)."""
    return next((a.shape[0] for a in outputs.values() if a.ndim >= 1), 1)


def _exact_rows(
    ref: dict[str, np.ndarray],
    cand: dict[str, np.ndarray],
    names: list[str],
    rows: int,
    axes: Mapping[str, int] | None = None,
) -> int:
    """How many of a batch's ``rows`` samples have every non-float output equal to FP32's (:func:`_exact_match`)."""
    return int(_exact_match(ref, cand, names, rows, axes).sum())


def _exact_match(
    ref: dict[str, np.ndarray],
    cand: dict[str, np.ndarray],
    names: list[str],
    rows: int,
    axes: Mapping[str, int] | None = None,
) -> np.ndarray:
    """Which of a batch's ``rows`` samples have every non-float output equal to FP32's (``[rows]`` bool).

    Outputs are compared sample by sample on their batch axis (``axes``, axis 0 for an output it lacks;
    a new state ``[2, batch, 128]`` has it on axis 1) when it holds the batch in both models; an output
    whose shape differs between the models, or has no such axis (NonZero's indices), makes the whole
    batch count as matching only when it is equal as a whole.
    """
    match = np.ones(rows, dtype=bool)
    for k in names:
        r, c = ref[k], cand[k]
        axis = (axes or {}).get(k, 0)
        if r.shape == c.shape and r.ndim > axis and r.shape[axis] == rows:
            match &= np.moveaxis(r == c, axis, 0).reshape(rows, -1).all(axis=1)
        elif not (r.shape == c.shape and np.array_equal(r, c)):
            match[:] = False
    return match


@dataclass(frozen=True, eq=False)
class RatioValues:
    """A share split over its units: the metric is ``sum(hits) / sum(counts)`` (top1, exact_match: one
    count per sample; top1_agreement: one per prediction; a custom metric's per-sample form: its values,
    counts 1)."""

    hits: np.ndarray
    counts: np.ndarray
    resamples: int = RESAMPLES

    @property
    def units(self) -> int:
        """Units resampled (samples; batches for predictions that are positions of one sample)."""
        return int(self.hits.size)

    @property
    def binary(self) -> bool:
        """One hit or none per unit (McNemar's test applies)."""
        return bool(np.all(self.counts == 1) and np.all((self.hits == 0) | (self.hits == 1)))

    def value(self) -> float:
        """The metric over every unit."""
        total = float(self.counts.sum())
        return float(self.hits.sum()) / total if total else math.nan

    def resampled(self, draws: np.ndarray) -> np.ndarray:
        """The metric on each row of unit indices."""
        num, den = self.hits[draws].sum(axis=1), self.counts[draws].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


@dataclass(frozen=True, eq=False)
class SqnrValues:
    """The worst float output's SQNR split over units: ``signal`` and ``noise`` energies ``[outputs, units]``
    (0 where an output is not compared), so a resample's SQNR is that of its summed energies."""

    signal: np.ndarray
    noise: np.ndarray
    resamples: int = RESAMPLES

    @property
    def units(self) -> int:
        """Units resampled (samples; whole batches whose outputs have no batch axis)."""
        return int(self.signal.shape[1])

    def resampled(self, draws: np.ndarray) -> np.ndarray:
        """The worst output's SQNR (dB) on each row of unit indices (nan: no output to compare)."""
        signal, noise = self.signal[:, draws].sum(axis=-1), self.noise[:, draws].sum(axis=-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            db = 10.0 * np.log10(signal / noise)
        db = np.where(signal > 0, db, np.nan)  # no signal: undefined, never the worst (as ErrorAccumulator)
        worst = np.where(np.isnan(db), np.inf, db).min(axis=0)
        return np.where(np.isnan(db).all(axis=0), np.nan, worst)


@dataclass(frozen=True, eq=False)
class HookValues:
    """A custom metric without a per-sample form: re-called on resampled lists of evaluation batches."""

    score: Callable[[list, list, list | None], float]
    reference: Sequence[dict[str, np.ndarray]]
    candidate: Sequence[dict[str, np.ndarray]]
    labels: Sequence[np.ndarray] | None
    resamples: int = HOOK_RESAMPLES

    @property
    def units(self) -> int:
        """Units resampled: the evaluation batches."""
        return len(self.reference)

    def resampled(self, draws: np.ndarray) -> np.ndarray:
        """The hook's value on each row of batch indices."""
        out = []
        for row in draws.tolist():
            labels = None if self.labels is None else [self.labels[i] for i in row]
            out.append(self.score([self.reference[i] for i in row], [self.candidate[i] for i in row], labels))
        return np.asarray(out, dtype=np.float64)


@dataclass(frozen=True)
class DataLabel:
    """A data source as a pickled :class:`Evaluator` keeps it: the name its messages give, and the specs."""

    source: str
    specs: tuple


@dataclass(frozen=True, eq=False)
class SampleResults:
    """One task result per evaluation sample (:meth:`Evaluator.sample_results`)."""

    kind: str
    """``"class"`` (predicted class), ``"hit"`` (1.0 / 0.0) or ``"value"`` (higher is better)."""
    values: np.ndarray
    """``[samples]``, in evaluation order."""


def _energies(r: np.ndarray, c: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Signal and noise energies of one output in one batch, per sample along ``axis`` (None: the batch
    as one unit); non-finite pairs left out, as :class:`ErrorAccumulator` leaves them.

    Summed in float64 from one float64 copy (every candidate of propose pays this per batch: the masked
    path, five times slower, runs only when a value is not finite)."""
    rows = 1 if axis is None else r.shape[axis]
    r2 = (r if axis is None else np.moveaxis(r, axis, 0)).reshape(rows, -1)
    c2 = (c if axis is None else np.moveaxis(c, axis, 0)).reshape(rows, -1)
    if np.isfinite(r2).all() and np.isfinite(c2).all():
        d = r2.astype(np.float64)
        signal = np.einsum("ij,ij->i", d, d)
        d -= c2
        return signal, np.einsum("ij,ij->i", d, d)
    r64, c64 = r2.astype(np.float64), c2.astype(np.float64)
    ok = np.isfinite(r64) & np.isfinite(c64)
    r64, c64 = np.where(ok, r64, 0.0), np.where(ok, c64, 0.0)
    return (r64 * r64).sum(axis=1), ((r64 - c64) ** 2).sum(axis=1)


class StoredBatches(Sequence[Batch]):
    """The evaluation batches: their feeds in an :class:`~qdebug.data.store.ArrayStore` (read back per
    pass), their labels, sizes and origins in memory."""

    def __init__(self) -> None:
        self.feeds = ArrayStore()
        self.meta: list[tuple[np.ndarray | None, int, str, dict]] = []

    def append(self, batch: Batch) -> None:
        self.feeds.append(batch.feeds)
        self.meta.append((batch.labels, batch.size, batch.origin, dict(batch.axes)))

    def __len__(self) -> int:
        return len(self.meta)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        labels, size, origin, axes = self.meta[index]
        return Batch(self.feeds[index], labels, size, origin, axes)

    def __iter__(self) -> Iterator[Batch]:
        for i in range(len(self)):
            yield self[i]

    def view(self, indices: range) -> StoredBatches:
        """Some of the batches, read through the same store (a shard of the evaluation set)."""
        out = StoredBatches.__new__(StoredBatches)
        out.feeds = self.feeds[indices.start : indices.stop]  # type: ignore[assignment]
        out.meta = self.meta[indices.start : indices.stop]
        return out


class _Tally:
    """One candidate compared with FP32 batch by batch: what its result keeps, without its outputs (a
    custom metric's hook reads them all at the end: they go to a store, spilled beyond its budget)."""

    def __init__(self, ev: Evaluator) -> None:
        self.ev = ev
        self.accs = {k: ErrorAccumulator() for k in ev.output_names}
        self.hits: list[np.ndarray] = []
        self.counts: list[np.ndarray] = []
        self.preds: list[np.ndarray] = []
        self.signal: list[list[np.ndarray]] = [[] for _ in ev._float_names]
        self.noise: list[list[np.ndarray]] = [[] for _ in ev._float_names]
        self.kept: ArrayStore | None = ArrayStore(inline=True) if ev._user is not None else None
        self.i = 0
        self.per_sample_classes = True
        """Every batch's predictions are its samples (one class each)."""

    def update(self, ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray]) -> None:
        """Compare one evaluation batch (the next one)."""
        ev, i = self.ev, self.i
        n = ev.sizes[i]
        self.i += 1
        for k, acc in self.accs.items():
            r, c = ref[k], cand.get(k)
            if c is not None and r.dtype.kind == "f" and r.shape == c.shape and r.size:
                acc.update(r, c)
        if ev.energies:
            self._energies(ref, cand, n)
        if self.kept is not None:
            self.kept.append(cand)
            return
        out0 = ev.output_names[0]
        if ev.metric_name == "top1":
            assert ev.labels is not None
            pred = _predicted(cand[out0], ev._indices)
            self.preds.append(pred)
            self.per_sample_classes &= pred.size == n
            self.hits.append((pred == ev.labels[i]).astype(np.float64).reshape(-1))
            self.counts.append(np.ones(self.hits[-1].size))
        elif ev.metric_name == "top1_agreement":
            # one unit per prediction of a batch whose predictions are its samples, else one per batch (the
            # positions of an output without a batch axis are one sample's, not independent draws)
            pred, want = _predicted(cand[out0], ev._indices), _predicted(ref[out0], ev._indices)
            self.preds.append(pred)
            self.per_sample_classes &= pred.size == n
            same = (pred == want).astype(np.float64).reshape(-1)
            if want.size == n:
                self.hits.append(same)
                self.counts.append(np.ones(n))
            else:
                self.hits.append(np.array([same.sum()]))
                self.counts.append(np.array([float(want.size)]))
        elif ev.metric_name == "exact_match":
            exact = [k for k in ev.output_names if _exact_kind(ref[k])]
            self.hits.append(_exact_match(ref, cand, exact, n, ev.output_axes).astype(np.float64))
            self.counts.append(np.ones(n))

    def absorb(self, part: EvalResult) -> None:
        """Add a shard's result (the shards in evaluation order): its sums, per-unit numbers and classes."""
        for k, acc in zip(self.accs, part.accumulators, strict=True):
            self.accs[k] = self.accs[k].merge(acc)
        for j in range(len(self.signal) if part.sqnr is not None else 0):
            self.signal[j].append(part.sqnr.signal[j])
            self.noise[j].append(part.sqnr.noise[j])
        if isinstance(part.values, RatioValues):
            self.hits.append(part.values.hits)
            self.counts.append(part.values.counts)
        if part.classes is None:
            self.per_sample_classes = False
        else:
            self.preds.append(part.classes)

    def _energies(self, ref: Mapping[str, np.ndarray], cand: Mapping[str, np.ndarray], n: int) -> None:
        """Per-unit energies of every float output: the batch is split into its samples when every float
        output of the reference has them on its batch axis, else it is one unit."""
        names = self.ev._float_names
        axes = {k: self.ev.output_axes.get(k, 0) for k in names}
        split = all(ref[k].ndim > axes[k] and ref[k].shape[axes[k]] == n for k in names)
        rows = n if split else 1
        for j, k in enumerate(names):
            r, c = ref[k], cand.get(k)
            if c is not None and r.dtype.kind == "f" and r.shape == c.shape and r.size:
                s_, n_ = _energies(r, c, axes[k] if split else None)
            else:
                s_, n_ = np.zeros(rows), np.zeros(rows)
            self.signal[j].append(s_)
            self.noise[j].append(n_)

    def result(self, seconds: float, value: float | None = None) -> EvalResult:
        """The candidate's score (``value``: FP32's own, which needs no hook call of its own)."""
        ev = self.ev
        outputs = tuple(OutputMetric(k, acc.result()) for k, acc in self.accs.items())
        sqnr: SqnrValues | None = None
        if not ev.energies:
            pass
        elif ev._float_names:
            sqnr = SqnrValues(
                np.stack([np.concatenate(x) for x in self.signal]), np.stack([np.concatenate(x) for x in self.noise])
            )
        else:
            sqnr = SqnrValues(np.zeros((0, ev.samples)), np.zeros((0, ev.samples)))
        values: RatioValues | SqnrValues | None = None
        if self.hits:
            values = RatioValues(np.concatenate(self.hits), np.concatenate(self.counts))
        name = ev.metric_name
        if value is not None:
            pass
        elif ev._user is not None:
            value = ev._call_user(ev.reference, self.kept, ev.labels)
        elif name in ("top1", "exact_match"):
            assert values is not None
            value = float(values.hits.sum()) / ev.samples
        elif name == "top1_agreement":
            assert values is not None
            value = values.value()
        else:
            finite = [a.result().sqnr_db for a in self.accs.values() if a.count]
            finite = [v for v in finite if not math.isnan(v)]
            value = min(finite) if finite else math.nan
        if name == "output_sqnr_db" and ev._user is None:
            values = sqnr
        classes = None
        if self.preds and self.per_sample_classes:
            classes = np.concatenate(self.preds).astype(np.int64)
        return EvalResult(
            name, value, ev.fp32_value, outputs, ev.samples, seconds,
            values=values, sqnr=sqnr, classes=classes, kept=self.kept, accumulators=tuple(self.accs.values()),
        )


class Evaluator:
    """Scores candidate models on a fixed evaluation set against cached FP32 outputs.

    The evaluation inputs and the FP32 outputs are kept in :class:`~qdebug.data.store.ArrayStore` s
    (memory up to a budget, a file beyond it), and a candidate is compared batch by batch as it runs:
    its result keeps per-sample numbers, not its outputs, so memory is flat in the evaluation-set size.
    """

    def __init__(
        self, fp32: onnx.ModelProto, data: DataSet, config: SessionConfig, metric: str | None = None
    ) -> None:
        self.config = config
        self.data = data
        self.output_axes = output_batch_axes(fp32, data.specs)
        """Each output's batch axis, where ``exact_match`` reads its samples."""
        session = make_session(fp32, config, what="FP32 model")
        self.output_names = [o.name for o in session.get_outputs()]
        fed = {s.name for s in data.specs}  # not an optional input the data leaves out
        self.input_names = [i.name for i in session.get_inputs() if i.name in fed]
        """The model inputs the data feeds, in session order (bench writes its input file in this order)."""
        self.batches = StoredBatches()
        self.reference: Sequence[dict[str, np.ndarray]] = ArrayStore()
        for b in data.batches():
            self.batches.append(b)
            self.reference.append(self._run(session, b.feeds))  # type: ignore[attr-defined]
            del b
        if not len(self.batches):
            raise QDebugError(
                f"evaluation data {data.source} has no samples", "give at least one sample", ExitCode.DATA
            )
        meta = self.batches.meta
        self.labels = [m[0] for m in meta] if all(m[0] is not None for m in meta) else None
        self.sizes = [m[1] for m in meta]
        self.samples = sum(self.sizes)
        self._start(metric)

    @classmethod
    def from_outputs(
        cls,
        reference: Sequence[dict[str, np.ndarray]],
        labels: list[np.ndarray] | None,
        data: DataSet,
        metric: str | None = None,
        sizes: list[int] | None = None,
    ) -> Evaluator:
        """An evaluator over outputs already computed (e.g. during the layer capture): no session is run.

        ``sizes`` are the samples per batch (without them: the labels' lengths, else axis 0 of the outputs).
        """
        self = cls.__new__(cls)
        self.data = data
        self.output_axes = {}
        self.batches = StoredBatches()
        self.output_names = list(reference[0])
        self.input_names = [sp.name for sp in data.specs]
        self.labels = labels if labels and len(labels) == len(reference) else None
        self.reference = reference
        if sizes is None:
            sizes = [len(lab) for lab in self.labels] if self.labels else [_rows(r) for r in reference]
        self.sizes = list(sizes)
        self.samples = sum(self.sizes)
        self._start(metric)
        return self

    def __getstate__(self) -> dict:
        """What a worker process needs to score candidates (``--workers``, ``--ray``): the data source is
        reduced to its name and input specs (its batches are in the stores, which a process on this
        machine reads from their files), the custom metric to its ``module:function`` spec, imported
        again on the other side."""
        state = dict(self.__dict__)
        state["data"] = DataLabel(self.data.source, tuple(self.data.specs))
        state["_user"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.metric_name not in BUILTIN:
            self._user = load_hook(self.metric_name, "metric")

    def _start(self, metric: str | None) -> None:
        """Resolve the metric and score FP32 against itself (or its labels)."""
        out0 = self.output_names[0]
        first = self.reference[0]
        self._float_names = [k for k in self.output_names if first[k].dtype.kind == "f"]
        self.fp32_value = math.nan  # FP32's own score, from the tally below
        """The float outputs: their per-sample energies are kept for the SQNR gates, whatever the metric."""
        self._indices = all(
            _class_indices(r[out0], n) for r, n in zip(self.reference, self.sizes, strict=True)
        ) if _class_indices(first[out0], self.sizes[0]) else False
        """The first output holds class indices (an ArgMax inside the model), not scores."""
        self.metric_name, self._user = self._resolve_metric(metric)
        self.energies = True
        """Every candidate's per-sample signal and noise energies are kept (the SQNR gates, the per-sample
        drill-down); propose's search turns it off unless its metric is the output SQNR: :meth:`keep_energies`."""
        tally = _Tally(self)
        tally.kept = None  # FP32's own outputs are the reference
        for r in self.reference:
            tally.update(r, r)
        if self._user is not None:
            self.fp32_value = self._call_user(self.reference, self.reference, self.labels)
            self._fp32 = tally.result(0.0, self.fp32_value)
            self._fp32 = dataclasses.replace(self._fp32, kept=self.reference)
        else:
            self._fp32 = tally.result(0.0)
            self.fp32_value = self._fp32.value
            self._fp32 = dataclasses.replace(self._fp32, fp32_value=self.fp32_value)
        if self.metric_name == "top1" and self._indices and self.fp32_value == 0.0 and self.samples >= 10:
            raise QDebugError(
                f"the FP32 model's predicted classes ({out0}) match none of the {self.samples} labels of "
                f"evaluation data {self.data.source}",
                "give 0-based class indices numbered as the model numbers its classes",
                ExitCode.DATA,
            )

    def _check_label_range(self, classes: int) -> None:
        """Labels outside [0, classes) would score 0 % without a word (e.g. 1-based or offset labels)."""
        assert self.labels is not None
        lo = min(int(lab.min()) for lab in self.labels if lab.size)
        hi = max(int(lab.max()) for lab in self.labels if lab.size)
        if lo < 0 or hi >= classes:
            raise QDebugError(
                f"labels of evaluation data {self.data.source} run from {lo} to {hi}, but the model's first "
                f"output {self.output_names[0]} has {classes} classes",
                f"give class indices in [0, {classes - 1}] (shift 1-based labels by -1)",
                ExitCode.DATA,
            )

    def _check_index_labels(self) -> None:
        """Class-index outputs carry no class count: at least negative labels are refused."""
        assert self.labels is not None
        lo = min((int(lab.min()) for lab in self.labels if lab.size), default=0)
        if lo < 0:
            raise QDebugError(
                f"labels of evaluation data {self.data.source} go down to {lo}; the model's first output "
                f"{self.output_names[0]} gives class indices from 0",
                "give 0-based class indices",
                ExitCode.DATA,
            )

    def _resolve_metric(self, metric: str | None) -> tuple[str, Callable | None]:
        first = self.reference[0][self.output_names[0]]
        if metric in (None, "auto"):
            if self.labels is not None and _classifier_shaped(first):
                self._check_label_range(first.shape[1])
                return "top1", None
            if self.labels is not None and self._indices:
                self._check_index_labels()
                return "top1", None
            if _classifier_shaped(first) or self._indices:
                return "top1_agreement", None
            if not any(a.dtype.kind in "fc" for a in self.reference[0].values()):
                # e.g. token ids or strings: SQNR has nothing to measure
                return "exact_match", None
            return "output_sqnr_db", None
        if metric == "top1":
            if self.labels is None:
                raise QDebugError(
                    f"metric top1 needs labels, but evaluation data {self.data.source} has no 'labels' array",
                    "add a 'labels' array to the data or use --metric top1_agreement",
                    ExitCode.DATA,
                )
            if self._indices:
                self._check_index_labels()
                return "top1", None
            if not _classifier_shaped(first):
                raise QDebugError(
                    f"metric top1 needs a [batch, classes] scores or [batch] class-index first output; "
                    f"{self.output_names[0]} has shape {list(first.shape)}",
                    "use --metric output_sqnr_db or a module:function metric",
                    ExitCode.DATA,
                )
            self._check_label_range(first.shape[1])
            return "top1", None
        if metric == "top1_agreement" and not (self._indices or _classifier_shaped(first)):
            raise QDebugError(
                f"metric top1_agreement needs a [batch, classes] scores or [batch] class-index first output; "
                f"{self.output_names[0]} has shape {list(first.shape)}",
                "use --metric output_sqnr_db, exact_match or a module:function metric",
                ExitCode.USAGE,
            )
        if metric == "exact_match" and not any(_exact_kind(a) for a in self.reference[0].values()):
            raise QDebugError(
                "metric exact_match compares integer, bool or string outputs, but every output of the model "
                "is float",
                "use --metric output_sqnr_db, top1 or top1_agreement",
                ExitCode.USAGE,
            )
        if metric in BUILTIN:
            return metric, None
        _check_hook_form(metric)
        return metric, load_hook(metric, "metric")

    def _run(self, session, feeds) -> dict[str, np.ndarray]:
        return run_session(session, self.output_names, feeds, "the evaluation data")

    def _call_user(self, reference: list, candidate: list, labels: list | None) -> float:
        """The custom metric's value (its errors and a nan as one-line errors)."""
        name = self.metric_name
        assert self._user is not None
        try:
            value = float(self._user(reference, candidate, labels))
        except Exception as e:
            raise QDebugError(
                f"metric {name} raised {e.__class__.__name__}: {e}",
                "fix the metric function",
                ExitCode.INPUT,
            ) from None
        if math.isnan(value):  # every comparison with it is False: propose/verify would judge nothing
            raise QDebugError(f"metric {name} returned nan", "return a number (higher is better)", ExitCode.INPUT)
        return value

    def score(
        self, model: onnx.ModelProto, what: str = "quantized model", *, fake_quant: bool = False
    ) -> EvalResult:
        """Run ``model`` over the evaluation set and score it against the FP32 outputs.

        ``fake_quant=True`` runs a QDQ model with ORT's QDQ handling off: float
        fake-quant semantics instead of integer kernels.
        """
        start = time.perf_counter()
        session = make_session(model, self.config, what=what, fake_quant=fake_quant)
        return self.score_session(session, seconds=time.perf_counter() - start)

    def score_session(
        self, session, extra: Mapping[str, np.ndarray] | None = None, seconds: float = 0.0
    ) -> EvalResult:
        """Score an open session (one kept across candidates: the switchable model), ``extra`` fed with
        every batch."""
        start = time.perf_counter()
        tally = _Tally(self)
        for batch, ref in zip(self.batches, self.reference, strict=True):
            feeds = {**batch.feeds, **extra} if extra else batch.feeds
            tally.update(ref, self._run(session, feeds))
            del batch, ref, feeds
        return tally.result(seconds + time.perf_counter() - start)

    def score_outputs(self, candidate: Iterable[Mapping[str, np.ndarray]], seconds: float = 0.0) -> EvalResult:
        """Score candidate outputs (one dict per evaluation batch) against the FP32 outputs."""
        start = time.perf_counter()
        tally = _Tally(self)
        for ref, cand in zip(self.reference, candidate, strict=True):
            tally.update(ref, cand)
        return tally.result(seconds + time.perf_counter() - start)

    def keep_energies(self, keep: bool) -> None:
        """Keep the float outputs' per-sample energies in each result (None in ``result.sqnr`` without them);
        always kept for ``output_sqnr_db``, whose split they are. Summing them is the one per-batch cost a
        candidate pays beyond its metric (a float64 copy of each output)."""
        self.energies = keep or (self.metric_name == "output_sqnr_db" and self._user is None)

    def shards(self, k: int) -> list[Evaluator]:
        """The evaluation set cut into at most ``k`` runs of whole batches with about equal samples, each an
        evaluator over the same stores: a candidate scored on every shard (on as many workers) and the
        results given to :meth:`merge` gives exactly :meth:`score`'s result. A custom metric reads every
        batch at once: its evaluator is not cut (one shard)."""
        if k <= 1 or self._user is not None or len(self.sizes) < 2:
            return [self]
        bounds = np.cumsum(self.sizes)
        cuts = sorted({int(np.searchsorted(bounds, self.samples * j / k, side="left")) + 1 for j in range(1, k)})
        edges = [0, *[c for c in cuts if 0 < c < len(self.sizes)], len(self.sizes)]
        return [self._shard(range(a, b)) for a, b in zip(edges, edges[1:], strict=False) if b > a]

    def _shard(self, indices: range) -> Evaluator:
        part = Evaluator.__new__(Evaluator)
        part.__dict__.update(self.__dict__)
        part.batches = self.batches.view(indices) if isinstance(self.batches, StoredBatches) else StoredBatches()
        part.reference = self.reference[indices.start : indices.stop]
        part.sizes = self.sizes[indices.start : indices.stop]
        part.labels = None if self.labels is None else self.labels[indices.start : indices.stop]
        part.samples = sum(part.sizes)
        return part

    def portable(self) -> Evaluator:
        """A copy that pickles with its data: the inputs and FP32 outputs read out of the stores into memory,
        for a worker on another machine (a Ray actor: the stores' files are this machine's). Meant for a
        shard (:meth:`shards`): its copy holds that shard's batches only."""
        part = Evaluator.__new__(Evaluator)
        part.__dict__.update(self.__dict__)
        batches = StoredBatches.__new__(StoredBatches)
        batches.feeds = [self.batches.feeds[i] for i in range(len(self.batches.meta))]  # type: ignore[assignment]
        batches.meta = list(self.batches.meta)
        part.batches = batches
        part.reference = [self.reference[i] for i in range(len(self.reference))]
        if self._fp32.kept is not None:  # a custom metric's FP32 view: the reference itself
            part._fp32 = dataclasses.replace(self._fp32, kept=part.reference)
        return part

    def merge(self, parts: Sequence[EvalResult]) -> EvalResult:
        """One result from the results of one candidate on :meth:`shards`, in shard order."""
        if len(parts) == 1 and parts[0].samples == self.samples:
            return parts[0]
        tally = _Tally(self)
        for part in parts:
            tally.absorb(part)
        return tally.result(sum(p.seconds for p in parts))

    def sample_values(self, result: EvalResult | None = None) -> RatioValues | SqnrValues | HookValues | None:
        """``result``'s metric (None: FP32's) split over the evaluation units, for a paired bootstrap
        (:mod:`qdebug.evaluation.noise`); every variant of one evaluator has the same units. None when it cannot be
        split: a custom metric without ``per_sample`` on one batch."""
        result = self._fp32 if result is None else result
        if self._user is not None:
            return None if result.kept is None else self._user_values(result.kept, result.value)
        return result.values

    def sample_results(self, result: EvalResult | None = None) -> SampleResults | None:
        """``result``'s task result per evaluation sample (None: FP32's), for the per-sample drill-down.

        ``kind`` says what the values are: ``"class"`` -- the predicted class of each sample (top1,
        top1_agreement with one prediction per sample); ``"hit"`` -- 1.0 where the sample's non-float
        outputs equal FP32's (exact_match); ``"value"`` -- a number per sample, higher is better (a custom
        metric's ``per_sample`` form; output_sqnr_db: the sample's worst float-output SQNR in dB, capped at
        FP32 itself). None where the metric gives nothing per sample (a hook without ``per_sample``, an
        output without a batch axis).
        """
        result = self._fp32 if result is None else result
        if self._user is not None:
            values = self.sample_values(result)
            return SampleResults("value", values.hits.copy()) if isinstance(values, RatioValues) else None
        if self.metric_name in ("top1", "top1_agreement"):
            return None if result.classes is None else SampleResults("class", result.classes.copy())
        values = result.values
        if isinstance(values, RatioValues):
            return SampleResults("hit", values.hits.copy())
        if not isinstance(values, SqnrValues) or values.units != self.samples:
            return None
        with np.errstate(divide="ignore", invalid="ignore"):
            db = 10.0 * np.log10(values.signal / values.noise)
        db = np.where(values.signal > 0, db, np.nan)
        db = np.where(np.isnan(db), np.inf, db).min(axis=0) if db.size else np.full(self.samples, np.nan)
        return SampleResults("value", np.minimum(db, SQNR_CAP_DB))

    def drop_interval(self, result: EvalResult, confidence: float = DEFAULT_CONFIDENCE) -> tuple[float, float]:
        """Paired-bootstrap interval of FP32 minus ``result`` (points for the accuracy metrics; ``nan`` bounds
        when the metric has no FP32 value or cannot be split): what a proposal's ``drop_interval`` records."""
        values = (self.sample_values(), self.sample_values(result))
        if not math.isfinite(self.fp32_value) or any(v is None or v.units < 2 for v in values):
            return (math.nan, math.nan)
        scale = 100.0 if self.metric_name in ACCURACY_METRICS else 1.0
        f, q = bootstrap(values)  # type: ignore[arg-type]
        return interval(scale * (f - q), scale * (self.fp32_value - result.value), confidence).pair()

    def sqnr_values(self, result: EvalResult | None = None) -> SqnrValues | None:
        """``result``'s worst output SQNR split over units, whatever the metric (``--target-sqnr``'s gate)."""
        return (self._fp32 if result is None else result).sqnr

    def _user_values(self, candidate: Sequence[dict[str, np.ndarray]], value: float) -> RatioValues | HookValues | None:
        """A custom metric's per-sample form (``function.per_sample``), else the hook on resampled batches."""
        per_sample = getattr(self._user, "per_sample", None)
        if per_sample is None:
            if len(self.reference) < 2:
                return None
            return HookValues(self._call_user, self.reference, candidate, self.labels)
        name = self.metric_name
        try:
            values = np.asarray(per_sample(self.reference, candidate, self.labels), dtype=np.float64).reshape(-1)
        except Exception as e:
            raise QDebugError(
                f"metric {name}'s per_sample raised {e.__class__.__name__}: {e}", "fix the metric function"
            ) from None
        if values.size != self.samples or not np.all(np.isfinite(values)):
            raise QDebugError(
                f"metric {name}'s per_sample returned {values.size} values (finite: {bool(np.isfinite(values).all())})"
                f" for {self.samples} evaluation samples",
                "return one finite number per sample",
            )
        if not math.isclose(float(values.mean()), value, rel_tol=1e-6, abs_tol=1e-9):
            raise QDebugError(
                f"metric {name}'s per_sample values average {float(values.mean()):.6g}, but the metric is {value:.6g}",
                "return per-sample values whose mean is the metric (or drop per_sample: batches are resampled)",
            )
        return RatioValues(values, np.ones(values.size))


def worst_output_sqnr(
    reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]
) -> float:
    """SQNR (dB) of the worst float output, each output over all its batches (nan: nothing to compare).

    The worst, as --target-sqnr judges it: pooled over all outputs, a box head in the thousands drowned the
    class scores' error, and the same name meant two numbers in one table. An output whose shape depends on
    the data (after NonZero, NonMaxSuppression) may keep other elements in the quantized model: those
    batches cannot be compared element-wise and are left out.
    """
    accs = {k: ErrorAccumulator() for k in names}
    for r, c in zip(reference, candidate, strict=True):
        for k in names:
            if k in r and k in c and r[k].dtype.kind == "f" and r[k].shape == c[k].shape and r[k].size:
                accs[k].update(r[k], c[k])
    values = [a.result().sqnr_db for a in accs.values() if a.count]
    values = [v for v in values if not math.isnan(v)]
    return min(values) if values else math.nan


def metric_scope_note(evaluator: Evaluator) -> str | None:
    """A note naming the model outputs the built-in task metric does not read.

    top1 and top1_agreement judge the first output only, output_sqnr_db the float outputs only,
    exact_match the non-float ones only: a second head (boxes next to class scores), TopK indices or an
    NMS output could change completely while propose reports the target met and verify passes.
    """
    if evaluator._user is not None:
        return None
    first = evaluator.reference[0]
    names = evaluator.output_names
    is_float = {n: first[n].dtype.kind in "fc" for n in names}
    metric = evaluator.metric_name
    if metric in ("top1", "top1_agreement"):
        read, why = names[:1], f"reads the first output {names[0]!r} only"
    elif metric == "output_sqnr_db":
        read, why = [n for n in names if is_float[n]], "reads the float outputs only"
    elif metric == "exact_match":
        read, why = [n for n in names if not is_float[n]], "reads the non-float outputs only"
    else:
        return None
    floats = [n for n in names if n not in read and is_float[n]]
    others = [n for n in names if n not in read and not is_float[n]]
    if not floats and not others:
        return None
    parts = []
    if floats:
        parts.append(f"float output(s) {', '.join(map(repr, floats))} count only through the output SQNR")
    if others:
        parts.append(f"integer output(s) {', '.join(map(repr, others))} are not compared at all")
    return (
        f"the task metric ({metric}) {why}: {'; '.join(parts)} (judge every head with a module:function "
        "metric" + (", or --metric output_sqnr_db for the float ones" if floats else "") + ")"
    )
