"""Generated streaming models (issue 16 item 5): a voice-activity model whose state has its batch on axis 1.

``streaming_vad`` is a tiny stand-in for a streaming VAD export: ``input [batch, 64]`` (one chunk of
audio features), ``state [2, batch, 16]`` (two layers of carried state, the ONNX RNN layout: batch on
axis 1) and a scalar ``sr`` (int64, the sample rate, cast and used as a gain), giving ``prob [batch, 1]``
and the new state ``stateN [2, batch, 16]``. ``streaming_vad_if`` is the same family's other export: the
whole network inside the branches of an ``If`` whose condition is a constant (ORT quantizes nothing inside
a subgraph until ``--inline-constant-if`` inlines the taken branch); ``streaming_vad_rate_if`` the export
that switches on the ``sr`` input itself, ``If(Equal(sr, 16000))`` (issue 35 item 4).

``stream_data`` writes a folder of .npz files, each one chunk and the state the model carried into it,
exactly as the model is run (the state comes from running the FP32 model chunk after chunk), with
``streams`` parallel streams per file (batch 1 or 4). Seeded, a few kilobytes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FEATURES = 64
HIDDEN = 16
SAMPLE_RATE = 16000


def _weights(rng: np.random.Generator, prefix: str) -> dict[str, np.ndarray]:
    def f32(*shape: int, scale: float = 0.3) -> np.ndarray:
        return rng.normal(0, scale, shape).astype(np.float32)

    return {
        f"{prefix}W1": f32(FEATURES, HIDDEN, scale=0.2),
        f"{prefix}b1": f32(HIDDEN, scale=0.1),
        f"{prefix}Wa": f32(HIDDEN, HIDDEN),
        f"{prefix}Ua": f32(HIDDEN, HIDDEN),
        f"{prefix}Wb": f32(HIDDEN, HIDDEN),
        f"{prefix}Ub": f32(HIDDEN, HIDDEN),
        f"{prefix}Wo": f32(HIDDEN, 1, scale=0.5),
        f"{prefix}bo": f32(1, scale=0.1),
    }


def _network(p: str, prob: str, state_out: str) -> list[onnx.NodeProto]:
    """The nodes of one network reading ``input``, ``state`` and ``sr``: a Gemm front end, two tanh cells
    that mix each state layer with the layer below, and a sigmoid head scaled by the sample rate."""
    node = helper.make_node
    return [
        node("Gemm", ["input", f"{p}W1", f"{p}b1"], [f"{p}h"], name=f"{p}front"),
        node("Relu", [f"{p}h"], [f"{p}hr"], name=f"{p}front_relu"),
        node("Gather", ["state", f"{p}zero"], [f"{p}s0"], name=f"{p}layer0_state", axis=0),
        node("Gather", ["state", f"{p}one"], [f"{p}s1"], name=f"{p}layer1_state", axis=0),
        node("MatMul", [f"{p}hr", f"{p}Wa"], [f"{p}xa"], name=f"{p}cell0_in"),
        node("MatMul", [f"{p}s0", f"{p}Ua"], [f"{p}ua"], name=f"{p}cell0_rec"),
        node("Add", [f"{p}xa", f"{p}ua"], [f"{p}pa"], name=f"{p}cell0_add"),
        node("Tanh", [f"{p}pa"], [f"{p}n0"], name=f"{p}cell0"),
        node("MatMul", [f"{p}n0", f"{p}Wb"], [f"{p}xb"], name=f"{p}cell1_in"),
        node("MatMul", [f"{p}s1", f"{p}Ub"], [f"{p}ub"], name=f"{p}cell1_rec"),
        node("Add", [f"{p}xb", f"{p}ub"], [f"{p}pb"], name=f"{p}cell1_add"),
        node("Tanh", [f"{p}pb"], [f"{p}n1"], name=f"{p}cell1"),
        node("Unsqueeze", [f"{p}n0", f"{p}axes0"], [f"{p}u0"], name=f"{p}stack0"),
        node("Unsqueeze", [f"{p}n1", f"{p}axes0"], [f"{p}u1"], name=f"{p}stack1"),
        node("Concat", [f"{p}u0", f"{p}u1"], [state_out], name=f"{p}new_state", axis=0),
        node("MatMul", [f"{p}n1", f"{p}Wo"], [f"{p}lo"], name=f"{p}head"),
        node("Add", [f"{p}lo", f"{p}bo"], [f"{p}logit"], name=f"{p}head_bias"),
        node("Cast", ["sr"], [f"{p}srf"], name=f"{p}sr_cast", to=TensorProto.FLOAT),
        node("Div", [f"{p}srf", f"{p}rate"], [f"{p}gain"], name=f"{p}sr_gain"),
        node("Mul", [f"{p}logit", f"{p}gain"], [f"{p}scaled"], name=f"{p}head_gain"),
        node("Sigmoid", [f"{p}scaled"], [prob], name=f"{p}prob"),
    ]


def _constants(p: str) -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array(np.array(0, np.int64), f"{p}zero"),
        numpy_helper.from_array(np.array(1, np.int64), f"{p}one"),
        numpy_helper.from_array(np.array([0], np.int64), f"{p}axes0"),
        numpy_helper.from_array(np.array(SAMPLE_RATE, np.float32), f"{p}rate"),
    ]


def _io(
    batch: str | int | None = "batch", state_batch: bool = True
) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    state = [2, batch, HIDDEN] if state_batch else [2, HIDDEN]
    inputs = [
        helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, FEATURES]),
        helper.make_tensor_value_info("state", TensorProto.FLOAT, state),
        helper.make_tensor_value_info("sr", TensorProto.INT64, []),
    ]
    outputs = [
        helper.make_tensor_value_info("prob", TensorProto.FLOAT, [batch, 1]),
        helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, batch, HIDDEN]),
    ]
    return inputs, outputs


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def streaming_vad(
    path: Path, seed: int = 0, batch: str | int | None = "batch", *, state_batch: bool = True
) -> Path:
    """The plain streaming model. ``batch``: the batch dimension's name, a fixed size, or None for an
    unnamed dynamic dimension (as some exporters write it); ``state_batch=False``: a state ``[2, 16]``
    shared by the whole batch, so no axis is common to the inputs."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(a, n) for n, a in _weights(rng, "").items()] + _constants("")
    inputs, outputs = _io(batch, state_batch)
    graph = helper.make_graph(_network("", "prob", "stateN"), "streaming_vad", inputs, outputs, inits)
    return _save(graph, path)


