"""qdebug bench: variants, fairness of the timed loop, the report, the chart, the CLI."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from qdebug.bench import (
    BenchOptions,
    chart_svg,
    int8_flags,
    int8_warning,
    latency_stats,
    load_bench,
    nice_ticks,
    parse_cpuinfo,
    run_bench,
)
from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import sha256_file
from qdebug.output.report_io import dumps, load_report
from qdebug.records import SCHEMA_VERSION, Proposal
from qdebug.runtime.bench_child import IOBINDING_PREALLOCATED, SESSION_RUN, Harness, make_session
from tests.conftest import FIXTURES, fixture_path, qdq_scales
from tests.models import save_graph, small_cnn, small_data

QUICK = ["--runs", "1", "--warmup", "1", "-q"]


# ----------------------------------------------------------------------------- fixtures (module-scoped runs)


@pytest.fixture(scope="module")
def cnn_bench(tmp_path_factory) -> tuple[int, Path, str]:
    """Every non-selective variant of the CNN fixture through the CLI, once for the module."""
    model = fixture_path("cnn", "model.onnx")
    tmp = tmp_path_factory.mktemp("cnn-bench")
    out = tmp / "bench.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(
            [
                "bench",
                str(model),
                "--calib",
                str(FIXTURES / "cnn" / "calib.npz"),
                "--eval",
                str(FIXTURES / "cnn" / "eval.npz"),
                "--variants",
                "fp32,dynamic,static,qoperator",
                "--batch-size",
                "32",
                "--no-cache",
                "-o",
                str(out),
                *QUICK,
            ]
        )
    return code, out, buf.getvalue()


@pytest.fixture(scope="module")
def transformer_bench(tmp_path_factory):
    """FP32, static and selective (the manifest's recovering nodes_to_exclude) on the transformer fixture."""
    model = fixture_path("transformer", "model.onnx")
    manifest = json.loads(fixture_path("manifest.json").read_text())
    nodes = manifest["fixtures"]["transformer"]["selective"]["nodes_to_exclude"]
    tmp = tmp_path_factory.mktemp("transformer-bench")
    proposal = Proposal(
        schema_version=SCHEMA_VERSION,
        kind="proposal",
        model_path=str(model),
        model_sha256=sha256_file(model),
        normalized_model="",
        nodes_to_exclude=tuple(nodes),
    )
    ppath = tmp / "proposal.json"
    ppath.write_text(dumps(proposal))
    report = run_bench(
        model,
        FIXTURES / "transformer" / "calib.npz",
        eval_data=FIXTURES / "transformer" / "eval.npz",
        proposal=ppath,
        output=tmp / "bench.json",
        chart=tmp / "bench.svg",
        options=BenchOptions(variants=("fp32", "static", "selective"), runs=1, warmup=1, use_cache=False),
    )
    return report, manifest, nodes, tmp


# ----------------------------------------------------------------------------- fixtures: every variant


def test_every_variant_builds_runs_and_is_evaluated_on_the_cnn(cnn_bench):
    code, out, stdout = cnn_bench
    assert code == 0
    report = load_bench(out)
    assert [v.name for v in report.variants] == ["fp32", "dynamic", "static", "qoperator"]
    assert report.samples == 500 and report.batch_size == 32
    for v in report.variants:
        assert v.error == "", v.error
        assert v.full is not None and v.full.batch_size == 32
        assert v.full.batches == 500 // 32  # one timed pass
        assert 0 < v.full.min_ms <= v.full.p50_ms <= v.full.p95_ms <= v.full.p99_ms <= v.full.max_ms
        assert v.full.throughput > 0
        assert v.model_bytes == Path(v.model_path).stat().st_size > 0
        assert 0.0 <= v.metric_value <= 1.0
        assert v.peak_rss_mb > v.rss_before_session_mb > 0
        assert v.binding == IOBINDING_PREALLOCATED
        assert v.providers_used[0] == "CPUExecutionProvider"
        assert v.name in stdout
    fp32 = report.variant("fp32")
    assert fp32.speedup == 1.0 and fp32.output_sqnr_db == math.inf
    assert report.variant("static").quant_format == "QDQ"
    assert report.variant("qoperator").quant_format == "QOperator"
    assert report.variant("dynamic").quant_format == "dynamic"
    for name in ("dynamic", "static", "qoperator"):
        v = report.variant(name)
        assert math.isfinite(v.output_sqnr_db) and v.output_sqnr_db > 5
        assert v.model_bytes < fp32.model_bytes  # int8 weights
        assert v.speedup == pytest.approx(fp32.full.p50_ms / v.full.p50_ms)
    # the models really are what their names say
    import onnx

    ops = {
        n: {node.op_type for node in onnx.load(report.variant(n).model_path).graph.node}
        for n in ("dynamic", "static", "qoperator")
    }
    assert "ConvInteger" in ops["dynamic"] or "MatMulInteger" in ops["dynamic"]
    assert "QuantizeLinear" in ops["static"] and "Conv" in ops["static"]
    assert "QLinearConv" in ops["qoperator"]


def test_tail_batch_is_timed_and_reported_separately(cnn_bench):
    _, out, stdout = cnn_bench
    report = load_bench(out)
    for v in report.variants:
        assert v.tail is not None
        assert v.tail.batch_size == 500 % 32 == 20  # never padded to 32
        assert v.tail.batches == 1
    assert "last batch (20 samples" in stdout


def test_machine_is_reported(cnn_bench):
    _, out, stdout = cnn_bench
    m = load_bench(out).machine
    import onnxruntime

    assert m.ort_version == onnxruntime.__version__
    assert m.providers == ("CPUExecutionProvider",)
    assert m.cpu_model and m.logical_cpus >= 1
    assert "machine:" in stdout and "INT8 flags" in stdout


def test_chart_is_an_svg_with_every_variant(cnn_bench):
    _, out, _ = cnn_bench
    svg = out.with_suffix(".svg").read_text()
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for name in ("fp32", "dynamic", "static", "qoperator"):
        assert name in text
    assert len([c for c in root.iter() if c.tag.endswith("circle")]) >= 4


def test_json_round_trips(cnn_bench):
    _, out, _ = cnn_bench
    report = load_bench(out)
    assert dumps(report) == out.read_text()


def test_selective_accuracy_lies_between_static_and_fp32_on_the_transformer(transformer_bench):
    report, manifest, nodes, _ = transformer_bench
    fp32, static, selective = (report.variant(n) for n in ("fp32", "static", "selective"))
    for v in (fp32, static, selective):
        assert v.error == "" and v.full is not None
    assert selective.excluded_nodes == len(nodes)
    assert static.metric_value < fp32.metric_value - 0.05  # the fixture's point: static loses clearly
    assert static.metric_value < selective.metric_value <= fp32.metric_value + 0.01
    entry = manifest["fixtures"]["transformer"]
    tol = manifest["tolerances"]["quantized_top1"]
    assert fp32.metric_value == pytest.approx(entry["fp32_top1"], abs=manifest["tolerances"]["fp32_top1"])
    assert selective.metric_value == pytest.approx(entry["selective"]["top1"], abs=tol)
    assert selective.output_sqnr_db > static.output_sqnr_db


# ----------------------------------------------------------------------------- the timed loop


def _harness(
    tmp_path: Path, n: int = 40, batch: int = 16, **kw
) -> tuple[Harness, list[dict[str, np.ndarray]]]:
    model = small_cnn(tmp_path / "m.onnx")
    x = np.load(small_data(tmp_path / "d.npz", n=n))["input"]
    batches = [{"input": x[i : i + batch]} for i in range(0, n, batch)]
    session = make_session(str(model), ["CPUExecutionProvider"], 1)
    return Harness(session, batches, **kw), batches


def test_timed_loop_allocates_no_input_buffers(tmp_path):
    harness, batches = _harness(tmp_path, n=136, batch=64)
    nbytes = batches[0]["input"].nbytes  # 16 KiB
    # one preallocated buffer per batch shape, shared by every batch of that shape
    bufs = {id(s.copies[0][0]) for s in harness.steps}
    assert len(bufs) == harness.shapes == 2
    assert harness.mode == IOBINDING_PREALLOCATED
    harness.warmup(1)
    got = harness.allocations(20)
    assert got["peak_max"] < nbytes / 8  # a few hundred bytes of Python objects, no buffer
    assert got["net"] < 512

    # the same measurement catches a loop that allocates its input per batch
    session = harness.session
    for step in harness.steps:
        src = step.copies[0][1]
        step.run = lambda src=src: session.run(None, {"input": np.array(src)})
    assert harness.allocations(20)["peak_max"] >= nbytes


def test_loop_times_outputs_whose_shape_depends_on_the_data(tmp_path):
    """Batches of one shape whose NonZero counts differ: the binding was checked on the first batch only,
    and the timed loop then failed with INVALID_ARG (bench said 'fp32 failed' for every variant)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("NonZero", ["r"], ["nz"], name="nz"),
        ],
        "nz",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("nz", TensorProto.INT64, [2, "K"])],
    )
    save_graph(graph, tmp_path / "nz.onnx")
    x = np.random.default_rng(0).normal(0, 1, (48, 8)).astype(np.float32)
    batches = [{"x": x[i : i + 16]} for i in range(0, 48, 16)]
    counts = {int(np.count_nonzero(b["x"] > 0)) for b in batches}
    assert len(counts) > 1  # the batches really differ
    harness = Harness(make_session(str(tmp_path / "nz.onnx"), ["CPUExecutionProvider"], 1), batches)
    assert harness.mode != IOBINDING_PREALLOCATED
    assert any("depends on the data" in n for n in harness.notes)
    harness.warmup(2)
    full, tail = harness.time(3)
    assert len(full) == 9 and len(tail) == 0


def test_loop_refills_buffers_in_place_and_outputs_match_session_run(tmp_path):
    harness, batches = _harness(tmp_path)
    harness.warmup(1)
    ref = [harness.session.run(None, b)[0] for b in batches]
    outs = [o for _, o in harness._alive]  # bound output buffers per shape
    for step, r in zip(harness.steps, ref, strict=True):
        for dst, src in step.copies:
            np.copyto(dst, src)
        step.run()
        bound = next(o[0] for o in outs if o[0].shape == r.shape)
        np.testing.assert_allclose(bound, r, rtol=1e-5, atol=1e-6)


def test_timing_splits_full_and_tail_batches(tmp_path):
    harness, _ = _harness(tmp_path, n=40, batch=16)
    harness.warmup(1)
    full, tail = harness.time(3)
    assert harness.full_size == 16
    assert len(full) == 2 * 3 and len(tail) == 3
    assert (full > 0).all() and (tail > 0).all()


def test_session_run_fallback_is_reported(tmp_path):
    harness, _ = _harness(tmp_path, use_iobinding=False)
    assert harness.mode == SESSION_RUN


def test_latency_stats():
    s = latency_stats([1_000_000, 2_000_000, 3_000_000, 4_000_000], 8)
    assert s is not None
    assert (s.min_ms, s.p50_ms, s.max_ms, s.mean_ms) == (1.0, 2.5, 4.0, 2.5)
    assert s.throughput == pytest.approx(8 * 4 / 0.010)
    assert latency_stats([], 8) is None


# ----------------------------------------------------------------------------- small model, API


def test_per_variant_process_and_every_field_on_a_small_model(tmp_path):
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz")
    report = run_bench(
        model,
        data,
        output=tmp_path / "b.json",
        options=BenchOptions(variants=("fp32", "static"), runs=2, warmup=1, batch_size=16),
    )
    assert [v.name for v in report.variants] == ["fp32", "static"]
    for v in report.variants:
        assert v.full is not None and v.full.batches == 2 * 2
        assert v.tail is not None and v.tail.batch_size == 8 and v.tail.batches == 2
        assert v.session_rss_mb == pytest.approx(v.peak_rss_mb - v.rss_before_session_mb)
    assert any("calibration data" in n for n in report.notes)  # no --eval given
    assert not (tmp_path / "b.svg").exists()  # chart only when asked (the CLI asks by default)


def test_several_methods_give_one_static_variant_each(tmp_path):
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz", n=32)
    report = run_bench(
        model,
        data,
        output=tmp_path / "b.json",
        options=BenchOptions(
            variants=("static",), methods=("minmax", "percentile"), runs=1, warmup=1, batch_size=16
        ),
    )
    assert [(v.name, v.method) for v in report.variants] == [
        ("static-minmax", "minmax"),
        ("static-percentile", "percentile"),
    ]
    assert all(math.isnan(v.speedup) for v in report.variants)  # no FP32 to compare with


# ----------------------------------------------------------------------------- CLI errors


def test_unavailable_provider_lists_the_available_ones(tmp_path, capsys):
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz")
    code = main(
        [
            "bench",
            str(model),
            "--calib",
            str(data),
            "--provider",
            "NoSuchExecutionProvider",
            "-o",
            str(tmp_path / "b.json"),
            "-q",
        ]
    )
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE
    assert "NoSuchExecutionProvider is not available" in err and "CPUExecutionProvider" in err
    assert "Traceback" not in err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["--variants", "fp32,int4"], ExitCode.USAGE, "unknown variant"),
        (["--variants", "selective"], ExitCode.USAGE, "needs a proposal"),
        (["--method", "minmax,magic"], ExitCode.USAGE, "unknown calibration method"),
        (["--runs", "0"], ExitCode.USAGE, "--runs must be >= 1"),
    ],
)
def test_usage_errors(tmp_path, capsys, argv, code, message):
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz")
    got = main(["bench", str(model), "--calib", str(data), "-o", str(tmp_path / "b.json"), "-q", *argv])
    err = capsys.readouterr().err
    assert got == code and message in err and "Traceback" not in err


def test_proposal_for_another_model_is_refused(tmp_path, capsys):
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz")
    proposal = Proposal(SCHEMA_VERSION, "proposal", "other.onnx", "0" * 64, "", ("conv1",))
    (tmp_path / "p.json").write_text(dumps(proposal))
    code = main(
        [
            "bench",
            str(model),
            "--calib",
            str(data),
            "--proposal",
            str(tmp_path / "p.json"),
            "-o",
            str(tmp_path / "b.json"),
            "-q",
        ]
    )
    assert code == ExitCode.INPUT
    assert "made for another model" in capsys.readouterr().err


def test_proposal_naming_unknown_nodes_is_refused(tmp_path, capsys, monkeypatch):
    """Refused before calibration (it was refused after calibrating and building the other variants)."""
    import qdebug.prepare

    def no_calibration(*a, **k):
        raise AssertionError("calibrated before checking the proposal")

    monkeypatch.setattr(qdebug.prepare, "calibrate", no_calibration)
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz")
    proposal = Proposal(SCHEMA_VERSION, "proposal", str(model), sha256_file(model), "", ("no_such_node",))
    (tmp_path / "p.json").write_text(dumps(proposal))
    code = main(
        [
            "bench",
            str(model),
            "--calib",
            str(data),
            "--proposal",
            str(tmp_path / "p.json"),
            "--variants",
            "selective",
            "-o",
            str(tmp_path / "b.json"),
            "-q",
        ]
    )
    assert code == ExitCode.INPUT
    assert "node(s) that are not in" in capsys.readouterr().err
    assert not (tmp_path / "b_files").exists()


# ----------------------------------------------------------------------------- machine, chart helpers


def test_int8_flags_and_warning():
    x86 = (
        "processor : 0\nmodel name : Some Xeon\n"
        "flags : fpu sse avx2 avx512f avx512bw avx512_vnni amx_tile amx_int8\n"
    )
    model, flags = parse_cpuinfo(x86)
    assert model == "Some Xeon"
    assert int8_flags("x86_64", flags) == ("avx512_vnni", "amx_int8", "amx_tile", "avx512bw", "avx2")
    assert int8_warning("x86_64", flags, ["CPUExecutionProvider"]) == ""
    assert "no VNNI/AMX (only AVX2)" in int8_warning("x86_64", {"avx2"}, ["CPUExecutionProvider"])
    assert int8_warning("x86_64", {"avx_vnni", "avx2"}, ["CPUExecutionProvider"]) == ""
    assert int8_warning("x86_64", {"avx2"}, ["CUDAExecutionProvider", "CPUExecutionProvider"]) == ""
    assert "could not read" in int8_warning("x86_64", None, ["CPUExecutionProvider"])
    arm = "processor : 0\nFeatures : fp asimd asimddp i8mm\nCPU part : 0xd40\n"
    _, aflags = parse_cpuinfo(arm)
    assert int8_flags("aarch64", aflags) == ("asimddp", "i8mm")
    assert int8_warning("aarch64", aflags, ["CPUExecutionProvider"]) == ""
    assert "dot-product" in int8_warning("aarch64", {"asimd"}, ["CPUExecutionProvider"])


def test_nice_ticks_cover_the_range():
    assert nice_ticks(0.0, 0.437) == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert nice_ticks(2.0, 8.0) == [2.0, 4.0, 6.0, 8.0]
    t = nice_ticks(93.1, 97.9)
    assert t[0] <= 93.1 and t[-1] >= 97.9
    assert nice_ticks(5.0, 5.0)[0] <= 5.0
    assert nice_ticks(0.0, math.inf) == []


def test_chart_handles_infinite_and_failed_variants(cnn_bench):
    from dataclasses import replace

    _, out, _ = cnn_bench
    report = load_bench(out)
    variants = list(report.variants)
    variants[1] = replace(variants[1], full=None, error="boom")  # failed: not drawn
    variants[2] = replace(variants[2], metric_value=math.inf)
    svg = chart_svg(replace(report, metric="output_sqnr_db", variants=tuple(variants)))
    root = ET.fromstring(svg)
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    assert "∞" in text and "boom" not in text


# ----------------------------------------------------------------------------- dynamic per-layer error


def test_dynamic_variant_has_a_per_layer_report(cnn_bench):
    from qdebug.output.report_io import load_report

    _, out, stdout = cnn_bench
    dyn = load_bench(out).variant("dynamic")
    assert dyn.layer_report and dyn.worst_layers
    layers = load_report(dyn.layer_report)  # an analysis report: qdebug tui opens it
    assert layers.quantized_model.path == dyn.model_path
    assert layers.config.method == "dynamic"
    scored = [t for t in layers.tensors if t.accumulated is not None]
    assert len(scored) >= len(layers.nodes) - 1
    assert all(t.local is None for t in layers.tensors)  # no fixed Q/DQ pair per tensor
    # only nodes the dynamic variant quantized are named (a LayerNormalization it never touches had been)
    assert {n.name for n in layers.nodes if n.quantized} >= {w.node for w in dyn.worst_layers}
    assert layers.weights and all(w.error.sqnr_db > 20 for w in layers.weights)
    assert "dynamic: worst layers" in stdout


def test_dynamic_pairing_follows_the_graph_not_the_names(tmp_path):
    import onnx

    from qdebug.graph.match_dynamic import pair_dynamic
    from qdebug.quant.quantize import quantize_dynamic_model

    fp32_path = fixture_path("transformer", "model.onnx")
    dyn_path = tmp_path / "dyn.onnx"
    quantize_dynamic_model(fp32_path, dyn_path)
    fp32, dyn = onnx.load(str(fp32_path)), onnx.load(str(dyn_path))
    # rename every intermediate tensor of the dynamic model: pairing must not care
    keep = (
        {i.name for i in dyn.graph.input}
        | {o.name for o in dyn.graph.output}
        | {i.name for i in dyn.graph.initializer}
    )
    renamed = {}
    for node in dyn.graph.node:
        for k, name in enumerate(node.output):
            if name and name not in keep:
                renamed[name] = f"t{len(renamed)}"
                node.output[k] = renamed[name]
        node.name = f"n{id(node) % 9973}"
    for node in dyn.graph.node:
        for k, name in enumerate(node.input):
            node.input[k] = renamed.get(name, name)
    pairing, quantized = pair_dynamic(fp32, dyn)
    assert not pairing.unmatched
    for p in pairing.tensors:
        assert p.qdq == renamed.get(p.fp32, p.fp32), p.fp32
    weights = {i.name for i in fp32.graph.initializer}
    matmuls = {n.name for n in fp32.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights}
    assert quantized == matmuls


# ----------------------------------------------------------------------------- proposals: settings and fields


def test_selective_variant_follows_the_proposals_settings(tmp_path):
    """A proposal made with percentile calibration and int8 activations was rebuilt by bench with minmax and
    uint8 (69 scales differed on the transformer): bench now builds with the proposal's settings."""
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz", n=32)
    quant = ["--method", "percentile", "--activation-type", "QInt8"]
    report, prop = tmp_path / "r.json", tmp_path / "p.json"
    assert main(["analyze", str(model), "--calib", str(data), *quant, "-o", str(report), "-q"]) == 0
    assert main(["propose", str(report), "--target-drop", "0", "-o", str(prop), "-q"]) in (0, 6)
    proposal = json.loads(prop.read_text())
    assert proposal["method"] == "percentile" and proposal["activation_type"] == "QInt8"
    args = [
        "bench",
        str(model),
        "--calib",
        str(data),
        "--proposal",
        str(prop),
        "--variants",
        "static,selective",
    ]
    assert (
        main(
            [
                *args,
                "--runs",
                "1",
                "--warmup",
                "0",
                "--no-dynamic-layers",
                "-o",
                str(tmp_path / "b.json"),
                "-q",
            ]
        )
        == 0
    )
    mine, theirs = (
        qdq_scales(tmp_path / "b_files" / "selective.onnx"),
        qdq_scales(Path(proposal["quantized_model"])),
    )
    assert mine.keys() == theirs.keys() and mine
    for name, value in theirs.items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)
    # the static variant shares the settings, so the two columns differ by the exclusions only
    types = _zero_point_types(tmp_path / "b_files" / "static.onnx")
    assert "int8" in types and "uint8" not in types  # QInt8 activations too (int32: biases)


