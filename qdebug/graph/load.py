"""Load a user's ONNX model and normalize it into the base for every later step.

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
  replaces the node) when asked -- ORT quantizes no subgraph;
* shape inference that survives dynamic dimensions and ends with every tensor
  typed (ONNX inference; where it leaves tensors untyped ORT's symbolic one, then
  with ``auto_merge``, then the types ORT resolves when it loads the model), saying
  which one worked; a ``Concat(axis=-1)`` of 1-D shape values gets ``axis=0`` (the
  same result), which ORT's symbolic inference -- and ``quant_pre_process`` --
  asserts on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import ModelProto, numpy_helper

from qdebug.errors import ExitCode, QDebugError
from qdebug.files import sha256_file

MIN_OPSET = 10
PER_CHANNEL_OPSET = 13
PROTO_LIMIT = (1 << 31) - (1 << 24)
"""Models above this many bytes cannot be serialized as one protobuf: they go through external data."""


def is_large(model: ModelProto) -> bool:
    """True when ``model`` must be saved and loaded with external data (protobuf's 2 GB limit).

    ``ModelProto.ByteSize()`` costs 40-60 ms on a 25 MB model and a run asks
    several times; the weights' byte counts plus the small messages' sizes give
    the same answer in a third of that, and only a model within 64 MB of the
    limit is measured exactly.
    """
    g = model.graph
    estimate = sum(len(t.raw_data) + 64 if t.raw_data else t.ByteSize() for t in g.initializer)
    estimate += sum(m.ByteSize() for m in (*g.node, *g.sparse_initializer, *model.functions))
    estimate += sum(v.ByteSize() for v in (*g.input, *g.output, *g.value_info, *g.quantization_annotation))
    estimate += sum(m.ByteSize() for m in (*model.metadata_props, *model.training_info, *model.opset_import))
    estimate += len(model.doc_string) + len(g.doc_string)
    if estimate < PROTO_LIMIT - (1 << 26):
        return False
    return model.ByteSize() > PROTO_LIMIT


def save_with_external_data(model: ModelProto, path: Path, location: str | None = None) -> None:
    """Save a copy of ``model`` with every initializer over 1 KB in one external file next to ``path``.

    Written here rather than by ``onnx.save_model(save_as_external_data=True)``,
    which appends to a data file that already exists (each re-run into the same
    output grew it by the whole model) and refuses a ``location`` that exists
    relative to the *working* directory. The data goes to a temp file renamed
    over ``location``; a caller that saves atomically renames the model last.
    The caller's model is not modified.
    """
    import os
    import tempfile

    from qdebug.files import output_mode

    location = location or path.name + ".data"
    target = path.parent / location
    copy = ModelProto()
    copy.CopyFrom(model)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{location}.", suffix=".tmp")
    with _unlinked_on_failure(tmp):
        with os.fdopen(fd, "wb") as f:
            for tensor in _initializers(copy.graph):
                if len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                    continue
                offset = f.tell()
                f.write(tensor.raw_data)
                del tensor.external_data[:]
                for key, value in (
                    ("location", location),
                    ("offset", offset),
                    ("length", len(tensor.raw_data)),
                ):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, str(value)
                tensor.data_location = onnx.TensorProto.EXTERNAL
                tensor.ClearField("raw_data")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, output_mode(target))
        os.replace(tmp, target)
    onnx.save_model(copy, str(path))


EXTERNAL_MIN_BYTES = 1024
"""Initializers this large go to the external data file (as ``onnx``'s own default threshold)."""


def iter_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph below it (If branches, Loop and Scan bodies), outermost first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                yield from iter_graphs(attr.g)
            for sub in attr.graphs:
                yield from iter_graphs(sub)


def _initializers(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Every initializer of ``graph`` and of its subgraphs."""
    for g in iter_graphs(graph):
        yield from g.initializer


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model as read from disk, with what identifies it."""

    path: Path
    proto: ModelProto
    sha256: str
    opset: int


@dataclass(frozen=True, eq=False)
class NormalizedModel:
    """The normalized model plus what normalization did (for the report's notes)."""

    proto: ModelProto
    name_map: tuple[tuple[str, str], ...]
    """(new name, original name) for every renamed node."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    opset: int = 0


def default_opset(model: ModelProto) -> int:
    """The opset of the default ONNX domain (``""`` or ``ai.onnx``)."""
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


def load_model(path: str | Path, what: str = "model") -> LoadedModel:
    """Read and check an ONNX file; every failure is one clear :class:`QDebugError`."""
    p = Path(path)
    if not p.exists():
        raise QDebugError(f"{what} file not found: {p}", "check the path", ExitCode.INPUT)
    if p.is_dir():
        raise QDebugError(
            f"{what} path {p} is a directory, not an .onnx file", "pass the .onnx file", ExitCode.INPUT
        )
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types for garbage input
        raise QDebugError(
            f"{p} is not a readable ONNX model ({e.__class__.__name__})",
            "pass an .onnx file exported by your framework",
            ExitCode.INPUT,
        ) from None
    _load_external_data(proto, p, what)
    if not proto.HasField("graph") or len(proto.graph.node) == 0:
        raise QDebugError(
            f"{p} is not an ONNX model (no graph or no nodes)", "pass a valid .onnx file", ExitCode.INPUT
        )
    opset = default_opset(proto)
    if opset == 0:
        raise QDebugError(f"{p} imports no default ONNX opset", "re-export the model with a standard opset")
    return LoadedModel(path=p, proto=proto, sha256=sha256_file(p), opset=opset)


def _load_external_data(proto: ModelProto, path: Path, what: str) -> None:
    """Read the weights stored next to the model (external data); a missing file is named."""
    from onnx import external_data_helper

    locations = set()
    for t in _all_tensors(proto.graph):
        if external_data_helper.uses_external_data(t):
            info = {e.key: e.value for e in t.external_data}
            locations.add(info.get("location", ""))
    if not locations:
        return
    missing = sorted(loc for loc in locations if not (path.parent / loc).is_file())
    if missing:
        raise QDebugError(
            f"{what} {path} stores its weights in external data file(s) that are missing: {', '.join(missing[:3])}",
            f"keep the external data files next to {path.name} (their paths are relative to it)",
            ExitCode.INPUT,
        )
    try:
        external_data_helper.load_external_data_for_model(proto, str(path.parent))
    except Exception as e:
        raise QDebugError(
            f"the external data of {what} {path} could not be read ({e.__class__.__name__}: {str(e)[:150]})",
            "re-save the model with onnx.save_model(..., save_as_external_data=True)",
            ExitCode.INPUT,
        ) from None


def _all_tensors(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    """Initializers and tensor attributes of ``graph`` and all its subgraphs."""
    out = list(graph.initializer)
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                out.append(attr.t)
            out.extend(attr.tensors)
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                out.extend(_all_tensors(sub))
    return out


def normalize(
    loaded: LoadedModel,
    *,
    upgrade_opset: bool = False,
    min_opset: int = MIN_OPSET,
    inline_constant_if: bool = False,
) -> NormalizedModel:
    """Return the normalized copy of ``loaded.proto`` (see module docstring); the input is not mutated."""
    model = ModelProto()
    model.CopyFrom(loaded.proto)
    notes: list[str] = []
    model = _ensure_opset(model, loaded.path, upgrade_opset, min_opset, notes)
    name_map = _name_nodes(model.graph, notes)
    _constants_to_initializers(model.graph, notes)
    if _inline_constant_ifs(model.graph, inline_constant_if, notes):
        _constants_to_initializers(model.graph, [])
    _drop_initializer_inputs(model.graph, notes)
    _outputs_that_are_inputs(model.graph, notes)
    _unshare_biases(model, notes)
    _check_known_domains(model, loaded.path)
    model = _infer_shapes(model, notes)
    return NormalizedModel(
        proto=model, name_map=tuple(name_map), notes=tuple(notes), opset=default_opset(model)
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


def _inline_constant_ifs(graph: onnx.GraphProto, enabled: bool, notes: list[str]) -> bool:
    """Replace each top-level ``If`` whose condition is a constant initializer by its taken branch.

    Returns True when something was inlined. Without ``enabled`` only a note
    says which If nodes could be inlined (and that their branches stay FP32).
    """
    inlined = []
    candidates = []
    for _ in range(64):  # nested constant Ifs surface at the top level after each pass
        index = next(
            (
                k
                for k, n in enumerate(graph.node)
                if n.op_type == "If"
                and n.domain in ("", "ai.onnx")
                and n.input
                and n.name not in candidates
                and _constant_bool(graph, n.input[0]) is not None
            ),
            None,
        )
        if index is None:
            break
        node = graph.node[index]
        taken = _constant_bool(graph, node.input[0])
        if not enabled:
            candidates.append(node.name)
            continue
        branch = next(a.g for a in node.attribute if a.name == ("then_branch" if taken else "else_branch"))
        new_nodes, new_inits = _inline_branch(graph, node, branch)
        cond = node.input[0]
        graph.node.remove(node)
        for k, n in enumerate(new_nodes):
            graph.node.insert(index + k, n)
        graph.initializer.extend(new_inits)
        if not any(cond in n.input for n in graph.node) and cond not in {o.name for o in graph.output}:
            keep = [i for i in graph.initializer if i.name != cond]
            del graph.initializer[:]
            graph.initializer.extend(keep)
        inlined.append(f"{node.name} ({'then' if taken else 'else'}_branch, {len(branch.node)} node(s))")
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
    return bool(inlined)


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


def _infer_shapes(model: ModelProto, notes: list[str]) -> ModelProto:
    """Run shape inference, falling back gracefully on dynamic shapes; every tensor should end typed.

    ONNX inference runs first: it is fast and is what ORT's quantizer itself
    uses. Only when it fails, or leaves activations without a type, is ORT's
    symbolic inference tried (what ``quant_pre_process`` uses; it fails with
    defaults on many dynamic models, so ``auto_merge=True`` is tried next).
    Importing it is slow where torch is installed, hence not the first choice.
    When both leave tensors untyped, their types are read from an ORT session
    over the model: ORT's quantizer skips a tensor without a type, and fails on
    a bias whose input it skipped ("Unable to get valid quantization scale"),
    so a model whose types are left unknown ends with float nodes or no model.
    """
    inferred: ModelProto | None = None
    try:
        inferred = _onnx_inference(model)
    except Exception as e:
        notes.append(f"ONNX shape inference failed ({e.__class__.__name__})")
    if inferred is not None:
        _concat_axes_for_symbolic(model, inferred, notes)
        if not _untyped_activations(inferred):
            return inferred
    symbolic = _symbolic_inference(model, notes)
    if symbolic is not None:
        return symbolic
    base = inferred if inferred is not None else model
    untyped = _untyped_activations(base)
    if not untyped:
        return base
    typed = _types_from_ort(base, untyped)
    if typed is not None:
        notes.append(
            f"read the types of {len(untyped)} tensor(s) that neither shape inference could type "
            f"({_some(untyped)}) from an ONNX Runtime session over the model, so ORT's quantizer sees them: "
            "it skips a tensor without a type, and fails on a bias whose input it skipped"
        )
        return typed
    notes.append(
        f"{len(untyped)} tensor(s) have no inferred type ({_some(untyped)}): ORT's quantizer does not quantize "
        "a tensor without a type, so the nodes around them stay float"
    )
    return base


def _some(names: list[str], limit: int = 4) -> str:
    """The first ``limit`` names, and how many more."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


_SHAPE_VALUE_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})


def _concat_axes_for_symbolic(model: ModelProto, inferred: ModelProto, notes: list[str]) -> None:
    """Give a Concat of 1-D shape values ``axis=0`` where it says ``-1`` (the same concatenation), in both
    ``model`` and ``inferred`` (in place).

    ORT's ``SymbolicShapeInference._infer_Concat`` tracks the values of shape arithmetic and asserts
    ``axis == 0`` when it knows every input's values: a ``Concat(axis=-1)`` building a Reshape target
    from ``Shape`` slices and constants (a MobileNetV3 at opset 11) stops it with a bare
    ``AssertionError`` -- and with it ``quant_pre_process``, which runs it first. For 1-D tensors the
    two axes are the same, so the rewrite changes no value.
    """
    g = inferred.graph
    types = {v.name: v.type.tensor_type for v in (*g.value_info, *g.input, *g.output)}
    inits = {t.name: t for t in g.initializer}

    def shape_value(name: str) -> bool:
        """A 1-D tensor whose values the symbolic inference tracks: a constant, or integer shape arithmetic."""
        if name in inits:
            return len(inits[name].dims) == 1
        t = types.get(name)
        return t is not None and t.elem_type in _SHAPE_VALUE_TYPES and t.HasField("shape") and len(t.shape.dim) == 1

    hit = [
        n.name
        for n in g.node
        if n.op_type == "Concat"
        and any(a.name == "axis" and a.i != 0 for a in n.attribute)
        and n.input
        and all(shape_value(i) for i in n.input)
    ]
    if not hit:
        return
    for proto in (model, inferred):
        for node in proto.graph.node:
            if node.name in hit:
                next(a for a in node.attribute if a.name == "axis").i = 0
    notes.append(
        f"set axis 0 on {len(hit)} Concat node(s) of 1-D shape values that said -1 ({_some(hit)}; the same "
        "concatenation): ORT's symbolic shape inference asserts axis == 0 on them (SymbolicShapeInference."
        "_infer_Concat, an ORT bug), so quant_pre_process fails on the original model; the normalized model "
        "passes it (or call quant_pre_process with skip_symbolic_shape=True)"
    )


def _onnx_inference(model: ModelProto) -> ModelProto:
    """ONNX shape inference; through a file for models over the protobuf limit."""
    if not is_large(model):
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="qdebug-shapes-") as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        save_with_external_data(model, src)
        onnx.shape_inference.infer_shapes_path(str(src), str(dst), strict_mode=False)
        return onnx.load(str(dst), load_external_data=True)


