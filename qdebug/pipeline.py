"""Compose the stages into the user-facing operations. No printing, no argparse.

``analyze`` is the foundation: load + normalize the model, open the data,
calibrate once (cached), build the QDQ model from the cached ranges (or take
the user's), pair tensors through the graph, stream the layer-wise capture,
score the task metric on un-instrumented sessions and write the report.

``_analyze`` runs those stages in order, one helper each: ``_prepared`` (the
shared prelude, with the evaluation data opened early), then ``_method_report``:
``_quantized_model``, ``_pairing``, the capture (:func:`qdebug.analysis.measure_layers`)
and its records, ``_report_notes``, ``_task_metric`` and :func:`assemble_report`, which
any command reporting on a quantized model's layers can share. Every note a
stage writes comes from :mod:`qdebug.analysis.notes` unless it is about this
command's own inputs (a user's model, its pairing).

:func:`analyze_methods` (``analyze --method a,b,c``) runs the prelude once and
``_method_report`` once per calibration method, with what the methods compute alike
shared between them (``_Shared``): the evaluator's FP32 outputs and the FP32 side of
the capture. On the 800-node chain of docs/benchmarks.md a method's time is mostly its
own capture (two thirds: opening the sessions of its merged FP32 + QDQ models), then
its calibration, quantization and scoring; what the reference's reductions add to the
merged models is what sharing saves (21.6 s -> 17.5 s for three methods).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import onnx

from qdebug.analysis import (
    LayerErrors,
    capture_notes,
    collapsed_range_notes,
    concat_range_notes,
    eval_range_notes,
    folded_activation_notes,
    instrumentation_notes,
    kernel_gap_notes,
    measure_layers,
    node_records,
    quantized_node_names,
    quantizer_notes,
    structure_notes,
    weight_records,
)
from qdebug.analysis.reference import SharedReference
from qdebug.data import DataSet, data_notes, model_input_specs, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.evaluate import EvalResult, Evaluator, metric_scope_note
from qdebug.evaluation.samples import DetailTarget, per_sample_section
from qdebug.graph.load import load_model
from qdebug.graph.match import Pairing, is_qdq_model, pair_models
from qdebug.graph.match_dynamic import pair_dynamic
from qdebug.graph.ops import INTEGER_KERNEL_OPS
from qdebug.output.files import (
    artifacts_dir,
    check_outputs_spare_inputs,
    check_writable,
    record_path,
    removed_on_failure,
)
from qdebug.output.report_io import save_report
from qdebug.prepare import (  # noqa: F401 -- AnalyzeOptions, assemble_report re-exported
    AnalyzeOptions,
    Prepared,
    assemble_report,
    calibrated,
    in_workdir,
    method_settings,
    model_info,
    prepare,
)
from qdebug.progress import Progress, no_progress
from qdebug.quant.fast_quantize import INFERRED_FILE
from qdebug.quant.quantize import QuantSpec, check_quantized_loads, float16_exclusions, quantize_static_model
from qdebug.records import (
    AnalysisConfig,
    ModelInfo,
    NodeRecord,
    Report,
    TaskMetric,
    WeightRecord,
)
from qdebug.records.report import QuantSettings, config_fields
from qdebug.records.samples import SampleSection
from qdebug.runtime.capture import SessionConfig, make_session


def analyze(
    model: str | Path,
    calib: str | Path,
    *,
    eval_data: str | Path | None = None,
    quantized: str | Path | None = None,
    output: str | Path = "qdebug-report.json",
    options: AnalyzeOptions | None = None,
    progress: Progress = no_progress,
) -> Report:
    """Analyze where quantization error enters ``model``; write and return the report.

    Args:
        model: the FP32 ONNX model (never modified).
        calib: calibration data (.npz, folder of .npz, or module:function).
        eval_data: evaluation data for the task metric (default: the calibration data).
        quantized: the user's own QDQ model; if None, qdebug builds it (default static QDQ).
        output: report path; the normalized/quantized models go to ``<stem>_files/``.
        options: see :class:`AnalyzeOptions`.
        progress: callback(stage, done, total) for progress display.

    """
    options = options or AnalyzeOptions()
    out = Path(output)
    check_writable(out)
    workdir = artifacts_dir(out)
    _check_spared(out, workdir, model, calib, eval_data, quantized)
    with removed_on_failure(workdir, [out], [model, calib, eval_data, quantized]):
        return _analyze(model, calib, eval_data, quantized, out, workdir, options, progress)


def _check_spared(
    out: Path,
    workdir: Path,
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    quantized: str | Path | None,
    which: str = "the ",
) -> None:
    """Refuse a report, normalized or quantized model path that is one of the inputs (``which`` names the
    report: "the minmax " for one of :func:`analyze_methods`)."""
    check_outputs_spare_inputs(
        {
            f"{which}report": out,
            f"{which}normalized model": workdir / "normalized.onnx",
            f"{which}quantized model": workdir / "quantized.onnx" if quantized is None else None,
            f"{which}shape-inferred model": workdir / INFERRED_FILE if quantized is None else None,
            f"{which}shape-inferred model's key": workdir / f"{INFERRED_FILE}.json" if quantized is None else None,
        },
        {
            "the model": model,
            "the calibration data": calib,
            "the evaluation data": eval_data,
            "the quantized model": quantized,
        },
    )


def analyze_methods(
    model: str | Path,
    calib: str | Path,
    outputs: Mapping[str, str | Path],
    *,
    eval_data: str | Path | None = None,
    quantized: str | Path | None = None,
    options: AnalyzeOptions | None = None,
    progress: Progress = no_progress,
    announce: Callable[[str], None] | None = None,
    shared_stages: Callable[[str], None] | None = None,
) -> tuple[Report, ...]:
    """:func:`analyze` for each calibration method of ``outputs`` (method -> its report path), in one run.

    What every method computes alike is computed once: the prelude (load, normalize, open the data and
    its checks), the FP32 outputs of the evaluation data (one :class:`~qdebug.evaluation.evaluate.Evaluator`, which
    scores each method's model), and the FP32 side of the graph engine's capture (recorded by the first
    method's capture, read back by the others': :mod:`qdebug.analysis.reference`). Each report is the one
    :func:`analyze` writes for that method alone -- the same numbers and notes -- except for its time
    stamp and paths; each method still calibrates (cached), quantizes, captures its model, scores it and
    writes its report and ``<stem>_files/``. A failure leaves the reports of the methods already done
    whole and nothing of the method that failed (:func:`qdebug.output.files.removed_on_failure`).

    ``announce`` gets a line as each method starts and as its report is written; ``shared_stages`` one
    per stage the methods share, as it runs once (progress: the CLI leaves it out with ``-q``).
    """
    options = options or AnalyzeOptions()
    say = announce or _silent
    once = shared_stages or _silent
    outs = {m: Path(o) for m, o in outputs.items()}
    inputs = (model, calib, eval_data, quantized)
    for method, out in outs.items():
        check_writable(out)
        _check_spared(out, artifacts_dir(out), model, calib, eval_data, quantized, f"the {method} ")
    shared: _Shared | None = None
    reports = []
    for i, (method, out) in enumerate(outs.items(), 1):
        opts = dataclasses.replace(options, method=method)
        workdir = artifacts_dir(out)
        say(f"method {method} ({i}/{len(outs)})")
        with removed_on_failure(workdir, [out], list(inputs)):
            if shared is None:
                prep, eval_set = _prepared(model, calib, eval_data, quantized, workdir, opts, progress, ranges=False)
                shared = _Shared(prep, eval_set, SharedReference() if len(outs) > 1 else None)
                once(f"shared by the {len(outs)} methods, run once: the model loaded and normalized, the data opened")
            prep = _for_method(shared.prep, opts, workdir, quantized, progress)
            report = _method_report(shared, prep, *inputs, out, workdir, opts, progress, once)
        reports.append(report)
        say(f"report written to {out}")
    return tuple(reports)


def _silent(line: str) -> None:
    """The default ``announce``: say nothing."""


class _Shared:
    """What the methods of one :func:`analyze_methods` run share, filled in as the first method runs.

    Mutable on purpose: the evaluator is made when the first method is scored (where :func:`analyze`
    makes it, so that errors come in the same order), and ``reference`` fills during the first capture.
    """

    def __init__(self, prep: Prepared, eval_set: DataSet | None, reference: SharedReference | None = None) -> None:
        self.prep = prep
        self.eval_set = eval_set
        self.reference = reference
        self._evaluator: Evaluator | None = None

    def evaluator(self, config: SessionConfig, metric: str | None) -> tuple[Evaluator, bool]:
        """The evaluator over the evaluation data (its FP32 outputs computed on the first call), and
        whether this call made it."""
        made = self._evaluator is None
        if self._evaluator is None:
            assert self.eval_set is not None
            self._evaluator = Evaluator(self.prep.normalized, self.eval_set, config, metric)
        return self._evaluator, made


def _for_method(
    prep: Prepared, options: AnalyzeOptions, workdir: Path, quantized: str | Path | None, progress: Progress
) -> Prepared:
    """The shared prelude made one method's: its normalized model in its ``workdir``, its settings, and
    (unless the quantized model is given) its calibration."""
    prep = in_workdir(prep, workdir)
    settings = method_settings(options, prep.normalized)
    settings = dataclasses.replace(settings, specialized_inputs=prep.settings.specialized_inputs)
    if quantized is not None:
        return dataclasses.replace(prep, settings=settings)
    float16_exclusions(prep.normalized)  # refuse an all-float16 model before calibrating
    return calibrated(prep, settings, options, progress)


def _analyze(
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    quantized: str | Path | None,
    out: Path,
    workdir: Path,
    options: AnalyzeOptions,
    progress: Progress,
) -> Report:
    """The body of :func:`analyze` (which cleans up after it on failure): the prelude, then the rest."""
    prep, eval_set = _prepared(model, calib, eval_data, quantized, workdir, options, progress)
    shared = _Shared(prep, eval_set)
    return _method_report(shared, prep, model, calib, eval_data, quantized, out, workdir, options, progress)


def _method_report(
    shared: _Shared,
    prep: Prepared,
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    quantized: str | Path | None,
    out: Path,
    workdir: Path,
    options: AnalyzeOptions,
    progress: Progress,
    once: Callable[[str], None] = _silent,
) -> Report:
    """One method's report from its prepared model (``prep``, calibrated) and what is ``shared``, one stage
    per line; written to ``out``."""
    config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
    eval_set = shared.eval_set
    notes = list(prep.notes)
    notes.extend(data_notes(prep.calib, eval_set, prep.normalized))
    qproto, qinfo, settings = _quantized_model(prep, model, quantized, options, workdir, notes)
    pairing, dyn_nodes = _pairing(prep, qproto, model, quantized, notes)
    ranges = prep.ranges.minmax() if prep.ranges is not None else {}
    reference = shared.reference
    replayed = reference.replayed if reference is not None else 0
    deployed = _Deployed(qproto, config) if eval_set is not None else None
    with _quantizer_faults_named(prep, qproto, built=quantized is None):
        layers = measure_layers(
            prep.normalized,
            qproto,
            pairing,
            prep.calib,
            config,
            ranges,
            progress,
            engine=options.engine,
            # a dynamic model quantizes at run time: no Q/DQ pairs, no fake-quant view
            fakequant_samples=0 if dyn_nodes is not None else options.fakequant_samples,
            shared=reference,
            plain=deployed,
            keep_sides=options.flip_details != 0,  # for the per-sample drill-down; deleted after it
        )
    if reference is not None:
        once(_capture_line(reference, replayed))
    notes.extend(capture_notes(layers, options.engine, eval_given=eval_data is not None))
    qnodes = set(dyn_nodes) if dyn_nodes is not None else quantized_node_names(qproto, pairing)
    nodes = node_records(prep.normalized, layers.tensors, qnodes, prep.name_map)
    weights = weight_records(prep.normalized, qproto, pairing)
    notes.extend(_report_notes(prep.normalized, qproto, layers, nodes, qnodes, weights, prep.data_constant_ifs))
    task, result, evaluator = _task_metric(
        shared, layers, nodes, qproto, config, options, dyn_nodes, notes, once, deployed
    )
    variant = "quantized" if quantized is not None else "static"  # the user's model may not be static
    per_sample = _per_sample(
        prep, eval_set, evaluator, (variant, result), qproto, pairing, config, options, notes, layers
    )
    if layers.sides is not None:  # (on an error before this, the directory goes when the object does)
        layers.sides.cleanup()
    report = assemble_report(
        prep,
        qinfo,
        layers,
        nodes,
        weights,
        result.outputs,
        task,
        _analysis_config(options, settings, calib, eval_data, quantized, layers),
        notes,
        ranges,
        calibration_cache=str(prep.ranges.cache_path) if prep.ranges and prep.ranges.cache_path else None,
    )
    report = dataclasses.replace(report, per_sample=per_sample)
    save_report(report, out)  # here, not in a stage: tests patch qdebug.pipeline.save_report
    return report


@contextlib.contextmanager
def _quantizer_faults_named(prep: Prepared, qproto: onnx.ModelProto, *, built: bool) -> Iterator[None]:
    """The capture opens the static model qdebug built first: when ORT cannot load it, say whether that is
    the quantizer's doing (:func:`check_quantized_loads`), instead of a trial load before the capture -- one
    session fewer, over the largest model analyze opens more than once (1.3 s of ORT's start-up on the
    3,200-node benchmark graph, docs/benchmarks.md)."""
    try:
        yield
    except QDebugError as e:
        if built and e.code == ExitCode.MODEL:
            check_quantized_loads(prep.normalized, qproto)  # raises the quantizer's fault when it is one
        raise


def _capture_line(reference: SharedReference, replayed_before: int) -> str:
    """What the capture just did with the FP32 side shared by the methods (a ``shared_stages`` line)."""
    if reference.replayed > replayed_before:
        return "capture: its FP32 side read back from the first method's capture, not computed again"
    if reference.complete and reference.replayed == 0:
        return "shared by the methods, run once: the FP32 side of the capture (the reference's reductions), recorded"
    return "capture: its FP32 side measured again (not the recorded one, or not on the graph engine)"


def _prepared(
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    quantized: str | Path | None,
    workdir: Path,
    options: AnalyzeOptions,
    progress: Progress,
    *,
    ranges: bool = True,
) -> tuple[Prepared, DataSet | None]:
    """The shared prelude, and the evaluation data opened inside it: before calibration (headers and first
    item checked), so that bad evaluation data is found before calibration, the fake-quant view and the
    whole capture have run. ``ranges=False``: without the calibration (:func:`analyze_methods` calibrates
    per method)."""
    opened: list[DataSet] = []

    def open_eval(normalized: onnx.ModelProto) -> None:
        if eval_data is not None:
            specs = model_input_specs(normalized, options.batch_axes)
            opened.append(open_data(eval_data, specs, batch_size=options.batch_size, what="evaluation data"))

    prep = prepare(
        model,
        calib,
        workdir,
        options,
        need_ranges=ranges and quantized is None,
        progress=progress,
        check=open_eval,
        eval_data=eval_data,
    )
    return prep, opened[0] if opened else None


def _quantized_model(
    prep: Prepared,
    model: str | Path,
    quantized: str | Path | None,
    options: AnalyzeOptions,
    workdir: Path,
    notes: list[str],
) -> tuple[onnx.ModelProto, ModelInfo, QuantSettings]:
    """The QDQ model to measure: built from the calibrated ranges, or the user's (checked).

    Returns it, its file's identity, and the settings the report records: the prelude's, or those read
    from a user's static QDQ model (per-channel, types, symmetric ranges...). Notes on how it was made go
    to ``notes``.
    """
    if quantized is None:
        return (*_built_model(prep, options, workdir, notes), prep.settings)
    return _users_model(prep, model, quantized, options, notes)


def _built_model(
    prep: Prepared, options: AnalyzeOptions, workdir: Path, notes: list[str]
) -> tuple[onnx.ModelProto, ModelInfo]:
    """ORT's static QDQ model from the calibrated ranges, saved as ``<workdir>/quantized.onnx`` (and the
    shape-inferred normalized model the quantizer made on the way, as ``fast_quantize.INFERRED_FILE``)."""
    from qdebug.quant import fast_quantize

    assert prep.ranges is not None
    settings = prep.settings
    quantized_path = workdir / "quantized.onnx"
    # no trial load: the capture opens it next, and names the quantizer's fault if ORT refuses it
    qproto = quantize_static_model(
        prep.normalized, prep.ranges, QuantSpec.of(settings), quantized_path, load_check=False
    )
    fast_quantize.save_inferred(prep.normalized, workdir / fast_quantize.INFERRED_FILE)
    notes.extend(
        quantizer_notes(
            prep.normalized,
            qproto,
            prep.ranges,
            per_channel=settings.per_channel,
            method=settings.method,
            activation_type=settings.activation_type,
        )
    )
    return qproto, model_info(quantized_path, qproto)


def _users_model(
    prep: Prepared, model: str | Path, quantized: str | Path, options: AnalyzeOptions, notes: list[str]
) -> tuple[onnx.ModelProto, ModelInfo, QuantSettings]:
    """The user's quantized model, refused unless it derives from ``model`` and is QDQ or dynamic; a static
    one also gives the settings it shows (per-channel, types, symmetric ranges...)."""
    qloaded = load_model(quantized, what="quantized model")
    qproto = qloaded.proto
    _check_same_inputs(prep.normalized, qproto, model, quantized)
    dynamic = is_dynamic_model(qproto)
    if not dynamic:
        _refuse_integer_ops(qproto, quantized)
    if not dynamic and not is_qdq_model(qproto):
        raise QDebugError(
            f"{quantized} has no QuantizeLinear/DequantizeLinear nodes",
            "pass a QDQ-format model (quantize_static with quant_format=QuantFormat.QDQ)",
            ExitCode.MODEL,
        )
    qinfo = model_info(qloaded.path, qproto, qloaded.sha256)
    settings = prep.settings
    if not dynamic:
        settings = _settings_from_model(qproto, prep, Path(quantized).name, notes)
    return qproto, qinfo, settings


def _pairing(
    prep: Prepared, qproto: onnx.ModelProto, model: str | Path, quantized: str | Path | None, notes: list[str]
) -> tuple[Pairing, set[str] | None]:
    """FP32 <-> quantized tensors paired through the graph, and the quantized nodes of a dynamic model
    (None for a QDQ model, whose quantized nodes are read from its Q/DQ pattern).

    Refuses a quantized model that does not derive from ``model``: then too few nodes pair.
    """
    dyn_nodes: set[str] | None = None
    if quantized is not None and is_dynamic_model(qproto):
        pairing, dyn_nodes = pair_dynamic(prep.normalized, qproto)  # by the integer-op chain
        notes.append(
            "dynamic quantization: activations are quantized per batch at run time, so there is no fixed "
            "Q/DQ pair per tensor: only the accumulated error (FP32 vs dynamic model) is measured, paired "
            "by graph position"
        )
    else:
        pairing = pair_models(prep.normalized, qproto)
    matched = len(pairing.node_map)
    non_qdq = sum(1 for n in qproto.graph.node if n.op_type not in ("QuantizeLinear", "DequantizeLinear"))
    if matched == 0 or (quantized is not None and matched < 0.5 * len(prep.normalized.graph.node)):
        raise QDebugError(
            f"the quantized model does not derive from {model}: only {matched} of "
            f"{len(prep.normalized.graph.node)} FP32 nodes have a counterpart ({non_qdq} non-Q/DQ nodes in it)",
            "pass the QDQ model made from this FP32 model",
            ExitCode.MODEL,
        )
    if pairing.unmatched:
        notes.append(f"{len(pairing.unmatched)} FP32 node(s) have no counterpart in the quantized model")
    return pairing, dyn_nodes


def _report_notes(
    fp32: onnx.ModelProto,
    qproto: onnx.ModelProto,
    layers: LayerErrors,
    nodes: tuple[NodeRecord, ...],
    quantized_nodes: set[str],
    weights: tuple[WeightRecord, ...] = (),
    data_constant_ifs: Sequence[str] = (),
) -> list[str]:
    """The notes read from the measurement itself, in the report's order (:mod:`qdebug.analysis.notes`)."""
    return [
        *instrumentation_notes(layers),
        *kernel_gap_notes(layers.tensors, layers.deployed_head, skip=layers.aliases, nodes=nodes),
        *concat_range_notes(fp32, layers.tensors),
        *collapsed_range_notes(layers.tensors, nodes, weights),
        *folded_activation_notes(nodes, layers.tensors),
        *structure_notes(fp32, qproto, quantized_nodes, data_constant_ifs),
    ]


