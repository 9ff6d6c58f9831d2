"""End-to-end tests of `qdebug analyze` against independent numpy computations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qdebug.cli.main import main
from qdebug.graph.instrument import with_outputs
from qdebug.graph.load import load_model, normalize
from qdebug.output.report_io import load_report
from qdebug.records import SCHEMA_VERSION
from tests.conftest import strict_json


def _session(model: onnx.ModelProto, outputs: list[str], optimize: bool = True) -> ort.InferenceSession:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name in outputs:
        m.graph.output.append(onnx.ValueInfoProto(name=name))
    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _dq_of(model: onnx.ModelProto, tensor: str) -> str:
    """Follow tensor -> QuantizeLinear -> DequantizeLinear in the test itself (no qdebug code)."""
    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0])
    return dq.output[0]


def _dq_params(model: onnx.ModelProto, dq_output: str) -> tuple[np.float32, np.ndarray]:
    """Scale and zero-point of the DequantizeLinear producing ``dq_output`` (read in the test itself)."""
    dq = next(n for n in model.graph.node if n.output[0] == dq_output)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    return np.float32(inits[dq.input[1]]), inits[dq.input[2]]


def _sqnr(ref: np.ndarray, cand: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    noise = np.sum((ref - cand) ** 2)
    return math.inf if noise == 0 else 10 * math.log10(np.sum(ref**2) / noise)


@pytest.fixture
def analyzed(cnn, tmp_path):
    model, calib = cnn
    out = tmp_path / "report.json"
    code = main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q", "--batch-size", "7"])
    assert code == 0
    return model, calib, out, load_report(out)


def test_report_is_strict_versioned_json(analyzed):
    _, _, out, report = analyzed
    raw = strict_json(out.read_text())  # no NaN/Infinity literals
    assert raw["schema_version"] == SCHEMA_VERSION
    assert report.samples == 40
    assert {n.name for n in report.nodes} >= {"conv1", "conv2", "fc"}
    # unnamed nodes got deterministic names and the map back to "" is kept
    assert ("Relu_5", "") in report.name_map and ("GlobalAveragePool_6", "") in report.name_map


def test_accumulated_and_local_match_numpy(analyzed):
    """Report numbers equal an independent computation on all captured tensors at once."""
    _, calib, _, report = analyzed
    fp32 = onnx.load(report.normalized_model)
    qdq = onnx.load(report.quantized_model.path)
    x = np.load(calib)["input"]
    checked = 0
    for tensor in ("c2", "bn2", "flat", "logits"):
        rec = report.tensor(tensor)
        ref = _session(fp32, [tensor]).run([tensor], {"input": x})[0]
        dq = _dq_of(qdq, rec.quantized_name if tensor == "logits" else tensor) if tensor != "logits" else None
        if dq is None:
            cand = _session(qdq, []).run(["logits"], {"input": x})[0]
        else:
            cand = _session(qdq, [dq]).run([dq], {"input": x})[0]
        assert rec.accumulated is not None
        assert rec.accumulated.sqnr_db == pytest.approx(_sqnr(ref, cand), abs=1e-3)
        assert rec.accumulated.max_abs == pytest.approx(float(np.max(np.abs(ref - cand))), rel=1e-4)
        assert rec.summary.min == pytest.approx(float(ref.min()), rel=1e-5)
        assert rec.summary.max == pytest.approx(float(ref.max()), rel=1e-5)
        checked += 1
        if dq is not None:
            # local error: the FP32 tensor against its own QuantizeLinear -> DequantizeLinear
            scale, zp = _dq_params(qdq, dq)
            info = np.iinfo(zp.dtype)
            q = np.clip(np.rint(ref / scale) + zp.astype(np.float32), info.min, info.max)
            post = ((q - zp.astype(np.float32)) * scale).astype(np.float32)
            assert rec.local is not None
            assert rec.local.sqnr_db == pytest.approx(_sqnr(ref, post), abs=1e-3)
            assert rec.local.max_abs == pytest.approx(float(np.max(np.abs(ref - post))), rel=1e-4)
            assert rec.local.max_abs <= float(scale) / 2 + 1e-6 or float(ref.max()) > (info.max - zp) * scale
    assert checked == 4


def test_folded_relu_is_paired_with_its_producer(analyzed):
    """ORT folds Relu into the quantization range; the pre-Relu FP32 tensor has no counterpart."""
    report = analyzed[3]
    c1 = report.tensor("c1")
    assert c1.accumulated is None and "folded" in c1.note
    r1 = report.tensor("r1")
    assert r1.accumulated is not None and r1.local is not None
    # local error of r1 (the FP32 Relu output against its own Q/DQ) is rounding only, not the negative half
    assert r1.local.sqnr_db > 30
    # the report says where the folded activation's error comes from (the producer, which propose may keep)
    producer = next(n.name for n in report.nodes if "c1" in n.outputs)
    relu = next(n.name for n in report.nodes if "r1" in n.outputs)
    note = next(n for n in report.notes if n.startswith("ORT folded"))
    assert f"{producer} -> {relu}" in note and "keep the producer FP32" in note


def test_nodes_have_introduced_error(analyzed):
    report = analyzed[3]
    fc = report.node("fc")
    assert fc.quantized
    assert math.isfinite(fc.introduced_db)
    assert fc.accumulated_sqnr_db == report.tensor("logits").accumulated.sqnr_db


def test_deployed_outputs_are_bit_identical(analyzed):
    assert analyzed[3].deployed_gap == 0.0


def test_csv_export(cnn, tmp_path):
    model, calib = cnn
    csv = tmp_path / "nodes.csv"
    assert (
        main(
            [
                "analyze",
                str(model),
                "--calib",
                str(calib),
                "-o",
                str(tmp_path / "r.json"),
                "-q",
                "--csv",
                str(csv),
            ]
        )
        == 0
    )
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("node,original_name,op_type")
    assert len(lines) == 1 + 9
    import csv as csvlib
    import math

    from qdebug.output.report_io import load_report

    rows = {r["node"]: r for r in csvlib.DictReader(csv.read_text().splitlines())}
    for node in load_report(tmp_path / "r.json").nodes:  # the CLI's ranking key is in the export too
        got = float(rows[node.name]["added_noise_db"]) if rows[node.name]["added_noise_db"] else math.nan
        assert got == pytest.approx(node.added_noise_db, rel=1e-6, nan_ok=True) or (
            math.isinf(got) and got == node.added_noise_db
        )


def test_instrumentation_is_deterministic_and_pure(cnn):
    model_path, _ = cnn
    loaded = load_model(model_path)
    before = loaded.proto.SerializeToString()
    a = normalize(loaded)
    b = normalize(loaded)
    assert a.proto.SerializeToString() == b.proto.SerializeToString()
    assert loaded.proto.SerializeToString() == before
    names = [n.output[0] for n in a.proto.graph.node]
    x = with_outputs(a.proto, names)
    y = with_outputs(a.proto, names)
    assert x.SerializeToString() == y.SerializeToString()
    assert len(a.proto.graph.output) == 1 and len(x.graph.output) == len(names)


def test_user_files_are_not_modified(cnn, tmp_path):
    model, calib = cnn
    before = (model.read_bytes(), calib.read_bytes())
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "r.json"), "-q"]) == 0
    assert (model.read_bytes(), calib.read_bytes()) == before


def test_user_supplied_quantized_model(analyzed, tmp_path):
    model, calib, _, report = analyzed
    out = tmp_path / "r2.json"
    code = main(
        [
            "analyze",
            str(model),
            "--calib",
            str(calib),
            "--quantized",
            report.quantized_model.path,
            "-o",
            str(out),
            "-q",
        ]
    )
    assert code == 0
    again = load_report(out)
    assert again.config.quantized_given
    assert again.tensor("c2").accumulated.sqnr_db == pytest.approx(report.tensor("c2").accumulated.sqnr_db)


def test_calibration_cache_is_reused(cnn, tmp_path, monkeypatch):
    model, calib = cnn
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "a.json"), "-q"]) == 0
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "b.json"), "-q"]) == 0
    a, b = load_report(tmp_path / "a.json"), load_report(tmp_path / "b.json")
    assert any("reused from cache" in n for n in b.notes)
    assert not any("reused from cache" in n for n in a.notes)
    assert a.ranges == b.ranges


@pytest.mark.parametrize("method", ["entropy", "percentile"])
def test_histogram_methods_with_a_smaller_last_batch(cnn, tmp_path, capsys, method):
    """ORT's histogram calibrators stack batches; 40 samples in batches of 16 must still work."""
    model, calib = cnn
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "analyze",
                str(model),
                "--calib",
                str(calib),
                "-o",
                str(out),
                "-q",
                "--batch-size",
                "16",
                "--method",
                method,
            ]
        )
        == 0
    )
    stdout = capsys.readouterr().out
    assert "Number of quantized bins" not in stdout  # ORT's prints go to stderr, stdout stays data
    assert load_report(out).config.method == method


