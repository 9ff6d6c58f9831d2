"""Pair an FP32 model with its dynamic-quantized version by graph structure.

``onnxruntime.quantization.quantize_dynamic`` leaves no Q/DQ pair per tensor
(activations are quantized per batch at run time), so :mod:`qdebug.graph.match`
cannot pair it. Here the integer-op chains it writes are followed instead:
``DynamicQuantizeLinear`` -> ``ConvInteger``/``MatMulInteger`` -> ``Cast`` ->
rescaling ``Mul`` (-> bias ``Add``). ``analyze`` on a dynamic model and the
dynamic variant of ``bench`` both measure its accumulated error through this
pairing.
"""

from __future__ import annotations

import onnx

from qdebug.graph.match import GraphIndex, Pairing, TensorPair, WeightPair
from qdebug.graph.ops import DYNAMIC_Q, INTEGER_OPS


def pair_dynamic(fp32: onnx.ModelProto, dyn: onnx.ModelProto) -> tuple[Pairing, set[str]]:
    """Pair FP32 tensors with a dynamic-quantized model's tensors by graph position.

    ``quantize_dynamic`` leaves most nodes as they are and replaces a quantized
    Conv/MatMul ``N`` by ``DynamicQuantizeLinear`` on its activation input, an
    integer op (``ConvInteger``/``MatMulInteger``) on the int8 weight, then a
    ``Cast`` and a rescaling ``Mul`` (and an ``Add`` for a bias; a Gemm becomes
    such a MatMul plus Add). Nodes are
    matched in topological order: an unchanged node by op type and the
    counterparts of its activation inputs; a quantized one by the integer op
    whose ``DynamicQuantizeLinear`` reads the counterpart of ``N``'s input,
    followed through the Cast/Mul/bias-Add chain to the float tensor standing
    for ``N``'s output. Names are not used.

    Returns ``(pairing, quantized)``: a :class:`~qdebug.graph.match.Pairing`
    without dequant/quant parameters (activations have no fixed Q/DQ pair: they
    are quantized per batch at run time, so only the accumulated error is
    measured), and the names of the FP32 nodes replaced by integer ops.
    """
    fi, di = GraphIndex(fp32), GraphIndex(dyn)
    tensor_map: dict[str, str] = {}
    for idx, name in enumerate(fi.inputs):
        if idx < len(di.inputs):
            tensor_map[name] = di.inputs[idx]
    fp_inits = set(fi.inits)
    used: set[int] = set()
    node_map: list[tuple[str, str]] = []
    unmatched: list[str] = []
    quantized: list[str] = []
    weights: list[WeightPair] = []
    notes: dict[str, str] = {}
    dyn_nodes = list(dyn.graph.node)

    for node in fp32.graph.node:
        positions = [i for i, n in enumerate(node.input) if n and n not in fp_inits]
        expected = tuple(tensor_map.get(node.input[i]) for i in positions)
        if None in expected:
            unmatched.append(node.name)
            _note_outputs(node, notes, "an input has no counterpart in the dynamic model")
            continue
        cand = _unchanged_counterpart(node, positions, expected, dyn_nodes, used)
        if cand is not None:
            used.add(id(cand))
            node_map.append((node.name, cand.name))
            for j, out in enumerate(node.output):
                if out and j < len(cand.output) and cand.output[j]:
                    dequantized = _dequantized(cand.output[j], di)
                    tensor_map[out] = dequantized or cand.output[j]
                    if dequantized and node.name not in quantized:  # e.g. a Gather of an int8 table
                        quantized.append(node.name)
            continue
        cand = _integer_counterpart(node, positions, expected, dyn_nodes, used, di)
        if cand is None:
            unmatched.append(node.name)
            _note_outputs(
                node, notes, f"node {node.name} ({node.op_type}) has no counterpart in the dynamic model"
            )
            continue
        used.add(id(cand))
        node_map.append((node.name, cand.name))
        quantized.append(node.name)
        has_bias = node.op_type in ("Conv", "Gemm") and len(node.input) > 2 and bool(node.input[2])
        out, scale_mul = _follow_rescale(cand, di, set(tensor_map.values()), has_bias)
        if node.output and node.output[0]:
            tensor_map[node.output[0]] = out
        w = _weight_pair(node, cand, scale_mul, fi, di)
        if w is not None:
            weights.append(w)

    outputs = tuple((f, di.outputs[i]) for i, f in enumerate(fi.outputs) if i < len(di.outputs))
    pairs = _tensor_pairs(fp32, fi, tensor_map, notes)
    pairing = Pairing(pairs, tuple(weights), tuple(node_map), tuple(unmatched), outputs)
    return pairing, set(quantized)


