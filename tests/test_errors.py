"""Bad input: one clear line on stderr, a documented non-zero exit code, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from qdebug.cli.main import main
from qdebug.errors import ExitCode
from tests.models import save_graph, small_cnn, small_data


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    return code, err


def assert_one_line(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("qdebug: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_model(tmp_path, capsys):
    calib = small_data(tmp_path / "c.npz")
    code, err = run_cli(["analyze", tmp_path / "nope.onnx", "--calib", calib, "-q"], capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, "not found", "nope.onnx")


def test_corrupt_model(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage" * 50)
    calib = small_data(tmp_path / "c.npz")
    code, err = run_cli(["analyze", bad, "--calib", calib, "-q"], capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, "not a readable ONNX model")


def test_non_onnx_file(tmp_path, capsys):
    txt = tmp_path / "model.onnx"
    txt.write_text("hello, I am not a model\n")
    code, err = run_cli(["analyze", txt, "--calib", small_data(tmp_path / "c.npz"), "-q"], capsys)
    assert code == ExitCode.INPUT
    assert "Traceback" not in err


def test_old_opset_refused_then_upgraded(tmp_path, capsys):
    model = small_cnn(tmp_path / "m9.onnx", opset=9)
    calib = small_data(tmp_path / "c.npz")
    code, err = run_cli(["analyze", model, "--calib", calib, "-q", "-o", tmp_path / "r.json"], capsys)
    assert code == ExitCode.MODEL
    assert_one_line(err, "opset 9", "--upgrade-opset")
    code, err = run_cli(
        ["analyze", model, "--calib", calib, "-q", "--upgrade-opset", "-o", tmp_path / "r.json"], capsys
    )
    assert code == 0, err


@pytest.mark.parametrize(
    "arrays, needle",
    [
        ({"image": np.zeros((4, 1, 8, 8), np.float32)}, "no array for model input"),
        ({"input": np.zeros((4, 1, 8, 8), np.float64)}, "dtype float64"),
        ({"input": np.zeros((4, 8, 8), np.float32)}, "rank 4"),
        ({"input": np.zeros((4, 1, 9, 8), np.float32)}, "axis 2 must be 8"),
        ({"input": np.zeros((0, 1, 8, 8), np.float32)}, "no samples"),
        ({"input": np.full((4, 1, 8, 8), np.nan, np.float32)}, "NaN/Inf"),
        ({"input": np.zeros((4, 1, 8, 8), np.float32), "labels": np.zeros(3, np.int64)}, "disagree"),
    ],
)
def test_bad_data(tmp_path, capsys, arrays, needle):
    model = small_cnn(tmp_path / "m.onnx")
    data = tmp_path / "d.npz"
    np.savez(data, **arrays)
    code, err = run_cli(["analyze", model, "--calib", data, "-q", "-o", tmp_path / "r.json"], capsys)
    assert code == ExitCode.DATA, err
    assert_one_line(err, needle)
    assert not (tmp_path / "r.json").exists()


def test_nan_in_evaluation_data_is_refused_before_calibration(tmp_path, capsys, monkeypatch):
    """Every command that takes ``--eval`` reads its values before calibrating: NaN in the second of two
    evaluation files (its headers are fine) had been found only when the set was first scored, after
    calibration, the fake-quant view and the capture. Calibration is made to fail loudly to prove the order."""
    import qdebug.prepare

    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-q", "-o", str(report)]) == 0
    proposal = tmp_path / "p.json"
    argv = ["propose", report, "--model", model, "--calib", calib, "-o", proposal, "--time-runs", "0", "-q"]
    assert main([str(a) for a in argv]) in (0, 6)
    evals = tmp_path / "eval"
    evals.mkdir()
    small_data(evals / "a.npz")
    bad = np.full((4, 1, 8, 8), 0.5, np.float32)
    bad[2, 0, 3, 1] = np.inf
    np.savez(evals / "b.npz", input=bad, labels=np.zeros(4, np.int64))
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated before the evaluation data's values were checked")

    monkeypatch.setattr(qdebug.prepare, "calibrate", no_calibration)
    commands = {
        "analyze": ["analyze", model, "--calib", calib, "--eval", evals, "-o", tmp_path / "r2.json"],
        "propose": ["propose", report, "--model", model, "--calib", calib, "--eval", evals, "-o", tmp_path / "p2.json"],
        "verify": ["verify", model, "--proposal", proposal, "--calib", calib, "--eval", evals],
        "bench": ["bench", model, "--calib", calib, "--eval", evals, "-o", tmp_path / "b.json"],
    }
    for name, argv in commands.items():
        code, err = run_cli([*argv, "-q"], capsys)
        assert code == ExitCode.DATA, (name, err)
        assert_one_line(err, "b.npz", "input 'input' contains 1 NaN/Inf value(s)")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report, no half-written output


def test_corrupt_npz(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    data = tmp_path / "d.npz"
    data.write_bytes(b"PK\x03\x04broken")
    code, err = run_cli(["analyze", model, "--calib", data, "-q"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "not a readable .npz")


def test_quantized_model_from_another_model(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz")
    assert main(["analyze", str(model), "--calib", str(calib), "-q", "-o", str(tmp_path / "r.json")]) == 0
    capsys.readouterr()
    other = tmp_path / "other.onnx"
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [
            helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q"),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq"),
        ],
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            helper.make_tensor("s", TensorProto.FLOAT, [], [0.1]),
            helper.make_tensor("z", TensorProto.UINT8, [], [0]),
        ],
    )
    g.node[0].input[0] = "input"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(other))
    code, err = run_cli(
        ["analyze", model, "--calib", calib, "--quantized", other, "-q", "-o", tmp_path / "r2.json"], capsys
    )
    assert code == ExitCode.MODEL
    assert_one_line(err, "does not derive from")


def test_quantized_model_with_other_input_names_does_not_derive(tmp_path, capsys):
    """The same network exported with another input name: the structure pairs, but ORT had failed to load
    the merged models ("Node input 'x16' is not a graph input") and blamed the fake-quant models, exit 4."""
    import onnx

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=8)
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "r.json"), "-q"]) == 0
    quantized = onnx.load(str(tmp_path / "r_files" / "quantized.onnx"))
    for node in quantized.graph.node:
        for i, name in enumerate(node.input):
            if name == "input":
                node.input[i] = "image"
    quantized.graph.input[0].name = "image"
    other = tmp_path / "other.onnx"
    onnx.save(quantized, str(other))
    args = ["analyze", model, "--calib", calib, "--quantized", other, "-q", "-o", tmp_path / "r2.json"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.MODEL
    assert_one_line(err, "does not derive from")
    assert "its inputs ['image'] are not the FP32 model's ['input']" in err


def test_unknown_provider(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    code, err = run_cli(
        ["analyze", model, "--calib", small_data(tmp_path / "c.npz"), "--provider", "FooExecutionProvider"],
        capsys,
    )
    assert code == ExitCode.USAGE
    assert_one_line(err, "FooExecutionProvider", "CPUExecutionProvider")


def test_unwritable_output_checked_before_work(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        code, err = run_cli(["analyze", model, "--calib", small_data(tmp_path / "c.npz"), "-o", ro / "r.json"], capsys)
        assert code == ExitCode.OUTPUT
        assert_one_line(err, "not writable")
    finally:
        os.chmod(ro, 0o700)


def test_output_under_a_file_checked_before_work(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    code, err = run_cli(["analyze", model, "--calib", small_data(tmp_path / "c.npz"), "-o", blocker / "r.json"], capsys)
    assert code == ExitCode.OUTPUT
    assert_one_line(err, "is not a directory")
    assert not list(tmp_path.glob("**/normalized.onnx"))


def test_output_is_a_directory(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    code, err = run_cli(["analyze", model, "--calib", small_data(tmp_path / "c.npz"), "-o", tmp_path], capsys)
    assert code == ExitCode.OUTPUT
    assert_one_line(err, "is a directory")


def test_usage_errors_exit_2(capsys):
    assert main(["analyze"]) == ExitCode.USAGE
    assert main(["no-such-command"]) == ExitCode.USAGE
    assert main([]) == ExitCode.USAGE


def test_usage_errors_are_one_line_naming_the_subcommand(capsys):
    """argparse printed its whole usage block before the error, and blamed an unknown flag of a subcommand
    on the top-level parser; every user error is one line."""
    cases = [
        (["analyze", "m.onnx"], "qdebug analyze: error: the following arguments are required: --calib"),
        (["propose", "r.json", "--batch-size", "3"], "qdebug propose: error: unrecognized arguments: --batch-size"),
        (["bench", "m.onnx", "--calib", "c.npz", "--timeout", "0"], "qdebug bench: error: argument --timeout"),
        (["no-such-command"], "qdebug: error: argument COMMAND: invalid choice"),
        # a flag before the subcommand: it has it, the flag is just in the wrong place
        (["-q", "analyze", "m.onnx", "--calib", "c.npz"], "qdebug: error: unrecognized arguments before the"),
    ]
    for argv, start in cases:
        assert main(argv) == ExitCode.USAGE
        err = capsys.readouterr().err
        assert err.startswith(start), err
        assert err.count("\n") == 1 and "--help" in err, err


def test_every_overview_help_line_is_a_whole_sentence(capsys):
    """``qdebug --help`` shows each subcommand's first docstring line: diff's had stopped mid-sentence
    ("...; with three or more, which") because its first sentence ran on to a second line (issue 38)."""
    import importlib

    from qdebug.cli.main import SUBCOMMANDS

    for name in SUBCOMMANDS:
        doc = (importlib.import_module(f"qdebug.cli.{name}").__doc__ or "").strip().splitlines()
        assert doc[0].endswith("."), (name, doc[0])
        assert len(doc) == 1 or not doc[1].strip(), (name, doc[:2])  # the sentence ends on its line
    assert main(["--help"]) == 0
    assert "which nodes got better or worse, and" in capsys.readouterr().out


def test_an_unknown_metric_names_the_built_in_ones_and_the_hook_forms(tmp_path, capsys):
    """``--metric top5`` had said only "is not module:function": it now lists what exists (issue 38)."""
    from qdebug.evaluation.evaluate import BUILTIN

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    args = ["analyze", model, "--calib", calib, "--metric", "top5", "-o", tmp_path / "r.json", "-q"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.USAGE
    assert_one_line(err, "unknown metric 'top5'", *BUILTIN, "package.module:function", "path/to/file.py:function")
    assert not (tmp_path / "r.json").exists()


def test_a_report_passed_as_the_proposal_is_named_with_the_command_that_makes_one(tmp_path, capsys):
    """``verify --proposal report.json`` had said "not a qdebug proposal (kind None)" (issue 38)."""
    import json

    from qdebug.output.report_io import save_report
    from tests.tui_report import make_report

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    save_report(make_report(), report)
    code, err = run_cli(["verify", model, "--calib", calib, "--proposal", report, "--runs", "0"], capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, f"{report} is an analysis report", "not a proposal", f"qdebug propose {report} -o")
    assert "kind None" not in err
    (tmp_path / "d.json").write_text(json.dumps({"schema_version": 1, "kind": "diff"}))
    code, err = run_cli(["verify", model, "--calib", calib, "--proposal", tmp_path / "d.json"], capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, "is a qdebug diff file, not a proposal", "qdebug propose")


def test_negative_threads_is_a_usage_error(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    args = ["analyze", model, "--calib", small_data(tmp_path / "c.npz"), "-o", tmp_path / "r.json"]
    code, err = run_cli([*args, "--threads", "-1"], capsys)
    assert code == ExitCode.USAGE
    assert_one_line(err, "--threads must be >= 0")
    assert not (tmp_path / "r.json").exists()


def test_help_imports_neither_onnxruntime_nor_textual():
    code = "import sys\nfrom qdebug.cli.main import main\nmain(['--help'])\n"
    probe = code + "print('onnxruntime' in sys.modules, 'textual' in sys.modules)\n"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, runpy\n" + probe.replace("main(['--help'])", "rc = main(['analyze', '--help'])"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "False False"


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "qdebug", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("qdebug ")


def test_a_failed_analysis_leaves_no_artifacts_directory(tmp_path, cnn):
    """Bad data is found after the model was normalized: the new <stem>_files/ must not stay behind."""
    import numpy as np

    model, _ = cnn
    np.savez(tmp_path / "wrong.npz", input=np.zeros((4, 3, 3, 3), np.float32))
    out = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(tmp_path / "wrong.npz"), "-o", str(out), "-q"]) == 5
    assert not out.exists() and not (tmp_path / "r_files").exists()
    nested = tmp_path / "new" / "dirs" / "r.json"  # directories made for -o go too
    assert main(["analyze", str(model), "--calib", str(tmp_path / "wrong.npz"), "-o", str(nested), "-q"]) == 5
    assert not (tmp_path / "new").exists()


def test_outputs_never_overwrite_inputs(tmp_path, capsys):
    """``-o`` or ``--csv`` naming an input file (or each other) is refused before any work: the user's
    files are never modified (``-o model.onnx`` had replaced the model with the report)."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    before = {p: p.read_bytes() for p in (model, calib)}
    report = tmp_path / "r.json"
    cases = [
        (["-o", model], "the report", "the model"),
        (["-o", report, "--csv", calib], "--csv", "the calibration data"),
        (["-o", report, "--csv", tmp_path / "." / "r.json"], "--csv", "the report"),
    ]
    for extra, what, whose in cases:
        code, err = run_cli(["analyze", model, "--calib", calib, "-q", *extra], capsys)
        assert code == ExitCode.USAGE, err
        assert_one_line(err, what, f"would overwrite {whose}")
    assert {p: p.read_bytes() for p in before} == before and not report.exists()

    assert run_cli(["analyze", model, "--calib", calib, "-q", "-o", report], capsys)[0] == 0
    saved = report.read_bytes()
    code, err = run_cli(["propose", report, "-o", report, "-q"], capsys)
    assert code == ExitCode.USAGE
    assert_one_line(err, "the proposal", "would overwrite the report")
    assert report.read_bytes() == saved


