"""CI-native outputs: ``verify --junit`` (one test case per gate) and ``--markdown`` for every command."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.output import ci_outputs
from qdebug.records import SCHEMA_VERSION
from qdebug.records.verify import VariantResult, VerifyResult
from tests.models import small_cnn, small_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(folder, model, calib): a tiny CNN analyzed and proposed for once, each with --markdown."""
    tmp = tmp_path_factory.mktemp("ci")
    model = small_cnn(tmp / "m.onnx", unnamed=False)
    calib = small_data(tmp / "c.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QDEBUG_CACHE_DIR", str(tmp / "cache"))
        mp.delenv(ci_outputs.STEP_SUMMARY, raising=False)
        argv = ["analyze", str(model), "--calib", str(calib), "-o", str(tmp / "r.json"), "-q"]
        assert main([*argv, "--markdown", str(tmp / "analyze.md")]) == 0
        argv = ["propose", str(tmp / "r.json"), "--target-drop", "0", "--time-runs", "0", "--max-evaluations", "4"]
        assert main([*argv, "-o", str(tmp / "p.json"), "-q", "--markdown", str(tmp / "propose.md")]) in (0, 6)
    return tmp, model, calib


def _verify(run, tmp_path, *extra: str) -> tuple[int, Path, Path, dict]:
    folder, model, calib = run
    junit, md, out = tmp_path / "verify.xml", tmp_path / "verify.md", tmp_path / "v.json"
    argv = ["verify", str(model), "--calib", str(calib), "--proposal", str(folder / "p.json"), "--runs", "0", "-q"]
    code = main([*argv, "-o", str(out), "--junit", str(junit), "--markdown", str(md), *extra])
    return code, junit, md, json.loads(out.read_text())


def check_junit(path: Path) -> ET.Element:
    """The JUnit XML structure CI servers read (Jenkins' junit-10.xsd, GitLab, GitHub test reporters):
    ``testsuites`` > ``testsuite`` (name, tests, failures, errors) > ``testcase`` (name, classname) >
    ``failure`` (message), each count equal to what the file holds."""
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    suites = list(root)
    assert suites and all(s.tag == "testsuite" for s in suites)
    total = {"tests": 0, "failures": 0, "errors": 0}
    for suite in suites:
        assert suite.get("name")
        assert {c.tag for c in suite} <= {"properties", "testcase", "system-out", "system-err"}
        cases = suite.findall("testcase")
        failed = [c for c in cases if c.find("failure") is not None]
        assert int(suite.get("tests")) == len(cases) and int(suite.get("failures")) == len(failed)
        assert int(suite.get("errors")) == sum(1 for c in cases if c.find("error") is not None)
        float(suite.get("time"))
        for case in cases:
            assert case.get("name") and case.get("classname")
            assert {c.tag for c in case} <= {"failure", "error", "skipped", "system-out", "system-err"}
            for failure in case.findall("failure"):
                assert failure.get("message")
        for p in suite.iterfind("properties/property"):
            assert p.get("name") and p.get("value") is not None
        total["tests"] += len(cases)
        total["failures"] += len(failed)
    for key, value in total.items():
        assert int(root.get(key)) == value, key
    return root


def test_junit_of_a_passing_verify(run, tmp_path, capsys):
    code, junit, md, result = _verify(run, tmp_path, "--min-recovery", "0", "--target-sqnr", "10")
    assert code == 0
    root = check_junit(junit)
    assert root.get("tests") == "3" and root.get("failures") == "0"
    names = [c.get("name") for c in root.iter("testcase")]
    assert any("recovery" in n for n in names) and "output SQNR >= 10 dB" in names and "INT8 speed-up kept" in names
    assert result["verdict"].startswith("PASS")
    text = md.read_text()
    assert text.startswith("## qdebug verify: PASS") and result["verdict"] in text
    assert _has_table(text)


def test_junit_of_a_failing_verify_carries_the_verdict(run, tmp_path, capsys):
    code, junit, md, result = _verify(run, tmp_path, "--target-sqnr", "200")
    assert code == ExitCode.TARGET_NOT_MET  # unchanged by the outputs
    root = check_junit(junit)
    assert root.get("tests") == "3" and root.get("failures") == "1"
    failed = [c for c in root.iter("testcase") if c.find("failure") is not None]
    assert [c.get("name") for c in failed] == ["output SQNR >= 200 dB"]
    assert failed[0].find("failure").get("message") == result["verdict"]
    # the gates as verify judged them are in the record, and the JUnit cases are those gates
    recorded = {g["name"]: g["side"] for g in result["gates"]}
    assert recorded["output SQNR >= 200 dB"] == -1 and recorded["INT8 speed-up kept"] == 1 and len(recorded) == 3
    assert sorted(c.get("name") for c in root.iter("testcase")) == sorted(recorded)
    assert all(g["text"] in result["verdict"] for g in result["gates"])
    assert result["verdict"] in capsys.readouterr().out  # the line printed is the message
    assert md.read_text().startswith("## qdebug verify: FAIL")