def _unchanged_counterpart(
    node: onnx.NodeProto,
    positions: list[int],
    expected: tuple[str | None, ...],
    dyn_nodes: list[onnx.NodeProto],
    used: set[int],
) -> onnx.NodeProto | None:
    """The first unused dynamic-model node of ``node``'s op type reading ``expected`` at ``positions``."""
    for c in dyn_nodes:
        if id(c) in used or c.op_type != node.op_type:
            continue
        if tuple(c.input[i] if i < len(c.input) else None for i in positions) == expected:
            return c
    return None


def _integer_counterpart(
    node: onnx.NodeProto,
    positions: list[int],
    expected: tuple[str | None, ...],
    dyn_nodes: list[onnx.NodeProto],
    used: set[int],
    di: GraphIndex,
) -> onnx.NodeProto | None:
    """The first unused integer op standing for ``node`` whose (dynamically quantized) activation input
    comes from ``node``'s only activation input's counterpart."""
    for c in dyn_nodes:
        if id(c) in used or c.op_type not in INTEGER_OPS.get(node.op_type, ()):
            continue
        if len(positions) == 1 and _float_source(c.input[0], di) == expected[0]:
            return c
    return None


def _float_source(tensor: str, di: GraphIndex) -> str:
    """The float tensor a ``DynamicQuantizeLinear`` quantized into ``tensor`` (``tensor`` itself if none)."""
    p = di.producer.get(tensor)
    return p.input[0] if p is not None and p.op_type == DYNAMIC_Q else tensor


def _tensor_pairs(
    fp32: onnx.ModelProto, fi: GraphIndex, tensor_map: dict[str, str], notes: dict[str, str]
) -> tuple[TensorPair, ...]:
    """One pair per FP32 graph input and node output, in graph order, noted where it has no counterpart."""
    pairs = []
    order = list(fi.inputs) + [o for n in fp32.graph.node for o in n.output if o and o not in fi.inits]
    for name in dict.fromkeys(order):
        q = tensor_map.get(name)
        pairs.append(TensorPair(name, q, None, None, notes.get(name, "" if q else "no counterpart")))
    return tuple(pairs)


def _dequantized(tensor: str, di: GraphIndex) -> str | None:
    """The float tensor standing for ``tensor`` when its only reader is a DequantizeLinear, else None.

    ``quantize_dynamic`` keeps a Gather (an embedding lookup) as it is but makes its table int8 and puts a
    DequantizeLinear after it: the Gather's own output is integer, and pairing the FP32 output with it had
    given -42 dB and blamed the embedding for all the error.
    """
    readers = di.consumers.get(tensor, [])
    if len(readers) == 1 and readers[0].op_type == "DequantizeLinear" and readers[0].input[0] == tensor:
        return readers[0].output[0]
    return None


def _note_outputs(node: onnx.NodeProto, notes: dict[str, str], text: str) -> None:
    """Give every output of an unmatched node the reason it has no counterpart."""
    for out in node.output:
        if out:
            notes[out] = text


def _follow_rescale(
    integer_op: onnx.NodeProto, di: GraphIndex, activations: set[str], has_bias: bool
) -> tuple[str, onnx.NodeProto | None]:
    """From an integer op's output, through Cast / rescaling Mul / bias Add, to the float tensor."""
    t = integer_op.output[0]
    scale_mul: onnx.NodeProto | None = None
    for _ in range(4):
        cons = di.consumers.get(t, [])
        if len(cons) != 1:
            break
        c = cons[0]
        others = [i for i in c.input if i and i != t]
        if c.op_type == "Cast":
            t = c.output[0]
        elif (
            c.op_type == "Mul" and scale_mul is None and others and all(o not in activations for o in others)
        ):
            scale_mul = c
            t = c.output[0]
        elif c.op_type == "Add" and has_bias and others and all(o in di.inits for o in others):
            has_bias = False
            t = c.output[0]
        else:
            break
    return t, scale_mul


def _weight_pair(
    node: onnx.NodeProto,
    integer_op: onnx.NodeProto,
    scale_mul: onnx.NodeProto | None,
    fi: GraphIndex,
    di: GraphIndex,
) -> WeightPair | None:
    """The FP32 weight and its int8 initializer, scale and zero point (None when not found)."""
    if node.op_type not in INTEGER_OPS or len(node.input) < 2 or node.input[1] not in fi.inits:
        return None
    if integer_op.op_type not in ("ConvInteger", "MatMulInteger") or len(integer_op.input) < 2:
        return None
    wq = integer_op.input[1]
    zp = integer_op.input[3] if len(integer_op.input) > 3 and integer_op.input[3] in di.inits else None
    scale: str | None = None
    if scale_mul is not None:
        for i in scale_mul.input:
            if i in di.inits:
                scale = i
            prod = di.producer.get(i)
            if prod is not None and prod.op_type == "Mul":
                scale = next((x for x in prod.input if x in di.inits), scale)
    if wq not in di.inits or scale is None:
        return None
    axis = 0 if node.op_type == "Conv" else 1
    return WeightPair(node.input[1], node.name, wq, scale, zp, axis)
