"""The prelude every command shares: load and normalize the model, open the data, calibrate once.

``analyze``, ``propose``, ``verify`` and ``bench`` all start here, so none of them imports another
command to get going; the proposal-vs-model checks that verify, bench and the TUI apply live here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from qdebug.analysis import DEFAULT_FAKEQUANT_SAMPLES
from qdebug.calibrate import Ranges, calibrate
from qdebug.capture import check_providers
from qdebug.data import DataSet, model_input_specs, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.files import sha256_file
from qdebug.graph.load import default_opset, is_large, load_model, normalize, save_model
from qdebug.graph.ops import INTEGER_KERNEL_OPS, QUANT_OPS
from qdebug.progress import Progress, no_progress
from qdebug.quantize import float16_exclusions
from qdebug.records import ModelInfo, Proposal


@dataclass(frozen=True)
class AnalyzeOptions:
    """Options of :func:`analyze` (the CLI flags of ``qdebug analyze``)."""

    method: str = "minmax"
    per_channel: bool = False
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    batch_size: int | None = None
    max_samples: int | None = None
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (input, axis); the others are read off the model (``decide_batch_axes``)."""
    metric: str | None = None
    upgrade_opset: bool = False
    inline_constant_if: bool = False
    """Inline the taken branch of If nodes whose condition is a constant (ORT quantizes no subgraph)."""
    use_cache: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0
    engine: str = "auto"
    """Capture engine: ``graph`` (reductions inside ORT), ``numpy`` (exact float64 copies), ``auto``."""
    fakequant_samples: int | None = DEFAULT_FAKEQUANT_SAMPLES
    """Run the fake-quant view on the first N samples only (None: all; 0: skip it)."""


def model_info(path: Path, proto: onnx.ModelProto, sha: str | None = None) -> ModelInfo:
    """Identify a model for the report."""
    inits = {i.name for i in proto.graph.initializer}
    return ModelInfo(
        path=str(path.resolve()),
        sha256=sha or sha256_file(path),
        opset=default_opset(proto),
        nodes=len(proto.graph.node),
        inputs=tuple(i.name for i in proto.graph.input if i.name not in inits),
        outputs=tuple(o.name for o in proto.graph.output),
    )


@dataclass(frozen=True, eq=False)
class Prepared:
    """A normalized model ready for quantization, with its data and calibration.

    The user's model is kept only as its :class:`ModelInfo`: its proto would
    double the weights held through the capture (22 MB on the BERT benchmark).
    """

    model: ModelInfo
    normalized: onnx.ModelProto
    normalized_path: Path
    notes: tuple[str, ...]
    name_map: dict[str, str]
    calib: DataSet
    ranges: Ranges | None


def prepare(
    model_path: str | Path,
    calib: str | Path,
    workdir: Path,
    options: AnalyzeOptions,
    *,
    need_ranges: bool = True,
    progress: Progress = no_progress,
    check: Callable[[onnx.ModelProto], None] | None = None,
) -> Prepared:
    """Load, normalize and save the model; open the calibration data; calibrate (cached).

    ``check`` sees the normalized model before any data is read: a proposal
    naming nodes the model lacks is refused before calibration, not after.
    """
    check_providers(options.providers)
    loaded = load_model(model_path)
    _refuse_quantized_base(loaded.proto, model_path)
    norm = normalize(
        loaded, upgrade_opset=options.upgrade_opset, inline_constant_if=options.inline_constant_if
    )
    if check is not None:
        check(norm.proto)
    normalized_path = workdir / "normalized.onnx"
    save_model(norm.proto, normalized_path)
    info = model_info(loaded.path, loaded.proto, loaded.sha256)
    del loaded  # the normalized model is what the rest works on: not two copies of the weights
    specs = model_input_specs(norm.proto, options.batch_axes)
    data = open_data(calib, specs, batch_size=options.batch_size, max_samples=options.max_samples)
    ranges = None
    if need_ranges:
        float16_exclusions(norm.proto)  # refuse an all-float16 model before calibrating
        count = [0]

        def on_batch(n: int) -> None:
            count[0] += n
            progress("calibrate", count[0], data.n_samples)

        ranges = calibrate(
            normalized_path,
            sha256_file(normalized_path),
            data,
            options.method,
            use_cache=options.use_cache,
            on_batch=on_batch,
            providers=options.providers,
            large=is_large(norm.proto),
        )
    return Prepared(info, norm.proto, normalized_path, norm.notes, dict(norm.name_map), data, ranges)