def streaming_vad_if(path: Path, seed: int = 0) -> Path:
    """The same network (same weights) inside the ``then`` branch of an ``If`` on a constant ``true``; the
    ``else`` branch is a second network (an 8 kHz model's stand-in) that is never taken."""
    cond = numpy_helper.from_array(np.array(True), "is_16k")
    return _if_model(path, seed, [], [cond], "streaming_vad_if")


def streaming_vad_rate_if(path: Path, seed: int = 0) -> Path:
    """As :func:`streaming_vad_if`, but the condition is computed from the input: ``If(Equal(sr, 16000))``
    (16000 a ``Constant`` node, as exporters write it), so the ``else`` network runs for any other rate."""
    rate = helper.make_tensor("rate_16k_value", TensorProto.INT64, [], [SAMPLE_RATE])
    nodes = [
        helper.make_node("Constant", [], ["rate_16k"], name="rate_16k", value=rate),
        helper.make_node("Equal", ["sr", "rate_16k"], ["is_16k"], name="is_16k"),
    ]
    return _if_model(path, seed, nodes, [], "streaming_vad_rate_if")


def _if_model(
    path: Path, seed: int, cond_nodes: list[onnx.NodeProto], cond_inits: list[onnx.TensorProto], name: str
) -> Path:
    """The network in both branches of ``If 'rate_switch'`` on ``is_16k``, which ``cond_nodes`` and
    ``cond_inits`` make."""
    rng = np.random.default_rng(seed)
    taken = _weights(rng, "")
    other = _weights(np.random.default_rng(seed + 100), "e_")
    inputs, outputs = _io()

    def branch(p: str, weights: dict[str, np.ndarray]) -> onnx.GraphProto:
        outs = [
            helper.make_tensor_value_info(f"{p}prob_out", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info(f"{p}state_out", TensorProto.FLOAT, [2, "batch", HIDDEN]),
        ]
        inits = [numpy_helper.from_array(a, n) for n, a in weights.items()] + _constants(p)
        return helper.make_graph(_network(p, f"{p}prob_out", f"{p}state_out"), f"{p}branch", [], outs, inits)

    node = helper.make_node(
        "If",
        ["is_16k"],
        ["prob", "stateN"],
        name="rate_switch",
        then_branch=branch("", taken),
        else_branch=branch("e_", other),
    )
    graph = helper.make_graph([*cond_nodes, node], name, inputs, outputs, cond_inits)
    return _save(graph, path)


def stream_data(
    model: Path, folder: Path, *, files: int = 12, streams: int = 1, seed: int = 1, state_batch: bool = True
) -> Path:
    """A folder of .npz files, one chunk per file: ``input [streams, 64]``, the ``state [2, streams, 16]``
    the model carried into that chunk (the FP32 model run chunk after chunk from a zero state) and
    ``sr``. ``state_batch=False``: a state ``[2, 16]`` (the first stream's) for a model that shares one."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    folder.mkdir(parents=True, exist_ok=True)
    state = np.zeros((2, streams, HIDDEN), np.float32)
    sr = np.array(SAMPLE_RATE, np.int64)
    t = np.arange(FEATURES, dtype=np.float32)
    for i in range(files):
        speech = np.sin(0.3 * t * (1 + i % 3))[None, :] * rng.uniform(0.2, 2.0, (streams, 1))
        chunk = (speech + rng.normal(0, 0.3, (streams, FEATURES))).astype(np.float32)
        fed = state if state_batch else state[:, 0]
        np.savez(folder / f"chunk_{i:03d}.npz", input=chunk, state=fed, sr=sr)
        _, state = session.run(None, {"input": chunk, "state": fed, "sr": sr})
    return folder
