"""Per-node fixes cheaper than FP32: which apply, what they override, and that ORT builds them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from qdebug.cli.main import main
from qdebug.output.report_io import load_report
from qdebug.propose.blame import Unit
from qdebug.propose.fixes import CLIP_KEEP, _clipped_range, fix_for
from qdebug.propose.structure import Structure
from qdebug.quant.quantize import QuantSpec, quantize_static_model
from qdebug.records import ErrorStats, Histogram, QuantParams, TensorOverride, TensorRecord, TensorSummary
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
    from qdebug.data import model_input_specs, open_data
    from qdebug.output.files import sha256_file
    from qdebug.quant.calibrate import calibrate

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


def _with_gaps(report, normalized, nodes, gap_db: float):
    """``report`` with the fake-quant view ``gap_db`` above the deployed kernels where ``nodes``' kernels write:
    each node's output, or the activation ORT folded into it (conv1's Relu); no gap anywhere else."""
    import dataclasses

    recorded = {t.name for t in report.tensors if t.accumulated is not None}
    written = set()
    for node in nodes:
        out = node.output[0]
        written.add(out if out in recorded else next(n for n in normalized.graph.node if out in n.input).output[0])
    tensors = tuple(
        dataclasses.replace(
            t, accumulated_fakequant=dataclasses.replace(t.accumulated, sqnr_db=t.accumulated.sqnr_db + gap_db)
        )
        if t.name in written
        else dataclasses.replace(t, accumulated_fakequant=t.accumulated)
        for t in report.tensors
    )
    return dataclasses.replace(report, tensors=tensors, kernel_gap_nodes=None)  # as a report from before the field


def test_seven_bit_weights_for_the_whole_model_where_the_kernels_lose_at_several_nodes(cnn_report):
    """Tried where the gap *opens* at two weighted nodes or more (conv1 through its folded Relu, and fc), not
    where one node's gap is inherited downstream (conv2 reads conv1's)."""
    import dataclasses

    from qdebug.propose.fixes import WHOLE_GAP_NODES, whole_reduce_range

    report, normalized, structure = cnn_report
    graph = structure.graph
    weighted = [n for n in normalized.graph.node if n.name in graph and graph.nodes[n.name]["weighted"]]
    assert [n.name for n in weighted] == ["conv1", "conv2", "fc"] and WHOLE_GAP_NODES == 2
    conv1, conv2, fc = weighted
    assert whole_reduce_range(structure, _with_gaps(report, normalized, weighted, 0.0)) is None  # no gap
    assert whole_reduce_range(structure, _with_gaps(report, normalized, [conv1], 10.0)) is None  # one node's
    # conv2 right after conv1: its gap is conv1's, inherited -- still one node where it opens
    assert whole_reduce_range(structure, _with_gaps(report, normalized, [conv1, conv2], 10.0)) is None
    fix = whole_reduce_range(structure, _with_gaps(report, normalized, [conv1, fc], 10.0))
    assert fix is not None and fix.kind == "reduce-range" and fix.unit.nodes == ()  # a whole-model fix
    weights = {n.input[1] for n in weighted}
    assert {o.tensor for o in fix.overrides} == weights and all(o.reduce_range for o in fix.overrides)
    assert "the gap opening at 2 weighted node(s) (conv1, fc)" in fix.why
    # already 7-bit (or U8U8 weights, which do not saturate): nothing to try
    for change in ({"reduce_range": True}, {"weight_type": "QUInt8"}):
        settings = dataclasses.replace(report.config.quant, **change)
        config = dataclasses.replace(report.config, quant_settings=settings)
        gapped = _with_gaps(dataclasses.replace(report, config=config), normalized, [conv1, fc], 10.0)
        assert whole_reduce_range(structure, gapped) is None, change
    # ORT builds it: every weight 7-bit (ORT's reduced int8 range, [-64, 64]), where static's reach past it
    ranges = _ranges(report, normalized)
    static = _int8_weights(quantize_static_model(normalized, ranges, QuantSpec()), weights)
    seven = _int8_weights(quantize_static_model(normalized, ranges, QuantSpec(tensor_overrides=fix.overrides)), weights)
    assert set(seven) == set(static) == weights
    assert all(v.min() >= -64 and v.max() <= 64 for v in seven.values())
    assert all(v.min() < -64 or v.max() > 64 for v in static.values())


def test_the_whole_model_fix_counts_the_nodes_analyzes_note_named(cnn_report):
    """The fix reads the report's kernel_gap_nodes -- where analyze's note found the gap opening, over the
    samples the fake-quant view saw -- and not the full run's deployed error, which can open the gap
    elsewhere when the view saw only the first samples."""
    import dataclasses

    from qdebug.propose.fixes import whole_reduce_range

    report, normalized, structure = cnn_report
    assert report.kernel_gap_nodes == ()  # analyze wrote the field: no gap on this fixture
    conv1, _, fc = [n for n in normalized.graph.node if n.name in ("conv1", "conv2", "fc")]
    full_run = _with_gaps(report, normalized, [conv1, fc], 10.0)  # two openings on the full run
    assert whole_reduce_range(structure, full_run) is not None
    assert whole_reduce_range(structure, dataclasses.replace(full_run, kernel_gap_nodes=("conv1",))) is None
    named = dataclasses.replace(report, kernel_gap_nodes=("fc", "conv1", "relu1"))  # the note named these
    fix = whole_reduce_range(structure, named)
    assert fix is not None and "at 2 weighted node(s) (fc, conv1)" in fix.why


def _int8_weights(model: onnx.ModelProto, weights: set[str]) -> dict[str, np.ndarray]:
    """The quantized int8 initializer of each of ``weights`` (found through its DequantizeLinear)."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits and node.output[0].startswith(tuple(weights)):
            weight = next(w for w in weights if node.output[0].startswith(w))
            out[weight] = onnx.numpy_helper.to_array(inits[node.input[0]])
    return out
