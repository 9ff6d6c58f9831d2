"""`qdebug diff`: two reports paired through the graph (names, then structure), their deltas, the outputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest

from qdebug.cli.main import main
from qdebug.diff import compare, diff_reports, load_diff, pair_nodes, verdict
from qdebug.errors import ExitCode
from qdebug.output.report_io import dumps, load_report
from qdebug.records import (
    SCHEMA_VERSION,
    AnalysisConfig,
    ErrorStats,
    ModelInfo,
    NodeRecord,
    Report,
    TensorRecord,
)
from qdebug.records.diff import DIFF_SCHEMA_VERSION, DiffReport, OutputChange
from tests.conftest import strict_json
from tests.models import small_cnn, small_data


def _renamed(model: Path, data: Path, out_model: Path, out_data: Path) -> None:
    """The same model with every node and tensor renamed (``v2/...``) and its input called ``x``: the next
    version of a model whose exporter named things differently."""
    m = onnx.load(str(model))
    g = m.graph
    rename = {vi.name: "x" for vi in g.input}
    for n in g.node:
        n.name = f"v2/{n.name}"
        for o in n.output:
            rename.setdefault(o, f"v2/{o}_out")
    for n in g.node:
        for i, t in enumerate(n.input):
            n.input[i] = rename.get(t, t)
        for i, t in enumerate(n.output):
            n.output[i] = rename[t]
    for vi in [*g.input, *g.output]:
        vi.name = rename[vi.name]
    onnx.save(m, str(out_model))
    arrays = dict(np.load(data))
    arrays["x"] = arrays.pop("input")
    np.savez(out_data, **arrays)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """(minmax report, percentile report, report of the renamed model), analyzed once for the module."""
    tmp = tmp_path_factory.mktemp("diff")
    model = small_cnn(tmp / "m.onnx", unnamed=False)
    data = small_data(tmp / "c.npz")
    _renamed(model, data, tmp / "m2.onnx", tmp / "c2.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
        for out, m, d, extra in (
            ("a.json", model, data, ()),
            ("b.json", model, data, ("--method", "percentile")),
            ("r.json", tmp / "m2.onnx", tmp / "c2.npz", ()),
        ):
            argv = ["analyze", str(m), "--calib", str(d), "-o", str(tmp / out), "-q", *extra]
            assert main(argv) == 0
    return tmp / "a.json", tmp / "b.json", tmp / "r.json"


def test_two_methods_pair_every_node_by_name_and_name_the_setting(reports, tmp_path, capsys):
    a, b, _ = reports
    out, md = tmp_path / "diff.json", tmp_path / "diff.md"
    assert main(["diff", str(a), str(b), "--json", str(out), "--markdown", str(md)]) == 0
    stdout = capsys.readouterr().out
    assert "settings that differ: method minmax -> percentile" in stdout
    data = strict_json(out.read_text())  # no NaN/Infinity literals
    assert data["kind"] == "diff" and data["schema_version"] == DIFF_SCHEMA_VERSION
    diff = load_diff(out)  # loads strictly back into the record
    assert isinstance(diff, DiffReport)
    report_a = load_report(a)
    assert len(diff.nodes) == len(report_a.nodes) and not diff.only_in_a and not diff.only_in_b
    assert {n.paired_by for n in diff.nodes} == {"name"}
    assert all(n.name_a == n.name_b for n in diff.nodes)
    assert [s.setting for s in diff.settings] == ["method"]
    assert len(diff.tensors) == len(report_a.tensors)
    assert diff.outputs and diff.outputs[0].name_b == "logits"
    assert diff.task_a is not None and diff.task_b is not None
    # every delta is B - A of the two reports' own numbers
    report_b = load_report(b)
    for n in diff.nodes:
        for field, record_field in (("accumulated_sqnr", "accumulated_sqnr_db"), ("local_sqnr", "local_sqnr_db")):
            va, vb = getattr(report_a.node(n.name_a), record_field), getattr(report_b.node(n.name_b), record_field)
            got = getattr(n, f"{field}_delta_db")
            assert (math.isnan(got) and (math.isnan(va) or math.isnan(vb))) or got == (0.0 if va == vb else vb - va)
    text = md.read_text()
    assert text.startswith("## qdebug diff") and "| node | op |" in text


def test_renamed_nodes_are_paired_by_structure(reports, tmp_path, capsys):
    a, _, r = reports
    assert main(["diff", str(a), str(r), "--top", "0", "--wide"]) == 0
    stdout = capsys.readouterr().out
    diff = diff_reports(a, r)
    report_a = load_report(a)
    assert len(diff.nodes) == len(report_a.nodes) and not diff.only_in_a and not diff.only_in_b
    assert {n.paired_by for n in diff.nodes} == {"structure"}
    assert all(n.name_b == f"v2/{n.name_a}" for n in diff.nodes), [(n.name_a, n.name_b) for n in diff.nodes]
    tensors = {t.name_a: t.name_b for t in diff.tensors}
    assert tensors["input"] == "x" and tensors["r1"] == "v2/r1_out" and tensors["logits"] == "v2/logits_out"
    assert [(o.name_a, o.name_b) for o in diff.outputs] == [("logits", "v2/logits_out")]
    # the same model, data and calibration: nothing changed
    assert {n.verdict for n in diff.nodes} <= {"same", "unscored"}
    deltas = [n.accumulated_sqnr_delta_db for n in diff.nodes]
    assert all(abs(d) < 1e-6 for d in deltas if not math.isnan(d))
    assert "model" in [s.setting for s in diff.settings]
    assert "conv2 -> v2/conv2" in stdout  # --wide: the name in A and in B
    assert "paired by graph structure" in stdout


def test_the_table_names_the_biggest_change_first(reports, tmp_path, capsys):
    """B = A with conv2 adding far more noise: it is the first row, worse, with its delta."""
    a, _, _ = reports
    data = json.loads(a.read_text())
    for node in data["nodes"]:
        if node["name"] == "conv2":
            old = node["added_noise_db"]
            node["added_noise_db"] = -5.0
            node["accumulated_sqnr_db"] = 5.0
    worse = tmp_path / "worse.json"
    worse.write_text(json.dumps(data))
    assert main(["diff", str(a), str(worse)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert "conv2" in rows[0] and "worse" in rows[0], rows
    assert f"{-5.0 - old:+.1f}" in rows[0]
    diff = diff_reports(a, worse)
    assert diff.nodes[0].name_b == "conv2" and diff.nodes[0].verdict == "worse"
    assert diff.counts()["worse"] >= 1


@pytest.mark.parametrize("bad", ["missing", "npz", "text", "proposal"])
def test_bad_input_is_one_line_and_exit_3(reports, tmp_path, capsys, bad):
    a, _, _ = reports
    path = tmp_path / f"{bad}.json"
    if bad == "npz":
        np.savez(tmp_path / "d.npz", x=np.zeros(3))
        path = tmp_path / "d.npz"
    elif bad == "text":
        path.write_text("not json at all\n")
    elif bad == "proposal":
        path.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "kind": "proposal"}))
    assert main(["diff", str(a), str(path)]) == ExitCode.INPUT
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("qdebug: error:") and "Traceback" not in err, err
    assert path.name in lines[0]


def test_an_output_over_an_input_is_refused(reports, capsys):
    a, b, _ = reports
    before = b.read_text()
    assert main(["diff", str(a), str(b), "--json", str(b)]) == ExitCode.USAGE
    assert "would overwrite" in capsys.readouterr().err
    assert main(["diff", str(a), str(b), "--markdown", str(a)]) == ExitCode.USAGE
    assert b.read_text() == before


# --------------------------------------------------------------------------- the pairing rule, on small graphs


def _report(spec, inputs=("x",), outputs=("y",), added=None) -> Report:
    """A report of nodes ``(name, original_name, op, inputs, outputs)``, in topological order."""
    added = added or {}
    depth = dict.fromkeys(inputs, 0)
    nodes, tensors = [], [TensorRecord(i, None, (), 0, None, None, None, None, None) for i in inputs]
    for name, original, op, ins, outs in spec:
        d = 1 + max((depth.get(t, 0) for t in ins), default=0)
        s = added.get(name, -30.0)
        nodes.append(NodeRecord(name, original, op, tuple(ins), tuple(outs), d, True, 40.0, -s, 0.0, 0.01,
                                added_noise_db=s))  # fmt: skip
        for o in outs:
            depth[o] = d
            tensors.append(TensorRecord(o, name, (), d, None, None, ErrorStats(40, 0, 1, 0, 0, 1),
                                        ErrorStats(-s, 0, 1, 0, 0, 1), None))  # fmt: skip
    info = ModelInfo("m.onnx", "0" * 64, 17, len(nodes), tuple(inputs), tuple(outputs))
    return Report(SCHEMA_VERSION, "0", "1.0", "", info, "", info, AnalysisConfig(), None, 1, tuple(nodes),
                  tuple(tensors), (), (), None, 0.0)  # fmt: skip


def test_generated_names_are_positions_not_names():
    """An Abs inserted first shifts the generated names: B's Relu_1 is A's Relu_0, not A's Relu_1."""
    a = _report([("Relu_0", "", "Relu", ["x"], ["t0"]), ("Relu_1", "", "Relu", ["t0"], ["y"])])
    b = _report(
        [
            ("Abs_0", "", "Abs", ["x"], ["u"]),
            ("Relu_1", "", "Relu", ["u"], ["t1"]),
            ("Relu_2", "", "Relu", ["t1"], ["y"]),
        ]
    )
    pairs = pair_nodes(a, b)
    assert pairs == {"Relu_2": ("Relu_1", "structure"), "Relu_1": ("Relu_0", "structure")}
    diff = compare(a, b)
    assert diff.only_in_b == ("Abs_0",) and not diff.only_in_a


