"""The ``qdebug bench`` command: build, score and time every variant, then write ``bench.json``.

:func:`run_bench` runs the stages in order, each a function of its own:

1. check the request (variants, counts, providers, output paths) and load the proposal;
2. prepare the normalized FP32 model and its calibration (:func:`qdebug.prepare.prepare`), and
   calibrate once more per extra method;
3. open the evaluation set and score FP32 on it (:class:`~qdebug.evaluation.evaluate.Evaluator`);
4. build the variants (:mod:`qdebug.bench.variants`) and score each, in this process, not timed;
5. time each in a process of its own (:mod:`qdebug.bench.children`);
6. assemble the :class:`~qdebug.records.bench.BenchReport`, write it and the chart.

A run that fails as a whole, or is interrupted, leaves no ``<output stem>_files/`` behind and the
outputs of an earlier run as they were (:func:`qdebug.output.files.removed_on_failure`).
"""

from __future__ import annotations

import datetime as _dt
import math
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import onnx

from qdebug import __version__
from qdebug.analysis.model_notes import float_size_note
from qdebug.bench.chart import chart_svg
from qdebug.bench.children import (
    child_spec,
    declared_shape_notes,
    latency_stats,
    run_children_interleaved,
    tail_stats,
    write_batches,
)
from qdebug.bench.dynamic import dynamic_layer_report
from qdebug.bench.machine import machine_info
from qdebug.bench.options import BenchOptions
from qdebug.bench.variants import Built, build_variants, replace_error, settings_of
from qdebug.data import data_notes, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.evaluate import Evaluator, metric_scope_note
from qdebug.graph.load import WeightBytes, stored_size, weight_bytes
from qdebug.output.files import (
    artifacts_dir,
    atomic_write_text,
    check_outputs_spare_inputs,
    check_writable,
    record_path,
    removed_on_failure,
    sha256_file,
)
from qdebug.output.report_io import dumps, load_proposal
from qdebug.prepare import (
    AnalyzeOptions,
    Prepared,
    base_setting_notes,
    calibration_notes,
    check_proposal,
    prepare,
)
from qdebug.progress import Progress, no_progress
from qdebug.quant.calibrate import Ranges, calibrate
from qdebug.quant.config import calibration_options
from qdebug.records import Proposal, Report, TaskMetric, rank_nodes
from qdebug.records.bench import BENCH_SCHEMA_VERSION, KINDS, BenchReport, VariantResult, WorstLayer
from qdebug.runtime.capture import SessionConfig, check_providers
from qdebug.runtime.parallel import check_request, open_pool


def run_bench(
    model: str | Path,
    calib: str | Path,
    *,
    eval_data: str | Path | None = None,
    proposal: str | Path | None = None,
    output: str | Path = "qdebug-bench.json",
    chart: str | Path | None = None,
    options: BenchOptions | None = None,
    progress: Progress = no_progress,
) -> BenchReport:
    """Build, evaluate and time every variant; write ``output`` (JSON) and ``chart`` (SVG); return the report.

    The variants' models go to ``<output stem>_files/``. A variant that fails to
    build or run is kept in the report with its ``error``; the others go on.
    A run that fails as a whole (or is interrupted) leaves no ``_files/`` behind.
    """
    inputs = [model, calib, eval_data, proposal]
    with removed_on_failure(artifacts_dir(Path(output)), [output, chart], inputs):
        return _run_bench(model, calib, eval_data, proposal, output, chart, options, progress)