def _zero_point_types(path: Path) -> set[str]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    return {
        str(numpy_helper.to_array(i).dtype) for i in model.graph.initializer if i.name.endswith("_zero_point")
    }


@pytest.mark.parametrize(
    "field, value, expect",
    [
        (
            "tensor_overrides",
            [{"tensor": "x", "quant_type": "Float8"}],
            "quant_type for tensor 'x': 'Float8'",
        ),
        ("method", "minmax2", "has method 'minmax2'"),
        ("activation_type", "QUInt7", "has activation_type 'QUInt7'"),
        ("per_channel", "false", "expected true or false"),
    ],
)
def test_hand_edited_proposal_fields_are_refused(tmp_path, capsys, field, value, expect):
    """A bad quant_type gave an AttributeError traceback (exit 1); "per_channel": "false" loaded as True."""
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "d.npz", n=16)
    proposal = json.loads(dumps(Proposal(SCHEMA_VERSION, "proposal", str(model), sha256_file(model), "", ())))
    proposal[field] = value
    (tmp_path / "p.json").write_text(json.dumps(proposal))
    for command in ("bench", "verify"):
        args = [command, str(model), "--calib", str(data), "--proposal", str(tmp_path / "p.json"), "-q"]
        if command == "bench":
            args += ["--variants", "selective", "-o", str(tmp_path / "b.json")]
        assert main(args) == ExitCode.INPUT, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expect in err[0], (command, err)


