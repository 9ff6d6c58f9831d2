"""The terminal UI: view model (plain Python), Pilot behaviour and SVG snapshots.

Everything runs from the synthetic report in ``tui_report.py``; no model is run.
"""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from qdebug.bench import (
    BENCH_SCHEMA_VERSION,
    BenchReport,
    LatencyStats,
    MachineInfo,
    VariantResult,
    WorstLayer,
)
from qdebug.errors import QDebugError
from qdebug.output.files import atomic_write_text
from qdebug.output.report_io import dumps, load_record, save_report
from qdebug.records import KERNEL_GAP_DB, SCHEMA_VERSION, NodeRecord, Proposal, TensorOverride
from qdebug.tui import benchview, charts
from qdebug.tui.model import (
    CELL_TEXT,
    COLUMNS,
    HAND_REASON,
    LayerModel,
    column,
    fmt_db,
    fmt_metric,
    fmt_small,
    fuzzy_score,
    middle_ellipsis,
    short_op,
    table_layout,
)
from tests.tui_report import added_noise_db, make_large_report, make_proposal, make_report

REPORT = make_report()
ROOT = Path(__file__).resolve().parent.parent


def _node(
    name: str,
    introduced: float,
    local: float = 30.0,
    acc: float = 20.0,
    kl: float = 0.0,
    added: float = math.nan,
) -> NodeRecord:
    return NodeRecord(
        name=name,
        original_name=name,
        op_type="Add",
        inputs=(),
        outputs=(),
        depth=1,
        quantized=True,
        local_sqnr_db=local,
        accumulated_sqnr_db=acc,
        introduced_db=introduced,
        kl=kl,
        added_noise_db=added,
    )


def _latency(p50: float, p95: float, batch: int = 32, batches: int = 75) -> LatencyStats:
    mean, lo, p99, hi = p50 * 1.02, p50 * 0.9, p95 * 1.1, p95 * 1.2
    return LatencyStats(batch, batches, p50, p95, p99, mean, lo, hi, batch * 1e3 / p50)


def make_bench(sha256: str | None = None) -> BenchReport:
    """A bench result for the TUI report's model, as ``qdebug bench`` writes it (numbers made up)."""
    machine = MachineInfo(
        cpu_model="AMD EPYC 7B13",
        arch="x86_64",
        logical_cpus=4,
        cpus_available=2,
        int8_flags=("avx2",),
        os="Linux",
        python="3.12",
        ort_version="1.32.0",
        providers=("CPUExecutionProvider",),
        threads=0,
        warning="this CPU has no VNNI/AMX (only AVX2): INT8 variants are often no faster than FP32",
    )
    variants = (
        VariantResult(
            "fp32",
            "fp32",
            model_bytes=1_800_000,
            full=_latency(0.841, 0.900),
            tail=_latency(0.6, 0.7, 20, 5),
            speedup=1.0,
            peak_rss_mb=80.2,
            metric_value=0.98,
            output_sqnr_db=math.inf,
        ),
        VariantResult(
            "dynamic",
            "dynamic",
            quant_format="dynamic",
            model_bytes=500_000,
            full=_latency(0.765, 0.800),
            speedup=0.841 / 0.765,
            peak_rss_mb=82.0,
            metric_value=0.98,
            output_sqnr_db=31.2,
            worst_layers=(WorstLayer("layer1/attn/softmax", "Softmax", 3.0, 19.5, -12.0),),
        ),
        VariantResult(
            "static",
            "static",
            method="minmax",
            quant_format="QDQ",
            model_bytes=520_000,
            full=_latency(0.739, 0.790),
            speedup=0.841 / 0.739,
            peak_rss_mb=81.0,
            metric_value=0.836,
            output_sqnr_db=13.5,
        ),
        VariantResult(
            "selective",
            "selective",
            method="minmax",
            quant_format="QDQ",
            model_bytes=700_000,
            excluded_nodes=2,
            full=_latency(0.774, 0.810),
            speedup=0.841 / 0.774,
            peak_rss_mb=81.0,
            metric_value=0.976,
            output_sqnr_db=25.0,
        ),
        VariantResult("qoperator", "qoperator", error="ORT refused the model: QLinearMatMul not implemented"),
    )
    return BenchReport(
        schema_version=BENCH_SCHEMA_VERSION,
        kind="bench",
        qdebug_version="0",
        created="2025-01-01T00:00:00+00:00",
        model=REPORT.model.path,
        model_sha256=REPORT.model.sha256 if sha256 is None else sha256,
        normalized_model="bench_files/normalized.onnx",
        calib="data/calib.npz",
        eval="data/eval.npz",
        metric="top1",
        samples=500,
        batch_size=32,
        runs=5,
        warmup=3,
        machine=machine,
        variants=variants,
        proposal="proposal.json",
    )


def write_bench(path: Path, bench: BenchReport) -> Path:
    atomic_write_text(path, dumps(bench))
    return path


# =========================================================================== model


