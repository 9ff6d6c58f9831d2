"""The TUI against a baseline (``qdebug tui B.json --against A.json``, ``qdebug tui diff.json``): the comparison
columns, their sort, the detail and header, and the CLI's errors.

Two real reports of one small CNN (minmax and percentile calibration, analyzed once for the module), and a
copy of the first with a node changed into another op and another model hash, for the unpaired case.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from textual.notifications import Notify

from qdebug.cli.main import main
from qdebug.diff import compare
from qdebug.output.report_io import load_report
from qdebug.records.diff import NodeChange
from qdebug.tui.app import QDebugApp
from qdebug.tui.compare import Baseline, fmt_change, judge, load_baseline
from qdebug.tui.model import COLUMNS, COMPARE_COLUMNS, LayerModel, fmt_db, table_layout
from qdebug.tui.widgets import CHANGE_STYLES, NodeDetail, NodeTable, SummaryBar, row_cells, summary_text
from tests.models import small_cnn, small_data

ROOT = Path(__file__).resolve().parent.parent
SIZE = (120, 40)
CUT = "relu2"
"""The node the baseline copy changes into another op (so nothing there pairs with it)."""


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    """``a`` (minmax), ``b`` (percentile) of one model, and ``cut``: ``a`` with node relu2 turned into another op
    and another model hash (a report of a changed model)."""
    tmp = tmp_path_factory.mktemp("compare")
    model = small_cnn(tmp / "m.onnx", unnamed=False)
    data = small_data(tmp / "c.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
        for out, extra in (("a.json", ()), ("b.json", ("--method", "percentile"))):
            argv = ["analyze", str(model), "--calib", str(data), "-o", str(tmp / out), "-q", *extra]
            assert main(argv) == 0
    cut = json.loads((tmp / "a.json").read_text())
    for n in cut["nodes"]:
        if n["name"] == CUT:  # the node became another op: nothing pairs with B's relu2
            n.update(name="leaky", original_name="leaky", op_type="LeakyRelu")
    cut["model"]["sha256"] = "0" * 64
    (tmp / "cut.json").write_text(json.dumps(cut))
    return {"a": tmp / "a.json", "b": tmp / "b.json", "cut": tmp / "cut.json"}


def _changes(a: Path, b: Path) -> dict[str, NodeChange]:
    """``qdebug diff a b``'s node changes by B's name, computed directly (the TUI must show the same)."""
    return {c.name_b: c for c in compare(load_report(a), load_report(b), str(a), str(b)).nodes}


def _shown(c: NodeChange, field: str) -> tuple[str, float]:
    """(cell text, sort value) of a delta, by hand: between two negligible values -- added noise both at or
    below -60 dB, SQNRs both at or above 60 -- ``~0`` sorting as 0 (bn2 goes from -104.8 dB to -inf)."""
    d = getattr(c, field)
    a, b = (c.added_noise_a_db, c.added_noise_b_db) if field == "added_noise_delta_db" else (
        -c.accumulated_sqnr_a_db, -c.accumulated_sqnr_b_db)
    if d != 0 and not math.isnan(d) and a <= -60 and b <= -60:
        return "~0", 0.0
    return fmt_change(d), d


def _expected_order(model: LayerModel, values: dict[str, float], descending: bool) -> list[str]:
    """The TUI's numeric order: finite values by direction, then infinities, then nan; ties topological."""
    names = [n.name for n in model.report.nodes]
    finite = sorted((n for n in names if math.isfinite(values[n])), key=values.get, reverse=descending)
    inf = sorted((n for n in names if math.isinf(values[n])), key=values.get, reverse=descending)
    return finite + inf + [n for n in names if math.isnan(values[n])]


def run(coro):
    return asyncio.run(coro)


# =========================================================================== model (no Textual)


