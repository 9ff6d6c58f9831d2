"""One fake-quant model whose every Q/DQ can be switched off by a graph input: candidates without sessions.

propose scores tens of candidates, each a model re-quantized from the cached ranges and an ORT session
built for it. On a large graph the session build is most of a candidate's cost. The *switchable* model
is the full static QDQ model in which every edge that reads a DequantizeLinear output -- a node's input
slot, or a graph output -- reads instead ``Where(switches[k], dequantized, float)``: the dequantized value
when switch ``k`` is on, the float tensor the FP32 model has there when it is off (the Q node's input for an
activation, the original initializer for a weight or bias). All switches on computes static INT8 in
fake-quant (float Q/DQ rounding); all off computes FP32.

A candidate model is *representable* when, edge by edge, it reads either the same dequantized value as the
static model (the same scale, zero point and, for weights, the same quantized values) or the float tensor:
excluding nodes only removes Q/DQ. A candidate that changes a range (a clip, 16-bit activations, per-channel
weights) or adds a Q/DQ the static model lacks is not: :func:`switches_for` returns None and the caller
scores the real model. The pairing is by node name and input slot, which ORT's quantizer keeps.

The switchable model computes in float (ORT's QDQ handling off): it screens candidates; the answer and
every reported point are confirmed on the real re-quantized model with integer kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SWITCHES = "qdebug_qdq_switches"
"""The switchable model's extra graph input: one bool per switchable edge."""
OUTPUT = "<graph output>"
"""The node name of a graph-output edge."""

Edge = tuple[str, int | str]
"""``(node name, input slot)``, or ``(OUTPUT, output name)``."""


@dataclass(frozen=True)
class _Dq:
    """One edge's DequantizeLinear as a candidate is compared on it."""

    scale: bytes
    zero_point: bytes
    data: bytes
    """The quantized initializer's bytes (weights), or the Q node's input name (activations)."""
    axis: int


@dataclass(frozen=True)
class Switchable:
    """The switchable model and what its switches mean."""

    model: onnx.ModelProto
    edges: tuple[Edge, ...]
    """Edge ``k`` is switch ``k``."""
    static: Mapping[Edge, _Dq]
    """What each edge reads in the static model."""
    nodes: Mapping[str, str]
    """The static model's nodes other than Q/DQ: name -> op type (a candidate must have the same)."""

    def all_on(self) -> np.ndarray:
        """The static model's switches."""
        return np.ones(len(self.edges), dtype=bool)


