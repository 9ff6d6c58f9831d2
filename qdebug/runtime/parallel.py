"""Candidate evaluations side by side: in this process, in local worker processes, or on a Ray cluster.

propose scores tens of candidate models, verify and bench a few variants, and each evaluation is
independent of the others: one model run over the evaluation set and compared with the FP32 outputs. A
:class:`Pool` scores them ``N`` at a time (``--workers N``, ``--ray auto|ADDRESS``):

- **inline** (``workers=1``): in this process, one after another, exactly as qdebug did before (nothing is
  pickled, the sessions use ``--threads`` as given);
- **processes** (``workers=N``): ``N`` local processes started with ``forkserver`` (``spawn`` off Linux),
  never ``fork`` -- ONNX Runtime is not fork-safe once a session exists. Each runs its sessions with
  ``max(1, cores // N)`` intra-op threads (``--threads`` sets them instead), so ``N`` sessions do not
  oversubscribe the cores the process may use (:func:`usable_cores`);
- **Ray** (``ray="auto"`` or an address): one Ray actor per worker (one CPU and one intra-op thread each),
  on the cluster ``ray.init`` finds (``auto``: ``RAY_ADDRESS`` or a ``ray start`` on this machine, else a
  local instance with ``N`` CPUs that the pool shuts down again) or connects to (``ADDRESS``). Ray's own
  scheduler places the actors; ``import ray`` happens only here, and without the extra installed the flag
  is one line naming ``pip install "qdebug[ray]"`` (exit 2).

The local processes start with the pool (so they come up while the command prepares); the evaluators
follow **once per worker**: pickled once into a temporary file that each process reads before its first task
(on Ray: put in the object store once, fetched by each actor before its first task), and again only when an
evaluator is added. Every task is then one candidate's serialized model (on Ray: put in the object store
once). A task is "score model M on evaluator E" (:class:`Task`), or on one **shard** of E: an evaluation
set of at least ``2 * shard_samples`` samples (:data:`SHARD_SAMPLES`) is cut into up to one shard per
worker (:meth:`~qdebug.evaluation.evaluate.Evaluator.shards`, whole batches), each candidate runs on every shard side
by side, and the pool merges the parts (:meth:`~qdebug.evaluation.evaluate.Evaluator.merge`, exact): a search that is
a chain of decisions still uses every worker. Local processes read a shard from the stores' files (this
machine's); Ray actors get their shard's data from the object store (:meth:`Evaluator.portable`, put there
once per evaluator), so actors on other machines need nothing of this one's disk.

Results come back **in the order asked**, whatever finishes first, and an error raised by a worker that is
a :class:`~qdebug.errors.QDebugError` comes back as that same error (message, hint, exit code; a bug keeps
its traceback). ``N`` decides how many of the tasks a caller hands over at once run side by side, never
which tasks there are: the caller's rounds (:meth:`qdebug.propose.search.Search.evaluate_many`,
:meth:`~qdebug.propose.search.Search.prefetch`) are the same for every ``N`` (a larger pool is handed
more guesses ahead, which change nothing that is scored or counted), so the answers are too.

A task may be **speculative** (:meth:`Pool.submit`): a candidate the caller is likely, not sure, to ask
for next. Workers left idle by the demanded tasks run it; a later request for the same model on the same
evaluator takes its result instead of scoring it again (tasks are keyed by the model's sha256), and the
inline pool never runs one unless it is asked for -- so speculation changes the wall time only.

Ctrl-C or SIGTERM while tasks run: :meth:`Pool.close` (the ``with`` block's exit) terminates every
worker process, kills the Ray actors and shuts down a Ray instance the pool started itself; the commands'
output transactions then leave no partial output, as before. Worker processes ignore SIGINT (the terminal
sends it to the whole process group; the main process stops them) and exit when the main process is gone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qdebug.errors import ExitCode, QDebugError

if TYPE_CHECKING:
    import onnx

    from qdebug.evaluation.evaluate import EvalResult, Evaluator

RAY_MISSING = '--ray needs Ray: pip install "qdebug[ray]"'
"""The one-line error of ``--ray`` without the extra (exit code :attr:`~qdebug.errors.ExitCode.USAGE`)."""

KEEP_RESULTS = 256
"""Finished tasks a pool remembers by model hash (their results are per-sample numbers, not outputs)."""

SHARD_SAMPLES = 256
"""Samples a shard holds at least: a set is cut into ``min(workers, samples // SHARD_SAMPLES)`` shards (a
smaller one is scored whole: a session's start and a candidate's first batch cost more than its half)."""


DEFAULT_WORKERS = 1
"""Workers when ``--workers`` is not given: one, in this process. Not the usable cores: one candidate's
session already uses every core through ORT's intra-op threads, and on the 2-core benchmark machine two
single-threaded workers ran propose at 0.80-0.87x of one two-threaded process (docs/benchmarks.md,
"Evaluations in parallel"); ``--workers N`` is for machines and models where a candidate leaves cores idle,
and ``--ray`` for clusters."""


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: ``taskset``, a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def worker_threads(workers: int, threads: int = 0) -> int:
    """Intra-op threads of each worker's sessions: ``threads`` when given, else ``max(1, cores // workers)``."""
    return threads if threads > 0 else max(1, usable_cores() // max(1, workers))


def check_workers(workers: int | None, ray: str | None) -> None:
    """Refuse ``--workers 0`` (or below) and an empty ``--ray`` before any work starts."""
    if workers is not None and workers < 1:
        raise QDebugError(f"--workers must be >= 1 (got {workers})", "pass 1 to score in this process", ExitCode.USAGE)
    if ray is not None and not ray.strip():
        raise QDebugError("--ray needs auto or a cluster address", "e.g. --ray auto", ExitCode.USAGE)


def check_request(runtime: Any) -> None:
    """Refuse what a command's runtime settings ask for and cannot get (``--workers 0``, ``--ray`` without Ray
    installed) before any long work starts."""
    workers, ray = getattr(runtime, "workers", None), getattr(runtime, "ray", None)
    check_workers(workers, ray)
    if ray is not None:
        _import_ray()


@dataclass(frozen=True)
class Task:
    """One evaluation: score a model on one of the pool's evaluators."""

    evaluator: int
    """Index into the pool's evaluators (each shipped once per worker)."""
    model: bytes
    """The candidate, serialized (``onnx.ModelProto.SerializeToString``)."""
    what: str = "quantized model"
    """How an error names the model (``candidate quantized model``)."""
    shard: tuple[int, int] | None = None
    """(i, k): score part ``i`` of the evaluator's ``shards(k)`` (None: the whole set)."""
    numbers_only: bool = False
    """Send back only the numbers (metric, value, output errors, samples, seconds), not what a result keeps
    for a bootstrap (a custom metric's view of the outputs can be the size of the outputs): what a search
    reads of its candidates."""


@dataclass(eq=False)
class Ticket:
    """A submitted task and, once it has run, its outcome (a result or the QDebugError it raised)."""

    task: Task | None
    speculative: bool
    key: str = ""
    """sha256 of (evaluator, model): equal requests share one ticket."""
    state: str = "queued"
    """``queued``, ``running``, ``done`` or ``dropped`` (a speculative task no longer wanted, never run)."""
    outcome: EvalResult | QDebugError | None = None
    proto: Any = field(default=None, repr=False)
    """Inline pool: the model itself (nothing is serialized there)."""
    evaluator: Any = field(default=None, repr=False)
    parts: list[Ticket] | None = field(default=None, repr=False)
    """A sharded evaluation: one ticket per shard (this one runs nothing itself; its outcome is their merge)."""
    parent: Ticket | None = field(default=None, repr=False)
    """The sharded evaluation this ticket is a part of."""
    numbers_only: bool = False


class Pool:
    """Scores models on evaluators, ``workers`` at a time, in this process, local processes or on Ray.

    ``evaluators``: the evaluators the pool will be asked to score on (each goes to each worker once; one
    given later, to :meth:`add` or with a task, is loaded by every worker before its next task).
    ``workers``: None for the cores the process may use (on Ray: the cluster's CPUs), 1 for this process.
    ``threads``: intra-op threads of each worker's sessions (0: ``max(1, cores // workers)``; Ray: 1).
    ``notes`` collects what the user should know (a local Ray instance started). Use it as a context
    manager: leaving the block, on an error or Ctrl-C too, stops every worker.
    """

    def __init__(
        self,
        evaluators: Sequence[Evaluator] = (),
        *,
        workers: int | None = None,
        ray: str | None = None,
        threads: int = 0,
        notes: list[str] | None = None,
        shard_samples: int = SHARD_SAMPLES,
    ) -> None:
        check_workers(workers, ray)
        self.evaluators: list[Evaluator] = list(evaluators)
        self.shard_samples = max(1, shard_samples)
        self._splits: dict[int, tuple[int, int]] = {}
        """Per evaluator: (k asked of its ``shards``, parts it gave)."""
        self.ray = ray.strip() if ray else None
        self.threads = threads
        self.notes = notes if notes is not None else []
        if self.ray is not None:
            _import_ray()  # the missing extra is refused now, before any long work
            self.workers = workers or 0  # 0: the cluster's CPUs, read once connected
        else:
            self.workers = workers if workers is not None else DEFAULT_WORKERS
        self._backend: _Backend | None = None
        self._version = 0
        """Of the evaluator list: one added is loaded by every worker before its next task."""
        self._demanded: deque[Ticket] = deque()
        self._speculative: deque[Ticket] = deque()
        self._running: dict[Any, Ticket] = {}
        self._known: OrderedDict[str, Ticket] = OrderedDict()
        self.scored = 0
        """Tasks run to completion (speculative ones included): what the pool cost."""
        if not self.inline and self.ray is None:
            self._start_backend()  # the processes start now, while this process prepares and scores FP32

    @property
    def size(self) -> int:
        """Evaluations that run at the same time (1 inline; on Ray, the actors once started)."""
        if self.inline:
            return 1
        return self._backend.slots if self._backend is not None else max(1, self.workers)

    @property
    def inline(self) -> bool:
        """Everything runs in this process, one evaluation at a time (``--workers 1``)."""
        return self.ray is None and self.workers <= 1

    # ------------------------------------------------------------------ submitting and collecting

    def submit(
        self,
        evaluator: Evaluator,
        model: onnx.ModelProto | None,
        what: str = "quantized model",
        *,
        speculative: bool = False,
        data: bytes | None = None,
        numbers_only: bool = False,
    ) -> Ticket:
        """Hand over one evaluation; a request equal to an earlier one (same evaluator, same model bytes) gets
        that one's ticket. ``speculative``: run it only on a worker the demanded tasks leave idle (inline:
        only when :meth:`outcome` asks for it). ``data``: the model already serialized. ``numbers_only``: see
        :attr:`Task.numbers_only` (inline, the whole result: nothing is sent)."""
        index = self._index(evaluator)
        if self.inline:
            return Ticket(Task(index, b"", what), speculative, proto=model, evaluator=evaluator)
        if data is None:
            assert model is not None
            data = _serialized(model)
        key = hashlib.sha256(f"{index}:{int(numbers_only)}:".encode() + data).hexdigest()
        known = self._known.get(key)
        if known is not None and known.state != "dropped":
            if not speculative and known.speculative:
                self._promote(known)
            return known
        k, count = self._split(index)
        queue = self._speculative if speculative else self._demanded
        if k == 0:
            ticket = Ticket(Task(index, data, what, numbers_only=numbers_only), speculative, key)
            queue.append(ticket)
        else:  # one task per shard, merged when asked for
            ticket = Ticket(None, speculative, key, evaluator=evaluator, numbers_only=numbers_only)
            ticket.parts = [
                Ticket(Task(index, data, what, shard=(i, k)), speculative, f"{key}:{i}/{k}", parent=ticket)
                for i in range(count)
            ]
            queue.extend(ticket.parts)
        self._remember(ticket)
        self._pump()
        return ticket

    def _split(self, index: int) -> tuple[int, int]:
        """(k, parts) of evaluator ``index``'s shards; k = 0: scored whole. On Ray always (k, parts) >= (1, 1):
        an actor gets its data from the object store, as a part."""
        if index not in self._splits:
            ev = self.evaluators[index]
            k = min(self.size, ev.samples // self.shard_samples)
            parts = len(ev.shards(k)) if k >= 2 else 1
            if parts >= 2:
                self._splits[index] = (k, parts)
            else:
                self._splits[index] = (1, 1) if self.ray is not None else (0, 1)
        return self._splits[index]

    def outcome(self, ticket: Ticket, idle: Callable[[], bool] | None = None) -> EvalResult | QDebugError:
        """The ticket's result, or the QDebugError its evaluation raised (waits for it; runs it if queued).

        ``idle``: work for this process while it waits (one step per call; False once there is none), such
        as building the next candidates (:meth:`qdebug.propose.search.Search.prefetch`)."""
        if ticket.state == "done":
            assert ticket.outcome is not None
            return ticket.outcome
        if ticket.parts is not None:
            return self._merged(ticket, idle)
        if self.inline:
            ticket.outcome = _score_inline(ticket.evaluator, ticket.proto, ticket.task.what if ticket.task else None)
            ticket.state, ticket.proto = "done", None
            self.scored += 1
            return ticket.outcome
        if ticket.state == "dropped":  # asked for after all: queue it again
            ticket.state = "queued"
            self._remember(ticket)
        if ticket.state == "queued":
            self._promote(ticket)
        while ticket.state != "done":
            self._pump()
            if idle is not None and ticket.state != "done":
                if self._collect(block=False):
                    continue
                if idle():
                    continue
                idle = None  # nothing left to do meanwhile: wait
            self._collect()
        assert ticket.outcome is not None
        return ticket.outcome

    def _merged(self, ticket: Ticket, idle: Callable[[], bool] | None) -> EvalResult | QDebugError:
        """A sharded evaluation's outcome: every part run (all queued ahead of other work), then merged; the
        first part's error (in shard order) if any failed."""
        assert ticket.parts is not None
        if ticket.state == "dropped":
            ticket.state = "queued"
            self._remember(ticket)
        for part in ticket.parts:
            if part.state == "dropped":
                part.state = "queued"
        self._promote(ticket)  # every queued part ahead of other work
        outs = [self.outcome(part, idle) for part in ticket.parts]
        errors = [o for o in outs if isinstance(o, QDebugError)]
        merged: EvalResult | QDebugError = errors[0] if errors else ticket.evaluator.merge(outs)
        if ticket.numbers_only and not errors:
            merged = _numbers(merged)  # type: ignore[arg-type]
        ticket.outcome, ticket.state, ticket.parts = merged, "done", None
        return merged

    def result(self, ticket: Ticket, idle: Callable[[], bool] | None = None) -> EvalResult:
        """The ticket's result; its QDebugError raised here (``idle``: see :meth:`outcome`)."""
        out = self.outcome(ticket, idle)
        if isinstance(out, QDebugError):
            raise out
        return out

    def outcomes(
        self,
        evaluator: Evaluator,
        models: Sequence[onnx.ModelProto],
        what: str = "quantized model",
        numbers_only: bool = False,
    ) -> list[EvalResult | QDebugError]:
        """Score every model (``workers`` at a time); results or errors in the order of ``models``."""
        tickets = [self.submit(evaluator, m, what, numbers_only=numbers_only) for m in models]
        return [self.outcome(t) for t in tickets]

    def map(
        self,
        evaluator: Evaluator,
        models: Sequence[onnx.ModelProto],
        what: str = "quantized model",
        numbers_only: bool = False,
    ) -> list[EvalResult]:
        """Score every model; the results in the order of ``models``. Once all have run, the error of the first
        model (in that order) that failed is raised: the same one for any number of workers."""
        out = self.outcomes(evaluator, models, what, numbers_only)
        for o in out:
            if isinstance(o, QDebugError):
                raise o
        return out  # type: ignore[return-value]

    def score(
        self,
        evaluator: Evaluator,
        model: onnx.ModelProto,
        what: str = "quantized model",
        data: bytes | None = None,
        numbers_only: bool = False,
    ) -> EvalResult:
        """One evaluation through the pool (as ``evaluator.score``)."""
        return self.result(self.submit(evaluator, model, what, data=data, numbers_only=numbers_only))

    def add(self, *evaluators: Evaluator) -> None:
        """Register evaluators before the first task, so each worker gets them all at its start."""
        for ev in evaluators:
            self._index(ev)

    def drop_speculative(self) -> None:
        """Forget speculative tasks not started yet (a new round makes them unlikely to be asked for)."""
        while self._speculative:
            t = self._speculative.popleft()
            t.state = "dropped"
            self._known.pop(t.key, None)
            if t.parent is not None and t.parent.state == "queued":
                t.parent.state = "dropped"
                self._known.pop(t.parent.key, None)

    # ------------------------------------------------------------------ lifetime

    def close(self, abort: bool = False) -> None:
        """Stop the workers (``abort``: at once, without waiting for running tasks)."""
        backend, self._backend = self._backend, None
        self._demanded.clear()
        self._speculative.clear()
        self._running.clear()
        if backend is not None:
            backend.close(abort)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(abort=exc_type is not None)

    # ------------------------------------------------------------------ internals

    def _index(self, evaluator: Evaluator) -> int:
        for i, e in enumerate(self.evaluators):
            if e is evaluator:
                return i
        self.evaluators.append(evaluator)
        self._version += 1  # the workers load the new list before their next task
        return len(self.evaluators) - 1

    def _remember(self, ticket: Ticket) -> None:
        self._known[ticket.key] = ticket
        self._known.move_to_end(ticket.key)
        while len(self._known) > KEEP_RESULTS:
            key, old = next(iter(self._known.items()))
            if old.state in ("queued", "running"):
                break
            del self._known[key]

    def _promote(self, ticket: Ticket) -> None:
        """A queued ticket asked for: it goes ahead of every other queued one (a sharded one: its parts)."""
        ticket.speculative = False
        if ticket.parts is not None:
            for part in reversed(ticket.parts):  # promoted last-first: they run first-first
                if part.state == "queued":
                    self._promote(part)
            return
        if ticket in self._speculative:
            self._speculative.remove(ticket)
        if ticket in self._demanded:
            self._demanded.remove(ticket)
        if ticket.state == "queued":
            self._demanded.appendleft(ticket)

    def _pump(self) -> None:
        """Start queued tasks on idle workers, demanded ones first."""
        while self._demanded or self._speculative:
            backend = self._backend or self._start_backend()
            if len(self._running) >= backend.slots:
                return
            if backend.version != self._version:  # the evaluators, pickled once for every worker
                backend.ship(pickle.dumps(self.evaluators, protocol=pickle.HIGHEST_PROTOCOL), self._version)
            ticket = (self._demanded or self._speculative).popleft()
            assert ticket.task is not None
            backend.prepare(self.evaluators, ticket.task)
            handle = backend.start(ticket.task)
            ticket.state = "running"
            self._running[handle] = ticket

    def _collect(self, block: bool = True) -> bool:
        """Record the outcome of running tasks that finished (``block``: wait for at least one); whether any did."""
        assert self._backend is not None and self._running
        done = self._backend.wait(list(self._running), None if block else 0.0)
        for handle, outcome in done:
            ticket = self._running.pop(handle)
            ticket.outcome, ticket.state, ticket.task = outcome, "done", None
            self.scored += 1
        return bool(done)

    def _start_backend(self) -> _Backend:
        """Start the workers (they need no evaluator to start: each loads the pool's list before its first task)."""
        if self.ray is not None:
            self._backend = _RayBackend(self.workers, self.threads, self.ray, self.notes)
        else:
            self._backend = _ProcessBackend(self.workers, worker_threads(self.workers, self.threads))
        return self._backend


def open_pool(runtime: Any, evaluators: Sequence[Evaluator] = (), notes: list[str] | None = None) -> Pool:
    """The pool a command's :class:`~qdebug.prepare.RuntimeSettings` ask for (``workers``, ``ray``, ``threads``)."""
    return Pool(
        evaluators,
        workers=getattr(runtime, "workers", None),
        ray=getattr(runtime, "ray", None),
        threads=getattr(runtime, "threads", 0) or 0,
        notes=notes,
    )


def score_all(
    pool: Pool | None,
    evaluator: Any,
    models: Sequence[onnx.ModelProto],
    what: str | None = None,
    numbers_only: bool = False,
) -> list[EvalResult]:
    """``evaluator.score`` of every model, through ``pool`` when there is one (else one after another here);
    ``numbers_only``: see :attr:`Task.numbers_only`."""
    if pool is None:
        return [evaluator.score(m, what=what) if what else evaluator.score(m) for m in models]
    return pool.map(evaluator, models, what or "quantized model", numbers_only)


def _score_inline(evaluator: Any, model: Any, what: str | None) -> Any:
    """``evaluator.score`` in this process, with a QDebugError returned rather than raised."""
    try:
        return evaluator.score(model, what=what) if what else evaluator.score(model)
    except QDebugError as e:
        return e


def _serialized(model: onnx.ModelProto) -> bytes:
    """The model's bytes for a worker; one over protobuf's 2 GB limit cannot travel that way."""
    from qdebug.graph.load import is_large

    if is_large(model):
        raise QDebugError(
            "the model is over protobuf's 2 GB limit and cannot be sent to a worker process",
            "run with --workers 1 (the evaluations then run in this process)",
            ExitCode.MODEL,
        )
    return model.SerializeToString()


# ---------------------------------------------------------------------- backends


class _Backend:
    """Where tasks run: ``slots`` at a time, on workers that load the evaluators (:meth:`ship`) once."""

    slots: int
    version: int = -1
    """Of the evaluator list the workers are handed (-1: none yet)."""

    def ship(self, payload: bytes, version: int) -> None:  # pragma: no cover - interface
        """Make the pickled evaluator list ``payload`` the one tasks started from now on score with."""
        raise NotImplementedError

    def prepare(self, evaluators: list[Evaluator], task: Task) -> None:
        """Before ``task`` starts: what its worker needs that the evaluator list does not give (nothing here)."""

    def start(self, task: Task) -> Any:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self, handles: list[Any], timeout: float | None) -> list[tuple[Any, Any]]:  # pragma: no cover
        """The tasks of ``handles`` that finished, with their outcomes: at least one unless ``timeout`` passed."""
        raise NotImplementedError

    def close(self, abort: bool) -> None:  # pragma: no cover - interface
        raise NotImplementedError


_WORKER: dict[str, Any] = {}
"""A local worker's state: its threads, and the evaluators of the last version it loaded."""


def _load_evaluators(payload: bytes, threads: int) -> list[Evaluator]:
    """The pool's evaluators unpickled in a worker, their sessions given ``threads`` intra-op threads."""
    evaluators = pickle.loads(payload)
    for ev in evaluators:
        ev.config = dataclasses.replace(ev.config, intra_op_threads=threads)
    return evaluators


def _init_worker(threads: int, parent: int) -> None:
    """A local worker's start: ignore Ctrl-C (the main process stops the workers) and exit with the main
    process; the evaluators come with the first task (:func:`_run_task`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.name == "posix":  # (os.kill(pid, 0) probes a process there; on Windows it would end it)
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _WORKER["threads"] = threads


def _exit_with_parent(parent: int) -> None:
    """Exit when the main process is gone (killed with SIGKILL: no clean-up ran to stop this worker)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # a new process under that pid, not ours to signal: ours is gone
            os._exit(1)


def _ready() -> int:
    """A no-op task: one per worker when the pool starts, so that every process starts at once."""
    return os.getpid()


def _run_task(task: Task, payload: tuple[str, int]) -> EvalResult | QDebugError:
    """Score one task in a local worker: its result, or the QDebugError it raised (a bug raises, with its
    traceback). ``payload``: (file, version) of the evaluators, read once per worker and version."""
    path, version = payload
    if _WORKER.get("version") != version:
        with open(path, "rb") as f:
            _WORKER["evaluators"] = _load_evaluators(f.read(), _WORKER.get("threads", 1))
        _WORKER["version"] = version
        _SHARDS.clear()  # cut from the evaluators just let go: a new one may get a freed one's id
    return _score_task(_WORKER["evaluators"], task)


def _score_task(evaluators: list[Evaluator], task: Task) -> EvalResult | QDebugError:
    import onnx

    model = onnx.load_model_from_string(task.model)
    evaluator = evaluators[task.evaluator]
    if task.shard is not None:
        evaluator = _shard_of(evaluator, *task.shard)
    try:
        r = evaluator.score(model, what=task.what)
    except QDebugError as e:
        return e
    return _numbers(r) if task.numbers_only else r


def _numbers(r: EvalResult) -> EvalResult:
    """``r`` without what only a bootstrap or a merge reads (:attr:`Task.numbers_only`)."""
    from qdebug.evaluation.evaluate import EvalResult

    return EvalResult(r.metric, r.value, r.fp32_value, r.outputs, r.samples, r.seconds)


_SHARDS: dict[tuple[int, int], tuple[Evaluator, list[Evaluator]]] = {}
"""A local worker's shards, per (evaluator id, k), with the evaluator they were cut from (held, so that its id
is not reused while the entry lives): cut once per evaluator it loaded, cleared with each new evaluator list."""


def _shard_of(evaluator: Evaluator, i: int, k: int) -> Evaluator:
    key = (id(evaluator), k)
    entry = _SHARDS.get(key)
    if entry is None or entry[0] is not evaluator:
        if len(_SHARDS) > 16:
            _SHARDS.clear()
        entry = _SHARDS[key] = (evaluator, evaluator.shards(k))
    return entry[1][i]


def _context() -> Any:
    """``forkserver`` on Linux (its server preloads qdebug's evaluation modules, so a worker starts in a
    fraction of a second), ``spawn`` elsewhere; never ``fork`` once ORT sessions exist."""
    import multiprocessing

    if sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods():
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["qdebug.runtime.parallel", "qdebug.evaluation.evaluate", "onnxruntime"])
        # the server preloads with its own sys.path (Python < 3.12 ignores the one it is handed): given
        # this process's, it imports this qdebug, not another one installed in site-packages
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        return ctx
    return multiprocessing.get_context("spawn")