def test_model_columns_values_and_sort(reports):
    a, b = reports["a"], reports["b"]
    report = load_report(b)
    plain = LayerModel(report)
    assert plain.columns() == COLUMNS and plain.baseline is None
    with pytest.raises(KeyError):
        plain.set_sort("added_delta")  # no baseline: no comparison column
    model = LayerModel(report, baseline=load_baseline(report, str(b), a))
    assert model.columns() == COLUMNS + COMPARE_COLUMNS
    assert model.column_keys()[-2:] == ("added_delta", "accumulated_delta")
    changes = _changes(a, b)
    assert set(changes) == {n.name for n in report.nodes}  # same model, two methods: every node pairs
    for n in report.nodes:
        c = changes[n.name]
        assert model.cell_text("added_delta", n) == _shown(c, "added_noise_delta_db")[0]
        assert model.cell_text("accumulated_delta", n) == _shown(c, "accumulated_sqnr_delta_db")[0]
        assert model.cell_text("added", n) == plain.cell_text("added", n)
    # sorting: worst first by default (added noise up, accumulated SQNR down), again: reversed
    for key, field, descending in (
        ("added_delta", "added_noise_delta_db", True),
        ("accumulated_delta", "accumulated_sqnr_delta_db", False),
    ):
        values = {name: _shown(c, field)[1] for name, c in changes.items()}
        model.set_sort(key)
        assert model.descending is descending
        assert [n.name for n in model.rows()] == _expected_order(model, values, descending)
        model.set_sort(key)
        assert [n.name for n in model.rows()] == _expected_order(model, values, not descending)
    model.set_sort("excluded")
    assert model.cycle_sort() == "added_delta" and model.cycle_sort() == "accumulated_delta"
    assert model.cycle_sort() == "name"  # round again
    # the layout has a width for each comparison column, wide enough for its values
    layout = table_layout(report.nodes, None, model.extra_cells())
    assert list(layout.widths)[-2:] == ["added_delta", "accumulated_delta"]
    assert all(layout.widths["added_delta"] > len(model.cell_text("added_delta", n)) for n in report.nodes)


def test_unpaired_nodes_are_blank_and_sort_last(reports):
    report = load_report(reports["b"])
    baseline = load_baseline(report, str(reports["b"]), reports["cut"])
    model = LayerModel(report, baseline=baseline)
    node = report.node(CUT)
    assert model.change(CUT) is None and math.isnan(model.delta("added_delta", node))
    assert model.cell_text("added_delta", node) == "" and model.cell_text("accumulated_delta", node) == ""
    assert model.judgement("added_delta", node) == ""
    for key in ("added_delta", "accumulated_delta"):
        model.set_sort(key)
        order = [n.name for n in model.rows()]
        assert order.index(CUT) >= sum(1 for n in report.nodes if not math.isnan(model.delta(key, n)))
    warning = baseline.warning()
    assert "another model" in warning and f"{len(report.nodes) - 1} of {len(report.nodes)} nodes paired" in warning
    assert "1 only here" in baseline.pairing_line()


def _edited(source: Path, out: Path, edit) -> Path:
    """A copy of report ``source`` with ``edit(data)`` applied to its JSON."""
    data = json.loads(source.read_text())
    edit(data)
    out.write_text(json.dumps(data))
    return out


def test_a_renamed_node_pairs_by_structure_and_shows_its_deltas(reports, tmp_path):
    """The baseline calls a node otherwise (same op, same place): it pairs by structure, and the shown
    report's node has the baseline's counterpart's deltas, under its own name."""
    report = load_report(reports["b"])

    def rename(data):
        (node,) = [n for n in data["nodes"] if n["name"] == "conv2"]
        node.update(name="conv2_old", original_name="conv2_old")

    renamed = _edited(reports["a"], tmp_path / "renamed.json", rename)
    baseline = load_baseline(report, str(reports["b"]), renamed)
    model = LayerModel(report, baseline=baseline)
    change = model.change("conv2")
    assert change is not None and (change.name_a, change.paired_by) == ("conv2_old", "structure")
    assert model.cell_text("added_delta", report.node("conv2")) == fmt_change(change.added_noise_delta_db) != ""
    assert "(1 by structure)" in baseline.pairing_line() and baseline.warning() == ""


