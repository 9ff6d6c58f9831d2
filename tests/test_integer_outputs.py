"""Models whose outputs are integers (a classifier exported with its ArgMax): scored, not skipped."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.evaluation.evaluate import _exact_rows
from qdebug.output.report_io import load_report
from tests.models import save_graph


def _argmax_model(path, classes: int = 12, seed: int = 3, tail: str = "argmax"):
    """MatMul -> Relu -> MatMul -> ArgMax (or TopK-3 indices, or NonZero then ArgMax): close logits, so
    int8 flips some of the predictions."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.normal(0, 0.4, (16, 32)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.2, (32, classes)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="mm2"),
    ]
    inits = [w1, w2]
    outputs = [helper.make_tensor_value_info("cls", TensorProto.INT64, ["N"])]
    if tail == "topk":
        inits.append(numpy_helper.from_array(np.array([3], dtype=np.int64), "k"))
        nodes.append(helper.make_node("TopK", ["logits", "k"], ["top", "cls"], name="top3", axis=1))
        outputs = [helper.make_tensor_value_info("cls", TensorProto.INT64, ["N", 3])]
    else:
        nodes.append(helper.make_node("ArgMax", ["logits"], ["cls"], name="pick", axis=1, keepdims=0))
    if tail == "nonzero":  # a first output that is not one row per sample
        inits.append(numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half"))
        nodes += [
            helper.make_node("Greater", ["logits", "half"], ["hot"], name="gt"),
            helper.make_node("NonZero", ["hot"], ["where"], name="nz"),
        ]
        outputs.insert(0, helper.make_tensor_value_info("where", TensorProto.INT64, [2, "K"]))
    graph = helper.make_graph(
        nodes, "argmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])], outputs, inits
    )
    save_graph(graph, path)
    return path


def _predictions(model_path, x: np.ndarray, name: str = "cls", batch: int | None = None) -> np.ndarray:
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    if batch is None:
        return sess.run([name], {"x": x})[0]
    return [sess.run(None, {"x": x[i : i + batch]}) for i in range(0, len(x), batch)]


def _analyze(tmp_path, model, *extra) -> object:
    out = tmp_path / "r.json"
    assert (
        main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), *extra, "-o", str(out), "-q"]) == 0
    )
    return load_report(out)


def test_argmax_model_scored_by_agreement_without_labels(tmp_path):
    model = _argmax_model(tmp_path / "m.onnx")
    x = np.random.default_rng(4).normal(0, 1, (64, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    report = _analyze(tmp_path, model)
    assert report.task.name == "top1_agreement"
    # independently: the saved quantized model's predictions against the FP32 model's
    expected = np.mean(_predictions(model, x) == _predictions(tmp_path / "r_files" / "quantized.onnx", x))
    assert report.task.fp32 == 1.0
    assert 0.5 < expected < 1.0
    assert report.task.quantized == pytest.approx(expected)


def test_integer_rows_scored_by_exact_match(tmp_path):
    """TopK indices ([batch, 3] integers) are not one class per sample: a sample counts when all three
    match."""
    model = _argmax_model(tmp_path / "m.onnx", tail="topk")
    x = np.random.default_rng(4).normal(0, 1, (64, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    report = _analyze(tmp_path, model)
    assert report.task.name == "exact_match"
    ref, quant = _predictions(model, x), _predictions(tmp_path / "r_files" / "quantized.onnx", x)
    expected = np.mean((ref == quant).all(axis=1))
    assert 0.3 < expected < 1.0
    assert report.task.quantized == pytest.approx(expected)


def test_exact_match_counts_samples_not_output_rows(tmp_path):
    """A NonZero output first ([2, K], not one row per sample): the task line counted K or 2 "samples"
    (it said 4 of 24), and scored a batch row by row when K happened to equal its size."""
    model = _argmax_model(tmp_path / "m.onnx", tail="nonzero")
    x = np.random.default_rng(4).normal(0, 1, (24, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    report = _analyze(tmp_path, model, "--batch-size", "8")
    assert report.task.name == "exact_match" and report.task.samples == 24
    # independently, batch by batch: a sample matches when its ArgMax matches and its batch's NonZero does
    hits = 0
    ref = _predictions(model, x, batch=8)
    quant = _predictions(tmp_path / "r_files" / "quantized.onnx", x, batch=8)
    for (r_where, r_cls), (q_where, q_cls) in zip(ref, quant, strict=True):
        same_where = r_where.shape == q_where.shape and np.array_equal(r_where, q_where)
        hits += int(np.sum(r_cls == q_cls)) if same_where else 0
    assert report.task.quantized == pytest.approx(hits / 24)


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
    save_graph(graph, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (16, 8)).astype(np.float32))
    args = [
        "analyze",
        str(tmp_path / "m.onnx"),
        "--calib",
        str(tmp_path / "c.npz"),
        "--metric",
        "exact_match",
    ]
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


@pytest.mark.parametrize("shift, expect", [(1, "match none of the 40 labels"), (-20, "go down to -")])
def test_bad_labels_for_class_index_outputs(tmp_path, capsys, shift, expect):
    """Class-index outputs carry no class count: 1-based labels had scored 0 % for FP32 and quantized alike
    (a target would then be met trivially), and negative labels went through."""
    model = _argmax_model(tmp_path / "m.onnx")
    x = np.random.default_rng(5).normal(0, 1, (40, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    np.savez(tmp_path / "e.npz", x=x, labels=_predictions(model, x) + shift)
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--eval", str(tmp_path / "e.npz")]
    assert main([*args, "-o", str(tmp_path / "r.json"), "-q"]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0]


def test_string_outputs_are_compared(tmp_path):
    """ArgMax then a LabelEncoder to class names: exact_match compared nothing and said 100 %."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (16, 6)).astype(np.float32), "w")
    names = [f"class{i}" for i in range(6)]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["logits"], name="mm"),
            helper.make_node("ArgMax", ["logits"], ["idx"], name="pick", axis=1, keepdims=0),
            helper.make_node(
                "LabelEncoder",
                ["idx"],
                ["label"],
                name="names",
                domain="ai.onnx.ml",
                keys_int64s=list(range(6)),
                values_strings=names,
                default_string="?",
            ),
        ],
        "strings",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("label", TensorProto.STRING, ["N"])],
        [w],
    )
    save_graph(graph, tmp_path / "m.onnx", opsets={"": 17, "ai.onnx.ml": 2})
    x = rng.normal(0, 1, (48, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    report = _analyze(tmp_path, tmp_path / "m.onnx")
    assert report.task.name == "exact_match"
    expected = np.mean(
        _predictions(tmp_path / "m.onnx", x, "label")
        == _predictions(tmp_path / "r_files" / "quantized.onnx", x, "label")
    )
    assert expected < 1.0
    assert report.task.quantized == pytest.approx(expected)
