"""The prelude every command shares: load and normalize the model, open the data, calibrate once.

``analyze``, ``propose``, ``verify`` and ``bench`` all start here, so none of them imports another
command to get going; the proposal-vs-model checks that verify, bench and the TUI apply live here too.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import onnx

from qdebug import __version__
from qdebug.analysis import DEFAULT_FAKEQUANT_SAMPLES, LayerErrors, kernel_gap_nodes
from qdebug.data import DataSet, model_input_specs, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.evaluation.samples import DEFAULT_FLIP_DETAILS
from qdebug.graph.load import default_opset, is_large, load_model, normalize, save_model
from qdebug.graph.ops import INTEGER_KERNEL_OPS, QUANT_OPS
from qdebug.output.files import sha256_file
from qdebug.progress import Progress, no_progress
from qdebug.quant.calibrate import Ranges, calibrate
from qdebug.quant.config import LoadedConfig, calibration_options, check_node_names
from qdebug.quant.config import resolve as resolve_settings
from qdebug.quant.quantize import float16_exclusions
from qdebug.records import (
    SCHEMA_VERSION,
    AnalysisConfig,
    ModelInfo,
    NodeRecord,
    OutputMetric,
    Proposal,
    Report,
    TaskMetric,
    WeightRecord,
)
from qdebug.records.report import QuantSettings
from qdebug.runtime.capture import check_providers

if TYPE_CHECKING:
    from qdebug.data.specs import InputSpec
    from qdebug.specialize import DataSource


@dataclass(frozen=True)
class RuntimeSettings:
    """How a command's sessions run: providers, threads, the calibration cache. Nothing here changes a
    number the report records, so no record stores it (batch size and sample counts do change them: they
    stay the commands' own options, recorded in the report's config)."""

    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0
    use_cache: bool = True
    """Read and write the calibration cache (``--no-cache``: neither)."""
    workers: int | None = None
    """Candidate evaluations run side by side (``--workers``; None: the cores the process may use, 1: in this
    process, as before). The answers do not depend on it (:mod:`qdebug.runtime.parallel`)."""
    ray: str | None = None
    """``--ray auto|ADDRESS``: score the evaluations on a Ray cluster instead of local processes."""


@dataclass(frozen=True)
class QuantRequest:
    """The quantization a command was asked for, before the report's or proposal's settings are known.

    ``config`` is the base: a ``--config`` file or ``--preset`` (:class:`~qdebug.quant.config.LoadedConfig`),
    recorded settings (:class:`~qdebug.records.QuantSettings`: the report's for propose, the proposal's for
    verify and bench, see :meth:`over`), or None for qdebug's defaults. ``given`` are the flags the user
    gave, applied last: a ``QuantSettings`` field or an ``extra_options`` key each. :meth:`resolve` (in
    :func:`prepare`, once the normalized model is known) gives the one ``QuantSettings`` to build with.
    """

    config: LoadedConfig | QuantSettings | None = None
    given: tuple[tuple[str, Any], ...] = ()

    def value(self, name: str, default: Any = None) -> Any:
        """A flag's value when given, else ``default``."""
        return next((v for k, v in self.given if k == name), default)

    def with_given(self, changes: Mapping[str, Any], unset: Sequence[str] = ()) -> QuantRequest:
        """The request with flags set (``changes``) and taken back (``unset``)."""
        kept = {k: v for k, v in self.given if k not in changes and k not in unset}
        return dataclasses.replace(self, given=tuple({**kept, **changes}.items()))

    def over(self, recorded: QuantSettings | None) -> QuantRequest:
        """The request with ``recorded`` as its base unless a config or preset was given."""
        return self if self.config is not None or recorded is None else dataclasses.replace(self, config=recorded)

    def resolve(self, model: onnx.ModelProto | None = None) -> QuantSettings:
        """The settings to build with (:func:`qdebug.quant.config.resolve`)."""
        return resolve_settings(self.config, self.given, model)


QUANT_FLAT = ("method", "per_channel", "activation_type", "weight_type", "upgrade_opset", "inline_constant_if")
"""The quantization settings the Options classes still take (and give) as flat keyword arguments."""
RUNTIME_FLAT = ("providers", "threads", "use_cache", "workers", "ray")
"""The runtime settings they take as flat keyword arguments."""

_T = TypeVar("_T")


