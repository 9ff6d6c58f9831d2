"""Quick, fair latency of a few models on one batch: what verify's table and propose's frontier report.

Every model gets one session made with the same settings, the same bound inputs, the same warm-up and
timed runs interleaved in rounds, so that a change of CPU frequency or background load hits them alike.
(``bench`` measures more carefully, in separate processes: see :mod:`qdebug.bench`.)

The sessions keep ORT's default of intra-op threads that spin after a run, as a deployment runs them:
``benchmarks/bench_timing_load.py`` found that threads that do not spin hold the FP32/INT8 ratio steadier
under load (spread 1.12-1.24 against 1.34-2.58 over five repeats, one busy process beside them) but halve
the INT8 speed-up an idle machine shows (1.5-1.6x against 2.7-3.3x on the same pair): a bias worse than the
noise. Under load the verdicts say when the timings are too noisy to judge instead.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from qdebug.data import feed_rows
from qdebug.errors import ExitCode, QDebugError
from qdebug.records.verify import Timing
from qdebug.runtime.bench_child import declared_shape_mismatches
from qdebug.runtime.capture import SessionConfig, make_session

CHUNK_RUNS = 10
"""Timed runs per model per round of :func:`time_sessions`."""


def time_sessions(
    models: Mapping[str, onnx.ModelProto],
    feeds: Mapping[str, np.ndarray],
    config: SessionConfig,
    *,
    runs: int = 50,
    warmup: int = 5,
    cancelled: Callable[[], bool] | None = None,
    notes: list[str] | None = None,
    rows: int | None = None,
    round_seconds: float | None = None,
) -> dict[str, Timing]:
    """Latency of each model on the same batch, measured fairly.

    One session per model, created once with the same ``config`` (provider,
    threads, full graph optimization); inputs bound once through IOBinding and
    reused by every run; ``warmup`` untimed runs each; then the timed runs in
    rounds of :data:`CHUNK_RUNS` per model in turn, so that CPU frequency or
    background load changes affect all models alike while each model's thread
    pool runs undisturbed by the others' spinning workers within a round.

    Outputs: ORT allocates them on the first run and the binding reuses them.
    A model whose declared output shape disagrees with what ORT returns cannot
    reuse them (ORT checks a bound output against the declaration: "Invalid
    rank for output ... Got: 3 Expected: 2" had ended verify with a
    traceback), so a real first run of each model is compared with its
    declaration; on a mismatch every model's outputs are bound afresh before
    each run (all alike, so the comparison stays fair) and ``notes`` gets one
    line per wrong output, naming it with the declared and the returned shape.

    ``round_seconds``: a model whose warm-up runs show a round of :data:`CHUNK_RUNS` would take longer is run
    fewer times per round (at least :data:`MIN_ROUND_RUNS`), its warm-up cut short too, so every round still
    holds every model once: propose's frontier times 9 to 11 models, and at 0.25-1.2 s a run on a 320x320
    detector that had been 100 s of a 340 s propose. None: every model runs :data:`CHUNK_RUNS` per round.
    """
    sessions = {name: make_session(model, config, what=f"{name} model") for name, model in models.items()}
    inputs = {k: np.asarray(v, order="C") for k, v in feeds.items()}
    wrong = _declared_shape_notes(sessions, inputs)
    bound = _bound_runs(sessions, inputs, fresh_outputs=bool(wrong))
    if bound is None:  # ORT refused its own kept outputs for a reason the declaration does not show
        wrong.append(
            "ONNX Runtime refused to reuse a model's outputs from one run to the next: every model's "
            "outputs are allocated by ORT on each timed run"
        )
        bound = _bound_runs(sessions, inputs, fresh_outputs=True) or {}
    if notes is not None:
        notes.extend(wrong)
    per_round = {name: _warm_up(run, warmup, round_seconds) for name, run in bound.items()}
    samples: dict[str, list[float]] = {name: [] for name in bound}
    rounds: dict[str, list[float]] = {name: [] for name in bound}
    done = 0
    while done < runs:
        if cancelled is not None and cancelled():
            break
        chunk = min(CHUNK_RUNS, runs - done)
        for name, run in bound.items():
            n = min(chunk, per_round[name])
            for _ in range(n):
                t0 = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - t0)
            rounds[name].append(1e3 * statistics.median(samples[name][-n:]))
        done += chunk
    batch = rows if rows is not None else feed_rows(feeds)  # rows: the batch's samples, on its batch axes
    provider = config.providers[0] if config.providers else "CPUExecutionProvider"
    out = {}
    for name, xs in samples.items():
        if not xs:
            continue
        xs_sorted = sorted(xs)
        mean = statistics.fmean(xs)
        out[name] = Timing(
            p50_ms=1e3 * _percentile(xs_sorted, 50),
            p95_ms=1e3 * _percentile(xs_sorted, 95),
            mean_ms=1e3 * mean,
            throughput=batch / mean if mean > 0 else math.inf,
            batch=batch,
            runs=len(xs),
            warmup=warmup,
            threads=config.intra_op_threads,
            provider=provider,
            rounds_ms=tuple(rounds[name]),
        )
    return out


MIN_ROUND_RUNS = 2
"""The fewest timed runs a model gets per round under ``round_seconds`` (a median of one run is no median)."""


def _warm_up(run: Callable[[], None], warmup: int, round_seconds: float | None) -> int:
    """Run ``warmup`` untimed runs; return how many runs per round the model gets (:data:`CHUNK_RUNS`, or with
    ``round_seconds`` as many as fit in it by the warm-up's median, at least :data:`MIN_ROUND_RUNS`; a slow
    model's warm-up stops once it has taken a round's time)."""
    if round_seconds is None:
        for _ in range(warmup):
            run()
        return CHUNK_RUNS
    spent: list[float] = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        run()
        spent.append(time.perf_counter() - t0)
        if sum(spent) >= round_seconds:
            break
    if not spent:
        return CHUNK_RUNS
    cost = statistics.median(spent)
    return CHUNK_RUNS if cost <= 0 else max(MIN_ROUND_RUNS, min(CHUNK_RUNS, int(round_seconds / cost)))


def _declared_shape_notes(sessions: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> list[str]:
    """One real (untimed) run of each session: a note per output whose declared shape ORT's array
    contradicts, each output once (every variant keeps the FP32 model's graph outputs)."""
    out: dict[str, str] = {}
    for name, session in sessions.items():
        feeds = {i.name: inputs[i.name] for i in session.get_inputs() if i.name in inputs}
        try:
            returned = session.run(None, feeds)
        except Exception as e:
            raise _run_failure(name, e) from None
        for output, note in declared_shape_mismatches(session, returned).items():
            out.setdefault(output, note)
    return list(out.values())


def _bound_runs(
    sessions: Mapping[str, Any], inputs: Mapping[str, np.ndarray], *, fresh_outputs: bool
) -> dict[str, Callable[[], None]] | None:
    """Each session's timed step over IOBinding, tried twice; None when ORT refuses reused outputs.

    ``fresh_outputs``: the outputs are bound anew before every run, so ORT
    allocates them each time and never checks a kept one against the
    declaration. Otherwise the outputs ORT allocated on the first run are
    reused, as a deployment binding its buffers once would.
    """
    bound = {}
    for name, session in sessions.items():
        io = session.io_binding()
        for i in session.get_inputs():
            if i.name in inputs:  # an optional input the data leaves out: ORT runs without it
                io.bind_cpu_input(i.name, inputs[i.name])
        run = _fresh_run(session, io) if fresh_outputs else _reused_run(session, io)
        try:
            run()
            run()  # the second run is the one that checks the outputs kept from the first
        except Exception as e:
            if not fresh_outputs:
                return None
            raise _run_failure(name, e) from None
        bound[name] = run
    return bound


def _reused_run(session: Any, io: Any) -> Callable[[], None]:
    """A run whose outputs ORT allocates once and the binding keeps."""
    for o in session.get_outputs():
        io.bind_output(o.name)
    return lambda: session.run_with_iobinding(io)


def _fresh_run(session: Any, io: Any) -> Callable[[], None]:
    """A run that binds its outputs anew first, so that ORT allocates them (of whatever shape) each time."""
    names = [o.name for o in session.get_outputs()]

    def run() -> None:
        io.clear_binding_outputs()
        for n in names:
            io.bind_output(n)
        session.run_with_iobinding(io)

    return run


def _run_failure(name: str, e: Exception) -> QDebugError:
    """The error for a variant ORT cannot run while it is timed (it ran when it was scored)."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else e.__class__.__name__
    return QDebugError(
        f"ONNX Runtime cannot run the {name} model for timing: {first}",
        "pass --runs 0 to skip the timing, and check the model's outputs with onnx.checker",
        ExitCode.MODEL,
    )


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)