def test_model_and_charts_do_not_import_textual_and_the_app_not_onnxruntime():
    code = (
        "import sys; import qdebug.records, qdebug.output.report_io, qdebug.output.files, qdebug.output.snippet, "
        "qdebug.progress, qdebug.output.formatting, qdebug.records.verify; "  # the light layer the TUI is built on
        "bad = [m for m in ('textual', 'onnxruntime', 'onnx') if m in sys.modules]; "
        "import qdebug.tui, qdebug.tui.model, qdebug.tui.charts, qdebug.tui.benchview; "
        "bad += [m for m in ('textual', 'onnxruntime', 'onnx') if m in sys.modules]; "
        "import qdebug.tui.app, qdebug.records.bench, qdebug.cli.tui; "  # the bench records load without ORT
        "bad += [m for m in ('onnxruntime', 'onnx') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kernel_gap_threshold_is_the_analysis_one():
    import qdebug.analysis
    import qdebug.records

    assert KERNEL_GAP_DB is qdebug.records.KERNEL_GAP_DB is qdebug.analysis.KERNEL_GAP_DB


def test_default_sort_is_added_noise_descending_with_nonfinite_last():
    m = LayerModel(REPORT)
    assert (m.sort_key, m.descending) == ("added", True)
    rows = m.rows()
    assert len(rows) == len(REPORT.nodes) == 32
    # ranked by the noise added, not by the SQNR ratio: layer0's softmax introduces the most dB
    # (its input is still clean) but adds less noise than layer1's softmax and GELU
    assert [n.name for n in rows[:4]] == [
        "layer1/attn/softmax",
        "layer1/mlp/gelu/erf",
        "layer1/attn/qk_matmul",
        "layer0/attn/softmax",
    ]
    assert max(
        REPORT.nodes, key=lambda n: n.introduced_db if math.isfinite(n.introduced_db) else -1
    ).name == ("layer0/attn/softmax")
    values = [n.added_noise_db for n in rows]
    finite = [v for v in values if math.isfinite(v)]
    assert finite == sorted(finite, reverse=True)
    assert values[: len(finite)] == finite  # numbers first
    assert values[-1] == -math.inf and rows[-1].name == "layer0/ln1"  # adds nothing: last


def test_synthetic_added_noise_follows_from_the_sqnrs():
    by_tensor = {t.name: t for t in REPORT.tensors}
    for n in REPORT.nodes:
        acts = [i for i in n.inputs if i in by_tensor and by_tensor[i].accumulated is not None]
        worst_in = min(by_tensor[i].accumulated.sqnr_db for i in acts)
        expected = added_noise_db(worst_in, n.accumulated_sqnr_db)
        assert n.added_noise_db == pytest.approx(expected) or n.added_noise_db == expected == -math.inf
        # additive: a node that only passes its input on adds nothing
        nsr_in, nsr_out = 10 ** (-worst_in / 10), 10 ** (-n.accumulated_sqnr_db / 10)
        assert 10 ** (n.added_noise_db / 10) == pytest.approx(nsr_out - nsr_in, abs=1e-12)
    assert added_noise_db(math.nan, 10.0) != added_noise_db(math.nan, 10.0)  # nan: unknown


def test_numeric_sort_directions_and_edge_values():
    nodes = (
        _node("a", 1.0),
        _node("b", math.nan),
        _node("c", math.inf),
        _node("d", 5.0),
        _node("e", -math.inf),
        _node("f", 5.0),
    )
    m = LayerModel(replace(REPORT, nodes=nodes, tensors=()))
    m.set_sort("introduced")
    assert m.descending
    assert [n.name for n in m.rows()] == ["d", "f", "a", "c", "e", "b"]  # ties keep graph order
    m.set_sort("introduced")  # same column again: reverse
    assert not m.descending
    assert [n.name for n in m.rows()] == ["a", "d", "f", "e", "c", "b"]  # nan stays last


def test_added_noise_sort_puts_nodes_adding_nothing_and_unknown_last():
    nodes = (
        _node("none", 0.0, added=-math.inf),
        _node("unknown", 0.0, added=math.nan),
        _node("small", 0.2, added=-40.0),
        _node("big", 0.1, added=-8.0),
    )
    m = LayerModel(replace(REPORT, nodes=nodes, tensors=()))
    assert [n.name for n in m.rows()] == ["big", "small", "none", "unknown"]
    m.set_sort("added")  # reversed: still numbers first
    assert [n.name for n in m.rows()] == ["small", "big", "none", "unknown"]


def test_set_sort_defaults_and_cycle():
    m = LayerModel(REPORT)
    m.set_sort("local")
    assert (m.sort_key, m.descending) == ("local", False)  # worst (lowest SQNR) first
    assert m.rows()[0].name == "layer1/attn/softmax"
    assert math.isnan(m.rows()[-1].local_sqnr_db)
    m.set_sort("name")
    assert [n.name for n in m.rows()] == sorted((n.name for n in REPORT.nodes), key=str.lower)
    assert m.cycle_sort() == "op"
    m.set_sort("excluded")
    m.toggle("layer1/mlp/fc2")
    assert m.rows()[0].name == "layer1/mlp/fc2"
    assert m.rows()[1].name == "layer1/attn/softmax"  # the rest in the default order


def test_fuzzy_score():
    assert fuzzy_score("", "anything") == 0
    assert fuzzy_score("qkmm", "layer0/attn/qk_matmul") is not None
    assert fuzzy_score("QK", "layer0/attn/qk_matmul") is not None  # case-insensitive
    assert fuzzy_score("mmqk", "layer0/attn/qk_matmul") is None  # order matters
    assert fuzzy_score("l1 soft", "layer1/attn/softmax") is not None  # all terms must match
    assert fuzzy_score("l1 soft", "layer0/mlp/fc1") is None
    assert fuzzy_score("softmax", "x/softmax") > fuzzy_score("sfx", "x/softmax")  # substring wins


def test_filters():
    m = LayerModel(REPORT)
    m.name_query = "softmax"
    assert [n.name for n in m.rows()] == ["layer1/attn/softmax", "layer0/attn/softmax"]
    m.name_query = "l1 gelu"
    assert {n.name for n in m.rows()} == {"layer1/mlp/gelu/erf", "layer1/mlp/gelu/mul"}
    m.name_query = ""
    m.op_filter = "Erf"
    assert [n.op_type for n in m.rows()] == ["Erf", "Erf"]
    m.name_query = "layer1"
    assert [n.name for n in m.rows()] == ["layer1/mlp/gelu/erf"]
    m.clear_filters()
    assert len(m.rows()) == 32


def test_cycle_op_filter_goes_round():
    m = LayerModel(REPORT)
    ops = m.op_types()
    assert ops == ("Add", "Erf", "LayerNormalization", "MatMul", "Mul", "Softmax")
    seen = [m.cycle_op_filter() for _ in range(len(ops) + 1)]
    assert seen == [*ops, None]


def test_neighbours():
    m = LayerModel(REPORT)
    assert [n.name for n in m.predecessors("layer0/attn/qk_matmul")] == [
        "layer0/attn/q_proj",
        "layer0/attn/k_proj",
    ]
    assert [n.name for n in m.successors("layer0/ln1")] == [
        "layer0/attn/q_proj",
        "layer0/attn/k_proj",
        "layer0/attn/v_proj",
    ]
    assert m.predecessors("layer0/ln1") == ()  # graph input + weights only
    assert m.successors("head/matmul") == ()  # graph output
    # residual Add: the graph input has no producer, the branch has one
    assert [n.name for n in m.predecessors("layer0/residual1")] == ["layer0/attn/out_proj"]
    worst = m.worst(m.predecessors("layer1/attn/av_matmul"))
    assert worst is not None and worst.name == "layer1/attn/softmax"
    assert m.worst([]) is None


def test_exclusion_set_and_share():
    m = LayerModel(REPORT)
    assert m.quantizable == 31  # layer0/ln1 is not quantized
    assert m.excluded == ()
    assert m.toggle("layer1/mlp/gelu/erf") is True
    assert m.toggle("layer1/attn/softmax") is True
    assert m.excluded == ("layer1/attn/softmax", "layer1/mlp/gelu/erf")  # table order
    assert m.excluded_share() == pytest.approx(2 / 31)
    assert m.toggle("layer1/attn/softmax") is False
    assert m.excluded == ("layer1/mlp/gelu/erf",)
    with pytest.raises(KeyError):
        m.toggle("no/such/node")


def test_proposal_sets_initial_exclusions_and_reasons():
    p = make_proposal(REPORT)
    p = replace(p, nodes_to_exclude=(*p.nodes_to_exclude, "ghost/node"))
    m = LayerModel(REPORT, p)
    assert set(m.excluded) == {"layer1/attn/softmax", "layer1/mlp/gelu/erf"}
    assert m.unknown_proposal_nodes == ("ghost/node",)
    assert m.reason("layer1/attn/softmax").reason.startswith("introduces")
    m.toggle("layer0/attn/softmax")
    assert m.reason("layer0/attn/softmax").reason.startswith(HAND_REASON)
    assert not m.sha_mismatch
    assert LayerModel(REPORT, replace(p, model_sha256="00" * 32)).sha_mismatch


def test_to_proposal_fields_and_snippet():
    m = LayerModel(REPORT)
    m.toggle("layer0/attn/softmax")
    m.toggle("layer1/mlp/gelu/erf")
    p = m.to_proposal()
    assert p.schema_version == SCHEMA_VERSION and p.kind == "proposal" and p.source == "tui"
    assert p.model_path == REPORT.model.path and p.model_sha256 == REPORT.model.sha256
    assert p.normalized_model == REPORT.normalized_model
    assert p.nodes_to_exclude == ("layer1/mlp/gelu/erf", "layer0/attn/softmax")  # table order
    assert [r.node for r in p.reasons] == list(p.nodes_to_exclude)
    r = p.reasons[1]
    assert r.action == "fp32" and HAND_REASON in r.reason
    assert "added noise -24.2 dB" in r.reason and "introduced 6.6 dB" in r.reason
    assert r.introduced_db == REPORT.node("layer0/attn/softmax").introduced_db
    assert p.per_channel is True and p.quantizable_nodes == 31
    assert (p.metric, p.fp32_metric, p.static_metric) == ("top1", 0.9125, 0.8610)
    compile(p.snippet, "<snippet>", "exec")  # valid Python
    for part in (
        "quantize_static(",
        "quant_format=QuantFormat.QDQ",
        "activation_type=QuantType.QUInt8",
        "weight_type=QuantType.QInt8",
        "per_channel=True",
        "calibrate_method=CalibrationMethod.MinMax",
        "'layer0/attn/softmax',",
        repr(REPORT.model.path),  # propose's choice: the user's model, as no excluded node was renamed
    ):
        assert part in p.snippet


def test_the_snippet_is_the_one_propose_writes():
    """The TUI had its own snippet: data_reader left to the user, always the normalized model. Its export
    now carries snippet.quantize_snippet's, from what the report records: a reader for the calibration
    data (input names, sample limit) and the user's model unless an excluded node was renamed."""
    from qdebug.output.snippet import quantize_snippet

    overrides = (TensorOverride("layer0/attn/softmax_out", "QUInt16"),)
    m = LayerModel(REPORT, replace(make_proposal(REPORT), tensor_overrides=overrides))
    m.toggle("layer0/attn/softmax")
    p = m.to_proposal()
    cfg = REPORT.config

    def expected(model_path: str) -> str:
        return quantize_snippet(
            model_path,
            p.nodes_to_exclude,
            method=cfg.method,
            per_channel=p.per_channel,
            activation_type=cfg.activation_type,
            weight_type=cfg.weight_type,
            tensor_overrides=overrides,
            calib_hint=cfg.calib,
            batch=1,
            max_samples=cfg.max_samples,
            inputs=REPORT.model.inputs,
        )

    assert p.snippet == expected(REPORT.model.path)
    assert f"Reader({cfg.calib!r}, batch=1, max_samples={cfg.max_samples!r})" in p.snippet
    renamed = replace(REPORT, name_map=(("layer0/attn/softmax", ""),))  # a node normalization had to name
    m2 = LayerModel(renamed, replace(make_proposal(renamed), tensor_overrides=overrides))
    m2.toggle("layer0/attn/softmax")
    assert m2.to_proposal().snippet == expected(REPORT.normalized_model)


def test_to_proposal_round_trips_through_json(tmp_path):
    m = LayerModel(REPORT, make_proposal(REPORT))
    p = m.to_proposal()
    path = tmp_path / "p.json"
    atomic_write_text(path, dumps(p))
    assert dumps(load_record(Proposal, path, "proposal")) == dumps(p)  # (nan != nan, compare as JSON)


def test_depth_profile():
    m = LayerModel(REPORT)
    prof = m.depth_profile()
    assert len(prof) == max(n.depth for n in REPORT.nodes) + 1
    assert all(math.isfinite(v) for v in prof)
    assert prof[-1] == pytest.approx(REPORT.node("head/matmul").accumulated_sqnr_db)
    assert prof[0] == max(prof)  # depth 0 has no node: the best value


def test_formatting():
    assert (fmt_db(math.inf), fmt_db(-math.inf), fmt_db(math.nan), fmt_db(3.14159)) == (
        "+inf",
        "-inf",
        "nan",
        "3.1",
    )
    assert (fmt_db(-0.04), fmt_db(-0.05), fmt_db(-36.0)) == ("0.0", "-0.1", "-36.0")
    assert [fmt_small(x) for x in (0.0, 0.0337, 1.436, 0.00598, 1.08e-7, 2.5e4, math.nan)] == [
        "0",
        "0.0337",
        "1.44",
        "6.0e-3",
        "1.1e-7",
        "2.5e4",
        "nan",
    ]
    assert (fmt_metric("top1", 0.9125), fmt_metric("loss", 0.123456), fmt_metric("top1", math.nan)) == (
        "91.25%",
        "0.1235",
        "-",
    )


def test_table_layout_never_cuts_numbers():
    nodes = REPORT.nodes
    natural = table_layout(nodes)
    assert not natural.short_ops
    assert natural.widths["name"] == 1 + max(len(n.name) for n in nodes)
    assert natural.widths["op"] == 1 + len("LayerNormalization")
    for col in COLUMNS:
        if col.numeric:  # every value, and the label with the sort arrow, plus a gap
            assert natural.widths[col.key] > max(
                len(col.label) + 1, *(len(CELL_TEXT[col.key](n)) for n in nodes)
            )
    assert table_layout(nodes, natural.total) == natural  # fits exactly
    short = table_layout(nodes, natural.total - 1)  # abbreviated op types first ...
    assert short.short_ops and short.widths["name"] == natural.widths["name"]
    assert short.op("LayerNormalization") == "LayerNorm" and short.total < natural.total
    tight = table_layout(nodes, short.total - 5)  # ... then names cut in the middle
    assert tight.total == short.total - 5
    assert tight.name("layer1/attn/qk_matmul") == "layer1/…k_matmul"  # 16 of 21 characters
    assert tight.name("head/matmul") == "head/matmul"
    assert {k: w for k, w in tight.widths.items() if k not in ("name", "op")} == {
        k: w for k, w in natural.widths.items() if k not in ("name", "op")
    }
    assert middle_ellipsis("abcdef", 3) == "a…f" and middle_ellipsis("abc", 3) == "abc"
    # wide (CJK) characters take two cells: cut by cells, the name fits its column and keeps both ends
    cut = middle_ellipsis("層正規化/注意/出力テンソル名前", 11)
    assert cut.startswith("層") and cut.endswith("名前") and "…" in cut
    assert sum(2 if ch not in "…/" else 1 for ch in cut) <= 11
    assert short_op("GlobalAveragePool") == "GlobalAvgPool" and short_op("MatMul") == "MatMul"


# =========================================================================== charts


def test_buckets_and_caret():
    assert [list(r) for r in charts.buckets(4, 2)] == [[0, 1], [2, 3]]
    assert [list(r) for r in charts.buckets(2, 4)] == [[0], [0], [1], [1]]
    covered = sorted({i for r in charts.buckets(29, 10) for i in r})
    assert covered == list(range(29))
    assert charts.caret(1, 2, 4) == "  ^"
    assert charts.caret(5, 2, 4) == ""


def test_sparkline_and_histogram():
    rows = charts.sparkline([0.0, 10.0], 2, height=2)
    assert rows == [" █", "▁█"]
    ref, cand = charts.histogram([0, 10, 1], [0, 5, 0], 3)
    assert ref == [" █▁"]  # a non-empty bin shows at least the lowest block
    assert cand == [" ▄ "]
    ref, cand = charts.histogram([1] * 100, [1] * 100, 10)
    assert len(ref[0]) == 10 and ref == cand


def test_scatter_range_and_plot():
    assert charts.scatter_range([0.739, 0.765, 0.841]) == (0.7, 0.9)  # close values: zoomed in
    assert charts.scatter_range([0.477, 4.63], zero=0.4) == (0.0, 6.0)  # far apart: from 0
    assert charts.scatter_range([83.6, 98.0], cap=100.0) == (80.0, 100.0)  # never past 100 %
    assert charts.scatter_range([]) == (0.0, 1.0) and charts.scatter_range([0.0, math.nan]) == (0.0, 1.0)
    points = [
        charts.Point(0.841, math.inf, "1", "fp32"),  # +inf: top edge
        charts.Point(0.765, 20.0, "2", "dynamic"),
        charts.Point(0.739, 10.0, "3", "static"),
        charts.Point(0.739, 10.0, "4", "same"),  # same cell as static
        charts.Point(0.8, math.nan, "5", "nan"),  # not drawn
    ]
    plot = charts.scatter(points, 60, 6, fmt_y=lambda v: f"{v:g}")
    assert len(plot.lines) == 6 + 2 and all(len(line) <= 60 for line in plot.lines)
    assert plot.y_range == (5.0, 25.0) and plot.x_range == (0.7, 0.9)
    assert [plot.lines[r][:4] for r in (0, 2, 5)] == ["25 ┤", "15 ┤", " 5 ┤"]  # top, middle, bottom
    assert plot.lines[6].startswith("   └┬") and plot.lines[7].split() == ["0.7", "0.8", "0.9"]
    body = [line[4:] for line in plot.lines[:6]]
    assert "1 fp32" in body[0] and "2 dynamic" in body[1]  # labelled right of the mark, rows by metric
    assert body[0].index("1") > body[1].index("2") > body[4].index(charts.SEVERAL)  # columns by latency
    assert "static" not in "".join(body) and "5" not in "".join(body)  # shared cell: no label; nan: no mark
    # every span covers what it colours: marks and labels of the drawn points only
    for line, start, end, i in plot.spans:
        assert plot.lines[line][start:end] in (points[i].mark, points[i].label)
    assert {i for *_, i in plot.spans} == {0, 1}


def test_bench_view_text():
    bench = make_bench()
    cells = [benchview.variant_cells(bench, i) for i in range(len(bench.variants))]
    assert [c["name"] for c in cells] == ["1 fp32", "2 dynamic", "3 static", "4 selective", "5 qoperator"]
    assert cells[0] == {
        "name": "1 fp32", "metric": "98.00%", "sqnr": "+inf", "p50": "0.841", "p95": "0.900",
        "throughput": "38050", "rss": "80", "size": "1.72 MiB", "speedup": "1.00x",
    }  # fmt: skip
    assert (cells[2]["metric"], cells[2]["sqnr"], cells[2]["speedup"]) == ("83.60%", "13.5", "1.14x")
    assert cells[4]["metric"] == "failed" and cells[4]["p50"] == "" and cells[4]["size"] == "-"
    assert benchview.machine_line(bench) == (
        "machine: AMD EPYC 7B13 (x86_64, 2 CPUs available) · INT8 flags: avx2 · ORT 1.32.0 · "
        "CPUExecutionProvider · threads auto"
    )
    assert "500 samples in batches of 32" in benchview.title_line(bench)
    notes = benchview.note_lines(bench)
    assert notes[0] == "last batch (20 samples, timed separately, not padded): fp32 p50 0.600 ms"
    assert (
        "qoperator failed: ORT refused" in notes[1]
        and "layer1/attn/softmax (adds -12.0 dB noise, SQNR 19.5 dB)" in notes[2]
    )
    points = benchview.chart_points(bench)
    assert [(p.mark, p.label, p.x, p.y) for p in points[:2]] == [
        ("1", "fp32", 0.841, 98.0),
        ("2", "dynamic", 0.765, 98.0),
    ]
    assert len(points) == 4 and benchview.chart_footnotes(bench) == ["qoperator: no timings, not drawn"]
    assert not benchview.model_mismatch(REPORT, bench)
    assert benchview.model_mismatch(REPORT, make_bench(sha256="0" * 64))
    assert not benchview.model_mismatch(REPORT, make_bench(sha256=""))  # unknown: no warning
    hint = benchview.bench_hint(REPORT, "run.report.json")
    assert "qdebug bench models/tiny_transformer.onnx --calib data/calib.npz --eval data/eval.npz" in hint
    assert "-o bench.json" in hint and "qdebug tui run.report.json --bench bench.json" in hint
    bare = replace(REPORT, config=replace(REPORT.config, calib=None, eval=None))
    hint = benchview.bench_hint(bare)
    assert "--calib CALIB --eval EVAL" in hint and "qdebug tui REPORT --bench" in hint


# =========================================================================== app (Pilot)

pytest.importorskip("textual")

from textual.notifications import Notify  # noqa: E402

from qdebug.tui import screens as screens_module  # noqa: E402
from qdebug.tui.app import (  # noqa: E402
    QDebugApp,
    default_export_path,
    load_bench_results,
    portable_svg,
    run_tui,
    save_screenshot,
)
from qdebug.tui.bench_widgets import BenchChart, BenchTable  # noqa: E402
from qdebug.tui.messages import VerifyProgress  # noqa: E402
from qdebug.tui.screens import BenchScreen, ExportDialog, HelpScreen, MainScreen, TextDialog  # noqa: E402
from qdebug.tui.widgets import (  # noqa: E402
    DetailPanel,
    NodeTable,
    VerifyPanel,
    node_detail_text,
    row_cells,
    summary_text,
)

SIZE = (120, 40)


def table_order(app: QDebugApp) -> list[str]:
    table = app.main_screen.query_one(NodeTable)
    return [str(row.key.value) for row in table.ordered_rows]


def run(coro):
    return asyncio.run(coro)


def test_default_sort_in_table_and_detail():
    posted = []

    async def main():
        app = QDebugApp(REPORT)
        async with app.run_test(size=SIZE, message_hook=posted.append) as pilot:
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)
            assert table_order(app) == [n.name for n in LayerModel(REPORT).rows()]
            assert app.main_screen.selected == "layer1/attn/softmax"
            assert app.screen.query_one("#node-detail").node == "layer1/attn/softmax"
            table = app.main_screen.query_one(NodeTable)
            assert table.virtual_size.width <= table.scrollable_content_region.width  # no sideways scroll
            header = [str(c.label) for c in table.columns.values()]
            assert header[:6] == ["Node", "Op", "Local", "Accum", "Added▼", "Intro"]
            await pilot.press("down")
            await pilot.pause()
            assert app.main_screen.selected == "layer1/mlp/gelu/erf"

    run(main())
    highlighted = [m.node for m in posted if isinstance(m, NodeTable.NodeHighlighted)]
    assert highlighted[-1] == "layer1/mlp/gelu/erf"


