"""The options of ``qdebug bench`` (:class:`BenchOptions`).

A module of its own because every stage reads them: the variants are built
with their quantization settings, the measuring processes get their loop
settings, and the driver checks them. Kept apart from :mod:`qdebug.bench.run`
so that those stages need not import the driver that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qdebug.prepare import QuantRequest, RuntimeSettings, flat_settings

BENCH_FLAT = ("per_channel", "activation_type", "weight_type", "upgrade_opset", "inline_constant_if")
"""The quantization settings :class:`BenchOptions` still takes as flat keyword arguments (the method is
its own ``methods`` list)."""


@flat_settings(BENCH_FLAT)
@dataclass(frozen=True)
class BenchOptions:
    """Options of :func:`run_bench` (the flags of ``qdebug bench``).

    ``quant``: a ``--config``/``--preset`` and the quantization flags given; what they leave open is the
    proposal's settings, else qdebug's defaults (``per_channel``, ``activation_type``, ``weight_type``,
    ``upgrade_opset``, ``inline_constant_if`` are still accepted and read as flat names, None/False meaning
    "the proposal's"); ``runtime``: providers, threads, cache (flat names too).
    """

    variants: tuple[str, ...] | None = None
    """Variants to measure (None: fp32, dynamic, static, and selective when a proposal is given -- as the
    CLI does without --variants)."""
    methods: tuple[str, ...] = ()
    """Calibration methods, one static variant each (empty: the proposal's method, else minmax)."""
    quant: QuantRequest = field(default_factory=QuantRequest)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    dynamic_ops: tuple[str, ...] = ()
    """Op types ``quantize_dynamic`` quantizes (empty: ORT's default set)."""
    batch_size: int | None = None
    max_samples: int | None = None
    """Calibration samples (the evaluation set is used whole)."""
    batch_axes: tuple[tuple[str, int | None], ...] = ()
    """``--batch-axis`` overrides (input, axis); the others are read off the model."""
    metric: str | None = None
    runs: int = 5
    warmup: int = 3
    alloc_batches: int = 20
    """Batches in the separate tracemalloc loop."""
    dynamic_layers: bool = True
    """Also measure the dynamic variant's per-layer error vs FP32 (a report ``qdebug tui`` opens)."""
    timeout_s: float = 600.0
    """Seconds a measuring process may take to start and warm up, for one timed pass, or to write its
    result; past that it is killed and its variant reported with an error (a hang must not stall CI)."""
