"""The verify gates: the selective model judged by recovery, drop and output SQNR, beyond the noise.

:func:`assess` (and :func:`judge`, its tuple form) passes or fails each gate only beyond the
paired-bootstrap interval :func:`gate_noise` assembles from the evaluator's per-sample values
(:mod:`qdebug.evaluation.noise`), else calls the result undecided; :func:`noise_fields` turns the intervals into
``verify.json`` fields. Plain functions over values and an :class:`~qdebug.evaluation.evaluate.Evaluator`: the
``verify`` command (:mod:`qdebug.verify`) calls them, and ``qdebug.output.ci_outputs`` reads the same gates
back from the record.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from qdebug.evaluation.evaluate import EvalResult, Evaluator, HookValues
from qdebug.evaluation.noise import Interval, PairedNoise, paired_noise, samples_to_decide, single_interval
from qdebug.output.formatting import ACCURACY_METRICS, fmt_db, metric_title
from qdebug.records.verify import GateRecord, VariantResult

__all__ = ["Judgement", "assess", "judge", "speedup_gate"]

MOSTLY_FP32_SHARE = 0.5
"""A selective model keeping more than this share of the quantizable nodes FP32 has given back most of the
INT8 speed-up (Q/DQ at every boundary, float kernels between): propose refuses such an answer and verify
fails it, both unless ``--accept-no-speedup``."""

SPEED_MARGIN = 0.1
"""How far beyond the other's spread a latency must be to count (10 %): an exit code must not hang on the
noise of a loaded 2-core machine."""

SPEEDUP_GATE = "INT8 speed-up kept"
"""The speed-up gate's name (a JUnit test case's)."""


class Latency(Protocol):
    """A timed model: verify's :class:`~qdebug.records.verify.Timing`, propose's frontier point."""

    p50_ms: float
    p95_ms: float


def mostly_fp32(kept_fp32: int, quantizable: int) -> bool:
    """Whether keeping ``kept_fp32`` of ``quantizable`` nodes FP32 gives most of the speed-up back."""
    return quantizable > 0 and kept_fp32 > MOSTLY_FP32_SHARE * quantizable


def static_buys_speed(fp32: Latency, static: Latency) -> bool:
    """Full static INT8 is faster than FP32 beyond the timing noise (else speed is not judged: the CPU's
    integer kernels buy nothing here)."""
    return static.p95_ms < (1 - SPEED_MARGIN) * fp32.p50_ms


def slower_than_fp32(fp32: Latency, candidate: Latency) -> bool:
    """``candidate`` is slower than FP32 beyond the timing noise."""
    return candidate.p50_ms > (1 + SPEED_MARGIN) * fp32.p95_ms


def gate_noise(
    evaluator: Evaluator,
    static: EvalResult,
    selective: EvalResult,
    confidence: float,
    target_sqnr: float | None,
) -> tuple[PairedNoise | None, list[str]]:
    """The paired bootstrap of FP32, static and selective (and of the selective model's output SQNR when
    ``--target-sqnr`` asks for it), or None with ``--confidence 0``; notes say what it could not cover."""
    if confidence <= 0:
        return None, []
    metric, notes = evaluator.metric_name, []
    values = tuple(evaluator.sample_values(r) for r in (None, static, selective))
    noise = None
    if math.isfinite(evaluator.fp32_value):
        if any(v is None or v.units < 2 for v in values):
            notes.append(
                f"no uncertainty estimate for {metric_title(metric)}: a custom metric on one evaluation batch and "
                "without a per_sample form (see README), or a single sample; its gate is judged on the point estimates"
            )
        else:
            fp32_v, static_v, sel_v = values
            hits = (fp32_v.hits > 0.5, sel_v.hits > 0.5) if metric == "top1" else None  # type: ignore[union-attr]
            noise = paired_noise(
                (fp32_v, static_v, sel_v),  # type: ignore[arg-type]
                (evaluator.fp32_value, static.value, selective.value),
                confidence=confidence,
                scale=100.0 if metric in ACCURACY_METRICS else 1.0,
                samples=evaluator.samples,
                hits=hits,
            )
            if isinstance(sel_v, HookValues):
                notes.append(
                    f"the intervals of {metric_title(metric)} resample its {sel_v.units} evaluation batches (the "
                    "metric has no per_sample form): they are rough with few batches"
                )
    if target_sqnr is not None:
        sqnr = evaluator.sqnr_values(selective)
        if sqnr is not None and sqnr.units >= 2:
            iv = single_interval(sqnr, selective.output_sqnr_db, confidence)
            base = noise or PairedNoise(confidence, sqnr.resamples, sqnr.units, evaluator.samples)
            noise = dataclasses.replace(base, sqnr=iv, sqnr_units=sqnr.units)
    return noise, notes


def noise_fields(noise: PairedNoise | None, j: Judgement) -> dict[str, object]:
    """The ``verify.json`` fields of the intervals (their defaults without them)."""
    if noise is None:
        return {}
    nan2 = (math.nan, math.nan)
    test = noise.mcnemar
    return {
        "confidence": noise.confidence,
        "decided": j.decided,
        "drop_interval": noise.drop.pair() if noise.drop else nan2,
        "static_drop_interval": noise.static_drop.pair() if noise.static_drop else nan2,
        "recovery_interval": noise.recovery.pair() if noise.recovery else nan2,
        "sqnr_interval": noise.sqnr.pair() if noise.sqnr else nan2,
        "p_value": test.p_value if test else math.nan,
        "discordant": (test.first_only, test.second_only) if test else None,
        "samples_to_decide": j.samples_to_decide,
        "resamples": noise.resamples,
        "noise_units": noise.units if noise.drop else noise.sqnr_units,
    }


@dataclass(frozen=True)
class Judgement:
    """What :func:`assess` concludes."""

    recovered: float
    met: bool
    """Every gate passed -- beyond the noise when intervals were given."""
    decided: bool
    """False when no gate failed beyond the noise but one could not be told from it (``UNDECIDED``)."""
    verdict: str
    samples_to_decide: int | None = None
    """Samples that would decide every undecided gate, if the estimates and their spread held."""
    gates: tuple[GateRecord, ...] = ()
    """Each gate's name, side and text: what ``--junit`` writes, one test case each."""