def _verify_record(**kw) -> VerifyResult:
    v = lambda name, metric, sqnr: VariantResult(name, metric, sqnr, 0, 0.0, 0, 0, 1, None)  # noqa: E731
    fields = dict(
        schema_version=SCHEMA_VERSION, kind="verify", model_path="/m.onnx", model_sha256="0" * 64, proposal="p.json",
        metric="top1", samples=10, quantizable_nodes=4,
        variants=(v("fp32", 0.9, math.inf), v("static", 0.5, 20.0), v("selective", 0.85, 30.0)),
        recovered_fraction=0.875, min_recovery=0.9, target_sqnr_db=math.nan, met=False,
        verdict="FAIL: recovered 87.5% of the top1 lost by static quantization (< 90% required)", seconds=1.0,
    )  # fmt: skip
    fields.update(kw)
    return VerifyResult(**fields)


def test_gates_mirror_the_verdict_and_never_contradict_it(tmp_path):
    gates = ci_outputs.verify_gates(_verify_record())
    assert [(g.name, g.passed) for g in gates] == [("top1 recovery >= 90%", False)]
    drop = ci_outputs.verify_gates(_verify_record(target_drop=10.0, met=True, verdict="PASS: ..."))
    assert [(g.name, g.passed) for g in drop] == [("top1 drop vs FP32 <= 10 points", True)]
    # a result judged failed whose numbers the mirror reads as passing: the record's verdict wins
    odd = _verify_record(recovered_fraction=0.95)
    assert [g.passed for g in ci_outputs.verify_gates(odd)] == [False]
    path = tmp_path / "j.xml"
    ci_outputs.write_junit(path, ci_outputs.verify_junit(odd))
    assert check_junit(path).get("failures") == "1"


def test_recorded_gates_are_read_as_judged_not_re_judged(tmp_path):
    """A record holding its gates gives them as verify judged them: names, sides and texts, even where its
    numbers alone would be judged otherwise (here: an SQNR gate the record has no target for)."""
    from qdebug.records.verify import GateRecord

    recorded = (
        GateRecord("top1 recovery >= 90%", -1, "recovered 87.5% (as judged)"),
        GateRecord("output SQNR >= 25 dB", 1, "output SQNR 30.0 dB >= 25.0 dB target"),
    )
    gates = ci_outputs.verify_gates(_verify_record(gates=recorded))
    assert [(g.name, g.passed, g.decided, g.detail) for g in gates] == [
        ("top1 recovery >= 90%", False, True, "recovered 87.5% (as judged)"),
        ("output SQNR >= 25 dB", True, True, "output SQNR 30.0 dB >= 25.0 dB target"),
    ]


def test_an_undecided_gate_is_recorded_and_read_back_undecided(tmp_path):
    """A gate whose interval straddles its target: assess records it on side 0, and CI outputs show it
    neither passed nor failed (a skipped JUnit case, no failure)."""
    from qdebug.evaluation.gates import assess
    from qdebug.evaluation.noise import Interval, PairedNoise

    noise = PairedNoise(0.95, 1000, 10, 10, recovery=Interval(0.875, 0.6, 1.1, 0.95))
    j = assess("top1", 0.9, 0.5, 0.85, 30.0, 0.9, None, noise=noise)
    assert not j.met and not j.decided
    assert [(g.name, g.side) for g in j.gates] == [("top1 recovery >= 90%", 0)]
    record = _verify_record(met=False, decided=False, verdict=j.verdict, gates=j.gates, confidence=0.95)
    (gate,) = ci_outputs.verify_gates(record)
    assert (gate.name, gate.passed, gate.decided) == ("top1 recovery >= 90%", False, False)
    path = tmp_path / "j.xml"
    ci_outputs.write_junit(path, ci_outputs.verify_junit(record))
    root = check_junit(path)
    assert root.get("failures") == "0" and len(list(root.iter("skipped"))) == 1


@pytest.mark.parametrize("target_drop", [None, 10.0])
def test_recorded_gates_have_the_names_and_order_old_records_are_re_judged_with(target_drop):
    """CI servers track a JUnit case by its name: a gate verify records is named, and ordered, as the
    re-judging of a record written before ``gates`` names it (the target gate, then the SQNR gate)."""
    from qdebug.evaluation.gates import assess

    drop = math.nan if target_drop is None else target_drop
    j = assess("top1", 0.9, 0.5, 0.85, 30.0, 0.9, 25.0, target_drop)
    old = _verify_record(target_sqnr_db=25.0, target_drop=drop, met=j.met, verdict=j.verdict)
    assert [g.name for g in j.gates] == [g.name for g in ci_outputs.verify_gates(old)]
    assert j.gates[-1].name == "output SQNR >= 25 dB"


def _has_table(text: str) -> bool:
    """A GitHub-flavoured Markdown table: a header row, its separator row, a body row."""
    lines = text.splitlines()
    sep = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+$")
    return any(
        lines[i].startswith("|") and sep.match(lines[i + 1]) and lines[i + 2].startswith("|")
        for i in range(len(lines) - 2)
    )