def _run_bench(
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    proposal: str | Path | None,
    output: str | Path,
    chart: str | Path | None,
    options: BenchOptions | None,
    progress: Progress,
) -> BenchReport:
    """The body of :func:`run_bench`: the stages in order, every check before the first data pass."""
    out = Path(output)
    options = _checked_request(options, proposal, model, calib, eval_data, out, chart)
    prop, model_sha = _proposal_for(options, model, proposal)
    notes: list[str] = []
    options = settings_of(options, prop, notes)
    if prop is not None and options.max_samples is None and prop.calib_max_samples is not None:
        options = replace(options, max_samples=prop.calib_max_samples)  # the proposal's calibration
    workdir = artifacts_dir(out)
    needs_ranges = any(k in ("static", "selective", "qoperator") for k in options.variants or ())
    check = _proposal_check(prop, model_sha, model)
    prep = prepare(
        model,
        calib,
        workdir,
        _prepare_options(options),
        need_ranges=needs_ranges,
        progress=progress,
        check=check,
        eval_data=eval_data if eval_data is not None else calib,  # without --eval: all of it (_evaluation)
    )
    notes.extend(prep.notes)
    notes.extend(_proposal_notes(prop, prep, options))
    ranges = _calibrations(prep, options)

    config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
    evaluator = _evaluation(prep, calib, eval_data, options, config, notes)
    built = build_variants(prep, ranges, options, prop, workdir, progress)
    source = "eval" if eval_data is not None else "calib"
    scores, layer_reports = _scores(built, evaluator, options, prep, workdir, config, source, progress, notes)
    measured = _measured(built, evaluator, options, progress)
    notes.extend(declared_shape_notes(measured))
    notes.extend(n for n in _quantizer_notes() if n not in notes)

    variants = [_variant_result(b, scores.get(b.name), measured.get(b.name)) for b in built]
    variants = [_with_layers(v, layer_reports.get(v.name), workdir) for v in variants]
    report = _bench_report(prep, calib, eval_data, proposal, options, evaluator, variants, notes)
    atomic_write_text(out, dumps(report))
    if chart is not None:
        atomic_write_text(chart, chart_svg(report))
    return report


def _checked_request(
    options: BenchOptions | None,
    proposal: str | Path | None,
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    out: Path,
    chart: str | Path | None,
) -> BenchOptions:
    """``options`` with the default variants filled in, once the flags and the output paths are checked.

    All of this is refused before the model is even loaded: a typo must not cost a calibration.
    """
    unknown_ops = [op for op in (options.dynamic_ops if options else ()) if not onnx.defs.has(op)]
    if unknown_ops:
        raise QDebugError(
            f"--dynamic-ops names op type(s) that ONNX does not define: {unknown_ops}",
            "use ONNX op type names such as MatMul,Gemm,Conv",
            ExitCode.USAGE,
        )
    options = options or BenchOptions()
    if options.variants is None:
        default = ("fp32", "dynamic", "static") + (("selective",) if proposal is not None else ())
        options = replace(options, variants=default)
    if not options.variants:
        raise QDebugError(
            "no variants to benchmark", f"pass --variants with some of {', '.join(KINDS)}", ExitCode.USAGE
        )
    if options.runs < 1 or options.warmup < 0:
        raise QDebugError(
            f"--runs must be >= 1 and --warmup >= 0 (got {options.runs}, {options.warmup})",
            "pass sensible counts",
            ExitCode.USAGE,
        )
    check_providers(options.providers)
    check_request(options.runtime)
    check_writable(out)
    if chart is not None:
        check_writable(chart, "--chart")
    check_outputs_spare_inputs(
        {"the bench result": out, "the chart": chart},
        {
            "the model": model,
            "the calibration data": calib,
            "the evaluation data": eval_data,
            "the proposal": proposal,
        },
    )
    return options


def _proposal_for(
    options: BenchOptions, model: str | Path, proposal: str | Path | None
) -> tuple[Proposal | None, str]:
    """The proposal the selective variant is built from, and the model's SHA-256 (None, "" without one).

    Only the selective variant reads the proposal; one made for another model is refused here, before
    anything is built.
    """
    if "selective" not in (options.variants or ()):
        return None, ""
    if proposal is None:
        raise QDebugError(
            "the selective variant needs a proposal",
            "pass --proposal proposal.json (from qdebug propose)",
            ExitCode.USAGE,
        )
    prop = load_proposal(proposal)
    model_sha = sha256_file(Path(model)) if Path(model).is_file() else ""
    if prop.model_sha256 and model_sha and prop.model_sha256 != model_sha:
        raise QDebugError(
            f"proposal {proposal} was made for another model (SHA-256 {prop.model_sha256[:12]}...)",
            f"pass the model the proposal was made for ({prop.model_path})",
            ExitCode.INPUT,
        )
    return prop, model_sha


