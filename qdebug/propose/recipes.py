"""Recipes first: when full static INT8 misses the target, the whole-model recipes are scored before any node.

The per-node search answers "which nodes need more bits"; on a model whose error is spread over every layer
(a per-tensor MobileNet, a Transformer with outlier channels) its honest answer was "most of them", the
INT8 speed-up gone. The known remedies are whole-model recipes (:mod:`qdebug.vocabulary`): a
transform of the FP32 model that ORT's quantizer then quantizes as usual. This stage builds each
applicable one, checks that an equivalence transform leaves the FP32 outputs as they were, calibrates it
(cached like every calibration), quantizes it with the run's settings and scores it on the search's
(screening) evaluator. The first recipe, in the registry's order, that meets the target is the base of
the rest of propose, which then has nothing left to change. When none meets it alone, the per-node search
starts from plain static as before (a planted culprit stays a one-node answer, not a recipe plus that
node), and the best recipe is named in the notes and measured in the frontier. Every number reported is
still confirmed on all samples and timed, in the frontier, like the search's own points.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import onnx

from qdebug.errors import QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator
from qdebug.evaluation.gates import SPEED_MARGIN, slower_than_fp32, static_buys_speed
from qdebug.graph.load import save_model
from qdebug.output.files import sha256_file
from qdebug.prepare import AnalyzeOptions, Prepared, calibrated
from qdebug.progress import Progress
from qdebug.propose.blame import Unit
from qdebug.propose.search import Target
from qdebug.quant.quantize import QuantSpec, quantize_model, quantize_static_model
from qdebug.recipes.base import Transformed
from qdebug.records.proposal import RecipeRecord
from qdebug.runtime.kernels import u8s8_saturates
from qdebug.runtime.timing import time_sessions
from qdebug.vocabulary import RECIPES, recipe, spec_changes

RECIPE_SAMPLES = 64
"""Calibration samples the recipes' statistics and equivalence checks read (the ranges use them all)."""
SMOOTH_ALPHAS = (0.5, 0.75, 0.25)
"""SmoothQuant's migration strengths tried, most common first; the later ones only while each helps."""
EQUIVALENCE_RTOL = 1e-3
"""Largest relative output difference an equivalence transform may make (float rounding is ~1e-6)."""
GAIN = 1e-9
"""A recipe that does not score above plain static by more than this is no base for the search."""
SPEED_RUNS = 20
"""Timed runs of FP32, full static and a dynamic or mixed model that meets the target, interleaved, before it
may be the answer: run-time quantization can cost more than INT8 saves (a recognizer's dynamic model ran at
0.26x FP32)."""


@dataclass(frozen=True)
class RecipeTrial:
    """One recipe tried: its transformed FP32 model, prepared and scored (``result`` None: refused)."""

    name: str
    steps: tuple[str, ...]
    transformed: Transformed
    prep: Prepared | None
    result: EvalResult | None
    met: bool
    params: tuple[tuple[str, float], ...] = ()
    refused: str = ""
    built: bytes = b""
    """A dynamic or mixed recipe's quantized model as scored (serialized): timed and compared from this, not
    built again (``quantize_dynamic`` of a large model takes seconds)."""

    def quantized(self) -> onnx.ModelProto | None:
        """The quantized model kept from scoring (None: a transform, whose model the search builds)."""
        return onnx.load_model_from_string(self.built) if self.built else None


