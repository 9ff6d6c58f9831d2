"""Per-node latency from ONNX Runtime's own profiler, booked to the user's nodes (``qdebug profile``).

Each model gets one session with profiling on and the optimized graph saved next to the trace (both in a
temporary folder, never the working directory): one warm-up run, then ``runs`` timed runs cycling over the
data's batches. The trace names ORT's kernels, not the user's nodes: the optimizer fuses (Conv+BN+Relu
becomes one ``Conv``, MatMul+Add a ``Gemm``, DQ->Conv->Q a ``QLinearConv``), renames (``conv1_token_19``,
``r1_nchwc`` after its output tensor, ``mm1/MatMulAddFusion``) and inserts layout kernels (NCHWc
``ReorderInput``/``ReorderOutput``, NHWC ``Transpose`` around integer Convs). So kernels are mapped through
tensors, not names: every tensor of the optimized graph that still carries a user tensor's value anchors it;
a kernel (or a group of kernels joined by tensors that exist only inside ORT) computes the user's nodes
between its anchored inputs and its anchored outputs. Name equality only decides which covered node a
kernel's time is booked to. The kernels an If, Loop or Scan runs in its bodies are profiled inside that
node's own event: they are kept as detail of that node and left out of every total.

Both models' sessions are open together and their timed runs alternate in rounds (as
:mod:`qdebug.runtime.timing` does), so that load or CPU-frequency drift hits both alike.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from qdebug.errors import ExitCode, QDebugError
from qdebug.records.profile import (
    ORT_INSERTED,
    PROFILE_SCHEMA_VERSION,
    KernelRecord,
    ModelProfile,
    NodeLatency,
    ProfileReport,
    verdict_line,
)
from qdebug.runtime.capture import SessionConfig, run_session
from qdebug.runtime.timing import CHUNK_RUNS

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
LAYOUT_OPS = frozenset({"Transpose", "ReorderInput", "ReorderOutput", "MemcpyToHost", "MemcpyFromHost"})
"""Kernels that only move data: when the user's graph has no node of that name and op, ORT inserted them."""
INTEGER_DTYPES = frozenset({"int8", "uint8", "int16", "uint16", "int4", "uint4"})
"""Input element types that make a kernel an integer one (the profiler's ``input_type_shape``)."""
_SAME_OP = {"Gemm": ("Gemm", "MatMul"), "FusedGemm": ("Gemm", "MatMul"), "QGemm": ("Gemm", "MatMul")}
"""Kernel ops that run a user op of another name beyond the prefix/suffix rule of :func:`base_ops`."""
QDQ_OVERHEAD_MIN_MS = 0.01
"""Q/DQ time per run below which ``qdq-overhead`` is never the cause: a few microseconds of kernel events
(whole microseconds each) are timer noise, not a cost worth a change to the model."""
QDQ_OVERHEAD_MIN_SHARE = 0.02
"""Nor below this share of the INT8 model's kernel time per run: what no change to one node could win."""
TICK_US = 2.0
"""Slack when testing that one profiler event lies inside another: start and duration are each truncated
to whole microseconds."""


# --------------------------------------------------------------------------- graphs


@dataclass(frozen=True)
class GraphIndex:
    """A graph's nodes with who produces and who reads each tensor (built once per graph)."""

    nodes: tuple[onnx.NodeProto, ...]
    names: tuple[str, ...]
    """Each node's name; an unnamed node gets ``<op>_<index>`` so that it can still be a row."""
    producer: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    constants: frozenset[str]
    """Initializers: never activations, never anchors."""
    inputs: frozenset[str]
    outputs: frozenset[str]

    @classmethod
    def of(cls, graph: onnx.GraphProto) -> GraphIndex:
        producer: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        for i, n in enumerate(graph.node):
            for t in n.output:
                if t:
                    producer[t] = i
            for t in n.input:
                if t:
                    consumers.setdefault(t, []).append(i)
        names = tuple(n.name or f"{n.op_type}_{i}" for i, n in enumerate(graph.node))
        return cls(
            nodes=tuple(graph.node),
            names=names,
            producer=producer,
            consumers={k: tuple(v) for k, v in consumers.items()},
            constants=frozenset(t.name for t in graph.initializer),
            inputs=frozenset(v.name for v in graph.input),
            outputs=frozenset(v.name for v in graph.output),
        )

    def activations(self, tensors: Iterable[str]) -> list[str]:
        """The tensors among ``tensors`` that carry data computed per run (not initializers, not empty)."""
        return [t for t in tensors if t and t not in self.constants]

    def index_of_name(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}


def subgraph_parents(graph: onnx.GraphProto) -> dict[str, str]:
    """Node name -> the top-level node whose If branch or Loop/Scan body holds it, at any depth (an If in a
    Loop body belongs to the Loop). The profiler times these nodes inside their parent's own event."""
    from qdebug.graph.load import iter_graphs

    out: dict[str, str] = {}
    for i, node in enumerate(graph.node):
        parent = node.name or f"{node.op_type}_{i}"
        for attr in node.attribute:
            subs = [attr.g] if attr.HasField("g") else list(attr.graphs)
            for sub in subs:
                for g in iter_graphs(sub):
                    for n in g.node:
                        if n.name:
                            out.setdefault(n.name, parent)
    return out


