"""A realistic, deterministic synthetic report (and proposal) for the TUI tests.

A two-layer transformer encoder (32 nodes): per layer LayerNorm, Q/K/V
projections, ``qk_matmul``, Softmax, ``av_matmul``, output projection, the
residual Adds, and an MLP with an Erf-based GELU; then a final LayerNorm and a
classification head. The error numbers follow a simple noise model (noise
powers add along the graph) with a few deliberately bad nodes (the Softmaxes,
the GELU Erfs, ``layer1/attn/qk_matmul``) and the edge cases the TUI must
handle: an unquantized node (``nan`` local SQNR, ``-inf`` added noise), exact
tensors (``+inf`` dB), an ``inf - inf = nan`` introduced value and a ``nan`` KL.

``added_noise_db`` follows from the SQNRs as in the analysis:
``10*log10(NSR_out - NSR_in)`` with ``NSR = 10**(-SQNR/10)`` at the worst input
and the output. ``layer0/attn/q_proj`` stands for a deployed integer kernel
that loses more than the QDQ graph's float semantics (30 dB local SQNR
deployed, 46 dB fake-quant), and the fake-quant numbers (``accumulated_fakequant``,
``task.quantized_fakequant``) follow from that second noise chain.

No model is run: this only builds :mod:`qdebug.records` objects.
"""

from __future__ import annotations

import dataclasses
import math
import random

from qdebug.records import (
    SCHEMA_VERSION,
    AnalysisConfig,
    ErrorStats,
    Histogram,
    ModelInfo,
    NodeReason,
    NodeRecord,
    OutputMetric,
    Proposal,
    QuantParams,
    Report,
    TaskMetric,
    TensorRecord,
    TensorSummary,
    WeightRecord,
)

SEED = 20240607
BINS = 32

# Local SQNR (dB) of the deliberately bad nodes; everything else gets 34..48 dB.
_BAD_LOCAL = {
    "layer0/attn/q_proj": 30.0,  # the deployed u8s8 kernel saturates (fake-quant: 46 dB, see _KERNEL_LOSS)
    "layer0/attn/softmax": 24.5,
    "layer0/mlp/gelu/erf": 27.0,
    "layer1/attn/qk_matmul": 22.0,
    "layer1/attn/softmax": 19.5,
    "layer1/mlp/gelu/erf": 23.5,
    "head/matmul": 29.0,
}
_KERNEL_LOSS = {"layer0/attn/q_proj": 46.0}  # fake-quant local SQNR where the integer kernel loses more
_UNQUANTIZED = {"layer0/ln1"}  # kept in FP32 by the quantizer: local nan, output exact (+inf)
_NAN_KL = {"layer1/mlp/gelu/mul"}


def _graph(layers: int = 2) -> list[tuple[str, str, list[str], list[str]]]:
    """(name, op, inputs, outputs) in topological order; weights are ``*.weight`` initializers."""
    nodes: list[tuple[str, str, list[str], list[str]]] = []
    h = "embeddings"
    for layer in range(layers):
        p = f"layer{layer}"

        def add(name: str, op: str, inputs: list[str], p: str = p) -> str:
            out = f"{p}/{name}_out"
            nodes.append((f"{p}/{name}", op, inputs, [out]))
            return out

        ln1 = add("ln1", "LayerNormalization", [h, f"{p}/ln1.weight", f"{p}/ln1.bias"])
        q = add("attn/q_proj", "MatMul", [ln1, f"{p}/attn/q_proj.weight"])
        k = add("attn/k_proj", "MatMul", [ln1, f"{p}/attn/k_proj.weight"])
        v = add("attn/v_proj", "MatMul", [ln1, f"{p}/attn/v_proj.weight"])
        qk = add("attn/qk_matmul", "MatMul", [q, k])
        sm = add("attn/softmax", "Softmax", [qk])
        av = add("attn/av_matmul", "MatMul", [sm, v])
        o = add("attn/out_proj", "MatMul", [av, f"{p}/attn/out_proj.weight"])
        r1 = add("residual1", "Add", [h, o])
        ln2 = add("ln2", "LayerNormalization", [r1, f"{p}/ln2.weight", f"{p}/ln2.bias"])
        fc1 = add("mlp/fc1", "MatMul", [ln2, f"{p}/mlp/fc1.weight"])
        erf = add("mlp/gelu/erf", "Erf", [fc1])
        mul = add("mlp/gelu/mul", "Mul", [fc1, erf])
        fc2 = add("mlp/fc2", "MatMul", [mul, f"{p}/mlp/fc2.weight"])
        h = add("residual2", "Add", [r1, fc2])
    nodes.append(
        ("final/ln", "LayerNormalization", [h, "final/ln.weight", "final/ln.bias"], ["final/ln_out"])
    )
    nodes.append(("head/matmul", "MatMul", ["final/ln_out", "head.weight"], ["logits"]))
    return nodes