@dataclass(frozen=True)
class RecipeStage:
    """What the stage found: the base for the search (``prep``), the recipe chosen, every trial and notes."""

    prep: Prepared
    chosen: RecipeTrial | None
    trials: tuple[RecipeTrial, ...]
    static_value: float
    notes: tuple[str, ...]
    static: tuple[onnx.ModelProto, EvalResult] | None = None
    """Plain full static INT8 and its score by the stage's evaluator: the search takes it as its first trial."""
    scored: tuple[tuple[onnx.ModelProto, EvalResult], ...] = ()
    """Other models the stage scored that the search will ask for (per-channel weights): not scored again."""
    deferred: RecipeTrial | None = None
    """The first dynamic or mixed recipe that meets the target (and keeps the speed-up): it changes how every
    MatMul is quantized, so the per-node search runs first and it becomes the answer only where the search's
    answer is no better (:func:`replaces`)."""

    @property
    def runner_up(self) -> RecipeTrial | None:
        """The best transform that beat the search's base without meeting the target (None when the recipe
        chosen meets it): the per-node search starts from it where the search from the base falls short."""
        if self.chosen is not None and self.chosen.met:
            return None
        base = self.chosen.result.value if self.chosen is not None and self.chosen.result is not None else None
        others = [t for t in self.trials if recipe(t.name).transforms and t.prep is not None and t is not self.chosen]
        return _choose(others, self.static_value if base is None else base)

    @property
    def near_miss(self) -> RecipeTrial | None:
        """The best dynamic or mixed recipe that missed the target alone but beat plain static (None when one
        met it): the per-node search on its quantizer -- ``quantize_dynamic`` with ``nodes_to_exclude`` -- may
        meet it with a few nodes kept FP32 (:func:`run_time_units`)."""
        if self.deferred is not None:
            return None
        near = [
            t for t in self.trials
            if not recipe(t.name).transforms and t.result is not None and not t.met
            and math.isfinite(t.result.value) and t.result.value > self.static_value + GAIN
        ]  # fmt: skip
        return max(near, key=lambda t: t.result.value) if near else None  # type: ignore[union-attr]

    def with_run_time(self, trial: RecipeTrial, note: str) -> RecipeStage:
        """The stage with ``trial`` (a dynamic or mixed recipe that missed alone) as the base of the answer,
        which keeps some nodes FP32 on top of it."""
        return dataclasses.replace(self, chosen=trial, deferred=None, notes=(*self.notes, note))

    def with_base(self, trial: RecipeTrial) -> RecipeStage:
        """The stage with ``trial`` (a transform that missed the target alone) as the base of the answer."""
        return dataclasses.replace(self, prep=trial.prep, chosen=trial, deferred=None)

    def with_chosen(self, trial: RecipeTrial) -> RecipeStage:
        """The stage with ``trial`` (the deferred recipe) as the base the answer is built on."""
        note = f"recipe {_label(trial)} meets the target: it is the answer"
        return dataclasses.replace(self, chosen=trial, deferred=None, notes=(*self.notes, note))

    @property
    def changes(self) -> dict[str, object]:
        """What the chosen recipe changes in the quantizer settings (how ORT builds the model, 7-bit weights)."""
        return spec_changes(self.chosen.steps, self.chosen.params) if self.chosen is not None else {}

    def prescored(self) -> tuple[tuple[onnx.ModelProto, EvalResult], ...]:
        """What the search may take as scored: plain static when it stays the base, and the others."""
        plain = (self.static,) if self.static is not None and self.chosen is None else ()
        return (*plain, *self.scored)

    def record(self, path: Path | None) -> RecipeRecord | None:
        """The proposal's record of the chosen recipe; ``path`` is where its FP32 model was saved."""
        if self.chosen is None:
            return None
        t = self.chosen
        path = path if recipe(t.name).transforms else None  # dynamic, mixed: the user's FP32 model as it is
        return RecipeRecord(
            name=t.name,
            steps=t.steps,
            params=t.params,
            fp32_model=str(path.resolve()) if path is not None else None,
            fp32_sha256=sha256_file(path) if path is not None else "",
            changed=t.transformed.changed,
            removed=t.transformed.removed,
            screened_metric=t.result.value if t.result is not None else math.nan,
            notes=t.transformed.notes,
        )


