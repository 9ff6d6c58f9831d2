"""The merged reduction model: structure (order, single consumers) and chunked capture."""

from __future__ import annotations

import math
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

import qdebug.analysis.graph_engine as graph_engine
import qdebug.analysis.measure as measure
import qdebug.analysis.numpy_engine as numpy_engine
from qdebug.cli.main import main
from qdebug.graph.match import pair_models
from qdebug.graph.reduce import SUBSAMPLE_INPUT, PairSpec, build_reduction_model, elem_types
from qdebug.output.report_io import load_report
from qdebug.records import Report
from qdebug.runtime.capture import SessionConfig, make_session, optimize_for_capture, run_session
from tests.conftest import analyze_args, analyze_with_both_engines, fixture_path


@pytest.fixture(scope="module")
def transformer_models(tmp_path_factory):
    """(normalized FP32, QDQ, pairing, calib) of the transformer fixture, via a real analysis."""
    base = fixture_path("transformer")
    out = tmp_path_factory.mktemp("reduce") / "r.json"
    assert main(analyze_args("transformer", out, "--max-samples", "16")) == 0
    report = load_report(out)
    fp32, qdq = onnx.load(report.normalized_model), onnx.load(report.quantized_model.path)
    return fp32, qdq, pair_models(fp32, qdq), base / "calib.npz"


def _merged(fp32, qdq, pairing):
    types = elem_types(fp32)
    scored = [p for p in pairing.tensors if types.get(p.fp32) == onnx.TensorProto.FLOAT]
    local = numpy_engine.local_fake_quant(qdq, scored)
    specs = [PairSpec(p.fp32, p.fp32, p.dequant or p.qdq, local.get(p.fp32)) for p in scored]
    config = SessionConfig()
    fo = optimize_for_capture(fp32, [p.fp32 for p in scored], config)
    qo = optimize_for_capture(qdq, [s.cand for s in specs if s.cand], config)
    keep = ([o.name for o in fp32.graph.output], [o.name for o in qdq.graph.output])
    rm = build_reduction_model(fo, qo, specs, ref_types=types, cand_types=elem_types(qdq), keep_outputs=keep)
    return rm, specs


def _live_peak(nodes: list[onnx.NodeProto], keep: set[str]) -> int:
    """Most activations of the two models alive at once when running ``nodes`` in this order.

    Only tensors the models produce count: qdebug's own per-pair scalars are tiny.
    """
    last_use = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            last_use[x] = i
    live: set[str] = set()
    peak = 0
    for i, n in enumerate(nodes):
        if not n.name.startswith("qdbg/"):
            live.update(o for o in n.output if o)
        peak = max(peak, len(live))
        live = {t for t in live if last_use.get(t, -1) > i or t in keep}
    return peak


def test_merged_model_is_topological_and_keeps_few_tensors_alive(transformer_models):
    fp32, qdq, pairing, _ = transformer_models
    rm, specs = _merged(fp32, qdq, pairing)
    graph = rm.model.graph
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    for node in graph.node:
        assert all(x in known for x in node.input if x), node.name
        known.update(node.output)
    outputs = {o.name for o in graph.output}
    ours = _live_peak(list(graph.node), outputs)
    # the naive order (both models first, reductions last) keeps every tensor alive until its reduction
    is_model = [not n.name.startswith("qdbg/") for n in graph.node]
    naive = [n for n, m in zip(graph.node, is_model, strict=True) if m] + [
        n for n, m in zip(graph.node, is_model, strict=True) if not m
    ]
    assert ours * 4 < _live_peak(naive, outputs), (ours, _live_peak(naive, outputs))
    assert len(specs) > 40


def test_every_compared_tensor_has_one_consumer(transformer_models):
    """ORT gives each consumer of a DequantizeLinear its own copy: the merged model must not let it."""
    fp32, qdq, pairing, _ = transformer_models
    rm, specs = _merged(fp32, qdq, pairing)
    consumers: dict[str, int] = {}
    for node in rm.model.graph.node:
        for x in node.input:
            consumers[x] = consumers.get(x, 0) + 1
    dq_outputs = [o for n in rm.model.graph.node if n.op_type == "DequantizeLinear" for o in n.output]
    assert dq_outputs
    assert all(consumers.get(o, 0) <= 1 for o in dq_outputs)
    assert sum(1 for s in specs if s.local is not None) == len(rm.keys["local"]) > 20