def _task_metric(
    shared: _Shared,
    layers: LayerErrors,
    nodes: tuple[NodeRecord, ...],
    qproto: onnx.ModelProto,
    config: SessionConfig,
    options: AnalyzeOptions,
    dyn_nodes: set[str] | None,
    notes: list[str],
    once: Callable[[str], None] = _silent,
    deployed: _Deployed | None = None,
) -> tuple[TaskMetric, EvalResult, Evaluator]:
    """The task metric of the deployed model (and of its fake-quant view), with the evaluation's notes, and
    the evaluator that scored it.

    With evaluation data, both are scored on un-instrumented sessions over all of it, against FP32 outputs
    computed once for every method of the run (``shared``); without, on the outputs the capture already
    saw on the calibration data. ``deployed``: the quantized model's session the capture's check opened,
    scored on (and then let go) instead of opening another.
    """
    if shared.eval_set is not None:
        evaluator, made = shared.evaluator(config, options.metric)
        if made and shared.reference is not None:
            once(f"shared by the methods, run once: the FP32 outputs of the {evaluator.samples} evaluation samples")
        notes.extend(eval_range_notes(evaluator, layers.tensors, nodes))
        fake_quant = options.fakequant_samples != 0 and dyn_nodes is None
        task, result = _scored_on_eval(evaluator, qproto, fake_quant, deployed)
    else:
        evaluator, task, result = _scored_on_capture(layers, shared.prep.calib, options.metric)
    scope = metric_scope_note(evaluator)
    if scope:
        notes.append(scope)
    return task, result, evaluator