def _stats(sqnr: float, power: float, kl: float, count: int = 4096) -> ErrorStats:
    if math.isinf(sqnr) and sqnr > 0:
        return ErrorStats(sqnr_db=sqnr, mse=0.0, cosine=1.0, max_abs=0.0, kl=0.0, count=count)
    mse = power * 10 ** (-sqnr / 10)
    cosine = 1.0 / math.sqrt(1.0 + 10 ** (-sqnr / 10))
    return ErrorStats(sqnr_db=sqnr, mse=mse, cosine=cosine, max_abs=4.0 * math.sqrt(mse), kl=kl, count=count)


def _hist(
    rng: random.Random, center: float, spread: float, noise_db: float
) -> tuple[Histogram, TensorSummary]:
    lo, hi = center - 4 * spread, center + 4 * spread
    edges = tuple(lo + (hi - lo) * i / BINS for i in range(BINS + 1))
    ref = []
    cand = []
    jitter = 0.0 if math.isinf(noise_db) else min(0.9, 10 ** (-noise_db / 20) * 3)
    for i in range(BINS):
        mid = (edges[i] + edges[i + 1]) / 2
        count = int(2000 * math.exp(-0.5 * ((mid - center) / spread) ** 2))
        ref.append(count)
        factor = 1.0 + jitter * math.sin(1.7 * i + rng.random())
        cand.append(max(0, int(count * factor)))
    if not math.isinf(noise_db):
        ref[0] += 3  # outliers in the outer bins
        cand[-1] += 2
    summary = TensorSummary(min=lo, max=hi, mean=center, std=spread, count=sum(ref))
    return Histogram(edges=edges, ref_counts=tuple(ref), cand_counts=tuple(cand)), summary


def _noise(db: float) -> float:
    return 0.0 if math.isinf(db) and db > 0 else 10 ** (-db / 10)


def _db(noise: float) -> float:
    return math.inf if noise <= 0 else -10 * math.log10(noise)


def added_noise_db(sqnr_in: float, sqnr_out: float) -> float:
    """``10*log10(NSR_out - NSR_in)``: the noise a node adds relative to the signal (``-inf``: none)."""
    if math.isnan(sqnr_in) or math.isnan(sqnr_out):
        return math.nan
    delta = _noise(sqnr_out) - _noise(sqnr_in)
    return 10 * math.log10(delta) if delta > 0 else -math.inf


