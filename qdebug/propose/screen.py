"""Cheap screening, exact confirmation: score candidates on a part of the evaluation set, report on all of it.

A search scores tens of candidates; on a large evaluation set most of its time is evaluation. Candidates
are therefore screened on the first :data:`SCREEN_SAMPLES` samples (when the set holds at least
:data:`SCREEN_FACTOR` times as many, or as ``--screen-samples`` says), each still a real re-quantized
model run with ORT's kernels; then static, the answer and every frontier point are scored again on
*every* sample, and only those numbers are reported. An answer that met the target on the screen but
misses it on all samples is replaced by the smallest screened answer that meets it on all of them, or
reported as missed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx

from qdebug.data import open_data
from qdebug.evaluation.evaluate import EvalResult, Evaluator
from qdebug.prepare import Prepared
from qdebug.propose.frontier import frontier_neighbours
from qdebug.propose.search import Plan, Search, Target, Trial, plan_of
from qdebug.quant.quantize import QuantSpec
from qdebug.records import AnalysisConfig
from qdebug.runtime.capture import SessionConfig
from qdebug.runtime.parallel import Pool, score_all

SCREEN_SAMPLES = 256
"""Evaluation samples candidates are screened on by default."""
SCREEN_FACTOR = 4
"""Screening engages by default only when the evaluation set holds this many times :data:`SCREEN_SAMPLES`."""
CONFIRM_TRIES = 4
"""Larger screened answers scored on all samples when the answer misses there."""


def screening_evaluator(
    prep: Prepared,
    eval_src: str | Path,
    cfg: AnalysisConfig,
    config: SessionConfig,
    full: Evaluator,
    screen_samples: int | None,
) -> Evaluator | None:
    """An evaluator over the first samples of the evaluation set, or ``None`` when screening does not pay
    (``screen_samples`` 0, or a set too small for it)."""
    n = SCREEN_SAMPLES if screen_samples is None else screen_samples
    if n <= 0 or (screen_samples is None and full.samples < SCREEN_FACTOR * n) or n >= full.samples:
        return None
    data = open_data(
        eval_src,
        prep.calib.specs,
        batch_size=cfg.batch_size,
        max_samples=n,
        what="evaluation data",
        limit_flag="--screen-samples",
    )
    return Evaluator(prep.normalized, data, config, full.metric_name)


def rescored(trial: Trial, result: EvalResult, target: Target) -> Trial:
    """``trial`` with the numbers of a score on all samples."""
    return dataclasses.replace(
        trial, value=result.value, output_sqnr_db=result.output_sqnr_db, met=target.met(result)
    )


def start_on_all(pool: Pool | None, full: Evaluator, search: Search, final: Trial, selective: onnx.ModelProto) -> None:
    """Hand the pool, at once, what a screened search scores next on every sample: static and the answer
    (:func:`confirm_on_all`), then the neighbours the frontier scores again if the answer holds. Their scores
    are taken from there when asked for (nothing is hinted with one worker)."""
    if pool is None or pool.inline:
        return
    models = [search.build((), (), search.trials[0].per_channel)[1], selective]
    for _, t in frontier_neighbours(search, final):
        models.append(search.build(t.nodes, t.overrides, t.per_channel, fixes=t.fixes)[1])
    for model in models:
        pool.submit(full, model, numbers_only=True)


def confirm_on_all(
    search: Search,
    full: Evaluator,
    target: Target,
    plan: Plan,
    final: Trial,
    spec: QuantSpec,
    selective: onnx.ModelProto,
    pool: Pool | None = None,
) -> tuple[Plan, Trial, QuantSpec, onnx.ModelProto, list[str]]:
    """Static and the answer scored on every sample (side by side, through ``pool``); a screened answer that
    misses there replaced by the smallest larger screened answer that meets it (at most :data:`CONFIRM_TRIES`
    tries)."""
    screened = search.evaluator.samples
    search.evaluator, search.target = full, target  # everything reported from here on is on all samples
    static = search.trials[0]
    on_all = score_all(pool, full, [search.build((), (), static.per_channel)[1], selective], numbers_only=True)
    search.keep_result(selective, full, on_all[1])  # the answer's interval is read from it
    search.trials[0] = rescored(static, on_all[0], target)
    confirmed = rescored(final, on_all[1], target)
    notes = (
        [
            f"candidates were screened on the first {screened} of {full.samples} evaluation samples; static, the "
            f"answer and the frontier are scored on all {full.samples} (--screen-samples 0 scores everything on all)"
        ]
        if screened < full.samples
        else []  # screened on the switchable model over every sample: its own note says so
    )
    if confirmed.met or not final.met:
        return plan, confirmed, spec, selective, notes
    size = _size(final)
    larger = sorted((t for t in search.trials if t.met and search.fits(t) and _size(t) > size), key=_size)
    for trial in larger[:CONFIRM_TRIES]:
        built, model, _ = search.build(trial.nodes, trial.overrides, trial.per_channel, fixes=trial.fixes)
        result = score_all(pool, full, [model], numbers_only=True)[0]
        search.keep_result(model, full, result)
        checked = rescored(trial, result, target)
        if checked.met:
            notes.append(
                f"the screened answer ({size} change(s)) misses the target as deployed (all samples, real "
                f"model); the smallest screened answer that meets it there ({_size(trial)} change(s)) is "
                "proposed instead"
            )
            return plan_of(plan, checked), checked, built, model, notes
    notes.append(
        "the answer met the target when screened but misses it on the real models, and so do the "
        f"{min(len(larger), CONFIRM_TRIES)} larger screened answer(s) tried: pass --screen-samples 0 "
        "--screen-model off"
    )
    return plan, confirmed, spec, selective, notes


def _size(trial: Trial) -> int:
    return len(trial.nodes) + len(trial.overrides) + len(trial.fixes)
