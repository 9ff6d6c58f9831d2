"""Opening a data source: :func:`open_data` takes an ``.npz`` file, a folder of them or a hook
(:mod:`qdebug.data.hooks`).

Files are checked from their headers before any long work, then read one at a time on every pass, so
memory does not grow with the number of files; ``--max-samples`` stops the reading early.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from qdebug.data.checks import (
    batch_size_of,
    check_finite,
    check_fixed_batches,
    check_header,
    labels_fed,
)
from qdebug.data.dataset import DataSet, split_batches
from qdebug.data.hooks import hook_dataset
from qdebug.data.rows import Batch, feed_rows
from qdebug.data.specs import LABELS_KEY, InputSpec, batch_axes, resolve_batch_axes
from qdebug.errors import ExitCode, QDebugError


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
        return hook_dataset(text, specs, batch_size, max_samples, what)
    raise QDebugError(
        f"{what} not found: {text}", "pass an .npz file, a folder of them, or module:function", ExitCode.INPUT
    )


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
        counts.append(check_header(f, header, specs, what))
        has_labels = has_labels and LABELS_KEY in header and not labels_fed(specs)
    total = sum(counts)
    labelled = [f.name for f, h in headers.items() if LABELS_KEY in h]
    for f, header in headers.items():  # from the headers: strings had been found after the whole capture
        if LABELS_KEY in header and not labels_fed(specs):
            shape, dtype = header[LABELS_KEY]
            if dtype.kind not in "iuf" or len(shape) not in (1, 2) or (len(shape) == 2 and shape[1] != 1):
                raise QDebugError(
                    f"{what} {f}: labels have dtype {dtype} and shape {list(shape)}, expected one integer "
                    "class index per sample",
                    "save labels as a 1-D integer array (labels.astype(numpy.int64); argmax of one-hot rows)",
                    ExitCode.DATA,
                )
    if labelled and len(labelled) < len(headers) and not labels_fed(specs):
        raise QDebugError(
            f"{what} {source}: {len(labelled)} of {len(headers)} files have labels (e.g. {labelled[0]}), the "
            "others not; they had been dropped silently and top-1 became agreement with FP32",
            "give every file labels, or none",
            ExitCode.DATA,
        )
    if total == 0:
        raise QDebugError(f"{what} {source} holds no samples", "give at least one sample", ExitCode.DATA)
    n_samples = min(total, max_samples) if max_samples else total
    bsize = batch_size_of(specs, batch_size, source)
    check_fixed_batches(specs, counts, n_samples, source, what, limit_flag)
    axes = batch_axes(specs)

    def make_iter() -> Iterator[Batch]:
        left = n_samples
        for f in files:
            if left <= 0:
                return
            arrays = _read_npz(f, specs)
            n = feed_rows({s.name: arrays[s.name] for s in specs}, axes)
            check_finite(arrays, str(f))
            take = min(n, left)
            left -= take
            yield from split_batches(arrays, take, bsize, str(f), has_labels, labels_fed(specs), axes)
            del arrays

    def read_inputs(names: tuple[str, ...]) -> Iterator[tuple[dict[str, np.ndarray], str]]:
        left = n_samples
        wanted = tuple(s for s in specs if s.name in names)
        for f, n in zip(files, counts, strict=True):
            if left <= 0:
                return
            left -= n
            yield _read_npz(f, wanted), str(f)

    used = {s.name for s in specs} | {LABELS_KEY}
    ignored = tuple(sorted({k for h in headers.values() for k in h if k not in used}))
    return DataSet(source, specs, make_iter, n_samples, has_labels, ignored, read_inputs)


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
