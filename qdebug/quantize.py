"""Build quantized variants -- the only module that spells ORT quantization options.

Static QDQ models are built from cached :class:`~qdebug.calibrate.Ranges`
through ORT's ``QDQQuantizer`` (what ``quantize_static`` runs after it has
calibrated), so a variant with other ``nodes_to_exclude`` costs tens of
milliseconds instead of a full recalibration. Every ORT failure becomes one
:class:`QDebugError` explaining the option that avoids it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from qdebug.calibrate import Ranges, op_types_to_quantize, quiet_ort_logging
from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.load import PER_CHANNEL_OPSET, default_opset, save_model
from qdebug.records import QUANT_TYPES, TensorOverride
from qdebug.snippet import quantize_snippet as quantize_snippet  # re-exported: it moved to snippet.py


@dataclass(frozen=True)
class QuantSpec:
    """Everything that decides a static QDQ model besides the ranges."""

    per_channel: bool = False
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    nodes_to_exclude: tuple[str, ...] = ()
    tensor_overrides: tuple[TensorOverride, ...] = ()
    keep_removable_activations: bool = False

    def extra_options(self) -> dict[str, Any]:
        """ORT ``extra_options`` for this spec."""
        from onnxruntime.quantization import QuantType

        opts: dict[str, Any] = {}
        if self.tensor_overrides:
            opts["TensorQuantOverrides"] = {
                o.tensor: [{"quant_type": getattr(QuantType, o.quant_type)}] for o in self.tensor_overrides
            }
        if self.keep_removable_activations:
            opts["QDQKeepRemovableActivations"] = True
        return opts


def _qtype(name: str) -> Any:
    from onnxruntime.quantization import QuantType

    if name not in QUANT_TYPES:
        raise QDebugError(
            f"unknown quantization type {name!r}", f"use one of {', '.join(QUANT_TYPES)}", ExitCode.USAGE
        )
    return getattr(QuantType, name)


def quantize_static_model(
    model: onnx.ModelProto,
    ranges: Ranges,
    spec: QuantSpec,
    out_path: Path | None = None,
    *,
    quant_format: str = "QDQ",
) -> onnx.ModelProto:
    """Build the static QDQ model of ``model`` from cached ``ranges`` (deep-copied; inputs untouched).

    ``model`` must be the normalized model (shape-inferred). Node names in
    ``spec.nodes_to_exclude`` that do not exist are refused, since ORT would
    silently ignore them. ``quant_format="QOperator"`` builds the QOperator
    form (QLinearConv, QLinearMatMul...) instead, through ORT's ``ONNXQuantizer``
    (what ``quantize_static(quant_format=QuantFormat.QOperator)`` runs).
    """
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode, update_opset_version

    names = {n.name for n in model.graph.node}
    unknown = [n for n in spec.nodes_to_exclude if n not in names]
    if unknown:
        raise QDebugError(
            f"nodes_to_exclude names {len(unknown)} node(s) not in the model: {unknown[:5]}",
            "use node names from the qdebug report (normalized names)",
            ExitCode.INPUT,
        )
    _refuse_reserved_names(model)
    _refuse_nan_outputs(model, ranges)
    forced = float16_exclusions(model) + nonfinite_range_exclusions(model, ranges)[0]
    if forced:
        extra_excluded = tuple(n for n in forced if n not in spec.nodes_to_exclude)
        spec = dataclasses.replace(spec, nodes_to_exclude=tuple(spec.nodes_to_exclude) + extra_excluded)
    work = copy.deepcopy(model)
    if spec.per_channel and default_opset(work) < PER_CHANNEL_OPSET:
        work = _upgrade_for_per_channel(work)
    weight_type = _qtype(spec.weight_type)
    activation_type = _qtype(spec.activation_type)
    extra = spec.extra_options()
    try:
        with quiet_ort_logging():
            work = update_opset_version(
                work, weight_type, activation_type, tensor_quant_overrides=extra.get("TensorQuantOverrides")
            )
            if quant_format == "QOperator":
                quantizer = ONNXQuantizer(
                    work,
                    spec.per_channel,
                    False,
                    QuantizationMode.QLinearOps,
                    True,
                    weight_type,
                    activation_type,
                    copy.deepcopy(ranges.tensors),
                    [],
                    list(spec.nodes_to_exclude),
                    op_types_to_quantize(),
                    extra,
                )
            else:
                quantizer = QDQQuantizer(
                    work,
                    spec.per_channel,
                    False,
                    weight_type,
                    activation_type,
                    copy.deepcopy(ranges.tensors),
                    [],
                    list(spec.nodes_to_exclude),
                    op_types_to_quantize(),
                    extra,
                )
            quantizer.quantize_model()
            result = quantizer.model.model
    except QDebugError:
        raise
    except Exception as e:
        raise _explain_quantizer_error(e, spec) from None
    _exact_passthrough_outputs(result)
    if out_path is not None:
        save_model(result, out_path)
    return result


def _exact_passthrough_outputs(model: onnx.ModelProto) -> None:
    """A graph output that is an ``Identity`` of a graph input reads the input itself again.

    ORT rewires *every* reader of a quantized tensor to its DequantizeLinear output, the Identity that
    passes a graph input through to an output included (normalization adds one for an input listed as an
    output): the output then left the model quantized (54 dB instead of exact). Nothing is computed on
    that path, so nothing of the quantization is lost by reading the input itself.
    """
    inputs = {i.name for i in model.graph.input}
    producer = {o: n for n in model.graph.node for o in n.output}
    outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        if node.op_type != "Identity" or not node.output or node.output[0] not in outputs:
            continue
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in inputs:
            node.input[0] = q.input[0]


_ORT_SUFFIXES = ("_QuantizeLinear_Output", "_DequantizeLinear_Output", "_QuantizeLinear_Input", "_quantized")
"""Names ORT's quantizer gives the tensors it adds for tensor ``T`` (``T`` + suffix)."""