def test_dynamic_quantized_model_is_analyzed_by_graph_position(tmp_path):
    """`analyze --quantized` accepts a quantize_dynamic model: accumulated error only, paired structurally."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from tests.conftest import fixture_path

    base = fixture_path("transformer")
    dyn = tmp_path / "dyn.onnx"
    quantize_dynamic(str(base / "model.onnx"), str(dyn), weight_type=QuantType.QInt8)
    out = tmp_path / "dyn.json"
    assert (
        main(
            [
                "analyze",
                str(base / "model.onnx"),
                "--calib",
                str(base / "calib.npz"),
                "--quantized",
                str(dyn),
                "-o",
                str(out),
                "-q",
                "--max-samples",
                "32",
            ]
        )
        == 0
    )
    report = load_report(out)
    assert any("dynamic quantization" in n for n in report.notes)
    matmuls = [n for n in report.nodes if n.op_type == "MatMul" and n.name.endswith("q_matmul")]
    assert matmuls and all(n.quantized for n in matmuls)
    q = report.tensor(matmuls[0].outputs[0])
    assert q.accumulated is not None and math.isfinite(q.accumulated.sqnr_db) and q.local is None


@pytest.mark.parametrize("engine", ["graph", "numpy"])
def test_fakequant_samples_limits_the_fake_quant_view(cnn, tmp_path, engine):
    model, calib = cnn
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q", "--batch-size", "8"]
    assert main([*args, "--fakequant-samples", "16", "--engine", engine]) == 0
    report = load_report(out)
    assert report.samples == 40 and report.config.fakequant_samples == 16
    c2 = report.tensor("c2")
    assert c2.accumulated_fakequant.count == 16 * 4 * 8 * 8  # two batches of 8: 16 samples of a 4x8x8 tensor
    assert c2.accumulated.count == c2.local.count == 40 * 4 * 8 * 8  # local error is measured on every sample
    assert any("first 16 of 40 calibration samples" in n for n in report.notes)
    assert math.isfinite(report.task.quantized_fakequant)
    assert main([*args, "--fakequant-samples", "0", "--engine", engine]) == 0
    report = load_report(out)
    assert report.tensor("c2").accumulated_fakequant is None and math.isnan(report.task.quantized_fakequant)
    assert main([*args, "--fakequant-samples", "all", "--engine", engine]) == 0
    assert load_report(out).tensor("c2").accumulated_fakequant.count == 40 * 4 * 8 * 8


def test_fakequant_samples_rejects_bad_values(cnn, tmp_path, capsys):
    model, calib = cnn
    args = ["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "r.json"), "-q"]
    assert main([*args, "--fakequant-samples", "-3"]) == 2
    err = capsys.readouterr().err
    assert "--fakequant-samples" in err and "Traceback" not in err


def test_kernel_gap_compares_the_same_samples(analyzed):
    """The deployed side of the kernel gap covers the samples the fake-quant view saw, not the whole run."""
    import dataclasses

    from qdebug.analysis import kernel_gap_notes

    report = analyzed[3]
    rec = report.tensor("c2")
    assert rec.accumulated_fakequant is not None
    fq = rec.accumulated_fakequant.sqnr_db
    bad_overall = dataclasses.replace(rec, accumulated=dataclasses.replace(rec.accumulated, sqnr_db=fq - 10))
    assert kernel_gap_notes((bad_overall,)), "a 10 dB gap over the whole run is called out"
    same = {"c2": dataclasses.replace(rec.accumulated, sqnr_db=fq - 0.5)}
    assert kernel_gap_notes((bad_overall,), same) == [], "on the same samples there is no gap"


def test_the_report_keeps_the_nodes_the_kernel_gap_note_names(analyzed):
    """kernel_gap_nodes (written to the report) is the note's rule with the note's arguments: the same
    nodes in the same order, on the same samples; () where no gap opens."""
    import dataclasses

    from qdebug.analysis import kernel_gap_nodes, kernel_gap_notes

    report = analyzed[3]
    assert report.kernel_gap_nodes == kernel_gap_nodes(report.tensors, nodes=report.nodes)
    c2, bn2 = report.tensor("c2"), report.tensor("bn2")

    def gap(t, db):
        deployed = dataclasses.replace(t.accumulated, sqnr_db=t.accumulated_fakequant.sqnr_db - db)
        return dataclasses.replace(t, accumulated=deployed)

    gapped = (gap(c2, 4.0), gap(bn2, 9.0))  # without node records each tensor is its own start
    assert kernel_gap_nodes(gapped) == ("bn2", "conv2")  # largest gap first, as the note lists them
    (note,) = kernel_gap_notes(gapped)
    assert note.index("from bn2") < note.index("from conv2")
    same = {"bn2": dataclasses.replace(bn2.accumulated, sqnr_db=bn2.accumulated_fakequant.sqnr_db)}
    assert kernel_gap_nodes(gapped, same) == ("conv2",)  # on the fake-quant view's samples bn2 has no gap


def test_kernel_gap_note_names_where_the_gap_opens(analyzed):
    """A gap the producer's inputs already carry is inherited: the note names the node where it opens (it
    had named the tensors with the largest gap, three nodes downstream, and advised keeping those FP32)."""
    import dataclasses

    from qdebug.analysis import kernel_gap_notes

    report = analyzed[3]

    def with_gap(name: str, gap: float):
        rec = report.tensor(name)
        fq = rec.accumulated_fakequant.sqnr_db
        return dataclasses.replace(rec, accumulated=dataclasses.replace(rec.accumulated, sqnr_db=fq - gap))

    # conv2 opens a 6 dB gap on c2; bn2 and the rest only carry it on (a little wider)
    tensors = (with_gap("r1", 0.0), with_gap("c2", 6.0), with_gap("bn2", 8.0))
    (note,) = kernel_gap_notes(tensors, nodes=report.nodes)
    assert "the gap opens at c2 (from conv2)" in note and "keep conv2 out of INT8" in note
    assert "bn2 (from" not in note and "1 tensor(s) downstream inherit it" in note
    # without node records every tensor counts as its own start, largest first
    (plain,) = kernel_gap_notes(tensors)
    assert plain.index("bn2 (from bn2)") < plain.index("c2 (from conv2)")
    # a gap first seen after a Relu ORT folded into conv1's output Q is conv1's kernel, not the Relu's
    assert "folded" in report.tensor("c1").note  # the premise: c1 has no views of its own
    relu1 = report.tensor("r1").producer
    (folded,) = kernel_gap_notes((report.tensor("c1"), with_gap("r1", 6.0), with_gap("c2", 6.0)), nodes=report.nodes)
    assert f"r1 (from conv1, {relu1} folded into it)" in folded and "keep conv1 out of INT8" in folded


def test_demo_runs_the_whole_loop(tmp_path, capsys):
    """`qdebug demo` is the Quick start's main job: analyze, propose and verify the bundled model."""
    from qdebug.output.report_io import load_report

    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "-q"]) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    report = load_report(out / "report.json")
    assert report.task is not None and report.task.fp32 - report.task.quantized > 0.05  # the designed drop
    assert (out / "proposal.json").is_file() and (out / "verify.json").is_file()
    verdict = json.loads((out / "verify.json").read_text())["verdict"]
    assert verdict in stdout and "Explore it interactively:  qdebug tui" in stdout
    # where the bundled files are (inside the installed package), so the README's steps can be run on them
    from qdebug.cli.demo import demo_files

    err = captured.err
    assert all(f"{what}: {path}" in err for what, path in zip(("model", "calibration data", "evaluation data"),
                                                             demo_files(), strict=True))  # fmt: skip


