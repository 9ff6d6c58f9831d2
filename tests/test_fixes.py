"""Per-node fixes cheaper than FP32: which apply, what they override, and that ORT builds them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qdebug.cli.main import main
from qdebug.propose.blame import Unit
from qdebug.propose.fixes import CLIP_KEEP, _clipped_range, fix_for
from qdebug.propose.structure import Structure
from qdebug.quantize import QuantSpec, quantize_static_model
from qdebug.records import ErrorStats, Histogram, QuantParams, TensorOverride, TensorRecord, TensorSummary
from qdebug.report_io import load_report
from tests.models import small_cnn, small_data


def _tensor(counts: list[int], lo: float, hi: float) -> TensorRecord:
    inner = np.linspace(lo, hi, len(counts) - 1).tolist()
    edges = (-np.inf, *inner, np.inf)
    stats = ErrorStats(sqnr_db=30.0, mse=1.0, cosine=1.0, max_abs=1.0, kl=0.0, count=sum(counts))
    return TensorRecord(
        name="t",
        producer="p",
        consumers=("c",),
        depth=1,
        summary=TensorSummary(lo, hi, 0.0, 1.0, sum(counts)),
        quant=QuantParams(scale=(hi - lo) / 255, zero_point=128, qtype="uint8"),
        local=stats,
        accumulated=stats,
        histogram=Histogram(tuple(edges), tuple(counts), tuple(counts)),
    )


def test_a_range_set_by_a_few_outliers_is_clipped_to_where_the_values_are():
    counts = [0] * 258
    counts[1] = counts[256] = 1  # one value at each end of a [-100, 100] range
    counts[120:138] = [100_000] * 18  # the rest near 0
    rmin, rmax = _clipped_range(_tensor(counts, -100.0, 100.0))
    assert -100 < rmin < 0 < rmax < 100 and rmax - rmin < 100 / 2
    kept = sum(counts[120:138]) / sum(counts)
    assert kept >= CLIP_KEEP - 1e-4


def test_a_range_the_values_fill_is_not_clipped():
    counts = [0] + [100] * 256 + [0]
    assert _clipped_range(_tensor(counts, -1.0, 1.0)) is None


@pytest.fixture(scope="module")
def cnn_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fixes")
    model, calib = small_cnn(tmp / "m.onnx"), small_data(tmp / "c.npz")
    assert main(["analyze", str(model), "--calib", str(calib), "-o", str(tmp / "r.json"), "-q"]) == 0
    report = load_report(tmp / "r.json")
    normalized = onnx.load(report.normalized_model)
    return report, normalized, Structure(normalized, report.nodes)


def _unit(structure: Structure, node: str) -> Unit:
    return Unit(f"node:{node}", "node", (node,), (), 1.0, node, "test")


def test_per_channel_for_one_conv_overrides_its_weight_on_the_output_channel_axis(cnn_report):
    report, normalized, structure = cnn_report
    conv = next(n for n in normalized.graph.node if n.op_type == "Conv" and n.name in structure.excludable)
    fix = fix_for(_unit(structure, conv.name), "per-channel", structure, report, per_channel=False)
    assert fix is not None and fix.overrides == (TensorOverride(conv.input[1], axis=0),)
    assert fix_for(_unit(structure, conv.name), "per-channel", structure, report, per_channel=True) is None
    # ORT builds it: that Conv's weight has one scale per output channel, the others one scale
    ranges = _ranges(report, normalized)
    model = quantize_static_model(normalized, ranges, QuantSpec(tensor_overrides=fix.overrides))
    scales = _weight_scale_sizes(model)
    assert scales[conv.input[1]] == np.prod(_dims(normalized, conv.input[1])[:1])
    others = {n.input[1] for n in normalized.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")} - {conv.input[1]}
    assert others and all(scales[w] == 1 for w in others if w in scales)


def test_a_weightless_node_has_no_weight_fix(cnn_report):
    report, normalized, structure = cnn_report
    node = next(n for n in normalized.graph.node if n.op_type in ("Relu", "Add", "GlobalAveragePool"))
    for kind in ("per-channel", "reduce-range"):
        assert fix_for(_unit(structure, node.name), kind, structure, report, per_channel=False) is None


def test_reduce_range_is_tried_only_where_analyze_measured_a_kernel_gap(cnn_report):
    report, normalized, structure = cnn_report
    conv = next(n for n in normalized.graph.node if n.op_type == "Conv" and n.name in structure.excludable)
    gaps = [
        t.accumulated_fakequant.sqnr_db - t.accumulated.sqnr_db
        for t in report.tensors
        if t.accumulated is not None and t.accumulated_fakequant is not None
    ]
    fix = fix_for(_unit(structure, conv.name), "reduce-range", structure, report, per_channel=False)
    if all(g <= 3.0 for g in gaps if np.isfinite(g)):
        assert fix is None  # no gap measured on this CPU: no evaluation spent on it
    else:
        assert fix is None or all(o.reduce_range for o in fix.overrides)


def _ranges(report, normalized):
    from qdebug.calibrate import calibrate
    from qdebug.data import model_input_specs, open_data
    from qdebug.files import sha256_file

    data = open_data(report.config.calib, model_input_specs(normalized))
    return calibrate(report.normalized_model, sha256_file(report.normalized_model), data, "minmax")


def _dims(model: onnx.ModelProto, name: str) -> list[int]:
    return list(next(i for i in model.graph.initializer if i.name == name).dims)


def _weight_scale_sizes(model: onnx.ModelProto) -> dict[str, int]:
    """Float weight name -> number of scales its DequantizeLinear carries."""
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in inits and n.input[0].endswith("_quantized"):
            scale = inits[n.input[1]]
            out[n.input[0][: -len("_quantized")]] = int(np.prod(scale.dims)) if scale.dims else 1
    return out