def test_the_candidate_is_released_before_the_local_error_is_computed(transformer_models):
    """Each side is subsampled right after its own reductions: the candidate tensor's last reader runs
    before the pair's QuantizeLinear, so the two never hold memory at once."""
    fp32, qdq, pairing, _ = transformer_models
    rm, specs = _merged(fp32, qdq, pairing)
    nodes = list(rm.model.graph.node)
    position = {o: i for i, n in enumerate(nodes) for o in n.output}
    last_read: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for x in n.input:
            last_read[x] = i
    checked = 0
    for key, sides in rm.samples.items():
        if "c" not in sides or "l" not in sides:
            continue
        cand = nodes[position[sides["c"]]].input[0]  # the Reshape that flattens the candidate
        cand = nodes[position[cand]].input[0]
        quantize = next(n for n in nodes[position[cand] :] if n.op_type == "QuantizeLinear")
        assert last_read[cand] < nodes.index(quantize), key
        checked += 1
    assert checked > 20


def test_merged_models_refer_to_the_weights_files_and_leave_nothing_behind(
    transformer_models, tmp_path, monkeypatch
):
    """ORT writes each optimized side's weights once, to the capture's scratch directory; the merged models
    only refer to them (copying them into each merge set the BERT benchmark's peak), and the directory
    goes with the capture, also when building fails."""
    fp32, qdq, pairing, _ = transformer_models
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    types = elem_types(fp32)
    scored = [p for p in pairing.tensors if types.get(p.fp32) == onnx.TensorProto.FLOAT]
    local = numpy_engine.local_fake_quant(qdq, scored)
    path = graph_engine.GraphPath(fp32, qdq, scored, local, SessionConfig())
    scratch = Path(path._dir.name)
    big = sum(len(t.raw_data) for t in fp32.graph.initializer if len(t.raw_data) > 1024)
    for name in ("main.onnx", "fakequant.onnx"):
        merged = onnx.load(scratch / name, load_external_data=False)
        assert max(len(t.raw_data) for t in merged.graph.initializer) <= 1024, name
        external = [t for t in merged.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        sizes = [int(next(e.value for e in t.external_data if e.key == "length")) for t in external]
        assert sum(sizes) >= big, name  # the FP32 side's weights, at least, are in the files
        files = {e.value for t in external for e in t.external_data if e.key == "location"}
        assert files and all((scratch / f).is_file() for f in files), name
    path.main_sess()  # ORT finds the weights next to the merged model
    path.close()
    assert not scratch.exists()

    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(graph_engine, "build_reduction_model", fail)
    with pytest.raises(KeyboardInterrupt) as caught:
        graph_engine.GraphPath(fp32, qdq, scored, local, SessionConfig())
    # checked while the traceback (and so the half-built capture) is still alive: not left to the GC
    assert caught.traceback and not list(tmp_path.glob("qdebug-capture-*"))


def test_in_graph_sums_match_numpy_on_one_batch(transformer_models):
    fp32, qdq, pairing, calib = transformer_models
    rm, specs = _merged(fp32, qdq, pairing)
    x = np.load(calib)["input"][:8]
    session = make_session(rm.model, SessionConfig(), optimize=False, keep_order=True)
    out = run_session(session, rm.outputs, {"input": x, SUBSAMPLE_INPUT: np.array(512, dtype=np.int64)})
    stats = rm.stats(out)
    spec = next(s for s in specs if s.local is not None and s.cand is not None)
    ref = make_session(_exposed(fp32, spec.ref), SessionConfig()).run([spec.ref], {"input": x})[0]
    fq = numpy_engine.fake_quantize(ref, spec.local)
    local = stats["local"][spec.key]
    assert stats["ref"][spec.key]["count"] == ref.size
    assert local["noise2"] == pytest.approx(float(np.sum((ref.astype(np.float64) - fq) ** 2)), rel=1e-3)
    assert max(local["dmax"], -local["dmin"]) == pytest.approx(float(np.max(np.abs(ref - fq))), rel=1e-5)
    assert len(out[rm.samples[spec.key]["r"]]) <= 2 * 512


def _exposed(model: onnx.ModelProto, name: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.output.append(onnx.ValueInfoProto(name=name))
    return m


def test_chunked_capture_matches_whole_batches(tmp_path, monkeypatch):
    """Cutting batches into capture chunks changes nothing but speed and memory."""
    reports = {}
    for label, elements in (("one-sample", 1), ("whole", 1 << 40)):
        monkeypatch.setattr(graph_engine, "CAPTURE_ELEMENTS", elements)
        out = tmp_path / f"{label}.json"
        assert main(analyze_args("transformer", out, "--max-samples", "24", "--batch-size", "12")) == 0
        reports[label] = load_report(out)
    a, b = reports["one-sample"], reports["whole"]
    assert a.task == b.task
    compared = 0
    for ta in a.tensors:
        tb = b.tensor(ta.name)
        for x, y in ((ta.accumulated, tb.accumulated), (ta.local, tb.local)):
            assert (x is None) == (y is None)
            if x is None or not math.isfinite(x.sqnr_db):
                continue
            assert x.count == y.count
            assert x.sqnr_db == pytest.approx(y.sqnr_db, abs=0.01), ta.name
            assert x.max_abs == pytest.approx(y.max_abs, rel=1e-4, abs=1e-6), ta.name
            compared += 1
        # kernels may round differently at another batch size: equal to float32 precision
        assert ta.summary.max == pytest.approx(tb.summary.max, rel=1e-6, abs=1e-7)
    assert compared > 50


@dataclass
class _Capture:
    """A report of the transformer fixture, with the capture-worker threads that ran and the intra-op
    threads of every capture session opened (None: ORT's own)."""

    report: Report
    workers: set[str]
    sessions: list[int | None]


def _capture(tmp_path, monkeypatch, label: str, threads: int, patch: dict, *extra: str) -> _Capture:
    """``qdebug analyze`` of the transformer fixture with ``patch`` applied to qdebug.analysis.graph_engine."""
    seen: list[str] = []
    opened: list[int | None] = []
    real_run, real_make = graph_engine.run_session, graph_engine.make_session

    def spy_run(session, names, feeds, what="the model"):
        seen.append(threading.current_thread().name)
        return real_run(session, names, feeds, what)

    def spy_make(*args, threads=None, **kwargs):
        opened.append(threads)
        return real_make(*args, threads=threads, **kwargs)

    out = tmp_path / f"{label}.json"
    with monkeypatch.context() as m:
        m.setattr(graph_engine, "run_session", spy_run)
        m.setattr(graph_engine, "make_session", spy_make)
        for name, value in patch.items():
            m.setattr(graph_engine, name, value)
        assert main(analyze_args("transformer", out, "--threads", str(threads), *extra)) == 0
    workers = {t for t in seen if t.startswith("qdebug-capture")}
    return _Capture(load_report(out), workers, opened)


def test_reports_do_not_depend_on_the_capture_workers(tmp_path, monkeypatch):
    """Chunks run side by side on the capture workers, but where they start and end depends on the model
    and the batch only, and they are accumulated in order: 1 or 3 workers give the same report, bit for bit.

    Batches too small to be worth a worker (the fixture's, at the real thresholds), and chunks too large
    for the in-flight memory budget, run one at a time on sessions with ORT's own threads (the fake-quant one,
    opened single-threaded before sizing, is kept when its 32 rows cost less than opening it again; the main
    one opens after sizing, with ORT's threads).
    """
    small = {"CAPTURE_ELEMENTS": 4 * 1024, "MIN_PIECE_ELEMENTS": 1}  # chunks of 4 rows, cut in 4s
    budget = {**small, "IN_FLIGHT_ELEMENTS": 4 * 1024}  # room for one chunk in flight: one worker
    runs = (("one", 1, small), ("three", 3, small), ("tiny", 3, {}), ("budget", 3, budget))
    got = {
        label: _capture(
            tmp_path, monkeypatch, label, threads, patch, "--max-samples", "32", "--batch-size", "16"
        )
        for label, threads, patch in runs
    }
    assert not got["one"].workers and len(got["three"].workers) >= 2
    # fake-quant single-threaded, then (reopened with ORT's threads or kept: timed, see the test below) the main
    # session with ORT's threads; the reports are the same either way
    for label in ("tiny", "budget"):
        assert not got[label].workers and got[label].sessions in ([1, None], [1, None, None]), label
    assert got["budget"].report.tensors == got["one"].report.tensors
    one, three = got["one"].report, got["three"].report
    assert one.task == three.task
    compared = 0
    for ts in one.tensors:
        tc = three.tensor(ts.name)
        assert ts.summary == tc.summary, ts.name
        pairs = ((ts.accumulated, tc.accumulated), (ts.local, tc.local))
        for a, b in (*pairs, (ts.accumulated_fakequant, tc.accumulated_fakequant)):
            assert a == b, ts.name
            compared += a is not None
    assert compared > 80


def test_one_sample_batches_run_side_by_side_across_batches(tmp_path, monkeypatch):
    """A one-sample batch cannot be cut, so the workers take consecutive batches: the same report as one
    run at a time. With too little work per sample (the fixture, at the real threshold) the runs stay one
    at a time, on sessions with ORT's own threads."""
    runs = (("one", 1, {"MIN_PIECE_ELEMENTS": 1}), ("two", 2, {"MIN_PIECE_ELEMENTS": 1}), ("tiny", 2, {}))
    got = {
        label: _capture(
            tmp_path, monkeypatch, label, threads, patch, "--max-samples", "12", "--batch-size", "1"
        )
        for label, threads, patch in runs
    }
    assert len(got["two"].workers) == 2 and got["two"].sessions == [1, 1]
    assert not got["tiny"].workers and got["tiny"].sessions in ([1, None], [1, None, None])  # fq (kept or not), main
    assert not got["one"].workers and got["one"].report.samples == 12
    # both single-threaded sessions: bit for bit
    assert got["one"].report.tensors == got["two"].report.tensors
    assert got["one"].report.task == got["two"].report.task


def test_batches_of_varying_shapes_are_cut_the_same_whatever_the_workers(tmp_path):
    """How a batch is cut must not depend on how far the pipeline has read when it is loaded (found in
    review: a folder of two sequence lengths gave other sums with 2 workers than with 1)."""
    model = fixture_path("robustness", "dynamic.onnx")
    rng = np.random.default_rng(0)
    data = tmp_path / "calib"
    data.mkdir()
    for i, length in enumerate((256, 512, 256, 256)):
        np.savez(data / f"f{i:02d}.npz", x=rng.standard_normal((2, length, 16)).astype(np.float32))
    reports = {}
    for threads in (1, 2):
        out = tmp_path / f"t{threads}.json"
        args = ["analyze", str(model), "--calib", str(data), "-o", str(out), "-q", "--batch-size", "2"]
        assert main([*args, "--fakequant-samples", "0", "--threads", str(threads)]) == 0
        reports[threads] = load_report(out)
    assert reports[1].samples == reports[2].samples == 8
    assert reports[1].tensors == reports[2].tensors


def test_opset_10_models_use_the_graph_engine_and_agree_with_numpy(tmp_path):
    """Opset 10 has no sequence ops: the reductions stack their scalars with Reshape + Concat instead."""
    from tests.models import small_cnn, small_data

    model, calib = small_cnn(tmp_path / "m10.onnx", opset=10), small_data(tmp_path / "c.npz")
    reports = {}
    for engine in ("graph", "numpy"):
        out = tmp_path / f"{engine}.json"
        args = ["analyze", str(model), "--calib", str(calib), "-o", str(out), "-q", "--engine", engine]
        assert main(args) == 0
        reports[engine] = load_report(out)
    g, n = reports["graph"], reports["numpy"]
    assert g.config.fakequant_samples == n.config.fakequant_samples
    compared = 0
    for tg in g.tensors:
        tn = n.tensor(tg.name)
        for a, b in ((tg.accumulated, tn.accumulated), (tg.local, tn.local)):
            if a is None or b is None or not math.isfinite(b.sqnr_db):
                continue
            assert a.sqnr_db == pytest.approx(b.sqnr_db, abs=0.02), tg.name
            compared += 1
    assert compared >= 6


def test_a_fixed_batch_dimension_is_never_cut_into_chunks(tmp_path, monkeypatch):
    """A model whose batch dimension is static must see whole batches, whatever the chunk budget."""
    from tests.models import small_cnn, small_data

    path = small_cnn(tmp_path / "m.onnx")
    model = onnx.load(path)
    for value in (model.graph.input[0], model.graph.output[0]):
        value.type.tensor_type.shape.dim[0].Clear()
        value.type.tensor_type.shape.dim[0].dim_value = 8
    onnx.save(model, path)
    calib = small_data(tmp_path / "c.npz")
    monkeypatch.setattr(graph_engine, "CAPTURE_ELEMENTS", 1)  # would cut every batch into single samples
    out = tmp_path / "r.json"
    args = ["analyze", str(path), "--calib", str(calib), "-o", str(out), "-q", "--batch-size", "8"]
    assert main(args) == 0
    report = load_report(out)
    assert report.samples == 40 and report.tensor("c2").local.count == 40 * 4 * 8 * 8
    assert report.deployed_gap == 0.0


def test_deployed_head_covers_the_fake_quant_samples(transformer_models):
    from qdebug.data import model_input_specs, open_data

    fp32, qdq, pairing, calib = transformer_models
    data = open_data(calib, model_input_specs(fp32), batch_size=8, max_samples=24)
    layers = measure.measure_layers(fp32, qdq, pairing, data, SessionConfig(), fakequant_samples=8)
    assert layers.samples == 24 and layers.fakequant_samples == 8
    checked = 0
    for t in layers.tensors:
        head = layers.deployed_head.get(t.name)
        if head is None or t.accumulated_fakequant is None:
            continue
        assert head.count == t.accumulated_fakequant.count == t.accumulated.count // 3
        checked += 1
    assert checked > 20


def test_permutation_outputs_share_their_sources_statistics(tmp_path, monkeypatch):
    """Reshape/Transpose outputs are not measured twice, and sharing changes no number."""
    reports = {}
    for label in ("shared", "measured"):
        if label == "measured":
            monkeypatch.setattr(measure, "permutation_aliases", lambda *a, **k: {})
        out = tmp_path / f"{label}.json"
        assert main(analyze_args("transformer", out, "--max-samples", "16")) == 0
        reports[label] = load_report(out)
    shared = [t for t in reports["shared"].tensors if t.note.startswith("same values as")]
    assert len(shared) >= 8
    for t in shared:
        u = reports["measured"].tensor(t.name)
        assert t.summary.max == pytest.approx(u.summary.max, abs=1e-6)
        for x, y in ((t.accumulated, u.accumulated), (t.local, u.local)):
            assert (x is None) == (y is None)
            if x is not None and math.isfinite(x.sqnr_db):
                assert x.count == y.count and x.sqnr_db == pytest.approx(y.sqnr_db, abs=1e-4), t.name


def _tiny(path, outputs, nodes, x_shape):
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32), "W")
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)], outputs, [w]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.mark.parametrize("kind", ["scalar_output", "time_major_output"])
def test_outputs_without_a_leading_batch_axis(tmp_path, kind):
    """A scalar output, or a [T, N, C] output: batches are not cut into chunks and both engines agree."""
    from onnx import TensorProto, helper

    mm = helper.make_node("MatMul", ["x", "W"], ["a"], name="mm")
    relu = helper.make_node("Relu", ["a"], ["y"], name="relu")
    if kind == "scalar_output":
        nodes = [mm, relu, helper.make_node("ReduceMean", ["y"], ["s"], name="rm", keepdims=0)]
        outputs = [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, []),
        ]
        x = np.random.default_rng(1).standard_normal((37, 6)).astype(np.float32)
        shape = ["N", 6]
    else:
        nodes = [mm, relu, helper.make_node("Transpose", ["y"], ["t"], name="tm", perm=[1, 0, 2])]
        outputs = [helper.make_tensor_value_info("t", TensorProto.FLOAT, ["T", "N", 4])]
        x = np.random.default_rng(1).standard_normal((37, 5, 6)).astype(np.float32)
        shape = ["N", "T", 6]
    model = _tiny(tmp_path / "m.onnx", outputs, nodes, shape)
    np.savez(tmp_path / "c.npz", x=x)
    reports = analyze_with_both_engines(model, tmp_path / "c.npz", tmp_path, "--metric", "output_sqnr_db")
    g, n = reports["graph"], reports["numpy"]
    assert g.samples == n.samples == 37
    for t in g.tensors:
        if t.accumulated is not None and math.isfinite(t.accumulated.sqnr_db):
            assert t.accumulated.count == n.tensor(t.name).accumulated.count
            assert t.accumulated.sqnr_db == pytest.approx(n.tensor(t.name).accumulated.sqnr_db, abs=0.02)


