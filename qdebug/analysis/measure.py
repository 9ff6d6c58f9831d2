"""Layer-wise error of a QDQ model against its FP32 model, streamed batch by batch.

:func:`measure_layers` is the capture's driver. It decides which paired
tensors can be scored (float tensors whose shape does not depend on the data;
a Reshape/Transpose output shares its input's statistics, :func:`permutation_aliases`),
picks an engine -- reductions inside ORT (:mod:`.graph_engine`) or float64 numpy
copies (:mod:`.numpy_engine`) -- streams the data through it and hands the
filled accumulators to :mod:`.build` for the records.

Two views are measured. The main pass runs the FP32 model and the QDQ model
*as deployed* on every sample -- ORT keeps its integer fusions (QLinearConv...),
so the *accumulated* error (FP32 vs QDQ at each tensor) is measured on the
kernels users ship -- and, per quantized tensor, the *local* error: the FP32
tensor against QuantizeLinear->DequantizeLinear of itself with the QDQ model's
scale and zero-point, i.e. what this tensor's own quantization adds, isolated
from upstream error. A second, optional pass runs the QDQ model un-optimized
(fake-quant) on the first ``fakequant_samples`` samples: the accumulated error
without ORT's integer kernels. The gap between the two views exposes kernel
problems (e.g. u8s8 saturation on CPUs without VNNI) that fake-quant tools
never see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from qdebug.analysis.build import TensorAcc, tensor_records
from qdebug.analysis.graph_engine import FLOAT_TYPES, GraphPath, OptimizedSides
from qdebug.analysis.numpy_engine import NumpyPath, local_fake_quant
from qdebug.analysis.reference import ReferenceMismatch, SharedReference
from qdebug.data import Batch, DataSet, batch_axes, take_rows
from qdebug.data.store import ArrayStore
from qdebug.evaluation.evaluate import worst_output_sqnr
from qdebug.graph.match import GraphIndex, Pairing, TensorPair, subgraph_tensors
from qdebug.graph.ops import DATA_SHAPED_OPS, PERMUTATION_OPS
from qdebug.graph.reduce import compatible, elem_types
from qdebug.progress import Progress
from qdebug.records import ErrorStats, NotCaptured, TensorRecord
from qdebug.runtime.capture import SessionConfig, Tap, release_freed_memory, run_session

DEFAULT_FAKEQUANT_SAMPLES = 32
"""Samples the fake-quant view runs on unless told otherwise (it is a diagnostic, not the measurement)."""


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
    sides: OptimizedSides | None = None
    """With ``measure_layers(keep_sides=True)`` and the graph engine: the optimized sides it measured on,
    kept for the per-sample drill-down (the caller deletes them: :meth:`OptimizedSides.cleanup`)."""


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


@dataclass(frozen=True, eq=False)
class ModelOutputs:
    """Per-batch graph outputs seen during the capture (reused as the task metric when eval == calib)."""

    reference: ArrayStore
    """In a store (memory up to a budget, a file beyond): analyze's memory stays flat in the samples."""
    deployed: ArrayStore
    fakequant: ArrayStore
    labels: list[np.ndarray] | None
    fakequant_reference: ArrayStore = dataclasses.field(default_factory=ArrayStore)
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
    shared: SharedReference | None = None,
    plain: Callable[[], Any] | None = None,
    keep_sides: bool = False,
) -> LayerErrors:
    """Stream ``data`` through the models and accumulate every tensor's error.

    ``engine="graph"`` computes the reductions inside ORT on merged models
    (:mod:`qdebug.graph.reduce`); ``"numpy"`` copies every tensor out and reduces
    it in numpy (exact float64, slower); ``"auto"`` uses the graph engine when
    both models share an opset and every paired tensor has a known float type.
    ``fakequant_samples`` limits the fake-quant view to the first batches
    covering that many samples (``None``: every sample; ``0``: none).
    ``shared``: the FP32 side of the graph engine's reductions, recorded by this capture for the next
    captures of the same FP32 model and data, or read back from an earlier one (:mod:`.reference`):
    the same numbers either way; a capture whose FP32 side turns out not to be the recorded one is
    measured again in full.
    ``plain``: opens the un-instrumented quantized model's session (an ORT ``InferenceSession``) for the
    check that instrumentation changed nothing, run on the first rows once the capture's own sessions are
    closed; the caller may keep it for its own runs (analyze scores the evaluation set on it: one start-up
    of the optimized QDQ model instead of two, 1.8 s at 3,200 nodes). Default: a session of its own, gone
    after the check. ``keep_sides``: keep the optimized sides on disk (:attr:`LayerErrors.sides`).
    """
    args = (fp32, qdq, pairing, data, config, ranges, progress, engine, fakequant_samples)
    try:
        return _measure(*args, shared, plain, keep_sides)
    except ReferenceMismatch:
        assert shared is not None
        shared.refuse()
        return _measure(*args, None, plain, keep_sides)


