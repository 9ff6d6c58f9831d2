"""Which of the report's nodes and tensors a note names: plain Python, no Textual.

The notes are prose; this finds the report's own names in them (longest first, on word boundaries, a
name that is also a word of the prose only where the note quotes it), so the findings pane can link each
note to what it is about.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from qdebug.records import NodeRecord, Report

PROSE_WORDS: frozenset[str] = frozenset(
    """a an and are as at by data float for from in input inputs is it its keep mask model node nodes of on one
    or output outputs range ranges scale scales tensor tensors the to value values weight weights with""".split()
)
"""Words of the notes' prose that are also plausible names (a graph input called ``input``): such a name links
only where the note quotes it (``'output'``), or "graph input" in any note had named the tensor ``input``."""


_NAME_PUNCT = "/.:-"
"""Punctuation names are made of (``layer0/attn``, ``conv.weight``, ``input:0``): a match next to it is part of a
longer name, unless it ends the sentence (``keep head/concat.``, ``masked: 58% ...``, ``b...)``)."""


_QUOTES = "'\"`"


def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


def _quoted(text: str, start: int, end: int) -> bool:
    return 0 < start and end < len(text) and text[start - 1] in _QUOTES and text[end] == text[start - 1]


_WORD = re.compile(r"\w+")


class NameMatcher:
    """Known names, indexed for finding them in many notes (:func:`match_names`).

    A name found on word boundaries has each of its word runs (letters, digits, ``_``) as a whole word of the
    text: the names worth searching for are those whose longest run is a word of the text, which keeps a
    note's search to a few names in a 5,000-node report (trying every name took 0.7 s for 10 notes).
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._by_word: dict[str, list[str]] = {}
        self._wordless: list[str] = []
        for name in set(names):
            runs = _WORD.findall(name)
            if runs:
                self._by_word.setdefault(max(runs, key=len), []).append(name)
            elif name:
                self._wordless.append(name)

    def match(self, text: str) -> tuple[tuple[int, int, str], ...]:
        """:func:`match_names` of ``text`` and these names."""
        candidates = [n for w in set(_WORD.findall(text)) for n in self._by_word.get(w, ())]
        candidates += [n for n in self._wordless if n in text]
        taken = bytearray(len(text))
        found: list[tuple[int, int, str]] = []
        for name in sorted(candidates, key=lambda n: (-len(n), n)):
            prose = name.lower() in PROSE_WORDS
            start = text.find(name)
            while start >= 0:
                end = start + len(name)
                free = not any(taken[start:end])
                if free and _bounded(text, start, end) and (not prose or _quoted(text, start, end)):
                    taken[start:end] = b"\x01" * len(name)
                    found.append((start, end, name))
                start = text.find(name, start + 1)
        return tuple(sorted(found))


def match_names(text: str, names: Iterable[str]) -> tuple[tuple[int, int, str], ...]:
    """Where the known ``names`` occur in ``text``, as ``(start, end, name)`` in text order.

    A note is prose, not a grammar: this finds the report's own names in it, exactly (case-sensitive).
    Longest names first, and a character claimed by a longer name is not matched again, so the node
    ``layer0/attn/q_proj`` is not found inside the tensor ``layer0/attn/q_proj_out``. Each occurrence must
    stand on word boundaries (:func:`_bounded`): ``conv1`` is not in ``conv10`` nor in ``block/conv1``,
    ``x`` not in ``342x``; sentence punctuation after a name does not hide it. A name that is also a word of
    the prose (:data:`PROSE_WORDS`) counts only where quoted. Many notes: :class:`NameMatcher`.
    """
    return NameMatcher(names).match(text)


@dataclass(frozen=True)
class Mention:
    """One place where a note names a node or a tensor of the report."""

    start: int
    end: int
    """``text[start:end]`` is the name as the note writes it (a node's original name maps to the node)."""
    name: str
    """The node's name in the report (normalized), or the tensor's or weight's."""
    kind: str
    """``node``, ``tensor`` or ``weight``."""


@dataclass(frozen=True)
class Finding:
    """One note of the report with the report's nodes and tensors it names (the findings pane, ``f``)."""

    index: int
    """Position in ``Report.notes``; the pane numbers findings from 1."""
    text: str
    mentions: tuple[Mention, ...]
    """The names found in ``text``, in text order (:func:`match_names`)."""
    nodes: tuple[str, ...]
    """Nodes the note names, in order of first mention: the ones its advice is about."""
    tensors: tuple[str, ...]
    """Tensors and weights it names, in order of first mention."""
    linked: tuple[str, ...]
    """The nodes enter jumps to, one per press: those named, then the producers of the named tensors (and the
    nodes reading the named weights)."""
    targets: tuple[str, ...]
    """The nodes ``x`` excludes: the excludable ones among those named, or, when the note names no node, among
    the producers of its tensors (``keep its producer FP32``). Empty: the note advises nothing to exclude."""


def note_findings(report: Report) -> tuple[Finding, ...]:
    """Every note of ``report`` as a :class:`Finding`, in the report's order (notes naming nothing too)."""
    kinds: dict[str, tuple[str, str]] = {}
    """Name as a note may write it -> (kind, name in the report); a node's own name wins over a tensor's."""
    producer: dict[str, str] = {}
    for w in report.weights:
        kinds[w.name] = ("weight", w.name)
    for t in report.tensors:
        kinds[t.name] = ("tensor", t.name)
    for n in report.nodes:
        for out in n.outputs:
            if out:
                producer[out] = n.name
                kinds.setdefault(out, ("tensor", out))
    for n in report.nodes:
        if n.original_name and n.original_name not in kinds:
            kinds[n.original_name] = ("node", n.name)
    for n in report.nodes:
        kinds[n.name] = ("node", n.name)
    reader = {w.name: w.node for w in report.weights}
    by_name = {n.name: n for n in report.nodes}
    matcher = NameMatcher(kinds)
    findings = []
    for index, text in enumerate(report.notes):
        mentions = tuple(Mention(s, e, kinds[name][1], kinds[name][0]) for s, e, name in matcher.match(text))
        nodes = tuple(dict.fromkeys(m.name for m in mentions if m.kind == "node"))
        tensors = tuple(dict.fromkeys(m.name for m in mentions if m.kind != "node"))
        via = [reader.get(t) if kinds[t][0] == "weight" else producer.get(t) for t in tensors]
        via_nodes = tuple(dict.fromkeys(n for n in via if n is not None and n in by_name))
        linked = tuple(dict.fromkeys(nodes + via_nodes))
        targets = tuple(n for n in (nodes or via_nodes) if is_excludable(by_name[n]))
        findings.append(Finding(index, text, mentions, nodes, tensors, linked, targets))
    return tuple(findings)


def _bounded(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` stands alone: no name character before it, and after it either none or
    only punctuation that ends the sentence (a run of ``/.:-`` not followed by a letter, digit or ``_``)."""
    if start > 0 and (_word_char(text[start - 1]) or text[start - 1] in _NAME_PUNCT):
        return False
    after = end
    while after < len(text) and text[after] in _NAME_PUNCT:
        after += 1
    return after == len(text) or not _word_char(text[after])


def is_excludable(node: NodeRecord) -> bool:
    return node.excludable if node.excludable is not None else node.quantized
