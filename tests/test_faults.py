"""Hostile input and faults: fuzzed files, interrupts, stale reports (issue 6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.report_io import load_report
from tests.models import small_cnn, small_data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    model, calib = small_cnn(d / "m.onnx"), small_data(d / "c.npz")
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(d / "r.json"), "-q"]) == 0
    return model, calib, d / "r.json"


def _cli(args) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "qdebug", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    return proc.returncode, proc.stderr


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(cut=st.floats(0.0, 0.98), junk=st.binary(max_size=64))
def test_truncated_or_garbled_model(good, tmp_path_factory, cut, junk):
    model, calib, _ = good
    data = model.read_bytes()
    bad = tmp_path_factory.mktemp("fz") / "bad.onnx"
    bad.write_bytes(data[: int(len(data) * cut)] + junk)
    try:
        code = main(["analyze", str(bad), "--calib", str(calib), "-q", "-o", str(bad.parent / "r.json")])
    except QDebugError:  # pragma: no cover - main catches it
        pytest.fail("QDebugError escaped main")
    # either a clear user error, or (rarely) the bytes still parse into a valid model
    assert code in (0, ExitCode.INPUT, ExitCode.MODEL, ExitCode.DATA)


@FUZZ
@given(cut=st.floats(0.0, 0.98), junk=st.binary(max_size=64))
def test_truncated_or_garbled_data(good, tmp_path_factory, cut, junk):
    model, calib, _ = good
    data = calib.read_bytes()
    bad = tmp_path_factory.mktemp("fz") / "bad.npz"
    bad.write_bytes(data[: int(len(data) * cut)] + junk)
    code = main(["analyze", str(model), "--calib", str(bad), "-q", "-o", str(bad.parent / "r.json")])
    assert code in (ExitCode.DATA, ExitCode.INPUT)


@FUZZ
@given(cut=st.floats(0.0, 0.99), junk=st.text(max_size=20))
def test_truncated_or_garbled_report(good, tmp_path_factory, cut, junk):
    _, _, report = good
    text = report.read_text()
    bad = tmp_path_factory.mktemp("fz") / "bad.json"
    bad.write_text(text[: int(len(text) * cut)] + junk)
    with pytest.raises(QDebugError) as info:
        load_report(bad)
    assert info.value.code == ExitCode.INPUT


def test_report_from_other_schema_version_is_refused(good, tmp_path):
    raw = json.loads(good[2].read_text())
    raw["schema_version"] = 0
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    with pytest.raises(QDebugError, match="schema version 0"):
        load_report(old)


def test_report_with_wrong_field_types_is_refused(good, tmp_path):
    raw = json.loads(good[2].read_text())
    raw["nodes"] = "not a list"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(QDebugError, match="not a valid qdebug report"):
        load_report(bad)


def test_random_bytes_as_every_input_kind(tmp_path):
    rng = np.random.default_rng(0)
    junk = tmp_path / "junk.bin"
    junk.write_bytes(rng.bytes(4096))
    model = small_cnn(tmp_path / "m.onnx")
    for args, ok in (
        (["analyze", junk, "--calib", small_data(tmp_path / "c.npz")], (ExitCode.INPUT,)),
        (["analyze", model, "--calib", junk], (ExitCode.INPUT, ExitCode.DATA)),
        (["tui", junk], (ExitCode.INPUT,)),
    ):
        code, err = _cli([*args, "-o", tmp_path / "r.json"] if args[0] == "analyze" else args)
        assert code in ok, err
        assert "Traceback" not in err and err.count("qdebug: error:") == 1


SLOW_METRIC = """
import pathlib, time
def score(reference, candidate, labels):
    pathlib.Path(__file__).with_name("metric-entered").touch()
    time.sleep(60)
    return 0.0
