"""Verify a proposal: FP32 vs full static vs selective static, side by side, on the evaluation set.

The selective model is re-quantized from the cached calibration ranges with
the proposal's ``nodes_to_exclude``/overrides (the proposal's own model file is
not trusted), and the three variants are compared on:

* the task metric and the worst output SQNR vs FP32;
* the recovered fraction ``(sel - static) / (fp32 - static)`` -- for a metric
  with no finite FP32 value (output SQNR) the verdict uses ``--target-sqnr``;
* every drop, recovery and output SQNR with its paired-bootstrap interval
  (:mod:`qdebug.noise`, :func:`_noise`): :func:`assess` passes or fails a gate
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from qdebug.analysis import quantized_node_names
from qdebug.analysis.notes import float_size_note
from qdebug.calibrate import op_types_to_quantize
from qdebug.capture import SessionConfig
from qdebug.data import DataSet, data_notes, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluate import EvalResult, Evaluator, HookValues, metric_scope_note
from qdebug.files import (
    artifacts_dir,
    atomic_write_text,
    check_outputs_spare_inputs,
    check_writable,
    removed_on_failure,
)
from qdebug.formatting import ACCURACY_METRICS, fmt_db
from qdebug.graph.load import LoadedModel, WeightBytes, load_model, save_model, stored_size, weight_bytes
from qdebug.graph.match import pair_models
from qdebug.noise import DEFAULT_CONFIDENCE, Interval, PairedNoise, paired_noise, samples_to_decide, single_interval
from qdebug.prepare import (
    QUANT_FLAT,
    AnalyzeOptions,
    QuantRequest,
    RuntimeSettings,
    base_setting_notes,
    calibration_notes,
    check_proposal,
    flat_settings,
    prepare,
    settings_notes,
)
from qdebug.progress import Progress, no_progress
from qdebug.quantize import QuantSpec, quantize_static_model
from qdebug.records import SCHEMA_VERSION, Proposal
from qdebug.records.verify import Timing, VariantResult, VerifyResult, fmt_binary_size
from qdebug.report_io import dumps, load_proposal
from qdebug.timing import CHUNK_RUNS, time_sessions  # re-exported: verify times its table there

__all__ = [
    "CHUNK_RUNS",
    "DEFAULT_MIN_RECOVERY",
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


# ----------------------------------------------------------------------------- timing


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
    """Confidence of the paired-bootstrap intervals the gates are judged by (:mod:`qdebug.noise`): a gate
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
        self.prep = prepare(model, calib, workdir, aopts, progress=progress, check=check)
        self.config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
        eval_set = _eval_set(calib, eval_data, self.prep.calib, options)
        self.data_notes = data_notes(
            self.prep.calib, eval_set if eval_set is not self.prep.calib else None, self.prep.normalized
        )
        self.evaluator = Evaluator(self.prep.normalized, eval_set, self.config, options.metric)
        self.data_notes += [n for n in [metric_scope_note(self.evaluator)] if n]
        self.feeds = dict(self.evaluator.batches[0].feeds)
        self.static_cache: dict[str, tuple[onnx.ModelProto, EvalResult, set[str]]] = {}
        self._ops = set(self.prep.settings.op_types or op_types_to_quantize())

    def static(self, spec: QuantSpec) -> tuple[onnx.ModelProto, EvalResult, set[str]]:
        """(model, EvalResult, quantizable node names) of the full static variant (cached per spec)."""
        key = repr(spec)
        if key not in self.static_cache:
            model = quantize_static_model(self.prep.normalized, self.prep.ranges, spec)
            result = self.evaluator.score(model, what="static quantized model")
            qnodes = quantized_node_names(model, pair_models(self.prep.normalized, model))
            ops = {n.name: n.op_type for n in self.prep.normalized.graph.node}
            quantizable = {n for n in qnodes if ops.get(n) in self._ops}
            self.static_cache[key] = (model, result, quantizable)
        return self.static_cache[key]


def _eval_set(
    calib: str | Path, eval_data: str | Path | None, calibration: DataSet, options: VerifyOptions
) -> DataSet:
    """The data the variants are scored on: ``eval_data``, else the calibration data (re-opened when
    ``--eval-max-samples`` caps it, so the cap does not shrink the calibration)."""
    source = eval_data if eval_data is not None else calib if options.eval_max_samples is not None else None
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


