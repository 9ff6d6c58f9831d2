"""The FP32 side of a graph-engine capture, recorded by one capture and read back by the next ones.

``analyze --method minmax,entropy,percentile`` captures three QDQ models against the same FP32 model, over
the same data cut into the same chunks. Each merged reduction model (:mod:`qdebug.graph.reduce`) computes
the reference's own reductions -- element count, sum of squares, min, max, sum, and a subsample -- for
every scored tensor: the same numbers for every method, from the same FP32 kernels on the same inputs.
They are about a third of a merged model's nodes (8,821 of 24,057 on the 800-node chain of
docs/benchmarks.md), and what a capture pays most for is opening its sessions, roughly in proportion to
the node count. So the first capture records them, chunk by chunk, and the next ones build their merged
models without them and read them back (:class:`SharedReference`).

Read back only where that is provably the numbers a capture of its own would compute:

* the same FP32 proto, the same scored tensors in the same order, the same fake-quant view and the same
  batch axes and chunking rule (:meth:`SharedReference.key`);
* both sides optimized beforehand, so the merged models run with ORT's optimizer off and the FP32 nodes
  are exactly the ones given (with the optimizer on, dropping the reference's reductions could let ORT
  fuse differently);
* every chunk's feeds equal to the recorded chunk's (a digest each: a data hook that yields other samples
  on each call is caught), and as many chunks.

Otherwise :class:`ReferenceMismatch` is raised and the capture is measured again in full. The capture that
records also leaves the number of capture workers it settled on, so that the next ones open their sessions
with it at once instead of reopening them after their first run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from qdebug.data.store import ArrayStore

SAMPLE_PREFIX = "qdbg/shared-r/"
"""Names the recorded reference subsamples are read back under (``<prefix><index of the pair>``): no merged
model has an output of that name."""


class ReferenceMismatch(Exception):
    """A capture's FP32 side is not the recorded one (internal: the capture is measured again in full)."""


def feeds_digest(feeds: Mapping[str, np.ndarray]) -> bytes:
    """A digest of one chunk's inputs: names, types, shapes and values."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(feeds):
        a = np.asarray(feeds[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(repr(a.tolist()).encode() if a.dtype.kind == "O" else np.ascontiguousarray(a).tobytes())
    return h.digest()


@dataclass(eq=False)
class _Pass:
    """One recorded pass (the main one or the fake-quant view's): per chunk, in the order chunks are used."""

    keys: tuple[str, ...]
    """The pairs of the ``ref`` group, in its output vectors' order."""
    columns: tuple[str, ...]
    """The ``ref`` group's outputs (``qdbg/ref/<statistic>``)."""
    sampled: tuple[bool, ...]
    """Which pairs have a recorded subsample."""
    store: ArrayStore = field(default_factory=ArrayStore)
    digests: list[bytes] = field(default_factory=list)
    read: int = 0
    """Chunks read back by the capture now replaying (reset when one starts)."""


class SharedReference:
    """The FP32 reductions of one capture, for the next captures of the same FP32 model over the same data.

    Mutable on purpose: the first capture fills it as it runs; it is complete only once that capture has
    finished (a failed or interrupted one leaves nothing to read back). ``replayed`` and ``refused`` count
    the captures that read it back and those that could not (for the command's progress lines).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._fp32: onnx.ModelProto | None = None
        self._passes: dict[str, _Pass] = {}
        self.complete = False
        self.workers: int | None = None
        """The capture workers the recording capture settled on."""
        self.replayed = 0
        self.refused = 0

    @staticmethod
    def key(
        scored: Sequence[str], fakequant: bool, axes: Mapping[str, Any], chunk_axes: Mapping[str, int] | None
    ) -> tuple:
        """What a capture's FP32 side depends on besides the FP32 proto and the data: the scored tensors in
        order, the fake-quant view, the inputs' batch axes and the outputs' (None: batches are not cut)."""
        outs = None if chunk_axes is None else tuple(sorted(chunk_axes.items()))
        return (tuple(scored), fakequant, tuple(sorted(axes.items())), outs)

    def usable(self, fp32: onnx.ModelProto, key: tuple) -> bool:
        """Whether a capture of ``fp32`` with ``key`` may read this recording back."""
        return self.complete and fp32 is self._fp32 and key == self._key

    def start_recording(self, fp32: onnx.ModelProto, key: tuple) -> None:
        """Forget any earlier recording; the capture starting now records its FP32 side."""
        self._key, self._fp32, self._passes, self.complete, self.workers = key, fp32, {}, False, None

    def start_replay(self) -> None:
        """A capture starts reading the recording back from its first chunk."""
        for p in self._passes.values():
            p.read = 0

    def record(
        self,
        name: str,
        feeds: Mapping[str, np.ndarray],
        out: Mapping[str, np.ndarray],
        keys: Sequence[str],
        samples: Mapping[str, Mapping[str, str]],
    ) -> None:
        """Keep one chunk's reference outputs of pass ``name`` (``keys``: the ``ref`` group's pairs)."""
        p = self._passes.get(name)
        if p is None:
            columns = tuple(sorted(n for n in out if n.startswith("qdbg/ref/")))
            sampled = tuple("r" in samples.get(k, {}) for k in keys)
            p = self._passes[name] = _Pass(tuple(keys), columns, sampled)
        entry = {c: out[c] for c in p.columns}
        entry.update(
            (f"{SAMPLE_PREFIX}{i}", out[samples[k]["r"]]) for i, k in enumerate(p.keys) if p.sampled[i]
        )
        p.store.append(entry)
        p.digests.append(feeds_digest(feeds))

    def finish_recording(self, workers: int) -> None:
        """The recording capture finished: its recording may be read back."""
        self.complete, self.workers = True, workers

    def replayed_keys(self, name: str) -> tuple[tuple[str, ...], dict[str, str]] | None:
        """Pass ``name``'s ``ref`` pairs and their subsample names, as a replaying reduction model reads them
        (None: the pass was not recorded)."""
        p = self._passes.get(name)
        if p is None:
            return None
        return p.keys, {k: f"{SAMPLE_PREFIX}{i}" for i, k in enumerate(p.keys) if p.sampled[i]}

    def replay(self, name: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The next chunk's recorded reference outputs of pass ``name``, after checking its feeds are the
        recorded chunk's (:class:`ReferenceMismatch` if not, or if there are more chunks than recorded)."""
        p = self._passes.get(name)
        if p is None or p.read >= len(p.digests) or feeds_digest(feeds) != p.digests[p.read]:
            raise ReferenceMismatch(name)
        p.read += 1
        return p.store[p.read - 1]

    def finish_replay(self) -> None:
        """A replaying capture finished: it must have read every recorded chunk."""
        if any(p.read != len(p.digests) for p in self._passes.values()):
            raise ReferenceMismatch("fewer chunks than recorded")
        self.replayed += 1

    def refuse(self) -> None:
        """A capture could not read it back (other feeds): later ones do not try."""
        self.refused += 1
        self.complete = False
