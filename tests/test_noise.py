"""Gates that know their noise (issue 19 item 3): paired-bootstrap intervals, McNemar's exact test, the
samples that would decide, and verify's undecided verdict with its own exit code."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import binomtest

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.evaluate import Evaluator, HookValues, RatioValues, worst_output_sqnr
from qdebug.evaluation.noise import (
    Interval,
    bootstrap,
    interval,
    mcnemar,
    paired_noise,
    samples_to_decide,
    single_interval,
)
from qdebug.graph.load import load_model
from qdebug.output import ci_outputs
from qdebug.output.report_io import dumps, from_jsonable
from qdebug.records import SCHEMA_VERSION, Proposal
from qdebug.records.verify import VerifyResult
from qdebug.verify import assess, judge
from tests.conftest import fixture_path


def _hits(n: int, right: int) -> RatioValues:
    hits = np.zeros(n)
    hits[:right] = 1.0
    return RatioValues(hits, np.ones(n))


# --------------------------------------------------------------------------- the statistics


def test_bootstrap_interval_of_a_known_binomial_case_is_the_normal_one():
    """60 samples at 90 %: the percentile interval is the normal one, p +- 1.96 sqrt(p(1-p)/n), to within a
    sample, and it overlaps Wilson's."""
    v = _hits(60, 54)
    iv = interval(bootstrap([v])[0], v.value(), 0.95)
    p, n = 0.9, 60
    half = 1.959964 * math.sqrt(p * (1 - p) / n)
    assert iv.estimate == pytest.approx(0.9)
    assert iv.low == pytest.approx(p - half, abs=1.5 / n) and iv.high == pytest.approx(p + half, abs=1.5 / n)
    z = 1.959964
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    w = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    assert iv.low < centre + w and iv.high > centre - w  # Wilson [0.799, 0.953]
    assert iv.low <= p <= iv.high


def test_the_interval_covers_the_true_accuracy_about_as_often_as_it_says():
    """Coverage over 200 evaluation sets of 60 samples drawn at a true 90 %: near 95 % (the percentile
    bootstrap of a proportion is a little short at this size)."""
    rng = np.random.default_rng(3)
    covered = 0
    for _ in range(200):
        hits = (rng.random(60) < 0.9).astype(np.float64)
        v = RatioValues(hits, np.ones(60))
        iv = interval(bootstrap([v], resamples=1000)[0], v.value(), 0.95)
        covered += iv.low <= 0.9 <= iv.high
    assert 0.85 <= covered / 200 <= 0.995


def test_the_bootstrap_is_paired_and_deterministic():
    """The same draws for every variant: a selective model that differs from FP32 on two samples has an
    interval two samples wide, whatever the accuracy's own spread; and the same data give the same draws."""
    fp32 = _hits(60, 54)
    hits = fp32.hits.copy()
    hits[0] = 0.0
    hits[1] = 0.0  # two samples FP32 gets right and the selective model not
    sel = RatioValues(hits, np.ones(60))
    first = paired_noise((fp32, fp32, sel), (0.9, 0.9, 52 / 60), confidence=0.95, scale=100.0)
    again = paired_noise((fp32, fp32, sel), (0.9, 0.9, 52 / 60), confidence=0.95, scale=100.0)
    assert first == again
    assert first.drop.estimate == pytest.approx(100 * 2 / 60)
    assert first.drop.low >= 0.0 and first.drop.high <= 100 * 6 / 60  # never below 0: the pairs only ever lose
    # the two models drawn independently, as two unpaired evaluation sets would be: more than twice as wide
    unpaired = interval(bootstrap([fp32], seed=1)[0] - bootstrap([sel], seed=2)[0], 2 / 60, 0.95)
    assert first.drop.high - first.drop.low < 100 * (unpaired.high - unpaired.low) / 2


def test_mcnemar_is_scipys_exact_binomial_on_the_discordant_pairs():
    fp32 = np.array([1] * 50 + [1] * 7 + [0] * 1 + [0] * 2, dtype=bool)
    sel = np.array([1] * 50 + [0] * 7 + [1] * 1 + [0] * 2, dtype=bool)
    test = mcnemar(fp32, sel)
    assert (test.first_only, test.second_only) == (7, 1)
    assert test.p_value == pytest.approx(binomtest(7, 8, 0.5).pvalue)
    assert test.p_value == pytest.approx(2 * (1 + 8) / 2**8)  # by hand: P(X <= 1) twice, X ~ B(8, 1/2)
    assert mcnemar(fp32, fp32).p_value == 1.0  # no discordant pair: nothing to tell apart


