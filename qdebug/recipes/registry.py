"""The recipes propose knows, in one place: what each applies to, how it is built, screened, reproduced, explained.

A new recipe is one entry here, its own module under ``qdebug/recipes/`` and its tests: the search
(:mod:`qdebug.propose.recipes`), the proposal record, verify's rebuild and the snippet read every other
fact from the entry. The entries are in the order propose tries them, the least change first: when two
recipes meet the target, the earlier one is the answer.

This module imports nothing but the standard library, so the TUI and the printers may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    )
}


def recipe(name: str) -> Recipe:
    """The entry named ``name`` (a KeyError names the known ones)."""
    try:
        return RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}") from None
