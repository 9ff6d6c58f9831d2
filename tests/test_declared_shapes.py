"""A model whose declared output shape disagrees with what ONNX Runtime returns (issue 16, item 4).

The trait, from a CNN+LSTM text recognizer: the output is declared ``[1, seqlen]`` and ORT returns
``[seqlen, 1, 8210]``. ORT loads it (shape inference cannot see the rank through the exporter's dynamic
Reshape), warns on every run of a session with default logging, and refuses to reuse an output buffer it
allocated itself ("Invalid rank for output: ... Got: 3 Expected: 2"): ``qdebug verify`` ended with that
traceback when it timed the variants. The fixture hides the rank the same way: the Reshape's target shape
is sliced to a data-dependent length, so neither ONNX nor ORT's optimizer can tell its rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.runtime.bench_child import IOBINDING_ORT_OUTPUTS, Harness, declared_shape_mismatches, make_session
from qdebug.runtime.capture import SessionConfig
from qdebug.verify import time_sessions

WARNING = "VerifyOutputSizes"
"""What ORT's per-run warning about the output says (``execution_frame.cc ... VerifyOutputSizes``)."""


def wrong_declared_output(path: Path, seed: int = 0) -> Path:
    """MatMul-Relu-MatMul to ``logits [N, seqlen, 8]``, then a Reshape to its own shape whose target is
    sliced to ``max(dims)`` (clamped: all of them), so its rank is unknown until it runs; the graph output
    ``out`` is declared ``[N, seqlen]``: rank 2 for a rank-3 tensor."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 16)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (16, 8)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="fc2"),
        helper.make_node("Shape", ["logits"], ["dims_all"], name="dims_all"),
        helper.make_node("ReduceMax", ["dims_all"], ["dims_end"], name="dims_end", keepdims=1),
        helper.make_node("Slice", ["dims_all", "zero", "dims_end"], ["dims"], name="dims"),
        helper.make_node("Reshape", ["logits", "dims"], ["out"], name="reshape_out"),
    ]
    graph = helper.make_graph(
        nodes,
        "wrong_declared_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "seqlen", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", "seqlen"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def sequences(path: Path, n: int = 40, seed: int = 1) -> Path:
    """``n`` sequences of 5 steps of 4 features (in batches of 4: ten batches, ten warnings before)."""
    np.savez(path, x=np.random.default_rng(seed).random((n, 5, 4)).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def fixture(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("declared")
    return wrong_declared_output(tmp / "model.onnx"), sequences(tmp / "calib.npz")


def _batch(rows: int = 4) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(2).random((rows, 5, 4)).astype(np.float32)}


# ----------------------------------------------------------------------------- the trait itself


def test_ort_refuses_to_reuse_the_outputs_of_a_wrongly_declared_model(fixture):
    """The fixture keeps the trait: declared rank 2 after ORT's optimizations, rank 3 returned, and
    a binding that reuses ORT's own output fails on its second run (what verify's loop did)."""
    session = make_session(str(fixture[0]), ["CPUExecutionProvider"], 1)
    assert session.get_outputs()[0].shape == ["N", "seqlen"]
    assert session.run(None, _batch())[0].shape == (4, 5, 8)
    io = session.io_binding()
    io.bind_cpu_input("x", _batch()["x"])
    io.bind_output("out")
    session.run_with_iobinding(io)
    with pytest.raises(RuntimeError, match="Invalid rank for output: out Got: 3 Expected: 2"):
        session.run_with_iobinding(io)


def test_the_mismatch_names_the_output_and_both_shapes(fixture):
    session = make_session(str(fixture[0]), ["CPUExecutionProvider"], 1)
    notes = declared_shape_mismatches(session, session.run(None, _batch()))
    assert list(notes) == ["out"]
    assert "'out' as [N, seqlen] but ONNX Runtime returns [4, 5, 8]" in notes["out"]


def test_a_conforming_declaration_is_not_reported(tmp_path):
    """Named and unknown dims take any size, an unknown shape checks nothing; a fixed size must match."""

    class _Meta:
        def __init__(self, name: str, shape: list) -> None:
            self.name, self.shape = name, shape

    class _Session:
        def __init__(self, *shapes: list) -> None:
            self.metas = [_Meta(f"o{i}", s) for i, s in enumerate(shapes)]

        def get_outputs(self) -> list:
            return self.metas

    arr = np.zeros((4, 5, 8), np.float32)
    assert declared_shape_mismatches(_Session(["N", None, 8], [], [-1, 5, 8]), [arr, arr, arr]) == {}
    wrong = declared_shape_mismatches(_Session([4, 5, 9], ["N", "seqlen"]), [arr, arr])
    assert list(wrong) == ["o0", "o1"] and "as [4, 5, 9]" in wrong["o0"]


# ----------------------------------------------------------------------------- the timing loops


def test_verify_times_a_wrongly_declared_model_and_says_so_once(fixture):
    model = onnx.load(str(fixture[0]))
    notes: list[str] = []
    timings = time_sessions(
        {"fp32": model, "static": model}, _batch(), SessionConfig(intra_op_threads=1), runs=12, warmup=2, notes=notes
    )
    assert set(timings) == {"fp32", "static"}
    assert all(t.runs == 12 and t.p50_ms > 0 for t in timings.values())
    assert len(notes) == 1 and "'out' as [N, seqlen] but ONNX Runtime returns [4, 5, 8]" in notes[0]


def test_verify_keeps_reusing_outputs_when_the_declaration_is_right(tmp_path):
    from tests.models import small_cnn

    model = onnx.load(str(small_cnn(tmp_path / "m.onnx")))
    notes: list[str] = []
    feeds = {"input": np.zeros((2, 1, 8, 8), np.float32)}
    assert time_sessions({"m": model}, feeds, SessionConfig(intra_op_threads=1), runs=3, warmup=0, notes=notes)
    assert notes == []


def test_bench_harness_lets_ort_allocate_and_names_the_declaration(fixture):
    """Straight to ORT's outputs (a preallocated buffer of the real shape is refused), with the declaration
    named once across batch shapes and no vague "could not be bound" note."""
    session = make_session(str(fixture[0]), ["CPUExecutionProvider"], 1)
    harness = Harness(session, [_batch(4), _batch(4), _batch(3)])
    assert harness.mode == IOBINDING_ORT_OUTPUTS and harness.notes == []
    assert list(harness.declared) == ["out"] and "returns [4, 5, 8]" in harness.declared["out"]
    harness.warmup(1)
    full, tail = harness.time(2)
    assert len(full) == 4 and len(tail) == 2 and (full > 0).all()


# ----------------------------------------------------------------------------- the CLI, end to end


def _cli(capfd, args: list[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capfd.readouterr()
    return code, out, err


def test_every_command_runs_a_wrongly_declared_model(fixture, tmp_path, capfd):
    """analyze, propose, verify (timed) and bench exit as usual, without a traceback; verify and bench say
    once which output is declared wrongly; ORT's warning is not printed once per batch (ten batches)."""
    model, calib = fixture
    report, proposal = tmp_path / "a.json", tmp_path / "p.json"
    code, _, err = _cli(capfd, ["analyze", str(model), "--calib", str(calib), "--batch-size", "4", "-o", str(report)])
    assert code == 0 and "Traceback" not in err and WARNING not in err
    code, _, err = _cli(capfd, ["propose", str(report), "-o", str(proposal), "-q"])
    assert code == 0 and "Traceback" not in err
    verify_out = tmp_path / "v.json"
    args = ["verify", str(model), "--calib", str(calib), "--proposal", str(proposal), "--batch-size", "4"]
    code, out, err = _cli(capfd, [*args, "--runs", "3", "--target-sqnr", "20", "-o", str(verify_out), "-q"])
    assert code == 0 and "Traceback" not in err and WARNING not in err, err
    notes = json.loads(verify_out.read_text())["notes"]
    said = [n for n in notes if "declares output 'out' as [N, seqlen]" in n]
    assert len(said) == 1 and "returns [4, 5, 8]" in said[0] and out.count("declares output 'out'") == 1
    bench_out = tmp_path / "b.json"
    args = ["bench", str(model), "--calib", str(calib), "--variants", "fp32,static", "--batch-size", "4"]
    code, out, err = _cli(capfd, [*args, "--runs", "1", "--warmup", "1", "--no-dynamic-layers", "-o", str(bench_out)])
    assert code == 0 and "Traceback" not in err and WARNING not in err, err
    bench = json.loads(bench_out.read_text())
    said = [n for n in bench["notes"] if "declares output 'out' as [N, seqlen]" in n]
    assert len(said) == 1 and "returns [4, 5, 8]" in said[0] and out.count("declares output 'out'") == 1
    assert all(v["binding"] == IOBINDING_ORT_OUTPUTS and not v["error"] for v in bench["variants"])


def test_calibration_does_not_print_orts_warning_per_batch(fixture, tmp_path, capfd):
    """ORT's calibrator runs its own session once per batch; its log is quieted for every method."""
    model, calib = fixture
    for method in ("minmax", "entropy"):
        out = tmp_path / f"{method}.json"
        args = ["analyze", str(model), "--calib", str(calib), "--batch-size", "4", "--method", method]
        code, _, err = _cli(capfd, [*args, "--no-cache", "-o", str(out), "-q"])
        assert code == 0 and WARNING not in err, (method, err)
