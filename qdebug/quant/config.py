"""Use your own quantization settings: ``--config`` files, ``--preset`` names, settings read off a QDQ model.

A config file holds the keyword arguments of ``onnxruntime.quantization.quantize_static`` -- or of
``get_qdq_config`` -- as JSON, TOML or a Python file that assigns them at module level. Every key is
checked against the installed ORT's signature (and ``extra_options`` keys against the ones its
``quantize_static`` documents), so a misspelled key is one line naming the closest valid one instead of
an option ORT would silently ignore. A key a config leaves out takes that function's own default, exactly
as the user's call would: ``quantize_static``'s activations are ``QInt8``. The result is one
:class:`~qdebug.records.QuantSettings` in ``quantize_static`` form, which the report and the proposal
record, every variant is built from, and the snippet spells out.

A preset is a config qdebug ships (:data:`PRESETS`); :func:`config_text` prints the config any settings
stand for. :func:`read_off` turns what :func:`qdebug.graph.match.qdq_settings` reads off a user's QDQ
model into settings, with one note on what it could not tell.

Engine layer: ORT is imported only where its signature, registry or enums are needed.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdebug.errors import ExitCode, QDebugError
from qdebug.records import METHODS, QUANT_TYPES
from qdebug.records.report import ExtraOption, QuantSettings

FUNCTIONS = ("quantize_static", "get_qdq_config")
"""The ORT functions whose keyword arguments a config may hold (``"function"`` picks one; default: the one
whose signature takes every key, ``quantize_static`` when both do)."""

TENSORRT_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
"""The op types the ``tensorrt`` preset quantizes: the ones TensorRT runs as INT8 kernels next to their
Q/DQ pairs (everything else is fused or left to TensorRT's own precision choice)."""

PRESETS: dict[str, dict[str, Any]] = {
    "cpu-u8s8": {"calibrate_method": "MinMax", "activation_type": "QUInt8", "weight_type": "QInt8"},
    "cpu-s8s8": {
        "calibrate_method": "MinMax",
        "activation_type": "QInt8",
        "weight_type": "QInt8",
        "extra_options": {"ActivationSymmetric": True, "WeightSymmetric": True},
    },
    "tensorrt": {
        "calibrate_method": "MinMax",
        "activation_type": "QInt8",
        "weight_type": "QInt8",
        "per_channel": True,
        "op_types_to_quantize": list(TENSORRT_OPS),
        "extra_options": {
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "AddQDQPairToWeight": True,
            "DedicatedQDQPair": True,
            "QDQOpTypePerChannelSupportToAxis": {"MatMul": 1},
        },
    },
    "qnn": {
        "calibrate_method": "MinMax",
        "activation_type": "QUInt16",
        "weight_type": "QUInt8",
        "extra_options": {"MinimumRealRange": 0.0001, "DedicatedQDQPair": False},
    },
}
"""The deployment presets, as ``quantize_static`` keyword arguments (``--preset NAME``)."""

PRESET_HELP = {
    "cpu-u8s8": "ORT's CPU default and qdebug's: uint8 activations, int8 weights",
    "cpu-s8s8": "x86 CPUs, S8S8: int8 activations and weights, both symmetric (zero points 0)",
    "tensorrt": "TensorRT: S8S8 symmetric, per-channel weights, Conv/ConvTranspose/Gemm/MatMul only, one "
    "Q/DQ pair per reader, weights kept float with their own Q/DQ",
    "qnn": "Qualcomm QNN (HTP): 16-bit activations (QUInt16), 8-bit weights (QUInt8), a minimum real range",
}

COMMAND_LINE_KEYS = {
    "model_input": "the model is qdebug's first argument",
    "model_output": "qdebug writes its own models",
    "calibration_data_reader": "--calib gives the calibration data",
    "calibration_cache_path": "qdebug caches its ranges itself (--no-cache turns that off)",
}
"""Keys of the signatures that a config may not hold, and why."""

IGNORED_KEYS = ("use_external_data_format", "calibration_providers")
"""Keys accepted and not applied: they change how ORT stores or computes, not the model's numbers
(qdebug decides the external-data layout by size; ``--provider`` runs calibration)."""

CALIBRATION_KEYS = (
    ("CalibTensorRangeSymmetric", "symmetric"),
    ("CalibMovingAverage", "moving_average"),
    ("CalibMovingAverageConstant", "averaging_constant"),
    ("CalibMaxIntermediateOutputs", "max_intermediate_outputs"),
    ("CalibPercentile", "percentile"),
)
"""``extra_options`` keys that change the calibration, and the calibrator option each becomes (as
``quantize_static`` passes them): part of the calibration cache key."""

_EXTRA_KEYS_ALWAYS = ("CalibPercentile", "QuantizeBias", "BlockSize")
"""``extra_options`` keys ORT reads without listing them in ``quantize_static``'s docstring."""

_METHOD_OF = {"minmax": "minmax", "entropy": "entropy", "percentile": "percentile", "distribution": "distribution"}


@dataclass(frozen=True, eq=False)
class LoadedConfig:
    """A config file or preset as given: which function's keyword arguments, and their values (ORT's
    objects allowed, e.g. ``QuantType.QInt8`` or a ``nodes_to_exclude`` function in a Python file)."""

    source: str
    """``preset NAME`` or the file's absolute path."""
    function: str
    """``quantize_static`` or ``get_qdq_config``."""
    kwargs: tuple[tuple[str, Any], ...]


def _fail(source: str, message: str, hint: str) -> QDebugError:
    return QDebugError(f"{source}: {message}", hint, ExitCode.INPUT)


def _closest(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    if not match:
        match = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
        match = [c for c in choices if c.lower() == match[0]] if match else []
    return f" (did you mean {match[0]!r}?)" if match else ""


def signature_keys(function: str) -> tuple[str, ...]:
    """The keyword arguments of the installed ORT's ``function``."""
    from onnxruntime import quantization

    return tuple(inspect.signature(getattr(quantization, function)).parameters)


def extra_option_keys() -> tuple[str, ...]:
    """The ``extra_options`` keys the installed ORT's ``quantize_static`` documents (plus the few it reads
    without documenting them)."""
    from onnxruntime.quantization import quantize_static

    doc = inspect.getdoc(quantize_static) or ""
    section = doc.split("extra_options:", 1)[1] if "extra_options:" in doc else ""
    keys = re.findall(r"^\s{4,16}([A-Za-z][\w.]*)\s*=", section, re.M)
    return tuple(dict.fromkeys([*keys, *_EXTRA_KEYS_ALWAYS]))


# ----------------------------------------------------------------------------- loading


def load_config(path: str | Path) -> LoadedConfig:
    """Read a config file (``.json``, ``.toml`` or ``.py``) and check its keys (not yet its values)."""
    p = Path(path)
    source = str(p.resolve())
    if not p.is_file():
        raise QDebugError(
            f"config file {path} not found", "pass the path of a .json, .toml or .py file", ExitCode.INPUT
        )
    suffix = p.suffix.lower()
    if suffix == ".json":
        raw = _json_file(p, source)
    elif suffix == ".toml":
        raw = _toml_file(p, source)
    elif suffix == ".py":
        raw = _python_file(p, source)
    else:
        raise QDebugError(
            f"config file {path} is neither .json, .toml nor .py",
            "write the quantize_static keyword arguments as JSON, TOML or Python",
            ExitCode.INPUT,
        )
    if not isinstance(raw, dict):
        raise _fail(source, "the config is not a table of keyword arguments", "write an object such as "
                    '{"per_channel": true}')
    return checked_config(source, raw)


def _json_file(p: Path, source: str) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(source, f"not valid JSON ({e})", "fix the JSON, or write the config as TOML") from None


def _toml_file(p: Path, source: str) -> Any:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        raise _fail(source, "TOML needs Python >= 3.11 (tomllib)", "write the config as JSON") from None
    try:
        return tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise _fail(source, f"not valid TOML ({e})", "fix the TOML, or write the config as JSON") from None


def _python_file(p: Path, source: str) -> dict[str, Any]:
    """The module-level names a Python config assigns (names starting with ``_``, imported modules and
    classes are helpers; a function counts only under a key's name, e.g. ``nodes_to_exclude``)."""
    import runpy
    import types

    try:
        namespace = runpy.run_path(str(p), run_name="qdebug_config")
    except Exception as e:
        raise _fail(
            source, f"running the config failed ({e.__class__.__name__}: {str(e)[:200]})", "fix the Python file"
        ) from None
    keys = set(signature_keys("quantize_static")) | set(signature_keys("get_qdq_config")) | {"function"}
    out = {}
    for name, value in namespace.items():
        if name.startswith("_") or isinstance(value, (types.ModuleType, type)):
            continue
        if callable(value) and name not in keys and not hasattr(value, "name"):
            continue  # a helper function (an enum member such as QuantType.QInt8 is callable too)
        out[name] = value
    return out


def checked_config(source: str, raw: Mapping[str, Any]) -> LoadedConfig:
    """``raw`` keyword arguments checked against the installed ORT: the function they are for, every key
    one of its keyword arguments (the closest named when not), no key qdebug gives itself."""
    raw = dict(raw)
    function = raw.pop("function", None)
    signatures = {f: signature_keys(f) for f in FUNCTIONS}
    if function is not None and function not in FUNCTIONS:
        raise _fail(source, f"function {function!r} is not one qdebug reads{_closest(str(function), FUNCTIONS)}",
                    f"use one of {', '.join(FUNCTIONS)}")
    if function is None:
        function = next((f for f in FUNCTIONS if set(raw) <= set(signatures[f])), "quantize_static")
    valid = signatures[function]
    for key in raw:
        if key in COMMAND_LINE_KEYS:
            raise _fail(source, f"{key} is not a config setting: {COMMAND_LINE_KEYS[key]}", f"remove {key}")
        if key not in valid:
            raise _fail(
                source,
                f"unknown key {key!r} for {function}{_closest(key, [*valid, 'function'])}",
                f"use the keyword arguments of onnxruntime.quantization.{function} ({_ort_version()})",
            )
    extras = raw.get("extra_options") or {}
    if not isinstance(extras, Mapping):
        raise _fail(source, "extra_options is not a table", 'write it as {"ActivationSymmetric": true, ...}')
    known = extra_option_keys()
    for key in extras:
        if key not in known:
            raise _fail(
                source,
                f"unknown extra_options key {key!r}{_closest(str(key), known)}",
                f"use the extra_options ORT {_ort_version()} documents for quantize_static",
            )
    return LoadedConfig(source, function, tuple(raw.items()))


def _ort_version() -> str:
    import onnxruntime

    return f"ORT {onnxruntime.__version__}"


def preset_config(name: str) -> LoadedConfig:
    """The config a preset stands for."""
    if name not in PRESETS:
        raise QDebugError(
            f"unknown preset {name!r}{_closest(name, list(PRESETS))}",
            f"use one of {', '.join(PRESETS)}",
            ExitCode.USAGE,
        )
    return checked_config(f"preset {name}", json.loads(json.dumps(PRESETS[name])))


# ----------------------------------------------------------------------------- values


def jsonable(value: Any, where: str = "") -> Any:
    """A config value as JSON holds it: ORT enums by name, numpy arrays and scalars as numbers or lists,
    sets as sorted lists, tuples as lists."""
    import numpy as np

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if hasattr(value, "name") and type(value).__module__.startswith("onnxruntime"):
        return value.name  # QuantType, CalibrationMethod, QuantFormat members
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(jsonable(v, where) for v in value)
    if isinstance(value, (list, tuple)):
        return [jsonable(v, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    raise QDebugError(
        f"the config value of {where or 'a key'} ({type(value).__name__}) cannot be recorded",
        "use numbers, strings, lists and tables (ORT's QuantType and CalibrationMethod members are fine)",
        ExitCode.INPUT,
    )


def _name(value: Any) -> str:
    """An enum member or its name as written (``QuantType.QInt8``, ``"QInt8"``) -> ``QInt8``."""
    text = value.name if hasattr(value, "name") and not isinstance(value, str) else str(value)
    return text.rsplit(".", 1)[-1]


def _qtype(source: str, key: str, value: Any) -> str:
    name = _name(value)
    match = next((t for t in QUANT_TYPES if t.lower() == name.lower()), None)
    if match is None:
        raise _fail(source, f"{key} {name!r} is not a type qdebug builds{_closest(name, QUANT_TYPES)}",
                    f"use one of {', '.join(QUANT_TYPES)}")
    return match


def _method(source: str, value: Any) -> str:
    name = _name(value).lower()
    if name not in _METHOD_OF:
        raise _fail(source, f"calibrate_method {_name(value)!r} is not one of ORT's{_closest(name, METHODS)}",
                    "use MinMax, Entropy, Percentile or Distribution")
    return _METHOD_OF[name]


def _bool(source: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(source, f"{key} must be true or false (got {value!r})", f"write {key} = true or false")
    return value


def _names(source: str, key: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise _fail(source, f"{key} must be a list of names (got {value!r})", f'write {key} = ["a", "b"]')
    if not all(isinstance(v, str) for v in value):
        raise _fail(source, f"{key} must hold names (strings)", f'write {key} = ["a", "b"]')
    return tuple(value)


def _ort_defaults(function: str) -> dict[str, Any]:
    """The installed ORT's defaults of ``function``'s keyword arguments (what a config leaves out)."""
    from onnxruntime import quantization

    params = inspect.signature(getattr(quantization, function)).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


# ----------------------------------------------------------------------------- settings


def settings_of(config: LoadedConfig, model: Any = None) -> QuantSettings:
    """The settings a config stands for, in ``quantize_static`` form. A ``get_qdq_config`` config is run
    through the installed ORT's own ``get_qdq_config`` on ``model`` (the normalized model: the op types it
    picks are the model's); without a model only its explicit op types are known."""
    kwargs = dict(config.kwargs)
    if config.function == "get_qdq_config":
        kwargs = _from_get_qdq_config(config, kwargs, model)
    merged = {**_ort_defaults("quantize_static"), **kwargs}
    source = config.source
    fmt = _name(merged.get("quant_format", "QDQ"))
    if fmt != "QDQ":
        raise _fail(source, f"quant_format {fmt} is not analyzed layer by layer (its tensors are integers)",
                    "use quant_format QDQ; qdebug bench --variants fp32,static,qoperator times the QOperator form")
    extras = jsonable(merged.get("extra_options") or {}, "extra_options")
    settings = QuantSettings(
        method=_method(source, merged.get("calibrate_method", "MinMax")),
        per_channel=_bool(source, "per_channel", merged.get("per_channel", False)),
        activation_type=_qtype(source, "activation_type", merged.get("activation_type", "QInt8")),
        weight_type=_qtype(source, "weight_type", merged.get("weight_type", "QInt8")),
        reduce_range=_bool(source, "reduce_range", merged.get("reduce_range", False)),
        op_types=tuple(sorted(set(_names(source, "op_types_to_quantize", merged.get("op_types_to_quantize"))))),
        nodes_to_quantize=_names(source, "nodes_to_quantize", merged.get("nodes_to_quantize")),
        nodes_to_exclude=_names(source, "nodes_to_exclude", merged.get("nodes_to_exclude")),
        extra_options=tuple(ExtraOption(k, extras[k]) for k in sorted(extras)),
        source=source,
    )
    check_extra_options(settings)
    return settings


def _from_get_qdq_config(config: LoadedConfig, kwargs: dict[str, Any], model: Any) -> dict[str, Any]:
    """``get_qdq_config``'s keyword arguments turned into ``quantize_static``'s by ORT's own function."""
    from onnxruntime import quantization

    ort_kwargs = {k: _to_ort_argument(k, v) for k, v in kwargs.items()}
    if model is None:  # before normalization: what does not need the model, with get_qdq_config's defaults
        shared = {**_ort_defaults("get_qdq_config"), **ort_kwargs}
        return {k: v for k, v in shared.items() if k in signature_keys("quantize_static") and k != "nodes_to_exclude"}
    try:
        made = quantization.get_qdq_config(model, None, **ort_kwargs)
    except Exception as e:
        raise _fail(config.source, f"ORT's get_qdq_config refused it ({e.__class__.__name__}: {str(e)[:200]})",
                    "check the values against get_qdq_config's documentation") from None
    out = {
        "calibrate_method": made.calibrate_method,
        "quant_format": made.quant_format,
        "activation_type": made.activation_type,
        "weight_type": made.weight_type,
        "op_types_to_quantize": made.op_types_to_quantize,
        "nodes_to_quantize": made.nodes_to_quantize,
        "nodes_to_exclude": sorted(made.nodes_to_exclude or []),
        "per_channel": made.per_channel,
        "reduce_range": made.reduce_range,
        "extra_options": made.extra_options,
    }
    return {k: v for k, v in out.items() if v is not None}


def _to_ort_argument(key: str, value: Any) -> Any:
    """A config value as ORT's function wants it (enums from their names, override entries as arrays)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

    if key in ("activation_type", "weight_type") and isinstance(value, str):
        return getattr(QuantType, _name(value))
    if key == "calibrate_method" and isinstance(value, str):
        return CalibrationMethod[{m.name.lower(): m.name for m in CalibrationMethod}.get(value.lower(), value)]
    if key == "quant_format" and isinstance(value, str):
        return QuantFormat[_name(value)]
    if key == "tensor_quant_overrides" and value:
        return ort_tensor_overrides(jsonable(value), "QUInt8")
    if key == "extra_options" and value:
        return ort_extra_options(jsonable(value), "QUInt8")
    return value


def check_extra_options(settings: QuantSettings) -> None:
    """Refuse the ``extra_options`` qdebug cannot apply from cached ranges, with the reason."""
    source = settings.source or "the settings"
    if settings.extra("SmoothQuant", False):
        raise _fail(
            source,
            "SmoothQuant cannot be applied from cached ranges: it rewrites the model (folds per-channel "
            "activation scales into the weights, neural-compressor's ORTSmoothQuant) from the calibration "
            "data's per-channel statistics before ORT calibrates, and qdebug rebuilds every variant from "
            "per-tensor ranges of one normalized model",
            "apply SmoothQuant yourself and analyze the transformed FP32 model, or drop SmoothQuant",
        )
    if settings.extra("CalibStridedMinMax") and settings.extra("CalibMovingAverage", False):
        raise _fail(
            source,
            "CalibStridedMinMax with CalibMovingAverage averages over the strides of ORT's own reader, which "
            "qdebug's batches do not reproduce",
            "drop CalibStridedMinMax (it only saves memory) or CalibMovingAverage",
        )
    overrides = settings.extra("TensorQuantOverrides")
    if overrides is not None and not (
        isinstance(overrides, Mapping) and all(isinstance(v, list) and v for v in overrides.values())
    ):
        raise _fail(source, "TensorQuantOverrides is not a table of tensor names", "write {tensor: [{...}]}")


def calibration_options(settings: QuantSettings) -> dict[str, Any]:
    """The calibrator options ``settings`` imply (as ``quantize_static`` passes them to ORT's calibrator):
    empty for qdebug's defaults, so their calibration cache keys stay what they were."""
    extras = settings.extra_dict()
    return {option: extras[key] for key, option in CALIBRATION_KEYS if key in extras}


def resolve(
    base: LoadedConfig | QuantSettings | None,
    given: Sequence[tuple[str, Any]] = (),
    model: Any = None,
) -> QuantSettings:
    """The settings to build with: ``base`` (a config, preset or recorded settings; None: qdebug's
    defaults) with the flags ``given`` applied last -- a :class:`QuantSettings` field name or an
    ``extra_options`` key each (``ActivationSymmetric``) -- and checked."""
    if isinstance(base, LoadedConfig):
        settings = settings_of(base, model)
    else:
        settings = base or QuantSettings()
    if given:
        fields = {f.name for f in dataclasses.fields(QuantSettings)}
        for key, value in given:
            if key in fields:
                settings = dataclasses.replace(settings, **{key: value})
            else:
                settings = settings.with_extra(key, value)
        if isinstance(base, LoadedConfig) or (base is not None and base.source):
            settings = dataclasses.replace(settings, source=f"{settings.source} + flags")
    _check_values(settings)
    return settings


def _check_values(settings: QuantSettings) -> None:
    """Refuse a method or type qdebug does not know (flags are checked by argparse, records are not)."""
    source = settings.source or "the settings"
    if settings.method not in METHODS:
        raise _fail(source, f"unknown calibration method {settings.method!r}", f"use one of {', '.join(METHODS)}")
    for key in ("activation_type", "weight_type"):
        _qtype(source, key, getattr(settings, key))
    check_extra_options(settings)


def check_node_names(settings: QuantSettings, model: Any) -> None:
    """Refuse ``nodes_to_exclude``/``nodes_to_quantize`` names the normalized model lacks (ORT ignores
    them silently: a typo would quantize what the user meant to keep float)."""
    names = {n.name for n in model.graph.node}
    for key in ("nodes_to_exclude", "nodes_to_quantize"):
        unknown = [n for n in getattr(settings, key) if n not in names]
        if unknown:
            raise _fail(
                settings.source or "the settings",
                f"{key} names {len(unknown)} node(s) not in the model: {unknown[0]!r}"
                f"{_closest(unknown[0], sorted(names))}{' ...' if len(unknown) > 1 else ''}",
                "use the node names of the normalized model (the names in qdebug's report)",
            )


# ----------------------------------------------------------------------------- ORT objects


_NUMPY_OF = {"QUInt8": "uint8", "QInt8": "int8", "QUInt16": "uint16", "QInt16": "int16"}


def ort_extra_options(extras: Mapping[str, Any], activation_type: str) -> dict[str, Any]:
    """``extra_options`` (JSON values) as ORT's quantizer reads them: ``TensorQuantOverrides`` with
    ``QuantType`` members and float32 arrays (:func:`ort_tensor_overrides`), the rest as given."""
    out = dict(extras)
    if "TensorQuantOverrides" in out and out["TensorQuantOverrides"] is not None:
        out["TensorQuantOverrides"] = ort_tensor_overrides(out["TensorQuantOverrides"], activation_type)
    return out


def ort_tensor_overrides(overrides: Mapping[str, Sequence[Mapping[str, Any]]], default_type: str) -> dict[str, Any]:
    """``TensorQuantOverrides`` (JSON values) as ORT wants them: ``quant_type`` a ``QuantType``; ``scale``,
    ``rmin``, ``rmax`` float32 arrays; ``zero_point`` an array of the entry's type; ``convert`` the same,
    its ``recv_nodes`` a set."""
    return {name: [_ort_entry(e, default_type) for e in entries] for name, entries in overrides.items()}


def _ort_entry(entry: Mapping[str, Any], default_type: str) -> dict[str, Any]:
    import numpy as np
    from onnxruntime.quantization import QuantType

    qtype = _name(entry["quant_type"]) if "quant_type" in entry else default_type
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if key == "quant_type":
            out[key] = getattr(QuantType, _name(value))
        elif key in ("scale", "rmin", "rmax"):
            out[key] = np.array(value, dtype=np.float32)
        elif key == "zero_point":
            out[key] = np.array(value, dtype=_NUMPY_OF.get(qtype, "int32"))
        elif key == "convert":
            converted = _ort_entry({k: v for k, v in value.items() if k != "recv_nodes"}, qtype)
            if "recv_nodes" in value:
                converted["recv_nodes"] = set(value["recv_nodes"])
            out[key] = converted
        else:
            out[key] = value
    return out


def ort_kwargs(settings: QuantSettings) -> dict[str, Any]:
    """The ``quantize_static`` keyword arguments ``settings`` stand for, as ORT's objects (what a user's
    own call passes; the tests call ``quantize_static(**ort_kwargs(s))``)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType

    methods = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}
    out: dict[str, Any] = {
        "quant_format": QuantFormat.QDQ,
        "calibrate_method": CalibrationMethod[methods[settings.method]],
        "activation_type": getattr(QuantType, settings.activation_type),
        "weight_type": getattr(QuantType, settings.weight_type),
        "per_channel": settings.per_channel,
        "reduce_range": settings.reduce_range,
    }
    if settings.op_types:
        out["op_types_to_quantize"] = list(settings.op_types)
    if settings.nodes_to_quantize:
        out["nodes_to_quantize"] = list(settings.nodes_to_quantize)
    if settings.nodes_to_exclude:
        out["nodes_to_exclude"] = list(settings.nodes_to_exclude)
    if settings.extra_options:
        out["extra_options"] = ort_extra_options(settings.extra_dict(), settings.activation_type)
    return out


# ----------------------------------------------------------------------------- printing


def config_kwargs(settings: QuantSettings) -> dict[str, Any]:
    """The ``quantize_static`` keyword arguments of ``settings`` as JSON values: a config ``--config``
    reads back to the same settings."""
    methods = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile", "distribution": "Distribution"}
    out: dict[str, Any] = {
        "calibrate_method": methods.get(settings.method, settings.method),
        "activation_type": settings.activation_type,
        "weight_type": settings.weight_type,
        "per_channel": settings.per_channel,
        "reduce_range": settings.reduce_range,
        "op_types_to_quantize": list(settings.op_types) or None,
        "nodes_to_quantize": list(settings.nodes_to_quantize) or None,
        "nodes_to_exclude": list(settings.nodes_to_exclude) or None,
        "extra_options": settings.extra_dict(),
    }
    return out


def config_text(settings: QuantSettings) -> str:
    """The config ``settings`` stand for, as JSON (``--print-config``): ``quantize_static``'s keyword
    arguments only (qdebug's own ``upgrade_opset``/``inline_constant_if`` are flags), so the file loads back
    with ``--config`` as it is."""
    return json.dumps(config_kwargs(settings), indent=2) + "\n"


def describe(settings: QuantSettings) -> str:
    """The settings in a few words, for notes (``QInt8 activations (symmetric), per-channel QInt8 weights``)."""
    parts = [
        f"{settings.method}",
        f"{settings.activation_type} activations" + (" (symmetric)" if settings.extra("ActivationSymmetric") else ""),
        f"{'per-channel ' if settings.per_channel else ''}{settings.weight_type} weights"
        + (" (7-bit)" if settings.reduce_range else ""),
    ]
    if settings.op_types:
        parts.append(f"op types {','.join(settings.op_types)}")
    others = [o.key for o in settings.extra_options if o.key != "ActivationSymmetric"]
    if others:
        parts.append("extra_options " + ",".join(others))
    return ", ".join(parts)


# ----------------------------------------------------------------------------- read off a QDQ model


_FOLLOWERS = ("QDQRemovableActivation", "QDQDirect8BitOp", "QDQResize", "QDQMaxPool", "QDQPad", "QDQSplit")
"""ORT's QDQ handlers that quantize a node only when its input already is (or fold it away): a model's op
types are inferred from the others."""


def _always_quantized_ops() -> set[str]:
    """Op types ORT's default static quantization puts Q/DQ on whenever they read a float tensor."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    ops = set(QLinearOpsRegistry) | set(QDQRegistry)
    return {op for op in ops if QDQRegistry.get(op) is None or QDQRegistry[op].__name__ not in _FOLLOWERS}


def _float_readers(fp32: Any) -> set[str]:
    """Op types of the FP32 model's nodes that read a float tensor (by the types shape inference gave)."""
    import onnx

    g = fp32.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        types[vi.name] = vi.type.tensor_type.elem_type
    return {n.op_type for n in g.node if any(types.get(t) == onnx.TensorProto.FLOAT for t in n.input if t)}


def read_off(found: Any, fp32: Any, base: QuantSettings, source: str) -> tuple[QuantSettings, str]:
    """Settings of a user's QDQ model: ``base`` (the flags) with what ``found``
    (:class:`~qdebug.graph.match.QDQSettings`) shows, and one note naming what was read and what could not
    be and was assumed. ``fp32`` is the normalized FP32 model the QDQ model was made from."""
    s = dataclasses.replace(
        base,
        per_channel=found.per_channel if found.per_channel is not None else base.per_channel,
        activation_type=found.activation_type or base.activation_type,
        weight_type=found.weight_type or base.weight_type,
        source=f"read off {source}",
    )
    read: list[str] = []
    if found.activation_symmetric:
        s = s.with_extra("ActivationSymmetric", True)
        read.append("symmetric activations")
    signed = s.weight_type in ("QInt8", "QInt16")
    if found.weight_symmetric is not None and found.weight_symmetric != signed:
        s = s.with_extra("WeightSymmetric", found.weight_symmetric)
        read.append("symmetric weights" if found.weight_symmetric else "asymmetric weights")
    if found.reduce_range:
        s = dataclasses.replace(s, reduce_range=True)
        read.append("7-bit weights (reduce_range)")
    s, more = _read_op_types(found, fp32, s)
    read.extend(more)
    s, more = _read_layout(found, fp32, s)
    read.extend(more)
    def say(field: str, value: object) -> str:
        if field == "per_channel":
            return "per-channel weights" if value else "per-tensor weights"
        return f"{value} {'activations' if field == 'activation_type' else 'weights'}"

    changed = [
        f"{say(f, getattr(s, f))} (flags: {say(f, getattr(base, f))})"
        for f in ("per_channel", "activation_type", "weight_type")
        if getattr(s, f) != getattr(base, f)
    ]
    note = (
        "settings read from the quantized model: "
        + (", ".join(changed) if changed else "as the flags say")
        + (f", and {', '.join(read)}" if read else "")
        + "; not readable from a model, so assumed: the calibration method and its options (the model holds "
        "its ranges, not how they were found), nodes_to_exclude, and any extra_options the Q/DQ nodes do not "
        f"show; propose, verify and bench rebuild it with them from qdebug's own calibration (--method "
        f"{s.method}), so their static baseline can differ from this file"
    )
    return s, note


def _read_op_types(found: Any, fp32: Any, s: QuantSettings) -> tuple[QuantSettings, list[str]]:
    """``op_types_to_quantize`` when an op type ORT quantizes by default reads floats in the FP32 model yet
    carries no Q/DQ in the QDQ model (the user's list left it out)."""
    if not found.op_types:
        return s, []
    missing = sorted((_always_quantized_ops() & _float_readers(fp32)) - set(found.op_types))
    if not missing:
        return s, []
    return dataclasses.replace(s, op_types=tuple(found.op_types)), [
        f"op types {','.join(found.op_types)} (no Q/DQ on {','.join(missing)})"
    ]


def _read_layout(found: Any, fp32: Any, s: QuantSettings) -> tuple[QuantSettings, list[str]]:
    """Per-channel axes that differ from ORT's defaults, 16-bit (or other minority-type) activations,
    float weights with their own Q/DQ pair, one Q/DQ pair per reader."""
    read: list[str] = []
    defaults = {"Conv": 0, "ConvTranspose": 1, "MatMul": 1}
    axes = {op: axis for op, axis in found.per_channel_axes if op in defaults and axis != defaults[op]}
    if axes:
        s = s.with_extra("QDQOpTypePerChannelSupportToAxis", dict(sorted(axes.items())))
        read.append("per-channel axes " + ", ".join(f"{op} {axis}" for op, axis in sorted(axes.items())))
    tensors = {t.name for t in fp32.graph.initializer} | {o for n in fp32.graph.node for o in n.output}
    tensors |= {i.name for i in fp32.graph.input}
    other = {t: q for t, q in found.tensor_types if q != s.activation_type and t in tensors}
    if other:
        user = dict(s.extra("TensorQuantOverrides") or {})
        user.update({t: [{"quant_type": q}] for t, q in sorted(other.items())})
        s = s.with_extra("TensorQuantOverrides", user)
        kinds = sorted(set(other.values()))
        read.append(f"{len(other)} tensor(s) quantized as {'/'.join(kinds)} (TensorQuantOverrides)")
    if found.float_weights:
        s = s.with_extra("AddQDQPairToWeight", True)
        read.append("float weights with their own Q/DQ (AddQDQPairToWeight)")
    if found.dedicated_pairs:
        s = s.with_extra("DedicatedQDQPair", True)
        read.append("a Q/DQ pair per reader (DedicatedQDQPair)")
    return s, read
