"""`qdebug verify`: side-by-side FP32 / static / selective, exit codes for CI, bad inputs, the TUI adapter."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from qdebug.cli.main import main
from qdebug.cli.tui import make_tui_verify
from qdebug.errors import ExitCode
from qdebug.graph.load import load_model
from qdebug.output.report_io import dumps, load_report
from qdebug.propose import ProposeOptions, propose
from qdebug.records import SCHEMA_VERSION, Proposal, TensorOverride
from qdebug.runtime.capture import SessionConfig
from qdebug.verify import VerifyOptions, judge, time_sessions, verify
from tests.conftest import analyze_then_propose, fixture_path, qdq_scales


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, calib, eval, report, proposal path): analyze + propose once for the module."""
    tmp = tmp_path_factory.mktemp("verify")
    model = fixture_path("transformer", "model.onnx")
    calib = fixture_path("transformer", "calib.npz")
    evaluation = fixture_path("transformer", "eval.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qdebug-cache"))
        assert (
            main(
                [
                    "analyze",
                    str(model),
                    "--calib",
                    str(calib),
                    "--eval",
                    str(evaluation),
                    "-o",
                    str(tmp / "report.json"),
                    "-q",
                ]
            )
            == 0
        )
        report = load_report(tmp / "report.json")
        # 3% of the loss, in points: a proposal verify's 95% interval then passes on either kind of x86 kernel
        # (with 10%, the 3-node answer recovered 91.7% [83.5%, 100%] without VNNI: undecided)
        drop = 3 * (report.task.fp32 - report.task.quantized)
        # the per-node answer (not a recipe a timed comparison may pick on this machine): verify's subject
        options = ProposeOptions(target_drop=drop, recipes=())
        result = propose(report, output=tmp / "proposal.json", options=options)
    assert result.met
    return model, calib, evaluation, report, tmp / "proposal.json"


def _write(proposal: Proposal, path) -> str:
    path.write_text(dumps(proposal))
    return str(path)


def _args(setup, proposal, *extra):
    model, calib, evaluation, _, _ = setup
    return [
        "verify",
        str(model),
        "--calib",
        str(calib),
        "--eval",
        str(evaluation),
        "--proposal",
        str(proposal),
        "-q",
        *extra,
    ]


def test_verify_met_exits_0_with_side_by_side_report(setup, tmp_path, capsys):
    model, _, _, _, proposal_path = setup
    out = tmp_path / "verify.json"
    assert main(_args(setup, proposal_path, "--runs", "10", "-o", str(out))) == 0
    stdout = capsys.readouterr().out
    assert "fp32" in stdout and "selective" in stdout and "PASS" in stdout
    raw = json.loads(out.read_text())
    assert raw["kind"] == "verify" and raw["met"] is True
    # the verdict line says what the recovery costs in speed (issue 15: where CI reads it)
    assert "; selective p50 " in raw["verdict"] and "(FP32 " in raw["verdict"] and "static " in raw["verdict"]
    v = {x["name"]: x for x in raw["variants"]}
    assert set(v) == {"fp32", "static", "selective"}
    assert raw["recovered_fraction"] >= 0.9
    fp32, static, sel = v["fp32"]["metric"], v["static"]["metric"], v["selective"]["metric"]
    assert raw["recovered_fraction"] == pytest.approx((sel - static) / (fp32 - static))
    # verify keeps FP32 exactly the nodes the proposal names. How many the search needed depends on the CPU's
    # integer kernels (5 with AVX2's saturating u8s8 kernels, 7 with VNNI's exact ones): what holds on any CPU
    # is the count read off the proposal, and that it is a part of the model, not all of it.
    proposed = json.loads(Path(setup[4]).read_text())
    assert v["selective"]["nodes_excluded"] == len(proposed["nodes_to_exclude"]) > 0
    assert v["selective"]["nodes_excluded"] < raw["quantizable_nodes"]
    assert v["selective"]["excluded_share"] == pytest.approx(
        v["selective"]["nodes_excluded"] / raw["quantizable_nodes"]
    )
    normalized = out.parent / f"{out.stem}_files" / "normalized.onnx"  # what every variant is built from
    assert v["selective"]["size_bytes"] < v["fp32"]["size_bytes"] == normalized.stat().st_size
    assert v["selective"]["size_bytes"] == Path(v["selective"]["path"]).stat().st_size
    # not static <= selective: keeping a weightless node (an Add) FP32 drops its Q/DQ pairs and the
    # selective model is then the smaller one
    assert v["static"]["size_bytes"] < v["fp32"]["size_bytes"]
    for x in v.values():
        t = x["timing"]
        assert t["runs"] == 10 and t["batch"] == 16 and 0 < t["p50_ms"] <= t["p95_ms"] and t["throughput"] > 0
    assert v["fp32"]["output_sqnr_db"] == "inf"
    assert (tmp_path / "verify_files" / "selective.onnx").exists()


