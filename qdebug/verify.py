"""Verify a proposal: FP32 vs full static vs selective static, side by side, on the evaluation set.

The selective model is re-quantized from the cached calibration ranges with
the proposal's ``nodes_to_exclude``/overrides (the proposal's own model file is
not trusted), and the three variants are compared on:

* the task metric and the worst output SQNR vs FP32;
* the recovered fraction ``(sel - static) / (fp32 - static)`` -- for a metric
  with no finite FP32 value (output SQNR) the verdict uses ``--target-sqnr``;
* nodes kept FP32 (count and share of the quantizable nodes), Q/DQ pairs;
* model size, and latency p50/p95 + throughput measured fairly by
  :func:`time_sessions`: one session per variant created once with the same
  provider and threads, the same input buffers bound once (IOBinding), a
  warm-up, then timed runs in alternating rounds so drift hits every variant alike.

``make_tui_verify`` adapts all of this to the TUI's ``verify_fn`` protocol.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdebug.data import feed_rows
from qdebug.errors import ExitCode, QDebugError
from qdebug.formatting import ACCURACY_METRICS, fmt_db, fmt_metric
from qdebug.records import SCHEMA_VERSION, Proposal, Report
from qdebug.report_io import load_proposal

if TYPE_CHECKING:
    import numpy as np
    import onnx

    from qdebug.capture import SessionConfig

DEFAULT_MIN_RECOVERY = 0.9
CHUNK_RUNS = 10
"""Timed runs per model per round of :func:`time_sessions`."""


@dataclass(frozen=True)
class Timing:
    """Latency of one variant over ``runs`` timed runs of the same batch."""

    p50_ms: float
    p95_ms: float
    mean_ms: float
    throughput: float
    """Samples per second at this batch size (batch / mean latency)."""
    batch: int
    runs: int
    warmup: int
    threads: int
    """Intra-op threads asked for (0: ORT's default)."""
    provider: str


@dataclass(frozen=True)
class VariantResult:
    """One column of the side-by-side table."""

    name: str
    """``fp32``, ``static`` or ``selective``."""
    metric: float
    output_sqnr_db: float
    """Worst output SQNR vs FP32 (``inf`` for FP32 itself)."""
    nodes_excluded: int
    excluded_share: float
    """``nodes_excluded`` / quantizable nodes."""
    tensor_overrides: int
    qdq_pairs: int
    """QuantizeLinear nodes in the model (0 for FP32)."""
    size_bytes: int
    path: str | None
    timing: Timing | None = None


@dataclass(frozen=True)
class VerifyResult:
    """The verify report (``verify.json``)."""

    schema_version: int
    kind: str
    """Always ``"verify"``."""
    model_path: str
    model_sha256: str
    proposal: str
    """Where the proposal came from (a path, or ``tui``)."""
    metric: str
    samples: int
    quantizable_nodes: int
    variants: tuple[VariantResult, ...]
    recovered_fraction: float
    """``(sel - static) / (fp32 - static)``; ``nan`` when nothing was lost or FP32 has no finite value."""
    min_recovery: float
    target_sqnr_db: float
    """``nan`` when not asked."""
    met: bool
    verdict: str
    seconds: float
    notes: tuple[str, ...] = ()
    """What the user should know (e.g. a calibration that differs from the proposal's)."""
    target_drop: float = math.nan
    """The allowed drop vs FP32 when judged by it (``--target-drop``); ``nan`` when judged by recovery."""

    def variant(self, name: str) -> VariantResult:
        """The ``fp32``/``static``/``selective`` column."""
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def summary_lines(self) -> list[str]:
        """Plain-text side-by-side table and verdict (the CLI prints it; the TUI shows it)."""
        cols = self.variants
        rows: list[tuple[str, list[str]]] = [
            (self.metric, [fmt_metric(self.metric, v.metric) for v in cols]),
            ("output SQNR dB", [fmt_db(v.output_sqnr_db) for v in cols]),
            (
                "nodes FP32",
                [
                    f"{v.nodes_excluded} ({100 * v.excluded_share:.1f}%)" if v.name != "fp32" else "all"
                    for v in cols
                ],
            ),
            ("16-bit tensors", [str(v.tensor_overrides) for v in cols]),
            ("Q/DQ pairs", [str(v.qdq_pairs) for v in cols]),
            ("size", [_fmt_size(v.size_bytes) for v in cols]),
        ]
        if all(math.isnan(v.output_sqnr_db) for v in cols if v.name != "fp32"):
            del rows[1]  # no float output (ArgMax, token ids): there is no SQNR to show
        if all(v.timing is not None for v in cols):
            rows += [
                ("latency p50 ms", [f"{v.timing.p50_ms:.3f}" for v in cols if v.timing]),
                ("latency p95 ms", [f"{v.timing.p95_ms:.3f}" for v in cols if v.timing]),
                ("throughput /s", [f"{v.timing.throughput:.0f}" for v in cols if v.timing]),
            ]
        width = max(len(r[0]) for r in rows)
        cw = [max(len(v.name), *(len(r[1][i]) for r in rows)) for i, v in enumerate(cols)]
        lines = [" " * width + "  " + "  ".join(v.name.rjust(cw[i]) for i, v in enumerate(cols))]
        for label, vals in rows:
            lines.append(label.ljust(width) + "  " + "  ".join(x.rjust(cw[i]) for i, x in enumerate(vals)))
        timing = cols[0].timing
        if timing is not None:
            lines.append(
                f"timing: batch {timing.batch}, {timing.runs} runs after {timing.warmup} warm-up, "
                f"{timing.provider}, threads {timing.threads or 'default'}"
            )
        lines.append(self.verdict)
        return lines


def _fmt_size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


# ----------------------------------------------------------------------------- timing


def time_sessions(
    models: Mapping[str, onnx.ModelProto],
    feeds: Mapping[str, np.ndarray],
    config: SessionConfig,
    *,
    runs: int = 50,
    warmup: int = 5,
    cancelled: Callable[[], bool] | None = None,
) -> dict[str, Timing]:
    """Latency of each model on the same batch, measured fairly.

    One session per model, created once with the same ``config`` (provider,
    threads, full graph optimization); inputs bound once through IOBinding and
    reused by every run; ``warmup`` untimed runs each; then the timed runs in
    rounds of :data:`CHUNK_RUNS` per model in turn, so that CPU frequency or
    background load changes affect all models alike while each model's thread
    pool runs undisturbed by the others' spinning workers within a round.
    """
    import numpy as np

    from qdebug.capture import make_session

    bound = {}
    for name, model in models.items():
        session = make_session(model, config, what=f"{name} model")
        io = session.io_binding()
        for i in session.get_inputs():
            if i.name in feeds:  # an optional input the data leaves out: ORT runs without it
                io.bind_cpu_input(i.name, np.asarray(feeds[i.name], order="C"))
        for o in session.get_outputs():
            io.bind_output(o.name)
        bound[name] = (session, io)
    for session, io in bound.values():
        for _ in range(warmup):
            session.run_with_iobinding(io)
    samples: dict[str, list[float]] = {name: [] for name in bound}
    done = 0
    while done < runs:
        if cancelled is not None and cancelled():
            break
        chunk = min(CHUNK_RUNS, runs - done)
        for name, (session, io) in bound.items():
            for _ in range(chunk):
                t0 = time.perf_counter()
                session.run_with_iobinding(io)
                samples[name].append(time.perf_counter() - t0)
        done += chunk
    batch = feed_rows(feeds)
    provider = config.providers[0] if config.providers else "CPUExecutionProvider"
    out = {}
    for name, xs in samples.items():
        if not xs:
            continue
        xs_sorted = sorted(xs)
        mean = statistics.fmean(xs)
        out[name] = Timing(
            p50_ms=1e3 * _percentile(xs_sorted, 50),
            p95_ms=1e3 * _percentile(xs_sorted, 95),
            mean_ms=1e3 * mean,
            throughput=batch / mean if mean > 0 else math.inf,
            batch=batch,
            runs=len(xs),
            warmup=warmup,
            threads=config.intra_op_threads,
            provider=provider,
        )
    return out


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


# ----------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class VerifyOptions:
    """Options of :func:`verify` (the flags of ``qdebug verify``)."""

    min_recovery: float = DEFAULT_MIN_RECOVERY
    target_sqnr: float | None = None
    target_drop: float | None = None
    """Judge as ``propose --target-drop`` does instead of by recovery: the selective model may lose at most
    this much against FP32 (points for top-1 style metrics). None: judge by ``min_recovery``."""
    metric: str | None = None
    method: str | None = None
    """Calibration method (None: the proposal's, else minmax)."""
    activation_type: str | None = None
    weight_type: str | None = None
    per_channel: bool = False
    """Per-channel weights for the static baseline too (the selective model also follows the proposal)."""
    batch_size: int | None = None
    max_samples: int | None = None
    eval_max_samples: int | None = None
    runs: int = 50
    """Timed runs per variant (0: no latency measurement)."""
    warmup: int = 5
    use_cache: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0
    upgrade_opset: bool = False
    inline_constant_if: bool = False


class _Context:
    """What verify needs that does not depend on the proposal (built once; reused by the TUI)."""

    def __init__(
        self,
        model: str | Path,
        calib: str | Path,
        eval_data: str | Path | None,
        workdir: Path,
        options: VerifyOptions,
        method: str,
        progress: Callable[[str, int, int | None], None],
        check: Callable[[Any], None] | None = None,
    ) -> None:
        from qdebug.analysis import quantized_node_names
        from qdebug.calibrate import op_types_to_quantize
        from qdebug.capture import SessionConfig
        from qdebug.data import data_notes, open_data
        from qdebug.evaluate import Evaluator, metric_scope_note
        from qdebug.graph.match import pair_models
        from qdebug.prepare import AnalyzeOptions, prepare

        self.options = options
        aopts = AnalyzeOptions(
            method=method,
            batch_size=options.batch_size,
            max_samples=options.max_samples,
            upgrade_opset=options.upgrade_opset,
            inline_constant_if=options.inline_constant_if,
            use_cache=options.use_cache,
            providers=options.providers,
            threads=options.threads,
        )
        self.prep = prepare(model, calib, workdir, aopts, progress=progress, check=check)
        self.config = SessionConfig(providers=options.providers, intra_op_threads=options.threads)
        eval_set = self.prep.calib
        if eval_data is not None:
            eval_set = open_data(
                eval_data,
                self.prep.calib.specs,
                batch_size=options.batch_size,
                max_samples=options.eval_max_samples,
                what="evaluation data",
                limit_flag="--eval-max-samples",
            )
        elif options.eval_max_samples is not None:
            eval_set = open_data(
                calib,
                self.prep.calib.specs,
                batch_size=options.batch_size,
                max_samples=options.eval_max_samples,
                what="evaluation data",
                limit_flag="--eval-max-samples",
            )
        self.data_notes = data_notes(
            self.prep.calib, eval_set if eval_set is not self.prep.calib else None, self.prep.normalized
        )
        self.evaluator = Evaluator(self.prep.normalized, eval_set, self.config, options.metric)
        self.data_notes += [n for n in [metric_scope_note(self.evaluator)] if n]
        self.feeds = dict(self.evaluator.batches[0].feeds)
        self.static_cache: dict[tuple, tuple[Any, Any, set[str]]] = {}
        self._pair_models = pair_models
        self._quantized_node_names = quantized_node_names
        self._ops = set(op_types_to_quantize())

    def static(self, spec: Any) -> tuple[Any, Any, set[str]]:
        """(model, EvalResult, quantizable node names) of the full static variant (cached per spec)."""
        from qdebug.quantize import quantize_static_model

        key = (spec.per_channel, spec.activation_type, spec.weight_type)
        if key not in self.static_cache:
            model = quantize_static_model(self.prep.normalized, self.prep.ranges, spec)
            result = self.evaluator.score(model, what="static quantized model")
            pairing = self._pair_models(self.prep.normalized, model)
            qnodes = self._quantized_node_names(model, pairing)
            ops = {n.name: n.op_type for n in self.prep.normalized.graph.node}
            quantizable = {n for n in qnodes if ops.get(n) in self._ops}
            self.static_cache[key] = (model, result, quantizable)
        return self.static_cache[key]


def verify(
    model: str | Path,
    calib: str | Path,
    eval_data: str | Path | None,
    proposal: Proposal | str | Path,
    *,
    options: VerifyOptions | None = None,
    output: str | Path | None = None,
    progress: Callable[[str, int, int | None], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    _context: _Context | None = None,
) -> VerifyResult:
    """Re-quantize with the proposal and compare FP32 / full static / selective static.

    Args:
        model: the user's FP32 model (must be the one the proposal was made for).
        calib: calibration data (ranges come from the cache when present).
        eval_data: evaluation data (None: the calibration data).
        proposal: a :class:`Proposal` or the path of a proposal file.
        options: see :class:`VerifyOptions`.
        output: write ``verify.json`` here (atomically), and the static/selective models to ``<stem>_files/``.
        progress: callback(stage, done, total).
        cancelled: polled between stages; when it turns True the function returns early with what it has
            (only used by the TUI, which discards that result).

    """
    import tempfile

    from qdebug.files import (
        artifacts_dir,
        atomic_write_text,
        check_outputs_spare_inputs,
        check_writable,
        removed_on_failure,
    )
    from qdebug.graph.load import load_model, save_model, stored_size
    from qdebug.prepare import base_setting_notes, calibration_notes, check_proposal
    from qdebug.quantize import QuantSpec, quantize_static_model
    from qdebug.report_io import dumps

    start = time.perf_counter()
    options = options or VerifyOptions()
    progress = progress or (lambda stage, done, total: None)
    cancelled = cancelled or (lambda: False)
    source = "tui" if isinstance(proposal, Proposal) else str(proposal)
    if output is not None:
        check_outputs_spare_inputs(
            {"the verify result": output},
            {
                "the model": model,
                "the calibration data": calib,
                "the evaluation data": eval_data,
                "the proposal": None if isinstance(proposal, Proposal) else proposal,
            },
        )
    if not isinstance(proposal, Proposal):
        proposal = load_proposal(proposal)
    if options.eval_max_samples is not None and options.eval_max_samples < 1:
        raise QDebugError(
            f"--eval-max-samples must be >= 1 (got {options.eval_max_samples})",
            "pass a positive number",
            ExitCode.USAGE,
        )
    if options.target_sqnr is not None and not math.isfinite(options.target_sqnr):
        raise QDebugError(
            f"--target-sqnr must be a finite number (got {options.target_sqnr})",
            "pass the required output SQNR in dB",
            ExitCode.USAGE,
        )
    if options.target_drop is not None and not 0.0 <= options.target_drop < math.inf:
        raise QDebugError(
            f"--target-drop must be >= 0 (got {options.target_drop})", "pass the allowed drop", ExitCode.USAGE
        )
    if not 0.0 <= options.min_recovery <= 1.5:
        raise QDebugError(
            f"--min-recovery must be within [0, 1.5] (got {options.min_recovery})",
            "pass a fraction such as 0.9",
            ExitCode.USAGE,
        )
    if output is not None:
        check_writable(output)
    loaded = load_model(model)
    if proposal.model_sha256 and proposal.model_sha256 != loaded.sha256:
        raise QDebugError(
            f"the proposal was made for another model (sha256 {proposal.model_sha256[:12]}...), not {model} "
            f"({loaded.sha256[:12]}...)",
            "run qdebug propose on a report of this model",
            ExitCode.INPUT,
        )
    method = options.method or proposal.method or "minmax"
    activation = options.activation_type or proposal.activation_type or "QUInt8"
    weight = options.weight_type or proposal.weight_type or "QInt8"
    if options.max_samples is None and proposal.calib_max_samples is not None:
        options = dataclasses.replace(options, max_samples=proposal.calib_max_samples)
    tmp = None
    # a failed or interrupted run leaves no half-filled <stem>_files/, and an earlier run's outputs as they were
    guard = removed_on_failure(
        artifacts_dir(Path(output)) if output is not None else None,
        [output],
        [model, calib, eval_data, source if source != "tui" else None],
    )
    try:
        with guard:
            ctx = _context
            if ctx is None:
                if output is not None:
                    workdir = artifacts_dir(Path(output))
                else:
                    tmp = tempfile.TemporaryDirectory(prefix="qdebug-verify-")
                    workdir = Path(tmp.name)
                ctx = _Context(
                    model,
                    calib,
                    eval_data,
                    workdir,
                    options,
                    method,
                    progress,
                    check=lambda normalized: check_proposal(proposal, loaded.sha256, model, normalized),
                )
            check_proposal(proposal, loaded.sha256, model, ctx.prep.normalized)
            evaluator = ctx.evaluator
            metric = evaluator.metric_name
            fp32_value = evaluator.fp32_value
            if not math.isfinite(fp32_value) and options.target_drop is not None:
                raise QDebugError(  # it had been skipped, yet recorded in verify.json as applied
                    f"--target-drop needs a metric with an FP32 value; {metric} has none",
                    "pass --target-sqnr DB to judge the selective model's output SQNR",
                    ExitCode.USAGE,
                )
            if not math.isfinite(fp32_value) and options.target_sqnr is None:
                raise QDebugError(
                    f"metric {metric} has no finite FP32 value, so a recovered fraction is undefined",
                    "pass --target-sqnr DB to judge the selective model's output SQNR",
                    ExitCode.USAGE,
                )
            base_pc = options.per_channel or bool(proposal.base_per_channel)
            base = QuantSpec(per_channel=base_pc, activation_type=activation, weight_type=weight)
            progress("static", 0, 3)
            static_model, static_res, quantizable = ctx.static(base)
            if cancelled():
                return _cancelled(proposal, source)
            progress("selective", 1, 3)
            sel_spec = QuantSpec(
                per_channel=options.per_channel or proposal.per_channel,
                activation_type=activation,
                weight_type=weight,
                nodes_to_exclude=tuple(proposal.nodes_to_exclude),
                tensor_overrides=tuple(proposal.tensor_overrides),
            )
            sel_model = quantize_static_model(ctx.prep.normalized, ctx.prep.ranges, sel_spec)
            sel_res = evaluator.score(sel_model, what="selective quantized model")
            if cancelled():
                return _cancelled(proposal, source)
            models = {"fp32": ctx.prep.normalized, "static": static_model, "selective": sel_model}
            sizes = {name: m.ByteSize() for name, m in models.items()}
            paths: dict[str, str | None] = {
                "fp32": str(loaded.path.resolve()),
                "static": None,
                "selective": None,
            }
            # the model every variant is built from (as bench reports it), weights files included
            sizes["fp32"] = stored_size(ctx.prep.normalized_path)
            if output is not None:
                files = artifacts_dir(Path(output))
                for name in ("static", "selective"):
                    path = files / f"{name}.onnx"
                    save_model(models[name], path)
                    paths[name] = str(path.resolve())
                    sizes[name] = stored_size(path)
            timings: dict[str, Timing] = {}
            if options.runs > 0:
                progress("timing", 2, 3)
                timings = time_sessions(
                    models,
                    ctx.feeds,
                    ctx.config,
                    runs=options.runs,
                    warmup=options.warmup,
                    cancelled=cancelled,
                )
                if cancelled():
                    return _cancelled(proposal, source)
            progress("timing", 3, 3)
            n_q = len(quantizable)
            excluded = [n for n in proposal.nodes_to_exclude if n in quantizable]

            def qdq(m: onnx.ModelProto) -> int:
                return sum(1 for n in m.graph.node if n.op_type == "QuantizeLinear")

            variants = (
                VariantResult(
                    "fp32",
                    fp32_value,
                    math.inf,
                    n_q,
                    1.0,
                    0,
                    0,
                    sizes["fp32"],
                    paths["fp32"],
                    timings.get("fp32"),
                ),
                VariantResult(
                    "static",
                    static_res.value,
                    static_res.output_sqnr_db,
                    0,
                    0.0,
                    0,
                    qdq(static_model),
                    sizes["static"],
                    paths["static"],
                    timings.get("static"),
                ),
                VariantResult(
                    "selective",
                    sel_res.value,
                    sel_res.output_sqnr_db,
                    len(excluded),
                    len(excluded) / n_q if n_q else math.nan,
                    len(proposal.tensor_overrides),
                    qdq(sel_model),
                    sizes["selective"],
                    paths["selective"],
                    timings.get("selective"),
                ),
            )
            recovered, met, verdict = judge(
                metric,
                fp32_value,
                static_res.value,
                sel_res.value,
                sel_res.output_sqnr_db,
                options.min_recovery,
                options.target_sqnr,
                options.target_drop,
            )
            result = VerifyResult(
                schema_version=SCHEMA_VERSION,
                kind="verify",
                model_path=str(loaded.path.resolve()),
                model_sha256=loaded.sha256,
                proposal=source,
                metric=metric,
                samples=evaluator.samples,
                quantizable_nodes=n_q,
                variants=variants,
                recovered_fraction=recovered,
                min_recovery=options.min_recovery,
                target_sqnr_db=math.nan if options.target_sqnr is None else float(options.target_sqnr),
                met=met,
                verdict=verdict,
                seconds=time.perf_counter() - start,
                notes=tuple(
                    ctx.data_notes
                    + calibration_notes(proposal, ctx.prep.ranges)
                    + base_setting_notes(proposal, options.per_channel)
                ),
                target_drop=math.nan if options.target_drop is None else float(options.target_drop),
            )
            if output is not None:
                atomic_write_text(output, dumps(result))
            return result
    finally:
        if tmp is not None:
            tmp.cleanup()


def judge(
    metric: str,
    fp32: float,
    static: float,
    selective: float,
    selective_sqnr: float,
    min_recovery: float,
    target_sqnr: float | None,
    target_drop: float | None = None,
) -> tuple[float, bool, str]:
    """(recovered fraction, met, one-line verdict).

    ``target_drop`` judges the selective model against FP32 as ``propose --target-drop`` does (points for
    accuracy metrics), so a CI gate can hold the proposal to the target it was searched for: by recovery,
    a proposal propose had reported as missing its target could pass.
    """
    parts = []
    met = True
    recovered = math.nan
    if math.isfinite(fp32) and math.isfinite(static) and fp32 - static > 1e-12:
        recovered = (selective - static) / (fp32 - static)
    if target_drop is not None and not math.isfinite(fp32):
        met = False
        parts.append(f"no FP32 value of {metric} to measure a drop from")
    elif target_drop is not None:
        scale = 100.0 if metric in ACCURACY_METRICS else 1.0
        drop = (fp32 - selective) * scale
        ok = drop <= target_drop + 1e-9
        met &= ok
        unit = " points" if scale == 100.0 else ""
        where = f"{drop:.2f}{unit} below" if drop >= 0 else f"{-drop:.2f}{unit} above"
        parts.append(
            f"the selective model is {where} FP32 on {metric} ({'<=' if ok else '>'} {target_drop:g}{unit} "
            "drop allowed)"
        )
    elif math.isfinite(fp32):
        gap = fp32 - static
        if gap > 1e-12:
            recovered = (selective - static) / gap
            ok = recovered >= min_recovery - 1e-12
            met &= ok
            whole = abs(100 * min_recovery - round(100 * min_recovery)) < 1e-9  # 90 %, not 93.06 %
            parts.append(
                f"recovered {100 * recovered:.{1 if whole else 2}f}% of the {metric} lost by static "
                f"quantization ({'>=' if ok else '<'} {_percent(min_recovery)} required)"
            )
        else:
            # static at or above FP32 (often by noise): the selective model passes when it keeps either level
            ok = selective >= min(static, fp32) - 1e-12
            met &= ok
            level = "not worse than static" if selective >= static - 1e-12 else "at least FP32's value"
            parts.append(
                f"static quantization lost nothing on {metric}; the selective model is "
                f"{level if ok else 'worse than both FP32 and static'}"
            )
    if target_sqnr is not None:
        ok = not math.isnan(selective_sqnr) and selective_sqnr >= target_sqnr - 1e-12
        met &= ok
        parts.append(
            f"output SQNR {fmt_db(selective_sqnr)} dB {'>=' if ok else '<'} {target_sqnr:.1f} dB target"
        )
    verdict = ("PASS: " if met else "FAIL: ") + "; ".join(parts)
    return recovered, met, verdict


def _cancelled(proposal: Proposal, source: str) -> VerifyResult:
    return VerifyResult(
        SCHEMA_VERSION,
        "verify",
        proposal.model_path,
        proposal.model_sha256,
        source,
        "",
        0,
        0,
        (),
        math.nan,
        DEFAULT_MIN_RECOVERY,
        math.nan,
        False,
        "cancelled",
        0.0,
    )


# ----------------------------------------------------------------------------- TUI adapter


def make_tui_verify(
    report: Report, *, runs: int = 20, options: VerifyOptions | None = None
) -> Callable[[Proposal, Callable[[float, str], None], Callable[[], bool]], VerifyResult] | None:
    """A TUI ``verify_fn(proposal, progress, cancelled)``; None when the report's files are not reachable.

    The model, calibration and evaluation paths recorded in the report must
    exist here and the model must still match the report's hash. Calibration,
    the FP32 reference outputs and the static baseline are prepared on the
    first call and reused by later ones, so each further verify costs one
    re-quantization, one evaluation and the timing runs.
    """
    from qdebug.files import sha256_file

    cfg = report.config
    model = Path(report.model.path)
    calib = cfg.calib
    if calib is None or not model.is_file():
        return None
    if not Path(calib).exists() and ":" not in calib:
        return None
    if cfg.eval is not None and not Path(cfg.eval).exists() and ":" not in cfg.eval:
        return None
    try:
        if sha256_file(model) != report.model.sha256:
            return None
    except OSError:
        return None
    base = options or VerifyOptions()
    opts = VerifyOptions(
        min_recovery=base.min_recovery,
        target_sqnr=base.target_sqnr,
        metric=base.metric or cfg.metric,
        method=cfg.method,
        activation_type=cfg.activation_type,
        weight_type=cfg.weight_type,
        per_channel=cfg.per_channel,
        batch_size=cfg.batch_size,
        max_samples=cfg.max_samples,
        eval_max_samples=base.eval_max_samples,
        runs=runs,
        warmup=base.warmup,
        use_cache=base.use_cache,
        providers=base.providers,
        threads=base.threads,
        upgrade_opset=cfg.upgrade_opset,
        inline_constant_if=cfg.inline_constant_if,
    )
    state: dict[str, Any] = {}

    def verify_fn(
        proposal: Proposal, progress: Callable[[float, str], None], cancelled: Callable[[], bool]
    ) -> VerifyResult:
        def stage(name: str, done: int, total: int | None) -> None:
            fraction = 0.0 if not total else min(1.0, done / total)
            progress(fraction, name)

        if "ctx" not in state:
            import tempfile

            progress(0.0, "preparing (calibration from cache, FP32 reference)")
            state["tmp"] = tempfile.TemporaryDirectory(prefix="qdebug-tui-verify-")
            state["ctx"] = _Context(model, calib, cfg.eval, Path(state["tmp"].name), opts, cfg.method, stage)
        target = opts.target_sqnr
        if target is None and not math.isfinite(state["ctx"].evaluator.fp32_value):
            target = 30.0
        run_opts = opts if target == opts.target_sqnr else _replace(opts, target_sqnr=target)
        return verify(
            model,
            calib,
            cfg.eval,
            proposal,
            options=run_opts,
            progress=stage,
            cancelled=cancelled,
            _context=state["ctx"],
        )

    return verify_fn


def _replace(options: VerifyOptions, **changes: Any) -> VerifyOptions:
    import dataclasses

    return dataclasses.replace(options, **changes)


def _percent(fraction: float) -> str:
    """A threshold as given: 90%, 93.06% (a rounded one had printed "recovered 93.1% (< 93% required)"),
    never -0%."""
    return f"{100 * fraction + 0.0:.4g}%"
