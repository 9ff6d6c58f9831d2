"""Contracts of fast_quantize's vectorized per-channel branch: on a real ORT QDQQuantizer over a tiny
model, ``calc_initializer_quant_params`` (qdebug's) must return exactly what ORT's own
``QDQQuantizer._calc_initializer_quant_params`` returns on the same quantizer -- same entries, same order,
same bits -- for every branch condition ORT's loop has: tensor overrides (scale/zero point, quant type,
axis, symmetric, per-channel rmin/rmax), block-wise weights, 4-bit types, NaN, float16, an activation-typed
initializer quantized per channel, a minimum real range and an empty weight. Scenarios the vector pass
takes are also checked to really take it."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quant_utils
from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData
from onnxruntime.quantization.qdq_quantizer import QDQQuantizer
from onnxruntime.quantization.registry import CreateQDQQuantizer

from qdebug.quant import fast_quantize
from tests.verified_ort import verified_sources

pytestmark = verified_sources  # ORT's own code, as verified: skipped on other releases


def _model(w: np.ndarray, elem: int = TensorProto.FLOAT, c: np.ndarray | None = None):
    inits = [numpy_helper.from_array(w, "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    out = "y"
    if c is not None:
        inits.append(numpy_helper.from_array(c, "c"))
        nodes.append(helper.make_node("Add", ["y", "c"], ["z"], name="add"))
        out = "z"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", elem, [2, w.shape[0]])],
        [helper.make_tensor_value_info(out, elem, [2, w.shape[1]])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _both(model, per_channel=True, weight=QuantType.QInt8, extra=None):
    """(qdebug's, ORT's) initializer parameters on one quantizer that went through ORT's node quantizers;
    an exception's type and message in place of a result."""
    ranges = {n: TensorData(lowest=np.float32(-1), highest=np.float32(1)) for n in ("x", "y", "z")}
    quantizer = fast_quantize.indexed(QDQQuantizer)(
        model, per_channel, False, weight, QuantType.QUInt8, TensorsData(CalibrationMethod.MinMax, ranges),
        [], [], ["MatMul", "Add"], extra or {},
    )  # fmt: skip
    for node in quantizer.model.nodes():
        if quantizer.should_quantize_node(node):
            CreateQDQQuantizer(quantizer, node).quantize()

    def result(call):
        try:
            return _flat(call())
        except Exception as e:  # noqa: BLE001 -- ORT's error is part of its behaviour
            return f"{type(e).__name__}: {e}"

    ours = result(quantizer._calc_initializer_quant_params)
    theirs = result(lambda: QDQQuantizer._calc_initializer_quant_params(quantizer))
    return ours, theirs