def _per_sample(
    prep: Prepared,
    eval_set: DataSet | None,
    evaluator: Evaluator,
    result: tuple[str, EvalResult],
    qproto: onnx.ModelProto,
    pairing: Pairing,
    config: SessionConfig,
    options: AnalyzeOptions,
    notes: list[str],
    layers: LayerErrors | None = None,
) -> SampleSection | None:
    """The per-sample drill-down (:mod:`qdebug.evaluation.samples`) on the data the task metric was scored on: the
    evaluation data, else the calibration data the capture ran on (re-read for the flipped samples); through
    the capture's optimized sides when it kept them (``layers``)."""
    sides = layers.sides if layers is not None else None
    target = DetailTarget(result[0], qproto, pairing, sides, layers.aliases if layers is not None else {})
    return per_sample_section(
        evaluator,
        [result],
        prep.normalized,
        config,
        data="eval" if eval_set is not None else "calib",
        batches=None if eval_set is not None else prep.calib.batches(),
        target=target,
        details=options.flip_details,
        notes=notes,
    )


class _Deployed:
    """The un-instrumented quantized model's session, opened at most once: the capture's check that
    instrumentation changed nothing runs on it (``measure_layers(plain=...)``), then the evaluation. ORT's
    start-up of an optimized QDQ model grows faster than its node count (1.8 s at 3,200 nodes), so one
    start-up fewer matters most on the largest models."""

    def __init__(self, model: onnx.ModelProto, config: SessionConfig) -> None:
        self.model, self.config = model, config
        self.session = None
        self.seconds = 0.0

    def __call__(self):
        if self.session is None:
            start = time.perf_counter()
            self.session = make_session(self.model, self.config, what="quantized model")
            self.seconds = time.perf_counter() - start
        return self.session

    def release(self):
        """The open session (None if none was opened), no longer held here."""
        session, self.session = self.session, None
        return session


