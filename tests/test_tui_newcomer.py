"""Issue 38, a newcomer's run of the TUI: what they tripped on, driven through Pilot at their terminal sizes.

Everything runs from the synthetic report in ``tui_report.py`` (plus a per-sample section built here); no
model is run.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from textual.widgets import DataTable

from qdebug.records.samples import SAMPLES_VERSION, SampleDetail, SampleFlip, SampleSection, VariantSamples
from qdebug.tui.app import QDebugApp
from qdebug.tui.samples import SamplesScreen
from qdebug.tui.samples_model import INPUT_WIDTH, NAME_WIDTH
from tests.tui_report import make_report

REPORT = make_report()

LONG_ORIGIN = "data/evaluation_images_of_the_second_validation_split.npz[32:48]"
"""A batch origin far wider than the input column: it must keep its row visible."""


def _section() -> SampleSection:
    """Four flips of the static model; the first three measured tensor by tensor. Sample 335 is row 15 of
    the batch ``eval.npz[320:336]`` (the newcomer's table read ``row 1``)."""
    tensors = tuple(t.name for t in REPORT.tensors)
    producer = {o: n.name for n in REPORT.nodes for o in n.outputs}
    depth = {n.name: n.depth for n in REPORT.nodes}
    nodes = tuple(producer.get(t, "") for t in tensors)
    n = len(tensors)
    flips = (
        SampleFlip(335, "data/eval.npz[320:336]", 15, 3, 3.0, 5.0, "lost", 12.5),
        SampleFlip(17, "data/eval.npz[16:32]", 1, 3, 3.0, 5.0, "lost", 11.5),
        SampleFlip(40, LONG_ORIGIN, 8, 3, 3.0, 5.0, "lost", 10.5),
        SampleFlip(208, "data/eval.npz[208:224]", 0, 3, 3.0, 5.0, "lost", 9.5),
    )
    details = tuple(
        SampleDetail(
            f.index,
            "static",
            tuple(40.0 - i for i in range(n)),
            tuple(-30.0 + (i % 7) for i in range(n)),
            tuple(0.01 * (i % 4) if i else math.nan for i in range(n)),
            f.output_sqnr_db,
        )
        for f in flips[:3]
    )
    results = (3.0,) * 512
    return SampleSection(
        SAMPLES_VERSION,
        "top1",
        "class",
        "eval",
        512,
        "the argmax differs",
        results,
        None,
        (VariantSamples("static", results, len(flips), flips),),
        50,
        tensors,
        nodes,
        tuple(depth.get(x, 0) for x in nodes),
        details,
        "static",
    )


SAMPLES_REPORT = replace(REPORT, per_sample=_section())


def run(coro) -> None:
    asyncio.run(coro)


def _visible_columns(table: DataTable) -> list[str]:
    """The labels of the columns drawn whole inside the table's visible width (no sideways scroll)."""
    room = table.scrollable_content_region.width
    shown, x = [], 0
    for col in table.ordered_columns:
        x += col.get_render_width(table)
        if x <= room:
            shown.append(str(col.label))
    return shown


# --------------------------------------------------------------------------- item 1: the samples screen


@pytest.mark.parametrize("size", [(80, 24), (120, 36)])
def test_samples_screen_shows_the_right_row_and_the_divergence_numbers(size):
    """The input cell names the sample's row in the file (``row 1`` had been ``row 15`` cut by the pane's edge),
    long cells end in ``…`` within their width, and the tensors' SQNR, added noise and clip rate are on
    screen without scrolling; tab, named in the footer, moves to the tensors' table."""

    async def main() -> None:
        app = QDebugApp(SAMPLES_REPORT)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await pilot.press("i")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, SamplesScreen)
            flips = screen.query_one("#flips", DataTable)
            column = [str(c.label) for c in flips.ordered_columns].index("input")
            cells = [str(flips.get_row_at(r)[column]) for r in range(flips.row_count)]
            assert cells[0] == "eval.npz[335]" and cells[1] == "eval.npz[17]"
            assert "…" in cells[2] and cells[2].endswith("[40]") and len(cells[2]) <= INPUT_WIDTH
            assert {"sample", "input", "change", "out SQNR"} <= set(_visible_columns(flips))

            divergence = screen.query_one("#divergence", DataTable)
            assert {"tensor", "SQNR dB", "added dB", "clip", "report SQNR"} <= set(_visible_columns(divergence))
            names = [str(divergence.get_row_at(r)[0]) for r in range(divergence.row_count)]
            assert "layer0/attn…k_matmul_out" in names and all(len(x) <= NAME_WIDTH for x in names)

            footer = {b.binding.key: b.binding for b in screen.active_bindings.values()}
            assert footer["tab"].show and footer["tab"].description
            await pilot.press("tab")
            assert divergence.has_focus
            await pilot.press("tab")
            assert flips.has_focus

    run(main())