SIDES = {1: "passed", -1: "failed", 0: "undecided"}
"""How a gate went, in the verdict line when the gates went different ways ("FAIL: undecided: ...; failed: ...")."""


@dataclass(frozen=True)
class _Gate:
    name: str
    text: str
    side: int
    """1: passes, -1: fails (beyond the noise when an interval is given), 0: the interval straddles it."""
    needed: int | None = None
    """For a straddling gate: samples that would decide it (None: not estimable)."""


def judge(
    metric: str,
    fp32: float,
    static: float,
    selective: float,
    selective_sqnr: float,
    min_recovery: float,
    target_sqnr: float | None,
    target_drop: float | None = None,
    *,
    noise: PairedNoise | None = None,
) -> tuple[float, bool, str]:
    """(recovered fraction, met, one-line verdict) of :func:`assess`."""
    j = assess(metric, fp32, static, selective, selective_sqnr, min_recovery, target_sqnr, target_drop, noise=noise)
    return j.recovered, j.met, j.verdict


def assess(
    metric: str,
    fp32: float,
    static: float,
    selective: float,
    selective_sqnr: float,
    min_recovery: float,
    target_sqnr: float | None,
    target_drop: float | None = None,
    *,
    noise: PairedNoise | None = None,
    speed: _Gate | None = None,
) -> Judgement:
    """Judge the selective model's gates, by their intervals when ``noise`` gives them, and ``speed``
    (:func:`speedup_gate`) when given.

    ``target_drop`` judges the selective model against FP32 as ``propose --target-drop`` does (points for
    accuracy metrics), so a CI gate can hold the proposal to the target it was searched for: by recovery,
    a proposal propose had reported as missing its target could pass. Without ``noise`` every gate is
    judged on its point estimate. With it, a gate passes when its estimate and whole interval pass, fails
    when they all fail, and is undecided otherwise; the result fails when a gate fails, is undecided when
    one is, and passes when every gate passes.
    """
    recovered = math.nan
    if math.isfinite(fp32) and math.isfinite(static) and fp32 - static > 1e-12:
        recovered = (selective - static) / (fp32 - static)
    gates = []
    if target_drop is not None and not math.isfinite(fp32):
        why = f"no FP32 value of {metric_title(metric)} to measure a drop from"
        gates.append(_Gate(_drop_name(metric, target_drop), why, -1))
    elif target_drop is not None:
        gates.append(_drop_gate(metric, fp32, selective, target_drop, noise))
    elif math.isfinite(fp32):
        gates.append(_recovery_gate(metric, fp32, static, selective, min_recovery, noise))
    if target_sqnr is not None:
        gates.append(_sqnr_gate(selective_sqnr, target_sqnr, noise))
    if speed is not None:
        gates.append(speed)
    mixed = len({g.side for g in gates}) > 1  # each part then says which way it went
    parts = "; ".join(f"{SIDES[g.side]}: {g.text}" if mixed else g.text for g in gates)
    records = tuple(GateRecord(g.name, g.side, g.text) for g in gates)
    if any(g.side < 0 for g in gates):
        return Judgement(recovered, False, True, "FAIL: " + parts, gates=records)
    open_gates = [g for g in gates if g.side == 0]
    if not open_gates:
        return Judgement(recovered, True, True, "PASS: " + parts, gates=records)
    assert noise is not None
    needed = None if any(g.needed is None for g in open_gates) else max(g.needed or 0 for g in open_gates)
    tail = (
        f"; about {needed:,} samples would decide it ({noise.samples:,} now)"
        if needed is not None
        else "; no sample count is estimable (an estimate on its target, or an unbounded interval)"
    )
    head = f"UNDECIDED: the evaluation set is too small to tell at {_percent(noise.confidence)} confidence: "
    return Judgement(recovered, False, False, head + parts + tail, needed, records)


