"""Calibration and evaluation data: sources -> validated, re-iterable batches.

A source is one of

* an ``.npz`` file keyed by model input name (samples stacked on each input's
  batch axis, see below), with an optional ``labels`` key;
* a folder of such files (sorted by name); files may differ in their dynamic
  dimensions (sequence length, image width) -- each is then its own batch;
* a Python hook ``module:function`` or ``path/to/file.py:function`` returning
  an iterable of feed dicts (a ``labels`` key is taken as labels) or an ORT
  ``CalibrationDataReader``.

Each input's batch axis is read off the model (:func:`decide_batch_axes`): the
symbolic dimension the inputs share (``batch``, ``N``), wherever it sits -- a
streaming model's state ``[2, batch, 128]`` has it on axis 1 -- else the only
size they share, else axis 0; with no axis to split on, each file or hook item
is one indivisible batch. ``--batch-axis NAME=AXIS`` overrides it. Everything
that cuts, counts or stacks samples goes through :func:`take_rows`,
:func:`feed_rows` and :func:`join_rows` with those axes.

Everything is checked against the model's inputs (names, dtype, rank, static
dims) before any long work starts, and every problem is one
:class:`~qdebug.errors.QDebugError` naming the file, the input and the fix.
Only one file is held in memory at a time, so memory does not grow with the
number of files.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qdebug.errors import ExitCode, QDebugError

LABELS_KEY = "labels"

BATCH_AXIS_FLAG = "--batch-axis"

Axes = Mapping[str, "int | None"]
"""Input name -> the axis its samples are stacked on (None: fed whole with every batch, e.g. a scalar)."""

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


@dataclass(frozen=True)
class Batch:
    """One batch of feeds (exactly the model's inputs) and its labels, if any."""

    feeds: Mapping[str, np.ndarray]
    labels: np.ndarray | None
    size: int
    origin: str
    """Where it came from (file and slice) for error messages."""
    axes: Axes = dataclasses.field(default_factory=dict)
    """Each input's batch axis (:func:`batch_axes`): what a chunk of this batch is cut on."""


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


# ----------------------------------------------------------------------------- batch axes


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


def _axis_of(name: str, value: np.ndarray, axes: Axes | None) -> int | None:
    """The batch axis of one array: ``axes``' (axis 0 for a name it lacks); None for rank 0."""
    if not value.ndim:
        return None
    if axes is None or name not in axes:
        return 0
    axis = axes[name]
    return axis if axis is None or axis < value.ndim else None


def feed_rows(feeds: Mapping[str, np.ndarray], axes: Axes | None = None) -> int:
    """Samples in one feed dict: the size of its first batched array on its batch axis (``axes``; without
    them axis 0), 1 when no input has one (scalars; an indivisible batch)."""
    for k, v in feeds.items():
        axis = _axis_of(k, v, axes)
        if axis is not None:
            return int(v.shape[axis])
    return 1


def take_rows(
    feeds: Mapping[str, np.ndarray], start: int, stop: int | None = None, axes: Axes | None = None
) -> dict[str, np.ndarray]:
    """Samples ``start:stop`` of a feed dict, each input cut on its batch axis (``axes``; without them
    axis 0); inputs without one (rank 0: one value for the whole batch) are kept whole. A cut off axis 0 is
    copied contiguous, as ORT reads it."""
    out = {}
    for k, v in feeds.items():
        axis = _axis_of(k, v, axes)
        if axis is None:
            out[k] = v
        elif axis == 0:
            out[k] = v[start:stop]
        else:
            out[k] = np.ascontiguousarray(v[(slice(None),) * axis + (slice(start, stop),)])
    return out


def join_rows(parts: Sequence[Mapping[str, np.ndarray]], axes: Axes | None = None) -> dict[str, np.ndarray]:
    """Consecutive feed dicts of one model joined on each input's batch axis (one value kept whole)."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {}
    for k, v in parts[0].items():
        axis = _axis_of(k, v, axes)
        out[k] = v if axis is None else np.concatenate([p[k] for p in parts], axis=axis)
    return out


class DataSet:
    """A re-iterable, validated source of :class:`Batch` es.

    ``batches()`` can be called once per pass (calibration, capture, evaluation);
    files are re-read and hooks re-called each time, so nothing accumulates.
    """

    def __init__(
        self,
        source: str,
        specs: tuple[InputSpec, ...],
        make_iter: Callable[[], Iterator[Batch]],
        n_samples: int | None,
        has_labels: bool,
        ignored: tuple[str, ...] = (),
    ) -> None:
        self.source = source
        self.specs = specs
        self._make_iter = make_iter
        self.n_samples = n_samples
        self.has_labels = has_labels
        self.ignored = ignored
        """Arrays in the files that are neither a model input nor the labels (read by nothing)."""
        self._pass_samples: int | None = None
        """Samples in the first complete pass: every later complete pass must match it."""

    def batches(self) -> Iterator[Batch]:
        """Iterate over the batches (validated as they are produced)."""
        seen = 0
        for batch in self._make_iter():
            _check_batch(batch, self.specs)
            seen += batch.size
            yield batch
        if self._pass_samples is None:
            self._pass_samples = seen
        elif seen != self._pass_samples:
            # e.g. a module-level reader object returned on every call: used up after the first pass
            raise QDebugError(
                f"data source {self.source} yielded {self._pass_samples} samples on its first pass and "
                f"{seen} on a later one",
                "make the hook return a new iterable or CalibrationDataReader on every call",
                ExitCode.DATA,
            )

    def first(self) -> Batch:
        """The first batch (used to prepare sessions before the timed work)."""
        for b in self.batches():
            return b
        raise QDebugError(
            f"data source {self.source} yields no samples", "give at least one sample", ExitCode.DATA
        )


def open_data(
    source: str | Path,
    specs: tuple[InputSpec, ...],
    *,
    batch_size: int | None = None,
    max_samples: int | None = None,
    what: str = "calibration data",
    limit_flag: str | None = "",
) -> DataSet:
    """Open and validate a data source against the model inputs (see module docstring).

    ``limit_flag`` is the flag that limits this data's samples, for hints (``""``: ``--max-samples``
    for calibration data, none otherwise; ``None``: the command has none).
    """
    if batch_size is not None and batch_size < 1:
        raise QDebugError(
            f"--batch-size must be >= 1 (got {batch_size})", "pass a positive batch size", ExitCode.USAGE
        )
    if limit_flag == "":
        limit_flag = "--max-samples" if what == "calibration data" else None
    if max_samples is not None and max_samples < 1:
        flag = limit_flag or "--max-samples"
        raise QDebugError(
            f"{flag} must be >= 1 (got {max_samples})", "pass a positive number", ExitCode.USAGE
        )
    text = str(source)
    path = Path(text)
    if path.exists():
        if path.is_dir():
            files = sorted(p for p in path.iterdir() if p.suffix.lower() == ".npz" and p.is_file())
            if not files:
                subfolders = [p.name for p in path.iterdir() if p.is_dir()]
                inside = f" (subfolders are not read: {', '.join(sorted(subfolders)[:3])})" if subfolders else ""
                raise QDebugError(
                    f"{what} folder {path} has no .npz files{inside}",
                    "put one .npz per batch in the folder itself",
                    ExitCode.DATA,
                )
        else:
            files = [path]
        return _file_dataset(text, files, specs, batch_size, max_samples, what, limit_flag)
    if ":" in text and not text.endswith(".npz"):
        return _hook_dataset(text, specs, batch_size, max_samples, what)
    raise QDebugError(
        f"{what} not found: {text}", "pass an .npz file, a folder of them, or module:function", ExitCode.INPUT
    )


# ----------------------------------------------------------------------------- files


def _npz_header(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of every array in an .npz, read from the headers only."""
    try:
        with zipfile.ZipFile(path) as z:
            out = {}
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                    else:
                        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                out[info.filename[: -len(".npy")]] = (tuple(shape), np.dtype(dtype))
            return out
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise QDebugError(
            f"{path} is not a readable .npz file ({e.__class__.__name__})",
            "save data with numpy.savez(path, **{input_name: array})",
            ExitCode.DATA,
        ) from None