def make_report(model_path: str = "models/tiny_transformer.onnx", layers: int = 2) -> Report:
    """The synthetic report; identical on every call.

    ``layers``: encoder layers (15 nodes each, plus the final LayerNorm and the head): 2 for the tests'
    32 nodes; :func:`make_large_report` stacks more for the performance checks.
    """
    rng = random.Random(SEED)
    graph = _graph(layers)
    # a deeper stack gets proportionally quieter nodes and gentler amplification, so its accumulated
    # SQNRs end where the 2-layer model's do (2 layers: no change)
    depth_scale = layers / 2
    local_offset_db = 10 * math.log10(depth_scale)
    producers = {out: name for name, _, _, outs in graph for out in outs}
    consumers: dict[str, list[str]] = {}
    for name, _, ins, _ in graph:
        for i in ins:
            consumers.setdefault(i, []).append(name)

    depth_of: dict[str, int] = {"embeddings": 0}
    acc_of: dict[str, float] = {"embeddings": math.inf}  # graph input kept exact
    fq_of: dict[str, float] = {"embeddings": math.inf}  # the same chain with fake-quant arithmetic
    tensors: list[TensorRecord] = []
    nodes: list[NodeRecord] = []
    weights: list[WeightRecord] = []

    emb_hist, emb_summary = _hist(rng, 0.0, 1.0, math.inf)
    tensors.append(
        TensorRecord(
            name="embeddings",
            producer=None,
            consumers=tuple(consumers["embeddings"]),
            depth=0,
            summary=emb_summary,
            quant=None,
            local=None,
            accumulated=_stats(math.inf, 1.0, 0.0),
            histogram=emb_hist,
            note="graph input (not quantized)",
        )
    )

    for name, op, ins, outs in graph:
        acts = [i for i in ins if not i.endswith(".weight") and not i.endswith(".bias")]
        depth = 1 + max(depth_of[i] for i in acts)
        worst_in = min(acc_of[i] for i in acts)
        quantized = name not in _UNQUANTIZED
        local = _BAD_LOCAL.get(name, round(34 + 14 * rng.random(), 2)) if quantized else math.nan
        local += local_offset_db
        noise_in = _noise(worst_in)
        gain = 1.25 ** (1 / depth_scale) if op in ("Softmax", "Erf") else 1.0
        noise_out = noise_in * gain + (0.0 if not quantized else _noise(local))
        acc = _db(noise_out)
        fq_local = _KERNEL_LOSS.get(name, local)
        fq_in = _noise(min(fq_of[i] for i in acts))
        fq = _db(fq_in * gain + (0.0 if not quantized else _noise(fq_local)))
        kl = math.nan if name in _NAN_KL else (0.0 if not quantized else round(10 ** (-local / 10) * 3, 6))
        introduced = worst_in - acc  # inf - finite = inf, inf - inf = nan
        for out in outs:
            depth_of[out] = depth
            acc_of[out] = acc
            fq_of[out] = fq
            center = 0.5 if op == "Softmax" else 0.0
            spread = 0.15 if op == "Softmax" else 1.0 + (depth % 5) * 0.3
            hist, summary = _hist(rng, center, spread, acc)
            scale = (summary.max - summary.min) / 255
            quant = (
                QuantParams(scale=scale, zero_point=int(round(-summary.min / scale)), qtype="uint8")
                if quantized
                else None
            )
            tensors.append(
                TensorRecord(
                    name=out,
                    producer=name,
                    consumers=tuple(consumers.get(out, ())),
                    depth=depth,
                    summary=summary,
                    quant=quant,
                    local=_stats(local, summary.std**2, kl) if quantized else None,
                    accumulated=_stats(acc, summary.std**2, kl),
                    histogram=hist,
                    quantized_name=f"{out}_DequantizeLinear_Output" if quantized else None,
                    accumulated_fakequant=_stats(fq, summary.std**2, kl) if quantized else None,
                    note="" if quantized else "not quantized (kept in FP32)",
                )
            )
        for w in ins:
            if w.endswith(".weight") and op == "MatMul":
                wdb = round(38 + 8 * rng.random(), 2)
                weights.append(
                    WeightRecord(
                        name=w,
                        node=name,
                        error=_stats(wdb, 0.02, 0.0, count=64 * 64),
                        quant=QuantParams(scale=0.0021, zero_point=0, qtype="int8", axis=1, channels=64),
                        channel_sqnr_db=tuple(round(wdb + rng.uniform(-3, 3), 2) for _ in range(4)),
                    )
                )
        nodes.append(
            NodeRecord(
                name=name,
                original_name=name if name != "final/ln" else "",
                op_type=op,
                inputs=tuple(ins),
                outputs=tuple(outs),
                depth=depth,
                quantized=quantized,
                local_sqnr_db=local,
                accumulated_sqnr_db=acc,
                introduced_db=introduced,
                kl=kl,
                added_noise_db=added_noise_db(worst_in, acc),
            )
        )

    assert producers  # every activation has a producer or is the graph input
    info = ModelInfo(
        path=model_path,
        sha256="3f" * 32,
        opset=17,
        nodes=len(nodes),
        inputs=("embeddings",),
        outputs=("logits",),
    )
    return Report(
        schema_version=SCHEMA_VERSION,
        qdebug_version="0.1.0",
        ort_version="1.20.0",
        created="2024-06-07T12:00:00+00:00",
        model=info,
        normalized_model="out/tiny_transformer.normalized.onnx",
        quantized_model=ModelInfo(
            path="out/tiny_transformer.qdq.onnx",
            sha256="a1" * 32,
            opset=17,
            nodes=len(nodes) * 3,
            inputs=("embeddings",),
            outputs=("logits",),
        ),
        config=AnalysisConfig(
            method="minmax",
            per_channel=True,
            activation_type="QUInt8",
            weight_type="QInt8",
            calib="data/calib.npz",
            eval="data/eval.npz",
            metric="top1",
        ),
        calibration_cache=None,
        samples=64,
        nodes=tuple(nodes),
        tensors=tuple(tensors),
        weights=tuple(weights),
        outputs=(OutputMetric(name="logits", error=_stats(acc_of["logits"], 4.0, 0.01)),),
        task=TaskMetric(
            name="top1", fp32=0.9125, quantized=0.8610, samples=512, data="eval", quantized_fakequant=0.8830
        ),
        deployed_gap=0.0,
        notes=("named 1 unnamed node (final/ln)",),
    )


