"""Benchmark: how much propose's and verify's FP32/INT8 speed ratio moves between repeats, idle and under load.

qdebug times the models it compares side by side in one process (:func:`qdebug.runtime.timing.time_sessions`:
one session each, interleaved rounds of 10 runs). ONNX Runtime's intra-op threads spin after a run by default;
with several sessions in one process, a finished session's spinning threads take the cores the next model's
run needs. This script times the same FP32/INT8 pair ``--repeats`` times with the threads spinning (ORT's
default, which qdebug keeps) and not, idle and with one CPU-bound process beside it (``--load``), and prints
each repeat's speed-up (FP32 p50 / INT8 p50) and the spread (largest / smallest). For the default threads it
also prints what verify's and propose's tables say of each repeat: the median of the per-round ratios, their
range, and the verdict (faster or slower only where every interleaved round says so, else within the noise).

The pairs are the bench-size planted gain kinds (``fixtures/planted.py``): ``dynamic_lstm`` FP32 against its
``quantize_dynamic`` model, ``mixed_conv`` FP32 against static Conv + dynamic MatMul.

Usage:
  python benchmarks/bench_timing_load.py [--repeats 5] [--runs 30] [--load both|idle|busy]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "fixtures"))

import planted  # noqa: E402


def _burn(stop) -> None:  # one busy process beside the timing
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1000003


def _pairs(work: Path) -> dict[str, tuple[onnx.ModelProto, onnx.ModelProto, dict[str, np.ndarray]]]:
    out = {}
    for kind in ("dynamic_lstm", "mixed_conv"):
        rec = planted.make(kind, work / kind, "bench")
        quant = planted.quantize_as(rec, work / kind / "q.onnx", rec.fix)
        data = dict(np.load(rec.eval))
        data.pop("labels", None)
        feeds = {k: v[:16] for k, v in data.items()}
        out[kind] = (onnx.load(rec.model), onnx.load(str(quant)), feeds)
    return out


def _speedups(pair, spinning: bool, repeats: int, runs: int) -> list[tuple[float, object]]:
    """Each repeat's FP32 p50 / INT8 p50, with its per-round :class:`~qdebug.records.verify.SpeedRatio`."""
    from qdebug.records.verify import speed_ratio
    from qdebug.runtime import capture, timing
    from qdebug.runtime.capture import SessionConfig

    real = capture.make_session

    def session(model, config, **kw):
        kw["spinning"] = spinning
        return real(model, config, **kw)

    timing.make_session = session
    try:
        fp32, quant, feeds = pair
        out = []
        for _ in range(repeats):
            t = timing.time_sessions({"fp32": fp32, "int8": quant}, feeds, SessionConfig(), runs=runs)
            out.append((t["fp32"].p50_ms / t["int8"].p50_ms, speed_ratio(t["fp32"].rounds_ms, t["int8"].rounds_ms)))
        return out
    finally:
        timing.make_session = real


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--load", choices=("both", "idle", "busy"), default="both")
    args = ap.parse_args(argv)
    loads = ("idle", "busy") if args.load == "both" else (args.load,)
    with tempfile.TemporaryDirectory(prefix="bench-timing-") as tmp:
        pairs = _pairs(Path(tmp))
        print("| pair | machine | threads | speed-up FP32/INT8 per repeat | spread | tables' ratio (range): verdict |")
        print("|---|---|---|---|---|---|")
        for load in loads:
            stop = multiprocessing.Event()
            burner = multiprocessing.Process(target=_burn, args=(stop,)) if load == "busy" else None
            if burner is not None:
                burner.start()
            try:
                for kind, pair in pairs.items():
                    for spinning in (True, False):
                        rows = _speedups(pair, spinning, args.repeats, args.runs)
                        r = [x for x, _ in rows]
                        label = "spinning (ORT default, qdebug)" if spinning else "not spinning"
                        each = " ".join(f"{x:.2f}" for x in r)
                        said = "; ".join(f"{s.show()}: {s.verdict}" for _, s in rows if s is not None)
                        said = said if spinning else "-"
                        print(f"| {kind} | {load} | {label} | {each} | {max(r) / min(r):.2f} | {said} |", flush=True)
            finally:
                if burner is not None:
                    stop.set()
                    burner.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
