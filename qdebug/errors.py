"""The one user-error type and the documented exit codes.

Anything the user can fix (a wrong path, a corrupt model, data of the wrong
shape) is raised as :class:`QDebugError` and printed as one line by the CLI.
Any other exception is a bug in qdebug and keeps its traceback.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Process exit codes; each one is documented in the README."""

    OK = 0
    """Success; for ``verify`` also: the recovery target was met."""
    INTERNAL = 1
    """A bug in qdebug (an unexpected exception, printed with its traceback)."""
    USAGE = 2
    """Bad command-line usage (unknown flag, missing argument); argparse's own code."""
    INPUT = 3
    """A file the user gave is missing, unreadable or not what it should be (model, data, report)."""
    MODEL = 4
    """The model is not supported as given (opset, custom ops, ORT refuses it, quantizer failure)."""
    DATA = 5
    """Calibration/evaluation data does not match the model (names, dtypes, shapes, NaN/Inf, empty)."""
    TARGET_NOT_MET = 6
    """``verify``/``propose`` ran fine but the accuracy/SQNR target was not met (for CI gating)."""
    OUTPUT = 7
    """An output could not be written (unwritable directory, disk full)."""
    UNDECIDED = 8
    """``verify`` ran fine, but the evaluation set is too small to tell whether the target is met: no gate
    missed it beyond the noise, and one's interval at ``--confidence`` straddles it (the verdict says how
    many samples would decide it)."""
    INTERRUPTED = 130
    """Interrupted (Ctrl-C); nothing half-written is left behind."""
    TERMINATED = 143
    """Terminated (SIGTERM: ``timeout``, a cancelled CI job); cleaned up like Ctrl-C."""


class QDebugError(Exception):
    """A problem the user can fix: one line saying what is wrong and how to fix it.

    Args:
        message: what is wrong, naming the file/tensor/option concerned.
        hint: how to fix it (appended after ' -- ').
        code: the exit code the CLI returns.

    """

    def __init__(self, message: str, hint: str = "", code: ExitCode = ExitCode.INPUT) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code

    def __reduce__(self) -> tuple:
        """Pickled whole: an error raised in a worker process (``--workers``, ``--ray``) comes back with its
        hint and exit code (Exception's default pickling keeps only the message)."""
        return (self.__class__, (self.message, self.hint, self.code))

    def one_line(self) -> str:
        """The error as a single line (newlines folded) for stderr."""
        text = self.message if not self.hint else f"{self.message} -- {self.hint}"
        return " ".join(text.split())