# --------------------------------------------------------------------------- item 2: picking an op type


def test_o_opens_the_op_type_list_and_capital_o_goes_back_to_all_ops():
    """``o`` stepped through 26 op types one press at a time; now it opens the list (type to search, enter
    picks, the table has the focus again) and ``O`` drops the filter, offered in the footer while one is set
    and in the help."""
    from textual.widgets import Select

    from qdebug.tui.screens import HELP_ROWS, MainScreen, NodeTable

    assert any(key == "O" for key, _ in HELP_ROWS)

    def footer(screen: MainScreen) -> set[str]:
        return {b.binding.key for b in screen.active_bindings.values() if b.binding.show and b.enabled}

    async def main() -> None:
        app = QDebugApp(REPORT)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            screen = app.main_screen
            assert "O" not in footer(screen)  # nothing to reset yet
            await pilot.press("o")
            await pilot.pause()
            assert screen.query_one("#op-filter", Select).expanded
            await pilot.press(*"Softm", "enter")
            await pilot.pause()
            assert app.model.op_filter == "Softmax"
            assert {n.op_type for n in app.model.rows()} == {"Softmax"}
            assert isinstance(app.focused, NodeTable)
            assert "O" in footer(screen)
            await pilot.press("O")
            await pilot.pause()
            assert app.model.op_filter is None and len(app.model.rows()) == len(REPORT.nodes)
            assert screen.query_one("#op-filter", Select).is_blank() and "O" not in footer(screen)
            await pilot.press("o")
            await pilot.pause()
            await pilot.press("escape")  # esc closes the list, the filter stays as it was
            await pilot.pause()
            assert app.model.op_filter is None and isinstance(app.focused, NodeTable)

    run(main())


# --------------------------------------------------------------------------- item 3: the snippet dialog


def test_the_snippet_keeps_its_lines_whole_at_80_columns():
    """The snippet was wrapped to the dialog's width: continuation lines began at column 0, so its
    indentation no longer read as Python. Its lines stay whole now and scroll sideways."""
    from textual.containers import VerticalScroll
    from textual.widgets import Static

    from qdebug.tui.screens import TextDialog
    from tests.tui_report import make_proposal

    async def main() -> None:
        app = QDebugApp(REPORT, make_proposal(REPORT))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            await pilot.press("c")
            await pilot.pause()
            dialog = app.screen
            assert isinstance(dialog, TextDialog)
            lines = dialog.body.split("\n")
            body = dialog.query_one("#dialog-body", Static)
            assert body.size.height == len(lines)  # one row per line: nothing wrapped
            assert body.size.width == max(len(line) for line in lines)
            scroll = dialog.query_one(VerticalScroll)
            assert scroll.virtual_size.width > scroll.scrollable_content_region.width  # it scrolls sideways
            await pilot.press("right", "right")
            assert scroll.scroll_x > 0

    run(main())


# --------------------------------------------------------------------------- item 4: verify at 80 columns