def base_ops(kernel_op: str) -> tuple[str, ...]:
    """The user ops a kernel op runs: ``QLinearConv``/``FusedConv``/``ConvInteger`` -> Conv, ``Gemm`` -> Gemm
    or MatMul (MatMul+Add fusion). Used to book a fused kernel's time to the node whose op it runs."""
    if kernel_op in _SAME_OP:
        return _SAME_OP[kernel_op]
    op = kernel_op
    for prefix in ("QLinear", "Fused", "Nhwc", "DynamicQuantize"):
        if op.startswith(prefix) and len(op) > len(prefix):
            op = op[len(prefix) :]
    for suffix in ("IntegerToFloat", "Integer"):
        if op.endswith(suffix) and len(op) > len(suffix):
            op = op[: -len(suffix)]
    return (op,)


@dataclass(frozen=True)
class KernelMapping:
    """Where one optimized-graph node's work belongs in the user's graph."""

    nodes: tuple[int, ...]
    """User node indices it computes, in graph order; empty: ORT inserted it."""
    booked_to: int | None


class _Groups:
    """Union-find over optimized-graph node indices."""

    def __init__(self, n: int) -> None:
        self.parent = list(range(n))

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def join(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def map_kernels(user: GraphIndex, opt: GraphIndex) -> list[KernelMapping]:
    """Map every node of ORT's optimized graph to the user's nodes it computes (see the module docstring).

    1. *Named*: an optimized node whose name is a user node's and whose op runs that node's op.
    2. *Anchors*: an optimized tensor of a user tensor's name is that tensor; a named node of the same op
       carries its user node's inputs and outputs; an unnamed layout kernel's output is its input.
    3. *Groups*: nodes joined by tensors with no anchor (ORT-internal) are one group; the group computes
       the user nodes found walking back from its anchored outputs until an anchored tensor (materialized
       by another kernel), a graph input or an initializer.
    4. *Booking*: in a group each computing kernel takes its named node, else the first covered node of
       its op, else the first one left; nodes no kernel takes were fused into the group's first kernel.
    """
    named = _named(user, opt)
    eq = _anchors(user, opt, named)
    layout = {i for i, n in enumerate(opt.nodes) if n.op_type in LAYOUT_OPS and i not in named}
    groups = _Groups(len(opt.nodes))
    for t, p in opt.producer.items():
        if t in eq or t in opt.constants:
            continue
        for c in opt.consumers.get(t, ()):
            groups.join(p, c)
    members: dict[int, list[int]] = {}
    for i in range(len(opt.nodes)):
        members.setdefault(groups.find(i), []).append(i)
    boundary = set(eq.values())
    out: list[KernelMapping] = [KernelMapping((), None)] * len(opt.nodes)
    for group in members.values():
        computing = [i for i in group if i not in layout]
        if not computing:
            continue
        anchors = {eq[t] for i in computing for t in opt.nodes[i].output if t in eq}
        covered = _walk_back(user, anchors, boundary)
        for i, mapping in _book(user, opt, computing, covered, named).items():
            out[i] = mapping
    return out


def _named(user: GraphIndex, opt: GraphIndex) -> dict[int, int]:
    """Optimized node -> user node of the same name whose op the kernel runs (exact or QLinear/Fused...)."""
    by_name = {n.name: i for i, n in enumerate(user.nodes) if n.name}
    out = {}
    for i, n in enumerate(opt.nodes):
        u = by_name.get(n.name)
        if u is not None and (n.op_type == user.nodes[u].op_type or user.nodes[u].op_type in base_ops(n.op_type)):
            out[i] = u
    return out


def _anchors(user: GraphIndex, opt: GraphIndex, named: Mapping[int, int]) -> dict[str, str]:
    """Optimized activation tensor -> the user tensor whose value it carries (see :func:`map_kernels`)."""
    values = set(user.producer) | set(user.inputs)
    values -= user.constants
    eq: dict[str, str] = {}
    for n in opt.nodes:
        for t in (*opt.activations(n.input), *opt.activations(n.output)):
            if t in values:
                eq[t] = t
    for oi, ui in named.items():
        o, u = opt.nodes[oi], user.nodes[ui]
        if o.op_type != u.op_type:  # a QLinear kernel's tensors are quantized: not the float node's
            continue
        for a, b in (*zip(o.output, u.output, strict=False), *zip(o.input, u.input, strict=False)):
            if a and b and a not in opt.constants and b not in user.constants:
                eq.setdefault(a, b)
    changed = True
    while changed:  # a layout kernel's output holds its input's values, in another layout
        changed = False
        for i, n in enumerate(opt.nodes):
            if n.op_type not in LAYOUT_OPS or i in named:
                continue
            ins, outs = opt.activations(n.input), opt.activations(n.output)
            if len(ins) != 1 or len(outs) != 1:
                continue
            a, b = ins[0], outs[0]
            if a in eq and b not in eq:
                eq[b] = eq[a]
                changed = True
            elif b in eq and a not in eq:
                eq[a] = eq[b]
                changed = True
    return eq


def _walk_back(user: GraphIndex, anchors: Iterable[str], boundary: set[str]) -> tuple[int, ...]:
    """The user nodes that compute ``anchors`` from materialized tensors (``boundary``), graph inputs or
    initializers: what a kernel producing ``anchors`` must have done."""
    seen: set[int] = set()
    stack = [user.producer[t] for t in anchors if t in user.producer]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        for t in user.nodes[i].input:
            if t and t not in boundary and t not in user.constants and t in user.producer:
                stack.append(user.producer[t])
    return tuple(sorted(seen))


def _book(
    user: GraphIndex, opt: GraphIndex, computing: Sequence[int], covered: Sequence[int], named: Mapping[int, int]
) -> dict[int, KernelMapping]:
    """Each computing kernel of a group with the user node its time counts for (step 4 of
    :func:`map_kernels`). A group that covers nothing was inserted by ORT."""
    if not covered:
        return {}
    taken: dict[int, int] = {}
    cover = set(covered)
    for i in computing:
        if named.get(i) in cover:
            taken[i] = named[i]
    used = set(taken.values())
    order = [u for u in covered if user.nodes[u].op_type not in QDQ_OPS] + [
        u for u in covered if user.nodes[u].op_type in QDQ_OPS
    ]
    for i in computing:
        if i in taken:
            continue
        ops = base_ops(opt.nodes[i].op_type)
        pick = next((u for u in order if u not in used and user.nodes[u].op_type in ops), None)
        if pick is None:
            pick = next((u for u in order if u not in used), order[0])
        taken[i] = pick
        used.add(pick)
    owner = {u: i for i, u in taken.items()}
    fused: dict[int, set[int]] = {i: {u} for i, u in taken.items()}
    for u in covered:
        if u not in owner:
            fused[_fused_into(user, u, owner, cover, computing[0])].add(u)
    return {i: KernelMapping(tuple(sorted(fused[i])), u) for i, u in taken.items()}


def _fused_into(user: GraphIndex, u: int, owner: Mapping[int, int], cover: set[int], first: int) -> int:
    """The kernel of a group that computes a covered node no kernel was booked to: the kernel of its latest
    booked ancestor inside the group (a Relu, BatchNormalization or Add fused into the Conv before it, the
    QuantizeLinear of a QLinearConv's output), else of its earliest booked descendant (a weight's or an
    input's DequantizeLinear), else the group's first kernel. A DequantizeLinear looks down first: it
    belongs to the kernel it feeds."""
    up = _reach(u, cover, lambda j: [user.producer[t] for t in user.nodes[j].input if t in user.producer])
    down = _reach(u, cover, lambda j: [c for t in user.nodes[j].output for c in user.consumers.get(t, ())])
    before = [owner[max(j for j in up if j in owner)]] if any(j in owner for j in up) else []
    after = [owner[min(j for j in down if j in owner)]] if any(j in owner for j in down) else []
    order = after + before if user.nodes[u].op_type == "DequantizeLinear" else before + after
    return order[0] if order else first


def _reach(start: int, within: set[int], step: Callable[[int], Iterable[int]]) -> set[int]:
    """The nodes of ``within`` reached from ``start`` by ``step`` (producers or consumers), start excluded."""
    seen: set[int] = set()
    stack = [j for j in step(start) if j in within]
    while stack:
        j = stack.pop()
        if j not in seen:
            seen.add(j)
            stack.extend(k for k in step(j) if k in within)
    return seen


def qdq_owner(user: GraphIndex, i: int) -> int | None:
    """The node a Q or DQ node's time counts for: a QuantizeLinear follows the node that produced its input
    (its output quantization), a DequantizeLinear feeds its consumer; a Q of a graph input counts for the
    node its DQ feeds, a DQ of a graph output for the node whose output it was."""
    node = user.nodes[i]
    if node.op_type == "QuantizeLinear":
        return _producer_through_qdq(user, i) if node.input[0] in user.producer else _consumer_through_qdq(user, i)
    found = _consumer_through_qdq(user, i)
    return found if found is not None else _producer_through_qdq(user, i)


def is_output_dq(user: GraphIndex, i: int) -> bool:
    """Whether node ``i`` is a DequantizeLinear that writes a graph output: the INT8 model pays it wherever
    its quantized region ends, so it is time around a node but never that node's overhead."""
    node = user.nodes[i]
    return node.op_type == "DequantizeLinear" and any(t in user.outputs for t in node.output)


def _consumer_through_qdq(user: GraphIndex, i: int) -> int | None:
    stack, seen = [i], set()
    while stack:
        j = stack.pop(0)
        if j in seen:
            continue
        seen.add(j)
        for t in user.nodes[j].output:
            for c in user.consumers.get(t, ()):
                if user.nodes[c].op_type not in QDQ_OPS:
                    return c
                stack.append(c)
    return None


def _producer_through_qdq(user: GraphIndex, i: int) -> int | None:
    j: int | None = i
    seen = set()
    while j is not None and j not in seen:
        seen.add(j)
        first = user.nodes[j].input[0] if user.nodes[j].input else ""
        p = user.producer.get(first)
        if p is None:
            return None
        if user.nodes[p].op_type not in QDQ_OPS:
            return p
        j = p
    return None


# --------------------------------------------------------------------------- the trace


@dataclass(frozen=True)
class KernelTime:
    """One kernel's profiler events over the timed runs."""

    name: str
    op_type: str
    provider: str
    total_us: float
    integer: bool
    inside: str = ""
    """The If/Loop/Scan kernel whose branch or body ran this one (its events lie inside that kernel's):
    empty for a kernel of the main graph."""


@dataclass(frozen=True)
class Trace:
    """What the profiler recorded for the timed runs (the warm-up runs left out)."""

    kernels: tuple[KernelTime, ...]
    """The main graph's kernels: one at a time in a run, so their durations add up."""
    runs: int
    kernel_us_per_run: tuple[float, ...]
    """Sum of the main graph's kernel durations in each timed run."""
    model_run_us: tuple[float, ...]
    """ORT's ``model_run`` duration of each timed run."""
    subgraph_kernels: tuple[KernelTime, ...] = ()
    """Kernels run inside an If/Loop/Scan kernel: already in its duration, so in no sum."""


def parse_trace(path: str | Path, warmup: int, subgraphs: Mapping[str, str] | None = None) -> Trace:
    """Read the profiler's JSON: ``model_run`` events delimit runs, ``cat == "Node"`` events named
    ``<node>_kernel_time`` are kernels (fence events are skipped); events of the first ``warmup`` runs
    are left out.

    ``subgraphs`` maps the nodes of If/Loop/Scan bodies to their top-level node (:func:`subgraph_parents`):
    an event of such a node that lies inside an event of that parent in the same run was timed within the
    parent's (the same name in the main graph, outside it, stays a kernel of its own)."""
    events = json.loads(Path(path).read_text())
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=_ts)
    timed = runs[warmup:]
    starts = [_ts(r) for r in timed]
    found: list[tuple[str, int, float, float, Mapping[str, Any]]] = []
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        k = _run_of(_ts(e), timed, starts)
        if k is not None:
            found.append((e["name"][: -len("_kernel_time")], k, _ts(e), float(e.get("dur", 0)), e.get("args", {})))
    parents = subgraphs or {}
    parent_names = set(parents.values())
    spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for name, k, ts, dur, _args in found:
        if name in parent_names:
            spans.setdefault((name, k), []).append((ts, ts + dur))
    totals: dict[tuple[str, str], list[Any]] = {}
    per_run = [0.0] * len(timed)
    for name, k, ts, dur, args in found:
        parent = parents.get(name, "")
        inside = parent and any(a - TICK_US <= ts and ts + dur <= b + TICK_US for a, b in spans.get((parent, k), ()))
        if not inside:
            parent = ""
            per_run[k] += dur
        entry = totals.setdefault(
            (name, parent), [args.get("op_name", ""), args.get("provider", ""), 0.0, _integer(args)]
        )
        entry[2] += dur
    kernels = [KernelTime(n, op, prov, us, integer, parent) for (n, parent), (op, prov, us, integer) in totals.items()]
    return Trace(
        tuple(k for k in kernels if not k.inside),
        len(timed),
        tuple(per_run),
        tuple(float(r.get("dur", 0)) for r in timed),
        tuple(k for k in kernels if k.inside),
    )