def test_user_names_pair_first_and_ties_go_in_topological_order():
    """Two sibling Relus of one input: named ones by name whatever their order, unnamed ones first to first."""
    spec = [("r1", "r1", "Relu", ["x"], ["y1"]), ("r2", "r2", "Relu", ["x"], ["y2"])]
    a = _report(spec, outputs=("y1", "y2"))
    swapped = _report(list(reversed(spec)), outputs=("y2", "y1"))
    assert pair_nodes(a, swapped) == {"r1": ("r1", "name"), "r2": ("r2", "name")}
    b = _report([("b1", "", "Relu", ["x"], ["o1"]), ("b2", "", "Relu", ["x"], ["o2"])], outputs=("o1", "o2"))
    assert pair_nodes(a, b) == {"b1": ("r1", "structure"), "b2": ("r2", "structure")}
    assert pair_nodes(a, b) == pair_nodes(a, b)  # deterministic
    # generated names that did not move break the tie, whatever the order
    gen = [("Relu_0", "", "Relu", ["x"], ["y1"]), ("Relu_1", "", "Relu", ["x"], ["y2"])]
    shuffled = _report(list(reversed(gen)), outputs=("y2", "y1"))
    assert pair_nodes(_report(gen, outputs=("y1", "y2")), shuffled) == {
        "Relu_1": ("Relu_1", "structure"),
        "Relu_0": ("Relu_0", "structure"),
    }


