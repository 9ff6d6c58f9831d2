"""The verified frontier: what the answer costs in speed, next to the few alternatives that matter.

A proposal that meets the target by keeping half the model FP32 has given back the INT8 speed-up, and
one that keeps 99 % is a slower FP32 model. So propose times its answer with verify's fair harness
(:func:`qdebug.runtime.timing.time_sessions`: one session each, same batch, same threads, interleaved rounds)
next to FP32, full static INT8, ``quantize_dynamic``, and the best configurations it scored that change
less or more than the answer; every point is a model actually built and scored, never an estimate.
:func:`speed_verdict` then says in one line when the answer is no faster than FP32 while static is,
beyond the timing noise, and names the best option it measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import onnx

from qdebug.errors import QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator
from qdebug.evaluation.gates import SPEED_MARGIN, slower_than_fp32, static_buys_speed
from qdebug.output.formatting import fmt_metric
from qdebug.prepare import Prepared
from qdebug.progress import Progress
from qdebug.propose.recipes import RecipeStage, best_per_family, recipe_label
from qdebug.propose.search import Search, Trial
from qdebug.quant.calibrate import op_types_to_quantize
from qdebug.quant.quantize import (
    QuantSpec,
    dynamic_conv_note,
    quantize_dynamic_model,
    quantize_model,
    quantize_static_model,
)
from qdebug.records import FrontierPoint
from qdebug.records.verify import Timing
from qdebug.runtime.kernels import u8s8_saturates
from qdebug.runtime.parallel import Pool, score_all
from qdebug.runtime.timing import time_sessions
from qdebug.vocabulary import RECIPES, quantizer_of, spec_changes

_Entry = tuple[str, "Trial | None", "EvalResult | None", onnx.ModelProto]
"""A frontier point before it is timed: label, the search's trial (if any), its score here (if any), model."""

TIME_RUNS = 20
"""Timed runs per frontier point (``--time-runs``; 0 skips the frontier)."""
ROUND_SECONDS = 1.0
"""About how long one model's share of a timing round may take: a slow model (a 320x320 detector, a dynamic
model's ConvInteger) is run fewer times per round, every round still holding every model
(:func:`~qdebug.runtime.timing.time_sessions`)."""


def verified_frontier(
    search: Search,
    prep: Prepared,
    evaluator: Evaluator,
    final: Trial,
    selective: onnx.ModelProto,
    runs: int,
    progress: Progress,
    rescore: bool = False,
    pool: Pool | None = None,
    dynamic: onnx.ModelProto | QDebugError | None = None,
    recipes: RecipeStage | None = None,
) -> tuple[tuple[FrontierPoint, ...], list[str]]:
    """The frontier points (FP32 first) and notes on what could not be measured; ``rescore``: the search
    was screened on part of the evaluation set, so its neighbours are scored again on all of it.

    The evaluations (the neighbours rescored, the dynamic model) go to ``pool`` side by side; the timing
    after them runs here, one model at a time, with the workers idle. ``dynamic``: the dynamic model
    already built (:func:`dynamic_variant`; None: built here). ``recipes``: the whole-model recipes tried
    (:mod:`qdebug.propose.recipes`): the best of each family is a point, ``recipe <name>``; when one is the
    search's base, ``static`` stays the user's model's full static INT8 and the base's is that recipe's point."""
    if runs <= 0 or not evaluator.batches:
        return (), []
    notes: list[str] = []
    static = search.trials[0]
    base_static = search.build((), (), static.per_channel)[1]
    entries: list[_Entry] = [("fp32", None, None, prep.normalized)]
    tried = _recipe_points(recipes, prep, evaluator, pool)
    if recipes is not None and recipes.chosen is not None:
        entries.append(tried.pop(0))  # the user's model's full static INT8
        entries.append((recipe_label(recipes.chosen), static, None, base_static))
    else:
        entries.append(("static", static, None, base_static))
    entries.append(("proposal", final, None, selective))
    entries += tried + _weighted_only(prep, evaluator, pool)
    neighbours = [
        (label, trial, search.build(trial.nodes, trial.overrides, trial.per_channel, fixes=trial.fixes)[1])
        for label, trial in frontier_neighbours(search, final)
    ]
    models = [m for _, _, m in neighbours]
    rescored = score_all(pool, evaluator, models, numbers_only=True) if rescore else [None] * len(neighbours)
    entries += [(label, trial, res, m) for (label, trial, m), res in zip(neighbours, rescored, strict=True)]
    chosen_dynamic = recipes is not None and recipes.chosen is not None and recipes.chosen.name == "dynamic"
    scored = None if chosen_dynamic else _dynamic(prep, evaluator, notes, pool, dynamic)  # else the base's point
    if scored is not None:
        entries.append(("dynamic", None, scored[1], scored[0]))
    progress("frontier", 0, len(entries))
    models = {e[0]: e[3] for e in entries}
    first = evaluator.batches[0]
    timings = time_sessions(
        models, first.feeds, evaluator.config, runs=runs, notes=notes, rows=first.size, round_seconds=ROUND_SECONDS
    )
    progress("frontier", len(entries), len(entries))
    points = tuple(_point(search, label, trial, result, timings[label]) for label, trial, result, _ in entries)
    if recipes is not None and recipes.chosen is not None:  # the answer and its neighbours: on the recipe's model
        label = recipe_label(recipes.chosen)
        trials = {e[0]: e[1] for e in entries if e[0] in ON_THE_ANSWERS_BASE}
        points = tuple(
            dataclasses.replace(p, changed=_on_recipe(label, p.changed, trials[p.label] or final))
            if p.label in trials else p
            for p in points
        )
    return points, notes


