"""The verified frontier propose writes (issue 15 item 5): every point is a model built, scored and timed
alike, and the one-line verdict says when the answer gives the INT8 speed-up back."""

from __future__ import annotations

import json

from qdebug.cli.main import main
from qdebug.propose.frontier import speed_verdict
from qdebug.records import FrontierPoint
from tests.conftest import analyze_then_propose


def _point(label: str, p50: float, met: bool = True, metric: float = 0.9, spread: float = 0.02) -> FrontierPoint:
    return FrontierPoint(label, label, 0, metric, 30.0, met, p50, p50 * (1 + spread))


def test_a_proposal_slower_than_fp32_while_static_is_faster_gives_the_speed_up_back():
    points = [_point("fp32", 10.0), _point("static", 6.0, met=False), _point("proposal", 12.0),
              _point("dynamic", 8.0)]  # fmt: skip
    lines, slow = speed_verdict(points)
    assert slow and "slower than FP32" in lines[0] and "dynamic (dynamic) meets the target at 8 ms" in lines[0]


def test_with_nothing_faster_that_meets_the_target_the_best_option_is_a_looser_target_or_fp32():
    points = [_point("fp32", 10.0), _point("static", 6.0, met=False, metric=0.5), _point("proposal", 12.0),
              _point("smaller", 7.0, met=False, metric=0.8)]  # fmt: skip
    lines, slow = speed_verdict(points)
    assert slow and "a looser target: smaller (smaller) reaches 0.8 at 7 ms" in lines[0]
    lines, slow = speed_verdict([_point("fp32", 10.0), _point("static", 6.0, met=False), _point("proposal", 12.0)])
    assert slow and "a looser target: static (static) reaches 0.9 at 6 ms" in lines[0]  # full INT8's own numbers


def test_timing_noise_is_not_a_verdict():
    # the proposal's median inside FP32's spread: not slower; static inside it too: no speed to give back
    points = [_point("fp32", 10.0, spread=0.1), _point("static", 6.0, met=False), _point("proposal", 10.5)]
    lines, slow = speed_verdict(points)
    assert not slow and lines == []
    lines, slow = speed_verdict([_point("fp32", 10.0), _point("static", 9.9), _point("proposal", 12.0)])
    assert not slow and "not faster than FP32 here beyond the timing noise" in lines[0]


def test_a_faster_alternative_that_also_meets_the_target_is_named():
    points = [_point("fp32", 10.0), _point("static", 6.0, met=False), _point("proposal", 9.0),
              _point("dynamic", 5.0)]  # fmt: skip
    lines, slow = speed_verdict(points)
    assert not slow and lines == ["dynamic (dynamic) also meets the target and is faster than the proposal "
                                  "(p50 5 vs 9 ms, FP32 10 ms)"]  # fmt: skip
    # a point that keeps every quantizable node FP32 quantizes nothing: the FP32 model is no option to name
    every = FrontierPoint("larger", "11 nodes FP32", 11, 0.9, 30.0, True, 5.0, 5.1)
    assert speed_verdict([*points[:3], every], quantizable=11) == ([], False)
    assert speed_verdict([*points[:3], every], quantizable=12)[0][0].startswith("larger (11 nodes FP32) also")


def test_the_proposal_file_carries_the_measured_frontier(tmp_path, cnn):
    model, calib = cnn
    raw = analyze_then_propose(model, calib, tmp_path)
    labels = [p["label"] for p in raw["frontier"]]
    # the CNN's BatchNormalization nodes are folded (ORT's documented pre-processing): that recipe's full
    # static INT8 is the answer's base, named between static (the user's model's) and the proposal
    assert labels[:4] == ["fp32", "static", "recipe fold-bn", "proposal"] and "dynamic" in labels
    # and full static INT8 of its weighted ops only (its Add, Relu, pools stay float): the --op-types point
    (op_point,) = [p for p in raw["frontier"] if p["label"].startswith("static --op-types ")]
    assert op_point["label"] == "static --op-types Conv,Gemm" and op_point["changed"].endswith("only")
    by = {p["label"]: p for p in raw["frontier"]}
    assert by["proposal"]["metric"] == raw["expected_metric"] and by["static"]["metric"] == raw["static_metric"]
    assert all(p["p50_ms"] > 0 and p["p95_ms"] >= p["p50_ms"] for p in raw["frontier"])
    assert by["fp32"]["output_sqnr_db"] == "inf" and by["fp32"]["met"] is True  # the reference itself
    # timed together in interleaved rounds: every point's round medians pair with FP32's (the ratio's spread)
    rounds = {len(p["rounds_ms"]) for p in raw["frontier"]}
    assert len(rounds) == 1 and rounds.pop() >= 2