def test_names_listed_twice_count_once(tmp_path):
    from qdebug.output.report_io import load_proposal

    model = small_cnn(tmp_path / "m.onnx")
    proposal = json.loads(dumps(Proposal(SCHEMA_VERSION, "proposal", str(model), sha256_file(model), "", ())))
    proposal["nodes_to_exclude"] = ["a", "b", "a", "b"]
    proposal["tensor_overrides"] = [{"tensor": "t", "quant_type": "QUInt16"}] * 2
    (tmp_path / "p.json").write_text(json.dumps(proposal))
    loaded = load_proposal(tmp_path / "p.json")
    assert loaded.nodes_to_exclude == ("a", "b") and len(loaded.tensor_overrides) == 1
    proposal["tensor_overrides"].append({"tensor": "t", "quant_type": "QInt16"})
    (tmp_path / "p.json").write_text(json.dumps(proposal))
    with pytest.raises(QDebugError, match="two types"):
        load_proposal(tmp_path / "p.json")


def test_variants_are_timed_in_turns(tmp_path):
    """Every variant's process stays open and the passes go round robin (they ran one variant after
    another, so a slow-down late in the run fell on the last variants only)."""
    from qdebug.bench import child_spec, run_children_interleaved, write_batches
    from qdebug.data import Batch

    model = small_cnn(tmp_path / "m.onnx")
    x = np.load(small_data(tmp_path / "d.npz", n=20))["input"]
    batches = [Batch({"input": x[:16]}, None, 16, "d"), Batch({"input": x[16:]}, None, 4, "d")]
    write_batches(batches, ["input"], tmp_path / "in.npz")
    options = BenchOptions(runs=4, warmup=1, alloc_batches=2)
    specs = {
        name: child_spec(model, tmp_path / "in.npz", ["input"], 2, options, tmp_path / f"{name}.json")
        for name in ("a", "b", "c")
    }
    specs["broken"] = dict(specs["a"], model=str(tmp_path / "missing.onnx"), result=str(tmp_path / "x.json"))
    results = run_children_interleaved(specs, tmp_path, runs=4)
    assert not results["broken"]["ok"] and "NoSuchFile" in results["broken"]["error"]
    order = sorted((t, name) for name in "abc" for t in results[name]["pass_starts_ns"])
    names = [name for _, name in order]
    assert len(names) == 12
    for r in range(4):  # each pass runs every variant once, the first one rotating
        assert sorted(names[3 * r : 3 * r + 3]) == ["a", "b", "c"]
    assert names[:3] != names[3:6]
    for name in "abc":
        assert len(results[name]["full_ns"]) == 4 and len(results[name]["tail_ns"]) == 4


