"""Compare FP32, dynamic, static and selective-static variants fairly: speed, memory, size, accuracy.

Builds every variant from the same normalized FP32 model (static ones from the
cached calibration ranges, the selective one from a proposal), scores each on
the evaluation set, then times each in its own process with the same inputs,
batch shape, provider and threads: session created once, input buffers
refilled in place, outputs bound to preallocated buffers (ORT IO binding),
warm-up excluded, the smaller last batch timed separately. Prints a table,
writes JSON (-o) and an SVG chart of accuracy vs latency (--chart).

Exits with 4 when a variant failed to build or run (the others are still
measured and written).

for example:
  qdebug bench model.onnx --calib calib.npz --eval eval.npz
  qdebug bench model.onnx --calib calib.npz --eval eval.npz --proposal proposal.json \\
      --variants fp32,dynamic,static,selective --method minmax,entropy --threads 4 -o bench.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from qdebug.cli.common import (
    add_parallel_arguments,
    add_quant_arguments,
    batch_axes_arg,
    fmt_db,
    fmt_metric,
    positive_float,
    quant_request,
    runtime_settings,
)
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.ci_outputs import MARKDOWN_HELP
from qdebug.output.formatting import fmt_size, prefix_note, table_names

if TYPE_CHECKING:  # qdebug.bench loads onnxruntime: imported when a command runs, not for --help
    from qdebug.bench import BenchOptions
    from qdebug.records.bench import BenchReport


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug bench``."""
    p.add_argument("model", help="FP32 ONNX model")
    p.add_argument(
        "--calib", required=True, help="calibration data: .npz, folder of .npz, or module:function"
    )
    p.add_argument(
        "--eval", default=None, help="evaluation data, timed and scored (default: the calibration data)"
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated: fp32,dynamic,static,selective,qoperator "
        "(default: fp32,dynamic,static, plus selective with --proposal)",
    )
    p.add_argument(
        "--proposal", default=None, help="proposal.json from qdebug propose (for the selective variant)"
    )
    p.add_argument(
        "--dynamic-ops",
        default=None,
        help="op types for dynamic quantization, e.g. MatMul,Gemm (default: ORT's)",
    )
    p.add_argument(
        "--runs", type=int, default=5, help="timed passes over the evaluation set per variant (default: 5)"
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed runs of each batch shape first (default: 3)"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        metavar="SECONDS",
        help="a variant's process that takes longer to start, to finish one timed pass or to write its "
        "result is killed and the variant reported as an error (default: 600)",
    )
    p.add_argument(
        "-o", "--output", default="qdebug-bench.json", help="JSON result (default: qdebug-bench.json)"
    )
    p.add_argument(
        "--chart", default=None, help="SVG chart of accuracy vs latency (default: the -o path with .svg)"
    )
    p.add_argument("--no-chart", action="store_true", help="do not write the chart")
    p.add_argument("--markdown", default=None, metavar="FILE", help=MARKDOWN_HELP)
    p.add_argument(
        "--no-dynamic-layers",
        action="store_true",
        help="skip the dynamic variant's per-layer error report (one extra pass over the calibration data)",
    )
    add_quant_arguments(p, several_methods=True, from_proposal=True)
    add_parallel_arguments(p, what="accuracy evaluations of the variants (never the timing)")


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """BenchOptions from parsed flags."""
    from qdebug.bench import BenchOptions, parse_methods, parse_variants

    if args.variants is not None:  # --variants "" is refused, not read as the default set
        variants = parse_variants(args.variants)
    else:
        variants = ("fp32", "dynamic", "static") + (("selective",) if args.proposal else ())
    dynamic_ops = tuple(o.strip() for o in (args.dynamic_ops or "").split(",") if o.strip())
    methods = parse_methods(args.method) if args.method is not None else ()
    if args.calib_percentile is not None:
        if methods and "percentile" not in methods:
            raise QDebugError(
                "--calib-percentile is the percentile method's option, and --method has no percentile",
                "add percentile to --method, or drop --method",
                ExitCode.USAGE,
            )
        methods = methods or ("percentile",)
    return BenchOptions(
        variants=variants,
        methods=methods,
        quant=quant_request(args, with_method=False),  # unset: the proposal's
        runtime=runtime_settings(args),
        dynamic_ops=dynamic_ops,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        batch_axes=batch_axes_arg(args),
        metric=args.metric,
        runs=args.runs,
        warmup=args.warmup,
        dynamic_layers=not args.no_dynamic_layers,
        timeout_s=args.timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the table."""
    from qdebug.bench import run_bench
    from qdebug.cli.progress import stderr_progress
    from qdebug.errors import ExitCode
    from qdebug.output import ci_outputs

    options = bench_options(args)
    chart = None if args.no_chart else (args.chart or str(Path(args.output).with_suffix(".svg")))
    ci_outputs.check_ci_outputs(args, (args.model, args.calib, args.eval, args.proposal), (args.output, chart))
    with stderr_progress(not args.quiet) as progress:
        report = run_bench(
            args.model,
            args.calib,
            eval_data=args.eval,
            proposal=args.proposal,
            output=args.output,
            chart=chart,
            options=options,
            progress=progress,
        )
    print_table(report)
    ci_outputs.write_ci_outputs(args, report)
    if report.machine.warning:
        print(f"qdebug: warning: {report.machine.warning}", file=sys.stderr)
    print(f"\nresults written to {args.output}" + (f", chart to {chart}" if chart else ""), file=sys.stderr)
    failed = [v.name for v in report.variants if v.error]
    return int(ExitCode.MODEL) if failed else 0


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def _float_weights(v) -> str:
    """``"49.0 KiB 82%"``: the variant's float weights and their share of its weights -- what quantization did
    not shrink (``-`` in a bench.json written before the field)."""
    if v.float_weight_bytes is None or not v.weight_bytes:
        return "-"
    if not v.float_weight_bytes:
        return "none"
    return f"{fmt_size(v.float_weight_bytes)} {v.float_weight_bytes / v.weight_bytes:.0%}"


WORST_NAME_WIDTH = 48
"""Cells for one node name in the worst-layers lines (three per line; the full names are in the JSON)."""


def _print_worst_layers(console, report: BenchReport) -> None:
    """Each variant's three worst layers, their names shortened together (:func:`table_names`)."""
    shown = [(v, v.worst_layers[:3]) for v in report.variants if v.worst_layers]
    names = [w.node for _, worst in shown for w in worst]
    prefix, short = table_names(names, WORST_NAME_WIDTH)
    if prefix:
        console.print(prefix_note(prefix, "the results JSON and the per-layer reports"))
    it = iter(short)
    for v, worst in shown:
        text = ", ".join(f"{next(it)} ({w.op_type}, adds {fmt_db(w.added_noise_db)} dB noise)" for w in worst)
        console.print(f"{v.name}: worst layers {text}; per-layer report {v.layer_report} (qdebug tui)")


def print_table(report: BenchReport) -> None:
    """The machine, one row per variant, the tail batches and notes, on stdout."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # names and errors come from the model: printed as they are, never read as Rich markup
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
    m = report.machine
    flags = ", ".join(m.int8_flags) or "none"
    console.print(
        f"machine: {m.cpu_model} ({m.arch}, {m.cpus_available} CPUs available), INT8 flags: {flags}; "
        f"ORT {m.ort_version}, {m.providers[0]}, threads {m.threads or 'auto'}"
    )
    console.print(
        f"{report.samples} samples in batches of {report.batch_size}, {report.runs} timed passes, "
        f"{report.warmup} warm-up runs per batch shape; metric {report.metric}"
    )
    table = Table(title="variants (latency per batch; speedup vs FP32 p50)")
    cols = (
        "variant",
        "size",
        "float wts",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "samples/s",
        "speedup",
        "peak RSS MiB",
        "py B/batch",
        report.metric,
        "out SQNR dB",
    )
    for c in cols:
        table.add_column(c, justify="left" if c == "variant" else "right")
    for v in report.variants:
        if v.error or v.full is None:
            table.add_row(v.name, fmt_size(v.model_bytes), _float_weights(v), "failed", *[""] * 8)
            continue
        f = v.full
        table.add_row(
            v.name,
            fmt_size(v.model_bytes),
            _float_weights(v),
            _ms(f.p50_ms),
            _ms(f.p95_ms),
            _ms(f.p99_ms),
            f"{f.throughput:.1f}",
            "-" if not math.isfinite(v.speedup) else f"{v.speedup:.2f}x",
            f"{v.peak_rss_mb:.0f}",
            f"{v.alloc_bytes_per_batch:.0f}",
            fmt_metric(report.metric, v.metric_value),
            fmt_db(v.output_sqnr_db),
        )
    console.print(table)
    tails = [v for v in report.variants if v.tail is not None]
    if tails:
        t0, sizes = tails[0].tail, tails[0].tail_sizes
        what = (
            f"smaller batches ({', '.join(map(str, sizes))} samples, mean {t0.batch_size}"
            if len(sizes) > 1
            else f"last batch ({t0.batch_size} samples"
        )
        console.print(
            f"{what}, timed separately, not padded): "
            + "  ".join(f"{v.name} p50 {_ms(v.tail.p50_ms)} ms" for v in tails)
        )
    _print_worst_layers(console, report)
    for v in report.variants:
        if v.error:
            console.print(Text(f"{v.name} failed", style="red") + Text(f": {v.error}"))
        for note in v.notes:
            console.print(f"note: {v.name}: {note}")
        if v.binding and v.binding != "iobinding":
            console.print(
                f"note: {v.name} timed with {v.binding} (IO binding to preallocated outputs refused)"
            )
    for note in report.notes:
        console.print(f"note: {note}")