def test_samples_to_decide_come_from_the_observed_spread():
    iv = Interval(0.5, 0.1, 0.9, 0.95)
    assert samples_to_decide(iv, 0.8, 60) == math.ceil(60 * (0.4 / 0.3) ** 2)
    assert samples_to_decide(iv, 0.5, 60) is None  # an estimate on its target: no count decides it
    assert samples_to_decide(Interval(0.5, 0.1, math.inf, 0.95), 0.8, 60) is None
    # the count holds: the same data repeated to that many samples decide the gate
    fp32 = _hits(60, 57)
    hits = fp32.hits.copy()
    hits[:3] = 0.0  # 5 points lost
    sel = RatioValues(hits, np.ones(60))
    noise = paired_noise((fp32, fp32, sel), (0.95, 0.95, 0.9), confidence=0.95, scale=100.0)
    target = 2.0
    assert noise.drop.low < target < noise.drop.high
    needed = samples_to_decide(noise.drop, target, 60)
    assert needed is not None and needed > 60
    reps = math.ceil(needed / 60)
    big_f = RatioValues(np.tile(fp32.hits, reps), np.ones(60 * reps))
    big_s = RatioValues(np.tile(sel.hits, reps), np.ones(60 * reps))
    bigger = paired_noise((big_f, big_f, big_s), (0.95, 0.95, 0.9), confidence=0.95, scale=100.0)
    assert bigger.drop.low > target


# --------------------------------------------------------------------------- the per-sample views


def _evaluator(reference, labels=None, metric=None, sizes=None):
    data = SimpleNamespace(specs=[], source="test data")
    return Evaluator.from_outputs(reference, labels, data, metric, sizes)


def test_per_sample_views_add_up_to_the_metric():
    rng = np.random.default_rng(0)
    ref = [{"y": rng.normal(size=(8, 5)).astype(np.float32)} for _ in range(3)]
    labels = [r["y"].argmax(1) for r in ref]
    labels[0][:2] = (labels[0][:2] + 1) % 5  # FP32 wrong on two samples
    cand = [{"y": r["y"] + rng.normal(0, 0.5, size=r["y"].shape).astype(np.float32)} for r in ref]
    ev = _evaluator(ref, labels, "top1")
    result = ev.score_outputs(cand)
    values = ev.sample_values(result)
    assert isinstance(values, RatioValues) and values.binary and values.units == 24
    assert values.value() == pytest.approx(result.value) and ev.sample_values().value() == pytest.approx(ev.fp32_value)
    everything = np.arange(24)[None, :]  # the draw that takes each sample once
    assert values.resampled(everything)[0] == pytest.approx(result.value)
    # output SQNR: the draw that takes each sample once is the whole set's SQNR (sums, not a mean of dB)
    sqnr = ev.sqnr_values(result)
    assert sqnr is not None and sqnr.units == 24
    assert sqnr.resampled(everything)[0] == pytest.approx(worst_output_sqnr(ref, cand, ["y"]))
    assert single_interval(sqnr, result.output_sqnr_db, 0.9).low < result.output_sqnr_db
    # what a proposal's drop_interval records: FP32 minus the candidate, in points
    low, high = ev.drop_interval(result)
    assert low <= 100 * (ev.fp32_value - result.value) <= high


def test_agreement_positions_without_a_batch_axis_are_one_unit_per_batch():
    """An output ``[T, classes]`` at batch 1 holds positions of one sample: they are drawn together."""
    rng = np.random.default_rng(1)
    ref = [{"y": rng.normal(size=(7, 4)).astype(np.float32)} for _ in range(4)]
    cand = [{"y": r["y"][:, ::-1].copy()} for r in ref]
    ev = _evaluator(ref, None, "top1_agreement", sizes=[1, 1, 1, 1])
    result = ev.score_outputs(cand)
    values = ev.sample_values(result)
    assert values.units == 4 and values.counts.tolist() == [7.0] * 4
    assert values.value() == pytest.approx(result.value)