def _file_dataset(
    source: str,
    files: list[Path],
    specs: tuple[InputSpec, ...],
    batch_size: int | None,
    max_samples: int | None,
    what: str,
    limit_flag: str | None = "--max-samples",
) -> DataSet:
    headers = {f: _npz_header(f) for f in files}
    first = next(iter(headers.items()), None)
    if first is not None:
        specs = resolve_batch_axes(specs, {k: v[0] for k, v in first[1].items()}, str(first[0]))
    counts = []  # samples per file (its inputs and labels agree on their batch axes: checked here)
    has_labels = True
    for f, header in headers.items():
        counts.append(_check_header(f, header, specs, what))
        has_labels = has_labels and LABELS_KEY in header and not _labels_fed(specs)
    total = sum(counts)
    labelled = [f.name for f, h in headers.items() if LABELS_KEY in h]
    for f, header in headers.items():  # from the headers: strings had been found after the whole capture
        if LABELS_KEY in header and not _labels_fed(specs):
            shape, dtype = header[LABELS_KEY]
            if dtype.kind not in "iuf" or len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
                raise QDebugError(
                    f"{what} {f}: labels have dtype {dtype} and shape {list(shape)}, expected one integer "
                    "class index per sample",
                    "save labels as a 1-D integer array (labels.astype(numpy.int64); argmax of one-hot rows)",
                    ExitCode.DATA,
                )
    if labelled and len(labelled) < len(headers) and not _labels_fed(specs):
        raise QDebugError(
            f"{what} {source}: {len(labelled)} of {len(headers)} files have labels (e.g. {labelled[0]}), the "
            "others not; they had been dropped silently and top-1 became agreement with FP32",
            "give every file labels, or none",
            ExitCode.DATA,
        )
    if total == 0:
        raise QDebugError(f"{what} {source} holds no samples", "give at least one sample", ExitCode.DATA)
    n_samples = min(total, max_samples) if max_samples else total
    bsize = _batch_size(specs, batch_size, source)
    _check_fixed_batches(specs, counts, n_samples, source, what, limit_flag)
    axes = batch_axes(specs)

    def make_iter() -> Iterator[Batch]:
        left = n_samples
        for f in files:
            if left <= 0:
                return
            arrays = _read_npz(f, specs)
            n = feed_rows({s.name: arrays[s.name] for s in specs}, axes)
            _check_finite(arrays, str(f))
            take = min(n, left)
            left -= take
            yield from _split(arrays, take, bsize, str(f), has_labels, _labels_fed(specs), axes)
            del arrays

    used = {s.name for s in specs} | {LABELS_KEY}
    ignored = tuple(sorted({k for h in headers.values() for k in h if k not in used}))
    return DataSet(source, specs, make_iter, n_samples, has_labels, ignored)


