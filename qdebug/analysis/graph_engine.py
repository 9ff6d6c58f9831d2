"""The graph engine: the capture's reductions computed inside ORT, on merged models.

Each side is optimized once, then the FP32 and QDQ models are merged into
one reduction model (:mod:`qdebug.graph.reduce`) that turns every paired
tensor into a few sums per batch; a second merged model serves the
fake-quant view. So each batch is reduced inside ORT and dropped, and memory
is flat in the number of samples.

Batches are split into capture chunks whose largest tensor stays cache-sized
(:data:`CAPTURE_ELEMENTS`). Chunks run concurrently, one single-threaded ORT
run per core (:func:`capture_workers`), and are accumulated in order; where
chunks start and end depends only on the model and the batch. So a report
depends neither on which run finishes first nor on the machine's core count.
Tensors whose in-graph sums are not finite are measured again by the numpy
engine (:class:`~qdebug.analysis.numpy_engine.NumpyPath`), exactly.

The tuning constants are read at run time from this module: a test that
patches one must patch it here, not on :mod:`qdebug.analysis`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx

from qdebug.analysis.build import TensorAcc
from qdebug.analysis.numpy_engine import Arrays, NumpyPath
from qdebug.analysis.reference import ReferenceMismatch, SharedReference
from qdebug.data import Axes, Batch, batch_axes, feed_rows, model_input_specs, take_rows
from qdebug.evaluation.metrics import ErrorAccumulator
from qdebug.graph.load import save_model
from qdebug.graph.match import TensorPair
from qdebug.graph.reduce import (
    SUBSAMPLE_INPUT,
    FakeQuant,
    PairSpec,
    ReductionModel,
    build_reduction_model,
    dot_from_sums,
    elem_types,
    moments_from_sums,
)
from qdebug.runtime.capture import (
    SessionConfig,
    make_session,
    open_sliced,
    optimize_for_capture,
    release_freed_memory,
    run_session,
)

Run = Callable[[Arrays], Arrays]
"""One ORT run of a merged model over a chunk's feeds (thread-safe: it goes to the capture workers)."""
Use = Callable[[int, Arrays, Arrays], tuple[Arrays, Arrays]]
"""Accumulates one run's sums (samples before the batch, the chunk's feeds, the run's outputs) and returns
the chunk's (FP32, quantized) graph outputs; on the calling thread, in chunk order."""

SUBSAMPLE_PER_SAMPLE = 256
"""Elements per tensor per sample copied out of ORT for the KL and TUI histograms (every k-th element)."""

CAPTURE_ELEMENTS = 1 << 19
"""Largest tensor (elements) a capture chunk aims for: 2 MiB of float32, so a tensor, its counterpart and
their difference stay in a CPU's last-level cache while they are reduced. On the BERT benchmark model,
chunks of 4 samples (512 K elements) ran 1.3x faster than whole batches of 16 and peaked at 0.3 GB instead
of 0.8 GB (docs/benchmarks.md)."""

MAX_CAPTURE_WORKERS = 4
"""Most capture runs in flight at once (each holds its own chunk's tensors)."""

CHUNK_PIECES = 4
"""A batch with enough work is cut into a multiple of this many chunks, so that up to this many workers
share it evenly (16 rows, chunk 16: four chunks of 4, not one of 16). A constant, not the worker count:
where chunks start and end moves the float32 in-graph sums and the histogram subsamples, and a report must
not depend on the machine's core count or ``--threads`` (tested)."""

MIN_PIECE_ELEMENTS = CAPTURE_ELEMENTS // 8
"""A batch is cut into :data:`CHUNK_PIECES` chunks only if each still holds this many elements of its
largest tensor: below that, the ~3-10 ms each run costs in Python (reading its sums) outweighs another core
(the transformer fixture ran up to 1.4x slower at N = 1000 when its batches of 16 were cut in two), and such
batches run one at a time on ORT's own threads."""

IN_FLIGHT_ELEMENTS = 4 * CAPTURE_ELEMENTS
"""Budget for the largest tensors of all chunks in flight: a model whose chunk is large gets fewer workers,
so the capture's memory does not grow with the number of cores (one chunk of 4 M elements: one worker)."""

READ_AHEAD_BYTES = 1 << 20
"""The capture loads the next batch before the current one is read only if a batch's inputs are this small
(or the batches are too small to keep the workers busy): the data is then not what sets the peak."""