ON_THE_ANSWERS_BASE = ("proposal", "smaller", "larger")
"""The frontier's points built like the answer, on its recipe's model or quantizer (the others name theirs)."""


def _recipe_points(
    recipes: RecipeStage | None, prep: Prepared, evaluator: Evaluator, pool: Pool | None
) -> list[_Entry]:
    """The frontier's recipe entries, scored on every evaluation sample: the user's model's full static
    INT8 first when a recipe is the search's base, then the best trial of each recipe family not chosen."""
    if recipes is None or not recipes.trials:
        return []
    models: list[tuple[str, onnx.ModelProto]] = []
    if recipes.chosen is not None:
        assert prep.ranges is not None
        models.append(("static", quantize_static_model(prep.normalized, prep.ranges, QuantSpec.of(prep.settings))))
    for trial in best_per_family(recipes.trials):
        if trial is recipes.chosen or trial.prep is None or trial.prep.ranges is None or trial.name == "dynamic":
            continue  # the dynamic recipe's model is the frontier's own ``dynamic`` point
        spec = QuantSpec.of(trial.prep.settings, **spec_changes(trial.steps, trial.params))  # type: ignore[arg-type]
        model = trial.quantized() or quantize_model(trial.prep.normalized, trial.prep.ranges, spec)
        models.append((recipe_label(trial), model))
    results = score_all(pool, evaluator, [m for _, m in models], numbers_only=True)
    return [(label, None, result, model) for (label, model), result in zip(models, results, strict=True)]


WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
"""The op types whose integer kernels buy the INT8 speed-up: the frontier's ``--op-types`` point keeps to them."""


def _weighted_only(prep: Prepared, evaluator: Evaluator, pool: Pool | None) -> list[_Entry]:
    """Full static INT8 of the weighted op types only (``--op-types Conv,MatMul...``), scored on every
    evaluation sample: where Q/DQ pairs around Add, Mul, Concat or Resize cost more than their integer kernels
    save, this point is the faster static model (issue 37: the fix named when INT8 does not pay). Not added
    when the run's settings restrict the op types already, or when the model quantizes nothing else."""
    if prep.ranges is None or prep.settings.op_types:
        return []
    present = {n.op_type for n in prep.normalized.graph.node}
    weighted = tuple(op for op in WEIGHTED_OPS if op in present)
    others = present & set(op_types_to_quantize()) - set(weighted)
    if not weighted or not others:
        return []
    try:
        spec = QuantSpec.of(prep.settings, op_types=weighted)
        model = quantize_static_model(prep.normalized, prep.ranges, spec)
    except QDebugError:
        return []
    (result,) = score_all(pool, evaluator, [model], numbers_only=True)
    return [(f"static --op-types {','.join(weighted)}", None, result, model)]