def data_notes(calib: DataSet, evaluation: DataSet | None, model: Any = None) -> list[str]:
    """:func:`batch_axis_note` and :func:`ignored_note` for the calibration and (when given) the evaluation
    data of ``model``."""
    defaulted = defaulted_inputs(model) if model is not None else set()
    notes = [batch_axis_note(calib.specs), ignored_note(calib, "calibration data", defaulted)]
    if evaluation is not None:
        if batch_axes(evaluation.specs) != batch_axes(calib.specs):
            notes.append(f"evaluation data: {batch_axis_note(evaluation.specs) or 'batch axis 0'}")
        notes.append(ignored_note(evaluation, "evaluation data", defaulted))
    return [n for n in notes if n]


def defaulted_inputs(model: Any) -> set[str]:
    """Values the model holds itself (initializers): an input with a default (normalization keeps it as an
    initializer only) or a weight. The data cannot feed them."""
    return {t.name for t in model.graph.initializer}


def ignored_note(data: DataSet, what: str, defaulted: set[str] | frozenset[str] = frozenset()) -> str | None:
    """A note naming the arrays nothing reads: a typo such as ``label`` for ``labels`` had silently turned
    top-1 against labels into agreement with FP32 (100 %). An input with a default in the model is named as
    such: the model's default is used (it had been called "neither a model input")."""
    if not data.ignored:
        return None
    import difflib

    parts = []
    kept = [k for k in data.ignored if k in defaulted]
    if kept:
        names = ", ".join(repr(k) for k in kept)
        held = "the model holds these values itself (an input's default or a weight)"
        parts.append(f"{names}: {held}; the data's were ignored")
    unread = [k for k in data.ignored if k not in defaulted]
    if unread:
        names = ", ".join(repr(k) for k in unread)
        wanted = [LABELS_KEY, *(s.name for s in data.specs)]
        hints = [
            f"{m[0]!r} for {k!r}"
            for k in unread
            if (m := difflib.get_close_matches(k, wanted, n=1, cutoff=0.6))
        ]
        guess = f" (did you mean {', '.join(hints)}?)" if hints else ""
        parts.append(f"key(s) {names} are neither a model input nor 'labels' and were ignored{guess}")
    return f"{what} {data.source}: " + "; ".join(parts)


