"""The search state: what a candidate must reach, the variants tried, and the budget they spend.

:class:`Search` is the one place that turns a configuration (nodes kept FP32,
tensors given 16-bit activations, per-channel weights) into a score. Variants
are re-quantized from the *cached* calibration ranges (never a recalibration;
see ``benchmarks/bench_propose.py``) and scored with
:class:`~qdebug.evaluation.evaluate.Evaluator`; a configuration asked twice, or one whose
quantized model equals an earlier one, is scored once, so a strategy may ask
freely and only pays for what is new. Every scored variant is a :class:`Trial`
in ``Search.trials``, the trace the proposal reports.

A :class:`Plan` is a configuration in terms of units (see
:mod:`qdebug.propose.blame`). The strategies in :mod:`qdebug.propose.strategy`
build plans and score them with :func:`evaluate_plan`; :func:`final_answer` and
:func:`without_per_channel` pick the answer from the trace afterwards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import onnx

from qdebug.errors import QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator
from qdebug.graph.match import GraphIndex
from qdebug.output.formatting import ACCURACY_METRICS, fmt_db, fmt_metric, metric_title
from qdebug.progress import DETAIL, Progress
from qdebug.propose.blame import Unit
from qdebug.propose.structure import Structure
from qdebug.quant.calibrate import Ranges
from qdebug.quant.quantize import QuantSpec, check_quantized_loads, quantize_model
from qdebug.records import TensorOverride
from qdebug.runtime.parallel import Pool, Ticket
from qdebug.vocabulary import PER_UNIT_FIXES


@dataclass(frozen=True)
class Target:
    """What a candidate must reach."""

    metric: str
    kind: str
    """``drop`` (task metric vs FP32) or ``sqnr`` (worst output SQNR)."""
    threshold: float
    fp32: float
    noise: float
    """Smallest change of :meth:`value` that counts as a gain (one or two samples for accuracies)."""
    basis: str = ""
    """How a default threshold was derived, when it was (printed with it)."""

    def value(self, result: EvalResult | Trial) -> float:
        """The number compared with the threshold (of a fresh score or of a trial in the trace)."""
        return result.output_sqnr_db if self.kind == "sqnr" else result.value

    def met(self, result: EvalResult) -> bool:
        """True when ``result`` reaches the threshold."""
        v = self.value(result)
        return not math.isnan(v) and v >= self.threshold - 1e-12

    def show(self, result: EvalResult | Trial) -> str:
        """A result's number as the target reads it (``top1 87.00%``, ``SQNR 31.2 dB``)."""
        if self.kind == "sqnr":
            return f"SQNR {fmt_db(self.value(result))} dB"
        return f"{metric_title(self.metric)} {fmt_metric(self.metric, self.value(result))}"

    def show_threshold(self) -> str:
        """The threshold in the same form as :meth:`show`."""
        if self.kind == "sqnr":
            return f"{fmt_db(self.threshold)} dB"
        return fmt_metric(self.metric, self.threshold)

    def describe(self) -> str:
        """One line for the CLI and the reasons."""
        if self.kind == "sqnr":
            return f"worst output SQNR >= {self.threshold:.1f} dB"
        if self.metric in ACCURACY_METRICS:
            return f"{self.metric} >= {100 * self.threshold:.2f}% (FP32 {100 * self.fp32:.2f}%)"
        basis = f"; {self.basis}" if self.basis else ""
        return f"{metric_title(self.metric)} >= {self.threshold:.4g} (FP32 {self.fp32:.4g}{basis})"


@dataclass(frozen=True)
class Trial:
    """One evaluated candidate."""

    step: str
    """``baseline``, ``per-channel``, ``diagnosis``, ``candidates``, ``bisect``, ``gallop``, ``minimize``, ``prune``
    (pairs), ``int16``, ``single``."""
    nodes: tuple[str, ...]
    overrides: tuple[str, ...]
    per_channel: bool
    value: float
    output_sqnr_db: float
    met: bool
    """The target is reached (regardless of ``max_nodes``)."""
    qdq_pairs: int
    """QuantizeLinear nodes in the variant (activations and weights)."""
    quantize_seconds: float
    eval_seconds: float
    fixes: tuple[TensorOverride, ...] = ()
    """Per-node fixes that keep nodes INT8 (a clipped range, one node's per-channel or 7-bit weights)."""


