"""Build quantized variants -- the only module that spells ORT quantization options.

Static QDQ models are built from cached :class:`~qdebug.quant.calibrate.Ranges`
through ORT's ``QDQQuantizer`` (what ``quantize_static`` runs after it has
calibrated), so a variant with other ``nodes_to_exclude`` costs tens of
milliseconds instead of a full recalibration. Every ORT failure becomes one
:class:`QDebugError` explaining the option that avoids it.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import math
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.load import PER_CHANNEL_OPSET, default_opset, save_model
from qdebug.output.snippet import quantize_snippet as quantize_snippet  # re-exported: it moved to snippet.py
from qdebug.quant.calibrate import Ranges, op_types_to_quantize, quiet_ort_logging
from qdebug.records import QUANT_TYPES, TensorOverride
from qdebug.records.proposal import merge_tensor_overrides
from qdebug.records.report import ExtraOption, QuantSettings


@dataclass(frozen=True)
class QuantSpec:
    """Everything that decides a static QDQ model besides the ranges.

    A variant is the base settings (:meth:`of` a :class:`~qdebug.records.QuantSettings`: the user's config
    included) plus its own changes: ``per_channel``, ``nodes_to_exclude`` (added to the base's
    ``base_exclusions``) and ``tensor_overrides`` (merged into the base's ``TensorQuantOverrides``, the
    variant's keys winning) -- what propose's search, verify and bench replace.
    """

    per_channel: bool = False
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    nodes_to_exclude: tuple[str, ...] = ()
    tensor_overrides: tuple[TensorOverride, ...] = ()
    keep_removable_activations: bool = False
    reduce_range: bool = False
    op_types: tuple[str, ...] = ()
    """``op_types_to_quantize`` (empty: every op type ORT quantizes)."""
    nodes_to_quantize: tuple[str, ...] = ()
    base_exclusions: tuple[str, ...] = ()
    """The base settings' own ``nodes_to_exclude`` (the user's), excluded by every variant."""
    base_extra: tuple[ExtraOption, ...] = ()
    """The base settings' ``extra_options`` (JSON values)."""
    quantizer: str = "static"
    """How ORT builds the model (:data:`qdebug.vocabulary.QUANTIZERS`): ``static`` QDQ from the ranges,
    ``dynamic`` (``quantize_dynamic``: INT8 weights, activations quantized at run time) or ``mixed``
    (static QDQ on every op type but :data:`~qdebug.vocabulary.DYNAMIC_OPS`, then ``quantize_dynamic`` on
    those). A whole-model recipe sets it (:func:`quantize_model`)."""

    @classmethod
    def of(cls, settings: QuantSettings, **changes: Any) -> QuantSpec:
        """The spec of ``settings`` (a variant's own changes as keyword arguments)."""
        base = cls(
            per_channel=settings.per_channel,
            activation_type=settings.activation_type,
            weight_type=settings.weight_type,
            reduce_range=settings.reduce_range,
            op_types=settings.op_types,
            nodes_to_quantize=settings.nodes_to_quantize,
            base_exclusions=settings.nodes_to_exclude,
            base_extra=settings.extra_options,
        )
        return dataclasses.replace(base, **changes) if changes else base

    def excluded(self) -> list[str]:
        """Every node ORT is told to exclude: the base's, then the variant's."""
        return list(dict.fromkeys([*self.base_exclusions, *self.nodes_to_exclude]))

    def quantized_op_types(self) -> list[str]:
        """``op_types_to_quantize`` as ORT gets it."""
        return list(self.op_types) if self.op_types else op_types_to_quantize()

    def extra_options(self) -> dict[str, Any]:
        """ORT ``extra_options`` for this spec: the base's, the variant's overrides merged in."""
        from qdebug.quant.config import ort_extra_options

        extras = {o.key: o.value for o in self.base_extra}
        opts: dict[str, Any] = {}
        if self.tensor_overrides:
            user = extras.get("TensorQuantOverrides")
            extras["TensorQuantOverrides"] = merge_tensor_overrides(user, self.tensor_overrides)  # type: ignore[arg-type]
        opts.update(ort_extra_options(extras, self.activation_type))
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
    load_check: bool = True,
) -> onnx.ModelProto:
    """Build the static QDQ model of ``model`` from cached ``ranges`` (deep-copied; inputs untouched).

    ``load_check=False`` leaves out ORT's trial load of the result (the checks by name still run): for a
    caller that opens a session on it next anyway, and calls :func:`check_quantized_loads` only when
    that fails (propose's candidates: one session per candidate, not two).

    ``model`` must be the normalized model (shape-inferred). Node names in
    ``spec.nodes_to_exclude`` that do not exist are refused, since ORT would
    silently ignore them. ``quant_format="QOperator"`` builds the QOperator
    form (QLinearConv, QLinearMatMul...) instead, through ORT's ``ONNXQuantizer``
    (what ``quantize_static(quant_format=QuantFormat.QOperator)`` runs).
    """
    from qdebug.quant import fast_quantize

    key = fast_quantize.content_key(model)
    facts = _facts(model, key)
    _refuse_unknown_exclusions(spec, facts.node_names)
    before = facts.names
    _refuse_reserved_names(model, before)
    seen = ranges.minmax()
    _refuse_nan_outputs(model, ranges, seen)
    forced = facts.float16_exclusions(model) + nonfinite_range_exclusions(model, ranges, seen)[0]
    if forced:
        extra_excluded = tuple(n for n in forced if n not in spec.nodes_to_exclude)
        spec = dataclasses.replace(spec, nodes_to_exclude=tuple(spec.nodes_to_exclude) + extra_excluded)
    fast = fast_quantize.use_fast_path()
    with collector_paused():  # back on once _run_quantizer's quantizer is freed (see collector_paused)
        try:
            result, read = _run_quantizer(model, ranges, spec, quant_format, fast, key)
        except fast_quantize.IndexOutOfStep as e:
            fast_quantize.note(
                f"ORT's quantizer was run again on its plain path (quadratic in the node count): qdebug's index "
                f"of the graph fell out of step with it ({e}); please report this model to qdebug"
            )
            result, read = _run_quantizer(model, ranges, spec, quant_format, False)
    after = _Names.of(result, read)
    _exact_passthrough_outputs(result, after)
    check_quantized_loads(model, result, load=load_check, names=(before, after))
    if out_path is not None:
        save_model(result, out_path)
    return result


