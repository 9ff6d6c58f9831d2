"""Layer-wise error of a QDQ model against its FP32 model, streamed batch by batch.

One merged session does the work on every sample (:mod:`qdebug.graph.reduce`):
the FP32 model and the QDQ model *as deployed* -- ORT keeps its integer
fusions (QLinearConv...), so the *accumulated* error (FP32 vs QDQ at each
tensor) is measured on the kernels users ship -- and, per quantized tensor,
the *local* error: the FP32 tensor against QuantizeLinear->DequantizeLinear of
itself with the QDQ model's scale and zero-point, i.e. what this tensor's own
quantization adds, isolated from upstream error.

A second, optional session runs the QDQ model un-optimized (fake-quant) on the
first ``fakequant_samples`` samples: the accumulated error without ORT's
integer kernels. The gap between the two views exposes kernel problems (e.g.
u8s8 saturation on CPUs without VNNI) that fake-quant tools never see.

Each batch is reduced inside ORT to a few sums per tensor and dropped, so
memory is flat in the number of samples; batches are split into capture
chunks whose largest tensor stays cache-sized (:data:`CAPTURE_ELEMENTS`).
Chunks run concurrently, one single-threaded ORT run per core
(:func:`capture_workers`), and are accumulated in order; where chunks start
and end depends only on the model and the batch. So a report depends neither
on which run finishes first nor on the machine's core count.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qdebug.capture import (
    SessionConfig,
    Tap,
    make_session,
    optimize_for_capture,
    release_freed_memory,
    run_session,
)
from qdebug.data import Batch, DataSet, feed_rows, model_input_specs, take_rows
from qdebug.evaluate import worst_output_sqnr
from qdebug.graph.load import save_model
from qdebug.graph.match import GraphIndex, Pairing, TensorPair, subgraph_tensors
from qdebug.graph.ops import DATA_SHAPED_OPS, PERMUTATION_OPS
from qdebug.graph.reduce import (
    SUBSAMPLE_INPUT,
    FakeQuant,
    PairSpec,
    ReductionModel,
    build_reduction_model,
    compatible,
    dot_from_sums,
    elem_types,
    moments_from_sums,
)
from qdebug.metrics import (
    ErrorAccumulator,
    HistogramAccumulator,
    QuantGrid,
    SummaryAccumulator,
    TensorErrorAccumulator,
    grid_for,
    range_edges,
)
from qdebug.progress import Progress
from qdebug.records import (
    KERNEL_GAP_DB,
    ErrorStats,
    NodeRecord,
    NotCaptured,
    QuantParams,
    TensorRecord,
    WeightRecord,
    folded_into,
)

SQNR_CAP_DB = 120.0
"""SQNRs above this count as exact when computing the error a node introduces."""

DEFAULT_FAKEQUANT_SAMPLES = 32
"""Samples the fake-quant view runs on unless told otherwise (it is a diagnostic, not the measurement)."""

SUBSAMPLE_PER_SAMPLE = 256
"""Elements per tensor per sample copied out of ORT for the KL and TUI histograms (every k-th element)."""

CAPTURE_ELEMENTS = 1 << 19
"""Largest tensor (elements) a capture chunk aims for: 2 MiB of float32, so a tensor, its counterpart and
their difference stay in a CPU's last-level cache while they are reduced. On the BERT benchmark model,
chunks of 4 samples (512 K elements) ran 1.3x faster than whole batches of 16 and peaked at 0.3 GB instead
of 0.8 GB (docs/benchmarks.md)."""

MAX_CAPTURE_WORKERS = 4
"""Most capture runs in flight at once (each holds its own chunk's tensors)."""

CHUNK_PIECES = 4
"""A batch with enough work is cut into a multiple of this many chunks, so that up to this many workers
share it evenly (16 rows, chunk 16: four chunks of 4, not one of 16). A constant, not the worker count:
where chunks start and end moves the float32 in-graph sums and the histogram subsamples, and a report must
not depend on the machine's core count or ``--threads`` (tested)."""

MIN_PIECE_ELEMENTS = CAPTURE_ELEMENTS // 8
"""A batch is cut into :data:`CHUNK_PIECES` chunks only if each still holds this many elements of its
largest tensor: below that, the ~3-10 ms each run costs in Python (reading its sums) outweighs another core
(the transformer fixture ran up to 1.4x slower at N = 1000 when its batches of 16 were cut in two), and such
batches run one at a time on ORT's own threads."""

IN_FLIGHT_ELEMENTS = 4 * CAPTURE_ELEMENTS
"""Budget for the largest tensors of all chunks in flight: a model whose chunk is large gets fewer workers,
so the capture's memory does not grow with the number of cores (one chunk of 4 M elements: one worker)."""

READ_AHEAD_BYTES = 1 << 20
"""The capture loads the next batch before the current one is read only if a batch's inputs are this small
(or the batches are too small to keep the workers busy): the data is then not what sets the peak."""


def capture_workers(config: SessionConfig) -> int:
    """How many capture chunks may run at once, each an ORT run with one intra-op thread.

    The merged models run ~3,000 small reductions per chunk. With ORT's
    intra-op pool, each one pays a fork/join across the cores; running whole
    chunks side by side, one thread each, keeps every core busy without that
    synchronization. On the 2-core development machine the BERT benchmark's
    capture took 3.4-3.8 s instead of 4.8-5.7 s (docs/benchmarks.md). Only on
    the CPU provider: other providers keep their own threading. Fewer run once
    the chunks are sized (:data:`IN_FLIGHT_ELEMENTS`, :data:`MIN_PIECE_ELEMENTS`).
    """
    if tuple(config.providers) != ("CPUExecutionProvider",):
        return 1
    cores = config.intra_op_threads or _cpu_count()
    return max(1, min(cores, MAX_CAPTURE_WORKERS))


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, e.g. ``taskset`` or a cpuset; not a CPU quota)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, eq=False)
class LayerErrors:
    """The per-tensor results of :func:`measure_layers`."""

    tensors: tuple[TensorRecord, ...]
    not_captured: tuple[NotCaptured, ...]
    samples: int
    deployed_gap: float
    outputs: ModelOutputs
    engine: str
    fakequant_samples: int = 0
    """Samples that went through the fake-quant view."""
    deployed_head: dict[str, ErrorStats] = dataclasses.field(default_factory=dict)
    """Accumulated (deployed) error over the same first samples as the fake-quant view, per tensor."""
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    """Tensors that share another tensor's statistics (:func:`permutation_aliases`): name -> source."""
    first_batch_sqnr: tuple[float, float] | None = None
    """Worst output SQNR against FP32 on the first rows, (un-instrumented, instrumented) quantized model."""


class _TensorAcc:
    """Accumulators of one FP32 tensor."""

    def __init__(self, quant: QuantParams | None, fallback: tuple[float, float] | None) -> None:
        edges = _edges(quant, fallback)
        self.summary = SummaryAccumulator()
        self.acc = TensorErrorAccumulator(edges)
        self.local = TensorErrorAccumulator(edges) if quant is not None else None
        self.fakequant = ErrorAccumulator() if quant is not None else None
        self.head = ErrorAccumulator() if quant is not None else None
        """The accumulated error over the fake-quant view's samples only (like-for-like kernel gap)."""
        self.deferred_edges = edges is None

    def ensure_edges(self, ref: np.ndarray, lo: float | None = None, hi: float | None = None) -> None:
        """Fix histogram edges from the first batch for tensors with neither a grid nor a calibrated range."""
        if not self.deferred_edges:
            return
        self.deferred_edges = False
        if lo is None or hi is None:
            finite = ref[np.isfinite(ref)]
            if not finite.size:
                return
            lo, hi = float(finite.min()), float(finite.max())
        if math.isfinite(lo) and math.isfinite(hi) and self.acc.histogram is None:
            self.acc.histogram = HistogramAccumulator(range_edges(lo, hi))


