"""Arguments and printing shared by several subcommands."""

from __future__ import annotations

import argparse
import math
from typing import Any


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """Calibration/quantization flags shared by analyze, propose, verify and bench."""
    p.add_argument(
        "--method",
        default="minmax",
        choices=("minmax", "entropy", "percentile", "distribution"),
        help="calibration method (default: minmax)",
    )
    p.add_argument("--per-channel", action="store_true", help="quantize weights per channel")
    p.add_argument(
        "--activation-type",
        default="QUInt8",
        choices=("QUInt8", "QInt8", "QUInt16", "QInt16"),
        help="activation quantization type (default: QUInt8)",
    )
    p.add_argument(
        "--weight-type",
        default="QInt8",
        choices=("QUInt8", "QInt8"),
        help="weight quantization type (default: QInt8)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="samples per batch (default: 16, or the model's fixed batch)",
    )
    p.add_argument("--max-samples", type=int, default=None, help="use at most N calibration samples")
    p.add_argument(
        "--metric",
        default=None,
        help="task metric: top1, top1_agreement, output_sqnr_db or module:function (default: top1 when labels exist)",
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
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: ORT's choice)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def analyze_options(args: Any) -> Any:
    """AnalyzeOptions from parsed flags."""
    from qdebug.pipeline import AnalyzeOptions

    return AnalyzeOptions(
        method=args.method,
        per_channel=args.per_channel,
        activation_type=args.activation_type,
        weight_type=args.weight_type,
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        metric=args.metric,
        upgrade_opset=args.upgrade_opset,
        inline_constant_if=args.inline_constant_if,
        use_cache=not args.no_cache,
        providers=(args.provider,)
        if args.provider == "CPUExecutionProvider"
        else (args.provider, "CPUExecutionProvider"),
        threads=args.threads,
    )


def fmt_db(x: float) -> str:
    """A dB value for tables: 1 decimal, inf/nan spelled out."""
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.1f}"


def fmt_metric(name: str, x: float) -> str:
    """A task metric value (percent for accuracies)."""
    if math.isnan(x):
        return "-"
    if name in ("top1", "top1_agreement"):
        return f"{100 * x:.2f}%"
    return f"{x:.4g}"
