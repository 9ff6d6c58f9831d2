"""The options of ``qdebug bench`` (:class:`BenchOptions`).

A module of its own because every stage reads them: the variants are built
with their quantization settings, the measuring processes get their loop
settings, and the driver checks them. Kept apart from :mod:`qdebug.bench.run`
so that those stages need not import the driver that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchOptions:
    """Options of :func:`run_bench` (the flags of ``qdebug bench``)."""

    variants: tuple[str, ...] | None = None
    """Variants to measure (None: fp32, dynamic, static, and selective when a proposal is given -- as the
    CLI does without --variants)."""
    methods: tuple[str, ...] = ()
    """Calibration methods, one static variant each (empty: the proposal's method, else minmax)."""
    per_channel: bool = False
    activation_type: str | None = None
    """Activation type of the static variants (None: the proposal's, else QUInt8)."""
    weight_type: str | None = None
    """Weight type of the static variants (None: the proposal's, else QInt8)."""
    dynamic_ops: tuple[str, ...] = ()
    """Op types ``quantize_dynamic`` quantizes (empty: ORT's default set)."""
    batch_size: int | None = None
    max_samples: int | None = None
    """Calibration samples (the evaluation set is used whole)."""
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (input, axis); the others are read off the model."""
    metric: str | None = None
    upgrade_opset: bool = False
    inline_constant_if: bool = False
    use_cache: bool = True
    providers: tuple[str, ...] = ("CPUExecutionProvider",)
    threads: int = 0
    runs: int = 5
    warmup: int = 3
    alloc_batches: int = 20
    """Batches in the separate tracemalloc loop."""
    dynamic_layers: bool = True
    """Also measure the dynamic variant's per-layer error vs FP32 (a report ``qdebug tui`` opens)."""
    timeout_s: float = 600.0
    """Seconds a measuring process may take to start and warm up, for one timed pass, or to write its
    result; past that it is killed and its variant reported with an error (a hang must not stall CI)."""
