"""The per-sample drill-down through the capture's optimized sides (graph_engine.OptimizedSides): the same
numbers as the Tap sessions over both models, no model optimized again, the sides' files deleted after, and
the Taps again whenever the sides lack a tensor the capture measured."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import qdebug.analysis.per_sample as per_sample
from qdebug.analysis import measure_layers
from qdebug.cli.main import main
from qdebug.graph.match import pair_models
from qdebug.prepare import AnalyzeOptions, prepare
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.runtime.capture import SessionConfig
from tests.conftest import FIXTURES


def _captured(fixture: str, tmp_path: Path):
    root = FIXTURES / fixture
    prep = prepare(root / "model.onnx", root / "calib.npz", tmp_path, AnalyzeOptions(use_cache=False))
    qproto = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(), load_check=False)
    pairing = pair_models(prep.normalized, qproto)
    data = prep.calib
    layers = measure_layers(prep.normalized, qproto, pairing, data, SessionConfig(), keep_sides=True)
    batch = next(iter(data.batches()))
    samples = [per_sample.cut(i, batch.feeds, i, batch.size, batch.axes) for i in range(3)]
    return prep, qproto, pairing, layers, samples


def sessions_opened(monkeypatch) -> list[bool]:
    """per_sample's own session openings (their ``optimize`` flags), recorded from now on; the Taps open
    theirs through qdebug.runtime.capture and are not counted."""
    opened: list[bool] = []
    real = per_sample.make_session

    def spy(model, config, *, optimize=True, **kwargs):
        opened.append(optimize)
        return real(model, config, optimize=optimize, **kwargs)

    monkeypatch.setattr(per_sample, "make_session", spy)
    return opened


def _numbers(measured) -> list[float]:
    """Every number of every measured sample, flat."""
    return [float(v) for m in measured for v in (*m.sqnr_db, *m.added_noise_db, *m.clip_rate, m.output_sqnr_db)]


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("fixture", ["cnn", "transformer"])
def test_the_sides_give_the_taps_numbers_without_optimizing_again(fixture, tmp_path, monkeypatch):
    prep, qproto, pairing, layers, samples = _captured(fixture, tmp_path)
    sides = layers.sides
    assert sides is not None and sides.fp32.is_file() and sides.qdq.is_file()
    if fixture == "transformer":
        assert layers.aliases  # Reshape/Transpose outputs measured through their sources
    opened = sessions_opened(monkeypatch)
    args = (prep.normalized, qproto, pairing, samples, SessionConfig())
    shape, through_sides = per_sample.sample_tensors(*args, sides=sides, aliases=layers.aliases)
    assert opened == [False, False]  # both files opened as they are: nothing optimized again
    monkeypatch.undo()
    shape_taps, through_taps = per_sample.sample_tensors(*args)
    assert shape == shape_taps and len(through_sides) == len(through_taps) == 3
    finite = [v for m in through_sides for v in m.sqnr_db if not math.isnan(v)]
    assert finite, "the samples were measured"
    aliased = [k for k, name in enumerate(shape.names) if name in layers.aliases]
    for m, n in zip(through_sides, through_taps, strict=True):
        # an alias has its source's values, as in the report: its node adds no noise (-inf), where its own
        # values (a Transpose's, moved) gave float dust
        for k in aliased:
            assert m.added_noise_db[k] == -math.inf or m.added_noise_db[k] == n.added_noise_db[k]
            assert n.added_noise_db[k] < -100 or n.added_noise_db[k] == m.added_noise_db[k]
        same = [k for k in range(len(shape.names)) if k not in aliased]
        assert _close([m.added_noise_db[k] for k in same], [n.added_noise_db[k] for k in same])
        assert _close([*m.sqnr_db, *m.clip_rate, m.output_sqnr_db], [*n.sqnr_db, *n.clip_rate, n.output_sqnr_db])
    sides.cleanup()
    assert not sides.fp32.exists()


def test_sides_lacking_a_measured_tensor_fall_back_to_the_taps(tmp_path, monkeypatch):
    prep, qproto, pairing, layers, samples = _captured("cnn", tmp_path)
    sides = layers.sides
    assert sides is not None
    sides.qdq_names = frozenset(sorted(sides.qdq_names)[1:])  # one quantized tensor the capture measured missing
    opened = sessions_opened(monkeypatch)
    args = (prep.normalized, qproto, pairing, samples, SessionConfig())
    _, measured = per_sample.sample_tensors(*args, sides=sides, aliases=layers.aliases)
    assert opened == []  # per_sample's own sessions were not used: the Taps ran (capture.make_session)
    monkeypatch.undo()
    _, taps = per_sample.sample_tensors(*args)
    assert _close(_numbers(measured), _numbers(taps))
    sides.cleanup()


def test_analyze_drills_down_through_the_sides_and_deletes_them(tmp_path, monkeypatch):
    import tempfile

    made: list[Path] = []
    real = per_sample._SideRun.__init__

    def spy(self, path, *args, **kwargs):
        made.append(Path(path))
        real(self, path, *args, **kwargs)

    monkeypatch.setattr(per_sample._SideRun, "__init__", spy)
    cnn = FIXTURES / "cnn"
    (tmp_path / "tmp").mkdir()  # temporary directories of this test's own: other runs share /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    before = set(Path(tempfile.gettempdir()).glob("qdebug-sides-*"))
    code = main(["analyze", str(cnn / "model.onnx"), "--calib", str(cnn / "calib.npz"), "--eval",
                 str(cnn / "eval.npz"), "-o", str(tmp_path / "r.json"), "-q", "--no-cache"])  # fmt: skip
    assert code == 0
    import json

    section = json.loads((tmp_path / "r.json").read_text())["per_sample"]
    assert section["details"], "a flipped sample was measured tensor by tensor"
    assert [p.name for p in made] == ["fp32-optimized.onnx", "qdq-optimized.onnx"]
    assert not any(p.exists() for p in made)
    assert set(Path(tempfile.gettempdir()).glob("qdebug-sides-*")) == before
