"""Every on-disk schema qdebug writes: frozen records, standard library only.

Importing this package loads neither onnx nor onnxruntime (the TUI and the CLI printers rely on it).
``report`` holds the analysis report, ``proposal`` the proposal file; ``bench`` and ``verify`` (their own
submodules, since both define a ``VariantResult``) hold the results of those commands.
"""

from qdebug.records.proposal import (
    FrontierPoint,
    NodeReason,
    Proposal,
    RecipeRecord,
    TensorOverride,
)
from qdebug.records.report import (
    KERNEL_GAP_DB,
    METHODS,
    QUANT_TYPES,
    SCHEMA_VERSION,
    SQNR_CAP_DB,
    AnalysisConfig,
    ErrorStats,
    Histogram,
    ModelInfo,
    NodeRecord,
    NotCaptured,
    OutputMetric,
    QuantParams,
    Report,
    TaskMetric,
    TensorRecord,
    TensorSummary,
    WeightRecord,
    folded_into,
    from_exact_input,
    rank_nodes,
)

__all__ = [
    "SQNR_CAP_DB",
    "from_exact_input",
    "FrontierPoint",
    "AnalysisConfig",
    "ErrorStats",
    "Histogram",
    "KERNEL_GAP_DB",
    "METHODS",
    "ModelInfo",
    "NodeReason",
    "NodeRecord",
    "NotCaptured",
    "OutputMetric",
    "Proposal",
    "RecipeRecord",
    "QUANT_TYPES",
    "QuantParams",
    "Report",
    "SCHEMA_VERSION",
    "TaskMetric",
    "TensorOverride",
    "TensorRecord",
    "TensorSummary",
    "WeightRecord",
    "folded_into",
    "rank_nodes",
]
