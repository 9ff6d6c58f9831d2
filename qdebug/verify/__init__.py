"""``qdebug verify``: a proposal proved on the evaluation set, FP32 vs static vs selective side by side.

The selective model is re-quantized from the cached calibration ranges with the proposal's exclusions and
overrides, the three variants are scored and timed alike, and the gates are judged beyond the noise
(:mod:`qdebug.evaluation.gates`). The modules:

* :mod:`~qdebug.verify.run`: :func:`verify`, the command's stages in order, and :class:`VerifyOptions`;
* :mod:`~qdebug.verify.table`: the FP32, static and selective columns, their weight bytes and notes.

The ``verify.json`` records live in :mod:`qdebug.records.verify`; this package re-exports them, the gates
and the timing verify uses, as :mod:`~qdebug.verify.run` does. Patch a name in the submodule that looks it
up (:mod:`qdebug.verify.run`), not here.
"""

from qdebug.verify.run import (
    CHUNK_RUNS,
    DEFAULT_MIN_RECOVERY,
    Judgement,
    Timing,
    VariantResult,
    VerifyOptions,
    VerifyResult,
    assess,
    judge,
    time_sessions,
    verify,
)

__all__ = [
    "CHUNK_RUNS",
    "DEFAULT_MIN_RECOVERY",
    "Judgement",
    "Timing",
    "VariantResult",
    "VerifyOptions",
    "VerifyResult",
    "assess",
    "judge",
    "time_sessions",
    "verify",
]