def _side(iv: Interval | None, estimate: float, passes: Callable[[float], bool]) -> int:
    """1 when the estimate and both bounds pass, -1 when all fail, 0 when they disagree; the estimate
    alone without an interval (or with an undefined one)."""
    if iv is None or math.isnan(iv.low) or math.isnan(iv.high):
        return 1 if passes(estimate) else -1
    verdicts = {passes(x) for x in (iv.low, estimate, iv.high)}
    return 0 if len(verdicts) == 2 else (1 if verdicts == {True} else -1)


def _shown(iv: Interval | None, fmt: Callable[[float], str], unit: str = "") -> str:
    """`` [95% interval 0.20 to 1.40 points]``, appended to a gate's text (nothing without an interval)."""
    if iv is None or math.isnan(iv.low):
        return ""
    return f" [{_percent(iv.confidence)} interval {fmt(iv.low)} to {fmt(iv.high)}{unit}]"


def _needed(iv: Interval | None, threshold: float, units: int, per_unit: float) -> int | None:
    """Samples that would decide a straddling gate (:func:`qdebug.evaluation.noise.samples_to_decide`)."""
    n = None if iv is None else samples_to_decide(iv, threshold, units)
    return None if n is None else math.ceil(n * per_unit)


def _points(x: float) -> str:
    return f"{x:.2f}"


