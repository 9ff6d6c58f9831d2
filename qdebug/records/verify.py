"""The ``verify.json`` schema: FP32, full static and selective static side by side, and the verdict.

Plain frozen dataclasses like the rest of :mod:`qdebug.records`, so the TUI can show a verify result
without loading onnx or onnxruntime. They import only :mod:`qdebug.output.formatting` (itself standard
library only) for the plain-text table both front ends print. The command that measures them is
:mod:`qdebug.verify`, which re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qdebug.output.formatting import ACCURACY_METRICS, fmt_binary_size, fmt_db, fmt_metric, metric_title
from qdebug.records.samples import SampleSection


@dataclass(frozen=True)
class Timing:
    """Latency of one variant over ``runs`` timed runs of the same batch."""

    p50_ms: float
    p95_ms: float
    mean_ms: float
    throughput: float
    """Samples per second at this batch size (batch / mean latency)."""
    batch: int
    runs: int
    warmup: int
    threads: int
    """Intra-op threads asked for (0: ORT's default)."""
    provider: str
    rounds_ms: tuple[float, ...] = ()
    """Each interleaved round's median latency (ms), in order. The models timed together ran their rounds in
    turn, so round i of one and round i of another met the same machine: their ratio per round gives a
    speed-up with its spread (:func:`speed_ratio`). Empty in a file written before the field."""


@dataclass(frozen=True)
class SpeedRatio:
    """How many times faster than FP32 a model ran: the median of the per-round ratios and their range."""

    median: float
    low: float
    high: float
    rounds: int

    def show(self) -> str:
        """``1.25x (1.18-1.31)``."""
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"

    @property
    def verdict(self) -> str:
        """``faster`` or ``slower`` only where every round says so; else ``within the noise``."""
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "within the noise"


def speed_row(cols: Sequence[VariantResult]) -> list[str]:
    """The table's ``speed vs FP32`` cells (``1.00x``, ``2.31x (2.10-2.52)``...), FP32 first; empty unless every
    column was timed in two rounds or more with FP32's."""
    if not cols or cols[0].name != "fp32" or any(v.timing is None for v in cols):
        return []
    fp32 = cols[0].timing
    assert fp32 is not None
    ratios = [speed_ratio(fp32.rounds_ms, v.timing.rounds_ms) for v in cols[1:] if v.timing is not None]
    if not ratios or any(r is None for r in ratios):
        return []
    return ["1.00x", *(r.show() for r in ratios if r is not None)]


def speed_ratio(fp32_rounds: tuple[float, ...], rounds: tuple[float, ...]) -> SpeedRatio | None:
    """FP32's latency over the model's, round by round (paired: each round ran both in turn); None with fewer
    than two rounds to pair (one number has no spread) or rounds that were not timed together (other counts)."""
    if len(fp32_rounds) != len(rounds):
        return None
    pairs = [(a, b) for a, b in zip(fp32_rounds, rounds, strict=True) if a > 0 and b > 0]
    if len(pairs) < 2:
        return None
    ratios = sorted(a / b for a, b in pairs)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return SpeedRatio(median, ratios[0], ratios[-1], len(ratios))


@dataclass(frozen=True)
class VariantResult:
    """One column of the side-by-side table."""

    name: str
    """``fp32``, ``static`` or ``selective``."""
    metric: float
    output_sqnr_db: float
    """Worst output SQNR vs FP32 (``inf`` for FP32 itself)."""
    nodes_excluded: int
    excluded_share: float
    """``nodes_excluded`` / quantizable nodes."""
    tensor_overrides: int
    qdq_pairs: int
    """QuantizeLinear nodes in the model (0 for FP32)."""
    size_bytes: int
    """The model on disk, weights files included."""
    path: str | None
    timing: Timing | None = None
    weight_bytes: int | None = None
    """Bytes of the variant's weights (initializers and Constant values), from their shapes; ``None`` in
    files written before."""
    float_weight_bytes: int | None = None
    """How many of ``weight_bytes`` are float (Q/DQ scales left out): what quantization did not shrink. A
    CNN+LSTM reader's static model keeps its LSTM's weights float (ORT quantizes no LSTM in QDQ), and its
    size had read as a quantized size. ``None`` in files written before it."""
    runtime_quantized: int = 0
    """Tensors quantized at run time (DynamicQuantizeLinear, DynamicQuantizeLSTM nodes): a dynamic or mixed
    recipe's INT8 MatMuls and LSTMs, which have no Q/DQ pair."""


@dataclass(frozen=True)
class GateRecord:
    """One gate verify judged, as it judged it: what CI outputs (``--junit``) read, never re-judge."""

    name: str
    """What it checks, with its target: ``top1 recovery >= 90%``, ``output SQNR >= 20 dB``."""
    side: int
    """1 passed, -1 failed (beyond the noise when intervals were given), 0 undecided (its interval straddles)."""
    text: str
    """Its part of the verdict line."""


@dataclass(frozen=True)
class VerifyResult:
    """The verify report (``verify.json``)."""

    schema_version: int
    kind: str
    """Always ``"verify"``."""
    model_path: str
    model_sha256: str
    proposal: str
    """Where the proposal came from (a path, or ``tui``)."""
    metric: str
    samples: int
    quantizable_nodes: int
    variants: tuple[VariantResult, ...]
    recovered_fraction: float
    """``(sel - static) / (fp32 - static)``; ``nan`` when nothing was lost or FP32 has no finite value."""
    min_recovery: float
    target_sqnr_db: float
    """``nan`` when not asked."""
    met: bool
    verdict: str
    seconds: float
    notes: tuple[str, ...] = ()
    """What the user should know (e.g. a calibration that differs from the proposal's)."""
    target_drop: float = math.nan
    """The allowed drop vs FP32 when judged by it (``--target-drop``); ``nan`` when judged by recovery."""
    confidence: float = math.nan
    """Confidence of the intervals below (``--confidence``); ``nan``: judged on point estimates (``--confidence
    0``, a custom metric on one batch, files written before)."""
    decided: bool = True
    """False: no gate missed its target beyond the noise, but one could not be told from it (exit 8,
    ``UNDECIDED``); ``met`` is then False too."""
    drop_interval: tuple[float, float] = (math.nan, math.nan)
    """Paired-bootstrap interval of FP32 minus selective (points for the accuracy metrics)."""
    static_drop_interval: tuple[float, float] = (math.nan, math.nan)
    """The same for FP32 minus static."""
    recovery_interval: tuple[float, float] = (math.nan, math.nan)
    """Interval of ``recovered_fraction`` (a draw where static lost nothing counts as ``inf`` when the
    selective model keeps the lower level there, ``-inf`` when not)."""
    sqnr_interval: tuple[float, float] = (math.nan, math.nan)
    """Interval of the selective model's worst output SQNR (dB), with ``--target-sqnr``."""
    p_value: float = math.nan
    """McNemar's exact test, FP32 vs selective (top1 only): how likely so lopsided a split of the samples
    only one of them gets right is if the two are equally accurate."""
    discordant: tuple[int, int] | None = None
    """McNemar's discordant pairs: samples only FP32 gets right, samples only the selective model does."""
    samples_to_decide: int | None = None
    """When undecided: evaluation samples that would decide it, if the estimates and their spread held
    (None: not estimable, or decided)."""
    resamples: int = 0
    """Bootstrap draws behind the intervals (0: none)."""
    noise_units: int = 0
    """Units drawn: ``samples``, or the evaluation batches (a custom metric without ``per_sample``; an output
    without a batch axis)."""
    per_sample: SampleSection | None = None
    """The per-sample drill-down (:mod:`qdebug.records.samples`): FP32's, static's and selective's result per
    evaluation sample, the flips of each, and the selective model's worst flips measured tensor by tensor;
    ``None`` in files written before it."""
    gates: tuple[GateRecord, ...] = ()
    """Each gate as :func:`qdebug.evaluation.gates.assess` judged it (empty in files written before it)."""

    def variant(self, name: str) -> VariantResult:
        """The ``fp32``/``static``/``selective`` column."""
        for v in self.variants:
            if v.name == name:
                return v
        raise KeyError(name)

    def summary_lines(self) -> list[str]:
        """Plain-text side-by-side table and verdict (the CLI prints it; the TUI shows it)."""
        cols = self.variants
        rows: list[tuple[str, list[str]]] = [
            (metric_title(self.metric), [fmt_metric(self.metric, v.metric) for v in cols]),
            ("output SQNR dB", [fmt_db(v.output_sqnr_db) for v in cols]),
            (
                "nodes FP32",
                [
                    f"{v.nodes_excluded} ({100 * v.excluded_share:.1f}%)" if v.name != "fp32" else "all"
                    for v in cols
                ],
            ),
            ("tensor overrides", [str(v.tensor_overrides) for v in cols]),
            ("Q/DQ pairs", [str(v.qdq_pairs) for v in cols]),
            *([("run-time quantized", [str(v.runtime_quantized) for v in cols])] if any(
                v.runtime_quantized for v in cols) else []),
            ("size", [fmt_binary_size(v.size_bytes) for v in cols]),
            ("float weights", [_float_share(v) for v in cols]),
        ]
        if all(v.float_weight_bytes is None for v in cols):
            rows.pop()  # a verify.json written before the field
        if all(math.isnan(v.output_sqnr_db) for v in cols if v.name != "fp32"):
            del rows[1]  # no float output (ArgMax, token ids): there is no SQNR to show
        if all(v.timing is not None for v in cols):
            rows += [
                ("latency p50 ms", [f"{v.timing.p50_ms:.3f}" for v in cols if v.timing]),
                ("latency p95 ms", [f"{v.timing.p95_ms:.3f}" for v in cols if v.timing]),
                ("throughput /s", [f"{v.timing.throughput:.0f}" for v in cols if v.timing]),
            ]
            speed = speed_row(cols)
            rows += [("speed vs FP32", speed)] if speed else []
        width = max(len(r[0]) for r in rows)
        cw = [max(len(v.name), *(len(r[1][i]) for r in rows)) for i, v in enumerate(cols)]
        lines = [" " * width + "  " + "  ".join(v.name.rjust(cw[i]) for i, v in enumerate(cols))]
        for label, vals in rows:
            lines.append(label.ljust(width) + "  " + "  ".join(x.rjust(cw[i]) for i, x in enumerate(vals)))
        timing = cols[0].timing
        if timing is not None:
            n = len(timing.rounds_ms)
            rounds = f"; speed: the median ratio of {n} interleaved rounds (their range)" if n > 1 else ""
            lines.append(
                f"timing: batch {timing.batch}, {timing.runs} runs after {timing.warmup} warm-up, "
                f"{timing.provider}, threads {timing.threads or 'default'}{rounds}"
            )
        noise = self.noise_line()
        if noise:
            lines.append(noise)
        lines.append(self.verdict)
        return lines

    def noise_line(self) -> str:
        """``noise: 95% paired bootstrap over 500 samples ...``: every interval and McNemar's test in one
        line ("" without intervals)."""
        if math.isnan(self.confidence) or not self.resamples:
            return ""
        share = self.metric in ACCURACY_METRICS
        unit = " points" if share else ""
        parts = []
        for label, iv in (("selective drop vs FP32", self.drop_interval), ("static drop", self.static_drop_interval)):
            try:
                estimate = self.variant("fp32").metric - self.variant(label.split()[0]).metric
            except KeyError:
                estimate = math.nan
            if not math.isnan(iv[0]):
                scale = 100.0 if share else 1.0
                parts.append(f"{label} {estimate * scale:.2f}{unit} [{iv[0]:.2f}, {iv[1]:.2f}]")
        if not math.isnan(self.recovery_interval[0]) and not math.isnan(self.recovered_fraction):
            lo, hi = (_share(x) for x in self.recovery_interval)
            parts.append(f"recovered {_share(self.recovered_fraction)} [{lo}, {hi}]")
        if not math.isnan(self.sqnr_interval[0]):
            parts.append(f"selective output SQNR [{fmt_db(self.sqnr_interval[0])}, {fmt_db(self.sqnr_interval[1])}] dB")
        if self.discordant is not None and not math.isnan(self.p_value):
            b, c = self.discordant
            parts.append(f"McNemar exact p = {self.p_value:.3g} ({b} samples only FP32 gets right, {c} only selective)")
        per = f"{self.samples} samples" if self.noise_units in (0, self.samples) else f"{self.noise_units} batches"
        head = f"noise: {100 * self.confidence:g}% paired bootstrap over {per} ({self.resamples} draws)"
        return head + (": " + "; ".join(parts) if parts else "")


def _share(x: float) -> str:
    """A fraction as a percentage (``inf``/``-inf`` as they are)."""
    return f"{100 * x:.1f}%" if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _float_share(v: VariantResult) -> str:
    """``"49.0 KiB (82%)"``: the variant's float weights and their share of its weights (``-`` unknown)."""
    if v.float_weight_bytes is None or not v.weight_bytes:
        return "-"
    return f"{fmt_binary_size(v.float_weight_bytes)} ({v.float_weight_bytes / v.weight_bytes:.0%})"