def _refuse_quantized_base(proto: onnx.ModelProto, path: str | Path) -> None:
    """The model to analyze (the base of every quantized variant) must be the float model: an already
    quantized one had failed inside ORT's quantizer ("KeyError: ..._scale -- report this model")."""
    from collections import Counter

    ops = Counter(
        n.op_type
        for n in proto.graph.node
        if n.op_type in QUANT_OPS or n.op_type in INTEGER_KERNEL_OPS or n.op_type.startswith("QLinear")
    )
    if ops:
        found = ", ".join(f"{op} x{k}" for op, k in sorted(ops.items()))
        raise QDebugError(
            f"{path} is already quantized ({found})",
            "pass the FP32 model it was made from, and this one with --quantized",
            ExitCode.MODEL,
        )


def calibration_notes(proposal: Proposal, ranges: Ranges | None) -> list[str]:
    """A note when this run's calibration is not the one the proposal was made with.

    The key hashes the model, the calibration data's content and sample
    count, the method and ORT's version: another ``--calib`` file or
    ``--max-samples`` gives other scales, so the selective model here is not
    the one ``propose`` measured (verify still judges the model it built).
    """
    if not proposal.calibration_key or ranges is None or ranges.key == proposal.calibration_key:
        return []
    return [
        "the calibration differs from the one the proposal was made with (other calibration data, sample "
        "count or method): the selective model's scales differ from propose's; pass the proposal's "
        "--calib and --max-samples to rebuild its model exactly"
    ]


def base_setting_notes(proposal: Proposal, per_channel_flag: bool) -> list[str]:
    """A note when a proposal made before ``base_per_channel`` was recorded has per-channel weights: the
    static baseline is then per-tensor unless ``--per-channel`` says otherwise, and the selective model
    differs from it by more than its exclusions (silent before)."""
    if proposal.base_per_channel is not None or not proposal.per_channel or per_channel_flag:
        return []
    return [
        "the proposal has per-channel weights but does not record the report's own setting (an older "
        "qdebug): the static baseline is per-tensor; pass --per-channel if the report was per-channel"
    ]


def check_proposal(
    proposal: Proposal, model_sha256: str, model_path: str | Path, normalized: onnx.ModelProto
) -> None:
    """Refuse a proposal for another model, or one naming nodes/tensors the model does not have."""
    if proposal.model_sha256 and proposal.model_sha256 != model_sha256:
        raise QDebugError(
            f"the proposal was made for another model (sha256 {proposal.model_sha256[:12]}...), "
            f"not {model_path} "
            f"({model_sha256[:12]}...)",
            "run qdebug propose on a report of this model",
            ExitCode.INPUT,
        )
    names = {n.name for n in normalized.graph.node}
    unknown = [n for n in proposal.nodes_to_exclude if n not in names]
    if unknown:
        raise QDebugError(
            f"the proposal names {len(unknown)} node(s) that are not in {model_path}: "
            f"{', '.join(repr(u) for u in unknown[:5])}{' ...' if len(unknown) > 5 else ''}",
            "use node names from the qdebug report of this model",
            ExitCode.INPUT,
        )
    tensors = {t for n in normalized.graph.node for t in list(n.input) + list(n.output) if t}
    bad = [o.tensor for o in proposal.tensor_overrides if o.tensor not in tensors]
    if bad:
        raise QDebugError(
            f"the proposal overrides {len(bad)} tensor(s) that are not in {model_path}: {bad[:5]}",
            "use tensor names from the qdebug report of this model",
            ExitCode.INPUT,
        )
