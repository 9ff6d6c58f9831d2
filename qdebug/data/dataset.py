"""A validated, re-iterable data source (:class:`DataSet`), the batching files and hooks share, and its
ORT ``CalibrationDataReader`` view (:class:`ReaderAdapter`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from qdebug.data.checks import check_batch, check_finite, class_indices
from qdebug.data.rows import Axes, Batch, feed_rows, take_rows
from qdebug.data.specs import LABELS_KEY, InputSpec
from qdebug.errors import ExitCode, QDebugError


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
        read_inputs: Callable[[tuple[str, ...]], Iterator[tuple[dict[str, np.ndarray], str]]] | None = None,
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
        self._read_inputs = read_inputs
        """Files: reads some inputs' arrays only, file by file (:meth:`input_arrays`)."""

    def batches(self) -> Iterator[Batch]:
        """Iterate over the batches (validated as they are produced)."""
        seen = 0
        for batch in self._make_iter():
            check_batch(batch, self.specs)
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

    def input_arrays(self, names: Sequence[str]) -> Iterator[tuple[Mapping[str, np.ndarray], str]]:
        """The arrays of the inputs ``names`` only, one file (of the samples counted) or batch at a time, with
        where each came from: a scan of a few inputs (files: nothing else is read; hooks: every batch)."""
        if self._read_inputs is not None:
            for arrays, origin in self._read_inputs(tuple(names)):
                yield {n: arrays[n] for n in names}, origin
            return
        for batch in self.batches():
            yield {n: batch.feeds[n] for n in names}, batch.origin

    def check_values(self) -> None:
        """Refuse NaN/Inf in a float input now, before any long work starts (exit 5): the files' float inputs
        are read once, nothing else. A hook's items are checked as they are produced, the first one when the
        hook is opened (calling it again here could cost as much as the work itself)."""
        if self._read_inputs is None:
            return
        names = [s.name for s in self.specs if s.dtype.kind in "fc"]
        if names:
            for arrays, origin in self.input_arrays(names):
                check_finite(arrays, origin)

    def first(self) -> Batch:
        """The first batch (used to prepare sessions before the timed work)."""
        for b in self.batches():
            return b
        raise QDebugError(
            f"data source {self.source} yields no samples", "give at least one sample", ExitCode.DATA
        )


def split_batches(
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
            labels = class_indices(labels, stop - start, origin)
        yield Batch(feeds, labels, stop - start, f"{origin}[{start}:{stop}]", axes)


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
