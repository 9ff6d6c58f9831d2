"""Building the model variants ``qdebug bench`` compares, all from the same normalized FP32 model.

Dynamic quantization (int8 weights, activations quantized at run time),
static QDQ from the cached calibration ranges (one per calibration method),
selective static from a :class:`~qdebug.records.Proposal`, optionally the
QOperator format. Every static variant and the selective one share the
calibration method and the types, so the table compares exclusions, not
settings. A variant that fails to build is kept, with its error, and the
others go on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path

from qdebug.bench.options import BenchOptions
from qdebug.errors import ExitCode, QDebugError
from qdebug.prepare import AnalyzeOptions, Prepared, recipe_base
from qdebug.progress import Progress
from qdebug.quant.calibrate import Ranges
from qdebug.quant.config import describe
from qdebug.quant.quantize import (
    QuantSpec,
    dynamic_conv_note,
    quantize_dynamic_model,
    quantize_model,
    quantize_static_model,
)
from qdebug.records import METHODS, Proposal
from qdebug.records.bench import KINDS


@dataclass(frozen=True)
class Built:
    """A variant as built: where its model is, or why there is none."""

    name: str
    kind: str
    method: str
    quant_format: str
    per_channel: bool
    path: Path | None
    """The model file (the normalized FP32 model for ``fp32``); None when the build failed."""
    excluded: int = 0
    notes: tuple[str, ...] = ()
    error: str = ""


def parse_variants(text: str) -> tuple[str, ...]:
    """``fp32,dynamic,static`` -> a tuple of kinds (unknown or repeated kinds refused)."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise QDebugError(
            f"unknown variant(s) {unknown or [text]} in --variants",
            f"use a comma-separated list of {', '.join(KINDS)}",
            ExitCode.USAGE,
        )
    if len(set(kinds)) != len(kinds):
        raise QDebugError(f"--variants repeats a variant: {text}", "name each variant once", ExitCode.USAGE)
    return kinds


def parse_methods(text: str) -> tuple[str, ...]:
    """``minmax,entropy`` -> a tuple of calibration methods (unknown ones refused)."""
    methods = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise QDebugError(
            f"unknown calibration method(s) {unknown or [text]} in --method",
            f"use a comma-separated list of {', '.join(METHODS)}",
            ExitCode.USAGE,
        )
    return methods


def settings_of(options: BenchOptions, proposal: Proposal | None, notes: list[str]) -> BenchOptions:
    """``options`` with the quantization settings filled in: the flags and ``--config`` over the proposal's
    settings (the user's config included), else over the defaults; the calibration methods default to
    theirs.

    Every static variant and the selective one share them -- the report's per-channel setting and types
    included (a per-channel report's static variants had been built per-tensor, and the selective one
    credited with the gap) -- so the table compares exclusions, not settings; a selective model then built
    with other settings than the proposal's is noted.
    """
    quant = options.quant.over(proposal.quant if proposal is not None else None)
    settings = quant.resolve()
    methods = options.methods or (settings.method,)
    if proposal is not None and "selective" in (options.variants or ()):
        made = proposal.quant
        used = {"method": methods[0], "activation type": settings.activation_type}
        used["weight type"] = settings.weight_type
        was = {"method": proposal.method, "activation type": proposal.activation_type}
        was["weight type"] = proposal.weight_type
        differ = [f"{k} {used[k]} (proposal: {was[k]})" for k in used if was[k] and was[k] != used[k]]
        same_rest = dataclasses.replace(settings, method=made.method, source="") == made.without_source()
        if not differ and not same_rest and proposal.quant_settings is not None:
            differ = [f"{settings.source or 'other settings'} ({describe(settings)})"]
        if differ:
            notes.append(
                f"the selective model is built with {', '.join(differ)}: its scales differ from the "
                "proposal's model"
            )
    return replace(options, methods=methods, quant=quant)


