"""Evaluation, metrics and gates: how good a candidate is, and how sure the evaluation set lets us be.

Modules:

* :mod:`~qdebug.evaluation.evaluate`: task metric of a candidate vs cached FP32 outputs, and its per-sample parts;
* :mod:`~qdebug.evaluation.metrics`: streaming accumulators (``update/merge/result``) for SQNR, MSE, cosine, KL...;
* :mod:`~qdebug.evaluation.samples`: the per-sample drill-down: which samples flip, and why;
* :mod:`~qdebug.evaluation.noise`: paired bootstrap intervals, McNemar's exact test, samples to decide;
* :mod:`~qdebug.evaluation.gates`: verify's gates (``assess``, ``judge``), judged beyond the noise.

Import the modules themselves; this file imports nothing.
"""