@dataclass(frozen=True, eq=False)
class _Variants:
    """The two quantized variants, built and scored (FP32 is the context's normalized model)."""

    static_model: onnx.ModelProto
    static: EvalResult
    quantizable: set[str]
    """Nodes whose exclusion changes the static model: what the excluded share is counted against."""
    selective_model: onnx.ModelProto
    selective: EvalResult


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
        with guard:
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
            built = _quantized_variants(ctx, proposal, progress, cancelled)
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
            columns = _with_weights(_columns(ctx.evaluator.fp32_value, built, proposal, sizes, paths, timings), weights)
            result = _verify_result(ctx, loaded, proposal, source, options, built, columns, start)
            notes = result.notes + tuple(timing_notes) + _float_size_notes(weights)
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
    ctx: _Context, proposal: Proposal, progress: Progress, cancelled: Callable[[], bool]
) -> _Variants | None:
    """Build and score full static (cached in ``ctx``) and selective static, both from the settings the
    context calibrated with (the proposal's, the user's config included, with the flags); None once
    cancelled."""
    settings = ctx.prep.settings
    base = QuantSpec.of(settings, per_channel=settings.per_channel or bool(proposal.base_per_channel))
    progress("static", 0, 3)
    static_model, static_res, quantizable = ctx.static(base)
    if cancelled():
        return None
    progress("selective", 1, 3)
    sel_spec = QuantSpec.of(
        settings,
        per_channel=settings.per_channel or proposal.per_channel,
        nodes_to_exclude=tuple(proposal.nodes_to_exclude),
        tensor_overrides=tuple(proposal.tensor_overrides),
    )
    sel_model = quantize_static_model(ctx.prep.normalized, ctx.prep.ranges, sel_spec)
    sel_res = ctx.evaluator.score(sel_model, what="selective quantized model")
    if cancelled():
        return None
    return _Variants(static_model, static_res, quantizable, sel_model, sel_res)


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


def _with_weights(columns: tuple[VariantResult, ...], weights: Mapping[str, WeightBytes]) -> tuple[VariantResult, ...]:
    """The columns with their weight bytes and float weight bytes (what the size column is made of)."""
    return tuple(
        dataclasses.replace(v, weight_bytes=weights[v.name].total, float_weight_bytes=weights[v.name].floating)
        for v in columns
    )


def _float_size_notes(weights: Mapping[str, WeightBytes]) -> tuple[str, ...]:
    """One note per quantized variant whose size is mostly float weights (:func:`float_size_note`)."""
    notes = ((name, float_size_note(w, fmt_binary_size)) for name, w in weights.items() if name != "fp32")
    return tuple(f"{name}: {note}" for name, note in notes if note)


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


def _columns(
    fp32_value: float,
    built: _Variants,
    proposal: Proposal,
    sizes: Mapping[str, int],
    paths: Mapping[str, str | None],
    timings: Mapping[str, Timing],
) -> tuple[VariantResult, ...]:
    """The fp32, static and selective columns of the table."""
    n_q = len(built.quantizable)
    excluded = [n for n in proposal.nodes_to_exclude if n in built.quantizable]
    return (
        VariantResult(
            "fp32",
            fp32_value,
            math.inf,
            n_q,
            1.0,
            0,
            0,
            sizes["fp32"],
            paths["fp32"],
            timings.get("fp32"),
        ),
        VariantResult(
            "static",
            built.static.value,
            built.static.output_sqnr_db,
            0,
            0.0,
            0,
            _qdq_pairs(built.static_model),
            sizes["static"],
            paths["static"],
            timings.get("static"),
        ),
        VariantResult(
            "selective",
            built.selective.value,
            built.selective.output_sqnr_db,
            len(excluded),
            len(excluded) / n_q if n_q else math.nan,
            len(proposal.tensor_overrides),
            _qdq_pairs(built.selective_model),
            sizes["selective"],
            paths["selective"],
            timings.get("selective"),
        ),
    )


def _speed_clause(columns: Sequence[VariantResult]) -> str:
    """``; selective p50 0.296 ms (FP32 0.306, static 0.294)`` for the verdict line (nothing untimed): a
    selective model that recovers accuracy but gives the speed-up back must say so where CI reads."""
    timed = {c.name: c.timing for c in columns if c.timing is not None and c.timing.p50_ms > 0}
    sel = timed.get("selective")
    if sel is None:
        return ""
    others = [f"{label} {timed[n].p50_ms:.3g}" for n, label in (("fp32", "FP32"), ("static", "static")) if n in timed]
    return f"; selective p50 {sel.p50_ms:.3g} ms ({', '.join(others)})"


