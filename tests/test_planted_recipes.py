"""The planted kinds for the whole-model recipes (``fixtures/planted.py``): on each, default static QDQ misses
a one-point target, a few nodes kept FP32 do not recover it, and the planted recipe alone meets it.

Margins: the models are seeded, so every number is the same on every machine but for ORT's integer kernels.
On AVX2 without VNNI, ORT's u8s8 Conv/MatMul sums pairs of u8*s8 products in int16 (vpmaddubsw), which
saturates; with VNNI (this project's CPU) nothing saturates. Emulating the AVX2 saturation in numpy (every
u8s8 Conv/MatMul/Gemm, K-adjacent pairs, the rest run by ORT) gives, at size small -- FP32 / static /
remedy, top1 on 512 eval samples:

* equalize_depthwise: 0.998 / 0.480 (AVX2 0.479) / 0.998 (AVX2 0.998)
* smooth_outliers:    0.912 / 0.848 (AVX2 0.852) / 0.920 (AVX2 0.908)
* bias_shift:         0.998 / 0.859 / 1.000 (per-channel weights 0.795: every filter holds one large tap)

so static misses by >= 6 points and the remedy meets the target on both (the tightest: smooth_outliers on
AVX2, 0.6 points above it). The asserts below are the target itself (remedy) and 3 points below it (static).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest

from tests.conftest import FIXTURES

MISS = 0.03
"""How far below the one-point target plain static and per-channel weights must stay."""
FEW_MISS = 0.02
"""... and a few nodes kept FP32 (bias_shift's last three layers FP32 reach 0.959 against a 0.988 target)."""


def _planted():
    spec = importlib.util.spec_from_file_location("planted", FIXTURES / "planted.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("planted", module)  # its dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return sys.modules["planted"]


FIX = {"equalize_depthwise": "equalize", "smooth_outliers": "smooth", "bias_shift": "bias-correction"}

FEW = {
    # the obvious few nodes to keep FP32, and more than a few: none recovers the point
    "equalize_depthwise": ["block0/dw/conv", "block1/dw/conv", "block2/dw/conv"],
    "smooth_outliers": ["block0/ln1", "block0/ln2", "block1/ln1", "block1/ln2"],
    "bias_shift": ["layer3/conv", "layer4/conv", "layer5/conv"],
}


@pytest.mark.parametrize("kind", ["equalize_depthwise", "smooth_outliers", "bias_shift"])
def test_static_misses_a_few_nodes_do_not_fix_and_the_recipe_does(kind, tmp_path):
    planted = _planted()
    rec = planted.make(kind, tmp_path / kind, "small")
    assert rec.culprits == [] and not rec.small_set_exists
    assert rec.fix == FIX[kind]
    fp32 = planted.score(rec, rec.model)
    target = fp32 - rec.target_drop / 100  # top1 counts in points
    static = planted.score(rec, planted.quantize(rec, tmp_path / "static.onnx"))
    assert static < target - MISS, (fp32, static)
    few = planted.score(rec, planted.quantize(rec, tmp_path / "few.onnx", FEW[kind]))
    assert few < target - FEW_MISS, (fp32, few)
    # per-channel weights, the quantizer option propose scores before any recipe, do not recover it either
    per_channel = planted.score(rec, planted.quantize(rec, tmp_path / "pc.onnx", per_channel=True))
    assert per_channel < target - MISS, (fp32, per_channel)
    fixed = planted.apply_recipe(rec, tmp_path / "fixed.onnx")
    remedy = planted.score(rec, planted.quantize(dataclasses.replace(rec, model=str(fixed)), tmp_path / "fixed.q.onnx"))
    assert remedy >= target, (fp32, static, remedy)
    if kind != "bias_shift":  # equivalence transforms: the FP32 model computes what it did
        assert planted.max_relative_change(rec, fixed) <= 1e-4
