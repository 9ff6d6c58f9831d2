"""Per-channel statistics of intermediate tensors, streamed over calibration batches.

SmoothQuant needs each smoothed activation's per-channel max-abs; bias correction needs each corrected
layer's per-channel output mean, on the FP32 model and on its QDQ model. Both are read here the same way:
the named tensors become extra graph outputs of a copy of the model, the copy runs once per batch, and
each channel's running min/max/sum is updated in float64 -- no batch is kept, so 64 samples of a large
Transformer cost one batch of memory.

The channel axis is decided from the graph, not from the data (a [1, 8, 8] tensor could be either):

* a tensor read by a MatMul as input A, or by a Gemm as input A (``transA=0``): its last axis (the
  reduction axis K, the one SmoothQuant scales); ``transA=1``: axis 0;
* a tensor read by a Conv as its input X: axis 1 (NCHW / NCW);
* otherwise, a tensor produced by a Conv or ConvTranspose: axis 1;
* anything else -- produced by a MatMul or Gemm, by a MatMul's bias Add, by a LayerNormalization, or a
  graph input: the last axis (a Gemm's N, a Transformer's hidden axis).

On a QDQ model (ORT's ``quantize_static``) a float tensor is read through a QuantizeLinear ->
DequantizeLinear pair; the readers and the producer are looked up through such pairs, so the same float
tensor name gets the same axis in the FP32 model and in its QDQ model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class ChannelStats:
    """One tensor's statistics per channel (float64 arrays of the channel count)."""

    absmax: np.ndarray
    """max |x| per channel: SmoothQuant's activation range."""
    mean: np.ndarray
    """Mean per channel: what bias correction compares between the FP32 and the QDQ model."""
    min: np.ndarray
    max: np.ndarray
    samples: int
    """Values each channel's statistics were taken over (every position of every batch)."""
    axis: int
    """The channel axis of the tensor as it was read (non-negative)."""


class Graph:
    """Who produces and who reads each tensor of a graph, and its initializers -- built once per call."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.graph = g
        self.inits: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in g.node:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i, name in enumerate(node.input):
                if name:
                    self.readers.setdefault(name, []).append((node, i))
        self.outputs = {o.name for o in g.output}
        self.inputs = {i.name for i in g.input}

    def readers_of(self, tensor: str) -> list[tuple[onnx.NodeProto, int]]:
        """The nodes reading ``tensor`` (with the input index), seen through QuantizeLinear ->
        DequantizeLinear pairs: on a QDQ model, the ops that read its dequantized copy."""
        found: list[tuple[onnx.NodeProto, int]] = []
        for node, i in self.readers.get(tensor, []):
            if node.op_type in _QDQ and i == 0:
                found.extend(self.readers_of(node.output[0]))
            else:
                found.append((node, i))
        return found

    def producer_of(self, tensor: str) -> onnx.NodeProto | None:
        """The node computing ``tensor``, seen back through a DequantizeLinear <- QuantizeLinear pair (a QDQ
        model's graph output is the DequantizeLinear's output)."""
        node = self.producer.get(tensor)
        while node is not None and node.op_type in _QDQ and node.input[0] not in self.inits:
            node = self.producer.get(node.input[0])
        return node

    def only_reader(self, name: str, node: onnx.NodeProto) -> bool:
        """Whether ``node`` is the one node reading ``name`` (and it is no graph output): a weight that may
        be rewritten without changing anything else."""
        readers = self.readers.get(name, [])
        return name not in self.outputs and len({id(n) for n, _ in readers}) == 1 and readers[0][0] is node

    def array(self, name: str) -> np.ndarray | None:
        """The initializer ``name`` as an array (None when it is not one)."""
        t = self.inits.get(name)
        return onnx.numpy_helper.to_array(t) if t is not None else None


def channel_axis(graph: Graph, tensor: str) -> int:
    """The channel axis of ``tensor`` (``-1``: the last), from its readers, else its producer (module doc)."""
    for node, i in graph.readers_of(tensor):
        if node.op_type == "MatMul" and i == 0:
            return -1
        if node.op_type == "Gemm" and i == 0:
            return 0 if _attr(node, "transA", 0) else -1
        if node.op_type == "Conv" and i == 0:
            return 1
    producer = graph.producer_of(tensor)
    if producer is None:
        return -1
    if producer.op_type in ("Conv", "ConvTranspose"):
        return 1
    return -1


def _attr(node: onnx.NodeProto, name: str, default: int | float) -> int | float:
    """An int or float attribute of ``node`` (``default`` when absent)."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


