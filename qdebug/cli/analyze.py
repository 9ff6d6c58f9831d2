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
from qdebug.output.ci_outputs import MARKDOWN_HELP
from qdebug.output.formatting import ACCURACY_METRICS, prefix_note


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug analyze``."""
    p.add_argument("model", help="FP32 ONNX model")
    p.add_argument("--calib", required=True, help="calibration data: .npz, folder of .npz, or module:function")
    p.add_argument("--eval", default=None, help="evaluation data with a 'labels' array (default: calibration data)")
    p.add_argument("--quantized", default=None, help="your own QDQ model (default: qdebug quantizes with ORT)")
    p.add_argument("-o", "--output", default="qdebug-report.json", help="report path (default: qdebug-report.json)")
    p.add_argument("--csv", default=None, help="also write one CSV row per node to this path")
    p.add_argument(
        "--profile",
        type=non_negative_int,
        default=0,
        metavar="RUNS",
        help="also profile the FP32 and the quantized model with ORT's profiler over RUNS runs of the evaluation "
        "batches and record each node's time in the report (qdebug profile's numbers; default 0: not)",
    )
    p.add_argument("--markdown", default=None, metavar="FILE", help=MARKDOWN_HELP)
    p.add_argument("--top", type=non_negative_int, default=10, help="rows in the worst-layers summary (default: 10)")
    p.add_argument("--wide", action="store_true", help="full node names in the summary (default: shortened to fit)")
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
    p.add_argument(
        "--flip-details",
        type=non_negative_int,
        default=20,
        metavar="N",
        help="run the N worst flipped samples again, each on its own, to measure where each diverges and what "
        "it clips (0: list the flips only; default: 20)",
    )
    add_quant_arguments(p, several_methods=True)


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
    """Run the analysis and print the summary (one report per method when ``--method`` lists several)."""
    from qdebug.bench import parse_methods

    methods = parse_methods(args.method) if args.method is not None else ()
    if len(methods) > 1:
        return _run_methods(args, methods)
    args = argparse.Namespace(**{**vars(args), "method": methods[0] if methods else None})
    return _run_one(args)


def method_output(output: str | Path, method: str) -> Path:
    """Where ``--method a,b`` writes method ``a``'s report: ``report.json`` -> ``report.a.json``."""
    path = Path(output)
    return path.with_name(f"{path.stem}.{method}{path.suffix or '.json'}")


def _run_methods(args: argparse.Namespace, methods: tuple[str, ...]) -> int:
    """One report per calibration method (``<stem>.<method>.json``) from one run whose common stages run
    once (:func:`qdebug.pipeline.analyze_methods`), then the comparison of all of them tensor by tensor
    (``qdebug diff`` of those reports)."""
    from qdebug.diff import compare_many
    from qdebug.errors import ExitCode, QDebugError
    from qdebug.output import ci_outputs
    from qdebug.output.files import check_outputs_spare_inputs
    from qdebug.pipeline import analyze_methods

    if args.csv or args.calib_percentile is not None or args.profile:
        flag = "--csv" if args.csv else "--calib-percentile" if args.calib_percentile is not None else "--profile"
        raise QDebugError(
            f"{flag} takes one calibration method, and --method lists {len(methods)}",
            f"run analyze once per method for {flag}, or drop it",
            ExitCode.USAGE,
        )
    outputs = {m: method_output(args.output, m) for m in methods}
    inputs = {"the model": args.model, "the calibration data": args.calib, "the evaluation data": args.eval}
    check_outputs_spare_inputs({f"the {m} report": str(o) for m, o in outputs.items()}, inputs)
    written = tuple(map(str, outputs.values()))
    ci_outputs.check_ci_outputs(args, (args.model, args.calib, args.eval, args.quantized), written)
    one = argparse.Namespace(**{**vars(args), "method": methods[0]})
    options = dataclasses.replace(
        analyze_options(one),
        engine=args.engine,
        fakequant_samples=_fakequant_samples(args.fakequant_samples),
        flip_details=args.flip_details,
    )

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with stderr_progress(not args.quiet) as progress:
        reports = analyze_methods(
            args.model,
            args.calib,
            outputs,
            eval_data=args.eval,
            quantized=args.quantized,
            options=options,
            progress=progress,
            announce=say,
            shared_stages=None if args.quiet else say,
        )
    comparison = compare_many(list(reports), [str(o) for o in outputs.values()])
    print_comparison(comparison, args.top, wide=args.wide)
    print_method_notes(dict(zip(methods, reports, strict=True)))
    ci_outputs.write_ci_outputs(args, comparison, top=args.top)
    return 0


