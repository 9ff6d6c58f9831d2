"""The TUI's findings pane (issue 19 item 5): the report's notes, linked to the nodes and tensors they name.

The name matching is plain Python (:func:`qdebug.tui.model.match_names`), tested on notes ``qdebug analyze``
wrote; the pane is tested with Pilot and an SVG snapshot on the synthetic report of ``tui_report.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses

from textual.notifications import Notify

from qdebug.tui.app import QDebugApp
from qdebug.tui.findings import FindingsPanel
from qdebug.tui.model import FINDING_REASON, HAND_REASON, LayerModel, match_names, note_findings
from qdebug.tui.screens import HelpScreen, MainScreen, TextDialog
from qdebug.tui.widgets import NodeTable, summary_text
from tests.tui_report import KERNEL_GAP_NOTE, make_findings_report, make_report

SIZE = (120, 40)
FINDINGS = make_findings_report()

# Notes `qdebug analyze` wrote (verbatim) on the generated models of tests/test_notes.py, with each report's
# node and tensor names: the detector whose loss is one Concat, an additive -1e9 mask, a hot residual.
BOX_NOTE = (
    "Concat head/concat joins inputs whose ranges differ by 342x (boxes [1, 320], scores [0.0296, 0.937]): one "
    "scale for detections wipes out the small one; its shared scale 1.255 leaves scores about 0.7 quantization "
    "level(s); local SQNR of detections: 52.4 dB. Keep detections in float (exclude head/concat and its quantized "
    "neighbours), give it 16-bit activations, or concatenate after dequantizing"
)
BOX_NAMES = (
    *("box/matmul", "box/sigmoid", "box/scale", "box/to_pixels", "cls/matmul", "cls/sigmoid", "head/concat"),
    *("x", "b", "b01", "bpx", "boxes", "c", "scores", "detections", "w_box", "px", "one", "w_cls"),
)
MASK_NOTE = (
    "masked: 58% of its values fall in one quantization step (scale 3.92e+06 for the range [-1e+09, 12.1]), "
    "although its SQNR looks 170.0 dB (the largest values carry the energy); softmax (Softmax) reading it falls "
    "to 4.1 dB SQNR, which its own quantization (52.0 dB) does not explain. A range set by outliers such as mask "
    "values of -1e9 erases the other values: keep mask_add and softmax out of quantization"
)
MASK_WEIGHTS_NOTE = (
    "the quantized model keeps 148 B of the model's 664 B of weights float in mask_inv (Sub, 148 B): those nodes "
    "are not quantized (excluded, or an op ORT's quantizer leaves float), so they add to its size and run float "
    "kernels"
)
MASK_NAMES = (
    *("q_proj", "k_t", "qk", "mask_inv", "mask_mul", "mask_add", "softmax", "pv", "o_proj"),
    *("x", "q", "xt", "scores", "drop", "madd", "masked", "p", "ctx", "y"),
)
RESIDUAL_NOTE = (
    "resid: 70% of its values fall in one quantization step (scale 3.94 for the range [-3.55, 1e+03]), although "
    "its SQNR looks 50.1 dB (the largest values carry the energy); block/proj (MatMul) reading it falls to 3.4 dB "
    "SQNR, which its own quantization (43.7 dB) does not explain. A range set by outliers such as mask values of "
    "-1e9 erases the other values: keep block/residual and block/proj out of quantization"
)
RESIDUAL_NAMES = ("block/fc", "block/residual", "block/proj", "x", "h", "resid", "y")


def named(text: str, names) -> list[str]:
    """The names :func:`match_names` finds in ``text``, in text order, checked against the spans."""
    found = match_names(text, names)
    assert all(text[start:end] == name for start, end, name in found)
    assert all(a[1] <= b[0] for a, b in zip(found, found[1:], strict=False))  # in order, never overlapping
    return [name for _, _, name in found]


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- name matching


def test_match_names_on_notes_analyze_wrote():
    assert named(BOX_NOTE, BOX_NAMES) == [
        *("head/concat", "boxes", "scores", "detections", "scores", "detections", "detections", "head/concat"),
    ]  # not x in "342x", not b, c or one: "one scale" is prose (a tensor called "one" links only quoted)
    assert named(MASK_NOTE, MASK_NAMES) == ["masked", "softmax", "mask_add", "softmax"]  # not "(Softmax)"
    assert named(MASK_WEIGHTS_NOTE, MASK_NAMES) == ["mask_inv"]
    assert named(RESIDUAL_NOTE, RESIDUAL_NAMES) == ["resid", "block/proj", "block/residual", "block/proj"]
    report = make_report()
    names = [n.name for n in report.nodes] + [t.name for t in report.tensors]
    # longest first: the node is not found inside its output tensor's name, and both are found
    assert named(KERNEL_GAP_NOTE, names) == ["layer0/attn/q_proj_out", "layer0/attn/q_proj", "layer0/attn/q_proj"]


def test_match_names_word_boundaries_and_prose_words():
    names = ("conv1", "block/conv1", "input:0", "input", "relu")
    assert named("keep conv10 and layer/conv1 and conv1_out", names) == []  # parts of longer names
    assert named("keep conv1. Then conv1: its (conv1), conv1...) and 'conv1'", names) == ["conv1"] * 5
    assert named("block/conv1 reads input:0: 3 dB", names) == ["block/conv1", "input:0"]
    assert named("the graph input is clipped; 'input' and `input` are", names) == ["input", "input"]
    assert named("x-relu relu-x relu/x x.relu relu", names) == ["relu"]
    assert named("Relu RELU", names) == []  # names are exact
    assert match_names("", names) == () and match_names("conv1", ()) == ()


def test_note_findings_link_nodes_tensors_and_targets():
    findings = note_findings(FINDINGS)
    assert [f.index for f in findings] == list(range(len(FINDINGS.notes)))
    unnamed, cache, gap, collapsed, evaluation = findings
    assert unnamed.nodes == unnamed.linked == unnamed.targets == ("final/ln",)
    assert cache.mentions == () and cache.linked == cache.targets == ()
    assert gap.nodes == ("layer0/attn/q_proj",) and gap.tensors == ("layer0/attn/q_proj_out",)
    assert gap.targets == ("layer0/attn/q_proj",)
    assert [m.kind for m in gap.mentions] == ["tensor", "node", "node"]
    # the nodes named first (in order of mention), then the producers of the named tensors
    assert collapsed.linked == collapsed.targets == ("layer1/attn/av_matmul", "layer1/attn/softmax")
    assert evaluation.tensors == ("logits",) and evaluation.targets == ("head/matmul",)

    report = make_report()
    renamed = dataclasses.replace(report.node("layer1/mlp/fc2"), original_name="/encoder/layer.1/fc2/MatMul")
    nodes = tuple(renamed if n.name == renamed.name else n for n in report.nodes)
    notes = (
        "keep layer0/ln1 FP32",  # the quantizer leaves it float: linked, nothing to exclude
        "evaluation data drives output 'logits' outside its calibrated range: keep its producer FP32",
        "/encoder/layer.1/fc2/MatMul (MatMul) reads layer1/mlp/fc2.weight",
    )
    ln1, producer, original = note_findings(dataclasses.replace(report, nodes=nodes, notes=notes))
    assert ln1.linked == ("layer0/ln1",) and ln1.targets == ()
    assert producer.nodes == () and producer.targets == ("head/matmul",)  # no node named: the producer
    assert original.nodes == ("layer1/mlp/fc2",) and original.tensors == ("layer1/mlp/fc2.weight",)
    assert [m.kind for m in original.mentions] == ["node", "weight"]


def test_toggle_finding_excludes_its_targets_and_gives_the_note_as_reason():
    m = LayerModel(FINDINGS)
    m.toggle("layer1/attn/softmax")  # by hand first
    excluded, changed = m.toggle_finding(3)
    assert excluded and changed == ("layer1/attn/av_matmul",)
    assert set(m.excluded) == {"layer1/attn/av_matmul", "layer1/attn/softmax"}
    assert m.reason("layer1/attn/av_matmul").reason == f"{FINDING_REASON}: {FINDINGS.notes[3]}"
    assert m.reason("layer1/attn/softmax").reason.startswith(HAND_REASON)
    assert m.finding_of("layer1/attn/av_matmul") == 3 and m.finding_of("layer1/attn/softmax") is None
    proposal = m.to_proposal()
    assert set(proposal.nodes_to_exclude) == {"layer1/attn/av_matmul", "layer1/attn/softmax"}
    assert excluded_reasons(proposal)["layer1/attn/av_matmul"].startswith(FINDING_REASON)
    assert m.toggle_finding(3) == (False, ("layer1/attn/av_matmul", "layer1/attn/softmax"))  # all: included again
    assert m.excluded == () and m.finding_of("layer1/attn/av_matmul") is None
    assert m.toggle_finding(1) == (True, ())  # names nothing: nothing changes
    m.toggle_finding(2)
    m.toggle("layer0/attn/q_proj")  # included by hand: its reason is no longer the note's
    assert m.finding_of("layer0/attn/q_proj") is None and m.excluded == ()


def excluded_reasons(proposal) -> dict[str, str]:
    return {r.node: r.reason for r in proposal.reasons}


def test_header_counts_the_findings():
    assert summary_text(FINDINGS).plain.endswith("│ 5 findings (f)")
    assert summary_text(make_report()).plain.endswith("│ 1 finding (f)")
    assert "finding" not in summary_text(dataclasses.replace(FINDINGS, notes=())).plain


# --------------------------------------------------------------------------- the pane


class Verified:
    def __init__(self, nodes):
        self.nodes = nodes

    def summary_lines(self):
        return [f"{len(self.nodes)} nodes kept in FP32"]


def test_findings_pane_jumps_excludes_and_verifies():
    calls = []
    notes: list[str] = []

    def verify_fn(proposal, progress, cancelled):
        calls.append(proposal.nodes_to_exclude)
        return Verified(proposal.nodes_to_exclude)

    def hook(message):
        if isinstance(message, Notify):
            notes.append(message.notification.message)

    async def main():
        app = QDebugApp(FINDINGS, verify_fn=verify_fn)
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            screen = app.main_screen
            table = screen.query_one(NodeTable)
            pane = screen.query_one(FindingsPanel)
            assert not pane.display and table.current == "layer1/attn/softmax"  # closed: the table as before
            await pilot.press("f")
            await pilot.pause()
            assert pane.display and app.focused is pane.entries and pane.highlighted == 0
            assert pane.entries.option_count == len(FINDINGS.notes)
            await pilot.press("down", "down", "down")  # the collapsed-range note
            assert pane.highlighted == 3
            await pilot.press("enter")
            await pilot.pause()
            assert table.current == "layer1/attn/av_matmul" and screen.selected == "layer1/attn/av_matmul"
            assert app.focused is pane.entries  # the pane keeps the focus: enter again, x, v
            await pilot.press("enter")
            await pilot.pause()
            assert table.current == "layer1/attn/softmax"
            await pilot.press("enter")
            await pilot.pause()
            assert table.current == "layer1/attn/av_matmul"  # round again
            await pilot.press("x")
            await pilot.pause()
            assert set(app.model.excluded) == {"layer1/attn/av_matmul", "layer1/attn/softmax"}
            assert table.get_cell("layer1/attn/av_matmul", "name").style == "bold magenta"
            assert screen.query_one("#exclusions").option_count == 2
            assert "finding 4" in str(screen.query_one("#exclusions").get_option_at_index(0).prompt)
            assert any("v verifies" in n for n in notes)
            await pilot.press("v")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert isinstance(app.screen, TextDialog) and "2 nodes kept in FP32" in app.screen.body
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen) and app.focused is pane.entries
            await pilot.press("space")  # all excluded: included again
            await pilot.pause()
            assert app.model.excluded == ()
            await pilot.press("up", "up", "enter", "x")  # the cache note names nothing
            await pilot.pause()
            assert app.model.excluded == () and table.current == "layer1/attn/av_matmul"
            assert any("finding 2 names no node of the report" in n for n in notes)
            await pilot.press("escape")  # back to the table; the pane stays open
            await pilot.pause()
            assert app.focused is table and pane.display
            await pilot.press("x")  # the table's own x still toggles the row under the cursor
            await pilot.pause()
            assert app.model.excluded == ("layer1/attn/av_matmul",)
            await pilot.press("f")
            await pilot.pause()
            assert not pane.display and app.focused is table
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)

    run(main())
    assert len(calls) == 1 and set(calls[0]) == {"layer1/attn/av_matmul", "layer1/attn/softmax"}


def test_f_without_notes_says_so_and_the_narrow_pane_takes_the_detail_rows():
    notes: list[str] = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append(message.notification.message)

    async def main():
        app = QDebugApp(dataclasses.replace(FINDINGS, notes=()))
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            await pilot.press("f")
            await pilot.pause()
            assert not app.main_screen.query_one(FindingsPanel).display
        app = QDebugApp(FINDINGS)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            right = app.main_screen.query_one("#right")
            assert right.display and right.region.height > 0
            await pilot.press("f")
            await pilot.pause()
            table = app.main_screen.query_one(NodeTable)
            assert app.main_screen.query_one("#right").region.height == 0  # hidden while the pane is open
            assert table.region.height >= 6 and app.main_screen.query_one(FindingsPanel).region.height >= 8
            await pilot.press("f")
            await pilot.pause()
            assert right.region.height > 0

    run(main())
    assert notes == ["the report has no notes"]


def test_snapshot_findings_120x40(snap_compare):
    # f opens the pane, the kernel-gap note (3rd) is picked: the table jumps to layer0/attn/q_proj
    assert snap_compare(QDebugApp(FINDINGS), press=["f", "down", "down", "enter"], terminal_size=SIZE)
