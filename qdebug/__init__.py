"""qdebug: a layer-wise quantization debugger for ONNX Runtime.

The public API is loaded lazily so that ``import qdebug`` (and ``qdebug --help``)
does not import onnxruntime or textual.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API: dict[str, str | tuple[str, str]] = {
    "analyze": "qdebug.pipeline",
    "AnalyzeOptions": "qdebug.pipeline",
    "propose_exclusions": ("qdebug.propose", "propose"),
    "ProposeOptions": "qdebug.propose",
    "verify_proposal": ("qdebug.verify", "verify"),
    "VerifyOptions": "qdebug.verify",
    "run_bench": "qdebug.bench",
    "BenchOptions": "qdebug.bench",
    "load_report": "qdebug.output.report_io",
    "save_report": "qdebug.output.report_io",
    "QDebugError": "qdebug.errors",
    "ExitCode": "qdebug.errors",
    "Report": "qdebug.records",
    "rank_nodes": "qdebug.records",
    "Proposal": "qdebug.records",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'qdebug' has no attribute {name!r}")
    import importlib

    module, attr = target if isinstance(target, tuple) else (target, name)
    return getattr(importlib.import_module(module), attr)
