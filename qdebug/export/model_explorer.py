"""A report as Google Model Explorer *node data*: the graph, coloured by error (``qdebug export model-explorer``).

Model Explorer (``ai-edge-model-explorer``) with its ONNX adapter (``model-explorer-onnx``) draws an ONNX
graph and colours its nodes from node data files: one value per node, and thresholds or a gradient that
turn a value into a colour. One file is written per number of the report (:data:`METRICS`) and, with a
proposal, one of the action it takes per node, each built from Model Explorer's own dataclasses
(:mod:`model_explorer.node_data_builder`: ``ModelNodeData`` of one ``GraphNodeData``).

* **Node ids.** The adapter names a node by its ``NodeProto.name`` (``<node_i>`` when it has none) and its
  main graph by ``GraphProto.name``. The normalized model the report points at (``report.normalized_model``)
  names every node, with the names the report uses, so the files are keyed by the report's node names under
  that model's graph name: open the normalized model, not the original one (whose unnamed nodes the adapter
  calls ``<node_i>``). An unnamed graph is keyed both ``""`` and ``"<main>"`` (the adapter's name for it,
  depending on its onnx-ir version).
* **Values.** JSON has no nan or inf, and Model Explorer leaves a node without a value uncoloured: a node
  whose number is not finite (an exact tensor's +inf SQNR, a node adding no noise, nothing quantized) has
  no entry.
* **Colours.** Added noise and the SQNRs by fixed thresholds, the TUI's: red for an SQNR up to 20 dB or a
  node adding more than -20 dB of noise (alone, it takes a clean signal to 20 dB SQNR), amber up to 30 dB
  (-30 dB), light green beyond. KL has no absolute scale: a gradient from white (the lowest value) to red
  (the highest). A proposal's actions (``fp32``, ``int16``, ``clip``, ``per-channel``, ``reduce-range``;
  ``recipe`` for a node whose weights its whole-model recipe rewrote, ``folded`` for one it folded away;
  ``unchanged`` for the other quantized nodes) are strings, one colour each.

The packages are imported only here, when an export runs: without the ``viz`` extra the export fails in
one line before it reads anything (exit 2, like an unavailable execution provider).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import atomic_write_text, check_outputs_spare_inputs, check_writable
from qdebug.records import NodeRecord, Proposal, Report
from qdebug.vocabulary import FIX_KINDS, RECIPE_COLOURS, RUN_TIME_OPS, quantizer_of

RED = "#e53935"
AMBER = "#ffb300"
GREEN = "#a5d6a7"
WHITE = "#ffffff"

INSTALL_HINT = "pip install 'qdebug[viz]'"
UNCHANGED = "unchanged"
ACTION_COLOURS = {
    **{k: FIX_KINDS[k].colour for k in reversed(FIX_KINDS)},
    **RECIPE_COLOURS,
    UNCHANGED: "#e0e0e0",
}
"""Colour of each proposal action, the most drastic first: a node with several takes its first one's."""
ACTION_FILE = "action"


@dataclass(frozen=True)
class Metric:
    """One node data file: a number of :class:`~qdebug.records.NodeRecord` and how it is coloured."""

    key: str
    """The record's field, and the file's stem."""
    title: str
    """The name Model Explorer shows for the file."""
    bands: tuple[tuple[float, str], ...] = ()
    """``(upper bound, colour)``, ascending: a value up to a bound takes that band's colour."""
    above: str = ""
    """The colour of values above the last band; ``""``: a gradient instead, white to red."""

    def value(self, node: NodeRecord) -> float:
        """The node's number."""
        return float(getattr(node, self.key))


METRICS = (
    Metric("added_noise_db", "added noise dB (red > -20, amber > -30)", ((-30.0, GREEN), (-20.0, AMBER)), RED),
    Metric("accumulated_sqnr_db", "accumulated SQNR dB (red <= 20, amber <= 30)", ((20.0, RED), (30.0, AMBER)), GREEN),
    Metric("local_sqnr_db", "local SQNR dB (red <= 20, amber <= 30)", ((20.0, RED), (30.0, AMBER)), GREEN),
    Metric("kl", "KL (white: lowest, red: highest)"),
)
"""The files written for every report, in this order."""
LATENCY = Metric("int8_ms_lost", "INT8 ms lost per run vs FP32 (green: saved, red: lost; analyze --profile)",
                 ((0.0, GREEN),), RED)  # fmt: skip
"""The file written for a report with a profile (``analyze --profile``): each node's INT8 time less its FP32
time, Q/DQ kernels around it included."""