def _share(x: float) -> str:
    return f"{100 * x:.1f}%" if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _drop_name(metric: str, target_drop: float) -> str:
    """``top1 drop vs FP32 <= 1 points``: the drop gate's name (a JUnit test case's)."""
    unit = " points" if metric in ACCURACY_METRICS else ""
    return f"{metric_title(metric)} drop vs FP32 <= {target_drop:g}{unit}"


def _drop_gate(metric: str, fp32: float, selective: float, target_drop: float, noise: PairedNoise | None) -> _Gate:
    scale = 100.0 if metric in ACCURACY_METRICS else 1.0
    drop = (fp32 - selective) * scale
    ok = drop <= target_drop + 1e-9
    unit = " points" if scale == 100.0 else ""
    where = f"{drop:.2f}{unit} below" if drop >= 0 else f"{-drop:.2f}{unit} above"
    iv = noise.drop if noise else None
    side = _side(iv, drop, lambda x: x <= target_drop + 1e-9)
    text = (
        f"the selective model is {where} FP32 on {metric_title(metric)} ({'<=' if ok else '>'} {target_drop:g}{unit} "
        f"drop allowed){_shown(iv, _points, unit)}"
    )
    needed = _needed(iv, target_drop, noise.units, noise.per_unit) if noise and side == 0 else None
    return _Gate(_drop_name(metric, target_drop), text, side, needed)


def _recovery_gate(
    metric: str, fp32: float, static: float, selective: float, min_recovery: float, noise: PairedNoise | None
) -> _Gate:
    gap = fp32 - static
    name = f"{metric_title(metric)} recovery >= {_percent(min_recovery)}"
    if gap > 1e-12:
        recovered = (selective - static) / gap
        ok = recovered >= min_recovery - 1e-12
        whole = abs(100 * min_recovery - round(100 * min_recovery)) < 1e-9  # 90 %, not 93.06 %
        iv = noise.recovery if noise else None
        side = _side(iv, recovered, lambda x: x >= min_recovery - 1e-12)
        text = (
            f"recovered {100 * recovered:.{1 if whole else 2}f}% of the {metric_title(metric)} lost by static "
            f"quantization ({'>=' if ok else '<'} {_percent(min_recovery)} required){_shown(iv, _share)}"
        )
        needed = _needed(iv, min_recovery, noise.units, noise.per_unit) if noise and side == 0 else None
        return _Gate(name, text, side, needed)
    # static at or above FP32 (often by noise): the selective model passes when it keeps either level
    margin = selective - min(static, fp32)
    ok = margin >= -1e-12
    level = "not worse than static" if selective >= static - 1e-12 else "at least FP32's value"
    iv = noise.margin if noise else None
    side = _side(iv, margin * (100.0 if metric in ACCURACY_METRICS else 1.0), lambda x: x >= -1e-9)
    unit = " points" if metric in ACCURACY_METRICS else ""
    shown = _shown(iv, _points, f"{unit} of selective minus the lower of FP32 and static")
    text = (
        f"static quantization lost nothing on {metric_title(metric)}; the selective model is "
        f"{level if ok else 'worse than both FP32 and static'}{shown}"
    )
    needed = _needed(iv, 0.0, noise.units, noise.per_unit) if noise and side == 0 else None
    return _Gate(name, text, side, needed)


def _sqnr_gate(selective_sqnr: float, target_sqnr: float, noise: PairedNoise | None) -> _Gate:
    ok = not math.isnan(selective_sqnr) and selective_sqnr >= target_sqnr - 1e-12
    iv = noise.sqnr if noise else None
    side = -1 if math.isnan(selective_sqnr) else _side(iv, selective_sqnr, lambda x: x >= target_sqnr - 1e-12)
    text = (
        f"output SQNR {fmt_db(selective_sqnr)} dB {'>=' if ok else '<'} {target_sqnr:.1f} dB target"
        f"{_shown(iv, fmt_db, ' dB')}"
    )
    per_unit = noise.samples / noise.sqnr_units if noise and noise.sqnr_units else 1.0
    needed = _needed(iv, target_sqnr, noise.sqnr_units, per_unit) if noise and side == 0 else None
    return _Gate(f"output SQNR >= {target_sqnr:g} dB", text, side, needed)