def _flat(params) -> list:
    """Every entry, in order, each field's value (arrays by dtype, shape and bytes)."""
    return [
        (
            name,
            [(k, (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v) for k, v in p.data.items()],
        )
        for name, p in params.items()
    ]


_W = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
_TINY_F16 = (_W * np.array([1.0, 1e-3, 1.0, 2e-4], dtype=np.float32)).astype(np.float16)  # subnormal fp16 scales
_NAN = np.where(np.arange(24).reshape(6, 4) == 5, np.nan, _W).astype(np.float32)
_OV = "TensorQuantOverrides"

# name: (model, per_channel, weight type, extra options, vectorized?)
SCENARIOS = {
    "plain per-channel": (_model(_W), True, QuantType.QInt8, {}, True),
    "large minimum real range": (_model(_W), True, QuantType.QInt8, {"MinimumRealRange": 50.0}, True),
    "override symmetric off": (
        _model(_W),
        True,
        QuantType.QInt8,
        {_OV: {"w": [{"axis": 1, "symmetric": False}]}},
        True,
    ),
    "override quant type 16-bit": (
        _model(_W),
        True,
        QuantType.QInt8,
        {_OV: {"w": [{"axis": 1, "quant_type": QuantType.QInt16}]}},
        True,
    ),
    "override reduce range": (
        _model(_W),
        True,
        QuantType.QInt8,
        {_OV: {"w": [{"axis": 1, "reduce_range": True}]}},
        True,
    ),
    "override axis 0": (_model(_W), True, QuantType.QInt8, {_OV: {"w": [{"axis": 0}]}}, True),
    "override axis 0, per-channel off": (_model(_W), False, QuantType.QInt8, {_OV: {"w": [{"axis": 0}]}}, True),
    "override axis -1": (_model(_W), True, QuantType.QInt8, {_OV: {"w": [{"axis": -1}]}}, True),
    "activation-typed initializer per channel": (
        _model(_W, c=np.linspace(-2, 3, 4, dtype=np.float32)),
        True,
        QuantType.QInt8,
        {_OV: {"c": [{"axis": 0}]}},
        True,
    ),
    # ORT's order of entries: a vectorized weight, then a per-tensor initializer from ORT's loop
    "per-channel weight then a per-tensor initializer": (
        _model(_W, c=np.linspace(-2, 3, 4, dtype=np.float32)),
        True,
        QuantType.QInt8,
        {},
        True,
    ),
    "override rmin/rmax": (
        _model(_W),
        True,
        QuantType.QInt8,
        {_OV: {"w": [{"axis": 1, "rmin": np.float32(-5), "rmax": np.float32(5)}]}},
        False,
    ),
    "override scale and zero point": (
        _model(_W),
        True,
        QuantType.QInt8,
        {_OV: {"w": [{"axis": 1, "scale": np.float32(0.1), "zero_point": np.int8(0)}]}},
        False,
    ),
    "block-wise": (_model(_W), True, QuantType.QInt8, {"BlockSize": 2}, False),
    "4-bit weights": (_model(_W), True, QuantType.QInt4, {}, False),
    "NaN in a channel": (_model(_NAN), True, QuantType.QInt8, {}, False),
    "float16 weights with subnormal scales": (_model(_TINY_F16, TensorProto.FLOAT16), True, QuantType.QInt8, {}, False),
    "empty weight": (_model(np.zeros((0, 4), np.float32)), True, QuantType.QInt8, {}, False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_initializer_params_are_orts_for_every_branch(scenario, monkeypatch):
    model, per_channel, weight, extra, vectorized = SCENARIOS[scenario]
    calls = []
    real = fast_quantize.channel_quant_params

    def counted(*args, **kwargs):
        calls.append(args[1:])
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_quantize, "channel_quant_params", counted)
    with np.errstate(all="ignore"):
        ours, theirs = _both(model, per_channel, weight, extra)
    assert ours == theirs, scenario  # entries, their order and their bits
    assert bool(calls) == vectorized, (scenario, calls)


_C = np.linspace(-2, 3, 4, dtype=np.float32)
_POSITIVE = np.abs(_W) + 0.5

# per-tensor initializers (session 16's bulk pass): name: (model, weight type, extra options, groups in bulk)
TENSOR_SCENARIOS = {
    "int8 weight": (_model(_W), QuantType.QInt8, {}, 1),
    "uint8 weight (asymmetric)": (_model(_W), QuantType.QUInt8, {}, 1),
    "all-positive uint8 weight": (_model(_POSITIVE), QuantType.QUInt8, {}, 1),
    "all-zero weight (tiny scale)": (_model(np.zeros((6, 4), np.float32)), QuantType.QInt8, {}, 1),
    "a weight and an activation-typed initializer": (_model(_W, c=_C), QuantType.QInt8, {}, 2),
    "activations symmetric": (_model(_W, c=_C), QuantType.QInt8, {"ActivationSymmetric": True}, 2),
    "weights asymmetric": (_model(_W, c=_C), QuantType.QInt8, {"WeightSymmetric": False}, 2),
    "minimum real range": (_model(_W, c=_C), QuantType.QInt8, {"MinimumRealRange": 50.0}, 2),
    "override 16-bit": (_model(_W), QuantType.QInt8, {_OV: {"w": [{"quant_type": QuantType.QInt16}]}}, 1),
    "override symmetric off": (_model(_W), QuantType.QInt8, {_OV: {"w": [{"symmetric": False}]}}, 1),
    "override reduce range": (_model(_W, c=_C), QuantType.QInt8, {_OV: {"w": [{"reduce_range": True}]}}, 2),
    "override rmin/rmax": (
        _model(_W),
        QuantType.QInt8,
        {_OV: {"w": [{"rmin": np.float32(-5), "rmax": np.float32(5)}]}},
        0,
    ),
    "override scale and zero point": (
        _model(_W),
        QuantType.QInt8,
        {_OV: {"w": [{"scale": np.float32(0.1), "zero_point": np.int8(0)}]}},
        0,
    ),
    "4-bit weight": (_model(_W), QuantType.QInt4, {}, 0),
    "NaN in the weight": (_model(_NAN), QuantType.QInt8, {}, 0),
    "float16 weight": (_model(_TINY_F16, TensorProto.FLOAT16), QuantType.QInt8, {}, 0),
    "empty weight": (_model(np.zeros((0, 4), np.float32)), QuantType.QInt8, {}, 0),
}


@pytest.mark.parametrize("scenario", list(TENSOR_SCENARIOS))
def test_per_tensor_initializer_params_are_orts_for_every_branch(scenario, monkeypatch):
    """Per-tensor initializers (per_channel off): qdebug's bulk pass returns ORT's entries, order and bits,
    and takes exactly the groups (type, symmetry, reduce_range) it should; the rest stays ORT's loop."""
    model, weight, extra, groups = TENSOR_SCENARIOS[scenario]
    calls = []
    real = fast_quantize.range_quant_params

    def counted(*args, **kwargs):
        if sys._getframe(2).f_code.co_name == "calc_initializer_quant_params":  # not the activations' pass
            calls.append(args[2:5])
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_quantize, "range_quant_params", counted)
    with np.errstate(all="ignore"):
        ours, theirs = _both(model, False, weight, extra)
    assert ours == theirs, scenario
    assert len(calls) == groups, (scenario, calls)


def test_a_scale_of_exactly_float32_tiny_is_kept_as_ort_keeps_it():
    """ORT replaces a scale *below* float32's smallest normal by 1 (zero point 0); one exactly equal to it
    is kept. Channels whose range makes the scale exactly 2**-126 for int8 symmetric (absmax 127 * 2**-126)
    and for uint8 asymmetric (an all-positive channel of max 255 * 2**-126)."""
    tiny = np.finfo(np.float32).tiny
    data = np.array([[127 * tiny, -3 * tiny], [255 * tiny, 0.0], [1.0, -1.0], [126 * tiny, 0.0]], dtype=np.float32)
    for quant_type, symmetric in ((TensorProto.INT8, True), (TensorProto.UINT8, False), (TensorProto.UINT8, True)):
        ours = fast_quantize.channel_quant_params(data, 0, quant_type, symmetric, False, None)
        theirs = [
            quant_utils.compute_data_quant_params(row, quant_type, symmetric, reduce_range=False, min_real_range=None)
            for row in data
        ]
        zps, scales = np.asarray([t[0] for t in theirs]), np.asarray([t[1] for t in theirs])
        assert ours[0].tobytes() == zps.tobytes() and ours[0].dtype == zps.dtype, (quant_type, symmetric)
        assert ours[1].tobytes() == scales.tobytes() and ours[1].dtype == scales.dtype, (quant_type, symmetric)
    # the boundary is really hit: int8 symmetric keeps channel 0's scale at tiny, not 1
    assert fast_quantize.channel_quant_params(data, 0, TensorProto.INT8, True, False, None)[1][0] == tiny


def test_ort_sees_its_own_tensors_to_quantize_after_the_vector_pass():
    """The vectorized entries are taken out of ``tensors_to_quantize`` only while ORT's loop runs."""
    model = _model(_W, c=np.linspace(-2, 3, 4, dtype=np.float32))
    ranges = {n: TensorData(lowest=np.float32(-1), highest=np.float32(1)) for n in ("x", "y", "z")}
    quantizer = fast_quantize.indexed(QDQQuantizer)(
        model, True, False, QuantType.QInt8, QuantType.QUInt8, TensorsData(CalibrationMethod.MinMax, ranges),
        [], [], ["MatMul", "Add"], {},
    )  # fmt: skip
    for node in quantizer.model.nodes():
        if quantizer.should_quantize_node(node):
            CreateQDQQuantizer(quantizer, node).quantize()
    before = dict(quantizer.tensors_to_quantize)
    params = quantizer._calc_initializer_quant_params()
    assert "w" in params and quantizer.tensors_to_quantize == before
    assert list(quantizer.tensors_to_quantize) == list(before)


def test_the_vector_pass_relies_on_hash_guarded_ort_sources(monkeypatch):
    """The ORT functions whose steps the vector pass repeats are guarded: each is in VERIFIED_SOURCES with
    the installed ORT's source, and a change of any one of them turns the fast quantizer off."""
    guarded = (
        "QDQQuantizer._calc_initializer_quant_params",
        "quant_utils.compute_data_quant_params",
        "quant_utils.compute_scale_zp",
        "quant_utils.get_qmin_qmax_for_qType",
        "quant_utils._check_type",
        "BaseQuantizer.is_weight_symmetric",
        "QDQQuantizer._make_scale_zp_initializers",
        "QDQQuantizer.calc_graph_quant_params",
        "QDQQuantizer.calc_quant_params",
    )
    now = fast_quantize.current_sources()
    for label in guarded:
        assert label in fast_quantize.VERIFIED_SOURCES and now[label] == fast_quantize.VERIFIED_SOURCES[label]
    verified = dict(fast_quantize.VERIFIED_SOURCES)
    for label in guarded:  # one changed at a time
        monkeypatch.setattr(fast_quantize, "VERIFIED_SOURCES", dict(verified, **{label: "0" * 16}))
        monkeypatch.setattr(fast_quantize, "_PROBLEMS", {})
        monkeypatch.delenv(fast_quantize.PLAIN_ENV, raising=False)
        problem = fast_quantize.fast_path_problem("quantizer")
        assert problem is not None and label in problem, label


def _bare_quantizer(cls):
    ranges = {n: TensorData(lowest=np.float32(-1), highest=np.float32(1)) for n in ("x", "y", "z")}
    return cls(
        _model(_W), False, False, QuantType.QInt8, QuantType.QUInt8, TensorsData(CalibrationMethod.MinMax, ranges),
        [], [], ["MatMul"], {},
    )  # fmt: skip


def test_scale_and_zero_point_initializers_are_orts_own(monkeypatch):
    """make_scale_zp_initializers (the indexed quantizer's): the tensors ORT's method makes with
    onnx.helper.make_tensor, byte for byte and added in the same order, for per-tensor parameters of every
    8/16-bit type at their extremes and float32 scales down to subnormals, NaN and inf; per-channel
    parameters, a zero point whose dtype is not its type's and float16 scales are ORT's method itself."""
    from onnxruntime.quantization.base_quantizer import QuantizationParams

    types = {TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16,
             TensorProto.UINT16: np.uint16}  # fmt: skip
    scales = [0.1, 1.0, np.finfo(np.float32).tiny, 1e-45, np.nan, np.inf, 3.4e38]
    cases = []
    for quant_type, dtype in types.items():
        info = np.iinfo(dtype)
        for k, zp in enumerate((info.min, 0, info.max)):
            scale = np.array(scales[(k + quant_type) % len(scales)], dtype=np.float32)
            cases.append((QuantizationParams(zero_point=np.array(zp, dtype), scale=scale, quant_type=quant_type), True))
    per_channel = QuantizationParams(
        zero_point=np.zeros(3, np.int8), scale=np.ones(3, np.float32), quant_type=TensorProto.INT8, axis=0
    )
    cases.append((per_channel, False))
    wrong = QuantizationParams(zero_point=np.array(5, np.int32), scale=np.array(0.5, np.float32), quant_type=2)
    cases.append((wrong, False))
    half = QuantizationParams(zero_point=np.array(0, np.uint8), scale=np.array(0.5, np.float16), quant_type=2)
    cases.append((half, False))
    ours_q, theirs_q = _bare_quantizer(fast_quantize.indexed(QDQQuantizer)), _bare_quantizer(QDQQuantizer)
    plain = []
    real = QDQQuantizer._make_scale_zp_initializers
    monkeypatch.setattr(QDQQuantizer, "_make_scale_zp_initializers", lambda *a: plain.append(1) or real(*a))
    for k, (params, fast) in enumerate(cases):
        before = len(plain)
        ours = ours_q._make_scale_zp_initializers(f"t{k}", params, "_s")
        assert (len(plain) == before) == fast, k
        theirs = real(theirs_q, f"t{k}", params, "_s")
        for a, b in ((ours.scale, theirs.scale), (ours.zero_point, theirs.zero_point)):
            assert a.SerializeToString() == b.SerializeToString(), k
    again = QuantizationParams(zero_point=np.array(7, np.uint8), scale=np.array(0.25, np.float32), quant_type=2)
    ours, theirs = ours_q._make_scale_zp_initializers("t0", again, "_s"), real(theirs_q, "t0", again, "_s")
    for a, b in ((ours.scale, theirs.scale), (ours.zero_point, theirs.zero_point)):  # names taken: not added,
        assert a.SerializeToString() == b.SerializeToString()  # and the tensors returned are the ones made
        assert a.float_data[:] == [0.25] or a.int32_data[:] == [7]
    mine = [t.SerializeToString() for t in ours_q.model.model.graph.initializer]
    assert mine == [t.SerializeToString() for t in theirs_q.model.model.graph.initializer]
    assert isinstance(ours_q.model, fast_quantize.IndexedModel)
    ours_q.model.check_in_step()  # the tensors made in place are indexed where they are


def _activation_model():
    """x -> MatMul(w) -> y -> Relu -> r -> Softmax -> s -> Add(c) -> z: a Relu whose input range ORT replaces
    with its output's, a Softmax output ORT sets to [0, 1], an Add constant."""
    inits = [numpy_helper.from_array(_W, "w"), numpy_helper.from_array(_C, "c")]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("Relu", ["y"], ["r"], name="relu"),
        helper.make_node("Softmax", ["r"], ["s"], name="softmax"),
        helper.make_node("Add", ["s", "c"], ["z"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 4])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _ranges(**special):
    base = {"x": (-1.5, 2.0), "y": (-3.0, 4.0), "r": (0.0, 4.0), "s": (0.0, 0.9), "z": (-2.0, 5.0)}
    out = {}
    for name, (lo, hi) in base.items():
        lo, hi = special.get(name, (np.float32(lo), np.float32(hi)))
        out[name] = TensorData(lowest=lo, highest=hi)
    return TensorsData(CalibrationMethod.MinMax, out)


_F32 = np.float32
# name: (activation type, extra options, special ranges, tensors in bulk)
ACTIVATION_SCENARIOS = {
    "uint8 asymmetric": (QuantType.QUInt8, {}, {}, 5),
    "int8 symmetric": (QuantType.QInt8, {"ActivationSymmetric": True}, {}, 5),
    "16-bit": (QuantType.QUInt16, {}, {}, 5),
    "minimum real range": (QuantType.QUInt8, {"MinimumRealRange": 3.0}, {}, 5),
    "a zero range (tiny scale)": (QuantType.QUInt8, {}, {"x": (_F32(0), _F32(0))}, 5),
    "0-d and 1-element array ranges": (
        QuantType.QUInt8,
        {},
        {"x": (np.array(-1, _F32), np.array(1, _F32)), "z": (np.array([-2], _F32), np.array([3], _F32))},
        5,
    ),
    "restricted asymmetric uint8": (QuantType.QUInt8, {"ActivationRestrictedAsymmetric": True}, {}, 0),
    "restricted asymmetric, symmetric on": (
        QuantType.QUInt8, {"ActivationRestrictedAsymmetric": True, "ActivationSymmetric": True}, {}, 5,
    ),  # fmt: skip
    "overrides": (
        QuantType.QUInt8,
        {
            _OV: {
                "x": [{"quant_type": QuantType.QUInt16}],
                "y": [{"symmetric": True}],
                "z": [{"reduce_range": True}],
                "r": [{"rmin": _F32(-1), "rmax": _F32(1)}],
                "s": [{"scale": np.array(0.01, _F32), "zero_point": np.array(0, np.uint8)}],
            }
        },
        {},
        3,
    ),
    "convert": (
        QuantType.QUInt8,
        {_OV: {"y": [{"quant_type": QuantType.QUInt8, "convert": {"quant_type": QuantType.QUInt16}}]}},
        {},
        4,
    ),
    "float16 range": (QuantType.QUInt8, {}, {"x": (np.float16(-1), np.float16(1))}, 4),
    "NaN range (ORT refuses)": (QuantType.QUInt8, {}, {"x": (_F32(np.nan), _F32(1))}, 0),
    "an infinite range (left to ORT)": (QuantType.QUInt8, {}, {"z": (_F32(-np.inf), _F32(2))}, 4),
}


@pytest.mark.parametrize("scenario", list(ACTIVATION_SCENARIOS))
def test_activation_params_are_orts_for_every_branch(scenario, monkeypatch):
    """calc_graph_quant_params (the indexed QDQQuantizer's): ORT's own loop's entries -- original, converted and
    receiving nodes, ORT's order, the same bits -- with exactly the plain tensors computed in bulk; after ORT's
    range adjustments (the Relu input takes its output's range, the Softmax output [0, 1])."""
    activation, extra, special, bulk = ACTIVATION_SCENARIOS[scenario]
    taken = []
    real = fast_quantize.range_quant_params

    def counted(*args, **kwargs):
        if sys._getframe(2).f_code.co_name == "calc_graph_quant_params":  # through _grouped_params
            taken.append(len(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(fast_quantize, "range_quant_params", counted)

    def built(cls):
        try:
            with np.errstate(all="ignore"):
                quantizer = cls(
                    _activation_model(), False, False, QuantType.QInt8, activation, _ranges(**special), [], [],
                    ["MatMul", "Relu", "Softmax", "Add"], extra,
                )  # fmt: skip
        except Exception as e:  # noqa: BLE001 -- ORT's error is part of its behaviour
            return f"{type(e).__name__}: {e}"
        return quantizer, _flat_params(quantizer.quantization_params)  # computed by __init__

    ours, theirs = built(fast_quantize.indexed(QDQQuantizer)), built(QDQQuantizer)
    if isinstance(theirs, str):  # ORT refuses (a non-finite range): so does the bulk pass, alike
        assert ours == theirs and not taken, scenario
        return
    assert ours[1] == theirs[1], scenario
    assert sum(taken) == bulk, (scenario, taken)
    assert [name for name, _ in ours[1]] == list(ours[0].tensors_range)


def _flat_params(params) -> list:
    def one(p):
        return None if p is None else _flat({"": p})[0][1]

    return [(name, (one(q.original), one(q.converted), q.converted_recv_nodes)) for name, q in params.items()]


def test_ranges_minmax_reads_single_values_as_the_reduction_does():
    """Ranges.minmax's direct read of a single value (numpy scalar, 0-d or one-element array, float16, NaN,
    inf) gives float(np.min / np.max) of it; ranges of several values are still reduced."""
    from qdebug.quant.calibrate import Ranges

    values = {
        "scalar": (np.float32(-1.5), np.float32(2.25)),
        "0-d": (np.array(-3, np.float32), np.array(7, np.float32)),
        "one element": (np.array([-0.5], np.float32), np.array([[4.0]], np.float32)),
        "float16": (np.float16(-1.0009766), np.float16(65504)),
        "nan and inf": (np.float32(np.nan), np.float32(np.inf)),
        "several": (np.array([3, -2, 1], np.float32), np.array([5, 9, 2], np.float32)),
    }
    data = {k: TensorData(lowest=lo, highest=hi) for k, (lo, hi) in values.items()}
    got = Ranges("minmax", "k", TensorsData(CalibrationMethod.MinMax, data), None, False).minmax()
    for k, (lo, hi) in values.items():
        expected = (float(np.min(lo)), float(np.max(hi)))
        assert np.array_equal(got[k], expected, equal_nan=True) and all(type(v) is float for v in got[k]), k
    assert got["several"] == (-2.0, 9.0)
