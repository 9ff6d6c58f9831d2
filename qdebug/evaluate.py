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
of :mod:`qdebug.noise`: per-sample hits for ``top1`` and ``exact_match``; per-prediction agreement for
``top1_agreement`` (one unit per sample, or one per batch whose predictions are positions of one sample);
per-sample signal and noise energies of every float output for ``output_sqnr_db`` (a resample's SQNR is
that of its summed energies). A custom metric function may carry an optional per-sample form,
``function.per_sample(reference, candidate, labels) -> list[float]``, one value per sample whose mean is
the metric; without it the hook itself is re-called on resampled lists of evaluation batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from qdebug.capture import SessionConfig, make_session, run_session
from qdebug.data import DataSet, load_hook, output_batch_axes
from qdebug.errors import ExitCode, QDebugError
from qdebug.formatting import ACCURACY_METRICS
from qdebug.metrics import ErrorAccumulator
from qdebug.noise import DEFAULT_CONFIDENCE, HOOK_RESAMPLES, RESAMPLES, bootstrap, interval
from qdebug.records import SQNR_CAP_DB, OutputMetric

BUILTIN = ("top1", "top1_agreement", "exact_match", "output_sqnr_db")


@dataclass(frozen=True)
class EvalResult:
    """Score of one candidate model."""

    metric: str
    value: float
    fp32_value: float
    outputs: tuple[OutputMetric, ...]
    samples: int
    seconds: float
    candidate: tuple[dict[str, np.ndarray], ...] = field(default=(), compare=False, repr=False)
    """The candidate's outputs (one dict per evaluation batch), kept for :meth:`Evaluator.sample_values`:
    model outputs are small, and a result is dropped once its value is read (propose keeps trials)."""

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
    as one unit); non-finite pairs left out, as :class:`ErrorAccumulator` leaves them."""
    r64, c64 = r.astype(np.float64), c.astype(np.float64)
    ok = np.isfinite(r64) & np.isfinite(c64)
    r64, c64 = np.where(ok, r64, 0.0), np.where(ok, c64, 0.0)
    rows = 1 if axis is None else r64.shape[axis]
    r2 = (r64 if axis is None else np.moveaxis(r64, axis, 0)).reshape(rows, -1)
    c2 = (c64 if axis is None else np.moveaxis(c64, axis, 0)).reshape(rows, -1)
    return (r2 * r2).sum(axis=1), ((r2 - c2) ** 2).sum(axis=1)


class Evaluator:
    """Scores candidate models on a fixed evaluation set against cached FP32 outputs."""

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
        self.batches = list(data.batches())
        if not self.batches:
            raise QDebugError(
                f"evaluation data {data.source} has no samples", "give at least one sample", ExitCode.DATA
            )
        self.labels = (
            [b.labels for b in self.batches] if all(b.labels is not None for b in self.batches) else None
        )
        self.reference = [self._run(session, b.feeds) for b in self.batches]
        self.sizes = [b.size for b in self.batches]
        self.samples = sum(self.sizes)
        self._start(metric)

    @classmethod
    def from_outputs(
        cls,
        reference: list[dict[str, np.ndarray]],
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
        self.batches = []
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
        reduced to its name and input specs (its batches are already held), the custom metric to its
        ``module:function`` spec, imported again on the other side."""
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
        self._indices = all(_class_indices(r[out0], n) for r, n in zip(self.reference, self.sizes, strict=True))
        """The first output holds class indices (an ArgMax inside the model), not scores."""
        self.metric_name, self._user = self._resolve_metric(metric)
        self.fp32_value = self._score(self.reference)
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

    def _score(self, candidate: list[dict[str, np.ndarray]]) -> float:
        name = self.metric_name
        if self._user is not None:
            return self._call_user(self.reference, candidate, self.labels)
        out0 = self.output_names[0]
        if name == "top1":
            assert self.labels is not None
            hits = sum(
                int(np.sum(_predicted(c[out0], self._indices) == lab))
                for c, lab in zip(candidate, self.labels, strict=True)
            )
            return hits / self.samples
        if name == "top1_agreement":
            # a share of the predictions compared: one per sample for [batch, classes], one per position for
            # an output without a batch axis ([T, classes] at batch 1 had read 1600 %)
            pairs = [
                (_predicted(c[out0], self._indices), _predicted(r[out0], self._indices))
                for c, r in zip(candidate, self.reference, strict=True)
            ]
            total = sum(ref.size for _, ref in pairs)
            return sum(int(np.sum(cand == ref)) for cand, ref in pairs) / total if total else math.nan
        if name == "exact_match":
            exact = [k for k in self.output_names if _exact_kind(self.reference[0][k])]
            rows = zip(candidate, self.reference, self.sizes, strict=True)
            hits = sum(_exact_rows(r, c, exact, n, self.output_axes) for c, r, n in rows)
            return hits / self.samples
        return worst_output_sqnr(self.reference, candidate, self.output_names)

    def score(
        self, model: onnx.ModelProto, what: str = "quantized model", *, fake_quant: bool = False
    ) -> EvalResult:
        """Run ``model`` over the evaluation set and score it against the FP32 outputs.

        ``fake_quant=True`` runs a QDQ model with ORT's QDQ handling off: float
        fake-quant semantics instead of integer kernels.
        """
        start = time.perf_counter()
        session = make_session(model, self.config, what=what, fake_quant=fake_quant)
        candidate = [self._run(session, b.feeds) for b in self.batches]
        return self.score_outputs(candidate, time.perf_counter() - start)

    def score_outputs(self, candidate: list[dict[str, np.ndarray]], seconds: float = 0.0) -> EvalResult:
        """Score candidate outputs (one dict per evaluation batch) against the FP32 outputs."""
        start = time.perf_counter()
        value = self._score(candidate)
        outputs = []
        for k in self.output_names:
            acc = ErrorAccumulator()
            for c, r in zip(candidate, self.reference, strict=True):
                if r[k].dtype.kind == "f" and r[k].shape == c[k].shape:
                    acc.update(r[k], c[k])
            outputs.append(OutputMetric(k, acc.result()))
        elapsed = seconds + time.perf_counter() - start
        return EvalResult(
            self.metric_name, value, self.fp32_value, tuple(outputs), self.samples, elapsed, tuple(candidate)
        )

    def sample_values(self, result: EvalResult | None = None) -> RatioValues | SqnrValues | HookValues | None:
        """``result``'s metric (None: FP32's) split over the evaluation units, for a paired bootstrap
        (:mod:`qdebug.noise`); every variant of one evaluator has the same units. None when it cannot be
        split: a result without its outputs, or a custom metric without ``per_sample`` on one batch."""
        candidate = self.reference if result is None else list(result.candidate)
        if not candidate:
            return None
        name = self.metric_name
        if self._user is not None:
            return self._user_values(candidate, self.fp32_value if result is None else result.value)
        out0 = self.output_names[0]
        if name == "top1":
            assert self.labels is not None
            hits = [_predicted(c[out0], self._indices) == lab for c, lab in zip(candidate, self.labels, strict=True)]
            flat = np.concatenate(hits).astype(np.float64)
            return RatioValues(flat, np.ones_like(flat))
        if name == "top1_agreement":
            return self._agreement_values(candidate)
        if name == "exact_match":
            exact = [k for k in self.output_names if _exact_kind(self.reference[0][k])]
            rows = zip(candidate, self.reference, self.sizes, strict=True)
            match = np.concatenate([_exact_match(r, c, exact, n, self.output_axes) for c, r, n in rows])
            return RatioValues(match.astype(np.float64), np.ones(match.size))
        return self._sqnr_values(candidate)

    def sample_results(self, result: EvalResult | None = None) -> SampleResults | None:
        """``result``'s task result per evaluation sample (None: FP32's), for the per-sample drill-down.

        ``kind`` says what the values are: ``"class"`` -- the predicted class of each sample (top1,
        top1_agreement with one prediction per sample); ``"hit"`` -- 1.0 where the sample's non-float
        outputs equal FP32's (exact_match); ``"value"`` -- a number per sample, higher is better (a custom
        metric's ``per_sample`` form; output_sqnr_db: the sample's worst float-output SQNR in dB, capped at
        FP32 itself). None where the metric gives nothing per sample (a hook without ``per_sample``, an
        output without a batch axis).
        """
        candidate = self.reference if result is None else list(result.candidate)
        if not candidate:
            return None
        name = self.metric_name
        if self._user is not None:
            values = self._user_values(candidate, self.fp32_value if result is None else result.value)
            return SampleResults("value", values.hits.copy()) if isinstance(values, RatioValues) else None
        out0 = self.output_names[0]
        if name in ("top1", "top1_agreement"):
            preds = [_predicted(c[out0], self._indices) for c in candidate]
            if any(p.size != n for p, n in zip(preds, self.sizes, strict=True)):
                return None
            return SampleResults("class", np.concatenate(preds).astype(np.int64))
        values = self.sample_values(result)
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
        candidate = self.reference if result is None else list(result.candidate)
        return self._sqnr_values(candidate) if candidate else None

    def _agreement_values(self, candidate: list[dict[str, np.ndarray]]) -> RatioValues:
        """One unit per prediction of a batch whose predictions are its samples, else one per batch (the
        positions of an output without a batch axis are one sample's, not independent draws)."""
        out0 = self.output_names[0]
        hits: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        for c, r, n in zip(candidate, self.reference, self.sizes, strict=True):
            ref = _predicted(r[out0], self._indices)
            same = (_predicted(c[out0], self._indices) == ref).astype(np.float64).reshape(-1)
            if ref.size == n:
                hits.append(same)
                counts.append(np.ones(n))
            else:
                hits.append(np.array([same.sum()]))
                counts.append(np.array([float(ref.size)]))
        return RatioValues(np.concatenate(hits), np.concatenate(counts))

    def _sqnr_values(self, candidate: list[dict[str, np.ndarray]]) -> SqnrValues:
        """Per-unit energies of every float output: a batch is split into its samples when every float
        output of the reference has them on its batch axis, else it is one unit."""
        names = [k for k in self.output_names if self.reference[0][k].dtype.kind == "f"]
        signal: list[list[np.ndarray]] = [[] for _ in names]
        noise: list[list[np.ndarray]] = [[] for _ in names]
        for c, r, n in zip(candidate, self.reference, self.sizes, strict=True):
            axes = {k: self.output_axes.get(k, 0) for k in names}
            split = all(r[k].ndim > axes[k] and r[k].shape[axes[k]] == n for k in names)
            rows = n if split else 1
            for i, k in enumerate(names):
                if k in c and r[k].dtype.kind == "f" and r[k].shape == c[k].shape and r[k].size:
                    s_, n_ = _energies(r[k], c[k], axes[k] if split else None)
                else:
                    s_, n_ = np.zeros(rows), np.zeros(rows)
                signal[i].append(s_)
                noise[i].append(n_)
        if not names:
            return SqnrValues(np.zeros((0, self.samples)), np.zeros((0, self.samples)))
        return SqnrValues(np.stack([np.concatenate(x) for x in signal]), np.stack([np.concatenate(x) for x in noise]))

    def _user_values(self, candidate: list[dict[str, np.ndarray]], value: float) -> RatioValues | HookValues | None:
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