def _check_header(
    f: Path, header: Mapping[str, tuple[tuple[int, ...], np.dtype]], specs: tuple[InputSpec, ...], what: str
) -> int:
    names = [s.name for s in specs]
    missing = [n for n in names if n not in header]
    if missing:
        raise QDebugError(
            f"{what} {f} has no array for model input(s) {missing} (it has {sorted(header)})",
            f"save the arrays under the model's input names {names}",
            ExitCode.DATA,
        )
    sizes: dict[str, tuple[int, int]] = {}  # input -> (batch axis, samples on it)
    for s in specs:
        shape, dtype = header[s.name]
        _check_array_meta(s, shape, dtype, str(f))
        if s.batch_axis is not None and len(shape) > s.batch_axis:
            sizes[s.name] = (s.batch_axis, shape[s.batch_axis])
    if LABELS_KEY in header and not _labels_fed(specs):
        label_shape = header[LABELS_KEY][0]
        sizes.setdefault(LABELS_KEY, (0, label_shape[0] if label_shape else 1))
        if len(sizes) == 1:  # no input has a batch axis: the file is one sample, so are its labels
            sizes[""] = (0, 1)
    return _same_samples(sizes, f"{what} {f}")


def _same_samples(sizes: Mapping[str, tuple[int, int]], origin: str) -> int:
    """The samples every input (and the labels) hold on its batch axis, or one line naming them all: a
    streaming model's ``state [2, 1, 128]`` had been read as 2 samples next to ``input [1, 576]``."""
    counts = {n for _, n in sizes.values()}
    if not counts:  # scalar inputs only, or no batch axis: the file or item is one sample
        return 1
    if len(counts) != 1:
        if {a for a, _ in sizes.values()} == {0} and "" not in sizes:
            where = f"axis 0): {dict((k, n) for k, (_, n) in sizes.items())}"
        else:
            where = ", ".join(f"{k or 'one sample'}: {n} on axis {a}" for k, (a, n) in sizes.items()) + ")"
        raise QDebugError(
            f"{origin}: arrays disagree on the number of samples ({where}",
            "give every input (and the labels) the same number of samples on its batch axis, or name each "
            f"input's batch axis with {BATCH_AXIS_FLAG} NAME=AXIS",
            ExitCode.DATA,
        )
    return counts.pop()


def _check_array_meta(spec: InputSpec, shape: tuple[int, ...], dtype: np.dtype, origin: str) -> None:
    if np.dtype(dtype) != spec.dtype:
        raise QDebugError(
            f"{origin}: input {spec.name!r} has dtype {np.dtype(dtype)}, the model expects {spec.dtype}",
            f"convert it with array.astype(numpy.{spec.dtype})",
            ExitCode.DATA,
        )
    if spec.scalar and shape:
        raise QDebugError(
            f"{origin}: input {spec.name!r} has shape {list(shape)}, the model expects a scalar (rank 0)",
            f"save one value per file (numpy.{spec.dtype}(value)): it is fed with every batch of that file",
            ExitCode.DATA,
        )
    if spec.shape and len(shape) != len(spec.shape):
        raise QDebugError(
            f"{origin}: input {spec.name!r} has shape {list(shape)}, the model expects rank {len(spec.shape)} "
            f"({spec.describe()})",
            f"stack samples on axis {spec.batch_axis or 0} with the model's full input shape",
            ExitCode.DATA,
        )
    for axis, (have, want) in enumerate(zip(shape, spec.shape, strict=False)):
        if axis == spec.batch_axis:
            continue
        if isinstance(want, int) and have != want:
            raise QDebugError(
                f"{origin}: input {spec.name!r} has shape {list(shape)}, the model expects {spec.describe()} "
                f"(axis {axis} must be {want})",
                "resize/pad the data to the model's input shape",
                ExitCode.DATA,
            )


def _read_npz(f: Path, specs: tuple[InputSpec, ...]) -> dict[str, np.ndarray]:
    try:
        with np.load(f, allow_pickle=False) as z:
            arrays = {s.name: np.asarray(z[s.name], order="C") for s in specs}
            if LABELS_KEY in z.files:
                arrays[LABELS_KEY] = np.asarray(z[LABELS_KEY])
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise QDebugError(
            f"cannot read {f} ({e.__class__.__name__}: {e})", "re-save the file", ExitCode.DATA
        ) from None
    return arrays


