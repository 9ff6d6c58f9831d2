"""Real-world graphs (issue 6): every robustness fixture works end to end or stops with one clear line.

Each test runs the CLI in-process: an unexpected exception would surface here as a
traceback and fail the test, so "exit code + one-line message" is what is proven.
The table in docs/robustness.md points at these tests.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from qdebug.cli.main import main
from qdebug.errors import ExitCode
from qdebug.output.report_io import load_report
from tests.conftest import ROOT, analyze_args, analyze_with_both_engines, fixture_path
from tests.models import (
    branch_reads_outer_weight,
    embedding_classifier,
    masked_attention,
    save_graph,
    sequence_split,
    small_cnn,
    small_data,
)

SMALL = ["-q", "--max-samples", "16"]


def rob(name: str) -> Path:
    return fixture_path("robustness", name)


def run(args, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    return code, err


def analyze(name: str, out: Path, capsys, *extra, calib: Path | None = None):
    calib = calib or rob(f"{name}_calib.npz")
    code, err = run(["analyze", rob(f"{name}.onnx"), "--calib", calib, "-o", out, *SMALL, *extra], capsys)
    assert code == 0, err
    return load_report(out)


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("qdebug: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def scored(report) -> set[str]:
    return {t.name for t in report.tensors if t.accumulated is not None}


# --------------------------------------------------------------------------- names


def test_unnamed_nodes_get_unique_deterministic_names(tmp_path, capsys):
    report = analyze("unnamed", tmp_path / "r.json", capsys)
    names = [n.name for n in report.nodes]
    assert all(names) and len(set(names)) == len(names)
    assert sum(1 for _, old in report.name_map if old == "") == 5
    assert any("named 5 unnamed" in n for n in report.notes)
    assert any(n.quantized for n in report.nodes if (n.name, "") in report.name_map)


def test_duplicate_node_names_are_made_unique(tmp_path, capsys):
    model = onnx.load(str(fixture_path("cnn", "model.onnx")))
    for node in model.graph.node[1:3]:
        node.name = model.graph.node[0].name
    onnx.save(model, str(tmp_path / "dup.onnx"))
    code, err = run(
        [
            "analyze",
            tmp_path / "dup.onnx",
            "--calib",
            fixture_path("cnn", "calib.npz"),
            "-o",
            tmp_path / "r.json",
            *SMALL,
        ],
        capsys,
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    names = [n.name for n in report.nodes]
    assert len(set(names)) == len(names)
    assert any("not unique" in n for n in report.notes)
    dup = model.graph.node[0].name
    assert sum(1 for new, old in report.name_map if old == dup and new != dup) == 2


# --------------------------------------------------------------------------- several inputs, dynamic shapes


def _propose_verify_bench(model: Path, calib: Path, report: Path, tmp: Path, capsys, *verify_extra) -> dict:
    code, err = run(["propose", report, "-o", tmp / "p.json", "-q", "--max-evaluations", "6"], capsys)
    assert code in (0, ExitCode.TARGET_NOT_MET), err
    assert (tmp / "p.selective.onnx").is_file()
    code, err = run(
        [
            "verify",
            model,
            "--calib",
            calib,
            "--proposal",
            tmp / "p.json",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--max-samples",
            "16",
            "-q",
            *verify_extra,
        ],
        capsys,
    )
    assert code in (0, ExitCode.TARGET_NOT_MET), err
    code, err = run(
        [
            "bench",
            model,
            "--calib",
            calib,
            "--proposal",
            tmp / "p.json",
            "--variants",
            "fp32,static,selective",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--max-samples",
            "16",
            "-o",
            tmp / "b.json",
            "-q",
        ],
        capsys,
    )
    assert code == 0, err
    return json.loads((tmp / "b.json").read_text())


def test_multi_io_end_to_end(tmp_path, capsys):
    report = analyze("multi_io", tmp_path / "r.json", capsys)
    assert {"image", "features"} <= scored(report)
    assert {o.name for o in report.outputs} == {
        "logits",
        "embedding",
    }  # an intermediate that is also an output
    assert all(math.isfinite(o.error.sqnr_db) for o in report.outputs)
    bench = _propose_verify_bench(
        rob("multi_io.onnx"), rob("multi_io_calib.npz"), tmp_path / "r.json", tmp_path, capsys
    )
    assert {v["name"] for v in bench["variants"]} == {"fp32", "static", "selective"}


def test_dynamic_sequence_lengths_from_a_folder_end_to_end(tmp_path, capsys):
    folder = rob("dynamic_calib")
    shapes = [np.load(f)["x"].shape for f in sorted(folder.glob("*.npz"))]
    assert len({s[1] for s in shapes}) == 4  # batches of 4 different sequence lengths
    code, err = run(
        ["analyze", rob("dynamic.onnx"), "--calib", folder, "-o", tmp_path / "r.json", "-q"], capsys
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    assert report.samples == sum(s[0] for s in shapes)
    x = next(t for t in report.tensors if t.name == "x")
    assert x.summary.count == sum(int(np.prod(s)) for s in shapes)  # every batch, every length, was seen
    assert all(t.accumulated is not None for t in report.tensors if t.quant is not None)
    _propose_verify_bench(
        rob("dynamic.onnx"), folder, tmp_path / "r.json", tmp_path, capsys, "--target-sqnr", "20"
    )


# --------------------------------------------------------------------------- integer tensors


def test_integer_tensors_are_never_scored(tmp_path, capsys):
    report = analyze("int_ops", tmp_path / "r.json", capsys)
    reasons = {n.name: n.reason for n in report.not_captured}
    ints = {"shape/of_input_out", "shape/batch_out", "shape/unsqueeze_out", "shape/concat_out"}
    assert ints <= set(reasons)
    assert all("int64" in reasons[n] and "not scored" in reasons[n] for n in ints)
    assert not ints & {t.name for t in report.tensors}
    assert "fc1/matmul_out" in scored(report)


def test_int64_inputs(tmp_path, capsys):
    report = analyze("int64_inputs", tmp_path / "r.json", capsys)
    reasons = {n.name: n.reason for n in report.not_captured}
    assert "int64" in reasons["input_ids"] and "int64" in reasons["attention_mask"]
    assert {"embed/gather_out", "logits"} <= scored(report)
    assert "embed.table" in {w.name for w in report.weights}


# --------------------------------------------------------------------------- graph oddities


def test_input_listed_as_output_is_normalized(tmp_path, capsys):
    report = analyze("input_as_output", tmp_path / "r.json", capsys)
    note = next(n for n in report.notes if "Identity" in n)
    assert "Graph is not a DAG" in note and "x -> x__out" in note
    assert {o.name for o in report.outputs} == {"y", "x__out"}


def test_passed_through_inputs_and_weights_stay_exact(tmp_path):
    """Two relatives of an initializer listed as an output: the user's own Identity of a weight a MatMul
    reads too (anchors), and a graph input passed to an output (normalization's Identity). ORT rewires
    every reader of a quantized tensor to its DequantizeLinear output, so both left the quantized model
    quantized (56 and 54 dB); nothing is computed on those paths, and both stay exact now."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    anchors = rng.normal(0, 30, (8, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "anchors"], ["y"], name="mm"),
        helper.make_node("Identity", ["anchors"], ["anchors_out"], name="anchors_id"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("anchors_out", TensorProto.FLOAT, [8, 8]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
        ],
        [numpy_helper.from_array(anchors, "anchors")],
    )
    save_graph(graph, tmp_path / "m.onnx")
    x = rng.normal(0, 1, (32, 8)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    out = tmp_path / "r.json"
    assert main(["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    errors = {o.name: o.error for o in report.outputs}
    assert errors["x__out"].max_abs == 0 and errors["anchors_out"].max_abs == 0
    assert errors["y"].sqnr_db < 60  # the MatMul itself is still quantized
    sess = ort.InferenceSession(str(tmp_path / "r_files" / "quantized.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x}), strict=True))
    np.testing.assert_array_equal(got["x__out"], x)
    np.testing.assert_array_equal(got["anchors_out"], anchors)


def test_initializer_outputs_stay_exact(tmp_path, capsys):
    """An initializer listed as a graph output is model data: it left the quantized model exact when nothing
    else read it, but quantized (45 dB) when a MatMul read it too -- ORT rewires every consumer of a quantized
    weight to its DequantizeLinear output. Both now stay exact, in the report and in the saved QDQ model."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.3, (8, 4)).astype(np.float32)
    anchors = rng.normal(0, 30, (100, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 4]),
            helper.make_tensor_value_info("anchors", TensorProto.FLOAT, [100, 4]),
        ],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(anchors, "anchors")],
    )
    save_graph(graph, tmp_path / "m.onnx")
    x = rng.normal(0, 1, (32, 8)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    out = tmp_path / "r.json"
    assert (
        main(["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"])
        == 0
    )
    report = load_report(out)
    errors = {o.name: o.error for o in report.outputs}
    assert errors["w__out"].max_abs == 0 and errors["anchors__out"].max_abs == 0
    assert errors["y"].sqnr_db < 60  # the MatMul itself is still quantized
    assert "w" in {r.name for r in report.weights}
    sess = ort.InferenceSession(
        str(tmp_path / "r_files" / "quantized.onnx"), providers=["CPUExecutionProvider"]
    )
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x}), strict=True))
    np.testing.assert_array_equal(got["w__out"], w)
    np.testing.assert_array_equal(got["anchors__out"], anchors)
    assert any("w are graph outputs and also read by nodes" in n for n in report.notes)


def test_initializer_listed_twice_as_output(tmp_path):
    """ORT runs a model listing the same initializer twice as an output; normalization gave both pass-through
    Identity nodes one name, and calibration failed (exit 4, 'two nodes with same node name')."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.3, (8, 4)).astype(np.float32)
    out_w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 4])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]), out_w, out_w],
        [numpy_helper.from_array(w, "w")],
    )
    save_graph(graph, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (16, 8)).astype(np.float32))
    out = tmp_path / "r.json"
    assert (
        main(["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"])
        == 0
    )
    errors = {o.name: o.error for o in load_report(out).outputs}
    assert len(errors) == 3 and all(errors[n].max_abs == 0 for n in errors if n != "y")


