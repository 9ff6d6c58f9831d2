"""Verify a proposal: FP32 vs full static vs selective static, side by side.

Re-quantizes the model with the proposal's nodes_to_exclude and overrides
(from the cached calibration ranges), and compares the three variants on the
task metric, output SQNR, recovered fraction (sel - static) / (fp32 - static),
nodes kept FP32, model size, and latency p50/p95 + throughput (same
provider, threads and batch; one session per variant; warm-up; input buffers
bound once). For a metric with no finite FP32 value (output_sqnr_db) the
verdict uses --target-sqnr. Quantization settings default to the ones the
proposal records (else minmax / QUInt8 / QInt8).

Every drop, recovery and output SQNR gets a paired-bootstrap interval over the
evaluation samples at --confidence (and, for top1, McNemar's exact test of
FP32 vs selective): a gate passes or fails only beyond the noise.

exit codes: 0 when the recovery (and --target-sqnr, if given) is met beyond
the noise and the selective model keeps the INT8 speed-up (propose's rule:
not most quantizable nodes FP32, not timed slower than FP32 while static is
faster; --accept-no-speedup waives it; a model with nothing quantized never
passes); 6 when missed beyond it (for CI gating); 8 when undecided: the
evaluation set is too small, the interval straddles the target (the verdict
says about how many samples would decide it); 3 for a proposal made for
another model or naming nodes the model does not have; 5 for evaluation data
without labels when top1 is asked.

Example:
  qdebug verify model.onnx --calib calib.npz --eval eval.npz --proposal proposal.json -o verify.json

"""

from __future__ import annotations

import argparse
import sys

from qdebug.cli.common import (
    add_parallel_arguments,
    add_quant_arguments,
    batch_axes_arg,
    finite_float,
    quant_request,
    runtime_settings,
)
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.ci_outputs import JUNIT_HELP, MARKDOWN_HELP
from qdebug.output.formatting import metric_title


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug verify``."""
    p.add_argument("model", help="FP32 ONNX model the proposal was made for")
    p.add_argument(
        "--calib", required=True, help="calibration data: .npz, folder of .npz, or module:function"
    )
    p.add_argument("--eval", default=None, help="evaluation data (default: the calibration data)")
    p.add_argument(
        "--proposal", required=True, help="proposal.json from qdebug propose (or exported by the TUI)"
    )
    p.add_argument(
        "--min-recovery",
        type=finite_float,
        default=0.9,
        metavar="FRACTION",
        help="share of the lost metric the selective model must recover, 0 to 1.5 (default: 0.9)",
    )
    p.add_argument(
        "--target-drop",
        type=finite_float,
        default=None,
        metavar="POINTS",
        help="judge as propose --target-drop does instead of by recovery: the selective model may lose at "
        "most POINTS against FP32 (top1 points); use the value you gave propose",
    )
    p.add_argument(
        "--target-sqnr",
        type=finite_float,
        default=None,
        metavar="DB",
        help="also require the selective model's worst output SQNR >= DB (needed for output_sqnr_db)",
    )
    p.add_argument(
        "--confidence",
        type=finite_float,
        default=0.95,
        metavar="LEVEL",
        help="confidence of the paired-bootstrap intervals the gates are judged by: exit 6 only when the "
        "target is missed beyond the noise, 8 (undecided) when the interval straddles it; 0 judges the point "
        "estimates (default: 0.95)",
    )
    p.add_argument(
        "--eval-max-samples", type=int, default=None, metavar="N", help="evaluate on the first N samples"
    )
    p.add_argument(
        "--runs", type=int, default=50, help="timed runs per variant (0: skip latency; default: 50)"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up runs per variant (default: 5)")
    p.add_argument(
        "--flip-details",
        type=int,
        default=20,
        metavar="N",
        help="run the selective model's N worst flipped samples again, each on its own, to measure where each "
        "diverges and what it clips (0: list the flips only; default: 20)",
    )
    p.add_argument(
        "--calib-add-flipped",
        action="store_true",
        help="also rebuild static and selective from the cached ranges widened by the static model's flipped "
        "samples' activations, and score them: does calibrating on such inputs recover? (an upper bound: the "
        "samples are evaluation samples)",
    )
    p.add_argument(
        "-o", "--output", default=None, help="write verify.json here (and the models to <stem>_files/)"
    )
    p.add_argument(
        "--accept-no-speedup",
        action="store_true",
        help="pass a selective model that gives the INT8 speed-up back, as propose --accept-no-speedup does: it "
        "keeps most quantizable nodes FP32, or is timed slower than FP32 while full static is faster (default: "
        "exit 6); one that quantizes nothing never passes",
    )
    p.add_argument("--junit", default=None, metavar="FILE", help=JUNIT_HELP)
    p.add_argument("--markdown", default=None, metavar="FILE", help=MARKDOWN_HELP)
    add_quant_arguments(p, from_proposal=True)  # None = the setting recorded in the proposal
    add_parallel_arguments(p, what="evaluations of static and selective")


def run(args: argparse.Namespace) -> int:
    """Verify and print the side-by-side table; exit 6 when the target is missed, 8 when undecided."""
    from qdebug.cli.progress import stderr_progress
    from qdebug.output import ci_outputs
    from qdebug.verify import VerifyOptions, verify  # onnx and onnxruntime: not for --help

    if args.runs < 0 or args.warmup < 0 or args.flip_details < 0:
        raise QDebugError("--runs, --warmup and --flip-details must be >= 0", "pass a count", ExitCode.USAGE)
    options = VerifyOptions(
        min_recovery=args.min_recovery,
        target_sqnr=args.target_sqnr,
        target_drop=args.target_drop,
        confidence=args.confidence,
        metric=args.metric,
        quant=quant_request(args),  # None / unset: the proposal's
        runtime=runtime_settings(args),
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        eval_max_samples=args.eval_max_samples,
        batch_axes=batch_axes_arg(args),
        runs=args.runs,
        warmup=args.warmup,
        flip_details=args.flip_details,
        calib_add_flipped=args.calib_add_flipped,
        accept_no_speedup=args.accept_no_speedup,
    )
    ci_outputs.check_ci_outputs(args, (args.model, args.calib, args.eval, args.proposal), (args.output,))
    with stderr_progress(not args.quiet) as progress:
        result = verify(
            args.model,
            args.calib,
            args.eval,
            args.proposal,
            options=options,
            output=args.output,
            progress=progress,
        )
    print(f"{metric_title(result.metric)} on {result.samples} samples; {result.quantizable_nodes} quantizable nodes")
    for line in result.summary_lines():
        print(line)
    if result.per_sample is not None:
        print()
        for line in result.per_sample.summary_lines():
            print(line)
    for note in result.notes:
        print(f"note: {note}")
    if args.output:
        print(f"\nverify report written to {args.output}", file=sys.stderr)
    ci_outputs.write_ci_outputs(args, result)
    if result.met:
        return 0
    return int(ExitCode.TARGET_NOT_MET if result.decided else ExitCode.UNDECIDED)
