"""ONNX Runtime sessions over instrumented models, one batch at a time.

Nothing here keeps tensors beyond the batch being processed: the caller feeds
each batch's tensors into streaming accumulators and drops them, so memory is
flat in the number of samples.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.instrument import with_outputs

if TYPE_CHECKING:
    from qdebug.graph.segment import Plan


def release_freed_memory() -> None:
    """Hand memory that Python, numpy and ORT have freed back to the OS.

    The C library (glibc) keeps freed pages in its arenas (one per thread that allocated), so
    what a finished phase freed -- an optimization session, a merged model's
    proto, the fake-quant session -- would still count in the next phase's
    peak RSS. On the ResNet benchmark model, trimming between capture phases
    took 11-15 MB off the peak. A no-op where the C library has no
    ``malloc_trim`` (macOS, Windows, musl).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """The C library's ``malloc_trim`` (glibc), or None where it has none."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc is already loaded
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


@dataclass(frozen=True)
class SessionConfig:
    """Execution settings shared by every session of a comparison (fairness)."""

    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    intra_op_threads: int = 0
    """0 lets ORT choose (one thread per physical core)."""

    def __post_init__(self) -> None:
        if self.intra_op_threads < 0:
            raise QDebugError(
                f"--threads must be >= 0 (got {self.intra_op_threads})",
                "pass 0 for ORT's choice or a number of threads",
                ExitCode.USAGE,
            )


def available_providers() -> list[str]:
    """Execution providers this onnxruntime build offers."""
    import onnxruntime as ort

    return list(ort.get_available_providers())


def check_providers(providers: Sequence[str]) -> None:
    """Refuse a provider ORT does not offer, listing the ones it does."""
    avail = available_providers()
    missing = [p for p in providers if p not in avail]
    if missing:
        raise QDebugError(
            f"execution provider {missing[0]} is not available in this onnxruntime build",
            f"use one of: {', '.join(avail)}",
            ExitCode.USAGE,
        )


def make_session(
    model: onnx.ModelProto | Path,
    config: SessionConfig,
    *,
    optimize: bool = True,
    what: str = "model",
    arena: bool = True,
    fake_quant: bool = False,
    keep_order: bool | None = None,
    threads: int | None = None,
    mem_pattern: bool = True,
    spinning: bool = True,
):
    """Create an InferenceSession from an in-memory model or a model file, with ORT errors made readable.

    A file keeps the peak lower: no serialized copy of the model exists next to ORT's own.

    ``keep_order`` (default: when ``arena`` is off) runs nodes in ORT's
    priority-based order, which follows the model's node order; with it off
    ORT picks a depth-first order that keeps most instrumented activations
    alive.

    ``arena=False`` for instrumented models: with hundreds of extra outputs of
    data-dependent sizes, ORT's CPU arena grew by ~1 GB per batch on the BERT
    benchmark model (2.5 GB after two batches, 8 GB over a run); without it the
    peak stays at one batch's tensors.

    ``fake_quant=True`` turns ORT's QDQ handling off (``session.disable_quant_qdq``):
    no integer kernels, no per-consumer DequantizeLinear copies; a QDQ model then
    computes in float with the Q/DQ rounding -- the fake-quant view.

    ``threads`` overrides the config's intra-op threads (capture runs several
    single-threaded runs side by side).

    ``mem_pattern=False`` turns off ORT's memory pattern, which plans one block for every intermediate
    tensor on a session's first run with a new input shape, in time superlinear in the node count: on
    the 48,000-node merged capture model of a 1,600-node graph the first run took 6-9 s with it and
    0.18 s without (later runs 0.2-0.3 s either way). Capture sessions run a handful of times: they go
    without; models run over a whole evaluation set keep it.

    ``spinning=False`` stops the intra-op threads from spinning after a run (``session.intra_op.allow_spinning``;
    ``benchmarks/bench_timing_load.py`` compares both: steadier under load, but a biased INT8 speed-up).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not arena:
        opts.enable_cpu_mem_arena = False
    if keep_order or (keep_order is None and not arena):
        # with hundreds of extra outputs the default order keeps most activations alive; the
        # priority-based order cut the BERT benchmark's peak by 20-25 %
        opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    opts.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    opts.log_severity_level = 3
    if not mem_pattern:
        opts.enable_mem_pattern = False
    if fake_quant:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads or config.intra_op_threads:
        opts.intra_op_num_threads = threads or config.intra_op_threads
    from qdebug.graph.load import is_large, save_with_external_data

    tmp = None
    try:
        if isinstance(model, Path):
            return ort.InferenceSession(str(model), opts, providers=list(config.providers))
        if is_large(model):  # over protobuf's 2 GB limit: ORT reads it from a file with external data
            import tempfile

            tmp = tempfile.TemporaryDirectory(prefix="qdebug-session-")
            path = Path(tmp.name) / "model.onnx"
            save_with_external_data(model, path)
            session = ort.InferenceSession(str(path), opts, providers=list(config.providers))
            session._qdebug_tmp = tmp  # keep the weights file as long as the session lives
            return session
        return ort.InferenceSession(model.SerializeToString(), opts, providers=list(config.providers))
    except Exception as e:
        if tmp is not None:
            tmp.cleanup()
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise QDebugError(
            f"ONNX Runtime cannot load the {what}: {first[:300]}",
            "check the model with onnx.checker and that its ops are supported by this ORT version",
            ExitCode.MODEL,
        ) from None


