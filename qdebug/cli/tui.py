"""Browse an analysis report in the terminal (Textual app).

Sort and filter nodes, see histograms and neighbours, toggle exclusions,
export them as a proposal, and run verify in the background when the
model and data recorded in the report are reachable.

With --bench, b shows the results of qdebug bench (one row per variant, the
machine, task metric vs latency).

With --against, the table compares the report with another report of the same
model (another calibration method, ORT version): columns ΔAdd and ΔAcc
(this minus the baseline, paired as qdebug diff pairs them; keys 9 and 0 sort
by them), the baseline's numbers in the detail. A diff.json from qdebug diff
--json opens its report B with its A as the baseline.

Example:
  qdebug tui report.json --proposal proposal.json
  qdebug tui report.json --bench bench.json
  qdebug tui percentile.json --against minmax.json
  qdebug tui diff.json

"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import check_outputs_spare_inputs, check_writable, sha256_file
from qdebug.records import AnalysisConfig, Proposal, Report

if TYPE_CHECKING:
    from qdebug.tui.compare import Baseline
    from qdebug.verify import VerifyOptions, VerifyResult

TuiVerify = Callable[[Proposal, Callable[[float, str], None], Callable[[], bool]], "VerifyResult"]
"""The TUI's ``verify_fn(proposal, progress, cancelled)`` (:data:`qdebug.tui.app.VerifyFn`), made by
:func:`make_tui_verify`."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug tui``."""
    p.add_argument(
        "report", help="report.json written by qdebug analyze (or a diff.json from qdebug diff --json: its B vs its A)"
    )
    p.add_argument(
        "--proposal", default=None, help="proposal.json from qdebug propose (its exclusions are preselected)"
    )
    p.add_argument(
        "--bench",
        default=None,
        help="bench.json from qdebug bench -o (b shows the variants, the machine and metric vs latency)",
    )
    p.add_argument(
        "--against",
        default=None,
        metavar="OTHER.json",
        help="another report of the same model to compare with: adds columns ΔAdd/ΔAcc (this minus it)",
    )
    p.add_argument(
        "--screenshot",
        default=None,
        metavar="SHOT.svg",
        help="write an SVG screenshot of the app to this path (its name must end in .svg) and exit",
    )


def run(args: argparse.Namespace) -> int:
    """Open the app (the TUI itself never imports onnxruntime; verify runs through the core).

    This module is the composition root: it alone wires the TUI to :mod:`qdebug.verify`, through
    :func:`make_tui_verify`.
    """
    from qdebug.output.report_io import load_bench, load_proposal

    report_path, report, baseline = _open(args)  # a clear one-line error before the screen is taken over
    if args.bench:  # likewise for a missing or corrupt bench file
        _same_model(report, load_bench(args.bench).model_sha256, args.bench, "bench result")
    if args.proposal:
        proposal = load_proposal(args.proposal)
        _same_model(report, proposal.model_sha256, args.proposal, "proposal")
        known = {n.name for n in report.nodes}
        unknown = [n for n in proposal.nodes_to_exclude if n not in known]
        if unknown:
            raise QDebugError(
                f"proposal {args.proposal} names {len(unknown)} node(s) not in the report: {unknown[:5]}",
                "pass a proposal made from this report (qdebug propose)",
                ExitCode.INPUT,
            )
    if args.screenshot:
        from qdebug.tui.app import save_screenshot

        check_writable(args.screenshot, "--screenshot")
        check_outputs_spare_inputs(
            {"--screenshot": args.screenshot},
            {
                "the report": report_path,
                "the diff": args.report,
                "the baseline report": args.against,
                "the proposal": args.proposal,
                "the bench result": args.bench,
            },
        )
        _check_svg_name(args.screenshot)

        save_screenshot(
            report_path, args.screenshot, proposal_path=args.proposal, bench_path=args.bench, baseline=baseline
        )
        return 0
    from qdebug.tui.app import run_tui

    return run_tui(
        report_path, args.proposal, verify_fn=make_tui_verify(report), bench_path=args.bench, baseline=baseline
    )


def _check_svg_name(path: str) -> None:
    """Refuse a screenshot name that says another format: Textual draws SVG only, and ``shot.png`` holding
    SVG had been written without a word (an image viewer then calls it broken)."""
    suffix = Path(path).suffix
    if suffix.lower() != ".svg":
        said = f"ends in {suffix}" if suffix else "has no suffix"
        raise QDebugError(
            f"--screenshot {path}: the screenshot is an SVG image, but the name {said}",
            f"name it {Path(path).with_suffix('.svg').name}; for a PNG, convert that afterwards (e.g. rsvg-convert)",
            ExitCode.USAGE,
        )


