"""The notes on how the quantized model was built and what it keeps in float, apart from its measured loss.

What qdebug had ORT's quantizer do (:func:`quantizer_notes`), how the capture ran
(:func:`capture_notes`), what ORT folded or leaves in float by construction
(:func:`folded_activation_notes`, :func:`structure_notes` with :func:`float_weight_notes`), and the size
note verify and bench print for a variant that is largely float weights (:func:`float_size_note`). The
notes that diagnose where the measured error comes from live in :mod:`qdebug.analysis.notes`, which
re-exports these.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import onnx

from qdebug.analysis.measure import LayerErrors
from qdebug.graph.load import PER_CHANNEL_OPSET, WeightBytes, default_opset, weight_bytes
from qdebug.graph.match import is_qdq_model
from qdebug.output.formatting import fmt_size
from qdebug.quant import fast_quantize
from qdebug.quant.calibrate import Ranges
from qdebug.quant.quantize import float16_exclusions, nonfinite_range_exclusions
from qdebug.records import NodeRecord, TensorRecord, folded_into


def folded_activation_notes(nodes: tuple[NodeRecord, ...], tensors: tuple[TensorRecord, ...]) -> list[str]:
    """One note for the activations ORT folded into their producer's output quantization.

    The error of that Q/DQ then shows at the activation (ranked by the summary, but not excludable
    itself), while the producer shows no numbers at all: a walk-through saw a Relu ranked worst and
    propose keep a LayerNormalization the summary never named.
    """
    pairs = [f"{src} -> {act}" for act, src in folded_into(nodes, tensors).items()]
    if not pairs:
        return []
    shown = ", ".join(pairs[:4]) + ("..." if len(pairs) > 4 else "")
    return [
        f"ORT folded {len(pairs)} activation(s) into the quantization of their producer's output ({shown}): "
        "that Q/DQ's error shows at the activation, which cannot be kept FP32 by itself; keep the producer FP32 "
        "to remove it"
    ]


def structure_notes(
    fp32: onnx.ModelProto, qdq: onnx.ModelProto, quantized_nodes: set[str], data_constant_ifs: Collection[str] = ()
) -> list[str]:
    """What ORT's static quantizer leaves in float by construction: subgraphs and recurrent ops.

    ``data_constant_ifs``: the If nodes whose condition reads only inputs that hold one value in the data
    (normalization's note names the input and the value): not said to be computed at run time."""
    notes = []

    def count(graph: onnx.GraphProto, op: str | None = None) -> int:
        total = 0
        for n in graph.node:
            total += op is None or n.op_type == op
            for attr in n.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    total += count(sub, op)
        return total

    q_inside = sum(
        count(sub, "QuantizeLinear")
        for n in qdq.graph.node
        for attr in n.attribute
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
    )
    constants = {i.name for i in fp32.graph.initializer}
    for node in fp32.graph.node:
        subs = [
            (attr.name, sub)
            for attr in node.attribute
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
        ]
        if not subs:
            continue
        inner = sum(count(g) for _, g in subs)
        if q_inside == 0:
            extra = ""
            if node.op_type == "If" and node.input and node.input[0] in constants:
                extra = "; its condition is a constant: --inline-constant-if inlines the taken branch"
            elif node.op_type == "If" and node.name in data_constant_ifs:
                extra = (
                    "; its condition reads only inputs that hold one value in your data: --inline-constant-if "
                    "inlines the branch that value takes"
                )
            elif node.op_type == "If":
                extra = (
                    "; its condition is computed at run time, so it cannot be inlined"
                    " (with a constant condition, --inline-constant-if inlines the taken branch)"
                )
            notes.append(
                f"{node.op_type} node {node.name} holds {inner} node(s) in {', '.join(a for a, _ in subs)} "
                f"that stay FP32: ORT's quantizer inserts no QuantizeLinear/DequantizeLinear inside subgraphs{extra}; "
                "their tensors are listed in not_captured"
            )
    return notes + float_weight_notes(fp32, qdq, quantized_nodes)


RECURRENT_OPS = ("LSTM", "GRU", "RNN")
RECURRENT_START = "recurrent node(s)"
FLOAT_WEIGHTS_START = "the quantized model keeps"
"""Ops ORT's static (QDQ) quantizer never quantizes; ``quantize_dynamic`` has an integer LSTM only."""

FLOAT_WEIGHT_SHARE = 0.1
"""Float weights of nodes other than the recurrent ones are named when they hold this share of the model's
weights: below it, what stays float does not change the model's size or speed much."""


def float_weight_notes(fp32: onnx.ModelProto, qdq: onnx.ModelProto, quantized_nodes: set[str]) -> list[str]:
    """Which big ops the quantized model keeps in float, and how much of the model's weights that is.

    A CNN+LSTM reader's static QDQ model keeps its LSTM in float (ORT quantizes no LSTM in QDQ), and with
    it half the model's weight bytes: the summary had named the LSTM but not what it weighs, so the
    quantized model's size read as "quantized". Bytes are what the report can say without timing; how
    much of the run time the float ops take is ``qdebug bench``'s to measure.
    """
    before, after = weight_bytes(fp32), weight_bytes(qdq)
    if not before.total:
        return []
    notes = []
    rnn = [n for n in fp32.graph.node if n.op_type in RECURRENT_OPS and n.name not in quantized_nodes]
    if rnn:
        held = sum(after.of(n.name) for n in rnn)
        names = ", ".join(f"{n.name} ({n.op_type})" for n in rnn)
        each = [f"{n.name} {fmt_size(after.of(n.name))}" for n in rnn if after.of(n.name)]
        share = (
            f" and keep {fmt_size(held)} of the model's {fmt_size(before.total)} of weights float "
            f"({held / before.total:.0%}{': ' + ', '.join(each) if len(each) > 1 else ''}; "
            f"the quantized model's weights are {fmt_size(after.total)}, "
            f"{fmt_size(after.floating)} of them float)"
            if held
            else ""
        )
        notes.append(
            f"{RECURRENT_START} {names} stay FP32{share}: ORT's static quantizer does not quantize "
            "LSTM/GRU/RNN (quantize_dynamic turns LSTM into DynamicQuantizeLSTM, int8 weights); their outputs "
            "are still measured, and the error reaching them comes from the quantized nodes upstream"
        )
    big = [
        (name, op, b)
        for name, op, b in after.by_node
        if op not in RECURRENT_OPS and b >= FLOAT_WEIGHT_SHARE * before.total
    ]
    if big:
        shown = ", ".join(f"{name} ({op}, {fmt_size(b)})" for name, op, b in big[:4])
        kept = sum(b for *_, b in big)
        notes.append(
            f"{FLOAT_WEIGHTS_START} {fmt_size(kept)} of the model's {fmt_size(before.total)} of weights "
            f"float in {shown}{'...' if len(big) > 4 else ''}: those nodes are not quantized (excluded, or an op "
            "ORT's quantizer leaves float), so they add to its size and run float kernels"
        )
    return notes


FLOAT_SIZE_SHARE = 0.25
"""A quantized variant whose weights are at least this share float gets a note naming what stays float."""


def float_size_note(weights: WeightBytes, size: Callable[[int], str] = fmt_size) -> str | None:
    """verify's and bench's note on a quantized variant whose size is largely float weights, or ``None``
    (the caller says which variant; ``size`` writes bytes in its table's unit).

    The size column compares files; a static CNN+LSTM reader is half its FP32 size because the LSTM's
    weights stay float, and nothing had said so ("26 MB of 54 MB stays float" is what the user needs).
    """
    if not weights.total or weights.floating < FLOAT_SIZE_SHARE * weights.total:
        return None
    shown = ", ".join(f"{name} ({op}, {size(b)})" for name, op, b in weights.by_node[:3])
    more = f" and {len(weights.by_node) - 3} more" if len(weights.by_node) > 3 else ""
    why = (
        "; ORT's static quantizer does not quantize LSTM/GRU/RNN (quantize_dynamic has DynamicQuantizeLSTM)"
        if any(op in RECURRENT_OPS for _, op, _ in weights.by_node[:3])
        else ""
    )
    return (
        f"{size(weights.floating)} of its {size(weights.total)} of weights stay float "
        f"({weights.floating / weights.total:.0%}), so its size is not that of a quantized model: "
        f"{shown}{more}{why}"
    )


def quantizer_notes(
    normalized: onnx.ModelProto,
    qproto: onnx.ModelProto,
    ranges: Ranges,
    *,
    per_channel: bool,
    method: str,
    activation_type: str,
) -> list[str]:
    """Notes on how qdebug built the QDQ model from ``normalized`` and its calibrated ``ranges``.

    What ORT's quantizer was made to do differently from a plain ``quantize_static`` call (an opset
    conversion, nodes kept out of quantization) must reach the user, who will call ORT themselves; so must a
    calibration method that is known to clip, reused cached ranges, and a model ORT quantized nothing of.
    """
    notes = []
    if per_channel and default_opset(normalized) < PER_CHANNEL_OPSET:
        notes.append(
            f"per-channel weights need DequantizeLinear's axis (opset {PER_CHANNEL_OPSET}): the quantized model "
            f"was converted from opset {default_opset(normalized)} with onnx.version_converter (ORT would "
            "otherwise write a model it cannot load)"
        )
    half = float16_exclusions(normalized)
    if half:
        notes.append(
            f"kept {len(half)} node(s) that compute in float16 out of quantization ({', '.join(half[:6])}"
            f"{'...' if len(half) > 6 else ''}): ORT's quantizer writes an invalid model (float16 scales) for "
            "them; every qdebug variant excludes them, add them to nodes_to_exclude when you call ORT yourself"
        )
    unbounded, why = nonfinite_range_exclusions(normalized, ranges)
    if unbounded:
        nodes = ", ".join(unbounded[:6]) + ("..." if len(unbounded) > 6 else "")
        tensors = ", ".join(why[:4]) + ("..." if len(why) > 4 else "")
        notes.append(
            f"kept {len(unbounded)} node(s) out of quantization ({nodes}) because tensor(s) they read or "
            f"write have a calibrated range that is not finite ({tensors}: an -inf mask or a division by "
            "zero?): ORT's quantizer fails or writes an infinite scale for them; every qdebug variant "
            "excludes them, add them to nodes_to_exclude when you call ORT yourself"
        )
    if method == "distribution" and activation_type in ("QUInt8", "QInt8"):
        notes.append(
            "--method distribution: ORT's Distribution calibrator is meant for float8 types; with 8-bit "
            "integers its ranges often clip (the CNN fixture: top-1 98 % -> 20 %, the same with ORT's "
            "quantize_static): compare with --method minmax, entropy or percentile"
        )
    if method == "entropy":
        notes.extend(n for n in [entropy_search_note(ranges)] if n)
    notes.extend(fast_quantize.notes())  # ORT's quantizer or calibrator fell back to its plain path
    if ranges.from_cache:
        notes.append(f"calibration ranges reused from cache {ranges.cache_path}")
    if not is_qdq_model(qproto):
        notes.append(
            "ORT inserted no QuantizeLinear/DequantizeLinear nodes: nothing in the main graph was quantized "
            "(is the network inside If/Loop subgraphs?)"
        )
    return notes


def capture_notes(layers: LayerErrors, requested_engine: str, eval_given: bool) -> list[str]:
    """Notes on how the capture ran: a fake-quant view over fewer samples than the main pass, and the numpy
    engine chosen by ``--engine auto`` (slower, and a sign the two models differ in opset or types).

    ``eval_given``: with evaluation data the fake-quant task metric is scored on all of it, so only
    ``accumulated_fakequant`` is limited to the first samples.
    """
    notes = []
    if 0 < layers.fakequant_samples < layers.samples:
        what = "accumulated_fakequant" + ("" if eval_given else ", the fake-quant task metric")
        notes.append(
            f"the fake-quant view ({what}) ran on the first "
            f"{layers.fakequant_samples} of {layers.samples} calibration samples (--fakequant-samples, "
            "rounded up to whole batches)"
        )
    if layers.engine == "numpy" and requested_engine == "auto":
        notes.append(
            "layer capture used the numpy engine (models differ in opset or tensor types are unknown)"
        )
    return notes


ENTROPY_QUANTIZED_BINS = 128
"""The quantized bins ORT's ``create_calibrator`` gives the entropy calibrator (``num_quantized_bins``), and
its default histogram size (``num_bins``): ``quantize_static`` passes neither."""


def entropy_search_note(ranges: Ranges) -> str | None:
    """A note when ORT's entropy calibration searched no threshold: its KL search slides a window of
    ``num_quantized_bins`` bins outward from the histogram's middle, so a histogram of no more bins than
    that (128 and 128, ``quantize_static``'s only setting) tries one candidate, the whole histogram, and
    gives the tensor's min/max range -- minmax's, under another name."""
    data = getattr(ranges.tensors, "data", {})
    flat = [
        k for k, t in data.items() if getattr(t, "hist", None) is not None and t.hist.size <= ENTROPY_QUANTIZED_BINS
    ]
    if not flat:
        return None
    return (
        f"--method entropy searched no clipping threshold on {len(flat)} of {len(data)} tensors: ORT builds "
        f"the entropy calibrator with a {ENTROPY_QUANTIZED_BINS}-bin histogram and {ENTROPY_QUANTIZED_BINS} "
        "quantized bins (quantize_static has no option to change either), so its KL search tries only the whole "
        "histogram and those ranges are the tensors' min/max, as --method minmax gives; for clipped ranges "
        "compare with --method percentile (or ORT's create_calibrator with extra_options num_bins=2048)"
    )
