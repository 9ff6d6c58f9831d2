"""`qdebug export model-explorer`: node data files keyed like the ONNX adapter keys the graph, loaded back
through Model Explorer's own packages (the ``viz`` extra); the tests that need them skip without it."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import shlex
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from qdebug.cli.main import main
from qdebug.errors import ExitCode
from qdebug.export.model_explorer import ACTION_COLOURS, AMBER, GREEN, METRICS, RED, graph_ids
from qdebug.output.report_io import dumps, load_report, save_report
from qdebug.records import SCHEMA_VERSION, NodeReason, Proposal
from tests.conftest import strict_json
from tests.models import small_cnn, small_data
from tests.test_errors import assert_one_line


def _viz():
    """Model Explorer's node data classes, dacite (its deserializer) and the ONNX adapter; skip without them."""
    nd = pytest.importorskip("model_explorer.node_data_builder", reason="the viz extra is not installed")
    dacite = pytest.importorskip("dacite", reason="the viz extra is not installed")
    adapter = pytest.importorskip("model_explorer_onnx.main", reason="the viz extra is not installed")
    return nd, dacite, adapter


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """The report of small_cnn (two unnamed nodes, named Relu_5 and GlobalAveragePool_6 by normalization)."""
    tmp = tmp_path_factory.mktemp("me")
    model, data = small_cnn(tmp / "m.onnx"), small_data(tmp / "c.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
        assert main(["analyze", str(model), "--calib", str(data), "-o", str(tmp / "r.json"), "-q"]) == 0
    return tmp / "r.json"


def _proposal(report: Path, path: Path, exclude=("fc",), clip="conv2") -> Path:
    rep = load_report(report)
    reasons = (
        NodeReason("fc", "fc", "Gemm", "fp32", "kept FP32"),
        NodeReason(clip, clip, "Conv", "clip", "range clipped"),
        NodeReason("", "", "", "per-channel", "per-channel weights"),
    )
    proposal = Proposal(
        schema_version=SCHEMA_VERSION,
        kind="proposal",
        model_path=rep.model.path,
        model_sha256=rep.model.sha256,
        normalized_model=rep.normalized_model,
        nodes_to_exclude=tuple(exclude),
        per_channel=True,
        reasons=reasons,
    )
    path.write_text(dumps(proposal), encoding="utf-8")
    return path


def _colour(data: dict, value: float) -> str:
    """Model Explorer's ``getBgColor`` (web_app/main-*.js): a gradient when one is given, else the first
    threshold the value does not exceed; beyond the last, transparent."""
    assert not data.get("gradient"), "a gradient file"
    return next((t["bgColor"] for t in data["thresholds"] if value <= t["value"]), "transparent")


def _adapter_graphs(adapter, model: Path) -> dict[str, set[str]]:
    """Graph id -> node ids, as the ONNX adapter converts the model for Model Explorer."""
    graphs = adapter.ONNXAdapter().convert(str(model), {})["graphs"]
    return {g.id: {n.id for n in g.nodes} for g in graphs}


def test_the_files_load_through_model_explorer_and_hold_the_reports_numbers(report, tmp_path, capsys):
    nd, dacite, adapter = _viz()
    out = tmp_path / "me"
    proposal = _proposal(report, tmp_path / "proposal.json")
    assert main(["export", "model-explorer", str(report), "-o", str(out), "--proposal", str(proposal)]) == 0
    stdout = capsys.readouterr().out
    rep = load_report(report)
    names = [m.key for m in METRICS] + ["action"]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{n}.json" for n in names)

    # the printed command: Model Explorer's own console script, the normalized model, every file
    argv = shlex.split(next(line for line in stdout.splitlines() if "--node_data_paths=" in line))
    scripts = {e.name for e in importlib.metadata.entry_points(group="console_scripts")}
    assert argv[0] == "model-explorer" and "model-explorer" in scripts
    assert argv[1] == rep.normalized_model and "--extensions=model_explorer_onnx" in argv
    paths = next(a for a in argv if a.startswith("--node_data_paths=")).partition("=")[2].split(",")
    assert paths == [str((out / f"{n}.json").resolve()) for n in names]

    graphs = _adapter_graphs(adapter, Path(rep.normalized_model))
    files = {}
    for name in names:
        raw = strict_json((out / f"{name}.json").read_text())  # no NaN/Infinity, which the browser refuses
        # a ModelNodeData file (graph id -> GraphNodeData), as Model Explorer's web app tells them apart
        assert "results" not in raw and all("results" in v for v in raw.values())
        assert set(raw) <= set(graphs) and raw, f"{name}: graph ids {set(raw)}, the adapter's {set(graphs)}"
        (graph_id,) = raw
        # the action values are strings, which the web app shows and NodeDataResult's `Num` hint leaves out
        config = dacite.Config(check_types=name != "action")
        data = dacite.from_dict(nd.GraphNodeData, raw[graph_id], config=config)
        assert set(data.results) <= graphs[graph_id], f"{name}: ids the adapter does not have"
        files[name] = (raw[graph_id], data)

    # values of a few nodes, the generated name Relu_5 among them, against the report
    for node in ("fc", "conv2", "Relu_5"):
        record = rep.node(node)
        for metric in METRICS:
            expected = metric.value(record)
            raw, data = files[metric.key]
            if math.isfinite(expected):
                assert data.results[node].value == pytest.approx(expected, rel=1e-5, abs=1e-9)
            else:
                assert node not in data.results
    for metric in METRICS:
        raw, data = files[metric.key]
        finite = {n.name for n in rep.nodes if math.isfinite(metric.value(n))}
        assert set(data.results) == finite, metric.key
        if metric.key == "kl":
            assert [g.stop for g in data.gradient] == [0, 0.5, 1] and not data.thresholds
        else:
            assert all(_colour(raw, r.value) != "transparent" for r in data.results.values()), metric.key
    sqnr = files["accumulated_sqnr_db"][0]
    assert (_colour(sqnr, 12.0), _colour(sqnr, 25.0), _colour(sqnr, 31.0)) == (RED, AMBER, GREEN)
    noise = files["added_noise_db"][0]
    assert (_colour(noise, -45.0), _colour(noise, -25.0)) == (GREEN, AMBER)

    raw, actions = files["action"]
    assert actions.results["fc"].value == "fp32" and actions.results["fc"].bgColor == RED
    assert actions.results["conv2"].value == "clip" and actions.results["conv2"].bgColor == ACTION_COLOURS["clip"]
    quantized = {n.name for n in rep.nodes if n.quantized}
    assert {k for k, v in actions.results.items() if v.value == "unchanged"} == quantized - {"fc", "conv2"}
    assert "whole model" in actions.name and raw["showExpandedSummaryOnGroupNode"] is True


def test_a_sensitive_node_is_coloured_red(report, tmp_path, capsys):
    """A node made sensitive in the report (12 dB accumulated, -10 dB added noise) comes out red in both."""
    _viz()
    rep = load_report(report)
    nodes = tuple(
        dataclasses.replace(n, accumulated_sqnr_db=12.0, added_noise_db=-10.0) if n.name == "conv2" else n
        for n in rep.nodes
    )
    bad = tmp_path / "bad.json"
    save_report(dataclasses.replace(rep, nodes=nodes), bad)
    assert main(["export", "model-explorer", str(bad), "-o", str(tmp_path / "me")]) == 0
    (sqnr,) = strict_json((tmp_path / "me" / "accumulated_sqnr_db.json").read_text()).values()
    (noise,) = strict_json((tmp_path / "me" / "added_noise_db.json").read_text()).values()
    assert _colour(sqnr, sqnr["results"]["conv2"]["value"]) == RED
    assert _colour(noise, noise["results"]["conv2"]["value"]) == RED
    assert not (tmp_path / "me" / "action.json").exists()  # no proposal, no action file


def test_an_unnamed_graph_is_keyed_as_the_adapter_names_it(report, tmp_path):
    _, _, adapter = _viz()
    rep = load_report(report)
    model = onnx.load(rep.normalized_model)
    model.graph.name = ""
    onnx.save(model, tmp_path / "unnamed.onnx")
    ids = graph_ids(tmp_path / "unnamed.onnx", rep)
    (main_graph, *_) = _adapter_graphs(adapter, tmp_path / "unnamed.onnx")
    assert main_graph in ids


def test_without_the_extra_one_line_says_how_to_install_it(report, tmp_path, capsys, monkeypatch):
    """Exit 2 (USAGE, as for an unavailable execution provider), nothing written; runs with or without the
    packages (a None entry in sys.modules makes an import fail)."""
    monkeypatch.setitem(sys.modules, "model_explorer", None)
    monkeypatch.setitem(sys.modules, "model_explorer_onnx", None)
    code = main(["export", "model-explorer", str(report), "-o", str(tmp_path / "me")])
    assert code == ExitCode.USAGE
    assert_one_line(capsys.readouterr().err, "pip install 'qdebug[viz]'", "Model Explorer")
    assert not (tmp_path / "me").exists()


def test_a_proposal_of_another_model_and_a_missing_model_are_refused(report, tmp_path, capsys):
    _viz()
    other = _proposal(report, tmp_path / "other.json", exclude=("not_a_node",))
    code = main(["export", "model-explorer", str(report), "-o", str(tmp_path / "a"), "--proposal", str(other)])
    assert code == ExitCode.INPUT
    assert_one_line(capsys.readouterr().err, "not_a_node", "another model")

    rep = load_report(report)
    gone = tmp_path / "gone.json"
    save_report(dataclasses.replace(rep, normalized_model=str(tmp_path / "nope.onnx")), gone)
    assert main(["export", "model-explorer", str(gone), "-o", str(tmp_path / "b")]) == ExitCode.INPUT
    assert_one_line(capsys.readouterr().err, "nope.onnx", "re-run qdebug analyze")


def test_export_help_and_a_missing_format_load_no_model_explorer():
    code = (
        "import sys\nfrom qdebug.cli.main import main\n"
        "try:\n    main(['export', 'model-explorer', '--help'])\nexcept SystemExit:\n    pass\n"
        "rc = main(['export'])\n"
        "print(rc, [m for m in ('model_explorer', 'onnx', 'onnxruntime') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--proposal" in out.stdout and "pip install 'qdebug[viz]'" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == f"{int(ExitCode.USAGE)} []"
    assert "the following arguments are required: FORMAT" in out.stderr


def test_a_profiled_report_gets_a_file_of_the_time_each_node_saves_or_loses(tmp_path, capsys):
    """``analyze --profile`` records ORT's per-node times; the export writes each node's INT8 time (its Q/DQ
    kernels included) less its FP32 time: green where INT8 saves, red where it loses (issue 37)."""
    nd, dacite, _ = _viz()
    model, data = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(data), "--profile", "3", "-o", str(report), "-q"]) == 0
    rep = load_report(report)
    assert rep.profile is not None and rep.profile.nodes
    out = tmp_path / "me"
    assert main(["export", "model-explorer", str(report), "-o", str(out)]) == 0
    (graph,) = strict_json((out / "int8_ms_lost.json").read_text()).values()
    values = {k: v["value"] for k, v in graph["results"].items()}
    assert values == {n.name: pytest.approx(-n.saved_ms, rel=1e-5, abs=1e-9) for n in rep.profile.nodes}
    assert {t["bgColor"] for t in graph["thresholds"]} == {GREEN, RED}  # saved, lost