@dataclass(eq=False)
class _Ahead:
    """A variant built before it was asked for (:meth:`Search.prefetch`), and its score under way."""

    spec: QuantSpec | None = None
    qsec: float = 0.0
    digest: str = ""
    data: bytes = b""
    """The serialized model (what the pool sends, and what the digest hashes; the proto itself is let go)."""
    qdq: int = 0
    """QuantizeLinear nodes in it (the trial records them)."""
    ticket: Ticket | None = None
    evaluator: Evaluator | None = None
    """The evaluator its score is under way on (a screened search confirms on another one)."""
    error: Exception | None = None
    """Why it could not be built (raised when it is asked for, as building it then would)."""


def _qdq(model: onnx.ModelProto) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear")


def _unstarted(entry: _Ahead) -> bool:
    """A variant built ahead whose score no worker has started (or ever will)."""
    return entry.ticket is None or entry.ticket.state == "dropped"


def model_digest(model: onnx.ModelProto) -> str:
    """sha256 of a model's deterministic serialization: what identical variants are recognised by."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


RESULTS_KEPT = 8
"""Scores :attr:`Search.results` keeps with their per-sample numbers (a few numbers per sample each)."""

BUILT_BYTES = 256 * 2**20
"""Serialized variants :meth:`Search.build` keeps for being asked again (on a 3,200-node graph each
re-quantization costs about 2 s; a model over this size is not kept)."""
AHEAD_KEPT = 32
"""Variants built ahead that a search keeps at most (the oldest hints are let go first)..."""
AHEAD_BYTES = 1 << 30
"""...and the most bytes of serialized models they may hold together (a 3,200-node graph is ~100 MB)."""


class Search:
    """Evaluates variants (cached by configuration) within a budget and keeps the trace."""

    def __init__(
        self,
        normalized: onnx.ModelProto,
        ranges: Ranges,
        base_spec: QuantSpec,
        evaluator: Evaluator,
        target: Target,
        structure: Structure,
        budget: int,
        int16_type: str,
        progress: Progress,
        max_nodes: int | None = None,
        pool: Pool | None = None,
        allow: Sequence[str] = ("fp32",),
    ) -> None:
        self.normalized = normalized
        self.ranges = ranges
        self.base_spec = base_spec
        self.evaluator = evaluator
        self.target = target
        self.structure = structure
        self.budget = budget
        self.int16_type = int16_type
        self.progress = progress
        self.trials: list[Trial] = []
        self.cache: dict[tuple, Trial] = {}
        """Trials by resolved configuration (nodes after closing leaks, overrides, per-channel)."""
        self.equivalents: list[Trial] = []
        """Trials answered from an equal model scored under another list (no evaluation spent): the final
        choice considers them too, since their list may be the one that fits ``--max-nodes``."""
        self.by_model: dict[str, Trial] = {}
        """Trials by the sha256 of the quantized model they scored: equal models are scored once."""
        self.resolved: dict[tuple, tuple] = {}
        """Asked configuration -> resolved one: a repeated candidate is neither re-quantized nor re-scored."""
        self.per_channel = base_spec.per_channel
        self.max_nodes = max_nodes
        self.allow = tuple(allow)
        """``--allow``'s actions: what the strategy may change (keep FP32, 16-bit, per-channel, the fixes)."""
        self.held = 0
        """Evaluations the growth may not spend (released before the answer is refined)."""
        self.skips: list[str] = []
        """Candidates ORT's quantizer could not build, with its reason (shown as notes)."""
        self.pool = pool
        """Where candidates are scored (None or an inline pool: here, one at a time; see :meth:`prefetch`)."""
        self.ahead: dict[tuple, _Ahead] = {}
        """Variants built and handed to the pool before they were asked for (:meth:`prefetch`), by asked
        configuration: nothing of the trace or the budget, only work done early."""
        self.built: OrderedDict[tuple, tuple[QuantSpec, bytes]] = OrderedDict()
        """Variants built, by what was asked (serialized, at most :data:`BUILT_BYTES` in all, the most recent
        kept): the answer, static and the frontier's points are built again after the search."""
        self.results: OrderedDict[str, tuple[object, EvalResult]] = OrderedDict()
        """The last scores with their per-sample numbers, by model digest: the answer's drop interval is read
        from its own (no evaluation again) when the search scored it on the whole set."""
        self.prescored: dict[str, EvalResult] = {}
        """Scores of models already scored by this evaluator before the search (the recipes stage's full
        static), by model digest: taken once instead of scoring the same model again."""
        self.hinted: OrderedDict[tuple, bool] = OrderedDict()
        """The last hint's variants not built yet (-> every one will be asked for)."""

    @property
    def hint_depth(self) -> int:
        """Steps ahead a sequential strategy hints (:meth:`prefetch`; bisection, QuickXplain): 2 (the next step
        either way: 3 candidates) up to 6 workers, one more step per doubling beyond, so a larger pool has
        enough to do. It decides what may run early, never what is scored or counted."""
        slots = 1 if self.pool is None else self.pool.size
        return max(2, min(4, (slots + 1).bit_length() - 1))

    @property
    def left(self) -> int:
        """Evaluations left in the budget (less those held back for refining the answer)."""
        return self.budget - len(self.trials) - self.held

    def spec(
        self,
        nodes: Iterable[str],
        overrides: Iterable[str],
        per_channel: bool | None = None,
        fixes: Iterable[TensorOverride] = (),
    ) -> QuantSpec:
        """The QuantSpec of a variant: FP32 nodes, 16-bit tensors, per-node fixes (on other tensors)."""
        int16 = set(overrides)
        fixed = sorted((f for f in set(fixes) if f.tensor not in int16), key=lambda f: f.tensor)
        return dataclasses.replace(
            self.base_spec,
            per_channel=self.per_channel if per_channel is None else per_channel,
            nodes_to_exclude=tuple(sorted(set(nodes), key=self.structure.order.__getitem__)),
            tensor_overrides=tuple(TensorOverride(t, self.int16_type) for t in sorted(int16)) + tuple(fixed),
        )

    def build(
        self,
        nodes: Iterable[str],
        overrides: Iterable[str] = (),
        per_channel: bool | None = None,
        keep_float: Iterable[str] = (),
        fixes: Iterable[TensorOverride] = (),
    ) -> tuple[QuantSpec, onnx.ModelProto, float]:
        """Quantize a variant from the cached ranges; close leaks so ``keep_float`` tensors stay float."""
        start = time.perf_counter()
        nodes = set(nodes)
        keep = set(keep_float)
        pc = self.per_channel if per_channel is None else per_channel
        asked = (frozenset(nodes), frozenset(overrides), pc, frozenset(keep), frozenset(fixes))
        if asked in self.built:  # the answer and the frontier's points are built again after the search
            self.built.move_to_end(asked)
            spec, data = self.built[asked]
            return spec, onnx.load_from_string(data), time.perf_counter() - start
        for _ in range(4):
            spec = self.spec(nodes, overrides, per_channel, fixes)
            model = quantize_model(self.normalized, self.ranges, spec, load_check=False)
            if not keep:
                break
            index = GraphIndex(model)
            extra = set()
            for t in keep:
                dq = index.dequant_of(t)
                if dq is None:
                    continue
                for consumer in index.consumers.get(dq[0], []):
                    if consumer.name in self.structure.excludable and consumer.name not in nodes:
                        extra.add(consumer.name)
            if not extra:
                break
            nodes |= extra
        self._keep_built(asked, spec, model)
        if keep:  # the trace records the nodes leaks were closed with: the answer is built again from those
            self._keep_built((frozenset(nodes), asked[1], pc, frozenset(), asked[4]), spec, model)
        return spec, model, time.perf_counter() - start

    def prescore(self, model: onnx.ModelProto, result: EvalResult) -> None:
        """Take ``result`` as this search's evaluator's score of ``model`` (scored before the search)."""
        self.prescored[model_digest(model)] = result

    def adopt_static(self, data: bytes) -> None:
        """Take ``data`` (a serialized model) as the static variant, built: analyze's own, checked by
        :func:`qdebug.propose.reuse.analyzed_static` to be what :meth:`build` would make."""
        asked = (frozenset(), frozenset(), self.per_channel, frozenset(), frozenset())
        if len(data) <= BUILT_BYTES:
            self.built[asked] = (self.spec((), ()), data)

    def _keep_built(self, asked: tuple, spec: QuantSpec, model: onnx.ModelProto) -> None:
        """Keep a built variant's serialized model, the oldest dropped beyond :data:`BUILT_BYTES` in all."""
        data = model.SerializeToString()
        if len(data) > BUILT_BYTES or asked in self.built:
            return
        self.built[asked] = (spec, data)
        total = sum(len(d) for _, d in self.built.values())
        while total > BUILT_BYTES:
            _, (_, dropped) = self.built.popitem(last=False)
            total -= len(dropped)

    def ask(
        self,
        nodes: Iterable[str],
        overrides: Iterable[str] = (),
        per_channel: bool | None = None,
        keep_float: Iterable[str] = (),
        fixes: Iterable[TensorOverride] = (),
    ) -> tuple:
        """A variant as asked (per-channel resolved now): what :meth:`evaluate`, :meth:`prefetch` and
        :meth:`evaluate_many` take, and the key of the cache of asked configurations."""
        pc = self.per_channel if per_channel is None else per_channel
        return (frozenset(nodes), frozenset(overrides), pc, frozenset(keep_float), frozenset(fixes))

    def evaluate(
        self,
        step: str,
        nodes: Iterable[str],
        overrides: Iterable[str] = (),
        per_channel: bool | None = None,
        keep_float: Iterable[str] = (),
        fixes: Iterable[TensorOverride] = (),
    ) -> Trial | None:
        """Score one variant (``None`` when the budget is spent); identical variants are scored once."""
        return self._evaluate(step, self.ask(nodes, overrides, per_channel, keep_float, fixes))

    def evaluate_many(self, step: str, asked: Sequence[tuple], reserve: int = 0) -> list[Trial | None]:
        """Score a round of variants side by side (:meth:`ask` tuples); the trials as :meth:`evaluate` one
        after another would give them, in the same order, with the same budget: a variant is scored while more
        than ``reserve`` evaluations are left, and none after the first that finds no more (``None`` there).

        The whole round goes to the pool (built here, in order, each while the ones before it are scored); the
        pool's size decides only how many run at the same time, so the trace is the same for any ``--workers``."""
        self.prefetch(asked, sure=True)
        out: list[Trial | None] = []
        for a in asked:
            if self.left <= reserve:
                break
            out.append(self._evaluate(step, a))
        return out + [None] * (len(asked) - len(out))

    def prefetch(self, asked: Sequence[tuple], sure: bool = False) -> None:
        """Hint the variants a strategy is likely to ask for next (:meth:`ask` tuples, likeliest first): while
        this process waits for a score, it builds them one by one and hands them to idle workers.

        Nothing is recorded: no trial, no budget, no cache entry. When :meth:`evaluate` later asks for one, it
        takes the model built and the score computed ahead (the numbers it would compute itself), spends the
        evaluation then and records the trial then; one never asked for cost only the work. So hints change
        a search's wall time, never its answer. Without a pool, or with one worker, they are ignored (nothing
        is built ahead), and the variants are built only while a score is awaited, so hints cost the main
        process no time of its own. ``sure``: every one will be asked for (a round of
        :meth:`evaluate_many`), so none waits for workers left idle. A new hint replaces the last one.
        """
        pool = self.pool
        if pool is None or pool.inline or self.left <= 0:
            return
        pool.drop_speculative()  # a new round: older hints not started yet are not worth a worker
        self.hinted = OrderedDict((a, sure) for a in asked)
        # a variant built for an older hint that no worker took up is let go (with its model)
        for a in [a for a, e in self.ahead.items() if a not in self.hinted and _unstarted(e)]:
            del self.ahead[a]

    def _work_ahead(self) -> bool:
        """One step of the work hinted (:meth:`prefetch`), done while a score is awaited: build the next hinted
        variant and start scoring it. False when nothing is left to do."""
        pool = self.pool
        assert pool is not None
        while self.hinted:
            a, sure = self.hinted.popitem(last=False)
            known = self.resolved.get(a)
            if known is not None and known in self.cache:
                continue
            entry = self.ahead.get(a)
            built = entry is None
            if entry is None:
                entry = self.ahead[a] = self._build_ahead(a)
                while len(self.ahead) > AHEAD_KEPT or sum(len(e.data) for e in self.ahead.values()) > AHEAD_BYTES:
                    del self.ahead[next(iter(self.ahead))]
            if entry.error is not None or entry.digest in self.by_model:  # no model, or its score is known
                if built:
                    return True
                continue
            if _unstarted(entry) or entry.evaluator is not self.evaluator:
                what = "candidate quantized model"
                entry.ticket = pool.submit(
                    self.evaluator, None, what, speculative=not sure, data=entry.data, numbers_only=True
                )
                entry.evaluator = self.evaluator
            return True
        return False

    def _build_ahead(self, asked: tuple) -> _Ahead:
        """Build an asked variant for :meth:`prefetch` (an error kept for the moment it is asked for)."""
        nodes, overrides, pc, keep_float, fixes = asked
        try:
            spec, model, qsec = self.build(nodes, overrides, pc, keep_float, fixes)
        except Exception as e:  # noqa: BLE001  (raised again, or skipped, only if it is ever asked for)
            return _Ahead(error=e)
        data = model.SerializeToString(deterministic=True)
        return _Ahead(spec, qsec, hashlib.sha256(data).hexdigest(), data, _qdq(model))

    def _evaluate(self, step: str, asked: tuple) -> Trial | None:
        nodes, overrides, pc, keep_float, fixes = asked
        known = self.resolved.get(asked)
        if known is not None and known in self.cache:
            return self.cache[known]
        if self.left <= 0:
            return None
        ahead = self.ahead.pop(asked, None)
        self.hinted.pop(asked, None)
        try:
            if ahead is not None and ahead.error is not None:
                raise ahead.error
            model: onnx.ModelProto | None = None
            if ahead is not None:
                spec, qsec = ahead.spec, ahead.qsec
            else:
                spec, model, qsec = self.build(nodes, overrides, pc, keep_float, fixes)
        except QDebugError as e:
            if not self.trials:  # full static itself: nothing to compare with, the run cannot go on
                raise
            return self._skipped(step, asked, e)
        int16 = tuple(o.tensor for o in spec.tensor_overrides if o.quant_type == self.int16_type)
        fixed = tuple(o for o in spec.tensor_overrides if o.quant_type != self.int16_type)
        key = (spec.nodes_to_exclude, int16, spec.per_channel, fixed)
        self.resolved[asked] = key
        if key in self.cache:
            return self.cache[key]
        # the same model from another list: excluding a node next to an excluded one often changes nothing
        # in ORT's rewrite (review: 5 of 16 evaluations on a depthwise CNN re-scored identical models)
        if ahead is not None:
            digest = ahead.digest
        else:
            assert model is not None
            digest = model_digest(model)
        same = self.by_model.get(digest)
        if same is not None:
            trial = dataclasses.replace(
                same, step=step, nodes=key[0], overrides=key[1], per_channel=key[2], fixes=key[3]
            )
            self.cache[key] = trial
            self.equivalents.append(trial)
            return trial
        try:
            result = self.prescored.pop(digest, None) or self._score(model, ahead)
        except QDebugError as scored:
            # built without ORT's trial load (the evaluation opens the one session): name the quantizer's fault
            # if it is one, and skip the candidate either way unless it is full static itself
            e = scored  # (a metric's own error had left this unbound: an UnboundLocalError, not its one line)
            if model is None:
                model = onnx.load_model_from_string(ahead.data)  # type: ignore[union-attr]
            try:
                check_quantized_loads(self.normalized, model)
            except QDebugError as quantizer_fault:
                e = quantizer_fault
            if not self.trials:
                raise e from None
            return self._skipped(step, asked, e, verb="load")
        qdq = ahead.qdq if ahead is not None else _qdq(model)  # type: ignore[arg-type]
        trial = Trial(
            step=step,
            nodes=key[0],
            overrides=key[1],
            per_channel=key[2],
            value=result.value,
            output_sqnr_db=result.output_sqnr_db,
            met=self.target.met(result),
            qdq_pairs=qdq,
            quantize_seconds=qsec,
            eval_seconds=result.seconds,
            fixes=key[3],
        )
        self._record(trial, key, digest, result)
        return trial

    def _record(self, trial: Trial, key: tuple, digest: str, result: EvalResult) -> None:
        """A new trial in the trace, the caches and the progress line; its score kept when it has per-sample
        numbers (scored here, not numbers only): the answer's interval is read from it."""
        self.trials.append(trial)
        self.cache[key] = trial
        self.by_model[digest] = trial
        self._keep(digest, self.evaluator, result)
        self.progress(f"search{DETAIL}{self.status(trial)}", len(self.trials), self.budget)

    def keep_result(self, model: onnx.ModelProto, scorer: object, result: EvalResult) -> None:
        """Keep ``scorer``'s score of ``model`` when it has per-sample numbers (scored here, not numbers only):
        the answer's interval is read from it, not evaluated again."""
        self._keep(model_digest(model), scorer, result)

    def _keep(self, digest: str, scorer: object, result: EvalResult) -> None:
        if result.values is not None:
            self.results[digest] = (scorer, result)
            while len(self.results) > RESULTS_KEPT:
                self.results.popitem(last=False)

    def _score(self, model: onnx.ModelProto | None, ahead: _Ahead | None) -> EvalResult:
        """The candidate's score: the one started by :meth:`prefetch`, else one asked of the pool (or of the
        evaluator, without a pool) now."""
        what = "candidate quantized model"
        if self.pool is None:
            assert model is not None
            return self.evaluator.score(model, what=what)
        if ahead is not None and not _unstarted(ahead) and ahead.evaluator is self.evaluator:
            ticket = ahead.ticket
        else:
            data = ahead.data if ahead is not None else None
            ticket = self.pool.submit(self.evaluator, model, what, data=data, numbers_only=True)
        assert ticket is not None
        return self.pool.result(ticket, idle=self._work_ahead)

    def status(self, trial: Trial) -> str:
        """What a person follows during a long search: the trial just scored and the best answer so far
        (``12 nodes · top1 87.00% · best 99.00% @ 3 nodes``)."""
        line = f"{_size(trial)} · {self.target.show(trial)}"
        met = [t for t in self.trials if t.met and self.fits(t)]
        if met:
            best = min(met, key=lambda t: (len(t.nodes) + len(t.overrides), -self.score(t)))
            return f"{line} · best {self.target.show(best)} @ {_size(best)}"
        best = max(self.trials, key=self.score)
        return f"{line} · best {self.target.show(best)} (target {self.target.show_threshold()})"

    def _skipped(self, step: str, asked: tuple, error: QDebugError, verb: str = "build") -> Trial:
        """A candidate ORT's quantizer cannot build: a reasoned skip in the notes, scored as missing the target
        (no evaluation spent), so the search goes on without it instead of failing the run."""
        nodes, overrides, pc, _, fixes = asked
        what = "per-channel weights" if step == "per-channel" else f"a {step} candidate"
        self.skips.append(f"skipped {what} ONNX Runtime could not {verb} ({error.message})")
        trial = Trial(
            step, tuple(sorted(nodes)), tuple(sorted(overrides)), pc, math.nan, math.nan, False, 0, 0.0, 0.0,
            tuple(fixes),
        )
        self.cache[asked] = trial
        self.resolved[asked] = asked
        return trial

    def fits(self, trial: Trial) -> bool:
        """Whether a trial keeps at most ``max_nodes`` nodes FP32."""
        return self.max_nodes is None or len(trial.nodes) <= self.max_nodes

    def score(self, trial: Trial) -> float:
        """The target's number for a trial (``-inf`` for nan)."""
        v = self.target.value(trial)
        return -math.inf if math.isnan(v) else v


