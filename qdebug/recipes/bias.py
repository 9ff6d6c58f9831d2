"""Empirical bias correction (Nagel et al. 2019, section 4.2): cancel the mean shift quantization adds.

Rounding a layer's weights shifts the mean of its output channels: ``E[W_q x] - E[W x] = eps E[x]``. The
shift is measured on calibration data, per output channel, and subtracted from the layer's bias:
``b' = b - (mean_q - mean_fp32)`` (:func:`correct_bias`). Quantizing the corrected FP32 model then gives a
QDQ model whose layer means match FP32's.

Which two means: :func:`bias_probe` adds to the QDQ model, next to each corrected layer, the FP32 layer
reading the same quantized input, so ``mean_q - mean_fp32`` is the layer's own shift. Comparing the FP32
model with the QDQ model end to end instead counts each upstream layer's shift again in every layer below
it; corrected in one pass, those corrections add up (a Conv -> Relu -> Conv -> Gemm test net's output mean
error doubles instead of shrinking). With the local shift one pass is enough, as in the paper.

What the probe measures is the quantized layer computed in float on dequantized weights and inputs: a
layer whose output is read as a graph output is not fused by ORT into its integer kernel. That is exactly
what VNNI and ARM integer kernels compute (up to float rounding), not what AVX2-only x86 CPUs do where a
u8s8 pair sum saturates its int16 (8-bit weights near +-127 on uint8 inputs near 255): such a layer's
extra shift is not seen, nor corrected. Quantizing with 7-bit weights (``reduce_range``) rules it out.

This is no equivalence transform: the corrected FP32 model computes other outputs than the user's, on
purpose, and only its quantized model is meant to be deployed. Nothing checks it against the FP32 outputs.

The layers corrected: a Conv (its bias input), a Gemm (its C input), and a MatMul whose output only a bias
Add with a constant per-channel bias reads (the Add's constant). A Conv or Gemm without a bias gets one
(the correction alone) under a fresh initializer name.

Measuring the QDQ model: ORT's ``quantize_static`` (QDQ format) keeps every original node and its name,
but not always its output's name. A float tensor read by a quantized op keeps its name as the
QuantizeLinear's input (its readers read ``<name>_DequantizeLinear_Output``); a graph output is renamed
``<name>_QuantizeLinear_Input`` (the DequantizeLinear then writes ``<name>``); and a Conv/Gemm/Add whose
only reader is a Relu or Clip loses that activation, its output taking the activation's name (the Q/DQ
after it clamps instead). In every case the output of the node of the same name in the QDQ model is the
layer's output computed from quantized weights and inputs, before its own output is quantized -- the
value whose mean is compared. :func:`quantized_tensors` makes that pairing, by node, never by name suffix;
the FP32 name itself is gone from the QDQ model for a layer that lost its Relu, and names the dequantized
value for a graph output.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from qdebug.recipes.base import Transformed
from qdebug.recipes.stats import Graph, as_float

NAMES_SHOWN = 5
"""Nodes a note names before it says how many more."""


@dataclass(frozen=True)
class _Target:
    """A layer whose bias can be corrected."""

    node: str
    """The node whose bias input changes (a Conv, a Gemm, or a MatMul's bias Add)."""
    tensor: str
    """Its output: the tensor whose per-channel mean is measured."""
    bias: str | None
    """The bias initializer (None: the node has none; a zero one is added)."""
    scale: float
    """What the bias is multiplied by in the node (a Gemm's ``beta``; 1 elsewhere)."""


def bias_correction_tensors(model: onnx.ModelProto) -> dict[str, str]:
    """The layers :func:`correct_bias` can correct: node name -> the output tensor whose mean it needs."""
    targets, _ = _targets(Graph(model))
    return {t.node: t.tensor for t in targets}


def quantized_tensors(fp32: onnx.ModelProto, qdq: onnx.ModelProto, tensors: Iterable[str]) -> dict[str, str]:
    """FP32 tensor name -> the QDQ model's tensor holding the same layer's output (module doc).

    Paired by the producing node's name and op type, which ORT's quantizer keeps; a tensor whose node the
    QDQ model lacks is left out (its layer is then not corrected, with a note).
    """
    made = {o: n for n in fp32.graph.node for o in n.output[:1] if o}
    nodes = {n.name: n for n in qdq.graph.node if n.name}
    pairs: dict[str, str] = {}
    for tensor in tensors:
        node = made.get(tensor)
        twin = nodes.get(node.name) if node is not None and node.name else None
        if twin is not None and twin.op_type == node.op_type and twin.output and twin.output[0]:
            pairs[tensor] = twin.output[0]
    return pairs


@dataclass(frozen=True)
class BiasProbe:
    """A QDQ model that also computes, next to each corrected layer, the FP32 layer on the same input.

    ``reference`` minus ``quantized`` is the layer's own mean shift (its rounded weights and bias, Nagel's
    ``E[eps x]``), without the shift its quantized input brings from upstream layers: corrected in one pass,
    every upstream correction would otherwise be counted again downstream (a Conv -> Relu -> Conv -> Gemm
    net measured end to end ends up with twice the output mean error it started with).
    """

    model: onnx.ModelProto
    quantized: Mapping[str, str]
    """FP32 output tensor -> the QDQ model's tensor of that layer's output (before its own Q/DQ)."""
    reference: Mapping[str, str]
    """FP32 output tensor -> the added FP32 copy of the layer's output, read from the QDQ model's input."""

    def tensors(self) -> list[str]:
        """Every tensor to measure, sorted."""
        return sorted({*self.quantized.values(), *self.reference.values()})


def bias_probe(fp32: onnx.ModelProto, qdq: onnx.ModelProto) -> BiasProbe:
    """``qdq`` (the QDQ model of ``fp32``, untouched) plus, after each layer :func:`bias_correction_tensors`
    names, a copy of the FP32 layer (FP32 weight and bias) reading the quantized layer's own inputs.

    Measure both with :func:`~qdebug.recipes.stats.channel_stats` and pass the reference means as
    ``fp32_mean`` and the quantized ones as ``quant_mean`` to :func:`correct_bias`. A layer whose node the
    QDQ model lacks is left out.
    """
    graph = Graph(fp32)
    targets, _ = _targets(graph)
    out = onnx.ModelProto()
    out.CopyFrom(qdq)
    taken = _all_names(qdq) | _all_names(fp32)
    twins = {n.name: n for n in out.graph.node if n.name}
    pairs = quantized_tensors(fp32, qdq, [t.tensor for t in targets])
    added: dict[str, list[onnx.NodeProto]] = {}
    reference: dict[str, str] = {}
    for t in targets:
        layer = graph.producer[t.tensor]
        chain = [graph.producer[_other_input(layer, t.bias)], layer] if layer.op_type == "Add" else [layer]
        if t.tensor not in pairs or any(n.name not in twins or twins[n.name].op_type != n.op_type for n in chain):
            continue
        nodes = _reference_chain(out, graph, chain, twins, taken)
        added.setdefault(twins[layer.name].name, []).extend(nodes)
        reference[t.tensor] = nodes[-1].output[0]
    order = [n for node in out.graph.node for n in (node, *added.get(node.name, []))]
    del out.graph.node[:]
    out.graph.node.extend(order)
    return BiasProbe(out, {k: v for k, v in pairs.items() if k in reference}, reference)


def _other_input(node: onnx.NodeProto, name: str | None) -> str:
    """The input of a binary ``node`` that is not ``name``."""
    return node.input[1] if node.input[0] == name else node.input[0]


def _reference_chain(
    probe: onnx.ModelProto,
    graph: Graph,
    chain: list[onnx.NodeProto],
    twins: Mapping[str, onnx.NodeProto],
    taken: set[str],
) -> list[onnx.NodeProto]:
    """Copies of the FP32 nodes ``chain`` (a layer, or a MatMul and its bias Add) reading the QDQ twin's
    activation input and the FP32 constants (added to ``probe`` under fresh names)."""
    made: list[onnx.NodeProto] = []
    for node in chain:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = _fresh(f"{node.name}.fp32_reference", taken)
        for i, name in enumerate(node.input):
            if name in graph.inits:
                constant = onnx.TensorProto()
                constant.CopyFrom(graph.inits[name])
                constant.name = _fresh(f"{name}.fp32_reference", taken)
                probe.graph.initializer.append(constant)
                copy.input[i] = constant.name
            elif made and graph.producer.get(name) is chain[0]:  # the bias Add reads the MatMul's copy
                copy.input[i] = made[-1].output[0]
            else:
                copy.input[i] = twins[node.name].input[i]
        del copy.output[1:]
        copy.output[0] = _fresh(f"{node.output[0]}.fp32_reference", taken)
        made.append(copy)
    return made


def correct_bias(
    model: onnx.ModelProto,
    fp32_mean: Mapping[str, np.ndarray],
    quant_mean: Mapping[str, np.ndarray],
) -> Transformed:
    """A copy of ``model`` whose layer biases are shifted by ``-(quant_mean - fp32_mean)`` per channel.

    Both mappings are keyed by the FP32 tensor names :func:`bias_correction_tensors` gives; measure them
    through :func:`bias_probe` (``reference`` -> ``fp32_mean``, ``quantized`` -> ``quant_mean``). The FP32
    outputs change on purpose: no
    equivalence check applies (module doc). A layer without both means, or whose means do not match its
    bias's channel count, is left alone, with a note.
    """
    graph = Graph(model)
    targets, skipped = _targets(graph)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name: t for t in out.graph.initializer}
    nodes = {n.name: n for n in out.graph.node}
    taken = _all_names(model)
    changed: list[str] = []
    for t in targets:
        fm, qm = as_float(fp32_mean, t.tensor), as_float(quant_mean, t.tensor)
        if fm is None or qm is None or fm.shape != qm.shape:
            skipped.append(("its output's mean was not measured on both models", t.node))
            continue
        shift = (qm - fm) / t.scale
        if not np.all(np.isfinite(shift)):
            skipped.append(("its measured mean shift is not finite", t.node))
            continue
        if t.bias is None:
            _add_bias(out, nodes[t.node], graph, shift, taken)
        elif not _shift_bias(inits[t.bias], shift):
            skipped.append(("its bias has another channel count than its output", t.node))
            continue
        changed.append(t.node)
    notes = [f"bias correction shifted {len(changed)} layer bias(es) by the quantized model's mean error"]
    notes = notes if changed else []
    notes.extend(_skip_notes(skipped))
    return Transformed(model=out, changed=tuple(changed), notes=tuple(notes))


