"""Propose which nodes to keep out of quantization, and prove it on the evaluation data.

Reads the analysis report (the model, data and quantization settings recorded
in it; each path can be overridden), checks the model still matches the
report (sha256), and searches the smallest set of nodes to keep FP32 -- or,
with --allow, 16-bit activations / per-channel weights -- that meets the
target. Candidates are re-quantized from the cached calibration ranges and
scored on the evaluation set; the number of evaluations and their time are
reported. Writes proposal.json, <stem>.selective.onnx (the selectively
quantized model) next to it, and prints a ready-to-paste quantize_static
snippet.

The default target is a 1-point drop of the task metric vs FP32 (top1
points), 1 % of |FP32| for a module:function metric (in its own
units), or 30 dB output SQNR for a metric without an FP32 value.

exit codes: 0 when the target is met; 6 when no proposal within --max-nodes
meets it (the best proposal found is still written), or when the one that
meets it gives the INT8 speed-up back (unless --accept-no-speedup); 3 when
the model is not the one the report was made from.

Example:
  qdebug propose report.json --target-drop 1 --max-nodes 8 -o proposal.json

"""

from __future__ import annotations

import argparse
import math
import sys

from qdebug.cli.common import (
    add_config_arguments,
    add_parallel_arguments,
    batch_axes_arg,
    batch_axis_pairs,
    finite_float,
    fmt_metric,
    quant_request,
    runtime_settings,
)
from qdebug.output.ci_outputs import MARKDOWN_HELP
from qdebug.output.formatting import metric_title, prefix_note
from qdebug.records.verify import speed_ratio
from qdebug.vocabulary import ACTIONS, DEFAULT_ALLOW, RECIPES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug propose``."""
    p.add_argument("report", help="analysis report written by qdebug analyze")
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--target-drop",
        type=finite_float,
        default=None,
        metavar="DROP",
        help="allowed metric drop vs FP32: percentage points for top1, top1_agreement and exact_match "
        "(default: 1 point); the metric's own units for a module:function metric (default: 1 %% of |FP32|)",
    )
    target.add_argument(
        "--target-sqnr",
        type=finite_float,
        default=None,
        metavar="DB",
        help="required worst output SQNR in dB (instead of a metric drop)",
    )
    p.add_argument("--max-nodes", type=int, default=None, metavar="K", help="keep at most K nodes FP32")
    p.add_argument(
        "--allow",
        default=",".join(DEFAULT_ALLOW),
        metavar="LIST",
        help=f"comma list of {', '.join(ACTIONS)} (default: all but "
        "int16, which runs as float on the CPU provider, and calib-flipped); the cheapest change that meets "
        "the target is kept, per node: per-channel weights for the whole model, else a clipped range < "
        "per-channel weights < 7-bit weights < 16-bit activations < fp32. calib-flipped: the ranges widened "
        "by the report's flipped evaluation samples (as verify --calib-add-flipped), for the whole model, "
        "else per node after the other fixes; an upper bound, as those samples are evaluation samples",
    )
    p.add_argument(
        "--recipes",
        default="all",
        metavar="LIST",
        help="whole-model recipes tried before any per-node change when full static INT8 misses the target: "
        f"comma list of {', '.join(RECIPES)}, or all (default) or none. The first transform that "
        "meets the target is the answer; mixed and dynamic replace the per-node answer only where it misses or "
        "keeps most nodes (or only MatMuls) FP32",
    )
    p.add_argument("--model", default=None, help="FP32 model (default: the path recorded in the report)")
    p.add_argument("--calib", default=None, help="calibration data (default: the report's)")
    p.add_argument("--eval", default=None, help="evaluation data (default: the report's)")
    p.add_argument(
        "--metric",
        default=None,
        help="task metric: top1, top1_agreement, exact_match, output_sqnr_db or module:function "
        "(default: the report's)",
    )
    p.add_argument(
        "--batch-axis",
        type=batch_axis_pairs,
        action="append",
        metavar="NAME=AXIS",
        help="the axis an input's samples are stacked on, e.g. state=1 (default: the report's, else read off "
        "the model)",
    )
    p.add_argument(
        "--eval-max-samples",
        type=int,
        default=None,
        metavar="N",
        help="score candidates on the first N evaluation samples",
    )
    p.add_argument(
        "--max-evaluations",
        type=int,
        default=None,
        metavar="N",
        help="evaluation budget (default: 2*ceil(log2 L)+10 for L candidate nodes to find an answer, plus "
        "2*ceil(log2 L)+6 to shrink it by group testing and refine it: nodes that only go in pairs, units "
        "tried alone)",
    )
    p.add_argument("-o", "--output", default="proposal.json", help="proposal path (default: proposal.json)")
    p.add_argument("--markdown", default=None, metavar="FILE", help=MARKDOWN_HELP)
    p.add_argument("--no-cache", action="store_true", help="do not read or write the calibration cache")
    p.add_argument("--provider", default="CPUExecutionProvider", help="ONNX Runtime execution provider")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: ORT's choice)")
    p.add_argument("--snippet", action="store_true", help="also print the quantize_static snippet on stdout")
    add_config_arguments(p)  # default: the report's settings
    add_parallel_arguments(p)
    p.add_argument(
        "--wide", action="store_true", help="full node names in the proposal table (default: shortened to fit)"
    )
    p.add_argument(
        "--accept-no-speedup",
        action="store_true",
        help="exit 0 for a proposal that meets the target but gives the INT8 speed-up back: it keeps most "
        "quantizable nodes FP32, or the verified frontier timed it slower than FP32 while full static is "
        "faster (default: exit 6)",
    )
    p.add_argument(
        "--screen-samples",
        type=int,
        default=None,
        metavar="N",
        help="score candidates on the first N evaluation samples, then static, the answer and the frontier on "
        "all of them (default: 256 when the set holds at least 1,024; 0: every candidate on all samples)",
    )
    p.add_argument(
        "--screen-model",
        choices=("auto", "on", "off"),
        default="auto",
        help="score candidates that only keep nodes FP32 on one switchable fake-quant model (a graph input "
        "keeps each Q/DQ or not: no session per candidate), confirming static, the answer and the frontier on "
        "their real models; auto: on graphs of 1,000 nodes or more without an integer-kernel gap (default)",
    )
    p.add_argument(
        "--time-runs",
        type=int,
        default=20,
        metavar="N",
        help="timed runs per point of the verified frontier (FP32, static, the proposal, its neighbours, "
        "dynamic), with verify's harness; 0: no frontier (default: 20)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    """Search, write the proposal, print the summary; exit 6 when the target is not met."""
    from qdebug.cli.progress import stderr_progress
    from qdebug.errors import ExitCode, QDebugError
    from qdebug.output import ci_outputs
    from qdebug.propose import ProposeOptions, propose

    if args.max_evaluations is not None and args.max_evaluations < 1:
        raise QDebugError("--max-evaluations must be >= 1", "pass a positive number", ExitCode.USAGE)
    if args.screen_samples is not None and args.screen_samples < 0:
        raise QDebugError("--screen-samples must be >= 0", "pass 0 to score on all samples", ExitCode.USAGE)
    if args.time_runs < 0:
        raise QDebugError("--time-runs must be >= 0", "pass 0 to skip the frontier, or a run count", ExitCode.USAGE)
    options = ProposeOptions(
        target_drop=args.target_drop,
        target_sqnr=args.target_sqnr,
        max_nodes=args.max_nodes,
        allow=tuple(args.allow.split(",")),
        recipes=_recipes_arg(args.recipes),
        metric=args.metric,
        eval_max_samples=args.eval_max_samples,
        max_evaluations=args.max_evaluations,
        quant=quant_request(args),
        runtime=runtime_settings(args),
        time_runs=args.time_runs,
        screen_samples=args.screen_samples,
        screen_model=args.screen_model,
        batch_axes=batch_axes_arg(args),
    )
    ci_outputs.check_ci_outputs(args, (args.report, args.model, args.calib, args.eval), (args.output,))
    with stderr_progress(not args.quiet) as progress:
        result = propose(
            args.report,
            output=args.output,
            options=options,
            model=args.model,
            calib=args.calib,
            eval_data=args.eval,
            progress=progress,
        )
    print_summary(result, wide=args.wide)
    ci_outputs.write_ci_outputs(args, result.proposal, met=result.met, target=result.target.describe())
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    if args.snippet:
        print()
        print(result.proposal.snippet, end="")
    print(
        f"\nproposal written to {args.output}; selective model: {result.proposal.quantized_model}",
        file=sys.stderr,
    )
    if not result.met:
        print(
            f"qdebug: target not met ({result.target.describe()}); wrote the best proposal found",
            file=sys.stderr,
        )
        return int(ExitCode.TARGET_NOT_MET)
    if result.no_speedup:
        print(f"qdebug: {result.no_speedup}", file=sys.stderr)
        if not args.accept_no_speedup:
            return int(ExitCode.TARGET_NOT_MET)
    return 0


def print_summary(result, wide: bool = False) -> None:
    """Target, metric FP32 / static / selective, what is excluded and why, and the search cost.

    ``wide``: full node names in the table (default: shortened to fit, as in analyze's summary).
    """
    from rich.console import Console

    # names and reasons come from the model: printed as they are, never read as Rich markup
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    p = result.proposal
    name = p.metric
    console.print(f"target: {result.target.describe()}  ->  {'MET' if result.met else 'NOT MET'}")
    on = f" on {p.eval_samples} evaluation samples" if p.eval_samples else ""
    console.print(
        f"{name}{on}: FP32 {fmt_metric(name, p.fp32_metric)}  static {fmt_metric(name, p.static_metric)}  "
        f"selective {fmt_metric(name, p.expected_metric)}"
    )
    if p.recipe is not None and p.recipe.quantizer != "static":
        r = p.recipe
        entry = RECIPES.get(r.name)
        console.print(f"recipe: {r.name} -- {entry.title if entry else r.name}: {entry.reproduce if entry else ''}")
    elif p.recipe is not None:
        r = p.recipe
        what = f"{len(r.changed)} node(s) rewritten" + (f", {len(r.removed)} folded away" if r.removed else "")
        console.print(f"recipe: {'+'.join(r.steps) or r.name} ({what}); quantized from {r.fp32_model or 'its model'}")
    share = f"{100 * len(p.nodes_to_exclude) / p.quantizable_nodes:.1f}%" if p.quantizable_nodes else "-"
    console.print(
        f"nodes kept FP32: {len(p.nodes_to_exclude)} of {p.quantizable_nodes} quantizable "
        f"({share}); "
        f"{_overrides_text(p.tensor_overrides)}; per-channel: {p.per_channel}; "
        f"Q/DQ pairs vs static: {p.qdq_pairs_delta:+d}"
    )
    trials = result.trials
    qsec = sum(t.quantize_seconds for t in trials)
    esec = sum(t.eval_seconds for t in trials)
    console.print(
        f"search: {result.evaluations} evaluations (budget {result.max_evaluations}, "
        f"L={result.candidates} candidate "
        f"nodes), {result.reranks} re-rank capture(s); re-quantize {qsec:.2f} s + evaluate {esec:.2f} s; "
        f"total {result.seconds:.1f} s"
    )
    if p.stage_seconds:
        console.print("time per stage: " + " · ".join(f"{name} {sec:.1f} s" for name, sec in p.stage_seconds))
    if p.reasons:
        _reasons_table(console, p.reasons, wide)
    if p.frontier:
        _frontier_table(console, p.frontier, name)


def _overrides_text(overrides) -> str:
    """``16-bit tensors: 2`` and the other overrides (clipped or widened ranges, one node's per-channel or
    7-bit weights: INT8 kept) counted apart."""
    int16 = sum(1 for o in overrides if o.quant_type in ("QUInt16", "QInt16"))
    fixes = len(overrides) - int16
    return f"16-bit tensors: {int16}" + (f"; range/weight overrides (INT8 kept): {fixes}" if fixes else "")


def _frontier_table(console, frontier, metric: str) -> None:
    """The verified frontier: each point built, scored and timed alike (vs FP32: the median of the interleaved
    rounds' ratios and their range, else the p50s' ratio)."""
    from rich.table import Table

    fp32 = next((f for f in frontier if f.label == "fp32"), None)
    table = Table(title="verified frontier (each point built, scored and timed alike)")
    for col, just in (("", "left"), ("changes", "left"), (metric_title(metric), "right"), ("met", "left"),
                      ("p50 ms", "right"), ("vs FP32", "right")):  # fmt: skip
        table.add_column(col, justify=just)
    for f in frontier:
        spread = speed_ratio(fp32.rounds_ms, f.rounds_ms) if fp32 is not None and f is not fp32 else None
        ratio = f"{fp32.p50_ms / f.p50_ms:.2f}x" if fp32 is not None and f.p50_ms > 0 else "-"
        ratio = spread.show() if spread is not None else ratio
        table.add_row(f.label, f.changed, fmt_metric(metric, f.metric), "yes" if f.met else "no", f"{f.p50_ms:.3g}",
                      ratio)  # fmt: skip
    console.print(table)


def _reasons_table(console, reasons, wide: bool) -> None:
    """One row per excluded node or override: names fitted as analyze's table fits them (``wide``: whole)."""
    from rich.table import Table

    from qdebug.cli.analyze import name_column

    cols = ("node", "op", "action", "introduced dB", "region", "why")
    rows = [
        (
            r.op_type,
            r.action,
            "-" if math.isnan(r.introduced_db) else f"{r.introduced_db:.1f}",
            str(r.region) if r.region >= 0 else "-",
            r.reason.split("; ")[0],
        )
        for r in reasons
    ]
    names, prefix = name_column([r.node for r in reasons], cols, rows, console, wide, wrapped=1)
    if prefix:
        console.print(prefix_note(prefix))
    table = Table(title="proposal")
    for col in cols:
        if col == "node":  # already fitted (or --wide): rich must not cut it again
            table.add_column(col, no_wrap=not wide, overflow="fold" if wide else "ellipsis")
        else:
            table.add_column(col, justify="right" if col in ("introduced dB", "region") else "left")
    for name, row in zip(names, rows, strict=True):
        table.add_row(name, *row)
    console.print(table)


def _recipes_arg(value: str) -> tuple[str, ...] | None:
    """``--recipes``: ``all`` (None: every recipe), ``none`` (no recipe), else the names (checked by propose)."""
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    if names == ("all",):
        return None
    if names == ("none",) or not names:
        return ()
    return names
