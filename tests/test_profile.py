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
from qdebug.records.profile import (
    CAUSES,
    ORT_INSERTED,
    PROFILE_SCHEMA_VERSION,
    KernelRecord,
    ModelProfile,
    ProfileReport,
    sorted_nodes,
)
from qdebug.runtime.capture import SessionConfig
from qdebug.runtime.profile import (
    LAYOUT_OPS,
    QDQ_OVERHEAD_MIN_MS,
    GraphIndex,
    KernelMapping,
    ModelRun,
    ModelToProfile,
    node_rows,
    parse_trace,
    profile_models,
    run_profile,
    subgraph_parents,
    timed_rounds,
)
from qdebug.runtime.timing import CHUNK_RUNS

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


def _loop_model(path: Path) -> Path:
    """Relu -> Loop (10 times: MatMul -> Tanh on a 32x32 state, and an unnamed Identity for the condition)."""
    w = numpy_helper.from_array(np.random.default_rng(2).normal(0, 0.1, (32, 32)).astype(np.float32), "W")
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["s_in", "W"], ["m"], name="body_mm"),
            helper.make_node("Tanh", ["m"], ["s_out"], name="body_tanh"),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_in", TensorProto.FLOAT, ["N", 32]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s_out", TensorProto.FLOAT, ["N", 32]),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Loop", ["trip", "cond", "r"], ["y"], name="loop", body=body),
        ],
        "looped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 32])],
        [w, numpy_helper.from_array(np.array(10, np.int64), "trip"), numpy_helper.from_array(np.array(True), "cond")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_loop_body_kernels_count_once_in_the_loop(tmp_path: Path) -> None:
    """The profiler times a Loop body's kernels inside the Loop's own event: they are detail booked to
    the Loop node (the unnamed one named in the copy), never ORT-inserted, and in no total, so that the
    kernel sum stays within ORT's model_run and the wall time (it was twice the body's time before)."""
    path = _loop_model(tmp_path / "loop.onnx")
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(3).normal(size=(16, 32)).astype(np.float32))
    before = _sha(path)
    report = run_profile(path, None, str(tmp_path / "x.npz"), runs=4, config=SessionConfig(intra_op_threads=1))
    assert _sha(path) == before
    m = report.fp32
    assert {k.name for k in m.kernels} == {"relu", "loop"}
    assert all(k.nodes == (k.booked_to,) for k in m.kernels) and m.inserted_ms == 0
    inner = {k.name: k for k in m.subgraph_kernels}
    assert set(inner) == {"body_mm", "body_tanh", "loop/Identity_2"}
    assert all(k.inside == "loop" and k.booked_to == "loop" and k.nodes == ("loop",) for k in inner.values())
    loop = next(k for k in m.kernels if k.name == "loop")
    slack_ms = (len(m.kernels) + len(inner)) * 2e-3
    assert sum(k.ms_per_run for k in inner.values()) <= loop.ms_per_run + slack_ms
    assert m.kernel_ms == pytest.approx(sum(k.ms_per_run for k in m.kernels), rel=1e-9)
    assert m.kernel_ms <= m.model_run_ms + slack_ms
    for kernel_ms, wall_ms in zip(m.run_kernel_ms, m.run_wall_ms, strict=True):
        assert kernel_ms <= wall_ms + slack_ms
    rows = {n.name: n for n in report.nodes}
    assert set(rows) == {"relu", "loop"} and rows["loop"].fp32_ms == loop.ms_per_run