def _percent(fraction: float) -> str:
    """A threshold as given: 90%, 93.06% (a rounded one had printed "recovered 93.1% (< 93% required)"),
    never -0%."""
    return f"{100 * fraction + 0.0:.4g}%"


def speedup_gate(columns: Sequence[VariantResult], accept_no_speedup: bool = False) -> _Gate:
    """Whether the selective model is still an INT8 model that keeps the speed-up, by propose's rule.

    It fails, whatever ``accept_no_speedup`` says, when nothing is quantized: no node of the full static
    model (ORT's quantizer found nothing to quantize, e.g. a network inside an If), or none left in the
    selective one (all its nodes FP32, no Q/DQ pair): a CI gate must not go green on the FP32 model. It
    fails unless ``accept_no_speedup`` when the selective model keeps most quantizable nodes FP32
    (:func:`mostly_fp32`), or is timed slower than FP32 while full static is faster, both beyond the noise.
    """
    by = {c.name: c for c in columns}
    fp32, static, selective = by["fp32"], by["static"], by["selective"]
    quantizable, kept = fp32.nodes_excluded, selective.nodes_excluded
    if quantizable == 0 or static.qdq_pairs == 0:
        text = (
            "ORT's quantizer quantized no node of this model (the full static model has no Q/DQ pair): there is "
            "no INT8 model to verify"
        )
        return _Gate(SPEEDUP_GATE, text, -1)
    if kept >= quantizable or selective.qdq_pairs == 0 and selective.runtime_quantized == 0:
        text = (
            f"the selective model quantizes nothing ({kept} of {quantizable} quantizable nodes FP32, "
            f"{selective.qdq_pairs} Q/DQ pairs, nothing quantized at run time): it is the FP32 model, not "
            "selective quantization"
        )
        return _Gate(SPEEDUP_GATE, text, -1)
    reasons = []
    if mostly_fp32(kept, quantizable):
        reasons.append(
            f"the selective model keeps {kept} of {quantizable} quantizable nodes ({100 * kept / quantizable:.0f} %) "
            "FP32: most of the INT8 speed-up is gone"
        )
    t_fp32, t_static, t_sel = fp32.timing, static.timing, selective.timing
    buys = t_fp32 is not None and t_static is not None and static_buys_speed(t_fp32, t_static)
    # a selective model that changes nothing is full static INT8 again: its timing differs from static's by
    # noise alone (a verify of 2 runs under load had called it slower than FP32 while static was faster)
    as_static = kept == 0 and selective.tensor_overrides == 0 and selective.qdq_pairs == static.qdq_pairs
    if buys and not as_static and t_sel is not None and slower_than_fp32(t_fp32, t_sel):  # type: ignore[arg-type]
        reasons.append(
            f"the selective model is slower than FP32 (p50 {t_sel.p50_ms:.3g} vs {t_fp32.p50_ms:.3g} ms; "  # type: ignore[union-attr]
            f"full static {t_static.p50_ms:.3g} ms): it gives the INT8 speed-up back"  # type: ignore[union-attr]
        )
    if reasons and not accept_no_speedup:
        return _Gate(SPEEDUP_GATE, "; ".join(reasons) + " (--accept-no-speedup takes it anyway)", -1)
    if reasons:
        return _Gate(SPEEDUP_GATE, "; ".join(reasons) + ", accepted with --accept-no-speedup", 1)
    text = f"the selective model quantizes {quantizable - kept} of {quantizable} quantizable nodes"
    if t_fp32 is not None and t_static is not None and not buys:
        text += "; full static INT8 is not faster than FP32 here beyond the timing noise, so speed is not judged"
    return _Gate(SPEEDUP_GATE, text, 1)
