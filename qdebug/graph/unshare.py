"""Give every bias that several nodes read its own copy, before ORT's quantizer copies it badly.

A bias's quantization scale is ``input_scale * weight_scale`` of the node reading it, so
``QDQQuantizer.quantize_bias_tensor`` gives each further reader of a shared bias a copy made by
``_dup_initializer``, named ``f"{name}{k}"`` (k = 1 + the largest integer suffix among
*initializers* starting with ``name``, 0 for the first copy). Only initializer names are checked:
when an activation, a graph input or output already has that name, the quantized model defines
it twice and ORT wires that tensor's readers to the bias (e.g. ``Invalid attribute perm
{0, 2, 3, 1}, input shape = {36}`` on the Transpose after a Conv). tf2onnx and jax2tf fold equal
constants (all-zero biases) into one initializer, so whole model families hit this.

:func:`unshare_biases` does the copying first, under names unique among *all* value names, so
ORT has nothing left to copy. :data:`SNIPPET` is the same function with ``onnx`` only, for the
code handed to the user before their own ``quantize_static`` call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

BIAS_OPS = frozenset(
    {"Conv", "ConvTranspose", "Gemm", "BatchNormalization", "InstanceNormalization", "LayerNormalization"}
)
"""Ops whose input 2 ORT's QDQ quantizer quantizes as a bias (``quantize_bias_tensor``)."""


@dataclass(frozen=True)
class Unshared:
    """One bias read by several nodes, and the copies made for them."""

    original: str
    copies: tuple[tuple[str, str], ...]
    """(node name, copy name) for every reader that now reads its own copy."""
    ort_names: tuple[str, ...]
    """The names ORT's ``_dup_initializer`` would have given its copies, in its order."""
    collisions: tuple[str, ...]
    """Those of ``ort_names`` that are already the name of another tensor (the bug's trigger)."""


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def value_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name of ``graph`` and its subgraphs: inputs, outputs, value_info, initializers, node I/O."""
    names: set[str] = set()
    for g in _graphs(graph):
        names |= {v.name for v in (*g.input, *g.output, *g.value_info, *g.initializer, *g.sparse_initializer)}
        for node in g.node:
            names |= {*node.input, *node.output}
    names.discard("")
    return names


def ort_copy_names(original: str, count: int, initializers: set[str]) -> list[str]:
    """The names ORT's ``QDQQuantizer._dup_initializer`` gives ``count`` copies of ``original``."""
    names = set(initializers)
    out = []
    for _ in range(count):
        suffixes = [int(n[len(original) :]) for n in names if n.startswith(original) and _is_int(n[len(original) :])]
        name = f"{original}{max(suffixes, default=-1) + 1}"
        names.add(name)
        out.append(name)
    return out


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def unshare_biases(model: onnx.ModelProto) -> list[Unshared]:
    """Give each reader of a shared bias initializer its own copy (in place); returns what was copied.

    A bias (input 2 of a :data:`BIAS_OPS` node, an initializer of the main graph) read by more than
    one node or slot anywhere in the model gets a copy for each bias reader but the first; when
    other nodes (or subgraphs, or the graph outputs) read it too, the first bias reader gets a copy
    as well. A copy is named ``<name>__copy<k>``, the first such name that is no tensor's name.
    """
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    taken = value_names(graph)
    uses: Counter[str] = Counter()
    for g in _graphs(graph):
        for node in g.node:
            uses.update(t for t in node.input if t)
    uses.update(o.name for o in graph.output)
    bias_reads: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type in BIAS_OPS and len(node.input) > 2:
            name = node.input[2]
            if name in inits and uses[name] > 1:
                bias_reads.setdefault(name, []).append(node)
    done = []
    for name, readers in bias_reads.items():
        ort_names = ort_copy_names(name, len(readers) - 1, set(inits))
        collisions = tuple(n for n in ort_names if n in taken and n not in inits)
        copied = readers[1:] if len(readers) == uses[name] else readers
        copies = []
        k = 1
        for node in copied:
            while f"{name}__copy{k}" in taken:
                k += 1
            new = f"{name}__copy{k}"
            taken.add(new)
            tensor = onnx.TensorProto()
            tensor.CopyFrom(inits[name])
            tensor.name = new
            graph.initializer.append(tensor)
            node.input[2] = new
            copies.append((node.name, new))
        done.append(Unshared(name, tuple(copies), tuple(ort_names), collisions))
    return done


SNIPPET_FUNCTION = '''\
import collections

import onnx

BIAS_OPS = {"Conv", "ConvTranspose", "Gemm", "BatchNormalization", "InstanceNormalization", "LayerNormalization"}


def unshare_biases(model):
    """Give each node reading a shared bias its own copy, under a name no tensor has: ORT's quantizer
    names its copies f"{name}{k}", which may be an activation's name (the model then fails to load)."""
    graphs, names, uses = [model.graph], set(), collections.Counter(o.name for o in model.graph.output)
    while graphs:  # every name in the model, subgraphs included
        g = graphs.pop()
        names |= {v.name for v in [*g.input, *g.output, *g.value_info, *g.initializer]}
        for n in g.node:
            names |= {*n.input, *n.output}
            uses.update(n.input)
            graphs += [a.g for a in n.attribute if a.HasField("g")] + [s for a in n.attribute for s in a.graphs]
    inits = {t.name: t for t in model.graph.initializer}
    readers = collections.defaultdict(list)
    for n in model.graph.node:
        if n.op_type in BIAS_OPS and len(n.input) > 2 and n.input[2] in inits and uses[n.input[2]] > 1:
            readers[n.input[2]].append(n)
    for name, nodes in readers.items():
        k = 0
        for n in nodes[1:] if len(nodes) == uses[name] else nodes:  # the first keeps it if only biases read it
            k += 1
            while f"{name}__copy{k}" in names:
                k += 1
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[name])
            copy.name = f"{name}__copy{k}"
            names.add(copy.name)
            model.graph.initializer.append(copy)
            n.input[2] = copy.name
'''
"""``unshare_biases`` with ``onnx`` only: what :func:`unshare_biases` does, for the user's own script."""


def snippet(model_path: str, out_path: str = "model.unshared.onnx") -> str:
    """The user's lines: :data:`SNIPPET_FUNCTION`, then load ``model_path``, unshare, save ``out_path``
    (the file to hand to ``quantize_static``)."""
    return (
        SNIPPET_FUNCTION
        + "\n\n"
        + f"model = onnx.load({model_path!r})\n"
        + "unshare_biases(model)\n"
        + f"onnx.save(model, {out_path!r})  # quantize_static this file\n"
    )