def test_custom_metrics_resample_batches_or_use_their_per_sample_form(tmp_path):
    hook = tmp_path / "acc_metric.py"
    hook.write_text(
        "import numpy as np\n\n"
        "def acc(reference, candidate, labels):\n"
        "    hits = [(c['y'].argmax(1) == lab) for c, lab in zip(candidate, labels)]\n"
        "    return float(np.concatenate(hits).mean())\n\n"
        "def per(reference, candidate, labels):\n"
        "    return [float(h) for c, lab in zip(candidate, labels) for h in (c['y'].argmax(1) == lab)]\n\n"
        "def bad_per(reference, candidate, labels):\n"
        "    return [1.0] * sum(len(lab) for lab in labels)\n\n"
        "def with_form(reference, candidate, labels):\n"
        "    return acc(reference, candidate, labels)\n\n"
        "def with_bad_form(reference, candidate, labels):\n"
        "    return acc(reference, candidate, labels)\n\n"
        "with_form.per_sample = per\n"
        "with_bad_form.per_sample = bad_per\n"
    )
    rng = np.random.default_rng(2)
    ref = [{"y": rng.normal(size=(6, 3)).astype(np.float32)} for _ in range(5)]
    labels = [rng.integers(0, 3, 6) for _ in ref]
    cand = [{"y": r["y"][:, ::-1].copy()} for r in ref]
    plain = _evaluator(ref, labels, f"{hook}:acc")
    result = plain.score_outputs(cand)
    values = plain.sample_values(result)
    assert isinstance(values, HookValues) and values.units == 5  # batches
    assert values.resampled(np.arange(5)[None, :])[0] == pytest.approx(result.value)
    form = _evaluator(ref, labels, f"{hook}:with_form")
    per = form.sample_values(form.score_outputs(cand))
    assert isinstance(per, RatioValues) and per.units == 30 and per.value() == pytest.approx(result.value)
    bad = _evaluator(ref, labels, f"{hook}:with_bad_form")
    with pytest.raises(QDebugError, match="average"):
        bad.sample_values(bad.score_outputs(cand))
    one_batch = _evaluator(ref[:1], labels[:1], f"{hook}:acc")
    assert one_batch.sample_values(one_batch.score_outputs(cand[:1])) is None  # nothing to resample


# --------------------------------------------------------------------------- judging


def test_judge_by_intervals_pass_fail_undecided():
    fp32 = _hits(60, 57)
    hits = fp32.hits.copy()
    hits[:3] = 0.0
    sel = RatioValues(hits, np.ones(60))
    noise = paired_noise((fp32, sel, sel), (0.95, 0.9, 0.9), confidence=0.95, scale=100.0)
    args = ("top1", 0.95, 0.9, 0.9, 10.0, 0.9, None)
    undecided = assess(*args, 2.0, noise=noise)
    assert not undecided.met and not undecided.decided
    assert undecided.verdict.startswith("UNDECIDED: the evaluation set is too small to tell at 95% confidence")
    assert f"about {undecided.samples_to_decide:,} samples would decide it (60 now)" in undecided.verdict
    assert "[95% interval" in undecided.verdict
    assert judge(*args, 2.0)[1] is False  # on the point estimate alone: a plain miss
    decided = assess(*args, 20.0, noise=noise)
    assert decided.met and decided.decided and decided.verdict.startswith("PASS")
    assert not assess(*args, 0.0, noise=noise).decided  # 5 points lost, but 0 is inside [0, 11.7]
    # recovery: nothing of static's loss recovered, beyond any doubt
    static = RatioValues(np.zeros(60), np.ones(60))
    none = paired_noise((fp32, static, static), (0.95, 0.0, 0.0), confidence=0.95, scale=100.0)
    failed = assess("top1", 0.95, 0.0, 0.0, 10.0, 0.9, None, noise=none)
    assert failed.decided and not failed.met and failed.verdict.startswith("FAIL")


# --------------------------------------------------------------------------- verify end to end


@pytest.fixture(scope="module")
def transformer():
    model = fixture_path("transformer", "model.onnx")
    return model, fixture_path("transformer", "calib.npz"), fixture_path("transformer", "eval.npz")


def _empty_proposal(model, path):
    """Exclude nothing: the selective model is the static one (8-10 points below FP32 on 60 samples: 5 or 6
    samples lost, by the CPU's integer kernels -- VNNI or not)."""
    sha = load_model(model).sha256
    path.write_text(dumps(dataclasses.replace(Proposal(SCHEMA_VERSION, "proposal", "", sha, "", ()), method="minmax")))
    return path


def _verify(transformer, proposal, out, *extra):
    model, calib, evaluation = transformer
    argv = ["verify", str(model), "--calib", str(calib), "--eval", str(evaluation), "--proposal", str(proposal),
            "--eval-max-samples", "60", "--runs", "0", "-q", "-o", str(out), *extra]  # fmt: skip
    return main(argv)