def wanted(asked: Sequence[str] | None) -> tuple[str, ...]:
    """The recipes a run may try: ``None`` every one in the registry, else those named (checked)."""
    if asked is None:
        return tuple(RECIPES)
    unknown = [a for a in asked if a not in RECIPES]
    if unknown:
        from qdebug.errors import ExitCode

        raise QDebugError(
            f"--recipes names unknown recipe(s): {', '.join(unknown)}",
            f"use some of {', '.join(RECIPES)}, or 'none'",
            ExitCode.USAGE,
        )
    return tuple(asked)


def run_recipes(
    prep: Prepared,
    evaluator: Evaluator,
    target: Target,
    options: AnalyzeOptions,
    workdir: Path,
    progress: Progress,
    names: Sequence[str],
    static_bytes: bytes | None = None,
    per_channel_first: bool = False,
    speed_runs: int = SPEED_RUNS,
) -> RecipeStage:
    """Score plain static and, when it misses ``target``, each applicable recipe in ``names``; choose the base.
    ``static_bytes``: plain static already built (analyze's, when it is what this run would build).
    ``per_channel_first``: per-channel weights (a quantizer option, no transformed model: the smaller change)
    are scored before any recipe, and when they meet the target no recipe is tried (the per-node search
    then finds them, as its first whole-model fix, without scoring them again). ``speed_runs``: timed runs
    that a dynamic or mixed model meeting the target must beat FP32 in (0: not timed, taken as it scores)."""
    assert prep.ranges is not None
    spec = QuantSpec.of(prep.settings)
    if static_bytes is not None:
        static_model = onnx.load_model_from_string(static_bytes)
    else:
        static_model = quantize_static_model(prep.normalized, prep.ranges, spec, load_check=False)
    static = evaluator.score(static_model)
    plain = (static_model, static)
    ops = {n.op_type for n in prep.normalized.graph.node}
    if target.met(static):
        # ORT's documented path folds BatchNormalization before quantizing (quant_pre_process): a model
        # that meets the target anyway is still built that way when that meets it too, for its speed
        names = [n for n in names if n == "fold-bn"]
    if not names:
        return RecipeStage(prep, None, (), target.value(static), (), plain)
    if per_channel_first and not target.met(static) and not spec.per_channel:
        pc = _per_channel(prep, spec, evaluator)
        if pc is not None and target.met(pc[1]):
            note = (
                f"full static INT8 misses the target ({target.show(static)}); per-channel weights meet it "
                f"({target.show(pc[1])}): no recipe was needed"
            )
            return RecipeStage(prep, None, (), target.value(static), (note,), plain, (pc,))
    trials: list[RecipeTrial] = []
    notes: list[str] = []
    builders = _builders(prep, names, target.value(static))
    for i, (name, build) in enumerate(builders):
        if any(t.met for t in trials):  # the least change that meets the target is the answer
            break
        entry = recipe(name)
        if entry.applies_to and not ops & set(entry.applies_to) or entry.also_needs and not ops & set(entry.also_needs):
            continue
        progress("recipes", i, len(builders))
        try:
            for transformed, steps, params in build(trials):
                trial = _score(prep, name, steps, params, transformed, evaluator, target, options, workdir)
                if trial.met and not entry.transforms and speed_runs > 0:
                    trial, note = _keeps_speed(trial, prep, evaluator, speed_runs, static_model)
                    notes.extend([note] if note else [])
                trials.append(trial)
                if trial.met or trial.result is None:
                    break
        except QDebugError as e:
            notes.append(f"recipe {name} could not be tried: {e.message}")
    progress("recipes", len(builders), len(builders))
    met = [t for t in trials if t.met and t.prep is not None]
    chosen = next((t for t in met if recipe(t.name).transforms), None)
    deferred = next((t for t in met if not recipe(t.name).transforms), None) if chosen is None else None
    folded = _folded_base(trials, target, static) if chosen is None and deferred is None else None
    notes.extend(_notes(trials, chosen, target, static, deferred, folded))
    chosen = chosen or folded
    base = chosen.prep if chosen is not None and chosen.prep is not None else prep
    return RecipeStage(base, chosen, tuple(trials), target.value(static), tuple(notes), plain, deferred=deferred)