def data_dependent_shapes(model: onnx.ModelProto) -> dict[str, str]:
    """Top-level tensors at or after an op of :data:`DATA_SHAPED_OPS` (or a TopK whose k is computed):
    name -> ``"<op> '<node>'"``. Conservative: everything downstream, whatever its shape inference says."""
    constant = {i.name for i in model.graph.initializer}
    constant |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    out: dict[str, str] = {}
    for node in model.graph.node:  # topologically sorted (ONNX requires it)
        origin = next((out[t] for t in node.input if t in out), None)
        computed_k = node.op_type == "TopK" and len(node.input) > 1 and node.input[1] not in constant
        if origin is None and (node.op_type in DATA_SHAPED_OPS or computed_k):
            origin = f"{node.op_type} '{node.name}'"
        if origin is not None:
            out.update((o, origin) for o in node.output if o)
    return out


def _container_values(model: onnx.ModelProto) -> dict[str, str]:
    """Values typed as a sequence, map or optional (``SplitToSequence``...): name -> kind. ORT returns them
    as Python lists or dicts, and the in-graph reductions cannot take them."""
    out = {}
    for vi in (*model.graph.value_info, *model.graph.output):
        kind = vi.type.WhichOneof("value")
        if kind in ("sequence_type", "map_type", "optional_type"):
            out[vi.name] = kind.split("_")[0]
    return out


def _edges(quant: QuantParams | None, rng: tuple[float, float] | None) -> np.ndarray | QuantGrid | None:
    # a user's QDQ model may hold an infinite scale (ORT's quantize_static on an -inf attention mask)
    if quant is not None and math.isfinite(quant.scale) and quant.scale > 0:
        return grid_for(quant)
    if rng is not None and math.isfinite(rng[0]) and math.isfinite(rng[1]):
        return range_edges(rng[0], rng[1])
    return None


@dataclass(frozen=True, eq=False)
class ModelOutputs:
    """Per-batch graph outputs seen during the capture (reused as the task metric when eval == calib)."""

    reference: list[dict[str, np.ndarray]]
    deployed: list[dict[str, np.ndarray]]
    fakequant: list[dict[str, np.ndarray]]
    labels: list[np.ndarray] | None
    fakequant_reference: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    """FP32 outputs of the fake-quant view's own pass: its metric is scored against these, so a data
    hook that yields other samples on each call still compares like with like."""
    fakequant_labels: list[np.ndarray] | None = None
    sizes: list[int] = dataclasses.field(default_factory=list)
    """Samples per batch of ``reference``/``deployed`` (outputs need not be batch-major: NonZero, scalars)."""
    fakequant_sizes: list[int] = dataclasses.field(default_factory=list)


def measure_layers(
    fp32: onnx.ModelProto,
    qdq: onnx.ModelProto,
    pairing: Pairing,
    data: DataSet,
    config: SessionConfig,
    ranges: dict[str, tuple[float, float]] | None = None,
    progress: Progress | None = None,
    *,
    engine: str = "auto",
    fakequant_samples: int | None = DEFAULT_FAKEQUANT_SAMPLES,
) -> LayerErrors:
    """Stream ``data`` through the models and accumulate every tensor's error.

    ``engine="graph"`` computes the reductions inside ORT on merged models
    (:mod:`qdebug.graph.reduce`); ``"numpy"`` copies every tensor out and reduces
    it in numpy (exact float64, slower); ``"auto"`` uses the graph engine when
    both models share an opset and every paired tensor has a known float type.
    ``fakequant_samples`` limits the fake-quant view to the first batches
    covering that many samples (``None``: every sample; ``0``: none).
    """
    ranges = ranges or {}
    accs = {p.fp32: _TensorAcc(p.quant, ranges.get(p.fp32)) for p in pairing.tensors}
    skipped: dict[str, str] = {}
    types = elem_types(fp32)
    containers = _container_values(fp32)
    data_shaped = data_dependent_shapes(fp32)
    for p in pairing.tensors:
        t = types.get(p.fp32)
        if p.fp32 in containers:
            skipped[p.fp32] = f"{containers[p.fp32]} value, not a tensor: not scored"
        elif p.fp32 in data_shaped:
            skipped[p.fp32] = (
                f"its shape depends on the data (after {data_shaped[p.fp32]}): the FP32 and quantized models "
                "may keep different elements, which cannot be compared one to one; not scored"
            )
        elif t is not None and t not in _FLOAT_TYPES:
            skipped[p.fp32] = (
                f"{onnx.TensorProto.DataType.Name(t).lower()} tensor: not a float tensor, not scored"
            )
    scored = [p for p in pairing.tensors if p.fp32 not in skipped]
    aliases = permutation_aliases(fp32, scored)
    measured = [p for p in scored if p.fp32 not in aliases]
    for name, source in aliases.items():
        accs[name] = accs[source]  # the same values in another order: the same statistics, measured once
    scored = measured
    local = local_fake_quant(qdq, scored)
    use_graph = engine == "graph" or (
        engine == "auto" and compatible(fp32, qdq) and all(types.get(p.fp32) in _FLOAT_TYPES for p in scored)
    )
    numpy_path = _NumpyPath(fp32, qdq, scored, local, config)
    fakequant = fakequant_samples is None or fakequant_samples > 0
    path: _NumpyPath | _GraphPath = (
        _GraphPath(fp32, qdq, scored, local, config, fakequant=fakequant) if use_graph else numpy_path
    )
    try:
        outputs, samples, gap, fq_done, first_sqnr = _stream(
            path, numpy_path, data, accs, skipped, qdq, config, progress, fakequant, fakequant_samples
        )
    finally:  # sessions, capture workers and stashed models go on failure and Ctrl-C too
        if isinstance(path, _GraphPath):
            path.close()

    records = _tensor_records(fp32, pairing, accs, skipped, aliases)
    not_captured = [NotCaptured(name, reason) for name, reason in sorted(skipped.items())]
    for name, where in subgraph_tensors(fp32):
        not_captured.append(
            NotCaptured(name, f"inside {where}: ORT cannot expose subgraph tensors as graph outputs")
        )
    engine_used = "graph" if isinstance(path, _GraphPath) else "numpy"
    head = {
        k: a.head.result()
        for k, a in accs.items()
        if k not in aliases and a.head is not None and a.head.count
    }
    return LayerErrors(
        tuple(records),
        tuple(not_captured),
        samples,
        gap,
        outputs,
        engine_used,
        fq_done,
        head,
        aliases,
        first_sqnr,
    )


