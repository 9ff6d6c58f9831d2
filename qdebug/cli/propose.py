"""(propose: not implemented yet.)"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No flags yet."""


def run(args: argparse.Namespace) -> int:
    """Not implemented yet."""
    from qdebug.errors import ExitCode, QDebugError

    raise QDebugError("qdebug propose is not implemented yet", "use qdebug analyze", ExitCode.USAGE)