def _prepare_options(options: BenchOptions) -> AnalyzeOptions:
    """The preparation's settings: the first calibration method, and the shared types and runtime."""
    return AnalyzeOptions(
        quant=options.quant.with_given({"method": options.methods[0]}),
        runtime=options.runtime,
        batch_size=options.batch_size,
        max_samples=options.max_samples,
        batch_axes=options.batch_axes,
        metric=options.metric,
    )


def _proposal_check(
    prop: Proposal | None, model_sha: str, model: str | Path
) -> Callable[[onnx.ModelProto], None] | None:
    """What :func:`prepare` runs on the normalized model before calibration: a wrong proposal costs no
    data pass."""
    if prop is None:
        return None

    def check(normalized: onnx.ModelProto) -> None:
        check_proposal(prop, model_sha or prop.model_sha256, model, normalized)

    return check


def _quantizer_notes() -> tuple[str, ...]:
    """The note that ORT's own quantizer ran where qdebug's faster one could not (:mod:`qdebug.quant.fast_quantize`)."""
    from qdebug.quant import fast_quantize

    return fast_quantize.notes()


def _proposal_notes(prop: Proposal | None, prep: Prepared, options: BenchOptions) -> list[str]:
    """Where the benchmark's calibration or base settings differ from the proposal's."""
    if prop is None:
        return []
    notes: list[str] = []
    transformed = prop.recipe is not None and bool(prop.recipe.fp32_model)
    if prep.ranges is not None and options.methods[0] == (prop.method or "minmax") and not transformed:
        notes.extend(calibration_notes(prop, prep.ranges))  # (a recipe's model has ranges of its own)
    if prop.recipe is not None and transformed:
        steps = "+".join(prop.recipe.steps) or prop.recipe.name
        notes.append(
            f"selective is quantized from the proposal's recipe model ({steps}: {prop.recipe.fp32_model}), the "
            "other variants from your model"
        )
    elif prop.recipe is not None:  # dynamic, mixed: your model, quantized another way
        how = {"dynamic": "with quantize_dynamic", "mixed": "static for the Convs, quantize_dynamic for the MatMuls"}
        seven = ", 7-bit weights" if prop.recipe.reduce_range else ""
        notes.append(
            f"selective is your model quantized as the proposal's recipe {prop.recipe.name} says "
            f"({how.get(prop.recipe.quantizer, prop.recipe.quantizer)}{seven})"
        )
    notes.extend(base_setting_notes(prop, options.per_channel))
    return notes


def _calibrations(prep: Prepared, options: BenchOptions) -> dict[str, Ranges]:
    """The ranges of every calibration method (the first one from :func:`prepare`); none when no
    variant is static."""
    if prep.ranges is None:
        return {}
    ranges = {options.methods[0]: prep.ranges}
    normalized_sha = sha256_file(prep.normalized_path)
    for method in options.methods[1:]:
        ranges[method] = calibrate(
            prep.normalized_path,
            normalized_sha,
            prep.calib,
            method,
            use_cache=options.use_cache,
            providers=options.providers,
            op_types=prep.settings.op_types or None,
            calib_options=calibration_options(prep.settings),
        )
    return ranges


def _evaluation(
    prep: Prepared,
    calib: str | Path,
    eval_data: str | Path | None,
    options: BenchOptions,
    config: SessionConfig,
    notes: list[str],
) -> Evaluator:
    """The evaluation set (the calibration data without ``--eval``), scored once for FP32.

    Its batches are also what every variant is timed on; what limits the comparison goes to ``notes``.
    """
    if eval_data is not None:
        eval_set = open_data(eval_data, prep.calib.specs, batch_size=options.batch_size, what="evaluation data")
    else:
        eval_set = open_data(calib, prep.calib.specs, batch_size=options.batch_size)
        notes.append("no --eval data: the metric and the timings use the calibration data")
    notes.extend(data_notes(prep.calib, eval_set if eval_data is not None else None, prep.normalized))
    evaluator = Evaluator(prep.normalized, eval_set, config, options.metric)
    notes.extend(n for n in [metric_scope_note(evaluator)] if n)
    full_size = max(b.size for b in evaluator.batches)
    if options.batch_size is not None and full_size < options.batch_size:
        notes.append(f"the evaluation set has fewer samples than --batch-size: batches of {full_size}")
    return evaluator