def _stream(
    path: _NumpyPath | _GraphPath,
    numpy_path: _NumpyPath,
    data: DataSet,
    accs: dict[str, _TensorAcc],
    skipped: dict[str, str],
    qdq: onnx.ModelProto,
    config: SessionConfig,
    progress: Progress | None,
    fakequant: bool,
    fakequant_samples: int | None,
) -> tuple[ModelOutputs, int, float, int]:
    """The fake-quant view, then the main pass over ``data``: (outputs, samples, deployed gap, fq samples)."""
    outputs = ModelOutputs([], [], [], [] if data.has_labels else None, [], [] if data.has_labels else None)
    samples = 0
    gap = 0.0
    first_sqnr = None
    fq_done = 0
    # the fake-quant view first, on its own: its session is gone before the main one exists,
    # so the peak is the larger of the two, not their sum
    if fakequant:
        head_batches = _first_samples(data.batches(), fakequant_samples)
        for batch, ref_out, fq_out in path.fakequant_batches(head_batches, accs, numpy_path, skipped):
            outputs.fakequant.append(fq_out)
            outputs.fakequant_reference.append(ref_out)
            outputs.fakequant_sizes.append(batch.size)
            if outputs.fakequant_labels is not None and batch.labels is not None:
                outputs.fakequant_labels.append(batch.labels)
            fq_done += batch.size
            if progress:
                total = data.n_samples
                if fakequant_samples is not None and total is not None:
                    total = min(total, fakequant_samples)
                progress("fake-quant view", min(fq_done, total or fq_done), total)
            del batch, ref_out, fq_out  # not held while the next batches run
    path.close_fakequant()
    main = path.main_batches(data.batches(), accs, numpy_path, skipped, fq_done)
    for batch, ref_out, dep_out in main:  # not enumerate(): its cached tuple would hold the previous batch
        if samples == 0:  # the un-instrumented QDQ model, once, to show instrumentation changed nothing
            rows = min(batch.size, getattr(path, "chunk", None) or batch.size)
            plain = Tap(qdq, [], config, optimize=True, what="quantized model", arena=False)
            if rows < batch.size:  # chunked: outputs are batch-major (checked by _chunkable)
                first = take_rows(batch.feeds, 0, rows)
                dep_first = {k: v[:rows] for k, v in dep_out.items()}
                ref_first = {k: v[:rows] for k, v in ref_out.items()}
            else:
                first, dep_first, ref_first = batch.feeds, dep_out, ref_out
            plain_out = plain.run(first)
            gap = _deployed_gap(plain_out, dep_first, plain.graph_outputs)
            first_sqnr = (
                worst_output_sqnr([ref_first], [plain_out], plain.graph_outputs),
                worst_output_sqnr([ref_first], [dep_first], plain.graph_outputs),
            )
            del plain, first, dep_first, ref_first, plain_out
            release_freed_memory()
        outputs.reference.append(ref_out)
        outputs.deployed.append(dep_out)
        outputs.sizes.append(batch.size)
        if outputs.labels is not None and batch.labels is not None:
            outputs.labels.append(batch.labels)
        samples += batch.size
        if progress:
            progress("capture", samples, data.n_samples)
        del batch, ref_out, dep_out  # not held while the next batches run
    return outputs, samples, gap, fq_done, first_sqnr


def _first_samples(batches: Iterable[Batch], limit: int | None) -> Iterator[Batch]:
    """The batches that hold the first ``limit`` samples (all with None)."""
    done = 0
    for batch in batches:
        if limit is not None and done >= limit:
            return
        yield batch
        done += batch.size


_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}


def permutation_aliases(fp32: onnx.ModelProto, pairs: list[TensorPair]) -> dict[str, str]:
    """Tensors whose statistics equal another tensor's, so they need not be measured: name -> source.

    The output of a Reshape/Transpose/... holds its input's values in another
    order. When both tensors are quantized with the same parameters (ORT
    quantizes these ops as int8 data movement with the input's scale) or both
    not at all, every statistic qdebug reports -- SQNR, MSE, cosine, max-abs,
    the histograms, min/max/mean/std -- is order-invariant and therefore the
    same. On the BERT benchmark model this is 32 of 150 tensors.
    """
    by_name = {p.fp32: p for p in pairs}
    index = GraphIndex(fp32)
    out: dict[str, str] = {}
    for p in pairs:
        node = index.producer.get(p.fp32)
        if node is None or node.op_type not in PERMUTATION_OPS or node.domain not in ("", "ai.onnx"):
            continue
        src = by_name.get(node.input[0]) if node.input else None
        if src is None or src.folded is not None or p.folded is not None:
            continue
        same_kind = (p.qdq is None) == (src.qdq is None) and (p.dequant is None) == (src.dequant is None)
        if same_kind and p.quant == src.quant:
            out[p.fp32] = out.get(src.fp32, src.fp32)
    return out


def _alias_note(name: str, aliases: dict[str, str] | None) -> str:
    source = (aliases or {}).get(name)
    return f"same values as {source} (data movement): its statistics, measured once" if source else ""


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


