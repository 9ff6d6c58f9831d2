"""Node names in tables: the common prefix dropped, the middle elided, rows kept distinct (issue 16 item 3).

Exported names are long paths that share their start (``jax2tf_get_logits_/pjit_get_logits_/...``,
``/bert/encoder/layer.5/...``); cut from the end, every row of a table read the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from qdebug.output.formatting import (
    MIN_NAME_WIDTH,
    cells,
    common_prefix,
    distinct_shortened,
    prefix_note,
    shorten,
    table_names,
)

JAX = "jax2tf_get_logits_/pjit_get_logits_/ByteClassifier/"
BERT = [
    f"/bert/encoder/layer.{i}/{part}"
    for i in (5, 11)
    for part in (
        "attention/self/query/MatMul",
        "attention/self/key/MatMul",
        "attention/output/dense/MatMul",
        "output/dense/MatMul",
        "output/LayerNorm/Add_1",
    )
]

# =========================================================================== helpers


def test_prefix_ends_on_a_separator_only():
    assert common_prefix([JAX + "Dense_0/einsum/Einsum", JAX + "Dense_1/einsum/Einsum"]) == JAX
    assert common_prefix(["model.conv1", "model.conv10"]) == "model."  # not "model.conv1"
    assert common_prefix(["scope:conv_a", "scope:conv_b"]) == "scope:"
    assert common_prefix(BERT) == "/bert/encoder/layer."
    assert common_prefix(["block_1_conv", "block_1_relu"]) == ""  # '_' is part of a word


def test_no_common_prefix():
    assert common_prefix(["conv1/Conv", "fc/Gemm"]) == ""
    assert common_prefix(["/conv1/Conv", "/fc/Gemm"]) == ""  # a lone leading '/' is no prefix
    assert common_prefix([]) == ""


def test_a_single_name():
    assert common_prefix(["a/b/Conv"]) == "a/b/"
    assert table_names(["a/b/Conv"], 20) == ("", ["a/b/Conv"])  # it fits: shown whole
    prefix, shown = table_names([JAX + "Dense_0/einsum/Einsum"], 20)  # too long: its whole scope is common
    assert (prefix, shown) == (JAX + "Dense_0/einsum/", ["Einsum"])


def test_names_equal_to_the_prefix_are_not_emptied():
    assert common_prefix(["a/b/", "a/b/c"]) == "a/"
    assert common_prefix(["a/", "a/b"]) == ""
    assert common_prefix(["x/y", "x/y"]) == "x/"
    prefix, shown = table_names(["a/b/", "a/b/" + "c" * 30], 12)
    assert prefix == "a/" and shown[0] == "b/" and all(shown)


def test_shorten_elides_the_middle_by_cells():
    assert shorten("abcdef", 3) == "a…f" and shorten("abc", 3) == "abc"
    assert shorten("layer1/attn/qk_matmul", 16) == "layer1/…k_matmul"
    cut = shorten("層正規化/注意/出力テンソル名前", 11)
    assert cut.startswith("層") and cut.endswith("名前") and cells(cut) <= 11


def test_all_names_that_fit_are_shown_whole():
    names = ["conv1", "relu1", "fc"]
    assert table_names(names, 10) == ("", names)


@pytest.mark.parametrize("width", [MIN_NAME_WIDTH, 16, 20, 30, 40])
def test_distinct_names_stay_distinct(width):
    jax = [f"{JAX}Dense_{i}/{op}" for i in range(12) for op in ("einsum/Einsum", "add", "relu/Relu")]
    layers = [f"layer{i}/attn/{p}" for i in range(3) for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    middle = [f"start/{'x' * 30}{c}{'y' * 30}/end" for c in "ABC"]  # differ deep in the middle only
    for names in (jax, BERT, layers, middle):
        prefix, shown = table_names(names, width)
        assert len(set(shown)) == len(names), (width, shown)
        assert all(cells(s) <= width for s in shown)
        assert all(n.startswith(prefix) for n in names)
    assert distinct_shortened(["abcdef", "abcdef"], 3) == ["a…f", "a…f"]  # equal names stay equal


def test_the_example_of_the_issue():
    names = [f"{JAX}Dense_{i}/einsum/Einsum" for i in range(10)]
    prefix, shown = table_names(names, 24)
    assert prefix == JAX
    assert shown == [f"Dense_{i}/einsum/Einsum" for i in range(10)]
    assert JAX in prefix_note(prefix) and "--wide" in prefix_note(prefix)


# =========================================================================== end to end


def _dense_model(path: Path, layers: int = 4, seed: int = 0) -> Path:
    """A jax2tf-like MLP: every node under one long scope, ``.../Dense_<i>/{einsum/Einsum,add,relu/Relu}``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "input"
    for i in range(layers):
        scope = f"{JAX}Dense_{i}/"
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.4, (8, 8)).astype(np.float32), f"w{i}"),
            numpy_helper.from_array(rng.normal(0, 0.1, (8,)).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=scope + "einsum/Einsum"),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"], name=scope + "add"),
            helper.make_node("Relu", [f"add{i}"], [f"h{i}"], name=scope + "relu/Relu"),
        ]
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "byte_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _table_names(out: str) -> list[str]:
    """The first cell of each body row of the worst-nodes table."""
    rows = [line for line in out.splitlines() if line.startswith("│")]
    return [row.split("│")[1].strip() for row in rows if row.split("│")[1].strip() not in ("node", "")]


