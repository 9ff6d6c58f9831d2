"""The notes a report carries about its data: each input's batch axis, and arrays nothing reads."""

from __future__ import annotations

from typing import Any

from qdebug.data.dataset import DataSet
from qdebug.data.specs import LABELS_KEY, batch_axes, batch_axis_note


def data_notes(calib: DataSet, evaluation: DataSet | None, model: Any = None) -> list[str]:
    """:func:`batch_axis_note` and :func:`ignored_note` for the calibration and (when given) the evaluation
    data of ``model``."""
    defaulted = defaulted_inputs(model) if model is not None else set()
    notes = [batch_axis_note(calib.specs), ignored_note(calib, "calibration data", defaulted)]
    if evaluation is not None:
        if batch_axes(evaluation.specs) != batch_axes(calib.specs):
            notes.append(f"evaluation data: {batch_axis_note(evaluation.specs) or 'batch axis 0'}")
        notes.append(ignored_note(evaluation, "evaluation data", defaulted))
    return [n for n in notes if n]


def defaulted_inputs(model: Any) -> set[str]:
    """Values the model holds itself (initializers): an input with a default (normalization keeps it as an
    initializer only) or a weight. The data cannot feed them."""
    return {t.name for t in model.graph.initializer}


def ignored_note(data: DataSet, what: str, defaulted: set[str] | frozenset[str] = frozenset()) -> str | None:
    """A note naming the arrays nothing reads: a typo such as ``label`` for ``labels`` had silently turned
    top-1 against labels into agreement with FP32 (100 %). An input with a default in the model is named as
    such: the model's default is used (it had been called "neither a model input")."""
    if not data.ignored:
        return None
    import difflib

    parts = []
    kept = [k for k in data.ignored if k in defaulted]
    if kept:
        names = ", ".join(repr(k) for k in kept)
        held = "the model holds these values itself (an input's default or a weight)"
        parts.append(f"{names}: {held}; the data's were ignored")
    unread = [k for k in data.ignored if k not in defaulted]
    if unread:
        names = ", ".join(repr(k) for k in unread)
        wanted = [LABELS_KEY, *(s.name for s in data.specs)]
        hints = [
            f"{m[0]!r} for {k!r}"
            for k in unread
            if (m := difflib.get_close_matches(k, wanted, n=1, cutoff=0.6))
        ]
        guess = f" (did you mean {', '.join(hints)}?)" if hints else ""
        parts.append(f"key(s) {names} are neither a model input nor 'labels' and were ignored{guess}")
    return f"{what} {data.source}: " + "; ".join(parts)
