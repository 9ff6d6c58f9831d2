"""Arguments and printing shared by several subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from qdebug.formatting import fmt_db, fmt_metric

__all__ = [
    "add_quant_arguments",
    "analyze_options",
    "batch_axes_arg",
    "batch_axis_pairs",
    "finite_float",
    "fmt_db",
    "fmt_metric",
    "non_negative_int",
    "provider_list",
]


def finite_float(text: str) -> float:
    """argparse type: a finite number (``nan``/``inf`` as a target had run a whole search against it)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def batch_axis_pairs(text: str) -> tuple[tuple[str, int | None], ...]:
    """argparse type of ``--batch-axis``: ``NAME=AXIS`` pairs, comma-separated (``none``: fed whole)."""
    pairs = []
    for part in (p.strip() for p in text.split(",")):
        name, sep, axis = part.rpartition("=")
        if not part:
            continue
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=AXIS (e.g. state=1), got {part!r}")
        if axis.strip().lower() == "none":
            pairs.append((name.strip(), None))
            continue
        try:
            pairs.append((name.strip(), int(axis)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"the axis of {part!r} is not an integer (or none)") from None
    if not pairs:
        raise argparse.ArgumentTypeError("expected NAME=AXIS (e.g. state=1)")
    return tuple(pairs)


def batch_axes_arg(args: Any) -> tuple[tuple[str, int | None], ...]:
    """Every ``--batch-axis`` pair given, in order (the flag repeats, each a comma list)."""
    return tuple(pair for group in getattr(args, "batch_axis", None) or () for pair in group)


def add_quant_arguments(
    p: argparse.ArgumentParser, *, several_methods: bool = False, from_proposal: bool = False
) -> None:
    """Calibration/quantization flags shared by analyze, propose, verify and bench.

    ``several_methods``: ``--method`` takes a comma-separated list (bench builds one static
    variant per method) instead of one of the four names. ``from_proposal``: the method and
    types default to None, meaning the settings recorded in the proposal (verify, bench).
    """
    default = (lambda d: f"the proposal's, else {d}") if from_proposal else (lambda d: d)
    if several_methods:
        p.add_argument(
            "--method",
            default="minmax",
            help="calibration method(s), comma-separated: minmax, entropy, percentile, distribution "
            f"(one static variant each; default: {default('minmax')})",
        )
    else:
        p.add_argument(
            "--method",
            default="minmax",
            choices=("minmax", "entropy", "percentile", "distribution"),
            help=f"calibration method (default: {default('minmax')})",
        )
    p.add_argument("--per-channel", action="store_true", help="quantize weights per channel")
    p.add_argument(
        "--activation-type",
        default="QUInt8",
        choices=("QUInt8", "QInt8", "QUInt16", "QInt16"),
        help=f"activation quantization type (default: {default('QUInt8')})",
    )
    p.add_argument(
        "--weight-type",
        default="QInt8",
        choices=("QUInt8", "QInt8"),
        help=f"weight quantization type (default: {default('QInt8')})",
    )
    if from_proposal:
        p.set_defaults(method=None, activation_type=None, weight_type=None)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per batch (default: 16, or the model's fixed batch)",
    )
    p.add_argument("--max-samples", type=int, default=None, help="use at most N calibration samples")
    p.add_argument(
        "--batch-axis",
        type=batch_axis_pairs,
        action="append",
        metavar="NAME=AXIS",
        help="the axis an input's samples are stacked on, e.g. state=1 (repeatable or comma-separated; "
        "NAME=none feeds it whole; default: read off the model, e.g. its shared 'batch' dimension)",
    )
    p.add_argument(
        "--metric",
        default=None,
        help="task metric: top1, top1_agreement, exact_match, output_sqnr_db or module:function "
        "(default: top1 when labels exist)",
    )
    p.add_argument(
        "--upgrade-opset",
        action="store_true",
        help="convert models below opset 10 with onnx.version_converter",
    )
    p.add_argument(
        "--inline-constant-if",
        action="store_true",
        help="replace If nodes whose condition is a constant by their taken branch, so it can be quantized",
    )
    p.add_argument("--no-cache", action="store_true", help="do not read or write the calibration cache")
    p.add_argument("--provider", default="CPUExecutionProvider", help="ONNX Runtime execution provider")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (default: ORT's choice, one per core)"
        + ("" if from_proposal else "; analyze runs up to that many capture chunks side by side (at most 4)"),
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def provider_list(provider: str) -> tuple[str, ...]:
    """The session provider list for ``--provider``: the chosen one, with the CPU as fallback."""
    return (provider,) if provider == "CPUExecutionProvider" else (provider, "CPUExecutionProvider")


def analyze_options(args: Any) -> Any:
    """AnalyzeOptions from parsed flags."""
    from qdebug.prepare import AnalyzeOptions

    return AnalyzeOptions(
        method=args.method,
        per_channel=args.per_channel,
        activation_type=args.activation_type,
        weight_type=args.weight_type,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        batch_axes=batch_axes_arg(args),
        metric=args.metric,
        upgrade_opset=args.upgrade_opset,
        inline_constant_if=args.inline_constant_if,
        use_cache=not args.no_cache,
        providers=provider_list(args.provider),
        threads=args.threads,
    )