def _ts(e: Mapping[str, Any]) -> float:
    return float(e.get("ts", 0))


def _run_of(ts: float, runs: Sequence[Mapping[str, Any]], starts: Sequence[float]) -> int | None:
    """The timed run whose ``model_run`` interval holds ``ts`` (None: the warm-up or between runs)."""
    import bisect

    k = bisect.bisect_right(starts, ts) - 1
    if k < 0 or ts > starts[k] + float(runs[k].get("dur", 0)):
        return None
    return k


def _integer(args: Mapping[str, Any]) -> bool:
    shapes = args.get("input_type_shape") or []
    return any(dtype in INTEGER_DTYPES for item in shapes if isinstance(item, dict) for dtype in item)


# --------------------------------------------------------------------------- running a model


@dataclass(frozen=True)
class ModelRun:
    """One model profiled: its record and what the node rows need."""

    profile: ModelProfile
    user: GraphIndex
    mappings: dict[str, KernelMapping] = field(default_factory=dict)
    """Kernel name -> where it belongs."""


@dataclass(frozen=True)
class ModelToProfile:
    """A model file as :func:`profile_models` takes it."""

    path: Path
    proto: onnx.ModelProto
    sha256: str
    what: str
    """``FP32 model`` or ``INT8 model``: in messages, and its first word tags the scratch files."""