def _qdq_pairs(model: onnx.ModelProto) -> int:
    """QuantizeLinear nodes: one per quantized tensor (the table's Q/DQ pairs)."""
    return sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear")


def _verify_result(
    ctx: _Context,
    loaded: LoadedModel,
    proposal: Proposal,
    source: str,
    options: VerifyOptions,
    built: _Variants,
    columns: tuple[VariantResult, ...],
    start: float,
) -> VerifyResult:
    """Judge the selective model (by the intervals of :func:`_noise`) and assemble the ``verify.json`` record."""
    evaluator = ctx.evaluator
    noise, noise_notes = _noise(evaluator, built, options)
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
    )
    recovered, met, verdict = j.recovered, j.met, j.verdict + _speed_clause(columns)
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
            + calibration_notes(proposal, ctx.prep.ranges)
            + base_setting_notes(proposal, options.per_channel)
            + settings_notes(proposal, ctx.prep.settings)
            + noise_notes
        ),
        target_drop=math.nan if options.target_drop is None else float(options.target_drop),
        **_noise_fields(noise, j),
    )


def _noise(evaluator: Evaluator, built: _Variants, options: VerifyOptions) -> tuple[PairedNoise | None, list[str]]:
    """The paired bootstrap of FP32, static and selective (and of the selective model's output SQNR when
    ``--target-sqnr`` asks for it), or None with ``--confidence 0``; notes say what it could not cover."""
    confidence = options.confidence
    if confidence <= 0:
        return None, []
    metric, notes = evaluator.metric_name, []
    values = tuple(evaluator.sample_values(r) for r in (None, built.static, built.selective))
    noise = None
    if math.isfinite(evaluator.fp32_value):
        if any(v is None or v.units < 2 for v in values):
            notes.append(
                f"no uncertainty estimate for {metric}: a custom metric on one evaluation batch and without a "
                "per_sample form (see README), or a single sample; its gate is judged on the point estimates"
            )
        else:
            fp32_v, static_v, sel_v = values
            hits = (fp32_v.hits > 0.5, sel_v.hits > 0.5) if metric == "top1" else None  # type: ignore[union-attr]
            noise = paired_noise(
                (fp32_v, static_v, sel_v),  # type: ignore[arg-type]
                (evaluator.fp32_value, built.static.value, built.selective.value),
                confidence=confidence,
                scale=100.0 if metric in ACCURACY_METRICS else 1.0,
                samples=evaluator.samples,
                hits=hits,
            )
            if isinstance(sel_v, HookValues):
                notes.append(
                    f"the intervals of {metric} resample its {sel_v.units} evaluation batches (the metric has no "
                    "per_sample form): they are rough with few batches"
                )
    if options.target_sqnr is not None:
        sqnr = evaluator.sqnr_values(built.selective)
        if sqnr is not None and sqnr.units >= 2:
            iv = single_interval(sqnr, built.selective.output_sqnr_db, confidence)
            base = noise or PairedNoise(confidence, sqnr.resamples, sqnr.units, evaluator.samples)
            noise = dataclasses.replace(base, sqnr=iv, sqnr_units=sqnr.units)
    return noise, notes


def _noise_fields(noise: PairedNoise | None, j: Judgement) -> dict[str, object]:
    """The ``verify.json`` fields of the intervals (their defaults without them)."""
    if noise is None:
        return {}
    nan2 = (math.nan, math.nan)
    test = noise.mcnemar
    return {
        "confidence": noise.confidence,
        "decided": j.decided,
        "drop_interval": noise.drop.pair() if noise.drop else nan2,
        "static_drop_interval": noise.static_drop.pair() if noise.static_drop else nan2,
        "recovery_interval": noise.recovery.pair() if noise.recovery else nan2,
        "sqnr_interval": noise.sqnr.pair() if noise.sqnr else nan2,
        "p_value": test.p_value if test else math.nan,
        "discordant": (test.first_only, test.second_only) if test else None,
        "samples_to_decide": j.samples_to_decide,
        "resamples": noise.resamples,
        "noise_units": noise.units if noise.drop else noise.sqnr_units,
    }


