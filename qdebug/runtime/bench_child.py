"""The measuring side of ``qdebug bench``: one variant, one process.

``python -m qdebug.runtime.bench_child SPEC.json`` times one model and writes its
result JSON (path named in the spec). The parent (:mod:`qdebug.bench`) starts
one such process per variant (one after another, each ready before the next
starts), so each variant's peak RSS is its own and no variant inherits
another's arena or thread pool; with ``--serve`` the processes stay open and
the parent hands out the timed passes round robin (:func:`serve`).

This module imports only the standard library, numpy and onnxruntime (not
onnx, not the rest of qdebug), so the memory it reports is the model's and the
runtime's, not the tool's.

The loop (:class:`Harness`), identical for every variant:

* the session is created once, with the same options as
  ``qdebug.runtime.capture.make_session`` (``ORT_ENABLE_ALL``, the given providers and
  intra-op threads);
* one set of input buffers per distinct batch shape is allocated before any
  timing; each batch is copied into them with ``np.copyto`` -- nothing is
  allocated per batch;
* inputs and outputs are bound once per shape with ORT IO binding, outputs to
  preallocated numpy buffers shaped like a real first run's outputs (fallbacks,
  in order: outputs allocated by ORT, then plain ``session.run`` on the
  preallocated inputs; the mode used is reported). A model whose declared
  output shape disagrees with what ORT returns goes straight to ORT's own
  outputs (ORT refuses a buffer of the real shape), and the result's
  ``declared_shapes`` names the wrong declaration (:func:`declared_shape_mismatches`);
* warm-up runs (every batch shape, ``warmup`` times) are excluded;
* one timed batch = refill the bound inputs + run; timings go into a
  preallocated array; the garbage collector is paused during the timed passes;
* batches smaller than the largest (the last, partial batch) are timed and
  reported separately, never padded;
* Python-side allocations are measured with ``tracemalloc`` over a separate,
  short loop of the same steps after the timed passes (tracing slows the
  interpreter, so it never runs while timing).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IOBINDING_PREALLOCATED = "iobinding"
"""Inputs and outputs bound once to preallocated numpy buffers."""
IOBINDING_ORT_OUTPUTS = "iobinding-ort-outputs"
"""Inputs bound to preallocated buffers; outputs allocated by ORT on each run (shape not fixed)."""
SESSION_RUN = "session.run"
"""Plain ``session.run`` over the preallocated input buffers (IO binding refused by the provider)."""
_MODES = [IOBINDING_PREALLOCATED, IOBINDING_ORT_OUTPUTS, SESSION_RUN]


def make_session(model_path: str, providers: Sequence[str], threads: int) -> Any:
    """An InferenceSession with the options of ``qdebug.runtime.capture.make_session`` (kept in step with it)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    return ort.InferenceSession(model_path, opts, providers=list(providers))


@dataclass
class Step:
    """One batch of the loop: copy the batch into the bound buffers, then run."""

    copies: tuple[tuple[np.ndarray, np.ndarray], ...]
    """(destination buffer, source batch array) per input."""
    run: Callable[[], Any]
    size: int
    """Samples in the batch."""


def declared_shape_mismatches(session: Any, outputs: Sequence[Any]) -> dict[str, str]:
    """Output name -> a note, for each output whose array, as ORT returned it, contradicts its declared shape.

    ORT checks an output bound to a buffer against the declared shape (after
    its own shape inference) and refuses one of another rank or fixed size
    ("Invalid rank for output: ... Got: 3 Expected: 2") -- even a buffer of
    exactly the shape ORT itself returned. Such a declaration is the model's
    fault: ORT can only allocate that model's outputs on each run, and with
    default logging it warns about the output on every run. Shared with
    ``qdebug.verify``'s timing, so both say it in the same words.
    """
    notes = {}
    for meta, value in zip(session.get_outputs(), outputs, strict=False):
        shape = getattr(value, "shape", None)
        if shape is None or _conforms(meta.shape, shape):
            continue
        notes[meta.name] = (
            f"the model declares output '{meta.name}' as {_dims(meta.shape)} but ONNX Runtime returns "
            f"{_dims(shape)}: the declaration is wrong (ORT warns about it on every run and refuses output "
            "buffers of the real shape), so ORT allocates this output on every timed run; fix or clear "
            "the output's shape in the model"
        )
    return notes