def fake_quantize(x: np.ndarray, fq: FakeQuant) -> np.ndarray:
    """QuantizeLinear -> DequantizeLinear in numpy, as ORT computes it (float32, round half to even, saturate)."""
    x32 = np.asarray(x, dtype=np.float32)
    scale = np.asarray(fq.scale, dtype=np.float32)
    zp = np.asarray(fq.zero_point) if fq.zero_point is not None else np.zeros_like(scale, dtype=np.uint8)
    if fq.axis is not None and scale.ndim == 1 and x32.ndim > 1:
        shape = [1] * x32.ndim
        shape[fq.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    info = np.iinfo(zp.dtype)
    zpf = zp.astype(np.float32)
    q = np.clip(np.rint(x32 / scale) + zpf, info.min, info.max)
    return ((q - zpf) * scale).astype(np.float32)


def _graph_outputs(values: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
    return {n: values[n] for n in names if n in values}


class _NumpyPath:
    """Copy every tensor out of ORT and reduce it in float64 numpy (exact; also the NaN fallback)."""

    def __init__(
        self,
        fp32: onnx.ModelProto,
        qdq: onnx.ModelProto,
        scored: list,
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
        self, batch: Batch, accs: dict[str, _TensorAcc], numpy_path=None, skipped=None, head: bool = False
    ):
        """One batch through the FP32 and deployed sessions; returns (FP32, deployed) graph outputs."""
        return self.measure(batch.feeds, accs, self.scored, {} if skipped is None else skipped, head)

    def measure(
        self, feeds, accs: dict[str, _TensorAcc], pairs: list, skipped: dict[str, str], head: bool = False
    ):
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

    def fakequant(self, batch: Batch, accs: dict[str, _TensorAcc], numpy_path=None, skipped=None):
        """One batch through the fake-quant session; returns its (FP32, fake-quant) graph outputs."""
        return self.fakequant_pairs(batch.feeds, accs, self.scored)

    def main_batches(self, batches: Iterable[Batch], accs, numpy_path, skipped, fq_done: int):
        """``(batch, FP32 outputs, deployed outputs)`` per batch, in order (the graph path's interface)."""
        start = 0
        for batch in batches:
            yield (batch, *self.main(batch, accs, numpy_path, skipped, head=start < fq_done))
            start += batch.size

    def fakequant_batches(self, batches: Iterable[Batch], accs, numpy_path, skipped):
        """``(batch, FP32 outputs, fake-quant outputs)`` per batch, in order."""
        for batch in batches:
            yield (batch, *self.fakequant(batch, accs, numpy_path, skipped))

    def fakequant_pairs(self, feeds, accs: dict[str, _TensorAcc], pairs: list):
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


def _finite(stats: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in stats.values())


def _add_pair(err: ErrorAccumulator, ref2: float, n: int, st: dict[str, float]) -> None:
    """Add one batch's in-graph sums of a (reference, candidate) pair to ``err``."""
    dot = dot_from_sums(ref2, st["cand2"], st["noise2"])
    err.add_sums(ref2, st["noise2"], st["cand2"], dot, max(st["dmax"], -st["dmin"]), n)


class _GraphPath:
    """Reductions computed inside ORT: one merged session on every sample, one for the fake-quant view."""

    def __init__(
        self,
        fp32: onnx.ModelProto,
        qdq: onnx.ModelProto,
        scored: list,
        local: dict[str, FakeQuant],
        config: SessionConfig,
        *,
        fakequant: bool = True,
    ) -> None:
        self.scored = scored
        self.config = config
        self._files: dict[str, Path] = {}
        # the optimized models' weights go to files here, next to the merged models that refer to them
        # (ORT maps them while a session lives: where a mapped file cannot be deleted, cleanup must not fail)
        self._dir = tempfile.TemporaryDirectory(prefix="qdebug-capture-", ignore_cleanup_errors=True)
        try:
            self._build(fp32, qdq, scored, local, fakequant)
        except BaseException:  # a model ORT rejects, Ctrl-C: no scratch files left behind
            self._dir.cleanup()
            raise
        release_freed_memory()  # the protos are on disk now: their memory must not add to the sessions' peak
        self._main_sess = None
        self._fq_sess = None
        self.chunk: int | None = None
        self._largest = 0
        self._split_largest = 0
        """The first run's largest tensor per sample: what batches are cut by (fixed, so the cut of a batch
        does not depend on how far the pipeline has read when it is loaded)."""
        self._pending: dict[tuple[str, str], tuple[list, list]] = {}
        self._range: dict[str, tuple[float, float]] = {}
        self.splittable = _chunkable(fp32, qdq)
        self.workers = capture_workers(config)
        """Runs in flight at once; settled after the first run (:meth:`_settle`)."""
        self._settled = False
        self._pool: ThreadPoolExecutor | None = None

    def _build(self, fp32, qdq, scored: list, local: dict[str, FakeQuant], fakequant: bool) -> None:
        """Optimize each side, merge them into the main (and fake-quant) reduction models, stash those."""
        config = self.config
        scratch = Path(self._dir.name)
        cand = [p.dequant or p.qdq for p in scored if p.qdq is not None]
        fo = optimize_for_capture(
            fp32, [p.fp32 for p in scored], config, what="FP32 model", scratch=scratch, tag="fp32-optimized"
        )
        qo = (
            optimize_for_capture(
                qdq, cand, config, what="quantized model", scratch=scratch, tag="qdq-optimized"
            )
            if fo is not None
            else None
        )
        self.preoptimized = fo is not None and qo is not None
        ref_model = fo if self.preoptimized else fp32
        types = (elem_types(fp32), _with_dq_types(qdq, elem_types(qdq)))
        keep = ([o.name for o in fp32.graph.output], [o.name for o in qdq.graph.output])
        specs = [PairSpec(p.fp32, p.fp32, p.dequant or p.qdq, local.get(p.fp32)) for p in scored]
        fq_specs = [PairSpec(p.fp32, p.fp32, p.dequant) for p in scored if p.dequant is not None]
        build = {"ref_types": types[0], "cand_types": types[1], "keep_outputs": keep}
        # both merged models go to files and their protos (and the optimized models) are dropped before any
        # session exists: ORT's copy is then the only one at the peak (60-90 MB less on the BERT model)
        main = build_reduction_model(ref_model, qo if self.preoptimized else qdq, specs, **build)
        self.main_model: ReductionModel = self._stash(main, "main.onnx")
        del main, qo
        self.fq_model: ReductionModel | None = None
        if fakequant:
            names = [p.dequant for p in scored if p.dequant is not None]
            fq = optimize_for_capture(
                qdq,
                names,
                config,
                fake_quant=True,
                what="quantized model",
                scratch=scratch,
                tag="fakequant-optimized",
            )
            # the fake-quant view: the same FP32 side against the QDQ model with ORT's QDQ handling off
            fq_model = build_reduction_model(
                ref_model, fq or qdq, fq_specs, ref_stats=False, with_samples=False, **build
            )
            del fq
            self.fq_model = self._stash(fq_model, "fakequant.onnx")

    def _stash(self, model: ReductionModel, name: str) -> ReductionModel:
        """Write a merged model to this capture's scratch directory; return it without its proto."""
        path = Path(self._dir.name) / name
        save_model(model.model, path)
        self._files[name] = path
        return dataclasses.replace(model, model=None)

    def _open(self, name: str, what: str, **options):
        """A session over a stashed merged model (arena on, node order kept)."""
        threads = 1 if self.workers > 1 else None
        return make_session(
            self._files[name], self.config, what=what, arena=True, keep_order=True, threads=threads, **options
        )

    def fq_sess(self):
        """The fake-quant session, created on first use."""
        if self._fq_sess is None:
            self._fq_sess = self._open("fakequant.onnx", "fake-quant models", optimize=False, fake_quant=True)
        return self._fq_sess

    def main_sess(self):
        """The main session, created on first use (after the fake-quant view is released)."""
        if self._main_sess is None:
            self._main_sess = self._open("main.onnx", "instrumented models", optimize=not self.preoptimized)
        return self._main_sess

    def close_fakequant(self) -> None:
        """Release the fake-quant session before the main session is created."""
        if self._fq_sess is not None:
            self._fq_sess = None
            release_freed_memory()

    def close(self) -> None:
        """Release the sessions and the workers and delete the stashed models."""
        if self._pool is not None:  # chunks still queued (an error, Ctrl-C) are dropped, not run
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._main_sess = self._fq_sess = None
        self._dir.cleanup()
        release_freed_memory()  # the report is built next: it must not stack on the sessions' leftovers

    def main_batches(self, batches: Iterable[Batch], accs, numpy_path: _NumpyPath, skipped, fq_done: int):
        """``(batch, FP32 outputs, deployed outputs)`` per batch, in order.

        A batch's deployed error also goes to ``head`` when it was in the fake-quant view (its first
        ``fq_done`` samples).
        """
        self.main_sess()  # here, not on a worker: two workers must not both create it
        model = self.main_model

        def run(feeds):  # looked up per run: the session is reopened if the workers are turned off
            return run_session(
                self.main_sess(), model.outputs, _with_subsample(feeds), "the instrumented models"
            )

        def use(start, feeds, out):
            return self._use_main(feeds, out, accs, numpy_path, skipped, start < fq_done)

        def joined(item):
            batch, parts = item
            self._flush(accs)
            return batch, _join([r for r, _ in parts]), _join([d for _, d in parts])

        # through map(): no local of this frame holds a yielded batch while the next ones run
        yield from map(joined, self._pipeline(batches, run, use))

    def _queue(self, name: str, kind: str, ref: np.ndarray, cand: np.ndarray) -> None:
        """Histogram samples wait for the end of the data batch: one numpy call per tensor, not per chunk."""
        entry = self._pending.setdefault((name, kind), ([], []))
        entry[0].append(ref)
        entry[1].append(cand)

    def _flush(self, accs: dict[str, _TensorAcc]) -> None:
        for name, (lo, hi) in self._range.items():
            accs[name].ensure_edges(np.empty(0, np.float32), lo, hi)
        self._range.clear()
        for (name, kind), (refs, cands) in self._pending.items():
            target = accs[name].acc if kind == "acc" else accs[name].local
            if target is not None and target.histogram is not None:
                target.histogram.update(np.concatenate(refs), np.concatenate(cands))
        self._pending.clear()

    def fakequant_batches(self, batches: Iterable[Batch], accs, numpy_path: _NumpyPath, skipped):
        """``(batch, FP32 outputs, fake-quant outputs)`` per batch, in order."""
        self.fq_sess()
        model = self.fq_model

        def run(feeds):
            return run_session(self.fq_sess(), model.outputs, _with_subsample(feeds), "the fake-quant models")

        def use(start, feeds, out):
            return self._use_fakequant(feeds, out, accs, numpy_path)

        def joined(item):
            batch, parts = item
            return batch, _join([r for r, _ in parts]), _join([q for _, q in parts])

        yield from map(joined, self._pipeline(batches, run, use))

    def _pipeline(self, batches: Iterable[Batch], run, use) -> Iterator[tuple[Batch, list]]:
        """``(batch, [use(start, chunk, run(chunk)) for its chunks])`` per batch, in order.

        ``run`` (ORT only, thread-safe) goes to the workers. A batch with
        fewer chunks than workers (one sample, or a model whose batches cannot
        be cut) does not leave them idle: the next batches' chunks start while
        its own are read. ``use`` (the accumulation) stays on this thread and
        sees the chunks in order, so the float64 sums are the same whatever
        the timing. ``start``: the samples before the batch. Until the workers
        are settled, the first run is made alone.
        """
        window: deque = deque()
        start = 0
        for batch in batches:
            done, pieces = self._first(batch, start, run, use)
            jobs = [self._pool_for().submit(run, p) if self.workers > 1 else None for p in pieces]
            window.append((batch, start, done, pieces, jobs))
            del done, pieces, jobs  # the window owns them: a finished batch's results must not outlive it
            start += batch.size
            while window and self._must_finish(window):
                yield self._finish(window.popleft(), run, use)
        while window:
            yield self._finish(window.popleft(), run, use)

    def _must_finish(self, window: deque) -> bool:
        """Whether the oldest batch is read now, before the next one is loaded.

        The pipeline reads ahead only as far as the workers need: batches
        with fewer chunks than workers, until the batches behind hold as many;
        a batch that keeps them busy alone, one batch more when its inputs are
        small (the next batch's chunks then start the moment this one's end,
        not after its results are read), and none when they are large (ResNet
        batches of 16: 9.6 MB more at the peak).
        """
        behind = sum(len(entry[3]) for entry in list(window)[1:])
        if self.workers == 1 or len(window) > self.workers or behind >= self.workers:
            return True
        oldest = window[0]
        if len(oldest[3]) < self.workers:
            return False
        small = sum(v.nbytes for v in oldest[0].feeds.values()) <= READ_AHEAD_BYTES
        return not (small and len(window) == 1)

    @staticmethod
    def _finish(entry, run, use) -> tuple[Batch, list]:
        batch, start, done, pieces, jobs = entry
        for i, piece in enumerate(pieces):
            job, jobs[i] = jobs[i], None  # each run's outputs go as soon as they are read, not with the batch
            done.append(use(start, piece, job.result() if job is not None else run(piece)))
            del job
        return batch, done

    def _first(self, batch: Batch, start: int, run, use) -> tuple[list, list]:
        """(chunks already used, chunks to run) of ``batch``; the very first run is made here, alone."""
        feeds, n = batch.feeds, batch.size
        done = []
        if not self._settled:
            # one sample measures the model; a batch that cannot be cut runs whole
            rows = 1 if self.splittable else n
            first = take_rows(feeds, 0, rows)
            done.append(use(start, first, run(first)))
            self._settle(n)
            if rows == n:
                return done, []
            feeds, n = take_rows(feeds, rows), n - rows
        return done, list(_split(feeds, self._piece_rows(n)))

    def _settle(self, n: int) -> None:
        """After the first run: chunk rows from its largest tensor, then how many workers that is worth."""
        largest = self._split_largest = max(self._largest, 1)
        if self.splittable:
            self.chunk = max(1, CAPTURE_ELEMENTS // largest)
        per_run = (min(self._piece_rows(n), n) if self.splittable else n) * largest
        workers = self.workers
        if per_run < MIN_PIECE_ELEMENTS:  # too little work per run: the Python side would be the bottleneck
            workers = 1
        else:  # the runs in flight together stay within the memory budget
            workers = min(workers, max(1, IN_FLIGHT_ELEMENTS // per_run))
        if workers == 1 and self.workers > 1:
            # the open session was made single-threaded for the workers: reopen it with ORT's threads
            self._main_sess = self._fq_sess = None
            release_freed_memory()
        self.workers = workers
        self._settled = True

    def _piece_rows(self, n: int) -> int:
        """Rows per chunk for a batch of ``n``: at most ``self.chunk``; a multiple of :data:`CHUNK_PIECES`
        chunks when each keeps enough work. Depends on the model and the batch only, never on the workers."""
        if not (self.splittable and self.chunk):
            return n
        pieces = -(-n // self.chunk)
        if n * self._split_largest >= MIN_PIECE_ELEMENTS * CHUNK_PIECES:
            pieces = min(n, -(-pieces // CHUNK_PIECES) * CHUNK_PIECES)
        return -(-n // max(pieces, 1))

    def _pool_for(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="qdebug-capture")
        return self._pool

    def _note_size(self, counts: list[float], feeds) -> None:
        rows = feed_rows(feeds)
        self._largest = -(-int(max(counts, default=0)) // max(rows, 1))

    def _use_main(self, feeds, out, accs, numpy_path, skipped, head=False):
        st = self.main_model.stats(out)
        bad = []
        for p in self.scored:
            ref = st["ref"][p.fp32]
            acc = st["acc"].get(p.fp32)
            loc = st["local"].get(p.fp32)
            if not (_finite(ref) and (acc is None or _finite(acc)) and (loc is None or _finite(loc))):
                bad.append(p)
                continue
            a = accs[p.fp32]
            n = int(ref["count"])
            mean, m2 = moments_from_sums(n, ref["rsum"], ref["ref2"])
            a.summary.add_moments(n, mean, m2, ref["rmin"], ref["rmax"])
            names = self.main_model.samples[p.fp32]
            if a.deferred_edges:  # edges from the whole first batch, fixed when its samples are flushed
                lo, hi = self._range.get(p.fp32, (math.inf, -math.inf))
                self._range[p.fp32] = (min(lo, ref["rmin"]), max(hi, ref["rmax"]))
            if acc is not None:
                _add_pair(a.acc.error, ref["ref2"], n, acc)
                if head and a.head is not None:
                    _add_pair(a.head, ref["ref2"], n, acc)
                if a.acc.histogram is not None or a.deferred_edges:
                    self._queue(p.fp32, "acc", out[names["r"]], out[names["c"]])
            if loc is not None and a.local is not None:
                _add_pair(a.local.error, ref["ref2"], n, loc)
                if a.local.histogram is not None:
                    self._queue(p.fp32, "local", out[names["r"]], out[names["l"]])
        self._note_size([r["count"] for r in st["ref"].values()], feeds)
        if bad:
            numpy_path.measure(feeds, accs, bad, skipped, head)
        ref_out = {orig: out[name] for name, orig in self.main_model.ref_outputs.items()}
        dep_out = {orig: out[name] for name, orig in self.main_model.cand_outputs.items()}
        return ref_out, dep_out

    def _use_fakequant(self, feeds, out, accs, numpy_path):
        st = self.fq_model.stats(out)
        bad = []
        for p in self.scored:
            acc = st["acc"].get(p.fp32)
            a = accs[p.fp32]
            if acc is None or a.fakequant is None:
                continue
            ref = st["ref"][p.fp32]
            if _finite(ref) and _finite(acc):
                _add_pair(a.fakequant, ref["ref2"], int(ref["count"]), acc)
            else:
                bad.append(p)
        self._note_size([r["count"] for r in st["ref"].values()], feeds)
        if bad:
            numpy_path.fakequant_pairs(feeds, accs, bad)
        ref_out = {orig: out[name] for name, orig in self.fq_model.ref_outputs.items()}
        return ref_out, {orig: out[name] for name, orig in self.fq_model.cand_outputs.items()}


def _with_dq_types(model: onnx.ModelProto, types: dict[str, int]) -> dict[str, int]:
    """``types`` plus DequantizeLinear outputs, whose element type is their scale's.

    ORT's quantizer writes no value_info for the Q/DQ tensors it adds; without
    this, every compared DQ output would be cast (copied) to float first.
    """
    out = dict(types)
    inits = {i.name: i.data_type for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and len(node.input) > 1 and node.input[1] in inits:
            out.setdefault(node.output[0], inits[node.input[1]])
    return out


def _with_subsample(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rows = feed_rows(feeds)
    target = SUBSAMPLE_PER_SAMPLE * max(int(rows), 1)
    return {**feeds, SUBSAMPLE_INPUT: np.array(target, dtype=np.int64)}


def _chunkable(fp32: onnx.ModelProto, qdq: onnx.ModelProto) -> bool:
    """Whether batches may be cut into capture chunks without changing any number.

    Samples must be independent along axis 0: every graph input and output of
    both models has the inputs' symbolic batch dimension first, and no float
    tensor of the FP32 model is a scalar or has a fixed first dimension (a
    reduction over the batch, e.g. a mean used as a branch condition, would
    see a chunk instead of the batch). Unknown shapes count as not chunkable.
    Rank-0 inputs are one value for the whole batch, fed whole to every chunk.
    """
    inits = {i.name for i in fp32.graph.initializer}
    scalars = {s.name for s in model_input_specs(fp32) if s.scalar}
    inputs = [v for v in fp32.graph.input if v.name not in inits and v.name not in scalars]
    batch = {_first_dim(v) for v in inputs}
    if not inputs or len(batch) != 1 or not next(iter(batch)):
        return False
    symbol = next(iter(batch))
    for model in (fp32, qdq):
        for v in model.graph.output:
            if _first_dim(v) != symbol:
                return False
    for v in fp32.graph.value_info:
        t = v.type.tensor_type
        if t.elem_type in _FLOAT_TYPES and t.HasField("shape"):
            if not t.shape.dim or t.shape.dim[0].HasField("dim_value"):
                return False
    return True


def _first_dim(value: onnx.ValueInfoProto) -> str:
    """The symbolic name of a value's first dimension ("" when static, unnamed or unknown)."""
    t = value.type.tensor_type
    if not value.type.HasField("tensor_type") or not t.HasField("shape") or not t.shape.dim:
        return ""
    d = t.shape.dim[0]
    return d.dim_param if d.HasField("dim_param") else ""


def _split(feeds: dict[str, np.ndarray], size: int):
    n = feed_rows(feeds)
    if n <= size:
        yield feeds
        return
    for start in range(0, n, size):
        yield take_rows(feeds, start, start + size)


def _join(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Graph outputs of consecutive chunks of one batch, concatenated back along the batch axis."""
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def kernel_gap_notes(
    tensors: tuple[TensorRecord, ...],
    same_samples: dict[str, ErrorStats] | None = None,
    limit: int = 3,
    skip: Collection[str] = (),
    nodes: Sequence[NodeRecord] = (),
) -> list[str]:
    """Notes naming where ORT's deployed integer kernels start to lose much more than fake-quant.

    ``same_samples`` holds the deployed error over the samples the fake-quant
    view saw (:attr:`LayerErrors.deployed_head`), so both sides of the gap
    cover the same data; without it the full-run ``accumulated`` is used.
    ``skip``: tensors not to count (e.g. a Reshape of a tensor already counted).
    With ``nodes``, a gap its producer's inputs already carry is inherited, not
    started there: the note names the nodes where the gap first opens (it had
    named a LeakyRelu and a Split three nodes below the Conv whose u8s8 kernel
    lost the precision, and told the user to keep those out of INT8).
    """
    gaps: dict[str, tuple[float, TensorRecord, ErrorStats]] = {}
    measured: dict[str, float] = {}
    for t in tensors:
        deployed = (same_samples or {}).get(t.name, t.accumulated)
        if deployed is None or t.accumulated_fakequant is None:
            continue
        gap = t.accumulated_fakequant.sqnr_db - deployed.sqnr_db
        if not math.isfinite(gap):
            continue
        measured[t.name] = gap
        if gap > KERNEL_GAP_DB and t.name not in skip:
            gaps[t.name] = (gap, t, deployed)
    if not gaps:
        return []
    inputs_of = {n.name: n.inputs for n in nodes}
    producer_of = {o: n.name for n in nodes for o in n.outputs}

    seen: dict[tuple[str, int], float] = {}

    def upstream(name: str, hops: int = 6) -> float:
        """The gap a tensor carries; through tensors without both views (an activation ORT folded into its
        producer), the largest of the nearest ones above it (memoized: wide fan-in would be exponential)."""
        if name in measured:
            return measured[name]
        if hops == 0 or name not in producer_of:
            return 0.0
        key = (name, hops)
        if key not in seen:
            seen[key] = max((upstream(i, hops - 1) for i in inputs_of[producer_of[name]]), default=0.0)
        return seen[key]

    def opened(gap: float, t: TensorRecord) -> float:
        """The part of ``t``'s gap its producer adds (all of it without node records)."""
        before = [upstream(i) for i in inputs_of.get(t.producer or "", ())]
        return gap - max(before, default=0.0)

    starts = sorted(
        ((opened(g, t), g, t, d) for g, t, d in gaps.values() if opened(g, t) > KERNEL_GAP_DB),
        key=lambda s: -s[0],
    ) or sorted(((g, g, t, d) for g, t, d in gaps.values()), key=lambda s: -s[0])
    shown = starts[:limit]
    folded = folded_into(nodes, tensors)

    def origin(t: TensorRecord) -> tuple[str | None, str]:
        """The node whose kernel made ``t`` (the producer an activation was folded into), and how to say it."""
        src = folded.get(t.producer or "")
        if src is not None:  # a Relu ORT folded into its producer's output Q: the producer's kernel
            return src, f" (from {src}, {t.producer} folded into it)"
        return t.producer, f" (from {t.producer})" if t.producer else ""

    where = ", ".join(
        f"{t.name}{origin(t)[1]}: {d.sqnr_db:.1f} dB deployed vs {t.accumulated_fakequant.sqnr_db:.1f} dB fake-quant"
        for _, _, t, d in shown
    )
    inherited = len(gaps) - len(starts)
    rest = f"; {inherited} tensor(s) downstream inherit it" if nodes and inherited > 0 else ""
    producers = ", ".join(dict.fromkeys(o for o in (origin(t)[0] for _, _, t, _ in shown) if o)) or "those nodes"
    return [
        f"deployed INT8 kernels lose more than the QDQ graph's own rounding explains at {len(gaps)} tensor(s); "
        f"the gap opens at {where}{rest}. On x86 CPUs without VNNI, u8s8 MatMul/Conv kernels can saturate "
        f"16-bit intermediates (ORT's documented U8S8 saturation): re-quantize with --weight-type QUInt8 "
        f"(U8U8) or keep {producers} out of INT8"
    ]


CONCAT_RANGE_RATIO = 50.0
"""Concat inputs whose quantization ranges differ by more than this share one scale badly."""


def _qspan(t: TensorRecord) -> float:
    """Width of the range a uint8 scale must cover (min/max with 0 included, as ORT's calibration does)."""
    assert t.summary is not None
    return max(t.summary.max, 0.0) - min(t.summary.min, 0.0)


def concat_range_notes(fp32: onnx.ModelProto, tensors: tuple[TensorRecord, ...]) -> list[str]:
    """Notes naming Concat outputs whose inputs' ranges differ by > :data:`CONCAT_RANGE_RATIO`.

    One scale for the concatenated tensor is sized by the widest input, so a narrow
    input (0-1 class scores next to pixel box coordinates) keeps only a few levels.
    """
    by_name = {t.name: t for t in tensors}
    notes = []
    for node in fp32.graph.node:
        if node.op_type != "Concat" or not node.output or node.output[0] not in by_name:
            continue
        parts = [by_name[i] for i in node.input if i in by_name and by_name[i].summary is not None]
        spans = [(_qspan(t), t) for t in parts if math.isfinite(_qspan(t)) and _qspan(t) > 0]
        if len(spans) < 2:
            continue
        lo_span, small = min(spans, key=lambda x: x[0])
        hi_span = max(x[0] for x in spans)
        if hi_span <= CONCAT_RANGE_RATIO * lo_span:
            continue
        out = by_name[node.output[0]]
        detail = ""
        if out.quant is not None and out.quant.scale > 0:
            detail = (
                f"; its shared scale {out.quant.scale:.4g} leaves {small.name} about "
                f"{lo_span / out.quant.scale:.1f} quantization level(s)"
            )
        if out.local is not None:
            detail += f"; local SQNR of {out.name}: {out.local.sqnr_db:.1f} dB"
        ranges = ", ".join(f"{t.name} [{t.summary.min:.4g}, {t.summary.max:.4g}]" for t in parts if t.summary)
        notes.append(
            f"Concat {node.name} joins inputs whose ranges differ by {hi_span / lo_span:.0f}x ({ranges}): "
            f"one scale for {out.name} wipes out the small one{detail}. Keep {out.name} in float (exclude "
            f"{node.name} and its quantized neighbours), give it 16-bit activations, or concatenate after "
            "dequantizing"
        )
    return notes


COLLAPSED_SHARE = 0.5
"""A quantized tensor with at least this share of its values in one quantization step has lost them."""

COLLAPSE_INTRODUCED_DB = 20.0
"""...when a consumer then introduces at least this much error (the damage shows downstream)."""


def folded_activation_notes(nodes: tuple[NodeRecord, ...], tensors: tuple[TensorRecord, ...]) -> list[str]:
    """One note for the activations ORT folded into their producer's output quantization.

    The error of that Q/DQ then shows at the activation (ranked by the summary, but not excludable
    itself), while the producer shows no numbers at all: a walk-through saw a Relu ranked worst and
    propose keep a LayerNormalization the summary never named.
    """
    pairs = [f"{src} -> {act}" for act, src in folded_into(nodes, tensors).items()]
    if not pairs:
        return []
    shown = ", ".join(pairs[:4]) + ("..." if len(pairs) > 4 else "")
    return [
        f"ORT folded {len(pairs)} activation(s) into the quantization of their producer's output ({shown}): "
        "that Q/DQ's error shows at the activation, which cannot be kept FP32 by itself; keep the producer FP32 "
        "to remove it"
    ]


def collapsed_range_notes(tensors: tuple[TensorRecord, ...], nodes: tuple[NodeRecord, ...]) -> list[str]:
    """Notes naming tensors whose range is set by a few huge values (an additive mask of -1e9): most values
    share one quantization step, which SQNR hides (the huge values carry nearly all the energy), and the
    error first shows in a consumer (the Softmax), which the ranking would blame instead."""
    by_node = {n.name: n for n in nodes}
    notes = []
    for t in tensors:
        h, q = t.histogram, t.quant
        if h is None or q is None or not (math.isfinite(q.scale) and q.scale > 0) or t.summary is None:
            continue
        total = sum(h.ref_counts)
        if not total or max(h.ref_counts) < COLLAPSED_SHARE * total:
            continue
        hurt = [by_node[c] for c in t.consumers if c in by_node]
        hurt = [
            n for n in hurt if math.isfinite(n.introduced_db) and n.introduced_db >= COLLAPSE_INTRODUCED_DB
        ]
        if not hurt:
            continue
        worst = max(hurt, key=lambda n: n.introduced_db)
        sqnr = f"{t.accumulated.sqnr_db:.1f} dB" if t.accumulated is not None else "fine"
        notes.append(
            f"{t.name}: {max(h.ref_counts) / total:.0%} of its values fall in one quantization step (scale "
            f"{q.scale:.3g} for the range [{t.summary.min:.3g}, {t.summary.max:.3g}]), although its SQNR looks "
            f"{sqnr} (the largest values carry the energy); {worst.name} ({worst.op_type}) then introduces "
            f"{worst.introduced_db:.1f} dB. A range set by outliers such as mask values of -1e9 erases the other "
            f"values: keep {t.producer or t.name} and {worst.name} out of quantization"
        )
    return notes


def structure_notes(fp32: onnx.ModelProto, qdq: onnx.ModelProto, quantized_nodes: set[str]) -> list[str]:
    """What ORT's static quantizer leaves in float by construction: subgraphs and recurrent ops."""
    notes = []

    def count(graph: onnx.GraphProto, op: str | None = None) -> int:
        total = 0
        for n in graph.node:
            total += op is None or n.op_type == op
            for attr in n.attribute:
                for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                    total += count(sub, op)
        return total

    q_inside = sum(
        count(sub, "QuantizeLinear")
        for n in qdq.graph.node
        for attr in n.attribute
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
    )
    constants = {i.name for i in fp32.graph.initializer}
    for node in fp32.graph.node:
        subs = [
            (attr.name, sub)
            for attr in node.attribute
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs))
        ]
        if not subs:
            continue
        inner = sum(count(g) for _, g in subs)
        if q_inside == 0:
            extra = ""
            if node.op_type == "If" and node.input and node.input[0] in constants:
                extra = "; its condition is a constant: --inline-constant-if inlines the taken branch"
            elif node.op_type == "If":
                extra = (
                    "; its condition is computed at run time, so it cannot be inlined"
                    " (with a constant condition, --inline-constant-if inlines the taken branch)"
                )
            notes.append(
                f"{node.op_type} node {node.name} holds {inner} node(s) in {', '.join(a for a, _ in subs)} "
                f"that stay FP32: ORT's quantizer inserts no QuantizeLinear/DequantizeLinear inside subgraphs{extra}; "
                "their tensors are listed in not_captured"
            )
    recurrent = ("LSTM", "GRU", "RNN")
    rnn = [n for n in fp32.graph.node if n.op_type in recurrent and n.name not in quantized_nodes]
    if rnn:
        names = ", ".join(f"{n.name} ({n.op_type})" for n in rnn)
        notes.append(
            f"recurrent node(s) {names} stay FP32: ORT's static quantizer does not quantize LSTM/GRU/RNN "
            "(quantize_dynamic turns LSTM into DynamicQuantizeLSTM); their outputs are still measured, and "
            "the error reaching them comes from upstream quantized nodes"
        )
    return notes


def instrumentation_notes(layers: LayerErrors) -> list[str]:
    """A note when instrumenting the quantized model changed how ORT runs it, not just what it exposes.

    Exposing DequantizeLinear outputs keeps ORT's usual integer fusions, but not every one: with int8
    activations (S8S8, ActivationSymmetric), ORT stops fusing a Conv whose DQ output is a graph output,
    so the instrumented model computed in float what the deployed one computes in int8. The per-layer
    numbers then miss the deployed loss (39.7 dB per layer against 13.0 dB at the deployed output, a
    17.5-point drop no layer explained, and no note).
    """
    if layers.first_batch_sqnr is None:
        return []
    deployed, instrumented = layers.first_batch_sqnr
    finite = math.isfinite(deployed) and math.isfinite(instrumented)
    if not finite or instrumented - deployed <= KERNEL_GAP_DB:
        return []
    return [
        f"the deployed quantized model's outputs are worse than the instrumented one's ({deployed:.1f} against "
        f"{instrumented:.1f} dB SQNR on the first batch): exposing its tensors changed how ORT fuses its integer "
        "kernels (int8 activations, S8S8, do this), so the per-layer numbers describe un-fused kernels and "
        "miss part of the deployed loss (uint8 activations, ORT's default, keep the fusions)"
    ]


def _deployed_gap(
    plain: dict[str, np.ndarray], instrumented: dict[str, np.ndarray], outputs: list[str]
) -> float:
    gap = 0.0
    for name in outputs:
        a, b = plain.get(name), instrumented.get(name)
        if a is None or b is None or a.dtype.kind != "f" or a.shape != b.shape:
            continue
        gap = max(gap, float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0)
    return gap


def _tensor_records(
    fp32: onnx.ModelProto,
    pairing: Pairing,
    accs: dict[str, _TensorAcc],
    skipped: dict[str, str],
    aliases: dict[str, str] | None = None,
) -> list[TensorRecord]:
    index = GraphIndex(fp32)
    depth = node_depths(fp32)
    out = []
    for p in pairing.tensors:
        a = accs[p.fp32]
        summary = a.summary.result()
        if summary.count == 0:
            if p.fp32 not in skipped and p.note:
                skipped[p.fp32] = p.note
            continue
        producer = index.producer.get(p.fp32)
        acc_stats = a.acc.result() if (a.acc is not None and p.qdq is not None and _has_data(a.acc)) else None
        local = a.local.result() if (a.local is not None and _has_data(a.local)) else None
        hist = a.acc.histogram_result() if (a.acc is not None and _has_data(a.acc)) else None
        out.append(
            TensorRecord(
                name=p.fp32,
                producer=producer.name if producer is not None else None,
                consumers=tuple(n.name for n in index.consumers.get(p.fp32, [])),
                depth=depth.get(producer.name, 0) if producer is not None else 0,
                summary=summary,
                quant=p.quant,
                local=local,
                accumulated=acc_stats,
                histogram=hist,
                quantized_name=p.dequant or p.qdq,
                note=p.note or skipped.get(p.fp32, "") or _alias_note(p.fp32, aliases),
                accumulated_fakequant=(
                    a.fakequant.result() if a.fakequant is not None and a.fakequant.count else None
                ),
            )
        )
    return out


def _has_data(acc: TensorErrorAccumulator) -> bool:
    return acc.error.result().count + acc.error.result().nonfinite > 0


def node_depths(model: onnx.ModelProto) -> dict[str, int]:
    """Topological depth of every node (1 + deepest producer of its inputs; graph inputs are 0)."""
    producer_depth: dict[str, int] = {}
    depths = {}
    for node in model.graph.node:
        d = 1 + max((producer_depth.get(i, 0) for i in node.input if i), default=0)
        depths[node.name] = d
        for o in node.output:
            producer_depth[o] = d
    return depths


def _worst(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return min(finite) if finite else math.nan


def _nsr_db(sqnr: float) -> float:
    """Noise-to-signal in dB with SQNR capped at :data:`SQNR_CAP_DB` (exact counts as the cap)."""
    return -min(sqnr, SQNR_CAP_DB)


def node_records(
    fp32: onnx.ModelProto,
    tensors: tuple[TensorRecord, ...],
    quantized_nodes: set[str],
    name_map: dict[str, str],
) -> tuple[NodeRecord, ...]:
    """Per-node error: worst output SQNRs and the error the node introduces.

    ``introduced_db`` = accumulated SQNR at the node's worst float input minus
    at its worst float output (both capped at 120 dB, so an exact input counts
    as 120 dB). Positive: the node makes the error worse.
    """
    from qdebug.calibrate import op_types_to_quantize

    ops = set(op_types_to_quantize())
    by_name = {t.name: t for t in tensors}
    index = GraphIndex(fp32)
    depth = node_depths(fp32)
    out = []
    for node in fp32.graph.node:
        outs = [by_name[o] for o in node.output if o in by_name]
        acc_out = _worst([t.accumulated.sqnr_db for t in outs if t.accumulated])
        acc_in = _worst([_upstream_sqnr(i, by_name, index) for i in node.input if i and i not in index.inits])
        local = _worst([t.local.sqnr_db for t in outs if t.local])
        if math.isnan(acc_out):
            introduced = added = math.nan
        else:
            in_db = SQNR_CAP_DB if math.isnan(acc_in) else acc_in
            introduced = _nsr_db(acc_out) - _nsr_db(in_db)
            delta = 10 ** (_nsr_db(acc_out) / 10) - 10 ** (_nsr_db(in_db) / 10)
            added = 10 * math.log10(delta) if delta > 0 else -math.inf
        # accumulated, not local: binned by level, a tensor's own Q/DQ leaves KL at ~0 unless it clips, and
        # the column read 0 everywhere; the shift from FP32 at the node's output is what KL should show here
        kls = [t.accumulated.kl for t in outs if t.accumulated and not math.isnan(t.accumulated.kl)]
        out.append(
            NodeRecord(
                name=node.name,
                original_name=name_map.get(node.name, node.name),
                op_type=node.op_type,
                inputs=tuple(node.input),
                outputs=tuple(node.output),
                depth=depth[node.name],
                quantized=node.name in quantized_nodes,
                local_sqnr_db=local,
                accumulated_sqnr_db=acc_out,
                introduced_db=introduced,
                kl=max(kls) if kls else math.nan,
                domain=node.domain,
                added_noise_db=added,
                excludable=_excludable(node, quantized_nodes, ops),
            )
        )
    return tuple(out)


def _excludable(node: onnx.NodeProto, quantized_nodes: set[str], ops: set[str]) -> bool:
    """ORT quantizes the node's op type (default domain) and did quantize it: excluding it changes the model."""
    return node.name in quantized_nodes and node.op_type in ops and not node.domain.startswith("com.")


def _upstream_sqnr(tensor: str, by_name: dict[str, TensorRecord], index: GraphIndex, hops: int = 4) -> float:
    """Accumulated SQNR of ``tensor``, or of the nearest upstream tensors that have one.

    A tensor with no quantized counterpart (e.g. a Conv output whose Relu ORT
    folded away) would otherwise look exact and make its consumer look guilty
    of all the error the pair introduced.
    """
    rec = by_name.get(tensor)
    if rec is not None and rec.accumulated is not None:
        return rec.accumulated.sqnr_db
    producer = index.producer.get(tensor)
    if producer is None or hops == 0:
        return math.nan
    return _worst(
        [_upstream_sqnr(i, by_name, index, hops - 1) for i in producer.input if i and i not in index.inits]
    )


def quantized_node_names(qdq: onnx.ModelProto, pairing: Pairing) -> set[str]:
    """FP32 nodes whose QDQ counterpart computes on quantized values: ORT quantizes their op type and they
    read or write a Q/DQ tensor.

    Touching Q/DQ is not enough: a float LSTM, Cast, ReduceMean or contrib op reads the DQ output its
    quantized producer left, and its output is quantized for a quantized consumer -- the same pattern a
    quantized node has, so only the op type tells them apart (ORT runs no integer kernel for an op
    outside its quantizer's registries). Every node touching Q/DQ had counted: an LSTM showed as quantized
    and the recurrent-op note was never written.
    """
    from qdebug.calibrate import op_types_to_quantize

    ops = set(op_types_to_quantize())
    qi = GraphIndex(qdq)
    qnodes = {n.name: n for n in qdq.graph.node}
    out = set()
    for fname, qname in pairing.node_map:
        node = qnodes.get(qname)
        if node is None or node.op_type not in ops:
            continue
        reads = any(qi.producer.get(i) is not None and qi.is_dq(qi.producer[i]) for i in node.input if i)
        writes = any(any(qi.is_q(c) for c in qi.consumers.get(o, [])) for o in node.output if o)
        if reads or writes:
            out.add(fname)
    return out


def weight_records(fp32: onnx.ModelProto, qdq: onnx.ModelProto, pairing: Pairing) -> tuple[WeightRecord, ...]:
    """FP32 initializer vs dequantized integer initializer, per tensor and per channel."""
    fi, qi = GraphIndex(fp32), GraphIndex(qdq)
    out = []
    for w in pairing.weights:
        ref = fi.const_array(w.fp32)
        q = qi.const_array(w.quantized)
        scale = qi.const_array(w.scale)
        zp = qi.const_array(w.zero_point) if w.zero_point else None
        if ref is None or q is None or scale is None or ref.dtype.kind != "f":
            continue
        deq = _dequantize(q, scale, zp, w.axis)
        if deq.shape != ref.shape:
            continue
        acc = ErrorAccumulator()
        acc.update(ref, deq)
        channel = ()
        if w.axis is not None and scale.size > 1:
            channel = tuple(_channel_sqnr(ref, deq, w.axis))
        quant = QuantParams(
            scale=float(scale.ravel()[0]),
            zero_point=int(zp.ravel()[0]) if zp is not None else 0,
            qtype=str(q.dtype),
            axis=w.axis,
            channels=int(scale.size),
        )
        out.append(WeightRecord(w.fp32, w.node, acc.result(), quant, channel))
    return tuple(out)


def _dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int | None) -> np.ndarray:
    qf = q.astype(np.float64)
    z = zp.astype(np.float64) if zp is not None else np.zeros_like(scale, dtype=np.float64)
    s = scale.astype(np.float64)
    if axis is not None and s.size > 1:
        shape = [1] * q.ndim
        shape[axis] = -1
        s = s.reshape(shape)
        z = z.reshape(shape)
    return (qf - z) * s


def _channel_sqnr(ref: np.ndarray, deq: np.ndarray, axis: int) -> list[float]:
    out = []
    for c in range(ref.shape[axis]):
        acc = ErrorAccumulator()
        acc.update(np.take(ref, c, axis=axis), np.take(deq, c, axis=axis))
        out.append(acc.result().sqnr_db)
    return out


__all__ = [
    "LayerErrors",
    "concat_range_notes",
    "structure_notes",
    "measure_layers",
    "node_records",
    "quantized_node_names",
    "weight_records",
    "node_depths",
    "ErrorStats",
]