"""


def test_sigint_leaves_no_partial_output_and_cache_is_reused(tmp_path):
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    (tmp_path / "slowmetric.py").write_text(SLOW_METRIC)
    out = tmp_path / "out" / "report.json"
    env = dict(os.environ, QDEBUG_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qdebug",
            "analyze",
            str(model),
            "--calib",
            str(calib),
            "-o",
            str(out),
            "--metric",
            f"{tmp_path / 'slowmetric.py'}:score",
        ],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        # a shell that starts jobs in the background sets SIGINT to "ignore", which children
        # inherit (Python then installs no KeyboardInterrupt handler); restore the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # wait until the long evaluation is under way (calibration cached, capture done), then interrupt
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metric-entered").exists():
        time.sleep(0.1)
    assert list((tmp_path / "cache").glob("calib/*.json")), (
        "calibration cache not written before the interrupt"
    )
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.INTERRUPTED, err
    assert "interrupted" in err and "Traceback" not in err
    assert not out.exists()
    leftovers = [
        p for p in tmp_path.rglob("*") if p.name.endswith(".tmp") or p.name.startswith("qdebug-calib-")
    ]
    assert leftovers == []
    rerun = subprocess.run(
        [sys.executable, "-m", "qdebug", "analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert any("reused from cache" in n for n in load_report(out).notes)


def test_disk_full_while_writing_the_report(tmp_path, monkeypatch, capsys):
    """ENOSPC during the final write: exit 7, one line, no report and no temp file left behind."""
    import errno

    import qdebug.output.files as rio

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    out = tmp_path / "out" / "report.json"

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rio.os, "fsync", full)
    code = main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"])
    err = capsys.readouterr().err
    assert code == ExitCode.OUTPUT
    assert "No space left on device" in err and "Traceback" not in err
    assert not out.exists()
    assert not out.parent.exists()  # no temp file, and the directory made for -o goes too (empty)


def test_disk_full_while_writing_a_model(tmp_path, monkeypatch, capsys):
    """ENOSPC while bench saves a quantized model: it was an OSError traceback with exit 1."""
    import errno

    import onnx

    import qdebug.graph.modelfile as modelfile

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=16)
    real = onnx.save_model

    def full(proto, path, *a, **k):
        if "static" in str(path) or "static" in Path(str(path)).name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(proto, path, *a, **k)

    monkeypatch.setattr(modelfile.onnx, "save_model", full)
    out = tmp_path / "b.json"
    code = main(
        ["bench", str(model), "--calib", str(calib), "--variants", "fp32,static", "-o", str(out), "-q"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.OUTPUT
    assert len(err) == 1 and "No space left on device" in err[0]
    assert not out.exists() and not (tmp_path / "b_files").exists()


def test_outputs_get_the_permissions_a_plain_write_would_give(good, tmp_path):
    """Atomic writes go through mkstemp, which creates 0600 files: reports and models must instead get
    what ``open()`` gives (0666 less the umask), or keep the mode of the file they replace."""
    import stat

    import qdebug.output.files as rio

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    mask = os.umask(0o022)
    os.umask(mask)
    _, _, report = good
    expected = 0o666 & ~mask
    assert mode(report) == expected
    models = list(report.with_name("r_files").glob("*.onnx"))
    assert models and {mode(m) for m in models} == {expected}

    kept = tmp_path / "kept.json"
    kept.write_text("{}")
    kept.chmod(0o640)
    rio.atomic_write_text(kept, "[]\n")
    assert mode(kept) == 0o640 and kept.read_text() == "[]\n"

    previous = os.umask(0o027)
    rio._umask.cache_clear()
    try:
        rio.atomic_write_text(tmp_path / "new.json", "{}\n")
    finally:
        os.umask(previous)
        rio._umask.cache_clear()
    assert mode(tmp_path / "new.json") == 0o640


def _tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or the file itself) with its bytes."""
    if path.is_file():
        return {path.name: path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command", ["analyze", "bench"])
def test_interrupted_rerun_keeps_the_earlier_outputs(tmp_path, monkeypatch, capsys, command):
    """A re-run over earlier outputs that is interrupted (here: right after its JSON is written, while the
    chart or the summary is made) leaves the earlier run's JSON and models exactly as they were. Before,
    the re-run had replaced <stem>_files/*.onnx under the old JSON (or left a JSON whose models were
    deleted), and said "no partial output was written"."""
    import qdebug.bench.run
    import qdebug.pipeline

    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=16)
    out = tmp_path / "out.json"
    args = [command, str(model), "--calib", str(calib), "-o", str(out), "-q"]
    if command == "bench":
        args += ["--variants", "fp32,static", "--runs", "1", "--warmup", "0", "--no-dynamic-layers"]
    assert main(args) == 0
    before = {name: _tree(tmp_path / name) for name in ("out.json", "out_files")}
    assert before["out_files"]

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if command == "analyze":
        real = qdebug.pipeline.save_report

        def save_then_interrupt(*a, **k):
            real(*a, **k)
            raise KeyboardInterrupt

        monkeypatch.setattr(qdebug.pipeline, "save_report", save_then_interrupt)
    else:
        monkeypatch.setattr(qdebug.bench.run, "chart_svg", interrupt)
    capsys.readouterr()
    assert main([*args, "--per-channel"]) == ExitCode.INTERRUPTED
    after = {name: _tree(tmp_path / name) for name in ("out.json", "out_files")}
    assert after == before
    assert not [p for p in tmp_path.iterdir() if "qdebug-previous" in p.name]
    monkeypatch.undo()
    assert main([*args, "--per-channel"]) == 0  # and a completed re-run replaces them
    assert _tree(tmp_path / "out.json") != before["out.json"]
    assert not [p for p in tmp_path.iterdir() if "qdebug-previous" in p.name]