def test_initializers_listed_as_inputs(tmp_path, capsys):
    model = onnx.load(str(fixture_path("cnn", "model.onnx")))
    for init in model.graph.initializer:  # what IR < 4 exporters write
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    onnx.save(model, str(tmp_path / "m.onnx"))
    code, err = run(
        [
            "analyze",
            tmp_path / "m.onnx",
            "--calib",
            fixture_path("cnn", "calib.npz"),
            "-o",
            tmp_path / "r.json",
            *SMALL,
        ],
        capsys,
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    assert report.model.inputs == ("input",)
    assert any("also listed as graph inputs" in n for n in report.notes)
    assert "stem.conv.weight" in {w.name for w in report.weights}  # weights still quantized


def test_empty_optional_inputs(tmp_path, capsys):
    model = onnx.load(str(fixture_path("cnn", "model.onnx")))
    relu = next(n for n in model.graph.node if n.name == "stem/relu")
    relu.op_type = "Clip"
    relu.input.extend(["", "clip.max"])  # no min: an empty optional input
    model.graph.initializer.append(numpy_helper.from_array(np.array(50, np.float32), "clip.max"))
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(tmp_path / "m.onnx"))
    code, err = run(
        [
            "analyze",
            tmp_path / "m.onnx",
            "--calib",
            fixture_path("cnn", "calib.npz"),
            "-o",
            tmp_path / "r.json",
            *SMALL,
        ],
        capsys,
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    assert "stem/relu_out" in scored(report)
    assert report.node("stem/relu").inputs[1] == ""


def test_constant_nodes_become_quantized_weights(tmp_path, capsys):
    assert not onnx.load(str(rob("constant_weights.onnx"))).graph.initializer
    report = analyze("constant_weights", tmp_path / "r.json", capsys)
    assert any("turned 4 Constant" in n for n in report.notes)
    weights = {w.name: w for w in report.weights}
    assert {"fc1/weight_out", "fc2/weight_out"} <= set(weights)
    assert all(
        weights[w].error.sqnr_db > 30 and weights[w].quant.qtype == "int8"
        for w in ("fc1/weight_out", "fc2/weight_out")
    )


def test_custom_op_is_refused(tmp_path, capsys):
    code, err = run(
        [
            "analyze",
            rob("custom_op.onnx"),
            "--calib",
            rob("custom_op_calib.npz"),
            "-o",
            tmp_path / "r.json",
            "-q",
        ],
        capsys,
    )
    assert code == ExitCode.MODEL
    line = one_line_error(err)
    assert "com.example.custom::FancyNorm" in line and "custom/fancy_norm" in line
    assert not (tmp_path / "r.json").exists()


# --------------------------------------------------------------------------- opsets


def test_opset9_refused_then_upgraded_end_to_end(tmp_path, capsys):
    code, err = run(
        ["analyze", rob("opset9.onnx"), "--calib", rob("opset9_calib.npz"), "-o", tmp_path / "r.json", "-q"],
        capsys,
    )
    assert code == ExitCode.MODEL and "--upgrade-opset" in one_line_error(err)
    report = analyze("opset9", tmp_path / "r.json", capsys, "--upgrade-opset")
    assert report.config.upgrade_opset and any("opset 9 to 13" in n for n in report.notes)
    # propose repeats the upgrade from the report; verify takes the flag
    code, err = run(
        ["propose", tmp_path / "r.json", "-o", tmp_path / "p.json", "-q", "--max-evaluations", "4"], capsys
    )
    assert code in (0, ExitCode.TARGET_NOT_MET), err
    code, err = run(
        [
            "verify",
            rob("opset9.onnx"),
            "--calib",
            rob("opset9_calib.npz"),
            "--proposal",
            tmp_path / "p.json",
            "--upgrade-opset",
            "--runs",
            "0",
            "-q",
        ],
        capsys,
    )
    assert code in (0, ExitCode.TARGET_NOT_MET), err


def test_the_opset_converters_own_constants_are_not_reported_as_the_users(tmp_path, capsys):
    """onnx.version_converter turns Split's and Squeeze's attributes into unnamed Constant inputs: the notes
    had said "named 2 unnamed node(s)" and "turned 2 Constant node(s) into initializers so their weights
    can be quantized" of a model with names everywhere and no Constant at all."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Split", ["h"], ["a", "b"], name="split", axis=1, split=[4, 4]),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Unsqueeze", ["s"], ["u"], name="unsq", axes=[1]),
        helper.make_node("Squeeze", ["u"], ["y"], name="sq", axes=[1]),
    ]
    graph = helper.make_graph(
        nodes,
        "op9",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "w")],
    )
    model = save_graph(graph, tmp_path / "m.onnx", opsets={"": 9})
    np.savez(tmp_path / "c.npz", x=rng.standard_normal((16, 6)).astype(np.float32))
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--upgrade-opset", "-o", str(out), "-q"]
    assert main(args) == 0
    report = load_report(out)
    assert any("from opset 9 to 13" in n for n in report.notes)
    assert not any(n.startswith(("named ", "turned ")) for n in report.notes), report.notes
    assert {n.name for n in report.nodes} == {"mm", "split", "add", "unsq", "sq"}


def test_per_channel_below_opset13_gives_a_loadable_model(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx", opset=11)
    calib = small_data(tmp_path / "c.npz", n=16)
    code, err = run(
        ["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", "-q", "--per-channel"], capsys
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    qmodel = onnx.load(report.quantized_model.path)
    assert report.quantized_model.opset >= 13
    ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])  # ORT loads it
    assert any(w.quant.channels > 1 and w.quant.axis is not None for w in report.weights)
    assert any("opset 13" in n for n in report.notes)


# --------------------------------------------------------------------------- external data


def test_external_data_model(tmp_path, capsys):
    model = onnx.load(str(fixture_path("cnn", "model.onnx")))
    onnx.save(
        model,
        str(tmp_path / "m.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="m.onnx.data",
        size_threshold=0,
    )
    assert (tmp_path / "m.onnx").stat().st_size < 4096  # weights really are outside
    code, err = run(
        [
            "analyze",
            tmp_path / "m.onnx",
            "--calib",
            fixture_path("cnn", "calib.npz"),
            "-o",
            tmp_path / "r.json",
            *SMALL,
        ],
        capsys,
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    assert len(report.weights) >= 6 and report.task.quantized > 0.5
    (tmp_path / "m.onnx.data").unlink()
    code, err = run(
        ["analyze", tmp_path / "m.onnx", "--calib", fixture_path("cnn", "calib.npz"), "-q"], capsys
    )
    assert code == ExitCode.INPUT and "m.onnx.data" in one_line_error(err)


# --------------------------------------------------------------------------- control flow, recurrent ops


def test_if_with_runtime_condition_is_explained(tmp_path, capsys):
    report = analyze("if_subgraph", tmp_path / "r.json", capsys)
    note = next(n for n in report.notes if n.startswith("If node branch/if"))
    assert "inserts no QuantizeLinear" in note and "cannot be inlined" in note
    reasons = {n.name: n.reason for n in report.not_captured}
    assert {"then/conv_out", "else/matmul_out"} <= set(reasons)
    assert "inside If node 'branch/if'" in reasons["then/conv_out"]
    assert "cond/greater_out" in reasons and "bool" in reasons["cond/greater_out"]


def _constant_if_model(path: Path) -> Path:
    """if_subgraph with the condition folded to a constant (as exporters do for a fixed sample rate)."""
    model = onnx.load(str(rob("if_subgraph.onnx")))
    g = model.graph
    nodes = [n for n in g.node if not n.name.startswith("cond/")]
    const = helper.make_node(
        "Constant", [], ["cond/greater_out"], name="cond/const", value=numpy_helper.from_array(np.array(True))
    )
    del g.node[:]
    g.node.extend([const, *nodes])
    inits = [i for i in g.initializer if i.name != "cond.threshold"]
    del g.initializer[:]
    g.initializer.extend(inits)
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return path


def test_constant_if_is_inlined_on_request(tmp_path, capsys):
    model = _constant_if_model(tmp_path / "if_const.onnx")
    calib = rob("if_subgraph_calib.npz")
    code, err = run(["analyze", model, "--calib", calib, "-o", tmp_path / "plain.json", *SMALL], capsys)
    assert code == 0, err
    plain = load_report(tmp_path / "plain.json")
    assert any("--inline-constant-if" in n and "branch/if" in n for n in plain.notes)
    assert "then/conv_out" in {n.name for n in plain.not_captured}

    code, err = run(
        ["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", *SMALL, "--inline-constant-if"],
        capsys,
    )
    assert code == 0, err
    report = load_report(tmp_path / "r.json")
    assert report.config.inline_constant_if
    assert any("inlined the taken branch" in n and "then_branch" in n for n in report.notes)
    assert report.node("then/conv").quantized and "then/conv_out" in scored(report)
    assert "then.conv.w" in {w.name for w in report.weights}
    assert not report.not_captured
    # the inlined model gives the FP32 model's outputs exactly
    sess_in = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    sess_out = ort.InferenceSession(report.normalized_model, providers=["CPUExecutionProvider"])
    x = np.load(calib)["input"][8:12]
    np.testing.assert_array_equal(sess_in.run(None, {"input": x})[0], sess_out.run(None, {"input": x})[0])
    code, err = run(
        ["propose", tmp_path / "r.json", "-o", tmp_path / "p.json", "-q", "--max-evaluations", "4"], capsys
    )
    assert code in (0, ExitCode.TARGET_NOT_MET), err


@pytest.mark.parametrize("name,op", [("loop", "Loop"), ("scan", "Scan")])
def test_loop_and_scan_bodies_listed_as_not_captured(tmp_path, capsys, name, op):
    report = analyze(name, tmp_path / "r.json", capsys)
    body = [n for n in report.not_captured if f"inside {op} node" in n.reason]
    assert len(body) >= 4
    assert any(n.startswith(f"{op} node") and "stay FP32" in n for n in report.notes)
    assert all(math.isfinite(o.error.sqnr_db) for o in report.outputs)


@pytest.mark.parametrize("name,op", [("lstm", "LSTM"), ("gru", "GRU")])
def test_recurrent_ops_are_measured_and_explained(tmp_path, capsys, name, op):
    report = analyze(name, tmp_path / "r.json", capsys)
    node = report.node(f"rnn/{name}")
    assert node.op_type == op and not node.quantized
    assert any(f"rnn/{name} ({op}) stay FP32" in n for n in report.notes)
    assert {"rnn/y", "rnn/h_n", "logits"} <= scored(report)  # the recurrent op's outputs are measured


# --------------------------------------------------------------------------- float16


def test_float16_model_is_refused(tmp_path, capsys):
    code, err = run(
        ["analyze", rob("fp16.onnx"), "--calib", rob("fp16_calib.npz"), "-o", tmp_path / "r.json", "-q"],
        capsys,
    )
    assert code == ExitCode.MODEL
    assert "float16" in one_line_error(err)
    assert not (tmp_path / "r.json").exists()


def test_mixed_float16_keeps_the_half_section_float(tmp_path, capsys):
    report = analyze("mixed_fp16", tmp_path / "r.json", capsys)
    note = next(n for n in report.notes if "float16" in n)
    assert "fc1/matmul" in note and "nodes_to_exclude" in note
    assert not report.node("fc1/matmul").quantized and report.node("fc0/matmul").quantized
    qmodel = onnx.load(report.quantized_model.path)
    ort.InferenceSession(qmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    half = {i.name for i in qmodel.graph.initializer if i.data_type == onnx.TensorProto.FLOAT16}
    assert "fc1.w" in half  # the float16 weight stayed float16, not quantized
    assert all(math.isfinite(o.error.sqnr_db) for o in report.outputs)
    # the pasteable snippet spells the float16 nodes out, so plain ORT writes a model that loads too
    capsys.readouterr()
    code = main(
        [
            "propose",
            str(tmp_path / "r.json"),
            "-o",
            str(tmp_path / "p.json"),
            "-q",
            "--snippet",
            "--max-evaluations",
            "4",
        ]
    )
    assert code in (0, ExitCode.TARGET_NOT_MET)
    snippet = capsys.readouterr().out
    excluded = snippet.split("nodes_to_exclude = [")[1].split("]")[0]
    assert "'fc1/matmul'" in excluded and "'to_fp32/cast'" in excluded

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    x = np.load(rob("mixed_fp16_calib.npz"))["x"]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"x": x[i : i + 4]} for i in range(0, 16, 4)])

        def get_next(self):
            return next(self.items, None)

    names = [n.strip().strip(",'") for n in excluded.split() if n.strip()]
    quantize_static(
        str(rob("mixed_fp16.onnx")),
        str(tmp_path / "ort.onnx"),
        Reader(),
        quant_format=QuantFormat.QDQ,
        nodes_to_exclude=names,
    )
    ort.InferenceSession(str(tmp_path / "ort.onnx"), providers=["CPUExecutionProvider"])


# --------------------------------------------------------------------------- detection head


def test_detection_concat_range_mismatch_is_called_out(tmp_path, capsys):
    report = analyze("detect_concat", tmp_path / "r.json", capsys)
    note = next(n for n in report.notes if n.startswith("Concat head/concat"))
    assert "box/to_pixels_out" in note and "cls/sigmoid_out" in note and "detections" in note
    ratio = float(note.split("differ by ")[1].split("x")[0])
    assert ratio > 50
    assert "quantization level" in note and "local SQNR" in note


# --------------------------------------------------------------------------- user-supplied quantized models


def test_qoperator_model_as_quantized_is_refused(tmp_path, capsys):
    code, err = run(
        [
            "analyze",
            fixture_path("cnn", "model.onnx"),
            "--calib",
            fixture_path("cnn", "calib.npz"),
            "--quantized",
            rob("qoperator.onnx"),
            "-o",
            tmp_path / "r.json",
            "-q",
        ],
        capsys,
    )
    assert code == ExitCode.MODEL
    line = one_line_error(err)
    assert "QOperator" in line and "QLinearConv" in line and "QuantFormat.QDQ" in line


def test_qdq_model_from_another_tool_pairs_by_structure(tmp_path, capsys):
    """Every node and internal tensor renamed (another tool's naming): the numbers do not change."""
    model, calib = fixture_path("cnn", "model.onnx"), fixture_path("cnn", "calib.npz")
    code, err = run(["analyze", model, "--calib", calib, "-o", tmp_path / "own.json", *SMALL], capsys)
    assert code == 0, err
    own = load_report(tmp_path / "own.json")
    q = onnx.load(own.quantized_model.path)
    keep = {i.name for i in q.graph.input} | {o.name for o in q.graph.output}
    rename = {}
    for k, node in enumerate(q.graph.node):
        node.name = f"other_tool_{k}"
        for j, o in enumerate(node.output):
            if o not in keep:
                rename.setdefault(o, f"t{len(rename)}")
                node.output[j] = rename[o]
    for init in q.graph.initializer:
        rename.setdefault(init.name, f"c{len(rename)}")
        init.name = rename[init.name]
    for node in q.graph.node:
        for j, i in enumerate(node.input):
            node.input[j] = rename.get(i, i)
    del q.graph.value_info[:]
    onnx.save(q, str(tmp_path / "other.onnx"))
    code, err = run(
        [
            "analyze",
            model,
            "--calib",
            calib,
            "--quantized",
            tmp_path / "other.onnx",
            "-o",
            tmp_path / "r.json",
            *SMALL,
        ],
        capsys,
    )
    assert code == 0, err
    other = load_report(tmp_path / "r.json")
    mine = {t.name: t.accumulated.sqnr_db for t in own.tensors if t.accumulated}
    theirs = {t.name: t.accumulated.sqnr_db for t in other.tensors if t.accumulated}
    assert mine.keys() == theirs.keys()
    for name, db in mine.items():
        assert theirs[name] == pytest.approx(db, abs=1e-3), name


# --------------------------------------------------------------------------- memory


_PEAK = """
import resource, sys
from qdebug.cli.main import main
code = main(sys.argv[1:])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def test_peak_memory_is_flat_in_the_number_of_samples(tmp_path):
    """1,000 calibration samples: peak RSS within 15% of the 32-sample run (streamed, not kept per sample)."""
    x = np.load(fixture_path("cnn", "calib.npz"))["input"]
    np.savez(tmp_path / "c1000.npz", input=np.resize(x, (1000, *x.shape[1:])))
    peaks = {}
    for n in (32, 1000):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _PEAK,
                "analyze",
                str(fixture_path("cnn", "model.onnx")),
                "--calib",
                str(tmp_path / "c1000.npz"),
                "--max-samples",
                str(n),
                "-o",
                str(tmp_path / f"r{n}.json"),
                "-q",
                "--no-cache",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        peaks[n] = int(proc.stdout.strip().splitlines()[-1])
    assert load_report(tmp_path / "r1000.json").samples == 1000
    assert peaks[1000] <= 1.15 * peaks[32], peaks


# --------------------------------------------------------------------------- quantizer exceptions


def test_quantizer_exception_is_explained_with_the_option_that_avoids_it(tmp_path, capsys, monkeypatch):
    """Simulated: ORT's int32 bias-scale adjustment for per-channel weights raising inside quantize_model."""
    from onnxruntime.quantization.qdq_quantizer import QDQQuantizer

    def boom(self):
        raise ValueError("bias scale is too small for int32 (adjust_tensor_ranges)")

    monkeypatch.setattr(QDQQuantizer, "quantize_model", boom)
    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz", n=8)
    code, err = run(
        ["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", "-q", "--per-channel"], capsys
    )
    assert code == ExitCode.MODEL
    line = one_line_error(err)
    assert "quantizer failed" in line and "drop --per-channel" in line
    assert not (tmp_path / "r.json").exists()


def test_inlined_branches_with_duplicate_tensor_names(tmp_path):
    """Two If nodes whose branches reuse the same tensor names (valid: sibling subgraphs); inlining both
    renames the clash and keeps the outputs bit-identical."""
    from qdebug.graph.load import load_model, normalize

    def branch(tag: str, out: str, op: str) -> onnx.GraphProto:
        return helper.make_graph(
            [
                helper.make_node(op, ["x"], ["t"], name=f"{tag}/a"),
                helper.make_node("Abs", ["t"], [out], name=f"{tag}/b"),
            ],
            tag,
            [],
            [helper.make_tensor_value_info(out, onnx.TensorProto.FLOAT, None)],
        )

    graph = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["flag"],
                ["y1"],
                name="if1",
                then_branch=branch("t1", "u1", "Neg"),
                else_branch=branch("e1", "w1", "Relu"),
            ),
            helper.make_node(
                "If",
                ["flag"],
                ["y2"],
                name="if2",
                then_branch=branch("t2", "u2", "Sigmoid"),
                else_branch=branch("e2", "w2", "Relu"),
            ),
            helper.make_node("Add", ["y1", "y2"], ["out"], name="add"),
        ],
        "clash",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(np.array(True), "flag")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    assert (
        main(
            [
                "analyze",
                str(tmp_path / "m.onnx"),
                "--calib",
                str(tmp_path / "c.npz"),
                "-o",
                str(tmp_path / "r.json"),
                "-q",
            ]
        )
        == 0
    )
    report = load_report(tmp_path / "r.json")  # without inlining: each 't' is listed with where it lives
    wheres = sorted(n.reason.split(":")[0] for n in report.not_captured if n.name == "t")
    assert len(wheres) == 4 and len(set(wheres)) == 4
    assert any("if1" in n and "condition is a constant" in n for n in report.notes)
    norm = normalize(load_model(tmp_path / "m.onnx"), inline_constant_if=True)
    assert not any(n.op_type == "If" for n in norm.proto.graph.node)
    outputs = [o for n in norm.proto.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs)) and "if2/t" in outputs
    before = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    after = ort.InferenceSession(norm.proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x}
    )
    np.testing.assert_array_equal(before[0], after[0])


