"""The user's own quantization settings (issue 20): ``--config``, ``--preset``, the flags, and the settings
read off a ``--quantized`` model.

The proof is the model. For every option and preset, qdebug's static model -- built the way analyze,
propose, verify and bench build theirs (:func:`qdebug.prepare.prepare` resolves the config and calibrates
with it, :func:`qdebug.quant.quantize.quantize_static_model` builds from the cached ranges) -- is byte-identical
to what the user's own ``quantize_static`` call with the same arguments writes. That call runs on the
normalized model file qdebug quantizes, with a reader feeding the same calibration data in the same
batches; ORT's ``save_model_to_file`` sorts the nodes topologically, so qdebug's model is compared after
the same sort (:func:`_as_ort_saves`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    CalibrationMethod,
    QuantFormat,
    QuantType,
    get_qdq_config,
    quantize,
    quantize_static,
)
from onnxruntime.quantization.onnx_model import ONNXModel

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.match import qdq_settings
from qdebug.output.report_io import load_proposal, load_report
from qdebug.output.snippet import quantize_snippet
from qdebug.prepare import AnalyzeOptions, QuantRequest, prepare
from qdebug.quant.config import (
    PRESETS,
    calibration_options,
    checked_config,
    config_text,
    load_config,
    preset_config,
    read_off,
)
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.records import Proposal, TensorOverride
from qdebug.records.report import QuantSettings
from tests.conftest import fixture_path

CNN = fixture_path("cnn", "model.onnx")
CNN_CALIB = fixture_path("cnn", "calib.npz")
BATCH = 16
"""qdebug's default batch size: its MinMax calibration reads the data in batches of 16."""


class _Reader(CalibrationDataReader):
    """The user's reader: the ``.npz`` file's inputs in batches of ``batch`` (1 for the histogram methods,
    whose ORT calibrators qdebug feeds one sample at a time)."""

    def __init__(self, path: Path, batch: int) -> None:
        data = np.load(path)
        names = [k for k in data.files if k != "labels"]
        n = len(data[names[0]])
        self._items = iter([{k: data[k][i : i + batch] for k in names} for i in range(0, n, batch)])

    def get_next(self) -> dict | None:
        return next(self._items, None)


def _as_ort_saves(model: onnx.ModelProto) -> bytes:
    """``model`` as ORT's ``quantize_static`` writes its result (nodes sorted topologically by ORT), in the
    form :func:`_serialized` compares."""
    m = ONNXModel(copy.deepcopy(model))
    m.topological_sort()
    return _serialized(m.model)


def _serialized(model: onnx.ModelProto) -> bytes:
    """The model's deterministic bytes, less one default: a float weight kept float may carry
    ``data_location`` set to its default (``DEFAULT``) on one side and unset on the other, depending on
    which file or proto ORT's loader read -- the same tensor, two bytes apart."""
    model = copy.deepcopy(model)
    for t in model.graph.initializer:
        if t.HasField("data_location") and t.data_location == TensorProto.DEFAULT:
            t.ClearField("data_location")
    return model.SerializeToString(deterministic=True)


def _qdebug(config: dict, workdir: Path, model: Path = CNN, calib: Path = CNN_CALIB, **changes):
    """(prepared, qdebug's static model) for ``config`` -- a variant's own ``changes`` on top."""
    options = AnalyzeOptions(quant=QuantRequest(checked_config("test config", config)))
    prep = prepare(model, calib, workdir, options)
    assert prep.ranges is not None
    return prep, quantize_static_model(prep.normalized, prep.ranges, QuantSpec.of(prep.settings, **changes))


def _users(prep, tmp_path: Path, calib: Path = CNN_CALIB, batch: int = BATCH, **kwargs) -> bytes:
    """The user's own ``quantize_static`` call on the normalized model file, serialized."""
    out = tmp_path / "users.onnx"
    quantize_static(str(prep.normalized_path), str(out), _Reader(calib, batch), **kwargs)
    return _serialized(onnx.load(str(out)))