def frontier_neighbours(search: Search, final: Trial) -> list[tuple[str, Trial]]:
    """The best-scoring trial that changes less than the answer, and the best that changes more (when it
    scores higher): what a looser target, or a stricter one, would cost."""
    size = _size(final)
    pool = [t for t in [*search.trials, *search.equivalents] if search.fits(t) and t is not search.trials[0]]
    smaller = [t for t in pool if 0 < _size(t) < size]
    larger = [t for t in pool if _size(t) > size and search.score(t) > search.score(final)]
    out = []
    if smaller:
        out.append(("smaller", max(smaller, key=lambda t: (search.score(t), -_size(t)))))
    if larger:
        out.append(("larger", max(larger, key=lambda t: (search.score(t), -_size(t)))))
    return out


def _size(trial: Trial) -> int:
    return len(trial.nodes) + len(trial.overrides) + len(trial.fixes)


def dynamic_variant(prep: Prepared) -> onnx.ModelProto | QDebugError:
    """``quantize_dynamic`` of the normalized model (the error when ORT cannot build it)."""
    try:
        return quantize_dynamic_model(prep.normalized_path)
    except QDebugError as e:
        return e


def _dynamic(
    prep: Prepared,
    evaluator: Evaluator,
    notes: list[str],
    pool: Pool | None = None,
    model: onnx.ModelProto | QDebugError | None = None,
) -> tuple[onnx.ModelProto, EvalResult] | None:
    """``quantize_dynamic`` of the normalized model, scored (``None`` with a note when ORT cannot build it)."""
    model = dynamic_variant(prep) if model is None else model
    try:
        if isinstance(model, QDebugError):
            raise model
        what = "dynamic quantized model"
        notes.extend(n for n in [dynamic_conv_note(prep.normalized)] if n)
        if pool is None:
            return model, evaluator.score(model, what=what)
        return model, pool.score(evaluator, model, what, numbers_only=True)
    except QDebugError as e:
        notes.append(f"the frontier has no dynamic-quantization point: {e.message}")
        return None


def _point(search: Search, label: str, trial: Trial | None, result: EvalResult | None, timing: Timing) -> FrontierPoint:
    target = search.target
    if result is not None:  # scored here (dynamic; a neighbour rescored on all samples)
        value, sqnr, met = result.value, result.output_sqnr_db, target.met(result)
        nodes = len(trial.nodes) if trial is not None else 0
    elif trial is not None:
        value, sqnr, met, nodes = trial.value, trial.output_sqnr_db, trial.met, len(trial.nodes)
    else:  # FP32 itself
        value, sqnr, met, nodes = target.fp32, math.inf, True, -1
    changed = _changed(label, trial)
    return FrontierPoint(label, changed, nodes, value, sqnr, met, timing.p50_ms, timing.p95_ms, timing.rounds_ms)


def _changed(label: str, trial: Trial | None) -> str:
    if label == "fp32":
        return "no quantization"
    if label.startswith("recipe "):
        steps = _recipe_steps(label)
        if quantizer_of(steps) != "static":  # dynamic, mixed: no static model under it
            pc = " (per-channel weights)" if trial is not None and trial.per_channel and _size(trial) == 0 else ""
            return RECIPES[steps[-1]].title + pc + _changed_on_top(trial)
        return f"{label.removeprefix('recipe ')} + " + _changed("static", trial)
    if label == "dynamic":
        return "quantize_dynamic (weights INT8, activations at run time)"
    if label.startswith("static --op-types "):
        return f"full static INT8 of {label.removeprefix('static --op-types ').replace(',', ', ')} only"
    if trial is None or _size(trial) == 0:
        return "full static INT8" + (" (per-channel weights)" if trial is not None and trial.per_channel else "")
    parts = []
    if trial.nodes:
        parts.append(f"{len(trial.nodes)} node{'s' if len(trial.nodes) != 1 else ''} FP32")
    if trial.overrides:
        parts.append(f"{len(trial.overrides)} tensor(s) 16-bit")
    if trial.fixes:
        parts.append(f"{len(trial.fixes)} range/weight override(s)")
    return " + ".join(parts) + (", per-channel weights" if trial.per_channel else "")


def _on_recipe(label: str, changed: str, final: Trial) -> str:
    """What the answer changes when it is built on the recipe ``label`` names."""
    if quantizer_of(_recipe_steps(label)) != "static":
        return _changed(label, final)
    return f"{label.removeprefix('recipe ')} + {changed}"