def _run_quantizer(
    model: onnx.ModelProto, ranges: Ranges, spec: QuantSpec, quant_format: str, fast: bool, key: bytes | None = None
) -> tuple[onnx.ModelProto, Any]:
    """ORT's ``QDQQuantizer`` (or ``ONNXQuantizer`` for QOperator) over a copy of ``model``, as
    ``quantize_static`` runs it after calibrating. ``fast`` runs the same quantizer over qdebug's indexed
    model (:mod:`qdebug.quant.fast_quantize`: the same model, in time linear in the graph); it raises
    :class:`~qdebug.quant.fast_quantize.IndexOutOfStep` if its index and the graph disagree at the end. ``key``:
    ``model``'s :func:`~qdebug.quant.fast_quantize.content_key`, when the caller has it. Returns the model and,
    on the fast path, the names its index check read off the result
    (:meth:`~qdebug.quant.fast_quantize.IndexedModel.final_names`; None: read them again)."""
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
    from onnxruntime.quantization.quant_utils import QuantizationMode

    from qdebug.quant import fast_quantize

    work = model if fast else copy.deepcopy(model)  # fast: copied below, once it is known from what
    per_channel_weights = spec.per_channel or any(o.axis is not None for o in spec.tensor_overrides)
    if per_channel_weights and default_opset(work) < PER_CHANNEL_OPSET:
        work = _upgrade_for_per_channel(copy.deepcopy(model) if fast else work)
    weight_type = _qtype(spec.weight_type)
    activation_type = _qtype(spec.activation_type)
    extra = spec.extra_options()
    tensors = ranges.private_tensors()
    scope = fast_quantize.installed() if fast else contextlib.nullcontext()
    try:
        with quiet_ort_logging(), scope:
            work = updated_opset(work, weight_type, activation_type, extra.get("TensorQuantOverrides"))
            if fast and work is model:  # not converted: the quantizer's own shape inference, made once per model
                work = fast_quantize.shape_inferred(model, key)
            if default_opset(work) != default_opset(model):
                carry_ranges_to_converted(model, work, tensors)
            nodes = (list(spec.nodes_to_quantize), spec.excluded(), spec.quantized_op_types())
            common = (weight_type, activation_type, tensors, *nodes)
            flags = (spec.per_channel, spec.reduce_range)
            if quant_format == "QOperator":
                cls = fast_quantize.indexed(ONNXQuantizer) if fast else ONNXQuantizer
                quantizer = cls(work, *flags, QuantizationMode.QLinearOps, True, *common, extra)
            else:
                cls = fast_quantize.indexed(QDQQuantizer) if fast else QDQQuantizer
                quantizer = cls(work, *flags, *common, extra)
            quantizer.quantize_model()
            read = None
            if fast and isinstance(quantizer.model, fast_quantize.IndexedModel):
                quantizer.model.check_in_step()
                read = quantizer.model.final_names()
            return quantizer.model.model, read
    except (QDebugError, fast_quantize.IndexOutOfStep):
        raise
    except Exception as e:
        raise _explain_quantizer_error(e, spec) from None