def _folded_base(trials: Sequence[RecipeTrial], target: Target, static: EvalResult) -> RecipeTrial | None:
    """BatchNormalization folded into its Conv, when no recipe meets the target and folding scores no worse than
    plain static: the model ORT's documented pre-processing (``quant_pre_process``) quantizes, so the per-node
    search starts from it and qdebug's baseline is never the slower path (a BatchNormalization left between Q/DQ
    pairs runs a float kernel, quantized twice: a MobileNetV3 classifier's plain static ran at 0.58x FP32's
    speed, folded at 1x). Not with a dynamic or mixed recipe waiting: those quantize the user's model as it is."""
    fold = next((t for t in trials if t.steps == ("fold-bn",) and t.prep is not None and t.result is not None), None)
    if fold is None or fold.result is None or target.value(fold.result) < target.value(static):
        return None
    return fold


def replaces(
    deferred: RecipeTrial, answer_met: bool, fp32_nodes: Sequence[str], quantizable: int, ops: dict[str, str]
) -> str:
    """Why the deferred dynamic or mixed recipe replaces the per-node search's answer ("": it does not). It
    does when the answer misses the target, keeps most quantizable nodes FP32 (the INT8 speed-up gone), or
    keeps FP32 only nodes the recipe quantizes at run time (MatMul, Gemm, LSTM: the recipe has them INT8
    where the answer has them float) -- for ``dynamic`` only on a model without convolutions, which it
    would run as slow ConvInteger. ``ops``: each node's op type."""
    from qdebug.evaluation.gates import mostly_fp32
    from qdebug.vocabulary import DYNAMIC_OPS

    if not answer_met:
        return "the per-node search found no answer that meets the target"
    if mostly_fp32(len(fp32_nodes), quantizable):
        return f"the per-node search's answer keeps {len(fp32_nodes)} of {quantizable} quantizable nodes FP32"
    # dynamic quantizes a Conv at run time too (ConvInteger, far slower than static INT8): only where the
    # model has none does it keep, INT8, everything the answer quantizes statically that costs time
    convs = any(op in ("Conv", "ConvTranspose") for op in ops.values())
    if deferred.name == "dynamic" and convs:
        return ""
    if fp32_nodes and all(ops.get(n) in DYNAMIC_OPS for n in fp32_nodes):
        kinds = ", ".join(sorted({ops[n] for n in fp32_nodes}))
        return (
            f"the per-node search's answer keeps {len(fp32_nodes)} {kinds} node(s) FP32, which recipe "
            f"{_label(deferred)} quantizes at run time"
        )
    return ""


Build = Callable[[list[RecipeTrial]], Iterator[tuple[Transformed, tuple[str, ...], tuple[tuple[str, float], ...]]]]


