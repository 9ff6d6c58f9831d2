"""Export a report for another tool: the graph, coloured by error, in Google Model Explorer.

`export model-explorer` writes Model Explorer node data files into a directory: the added noise, the
accumulated and local SQNR and the KL of every node (red where the TUI shows red), and with --proposal the
action it takes per node. It prints the command that opens them on the report's normalized model (the
files are keyed by its node names). Needs the viz extra: pip install 'qdebug[viz]' (exit 2 without it).

Example:
  qdebug export model-explorer report.json -o me/ --proposal proposal.json

"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``qdebug export`` and its formats."""
    sub = p.add_subparsers(dest="format", metavar="FORMAT", required=True, parser_class=type(p))
    me = sub.add_parser(
        "model-explorer",
        help="Model Explorer node data files (one per number, and the proposal's actions)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    me.add_argument("report", metavar="REPORT.json", help="the report written by qdebug analyze")
    me.add_argument("-o", "--output", required=True, metavar="DIR", help="directory of the files (made if missing)")
    me.add_argument("--proposal", default=None, metavar="FILE", help="also write the action per node of this proposal")


def run(args: argparse.Namespace) -> int:
    """Write the files of the chosen format and print how to open them."""
    from qdebug.export import export_model_explorer

    result = export_model_explorer(args.report, args.output, proposal=args.proposal)
    width = max(len(f.path.name) for f in result.files)
    print(f"Model Explorer node data written to {result.files[0].path.parent}:")
    for f in result.files:
        rest = f"  ({f.left_out} without a value: uncoloured)" if f.left_out else ""
        print(f"  {f.path.name:<{width}}  {f.nodes:>5} nodes  {f.title}{rest}")
    print("open them on the normalized model (the files are keyed by its node names):")
    print(f"  {result.command()}")
    print("(add --no_open_in_browser on a machine without a browser; onnxvis MODEL --node_data_paths=... is the same)")
    return 0