@dataclass(frozen=True)
class _Opened:
    """One model's profiling session, open while the runs of all models alternate."""

    model: ModelToProfile
    proto: onnx.ModelProto
    """The model with every node named (:func:`_with_node_names`)."""
    tag: str
    session: Any
    batches: list[dict[str, np.ndarray]]


def profile_models(
    models: Sequence[ModelToProfile],
    feeds: Sequence[Mapping[str, np.ndarray]],
    config: SessionConfig,
    *,
    runs: int,
    scratch: Path,
) -> list[ModelRun]:
    """Profile the models together: one session each, all open at once; one warm-up run each, then
    ``runs`` timed runs each cycling over ``feeds``, in rounds (:func:`timed_rounds`)."""
    opened = []
    for model in models:
        tag = model.what.split()[0].lower()
        proto, copy = _with_node_names(model.proto, scratch / f"{tag}-named.onnx")
        session = _profiling_session(copy or model.path, config, scratch, tag, model.what)
        names = [i.name for i in session.get_inputs()]
        batches = [{n: f[n] for n in names if n in f} for f in feeds]
        opened.append(_Opened(model, proto, tag, session, batches))
    # capture's run_session: the same one-line error (exit 5) for data ORT rejects at run time
    outputs = [[out.name for out in o.session.get_outputs()] for o in opened]
    steps = [
        lambda batch, o=o, n=n: run_session(o.session, n, batch, f"the {o.model.what}")
        for o, n in zip(opened, outputs, strict=True)
    ]
    walls = timed_rounds(steps, [o.batches for o in opened], runs)
    return [_record(o, w, scratch) for o, w in zip(opened, walls, strict=True)]