def test_models_over_the_protobuf_limit_go_through_external_data(tmp_path, monkeypatch):
    """Simulated: the 2 GB protobuf limit is lowered so the CNN fixture takes the large-model paths
    (shape inference from a file, calibration and sessions with external data, external-data saves)."""
    import qdebug.graph.modelfile as modelfile

    monkeypatch.setattr(modelfile, "PROTO_LIMIT", 4096)
    out = tmp_path / "r.json"
    code = main(analyze_args("cnn", out, "--no-cache"))
    assert code == 0
    report = load_report(out)
    files = tmp_path / "r_files"
    assert (files / "normalized.onnx.data").is_file() and (files / "quantized.onnx.data").is_file()
    assert (files / "normalized.onnx").stat().st_size < 40_000  # weights live in the .data file
    assert abs(report.task.fp32 - report.task.quantized) <= 0.02
    assert report.tensor("logits").accumulated.sqnr_db > 15

    # a re-run into the same output replaces the weights files instead of appending to them (onnx's own
    # external-data saving appends), and a file of the same name in the working directory does not matter
    sizes = {p.name: p.stat().st_size for p in files.glob("*.data")}
    monkeypatch.chdir(tmp_path)
    Path("quantized.onnx.data").write_bytes(b"not ours")
    assert main(analyze_args("cnn", out, "--no-cache")) == 0
    assert {p.name: p.stat().st_size for p in files.glob("*.data")} == sizes
    assert Path("quantized.onnx.data").read_bytes() == b"not ours"
    assert (
        load_report(out).tensor("logits").accumulated.sqnr_db == report.tensor("logits").accumulated.sqnr_db
    )