def _initializers(model: onnx.ModelProto) -> dict[str, TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _const_bytes(name: str, inits: Mapping[str, TensorProto], consts: Mapping[str, np.ndarray]) -> bytes | None:
    if name in inits:
        return numpy_helper.to_array(inits[name]).tobytes()
    if name in consts:
        return consts[name].tobytes()
    return None


def _read_edges(model: onnx.ModelProto) -> tuple[dict[Edge, _Dq | None], dict[str, str], dict[Edge, str]]:
    """Every edge of ``model``: the DequantizeLinear it reads (None: a float tensor), the nodes that are
    not Q/DQ, and the DQ output name each DQ-fed edge reads."""
    graph = model.graph
    inits = _initializers(model)
    consts = {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in graph.node
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
    }
    producer = {o: n for n in graph.node for o in n.output}

    def dq_of(tensor: str) -> _Dq | None:
        d = producer.get(tensor)
        if d is None or d.op_type != "DequantizeLinear":
            return None
        scale = _const_bytes(d.input[1], inits, consts) or b""
        zp = _const_bytes(d.input[2], inits, consts) if len(d.input) > 2 and d.input[2] else b""
        axis = next((a.i for a in d.attribute if a.name == "axis"), 1)
        src = d.input[0]
        q = producer.get(src)
        if q is not None and q.op_type == "QuantizeLinear":
            data = ("act:" + q.input[0]).encode()
        else:
            data = _const_bytes(src, inits, consts) or ("?" + src).encode()
        return _Dq(scale, zp or b"", data, axis)

    edges: dict[Edge, _Dq | None] = {}
    reads: dict[Edge, str] = {}
    nodes: dict[str, str] = {}
    for n in graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        nodes[n.name] = n.op_type
        for i, name in enumerate(n.input):
            if name:
                edges[(n.name, i)] = dq_of(name)
                reads[(n.name, i)] = name
    for o in graph.output:
        edges[(OUTPUT, o.name)] = dq_of(o.name)
        reads[(OUTPUT, o.name)] = o.name
    return edges, nodes, reads


class _Wiring:
    """The switchable model under construction: fresh names, the FP32 floats added, the switch nodes."""

    def __init__(self, model: onnx.ModelProto, fp32: onnx.ModelProto) -> None:
        self.graph = model.graph
        self.fp32_nodes = {n.name: n for n in fp32.graph.node}
        self.fp32_inits = _initializers(fp32)
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.by_name = {n.name: n for n in self.graph.node}
        graph = self.graph
        self.taken = {t for n in graph.node for t in (*n.input, *n.output)} | {t.name for t in graph.initializer}
        self.taken |= {i.name for i in graph.input}
        self.floats: dict[str, str] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.renamed_outputs: dict[str, str] = {}
        self.edges: list[Edge] = []

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def float_source(self, edge: Edge, tensor: str) -> str | None:
        """What the FP32 model reads on ``edge``: the Q node's input (an activation), else the original
        initializer, added under a fresh name (a weight, a bias); None when neither is found."""
        node_name, slot = edge
        dq = self.producer[tensor]
        q = self.producer.get(dq.input[0])
        if q is not None and q.op_type == "QuantizeLinear":
            return q.input[0]
        original_node = self.fp32_nodes.get(node_name) if node_name != OUTPUT else None
        if original_node is None or not isinstance(slot, int) or slot >= len(original_node.input):
            return None
        original = original_node.input[slot]
        if original not in self.fp32_inits:
            return None
        if original not in self.floats:
            self.floats[original] = self.fresh(f"{original}_qdebug_float")
            array = numpy_helper.to_array(self.fp32_inits[original])
            self.graph.initializer.append(numpy_helper.from_array(array, self.floats[original]))
        return self.floats[original]

    def switch(self, edge: Edge, tensor: str, float_src: str) -> None:
        """Put ``edge`` behind switch ``k``: ``Where(switches[k], dequantized, float)``."""
        k = len(self.edges)
        self.edges.append(edge)
        index = self.fresh(f"qdebug_switch_index_{k}")
        self.graph.initializer.append(numpy_helper.from_array(np.array(k, dtype=np.int64), index))
        flag = self.fresh(f"qdebug_switch_{k}")
        self.nodes.append(helper.make_node("Gather", [SWITCHES, index], [flag], name=self.fresh(f"qdebug_gather_{k}")))
        where = self.fresh(f"qdebug_where_{k}")
        node_name, slot = edge
        if node_name == OUTPUT:
            # the graph output keeps its name: the DQ writes elsewhere, the Where writes the output
            inner = self.fresh(f"{tensor}_qdebug_dq")
            self.renamed_outputs[tensor] = inner
            self.nodes.append(helper.make_node("Where", [flag, inner, float_src], [tensor], name=where))
        else:
            out = self.fresh(f"{tensor}_qdebug_switched")
            self.nodes.append(helper.make_node("Where", [flag, tensor, float_src], [out], name=where))
            self.by_name[node_name].input[slot] = out  # type: ignore[index]

    def finish(self) -> None:
        """Rename the DQ outputs that were graph outputs, add the switch nodes and input, order the graph."""
        for n in self.graph.node:
            for j, o in enumerate(n.output):
                n.output[j] = self.renamed_outputs.get(o, o)
        # every reader of such a DQ output reads it under its new name -- the Where of another edge included,
        # so that edge's switch alone decides what it reads
        for n in [*self.graph.node, *self.nodes]:
            if n.op_type == "Where" and n.output[0] in self.renamed_outputs:
                continue
            for j, i in enumerate(n.input):
                n.input[j] = self.renamed_outputs.get(i, i)
        self.graph.node.extend(self.nodes)
        self.graph.input.append(helper.make_tensor_value_info(SWITCHES, TensorProto.BOOL, [len(self.edges)]))
        _topological(self.graph)


def build_switchable(static: onnx.ModelProto, fp32: onnx.ModelProto) -> Switchable | None:
    """The switchable model of ``static`` (quantized from ``fp32``), or None when it has no Q/DQ edge that
    can be switched. Neither model is changed."""
    edges, nodes, reads = _read_edges(static)
    model = onnx.ModelProto()
    model.CopyFrom(static)
    wiring = _Wiring(model, fp32)
    for edge, dq in edges.items():
        if dq is None:
            continue
        float_src = wiring.float_source(edge, reads[edge])
        if float_src is not None:
            wiring.switch(edge, reads[edge], float_src)
    if not wiring.edges:
        return None
    wiring.finish()
    static_edges = {e: edges[e] for e in wiring.edges}
    return Switchable(model, tuple(wiring.edges), static_edges, nodes)  # type: ignore[arg-type]


def _topological(graph: onnx.GraphProto) -> None:
    """Order the nodes so each comes after its inputs' producers (the Where nodes were appended)."""
    known = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    producers = {o: n for n in pending for o in n.output}
    placed: set[int] = set()

    def place(node: onnx.NodeProto, stack: set[int]) -> None:
        key = id(node)
        if key in placed:
            return
        stack.add(key)
        for i in node.input:
            p = producers.get(i)
            if i not in known and p is not None and id(p) not in placed and id(p) not in stack:
                place(p, stack)
        placed.add(key)
        ordered.append(node)

    for n in pending:
        place(n, set())
    copies = [onnx.NodeProto() for _ in ordered]
    for c, n in zip(copies, ordered, strict=True):
        c.CopyFrom(n)
    del graph.node[:]
    graph.node.extend(copies)


def switches_for(switchable: Switchable, candidate: onnx.ModelProto) -> np.ndarray | None:
    """The switches that make the switchable model compute ``candidate`` (a re-quantization of the same
    FP32 model), or None when it cannot: a node added or gone, an edge that reads other Q/DQ parameters
    than the static model's, or a Q/DQ where the static model has none."""
    edges, nodes, _ = _read_edges(candidate)
    if nodes != switchable.nodes:
        return None
    on = np.zeros(len(switchable.edges), dtype=bool)
    index = {e: k for k, e in enumerate(switchable.edges)}
    for edge, dq in edges.items():
        k = index.get(edge)
        if dq is None:
            continue  # reads the float tensor: its switch stays off
        if k is None or dq != switchable.static[edge]:
            return None
        on[k] = True
    return on


class SwitchScreen:
    """Scores candidates the way an :class:`~qdebug.evaluation.evaluate.Evaluator` does, through the switchable model
    where the candidate is representable (one session for all of them, fake-quant semantics), else through
    the evaluator itself (the candidate's own session, integer kernels). propose screens with it and
    confirms the answer and every reported point with the evaluator.

    It stands in for the evaluator it wraps (its attributes are the evaluator's); it pickles without its
    session, which a worker process builds again on its first score.
    """

    def __init__(self, evaluator, switchable: Switchable) -> None:
        self.evaluator = evaluator
        self.switchable = switchable
        self._session = None
        self.screened = 0
        """Candidates scored through the switchable model."""
        self.fallbacks = 0
        """Candidates it could not represent (scored on their own model)."""

    def __getattr__(self, name: str):
        if name in ("evaluator", "switchable", "_session"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.evaluator, name)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_session": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def session(self):
        """The switchable model's session (built on first use; ORT's QDQ handling off)."""
        if self._session is None:
            from qdebug.runtime.capture import make_session

            self._session = make_session(
                self.switchable.model, self.evaluator.config, what="switchable fake-quant model", fake_quant=True
            )
        return self._session

    def score(self, model: onnx.ModelProto, what: str = "quantized model", *, fake_quant: bool = False):
        """The candidate's score: through the switches when they can express it, else on its own model."""
        switches = None if fake_quant else switches_for(self.switchable, model)
        if switches is None:
            self.fallbacks += 1
            return self.evaluator.score(model, what, fake_quant=fake_quant)
        self.screened += 1
        return self.evaluator.score_session(self.session(), {SWITCHES: switches})