def timed_rounds(
    steps: Sequence[Callable[[Mapping[str, np.ndarray]], None]],
    batches: Sequence[Sequence[Mapping[str, np.ndarray]]],
    runs: int,
) -> list[list[float]]:
    """Each step's wall times (seconds) of ``runs`` timed calls, after one warm-up call each on its first batch.

    The timed calls alternate between the steps in rounds of :data:`~qdebug.runtime.timing.CHUNK_RUNS`, as
    :func:`qdebug.runtime.timing.time_sessions` does: a drift of CPU frequency or background load hits every
    model alike, while within a round a model runs undisturbed by the other session's spinning threads and
    with its own weights in cache, as it would deployed. Call ``k`` of every step gets its ``k``-th batch
    (cycling), so that the models see the same data run by run.
    """
    for step, own in zip(steps, batches, strict=True):
        step(own[0])
    walls: list[list[float]] = [[] for _ in steps]
    done = 0
    while done < runs:
        chunk = min(CHUNK_RUNS, runs - done)
        for step, own, out in zip(steps, batches, walls, strict=True):
            for k in range(done, done + chunk):
                batch = own[k % len(own)]
                t0 = time.perf_counter()
                step(batch)
                out.append(time.perf_counter() - t0)
        done += chunk
    return walls


def _record(o: _Opened, walls: Sequence[float], scratch: Path) -> ModelRun:
    """One model's record from its session's trace and optimized graph."""
    optimized = onnx.load(str(scratch / f"{o.tag}-optimized.onnx"), load_external_data=False)
    parents = subgraph_parents(optimized.graph)
    trace = parse_trace(o.session.end_profiling(), warmup=1, subgraphs=parents)
    user, opt = GraphIndex.of(o.proto.graph), GraphIndex.of(optimized.graph)
    by_name = opt.index_of_name()
    mapping = map_kernels(user, opt)
    mappings: dict[str, KernelMapping] = {}
    n = max(trace.runs, 1)

    def record(k: KernelTime, m: KernelMapping) -> KernelRecord:
        return KernelRecord(
            name=k.name,
            op_type=k.op_type,
            provider=k.provider,
            ms_per_run=k.total_us / n / 1e3,
            integer=k.integer,
            nodes=tuple(user.names[u] for u in m.nodes),
            booked_to="" if m.booked_to is None else user.names[m.booked_to],
            inside=k.inside,
        )

    kernels = []
    for k in trace.kernels:
        m = mapping[by_name[k.name]] if k.name in by_name else KernelMapping((), None)
        mappings[k.name] = m
        kernels.append(record(k, m))
    inner = []
    for k in trace.subgraph_kernels:  # detail of the If/Loop/Scan node its parent kernel is booked to
        parent = mapping[by_name[k.inside]] if k.inside in by_name else KernelMapping((), None)
        booked = () if parent.booked_to is None else (parent.booked_to,)
        inner.append(record(k, KernelMapping(booked, parent.booked_to)))
    record_ = ModelProfile(
        path=str(o.model.path),
        sha256=o.model.sha256,
        runs=trace.runs,
        wall_p50_ms=1e3 * statistics.median(walls),
        wall_mean_ms=1e3 * statistics.fmean(walls),
        model_run_ms=statistics.fmean(trace.model_run_us) / 1e3 if trace.model_run_us else 0.0,
        kernel_ms=sum(k.ms_per_run for k in kernels),
        inserted_ms=sum(k.ms_per_run for k in kernels if not k.nodes),
        run_wall_ms=tuple(1e3 * w for w in walls),
        run_kernel_ms=tuple(us / 1e3 for us in trace.kernel_us_per_run),
        kernels=tuple(kernels),
        subgraph_kernels=tuple(inner),
    )
    return ModelRun(record_, user, mappings)


