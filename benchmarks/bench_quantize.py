"""Benchmark: ORT's plain quantizer path vs qdebug's indexed one, on generated graphs of 800-3,200 nodes.

The model is the one of docs/benchmarks.md "large graphs": 8-node residual blocks (MatMul, Add, Relu,
MatMul, Add, Mul, Add, LayerNormalization) on a ``[B, 16]`` tensor. For each size, in one process:

  calibrate   qdebug.quant.calibrate.calibrate (no cache), 32 samples: ORT's MinMax calibrator, whose
              augment_graph is plain (quadratic) or qdebug's (linear)
  quantize    qdebug.quant.quantize.quantize_static_model from the cached ranges (what propose and verify run
              per variant): ORT's QDQQuantizer over ORT's ONNXModel (plain) or qdebug's IndexedModel
              (fast), plus qdebug's own checks, of which "load check" is the ORT session that proves the
              model loads (the same in both)

Both paths must give byte-identical models and identical ranges (checked here too). The fast path is
timed ``--repeat`` times (median); the plain one once per size (minutes at 3,200 nodes).

Usage:
  python benchmarks/bench_quantize.py --sizes 800,1600,3200
Writes a markdown table to stdout (copied into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK_NODES = 8


def make_chain(blocks: int, *, width: int = 16, seed: int = 0, variety: bool = False) -> onnx.ModelProto:
    """``blocks`` residual blocks of 8 nodes (the "large graphs" model), shape-inferred, opset 17.

    ``variety`` adds to every block a Reshape, a Gemm with bias, a Softmax, a Concat with the block's
    output and a MatMul back to ``width`` (parameter sharing, bias quantization, a tensor read by three
    nodes), and makes every third block's output a graph output as well (ORT's graph-output path): the
    paths of ORT's quantizer the tests compare beyond the benchmark's.
    """
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    outputs: list[str] = []

    def init(name: str, arr: Any, dtype: Any = np.float32) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr, dtype=dtype), name))
        return name

    def node(op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        out = f"{name}.out"
        nodes.append(helper.make_node(op, inputs, [out], name=name, **attrs))
        return out

    x = "x"
    for b in range(blocks):
        p = f"b{b}"
        h = node("MatMul", [x, init(f"{p}.w1", rng.normal(0, 0.3, (width, width)))], f"{p}/mm1")
        h = node("Add", [h, init(f"{p}.b1", rng.normal(0, 0.1, width))], f"{p}/add1")
        h = node("Relu", [h], f"{p}/relu")
        h = node("MatMul", [h, init(f"{p}.w2", rng.normal(0, 0.3, (width, width)))], f"{p}/mm2")
        h = node("Add", [h, init(f"{p}.b2", rng.normal(0, 0.1, width))], f"{p}/add2")
        h = node("Mul", [h, init(f"{p}.s", rng.normal(1, 0.1, width))], f"{p}/mul")
        h = node("Add", [h, x], f"{p}/res")
        x = node("LayerNormalization", [h, init(f"{p}.g", np.ones(width)), init(f"{p}.be", np.zeros(width))],
                 f"{p}/ln", axis=-1)
        if variety:
            if b % 3 == 2:
                outputs.append(x)
            r = node("Reshape", [x, init(f"{p}.shape", [-1, width], np.int64)], f"{p}/reshape")
            g = node("Gemm", [r, init(f"{p}.wg", rng.normal(0, 0.3, (width, width))),
                              init(f"{p}.bg", rng.normal(0, 0.1, width))], f"{p}/gemm", transB=1)
            s = node("Softmax", [g], f"{p}/softmax", axis=-1)
            c = node("Concat", [s, x, r], f"{p}/concat", axis=-1)
            x = node("MatMul", [c, init(f"{p}.wc", rng.normal(0, 0.2, (3 * width, width)))], f"{p}/proj")
    outputs.append(x)
    graph = helper.make_graph(
        nodes,
        f"chain{blocks}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["N", width]) for o in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def chain_data(path: Path, n: int = 32, width: int = 16, seed: int = 1) -> Path:
    """``n`` calibration samples for :func:`make_chain`."""
    np.savez(path, x=np.random.default_rng(seed).normal(0, 1, (n, width)).astype(np.float32))
    return path


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _load_check_seconds(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(wall, seconds in quantize's ORT load check, result) of ``fn``."""
    import qdebug.quant.quantize as q

    spent = [0.0]
    original = q._ort_load_error

    def timed(model: onnx.ModelProto) -> str | None:
        t = time.perf_counter()
        try:
            return original(model)
        finally:
            spent[0] += time.perf_counter() - t

    q._ort_load_error = timed
    try:
        wall, out = _timed(fn)
    finally:
        q._ort_load_error = original
    return wall, spent[0], out


