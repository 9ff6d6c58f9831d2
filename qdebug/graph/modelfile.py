"""Model files: reading, writing and measuring an ONNX model, the user's or one qdebug builds.

:func:`load_model` reads and checks a file and the external data next to it; :func:`save_model` writes
atomically, through external data (:func:`save_with_external_data`) for a model over the protobuf limit
(:data:`PROTO_LIMIT`, :func:`is_large`). :func:`stored_size` is a saved model's bytes on disk,
:func:`weight_bytes` how many of its weights are float. Never mutates the model it is given.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import ModelProto

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import sha256_file

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

    from qdebug.output.files import output_mode

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
    from qdebug.output.files import output_mode

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
        from qdebug.output.files import write_hint

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
