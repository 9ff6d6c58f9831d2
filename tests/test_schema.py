"""The report's schema version: what version 3 added (``TensorRecord.folded_into``), how files of version 2
still load, and how files of versions this qdebug does not know are refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from qdebug.cli.main import main
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.report_io import dumps, load_proposal, load_report, save_report
from qdebug.records import SCHEMA_VERSION, folded_into
from tests.tui_report import make_proposal, make_report

V2_NOTE = (
    "no counterpart in the quantized model: ORT folded the following Relu (relu1) "
    "into the quantization range of its output"
)
"""A version-2 tensor note, as version 2's pairing wrote it (the only marker of a folded activation then)."""


@pytest.fixture
def analyzed(cnn, tmp_path) -> tuple[Path, dict]:
    """A report of the tiny CNN (ORT folds its Relus into their producers' output quantization) and its JSON."""
    model, calib = cnn
    out = tmp_path / "report.json"
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q", "--batch-size", "7"]) == 0
    return out, json.loads(out.read_text())


def _as_v2(raw: dict) -> dict:
    """The same report as version 2 wrote it: no ``folded_into``, the version number 2."""
    old = json.loads(json.dumps(raw))
    old["schema_version"] = 2
    for t in old["tensors"]:
        del t["folded_into"]
    return old


def test_a_new_report_carries_folded_into(analyzed):
    path, raw = analyzed
    assert raw["schema_version"] == SCHEMA_VERSION == 3
    report = load_report(path)
    relu = next(n for n in report.nodes if n.op_type == "Relu" and "r1" in n.outputs)
    conv = next(n for n in report.nodes if "c1" in n.outputs)
    assert report.tensor("c1").folded_into == relu.name  # the pre-activation tensor names the activation
    assert report.tensor("r1").folded_into is None  # the activation's output carries the pair, not the mark
    assert all("folded_into" in t for t in raw["tensors"])  # written on every tensor (null when not folded)
    assert folded_into(report.nodes, report.tensors)[relu.name] == conv.name
    folded = {t["name"] for t in raw["tensors"] if t["folded_into"] is not None}
    assert folded == {t["name"] for t in raw["tensors"] if "ORT folded" in t["note"]}  # the note stays for people


def test_a_schema_2_report_loads_with_folded_into_derived_from_its_notes(analyzed, tmp_path):
    path, raw = analyzed
    old = tmp_path / "v2.json"
    old.write_text(json.dumps(_as_v2(raw)))
    migrated, current = load_report(old), load_report(path)
    assert migrated.schema_version == SCHEMA_VERSION
    assert dumps(migrated) == dumps(current)  # the migration rebuilds exactly what the pairing writes
    assert folded_into(migrated.nodes, migrated.tensors) == folded_into(current.nodes, current.tensors) != {}


def test_a_synthetic_schema_2_report_gets_folded_into_from_the_note_only(tmp_path):
    report = make_report()
    t = next(t for t in report.tensors if t.producer is not None and len(t.consumers) == 1)
    other = next(x for x in report.tensors if x.name != t.name and x.consumers)
    tensors = tuple(dataclasses.replace(x, note=V2_NOTE) if x is t else x for x in report.tensors)
    raw = json.loads(dumps(dataclasses.replace(report, tensors=tensors)))
    (tmp_path / "v2.json").write_text(json.dumps(_as_v2(raw)))
    loaded = load_report(tmp_path / "v2.json")
    assert loaded.tensor(t.name).folded_into == t.consumers[0]
    assert loaded.tensor(other.name).folded_into is None
    assert folded_into(loaded.nodes, loaded.tensors) == {t.consumers[0]: t.producer}


