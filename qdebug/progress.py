"""The progress callback every long stage takes: ``progress(stage, done, total)``.

Stages report to it and never print; the CLI turns the calls into a bar or plain lines on stderr.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, int, "int | None"], None]
"""``progress(stage, done, total)``: ``total`` is None when the count is not known in advance."""

DETAIL = " · "
"""Separates a stage's name from a detail that changes as it runs (``search · 12 changed · best ...``):
displays keep one bar per name and show the latest detail with it."""


def no_progress(stage: str, done: int, total: int | None) -> None:
    """The default callback: report nothing."""
    return None