def _check_same_rows(arrays: Mapping[str, np.ndarray], axes: Axes, origin: str) -> int:
    """The samples of one item: every input (and the labels) holds as many on its batch axis (only the
    first input's had been used: the others were cut to it, or ORT failed with a raw message)."""
    sizes = {}
    for k, v in arrays.items():
        axis = _axis_of(k, v, axes) if k in axes or k == LABELS_KEY else None
        if axis is not None:
            sizes[k] = (axis, int(v.shape[axis]))
    if LABELS_KEY in sizes and len(sizes) == 1 and LABELS_KEY not in axes:  # no batch axis: one sample
        sizes[""] = (0, 1)
    return _same_samples(sizes, origin)


def _check_finite(arrays: Mapping[str, np.ndarray], origin: str) -> None:
    for name, a in arrays.items():
        if name == LABELS_KEY or a.dtype.kind not in "fc":
            continue
        if not np.isfinite(a).all():
            bad = int(a.size - np.count_nonzero(np.isfinite(a)))
            raise QDebugError(
                f"{origin}: input {name!r} contains {bad} NaN/Inf value(s)",
                "clean the data (NaN/Inf make every error metric meaningless)",
                ExitCode.DATA,
            )


def fixed_batch(specs: Sequence[InputSpec]) -> int:
    """The model's fixed batch dimension (1 when it is dynamic or the inputs disagree)."""
    fixed = _fixed_sizes(specs)
    return fixed.pop() if len(fixed) == 1 else 1


def _fixed_sizes(specs: Sequence[InputSpec]) -> set[int]:
    """The static sizes the model declares on its inputs' batch axes."""
    return {
        s.shape[s.batch_axis]  # type: ignore[misc]
        for s in specs
        if s.batch_axis is not None and s.batch_axis < len(s.shape) and isinstance(s.shape[s.batch_axis], int)
    }


def _check_fixed_batches(
    specs: tuple[InputSpec, ...],
    counts: list[int],
    n_samples: int,
    source: str,
    what: str,
    limit_flag: str | None = "--max-samples",
) -> None:
    """A model whose batch dimension is fixed at B > 1 takes only full batches: every file's share of the
    samples must be a multiple of B. Refused up front (exit 5), never padded or dropped silently; ORT had
    failed mid-calibration instead, and the message blamed the model."""
    batch = fixed_batch(specs)
    if batch <= 1:
        return
    left = n_samples
    for n in counts:
        take = min(n, left)
        left -= take
        if take % batch:
            whole_files = len(counts) == 1 or all(c % batch == 0 for c in counts)
            usable = _usable_samples(counts, n_samples, batch) if whole_files else None
            if usable and limit_flag:
                hint = f"pass {limit_flag} {usable}"
            elif usable:
                hint = f"keep the first {usable} samples"
            else:
                hint = f"give each file a multiple of {batch} samples"
            raise QDebugError(
                f"{what} {source}: {take} sample(s) in a file do not fill batches of {batch} "
                f"(the model's batch dimension is fixed at {batch})",
                f"{hint}, or export the model with a dynamic batch dimension",
                ExitCode.DATA,
            )


def _usable_samples(counts: list[int], limit: int, batch: int) -> int:
    """The most samples, at most ``limit``, whose share of every file fills whole batches (files read in
    order): a limit falling inside a file is rounded down to a whole batch there."""
    usable = 0
    for n in counts:
        take = min(n, limit)
        if take % batch:  # the first file whose share does not fill batches: round down there, stop
            return usable + take - take % batch
        usable, limit = usable + take, limit - take
    return usable


def _batch_size(specs: tuple[InputSpec, ...], requested: int | None, source: str) -> int | None:
    """The batch size to split files into; ``None`` keeps each file's batch as is.

    A model with a static batch dimension accepts only that size.
    """
    static = _fixed_sizes(specs)
    if static:
        fixed = static.pop()
        if requested is not None and requested != fixed:
            raise QDebugError(
                f"--batch-size {requested} does not fit the model, whose batch dimension is fixed at {fixed}",
                f"use --batch-size {fixed}, or export the model with a dynamic batch dimension",
                ExitCode.DATA,
            )
        return fixed
    return requested if requested is not None else 16


