"""Contracts of the optimized sides' lifecycle in analyze (pipeline._method_report/_per_sample,
samples.DetailTarget): the sides are kept only for a drill-down, deleted before the report is assembled
(not merely when their object is collected), and the drill-down through them gets the capture's aliases:
an alias tensor (a Reshape/Transpose output) has its source's numbers, never nan."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from qdebug import pipeline
from qdebug.analysis import graph_engine, per_sample
from qdebug.cli.main import main
from tests.conftest import FIXTURES

TRANSFORMER = FIXTURES / "transformer"


def _analyze(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "analyze", str(TRANSFORMER / "model.onnx"), "--calib", str(TRANSFORMER / "calib.npz"),
        "--eval", str(TRANSFORMER / "eval.npz"), "-o", str(tmp_path / "r.json"), "-q", "--no-cache", *extra,
    ]  # fmt: skip


def _sides_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("qdebug-sides-*"))


def _spied(monkeypatch) -> tuple[list, list, list]:
    """(sides kept, side sessions opened, sides directories alive when the report was assembled)."""
    kept, opened, at_report = [], [], []
    moved = graph_engine.OptimizedSides.moved.__func__

    def spy_moved(cls, *args, **kwargs):
        sides = moved(cls, *args, **kwargs)
        kept.append(sides)
        return sides

    monkeypatch.setattr(graph_engine.OptimizedSides, "moved", classmethod(spy_moved))
    real_side = per_sample._SideRun.__init__

    def spy_side(self, path, *args, **kwargs):
        opened.append(Path(path).name)
        real_side(self, path, *args, **kwargs)

    monkeypatch.setattr(per_sample._SideRun, "__init__", spy_side)
    real_report = pipeline.assemble_report

    def spy_report(*args, **kwargs):
        at_report.append(_sides_dirs())
        return real_report(*args, **kwargs)

    monkeypatch.setattr(pipeline, "assemble_report", spy_report)
    return kept, opened, at_report


def _private_tmp(tmp_path: Path, monkeypatch) -> None:
    """Temporary directories of this test's own (another run's sides in the shared /tmp are not ours)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def test_the_drill_down_reads_aliases_through_the_sides_which_are_gone_before_the_report(tmp_path, monkeypatch):
    _private_tmp(tmp_path, monkeypatch)
    before = _sides_dirs()
    kept, opened, at_report = _spied(monkeypatch)
    assert main(_analyze(tmp_path)) == 0
    assert len(kept) == 1 and kept[0] is not None  # the capture kept its sides for the drill-down
    assert opened == ["fp32-optimized.onnx", "qdq-optimized.onnx"]  # and the drill-down ran through them
    assert at_report == [before]  # deleted before the report was assembled, not when collected
    section = json.loads((tmp_path / "r.json").read_text())["per_sample"]
    assert section["details"]
    for detail in section["details"]:
        # the transformer's Reshape/Transpose outputs are aliases: read through their sources, never nan
        values = detail["sqnr_db"]
        assert len(values) == len(section["tensors"])
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), detail["index"]


def test_no_sides_are_kept_without_a_drill_down(tmp_path, monkeypatch):
    kept, opened, _ = _spied(monkeypatch)
    assert main(_analyze(tmp_path, "--flip-details", "0")) == 0
    assert kept == [] and opened == []
