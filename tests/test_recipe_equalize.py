"""BatchNormalization folding, cross-layer equalization, ReLU6 relaxation and the equivalence check, on small
real models built here (opset 13 unless an op needs more)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx import helper as h

from qdebug.errors import ExitCode, QDebugError
from qdebug.recipes.equalize import equalize, range_spread, relax_relu6
from qdebug.recipes.equivalence import check_equivalent, require_equivalent
from qdebug.recipes.fold import fold_batchnorm

BN = ("gamma", "beta", "mean", "var")
SPREAD = np.array([100, 1, 1, 1, 1, 1, 1, 1], np.float32)
"""Conv1's per-output-channel weight ranges: one channel 100x the others (a large BN gamma folded in)."""


def _model(nodes, inits, outputs, *, opset=13, channels_in=3, value_info=()) -> onnx.ModelProto:
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["N", channels_in, 8, 8])],
        [h.make_tensor_value_info(o, TensorProto.FLOAT, ["N", "C", "H", "W"]) for o in outputs],
        inits,
        value_info=list(value_info),
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _bn_params(rng: np.random.Generator, prefix: str, c: int) -> list[onnx.TensorProto]:
    return [
        numpy_helper.from_array(rng.uniform(0.8, 1.2, c).astype(np.float32), f"{prefix}_gamma"),
        numpy_helper.from_array((0.1 * rng.normal(size=c)).astype(np.float32), f"{prefix}_beta"),
        numpy_helper.from_array(rng.normal(size=c).astype(np.float32), f"{prefix}_mean"),
        numpy_helper.from_array(rng.uniform(0.5, 2.0, c).astype(np.float32), f"{prefix}_var"),
    ]


def _channels(w: np.ndarray, ranges: np.ndarray, axis: int) -> np.ndarray:
    """``w`` rescaled so that its channels along ``axis`` have max-abs ``ranges``."""
    moved = np.moveaxis(w, axis, 0)
    moved = moved / np.abs(moved).reshape(moved.shape[0], -1).max(axis=1).reshape((-1,) + (1,) * (w.ndim - 1))
    return np.moveaxis(moved * ranges.reshape((-1,) + (1,) * (w.ndim - 1)), 0, axis).astype(np.float32)