def test_parse_trace_books_a_body_kernel_inside_its_parent_event_only(tmp_path: Path) -> None:
    """An event of a body node that lies inside its Loop's event of the same run is detail of that Loop;
    the same name outside it (a main-graph node of that name) stays a kernel of its own."""

    def event(name: str, ts: int, dur: int, op: str = "MatMul") -> dict:
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [
        {"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},
        event("loop", 10, 60, "Loop"), event("mm", 12, 20), event("mm", 40, 20), event("mm", 75, 5),
    ]  # fmt: skip
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    trace = parse_trace(path, warmup=0, subgraphs={"mm": "loop"})
    assert {(k.name, k.total_us, k.inside) for k in trace.kernels} == {("loop", 60.0, ""), ("mm", 5.0, "")}
    assert [(k.name, k.total_us, k.inside) for k in trace.subgraph_kernels] == [("mm", 40.0, "loop")]
    assert trace.kernel_us_per_run == (65.0,)
    assert parse_trace(path, warmup=0).kernel_us_per_run == (105.0,)  # without the map: counted twice


def test_a_model_ort_refuses_is_one_line_on_stderr(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """ORT's own log line (``EndProfiling] Could not write a profile because no model was loaded``, on the
    process's stderr) is silenced; ORT's reason is in qdebug's one line."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="twice"), helper.make_node("Relu", ["r"], ["y"], name="twice")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "refused.onnx"))
    np.savez(tmp_path / "x.npz", x=np.zeros((1,), np.float32))
    assert main(["profile", str(tmp_path / "refused.onnx"), "--data", str(tmp_path / "x.npz"), "-q"]) == 4
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "cannot load the FP32 model" in err and "same node name" in err, err


def test_the_optimized_graph_keeps_its_initializers_in_a_data_file(tmp_path: Path) -> None:
    """ORT saves the optimized graph with every initializer of 1 KiB or more in a file beside it (as
    capture's optimize_for_capture does): a model over the protobuf limit saves too, and no weight is
    copied inline."""
    path = _loop_model(tmp_path / "loop.onnx")
    proto = onnx.load(str(path))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    feeds = [{"x": np.ones((2, 32), np.float32)}]
    (run,) = profile_models([ModelToProfile(path, proto, _sha(path), "FP32 model")], feeds, SessionConfig(), runs=1,
                            scratch=scratch)  # fmt: skip
    assert run.profile.runs == 1
    optimized = onnx.load(str(scratch / "fp32-optimized.onnx"), load_external_data=False)
    assert (scratch / "fp32-optimized.data").stat().st_size >= 32 * 32 * 4
    assert (scratch / "fp32-optimized.onnx").stat().st_size < 32 * 32 * 4
    external = [t.name for g in _graphs(optimized.graph) for t in g.initializer
                if t.data_location == TensorProto.EXTERNAL]  # fmt: skip
    assert "W" in external
    assert subgraph_parents(optimized.graph).keys() >= {"body_mm", "body_tanh", "loop/Identity_2"}


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    out = [graph]
    for n in graph.node:
        for a in n.attribute:
            if a.HasField("g"):
                out += _graphs(a.g)
    return out


def test_timed_runs_alternate_between_the_models_in_rounds() -> None:
    """One warm-up run each, then rounds of CHUNK_RUNS runs per model in turn, run k of each on batch k."""
    calls: list[tuple[str, int]] = []
    batches = [[{"k": np.array(i)} for i in range(3)], [{"k": np.array(i)} for i in range(3)]]
    steps = [lambda b, m=m: calls.append((m, int(b["k"]))) for m in ("fp32", "int8")]
    runs = 2 * CHUNK_RUNS + 5
    walls = timed_rounds(steps, batches, runs)
    assert [len(w) for w in walls] == [runs, runs]
    assert calls[:2] == [("fp32", 0), ("int8", 0)]
    expected = []
    for start, size in ((0, CHUNK_RUNS), (CHUNK_RUNS, CHUNK_RUNS), (2 * CHUNK_RUNS, 5)):
        for m in ("fp32", "int8"):
            expected += [(m, k % 3) for k in range(start, start + size)]
    assert calls[2:] == expected


def _qdq_runs(
    fp32_ms: float, int8_ms: float, q_ms: float, out_dq_ms: float, other_ms: float
) -> tuple[ModelRun, ModelRun]:
    """FP32 ``x -> sm -> y`` and INT8 ``x -> q -> dq -> sm -> q2 -> dq2 -> y`` (dq2 writes the graph
    output), each node its own kernel: ``q`` and ``dq2`` cost ``q_ms`` and ``out_dq_ms``, the node's integer
    kernel ``int8_ms``, and a kernel ORT inserted ``other_ms`` (the rest of a larger model)."""

    def graph(nodes: list[onnx.NodeProto]) -> GraphIndex:
        io = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [1]) for t in ("x", "y")]
        return GraphIndex.of(helper.make_graph(nodes, "g", io[:1], io[1:]))

    def run(user: GraphIndex, times: dict[str, float], integer: bool) -> ModelRun:
        kernels = [KernelRecord(n, user.nodes[user.names.index(n)].op_type, "CPU", ms, integer, (n,), n)
                   for n, ms in times.items()]  # fmt: skip
        kernels.append(KernelRecord("reorder", "ReorderInput", "CPU", other_ms, False, (), ""))
        mappings = {k.name: KernelMapping((user.names.index(k.name),), user.names.index(k.name)) for k in kernels
                    if k.nodes}  # fmt: skip
        mappings["reorder"] = KernelMapping((), None)
        total = sum(k.ms_per_run for k in kernels)
        profile = ModelProfile("m.onnx", "", 1, total, total, total, total, other_ms, (total,), (total,),
                               tuple(kernels))  # fmt: skip
        return ModelRun(profile, user, mappings)

    fp32 = graph([helper.make_node("Softmax", ["x"], ["y"], name="sm")])
    int8 = graph([
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        helper.make_node("Softmax", ["xd"], ["sm_out"], name="sm"),
        helper.make_node("QuantizeLinear", ["sm_out", "s", "z"], ["yq"], name="q2"),
        helper.make_node("DequantizeLinear", ["yq", "s", "z"], ["y"], name="dq2"),
    ])  # fmt: skip
    return run(fp32, {"sm": fp32_ms}, False), run(int8, {"q": q_ms, "sm": int8_ms, "dq2": out_dq_ms}, True)


def test_a_graph_outputs_dequantize_is_no_qdq_overhead() -> None:
    """The DequantizeLinear writing a graph output is in the node's Q/DQ time, but no cause: the INT8 model
    pays it wherever its quantized region ends. Without it the same node is qdq-overhead."""
    (row,) = node_rows(*_qdq_runs(fp32_ms=1.0, int8_ms=0.9, q_ms=0.05, out_dq_ms=0.2, other_ms=0.0))
    assert (row.name, row.qdq_ms, row.output_dq_ms, row.cause) == ("sm", pytest.approx(0.25), 0.2, "")
    assert row.saved_ms == pytest.approx(-0.15)
    (row,) = node_rows(*_qdq_runs(fp32_ms=1.0, int8_ms=0.9, q_ms=0.25, out_dq_ms=0.0, other_ms=0.0))
    assert (row.qdq_ms, row.output_dq_ms, row.cause) == (0.25, 0.0, "qdq-overhead")


@pytest.mark.parametrize(
    ("q_ms", "other_ms", "cause"),
    [
        (QDQ_OVERHEAD_MIN_MS / 2, 0.0, ""),  # microseconds: noise
        (0.05, 10.0, ""),  # 0.05 ms of an INT8 run of 10.95 ms: below 2 %
        (0.05, 1.0, "qdq-overhead"),  # 0.05 of 1.95 ms: over both
    ],
)
def test_qdq_overhead_needs_time_that_is_no_noise(q_ms: float, other_ms: float, cause: str) -> None:
    """In every case the node's integer kernel saves 0.001 ms and its Q/DQ costs more than that."""
    (row,) = node_rows(*_qdq_runs(fp32_ms=0.901, int8_ms=0.9, q_ms=q_ms, out_dq_ms=0.0, other_ms=other_ms))
    assert 0 < row.fp32_ms - row.int8_ms < row.qdq_ms
    assert row.cause == cause


def test_analyze_profile_records_each_nodes_time_under_the_reports_node_names(tmp_path, capsys):
    """``analyze --profile RUNS`` profiles the report's normalized FP32 model and its quantized model and puts
    the result in the report: every profiled node is one of the report's nodes (the same names), and the
    summary ends with the profile's verdict. With several calibration methods it is refused in one line."""
    from qdebug.cli.main import main
    from qdebug.output.report_io import load_report
    from tests.models import small_cnn, small_data

    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(data), "--profile", "3", "-o", str(report), "-q"]) == 0
    assert "latency (ORT's profiler, 3 runs): " in capsys.readouterr().out
    rep = load_report(report)
    assert rep.profile is not None and rep.profile.int8 is not None and rep.profile.fp32.runs == 3
    assert {n.name for n in rep.profile.nodes} <= {n.name for n in rep.nodes} and rep.profile.nodes
    argv = ["analyze", str(model), "--calib", str(data), "--method", "minmax,entropy", "--profile", "3"]
    assert main([*argv, "-o", str(tmp_path / "m.json"), "-q"]) == 2
    assert "--profile takes one calibration method" in capsys.readouterr().err
