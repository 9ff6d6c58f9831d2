"""The ``quantize_static`` snippet: ready-to-paste Python that rebuilds a proposal's model with plain ORT.

Pure text over plain values (no onnx, no onnxruntime import), so the TUI's
export and ``qdebug propose`` write the same snippet. The caller reads what
needs the model (input names, a fixed batch dimension, float16 nodes to
exclude) and passes it in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from qdebug.records import TensorOverride
from qdebug.records.proposal import merge_tensor_overrides
from qdebug.records.report import QuantSettings
from qdebug.vocabulary import DYNAMIC_OPS

_METHOD_NAMES = {
    "minmax": "MinMax",
    "entropy": "Entropy",
    "percentile": "Percentile",
    "distribution": "Distribution",
}
"""qdebug's calibration methods by ORT's ``CalibrationMethod`` member name (others: ``MinMax``)."""


def quantize_snippet(
    model_path: str,
    nodes_to_exclude: Sequence[str],
    *,
    method: str,
    per_channel: bool,
    activation_type: str,
    weight_type: str,
    tensor_overrides: Sequence[TensorOverride] = (),
    calib_hint: str = "calib.npz",
    batch: int = 1,
    max_samples: int | None = None,
    inputs: Sequence[str] = (),
    batch_axes: Mapping[str, int | None] | None = None,
    settings: QuantSettings | None = None,
    quantizer: str = "static",
    reduce_range: bool = False,
) -> str:
    """Ready-to-paste Python calling ``quantize_static`` with a proposal's settings.

    ``quantizer`` (a dynamic or mixed recipe's): ``dynamic`` calls ``quantize_dynamic`` alone (no
    calibration data); ``mixed`` calls ``quantize_static`` on every op type but
    :data:`~qdebug.vocabulary.DYNAMIC_OPS` and then ``quantize_dynamic`` of its output on those, as qdebug
    builds it. ``reduce_range``: 7-bit weights in every call (a recipe's, on a CPU whose u8s8 kernels
    saturate; the user's own setting is ``settings``').

    ``settings``: the base quantization (the user's config): its ``reduce_range``, op types,
    ``nodes_to_quantize``, own exclusions (listed first) and ``extra_options`` are written too, the
    proposal's ``tensor_overrides`` merged into its ``TensorQuantOverrides`` as qdebug built them.

    Its reader reads the calibration data as qdebug did: a ``.npz`` file, a
    folder of them or a ``module:function`` / ``file.py:function`` hook, the
    first ``max_samples`` samples, in batches of ``batch`` (a model's fixed
    batch dimension accepts nothing else). The first version read one file,
    one sample at a time, every sample: it failed on folders and fixed-batch
    models, and built other scales than the proposal's after ``--max-samples``. ``batch_axes``: each
    input's batch axis as qdebug read the data (None: the reader finds them from the first item).
    """
    if reduce_range:
        settings = dataclasses.replace(settings or QuantSettings(), reduce_range=True)
    if quantizer == "dynamic":
        return "\n".join(_dynamic_lines(model_path, nodes_to_exclude, per_channel, settings, header=True)) + "\n"
    static_out = "model.static_part.onnx" if quantizer == "mixed" else "model.selective.onnx"
    lines = _reader_lines(inputs, batch_axes) + _call_lines(
        model_path,
        nodes_to_exclude,
        method=method,
        per_channel=per_channel,
        activation_type=activation_type,
        weight_type=weight_type,
        tensor_overrides=tensor_overrides,
        calib_hint=calib_hint,
        batch=batch,
        max_samples=max_samples,
        settings=settings,
        out=static_out,
        mixed=quantizer == "mixed",
    )
    if quantizer == "mixed":
        lines += ["", *_dynamic_lines(static_out, nodes_to_exclude, per_channel, settings, header=False)]
    return "\n".join(lines) + "\n"


REDUCE_RANGE_WHY = "7-bit weights: ORT's advice where u8s8 kernels saturate (no VNNI)"


def _dynamic_lines(
    model_path: str,
    nodes_to_exclude: Sequence[str],
    per_channel: bool,
    settings: QuantSettings | None,
    *,
    header: bool,
) -> list[str]:
    """``quantize_dynamic`` of ``model_path``: alone (``header``: with its imports and exclusions), or as
    a mixed recipe's second pass over the static pass's output, on MatMul, LSTM and Attention only."""
    base = settings or QuantSettings()
    excluded = list(dict.fromkeys([*base.nodes_to_exclude, *nodes_to_exclude]))
    lines = []
    if header:
        lines += [
            "from onnxruntime.quantization import QuantType, quantize_dynamic",
            "",
            "nodes_to_exclude = [",
            *[f"    {name!r}," for name in excluded],
            "]",
        ]
    else:
        lines += ["from onnxruntime.quantization import quantize_dynamic", ""]
    lines += [
        "quantize_dynamic(",
        f"    {model_path!r},",
        "    'model.selective.onnx',",
        *(["    op_types_to_quantize=['MatMul', 'LSTM', 'Attention'],"] if not header else []),
        "    weight_type=QuantType.QInt8,",
        f"    per_channel={per_channel},",
        *([f"    reduce_range=True,  # {REDUCE_RANGE_WHY}"] if base.reduce_range else []),
        "    nodes_to_exclude=nodes_to_exclude,",
        ")",
    ]
    return lines


def _reader_lines(inputs: Sequence[str], batch_axes: Mapping[str, int | None] | None = None) -> list[str]:
    """The imports and the ``Reader`` that feeds the calibration data to ORT as qdebug read it.

    Samples are cut, counted and joined on each input's batch axis (``batch_axes``; without them the
    reader takes axis 0 where the inputs agree on it, else the one size every input has once, as qdebug
    does for a model whose dimensions are unnamed): a streaming model's state ``[2, batch, 128]`` had been
    cut on axis 0, its two layers read as two samples.
    """
    axes = None if batch_axes is None else {k: batch_axes.get(k, 0) for k in inputs}
    return [
        "import importlib",
        "import importlib.util",
        "from pathlib import Path",
        "",
        "import numpy as np",
        "from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,",
        "                                      QuantType, quantize_static)",
        "",
        "",
        f"INPUTS = {list(inputs)!r}  # the model's inputs: other keys (labels, ids) are not fed",
        f"BATCH_AXES = {axes!r}  # each input's batch axis (None: fed whole); None: found from the data",
        "",
        "",
        "def calibration_feeds(source):",
        '    """Feed dicts of a .npz file, a folder of .npz files or a \'module:function\' hook."""',
        "    path = Path(source)",
        "    if path.exists():",
        "        for f in sorted(path.glob('*.npz')) if path.is_dir() else [path]:",
        "            data = np.load(f)",
        "            yield {k: data[k] for k in INPUTS}",
        "        return",
        "    target, name = source.rsplit(':', 1)",
        "    if target.endswith('.py'):",
        "        spec = importlib.util.spec_from_file_location('calibration_hook', target)",
        "        module = importlib.util.module_from_spec(spec)",
        "        spec.loader.exec_module(module)",
        "    else:",
        "        module = importlib.import_module(target)",
        "    items = getattr(module, name)()",
        "    items = iter(items.get_next, None) if isinstance(items, CalibrationDataReader) else items",
        "    for feeds in items:",
        "        yield {k: np.asarray(feeds[k]) for k in INPUTS}",
        "",
        "",
        "def find_axes(feeds):  # each input's batch axis; a scalar (rank-0) input has none: fed whole",
        "    if BATCH_AXES is not None:",
        "        return {k: BATCH_AXES[k] if v.ndim else None for k, v in feeds.items()}",
        "    shapes = [v.shape for v in feeds.values() if v.ndim]",
        "    common = [n for n in set(shapes[0]) if all(s.count(n) == 1 for s in shapes)] if shapes else []",
        "    if len({s[0] for s in shapes}) > 1 and len(common) == 1:  # not all on axis 0: their one shared size",
        "        return {k: v.shape.index(common[0]) if v.ndim else None for k, v in feeds.items()}",
        "    return {k: 0 if v.ndim else None for k, v in feeds.items()}",
        "",
        "",
        "def count(feeds, axes):  # samples in one feed dict (an item with no batch axis is one)",
        "    return next((v.shape[axes[k]] for k, v in feeds.items() if axes[k] is not None), 1)",
        "",
        "",
        "def rows(feeds, axes, start, stop=None):  # samples start:stop, each input cut on its batch axis",
        "    cut = {k: (slice(None),) * axes[k] + (slice(start, stop),) for k in feeds if axes[k] is not None}",
        "    return {k: np.ascontiguousarray(v[cut[k]]) if k in cut else v for k, v in feeds.items()}",
        "",
        "",
        "def join(parts, axes):  # feed dicts joined on each input's batch axis",
        "    return {k: v if axes[k] is None else np.concatenate([p[k] for p in parts], axis=axes[k])",
        "            for k, v in parts[0].items()}",
        "",
        "",
        "class Reader(CalibrationDataReader):",
        "    def __init__(self, source, batch, max_samples=None):",
        "        axes = {}",
        "",
        "        def items():",
        "            left = max_samples",
        "            for feeds in calibration_feeds(source):",
        "                if not axes:  # the first item decides, as qdebug's first file did",
        "                    axes.update(find_axes(feeds))",
        "                n = count(feeds, axes)",
        "                n = n if left is None else min(n, left)",
        "                yield rows(feeds, axes, 0, n), n",
        "                if left is not None:",
        "                    left -= n",
        "                    if left <= 0:",
        "                        return",
        "",
        "        def batches():  # items joined into whole batches: a fixed batch dimension takes nothing else",
        "            pending, total = [], 0",
        "            for feeds, n in items():",
        "                pending.append(feeds)",
        "                total += n",
        "                if total < batch:",
        "                    continue",
        "                joined = pending[0] if len(pending) == 1 else join(pending, axes)",
        "                whole = total - total % batch",
        "                for i in range(0, whole, batch):",
        "                    yield rows(joined, axes, i, i + batch)",
        "                pending = [rows(joined, axes, whole)] if total > whole else []",
        "                total -= whole",
        "            if total:",
        "                raise ValueError(f'{total} samples left over do not fill a batch of {batch}')",
        "",
        "        self._items = batches()",
        "",
        "    def get_next(self):",
        "        return next(self._items, None)",
        "",
        "",
    ]


