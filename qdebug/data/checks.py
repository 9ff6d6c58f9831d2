"""The data checks, run before any long work starts.

Arrays against the model's inputs (dtype, rank, static dims), the same number of samples in every input and
the labels, finite values, ids inside the table a Gather reads, labels as class indices, and whole batches
for a model whose batch dimension is fixed. Every problem is one :class:`~qdebug.errors.QDebugError`
naming the file or hook item, the input and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from qdebug.data.rows import Axes, Batch, axis_of
from qdebug.data.specs import BATCH_AXIS_FLAG, LABELS_KEY, InputSpec, fixed_batch, fixed_sizes
from qdebug.errors import ExitCode, QDebugError


def check_header(
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
        check_array_meta(s, shape, dtype, str(f))
        if s.batch_axis is not None and len(shape) > s.batch_axis:
            sizes[s.name] = (s.batch_axis, shape[s.batch_axis])
    if LABELS_KEY in header and not labels_fed(specs):
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


def check_array_meta(spec: InputSpec, shape: tuple[int, ...], dtype: np.dtype, origin: str) -> None:
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


def check_same_rows(arrays: Mapping[str, np.ndarray], axes: Axes, origin: str) -> int:
    """The samples of one item: every input (and the labels) holds as many on its batch axis (only the
    first input's had been used: the others were cut to it, or ORT failed with a raw message)."""
    sizes = {}
    for k, v in arrays.items():
        axis = axis_of(k, v, axes) if k in axes or k == LABELS_KEY else None
        if axis is not None:
            sizes[k] = (axis, int(v.shape[axis]))
    if LABELS_KEY in sizes and len(sizes) == 1 and LABELS_KEY not in axes:  # no batch axis: one sample
        sizes[""] = (0, 1)
    return _same_samples(sizes, origin)


def check_finite(arrays: Mapping[str, np.ndarray], origin: str) -> None:
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


def check_fixed_batches(
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


def batch_size_of(specs: tuple[InputSpec, ...], requested: int | None, source: str) -> int | None:
    """The batch size to split files into; ``None`` keeps each file's batch as is.

    A model with a static batch dimension accepts only that size.
    """
    static = fixed_sizes(specs)
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


def class_indices(labels: np.ndarray, n: int, origin: str) -> np.ndarray:
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


def labels_fed(specs: tuple[InputSpec, ...]) -> bool:
    """Whether the model has an input named ``labels``: the key is then fed to it and is not the labels
    (the model had been run without it: "Required inputs (['labels']) are missing")."""
    return any(s.name == LABELS_KEY for s in specs)


def check_batch(batch: Batch, specs: tuple[InputSpec, ...]) -> None:
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
