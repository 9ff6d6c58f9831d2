"""The record every model transform returns.

A transform never mutates the model it is given; it returns a new one and says, in the user's node names,
what it changed and what it left alone and why -- the notes a proposal carries to the user.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx


@dataclass(frozen=True)
class Transformed:
    """A transformed copy of a model, and what the transform did to it."""

    model: onnx.ModelProto
    changed: tuple[str, ...] = ()
    """Nodes (their names) whose weights, biases or attributes the transform rewrote."""
    removed: tuple[str, ...] = ()
    """Nodes the transform removed (a BatchNormalization folded into its Conv)."""
    notes: tuple[str, ...] = ()
    """One line each, for the user: what was done, and what was skipped and why."""

    @property
    def touched(self) -> bool:
        """Whether the transform changed anything at all (an untouched model is no recipe)."""
        return bool(self.changed or self.removed)