def _size(trial: Trial) -> str:
    """``3 nodes``, ``3 nodes + 2 16-bit``: what a trial changes."""
    text = f"{len(trial.nodes)} node{'s' if len(trial.nodes) != 1 else ''}"
    if trial.overrides:
        text += f" + {len(trial.overrides)} 16-bit"
    return f"{text} + {len(trial.fixes)} fixed" if trial.fixes else text


@dataclass(frozen=True)
class Fix:
    """A unit kept INT8 by a cheaper change than FP32 (:data:`FIXES`)."""

    unit: Unit
    kind: str
    """One of :data:`FIXES`."""
    overrides: tuple[TensorOverride, ...]
    why: str
    """What the change is, in numbers (the clipped range and the share of values it keeps)."""


FIXES = PER_UNIT_FIXES
"""The per-unit fixes from the report's own numbers, cheapest first (:mod:`qdebug.vocabulary`)."""
"""Per-node fixes tried, in this order, before 16-bit activations and FP32: a clipped activation range
(from the cached histogram), per-channel weights for that node, 7-bit weights (u8s8 kernels without VNNI)."""


@dataclass(frozen=True)
class Plan:
    """A candidate configuration: units kept FP32, units given 16-bit activations, units fixed cheaper."""

    fp32: tuple[Unit, ...] = ()
    int16: tuple[Unit, ...] = ()
    fixed: tuple[Fix, ...] = ()

    def fixes(self) -> set[TensorOverride]:
        """The per-node fixes' overrides."""
        return {o for f in self.fixed for o in f.overrides}

    def nodes(self) -> set[str]:
        """Nodes to exclude."""
        return {n for u in self.fp32 for n in u.nodes}

    def overrides(self) -> set[str]:
        """Tensors to quantize with 16 bits."""
        return {t for u in self.int16 for t in u.tensors if t not in self.nodes_tensors()}

    def nodes_tensors(self) -> set[str]:
        """Tensors the FP32 units keep float (no point in overriding them)."""
        return {u.key for u in self.fp32 if u.kind == "tensor"}

    def keep_float(self) -> set[str]:
        """Tensors whose Q/DQ must be gone in the rewritten graph (leaks: exclude the neighbour too)."""
        return self.nodes_tensors()

    def units(self) -> tuple[Unit, ...]:
        """All units, FP32 ones first."""
        return self.fp32 + self.int16 + tuple(f.unit for f in self.fixed)

    def with_units(self, units: Sequence[Unit], action: str) -> Plan:
        """A copy of this plan with ``units`` added under ``action``."""
        if action == "int16":
            return Plan(self.fp32, self.int16 + tuple(units), self.fixed)
        return Plan(self.fp32 + tuple(units), self.int16, self.fixed)