def test_empty_proposal_is_not_met_exit_6(setup, tmp_path, capsys):
    proposal = dataclasses.replace(
        Proposal(SCHEMA_VERSION, "proposal", "", setup[3].model.sha256, "", ()), method="minmax"
    )
    code = main(_args(setup, _write(proposal, tmp_path / "empty.json"), "--runs", "0"))
    assert code == ExitCode.TARGET_NOT_MET
    assert "FAIL" in capsys.readouterr().out


def test_min_recovery_zero_passes_an_empty_proposal(setup, tmp_path):
    proposal = Proposal(SCHEMA_VERSION, "proposal", "", setup[3].model.sha256, "", ())
    assert (
        main(_args(setup, _write(proposal, tmp_path / "e.json"), "--runs", "0", "--min-recovery", "0")) == 0
    )


def _excluding(setup, share: float) -> Proposal:
    """A proposal keeping FP32 the first ``share`` of the nodes the report found quantized."""
    quantized = [n.name for n in setup[3].nodes if n.quantized]
    kept = tuple(quantized[: math.ceil(share * len(quantized))])
    return dataclasses.replace(
        Proposal(SCHEMA_VERSION, "proposal", "", setup[3].model.sha256, "", kept), method="minmax"
    )


def test_a_proposal_with_nothing_quantized_never_passes(setup, tmp_path, capsys):
    """Every quantized node kept FP32: the selective model is the FP32 model. It recovers 100 % of the loss,
    and verify had printed PASS on it; a CI gate must not go green on FP32, --accept-no-speedup or not."""
    path = _write(_excluding(setup, 1.0), tmp_path / "all.json")
    out = tmp_path / "v.json"
    assert main(_args(setup, path, "--runs", "0", "--accept-no-speedup", "-o", str(out))) == ExitCode.TARGET_NOT_MET
    raw = json.loads(out.read_text())
    v = {x["name"]: x for x in raw["variants"]}
    assert v["selective"]["qdq_pairs"] == 0 and raw["recovered_fraction"] == pytest.approx(1.0)
    gates = {g["name"]: g["side"] for g in raw["gates"]}
    assert gates == {"top1 recovery >= 90%": 1, "INT8 speed-up kept": -1}
    assert raw["verdict"].startswith("FAIL") and "the selective model quantizes nothing" in raw["verdict"]


def test_a_mostly_fp32_proposal_fails_as_propose_refuses_it_unless_accepted(setup, tmp_path, capsys):
    """Propose's rule (more than half the quantizable nodes FP32 gives the speed-up back: exit 6 unless
    --accept-no-speedup) is verify's: verify had passed a proposal propose refused."""
    path = _write(_excluding(setup, 0.6), tmp_path / "most.json")
    out = tmp_path / "v.json"
    args = _args(setup, path, "--runs", "0", "--min-recovery", "0", "-o", str(out))
    assert main(args) == ExitCode.TARGET_NOT_MET
    raw = json.loads(out.read_text())
    speed = next(g for g in raw["gates"] if g["name"] == "INT8 speed-up kept")
    assert speed["side"] == -1 and "FP32: most of the INT8 speed-up is gone" in speed["text"]
    assert "--accept-no-speedup" in speed["text"] and speed["text"] in raw["verdict"]
    assert main([*args, "--accept-no-speedup"]) == 0
    raw = json.loads(out.read_text())
    speed = next(g for g in raw["gates"] if g["name"] == "INT8 speed-up kept")
    assert speed["side"] == 1 and "accepted with --accept-no-speedup" in speed["text"]