def test_a_branch_reading_an_outer_weight(tmp_path):
    """An If branch that reads an initializer of the outer graph: the merged reduction models rename it
    on both sides (onnx.compose.add_prefix left the branch's reference unrenamed: ORT refused the model),
    and the graph engine agrees with the exact numpy engine."""
    model = branch_reads_outer_weight(tmp_path / "m.onnx")
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (32, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    reports = analyze_with_both_engines(model, tmp_path / "c.npz", tmp_path, "--batch-size", "8")
    graph, exact = reports["graph"], reports["numpy"]
    assert {t.name for t in graph.tensors} == {t.name for t in exact.tensors}
    for t in exact.tensors:
        if t.accumulated is not None and math.isfinite(t.accumulated.sqnr_db):
            assert graph.tensor(t.name).accumulated.sqnr_db == pytest.approx(t.accumulated.sqnr_db, abs=0.02)
    assert any("inside" in n.reason for n in graph.not_captured)  # the branches' own tensors


def test_an_infinite_mask_keeps_its_nodes_in_fp32(tmp_path, capsys):
    """``Where(mask, scores, -inf)`` gives the masked scores an infinite range: ORT's quantizer would write
    an infinite scale (NaN outputs); qdebug keeps the nodes around the tensor in FP32 and says so. A mask
    that makes the FP32 outputs NaN is refused as a model error, not blamed on the quantizer."""
    model = masked_attention(tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(1).normal(0, 1, (16, 6, 8)).astype(np.float32))
    out = tmp_path / "r.json"
    assert (
        main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q", "--no-cache"])
        == 0
    )
    report = load_report(out)
    note = next(n for n in report.notes if "not finite" in n)
    assert "mask_where" in note and "softmax" in note and "masked" in note
    assert math.isfinite(report.outputs[0].error.sqnr_db) and report.outputs[0].error.sqnr_db > 15
    quantized = onnx.load(report.quantized_model.path)
    q_inputs = {n.input[0] for n in quantized.graph.node if n.op_type == "QuantizeLinear"}
    assert "masked" not in q_inputs and "q" in q_inputs  # the masked scores stay FP32, the rest is quantized

    # the model ORT's quantize_static itself writes (an infinite scale on the masked scores) is analyzed
    # as given, without a traceback: its error is what the user needs to see
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": np.load(tmp_path / "c.npz")["x"]}])

        def get_next(self):
            return next(self.batches, None)

    own = tmp_path / "own_qdq.onnx"
    quantize_static(str(model), str(own), Reader(), quant_format=QuantFormat.QDQ)
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--quantized", str(own)]
    assert main([*args, "-o", str(tmp_path / "own.json"), "-q"]) == 0
    assert not report.outputs[0].error.sqnr_db < load_report(tmp_path / "own.json").outputs[0].error.sqnr_db

    capsys.readouterr()
    broken = masked_attention(tmp_path / "nan.onnx", nan_mask=True)
    code = main(
        ["analyze", str(broken), "--calib", str(tmp_path / "c.npz"), "-o", str(tmp_path / "n.json"), "-q"]
    )
    err = capsys.readouterr().err
    assert code == ExitCode.MODEL and "computes NaN for output(s) y" in err and "Traceback" not in err


def test_sequence_values_are_listed_not_scored(tmp_path):
    """A sequence-typed value (SplitToSequence) comes out of ORT as a list: it is listed in not_captured and
    the tensors around it are scored (the numpy engine had crashed on it: 'list' has no dtype)."""
    model = sequence_split(tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(2).normal(0, 1, (32, 8)).astype(np.float32))
    for report in analyze_with_both_engines(model, tmp_path / "c.npz", tmp_path).values():
        reasons = [n.reason for n in report.not_captured if n.name == "parts"]
        assert reasons == ["sequence value, not a tensor: not scored"]
        assert report.tensor("cat").accumulated.sqnr_db > 15 and report.tensor("y").accumulated.sqnr_db > 15


def test_a_model_input_named_labels_is_fed_to_the_model(tmp_path):
    """The data's ``labels`` key is the labels, unless the model has an input of that name: it is then fed
    to the model (it had been withheld: ORT "Required inputs (['labels']) are missing", exit 4)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
            helper.make_node("Add", ["h", "labels"], ["y"], name="add"),
        ],
        "labels_input",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("labels", TensorProto.FLOAT, ["N", 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.normal(0, 0.3, (8, 4)).astype(np.float32), "w")],
    )
    save_graph(graph, tmp_path / "m.onnx")
    data = {"x": rng.normal(0, 1, (32, 8)), "labels": rng.normal(0, 1, (32, 4))}
    np.savez(tmp_path / "c.npz", **{k: v.astype(np.float32) for k, v in data.items()})
    out = tmp_path / "r.json"
    assert (
        main(["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"])
        == 0
    )
    report = load_report(out)
    assert report.task.name != "top1"  # not taken as labels
    assert report.tensor("y").accumulated.sqnr_db > 15


def test_data_dependent_shapes_are_listed_not_compared(tmp_path):
    """NonZero -> GatherND (how detection post-processing selects boxes): the quantized model may keep
    other elements than FP32, so those tensors are listed, not compared (the graph engine had failed inside
    its own Sub node, the numpy engine with a traceback on the output's shape)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(16)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Greater", ["h", "zero"], ["pos"], name="gt"),
        helper.make_node("NonZero", ["pos"], ["nz"], name="nz"),
        helper.make_node("Transpose", ["nz"], ["idx"], name="tr", perm=[1, 0]),
        helper.make_node("GatherND", ["h", "idx"], ["sel"], name="select"),
        helper.make_node("Sigmoid", ["sel"], ["y"], name="sig"),
    ]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 4)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(0, np.float32), "zero"),
    ]
    graph = helper.make_graph(
        nodes,
        "nonzero",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["K"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (32, 8)).astype(np.float32))
    for report in analyze_with_both_engines(tmp_path / "m.onnx", tmp_path / "c.npz", tmp_path).values():
        reasons = {n.name: n.reason for n in report.not_captured}
        assert all("depends on the data (after NonZero 'nz')" in reasons[t] for t in ("sel", "y"))
        assert report.tensor("h").accumulated.sqnr_db > 15


