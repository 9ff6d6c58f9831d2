"""Screening on the switchable fake-quant model (``--screen-model``): candidates without a session each.

A candidate of the search is a model re-quantized from the cached ranges; scoring it builds an ORT session
for it, which on a graph of thousands of nodes is most of the candidate's cost (3,200 nodes: 5.3 s a
candidate, 3.0 s through the switchable model, ``docs/benchmarks.md``). :mod:`qdebug.quant.switchable` builds
one model whose every Q/DQ edge a graph input switches on or off; a candidate that only keeps nodes FP32
is then its switches, scored on the one session. Its numbers are fake-quant (float Q/DQ, no integer
kernels), so they screen: static, the answer and every frontier point are scored again on their real
models (:func:`qdebug.propose.screen.confirm_on_all`), and only those numbers are reported.

``auto`` screens this way on graphs of :data:`SWITCH_NODES` nodes or more, where session builds dominate,
unless analyze measured an integer-kernel gap (the fake-quant metric far from the deployed one): there
the fake-quant numbers would rank candidates by a loss the deployed model does not have.
"""

from __future__ import annotations

import math

import onnx

from qdebug.output.formatting import ACCURACY_METRICS
from qdebug.quant.switchable import SwitchScreen, build_switchable
from qdebug.records import Report

MODES = ("auto", "on", "off")
SWITCH_NODES = 1000
"""Nodes from which ``--screen-model auto`` screens on the switchable model."""
GAP_POINTS = 1.0
"""Deployed vs fake-quant metric gap (points for accuracies, the metric's unit otherwise) beyond which
``auto`` does not screen in fake-quant."""


def kernel_gap(report: Report) -> float:
    """How far the fake-quant metric analyze measured is from the deployed one (0 when not measured)."""
    task = report.task
    if task is None or math.isnan(task.quantized_fakequant):
        return 0.0
    # the deployed model on the fake-quant view's own samples where analyze has it: like with like
    deployed = task.quantized if math.isnan(task.quantized_same_samples) else task.quantized_same_samples
    if math.isnan(deployed):
        return 0.0
    scale = 100.0 if task.name in ACCURACY_METRICS else 1.0
    return abs(task.quantized_fakequant - deployed) * scale


def wanted(mode: str, report: Report) -> bool:
    """Whether to screen on the switchable model (``mode``: ``--screen-model``)."""
    if mode == "off":
        return False
    if mode == "on":
        return True
    return len(report.nodes) >= SWITCH_NODES and kernel_gap(report) <= GAP_POINTS


def switch_screen(evaluator, static: onnx.ModelProto, fp32: onnx.ModelProto) -> SwitchScreen | None:
    """``evaluator`` screening through the switchable model of ``static`` (None: nothing to switch)."""
    switchable = build_switchable(static, fp32)
    return None if switchable is None else SwitchScreen(evaluator, switchable)


def switch_note(screen: SwitchScreen) -> str:
    """What the screening did, for the proposal's notes."""
    total = screen.screened + screen.fallbacks
    return (
        f"{screen.screened} of {total} candidate(s) were screened on one switchable fake-quant model (a graph "
        "input keeps each Q/DQ or not: no session per candidate; float Q/DQ, no integer kernels), the "
        f"{screen.fallbacks} other(s) on their own models; static, the answer and the frontier are scored on "
        "their real models (--screen-model off scores every candidate that way)"
    )
