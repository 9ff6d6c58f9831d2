"""Progress on stderr for long stages (rich bars on a terminal, a few plain lines otherwise)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from qdebug.progress import Progress as ProgressFn


@contextmanager
def stderr_progress(enabled: bool = True) -> Iterator[ProgressFn]:
    """Yield a ``progress(stage, done, total)`` callback that draws on stderr."""
    if not enabled:
        yield lambda stage, done, total: None
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description:>10}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as bar:
            tasks: dict[str, int] = {}

            def update(stage: str, done: int, total: int | None) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], completed=done, total=total)

            yield update
        return
    last: dict[str, float] = {}

    def plain(stage: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        finished = total is not None and done >= total
        if stage in last and not finished and now - last[stage] < 5.0:
            return
        last[stage] = now
        of = f"/{total}" if total else ""
        print(f"qdebug: {stage} {done}{of}", file=sys.stderr, flush=True)

    yield plain