def _targets(graph: Graph) -> tuple[list[_Target], list[tuple[str, str]]]:
    """Every correctable layer in graph order, and every candidate (a Conv/Gemm/MatMul with a constant
    weight) left alone, with why."""
    targets: list[_Target] = []
    skipped: list[tuple[str, str]] = []
    for node in graph.graph.node:
        if node.op_type not in ("Conv", "Gemm", "MatMul") or len(node.input) < 2 or node.input[1] not in graph.inits:
            continue
        found = _matmul_target(graph, node) if node.op_type == "MatMul" else _own_bias_target(graph, node)
        if isinstance(found, str):
            skipped.append((found, node.name))
        else:
            targets.append(found)
    return targets, skipped


def _own_bias_target(graph: Graph, node: onnx.NodeProto) -> _Target | str:
    """A Conv's or Gemm's bias input (input 2), or why it cannot be corrected."""
    scale = float(_attr(node, "beta", 1.0)) if node.op_type == "Gemm" else 1.0
    if scale == 0.0:
        return "its bias is multiplied by beta=0"
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if bias is None:
        return _Target(node.name, node.output[0], None, scale)
    if bias not in graph.inits or not graph.only_reader(bias, node):
        return "its bias is not a constant of its own"
    b = graph.array(bias)
    assert b is not None
    if not np.issubdtype(b.dtype, np.floating) or (b.size != 1 and b.size != b.shape[-1]):
        return "its bias is not one value per output channel"
    return _Target(node.name, node.output[0], bias, scale)


