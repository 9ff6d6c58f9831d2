"""propose starts from the static model analyze already built, when it is provably the one it would build.

Re-quantizing is propose's one cost that grows with the graph and not with the data (about 1.6 s at 3,200
nodes, ORT's quantizer over qdebug's index), and on a model whose answer is found in two evaluations the
static model is one of its two quantizations. analyze saved that model as ``<report>_files/quantized.onnx``;
:func:`analyzed_static` hands it to the search when every input of the quantizer is the same as propose's
own: the normalized model's bytes, the calibrated ranges (each tensor's lowest and highest, as the report
recorded them), the quantization spec and ONNX Runtime's version, and the file is the one the report names
(its sha256). Anything else -- a user's ``--quantized`` model, a moved or edited file, another ORT -- and
the search quantizes as before: the reuse saves time, never changes an answer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnxruntime

from qdebug.output.files import sha256_file
from qdebug.quant.calibrate import Ranges
from qdebug.quant.quantize import QuantSpec
from qdebug.records import Report


def _same_ranges(report: Report, ranges: Ranges) -> bool:
    """The report's recorded ranges are exactly the ones propose quantizes from (JSON keeps floats exact)."""
    recorded = {name: (lo, hi) for name, lo, hi in report.ranges}
    return bool(recorded) and recorded == {k: (float(lo), float(hi)) for k, (lo, hi) in ranges.minmax().items()}


def offer_analyzed_inference(report: Report) -> bool:
    """Offer the quantizer the shape-inferred normalized model analyze saved next to its static model
    (``normalized.inferred.onnx``): the first static build then reads it instead of making ORT's round
    trip (save, ``infer_shapes_path``, load: 60 ms at 3,200 nodes). Taken only for the same model content,
    made by the same onnx, ORT and qdebug, and with the sha256 recorded beside it
    (:mod:`qdebug.quant.fast_quantize`)."""
    from qdebug.quant import fast_quantize

    if report.config.quantized_given:
        return False
    return fast_quantize.offer_inferred(Path(report.quantized_model.path).parent / fast_quantize.INFERRED_FILE)


def analyzed_static(report: Report, normalized_path: Path, ranges: Ranges, spec: QuantSpec) -> bytes | None:
    """analyze's static model's bytes when propose would build exactly it from ``spec``, else None."""
    if report.config.quantized_given or report.ort_version != onnxruntime.__version__:
        return None
    if spec != QuantSpec.of(report.config.quant):
        return None
    path = Path(report.quantized_model.path)
    analyzed = Path(report.normalized_model)
    if not path.is_file() or not analyzed.is_file() or not _same_ranges(report, ranges):
        return None
    if not normalized_path.is_file() or sha256_file(analyzed) != sha256_file(normalized_path):
        return None
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != report.quantized_model.sha256:
        return None
    return data
