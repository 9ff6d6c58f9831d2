"""Verify a proposal: FP32 vs full static vs selective static, side by side, on the evaluation set.

The selective model is re-quantized from the cached calibration ranges with
the proposal's ``nodes_to_exclude``/overrides (the proposal's own model file is
not trusted), and the three variants are compared on:

* the task metric and the worst output SQNR vs FP32;
* the recovered fraction ``(sel - static) / (fp32 - static)`` -- for a metric
  with no finite FP32 value (output SQNR) the verdict uses ``--target-sqnr``;
* every drop, recovery and output SQNR with its paired-bootstrap interval
  (:mod:`qdebug.evaluation.noise`, assembled by :mod:`qdebug.evaluation.gates`): :func:`assess` passes or fails a gate
  only beyond the noise at ``--confidence``, else the result is undecided (exit 8);
* nodes kept FP32 (count and share of the quantizable nodes), Q/DQ pairs;
* model size, and latency p50/p95 + throughput measured fairly by
  :func:`time_sessions`: one session per variant created once with the same
  provider and threads, the same input buffers bound once (IOBinding), a
  warm-up, then timed runs in alternating rounds so drift hits every variant alike.

:func:`verify` runs its stages in order: check the options, identify the model,
resolve the settings, prepare (:class:`_Context`), build and score the two
quantized variants, save them, time all three, and assemble the
:class:`VerifyResult`. The ``verify.json`` records live in
:mod:`qdebug.records.verify` (re-exported here); the TUI's ``verify_fn`` adapter
is :func:`qdebug.cli.tui.make_tui_verify`, which reuses one :class:`_Context`
across calls.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from qdebug.analysis import quantized_node_names
from qdebug.data import DataSet, data_notes, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator, metric_scope_note
from qdebug.evaluation.gates import (  # re-exported: the gates verify judges by
    Judgement,
    assess,
    gate_noise,
    judge,
    noise_fields,
    speedup_gate,
)
from qdebug.evaluation.noise import DEFAULT_CONFIDENCE
from qdebug.evaluation.samples import DEFAULT_FLIP_DETAILS, DetailTarget, per_sample_section
from qdebug.graph.load import LoadedModel, load_model, save_model, stored_size, weight_bytes
from qdebug.graph.match import pair_models
from qdebug.output.files import (
    artifacts_dir,
    atomic_write_text,
    check_outputs_spare_inputs,
    check_writable,
    removed_on_failure,
)
from qdebug.output.report_io import dumps, load_proposal
from qdebug.prepare import (
    QUANT_FLAT,
    AnalyzeOptions,
    Prepared,
    QuantRequest,
    RuntimeSettings,
    base_setting_notes,
    calibration_notes,
    check_proposal,
    flat_settings,
    prepare,
    recipe_base,
    settings_notes,
)
from qdebug.progress import Progress, no_progress
from qdebug.quant.calibrate import op_types_to_quantize
from qdebug.quant.quantize import QuantSpec, quantize_model, quantize_static_model, run_time_quantizable
from qdebug.quant.recalibrate import calib_add_flipped
from qdebug.records import SCHEMA_VERSION, Proposal
from qdebug.records.samples import SampleSection
from qdebug.records.verify import Timing, VariantResult, VerifyResult
from qdebug.runtime.capture import SessionConfig
from qdebug.runtime.parallel import Pool, check_request, open_pool, score_all
from qdebug.runtime.timing import CHUNK_RUNS, time_sessions  # re-exported: verify times its table there
from qdebug.verify.table import Variants, float_size_notes, speed_clause, variant_columns, with_weights

__all__ = [
    "CHUNK_RUNS",
    "DEFAULT_MIN_RECOVERY",
    "Judgement",
    "Timing",
    "VariantResult",
    "VerifyOptions",
    "VerifyResult",
    "assess",
    "judge",
    "time_sessions",
    "verify",
]

DEFAULT_MIN_RECOVERY = 0.9


# ----------------------------------------------------------------------------- verify


@flat_settings(QUANT_FLAT)
@dataclass(frozen=True)
class VerifyOptions:
    """Options of :func:`verify` (the flags of ``qdebug verify``).

    ``quant``: a ``--config``/``--preset`` and the quantization flags given; what they leave open is the
    proposal's (:attr:`~qdebug.records.Proposal.quant`), else qdebug's default. ``method``,
    ``activation_type``, ``weight_type`` (None: the proposal's), ``per_channel`` (per-channel weights for
    the static baseline too), ``upgrade_opset``, ``inline_constant_if`` (False: the proposal's) and the
    runtime's ``providers``, ``threads``, ``use_cache`` are still accepted and read as flat names.
    """

    min_recovery: float = DEFAULT_MIN_RECOVERY
    target_sqnr: float | None = None
    target_drop: float | None = None
    """Judge as ``propose --target-drop`` does instead of by recovery: the selective model may lose at most
    this much against FP32 (points for top-1 style metrics). None: judge by ``min_recovery``."""
    confidence: float = DEFAULT_CONFIDENCE
    """Confidence of the paired-bootstrap intervals the gates are judged by (:mod:`qdebug.evaluation.noise`): a gate
    passes or fails only beyond the noise, else the result is undecided. 0: judge the point estimates."""
    metric: str | None = None
    quant: QuantRequest = field(default_factory=QuantRequest)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    batch_size: int | None = None
    max_samples: int | None = None
    eval_max_samples: int | None = None
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (input, axis); the others are read off the model."""
    runs: int = 50
    """Timed runs per variant (0: no latency measurement)."""
    warmup: int = 5
    flip_details: int = DEFAULT_FLIP_DETAILS
    """The selective model's flipped samples measured tensor by tensor (``--flip-details``; 0: none)."""
    accept_no_speedup: bool = False
    """Pass a selective model that gives the INT8 speed-up back (most quantizable nodes FP32, or timed slower
    than FP32 while full static is faster), as ``propose --accept-no-speedup`` takes such an answer; one
    that quantizes nothing never passes (:func:`~qdebug.gates.speedup_gate`)."""
    calib_add_flipped: bool = False
    """Also rebuild both variants with static's flipped samples added to the cached calibration ranges, and
    score them (``--calib-add-flipped``, :mod:`qdebug.quant.recalibrate`)."""


class _Context:
    """What verify needs that does not depend on the proposal (built once; reused by the TUI)."""

    def __init__(
        self,
        model: str | Path,
        calib: str | Path,
        eval_data: str | Path | None,
        workdir: Path,
        options: VerifyOptions,
        method: str,
        progress: Progress,
        check: Callable[[onnx.ModelProto], None] | None = None,
    ) -> None:
        self.options = options
        quant = options.quant
        if method and quant.config is None and quant.value("method") is None:
            quant = quant.with_given({"method": method})
        aopts = AnalyzeOptions(
            quant=quant,
            runtime=options.runtime,
            batch_size=options.batch_size,
            max_samples=options.max_samples,
            batch_axes=options.batch_axes,
        )
        self.aopts = aopts
        self.prep = prepare(
            model,
            calib,
            workdir,
            aopts,
            progress=progress,
            check=check,
            eval_data=_eval_source(calib, eval_data, options),
            eval_max_samples=options.eval_max_samples,
            eval_limit_flag="--eval-max-samples",
        )
        self.config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
        eval_set = _eval_set(calib, eval_data, self.prep.calib, options)
        self.data_notes = data_notes(
            self.prep.calib, eval_set if eval_set is not self.prep.calib else None, self.prep.normalized
        )
        self.evaluator = Evaluator(self.prep.normalized, eval_set, self.config, options.metric)
        self.data_notes += [n for n in [metric_scope_note(self.evaluator)] if n]
        self.feeds = dict(self.evaluator.batches[0].feeds)
        self.static_cache: dict[str, tuple[onnx.ModelProto, EvalResult, set[str]]] = {}
        self._recipe_bases: dict[str, Prepared] = {}
        self._ops = set(self.prep.settings.op_types or op_types_to_quantize())

    def base_of(self, proposal: Proposal) -> Prepared:
        """The prepared FP32 model the selective variant is quantized from: the context's, or the proposal's
        recipe's transformed model (checked by hash, calibrated with the context's settings, cached)."""
        recipe = proposal.recipe
        if recipe is None or not recipe.fp32_model:
            return self.prep
        key = f"{recipe.fp32_model}:{recipe.fp32_sha256}"
        if key not in self._recipe_bases:
            self._recipe_bases[key] = recipe_base(self.prep, proposal, self.aopts)
        return self._recipe_bases[key]

    def static(
        self, spec: QuantSpec, pool: Pool | None = None, then: Callable[[], object] | None = None
    ) -> tuple[onnx.ModelProto, EvalResult, set[str]]:
        """(model, EvalResult, quantizable node names) of the full static variant (cached per spec).

        With ``pool`` its score runs there, and ``then`` (the selective variant's build and hand-over) runs
        while it does."""
        key = repr(spec)
        if key not in self.static_cache:
            model = quantize_static_model(self.prep.normalized, self.prep.ranges, spec)
            if pool is None:
                result = self.evaluator.score(model, what="static quantized model")
            else:
                ticket = pool.submit(self.evaluator, model, "static quantized model")
                try:
                    if then is not None:
                        then()
                finally:  # static's own error first, as when scored one after the other
                    result = pool.result(ticket)
            qnodes = quantized_node_names(model, pair_models(self.prep.normalized, model))
            ops = {n.name: n.op_type for n in self.prep.normalized.graph.node}
            quantizable = {n for n in qnodes if ops.get(n) in self._ops}
            self.static_cache[key] = (model, result, quantizable)
        return self.static_cache[key]


def _eval_set(calib: str | Path, eval_data: str | Path | None, calibration: DataSet, options: VerifyOptions) -> DataSet:
    """The data the variants are scored on: ``eval_data``, else the calibration data (re-opened when
    ``--eval-max-samples`` caps it, so the cap does not shrink the calibration)."""
    source = _eval_source(calib, eval_data, options)
    if source is None:
        return calibration
    return open_data(
        source,
        calibration.specs,
        batch_size=options.batch_size,
        max_samples=options.eval_max_samples,
        what="evaluation data",
        limit_flag="--eval-max-samples",
    )


def _eval_source(calib: str | Path, eval_data: str | Path | None, options: VerifyOptions) -> str | Path | None:
    """The source :func:`_eval_set` opens anew (None: the calibration data as calibrated)."""
    return eval_data if eval_data is not None else calib if options.eval_max_samples is not None else None


def verify(
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    proposal: Proposal | str | Path,
    *,
    options: VerifyOptions | None = None,
    output: str | Path | None = None,
    progress: Progress | None = None,
    cancelled: Callable[[], bool] | None = None,
    _context: _Context | None = None,
) -> VerifyResult:
    """Re-quantize with the proposal and compare FP32 / full static / selective static.

    Args:
        model: the user's FP32 model (must be the one the proposal was made for).
        calib: calibration data (ranges come from the cache when present).
        eval_data: evaluation data (None: the calibration data).
        proposal: a :class:`Proposal` or the path of a proposal file.
        options: see :class:`VerifyOptions`.
        output: write ``verify.json`` here (atomically), and the static/selective models to ``<stem>_files/``.
        progress: callback(stage, done, total).
        cancelled: polled between stages; when it turns True the function returns early with what it has
            (only used by the TUI, which discards that result).

    """
    start = time.perf_counter()
    options = options or VerifyOptions()
    progress = progress or no_progress
    cancelled = cancelled or (lambda: False)
    source = "tui" if isinstance(proposal, Proposal) else str(proposal)
    if output is not None:
        _spare_inputs(output, model, calib, eval_data, proposal)
    if not isinstance(proposal, Proposal):
        proposal = load_proposal(proposal)
    _check_options(options)
    if output is not None:
        check_writable(output)
    loaded = load_model(model)
    _same_model(proposal, loaded, model)
    method, options = _resolved_settings(options, proposal)
    tmp = None
    # a failed or interrupted run leaves no half-filled <stem>_files/, and an earlier run's outputs as they were
    guard = removed_on_failure(
        artifacts_dir(Path(output)) if output is not None else None,
        [output],
        [model, calib, eval_data, source if source != "tui" else None],
    )
    try:
        with guard, open_pool(options.runtime) as pool:  # its workers stop before the guard cleans up
            ctx = _context
            if ctx is None:
                if output is not None:
                    workdir = artifacts_dir(Path(output))
                else:
                    tmp = tempfile.TemporaryDirectory(prefix="qdebug-verify-")
                    workdir = Path(tmp.name)
                ctx = _Context(
                    model,
                    calib,
                    eval_data,
                    workdir,
                    options,
                    method,
                    progress,
                    check=lambda normalized: check_proposal(proposal, loaded.sha256, model, normalized),
                )
            check_proposal(proposal, loaded.sha256, model, ctx.prep.normalized)
            _require_fp32_value(ctx.evaluator, options)
            built = _quantized_variants(ctx, proposal, progress, cancelled, pool)
            if built is None:
                return _cancelled(proposal, source)
            models = {"fp32": ctx.prep.normalized, "static": built.static_model, "selective": built.selective_model}
            paths, sizes = _saved_models(models, output, ctx, loaded)
            weights = {name: weight_bytes(m) for name, m in models.items()}
            timing_notes: list[str] = []
            timings = _timings(models, ctx, options, progress, cancelled, timing_notes)
            if timings is None:
                return _cancelled(proposal, source)
            progress("timing", 3, 3)
            columns = variant_columns(ctx.evaluator.fp32_value, built, proposal, sizes, paths, timings)
            columns = with_weights(columns, weights)
            result = _verify_result(ctx, loaded, proposal, source, options, built, columns, start)
            notes = result.notes + tuple(timing_notes) + float_size_notes(weights) + tuple(pool.notes)
            result = dataclasses.replace(result, notes=notes)
            if output is not None:
                atomic_write_text(output, dumps(result))
            return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def _spare_inputs(
    output: str | Path,
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    proposal: Proposal | str | Path,
) -> None:
    """Refuse an ``output`` that would replace a file this run reads (checked before any is read)."""
    check_outputs_spare_inputs(
        {"the verify result": output},
        {
            "the model": model,
            "the calibration data": calib,
            "the evaluation data": eval_data,
            "the proposal": None if isinstance(proposal, Proposal) else proposal,
        },
    )


def _check_options(options: VerifyOptions) -> None:
    """Refuse option values no run can honour, before any model or data is read."""
    check_request(options.runtime)
    if options.eval_max_samples is not None and options.eval_max_samples < 1:
        raise QDebugError(
            f"--eval-max-samples must be >= 1 (got {options.eval_max_samples})",
            "pass a positive number",
            ExitCode.USAGE,
        )
    if options.target_sqnr is not None and not math.isfinite(options.target_sqnr):
        raise QDebugError(
            f"--target-sqnr must be a finite number (got {options.target_sqnr})",
            "pass the required output SQNR in dB",
            ExitCode.USAGE,
        )
    if options.target_drop is not None and not 0.0 <= options.target_drop < math.inf:
        raise QDebugError(
            f"--target-drop must be >= 0 (got {options.target_drop})", "pass the allowed drop", ExitCode.USAGE
        )
    if not 0.0 <= options.confidence < 1.0:
        raise QDebugError(
            f"--confidence must be within [0, 1) (got {options.confidence})",
            "pass a level such as 0.95 (0: judge the point estimates, ignoring the noise)",
            ExitCode.USAGE,
        )
    if not 0.0 <= options.min_recovery <= 1.5:
        raise QDebugError(
            f"--min-recovery must be within [0, 1.5] (got {options.min_recovery})",
            "pass a fraction such as 0.9",
            ExitCode.USAGE,
        )


def _same_model(proposal: Proposal, loaded: LoadedModel, model: str | Path) -> None:
    """A proposal made for another model names that model's nodes: refuse it before calibrating."""
    if proposal.model_sha256 and proposal.model_sha256 != loaded.sha256:
        raise QDebugError(
            f"the proposal was made for another model (sha256 {proposal.model_sha256[:12]}...), not {model} "
            f"({loaded.sha256[:12]}...)",
            "run qdebug propose on a report of this model",
            ExitCode.INPUT,
        )


def _resolved_settings(options: VerifyOptions, proposal: Proposal) -> tuple[str, VerifyOptions]:
    """(calibration method, options): the options' quantization request over the proposal's settings (a
    flag or ``--config`` wins, else the proposal's setting, else the default); the proposal's calibration
    sample count applies unless ``--max-samples`` is given, so the ranges are the ones the proposal was
    searched with."""
    options = dataclasses.replace(options, quant=options.quant.over(proposal.quant))
    method = options.quant.resolve().method
    if options.max_samples is None and proposal.calib_max_samples is not None:
        options = dataclasses.replace(options, max_samples=proposal.calib_max_samples)
    if options.metric is None and proposal.metric and proposal.metric != "output_sqnr_db":
        # the metric propose judged by (a custom one had to be given again, or verify judged output SQNR)
        options = dataclasses.replace(options, metric=proposal.metric)
    return method, options


def _require_fp32_value(evaluator: Evaluator, options: VerifyOptions) -> None:
    """A metric without a finite FP32 value (output SQNR) leaves only ``--target-sqnr`` to judge by."""
    metric = evaluator.metric_name
    fp32_value = evaluator.fp32_value
    if not math.isfinite(fp32_value) and options.target_drop is not None:
        raise QDebugError(  # it had been skipped, yet recorded in verify.json as applied
            f"--target-drop needs a metric with an FP32 value; {metric} has none",
            "pass --target-sqnr DB to judge the selective model's output SQNR",
            ExitCode.USAGE,
        )
    if not math.isfinite(fp32_value) and options.target_sqnr is None:
        raise QDebugError(
            f"metric {metric} has no finite FP32 value, so a recovered fraction is undefined",
            "pass --target-sqnr DB to judge the selective model's output SQNR",
            ExitCode.USAGE,
        )


def _quantized_variants(
    ctx: _Context,
    proposal: Proposal,
    progress: Progress,
    cancelled: Callable[[], bool],
    pool: Pool | None = None,
) -> Variants | None:
    """Build and score full static (cached in ``ctx``) and selective static, both from the settings the
    context calibrated with (the proposal's, the user's config included, with the flags); None once
    cancelled. With several workers (``pool``) the two scores run side by side."""
    base, sel_spec = _specs(ctx, proposal)
    side = pool if pool is not None and not pool.inline else None
    handed: list = []
    sel_base = ctx.base_of(proposal)  # the recipe's transformed FP32 model, when the proposal has one

    def selective_too() -> None:  # built and handed over while static is scored
        model = quantize_model(sel_base.normalized, sel_base.ranges, sel_spec)
        handed.extend([model, side.submit(ctx.evaluator, model, "selective quantized model")])  # type: ignore[union-attr]

    progress("static", 0, 3)
    static_model, static_res, quantizable = ctx.static(base, side, selective_too)
    if cancelled():
        return None
    progress("selective", 1, 3)
    if handed:
        sel_model, sel_res = handed[0], side.result(handed[1])  # type: ignore[union-attr]
    else:  # one after the other (one worker, or static known already)
        sel_model = quantize_model(sel_base.normalized, sel_base.ranges, sel_spec)
        sel_res = score_all(side, ctx.evaluator, [sel_model], "selective quantized model")[0]
    if cancelled():
        return None
    other = sel_base.normalized if sel_base is not ctx.prep else None
    if sel_spec.quantizer == "dynamic":  # its other nodes stay float: "most kept FP32" counts against these
        quantizable = set(run_time_quantizable(sel_base.normalized))
    return Variants(static_model, static_res, quantizable, sel_model, sel_res, other)


def _specs(ctx: _Context, proposal: Proposal) -> tuple[QuantSpec, QuantSpec]:
    """(static, selective) specs, both from the settings the context calibrated with (the proposal's, the
    user's config included, with the flags)."""
    settings = ctx.prep.settings
    base = QuantSpec.of(settings, per_channel=settings.per_channel or bool(proposal.base_per_channel))
    sel_spec = QuantSpec.of(
        settings,
        per_channel=settings.per_channel or proposal.per_channel,
        nodes_to_exclude=tuple(proposal.nodes_to_exclude),
        tensor_overrides=tuple(proposal.tensor_overrides),
        **(proposal.recipe.spec_changes() if proposal.recipe is not None else {}),  # type: ignore[arg-type]
    )
    return base, sel_spec


def _per_sample(
    ctx: _Context, built: Variants, options: VerifyOptions, proposal: Proposal, notes: list[str]
) -> SampleSection | None:
    """The per-sample drill-down (:mod:`qdebug.evaluation.samples`): static's and selective's result per evaluation
    sample, their flips, and the selective model's worst remaining flips measured tensor by tensor; with
    ``calib_add_flipped`` both variants rebuilt with static's flips added to the calibration
    (:mod:`qdebug.quant.recalibrate`)."""
    target = None
    if options.flip_details > 0:
        pairing = pair_models(built.selective_base or ctx.prep.normalized, built.selective_model)
        target = DetailTarget("selective", built.selective_model, pairing)
    section = per_sample_section(
        ctx.evaluator,
        [("static", built.static), ("selective", built.selective)],
        ctx.prep.normalized,
        ctx.config,
        target=target,
        details=options.flip_details,
        notes=notes,
    )
    if section is None or not options.calib_add_flipped:
        return section
    static_spec, sel_spec = _specs(ctx, proposal)
    specs = [("static", static_spec, built.static.value), ("selective", sel_spec, built.selective.value)]
    if built.selective_base is not None:  # the two variants have different FP32 bases: not rebuilt alike
        notes.append("--calib-add-flipped is not applied to a proposal built on a recipe's transformed model")
        return section
    again = calib_add_flipped(ctx.evaluator, section, ctx.prep.normalized, ctx.prep.ranges, specs, ctx.config)
    return dataclasses.replace(section, recalibrated=again)


def _saved_models(
    models: Mapping[str, onnx.ModelProto], output: str | Path | None, ctx: _Context, loaded: LoadedModel
) -> tuple[dict[str, str | None], dict[str, int]]:
    """(paths, sizes) of the variants; with ``output`` the quantized ones are saved to ``<stem>_files/``
    and their sizes are the files', else their serialized sizes."""
    sizes = {name: m.ByteSize() for name, m in models.items()}
    paths: dict[str, str | None] = {
        "fp32": str(loaded.path.resolve()),
        "static": None,
        "selective": None,
    }
    # the model every variant is built from (as bench reports it), weights files included
    sizes["fp32"] = stored_size(ctx.prep.normalized_path)
    if output is not None:
        files = artifacts_dir(Path(output))
        for name in ("static", "selective"):
            path = files / f"{name}.onnx"
            save_model(models[name], path)
            paths[name] = str(path.resolve())
            sizes[name] = stored_size(path)
    return paths, sizes


def _timings(
    models: Mapping[str, onnx.ModelProto],
    ctx: _Context,
    options: VerifyOptions,
    progress: Progress,
    cancelled: Callable[[], bool],
    notes: list[str] | None = None,
) -> dict[str, Timing] | None:
    """Latency of every variant (none with ``runs`` 0); None once cancelled. What limits it goes to ``notes``."""
    if options.runs <= 0:
        return {}
    progress("timing", 2, 3)
    timings = time_sessions(
        models,
        ctx.feeds,
        ctx.config,
        runs=options.runs,
        warmup=options.warmup,
        cancelled=cancelled,
        notes=notes,
        rows=ctx.evaluator.batches[0].size,
    )
    return None if cancelled() else timings


def _verify_result(
    ctx: _Context,
    loaded: LoadedModel,
    proposal: Proposal,
    source: str,
    options: VerifyOptions,
    built: Variants,
    columns: tuple[VariantResult, ...],
    start: float,
) -> VerifyResult:
    """Judge the selective model (by the intervals of :func:`gate_noise`) and assemble the ``verify.json`` record."""
    evaluator = ctx.evaluator
    noise, noise_notes = gate_noise(evaluator, built.static, built.selective, options.confidence, options.target_sqnr)
    j = assess(
        evaluator.metric_name,
        evaluator.fp32_value,
        built.static.value,
        built.selective.value,
        built.selective.output_sqnr_db,
        options.min_recovery,
        options.target_sqnr,
        options.target_drop,
        noise=noise,
        speed=speedup_gate(columns, options.accept_no_speedup),
    )
    recovered, met, verdict = j.recovered, j.met, j.verdict + speed_clause(columns)
    sample_notes: list[str] = []
    per_sample = _per_sample(ctx, built, options, proposal, sample_notes)
    return VerifyResult(
        schema_version=SCHEMA_VERSION,
        kind="verify",
        model_path=str(loaded.path.resolve()),
        model_sha256=loaded.sha256,
        proposal=source,
        metric=evaluator.metric_name,
        samples=evaluator.samples,
        quantizable_nodes=len(built.quantizable),
        variants=columns,
        recovered_fraction=recovered,
        min_recovery=options.min_recovery,
        target_sqnr_db=math.nan if options.target_sqnr is None else float(options.target_sqnr),
        met=met,
        verdict=verdict,
        seconds=time.perf_counter() - start,
        notes=tuple(
            ctx.data_notes
            + calibration_notes(proposal, ctx.base_of(proposal).ranges)
            + base_setting_notes(proposal, options.per_channel)
            + settings_notes(proposal, ctx.prep.settings)
            + noise_notes
            + sample_notes
            + _quantizer_notes()
        ),
        target_drop=math.nan if options.target_drop is None else float(options.target_drop),
        **noise_fields(noise, j),
        per_sample=per_sample,
        gates=j.gates,
    )


def _quantizer_notes() -> list[str]:
    """The note that ORT's own quantizer ran where qdebug's faster one could not (:mod:`qdebug.quant.fast_quantize`)."""
    from qdebug.quant import fast_quantize

    return list(fast_quantize.notes())


def _cancelled(proposal: Proposal, source: str) -> VerifyResult:
    return VerifyResult(
        SCHEMA_VERSION,
        "verify",
        proposal.model_path,
        proposal.model_sha256,
        source,
        "",
        0,
        0,
        (),
        math.nan,
        DEFAULT_MIN_RECOVERY,
        math.nan,
        False,
        "cancelled",
        0.0,
    )
