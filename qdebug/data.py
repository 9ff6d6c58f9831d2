"""Calibration and evaluation data: sources -> validated, re-iterable batches.

A source is one of

* an ``.npz`` file keyed by model input name (batch on axis 0), with an
  optional ``labels`` key;
* a folder of such files (sorted by name); files may differ in their dynamic
  dimensions (sequence length, image width) -- each is then its own batch;
* a Python hook ``module:function`` or ``path/to/file.py:function`` returning
  an iterable of feed dicts (a ``labels`` key is taken as labels) or an ORT
  ``CalibrationDataReader``.

Everything is checked against the model's inputs (names, dtype, rank, static
dims) before any long work starts, and every problem is one
:class:`~qdebug.errors.QDebugError` naming the file, the input and the fix.
Only one file is held in memory at a time, so memory does not grow with the
number of files.
"""

from __future__ import annotations

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


def model_input_specs(model: Any) -> tuple[InputSpec, ...]:
    """The inputs the data must feed: graph inputs that are neither initializers (a default the model
    carries) nor ``optional`` (ORT runs without them; they had been demanded, as float32)."""
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
        specs.append(InputSpec(vi.name, dtype, tuple(dims), index, scalar))
    return tuple(specs)


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


def feed_rows(feeds: Mapping[str, np.ndarray]) -> int:
    """Samples in one feed dict: axis 0 of its batched arrays (1 when every input is a scalar)."""
    return next((int(v.shape[0]) for v in feeds.values() if v.ndim), 1)


def take_rows(feeds: Mapping[str, np.ndarray], start: int, stop: int | None = None) -> dict[str, np.ndarray]:
    """Samples ``start:stop`` of a feed dict; rank-0 inputs (one value for the whole batch) are kept whole."""
    return {k: v[start:stop] if v.ndim else v for k, v in feeds.items()}


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
    counts = []  # samples per file (its inputs and labels agree on axis 0: checked here)
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

    def make_iter() -> Iterator[Batch]:
        left = n_samples
        for f in files:
            if left <= 0:
                return
            arrays = _read_npz(f, specs)
            n = feed_rows({s.name: arrays[s.name] for s in specs})
            _check_finite(arrays, str(f))
            take = min(n, left)
            left -= take
            yield from _split(arrays, take, bsize, str(f), has_labels, _labels_fed(specs))
            del arrays

    used = {s.name for s in specs} | {LABELS_KEY}
    ignored = tuple(sorted({k for h in headers.values() for k in h if k not in used}))
    return DataSet(source, specs, make_iter, n_samples, has_labels, ignored)


def data_notes(calib: DataSet, evaluation: DataSet | None, model: Any = None) -> list[str]:
    """:func:`ignored_note` for the calibration and (when given) the evaluation data of ``model``."""
    defaulted = defaulted_inputs(model) if model is not None else set()
    notes = [ignored_note(calib, "calibration data", defaulted)]
    if evaluation is not None:
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
    counts = set()
    for s in specs:
        shape, dtype = header[s.name]
        _check_array_meta(s, shape, dtype, str(f))
        if not s.scalar:
            counts.add(shape[0] if shape else 1)
    if LABELS_KEY in header:
        counts.add(header[LABELS_KEY][0][0] if header[LABELS_KEY][0] else 1)
    if not counts:  # scalar inputs only: the file is one sample
        return 1
    if len(counts) != 1:
        raise QDebugError(
            f"{what} {f}: arrays disagree on the number of samples (axis 0 sizes {sorted(counts)})",
            "give every input (and labels) the same batch size on axis 0",
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
            "stack samples on axis 0 with the model's full input shape",
            ExitCode.DATA,
        )
    for axis, (have, want) in enumerate(zip(shape, spec.shape, strict=False)):
        if axis == 0:
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


def _check_same_rows(arrays: Mapping[str, np.ndarray], used: set[str], origin: str) -> None:
    """Every input (and the labels: ``used``) of one item has the same number of samples on axis 0 (only
    the first input's had been used: the others were cut to it, or ORT failed with a raw message)."""
    rows = {k: v.shape[0] for k, v in arrays.items() if v.ndim and k in used}
    if len(set(rows.values())) > 1:
        raise QDebugError(
            f"{origin}: arrays disagree on the number of samples (axis 0): {rows}",
            "give every input (and the labels) the same batch size",
            ExitCode.DATA,
        )


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
    fixed = {s.shape[0] for s in specs if s.shape and isinstance(s.shape[0], int)}
    return fixed.pop() if len(fixed) == 1 else 1


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
    static = {s.shape[0] for s in specs if s.shape and isinstance(s.shape[0], int)}
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
) -> Iterator[Batch]:
    step = bsize or n
    for start in range(0, n, step):
        stop = min(n, start + step)
        feeds = take_rows({k: v for k, v in arrays.items() if labels_fed or k != LABELS_KEY}, start, stop)
        labels = arrays[LABELS_KEY][start:stop] if has_labels and LABELS_KEY in arrays else None
        if labels is not None:
            labels = _class_indices(labels, stop - start, origin)
        yield Batch(feeds, labels, stop - start, f"{origin}[{start}:{stop}]")


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
            mod_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            folder = str(path.resolve().parent)  # its own imports of modules next to it, as `python file.py`
            if folder not in sys.path:
                sys.path.insert(0, folder)
            mod_spec.loader.exec_module(module)
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
    bsize = _batch_size(specs, batch_size, spec)

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
            _check_same_rows(arrays, used, f"{what} hook {spec} item {i}")
            n = feed_rows({s.name: arrays[s.name] for s in specs})
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
            items = _fill_fixed_batches(items, fixed_batch(specs), spec, what)
        for arrays, n, origin in items:
            yield from _split(arrays, n, bsize, origin, LABELS_KEY in arrays and not fed, fed)

    # Validate the first item now, before any long work.
    first = next(iter(make_batches()), None)
    if first is None:
        raise QDebugError(
            f"{what} hook {spec} yields no samples", "yield at least one feed dict", ExitCode.DATA
        )
    return DataSet(spec, specs, make_batches, None, first.labels is not None, tuple(sorted(ignored)))


def _fill_fixed_batches(
    items: Iterator[tuple[dict[str, np.ndarray], int, str]], batch: int, spec: str, what: str
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
        arrays = take_rows(arrays, 0, n)
        if pending and not _stackable(pending[0], arrays):
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
        joined = {k: np.concatenate([p[k] for p in pending]) if v.ndim else v for k, v in pending[0].items()}
        whole = rows - rows % batch
        yield take_rows(joined, 0, whole), whole, f"{first_origin}..{origin}"
        pending, rows = ([take_rows(joined, whole)], rows - whole) if rows > whole else ([], 0)
        first_origin = origin
    if rows:
        raise QDebugError(
            f"{what} hook {spec}: {rows} sample(s) left at the end do not fill a batch of {batch} "
            f"(the model's batch dimension is fixed at {batch})",
            f"yield a multiple of {batch} samples (or pass a --max-samples that is one), "
            "or export the model with a dynamic batch dimension",
            ExitCode.DATA,
        )


def _stackable(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    """Whether two items have the same keys, the same dimensions after the batch axis and the same scalars
    (a rank-0 input is one value for the whole batch: items that disagree on it cannot share one)."""

    def same(x: np.ndarray, y: np.ndarray) -> bool:
        if x.ndim and y.ndim:
            return x.shape[1:] == y.shape[1:]
        return not x.ndim and not y.ndim and np.array_equal(x, y)

    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


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
                    yield take_rows(batch.feeds, i, i + 1)
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
