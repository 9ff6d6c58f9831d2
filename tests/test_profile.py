"""``qdebug profile``: ORT's profiler trace booked to the user's nodes, on real small models.

The FP32 model is Conv -> BatchNormalization -> Relu -> Conv -> Relu -> Erf -> Conv -> GlobalAveragePool ->
Flatten -> MatMul -> Add, quantized with ORT's ``quantize_static`` (QDQ, no pre-processing, so the
BatchNormalization stays unfolded between Q/DQ pairs and the Erf has no integer kernel). Every assertion is
structural or an inequality that holds by construction (see :func:`test_kernel_time_is_bounded_by_run_time`):
nothing depends on how fast this machine is or which x86 instruction sets it has.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.records.profile import CAUSES, ORT_INSERTED, PROFILE_SCHEMA_VERSION, ProfileReport, sorted_nodes
from qdebug.runtime.profile import LAYOUT_OPS, parse_trace, run_profile

C = 16
RUNS = 6


def _fp32_model(path: Path) -> Path:
    rng = np.random.default_rng(0)

    def init(name: str, shape: tuple[int, ...], scale: float = 0.3, low: float | None = None) -> onnx.TensorProto:
        a = rng.uniform(low, 1.5, shape) if low is not None else rng.normal(size=shape) * scale
        return numpy_helper.from_array(a.astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s", "bb", "m", "v"], ["n1"], name="bn1"),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Erf", ["r2"], ["e2"], name="erf"),
        helper.make_node("Conv", ["e2", "w3", "b3"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c3"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "wm"], ["mm"], name="fc"),
        helper.make_node("Add", ["mm", "bm"], ["y"], name="fc_bias"),
    ]
    inits = [
        init("w1", (C, 3, 3, 3)), init("b1", (C,)),
        init("s", (C,), low=0.5), init("bb", (C,)), init("m", (C,)), init("v", (C,), low=0.5),
        init("w2", (C, C, 3, 3), 0.1), init("b2", (C,)),
        init("w3", (C, C, 3, 3), 0.1), init("b3", (C,)),
        init("wm", (C, 10)), init("bm", (10,)),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "profiled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 24, 24])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _quantized(fp32: Path, data: np.ndarray, path: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([{"x": data[i : i + 4]} for i in range(0, len(data), 4)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    quantize_static(str(fp32), str(path), Reader(), quant_format=QuantFormat.QDQ)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("profile")
    x = np.random.default_rng(1).normal(size=(8, 3, 24, 24)).astype(np.float32)
    np.savez(d / "data.npz", x=x)
    fp32 = _fp32_model(d / "fp32.onnx")
    return {"fp32": fp32, "int8": _quantized(fp32, x, d / "int8.onnx"), "data": d / "data.npz", "dir": d}


@pytest.fixture(scope="module")
def report(files: dict[str, Path]) -> ProfileReport:
    return run_profile(files["fp32"], files["int8"], str(files["data"]), runs=RUNS)


def _user_nodes(path: Path) -> dict[str, str]:
    return {n.name: n.op_type for n in onnx.load(str(path)).graph.node}


def test_every_kernel_is_booked_to_user_nodes_or_inserted_by_ort(report: ProfileReport, files: dict[str, Path]) -> None:
    """Each kernel of both traces computes named nodes of its own model, booked to one of them, or is a
    layout kernel ORT inserted; every Conv is booked exactly one kernel, fusions land where they should."""
    for profile, path in ((report.fp32, files["fp32"]), (report.int8, files["int8"])):
        assert profile is not None and profile.kernels
        user = _user_nodes(path)
        booked: dict[str, int] = {}
        for k in profile.kernels:
            if k.nodes:
                assert set(k.nodes) <= set(user), k
                assert k.booked_to in k.nodes, k
                booked[k.booked_to] = booked.get(k.booked_to, 0) + 1
            else:
                assert k.op_type in LAYOUT_OPS, f"{k.name} ({k.op_type}) is neither a user node's nor {ORT_INSERTED}"
                assert k.booked_to == ""
        for conv in ("conv1", "conv2", "conv3"):
            assert booked.get(conv) == 1, (path.name, conv, booked)
    rows = {n.name: n for n in report.nodes}
    assert rows["bn1"].fp32_kernel == "fused into conv1"  # Conv+BN(+Relu) is one FP32 kernel
    assert rows["fc_bias"].fp32_kernel == "fused into fc"  # MatMul+Add -> Gemm
    assert rows["fc"].fp32_kernel == "Gemm"
    for conv in ("conv1", "conv2", "conv3"):
        assert rows[conv].int8_kernel == "QLinearConv" and rows[conv].integer
    assert not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in report.nodes)


def test_kernel_time_is_bounded_by_run_time(report: ProfileReport) -> None:
    """Bounds that hold however loaded the machine is.

    Upper, run by run: ORT's sequential executor runs one kernel at a time (intra-op threads work inside
    a kernel's interval), every kernel event of a run lies inside that run's ``model_run`` event, and that
    inside the ``session.run`` call timed with perf_counter; so each run's kernel sum <= its wall time, and
    the means over the same runs keep the order. Slack: durations are whole microseconds (1 us per event).
    Lower: the time between kernels is the executor's few microseconds per kernel, but a preemption that
    lands between two kernels (a loaded 2-core machine) stretches one run's wall time only. So the bound is
    on the best run, not the mean: some run of the six spends at least a quarter of its wall time in
    kernels (0.85-0.9 unloaded).
    Accounting: every kernel's time is booked exactly once -- to a node row, as Q/DQ time around one, or
    as ORT-inserted -- so the rows and the inserted kernels add up to the kernel total.
    """
    assert report.int8 is not None
    for m in (report.fp32, report.int8):
        assert m.runs == RUNS == len(m.run_wall_ms) == len(m.run_kernel_ms)
        slack_ms = len(m.kernels) * 1e-3
        for kernel_ms, wall_ms in zip(m.run_kernel_ms, m.run_wall_ms, strict=True):
            assert kernel_ms <= wall_ms + slack_ms
        assert m.kernel_ms <= m.model_run_ms + slack_ms
        assert m.model_run_ms <= m.wall_mean_ms + 1e-3
        assert m.kernel_ms == pytest.approx(sum(m.run_kernel_ms) / m.runs, rel=1e-6)
        assert max(k / w for k, w in zip(m.run_kernel_ms, m.run_wall_ms, strict=True)) >= 0.25
    fp32_rows = sum(n.fp32_ms for n in report.nodes)
    int8_rows = sum(n.int8_ms + n.qdq_ms for n in report.nodes)
    assert fp32_rows + report.fp32.inserted_ms == pytest.approx(report.fp32.kernel_ms, rel=1e-9, abs=1e-9)
    assert int8_rows + report.int8.inserted_ms == pytest.approx(report.int8.kernel_ms, rel=1e-9, abs=1e-9)


def test_causes_name_the_nodes_that_lose_time(report: ProfileReport) -> None:
    """The BatchNormalization left between Q/DQ pairs is unfolded-batchnorm; the Erf between them (no
    integer kernel) is no-integer-kernel; the Convs with integer kernels get no structural cause."""
    rows = {n.name: n for n in report.nodes}
    bn = rows["bn1"]
    assert bn.op_type == "BatchNormalization"
    assert bn.cause == "unfolded-batchnorm" and bn.explanation == CAUSES["unfolded-batchnorm"]
    assert bn.int8_kernel == "BatchNormalization" and not bn.integer
    assert bn.int8_ms > 0 and bn.qdq_ms > 0 and bn.fp32_ms == 0  # FP32 folds it into conv1; INT8 runs it
    assert bn.saved_ms < 0
    assert rows["erf"].cause == "no-integer-kernel" and rows["erf"].qdq_ms > 0
    for conv in ("conv1", "conv2", "conv3"):
        assert rows[conv].cause in ("", "qdq-overhead")
    assert report.verdict.startswith("static INT8 is ")
    # the verdict names the three nodes that lose the most time, with their causes: which three depends on
    # the timings (under load another node can outlose bn1), so the check is that it names exactly those
    losers = [n for n in sorted_nodes(report.nodes, "lost") if n.saved_ms < 0][:3]
    assert losers and all(f"{n.name} ({n.cause or n.op_type}" in report.verdict for n in losers)
    assert sorted_nodes(report.nodes, "lost")[0].saved_ms <= sorted_nodes(report.nodes, "saved")[0].saved_ms


def test_parse_trace_skips_the_warm_up_and_fences(tmp_path: Path) -> None:
    """Kernel events of the warm-up run and fence events are left out; each timed run gets its own sum."""

    def run(ts: int, dur: int) -> dict:
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def kernel(name: str, ts: int, dur: int, dtype: str = "float") -> dict:
        args = {"op_name": "Conv", "provider": "CPUExecutionProvider", "input_type_shape": [{dtype: [1]}]}
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": args}

    events = [
        run(0, 100), kernel("a", 10, 50),  # warm-up
        run(200, 100), kernel("a", 210, 30), {"cat": "Node", "name": "a_fence_before", "ts": 205, "dur": 1},
        kernel("b", 250, 20, "uint8"),
        run(400, 100), kernel("a", 410, 40),
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    trace = parse_trace(path, warmup=1)
    assert trace.runs == 2
    assert trace.kernel_us_per_run == (50.0, 40.0)
    assert trace.model_run_us == (100.0, 100.0)
    times = {k.name: (k.total_us, k.integer) for k in trace.kernels}
    assert times == {"a": (70.0, False), "b": (20.0, True)}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_table_json_errors_and_inputs_untouched(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [files["fp32"], files["int8"], files["data"]]
    before = [(_sha(p), p.stat().st_mtime_ns) for p in inputs]
    out = tmp_path / "profile.json"
    argv = [str(files["fp32"]), str(files["int8"]), "--data", str(files["data"]), "--runs", "3", "-q"]
    assert main(["profile", *argv, "--json", str(out), "--sort", "saved", "--top", "5"]) == 0
    printed = capsys.readouterr()
    for word in ("node", "FP32 ms", "INT8 ms", "saved ms", "Q/DQ ms", "cause", "static INT8 is"):
        assert word in printed.out
    assert "5 of 11 nodes" in printed.out and "6 more nodes" in printed.out  # --top 5
    saved = json.loads(out.read_text())
    assert saved["schema_version"] == PROFILE_SCHEMA_VERSION and saved["kind"] == "profile"
    assert {n["name"] for n in saved["nodes"]} >= {"conv1", "bn1", "erf"}
    assert [(_sha(p), p.stat().st_mtime_ns) for p in inputs] == before
    assert not list(Path.cwd().glob("onnxruntime_profile*"))  # the trace never lands in the working directory

    missing = tmp_path / "missing.onnx"
    assert main(["profile", str(missing), "--data", str(files["data"])]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing.onnx" in err and "Traceback" not in err

    not_onnx = tmp_path / "junk.onnx"
    not_onnx.write_text("not a model")
    assert main(["profile", str(not_onnx), "--data", str(files["data"])]) == 3
    assert capsys.readouterr().err.count("\n") == 1

    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((2, 4, 24, 24), np.float32))
    assert main(["profile", str(files["fp32"]), "--data", str(wrong)]) == 5
    assert capsys.readouterr().err.count("\n") == 1

    assert main(["profile", *argv, "--json", str(files["data"])]) == 2  # an output that is an input
    assert capsys.readouterr().err.count("\n") == 1
    assert [(_sha(p), p.stat().st_mtime_ns) for p in inputs] == before


def test_unnamed_nodes_are_named_in_a_copy_and_paired_through_the_q_dq(tmp_path: Path, files: dict[str, Path]) -> None:
    """ORT's profiler calls an unnamed node ``<op>_<internal index>`` and its saved optimized graph leaves the
    name empty: the profile runs a named copy (the user's file untouched), and the INT8 model's unnamed
    nodes pair with the FP32 ones by output, else by the float tensor they read through Q/DQ."""
    model = onnx.load(str(files["fp32"]))
    for n in model.graph.node:
        n.name = ""
    fp32 = tmp_path / "unnamed.onnx"
    onnx.save(model, str(fp32))
    x = np.load(files["data"])["x"]
    int8 = _quantized(fp32, x, tmp_path / "unnamed.int8.onnx")
    before = _sha(fp32)
    report = run_profile(fp32, int8, str(files["data"]), runs=2)
    assert _sha(fp32) == before and sorted(p.name for p in tmp_path.iterdir()) == ["unnamed.int8.onnx", "unnamed.onnx"]
    for m in (report.fp32, report.int8):
        assert m is not None
        assert all(k.nodes or k.op_type in LAYOUT_OPS for k in m.kernels)
    rows = [n for n in report.nodes if n.op_type in ("Conv", "BatchNormalization", "Erf")]
    assert [n.int8_kernel for n in rows] == ["QLinearConv", "BatchNormalization", "QLinearConv", "Erf", "QLinearConv"]
    assert [n.cause for n in rows if n.cause in ("unfolded-batchnorm", "no-integer-kernel")] == [
        "unfolded-batchnorm",
        "no-integer-kernel",
    ]
