"""The per-sample drill-down (issue 19, item 2): which evaluation samples flip, and why.

Checked against direct onnxruntime runs of the demo model: the flipped samples are those whose argmax
changes, a flipped sample's worst tensor has the SQNR that tensor has for that sample alone, its clip rate
is the share of its values beyond the tensor's quantization range; the section round-trips through
``report.json`` (and reports without it still load), the CLI summary names the flips, the TUI lists them,
and verify records the selective model's flips.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qdebug.analysis.per_sample import clip_rate, cut, one_sample
from qdebug.cli.demo import demo_files
from qdebug.cli.main import main
from qdebug.evaluation.samples import flipped
from qdebug.graph.reduce import FakeQuant
from qdebug.output.ci_outputs import report_markdown
from qdebug.output.report_io import dumps, load_record, load_report
from qdebug.records import SCHEMA_VERSION, Proposal
from qdebug.records.samples import SampleSection
from qdebug.records.verify import VerifyResult
from qdebug.verify import VerifyOptions, verify

BATCH = 16
"""analyze's evaluation batch on the demo data (the npz is cut in batches of 16)."""


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(model, calib, eval, report path, report, stdout) of ``qdebug analyze`` on the demo, run once."""
    tmp = tmp_path_factory.mktemp("samples")
    model, calib, evaluation = demo_files()
    out = tmp / "report.json"
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qdebug-cache"))
        args = ["analyze", str(model), "--calib", str(calib), "--eval", str(evaluation), "-o", str(out), "-q"]
        assert main([*args, "--flip-details", "6"]) == 0
    return model, calib, evaluation, out, load_report(out), stdout.getvalue()


def _classes(model: Path | str, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, {"input": x[i : i + BATCH]})[0] for i in range(0, len(x), BATCH)]).argmax(1)


def _tensors(model: Path | str, names: list[str], x: np.ndarray) -> list[np.ndarray]:
    """``names`` of ``model`` (made graph outputs) for the input ``x``."""
    proto = onnx.load(str(model))
    have = {o.name for o in proto.graph.output}
    proto.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in have)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(names, {"input": x})


def _sqnr(r: np.ndarray, c: np.ndarray) -> float:
    r64, c64 = r.astype(np.float64), c.astype(np.float64)
    return 10 * math.log10(float((r64**2).sum()) / float(((r64 - c64) ** 2).sum()))


def test_flipped_samples_match_argmax_of_both_models(demo):
    model, _, evaluation, out, report, _ = demo
    data = np.load(evaluation)
    x, labels = data["input"], data["labels"]
    fp32 = _classes(model, x)
    static = _classes(out.parent / "report_files" / "quantized.onnx", x)
    section = report.per_sample
    assert section is not None and section.kind == "class" and section.data == "eval" and section.samples == 500
    assert list(section.fp32) == fp32.tolist() and section.labels == tuple(labels.tolist())
    v = section.variant("static")
    assert list(v.results) == static.tolist()
    changed = np.flatnonzero(fp32 != static)
    assert v.flipped == len(changed) > 10
    assert {f.index for f in v.flips} == set(changed.tolist())
    lost = {int(i) for i in changed if fp32[i] == labels[i]}
    gained = {int(i) for i in changed if static[i] == labels[i]}
    assert {f.index for f in v.flips if f.effect == "lost"} == lost
    assert {f.index for f in v.flips if f.effect == "gained"} == gained
    # the accuracy the report states is what the per-sample results add up to
    assert np.mean(static == labels) == pytest.approx(report.task.quantized)
    # worst first: every lost sample before the others, then by output SQNR
    effects = [f.effect for f in v.flips]
    assert effects[: len(lost)] == ["lost"] * len(lost)
    sqnrs = [f.output_sqnr_db for f in v.flips[: len(lost)]]
    assert sqnrs == sorted(sqnrs)
    # a flip names its input: the batch's file and slice, and the row in it
    first = v.flips[0]
    assert first.origin.endswith(f"eval.npz[{first.index // BATCH * BATCH}:{first.index // BATCH * BATCH + BATCH}]")
    assert first.row == first.index % BATCH and first.label == labels[first.index]
    # its output SQNR is that sample's logits against FP32's
    quantized = out.parent / "report_files" / "quantized.onnx"
    logits = [_tensors(m, ["logits"], x[first.index : first.index + 1])[0] for m in (model, quantized)]
    assert first.output_sqnr_db == pytest.approx(_sqnr(*logits), abs=1e-3)


def test_a_flipped_samples_worst_tensor_and_clip_rate_are_real(demo):
    model, _, evaluation, out, report, _ = demo
    section = report.per_sample
    v = section.variant("static")
    assert section.detail_variant == "static" and len(section.details) == 6
    assert [d.index for d in section.details] == [f.index for f in v.flips[:6]]
    x = np.load(evaluation)["input"]
    detail = section.details[0]
    worst = section.worst_tensors(detail, 1)[0]
    one = x[detail.index : detail.index + 1]
    quantized = out.parent / "report_files" / "quantized.onnx"
    record = report.tensor(worst.tensor)
    (ref,) = _tensors(model, [worst.tensor], one)
    (cand,) = _tensors(quantized, [record.quantized_name], one)
    assert worst.sqnr_db == pytest.approx(_sqnr(ref, cand), abs=1e-4)
    assert detail.output_sqnr_db == pytest.approx(v.flips[0].output_sqnr_db, abs=0.05)  # the re-run agrees
    # the rows run along depth (topological order) and the worst is a real drop somewhere on it
    assert list(section.tensor_depths) != sorted(section.tensor_depths, reverse=True)
    assert len(detail.sqnr_db) == len(section.tensors) == len(detail.clip_rate)
    # clip rates: the share of the sample's FP32 values beyond what the tensor's Q/DQ represents
    checked = 0
    for d in section.details:
        for name, rate in zip(section.tensors, d.clip_rate, strict=True):
            q = report.tensor(name).quant
            if q is None or math.isnan(rate) or (checked and rate == 0):
                continue
            (values,) = _tensors(model, [name], x[d.index : d.index + 1])
            levels = np.rint(values.astype(np.float32) / np.float32(q.scale)) + q.zero_point
            info = np.iinfo(q.qtype)
            assert rate == pytest.approx(float(np.mean((levels < info.min) | (levels > info.max)))), name
            checked += 1
        if checked > 3:
            break
    assert checked > 1
    assert any(c > 0 for d in section.details for c in d.clip_rate if not math.isnan(c))


def test_the_cli_summary_names_the_count_and_the_five_worst(demo):
    *_, report, stdout = demo
    v = report.per_sample.variant("static")
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("flipped samples (top1"))
    assert lines[head + 1].strip().startswith(f"static: {v.flipped} of 500 samples flip (")
    worst = [line.strip() for line in lines[head + 3 : head + 8]]
    assert [line.split()[0] for line in worst] == [f"#{f.index}" for f in v.flips[:5]]
    assert all("eval.npz[" in line and "diverges most at" in line for line in worst)
    markdown = report_markdown(report)
    assert "**flipped samples (top1 per sample vs FP32, 500 eval samples)**" in markdown
    assert f"| #{v.flips[0].index} | eval.npz[" in markdown


def test_the_section_round_trips_and_old_files_load_without_it(demo, tmp_path):
    *_, out, report, _ = demo
    section = report.per_sample
    assert isinstance(section, SampleSection) and section.version == 1
    raw = json.loads(out.read_text())  # as analyze wrote it from the record it built
    assert json.loads(dumps(section)) == raw["per_sample"]  # loaded and written again: the same JSON
    assert raw["per_sample"]["variants"][0]["results"][:3] == list(section.variant("static").results[:3])
    assert raw["per_sample"]["details"][0]["clip_rate"] == [
        "nan" if math.isnan(c) else c for c in section.details[0].clip_rate
    ]
    del raw["per_sample"]  # a report written before the section
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    assert load_report(old).per_sample is None
    result = VerifyResult(SCHEMA_VERSION, "verify", "m", "", "p", "top1", 1, 1, (), 0.0, 0.9, math.nan, True, "", 0.0)
    text = json.loads(dumps(result))
    del text["per_sample"]
    path = tmp_path / "verify.json"
    path.write_text(json.dumps(text))
    assert load_record(VerifyResult, path, "verify").per_sample is None


def test_the_samples_screen_lists_the_flips_and_shows_their_divergence(demo):
    from textual.notifications import Notify

    from qdebug.tui.app import QDebugApp
    from qdebug.tui.samples import SamplesScreen
    from qdebug.tui.screens import MainScreen
    from tests.tui_report import make_report

    report = demo[4]
    flips = report.per_sample.variant("static").flips

    async def run() -> None:
        app = QDebugApp(report)
        async with app.run_test(size=(140, 40)) as pilot:
            await pilot.pause()
            keys = {b.binding.key: b.binding.description for b in app.screen.active_bindings.values()}
            assert keys["i"] == "Samples"
            await pilot.press("i")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, SamplesScreen)
            table = screen.query_one("#flips")
            assert table.row_count == len(flips)
            assert [str(k.value) for k in table.rows][:3] == [str(f.index) for f in flips[:3]]
            assert screen.shown == flips[0].index
            divergence = screen.query_one("#divergence")
            assert divergence.row_count == len(report.per_sample.tensors)
            await pilot.press("down")
            await pilot.pause()
            assert screen.shown == flips[1].index
            for _ in range(4):  # rank, sample, input, change -> out SQNR
                await pilot.press("s")
            await pilot.pause()
            assert screen.model.sort_key == "sqnr"
            order = [r.flip.output_sqnr_db for r in screen.model.rows()]
            assert order == sorted(order)
            assert screen.shown == screen.model.rows()[0].flip.index  # a new order: the cursor on its first row
            await pilot.press("r")
            await pilot.pause()
            assert [r.flip.output_sqnr_db for r in screen.model.rows()] == sorted(order, reverse=True)
            # a flip beyond the measured ones says so instead of a table
            last = flips[-1].index
            screen.show_sample(last)
            assert divergence.row_count == 0 and "--flip-details" in screen.model.detail_head(last)
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)
        notes: list[str] = []

        def hook(message) -> None:
            if isinstance(message, Notify):
                notes.append(message.notification.message)

        bare = QDebugApp(make_report())  # a report without the section: i says so, nothing opens
        async with bare.run_test(size=(120, 40), message_hook=hook) as pilot:
            await pilot.pause()
            await pilot.press("i")
            await pilot.pause()
            assert isinstance(bare.screen, MainScreen)
            assert any("no per-sample drill-down" in n for n in notes)

    asyncio.run(run())


def test_verify_records_the_selective_models_flips(demo, tmp_path):
    model, calib, evaluation, _, report, _ = demo
    nodes = ("embed/add_position", "layer0/ln1", "layer0/attn_residual", "layer0/ln2", "layer0/ffn_residual")
    proposal = Proposal(SCHEMA_VERSION, "proposal", "", report.model.sha256, "", nodes, method="minmax")
    out = tmp_path / "verify.json"
    options = VerifyOptions(runs=0, flip_details=2, calib_add_flipped=True)
    result = verify(model, calib, evaluation, proposal, options=options, output=out)
    section = result.per_sample
    assert section is not None and [v.name for v in section.variants] == ["static", "selective"]
    x, labels = np.load(evaluation)["input"], np.load(evaluation)["labels"]
    fp32 = _classes(model, x)
    selective = _classes(out.parent / "verify_files" / "selective.onnx", x)
    sel = section.variant("selective")
    assert list(sel.results) == selective.tolist()
    assert {f.index for f in sel.flips} == set(np.flatnonzero(fp32 != selective).tolist())
    assert sel.flipped < section.variant("static").flipped
    assert np.mean(selective == labels) == pytest.approx(result.variant("selective").metric)
    assert section.detail_variant == "selective" and len(section.details) == min(2, sel.flipped)
    assert "selective vs static:" in section.comparison_line()
    assert load_record(VerifyResult, out, "verify").per_sample.variant("selective").flipped == sel.flipped
    # --calib-add-flipped: the cached ranges widened by static's flipped samples, both variants scored again
    again = section.recalibrated
    static = section.variant("static")
    assert again is not None and again.samples_added == static.flipped and again.tensors_widened > 0
    assert [(v.name, v.before) for v in again.variants] == [
        ("static", result.variant("static").metric),
        ("selective", result.variant("selective").metric),
    ]
    assert again.variants[0].flipped_before == static.flipped and 0 <= again.variants[0].recovered <= static.flipped
    tensor, lo, hi, new_lo, new_hi = again.widened[0]
    rows = [f.index for f in static.flips]
    (values,) = _tensors(model, [tensor], x[rows])  # one batch: no op mixes the samples
    assert new_lo == pytest.approx(min(lo, float(values.min())), abs=1e-5)
    assert new_hi == pytest.approx(max(hi, float(values.max())), abs=1e-5)
    assert (new_lo, new_hi) != (lo, hi)
    assert any(line.startswith("  calibration + the ") for line in section.summary_lines())


def test_the_flip_rule_per_kind():
    fp32 = np.array([1, 2, 3, 4], dtype=float)
    sqnr = np.array([30.0, 5.0, np.nan, 10.0])
    labels = np.array([1, 0, 3, 9])
    # classes: lost (FP32 right) first, then changed, then gained; by output SQNR inside each
    assert flipped("class", fp32, np.array([0, 0, 0, 7], dtype=float), labels, sqnr) == [0, 2, 3, 1]
    assert flipped("class", fp32, fp32.copy(), labels, sqnr) == []
    assert flipped("hit", np.ones(4), np.array([1.0, 0.0, 0.0, 1.0]), None, sqnr) == [1, 2]
    # values: the worst 5 % (at least one) by their drop, among those that dropped
    values = np.linspace(0.0, 1.0, 100)
    drops = values.copy()
    drops[[3, 50, 70]] -= [0.5, 0.9, 0.2]
    assert flipped("value", values, drops, None, np.full(100, np.nan)) == [50, 3, 70]
    assert flipped("value", values, values.copy(), None, np.full(100, np.nan)) == []


def test_a_value_metrics_list_says_it_is_the_worst_share_not_flips():
    """For a value metric the listed samples are the worst 5 % by it, a quantile of fixed size: "5 of
    static's 5 recovered, 0 still flip, 5 new" read as a measurement (issue 38)."""
    from qdebug.records.samples import SampleFlip, VariantSamples

    def variant(name: str, worst: list[int]) -> VariantSamples:
        flips = tuple(SampleFlip(i, "eval.npz[0:100]", i, None, 30.0, 20.0, "worse", 20.0) for i in worst)
        return VariantSamples(name, (25.0,) * 100, len(flips), flips)

    variants = (variant("static", [1, 2, 3, 4, 5]), variant("selective", [1, 2, 7, 8, 9]))
    section = SampleSection(1, "output_sqnr_db", "value", "eval", 100, "worst 5%", (30.0,) * 100, None, variants, 200)
    lines = section.summary_lines()
    assert lines[0] == "worst samples (output_sqnr_db per sample vs FP32, 100 eval samples; no value flips):"
    assert lines[1] == "  static: 5 of 100 samples listed, its worst 5% by output_sqnr_db (not flips)"
    assert lines[3] == (
        "  selective vs static, each one's worst 5%: 2 samples in both, 3 only in static's, 3 only in selective's"
    )
    assert not any("recovered" in line or "still flip" in line for line in lines)
    from qdebug.output.ci_outputs import samples_markdown  # the Markdown summary says it the same way

    assert section.count_line("static") in samples_markdown(section)