def updated_opset(
    model: onnx.ModelProto, weight_type: Any, activation_type: Any = None, overrides: Any = None
) -> onnx.ModelProto:
    """ORT's ``update_opset_version`` -- the opset ``quantize_static`` converts the model to before quantizing --
    with the arguments the installed ORT's takes (asked of its signature): from 1.28 it also raises the opset
    to 21 for 16-bit types (``activation_type``, ``tensor_quant_overrides``), 1.23 to 1.26 look at the weight
    type only, and 1.20 to 1.22 have none (their quantizer raises an opset below 10 itself, and writes 16-bit
    Q/DQ in the com.microsoft domain). ``model`` is returned where nothing changes."""
    import inspect

    from onnxruntime.quantization import quant_utils

    update = getattr(quant_utils, "update_opset_version", None)
    if update is None:
        return model
    takes = inspect.signature(update).parameters
    kwargs = {
        name: value
        for name, value in (("activation_type", activation_type), ("tensor_quant_overrides", overrides))
        if name in takes
    }
    return update(model, weight_type, **kwargs)


def carry_ranges_to_converted(before: onnx.ModelProto, after: onnx.ModelProto, tensors: Any) -> list[str]:
    """Give tensors that an opset conversion added the calibrated ranges of the tensors they only reshape.

    The ranges are calibrated on the normalized model; per-channel weights (opset 13) and 16-bit types
    (opset 21, ORT's ``update_opset_version``) convert it afterwards with ``onnx.version_converter``. For
    a ``Softmax`` or ``LogSoftmax`` of opset < 13 whose input rank is unknown to shape inference
    (a ``Squeeze`` without axes on a dynamic dimension, a computed Reshape...) the converter keeps the
    old 2-D meaning by writing Shape/Flatten/Softmax/Reshape, the Softmax making a new tensor
    ``<name>_intermediate``. ORT's ``BaseQuantizer.adjust_tensor_ranges`` then sets the range of every
    Softmax output, and ``TensorsData.__setitem__`` refuses a name it has no range for: "Only an existing
    tensor can be modified, 'softmax_9.tmp_0_intermediate' is not." (the CRNN recognizers of issue 16).
    A new tensor written by, or read by, an op that only moves values (Flatten, Reshape...) holds the
    same values as its calibrated neighbour, so it gets that range; a Softmax output still without one
    gets [0, 1], the range ORT gives every Softmax output anyway. Returns the tensors given a range.
    """
    import numpy as np
    from onnxruntime.quantization.calibrate import TensorData

    from qdebug.graph.ops import PERMUTATION_OPS
    from qdebug.graph.unshare import value_names

    data = getattr(tensors, "data", tensors)
    old = value_names(before.graph)
    new = [o for n in after.graph.node for o in n.output if o and o not in old and o not in data]
    producer = {o: n for n in after.graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in after.graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    filled: list[str] = []
    changed = True
    while changed:
        changed = False
        for name in new:
            if name in data:
                continue
            p = producer.get(name)
            sources = [p.input[0]] if p is not None and p.op_type in PERMUTATION_OPS and p.input else []
            sources += [
                r.output[0] for r in readers.get(name, []) if r.op_type in PERMUTATION_OPS and r.input[0] == name
            ]
            source = next((s for s in sources if s in data), None)
            if source is not None:
                data[name] = copy.deepcopy(data[source])
                filled.append(name)
                changed = True
    for n in after.graph.node:
        if n.op_type == "Softmax" and n.output and n.output[0] and n.output[0] not in data:
            data[n.output[0]] = TensorData(lowest=np.float32(0.0), highest=np.float32(1.0))
            filled.append(n.output[0])
    return filled


LOAD_CHECK_MAX_BYTES = 256 << 20
"""Quantized models with more weight bytes than this are not loaded by :func:`check_quantized_loads`."""


def check_quantized_loads(
    model: onnx.ModelProto,
    quantized: onnx.ModelProto,
    *,
    load: bool = True,
    names: tuple[_Names, _Names] | None = None,
) -> None:
    """Refuse a model ORT's quantizer wrote that ORT cannot load, naming the quantizer and the pattern.

    ``model`` (the normalized FP32 model) loaded for calibration, so a quantized model that does not
    load is the quantizer's doing: the error says so, with what triggered it and the way around it,
    instead of a bare "cannot load" later from whatever step first opens the model. Checked first,
    cheaply and by name: an activation of ``model`` whose name the quantizer gave a weight of its own
    (``QDQQuantizer._dup_initializer``'s copy of a shared bias: the activation's readers then read
    the bias, a model that fails to load -- or, where the shapes happen to broadcast, loads and
    computes garbage), and a tensor name defined twice. Then ORT loads the model with optimizations
    off: a few ms on small models, about 1 s for :data:`LOAD_CHECK_MAX_BYTES` of weights, above which
    (propose builds dozens of variants) only the checks by name run. ``names``: the two models' names, when
    the caller has read them already (:class:`_Names`).
    """
    before, after = names if names is not None else (_Names(model), _Names(quantized))
    clash = _activations_taken_by_weights(before, after) or after.defined_twice() - before.defined_twice()
    if clash:
        raise _invalid_quantized_model(model, quantized, sorted(clash), None)
    if not load:  # before the sum: ``t.raw_data`` copies each weight's bytes out of the protobuf
        return
    weights = sum(len(t.raw_data) or 4 * len(t.float_data) for t in quantized.graph.initializer)
    if weights > LOAD_CHECK_MAX_BYTES:
        return
    error = _ort_load_error(quantized)
    if error is None or _ort_load_error(model) is not None:  # the FP32 model fails too: not the quantizer's
        return
    raise _invalid_quantized_model(model, quantized, [], error)


class _Names:
    """A model's top-level names, read off the protobuf once: graph inputs, initializers, every node output
    in order (empty ones included) and each output's producer (the last node writing it; not read with
    ``producers=False``). Reading a field of a protobuf message from Python is most of what qdebug's checks
    around ORT's quantizer cost (11,200 nodes and 16,400 initializers in a 3,200-node build), so each model
    is read once for all of them."""

    __slots__ = ("inputs", "initializers", "written", "producer")

    def __init__(self, model: onnx.ModelProto, producers: bool = True) -> None:
        graph = model.graph
        self.inputs = [i.name for i in graph.input]
        self.initializers = [t.name for t in graph.initializer]
        self.written: list[str] = []
        self.producer: dict[str, Any] = {}
        for node in graph.node:
            outputs = list(node.output)
            self.written.extend(outputs)
            if producers:
                for name in outputs:
                    self.producer[name] = node

    @classmethod
    def of(cls, model: onnx.ModelProto, read: Any = None) -> _Names:
        """``_Names(model)``, taken from what the quantizer's index check read off ``model`` where it hands
        that over (``read``: :class:`~qdebug.quant.fast_quantize.GraphNames`; 35 ms less at 3,200 nodes)."""
        if read is None or read.written is None or read.producer is None or read.initializers is None:
            return cls(model)
        names = cls.__new__(cls)
        names.inputs = [i.name for i in model.graph.input]
        names.initializers = list(read.initializers)
        names.written = read.written
        names.producer = read.producer
        return names

    def defined_twice(self) -> set[str]:
        """Tensor names the main graph defines more than once (graph inputs, initializers, node outputs)."""
        from collections import Counter

        defs = Counter([*self.inputs, *self.initializers, *(o for o in self.written if o)])
        return {name for name, k in defs.items() if k > 1}


class _Facts:
    """What :func:`quantize_static_model` reads of its input model before each build -- its node names, its
    :class:`_Names` (without producers: nothing here holds the model's nodes) and its float16 exclusions,
    read on first use -- a function of the model's content alone: propose and verify build tens of variants
    of one normalized model (25 ms a build at 3,200 nodes), so they are kept for the latest content key."""

    __slots__ = ("node_names", "names", "_half")

    def __init__(self, model: onnx.ModelProto) -> None:
        self.node_names = frozenset(n.name for n in model.graph.node)
        self.names = _Names(model, producers=False)
        self._half: list[str] | None = None

    def float16_exclusions(self, model: onnx.ModelProto) -> list[str]:
        """:func:`float16_exclusions` of the model (its refusal is raised each time, never kept)."""
        if self._half is None:
            self._half = float16_exclusions(model)
        return list(self._half)


_FACTS: dict[bytes, _Facts] = {}
_FACTS_LOCK = threading.Lock()


def _facts(model: onnx.ModelProto, key: bytes | None) -> _Facts:
    """``model``'s :class:`_Facts`, kept for its content ``key`` (None: read afresh, not kept)."""
    if key is None:
        return _Facts(model)
    with _FACTS_LOCK:
        kept = _FACTS.get(key)
    if kept is None:
        kept = _Facts(model)
        with _FACTS_LOCK:
            _FACTS.clear()
            _FACTS[key] = kept
    return kept


def _activations_taken_by_weights(model: _Names, quantized: _Names) -> set[str]:
    """Activations of ``model`` that ``quantized`` has a weight named like (``T`` or ``T_quantized``)."""
    weights = set(model.initializers)
    activations = {o for o in model.written if o and o not in weights}
    added = set(quantized.initializers) - weights
    return {a for a in activations if a in added or f"{a}_quantized" in added}


def _ort_load_error(model: onnx.ModelProto) -> str | None:
    """ORT's first error line when it cannot load ``model`` (CPU, optimizations off), else None."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1  # the session never runs
    opts.add_session_config_entry("session.disable_prepacking", "1")
    try:
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        text = str(e).strip()
        return text.splitlines()[0] if text else e.__class__.__name__
    return None


def _invalid_quantized_model(
    model: onnx.ModelProto, quantized: onnx.ModelProto, twice: list[str], error: str | None
) -> QDebugError:
    """The error for a quantized model ORT cannot load: which quantizer pattern made it, and the way out."""
    import re
    from collections import Counter

    inits = {t.name for t in model.graph.initializer}
    producer = {o: n.name for n in model.graph.node for o in n.output}
    readers: Counter[str] = Counter(t for n in model.graph.node for t in n.input)
    for name in twice:
        base = next(
            (b for b in inits if name.startswith(b) and name[len(b) :].isdigit() and readers[b] > 1), None
        )
        if base is None:
            continue
        owner = f"the output of node {producer[name]!r}" if name in producer else "the name of another tensor"
        return QDebugError(
            f"ONNX Runtime's quantizer wrote an invalid model: it copied the initializer {base!r} that several "
            f"nodes share as {name!r} (QDQQuantizer._dup_initializer checks only initializer names), but "
            f"{name!r} is {owner}, whose readers it rewired to the copy",
            "give every node reading a shared bias (Conv, Gemm...) its own copy under a name no tensor has before "
            "quantizing: qdebug's normalization does (qdebug.graph.unshare.unshare_biases), and "
            "qdebug.graph.unshare.snippet() gives the lines for your own quantize_static call",
            ExitCode.MODEL,
        )
    if twice:
        return QDebugError(
            "ONNX Runtime's quantizer wrote an invalid model: it gives tensor(s) "
            f"{', '.join(repr(n) for n in twice[:3])} a second definition",
            "keep the nodes that write or read them out of quantization (nodes_to_exclude) and report the "
            "model to qdebug",
            ExitCode.MODEL,
        )
    node = re.search(r"Node \(([^)]*)\) Op \(([^)]*)\)", error or "")
    where = f" at node {node.group(1)!r} ({node.group(2)})" if node else ""
    return QDebugError(
        f"ONNX Runtime's quantizer wrote a model ORT cannot load{where} although the FP32 model loads: "
        f"{(error or '')[:300]}",
        "this is a bug in ORT's quantizer: keep the node named here and its neighbours out of quantization "
        "(nodes_to_exclude), and report the model to qdebug",
        ExitCode.MODEL,
    )


def _exact_passthrough_outputs(model: onnx.ModelProto, names: _Names | None = None) -> None:
    """A graph output that is an ``Identity`` of a graph input reads the input itself again.

    ORT rewires *every* reader of a quantized tensor to its DequantizeLinear output, the Identity that
    passes a graph input through to an output included (normalization adds one for an input listed as an
    output): the output then left the model quantized (54 dB instead of exact). Nothing is computed on
    that path, so nothing of the quantization is lost by reading the input itself. ``names``: the model's,
    read already (:class:`_Names`).
    """
    names = names if names is not None else _Names(model)
    inputs = set(names.inputs)
    producer = names.producer
    outputs = {o.name for o in model.graph.output}
    writers = {id(producer[o]): producer[o] for o in outputs if o in producer}  # the nodes writing an output
    for node in writers.values():
        if node.op_type != "Identity" or node.output[0] not in outputs:
            continue
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in inputs:
            node.input[0] = q.input[0]


_ORT_SUFFIXES = ("_QuantizeLinear_Output", "_DequantizeLinear_Output", "_QuantizeLinear_Input", "_quantized")
"""Names ORT's quantizer gives the tensors it adds for tensor ``T`` (``T`` + suffix)."""


def _refuse_nan_outputs(
    model: onnx.ModelProto, ranges: Ranges, seen: dict[str, tuple[float, float]] | None = None
) -> None:
    """Stop before quantizing a model whose FP32 outputs were entirely NaN during calibration.

    ORT's quantizer would fail later on with "scale issue"; the cause is the FP32 model (e.g. an attention
    mask computed as ``(1 - mask) * -inf``: 0 * inf is NaN), which no quantization setting fixes.
    ``seen``: ``ranges.minmax()``, when the caller has it.
    """
    seen = ranges.minmax() if seen is None else seen
    nan = [o.name for o in model.graph.output if o.name in seen and any(math.isnan(v) for v in seen[o.name])]
    if nan:
        raise QDebugError(
            f"the FP32 model computes NaN for output(s) {', '.join(nan[:3])} on the calibration data",
            "fix the model: e.g. an attention mask of (1 - mask) * -inf is NaN where mask is 1 (0 * inf); "
            "use a large negative number such as -1e4, or Where(mask, scores, -inf)",
            ExitCode.MODEL,
        )


def _refuse_reserved_names(model: onnx.ModelProto, names: _Names | None = None) -> None:
    """A tensor already named like one ORT's quantizer will add (``x_DequantizeLinear_Output`` next to a
    tensor ``x``) makes it write a model with two definitions of that name, which ORT then refuses with
    "check the model with onnx.checker". Said plainly, before quantizing."""
    read = names if names is not None else _Names(model)
    defined = {*read.inputs, *read.initializers, *(o for o in read.written if o)}
    suffixed = [n for n in defined if n.endswith(_ORT_SUFFIXES)]  # one call per name; most end otherwise
    clash = sorted(
        n for n in suffixed for suffix in _ORT_SUFFIXES if n.endswith(suffix) and n[: -len(suffix)] in defined
    )
    if clash:
        raise QDebugError(
            f"tensor name(s) {clash[:3]} are the names ORT's quantizer gives its own Q/DQ tensors, so the "
            "quantized model would define them twice",
            "rename those tensors in the model to names without these suffixes, then re-run",
            ExitCode.MODEL,
        )


def nonfinite_range_exclusions(
    model: onnx.ModelProto, ranges: Ranges, seen: dict[str, tuple[float, float]] | None = None
) -> tuple[list[str], list[str]]:
    """(nodes every static variant must exclude, tensors why): the producers and consumers of tensors whose
    calibrated range is not finite.

    An attention mask written with ``-inf`` (``masked_fill``, ``Where(mask, scores, -inf)``) or a division
    by zero gives a tensor an infinite range: ORT's quantizer then asserts ("scale issue") or writes an
    infinite scale that turns the tensor into NaN. Keeping the nodes around it in FP32 is what a user of
    ORT has to do too; the analysis says so in a note.
    """
    seen = ranges.minmax() if seen is None else seen
    bad = sorted(n for n, (lo, hi) in seen.items() if not (math.isfinite(lo) and math.isfinite(hi)))
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
    if not any(t in _HALF_TYPES for t in types.values()):
        return []  # the common case, without reading every node
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
    from qdebug.quant.calibrate import op_types_to_quantize

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


def _refuse_unknown_exclusions(spec: QuantSpec, names: Collection[str]) -> None:
    """Refuse ``nodes_to_exclude`` naming nodes not in the model: ORT would silently ignore them."""
    unknown = [n for n in spec.nodes_to_exclude if n not in names]
    if unknown:
        raise QDebugError(
            f"nodes_to_exclude names {len(unknown)} node(s) not in the model: {unknown[:5]}",
            "use node names from the qdebug report (normalized names)",
            ExitCode.INPUT,
        )


def quantize_model(
    model: onnx.ModelProto,
    ranges: Ranges,
    spec: QuantSpec,
    out_path: Path | None = None,
    *,
    load_check: bool = True,
) -> onnx.ModelProto:
    """The model ``spec.quantizer`` says ORT builds: :func:`quantize_static_model` for ``static``;
    ``quantize_dynamic`` of ``model`` for ``dynamic``; for ``mixed`` the static QDQ model of every op type
    but :data:`~qdebug.vocabulary.DYNAMIC_OPS`, then ``quantize_dynamic`` of it on those. ``nodes_to_exclude``
    are excluded by every pass; tensor overrides reach the static pass only (``quantize_dynamic`` reads
    none)."""
    if spec.quantizer == "static":
        return quantize_static_model(model, ranges, spec, out_path, load_check=load_check)
    import tempfile

    from qdebug.vocabulary import DYNAMIC_OPS

    _refuse_unknown_exclusions(spec, {n.name for n in model.graph.node})
    first, ops = model, None
    if spec.quantizer == "mixed":
        static_ops = tuple(op for op in spec.quantized_op_types() if op not in DYNAMIC_OPS)
        first = quantize_static_model(
            model, ranges, dataclasses.replace(spec, quantizer="static", op_types=static_ops), load_check=False
        )
        ops = [op for op in DYNAMIC_OPS if op != "Gemm"]  # quantize_dynamic turns each Gemm into a MatMul
    with tempfile.TemporaryDirectory(prefix="qdebug-dynamic-") as tmp:
        src = Path(tmp) / "input.onnx"
        save_model(first, src)
        built = quantize_dynamic_model(
            src,
            out_path,
            op_types=ops,
            per_channel=spec.per_channel,
            nodes_to_exclude=spec.excluded(),
            reduce_range=spec.reduce_range,
        )
    if load_check:
        check_quantized_loads(model, built)
    return built


def quantize_dynamic_model(
    model_path: Path,
    out_path: Path | None = None,
    *,
    op_types: Sequence[str] | None = None,
    per_channel: bool = False,
    nodes_to_exclude: Sequence[str] = (),
    reduce_range: bool = False,
) -> onnx.ModelProto:
    """Dynamic quantization (QInt8 weights, activations quantized at run time): the model ORT's
    ``quantize_dynamic`` writes, byte for byte, run over qdebug's indexed model where the sources it relies
    on are the verified ones (:mod:`qdebug.quant.fast_quantize`; ORT's own function is quadratic in the node
    count: 7.7 s of a 25 s propose on 3,200 nodes). Written to ``out_path`` when given; returned either way
    (on the fast path without a write and a read-back when there is no ``out_path``). Where this ORT cannot run
    the ConvInteger nodes its ``quantize_dynamic`` writes (:func:`int8_conv_integer_runs`), its default op types
    less Conv (:func:`dynamic_conv_note`)."""
    from qdebug.quant import fast_quantize

    if op_types is None and not int8_conv_integer_runs():
        from onnxruntime.quantization.registry import IntegerOpsRegistry

        op_types = [op for op in IntegerOpsRegistry if op != "Conv"]  # dynamic_conv_note says so
    opts = _Dynamic(op_types, per_channel, nodes_to_exclude, reduce_range)
    try:
        with quiet_ort_logging(), collector_paused():
            if fast_quantize.use_fast_path("dynamic quantizer"):
                try:
                    return _dynamic_indexed(Path(model_path), out_path, opts)
                except fast_quantize.IndexOutOfStep as e:
                    fast_quantize.note(
                        f"ORT's dynamic quantizer was run again on its plain path (quadratic in the node count): "
                        f"qdebug's index of the graph fell out of step with it ({e}); please report this model"
                    )
            return _dynamic_plain(Path(model_path), out_path, opts)
    except Exception as e:
        raise QDebugError(
            f"ONNX Runtime's dynamic quantizer failed ({e.__class__.__name__}: {str(e)[:200]})",
            "restrict the op types with --dynamic-ops MatMul",
            ExitCode.MODEL,
        ) from None


_CONV_INTEGER_RUNS: list[bool] = []


def int8_conv_integer_runs() -> bool:
    """Whether this ORT's CPU provider runs ``ConvInteger`` on uint8 inputs and int8 weights -- what its
    ``quantize_dynamic`` writes for a Conv by default. ORT 1.20 to 1.23 have a uint8-weight kernel only, so
    their own dynamic model of a CNN does not load there. Asked of ORT once per process (a one-node session)."""
    if not _CONV_INTEGER_RUNS:
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        weight = numpy_helper.from_array(np.ones((1, 1, 1, 1), np.int8), "w")
        graph = helper.make_graph(
            [helper.make_node("ConvInteger", ["x", "w"], ["y"])],
            "conv_integer_probe",
            [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 1, 2, 2])],
            [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
            [weight],
        )
        probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 10)])
        probe.ir_version = 8
        try:
            ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
            _CONV_INTEGER_RUNS.append(True)
        except Exception:  # NOT_IMPLEMENTED: no kernel for this type combination
            _CONV_INTEGER_RUNS.append(False)
    return _CONV_INTEGER_RUNS[0]