def _class_indices(labels: np.ndarray, n: int, origin: str) -> np.ndarray:
    """``labels`` as one integer class index per sample, or a one-line error.

    Labels shaped [N, 1] had broadcast against the [N] predictions (top-1 of 244 %), [N, 3] crashed, and a
    hook's labels of another length too.
    """
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or len(labels) != n:
        raise QDebugError(
            f"{origin}: labels have shape {list(labels.shape)}, expected one class index per sample ([{n}])",
            "give labels as a 1-D integer array with the inputs' number of samples",
            ExitCode.DATA,
        )
    if labels.dtype.kind in "iu":
        return labels
    if labels.dtype.kind == "f":
        bad = ~np.isfinite(labels) | (labels != np.round(labels)) | (np.abs(labels) > 2**53)
        if not bad.any():
            return labels.astype(np.int64)
        first = float(labels[bad][0])  # NaN, 1.5 or 4e20: say which, not just the dtype float labels pass
        raise QDebugError(
            f"{origin}: labels hold {first!r}, which is not a class index ({int(bad.sum())} such value(s))",
            "give one integer class index per sample",
            ExitCode.DATA,
        )
    raise QDebugError(
        f"{origin}: labels have dtype {labels.dtype}, expected integer class indices",
        "convert them with labels.astype(numpy.int64) (one class index per sample)",
        ExitCode.DATA,
    )


def _labels_fed(specs: tuple[InputSpec, ...]) -> bool:
    """Whether the model has an input named ``labels``: the key is then fed to it and is not the labels
    (the model had been run without it: "Required inputs (['labels']) are missing")."""
    return any(s.name == LABELS_KEY for s in specs)


def _split(
    arrays: Mapping[str, np.ndarray],
    n: int,
    bsize: int | None,
    origin: str,
    has_labels: bool,
    labels_fed: bool = False,
    axes: Axes | None = None,
) -> Iterator[Batch]:
    """Batches of ``bsize`` (None: all ``n``) samples of one file or item, cut on each input's ``axes``."""
    step = bsize or n
    axes = dict(axes or {})
    for start in range(0, n, step):
        stop = min(n, start + step)
        inputs = {k: v for k, v in arrays.items() if labels_fed or k != LABELS_KEY}
        feeds = take_rows(inputs, start, stop, axes) if (start, stop) != (0, feed_rows(inputs, axes)) else inputs
        labels = arrays[LABELS_KEY][start:stop] if has_labels and LABELS_KEY in arrays else None
        if labels is not None:
            labels = _class_indices(labels, stop - start, origin)
        yield Batch(feeds, labels, stop - start, f"{origin}[{start}:{stop}]", axes)


# ----------------------------------------------------------------------------- hooks