def test_summary_line_for_integer_and_sqnr_outputs(tmp_path, capsys):
    """The summary's task line: an ArgMax-only model is scored by agreement with FP32 (it printed
    "FP32 - quantized - (drop nan)"), and output SQNR is shown against FP32 (it printed "drop inf")."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (8, 4)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (32, 8)).astype(np.float32))
    lines = {}
    for kind, tail, out in (
        (
            "argmax",
            [helper.make_node("ArgMax", ["h"], ["cls"], name="pick", axis=1)],
            ("cls", TensorProto.INT64),
        ),
        ("sigmoid", [helper.make_node("Sigmoid", ["h"], ["y"], name="sig")], ("y", TensorProto.FLOAT)),
    ):
        nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), *tail]
        graph = helper.make_graph(
            nodes, kind, [x], [helper.make_tensor_value_info(out[0], out[1], ["N"])], [w]
        )
        save_graph(graph, tmp_path / f"{kind}.onnx")
        capsys.readouterr()
        args = ["analyze", str(tmp_path / f"{kind}.onnx"), "--calib", str(tmp_path / "c.npz")]
        if kind == "sigmoid":
            args += ["--metric", "output_sqnr_db"]
        assert main([*args, "-o", str(tmp_path / f"{kind}.json"), "-q"]) == 0
        lines[kind] = capsys.readouterr().out.splitlines()[0]
    assert lines["argmax"].startswith("top1_agreement on 32 calib samples: FP32 100.00%"), lines["argmax"]
    assert "nan" not in lines["argmax"]
    assert lines["sigmoid"].startswith("output_sqnr_db") and "dB (against FP32)" in lines["sigmoid"]
    assert "inf" not in lines["sigmoid"]


def test_upgraded_opset_keeps_the_users_names(tmp_path):
    """version_converter replaces an opset-9 Upsample by an unnamed Resize with a fresh output name: the
    report must still call them ``up`` (it showed ``Resize_2`` and ``_v_8``)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Upsample", ["c", "scales"], ["up"], name="up", mode="nearest"),
        helper.make_node("Relu", ["up"], ["y"], name="relu"),
    ]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    graph = helper.make_graph(
        nodes,
        "upsample9",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 4
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (16, 1, 8, 8)).astype(np.float32))
    out = tmp_path / "r.json"
    args = ["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]
    assert main([*args, "--upgrade-opset"]) == 0
    report = load_report(out)
    assert (report.node("up").op_type, report.node("up").original_name) == ("Resize", "up")
    assert report.tensor("up").summary.count == 16 * 4 * 16 * 16  # the user's tensor name, measured


def test_a_range_set_by_mask_values_is_named(tmp_path):
    """``scores + (1 - mask) * -1e9``: the scale (~4e6) puts every unmasked score in one step. SQNR hides it
    (the mask values carry the energy) and the Softmax after it is ranked first; a note names the cause."""
    model = masked_attention(tmp_path / "m.onnx", additive=-1e9)
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(1).normal(0, 1, (16, 6, 8)).astype(np.float32))
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.tensor("masked").accumulated.sqnr_db > 60  # looks perfect...
    note = next(n for n in report.notes if n.startswith("masked: "))
    assert "one quantization step" in note and "softmax" in note and "mask_add" in note


