"""verify's table: the FP32, static and selective columns as :class:`~qdebug.records.verify.VariantResult`.

:class:`Variants` holds the two quantized variants as built and scored; :func:`variant_columns` makes the three
columns of them (task metric, output SQNR, nodes kept FP32 and their share, overrides, Q/DQ pairs, size,
path, timing), :func:`with_weights` adds the weight bytes the size is made of, and
:func:`float_size_notes` and :func:`speed_clause` say what a reader of the verdict should know about
them. Plain functions over built models and records: the ``verify`` command (:mod:`qdebug.verify`) calls
them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

from qdebug.analysis.model_notes import float_size_note
from qdebug.evaluation.evaluate import EvalResult
from qdebug.graph.load import WeightBytes
from qdebug.records.proposal import Proposal
from qdebug.records.verify import Timing, VariantResult, fmt_binary_size, speed_ratio


@dataclass(frozen=True, eq=False)
class Variants:
    """The two quantized variants, built and scored (FP32 is the context's normalized model)."""

    static_model: onnx.ModelProto
    static: EvalResult
    quantizable: set[str]
    """Nodes whose exclusion changes the static model: what the excluded share is counted against."""
    selective_model: onnx.ModelProto
    selective: EvalResult
    selective_base: onnx.ModelProto | None = None
    """The FP32 model the selective one was quantized from when it is not the context's: the proposal's
    recipe's transformed model (None: the context's normalized model)."""


def with_weights(columns: tuple[VariantResult, ...], weights: Mapping[str, WeightBytes]) -> tuple[VariantResult, ...]:
    """The columns with their weight bytes and float weight bytes (what the size column is made of)."""
    return tuple(
        dataclasses.replace(v, weight_bytes=weights[v.name].total, float_weight_bytes=weights[v.name].floating)
        for v in columns
    )


def float_size_notes(weights: Mapping[str, WeightBytes]) -> tuple[str, ...]:
    """One note per quantized variant whose size is mostly float weights (:func:`float_size_note`)."""
    notes = ((name, float_size_note(w, fmt_binary_size)) for name, w in weights.items() if name != "fp32")
    return tuple(f"{name}: {note}" for name, note in notes if note)


def variant_columns(
    fp32_value: float,
    built: Variants,
    proposal: Proposal,
    sizes: Mapping[str, int],
    paths: Mapping[str, str | None],
    timings: Mapping[str, Timing],
) -> tuple[VariantResult, ...]:
    """The fp32, static and selective columns of the table."""
    n_q = len(built.quantizable)
    excluded = [n for n in proposal.nodes_to_exclude if n in built.quantizable]
    return (
        VariantResult(
            "fp32",
            fp32_value,
            math.inf,
            n_q,
            1.0,
            0,
            0,
            sizes["fp32"],
            paths["fp32"],
            timings.get("fp32"),
        ),
        VariantResult(
            "static",
            built.static.value,
            built.static.output_sqnr_db,
            0,
            0.0,
            0,
            _qdq_pairs(built.static_model),
            sizes["static"],
            paths["static"],
            timings.get("static"),
        ),
        VariantResult(
            "selective",
            built.selective.value,
            built.selective.output_sqnr_db,
            len(excluded),
            len(excluded) / n_q if n_q else math.nan,
            len(proposal.tensor_overrides),
            _qdq_pairs(built.selective_model),
            sizes["selective"],
            paths["selective"],
            timings.get("selective"),
            runtime_quantized=runtime_quantized(built.selective_model),
        ),
    )


def speed_clause(columns: Sequence[VariantResult]) -> str:
    """``; selective p50 0.296 ms (FP32 0.306, static 0.294)`` for the verdict line (nothing untimed): a
    selective model that recovers accuracy but gives the speed-up back must say so where CI reads."""
    timed = {c.name: c.timing for c in columns if c.timing is not None and c.timing.p50_ms > 0}
    sel = timed.get("selective")
    if sel is None:
        return ""
    others = [f"{label} {timed[n].p50_ms:.3g}" for n, label in (("fp32", "FP32"), ("static", "static")) if n in timed]
    clause = f"; selective p50 {sel.p50_ms:.3g} ms ({', '.join(others)})"
    ratio = speed_ratio(timed["fp32"].rounds_ms, sel.rounds_ms) if "fp32" in timed else None
    if ratio is not None:  # "faster" or "slower" only where every interleaved round says so
        clause += f", {ratio.show()} FP32's speed over {ratio.rounds} rounds: {ratio.verdict}"
    return clause


RUNTIME_QUANTIZERS = ("DynamicQuantizeLinear", "DynamicQuantizeLSTM")


def runtime_quantized(model: onnx.ModelProto) -> int:
    """Tensors a dynamic or mixed model quantizes at run time (its INT8 MatMuls' and LSTMs' inputs)."""
    return sum(1 for n in model.graph.node if n.op_type in RUNTIME_QUANTIZERS)


def _qdq_pairs(model: onnx.ModelProto) -> int:
    """QuantizeLinear nodes: one per quantized tensor (the table's Q/DQ pairs)."""
    return sum(1 for n in model.graph.node if n.op_type == "QuantizeLinear")
