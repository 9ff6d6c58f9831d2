"""``propose --allow calib-flipped`` (issue 19 item 2): the static model's flipped evaluation samples added to
the calibration, tried as a fix from the cached ranges plus those samples only.

On a generated model whose calibration data never reaches the range a bright part of the evaluation data
does: the flipped samples' FP32 ranges become ``rmin``/``rmax`` overrides that keep the saturated MatMul INT8
(instead of FP32), or, where they are the only loss, the whole model's; without the kind nothing changes; a
report without flips says so; verify and the snippet rebuild the same model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.report_io import dumps, load_report
from qdebug.propose import ProposeOptions, propose
from qdebug.propose import flipped as flipped_module
from qdebug.propose.blame import Unit
from qdebug.propose.flipped import LEAK_NOTE, SKIPPED, FlippedRanges, _meaningful, leak_notes
from qdebug.propose.options import check_allow
from qdebug.propose.structure import Structure
from qdebug.records import TensorOverride
from qdebug.verify import VerifyOptions, verify
from tests.conftest import qdq_scales

D, H, K = 16, 32, 4
"""Input features, hidden width, classes."""
GAIN = 2.5
"""The bright evaluation samples: 30 % of them, every feature this many times what calibration saw."""
BOTH = ("fp32", "calib-flipped")


def _graph(w1: np.ndarray, w2: np.ndarray, b2: np.ndarray, concat: bool) -> onnx.ModelProto:
    """MatMul+Add -> LayerNorm -> MatMul+Add (logits); with ``concat`` the logits joined with a score in
    [-300, -200] (never the argmax), whose per-tensor scale rounds the logits: a second, planted culprit."""
    f = lambda a, n: numpy_helper.from_array(np.asarray(a, np.float32), n)  # noqa: E731
    inits = [f(w1, "fc1.weight"), f(np.zeros(H), "fc1.bias"), f(np.ones(H), "ln.weight"), f(np.zeros(H), "ln.bias")]
    inits += [f(w2, "fc2.weight"), f(b2, "fc2.bias")]
    node = helper.make_node
    nodes = [
        node("MatMul", ["input", "fc1.weight"], ["fc1/matmul"], name="fc1/matmul"),
        node("Add", ["fc1/matmul", "fc1.bias"], ["fc1/bias_add"], name="fc1/bias_add"),
        node("LayerNormalization", ["fc1/bias_add", "ln.weight", "ln.bias"], ["ln"], name="ln", axis=-1),
        node("MatMul", ["ln", "fc2.weight"], ["fc2/matmul"], name="fc2/matmul"),
        node("Add", ["fc2/matmul", "fc2.bias"], ["logits"], name="fc2/bias_add"),
    ]
    out = "logits"
    if concat:
        aux = np.random.default_rng(7).normal(0, 1 / np.sqrt(H), (H, 1))
        inits += [f(aux, "aux.weight"), f(-100.0, "aux.scale"), f(-200.0, "aux.shift")]
        nodes += [
            node("MatMul", ["ln", "aux.weight"], ["aux/matmul"], name="aux/matmul"),
            node("Sigmoid", ["aux/matmul"], ["aux/sigmoid"], name="aux/sigmoid"),
            node("Mul", ["aux/sigmoid", "aux.scale"], ["aux/mul"], name="aux/mul"),
            node("Add", ["aux/mul", "aux.shift"], ["aux/add"], name="aux/add"),
            node("Concat", ["logits", "aux/add"], ["scores"], name="head/concat", axis=-1),
        ]
        out = "scores"
    graph = helper.make_graph(
        nodes,
        "saturating",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", D])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, x: np.ndarray, name: str) -> np.ndarray:
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    if name not in [o.name for o in proto.graph.output]:
        proto.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([name], {"input": x})[0]


def saturating_model(folder: Path, concat: bool, seed: int = 0) -> tuple[Path, Path, Path]:
    """(model, calib, eval): classes told apart by the relative size of positive features, calibrated on
    features in [0, 1.2]; 30 % of the evaluation samples are :data:`GAIN` times brighter. FP32 does not care
    (the LayerNorm undoes the scale) but static clips them at the calibrated range, which loses the relative
    sizes. The head is fitted (ridge) on FP32 features, so FP32's classes have margins; labels are FP32's."""
    rng = np.random.default_rng(seed)
    centers = rng.uniform(0.1, 1.0, (K, D))

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, K, n)
        return np.clip(centers[y] + 0.35 * rng.standard_normal((n, D)), 0.0, 1.2).astype(np.float32), y

    (x_calib, _), (x_eval, _), (x_fit, y_fit) = draw(64), draw(256), draw(512)
    x_eval[rng.random(len(x_eval)) < 0.3] *= GAIN
    w1 = rng.normal(0, 1 / np.sqrt(D), (D, H))
    feats = _run(_graph(w1, np.zeros((H, K)), np.zeros(K), False), x_fit, "ln").astype(np.float64)
    target = np.full((len(y_fit), K), -2.0)
    target[np.arange(len(y_fit)), y_fit] = 2.0
    mu = feats.mean(0)
    z = feats - mu
    w2 = np.linalg.solve(z.T @ z + 0.05 * len(z) * np.eye(H), z.T @ (target - target.mean(0)))
    model = _graph(w1, w2, target.mean(0) - mu @ w2, concat)
    folder.mkdir(parents=True, exist_ok=True)
    paths = folder / "model.onnx", folder / "calib.npz", folder / "eval.npz"
    onnx.save(model, str(paths[0]))
    for path, x in zip(paths[1:], (x_calib, x_eval), strict=True):
        np.savez(path, input=x, labels=_run(model, x, model.graph.output[0].name).argmax(1))
    return paths


def _analyzed(tmp: Path, concat: bool) -> tuple[Path, Path, Path, Path]:
    model, calib, evaluation = saturating_model(tmp, concat)
    report = tmp / "report.json"
    args = ["analyze", str(model), "--calib", str(calib), "--eval", str(evaluation), "-o", str(report), "-q"]
    assert main([*args, "--flip-details", "0"]) == 0
    return model, calib, evaluation, report


@pytest.fixture(scope="module")
def two_culprits(tmp_path_factory):
    """(model, calib, eval, report): the saturated MatMul and the head Concat both lose."""
    return _analyzed(tmp_path_factory.mktemp("flipped-concat"), concat=True)


@pytest.fixture(scope="module")
def saturation_only(tmp_path_factory):
    """(model, calib, eval, report): the saturated input range is the only loss."""
    return _analyzed(tmp_path_factory.mktemp("flipped-plain"), concat=False)


def _propose(report: Path, out: Path | None, allow: tuple[str, ...]):
    # no whole-model recipe: these tests compare the per-node FP32 search with the flipped samples' ranges
    # (on an AVX2 CPU's saturating kernels a recipe may meet the target first: tests/test_propose_recipes.py)
    return propose(report, output=out, options=ProposeOptions(allow=allow, time_runs=0, recipes=()))


def test_the_planted_model_loses_where_the_evaluation_data_leaves_the_calibrated_range(saturation_only):
    _, _, evaluation, report_path = saturation_only
    report = load_report(report_path)
    (calibrated,) = [t.summary for t in report.tensors if t.name == "input"]
    assert calibrated.max == pytest.approx(1.2)
    bright = np.load(evaluation)["input"].max(axis=1) > calibrated.max
    flips = [f.index for f in report.per_sample.variant("static").flips]
    assert len(flips) >= 4 and sum(bright[flips]) > len(flips) / 2 and bright.mean() < 0.3


def test_the_flipped_ranges_keep_the_saturated_matmul_int8_instead_of_fp32(two_culprits, tmp_path):
    model, calib, evaluation, report_path = two_culprits
    plain = _propose(report_path, None, ("fp32",))
    assert plain.met and {"fc1/matmul", "head/concat"} <= set(plain.proposal.nodes_to_exclude)
    result = _propose(report_path, tmp_path / "p.json", BOTH)
    proposal = result.proposal
    assert result.met and proposal.nodes_to_exclude == ("head/concat",)
    assert proposal.expected_metric >= result.target.threshold > proposal.static_metric
    (fix,) = [r for r in proposal.reasons if r.action == "calib-flipped"]
    static = load_report(report_path).per_sample.variant("static")
    assert fix.node == "fc1/matmul" and f"the {static.flipped} flipped evaluation samples" in fix.reason
    assert "range of input widened [0, 1.2] -> [0, 3" in fix.reason and "upper bound" in fix.reason
    # the overrides are the flipped samples' own FP32 ranges, on the MatMul's tensors only
    x = np.load(evaluation)["input"][[f.index for f in static.flips]]
    overrides = {o.tensor: o for o in proposal.tensor_overrides}
    assert set(overrides) == {"input", "fc1/matmul"}
    assert overrides["input"].rmax == pytest.approx(float(x.max()))
    proto = onnx.load(str(model))
    assert overrides["fc1/matmul"].rmax == pytest.approx(float(_run(proto, x, "fc1/matmul").max()), rel=1e-5)
    assert LEAK_NOTE in result.notes
    # verify rebuilds the same overrides from the proposal alone and measures the same metric
    options = VerifyOptions(runs=0)
    checked = verify(model, calib, evaluation, tmp_path / "p.json", options=options, output=tmp_path / "v.json")
    assert checked.variant("selective").metric == pytest.approx(proposal.expected_metric)
    selective = tmp_path / "v_files" / "selective.onnx"
    scales = qdq_scales(selective)
    assert qdq_scales(proposal.quantized_model) == pytest.approx(scales)
    assert scales["input_scale"] == pytest.approx(overrides["input"].rmax / 255, rel=1e-6)


def test_the_snippet_reproduces_the_widened_ranges(two_culprits, tmp_path, monkeypatch):
    _, _, _, report_path = two_culprits
    result = _propose(report_path, tmp_path / "p.json", BOTH)
    assert "'input': [{'rmin'" in result.proposal.snippet
    monkeypatch.chdir(tmp_path)
    exec(compile(result.proposal.snippet, "snippet", "exec"), {})
    mine, theirs = qdq_scales(tmp_path / "model.selective.onnx"), qdq_scales(result.proposal.quantized_model)
    assert mine.keys() == theirs.keys() and mine
    for name, value in theirs.items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-6, err_msg=name)


def test_where_the_saturation_is_the_only_loss_the_whole_model_ranges_are_the_answer(saturation_only, capsys):
    _, _, _, report_path = saturation_only
    plain = _propose(report_path, None, ("fp32",))
    assert plain.met and "fc1/matmul" in plain.proposal.nodes_to_exclude
    result = _propose(report_path, None, BOTH)
    assert result.met and result.proposal.nodes_to_exclude == ()
    assert [t.step for t in result.trials] == ["baseline", "whole calib-flipped"]
    (fix,) = result.proposal.reasons
    assert (fix.node, fix.action) == ("", "calib-flipped") and "for the whole model" in fix.reason
    assert "input" in {o.tensor for o in result.proposal.tensor_overrides}
    # only ranges the flipped samples widen meaningfully are overridden (a sliver more range costs resolution)
    calibrated = {name: (lo, hi) for name, lo, hi in load_report(report_path).ranges}
    for o in result.proposal.tensor_overrides:
        assert _meaningful(*calibrated[o.tensor], o.rmin, o.rmax), o
    # a whole-model option, so it may go alone (like per-channel); clip alone may not
    out = str(Path(report_path).with_name("alone.json"))
    args = ["--allow", "calib-flipped", "--recipes", "none", "--time-runs", "0"]
    assert main(["propose", str(report_path), *args, "-o", out, "-q"]) == 0
    assert LEAK_NOTE in capsys.readouterr().err


def test_without_the_kind_nothing_changes(two_culprits, monkeypatch):
    """Not in the default --allow (its recovery is measured on the samples it calibrates on): the flipped
    samples are never run and no fix of the kind is tried."""
    _, _, _, report_path = two_culprits

    def refuse(*args, **kwargs):
        raise AssertionError("sample_ranges ran without --allow calib-flipped")

    monkeypatch.setattr(flipped_module, "sample_ranges", refuse)
    result = propose(report_path, output=None, options=ProposeOptions(time_runs=0))
    assert "calib-flipped" not in {t.step.split()[-1] for t in result.trials}
    assert all(r.action != "calib-flipped" for r in result.proposal.reasons)
    assert not any("calib-flipped" in n for n in result.notes)


def test_a_report_without_flips_says_so_and_searches_as_without_the_kind(two_culprits, tmp_path):
    _, _, _, report_path = two_culprits
    report = load_report(report_path)
    plain = _propose(report_path, None, ("fp32",)).proposal
    none = tmp_path / "no-section.json"
    none.write_text(dumps(dataclasses.replace(report, per_sample=None)))
    section = report.per_sample
    static = dataclasses.replace(section.variant("static"), flipped=0, flips=())
    unflipped = tmp_path / "no-flips.json"
    no_flips = dataclasses.replace(section, variants=(static,))
    unflipped.write_text(dumps(dataclasses.replace(report, per_sample=no_flips)))
    for path, why in ((none, "the report has no per-sample section"), (unflipped, "static flips none of its samples")):
        result = _propose(path, None, BOTH)
        assert f"no flipped samples recorded: {why}; --allow calib-flipped skipped" in result.notes
        assert result.proposal.nodes_to_exclude == plain.nodes_to_exclude
        assert result.proposal.tensor_overrides == plain.tensor_overrides


def test_flips_recorded_on_other_data_than_this_runs_evaluation_are_not_used(two_culprits, tmp_path):
    """The flips are row numbers: of the calibration data (analyze without --eval), or of another file than
    this run evaluates on, they name other samples -- the kind is skipped, with a note saying why."""
    _, _, evaluation, report_path = two_culprits
    report = load_report(report_path)
    plain = _propose(report_path, None, ("fp32",)).proposal
    on_calib = tmp_path / "on-calib.json"
    section = dataclasses.replace(report.per_sample, data="calib")
    on_calib.write_text(dumps(dataclasses.replace(report, per_sample=section)))
    result = _propose(on_calib, None, BOTH)
    assert any(n.startswith("no flipped samples recorded on evaluation data") for n in result.notes), result.notes
    assert result.proposal.nodes_to_exclude == plain.nodes_to_exclude
    other = tmp_path / "other_eval.npz"
    other.write_bytes(Path(evaluation).read_bytes())  # the same rows, but not the file the flips were counted in
    result = propose(report_path, output=None, eval_data=other, options=ProposeOptions(allow=BOTH, time_runs=0))
    assert any("not of this run's evaluation data" in n and SKIPPED in n for n in result.notes), result.notes
    assert all(r.action != "calib-flipped" for r in result.proposal.reasons)


def test_a_unit_gets_only_its_own_meaningfully_widened_tensors(two_culprits):
    _, _, _, report_path = two_culprits
    report = load_report(report_path)
    structure = Structure(onnx.load(report.normalized_model), report.nodes)
    ranges = FlippedRanges(3, (("input", 0.0, 1.2, 0.0, 3.0), ("ln", -2.0, 2.0, -2.5, 2.5)))
    unit = Unit("fc1/matmul", "tensor", ("fc1/matmul",), ("fc1/matmul",), 1.0, "fc1/matmul", "test")
    fix = ranges.fix(unit, structure)
    assert fix is not None and fix.overrides == (TensorOverride("input", rmin=0.0, rmax=3.0),)
    assert "the 3 flipped evaluation samples" in fix.why and "range of input widened [0, 1.2] -> [0, 3]" in fix.why
    head = Unit("logits", "tensor", ("head/concat",), ("logits",), 1.0, "head/concat", "test")
    assert ranges.fix(head, structure) is None  # neither widened range is one of its tensors
    whole = ranges.whole()
    assert whole is not None and whole.overrides[1] == TensorOverride("ln", rmin=-2.5, rmax=2.5)
    assert "and 1 more" in whole.why  # two ranges: the first named, one more
    assert FlippedRanges(3, ()).whole() is None
    assert _meaningful(0.0, 1.0, 0.0, 1.2) and not _meaningful(0.0, 1.0, 0.0, 1.05)
    assert not _meaningful(-1.0, 1.0, -1.05, 1.05)  # 5 % wider: clips next to nothing
    assert not _meaningful(0.5, 1.0, 0.5, 1.08)  # ORT quantizes [0, 1] -> [0, 1.08]: 8 % wider, not 16 %
    # the answer uses the fix (leak note) as soon as one of its overrides is a widened range
    int16 = TensorOverride("ln", quant_type="QUInt16")
    assert leak_notes((int16, *fix.overrides), ranges) == (LEAK_NOTE,)
    assert leak_notes((int16,), ranges) == () and leak_notes(fix.overrides, None) == ()


def test_allow_checks():
    assert check_allow(["fp32", "calib-flipped"]) == BOTH
    assert check_allow(["calib-flipped"]) == ("calib-flipped",)
    for bad in (["calib-flipped", "clip"], ["clip"]):
        with pytest.raises(QDebugError) as e:
            check_allow(bad)
        assert e.value.code == ExitCode.USAGE and "\n" not in e.value.one_line()