def _measure(
    fp32: onnx.ModelProto,
    qdq: onnx.ModelProto,
    pairing: Pairing,
    data: DataSet,
    config: SessionConfig,
    ranges: dict[str, tuple[float, float]] | None,
    progress: Progress | None,
    engine: str,
    fakequant_samples: int | None,
    shared: SharedReference | None,
    plain: Callable[[], Any] | None = None,
    keep_sides: bool = False,
) -> LayerErrors:
    """The body of :func:`measure_layers`, with the FP32 side shared through ``shared`` (or not: None)."""
    ranges = ranges or {}
    accs = {p.fp32: TensorAcc(p.quant, ranges.get(p.fp32)) for p in pairing.tensors}
    types = elem_types(fp32)
    skipped = _unscorable(fp32, pairing.tensors, types)
    scored = [p for p in pairing.tensors if p.fp32 not in skipped]
    aliases = permutation_aliases(fp32, scored)
    measured = [p for p in scored if p.fp32 not in aliases]
    for name, source in aliases.items():
        accs[name] = accs[source]  # the same values in another order: the same statistics, measured once
    scored = measured
    local = local_fake_quant(qdq, scored)
    use_graph = engine == "graph" or (
        engine == "auto" and compatible(fp32, qdq) and all(types.get(p.fp32) in FLOAT_TYPES for p in scored)
    )
    numpy_path = NumpyPath(fp32, qdq, scored, local, config)
    fakequant = fakequant_samples is None or fakequant_samples > 0
    path: NumpyPath | GraphPath = (
        GraphPath(
            fp32, qdq, scored, local, config, fakequant=fakequant, axes=batch_axes(data.specs), shared=shared,
            keep_sides=keep_sides,
        )  # fmt: skip
        if use_graph
        else numpy_path
    )
    try:
        outputs, samples, fq_done, first_rows = _stream(
            path, numpy_path, data, accs, skipped, progress, fakequant, fakequant_samples
        )
        if isinstance(path, GraphPath):
            path.finish_sharing()
    finally:  # sessions, capture workers and stashed models go on failure and Ctrl-C too
        if isinstance(path, GraphPath):
            path.close()
    gap, first_sqnr = _plain_check(qdq, config, first_rows, plain)

    records = tensor_records(fp32, pairing, accs, skipped, aliases)  # adds the pairs' own notes to skipped
    not_captured = _not_captured(fp32, skipped)
    engine_used = "graph" if isinstance(path, GraphPath) else "numpy"
    head = {
        k: a.head.result()
        for k, a in accs.items()
        if k not in aliases and a.head is not None and a.head.count
    }
    return LayerErrors(
        tuple(records),
        not_captured,
        samples,
        gap,
        outputs,
        engine_used,
        fq_done,
        head,
        aliases,
        first_sqnr,
        path.sides if isinstance(path, GraphPath) else None,
    )


def _unscorable(fp32: onnx.ModelProto, pairs: Sequence[TensorPair], types: dict[str, int]) -> dict[str, str]:
    """Paired tensors no engine can compare, with the reason the report lists them under: sequence/map
    values, shapes that depend on the data, tensors that are not float (``types``: their element types)."""
    containers = _container_values(fp32)
    data_shaped = data_dependent_shapes(fp32)
    skipped: dict[str, str] = {}
    for p in pairs:
        t = types.get(p.fp32)
        if p.fp32 in containers:
            skipped[p.fp32] = f"{containers[p.fp32]} value, not a tensor: not scored"
        elif p.fp32 in data_shaped:
            skipped[p.fp32] = (
                f"its shape depends on the data (after {data_shaped[p.fp32]}): the FP32 and quantized models "
                "may keep different elements, which cannot be compared one to one; not scored"
            )
        elif t is not None and t not in FLOAT_TYPES:
            skipped[p.fp32] = (
                f"{onnx.TensorProto.DataType.Name(t).lower()} tensor: not a float tensor, not scored"
            )
    return skipped


