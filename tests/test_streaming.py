"""Streaming models whose state has its batch axis elsewhere (issue 16 item 5).

A streaming voice-activity model takes ``input [batch, 64]``, ``state [2, batch, 16]`` (the ONNX RNN
layout: batch on axis 1) and a scalar ``sr``; each file of the data folder is one chunk with its state.
``qdebug analyze`` had refused all of it ("arrays disagree on the number of samples (axis 0 sizes
[1, 2])"). The batch axis is now read off the model (or ``--batch-axis``), and everything that cuts,
counts or joins samples uses it: the data, the capture's chunks, ``--max-samples``, the evaluation,
bench's and verify's timed batches and the snippet's reader. Fixtures: ``tests/streaming_models.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qdebug.cli.main import main
from qdebug.data import batch_axes, batch_axis_note, model_input_specs, open_data
from qdebug.errors import ExitCode
from qdebug.output.report_io import load_report
from tests.models import small_cnn
from tests.streaming_models import stream_data, streaming_vad, streaming_vad_if

OLD_REFUSAL = "arrays disagree on the number of samples (axis 0 sizes"


def _sqnr(model: Path, quantized: Path, feeds: list[dict[str, np.ndarray]], output: str) -> float:
    """The SQNR (dB) of ``output`` of ``quantized`` against ``model`` over ``feeds``, with plain ORT."""
    fp32 = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    qdq = ort.InferenceSession(str(quantized), providers=["CPUExecutionProvider"])
    signal = noise = 0.0
    for f in feeds:
        ref = fp32.run([output], f)[0].astype(np.float64)
        cand = qdq.run([output], f)[0].astype(np.float64)
        signal += float((ref**2).sum())
        noise += float(((ref - cand) ** 2).sum())
    return 10 * math.log10(signal / noise)


def _files(folder: Path) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(f)) for f in sorted(folder.glob("*.npz"))]


def _first_samples(files: list[dict[str, np.ndarray]], n: int) -> list[dict[str, np.ndarray]]:
    """The first ``n`` samples of the files, cut on the model's axes by hand (input 0, state 1)."""
    out = []
    for f in files:
        take = min(n, len(f["input"]))
        if take <= 0:
            break
        state = np.ascontiguousarray(f["state"][:, :take])
        out.append({"input": f["input"][:take], "state": state, "sr": f["sr"]})
        n -= take
    return out


@pytest.fixture
def vad(tmp_path):
    """The plain model with a batch-1 folder (12 chunks) and a batch-4 folder (6 files of 4 streams)."""
    model = streaming_vad(tmp_path / "vad.onnx")
    return model, stream_data(model, tmp_path / "one"), stream_data(model, tmp_path / "four", files=6, streams=4)


def _axis_note(report: Path) -> str:
    """The report's batch-axis note (the printed one may be wrapped at the terminal's width)."""
    return next(n for n in load_report(report).notes if n.startswith("batch axis:"))


def _analyze(capsys, model: Path, data: Path, out: Path, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["analyze", str(model), "--calib", str(data), "-o", str(out), "--no-cache", *argv])
    got = capsys.readouterr()
    return code, got.out, got.err