class _ProcessBackend(_Backend):
    """``workers`` local processes (a ``ProcessPoolExecutor``), all started at once; the evaluators reach
    them through a file written once and read once by each (not pickled into every process's start)."""

    def __init__(self, workers: int, threads: int) -> None:
        from concurrent.futures import ProcessPoolExecutor

        self.slots = workers
        self.executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=_context(), initializer=_init_worker, initargs=(threads, os.getpid())
        )
        # a submit that finds no idle worker starts a process: all start now, from a thread of their own (the
        # first start waits for the fork server's imports; this process goes on preparing meanwhile)
        self.starter = threading.Thread(target=self._start_all, args=(workers,), daemon=True)
        self.starter.start()
        self.files: list[str] = []
        self.payload: tuple[str, int] | None = None

    def _start_all(self, workers: int) -> None:
        try:
            for _ in range(workers):
                self.executor.submit(_ready)
        except RuntimeError:  # shut down already (an early error or Ctrl-C): nothing left to start
            pass

    def ship(self, payload: bytes, version: int) -> None:
        import tempfile

        fd, path = tempfile.mkstemp(prefix="qdebug-evaluators-", suffix=".pickle")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        self.files.append(path)
        self.payload, self.version = (path, version), version

    def start(self, task: Task) -> Any:
        return self.executor.submit(_run_task, task, self.payload)

    def wait(self, handles: list[Any], timeout: float | None) -> list[tuple[Any, Any]]:
        from concurrent.futures import FIRST_COMPLETED
        from concurrent.futures import wait as wait_futures
        from concurrent.futures.process import BrokenProcessPool

        done, _ = wait_futures(handles, timeout=timeout, return_when=FIRST_COMPLETED)
        out = []
        for future in done:
            try:
                out.append((future, future.result()))
            except BrokenProcessPool:
                raise QDebugError(
                    "a --workers process died while scoring a model (killed, or out of memory)",
                    "run with fewer --workers (each holds the evaluation set), or --workers 1",
                    ExitCode.INTERNAL,
                ) from None
        return out

    def close(self, abort: bool) -> None:
        try:
            self.starter.join()
            if abort:
                _terminate(self.executor)
            self.executor.shutdown(wait=True, cancel_futures=True)
        finally:
            for path in self.files:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _terminate(executor: Any) -> None:
    """Stop every worker process of ``executor`` now (Python 3.14 has ``terminate_workers``)."""
    stop = getattr(executor, "terminate_workers", None)
    if stop is not None:
        stop()
        return
    for proc in list((getattr(executor, "_processes", None) or {}).values()):
        if proc.is_alive():
            proc.terminate()
    for proc in list((getattr(executor, "_processes", None) or {}).values()):
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()