def test_clip_rate_per_tensor_and_per_channel():
    fq = FakeQuant(np.array(0.1, dtype=np.float32), np.array(128, dtype=np.uint8))
    x = np.array([-13.0, -12.8, 0.0, 12.7, 12.8, np.nan], dtype=np.float32)  # levels 128 +- 127.5 round off
    assert clip_rate(x, fq) == pytest.approx(2 / 5)
    per_channel = FakeQuant(np.array([1.0, 0.01], dtype=np.float32), np.array([0, 0], dtype=np.int8), axis=1)
    y = np.array([[1.0, 1.0], [2.0, 2.0]], dtype=np.float32)  # channel 1 holds at most 1.27
    assert clip_rate(y, per_channel) == pytest.approx(0.25)


def test_without_evaluation_data_the_flips_are_on_the_calibration_data(demo, tmp_path):
    """analyze scores its metric on the outputs the capture saw: the drill-down re-reads that data."""
    model, calib, _, _, _, _ = demo
    out = tmp_path / "calib.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q", "--flip-details", "1"]) == 0
    section = load_report(out).per_sample
    assert section.data == "calib" and section.samples == 128
    x = np.load(calib)["input"]
    fp32, static = _classes(model, x), _classes(out.parent / "calib_files" / "quantized.onnx", x)
    v = section.variant("static")
    assert {f.index for f in v.flips} == set(np.flatnonzero(fp32 != static).tolist()) != set()
    assert all(f.origin.endswith("calib.npz[" + f"{f.index - f.row}:{f.index - f.row + BATCH}]") for f in v.flips)
    assert len(section.details) == 1 and section.details[0].index == v.flips[0].index


