"""Per-node latency from ONNX Runtime's own profiler: where static INT8 gains and loses time against FP32.

Runs each model in one session with ORT's profiler on (one warm-up run, then --runs timed runs over the
data's batches; the two models' runs alternate in rounds, so that a change of load hits both alike) and
books every kernel to the nodes of your model it computes, through the optimized graph: fused kernels
(Conv+BN+Relu, MatMul+Add -> Gemm, DQ->Conv->Q -> QLinearConv) count for the node whose op they run, and
surviving QuantizeLinear/DequantizeLinear kernels as Q/DQ time around the node they feed or follow; layout
kernels ORT adds (NCHWc reorders, NHWC transposes) are listed as ORT-inserted; the kernels an If, Loop or
Scan runs in its bodies are in that node's time, counted once. Prints one row per node (FP32 ms, INT8 ms,
saved ms, the INT8 kernel and whether it is an integer one, Q/DQ ms, a cause), the totals, the measured
p50 wall time per run of each model and a verdict. Causes: unfolded-batchnorm, no-integer-kernel,
qdq-overhead. --json writes it all (profile.json).

Example:
  qdebug profile model.onnx model.int8.onnx --data calib.npz --runs 20 --json profile.json

"""

from __future__ import annotations

import argparse
import sys

from qdebug.cli.common import non_negative_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug profile``."""
    from qdebug.records.profile import SORT_KEYS

    p.add_argument("fp32", metavar="FP32.onnx", help="the FP32 model")
    p.add_argument("quant", metavar="QUANT.onnx", nargs="?", default=None, help="its static INT8 (QDQ) model")
    p.add_argument(
        "--data", required=True, metavar="DATA", help="input data: an .npz, a folder of them or module:function"
    )
    p.add_argument("--runs", type=int, default=20, help="timed runs per model, cycling over the batches (default: 20)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="samples per batch (default: 16, or the model's fixed batch)"
    )
    p.add_argument("--threads", type=non_negative_int, default=0, help="CPU threads (default: ORT's choice)")
    p.add_argument("--provider", default="CPUExecutionProvider", help="ONNX Runtime execution provider")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole profile here (profile.json)")
    p.add_argument(
        "--sort",
        default="lost",
        choices=SORT_KEYS,
        help="order of the node table (default: lost, most time lost first)",
    )
    p.add_argument("--top", type=non_negative_int, default=20, help="rows in the node table (default: 20; 0: all)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> int:
    """Profile the models, print the table, write the JSON asked for."""
    from qdebug.errors import ExitCode, QDebugError
    from qdebug.output.files import atomic_write_text, check_outputs_spare_inputs, check_writable
    from qdebug.output.report_io import dumps
    from qdebug.runtime.capture import SessionConfig, check_providers
    from qdebug.runtime.profile import run_profile

    if args.runs < 1:
        raise QDebugError(f"--runs must be >= 1 (got {args.runs})", "pass a positive number of runs", ExitCode.USAGE)
    if args.json:
        check_writable(args.json, "--json")
        check_outputs_spare_inputs(
            {"--json": args.json}, {"the FP32 model": args.fp32, "the INT8 model": args.quant, "the data": args.data}
        )
    check_providers([args.provider])
    config = SessionConfig(providers=(args.provider,), intra_op_threads=args.threads)
    say = None if args.quiet else (lambda msg: print(f"qdebug profile: {msg}", file=sys.stderr))
    report = run_profile(
        args.fp32, args.quant, args.data, runs=args.runs, config=config, batch_size=args.batch_size, progress=say
    )
    print_profile(report, sort=args.sort, top=args.top)
    if args.json:
        atomic_write_text(args.json, dumps(report))
        print(f"profile written to {args.json}", file=sys.stderr)
    return 0


def print_profile(report, sort: str = "lost", top: int = 20) -> None:
    """The node table, the ORT-inserted kernels, the totals, the causes and the verdict, on stdout."""
    from rich.console import Console
    from rich.table import Table

    from qdebug.records.profile import CAUSES, ORT_INSERTED, sorted_nodes

    # names come from the models: printed as they are, never read as Rich markup
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)
    int8 = report.int8
    if int8 is None and sort in ("saved", "lost"):  # nothing saved or lost without an INT8 model
        sort = "fp32"
    rows = sorted_nodes(report.nodes, sort)
    shown = rows if top == 0 else rows[:top]
    table = Table(title=f"{len(shown)} of {len(report.nodes)} nodes, ms per run, sorted by {sort}")
    for col in ("node", "op", "FP32 ms", "INT8 ms", "saved ms", "kernel", "Q/DQ ms", "cause"):
        table.add_column(col, justify="left" if col in ("node", "op", "kernel", "cause") else "right")
    for n in shown:
        kernel = n.int8_kernel if int8 is not None else n.fp32_kernel
        if int8 is not None and n.int8_ms > 0:
            kernel += " (int)" if n.integer else " (float)"
        table.add_row(
            n.name,
            n.op_type,
            _ms(n.fp32_ms),
            _ms(n.int8_ms) if int8 else "-",
            f"{n.saved_ms:+.3f}" if int8 else "-",
            kernel,
            _ms(n.qdq_ms) if int8 else "-",
            n.cause,
        )
    for op, (a, b) in _inserted(report).items():
        table.add_row(ORT_INSERTED, op, _ms(a), _ms(b) if int8 else "-", f"{a - b:+.3f}" if int8 else "-", op, "", "")
    console.print(table)
    if len(shown) < len(rows):
        console.print(f"{len(rows) - len(shown)} more nodes (--top 0 shows all)")
    for label, m in (("FP32", report.fp32), ("INT8", int8)):
        if m is not None:
            inner = len({k.name for k in m.subgraph_kernels})
            within = f"; {inner} more inside If/Loop/Scan kernels, in their time" if inner else ""
            console.print(
                f"{label}: kernels {m.kernel_ms:.3f} ms per run ({m.inserted_ms:.3f} ORT-inserted{within}), "
                f"ORT model_run {m.model_run_ms:.3f} ms, wall p50 {m.wall_p50_ms:.3f} ms over {m.runs} runs"
            )
    for cause in sorted({n.cause for n in report.nodes if n.cause}):
        console.print(f"{cause}: {CAUSES[cause]}")
    for note in report.notes:
        console.print(f"note: {note}")
    console.print(report.verdict)


def _ms(x: float) -> str:
    return f"{x:.3f}" if x else "0"


def _inserted(report) -> dict[str, tuple[float, float]]:
    """ORT-inserted kernels' time per run by op: (FP32 model, INT8 model)."""
    out: dict[str, list[float]] = {}
    for side, m in enumerate((report.fp32, report.int8)):
        if m is None:
            continue
        for k in m.kernels:
            if not k.nodes:
                out.setdefault(k.op_type, [0.0, 0.0])[side] += k.ms_per_run
    return {op: (a, b) for op, (a, b) in sorted(out.items())}