def _builders(prep: Prepared, names: Sequence[str], static_value: float) -> list[tuple[str, Build]]:
    """Each wanted recipe's builder, in the registry's order: a generator of transformed models to score
    (SmoothQuant yields one per alpha; it stops at the first that meets the target)."""
    model = prep.normalized

    def fold(_: list[RecipeTrial]):
        from qdebug.recipes.fold import fold_batchnorm

        t = fold_batchnorm(model)
        if t.touched:
            yield t, ("fold-bn",), ()

    def equalize(_: list[RecipeTrial]):
        from qdebug.recipes.equalize import equalize as cle
        from qdebug.recipes.fold import fold_batchnorm

        folded = fold_batchnorm(model)
        t = cle(folded.model)
        if t.touched:
            yield _chain(folded, t), ("fold-bn", "equalize") if folded.touched else ("equalize",), ()

    def smooth(_: list[RecipeTrial]):
        from qdebug.recipes.smooth import smooth as sq
        from qdebug.recipes.smooth import smoothable
        from qdebug.recipes.stats import channel_stats

        sites = smoothable(model)
        if not sites:
            return
        stats = channel_stats(model, [s.tensor for s in sites], _batches(prep))
        absmax = {k: v.absmax for k, v in stats.items()}
        for alpha in SMOOTH_ALPHAS:
            t = sq(model, absmax, alpha=alpha)
            if not t.touched:
                return
            yield t, ("smooth",), (("alpha", alpha),)

    def bias(trials: list[RecipeTrial]):
        from qdebug.recipes.bias import bias_correction_tensors, bias_probe, correct_bias
        from qdebug.recipes.stats import channel_stats

        base, base_prep, steps = model, prep, ()
        best = _choose([t for t in trials if recipe(t.name).equivalent and recipe(t.name).transforms], static_value)
        if best is not None and best.prep is not None:  # on top of the best equivalence transform beating static
            base, base_prep, steps = best.prep.normalized, best.prep, best.steps
        if not bias_correction_tensors(base):
            return
        assert base_prep.ranges is not None
        quantized = quantize_static_model(base, base_prep.ranges, QuantSpec.of(base_prep.settings), load_check=False)
        # each layer's own shift: its FP32 twin reads the same quantized input in a probe copy of the QDQ model
        # (FP32 against QDQ end to end counts every upstream shift again downstream, and over-corrects)
        probe = bias_probe(base, quantized)
        stats = channel_stats(probe.model, probe.tensors(), _batches(prep))
        fp32 = {k: stats[r].mean for k, r in probe.reference.items()}
        t = correct_bias(base, fp32, {k: stats[q].mean for k, q in probe.quantized.items()})
        if t.touched:
            yield t, (*steps, "bias-correction"), ()

    # ORT's advice for CPUs whose u8s8 kernels saturate (no VNNI): 7-bit weights for quantize_dynamic
    reduce = (("reduce_range", 1.0),) if u8s8_saturates() and not prep.settings.reduce_range else ()

    def quantized_as_is(name: str) -> Build:
        def build(_: list[RecipeTrial]):
            yield Transformed(model=model), (name,), reduce

        return build

    table = {"fold-bn": fold, "equalize": equalize, "smooth": smooth, "bias-correction": bias}
    table.update({n: quantized_as_is(n) for n, r in RECIPES.items() if not r.transforms})
    return [(n, table[n]) for n in RECIPES if n in names]


def _per_channel(prep: Prepared, spec: QuantSpec, evaluator: Evaluator) -> tuple[onnx.ModelProto, EvalResult] | None:
    """Full static INT8 with per-channel weights, scored (None: ORT's quantizer cannot build it)."""
    assert prep.ranges is not None
    try:
        spec = dataclasses.replace(spec, per_channel=True)
        model = quantize_static_model(prep.normalized, prep.ranges, spec, load_check=False)
        return model, evaluator.score(model)
    except QDebugError:
        return None


def _chain(first: Transformed, second: Transformed) -> Transformed:
    """Two transforms applied in turn, as one."""
    return Transformed(
        model=second.model,
        changed=tuple(dict.fromkeys(n for n in (*first.changed, *second.changed) if n not in second.removed)),
        removed=tuple(dict.fromkeys((*first.removed, *second.removed))),
        notes=(*first.notes, *second.notes),
    )


def _batches(prep: Prepared) -> Iterator[dict[str, np.ndarray]]:
    """The first :data:`RECIPE_SAMPLES` calibration samples' feeds, batch by batch."""
    seen = 0
    for batch in prep.calib.batches():
        yield dict(batch.feeds)
        seen += batch.size
        if seen >= RECIPE_SAMPLES:
            return