def _run_one(args: argparse.Namespace) -> int:
    """One analysis (one method), its summary and files."""
    from qdebug.output import ci_outputs
    from qdebug.output.files import atomic_write_text, check_outputs_spare_inputs, check_writable
    from qdebug.output.report_io import dumps, report_to_csv
    from qdebug.pipeline import analyze

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
    ci_outputs.check_ci_outputs(args, (args.model, args.calib, args.eval, args.quantized), (args.output, args.csv))
    options = dataclasses.replace(
        analyze_options(args),
        engine=args.engine,
        fakequant_samples=_fakequant_samples(args.fakequant_samples),
        flip_details=args.flip_details,
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
    if args.profile:
        report = _with_profile(report, args)
        atomic_write_text(args.output, dumps(report))  # the report again, whole, with the profile in it
    if args.csv:
        atomic_write_text(args.csv, report_to_csv(report))
    print_summary(report, args.top, wide=args.wide)
    if report.profile is not None:
        print(f"latency (ORT's profiler, {report.profile.fp32.runs} runs): {report.profile.verdict}")
    ci_outputs.write_ci_outputs(args, report, top=args.top)
    print(f"\nreport written to {args.output}", file=sys.stderr)
    return 0


def _with_profile(report, args: argparse.Namespace):
    """``report`` with the per-node profile of its normalized FP32 model (whose node names it uses) and its
    quantized model, over the evaluation data (else the calibration data)."""
    import dataclasses

    from qdebug.cli.common import provider_list
    from qdebug.runtime.capture import SessionConfig
    from qdebug.runtime.profile import run_profile

    say = None if args.quiet else (lambda msg: print(f"qdebug analyze: {msg}", file=sys.stderr))
    config = SessionConfig(providers=provider_list(args.provider), intra_op_threads=args.threads or 0)
    profile = run_profile(
        report.normalized_model,
        report.quantized_model.path,
        args.eval or args.calib,
        runs=args.profile,
        config=config,
        progress=say,
    )
    return dataclasses.replace(report, profile=profile)


def print_comparison(result, top: int = 10, wide: bool = False) -> None:
    """Each report's task metric and wins, then the tensors where the best report wins by the most."""
    from rich.console import Console
    from rich.table import Table

    from qdebug.records.diff import COMPARISON_COLUMNS, comparison_header, comparison_rows

    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    for line in comparison_header(result):
        console.print(line)
    rows = comparison_rows(result, top)
    if rows:
        names, prefix = name_column([r[0] for r in rows], COMPARISON_COLUMNS, [r[1:] for r in rows], console, wide)
        shown = f"{len(rows)} of {len(result.tensors)}" if len(rows) < len(result.tensors) else f"all {len(rows)}"
        title = f"{shown} tensors, biggest margin first (SQNR per report: {' / '.join(result.labels)})"
        table = Table(title=title + (f"; names without the prefix {prefix!r}" if prefix else ""))
        for i, col in enumerate(COMPARISON_COLUMNS):
            table.add_column(col, justify="right" if i >= 2 else "left", overflow="fold")
        for name, row in zip(names, rows, strict=True):
            table.add_row(name, *row[1:])
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}")


def method_notes(reports: dict) -> list[str]:
    """Each method's notes as printed lines, labelled by method: a note every method carries once, as
    ``note (every method): ...``, first; then the others in each method's order, a note two of three carry
    under both names (``note (minmax, entropy): ...``), once. ``--method a,b,c`` had printed no note at all,
    although each report holds its own (the entropy-calibration note the README promises among them)."""
    owners: dict[str, list[str]] = {}
    for method, report in reports.items():
        for note in dict.fromkeys(report.notes):
            owners.setdefault(note, []).append(method)
    every = [n for n, m in owners.items() if len(m) == len(reports)]
    lines = [f"note (every method): {n}" for n in every] if len(reports) > 1 else [f"note: {n}" for n in every]
    for method in reports:
        for note, held in owners.items():
            if held[0] == method and len(held) < len(reports):
                lines.append(f"note ({', '.join(held)}): {note}")
    return lines


def print_method_notes(reports: dict) -> None:
    """:func:`method_notes` on stdout, under the comparison (names and notes as they are, never markup)."""
    from rich.console import Console

    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    for line in method_notes(reports):
        console.print(line)


def rank_nodes(report) -> list:
    """Nodes worst first (:func:`qdebug.records.rank_nodes`)."""
    from qdebug.records import rank_nodes as ranked

    return ranked(report.nodes)


def name_column(
    names: list[str],
    cols: tuple[str, ...],
    rows: list[tuple[str, ...]],
    console,
    wide: bool,
    wrapped: int = 0,
) -> tuple[list[str], str]:
    """``(shown names, dropped prefix)`` for a rich table whose first column is ``names``.

    ``rows``: the other columns' cells. The names get what those columns leave of the console's width
    (:func:`~qdebug.output.formatting.table_names`: the common prefix dropped, cut in the middle); the last
    ``wrapped`` columns are prose rich wraps, counted at most 30 cells wide. ``wide``: full names, and a
    console wide enough to print them unbroken when it is not a terminal. Shared by propose's table.
    """
    from qdebug.output.formatting import cells, name_column_width, table_names, table_overhead

    others = [max([len(c), *(cells(r[i]) for r in rows)]) for i, c in enumerate(cols[1:])]
    for i in range(len(others) - wrapped, len(others)):
        others[i] = min(others[i], 30)
    if wide:
        need = table_overhead(others) + max([len(cols[0]), *map(cells, names)])
        if not console.is_terminal:
            console.width = max(console.width, need)
        return names, ""
    prefix, shown = table_names(names, name_column_width(console.width, others))
    return shown, prefix