def _conforms(declared: Sequence[Any], shape: Sequence[int]) -> bool:
    """Whether ORT accepts an output of ``shape`` for ``declared`` (``[]``: ORT knows no shape, checks none;
    a named or unknown dimension takes any size)."""
    if not declared:
        return True
    if len(declared) != len(shape):
        return False
    return all(not isinstance(d, int) or d < 0 or d == n for d, n in zip(declared, shape, strict=True))


def _dims(shape: Sequence[Any]) -> str:
    """``[N, seqlen]``, ``[8, 5, 8]``: an unnamed unknown dimension shows as ``?``."""
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _rows(batch: Mapping[str, np.ndarray]) -> int:
    """Samples in one batch when the parent did not say (:func:`load_rows`): :func:`qdebug.data.feed_rows`'s
    rule without batch axes (axis 0 of the first batched input; 1 when every input is a scalar), restated
    because this module imports nothing of qdebug."""
    return next((len(v) for v in batch.values() if v.ndim), 1)


class Harness:
    """The timed loop over one session (see the module docstring).

    Args:
        session: an ``onnxruntime.InferenceSession``.
        batches: the batches, each a mapping input name -> array.
        use_iobinding: False forces plain ``session.run`` (for comparisons).
        rows: the samples of each batch (None: axis 0 of its first batched input).

    """

    def __init__(
        self,
        session: Any,
        batches: Sequence[Mapping[str, np.ndarray]],
        *,
        use_iobinding: bool = True,
        rows: Sequence[int] | None = None,
    ) -> None:
        if not batches:
            raise ValueError("no batches to time")
        self.session = session
        self.input_names = [i.name for i in session.get_inputs() if i.name in batches[0]]
        self.output_names = [o.name for o in session.get_outputs()]
        self.notes: list[str] = []
        self.declared: dict[str, str] = {}
        """:func:`declared_shape_mismatches`, each output's note from the first batch shape that showed it."""
        sizes = [int(n) for n in rows] if rows is not None else [_rows(b) for b in batches]
        self.full_size = max(sizes)
        by_shape: dict[tuple, tuple[tuple[np.ndarray, ...], Callable[[], Any], str]] = {}
        steps = []
        first: list[Step] = []
        keys = []
        for b, size in zip(batches, sizes, strict=True):
            key = tuple((b[n].shape, b[n].dtype.str) for n in self.input_names)
            if key not in by_shape:
                bufs = tuple(np.empty(b[n].shape, b[n].dtype) for n in self.input_names)
                for buf, n in zip(bufs, self.input_names, strict=True):
                    np.copyto(buf, b[n])
                by_shape[key] = (bufs, *self._bind(bufs, use_iobinding))
            bufs, run, _ = by_shape[key]
            srcs = (np.asarray(b[n], order="C") for n in self.input_names)
            copies = tuple(zip(bufs, srcs, strict=True))
            steps.append(Step(copies, run, size))
            keys.append(key)
            if len(first) < len(by_shape):
                first.append(steps[-1])
        if self._data_dependent_outputs():
            steps = self._check_preallocated(steps, keys, by_shape)
            first = [next(s for s, k in zip(steps, keys, strict=True) if k == key) for key in by_shape]
        self.steps = steps
        self.shapes = len(by_shape)
        self.mode = max((m for _, _, m in by_shape.values()), key=_MODES.index)
        """The least direct binding mode used for any batch shape."""
        self._first_of_shape = first
        self.last_wall_ns = 0
        """Wall time of the last timed loop (all batches, bookkeeping included, setup excluded)."""

    # ------------------------------------------------------------------ binding

    def _data_dependent_outputs(self) -> bool:
        """Whether an output dimension may depend on the values, not only on the input shapes.

        A dimension that is neither a number nor named like an input dimension
        (NonZero's count, ``[2, K]``) may differ between two batches of one
        shape; their preallocated output buffers would then be refused.
        """
        named = {d for i in self.session.get_inputs() for d in i.shape if isinstance(d, str)}
        return any(
            not isinstance(d, int) and d not in named for o in self.session.get_outputs() for d in o.shape
        )

    def _check_preallocated(self, steps: list[Step], keys: list, by_shape: dict) -> list[Step]:
        """Run every batch once (plain ``run``); a batch shape whose output shapes vary gets ORT's outputs.

        Binding checks only the first batch of each shape, so a later batch with
        another NonZero count failed inside the timed loop (INVALID_ARG).
        """
        seen: dict[tuple, list[tuple[int, ...]]] = {}
        moved: dict[tuple, Callable[[], Any]] = {}
        for step, key in zip(steps, keys, strict=True):
            bufs, _, mode = by_shape[key]
            if mode != IOBINDING_PREALLOCATED or key in moved:
                continue
            feeds = {n: src for n, (_, src) in zip(self.input_names, step.copies, strict=True)}
            shapes = [o.shape for o in self.session.run(self.output_names, feeds)]
            if seen.setdefault(key, shapes) != shapes:
                moved[key] = self._ort_outputs(bufs)
                by_shape[key] = (bufs, moved[key], IOBINDING_ORT_OUTPUTS)
        if moved:
            self.notes.append(
                "an output's shape depends on the data (e.g. NonZero): ORT allocates the outputs of "
                f"{len(moved)} batch shape(s)"
            )
        return [Step(s.copies, moved.get(k, s.run), s.size) for s, k in zip(steps, keys, strict=True)]

    def _ort_outputs(self, bufs: tuple[np.ndarray, ...]) -> Callable[[], Any]:
        """A binding of ``bufs`` as inputs whose outputs ORT allocates on each run.

        The outputs are bound afresh before every run: a binding keeps the
        values ORT allocated and hands them back as preallocated outputs on
        the next run, which a NonZero of another count then refuses.
        """
        sess = self.session
        io = sess.io_binding()
        for name, buf in zip(self.input_names, bufs, strict=True):
            io.bind_input(name, "cpu", 0, buf.dtype.type, buf.shape, buf.ctypes.data)
        names = self.output_names
        self._keep(io, [])

        def run() -> None:
            io.clear_binding_outputs()
            for name in names:
                io.bind_output(name, "cpu")
            sess.run_with_iobinding(io)

        run()
        return run

    def _bind(self, bufs: tuple[np.ndarray, ...], use_iobinding: bool) -> tuple[Callable[[], Any], str]:
        """The run of one batch shape, its outputs in buffers shaped like a real first run's outputs."""
        sess = self.session
        feeds = dict(zip(self.input_names, bufs, strict=True))
        reference = sess.run(self.output_names, feeds)
        wrong = self._note_declared(reference)
        if not use_iobinding:
            return (lambda: sess.run(self.output_names, feeds)), SESSION_RUN
        try:
            io = sess.io_binding()
            for name, buf in zip(self.input_names, bufs, strict=True):
                io.bind_input(name, "cpu", 0, buf.dtype.type, buf.shape, buf.ctypes.data)
        except Exception as e:  # a provider that refuses host-memory inputs
            self.notes.append(f"IO binding refused ({e.__class__.__name__}); timed with session.run")
            return (lambda: sess.run(self.output_names, feeds)), SESSION_RUN
        if wrong:  # ORT refuses any buffer for such an output: no attempt, no second note
            return self._ort_outputs_or_run(bufs, feeds)
        outs = [np.empty_like(r) for r in reference]
        try:
            for name, out in zip(self.output_names, outs, strict=True):
                io.bind_output(name, "cpu", 0, out.dtype.type, out.shape, out.ctypes.data)
            sess.run_with_iobinding(io)
            sess.run_with_iobinding(io)  # twice: a changing output shape shows on the second run
            if not all(o.shape == r.shape for o, r in zip(outs, reference, strict=True)):
                raise ValueError("output shape changed")
        except Exception as e:
            self.notes.append(
                f"outputs could not be bound to preallocated buffers ({e.__class__.__name__}); "
                "ORT allocates them"
            )
            return self._ort_outputs_or_run(bufs, feeds)
        self._keep(io, outs)
        return (lambda: sess.run_with_iobinding(io)), IOBINDING_PREALLOCATED

    def _note_declared(self, reference: Sequence[Any]) -> bool:
        """Record the outputs ``reference`` shows declared wrongly (each output once); whether there are any."""
        wrong = declared_shape_mismatches(self.session, reference)
        for name, note in wrong.items():
            self.declared.setdefault(name, note)
        return bool(wrong)

    def _ort_outputs_or_run(
        self, bufs: tuple[np.ndarray, ...], feeds: Mapping[str, np.ndarray]
    ) -> tuple[Callable[[], Any], str]:
        """Outputs allocated by ORT on each run; plain ``session.run`` when even that binding fails."""
        try:
            return self._ort_outputs(bufs), IOBINDING_ORT_OUTPUTS
        except Exception as e:
            self.notes.append(f"IO binding failed ({e.__class__.__name__}); timed with session.run")
            sess, names = self.session, self.output_names
            return (lambda: sess.run(names, feeds)), SESSION_RUN

    def _keep(self, io: Any, outs: list[np.ndarray]) -> None:
        """Keep the binding and its output buffers alive as long as the harness."""
        self.__dict__.setdefault("_alive", []).append((io, outs))

    # ------------------------------------------------------------------ loops

    def warmup(self, runs: int) -> None:
        """Run every distinct batch shape ``runs`` times (not timed), after a garbage collection.

        The collection happens here rather than at the start of :meth:`time`
        because it walks the whole heap and leaves the caches cold for the
        first timed batch.
        """
        gc.collect()
        for _ in range(runs):
            for step in self._first_of_shape:
                for dst, src in step.copies:
                    np.copyto(dst, src)
                step.run()

    def time(self, passes: int) -> tuple[np.ndarray, np.ndarray]:
        """Time ``passes`` passes over all batches; returns (full-batch ns, tail-batch ns)."""
        steps = self.steps
        n = len(steps) * passes
        times = np.zeros(n, dtype=np.int64)
        full = np.zeros(n, dtype=bool)
        for i, s in enumerate(steps * passes):
            full[i] = s.size == self.full_size
        order = steps * passes
        copyto = np.copyto
        clock = time.perf_counter_ns
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            i = 0
            start = clock()
            for step in order:
                t0 = clock()
                for dst, src in step.copies:
                    copyto(dst, src)
                step.run()
                times[i] = clock() - t0
                i += 1
            self.last_wall_ns = clock() - start
        finally:
            if was_enabled:
                gc.enable()
        return times[full], times[~full]

    def allocations(self, batches: int) -> dict[str, float]:
        """Python-side allocations per batch of the loop body, measured with tracemalloc.

        Returns ``peak_max``/``peak_mean``: bytes allocated above the level at
        the start of a batch, at the batch's peak (a buffer allocated and freed
        within the batch counts here), after subtracting the same measurement
        of an empty batch; and ``net``: bytes still held per batch afterwards.
        """
        steps = self.steps
        order = [steps[i % len(steps)] for i in range(max(1, batches))]
        empty = [Step((), _nothing, 0)] * len(order)
        floor = float(np.median(_trace(empty)[:-2]))
        peaks = _trace(order)
        start, end = peaks[-2:]
        peaks = np.maximum(peaks[:-2] - floor, 0.0)
        return {
            "peak_max": float(peaks.max()),
            "peak_mean": float(peaks.mean()),
            "net": (end - start) / len(order),
            "batches": float(len(order)),
        }