def test_each_inputs_batch_axis_is_read_off_the_model(tmp_path):
    """The symbolic dimension the inputs share, wherever it sits; the only static size they share; the
    data's shapes when the model names none; none at all when the state is shared by the batch."""
    specs = model_input_specs(onnx.load(streaming_vad(tmp_path / "named.onnx")))
    assert batch_axes(specs) == {"input": 0, "state": 1, "sr": None}
    assert "symbolic dimension 'batch'" in specs[0].batch_rule
    static = model_input_specs(onnx.load(streaming_vad(tmp_path / "static.onnx", batch=4)))
    assert batch_axes(static) == {"input": 0, "state": 1, "sr": None}
    assert "size 4, the only one every input declares" in static[0].batch_rule
    unnamed = streaming_vad(tmp_path / "unnamed.onnx", batch=None)
    # files of 2 streams: axis 0 is 2 in both, but only the state's unnamed axis 1 can be its batch
    data = open_data(stream_data(unnamed, tmp_path / "u", files=2, streams=2), model_input_specs(onnx.load(unnamed)))
    assert batch_axes(data.specs) == {"input": 0, "state": 1, "sr": None}
    assert data.n_samples == 4 and "size 2, the only one every input has in" in data.specs[0].batch_rule
    shared = model_input_specs(onnx.load(streaming_vad(tmp_path / "shared.onnx", state_batch=False)))
    assert batch_axes(shared) == {"input": None, "state": None, "sr": None}
    overridden = model_input_specs(onnx.load(streaming_vad(tmp_path / "o.onnx")), [("state", 1), ("input", 0)])
    assert batch_axes(overridden) == {"input": 0, "state": 1, "sr": None}
    assert "--batch-axis" in overridden[0].batch_rule
    # an ordinary model keeps axis 0 and says nothing
    ordinary = model_input_specs(onnx.load(small_cnn(tmp_path / "cnn.onnx")))
    assert {s.batch_axis for s in ordinary} == {0} and batch_axis_note(ordinary) is None


def test_analyze_a_streaming_model_with_its_state_batch_on_axis_1(vad, tmp_path, capsys):
    """The refusal is gone; the note says which axis each input got and why; the samples are the chunks;
    the report's output SQNR is the one plain ORT gives on the files as they are."""
    model, one, _ = vad
    out = tmp_path / "r.json"
    code, stdout, err = _analyze(capsys, model, one, out)
    assert code == 0, err
    assert "Traceback" not in err and OLD_REFUSAL not in err
    assert "note: batch axis: 'input' on axis 0, 'state' on axis 1" in stdout
    assert _axis_note(out).startswith(
        "batch axis: 'input' on axis 0, 'state' on axis 1 (from the symbolic dimension 'batch' every input has); "
        "'sr' (a scalar) fed whole with every batch"
    )
    report = load_report(out)
    assert report.samples == 12 and report.task is not None and report.task.samples == 12
    quantized = tmp_path / "r_files" / "quantized.onnx"
    for name in ("prob", "stateN"):
        got = next(t for t in report.tensors if t.name == name).accumulated.sqnr_db
        assert got == pytest.approx(_sqnr(model, quantized, _files(one), name), abs=1e-3)


def test_max_samples_and_capture_chunks_cut_the_state_on_its_batch_axis(vad, tmp_path, capsys):
    """Files of 4 streams: --max-samples 10 ends inside the third file and --batch-size 2 cuts each file in
    two (the capture cuts further into chunks); the numbers are plain ORT's on the first 10 samples cut on
    axis 0 of the input and axis 1 of the state."""
    model, _, four = vad
    out = tmp_path / "r.json"
    code, stdout, err = _analyze(capsys, model, four, out, "--max-samples", "10", "--batch-size", "2", "-q")
    assert code == 0, err
    report = load_report(out)
    assert report.samples == 10 and report.task.samples == 10
    head = _first_samples(_files(four), 10)
    quantized = tmp_path / "r_files" / "quantized.onnx"
    for name in ("prob", "stateN"):
        got = next(t for t in report.tensors if t.name == name).accumulated.sqnr_db
        assert got == pytest.approx(_sqnr(model, quantized, head, name), abs=1e-3)