def _recipe_steps(label: str) -> list[str]:
    """The recipe steps a frontier label names (``recipe fold-bn+equalize``, ``recipe smooth alpha=0.5``:
    :func:`~qdebug.propose.recipes.recipe_label` writes them)."""
    return label.removeprefix("recipe ").split()[0].split("+")


def _changed_on_top(trial: Trial | None) -> str:
    """`` + 2 nodes FP32`` when ``trial`` changes anything of its base, else nothing."""
    return "" if trial is None or _size(trial) == 0 else " + " + _changed("static", trial)


def speed_verdict(
    points: Sequence[FrontierPoint], base: str = "static", quantizable: int | None = None
) -> tuple[list[str], bool]:
    """(lines for the user, whether the answer gave the speed-up back) from the frontier.

    Judged beyond the timing noise only (:func:`~qdebug.gates.slower_than_fp32` while
    :func:`~qdebug.gates.static_buys_speed`: verify's speed-up gate applies the same rule). When static is
    no faster than FP32, quantization buys no speed on this machine: said so, and the answer is judged on
    accuracy alone. Another measured point that also meets the target and is faster than the answer is
    named either way (``quantize_dynamic`` often is, on a transformer). ``base``: the label of the full
    static INT8 the answer was searched from (a recipe's, when one was chosen). ``quantizable``: how many
    nodes the answer's quantizer quantizes (a point keeping them all FP32 quantizes nothing and is not named).
    """
    by = {p.label: p for p in points}
    fp32, static, answer = by.get("fp32"), by.get(base, by.get("static")), by.get("proposal")
    if fp32 is None or static is None or answer is None:
        return [], False
    lines, slow = [], False
    plain = by.get("static")
    recipe_pays = base != "static" and plain is not None and static_buys_speed(fp32, static)
    if recipe_pays and not static_buys_speed(fp32, plain):  # type: ignore[arg-type]
        lines.append(
            f"full static INT8 of your model is not faster than FP32 (p50 {plain.p50_ms:.3g} vs {fp32.p50_ms:.3g} ms) "
            f"where {base.removeprefix('recipe ')} makes it faster ({static.p50_ms:.3g} ms)"
            + (": a BatchNormalization left between Q/DQ pairs runs as a float kernel, quantized twice; folded "
               "into its Conv (as ORT's quant_pre_process does) it costs neither" if "fold-bn" in base else "")
        )  # fmt: skip
    if not static_buys_speed(fp32, static) and static.p50_ms < (1 - SPEED_MARGIN) * fp32.p50_ms:
        lines.append(
            f"the timings are too noisy here to judge speed (full static INT8 p50 {static.p50_ms:.3g} ms but p95 "
            f"{static.p95_ms:.3g} ms; FP32 p50 {fp32.p50_ms:.3g} ms): the proposal is judged on accuracy alone; "
            "time it on a quieter machine with qdebug bench"
        )
    elif not static_buys_speed(fp32, static) and (ops := _faster_weighted_only(points, fp32)) is not None:
        lines.append(
            f"full static INT8 is not faster than FP32 here (p50 {static.p50_ms:.3g} vs {fp32.p50_ms:.3g} ms), but "
            f"{ops.changed} is ({ops.p50_ms:.3g} ms, metric {ops.metric:.4g}): "
            f"the Q/DQ pairs around the other ops cost more than their integer kernels save; "
            f"{ops.label.removeprefix('static ')} keeps the speed-up (qdebug profile shows where the time goes)"
        )
    elif not static_buys_speed(fp32, static):
        lines.append(
            f"full static INT8 is not faster than FP32 here beyond the timing noise (p50 {static.p50_ms:.3g} vs "
            f"{fp32.p50_ms:.3g} ms): {_why_int8_does_not_pay()}; the proposal is judged on accuracy alone"
        )
    elif slower_than_fp32(fp32, answer):
        slow = True
        lines.append(
            f"the proposal is slower than FP32 (p50 {answer.p50_ms:.3g} vs {fp32.p50_ms:.3g} ms; full static "
            f"{static.p50_ms:.3g} ms): it gives the INT8 speed-up back. Best option measured: "
            f"{_best_option(points, fp32)}"
        )
    better = [
        p for p in points
        if p.label not in ("fp32", "proposal") and p.met and p.p95_ms < answer.p50_ms
        and (quantizable is None or p.nodes_fp32 < quantizable)  # every node FP32: the FP32 model, not an option
    ]  # fmt: skip
    if better and not slow:
        best = min(better, key=lambda p: p.p50_ms)
        lines.append(
            f"{best.label} ({best.changed}) also meets the target and is faster than the proposal (p50 "
            f"{best.p50_ms:.3g} vs {answer.p50_ms:.3g} ms, FP32 {fp32.p50_ms:.3g} ms)"
        )
    return lines, slow


