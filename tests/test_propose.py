"""`qdebug propose` on the transformer fixture, against a naive baseline, plus its graph rules.

The transformer fixture loses > 5 top-1 points under default static QDQ
because two residual-stream channels carry a +-100 offset; the tests check the
issue's quality bar: >= 90% of the lost top-1 recovered, <= 10% of the
quantizable nodes kept FP32, a selective model smaller than FP32, no more
nodes than a naive top-k-by-local-SQNR baseline and at most
``2*ceil(log2 L) + 10`` evaluations.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.errors import ExitCode
from qdebug.output.report_io import load_record, load_report
from qdebug.propose import (
    ProposeOptions,
    Structure,
    Target,
    Trial,
    Unit,
    blame_tensors,
    default_budget,
    find_patterns,
    make_target,
    model_graph,
    propose,
    rank_units,
    run_search,
)
from qdebug.records import SCHEMA_VERSION, ErrorStats, NodeRecord, Proposal, QuantParams, WeightRecord
from tests.conftest import analyze_then_propose, fixture_path, qdq_scales, strict_json


@pytest.fixture(scope="module")
def transformer(tmp_path_factory):
    """(model, calib, eval, report path, report): the fixture analyzed once for this module."""
    tmp = tmp_path_factory.mktemp("propose")
    model = fixture_path("transformer", "model.onnx")
    calib = fixture_path("transformer", "calib.npz")
    evaluation = fixture_path("transformer", "eval.npz")
    out = tmp / "report.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qdebug-cache"))
        code = main(
            ["analyze", str(model), "--calib", str(calib), "--eval", str(evaluation), "-o", str(out), "-q"]
        )
    assert code == 0
    return model, calib, evaluation, out, load_report(out)


def _lost_points(report) -> float:
    return 100 * (report.task.fp32 - report.task.quantized)


@pytest.fixture(scope="module")
def proposed(transformer, tmp_path_factory):
    """`qdebug propose` with a target of 90% recovery (a drop of 10% of what static quantization lost)."""
    model, calib, evaluation, report_path, report = transformer
    out = tmp_path_factory.mktemp("proposal") / "proposal.json"
    drop = 0.1 * _lost_points(report)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qdebug-cache"))
        # the per-node search's answer, which these tests are about: with recipes, a timed comparison may
        # take quantize_dynamic instead where it runs faster on this machine (tested in test_propose_recipes)
        argv = ["propose", str(report_path), "--target-drop", f"{drop:.4f}", "--recipes", "none"]
        code = main([*argv, "-o", str(out), "-q"])
    assert code == 0
    return out, load_record(Proposal, out, "proposal")


def _top1(model_path, evaluation) -> float:
    """Accuracy of an ONNX file on the eval set, computed here without qdebug."""
    data = np.load(evaluation)
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": data["input"]})[0]
    return float(np.mean(np.argmax(logits, axis=1) == data["labels"]))


def test_fixture_loses_under_static(transformer):
    report = transformer[4]
    assert report.task.name == "top1"
    assert _lost_points(report) >= 5.0


def test_proposal_meets_quality_bar(transformer, proposed):
    model, _, evaluation, _, report = transformer
    out, proposal = proposed
    assert proposal.kind == "proposal" and proposal.schema_version == SCHEMA_VERSION
    assert proposal.model_sha256 == report.model.sha256
    assert proposal.quantizable_nodes > 0
    # <= 10% of the quantizable nodes kept FP32
    assert 0 < len(proposal.nodes_to_exclude) <= 0.1 * proposal.quantizable_nodes
    # the selective model on disk, scored independently, recovers >= 90% of the lost top-1
    selective = out.with_name("proposal.selective.onnx")
    assert proposal.quantized_model == str(selective.resolve())
    acc = _top1(selective, evaluation)
    assert acc == pytest.approx(proposal.expected_metric, abs=1e-9)
    recovered = (acc - report.task.quantized) / (report.task.fp32 - report.task.quantized)
    assert recovered >= 0.9
    # and it is smaller than the FP32 model
    assert selective.stat().st_size < model.stat().st_size
    # excluded nodes are really float in the rewritten graph: no excluded MatMul reads an int8 weight
    sel = onnx.load(str(selective))
    dq_out = {n.output[0]: n for n in sel.graph.node if n.op_type == "DequantizeLinear"}
    inits = {i.name for i in sel.graph.initializer}
    for node in sel.graph.node:
        if node.name in proposal.nodes_to_exclude:
            for i in node.input:
                assert not (i in dq_out and dq_out[i].input[0] in inits), (
                    f"{node.name} reads a quantized weight"
                )


def test_proposal_records_reasons_snippet_and_cost(proposed):
    out, proposal = proposed
    raw = strict_json(out.read_text())
    assert raw["kind"] == "proposal"
    assert proposal.evaluations >= 2 and proposal.search_seconds > 0
    assert {r.node for r in proposal.reasons if r.action == "fp32"} == set(proposal.nodes_to_exclude)
    assert all(r.reason and "dB" in r.reason for r in proposal.reasons)
    assert any(math.isfinite(r.introduced_db) and r.introduced_db > 1 for r in proposal.reasons)
    assert "quantize_static(" in proposal.snippet and "nodes_to_exclude" in proposal.snippet
    for name in proposal.nodes_to_exclude:
        assert repr(name) in proposal.snippet
    compile(proposal.snippet, "snippet", "exec")
    assert proposal.method == "minmax" and proposal.activation_type == "QUInt8"


def test_proposal_records_the_answers_drop_interval(transformer, proposed):
    """The paired-bootstrap interval of FP32 minus the answer, as the evaluator gives it for the selective model
    scored directly (it had been left nan in every proposal)."""
    from qdebug.data import model_input_specs, open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.runtime.capture import SessionConfig

    model, _, evaluation, _, report = transformer
    out, proposal = proposed
    low, high = proposal.drop_interval
    drop = 100 * (proposal.fp32_metric - proposal.expected_metric)
    assert math.isfinite(low) and math.isfinite(high) and low - 1e-9 <= drop <= high + 1e-9
    normalized = onnx.load(report.normalized_model)
    ev = Evaluator(normalized, open_data(evaluation, model_input_specs(normalized)), SessionConfig(), "top1")
    direct = ev.drop_interval(ev.score(onnx.load(proposal.quantized_model)))
    assert direct == pytest.approx(proposal.drop_interval, abs=1e-9)


def test_a_target_met_on_the_point_estimate_only_is_said():
    from qdebug.propose.run import _interval_notes

    target = Target("top1", "drop", 0.89, 0.90, 0.001)
    met = Trial("final", (), (), False, 0.895, 30.0, True, 0, 0.0, 0.0)
    (note,) = _interval_notes(target, met, (0.0, 1.4), 500)  # 0.5 points, allowed 1, interval up to 1.4
    assert "point estimate" in note and "exit 8" in note and "evaluation samples would decide it" in note
    assert _interval_notes(target, met, (0.1, 0.9), 500) == ()  # decided: the whole interval within the target
    missed = dataclasses.replace(met, value=0.85, met=False)
    assert _interval_notes(target, missed, (3.0, 7.0), 500) == ()  # a miss says so elsewhere


def test_snippet_reproduces_the_selective_model(transformer, proposed, tmp_path, monkeypatch):
    """The pasted snippet (fresh quantize_static, ORT's own calibration) gives the promised accuracy."""
    _, _, evaluation, _, _ = transformer
    _, proposal = proposed
    monkeypatch.chdir(tmp_path)
    exec(compile(proposal.snippet, "snippet", "exec"), {})
    assert _top1(tmp_path / "model.selective.onnx", evaluation) == pytest.approx(
        proposal.expected_metric, abs=0.004
    )


def test_beats_naive_top_k_baseline_with_few_evaluations(transformer, proposed):
    """Naive baseline: exclude the top-k nodes by local SQNR, k = 1, 2, ... until the target is met.

    It reaches the target with no fewer nodes than the proposal (every k below
    the proposal's size misses it), and the proposal stayed within the default
    budget for its L candidate nodes (what the minimization itself costs is
    pinned by ``test_minimal_subset_*``).
    """
    from qdebug.data import open_data
    from qdebug.evaluation.evaluate import Evaluator
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.propose import excludable_nodes
    from qdebug.quant.quantize import QuantSpec, quantize_static_model
    from qdebug.runtime.capture import SessionConfig

    model, calib, evaluation, report_path, report = transformer
    _, proposal = proposed
    prep = prepare(model, calib, report_path.parent / "baseline_files", AnalyzeOptions())
    evaluator = Evaluator(
        prep.normalized, open_data(evaluation, prep.calib.specs, what="eval"), SessionConfig()
    )
    threshold = report.task.fp32 - 0.1 * (report.task.fp32 - report.task.quantized)
    excludable = set(excludable_nodes(report.nodes))
    ranked = sorted(
        (n for n in report.nodes if n.name in excludable and not math.isnan(n.local_sqnr_db)),
        key=lambda n: n.local_sqnr_db,
    )
    k_ours = len(proposal.nodes_to_exclude)
    for k in range(1, k_ours):
        spec = QuantSpec(nodes_to_exclude=tuple(n.name for n in ranked[:k]))
        value = evaluator.score(quantize_static_model(prep.normalized, prep.ranges, spec)).value
        assert value < threshold, f"the naive baseline met the target with {k} < {k_ours} nodes"
    # L and the evaluation bound, from the same ranking propose used
    structure = Structure(prep.normalized, report.nodes)
    units = rank_units(structure, report.nodes, report.weights)
    candidates = len({n for u in units for n in u.nodes})
    assert proposal.evaluations <= default_budget(candidates)


def test_int16_and_per_channel_alternatives(transformer, tmp_path):
    """With int16 allowed the cheaper 16-bit activations replace the FP32 nodes and still meet the target."""
    _, _, evaluation, report_path, report = transformer
    out = tmp_path / "p16.json"
    drop = 0.1 * _lost_points(report)
    code = main(
        [
            "propose",
            str(report_path),
            "--target-drop",
            f"{drop:.4f}",
            "--allow",
            "fp32,int16,per-channel",
            "--recipes",
            "none",  # the per-node fixes' answer, not a recipe a timed comparison may take
            "-o",
            str(out),
            "-q",
        ]
    )
    assert code == 0
    proposal = load_record(Proposal, out, "proposal")
    if proposal.tensor_overrides and not any(r.action == "fp32" for r in proposal.reasons):
        assert proposal.nodes_to_exclude == ()  # int16 was enough: no FP32 node at all
        assert all(o.quant_type == "QUInt16" for o in proposal.tensor_overrides)
        assert any(r.action == "int16" for r in proposal.reasons)
        assert "TensorQuantOverrides" in proposal.snippet
    acc = _top1(out.with_name("p16.selective.onnx"), evaluation)
    assert (acc - report.task.quantized) / (report.task.fp32 - report.task.quantized) >= 0.9
    for r in proposal.reasons:  # per-channel is credited with its own step's gain, not the whole proposal's
        if r.action == "per-channel":
            assert "alone" in r.reason and f"-> {100 * proposal.expected_metric:.2f}%;" not in r.reason


def test_target_not_met_exits_6_and_still_writes(transformer, tmp_path):
    _, _, _, report_path, _ = transformer
    out = tmp_path / "p.json"
    code = main(
        [
            "propose",
            str(report_path),
            "--target-drop",
            "0",
            "--max-nodes",
            "1",
            "--max-evaluations",
            "4",
            "--recipes",
            "none",  # quantize_dynamic meets even this target on the transformer: the per-node search's miss
            "-o",
            str(out),
            "-q",
        ]
    )
    assert code == ExitCode.TARGET_NOT_MET
    proposal = load_record(Proposal, out, "proposal")
    assert len(proposal.nodes_to_exclude) <= 1
    assert proposal.evaluations <= 4
    assert out.with_name("p.selective.onnx").exists()


def test_report_of_another_model_is_refused(transformer, tmp_path, capsys):
    model, _, _, report_path, _ = transformer
    other = tmp_path / "other.onnx"
    proto = onnx.load(str(model))
    proto.doc_string = "changed"
    onnx.save(proto, str(other))
    code = main(["propose", str(report_path), "--model", str(other), "-o", str(tmp_path / "p.json"), "-q"])
    assert code == ExitCode.INPUT
    err = capsys.readouterr().err
    assert "not the model the report was made from" in err and len(err.strip().splitlines()) == 1


def test_moved_model_asks_for_model_flag(transformer, tmp_path, capsys):
    model, calib, evaluation, report_path, _ = transformer
    moved = tmp_path / "report.json"
    raw = json.loads(report_path.read_text())
    raw["model"]["path"] = str(tmp_path / "gone.onnx")
    moved.write_text(json.dumps(raw))
    code = main(["propose", str(moved), "-o", str(tmp_path / "p.json"), "-q"])
    assert code == ExitCode.INPUT
    assert "--model" in capsys.readouterr().err
    shutil.copy(model, tmp_path / "copy.onnx")
    code = main(
        [
            "propose",
            str(moved),
            "--model",
            str(tmp_path / "copy.onnx"),
            "--max-evaluations",
            "2",
            "-o",
            str(tmp_path / "p.json"),
            "-q",
        ]
    )
    assert code in (0, ExitCode.TARGET_NOT_MET)


def test_bad_allow_is_usage_error(transformer, tmp_path):
    report_path = transformer[3]
    assert (
        main(["propose", str(report_path), "--allow", "fp8", "-o", str(tmp_path / "p.json"), "-q"])
        == ExitCode.USAGE
    )
    assert main(["propose", str(report_path), "--target-drop", "1", "--target-sqnr", "20"]) == ExitCode.USAGE


# ----------------------------------------------------------------------------- graph rules (no model run)


def _tiny_block() -> onnx.ModelProto:
    """X -> decomposed LayerNorm -> MatMul -> decomposed GELU -> MatMul -> residual Add(x, .)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.float32(2.0), "two"),
        numpy_helper.from_array(np.float32(1e-5), "eps"),
        numpy_helper.from_array(np.float32(1.41421), "sqrt2"),
        numpy_helper.from_array(np.float32(1.0), "one"),
        numpy_helper.from_array(np.float32(0.5), "half"),
        numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "w2"),
    ]
    n = helper.make_node
    nodes = [
        n("ReduceMean", ["x"], ["mean"], name="ln/mean", axes=[-1]),
        n("Sub", ["x", "mean"], ["xc"], name="ln/sub"),
        n("Pow", ["xc", "two"], ["sq"], name="ln/pow"),
        n("ReduceMean", ["sq"], ["var"], name="ln/var", axes=[-1]),
        n("Add", ["var", "eps"], ["vare"], name="ln/add_eps"),
        n("Sqrt", ["vare"], ["std"], name="ln/sqrt"),
        n("Div", ["xc", "std"], ["ln"], name="ln/div"),
        n("MatMul", ["ln", "w1"], ["h"], name="fc1"),
        n("Div", ["h", "sqrt2"], ["g1"], name="gelu/div"),
        n("Erf", ["g1"], ["g2"], name="gelu/erf"),
        n("Add", ["g2", "one"], ["g3"], name="gelu/add"),
        n("Mul", ["h", "g3"], ["g4"], name="gelu/mul"),
        n("Mul", ["g4", "half"], ["g5"], name="gelu/half"),
        n("MatMul", ["g5", "w2"], ["y"], name="fc2"),
        n("Add", ["x", "y"], ["out"], name="residual"),
    ]
    graph = helper.make_graph(
        nodes,
        "block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_graph_has_nodes_as_nodes_and_tensors_as_edges():
    g = model_graph(_tiny_block())
    assert g.number_of_nodes() == 15
    assert g.edges["ln/sub", "ln/div"]["tensors"] == ("xc",)
    assert g.nodes["fc1"]["weighted"] and not g.nodes["gelu/mul"]["weighted"]


def test_decomposed_layernorm_and_gelu_are_one_region_each_residual_is_not():
    patterns = {kind: nodes for kind, nodes in find_patterns(model_graph(_tiny_block()))}
    assert patterns["layernorm"] == {
        "ln/mean",
        "ln/sub",
        "ln/pow",
        "ln/var",
        "ln/add_eps",
        "ln/sqrt",
        "ln/div",
    }
    assert patterns["gelu"] == {"gelu/div", "gelu/erf", "gelu/add", "gelu/mul"}
    assert all("residual" not in nodes for nodes in patterns.values())


def _rec(name, op, inputs, outputs, intro, local, acc) -> NodeRecord:
    return NodeRecord(name, name, op, tuple(inputs), tuple(outputs), 1, True, local, acc, intro, math.nan)


def test_blame_goes_to_inputs_when_the_node_own_quantization_is_fine():
    nodes = [
        _rec("ln", "LayerNormalization", ["x"], ["a"], 13.0, 38.0, 22.0),  # input-driven: 22 + 6 < 38
        _rec("mm", "MatMul", ["a", "w"], ["b"], 15.0, 20.0, 18.0),  # own: 18 + 6 >= 20
        _rec("ok", "Add", ["b", "c"], ["d"], 10.0, 40.0, 35.0),  # own but harmless (35 dB >= 30)
    ]
    stats = ErrorStats(50.0, 0.0, 1.0, 0.0, 0.0, 1)
    weights = [WeightRecord("w", "mm", stats, QuantParams(0.1, 0, "int8"))]
    blame = blame_tensors(nodes, weights, {"x", "a", "b", "c", "d"})
    assert blame["x"][:2] == (13.0, "ln")
    assert blame["b"][:2] == (15.0, "mm")
    assert "d" not in blame and "a" not in blame
    # when x is already float, blame moves on upstream (here: nowhere, x is a graph input)
    assert "x" not in blame_tensors(nodes, weights, {"x", "a", "b", "c", "d"}, {"x"})


def test_unit_keeps_a_tensor_float_with_all_its_quantized_neighbours():
    model = _tiny_block()
    nodes = [_rec(n.name, n.op_type, n.input, n.output, 0.0, 40.0, 40.0) for n in model.graph.node]
    structure = Structure(model, nodes)
    kind, members, tensors = structure.unit_for("h")
    # fc1 produces h; gelu/div (not quantizable) and gelu/mul read it; gelu/mul is inside the GELU pattern
    assert kind == "gelu"
    assert set(members) == {"fc1", "gelu/add", "gelu/mul"}
    assert "h" in tensors and "g3" in tensors


def test_targets():
    t = make_target("top1", 0.95, 500, ProposeOptions(target_drop=2.0))
    assert t.kind == "drop" and t.threshold == pytest.approx(0.93)
    assert make_target("top1", 0.95, 500, ProposeOptions()).threshold == pytest.approx(0.94)
    s = make_target("top1", 0.95, 500, ProposeOptions(target_sqnr=25.0))
    assert s.kind == "sqnr" and s.threshold == 25.0
    assert make_target("output_sqnr_db", math.inf, 10, ProposeOptions()).kind == "sqnr"
    from qdebug.errors import QDebugError

    with pytest.raises(QDebugError):
        make_target("output_sqnr_db", math.inf, 10, ProposeOptions(target_drop=1.0))


def test_a_metric_hook_is_shown_by_its_function_name():
    """A user's metric hook is recorded whole (it is loaded again from it) but shown by its function's name:
    the full path had filled every progress line of a search on a real model."""
    from qdebug.output.formatting import metric_title

    hook = "/home/me/project/benchmarks/metrics.py:mask_iou"
    t = Target(hook, "drop", 0.99, 1.0, 0.001)
    trial = Trial("baseline", (), (), False, 0.9262, 30.0, False, 1, 0.0, 0.0)
    assert t.show(trial) == "mask_iou 0.9262" and t.describe() == "mask_iou >= 0.99 (FP32 1)"
    assert metric_title("pkg.metrics:f1") == "f1" and metric_title("top1") == "top1"
    assert metric_title("C:\\m.py") == "C:\\m.py"  # a Windows drive is no hook


class _FakeSearch:
    """The interface run_search needs, over a metric defined on node sets (no model)."""

    def __init__(self, metric, budget: int = 30, allow=("fp32",)) -> None:
        self.metric = metric
        self.allow = allow
        self.trials: list = []
        self.equivalents: list = []
        self.cache: dict = {}
        self.per_channel = False
        self.max_nodes = None
        self.budget = budget
        self.target = Target("top1", "drop", 0.9, 1.0, 0.001)

    @property
    def left(self) -> int:
        return self.budget - len(self.trials)

    def evaluate(self, step, nodes, overrides=(), per_channel=None, keep_float=(), fixes=()):
        key = (tuple(sorted(nodes)), tuple(sorted(overrides)))
        if key in self.cache:
            return self.cache[key]
        if self.left <= 0:
            return None
        value = self.metric(set(nodes), set(overrides))
        trial = Trial(step, key[0], key[1], False, value, math.nan, value >= 0.9, 0, 0.0, 0.0)
        self.trials.append(trial)
        self.cache[key] = trial
        return trial

    def fits(self, trial) -> bool:
        return True

    def score(self, trial) -> float:
        return trial.value

    # the round interface (Search.ask / prefetch / evaluate_many): hints ignored, rounds one after another
    hint_depth = 2

    def ask(self, nodes, overrides=(), per_channel=None, keep_float=(), fixes=()):
        return (tuple(nodes), tuple(overrides), per_channel, tuple(keep_float), tuple(fixes))

    def prefetch(self, asked, sure=False) -> None:
        pass

    def evaluate_many(self, step, asked, reserve=0):
        out = []
        for a in asked:
            if self.left <= reserve:
                break
            out.append(self.evaluate(step, *a))
        return out + [None] * (len(asked) - len(out))


def _unit(name: str, *nodes: str) -> Unit:
    return Unit(name, "tensor", nodes or (name,), (name,), 1.0, name, "test")


def test_greedy_re_ranks_when_the_first_ranking_stalls():
    """Excluding a helps, b and c do not; only after a is excluded does x show up (masked error)."""

    def metric(nodes, overrides):
        return 0.2 + 0.5 * ("a" in nodes) + 0.3 * ("x" in nodes) - 0.001 * len(nodes)

    reranked = []

    def rerank(plan, widen):
        reranked.append(plan.nodes())
        return [_unit("x"), _unit("b")] if "a" in plan.nodes() else [_unit("a"), _unit("b"), _unit("c")]

    search = _FakeSearch(metric)
    search.allow = ("fp32",)
    plan, met, reranks = run_search(search, [_unit("a"), _unit("b"), _unit("c")], rerank, None)
    assert met is not None and met.met
    assert plan.nodes() == {"a", "x"}
    assert reranks >= 1 and reranked[0] == {"a"}
    assert len(search.trials) <= 2 * math.ceil(math.log2(4)) + 10


def test_bisect_then_prune_on_a_monotone_ranking():
    """Eight ranked units where the 2nd and 5th are needed: bisect finds the prefix, prune drops the rest."""
    names = [f"n{i}" for i in range(8)]

    def metric(nodes, overrides):
        return 0.2 + 0.4 * ("n1" in nodes) + 0.4 * ("n4" in nodes)

    search = _FakeSearch(metric)
    search.allow = ("fp32",)
    plan, met, reranks = run_search(search, [_unit(n) for n in names], lambda p, w: [], None)
    assert plan.nodes() == {"n1", "n4"} and met.met and reranks == 0
    assert len(search.trials) <= 2 * math.ceil(math.log2(8)) + 10


@pytest.mark.parametrize(
    ("with_pc", "without_pc", "kept"),
    [
        (0.85, 0.92, False),  # per-channel hurt the final set (a depthwise CNN: 41.2 dB with, 43.9 without)
        (0.95, 0.91, False),  # both meet the target: the simpler configuration wins
        (0.95, 0.50, True),  # per-channel is what meets it
        (0.60, 0.55, True),  # neither meets it: the better score
    ],
)
def test_final_set_is_rechecked_without_per_channel(with_pc, without_pc, kept):
    """Per-channel is adopted before the exclusions are searched; once they are found, one more evaluation
    decides whether it still earns its place."""
    from qdebug.propose.search import without_per_channel

    search = _FakeSearch(lambda nodes, overrides: without_pc)
    final = Trial("prune", ("a",), (), True, with_pc, math.nan, with_pc >= 0.9, 0, 0.0, 0.0)
    chosen = without_per_channel(search, final, in_effect=True)
    assert chosen.per_channel is kept and len(search.trials) == 1
    assert chosen.nodes == ("a",)
    # no weight left with more than one scale: the same model either way, no evaluation spent
    search = _FakeSearch(lambda nodes, overrides: without_pc)
    assert without_per_channel(search, final, in_effect=False).per_channel is False and not search.trials


def test_a_unit_tried_alone_must_be_smaller_than_the_answer():
    """After the search, units it never blamed are tried alone; a 4-node region meeting the target alone
    must not replace a 2-node answer (review: it did, with a worse score)."""

    def metric(nodes, overrides):
        if {"a", "b"} <= nodes:
            return 0.95
        return 0.91 if {"p", "q", "r", "s"} <= nodes else 0.3

    search = _FakeSearch(metric)
    initial = [_unit("a"), _unit("b")]
    widened = [*initial, _unit("region", "p", "q", "r", "s")]
    search.allow = ("fp32",)
    plan, met, _ = run_search(search, initial, lambda p, w: [], None, widened)
    assert plan.nodes() == {"a", "b"} and met.value == 0.95


def test_two_branches_that_only_go_together_are_pruned_as_a_pair():
    """Keeping either branch of a Concat FP32 alone misses the target; dropping both meets it. The one-at-a-
    time prune kept 5 nodes where 3 meet the target (review, a Concat of ranges 100x apart)."""
    needed = {"concat", "mix", "head"}

    def metric(nodes, overrides):
        if not needed <= nodes:
            return 0.5
        branches = {"left", "right"} & nodes
        return 0.93 if len(branches) != 1 else 0.85

    search = _FakeSearch(metric)
    units = [_unit(n) for n in ("left", "right", "concat", "mix", "head")]
    search.allow = ("fp32",)
    plan, met, _ = run_search(search, units, lambda p, w: [], None)
    assert plan.nodes() == needed and met.met


def test_per_channel_is_not_adopted_for_the_exclusion_search_when_fp32_alone_meets():
    """Per-channel helping a little (41.4 -> 42.2 %) had been adopted before the exclusions were searched,
    which then needed 7 nodes at 91.0 % where 2 nodes meet the target without it."""

    class PerChannelSearch(_FakeSearch):
        def evaluate(self, step, nodes, overrides=(), per_channel=None, keep_float=(), fixes=()):
            pc = self.per_channel if per_channel is None else per_channel
            key = (tuple(sorted(nodes)), tuple(sorted(overrides)), pc)
            if key in self.cache:
                return self.cache[key]
            base = 0.95 if {"a", "b"} <= set(nodes) else 0.42
            value = base + 0.01 if pc and not nodes else (0.5 if pc else base)
            trial = Trial(step, key[0], key[1], pc, value, math.nan, value >= 0.9, 0, 0.0, 0.0)
            self.trials.append(trial)
            self.cache[key] = trial
            return trial

    search = PerChannelSearch(lambda n, o: 0.0)
    units = [_unit(n) for n in ("a", "b", "c")]
    search.allow = ("fp32", "per-channel")
    plan, met, _ = run_search(search, units, lambda p, w: [], None)
    assert plan.nodes() == {"a", "b"} and met.met and not met.per_channel


def test_sixteen_bit_overrides_are_pruned_to_the_tensors_needed():
    """A block turned 16-bit carried all its tensors (masked attention: five) where one was enough."""

    def metric(nodes, overrides):
        return 0.95 if ("n1" in nodes or "t2" in overrides) else 0.3

    search = _FakeSearch(metric)
    block = Unit("blk", "pattern", ("n1",), ("t1", "t2", "t3"), 1.0, "n1", "test")
    search.allow = ("fp32", "int16")
    plan, met, _ = run_search(search, [block], lambda p, w: [], None)
    assert met.met and not plan.nodes() and plan.overrides() == {"t2"}


def test_int16_replaces_fp32_when_it_is_enough():
    def metric(nodes, overrides):
        return 0.95 if ("a" in nodes or "a" in overrides) else 0.3

    search = _FakeSearch(metric)
    search.allow = ("fp32", "int16")
    plan, met, _ = run_search(search, [_unit("a"), _unit("b")], lambda p, w: [], None)
    assert met.met and not plan.fp32 and [u.key for u in plan.int16] == ["a"]
    assert met.overrides == ("a",) and met.nodes == ()


def test_no_more_nodes_than_the_fixture_generators_known_answer(transformer, tmp_path):
    """make_fixtures.py records an exclusion set that recovers to within its recovery window; do as well."""
    manifest = json.loads(fixture_path("manifest.json").read_text())
    known = manifest["fixtures"]["transformer"]["selective"]["nodes_to_exclude"]
    window = 100 * manifest["tolerances"]["recovery_window"]
    report_path = transformer[3]
    out = tmp_path / "p.json"
    assert main(["propose", str(report_path), "--target-drop", str(window), "-o", str(out), "-q"]) == 0
    proposal = load_record(Proposal, out, "proposal")
    assert len(proposal.nodes_to_exclude) <= len(known)
    assert proposal.expected_metric >= proposal.fp32_metric - window / 100 - 1e-9


def test_snippet_reads_the_data_as_qdebug_did(tmp_path, monkeypatch):
    """A model with a fixed batch of 4, calibration data in a folder, analyze --max-samples 24: the snippet
    fed one sample at a time from one file, every sample, so it failed ("Got: 1 Expected: 4", or
    IsADirectoryError) or built other scales than the proposal's. Propose also failed outright on such
    models: its re-rank capture read 32 samples, which fill no batches of 3."""
    from tests.models import small_data

    model = _fixed_batch_cnn(tmp_path / "m.onnx", 4)
    folder = tmp_path / "calib"
    folder.mkdir()
    for i in range(3):
        small_data(folder / f"part{i}.npz", n=12, seed=i)
    proposal = analyze_then_propose(model, folder, tmp_path, "--max-samples", "24")
    _assert_snippet_rebuilds(proposal, tmp_path, monkeypatch)


def _fixed_batch_cnn(path: Path, batch: int) -> Path:
    """tests.models.small_cnn with its batch dimension fixed at ``batch``."""
    import onnx

    from tests.models import small_cnn

    model = small_cnn(path)
    proto = onnx.load(model)
    for value in (proto.graph.input[0], proto.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_value = batch
    onnx.save(proto, model)
    return model


def _assert_snippet_rebuilds(proposal: dict, tmp_path: Path, monkeypatch) -> None:
    """Run the proposal's snippet in ``tmp_path``: its model has the same scales as the proposal's."""
    monkeypatch.chdir(tmp_path)
    exec(compile(proposal["snippet"], "snippet", "exec"), {})
    mine, theirs = qdq_scales(tmp_path / "model.selective.onnx"), qdq_scales(proposal["quantized_model"])
    assert mine.keys() == theirs.keys() and mine
    for name, value in theirs.items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-6, err_msg=name)


def test_hook_samples_fill_a_fixed_batch(tmp_path, monkeypatch, capsys):
    """A hook yielding one sample at a time into a model whose batch is fixed at 4: qdebug and the snippet
    stack them into batches of 4 (calibration had failed with "invalid dimensions", exit 4, and the snippet
    fed single samples); both then build the same scales. Samples left over are refused, not dropped."""
    from tests.models import small_data

    model = _fixed_batch_cnn(tmp_path / "m.onnx", 4)
    small_data(tmp_path / "d.npz", n=24)
    hook = tmp_path / "hook.py"
    hook.write_text(
        "import numpy as np\n"
        "N = 24\n"
        "def feeds():\n"
        f"    z = np.load({str(tmp_path / 'd.npz')!r})\n"
        "    for i in range(N):\n"
        "        yield {k: z[k][i:i + 1] for k in z.files}\n"
    )
    proposal = analyze_then_propose(model, Path(f"{hook}:feeds"), tmp_path)
    _assert_snippet_rebuilds(proposal, tmp_path, monkeypatch)

    hook.write_text(hook.read_text().replace("N = 24", "N = 23"))
    capsys.readouterr()
    code = main(["analyze", str(model), "--calib", f"{hook}:feeds", "-o", str(tmp_path / "r2.json"), "-q"])
    assert code == ExitCode.DATA
    assert "3 sample(s) left at the end do not fill a batch of 4" in capsys.readouterr().err
    assert not (tmp_path / "r2.json").exists()


def test_max_nodes_cuts_a_region_instead_of_dropping_it(transformer, tmp_path):
    """The top region of the transformer has 3 nodes: with --max-nodes 1 the cap dropped it whole and the
    proposal came out empty (static's 83.6 %); its first node, the embedding Add, alone gives 92.4 %. Without
    recipes: with them, the one node missing the target, quantize_dynamic is the answer."""
    _, _, _, report_path, report = transformer
    options = ProposeOptions(max_nodes=1, recipes=())
    result = propose(report_path, output=tmp_path / "p.json", options=options)
    p = result.proposal
    assert len(p.nodes_to_exclude) == 1
    assert p.expected_metric >= p.static_metric + 0.05
    assert _top1(Path(p.quantized_model), fixture_path("transformer", "eval.npz")) == pytest.approx(
        p.expected_metric, abs=1e-9
    )


def test_propose_and_the_tui_count_the_same_quantizable_nodes(transformer, proposed):
    """The report records which nodes are excludable; the TUI counted every `quantized` node (72 on the
    transformer, including Divs that only touched a Q/DQ for their consumer's sake) where propose and verify
    count 67. Those Divs are no longer called quantized (ORT has no integer Div) either."""
    from qdebug.tui.model import LayerModel

    report = transformer[4]
    proposal = proposed[1]
    excludable = [n for n in report.nodes if n.excludable]
    divs = [n for n in report.nodes if n.op_type == "Div"]
    assert divs and not any(n.quantized for n in divs)
    assert len(excludable) == proposal.quantizable_nodes == 67
    view = LayerModel(report)
    assert view.quantizable == proposal.quantizable_nodes
    for name in proposal.nodes_to_exclude:
        view.toggle(name)
    exported = view.to_proposal()
    assert exported.quantizable_nodes == proposal.quantizable_nodes and exported.qdq_pairs_delta is None
    assert view.excluded_share() == pytest.approx(len(proposal.nodes_to_exclude) / proposal.quantizable_nodes)


@pytest.mark.parametrize("max_nodes", [None, 1])
def test_a_head_after_an_average_is_tried_alone(tmp_path, max_nodes):
    """The Gemm head after a mean introduces less than nothing (the mean averages upstream noise), so the
    blame never named it: the search kept 4 of 6 nodes FP32 for 43 dB, and with --max-nodes 1 said the
    target was missed -- while the head alone gives 43.2 dB."""
    from tests.models import pooled_audio_classifier

    model, calib, evaluation = pooled_audio_classifier(tmp_path / "m")
    report = tmp_path / "r.json"
    args = ["analyze", str(model), "--calib", str(calib), "--eval", str(evaluation), "-o", str(report), "-q"]
    assert main(args) == 0
    fc = load_report(report).node("fc")
    assert fc.added_noise_db == -math.inf or fc.introduced_db < 0  # not blamed by the error it introduces
    cap = ["--max-nodes", str(max_nodes)] if max_nodes else []
    out = tmp_path / "p.json"
    # the per-node search's answer (with recipes, mixed quantizes fc at run time instead of keeping it FP32)
    argv = ["propose", str(report), "--target-sqnr", "43", *cap, "--recipes", "none"]
    assert main([*argv, "-o", str(out), "-q"]) == 0
    proposal = load_record(Proposal, out, "proposal")
    assert proposal.nodes_to_exclude == ("fc",) and proposal.expected_metric >= 43


def test_a_proposal_that_leaves_nothing_quantized_says_so(tmp_path, capsys):
    """Both Gemms of a small MLP must stay FP32 to keep every top-1 answer: propose had reported MET with
    0 Q/DQ pairs left and not a word that the 'selective' model is simply the FP32 one."""
    from onnx import TensorProto, helper, numpy_helper

    from qdebug.cli.main import main
    from tests.models import save_graph

    rng = np.random.default_rng(5)
    weights = {"w1": (64, 128), "b1": (128,), "w2": (128, 10), "b2": (10,)}
    inits = [numpy_helper.from_array(rng.normal(0, 0.2, s).astype(np.float32), n) for n, s in weights.items()]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["g1"], name="fc1"),
        helper.make_node("Relu", ["g1"], ["r1"], name="relu1"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["logits"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = save_graph(graph, tmp_path / "m.onnx", opsets={"": 17})
    np.savez(tmp_path / "c.npz", x=rng.normal(0, 1, (64, 64)).astype(np.float32))
    x = rng.normal(0, 1, (200, 64)).astype(np.float32)
    labels = ort.InferenceSession(str(model)).run(None, {"x": x})[0].argmax(1)
    np.savez(tmp_path / "e.npz", x=x, labels=labels)
    report, prop = tmp_path / "r.json", tmp_path / "p.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "--eval", str(tmp_path / "e.npz")]
    assert main([*args, "-o", str(report), "-q"]) == 0
    capsys.readouterr()
    # keeping every node FP32 gives the speed-up back: exit 6, unless the user accepts it
    assert main(["propose", str(report), "--target-drop", "0", "-o", str(prop)]) == ExitCode.TARGET_NOT_MET
    assert "most of the INT8 speed-up is gone" in capsys.readouterr().err
    assert main(["propose", str(report), "--target-drop", "0", "-o", str(prop), "--accept-no-speedup"]) == 0
    out = "".join(capsys.readouterr())
    selective = onnx.load(str(tmp_path / "p.selective.onnx"))
    assert not any(n.op_type == "QuantizeLinear" for n in selective.graph.node)  # the premise
    assert "note: the selective model has no quantization left (0 Q/DQ pairs, static has 3)" in out
    # a proposal that keeps some quantization says nothing of the kind
    capsys.readouterr()
    assert main(["propose", str(report), "--target-drop", "100", "-o", str(tmp_path / "p2.json")]) == 0
    assert "no quantization left" not in "".join(capsys.readouterr())


# Proposal.qdq_pairs_delta had no check on a real proposal (the TUI tests only see None).
def _q(path) -> int:
    return sum(1 for n in onnx.load(str(path)).graph.node if n.op_type == "QuantizeLinear")


def test_qdq_pairs_delta_is_selective_minus_static(cnn, tmp_path):
    model, calib = cnn
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 0
    report = load_report(out)
    # an output SQNR the full static model misses (32 dB on this CNN): nodes must be excluded
    # no recipe and no per-node fix: nodes go FP32 (bias correction alone reaches 40 dB on this CNN)
    options = ProposeOptions(target_sqnr=40.0, allow=("fp32",), recipes=())
    result = propose(report, output=tmp_path / "p.json", options=options)
    p = result.proposal
    assert p.nodes_to_exclude, "precondition: the proposal excludes nodes"
    static, selective = _q(tmp_path / "r_files" / "quantized.onnx"), _q(p.quantized_model)
    assert selective < static
    assert p.qdq_pairs_delta == selective - static


def test_a_custom_metric_defaults_to_a_relative_drop():
    """One raw unit on a metric in [0, 1] accepted anything: propose said MET for an empty proposal while the
    metric had gone from 1 to 0. The default is now 1 % of |FP32|, printed as the threshold it implies."""
    target = make_target("hooks.py:iou", 0.8, 60, ProposeOptions())
    assert target.threshold == pytest.approx(0.792)
    assert "0.792" in target.describe() and "1 % below FP32" in target.describe()
    negative = make_target("hooks.py:neg_loss", -2.0, 60, ProposeOptions())
    assert negative.threshold == pytest.approx(-2.02)  # below FP32 for a negative metric too
    given = make_target("hooks.py:iou", 0.8, 60, ProposeOptions(target_drop=0.05))
    assert given.threshold == pytest.approx(0.75) and "below FP32" not in given.describe()  # raw units
    assert make_target("top1", 0.9, 100, ProposeOptions()).threshold == pytest.approx(0.89)  # points


def test_the_search_progress_says_what_is_tried_and_the_best_so_far(transformer, tmp_path, capsys):
    """A search can take minutes: each line names the trial and the best answer so far (plain lines when
    stderr is not a terminal, as here)."""
    _, _, _, report_path, _ = transformer
    assert main(["propose", str(report_path), "-o", str(tmp_path / "p.json")]) in (0, ExitCode.TARGET_NOT_MET)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("qdebug: search ")]
    assert lines and all(" · " in x and " best " in x and "top1 " in x for x in lines)
    assert "node" in lines[0] and ("(target " in lines[0] or " @ " in lines[0])


def test_a_proposal_keeping_most_of_the_model_fp32_says_so():
    """A proposal that keeps most nodes FP32 gives back the INT8 speed-up (one kept 99 % and was reported
    as MET): it is named in one line, and the CLI exits 6 unless --accept-no-speedup."""
    from qdebug.propose.run import _mostly_fp32

    def trial(n: int) -> Trial:
        nodes = tuple(f"n{i}" for i in range(n))
        return Trial("minimize", nodes, (), False, 0.9, 30.0, True, 3, 0.0, 0.0)

    line = _mostly_fp32(trial(6), 10)
    assert "keeps 6 of 10 quantizable nodes (60 %) FP32" in line and "a looser target" in line
    assert _mostly_fp32(trial(5), 10) == "" and _mostly_fp32(trial(0), 0) == ""
    # its advice names only what the run did not try: per-channel weights where --allow left them out, the
    # recipes scored as tried, and no 16-bit activations (float kernels on the CPU provider: no speed back)
    assert "--allow" not in line and "int16" not in line and "the frontier lists what each" in line
    line = _mostly_fp32(trial(6), 10, ("fp32",), ("fold-bn", "dynamic"), timed=False)
    assert "--allow fp32,per-channel (per-channel weights)" in line and "frontier" not in line
    assert "The recipes tried (fold-bn, dynamic) do not meet the target alone" in line


def test_the_snippet_quantizes_the_normalized_model_when_weights_sit_in_constant_nodes(tmp_path):
    """Plain quantize_static leaves Constant-node weights float; normalization made them initializers, so the
    snippet the user runs must start from the normalized model or it rebuilds another, larger model."""
    model = fixture_path("robustness", "constant_weights.onnx")
    calib = fixture_path("robustness", "constant_weights_calib.npz")
    report, prop = tmp_path / "r.json", tmp_path / "p.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(report), "-q"]) == 0
    assert main(["propose", str(report), "--target-drop", "0", "-o", str(prop), "-q", "--time-runs", "0"]) in (0, 6)
    p = load_record(Proposal, prop, "proposal")
    assert repr(p.normalized_model) in p.snippet and repr(str(model.resolve())) not in p.snippet


def test_the_answers_interval_is_read_from_its_kept_score_and_never_from_a_screening_one():
    """No second evaluation of the answer when the search kept its score on every sample; a score kept by a
    screening evaluator (a subset, or the switchable fake-quant session) is not the deployed one: scored again."""
    from types import SimpleNamespace

    from qdebug.propose.run import _answer_interval
    from qdebug.propose.search import model_digest

    model = onnx.ModelProto(ir_version=8)
    kept = SimpleNamespace(samples=10)
    scored = []

    class Full:
        fp32_value = 0.9

        def drop_interval(self, result):
            return (0.0, 1.0) if result is kept else (2.0, 3.0)

        def score(self, m):
            scored.append(m)
            return SimpleNamespace(samples=10)

    full, screen = Full(), object()
    search = SimpleNamespace(results={model_digest(model): (full, kept)})
    assert _answer_interval(search, full, model, None) == (0.0, 1.0) and not scored
    search.results[model_digest(model)] = (screen, kept)
    assert _answer_interval(search, full, model, None) == (2.0, 3.0) and scored == [model]


class _FixAwareSearch(_FakeSearch):
    """A :class:`_FakeSearch` whose metric also sees each trial's per-node fixes (as ``fix:<tensor>``)."""

    def evaluate(self, step, nodes, overrides=(), per_channel=None, keep_float=(), fixes=()):
        seen = tuple(overrides) + tuple(f"fix:{o.tensor}" for o in fixes)
        return super().evaluate(step, nodes, seen, per_channel, keep_float)


def _whole(kind: str, tensor: str):
    from qdebug.propose.search import Fix
    from qdebug.records import TensorOverride

    return Fix(Unit(kind, "model", (), (), 0.0, "", "whole"), kind, (TensorOverride(tensor, reduce_range=True),), "why")


class _ChannelAwareSearch(_FixAwareSearch):
    """A :class:`_FixAwareSearch` whose metric also sees per-channel weights (as ``pc``), and which keeps
    the hints it is given."""

    def __init__(self, metric) -> None:
        super().__init__(metric)
        self.hints: list[list] = []

    def evaluate(self, step, nodes, overrides=(), per_channel=None, keep_float=(), fixes=()):
        seen = (*overrides, "pc") if per_channel else tuple(overrides)
        return super().evaluate(step, nodes, seen, None, keep_float, fixes)

    def prefetch(self, asked, sure=False) -> None:
        self.hints.append(list(asked))


def test_seven_bit_weights_for_the_whole_model_come_before_per_channel_weights():
    """Where the kernels saturate at several nodes (the whole reduce-range fix is offered), 7-bit weights are
    tried before per-channel weights, which do not cure it: where they meet the target, per-channel weights
    are never built, not even ahead (the first hints are the baseline and the 7-bit model alone); where they
    miss, per-channel weights come next, then the other whole-model fixes."""
    seven_bit, flipped = _whole("reduce-range", "w_all"), _whole("calib-flipped", "w_flip")
    allow = ("fp32", "per-channel")

    search = _ChannelAwareSearch(lambda nodes, overrides: 0.95 if overrides & {"fix:w_all", "pc"} else 0.2)
    search.allow = allow
    plan, met, _ = run_search(search, [_unit("a")], lambda p, w: [], None, wholes=[seven_bit, flipped])
    assert met is not None and plan.fixed == (seven_bit,) and not search.per_channel
    assert [t.step for t in search.trials] == ["baseline", "whole reduce-range"]
    assert len(search.hints) == 1 and len(search.hints[0]) == 2  # the baseline, the 7-bit model
    assert not any(a[2] for a in search.hints[0])  # per-channel weights not hinted

    search = _ChannelAwareSearch(lambda nodes, overrides: 0.95 if overrides & {"fix:w_flip"} else 0.2)
    search.allow = allow
    plan, met, _ = run_search(search, [_unit("a")], lambda p, w: [], None, wholes=[seven_bit, flipped])
    assert plan.fixed == (flipped,)
    assert [t.step for t in search.trials] == ["baseline", "whole reduce-range", "per-channel", "whole calib-flipped"]
    assert any(a[2] for a in search.hints[1])  # per-channel weights hinted once the 7-bit model missed

    # without the 7-bit fix, per-channel weights come first and are hinted at once, as before
    search = _ChannelAwareSearch(lambda nodes, overrides: 0.95 if "pc" in overrides else 0.2)
    search.allow = allow
    plan, met, _ = run_search(search, [_unit("a")], lambda p, w: [], None, wholes=[flipped])
    assert met is not None and search.per_channel and [t.step for t in search.trials] == ["baseline", "per-channel"]
    assert len(search.hints) == 1 and any(a[2] for a in search.hints[0])


def test_the_whole_model_fixes_are_tried_in_order_and_the_first_that_meets_is_the_answer():
    """7-bit weights for the whole model (where the kernels saturate) meet the target: one evaluation after
    the baseline, no node kept FP32; when it does not, the next whole fix is tried, then the node search."""
    seven_bit, flipped = _whole("reduce-range", "w_all"), _whole("calib-flipped", "w_flip")

    def metric(nodes, overrides):
        return 0.95 if "fix:w_all" in overrides else 0.2 + 0.75 * ("a" in nodes)

    search = _FixAwareSearch(metric)
    plan, met, _ = run_search(search, [_unit("a"), _unit("b")], lambda p, w: [], None, wholes=[seven_bit, flipped])
    assert met is not None and met.met and plan.fixed == (seven_bit,) and not plan.nodes()
    assert [t.step for t in search.trials] == ["baseline", "whole reduce-range"]

    def flipped_only(nodes, overrides):
        return 0.95 if "fix:w_flip" in overrides else 0.2 + 0.75 * ("a" in nodes)

    search = _FixAwareSearch(flipped_only)
    search.allow = ("fp32",)
    plan, met, _ = run_search(search, [_unit("a")], lambda p, w: [], None, wholes=[seven_bit, flipped])
    assert plan.fixed == (flipped,) and [t.step for t in search.trials] == [
        "baseline",
        "whole reduce-range",
        "whole calib-flipped",
    ]
    # neither meets: the node search goes on without them, and finds the node
    search = _FixAwareSearch(lambda nodes, overrides: 0.2 + 0.75 * ("a" in nodes))
    search.allow = ("fp32",)
    plan, met, _ = run_search(search, [_unit("a"), _unit("b")], lambda p, w: [], None, wholes=[seven_bit])
    assert met is not None and plan.nodes() == {"a"} and not plan.fixed


def test_quantize_dynamic_is_the_answer_where_the_node_cap_leaves_the_search_short(transformer, tmp_path):
    """The transformer's one-node cap misses the target (``test_max_nodes_cuts_a_region_instead_of_dropping_it``):
    with recipes, the dynamic recipe the stage scored and deferred becomes the answer, and the note says why."""
    options = ProposeOptions(max_nodes=1, time_runs=0)
    result = propose(transformer[3], output=tmp_path / "p.json", options=options)
    p = result.proposal
    assert result.met and p.recipe is not None and p.recipe.name == "dynamic" and p.nodes_to_exclude == ()
    assert any("found no answer that meets the target" in n for n in result.notes), result.notes


def test_the_search_starts_again_from_the_best_recipe_where_plain_static_falls_short(transformer, tmp_path):
    """No transform meets the target alone on the transformer and one node cannot (``--max-nodes 1``): the per-node
    search runs again from the best recipe that beat plain static, and its answer is taken only where it does
    better -- closer to the target with no more nodes than the answer from plain static."""
    plain = propose(transformer[3], output=None, options=ProposeOptions(max_nodes=1, time_runs=0, recipes=()))
    options = ProposeOptions(max_nodes=1, time_runs=0, recipes=("smooth", "bias-correction"))
    result = propose(transformer[3], output=tmp_path / "p.json", options=options)
    p, q = result.proposal, plain.proposal
    # On VNNI kernels: plain static + embed/add_position 92.4 %, smooth+bias-correction + the same node 93.0 %
    # (both miss 97 %). Which one wins rests on integer kernels that differ by CPU, so the rule is asserted:
    # the recipe's answer is taken only where it does better, and the notes say which happened.
    assert q.recipe is None and len(q.nodes_to_exclude) <= 1
    if p.recipe is not None:  # the best recipe: smooth+bias-correction on VNNI, smooth alone on AVX2 kernels
        assert set(p.recipe.steps) <= {"smooth", "bias-correction"} and len(p.nodes_to_exclude) <= 1
        assert p.expected_metric > q.expected_metric or len(p.nodes_to_exclude) < len(q.nodes_to_exclude)
        came = f"from recipe {'+'.join(p.recipe.steps)}"
        assert any(came in n and ("comes closer" in n or "meets it" in n) for n in result.notes), result.notes
    else:
        assert p.expected_metric == q.expected_metric
        assert any("did no better" in n for n in result.notes), result.notes