def test_sort_by_keys_and_header_click():
    async def main():
        app = QDebugApp(REPORT)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("3")  # local SQNR, worst first
            await pilot.pause()
            assert table_order(app)[0] == "layer1/attn/softmax"
            await pilot.press("3")  # again: reverse (nan still last)
            await pilot.pause()
            order = table_order(app)
            assert order[0] == "layer0/attn/out_proj" and order[-1] == "layer0/ln1"
            # mouse: click the "Node" header
            await pilot.click(NodeTable, offset=(3, 0))
            await pilot.pause()
            assert app.model.sort_key == "name"
            assert table_order(app) == sorted(table_order(app), key=str.lower)
            # mouse: click the third data row selects it
            await pilot.click(NodeTable, offset=(3, 3))
            await pilot.pause()
            assert app.main_screen.selected == table_order(app)[2]

    run(main())


def test_filter_by_name_and_op_and_jump_out_of_the_filter():
    async def main():
        app = QDebugApp(REPORT)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("slash", *"l1sm")
            await pilot.pause()
            assert table_order(app) == ["layer1/attn/softmax"]
            assert app.main_screen.selected == "layer1/attn/softmax"
            await pilot.press("enter")  # back to the table
            await pilot.pause()
            assert isinstance(app.focused, NodeTable)
            await pilot.press("slash", "ctrl+u", "escape")  # clear the query, leave the input
            await pilot.pause()
            assert len(table_order(app)) == 32 and isinstance(app.focused, NodeTable)
            await pilot.press("o", *"Erf", "enter")  # the op-type list: type to search, enter picks
            await pilot.pause()
            assert app.model.op_filter == "Erf"
            assert table_order(app) == ["layer1/mlp/gelu/erf", "layer0/mlp/gelu/erf"]
            # jumping to a node the filter hides clears the filters
            await pilot.press("left_square_bracket")
            await pilot.pause()
            assert app.main_screen.selected == "layer1/mlp/fc1"
            assert len(table_order(app)) == 32 and app.model.op_filter is None

    run(main())