def build_variants(
    prep: Prepared,
    ranges: dict[str, Ranges],
    options: BenchOptions,
    proposal: Proposal | None,
    workdir: Path,
    progress: Progress,
) -> list[Built]:
    """Build every variant ``options`` asks for into ``workdir``, in order; one that fails keeps its error.

    Two failures are not one variant's and stop the run: a proposal naming nodes the model does not
    have (the user's error), and an output error (a full disk fails every later write too).
    """
    several = len(options.methods) > 1
    per_channel = prep.settings.per_channel
    built: list[Built] = []
    plan = _plan(options)
    for i, (kind, method) in enumerate(plan):
        progress("build", i, len(plan))
        if kind == "fp32":
            built.append(Built("fp32", kind, "", "", False, prep.normalized_path))
            continue
        name = f"{kind}-{method}" if several and kind in ("static", "qoperator") else kind
        path = workdir / f"{name}.onnx"
        try:
            if kind == "dynamic":
                built.append(_dynamic(prep, name, path, options))
            elif kind in ("static", "qoperator"):
                built.append(_static(prep, name, kind, method, ranges[method], path, options))
            else:
                assert proposal is not None  # the driver refuses the selective variant without one
                built.append(_selective(prep, name, method, ranges[method], path, options, proposal))
        except QDebugError as e:
            if kind == "selective" and "not in the model" in e.message:
                raise  # a proposal for another model is the user's error, not a variant failure
            if e.code == ExitCode.OUTPUT:
                raise  # a full disk fails every later write too: not one variant's failure
            built.append(Built(name, kind, method, "", per_channel, None, error=e.one_line()))
    progress("build", len(plan), len(plan))
    return built


def _plan(options: BenchOptions) -> list[tuple[str, str]]:
    """(kind, calibration method) of each variant to build: static and QOperator once per method."""
    plan: list[tuple[str, str]] = []
    for kind in options.variants or ():
        if kind in ("static", "qoperator"):
            plan.extend((kind, m) for m in options.methods)
        elif kind == "selective":
            plan.append((kind, options.methods[0]))
        else:
            plan.append((kind, ""))
    return plan


def _dynamic(prep: Prepared, name: str, path: Path, options: BenchOptions) -> Built:
    """The dynamic variant (``quantize_dynamic``: int8 weights, activations quantized at run time)."""
    per_channel = prep.settings.per_channel
    quantize_dynamic_model(
        prep.normalized_path,
        path,
        op_types=options.dynamic_ops or None,
        per_channel=per_channel,
    )
    # the op types only when --dynamic-ops chose them ("ORT's default op types" told nothing)
    notes = (f"op types: {','.join(options.dynamic_ops)}",) if options.dynamic_ops else ()
    notes += tuple(n for n in [dynamic_conv_note(prep.normalized, options.dynamic_ops)] if n)
    return Built(name, "dynamic", "", "dynamic", per_channel, path, notes=notes)


def _static(
    prep: Prepared, name: str, kind: str, method: str, ranges: Ranges, path: Path, options: BenchOptions
) -> Built:
    """A static variant from one method's ranges, in the QDQ format or (``qoperator``) the QOperator one."""
    spec = QuantSpec.of(prep.settings)  # the method is the ranges'
    fmt = "QOperator" if kind == "qoperator" else "QDQ"
    quantize_static_model(prep.normalized, ranges, spec, path, quant_format=fmt)
    return Built(name, kind, method, fmt, spec.per_channel, path)


def _selective(
    prep: Prepared,
    name: str,
    method: str,
    ranges: Ranges,
    path: Path,
    options: BenchOptions,
    proposal: Proposal,
) -> Built:
    """The static variant with the proposal's exclusions, tensor overrides and per-channel setting, quantized
    from the proposal's recipe's transformed FP32 model when it has one."""
    if proposal.recipe is not None and proposal.recipe.fp32_model:
        prep = recipe_base(prep, proposal, AnalyzeOptions(runtime=options.runtime), method)
        assert prep.ranges is not None
        ranges = prep.ranges
    spec = QuantSpec.of(
        prep.settings,
        per_channel=proposal.per_channel,
        nodes_to_exclude=tuple(proposal.nodes_to_exclude),
        tensor_overrides=tuple(proposal.tensor_overrides),
        **(proposal.recipe.spec_changes() if proposal.recipe is not None else {}),  # type: ignore[arg-type]
    )
    quantize_model(prep.normalized, ranges, spec, path)
    notes = []
    if proposal.per_channel != prep.settings.per_channel:
        mode = ("per-channel", "per-tensor") if proposal.per_channel else ("per-tensor", "per-channel")
        flag = "--per-channel" if proposal.per_channel else "no --per-channel"
        notes.append(
            f"{mode[0]} weights as in the proposal, where the static variants are {mode[1]}: it "
            f"differs from static by more than its exclusions ({flag} compares like for like)"
        )
    if proposal.tensor_overrides:
        notes.append(f"{len(proposal.tensor_overrides)} tensor override(s) (e.g. 16-bit activations)")
    return Built(
        name,
        "selective",
        method,
        "QDQ",
        proposal.per_channel,
        path,
        excluded=len(proposal.nodes_to_exclude),
        notes=tuple(notes),
    )


def replace_error(b: Built, error: str) -> Built:
    """``b`` as a failed variant (it built, but could not be loaded or scored)."""
    return replace(b, error=error)
