"""Benchmark: ONNX Runtime's own session start-up against the node count -- the part of analyze's growth
qdebug cannot remove.

analyze at 800 -> 3,200 nodes grows by more than the 4x of the graph (docs/benchmarks.md, "large graphs"),
and its profile puts most of the excess in ``InferenceSession.__init__`` (``initialize_session``, ORT's
C++), for every session it opens: the instrumented capture models, the fake-quant view, the evaluator's.
This measures that call alone on the generated chain (``bench_quantize.make_chain``) and its static QDQ
model, with ORT's graph optimizations on (what qdebug runs) and off: if the growth is superlinear with the
optimizations off too, it is in ORT's graph construction and resolution, not in a fusion qdebug could skip.
A second table strips it further: bare chains of N ``Add`` nodes (or ``QuantizeLinear``/``DequantizeLinear``
pairs), each with its own scalar initializer, on ``[1, 16]``, optimizations off.

A third table: bare ``Relu`` graphs of several sizes and widths, opened as one session and as the slices qdebug's
capture opens a large model in (:mod:`qdebug.graph.segment`); a fourth, the merged capture models analyze opens
on the chain, each opened both ways.

Usage:
  python benchmarks/bench_session_init.py --sizes 800,1600,3200 [--runs 3]
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_quantize import chain_data, make_chain  # noqa: E402

from qdebug.prepare import AnalyzeOptions, prepare  # noqa: E402
from qdebug.quant.quantize import QuantSpec, quantize_static_model  # noqa: E402


def _start(path: Path, optimized: bool, runs: int) -> float:
    """Median seconds of ``InferenceSession(path)`` on the CPU provider (memory pattern off, as qdebug's
    capture sessions run)."""
    times = []
    for _ in range(runs):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.enable_mem_pattern = False
        if not optimized:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        start = time.perf_counter()
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bare_chain(n: int, qdq: bool) -> bytes:
    """``n`` Add nodes (``qdq``: Q/DQ pairs) in a chain on ``[1, 16]``, each with its own initializers."""
    nodes, inits, prev = [], [], "x"
    for i in range(n):
        inits.append(numpy_helper.from_array(np.array(1.0 + i * 1e-6, np.float32), f"c{i}"))
        if qdq:
            inits.append(numpy_helper.from_array(np.array(128, np.uint8), f"z{i}"))
            nodes.append(helper.make_node("QuantizeLinear", [prev, f"c{i}", f"z{i}"], [f"q{i}"], name=f"q{i}"))
            nodes.append(helper.make_node("DequantizeLinear", [f"q{i}", f"c{i}", f"z{i}"], [f"y{i}"], name=f"d{i}"))
        else:
            nodes.append(helper.make_node("Add", [prev, f"c{i}"], [f"y{i}"], name=f"n{i}"))
        prev = f"y{i}"
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 16])], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _start_bytes(data: bytes, runs: int) -> float:
    times = []
    for _ in range(runs):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.enable_mem_pattern = False
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        start = time.perf_counter()
        ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(nodes: int, tmp: Path, runs: int) -> dict:
    fp32 = tmp / f"chain{nodes}.onnx"
    onnx.save(make_chain(nodes // 8), fp32)
    prep = prepare(fp32, chain_data(tmp / "calib.npz", 8), tmp / f"w{nodes}", AnalyzeOptions(use_cache=False))
    qdq = tmp / f"qdq{nodes}.onnx"
    model = quantize_static_model(prep.normalized, prep.ranges, QuantSpec(), qdq)
    row = {"nodes": nodes, "qdq_nodes": len(model.graph.node)}
    for label, path in (("fp32", fp32), ("qdq", qdq)):
        row[f"{label}_opt"] = _start(path, True, runs)
        row[f"{label}_noopt"] = _start(path, False, runs)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="800,1600,3200")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, Path(tmp), args.runs) for n in sizes]
    print(f"machine: {platform.machine()}, {platform.python_version()}, onnxruntime {ort.__version__}\n")
    print("| nodes | QDQ nodes | FP32 start, optimized | FP32, optimizations off | QDQ start, optimized | QDQ, off |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['nodes']:,} | {r['qdq_nodes']:,} | {r['fp32_opt']:.3f} s | {r['fp32_noopt']:.3f} s "
              f"| {r['qdq_opt']:.3f} s | {r['qdq_noopt']:.3f} s |")  # fmt: skip
    first, last = rows[0], rows[-1]
    grow = last["nodes"] / first["nodes"]
    print(f"\ngrowth {first['nodes']:,} -> {last['nodes']:,} nodes ({grow:.0f}x): " + ", ".join(
        f"{k} {last[k] / first[k]:.1f}x" for k in ("fp32_opt", "fp32_noopt", "qdq_opt", "qdq_noopt")))  # fmt: skip
    bare = [2000, 4000, 8000]
    print("\n| bare chain, optimizations off | " + " | ".join(f"{n:,} nodes" for n in bare) + " | growth for 4x |")
    print("|---|" + "---:|" * (len(bare) + 1))
    for label, qdq in (("Add + its own scalar", False), ("Q/DQ pair + own scale, zero point", True)):
        times = [_start_bytes(bare_chain(n if not qdq else n // 2, qdq), args.runs) for n in bare]
        cells = " | ".join(f"{t:.3f} s" for t in times)
        print(f"| {label} | {cells} | {times[-1] / times[0]:.1f}x |")
    _width_and_slices(args.runs)
    print("\n| capture model (graph), optimizations off | nodes | one session | sliced | sliced/one |")
    print("|---|---:|---:|---:|---:|")
    for nodes in sizes:
        for name, count, whole, cut in _capture_models(nodes, args.runs):
            print(f"| {name} ({nodes:,}-node chain) | {count:,} | {whole:.2f} s | {cut:.2f} s | {cut / whole:.2f} |")
    return 0


def _capture_models(nodes: int, runs: int) -> list[tuple[str, int, float, float]]:
    """(model, nodes, one session s, sliced s) for each merged capture model analyze opens on the chain: its
    own opening (``open_sliced``) is wrapped to time both ways on the same file first (medians of ``runs``)."""
    import qdebug.analysis.graph_engine as engine
    from qdebug.cli.main import main as qdebug_main

    rows = []
    real = engine.open_sliced

    def timed(path: Path, open_one, **kwargs):
        count = len(onnx.load(str(path), load_external_data=False).graph.node)
        ways = []
        for way in (open_one, lambda p: real(p, open_one, **kwargs)):
            seconds = []
            for _ in range(runs):
                start = time.perf_counter()
                way(path)
                seconds.append(time.perf_counter() - start)
            ways.append(statistics.median(seconds))
        rows.append((path.stem, count, *ways))
        return real(path, open_one, **kwargs)

    engine.open_sliced = timed
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = Path(tmp) / "chain.onnx"
            onnx.save(make_chain(nodes // 8), model)
            calib = chain_data(Path(tmp) / "calib.npz", 32)
            argv = ["analyze", str(model), "--calib", str(calib), "-o", str(Path(tmp) / "r.json"), "-q", "--no-cache"]
            assert qdebug_main(argv) == 0
    finally:
        engine.open_sliced = real
    return rows


def relu_graph(width: int, depth: int) -> onnx.ModelProto:
    """``width`` parallel chains of ``depth`` Relu nodes from one input: no initializers, no attributes."""
    nodes, outputs = [], []
    for w in range(width):
        prev = "x"
        for i in range(depth):
            nodes.append(helper.make_node("Relu", [prev], [f"y{w}_{i}"], name=f"n{w}_{i}"))
            prev = f"y{w}_{i}"
        outputs.append(helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 16]))
    graph = helper.make_graph(nodes, "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _width_and_slices(runs: int) -> None:
    """ORT's start-up per node against the node count and the graph's width, and the same graph opened as
    qdebug's capture opens a large model with optimizations off: slices of ``SEGMENT_NODES``, one session each
    (:func:`qdebug.runtime.capture.open_sliced`)."""
    from qdebug.graph.segment import SEGMENT_NODES
    from qdebug.runtime.capture import SessionConfig, make_session, open_sliced

    sliced = f"sliced ({SEGMENT_NODES:,} nodes)"
    print(f"\n| Relu graph, optimizations off | nodes | one session | per node | {sliced} | per node |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for width, depth in ((1, 4000), (1, 16000), (16, 1000), (64, 250), (1, 64000)):
            path = Path(tmp) / f"relu{width}x{depth}.onnx"
            onnx.save(relu_graph(width, depth), path)
            whole = _start(path, False, runs)
            sliced = []
            for _ in range(runs):
                start = time.perf_counter()
                open_sliced(path, lambda p: make_session(p, SessionConfig(), optimize=False, mem_pattern=False))
                sliced.append(time.perf_counter() - start)
            n = width * depth
            cut = statistics.median(sliced)
            print(f"| {width} x {depth:,} | {n:,} | {whole:.3f} s | {1e6 * whole / n:.0f} us "
                  f"| {cut:.3f} s | {1e6 * cut / n:.0f} us |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
