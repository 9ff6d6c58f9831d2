"""Shared pytest fixtures."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.models import small_cnn, small_data

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Keep the calibration cache out of the user's home during tests."""
    monkeypatch.setenv("QDEBUG_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "qdebug-cache"))


@pytest.fixture(autouse=True)
def _outside_the_checkout(tmp_path_factory, monkeypatch):
    """Run every test from a scratch directory: a command's default output (``proposal.json``, a report)
    lands there, never in the checkout (a test run once committed ``proposal.json`` at the root)."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def _git_status() -> str | None:
    try:
        r = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STATUS] = _git_status()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run when the tests left files in the checkout (``git status`` changed)."""
    before, after = session.config.stash.get(_STATUS, None), _git_status()
    if before is None or after is None or before == after:
        return
    new = sorted(set(after.splitlines()) - set(before.splitlines()))
    session.config.get_terminal_writer().line(
        f"the tests changed the checkout (git status): {'; '.join(new[:10]) or 'files changed'}", red=True
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_STATUS = pytest.StashKey[str | None]()


@pytest.fixture
def cnn(tmp_path: Path) -> tuple[Path, Path]:
    """(model, calib data) of a tiny CNN with unnamed nodes."""
    return small_cnn(tmp_path / "m.onnx"), small_data(tmp_path / "calib.npz")


def fixture_path(*parts: str) -> Path:
    """Path of a committed fixture (they are committed: a missing one is a failure, not a skip)."""
    path = FIXTURES.joinpath(*parts)
    assert path.exists(), f"fixture {path} missing (run python fixtures/make_fixtures.py)"
    return path


def analyze_args(name: str, out: Path, *extra: str) -> list[str]:
    """``qdebug analyze`` argv for a committed fixture (its model and calibration set), quiet, to ``out``."""
    base = fixture_path(name)
    return [
        "analyze",
        str(base / "model.onnx"),
        "--calib",
        str(base / "calib.npz"),
        "-o",
        str(out),
        "-q",
        *extra,
    ]


def analyze_with_both_engines(model: Path, calib: Path, tmp_path: Path, *extra: str) -> dict:
    """``{"graph": Report, "numpy": Report}``: the same analysis with the in-ORT and the exact numpy engine."""
    from qdebug.cli.main import main
    from qdebug.output.report_io import load_report

    reports = {}
    for engine in ("graph", "numpy"):
        out = tmp_path / f"{engine}.json"
        args = [
            "analyze",
            str(model),
            "--calib",
            str(calib),
            "-o",
            str(out),
            "-q",
            "--engine",
            engine,
            *extra,
        ]
        assert main(args) == 0
        reports[engine] = load_report(out)
    return reports


def analyze_then_propose(model: Path, calib: Path, tmp_path: Path, *analyze_extra: str) -> dict:
    """``analyze`` then ``propose --target-drop 0`` (the target may be missed); the proposal's JSON."""
    import json

    from qdebug.cli.main import main

    report, prop = tmp_path / "r.json", tmp_path / "p.json"
    assert main(["analyze", str(model), "--calib", str(calib), *analyze_extra, "-o", str(report), "-q"]) == 0
    assert main(["propose", str(report), "--target-drop", "0", "-o", str(prop), "-q"]) in (0, 6)
    return json.loads(prop.read_text())


def qdq_scales(path: Path | str) -> dict:
    """Every ``*_scale`` initializer of a QDQ model: equal scales mean the same calibration was used."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    return {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.name.endswith("_scale")}


def strict_json(text: str):
    """``json.loads`` refusing NaN/Infinity literals (plain ``json.loads`` accepts them: a "strict JSON"
    check made with it cannot fail)."""
    import json

    def refuse(literal: str):
        raise ValueError(f"non-standard JSON literal {literal}")

    return json.loads(text, parse_constant=refuse)


def planted():
    """``fixtures/planted.py`` (the planted-model generators) as the module ``planted``, loaded once: its
    dataclasses resolve their module by name, so it is registered in ``sys.modules`` before it runs."""
    import importlib.util
    import sys

    if "planted" not in sys.modules:
        spec = importlib.util.spec_from_file_location("planted", FIXTURES / "planted.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["planted"] = module
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    return sys.modules["planted"]
