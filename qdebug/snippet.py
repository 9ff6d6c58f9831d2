"""The ``quantize_static`` snippet: ready-to-paste Python that rebuilds a proposal's model with plain ORT.

Pure text over plain values (no onnx, no onnxruntime import), so the TUI's
export and ``qdebug propose`` write the same snippet. The caller reads what
needs the model (input names, a fixed batch dimension, float16 nodes to
exclude) and passes it in.
"""

from __future__ import annotations

from collections.abc import Sequence

from qdebug.records import TensorOverride

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
) -> str:
    """Ready-to-paste Python calling ``quantize_static`` with a proposal's settings.

    Its reader reads the calibration data as qdebug did: a ``.npz`` file, a
    folder of them or a ``module:function`` / ``file.py:function`` hook, the
    first ``max_samples`` samples, in batches of ``batch`` (a model's fixed
    batch dimension accepts nothing else). The first version read one file,
    one sample at a time, every sample: it failed on folders and fixed-batch
    models, and built other scales than the proposal's after ``--max-samples``.
    """
    lines = _reader_lines(inputs) + _call_lines(
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
    )
    return "\n".join(lines) + "\n"


def _reader_lines(inputs: Sequence[str]) -> list[str]:
    """The imports and the ``Reader`` that feeds the calibration data to ORT as qdebug read it."""
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
        "def rows(feeds, start, stop=None):  # samples start:stop; a scalar (rank-0) input is fed whole",
        "    return {k: v[start:stop] if v.ndim else v for k, v in feeds.items()}",
        "",
        "",
        "class Reader(CalibrationDataReader):",
        "    def __init__(self, source, batch, max_samples=None):",
        "        def items():",
        "            left = max_samples",
        "            for feeds in calibration_feeds(source):",
        "                n = next((len(v) for v in feeds.values() if v.ndim), 1)  # scalars: one per item",
        "                n = n if left is None else min(n, left)",
        "                yield rows(feeds, 0, n), n",
        "                if left is not None:",
        "                    left -= n",
        "                    if left <= 0:",
        "                        return",
        "",
        "        def batches():  # items joined into whole batches: a fixed batch dimension takes nothing else",
        "            pending, count = [], 0",
        "            for feeds, n in items():",
        "                pending.append(feeds)",
        "                count += n",
        "                if count < batch:",
        "                    continue",
        "                joined = pending[0] if len(pending) == 1 else {",
        "                    k: np.concatenate([p[k] for p in pending]) if v.ndim else v",
        "                    for k, v in pending[0].items()}",
        "                whole = count - count % batch",
        "                for i in range(0, whole, batch):",
        "                    yield rows(joined, i, i + batch)",
        "                pending = [rows(joined, whole)] if count > whole else []",
        "                count -= whole",
        "            if count:",
        "                raise ValueError(f'{count} samples left over do not fill a batch of {batch}')",
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
) -> list[str]:
    """The exclusions, the 16-bit overrides and the ``quantize_static`` call itself."""
    lines = [
        "nodes_to_exclude = [",
        *[f"    {name!r}," for name in nodes_to_exclude],
        "]",
    ]
    extra = ""
    if tensor_overrides:
        lines.append("tensor_overrides = {")
        lines.extend(f"    {o.tensor!r}: [{{{_override_text(o)}}}]," for o in tensor_overrides)
        lines.append("}")
        extra = "\n    extra_options={'TensorQuantOverrides': tensor_overrides},"
    lines += [
        "quantize_static(",
        f"    {model_path!r},",
        "    'model.selective.onnx',",
        f"    Reader({calib_hint!r}, batch={batch}, max_samples={max_samples!r}),",
        "    quant_format=QuantFormat.QDQ,",
        f"    activation_type=QuantType.{activation_type},",
        f"    weight_type=QuantType.{weight_type},",
        f"    per_channel={per_channel},",
        f"    calibrate_method=CalibrationMethod.{_METHOD_NAMES.get(method, 'MinMax')},",
        f"    nodes_to_exclude=nodes_to_exclude,{extra}",
        ")",
    ]
    return lines


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