def _untyped_activations(model: ModelProto) -> list[str]:
    typed = {vi.name for vi in model.graph.value_info if vi.type.tensor_type.elem_type}
    typed |= {vi.name for vi in model.graph.output} | {i.name for i in model.graph.initializer}
    return [o for n in model.graph.node for o in n.output if o and o not in typed]


@contextmanager
def _scratch_cwd() -> Iterator[None]:
    """Run in a temporary working directory that is deleted afterwards.

    ORT's symbolic shape inference writes ``sym_shape_infer_temp.onnx`` and
    external-data files into the *current directory* for some models (seen
    with float16 QDQ models) and leaves them there: the user's directory must
    not collect them.
    """
    import os
    import tempfile

    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="qdebug-shapes-") as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(old)


def _symbolic_inference(model: ModelProto, notes: list[str]) -> ModelProto | None:
    if is_large(model):
        return None
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except Exception:  # pragma: no cover - depends on the ORT build
        return None
    failure = ""
    for auto_merge in (False, True):
        try:
            with _scratch_cwd():
                out = SymbolicShapeInference.infer_shapes(model, auto_merge=auto_merge)
        except Exception as e:
            failure = _where_symbolic_failed(e)
            continue
        if out is not None:
            how = "with auto_merge=True (dynamic dimensions merged)" if auto_merge else "(ORT symbolic)"
            notes.append(f"shape inference completed {how}")
            return out
    notes.append(
        f"ORT symbolic shape inference failed even with auto_merge=True{failure} (quant_pre_process fails "
        "the same way; skip_symbolic_shape=True avoids it); kept the ONNX inference results"
    )
    return None


