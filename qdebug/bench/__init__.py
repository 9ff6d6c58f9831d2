"""``qdebug bench``: a fair deployment comparison of FP32 and quantized variants.

Every variant is built from the same normalized FP32 model
(:func:`qdebug.prepare.prepare`): dynamic quantization (QInt8 weights),
static QDQ from the cached calibration ranges (one per calibration method),
selective static from a :class:`~qdebug.records.Proposal`, optionally the
QOperator format; per-channel weights on request. Then, for each variant:

* the task metric and the output SQNR vs FP32 on the evaluation set
  (:class:`~qdebug.evaluation.evaluate.Evaluator`, in this process, not timed);
* latency, throughput, peak RSS and Python-side allocations, measured in a
  process of its own (:mod:`qdebug.runtime.bench_child`), on byte-identical input
  batches written once by this process, with the same provider, threads
  and batch shape for all of them.

The machine is part of the result: CPU model, the INT8-relevant instruction
set flags, the ORT version and provider, with a warning when INT8 speed-ups
are unlikely on this CPU (no VNNI/AMX on x86, no dot-product on Arm).

Modules:

* :mod:`~qdebug.bench.run`: :func:`run_bench`, the command's stages in order;
* :mod:`~qdebug.bench.options`: :class:`BenchOptions`;
* :mod:`~qdebug.bench.variants`: building the variants;
* :mod:`~qdebug.bench.children`: timing each in its own process, latency statistics;
* :mod:`~qdebug.bench.machine`: the CPU and its INT8 instruction sets;
* :mod:`~qdebug.bench.chart`: the SVG chart;
* :mod:`~qdebug.bench.dynamic`: the dynamic variant's per-layer report.

The ``bench.json`` records live in :mod:`qdebug.records.bench` and load with
:func:`qdebug.output.report_io.load_bench`: the TUI imports those, never this
package, which imports onnx and onnxruntime. The measuring process's own
code, :mod:`qdebug.runtime.bench_child`, stays outside this package so that running
it does not import this one.
"""

from qdebug.bench.chart import chart_svg, nice_ticks
from qdebug.bench.children import (
    HANDOVER_PAUSE_S,
    child_spec,
    latency_stats,
    run_child,
    run_children_interleaved,
    write_batches,
)
from qdebug.bench.dynamic import dynamic_layer_report
from qdebug.bench.machine import (
    ARM_FAST,
    ARM_INT8_FLAGS,
    X86_FAST,
    X86_INT8_FLAGS,
    int8_flags,
    int8_warning,
    machine_info,
    parse_cpuinfo,
)
from qdebug.bench.options import BenchOptions
from qdebug.bench.run import run_bench, worst_layers
from qdebug.bench.variants import parse_methods, parse_variants
from qdebug.graph.match_dynamic import pair_dynamic
from qdebug.output.report_io import load_bench
from qdebug.records.bench import (
    BENCH_SCHEMA_VERSION,
    KINDS,
    BenchReport,
    LatencyStats,
    MachineInfo,
    VariantResult,
    WorstLayer,
)

__all__ = [
    "ARM_FAST",
    "ARM_INT8_FLAGS",
    "BENCH_SCHEMA_VERSION",
    "HANDOVER_PAUSE_S",
    "KINDS",
    "X86_FAST",
    "X86_INT8_FLAGS",
    "BenchOptions",
    "BenchReport",
    "LatencyStats",
    "MachineInfo",
    "VariantResult",
    "WorstLayer",
    "chart_svg",
    "child_spec",
    "dynamic_layer_report",
    "int8_flags",
    "int8_warning",
    "latency_stats",
    "load_bench",
    "machine_info",
    "nice_ticks",
    "pair_dynamic",
    "parse_cpuinfo",
    "parse_methods",
    "parse_variants",
    "run_bench",
    "run_child",
    "run_children_interleaved",
    "worst_layers",
    "write_batches",
]
