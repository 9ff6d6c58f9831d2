"""Feed dicts and the samples in them: :class:`Batch`, and every cut, count and join of samples.

Everything that cuts, counts or stacks samples goes through :func:`take_rows`, :func:`feed_rows` and
:func:`join_rows`, each input on its own batch axis (:data:`Axes`, decided by :mod:`qdebug.data.specs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Axes = Mapping[str, "int | None"]
"""Input name -> the axis its samples are stacked on (None: fed whole with every batch, e.g. a scalar)."""


@dataclass(frozen=True)
class Batch:
    """One batch of feeds (exactly the model's inputs) and its labels, if any."""

    feeds: Mapping[str, np.ndarray]
    labels: np.ndarray | None
    size: int
    origin: str
    """Where it came from (file and slice) for error messages."""
    axes: Axes = dataclasses.field(default_factory=dict)
    """Each input's batch axis (:func:`batch_axes`): what a chunk of this batch is cut on."""


def axis_of(name: str, value: np.ndarray, axes: Axes | None) -> int | None:
    """The batch axis of one array: ``axes``' (axis 0 for a name it lacks); None for rank 0."""
    if not value.ndim:
        return None
    if axes is None or name not in axes:
        return 0
    axis = axes[name]
    return axis if axis is None or axis < value.ndim else None


def feed_rows(feeds: Mapping[str, np.ndarray], axes: Axes | None = None) -> int:
    """Samples in one feed dict: the size of its first batched array on its batch axis (``axes``; without
    them axis 0), 1 when no input has one (scalars; an indivisible batch)."""
    for k, v in feeds.items():
        axis = axis_of(k, v, axes)
        if axis is not None:
            return int(v.shape[axis])
    return 1


def take_rows(
    feeds: Mapping[str, np.ndarray], start: int, stop: int | None = None, axes: Axes | None = None
) -> dict[str, np.ndarray]:
    """Samples ``start:stop`` of a feed dict, each input cut on its batch axis (``axes``; without them
    axis 0); inputs without one (rank 0: one value for the whole batch) are kept whole. A cut off axis 0 is
    copied contiguous, as ORT reads it."""
    out = {}
    for k, v in feeds.items():
        axis = axis_of(k, v, axes)
        if axis is None:
            out[k] = v
        elif axis == 0:
            out[k] = v[start:stop]
        else:
            out[k] = np.ascontiguousarray(v[(slice(None),) * axis + (slice(start, stop),)])
    return out


def join_rows(parts: Sequence[Mapping[str, np.ndarray]], axes: Axes | None = None) -> dict[str, np.ndarray]:
    """Consecutive feed dicts of one model joined on each input's batch axis (one value kept whole)."""
    if len(parts) == 1:
        return dict(parts[0])
    out = {}
    for k, v in parts[0].items():
        axis = axis_of(k, v, axes)
        out[k] = v if axis is None else np.concatenate([p[k] for p in parts], axis=axis)
    return out