def flat_settings(quant: Sequence[str] = (), *, resolved: bool = False) -> Callable[[type[_T]], type[_T]]:
    """Keep an Options class's flat keyword arguments working over its embedded records.

    ``Options(method="entropy", providers=(...))``, ``dataclasses.replace(options, per_channel=True)`` and
    ``options.method`` read and write ``options.quant`` (a :class:`QuantRequest`) and ``options.runtime``
    (a :class:`RuntimeSettings`). ``resolved``: the flat names read the settings resolved over qdebug's
    defaults (analyze); otherwise they read the flags given, None/False meaning "not given -- the
    proposal's" (verify, bench), and passing None/False takes a flag back.
    """

    def decorate(cls: type[_T]) -> type[_T]:
        generated = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            flat_q = {k: kwargs.pop(k) for k in quant if k in kwargs}
            flat_r = {k: kwargs.pop(k) for k in RUNTIME_FLAT if k in kwargs}
            if flat_q:
                keep = {k: v for k, v in flat_q.items() if resolved or not (v is None or v is False)}
                request = kwargs.get("quant") or QuantRequest()
                kwargs["quant"] = request.with_given(keep, unset=[k for k in flat_q if k not in keep])
            if flat_r:
                kwargs["runtime"] = dataclasses.replace(kwargs.get("runtime") or RuntimeSettings(), **flat_r)
            generated(self, *args, **kwargs)

        __init__.__doc__ = generated.__doc__
        cls.__init__ = __init__  # type: ignore[misc]
        for name in quant:
            setattr(cls, name, property(_flat_quant(name, resolved), doc=f"``quant``'s {name} (flat view)."))
        for name in RUNTIME_FLAT:
            setattr(cls, name, property(_flat_runtime(name), doc=f"``runtime.{name}`` (flat view)."))
        return cls

    return decorate


def _flat_quant(name: str, resolved: bool) -> Callable[[Any], Any]:
    def get(self: Any) -> Any:
        if resolved:
            return getattr(self.quant.resolve(), name)
        return self.quant.value(name, False if name in ("per_channel", "upgrade_opset", "inline_constant_if") else None)

    return get


def _flat_runtime(name: str) -> Callable[[Any], Any]:
    return lambda self: getattr(self.runtime, name)