def _scores(
    built: list[Built],
    evaluator: Evaluator,
    options: BenchOptions,
    prep: Prepared,
    workdir: Path,
    config: SessionConfig,
    source: str,
    progress: Progress,
    notes: list[str],
) -> tuple[dict[str, tuple[float, float]], dict[str, Report]]:
    """(task metric, output SQNR) of every built variant, and the dynamic variant's per-layer report.

    A variant that cannot be scored gets its error in ``built`` (it is then not timed either);
    ``source`` names the evaluation data (``eval`` or ``calib``) in the per-layer report.
    """
    scores: dict[str, tuple[float, float]] = {}
    layer_reports: dict[str, Report] = {}
    # every variant's accuracy side by side (--workers); the pool is closed before anything is timed
    todo = [i for i, b in enumerate(built) if not b.error and b.path is not None and b.kind != "fp32"]
    outcomes: dict[int, Any] = {}
    with open_pool(options.runtime, [evaluator], notes) as pool:

        def submit(i: int) -> Any:
            return pool.submit(evaluator, onnx.load(str(built[i].path)), f"{built[i].name} model")

        tickets = {} if pool.inline else {i: submit(i) for i in todo}
        for n, i in enumerate(todo):  # inline: loaded and scored one at a time, as before
            progress("evaluate", n, len(built))
            outcomes[i] = pool.outcome(tickets.pop(i, None) or submit(i))
    for i, b in enumerate(built):
        progress("evaluate", i, len(built))
        if b.error or b.path is None:
            continue
        if b.kind == "fp32":
            scores[b.name] = (evaluator.fp32_value, math.inf)
            continue
        result = outcomes[i]
        if isinstance(result, QDebugError):
            built[i] = replace_error(b, result.one_line())
            continue
        scores[b.name] = (result.value, result.output_sqnr_db)
        if b.kind == "dynamic" and options.dynamic_layers:
            task = TaskMetric(result.metric, result.fp32_value, result.value, result.samples, source)
            try:
                layer_reports[b.name] = dynamic_layer_report(
                    prep, b.path, workdir / f"{b.name}.report.json", config, task, result.outputs, progress
                )
            except QDebugError as e:
                notes.append(f"no per-layer report for {b.name}: {e.one_line()}")
    progress("evaluate", len(built), len(built))
    return scores, layer_reports


def _measured(
    built: list[Built], evaluator: Evaluator, options: BenchOptions, progress: Progress
) -> dict[str, dict[str, Any]]:
    """Time every variant that built and scored, each in its own process, on the same input batches."""
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-") as tmp:
        tmpdir = Path(tmp)
        inputs_path = tmpdir / "inputs.npz"
        write_batches(evaluator.batches, evaluator.input_names, inputs_path)
        todo = [b for b in built if not b.error and b.path is not None]
        specs = {
            b.name: child_spec(
                b.path.resolve(),  # type: ignore[union-attr]
                inputs_path,
                evaluator.input_names,
                len(evaluator.batches),
                options,
                tmpdir / f"{b.name}.result.json",
            )
            for b in todo
        }
        return run_children_interleaved(specs, tmpdir, options.runs, progress, options.timeout_s)


def _bench_report(
    prep: Prepared,
    calib: str | Path,
    eval_data: str | Path | None,
    proposal: str | Path | None,
    options: BenchOptions,
    evaluator: Evaluator,
    variants: list[VariantResult],
    notes: list[str],
) -> BenchReport:
    """The ``bench.json`` record: the variants with their speed-up over FP32, and the machine."""
    fp32 = next((v for v in variants if v.kind == "fp32" and v.full is not None), None)
    if fp32 is not None:
        variants = [_with_speedup(v, fp32.full.p50_ms) for v in variants]  # type: ignore[union-attr]
    machine = machine_info(options.providers, options.threads)
    return BenchReport(
        schema_version=BENCH_SCHEMA_VERSION,
        kind="bench",
        qdebug_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=prep.model.path,
        model_sha256=prep.model.sha256,
        normalized_model=str(prep.normalized_path.resolve()),
        calib=record_path(calib),
        eval=record_path(eval_data if eval_data is not None else calib),
        metric=evaluator.metric_name,
        samples=evaluator.samples,
        batch_size=max(b.size for b in evaluator.batches),
        runs=options.runs,
        warmup=options.warmup,
        machine=machine,
        variants=tuple(variants),
        proposal=record_path(proposal) if proposal is not None else None,
        notes=tuple(notes),
    )