def test_unknown_node_is_refused(setup, tmp_path, capsys):
    proposal = Proposal(
        SCHEMA_VERSION, "proposal", "", setup[3].model.sha256, "", ("layer0/ln1", "no/such/node")
    )
    code = main(_args(setup, _write(proposal, tmp_path / "bad.json"), "--runs", "0"))
    assert code == ExitCode.INPUT
    err = capsys.readouterr().err
    assert "'no/such/node'" in err and len(err.strip().splitlines()) == 1


def test_proposal_for_another_model_is_refused(setup, tmp_path, capsys):
    proposal = Proposal(SCHEMA_VERSION, "proposal", "", "0" * 64, "", ("layer0/ln1",))
    code = main(_args(setup, _write(proposal, tmp_path / "other.json"), "--runs", "0"))
    assert code == ExitCode.INPUT
    assert "another model" in capsys.readouterr().err


def test_a_report_is_not_a_proposal(setup, tmp_path):
    report_json = tmp_path / "r.json"
    report_json.write_text(dumps(setup[3]))
    assert main(_args(setup, report_json, "--runs", "0")) == ExitCode.INPUT


def test_eval_data_without_labels_for_top1(setup, tmp_path, capsys):
    model, calib, evaluation, _, proposal_path = setup
    nolabels = tmp_path / "nolabels.npz"
    np.savez(nolabels, input=np.load(evaluation)["input"][:32])
    code = main(
        [
            "verify",
            str(model),
            "--calib",
            str(calib),
            "--eval",
            str(nolabels),
            "--proposal",
            str(proposal_path),
            "--metric",
            "top1",
            "--runs",
            "0",
            "-q",
        ]
    )
    assert code == ExitCode.DATA
    assert "labels" in capsys.readouterr().err


def test_output_sqnr_metric_needs_a_target_sqnr(setup, tmp_path, capsys):
    proposal_path = setup[4]
    assert main(_args(setup, proposal_path, "--metric", "output_sqnr_db", "--runs", "0")) == ExitCode.USAGE
    assert "--target-sqnr" in capsys.readouterr().err
    assert (
        main(_args(setup, proposal_path, "--metric", "output_sqnr_db", "--target-sqnr", "3", "--runs", "0"))
        == 0
    )
    assert (
        main(_args(setup, proposal_path, "--metric", "output_sqnr_db", "--target-sqnr", "60", "--runs", "0"))
        == ExitCode.TARGET_NOT_MET
    )


def test_library_verify_matches_the_proposal(setup):
    model, calib, evaluation, _, proposal_path = setup
    result = verify(model, calib, evaluation, proposal_path, options=VerifyOptions(runs=0))
    proposal = json.loads(proposal_path.read_text())
    assert result.met
    assert result.variant("selective").metric == pytest.approx(proposal["expected_metric"])
    assert result.variant("static").metric == pytest.approx(proposal["static_metric"])
    assert result.variant("fp32").timing is None
    lines = result.summary_lines()
    assert lines[-1].startswith("PASS") and any("top1" in x for x in lines)


