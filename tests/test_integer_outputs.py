"""Models whose outputs are integers (a classifier exported with its ArgMax): scored, not skipped."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.evaluate import _exact_rows
from qdebug.report_io import load_report


def _argmax_model(path, classes: int = 12, seed: int = 3):
    """MatMul -> Relu -> MatMul -> ArgMax: close logits, so int8 flips some of the predictions."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.normal(0, 0.4, (16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.2, (32, classes)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="mm2"),
        helper.make_node("ArgMax", ["logits"], ["cls"], name="pick", axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("cls", TensorProto.INT64, ["N"])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _predictions(model_path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return sess.run(["cls"], {"x": x})[0]


def test_argmax_model_scored_by_exact_match_without_labels(tmp_path):
    model = _argmax_model(tmp_path / "m.onnx")
    x = np.random.default_rng(4).normal(0, 1, (64, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.task.name == "exact_match"
    # independently: the saved quantized model's predictions against the FP32 model's
    expected = np.mean(_predictions(model, x) == _predictions(tmp_path / "r_files" / "quantized.onnx", x))
    assert report.task.fp32 == 1.0
    assert report.task.quantized == pytest.approx(expected)


def test_argmax_model_with_labels_scored_by_top1(tmp_path):
    model = _argmax_model(tmp_path / "m.onnx")
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (48, 16)).astype(np.float32)
    labels = _predictions(model, x)
    labels[::3] = (labels[::3] + 1) % 12  # a third of the labels disagree with FP32: FP32 scores ~67 %
    np.savez(tmp_path / "c.npz", x=x)
    np.savez(tmp_path / "e.npz", x=x, labels=labels)
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--eval", str(tmp_path / "e.npz")]
    assert main([*args, "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.task.name == "top1"
    assert report.task.fp32 == pytest.approx(np.mean(_predictions(model, x) == labels))
    quant = _predictions(tmp_path / "r_files" / "quantized.onnx", x)
    assert report.task.quantized == pytest.approx(np.mean(quant == labels))


def test_exact_match_refused_for_float_outputs(tmp_path, capsys):
    rng = np.random.default_rng(6)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (8, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "f",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (16, 8)).astype(np.float32))
    args = ["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "--metric", "exact_match"]
    assert main([*args, "-o", str(tmp_path / "r.json"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every output of the model is float" in err[0]
    assert not (tmp_path / "r.json").exists()


def test_exact_rows_per_sample_and_whole_batch():
    ref = {"cls": np.array([1, 2, 3, 4]), "idx": np.array([[0, 1], [1, 1], [2, 0], [3, 3]])}
    cand = {"cls": np.array([1, 0, 3, 4]), "idx": np.array([[0, 1], [1, 1], [2, 1], [3, 3]])}
    assert _exact_rows(ref, cand, ["cls"], 4) == 3
    assert _exact_rows(ref, cand, ["cls", "idx"], 4) == 2
    # not batch-major (NonZero's [rank, k] indices): the batch matches only as a whole
    nz_ref, nz_cand = {"nz": np.array([[0, 2, 3]])}, {"nz": np.array([[0, 2]])}
    assert _exact_rows(nz_ref, nz_cand, ["nz"], 4) == 0
    assert _exact_rows(nz_ref, nz_ref, ["nz"], 4) == 4