def _why_int8_does_not_pay() -> str:
    """What this machine's integer kernels say about static INT8 not paying (asked of ORT: the probe of
    :mod:`qdebug.runtime.kernels`, not the CPU flags)."""
    if u8s8_saturates():
        return (
            "this CPU's u8s8 integer kernels have no VNNI (they sum through a saturating int16), so they gain "
            "little over float; a CPU with AVX-VNNI or AVX512-VNNI runs them faster"
        )
    return (
        "this CPU runs VNNI integer kernels, so the time goes around them: Q/DQ pairs and float kernels between "
        "integer ones (qdebug profile FP32.onnx INT8.onnx names them, node by node)"
    )


def _faster_weighted_only(points: Sequence[FrontierPoint], fp32: FrontierPoint) -> FrontierPoint | None:
    """The frontier's ``--op-types`` point when it is faster than FP32 beyond the noise."""
    ops = next((p for p in points if p.label.startswith("static --op-types ")), None)
    return ops if ops is not None and static_buys_speed(fp32, ops) else None


def _best_option(points: Sequence[FrontierPoint], fp32: FrontierPoint) -> str:
    """The fastest point that meets the target and beats FP32; else the most accurate that beats FP32 (a
    looser target, with its numbers); else FP32."""
    faster = [p for p in points if p.label not in ("fp32", "proposal") and p.p50_ms < fp32.p50_ms]
    met = [p for p in faster if p.met]
    if met:
        best = min(met, key=lambda p: p.p50_ms)
        return f"{best.label} ({best.changed}) meets the target at {best.p50_ms:.3g} ms"
    if faster:
        closest = max(faster, key=lambda p: p.metric if math.isfinite(p.metric) else -math.inf)
        return (
            f"a looser target: {closest.label} ({closest.changed}) reaches {closest.metric:.4g} "
            f"at {closest.p50_ms:.3g} ms"
        )
    return "keep the model FP32"


def missed_verdict(points: Sequence[FrontierPoint], allow: Sequence[str] = ("fp32",), metric: str = "") -> str:
    """One line for an answer that misses the target: what each measured alternative reaches and costs, so
    the user can pick one (16-bit, dynamic, a looser target, or FP32) instead of a proposal that fails. The
    advice starts from what ``allow`` left out: a search not allowed to keep nodes FP32 is told so first.
    ``metric`` formats the numbers (``83.40%`` for an accuracy; else as measured)."""
    by = {p.label: p for p in points}
    fp32 = by.get("fp32")
    options = [p for p in points if p.label not in ("fp32", "proposal")]
    if fp32 is None or not options:
        return ""
    shown = (lambda v: fmt_metric(metric, v)) if metric else (lambda v: f"{v:.4g}")
    parts = [
        f"{p.label} ({p.changed}) {shown(p.metric)}{' meets it' if p.met else ''} at {p.p50_ms:.3g} ms"
        for p in sorted(options, key=lambda p: -p.metric if math.isfinite(p.metric) else math.inf)
    ]
    if "fp32" not in allow:
        advice = (
            f"--allow {','.join(allow)} kept every node quantized: add fp32 (e.g. --allow fp32,{','.join(allow)}) "
            "to let the search keep the nodes that need it FP32"
        )
    else:
        advice = (
            "The error may be spread over the whole model: try "
            + ("--allow fp32,int16 (16-bit activations), " if "int16" not in allow else "")
            + "a looser target, or keep the model FP32"
        )
    return f"no configuration found meets the target; measured: {'; '.join(parts)}; FP32 {fp32.p50_ms:.3g} ms. {advice}"