def test_judge():
    rec, met, verdict = judge("top1", 0.9, 0.5, 0.88, 10.0, 0.9, None)
    assert rec == pytest.approx(0.95) and met and verdict.startswith("PASS")
    rec, met, _ = judge("top1", 0.9, 0.5, 0.8, 10.0, 0.9, None)
    assert rec == pytest.approx(0.75) and not met
    rec, met, _ = judge("top1", 0.9, 0.9, 0.9, 10.0, 0.9, None)  # nothing lost
    assert math.isnan(rec) and met
    # static above FP32 by noise (CNN fixture: 98.4 % vs 98.0 %): a selective model at FP32's value had failed
    rec, met, verdict = judge("top1", 0.980, 0.984, 0.980, 10.0, 0.9, None)
    assert met and "at least FP32's value" in verdict
    assert not judge("top1", 0.980, 0.984, 0.976, 10.0, 0.9, None)[1]
    rec, met, _ = judge("output_sqnr_db", math.inf, 5.0, 20.0, 20.0, 0.9, 25.0)
    assert math.isnan(rec) and not met
    assert judge("output_sqnr_db", math.inf, 5.0, 30.0, 30.0, 0.9, 25.0)[1]
    # the threshold is printed as given: "recovered 93.1% (< 93% required)" had contradicted itself
    verdict = judge("top1", 0.98, 0.836, 0.97, 10.0, 0.9306, None)[2]
    assert "recovered 93.06% of the top1" in verdict and "(< 93.06% required)" in verdict
    assert "(>= 0% required)" in judge("top1", 0.9, 0.5, 0.88, 10.0, -0.0, None)[2]
    # judged like propose --target-drop: 94.6 % recovered passes by recovery, but 2.2 points lost fail a 1-point
    # target (a proposal propose reported as missing its target had passed the CI gate)
    assert judge("top1", 0.938, 0.532, 0.916, 10.0, 0.9, None)[1]
    rec, met, verdict = judge("top1", 0.938, 0.532, 0.916, 10.0, 0.9, None, 1.0)
    assert not met and "2.20 points below FP32 on top1 (> 1 points drop allowed)" in verdict
    assert rec == pytest.approx((0.916 - 0.532) / (0.938 - 0.532))
    assert judge("top1", 0.938, 0.532, 0.930, 10.0, 0.9, None, 1.0)[1]
    # no FP32 value to drop from: never an empty PASS (it had returned 'PASS: ')
    met, verdict = judge("output_sqnr_db", math.inf, 5.0, 30.0, 30.0, 0.9, None, 1.0)[1:]
    assert not met and "no FP32 value" in verdict


def test_time_sessions_is_fair_and_minimal(setup):
    model = onnx.load(str(setup[0]))
    feeds = {"input": np.load(setup[2])["input"][:8]}
    timings = time_sessions(
        {"a": model, "b": model}, feeds, SessionConfig(intra_op_threads=1), runs=12, warmup=2
    )
    assert set(timings) == {"a", "b"}
    for t in timings.values():
        assert t.runs == 12 and t.batch == 8 and t.warmup == 2 and t.threads == 1
        assert 0 < t.p50_ms <= t.p95_ms and t.throughput == pytest.approx(8 / (t.mean_ms / 1e3))


def test_tui_verify_adapter(setup):
    report = setup[3]
    proposal_path = setup[4]
    from qdebug.output.report_io import load_record

    proposal = load_record(Proposal, proposal_path, "proposal")
    fn = make_tui_verify(report, runs=3)
    assert fn is not None
    seen = []
    result = fn(proposal, lambda fraction, text: seen.append((fraction, text)), lambda: False)
    assert result.met and seen and all(0.0 <= f <= 1.0 for f, _ in seen)
    lines = result.summary_lines()
    assert all(isinstance(x, str) for x in lines) and lines[-1].startswith("PASS")
    # a second call reuses the prepared context and honours cancellation
    assert fn(proposal, lambda f, t: None, lambda: True).verdict == "cancelled"


def test_tui_verify_unavailable_when_files_are_not_reachable(setup, tmp_path):
    report = setup[3]
    gone = dataclasses.replace(
        report, model=dataclasses.replace(report.model, path=str(tmp_path / "gone.onnx"))
    )
    assert make_tui_verify(gone) is None
    no_calib = dataclasses.replace(
        report, config=dataclasses.replace(report.config, calib=str(tmp_path / "x.npz"))
    )
    assert make_tui_verify(no_calib) is None


