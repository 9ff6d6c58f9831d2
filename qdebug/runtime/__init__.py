"""ONNX Runtime sessions: capture, timing, parallel candidate evaluations, bench's measuring process.

Modules:

* :mod:`~qdebug.runtime.capture`: ORT sessions over instrumented models, one batch at a time;
* :mod:`~qdebug.runtime.timing`: quick, fair latency of a few models on one batch (verify, propose's frontier);
* :mod:`~qdebug.runtime.parallel`: candidate evaluations side by side (``--workers``, ``--ray``);
* :mod:`~qdebug.runtime.bench_child`: the measuring side of ``bench``, one variant per process.

This file imports nothing: ``python -m qdebug.runtime.bench_child`` must import nothing of qdebug beyond it.
"""
