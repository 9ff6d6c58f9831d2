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


class StageClock:
    """A progress callback that passes every call on to ``inner`` and times the stages: the time from one call
    to the next is the first one's stage's (its name without a :data:`DETAIL`), so a stage that comes back
    (the search between re-ranks) adds up. :meth:`seconds` closes the current stage at the time it is asked."""

    def __init__(self, inner: Progress, clock: Callable[[], float] | None = None) -> None:
        import time

        self._inner = inner
        self._clock = clock or time.perf_counter
        self._stage: str | None = None
        self._since = self._clock()
        self._seconds: dict[str, float] = {}

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        self._close()
        self._stage = stage.split(DETAIL)[0]
        self._inner(stage, done, total)

    def _close(self) -> None:
        now = self._clock()
        if self._stage is not None:
            self._seconds[self._stage] = self._seconds.get(self._stage, 0.0) + now - self._since
        self._since = now

    def seconds(self) -> tuple[tuple[str, float], ...]:
        """Each stage's wall seconds so far, in the order the stages first came."""
        self._close()
        return tuple(self._seconds.items())


def stage_seconds(progress: Progress) -> tuple[tuple[str, float], ...]:
    """The stages' seconds when ``progress`` is a :class:`StageClock`, else nothing."""
    return progress.seconds() if isinstance(progress, StageClock) else ()