def _call_lines(
    model_path: str,
    nodes_to_exclude: Sequence[str],
    *,
    method: str,
    per_channel: bool,
    activation_type: str,
    weight_type: str,
    tensor_overrides: Sequence[TensorOverride],
    calib_hint: str,
    batch: int,
    max_samples: int | None,
    settings: QuantSettings | None = None,
    out: str = "model.selective.onnx",
    mixed: bool = False,
) -> list[str]:
    """The exclusions, the overrides, the user's other settings and the ``quantize_static`` call itself
    (``mixed``: a mixed recipe's static pass, on the op types other than :data:`DYNAMIC_OPS`)."""
    base = settings or QuantSettings()
    excluded = list(dict.fromkeys([*base.nodes_to_exclude, *nodes_to_exclude]))
    lines = [
        "nodes_to_exclude = [",
        *[f"    {name!r}," for name in excluded],
        "]",
    ]
    extra = ""
    if base.extra_options:
        lines.extend(_extra_lines(base, tensor_overrides))
        extra = "\n    extra_options=extra_options,"
    elif tensor_overrides:
        lines.append("tensor_overrides = {")
        lines.extend(f"    {o.tensor!r}: [{{{_override_text(o)}}}]," for o in tensor_overrides)
        lines.append("}")
        extra = "\n    extra_options={'TensorQuantOverrides': tensor_overrides},"
    others = [
        *(["    reduce_range=True,"] if base.reduce_range else []),
        *([f"    op_types_to_quantize={list(base.op_types)!r},"] if base.op_types and not mixed else []),
        *(["    op_types_to_quantize=STATIC_OPS,"] if mixed else []),
        *([f"    nodes_to_quantize={list(base.nodes_to_quantize)!r},"] if base.nodes_to_quantize else []),
    ]
    if mixed:  # every op type ORT's quantize_static quantizes (or the user's) but those left to quantize_dynamic
        ops = f"{list(base.op_types)!r}" if base.op_types else "QDQRegistry.keys() | QLinearOpsRegistry.keys()"
        lines = [
            "from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry",
            "",
            f"STATIC_OPS = sorted(set({ops}) - {{{', '.join(map(repr, DYNAMIC_OPS))}}})",
            *lines,
        ]
    lines += [
        "quantize_static(",
        f"    {model_path!r},",
        f"    {out!r},",
        f"    Reader({calib_hint!r}, batch={batch}, max_samples={max_samples!r}),",
        "    quant_format=QuantFormat.QDQ,",
        f"    activation_type=QuantType.{activation_type},",
        f"    weight_type=QuantType.{weight_type},",
        f"    per_channel={per_channel},",
        f"    calibrate_method=CalibrationMethod.{_METHOD_NAMES.get(method, 'MinMax')},",
        *others,
        f"    nodes_to_exclude=nodes_to_exclude,{extra}",
        ")",
    ]
    return lines


