"""Compose the stages into the user-facing operations. No printing, no argparse.

``analyze`` is the foundation: load + normalize the model, open the data,
calibrate once (cached), build the QDQ model from the cached ranges (or take
the user's), pair tensors through the graph, stream the layer-wise capture,
score the task metric on un-instrumented sessions and write the report.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from pathlib import Path

import onnx

from qdebug import __version__
from qdebug.analysis import (
    collapsed_range_notes,
    concat_range_notes,
    folded_activation_notes,
    instrumentation_notes,
    kernel_gap_notes,
    measure_layers,
    node_records,
    quantized_node_names,
    structure_notes,
    weight_records,
)
from qdebug.capture import SessionConfig
from qdebug.data import DataSet, data_notes, model_input_specs, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluate import Evaluator, eval_range_notes, metric_scope_note
from qdebug.files import (
    artifacts_dir,
    check_outputs_spare_inputs,
    check_writable,
    record_path,
    removed_on_failure,
)
from qdebug.graph.load import (
    PER_CHANNEL_OPSET,
    default_opset,
    load_model,
)
from qdebug.graph.match import is_qdq_model, pair_models
from qdebug.graph.ops import INTEGER_KERNEL_OPS
from qdebug.prepare import AnalyzeOptions, Prepared, model_info, prepare  # noqa: F401 -- re-exported
from qdebug.progress import Progress, no_progress
from qdebug.quantize import QuantSpec, float16_exclusions, nonfinite_range_exclusions, quantize_static_model
from qdebug.records import SCHEMA_VERSION, AnalysisConfig, Report, TaskMetric
from qdebug.report_io import save_report


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
    check_outputs_spare_inputs(
        {
            "the report": out,
            "the normalized model": workdir / "normalized.onnx",
            "the quantized model": workdir / "quantized.onnx" if quantized is None else None,
        },
        {
            "the model": model,
            "the calibration data": calib,
            "the evaluation data": eval_data,
            "the quantized model": quantized,
        },
    )
    with removed_on_failure(workdir, [out], [model, calib, eval_data, quantized]):
        return _analyze(model, calib, eval_data, quantized, out, workdir, options, progress)


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
    """The body of :func:`analyze` (which cleans up after it on failure)."""
    config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
    opened: list[DataSet] = []

    def open_eval(normalized: onnx.ModelProto) -> None:
        # before calibration (headers and first item checked): bad evaluation data had been found only
        # after calibration, the fake-quant view and the whole capture had run
        if eval_data is not None:
            specs = model_input_specs(normalized)
            opened.append(open_data(eval_data, specs, batch_size=options.batch_size, what="evaluation data"))

    prep = prepare(
        model, calib, workdir, options, need_ranges=quantized is None, progress=progress, check=open_eval
    )
    eval_set = opened[0] if opened else None
    notes = list(prep.notes)
    notes.extend(data_notes(prep.calib, eval_set, prep.normalized))

    if quantized is None:
        assert prep.ranges is not None
        spec = QuantSpec(
            per_channel=options.per_channel,
            activation_type=options.activation_type,
            weight_type=options.weight_type,
        )
        quantized_path = workdir / "quantized.onnx"
        qproto = quantize_static_model(prep.normalized, prep.ranges, spec, quantized_path)
        if options.per_channel and default_opset(prep.normalized) < PER_CHANNEL_OPSET:
            notes.append(
                f"per-channel weights need DequantizeLinear's axis (opset {PER_CHANNEL_OPSET}): the quantized model "
                f"was converted from opset {default_opset(prep.normalized)} with onnx.version_converter (ORT would "
                "otherwise write a model it cannot load)"
            )
        half = float16_exclusions(prep.normalized)
        if half:
            notes.append(
                f"kept {len(half)} node(s) that compute in float16 out of quantization ({', '.join(half[:6])}"
                f"{'...' if len(half) > 6 else ''}): ORT's quantizer writes an invalid model (float16 scales) for "
                "them; every qdebug variant excludes them, add them to nodes_to_exclude when you call ORT yourself"
            )
        unbounded, why = nonfinite_range_exclusions(prep.normalized, prep.ranges)
        if unbounded:
            nodes = ", ".join(unbounded[:6]) + ("..." if len(unbounded) > 6 else "")
            tensors = ", ".join(why[:4]) + ("..." if len(why) > 4 else "")
            notes.append(
                f"kept {len(unbounded)} node(s) out of quantization ({nodes}) because tensor(s) they read or "
                f"write have a calibrated range that is not finite ({tensors}: an -inf mask or a division by "
                "zero?): ORT's quantizer fails or writes an infinite scale for them; every qdebug variant "
                "excludes them, add them to nodes_to_exclude when you call ORT yourself"
            )
        if options.method == "distribution" and options.activation_type in ("QUInt8", "QInt8"):
            notes.append(
                "--method distribution: ORT's Distribution calibrator is meant for float8 types; with 8-bit "
                "integers its ranges often clip (the CNN fixture: top-1 98 % -> 20 %, the same with ORT's "
                "quantize_static): compare with --method minmax, entropy or percentile"
            )
        if prep.ranges.from_cache:
            notes.append(f"calibration ranges reused from cache {prep.ranges.cache_path}")
        if not is_qdq_model(qproto):
            notes.append(
                "ORT inserted no QuantizeLinear/DequantizeLinear nodes: nothing in the main graph was quantized "
                "(is the network inside If/Loop subgraphs?)"
            )
        qinfo = model_info(quantized_path, qproto)
    else:
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
        if not dynamic:
            options = _settings_from_model(qproto, options, notes)

    dyn_nodes: set[str] | None = None
    if quantized is not None and is_dynamic_model(qproto):
        from qdebug.bench import pair_dynamic  # dynamic models pair by the integer-op chain

        pairing, dyn_nodes = pair_dynamic(prep.normalized, qproto)
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

    ranges_mm = prep.ranges.minmax() if prep.ranges is not None else {}
    layers = measure_layers(
        prep.normalized,
        qproto,
        pairing,
        prep.calib,
        config,
        ranges_mm,
        progress,
        engine=options.engine,
        # a dynamic model quantizes at run time: no Q/DQ pairs, no fake-quant view
        fakequant_samples=0 if dyn_nodes is not None else options.fakequant_samples,
    )
    if 0 < layers.fakequant_samples < layers.samples:
        # with --eval the fake-quant task metric is scored on the whole evaluation set (below)
        what = "accumulated_fakequant" + ("" if eval_data is not None else ", the fake-quant task metric")
        notes.append(
            f"the fake-quant view ({what}) ran on the first "
            f"{layers.fakequant_samples} of {layers.samples} calibration samples (--fakequant-samples, "
            "rounded up to whole batches)"
        )
    if layers.engine == "numpy" and options.engine == "auto":
        notes.append(
            "layer capture used the numpy engine (models differ in opset or tensor types are unknown)"
        )
    qnodes = set(dyn_nodes) if dyn_nodes is not None else quantized_node_names(qproto, pairing)
    nodes = node_records(prep.normalized, layers.tensors, qnodes, prep.name_map)
    weights = weight_records(prep.normalized, qproto, pairing)
    notes.extend(instrumentation_notes(layers))
    notes.extend(kernel_gap_notes(layers.tensors, layers.deployed_head, skip=layers.aliases, nodes=nodes))
    notes.extend(concat_range_notes(prep.normalized, layers.tensors))
    notes.extend(collapsed_range_notes(layers.tensors, nodes))
    notes.extend(folded_activation_notes(nodes, layers.tensors))
    notes.extend(structure_notes(prep.normalized, qproto, qnodes))

    if eval_set is not None:
        evaluator = Evaluator(prep.normalized, eval_set, config, options.metric)
        notes.extend(eval_range_notes(evaluator, layers.tensors, nodes))
        result = evaluator.score(qproto)
        fakequant_value = (
            evaluator.score(qproto, fake_quant=True).value
            if options.fakequant_samples != 0 and dyn_nodes is None
            else math.nan
        )
        fq_samples, same_value = (
            (result.samples, result.value) if not math.isnan(fakequant_value) else (0, math.nan)
        )
        eval_label = "eval"
    else:  # the capture already ran both models over the calibration data: reuse its outputs
        outs = layers.outputs
        evaluator = Evaluator.from_outputs(
            outs.reference, outs.labels, prep.calib, options.metric, outs.sizes
        )
        result = evaluator.score_outputs(outs.deployed)
        fakequant_value, same_value, fq_samples = math.nan, math.nan, 0
        k = len(outs.fakequant)
        if k:
            # each side against its own pass's FP32 outputs; the deployed model over the same first batches
            fq_eval = Evaluator.from_outputs(
                outs.fakequant_reference,
                outs.fakequant_labels,
                prep.calib,
                options.metric,
                outs.fakequant_sizes,
            )
            fq_res = fq_eval.score_outputs(outs.fakequant)
            fakequant_value, fq_samples = fq_res.value, layers.fakequant_samples
            labels = outs.labels[:k] if outs.labels else None
            head = Evaluator.from_outputs(
                outs.reference[:k], labels, prep.calib, options.metric, outs.sizes[:k]
            )
            same_value = head.score_outputs(outs.deployed[:k]).value
        eval_label = "calib"
    scope = metric_scope_note(evaluator)
    if scope:
        notes.append(scope)
    task = TaskMetric(
        result.metric,
        result.fp32_value,
        result.value,
        result.samples,
        eval_label,
        fakequant_value,
        fq_samples,
        same_value,
    )

    import onnxruntime

    report = Report(
        schema_version=SCHEMA_VERSION,
        qdebug_version=__version__,
        ort_version=onnxruntime.__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=prep.model,
        normalized_model=str(prep.normalized_path.resolve()),
        quantized_model=qinfo,
        config=AnalysisConfig(
            method=options.method,
            per_channel=options.per_channel,
            activation_type=options.activation_type,
            weight_type=options.weight_type,
            batch_size=options.batch_size,
            max_samples=options.max_samples,
            calib=record_path(calib),
            eval=record_path(eval_data) if eval_data is not None else None,
            metric=record_path(options.metric) if options.metric and ":" in options.metric else options.metric,
            quantized_given=quantized is not None,
            fakequant_samples=layers.fakequant_samples,
            upgrade_opset=options.upgrade_opset,
            inline_constant_if=options.inline_constant_if,
        ),
        calibration_cache=str(prep.ranges.cache_path) if prep.ranges and prep.ranges.cache_path else None,
        samples=layers.samples,
        nodes=nodes,
        tensors=layers.tensors,
        weights=weights,
        outputs=result.outputs,
        task=task,
        deployed_gap=layers.deployed_gap,
        not_captured=layers.not_captured,
        notes=tuple(notes),
        name_map=tuple(sorted(prep.name_map.items())),
        ranges=tuple((k, lo, hi) for k, (lo, hi) in sorted(ranges_mm.items())),
    )
    save_report(report, out)
    return report


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


def _settings_from_model(qproto: onnx.ModelProto, options: AnalyzeOptions, notes: list[str]) -> AnalyzeOptions:
    """The options with per-channel and the types the user's QDQ model was made with, so that the report
    records them and propose, verify and bench rebuild a comparable model; a note says what was read and
    that the rebuilt models come from qdebug's own calibration."""
    from qdebug.graph.match import qdq_settings

    found = qdq_settings(qproto)
    read = dataclasses.replace(
        options,
        per_channel=found.per_channel if found.per_channel is not None else options.per_channel,
        activation_type=found.activation_type or options.activation_type,
        weight_type=found.weight_type or options.weight_type,
    )
    def say(field: str, value: object) -> str:
        if field == "per_channel":
            return "per-channel weights" if value else "per-tensor weights"
        return f"{value} {'activations' if field == 'activation_type' else 'weights'}"

    changed = [
        f"{say(f, getattr(read, f))} (flags: {say(f, getattr(options, f))})"
        for f in ("per_channel", "activation_type", "weight_type")
        if getattr(read, f) != getattr(options, f)
    ]
    notes.append(
        "settings read from the quantized model: "
        + (", ".join(changed) if changed else "as the flags say")
        + f"; propose, verify and bench rebuild it with them from qdebug's own calibration (--method "
        f"{options.method}), so their static baseline can differ from this file"
    )
    return read


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