def test_a_baseline_lacking_a_node_warns_and_counts_each_side(reports, tmp_path):
    """Same model, a node the baseline does not have: a warning, and the pairing line counts the unpaired
    nodes on each side (here 1 and 0)."""
    report = load_report(reports["b"])

    def drop(data):  # the last node (a report's depths must stay 1..n)
        data["nodes"] = [n for n in data["nodes"] if n["name"] != "fc"]

    fewer = _edited(reports["a"], tmp_path / "fewer.json", drop)
    baseline = load_baseline(report, str(reports["b"]), fewer)
    assert baseline.same_model and baseline.change("fc") is None
    total = len(report.nodes)
    assert baseline.pairing_line() == f"{total - 1} of {total} nodes paired, 1 only here, 0 only in the baseline"
    assert "does not pair every node" in baseline.warning()


def test_the_tally_counts_each_verdict(reports):
    report = load_report(reports["b"])
    diff = load_baseline(report, str(reports["b"]), reports["a"]).diff
    verdicts = ["worse", "worse", "better"] + ["same"] * (len(diff.nodes) - 3)
    nodes = tuple(dataclasses.replace(c, verdict=v) for c, v in zip(diff.nodes, verdicts, strict=True))
    baseline = Baseline(dataclasses.replace(diff, nodes=nodes))
    assert baseline.tally_line() == f"2 worse, 1 better, {len(nodes) - 3} same"
    # an undefined delta (a side without a number) is spelled out in the TUI, unlike the diff's "-"
    assert fmt_change(math.nan) == "nan" and fmt_change(math.inf) == "+inf" and fmt_change(-0.4) == "-0.4"


def test_cells_are_coloured_by_the_verdict_threshold(reports):
    """Worse red, better green, within the diff's SAME_DB dim: the deltas forced, the rest as computed."""
    report = load_report(reports["b"])
    diff = load_baseline(report, str(reports["b"]), reports["a"]).diff
    forced = {"conv2": (5.0, -5.0), "fc": (-5.0, 5.0), "conv1": (0.05, -0.05)}
    nodes = tuple(
        dataclasses.replace(c, added_noise_delta_db=forced[c.name_b][0], accumulated_sqnr_delta_db=forced[c.name_b][1])
        if c.name_b in forced
        else c
        for c in diff.nodes
    )
    model = LayerModel(report, baseline=Baseline(dataclasses.replace(diff, nodes=nodes)))
    keys = model.column_keys()
    for name, expected in (("conv2", "bold red"), ("fc", "green"), ("conv1", "dim")):
        cells = row_cells(report.node(name), False, None, model)
        assert len(cells) == len(keys)
        for key in ("added_delta", "accumulated_delta"):
            assert str(cells[keys.index(key)].style) == expected, (name, key)
    assert judge(5.0, True) == "worse" and judge(5.0, False) == "better" and judge(math.nan, True) == ""
    assert CHANGE_STYLES["worse"] == "bold red"