@dataclass(frozen=True)
class Judgement:
    """What :func:`assess` concludes."""

    recovered: float
    met: bool
    """Every gate passed -- beyond the noise when intervals were given."""
    decided: bool
    """False when no gate failed beyond the noise but one could not be told from it (``UNDECIDED``)."""
    verdict: str
    samples_to_decide: int | None = None
    """Samples that would decide every undecided gate, if the estimates and their spread held."""


@dataclass(frozen=True)
class _Gate:
    text: str
    side: int
    """1: passes, -1: fails (beyond the noise when an interval is given), 0: the interval straddles it."""
    needed: int | None = None
    """For a straddling gate: samples that would decide it (None: not estimable)."""


def judge(
    metric: str,
    fp32: float,
    static: float,
    selective: float,
    selective_sqnr: float,
    min_recovery: float,
    target_sqnr: float | None,
    target_drop: float | None = None,
    *,
    noise: PairedNoise | None = None,
) -> tuple[float, bool, str]:
    """(recovered fraction, met, one-line verdict) of :func:`assess`."""
    j = assess(metric, fp32, static, selective, selective_sqnr, min_recovery, target_sqnr, target_drop, noise=noise)
    return j.recovered, j.met, j.verdict


def assess(
    metric: str,
    fp32: float,
    static: float,
    selective: float,
    selective_sqnr: float,
    min_recovery: float,
    target_sqnr: float | None,
    target_drop: float | None = None,
    *,
    noise: PairedNoise | None = None,
) -> Judgement:
    """Judge the selective model's gates, by their intervals when ``noise`` gives them.

    ``target_drop`` judges the selective model against FP32 as ``propose --target-drop`` does (points for
    accuracy metrics), so a CI gate can hold the proposal to the target it was searched for: by recovery,
    a proposal propose had reported as missing its target could pass. Without ``noise`` every gate is
    judged on its point estimate. With it, a gate passes when its estimate and whole interval pass, fails
    when they all fail, and is undecided otherwise; the result fails when a gate fails, is undecided when
    one is, and passes when every gate passes.
    """
    recovered = math.nan
    if math.isfinite(fp32) and math.isfinite(static) and fp32 - static > 1e-12:
        recovered = (selective - static) / (fp32 - static)
    gates = []
    if target_drop is not None and not math.isfinite(fp32):
        gates.append(_Gate(f"no FP32 value of {metric} to measure a drop from", -1))
    elif target_drop is not None:
        gates.append(_drop_gate(metric, fp32, selective, target_drop, noise))
    elif math.isfinite(fp32):
        gates.append(_recovery_gate(metric, fp32, static, selective, min_recovery, noise))
    if target_sqnr is not None:
        gates.append(_sqnr_gate(selective_sqnr, target_sqnr, noise))
    parts = "; ".join(g.text for g in gates)
    if any(g.side < 0 for g in gates):
        return Judgement(recovered, False, True, "FAIL: " + parts)
    open_gates = [g for g in gates if g.side == 0]
    if not open_gates:
        return Judgement(recovered, True, True, "PASS: " + parts)
    assert noise is not None
    needed = None if any(g.needed is None for g in open_gates) else max(g.needed or 0 for g in open_gates)
    tail = (
        f"; about {needed:,} samples would decide it ({noise.samples:,} now)"
        if needed is not None
        else "; no sample count is estimable (an estimate on its target, or an unbounded interval)"
    )
    head = f"UNDECIDED: the evaluation set is too small to tell at {_percent(noise.confidence)} confidence: "
    return Judgement(recovered, False, False, head + parts + tail, needed)


def _side(iv: Interval | None, estimate: float, passes: Callable[[float], bool]) -> int:
    """1 when the estimate and both bounds pass, -1 when all fail, 0 when they disagree; the estimate
    alone without an interval (or with an undefined one)."""
    if iv is None or math.isnan(iv.low) or math.isnan(iv.high):
        return 1 if passes(estimate) else -1
    verdicts = {passes(x) for x in (iv.low, estimate, iv.high)}
    return 0 if len(verdicts) == 2 else (1 if verdicts == {True} else -1)


def _shown(iv: Interval | None, fmt: Callable[[float], str], unit: str = "") -> str:
    """`` [95% interval 0.20 to 1.40 points]``, appended to a gate's text (nothing without an interval)."""
    if iv is None or math.isnan(iv.low):
        return ""
    return f" [{_percent(iv.confidence)} interval {fmt(iv.low)} to {fmt(iv.high)}{unit}]"


