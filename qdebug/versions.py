"""The onnxruntime, onnx and numpy releases qdebug runs on, and the one line that refuses older ones.

The floors are pyproject.toml's (a test keeps them equal); docs/versions.md has the table of the releases
``benchmarks/version_matrix.py`` ran the whole loop on. Newer releases are not refused: where ORT's quantizer
code changed, qdebug runs ORT's own quantizer and says so in a note (:mod:`qdebug.quant.fast_quantize`).
"""

from __future__ import annotations

import importlib
import re

from qdebug.errors import ExitCode, QDebugError

MINIMUM: dict[str, tuple[int, int, int]] = {
    "onnxruntime": (1, 20, 1),
    "onnx": (1, 16, 0),
    "numpy": (1, 24, 0),
}
"""The oldest release of each that the version matrix ran the whole loop on (docs/versions.md)."""


def parse(version: str) -> tuple[int, int, int] | None:
    """``"1.20.1"``, ``"1.33.0.dev20260101"``, ``"2.0.0rc1"`` -> (major, minor, patch); None when unreadable."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return None
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def _text(version: tuple[int, int, int]) -> str:
    return ".".join(map(str, version))


def check_installed() -> None:
    """Raise a one-line :class:`QDebugError` (exit 2, like a missing extra) when onnxruntime, onnx or numpy is
    missing, fails to import, or is older than :data:`MINIMUM`. Imports them: call it where the command is
    about to anyway."""
    for name, floor in MINIMUM.items():
        wanted = f"pip install -U '{name}>={_text(floor)}' (tested releases: docs/versions.md)"
        try:
            module = importlib.import_module(name)
        except Exception as e:  # ImportError, or a binary built for another numpy failing its own way
            first = (str(e).strip().splitlines() or [e.__class__.__name__])[0][:200]
            raise QDebugError(f"{name} could not be imported ({first})", wanted, ExitCode.USAGE) from None
        version = str(getattr(module, "__version__", ""))
        parsed = parse(version)
        if parsed is not None and parsed < floor:
            raise QDebugError(
                f"{name} {version} is older than {_text(floor)}, the oldest release qdebug runs on",
                wanted,
                ExitCode.USAGE,
            )