def _matmul_target(graph: Graph, node: onnx.NodeProto) -> _Target | str:
    """A MatMul's bias Add (its only reader, adding a constant per-channel vector), or why there is none."""
    readers = graph.readers.get(node.output[0], [])
    add = readers[0][0] if len(readers) == 1 else None
    if add is None or add.op_type != "Add" or node.output[0] in graph.outputs or len(add.input) != 2:
        return "no bias Add follows it alone (add one to the model to have it corrected)"
    bias = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    b = graph.array(bias)
    if b is None or not graph.only_reader(bias, add) or not np.issubdtype(b.dtype, np.floating):
        return "its bias Add does not add a constant of its own"
    if b.size != 1 and (b.size != b.shape[-1]):
        return "its bias Add's constant is not one value per output channel"
    return _Target(add.name, add.output[0], bias, 1.0)


def _shift_bias(tensor: onnx.TensorProto, shift: np.ndarray) -> bool:
    """Subtract ``shift`` from bias initializer ``tensor`` in place (a scalar bias becomes per-channel,
    rank kept); False when the channel counts differ."""
    b = onnx.numpy_helper.to_array(tensor)
    if b.size == 1 and shift.shape[0] != 1:
        b = np.full((*b.shape[:-1], shift.shape[0]) if b.ndim else (shift.shape[0],), b.reshape(-1)[0], b.dtype)
    if b.shape[-1:] != shift.shape:
        return False
    new = (b.astype(np.float64) - shift).astype(b.dtype)
    tensor.CopyFrom(onnx.numpy_helper.from_array(new, tensor.name))
    return True