def test_batch_axis_flag_overrides_the_model(vad, tmp_path, capsys):
    """--batch-axis (repeatable, or a comma list) gives the axes; the note names the flag. A wrong axis is
    one line naming each input's size on its axis (exit 5); an unknown input or a bad pair is a usage
    error."""
    model, _, four = vad
    code, stdout, err = _analyze(capsys, model, four, tmp_path / "a.json", "--batch-axis", "input=0,state=-2")
    assert code == 0, err
    assert "(from --batch-axis for 'input', 'state')" in _axis_note(tmp_path / "a.json")
    # the report records the overrides and propose repeats them
    assert load_report(tmp_path / "a.json").config.batch_axes == (("input", 0), ("state", -2))
    out = tmp_path / "a_p.json"
    assert main(["propose", str(tmp_path / "a.json"), "-o", str(out), "-q", "--time-runs", "0"]) in (0, 6)
    assert "BATCH_AXES = {'input': 0, 'state': 1, 'sr': None}" in json.loads(out.read_text())["snippet"]
    capsys.readouterr()
    code, stdout, err = _analyze(capsys, model, four, tmp_path / "b.json", "--batch-axis", "state=0", "-q")
    assert code == ExitCode.DATA and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "arrays disagree on the number of samples (axis 0): {'input': 4, 'state': 2}" in line
    assert "--batch-axis NAME=AXIS" in line
    code, _, err = _analyze(capsys, model, four, tmp_path / "f.json", "--batch-axis", "input=1", "-q")
    assert code == ExitCode.DATA
    assert "(input: 64 on axis 1, state: 4 on axis 1)" in err.strip().splitlines()[-1]
    code, _, err = _analyze(capsys, model, four, tmp_path / "c.json", "--batch-axis", "states=1", "-q")
    assert code == ExitCode.USAGE and "the model has no input 'states'" in err
    code, _, err = _analyze(capsys, model, four, tmp_path / "d.json", "--batch-axis", "state=3", "-q")
    assert code == ExitCode.USAGE and "has no axis 3" in err
    code, _, err = _analyze(capsys, model, four, tmp_path / "e.json", "--batch-axis", "state", "-q")
    assert code == ExitCode.USAGE and "expected NAME=AXIS" in err and "Traceback" not in err


def test_a_state_shared_by_the_batch_makes_each_file_one_batch(tmp_path, capsys):
    """No axis every input shares (a state [2, 16] next to input [batch, 64]): each file is one
    indivisible batch, one sample, fed whole; the note says so."""
    model = streaming_vad(tmp_path / "m.onnx", state_batch=False)
    data = stream_data(model, tmp_path / "d", files=5, streams=3, state_batch=False)
    code, stdout, err = _analyze(capsys, model, data, tmp_path / "r.json", "--batch-size", "1")
    assert code == 0, err
    assert _axis_note(tmp_path / "r.json").startswith("batch axis: none (no axis every input shares")
    report = load_report(tmp_path / "r.json")
    assert report.samples == 5
    got = next(t for t in report.tensors if t.name == "prob").accumulated.sqnr_db
    assert got == pytest.approx(_sqnr(model, tmp_path / "r_files" / "quantized.onnx", _files(data), "prob"), abs=1e-3)


def test_a_hook_of_single_chunks_fills_a_fixed_batch_on_the_states_axis(tmp_path, capsys):
    """A model exported with a fixed batch of 4 (input [4, 64], state [2, 4, 16]) and a hook yielding one
    chunk at a time: the items are stacked on each input's batch axis into batches of 4."""
    model = streaming_vad(tmp_path / "m.onnx", batch=4)
    hook = tmp_path / "hook.py"
    hook.write_text(
        "import numpy as np\n"
        "def chunks():\n"
        "    rng = np.random.default_rng(0)\n"
        "    for i in range(8):\n"
        "        yield {'input': rng.normal(size=(1, 64)).astype(np.float32),\n"
        "               'state': rng.uniform(-1, 1, (2, 1, 16)).astype(np.float32), 'sr': np.int64(16000)}\n"
    )
    code, stdout, err = _analyze(capsys, model, Path(f"{hook}:chunks"), tmp_path / "r.json", "-q")
    assert code == 0, err
    assert load_report(tmp_path / "r.json").samples == 8
    # a model that names none of its dimensions: the hook's first item decides
    unnamed = streaming_vad(tmp_path / "u.onnx", batch=None)
    code, stdout, err = _analyze(capsys, unnamed, Path(f"{hook}:chunks"), tmp_path / "u.json", "-q")
    assert code == 0, err
    note = next(n for n in load_report(tmp_path / "u.json").notes if n.startswith("batch axis:"))
    assert "'state' on axis 1 (from size 1, the only one every input has in" in note and "item 0" in note