def test_the_note_is_no_longer_parsed(tmp_path):
    report = make_report()
    t = next(t for t in report.tensors if t.producer is not None and len(t.consumers) == 1)
    noted = dataclasses.replace(report, tensors=tuple(dataclasses.replace(x, note=V2_NOTE) for x in report.tensors))
    assert folded_into(noted.nodes, noted.tensors) == {}  # version 3: the text alone marks nothing
    marked = dataclasses.replace(
        report,
        tensors=tuple(dataclasses.replace(x, folded_into=x.consumers[0]) if x is t else x for x in report.tensors),
    )
    assert folded_into(marked.nodes, marked.tensors) == {t.consumers[0]: t.producer}
    save_report(marked, tmp_path / "r.json")  # and the field survives the round trip
    assert load_report(tmp_path / "r.json").tensor(t.name).folded_into == t.consumers[0]
    # a hand-edited mark that names no reader of the tensor is not an attribution
    elsewhere = next(n.name for n in report.nodes if t.name not in n.inputs)
    stray = dataclasses.replace(
        report, tensors=tuple(dataclasses.replace(x, folded_into=elsewhere) if x is t else x for x in report.tensors)
    )
    assert folded_into(stray.nodes, stray.tensors) == {}


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 99])
def test_a_report_of_a_newer_version_is_refused_with_the_reason(tmp_path, version):
    raw = json.loads(dumps(make_report()))
    raw["schema_version"] = version
    (tmp_path / "new.json").write_text(json.dumps(raw))
    with pytest.raises(QDebugError) as info:
        load_report(tmp_path / "new.json")
    assert f"schema version {version}, this qdebug reads versions 2 and {SCHEMA_VERSION}" in str(info.value)
    assert "newer qdebug" in info.value.hint and "upgrade" in info.value.hint
    assert info.value.code == ExitCode.INPUT


def test_a_report_of_an_unknown_older_version_is_refused(tmp_path, capsys):
    raw = json.loads(dumps(make_report()))
    raw["schema_version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(raw))
    with pytest.raises(QDebugError, match="schema version 1, this qdebug reads versions 2 and 3") as info:
        load_report(tmp_path / "old.json")
    assert "re-create it" in info.value.hint
    assert main(["tui", str(tmp_path / "old.json")]) == ExitCode.INPUT  # one line from the CLI, no traceback
    err = capsys.readouterr().err
    assert "schema version 1" in err and "Traceback" not in err


def test_the_version_as_a_string_is_refused(tmp_path):
    raw = json.loads(dumps(make_report()))
    raw["schema_version"] = "2"  # neither migrated nor read as 2
    (tmp_path / "s.json").write_text(json.dumps(raw))
    with pytest.raises(QDebugError, match="schema version '2'"):
        load_report(tmp_path / "s.json")


def test_a_schema_2_proposal_loads_unchanged(tmp_path):
    proposal = make_proposal()
    raw = json.loads(dumps(proposal))
    raw["schema_version"] = 2
    (tmp_path / "p.json").write_text(json.dumps(raw))
    loaded = load_proposal(tmp_path / "p.json")
    assert loaded.schema_version == SCHEMA_VERSION
    assert dumps(loaded) == dumps(dataclasses.replace(proposal, schema_version=SCHEMA_VERSION))


@dataclasses.dataclass(frozen=True)
class _Tree:
    """A record holding its own type (the decoders are made per type, once)."""

    label: str
    weight: float | None
    children: tuple[_Tree, ...] = ()


def test_records_decode_with_their_types_checked_also_a_record_that_holds_its_own_type():
    """from_jsonable builds each type's decoder once: the values still go through every check (a bool is not
    a float's "inf", 1.5 not an int), defaults fill missing fields, and a recursive record decodes."""
    from qdebug.output.report_io import from_jsonable, to_jsonable

    tree = _Tree("root", None, (_Tree("a", float("inf")), _Tree("b", 2.0, (_Tree("c", -1.5),))))
    assert from_jsonable(_Tree, json.loads(json.dumps(to_jsonable(tree)))) == tree
    assert from_jsonable(_Tree, {"label": "x", "weight": 3}) == _Tree("x", 3.0)
    assert from_jsonable(tuple[int, ...], [1, 2.0]) == (1, 2)
    for tp, bad, why in (
        (_Tree, {"label": 1, "weight": None}, "expected a string"),
        (_Tree, {"label": "x", "weight": None, "children": "ab"}, "expected a list"),
        (tuple[int, ...], [1, 1.5], "expected an integer"),
        (tuple[int, str], [True, "a"], "expected an integer"),
        (bool, "false", "expected true or false"),
    ):
        with pytest.raises(ValueError, match=why):
            from_jsonable(tp, bad)
    with pytest.raises(TypeError):  # a field without default missing
        from_jsonable(_Tree, {"weight": 1.0})


def test_an_analyzed_report_round_trips_byte_for_byte(analyzed, tmp_path):
    """The report analyze wrote loads back into records that write the same bytes again."""
    path, _ = analyzed
    assert dumps(load_report(path)) == path.read_text()