class _Accumulator:
    """Streaming per-channel min/max/absmax/sum in float64."""

    def __init__(self, axis: int) -> None:
        self.axis = axis
        self.count = 0
        self.lo: np.ndarray | None = None
        self.hi: np.ndarray | None = None
        self.total: np.ndarray | None = None

    def update(self, name: str, x: np.ndarray) -> None:
        """Fold one batch's value of the tensor in."""
        x = np.asarray(x, dtype=np.float64)
        if x.ndim == 0:
            x = x.reshape(1)
        axis = self.axis % x.ndim if -x.ndim <= self.axis < x.ndim else x.ndim - 1
        rows = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
        lo, hi, total = rows.min(axis=0), rows.max(axis=0), rows.sum(axis=0)
        if self.lo is None:
            self.axis, self.lo, self.hi, self.total = axis, lo, hi, total
        elif lo.shape != self.lo.shape:
            raise ValueError(f"tensor {name!r} has {lo.shape[0]} channels in one batch, {self.lo.shape[0]} in another")
        else:
            self.lo, self.hi, self.total = np.minimum(self.lo, lo), np.maximum(self.hi, hi), self.total + total
        self.count += rows.shape[0]

    def result(self, name: str) -> ChannelStats:
        """The statistics so far (a tensor never seen is an error: there were no batches)."""
        if self.lo is None or self.hi is None or self.total is None:
            raise ValueError(f"no batch reached tensor {name!r}: channel statistics need at least one batch")
        absmax = np.maximum(np.abs(self.lo), np.abs(self.hi))
        return ChannelStats(absmax, self.total / self.count, self.lo, self.hi, self.count, self.axis)


def with_float_outputs(model: onnx.ModelProto, tensors: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also outputs ``tensors`` (FLOAT, no shape; graph outputs and inputs are
    output already or fed, and are left as they are)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    have = {o.name for o in out.graph.output} | {i.name for i in out.graph.input}
    for name in dict.fromkeys(tensors):
        if name not in have:
            out.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    return out


def channel_stats(
    model: onnx.ModelProto,
    tensors: Sequence[str],
    batches: Iterable[dict[str, np.ndarray]],
) -> dict[str, ChannelStats]:
    """Per-channel statistics of each tensor in ``tensors`` over ``batches`` (feeds of ``model``'s inputs).

    ``model`` is not changed; it may be a QDQ model, read by its float tensor names (module doc). A name
    that no node computes and no graph input carries is a caller's bug (ValueError): a QDQ model may have
    renamed a layer's output; pair it by node (:func:`qdebug.recipes.bias.quantized_tensors`).
    """
    import onnxruntime as ort

    graph = Graph(model)
    names = list(dict.fromkeys(tensors))
    unknown = [n for n in names if n not in graph.producer and n not in graph.inputs]
    if unknown:
        raise ValueError(f"no node of the model computes {', '.join(unknown[:5])}")
    accs = {n: _Accumulator(channel_axis(graph, n)) for n in names}
    probe = with_float_outputs(model, names)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    fetch = [n for n in names if n not in graph.inputs]
    for feeds in batches:
        values = dict(zip(fetch, session.run(fetch, feeds), strict=True)) if fetch else {}
        for n in names:
            accs[n].update(n, values[n] if n in values else feeds[n])
    return {n: accs[n].result(n) for n in names}


def graph_order(graph: Graph, names: Iterable[str]) -> Iterator[str]:
    """``names`` in the order their producers appear in the graph (graph inputs first): deterministic notes."""
    rank = {o: i for i, node in enumerate(graph.graph.node) for o in node.output}
    yield from sorted(names, key=lambda n: (rank.get(n, -1), n))


def as_float(values: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    """``values[name]`` as a 1-D float64 array (None when absent)."""
    v = values.get(name)
    return None if v is None else np.asarray(v, dtype=np.float64).reshape(-1)
