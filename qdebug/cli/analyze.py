"""Measure where quantization error enters a model, layer by layer.

Calibrates once (cached), builds the static QDQ model (or takes yours with
--quantized), runs FP32 and QDQ over the calibration data one batch at a
time, and writes a versioned JSON report with local and accumulated error
(SQNR, MSE, cosine, max-abs, KL) for every float tensor.

Example:
  qdebug analyze model.onnx --calib calib.npz --eval eval.npz -o report.json

"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from qdebug.cli.common import add_quant_arguments, analyze_options, fmt_db, fmt_metric, non_negative_int
from qdebug.cli.progress import stderr_progress
from qdebug.formatting import ACCURACY_METRICS


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug analyze``."""
    p.add_argument("model", help="FP32 ONNX model")
    p.add_argument(
        "--calib", required=True, help="calibration data: .npz, folder of .npz, or module:function"
    )
    p.add_argument(
        "--eval", default=None, help="evaluation data with a 'labels' array (default: calibration data)"
    )
    p.add_argument(
        "--quantized", default=None, help="your own QDQ model (default: qdebug quantizes with ORT)"
    )
    p.add_argument(
        "-o", "--output", default="qdebug-report.json", help="report path (default: qdebug-report.json)"
    )
    p.add_argument("--csv", default=None, help="also write one CSV row per node to this path")
    p.add_argument(
        "--top", type=non_negative_int, default=10, help="rows in the worst-layers summary (default: 10)"
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=("auto", "graph", "numpy"),
        help="capture engine: reductions inside ORT (graph, fast) or float64 numpy copies (exact); default auto",
    )
    p.add_argument(
        "--fakequant-samples",
        default=None,
        metavar="N|all",
        help="run the fake-quant view (the QDQ model without ORT's integer kernels, to expose kernel "
        "problems) on the first N samples; 0 skips it (default: 32)",
    )
    add_quant_arguments(p)


def _fakequant_samples(value: str | None) -> int | None:
    """``--fakequant-samples``: a count, ``all`` (None), or the default when not given."""
    from qdebug.analysis import DEFAULT_FAKEQUANT_SAMPLES
    from qdebug.errors import ExitCode, QDebugError

    if value is None:
        return DEFAULT_FAKEQUANT_SAMPLES
    if value.strip().lower() == "all":
        return None
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise QDebugError(
            f"--fakequant-samples must be a number >= 0 or 'all' (got {value!r})",
            "pass e.g. --fakequant-samples 64, 0 to skip the fake-quant view, or all",
            ExitCode.USAGE,
        )
    return n


def run(args: argparse.Namespace) -> int:
    """Run the analysis and print the summary."""
    from qdebug.files import atomic_write_text, check_outputs_spare_inputs, check_writable
    from qdebug.pipeline import analyze
    from qdebug.report_io import report_to_csv

    if args.csv:
        check_writable(args.csv, "--csv")
        inputs = {
            "the model": args.model,
            "the calibration data": args.calib,
            "the evaluation data": args.eval,
            "the quantized model": args.quantized,
        }
        check_outputs_spare_inputs({"the report": args.output, "--csv": args.csv}, inputs)
        _refuse_inside_artifacts(Path(args.csv), Path(args.output))
    options = dataclasses.replace(
        analyze_options(args),
        engine=args.engine,
        fakequant_samples=_fakequant_samples(args.fakequant_samples),
    )
    with stderr_progress(not args.quiet) as progress:
        report = analyze(
            args.model,
            args.calib,
            eval_data=args.eval,
            quantized=args.quantized,
            output=args.output,
            options=options,
            progress=progress,
        )
    if args.csv:
        atomic_write_text(args.csv, report_to_csv(report))
    print_summary(report, args.top)
    print(f"\nreport written to {args.output}", file=sys.stderr)
    return 0


def rank_nodes(report) -> list:
    """Nodes worst first (:func:`qdebug.records.rank_nodes`)."""
    from qdebug.records import rank_nodes as ranked

    return ranked(report.nodes)


