"""NodeRecord.kl is the largest *accumulated* KL over the node's outputs (commit bb00760): nothing checked it on
a real report, so taking the local KL (0 everywhere with level-aligned bins) or the smallest output's KL passed."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.output.report_io import load_report
from tests.models import save_graph


def _split_model(path: Path) -> Path:
    """MatMul -> Split into a narrow and a wide half -> two MatMul heads: Split has two outputs whose
    accumulated KLs differ."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.5, (8, 8)).astype(np.float32)
    w1[:, 4:] *= 20.0  # the second half spans a much wider range than the first
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(np.array([4, 4], np.int64), "split"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "wa"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "wb"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Split", ["h", "split"], ["ha", "hb"], name="split", axis=1),
        helper.make_node("MatMul", ["ha", "wa"], ["ya"], name="head_a"),
        helper.make_node("MatMul", ["hb", "wb"], ["yb"], name="head_b"),
    ]
    graph = helper.make_graph(
        nodes,
        "split_heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [
            helper.make_tensor_value_info("ya", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("yb", TensorProto.FLOAT, ["N", 3]),
        ],
        inits,
    )
    return save_graph(graph, path, opsets={"": 13})


def test_node_kl_is_the_largest_accumulated_kl_of_its_outputs(cnn, tmp_path):
    model, calib = cnn
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    checked = 0
    for node in report.nodes:
        kls = [
            t.accumulated.kl
            for t in (report.tensor(o) for o in node.outputs if o)
            if t is not None and t.accumulated is not None and not math.isnan(t.accumulated.kl)
        ]
        if not kls:
            assert math.isnan(node.kl), node.name
            continue
        assert node.kl == max(kls), node.name
        checked += 1
    assert checked >= 5
    # the KL column is not 0 everywhere (as the local, level-binned KL would make it)
    assert max(n.kl for n in report.nodes if not math.isnan(n.kl)) > 0.05


def test_multi_output_node_kl_takes_the_worst_output(tmp_path):
    model = _split_model(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (32, 8)).astype(np.float32))
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    split = report.node("split")
    kls = [report.tensor(o).accumulated.kl for o in ("ha", "hb")]
    assert all(math.isfinite(k) for k in kls) and kls[0] != kls[1], f"precondition: outputs' KLs differ {kls}"
    assert split.kl == max(kls)


def test_a_folded_activation_is_judged_against_its_producers_inputs(cnn, tmp_path):
    """ORT folds Relu into the Add's output Q/DQ, so `add` has no counterpart; the Relu's input SQNR must come
    from upstream (bn2, r1), not count as exact (120 dB), or the Relu "introduces" ~85 dB and tops the ranking."""
    model, calib = cnn
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.tensor("add").accumulated is None, "precondition: ORT folded the Relu after res_add"
    relu = next(n for n in report.nodes if n.inputs == ("add",))
    acc = {name: report.tensor(name).accumulated.sqnr_db for name in ("bn2", "r1", "r2")}
    expected = min(acc["bn2"], acc["r1"]) - acc["r2"]  # noise-to-signal at the output minus at the worst input
    assert relu.introduced_db == pytest.approx(expected, abs=1e-6)
    assert relu.introduced_db < 10