def test_jump_to_neighbours_keys_and_list():
    async def main():
        app = QDebugApp(REPORT)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            screen = app.main_screen
            screen.select_node("layer0/attn/softmax")
            await pilot.press("left_square_bracket")  # softmax -> its producer
            await pilot.pause()
            assert screen.selected == "layer0/attn/qk_matmul"
            assert screen.query_one(NodeTable).current == "layer0/attn/qk_matmul"
            await pilot.press("left_square_bracket")  # worst of q_proj / k_proj
            await pilot.pause()
            assert screen.selected == "layer0/attn/q_proj"
            await pilot.press("right_square_bracket")
            await pilot.pause()
            assert screen.selected == "layer0/attn/qk_matmul"
            # the neighbour list: focus it, move to the consumer, enter jumps
            neighbours = screen.query_one("#neighbours")
            neighbours.focus()
            for _ in range(5):
                await pilot.press("down")
                if neighbours.highlighted_node == "layer0/attn/softmax":
                    break
            await pilot.press("enter")
            await pilot.pause()
            assert screen.selected == "layer0/attn/softmax"
            assert isinstance(app.focused, NodeTable)

    run(main())


def test_toggle_exclusion_and_export(tmp_path):
    report_path = tmp_path / "run.report.json"
    save_report(REPORT, report_path)
    notes: list[str] = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append(message.notification.message)

    async def main():
        app = QDebugApp(REPORT, report_path=str(report_path))
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            await pilot.press("x", "down", "down", "space", "down", "x", "x")  # rows 1 and 3
            await pilot.pause()
            assert app.model.excluded == ("layer1/attn/softmax", "layer1/attn/qk_matmul")
            table = app.main_screen.query_one(NodeTable)
            assert table.get_cell("layer1/attn/qk_matmul", "name").style == "bold magenta"
            assert table.get_cell("layer0/attn/softmax", "name").style == ""
            panel = app.main_screen.query_one("#exclusions")
            assert panel.option_count == 2
            await pilot.press("e")
            await pilot.pause()
            assert isinstance(app.screen, ExportDialog)
            await pilot.press("enter")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)

    run(main())
    out = tmp_path / "run.report.proposal.json"
    assert default_export_path(report_path) == out
    p = load_record(Proposal, out, "proposal")
    assert p.nodes_to_exclude == ("layer1/attn/softmax", "layer1/attn/qk_matmul")
    assert p.source == "tui" and all(HAND_REASON in r.reason for r in p.reasons)
    assert (p.method, p.activation_type, p.weight_type) == (
        REPORT.config.method,
        REPORT.config.activation_type,
        REPORT.config.weight_type,
    )
    assert "nodes_to_exclude = [" in p.snippet  # snippet.quantize_snippet's layout, as propose writes it
    assert any(str(out) in n for n in notes)