def test_fake_quantize_uses_dequantize_linears_default_axis():
    """A per-channel DequantizeLinear without an axis attribute quantizes along axis 1."""
    from onnx import helper, numpy_helper

    scale = np.array([0.1, 0.2, 0.4], np.float32)
    zp = np.zeros(3, np.int8)
    qdq = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
            ],
            "g",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4])],
            [helper.make_tensor_value_info("d", onnx.TensorProto.FLOAT, [2, 3, 4])],
            [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zp, "z")],
        )
    )

    class Pair:
        fp32, dequant = "x", "d"

    fq = numpy_engine.local_fake_quant(qdq, [Pair()])["x"]
    assert fq.axis == 1
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    expected = np.clip(np.rint(x / scale[None, :, None]), -128, 127) * scale[None, :, None]
    np.testing.assert_allclose(numpy_engine.fake_quantize(x, fq), expected, rtol=1e-6)


def test_a_shuffling_data_hook_keeps_the_fake_quant_metric_like_for_like(tmp_path, monkeypatch):
    """The fake-quant view reads the data again: a hook that shuffles on each call must not mismatch it."""
    calib = fixture_path("transformer", "calib.npz")
    (tmp_path / "shuffled_hook.py").write_text(
        "import numpy as np\n"
        "def data():\n"
        f"    z = np.load({str(calib)!r})\n"
        "    x, y = z['input'], z['labels']\n"
        "    idx = np.random.permutation(len(x))\n"
        "    for s in range(0, len(x), 16):\n"
        "        yield {'input': x[idx[s:s + 16]], 'labels': y[idx[s:s + 16]]}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "r.json"
    model = fixture_path("transformer", "model.onnx")
    assert main(["analyze", str(model), "--calib", "shuffled_hook:data", "-o", str(out), "-q"]) == 0
    task = load_report(out).task
    # scored against its own pass's FP32 outputs and labels: close to the deployed accuracy, not ~10 %
    assert task.fakequant_samples == 32 and task.quantized_fakequant > 0.7
    assert math.isfinite(task.quantized_same_samples)


def test_a_single_threaded_session_is_reopened_only_where_threads_can_win_back_its_opening():
    """After sizing settles on one worker: reopening with ORT's threads pays when half the single-threaded time
    of the rows left exceeds what the session took to open; unknown rows (the main pass) always reopen."""
    from types import SimpleNamespace

    worth = graph_engine.GraphPath._worth_reopening
    state = dict(splittable=True, _first_seconds=0.01, _opened={"fakequant.onnx": 2.5})
    assert not worth(SimpleNamespace(fq_rows=32, **state), "fakequant.onnx", 16)  # 0.155 s to win, 2.5 s to pay
    assert worth(SimpleNamespace(fq_rows=1000, **state), "fakequant.onnx", 16)  # 5 s to win
    assert worth(SimpleNamespace(fq_rows=None, **state), "fakequant.onnx", 16)
    assert worth(SimpleNamespace(fq_rows=32, **state), "main.onnx", 16)