Rerank = Callable[[Plan, bool], list[Unit]]
"""Candidate units ranked again given what a plan already keeps float (the bool widens the ranking to every
quantized tensor): a short layer capture of the plan's variant reveals error the first ranking masked."""


def evaluate_plan(search: Search, step: str, plan: Plan) -> Trial | None:
    """Score ``plan`` (``None`` when the budget is spent); its FP32 tensors' leaks are closed first."""
    return search.evaluate(step, plan.nodes(), plan.overrides(), keep_float=plan.keep_float(), fixes=plan.fixes())


def plan_ask(search: Search, plan: Plan) -> tuple:
    """``plan`` as :meth:`Search.ask` puts a variant (for :meth:`Search.prefetch` and
    :meth:`Search.evaluate_many`), exactly as :func:`evaluate_plan` would ask for it."""
    return search.ask(plan.nodes(), plan.overrides(), keep_float=plan.keep_float(), fixes=plan.fixes())


REFINE_EVALS = 6
"""Evaluations the default budget holds back from the growth for refining its answer: pairs of nodes that
only go together, and units tried alone (both had found smaller answers the budget left no room for)."""


def default_budget(candidate_nodes: int) -> int:
    """``2*ceil(log2 L) + 10`` evaluations for ``L`` candidate nodes to find an answer, plus
    :func:`held_back` ones to minimize and refine it."""
    return 2 * math.ceil(math.log2(max(candidate_nodes, 2))) + 10 + held_back(candidate_nodes)