def test_proposal_is_initial_set_export_error_and_verify_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    notes: list[tuple[str, str]] = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append((message.notification.severity, message.notification.message))

    async def main():
        report_path = tmp_path / "report.json"
        save_report(REPORT, report_path)
        app = QDebugApp(
            REPORT,
            make_proposal(REPORT),
            export_path=blocker / "sub" / "p.json",
            report_path=str(report_path),
        )
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            screen = app.main_screen
            assert set(app.model.excluded) == {"layer1/attn/softmax", "layer1/mlp/gelu/erf"}
            first = screen.query_one("#exclusions").get_option_at_index(0)
            assert first.id == "layer1/attn/softmax" and "introduces" in str(first.prompt)
            await pilot.press("e", "enter")
            await pilot.pause()
            assert screen.last_export is None
            before = report_path.read_bytes()
            assert screen.export(report_path) is None  # never over the report itself
            assert report_path.read_bytes() == before
            good = tmp_path / "ok.json"
            assert screen.export(good) is not None
            assert load_record(Proposal, good, "proposal").nodes_to_exclude == app.model.excluded
            await pilot.press("v")  # no verify_fn: a warning, nothing runs
            await pilot.pause()
            assert screen.verify_state == "idle"

    run(main())
    assert any(sev == "error" and "cannot write" in msg for sev, msg in notes)
    assert any(sev == "error" and "would overwrite the report" in msg for sev, msg in notes)
    assert any(sev == "warning" and "verify is unavailable" in msg for sev, msg in notes)


def test_help_screen_and_snippet_dialog():
    async def main():
        app = QDebugApp(REPORT, make_proposal(REPORT))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)
            await pilot.press("c")
            await pilot.pause()
            assert isinstance(app.screen, TextDialog)
            assert "quantize_static(" in app.clipboard
            assert "'layer1/attn/softmax'," in app.clipboard
            assert app.screen.body == app.clipboard
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)

    run(main())


class FakeResult:
    def __init__(self, nodes):
        self.nodes = nodes

    def summary_lines(self):
        return ["verify: top1 0.9020 (target 0.9", f"{len(self.nodes)} nodes kept in FP32"]


def test_verify_runs_in_a_worker_and_shows_the_result(monkeypatch):
    # An interval no run reaches makes the throttle deterministic on a loaded machine:
    # the first report and the final one show, the three between are dropped.
    monkeypatch.setattr(screens_module, "PROGRESS_INTERVAL_S", 3600.0)
    calls = []
    posted = []

    def verify_fn(proposal, progress, cancelled):
        calls.append((proposal.nodes_to_exclude, threading.current_thread() is threading.main_thread()))
        for i in range(5):
            progress((i + 1) / 5, f"step {i + 1}/5")
        return FakeResult(proposal.nodes_to_exclude)

    async def main():
        app = QDebugApp(REPORT, make_proposal(REPORT), verify_fn=verify_fn)
        async with app.run_test(size=SIZE, message_hook=posted.append) as pilot:
            await pilot.pause()
            await pilot.press("v")
            await app.workers.wait_for_complete()
            await pilot.pause()
            screen = app.main_screen
            assert screen.verify_state == "done"
            assert isinstance(app.screen, TextDialog)
            assert "2 nodes kept in FP32" in app.screen.body
            assert "2 nodes kept in FP32" in str(screen.query_one("#verify-result").render())
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)

    run(main())
    assert calls == [(("layer1/attn/softmax", "layer1/mlp/gelu/erf"), False)]  # in a thread
    # Textual's hook sees a message at each pump it passes through: count each once.
    progress = list({id(m): m for m in posted if isinstance(m, VerifyProgress)}.values())
    assert [(m.fraction, m.text) for m in progress] == [(0.2, "step 1/5"), (1.0, "step 5/5")]


def test_verify_cancel():
    started = threading.Event()
    saw_cancel = threading.Event()

    def verify_fn(proposal, progress, cancelled):
        for i in range(500):  # at most ~5 s
            if cancelled():
                saw_cancel.set()
                return None
            progress(i / 500, "evaluating")
            started.set()
            threading.Event().wait(0.01)
        return FakeResult(())

    async def main():
        app = QDebugApp(REPORT, verify_fn=verify_fn)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("v")
            for _ in range(200):
                if started.is_set():
                    break
                await asyncio.sleep(0.01)
            await pilot.pause()
            assert app.main_screen.verify_state == "running"
            assert app.main_screen.query_one("#verify").display
            await pilot.press("escape")
            await pilot.pause()
            assert app.main_screen.verify_state == "cancelled"
            assert isinstance(app.screen, MainScreen)

    run(main())
    assert saw_cancel.wait(5)


def test_verify_error_is_shown():
    notes: list[tuple[str, str]] = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append((message.notification.severity, message.notification.message))

    def verify_fn(proposal, progress, cancelled):
        raise QDebugError("data file eval.npz not found", "pass --eval")

    async def main():
        app = QDebugApp(REPORT, verify_fn=verify_fn)
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            await pilot.press("v")
            await app.workers.wait_for_complete()
            await pilot.pause()
            assert app.main_screen.verify_state == "failed"
            assert isinstance(app.screen, TextDialog)
            assert "eval.npz not found -- pass --eval" in app.screen.body

    run(main())
    assert ("error", "data file eval.npz not found -- pass --eval") in notes


