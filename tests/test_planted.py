"""propose against planted culprits (issue 15): on generated models whose minimal fix is known, the answer
is no larger than the planted set, and where no small set exists it says so."""

from __future__ import annotations

import json

import pytest

from qdebug.cli.main import main
from qdebug.errors import ExitCode
from tests.conftest import planted as _planted


def _analyze_and_propose(kind: str, tmp_path, *extra: str):
    rec = _planted().make(kind, tmp_path / kind, "small")
    report, proposal = tmp_path / "r.json", tmp_path / "p.json"
    args = ["analyze", rec.model, "--calib", rec.calib, "--eval", rec.eval, "--metric", rec.metric]
    assert main([*args, "-o", str(report), "-q"]) == 0
    code = main(["propose", str(report), "--target-drop", str(rec.target_drop), "-o", str(proposal), "-q", *extra])
    return rec, code, json.loads(proposal.read_text())


def _changed_units(p: dict) -> int:
    """Nodes kept FP32 plus units fixed another way (one reason each)."""
    fixed = {r["node"] for r in p["reasons"] if r["action"] not in ("fp32", "per-channel")}
    return len(p["nodes_to_exclude"]) + len(fixed)


@pytest.mark.parametrize("kind", ["detector_concat", "outlier_residual", "decomposed_layernorm", "two_culprits"])
def test_the_answer_is_no_larger_than_the_planted_culprits(kind, tmp_path):
    # the per-node search's answer: with recipes, quantize_dynamic (which meets on some kinds) may be taken where
    # a timed comparison finds it faster on this machine
    rec, code, p = _analyze_and_propose(kind, tmp_path, "--recipes", "none")
    assert code == 0, p["reasons"]
    assert _changed_units(p) <= len(rec.culprits), (p["nodes_to_exclude"], rec.culprits)
    if p["nodes_to_exclude"] and not p["tensor_overrides"]:
        assert set(p["nodes_to_exclude"]) <= set(rec.culprits)  # found exactly them, not neighbours
    points = rec.metric in ("top1", "top1_agreement")  # qdebug counts their drops in points
    assert p["expected_metric"] >= p["fp32_metric"] - rec.target_drop / (100 if points else 1) - 1e-9


def test_where_no_small_set_exists_propose_says_so_and_exits_6(tmp_path, capsys):
    rec, code, p = _analyze_and_propose("no_small_set", tmp_path)
    assert not rec.small_set_exists
    assert code == ExitCode.TARGET_NOT_MET
    err = capsys.readouterr().err
    assert "target not met" in err or "most of the INT8 speed-up is gone" in err
