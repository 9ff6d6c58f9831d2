"""The ``propose`` command: check the request, prepare, search, and write the proposal and its model.

:func:`propose` checks what it was given (the report's model by hash, the
flags, outputs that spare the inputs) and runs :func:`_propose` inside the
output transaction, so that a failed run leaves no partial files. The driver
is a sequence of named stages: the analysis settings from the report
(:func:`_prepare_options`), the shared prelude (:func:`~qdebug.prepare.prepare`),
the evaluator (:func:`_evaluator`), the search state (:func:`_search`), the
re-ranking capture (:func:`_reranker`), the strategies
(:func:`~qdebug.propose.strategy.run_search`), the answer
(:func:`_selective`) and its record (:func:`_proposal_record`).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from qdebug.analysis import measure_layers, node_records, quantized_node_names, weight_records
from qdebug.data import DataSet, InputSpec, data_notes, fixed_batch, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator, metric_scope_note
from qdebug.evaluation.gates import mostly_fp32
from qdebug.evaluation.noise import DEFAULT_CONFIDENCE, Interval, samples_to_decide
from qdebug.graph.load import save_model
from qdebug.graph.match import pair_models, qdq_settings
from qdebug.output.files import (
    artifacts_dir,
    atomic_write_text,
    check_outputs_spare_inputs,
    check_writable,
    removed_on_failure,
    sha256_file,
)
from qdebug.output.formatting import ACCURACY_METRICS
from qdebug.output.report_io import dumps, load_report
from qdebug.prepare import AnalyzeOptions, Prepared, prepare, ranges_by
from qdebug.progress import Progress, StageClock, no_progress, stage_seconds
from qdebug.propose import switch
from qdebug.propose.blame import Unit, rank_units
from qdebug.propose.diagnose import diagnosed_units
from qdebug.propose.explain import nothing_quantized, proposal_snippet, quantized_given_notes, reason_lines
from qdebug.propose.fixes import PERCENTILE, fix_for, whole_percentile, whole_reduce_range
from qdebug.propose.flipped import flipped_ranges, leak_notes
from qdebug.propose.frontier import dynamic_variant, missed_verdict, speed_verdict, verified_frontier
from qdebug.propose.latency import LatencyModel, cheapest, chosen_note
from qdebug.propose.options import (  # re-exported: the request's options, target and result
    ACTIONS,
    DEFAULT_ALLOW,
    DEFAULT_RELATIVE_DROP,
    RERANK_SAMPLES,
    ProposeOptions,
    ProposeResult,
    check_allow,
    make_target,
)
from qdebug.propose.recipes import (
    RANK_RUNS,
    SPEED_RUNS,
    RecipeStage,
    RecipeTrial,
    SpeedComparison,
    better_on_both_axes,
    compare_speed,
    recipe_label,
    replaces,
    run_recipes,
    run_time_units,
)
from qdebug.propose.recipes import wanted as wanted_recipes
from qdebug.propose.reuse import analyzed_static, offer_analyzed_inference
from qdebug.propose.screen import confirm_on_all, screening_evaluator, start_on_all
from qdebug.propose.search import (
    Fix,
    Plan,
    Rerank,
    Search,
    Target,
    Trial,
    default_budget,
    final_answer,
    held_back,
    model_digest,
    plan_of,
    without_per_channel,
)
from qdebug.propose.strategy import run_search
from qdebug.propose.structure import Structure
from qdebug.propose.switch import switch_note
from qdebug.quant.calibrate import Ranges
from qdebug.quant.quantize import QuantSpec, run_time_quantizable
from qdebug.quant.switchable import SwitchScreen
from qdebug.records import (
    SCHEMA_VERSION,
    AnalysisConfig,
    FrontierPoint,
    NodeRecord,
    Proposal,
    RecipeRecord,
    Report,
    WeightRecord,
)
from qdebug.runtime.capture import SessionConfig
from qdebug.runtime.parallel import Pool, check_request, open_pool
from qdebug.vocabulary import recipe as recipe_entry
from qdebug.vocabulary import spec_changes

__all__ = [
    "ACTIONS",
    "DEFAULT_ALLOW",
    "DEFAULT_RELATIVE_DROP",
    "RERANK_SAMPLES",
    "ProposeOptions",
    "ProposeResult",
    "check_report_model",
    "make_target",
    "propose",
    "rerank_limit",
    "selective_model_path",
]


def check_report_model(report: Report, model: str | Path | None) -> Path:
    """The model file the report was made from (or ``model``), refusing another model (hash mismatch)."""
    path = Path(model) if model is not None else Path(report.model.path)
    if not path.is_file():
        raise QDebugError(
            f"model file {path} (recorded in the report) not found",
            "pass the FP32 model with --model",
            ExitCode.INPUT,
        )
    sha = sha256_file(path)
    if sha != report.model.sha256:
        raise QDebugError(
            f"{path} is not the model the report was made from (sha256 {sha[:12]}... vs {report.model.sha256[:12]}...)",
            "re-run qdebug analyze on this model, or pass the original model with --model",
            ExitCode.INPUT,
        )
    return path


def rerank_limit(specs: Sequence[InputSpec], wanted: int, available: int | None) -> int:
    """Samples a re-rank capture reads: ``wanted``, at most the report's calibration samples, and whole
    batches of a fixed batch dimension (a model fixed at 3 had failed: 32 samples fill no batches of 3,
    and the advice to pass --max-samples named a flag propose does not have)."""
    n = min(wanted, available) if available else wanted
    batch = fixed_batch(specs)
    return max(batch, n - n % batch) if batch > 1 else n


def selective_model_path(output: str | Path) -> Path:
    """Where the selectively quantized model of a proposal goes: ``<stem>.selective.onnx`` next to it."""
    out = Path(output)
    return out.with_name(f"{out.stem}.selective.onnx")


def propose(
    report: Report | str | Path,
    *,
    output: str | Path | None = "proposal.json",
    options: ProposeOptions | None = None,
    model: str | Path | None = None,
    calib: str | Path | None = None,
    eval_data: str | Path | None = None,
    progress: Progress | None = None,
) -> ProposeResult:
    """Search the smallest mixed-precision proposal that meets the target; write it (and its model).

    Args:
        report: the analysis report (or its path).
        output: proposal path; the selective model goes next to it as ``<stem>.selective.onnx`` and
            the normalized model into ``<stem>_files/``. ``None``: write nothing (a temp dir is used).
        options: see :class:`ProposeOptions`.
        model: the FP32 model (default: the path in the report); must hash like the report's model.
        calib: calibration data (default: the report's); ranges come from the cache when present.
        eval_data: evaluation data (default: the report's, else the calibration data).
        progress: callback(stage, done, total).

    The proposal is written even when the target is not met (``result.met`` is then False).

    """
    start = time.perf_counter()
    options = options or ProposeOptions()
    progress = StageClock(progress or no_progress)  # the proposal records each stage's time
    source = report
    if not isinstance(report, Report):
        report = load_report(report)
    allow = check_allow(options.allow)
    recipes = wanted_recipes(options.recipes)
    check_request(options.runtime)
    if options.max_nodes is not None and options.max_nodes < 0:
        raise QDebugError("--max-nodes must be >= 0", "pass a node count", ExitCode.USAGE)
    model_path = check_report_model(report, model)
    calib_src = calib if calib is not None else report.config.calib
    if calib_src is None:
        raise QDebugError("the report records no calibration data", "pass --calib", ExitCode.INPUT)
    eval_src = eval_data if eval_data is not None else (report.config.eval or calib_src)
    if output is not None:
        check_writable(output)
        check_outputs_spare_inputs(
            {"the proposal": output, "the selective model": selective_model_path(Path(output))},
            {
                "the report": source if isinstance(source, (str, Path)) else None,
                "the model": model_path,
                "the calibration data": calib_src,
                "the evaluation data": eval_src,
            },
        )
    with tempfile.TemporaryDirectory(prefix="qdebug-propose-") as tmp:
        workdir = artifacts_dir(Path(output)) if output is not None else Path(tmp)
        outputs = [output, selective_model_path(output)] if output is not None else []
        inputs = [source if isinstance(source, (str, Path)) else None, model_path, calib_src, eval_src]
        # the pool inside the guard: on an error or Ctrl-C its workers stop before the outputs are removed
        with (
            removed_on_failure(workdir if output is not None else None, outputs, inputs),
            open_pool(options.runtime) as pool,
        ):
            return _propose(
                report, model_path, calib_src, eval_src, workdir, output, options, allow, progress, start, pool,
                recipes,
            )  # fmt: skip


def _propose(
    report: Report,
    model_path: Path,
    calib_src: str | Path,
    eval_src: str | Path,
    workdir: Path,
    output: str | Path | None,
    options: ProposeOptions,
    allow: tuple[str, ...],
    progress: Progress,
    start: float,
    pool: Pool | None = None,
    recipes: Sequence[str] = (),
) -> ProposeResult:
    """The checked request turned into a proposal: prepare, search, choose, write (inside the output guard).

    ``pool`` scores the candidates (:mod:`qdebug.runtime.parallel`); the answer is the same with any."""
    cfg = report.config
    progress("prepare", 0, None)
    prep = prepare(
        model_path,
        calib_src,
        workdir,
        _prepare_options(cfg, options),
        progress=progress,
        eval_data=eval_src,
        eval_max_samples=options.eval_max_samples,
        eval_limit_flag="--eval-max-samples",
    )
    assert prep.ranges is not None
    _check_names(report, prep)
    config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
    evaluator, input_notes = _evaluator(prep, eval_src, cfg, options, config)
    target = make_target(evaluator.metric_name, evaluator.fp32_value, evaluator.samples, options)
    screen = screening_evaluator(prep, eval_src, cfg, config, evaluator, options.screen_samples)
    for scorer in (evaluator, screen):  # the search reads each candidate's metric, not its output energies
        if scorer is not None:
            scorer.keep_energies(False)
    screened = screen or evaluator
    screen_target = make_target(screened.metric_name, screened.fp32_value, screened.samples, options)
    dynamic = _start_pool(pool, prep, screened, evaluator, options)
    fp32_prep = prep  # the user's model: the FP32 reference, its timing and the dynamic variant
    stage = _recipes(prep, report, screened, screen_target, options, workdir, progress, recipes)
    user_report = report
    prep, report = stage.prep, _on_base(report, stage.prep)  # the search starts from the recipe chosen, if any
    run = _Run(screened, screen_target, options, progress, pool, calib_src, eval_src, cfg, config, evaluator, allow)
    found = _search_from(prep, report, stage.changes, stage.prescored(), run)
    stage, search, answer = _deferred_answer(
        stage, found.search, found.report, found.answer, found.rerank, allow,
        lambda changes: _search(prep, report, screened, screen_target, options, progress, pool, changes)[0],
        lambda deferred, mine, model, value: better_on_both_axes(
            deferred, mine, prep, screened, SPEED_RUNS if options.time_runs > 0 else 0, model, value
        ),
    )  # fmt: skip
    if search is found.search:  # the answer is still the per-node search's: the best recipe may do better
        stage, found = _on_runner_up(stage, found, report, run)
        stage, found = _on_run_time(stage, found, fp32_prep, user_report, run)
        search, answer = found.search, found.answer
    plan, final, spec, selective = answer
    prep, report, initial, reranks, switch = found.prep, found.report, found.initial, found.reranks, found.switch
    flipped, flipped_note = found.flipped, found.flipped_note
    latency_notes = [found.latency_note] if found.latency_note else []
    if switch is not None:
        screen = switch  # confirmed below like a subset screen: everything reported is on real models
    screen_notes: list[str] = [switch_note(switch)] if switch is not None else []
    if screen is not None:  # report every number on all samples, the answer confirmed there
        if options.time_runs > 0:
            start_on_all(pool, evaluator, search, final, selective)
        plan, final, spec, selective, confirm_notes = confirm_on_all(
            search, evaluator, target, plan, final, spec, selective, pool
        )
        screen_notes += confirm_notes
    static = search.trials[0]
    frontier, speed_notes, no_speedup = _speed(
        search, fp32_prep, evaluator, final, selective, options, progress, rescore=screen is not None, pool=pool,
        dynamic=dynamic, allow=allow, recipes=stage,
    )  # fmt: skip
    interval = _answer_interval(search, evaluator, selective, pool)
    seconds = time.perf_counter() - start
    sel_path = selective_model_path(output) if output is not None else None
    recipe = stage.record(prep.normalized_path if output is not None else None)
    proposal = _proposal_record(
        report, model_path, prep, calib_src, search, plan, spec, final, seconds, sel_path, recipe
    )
    plain_static = _plain_static(stage, frontier, evaluator, search.target) if recipe else proposal.static_metric
    proposal = dataclasses.replace(
        proposal,
        frontier=frontier,
        drop_interval=interval,
        recipe=recipe,
        static_metric=plain_static,
        stage_seconds=stage_seconds(progress),
        normalized_model=proposal.normalized_model if recipe is None or output is None
        else str(fp32_prep.normalized_path.resolve()),
    )
    if output is not None and sel_path is not None:
        save_model(selective, sel_path)
        atomic_write_text(output, dumps(proposal))
    return ProposeResult(
        proposal=proposal,
        met=final.met and search.fits(final),
        target=target,
        candidates=_candidate_nodes(initial),
        units=tuple(initial),
        trials=tuple(search.trials),
        reranks=reranks,
        max_evaluations=search.budget,
        seconds=seconds,
        proposal_path=str(output) if output is not None else None,
        notes=(
            *input_notes,
            *_settings_notes(report, prep),
            *quantized_given_notes(report),
            *nothing_quantized(final, static),
            *stage.notes,
            *latency_notes,
            *([flipped_note] if flipped_note else leak_notes(final.fixes, flipped)),
            *screen_notes,
            *search.skips,
            *_interval_notes(target, final, interval, evaluator.samples),
            *speed_notes,
            *_batch_note(stage, evaluator),
            *(pool.notes if pool is not None else ()),
            *_quantizer_notes(report),
        ),
        no_speedup=no_speedup,
    )


def _answer_interval(
    search: Search, evaluator: Evaluator, selective: onnx.ModelProto, pool: Pool | None
) -> tuple[float, float]:
    """The answer's paired-bootstrap drop interval on every evaluation sample (``Evaluator.drop_interval``):
    from its own score when the search kept it with its per-sample numbers, else scored once more."""
    if not math.isfinite(evaluator.fp32_value):
        return (math.nan, math.nan)
    scorer, result = search.results.get(model_digest(selective), (None, None))
    if result is None or scorer is not evaluator:  # not kept, or a screening evaluator's
        result = pool.score(evaluator, selective) if pool is not None else evaluator.score(selective)
    return evaluator.drop_interval(result)


def _quantizer_notes(report: Report) -> tuple[str, ...]:
    """The note that ORT's own quantizer ran where qdebug's faster one could not (:mod:`qdebug.quant.fast_quantize`),
    unless the report already says it."""
    from qdebug.quant import fast_quantize

    return tuple(n for n in fast_quantize.notes() if n not in report.notes)


def _interval_notes(target: Target, final: Trial, interval: tuple[float, float], samples: int) -> tuple[str, ...]:
    """Said when the answer meets a drop target on its point estimate only: its interval reaches past the
    allowed drop, so ``qdebug verify`` on this evaluation set may call it undecided (exit 8)."""
    low, high = interval
    if target.kind != "drop" or not final.met or not (math.isfinite(low) and math.isfinite(high)):
        return ()
    scale = 100.0 if target.metric in ACCURACY_METRICS else 1.0
    allowed = scale * (target.fp32 - target.threshold)
    drop = scale * (target.fp32 - final.value)
    if high <= allowed + 1e-9:
        return ()
    unit = " points" if scale == 100.0 else ""
    needed = samples_to_decide(Interval(drop, low, high, DEFAULT_CONFIDENCE), allowed, samples)
    more = f"; about {needed:,} evaluation samples would decide it ({samples:,} now)" if needed else ""
    return (
        f"the answer meets the target on its point estimate (a drop of {drop:.2f}{unit}), but its "
        f"{100 * DEFAULT_CONFIDENCE:g}% interval [{low:.2f}, {high:.2f}]{unit} reaches past the {allowed:g}{unit} "
        f"allowed: qdebug verify on this evaluation set may call it undecided (exit 8){more}",
    )


def _speed(
    search: Search,
    prep: Prepared,
    evaluator: Evaluator,
    final: Trial,
    selective: onnx.ModelProto,
    options: ProposeOptions,
    progress: Progress,
    rescore: bool = False,
    pool: Pool | None = None,
    dynamic: onnx.ModelProto | QDebugError | None = None,
    allow: Sequence[str] = ("fp32",),
    recipes: RecipeStage | None = None,
) -> tuple[tuple[FrontierPoint, ...], list[str], str]:
    """The verified frontier, notes on it, and the line saying the answer gives the speed-up back (``""``
    when it does not): it keeps most of the model FP32, or it is timed slower than FP32 beyond the noise."""
    frontier, notes = verified_frontier(
        search, prep, evaluator, final, selective, options.time_runs, progress, rescore=rescore, pool=pool,
        dynamic=dynamic, recipes=recipes,
    )  # fmt: skip
    if not (final.met and search.fits(final)):
        missed = missed_verdict(frontier, allow, search.target.metric if search.target.kind == "drop" else "")
        return frontier, [*notes, missed] if frontier else notes, ""
    chosen = recipes.chosen if recipes is not None else None
    # a transform's full static INT8 is the answer's base; a dynamic or mixed answer is judged against plain
    # static, as verify judges it (its recipe's own model is no static INT8)
    base = recipe_label(chosen) if chosen is not None and recipe_entry(chosen.name).transforms else "static"
    lines, slow = speed_verdict(frontier, base, quantizable_count(search))
    tried = tuple(t.name for t in recipes.trials if t.result is not None) if recipes is not None else ()
    mostly = _mostly_fp32(final, quantizable_count(search), search.allow, tried, bool(frontier))
    if not slow:
        notes.extend(lines)
    reasons = [x for x in (mostly, *(lines if slow else [])) if x]
    if not reasons:
        return frontier, notes, ""
    return frontier, notes, "; ".join(reasons) + ". Pass --accept-no-speedup to take this proposal anyway"


def _mostly_fp32(
    final: Trial, quantizable: int, allow: Sequence[str] = DEFAULT_ALLOW, tried: Sequence[str] = (),
    timed: bool = True,
) -> str:
    """The plain line for an answer that keeps most of the model FP32 (``""`` when it does not). Its advice
    names only what this run did not try (advice that, followed, returns the same answer is no advice):
    ``tried`` holds the recipes scored, and the frontier (``timed``) has measured dynamic quantization.
    16-bit activations are not offered: on the CPU provider they run as float kernels and give no speed back."""
    if not mostly_fp32(len(final.nodes), quantizable):
        return ""
    untried = []
    if "per-channel" not in allow:
        untried.append(f"--allow {','.join(dict.fromkeys([*allow, 'per-channel']))} (per-channel weights), ")
    done = f" The recipes tried ({', '.join(tried)}) do not meet the target alone." if tried else ""
    return (
        f"the proposal keeps {len(final.nodes)} of {quantizable} quantizable nodes "
        f"({100 * len(final.nodes) / quantizable:.0f} %) FP32: most of the INT8 speed-up is gone.{done} Try "
        f"{''.join(untried)}a looser target"
        + (" (the frontier lists what each alternative measured reaches and costs)" if timed else "")
        + ", or keep the model FP32"
    )


def _start_pool(
    pool: Pool | None, prep: Prepared, screened: Evaluator, full: Evaluator, options: ProposeOptions
) -> onnx.ModelProto | QDebugError | None:
    """Give the pool its evaluators (each worker gets them once) and, with several workers and a frontier to
    measure, the dynamic model at once: its score does not depend on the search, so a worker computes it
    while the search goes on. Returns that model (None: the frontier builds it, as with one worker)."""
    if pool is None:
        return None
    pool.add(*dict.fromkeys([screened, full]))
    if pool.inline or options.time_runs <= 0:
        return None
    dynamic = dynamic_variant(prep)
    if not isinstance(dynamic, QDebugError):
        pool.submit(full, dynamic, "dynamic quantized model", numbers_only=True)
    return dynamic


def _prepare_options(cfg: AnalysisConfig, options: ProposeOptions) -> AnalyzeOptions:
    """The report's quantization settings with this run's metric, cache and runtime flags: the variants
    must be quantized exactly as the analyzed model was, or the ranking would describe another model."""
    return AnalyzeOptions(
        quant=options.quant.over(cfg.quant),  # the report's settings, the user's config included
        runtime=options.runtime,
        batch_size=cfg.batch_size,
        max_samples=cfg.max_samples,
        metric=options.metric or cfg.metric,
        batch_axes=options.batch_axes or cfg.batch_axes,
    )


def _settings_notes(report: Report, prep: Prepared) -> list[str]:
    """A note when propose builds its variants with other settings than the report's (``--config``)."""
    if prep.settings.without_source() == report.config.quant.without_source():
        return []
    from qdebug.quant.config import describe

    return [
        f"the variants are built with {prep.settings.source or 'other settings'} ({describe(prep.settings)}), "
        f"not the report's ({describe(report.config.quant)}): the ranking describes the report's model"
    ]


def _recipes(
    prep: Prepared,
    report: Report,
    screened: Evaluator,
    target: Target,
    options: ProposeOptions,
    workdir: Path,
    progress: Progress,
    recipes: Sequence[str],
) -> RecipeStage:
    """The recipes stage (:mod:`qdebug.propose.recipes`); its plain static build reads analyze's own static
    model and shape-inferred normalized model where they are what this run would build."""
    assert prep.ranges is not None
    offer_analyzed_inference(report)
    analyzed = analyzed_static(report, prep.normalized_path, prep.ranges, QuantSpec.of(prep.settings))
    aopts = _prepare_options(report.config, options)
    return run_recipes(
        prep, screened, target, aopts, workdir, progress, recipes, static_bytes=analyzed,
        per_channel_first="per-channel" in options.allow,
        speed_runs=SPEED_RUNS if options.time_runs > 0 else 0,
    )  # fmt: skip


_Answer = tuple[Plan, Trial, QuantSpec, onnx.ModelProto]


@dataclass(frozen=True)
class _Run:
    """What every per-node search of one propose run shares (its evaluators, options and data)."""

    screened: Evaluator
    target: Target
    options: ProposeOptions
    progress: Progress
    pool: Pool | None
    calib_src: str | Path
    eval_src: str | Path
    cfg: AnalysisConfig
    config: SessionConfig
    evaluator: Evaluator
    allow: tuple[str, ...]


@dataclass(frozen=True)
class _Searched:
    """One per-node search from one base (plain static, or a recipe's model) and its answer."""

    prep: Prepared
    report: Report
    search: Search
    initial: list[Unit]
    answer: _Answer
    reranks: int
    rerank: Rerank
    switch: SwitchScreen | None
    flipped: Any
    flipped_note: str
    latency_note: str = ""
    """Why the answer is a larger set than the smallest that meets the target (its estimated latency), or ""."""

    @property
    def met(self) -> bool:
        """Whether its answer meets the target within ``--max-nodes``."""
        final = self.answer[1]
        return final.met and self.search.fits(final)


def _search_from(
    prep: Prepared,
    report: Report,
    changes: Mapping[str, object],
    prescored: Sequence[tuple[onnx.ModelProto, EvalResult]],
    run: _Run,
) -> _Searched:
    """The per-node search from ``prep``'s model (diagnoses, group testing, per-node fixes): its answer."""
    options, allow = run.options, run.allow
    search, structure, initial = _search(
        prep, report, run.screened, run.target, options, run.progress, run.pool, changes
    )
    for model, result in prescored:  # plain static (per-channel too), scored already: not again
        search.prescore(model, result)
    switch = _switch_screen(search, prep, report, options)
    rerank = _reranker(search, prep, run.calib_src, run.cfg, options, run.config, run.progress)
    widened = rank_units(structure, report.nodes, report.weights, widen=True)
    diagnosed = diagnosed_units(structure, report)
    # --allow calib-flipped: the flipped samples' FP32 ranges, measured once
    flipped, flipped_note = flipped_ranges(
        report, run.evaluator, prep.normalized, prep.ranges, run.config, run.eval_src, allow
    )

    def fixer(unit: Unit, kind: str) -> Fix | None:
        return fix_for(unit, kind, structure, report, search.per_channel, flipped)

    wholes = [
        fix
        for fix in (
            whole_reduce_range(structure, report) if "reduce-range" in allow else None,
            flipped.whole() if flipped is not None else None,
            _long_tails(prep, report, search, run) if "clip" in allow else None,
        )
        if fix is not None
    ]
    plan, met, reranks = run_search(
        search, initial, rerank, options.max_nodes, widened, diagnosed, fixer=fixer, wholes=wholes
    )
    plan, met, latency_note = _cheaper(search, report, plan, met)
    answer = _selective(search, report, plan, met)
    return _Searched(
        prep, report, search, initial, answer, reranks, rerank, switch, flipped, flipped_note, latency_note
    )


def _cheaper(search: Search, report: Report, plan: Plan, met: Trial | None) -> tuple[Plan, Trial | None, str]:
    """The met candidate estimated clearly faster than the search's smallest answer, from the report's profile
    (``analyze --profile``; :mod:`qdebug.propose.latency`), with the note saying so; else the answer as it was."""
    graph = [n.name for n in search.normalized.graph.node]
    latency = LatencyModel.of(report.profile, search.trials[0], graph) if search.trials else None
    if latency is None or met is None or not search.fits(met):
        return plan, met, ""
    found = cheapest(search, latency, met)
    if found is None:
        return plan, met, ""
    chosen, est, mine = found
    return plan_of(plan, chosen), chosen, chosen_note(latency, met, chosen, est, mine)


def _on_runner_up(stage: RecipeStage, found: _Searched, report: Report, run: _Run) -> tuple[RecipeStage, _Searched]:
    """When no recipe met the target alone and the search from plain static missed it too (or kept most nodes
    FP32), the search again from the best recipe that beat plain static; its answer where it is the better."""
    runner = stage.runner_up
    final = found.answer[1]
    excludable = len(found.search.structure.excludable)
    if runner is None or runner.prep is None or found.met and not mostly_fp32(len(final.nodes), excludable):
        return stage, found
    base = runner.prep
    other = _search_from(base, _on_base(report, base), {}, (), run)
    mine = other.answer[1]
    size, before = (len(mine.nodes), -other.search.score(mine)), (len(final.nodes), -found.search.score(final))
    better = (other.met and not found.met) or (other.met == found.met and size < before)
    if not better:
        note = (
            f"the per-node search from recipe {recipe_label(runner).removeprefix('recipe ')} did no better "
            f"({len(other.search.trials)} evaluations) than the one from {_base_label(stage)}"
        )
        return dataclasses.replace(stage, notes=(*stage.notes, note)), found
    start = _base_label(stage)
    note = (
        f"the per-node search from {start} {'missed the target' if not found.met else 'kept most nodes FP32'} "
        f"({len(found.search.trials)} evaluations); from recipe {recipe_label(runner).removeprefix('recipe ')} it "
        f"{'meets it' if other.met else 'comes closer'} with {len(mine.nodes)} node(s) FP32"
    )
    return dataclasses.replace(stage.with_base(runner), notes=(*stage.notes, note)), other


def _on_run_time(
    stage: RecipeStage, found: _Searched, prep: Prepared, report: Report, run: _Run
) -> tuple[RecipeStage, _Searched]:
    """Dynamic (or mixed) quantization with exclusions, the ORT docs' advice for Transformer and RNN models:
    where that recipe missed the target alone but beat plain static (:attr:`RecipeStage.near_miss`), the
    per-node search on its quantizer, over the nodes it quantizes (:func:`run_time_units`), from the user's
    FP32 model (``prep``, ``report``); its answer where :func:`_run_time_wins` says so, with a note either way.
    Not for ``dynamic`` on a model with convolutions: it runs them as slow ConvInteger or leaves them float
    (``mixed`` is the recipe for those)."""
    near = stage.near_miss
    if near is None or near.result is None or "fp32" not in run.allow or run.target.met(near.result):
        return stage, found  # (met yet not chosen: refused for giving the speed-up back, exclusions slow it more)
    final = found.answer[1]
    if found.met and not final.nodes:
        return stage, found  # nothing kept FP32: no smaller change to find
    ops = {n.name: n.op_type for n in prep.normalized.graph.node}
    if near.name == "dynamic" and any(op in ("Conv", "ConvTranspose") for op in ops.values()):
        return stage, found  # it would run them as slow ConvInteger or leave them float: mixed is for these
    changes = spec_changes(near.steps, near.params)
    search, _, initial = _search(prep, report, run.screened, run.target, run.options, run.progress, run.pool, changes)
    kept = near.quantized()
    if kept is not None:  # scored by the same evaluator in the stage: not again
        search.prescore(kept, near.result)
    units = run_time_units(initial, near.name, run_time_quantizable(prep.normalized))
    plan, met, _ = run_search(search, units, lambda plan, widen: units, run.options.max_nodes)
    answer = _selective(search, report, plan, met)
    mine, label = answer[1], recipe_label(near).removeprefix("recipe ")
    if not (mine.met and search.fits(mine)):
        note = f"recipe {label} with nodes kept FP32 did not meet the target either ({len(search.trials)} evaluations)"
        return dataclasses.replace(stage, notes=(*stage.notes, note)), found
    runs = RANK_RUNS if run.options.time_runs > 0 else 0
    wins, why = _run_time_wins(found, mine, quantizable_count(search), lambda: compare_speed(
        answer[3], found.answer[3], run.screened, runs))  # fmt: skip
    kept_fp32 = f"{len(mine.nodes)} node(s) FP32" + (
        " and per-channel weights" if mine.per_channel and not search.base_spec.per_channel else ""
    )
    if not wins:
        note = f"recipe {label} meets the target with {kept_fp32} ({len(search.trials)} evaluations) but {why}: "
        note += f"the answer is from {_base_label(stage)}"
        return dataclasses.replace(stage, notes=(*stage.notes, note)), found
    searched = _Searched(prep, report, search, units, answer, 0, lambda plan, widen: units, None, None, "")
    return stage.with_run_time(near, f"recipe {label} meets the target with {kept_fp32}: {why}"), searched


def _run_time_wins(
    found: _Searched, mine: Trial, total: int, timed: Callable[[], SpeedComparison | None]
) -> tuple[bool, str]:
    """Whether the run-time answer ``mine`` (which meets the target; ``total``: the nodes its quantizer
    quantizes) replaces the static one, and why (why not). It does where the static answer misses the target;
    not where it keeps most of its own nodes FP32 while the static answer meets it; where the static answer
    keeps most nodes FP32; else, both meeting it, where it keeps fewer nodes FP32 and is not timed slower, or
    is timed faster -- each in every one of three interleaved rounds (``timed``; None: untimed, fewer wins)."""
    final = found.answer[1]
    if not found.met:  # a met answer, even one that keeps most nodes FP32 (the speed verdict says so)
        return True, "the per-node search " + ("found none within --max-nodes" if final.met else "missed the target")
    if mostly_fp32(len(mine.nodes), total):  # 8 of a deep MLP's 11 MatMuls kept out: no speed-up left
        return False, f"keeps {len(mine.nodes)} of the {total} nodes it quantizes FP32, most of its speed-up gone"
    if mostly_fp32(len(final.nodes), len(found.search.structure.excludable)):
        return True, "the per-node search kept most nodes FP32"
    speed = timed()
    shown = f" (p50 {speed.mine_ms:.3g} vs {speed.theirs_ms:.3g} ms)" if speed is not None else ""
    verdict = speed.verdict if speed is not None else "untimed"
    if len(mine.nodes) < len(final.nodes) and verdict != "slower":
        how = " (untimed: --time-runs 0)" if speed is None else (
            f" and runs {'faster' if verdict == 'faster' else 'as fast within the noise'}{shown}")  # fmt: skip
        return True, f"it keeps fewer nodes FP32 than the static answer's {len(final.nodes)}{how}"
    if verdict == "faster":
        return True, f"it runs faster than the static answer with {len(final.nodes)} node(s) FP32{shown}"
    if verdict == "slower":
        return False, f"runs slower than the static answer{shown}"
    return False, f"keeps no fewer nodes FP32 than its {len(final.nodes)} and is not timed faster{shown}"


def _batch_note(stage: RecipeStage, evaluator: Evaluator) -> list[str]:
    """A dynamic or mixed answer's score holds for batches like the evaluation's: quantize_dynamic gives each
    MatMul input one range per run, over the whole batch (the planted gain model scored 99.6 % at batch 16 and
    61 % at 512, its recording sessions mixed in one range)."""
    chosen = stage.chosen
    if chosen is None or recipe_entry(chosen.name).transforms or not evaluator.batches:
        return []
    rows = evaluator.batches[0].size
    return [
        f"recipe {chosen.name} quantizes each MatMul input at run time over the whole batch it runs: its score was "
        f"measured on batches of {rows}; deployed at another batch size (or mixing unlike inputs in one batch), "
        "check it with qdebug verify --batch-size N"
    ]


def quantizable_count(search: Search) -> int:
    """How many nodes the answer's quantizer quantizes: under the dynamic recipe only those
    ``quantize_dynamic`` quantizes (its other nodes stay float whatever the answer keeps), else every node
    the static quantizer quantizes. "Most nodes kept FP32" counts against it."""
    if search.spec((), ()).quantizer == "dynamic":
        return len(run_time_quantizable(search.normalized))
    return len(search.structure.excludable)


def _base_label(stage: RecipeStage) -> str:
    """What the first per-node search started from: ``plain static`` or ``recipe fold-bn``."""
    return f"recipe {recipe_label(stage.chosen).removeprefix('recipe ')}" if stage.chosen else "plain static"


def _deferred_answer(
    stage: RecipeStage,
    search: Search,
    report: Report,
    answer: _Answer,
    rerank: Rerank,
    allow: Sequence[str],
    new_search: Callable[[Mapping[str, object]], Search],
    timed: Callable[[RecipeTrial, float, onnx.ModelProto, float], str] | None = None,
) -> tuple[RecipeStage, Search, _Answer]:
    """The per-node search's ``answer``, or the stage's deferred dynamic or mixed recipe where that replaces
    it (:func:`~qdebug.propose.recipes.replaces`): then a search on the recipe's quantizer (``new_search``),
    whose first trial, the recipe's model, meets the target. ``timed``: why the recipe is better on both axes
    than the answer's model and score (:func:`~qdebug.propose.recipes.better_on_both_axes`), "" when not."""
    final = answer[1]
    if stage.deferred is None:
        return stage, search, answer
    ops = {n.name: n.op_type for n in search.normalized.graph.node}
    met = final.met and search.fits(final)
    why = replaces(stage.deferred, met, final.nodes, len(search.structure.excludable), ops)
    if not why and met and timed is not None:
        assert stage.deferred.result is not None
        why = timed(stage.deferred, search.target.value(stage.deferred.result), answer[3], search.score(final))
    if not why:
        return stage, search, answer
    trial = stage.deferred
    stage = stage.with_chosen(trial)
    stage = dataclasses.replace(stage, notes=(*stage.notes, f"{why} ({len(search.trials)} evaluations)"))
    search = new_search(stage.changes)
    kept = trial.quantized()
    if kept is not None and trial.result is not None:  # scored by the same evaluator in the stage: not again
        search.prescore(kept, trial.result)
    plan, met_trial, _ = run_search(search, [], rerank, None)
    return stage, search, _selective(search, report, plan, met_trial)


def _plain_static(stage: RecipeStage, frontier: Sequence[FrontierPoint], evaluator: Evaluator, target: Target) -> float:
    """The user's model's full static INT8 metric on every evaluation sample, when a recipe is the base (the
    search's first trial is then the recipe's): the frontier's ``static`` point, else scored here."""
    point = next((p for p in frontier if p.label == "static"), None)
    if point is not None:
        return point.metric
    assert stage.static is not None
    model, result = stage.static
    return target.value(result if result.samples == evaluator.samples else evaluator.score(model))


def _on_base(report: Report, base: Prepared) -> Report:
    """The report as the search reads it on ``base``: a recipe that folded nodes away (BatchNormalization
    into its Conv) leaves them out of the ranking, since no variant can exclude them."""
    names = {n.name for n in base.normalized.graph.node}
    if all(n.name in names for n in report.nodes):
        return report
    return dataclasses.replace(report, nodes=tuple(n for n in report.nodes if n.name in names))


def _check_names(report: Report, prep: Prepared) -> None:
    """Refuse a report whose node names the normalized model lacks (another qdebug's normalization): its
    blame would name nodes no variant can exclude."""
    names = {n.name for n in prep.normalized.graph.node}
    missing = [n.name for n in report.nodes if n.name not in names]
    if missing:
        raise QDebugError(
            f"the report's nodes do not match the normalized model ({len(missing)} missing: {missing[0]!r}...)",
            "re-run qdebug analyze with this qdebug version",
            ExitCode.INPUT,
        )


def _evaluator(
    prep: Prepared, eval_src: str | Path, cfg: AnalysisConfig, options: ProposeOptions, config: SessionConfig
) -> tuple[Evaluator, list[str]]:
    """The evaluator every candidate is scored with (FP32 scored once, here), and the notes on its data."""
    eval_set = open_data(
        eval_src,
        prep.calib.specs,
        batch_size=cfg.batch_size,
        max_samples=options.eval_max_samples,
        what="evaluation data",
        limit_flag="--eval-max-samples",
    )
    evaluator = Evaluator(prep.normalized, eval_set, config, options.metric or cfg.metric)
    notes = data_notes(prep.calib, eval_set, prep.normalized)
    notes += [n for n in [metric_scope_note(evaluator)] if n]
    return evaluator, notes


def _switch_screen(search: Search, prep: Prepared, report: Report, options: ProposeOptions) -> SwitchScreen | None:
    """The search's evaluator wrapped to screen on the switchable model of its static variant, when
    ``--screen-model`` asks for it (:mod:`qdebug.propose.switch`); the search then scores in this process
    (the one switchable session), its pool kept for the confirmation and the frontier."""
    if not switch.wanted(options.screen_model, report) or search.base_spec.quantizer != "static":
        return None  # the switchable model switches QDQ pairs: a dynamic base has none to switch
    static = search.build((), (), search.per_channel)[1]
    screen = switch.switch_screen(search.evaluator, static, prep.normalized)
    if screen is not None:
        search.evaluator = screen
        search.pool = None
    return screen


def _long_tails(prep: Prepared, report: Report, search: Search, run: _Run) -> Fix | None:
    """The clip fix of every long-tailed activation (:func:`~qdebug.propose.fixes.whole_percentile`), when the
    search's static model misses the target: only then is the percentile calibration pass spent (cached)."""
    assert prep.ranges is not None
    baseline = search.evaluate("baseline", ())
    if baseline is None or baseline.met:
        return None
    options = _prepare_options(report.config, run.options)
    ranges = ranges_by(prep, options, "percentile", run.progress, percentile=PERCENTILE)
    return whole_percentile(prep.ranges.minmax(), ranges.minmax())


def _search(
    prep: Prepared,
    report: Report,
    evaluator: Evaluator,
    target: Target,
    options: ProposeOptions,
    progress: Progress,
    pool: Pool | None = None,
    changes: Mapping[str, object] | None = None,
) -> tuple[Search, Structure, list[Unit]]:
    """The search state over the report's first ranking, with its budget (some held back for refining);
    ``changes``: the chosen recipe's changes to the quantizer settings (a dynamic or mixed recipe's quantizer, its
    7-bit weights), for every variant."""
    assert prep.ranges is not None
    structure = Structure(prep.normalized, report.nodes)
    initial = rank_units(structure, report.nodes, report.weights)
    budget = options.max_evaluations or default_budget(_candidate_nodes(initial))
    base_spec = QuantSpec.of(prep.settings, **(changes or {}))  # type: ignore[arg-type]  # the report's settings
    int16_type = "QInt16" if prep.settings.activation_type == "QInt8" else "QUInt16"
    search = Search(
        prep.normalized,
        prep.ranges,
        base_spec,
        evaluator,
        target,
        structure,
        budget,
        int16_type,
        progress,
        options.max_nodes,
        pool,
        check_allow(options.allow),
    )
    if options.max_evaluations is None:
        search.held = held_back(_candidate_nodes(initial))
    offer_analyzed_inference(report)
    static = analyzed_static(report, prep.normalized_path, prep.ranges, search.spec((), ()))
    if static is not None:  # not quantized again: analyze built exactly this model
        search.adopt_static(static)
    return search, structure, initial


def _candidate_nodes(units: Sequence[Unit]) -> int:
    """``L``: distinct excludable nodes over the ranked units (what the default budget is a log of)."""
    return len({n for u in units for n in u.nodes})


def _reranker(
    search: Search,
    prep: Prepared,
    calib_src: str | Path,
    cfg: AnalysisConfig,
    options: ProposeOptions,
    config: SessionConfig,
    progress: Progress,
) -> Rerank:
    """Re-rank the units by a short layer capture of a plan's variant on a few calibration samples.

    The samples are opened on the first re-rank: a search that needs none reads no data for it.
    """
    limit = rerank_limit(prep.calib.specs, options.rerank_samples, prep.calib.n_samples)
    opened: list[DataSet] = []

    def rerank(plan: Plan, widen: bool) -> list[Unit]:
        progress("re-rank", 0, None)
        if not opened:
            opened.append(open_data(calib_src, prep.calib.specs, batch_size=cfg.batch_size, max_samples=limit))
        nodes, weights = _capture_nodes(search, plan, opened[0], config, search.ranges, prep.name_map)
        excluded, overridden = frozenset(plan.nodes()), frozenset(plan.overrides())
        return rank_units(search.structure, nodes, weights, excluded, overridden, widen=widen)

    return rerank


def _selective(
    search: Search, report: Report, plan: Plan, met: Trial | None
) -> tuple[Plan, Trial, QuantSpec, onnx.ModelProto]:
    """The answer and its model: the met trial that fits (else the best that does), per-channel weights
    dropped when the report's settings had none and they do not earn their place."""
    plan, final = final_answer(search, plan, met)
    spec, selective, _ = search.build(final.nodes, final.overrides, final.per_channel, fixes=final.fixes)
    if spec.per_channel and not search.base_spec.per_channel:
        # per-channel weights show in a static model's Q/DQ; a dynamic model's sit in its integer MatMuls'
        # scales, which qdq_settings does not read: there one evaluation decides (it had recorded the
        # per-channel score for the model built without them)
        in_effect = bool(qdq_settings(selective).per_channel) if spec.quantizer == "static" else True
        final = without_per_channel(search, final, in_effect)
        if not final.per_channel:
            spec, selective, _ = search.build(final.nodes, final.overrides, False, fixes=final.fixes)
    return plan, final, spec, selective


def _proposal_record(
    report: Report,
    model_path: Path,
    prep: Prepared,
    calib_src: str | Path,
    search: Search,
    plan: Plan,
    spec: QuantSpec,
    final: Trial,
    seconds: float,
    sel_path: Path | None,
    recipe: RecipeRecord | None = None,
) -> Proposal:
    """The proposal file's record; ``sel_path`` is where the selective model goes (``None``: nothing is
    written, so the normalized model recorded is the report's)."""
    cfg, settings = report.config, prep.settings
    target, static = search.target, search.trials[0]
    return Proposal(
        schema_version=SCHEMA_VERSION,
        kind="proposal",
        model_path=str(model_path.resolve()),
        model_sha256=report.model.sha256,
        normalized_model=str(prep.normalized_path.resolve()) if sel_path is not None else report.normalized_model,
        nodes_to_exclude=spec.nodes_to_exclude,
        tensor_overrides=spec.tensor_overrides,
        per_channel=spec.per_channel,
        reasons=reason_lines(report, plan, spec, target, static, final, search.trials),
        metric=target.metric if target.kind == "drop" else "output_sqnr_db",
        fp32_metric=target.fp32 if target.kind == "drop" else math.inf,
        static_metric=target.value(static),
        expected_metric=target.value(final),
        evaluations=len(search.trials),
        search_seconds=seconds,
        source="propose",
        quantized_model=str(sel_path.resolve()) if sel_path is not None else None,
        snippet=proposal_snippet(report, model_path, prep, spec, calib_src, recipe),
        quantizable_nodes=quantizable_count(search),
        qdq_pairs_delta=final.qdq_pairs - static.qdq_pairs,
        method=settings.method,
        activation_type=settings.activation_type,
        weight_type=settings.weight_type,
        base_per_channel=settings.per_channel,
        calibration_key=prep.ranges.key if prep.ranges is not None else "",
        calib_max_samples=cfg.max_samples,
        eval_samples=search.evaluator.samples,
        quant_settings=settings,
    )


def _capture_nodes(
    search: Search, plan: Plan, data: DataSet, config: SessionConfig, ranges: Ranges, name_map: dict[str, str]
) -> tuple[tuple[NodeRecord, ...], tuple[WeightRecord, ...]]:
    """Node records of the current variant: a short layer capture on a few calibration samples."""
    _, model, _ = search.build(plan.nodes(), plan.overrides(), keep_float=plan.keep_float())
    pairing = pair_models(search.normalized, model)
    # re-ranking needs local and accumulated error only, not the fake-quant view
    layers = measure_layers(search.normalized, model, pairing, data, config, ranges.minmax(), fakequant_samples=0)
    qnodes = quantized_node_names(model, pairing)
    nodes = node_records(search.normalized, layers.tensors, qnodes, name_map)
    return nodes, weight_records(search.normalized, model, pairing)