def test_a_node_inserted_upstream_still_pairs_what_follows():
    """Depth shifts after an inserted node: the relaxed pass (no depth) and the consumer pass pair the rest."""
    a = _report([("c", "", "Conv", ["x"], ["t"]), ("r", "", "Relu", ["t"], ["u"]), ("s", "", "Sigmoid", ["u"], ["y"])])
    b = _report(
        [
            ("c2", "", "Conv", ["x"], ["t"]),
            ("m", "", "Mul", ["t"], ["t2"]),
            ("r2", "", "Relu", ["t2"], ["u"]),
            ("s2", "", "Sigmoid", ["u"], ["y"]),
        ]
    )
    assert pair_nodes(a, b) == {"c2": ("c", "structure"), "r2": ("r", "structure"), "s2": ("s", "structure")}


def test_unrelated_models_get_a_note_and_keep_exit_0(tmp_path, capsys):
    """Two different models paired one look-alike Gemm (``head/gemm -> fc``) without a word (issue 38)."""
    from qdebug.output.report_io import save_report

    cnn = _report([(n, n, op, [i], [o]) for n, op, i, o in (
        ("stem/conv", "Conv", "x", "c"), ("stem/relu", "Relu", "c", "r"), ("pool", "GlobalAveragePool", "r", "p"),
        ("head/gemm", "Gemm", "p", "y"))])  # fmt: skip
    mlp = _report([(n, n, op, [i], [o]) for n, op, i, o in (
        ("embed", "MatMul", "x", "e"), ("ln", "LayerNormalization", "e", "n"), ("act", "Softmax", "n", "s"),
        ("fc", "Gemm", "s", "y"))])  # fmt: skip
    diff = compare(cnn, mlp)
    assert [(n.name_a, n.name_b) for n in diff.nodes] == [("head/gemm", "fc")]
    assert diff.notes[0] == (
        "A and B look like different models: 1 of A's 4 nodes and B's 4 paired, so the pairs may be unrelated layers"
    )
    assert not any("different models" in n for n in compare(cnn, cnn).notes)  # the same model: no such note
    save_report(cnn, tmp_path / "a.json")
    save_report(mlp, tmp_path / "b.json")
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0  # diff documents no code for it
    assert "note: A and B look like different models" in capsys.readouterr().out