def _score(
    prep: Prepared,
    name: str,
    steps: tuple[str, ...],
    params: tuple[tuple[str, float], ...],
    transformed: Transformed,
    evaluator: Evaluator,
    target: Target,
    options: AnalyzeOptions,
    workdir: Path,
) -> RecipeTrial:
    """Check, calibrate, quantize and score one transformed model (refused: with the reason, unscored); a
    recipe that only chooses how ORT quantizes (dynamic, mixed) is built from the run's own ranges."""
    if not recipe(name).transforms:
        assert prep.ranges is not None
        spec = QuantSpec.of(prep.settings, **spec_changes(steps, params))  # type: ignore[arg-type]
        model = quantize_model(prep.normalized, prep.ranges, spec, load_check=False)
        result = evaluator.score(model)
        return RecipeTrial(
            name, steps, transformed, prep, result, target.met(result), params, built=model.SerializeToString()
        )
    if all(recipe(s).equivalent for s in steps):
        from qdebug.recipes.equivalence import check_equivalent

        same = check_equivalent(prep.normalized, transformed.model, islice(_batches(prep), 8), rtol=EQUIVALENCE_RTOL)
        if not same.ok:
            return RecipeTrial(name, steps, transformed, None, None, False, params, refused=same.describe())
    tag = "+".join(steps) + "".join(f"-{k}{v:g}" for k, v in params)
    path = workdir / f"recipe.{tag}.onnx"
    save_model(transformed.model, path)
    base = dataclasses.replace(prep, normalized=transformed.model, normalized_path=path, ranges=None)
    ready = calibrated(base, prep.settings, options)
    assert ready.ranges is not None
    model = quantize_static_model(ready.normalized, ready.ranges, QuantSpec.of(ready.settings), load_check=False)
    result = evaluator.score(model)
    return RecipeTrial(name, steps, transformed, ready, result, target.met(result), params)


def _built(trial: RecipeTrial, prep: Prepared) -> onnx.ModelProto:
    """``trial``'s quantized model, built from ``prep``'s ranges (a trial made without keeping it)."""
    assert prep.ranges is not None
    spec = QuantSpec.of(prep.settings, **spec_changes(trial.steps, trial.params))  # type: ignore[arg-type]
    return quantize_model(prep.normalized, prep.ranges, spec, load_check=False)


def better_on_both_axes(
    deferred: RecipeTrial,
    deferred_value: float,
    prep: Prepared,
    evaluator: Evaluator,
    runs: int,
    answer: onnx.ModelProto,
    answer_value: float,
) -> str:
    """Why the deferred dynamic or mixed recipe (its target value ``deferred_value``) is a better answer
    than the per-node search's ``answer`` (``answer_value``, by the same evaluator and target) on both axes:
    it scores at least as well and its median run is 10 % faster (``runs`` interleaved runs on the evaluation's
    first batch: on an idle 2-core machine the medians of a pair held within 11-21 % over repeats, where the
    p95 tails overlapped). "" when it is not, or when nothing is timed (``runs`` 0)."""
    if runs <= 0 or not evaluator.batches or prep.ranges is None or not deferred_value >= answer_value:
        return ""
    model = deferred.quantized() or _built(deferred, prep)
    first = evaluator.batches[0]
    timings = time_sessions({"answer": answer, "recipe": model}, first.feeds, evaluator.config, runs=runs,
                            rows=first.size)  # fmt: skip
    mine, theirs = timings["recipe"], timings["answer"]
    if not mine.p50_ms < (1 - SPEED_MARGIN) * theirs.p50_ms:  # medians of interleaved runs, 10 % apart
        return ""
    return (
        f"recipe {_label(deferred)} scores at least as well as the per-node search's answer and runs faster "
        f"(p50 {mine.p50_ms:.3g} vs {theirs.p50_ms:.3g} ms)"
    )


