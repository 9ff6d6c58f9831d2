"""Arguments and printing shared by several subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qdebug.output.formatting import fmt_db, fmt_metric

__all__ = [
    "add_config_arguments",
    "add_parallel_arguments",
    "add_quant_arguments",
    "analyze_options",
    "quant_request",
    "runtime_settings",
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
    default = (lambda d: f"the proposal's, else {d}") if from_proposal else (lambda d: f"the config's, else {d}")
    if several_methods:
        p.add_argument(
            "--method",
            default=None,
            help="calibration method(s), comma-separated: minmax, entropy, percentile, distribution "
            f"(one static variant each; default: {default('minmax')})",
        )
    else:
        p.add_argument(
            "--method",
            default=None,
            choices=("minmax", "entropy", "percentile", "distribution"),
            help=f"calibration method (default: {default('minmax')})",
        )
    p.add_argument("--per-channel", action="store_true", help="quantize weights per channel")
    p.add_argument(
        "--activation-type",
        default=None,
        choices=("QUInt8", "QInt8", "QUInt16", "QInt16"),
        help=f"activation quantization type (default: {default('QUInt8')})",
    )
    p.add_argument(
        "--weight-type",
        default=None,
        choices=("QUInt8", "QInt8"),
        help=f"weight quantization type (default: {default('QInt8')})",
    )
    _add_option_flags(p)
    add_config_arguments(p)
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


def _add_option_flags(p: argparse.ArgumentParser) -> None:
    """The ORT options people reach for most, as flags (each one key of a config)."""
    p.add_argument(
        "--symmetric-activations",
        action="store_true",
        help="symmetric activation ranges (ActivationSymmetric): zero point 0 (int8) or 128 (uint8), half "
        "the levels unused on a one-sided tensor such as a Relu output; what TensorRT and S8S8 expect",
    )
    p.add_argument(
        "--symmetric-weights",
        action="store_true",
        help="symmetric weight ranges (WeightSymmetric; already ORT's default for int8 weights)",
    )
    p.add_argument(
        "--reduce-range",
        action="store_true",
        help="7-bit weights (reduce_range): half the weight resolution, no u8s8 saturation on x86 CPUs "
        "without VNNI",
    )
    p.add_argument(
        "--op-types",
        default=None,
        metavar="OPS",
        help="quantize only these op types, comma-separated (op_types_to_quantize, e.g. Conv,MatMul,Gemm; "
        "calibration collects their tensors only)",
    )
    p.add_argument(
        "--calib-percentile",
        type=positive_float,
        default=None,
        metavar="P",
        help="percentile calibration keeping P %% of the values inside the range (CalibPercentile, e.g. "
        "99.99; implies --method percentile): outliers beyond it are clipped",
    )


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--preset`` and ``--print-config`` (analyze, propose, verify, bench)."""
    from qdebug.quant.config import PRESET_HELP

    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="your quantize_static (or get_qdq_config) keyword arguments as JSON, TOML or Python: every model "
        "qdebug builds uses them (flags given as well win)",
    )
    p.add_argument(
        "--preset",
        default=None,
        choices=tuple(PRESET_HELP),
        help="a deployment config: " + "; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items()),
    )
    p.add_argument(
        "--print-config",
        nargs=0,
        action=_PrintConfig,
        help="print the quantize_static config that --preset / --config and the flags before this one stand "
        "for (JSON, loadable with --config) and exit",
    )