def _extra_lines(settings: QuantSettings, tensor_overrides: Sequence[TensorOverride]) -> list[str]:
    """``tensor_overrides`` (the user's merged with the proposal's, as qdebug builds them) and the user's
    ``extra_options`` dict, written as ORT reads them."""
    extras = settings.extra_dict()
    user = extras.pop("TensorQuantOverrides", None)
    merged = merge_tensor_overrides(user, tensor_overrides)  # type: ignore[arg-type]
    lines = []
    if merged or user is not None:
        lines.append("tensor_overrides = {")
        for name, entries in merged.items():
            lines.append(f"    {name!r}: [{', '.join(_entry_text(e) for e in entries)}],")
        lines.append("}")
        extras["TensorQuantOverrides"] = _Raw("tensor_overrides")
    lines.append("extra_options = {")
    lines.extend(f"    {key!r}: {_value_text(value)}," for key, value in extras.items())
    lines.append("}")
    return lines


class _Raw(str):
    """Python source written as it is (a name defined above)."""


def _value_text(value: object) -> str:
    """A JSON value as a Python literal (``True``, ``None``, nested dicts and lists)."""
    if isinstance(value, _Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_value_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    return repr(value)


_NUMPY_TYPES = {"QUInt8": "uint8", "QInt8": "int8", "QUInt16": "uint16", "QInt16": "int16"}


def _entry_text(entry: Mapping[str, object]) -> str:
    """One ``TensorQuantOverrides`` entry (JSON values) as ORT wants it: ``QuantType`` members, float32
    ranges and scales, a typed zero point, ``recv_nodes`` as a set."""
    parts = []
    for key, value in entry.items():
        if key == "quant_type":
            parts.append(f"'quant_type': QuantType.{value}")
        elif key in ("rmin", "rmax", "scale"):
            arr = f"np.array({value!r}, dtype=np.float32)" if isinstance(value, list) else f"np.float32({value!r})"
            parts.append(f"{key!r}: {arr}")
        elif key == "zero_point":
            dtype = _NUMPY_TYPES.get(str(entry.get("quant_type", "")), "int32")
            parts.append(f"'zero_point': np.array({value!r}, dtype=np.{dtype})")
        elif key == "convert" and isinstance(value, dict):
            inner = {k: v for k, v in value.items() if k != "recv_nodes"}
            text = _entry_text(inner)[1:-1]
            if "recv_nodes" in value:
                nodes = sorted(value["recv_nodes"])  # type: ignore[call-overload]
                text += (", " if text else "") + "'recv_nodes': {" + ", ".join(repr(n) for n in nodes) + "}"
            parts.append("'convert': {" + text + "}")
        else:
            parts.append(f"{key!r}: {_value_text(value)}")
    return "{" + ", ".join(parts) + "}"


def _override_text(o: TensorOverride) -> str:
    """The keys of one ``TensorQuantOverrides`` entry, as Python source (ORT wants ranges as arrays)."""
    parts = []
    if o.quant_type:
        parts.append(f"'quant_type': QuantType.{o.quant_type}")
    if o.rmin is not None and o.rmax is not None:
        parts.append(f"'rmin': np.float32({o.rmin!r}), 'rmax': np.float32({o.rmax!r})")
    if o.axis is not None:
        parts.append(f"'axis': {o.axis}")
    if o.reduce_range:
        parts.append("'reduce_range': True")
    return ", ".join(parts)