def _nothing() -> None:
    return None


def _trace(order: Sequence[Step]) -> np.ndarray:
    """Per step: tracemalloc peak above the level at the step's start; then the totals before and after."""
    out = np.zeros(len(order) + 2, dtype=np.float64)
    copyto = np.copyto
    tracemalloc.start()
    try:
        out[-2] = tracemalloc.get_traced_memory()[0]
        for i, step in enumerate(order):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            for dst, src in step.copies:
                copyto(dst, src)
            step.run()
            out[i] = tracemalloc.get_traced_memory()[1] - before
        out[-1] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return out


# ---------------------------------------------------------------------- memory


def memory_bytes() -> dict[str, int]:
    """Current and peak resident set size of this process, in bytes.

    Linux: ``VmRSS``/``VmHWM`` from ``/proc/self/status``; elsewhere the peak
    from ``getrusage`` (kilobytes on Linux, bytes on macOS) and no current value.
    """
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024
    return {"rss": out.get("VmRSS", 0), "peak": out.get("VmHWM", peak)}


# ---------------------------------------------------------------------- entry


def load_batches(path: str, input_names: Sequence[str], count: int) -> list[dict[str, np.ndarray]]:
    """The batches the parent wrote: arrays ``b{i}_{j}`` (batch i, input j) in one .npz."""
    with np.load(path, allow_pickle=False) as z:
        return [
            {name: np.asarray(z[f"b{i}_{j}"], order="C") for j, name in enumerate(input_names)}
            for i in range(count)
        ]


