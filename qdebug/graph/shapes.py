"""Shape inference that survives dynamic dimensions and ends with every tensor typed (:func:`infer_shapes`).

The fallback chain: ONNX inference; where it leaves tensors untyped, ORT's symbolic inference, then with
``auto_merge``; then the element types ORT resolves when it loads the model. Each step that was needed is
named in a note. A ``Concat(axis=-1)`` of 1-D shape values gets ``axis=0`` first (the same result), which
ORT's symbolic inference -- and ``quant_pre_process`` -- asserts on. onnxruntime is imported only when a
fallback runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
from onnx import ModelProto

from qdebug.graph.modelfile import is_large, save_with_external_data


def infer_shapes(model: ModelProto, notes: list[str]) -> ModelProto:
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
