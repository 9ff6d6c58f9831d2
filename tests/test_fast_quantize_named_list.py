"""Contracts of fast_quantize.NamedList (ORT's ``new_nodes`` indexed by name): every list change
that moves or replaces elements, followed by appends, still gives ORT's ``find_by_name`` answer, and a
lookup after the first reads only the names appended since (the point of the index)."""

from __future__ import annotations

import onnx
import pytest
from onnxruntime.quantization import quant_utils

from qdebug.quant import fast_quantize
from tests.verified_ort import verified_sources

pytestmark = verified_sources  # ORT's own code, as verified: skipped on other releases


def _node(name: str) -> onnx.NodeProto:
    return onnx.helper.make_node("Relu", ["a"], [f"{name}.out"], name=name)


def _filled(names: str) -> fast_quantize.NamedList:
    nodes = fast_quantize.NamedList(_node(n) for n in names)
    assert fast_quantize.find_by_name(names[0], nodes) is nodes[0]  # the index is built
    return nodes


def _agrees(nodes: fast_quantize.NamedList, asked: str) -> None:
    plain = list(nodes)
    for name in asked:
        assert fast_quantize.find_by_name(name, nodes) is quant_utils.find_by_name(name, plain), name


CHANGES = {
    "pop then append": lambda nodes: (nodes.pop(0), nodes.append(_node("x"))),
    "pop from the end then append": lambda nodes: (nodes.pop(), nodes.append(_node("x"))),
    "set an item": lambda nodes: nodes.__setitem__(0, _node("x")),
    "set a slice of the same length": lambda nodes: nodes.__setitem__(slice(0, 2), [_node("x"), _node("y")]),
    "insert at the front": lambda nodes: nodes.insert(0, _node("x")),
    "delete then append": lambda nodes: (nodes.__delitem__(1), nodes.append(_node("x"))),
    "remove then append": lambda nodes: (nodes.remove(nodes[0]), nodes.append(_node("x"))),
    "sort": lambda nodes: nodes.sort(key=lambda n: n.name, reverse=True),
    "reverse": lambda nodes: nodes.reverse(),
    "clear then extend": lambda nodes: (nodes.clear(), nodes.extend([_node("c"), _node("x")])),
    "repeat in place": lambda nodes: nodes.__imul__(2),
    "reassigned wholesale": lambda nodes: nodes.__setitem__(slice(None), [_node(n) for n in "xcba"]),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_lookups_after_any_change_are_orts_first_match(change):
    nodes = _filled("abcab")
    CHANGES[change](nodes)
    _agrees(nodes, "xyzabc")  # the new names first: a stale hit on an old one rebuilds the index
    nodes.append(_node("z"))
    nodes += [_node("x")]
    _agrees(nodes, "xyzabc")  # the new names first: a stale hit on an old one rebuilds the index


def test_an_indexed_quantizer_keeps_new_nodes_a_named_list_when_reassigned():
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer

    cls = fast_quantize.indexed(ONNXQuantizer)
    quantizer = cls.__new__(cls)
    quantizer.new_nodes = [_node("a")]
    assert type(quantizer.new_nodes) is fast_quantize.NamedList
    assert fast_quantize.find_by_name("a", quantizer.new_nodes) is quantizer.new_nodes[0]
    quantizer.new_nodes = quantizer.new_nodes + [_node("b")]  # list + list: a plain list, wrapped again
    assert type(quantizer.new_nodes) is fast_quantize.NamedList
    assert fast_quantize.find_by_name("b", quantizer.new_nodes).name == "b"


class _Counted:
    """A node whose name reads are counted."""

    reads = 0

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        _Counted.reads += 1
        return self._name


def test_a_lookup_reads_only_the_names_appended_since_the_last():
    nodes = fast_quantize.NamedList(_Counted(f"n{k}") for k in range(1000))
    assert nodes.first_named("n500").name == "n500"
    _Counted.reads = 0
    for k in range(50):
        nodes.append(_Counted(f"m{k}"))
        assert nodes.first_named(f"missing{k}") is None
        assert nodes.first_named(f"m{k}") is nodes[-1]
    assert _Counted.reads <= 50 * 3, _Counted.reads  # the new name, and a found item's check; never a rescan
