"""The ``qdebug`` command line: ``main(argv) -> int``, testable in-process.

Each subcommand is a module of this package with a docstring (its help),
``add_arguments(parser)`` and ``run(args) -> int``. Only
:class:`~qdebug.errors.QDebugError` is caught here -- printed as one line,
with its documented exit code; anything else is a bug and keeps its
traceback. Data goes to stdout, progress and diagnostics to stderr. Heavy
imports (onnxruntime, textual) happen inside ``run`` so ``qdebug --help``
stays fast and light.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from qdebug import __version__
from qdebug.errors import ExitCode, QDebugError

SUBCOMMANDS = ("analyze", "propose", "verify", "bench", "profile", "diff", "export", "tui", "demo")
RUNS_ORT = ("analyze", "propose", "verify", "bench", "profile", "demo")
"""The subcommands that run ONNX Runtime: onnxruntime, onnx and numpy are checked before they start
(:func:`qdebug.versions.check_installed`); the others read reports only."""

EPILOG = """exit codes:
  0  success (verify: target met)          5  data does not match the model
  1  internal error (a bug: traceback)     6  accuracy/SQNR target not met
  2  bad usage, or an old onnxruntime      7  cannot write an output
  3  missing/unreadable input file       130  interrupted (Ctrl-C)
  4  model not supported as given        143  terminated (SIGTERM)
  8  verify: undecided -- the evaluation set is too small to tell the target from the noise
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line like every other qdebug error (argparse printed the whole
    usage block first) and the same exit code, 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} -- see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(int(ExitCode.USAGE))


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every subcommand."""
    parser = _Parser(
        prog="qdebug",
        description="Layer-wise quantization debugger for ONNX Runtime.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qdebug {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"qdebug.cli.{name}")
        doc = (module.__doc__ or "").strip()
        p = sub.add_parser(
            name,
            help=doc.splitlines()[0] if doc else name,
            description=doc,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _unrecognized(words: list[str], extra: list[str], command: str | None) -> str:
    """The one-line error for arguments no parser took, named by the subcommand that refused them.

    Flags given before the subcommand (``qdebug -q analyze ...``) belong to no parser: the message says to
    put them after it, not that the subcommand lacks a flag its --help lists.
    """
    listed = " ".join(extra)
    if command is None or command not in words:
        return f"qdebug: error: unrecognized arguments: {listed} -- see 'qdebug --help'"
    before = [w for w in extra if w in words[: words.index(command)]]
    if before:
        return (
            f"qdebug: error: unrecognized arguments before the subcommand: {' '.join(before)} -- "
            f"put them after it (see 'qdebug {command} --help')"
        )
    return f"qdebug {command}: error: unrecognized arguments: {listed} -- see 'qdebug {command} --help'"


class _Terminated(KeyboardInterrupt):
    """SIGTERM (``timeout``, a CI job cancelled, ``docker stop``), raised like Ctrl-C so that the same
    clean-up runs: it had killed the process with a report half replaced."""

    seen = False
    """Set by the handler: raised inside a Ray call (``--ray``), it comes out as a plain KeyboardInterrupt."""


def _on_sigterm(signum: int, frame: object) -> None:
    _Terminated.seen = True
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code instead of exiting."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _Terminated.seen = False
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    words = list(argv) if argv is not None else sys.argv[1:]
    try:
        args, extra = parser.parse_known_args(words)
    except SystemExit as e:
        return int(e.code or 0)
    if extra:
        print(_unrecognized(words, extra, getattr(args, "command", None)), file=sys.stderr)
        return int(ExitCode.USAGE)
    if not getattr(args, "_run", None):
        parser.print_help(sys.stderr)
        return int(ExitCode.USAGE)
    stdout = sys.stdout
    if getattr(args, "command", None) != "tui":  # the TUI owns the terminal
        sys.stdout = _PipeSafe(stdout)
    try:
        if args.command in RUNS_ORT:
            from qdebug.versions import check_installed

            check_installed()
        return int(args._run(args))
    except QDebugError as e:
        print(f"qdebug: error: {e.one_line()}", file=sys.stderr)
        return int(e.code)
    except _Terminated:
        print("qdebug: terminated (SIGTERM); no partial output was written", file=sys.stderr)
        return int(ExitCode.TERMINATED)
    except KeyboardInterrupt:
        if _Terminated.seen:
            print("qdebug: terminated (SIGTERM); no partial output was written", file=sys.stderr)
            return int(ExitCode.TERMINATED)
        print("qdebug: interrupted; no partial output was written", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    finally:
        if isinstance(sys.stdout, _PipeSafe):
            sys.stdout.flush()  # now, while a closed pipe is still caught: not in Python's final flush
        sys.stdout = stdout


class _PipeSafe(io.TextIOBase):
    """Standard output that goes quiet when its reader leaves (``qdebug verify ... | head -1``).

    The command then still finishes, writes its files and returns its own exit code; the closed pipe had
    raised BrokenPipeError from a print (exit 1 with a traceback, the report not written). Once broken,
    the descriptor is pointed at /dev/null so that Python's final flush does not fail either.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.broken = False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._silence()

    def _silence(self) -> None:
        self.broken = True
        try:
            fd = self._stream.fileno()
        except (AttributeError, OSError, ValueError):  # a test's capture has no descriptor
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except ValueError:  # closed (a library asking at exit, e.g. Ray's colorama, after a test's capture)
            return False

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