# ---------------------------------------------------------------------- Ray


def _import_ray() -> Any:
    """``ray``, or the one-line error naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise QDebugError(
            RAY_MISSING, "or leave --ray out to score in local processes (--workers)", ExitCode.USAGE
        ) from None
    return ray


class _RayScorer:
    """A Ray actor's body: the evaluators of the last version it was handed (loaded from the object store once
    per version), then one task per call."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.key = ""
        self.evaluators: list[Evaluator] = []

    def score(self, task: Task, model: bytes, part: list, key: str) -> EvalResult | QDebugError:
        """Score ``model`` on the evaluator part ``part[0]`` references (its data inside: fetched from the object
        store only when it is another part than the last one, ``key``)."""
        if key != self.key:  # ``part`` holds the reference: Ray resolves it only here, once per part
            import ray

            self.evaluators, self.key = _load_evaluators(ray.get(part[0]), self.threads), key
        return _score_task(self.evaluators, dataclasses.replace(task, model=model, evaluator=0, shard=None))


def _connect(ray: Any, address: str, cpus: int) -> tuple[bool, str]:
    """Attach to the cluster ``address`` names; for ``auto`` without one, start a local instance of ``cpus``
    CPUs. (whether this call started it, a note). The workers import this qdebug (``py_modules``)."""
    import logging

    import qdebug

    env = {"py_modules": [os.path.dirname(os.path.abspath(qdebug.__file__))]}
    common = dict(runtime_env=env, logging_level=logging.WARNING, log_to_driver=False)
    on_main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if on_main else None
    try:
        try:
            ray.init(address=address, **common)
            return False, ""
        except ConnectionError as e:
            if address != "auto":
                raise QDebugError(
                    f"cannot connect to the Ray cluster at {address}: {str(e).splitlines()[0][:200]}",
                    "check the address (ray status on the head node), or pass --ray auto",
                    ExitCode.USAGE,
                ) from None
        ray.init(num_cpus=cpus, include_dashboard=False, **common)
        note = (
            f"--ray auto found no Ray cluster (RAY_ADDRESS, ray start): started a local Ray instance with {cpus} "
            "CPU(s) for this run"
        )
        return True, note
    finally:
        if on_main and handler is not None:  # ray.init installs its own SIGTERM handler: ours cleans up
            signal.signal(signal.SIGTERM, handler)