def capture_workers(config: SessionConfig) -> int:
    """How many capture chunks may run at once, each an ORT run with one intra-op thread.

    The merged models run ~3,000 small reductions per chunk. With ORT's
    intra-op pool, each one pays a fork/join across the cores; running whole
    chunks side by side, one thread each, keeps every core busy without that
    synchronization. On the 2-core development machine the BERT benchmark's
    capture took 3.4-3.8 s instead of 4.8-5.7 s (docs/benchmarks.md). Only on
    the CPU provider: other providers keep their own threading. Fewer run once
    the chunks are sized (:data:`IN_FLIGHT_ELEMENTS`, :data:`MIN_PIECE_ELEMENTS`).
    """
    if tuple(config.providers) != ("CPUExecutionProvider",):
        return 1
    cores = config.intra_op_threads or _cpu_count()
    return max(1, min(cores, MAX_CAPTURE_WORKERS))


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, e.g. ``taskset`` or a cpuset; not a CPU quota)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}


def _finite(stats: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in stats.values())


def _add_pair(err: ErrorAccumulator, ref2: float, n: int, st: dict[str, float]) -> None:
    """Add one batch's in-graph sums of a (reference, candidate) pair to ``err``."""
    dot = dot_from_sums(ref2, st["cand2"], st["noise2"])
    err.add_sums(ref2, st["noise2"], st["cand2"], dot, max(st["dmax"], -st["dmin"]), n)


class OptimizedSides:
    """The capture's two sides as ORT optimized them -- the FP32 model with the capture's FP32 tensors as
    outputs, the quantized one with their quantized counterparts -- kept on disk after the capture, in a
    directory of their own (deleted by :meth:`cleanup`, or when this is collected).

    The per-sample drill-down opens them with graph optimizations off instead of optimizing the models
    again: ORT's start-up of an optimized QDQ model grows faster than its node count (1.5-2 s for the
    instrumented quantized model of a 3,200-node graph, against a fraction of that for its optimized file
    opened as it is), and the values are the ones the capture measured, fusions included.
    """

    TAGS = ("fp32-optimized", "qdq-optimized")

    def __init__(self, directory: tempfile.TemporaryDirectory, fp32_names: frozenset[str], qdq_names: frozenset[str]):
        self._dir = directory
        self.fp32 = Path(directory.name) / f"{self.TAGS[0]}.onnx"
        self.qdq = Path(directory.name) / f"{self.TAGS[1]}.onnx"
        self.fp32_names = fp32_names
        """The FP32 side's extra outputs."""
        self.qdq_names = qdq_names
        """The quantized side's extra outputs."""

    @classmethod
    def moved(cls, scratch: Path, fp32_names: frozenset[str], qdq_names: frozenset[str]) -> OptimizedSides | None:
        """The sides' files (each model and its weights file, which it names relatively) moved out of
        ``scratch`` into a directory of their own; None when one is missing."""
        directory = tempfile.TemporaryDirectory(prefix="qdebug-sides-", ignore_cleanup_errors=True)
        try:
            for tag in cls.TAGS:
                for suffix in (".onnx", ".data"):
                    src = scratch / f"{tag}{suffix}"
                    if src.exists():
                        os.replace(src, Path(directory.name) / src.name)
                    elif suffix == ".onnx":
                        raise FileNotFoundError(src)
        except OSError:
            directory.cleanup()
            return None
        return cls(directory, fp32_names, qdq_names)

    def cleanup(self) -> None:
        """Delete the files (the sessions opened on them must be gone)."""
        self._dir.cleanup()