def test_a_change_between_negligible_noise_levels_is_dim_and_sorts_as_none(reports):
    """The demo's scale_mul went from added noise -inf to -155.6 dB (float rounding) and the TUI showed ΔAdd
    +inf, red, sorted first as the worst change. Both sides at or below -60 dB: ``~0``, dim, sorted as 0.
    The small CNN's bn2 goes from -104.8 dB to -inf on its own; conv2 is forced to -inf -> -155.6."""
    report = load_report(reports["b"])
    diff = load_baseline(report, str(reports["b"]), reports["a"]).diff
    forced = {"added_noise_a_db": -math.inf, "added_noise_b_db": -155.6, "added_noise_delta_db": math.inf}
    nodes = tuple(dataclasses.replace(c, **forced) if c.name_b == "conv2" else c for c in diff.nodes)
    model = LayerModel(report, baseline=Baseline(dataclasses.replace(diff, nodes=nodes)))
    keys = model.column_keys()
    assert model.change("bn2").added_noise_b_db == -math.inf < model.change("bn2").added_noise_a_db < -60
    for name in ("conv2", "bn2"):
        assert math.isinf(model.change(name).added_noise_delta_db)  # the record keeps the number
        assert model.cell_text("added_delta", report.node(name)) == "~0"
        assert model.delta("added_delta", report.node(name)) == 0.0
        cells = row_cells(report.node(name), False, None, model)
        assert str(cells[keys.index("added_delta")].style) == "dim"
    model.set_sort("added_delta")  # worst first: a real change leads, not conv2's +inf
    order = [n.name for n in model.rows()]
    assert order[0] != "conv2" and model.delta("added_delta", report.node(order[0])) > 0.1
    from qdebug.tui.widgets import node_detail_text

    text = node_detail_text(model, report.node("conv2"), 80).plain  # the detail says the same
    assert "-inf → -155.6 dB (~0)" in text and "+inf" not in text