def _needed(iv: Interval | None, threshold: float, units: int, per_unit: float) -> int | None:
    """Samples that would decide a straddling gate (:func:`qdebug.noise.samples_to_decide`)."""
    n = None if iv is None else samples_to_decide(iv, threshold, units)
    return None if n is None else math.ceil(n * per_unit)


def _points(x: float) -> str:
    return f"{x:.2f}"


def _share(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _drop_gate(metric: str, fp32: float, selective: float, target_drop: float, noise: PairedNoise | None) -> _Gate:
    scale = 100.0 if metric in ACCURACY_METRICS else 1.0
    drop = (fp32 - selective) * scale
    ok = drop <= target_drop + 1e-9
    unit = " points" if scale == 100.0 else ""
    where = f"{drop:.2f}{unit} below" if drop >= 0 else f"{-drop:.2f}{unit} above"
    iv = noise.drop if noise else None
    side = _side(iv, drop, lambda x: x <= target_drop + 1e-9)
    text = (
        f"the selective model is {where} FP32 on {metric} ({'<=' if ok else '>'} {target_drop:g}{unit} "
        f"drop allowed){_shown(iv, _points, unit)}"
    )
    needed = _needed(iv, target_drop, noise.units, noise.per_unit) if noise and side == 0 else None
    return _Gate(text, side, needed)


def _recovery_gate(
    metric: str, fp32: float, static: float, selective: float, min_recovery: float, noise: PairedNoise | None
) -> _Gate:
    gap = fp32 - static
    if gap > 1e-12:
        recovered = (selective - static) / gap
        ok = recovered >= min_recovery - 1e-12
        whole = abs(100 * min_recovery - round(100 * min_recovery)) < 1e-9  # 90 %, not 93.06 %
        iv = noise.recovery if noise else None
        side = _side(iv, recovered, lambda x: x >= min_recovery - 1e-12)
        text = (
            f"recovered {100 * recovered:.{1 if whole else 2}f}% of the {metric} lost by static "
            f"quantization ({'>=' if ok else '<'} {_percent(min_recovery)} required){_shown(iv, _share)}"
        )
        needed = _needed(iv, min_recovery, noise.units, noise.per_unit) if noise and side == 0 else None
        return _Gate(text, side, needed)
    # static at or above FP32 (often by noise): the selective model passes when it keeps either level
    margin = selective - min(static, fp32)
    ok = margin >= -1e-12
    level = "not worse than static" if selective >= static - 1e-12 else "at least FP32's value"
    iv = noise.margin if noise else None
    side = _side(iv, margin * (100.0 if metric in ACCURACY_METRICS else 1.0), lambda x: x >= -1e-9)
    unit = " points" if metric in ACCURACY_METRICS else ""
    shown = _shown(iv, _points, f"{unit} of selective minus the lower of FP32 and static")
    text = (
        f"static quantization lost nothing on {metric}; the selective model is "
        f"{level if ok else 'worse than both FP32 and static'}{shown}"
    )
    needed = _needed(iv, 0.0, noise.units, noise.per_unit) if noise and side == 0 else None
    return _Gate(text, side, needed)


def _sqnr_gate(selective_sqnr: float, target_sqnr: float, noise: PairedNoise | None) -> _Gate:
    ok = not math.isnan(selective_sqnr) and selective_sqnr >= target_sqnr - 1e-12
    iv = noise.sqnr if noise else None
    side = -1 if math.isnan(selective_sqnr) else _side(iv, selective_sqnr, lambda x: x >= target_sqnr - 1e-12)
    text = (
        f"output SQNR {fmt_db(selective_sqnr)} dB {'>=' if ok else '<'} {target_sqnr:.1f} dB target"
        f"{_shown(iv, fmt_db, ' dB')}"
    )
    per_unit = noise.samples / noise.sqnr_units if noise and noise.sqnr_units else 1.0
    needed = _needed(iv, target_sqnr, noise.sqnr_units, per_unit) if noise and side == 0 else None
    return _Gate(text, side, needed)


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


def _percent(fraction: float) -> str:
    """A threshold as given: 90%, 93.06% (a rounded one had printed "recovered 93.1% (< 93% required)"),
    never -0%."""
    return f"{100 * fraction + 0.0:.4g}%"
