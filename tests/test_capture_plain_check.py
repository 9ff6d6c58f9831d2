"""Contracts of the capture's check that instrumentation changed nothing (measure._plain_check,
``measure_layers(plain=...)``) and of pipeline._Deployed / _scored_on_eval: the check runs on the first
batch's first rows (a chunk's worth, own copies, when the capture chunks), on the session ``plain``
opens, and reports (plain, instrumented) SQNRs in that order; a retried capture (its FP32 side not the
recorded one) still uses ``plain`` and keeps the sides; the evaluation scores on the check's session only
with the evaluator's settings, carries its start-up time, and lets it go."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug import pipeline
from qdebug.analysis import measure_layers
from qdebug.analysis.reference import SharedReference
from qdebug.data import model_input_specs, open_data
from qdebug.evaluation.evaluate import Evaluator
from qdebug.graph.match import pair_models
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.runtime.capture import SessionConfig, make_session
from tests.conftest import FIXTURES


class _Recorded:
    """An ORT session whose runs' feeds are kept."""

    def __init__(self, session) -> None:
        self.session = session
        self.feeds: list[dict[str, np.ndarray]] = []

    def get_inputs(self):
        return self.session.get_inputs()

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, names, feeds):
        self.feeds.append(dict(feeds))
        return self.session.run(names, feeds)


def _prepared(model: Path, calib: Path, tmp: Path):
    prep = prepare(model, calib, tmp, AnalyzeOptions(use_cache=False))
    qproto = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(), load_check=False)
    return prep, qproto, pair_models(prep.normalized, qproto)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Conv model whose largest tensor (64 K elements a sample) makes the capture cut its batches of 16
    into chunks of 8; 32 calibration samples, two batches."""
    tmp = tmp_path_factory.mktemp("wide")
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.normal(0, 0.2, (16, 8, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "b")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["y"], name="flat"),
    ]
    graph = helper.make_graph(
        nodes, "wide", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])], [w, b],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp / "model.onnx")
    np.savez(tmp / "calib.npz", x=rng.normal(0, 1, (32, 8, 64, 64)).astype(np.float32))
    return _prepared(tmp / "model.onnx", tmp / "calib.npz", tmp / "work")


def test_the_check_runs_on_own_copies_of_the_first_batchs_first_chunk(wide):
    prep, qproto, pairing = wide
    recorded: list[_Recorded] = []

    def plain():
        recorded.append(_Recorded(make_session(qproto, SessionConfig(), what="quantized model")))
        return recorded[-1]

    layers = measure_layers(prep.normalized, qproto, pairing, prep.calib, SessionConfig(), plain=plain)
    assert len(recorded) == 1 and len(recorded[0].feeds) == 1  # one session, one run
    (feeds,) = recorded[0].feeds
    first = next(iter(prep.calib.batches())).feeds["x"]
    assert first.shape[0] == 16
    x = feeds["x"]
    assert 0 < x.shape[0] < 16, x.shape  # a chunk's rows, not the whole batch
    assert np.array_equal(x, first[: x.shape[0]])  # the first batch's first rows
    assert x.flags.owndata and not np.shares_memory(x, first)  # a copy: the batch is not kept alive
    assert layers.deployed_gap == 0.0 and layers.first_batch_sqnr is not None


def test_the_sqnrs_are_plain_then_instrumented(tmp_path):
    """With ``plain`` opening the FP32 model (the check cannot tell), the first SQNR is the plain session's
    (FP32 against FP32: no noise), the second the instrumented quantized model's, and the gap is theirs."""
    prep, qproto, pairing = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp_path)
    config = SessionConfig()
    layers = measure_layers(
        prep.normalized, qproto, pairing, prep.calib, config, plain=lambda: make_session(prep.normalized, config)
    )
    plain_sqnr, instrumented_sqnr = layers.first_batch_sqnr
    assert plain_sqnr > 100 and instrumented_sqnr < 60, layers.first_batch_sqnr
    assert layers.deployed_gap > 0
    honest = measure_layers(prep.normalized, qproto, pairing, prep.calib, config)
    assert math.isclose(honest.first_batch_sqnr[1], instrumented_sqnr, rel_tol=1e-9)
    assert honest.first_batch_sqnr[0] == pytest.approx(instrumented_sqnr, abs=1e-6)