def test_compare_module_imports_no_textual_or_onnx():
    code = (
        "import sys, qdebug.tui.compare, qdebug.tui.model; "
        "bad = [m for m in ('textual', 'onnxruntime', 'onnx') if m in sys.modules]; print(bad); sys.exit(bool(bad))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# =========================================================================== the app


def _cell(table: NodeTable, node: str, key: str) -> str:
    return table.get_cell(node, key).plain


def fmt_db_pair(a: float, b: float) -> str:
    """``baseline → this dB``, as the detail writes a number of both reports."""
    return f"{fmt_db(a)} → {fmt_db(b)} dB"


def test_the_table_shows_and_sorts_by_the_comparison_columns(reports):
    a, b = reports["a"], reports["b"]
    report = load_report(b)
    changes = _changes(a, b)
    finite = [c for c in changes.values() if math.isfinite(c.added_noise_delta_db)]
    known = max(finite, key=lambda c: abs(c.added_noise_delta_db))  # the node whose added noise moved most

    async def main_():
        app = QDebugApp(report, report_path=str(b), baseline=load_baseline(report, str(b), a))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            table = app.main_screen.query_one(NodeTable)
            labels = [str(c.label) for c in table.columns.values()]
            assert labels[-2:] == ["ΔAdd", "ΔAcc"] and labels[:2] == ["Node", "Op"]
            assert table.virtual_size.width <= table.scrollable_content_region.width  # fits at 120 columns
            assert _cell(table, known.name_b, "added_delta") == fmt_change(known.added_noise_delta_db)
            assert _cell(table, known.name_b, "accumulated_delta") == fmt_change(known.accumulated_sqnr_delta_db)
            values = {name: _shown(c, "added_noise_delta_db")[1] for name, c in changes.items()}
            last = _expected_order(app.model, values, True)[-1]
            app.main_screen.select_node(last)  # the node ΔAdd puts last is selected
            await pilot.pause()
            await pilot.press("9")  # ΔAdd, worst (most added noise) first
            await pilot.pause()
            order = [str(r.key.value) for r in table.ordered_rows]
            assert app.model.sort_key == "added_delta" and order == _expected_order(app.model, values, True)
            # a sort shows its top: the cursor (and the detail) on the first row, not on the node it left
            assert app.main_screen.selected == table.current == order[0] != last and table.scroll_y == 0
            assert app.main_screen.query_one(NodeDetail).node == order[0]
            assert str(table.columns[table.ordered_columns[-2].key].label) == "ΔAdd▼"
            await pilot.press("9")  # again: reversed
            await pilot.pause()
            order = [str(r.key.value) for r in table.ordered_rows]
            assert order == _expected_order(app.model, values, False)
            await pilot.press("0")  # ΔAcc, worst (SQNR down) first
            await pilot.pause()
            acc = {name: _shown(c, "accumulated_sqnr_delta_db")[1] for name, c in changes.items()}
            assert [str(r.key.value) for r in table.ordered_rows] == _expected_order(app.model, acc, False)
            # the detail shows the baseline's numbers and the verdict; the header what it compares against
            app.main_screen.select_node(known.name_b)
            await pilot.pause()
            detail = app.main_screen.query_one(NodeDetail)
            text = detail.render().plain
            assert f"vs a.json: {known.verdict}" in text
            assert f"added noise {fmt_db_pair(known.added_noise_a_db, known.added_noise_b_db)}" in text
            header = summary_text(report, None, app.model.baseline).plain
            assert "vs a.json" in header and "method minmax → percentile" in header
            assert f"{len(changes)} of {len(report.nodes)} nodes paired" in header
            assert app.main_screen.query_one(SummaryBar).baseline is app.model.baseline
            assert app.sub_title.endswith("vs a.json")
            await pilot.press("question_mark")  # the help lists the comparison columns with their keys
            await pilot.pause()
            help_text = "".join(str(s.render()) for s in app.screen.query("Static"))
            assert "9     ΔAdd" in help_text and "0     ΔAcc" in help_text

    run(main_())


def test_another_model_opens_with_a_note_and_blanks_for_unpaired_nodes(reports):
    b = reports["b"]
    report = load_report(b)
    notes = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append((message.notification.severity, message.notification.message))

    async def main_():
        app = QDebugApp(report, baseline=load_baseline(report, str(b), reports["cut"]))
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            table = app.main_screen.query_one(NodeTable)
            assert _cell(table, CUT, "added_delta") == "" and _cell(table, CUT, "accumulated_delta") == ""
            paired = next(n.name for n in report.nodes if n.name != CUT)
            assert _cell(table, paired, "accumulated_delta") != ""
            app.main_screen.select_node(CUT)
            await pilot.pause()
            assert "vs cut.json: no counterpart there" in app.main_screen.query_one(NodeDetail).render().plain
            await pilot.press("x")  # the exclusion mark still redraws its row (the columns moved nothing)
            await pilot.pause()
            assert _cell(table, CUT, "excluded") == "✗" and _cell(table, CUT, "added_delta") == ""

    run(main_())
    warnings = [m for s, m in notes if s == "warning"]
    total = len(report.nodes)
    assert any("another model" in m and f"{total - 1} of {total} nodes paired" in m for m in warnings), notes


def test_without_a_baseline_the_table_and_keys_are_unchanged(reports):
    report = load_report(reports["b"])

    async def main_():
        app = QDebugApp(report)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            table = app.main_screen.query_one(NodeTable)
            assert [c.key.value for c in table.ordered_columns] == [c.key for c in COLUMNS]
            await pilot.press("9", "0")  # no comparison columns: nothing to sort by
            await pilot.pause()
            assert app.model.sort_key == "added" and app.return_code is None

    run(main_())


# =========================================================================== the command line


def test_cli_against_and_a_diff_file_open(reports, tmp_path):
    a, b = reports["a"], reports["b"]
    shot = tmp_path / "against.svg"
    assert main(["tui", str(b), "--against", str(a), "--screenshot", str(shot)]) == 0
    svg = shot.read_text()
    assert "ΔAdd" in svg and "a.json" in svg
    diff = tmp_path / "diff.json"
    assert main(["diff", str(a), str(b), "--json", str(diff)]) == 0
    shot2 = tmp_path / "diff.svg"
    assert main(["tui", str(diff), "--screenshot", str(shot2)]) == 0
    assert "ΔAdd" in shot2.read_text()


def _one_line_error(capsys, *words: str) -> None:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_cli_bad_against_files_are_one_line_exit_3(reports, tmp_path, capsys):
    b = str(reports["b"])
    capsys.readouterr()
    assert main(["tui", b, "--against", str(tmp_path / "nope.json")]) == 3
    _one_line_error(capsys, "--against", "not found", "nope.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"schema_version": 3, "nodes": [')
    assert main(["tui", b, "--against", str(corrupt)]) == 3
    _one_line_error(capsys, "--against", "not JSON")
    diff = tmp_path / "diff.json"
    assert main(["diff", str(reports["a"]), b, "--json", str(diff)]) == 0
    capsys.readouterr()
    assert main(["tui", b, "--against", str(diff)]) == 3  # a diff is no report: it is opened by itself
    _one_line_error(capsys, "--against", "is a qdebug diff, not a report", f"open it as `qdebug tui {diff}`")
    assert main(["tui", str(diff), "--against", str(reports["a"])]) == 2  # a diff names its baseline already
    _one_line_error(capsys, "names its baseline")
    # a proposal is no report either, and only analyze's report is one (the hint had listed every command)
    proposal = tmp_path / "p.json"
    assert main(["propose", str(reports["a"]), "-o", str(proposal), "-q"]) in (0, 6)
    capsys.readouterr()
    assert main(["tui", b, "--against", str(proposal)]) == 3
    _one_line_error(capsys, "--against", "proposal file, not a report", "the file qdebug analyze writes")
    comparison = tmp_path / "cmp.json"
    assert main(["diff", str(reports["a"]), b, str(reports["a"]), "--json", str(comparison)]) == 0
    capsys.readouterr()
    assert main(["tui", b, "--against", str(comparison)]) == 3
    _one_line_error(capsys, "--against", "comparison of several reports", "one of the reports it compares")
    assert main(["tui", b, "--against", str(tmp_path)]) == 3  # a folder: said so, not "not found"
    _one_line_error(capsys, "--against", f"{tmp_path} is a directory, not a report file")


def test_cli_a_stale_or_orphaned_diff_file_is_refused(reports, tmp_path, capsys):
    a, b = reports["a"], reports["b"]
    copy = tmp_path / "b.json"
    copy.write_text(b.read_text())
    diff = tmp_path / "diff.json"
    assert main(["diff", str(a), str(copy), "--json", str(diff)]) == 0
    data = json.loads(copy.read_text())
    data["created"] = "2000-01-01T00:00:00+00:00"  # analyzed again since the diff
    copy.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["tui", str(diff), "--screenshot", str(tmp_path / "s.svg")]) == 3
    _one_line_error(capsys, "changed since", "--against")
    copy.unlink()
    assert main(["tui", str(diff), "--screenshot", str(tmp_path / "s.svg")]) == 3
    _one_line_error(capsys, "not found", "--against")
    # edited: same model, stamp and node count, but a paired node renamed -- the deltas name what is gone
    copy.write_text(b.read_text())
    assert main(["diff", str(a), str(copy), "--json", str(diff)]) == 0
    data = json.loads(copy.read_text())
    next(n for n in data["nodes"] if n["name"] == CUT)["name"] = "renamed"
    copy.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["tui", str(diff), "--screenshot", str(tmp_path / "s.svg")]) == 3
    _one_line_error(capsys, "changed since")


def test_a_diff_with_relative_paths_opens_from_another_folder(reports, tmp_path, monkeypatch):
    """``qdebug diff a.json b.json --json diff.json`` run in the reports' folder, opened from elsewhere: B is
    found next to the diff file."""
    from qdebug.tui.compare import open_diff

    folder = tmp_path / "reports"
    folder.mkdir()
    for name in ("a", "b"):
        (folder / f"{name}.json").write_text(reports[name].read_text())
    monkeypatch.chdir(folder)
    assert main(["diff", "a.json", "b.json", "--json", "diff.json"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    path, baseline = open_diff(folder / "diff.json")
    assert Path(path) == folder / "b.json" and baseline.label == "a.json"