def test_a_fixed_batch_model_runs_the_sample_as_copies_of_itself():
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(4, 3), "gain": np.array(2.0, dtype=np.float32)}
    sample = cut(9, feeds, 1, 4, {"x": 0, "gain": None})
    assert sample.feeds["x"].tolist() == [[3.0, 4.0, 5.0]] and sample.feeds["gain"] == 2.0
    alone, copies = one_sample(sample, 1)
    assert copies == 1 and alone["x"].shape == (1, 3)
    four, copies = one_sample(sample, 4)
    assert copies == 4 and four["x"].tolist() == [[3.0, 4.0, 5.0]] * 4 and four["gain"] == 2.0
    whole = cut(0, {"x": feeds["x"][:1]}, 0, 1, {"x": 0})
    assert one_sample(whole, 1)[1] == 1


def test_exact_match_and_a_custom_metrics_per_sample_form(tmp_path):
    """A hit lost is a flip; a custom metric's per-sample values list the worst 5 % by their drop."""
    from tests.test_integer_outputs import _argmax_model, _predictions

    model = _argmax_model(tmp_path / "m.onnx", tail="topk")
    x = np.random.default_rng(4).normal(0, 1, (64, 16)).astype(np.float32)
    np.savez(tmp_path / "c.npz", x=x)
    hook = tmp_path / "same_top3.py"
    hook.write_text(
        "import numpy as np\n\n"
        "def per(reference, candidate, labels):\n"
        "    return [float(v) for r, c in zip(reference, candidate) for v in (r['cls'] == c['cls']).all(axis=1)]\n\n"
        "def same(reference, candidate, labels):\n"
        "    return float(np.mean(per(reference, candidate, labels)))\n\n"
        "same.per_sample = per\n\n"
        "def odd(reference, candidate, labels):\n"
        "    return same(reference, candidate, labels)\n\n"
        "odd.per_sample = lambda reference, candidate, labels: [1.0] * sum(len(r['cls']) for r in reference)\n"
    )
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(out), "-q"]) == 0
    section = load_report(out).per_sample
    ref, quant = _predictions(model, x), _predictions(tmp_path / "r_files" / "quantized.onnx", x)
    lost = np.flatnonzero(~(ref == quant).all(axis=1))
    assert section.kind == "hit" and 0 < len(lost) < 64
    v = section.variant("static")
    assert v.flipped == len(lost) and {f.index for f in v.flips} == set(lost.tolist())
    assert {f.effect for f in v.flips} == {"lost"} and section.details  # float tensors inside: measured
    custom = tmp_path / "custom.json"
    args = ["analyze", str(model), "--calib", str(tmp_path / "c.npz"), "-o", str(custom), "-q"]
    assert main([*args, "--metric", f"{hook}:same", "--flip-details", "0"]) == 0
    section = load_report(custom).per_sample
    assert section.kind == "value" and section.details == ()
    v = section.variant("static")
    assert [f.index for f in v.flips] == lost[: math.ceil(0.05 * 64)].tolist()  # equal drops: by index
    assert all(f.fp32 == 1.0 and f.result == 0.0 and f.effect == "worse" for f in v.flips)
    # a per-sample form that does not add up to the metric: the analysis still succeeds, a note says why
    odd = tmp_path / "odd.json"
    assert main([*args[:-3], "-o", str(odd), "-q", "--metric", f"{hook}:odd"]) == 0
    report = load_report(odd)
    assert report.per_sample is None
    assert any(n.startswith("per-sample drill-down skipped: metric ") and "average" in n for n in report.notes)
