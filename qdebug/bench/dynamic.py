"""A dynamic-quantized variant's per-layer error vs FP32, as an analysis report.

``bench`` writes it for its dynamic variant so that ``qdebug tui`` can show
where dynamic quantization loses accuracy. It belongs with the ``analyze``
command (LAYOUT: ``pipeline.analyze_dynamic``), and lives here until that
module is reorganized.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from qdebug.analysis import measure_layers, node_records, weight_records
from qdebug.graph.match import Pairing
from qdebug.graph.match_dynamic import pair_dynamic
from qdebug.output.files import record_path
from qdebug.output.report_io import save_report
from qdebug.prepare import Prepared, assemble_report, model_info
from qdebug.progress import Progress, no_progress
from qdebug.records import AnalysisConfig, OutputMetric, Report, TaskMetric
from qdebug.runtime.capture import SessionConfig


def dynamic_layer_report(
    prep: Prepared,
    dyn_path: Path,
    out_path: Path,
    config: SessionConfig,
    task: TaskMetric,
    outputs: tuple[OutputMetric, ...],
    progress: Progress = no_progress,
) -> Report:
    """Per-layer accumulated error of the dynamic model vs FP32, as an analysis :class:`Report`.

    Streams the calibration data (like ``analyze``) through the instrumented
    FP32 and dynamic models; writes the report to ``out_path`` (``qdebug tui``
    opens it) and returns it.
    """
    dyn = onnx.load(str(dyn_path))
    pairing, quantized = pair_dynamic(prep.normalized, dyn)
    ranges = prep.ranges.minmax() if prep.ranges is not None else {}
    # a dynamic model has no Q/DQ pairs: there is no fake-quant view to run
    layers = measure_layers(
        prep.normalized, dyn, pairing, prep.calib, config, ranges, progress, fakequant_samples=0
    )
    nodes = node_records(prep.normalized, layers.tensors, quantized, prep.name_map)
    report = assemble_report(
        prep,
        model_info(dyn_path, dyn),
        layers,
        nodes,
        weight_records(prep.normalized, dyn, pairing),
        outputs,
        task,
        AnalysisConfig(method="dynamic", calib=record_path(prep.calib.source)),
        _notes(prep, pairing),
    )
    save_report(report, out_path)
    return report


def _notes(prep: Prepared, pairing: Pairing) -> tuple[str, ...]:
    """The preparation's notes, then what a dynamic model's report cannot show and what did not pair."""
    notes = list(prep.notes) + [
        "dynamic quantization: activations are quantized per batch at run time, so there is no fixed "
        "Q/DQ pair per tensor: only the accumulated error (FP32 vs dynamic model) is measured, "
        "paired by graph position",
    ]
    if pairing.unmatched:
        notes.append(f"{len(pairing.unmatched)} FP32 node(s) have no counterpart in the dynamic model")
    return tuple(notes)
