"""Whether a transformed FP32 model still computes what the user's model does, checked on data.

Folding and equalization are exact in real arithmetic and differ by float rounding only (~1e-6 of an
output's range); a difference beyond ``rtol`` means a transform was wrong for this model (or, for
:func:`~qdebug.recipes.equalize.relax_relu6`, that the model's activations do exceed 6), and the recipe
must not be used. Both models run on ORT's CPU provider, single-threaded with basic optimizations only, so
that ORT's own fusions cannot hide or cause a difference.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx

from qdebug.errors import ExitCode, QDebugError

if TYPE_CHECKING:
    import onnxruntime


@dataclass(frozen=True)
class Equivalence:
    """How far the transformed model's outputs are from the original's over the batches compared."""

    max_abs: float
    """Largest absolute difference over every output and sample."""
    max_rel: float
    """Largest over outputs of (that output's max absolute difference / its max-abs in the original): a
    difference relative to the output's range, so a near-zero element does not make it blow up."""
    outputs_compared: int
    """Graph outputs compared (every float or integer output the two models share)."""
    worst_output: str
    """The output whose ``max_rel`` is the largest."""
    rtol: float = 1e-3
    """The largest ``max_rel`` that counts as equivalent."""

    @property
    def ok(self) -> bool:
        """Whether the transformed model computes the same outputs, within ``rtol`` of their range."""
        return self.max_rel <= self.rtol

    def describe(self) -> str:
        """One line for the user."""
        if self.ok:
            return f"outputs match the FP32 model's within {100 * self.max_rel:.2g} % of their range"
        if not math.isfinite(self.max_rel):
            return (
                f"output '{self.worst_output}' differs from the FP32 model's "
                "(missing, another shape, NaN or Inf, or nonzero where it is 0)"
            )
        return f"output '{self.worst_output}' differs by {100 * self.max_rel:.2g} % of its range from the FP32 model's"


def check_equivalent(
    original: onnx.ModelProto,
    transformed: onnx.ModelProto,
    batches: Iterable[dict[str, np.ndarray]],
    *,
    rtol: float = 1e-3,
) -> Equivalence:
    """Run both models on every batch and measure how far their outputs are apart (streaming: only the
    maxima are kept, never the outputs)."""
    with tempfile.TemporaryDirectory(prefix="qdebug-equiv-") as tmp:
        a, b = _session(original, Path(tmp) / "a.onnx"), _session(transformed, Path(tmp) / "b.onnx")
        return _measure(a, b, batches, rtol)


def _measure(
    a: onnxruntime.InferenceSession,
    b: onnxruntime.InferenceSession,
    batches: Iterable[dict[str, np.ndarray]],
    rtol: float,
) -> Equivalence:
    """The difference between the two sessions' outputs over ``batches``."""
    names = [o.name for o in a.get_outputs() if o.name in {x.name for x in b.get_outputs()}]
    missing = [o.name for o in a.get_outputs() if o.name not in names]
    if missing:  # a transform that loses an output is no equivalence, whatever the others say
        return Equivalence(math.inf, math.inf, len(names), missing[0], rtol)
    inputs = [i.name for i in a.get_inputs()]
    diff = dict.fromkeys(names, 0.0)
    scale = dict.fromkeys(names, 0.0)
    seen = 0
    for batch in batches:
        feeds = {k: v for k, v in batch.items() if k in inputs}
        ra = a.run(names, feeds)
        rb = b.run(names, feeds)
        for name, x, y in zip(names, ra, rb, strict=True):
            d, m = _compare(np.asarray(x), np.asarray(y))
            diff[name] = max(diff[name], d)
            scale[name] = max(scale[name], m)
        seen += 1
    if not seen or not names:
        raise QDebugError(
            "cannot check the transformed model against the FP32 model: no " + ("data" if not seen else "outputs"),
            "give calibration data with at least one sample",
            ExitCode.DATA,
        )
    rel = {n: _relative(diff[n], scale[n]) for n in names}
    worst = max(names, key=lambda n: (rel[n], -names.index(n)))
    return Equivalence(
        max_abs=max(diff.values()), max_rel=rel[worst], outputs_compared=len(names), worst_output=worst, rtol=rtol
    )


def require_equivalent(
    original: onnx.ModelProto,
    transformed: onnx.ModelProto,
    batches: Iterable[dict[str, np.ndarray]],
    *,
    recipe: str,
    rtol: float = 1e-3,
) -> Equivalence:
    """:func:`check_equivalent`, raising a user error naming ``recipe`` when the outputs differ."""
    same = check_equivalent(original, transformed, batches, rtol=rtol)
    if not same.ok:
        raise QDebugError(
            f"recipe {recipe} changes the FP32 model's outputs: {same.describe()}",
            f"leave recipe {recipe} out for this model",
            ExitCode.MODEL,
        )
    return same


def _compare(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(max |x - y|, max |x|) in float64; inf when the shapes differ or NaN/Inf appears in one but not the
    other at the same place (a NaN in both is the same output)."""
    if x.shape != y.shape:
        return math.inf, 0.0
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    same_nonfinite = (np.isnan(x64) & np.isnan(y64)) | (np.isinf(x64) & (x64 == y64))
    finite = np.isfinite(x64) & np.isfinite(y64)
    if not np.all(finite | same_nonfinite):
        return math.inf, 0.0
    d = np.abs(x64 - y64)[finite]
    m = np.abs(x64)[np.isfinite(x64)]
    return float(d.max(initial=0.0)), float(m.max(initial=0.0))


def _relative(diff: float, scale: float) -> float:
    """``diff`` over ``scale``; an all-zero output must stay exactly zero."""
    if scale > 0:
        return diff / scale
    return 0.0 if diff == 0 else math.inf


def _session(model: onnx.ModelProto, path: Path) -> onnxruntime.InferenceSession:
    """A CPU session of ``model``: basic optimizations, one thread (deterministic, no fused kernels). A model
    over protobuf's 2 GB limit is saved to ``path`` with external data first."""
    import onnxruntime as ort

    from qdebug.graph.modelfile import is_large, save_with_external_data

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if is_large(model):
        save_with_external_data(model, path)
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