def run_time_quantizable(model: onnx.ModelProto) -> list[str]:
    """The nodes qdebug's dynamic recipe (``quantize_dynamic`` with its default op types) quantizes, in graph
    order: what "most nodes kept FP32" counts against for a dynamic model, whose other nodes stay float."""
    from qdebug.vocabulary import RUN_TIME_OPS

    inits = {t.name for t in model.graph.initializer}
    ops = {*RUN_TIME_OPS, *(("Conv",) if int8_conv_integer_runs() else ())}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in ops and (n.op_type != "Gather" or (bool(n.input) and n.input[0] in inits))
    ]


def dynamic_conv_note(model: onnx.ModelProto, op_types: Sequence[str] | None = None) -> str | None:
    """The note for a dynamic model of ``model`` built with ORT's default op types where
    :func:`int8_conv_integer_runs` is False and ``model`` has Conv nodes (None otherwise)."""
    if op_types or int8_conv_integer_runs() or not any(n.op_type == "Conv" for n in model.graph.node):
        return None
    import onnxruntime

    return (
        f"onnxruntime {onnxruntime.__version__} has no ConvInteger kernel for int8 weights (newer releases "
        "have one), so the dynamic model keeps its Conv nodes float: quantize_dynamic's own default would "
        "write a model this onnxruntime cannot load"
    )


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while ORT's quantizer runs (and back on after, as it was).

    The quantizer allocates a few small objects per node and tensor -- numpy scalars, protobuf wrappers,
    dicts -- none of them in reference cycles worth collecting, and every few hundred allocations the
    collector walks the process's live objects: 12-15 % of a 3,200-node per-channel build, with few or a
    million other live objects (``benchmarks/bench_collector.py``, docs/benchmarks.md). Whatever cyclic garbage
    the call leaves is collected once the collector is back.

    The block must end after the quantizer's objects are released: the first allocation once the collector
    is back runs a collection over every young object still alive, and a quantizer still referenced is
    ~160,000 of them (24 ms at 3,200 nodes; once it is freed, a few hundred are left).
    So the callers wrap the call that holds the quantizer, not the block inside it.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class _Dynamic:
    """``quantize_dynamic``'s options qdebug sets (INT8 weights always)."""

    op_types: Sequence[str] | None
    per_channel: bool
    nodes_to_exclude: Sequence[str] = ()
    reduce_range: bool = False


