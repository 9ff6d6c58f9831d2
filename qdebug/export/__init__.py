"""A report's numbers written for tools that are not qdebug.

* :mod:`.model_explorer` -- Google Model Explorer *node data* files (added noise, accumulated and local
  SQNR, KL, a proposal's action per node), keyed by the node ids of its ONNX adapter, with thresholds that
  colour the sensitive nodes; the packages (the ``viz`` extra) are imported only when an export runs.
"""

from qdebug.export.model_explorer import (
    METRICS,
    ModelExplorerExport,
    NodeDataFile,
    export_model_explorer,
    graph_ids,
)

__all__ = ["METRICS", "ModelExplorerExport", "NodeDataFile", "export_model_explorer", "graph_ids"]