def _open(args: argparse.Namespace) -> tuple[str, Report, Baseline | None]:
    """``(report path, report, baseline)``: the report with its ``--against`` baseline, or a diff file's report
    B with its A as the baseline (from the numbers the diff holds)."""
    from qdebug.output.report_io import load_report
    from qdebug.tui.compare import check_diff_matches, file_kind, load_baseline, open_diff

    if file_kind(args.report) == "diff":
        if args.against:
            raise QDebugError(
                f"{args.report} is a diff: it names its baseline already",
                "drop --against, or pass a report with it",
                ExitCode.USAGE,
            )
        report_path, baseline = open_diff(args.report)
        report = load_report(report_path)
        check_diff_matches(baseline, report, report_path, args.report)
        return report_path, report, baseline
    report = load_report(args.report)
    return args.report, report, load_baseline(report, args.report, args.against) if args.against else None


def _same_model(report: Report, sha256: str, path: str, what: str) -> None:
    """A proposal or bench result made for another model would show another model's numbers as this one's."""
    if sha256 and sha256 != report.model.sha256:
        raise QDebugError(
            f"{what} {path} was made for another model (sha256 {sha256[:12]}...), not the report's "
            f"{report.model.path}",
            f"pass a {what} made for this model",
            ExitCode.INPUT,
        )


# ----------------------------------------------------------------------------- the TUI's verify


def make_tui_verify(
    report: Report, *, runs: int = 20, options: VerifyOptions | None = None
) -> TuiVerify | None:
    """A TUI ``verify_fn(proposal, progress, cancelled)``; None when the report's files are not reachable.

    The model, calibration and evaluation paths recorded in the report must
    exist here and the model must still match the report's hash. Calibration,
    the FP32 reference outputs and the static baseline are prepared on the
    first call and reused by later ones, so each further verify costs one
    re-quantization, one evaluation and the timing runs.

    This is where the TUI (which never imports onnx or onnxruntime) meets
    :mod:`qdebug.verify` (which does): the core is imported on the first call,
    in the TUI's worker thread, so opening the TUI stays quick.
    """
    cfg = report.config
    model = Path(report.model.path)
    calib = cfg.calib
    if calib is None or not _reachable(report, model, calib):
        return None
    state: dict[str, Any] = {}

    def verify_fn(
        proposal: Proposal, progress: Callable[[float, str], None], cancelled: Callable[[], bool]
    ) -> VerifyResult:
        import qdebug.verify.run as core

        def stage(name: str, done: int, total: int | None) -> None:
            fraction = 0.0 if not total else min(1.0, done / total)
            progress(fraction, name)

        if "ctx" not in state:
            progress(0.0, "preparing (calibration from cache, FP32 reference)")
            state["opts"] = _tui_options(cfg, options or core.VerifyOptions(), runs)
            state["tmp"] = tempfile.TemporaryDirectory(prefix="qdebug-tui-verify-")
            workdir = Path(state["tmp"].name)
            state["ctx"] = core._Context(model, calib, cfg.eval, workdir, state["opts"], cfg.method, stage)
        opts = state["opts"]
        target = opts.target_sqnr
        if target is None and not math.isfinite(state["ctx"].evaluator.fp32_value):
            target = 30.0
        run_opts = opts if target == opts.target_sqnr else dataclasses.replace(opts, target_sqnr=target)
        return core.verify(
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


def _reachable(report: Report, model: Path, calib: str) -> bool:
    """Whether the model, calibration and evaluation data the report names are here, the model unchanged
    (a ``module:function`` hook is taken as reachable: importing it would run user code)."""
    cfg = report.config
    if not model.is_file():
        return False
    if not Path(calib).exists() and ":" not in calib:
        return False
    if cfg.eval is not None and not Path(cfg.eval).exists() and ":" not in cfg.eval:
        return False
    try:
        return sha256_file(model) == report.model.sha256
    except OSError:
        return False


def _tui_options(cfg: AnalysisConfig, base: VerifyOptions, runs: int) -> VerifyOptions:
    """Verify options that rebuild the report's quantization: its settings and data limits, with the
    judging, evaluation cap and runtime settings of ``base``."""
    return dataclasses.replace(
        base,
        quant=base.quant.over(cfg.quant),  # every setting the report records, the user's config included
        target_drop=None,
        metric=base.metric or cfg.metric,
        batch_size=cfg.batch_size,
        max_samples=cfg.max_samples,
        runs=runs,
    )
