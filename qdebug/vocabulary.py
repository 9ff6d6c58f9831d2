"""propose's vocabulary in one place: the per-node fixes ``--allow`` names, and the whole-model recipes.

Each entry says what it applies to, how it is tried, reproduced and explained. A new fix kind or recipe is
one entry here, its own module and its tests: ``--allow``'s and ``--recipes``' checks and help, the search's
order, the proposal record, verify's rebuild, the snippet and Model Explorer's colours read every other fact
from the entry (a recipe's module lives under ``qdebug/recipes/``, a fix's in ``qdebug/propose/fixes.py``).

Both tables are in the order propose tries them, the least change first: when two recipes meet the target
the earlier one is the answer, and a unit gets the first fix that meets it. The recipes that choose how ORT
quantizes (``quantizer`` not ``static``: mixed, dynamic) come last and wait for the per-node search
(:func:`qdebug.propose.recipes.replaces`).

The light layer: standard library only, so the TUI and the printers may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FixKind:
    """One per-node change ``--allow`` names (``fp32`` keeps a node out of quantization; the others keep it
    quantized more cheaply)."""

    name: str
    title: str
    """What it changes, in a few words (``--allow``'s help, tables)."""
    default: bool
    """In ``--allow``'s default list (16-bit activations run as float on the CPU provider; the flipped
    samples' ranges come from evaluation samples, so what they reach is an upper bound)."""
    per_unit: bool
    """Tried on one unit of the answer before keeping it FP32 (clip, per-channel, reduce-range, calib-flipped)."""
    whole_first: bool = False
    """Its whole-model form is tried before per-channel weights (7-bit weights: per-channel weights do not
    cure the saturating kernels it fixes)."""
    from_evaluation: bool = False
    """Its ranges come from evaluation samples (an upper bound, opt-in)."""
    colour: str = "#e53935"
    """Model Explorer's colour of a node it changes."""


FIX_KINDS: dict[str, FixKind] = {
    f.name: f
    for f in (
        FixKind("clip", "a clipped activation range (one unit's, or every long-tailed one's)", True, True,
                colour="#fdd835"),
        FixKind("per-channel", "per-channel weights (the whole model's, else one node's)", True, True,
                colour="#ce93d8"),
        FixKind("reduce-range", "7-bit weights (one node's, or the whole model's where the kernels saturate)",
                True, True, whole_first=True, colour="#90caf9"),
        FixKind("calib-flipped", "ranges widened by the static model's flipped evaluation samples", False, True,
                from_evaluation=True, colour="#80cbc4"),
        FixKind("int16", "16-bit activations", False, False, colour="#fb8c00"),
        FixKind("fp32", "the node kept FP32", True, False, colour="#e53935"),
    )
}  # fmt: skip
"""Every fix kind, the cheapest first (the order a unit's fixes are tried in; FP32 is the last resort)."""

ACTIONS = tuple(FIX_KINDS)
"""What ``--allow`` accepts."""
DEFAULT_ALLOW = tuple(k for k, f in FIX_KINDS.items() if f.default)
"""``--allow``'s default: every fix that keeps integer kernels on the CPU provider, and FP32."""
PER_UNIT_FIXES = tuple(k for k, f in FIX_KINDS.items() if f.per_unit and not f.from_evaluation)
"""The fixes a unit may get from the report's own numbers, cheapest first."""


QUANTIZERS = ("static", "dynamic", "mixed")
"""How ORT builds a recipe's model: ``quantize_static`` (QDQ, ranges from calibration), ``quantize_dynamic``
(INT8 weights, activations quantized at run time), or both in turn (``mixed``)."""
RUN_TIME_OPS = ("MatMul", "Attention", "LSTM", "EmbedLayerNormalization", "Gather")
"""The op types ``quantize_dynamic`` quantizes on their own (a Gather only over a constant table; Conv too
where this ORT runs its ConvInteger): its Transposes follow an input that is already quantized, and every
other node of a dynamic model stays float."""
DYNAMIC_OPS = ("MatMul", "Gemm", "LSTM", "Attention")
"""The op types ``mixed`` leaves to ``quantize_dynamic`` (it turns a Gemm into MatMul + Add and quantizes
the MatMul): the static pass quantizes every other op type, Conv first among them."""


@dataclass(frozen=True)
class Recipe:
    """One whole-model recipe."""

    name: str
    """The key (``--recipes`` names it; ``proposal.json`` records it)."""
    title: str
    """What it does, in a few words, for tables."""
    applies_to: tuple[str, ...]
    """Op types it needs in the model to do anything (empty: any model)."""
    equivalent: bool
    """Whether the transformed FP32 model must compute what the user's does (checked on the calibration
    data before the recipe is scored; refused when it does not). Bias correction is not: it shifts the
    FP32 model's biases on purpose, to cancel the quantized model's shift."""
    needs: tuple[str, ...]
    """Recipes applied first (bias correction is measured on the best equivalence transform's model)."""
    explanation: str
    """Why it helps, one sentence, with its source."""
    reproduce: str
    """How a user rebuilds the deployed model without qdebug."""
    quantizer: str = "static"
    """How ORT builds its model (:data:`QUANTIZERS`); a recipe that is not ``static`` quantizes the user's
    FP32 model as it is (no transform)."""
    also_needs: tuple[str, ...] = ()
    """Op types of which the model must hold one too (``mixed``: a Conv for the static pass)."""

    @property
    def transforms(self) -> bool:
        """Whether it rewrites the FP32 model (the others choose how ORT quantizes it)."""
        return self.quantizer == "static"


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            name="fold-bn",
            title="BatchNormalization folded into Conv",
            applies_to=("BatchNormalization",),
            equivalent=True,
            needs=(),
            explanation=(
                "a BatchNormalization left between Q/DQ pairs is quantized twice and runs as a float kernel; "
                "folded into its Conv's weights and bias, as ORT's quant_pre_process does, it costs neither"
            ),
            reproduce="quantize the transformed FP32 model saved with the proposal (recipe.fp32_model)",
        ),
        Recipe(
            name="equalize",
            title="cross-layer equalization",
            applies_to=("Conv",),
            equivalent=True,
            needs=("fold-bn",),
            explanation=(
                "per-channel weight ranges that differ by orders of magnitude leave most channels a few "
                "levels of a per-tensor scale; scaling consecutive Convs' channels against each other "
                "(Nagel et al. 2019, cross-layer equalization) evens them out and leaves the FP32 model's "
                "outputs unchanged"
            ),
            reproduce="quantize the transformed FP32 model saved with the proposal (recipe.fp32_model)",
        ),
        Recipe(
            name="smooth",
            title="SmoothQuant",
            applies_to=("MatMul", "Gemm"),
            equivalent=True,
            needs=(),
            explanation=(
                "a few activation channels with outliers entering a MatMul take the whole per-tensor range; "
                "SmoothQuant (Xiao et al. 2023) moves part of that range into the MatMul's weights, per "
                "channel, and leaves the FP32 model's outputs unchanged"
            ),
            reproduce="quantize the transformed FP32 model saved with the proposal (recipe.fp32_model)",
        ),
        Recipe(
            name="bias-correction",
            title="bias correction",
            applies_to=("Conv", "Gemm", "MatMul"),
            equivalent=False,
            needs=(),
            explanation=(
                "quantized weights shift each layer's output mean, and the shifts add up through the "
                "network; each bias is corrected by the shift measured on the calibration data (Nagel et "
                "al. 2019, empirical bias correction), so the quantized model's means match FP32's"
            ),
            reproduce=(
                "quantize the bias-corrected FP32 model saved with the proposal (recipe.fp32_model); deploy the "
                "quantized model only: its FP32 biases are shifted on purpose"
            ),
        ),
        Recipe(
            name="mixed",
            title="static Conv, dynamic MatMul/LSTM",
            applies_to=("MatMul", "Gemm", "LSTM", "Attention"),
            equivalent=True,
            needs=(),
            explanation=(
                "activations whose range changes from one input to the next (a sequence's length, a signal's "
                "loudness) lose their levels to one static range; quantized at run time, as ORT's "
                "quantize_dynamic does for MatMul and LSTM, each input gets its own, while the convolutions "
                "keep static INT8's speed"
            ),
            reproduce=(
                "quantize_static with op_types_to_quantize leaving out MatMul, Gemm, LSTM and Attention, then "
                "quantize_dynamic of its output with op_types_to_quantize=['MatMul', 'LSTM', 'Attention']"
            ),
            quantizer="mixed",
            also_needs=("Conv", "ConvTranspose"),
        ),
        Recipe(
            name="dynamic",
            title="quantize_dynamic",
            applies_to=("MatMul", "Gemm", "LSTM", "Attention", "Conv"),
            equivalent=True,
            needs=(),
            explanation=(
                "activations whose range changes from one input to the next lose their levels to one static "
                "range; ORT's quantize_dynamic quantizes them at run time, each input over its own range (the "
                "ORT docs' advice for Transformer and RNN models)"
            ),
            reproduce="quantize_dynamic of the FP32 model, with the proposal's nodes_to_exclude",
            quantizer="dynamic",
        ),
    )
}


RECIPE_COLOURS = {"recipe": "#a1887f", "folded": "#bcaaa4"}
"""Model Explorer's colours of a node a recipe rewrote, and of one it folded away."""


def spec_changes(steps: tuple[str, ...] | list[str], params: tuple[tuple[str, float], ...] = ()) -> dict[str, object]:
    """What a recipe of ``steps`` changes in the run's quantizer settings (``QuantSpec`` fields): how ORT builds
    the model, and 7-bit weights where the recipe was given them (``reduce_range`` among ``params``: the dynamic
    and mixed recipes on a CPU whose u8s8 kernels saturate)."""
    changes: dict[str, object] = {"quantizer": quantizer_of(steps)}
    if dict(params).get("reduce_range"):
        changes["reduce_range"] = True
    return changes


def quantizer_of(steps: tuple[str, ...] | list[str]) -> str:
    """How ORT builds the model of a recipe's ``steps`` (``static`` when none sets another)."""
    return next((RECIPES[s].quantizer for s in steps if s in RECIPES and not RECIPES[s].transforms), "static")


def recipe(name: str) -> Recipe:
    """The entry named ``name`` (a KeyError names the known ones)."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}") from None