KERNEL_GAP_NOTE = (
    "deployed INT8 kernels lose more than the QDQ graph's own rounding explains at 2 tensor(s); the gap opens at "
    "layer0/attn/q_proj_out (from layer0/attn/q_proj): 30.0 dB deployed vs 46.0 dB fake-quant; 1 tensor(s) "
    "downstream inherit it. On x86 CPUs without VNNI, ORT's u8s8 MatMul/Conv kernels can saturate their 16-bit "
    "intermediates (ORT's documented U8S8 saturation, a kernel limit, not the model's fault). Fixes that keep "
    "INT8: re-quantize with --weight-type QUInt8 (U8U8 kernels do not saturate), or give the nodes 7-bit weights "
    "(reduce_range: `qdebug propose` tries it for the whole model where the gap opens at several weighted nodes, "
    "else per node; --allow reduce-range, on by default), or keep layer0/attn/q_proj out of INT8"
)
"""``qdebug.analysis.kernel_gap_notes(report.tensors, nodes=report.nodes)`` on :func:`make_report`, verbatim."""


def make_findings_report() -> Report:
    """:func:`make_report` with the notes ``qdebug analyze`` writes about such a model (the findings pane).

    After the report's own note (``named 1 unnamed node``): a note naming nothing (the calibration cache),
    the kernel-gap note analyze writes for these numbers (:data:`KERNEL_GAP_NOTE`), and a collapsed-range
    and an evaluation-range note in analyze's words (:mod:`qdebug.analysis.notes`) with the report's own
    scales, ranges and SQNRs (the share in one step and the evaluation samples are made up: the synthetic
    histograms collapse nowhere and no evaluation data exists).
    """
    report = make_report()
    sm, logits = report.tensor("layer1/attn/softmax_out"), report.tensor("logits")
    av = report.node("layer1/attn/av_matmul")
    assert sm is not None and sm.quant is not None and sm.accumulated is not None
    assert logits is not None and logits.quant is not None
    lo = min((0 - logits.quant.zero_point) * logits.quant.scale, logits.summary.min)
    hi = max((255 - logits.quant.zero_point) * logits.quant.scale, logits.summary.max)
    collapsed = (
        f"layer1/attn/softmax_out: 62% of its values fall in one quantization step (scale {sm.quant.scale:.3g} for "
        f"the range [{sm.summary.min:.3g}, {sm.summary.max:.3g}]), although its SQNR looks "
        f"{sm.accumulated.sqnr_db:.1f} dB (the largest values carry the energy); layer1/attn/av_matmul (MatMul) "
        f"reading it falls to {av.accumulated_sqnr_db:.1f} dB SQNR, which its own quantization "
        f"({av.local_sqnr_db:.1f} dB) does not explain. A range set by outliers such as mask values of -1e9 erases "
        "the other values: keep layer1/attn/softmax and layer1/attn/av_matmul out of quantization"
    )
    evaluation = (
        f"evaluation data drives output 'logits' outside its calibrated range [{lo:.4g}, {hi:.4g}] on 12 of 512 "
        "samples (|value| up to 11.3): quantization clips those values, and the report's per-tensor numbers, "
        "measured on the calibration data, do not show it; calibrate on data that covers the evaluation range, "
        "or keep head/matmul FP32"
    )
    cache = "calibration ranges reused from cache data/.qdebug/minmax-3f3f3f3f.npz"
    return dataclasses.replace(report, notes=(*report.notes, cache, KERNEL_GAP_NOTE, collapsed, evaluation))


def make_large_report(nodes: int = 2000) -> Report:
    """The same encoder with enough layers for at least ``nodes`` nodes (BERT-base/ResNet-50 sized tables).

    Deep layers' errors follow the same noise model, so accumulated SQNRs fall steadily with depth and
    the columns hold the same mix of finite and non-finite values as the small report.
    """
    layers = max(2, -(-(nodes - 2) // 15))
    return make_report("models/large_transformer.onnx", layers=layers)


def make_proposal(report: Report | None = None) -> Proposal:
    """A ``propose``-style proposal excluding the two worst layer-1 nodes."""
    report = report or make_report()
    names = ("layer1/attn/softmax", "layer1/mlp/gelu/erf")
    reasons = []
    for region, n in enumerate(names):
        node = report.node(n)
        reasons.append(
            NodeReason(
                node=n,
                original_name=node.original_name,
                op_type=node.op_type,
                action="fp32",
                reason=f"introduces {node.introduced_db:.1f} dB; top-1 recovers when kept in FP32",
                introduced_db=node.introduced_db,
                local_sqnr_db=node.local_sqnr_db,
                region=region,
            )
        )
    return Proposal(
        schema_version=SCHEMA_VERSION,
        kind="proposal",
        model_path=report.model.path,
        model_sha256=report.model.sha256,
        normalized_model=report.normalized_model,
        nodes_to_exclude=names,
        reasons=tuple(reasons),
        metric="top1",
        fp32_metric=0.9125,
        static_metric=0.8610,
        expected_metric=0.9020,
        evaluations=7,
        search_seconds=12.5,
        source="propose",
        quantizable_nodes=sum(1 for n in report.nodes if n.quantized),
    )