def optimize_for_capture(
    model: onnx.ModelProto,
    names: Sequence[str],
    config: SessionConfig,
    *,
    fake_quant: bool = False,
    what: str = "model",
    scratch: Path | None = None,
    tag: str = "optimized",
) -> onnx.ModelProto | None:
    """``model`` with ``names`` as extra outputs, as ORT optimizes it for ``config`` (fused, folded).

    The merged reduction models run with graph optimizations off so that ORT
    keeps qdebug's memory-saving node order (:mod:`qdebug.graph.reduce`); each
    side is optimized here first, on its own, so it still runs the kernels a
    deployed session runs (QLinearMatMul, fused MatMul+Add...). Returns None
    when ORT cannot write the optimized model (e.g. one over 2 GB): the caller
    then merges the models as they are and lets ORT optimize the merged model.
    ``fake_quant=True``: optimized with ORT's QDQ handling off (see :func:`make_session`).

    With ``scratch`` (a directory that outlives the returned proto), ORT
    writes the weights to ``<scratch>/<tag>.data`` and the proto only refers
    to them: the merged models built from it, and their copies, then hold no
    weights (on the BERT benchmark model this was the run's peak, ~100 MB of
    weight copies, and 0.5 s of copying and serializing them). A model saved
    in ``scratch`` finds them by that relative name.
    """
    import tempfile

    import onnxruntime as ort

    from qdebug.graph.load import is_large

    instrumented = with_outputs(model, names)
    if is_large(instrumented):
        return None
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if fake_quant:
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    # this session never runs: packing the weights for the kernels would only cost time and memory
    opts.add_session_config_entry("session.disable_prepacking", "1")
    if config.intra_op_threads:
        opts.intra_op_num_threads = config.intra_op_threads
    with tempfile.TemporaryDirectory(prefix="qdebug-opt-") as tmp:
        path = Path(scratch or tmp) / f"{tag}.onnx"
        opts.optimized_model_filepath = str(path)
        if scratch is not None:
            opts.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", f"{tag}.data"
            )
            opts.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
            )
        try:
            ort.InferenceSession(instrumented.SerializeToString(), opts, providers=list(config.providers))
            del instrumented
            release_freed_memory()  # the session is gone: its memory must not add to the next phase's peak
            return onnx.load(str(path), load_external_data=scratch is None)
        except Exception as e:  # the merged model is still correct, only slower
            if "protobuf" in str(e).lower() or not path.exists():
                return None
            raise QDebugError(
                f"ONNX Runtime cannot load the {what}: {str(e).strip().splitlines()[0][:300]}",
                "check the model with onnx.checker and that its ops are supported by this ORT version",
                ExitCode.MODEL,
            ) from None


def run_session(
    session, names: Sequence[str], feeds: Mapping[str, np.ndarray], what: str = "the model"
) -> dict[str, np.ndarray]:
    """``session.run`` for ``names`` with the session's own inputs picked from ``feeds``.

    An ORT failure (e.g. data the model rejects at run time) becomes one
    :class:`QDebugError` line instead of a pybind traceback.
    """
    try:
        # an optional input the data does not feed is left out: ORT runs without it
        values = session.run(list(names), {i.name: feeds[i.name] for i in session.get_inputs() if i.name in feeds})
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise QDebugError(
            f"ONNX Runtime failed while running {what}: {first[:300]}",
            "check that the data matches what the model expects",
            ExitCode.DATA,
        ) from None
    return dict(zip(names, values, strict=True))


