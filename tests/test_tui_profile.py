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


def test_the_detail_pane_gives_a_profiled_nodes_times_and_its_cause(profiled):
    """A node the profile timed shows its FP32 and INT8 time per run and its INT8 kernel; one whose INT8 time
    has a cause (here set on the record: which node has one depends on the CPU) says how much it loses and
    what to do, in the profile's own words; an unprofiled report shows no time line."""
    import dataclasses

    from qdebug.records.profile import CAUSES
    from qdebug.tui.widgets import node_detail_text

    timed = {n.name: n for n in profiled.profile.nodes}
    name = next(n.name for n in profiled.nodes if n.name in timed)
    nodes = tuple(dataclasses.replace(n, cause="unfolded-batchnorm" if n.name == name else "") for n in timed.values())
    report = dataclasses.replace(profiled, profile=dataclasses.replace(profiled.profile, nodes=nodes))
    node = next(n for n in report.nodes if n.name == name)
    text = node_detail_text(LayerModel(report), node, 100).plain
    nl = {n.name: n for n in nodes}[name]
    assert f"FP32 {nl.fp32_ms:.3f} ms · INT8 {nl.int8_ms + nl.qdq_ms:.3f} ms (Q/DQ {nl.qdq_ms:.3f})" in text
    assert f"INT8 loses {-nl.saved_ms:.3f} ms here: unfolded-batchnorm -- {CAUSES['unfolded-batchnorm']}" in text
    other = next((n for n in report.nodes if n.name in timed and n.name != name), None)
    if other is not None:
        assert "INT8 loses" not in node_detail_text(LayerModel(report), other, 100).plain
    plain = dataclasses.replace(profiled, profile=None)
    assert "time/run" not in node_detail_text(LayerModel(plain), node, 100).plain