def load_hook(spec: str, what: str) -> Callable[..., Any]:
    """Resolve ``module:function`` or ``file.py:function`` to a callable (clear error if not)."""
    module_name, _, func_name = spec.rpartition(":")
    if not module_name or not func_name:
        raise QDebugError(
            f"{what} {spec!r} is not module:function", "write it as package.module:function", ExitCode.INPUT
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise QDebugError(f"{what} file not found: {path}", "check the path", ExitCode.INPUT)
            # registered under its own name while it runs: a dataclass in a hook file (with postponed
            # annotations) looks its module up in sys.modules, and had failed with an obscure AttributeError
            name = f"qdebug_hook_{path.stem}_{abs(hash(str(path.resolve()))):x}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            folder = str(path.resolve().parent)  # its own imports of modules next to it, as `python file.py`
            if folder not in sys.path:
                sys.path.insert(0, folder)
            sys.modules[name] = module
            try:
                mod_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            if "" not in sys.path and "." not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except QDebugError:
        raise
    except Exception as e:
        raise QDebugError(
            f"cannot import {what} module {module_name!r} ({e.__class__.__name__}: {e})",
            "make sure it is importable from the current directory",
            ExitCode.INPUT,
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise QDebugError(
            f"{module_name} has no function {func_name!r}", f"define {func_name} in it", ExitCode.INPUT
        )
    return func


def _hook_dataset(
    spec: str, specs: tuple[InputSpec, ...], batch_size: int | None, max_samples: int | None, what: str
) -> DataSet:
    func = load_hook(spec, what)
    specs = _hook_axes(func, spec, specs)
    bsize = _batch_size(specs, batch_size, spec)
    axes = batch_axes(specs)

    ignored: set[str] = set()
    labelled: set[bool] = set()  # whether the items carry labels (all must agree)

    used = {s.name for s in specs} | {LABELS_KEY}
    fed = _labels_fed(specs)

    def make_iter() -> Iterator[tuple[dict[str, np.ndarray], int, str]]:
        produced = 0
        for i, item in enumerate(_iterate_hook(func, spec)):
            if not isinstance(item, Mapping):
                raise QDebugError(
                    f"{what} hook {spec} yielded {type(item).__name__}, not a dict of input name -> array",
                    "yield {input_name: numpy array}",
                    ExitCode.DATA,
                )
            # only the model's inputs and the labels: another key (a file name, metadata) had reached ORT
            # ("Invalid input name", exit 4) or crashed the batching when it was not an array
            ignored.update(str(k) for k in item if k not in used)
            try:
                arrays = {k: np.asarray(v) for k, v in item.items() if k in used}
            except ValueError as e:  # ragged lists: "inhomogeneous shape"
                raise QDebugError(
                    f"{what} hook {spec} item {i}: a value is not an array ({e})",
                    "yield numpy arrays (one per model input, batch on axis 0)",
                    ExitCode.DATA,
                ) from None
            missing = [s.name for s in specs if s.name not in arrays]
            if missing:
                raise QDebugError(
                    f"{what} hook {spec} item {i} lacks model input(s) {missing}",
                    f"yield all of {[s.name for s in specs]}",
                    ExitCode.DATA,
                )
            for s in specs:
                _check_array_meta(s, arrays[s.name].shape, arrays[s.name].dtype, f"{spec} item {i}")
            _check_finite(arrays, f"{spec} item {i}")
            n = _check_same_rows(arrays, axes, f"{what} hook {spec} item {i}")
            if n == 0:  # an empty item is skipped, like an empty file (it had ended the data there, silently)
                continue
            if max_samples is not None:
                n = min(n, max_samples - produced)
            if n <= 0:
                break
            produced += n
            has = LABELS_KEY in arrays and not fed
            if labelled and has not in labelled:
                raise QDebugError(
                    f"{what} hook {spec}: item {i} {'has' if has else 'has no'} labels, the items before it "
                    f"{'did not' if has else 'did'} (they had been dropped silently: top-1 became agreement)",
                    "give every item labels, or none",
                    ExitCode.DATA,
                )
            labelled.add(has)
            yield arrays, n, f"{spec} item {i}"

    def make_batches() -> Iterator[Batch]:
        items = make_iter()
        if fixed_batch(specs) > 1:
            items = _fill_fixed_batches(items, fixed_batch(specs), spec, what, axes)
        for arrays, n, origin in items:
            yield from _split(arrays, n, bsize, origin, LABELS_KEY in arrays and not fed, fed, axes)

    # Validate the first item now, before any long work.
    first = next(iter(make_batches()), None)
    if first is None:
        raise QDebugError(
            f"{what} hook {spec} yields no samples", "yield at least one feed dict", ExitCode.DATA
        )
    return DataSet(spec, specs, make_batches, None, first.labels is not None, tuple(sorted(ignored)))


def _hook_axes(func: Callable[..., Any], spec: str, specs: tuple[InputSpec, ...]) -> tuple[InputSpec, ...]:
    """Batch axes the model left open, read off the hook's first item (one extra call of the hook)."""
    if not any(s.batch_rule == UNDECIDED for s in specs):
        return specs
    item = next(iter(_iterate_hook(func, spec)), None)
    if not isinstance(item, Mapping):
        return specs  # refused with its own message when the items are read
    shapes = {s.name: np.shape(item[s.name]) for s in specs if s.name in item}
    return resolve_batch_axes(specs, shapes, f"{spec} item 0")


def _fill_fixed_batches(
    items: Iterator[tuple[dict[str, np.ndarray], int, str]],
    batch: int,
    spec: str,
    what: str,
    axes: Axes | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], int, str]]:
    """A hook's items joined into whole batches of a model's fixed batch dimension ``batch``.

    A hook often yields one sample at a time; a model exported with a fixed batch of B takes only B, so the
    items are stacked until they fill one (ORT had failed mid-calibration with "invalid dimensions", exit 4).
    Samples left over at the end are refused (exit 5), never padded or dropped; so are items that cannot be
    stacked (other keys or other non-batch dimensions) while a batch is partly filled.
    """
    pending: list[dict[str, np.ndarray]] = []
    rows = 0
    first_origin = ""
    for arrays, n, origin in items:
        arrays = take_rows(arrays, 0, n, axes)
        if pending and not _stackable(pending[0], arrays, axes):
            raise QDebugError(
                f"{what} hook {spec}: {origin} cannot be stacked with the {rows} sample(s) before it (other keys, "
                f"shapes or scalar values), and the model's batch dimension is fixed at {batch}",
                f"yield batches of {batch} samples, or samples of one shape (and one value of each scalar input) "
                f"until each batch of {batch} is full",
                ExitCode.DATA,
            )
        if not pending:
            first_origin = origin
        pending.append(arrays)
        rows += n
        if rows < batch:
            continue
        joined = join_rows(pending, axes)
        whole = rows - rows % batch
        yield take_rows(joined, 0, whole, axes), whole, f"{first_origin}..{origin}"
        pending, rows = ([take_rows(joined, whole, None, axes)], rows - whole) if rows > whole else ([], 0)
        first_origin = origin
    if rows:
        raise QDebugError(
            f"{what} hook {spec}: {rows} sample(s) left at the end do not fill a batch of {batch} "
            f"(the model's batch dimension is fixed at {batch})",
            f"yield a multiple of {batch} samples (or pass a --max-samples that is one), "
            "or export the model with a dynamic batch dimension",
            ExitCode.DATA,
        )