class Tap:
    """A session that returns the values of chosen tensors for each batch.

    Graph inputs among the chosen names are served from the feeds, so they
    never become extra graph outputs.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        names: Sequence[str],
        config: SessionConfig,
        *,
        optimize: bool = True,
        what: str = "model",
        fake_quant: bool = False,
        arena: bool | None = None,
    ) -> None:
        inputs = {i.name for i in model.graph.input}
        self.names = list(dict.fromkeys(n for n in names if n))
        instrumented = with_outputs(model, [n for n in self.names if n not in inputs])
        self.session = make_session(
            instrumented,
            config,
            optimize=optimize,
            what=what,
            arena=not self.names if arena is None else arena,
            fake_quant=fake_quant,
            mem_pattern=not self.names,  # instrumented: hundreds of outputs, a few runs
        )
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.graph_outputs = [o.name for o in model.graph.output]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one batch; returns tensor name -> array for graph outputs and chosen tensors."""
        out = run_session(self.session, self.output_names, feeds)
        for name in self.names:
            if name in feeds and name not in out:
                out[name] = feeds[name]
        return out


@dataclass(frozen=True)
class _Arg:
    """A graph input as ``session.get_inputs()`` lists it (what :func:`run_session` reads: its name)."""

    name: str


class SegmentedSession:
    """A model with graph optimizations off, run as consecutive sessions over slices of its nodes
    (:mod:`qdebug.graph.segment`): the same outputs, bit for bit, and a shorter start-up on a large merged
    capture model (the 96,000-node main model of a 3,200-node graph: 3.9 s instead of 7.3 s,
    ``benchmarks/bench_session_init.py``).

    ``open_one(path)`` opens one slice's model file (written next to ``path``, so external weights that
    the model names relative to its folder are found); each slice's inputs are typed from the outputs of
    the slices already open. Thread-safe as ORT's sessions are: a run keeps its values to itself.
    """

    def __init__(self, path: Path, model: onnx.ModelProto, plan: Plan, open_one: Callable[[Path], Any]) -> None:
        from qdebug.graph import segment
        from qdebug.graph.modelfile import save_model

        self.plan = plan
        self._inputs = [_Arg(n) for n in plan.inputs]
        types = segment.input_types(model)
        initializers = {t.name: t for t in model.graph.initializer}
        self.sessions = []
        for k, part in enumerate(plan.slices):
            if not part.outputs:  # nothing it computes is read again (ORT refuses a run without outputs)
                self.sessions.append(None)
                continue
            piece = path.with_name(f"{path.stem}.slice{k}.onnx")
            save_model(segment.slice_model(model, plan, k, types, initializers), piece)
            session = open_one(piece)
            for out in session.get_outputs():
                elem = segment.tensor_type_of(out.type)
                if elem is None:
                    raise _NotSliceable(f"{out.name} is a {out.type}")
                types[out.name] = elem
            self.sessions.append(session)

    def get_inputs(self) -> list[_Arg]:
        return list(self._inputs)

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        values: dict[str, np.ndarray] = dict(feeds)
        for part, session in zip(self.plan.slices, self.sessions, strict=True):
            if session is not None:
                out = session.run(list(part.outputs), {n: values[n] for n in part.inputs if n in values})
                values.update(zip(part.outputs, out, strict=True))
            for name in part.last_read:  # read by no later slice: not held while the rest run
                values.pop(name, None)
        for stack in self.plan.stacks:
            parts = [values[p] for p in stack.parts]
            values[stack.output] = (np.stack if stack.new_axis else np.concatenate)(parts, axis=stack.axis)
        return [values[n] for n in names]


class _NotSliceable(Exception):
    """A value handed between slices is not a tensor (a sequence): the model is opened whole instead."""


def open_sliced(path: Path, open_one: Callable[[Path], Any], *, size: int | None = None):
    """A :class:`SegmentedSession` over the model file ``path`` in slices of ``size`` nodes
    (:func:`qdebug.graph.segment.slice_nodes`; ``0``: never) when :func:`qdebug.graph.segment.plan` finds the
    model worth slicing, else ``open_one(path)``: one session, as before. Only for sessions with graph
    optimizations off (a fusion across two slices would be lost)."""
    from qdebug.graph import segment

    size = segment.slice_nodes() if size is None else size
    if size <= 0:
        return open_one(path)
    model = onnx.load(str(path), load_external_data=False)
    found = segment.plan(model, size)
    if found is None:
        del model
        return open_one(path)
    try:
        return SegmentedSession(path, model, found, open_one)
    except (_NotSliceable, QDebugError):
        # a slice ORT will not load (a cut it cannot type) costs the time saved, never the run: open it whole,
        # which reports ORT's own error if the model itself is at fault
        del model
        return open_one(path)