@pytest.mark.parametrize("columns", [80, 120])
def test_long_names_fold_and_keep_their_layer_index(columns, tmp_path, capsys, monkeypatch):
    """At 120 columns the table leaves the names 12 cells: ``layer0/attn/v_matmul`` became ``lay…v_matmul``,
    its layer index gone; names now fold over up to three lines, whole (issue 38)."""
    import sys

    from qdebug.cli.diff import print_diff

    spec = [(f"layer{i}/attn/{op}_matmul", "x", "MatMul", ["x"], [f"t{i}{op}"]) for i in range(2) for op in "qkv"]
    spec += [("layer1/ln2", "x", "LayerNormalization", ["t1v"], ["y"])]
    a = _report(spec, added={name: -30.0 - k for k, (name, *_) in enumerate(spec)})
    b = _report(spec, added={name: -20.5 - 2 * k for k, (name, *_) in enumerate(spec)})
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # the width of a terminal of that many columns
    print_diff(compare(a, b), top=0)
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("│")]
    assert all(len(line) <= columns for line in table)
    column = "".join(line.split("│")[1].strip() for line in table)
    assert "…" not in column, out
    for name, *_ in spec:
        assert name in column, (name, out)
    assert "│ layer0/attn/" in out  # folded after a separator, not inside a component


def test_verdict_and_ranking():
    assert verdict(0.05, math.nan) == "same"
    assert verdict(1.0, -5.0) == "worse" and verdict(-1.0, 5.0) == "better"
    assert verdict(math.nan, 2.0) == "better" and verdict(math.nan, math.nan) == "unscored"
    spec = [("a", "a", "Relu", ["x"], ["t"]), ("b", "b", "Relu", ["t"], ["y"])]
    # a: -100 -> -90 dB (10 dB, negligible noise); b: -10 -> -9 dB (1 dB of noise that matters)
    diff = compare(_report(spec, added={"a": -100.0, "b": -10.0}), _report(spec, added={"a": -90.0, "b": -9.0}))
    assert [n.name_b for n in diff.nodes] == ["b", "a"]
    assert diff.nodes[0].added_noise_delta_db == pytest.approx(1.0) and diff.nodes[0].verdict == "worse"
    assert strict_json(dumps(diff))["nodes"][0]["name_b"] == "b"