_OK_CHILD = """
import json, sys
spec = json.load(open(sys.argv[1]))
print("ready", flush=True)
passes = 0
for line in sys.stdin:
    if line.strip() == "pass":
        passes += 1
        print("done", flush=True)
    elif line.strip() == "finish":
        break
json.dump({"ok": True, "full_ns": [1000] * passes}, open(spec["result"], "w"))
"""


def test_a_hanging_measuring_process_is_killed_and_reported(tmp_path, monkeypatch):
    """A process that never answers (a provider deadlock, a model that never returns) had blocked bench
    forever; now it is killed after the timeout, reported as its variant's error, and the others finish.
    The healthy process is a stand-in that answers at once: a real one (importing onnxruntime, building a
    session) could miss a short timeout on a loaded CI machine, and real ones are run by the other tests."""
    import os
    import sys
    import time

    import qdebug.bench.children as children
    from qdebug.bench import run_children_interleaved

    specs = {name: {"result": str(tmp_path / f"{name}.json")} for name in ("ok", "hang_start", "hang_pass")}
    hangs = {
        "hang_start": "import time; time.sleep(120)",
        "hang_pass": "import sys, time; print('ready', flush=True); sys.stdin.readline(); time.sleep(120)",
    }

    def command(spec_path, serve=False):
        code = hangs.get(spec_path.name.split(".")[0], _OK_CHILD)
        return [sys.executable, "-c", code, str(spec_path)], dict(os.environ)

    monkeypatch.setattr(children, "_child_command", command)
    start = time.monotonic()
    results = run_children_interleaved(specs, tmp_path, runs=2, timeout=2)
    assert time.monotonic() - start < 60  # not 120 s per hanging process
    assert results["ok"] == {"ok": True, "full_ns": [1000, 1000]}
    assert not results["hang_start"]["ok"] and "did not start within 2 s" in results["hang_start"]["error"]
    assert not results["hang_pass"]["ok"]
    assert "did not finish a timed pass within 2 s" in results["hang_pass"]["error"]