def _with_layers(v: VariantResult, report: Report | None, workdir: Path) -> VariantResult:
    """``v`` with its per-layer report's path and worst layers (as it is without a report)."""
    if report is None:
        return v
    path = (workdir / f"{v.name}.report.json").resolve()
    return replace(v, layer_report=str(path), worst_layers=worst_layers(report))


def _with_speedup(v: VariantResult, fp32_p50: float) -> VariantResult:
    """``v`` with FP32's p50 over its own (left without one when it has no full-batch timing)."""
    if v.full is None or not v.full.p50_ms > 0:
        return v
    return replace(v, speedup=fp32_p50 / v.full.p50_ms)


def _variant_result(b: Built, score: tuple[float, float] | None, m: dict[str, Any] | None) -> VariantResult:
    """The record of one variant from how it built, its score and its process's measurements.

    Without a score or a measurement the variant is reported with its error.
    """
    saved = b.path is not None and b.path.is_file()
    size = stored_size(b.path) if saved else 0
    weights = _weights_of(b.path) if saved else None
    size_note = float_size_note(weights) if weights is not None and b.kind != "fp32" else None
    b = replace(b, notes=(*b.notes, size_note)) if size_note else b
    common = dict(
        name=b.name,
        kind=b.kind,
        method=b.method,
        quant_format=b.quant_format,
        per_channel=b.per_channel,
        model_path=str(b.path.resolve()) if b.path is not None else "",
        model_bytes=size,
        weight_bytes=weights.total if weights is not None else None,
        float_weight_bytes=weights.floating if weights is not None else None,
        excluded_nodes=b.excluded,
    )
    error = b.error or (m.get("error", "") if m is not None and not m.get("ok") else "")
    if error or m is None or score is None:
        return VariantResult(**common, notes=b.notes, error=error or "not measured")  # type: ignore[arg-type]
    tail_sizes = m["tail_sizes"]
    tail_size = tail_sizes[0] if len(tail_sizes) == 1 else 0
    notes = list(b.notes) + list(m["notes"])
    if len(tail_sizes) > 1:
        notes.append(f"smaller batches of {len(tail_sizes)} sizes {tail_sizes} timed together as the tail")
    mb = 1024.0 * 1024.0
    return VariantResult(
        **common,  # type: ignore[arg-type]
        full=latency_stats(m["full_ns"], m["full_size"]),
        tail=tail_stats(m["tail_ns"], tail_size, tail_sizes),
        tail_sizes=tuple(tail_sizes),
        peak_rss_mb=m["peak_rss"] / mb,
        rss_before_session_mb=m["rss_before_session"] / mb,
        session_rss_mb=(m["peak_rss"] - m["rss_before_session"]) / mb,
        alloc_bytes_per_batch=float(m["alloc_peak_max"]),
        alloc_bytes_mean=float(m["alloc_peak_mean"]),
        alloc_net_bytes_per_batch=float(m["alloc_net"]),
        binding=m["mode"],
        providers_used=tuple(m["providers"]),
        metric_value=score[0],
        output_sqnr_db=score[1],
        notes=tuple(notes),
    )


def _weights_of(path: Path) -> WeightBytes:
    """The weight bytes of a saved variant, read from its shapes (its external data is not loaded)."""
    return weight_bytes(onnx.load(str(path), load_external_data=False))


def worst_layers(report: Report, top: int = 5) -> tuple[WorstLayer, ...]:
    """The ``top`` quantized nodes of a report by the noise they add, as the analysis summary ranks them.

    Only nodes the variant quantized: a LayerNormalization after a quantized MatMul amplifies the error it
    receives and "adds" noise by that measure, but nothing about it can be changed in that variant (a
    walk-through saw bench name one that dynamic quantization never touches).
    """
    ranked = [n for n in rank_nodes(report.nodes) if n.quantized]
    return tuple(
        WorstLayer(n.name, n.op_type, n.introduced_db, n.accumulated_sqnr_db, n.added_noise_db)
        for n in ranked[:top]
    )