def test_analyze_summary_keeps_names_distinct(tmp_path, capsys):
    from qdebug.cli.main import main

    model = _dense_model(tmp_path / "model.onnx", layers=6)
    calib = tmp_path / "calib.npz"
    np.savez(calib, input=np.random.default_rng(1).normal(0, 1, (32, 8)).astype(np.float32))
    args = ["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "r.json"), "-q"]
    assert main(args) == 0
    out = capsys.readouterr().out
    shown = _table_names(out)
    assert len(shown) >= 6 and len(set(shown)) == len(shown), out  # the issue: rows of "jax2tf_get_logits_/pji…"
    assert f"under {JAX}" in out  # the dropped prefix is said once, above the table
    assert all(re.fullmatch(r"Dense_\d/(einsum/Einsum|add|relu/Relu)", s) for s in shown), shown

    assert main([*args, "--wide"]) == 0
    wide = capsys.readouterr().out
    full = _table_names(wide)
    assert len(full) == len(shown) and all(s.startswith(JAX) for s in full), wide
    assert "names below are under" not in wide


def _console(width: int = 100):
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), width=width, highlight=False, markup=False)


def test_propose_table_keeps_names_distinct_and_wide_keeps_them_whole():
    from types import SimpleNamespace

    from qdebug.cli.propose import _reasons_table

    reasons = [
        SimpleNamespace(
            node=f"{JAX}Dense_{i}/einsum/Einsum",
            op_type="MatMul",
            action="fp32",
            introduced_db=3.0 - i,
            region=i,
            reason="introduces 3.0 dB; more",
        )
        for i in range(4)
    ]
    console = _console()
    _reasons_table(console, reasons, wide=False)
    out = console.file.getvalue()
    shown = _table_names(out)
    assert shown == [f"Dense_{i}/einsum/Einsum" for i in range(4)] and f"under {JAX}" in out, out
    console = _console()
    _reasons_table(console, reasons, wide=True)
    assert _table_names(console.file.getvalue()) == [r.node for r in reasons]


def test_bench_worst_layers_drop_the_common_prefix():
    from types import SimpleNamespace

    from qdebug.cli.bench import _print_worst_layers

    worst = tuple(
        SimpleNamespace(node=f"{JAX}Dense_{i}/einsum/Einsum", op_type="MatMul", added_noise_db=-30.0 - i)
        for i in range(3)
    )
    report = SimpleNamespace(
        variants=[SimpleNamespace(name="dynamic", worst_layers=worst, layer_report="dyn.json")]
    )
    console = _console(200)
    _print_worst_layers(console, report)
    out = console.file.getvalue()
    assert f"under {JAX}" in out and "results JSON" in out
    assert "dynamic: worst layers Dense_0/einsum/Einsum (MatMul" in out and out.count(JAX) == 1


def test_tui_name_column_drops_the_prefix_only_when_names_do_not_fit():
    import dataclasses

    from qdebug.tui.model import COLUMNS, LayerModel, table_layout
    from qdebug.tui.widgets import _header
    from tests.tui_report import make_report

    report = make_report()
    nodes = tuple(dataclasses.replace(n, name=JAX + n.name) for n in report.nodes)
    natural = table_layout(nodes)
    assert natural.prefix == "" and natural.name(nodes[0].name) == nodes[0].name  # room: full names
    narrow = table_layout(nodes, natural.total - 1)
    assert narrow.prefix == JAX and not narrow.short_ops  # dropping the scope was enough
    assert [narrow.name(n.name) for n in nodes] == [n.name[len(JAX) :] for n in nodes]
    tight = table_layout(nodes, natural.total - 60)
    shown = [tight.name(n.name) for n in nodes]
    assert len(set(shown)) == len(nodes) and all(cells(s) < tight.widths["name"] for s in shown)
    model = LayerModel(dataclasses.replace(report, nodes=nodes))
    header = _header(model, next(c for c in COLUMNS if c.key == "name"), narrow).plain
    assert header.startswith("Node") and "jax2tf" in header and header.endswith("/")
    assert cells(header) < narrow.widths["name"]