def test_removed_on_failure_edge_cases(tmp_path):
    """Found in review: an output that is also an input was moved away before the overlap check could name
    it; a symlinked _files/ was replaced by a directory (the user's link lost); an empty output path
    raised ValueError."""
    from qdebug.output.files import removed_on_failure

    same = tmp_path / "in.json"
    same.write_text("input")
    with removed_on_failure(tmp_path / "in_files", [same, ""], [same]):
        assert same.read_text() == "input"  # still there for the run (and its overlap check) to see
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "old.onnx").write_text("old")
    link = tmp_path / "r_files"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(KeyboardInterrupt):
        with removed_on_failure(link, [tmp_path / "r.json"], []):
            (tmp_path / "r.json").write_text("half")
            raise KeyboardInterrupt
    assert link.is_symlink() and (real / "old.onnx").read_text() == "old"
    assert not (tmp_path / "r.json").exists()
    with removed_on_failure(link, [tmp_path / "r.json"], []):
        (tmp_path / "r.json").write_text("whole")
    assert link.is_symlink() and (tmp_path / "r.json").read_text() == "whole"
    assert not [p for p in tmp_path.iterdir() if "qdebug-previous" in p.name]


def test_sigterm_restores_the_earlier_report_and_leaves_nothing_aside(tmp_path):
    """SIGTERM (timeout, a cancelled CI job) had killed the re-run outright: the earlier report was left
    hidden as .report.json.qdebug-previous next to half-built models. It is now cleaned up like Ctrl-C
    (exit 143), and an output a killed run left aside is put back by the next run."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz")
    (tmp_path / "slowmetric.py").write_text(SLOW_METRIC)
    out = tmp_path / "report.json"
    env = dict(os.environ, QDEBUG_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    base = [sys.executable, "-m", "qdebug", "analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]
    subprocess.run(base, cwd=tmp_path, env=env, check=True, capture_output=True)
    earlier = out.read_bytes()
    proc = subprocess.Popen(
        [*base, "--metric", f"{tmp_path / 'slowmetric.py'}:score"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metric-entered").exists():
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == ExitCode.TERMINATED, err
    assert "terminated" in err and "Traceback" not in err
    assert out.read_bytes() == earlier
    assert not list(tmp_path.glob(".*qdebug-previous"))

    # a run killed outright (SIGKILL) leaves the earlier output aside: the next run takes it back first
    out.rename(tmp_path / ".report.json.qdebug-previous")
    subprocess.run([*base, "--max-samples", "8"], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert out.is_file() and not list(tmp_path.glob(".*qdebug-previous"))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["nodes"][0].update(depth=1e999), "expected an integer, got inf"),
        (lambda r: r["nodes"][0].update(depth=1.5), "expected an integer, got 1.5"),
        (lambda r: r["nodes"][0].update(depth=10**18), "node depths"),
        (lambda r: r["nodes"][0].update(depth=-5), "node depths"),
        (lambda r: r["tensors"][0]["summary"].update(mean=10**400), "OverflowError"),
    ],
)
def test_hand_edited_report_numbers_are_refused(tmp_path, edit, message):
    """A depth of 1e999, 1e18 or -1e18, or a 400-digit number, had given tracebacks in propose and the TUI
    (OverflowError, MemoryError, IndexError); 1.5 was truncated to 1."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=8)
    report = tmp_path / "r.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(report), "-q"]) == 0
    data = json.loads(report.read_text())
    edit(data)
    report.write_text(json.dumps(data).replace("Infinity", "1e999"))
    commands = (["propose", str(report), "-o", str(tmp_path / "p.json")], ["tui", str(report), "--screenshot", "s.svg"])
    for args in commands:
        code, err = _cli(args)
        assert code == ExitCode.INPUT, err
        assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_deeply_nested_json_is_not_a_report(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(QDebugError, match="not JSON"):
        load_report(deep)


def test_an_output_symlink_is_written_through(tmp_path):
    """`-o link.json` had replaced the link with a regular file and left its target stale."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=8)
    target = tmp_path / "store" / "report.json"
    target.parent.mkdir()
    target.write_text('{"old": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(link), "-q"]) == 0
    assert link.is_symlink() and load_report(target).samples == 8


def test_an_output_left_aside_by_a_killed_run_comes_back_whole(tmp_path):
    """A run killed outright leaves the earlier report and _files/ aside and its own partial _files/ in
    place. The next run takes the earlier pair back first, also when it then fails itself: it had kept the
    partial folder and deleted the earlier models, and a failure then paired the earlier report with them."""
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=8)
    out, files = tmp_path / "r.json", tmp_path / "r_files"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q"]) == 0
    report, quantized = out.read_bytes(), (files / "quantized.onnx").read_bytes()
    out.rename(tmp_path / ".r.json.qdebug-previous")  # what a SIGKILL mid-run leaves
    files.rename(tmp_path / ".r_files.qdebug-previous")
    files.mkdir()
    (files / "normalized.onnx").write_bytes(b"partial")
    np.savez(tmp_path / "bad.npz", wrong=np.zeros((4, 2), np.float32))
    assert main(["analyze", str(model), "--calib", str(tmp_path / "bad.npz"), "-o", str(out), "-q"]) == ExitCode.DATA
    assert out.read_bytes() == report and (files / "quantized.onnx").read_bytes() == quantized
    assert not list(tmp_path.glob(".*qdebug-previous"))


def test_a_second_run_to_the_same_output_is_refused_while_the_first_writes(tmp_path):
    """Two runs into one -o had mixed their files (one's report, the other's models); the second now stops at
    once (exit 7) while the first holds the output's lock, and the lock goes with the first run."""
    fcntl = pytest.importorskip("fcntl")
    model, calib = small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "c.npz", n=8)
    out = tmp_path / "r.json"
    lock = tmp_path / ".r.json.qdebug-lock"
    with open(lock, "w") as held:  # what a running qdebug holds
        fcntl.flock(held, fcntl.LOCK_EX)
        code, err = _cli(["analyze", model, "--calib", calib, "-o", out, "-q"])
        assert code == ExitCode.OUTPUT and "another qdebug run is writing" in err and err.count("\n") == 1
        assert not out.exists()
    code, err = _cli(["analyze", model, "--calib", calib, "-o", out, "-q"])
    assert code == 0, err
    assert out.is_file() and not lock.exists()
