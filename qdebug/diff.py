"""Two analysis reports compared: which nodes got better or worse, and by how much (``qdebug diff``).

The reports may come from the same model (another calibration method, ORT version or data set) or from
two versions of it, so nodes are paired through the graph, never by position in the file:

1. **Names.** A node the user's model named (``original_name`` not empty) pairs with the node of the same
   name and op type in the other report. Names qdebug generated for unnamed nodes (``Relu_5``) are
   positions, not names -- they shift when a node is inserted -- so those nodes go to step 2.
2. **Structure**, repeated until nothing more pairs, each pass in the reports' topological order:

   a. same op type (and domain), same topological depth and the same inputs: each input is the same
      output index of an already paired producer, the graph input paired with it, or a constant;
   b. the same without the depth (a node was inserted or removed upstream);
   c. same op type and the same consumers: every consumer paired, reading the same output index at the
      same input position, and graph outputs at the same place (walked from the outputs back, for
      nodes whose producer changed).

   Several candidates with one key (siblings of one op reading the same tensors) pair in topological
   order, the first of B with the first of A -- unless one of them has the B node's own name. Graph
   inputs and outputs pair by name, then the rest by position among the unpaired ones.

Tensors pair through their producers (output ``k`` of paired nodes), graph inputs as above. Everything
is deterministic: the same two reports give the same pairing and the same numbers, in the same order.

Standard library only (records and report I/O), like the light layer, though it sits in the engine.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qdebug import __version__
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.report_io import load_record, load_report
from qdebug.records import NodeRecord, Report, TensorRecord
from qdebug.records.diff import (
    COMPARISON_KIND,
    DIFF_SCHEMA_VERSION,
    SAME_DB,  # defined with the records (the TUI and the tables read it), imported from here too
    Comparison,
    DiffReport,
    NodeChange,
    OutputChange,
    ReportSide,
    SettingChange,
    TaskSide,
    TensorBest,
    TensorChange,
    negligible_noise,
    negligible_sqnr,
)

SETTINGS = (
    "method",
    "per_channel",
    "activation_type",
    "weight_type",
    "calib",
    "eval",
    "metric",
    "batch_size",
    "max_samples",
    "fakequant_samples",
    "quantized_given",
    "upgrade_opset",
    "inline_constant_if",
)
"""The :class:`~qdebug.records.AnalysisConfig` fields a diff compares, in the order it lists them."""


# --------------------------------------------------------------------------- the graph of one report


@dataclass
class _Graph:
    """One report's nodes with the edges the pairing walks (built once per report)."""

    nodes: Sequence[NodeRecord]
    inputs: Sequence[str]
    outputs: Sequence[str]
    producer: dict[str, tuple[str, int]] = field(default_factory=dict)
    """tensor -> (producing node, output index)."""
    consumers: dict[str, list[tuple[int, str, int]]] = field(default_factory=dict)
    """node -> (output index, consumer, input position) for every edge leaving it."""
    by_name: dict[str, NodeRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in self.nodes:
            self.by_name[n.name] = n
            for k, out in enumerate(n.outputs):
                if out:
                    self.producer[out] = (n.name, k)
        for n in self.nodes:
            for j, t in enumerate(n.inputs):
                src = self.producer.get(t) if t else None
                if src is not None:
                    self.consumers.setdefault(src[0], []).append((src[1], n.name, j))


def _graph(report: Report) -> _Graph:
    return _Graph(report.nodes, report.model.inputs, report.model.outputs)


def pair_names(a: Sequence[str], b: Sequence[str]) -> dict[str, str]:
    """B name -> A name for two lists of graph inputs (or outputs): equal names first, then the unpaired
    ones by position among themselves."""
    pairs = {n: n for n in b if n in set(a)}
    rest_a = [n for n in a if n not in pairs]
    rest_b = [n for n in b if n not in pairs]
    pairs.update(zip(rest_b, rest_a, strict=False))
    return pairs


_Key = tuple
_KeyOf = Callable[[NodeRecord, _Graph, dict[str, str], dict[str, str], dict[str, str]], "_Key | None"]


def _input_parts(node: NodeRecord, g: _Graph, to_a: dict[str, str], inputs: dict[str, str]) -> _Key | None:
    """The node's inputs in A's terms (``None`` while a producer is unpaired)."""
    parts = []
    for t in node.inputs:
        src = g.producer.get(t) if t else None
        if not t:
            parts.append(("none", "", 0))
        elif src is not None:
            if src[0] not in to_a:
                return None
            parts.append(("node", to_a[src[0]], src[1]))
        elif t in g.inputs:
            if t not in inputs:
                return None
            parts.append(("input", inputs[t], 0))
        else:
            parts.append(("const", "", 0))
    return tuple(parts)


def _strict_key(node, g, to_a, inputs, outputs) -> _Key | None:
    parts = _input_parts(node, g, to_a, inputs)
    return None if parts is None else (node.op_type, node.domain, node.depth, parts)


def _relaxed_key(node, g, to_a, inputs, outputs) -> _Key | None:
    parts = _input_parts(node, g, to_a, inputs)
    return None if parts is None else (node.op_type, node.domain, parts)


def _consumer_key(node, g, to_a, inputs, outputs) -> _Key | None:
    """Op type and every consumer (paired) with where it reads the node, plus the graph outputs it makes."""
    parts = []
    for k, consumer, j in g.consumers.get(node.name, ()):
        if consumer not in to_a:
            return None
        parts.append(("node", to_a[consumer], k, j))
    for k, out in enumerate(node.outputs):
        if out in g.outputs:
            if out not in outputs:
                return None
            parts.append(("output", outputs[out], k, 0))
    return (node.op_type, node.domain, tuple(sorted(parts))) if parts else None


def _sweep(
    a: _Graph, b: _Graph, pairs: dict[str, str], io: tuple[dict, dict], key_of: _KeyOf, reverse: bool
) -> bool:
    """One pass of structural pairing with ``key_of``; ``pairs`` (B -> A) grows. True when it did."""
    used = set(pairs.values())
    identity = {n.name: n.name for n in a.nodes}
    a_in = {n: n for n in a.inputs}
    a_out = {n: n for n in a.outputs}
    order_a = list(reversed(a.nodes)) if reverse else list(a.nodes)
    groups: dict[_Key, deque[str]] = {}
    for n in order_a:
        if n.name not in used:
            key = key_of(n, a, identity, a_in, a_out)
            if key is not None:
                groups.setdefault(key, deque()).append(n.name)
    grew = False
    for n in reversed(b.nodes) if reverse else b.nodes:
        if n.name in pairs:
            continue
        key = key_of(n, b, pairs, io[0], io[1])
        queue = groups.get(key) if key is not None else None
        if queue:
            pairs[n.name] = _take(queue, n.name)
            grew = True
    return grew


def _take(queue: deque[str], name: str) -> str:
    """The candidate of that name if there is one (a generated name that did not move), else the first."""
    if name in queue and queue[0] != name:
        queue.remove(name)
        return name
    return queue.popleft()


def pair_nodes(a: Report, b: Report) -> dict[str, tuple[str, str]]:
    """B node -> (A node, ``name`` or ``structure``), by the rule in this module's docstring."""
    ga, gb = _graph(a), _graph(b)
    named_a = {n.name: n for n in a.nodes if n.original_name}
    pairs: dict[str, str] = {}
    for n in b.nodes:
        m = named_a.get(n.name) if n.original_name else None
        if m is not None and (m.op_type, m.domain) == (n.op_type, n.domain):
            pairs[n.name] = m.name
    by_name = set(pairs)
    io = (pair_names(ga.inputs, gb.inputs), pair_names(ga.outputs, gb.outputs))
    passes = ((_strict_key, False), (_relaxed_key, False), (_consumer_key, True))
    while any(_sweep(ga, gb, pairs, io, key, reverse) for key, reverse in passes):
        pass  # any() stops at the first pass that paired something: back to the strictest
    return {bn: (an, "name" if bn in by_name else "structure") for bn, an in pairs.items()}


def pair_tensors(a: Report, b: Report, nodes: dict[str, tuple[str, str]]) -> list[tuple[TensorRecord, TensorRecord]]:
    """(A tensor, B tensor) for every float tensor of B with a counterpart in A, in B's order."""
    ga, gb = _graph(a), _graph(b)
    inputs = pair_names(ga.inputs, gb.inputs)
    a_tensors = {t.name: t for t in a.tensors}
    out = []
    for t in b.tensors:
        src = gb.producer.get(t.name)
        if src is not None:
            pair = nodes.get(src[0])
            outs = ga.by_name[pair[0]].outputs if pair is not None else ()
            name = outs[src[1]] if src[1] < len(outs) else None
        else:
            name = inputs.get(t.name)
        if name is not None and name in a_tensors:
            out.append((a_tensors[name], t))
    return out


# --------------------------------------------------------------------------- the deltas


def delta(b: float, a: float) -> float:
    """``b - a``, with equal values (``inf`` and ``inf`` included) giving 0."""
    return 0.0 if a == b else b - a


def _linear(db: float) -> float:
    """A dB value as a power ratio (``-inf`` -> 0)."""
    if math.isnan(db):
        return math.nan
    try:
        return 10.0 ** (db / 10.0)
    except OverflowError:
        return math.inf


def verdict(
    added_delta: float,
    accumulated_delta: float,
    added: tuple[float, float] | None = None,
    accumulated: tuple[float, float] | None = None,
) -> str:
    """``worse``/``better``/``same`` by the added-noise delta (up is worse), else by the accumulated SQNR
    delta (up is better) when the added noise is undefined; ``unscored`` when neither is defined.

    ``added``, ``accumulated``: both sides' values (A, B). Where both are negligible -- added noise at or
    below -60 dB, an SQNR at or above 60 (:data:`~qdebug.records.diff.NEGLIGIBLE_NOISE_DB`) -- the delta
    is ``same`` whatever its size: -inf -> -155.6 dB of added noise is float rounding, not a +inf change."""
    sides = (
        (added_delta, True, added is not None and negligible_noise(*added)),
        (accumulated_delta, False, accumulated is not None and negligible_sqnr(*accumulated)),
    )
    for d, up_is_worse, negligible in sides:
        if math.isnan(d):
            continue
        if negligible or abs(d) <= SAME_DB:
            return "same"
        return "worse" if (d > 0) == up_is_worse else "better"
    return "unscored"


def _node_change(na: NodeRecord, nb: NodeRecord, how: str) -> NodeChange:
    added = delta(nb.added_noise_db, na.added_noise_db)
    acc = delta(nb.accumulated_sqnr_db, na.accumulated_sqnr_db)
    return NodeChange(
        name_a=na.name,
        name_b=nb.name,
        op_type=nb.op_type,
        paired_by=how,
        depth_a=na.depth,
        depth_b=nb.depth,
        added_noise_a_db=na.added_noise_db,
        added_noise_b_db=nb.added_noise_db,
        added_noise_delta_db=added,
        accumulated_sqnr_a_db=na.accumulated_sqnr_db,
        accumulated_sqnr_b_db=nb.accumulated_sqnr_db,
        accumulated_sqnr_delta_db=acc,
        local_sqnr_a_db=na.local_sqnr_db,
        local_sqnr_b_db=nb.local_sqnr_db,
        local_sqnr_delta_db=delta(nb.local_sqnr_db, na.local_sqnr_db),
        introduced_a_db=na.introduced_db,
        introduced_b_db=nb.introduced_db,
        kl_a=na.kl,
        kl_b=nb.kl,
        kl_delta=delta(nb.kl, na.kl),
        noise_change=delta(_linear(nb.added_noise_db), _linear(na.added_noise_db)),
        verdict=verdict(
            added,
            acc,
            (na.added_noise_db, nb.added_noise_db),
            (na.accumulated_sqnr_db, nb.accumulated_sqnr_db),
        ),
        quantized_a=na.quantized,
        quantized_b=nb.quantized,
    )


def _sqnr(stats) -> float:
    return math.nan if stats is None else stats.sqnr_db


def _kl(stats) -> float:
    return math.nan if stats is None else stats.kl


def _tensor_change(ta: TensorRecord, tb: TensorRecord) -> TensorChange:
    acc_a, acc_b = _sqnr(ta.accumulated), _sqnr(tb.accumulated)
    loc_a, loc_b = _sqnr(ta.local), _sqnr(tb.local)
    kl_a, kl_b = _kl(ta.accumulated), _kl(tb.accumulated)
    return TensorChange(
        name_a=ta.name,
        name_b=tb.name,
        paired_by="name" if ta.name == tb.name else "structure",
        accumulated_sqnr_a_db=acc_a,
        accumulated_sqnr_b_db=acc_b,
        accumulated_sqnr_delta_db=delta(acc_b, acc_a),
        local_sqnr_a_db=loc_a,
        local_sqnr_b_db=loc_b,
        local_sqnr_delta_db=delta(loc_b, loc_a),
        kl_a=kl_a,
        kl_b=kl_b,
        kl_delta=delta(kl_b, kl_a),
    )


def _rank_key(index: dict[str, int]) -> Callable[[NodeChange], tuple[float, float, int]]:
    """Biggest linear change of added noise first; unscored ones after, by the accumulated SQNR delta."""

    def key(c: NodeChange) -> tuple[float, float, int]:
        noise = -1.0 if math.isnan(c.noise_change) else abs(c.noise_change)
        acc = abs(c.accumulated_sqnr_delta_db) if not math.isnan(c.accumulated_sqnr_delta_db) else 0.0
        return -noise, -acc, index[c.name_b]

    return key


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def setting_changes(a: Report, b: Report) -> list[SettingChange]:
    """Every setting the two reports differ in: the model (by content), the analysis options, ORT and
    qdebug versions, capture samples and the task metric."""
    out = []
    if a.model.sha256 != b.model.sha256:
        out.append(
            SettingChange("model", f"{a.model.path} ({a.model.sha256[:12]})", f"{b.model.path} ({b.model.sha256[:12]})")
        )
    for name in SETTINGS:
        va, vb = getattr(a.config, name), getattr(b.config, name)
        if va != vb:
            out.append(SettingChange(name, _text(va), _text(vb)))
    for name, va, vb in (
        ("ort_version", a.ort_version, b.ort_version),
        ("qdebug_version", a.qdebug_version, b.qdebug_version),
        ("samples", a.samples, b.samples),
        ("task metric", a.task.name if a.task else None, b.task.name if b.task else None),
        ("task data", _task_data(a), _task_data(b)),
    ):
        if va != vb:
            out.append(SettingChange(name, _text(va), _text(vb)))
    return out


def _task_data(r: Report) -> str | None:
    return None if r.task is None else f"{r.task.samples} {r.task.data} samples"


def _task(r: Report) -> TaskSide | None:
    t = r.task
    return None if t is None else TaskSide(t.name, t.fp32, t.quantized, t.samples, t.data)


def output_changes(a: Report, b: Report) -> list[OutputChange]:
    """Each model output's SQNR in both reports (paired by name, then position)."""
    out_a = {o.name: o for o in a.outputs}
    pairs = pair_names([o.name for o in a.outputs], [o.name for o in b.outputs])
    changes = []
    for o in b.outputs:
        oa = out_a.get(pairs.get(o.name, ""))
        if oa is None or not (oa.error.count or o.error.count):  # integer outputs: nothing compared
            continue
        changes.append(OutputChange(oa.name, o.name, oa.error.sqnr_db, o.error.sqnr_db,
                                    delta(o.error.sqnr_db, oa.error.sqnr_db)))  # fmt: skip
    return changes


def _side(r: Report, path: str) -> ReportSide:
    return ReportSide(path, r.model.path, r.model.sha256, r.qdebug_version, r.ort_version, r.created, r.samples,
                      len(r.nodes))  # fmt: skip


UNRELATED_SHARE = 0.5
"""Below this share of the smaller report's nodes paired, the two reports are taken for different models."""


def _unrelated(nodes_a: int, nodes_b: int, paired: int) -> bool:
    """Whether so few nodes pair that A and B look like different models: a diff of two unrelated models had
    exited 0 pairing a few look-alike nodes (``head/gemm -> fc``) without a word, its deltas read as real."""
    smaller = min(nodes_a, nodes_b)
    return smaller > 0 and paired < UNRELATED_SHARE * smaller


def _notes(
    a: Report, b: Report, nodes: Sequence[NodeChange], only_a: Sequence[str], only_b: Sequence[str]
) -> list[str]:
    notes = []
    if _unrelated(len(a.nodes), len(b.nodes), len(nodes)):
        notes.append(f"A and B look like different models: {len(nodes)} of A's {len(a.nodes)} nodes and B's "
                     f"{len(b.nodes)} paired, so the pairs may be unrelated layers")  # fmt: skip
    if a.task is not None and b.task is not None and a.task.name != b.task.name:
        notes.append(f"the task metrics differ ({a.task.name} in A, {b.task.name} in B): compare their drops, "
                     "not their values")  # fmt: skip
    moved = sum(1 for n in nodes if n.paired_by == "structure" and n.name_a != n.name_b)
    if moved:
        notes.append(f"{moved} node(s) have other names in B and were paired by graph structure (op type, "
                     "depth, paired producers or consumers)")  # fmt: skip
    if only_a or only_b:
        notes.append(f"{len(only_a)} node(s) only in A, {len(only_b)} only in B (added, removed or changed "
                     "beyond recognition): not compared")  # fmt: skip
    return notes


def compare(a: Report, b: Report, path_a: str = "A", path_b: str = "B") -> DiffReport:
    """B compared with A: paired nodes (biggest change first) and tensors, settings, task and outputs."""
    nodes = pair_nodes(a, b)
    ga = {n.name: n for n in a.nodes}
    index = {n.name: i for i, n in enumerate(b.nodes)}
    changes = [_node_change(ga[an], nb, how) for nb in b.nodes if nb.name in nodes
               for an, how in (nodes[nb.name],)]  # fmt: skip
    changes.sort(key=_rank_key(index))
    paired_a = {an for an, _ in nodes.values()}
    only_a = tuple(n.name for n in a.nodes if n.name not in paired_a)
    only_b = tuple(n.name for n in b.nodes if n.name not in nodes)
    return DiffReport(
        schema_version=DIFF_SCHEMA_VERSION,
        kind="diff",
        qdebug_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        a=_side(a, path_a),
        b=_side(b, path_b),
        settings=tuple(setting_changes(a, b)),
        task_a=_task(a),
        task_b=_task(b),
        outputs=tuple(output_changes(a, b)),
        nodes=tuple(changes),
        tensors=tuple(_tensor_change(ta, tb) for ta, tb in pair_tensors(a, b, nodes)),
        only_in_a=only_a,
        only_in_b=only_b,
        notes=tuple(_notes(a, b, changes, only_a, only_b)),
    )


def diff_reports(path_a: str | Path, path_b: str | Path) -> DiffReport:
    """Load two reports (one-line errors for anything that is not one) and compare them."""
    return compare(load_report(path_a), load_report(path_b), str(path_a), str(path_b))


def load_diff(path: str | Path) -> DiffReport:
    """Load a ``diff.json`` written by ``qdebug diff --json``, refusing other files."""
    result = load_record(DiffReport, path, "diff", DIFF_SCHEMA_VERSION)
    if result.kind != "diff":
        raise QDebugError(f"{path} is not a qdebug diff (kind {result.kind!r})", "pass a diff.json", ExitCode.INPUT)
    return result


# --------------------------------------------------------------------------- three or more reports


def _labels(reports: Sequence[Report], paths: Sequence[str]) -> tuple[str, ...]:
    """The reports' calibration methods when those tell them apart, else their file names."""
    methods = [r.config.method for r in reports]
    if len(set(methods)) == len(methods):
        return tuple(methods)
    names = [Path(p).name for p in paths]
    return tuple(names) if len(set(names)) == len(names) else tuple(str(p) for p in paths)


def _best(values: Sequence[float]) -> tuple[int, float, tuple[int, ...]]:
    """``(best, margin, leaders)``: the index of the highest number (ties: the first; -1 when none is a
    number), the indices within :data:`SAME_DB` of it (in report order), and the best's margin over the
    highest number outside them; where all lead, over the second highest (nan with fewer than two numbers).
    ``inf`` ties ``inf`` (an exact tensor in two reports)."""
    scored = sorted(((v, -i) for i, v in enumerate(values) if not math.isnan(v)), reverse=True)
    if not scored:
        return -1, math.nan, ()
    top = scored[0][0]
    leaders = tuple(sorted(-i for v, i in scored if v == top or top - v <= SAME_DB))
    rest = [v for v, i in scored if -i not in leaders]
    if rest:
        margin = delta(top, rest[0])
    else:
        margin = delta(top, scored[1][0]) if len(scored) > 1 else math.nan
    return -scored[0][1], margin, leaders


def compare_many(reports: Sequence[Report], paths: Sequence[str]) -> Comparison:
    """Several reports of one model, tensor by tensor: which one quantizes each tensor best (local SQNR:
    its own range, upstream left FP32) and what each reaches with everything upstream quantized too.
    Tensors are paired with the first report's through the graph, as two-way diffs pair them."""
    first = reports[0]
    paired: dict[str, list[TensorRecord | None]] = {t.name: [t] for t in first.tensors}
    for other in reports[1:]:
        found = {ta.name: tb for ta, tb in pair_tensors(first, other, pair_nodes(first, other))}
        for name, row in paired.items():
            row.append(found.get(name))
    rows = []
    for name, row in paired.items():
        if any(t is None for t in row):
            continue
        local = tuple(_sqnr(t.local) for t in row)  # type: ignore[union-attr]
        best, margin, leaders = _best(local)
        if best < 0:
            continue  # quantized in none of them
        acc = tuple(_sqnr(t.accumulated) for t in row)  # type: ignore[union-attr]
        rows.append(TensorBest(name, local, acc, best, margin, leaders))
    n = len(reports)
    # ties last (their margin is within SAME_DB), then the biggest margin first
    rows.sort(key=lambda r: (r.tied(n), -(r.margin_db if math.isfinite(r.margin_db) else -1.0)))
    won = [r for r in rows if not r.tied(n)]
    wins = tuple(sum(1 for r in won if i in r.leaders) for i in range(n))
    shared = tuple(sum(1 for r in won if i in r.leaders and len(r.leaders) > 1) for i in range(n))
    notes = []
    unpaired = len(first.tensors) - len(paired) + sum(1 for row in paired.values() if any(t is None for t in row))
    if unpaired:
        notes.append(f"{unpaired} tensor(s) of {paths[0]} have no counterpart in every other report: not compared")
    models = {r.model.sha256 for r in reports}
    if len(models) > 1:
        notes.append("the reports are of different models: tensors were paired through the graph")
    return Comparison(
        schema_version=DIFF_SCHEMA_VERSION,
        kind=COMPARISON_KIND,
        qdebug_version=__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        labels=_labels(reports, paths),
        sides=tuple(_side(r, str(p)) for r, p in zip(reports, paths, strict=True)),
        tasks=tuple(_task(r) for r in reports),
        tensors=tuple(rows),
        wins=wins,
        notes=tuple(notes),
        ties=len(rows) - len(won),
        shared=shared,
    )


def compare_reports(paths: Sequence[str | Path]) -> Comparison:
    """Load three or more reports and compare them (:func:`compare_many`)."""
    return compare_many([load_report(p) for p in paths], [str(p) for p in paths])