def print_summary(report, top: int = 10, wide: bool = False) -> None:
    """Worst layers by introduced error, and the model-level metric, on stdout.

    The notes on what the quantized model leaves float and what ORT's integer kernels lose come right
    after the metric they explain; the others after the table. Node names are shortened to fit (their
    common prefix said once above the table, the rest cut in the middle); ``wide``: full names (the
    report and the CSV always have them).
    """
    from rich.console import Console

    # names and notes come from the model: printed as they are, never read as Rich markup
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    task = report.task
    if task is not None:
        head = f"{task.name} on {task.samples} {task.data} samples:"
        if math.isnan(task.fp32) and math.isnan(task.quantized):  # e.g. only integer (ArgMax) outputs
            console.print(f"{head} no float output to score; pass --metric module:function to measure the task")
        elif math.isinf(task.fp32) and math.isinf(task.quantized) and not any(n.quantized for n in report.nodes):
            # "inf dB" read as a perfect quantization; nothing was quantized (an If's subgraphs, exclusions)
            console.print(
                f"{head} the quantized model's outputs equal FP32's: nothing in it was quantized (notes below)"
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
    first, rest = _split_notes(report.notes)
    for note in first:
        console.print(f"note: {note}")
    _worst_table(console, report, top, wide)
    if report.per_sample is not None:  # which samples flip: one line each, never wrapped (grep-able)
        for line in report.per_sample.summary_lines():
            console.print(line, soft_wrap=True)
    for note in rest:
        console.print(f"note: {note}")
    if report.not_captured:
        console.print(f"note: {len(report.not_captured)} tensor(s) not captured (see the report's not_captured)")


def _split_notes(notes: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(printed above the table, below it): what stays float and what ORT's kernels lose go next to the
    metric they explain (:func:`qdebug.analysis.notes.headline_notes`)."""
    from qdebug.analysis.notes import headline_notes

    return headline_notes(notes)


EXACT_INPUT = "(exact input)"
"""What the summary prints for an ``introduced_db`` measured from exact inputs (the 120 dB cap minus the
output's SQNR): a MatMul reading an exact one-hot tensor showed "85.5" and read as the worst layer."""


def _introduced(node) -> str:
    """The introduced-error cell: the number, or :data:`EXACT_INPUT` where it is only the cap."""
    from qdebug.records.report import from_exact_input

    return EXACT_INPUT if from_exact_input(node) else fmt_db(node.introduced_db)


def _worst_table(console, report, top: int, wide: bool) -> None:
    """The worst-nodes table, and what its ``(float)`` marks mean."""
    from rich.table import Table

    from qdebug.records import folded_into

    ranked = rank_nodes(report)[:top]
    folded = folded_into(report.nodes, report.tensors)
    cols = ("node", "op", "added noise dB", "introduced dB", "local SQNR", "accum. SQNR", "KL")
    rows = [
        (
            n.op_type if n.quantized else f"{n.op_type} ({'folded' if n.name in folded else 'float'})",
            fmt_db(n.added_noise_db),
            _introduced(n),
            fmt_db(n.local_sqnr_db),
            fmt_db(n.accumulated_sqnr_db),
            "-" if math.isnan(n.kl) else f"{n.kl:.3g}",
        )
        for n in ranked
    ]
    names, prefix = name_column([n.name for n in ranked], cols, rows, console, wide)
    if prefix:
        console.print(prefix_note(prefix))
    table = Table(title=f"worst {len(ranked)} nodes by the noise they add ({report.samples} samples)")
    for col in cols:
        if col == "node":  # already fitted (or --wide): rich must not cut it again
            table.add_column(col, no_wrap=not wide, overflow="fold" if wide else "ellipsis")
        else:
            table.add_column(col, justify="left" if col == "op" else "right")
    for name, row in zip(names, rows, strict=True):
        table.add_row(name, *row)
    console.print(table)
    if any(not n.quantized and n.name not in folded for n in ranked):
        console.print(
            "(float): not quantized; it passes on, and may amplify, the error it receives from the quantized "
            "nodes upstream"
        )
    if any(row[2] == EXACT_INPUT for row in rows):
        console.print(
            f"{EXACT_INPUT}: the node's float inputs are exact (SQNR inf or above 120 dB, or none carries "
            "error), so the SQNR drop across it is not measured (the report holds 120 dB minus its output's "
            "SQNR); what it loses shows in added noise and accum. SQNR"
        )


def _refuse_inside_artifacts(csv: Path, output: Path) -> None:
    """``--csv`` must not land in the report's ``<stem>_files/`` (it had replaced the quantized model the
    report points at, and propose and the TUI went on without noticing)."""
    import os

    from qdebug.errors import ExitCode, QDebugError
    from qdebug.output.files import artifacts_dir

    files = Path(os.path.realpath(artifacts_dir(output)))
    if files in Path(os.path.realpath(csv)).parents:
        raise QDebugError(
            f"--csv {csv} is inside {artifacts_dir(output)}, where the report keeps its models",
            "write the CSV elsewhere",
            ExitCode.USAGE,
        )