@dataclass(frozen=True)
class NodeDataFile:
    """One file written."""

    path: Path
    title: str
    nodes: int
    """Nodes with a value (coloured)."""
    left_out: int
    """The report's nodes without one (not finite; for the action file: not quantized)."""


@dataclass(frozen=True)
class ModelExplorerExport:
    """What :func:`export_model_explorer` wrote, and what to open it with."""

    model: Path
    """The model to open: the report's normalized model, whose node names the files use."""
    graph_ids: tuple[str, ...]
    files: tuple[NodeDataFile, ...]

    def command(self) -> str:
        """The shell command that opens the model with every file (``--node_data_paths`` is comma-separated)."""
        paths = ",".join(str(f.path) for f in self.files)
        return shlex.join(
            ["model-explorer", str(self.model), "--extensions=model_explorer_onnx", f"--node_data_paths={paths}"]
        )


def _builder() -> Any:
    """Model Explorer's node data module, or the one-line error that says how to install it."""
    try:
        import model_explorer_onnx  # noqa: F401  (the adapter the printed command loads)
        from model_explorer import node_data_builder
    except ImportError as e:
        raise QDebugError(
            f"qdebug export model-explorer needs Google Model Explorer and its ONNX adapter ({e.name} is not "
            "installed)",
            INSTALL_HINT,
            ExitCode.USAGE,
        ) from None
    return node_data_builder


def export_model_explorer(
    report: str | Path, out_dir: str | Path, *, proposal: str | Path | None = None
) -> ModelExplorerExport:
    """Write the node data files of ``report`` (and the actions of ``proposal``) into ``out_dir``.

    Files are ``<metric>.json`` (:data:`METRICS`) and ``action.json``, each written atomically; the
    directory is made when missing. Raises :class:`~qdebug.errors.QDebugError` for a missing extra
    (exit 2), an unreadable report or proposal, a normalized model that is gone or is not the report's
    (exit 3), an output that cannot be written (exit 7).
    """
    from qdebug.output.report_io import load_proposal, load_report

    nd = _builder()
    out = Path(out_dir)
    if "," in str(out.resolve()):
        raise QDebugError(
            f"output directory {out} has a comma in its path, which Model Explorer's --node_data_paths "
            "splits on",
            "choose another -o directory",
            ExitCode.USAGE,
        )
    rep = load_report(report)
    metrics = METRICS + ((LATENCY,) if rep.profile is not None and rep.profile.int8 is not None else ())
    stems = [m.key for m in metrics] + ([ACTION_FILE] if proposal is not None else [])
    paths = {stem: (out / f"{stem}.json").resolve() for stem in stems}
    for path in paths.values():
        check_writable(path)
    check_outputs_spare_inputs(
        {f"-o file {p.name}": p for p in paths.values()}, {"the report": report, "--proposal": proposal}
    )
    prop = load_proposal(proposal) if proposal is not None else None
    model = Path(rep.normalized_model)
    ids = graph_ids(model, rep)
    files = []
    for metric in metrics:
        data = _metric_data(nd, metric, _values(rep, metric))
        files.append(_write(nd, paths[metric.key], ids, data, len(rep.nodes)))
    if prop is not None:
        data = _action_data(nd, rep, prop, str(proposal))
        files.append(_write(nd, paths[ACTION_FILE], ids, data, len(rep.nodes)))
    return ModelExplorerExport(model=model, graph_ids=ids, files=tuple(files))


def graph_ids(model: Path, report: Report) -> tuple[str, ...]:
    """The ids the ONNX adapter gives the model's main graph, checking that the model holds the report's
    nodes (it is the model their names come from)."""
    import onnx

    if not model.is_file():
        raise QDebugError(
            f"the normalized model {model} (recorded in the report) is not there",
            "re-run qdebug analyze, which writes it next to the report",
            ExitCode.INPUT,
        )
    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and others for a file that is not a model
        raise QDebugError(
            f"cannot read the normalized model {model}: {e}", "re-run qdebug analyze", ExitCode.INPUT
        ) from None
    names = {n.name for n in proto.graph.node}
    missing = [n.name for n in report.nodes if n.name not in names]
    if missing:
        raise QDebugError(
            f"the normalized model {model} lacks {len(missing)} of the report's nodes ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): it is not the model the report was made from",
            "re-run qdebug analyze",
            ExitCode.INPUT,
        )
    return (proto.graph.name,) if proto.graph.name else ("", "<main>")


