"""Load a user's ONNX model and normalize it into the base for every later step.

The modules:

* :mod:`qdebug.graph.modelfile` -- model files: :func:`load_model` (the file and its external data),
  :func:`save_model` (atomic, through external data over the protobuf limit :data:`PROTO_LIMIT`),
  :func:`is_large`, :func:`stored_size`, :func:`weight_bytes`, :func:`default_opset`, :func:`iter_graphs`;
* :mod:`qdebug.graph.normalize` -- :func:`normalize` and its passes: opset upgrade, deterministic node
  names, Constant -> initializer, input-as-output, shared-bias unsharing, constant-If inlining;
* :mod:`qdebug.graph.shapes` -- the shape-inference fallback chain normalization ends with.

Imports run one way: normalize -> shapes -> modelfile. This module re-exports the names other modules,
tests and benchmarks use. Patch a name (``PROTO_LIMIT``, a pass) in the module that looks it up: a patch
here changes nothing those modules read.
"""

from qdebug.graph.modelfile import (
    EXTERNAL_MIN_BYTES,
    PROTO_LIMIT,
    LoadedModel,
    WeightBytes,
    default_opset,
    is_large,
    iter_graphs,
    load_model,
    save_model,
    save_with_external_data,
    stored_size,
    weight_bytes,
)
from qdebug.graph.normalize import MIN_OPSET, PER_CHANNEL_OPSET, NormalizedModel, normalize

__all__ = [
    "EXTERNAL_MIN_BYTES",
    "MIN_OPSET",
    "PER_CHANNEL_OPSET",
    "PROTO_LIMIT",
    "LoadedModel",
    "NormalizedModel",
    "WeightBytes",
    "default_opset",
    "is_large",
    "iter_graphs",
    "load_model",
    "normalize",
    "save_model",
    "save_with_external_data",
    "stored_size",
    "weight_bytes",
]