def _dynamic_plain(model_path: Path, out_path: Path | None, opts: _Dynamic) -> onnx.ModelProto:
    import tempfile

    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(prefix="qdebug-dynamic-") as tmp:
        path = out_path if out_path is not None else Path(tmp) / "dynamic.onnx"
        quantize_dynamic(
            str(model_path),
            str(path),
            op_types_to_quantize=list(opts.op_types) if opts.op_types else None,
            per_channel=opts.per_channel,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(opts.nodes_to_exclude) or None,
            reduce_range=opts.reduce_range,
        )
        return onnx.load(str(path))


def _dynamic_indexed(model_path: Path, out_path: Path | None, opts: _Dynamic) -> onnx.ModelProto:
    """The body of ORT's ``quantize_dynamic`` (its source is among the verified ones) with the quantizer
    over an :class:`~qdebug.quant.fast_quantize.IndexedModel`; raises ``IndexOutOfStep`` before writing anything
    if the index and the graph disagree at the end. Without ``out_path`` the model is returned as ORT's
    ``save_model_to_file`` would write it (verified source too), without the write."""
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.quant_utils import (
        QuantizationMode,
        load_model_with_shape_infer,
        update_opset_version,
    )
    from onnxruntime.quantization.registry import IntegerOpsRegistry

    from qdebug.quant import fast_quantize

    ops = list(opts.op_types) if opts.op_types else list(IntegerOpsRegistry.keys())
    with fast_quantize.installed():
        model = update_opset_version(load_model_with_shape_infer(model_path), QuantType.QInt8)
        quantizer = fast_quantize.indexed(ONNXQuantizer)(
            model,
            opts.per_channel,
            opts.reduce_range,
            QuantizationMode.IntegerOps,
            False,  # static
            QuantType.QInt8,
            QuantType.QUInt8,  # dynamic activations are uint8
            None,
            [],
            list(opts.nodes_to_exclude),
            ops,
            {"MatMulConstBOnly": True},
        )
        quantizer.quantize_model()
        if isinstance(quantizer.model, fast_quantize.IndexedModel):
            quantizer.model.check_in_step()
        if out_path is not None:
            quantizer.model.save_model_to_file(str(out_path), False)
        else:  # what save_model_to_file does before onnx.save_model
            quantizer.model.topological_sort()
            for init in quantizer.model.model.graph.initializer:
                quantizer.model._check_init(init, "end")
        return quantizer.model.model