def _where_symbolic_failed(e: BaseException) -> str:
    """``" (AssertionError in SymbolicShapeInference._infer_Concat at Concat node 'x')"``: the deepest
    ``_infer_*`` method of ORT's symbolic inference in ``e``'s traceback and the node it was on (its bare
    ``assert`` says nothing by itself)."""
    where, node = "", None
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name.startswith("_infer_") and frame.f_code.co_filename.endswith("symbolic_shape_infer.py"):
            where = frame.f_code.co_name
            node = frame.f_locals.get("node", node)
        tb = tb.tb_next
    at = f" at {node.op_type} node {node.name!r}" if isinstance(node, onnx.NodeProto) else ""
    method = f" in SymbolicShapeInference.{where}" if where else ""
    message = str(e).strip().splitlines()[0][:100] if str(e).strip() else ""
    return f" ({e.__class__.__name__}{': ' + message if message else ''}{method}{at})"


def _types_from_ort(model: ModelProto, names: list[str]) -> ModelProto | None:
    """A copy of ``model`` whose ``names`` get the element types ONNX Runtime resolves when it loads the
    model (every kernel's type constraints, contrib ops included); ``None`` when ORT cannot load it.

    The probe lists the tensors as untyped graph outputs, so ORT reports their types; only the element
    type is kept (what the quantizer needs), never a shape ORT did not declare.
    """
    if not names or is_large(model):
        return None
    import onnxruntime as ort

    probe = ModelProto()
    probe.CopyFrom(model)
    outputs = {o.name for o in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in outputs)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:
        return None
    types = {o.name: o.type for o in session.get_outputs()}
    typed = ModelProto()
    typed.CopyFrom(model)
    for name in names:
        elem = _onnx_elem_type(types.get(name, ""))
        if elem:
            typed.graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem, None))
    return typed if not _untyped_activations(typed) else None