def test_markdown_of_every_command(run, tmp_path):
    folder, model, calib = run
    assert main(["diff", str(folder / "r.json"), str(folder / "r.json"), "--markdown", str(folder / "diff.md")]) == 0
    argv = ["bench", str(model), "--calib", str(calib), "--variants", "fp32,static", "--runs", "1", "--warmup", "0"]
    argv += ["--no-chart", "--no-dynamic-layers", "-o", str(tmp_path / "b.json"), "-q"]
    assert main([*argv, "--markdown", str(folder / "bench.md")]) == 0
    for command in ("analyze", "propose", "bench", "diff"):
        text = (folder / f"{command}.md").read_text()
        assert text.startswith(f"## qdebug {command}"), text[:80]
        assert _has_table(text), text
    assert "`fc`" in (folder / "analyze.md").read_text()  # node names as code
    assert "| static |" in (folder / "bench.md").read_text()
    assert not list(folder.glob(".*.tmp"))


def test_markdown_is_written_atomically(tmp_path, monkeypatch):
    """A write that fails leaves the old file whole and no temp file: the file is replaced, never edited."""
    path = tmp_path / "summary.md"
    path.write_text("old summary\n")

    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(QDebugError) as e:
        ci_outputs.write_markdown(path, "## new\n")
    assert e.value.code == ExitCode.OUTPUT
    assert path.read_text() == "old summary\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]


def test_the_step_summary_is_added_to(tmp_path, monkeypatch):
    summary = tmp_path / "step_summary"
    summary.write_text("## earlier step\n")
    monkeypatch.setenv(ci_outputs.STEP_SUMMARY, str(summary))
    ci_outputs.write_markdown(summary, "## qdebug verify: PASS\n")
    assert summary.read_text() == "## earlier step\n\n## qdebug verify: PASS\n"
    other = tmp_path / "other.md"
    other.write_text("old\n")
    ci_outputs.write_markdown(other, "new\n")  # any other file is replaced
    assert other.read_text() == "new\n"


def test_bad_markdown_paths_fail_before_any_work(run, tmp_path, capsys):
    folder, model, calib = run
    base = ["analyze", str(model), "--calib", str(calib), "-o", str(tmp_path / "r.json"), "-q"]
    assert main([*base, "--markdown", str(tmp_path / "r.json")]) == ExitCode.USAGE  # the report itself
    assert main([*base, "--markdown", str(model)]) == ExitCode.USAGE  # an input
    (tmp_path / "file").write_text("")
    assert main([*base, "--markdown", str(tmp_path / "file" / "x.md")]) == ExitCode.OUTPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 3 and all(line.startswith("qdebug: error:") for line in err), err
    assert not (tmp_path / "r.json").exists()


def test_ci_outputs_is_light():
    """Standard library and the light layer only: no onnx, onnxruntime, numpy or rich."""
    code = (
        "import sys, qdebug.output.ci_outputs; "
        "bad = [m for m in ('onnx', 'onnxruntime', 'numpy', 'rich', 'textual') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_help_lists_the_flags(capsys):
    for command in ("analyze", "propose", "verify", "bench", "diff"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "--markdown FILE" in out and ("--junit FILE" in out) == (command == "verify"), command


def test_exact_input_reads_as_the_cli_summary_says_it(run):
    """The Markdown's ``(exact input)`` is :func:`qdebug.analysis.build.from_exact_input`, re-stated in the light
    layer: the two must agree."""
    import dataclasses

    from qdebug.output.report_io import load_report
    from qdebug.records import from_exact_input

    folder, _, _ = run
    nodes = list(load_report(folder / "r.json").nodes)
    nodes += [dataclasses.replace(nodes[-1], accumulated_sqnr_db=34.5, introduced_db=85.5)]  # the cap
    for n in nodes:
        assert (ci_outputs._introduced(n) == "(exact input)") == from_exact_input(n), n.name
    assert ci_outputs._introduced(nodes[-1]) == "(exact input)"


def test_a_verdict_whose_gates_went_different_ways_labels_each_part():
    """An undecided drop gate next to a failed SQNR gate: 'FAIL: 0.60 <= 1 allowed' alone had read as nonsense."""
    from qdebug.evaluation.gates import assess
    from qdebug.evaluation.noise import Interval, PairedNoise

    noise = PairedNoise(
        0.95, 2000, 500, 500,
        drop=Interval(0.6, 0.0, 1.4, 0.95), sqnr=Interval(18.6, 18.0, 19.2, 0.95), sqnr_units=500,
    )  # fmt: skip
    j = assess("top1", 0.98, 0.834, 0.974, 18.6, 0.9, 30.0, 1.0, noise=noise)
    assert not j.met and j.decided and j.verdict.startswith("FAIL: undecided: the selective model is 0.60 points")
    assert "; failed: output SQNR 18.6 dB < 30.0 dB" in j.verdict
    assert [(g.name, g.side) for g in j.gates] == [("top1 drop vs FP32 <= 1 points", 0), ("output SQNR >= 30 dB", -1)]
    agree = assess("top1", 0.98, 0.834, 0.974, 18.6, 0.9, 10.0, 1.0, noise=dataclasses.replace(noise, drop=None))
    assert agree.verdict.startswith("PASS: the selective model") and "passed:" not in agree.verdict