def test_bench_screen_shows_variants_machine_and_chart(tmp_path):
    """``b`` with a bench file (here: one for another model, so a warning); without one, the hint."""
    path = write_bench(tmp_path / "bench.json", make_bench(sha256="0" * 64))
    bench = load_bench_results(path)  # the JSON ``qdebug bench -o`` writes, read back
    notes: list[tuple[str, str]] = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append((message.notification.severity, message.notification.message))

    async def main():
        app = QDebugApp(REPORT, bench=bench, report_path="run.report.json")
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            assert ("warning", benchview.MISMATCH) in notes  # told at once, still shown
            footer = {b.binding.key: b.binding.description for b in app.screen.active_bindings.values()}
            assert footer["b"] == "Bench"
            await pilot.press("b")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, BenchScreen) and screen.mismatch
            table = screen.query_one(BenchTable)
            header = [str(c.label) for c in table.columns.values()]
            assert header[:5] == ["variant", "top1", "SQNR", "p50 ms", "p95 ms"]  # metric named by the bench
            assert header[5:] == ["samples/s", "RSS MiB", "size", "×FP32"]
            rows = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
            assert rows[0] == ["1 fp32", "98.00%", "+inf", "0.841", "0.900", "38050", "80", "1.72 MiB", "1.00x"]
            static = ["3 static", "83.60%", "13.5", "0.739", "0.790", "43302", "81", "507.8 KiB", "1.14x"]
            assert rows[2] == static
            assert rows[3][:4] == ["4 selective", "97.60%", "25.0", "0.774"] and rows[3][-1] == "1.09x"
            assert rows[4][:2] == ["5 qoperator", "failed"]
            head = str(screen.query_one("#bench-head").render())
            assert "INT8 flags: avx2 · ORT 1.32.0 · CPUExecutionProvider" in head
            assert "warning: this CPU has no VNNI/AMX" in head and benchview.MISMATCH in head
            assert "last batch (20 samples" in str(screen.query_one("#bench-notes").render())
            chart = screen.query_one(BenchChart)
            text = chart.render().plain
            assert text.startswith("top1 (%) vs p50 ms per batch of 32")
            lines = text.split("\n")
            assert lines[1].startswith("100% ┤")  # accuracies stop at 100 %
            assert "1 fp32" in text and "3 static" in text  # one labelled mark per variant
            assert "qoperator: no timings, not drawn" in text
            row = {m: next(i for i, line in enumerate(lines) if f"{m} " in line) for m in ("1", "3")}
            assert row["3"] > row["1"]  # static is less accurate: lower
            assert chart.region.height >= 12 and "<svg" in app.export_screenshot()
            await pilot.press("escape")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)
            screen = app.main_screen  # as if started without --bench: b says how to make one
            screen.context = replace(screen.context, bench=None)
            await pilot.press("b")
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)

    run(main())
    hint = notes[-1][1]
    assert hint.startswith("no bench results loaded: run `qdebug bench models/tiny_transformer.onnx --calib")
    assert "-o bench.json`, then `qdebug tui run.report.json --bench bench.json`" in hint


