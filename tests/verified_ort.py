"""The mark for tests that prove qdebug's fast quantizer byte-identical to ORT's own code.

Those proofs hold for the ORT and onnx sources the fast path was verified on
(``qdebug.quant.fast_quantize.VERIFIED_SOURCES``). On any other release qdebug runs ORT's plain path instead (one
note in the report), so an upstream release must not turn the suite red: the marked tests are skipped,
with the installed versions and the functions that changed as the reason (``pytest -ra`` lists it).
``QDEBUG_STRICT_SOURCES=1`` runs them anyway -- the developer re-verifying a new release, or a CI job pinned
to the verified one (docs/design-notes.md, "Re-verifying a new ORT").
"""

from __future__ import annotations

import os

import pytest

from qdebug.quant import fast_quantize

STRICT_ENV = "QDEBUG_STRICT_SOURCES"

GAP = fast_quantize.verification_gap()
"""None on the verified release; otherwise what differs (computed once, at collection)."""

STRICT = os.environ.get(STRICT_ENV, "") not in ("", "0")

verified_sources = pytest.mark.skipif(
    GAP is not None and not STRICT,
    reason=f"proves the fast path on the verified ORT/onnx sources only: {GAP} "
    f"(qdebug runs ORT's plain path here; {STRICT_ENV}=1 runs this anyway)",
)