def _with_node_names(proto: onnx.ModelProto, path: Path) -> tuple[onnx.ModelProto, Path | None]:
    """The model with every node named, and the copy ORT should load (None: it names every node already).

    ORT's profiler calls an unnamed node ``<op>_<internal index>``, and the optimized graph it saves keeps
    the name empty: nothing ties the two. A copy in the scratch folder (the user's file is never touched)
    names them ``<op>_<position>`` (in an If/Loop/Scan body ``<parent>/<op>_<position>``), a name the
    profiler and the optimized graph then share.
    """
    from qdebug.graph.load import is_large, iter_graphs, save_with_external_data

    if all(n.name for g in iter_graphs(proto.graph) for n in g.node):
        return proto, None
    named = onnx.ModelProto()
    named.CopyFrom(proto)
    taken = {n.name for g in iter_graphs(named.graph) for n in g.node if n.name}
    _name_nodes(named.graph, "", taken)
    if is_large(named):
        save_with_external_data(named, path)
    else:
        onnx.save(named, str(path))
    return named, path


def _name_nodes(graph: onnx.GraphProto, prefix: str, taken: set[str]) -> None:
    """Name the unnamed nodes of ``graph`` and of its subgraphs, each name new to ``taken``."""
    for i, n in enumerate(graph.node):
        if not n.name:
            name = f"{prefix}{n.op_type}_{i}"
            while name in taken:
                name += "_"
            n.name = name
            taken.add(name)
        for attr in n.attribute:
            for sub in [attr.g] if attr.HasField("g") else attr.graphs:
                _name_nodes(sub, f"{n.name}/", taken)


def _profiling_session(path: Path, config: SessionConfig, scratch: Path, tag: str, what: str) -> Any:
    """A session with ORT's profiler on and its optimized graph saved, both under ``scratch``: the graph
    with its initializers in a data file beside it (as :func:`qdebug.runtime.capture.optimize_for_capture`
    does), never copied inline, so that a model over the protobuf limit saves too."""
    import onnxruntime as ort

    from qdebug.graph.load import EXTERNAL_MIN_BYTES

    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = str(scratch / f"{tag}-profile")
    opts.optimized_model_filepath = str(scratch / f"{tag}-optimized.onnx")
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{tag}-optimized.data")
    opts.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", str(EXTERNAL_MIN_BYTES)
    )
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # 4 (fatal only): ORT's own log lines never reach the user's stderr -- the NCHWc "hardware specific"
    # warning on saving the optimized graph, and, for a model ORT refuses, "EndProfiling] Could not write
    # a profile because no model was loaded" before qdebug's one line. Its errors still come as exceptions.
    opts.log_severity_level = 4
    if config.intra_op_threads:
        opts.intra_op_num_threads = config.intra_op_threads
    try:
        return ort.InferenceSession(str(path), opts, providers=list(config.providers))
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise QDebugError(
            f"ONNX Runtime cannot load the {what}: {first[:300]}",
            "check the model with onnx.checker and that its ops are supported by this ORT version",
            ExitCode.MODEL,
        ) from None


# --------------------------------------------------------------------------- node rows


@dataclass(frozen=True)
class _Side:
    """One model's time per user node, from its kernels."""

    ms: dict[int, float]
    kernel: dict[int, str]
    """Booked node -> op of its (slowest) kernel; a fused node -> ``fused into NODE``."""
    integer: dict[int, bool]
    qdq_ms: dict[int, float]
    output_dq_ms: dict[int, float]
    """Of ``qdq_ms``, a graph output's DequantizeLinear (:func:`is_output_dq`)."""
    kernel_ms: float
    """The model's kernel time per run: what ``qdq-overhead`` must be a share of."""


def _side(run: ModelRun) -> _Side:
    user = run.user
    ms: dict[int, float] = {}
    kernel: dict[int, tuple[float, str]] = {}
    integer: dict[int, bool] = {}
    fused: dict[int, str] = {}
    qdq: dict[int, float] = {}
    output_dq: dict[int, float] = {}
    index = user.index_of_name()
    for k in run.profile.kernels:
        m = run.mappings[k.name]
        if m.booked_to is None:
            continue
        b = m.booked_to
        if user.nodes[b].op_type in QDQ_OPS:
            owner = qdq_owner(user, b)
            if owner is not None:
                qdq[owner] = qdq.get(owner, 0.0) + k.ms_per_run
                if is_output_dq(user, b):
                    output_dq[owner] = output_dq.get(owner, 0.0) + k.ms_per_run
                continue
        ms[b] = ms.get(b, 0.0) + k.ms_per_run
        if b not in kernel or k.ms_per_run > kernel[b][0]:
            kernel[b] = (k.ms_per_run, k.op_type)
            integer[b] = k.integer
        for name in k.nodes:
            u = index[name]
            if u != b:
                fused.setdefault(u, user.names[b])
    kinds = {b: op for b, (_, op) in kernel.items()}
    for u, into in fused.items():
        kinds.setdefault(u, f"fused into {into}")
    return _Side(ms, kinds, integer, qdq, output_dq, run.profile.kernel_ms)