class _PrintConfig(argparse.Action):
    """``--print-config``: the config of what was given so far, printed at once (no model needed)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        from qdebug.errors import QDebugError
        from qdebug.quant.config import config_text

        try:
            text = config_text(quant_request(namespace).resolve())
        except QDebugError as e:
            parser.exit(int(e.code), f"qdebug: error: {e.one_line()}\n")
        sys.stdout.write(text)
        parser.exit(0)


def quant_request(args: Any, *, with_method: bool = True) -> Any:
    """The :class:`~qdebug.prepare.QuantRequest` of the parsed flags: ``--config`` or ``--preset`` as the
    base, each quantization flag given on top. ``with_method``: ``--method`` is one method (bench's is a
    list of variants)."""
    from qdebug.errors import ExitCode, QDebugError
    from qdebug.prepare import QuantRequest
    from qdebug.quant.config import load_config, preset_config

    config_path, preset = getattr(args, "config", None), getattr(args, "preset", None)
    if config_path and preset:
        raise QDebugError("--config and --preset both given", "pass one of them (flags add to either)", ExitCode.USAGE)
    config = load_config(config_path) if config_path else preset_config(preset) if preset else None
    given: dict[str, Any] = {}
    method = getattr(args, "method", None)
    if with_method and method is not None:
        given["method"] = method
    for name in ("activation_type", "weight_type"):
        if getattr(args, name, None) is not None:
            given[name] = getattr(args, name)
    for name in ("per_channel", "upgrade_opset", "inline_constant_if", "reduce_range"):
        if getattr(args, name, False):
            given[name] = True
    if getattr(args, "op_types", None):
        given["op_types"] = _op_types(args.op_types)
    if getattr(args, "symmetric_activations", False):
        given["ActivationSymmetric"] = True
    if getattr(args, "symmetric_weights", False):
        given["WeightSymmetric"] = True
    percentile = getattr(args, "calib_percentile", None)
    if percentile is not None:
        if with_method and method not in (None, "percentile"):
            raise QDebugError(
                f"--calib-percentile is the percentile method's option, not {method}'s",
                "drop --method or pass --method percentile",
                ExitCode.USAGE,
            )
        if with_method:
            given["method"] = "percentile"
        given["CalibPercentile"] = percentile
    return QuantRequest(config, tuple(given.items()))


def _op_types(text: str) -> tuple[str, ...]:
    """``--op-types``: a comma list of ONNX op types (unknown ones refused), sorted."""
    import onnx

    from qdebug.errors import ExitCode, QDebugError

    ops = sorted({o.strip() for o in text.split(",") if o.strip()})
    unknown = [o for o in ops if not onnx.defs.has(o)]
    if unknown or not ops:
        raise QDebugError(
            f"--op-types names op type(s) that ONNX does not define: {unknown or [text]}",
            "use ONNX op type names such as Conv,MatMul,Gemm",
            ExitCode.USAGE,
        )
    return tuple(ops)


def runtime_settings(args: Any) -> Any:
    """The :class:`~qdebug.prepare.RuntimeSettings` of ``--provider``, ``--threads``, ``--no-cache``,
    ``--workers`` and ``--ray``."""
    from qdebug.prepare import RuntimeSettings

    return RuntimeSettings(
        provider_list(args.provider),
        args.threads,
        not args.no_cache,
        workers=getattr(args, "workers", None),
        ray=getattr(args, "ray", None),
    )


def add_parallel_arguments(p: argparse.ArgumentParser, *, what: str = "candidate evaluations") -> None:
    """``--workers`` and ``--ray`` (propose, verify, bench): where the evaluations run
    (:mod:`qdebug.runtime.parallel`)."""
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help=f"{what} side by side in N worker processes, each with max(1, cores/N) threads (--threads sets "
        "them); the answer is the same for any N (default: 1, in this process: one session already uses every core "
        "through ORT's threads, and 2 workers on 2 cores measured slower)",
    )
    p.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS",
        help=f"run the {what} on a Ray cluster: auto (RAY_ADDRESS or a ray start on this machine, else a local "
        'instance of --workers CPUs) or the head\'s address; needs pip install "qdebug[ray]"',
    )


def provider_list(provider: str) -> tuple[str, ...]:
    """The session provider list for ``--provider``: the chosen one, with the CPU as fallback."""
    return (provider,) if provider == "CPUExecutionProvider" else (provider, "CPUExecutionProvider")


def analyze_options(args: Any) -> Any:
    """AnalyzeOptions from parsed flags."""
    from qdebug.prepare import AnalyzeOptions

    return AnalyzeOptions(
        quant=quant_request(args),
        runtime=runtime_settings(args),
        batch_size=args.batch_size,
        max_samples=args.max_samples,
        batch_axes=batch_axes_arg(args),
        metric=args.metric,
    )
