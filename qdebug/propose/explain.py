"""What a proposal says about itself: a reason per node, the quantize_static snippet, the notes.

Every excluded node (and every 16-bit unit, and per-channel weights when they
were adopted) gets a :class:`~qdebug.records.NodeReason` with the numbers
behind it: the unit it belongs to, its role there (produces the tensor kept
float, reads it, part of a region) and the measured metric, static vs
selective. The snippet is the ``quantize_static`` call that rebuilds the
selective model with plain ONNX Runtime; the notes say what the user should
know about how the proposal was made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import onnx

from qdebug.data import batch_axes, fixed_batch
from qdebug.graph.ops import WEIGHTED_OPS
from qdebug.graph.unshare import snippet as unshare_snippet
from qdebug.graph.unshare import unshare_biases
from qdebug.output.formatting import ACCURACY_METRICS
from qdebug.output.snippet import quantize_snippet
from qdebug.prepare import Prepared
from qdebug.propose.search import Plan, Target, Trial
from qdebug.quant.quantize import QuantSpec, float16_exclusions
from qdebug.records import NodeReason, RecipeRecord, Report
from qdebug.vocabulary import RECIPES

RUN_TIME_REASON = (
    "kept out of quantize_dynamic (nodes_to_exclude): quantized at run time, its input gets one range per run "
    "for all its channels, and the search on the dynamic quantizer measured what that costs"
)
"""Why a node is kept FP32 under the dynamic recipe (the report's numbers describe static ranges)."""


def reason_lines(
    report: Report,
    plan: Plan,
    spec: QuantSpec,
    target: Target,
    static: Trial,
    final: Trial,
    trials: Sequence[Trial] = (),
) -> tuple[NodeReason, ...]:
    """One reason per excluded node (and per 16-bit unit), with the numbers behind it."""
    by_name = {n.name: n for n in report.nodes}
    producer_of = {o: n.name for n in report.nodes for o in n.outputs}
    measured = f"measured: {_fmt(target, static)} -> {_fmt(target, final)}; target {target.describe()}"
    out: list[NodeReason] = []
    placed: set[str] = set()

    def reason(node: str, action: str, text: str, region: int = -1) -> NodeReason:
        rec = by_name.get(node)
        return NodeReason(
            node=node,
            original_name=rec.original_name if rec else node,
            op_type=rec.op_type if rec else "",
            action=action,
            reason=f"{text}; {measured}",
            introduced_db=rec.introduced_db if rec else math.nan,
            local_sqnr_db=rec.local_sqnr_db if rec else math.nan,
            region=region,
        )

    for k, u in enumerate(plan.fp32):
        keeps = (
            f"keeps {u.key} float"
            if u.kind == "tensor"
            else "the start of a region cut to fit --max-nodes"
            if u.kind == "node"
            else f"keeps the {u.kind} region float"
        )
        for n in u.nodes:
            if n in spec.nodes_to_exclude and n not in placed and spec.quantizer == "dynamic":
                placed.add(n)  # the static report's blame does not say why: run-time ranges do
                out.append(reason(n, "fp32", RUN_TIME_REASON, k))
            elif n in spec.nodes_to_exclude and n not in placed:
                placed.add(n)
                if u.kind != "tensor":
                    role = "part of the region"
                elif producer_of.get(u.key) == n:
                    role = "produces it"
                else:
                    role = "reads it, would re-quantize it"
                if n == u.blamed:
                    role += ", its introduced error is blamed here"
                out.append(reason(n, "fp32", f"{keeps} ({role}); {u.why}", k))
    for n in spec.nodes_to_exclude:
        if n not in placed:
            out.append(reason(n, "fp32", "neighbour kept FP32 so that a tensor stays float in ORT's rewrite"))
    for k, u in enumerate(plan.int16, start=len(plan.fp32)):
        out.append(
            reason(
                u.blamed,
                "int16",
                f"16-bit activations on {', '.join(u.tensors)} instead of keeping {', '.join(u.nodes)} FP32 "
                f"(cheaper: weights stay 8-bit, no FP32 kernels); {u.why}",
                k,
            )
        )
    for k, f in enumerate(plan.fixed, start=len(plan.fp32) + len(plan.int16)):
        if not f.unit.nodes:  # a whole-model fix (calib-flipped): no node it stands in for
            out.append(NodeReason("", "", "", f.kind, f"{f.why}; {measured}"))
            continue
        out.append(
            reason(
                f.unit.blamed,
                f.kind,
                f"{f.why} instead of keeping {', '.join(f.unit.nodes)} FP32 (the nodes keep their integer "
                f"kernels); {f.unit.why}",
                k,
            )
        )
    if spec.per_channel and not report.config.per_channel:
        # its own step's gain, not the whole proposal's (which credited it with the exclusions' gain too)
        alone = next((t for t in trials if t.step == "per-channel"), None)
        gain = f"{_fmt(target, static)} -> {_fmt(target, alone)} alone" if alone is not None else measured
        out.append(
            NodeReason(
                "",
                "",
                "",
                "per-channel",
                f"per-channel weights for the whole model improved the metric: {gain}; "
                f"target {target.describe()}",
            )
        )
    return tuple(out)


def _fmt(target: Target, trial: Trial) -> str:
    """A trial's number as the reasons print it: dB, a percentage for accuracies, else 4 digits."""
    v = target.value(trial)
    if target.kind == "sqnr":
        return f"{v:.1f} dB"
    if target.metric in ACCURACY_METRICS:
        return f"{100 * v:.2f}%"
    return f"{v:.4g}"


def proposal_snippet(
    report: Report,
    model_path: Path,
    prep: Prepared,
    spec: QuantSpec,
    calib_src: str | Path,
    recipe: RecipeRecord | None = None,
) -> str:
    """The quantize_static snippet; on the normalized model when an excluded node had no (unique) name, on
    the recipe's transformed FP32 model (``prep``'s) when the proposal has one."""
    # float16 nodes are excluded from every variant qdebug builds; plain ORT needs them spelled out
    excluded = tuple(spec.nodes_to_exclude)
    excluded += tuple(n for n in float16_exclusions(prep.normalized) if n not in excluded)
    renamed = {new for new, old in prep.name_map.items() if new != old}
    user = onnx.load(str(model_path), load_external_data=False)
    # plain quantize_static leaves weights held in Constant nodes float (normalization made them initializers)
    named = (*excluded, *prep.settings.nodes_to_exclude, *prep.settings.nodes_to_quantize)
    normalized = any(n in renamed for n in named) or _constant_weights(user) or _if_inlined(user, prep)
    transformed = recipe is not None and recipe.quantizer == "static"
    normalized = normalized or transformed
    target_model = prep.normalized_path if normalized else model_path
    model_file = str(Path(target_model).resolve())
    prelude = ""
    if recipe is not None and not transformed:
        prelude = f"# recipe {recipe.name}: {RECIPES[recipe.name].title}\n" if recipe.name in RECIPES else ""
    elif recipe is not None:
        prelude = (
            f"# recipe {'+'.join(recipe.steps) or recipe.name}: the model below is your FP32 model transformed by "
            "qdebug propose (saved with the proposal); quantize it, not the original\n"
        )
    elif not normalized and _hits_shared_bias_bug(user):
        # the user's own quantize_static would rewire an activation to a bias copy (ORT's _dup_initializer)
        prelude = unshare_snippet(model_file, "model.unshared.onnx") + "\n"
        model_file = "model.unshared.onnx"
    settings = prep.settings  # the base quantization, the user's config included
    return prelude + quantize_snippet(
        model_file,
        excluded,
        method=settings.method,
        per_channel=spec.per_channel,
        activation_type=settings.activation_type,
        weight_type=settings.weight_type,
        tensor_overrides=spec.tensor_overrides,
        calib_hint=str(calib_src),
        batch=fixed_batch(prep.calib.specs),  # a fixed batch dimension accepts nothing else
        max_samples=report.config.max_samples,
        inputs=[s.name for s in prep.calib.specs],
        batch_axes=batch_axes(prep.calib.specs),
        settings=settings,
        quantizer=recipe.quantizer if recipe is not None else "static",
        reduce_range=recipe is not None and recipe.reduce_range,
    )


def quantized_given_notes(report: Report) -> tuple[str, ...]:
    """A note when the report analyzed the user's own quantized model, which propose does not reuse."""
    if not report.config.quantized_given:
        return ()
    return (
        "the report analyzed a quantized model given with --quantized; here the static baseline and every "
        f"candidate are rebuilt from qdebug's own calibration ({report.config.method}, "
        f"{'per-channel' if report.config.per_channel else 'per-tensor'} weights, "
        f"{report.config.activation_type}/{report.config.weight_type}), so 'static' can differ from that file",
    )


def nothing_quantized(final: Trial, static: Trial) -> tuple[str, ...]:
    """A note when the selective model keeps no Q/DQ pair: "MET" then means "do not quantize" (a proposal
    keeping every quantizable node FP32 had been reported as met without a word)."""
    if final.qdq_pairs > 0 or static.qdq_pairs == 0:
        return ()
    return (
        "the selective model has no quantization left (0 Q/DQ pairs, static has "
        f"{static.qdq_pairs}): on this target, quantizing this model does not pay; try a looser "
        "--target-drop or 16-bit activations (--allow fp32,int16), or keep the model FP32",
    )


def _hits_shared_bias_bug(user: onnx.ModelProto) -> bool:
    """Whether ORT's quantizer would give a copy of a shared bias the name of an existing tensor in the
    user's model (qdebug's normalization unshares it; the snippet must too). Works on a copy."""
    proto = onnx.ModelProto()
    proto.CopyFrom(user)
    return any(u.collisions for u in unshare_biases(proto))


def _constant_weights(user: onnx.ModelProto) -> bool:
    """Whether a Conv/MatMul/Gemm of the user's model reads its weight from a Constant node: plain
    ``quantize_static`` then stores it float (0.75 MB where the normalized model gives 0.28 MB)."""
    constants = {o for n in user.graph.node if n.op_type == "Constant" for o in n.output}
    return any(
        n.op_type in WEIGHTED_OPS and any(i in constants for i in n.input[1:]) for n in user.graph.node
    )


def _if_inlined(user: onnx.ModelProto, prep: Prepared) -> bool:
    """Whether normalization inlined If branches (``--inline-constant-if``): ORT quantizes no subgraph, so
    the user's own quantize_static on their model would quantize nothing inside them."""
    def ifs(model: onnx.ModelProto) -> int:
        return sum(1 for n in model.graph.node if n.op_type == "If")

    return ifs(user) > ifs(prep.normalized)
