"""The 'strict JSON' checks used json.loads, which accepts NaN/Infinity/-Infinity literals, so they passed
even when dumps wrote them (tests/test_tui.py::test_report_json_is_strict, test_analyze.py's
test_report_is_strict_versioned_json, test_propose.py's "strict JSON" line)."""

from __future__ import annotations

import math

from qdebug.cli.main import main
from qdebug.output.report_io import dumps
from tests.conftest import strict_json
from tests.tui_report import make_report


def test_report_json_is_strict_and_keeps_nonfinite_values_as_strings():
    report = make_report()
    assert any(math.isinf(n.added_noise_db) for n in report.nodes), "precondition: the report has -inf"
    raw = strict_json(dumps(report))
    by_name = {n["name"]: n for n in raw["nodes"]}
    assert by_name["layer0/ln1"]["added_noise_db"] == "-inf"


def test_analyze_writes_strict_json(cnn, tmp_path):
    model, calib = cnn
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 0
    raw = strict_json(out.read_text())
    conv1 = next(n for n in raw["nodes"] if n["name"] == "conv1")
    assert conv1["introduced_db"] == "nan"  # conv1's output has no counterpart (Relu folded)