def bn_net(seed: int = 0) -> onnx.ModelProto:
    """conv1 -> bn1 -> relu1 -> conv2 -> bn2 -> y. conv1's channel 0 is 100x the others and conv2 reads it
    100x weaker, so every channel matters equally to y -- the pattern CLE exists for. conv2 has no bias (the
    fold adds one under a fresh name: ``w2_bias`` is taken by the Relu's output) and ``c1`` has a value_info
    (gone with the tensor after the fold)."""
    rng = np.random.default_rng(seed)
    w1 = _channels(rng.normal(size=(8, 3, 3, 3)), SPREAD, 0)
    w2 = _channels(rng.normal(size=(8, 8, 3, 3)), 0.3 / SPREAD, 1)
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "b1"),
        numpy_helper.from_array(w2, "w2"),
        *_bn_params(rng, "bn1", 8),
        *_bn_params(rng, "bn2", 8),
    ]
    nodes = [
        h.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c1", "bn1_gamma", "bn1_beta", "bn1_mean", "bn1_var"], ["n1"], name="bn1"),
        h.make_node("Relu", ["n1"], ["w2_bias"], name="relu1"),
        h.make_node("Conv", ["w2_bias", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c2", *(f"bn2_{p}" for p in BN)], ["y"], name="bn2", epsilon=1e-3),
    ]
    return _model(nodes, inits, ["y"], value_info=[h.make_tensor_value_info("c1", TensorProto.FLOAT, ["N", 8, 8, 8])])


def dw_block(seed: int = 1) -> onnx.ModelProto:
    """conv_a -> relu -> dw (depthwise) -> relu -> pw (1x1): a depthwise-separable block, two pairs sharing dw."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(_channels(rng.normal(size=(8, 3, 3, 3)), SPREAD, 0), "wa"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "ba"),
        numpy_helper.from_array(_channels(rng.normal(size=(8, 1, 3, 3)), SPREAD[::-1] / 10, 0), "wd"),
        numpy_helper.from_array(rng.normal(size=8).astype(np.float32), "bd"),
        numpy_helper.from_array((0.1 * rng.normal(size=(16, 8, 1, 1))).astype(np.float32), "wp"),
        numpy_helper.from_array(rng.normal(size=16).astype(np.float32), "bp"),
    ]
    nodes = [
        h.make_node("Conv", ["x", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        h.make_node("Relu", ["a"], ["ra"], name="relu_a"),
        h.make_node("Conv", ["ra", "wd", "bd"], ["d"], name="dw", pads=[1, 1, 1, 1], group=8),
        h.make_node("LeakyRelu", ["d"], ["rd"], name="relu_d", alpha=0.1),
        h.make_node("Conv", ["rd", "wp", "bp"], ["y"], name="pw"),
    ]
    return _model(nodes, inits, ["y"])


def conv_chain(acts: list[str], *, opset: int = 13, seed: int = 2) -> onnx.ModelProto:
    """len(acts) + 1 plain 3x3 Convs (8 channels, spread weights) with one activation op between each two."""
    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "x"
    for i in range(len(acts) + 1):
        inits.append(numpy_helper.from_array(_channels(rng.normal(size=(8, 8, 3, 3)), SPREAD, 0), f"w{i}"))
        nodes.append(h.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
        x = f"c{i}"
        if i < len(acts):
            nodes.append(h.make_node(acts[i], [x], [f"a{i}"], name=f"act{i}"))
            x = f"a{i}"
    nodes[-1].output[0] = "y"
    return _model(nodes, inits, ["y"], opset=opset, channels_in=8)


def two_readers(seed: int = 3) -> onnx.ModelProto:
    """conv1's output feeds bn1 and conv3 too; conv2 and conv4 share one weight: nothing may be rewritten."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(_channels(rng.normal(size=(8, 3, 3, 3)), SPREAD, 0), "w1"),
        numpy_helper.from_array(_channels(rng.normal(size=(8, 8, 1, 1)), SPREAD, 0), "w2"),
        numpy_helper.from_array(rng.normal(size=(8, 8, 1, 1)).astype(np.float32), "w3"),
        *_bn_params(rng, "bn1", 8),
        *_bn_params(rng, "bn2", 8),
    ]
    nodes = [
        h.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["c1", "bn1_gamma", "bn1_beta", "bn1_mean", "bn1_var"], ["n1"], name="bn1"),
        h.make_node("Relu", ["n1"], ["r1"], name="relu1"),
        h.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        h.make_node("BatchNormalization", ["c2", "bn2_gamma", "bn2_beta", "bn2_mean", "bn2_var"], ["y"], name="bn2"),
        h.make_node("Conv", ["c1", "w3"], ["c3"], name="conv3"),
        h.make_node("Conv", ["c3", "w2"], ["z"], name="conv4"),
    ]
    return _model(nodes, inits, ["y", "z"])