def test_a_capture_measured_again_in_full_still_checks_on_plain_and_keeps_its_sides(tmp_path):
    prep, qproto, pairing = _prepared(
        FIXTURES / "transformer" / "model.onnx", FIXTURES / "transformer" / "calib.npz", tmp_path
    )
    fp32, config = prep.normalized, SessionConfig()
    specs = model_input_specs(fp32)
    other = tmp_path / "other.npz"
    np.savez(other, input=np.random.default_rng(0).normal(0, 1, (32, 8, 8)).astype(np.float32))
    shared = SharedReference()
    data = open_data(FIXTURES / "transformer" / "calib.npz", specs, batch_size=16, max_samples=32)
    measure_layers(fp32, qproto, pairing, data, config, fakequant_samples=16, shared=shared)
    assert shared.complete
    opened = []

    def plain():
        opened.append(1)
        return make_session(qproto, config, what="quantized model")

    data = open_data(other, specs, batch_size=16, max_samples=32)
    layers = measure_layers(
        fp32, qproto, pairing, data, config, fakequant_samples=16, shared=shared, plain=plain, keep_sides=True
    )
    assert shared.refused == 1  # measured again, without the recorded FP32 side
    assert opened == [1] and layers.deployed_gap == 0.0
    assert layers.sides is not None and layers.sides.fp32.is_file() and layers.sides.qdq.is_file()
    layers.sides.cleanup()


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scored")
    prep, qproto, _ = _prepared(FIXTURES / "cnn" / "model.onnx", FIXTURES / "cnn" / "calib.npz", tmp)
    eval_set = open_data(FIXTURES / "cnn" / "eval.npz", model_input_specs(prep.normalized), batch_size=64)
    evaluator = Evaluator(prep.normalized, eval_set, SessionConfig(), None)
    return qproto, evaluator


def test_the_deployed_session_is_opened_once_and_scored_with_its_start_up_then_let_go(scored):
    qproto, evaluator = scored
    deployed = pipeline._Deployed(qproto, SessionConfig())
    session = deployed()
    assert deployed() is session  # opened at most once
    alive = weakref.ref(session)
    deployed.seconds = 1000.0  # its start-up, as the check's call measured it: part of the score's time
    del session
    task, result = pipeline._scored_on_eval(evaluator, qproto, False, deployed)
    assert result.seconds >= 1000.0
    assert result.value == evaluator.score(qproto).value and result.samples == evaluator.samples
    assert deployed.session is None
    gc.collect()
    assert alive() is None  # nothing holds the quantized model's session after the evaluation


def test_a_deployed_session_with_other_settings_is_not_scored_on(scored):
    qproto, evaluator = scored
    other = SessionConfig(intra_op_threads=1)
    assert other != evaluator.config
    deployed = pipeline._Deployed(qproto, other)
    deployed()
    deployed.seconds = 1000.0
    _, result = pipeline._scored_on_eval(evaluator, qproto, False, deployed)
    assert result.seconds < 1000.0  # scored on a session of the evaluator's settings instead
    assert result.value == evaluator.score(qproto).value


def test_the_gap_covers_every_graph_output(tmp_path):
    """A plain session that differs from the instrumented model only on the second graph output (the
    embedding, shifted by 1 -- ORT may then fuse that branch otherwise, so by more than 1 in places) shows in
    the gap: the check compares every output, not the first."""
    root = FIXTURES / "robustness"
    prep, qproto, pairing = _prepared(root / "multi_io.onnx", root / "multi_io_calib.npz", tmp_path)
    assert [o.name for o in qproto.graph.output] == ["logits", "embedding"]
    shifted = onnx.ModelProto()
    shifted.CopyFrom(qproto)
    g = shifted.graph
    producer = next(n for n in g.node if "embedding" in n.output)
    producer.output[list(producer.output).index("embedding")] = "embedding_unshifted"
    for node in g.node:  # the logits still read the embedding as it was
        for k, name in enumerate(node.input):
            if name == "embedding":
                node.input[k] = "embedding_unshifted"
    g.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), "qdbg_test_one"))
    g.node.append(helper.make_node("Add", ["embedding_unshifted", "qdbg_test_one"], ["embedding"], name="shift"))
    config = SessionConfig()
    layers = measure_layers(
        prep.normalized, qproto, pairing, prep.calib, config, plain=lambda: make_session(shifted, config)
    )
    assert layers.deployed_gap > 0.5
    honest = measure_layers(prep.normalized, qproto, pairing, prep.calib, config)
    assert honest.deployed_gap < 1e-3