def node_rows(fp32: ModelRun, int8: ModelRun | None) -> tuple[NodeLatency, ...]:
    """One row per user node: the FP32 model's nodes, paired with the INT8 model's node of the same name
    (else of the same first output) and op, then the INT8 model's own nodes; Q/DQ nodes are no rows."""
    a = _side(fp32)
    b = _side(int8) if int8 is not None else None
    pairs = _pairs(fp32.user, int8.user) if int8 is not None else {}
    rows = []
    for i, node in enumerate(fp32.user.nodes):
        if node.op_type in QDQ_OPS:
            continue
        j = pairs.get(i)
        rows.append(_row(fp32.user.names[i], node.op_type, a, i, int8, b, j))
    if int8 is not None and b is not None:
        paired = set(pairs.values())
        for j, node in enumerate(int8.user.nodes):
            if node.op_type in QDQ_OPS or j in paired:
                continue
            rows.append(_row(int8.user.names[j], node.op_type, None, None, int8, b, j))
    return tuple(rows)


def _pairs(fp32: GraphIndex, int8: GraphIndex) -> dict[int, int]:
    """FP32 node -> INT8 node: the same name (``quantize_static`` keeps names), else the same op on the
    same first output, else the same op reading the same float tensor (through the INT8 model's Q/DQ:
    the quantizer renames a Conv's output when it drops the Relu after it)."""
    by_name = {(n.name, n.op_type): j for j, n in enumerate(int8.nodes) if n.name}
    by_output = {(n.output[0], n.op_type): j for j, n in enumerate(int8.nodes) if n.output and n.output[0]}
    by_input: dict[tuple[str, str], int] = {}
    for j, n in enumerate(int8.nodes):
        if n.input and n.op_type not in QDQ_OPS:
            by_input.setdefault((_float_source(int8, n.input[0]), n.op_type), j)
    out: dict[int, int] = {}
    for i, n in enumerate(fp32.nodes):
        for key, table in (((n.name, n.op_type), by_name), ((n.output[0] if n.output else "", n.op_type), by_output),
                           ((n.input[0] if n.input else "", n.op_type), by_input)):  # fmt: skip
            j = table.get(key)
            if j is not None and j not in out.values():
                out[i] = j
                break
    return out


def _float_source(user: GraphIndex, tensor: str) -> str:
    """The float tensor behind ``tensor``: back through DequantizeLinear and QuantizeLinear."""
    seen = set()
    while tensor in user.producer and tensor not in seen:
        seen.add(tensor)
        p = user.nodes[user.producer[tensor]]
        if p.op_type not in QDQ_OPS or not p.input:
            break
        tensor = p.input[0]
    return tensor


def _row(
    name: str, op: str, a: _Side | None, i: int | None, int8: ModelRun | None, b: _Side | None, j: int | None
) -> NodeLatency:
    fp32_ms = a.ms.get(i, 0.0) if a is not None and i is not None else 0.0
    fp32_kernel = (a.kernel.get(i, "-") if a is not None and i is not None else "-")
    if int8 is None or b is None:
        return NodeLatency(name, op, fp32_ms, 0.0, 0.0, fp32_kernel, "-", False)
    if j is None:
        return NodeLatency(name, op, fp32_ms, 0.0, 0.0, fp32_kernel, "removed", False)
    row = NodeLatency(
        name=name,
        op_type=op,
        fp32_ms=fp32_ms,
        int8_ms=b.ms.get(j, 0.0),
        qdq_ms=b.qdq_ms.get(j, 0.0),
        fp32_kernel=fp32_kernel,
        int8_kernel=b.kernel.get(j, "-"),
        integer=b.integer.get(j, False),
        output_dq_ms=b.output_dq_ms.get(j, 0.0),
    )
    return _with_cause(row, int8.user, j, own_kernel=j in b.ms, kernel_ms=b.kernel_ms)