class _RayBackend(_Backend):
    """One Ray actor per worker (started with the pool); the evaluators go to the object store once per
    version, and each model once."""

    def __init__(self, workers: int, threads: int, address: str, notes: list[str]) -> None:
        ray = _import_ray()
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            self.started, note = _connect(ray, address, workers or usable_cores())
            if note:
                notes.append(note)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = max(1, workers or cpus)
        actor = ray.remote(num_cpus=1, max_restarts=0)(_RayScorer)
        self.actors = [actor.remote(threads or 1) for _ in range(self.slots)]
        self.idle = list(self.actors)
        self.busy: dict[Any, Any] = {}
        self.parts: dict[tuple[int, int], list[Any]] = {}
        self.models: dict[bytes, Any] = {}

    def ship(self, payload: bytes, version: int) -> None:
        self.version = version  # the actors get parts (:meth:`prepare`), with their data, not the list

    def prepare(self, evaluators: list[Evaluator], task: Task) -> None:
        """Put the parts of the task's evaluator in the object store, once: each a shard with its data
        (:meth:`~qdebug.evaluation.evaluate.Evaluator.portable`), pickled and put one at a time."""
        assert task.shard is not None
        k = task.shard[1]
        if (task.evaluator, k) not in self.parts:
            ev = evaluators[task.evaluator]
            shards = ev.shards(k) if k > 1 else [ev]
            self.parts[(task.evaluator, k)] = [
                self.ray.put(pickle.dumps([s.portable()], protocol=pickle.HIGHEST_PROTOCOL)) for s in shards
            ]

    def start(self, task: Task) -> Any:
        assert task.shard is not None
        i, k = task.shard
        actor = self.idle.pop()
        model = self.models.get(task.model)
        if model is None:  # each candidate once in the object store, whatever its number of parts
            self.models = {task.model: self.ray.put(task.model)}
            model = self.models[task.model]
        part = [self.parts[(task.evaluator, k)][i]]
        ref = actor.score.remote(dataclasses.replace(task, model=b""), model, part, f"{task.evaluator}:{i}/{k}")
        self.busy[ref] = actor
        return ref

    def wait(self, handles: list[Any], timeout: float | None) -> list[tuple[Any, Any]]:
        ray = self.ray
        done, _ = ray.wait(handles, num_returns=1, timeout=timeout)
        out = []
        for ref in done:
            self.idle.append(self.busy.pop(ref))
            try:
                out.append((ref, ray.get(ref)))
            except ray.exceptions.RayActorError as e:
                raise QDebugError(
                    f"a Ray worker died while scoring a model: {str(e).splitlines()[0][:200]}",
                    "check the cluster's memory (each actor holds the evaluation set), or use fewer --workers",
                    ExitCode.INTERNAL,
                ) from None
        return out

    def close(self, abort: bool) -> None:
        ray = self.ray
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001  (a dead actor or a lost connection: nothing left to stop)
                pass
        self.actors, self.idle, self.busy = [], [], {}
        if self.started:
            ray.shutdown()
