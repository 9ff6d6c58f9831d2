"""qdebug: a layer-wise quantization debugger for ONNX Runtime.

The public API is loaded lazily so that ``import qdebug`` (and ``qdebug --help``)
does not import onnxruntime or textual.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = {
    "analyze": "qdebug.pipeline",
    "AnalyzeOptions": "qdebug.pipeline",
    "run_bench": "qdebug.bench",
    "load_report": "qdebug.report_io",
    "save_report": "qdebug.report_io",
    "QDebugError": "qdebug.errors",
    "ExitCode": "qdebug.errors",
    "Report": "qdebug.records",
    "Proposal": "qdebug.records",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'qdebug' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
