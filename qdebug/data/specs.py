"""What the model expects of its data: each input's name, dtype and shape, and the axis its samples lie on.

:func:`model_input_specs` reads the inputs off the model and :func:`decide_batch_axes` gives each its batch
axis from the declared shapes (``--batch-axis`` overrides win); :func:`resolve_batch_axes` settles the axes
the model leaves open from the first file's or hook item's shapes. :func:`fixed_batch` is the model's fixed
batch dimension, :func:`batch_axis_note` the line a report carries about the axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from qdebug.errors import ExitCode, QDebugError

LABELS_KEY = "labels"


BATCH_AXIS_FLAG = "--batch-axis"


UNDECIDED = "?"
"""``InputSpec.batch_rule`` of an axis the model cannot tell (unnamed dynamic dims): read off the data."""


NO_AXIS_RULE = (
    "no axis every input shares (neither a common symbolic dimension nor a common size), so each file or hook "
    "item is one indivisible batch, counted as one sample"
)


@dataclass(frozen=True)
class InputSpec:
    """What the model expects for one input."""

    name: str
    dtype: np.dtype
    shape: tuple[int | str | None, ...]
    """Static dims as ints; dynamic dims as their symbolic name or ``None``."""
    index_rows: tuple[int, str] | None = None
    """For integer ids read by a Gather from a weight table: (rows of the table, the Gather's name). Ids
    outside it made ORT fail mid-calibration ("indices element out of data bounds", exit 4)."""
    scalar: bool = False
    """The model declares rank 0 (a threshold, a temperature): one value per file or hook item, fed whole
    with every batch cut from it, never split or stacked on an axis 0 it does not have."""
    batch_axis: int | None = 0
    """The axis its samples are stacked on (a streaming model's state ``[2, batch, 128]``: 1); None when it
    has none (a scalar; no axis every input shares): fed whole with every batch."""
    batch_rule: str = ""
    """How the axes were decided, for the data note ("" for the plain axis 0: nothing to say)."""

    def describe(self) -> str:
        """``name: float32[N,3,224,224]`` for messages."""
        dims = ",".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"


def model_input_specs(
    model: Any, batch_axes: Sequence[tuple[str, int | None]] = ()
) -> tuple[InputSpec, ...]:
    """The inputs the data must feed: graph inputs that are neither initializers (a default the model
    carries) nor ``optional`` (ORT runs without them; they had been demanded, as float32), each with its
    batch axis (:func:`decide_batch_axes`; ``batch_axes``: the user's ``--batch-axis`` overrides)."""
    from onnx import helper

    inits = {i.name for i in model.graph.initializer}
    rows = _gather_rows(model)
    specs = []
    for vi in model.graph.input:
        if vi.name in inits or vi.type.WhichOneof("value") == "optional_type":
            continue
        tt = vi.type.tensor_type
        dtype = (
            np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else np.dtype("float32")
        )
        dims: list[int | str | None] = []
        if tt.HasField("shape"):
            for d in tt.shape.dim:
                if d.HasField("dim_value") and d.dim_value > 0:
                    dims.append(int(d.dim_value))
                else:
                    dims.append(d.dim_param or None)
        scalar = tt.HasField("shape") and not dims  # an input without a shape has an unknown rank, not 0
        index = rows.get(vi.name) if dtype.kind in "iu" else None
        specs.append(InputSpec(vi.name, dtype, tuple(dims), index, scalar, None if scalar else 0))
    return decide_batch_axes(tuple(specs), batch_axes)


def _gather_rows(model: Any) -> dict[str, tuple[int, str]]:
    """Graph input -> (rows, Gather name) of the smallest weight table a Gather indexes with it."""
    tables = {t.name: list(t.dims) for t in model.graph.initializer}
    out: dict[str, tuple[int, str]] = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        dims = tables.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if not dims or not -len(dims) <= axis < len(dims):
            continue
        n = int(dims[axis])
        if node.input[1] not in out or n < out[node.input[1]][0]:
            out[node.input[1]] = (n, node.name or "Gather")
    return out


def decide_batch_axes(
    specs: tuple[InputSpec, ...], overrides: Sequence[tuple[str, int | None]] = ()
) -> tuple[InputSpec, ...]:
    """Each input's batch axis, read off the model's declared shapes (``overrides`` win).

    In order: a symbolic dimension every input has once and whose name says batch (``batch``,
    ``batch_size``, ``N``...), wherever it sits; axis 0 when the inputs agree there (all dynamic, or one
    size); the only symbolic dimension they share; the only static size they share (``[1, 576]`` and
    ``[2, 1, 128]``: axis 0 and 1). Where unnamed dynamic dimensions leave that open the data decides
    (:func:`resolve_batch_axes`); with no axis at all, none: each file or hook item is one batch. A
    streaming model's state ``[2, batch, 128]`` had been cut on axis 0, its 2 layers read as 2 samples.
    """
    wanted = _checked_overrides(specs, overrides)
    shapes = {s.name: s.shape for s in specs if s.shape and s.name not in wanted}
    axes, rule = _model_axes(shapes)
    if wanted:  # the others as the model says (axis 0 where it cannot tell)
        rest = rule if rule != UNDECIDED else ""
        rule = f"{BATCH_AXIS_FLAG} for {', '.join(map(repr, wanted))}" + (f"; the others from {rest}" if rest else "")
        axes = {**(axes or {}), **wanted}
    elif axes is None:
        rule = UNDECIDED
    return tuple(_with_axis(s, (axes or {}).get(s.name, 0), rule) for s in specs)


def _with_axis(spec: InputSpec, axis: int | None, rule: str) -> InputSpec:
    return dataclasses.replace(spec, batch_axis=None if spec.scalar else axis, batch_rule=rule)


def _checked_overrides(
    specs: tuple[InputSpec, ...], overrides: Sequence[tuple[str, int | None]]
) -> dict[str, int | None]:
    """``--batch-axis`` pairs checked against the model: a known input, an axis within its rank."""
    by_name = {s.name: s for s in specs}
    out: dict[str, int | None] = {}
    for name, axis in overrides:
        spec = by_name.get(name)
        if spec is None:
            raise QDebugError(
                f"{BATCH_AXIS_FLAG} {name}={axis}: the model has no input {name!r}",
                f"name one of {sorted(by_name)}",
                ExitCode.USAGE,
            )
        rank = len(spec.shape)
        if axis is not None and (spec.scalar or (rank and not -rank <= axis < rank)):
            raise QDebugError(
                f"{BATCH_AXIS_FLAG} {name}={axis}: {spec.describe()} has no axis {axis}",
                f"give an axis in 0..{max(rank - 1, 0)}, or {name}=none to feed it whole with every batch",
                ExitCode.USAGE,
            )
        out[name] = axis % rank if axis is not None and rank else axis
    return out


def _batch_like(name: str) -> bool:
    low = name.lower()
    return "batch" in low or low in ("n", "b", "bs", "bsz", "nb")


def _model_axes(shapes: Mapping[str, tuple[int | str | None, ...]]) -> tuple[dict[str, int | None] | None, str]:
    """(axes, rule) from the declared shapes of the ranked inputs; axes None: the model cannot tell."""
    if not shapes:
        return {}, ""
    dims = list(shapes.values())
    shared = [d for d in dims[0] if isinstance(d, str) and all(x.count(d) == 1 for x in dims)]
    likely = [d for d in shared if _batch_like(d)]
    firsts = {d[0] for d in dims}
    if likely or (len(shared) == 1 and not _axis0_agrees(firsts)):
        name = next((d for d in likely if firsts == {d}), (likely or shared)[0])
        axes = {k: d.index(name) for k, d in shapes.items()}
        dimension = f"the symbolic dimension {name!r} " + ("every input has" if len(dims) > 1 else "of the input")
        return axes, ("" if set(axes.values()) == {0} else dimension)
    if _axis0_agrees(firsts):
        return {k: 0 for k in shapes}, ""
    size = _shared_value(dims)
    if size is not None:
        return {k: d.index(size) for k, d in shapes.items()}, f"size {size}, the only one every input declares"
    if any(x is None for d in dims for x in d):
        return None, UNDECIDED
    return {k: None for k in shapes}, NO_AXIS_RULE


def _axis0_agrees(firsts: set[Any]) -> bool:
    """Axis 0 is every input's batch: all dynamic there, or all of one size."""
    return not any(isinstance(d, int) for d in firsts) or len(firsts) == 1


def _shared_value(dims: Sequence[Sequence[Any]]) -> int | None:
    """The only int every shape has exactly once (None: no such size, or several)."""
    sizes = [d for d in dict.fromkeys(dims[0]) if isinstance(d, int) and all(list(x).count(d) == 1 for x in dims)]
    return sizes[0] if len(sizes) == 1 and len(dims) > 1 else None


def resolve_batch_axes(
    specs: tuple[InputSpec, ...], shapes: Mapping[str, tuple[int, ...]], origin: str
) -> tuple[InputSpec, ...]:
    """Axes the model left open (:data:`UNDECIDED`) read off the first file's or item's ``shapes``.

    Only an input's unnamed dynamic dimensions can be its batch (all of them when it has none): axis 0
    when it is one for every input and the sizes agree there, else the only size every input has once
    among them, else none (each file or item one batch). An input ``[?, 64]`` with a state ``[2, ?, 16]``
    in files of 2 streams: axis 0 and 1, not the state's 2 layers.
    """
    if not any(s.batch_rule == UNDECIDED for s in specs):
        return specs
    ranked = {s.name: s for s in specs if not s.scalar and shapes.get(s.name)}
    if not ranked:
        return tuple(_with_axis(s, 0, "") for s in specs)
    open_dims = {k: _open_axes(s, len(shapes[k])) for k, s in ranked.items()}
    sizes = {k: [int(shapes[k][i]) for i in axes] for k, axes in open_dims.items()}
    if all(a[:1] == [0] for a in open_dims.values()) and len({v[0] for v in sizes.values()}) == 1:
        return tuple(_with_axis(s, 0, "") for s in specs)
    common = [n for n in dict.fromkeys(next(iter(sizes.values()))) if all(v.count(n) == 1 for v in sizes.values())]
    if len(common) != 1:
        return tuple(_with_axis(s, None, NO_AXIS_RULE) for s in specs)
    axes = {k: open_dims[k][sizes[k].index(common[0])] for k in ranked}
    rule = f"size {common[0]}, the only one every input has in {origin}, as the model names none of its dimensions"
    return tuple(_with_axis(s, axes.get(s.name, 0), rule) for s in specs)


def _open_axes(spec: InputSpec, rank: int) -> list[int]:
    """The axes of an input whose size the model leaves open and unnamed (every axis when none is)."""
    unnamed = [i for i, d in enumerate(spec.shape) if d is None]
    return unnamed or list(range(rank))


def batch_axes(specs: Sequence[InputSpec]) -> dict[str, int | None]:
    """Input name -> batch axis (None: fed whole), for :func:`take_rows` and friends."""
    return {s.name: s.batch_axis for s in specs}


def batch_axis_note(specs: Sequence[InputSpec]) -> str | None:
    """The one line that says which batch axis each input got and why (None for the plain axis 0)."""
    rule = next((s.batch_rule for s in specs if s.batch_rule), "")
    if not rule:
        return None
    if rule == NO_AXIS_RULE:
        head = f"batch axis: none ({rule})"
    else:
        where = ", ".join(
            f"{s.name!r} on axis {s.batch_axis}" for s in specs if s.batch_axis is not None
        )
        whole = [f"{s.name!r}" + (" (a scalar)" if s.scalar else "") for s in specs if s.batch_axis is None]
        fed = f"; {', '.join(whole)} fed whole with every batch" if whole else ""
        head = f"batch axis: {where or 'none'} (from {rule}){fed}; samples are cut, counted and scored on it"
    return f"{head} (override with {BATCH_AXIS_FLAG} NAME=AXIS)"


def output_batch_axes(model: Any, specs: Sequence[InputSpec]) -> dict[str, int]:
    """Graph output -> its batch axis: where it has the symbolic dimension the inputs' batch axes share
    (a new state ``[2, batch, 128]``: 1), else 0."""
    symbols = {
        s.shape[s.batch_axis]
        for s in specs
        if s.batch_axis is not None and s.batch_axis < len(s.shape)
    }
    symbol = symbols.pop() if len(symbols) == 1 else None
    out = {}
    for vi in model.graph.output:
        names = [d.dim_param for d in vi.type.tensor_type.shape.dim] if vi.type.HasField("tensor_type") else []
        out[vi.name] = names.index(symbol) if isinstance(symbol, str) and names.count(symbol) == 1 else 0
    return out


def fixed_batch(specs: Sequence[InputSpec]) -> int:
    """The model's fixed batch dimension (1 when it is dynamic or the inputs disagree)."""
    fixed = fixed_sizes(specs)
    return fixed.pop() if len(fixed) == 1 else 1


def fixed_sizes(specs: Sequence[InputSpec]) -> set[int]:
    """The static sizes the model declares on its inputs' batch axes."""
    return {
        s.shape[s.batch_axis]  # type: ignore[misc]
        for s in specs
        if s.batch_axis is not None and s.batch_axis < len(s.shape) and isinstance(s.shape[s.batch_axis], int)
    }