def _two_heads(path: Path) -> Path:
    """x -> Gemm -> Relu -> {class scores (~1), box regression (~1e3)}: two float outputs."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.models import save_graph

    rng = np.random.default_rng(6)
    shapes = {"w1": (16, 32), "wr": (32, 2), "wc": (32, 7)}
    scale = {"w1": 0.3, "wr": 300.0, "wc": 0.3}
    inits = [numpy_helper.from_array(rng.normal(0, scale[n], s).astype(np.float32), n) for n, s in shapes.items()]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["g1"], name="trunk"),
        helper.make_node("Relu", ["g1"], ["feat"], name="relu"),
        helper.make_node("MatMul", ["feat", "wc"], ["scores"], name="cls_head"),
        helper.make_node("MatMul", ["feat", "wr"], ["box"], name="reg_head"),
    ]
    outputs = [
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 7]),
        helper.make_tensor_value_info("box", TensorProto.FLOAT, ["N", 2]),
    ]
    graph = helper.make_graph(
        nodes, "two_heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])], outputs, inits
    )
    return save_graph(graph, path, opsets={"": 17})


def test_eval_values_beyond_the_calibrated_range_and_unscored_heads_are_named(tmp_path):
    """Evaluation samples that drive an output past everything calibration saw are clipped, and the
    report's per-tensor numbers (calibration data) do not show it: a note names the output, how many
    samples and its producer. The default top1_agreement reads the first head only: a note says so."""
    model = _two_heads(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (64, 16)).astype(np.float32))
    x = rng.normal(0, 1, (40, 16)).astype(np.float32)
    x[:3] *= 6.0  # three samples far outside the calibration data
    np.savez(tmp_path / "e.npz", x=x)
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--eval", str(tmp_path / "e.npz")]
    assert main([*args, "-o", str(out), "-q"]) == 0
    report = load_report(out)
    # an independent count: eval samples whose FP32 box leaves [calibrated min, max] (MinMax: the same range)
    box = ort.InferenceSession(str(model)).run(["box"], {"x": x})[0]
    lo, hi = report.tensor("box").summary.min, report.tensor("box").summary.max
    beyond = int(((box < lo) | (box > hi)).any(axis=1).sum())
    assert beyond >= 3  # the premise
    note = next(n for n in report.notes if n.startswith("evaluation data drives output 'box'"))
    assert f"on {beyond} of 40 samples" in note and "keep reg_head FP32" in note
    scope = next(n for n in report.notes if n.startswith("the task metric (top1_agreement)"))
    assert "reads the first output 'scores' only: float output(s) 'box' count only through the output SQNR" in scope
    # evaluation data inside the calibrated range: no range note
    np.savez(tmp_path / "e2.npz", x=x[3:] * 0.5)
    args[-1] = str(tmp_path / "e2.npz")
    assert main([*args, "-o", str(out), "-q"]) == 0
    assert not any(n.startswith("evaluation data drives") for n in load_report(out).notes)


def test_output_sqnr_metric_is_the_worst_heads_and_ints_are_named(tmp_path):
    """output_sqnr_db pooled every output: the ~1e3 box head drowned the class scores' error, and the task
    metric and verify's "output SQNR" row (the worst output) were two numbers under one name. It is the
    worst float output's SQNR now, computed here independently with plain ORT."""
    model = _two_heads(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (64, 16)).astype(np.float32))
    x = rng.normal(0, 1, (40, 16)).astype(np.float32) * 0.5
    np.savez(tmp_path / "e.npz", x=x)
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--eval", str(tmp_path / "e.npz")]
    assert main([*args, "--metric", "output_sqnr_db", "-o", str(out), "-q"]) == 0
    report = load_report(out)
    ref = ort.InferenceSession(str(model)).run(None, {"x": x})
    cand = ort.InferenceSession(report.quantized_model.path).run(None, {"x": x})
    sqnr = [
        10 * math.log10(float((r.astype(np.float64) ** 2).sum()) / float(((r - c).astype(np.float64) ** 2).sum()))
        for r, c in zip(ref, cand, strict=True)
    ]
    assert abs(sqnr[0] - sqnr[1]) > 0.5  # the premise: the heads differ (pooled, the box head would win)
    assert report.task.quantized == pytest.approx(min(sqnr), abs=1e-6)
    assert not any(n.startswith("the task metric") for n in report.notes)  # every output is float


