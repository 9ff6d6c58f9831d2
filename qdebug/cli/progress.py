"""Progress on stderr for long stages (rich bars on a terminal, a few plain lines otherwise)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from qdebug.progress import DETAIL
from qdebug.progress import Progress as ProgressFn


@contextmanager
def stderr_progress(enabled: bool = True) -> Iterator[ProgressFn]:
    """Yield a ``progress(stage, done, total)`` callback that draws on stderr."""
    if not enabled:
        yield lambda stage, done, total: None
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        with Progress(
            TextColumn("{task.fields[name]:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[detail]}"),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            tasks: dict[str, int] = {}

            def update(stage: str, done: int, total: int | None) -> None:
                name, _, detail = stage.partition(DETAIL)
                if name not in tasks:
                    tasks[name] = bar.add_task(name, total=total, name=name, detail=detail)
                bar.update(tasks[name], completed=done, total=total, detail=detail)

            yield update
        return
    last: dict[str, float] = {}
    started: dict[str, float] = {}

    def plain(stage: str, done: int, total: int | None) -> None:
        name, _, detail = stage.partition(DETAIL)
        now = time.monotonic()
        started.setdefault(name, now)
        finished = total is not None and done >= total
        if name in last and not finished and now - last[name] < 5.0:
            return
        last[name] = now
        of = f"/{total}" if total else ""
        extra = f" · {detail}" if detail else ""
        print(f"qdebug: {name} {done}{of}{extra}{_eta(now - started[name], done, total)}", file=sys.stderr, flush=True)

    yield plain


def _eta(elapsed: float, done: int, total: int | None) -> str:
    """`` · ETA 2 min`` from the pace so far (nothing before the first step or once done)."""
    if not total or done <= 0 or done >= total or elapsed < 1.0:
        return ""
    left = elapsed / done * (total - done)
    return f" · ETA {left / 60:.0f} min" if left >= 90 else f" · ETA {left:.0f} s"
