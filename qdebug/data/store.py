"""Batches of named arrays kept for later passes, in memory up to a budget and on disk beyond it.

The evaluator scores every candidate against the FP32 model's outputs on the same inputs, so both are kept
for the whole run. At production sizes they do not fit: 5,000 detection images with ``[1, 84, 8400]``
outputs are 14 GB of references, 24 GB of 640x640 inputs. An :class:`ArrayStore` holds its first
``budget`` bytes in memory (the small cases stay as fast as before) and appends the rest to one file in a
private temporary folder, read back one batch at a time with ``pread``: the page cache, not the process,
holds what is re-read, so peak memory is flat in the number of samples.

The budget is the process's, shared by all its stores (the evaluation inputs, the FP32 outputs, a custom
metric's candidate outputs): the first batches kept are the ones in memory, whichever store holds them.

A store pickles as its in-memory batches plus the path of its file, which a worker process on the same
machine (``--workers``) reads as it is; the file is removed when the store that wrote it is collected or
the process exits. ``QDEBUG_SPILL_DIR`` puts the folder elsewhere than the system's temporary directory
(a larger disk); ``QDEBUG_SPILL_MB`` sets the in-memory budget (default 256).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_BUDGET_MB = 256
"""Bytes (in MiB) a store keeps in memory before it spills (``QDEBUG_SPILL_MB``)."""


def spill_budget() -> int:
    """The in-memory budget of a new store, in bytes (``QDEBUG_SPILL_MB``; 0 spills everything)."""
    text = os.environ.get("QDEBUG_SPILL_MB", "")
    try:
        mb = float(text) if text else DEFAULT_BUDGET_MB
    except ValueError:
        mb = DEFAULT_BUDGET_MB
    return max(0, int(mb * 2**20))


@dataclass(frozen=True)
class _Spilled:
    """Where one array lies in the store's file."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


Entry = dict[str, "np.ndarray | _Spilled"]

_SHARED = {"held": 0}
"""Bytes held in memory by the stores under the process's budget."""


class _File:
    """The store's append-only file in a private folder, removed with its owner."""

    def __init__(self) -> None:
        parent = os.environ.get("QDEBUG_SPILL_DIR") or None
        self.folder = Path(tempfile.mkdtemp(prefix="qdebug-spill-", dir=parent))
        self.path = self.folder / "batches.bin"
        self.handle = open(self.path, "w+b")  # noqa: SIM115 -- closed by the finalizer
        self.size = 0
        self._finalizer = weakref.finalize(self, _remove, self.handle, self.folder)

    def write(self, arr: np.ndarray) -> _Spilled:
        arr = np.ascontiguousarray(arr)
        self.handle.seek(self.size)
        self.handle.write(memoryview(arr.reshape(-1)).cast("B") if arr.size else b"")
        self.handle.flush()
        entry = _Spilled(self.size, arr.dtype, tuple(arr.shape))
        self.size += arr.nbytes
        return entry

    def close(self) -> None:
        self._finalizer()


def _remove(handle, folder: Path) -> None:
    handle.close()
    shutil.rmtree(folder, ignore_errors=True)


def _read(path: Path, fd_cache: dict[Path, int], entry: _Spilled) -> np.ndarray:
    """One spilled array, read into fresh memory (never a map: mapped pages would count as the process's)."""
    out = np.empty(entry.shape, dtype=entry.dtype)
    if not out.size:
        return out
    fd = fd_cache.get(path)
    if fd is None:
        fd = fd_cache[path] = os.open(path, os.O_RDONLY)
    view = memoryview(out.reshape(-1)).cast("B")
    done = 0
    while done < entry.nbytes:
        n = os.preadv(fd, [view[done:]], entry.offset + done)
        if n <= 0:
            raise OSError(f"spill file {path} ends before byte {entry.offset + entry.nbytes}")
        done += n
    return out


class ArrayStore(Sequence[dict[str, np.ndarray]]):
    """An append-only sequence of ``{name: array}`` batches (see the module docstring).

    ``store[i]`` returns the batch's arrays (fresh copies for spilled ones: a caller may keep or change
    them); ``store[a:b]`` a view of those batches; iteration reads one batch at a time.
    """

    def __init__(self, budget: int | None = None, *, inline: bool = False) -> None:
        self._inline = inline
        """Pickled with its arrays rather than its file's path: a result a worker sends back, whose file
        goes with the worker's copy."""
        self._shared = budget is None
        """Under the process's budget (``QDEBUG_SPILL_MB``) rather than one of its own."""
        self.budget = spill_budget() if budget is None else budget
        self._entries: list[Entry] = []
        self._held = 0
        self._file: _File | None = None
        self._path: Path | None = None
        self._fds: dict[Path, int] = {}

    def append(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Keep one batch (in memory while the budget lasts, else in the file; strings stay in memory)."""
        size = sum(int(a.nbytes) for a in arrays.values() if a.dtype.kind != "O")
        held = _SHARED["held"] if self._shared else self._held
        if held + size <= self.budget:
            self._entries.append(dict(arrays))
            self._held += size
            if self._shared:
                _SHARED["held"] += size
            return
        if self._file is None:
            self._file = _File()
            self._path = self._file.path
        entry: Entry = {}
        for k, a in arrays.items():
            entry[k] = a if a.dtype.kind == "O" else self._file.write(a)
        self._entries.append(entry)

    @property
    def held_bytes(self) -> int:
        """Bytes of batches kept in memory."""
        return self._held

    @property
    def spilled_bytes(self) -> int:
        """Bytes of batches in the file."""
        return sum(e.nbytes for entry in self._entries for e in entry.values() if isinstance(e, _Spilled))

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return StoreView(self, range(len(self))[index])
        entry = self._entries[index]
        return {k: (_read(self._path, self._fds, v) if isinstance(v, _Spilled) else v) for k, v in entry.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        """Remove the file now (the store is empty afterwards)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._file is not None:
            self._file.close()
        self._release()
        self._entries, self._file, self._path = [], None, None

    def _release(self) -> None:
        """Give this store's in-memory bytes back to the process's budget."""
        if self._shared:
            _SHARED["held"] = max(0, _SHARED["held"] - self._held)
        self._held = 0

    def __getstate__(self) -> dict:
        if self._inline and self._file is not None:
            state = dict(self.__dict__)
            state.update(_entries=[self[i] for i in range(len(self))], _file=None, _path=None, _fds={}, _shared=False)
            return state
        state = dict(self.__dict__)
        state["_file"] = None  # the reader does not own (or remove) the file
        state["_fds"] = {}
        state["_shared"] = False  # what it brings in memory is not charged to the reader's budget
        return state

    def __del__(self) -> None:
        if getattr(self, "_shared", False):
            self._release()
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


class StoreView(Sequence[dict[str, np.ndarray]]):
    """Some batches of an :class:`ArrayStore`, read through it."""

    def __init__(self, store: Sequence[dict[str, np.ndarray]], indices: range) -> None:
        self._store = store
        self._indices = indices

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return StoreView(self._store, self._indices[index])
        return self._store[self._indices[index]]
