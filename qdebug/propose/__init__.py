"""Propose which nodes to keep out of quantization -- and prove it on the evaluation set.

The analysis report says where error *enters*; this package turns that into
the smallest mixed-precision configuration that meets a target, by evaluating
candidates on the evaluation data. The modules, in the order a run uses them:

``structure``
    The normalized model as a ``networkx.DiGraph`` (nodes = ONNX nodes, edges
    = tensors): producers, consumers, and the decomposed patterns (LayerNorm,
    GELU, attention cores) that are excluded whole or not at all.
``blame``
    Each node's introduced error attributed to a tensor (its output, or its
    inputs when the error is upstream error made visible), and the candidate
    :class:`Unit` s -- a tensor's producer plus all its quantized consumers,
    since ORT keeps a tensor float only if *no* neighbour quantizes it --
    ranked worst first.
``search``
    The search state: :class:`Target`, :class:`Trial`, :class:`Plan` and
    :class:`Search`, which re-quantizes variants from the cached calibration
    ranges, scores each distinct one once within the evaluation budget
    (``2*ceil(log2 L) + 10`` for ``L`` candidate nodes by default, plus a few
    held back to refine the answer) and keeps the trace.
``strategy``
    How plans are searched: per-channel weights first, bisection of the
    ranked units, greedy growth with re-ranking when they stall, then
    pruning, 16-bit activations instead of FP32 nodes, and units tried alone.
    The cheapest option that meets the target is kept: per-channel < int16 < fp32.
``explain``
    A reason per excluded node with the numbers behind it, the
    ``quantize_static`` snippet, and the notes.
``options``
    What a run is asked for: :class:`ProposeOptions`, the :class:`Target`
    they set (:func:`make_target`), ``--allow``'s actions, and :class:`ProposeResult`.
``run``
    The command: :func:`propose` checks the request, prepares the model,
    runs the search and writes the proposal and its selective model.
"""

from __future__ import annotations

from qdebug.propose.blame import (
    HARMLESS_SQNR_DB,
    INPUT_DRIVEN_MARGIN_DB,
    MIN_INTRODUCED_DB,
    Unit,
    blame_tensors,
    rank_units,
)
from qdebug.propose.options import ACTIONS, RERANK_SAMPLES, ProposeOptions, ProposeResult, make_target
from qdebug.propose.run import check_report_model, propose, rerank_limit, selective_model_path
from qdebug.propose.search import REFINE_EVALS, Plan, Rerank, Search, Target, Trial, default_budget
from qdebug.propose.strategy import PAIR_PRUNE_MAX_NODES, SINGLE_TRIES, run_search
from qdebug.propose.structure import (
    PATTERN_MAX_NODES,
    RESIDUAL_BRANCH_NODES,
    Structure,
    excludable_nodes,
    find_patterns,
    model_graph,
)

__all__ = [
    "ACTIONS",
    "HARMLESS_SQNR_DB",
    "INPUT_DRIVEN_MARGIN_DB",
    "MIN_INTRODUCED_DB",
    "PAIR_PRUNE_MAX_NODES",
    "PATTERN_MAX_NODES",
    "REFINE_EVALS",
    "RERANK_SAMPLES",
    "RESIDUAL_BRANCH_NODES",
    "SINGLE_TRIES",
    "Plan",
    "ProposeOptions",
    "ProposeResult",
    "Rerank",
    "Search",
    "Structure",
    "Target",
    "Trial",
    "Unit",
    "blame_tensors",
    "check_report_model",
    "default_budget",
    "excludable_nodes",
    "find_patterns",
    "make_target",
    "model_graph",
    "propose",
    "rank_units",
    "rerank_limit",
    "run_search",
    "selective_model_path",
]