class GraphPath:
    """Reductions computed inside ORT: one merged session on every sample, one for the fake-quant view."""

    def __init__(
        self,
        fp32: onnx.ModelProto,
        qdq: onnx.ModelProto,
        scored: list[TensorPair],
        local: dict[str, FakeQuant],
        config: SessionConfig,
        *,
        fakequant: bool = True,
        axes: Axes | None = None,
        shared: SharedReference | None = None,
        keep_sides: bool = False,
    ) -> None:
        self.scored = scored
        self.config = config
        self.keep_sides = keep_sides
        self.sides: OptimizedSides | None = None
        """After :meth:`close`, with ``keep_sides``: the optimized sides, kept (see :class:`OptimizedSides`)."""
        self._side_names: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())
        self._files: dict[str, Path] = {}
        self.in_axes: Axes = dict(axes) if axes is not None else batch_axes(model_input_specs(fp32))
        """Each input's batch axis (the data's): what a batch is cut and counted on."""
        out_axes = _chunk_axes(fp32, qdq, self.in_axes)
        self.out_axes: dict[str, int] = out_axes or {}
        """Each graph output's batch axis, where chunks of a batch are joined back (:func:`_chunk_axes`)."""
        self.splittable = out_axes is not None
        self.shared = shared
        """The FP32 side recorded by another capture or for the next ones (:mod:`.reference`), or None."""
        self.sharing: str | None = None
        """``"record"``, ``"replay"`` or None: what this capture does with ``shared`` (set by ``_build``)."""
        self._shared_key = SharedReference.key([p.fp32 for p in scored], fakequant, self.in_axes, out_axes)
        # the optimized models' weights go to files here, next to the merged models that refer to them
        # (ORT maps them while a session lives: where a mapped file cannot be deleted, cleanup must not fail)
        self._dir = tempfile.TemporaryDirectory(prefix="qdebug-capture-", ignore_cleanup_errors=True)
        try:
            self._build(fp32, qdq, scored, local, fakequant)
        except BaseException:  # a model ORT rejects, Ctrl-C: no scratch files left behind
            self._dir.cleanup()
            raise
        release_freed_memory()  # the protos are on disk now: their memory must not add to the sessions' peak
        self._main_sess = None
        self._fq_sess = None
        self.chunk: int | None = None
        self._largest = 0
        self._split_largest = 0
        """The first run's largest tensor per sample: what batches are cut by (fixed, so the cut of a batch
        does not depend on how far the pipeline has read when it is loaded)."""
        self._pending: dict[tuple[str, str], tuple[list, list]] = {}
        self._range: dict[str, tuple[float, float]] = {}
        self.workers = capture_workers(config)
        """Runs in flight at once; settled after the first run (:meth:`_settle`). A capture replaying
        another's FP32 side starts from the number that one settled on: the same first run settles it
        the same way, and its first session need not be reopened."""
        if self.sharing == "replay" and shared is not None and shared.workers is not None:
            self.workers = min(self.workers, shared.workers)
        self._settled = False
        self._pool: ThreadPoolExecutor | None = None
        self._opened: dict[str, float] = {}
        """Seconds each session took to open (what reopening it would cost again)."""
        self._first_seconds = 0.0
        """The first run's seconds per row (one sample, or the first batch that cannot be cut)."""
        self.fq_rows: int | None = None
        """Rows the fake-quant pass runs (None: not known), set by :meth:`fakequant_batches`."""
        self.reopened = 0
        """Sessions opened again with ORT's threads after the workers settled on one (tests read it)."""

    def _build(
        self,
        fp32: onnx.ModelProto,
        qdq: onnx.ModelProto,
        scored: list[TensorPair],
        local: dict[str, FakeQuant],
        fakequant: bool,
    ) -> None:
        """Optimize each side, merge them into the main (and fake-quant) reduction models, stash those."""
        config = self.config
        scratch = Path(self._dir.name)
        cand = [p.dequant or p.qdq for p in scored if p.qdq is not None]
        fo = optimize_for_capture(
            fp32, [p.fp32 for p in scored], config, what="FP32 model", scratch=scratch, tag="fp32-optimized"
        )
        qo = (
            optimize_for_capture(
                qdq, cand, config, what="quantized model", scratch=scratch, tag="qdq-optimized"
            )
            if fo is not None
            else None
        )
        self.preoptimized = fo is not None and qo is not None
        self._side_names = (frozenset(p.fp32 for p in scored), frozenset(cand))
        self.sharing = self._sharing(fp32)
        ref_model = fo if self.preoptimized else fp32
        types = (elem_types(fp32), _with_dq_types(qdq, elem_types(qdq)))
        keep = ([o.name for o in fp32.graph.output], [o.name for o in qdq.graph.output])
        specs = [PairSpec(p.fp32, p.fp32, p.dequant or p.qdq, local.get(p.fp32)) for p in scored]
        fq_specs = [PairSpec(p.fp32, p.fp32, p.dequant) for p in scored if p.dequant is not None]
        build = {"ref_types": types[0], "cand_types": types[1], "keep_outputs": keep}
        # both merged models go to files and their protos (and the optimized models) are dropped before any
        # session exists: ORT's copy is then the only one at the peak (60-90 MB less on the BERT model)
        reference = self.sharing != "replay"
        main = build_reduction_model(ref_model, qo if self.preoptimized else qdq, specs, reference=reference, **build)
        self.main_model: ReductionModel = self._replaying(self._stash(main, "main.onnx"), "main")
        del main, qo
        self.fq_model: ReductionModel | None = None
        if fakequant:
            names = [p.dequant for p in scored if p.dequant is not None]
            fq = optimize_for_capture(
                qdq,
                names,
                config,
                fake_quant=True,
                what="quantized model",
                scratch=scratch,
                tag="fakequant-optimized",
            )
            # the fake-quant view: the same FP32 side against the QDQ model with ORT's QDQ handling off
            fq_model = build_reduction_model(
                ref_model, fq or qdq, fq_specs, ref_stats=False, with_samples=False, reference=reference, **build
            )
            del fq
            self.fq_model = self._replaying(self._stash(fq_model, "fakequant.onnx"), "fakequant")

    def _sharing(self, fp32: onnx.ModelProto) -> str | None:
        """Replay ``shared`` when it holds this capture's FP32 side, else record it; neither without it, or
        when the sides are not optimized beforehand (the merged models then run ORT's optimizer, whose
        fusions could differ once the reference's reductions are gone: :mod:`.reference`)."""
        if self.shared is None or not self.preoptimized:
            return None
        if self.shared.usable(fp32, self._shared_key):
            self.shared.start_replay()
            return "replay"
        self.shared.start_recording(fp32, self._shared_key)
        return "record"

    def _replaying(self, model: ReductionModel, name: str) -> ReductionModel:
        """A merged model built without the reference's reductions, read as if it had them: its ``ref``
        pairs and their subsamples are the recorded ones (merged into each run's outputs by :meth:`_shared_out`)."""
        if self.sharing != "replay":
            return model
        assert self.shared is not None
        recorded = self.shared.replayed_keys(name)
        if recorded is None:
            raise ReferenceMismatch(name)
        keys, names = recorded
        samples = {k: dict(v) for k, v in model.samples.items()}
        for key, sample in names.items():
            samples.setdefault(key, {})["r"] = sample
        return dataclasses.replace(model, keys={**model.keys, "ref": keys}, samples=samples)

    def _shared_out(self, name: str, model: ReductionModel, feeds: Arrays, out: Arrays) -> Arrays:
        """One run's outputs, with the recorded reference outputs when replaying; recorded when recording."""
        if self.sharing == "replay":
            assert self.shared is not None
            return {**out, **self.shared.replay(name, feeds)}
        if self.sharing == "record":
            assert self.shared is not None
            self.shared.record(name, feeds, out, model.keys["ref"], model.samples)
        return out

    def finish_sharing(self) -> None:
        """The capture finished: a recording may now be read back; a replay must have read every chunk."""
        if self.sharing == "record":
            assert self.shared is not None
            self.shared.finish_recording(self.workers)
        elif self.sharing == "replay":
            assert self.shared is not None
            self.shared.finish_replay()

    def _stash(self, model: ReductionModel, name: str) -> ReductionModel:
        """Write a merged model to this capture's scratch directory; return it without its proto."""
        path = Path(self._dir.name) / name
        save_model(model.model, path)
        self._files[name] = path
        return dataclasses.replace(model, model=None)

    def _open(self, name: str, what: str, **options):
        """A session over a stashed merged model (arena on, node order kept, no memory pattern: its first
        run would plan it in time superlinear in the merged model's tens of thousands of nodes). Run with
        graph optimizations off (the sides were optimized beforehand), a large one is opened as slices of
        its nodes, one session each (:class:`~qdebug.runtime.capture.SegmentedSession`: the same outputs, and a
        start-up linear in the node count)."""
        threads = 1 if self.workers > 1 else None
        start = time.perf_counter()

        def open_one(path: Path):
            return make_session(
                path, self.config, what=what, arena=True, keep_order=True, threads=threads,
                mem_pattern=False, **options,
            )  # fmt: skip

        path = self._files[name]
        session = open_one(path) if options.get("optimize", True) else open_sliced(path, open_one)
        self._opened[name] = time.perf_counter() - start
        return session

    def fq_sess(self):
        """The fake-quant session, created on first use."""
        if self._fq_sess is None:
            self._fq_sess = self._open("fakequant.onnx", "fake-quant models", optimize=False, fake_quant=True)
        return self._fq_sess

    def main_sess(self):
        """The main session, created on first use (after the fake-quant view is released)."""
        if self._main_sess is None:
            self._main_sess = self._open("main.onnx", "instrumented models", optimize=not self.preoptimized)
        return self._main_sess

    def close_fakequant(self) -> None:
        """Release the fake-quant session before the main session is created."""
        if self._fq_sess is not None:
            self._fq_sess = None
            release_freed_memory()

    def close(self) -> None:
        """Release the sessions and the workers and delete the stashed models."""
        if self._pool is not None:  # chunks still queued (an error, Ctrl-C) are dropped, not run
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._main_sess = self._fq_sess = None
        if self.keep_sides and self.preoptimized:
            self.sides = OptimizedSides.moved(Path(self._dir.name), *self._side_names)
        self._dir.cleanup()
        release_freed_memory()  # the report is built next: it must not stack on the sessions' leftovers

    def main_batches(
        self,
        batches: Iterable[Batch],
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath,
        skipped: dict[str, str],
        fq_done: int,
    ) -> Iterator[tuple[Batch, Arrays, Arrays]]:
        """``(batch, FP32 outputs, deployed outputs)`` per batch, in order.

        A batch's deployed error also goes to ``head`` when it was in the fake-quant view (its first
        ``fq_done`` samples).
        """
        self.main_sess()  # here, not on a worker: two workers must not both create it
        model = self.main_model

        def run(feeds):  # looked up per run: the session is reopened if the workers are turned off
            return run_session(
                self.main_sess(), model.outputs, _with_subsample(feeds, self.in_axes), "the instrumented models"
            )

        def use(start, feeds, out):
            return self._use_main(feeds, out, accs, numpy_path, skipped, start < fq_done)

        def joined(item):
            batch, parts = item
            self._flush(accs)
            return batch, _join([r for r, _ in parts], self.out_axes), _join([d for _, d in parts], self.out_axes)

        # through map(): no local of this frame holds a yielded batch while the next ones run
        yield from map(joined, self._pipeline(batches, run, use))

    def _queue(self, name: str, kind: str, ref: np.ndarray, cand: np.ndarray) -> None:
        """Histogram samples wait for the end of the data batch: one numpy call per tensor, not per chunk."""
        entry = self._pending.setdefault((name, kind), ([], []))
        entry[0].append(ref)
        entry[1].append(cand)

    def _flush(self, accs: dict[str, TensorAcc]) -> None:
        for name, (lo, hi) in self._range.items():
            accs[name].ensure_edges(np.empty(0, np.float32), lo, hi)
        self._range.clear()
        for (name, kind), (refs, cands) in self._pending.items():
            target = accs[name].acc if kind == "acc" else accs[name].local
            if target is not None and target.histogram is not None:
                target.histogram.update(np.concatenate(refs), np.concatenate(cands))
        self._pending.clear()

    def fakequant_batches(
        self,
        batches: Iterable[Batch],
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath,
        skipped: dict[str, str],
        rows: int | None = None,
    ) -> Iterator[tuple[Batch, Arrays, Arrays]]:
        """``(batch, FP32 outputs, fake-quant outputs)`` per batch, in order; ``rows``: how many the batches
        hold, when known (whether the session is worth reopening once the workers settle)."""
        self.fq_rows = rows
        self.fq_sess()
        model = self.fq_model

        def run(feeds):
            feeds = _with_subsample(feeds, self.in_axes)
            return run_session(self.fq_sess(), model.outputs, feeds, "the fake-quant models")

        def use(start, feeds, out):
            return self._use_fakequant(feeds, out, accs, numpy_path)

        def joined(item):
            batch, parts = item
            return batch, _join([r for r, _ in parts], self.out_axes), _join([q for _, q in parts], self.out_axes)

        yield from map(joined, self._pipeline(batches, run, use))

    def _pipeline(self, batches: Iterable[Batch], run: Run, use: Use) -> Iterator[tuple[Batch, list]]:
        """``(batch, [use(start, chunk, run(chunk)) for its chunks])`` per batch, in order.

        ``run`` (ORT only, thread-safe) goes to the workers. A batch with
        fewer chunks than workers (one sample, or a model whose batches cannot
        be cut) does not leave them idle: the next batches' chunks start while
        its own are read. ``use`` (the accumulation) stays on this thread and
        sees the chunks in order, so the float64 sums are the same whatever
        the timing. ``start``: the samples before the batch. Until the workers
        are settled, the first run is made alone.
        """
        window: deque = deque()
        start = 0
        for batch in batches:
            done, pieces = self._first(batch, start, run, use)
            jobs = [self._pool_for().submit(run, p) if self.workers > 1 else None for p in pieces]
            window.append((batch, start, done, pieces, jobs))
            del done, pieces, jobs  # the window owns them: a finished batch's results must not outlive it
            start += batch.size
            while window and self._must_finish(window):
                yield self._finish(window.popleft(), run, use)
        while window:
            yield self._finish(window.popleft(), run, use)

    def _must_finish(self, window: deque) -> bool:
        """Whether the oldest batch is read now, before the next one is loaded.

        The pipeline reads ahead only as far as the workers need: batches
        with fewer chunks than workers, until the batches behind hold as many;
        a batch that keeps them busy alone, one batch more when its inputs are
        small (the next batch's chunks then start the moment this one's end,
        not after its results are read), and none when they are large (ResNet
        batches of 16: 9.6 MB more at the peak).
        """
        behind = sum(len(entry[3]) for entry in list(window)[1:])
        if self.workers == 1 or len(window) > self.workers or behind >= self.workers:
            return True
        oldest = window[0]
        if len(oldest[3]) < self.workers:
            return False
        small = sum(v.nbytes for v in oldest[0].feeds.values()) <= READ_AHEAD_BYTES
        return not (small and len(window) == 1)

    @staticmethod
    def _finish(entry: tuple, run: Run, use: Use) -> tuple[Batch, list]:
        batch, start, done, pieces, jobs = entry
        for i, piece in enumerate(pieces):
            job, jobs[i] = jobs[i], None  # each run's outputs go as soon as they are read, not with the batch
            done.append(use(start, piece, job.result() if job is not None else run(piece)))
            del job
        return batch, done

    def _first(self, batch: Batch, start: int, run: Run, use: Use) -> tuple[list, list]:
        """(chunks already used, chunks to run) of ``batch``; the very first run is made here, alone."""
        feeds, n = batch.feeds, batch.size
        done = []
        if not self._settled:
            # one sample measures the model; a batch that cannot be cut runs whole
            rows = 1 if self.splittable else n
            first = take_rows(feeds, 0, rows, self.in_axes) if rows < n else feeds
            began = time.perf_counter()
            out = run(first)
            self._first_seconds = (time.perf_counter() - began) / max(rows, 1)
            done.append(use(start, first, out))
            del out
            self._settle(n)
            if rows == n:
                return done, []
            feeds, n = take_rows(feeds, rows, None, self.in_axes), n - rows
        return done, list(_split(feeds, self._piece_rows(n), self.in_axes))

    def _settle(self, n: int) -> None:
        """After the first run: chunk rows from its largest tensor, then how many workers that is worth."""
        largest = self._split_largest = max(self._largest, 1)
        if self.splittable:
            self.chunk = max(1, CAPTURE_ELEMENTS // largest)
        per_run = (min(self._piece_rows(n), n) if self.splittable else n) * largest
        workers = self.workers
        if per_run < MIN_PIECE_ELEMENTS:  # too little work per run: the Python side would be the bottleneck
            workers = 1
        else:  # the runs in flight together stay within the memory budget
            workers = min(workers, max(1, IN_FLIGHT_ELEMENTS // per_run))
        if workers == 1 and self.workers > 1:
            # the open session was made single-threaded for the workers: reopen it with ORT's threads, unless
            # what is left for it costs less than opening it again (the fake-quant view of a large graph:
            # 32 samples, and a 3,200-node graph's session takes 2-3 s to open)
            keep_fq = self._fq_sess is not None and not self._worth_reopening("fakequant.onnx", n)
            self.reopened += int(self._fq_sess is not None and not keep_fq) + int(self._main_sess is not None)
            self._main_sess = None
            if not keep_fq:
                self._fq_sess = None
            release_freed_memory()
        self.workers = workers
        self._settled = True

    def _worth_reopening(self, name: str, n: int) -> bool:
        """Whether ORT's threads could win back more than a second opening of session ``name`` costs on the
        rows its pass has left: at most half their single-threaded time (two or more threads instead of
        one). True when the rows left are not known (the main pass: every calibration sample)."""
        rows = self.fq_rows if name == "fakequant.onnx" else None
        if rows is None:
            return True
        first = 1 if self.splittable else n
        return 0.5 * self._first_seconds * max(rows - first, 0) > self._opened.get(name, 0.0)

    def _piece_rows(self, n: int) -> int:
        """Rows per chunk for a batch of ``n``: at most ``self.chunk``; a multiple of :data:`CHUNK_PIECES`
        chunks when each keeps enough work. Depends on the model and the batch only, never on the workers."""
        if not (self.splittable and self.chunk):
            return n
        pieces = -(-n // self.chunk)
        if n * self._split_largest >= MIN_PIECE_ELEMENTS * CHUNK_PIECES:
            pieces = min(n, -(-pieces // CHUNK_PIECES) * CHUNK_PIECES)
        return -(-n // max(pieces, 1))

    def _pool_for(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="qdebug-capture")
        return self._pool

    def _note_size(self, counts: list[float], feeds: Arrays) -> None:
        rows = feed_rows(feeds, self.in_axes)
        self._largest = -(-int(max(counts, default=0)) // max(rows, 1))

    def _use_main(
        self,
        feeds: Arrays,
        out: Arrays,
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath,
        skipped: dict[str, str],
        head: bool = False,
    ) -> tuple[Arrays, Arrays]:
        out = self._shared_out("main", self.main_model, feeds, out)
        st = self.main_model.stats(out)
        bad = []
        for p in self.scored:
            ref = st["ref"][p.fp32]
            acc = st["acc"].get(p.fp32)
            loc = st["local"].get(p.fp32)
            if not (_finite(ref) and (acc is None or _finite(acc)) and (loc is None or _finite(loc))):
                bad.append(p)
                continue
            a = accs[p.fp32]
            n = int(ref["count"])
            mean, m2 = moments_from_sums(n, ref["rsum"], ref["ref2"])
            a.summary.add_moments(n, mean, m2, ref["rmin"], ref["rmax"])
            names = self.main_model.samples[p.fp32]
            if a.deferred_edges:  # edges from the whole first batch, fixed when its samples are flushed
                lo, hi = self._range.get(p.fp32, (math.inf, -math.inf))
                self._range[p.fp32] = (min(lo, ref["rmin"]), max(hi, ref["rmax"]))
            if acc is not None:
                _add_pair(a.acc.error, ref["ref2"], n, acc)
                if head and a.head is not None:
                    _add_pair(a.head, ref["ref2"], n, acc)
                if a.acc.histogram is not None or a.deferred_edges:
                    self._queue(p.fp32, "acc", out[names["r"]], out[names["c"]])
            if loc is not None and a.local is not None:
                _add_pair(a.local.error, ref["ref2"], n, loc)
                if a.local.histogram is not None:
                    self._queue(p.fp32, "local", out[names["r"]], out[names["l"]])
        self._note_size([r["count"] for r in st["ref"].values()], feeds)
        if bad:
            numpy_path.measure(feeds, accs, bad, skipped, head)
        ref_out = {orig: out[name] for name, orig in self.main_model.ref_outputs.items()}
        dep_out = {orig: out[name] for name, orig in self.main_model.cand_outputs.items()}
        return ref_out, dep_out

    def _use_fakequant(
        self, feeds: Arrays, out: Arrays, accs: dict[str, TensorAcc], numpy_path: NumpyPath
    ) -> tuple[Arrays, Arrays]:
        out = self._shared_out("fakequant", self.fq_model, feeds, out)
        st = self.fq_model.stats(out)
        bad = []
        for p in self.scored:
            acc = st["acc"].get(p.fp32)
            a = accs[p.fp32]
            if acc is None or a.fakequant is None:
                continue
            ref = st["ref"][p.fp32]
            if _finite(ref) and _finite(acc):
                _add_pair(a.fakequant, ref["ref2"], int(ref["count"]), acc)
            else:
                bad.append(p)
        self._note_size([r["count"] for r in st["ref"].values()], feeds)
        if bad:
            numpy_path.fakequant_pairs(feeds, accs, bad)
        ref_out = {orig: out[name] for name, orig in self.fq_model.ref_outputs.items()}
        return ref_out, {orig: out[name] for name, orig in self.fq_model.cand_outputs.items()}


def _with_dq_types(model: onnx.ModelProto, types: dict[str, int]) -> dict[str, int]:
    """``types`` plus DequantizeLinear outputs, whose element type is their scale's.

    ORT's quantizer writes no value_info for the Q/DQ tensors it adds; without
    this, every compared DQ output would be cast (copied) to float first.
    """
    out = dict(types)
    inits = {i.name: i.data_type for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and len(node.input) > 1 and node.input[1] in inits:
            out.setdefault(node.output[0], inits[node.input[1]])
    return out


def _with_subsample(feeds: Arrays, axes: Axes | None = None) -> Arrays:
    rows = feed_rows(feeds, axes)
    target = SUBSAMPLE_PER_SAMPLE * max(int(rows), 1)
    return {**feeds, SUBSAMPLE_INPUT: np.array(target, dtype=np.int64)}


def _chunk_axes(fp32: onnx.ModelProto, qdq: onnx.ModelProto, axes: Axes) -> dict[str, int] | None:
    """Each graph output's batch axis when batches may be cut into capture chunks without changing any
    number; None when they may not.

    Samples must be independent along the inputs' batch axes (``axes``, the data's): every such axis of
    every graph input is one symbolic dimension, which every graph output of both models has once (a
    streaming model's new state ``[2, batch, 128]``: on axis 1), and no float tensor of the FP32 model
    lost it (a reduction over the batch, e.g. a mean used as a branch condition, would see a chunk
    instead of the batch): with every axis 0 that is the old rule, no float tensor a scalar or with a
    fixed first dimension; elsewhere each float tensor must carry the symbol. Unknown shapes count as not
    chunkable. Rank-0 inputs are one value for the whole batch, fed whole to every chunk.
    """
    inits = {i.name for i in fp32.graph.initializer}
    scalars = {s.name for s in model_input_specs(fp32) if s.scalar}
    inputs = [v for v in fp32.graph.input if v.name not in inits and v.name not in scalars]
    if not inputs or any(axes.get(v.name, 0) is None for v in inputs):
        return None
    batch = {(_dim_names(v)[axes.get(v.name, 0) or 0 :] or [""])[0] for v in inputs}
    symbol = next(iter(batch))
    if len(batch) != 1 or not symbol:
        return None
    out: dict[str, int] = {}
    for model in (fp32, qdq):
        for v in model.graph.output:
            axis = _symbol_axis(_dim_names(v), symbol)
            if axis is None or out.setdefault(v.name, axis) != axis:
                return None
    first = all(axes.get(v.name, 0) == 0 for v in inputs) and not any(out.values())
    return out if _keeps_batch(fp32, symbol, first, _downstream(fp32, {v.name for v in inputs})) else None


def _downstream(model: onnx.ModelProto, sources: set[str]) -> set[str]:
    """The top-level tensors computed from ``sources`` (a value made of scalar inputs and constants only,
    e.g. a sample rate cast to a gain, is the same for every chunk)."""
    reached = set(sources)
    for node in model.graph.node:  # topologically sorted (ONNX requires it)
        subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if subgraph or any(i in reached for i in node.input):  # a subgraph may read any outer value
            reached.update(o for o in node.output if o)
    return reached


def _keeps_batch(fp32: onnx.ModelProto, symbol: str, first: bool, batched: set[str]) -> bool:
    """Whether every float tensor with a known shape computed from the samples (``batched``) keeps the
    batch: its first dimension is not static (``first``: the batch is every input's and output's axis 0),
    else it has ``symbol`` among its dims."""
    for v in fp32.graph.value_info:
        t = v.type.tensor_type
        if v.name in batched and t.elem_type in FLOAT_TYPES and t.HasField("shape"):
            if first and (not t.shape.dim or t.shape.dim[0].HasField("dim_value")):
                return False
            if not first and symbol not in _dim_names(v):
                return False
    return True


def _symbol_axis(names: list[str], symbol: str) -> int | None:
    """Where ``symbol`` sits in a value's dims: axis 0 when it is first, else its only place (None)."""
    if names[:1] == [symbol]:
        return 0
    return names.index(symbol) if names.count(symbol) == 1 else None


def _dim_names(value: onnx.ValueInfoProto) -> list[str]:
    """The symbolic name of each of a value's dimensions ("" where static or unnamed; [] when unknown)."""
    t = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not t.HasField("shape"):
        return []
    return [d.dim_param if d.HasField("dim_param") else "" for d in t.shape.dim]


def _split(feeds: Arrays, size: int, axes: Axes | None = None) -> Iterator[Arrays]:
    """Chunks of ``size`` samples of one batch, each input cut on its batch axis (``axes``)."""
    n = feed_rows(feeds, axes)
    if n <= size:
        yield feeds
        return
    for start in range(0, n, size):
        yield take_rows(feeds, start, start + size, axes)


def _join(parts: list[Arrays], axes: Mapping[str, int] | None = None) -> Arrays:
    """Graph outputs of consecutive chunks of one batch, concatenated back along each output's batch axis
    (``axes``, from :func:`_chunk_axes`; axis 0 for an output it lacks)."""
    if len(parts) == 1:
        return parts[0]
    axes = axes or {}
    return {k: np.concatenate([p[k] for p in parts], axis=axes.get(k, 0)) for k in parts[0]}