def test_analyze_with_several_methods_writes_one_report_each_and_names_the_best_per_tensor(
    tmp_path, capsys, monkeypatch
):
    """``analyze --method minmax,percentile,entropy`` (issue 19): a report per method next to ``-o``, the
    comparison table on stdout (the best report per tensor by its own local SQNR, checked against the
    reports' numbers), ``qdebug diff`` of the three reports giving the same file, and the note that ORT's
    entropy calibration with quantize_static's settings is minmax under another name."""
    from qdebug.diff import compare_reports
    from qdebug.records.diff import Comparison

    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    model = small_cnn(tmp_path / "m.onnx", unnamed=False)
    data = small_data(tmp_path / "c.npz")
    md = tmp_path / "methods.md"
    argv = ["analyze", str(model), "--calib", str(data), "-o", str(tmp_path / "r.json"), "-q",
            "--method", "minmax,percentile,entropy", "--fakequant-samples", "0", "--markdown", str(md)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    paths = [tmp_path / f"r.{m}.json" for m in ("minmax", "percentile", "entropy")]
    assert all(p.is_file() for p in paths) and not (tmp_path / "r.json").exists()
    reports = [load_report(p) for p in paths]
    assert [r.config.method for r in reports] == ["minmax", "percentile", "entropy"]
    comparison = compare_reports(paths)
    assert comparison.labels == ("minmax", "percentile", "entropy")
    assert sum(comparison.wins) <= len(comparison.tensors) > 0
    for row in comparison.tensors:
        local = [r.tensor(row.name).local.sqnr_db for r in reports]
        assert row.local_sqnr_db == tuple(local)
        assert local[row.best] == max(v for v in local if not math.isnan(v))
    assert "minmax: " in stdout and "best on" in stdout and "biggest margin first" in stdout
    entropy_notes = [n for n in reports[2].notes if "searched no clipping threshold" in n]
    assert entropy_notes and not any("searched no clipping" in n for n in reports[0].notes)
    # entropy's ranges are minmax's: every tensor's local SQNR is the same in both
    same = [r.local_sqnr_db[0] == r.local_sqnr_db[2] or math.isnan(r.local_sqnr_db[0]) for r in comparison.tensors]
    assert all(same)
    assert md.read_text().startswith("## qdebug diff: `minmax` vs `percentile` vs `entropy`")
    out = tmp_path / "cmp.json"
    assert main(["diff", *map(str, paths), "--json", str(out)]) == 0
    written = strict_json(out.read_text())
    assert written["kind"] == "comparison" and written["wins"] == list(comparison.wins)
    from qdebug.output.report_io import load_record

    assert isinstance(load_record(Comparison, out, "comparison", DIFF_SCHEMA_VERSION), Comparison)


# --------------------------------------------------------------------------- ties and negligible changes


def _locals(values: dict[str, float], method: str) -> Report:
    """A three-node chain whose tensors have the given local SQNR (others 40 dB), calibrated by ``method``."""
    import dataclasses

    spec = [("a", "a", "Relu", ["x"], ["t"]), ("b", "b", "Relu", ["t"], ["u"]), ("c", "c", "Relu", ["u"], ["y"])]
    r = _report(spec)
    tensors = tuple(
        dataclasses.replace(t, local=dataclasses.replace(t.local, sqnr_db=values[t.name]))
        if t.name in values else t
        for t in r.tensors
    )
    return dataclasses.replace(r, tensors=tensors, config=dataclasses.replace(r.config, method=method))


def test_a_margin_under_same_db_is_a_tie_and_joint_leaders_both_win():
    """The demo's three methods: percentile "best on 67 of 71" though only 4 tensors had a margin of 0.1 dB,
    and minmax "best on 0" though it and entropy (tied) beat percentile by 0.72 dB on the input. A margin of
    at most SAME_DB is a tie (counted as such), and reports tied at the top above the others all win."""
    from qdebug.diff import SAME_DB, compare_many
    from qdebug.records.diff import comparison_header, comparison_rows

    assert SAME_DB == 0.1
    minmax = _locals({"t": 40.05, "u": 56.5, "y": 38.3}, "minmax")
    entropy = _locals({"t": 40.02, "u": 56.5, "y": 38.3}, "entropy")
    percentile = _locals({"t": 40.0, "u": 55.78, "y": 38.6}, "percentile")
    c = compare_many([minmax, entropy, percentile], ["r.minmax.json", "r.entropy.json", "r.percentile.json"])
    by = {t.name: t for t in c.tensors}
    assert by["t"].tied(3) and by["t"].leaders == (0, 1, 2) and by["t"].margin_db == pytest.approx(0.03)
    assert by["u"].leaders == (0, 1) and by["u"].margin_db == pytest.approx(0.72) and not by["u"].tied(3)
    assert by["y"].leaders == (2,) and by["y"].best == 2 and by["y"].margin_db == pytest.approx(0.3)
    assert c.wins == (1, 1, 1) and c.shared == (1, 1, 0) and c.ties == 1
    assert [t.name for t in c.tensors][-1] == "t"  # ties last
    header = comparison_header(c)
    assert header[0] == "minmax: best on 1 of 3 tensors, 1 of them shared (r.minmax.json)"
    assert header[2] == "percentile: best on 1 of 3 tensors (r.percentile.json)"
    assert header[3] == "tied on 1 of 3 tensors (every local SQNR within 0.1 dB of the best)"
    rows = {r[0]: r[1] for r in comparison_rows(c, 0)}
    assert rows == {"u": "minmax, entropy", "y": "percentile", "t": "tied"}
    # exact in two (inf and inf tie), 50 dB in the third: both exact ones lead
    exact = compare_many([_locals({"u": math.inf}, "minmax"), _locals({"u": math.inf}, "entropy"),
                          _locals({"u": 50.0}, "percentile")], ["1", "2", "3"])  # fmt: skip
    assert {t.name: t for t in exact.tensors}["u"].leaders == (0, 1)


def test_an_older_comparison_file_still_reads(tmp_path):
    """Files written before ``leaders``/``ties``/``shared``: they read, a 0 margin is a tie, a win its best's."""
    from qdebug.diff import compare_many
    from qdebug.output.report_io import load_record
    from qdebug.records.diff import Comparison, comparison_header, comparison_rows

    c = compare_many([_locals({"y": 41.0}, "minmax"), _locals({}, "entropy"), _locals({}, "percentile")],
                     ["1", "2", "3"])  # fmt: skip
    data = strict_json(dumps(c))
    del data["ties"], data["shared"]
    for t in data["tensors"]:
        del t["leaders"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_record(Comparison, tmp_path / "old.json", "comparison", DIFF_SCHEMA_VERSION)
    assert old.ties == 0 and old.shared == () and old.wins == c.wins
    assert {r[0]: r[1] for r in comparison_rows(old, 0)}["y"] == "minmax"
    assert comparison_header(old)[0] == "minmax: best on 1 of 3 tensors (1)"


def test_changes_between_negligible_noise_levels_are_the_same():
    """The demo's diff called layer0/attn/scale_mul "worse" for added noise -inf -> -155.6 dB (float rounding;
    ΔAdd +inf in the TUI) and gelu_div (-80.6 -> -82.5) "better". Below -60 dB both sides are negligible."""
    from qdebug.records.diff import NEGLIGIBLE_NOISE_DB

    assert NEGLIGIBLE_NOISE_DB == -60.0
    assert verdict(math.inf, 0.0, (-math.inf, -155.6)) == "same"
    assert verdict(-math.inf, 0.0, (-152.1, -math.inf)) == "same"
    assert verdict(-1.9, 0.0, (-80.6, -82.5)) == "same"
    assert verdict(math.inf, 0.0, (-math.inf, -40.0)) == "worse"  # exact to INT8 noise: a real change
    assert verdict(2.3, 0.0, (-60.7, -58.4)) == "worse"  # one side above the floor
    assert verdict(math.nan, -5.0, None, (130.0, 125.0)) == "same"  # SQNRs above 60 dB: the same line
    assert verdict(math.nan, -5.0, None, (45.0, 40.0)) == "worse"
    spec = [("a", "a", "Relu", ["x"], ["t"]), ("b", "b", "Relu", ["t"], ["y"])]
    diff = compare(_report(spec, added={"a": -math.inf, "b": -30.0}), _report(spec, added={"a": -155.6, "b": -31.0}))
    by = {n.name_b: (n, cells) for n, cells in diff.table_rows()}
    assert by["a"][0].verdict == "same" and by["a"][1][2] == "~0"  # the Δ cell, not +inf
    assert by["a"][0].added_noise_delta_db == math.inf  # the record keeps the number
    assert by["b"][0].verdict == "better" and by["b"][1][2] == "-1.0"
    assert diff.counts() == {"worse": 0, "better": 1, "same": 1, "unscored": 0}


def test_a_small_output_delta_keeps_its_sign():
    """``output logits: SQNR A 5.4 dB, B 5.3 dB (0.0)`` hid a delta of -0.04."""
    from qdebug.records.diff import fmt_delta

    assert fmt_delta(-0.04, fine=True) == "-0.04" and fmt_delta(0.004, fine=True) == "+0.004"
    assert fmt_delta(0.0, fine=True) == "0.0" and fmt_delta(-0.04) == "0.0" and fmt_delta(1.26, fine=True) == "+1.3"
    spec = [("a", "a", "Relu", ["x"], ["y"])]
    diff = compare(_report(spec), _report(spec))
    diff = type(diff)(**{**diff.__dict__, "outputs": (OutputChange("y", "y", 5.41, 5.37, 5.37 - 5.41),)})
    assert "output y: SQNR A 5.4 dB, B 5.4 dB (-0.04)" in diff.header_lines()
