"""``--allow calib-flipped``: the static model's flipped evaluation samples added to the calibration, as a fix.

``verify --calib-add-flipped`` widens every cached range by the FP32 values of the samples the static model
gets wrong (:mod:`qdebug.quant.recalibrate`). A widened range is exactly a ``TensorQuantOverrides`` ``rmin``/``rmax``
entry, so propose can try it like a clipped range: on one unit's tensors (a per-node fix, instead of keeping
the unit FP32) or on every widened tensor at once (a whole-model first try, like whole-model per-channel).
The proposal's overrides and snippet then reproduce it without the user's calibration data changing, and
verify rebuilds the same overrides.

:func:`flipped_ranges` measures the ranges once per run, from the report's per-sample section (static's
flips, worst first, at most :data:`~qdebug.quant.recalibrate.MAX_ADDED`) run through the FP32 model. The samples
are evaluation samples, so a recovery measured on them is an upper bound (:data:`LEAK_NOTE`): opt-in only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from qdebug.data import fixed_batch
from qdebug.evaluation.evaluate import Evaluator
from qdebug.evaluation.samples import sample_inputs
from qdebug.propose.blame import Unit
from qdebug.propose.search import Fix
from qdebug.propose.structure import Structure
from qdebug.quant.calibrate import Ranges
from qdebug.quant.recalibrate import LEAK_NOTE as _RECALIBRATE_LEAK
from qdebug.quant.recalibrate import MAX_ADDED, growth, sample_ranges
from qdebug.records import Report, TensorOverride
from qdebug.runtime.capture import SessionConfig

KIND = "calib-flipped"
"""The ``--allow`` action (and the fix's kind)."""

WIDEN_MIN_GAIN = 1.1
"""A range is overridden only where the flipped samples widen it at least this many times (0 included, as
ORT includes it): a sliver more range clips next to nothing and costs every other value some resolution."""

SKIPPED = f"--allow {KIND} skipped"

LEAK_NOTE = f"{KIND}: {_RECALIBRATE_LEAK}"
"""Said whenever the answer uses the fix: the ranges come from the samples the metric is measured on."""


@dataclass(frozen=True)
class FlippedRanges:
    """The calibrated ranges the static model's flipped evaluation samples widen, measured once per run."""

    samples: int
    """Flipped samples run through FP32 (static's, worst first)."""
    widened: tuple[tuple[str, float, float, float, float], ...]
    """``(tensor, low, high, new low, new high)`` of each range widened at least :data:`WIDEN_MIN_GAIN`
    times, the most widened first (relative to its calibrated width)."""

    def fix(self, unit: Unit, structure: Structure) -> Fix | None:
        """The unit kept INT8 with its tensors' ranges widened (the tensors it keeps float and every activation
        its nodes read or write: keeping them FP32 had removed their Q/DQ), or None where none is widened."""
        nodes = set(unit.nodes)
        touched = {unit.key, *unit.tensors}
        touched |= {t for n in structure.model.graph.node if n.name in nodes for t in (*n.input, *n.output) if t}
        rows = [g for g in self.widened if g[0] in touched]
        return Fix(unit, KIND, _overrides(rows), self._why(rows)) if rows else None

    def whole(self) -> Fix | None:
        """Every widened range at once: what calibrating on calibration + the flipped samples gives (None
        when none is widened)."""
        if not self.widened:
            return None
        unit = Unit(KIND, "model", (), tuple(g[0] for g in self.widened), 0.0, "", "the whole model's ranges")
        return Fix(unit, KIND, _overrides(self.widened), self._why(self.widened, "for the whole model, "))

    def used_by(self, fixes: Iterable[TensorOverride]) -> bool:
        """Whether any of ``fixes`` is one of these widened ranges (the answer's overrides come from them)."""
        mine = set(_overrides(self.widened))
        return any(o in mine for o in fixes)

    def _why(self, rows: Sequence[tuple[str, float, float, float, float]], scope: str = "") -> str:
        """The fix in numbers: how many samples, the most widened range, how many more."""
        name, lo, hi, new_lo, new_hi = rows[0]
        more = f" and {len(rows) - 1} more" if len(rows) > 1 else ""
        return (
            f"calibration + the {self.samples} flipped evaluation samples, {scope}range of {name} widened "
            f"[{lo:.4g}, {hi:.4g}] -> [{new_lo:.4g}, {new_hi:.4g}]{more} (an upper bound: measured on the samples "
            "it was calibrated on)"
        )


def _overrides(rows: Sequence[tuple[str, float, float, float, float]]) -> tuple[TensorOverride, ...]:
    return tuple(TensorOverride(name, rmin=new_lo, rmax=new_hi) for name, _, _, new_lo, new_hi in rows)


def flipped_ranges(
    report: Report,
    evaluator: Evaluator,
    fp32: onnx.ModelProto,
    ranges: Ranges,
    config: SessionConfig,
    eval_src: str | Path,
    allow: Sequence[str] = (KIND,),
) -> tuple[FlippedRanges | None, str]:
    """The widened ranges, or None and the note saying why there are none (no per-sample section, no flips,
    flips on other data than this run evaluates on, none widens a range meaningfully); (None, "") without
    ``calib-flipped`` in ``allow``: nothing is run."""
    if KIND not in allow:
        return None, ""
    section = report.per_sample
    if section is None or not any(v.name == "static" and v.flips for v in section.variants):
        why = "the report has no per-sample section" if section is None else "static flips none of its samples"
        return None, f"no flipped samples recorded: {why}; {SKIPPED}"
    if section.data != "eval":
        return None, (
            "no flipped samples recorded on evaluation data: analyze scored its calibration data, whose ranges "
            f"already hold them (re-run qdebug analyze with --eval); {SKIPPED}"
        )
    if report.config.eval is None or not _same(report.config.eval, eval_src):
        return None, (
            f"the report's flipped samples are rows of {report.config.eval}, not of this run's evaluation data "
            f"{eval_src}; {SKIPPED}"
        )
    added = [f.index for f in section.variant("static").flips[:MAX_ADDED]]
    _, inputs = sample_inputs(evaluator, None, set(added), [])
    found = [inputs[i] for i in added if i in inputs]
    if not found:
        return None, f"the report's flipped samples are not in this run's evaluation data; {SKIPPED}"
    seen = sample_ranges(fp32, list(ranges.tensors.keys()), found, config, fixed_batch(evaluator.data.specs))
    rows = tuple(g for g in growth(ranges, seen) if _meaningful(*g[1:]))
    if not rows:
        return None, (
            f"the {len(found)} flipped samples widen no calibrated range {WIDEN_MIN_GAIN:g} times or more; {SKIPPED}"
        )
    return FlippedRanges(len(found), rows), ""


def _meaningful(lo: float, hi: float, new_lo: float, new_hi: float) -> bool:
    """Whether the widened range (0 included, as ORT quantizes it) is :data:`WIDEN_MIN_GAIN` times wider."""
    old = max(hi, 0.0) - min(lo, 0.0)
    return max(new_hi, 0.0) - min(new_lo, 0.0) >= WIDEN_MIN_GAIN * old


def _same(a: str | Path, b: str | Path) -> bool:
    """Whether two data sources name the same data (paths compared resolved; a hook spec as written)."""
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return str(a) == str(b)


def leak_notes(fixes: Iterable[TensorOverride], flipped: FlippedRanges | None) -> tuple[str, ...]:
    """:data:`LEAK_NOTE` when the answer's overrides (``fixes``) use the widened ranges, else nothing."""
    return (LEAK_NOTE,) if flipped is not None and flipped.used_by(fixes) else ()