def print_summary(report, top: int = 10) -> None:
    """Worst layers by introduced error, and the model-level metric, on stdout."""
    from rich.console import Console
    from rich.table import Table

    from qdebug.records import folded_into

    # names and notes come from the model: printed as they are, never read as Rich markup
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    task = report.task
    if task is not None:
        head = f"{task.name} on {task.samples} {task.data} samples:"
        if math.isnan(task.fp32) and math.isnan(task.quantized):  # e.g. only integer (ArgMax) outputs
            console.print(
                f"{head} no float output to score; pass --metric module:function to measure the task"
            )
        elif math.isinf(task.fp32):  # output_sqnr_db: FP32 is the reference itself ("drop inf" said nothing)
            unit = " dB" if task.name == "output_sqnr_db" else ""
            console.print(f"{head} quantized {fmt_metric(task.name, task.quantized)}{unit} (against FP32)")
        else:
            share = task.name in ACCURACY_METRICS
            drop = (task.fp32 - task.quantized) * (100 if share else 1)
            unit = " points" if share else ""
            console.print(
                f"{head} FP32 {fmt_metric(task.name, task.fp32)}  "
                f"quantized {fmt_metric(task.name, task.quantized)}  (drop {drop:.2f}{unit})"
            )
        if not math.isnan(task.quantized_fakequant):
            fq = fmt_metric(task.name, task.quantized_fakequant)
            if task.fakequant_samples and task.fakequant_samples < task.samples:
                same = fmt_metric(task.name, task.quantized_same_samples)
                console.print(
                    f"  same QDQ model without ORT's integer kernels (fake-quant), first {task.fakequant_samples} "
                    f"samples: {fq}  (quantized on those samples: {same})"
                )
            else:
                console.print(f"  same QDQ model without ORT's integer kernels (fake-quant): {fq}")
    for o in report.outputs:
        if not o.error.count:  # an integer output (ArgMax): nothing was compared
            continue
        console.print(f"output {o.name}: SQNR {fmt_db(o.error.sqnr_db)} dB, max-abs {o.error.max_abs:.4g}")
    if report.deployed_gap > 0:
        console.print(f"instrumented vs deployed quantized outputs differ by up to {report.deployed_gap:.3g}")
    ranked = rank_nodes(report)[:top]
    folded = folded_into(report.nodes, report.tensors)
    table = Table(title=f"worst {len(ranked)} nodes by the noise they add ({report.samples} samples)")
    for col in ("node", "op", "added noise dB", "introduced dB", "local SQNR", "accum. SQNR", "KL"):
        table.add_column(col, justify="left" if col in ("node", "op") else "right")
    for n in ranked:
        kl = "-" if math.isnan(n.kl) else f"{n.kl:.3g}"
        table.add_row(
            n.name,
            n.op_type if n.quantized else f"{n.op_type} ({'folded' if n.name in folded else 'float'})",
            fmt_db(n.added_noise_db),
            fmt_db(n.introduced_db),
            fmt_db(n.local_sqnr_db),
            fmt_db(n.accumulated_sqnr_db),
            kl,
        )
    console.print(table)
    if any(not n.quantized and n.name not in folded for n in ranked):
        console.print(
            "(float): not quantized; it passes on, and may amplify, the error it receives from the quantized "
            "nodes upstream"
        )
    for note in report.notes:
        console.print(f"note: {note}")
    if report.not_captured:
        console.print(
            f"note: {len(report.not_captured)} tensor(s) not captured (see the report's not_captured)"
        )


def _refuse_inside_artifacts(csv: Path, output: Path) -> None:
    """``--csv`` must not land in the report's ``<stem>_files/`` (it had replaced the quantized model the
    report points at, and propose and the TUI went on without noticing)."""
    import os

    from qdebug.errors import ExitCode, QDebugError
    from qdebug.files import artifacts_dir

    files = Path(os.path.realpath(artifacts_dir(output)))
    if files in Path(os.path.realpath(csv)).parents:
        raise QDebugError(
            f"--csv {csv} is inside {artifacts_dir(output)}, where the report keeps its models",
            "write the CSV elsewhere",
            ExitCode.USAGE,
        )