def _refuse_nan_outputs(model: onnx.ModelProto, ranges: Ranges) -> None:
    """Stop before quantizing a model whose FP32 outputs were entirely NaN during calibration.

    ORT's quantizer would fail later on with "scale issue"; the cause is the FP32 model (e.g. an attention
    mask computed as ``(1 - mask) * -inf``: 0 * inf is NaN), which no quantization setting fixes.
    """
    seen = ranges.minmax()
    nan = [o.name for o in model.graph.output if o.name in seen and any(math.isnan(v) for v in seen[o.name])]
    if nan:
        raise QDebugError(
            f"the FP32 model computes NaN for output(s) {', '.join(nan[:3])} on the calibration data",
            "fix the model: e.g. an attention mask of (1 - mask) * -inf is NaN where mask is 1 (0 * inf); "
            "use a large negative number such as -1e4, or Where(mask, scores, -inf)",
            ExitCode.MODEL,
        )


def _refuse_reserved_names(model: onnx.ModelProto) -> None:
    """A tensor already named like one ORT's quantizer will add (``x_DequantizeLinear_Output`` next to a
    tensor ``x``) makes it write a model with two definitions of that name, which ORT then refuses with
    "check the model with onnx.checker". Said plainly, before quantizing."""
    names = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    names |= {o for n in model.graph.node for o in n.output if o}
    clash = sorted(
        n for n in names for suffix in _ORT_SUFFIXES if n.endswith(suffix) and n[: -len(suffix)] in names
    )
    if clash:
        raise QDebugError(
            f"tensor name(s) {clash[:3]} are the names ORT's quantizer gives its own Q/DQ tensors, so the "
            "quantized model would define them twice",
            "rename those tensors in the model to names without these suffixes, then re-run",
            ExitCode.MODEL,
        )


