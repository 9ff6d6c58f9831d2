"""Latency in the search: each candidate's time per run estimated from the report's profile, before it is timed.

The per-node search finds the *smallest* set of nodes to keep FP32 that meets the target. The smallest is not
always the fastest: a node kept FP32 between two quantized ones adds a Q/DQ pair on each side, and keeping its
neighbours FP32 too can remove more Q/DQ time than their integer kernels saved. With a report made by
``analyze --profile`` (ORT's profiler, :mod:`qdebug.runtime.profile`), every node's FP32 and INT8 time per run
is known, and the search knows each candidate's Q/DQ pairs (``Trial.qdq_pairs``): :class:`LatencyModel`
estimates each candidate from those, and :func:`cheapest` offers the met candidate estimated clearly faster
than the smallest one as the answer. The estimate only chooses; the answer is timed for real in the frontier
with its neighbours, whose verdicts name a faster point that meets the target if the estimate was wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from qdebug.evaluation.gates import SPEED_MARGIN
from qdebug.propose.search import Search, Trial
from qdebug.records.profile import ProfileReport


@dataclass(frozen=True)
class LatencyModel:
    """Each profiled node's FP32 and INT8 kernel time per run, and the time of one Q/DQ pair."""

    fp32_ms: Mapping[str, float]
    int8_ms: Mapping[str, float]
    """The node's INT8 kernel (or its float kernel in the INT8 model), its Q/DQ kernels apart."""
    pair_ms: float
    """The profiled static model's Q/DQ time per run over its Q/DQ pairs: what one more or one fewer costs."""

    @classmethod
    def of(cls, profile: ProfileReport | None, static: Trial, graph: Iterable[str] = ()) -> LatencyModel | None:
        """The model of a report's profile, calibrated on full static INT8's Q/DQ pairs (``static``, the search's
        first trial); None without a profile of both models, without Q/DQ pairs to share the time over, or when
        the profiled FP32 model has nodes the search's ``graph`` (its node names) lacks: a recipe's transform
        (folded BatchNormalization) made another graph than the one profiled."""
        if profile is None or profile.int8 is None or static.qdq_pairs <= 0 or not profile.nodes:
            return None
        names = set(graph)
        if names and any(n.fp32_kernel != "-" and n.name not in names for n in profile.nodes):
            return None
        qdq = sum(n.qdq_ms for n in profile.nodes)
        return cls(
            fp32_ms={n.name: n.fp32_ms for n in profile.nodes},
            int8_ms={n.name: n.int8_ms for n in profile.nodes},
            pair_ms=qdq / static.qdq_pairs,
        )

    @property
    def fp32_total(self) -> float:
        """The FP32 model's kernel time per run."""
        return sum(self.fp32_ms.values())

    def estimate(self, fp32_nodes: Iterable[str], qdq_pairs: int) -> float | None:
        """Time per run of the INT8 model with ``fp32_nodes`` kept float and ``qdq_pairs`` Q/DQ pairs: every
        node's INT8 kernel, the kept ones' FP32 kernels instead, and the pairs. None when a kept node was not
        profiled (another model's node: a recipe's transform renamed or added it)."""
        kept = set(fp32_nodes)
        if not kept <= self.fp32_ms.keys():
            return None
        kernels = sum(self.fp32_ms[n] if n in kept else ms for n, ms in self.int8_ms.items())
        return kernels + qdq_pairs * self.pair_ms

    def of_trial(self, trial: Trial) -> float | None:
        """:meth:`estimate` of a scored candidate (None for one with 16-bit overrides, which run as float
        kernels the profile did not time)."""
        return None if trial.overrides else self.estimate(trial.nodes, trial.qdq_pairs)


def cheapest(search: Search, latency: LatencyModel, answer: Trial) -> tuple[Trial, float, float] | None:
    """The met candidate that fits ``--max-nodes`` and is estimated at least :data:`SPEED_MARGIN` faster than
    ``answer`` (the fewest nodes among equal estimates), with both estimates; None when the answer is the
    cheapest, or cannot be estimated."""
    mine = latency.of_trial(answer)
    if mine is None:
        return None
    scored = [
        (est, t)
        for t in [*search.trials, *search.equivalents]
        if t.met and search.fits(t) and t.per_channel == answer.per_channel and t is not answer
        for est in [latency.of_trial(t)]
        if est is not None
    ]
    if not scored:
        return None
    est, best = min(scored, key=lambda pair: (pair[0], len(pair[1].nodes)))
    if est >= (1 - SPEED_MARGIN) * mine:
        return None
    return best, est, mine


def chosen_note(latency: LatencyModel, smallest: Trial, chosen: Trial, est: float, mine: float) -> str:
    """Why the answer is not the smallest set: the estimates, with FP32's, and where both are measured."""
    return (
        f"the answer keeps {len(chosen.nodes)} node(s) FP32 ({chosen.qdq_pairs} Q/DQ pairs) rather than the smallest "
        f"set that meets the target, {len(smallest.nodes)} ({smallest.qdq_pairs} Q/DQ pairs): from the report's "
        f"profile it is estimated at {est:.3g} ms per run against {mine:.3g} (FP32 {latency.fp32_total:.3g}); "
        "the frontier times it for real"
    )