def _add_bias(
    model: onnx.ModelProto, node: onnx.NodeProto, graph: Graph, shift: np.ndarray, taken: set[str]
) -> None:
    """Give ``node`` (a Conv or Gemm without a bias) the bias ``-shift``, under a fresh initializer name."""
    weight = graph.inits[node.input[1]]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(weight.data_type)
    name = _fresh(f"{node.name}.bias_corrected", taken)
    model.graph.initializer.append(onnx.numpy_helper.from_array((-shift).astype(dtype), name))
    if len(node.input) > 2:
        node.input[2] = name
    else:
        node.input.append(name)


def _all_names(model: onnx.ModelProto) -> set[str]:
    """Every tensor name the graph uses (a new initializer must take none of them)."""
    g = model.graph
    names = {t.name for t in g.initializer} | {v.name for v in (*g.input, *g.output, *g.value_info)}
    for n in g.node:
        names.update(n.input)
        names.update(n.output)
    return names


def _fresh(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``... the first not in ``taken`` (then taken)."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _attr(node: onnx.NodeProto, name: str, default: float) -> float:
    """A float attribute of ``node`` (``default`` when absent)."""
    return next((float(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name == name), default)


def _skip_notes(skipped: list[tuple[str, str]]) -> list[str]:
    """One note per reason a layer was left alone: the count and the first node names."""
    by_reason: dict[str, list[str]] = {}
    for why, node in skipped:
        by_reason.setdefault(why, []).append(node)
    notes = []
    for why, nodes in by_reason.items():
        more = f" and {len(nodes) - NAMES_SHOWN} more" if len(nodes) > NAMES_SHOWN else ""
        notes.append(f"bias correction left {len(nodes)} layer(s) alone, {why}: {', '.join(nodes[:NAMES_SHOWN])}{more}")
    return notes