def test_time_runs_0_writes_no_frontier(tmp_path, cnn):
    model, calib = cnn
    report = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(report), "-q"]) == 0
    out = tmp_path / "p.json"
    assert main(["propose", str(report), "-o", str(out), "-q", "--time-runs", "0"]) in (0, 6)
    assert json.loads(out.read_text())["frontier"] == []


def test_a_missed_target_names_what_each_measured_alternative_reaches():
    from qdebug.propose.frontier import missed_verdict

    points = [_point("fp32", 10.0), _point("static", 6.0, met=False, metric=0.5), _point("proposal", 9.0, False),
              _point("dynamic", 8.0, met=False, metric=0.7)]  # fmt: skip
    line = missed_verdict(points)
    assert line.startswith("no configuration found meets the target; measured: dynamic (dynamic) 0.7 at 8 ms;")
    assert "static (static) 0.5 at 6 ms" in line and "keep the model FP32" in line


def test_a_missed_target_without_fp32_allowed_says_to_allow_it_and_formats_the_metric():
    """``--allow calib-flipped`` alone misses: the advice had been "the error may be spread over the whole model",
    and the numbers raw fractions (0.98) where every other line prints 98.00%."""
    from qdebug.propose.frontier import missed_verdict

    points = [_point("fp32", 10.0), _point("static", 6.0, met=False, metric=0.834), _point("proposal", 9.0, False),
              _point("dynamic", 8.0, met=True, metric=0.98)]  # fmt: skip
    line = missed_verdict(points, ("calib-flipped",), "top1")
    assert "dynamic (dynamic) 98.00% meets it at 8 ms" in line and "static (static) 83.40%" in line
    assert "add fp32 (e.g. --allow fp32,calib-flipped)" in line and "spread over the whole model" not in line
    assert "--allow fp32,int16" not in missed_verdict(points, ("fp32", "int16"), "top1")


def test_where_static_does_not_pay_a_faster_weighted_ops_only_point_is_named_with_its_flag():
    points = [_point("fp32", 10.0), _point("static", 11.0), _point("proposal", 11.0),
              _point("static --op-types Conv,MatMul", 6.0, met=False)]  # fmt: skip
    lines, slow = speed_verdict(points)
    assert not slow and "--op-types Conv,MatMul keeps the speed-up" in lines[0] and "6 ms" in lines[0]
    points[-1] = _point("static --op-types Conv,MatMul", 10.5, met=False)  # not faster: the plain verdict
    assert "not faster than FP32 here beyond the timing noise" in speed_verdict(points)[0][0]


def test_where_static_does_not_pay_the_verdict_says_what_this_machines_integer_kernels_are(monkeypatch):
    """The cause named is the kernels' own answer (the probe), not generic advice: no VNNI where the u8s8
    kernels saturate, else the Q/DQ and float kernels around the integer ones."""
    from qdebug.propose import frontier

    points = [_point("fp32", 10.0), _point("static", 10.0), _point("proposal", 10.0)]
    for saturates, said in ((True, "have no VNNI"), (False, "runs VNNI integer kernels")):
        monkeypatch.setattr(frontier, "u8s8_saturates", lambda s=saturates: s)
        (line,) = speed_verdict(points)[0]
        assert said in line and "judged on accuracy alone" in line
