"""Normalize a loaded model into the base for every later step.

Normalization is a pure function of the model bytes (deterministic, never
mutating its input, never touching the user's file):

* opset >= 10 (quantization needs it; ``upgrade_opset`` converts older models);
* every node gets a unique, deterministic name -- ``nodes_to_exclude`` matches
  node names, and all unnamed nodes share the name ``""``;
* weights held in ``Constant`` nodes become initializers (ORT's quantizer only
  quantizes initializer weights, so they would otherwise silently stay FP32);
* a graph input or initializer that is also listed as a graph output gets an
  ``Identity`` (ORT's quantizer asserts "Graph is not a DAG" on it); an
  initializer output reads its own copy, so it is never quantized;
* a bias initializer that several Conv/Gemm/normalization nodes read gets one copy per node,
  under a name no tensor has (ORT's quantizer would copy it itself, possibly under an
  activation's name: :mod:`qdebug.graph.unshare`);
* ``If`` nodes whose condition is a constant are inlined (the taken branch
  replaces the node) when asked -- ORT quantizes no subgraph; so are those whose
  condition is computed from constants and graph inputs that hold one value in
  all the user's data (``input_value``: a streaming model's sample rate), the
  model then being specialized on that value (:class:`DataIf`);
* shape inference that survives dynamic dimensions and ends with every tensor
  typed (ONNX inference; where it leaves tensors untyped ORT's symbolic one, then
  with ``auto_merge``, then the types ORT resolves when it loads the model), saying
  which one worked; a ``Concat(axis=-1)`` of 1-D shape values gets ``axis=0`` (the
  same result), which ORT's symbolic inference -- and ``quant_pre_process`` --
  asserts on (:mod:`qdebug.graph.shapes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import ModelProto, numpy_helper

from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.modelfile import LoadedModel, default_opset
from qdebug.graph.shapes import infer_shapes

MIN_OPSET = 10


PER_CHANNEL_OPSET = 13


InputValue = Callable[[str], "np.ndarray | None"]
"""Graph input name -> the one value it holds in every sample of the data, or None (it varies, is not fed
whole with every batch, or is not known): what decides an If whose condition reads graph inputs."""


CONDITION_NODES = 32
"""The most nodes a condition computed from graph inputs may take to be evaluated (a bigger cone is a
network, not a switch)."""


@dataclass(frozen=True, eq=False)
class DataIf:
    """A top-level ``If`` whose condition reads only constants and graph inputs that hold one value in the
    data: the branch those values take, inlined or (without ``--inline-constant-if``) only named."""

    node: str
    branch: str
    """``then_branch`` or ``else_branch``."""
    inputs: tuple[tuple[str, np.ndarray], ...]
    """The graph inputs its condition reads, with their value."""
    inlined: bool


@dataclass(frozen=True, eq=False)
class NormalizedModel:
    """The normalized model plus what normalization did (for the report's notes)."""

    proto: ModelProto
    name_map: tuple[tuple[str, str], ...]
    """(new name, original name) for every renamed node."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    opset: int = 0
    data_ifs: tuple[DataIf, ...] = ()
    """The If nodes decided by graph inputs that hold one value in the data (``input_value``), in order."""


def normalize(
    loaded: LoadedModel,
    *,
    upgrade_opset: bool = False,
    min_opset: int = MIN_OPSET,
    inline_constant_if: bool = False,
    input_value: InputValue | None = None,
) -> NormalizedModel:
    """Return the normalized copy of ``loaded.proto`` (see module docstring); the input is not mutated.

    ``input_value`` gives the value a graph input holds in every sample of the data (None: it varies), for
    the If nodes whose condition reads graph inputs: it is asked only about those inputs, as they are met.
    """
    model = ModelProto()
    model.CopyFrom(loaded.proto)
    notes: list[str] = []
    model = _ensure_opset(model, loaded.path, upgrade_opset, min_opset, notes)
    name_map = _name_nodes(model.graph, notes)
    _constants_to_initializers(model.graph, notes)
    data_ifs: list[DataIf] = []
    opsets = tuple(model.opset_import)
    if _inline_constant_ifs(model.graph, inline_constant_if, notes, input_value, opsets, data_ifs):
        _constants_to_initializers(model.graph, [])
    _drop_initializer_inputs(model.graph, notes)
    _outputs_that_are_inputs(model.graph, notes)
    _unshare_biases(model, notes)
    _check_known_domains(model, loaded.path)
    model = infer_shapes(model, notes)
    return NormalizedModel(
        proto=model,
        name_map=tuple(name_map),
        notes=tuple(notes),
        opset=default_opset(model),
        data_ifs=tuple(data_ifs),
    )


def _ensure_opset(
    model: ModelProto, path: Path, upgrade: bool, min_opset: int, notes: list[str]
) -> ModelProto:
    opset = default_opset(model)
    if opset >= min_opset:
        return model
    if not upgrade:
        raise QDebugError(
            f"{path} uses opset {opset}; quantization needs opset >= {min_opset}",
            "re-run with --upgrade-opset (uses onnx.version_converter) or re-export with a newer opset",
            ExitCode.MODEL,
        )
    target = max(min_opset, PER_CHANNEL_OPSET)
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, target)
    except Exception as e:
        raise QDebugError(
            f"could not convert {path} from opset {opset} to {target}: {e.__class__.__name__}: {str(e)[:200]}",
            "re-export the model with opset >= 13",
            ExitCode.MODEL,
        ) from None
    notes.append(f"converted the model from opset {opset} to {target} with onnx.version_converter")
    _restore_replaced_names(model, converted)
    # the converter's own Constants (the axes and split sizes that became inputs) are not the user's
    # weights: folded here, quietly, so the notes below speak of the user's model only (they had said
    # "named 4 unnamed node(s)" and "turned 4 Constant node(s) into initializers" of a model with neither)
    ours = {o for n in model.graph.node for o in n.output}
    _constants_to_initializers(converted.graph, [], skip=ours)
    return converted


def _restore_replaced_names(original: ModelProto, converted: ModelProto) -> None:
    """Give nodes and tensors that ``version_converter`` replaced their original names back (in place).

    An adapter such as Upsample -> Resize writes an unnamed node with a fresh output (``_v_8``), so the
    report showed ``Resize_2`` for the user's ``up``. A tensor is renamed back when a node that kept its
    name reads the fresh name where it read the original one, and that name is free; its unnamed
    producer then gets the original producer's name.
    """
    g = converted.graph
    defined = {i.name for i in g.input} | {t.name for t in g.initializer}
    defined |= {o for n in g.node for o in n.output}
    before = {n.name: n for n in original.graph.node if n.name}
    rename: dict[str, str] = {}
    for node in g.node:
        old = before.get(node.name)
        if old is None or len(old.input) != len(node.input):
            continue
        for was, now in zip(old.input, node.input, strict=True):
            if was != now and was and was not in defined and now not in rename:
                rename[now] = was
    if not rename:
        return
    producer = {o: n.name for n in original.graph.node for o in n.output}
    taken = {n.name for n in g.node if n.name}
    for node in g.node:
        for names in (node.input, node.output):
            for i, name in enumerate(names):
                names[i] = rename.get(name, name)
        if not node.name:
            origin = next((producer[o] for o in node.output if o in rename.values() and o in producer), "")
            if origin and origin not in taken:
                node.name = origin
                taken.add(origin)
    for info in g.value_info:
        info.name = rename.get(info.name, info.name)


def _name_nodes(graph: onnx.GraphProto, notes: list[str]) -> list[tuple[str, str]]:
    """Give unnamed and duplicate-named nodes unique deterministic names ``{op}_{index}``.

    Subgraph nodes are named too (prefixed by their parent) so names are
    unique model-wide, as ``nodes_to_exclude`` requires.
    """
    taken: Counter[str] = Counter()
    all_nodes: list[tuple[str, onnx.NodeProto]] = []
    _collect_nodes(graph, "", all_nodes)
    for _, node in all_nodes:
        if node.name:
            taken[node.name] += 1
    renamed: list[tuple[str, str]] = []
    used = {n.name for _, n in all_nodes if n.name and taken[n.name] == 1}
    for index, (prefix, node) in enumerate(all_nodes):
        if node.name and taken[node.name] == 1:
            continue
        base = node.name or f"{prefix}{node.op_type}_{index}"
        new = base
        k = 1
        while new in used:
            new = f"{base}__{k}"
            k += 1
        used.add(new)
        renamed.append((new, node.name))
        node.name = new
    unnamed = sum(1 for _, old in renamed if not old)
    dup = len(renamed) - unnamed
    if unnamed:
        notes.append(f"named {unnamed} unnamed node(s) deterministically as <op_type>_<index>")
    if dup:
        notes.append(f"renamed {dup} node(s) whose names were not unique (suffix __k)")
    return renamed


def _collect_nodes(graph: onnx.GraphProto, prefix: str, out: list[tuple[str, onnx.NodeProto]]) -> None:
    for node in graph.node:
        out.append((prefix, node))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _collect_nodes(attr.g, f"{prefix}{node.name or node.op_type}/{attr.name}/", out)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for i, g in enumerate(attr.graphs):
                    _collect_nodes(g, f"{prefix}{node.name or node.op_type}/{attr.name}{i}/", out)


def _constants_to_initializers(
    graph: onnx.GraphProto, notes: list[str], skip: set[str] | frozenset[str] = frozenset()
) -> None:
    """Move main-graph ``Constant(value=tensor)`` nodes into initializers (not those making ``skip``)."""
    keep = []
    moved = 0
    existing = {init.name for init in graph.initializer}
    for node in graph.node:
        value = None
        constant = node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1
        if constant and node.output[0] not in skip:
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    value = attr.t
        if value is None or node.output[0] in existing:
            keep.append(node)
            continue
        tensor = onnx.TensorProto()
        tensor.CopyFrom(value)
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        moved += 1
    if moved:
        del graph.node[:]
        graph.node.extend(keep)
        notes.append(
            f"turned {moved} Constant node(s) into initializers so their weights can be quantized (ORT's "
            "quantize_static run on the original model keeps such weights float in the file and quantizes them "
            "at run time, like activations: give it the normalized model, or run quant_pre_process first)"
        )


def _drop_initializer_inputs(graph: onnx.GraphProto, notes: list[str]) -> None:
    """Remove initializers from ``graph.input`` (IR < 4 exporters list every weight as an input).

    ORT treats such inputs as overridable, so its quantizer and optimizer leave
    those weights alone (no folding, constant weights seen as activations).
    """
    inits = {i.name for i in graph.initializer}
    keep = [i for i in graph.input if i.name not in inits]
    dropped = len(graph.input) - len(keep)
    if dropped:
        del graph.input[:]
        graph.input.extend(keep)
        notes.append(
            f"removed {dropped} initializer(s) that were also listed as graph inputs (old exporter style)"
        )


def _outputs_that_are_inputs(graph: onnx.GraphProto, notes: list[str]) -> None:
    """A graph output that is a graph input or an initializer gets an ``Identity`` and the name ``<name>__out``.

    ORT's quantizer asserts ("Graph is not a DAG") on a graph input listed as an output.
    An initializer listed as an output (anchors, priors, a lookup table) is
    model data, not an activation: the Identity reads its own copy when other
    nodes read the initializer too, because ORT replaces a quantized weight by
    its DequantizeLinear output for *every* consumer, and the output would
    then leave the model quantized (it stayed exact when nothing else read it).
    """
    real_inputs = {i.name for i in graph.input}
    weights = {i.name: i for i in graph.initializer}
    read = {name for n in graph.node for name in n.input}
    taken = (
        {o for n in graph.node for o in n.output} | real_inputs | set(weights) | {n.name for n in graph.node}
    )

    def fresh(base: str) -> str:
        while base in taken:
            base += "_"
        taken.add(base)
        return base

    passed, copied = [], []
    readers: dict[str, int] = {}
    for n in graph.node:
        for name in set(n.input):
            readers[name] = readers.get(name, 0) + 1
    for n in graph.node:  # an output made by an Identity of a weight other nodes read too: the same
        if n.op_type == "Identity" and n.input and n.input[0] in weights and readers[n.input[0]] > 1:
            if n.output[0] in {o.name for o in graph.output}:
                source = fresh(f"{n.input[0]}__out_value")
                copy = onnx.TensorProto()
                copy.CopyFrom(weights[n.input[0]])
                copy.name = source
                graph.initializer.append(copy)
                copied.append(n.input[0])
                n.input[0] = source
    for out in graph.output:
        if out.name not in real_inputs and out.name not in weights:
            continue
        source = out.name
        if out.name not in real_inputs and out.name in read:
            source = fresh(f"{out.name}__out_value")
            copy = onnx.TensorProto()
            copy.CopyFrom(weights[out.name])
            copy.name = source
            graph.initializer.append(copy)
            copied.append(out.name)
        new = fresh(f"{out.name}__out")
        node_name = fresh(f"{out.name}__out/identity")  # the same tensor may be listed twice
        graph.node.append(onnx.helper.make_node("Identity", [source], [new], name=node_name))
        passed.append(f"{out.name} -> {new}")
        out.name = new
    if passed:
        notes.append(
            "graph input(s) or initializer(s) also listed as graph output(s) now pass through an Identity node "
            f"(ORT's quantizer rejects them: 'Graph is not a DAG'); output renamed: {', '.join(passed)}"
        )
    if copied:
        notes.append(
            f"initializer(s) {', '.join(copied)} are graph outputs and also read by nodes: the outputs read a "
            "copy, so they stay exact when the weights are quantized (model data, not activations)"
        )


def _unshare_biases(model: ModelProto, notes: list[str]) -> None:
    """Give each reader of a shared bias its own copy (:func:`qdebug.graph.unshare.unshare_biases`).

    ORT's quantizer copies a shared bias itself under ``f"{name}{k}"``, a name it checks against
    initializers only: where that is an activation's name, the quantized model does not load.
    """
    from qdebug.graph.unshare import unshare_biases

    done = unshare_biases(model)
    if not done:
        return
    shown = "; ".join(
        f"{u.original} -> " + ", ".join(f"{copy} for {node}" for node, copy in u.copies) for u in done[:3]
    )
    more = f" and {len(done) - 3} more" if len(done) > 3 else ""
    clash = [c for u in done for c in u.collisions]
    why = (
        f"here {', '.join(repr(c) for c in clash[:3])} {'is' if len(clash) == 1 else 'are'} already the name of "
        "another tensor, whose readers it would have rewired to the bias (a model ORT cannot load)"
        if clash
        else "it checks only initializer names, so a copy can take an activation's name"
    )
    notes.append(
        f"gave {len(done)} bias initializer(s) read by several nodes one copy per node ({shown}{more}): ORT's "
        f"quantizer copies a shared bias itself as <name>0, <name>1... and {why}; quantize_static on your "
        "own model needs the same unsharing first (qdebug.graph.unshare.snippet)"
    )


def _constant_bool(graph: onnx.GraphProto, name: str) -> bool | None:
    """The value of a one-element initializer that is not also an (overridable) graph input."""
    if any(i.name == name for i in graph.input):
        return None
    for init in graph.initializer:
        if init.name == name:
            value = numpy_helper.to_array(init)
            return bool(value.ravel()[0]) if value.size == 1 else None
    return None


def _inline_constant_ifs(
    graph: onnx.GraphProto,
    enabled: bool,
    notes: list[str],
    input_value: InputValue | None = None,
    opsets: tuple[onnx.OperatorSetIdProto, ...] = (),
    data_ifs: list[DataIf] | None = None,
) -> bool:
    """Replace each top-level ``If`` whose condition is a constant initializer by its taken branch; so too
    each whose condition is computed from constants and graph inputs that ``input_value`` says hold one
    value in the data (its :class:`DataIf` goes to ``data_ifs``).

    Returns True when something was inlined. Without ``enabled`` only a note
    says which If nodes could be inlined (and that their branches stay FP32).
    """
    inlined = []
    candidates = []
    looked: set[str] = set()  # If nodes decided not to inline (named in a note, or not decidable)
    found: list[DataIf] = []
    for _ in range(64):  # nested constant Ifs surface at the top level after each pass
        choice = _next_if(graph, looked, input_value, opsets)
        if choice is None:
            break
        index, taken, inputs = choice
        node = graph.node[index]
        branch_name = "then_branch" if taken else "else_branch"
        if not enabled:
            looked.add(node.name)
            if inputs:
                found.append(DataIf(node.name, branch_name, inputs, inlined=False))
            else:
                candidates.append(node.name)
            continue
        cone = _condition_cone(graph, node.input[0]) if inputs else None
        branch = next(a.g for a in node.attribute if a.name == branch_name)
        new_nodes, new_inits = _inline_branch(graph, node, branch)
        cond = node.input[0]
        graph.node.remove(node)
        for k, n in enumerate(new_nodes):
            graph.node.insert(index + k, n)
        graph.initializer.extend(new_inits)
        if cone is not None:
            _drop_unread(graph, {n.name for n in cone[0]})
        elif not any(cond in n.input for n in graph.node) and cond not in {o.name for o in graph.output}:
            keep = [i for i in graph.initializer if i.name != cond]
            del graph.initializer[:]
            graph.initializer.extend(keep)
        if inputs:
            found.append(DataIf(node.name, branch_name, inputs, inlined=True))
        else:
            inlined.append(f"{node.name} ({branch_name}, {len(branch.node)} node(s))")
    if inlined:
        notes.append(
            f"inlined the taken branch of {len(inlined)} If node(s) with a constant condition "
            f"(--inline-constant-if): {', '.join(inlined)}; the model is only valid for that condition"
        )
    if candidates:
        notes.append(
            f"If node(s) {', '.join(candidates)} have a constant condition: their branches stay FP32 because ORT "
            "quantizes no subgraph; re-run with --inline-constant-if to inline the taken branch and quantize it"
        )
    notes.extend(_data_if_notes(found))
    if data_ifs is not None:
        data_ifs.extend(found)
    return bool(inlined) or any(d.inlined for d in found)


def _next_if(
    graph: onnx.GraphProto, looked: set[str], input_value: InputValue | None, opsets: tuple
) -> tuple[int, bool, tuple[tuple[str, np.ndarray], ...]] | None:
    """The first top-level If not ``looked`` at whose branch is known: (index, the condition's value, the
    graph inputs that decided it with their values -- empty for a constant condition). Ifs whose branch
    cannot be known are added to ``looked``."""
    for k, n in enumerate(graph.node):
        if n.op_type != "If" or n.domain not in ("", "ai.onnx") or not n.input or n.name in looked:
            continue
        constant = _constant_bool(graph, n.input[0])
        if constant is not None:
            return k, constant, ()
        decided = _data_condition(graph, n.input[0], input_value, opsets) if input_value is not None else None
        if decided is not None:
            return k, decided[0], decided[1]
        looked.add(n.name)
    return None


def _data_condition(
    graph: onnx.GraphProto, cond: str, input_value: InputValue, opsets: tuple
) -> tuple[bool, tuple[tuple[str, np.ndarray], ...]] | None:
    """The value of a condition computed from constants and graph inputs that hold one value in the data,
    and those inputs with their values; None when it reads anything else or cannot be evaluated."""
    cone = _condition_cone(graph, cond)
    if cone is None or not cone[1]:
        return None
    nodes, inputs = cone
    values = {}
    for name in inputs:  # in the order the graph lists them: the scan reads as few inputs as it must
        value = input_value(name)
        if value is None:
            return None
        values[name] = np.asarray(value)
    taken = _evaluate(graph, nodes, cond, values, opsets)
    return None if taken is None else (taken, tuple(values.items()))


def _condition_cone(graph: onnx.GraphProto, cond: str) -> tuple[list[onnx.NodeProto], list[str]] | None:
    """The nodes computing ``cond`` (graph order) and the graph inputs they read (graph order), when that
    cone reaches only initializers and graph inputs through at most :data:`CONDITION_NODES` deterministic
    standard nodes without subgraphs; else None."""
    producer = {o: n for n in graph.node for o in n.output if o}
    graph_inputs = [i.name for i in graph.input]
    weights = {i.name for i in graph.initializer}
    seen: set[str] = set()
    cone: set[str] = set()
    read: set[str] = set()
    todo = [cond]
    while todo:
        name = todo.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in graph_inputs:  # an input with an initializer is overridable: the data decides it
            read.add(name)
            continue
        if name in weights:
            continue
        node = producer.get(name)
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type.startswith("Random"):
            return None
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            return None
        cone.add(node.name)
        if len(cone) > CONDITION_NODES:
            return None
        todo.extend(node.input)
    return [n for n in graph.node if n.name in cone], [i for i in graph_inputs if i in read]


def _evaluate(
    graph: onnx.GraphProto, nodes: list[onnx.NodeProto], cond: str, values: dict[str, np.ndarray], opsets: tuple
) -> bool | None:
    """The one-element condition ``cond`` computed by ``nodes`` from ``values`` (onnx.reference); None when it
    cannot be computed or is not one element."""
    if not nodes:
        value = values.get(cond)
    else:
        from onnx.reference import ReferenceEvaluator

        needed = {t for n in nodes for t in n.input}
        inits = [t for t in graph.initializer if t.name in needed and t.name not in values]
        inputs = [i for i in graph.input if i.name in values]
        mini = onnx.helper.make_model(
            onnx.helper.make_graph(nodes, "condition", inputs, [onnx.ValueInfoProto(name=cond)], inits),
            opset_imports=list(opsets),
        )
        try:
            value = ReferenceEvaluator(mini).run([cond], dict(values))[0]
        except Exception:  # noqa: BLE001 -- an op the reference runtime lacks: the If is left as it is
            return None
    value = np.asarray(value)
    return bool(value.ravel()[0]) if value.size == 1 else None


def _drop_unread(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove the nodes of ``names`` (a condition's cone) that nothing reads any more, and the initializers
    only they read."""
    outputs = {o.name for o in graph.output}
    dropped: list[onnx.NodeProto] = []
    while True:
        read = {t for _, n in _all_nodes(graph) for t in n.input} | outputs
        dead = [n for n in graph.node if n.name in names and not any(o in read for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
        dropped.extend(dead)
    if dropped:
        read = {t for _, n in _all_nodes(graph) for t in n.input} | outputs
        was_read = {t for n in dropped for t in n.input}
        keep = [i for i in graph.initializer if i.name in read or i.name not in was_read]
        del graph.initializer[:]
        graph.initializer.extend(keep)


def _all_nodes(graph: onnx.GraphProto) -> list[tuple[str, onnx.NodeProto]]:
    out: list[tuple[str, onnx.NodeProto]] = []
    _collect_nodes(graph, "", out)
    return out


def show_value(value: np.ndarray) -> str:
    """A value as the notes and errors write it (``16000``, ``[1, 2]``, ``true``): its JSON text."""
    import json

    return json.dumps(np.asarray(value).tolist())


def _data_if_notes(found: list[DataIf]) -> list[str]:
    """One note for the If nodes inlined on the data's values, one for those only named (no flag)."""
    notes = []
    for inlined in (True, False):
        group = [d for d in found if d.inlined == inlined]
        if not group:
            continue
        values = dict(kv for d in group for kv in d.inputs)
        shown = [show_value(v) for v in values.values()]
        one = len(values) == 1
        where = (
            f"input{'' if one else 's'} {' and '.join(values)}, {' and '.join(shown)} in every calibration and "
            "evaluation sample"
        )
        valid = " and ".join(f"{name} = {v}" for name, v in zip(values, shown, strict=True))
        branches = " and ".join(f"the {d.branch} of If {d.node!r}" for d in group)
        if inlined:
            whose = "its condition reads" if len(group) == 1 else "their conditions read"
            notes.append(f"inlined {branches} ({whose} {where}): the quantized model is valid only for {valid}")
        else:
            ifs = " and ".join(f"If {d.node!r}" for d in group)
            whose = f"the condition of {ifs} reads" if len(group) == 1 else f"the conditions of {ifs} read"
            notes.append(
                f"{whose} only {where}: {'its' if len(group) == 1 else 'their'} branches stay FP32 because ORT "
                f"quantizes no subgraph; re-run with --inline-constant-if to inline {branches} and quantize it "
                f"(the quantized model is then valid only for {valid})"
            )
    return notes


def _inline_branch(
    graph: onnx.GraphProto, node: onnx.NodeProto, branch: onnx.GraphProto
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes and initializers of ``branch``, renamed so they fit in ``graph`` in place of ``node``."""
    existing = (
        {i.name for i in graph.input} | {i.name for i in graph.initializer} | {o.name for o in graph.output}
    )
    existing |= {o for n in graph.node for o in n.output}
    produced = [i.name for i in branch.initializer] + [o for n in branch.node for o in n.output if o]
    rename: dict[str, str] = {}
    for name in produced:
        if name in existing:
            new = f"{node.name}/{name}"
            while new in existing:
                new += "_"
            existing.add(new)
            rename[name] = new
    node_outputs = {o for n in branch.node for o in n.output if o}
    extra: list[onnx.NodeProto] = []
    claimed: set[str] = set()
    for bo, target in zip(branch.output, node.output, strict=False):
        if not target:
            continue
        if bo.name in node_outputs and bo.name not in claimed:
            claimed.add(bo.name)
            rename[bo.name] = target
        else:
            extra.append(
                onnx.helper.make_node("Identity", [bo.name], [target], name=f"{node.name}/{target}/identity")
            )
    nodes = []
    for n in list(branch.node) + extra:
        new = onnx.NodeProto()
        new.CopyFrom(n)
        _rename_io(new, rename)
        nodes.append(new)
    inits = []
    for init in branch.initializer:
        t = onnx.TensorProto()
        t.CopyFrom(init)
        t.name = rename.get(t.name, t.name)
        inits.append(t)
    return nodes, inits


def _rename_io(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    for k, name in enumerate(node.input):
        if name in rename:
            node.input[k] = rename[name]
    for k, name in enumerate(node.output):
        if name in rename:
            node.output[k] = rename[name]
    for attr in node.attribute:  # nested subgraphs may read renamed outer-scope tensors
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for sub in subs:
            for sn in sub.node:
                _rename_io(sn, {k: v for k, v in rename.items() if k not in {o for o in sn.output}})


_KNOWN_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "ai.onnx.training"}


def _check_known_domains(model: ModelProto, path: Path) -> None:
    nodes: list[tuple[str, onnx.NodeProto]] = []
    _collect_nodes(model.graph, "", nodes)
    local_functions = {(f.domain, f.name) for f in model.functions}
    for _, node in nodes:
        if node.domain not in _KNOWN_DOMAINS and (node.domain, node.op_type) not in local_functions:
            raise QDebugError(
                f"node {node.name!r} uses custom op {node.domain}::{node.op_type}, unknown to ONNX Runtime",
                "register the custom op library with ORT, or export the model without custom ops",
                ExitCode.MODEL,
            )