def _scored_on_eval(
    evaluator: Evaluator, qproto: onnx.ModelProto, fake_quant: bool, deployed: _Deployed | None = None
) -> tuple[TaskMetric, EvalResult]:
    """Deployed and (with ``fake_quant``) fake-quant scores over the whole evaluation set: the deployed
    model's score over the same samples is then its full score. The deployed one runs on ``deployed``'s
    session when it has one open with the evaluator's settings."""
    session = deployed.release() if deployed is not None else None
    if session is not None and deployed.config == evaluator.config:  # type: ignore[union-attr]
        result = evaluator.score_session(session, seconds=deployed.seconds)  # type: ignore[union-attr]
    else:
        result = evaluator.score(qproto)
    del session
    fakequant_value = evaluator.score(qproto, fake_quant=True).value if fake_quant else math.nan
    fq_samples, same_value = (result.samples, result.value) if not math.isnan(fakequant_value) else (0, math.nan)
    task = TaskMetric(
        result.metric,
        result.fp32_value,
        result.value,
        result.samples,
        "eval",
        fakequant_value,
        fq_samples,
        same_value,
    )
    return task, result


def _scored_on_capture(
    layers: LayerErrors, calib: DataSet, metric: str | None
) -> tuple[Evaluator, TaskMetric, EvalResult]:
    """Scores from the outputs the capture saw on the calibration data (both models already ran on it).

    The fake-quant view is scored against its own pass's FP32 outputs (a data hook may yield other samples
    on each call), and the deployed model again over the same first batches, to compare like with like.
    """
    outs = layers.outputs
    evaluator = Evaluator.from_outputs(outs.reference, outs.labels, calib, metric, outs.sizes)
    result = evaluator.score_outputs(outs.deployed)
    fakequant_value, same_value, fq_samples = math.nan, math.nan, 0
    k = len(outs.fakequant)
    if k:
        fq_eval = Evaluator.from_outputs(
            outs.fakequant_reference, outs.fakequant_labels, calib, metric, outs.fakequant_sizes
        )
        fakequant_value, fq_samples = fq_eval.score_outputs(outs.fakequant).value, layers.fakequant_samples
        labels = outs.labels[:k] if outs.labels else None
        head = Evaluator.from_outputs(outs.reference[:k], labels, calib, metric, outs.sizes[:k])
        same_value = head.score_outputs(outs.deployed[:k]).value
    task = TaskMetric(
        result.metric,
        result.fp32_value,
        result.value,
        result.samples,
        "calib",
        fakequant_value,
        fq_samples,
        same_value,
    )
    return evaluator, task, result