def held_back(candidate_nodes: int) -> int:
    """Evaluations the growth may not spend: ``2*ceil(log2 L)`` for the group-testing minimization (a few
    necessary units among ``L`` cost about that many each), :data:`REFINE_EVALS` and :data:`FIX_EVALS`."""
    return 2 * math.ceil(math.log2(max(candidate_nodes, 2))) + REFINE_EVALS + FIX_EVALS


FIX_EVALS = 6
"""Evaluations for trying per-node fixes (a clipped range, one node's per-channel or 7-bit weights) on the
minimized answer's units before leaving them FP32."""


def without_per_channel(search: Search, final: Trial, in_effect: bool) -> Trial:
    """``final`` without per-channel weights when they do not earn their place.

    Per-channel is adopted before the exclusions are searched; once they are
    found it may change nothing (no weight with more than one scale is left)
    or even hurt (on a depthwise CNN the final set scored 41.2 dB with it and
    43.9 dB without). One more evaluation decides: the set without it is kept
    when it meets the target as well, or scores at least as high.
    """
    if not in_effect:  # the same model either way: no evaluation needed
        return dataclasses.replace(final, per_channel=False)
    plain = search.evaluate(
        "without per-channel", final.nodes, final.overrides, per_channel=False, fixes=final.fixes
    )
    if plain is None:  # the budget is spent
        return final
    if (plain.met and final.met) or (plain.met, search.score(plain)) >= (final.met, search.score(final)):
        return plain
    return final


def final_answer(search: Search, plan: Plan, met: Trial | None) -> tuple[Plan, Trial]:
    """The met trial if it fits ``max_nodes``; else the best trial that fits (fewest nodes among equals)."""
    if met is not None and search.fits(met):
        return plan, met
    fitting = [t for t in [*search.trials, *search.equivalents] if search.fits(t)]
    best = max(fitting, key=lambda t: (t.met, search.score(t), -len(t.nodes) - len(t.overrides)))
    return plan_of(plan, best), best


def plan_of(plan: Plan, trial: Trial) -> Plan:
    """The units of ``plan`` that ``trial`` applies (its nodes not in them get the neighbour's reason)."""
    nodes, overrides = set(trial.nodes), set(trial.overrides)
    fp32 = tuple(u for u in plan.fp32 if set(u.nodes) <= nodes)
    int16 = tuple(u for u in plan.int16 if set(u.tensors) & overrides)
    fixed = tuple(f for f in plan.fixed if set(f.overrides) <= set(trial.fixes))
    return Plan(fp32, int16, fixed)