def run_time_units(ranked: Sequence[Unit], quantizer: str, run_time: Sequence[str] = ()) -> list[Unit]:
    """The per-node search's units under a dynamic or mixed recipe. ``mixed`` quantizes every node by one
    pass or the other: its units are the static ranking's (``ranked``). ``dynamic``: each ranked unit cut to
    the nodes ``quantize_dynamic`` quantizes (``run_time``, graph order; a LayerNorm kept float changes
    nothing there, the MatMuls reading it do), repeats dropped, then every other such node alone: the static
    report blames what static ranges break, and a MatMul whose input carries outlier channels may rank low
    there while it is the one run-time ranges break."""
    if quantizer != "dynamic":
        return list(ranked)
    quantized = set(run_time)
    out: list[Unit] = []
    seen: set[tuple[str, ...]] = set()
    for u in ranked:
        nodes = tuple(n for n in u.nodes if n in quantized)
        if nodes and nodes not in seen:
            seen.add(nodes)
            out.append(u if nodes == u.nodes else dataclasses.replace(u, nodes=nodes, tensors=()))
    covered = {n for u in out for n in u.nodes}
    for n in run_time:
        if n not in covered:
            out.append(Unit(f"node:{n}", "node", (n,), (), 0.0, n, "quantized at run time by the dynamic recipe"))
    return out


RANK_RUNS = 30
"""Interleaved runs each when two answers that both meet the target are compared for speed: three rounds of
ten, so that "faster" or "slower" is said only where every round agrees (one noisy pair of medians had
flipped the answer between identical runs)."""


@dataclass(frozen=True)
class SpeedComparison:
    """Two models timed alike: their p50s and whether the first is faster or slower in every round."""

    mine_ms: float
    theirs_ms: float
    verdict: str
    """``faster`` / ``slower`` (every round :data:`SPEED_MARGIN` apart, the same way) or ``same``."""


def compare_speed(
    mine: onnx.ModelProto, theirs: onnx.ModelProto, evaluator: Evaluator, runs: int
) -> SpeedComparison | None:
    """``mine`` against ``theirs``, ``runs`` interleaved runs each on the evaluation's first batch, in rounds
    of ten; None when nothing is timed (``runs`` 0, no batch)."""
    from qdebug.records.verify import speed_ratio

    if runs <= 0 or not evaluator.batches:
        return None
    first = evaluator.batches[0]
    timings = time_sessions({"mine": mine, "theirs": theirs}, first.feeds, evaluator.config, runs=runs,
                            rows=first.size)  # fmt: skip
    a, b = timings["mine"], timings["theirs"]
    ratio = speed_ratio(b.rounds_ms, a.rounds_ms)  # theirs over mine: above 1, mine is faster
    lows, highs = (ratio.low, ratio.high) if ratio is not None else (b.p50_ms / a.p50_ms,) * 2
    verdict = "faster" if lows * (1 - SPEED_MARGIN) > 1 else "slower" if highs < 1 - SPEED_MARGIN else "same"
    return SpeedComparison(a.p50_ms, b.p50_ms, verdict)


def _keeps_speed(
    trial: RecipeTrial, prep: Prepared, evaluator: Evaluator, runs: int, static: onnx.ModelProto
) -> tuple[RecipeTrial, str]:
    """``trial`` (a dynamic or mixed model that meets the target) as the answer unless it gives the INT8
    speed-up back: slower than FP32 beyond the noise where full static INT8 is faster beyond it, timed on
    the evaluation's first batch (``runs`` interleaved runs each; verify's rule, :mod:`qdebug.evaluation.gates`).
    Where static buys no speed on this CPU, speed is not judged, as verify does. Refused: not met, with a note."""
    if not evaluator.batches or prep.ranges is None:
        return trial, ""
    model = trial.quantized() or _built(trial, prep)
    first = evaluator.batches[0]
    timings = time_sessions(
        {"fp32": prep.normalized, "static": static, "recipe": model}, first.feeds, evaluator.config, runs=runs,
        rows=first.size,
    )  # fmt: skip
    fp32, mine = timings["fp32"], timings["recipe"]
    if not static_buys_speed(fp32, timings["static"]) or not slower_than_fp32(fp32, mine):
        return trial, ""
    note = (
        f"recipe {_label(trial)} meets the target but runs at {fp32.p50_ms / mine.p50_ms:.2f}x FP32's speed (p50 "
        f"{mine.p50_ms:.3g} vs {fp32.p50_ms:.3g} ms; full static INT8 {timings['static'].p50_ms:.3g} ms): "
        "quantizing at run time costs more than INT8 saves here, so it is not the answer"
    )
    return dataclasses.replace(trial, met=False), note