def test_the_detail_pane_keeps_its_width_while_a_verify_runs_at_80_columns():
    """Below 110 columns the verify panel was a third column beside detail | exclusions: the detail
    shrank to 14 columns, one word per line. Now it takes rows under them, the whole width."""
    import threading

    from qdebug.tui.screens import DetailPanel, VerifyPanel
    from tests.tui_report import make_proposal

    release = threading.Event()
    started = threading.Event()

    class Result:
        def summary_lines(self) -> list[str]:
            return ["verify: top1 0.9020 (target 0.9)", "2 nodes kept in FP32"]

    def verify_fn(proposal, progress, cancelled):
        progress(0.3, "evaluating the selective model")
        started.set()
        release.wait(10)
        return Result()

    async def main() -> None:
        app = QDebugApp(REPORT, make_proposal(REPORT), verify_fn=verify_fn)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            screen = app.main_screen
            detail = screen.query_one(DetailPanel)
            width = detail.region.width
            assert width >= 36
            await pilot.press("v")
            for _ in range(300):
                if started.is_set():
                    break
                await asyncio.sleep(0.01)
            await pilot.pause()
            panel = screen.query_one(VerifyPanel)
            assert screen.verify_state == "running" and panel.region.height > 0
            assert panel.region.width == 80 and detail.region.width == width
            release.set()
            await app.workers.wait_for_complete()
            await pilot.pause()
            await pilot.press("escape")  # the result dialog
            await pilot.pause()
            assert screen.verify_state == "done" and detail.region.width == width and detail.region.height >= 3
            assert screen.table.size.height - 1 >= 6  # the table keeps rows too

    run(main())


# --------------------------------------------------------------------------- items 5 and 6: the numbers' labels


def test_the_node_kl_and_its_tensors_kls_are_named():
    """The node's ``KL 1.411`` (its outputs' largest accumulated KL) sat above its output's ``KL 0 nats``
    (the local one): both unnamed, they read as one number that disagreed with itself."""
    from qdebug.tui.model import LayerModel
    from qdebug.tui.widgets import node_detail_text

    node = REPORT.node("layer1/attn/softmax")
    (out,) = node.outputs
    tensors = tuple(
        replace(t, local=replace(t.local, kl=0.0), accumulated=replace(t.accumulated, kl=1.411))
        if t.name == out
        else t
        for t in REPORT.tensors
    )
    report = replace(
        REPORT,
        tensors=tensors,
        nodes=tuple(replace(n, kl=1.411) if n.name == node.name else n for n in REPORT.nodes),
    )
    text = node_detail_text(LayerModel(report), report.node(node.name), 60).plain
    assert "KL accum 1.41" in text  # as the table's KL column writes it
    assert "KL local 0 · accum 1.41 nats" in text
    assert "KL 1.41" not in text and "KL    0 nats" not in text


def test_an_output_sqnr_metric_header_shows_the_int8_sqnr_without_a_drop():
    """With ``output_sqnr_db`` as the task metric FP32 is the reference (+inf): the header read
    ``FP32 inf → INT8 32.41 (-inf)``."""
    from qdebug.tui.widgets import summary_text

    task = replace(REPORT.task, name="output_sqnr_db", fp32=math.inf, quantized=32.4123, quantized_fakequant=33.5)
    head = summary_text(replace(REPORT, task=task)).plain
    assert "output SQNR (eval, 512): INT8 32.41 dB" in head and "fake-quant 33.5 dB" in head
    assert "-inf" not in head and "FP32" not in head
    assert "FP32 91.25% → INT8 86.10% (-5.15 pts)" in summary_text(REPORT).plain  # accuracy as before

    async def main() -> None:
        app = QDebugApp(replace(REPORT, task=task))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            shown = app.main_screen.query_one("#summary").render().plain
            assert "INT8 32.41 dB" in shown and "(-inf)" not in shown

    run(main())