def test_cli_bench_file_errors_and_screenshot(tmp_path, capsys):
    from qdebug.cli.main import main

    report_path = tmp_path / "r.json"
    save_report(REPORT, report_path)
    assert main(["tui", str(report_path), "--bench", str(tmp_path / "nope.json")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bench result file not found" in err and "nope.json" in err
    (tmp_path / "bad.json").write_text('{"schema_version": 1, "kind": "bench"')
    assert main(["tui", str(report_path), "--bench", str(tmp_path / "bad.json")]) == 3
    assert "not a valid qdebug bench result" in capsys.readouterr().err
    assert main(["tui", str(report_path), "--bench", str(report_path)]) == 3  # a report is no bench file
    good = write_bench(tmp_path / "bench.json", make_bench())
    shot = tmp_path / "shot.svg"
    assert main(["tui", str(report_path), "--bench", str(good), "--screenshot", str(shot)]) == 0
    assert shot.read_text().startswith("<svg")
    folder = tmp_path / "shots"  # a directory: named by its flag (the hint had said -o, which tui lacks)
    folder.mkdir()
    capsys.readouterr()
    assert main(["tui", str(report_path), "--screenshot", str(folder)]) == 7
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory -- give a file name with --screenshot" in err


def test_cli_screenshot_refuses_a_name_that_is_not_svg(tmp_path, capsys):
    """Textual draws SVG only: ``--screenshot shot.png`` had written SVG into a .png without a word (issue 38)."""
    from qdebug.cli.main import main

    report_path = tmp_path / "r.json"
    save_report(REPORT, report_path)
    for name in ("shot.png", "shot"):
        assert main(["tui", str(report_path), "--screenshot", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the screenshot is an SVG image" in err, err
        assert "name it shot.svg" in err and not (tmp_path / name).exists()
    assert main(["tui", str(report_path), "--screenshot", str(tmp_path / "shot.SVG")]) == 0
    assert (tmp_path / "shot.SVG").read_text().startswith("<svg")


def test_bench_prints_sizes_in_the_binary_units_verify_uses(capsys):
    """One model's size read as two numbers: bench printed kB/MB, verify KiB/MiB (issue 38)."""
    from qdebug.cli.bench import print_table
    from qdebug.output.formatting import fmt_size
    from qdebug.records.verify import fmt_binary_size

    assert fmt_size(520_000) == fmt_binary_size(520_000) == "507.8 KiB" and fmt_size(0) == "-"
    assert fmt_size(1_800_000) == fmt_binary_size(1_800_000) == "1.72 MiB"
    print_table(make_bench())
    out = capsys.readouterr().out
    assert "507.8 KiB" in out and "1.72 MiB" in out and "peak RSS MiB" in out
    assert not re.search(r"\d (kB|MB|GB)\b", out) and "RSS MB" not in out, out


def test_detail_and_summary_text():
    m = LayerModel(REPORT, make_proposal(REPORT))
    text = node_detail_text(m, REPORT.node("layer0/ln1"), 40).plain
    assert "not quantized" in text and "embeddings" in text and "added noise -inf dB" in text
    assert "fake-quant" not in text  # an unquantized output has no fake-quant numbers
    text = node_detail_text(m, REPORT.node("layer1/attn/softmax"), 40).plain
    assert "EXCLUDED" in text and "proposal (fp32)" in text
    assert "added noise -18.2 dB" in text and "introduced  3.0 dB" in text
    # the two histogram rows, the quantized one labelled with the tensor's own type (it said INT8 for
    # 16-bit activations too)
    assert "FP32 " in text and f" {REPORT.tensor('layer1/attn/softmax_out').quant.qtype.upper()}" in text
    assert "fake-quant SQNR 15.4 dB" in text and "kernels" not in text
    text = node_detail_text(m, REPORT.node("layer0/attn/q_proj"), 40).plain
    assert "weight" in text and "int8 per-axis 1" in text
    assert "fake-quant SQNR 46.0 dB\n" in text and "integer kernels lose 16.0 dB" in text  # 30 dB deployed
    head = summary_text(REPORT).plain
    assert head.count("\n") == 1  # one line of settings, one of results
    assert "tiny_transformer.onnx · opset 17 · 32 nodes" in head
    assert "FP32 91.25% → INT8 86.10% (-5.15 pts)" in head
    assert "fake-quant 88.30%" in head and "logits SQNR 13.5 dB" in head
    narrow = summary_text(REPORT, 78).plain
    assert all(len(line) <= 78 for line in narrow.split("\n")) and narrow.count("\n") == 3
    assert narrow.replace("\n", " ").replace(" · ", " ").replace(" │ ", " ") == head.replace(
        "\n", " "
    ).replace(" · ", " ").replace(" │ ", " ")  # wrapped at fields, nothing lost
    no_fq = replace(REPORT, task=replace(REPORT.task, quantized_fakequant=math.nan))
    assert "fake-quant" not in summary_text(no_fq).plain


def test_small_terminal_80x24():
    async def main():
        app = QDebugApp(REPORT, make_proposal(REPORT))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert app.screen.has_class("-narrow")
            for key in ("down", "x", "right_square_bracket", "3", "question_mark", "escape", "c", "escape"):
                await pilot.press(key)
            await pilot.pause()
            assert isinstance(app.screen, MainScreen)
            table = app.main_screen.query_one(NodeTable)
            assert table.region.height >= 8 and table.region.width == 80
            assert table.virtual_size.width <= table.scrollable_content_region.width
            assert not table.column_layout.short_ops  # 80 columns: the table has the whole width
            assert app.main_screen.query_one(DetailPanel).region.height > 0
            assert "<svg" in app.export_screenshot()
            await pilot.resize_terminal(112, 30)  # the table shares the width: op types abbreviated
            await pilot.pause()
            assert app.screen.has_class("-wide") and table.column_layout.short_ops
            assert table.virtual_size.width <= table.scrollable_content_region.width
            assert str(table.get_cell_at((0, 1))) in {short_op(n.op_type) for n in REPORT.nodes}

    run(main())


def test_degenerate_reports_render():
    """No task, no tensor numbers, no weights; and a report without nodes."""
    bare = replace(REPORT, task=None, outputs=(), tensors=(), weights=())
    empty = replace(REPORT, nodes=(), tensors=())
    assert LayerModel(empty).depth_profile() == [] and LayerModel(empty).excluded_share() == 0.0

    async def main():
        for report, keys in ((bare, ("down", "x", "left_square_bracket")), (empty, ("x", "3", "c"))):
            app = QDebugApp(report)
            async with app.run_test(size=SIZE) as pilot:
                await pilot.pause()
                await pilot.press(*keys)
                await pilot.pause()
                assert app.main_screen.query_one(NodeTable).row_count == len(report.nodes)
                assert "<svg" in app.export_screenshot()

    run(main())


def test_run_tui_load_errors_propagate(tmp_path):
    with pytest.raises(QDebugError, match="report file not found"):
        run_tui(str(tmp_path / "missing.json"))
    report_path = tmp_path / "r.json"
    save_report(REPORT, report_path)
    with pytest.raises(QDebugError, match="proposal"):
        run_tui(str(report_path), str(report_path))  # a report is not a proposal


def test_save_screenshot(tmp_path):
    report_path = tmp_path / "r.json"
    save_report(REPORT, report_path)
    out = save_screenshot(report_path, tmp_path / "shot.svg", size=(100, 30))
    text = out.read_text()
    assert text.startswith("<svg") and "layer0" in text
    # every renderer keeps the spacing (librsvg drops spaces at the ends of a text run)
    assert not re.search(r">&#160;|&#160;</text>", text)


def test_portable_svg_moves_edge_spaces_into_the_position():
    run_ = '<text class="r1" x="{x}" y="20" textLength="{n}" clip-path="url(#c)">{t}</text>'
    svg = run_.format(x=10, n=85.4, t="&#160;&#160;ab&#160;c&#160;") + run_.format(
        x=0, n=24.4, t="&#160;&#160;"
    )
    assert portable_svg(svg) == run_.format(x=34.4, n=48.8, t="ab&#160;c")  # 7 cells of 12.2
    assert portable_svg(run_.format(x=0, n=24.4, t="ab")) == run_.format(x=0, n=24.4, t="ab")


def test_report_json_is_strict():
    from tests.conftest import strict_json

    strict_json(dumps(REPORT))  # inf/nan encoded as strings


# =========================================================================== snapshots


def test_snapshot_main_120x40(snap_compare):
    assert snap_compare(QDebugApp(REPORT, make_proposal(REPORT)), terminal_size=(120, 40))


def test_snapshot_main_80x24(snap_compare):
    assert snap_compare(QDebugApp(REPORT, make_proposal(REPORT)), terminal_size=(80, 24))


def test_snapshot_filtered_and_excluded_120x40(snap_compare):
    assert snap_compare(
        QDebugApp(REPORT),
        press=["slash", *"attn", "enter", "down", "x", "down", "down"],
        terminal_size=(120, 40),
    )


def test_empty_table_keys_markup_op_types_and_export_spares_session_inputs(tmp_path):
    """Found by an adversarial run: up/pagedown on an empty table (a filter matching nothing) crashed on
    ``row_key=None``; an op type holding Rich markup crashed the op filter (``MarkupError``); and ``e``
    overwrote the --proposal and --bench files the session had read."""
    odd = "[bold red]EVIL[/]"
    report = replace(
        REPORT, nodes=tuple(replace(n, op_type=odd) if n.op_type == "Erf" else n for n in REPORT.nodes)
    )
    proposal_path = tmp_path / "p.json"
    proposal_path.write_text(dumps(make_proposal(REPORT)))
    bench_path = write_bench(tmp_path / "b.json", make_bench())
    kept = {p: p.read_bytes() for p in (proposal_path, bench_path)}
    inputs = {"the proposal": proposal_path, "the bench results": bench_path}

    async def main():
        app = QDebugApp(report, report_path=str(tmp_path / "r.json"), inputs=inputs)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            await pilot.press("slash", *"zzzzqqq", "enter")
            await pilot.pause()
            assert table_order(app) == []
            await pilot.press("up", "pagedown", "down", "home")
            await pilot.pause()
            await pilot.press("slash", "ctrl+u", "escape")
            await pilot.press("o")  # the op-type list: the markup op type is an entry like any other
            await pilot.pause()
            await pilot.press("left_square_bracket", *"bold", "enter")
            await pilot.pause()
            assert app.model.op_filter == odd
            assert sorted(table_order(app)) == ["layer0/mlp/gelu/erf", "layer1/mlp/gelu/erf"]
            for target in (proposal_path, bench_path):
                assert app.main_screen.export(target) is None
            assert app.main_screen.export(tmp_path / "new.json") is not None

    run(main())
    assert {p: p.read_bytes() for p in kept} == kept


def test_x_on_the_exclusion_list_and_export_path_details(tmp_path, monkeypatch):
    """The x key with the exclusion list focused toggled the table's node, not the highlighted entry;
    "~/p.json" in the export dialog made a directory named "~"; a NaN progress fraction recursed in the
    progress bar."""
    monkeypatch.setenv("HOME", str(tmp_path))

    async def main():
        app = QDebugApp(REPORT, make_proposal(REPORT))
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            screen = app.main_screen
            listed = screen.query_one("#exclusions")
            second = listed.get_option_at_index(1).id
            listed.focus()
            listed.highlighted = 1
            await pilot.pause()
            assert screen.table.current != second
            await pilot.press("x")
            await pilot.pause()
            assert second not in app.model.excluded and len(app.model.excluded) == 1
            assert screen.export("~/p.json") is not None
            screen.query_one(VerifyPanel).start()
            screen.query_one(VerifyPanel).progress(math.nan, "odd")
            await pilot.pause()

    run(main())
    assert (tmp_path / "p.json").is_file() and not (Path.cwd() / "~").exists()


def test_filter_typing_on_a_large_report_refreshes_once(monkeypatch):
    """A 5,000-node table took 2.6 s to rebuild per keystroke: large reports refresh when typing pauses
    (enter applies the filter at once)."""
    import qdebug.tui.screens as screens

    monkeypatch.setattr(screens, "DEBOUNCE_NODES", 1)  # this report counts as large
    monkeypatch.setattr(screens, "DEBOUNCE_S", 5.0)  # longer than the test: only enter applies it

    async def main():
        app = QDebugApp(REPORT)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            calls = []
            real = app.main_screen.refresh_table
            app.main_screen.refresh_table = lambda: (calls.append(1), real())[1]
            await pilot.press("slash", *"l1sm")
            await pilot.pause()
            assert calls == [] and len(table_order(app)) == 32  # not yet
            await pilot.press("enter")
            await pilot.pause()
            assert calls == [1] and table_order(app) == ["layer1/attn/softmax"]

    run(main())


@pytest.mark.parametrize("size, rows", [((40, 10), 1), ((60, 14), 3)])
def test_small_terminals_keep_table_rows(size, rows):
    """The narrow layout's detail/exclusion strip was 9 rows whatever the height: at 40x10 the table
    showed its header and no row."""

    async def main():
        app = QDebugApp(REPORT)
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            assert app.main_screen.table.size.height - 1 >= rows  # minus the header row

    run(main())


def test_the_verify_hook_hashes_the_model_without_onnx(tmp_path):
    """`qdebug tui` checks the report's model hash when it starts; that imported onnx (graph.load) only to
    hash a file."""
    model = ROOT / "fixtures" / "cnn" / "model.onnx"
    report = replace(
        REPORT,
        model=replace(REPORT.model, path=str(model), sha256="0" * 64),
        config=replace(REPORT.config, calib=str(ROOT / "fixtures" / "cnn" / "calib.npz"), eval=None),
    )
    save_report(report, tmp_path / "r.json")
    code = (
        "import sys; from qdebug.output.report_io import load_report; from qdebug.cli.tui import make_tui_verify; "
        f"hook = make_tui_verify(load_report({str(tmp_path / 'r.json')!r})); "
        "bad = [m for m in ('onnxruntime', 'onnx') if m in sys.modules]; "
        "print(bad, hook); sys.exit(1 if bad or hook is not None else 0)"  # the hash differs: no hook
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_export_spares_the_data_and_foreign_files_and_keeps_the_proposals_per_channel(tmp_path):
    """Review findings on `e`: it replaced the calibration and evaluation data (and any existing file) with
    proposal JSON, closed the app on "~nosuchuser/p.json", and dropped a loaded proposal's per-channel
    setting (verify then measured another model)."""
    from dataclasses import replace as dc_replace

    calib, evaluation, other = tmp_path / "calib.npz", tmp_path / "eval.npz", tmp_path / "notes.json"
    for f in (calib, evaluation):
        f.write_bytes(b"PK data")
    other.write_text('{"mine": true}')
    report = dc_replace(REPORT, config=dc_replace(REPORT.config, calib=str(calib), eval=str(evaluation)))
    proposal = dc_replace(make_proposal(report), per_channel=not report.config.per_channel)
    notes: list[str] = []

    def hook(message):
        if isinstance(message, Notify):
            notes.append(message.notification.message)

    async def main():
        app = QDebugApp(report, proposal)
        async with app.run_test(size=SIZE, message_hook=hook) as pilot:
            await pilot.pause()
            screen = app.main_screen
            for path in (calib, evaluation, other, "~nosuchuser-qdebug/p.json"):
                assert screen.export(path) is None, path
            done = tmp_path / "p.json"
            assert screen.export(done) is not None and screen.export(done) is not None  # an export: replaced
            exported = load_record(Proposal, done, "proposal")
            assert exported.per_channel is proposal.per_channel
            assert f"per_channel={proposal.per_channel}" in exported.snippet

    run(main())
    assert calib.read_bytes() == evaluation.read_bytes() == b"PK data" and other.read_text() == '{"mine": true}'
    assert any("would overwrite the calibration data" in n for n in notes)
    assert any("would overwrite the evaluation data" in n for n in notes)
    assert any("exists and is not a qdebug proposal" in n for n in notes)
    assert any("no such user's home directory" in n for n in notes)
    assert all(" -o " not in n for n in notes)  # the hints named a flag the TUI does not have


def test_large_report_sorts_filters_and_marks_rows_in_place():
    """Sorting a 2,000-node table took about 1 s: it was cleared and refilled, and Textual's DataTable
    measured every cell although every column has a fixed width. Sorts now reorder the rows in place and
    refills skip the measuring (timings: benchmarks/bench_tui.py); order, cells, header arrow, selection,
    exclusion marks and the table's scroll height must stay what a rebuild gives (checked on 300 nodes,
    several screens' worth, to keep the suite's time)."""
    from textual.widgets import DataTable

    assert "_update_dimensions" in vars(DataTable)  # the DataTable method NodeTable skips the measuring of
    report = make_large_report(300)
    assert len(report.nodes) >= 300

    async def main():
        app = QDebugApp(report)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            screen, table, model = app.main_screen, app.main_screen.table, app.model

            def check() -> None:
                rows = model.rows()
                assert table_order(app) == [n.name for n in rows]
                assert table.virtual_size.height == len(rows) + 1  # the header row
                assert table.virtual_size.width <= table.scrollable_content_region.width
                for i in {0, len(rows) // 2, len(rows) - 1} if rows else ():
                    n = rows[i]
                    want = row_cells(n, model.is_excluded(n.name), table.column_layout)
                    assert [c.plain for c in table.get_row_at(i)] == [c.plain for c in want]
                    assert [c.style for c in table.get_row_at(i)] == [c.style for c in want]
                arrows = [str(c.label) for c in table.columns.values() if str(c.label)[-1] in "▲▼"]
                assert arrows == [column(model.sort_key).label + ("▼" if model.descending else "▲")]

            for key in [*"12345678", "8"]:  # every column, then X reversed: each from its top
                await pilot.press(key)
                await pilot.pause()
                check()
                assert screen.selected == table.current == table_order(app)[0] and table.scroll_y == 0
            selected = screen.selected
            await pilot.press("x")  # sorted by X: the excluded node moves, its mark and colour change
            await pilot.pause()
            check()
            assert model.is_excluded(selected) and table.get_row(selected)[-1].plain == "✗"
            assert screen.selected == table.current == selected  # an exclusion is no sort: the cursor follows
            await pilot.press("5")  # back to Added, from its top; include the node again in place
            await pilot.pause()
            screen.select_node(selected)
            await pilot.press("x")
            await pilot.pause()
            check()
            assert not model.excluded and table.get_row(selected)[-1].plain == ""
            await pilot.press("slash", *"layer1/attn/soft", "enter")  # a filter, then clearing it
            await pilot.pause()
            check()
            assert 0 < len(table_order(app)) < len(report.nodes)
            await pilot.press("slash", "ctrl+u", "enter")
            await pilot.pause()
            check()
            assert len(table_order(app)) == len(report.nodes)

    run(main())


# ----- LayerModel behaviour a mutation audit found unchecked (the KL sort, the excluded share when a node that
# is not quantized is excluded, the depth profile where several nodes share a depth)


def test_sort_by_kl_puts_the_largest_divergence_first():
    nodes = tuple(_node(n, 1.0, kl=kl) for n, kl in (("a", 0.1), ("b", math.nan), ("c", 2.0), ("d", 0.5)))
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
    nodes = (
        replace(_node("a", 1.0, acc=30.0), depth=0),
        replace(_node("b", 1.0, acc=10.0), depth=0),
        _node("c", 1.0, acc=25.0),
    )
    m = LayerModel(replace(REPORT, nodes=nodes, tensors=()))
    assert m.depth_profile() == [10.0, 25.0]


def test_the_proposal_panel_shows_the_verified_frontier_in_one_line():
    """propose's frontier (speed vs FP32 of each point it timed) reaches the TUI next to the proposal."""
    from qdebug.records import FrontierPoint
    from qdebug.tui.model import frontier_line

    points = (
        FrontierPoint("fp32", "no quantization", -1, 0.98, math.inf, True, 1.0, 1.1),
        FrontierPoint("static", "full static INT8", 0, 0.83, 5.0, False, 0.5, 0.6),
        FrontierPoint("proposal", "5 nodes FP32", 5, 0.974, 18.0, True, 0.8, 0.9),
    )
    assert frontier_line(points) == "speed vs FP32: static 2.00x · proposal 1.25x met"
    assert frontier_line(points[1:]) == ""  # no FP32 point to compare with
    # with the interleaved rounds, the median of their ratios, as propose's table gives it (not the p50s')
    from dataclasses import replace

    fp32, _, answer = points
    rounds = (replace(fp32, rounds_ms=(1.0, 1.2, 1.0)), replace(answer, rounds_ms=(0.5, 1.0, 0.4)))
    assert frontier_line(rounds) == "speed vs FP32: proposal 2.00x met"


def test_the_recipe_notice_says_what_gets_quantized():
    """A transform's FP32 model is what gets quantized; quantize_dynamic quantizes the user's model as it is
    (the notice had called a dynamic recipe's model 'transformed', and it writes none)."""
    from qdebug.tui.model import recipe_notice

    assert "its transformed FP32 model is what gets quantized" in recipe_notice(("fold-bn", "equalize"))
    dynamic = recipe_notice(("dynamic",))
    assert "transformed" not in dynamic and "quantize_dynamic quantizes your FP32 model as it is" in dynamic
    assert "then quantize_dynamic on its MatMuls" in recipe_notice(("mixed",))


def test_the_tui_verify_rebuilds_the_reports_quantization_settings():
    """The TUI's verify takes the report's settings as its base (not as flags re-stated one by one)."""
    from qdebug.cli.tui import _tui_options
    from qdebug.records import AnalysisConfig
    from qdebug.verify import VerifyOptions

    cfg = AnalysisConfig(method="entropy", per_channel=True, activation_type="QInt8", weight_type="QInt8",
                         calib="c.npz", upgrade_opset=True, batch_size=8, max_samples=40)  # fmt: skip
    opts = _tui_options(cfg, VerifyOptions(), runs=3)
    settings = opts.quant.resolve()
    assert (settings.method, settings.per_channel, settings.activation_type, settings.upgrade_opset) == (
        "entropy", True, "QInt8", True)  # fmt: skip
    assert (opts.batch_size, opts.max_samples, opts.runs) == (8, 40, 3)