def _analysis_config(
    options: AnalyzeOptions,
    settings: QuantSettings,
    calib: str | Path,
    eval_data: str | Path | None,
    quantized: str | Path | None,
    layers: LayerErrors,
) -> AnalysisConfig:
    """The settings the report records, with data and hook paths made absolute (:func:`record_path`)."""
    return AnalysisConfig(
        **config_fields(settings),  # type: ignore[arg-type]
        batch_size=options.batch_size,
        max_samples=options.max_samples,
        calib=record_path(calib),
        eval=record_path(eval_data) if eval_data is not None else None,
        metric=record_path(options.metric) if options.metric and ":" in options.metric else options.metric,
        quantized_given=quantized is not None,
        fakequant_samples=layers.fakequant_samples,
        batch_axes=tuple(options.batch_axes),
    )


def _check_same_inputs(
    fp32: onnx.ModelProto, qproto: onnx.ModelProto, model: str | Path, quantized: str | Path
) -> None:
    """Both models take the same inputs (names), or the quantized one was not made from this model: ORT had
    failed to load the merged models ("Node input 'x16' is not a graph input", exit 4)."""
    want, have = ([s.name for s in model_input_specs(m)] for m in (fp32, qproto))
    if set(want) != set(have):
        raise QDebugError(
            f"the quantized model {quantized} does not derive from {model}: its inputs {have} are not the FP32 "
            f"model's {want}",
            "pass the QDQ model made from this FP32 model",
            ExitCode.MODEL,
        )


