"""Browse an analysis report in the terminal (Textual app).

Sort and filter nodes, see histograms and neighbours, toggle exclusions,
export them as a proposal, and run verify in the background when the
model and data recorded in the report are reachable.

With --bench, b shows the results of qdebug bench (one row per variant, the
machine, task metric vs latency).

Example:
  qdebug tui report.json --proposal proposal.json
  qdebug tui report.json --bench bench.json

"""

from __future__ import annotations

import argparse

from qdebug.errors import ExitCode, QDebugError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug tui``."""
    p.add_argument("report", help="report.json written by qdebug analyze")
    p.add_argument(
        "--proposal", default=None, help="proposal.json from qdebug propose (its exclusions are preselected)"
    )
    p.add_argument(
        "--bench",
        default=None,
        help="bench.json from qdebug bench -o (b shows the variants, the machine and metric vs latency)",
    )
    p.add_argument(
        "--screenshot", default=None, help="write an SVG screenshot of the app to this path and exit"
    )


def run(args: argparse.Namespace) -> int:
    """Open the app (the TUI itself never imports onnxruntime; verify runs through the core)."""
    from qdebug.report_io import load_report

    report = load_report(args.report)  # a clear one-line error before the screen is taken over
    if args.bench:  # likewise for a missing or corrupt bench file
        from qdebug.tui.app import load_bench_results

        _same_model(report, load_bench_results(args.bench).model_sha256, args.bench, "bench result")
    if args.proposal:
        from qdebug.tui.app import load_proposal

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
        from qdebug.files import check_outputs_spare_inputs, check_writable
        from qdebug.tui.app import save_screenshot

        check_writable(args.screenshot, "--screenshot")
        check_outputs_spare_inputs(
            {"--screenshot": args.screenshot},
            {"the report": args.report, "the proposal": args.proposal, "the bench result": args.bench},
        )

        save_screenshot(args.report, args.screenshot, proposal_path=args.proposal, bench_path=args.bench)
        return 0
    verify_fn = None
    try:
        from qdebug.verify import make_tui_verify

        verify_fn = make_tui_verify(report)
    except ImportError:  # verify not available in this build
        verify_fn = None
    from qdebug.tui.app import run_tui

    return run_tui(args.report, args.proposal, verify_fn=verify_fn, bench_path=args.bench)


def _same_model(report, sha256: str, path: str, what: str) -> None:
    """A proposal or bench result made for another model would show another model's numbers as this one's."""
    if sha256 and sha256 != report.model.sha256:
        raise QDebugError(
            f"{what} {path} was made for another model (sha256 {sha256[:12]}...), not the report's "
            f"{report.model.path}",
            f"pass a {what} made for this model",
            ExitCode.INPUT,
        )