def _values(report: Report, metric: Metric) -> dict[str, float]:
    """Each node's number for ``metric``: a record field, or the profile's INT8-minus-FP32 time."""
    if metric is LATENCY:
        assert report.profile is not None
        return {n.name: -n.saved_ms for n in report.profile.nodes}
    return {node.name: metric.value(node) for node in report.nodes}


def _rounded(x: float) -> float:
    return float(f"{x:.6g}")


def _metric_data(nd: Any, metric: Metric, values: dict[str, float]) -> Any:
    """One number's ``GraphNodeData``: the finite values (by node name), with thresholds (or a gradient)."""
    results = {}
    for name, x in values.items():
        if math.isfinite(x):
            results[name] = nd.NodeDataResult(value=_rounded(x))
    if not metric.above:
        gradient = [
            nd.GradientItem(stop=0, bgColor=WHITE),
            nd.GradientItem(stop=0.5, bgColor=AMBER),
            nd.GradientItem(stop=1, bgColor=RED),
        ]
        return nd.GraphNodeData(results=results, name=metric.title, gradient=gradient)
    # a value above the last threshold would stay uncoloured: the last band reaches the largest value
    top = max([r.value for r in results.values()] + [metric.bands[-1][0]])
    thresholds = [nd.ThresholdItem(value=v, bgColor=c) for v, c in metric.bands]
    thresholds.append(nd.ThresholdItem(value=top, bgColor=metric.above))
    return nd.GraphNodeData(results=results, name=metric.title, thresholds=thresholds)


def node_actions(report: Report, proposal: Proposal, where: str = "the proposal") -> dict[str, str]:
    """Node -> what ``proposal`` does to it (``fp32``, ``clip+reduce-range``, ...; ``unchanged`` for the
    other quantized nodes), refusing a proposal that names nodes the report does not have."""
    actions: dict[str, list[str]] = {}
    for name in proposal.nodes_to_exclude:
        actions.setdefault(name, []).append("fp32")
    for reason in proposal.reasons:
        if reason.node and reason.action not in actions.get(reason.node, []):
            actions.setdefault(reason.node, []).append(reason.action)
    if proposal.recipe is not None:  # the whole-model recipe's own changes: weights rewritten, nodes folded
        for name in proposal.recipe.changed:
            actions.setdefault(name, []).append("recipe")
        for name in proposal.recipe.removed:
            actions.setdefault(name, []).append("folded")
    known = {n.name for n in report.nodes}
    unknown = [name for name in actions if name not in known]
    if unknown:
        raise QDebugError(
            f"{where} names node(s) the report does not have ({', '.join(unknown[:3])}"
            f"{', ...' if len(unknown) > 3 else ''}): it was made from another model",
            "pass the proposal made from this report",
            ExitCode.INPUT,
        )
    order = list(ACTION_COLOURS)
    recipe = proposal.recipe
    run_time = recipe is not None and quantizer_of(recipe.steps or (recipe.name,)) == "dynamic"
    out = {}
    for node in report.nodes:
        if node.name in actions:
            done = sorted(actions[node.name], key=lambda a: order.index(a) if a in order else len(order))
            out[node.name] = "+".join(done)
        elif node.op_type in RUN_TIME_OPS if run_time else node.quantized:  # quantize_dynamic's own nodes
            out[node.name] = UNCHANGED
    return out


def _action_data(nd: Any, report: Report, proposal: Proposal, where: str) -> Any:
    """The proposal's ``GraphNodeData``: string values, each node coloured by its most drastic action."""
    results = {}
    for name, action in node_actions(report, proposal, where).items():
        colour = ACTION_COLOURS.get(action.split("+")[0], RED)
        results[name] = nd.NodeDataResult(value=action, bgColor=colour)
    whole = any(r.action == "per-channel" and not r.node for r in proposal.reasons)
    title = "proposal: action per node" + (" (and per-channel weights for the whole model)" if whole else "")
    if proposal.recipe is not None:
        title += f"; recipe {'+'.join(proposal.recipe.steps) or proposal.recipe.name}"
    return nd.GraphNodeData(
        results=results,
        name=title,
        showExpandedSummaryOnGroupNode=True,
        showLabelCountColumnsInChildrenStatsTable=True,
    )


def _write(nd: Any, path: Path, ids: tuple[str, ...], data: Any, nodes: int) -> NodeDataFile:
    text = nd.ModelNodeData(graphsData=dict.fromkeys(ids, data)).to_json_string(indent=2)
    atomic_write_text(path, text + "\n")
    return NodeDataFile(path=path, title=data.name, nodes=len(data.results), left_out=nodes - len(data.results))
