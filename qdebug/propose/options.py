"""What a ``propose`` run is asked for: :class:`ProposeOptions`, the target they set, and the result's record.

:func:`make_target` turns the flags into the search's :class:`~qdebug.propose.search.Target` (a drop in
points or in the metric's own units, or an output SQNR), :func:`check_allow` checks ``--allow`` against
:data:`ACTIONS`, and :class:`ProposeResult` is what :func:`qdebug.propose.run.propose` returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.formatting import ACCURACY_METRICS
from qdebug.prepare import QuantRequest, RuntimeSettings, flat_settings
from qdebug.propose.blame import Unit
from qdebug.propose.frontier import TIME_RUNS
from qdebug.propose.search import Target, Trial
from qdebug.records import Proposal
from qdebug.vocabulary import ACTIONS, DEFAULT_ALLOW  # re-exported: --allow's vocabulary

RERANK_SAMPLES = 32
"""Calibration samples used by one re-ranking capture."""


@flat_settings()
@dataclass(frozen=True)
class ProposeOptions:
    """Options of :func:`propose` (the flags of ``qdebug propose``).

    ``quant``: a ``--config`` or ``--preset`` to build every variant with instead of the report's settings
    (empty: the report's, which is what the ranking describes); ``runtime``: providers, threads, cache
    (``providers=``, ``threads=``, ``use_cache=`` are still accepted and read as flat names).
    """

    target_drop: float | None = None
    """Allowed drop of the task metric vs FP32: percentage points for the accuracy metrics
    (top1, top1_agreement, exact_match), else the metric's own units (None: 1 point, or 1 % of ``|FP32|``
    for a metric of other units)."""
    target_sqnr: float | None = None
    """Instead: worst output SQNR (dB) the selective model must reach."""
    max_nodes: int | None = None
    """Most nodes the proposal may keep out of quantization (None: no limit)."""
    allow: tuple[str, ...] = DEFAULT_ALLOW
    recipes: tuple[str, ...] | None = None
    """Whole-model recipes tried first when full static INT8 misses the target (None: every one in
    :mod:`qdebug.vocabulary`; empty: none): :mod:`qdebug.propose.recipes`."""
    metric: str | None = None
    """Task metric (default: the report's, else top1 when the data has labels)."""
    eval_max_samples: int | None = None
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (default: the report's, else read off the model)."""
    """Score candidates on at most this many evaluation samples (faster search, noisier metric)."""
    max_evaluations: int | None = None
    """Evaluation budget (None: ``2*ceil(log2 L) + 10`` for ``L`` candidate nodes)."""
    rerank_samples: int = RERANK_SAMPLES
    screen_samples: int | None = None
    """Screen candidates on the first N evaluation samples, confirm on all (None: 256 when the set holds at
    least 1,024; 0: never)."""
    screen_model: str = "auto"
    """Screen candidates on one switchable fake-quant model (:mod:`qdebug.propose.switch`): ``auto`` on
    graphs of 1,000 nodes or more without a measured integer-kernel gap, ``on``, ``off``."""
    time_runs: int = TIME_RUNS
    """Timed runs per point of the verified frontier (0: no frontier, no speed verdict)."""
    quant: QuantRequest = field(default_factory=QuantRequest)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)


@dataclass(frozen=True)
class ProposeResult:
    """The proposal plus how it was found."""

    proposal: Proposal
    met: bool
    target: Target
    candidates: int
    """``L``: distinct excludable nodes over all ranked candidate units."""
    units: tuple[Unit, ...]
    """The first ranking."""
    trials: tuple[Trial, ...]
    reranks: int
    """Layer captures made to re-rank given what is already excluded (not task-metric evaluations)."""
    max_evaluations: int
    seconds: float
    proposal_path: str | None = None
    notes: tuple[str, ...] = ()
    """What the user should know about how the proposal was made (printed by the CLI)."""
    no_speedup: str = ""
    """Why the answer gives the INT8 speed-up back, when it does: it keeps most of the model FP32, or the
    frontier timed it slower than FP32 while static is faster (the CLI prints it and exits 6 unless
    ``--accept-no-speedup``)."""

    @property
    def evaluations(self) -> int:
        """Task-metric evaluations made (each one variant scored on the evaluation set)."""
        return len(self.trials)


DEFAULT_RELATIVE_DROP = 0.01
"""Default target of a metric that is not a share of samples: 1 % of ``|FP32|`` below FP32."""


def make_target(metric: str, fp32: float, samples: int, options: ProposeOptions) -> Target:
    """The target from the flags (default: a 1-point drop, or 30 dB output SQNR for an SQNR metric)."""
    accuracy = metric in ACCURACY_METRICS
    if options.target_sqnr is not None:
        if not math.isfinite(options.target_sqnr):
            raise QDebugError(
                f"--target-sqnr must be a finite number (got {options.target_sqnr})",
                "pass the required output SQNR in dB",
                ExitCode.USAGE,
            )
        return Target(metric, "sqnr", float(options.target_sqnr), fp32, 0.1)
    if not math.isfinite(fp32):
        if options.target_drop is not None:
            raise QDebugError(
                f"metric {metric} has no finite FP32 value, so --target-drop has nothing to drop from",
                "pass --target-sqnr DB instead",
                ExitCode.USAGE,
            )
        return Target(metric, "sqnr", 30.0, fp32, 0.1)
    drop = 1.0 if options.target_drop is None else float(options.target_drop)
    if not drop >= 0 or not math.isfinite(drop):
        raise QDebugError(
            f"--target-drop must be >= 0 (got {drop})", "pass the allowed drop in points", ExitCode.USAGE
        )
    if accuracy:
        return Target(metric, "drop", fp32 - drop / 100.0, fp32, 1.5 / max(samples, 1))
    if options.target_drop is None:
        # a metric in its own units: one raw unit would accept anything on a metric in [0, 1] (an empty
        # proposal was "MET" while the metric had gone from 1 to 0)
        allowed = DEFAULT_RELATIVE_DROP * abs(fp32)
        basis = f"default: {100 * DEFAULT_RELATIVE_DROP:g} % below FP32; --target-drop sets it in {metric}'s units"
        return Target(metric, "drop", fp32 - allowed, fp32, 1e-9 + 1e-6 * abs(fp32), basis)
    return Target(metric, "drop", fp32 - drop, fp32, 1e-9 + 1e-6 * abs(fp32))


def check_allow(allow: Sequence[str]) -> tuple[str, ...]:
    """The ``--allow`` list without blanks and repeats, refusing an unknown action or an empty list."""
    out = tuple(dict.fromkeys(a.strip() for a in allow if a.strip()))
    bad = [a for a in out if a not in ACTIONS]
    if bad or not out:
        raise QDebugError(
            f"--allow got {', '.join(bad) or 'nothing'}",
            f"use a comma list of {', '.join(ACTIONS)}",
            ExitCode.USAGE,
        )
    if not {"fp32", "int16", "per-channel", "calib-flipped"} & set(out):
        raise QDebugError(
            "--allow needs fp32, int16, per-channel or calib-flipped", "e.g. --allow fp32,int16", ExitCode.USAGE
        )
    if "fp32" not in out and ({"clip", "reduce-range"} & set(out)):
        raise QDebugError(
            "--allow clip and reduce-range refine the nodes an FP32 search finds",
            "add fp32 (e.g. --allow fp32,clip,reduce-range)",
            ExitCode.USAGE,
        )
    return out