def _onnx_elem_type(ort_type: str) -> int:
    """``"tensor(float)"`` -> ``TensorProto.FLOAT``; 0 for anything else (sequences, maps, unknown)."""
    if not (ort_type.startswith("tensor(") and ort_type.endswith(")")):
        return 0
    try:
        return int(onnx.TensorProto.DataType.Value(ort_type[7:-1].upper()))
    except ValueError:
        return 0


_FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
)


@dataclass(frozen=True)
class WeightBytes:
    """How many bytes of a model's initializers there are, and how many of them are float.

    A quantized model's file size says nothing about what was quantized: a CNN+LSTM reader's static
    QDQ model is half its FP32 size because ORT leaves the LSTM's weights float, and only this split
    shows it (the size columns had read as "quantized").
    """

    total: int
    """Bytes of every initializer and Constant value (main graph and subgraphs), from their shapes:
    external data counts."""
    floating: int
    """Bytes of the float ones among them, Q/DQ scales left out (quantization parameters)."""
    by_node: tuple[tuple[str, str, int], ...] = ()
    """``(node, op_type, float bytes)`` of the nodes that read float weights, largest first; a weight
    read by several nodes counts for the first, one inside a subgraph for the node holding it."""

    def of(self, node: str) -> int:
        """Float weight bytes ``node`` reads (0 when it reads none)."""
        return next((b for name, _, b in self.by_node if name == node), 0)