def _choose(trials: Sequence[RecipeTrial], static_value: float) -> RecipeTrial | None:
    """The first trial (registry order) that meets the target; else the best-scoring one that beats plain
    static; else None (plain static stays the base)."""
    scored = [t for t in trials if t.result is not None]
    met = [t for t in scored if t.met]
    if met:
        return met[0]
    better = [t for t in scored if math.isfinite(t.result.value) and t.result.value > static_value + GAIN]  # type: ignore[union-attr]
    return max(better, key=lambda t: t.result.value) if better else None  # type: ignore[union-attr]


def _label(t: RecipeTrial) -> str:
    """A trial's name with its parameters (``fold-bn+equalize``, ``smooth alpha=0.5``)."""
    extra = " ".join(f"{k}={v:g}" for k, v in t.params)
    return f"{'+'.join(t.steps)}" + (f" {extra}" if extra else "")


def recipe_label(t: RecipeTrial) -> str:
    """The frontier's label of a recipe's full static INT8 point (``recipe smooth alpha=0.5``)."""
    return f"recipe {_label(t)}"


def best_per_family(trials: Sequence[RecipeTrial]) -> list[RecipeTrial]:
    """The best-scoring scored trial of each recipe, in the order tried."""
    best: dict[str, RecipeTrial] = {}
    for t in trials:
        if t.result is None:
            continue
        if t.name not in best or t.result.value > best[t.name].result.value:  # type: ignore[union-attr]
            best[t.name] = t
    return list(best.values())


def _notes(
    trials: Sequence[RecipeTrial],
    chosen: RecipeTrial | None,
    target: Target,
    static_result: EvalResult,
    deferred: RecipeTrial | None = None,
    folded: RecipeTrial | None = None,
) -> list[str]:
    """One line on what the recipes reached, and one per refused transform."""
    static = target.show(static_result)
    notes = [f"recipe {_label(t)} refused: {t.refused}" for t in trials if t.refused]
    scored = [t for t in trials if t.result is not None]
    if not scored:
        return notes
    reached = "; ".join(f"{_label(t)} {target.show(t.result)}" for t in scored)  # type: ignore[arg-type]
    best = _choose(trials, target.value(static_result))
    if chosen is not None and target.met(static_result):
        head = (
            f"full static INT8 meets the target ({static}); built with {_label(chosen)} (ORT's quant_pre_process "
            "folds BatchNormalization the same way) it meets it too and its BatchNormalization nodes leave the "
            "quantized graph"
        )
    elif chosen is not None:
        head = f"full static INT8 misses the target ({static}); recipe {_label(chosen)} meets it"
    elif deferred is not None:
        head = (
            f"full static INT8 misses the target ({static}); recipe {_label(deferred)} meets it, after the "
            "per-node search (it quantizes every MatMul differently: a few nodes kept FP32 may be the smaller change)"
        )
    elif folded is not None and folded.result is not None:
        head = (
            f"full static INT8 misses the target ({static}); no recipe meets it alone, so the per-node search starts "
            "from the model ORT's documented pre-processing quantizes (quant_pre_process folds BatchNormalization "
            f"into Conv: {target.show(folded.result)}), its BatchNormalization nodes out of the quantized graph"
        )
    elif best is not None:
        head = (
            f"full static INT8 misses the target ({static}); no recipe meets it alone (the best, "
            f"{_label(best)}, is in the frontier), so the per-node search starts from plain static"
        )
    else:
        head = f"full static INT8 misses the target ({static}); no recipe did better"
    notes.append(f"{head} (screened: {reached})")
    return notes
