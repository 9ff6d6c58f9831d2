"""The TUI over a report made with ``analyze --profile`` (issue 37): each node's INT8 time and the time INT8
loses or saves there are two more columns of the node table, sortable like the others."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("textual")

from qdebug.cli.main import main  # noqa: E402
from qdebug.output.report_io import load_report  # noqa: E402
from qdebug.tui.app import QDebugApp  # noqa: E402
from qdebug.tui.model import LayerModel  # noqa: E402
from qdebug.tui.widgets import NodeTable  # noqa: E402
from tests.models import small_cnn, small_data  # noqa: E402


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tui-profile")
    model, data = small_cnn(tmp / "m.onnx"), small_data(tmp / "c.npz")
    assert main(["analyze", str(model), "--calib", str(data), "--profile", "3", "-o", str(tmp / "r.json"), "-q"]) == 0
    return load_report(tmp / "r.json")


def test_the_profile_columns_hold_each_nodes_times_and_sort_the_biggest_loss_first(profiled):
    model = LayerModel(profiled)
    assert [c.key for c in model.columns()][-2:] == ["int8_ms", "lost_ms"]
    timed = {n.name: n for n in profiled.profile.nodes}
    for node in profiled.nodes:
        lost = model.latency("lost_ms", node)
        if node.name in timed:
            assert lost == pytest.approx(-timed[node.name].saved_ms)
            assert model.cell_text("lost_ms", node) == f"{lost:+.3f}"
        else:  # no kernel of its own (folded, or a tensor-only node): blank, sorted last
            assert math.isnan(lost) and model.cell_text("lost_ms", node) == ""
    model.set_sort("lost_ms")
    ordered = [n.name for n in model.ordered() if n.name in timed]
    assert ordered == sorted(timed, key=lambda k: timed[k].saved_ms)  # the biggest loss first
    assert LayerModel(profiled.__class__(**{**profiled.__dict__, "profile": None})).columns()[-1].key != "lost_ms"


def test_the_node_table_shows_the_profile_columns_at_120_columns(profiled):
    async def main_():
        app = QDebugApp(profiled, None)
        async with app.run_test(size=(120, 36)) as pilot:
            await pilot.pause()
            table = app.main_screen.query_one(NodeTable)
            labels = [str(c.label) for c in table.columns.values()]
            assert any("INT8 ms" in x for x in labels) and any("Lost ms" in x for x in labels), labels

    asyncio.run(main_())
