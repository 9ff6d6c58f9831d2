"""The layer-wise capture: where a QDQ model's error enters, tensor by tensor, node by node.

``qdebug analyze`` pairs the FP32 and QDQ models (:mod:`qdebug.graph.match`), then
this package measures them and explains the measurement:

* :mod:`.measure` -- :func:`measure_layers`, the capture's driver: which tensors
  are scored, which engine runs, the stream of batches (the main pass and the
  fake-quant view), the first-batch instrumentation check;
* :mod:`.graph_engine` -- the reductions inside ORT on merged models, cut into
  cache-sized chunks that run side by side (its tuning constants live there);
* :mod:`.numpy_engine` -- every tensor copied out and reduced in float64 (exact;
  the graph engine's fallback), and the local error's fake-quantization;
* :mod:`.build` -- the per-tensor accumulators both engines fill, and the tensor,
  node and weight records built from them;
* :mod:`.notes` -- the notes that diagnose the measured loss (kernel gap, shared
  and collapsed ranges, instrumentation, evaluation range), and the headline order;
* :mod:`.model_notes` -- the notes on how the model was built: the quantizer, the
  capture, what ORT folded or keeps float, and verify's and bench's size note.
* :mod:`.per_sample` -- the per-sample drill-down's second pass: a few flipped samples,
  each alone, through both models (per tensor its SQNR, added noise and clip rate).

Imports run one way: measure -> the engines -> build; notes -> model_notes, both
reading measure's result; per_sample reads measure, the numpy engine and build.
This module re-exports the names other modules, tests and benchmarks use. Patch a
name (a tuning constant, a session factory) in the submodule that looks it up:
a patch here changes nothing the capture reads.
"""

from qdebug.analysis.build import node_depths, node_records, quantized_node_names, weight_records
from qdebug.analysis.graph_engine import capture_workers
from qdebug.analysis.measure import (
    DEFAULT_FAKEQUANT_SAMPLES,
    LayerErrors,
    ModelOutputs,
    data_dependent_shapes,
    measure_layers,
    permutation_aliases,
)
from qdebug.analysis.model_notes import capture_notes, folded_activation_notes, quantizer_notes, structure_notes
from qdebug.analysis.notes import (
    collapsed_range_notes,
    concat_range_notes,
    eval_range_notes,
    instrumentation_notes,
    kernel_gap_nodes,
    kernel_gap_notes,
)
from qdebug.analysis.numpy_engine import fake_quantize, local_fake_quant
from qdebug.records import KERNEL_GAP_DB, ErrorStats, folded_into

__all__ = [
    "DEFAULT_FAKEQUANT_SAMPLES",
    "KERNEL_GAP_DB",
    "ErrorStats",
    "LayerErrors",
    "ModelOutputs",
    "capture_notes",
    "capture_workers",
    "collapsed_range_notes",
    "concat_range_notes",
    "data_dependent_shapes",
    "eval_range_notes",
    "fake_quantize",
    "folded_activation_notes",
    "folded_into",
    "instrumentation_notes",
    "kernel_gap_nodes",
    "kernel_gap_notes",
    "local_fake_quant",
    "measure_layers",
    "node_depths",
    "node_records",
    "permutation_aliases",
    "quantized_node_names",
    "quantizer_notes",
    "structure_notes",
    "weight_records",
]
