"""LayerModel behaviour the suite leaves unchecked: sorting by the KL column, the excluded share when a
non-quantizable node is excluded, and the depth profile where several nodes share a depth."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from qdebug.records import NodeRecord
from qdebug.tui.model import LayerModel
from tests.tui_report import make_report

REPORT = make_report()


def _node(name: str, *, kl: float = 0.0, acc: float = 20.0, depth: int = 1, quantized: bool = True) -> NodeRecord:
    return NodeRecord(
        name=name,
        original_name=name,
        op_type="Add",
        inputs=(),
        outputs=(),
        depth=depth,
        quantized=quantized,
        local_sqnr_db=30.0,
        accumulated_sqnr_db=acc,
        introduced_db=1.0,
        kl=kl,
        added_noise_db=-30.0,
    )


def test_sort_by_kl_puts_the_largest_divergence_first():
    nodes = (_node("a", kl=0.1), _node("b", kl=math.nan), _node("c", kl=2.0), _node("d", kl=0.5))
    m = LayerModel(replace(REPORT, nodes=nodes, tensors=()))
    m.set_sort("kl", descending=True)
    assert [n.name for n in m.rows()] == ["c", "d", "a", "b"]
    m.set_sort("kl", descending=False)
    assert [n.name for n in m.rows()] == ["a", "d", "c", "b"]


def test_excluded_share_counts_only_quantizable_nodes():
    m = LayerModel(REPORT)
    assert not REPORT.node("layer0/ln1").quantized  # the report's one node that is not quantized
    m.toggle("layer0/ln1")
    m.toggle("layer1/attn/softmax")
    assert m.excluded_share() == pytest.approx(1 / m.quantizable)


def test_depth_profile_takes_the_worst_node_at_each_depth():
    nodes = (_node("a", acc=30.0, depth=0), _node("b", acc=10.0, depth=0), _node("c", acc=25.0, depth=1))
    m = LayerModel(replace(REPORT, nodes=nodes, tensors=()))
    assert m.depth_profile() == [10.0, 25.0]