def test_symbolic_shape_inference_leaves_nothing_in_the_working_directory(tmp_path, monkeypatch):
    """ORT's symbolic inference writes temp files into the current directory; qdebug runs it elsewhere."""
    import types

    from qdebug.graph import shapes

    class LitteringInference:  # stands in for ORT's (which needs sympy, not a dependency of qdebug)
        @staticmethod
        def infer_shapes(model, **kwargs):
            Path("sym_shape_infer_temp.onnx").write_bytes(b"x")  # what ORT's does for some models
            return model

    fake = types.ModuleType("onnxruntime.tools.symbolic_shape_infer")
    fake.SymbolicShapeInference = LitteringInference
    monkeypatch.setitem(sys.modules, "onnxruntime.tools", types.ModuleType("onnxruntime.tools"))
    monkeypatch.setitem(sys.modules, "onnxruntime.tools.symbolic_shape_infer", fake)
    cwd = tmp_path / "user_dir"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    model = onnx.load(fixture_path("cnn", "model.onnx"))
    notes: list[str] = []
    assert shapes._symbolic_inference(model, notes) is model
    assert list(cwd.iterdir()) == [] and Path.cwd() == cwd


def test_names_with_rich_markup_are_printed_as_they_are(tmp_path, capsys):
    """Node and tensor names are the user's: '[red]boom' printed as 'boom', and a name holding '[/]' made
    analyze and propose exit 1 with a MarkupError (after writing their output)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (8, 8)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["[red]boom"], name="[red]boom"),
            helper.make_node("Relu", ["[red]boom"], ["y"], name="close[/]"),
        ],
        "markup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [w],
    )
    save_graph(graph, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (16, 8)).astype(np.float32))
    report = tmp_path / "r.json"
    assert (
        main(["analyze", str(tmp_path / "m.onnx"), "--calib", str(tmp_path / "c.npz"), "-o", str(report)])
        == 0
    )
    out = capsys.readouterr().out
    assert "close[/]" in out
    assert main(["propose", str(report), "-o", str(tmp_path / "p.json")]) in (0, 6)
    assert "Traceback" not in capsys.readouterr().err


def test_proposal_drops_per_channel_when_no_weight_stays_quantized(tmp_path, capsys):
    """On if_subgraph the only weight outside the If is the head Gemm's: per-channel helps until the Gemm
    is kept FP32, after which it changes nothing and must not be asked for (nor credited)."""
    import json

    report = tmp_path / "r.json"
    analyze("if_subgraph", report, capsys)
    prop = tmp_path / "p.json"
    code, err = run(
        ["propose", report, "--target-sqnr", "80", "--allow", "fp32,per-channel", "-o", prop, "-q"], capsys
    )
    assert code == 0, err
    proposal = json.loads(prop.read_text())
    assert "head/gemm" in proposal["nodes_to_exclude"]
    assert proposal["per_channel"] is False
    assert all(r["action"] != "per-channel" for r in proposal["reasons"])


def test_model_with_nothing_to_quantize_is_noted_and_ort_stays_quiet(tmp_path, capfd):
    """Exp and Pow have no QDQ kernels: ORT inserts no Q/DQ. The report says so, and the calibrator's own
    session (created by ORT without options) must not print its C++ "Removing initializer" warning."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph(
        [helper.make_node("Exp", ["x"], ["e"], name="exp"), helper.make_node("Pow", ["e", "p"], ["y"], name="pow")],
        "no_quant",
        [x],
        [y],
        [numpy_helper.from_array(np.full(4, 2.0, np.float32), "p")],
    )
    model = save_graph(graph, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).random((8, 4), dtype=np.float32))
    out = tmp_path / "r.json"
    code = main(["analyze", str(model), "--calib", str(tmp_path / "d.npz"), "-o", str(out), "-q", "--no-cache"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert "Removing initializer" not in err and "[W:onnxruntime" not in err
    assert any("inserted no QuantizeLinear" in n for n in load_report(out).notes)


def _ort_per_channel_s8s8(model: Path, calib: Path, out: Path, **extra) -> Path:
    """ORT's own quantize_static of ``model``: QDQ, per-channel, int8 activations and weights."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": np.load(calib)["input"]}])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(
        str(model), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, extra_options=extra,
    )
    return out


def test_settings_of_a_given_quantized_model_are_recorded(tmp_path, capsys):
    """A user's own model quantized per-channel with int8 activations: the report had recorded the flags'
    defaults (per-tensor, QUInt8), and propose then rebuilt and judged another model without a word."""
    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz", n=16)
    own = _ort_per_channel_s8s8(model, calib, tmp_path / "own.onnx")
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "--quantized", str(own), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.config.per_channel is True and report.config.activation_type == "QInt8"
    assert report.config.weight_type == "QInt8"
    note = next(n for n in report.notes if n.startswith("settings read from the quantized model"))
    assert "per-channel weights (flags: per-tensor weights)" in note
    assert "QInt8 activations (flags: QUInt8 activations)" in note
    capsys.readouterr()
    code = main(["propose", str(out), "--target-drop", "0", "-o", str(tmp_path / "p.json"), "-q"])
    assert code in (0, 6)
    assert "rebuilt from qdebug's own calibration (minmax, per-channel weights, QInt8/QInt8)" in capsys.readouterr().err
    assert json.loads((tmp_path / "p.json").read_text())["activation_type"] == "QInt8"


def test_arrays_nothing_reads_are_named_in_a_note(tmp_path):
    """An evaluation file with `label` instead of `labels`: top-1 against labels silently became agreement
    with FP32 (100 %); the report now names the ignored array and the likely key."""
    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz", n=16)
    with np.load(small_data(tmp_path / "e.npz", n=16, seed=3)) as z:
        np.savez(tmp_path / "typo.npz", input=z["input"], label=z["labels"])
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(calib), "--eval", str(tmp_path / "typo.npz")]
    assert main([*args, "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.task.name == "top1_agreement"
    note = next(n for n in report.notes if "were ignored" in n)
    assert note.startswith("evaluation data") and "'label'" in note and "did you mean 'labels' for 'label'" in note
    assert not any("calibration data" in n and "ignored" in n for n in report.notes)


def test_settings_of_a_tensorrt_style_qdq_model_are_read_from_its_weight_quantizers(tmp_path):
    """pytorch-quantization / modelopt exports keep float weights behind QuantizeLinear(axis=0) ->
    DequantizeLinear: per-channel had been missed (only integer weights were looked at), and an explicit
    --per-channel overridden."""
    from qdebug.graph.match import qdq_settings

    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz", n=16)
    ort_style = _ort_per_channel_s8s8(model, calib, tmp_path / "ort.onnx", QuantizeBias=False)
    proto = onnx.load(str(ort_style))
    inits = {t.name: t for t in proto.graph.initializer}
    nodes = []
    for node in proto.graph.node:  # int8 weight -> DQ  becomes  float weight -> Q -> DQ
        weight = inits.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if weight is not None and weight.data_type == onnx.TensorProto.INT8:
            w, s = numpy_helper.to_array(weight).astype(np.float32), numpy_helper.to_array(inits[node.input[1]])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            shape = [1] * w.ndim
            if s.size > 1:
                shape[axis] = -1
            proto.graph.initializer.append(numpy_helper.from_array(w * s.reshape(shape), weight.name + "_f"))
            attrs = {"axis": axis} if s.size > 1 else {}
            nodes.append(
                helper.make_node("QuantizeLinear", [weight.name + "_f", *node.input[1:]], [weight.name + "_q"], **attrs)
            )
            node.input[0] = weight.name + "_q"
        nodes.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    trt_style = tmp_path / "trt.onnx"
    onnx.save(proto, str(trt_style))
    found = qdq_settings(proto)
    assert (found.per_channel, found.weight_type, found.activation_type) == (True, "QInt8", "QInt8")
    out = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(calib), "--quantized", str(trt_style), "-o", str(out), "-q"]
    assert main(args) == 0
    assert load_report(out).config.per_channel is True


def test_ort_log_severity_set_by_an_api_user_survives_analyze(tmp_path, capfd):
    """Silencing the calibrator's C++ warnings had set ORT's process-wide log severity and reset it to
    'warning' afterwards, undoing an API user's own setting (ORT has no getter to restore it)."""
    from qdebug import AnalyzeOptions, analyze

    model = small_cnn(tmp_path / "m.onnx")
    proto = onnx.load(str(model))  # an initializer listed as a graph input: ORT warns about it at load
    proto.graph.input.append(helper.make_tensor_value_info(proto.graph.initializer[0].name, 1, None))
    onnx.save(proto, str(tmp_path / "warns.onnx"))
    ort.set_default_logger_severity(3)
    try:
        analyze(model, small_data(tmp_path / "c.npz", n=8), output=tmp_path / "r.json", options=AnalyzeOptions())
        capfd.readouterr()
        ort.InferenceSession(str(tmp_path / "warns.onnx"), providers=["CPUExecutionProvider"])
        assert "[W:onnxruntime" not in capfd.readouterr().err
    finally:
        ort.set_default_logger_severity(2)


def test_hook_keys_that_are_no_input_are_dropped_and_named(tmp_path, capsys, monkeypatch):
    """A hook item carrying a file name and metadata: the string had crashed the batching (IndexError
    traceback) and an extra array reached ORT ("Invalid input name", exit 4, blamed on the model). Both are
    dropped and named in a note, by analyze and by the commands that re-read the data."""
    model = small_cnn(tmp_path / "m.onnx")
    data = small_data(tmp_path / "d.npz", n=16)
    hook = tmp_path / "hook.py"
    hook.write_text(
        "import numpy as np\n"
        "def feeds():\n"
        f"    z = np.load({str(data)!r})\n"
        "    for i in range(0, 16, 8):\n"
        "        yield {'input': z['input'][i:i + 8], 'labels': z['labels'][i:i + 8],\n"
        "               'sample_id': f'img{i}.png', 'meta': np.zeros(8)}\n"
    )
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", f"{hook}:feeds", "-o", str(out), "-q"]) == 0
    note = next(n for n in load_report(out).notes if "were ignored" in n)
    assert "'meta', 'sample_id'" in note
    capsys.readouterr()
    code = main(["propose", str(out), "--target-drop", "100", "-o", str(tmp_path / "p.json"), "-q"])
    assert code == 0
    assert "'meta', 'sample_id' are neither a model input nor 'labels'" in capsys.readouterr().err
    # the proposal's snippet feeds the model's inputs only (it had fed sample_id: "Invalid input name")
    monkeypatch.chdir(tmp_path)
    exec(compile(json.loads((tmp_path / "p.json").read_text())["snippet"], "snippet", "exec"), {})
    assert (tmp_path / "model.selective.onnx").is_file()


def test_an_optional_input_the_data_leaves_out(tmp_path):
    """An `optional(tensor)` input ORT runs without had been demanded (exit 5, as float32), and once not
    demanded the sessions still asked the data for it."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])
    bias = helper.make_value_info(
        "bias", helper.make_optional_type_proto(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [4]))
    )
    y = helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["N", 5])
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    then = helper.make_graph(
        [helper.make_node("OptionalGetElement", ["bias"], ["bt"])], "then", [],
        [helper.make_tensor_value_info("bt", onnx.TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Mul", ["x", "zero"], ["be"])], "else", [],
        [helper.make_tensor_value_info("be", onnx.TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("OptionalHasElement", ["bias"], ["has"], name="has"),
        helper.make_node("If", ["has"], ["b"], name="if", then_branch=then, else_branch=other),
        helper.make_node("Add", ["x", "b"], ["xb"], name="add"),
        helper.make_node("MatMul", ["xb", "w"], ["out"], name="mm"),
    ]
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32), "w")
    graph = helper.make_graph(nodes, "optin", [x, bias], [y], [w, zero])
    model = save_graph(graph, tmp_path / "m.onnx", opsets={"": 18})
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(1).standard_normal((16, 4)).astype(np.float32))
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "d.npz"), "-o", str(out), "-q"]) == 0
    assert load_report(out).samples == 16


def test_data_for_an_input_with_a_default_is_named_as_such(tmp_path):
    """Data for an input the model gives a default (an initializer listed as an input) was called 'neither a
    model input nor labels'; the note now says the model's own value is used."""
    model = small_cnn(tmp_path / "m.onnx")
    proto = onnx.load(str(model))
    weight = proto.graph.initializer[0]
    proto.graph.input.append(helper.make_tensor_value_info(weight.name, weight.data_type, list(weight.dims)))
    onnx.save(proto, str(model))
    with np.load(small_data(tmp_path / "d.npz", n=8)) as z:
        np.savez(tmp_path / "e.npz", **{k: z[k] for k in z.files}, **{weight.name: numpy_helper.to_array(weight)})
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "e.npz"), "-o", str(out), "-q"]) == 0
    note = next(n for n in load_report(out).notes if "ignored" in n)
    assert f"'{weight.name}': the model holds these values itself" in note and "neither" not in note


def _scaled_classifier(path: Path) -> Path:
    """logits = MatMul(Relu(x * gain), w): ``gain`` is a rank-0 input (one value per file or hook item)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Mul", ["x", "gain"], ["xg"], name="scale"),
        helper.make_node("Relu", ["xg"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w"], ["logits"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "scalar_in",
        [  # the scalar first: bench's measuring process had read the batch size off the first input
            helper.make_tensor_value_info("gain", onnx.TensorProto.FLOAT, []),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 8]),
        ],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")],
    )
    return save_graph(graph, path, opsets={"": 17})


def test_a_scalar_model_input_is_fed_whole_with_every_batch(tmp_path, monkeypatch, capsys):
    """A rank-0 input (a gain, a threshold) was refused as disagreeing on axis 0 ("sizes [1, 32]"), and
    numpy's ascontiguousarray made it 1-D, which ORT then sliced to zero rows. One value per file is fed
    with every batch cut from that file: the report's output SQNR equals one computed here with plain ORT
    on whole files, the batches are cut (capture chunks included), and propose's snippet runs."""
    model = _scaled_classifier(tmp_path / "m.onnx")
    rng = np.random.default_rng(1)
    folder = tmp_path / "calib"
    folder.mkdir()
    files = {}
    for i, gain in enumerate((0.5, 3.0)):  # two gains: a file's batches must all get its own
        x = rng.standard_normal((40, 8)).astype(np.float32)
        files[folder / f"b{i}.npz"] = (x, np.float32(gain))
        np.savez(folder / f"b{i}.npz", x=x, gain=np.float32(gain))
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(folder), "--batch-size", "16", "-o", str(out), "-q"]) == 0
    report = load_report(out)
    assert report.samples == 80
    fp32 = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    qdq = ort.InferenceSession(str(tmp_path / "r_files" / "quantized.onnx"), providers=["CPUExecutionProvider"])
    signal = noise = 0.0
    for x, gain in files.values():
        feeds = {"x": x, "gain": np.array(gain)}
        ref = fp32.run(None, feeds)[0].astype(np.float64)
        cand = qdq.run(None, feeds)[0].astype(np.float64)
        signal += float((ref**2).sum())
        noise += float(((ref - cand) ** 2).sum())
    logits = next(t for t in report.tensors if t.name == "logits")
    assert logits.accumulated.sqnr_db == pytest.approx(10 * math.log10(signal / noise), abs=1e-3)
    # the scale of Relu's output was calibrated over both gains: its range reaches the larger one's values
    relu_max = max(float((np.maximum(x * g, 0)).max()) for x, g in files.values())
    h = next(t for t in report.tensors if t.name == "h")
    assert h.summary.max == pytest.approx(relu_max, rel=1e-6)
    # propose's snippet reads the scalar whole too
    assert main(["propose", str(out), "--target-drop", "100", "-o", str(tmp_path / "p.json"), "-q"]) == 0
    monkeypatch.chdir(tmp_path)
    exec(compile(json.loads((tmp_path / "p.json").read_text())["snippet"], "snippet", "exec"), {})
    assert (tmp_path / "model.selective.onnx").is_file()
    bench = ["bench", str(model), "--calib", str(folder), "--variants", "fp32,static", "--runs", "1"]
    assert main([*bench, "--warmup", "0", "--no-dynamic-layers", "-o", str(tmp_path / "b.json"), "-q"]) == 0
    # a scalar saved with a batch axis is one clear line, exit 5
    np.savez(tmp_path / "bad.npz", x=files[folder / "b0.npz"][0], gain=np.full(40, 0.5, np.float32))
    capsys.readouterr()
    code = main(["analyze", str(model), "--calib", str(tmp_path / "bad.npz"), "-o", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.DATA
    assert "'gain' has shape [40], the model expects a scalar (rank 0)" in err[-1]


def test_a_float_lstm_after_a_quantized_matmul_is_not_called_quantized(tmp_path, capsys):
    """An LSTM reads the DQ output its quantized producer (a MatMul) leaves, and its output is quantized for
    the Gemm after it, yet it computes in float: it had been reported quantized, so the recurrent-op note
    was not written and the TUI showed it as a quantized node."""
    rng = np.random.default_rng(8)
    f32 = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)  # noqa: E731
    inits = [
        numpy_helper.from_array(a, n)
        for n, a in [("W", f32(1, 32, 6)), ("R", f32(1, 32, 8)), ("wi", f32(6, 6)), ("wf", f32(3, 8))]
    ]
    inits.append(numpy_helper.from_array(np.array([0], np.int64), "ax0"))
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], name="to_seq_first", perm=[1, 0, 2]),
        helper.make_node("MatMul", ["xt", "wi"], ["xin"], name="in_proj"),
        helper.make_node("LSTM", ["xin", "W", "R"], ["Y", "Y_h"], name="lstm", hidden_size=8),
        helper.make_node("Squeeze", ["Y_h", "ax0"], ["hn"], name="squeeze"),
        helper.make_node("Gemm", ["hn", "wf"], ["logits"], name="fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "lstm_after_matmul",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 5, 6])],
        [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["N", 3])],
        inits,
    )
    model = save_graph(graph, tmp_path / "m.onnx", opsets={"": 17})
    np.savez(tmp_path / "c.npz", x=rng.standard_normal((16, 5, 6)).astype(np.float32))
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    qdq = onnx.load(report.quantized_model.path)
    lstm_in = next(n for n in qdq.graph.node if n.op_type == "LSTM").input[0]
    assert any(n.op_type == "DequantizeLinear" and lstm_in in n.output for n in qdq.graph.node)  # the premise
    assert not report.node("lstm").quantized and not report.node("lstm").excludable
    assert report.node("in_proj").quantized and report.node("fc").quantized
    assert any("lstm (LSTM) stay FP32" in n for n in report.notes)


def test_proposals_never_blame_an_integer_tensor(tmp_path):
    """A Gather kept FP32 had been explained as "keeps input_ids float": a unit keyed by the int64 ids ORT
    never quantizes. Units are built over float tensors only."""
    from qdebug.propose import Structure

    model = onnx.shape_inference.infer_shapes(onnx.load(str(embedding_classifier(tmp_path / "m.onnx"))))
    structure = Structure(model, [])
    assert "input_ids" not in structure.activations and {"e", "ln", "pooled"} <= structure.activations