@flat_settings(QUANT_FLAT, resolved=True)
@dataclass(frozen=True)
class AnalyzeOptions:
    """Options of :func:`analyze` (the CLI flags of ``qdebug analyze``).

    The quantization settings live in ``quant`` and the runtime ones in ``runtime``; ``method``,
    ``per_channel``, ``activation_type``, ``weight_type``, ``upgrade_opset``, ``inline_constant_if``,
    ``providers``, ``threads`` and ``use_cache`` are still accepted and read as flat names.
    """

    quant: QuantRequest = field(default_factory=QuantRequest)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    batch_size: int | None = None
    max_samples: int | None = None
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (input, axis); the others are read off the model (``decide_batch_axes``)."""
    metric: str | None = None
    engine: str = "auto"
    """Capture engine: ``graph`` (reductions inside ORT), ``numpy`` (exact float64 copies), ``auto``."""
    fakequant_samples: int | None = DEFAULT_FAKEQUANT_SAMPLES
    """Run the fake-quant view on the first N samples only (None: all; 0: skip it)."""
    flip_details: int = DEFAULT_FLIP_DETAILS
    """Flipped samples measured tensor by tensor in the per-sample drill-down (``--flip-details``; 0: none;
    :data:`qdebug.evaluation.samples.DEFAULT_FLIP_DETAILS`)."""

    @property
    def settings(self) -> QuantSettings:
        """The quantization settings resolved without the model (a ``get_qdq_config`` config's op types
        need it: :attr:`Prepared.settings` has the final ones)."""
        return self.quant.resolve()


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
    settings: QuantSettings = field(default_factory=QuantSettings)
    """The quantization settings every variant is built from (the request resolved on the normalized
    model, node names checked, the inputs it was specialized on); the ranges were calibrated with them."""
    data_constant_ifs: tuple[str, ...] = ()
    """If nodes whose condition reads only inputs that hold one value in the data, left in place for want
    of ``--inline-constant-if`` (:mod:`qdebug.specialize`): the structure note says so."""


def prepare(
    model_path: str | Path,
    calib: str | Path,
    workdir: Path,
    options: AnalyzeOptions,
    *,
    need_ranges: bool = True,
    progress: Progress = no_progress,
    check: Callable[[onnx.ModelProto], None] | None = None,
    eval_data: str | Path | None = None,
    eval_max_samples: int | None = None,
    eval_limit_flag: str | None = None,
) -> Prepared:
    """Load, normalize and save the model; open the calibration data; calibrate (cached).

    ``check`` sees the normalized model before any data is read: a proposal
    naming nodes the model lacks is refused before calibration, not after.
    ``eval_data`` (its first ``eval_max_samples``, limited by the command's ``eval_limit_flag``) is the
    evaluation data the command reads later: its values are checked before calibration, and an If decided
    by inputs that hold one value in the data must hold it there too (:mod:`qdebug.specialize`).
    """
    prep = prelude(
        model_path,
        calib,
        workdir,
        options,
        check=check,
        eval_data=eval_data,
        eval_max_samples=eval_max_samples,
        eval_limit_flag=eval_limit_flag,
    )
    if not need_ranges:
        return prep
    float16_exclusions(prep.normalized)  # refuse an all-float16 model before calibrating
    return calibrated(prep, prep.settings, options, progress)


def prelude(
    model_path: str | Path,
    calib: str | Path,
    workdir: Path,
    options: AnalyzeOptions,
    *,
    check: Callable[[onnx.ModelProto], None] | None = None,
    eval_data: str | Path | None = None,
    eval_max_samples: int | None = None,
    eval_limit_flag: str | None = None,
) -> Prepared:
    """:func:`prepare` up to calibration: what every calibration method of one model and data shares
    (``analyze --method a,b,c`` runs it once). The result has no ranges; :func:`calibrated` adds them."""
    from qdebug.specialize import DataSource, InputScan, input_values, specialized_inputs

    check_providers(options.providers)
    settings = options.quant.resolve()  # a bad config is refused before the model is read
    loaded = load_model(model_path)
    _refuse_quantized_base(loaded.proto, model_path)
    sources = [DataSource("calibration data", calib, options.max_samples)]
    if eval_data is not None:
        sources.append(DataSource("evaluation data", eval_data, eval_max_samples, eval_limit_flag))
    scan = InputScan(loaded.proto, sources, batch_size=options.batch_size, batch_axes=options.batch_axes)
    for recorded in settings.specialized_inputs:  # the report's: refused here, before any long work
        scan.require(recorded)
    # recorded settings (propose, verify, bench) inline what the report did, and nothing else
    discover = not isinstance(options.quant.config, QuantSettings)
    norm = normalize(
        loaded,
        upgrade_opset=settings.upgrade_opset,
        inline_constant_if=settings.inline_constant_if,
        input_value=input_values(scan, settings.specialized_inputs, discover=discover),
    )
    del scan
    settings = _on_model(options, norm.proto, settings)
    settings = dataclasses.replace(settings, specialized_inputs=specialized_inputs(norm.data_ifs))
    if check is not None:
        check(norm.proto)
    normalized_path = workdir / "normalized.onnx"
    save_model(norm.proto, normalized_path)
    info = model_info(loaded.path, loaded.proto, loaded.sha256)
    del loaded  # the normalized model is what the rest works on: not two copies of the weights
    specs = model_input_specs(norm.proto, options.batch_axes)
    data = open_data(calib, specs, batch_size=options.batch_size, max_samples=options.max_samples)
    _check_values(data, sources[1:], specs, options.batch_size)
    held = tuple(d.node for d in norm.data_ifs if not d.inlined)
    return Prepared(info, norm.proto, normalized_path, norm.notes, dict(norm.name_map), data, None, settings, held)


def _check_values(
    calibration: DataSet, others: Sequence[DataSource], specs: tuple[InputSpec, ...], batch_size: int | None
) -> None:
    """Every data source's values checked before calibration (NaN/Inf, exit 5): an evaluation set had been
    refused only when it was first scored, after calibration, the fake-quant view and the capture (19 s on a
    YOLOv8n detector)."""
    calibration.check_values()
    for source in others:
        open_data(
            source.source,
            specs,
            batch_size=batch_size,
            max_samples=source.max_samples,
            what=source.what,
            limit_flag=source.limit_flag,
        ).check_values()


def method_settings(options: AnalyzeOptions, normalized: onnx.ModelProto) -> QuantSettings:
    """The settings ``options`` resolve to on the normalized model (node names checked), as :func:`prelude`
    resolves them: what one method of ``analyze --method a,b,c`` builds with."""
    return _on_model(options, normalized, options.quant.resolve())


def _on_model(options: AnalyzeOptions, normalized: onnx.ModelProto, settings: QuantSettings) -> QuantSettings:
    """``settings`` completed on the normalized model: a ``get_qdq_config`` config picks the op types of this
    model; the node names they name must be in it."""
    if isinstance(options.quant.config, LoadedConfig) and options.quant.config.function != "quantize_static":
        settings = options.quant.resolve(normalized)
    check_node_names(settings, normalized)
    return settings


def calibrated(
    prep: Prepared, settings: QuantSettings, options: AnalyzeOptions, progress: Progress = no_progress
) -> Prepared:
    """``prep`` with the ranges of ``settings``' calibration method over its data (cached), and ``settings``."""
    prep = dataclasses.replace(prep, settings=settings)
    return dataclasses.replace(prep, ranges=ranges_by(prep, options, settings.method, progress))


def ranges_by(
    prep: Prepared, options: AnalyzeOptions, method: str, progress: Progress = no_progress, **calib_options: object
) -> Ranges:
    """``prep``'s model calibrated with another ``method`` (and calibrator options, e.g. ``percentile``) over
    the same data and op types as its own ranges, cached like them: what a per-tensor choice of method reads."""
    count = [0]

    def on_batch(n: int) -> None:
        count[0] += n
        progress("calibrate", count[0], prep.calib.n_samples)

    return calibrate(
        prep.normalized_path,
        sha256_file(prep.normalized_path),
        prep.calib,
        method,
        use_cache=options.use_cache,
        on_batch=on_batch,
        providers=options.providers,
        large=is_large(prep.normalized),
        op_types=prep.settings.op_types or None,
        calib_options={**calibration_options(prep.settings), **calib_options},
    )


def recipe_base(prep: Prepared, proposal: Proposal, options: AnalyzeOptions, method: str = "") -> Prepared:
    """The prepared FP32 model a proposal's selective variant is quantized from: ``prep`` itself, or the
    proposal's recipe's transformed model (:class:`~qdebug.records.RecipeRecord`), checked by hash and
    calibrated with ``prep``'s settings (``method``: another calibration method's), cached like any ranges."""
    recipe = proposal.recipe
    if recipe is None or not recipe.fp32_model:
        return prep
    path = Path(recipe.fp32_model)
    if not path.is_file():
        raise QDebugError(
            f"the proposal's recipe model {path} is missing (recipe {recipe.name})",
            "keep the proposal's <stem>_files/ folder where propose wrote it, or run qdebug propose again",
            ExitCode.INPUT,
        )
    if recipe.fp32_sha256 and sha256_file(path) != recipe.fp32_sha256:
        raise QDebugError(
            f"the proposal's recipe model {path} changed since propose wrote it (recipe {recipe.name})",
            "run qdebug propose again",
            ExitCode.INPUT,
        )
    base = dataclasses.replace(prep, normalized=load_model(path).proto, normalized_path=path.resolve(), ranges=None)
    settings = dataclasses.replace(prep.settings, method=method) if method else prep.settings
    return calibrated(base, settings, options)


def in_workdir(prep: Prepared, workdir: Path) -> Prepared:
    """``prep`` with its normalized model saved to ``workdir`` as well: each report of ``analyze --method
    a,b,c`` keeps its own ``<stem>_files/normalized.onnx``, byte for byte the one a run of its own writes."""
    path = workdir / "normalized.onnx"
    if path != prep.normalized_path:
        save_model(prep.normalized, path)
    return dataclasses.replace(prep, normalized_path=path)


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


def settings_notes(proposal: Proposal, settings: QuantSettings) -> list[str]:
    """A note when the models are built with other quantization settings than the proposal records (a
    ``--config``, ``--preset`` or flag given to verify): the selective model is then not propose's."""
    if proposal.quant_settings is None or settings.without_source() == proposal.quant.without_source():
        return []
    from qdebug.quant.config import describe

    return [
        f"the models are built with {settings.source or 'other settings'} ({describe(settings)}), not the "
        f"proposal's ({describe(proposal.quant)}): the selective model differs from the one propose measured"
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


def check_proposal(proposal: Proposal, model_sha256: str, model_path: str | Path, normalized: onnx.ModelProto) -> None:
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


def assemble_report(
    prep: Prepared,
    qinfo: ModelInfo,
    layers: LayerErrors,
    nodes: tuple[NodeRecord, ...],
    weights: tuple[WeightRecord, ...],
    outputs: tuple[OutputMetric, ...],
    task: TaskMetric,
    config: AnalysisConfig,
    notes: Sequence[str],
    ranges: Mapping[str, tuple[float, float]] | None = None,
    calibration_cache: str | None = None,
) -> Report:
    """The report of one analysis, from its stages' results (stamped with the versions and the time).

    Shared by ``analyze`` and any other command that measures a quantized model's layers (a dynamic
    model has no calibrated ``ranges`` and no ``calibration_cache``).
    """
    import onnxruntime

    return Report(
        schema_version=SCHEMA_VERSION,
        qdebug_version=__version__,
        ort_version=onnxruntime.__version__,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        model=prep.model,
        normalized_model=str(prep.normalized_path.resolve()),
        quantized_model=qinfo,
        config=config,
        calibration_cache=calibration_cache,
        samples=layers.samples,
        nodes=nodes,
        tensors=layers.tensors,
        weights=weights,
        outputs=outputs,
        task=task,
        deployed_gap=layers.deployed_gap,
        not_captured=layers.not_captured,
        notes=tuple(notes),
        name_map=tuple(sorted(prep.name_map.items())),
        ranges=tuple((k, lo, hi) for k, (lo, hi) in sorted((ranges or {}).items())),
        kernel_gap_nodes=kernel_gap_nodes(layers.tensors, layers.deployed_head, skip=layers.aliases, nodes=nodes),
    )