def test_dynamic_pairing_reads_an_int8_embedding_through_its_dequantize(tmp_path):
    """quantize_dynamic keeps a Gather as it is but makes its table int8 and dequantizes after it: the FP32
    Gather output had been paired with the Gather's uint8 output (-42 dB, 'introduced' 162 dB) and every
    node downstream left without a counterpart."""
    import onnx

    from qdebug.graph.match_dynamic import pair_dynamic
    from qdebug.quant.quantize import quantize_dynamic_model
    from tests.models import embedding_classifier

    rng = np.random.default_rng(0)
    model = embedding_classifier(tmp_path / "m.onnx")
    dyn_path = tmp_path / "dyn.onnx"
    quantize_dynamic_model(model, dyn_path)
    fp32, dyn = onnx.load(str(model)), onnx.load(str(dyn_path))
    gather = next(n for n in dyn.graph.node if n.op_type == "Gather")
    assert dyn.graph.node[1].op_type == "DequantizeLinear", "ORT no longer quantizes the table: test moot"
    pairing, quantized = pair_dynamic(fp32, dyn)
    by_fp32 = {p.fp32: p.qdq for p in pairing.tensors}
    dq = next(n for n in dyn.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == gather.output[0])
    assert by_fp32["e"] == dq.output[0] != gather.output[0]
    assert by_fp32["ln"] and by_fp32["pooled"] and not pairing.unmatched
    assert {"embed", "cls"} <= quantized

    np.savez(tmp_path / "d.npz", input_ids=rng.integers(0, 50, (16, 8)))
    args = ["bench", str(model), "--calib", str(tmp_path / "d.npz"), "--variants", "fp32,dynamic"]
    assert main([*args, "--runs", "1", "-o", str(tmp_path / "b.json"), "-q", "--no-chart"]) == 0
    report = load_report(tmp_path / "b_files" / "dynamic.report.json")
    assert report.tensor("e").accumulated.sqnr_db > 25  # int8 table: ~43 dB, not -42