def _not_captured(fp32: onnx.ModelProto, skipped: dict[str, str]) -> tuple[NotCaptured, ...]:
    """The tensors the report lists as not captured: the skipped ones by name, then those inside subgraphs."""
    out = [NotCaptured(name, reason) for name, reason in sorted(skipped.items())]
    for name, where in subgraph_tensors(fp32):
        out.append(NotCaptured(name, f"inside {where}: ORT cannot expose subgraph tensors as graph outputs"))
    return tuple(out)


def _stream(
    path: NumpyPath | GraphPath,
    numpy_path: NumpyPath,
    data: DataSet,
    accs: dict[str, TensorAcc],
    skipped: dict[str, str],
    progress: Progress | None,
    fakequant: bool,
    fakequant_samples: int | None,
) -> tuple[ModelOutputs, int, int, _FirstRows | None]:
    """The fake-quant view, then the main pass over ``data``.

    Returns (outputs, samples, fake-quant samples, the first rows for :func:`_plain_check`).
    """
    outputs = ModelOutputs(
        ArrayStore(), ArrayStore(), ArrayStore(), [] if data.has_labels else None, ArrayStore(),
        [] if data.has_labels else None,
    )
    samples = 0
    first_rows = None
    fq_done = 0
    # the fake-quant view first, on its own: its session is gone before the main one exists,
    # so the peak is the larger of the two, not their sum
    if fakequant:
        head_batches = _first_samples(data.batches(), fakequant_samples)
        known = [r for r in (data.n_samples, fakequant_samples) if r is not None]  # None: every sample
        fq_rows = min(known) if known else None  # at most this many (an upper bound when the data's is unknown)
        for batch, ref_out, fq_out in path.fakequant_batches(head_batches, accs, numpy_path, skipped, fq_rows):
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
        if samples == 0:  # kept for the check that instrumentation changed nothing (_plain_check)
            rows = min(batch.size, getattr(path, "chunk", None) or batch.size)
            if rows < batch.size:  # chunked: each output has a batch axis (checked by _chunk_axes)
                out_axes = getattr(path, "out_axes", {})
                first_rows = _FirstRows(
                    _copied(take_rows(batch.feeds, 0, rows, batch.axes)),
                    _copied(take_rows(dep_out, 0, rows, out_axes)),
                    _copied(take_rows(ref_out, 0, rows, out_axes)),
                )
            else:
                first_rows = _FirstRows(dict(batch.feeds), dep_out, ref_out)
        outputs.reference.append(ref_out)
        outputs.deployed.append(dep_out)
        outputs.sizes.append(batch.size)
        if outputs.labels is not None and batch.labels is not None:
            outputs.labels.append(batch.labels)
        samples += batch.size
        if progress:
            progress("capture", samples, data.n_samples)
        del batch, ref_out, dep_out  # not held while the next batches run
    return outputs, samples, fq_done, first_rows


@dataclass(frozen=True)
class _FirstRows:
    """The first batch's rows (a chunk's worth, when the capture chunks) of the inputs and of the deployed
    (instrumented) and FP32 outputs."""

    feeds: dict[str, np.ndarray]
    deployed: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]


def _copied(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Own copies of a few rows: a view would keep the whole first batch alive through the capture."""
    return {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}


def _plain_check(
    qdq: onnx.ModelProto, config: SessionConfig, first: _FirstRows | None, plain: Callable[[], Any] | None
) -> tuple[float, tuple[float, float] | None]:
    """The un-instrumented QDQ model on the first rows, after the capture: the largest difference of its
    outputs from the instrumented model's (the deployed gap) and the worst output SQNR of each against
    FP32. Run once the capture's sessions are closed, so that its session never adds to their peak."""
    if first is None:
        return 0.0, None
    outputs = [o.name for o in qdq.graph.output]
    if plain is None:
        tap = Tap(qdq, [], config, optimize=True, what="quantized model", arena=False)
        plain_out = tap.run(first.feeds)
        del tap
    else:
        session = plain()
        plain_out = run_session(session, [o.name for o in session.get_outputs()], first.feeds)
    gap = _deployed_gap(plain_out, first.deployed, outputs)
    sqnr = (
        worst_output_sqnr([first.reference], [plain_out], outputs),
        worst_output_sqnr([first.reference], [first.deployed], outputs),
    )
    del plain_out
    release_freed_memory()
    return gap, sqnr


def _first_samples(batches: Iterable[Batch], limit: int | None) -> Iterator[Batch]:
    """The batches that hold the first ``limit`` samples (all with None)."""
    done = 0
    for batch in batches:
        if limit is not None and done >= limit:
            return
        yield batch
        done += batch.size


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