def test_verify_and_bench_rebuild_the_proposals_calibration(tmp_path, capsys):
    """analyze --max-samples 16 -> propose -> verify/bench without the flag: they calibrated on every sample
    (64 scales differed from propose's model on the transformer). They now take the proposal's sample
    count, and a note says when the calibration still differs (another --calib file)."""
    from tests.models import small_cnn, small_data

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=48)
    prop = tmp_path / "p.json"
    proposal = analyze_then_propose(model, calib, tmp_path, "--max-samples", "16")
    assert proposal["calib_max_samples"] == 16 and proposal["calibration_key"]
    theirs = qdq_scales(proposal["quantized_model"])
    base = [str(model), "--calib", str(calib), "--proposal", str(prop), "-q"]
    # 16 samples: one sample separates FP32 from static, so the gate may be undecided (8) as well
    assert main(["verify", *base, "--runs", "0", "-o", str(tmp_path / "v.json")]) in (0, 6, ExitCode.UNDECIDED)
    out = capsys.readouterr().out
    assert "note: the calibration differs" not in out
    mine = qdq_scales(tmp_path / "v_files" / "selective.onnx")
    assert mine.keys() == theirs.keys()
    assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)
    bench = ["bench", *base, "--variants", "selective", "--runs", "1", "--warmup", "0", "--no-dynamic-layers"]
    assert main([*bench, "-o", str(tmp_path / "b.json")]) == 0
    capsys.readouterr()
    mine = qdq_scales(tmp_path / "b_files" / "selective.onnx")
    assert all(np.array_equal(mine[k], theirs[k]) for k in theirs)
    # other calibration data: verify judges the model it built, and says its scales are not propose's
    other = small_data(tmp_path / "o.npz", n=48, seed=7)
    args = ["verify", str(model), "--calib", str(other), "--proposal", str(prop), "--runs", "0", "-q"]
    assert main(args) in (0, 6, ExitCode.UNDECIDED)
    assert "note: the calibration differs from the one the proposal was made with" in capsys.readouterr().out


def test_stored_size_counts_external_weights(tmp_path):
    """A model saved with external data (every model over 2 GB) is mostly its weights file: sizes compared
    across variants counted the pointer file only."""
    from qdebug.graph.load import stored_size
    from tests.models import small_cnn

    model = onnx.load(str(small_cnn(tmp_path / "m.onnx")))
    onnx.save_model(
        model,
        str(tmp_path / "ext.onnx"),
        save_as_external_data=True,
        location="ext.onnx.data",
        size_threshold=0,
    )
    onnx_bytes, data_bytes = (
        (tmp_path / "ext.onnx").stat().st_size,
        (tmp_path / "ext.onnx.data").stat().st_size,
    )
    assert data_bytes > 0
    assert stored_size(tmp_path / "ext.onnx") == onnx_bytes + data_bytes
    assert stored_size(tmp_path / "m.onnx") == (tmp_path / "m.onnx").stat().st_size


def test_a_per_channel_reports_static_baseline_is_per_channel(tmp_path, capsys):
    """analyze --per-channel -> propose -> verify/bench without the flag: the static baseline had been
    rebuilt per-tensor while the selective model was per-channel, so an empty proposal was credited with
    the whole per-tensor/per-channel gap (98.7 % "recovered", PASS). The proposal now records the report's
    setting (base_per_channel) and every static variant follows it."""
    from qdebug.graph.match import qdq_settings
    from tests.models import small_cnn, small_data

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=32)
    proposal = analyze_then_propose(model, calib, tmp_path, "--per-channel")
    assert proposal["base_per_channel"] is True and proposal["per_channel"] is True
    base = [str(model), "--calib", str(calib), "--proposal", str(tmp_path / "p.json"), "-q"]
    assert main(["verify", *base, "--runs", "0", "--min-recovery", "0", "-o", str(tmp_path / "v.json")]) == 0
    for name in ("static", "selective"):
        assert qdq_settings(onnx.load(str(tmp_path / "v_files" / f"{name}.onnx"))).per_channel, name
    bench = ["bench", *base, "--variants", "static,selective", "--runs", "1", "--warmup", "0"]
    assert main([*bench, "--no-dynamic-layers", "-o", str(tmp_path / "b.json")]) == 0
    assert qdq_settings(onnx.load(str(tmp_path / "b_files" / "static.onnx"))).per_channel
    assert "per-channel weights as in the proposal" not in capsys.readouterr().out
    # a proposal from before the field: a per-tensor baseline, and a note that says so
    old = {k: v for k, v in proposal.items() if k != "base_per_channel"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    base[base.index(str(tmp_path / "p.json"))] = str(tmp_path / "old.json")
    assert main(["verify", *base, "--runs", "0", "--min-recovery", "0"]) == 0
    assert "does not record the report's own setting (an older qdebug)" in capsys.readouterr().out
    # a per-tensor report keeps a per-tensor baseline (the flag still turns it on)
    (tmp_path / "pt").mkdir()
    assert analyze_then_propose(model, calib, tmp_path / "pt")["base_per_channel"] is False


# verify must build the selective model the proposal describes (exclusions, 16-bit overrides, per-channel)
# and count what it did. The suite's only real proposal (transformer) has no overrides, per_channel False and
# only quantizable nodes, so ignoring overrides or per_channel, counting every named node, or reporting the
# static model's Q/DQ count for the selective one all passed.
def _q_types(model: onnx.ModelProto) -> dict[str, int]:
    """Activation tensor -> element type of its QuantizeLinear zero point (2 = uint8, 4 = uint16...)."""
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] not in inits and len(n.input) > 2:
            out[n.input[0]] = inits[n.input[2]].data_type
    return out