def test_float_ops_between_quantized_ones_are_not_quantized(tmp_path):
    """ReduceMean reads the DQ output LayerNormalization's quantization left and its output is quantized
    for the MatMul after it -- the pattern of a quantized node -- but ORT has no integer ReduceMean: it had
    been reported quantized (as contrib ops like MultiHeadAttention were)."""
    from tests.models import embedding_classifier

    model = embedding_classifier(tmp_path / "m.onnx")
    ids = np.random.default_rng(0).integers(0, 50, (16, 8)).astype(np.int64)
    np.savez(tmp_path / "c.npz", input_ids=ids)
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    qdq = onnx.load(report.quantized_model.path)
    pool = next(n for n in qdq.graph.node if n.op_type == "ReduceMean")
    producers = {o: n.op_type for n in qdq.graph.node for o in n.output}
    assert producers[pool.input[0]] == "DequantizeLinear"  # the premise
    assert not report.node("pool").quantized
    assert report.node("ln").quantized and report.node("cls").quantized


def _conv_split_model(path: Path) -> Path:
    """Conv -> Relu -> Split -> Conv on one half + the other half -> mean -> Gemm (int8 activations make
    ORT's fusions here depend on which tensors are graph outputs)."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.models import save_graph

    rng = np.random.default_rng(13)
    shapes = {"cw": (8, 3, 3, 3), "cb": (8,), "cw2": (4, 4, 3, 3), "cb2": (4,), "fw": (4, 10), "fb": (10,)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in shapes.items()]
    inits += [
        numpy_helper.from_array(np.array([4, 4], np.int64), "split"),
        numpy_helper.from_array(np.array([2, 3], np.int64), "sax"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "cw", "cb"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Split", ["r1", "split"], ["s1", "s2"], name="split", axis=1),
        helper.make_node("Conv", ["s1", "cw2", "cb2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "s2"], ["a"], name="add"),
        helper.make_node("ReduceMean", ["a"], ["m"], name="gap", axes=[2, 3], keepdims=1),
        helper.make_node("Squeeze", ["m", "sax"], ["sq"], name="squeeze"),
        helper.make_node("Gemm", ["sq", "fw", "fb"], ["logits"], name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    return save_graph(graph, path, opsets={"": 13})


def test_a_fusion_the_instrumentation_breaks_is_noted(tmp_path):
    """With int8 activations ORT stops fusing a Conv whose DQ output is a graph output: the instrumented
    model then computes in float what the deployed one computes in int8, and the per-layer numbers missed
    the deployed loss (39.7 dB per layer against 13.0 dB at the output, no word). A note now gives both
    output SQNRs of the first batch; the deployed one is checked here with plain ORT."""
    model = _conv_split_model(tmp_path / "m.onnx")
    x = np.random.default_rng(0).random((32, 3, 12, 12), dtype=np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--batch-size", "16", "-o", str(out), "-q"]
    assert main([*args, "--activation-type", "QInt8"]) == 0
    report = load_report(out)
    ref = ort.InferenceSession(str(model)).run(None, {"x": x[:16]})[0].astype(np.float64)

    def sqnr(level: ort.GraphOptimizationLevel) -> float:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = level
        got = ort.InferenceSession(report.quantized_model.path, opts).run(None, {"x": x[:16]})[0]
        return 10 * math.log10((ref**2).sum() / ((ref - got) ** 2).sum())

    deployed = sqnr(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    fake_quant = sqnr(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    notes = [n for n in report.notes if n.startswith("the deployed quantized model's outputs are worse")]
    if fake_quant - deployed <= 3:
        # this CPU's int8 kernels lose nothing here (AVX512-VNNI computes the same products exactly): a
        # note would be a false alarm
        assert notes == []
        return
    note = notes[0]
    assert f"({deployed:.1f} against" in note
    instrumented = float(note.split(" against ")[1].split(" dB")[0])
    assert instrumented > deployed + 3
    assert main(args) == 0  # uint8 activations (the default) keep the fusions: no such note
    assert not any(n.startswith("the deployed quantized model's") for n in load_report(out).notes)


def test_the_eval_range_note_counts_samples_not_values(tmp_path):
    """An output without a batch axis (a fixed batch of 1 reshaped to [4]) had its values counted as samples:
    "outside its calibrated range on 29 of 10 samples". Each evaluation batch counts as its samples."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.models import save_graph

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
        helper.make_node("Reshape", ["mm", "shp"], ["out"], name="flat"),
    ]
    graph = helper.make_graph(
        nodes,
        "flat",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])],
        [
            numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([4], np.int64), "shp"),
        ],
    )
    model = save_graph(graph, tmp_path / "m.onnx", opsets={"": 17})
    np.savez(tmp_path / "c.npz", x=rng.standard_normal((20, 8)).astype(np.float32))
    x = (5 * rng.standard_normal((10, 8))).astype(np.float32)
    np.savez(tmp_path / "e.npz", x=x)
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--eval", str(tmp_path / "e.npz")]
    assert main([*args, "-o", str(out), "-q"]) == 0
    report = load_report(out)
    rec = report.tensor("out")
    sess = ort.InferenceSession(str(model))
    outputs = [sess.run(None, {"x": x[i : i + 1]})[0] for i in range(10)]
    beyond = sum(bool(((o < rec.summary.min) | (o > rec.summary.max)).any()) for o in outputs)
    assert beyond > 0  # the premise
    note = next(n for n in report.notes if n.startswith("evaluation data drives output 'out'"))
    assert f"on {beyond} of 10 samples" in note
    assert "keep mm FP32" in note  # the MatMul that computes it, not the Reshape that only moves it


def test_top1_agreement_is_a_share_when_the_output_has_no_batch_axis(tmp_path):
    """A recognizer's [T, classes] output at batch 1 made top1_agreement count T positions per sample (1600 %
    on 16 timesteps): it is the share of the predictions that agree."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.models import save_graph

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.normal(0, 1, (8, 5)).astype(np.float32), "w")
    shape = numpy_helper.from_array(np.array([16, 8], np.int64), "shape")
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["xs"], name="flat"),
        helper.make_node("MatMul", ["xs", "w"], ["logits"], name="mm"),
    ]
    graph = helper.make_graph(
        nodes,
        "rec",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [16, 5])],
        [w, shape],
    )
    model = save_graph(graph, tmp_path / "m.onnx", opsets={"": 17})
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (1, 16, 8)).astype(np.float32))
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--metric", "top1_agreement"]
    assert main([*args, "-o", str(out), "-q"]) == 0
    task = load_report(out).task
    assert 0.0 <= task.quantized <= 1.0 and task.fp32 == 1.0
