"""The numpy engine: every paired tensor copied out of ORT and reduced in float64 numpy.

Exact, and slower than the graph engine. It is the engine when the two models
differ in opset or a tensor's type is unknown, and the graph engine's
fallback for the tensors whose in-graph sums are not finite (NaN, inf). It
also holds the local error's definition, shared by both engines: the
scale/zero-point of each tensor's DequantizeLinear (:func:`local_fake_quant`)
and QuantizeLinear->DequantizeLinear as ORT computes it (:func:`fake_quantize`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import onnx

from qdebug.analysis.build import TensorAcc
from qdebug.data import Batch
from qdebug.graph.match import GraphIndex, TensorPair
from qdebug.graph.reduce import FakeQuant
from qdebug.runtime.capture import SessionConfig, Tap

Arrays = dict[str, np.ndarray]
"""Tensor name -> array: one batch's feeds, or one run's outputs."""

_LOCAL_QTYPES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.UINT16,
}


def local_fake_quant(qdq: onnx.ModelProto, pairs: list[TensorPair]) -> dict[str, FakeQuant]:
    """Per quantized FP32 tensor: the scale/zero-point (and axis) of its DequantizeLinear in ``qdq``."""
    index = GraphIndex(qdq)
    out = {}
    for p in pairs:
        dq = index.producer.get(p.dequant) if p.dequant else None
        if dq is None or len(dq.input) < 2:
            continue
        scale = index.const_array(dq.input[1])
        zp = index.const_array(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if scale is None or (len(dq.input) > 2 and dq.input[2] and zp is None):
            continue
        if zp is not None and index.inits[dq.input[2]].data_type not in _LOCAL_QTYPES:
            continue  # int4/float8 grids: no local error rather than a wrong one
        # DequantizeLinear's axis defaults to 1 for a per-axis (1-D) scale
        axis = next((int(a.i) for a in dq.attribute if a.name == "axis"), 1) if scale.size > 1 else None
        out[p.fp32] = FakeQuant(scale, zp, axis, dq.domain if dq.domain not in ("", "ai.onnx") else "")
    return out


def quant_params(x: np.ndarray, fq: FakeQuant) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x as float32, scale, zero point)``, the parameters shaped to broadcast along ``fq.axis`` (per channel)."""
    x32 = np.asarray(x, dtype=np.float32)
    scale = np.asarray(fq.scale, dtype=np.float32)
    zp = np.asarray(fq.zero_point) if fq.zero_point is not None else np.zeros_like(scale, dtype=np.uint8)
    if fq.axis is not None and scale.ndim == 1 and x32.ndim > 1:
        shape = [1] * x32.ndim
        shape[fq.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    return x32, scale, zp


def fake_quantize(x: np.ndarray, fq: FakeQuant) -> np.ndarray:
    """QuantizeLinear -> DequantizeLinear in numpy, as ORT computes it (float32, round half to even, saturate)."""
    x32, scale, zp = quant_params(x, fq)
    info = np.iinfo(zp.dtype)
    zpf = zp.astype(np.float32)
    q = np.clip(np.rint(x32 / scale) + zpf, info.min, info.max)
    return ((q - zpf) * scale).astype(np.float32)


def _graph_outputs(values: Arrays, names: list[str]) -> Arrays:
    return {n: values[n] for n in names if n in values}


class NumpyPath:
    """Copy every tensor out of ORT and reduce it in float64 numpy (exact; also the NaN fallback)."""

    def __init__(
        self,
        fp32: onnx.ModelProto,
        qdq: onnx.ModelProto,
        scored: list[TensorPair],
        local: dict[str, FakeQuant],
        config: SessionConfig,
    ) -> None:
        self.fp32, self.qdq, self.config, self.scored, self.local = fp32, qdq, config, scored, local
        self._taps: tuple[Tap, Tap, Tap] | None = None

    def taps(self) -> tuple[Tap, Tap, Tap]:
        """The three instrumented sessions, created on first use."""
        if self._taps is None:
            pairs = [p for p in self.scored if p.qdq is not None]
            self._taps = (
                Tap(self.fp32, [p.fp32 for p in self.scored], self.config, what="instrumented FP32 model"),
                Tap(
                    self.qdq,
                    [p.dequant or p.qdq for p in pairs],
                    self.config,
                    what="instrumented quantized model",
                ),
                Tap(
                    self.qdq,
                    [p.dequant for p in pairs if p.dequant is not None],
                    self.config,
                    fake_quant=True,
                    what="fake-quant quantized model",
                ),
            )
        return self._taps

    def main(
        self,
        batch: Batch,
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath | None = None,
        skipped: dict[str, str] | None = None,
        head: bool = False,
    ) -> tuple[Arrays, Arrays]:
        """One batch through the FP32 and deployed sessions; returns (FP32, deployed) graph outputs."""
        return self.measure(batch.feeds, accs, self.scored, {} if skipped is None else skipped, head)

    def measure(
        self,
        feeds: Arrays,
        accs: dict[str, TensorAcc],
        pairs: list[TensorPair],
        skipped: dict[str, str],
        head: bool = False,
    ) -> tuple[Arrays, Arrays]:
        """Summary, local and accumulated error of ``pairs`` for one batch of ``feeds``."""
        fp_tap, dep_tap, _ = self.taps()
        f = fp_tap.run(feeds)
        d = dep_tap.run(feeds)
        for p in pairs:
            ref = f.get(p.fp32)
            if not isinstance(ref, np.ndarray) or ref.dtype.kind != "f":
                if ref is not None:
                    kind = ref.dtype if isinstance(ref, np.ndarray) else f"{type(ref).__name__}-valued"
                    skipped.setdefault(p.fp32, f"{kind} tensor: not a float tensor, not scored")
                continue
            a = accs[p.fp32]
            a.summary.update(ref)
            a.ensure_edges(ref)
            fq = self.local.get(p.fp32)
            if a.local is not None and fq is not None:
                a.local.update(ref, fake_quantize(ref, fq))
            if p.qdq is None:
                continue
            cand = d.get(p.dequant or p.qdq)
            if cand is None or cand.shape != ref.shape:
                skipped.setdefault(p.fp32, "quantized counterpart has another shape: not compared")
                continue
            a.acc.update(ref, cand)
            if head and a.head is not None:
                a.head.update(ref, cand)
        return _graph_outputs(f, fp_tap.graph_outputs), _graph_outputs(d, dep_tap.graph_outputs)

    def fakequant(
        self,
        batch: Batch,
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath | None = None,
        skipped: dict[str, str] | None = None,
    ) -> tuple[Arrays, Arrays]:
        """One batch through the fake-quant session; returns its (FP32, fake-quant) graph outputs."""
        return self.fakequant_pairs(batch.feeds, accs, self.scored)

    def main_batches(
        self,
        batches: Iterable[Batch],
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath,
        skipped: dict[str, str],
        fq_done: int,
    ) -> Iterator[tuple[Batch, Arrays, Arrays]]:
        """``(batch, FP32 outputs, deployed outputs)`` per batch, in order (the graph path's interface)."""
        start = 0
        for batch in batches:
            yield (batch, *self.main(batch, accs, numpy_path, skipped, head=start < fq_done))
            start += batch.size

    def fakequant_batches(
        self,
        batches: Iterable[Batch],
        accs: dict[str, TensorAcc],
        numpy_path: NumpyPath,
        skipped: dict[str, str],
        rows: int | None = None,
    ) -> Iterator[tuple[Batch, Arrays, Arrays]]:
        """``(batch, FP32 outputs, fake-quant outputs)`` per batch, in order (``rows``: as the graph path's)."""
        for batch in batches:
            yield (batch, *self.fakequant(batch, accs, numpy_path, skipped))

    def fakequant_pairs(
        self, feeds: Arrays, accs: dict[str, TensorAcc], pairs: list[TensorPair]
    ) -> tuple[Arrays, Arrays]:
        """FP32 vs fake-quant DQ outputs of ``pairs`` for one batch of ``feeds``; returns both graph outputs."""
        fp_tap, _, fq_tap = self.taps()
        f = fp_tap.run(feeds)
        q = fq_tap.run(feeds)
        for p in pairs:
            a = accs[p.fp32]
            post = q.get(p.dequant) if p.dequant else None
            ref = f.get(p.fp32)
            if a.fakequant is not None and post is not None and ref is not None and ref.shape == post.shape:
                a.fakequant.update(ref, post)
        return _graph_outputs(f, fp_tap.graph_outputs), _graph_outputs(q, fq_tap.graph_outputs)

    def close_fakequant(self) -> None:
        """Nothing to release: the numpy path keeps its sessions for NaN fallbacks."""