def _tensor_bytes(t: onnx.TensorProto) -> int:
    """Bytes of ``t``'s values from its shape and type, wherever they are stored (raw, typed, external)."""
    if t.raw_data:
        return len(t.raw_data)
    count = 1
    for d in t.dims:
        count *= int(d)
    try:
        return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except Exception:  # strings and types numpy cannot hold
        return t.ByteSize()


def weight_bytes(model: ModelProto) -> WeightBytes:
    """The :class:`WeightBytes` of ``model`` (its weights need not be loaded: shapes are enough)."""
    stored = dict(_stored_tensors(model.graph))
    floats = {name: t for name, t in stored.items() if t.data_type in _FLOAT_TYPES}
    total = sum(_tensor_bytes(t) for t in stored.values())
    seen: set[str] = set()
    per_node: list[tuple[str, str, int]] = []
    for top in model.graph.node:
        size = sum(_tensor_bytes(floats[name]) for name in _float_weights_read(top, floats, seen))
        if size:
            per_node.append((top.name, top.op_type, size))
    per_node.sort(key=lambda x: -x[2])
    return WeightBytes(total=total, floating=sum(b for *_, b in per_node), by_node=tuple(per_node))


def _stored_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """``(name, tensor)`` of every initializer and ``Constant`` value in ``graph`` and its subgraphs: a
    weight held in a Constant node is a weight too (ORT's quantize_static leaves it float)."""
    for g in iter_graphs(graph):
        for t in g.initializer:
            yield t.name, t
        for node in g.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
                for attr in node.attribute:
                    if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                        yield node.output[0], attr.t


def _float_weights_read(top: onnx.NodeProto, floats: dict[str, onnx.TensorProto], seen: set[str]) -> list[str]:
    """The float initializers ``top`` and the nodes of its subgraphs read that no earlier node did (added
    to ``seen``); a Q/DQ node's scale (input 1) is a quantization parameter, not a weight."""
    nodes = [top]
    for attr in top.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            nodes += [n for g in iter_graphs(sub) for n in g.node]
    found = []
    for node in nodes:
        scale_at = 1 if node.op_type in ("QuantizeLinear", "DequantizeLinear") else -1
        for k, name in enumerate(node.input):
            if name in floats and name not in seen and k != scale_at:
                seen.add(name)
                found.append(name)
    return found


def stored_size(path: Path) -> int:
    """Bytes a saved model takes on disk: its file plus the external-data files its weights are in.

    The ``.onnx`` file alone leaves out the weights of a model over 2 GB (and of
    any model saved with external data), so sizes compared across variants
    would compare a pointer file with a whole model.
    """
    size = path.stat().st_size
    proto = onnx.load(str(path), load_external_data=False)
    places = {
        entry.value
        for t in proto.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }
    return size + sum((path.parent / p).stat().st_size for p in places if (path.parent / p).is_file())


def save_model(model: ModelProto, path: Path) -> None:
    """Save a model atomically (temp file + rename); external data for > 2 GB models.

    A write that fails (disk full, a directory that cannot be created) is one
    :class:`QDebugError` line with exit 7, like the report's own writes.
    """
    import os
    import tempfile

    from qdebug.errors import ExitCode, QDebugError
    from qdebug.files import output_mode

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        large = is_large(model)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        with _unlinked_on_failure(tmp):
            if large:
                # the weights go to <name>.data first; the model file that points to them is renamed last
                save_with_external_data(model, Path(tmp), location=path.name + ".data")
            else:
                onnx.save_model(model, tmp)
            os.chmod(tmp, output_mode(path))
            os.replace(tmp, path)
    except OSError as e:
        from qdebug.files import write_hint

        raise QDebugError(f"cannot write {path}: {e.strerror or e}", write_hint(e), ExitCode.OUTPUT) from None


@contextmanager
def _unlinked_on_failure(tmp: str) -> Iterator[None]:
    """Remove the temp file ``tmp`` if the block fails or is interrupted before renaming it."""
    import os

    try:
        yield
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