def _with_cause(row: NodeLatency, user: GraphIndex, j: int, *, own_kernel: bool, kernel_ms: float) -> NodeLatency:
    """The cause of a node's lost time (``CAUSES``), from its place between Q/DQ and its kernel.

    ``qdq-overhead`` needs Q/DQ time that is no noise and could be won: the Q/DQ around the node without
    a graph output's DequantizeLinear, at least :data:`QDQ_OVERHEAD_MIN_MS` and
    :data:`QDQ_OVERHEAD_MIN_SHARE` of the INT8 model's ``kernel_ms``, and more than its kernel saves."""
    from dataclasses import replace

    node = user.nodes[j]
    after_dq = any(
        user.nodes[user.producer[t]].op_type == "DequantizeLinear"
        for t in user.activations(node.input)
        if t in user.producer
    )
    before_q = any(
        user.nodes[c].op_type == "QuantizeLinear" for t in node.output for c in user.consumers.get(t, ())
    )
    float_kernel = own_kernel and not row.integer
    if node.op_type == "BatchNormalization" and (after_dq or before_q) and float_kernel:
        return replace(row, cause="unfolded-batchnorm")
    if after_dq and before_q and float_kernel:
        return replace(row, cause="no-integer-kernel")
    overhead = row.qdq_ms - row.output_dq_ms
    floor = max(QDQ_OVERHEAD_MIN_MS, QDQ_OVERHEAD_MIN_SHARE * kernel_ms)
    if overhead >= floor and 0 < row.fp32_ms - row.int8_ms < overhead:  # a slower integer kernel: no Q/DQ matter
        return replace(row, cause="qdq-overhead")
    return row


# --------------------------------------------------------------------------- the command


def run_profile(
    fp32_path: str | Path,
    quant_path: str | Path | None,
    data_source: str,
    *,
    runs: int = 20,
    config: SessionConfig | None = None,
    batch_size: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> ProfileReport:
    """Profile the FP32 model and, when given, its static INT8 model on the same batches.

    Both models are read from their files (ORT loads them itself, external data included) and never
    written; the traces and optimized graphs live in a temporary folder removed on return.
    """
    import onnxruntime as ort

    from qdebug import __version__
    from qdebug.data import model_input_specs, open_data
    from qdebug.graph.load import load_model

    if runs < 1:
        raise QDebugError(f"--runs must be >= 1 (got {runs})", "pass a positive number of runs", ExitCode.USAGE)
    config = config or SessionConfig()
    say = progress or (lambda _msg: None)
    fp32 = load_model(fp32_path, "FP32 model")
    quant = load_model(quant_path, "INT8 model") if quant_path is not None else None
    specs = model_input_specs(fp32.proto)
    if quant is not None:
        _check_same_inputs(fp32.proto, quant.proto, quant.path)
    data = open_data(data_source, specs, batch_size=batch_size, what="data", limit_flag=None)
    feeds = [dict(b.feeds) for b in islice(data.batches(), runs)]
    if not feeds:
        raise QDebugError(f"data source {data_source} yields no samples", "give at least one sample", ExitCode.DATA)
    models = [ModelToProfile(fp32.path, fp32.proto, fp32.sha256, "FP32 model")]
    if quant is not None:
        models.append(ModelToProfile(quant.path, quant.proto, quant.sha256, "INT8 model"))
    with tempfile.TemporaryDirectory(prefix="qdebug-profile-") as tmp:
        which = "the FP32 and the INT8 model in turn" if quant is not None else "the FP32 model"
        say(f"profiling {which} ({runs} runs each)")
        done = profile_models(models, feeds, config, runs=runs, scratch=Path(tmp))
    a, b = done[0], (done[1] if quant is not None else None)
    rows = node_rows(a, b)
    notes = []
    if b is None:
        verdict = "FP32 only: give the static INT8 model (QUANT.onnx) to compare"
    else:
        verdict = verdict_line(a.profile.wall_p50_ms, b.profile.wall_p50_ms, rows)
        if not any(k.integer for k in b.profile.kernels if k.nodes):
            notes.append(f"{quant.path if quant else ''} runs no integer kernel: is it a quantized model?")
    return ProfileReport(
        schema_version=PROFILE_SCHEMA_VERSION,
        kind="profile",
        qdebug_version=__version__,
        ort_version=ort.__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        data=str(data_source),
        batches=len(feeds),
        provider=config.providers[0] if config.providers else "CPUExecutionProvider",
        threads=config.intra_op_threads,
        fp32=a.profile,
        int8=b.profile if b is not None else None,
        nodes=rows,
        verdict=verdict,
        notes=tuple(notes),
    )


def _check_same_inputs(fp32: onnx.ModelProto, quant: onnx.ModelProto, path: Path) -> None:
    """The INT8 model runs on the FP32 model's data: it must take the same inputs."""
    from qdebug.data import model_input_specs

    a = {s.name for s in model_input_specs(fp32)}
    b = {s.name for s in model_input_specs(quant)}
    if a != b:
        raise QDebugError(
            f"INT8 model {path} takes inputs {sorted(b)}, the FP32 model {sorted(a)}",
            "give the INT8 model quantized from this FP32 model",
            ExitCode.DATA,
        )


__all__ = [
    "ORT_INSERTED",
    "QDQ_OVERHEAD_MIN_MS",
    "QDQ_OVERHEAD_MIN_SHARE",
    "GraphIndex",
    "KernelMapping",
    "ModelToProfile",
    "Trace",
    "base_ops",
    "map_kernels",
    "node_rows",
    "parse_trace",
    "profile_models",
    "qdq_owner",
    "run_profile",
    "subgraph_parents",
    "timed_rounds",
]
