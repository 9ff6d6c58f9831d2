"""The switchable fake-quant model: one session that computes static, FP32 and any exclusion in between."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qdebug.cli.demo import demo_files
from qdebug.data import open_data
from qdebug.evaluation.evaluate import Evaluator
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.quant.switchable import SWITCHES, build_switchable, switches_for
from qdebug.runtime.capture import SessionConfig, make_session
from tests.conftest import planted as _planted


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    model, calib, evaluation = demo_files()
    prep = prepare(model, calib, tmp_path_factory.mktemp("sw") / "files", AnalyzeOptions())
    static = quantize_static_model(prep.normalized, prep.ranges, QuantSpec())
    data = open_data(evaluation, prep.calib.specs, batch_size=100, what="evaluation data")
    return prep, static, Evaluator(prep.normalized, data, SessionConfig())


def _outputs(session, evaluator, extra=None):
    return [session.run(None, {**b.feeds, **(extra or {})})[0] for b in evaluator.batches]


def test_all_on_is_static_fake_quant_and_all_off_is_fp32(demo):
    prep, static, evaluator = demo
    before = static.SerializeToString()
    switchable = build_switchable(static, prep.normalized)
    assert static.SerializeToString() == before  # the input is not changed
    onnx.checker.check_model(switchable.model)
    session = make_session(switchable.model, SessionConfig(), fake_quant=True)
    on = _outputs(session, evaluator, {SWITCHES: switchable.all_on()})
    off = _outputs(session, evaluator, {SWITCHES: ~switchable.all_on()})
    fake = _outputs(make_session(static, SessionConfig(), fake_quant=True), evaluator)
    fp32 = _outputs(make_session(prep.normalized, SessionConfig()), evaluator)
    for a, b in zip(on, fake, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(off, fp32, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert max(np.abs(a - b).max() for a, b in zip(fake, fp32, strict=True)) > 0.1  # static does lose


def test_an_exclusion_is_its_switches_and_scores_as_its_own_fake_quant_model(demo):
    prep, static, evaluator = demo
    switchable = build_switchable(static, prep.normalized)
    session = make_session(switchable.model, SessionConfig(), fake_quant=True)
    names = [n.name for n in prep.normalized.graph.node]
    tried = 0
    for excluded in (names[:1], names[3:4], names[10:14], names[-1:]):
        candidate = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(nodes_to_exclude=tuple(excluded)))
        switches = switches_for(switchable, candidate)
        assert switches is not None, excluded
        assert 0 < (~switches).sum() < switches.size
        tried += 1
        own = evaluator.score(candidate, fake_quant=True)
        screened = evaluator.score_session(session, {SWITCHES: switches})
        assert screened.value == own.value
        assert screened.outputs == own.outputs
    assert tried == 4


def test_a_changed_range_is_not_representable(demo):
    prep, static, _ = demo
    switchable = build_switchable(static, prep.normalized)
    assert (
        switches_for(switchable, quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True)))
        is None
    )
    assert switches_for(switchable, static).all()


def test_the_screen_stands_in_for_the_evaluator_and_falls_back_on_what_it_cannot_express(demo):
    import pickle

    from qdebug.quant.switchable import SwitchScreen

    prep, static, evaluator = demo
    screen = SwitchScreen(evaluator, build_switchable(static, prep.normalized))
    assert screen.samples == evaluator.samples and screen.metric_name == evaluator.metric_name
    excluded = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(nodes_to_exclude=("layer0/ln1",)))
    assert screen.score(excluded).value == evaluator.score(excluded, fake_quant=True).value
    per_channel = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(per_channel=True))
    assert screen.score(per_channel).value == evaluator.score(per_channel).value  # its own model, int kernels
    assert (screen.screened, screen.fallbacks) == (1, 1)
    worker = pickle.loads(pickle.dumps(screen))  # what a --workers process gets: the session is rebuilt there
    assert worker._session is None and worker.score(excluded).value == screen.score(excluded).value




@pytest.mark.parametrize("kind", ["outlier_residual", "detector_concat"])
def test_propose_screened_on_the_switchable_model_finds_the_planted_culprits(tmp_path, kind):
    """``--screen-model on``: the search's exclusion candidates go through the one switchable session, the
    answer is still exactly the planted set, and its reported numbers are the real model's (the same as
    a search without the screen)."""
    from qdebug.cli.main import main
    from qdebug.propose import ProposeOptions, propose

    planted = _planted()
    if kind not in planted.KINDS:
        pytest.skip(f"no planted kind {kind}")
    rec = planted.make(kind, tmp_path / kind, "small")
    report = tmp_path / "r.json"
    args = ["analyze", rec.model, "--calib", rec.calib, "--eval", rec.eval, "--metric", rec.metric]
    assert main([*args, "-o", str(report), "-q"]) == 0
    common = dict(target_drop=rec.target_drop, time_runs=0)
    off = propose(report, output=None, options=ProposeOptions(screen_model="off", **common))
    on = propose(report, output=None, options=ProposeOptions(screen_model="on", **common))
    assert list(on.proposal.nodes_to_exclude) == list(off.proposal.nodes_to_exclude) == list(rec.culprits)
    assert on.proposal.expected_metric == off.proposal.expected_metric  # confirmed on the real model
    assert on.proposal.static_metric == off.proposal.static_metric
    (note,) = [n for n in on.notes if "switchable fake-quant model" in n]
    screened, total = int(note.split(" of ")[0]), int(note.split(" of ")[1].split()[0])
    assert 1 <= screened <= total <= on.proposal.evaluations, note  # exclusions went through the switches
    assert not any("switchable" in n for n in off.notes)


def test_auto_screens_large_graphs_unless_the_fake_quant_metric_is_far_from_the_deployed_one():
    from types import SimpleNamespace

    from qdebug.propose.switch import SWITCH_NODES, wanted

    def report(nodes: int, fakequant: float, same: float, deployed: float = 0.5):
        task = SimpleNamespace(
            name="top1", quantized=deployed, quantized_fakequant=fakequant, quantized_same_samples=same
        )
        return SimpleNamespace(nodes=[None] * nodes, task=task)

    big, small = SWITCH_NODES, SWITCH_NODES - 1
    assert wanted("auto", report(big, 0.90, 0.905)) and not wanted("auto", report(small, 0.90, 0.905))
    assert not wanted("auto", report(big, 0.90, 0.70))  # a 20-point kernel gap: fake-quant would mislead
    # compared on the same samples: the whole set's deployed metric (0.5) is not the yardstick
    assert wanted("auto", report(big, 0.90, 0.90, deployed=0.5))
    assert wanted("on", report(small, 0.9, 0.1)) and not wanted("off", report(big, 0.9, 0.9))