def test_a_fixed_batch_takes_only_full_batches(tmp_path, capsys):
    """Batch dimension fixed at 4, 30 samples: refused before any work as a data error naming the fix (ORT
    had failed mid-calibration, exit 4, blaming the model); 28 samples run."""
    import onnx

    model = small_cnn(tmp_path / "m.onnx")
    proto = onnx.load(model)
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    proto.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 4
    onnx.save(proto, model)
    calib = small_data(tmp_path / "c.npz", n=30)
    code, err = run_cli(["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", "-q"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "30 sample(s)", "batches of 4", "--max-samples 28")
    assert not (tmp_path / "r.json").exists()
    args = ["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", "-q", "--max-samples", "28"]
    assert run_cli(args, capsys)[0] == 0
    # evaluation data: the hint names the flag that limits it (bench's --max-samples limits calibration only)
    calib28 = small_data(tmp_path / "c28.npz", n=28)
    bench = [
        "bench",
        model,
        "--calib",
        calib28,
        "--eval",
        calib,
        "--variants",
        "fp32",
        "-o",
        tmp_path / "b.json",
    ]
    code, err = run_cli([*bench, "-q"], capsys)
    assert code == ExitCode.DATA and "--max-samples" not in err
    assert_one_line(err, "evaluation data", "keep the first 28 samples")
    (tmp_path / "r.json").unlink()
    verify_args = ["verify", model, "--calib", calib28, "--eval", calib, "--proposal", tmp_path / "p.json"]
    assert run_cli(["analyze", model, "--calib", calib28, "-o", tmp_path / "r.json", "-q"], capsys)[0] == 0
    assert run_cli(["propose", tmp_path / "r.json", "-o", tmp_path / "p.json", "-q"], capsys)[0] in (0, 6)
    code, err = run_cli([*verify_args, "-q"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "evaluation data", "--eval-max-samples 28")
    # a folder of whole-batch files cut by --max-samples: the hint names the limit that fits (it had told
    # the user to give each file a multiple of 4, which every file already was)
    folder = tmp_path / "parts"
    folder.mkdir()
    for i, n in enumerate((4, 8, 12)):
        small_data(folder / f"p{i}.npz", n=n, seed=i)
    args = ["analyze", model, "--calib", folder, "-o", tmp_path / "r3.json", "-q", "--max-samples", "10"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "pass --max-samples 8")


@pytest.mark.parametrize(
    "labels, needle",
    [
        (lambda y: y[:, None], None),  # [N, 1] is read as [N] (it had broadcast: top-1 of 244 %)
        (lambda y: np.zeros((len(y), 3), np.int64), "shape [40, 3], expected one integer class index"),
        (lambda y: y + 100, "run from"),
        (lambda y: y + 0.5, "which is not a class index"),
        (lambda y: np.where(np.arange(len(y)) == 3, np.nan, y.astype(float)), "labels hold nan"),
        (lambda y: y * 0.0 + 4e20, "labels hold 4e+20"),
    ],
)
def test_labels_are_one_class_index_per_sample(tmp_path, capsys, labels, needle):
    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz")
    with np.load(calib) as z:
        np.savez(tmp_path / "e.npz", input=z["input"], labels=labels(z["labels"]))
    args = ["analyze", model, "--calib", calib, "--eval", tmp_path / "e.npz", "-o", tmp_path / "r.json", "-q"]
    code, err = run_cli(args, capsys)
    if needle is None:
        from qdebug.output.report_io import load_report

        task = load_report(tmp_path / "r.json").task
        np.savez(tmp_path / "e.npz", input=np.load(calib)["input"], labels=np.load(calib)["labels"])
        assert run_cli(args, capsys)[0] == 0
        plain = load_report(tmp_path / "r.json").task
        assert code == 0 and task.name == "top1"
        assert (task.fp32, task.quantized) == (plain.fp32, plain.quantized)
    else:
        assert code == ExitCode.DATA
        assert_one_line(err, needle)


def test_a_hook_used_up_after_one_pass_is_named(tmp_path, capsys, monkeypatch):
    """A module-level reader returned on every call is empty on the second pass: one line naming the fix
    (it had crashed with an IndexError)."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    (tmp_path / "hooks_once.py").write_text(
        "import numpy as np\n"
        f"_data = np.load({str(calib)!r})\n"
        "_once = iter([{'input': _data['input'][i:i + 8]} for i in range(0, 40, 8)])\n"
        "def feeds():\n"
        "    return _once\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run_cli(["analyze", model, "--calib", "hooks_once:feeds", "-o", tmp_path / "r.json", "-q"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "samples on its first pass and 0 on a later one", "new iterable")


def test_failed_propose_and_verify_leave_no_artifacts(tmp_path, capsys):
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert run_cli(["analyze", model, "--calib", calib, "-o", report, "-q"], capsys)[0] == 0
    assert run_cli(["propose", report, "-o", tmp_path / "p.json", "-q"], capsys)[0] in (
        0,
        ExitCode.TARGET_NOT_MET,
    )
    np.savez(tmp_path / "nan.npz", input=np.full((8, 1, 8, 8), np.nan, np.float32))
    args = [
        "verify",
        model,
        "--calib",
        calib,
        "--proposal",
        tmp_path / "p.json",
        "--eval",
        tmp_path / "nan.npz",
    ]
    code, err = run_cli([*args, "-o", tmp_path / "v.json", "--runs", "0"], capsys)
    assert code == ExitCode.DATA
    assert not (tmp_path / "v.json").exists() and not (tmp_path / "v_files").exists()
    code, err = run_cli(["propose", report, "--eval", tmp_path / "nan.npz", "-o", tmp_path / "q.json"], capsys)
    assert code == ExitCode.DATA
    assert not (tmp_path / "q_files").exists() and not (tmp_path / "q.selective.onnx").exists()


def test_record_files_of_another_kind_or_malformed(tmp_path, capsys):
    """A proposal where a report is expected is named as such (not as a schema-version mismatch), and a
    list field holding a string is refused (it had become a list of its letters)."""
    import json

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert run_cli(["analyze", model, "--calib", calib, "-o", report, "-q"], capsys)[0] == 0
    assert run_cli(["propose", report, "-o", tmp_path / "p.json", "-q"], capsys)[0] in (
        0,
        ExitCode.TARGET_NOT_MET,
    )
    code, err = run_cli(["propose", tmp_path / "p.json"], capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, "is a qdebug proposal file, not a report")
    proposal = json.loads((tmp_path / "p.json").read_text())
    proposal["nodes_to_exclude"] = "conv1"
    (tmp_path / "s.json").write_text(json.dumps(proposal))
    args = ["verify", model, "--calib", calib, "--proposal", tmp_path / "s.json", "--runs", "0"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, "expected a list")
    code, err = run_cli(["tui", report, "--screenshot", report], capsys)
    assert code == ExitCode.USAGE
    assert_one_line(err, "would overwrite the report")


def test_non_finite_targets_and_negative_counts_are_usage_errors(tmp_path, capsys):
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    report = tmp_path / "r.json"
    assert run_cli(["analyze", model, "--calib", calib, "-o", report, "-q", "--top", "0"], capsys)[0] == 0
    for args in (
        ["propose", report, "--target-drop", "nan"],
        ["propose", report, "--target-sqnr", "inf"],
        ["analyze", model, "--calib", calib, "--top", "-1"],
    ):
        code, err = run_cli(args, capsys)
        assert code == ExitCode.USAGE
        assert "must be" in err and "Traceback" not in err
    assert run_cli(["propose", report, "-o", tmp_path / "p.json", "-q"], capsys)[0] in (
        0,
        ExitCode.TARGET_NOT_MET,
    )
    args = ["verify", model, "--calib", calib, "--proposal", tmp_path / "p.json", "--eval-max-samples", "0"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.USAGE
    assert_one_line(err, "--eval-max-samples must be >= 1")


def test_an_already_quantized_model_is_not_the_base(tmp_path, capsys):
    """A QDQ model given as the model to analyze: one line saying so (it had failed inside ORT's quantizer
    with 'report this model to qdebug')."""
    from qdebug.output.report_io import load_report

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    assert run_cli(["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", "-q"], capsys)[0] == 0
    qdq = load_report(tmp_path / "r.json").quantized_model.path
    code, err = run_cli(["analyze", qdq, "--calib", calib, "-o", tmp_path / "q.json", "-q"], capsys)
    assert code == ExitCode.MODEL
    assert_one_line(err, "is already quantized (DequantizeLinear x", "--quantized")


def test_a_hook_file_is_recorded_with_an_absolute_path(tmp_path, capsys, monkeypatch):
    """propose reads the data back from the report: a ``hooks.py:feeds`` given relative to one directory
    must still be found from another."""
    from qdebug.output.report_io import load_report

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    (tmp_path / "hooks.py").write_text(
        "import numpy as np\n"
        "def feeds():\n"
        f"    d = np.load({str(calib)!r})\n"
        "    return [{'input': d['input'][i:i + 8], 'labels': d['labels'][i:i + 8]} for i in range(0, 40, 8)]\n"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert run_cli(["analyze", model, "--calib", "hooks.py:feeds", "-o", "out/r.json", "-q"], capsys)[0] == 0
    assert load_report(tmp_path / "out" / "r.json").config.calib == f"{tmp_path / 'hooks.py'}:feeds"
    monkeypatch.chdir(tmp_path / "out")
    code, err = run_cli(["propose", "r.json", "-o", "p.json", "-q"], capsys)
    assert code in (0, ExitCode.TARGET_NOT_MET), err


def test_tui_and_bench_inputs_are_checked(tmp_path, capsys, monkeypatch):
    """A proposal made for another model is refused by the TUI (it had shown it as this model's), an empty
    --variants or an unknown --dynamic-ops op by bench, and a metric returning nan by analyze."""
    calib = small_data(tmp_path / "c.npz")
    reports = []
    for seed in (0, 1):
        model = small_cnn(tmp_path / f"m{seed}.onnx", seed=seed)
        reports.append(tmp_path / f"r{seed}.json")
        assert run_cli(["analyze", model, "--calib", calib, "-o", reports[-1], "-q"], capsys)[0] == 0
    assert run_cli(["propose", reports[0], "-o", tmp_path / "p.json", "-q"], capsys)[0] in (
        0,
        ExitCode.TARGET_NOT_MET,
    )
    code, err = run_cli(
        ["tui", reports[1], "--proposal", tmp_path / "p.json", "--screenshot", tmp_path / "s.svg"], capsys
    )
    assert code == ExitCode.INPUT
    assert_one_line(err, "was made for another model")
    assert not (tmp_path / "s.svg").exists()
    for extra, needle in (
        (["--variants", ""], "unknown variant"),
        (["--dynamic-ops", "MatMul,Bogus"], "Bogus"),
    ):
        args = ["bench", tmp_path / "m0.onnx", "--calib", calib, "-o", tmp_path / "b.json", *extra]
        code, err = run_cli(args, capsys)
        assert code == ExitCode.USAGE
        assert_one_line(err, needle)
    (tmp_path / "nanmetric.py").write_text("def score(reference, candidate, labels):\n    return float('nan')\n")
    monkeypatch.chdir(tmp_path)
    args = [
        "analyze",
        tmp_path / "m0.onnx",
        "--calib",
        calib,
        "--metric",
        "nanmetric.py:score",
        "-o",
        tmp_path / "x.json",
    ]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.INPUT
    assert_one_line(err, "returned nan")


def test_quiet_means_quiet_with_a_histogram_calibrator(tmp_path, capsys):
    """ORT's entropy/percentile calibrators print their progress on stdout: dropped, so stdout holds the
    summary only and -q leaves stderr with the final line alone."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    args = ["analyze", model, "--calib", calib, "-o", tmp_path / "r.json", "-q", "--method", "percentile"]
    assert main([str(a) for a in args]) == 0
    captured = capsys.readouterr()
    assert "Collecting" not in captured.out + captured.err and "Number of" not in captured.out + captured.err
    assert [line for line in captured.err.splitlines() if line.strip()] == [f"report written to {tmp_path / 'r.json'}"]


def test_tensor_names_that_ort_gives_its_own_qdq_tensors(tmp_path, capsys):
    """``x_DequantizeLinear_Output`` next to ``x``: ORT's quantizer would define the name twice and the
    run failed with "check the model with onnx.checker"; now one line naming the tensors."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).normal(0, 0.3, (8, 8)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["x_QuantizeLinear_Output"], name="mm"),
        helper.make_node("Relu", ["x_QuantizeLinear_Output"], ["x_DequantizeLinear_Output"], name="relu"),
        helper.make_node("Sigmoid", ["x_DequantizeLinear_Output"], ["y"], name="sig"),
    ]
    graph = helper.make_graph(
        nodes,
        "clash",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [w],
    )
    save_graph(graph, tmp_path / "m.onnx")
    np.savez(tmp_path / "c.npz", x=np.random.default_rng(1).normal(0, 1, (16, 8)).astype(np.float32))
    args = ["analyze", tmp_path / "m.onnx", "--calib", tmp_path / "c.npz", "-o", tmp_path / "r.json", "-q"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.MODEL
    assert_one_line(err, "x_DequantizeLinear_Output", "names ORT's quantizer gives")


@pytest.mark.parametrize("flag", ["-o", "--chart"])
def test_bench_never_deletes_a_directory_named_as_its_output(tmp_path, capsys, flag):
    """`bench -o DIR` (or `--chart DIR`) had moved the directory aside as an earlier run's output, passed the
    writability check, then deleted it with everything in it on success (exit 0)."""
    model = small_cnn(tmp_path / "m.onnx")
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    args = ["bench", model, "--calib", small_data(tmp_path / "c.npz"), "--variants", "fp32", "--runs", "1"]
    args += ["--no-dynamic-layers", flag, folder] + (["-o", tmp_path / "b.json"] if flag == "--chart" else [])
    code, err = run_cli(args, capsys)
    assert code == ExitCode.OUTPUT
    assert_one_line(err, f"output path {folder} is a directory")
    assert (folder / "keep.txt").read_text() == "mine"


def test_token_ids_outside_the_embedding_table_are_a_data_error(tmp_path, capsys):
    """Ids 45..94 for a table of 50 rows: ORT failed mid-calibration ("indices element out of data bounds",
    a raw ORT log line) and the message blamed the model, exit 4."""
    from tests.models import embedding_classifier

    model = embedding_classifier(tmp_path / "m.onnx", vocab=50)
    ids = np.random.default_rng(0).integers(0, 50, (16, 8)) + 45
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    code, err = run_cli(["analyze", model, "--calib", tmp_path / "ids.npz", "-q", "-o", tmp_path / "r.json"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "outside the 50 rows of the table Gather 'embed' reads")
    assert "use ids in 0..49" in err and not (tmp_path / "r.json").exists()
    np.savez(tmp_path / "ok.npz", input_ids=ids - 45)  # in range: analyzed
    code, err = run_cli(["analyze", model, "--calib", tmp_path / "ok.npz", "-q", "-o", tmp_path / "r.json"], capsys)
    assert code == 0, err


HOOKS = """
import numpy as np
rng = np.random.default_rng(0)
def x(n):
    return rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
def raise_midway():
    yield {"input": x(4)}
    raise RuntimeError("disk vanished")
def ragged():
    yield {"input": [[1.0, 2.0], [3.0]]}
def rows_disagree():
    yield {"input": x(4), "labels": np.zeros(3, dtype=np.int64)}
def labels_some():
    yield {"input": x(4), "labels": np.zeros(4, dtype=np.int64)}
    yield {"input": x(4)}
def empty_item():
    yield {"input": x(4)}
    yield {"input": x(0)}
    yield {"input": x(12)}
"""


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        ("raise_midway", "raised RuntimeError at item 1: disk vanished"),
        ("ragged", "item 0: a value is not an array"),
        ("rows_disagree", "arrays disagree on the number of samples (axis 0): {'input': 4, 'labels': 3}"),
        ("labels_some", "item 1 has no labels, the items before it did"),
    ],
)
def test_hook_faults_are_data_errors(tmp_path, capsys, hook, message):
    """A hook failing while it is iterated had given a traceback (exit 1) or blamed the model (exit 4);
    rows that disagree were cut to the first input's; labels on some items only were dropped silently."""
    (tmp_path / "hooks.py").write_text(HOOKS)
    model = small_cnn(tmp_path / "m.onnx")
    args = ["analyze", model, "--calib", f"{tmp_path / 'hooks.py'}:{hook}", "-q", "-o", tmp_path / "r.json"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.DATA, err
    assert_one_line(err, message)


def test_an_empty_hook_item_is_skipped_not_the_end(tmp_path, capsys):
    """An empty item had ended the data there: 4 of 16 samples analyzed, silently."""
    from qdebug.output.report_io import load_report

    (tmp_path / "hooks.py").write_text(HOOKS)
    model = small_cnn(tmp_path / "m.onnx")
    args = ["analyze", model, "--calib", f"{tmp_path / 'hooks.py'}:empty_item", "-q", "-o", tmp_path / "r.json"]
    code, err = run_cli(args, capsys)
    assert code == 0, err
    assert load_report(tmp_path / "r.json").samples == 16


def test_labels_in_some_files_only_are_refused(tmp_path, capsys):
    model = small_cnn(tmp_path / "m.onnx")
    folder = tmp_path / "calib"
    folder.mkdir()
    small_data(folder / "a.npz", n=8, labels=True)
    small_data(folder / "b.npz", n=8, seed=2, labels=False)
    code, err = run_cli(["analyze", model, "--calib", folder, "-q", "-o", tmp_path / "r.json"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "1 of 2 files have labels (e.g. a.npz), the others not")


def test_file_hooks_import_their_neighbours_and_folders_name_their_subfolders(tmp_path, capsys):
    """A `file.py:function` hook could not import a module next to it (exit 3, 'importable from the
    current directory'); a folder holding only subfolders said 'no .npz files' without naming them; a
    --csv inside the report's _files/ replaced the quantized model the report points at."""
    model = small_cnn(tmp_path / "m.onnx")
    data = small_data(tmp_path / "d.npz", n=8)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "loader.py").write_text(f"import numpy as np\ndef load():\n    return np.load({str(data)!r})['input']\n")
    (hooks / "calib.py").write_text("import loader\ndef feeds():\n    yield {'input': loader.load()}\n")
    hook = f"{hooks / 'calib.py'}:feeds"
    code, err = run_cli(["analyze", model, "--calib", hook, "-q", "-o", tmp_path / "r.json"], capsys)
    assert code == 0, err
    nested = tmp_path / "nested"
    (nested / "part1").mkdir(parents=True)
    code, err = run_cli(["analyze", model, "--calib", nested, "-q", "-o", tmp_path / "r2.json"], capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "has no .npz files (subfolders are not read: part1)")
    csv = tmp_path / "r_files" / "quantized.onnx"
    code, err = run_cli(["analyze", model, "--calib", data, "-q", "-o", tmp_path / "r.json", "--csv", csv], capsys)
    assert code == ExitCode.USAGE
    assert_one_line(err, "where the report keeps its models")


def test_bad_eval_labels_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """String or one-hot labels in the evaluation data had been found after calibration, the fake-quant view
    and the whole capture had run."""
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz", n=8)
    x = np.load(calib)["input"]
    np.savez(tmp_path / "onehot.npz", input=x, labels=np.eye(4)[np.arange(8) % 4])
    args = ["analyze", model, "--calib", calib, "--eval", tmp_path / "onehot.npz", "-q", "-o", tmp_path / "r.json"]
    code, err = run_cli(args, capsys)
    assert code == ExitCode.DATA
    assert_one_line(err, "labels have dtype float64 and shape [8, 4], expected one integer class index")
    assert not list((tmp_path / "cache").rglob("*.json"))  # refused before calibrating


def test_the_readme_api_example_uses_only_exported_names():
    """The README's Python example is the API's documentation: it must compile and name only what qdebug
    exports (it had ranked nodes with a sort that NaN and -inf break, where qdebug.rank_nodes is the
    summary's ranking)."""
    import re

    import qdebug
    from tests.conftest import ROOT

    text = (ROOT / "README.md").read_text()
    block = text[text.index("import qdebug\n") :]
    block = block[: block.index("```")]
    compile(block, "README", "exec")
    used = set(re.findall(r"qdebug\.(\w+)", block))
    assert used and used <= set(qdebug.__all__), used - set(qdebug.__all__)
    assert "rank_nodes" in used


# tests/test_errors.py::test_unwritable_output_checked_before_work skips when run as root (as here and in
# most containers/CI): the read-only check then never runs. Simulating the permission keeps it running.
def test_unwritable_output_checked_before_work_even_as_root(tmp_path, capsys, monkeypatch):
    import qdebug.output.files as rio
    import qdebug.prepare

    model = small_cnn(tmp_path / "m.onnx")
    calib = small_data(tmp_path / "c.npz")
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if os.path.realpath(path) == str(ro.resolve()) and mode & os.W_OK:
            return False  # what a non-root user sees on a 0500 directory
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(rio.os, "access", access)

    def no_calibration(*a, **k):
        raise AssertionError("calibration started before the output path was checked")

    monkeypatch.setattr(qdebug.prepare, "calibrate", no_calibration)  # imported by name there
    code = main(["analyze", str(model), "--calib", str(calib), "-o", str(ro / "r.json"), "-q"])
    err = capsys.readouterr().err
    assert code == ExitCode.OUTPUT, err
    assert "not writable" in err and len(err.strip().splitlines()) == 1
    assert not (ro / "r.json").exists()


def test_a_closed_stdout_is_not_an_internal_error(tmp_path):
    """`qdebug verify ... | head -1`: the reader leaves early. A print then raised BrokenPipeError (exit 1, a
    traceback in verify); the command now finishes quietly with its own exit code. (`| true` closes the
    pipe before analyze prints anything, so the error is certain, not a race.)."""
    from pathlib import Path

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=16)
    out = tmp_path / "r.json"
    cmd = f"{sys.executable} -m qdebug analyze {model} --calib {calib} -o {out} | true"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr
    assert out.is_file()


def test_every_exit_code_is_in_the_help():
    """``qdebug <command> --help`` lists every documented exit code (8, verify's undecided, had been left out)."""
    import re

    from qdebug.cli.main import EPILOG
    from qdebug.errors import ExitCode

    listed = {int(n) for n in re.findall(r"(?:^|\s)(\d+)\s+\S", EPILOG)}
    assert {int(c) for c in ExitCode} <= listed, sorted({int(c) for c in ExitCode} - listed)