# every option: (config as the user writes it in JSON, the same call's keyword arguments, reader batch)
OPTIONS = {
    "reduce_range": ({"reduce_range": True}, {"reduce_range": True}, BATCH),
    "op_types_to_quantize": ({"op_types_to_quantize": ["Conv"]}, {"op_types_to_quantize": ["Conv"]}, BATCH),
    "nodes_to_quantize": (
        {"nodes_to_quantize": ["stem/conv", "block/1/conv"]},
        {"nodes_to_quantize": ["stem/conv", "block/1/conv"]},
        BATCH,
    ),
    "nodes_to_exclude": ({"nodes_to_exclude": ["stage2/conv"]}, {"nodes_to_exclude": ["stage2/conv"]}, BATCH),
    "calibrate_method": ({"calibrate_method": "Entropy"}, {"calibrate_method": CalibrationMethod.Entropy}, 1),
    "per_channel": ({"per_channel": True}, {"per_channel": True}, BATCH),
    "types": (
        {"activation_type": "QUInt16", "weight_type": "QUInt8"},
        {"activation_type": QuantType.QUInt16, "weight_type": QuantType.QUInt8},
        BATCH,
    ),
    "ActivationSymmetric": (
        {"activation_type": "QUInt8", "extra_options": {"ActivationSymmetric": True}},
        {"activation_type": QuantType.QUInt8, "extra_options": {"ActivationSymmetric": True}},
        BATCH,
    ),
    "WeightSymmetric": (
        {"extra_options": {"WeightSymmetric": False}},
        {"extra_options": {"WeightSymmetric": False}},
        BATCH,
    ),
    "CalibPercentile": (
        {"calibrate_method": "Percentile", "extra_options": {"CalibPercentile": 99.9}},
        {"calibrate_method": CalibrationMethod.Percentile, "extra_options": {"CalibPercentile": 99.9}},
        1,
    ),
    "CalibMovingAverage": (
        {"extra_options": {"CalibMovingAverage": True, "CalibMovingAverageConstant": 0.1}},
        {"extra_options": {"CalibMovingAverage": True, "CalibMovingAverageConstant": 0.1}},
        BATCH,
    ),
    "CalibTensorRangeSymmetric": (
        {"extra_options": {"CalibTensorRangeSymmetric": True}},
        {"extra_options": {"CalibTensorRangeSymmetric": True}},
        BATCH,
    ),
    "TensorQuantOverrides": (
        {
            "extra_options": {
                "TensorQuantOverrides": {
                    "block/1/conv_out": [{"quant_type": "QUInt16"}],
                    "stem/relu_out": [{"rmin": 0.0, "rmax": 2.5}],
                    "stage2.conv.weight": [{"axis": 0, "symmetric": True}],
                }
            }
        },
        {
            "extra_options": {
                "TensorQuantOverrides": {
                    "block/1/conv_out": [{"quant_type": QuantType.QUInt16}],
                    "stem/relu_out": [{"rmin": np.float32(0.0), "rmax": np.float32(2.5)}],
                    "stage2.conv.weight": [{"axis": 0, "symmetric": True}],
                }
            }
        },
        BATCH,
    ),
    "DedicatedQDQPair": (
        {"extra_options": {"DedicatedQDQPair": True}},
        {"extra_options": {"DedicatedQDQPair": True}},
        BATCH,
    ),
    "AddQDQPairToWeight": (
        {"extra_options": {"AddQDQPairToWeight": True}},
        {"extra_options": {"AddQDQPairToWeight": True}},
        BATCH,
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_builds_the_users_own_model_byte_for_byte(name, tmp_path):
    config, kwargs, batch = OPTIONS[name]
    prep, ours = _qdebug(config, tmp_path / "work")
    users = _users(prep, tmp_path, batch=batch, **kwargs)
    assert _as_ort_saves(ours) == users
    if name == "types":  # a config leaves nothing to qdebug's defaults: ORT's own are the user's
        assert (prep.settings.activation_type, prep.settings.weight_type) == ("QUInt16", "QUInt8")
    elif "activation_type" not in config:
        assert prep.settings.activation_type == "QInt8"  # quantize_static's default, not qdebug's QUInt8


def _presets_call(name: str) -> dict:
    """The ``quantize_static`` keyword arguments a preset stands for, written out as a user would."""
    calls = {
        "cpu-u8s8": {"activation_type": QuantType.QUInt8, "weight_type": QuantType.QInt8},
        "cpu-s8s8": {
            "activation_type": QuantType.QInt8,
            "weight_type": QuantType.QInt8,
            "extra_options": {"ActivationSymmetric": True, "WeightSymmetric": True},
        },
        "tensorrt": {
            "activation_type": QuantType.QInt8,
            "weight_type": QuantType.QInt8,
            "per_channel": True,
            "op_types_to_quantize": ["Conv", "ConvTranspose", "Gemm", "MatMul"],
            "extra_options": {
                "ActivationSymmetric": True,
                "WeightSymmetric": True,
                "AddQDQPairToWeight": True,
                "DedicatedQDQPair": True,
                "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
            },
        },
        "qnn": {
            "activation_type": QuantType.QUInt16,
            "weight_type": QuantType.QUInt8,
            "extra_options": {"MinimumRealRange": 0.0001, "DedicatedQDQPair": False},
        },
    }
    return {"quant_format": QuantFormat.QDQ, "calibrate_method": CalibrationMethod.MinMax, **calls[name]}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_builds_the_call_it_stands_for(name, tmp_path):
    prep = prepare(CNN, CNN_CALIB, tmp_path / "work", AnalyzeOptions(quant=QuantRequest(preset_config(name))))
    ours = quantize_static_model(prep.normalized, prep.ranges, QuantSpec.of(prep.settings))
    assert _as_ort_saves(ours) == _users(prep, tmp_path, **_presets_call(name))
    assert prep.settings.source == f"preset {name}"


def test_cpu_u8s8_is_todays_default():
    assert preset_config("cpu-u8s8") and QuantRequest(preset_config("cpu-u8s8")).resolve().without_source() == (
        QuantSettings()
    )


def test_printed_config_loads_back_to_the_same_settings(tmp_path):
    for name in PRESETS:
        settings = QuantRequest(preset_config(name)).resolve()
        path = tmp_path / f"{name}.json"
        path.write_text(config_text(settings))
        again = QuantRequest(load_config(path)).resolve()
        assert again.without_source() == settings.without_source()


def test_print_config_on_the_command_line(capsys):
    assert main(["analyze", "--preset", "tensorrt", "--symmetric-weights", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["per_channel"] is True
    assert printed["op_types_to_quantize"] == ["Conv", "ConvTranspose", "Gemm", "MatMul"]
    assert main(["analyze", "--print-config"]) == 0  # no preset: qdebug's default, cpu-u8s8
    assert json.loads(capsys.readouterr().out)["activation_type"] == "QUInt8"
    assert main(["analyze", "--reduce-range", "--op-types", "MatMul,Conv", "--calib-percentile", "99.9",
                 "--symmetric-activations", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["reduce_range"] and printed["op_types_to_quantize"] == ["Conv", "MatMul"]
    assert printed["calibrate_method"] == "Percentile"
    assert printed["extra_options"] == {"ActivationSymmetric": True, "CalibPercentile": 99.9}


def test_a_proposals_exclusions_and_overrides_merge_into_the_users(tmp_path):
    """Every variant is the user's config plus its own changes: exclusions added to the config's, the
    proposal's per-tensor keys winning over the user's for the tensors both name."""
    config = {
        "nodes_to_exclude": ["stage2/conv"],
        "extra_options": {"TensorQuantOverrides": {"stem/relu_out": [{"symmetric": True}]}},
    }
    fix = TensorOverride("stem/relu_out", rmin=0.0, rmax=2.0)
    prep, ours = _qdebug(config, tmp_path / "work", nodes_to_exclude=("head/gemm",), tensor_overrides=(fix,))
    users = _users(
        prep,
        tmp_path,
        nodes_to_exclude=["stage2/conv", "head/gemm"],
        extra_options={
            "TensorQuantOverrides": {
                "stem/relu_out": [{"symmetric": True, "rmin": np.float32(0.0), "rmax": np.float32(2.0)}]
            }
        },
    )
    assert _as_ort_saves(ours) == users


def _matmul_model(path: Path) -> tuple[Path, Path]:
    """A tiny MLP (MatMul weights, whose per-channel axis ORT takes as 1 unless told) and its data."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "w2")
    b1 = numpy_helper.from_array(rng.normal(size=(16,)).astype(np.float32), "b1")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        [w1, w2, b1],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    data = path.with_suffix(".npz")
    np.savez(data, x=rng.normal(size=(64, 8)).astype(np.float32))
    return path, data


def test_per_channel_axis_per_op_type(tmp_path):
    model, data = _matmul_model(tmp_path / "mlp.onnx")
    config = {"per_channel": True, "extra_options": {"QDQOpTypePerChannelSupportToAxis": {"MatMul": 0}}}
    prep, ours = _qdebug(config, tmp_path / "work", model, data)
    users = _users(prep, tmp_path, data, per_channel=True,
                   extra_options={"QDQOpTypePerChannelSupportToAxis": {"MatMul": 0}})
    assert _as_ort_saves(ours) == users
    assert ("MatMul", 0) in qdq_settings(ours).per_channel_axes


def test_a_get_qdq_config_config_is_run_through_orts_own_function(tmp_path):
    config = {"function": "get_qdq_config", "activation_symmetric": True, "per_channel": True,
              "calibrate_args": {"symmetric": True}}
    prep, ours = _qdebug(config, tmp_path / "work")
    made = get_qdq_config(onnx.load(str(prep.normalized_path)), _Reader(CNN_CALIB, BATCH),
                          activation_symmetric=True, per_channel=True, calibrate_args={"symmetric": True})
    out = tmp_path / "users.onnx"
    quantize(str(prep.normalized_path), str(out), made)
    assert _as_ort_saves(ours) == _serialized(onnx.load(str(out)))
    assert prep.settings.extra("ForceQuantizeNoInputCheck") is True  # what get_qdq_config adds
    assert calibration_options(prep.settings) == {"symmetric": True}


def test_calibration_options_are_part_of_the_cache_key(tmp_path):
    plain = prepare(CNN, CNN_CALIB, tmp_path / "a", AnalyzeOptions())
    again = prepare(CNN, CNN_CALIB, tmp_path / "b", AnalyzeOptions())
    moving = prepare(CNN, CNN_CALIB, tmp_path / "c",
                     AnalyzeOptions(quant=QuantRequest(given=(("CalibMovingAverage", True),))))
    ops = prepare(CNN, CNN_CALIB, tmp_path / "d", AnalyzeOptions(quant=QuantRequest(given=(("op_types", ("Conv",)),))))
    assert plain.ranges.key == again.ranges.key and again.ranges.from_cache
    assert len({plain.ranges.key, moving.ranges.key, ops.ranges.key}) == 3
    assert not moving.ranges.from_cache
    assert set(ops.ranges.minmax()) < set(plain.ranges.minmax())  # only the Conv nodes' tensors


# ----------------------------------------------------------------------------- config files


def test_the_readmes_example_config_loads(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Use your own quantization settings", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "q.toml").write_text(example)
    settings = QuantRequest(load_config(tmp_path / "q.toml")).resolve()
    assert settings.method == "percentile" and settings.extra("CalibPercentile") == 99.99
    assert settings.extra("TensorQuantOverrides") == {"block/1/conv_out": [{"quant_type": "QUInt16"}]}


def test_json_toml_and_python_configs_give_the_same_settings(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps({
        "activation_type": "QInt8", "per_channel": True, "op_types_to_quantize": ["Conv", "Gemm"],
        "extra_options": {"ActivationSymmetric": True, "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1}},
    }))
    (tmp_path / "q.toml").write_text(
        'activation_type = "QInt8"\nper_channel = true\nop_types_to_quantize = ["Conv", "Gemm"]\n'
        "[extra_options]\nActivationSymmetric = true\n[extra_options.QDQOpTypePerChannelSupportToAxis]\nMatMul = 1\n"
    )
    (tmp_path / "q.py").write_text(
        "from onnxruntime.quantization import QuantType\n\n"
        "activation_type = QuantType.QInt8\nper_channel = True\nop_types_to_quantize = ['Gemm', 'Conv']\n"
        "extra_options = {'ActivationSymmetric': True, 'QDQOpTypePerChannelSupportToAxis': {'MatMul': 1}}\n"
        "_helper = 3\n"
    )
    found = [QuantRequest(load_config(tmp_path / f"q.{x}")).resolve().without_source() for x in ("json", "toml", "py")]
    assert found[0] == found[1] == found[2]
    assert found[0].op_types == ("Conv", "Gemm") and found[0].extra("ActivationSymmetric") is True


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"per_chanel": True}, "unknown key 'per_chanel' for quantize_static (did you mean 'per_channel'?)"),
        ({"extra_options": {"ActivationSymetric": True}}, "did you mean 'ActivationSymmetric'?"),
        ({"activation_type": "QInt3"}, "activation_type 'QInt3' is not a type qdebug builds"),
        ({"per_channel": "yes"}, "per_channel must be true or false"),
        ({"calibrate_method": "MinMix"}, "did you mean 'minmax'?"),
        ({"calibration_data_reader": "x"}, "calibration_data_reader is not a config setting"),
        ({"quant_format": "QOperator"}, "quant_format QOperator is not analyzed layer by layer"),
        ({"function": "quantize_dynamic"}, "function 'quantize_dynamic' is not one qdebug reads"),
        ({"extra_options": {"SmoothQuant": True}}, "SmoothQuant cannot be applied from cached ranges"),
        ({"nodes_to_exclude": "stem/conv"}, "nodes_to_exclude must be a list of names"),
    ],
)
def test_a_bad_config_is_one_line_naming_the_fix(config, says, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    with pytest.raises(QDebugError) as e:
        QuantRequest(load_config(path)).resolve()
    assert says in e.value.one_line() and e.value.code == ExitCode.INPUT
    assert str(path.resolve()) in e.value.one_line()


def test_bad_config_files_on_the_command_line(tmp_path, capsys):
    model, calib = str(CNN), str(CNN_CALIB)
    (tmp_path / "typo.toml").write_text("reduce_rang = true\n")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "names.json").write_text(json.dumps({"nodes_to_exclude": ["stem/cnov"]}))
    out = str(tmp_path / "r.json")
    cases = [
        (["--config", str(tmp_path / "typo.toml")], "did you mean 'reduce_range'?", ExitCode.INPUT),
        (["--config", str(tmp_path / "broken.json")], "not valid JSON", ExitCode.INPUT),
        (["--config", str(tmp_path / "missing.json")], "not found", ExitCode.INPUT),
        (["--config", str(tmp_path / "names.json")], "did you mean 'stem/conv'?", ExitCode.INPUT),
        (["--config", str(tmp_path / "names.json"), "--preset", "qnn"], "--config and --preset", ExitCode.USAGE),
        (["--method", "minmax", "--calib-percentile", "99"], "--calib-percentile", ExitCode.USAGE),
    ]
    for extra, says, code in cases:
        assert main(["analyze", model, "--calib", calib, "-o", out, "-q", *extra]) == code
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "Traceback" not in err
    assert not Path(out).exists()


# ----------------------------------------------------------------------------- read off a --quantized model


def _users_qdq(tmp_path: Path, model: Path = CNN, calib: Path = CNN_CALIB, **kwargs):
    """(prepared normalized model, the user's QDQ model made from it by ``quantize_static(**kwargs)``)."""
    prep = prepare(model, calib, tmp_path / "work", AnalyzeOptions())
    out = tmp_path / "users.qdq.onnx"
    quantize_static(str(prep.normalized_path), str(out), _Reader(calib, BATCH), **kwargs)
    return prep, out


READABLE = {
    "activation symmetric": (
        {"activation_type": QuantType.QUInt8, "extra_options": {"ActivationSymmetric": True}},
        lambda s: s.extra("ActivationSymmetric") is True,
    ),
    "weights asymmetric": (
        {"activation_type": QuantType.QUInt8, "extra_options": {"WeightSymmetric": False}},
        lambda s: s.extra("WeightSymmetric") is False,
    ),
    "reduce_range": ({"activation_type": QuantType.QUInt8, "reduce_range": True}, lambda s: s.reduce_range),
    "op types": (
        {"activation_type": QuantType.QUInt8, "op_types_to_quantize": ["Conv"]},
        lambda s: s.op_types == ("Conv",),
    ),
    "per-channel and types": (
        {"activation_type": QuantType.QInt8, "per_channel": True},
        lambda s: s.per_channel and s.activation_type == "QInt8" and s.weight_type == "QInt8",
    ),
    "16-bit tensors": (
        {
            "activation_type": QuantType.QUInt8,
            "extra_options": {"TensorQuantOverrides": {"block/1/conv_out": [{"quant_type": QuantType.QUInt16}]}},
        },
        lambda s: s.extra("TensorQuantOverrides") == {"block/1/conv_out": [{"quant_type": "QUInt16"}]},
    ),
    "float weights with their own pair": (
        {"activation_type": QuantType.QUInt8, "extra_options": {"AddQDQPairToWeight": True}},
        lambda s: s.extra("AddQDQPairToWeight") is True,
    ),
    "a pair per reader": (
        {"activation_type": QuantType.QUInt8, "extra_options": {"DedicatedQDQPair": True}},
        lambda s: s.extra("DedicatedQDQPair") is True,
    ),
}


@pytest.mark.parametrize("name", sorted(READABLE))
def test_each_readable_setting_is_read_off_the_users_model(name, tmp_path):
    """Read back, and the model qdebug rebuilds from what it read is the user's, byte for byte."""
    kwargs, check = READABLE[name]
    prep, users = _users_qdq(tmp_path, **kwargs)
    settings, note = read_off(qdq_settings(onnx.load(str(users))), prep.normalized, QuantSettings(), users.name)
    assert check(settings), settings
    assert "; not readable from a model, so assumed: the calibration method" in note
    rebuilt = prepare(CNN, CNN_CALIB, tmp_path / "again", AnalyzeOptions(quant=QuantRequest(settings)))
    ours = quantize_static_model(rebuilt.normalized, rebuilt.ranges, QuantSpec.of(rebuilt.settings))
    assert _as_ort_saves(ours) == _serialized(onnx.load(str(users)))


def test_a_per_channel_axis_is_read_off_the_users_model(tmp_path):
    model, data = _matmul_model(tmp_path / "mlp.onnx")
    prep, users = _users_qdq(tmp_path, model, data, per_channel=True,
                             extra_options={"QDQOpTypePerChannelSupportToAxis": {"MatMul": 0}})
    settings, _ = read_off(qdq_settings(onnx.load(str(users))), prep.normalized, QuantSettings(), users.name)
    assert settings.extra("QDQOpTypePerChannelSupportToAxis") == {"MatMul": 0}


def test_the_defaults_read_off_as_the_defaults(tmp_path):
    prep, users = _users_qdq(tmp_path, activation_type=QuantType.QUInt8)
    settings, note = read_off(qdq_settings(onnx.load(str(users))), prep.normalized, QuantSettings(), users.name)
    assert settings.without_source() == QuantSettings()
    assert note.startswith("settings read from the quantized model: as the flags say; not readable from a model")


# ----------------------------------------------------------------------------- end to end


def test_analyze_records_the_config_and_measures_the_users_model(tmp_path):
    config = tmp_path / "q.json"
    config.write_text(json.dumps({"activation_type": "QInt8", "reduce_range": True,
                                  "extra_options": {"ActivationSymmetric": True}}))
    out = tmp_path / "report.json"
    assert main(["analyze", str(CNN), "--calib", str(CNN_CALIB), "-o", str(out), "-q", "--config", str(config),
                 "--per-channel"]) == 0
    report = load_report(out)
    settings = report.config.quant
    assert settings.source == f"{config.resolve()} + flags"
    assert settings.per_channel and settings.reduce_range and settings.extra("ActivationSymmetric") is True
    assert (report.config.activation_type, report.config.per_channel) == ("QInt8", True)  # older readers' fields
    built = onnx.load(str(tmp_path / "report_files" / "quantized.onnx"))
    prep = prepare(CNN, CNN_CALIB, tmp_path / "w", AnalyzeOptions())
    users = _users(prep, tmp_path, activation_type=QuantType.QInt8, reduce_range=True, per_channel=True,
                   extra_options={"ActivationSymmetric": True})
    assert _as_ort_saves(built) == users


def test_analyze_quantized_records_what_it_read(tmp_path):
    prep, users = _users_qdq(tmp_path, activation_type=QuantType.QInt8, reduce_range=True,
                             extra_options={"ActivationSymmetric": True})
    out = tmp_path / "report.json"
    assert main(["analyze", str(CNN), "--calib", str(CNN_CALIB), "--quantized", str(users), "-o", str(out),
                 "-q"]) == 0
    report = load_report(out)
    settings = report.config.quant
    assert settings.reduce_range and settings.activation_type == "QInt8"
    assert settings.extra("ActivationSymmetric") is True and settings.source == f"read off {users.name}"
    notes = [n for n in report.notes if n.startswith("settings read from the quantized model")]
    assert len(notes) == 1 and "symmetric activations" in notes[0] and "7-bit weights" in notes[0]


def test_propose_verify_and_bench_build_from_the_recorded_config(tmp_path, capsys):
    """The report's config is the base of every variant: propose records it in the proposal and its
    snippet, verify's and bench's static models are the user's own call."""
    from qdebug.bench import BenchOptions, run_bench
    from qdebug.verify import VerifyOptions, verify

    report = tmp_path / "report.json"
    assert main(["analyze", str(CNN), "--calib", str(CNN_CALIB), "-o", str(report), "-q", "--preset",
                 "cpu-s8s8"]) == 0
    proposal = tmp_path / "proposal.json"
    code = main(["propose", str(report), "-o", str(proposal), "-q", "--time-runs", "0", "--max-evaluations", "3",
                 "--target-drop", "100"])
    assert code == 0
    prop = load_proposal(proposal)
    assert prop.quant == load_report(report).config.quant and prop.quant.source == "preset cpu-s8s8"
    assert "'ActivationSymmetric': True" in prop.snippet and "activation_type=QuantType.QInt8" in prop.snippet
    prep = prepare(CNN, CNN_CALIB, tmp_path / "w", AnalyzeOptions())
    users = _users(prep, tmp_path, **_presets_call("cpu-s8s8"))
    capsys.readouterr()
    other = tmp_path / "other.json"  # propose told to build with other settings than the report's: it says so
    assert main(["propose", str(report), "-o", str(other), "-q", "--time-runs", "0", "--max-evaluations", "3",
                 "--target-drop", "100", "--preset", "cpu-u8s8"]) == 0
    said = capsys.readouterr()
    assert "the variants are built with preset cpu-u8s8" in said.out + said.err
    assert load_proposal(other).quant.activation_type == "QUInt8"

    result = verify(CNN, CNN_CALIB, None, proposal, options=VerifyOptions(runs=0), output=tmp_path / "v.json")
    static = onnx.load(str(tmp_path / "v_files" / "static.onnx"))
    assert _as_ort_saves(static) == users and result.variants

    run_bench(CNN, CNN_CALIB, proposal=proposal, output=tmp_path / "b.json",
              options=BenchOptions(variants=("static", "selective"), runs=1, warmup=0, dynamic_layers=False))
    static = onnx.load(str(tmp_path / "b_files" / "static.onnx"))
    assert _as_ort_saves(static) == users


def test_the_snippet_reproduces_the_selective_model_with_the_users_settings(tmp_path, monkeypatch):
    settings = QuantRequest(checked_config("t", {
        "activation_type": "QInt8", "reduce_range": True, "op_types_to_quantize": ["Conv", "Gemm", "Add"],
        "nodes_to_exclude": ["stage2/conv"],
        "extra_options": {"ActivationSymmetric": True,
                          "TensorQuantOverrides": {"stem/relu_out": [{"symmetric": False}]}},
    })).resolve()
    prep = prepare(CNN, CNN_CALIB, tmp_path / "w", AnalyzeOptions(quant=QuantRequest(settings)))
    fixes = (TensorOverride("stem/relu_out", rmin=0.0, rmax=2.0), TensorOverride("block/1/conv_out", "QUInt16"))
    spec = QuantSpec.of(prep.settings, nodes_to_exclude=("head/gemm",), tensor_overrides=fixes)
    ours = quantize_static_model(prep.normalized, prep.ranges, spec)
    text = quantize_snippet(str(prep.normalized_path), spec.nodes_to_exclude, method=settings.method,
                            per_channel=spec.per_channel, activation_type=settings.activation_type,
                            weight_type=settings.weight_type, tensor_overrides=fixes, calib_hint=str(CNN_CALIB),
                            batch=BATCH, inputs=["input"], settings=prep.settings)
    monkeypatch.chdir(tmp_path)
    exec(compile(text, "snippet", "exec"), {})
    assert _as_ort_saves(ours) == _serialized(onnx.load("model.selective.onnx"))


def test_options_keep_their_flat_keywords():
    """Public API: the Options classes still take (and give) the flat settings they took before."""
    from qdebug.bench import BenchOptions
    from qdebug.propose import ProposeOptions
    from qdebug.verify import VerifyOptions

    a = AnalyzeOptions(method="entropy", per_channel=True, providers=("CPUExecutionProvider",), threads=2)
    assert (a.method, a.per_channel, a.activation_type, a.threads, a.use_cache) == ("entropy", True, "QUInt8", 2, True)
    import dataclasses

    b = dataclasses.replace(a, activation_type="QInt8", use_cache=False)
    assert (b.method, b.activation_type, b.use_cache) == ("entropy", "QInt8", False)
    v = VerifyOptions(runs=0, method="minmax", per_channel=True)
    assert (v.method, v.activation_type, v.per_channel, v.runs) == ("minmax", None, True, 0)
    assert dataclasses.replace(v, per_channel=False).per_channel is False
    assert BenchOptions(weight_type="QUInt8").weight_type == "QUInt8" and BenchOptions().activation_type is None
    assert ProposeOptions(threads=3).threads == 3 and ProposeOptions().providers == ("CPUExecutionProvider",)


def test_an_old_proposal_still_gives_its_settings(tmp_path):
    old = Proposal(1, "proposal", "m", "", "n", (), method="entropy", activation_type="QInt8", base_per_channel=True)
    assert old.quant == QuantSettings(method="entropy", activation_type="QInt8", per_channel=True)
