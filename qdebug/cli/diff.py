"""Compare analysis reports: which nodes got better or worse, and by how much.

A and B are reports of the same model (another calibration method, ORT version or data set) or of two
versions of it. Nodes are paired by name where the model named them, else through the graph (op type,
topological depth, paired producers or consumers; ties in topological order). Prints the settings that
differ, both task metrics and output SQNRs, and the nodes whose added noise changed most; deltas are
B - A (SQNR up is better, added noise and KL down). --json writes every paired node and tensor.

Example:
  qdebug analyze model.onnx --calib calib.npz -o minmax.json
  qdebug analyze model.onnx --calib calib.npz --method percentile -o percentile.json
  qdebug diff minmax.json percentile.json --top 15 --json diff.json

With three or more reports, diff says which report quantizes each tensor best: each tensor is paired with
the first report's, and the table names the report whose own quantization of it is closest to FP32
(highest local SQNR), by how much, and every report's local and accumulated SQNR; the header gives each
one's task metric and wins (``analyze --method minmax,entropy,percentile -o r.json`` writes
r.minmax.json, r.entropy.json, r.percentile.json):
  qdebug diff r.minmax.json r.entropy.json r.percentile.json

"""

from __future__ import annotations

import argparse
import sys

from qdebug.cli.common import non_negative_int
from qdebug.output.ci_outputs import MARKDOWN_HELP
from qdebug.output.formatting import cells, fold_name, prefix_note


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug diff``."""
    p.add_argument("a", metavar="A.json", help="the report to compare against (the baseline)")
    p.add_argument("b", metavar="B.json", help="the report compared with it")
    p.add_argument("more", metavar="C.json", nargs="*", help="more reports: compare all, tensor by tensor")
    p.add_argument(
        "--top", type=non_negative_int, default=10, help="rows in the node table (default: 10; 0: every paired node)"
    )
    p.add_argument("--wide", action="store_true", help="full node names in the table (default: shortened to fit)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the whole comparison here (diff.json)")
    p.add_argument("--markdown", default=None, metavar="FILE", help=MARKDOWN_HELP)


def run(args: argparse.Namespace) -> int:
    """Pair the two reports, print the comparison, write the files asked for."""
    from qdebug.diff import diff_reports
    from qdebug.output.ci_outputs import check_ci_outputs, write_ci_outputs
    from qdebug.output.files import atomic_write_text, check_outputs_spare_inputs, check_writable
    from qdebug.output.report_io import dumps

    if args.json:
        check_writable(args.json, "--json")
        check_outputs_spare_inputs({"--json": args.json}, {"report A": args.a, "report B": args.b})
    check_ci_outputs(args, inputs=(args.a, args.b, *args.more), outputs=(args.json,))
    if args.more:
        return _run_many(args)
    result = diff_reports(args.a, args.b)
    print_diff(result, args.top, wide=args.wide)
    if args.json:
        atomic_write_text(args.json, dumps(result))
        print(f"\ndiff written to {args.json}", file=sys.stderr)
    write_ci_outputs(args, result, top=args.top)
    return 0


def _run_many(args: argparse.Namespace) -> int:
    """Three or more reports: the comparison table, and the files asked for."""
    from qdebug.cli.analyze import print_comparison
    from qdebug.diff import compare_reports
    from qdebug.output.ci_outputs import write_ci_outputs
    from qdebug.output.files import atomic_write_text
    from qdebug.output.report_io import dumps

    result = compare_reports([args.a, args.b, *args.more])
    print_comparison(result, args.top, wide=args.wide)
    if args.json:
        atomic_write_text(args.json, dumps(result))
        print(f"\ncomparison written to {args.json}", file=sys.stderr)
    write_ci_outputs(args, result, top=args.top)
    return 0


def print_diff(result, top: int = 10, wide: bool = False) -> None:
    """The header lines, the node table (biggest change first) and the notes, on stdout."""
    from rich.console import Console
    from rich.table import Table

    from qdebug.records.diff import TABLE_COLUMNS

    # names come from the models: printed as they are, never read as Rich markup
    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 120)
    for line in result.header_lines():
        console.print(line)
    rows = result.table_rows(top)
    if rows:
        names, prefix, width = _names(rows, console, wide)
        if prefix:
            console.print(prefix_note(prefix))
        shown = [name if wide else "\n".join(fold_name(name, width, NAME_LINES)) for name in names]
        table = Table(title=f"{len(rows)} of {len(result.nodes)} paired nodes, biggest change of added noise first "
                      "(B - A)")  # fmt: skip
        for col in TABLE_COLUMNS:
            if wide and col == "node":
                table.add_column(col, overflow="fold")
            elif col == "node":  # already fitted and folded: rich must neither squeeze nor cut it again
                longest = max(cells(line) for name in shown for line in name.splitlines())
                table.add_column(col, no_wrap=True, min_width=min(width, longest), overflow="ellipsis")
            else:
                table.add_column(col, justify="left" if col in ("op", "B vs A") else "right")
        for name, (_, row) in zip(shown, rows, strict=True):
            table.add_row(name, *row)
        console.print(table)
        if any(n.name_a != n.name_b for n, _ in rows) and not any(" -> " in x for x in names):
            console.print("(renamed nodes show their name in B; --wide shows both, as a -> b)")
    for label, names in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
        if names:
            more = f" (+{len(names) - 10} more in --json)" if len(names) > 10 else ""
            console.print(f"{label}: {', '.join(names[:10])}{more}")
    for note in result.notes:
        console.print(f"note: {note}")


NAME_LINES = 3
"""Lines a node name may take in the table (:func:`~qdebug.output.formatting.fold_name`): the other columns
leave the names 12 cells at 120 columns, too few for ``layer0/attn/v_matmul`` on one line."""


def _names(rows, console, wide: bool) -> tuple[list[str], str, int]:
    """``(shown names, dropped prefix, column width)`` of the node column: B's names, ``a -> b`` where a node
    was renamed, each at most :data:`NAME_LINES` column widths long (the caller folds them).

    As analyze's table fits its names (:func:`~qdebug.output.formatting.table_names`); where ``a -> b`` does not
    fit, A's and B's names are shortened apart, each to half the room, so that the arrow stays visible,
    or, in a column too narrow for two names, B's alone (``--wide`` shows both).
    """
    from qdebug.output.formatting import MIN_NAME_WIDTH, name_column_width, table_names, table_overhead
    from qdebug.records.diff import TABLE_COLUMNS, node_label

    labels = [node_label(n) for n, _ in rows]
    others = [max([len(c), *(cells(r[i]) for _, r in rows)]) for i, c in enumerate(TABLE_COLUMNS[1:])]
    if wide:
        if not console.is_terminal:
            console.width = max(console.width, table_overhead(others) + max(map(cells, labels)))
        return labels, "", console.width
    column = name_column_width(console.width, others)
    width = column * NAME_LINES
    if all(n.name_a == n.name_b for n, _ in rows) or all(cells(x) <= width for x in labels):
        prefix, shown = table_names(labels, width)
        return shown, prefix, column
    if width < 2 * MIN_NAME_WIDTH + 4:  # no room for both: B's names, A's with --wide
        prefix, shown = table_names([n.name_b for n, _ in rows], width)
        return shown, prefix, column
    half = (width - 4) // 2
    prefix_a, shown_a = table_names([n.name_a for n, _ in rows], half)
    prefix_b, shown_b = table_names([n.name_b for n, _ in rows], half)
    shown = [b if n.name_a == n.name_b else f"{a} -> {b}"
             for (n, _), a, b in zip(rows, shown_a, shown_b, strict=True)]  # fmt: skip
    prefix = " and ".join(f"{p} in {side}" for p, side in ((prefix_a, "A"), (prefix_b, "B")) if p)
    return shown, prefix, column