def _weight_scale_sizes(model: onnx.ModelProto) -> list[int]:
    inits = {i.name: i for i in model.graph.initializer}
    return [
        numpy_helper.to_array(inits[n.input[1]]).size
        for n in model.graph.node
        if n.op_type == "DequantizeLinear"
        and n.input[0] in inits
        and inits[n.input[0]].data_type == onnx.TensorProto.INT8
    ]


def test_verify_builds_and_counts_what_the_proposal_says(cnn, tmp_path):
    model, calib = cnn
    sha = load_model(model).sha256
    proposal = Proposal(
        SCHEMA_VERSION,
        "proposal",
        str(model),
        sha,
        "",
        nodes_to_exclude=("conv2", "relu1"),  # relu1: ORT folds it into conv1's Q/DQ (not quantizable)
        tensor_overrides=(TensorOverride("r1", "QUInt16"),),
        per_channel=True,
        method="minmax",
    )
    out = tmp_path / "v.json"
    result = verify(model, calib, None, proposal, options=VerifyOptions(runs=0, min_recovery=0.0), output=out)
    static = onnx.load(str(tmp_path / "v_files" / "static.onnx"))
    selective = onnx.load(str(tmp_path / "v_files" / "selective.onnx"))

    # exclusions: conv2 reads a float weight in the selective model, a quantized one in the static model
    def conv2_weight_quantized(m: onnx.ModelProto) -> bool:
        conv2 = next(n for n in m.graph.node if n.name == "conv2")
        producers = {o: n for n in m.graph.node for o in n.output}
        return conv2.input[1] in producers and producers[conv2.input[1]].op_type == "DequantizeLinear"

    assert conv2_weight_quantized(static) and not conv2_weight_quantized(selective)
    # the 16-bit override reached the model
    assert _q_types(static).get("r1") == onnx.TensorProto.UINT8
    assert _q_types(selective).get("r1") == onnx.TensorProto.UINT16
    # per-channel weights in the selective model only
    assert max(_weight_scale_sizes(static)) == 1 and max(_weight_scale_sizes(selective)) > 1
    sel = result.variant("selective")
    assert sel.nodes_excluded == 1  # relu1 is named but not quantizable
    assert sel.excluded_share == 1 / result.quantizable_nodes
    qdq = lambda m: sum(n.op_type == "QuantizeLinear" for n in m.graph.node)  # noqa: E731
    assert sel.qdq_pairs == qdq(selective) and result.variant("static").qdq_pairs == qdq(static)


def test_judge_an_undefined_output_sqnr_never_meets_a_target():
    """A NaN output SQNR (no signal) must fail --target-sqnr, whatever the recovery."""
    rec, met, verdict = judge("output_sqnr_db", math.inf, 5.0, math.nan, math.nan, 0.9, 25.0)
    assert not met and verdict.startswith("FAIL")