def relu6_net(opset: int, high: float = 6.0, seed: int = 4) -> onnx.ModelProto:
    """conv1 -> Clip(0, high) -> conv2: bounds as attributes before opset 11, else min from a Constant node
    and max from an initializer (both forms occur in exported models)."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(_channels(rng.normal(size=(8, 3, 3, 3)), SPREAD / 100, 0), "w1"),
        numpy_helper.from_array(_channels(rng.normal(size=(8, 8, 3, 3)), 1 / SPREAD, 1), "w2"),
    ]
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1])]
    if opset < 11:
        nodes.append(h.make_node("Clip", ["c1"], ["r1"], name="clip", min=0.0, max=high))
    else:
        inits.append(numpy_helper.from_array(np.array(high, np.float32), "six"))
        zero = h.make_tensor("zero_t", TensorProto.FLOAT, [], [0.0])
        nodes.append(h.make_node("Constant", [], ["zero"], name="zero_const", value=zero))
        nodes.append(h.make_node("Clip", ["c1", "zero", "six"], ["r1"], name="clip"))
    nodes.append(h.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]))
    return _model(nodes, inits, ["y"], opset=opset)


def _data(channels: int = 3, n: int = 4, seed: int = 10, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (scale * rng.normal(size=(2, channels, 8, 8))).astype(np.float32)} for _ in range(n)]


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _assert_same_outputs(a: onnx.ModelProto, b: onnx.ModelProto, batches: list[dict[str, np.ndarray]]) -> None:
    same = check_equivalent(a, b, batches, rtol=1e-4)
    assert same.ok, same.describe()
    assert same.outputs_compared == len(a.graph.output)


def test_fold_removes_bn_keeps_names_and_outputs():
    model = bn_net()
    before = model.SerializeToString()
    t = fold_batchnorm(model)
    assert model.SerializeToString() == before  # the input model is untouched
    onnx.checker.check_model(t.model, full_check=True)
    assert t.removed == ("bn1", "bn2") and t.changed == ("conv1", "conv2")
    assert [n.name for n in t.model.graph.node] == ["conv1", "relu1", "conv2"]
    assert [n.op_type for n in t.model.graph.node] == ["Conv", "Relu", "Conv"]
    # the Convs take the BNs' output names, so downstream is unchanged
    assert list(t.model.graph.node[0].output) == ["n1"] and list(t.model.graph.node[2].output) == ["y"]
    # conv2 had no bias: the new one has a fresh name ("w2_bias" is the Relu's output)
    assert t.model.graph.node[2].input[2] == "w2_bias_1"
    assert sorted(i.name for i in t.model.graph.initializer) == ["b1", "w1", "w2", "w2_bias_1"]
    assert not [v for v in t.model.graph.value_info if v.name == "c1"]
    assert len(t.notes) == 1 and "'bn1', 'bn2'" in t.notes[0]
    _assert_same_outputs(model, t.model, _data())
    assert fold_batchnorm(model).model.SerializeToString() == t.model.SerializeToString()  # deterministic


def test_fold_by_hand():
    """W' = W * gamma / sqrt(var + eps), b' = (b - mean) * gamma / sqrt(var + eps) + beta, eps from the node."""
    model = bn_net()
    arrays = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    folded = {t.name: numpy_helper.to_array(t) for t in fold_batchnorm(model).model.graph.initializer}
    k = arrays["bn2_gamma"] / np.sqrt(arrays["bn2_var"] + 1e-3)
    np.testing.assert_allclose(folded["w2"], arrays["w2"] * k.reshape(-1, 1, 1, 1), rtol=1e-6)
    np.testing.assert_allclose(folded["w2_bias_1"], -arrays["bn2_mean"] * k + arrays["bn2_beta"], rtol=1e-6)
    k = arrays["bn1_gamma"] / np.sqrt(arrays["bn1_var"] + 1e-5)
    np.testing.assert_allclose(folded["b1"], (arrays["b1"] - arrays["bn1_mean"]) * k + arrays["bn1_beta"], rtol=1e-6)


def conv_bn(opset: int, attrs: dict, *, op: str = "Conv", group: int = 1, seed: int = 5) -> onnx.ModelProto:
    """conv (or convT) -> bn -> bn2 -> y at ``opset``, BN attributes as that opset's exporters write them; two
    BNs in a row (both fold into the Conv)."""
    rng = np.random.default_rng(seed)
    shape = (8, 3, 3, 3) if op == "Conv" else (4, 8 // group, 3, 3)
    inits = [
        numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), "w"),
        *_bn_params(rng, "bn", 8),
        *_bn_params(rng, "bn2", 8),
    ]
    nodes = [
        h.make_node(op, ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1], group=group),
        h.make_node("BatchNormalization", ["c", "bn_gamma", "bn_beta", "bn_mean", "bn_var"], ["n"], name="bn", **attrs),
        h.make_node("BatchNormalization", ["n", "bn2_gamma", "bn2_beta", "bn2_mean", "bn2_var"], ["y"], name="bn2"),
    ]
    return _model(nodes, inits, ["y"], opset=opset, channels_in=3 if op == "Conv" else 4)


@pytest.mark.parametrize(
    ("opset", "bn_attrs"),
    [(9, {"momentum": 0.99, "epsilon": 1e-3}), (15, {"training_mode": 0, "momentum": 0.9}), (21, {})],
)
def test_fold_exported_batchnorm_opsets(opset, bn_attrs):
    """BatchNormalization 9 (momentum, no training_mode), 15 (training_mode=0) and 21 all fold; the outputs are
    checked here with ORT directly, not only through check_equivalent."""
    model = conv_bn(opset, bn_attrs)
    t = fold_batchnorm(model)
    assert t.removed == ("bn", "bn2") and t.changed == ("conv",)
    assert [(n.name, n.op_type, list(n.output)) for n in t.model.graph.node] == [("conv", "Conv", ["y"])]
    onnx.checker.check_model(t.model, full_check=True)
    for feeds in _data(n=2):
        want, got = _run(model, feeds)[0], _run(t.model, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("group", [1, 2])
def test_fold_into_conv_transpose(group):
    """A ConvTranspose's output channels sit on its weight's axis 1 (per group): folded there, outputs kept."""
    model = conv_bn(13, {}, op="ConvTranspose", group=group)
    t = fold_batchnorm(model)
    assert t.removed == ("bn", "bn2") and t.changed == ("conv",)
    _assert_same_outputs(model, t.model, _data(channels=4, n=2))


def test_equalize_bn_net_spread_and_outputs():
    """After folding, conv1's spread (max/median of its channels' ranges) is ~100 times the BN's gamma/sigma
    spread. conv2 reads channel 0 100x weaker, so CLE's s_i = sqrt(r1_i / r2_i) makes every channel's range
    sqrt(r1_i * r2_i) -- equal up to the BN factors and the random weights: the spread falls from 168 to 1.3
    (measured), so >= 50 before, < 3 after and a factor over 20 leave room for other seeds."""
    model = fold_batchnorm(bn_net()).model
    before = model.SerializeToString()
    t = equalize(model)
    assert model.SerializeToString() == before
    assert t.changed == ("conv1", "conv2") and t.removed == ()
    assert t.notes[0].startswith("cross-layer equalization rescaled 1 Conv pair(s) ('conv1'->'conv2')")
    spread_before, spread_after = range_spread(model)["conv1"], range_spread(t.model)["conv1"]
    assert spread_before >= 50 and spread_after < 3, (spread_before, spread_after)
    assert spread_before / spread_after > 20
    _assert_same_outputs(bn_net(), t.model, _data())
    assert [n.name for n in t.model.graph.node] == [n.name for n in model.graph.node]
    assert equalize(model).model.SerializeToString() == t.model.SerializeToString()  # deterministic


def test_equalize_depthwise_separable_chain():
    """Both pairs (plain -> depthwise, depthwise -> plain, through Relu and LeakyRelu) are equalized; the
    passes converge, so equalizing again finds nothing to move."""
    model = dw_block()
    t = equalize(model)
    assert t.changed == ("conv_a", "dw", "pw")
    assert "2 Conv pair(s)" in t.notes[0]
    _assert_same_outputs(model, t.model, _data())
    spread_before, spread_after = range_spread(model), range_spread(t.model)
    assert spread_after["conv_a"] < spread_before["conv_a"] / 10
    assert spread_after["dw"] < spread_before["dw"] / 5
    again = equalize(t.model)
    assert not again.touched


def test_equalize_skips_non_commuting_activation_with_a_note():
    model = conv_chain(["HardSwish"], opset=14)
    t = equalize(model)
    assert not t.touched and t.model.SerializeToString() == model.SerializeToString()
    assert t.notes == (
        "cross-layer equalization left 1 Conv pair(s) alone because the activation between them does not commute "
        "with per-channel scaling: 'conv0'->'conv1' (HardSwish)",
    )


def test_equalize_note_names_five_pairs_then_counts():
    t = equalize(conv_chain(["Sigmoid"] * 7))
    assert not t.touched and len(t.notes) == 1
    assert t.notes[0].endswith("'conv4'->'conv5' (Sigmoid), and 2 more")


def test_shared_tensors_are_neither_folded_nor_equalized():
    model = two_readers()
    f = fold_batchnorm(model)
    assert not f.touched
    assert f.notes == (
        "BatchNormalization 'bn1' left in place: the Conv's output is also read elsewhere",
        "BatchNormalization 'bn2' left in place: the Conv's weight or bias is not a float constant read by that "
        "Conv only",
    )
    assert not equalize(model).touched


def test_relax_relu6_opset13_then_equalize():
    model = relu6_net(13)
    before = model.SerializeToString()
    t = relax_relu6(model)
    assert model.SerializeToString() == before
    assert t.changed == ("clip",) and t.removed == ("zero_const",)
    assert [(n.name, n.op_type) for n in t.model.graph.node] == [("conv1", "Conv"), ("clip", "Relu"), ("conv2", "Conv")]
    assert [i.name for i in t.model.graph.initializer] == ["w1", "w2"]
    onnx.checker.check_model(t.model, full_check=True)
    small = _data(scale=0.5)  # conv1's outputs stay well under 6 here: the Relu computes what the Clip did
    assert max(float(np.abs(_run(model, b)[0]).max()) for b in small) > 0
    same = require_equivalent(model, t.model, small, recipe="equalize")
    assert same.ok
    eq = equalize(t.model)
    assert eq.changed == ("conv1", "conv2")
    require_equivalent(model, eq.model, small, recipe="equalize", rtol=1e-4)


def test_relax_relu6_opset10_attributes():
    model = relu6_net(10)
    t = relax_relu6(model)
    assert t.changed == ("clip",) and t.removed == ()
    node = t.model.graph.node[1]
    assert node.op_type == "Relu" and not node.attribute and list(node.input) == ["c1"]
    assert not relax_relu6(relu6_net(10, high=4.0)).touched
    assert not relax_relu6(relu6_net(13, high=4.0)).touched


def test_require_equivalent_refuses_relaxed_relu6_beyond_6():
    model = relu6_net(13)
    relaxed = relax_relu6(model).model
    big = _data(scale=300.0)
    with pytest.raises(QDebugError) as err:
        require_equivalent(model, relaxed, big, recipe="equalize")
    assert err.value.code == ExitCode.MODEL
    assert "recipe equalize" in err.value.message and "output 'y' differs by" in err.value.message
    same = check_equivalent(model, relaxed, big)
    assert not same.ok and same.worst_output == "y" and same.max_abs > 0


def test_check_equivalent_identity_and_no_data():
    model = bn_net()
    same = check_equivalent(model, model, _data(n=2))
    assert same.max_abs == 0 and same.max_rel == 0 and same.ok and same.outputs_compared == 1
    assert same.describe() == "outputs match the FP32 model's within 0 % of their range"
    with pytest.raises(QDebugError) as err:
        check_equivalent(model, model, [])
    assert err.value.code == ExitCode.DATA


def test_check_equivalent_counts_a_lost_output_as_a_difference():
    model = two_readers()
    lost = onnx.ModelProto()
    lost.CopyFrom(model)
    del lost.graph.output[1]
    same = check_equivalent(model, lost, _data(n=1))
    assert not same.ok and same.worst_output == "z" and same.max_rel == float("inf")
    assert same.describe().startswith("output 'z' differs from the FP32 model's (missing")


def test_equalize_needs_one_pass():
    with pytest.raises(ValueError, match="iterations"):
        equalize(bn_net(), iterations=0)


def _sqnr_db(reference: np.ndarray, other: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference.astype(np.float64) ** 2) / np.sum((reference - other) ** 2)))


def test_fold_and_equalize_raise_static_int8_per_tensor_sqnr(tmp_path):
    """Static INT8 QDQ, per-tensor, MinMax on 16 random samples: bn_net's output SQNR rises from 6.6 to
    38.2 dB after fold + equalize (+31.6 dB, ORT 1.32 on an AVX-512 VNNI CPU). Before, per-tensor gives
    conv1's seven small channels (and their activations) 1/100 of the int8 grid -- about one level -- while
    conv2 weighs them as much as the large one; after, every channel spans the grid.

    The quantized models are run twice. With ORT's default optimizations they run its integer kernels
    (QLinearConv), which differ between CPUs: AVX2 sums pairs of u8*s8 products in saturating int16
    (vpmaddubsw), VNNI in int32 (vpdpbusd). Saturation needs two neighbouring products both near 255*127, so
    it touches few outputs and moves an SQNR by a few dB at most -- hence a 15 dB bar for a 31 dB gain, which
    a half-working equalization (one channel, the wrong axis) would not clear. With optimizations off the
    same QDQ model runs DequantizeLinear -> float Conv, no integer kernel at all: that gain is the same on
    every CPU, and must clear the bar too."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
            self.feeds = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.feeds, None)

    rng = np.random.default_rng(20)
    calib = [{"x": rng.normal(size=(1, 3, 8, 8)).astype(np.float32)} for _ in range(16)]
    evaluate = {"x": rng.normal(size=(16, 3, 8, 8)).astype(np.float32)}
    original = bn_net()
    reference = _run(original, evaluate)[0]
    levels = {"integer": ort.GraphOptimizationLevel.ORT_ENABLE_ALL, "float": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
    sqnr: dict[tuple[str, str], float] = {}
    for name, model in (("plain", original), ("cle", equalize(fold_batchnorm(original).model).model)):
        src, dst = tmp_path / f"{name}.onnx", tmp_path / f"{name}.qdq.onnx"
        onnx.save(model, src)  # a path, not the proto: quantize_static rewrites a proto it is given
        quantize_static(src, dst, Reader(calib), quant_format=QuantFormat.QDQ, per_channel=False)
        for kernels, level in levels.items():
            options = ort.SessionOptions()
            options.graph_optimization_level = level
            session = ort.InferenceSession(str(dst), options, providers=["CPUExecutionProvider"])
            sqnr[name, kernels] = _sqnr_db(reference, session.run(None, evaluate)[0])
    for kernels in levels:
        assert sqnr["cle", kernels] - sqnr["plain", kernels] > 15, sqnr