def measure(nodes: int, tmp: Path, repeat: int, plain: bool) -> dict[str, Any]:
    """One size: calibration and re-quantization, fast (median of ``repeat``) and plain (once)."""
    from qdebug.prepare import AnalyzeOptions, prepare
    from qdebug.quant import fast_quantize
    from qdebug.quant.calibrate import _dump_tensors_data, calibrate
    from qdebug.quant.quantize import QuantSpec, quantize_static_model

    model = make_chain(nodes // BLOCK_NODES)
    path = tmp / f"chain{nodes}.onnx"
    onnx.save(model, path)
    prep = prepare(path, chain_data(tmp / "calib.npz"), tmp / f"w{nodes}", AnalyzeOptions(), need_ranges=False)
    sha = "bench"  # no cache is read or written

    def calib() -> Any:
        return calibrate(prep.normalized_path, sha, prep.calib, use_cache=False)

    row: dict[str, Any] = {"nodes": len(prep.normalized.graph.node)}
    fast_cal = [_timed(calib) for _ in range(repeat)]
    ranges = fast_cal[0][1]
    row["calib_fast"] = statistics.median(t for t, _ in fast_cal)
    spec = QuantSpec()
    fast_q = [_load_check_seconds(lambda: quantize_static_model(prep.normalized, ranges, spec)) for _ in range(repeat)]
    row["quant_fast"] = statistics.median(t for t, _, _ in fast_q)
    row["load_check"] = statistics.median(c for _, c, _ in fast_q)
    fast_bytes = fast_q[0][2].SerializeToString(deterministic=True)
    row["q_nodes"] = len(fast_q[0][2].graph.node)
    if plain:
        with fast_quantize.plain_path():
            row["calib_plain"], plain_ranges = _timed(calib)
            row["quant_plain"], _, plain_model = _load_check_seconds(
                lambda: quantize_static_model(prep.normalized, ranges, spec)
            )
        row["identical"] = plain_model.SerializeToString(deterministic=True) == fast_bytes and json.dumps(
            _dump_tensors_data(plain_ranges.tensors)
        ) == json.dumps(_dump_tensors_data(ranges.tensors))
    return row


def table(rows: Sequence[dict[str, Any]]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    lines = [
        "| nodes (QDQ nodes) | calibrate plain | calibrate fast | re-quantize plain | re-quantize fast "
        "| of which load check | speed-up (re-quantize) | identical |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        speed = f"{r['quant_plain'] / r['quant_fast']:.0f}x" if "quant_plain" in r else "-"
        lines.append(
            f"| {r['nodes']:,} ({r['q_nodes']:,}) | {s(r.get('calib_plain'))} | {s(r['calib_fast'])} "
            f"| {s(r.get('quant_plain'))} | {s(r['quant_fast'])} | {s(r['load_check'])} | {speed} "
            f"| {'yes' if r.get('identical') else ('-' if 'identical' not in r else 'NO')} |"
        )
    first, last = rows[0], rows[-1]
    if last["nodes"] > first["nodes"]:
        grow = last["nodes"] / first["nodes"]
        lines.append("")
        lines.append(
            f"Growth {first['nodes']:,} -> {last['nodes']:,} nodes ({grow:.0f}x): re-quantize fast "
            f"{last['quant_fast'] / first['quant_fast']:.1f}x (without the load check "
            f"{(last['quant_fast'] - last['load_check']) / (first['quant_fast'] - first['load_check']):.1f}x), "
            f"calibrate fast {last['calib_fast'] / first['calib_fast']:.1f}x"
            + (f", re-quantize plain {last['quant_plain'] / first['quant_plain']:.1f}x" if "quant_plain" in last
               and "quant_plain" in first else "")
            + "."
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="800,1600,3200", help="node counts (multiples of 8)")
    parser.add_argument("--repeat", type=int, default=3, help="fast-path runs per size (median)")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain path (minutes at 3,200 nodes)")
    args = parser.parse_args(argv)
    import onnxruntime

    rows = []
    with tempfile.TemporaryDirectory(prefix="qdebug-bench-quantize-") as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            rows.append(measure(size, Path(tmp), args.repeat, not args.no_plain))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    print(
        f"\nonnxruntime {onnxruntime.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"fast runs: median of {args.repeat}"
    )
    return 1 if any(r.get("identical") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