def _settings_from_model(qproto: onnx.ModelProto, prep: Prepared, name: str, notes: list[str]) -> QuantSettings:
    """The settings the user's QDQ model was made with, as far as its Q/DQ nodes show them (per-channel,
    types, symmetric ranges, 7-bit weights, op types, per-channel axes, 16-bit tensors...), over the
    flags', so that the report records them and propose, verify and bench rebuild a comparable model; one
    note says what was read and what could not be and was assumed."""
    from qdebug.graph.match import qdq_settings
    from qdebug.quant.config import read_off

    settings, note = read_off(qdq_settings(qproto), prep.normalized, prep.settings, name)
    notes.append(note)
    return settings


def is_dynamic_model(model: onnx.ModelProto) -> bool:
    """A ``quantize_dynamic`` model: DynamicQuantizeLinear feeding MatMulInteger/ConvInteger, no QLinear ops."""
    ops = {n.op_type for n in model.graph.node}
    return "DynamicQuantizeLinear" in ops and not any(o.startswith("QLinear") for o in ops)


def _refuse_integer_ops(qproto: onnx.ModelProto, path: str | Path) -> None:
    """Refuse QOperator / integer-op models: their tensors between nodes are integers, not pairable floats."""
    from collections import Counter

    ops = Counter(
        n.op_type for n in qproto.graph.node if n.op_type.startswith("QLinear") or n.op_type in INTEGER_KERNEL_OPS
    )
    if ops:
        found = ", ".join(f"{op} x{k}" for op, k in sorted(ops.items()))
        raise QDebugError(
            f"{path} is a QOperator-format (integer op) model ({found}): the tensors between its nodes are "
            "integers, so its layers cannot be paired with the FP32 tensors (only QDQ-format models can)",
            "pass a QDQ-format model (quantize_static(..., quant_format=QuantFormat.QDQ)) or drop "
            "--quantized; qdebug bench --variants fp32,static,qoperator compares the QOperator form end to end",
            ExitCode.MODEL,
        )


