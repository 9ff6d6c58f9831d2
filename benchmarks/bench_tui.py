#!/usr/bin/env python3
"""Benchmark ``qdebug tui`` on a large report: wall time of the interactive actions, headless.

Usage::

    python benchmarks/bench_tui.py [--nodes 2000 5000] [--repeat 5] [--profile ACTION]

Builds the tests' synthetic transformer report (``tests/tui_report.py``) with
enough layers for ``--nodes`` nodes (BERT-base / ResNet-50 sized tables),
writes it with :mod:`qdebug.output.report_io` and loads it back (so the app sees what
``qdebug tui report.json`` would), then drives the app with Textual's pilot
(``App.run_test``, 120x40, headless) and times each action from the key press
until the app is idle again: the handlers, DataTable's deferred idle work
(column measuring) and the compositor's render of the screen update (headless
runs compute it and only skip the terminal write).

Each number is the median of ``--repeat`` runs, each run in a fresh app: wall
time and the process's CPU time. The pilot's idle detection (Textual's
``wait_for_idle``: 20 ms polls, after every key) puts a floor under every wall
number, per key pressed; the ``(no-op key)`` row measures it. CPU time leaves
out those polls (and the other processes of a busy machine).

``--profile ACTION`` runs cProfile over one action (a row label prefix, e.g.
``sort``; several: comma-separated) in the first run and prints the top functions by cumulative and by own
time on stderr; the whole profile goes to ``bench_tui.<nodes>.prof`` in the current directory.

Prints a markdown table on stdout. No assertion on the timings: the TUI tests
check behaviour on a large report, this script only measures.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from textual._wait import wait_for_idle  # noqa: E402

from qdebug.output.report_io import load_report, save_report  # noqa: E402
from qdebug.tui.app import QDebugApp  # noqa: E402
from qdebug.tui.model import COLUMNS  # noqa: E402
from tests.tui_report import make_large_report  # noqa: E402

SIZE = (120, 40)


async def settle(pilot) -> None:
    """Until every widget has handled its messages and the process stops using the CPU (twice: the
    DataTable measures its rows on the Idle event after the handlers ran)."""
    for _ in range(2):
        await pilot._wait_for_screen(timeout=120)
        await wait_for_idle(0, max_sleep=120)


def _actions() -> list[tuple[str, Callable]]:
    """(label, async fn(pilot)) in the order they run in one app session."""

    def keys(*k: str):
        async def go(pilot):
            await pilot.press(*k)

        return go

    acts: list[tuple[str, Callable]] = [("(no-op key)", keys("f12"))]
    for i, col in enumerate(COLUMNS):
        acts.append((f"sort {i + 1} ({col.label})", keys(str(i + 1))))
    acts.append(("sort again (reverse)", keys(str(len(COLUMNS)))))
    acts.append(("sort back to Added", keys("5")))
    acts.append(("filter: type '/l1sm' + enter", keys("slash", *"l1sm", "enter")))
    acts.append(("filter: clear (ctrl+u, enter)", keys("slash", "ctrl+u", "enter")))
    acts.append(("op filter: o (first op)", keys("o")))
    acts.append(("op filter: back to all", _op_back_to_all))
    acts.append(("cursor: 1 down (detail + histograms)", keys("down")))
    acts.append(("cursor: 50 down", keys(*["down"] * 50)))
    acts.append(("toggle exclusion (x)", keys("x")))
    acts.append(("toggle exclusion back (x)", keys("x")))
    acts.append(("jump to producer ([)", keys("left_square_bracket")))
    acts.append(("jump to consumer (])", keys("right_square_bracket")))
    acts.append(("help screen (?) open", keys("question_mark")))
    acts.append(("help screen close", keys("escape")))
    return acts


async def _op_back_to_all(pilot) -> None:
    ops = pilot.app.model.op_types()
    await pilot.press(*["o"] * len(ops))  # first op -> ... -> last -> all


async def one_session(
    report, profile: str | None = None
) -> tuple[dict[str, tuple[float, float]], cProfile.Profile | None]:
    """One fresh app: start, then every action; (wall, CPU) seconds per label (and the profile of ``profile*``)."""
    times: dict[str, tuple[float, float]] = {}
    prof = cProfile.Profile() if profile else None
    app = QDebugApp(report)
    t0, c0 = time.perf_counter(), time.process_time()
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        times["start to first paint"] = (time.perf_counter() - t0, time.process_time() - c0)
        for label, act in _actions():
            on = prof is not None and label.startswith(tuple(profile.split(",")))
            t, c = time.perf_counter(), time.process_time()
            if on:
                prof.enable()
            await act(pilot)
            await settle(pilot)
            if on:
                prof.disable()
            times[label] = (time.perf_counter() - t, time.process_time() - c)
        assert not app.model.excluded, "the two x presses should cancel out"
    return times, prof


def bench(nodes: int, repeat: int, profile: str | None) -> tuple[dict[str, tuple[float, float]], int]:
    """Median (wall, CPU) seconds per action over ``repeat`` fresh apps on a report of about ``nodes`` nodes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "large.report.json"
        save_report(make_large_report(nodes), path)
        report = load_report(path)  # what `qdebug tui large.report.json` sees
    runs: list[dict[str, tuple[float, float]]] = []
    for i in range(repeat):
        times, prof = asyncio.run(one_session(report, profile if i == 0 else None))
        runs.append(times)
        if prof is not None:
            for order in ("cumulative", "tottime"):
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats(order).print_stats(25)
                print(f"## profile of {profile!r}* on {len(report.nodes)} nodes, by {order}", file=sys.stderr)
                print(out.getvalue(), file=sys.stderr)
            prof.dump_stats(f"bench_tui.{len(report.nodes)}.prof")  # for pstats / snakeviz
    medians = {k: (statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs)) for k in runs[0]}
    return medians, len(report.nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2000, 5000])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--profile", default=None, help="cProfile the actions whose label starts with this (several: comma-separated)"
    )
    args = ap.parse_args()
    results = []
    for n in args.nodes:
        results.append(bench(n, args.repeat, args.profile))
    print(f"median of {args.repeat} fresh apps; wall and process CPU ms from the key press until the app is idle\n")
    print("| action (120x40, headless) | " + " | ".join(f"{n} nodes wall | CPU" for _, n in results) + " |")
    print("|---|" + "---:|---:|" * len(results))
    for label in results[0][0]:
        cols = " | ".join(f"{r[label][0] * 1000:.0f} | {r[label][1] * 1000:.0f}" for r, _ in results)
        print(f"| {label} | {cols} |")

if __name__ == "__main__":
    main()