def load_rows(path: str, count: int) -> list[int] | None:
    """The samples of each batch, as the parent counted them on each input's batch axis (None: a file
    written without them)."""
    with np.load(path, allow_pickle=False) as z:
        return [int(n) for n in z["rows"][:count]] if "rows" in z.files else None


def measure(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Time one model as described by ``spec`` (see :func:`qdebug.bench.child_spec`), all passes at once."""
    opened = _Opened(spec)
    full, tail = opened.harness.time(spec["runs"])
    return opened.result([full], [tail], spec)


def serve(spec: Mapping[str, Any], commands: Any, replies: Any) -> dict[str, Any]:
    """Time one model a pass at a time, when the parent says so (``pass``), until ``finish``.

    The parent keeps every variant's process open and hands the passes round
    robin, so a drift of the machine's speed over the run (other tenants,
    clocks) falls on every variant alike instead of on whichever ran last;
    processes that are not timing wait on their input and take no CPU.
    """
    opened = _Opened(spec)
    print("ready", file=replies, flush=True)
    fulls, tails = [], []
    for line in iter(commands.readline, ""):  # one line at a time: no read-ahead on a pipe
        if line.strip() != "pass":
            break
        opened.starts.append(time.monotonic_ns())  # system-wide clock: passes of processes can be ordered
        full, tail = opened.harness.time(1)
        fulls.append(full)
        tails.append(tail)
        print("done", file=replies, flush=True)
    return opened.result(fulls, tails, spec)


class _Opened:
    """A variant's session, buffers and warmed-up loop, with the memory seen while opening them."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        batches = load_batches(spec["inputs"], spec["input_names"], spec["batches"])
        self.before_session = memory_bytes()["rss"]
        self.session = make_session(spec["model"], spec["providers"], spec["threads"])
        self.after_session = memory_bytes()["rss"]
        self.harness = Harness(self.session, batches, rows=load_rows(spec["inputs"], spec["batches"]))
        self.harness.warmup(spec["warmup"])
        self.starts: list[int] = []
        """``time.monotonic_ns()`` at the start of each pass served (:func:`serve`)."""

    def result(
        self, fulls: list[np.ndarray], tails: list[np.ndarray], spec: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The result JSON: timings of every pass, allocations, memory."""
        import onnxruntime as ort

        harness = self.harness
        allocs = harness.allocations(spec["alloc_batches"])
        mem = memory_bytes()
        empty = np.zeros(0, dtype=np.int64)
        return {
            "ok": True,
            "full_ns": np.concatenate([empty, *fulls]).tolist(),
            "tail_ns": np.concatenate([empty, *tails]).tolist(),
            "full_size": harness.full_size,
            "tail_sizes": sorted({s.size for s in harness.steps if s.size != harness.full_size}),
            "mode": harness.mode,
            "shapes": harness.shapes,
            "notes": harness.notes,
            "declared_shapes": list(harness.declared.values()),
            "peak_rss": mem["peak"],
            "rss_before_session": self.before_session,
            "rss_after_session": self.after_session,
            "alloc_peak_max": allocs["peak_max"],
            "alloc_peak_mean": allocs["peak_mean"],
            "alloc_net": allocs["net"],
            "alloc_batches": allocs["batches"],
            "providers": list(self.session.get_providers()),
            "ort_version": ort.__version__,
            "pass_starts_ns": self.starts,
        }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qdebug.runtime.bench_child SPEC.json [--serve]``: write the result JSON named in the spec.

    With ``--serve`` the passes are timed one at a time on the parent's ``pass``
    lines (stdin), each answered ``done`` (stdout); see :func:`serve`.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    serving = "--serve" in args
    args = [a for a in args if a != "--serve"]
    if len(args) != 1:
        print("usage: python -m qdebug.runtime.bench_child SPEC.json [--serve]", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        spec = json.load(f)
    try:
        result = serve(spec, sys.stdin, sys.stdout) if serving else measure(spec)
    except Exception as e:  # reported to the parent, which names the variant
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result = {"ok": False, "error": f"{e.__class__.__name__}: {first[:300]}"}
    tmp = spec["result"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["result"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