def test_verify_judges_by_the_proposals_custom_metric_and_hooks_may_hold_dataclasses(tmp_path, capsys):
    """Without --metric verify used its default (output SQNR, which has no FP32 value to drop from) instead
    of the metric propose judged by; and a metric file with a dataclass under postponed annotations failed
    to import with an obscure AttributeError (the module was not registered while it ran)."""
    from tests.models import small_cnn, small_data

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    hook = tmp_path / "my_metric.py"
    hook.write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n"
        "import numpy as np\n\n"
        "@dataclass\n"
        "class Agreement:\n"
        "    hits: int = 0\n"
        "    total: int = 0\n\n"
        "def agreement(reference, candidate, labels):\n"
        "    a = Agreement()\n"
        "    for r, c in zip(reference, candidate):\n"
        "        x, y = next(iter(r.values())), next(iter(c.values()))\n"
        "        a.hits += int((x.argmax(-1) == y.argmax(-1)).sum())\n"
        "        a.total += len(x)\n"
        "    return a.hits / a.total\n"
    )
    metric = f"{hook}:agreement"
    report, proposal, out = tmp_path / "r.json", tmp_path / "p.json", tmp_path / "v.json"
    assert main(["analyze", str(model), "--calib", str(calib), "--metric", metric, "-o", str(report), "-q"]) == 0
    argv = ["propose", str(report), "-o", str(proposal), "-q", "--time-runs", "0", "--accept-no-speedup"]
    assert main(argv) in (0, 6)
    code = main(["verify", str(model), "--calib", str(calib), "--proposal", str(proposal), "--runs", "2",
                 "--target-drop", "1", "-o", str(out), "-q"])  # fmt: skip
    assert code in (0, 6, ExitCode.UNDECIDED), capsys.readouterr().err
    assert json.loads(out.read_text())["metric"] == metric


def test_verify_gives_each_speed_ratio_with_its_spread_over_the_interleaved_rounds(setup, tmp_path, capsys):
    """Two rounds of 10 runs: every timed column keeps its two round medians in verify.json (read back as they
    were written), the table has a ``speed vs FP32`` row with each ratio's range, and the verdict line says
    faster, slower or within the noise by the rounds; one round has no spread, so no such row."""
    from qdebug.output.report_io import load_record
    from qdebug.records.verify import VerifyResult, speed_ratio

    _, _, _, _, proposal_path = setup
    out = tmp_path / "verify.json"
    assert main(_args(setup, proposal_path, "--runs", "20", "-o", str(out))) == 0
    stdout = capsys.readouterr().out
    loaded = load_record(VerifyResult, out, "verify")
    timings = {v.name: v.timing for v in loaded.variants}
    assert all(len(t.rounds_ms) == 2 and min(t.rounds_ms) > 0 for t in timings.values())
    ratio = speed_ratio(timings["fp32"].rounds_ms, timings["selective"].rounds_ms)
    (row,) = [line for line in stdout.splitlines() if line.startswith("speed vs FP32")]
    assert row.split()[-2:] == ratio.show().split() and "1.00x" in row
    assert f"FP32's speed over 2 rounds: {ratio.verdict}" in loaded.verdict
    assert main(_args(setup, proposal_path, "--runs", "10", "-o", str(tmp_path / "one.json"))) == 0
    assert "speed vs FP32" not in capsys.readouterr().out


def test_the_speed_gate_judges_no_timing_of_a_selective_model_that_is_full_static_again():
    """A selective model that keeps nothing FP32 and overrides nothing is the full static model: timed slower
    than FP32 while static is faster, that is noise (2 runs on a loaded CI machine), not a lost speed-up. One
    node kept FP32 with the same timings is judged, and fails."""
    from qdebug.evaluation.gates import speedup_gate
    from qdebug.records.verify import Timing, VariantResult

    def timing(p50):
        return Timing(p50, p50 * 1.05, p50, 16 / p50, 16, 2, 1, 0, "CPUExecutionProvider")

    def column(name, kept, pairs, p50):
        return VariantResult(name, 0.9, 30.0, kept, kept / 10, 0, pairs, 1000, None, timing(p50))

    fp32, static = column("fp32", 10, 0, 10.0), column("static", 0, 12, 5.0)
    same = speedup_gate([fp32, static, column("selective", 0, 12, 12.0)])
    assert same.side == 1 and "quantizes 10 of 10" in same.text
    one_fp32 = speedup_gate([fp32, static, column("selective", 1, 11, 12.0)])
    assert one_fp32.side == -1 and "slower than FP32" in one_fp32.text