def _stackable(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], axes: Axes | None = None) -> bool:
    """Whether two items have the same keys, the same dimensions but the batch axis and the same scalars
    (an input without a batch axis is one value for the whole batch: items that disagree on it cannot share
    one)."""

    def same(k: str, x: np.ndarray, y: np.ndarray) -> bool:
        axis = _axis_of(k, x, axes)
        if axis is not None and y.ndim == x.ndim:
            return np.delete(x.shape, axis).tolist() == np.delete(y.shape, axis).tolist()
        return x.shape == y.shape and np.array_equal(x, y)

    return a.keys() == b.keys() and all(same(k, a[k], b[k]) for k in a)


def _iterate_hook(func: Callable[..., Any], spec: str) -> Iterator[Any]:
    try:
        result = func()
    except Exception as e:
        raise QDebugError(
            f"data hook {spec} raised {e.__class__.__name__}: {e}", "fix the hook", ExitCode.DATA
        ) from None
    if hasattr(result, "get_next") and callable(result.get_next):
        items: Iterator[Any] = iter(result.get_next, None)
    elif isinstance(result, Iterable):
        items = iter(result)
    else:
        raise QDebugError(
            f"data hook {spec} returned {type(result).__name__}",
            "return an iterable of feed dicts or a CalibrationDataReader",
            ExitCode.DATA,
        )
    i = 0
    while True:
        try:  # the hook's own code runs here too: a generator raising midway had given a traceback (exit 1)
            item = next(items)
        except StopIteration:
            return
        except QDebugError:
            raise
        except Exception as e:
            raise QDebugError(
                f"data hook {spec} raised {e.__class__.__name__} at item {i}: {e}", "fix the hook", ExitCode.DATA
            ) from None
        yield item
        i += 1


# ----------------------------------------------------------------------------- checks


def _check_batch(batch: Batch, specs: tuple[InputSpec, ...]) -> None:
    if batch.size == 0:
        raise QDebugError(f"{batch.origin}: empty batch", "remove empty files/items", ExitCode.DATA)
    for spec in specs:
        a = batch.feeds.get(spec.name)
        if spec.index_rows is None or a is None or a.size == 0 or a.dtype.kind not in "iu":
            continue
        rows, gather = spec.index_rows
        lo, hi = int(a.min()), int(a.max())
        if lo < -rows or hi >= rows:
            raise QDebugError(
                f"{batch.origin}: input {spec.name!r} holds ids {lo}..{hi}, outside the {rows} rows of the "
                f"table Gather {gather!r} reads",
                f"use ids in 0..{rows - 1} (the tokenizer or vocabulary the model was trained with)",
                ExitCode.DATA,
            )


class ReaderAdapter:
    """Presents a :class:`DataSet` as an ORT ``CalibrationDataReader`` (one batch per ``get_next``)."""

    def __init__(
        self, data: DataSet, on_batch: Callable[[int], None] | None = None, *, single_samples: bool = False
    ) -> None:
        self._data = data
        self._it: Iterator[dict[str, np.ndarray]] | None = None
        self._on_batch = on_batch
        self._single = single_samples

    def _feeds(self) -> Iterator[dict[str, np.ndarray]]:
        for batch in self._data.batches():
            if self._single and batch.size > 1:
                for i in range(batch.size):
                    yield take_rows(batch.feeds, i, i + 1, batch.axes)
                    if self._on_batch:
                        self._on_batch(1)
            else:
                yield dict(batch.feeds)
                if self._on_batch:
                    self._on_batch(batch.size)

    def get_next(self) -> dict[str, np.ndarray] | None:
        """Next feed dict, or None at the end (ORT's protocol)."""
        if self._it is None:
            self._it = self._feeds()
        return next(self._it, None)

    def rewind(self) -> None:
        """Start again from the first batch."""
        self._it = None
