"""``analyze --method a,b,c`` prints each method's notes (a fresh-user review: three methods printed no
note, ``--method entropy`` alone five, the entropy-calibration note the README promises among them)."""

from __future__ import annotations

from types import SimpleNamespace

from qdebug.cli.analyze import method_notes


def _reports(**notes: tuple[str, ...]) -> dict:
    return {m: SimpleNamespace(notes=n) for m, n in notes.items()}


def test_each_methods_notes_are_labelled_and_shared_ones_printed_once():
    reports = _reports(
        minmax=("fake-quant view on 32 samples", "cache minmax"),
        entropy=("fake-quant view on 32 samples", "entropy searched no threshold", "cache entropy", "wide"),
        percentile=("fake-quant view on 32 samples", "cache percentile", "wide"),
    )
    assert method_notes(reports) == [  # a note two methods carry: once, under the first of them, naming both
        "note (every method): fake-quant view on 32 samples",
        "note (minmax): cache minmax",
        "note (entropy): entropy searched no threshold",
        "note (entropy): cache entropy",
        "note (entropy, percentile): wide",
        "note (percentile): cache percentile",
    ]


def test_no_notes_no_lines_and_a_repeated_note_once():
    assert method_notes(_reports(minmax=(), entropy=())) == []
    assert method_notes(_reports(minmax=("a", "a"), entropy=("a",))) == ["note (every method): a"]


def test_the_cli_prints_the_entropy_note(tmp_path, capsys):
    """Through the real CLI on the transformer fixture (a part of its data): the entropy report's own note
    is printed under its method's name, and every note of every report is on stdout."""
    from qdebug.cli.main import main
    from qdebug.output.report_io import load_report
    from tests.conftest import fixture_path

    base = fixture_path("transformer")
    out = tmp_path / "r.json"
    args = [
        "analyze", str(base / "model.onnx"), "--calib", str(base / "calib.npz"), "--max-samples", "32",
        "--batch-size", "16", "--fakequant-samples", "0", "--flip-details", "0", "-q",
        "--method", "minmax,entropy", "-o", str(out),
    ]
    assert main(args) == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at 120 columns
    for method in ("minmax", "entropy"):
        for note in load_report(tmp_path / f"r.{method}.json").notes:
            assert " ".join(note.split()) in printed, (method, note)
    assert "note (entropy): --method entropy searched no clipping threshold" in printed