def test_verify_says_undecided_when_the_target_lies_inside_the_interval(transformer, tmp_path, capsys):
    proposal = _empty_proposal(transformer[0], tmp_path / "p.json")
    out, junit = tmp_path / "v.json", tmp_path / "v.xml"
    assert _verify(transformer, proposal, out, "--target-drop", "8", "--junit", str(junit)) == ExitCode.UNDECIDED
    stdout = capsys.readouterr().out
    assert "UNDECIDED: the evaluation set is too small" in stdout and "noise: 95% paired bootstrap" in stdout
    raw = json.loads(out.read_text())
    assert raw["met"] is False and raw["decided"] is False and raw["confidence"] == 0.95
    low, high = raw["drop_interval"]
    assert low < 8 < high and raw["samples_to_decide"] > 60
    lost, gained = raw["discordant"]  # samples FP32 gets right and static wrong, and the other way round
    metric = {v["name"]: v["metric"] for v in raw["variants"]}
    assert lost == round(60 * (metric["fp32"] - metric["static"])) + gained and lost >= 4 and gained == 0
    assert raw["p_value"] == pytest.approx(binomtest(lost, lost + gained, 0.5).pvalue)
    assert raw["noise_units"] == 60 and raw["resamples"] == 2000
    case = __import__("xml.etree.ElementTree").etree.ElementTree.parse(junit).getroot().find(".//testcase")
    assert case.find("skipped") is not None and case.find("failure") is None
    assert case.find("skipped").get("message") == raw["verdict"]
    record = from_jsonable(VerifyResult, raw)
    # the drop gate is undecided; the speed-up gate passes (static's nodes are all still quantized)
    assert [(g.passed, g.decided) for g in ci_outputs.verify_gates(record)] == [(False, False), (True, True)]
    assert ci_outputs.verify_markdown(record).startswith("## qdebug verify: UNDECIDED")
    # deterministic: the same run gives the same intervals
    assert _verify(transformer, proposal, tmp_path / "again.json", "--target-drop", "8") == ExitCode.UNDECIDED
    again = json.loads((tmp_path / "again.json").read_text())
    keys = ("drop_interval", "static_drop_interval", "recovery_interval", "samples_to_decide", "p_value", "verdict")
    assert {k: again[k] for k in keys} == {k: raw[k] for k in keys}


def test_verify_exits_0_or_6_when_the_interval_decides(transformer, tmp_path, capsys):
    proposal = _empty_proposal(transformer[0], tmp_path / "p.json")
    assert _verify(transformer, proposal, tmp_path / "first.json", "--target-drop", "8") == ExitCode.UNDECIDED
    low, high = json.loads((tmp_path / "first.json").read_text())["drop_interval"]
    assert 0 < low < high  # 5 or 6 samples lost by the CPU's kernels: the targets below sit outside, either way
    below, above = f"{low / 2:.3f}", f"{high + 1:.3f}"
    assert _verify(transformer, proposal, tmp_path / "miss.json", "--target-drop", below) == ExitCode.TARGET_NOT_MET
    miss = json.loads((tmp_path / "miss.json").read_text())
    assert miss["decided"] is True and miss["drop_interval"] == [low, high] and miss["verdict"].startswith("FAIL")
    assert _verify(transformer, proposal, tmp_path / "met.json", "--target-drop", above) == 0
    met = json.loads((tmp_path / "met.json").read_text())
    assert met["met"] is True and met["drop_interval"][1] <= float(above) and met["samples_to_decide"] is None
    # by recovery: static's loss, none of it recovered, beyond the noise
    assert _verify(transformer, proposal, tmp_path / "rec.json") == ExitCode.TARGET_NOT_MET
    assert json.loads((tmp_path / "rec.json").read_text())["recovery_interval"] == [0.0, 0.0]
    # --confidence 0: the point estimates alone, as before the intervals (8.3-10 points lost > 8 allowed)
    assert _verify(transformer, proposal, tmp_path / "pt.json", "--target-drop", "8", "--confidence", "0") == 6
    point = json.loads((tmp_path / "pt.json").read_text())
    assert point["confidence"] == "nan" and point["drop_interval"] == ["nan", "nan"]
    assert _verify(transformer, proposal, tmp_path / "x.json", "--confidence", "1") == ExitCode.USAGE
    capsys.readouterr()


def test_older_verify_files_load_decided():
    """A verify.json written before the intervals: decided, no interval, judged on its point estimates."""
    old = {
        "schema_version": SCHEMA_VERSION, "kind": "verify", "model_path": "/m.onnx", "model_sha256": "0" * 64,
        "proposal": "p.json", "metric": "top1", "samples": 10, "quantizable_nodes": 4, "variants": [],
        "recovered_fraction": 0.5, "min_recovery": 0.9, "target_sqnr_db": "nan", "met": False,
        "verdict": "FAIL: ...", "seconds": 1.0,
    }  # fmt: skip
    record = from_jsonable(VerifyResult, old)
    assert record.decided and math.isnan(record.confidence) and record.noise_line() == ""
    assert [g.decided for g in ci_outputs.verify_gates(record)] == [True]
