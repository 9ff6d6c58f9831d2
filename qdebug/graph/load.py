"""Load a user's ONNX model and normalize it into the base for every later step.

Normalization is a pure function of the model bytes (deterministic, never
mutating its input, never touching the user's file):

* opset >= 10 (quantization needs it; ``upgrade_opset`` converts older models);
* every node gets a unique, deterministic name -- ``nodes_to_exclude`` matches
  node names, and all unnamed nodes share the name ``""``;
* weights held in ``Constant`` nodes become initializers (ORT's quantizer only
  quantizes initializer weights, so they would otherwise silently stay FP32);
* shape inference that survives dynamic dimensions (symbolic, then with
  ``auto_merge``, then plain ONNX inference), saying which one worked.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import ModelProto

from qdebug.errors import ExitCode, QDebugError

MIN_OPSET = 10
PER_CHANNEL_OPSET = 13


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


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in chunks (models can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
        raise QDebugError(f"{what} path {p} is a directory, not an .onnx file", "pass the .onnx file", ExitCode.INPUT)
    try:
        proto = onnx.load(str(p), load_external_data=True)
    except FileNotFoundError as e:
        raise QDebugError(
            f"{what} {p} refers to external data that is missing ({Path(e.filename or '').name or e})",
            "keep the external data files next to the .onnx file",
            ExitCode.INPUT,
        ) from None
    except Exception as e:  # protobuf raises several unrelated types for garbage input
        raise QDebugError(
            f"{p} is not a readable ONNX model ({e.__class__.__name__})",
            "pass an .onnx file exported by your framework",
            ExitCode.INPUT,
        ) from None
    if not proto.HasField("graph") or len(proto.graph.node) == 0:
        raise QDebugError(f"{p} is not an ONNX model (no graph or no nodes)", "pass a valid .onnx file", ExitCode.INPUT)
    opset = default_opset(proto)
    if opset == 0:
        raise QDebugError(f"{p} imports no default ONNX opset", "re-export the model with a standard opset")
    return LoadedModel(path=p, proto=proto, sha256=sha256_file(p), opset=opset)


def normalize(loaded: LoadedModel, *, upgrade_opset: bool = False, min_opset: int = MIN_OPSET) -> NormalizedModel:
    """Return the normalized copy of ``loaded.proto`` (see module docstring); the input is not mutated."""
    model = ModelProto()
    model.CopyFrom(loaded.proto)
    notes: list[str] = []
    model = _ensure_opset(model, loaded.path, upgrade_opset, min_opset, notes)
    name_map = _name_nodes(model.graph, notes)
    _constants_to_initializers(model.graph, notes)
    _check_known_domains(model, loaded.path)
    model = _infer_shapes(model, notes)
    return NormalizedModel(proto=model, name_map=tuple(name_map), notes=tuple(notes), opset=default_opset(model))


def _ensure_opset(model: ModelProto, path: Path, upgrade: bool, min_opset: int, notes: list[str]) -> ModelProto:
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
    return converted


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


def _constants_to_initializers(graph: onnx.GraphProto, notes: list[str]) -> None:
    """Move main-graph ``Constant(value=tensor)`` nodes into initializers."""
    keep = []
    moved = 0
    existing = {init.name for init in graph.initializer}
    for node in graph.node:
        value = None
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
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
        notes.append(f"turned {moved} Constant node(s) into initializers so their weights can be quantized")


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
    """Run shape inference, falling back gracefully on dynamic shapes.

    ONNX inference runs first: it is fast and is what ORT's quantizer itself
    uses. Only when it fails, or leaves activations without a type, is ORT's
    symbolic inference tried (what ``quant_pre_process`` uses; it fails with
    defaults on many dynamic models, so ``auto_merge=True`` is tried next).
    Importing it is slow where torch is installed, hence not the first choice.
    """
    inferred: ModelProto | None = None
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as e:
        notes.append(f"ONNX shape inference failed ({e.__class__.__name__})")
    if inferred is not None and not _untyped_activations(inferred):
        return inferred
    symbolic = _symbolic_inference(model, notes)
    if symbolic is not None:
        return symbolic
    if inferred is not None:
        notes.append(
            f"{len(_untyped_activations(inferred))} tensor(s) have no inferred type; ORT infers them at run time"
        )
        return inferred
    return model


def _untyped_activations(model: ModelProto) -> list[str]:
    typed = {vi.name for vi in model.graph.value_info if vi.type.tensor_type.elem_type}
    typed |= {vi.name for vi in model.graph.output} | {i.name for i in model.graph.initializer}
    return [o for n in model.graph.node for o in n.output if o and o not in typed]


def _symbolic_inference(model: ModelProto, notes: list[str]) -> ModelProto | None:
    if model.ByteSize() >= (1 << 31) - (1 << 20):
        return None
    try:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference
    except Exception:  # pragma: no cover - depends on the ORT build
        return None
    for auto_merge in (False, True):
        try:
            out = SymbolicShapeInference.infer_shapes(model, auto_merge=auto_merge)
        except Exception:
            continue
        if out is not None:
            how = "with auto_merge=True (dynamic dimensions merged)" if auto_merge else "(ORT symbolic)"
            notes.append(f"shape inference completed {how}")
            return out
    notes.append("ORT symbolic shape inference failed even with auto_merge=True; kept ONNX inference results")
    return None


def save_model(model: ModelProto, path: Path) -> None:
    """Save a model atomically (temp file + rename); external data for > 2 GB models."""
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    large = model.ByteSize() > (1 << 31) - (1 << 24)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if large:
            onnx.save_model(model, tmp, save_as_external_data=True, location=path.name + ".data")
        else:
            onnx.save_model(model, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_value_info(name: str) -> onnx.ValueInfoProto:
    """A bare graph-output declaration: ORT infers type and shape itself."""
    return onnx.ValueInfoProto(name=name)