def nonfinite_range_exclusions(model: onnx.ModelProto, ranges: Ranges) -> tuple[list[str], list[str]]:
    """(nodes every static variant must exclude, tensors why): the producers and consumers of tensors whose
    calibrated range is not finite.

    An attention mask written with ``-inf`` (``masked_fill``, ``Where(mask, scores, -inf)``) or a division
    by zero gives a tensor an infinite range: ORT's quantizer then asserts ("scale issue") or writes an
    infinite scale that turns the tensor into NaN. Keeping the nodes around it in FP32 is what a user of
    ORT has to do too; the analysis says so in a note.
    """
    bad = sorted(
        n for n, (lo, hi) in ranges.minmax().items() if not (math.isfinite(lo) and math.isfinite(hi))
    )
    if not bad:
        return [], []
    wanted = set(bad)
    nodes = [
        n.name for n in model.graph.node if n.name and any(t in wanted for t in [*n.input, *n.output] if t)
    ]
    return nodes, bad


_HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def float16_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of top-level nodes reading or writing a float16/bfloat16 tensor (types from shape inference)."""
    types = {i.name: i.data_type for i in model.graph.initializer}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        if vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    return [
        n.name
        for n in model.graph.node
        if any(types.get(t) in _HALF_TYPES for t in list(n.input) + list(n.output) if t)
    ]


def float16_exclusions(model: onnx.ModelProto) -> list[str]:
    """The float16 nodes every static variant must exclude; refuses a model with nothing else to quantize.

    ORT's quantizer writes float16 scales into QuantizeLinear/DequantizeLinear
    for float16 tensors (and float16 bias scales), a model ORT then refuses to
    load. The float32 part of a mixed model quantizes fine once they are excluded.
    """
    half = float16_nodes(model)
    if not half:
        return []
    from qdebug.calibrate import op_types_to_quantize

    ops = set(op_types_to_quantize())
    skip = set(half)
    if not any(n.op_type in ops and n.name not in skip for n in model.graph.node):
        raise QDebugError(
            f"the model computes in float16 ({len(half)} of {len(model.graph.node)} nodes): ONNX Runtime's "
            "quantizer writes float16 scales into QuantizeLinear/DequantizeLinear for float16 tensors, a model "
            "ORT refuses to load, and no float32 node is left to quantize",
            "quantize the float32 export of the model (or convert it to float32 first)",
            ExitCode.MODEL,
        )
    return half


def _upgrade_for_per_channel(model: onnx.ModelProto) -> onnx.ModelProto:
    """Per-channel DequantizeLinear needs ``axis`` (opset 13); ORT otherwise writes a model it cannot load."""
    from onnx import version_converter

    try:
        return version_converter.convert_version(model, PER_CHANNEL_OPSET)
    except Exception as e:
        raise QDebugError(
            f"per-channel quantization needs opset >= 13 and converting this opset-{default_opset(model)} model failed "
            f"({e.__class__.__name__})",
            "re-export the model at opset >= 13, or drop --per-channel",
            ExitCode.MODEL,
        ) from None


def _explain_quantizer_error(e: Exception, spec: QuantSpec) -> QDebugError:
    text = f"{e.__class__.__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    hint = "report this model to qdebug; try --per-channel off or excluding the node named in the message"
    if spec.per_channel and ("bias" in str(e).lower() or "scale" in str(e).lower()):
        hint = "ORT's int32 bias scale adjustment failed for per-channel weights; drop --per-channel"
    return QDebugError(f"ONNX Runtime's quantizer failed ({text})", hint, ExitCode.MODEL)


def quantize_dynamic_model(
    model_path: Path, out_path: Path, *, op_types: Sequence[str] | None = None, per_channel: bool = False
) -> None:
    """Dynamic quantization (QInt8 weights, activations quantized at run time)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    try:
        with quiet_ort_logging():
            quantize_dynamic(
                str(model_path),
                str(out_path),
                op_types_to_quantize=list(op_types) if op_types else None,
                per_channel=per_channel,
                weight_type=QuantType.QInt8,
            )
    except Exception as e:
        raise QDebugError(
            f"ONNX Runtime's dynamic quantizer failed ({e.__class__.__name__}: {str(e)[:200]})",
            "restrict the op types with --dynamic-ops MatMul",
            ExitCode.MODEL,
        ) from None