def test_propose_verify_bench_and_the_snippet_on_a_streaming_model(vad, tmp_path, capsys, monkeypatch):
    """The whole loop on files of 4 streams: propose and verify exit normally, verify times a batch of 4
    samples, bench counts 24 samples in batches of 4, and propose's snippet feeds ORT's quantize_static."""
    model, _, four = vad
    report, proposal = tmp_path / "r.json", tmp_path / "p.json"
    assert _analyze(capsys, model, four, report, "-q")[0] == 0
    argv = ["propose", str(report), "-o", str(proposal), "-q", "--target-sqnr", "38", "--accept-no-speedup"]
    argv += ["--recipes", "none"]  # a static answer: its snippet's calibration reader is what is tested here
    assert main(argv) in (0, ExitCode.TARGET_NOT_MET)
    capsys.readouterr()
    verify = ["verify", str(model), "--proposal", str(proposal), "--calib", str(four), "--runs", "2"]
    code = main([*verify, "--target-sqnr", "30", "-q", "-o", str(tmp_path / "v.json")])
    got = capsys.readouterr()
    assert code in (0, ExitCode.TARGET_NOT_MET) and "Traceback" not in got.err
    assert "timing: batch 4," in got.out and "batch axis: 'input' on axis 0, 'state' on axis 1" in got.out
    bench = ["bench", str(model), "--calib", str(four), "--variants", "fp32,static", "--runs", "1"]
    bench += ["--warmup", "0", "--no-dynamic-layers", "--batch-axis", "state=1", "--batch-axis", "input=0"]
    assert main([*bench, "-o", str(tmp_path / "b.json"), "-q"]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["samples"] == 24 and result["batch_size"] == 4
    assert any("--batch-axis for 'state', 'input'" in n for n in result["notes"])
    snippet = json.loads(proposal.read_text())["snippet"]
    work = tmp_path / "snippet"
    work.mkdir()
    monkeypatch.chdir(work)
    exec(compile(snippet, "snippet.py", "exec"), {"__name__": "__main__"})
    selective = onnx.load(work / "model.selective.onnx")
    assert any(n.op_type == "QuantizeLinear" for n in selective.graph.node)
    ort.InferenceSession(str(work / "model.selective.onnx"), providers=["CPUExecutionProvider"])


def test_verify_scores_the_answer_propose_recorded_whatever_its_recipe(vad, tmp_path, capsys):
    """On this stateful model the answer may be quantize_dynamic with per-channel weights (40.3 dB against 36.5
    without, VNNI): the per-channel flag had been dropped without an evaluation -- a dynamic model has no Q/DQ
    to show it -- so proposal.json recorded 40.3 dB for a model verify scored at 36.5. Whatever the answer
    on this CPU, verify's selective model scores what propose recorded."""
    model, _, four = vad
    report, proposal, out = tmp_path / "r.json", tmp_path / "p.json", tmp_path / "v.json"
    assert _analyze(capsys, model, four, report, "-q")[0] == 0
    argv = ["propose", str(report), "-o", str(proposal), "-q", "--target-sqnr", "38", "--accept-no-speedup"]
    assert main(argv) in (0, ExitCode.TARGET_NOT_MET)
    p = json.loads(proposal.read_text())
    verify = ["verify", str(model), "--proposal", str(proposal), "--calib", str(four), "--runs", "2"]
    assert main([*verify, "--target-sqnr", "30", "-q", "-o", str(out)]) in (0, ExitCode.TARGET_NOT_MET)
    selective = next(c for c in json.loads(out.read_text())["variants"] if c["name"] == "selective")
    assert selective["output_sqnr_db"] == pytest.approx(p["expected_metric"], abs=1e-6), (p["recipe"], p["per_channel"])


def test_the_snippet_reader_cuts_and_joins_on_the_batch_axes(vad, tmp_path):
    """The reader, given the axes or finding them from the first item, yields batches of exactly ``batch``
    samples: the state cut and joined on axis 1, the scalar fed whole."""
    from qdebug.output.snippet import _reader_lines

    _, one, four = vad
    for axes in (None, {"input": 0, "state": 1, "sr": None}):
        scope: dict = {}
        exec(compile("\n".join(_reader_lines(["input", "state", "sr"], axes)), "reader", "exec"), scope)
        for folder, batch in ((four, 3), (one, 4)):
            reader = scope["Reader"](str(folder), batch)
            shapes = {(b["input"].shape, b["state"].shape, b["sr"].shape) for b in iter(reader.get_next, None)}
            assert shapes == {((batch, 64), (2, batch, 16), ())}


def test_the_model_inside_a_constant_if_goes_through_analyze_propose_and_verify(tmp_path, capsys):
    """The same family's other export: the whole network inside the branches of an If with a constant
    condition, analyzed, proposed and verified with --inline-constant-if on files of one chunk each."""
    model = streaming_vad_if(tmp_path / "vad_if.onnx")
    data = stream_data(model, tmp_path / "d")
    report, proposal = tmp_path / "r.json", tmp_path / "p.json"
    code, stdout, err = _analyze(capsys, model, data, report, "--inline-constant-if")
    assert code == 0 and "Traceback" not in err, err
    assert "rate_switch" in stdout and "'state' on axis 1" in _axis_note(report)
    loaded = load_report(report)
    assert loaded.samples == 12 and any(t.name == "stateN" and t.quant is not None for t in loaded.tensors)
    argv = ["propose", str(report), "-o", str(proposal), "-q", "--target-sqnr", "38", "--accept-no-speedup"]
    argv += ["--recipes", "none"]  # a static answer: its snippet's calibration reader is what is tested here
    assert main(argv) in (0, ExitCode.TARGET_NOT_MET)
    capsys.readouterr()
    # ORT quantizes no subgraph: the snippet must start from the normalized model, where the If is inlined
    raw = json.loads(proposal.read_text())
    assert repr(raw["normalized_model"]) in raw["snippet"] and repr(str(model.resolve())) not in raw["snippet"]
    verify = ["verify", str(model), "--proposal", str(proposal), "--calib", str(data), "--inline-constant-if"]
    code = main([*verify, "--runs", "2", "--target-sqnr", "30", "-q"])
    got = capsys.readouterr()
    assert code in (0, ExitCode.TARGET_NOT_MET) and "Traceback" not in got.err
    assert "timing: batch 1," in got.out


def test_exact_match_reads_each_sample_on_its_outputs_batch_axis():
    """An integer state [2, batch, k]: a sample matches when its slice on axis 1 does."""
    from qdebug.evaluation.evaluate import _exact_rows

    ref = {"s": np.zeros((2, 3, 4), np.int64)}
    cand = {"s": ref["s"].copy()}
    cand["s"][1, 2, 0] = 1  # only the third sample differs
    assert _exact_rows(ref, cand, ["s"], 3, {"s": 1}) == 2


def test_bench_child_counts_the_samples_the_parent_wrote(tmp_path):
    """The measuring child imports nothing of qdebug: the batches' samples travel with them, so a state
    first in the file ([2, 4, 16]) is not read as 2 samples."""
    from qdebug.bench.children import write_batches
    from qdebug.data import Batch
    from qdebug.runtime.bench_child import Harness, load_batches, load_rows, make_session

    model = streaming_vad(tmp_path / "m.onnx")
    feeds = {
        "state": np.zeros((2, 4, 16), np.float32),
        "input": np.ones((4, 64), np.float32),
        "sr": np.array(16000, np.int64),
    }
    path = tmp_path / "inputs.npz"
    write_batches([Batch(feeds, None, 4, "x", {"input": 0, "state": 1, "sr": None})], list(feeds), path)
    assert load_rows(str(path), 1) == [4]
    session = make_session(str(model), ["CPUExecutionProvider"], 1)
    harness = Harness(session, load_batches(str(path), list(feeds), 1), rows=load_rows(str(path), 1))
    assert harness.full_size == 4
