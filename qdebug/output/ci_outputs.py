"""CI-native outputs: every command's summary as Markdown, and verify's gates as JUnit XML.

``--markdown FILE`` (analyze, propose, verify, bench, diff) writes the summary as Markdown tables, fit
for a pull-request comment or a CI step summary; ``verify --junit FILE`` writes one JUnit test case per
gate verify judges (the recovery or drop target, and ``--target-sqnr``), a failed gate carrying the
verdict line as its message, an undecided one (its interval straddles the target: verify exits 8) a
``<skipped/>`` with that message -- the evidence shows neither a pass nor a miss, and the exit code, not
the test count, fails the CI step. Both are rendered from the records alone (the light layer: standard library
and :mod:`qdebug.records`, :mod:`qdebug.output.formatting`, :mod:`qdebug.output.files`) and written atomically; the
exit codes stay those of the command.

A ``--markdown`` path that is the file GitHub Actions names in ``$GITHUB_STEP_SUMMARY`` is added to,
not replaced (still atomically: the old content and the new one are written together), so several
commands of one step each add their summary.
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import atomic_write_text, check_outputs_spare_inputs, check_writable
from qdebug.output.formatting import ACCURACY_METRICS, fmt_db, fmt_metric, fmt_size, metric_title
from qdebug.records import NodeRecord, Proposal, Report, folded_into, from_exact_input, rank_nodes
from qdebug.records.bench import BenchReport
from qdebug.records.diff import (
    COMPARISON_COLUMNS,
    TABLE_COLUMNS,
    Comparison,
    DiffReport,
    comparison_header,
    comparison_rows,
    node_label,
)
from qdebug.records.samples import SampleSection
from qdebug.records.verify import VerifyResult, fmt_binary_size, speed_row

MARKDOWN_HELP = (
    "also write the summary as Markdown tables to FILE (a pull-request comment, $GITHUB_STEP_SUMMARY: "
    "that file is added to, not replaced)"
)
JUNIT_HELP = "also write one JUnit XML test case per gate to FILE (a failed gate's message is the verdict line)"

STEP_SUMMARY = "GITHUB_STEP_SUMMARY"
"""The environment variable naming GitHub Actions' step-summary file."""


# --------------------------------------------------------------------------- writing


def check_ci_outputs(args: Any, inputs: Iterable[str | None] = (), outputs: Iterable[str | None] = ()) -> None:
    """Refuse, before any long work, a ``--markdown``/``--junit`` path (``args.markdown``, ``args.junit``)
    that cannot be written, is one of the ``inputs``, or is one of the command's other ``outputs``."""
    mine = {flag: getattr(args, flag[2:], None) for flag in ("--markdown", "--junit")}
    mine = {flag: path for flag, path in mine.items() if path}
    for flag, path in mine.items():
        check_writable(path, flag)
    check_outputs_spare_inputs(dict(mine), {f"the input {p}": p for p in inputs if p})
    others = {os.path.realpath(p): p for p in outputs if p}
    for flag, path in mine.items():
        if os.path.realpath(path) in others:
            raise QDebugError(
                f"{flag} {path} is also another output of this command",
                f"give {flag} a path of its own",
                ExitCode.USAGE,
            )


def write_ci_outputs(args: Any, record: object, **options: Any) -> None:
    """Write the files ``args.markdown`` and ``args.junit`` ask for (when set) from a command's record: a
    :class:`Report` (``options``: ``top``), :class:`Proposal` (``met``, ``target``), :class:`VerifyResult`
    (the only one with JUnit), :class:`BenchReport` or :class:`DiffReport` (``top``)."""
    markdown, junit = getattr(args, "markdown", None), getattr(args, "junit", None)
    if markdown:
        render = {
            Report: report_markdown,
            Proposal: proposal_markdown,
            VerifyResult: verify_markdown,
            BenchReport: bench_markdown,
            DiffReport: diff_markdown,
            Comparison: comparison_markdown,
        }[type(record)]
        write_markdown(markdown, render(record, **options))  # type: ignore[operator]
    if junit:
        if not isinstance(record, VerifyResult):
            raise TypeError(f"no JUnit output for {type(record).__name__}")
        write_junit(junit, verify_junit(record))


def write_markdown(path: str | Path, text: str) -> None:
    """Write a Markdown summary atomically; added to the step summary when ``path`` is that file."""
    summary = os.environ.get(STEP_SUMMARY)
    target = Path(path)
    if summary and target.is_file() and os.path.realpath(target) == os.path.realpath(summary):
        old = target.read_text(encoding="utf-8")
        text = old + ("\n" if old and not old.endswith("\n") else "") + ("\n" if old else "") + text
    atomic_write_text(target, text)


def write_junit(path: str | Path, xml: str) -> None:
    """Write a JUnit XML file atomically."""
    atomic_write_text(path, xml)


# --------------------------------------------------------------------------- Markdown pieces


def cell(text: object) -> str:
    """Text for a Markdown table cell: ``|`` escaped, line breaks folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def code(name: str) -> str:
    """A node or tensor name as inline code, whatever backticks it holds."""
    ticks = "``" if "`" in name else "`"
    pad = " " if name.startswith("`") or name.endswith("`") else ""
    return f"{ticks}{pad}{name}{pad}{ticks}"


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[int] = ()) -> str:
    """A GitHub-flavoured Markdown table; ``right``: indices of right-aligned (number) columns."""
    right = set(right)
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |"]
    lines.append("|" + "|".join("---:" if i in right else "---" for i in range(len(columns))) + "|")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _details(title: str, items: Sequence[str]) -> str:
    """A collapsed list (notes): out of the way in a PR comment, one click away."""
    if not items:
        return ""
    body = "\n".join(f"- {cell(i)}" for i in items)
    return f"\n<details><summary>{title} ({len(items)})</summary>\n\n{body}\n\n</details>\n"


def _drop(name: str, fp32: float, quantized: float) -> str:
    if not (math.isfinite(fp32) and math.isfinite(quantized)):
        return "-"
    share = name in ACCURACY_METRICS
    return f"{(fp32 - quantized) * (100 if share else 1):.2f}" + (" points" if share else "")


# --------------------------------------------------------------------------- one summary per command


def report_markdown(report: Report, top: int = 10) -> str:
    """``analyze``: the task metric, the outputs' SQNR and the worst nodes by the noise they add."""
    out = [f"## qdebug analyze: {code(Path(report.model.path).name)}\n\n"]
    t = report.task
    if t is not None:
        out.append(table(("metric", "FP32", "quantized", "drop"),
                         [(f"{t.name} ({t.samples} {t.data} samples)", fmt_metric(t.name, t.fp32),
                           fmt_metric(t.name, t.quantized), _drop(t.name, t.fp32, t.quantized))],
                         right=(1, 2, 3)))  # fmt: skip
    scored = [o for o in report.outputs if o.error.count]
    if scored:
        out.append("\n" + table(("output", "SQNR dB", "max-abs"),
                                [(code(o.name), fmt_db(o.error.sqnr_db), f"{o.error.max_abs:.4g}") for o in scored],
                                right=(1, 2)))  # fmt: skip
    ranked = rank_nodes(report.nodes)[:top]
    folded = folded_into(report.nodes, report.tensors)
    if ranked:
        out.append(f"\n**Worst {len(ranked)} nodes by the noise they add** ({report.samples} samples)\n\n")
        rows = [
            (code(n.name), n.op_type if n.quantized else f"{n.op_type} ({'folded' if n.name in folded else 'float'})",
             fmt_db(n.added_noise_db), _introduced(n), fmt_db(n.local_sqnr_db),
             fmt_db(n.accumulated_sqnr_db), "-" if math.isnan(n.kl) else f"{n.kl:.3g}")
            for n in ranked
        ]  # fmt: skip
        cols = ("node", "op", "added noise dB", "introduced dB", "local SQNR", "accum. SQNR", "KL")
        out.append(table(cols, rows, right=range(2, 7)))
    out.append(samples_markdown(report.per_sample))
    out.append(_details("notes", report.notes))
    return "".join(out)


def samples_markdown(section: SampleSection | None, top: int = 5) -> str:
    """The per-sample drill-down: the flip counts and the ``top`` worst flips as a table ("" without it)."""
    if section is None or not section.variants:
        return ""
    lines = section.summary_lines(0)
    out = [f"\n**{cell(lines[0].rstrip(':'))}**\n\n", "".join(f"- {cell(line)}\n" for line in lines[1:])]
    last = section.variants[-1]
    if last.flips and top > 0:
        cols = ("sample", "input", "change", "output SQNR", "diverges most at", "clipped")
        out.append(f"\nthe {min(top, len(last.flips))} worst ({last.name}):\n\n")
        out.append(table(cols, [section.flip_cells(f) for f in last.flips[:top]], right=(3,)))
    return "".join(out)


def _introduced(n: NodeRecord) -> str:
    """``(exact input)`` where ``introduced_db`` is only the cap minus the output's SQNR (as the CLI summary
    says it), else the number."""
    return "(exact input)" if from_exact_input(n) else fmt_db(n.introduced_db)


def proposal_markdown(proposal: Proposal, met: bool | None = None, target: str = "") -> str:
    """``propose``: the target and whether it was met, FP32 / static / selective, and every change."""
    p = proposal
    verdict = "" if met is None else (" -> **MET**" if met else " -> **NOT MET**")
    out = [f"## qdebug propose: {cell(target) or 'proposal'}{verdict}\n\n"]
    on = f" ({p.eval_samples} eval samples)" if p.eval_samples else ""
    out.append(table(("metric", "FP32", "static", "selective"),
                     [(f"{p.metric}{on}", fmt_metric(p.metric, p.fp32_metric), fmt_metric(p.metric, p.static_metric),
                       fmt_metric(p.metric, p.expected_metric))], right=(1, 2, 3)))  # fmt: skip
    share = f" ({100 * len(p.nodes_to_exclude) / p.quantizable_nodes:.1f}%)" if p.quantizable_nodes else ""
    out.append(f"\nnodes kept FP32: {len(p.nodes_to_exclude)} of {p.quantizable_nodes} quantizable{share}; "
               f"tensor overrides: {len(p.tensor_overrides)}; per-channel: {p.per_channel}; "
               f"{p.evaluations} evaluation{'' if p.evaluations == 1 else 's'}\n")  # fmt: skip
    if p.reasons:
        rows = [(code(r.node) if r.node else "(whole model)", r.op_type, r.action,
                 "-" if math.isnan(r.introduced_db) else f"{r.introduced_db:.1f}", r.reason.split("; ")[0])
                for r in p.reasons]  # fmt: skip
        out.append("\n" + table(("node", "op", "action", "introduced dB", "why"), rows, right=(3,)))
    return "".join(out)


def _verify_rows(result: VerifyResult) -> list[tuple[str, ...]]:
    cols = result.variants
    rows = [
        (result.metric, *(fmt_metric(result.metric, v.metric) for v in cols)),
        ("output SQNR dB", *(fmt_db(v.output_sqnr_db) for v in cols)),
        ("nodes FP32", *("all" if v.name == "fp32" else f"{v.nodes_excluded} ({100 * v.excluded_share:.1f}%)"
                         for v in cols)),  # fmt: skip
        ("tensor overrides", *(str(v.tensor_overrides) for v in cols)),
        ("Q/DQ pairs", *(str(v.qdq_pairs) for v in cols)),
        ("size", *(fmt_binary_size(v.size_bytes) for v in cols)),  # KiB, as verify's own table prints them
    ]
    if any(_float_weights(v) != "-" for v in cols):
        rows.append(("float weights", *(_float_weights(v, fmt_binary_size) for v in cols)))
    if all(v.timing is not None for v in cols):
        rows += [
            ("latency p50 ms", *(f"{v.timing.p50_ms:.3f}" for v in cols if v.timing)),
            ("latency p95 ms", *(f"{v.timing.p95_ms:.3f}" for v in cols if v.timing)),
            ("throughput /s", *(f"{v.timing.throughput:.0f}" for v in cols if v.timing)),
        ]
        speed = speed_row(cols)
        rows += [("speed vs FP32", *speed)] if speed else []
    return rows


def _float_weights(v: object, size=fmt_size) -> str:
    """The variant's float weights and their share of its weights (``-``: not in this file); ``size`` formats
    the bytes (verify's own size formatter, or bench's: both KiB/MiB)."""
    floats, total = getattr(v, "float_weight_bytes", None), getattr(v, "weight_bytes", None)
    if floats is None or not total:
        return "-"
    return f"{size(floats)} ({floats / total:.0%})" if floats else "none"


def verify_markdown(result: VerifyResult) -> str:
    """``verify``: PASS/FAIL/UNDECIDED, the verdict line, FP32 / static / selective side by side, the
    intervals, one row per gate."""
    head = "PASS" if result.met else ("FAIL" if result.decided else "UNDECIDED")
    out = [f"## qdebug verify: {head}\n\n> {cell(result.verdict)}\n\n"]
    scored = f"{metric_title(result.metric)} on {result.samples} samples"
    out.append(f"{scored}; {result.quantizable_nodes} quantizable nodes\n\n")
    if result.variants:
        out.append(table(("", *(v.name for v in result.variants)), _verify_rows(result),
                         right=range(1, len(result.variants) + 1)))  # fmt: skip
    if result.noise_line():
        out.append(f"\n{cell(result.noise_line())}\n")
    gates = verify_gates(result)
    if gates:
        rows = [(g.name, "pass" if g.passed else ("**FAIL**" if g.decided else "undecided"), g.detail) for g in gates]
        out.append("\n" + table(("gate", "result", "measured"), rows))
    out.append(samples_markdown(result.per_sample))
    out.append(_details("notes", result.notes))
    return "".join(out)


def bench_markdown(report: BenchReport) -> str:
    """``bench``: one row per variant (size, latency, throughput, speed-up, memory, accuracy)."""
    m = report.machine
    out = [f"## qdebug bench: {code(Path(report.model).name)}\n\n"]
    flags = ", ".join(m.int8_flags) or "none"
    out.append(
        f"{cell(m.cpu_model)} ({m.arch}, {m.cpus_available} CPUs), INT8 flags: {flags}; ORT {m.ort_version}; "
        f"{report.samples} samples in batches of {report.batch_size}, {report.runs} timed passes\n\n"
    )
    cols = ("variant", "size", "float wts", "p50 ms", "p95 ms", "p99 ms", "samples/s", "speedup", "peak RSS MiB",
            report.metric, "out SQNR dB")  # fmt: skip
    rows = []
    for v in report.variants:
        if v.error or v.full is None:
            rows.append((v.name, fmt_size(v.model_bytes), _float_weights(v), "failed", *[""] * 7))
            continue
        f = v.full
        rows.append((v.name, fmt_size(v.model_bytes), _float_weights(v), _ms(f.p50_ms), _ms(f.p95_ms), _ms(f.p99_ms),
                     f"{f.throughput:.1f}", "-" if not math.isfinite(v.speedup) else f"{v.speedup:.2f}x",
                     "-" if not math.isfinite(v.peak_rss_mb) else f"{v.peak_rss_mb:.0f}",
                     fmt_metric(report.metric, v.metric_value), fmt_db(v.output_sqnr_db)))  # fmt: skip
    out.append(table(cols, rows, right=range(1, len(cols))))
    errors = [f"{v.name} failed: {v.error}" for v in report.variants if v.error]
    notes = [*errors, *(f"{v.name}: {n}" for v in report.variants for n in v.notes), *report.notes]
    if m.warning:
        notes.insert(0, m.warning)
    out.append(_details("notes", notes))
    return "".join(out)


def _ms(x: float) -> str:
    return "-" if not math.isfinite(x) else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def diff_markdown(diff: DiffReport, top: int = 10) -> str:
    """``diff``: both reports, the settings that differ, the task and outputs, the biggest changes."""
    out = [f"## qdebug diff: {code(Path(diff.a.path).name)} vs {code(Path(diff.b.path).name)}\n\n"]
    out.append("".join(f"- {cell(line)}\n" for line in diff.header_lines()))
    rows = diff.table_rows(top)
    if rows:
        out.append(f"\n**{len(rows)} of {len(diff.nodes)} paired nodes, biggest change of added noise first "
                   "(B - A)**\n\n")  # fmt: skip
        out.append(table(TABLE_COLUMNS, [(code(node_label(n)), *cells) for n, cells in rows], right=range(2, 8)))
    only = [f"only in {s}: {', '.join(names)}" for s, names in (("A", diff.only_in_a), ("B", diff.only_in_b)) if names]
    out.append(_details("notes", [*only, *diff.notes]))
    return "".join(out)


def comparison_markdown(c: Comparison, top: int = 10) -> str:
    """Three or more reports: each one's task metric and wins, the tensors with the biggest margins."""
    out = [f"## qdebug diff: {' vs '.join(code(label) for label in c.labels)}\n\n"]
    out.append("".join(f"- {cell(line)}\n" for line in comparison_header(c)))
    rows = comparison_rows(c, top)
    if rows:
        out.append(f"\n**{len(rows)} of {len(c.tensors)} tensors, biggest margin first**\n\n")
        out.append(table(COMPARISON_COLUMNS, [(code(r[0]), *r[1:]) for r in rows], right=range(2, 5)))
    out.append(_details("notes", list(c.notes)))
    return "".join(out)


# --------------------------------------------------------------------------- JUnit


@dataclass(frozen=True)
class Gate:
    """One gate verify judged."""

    name: str
    passed: bool
    detail: str
    """The part of the verdict line about this gate."""
    decided: bool = True
    """False: neither passed nor failed beyond the noise (its interval straddles the target)."""


def verify_gates(result: VerifyResult) -> list[Gate]:
    """The gates a verify result was judged by, each passed, failed or undecided (as
    :func:`qdebug.verify.assess` judges: by the estimate and its interval when the record has one).

    The drop target (``--target-drop``) or else the recovery target, when FP32 has a value; the output
    SQNR target when one was given. Whatever they say, a result that met its target has no gate that did
    not pass, one that missed it beyond the noise at least one failed gate, and an undecided one at least
    one undecided gate and no failed one: the JUnit file never disagrees with the exit code.

    A record that holds its gates (``gates``, written by this version) is read as judged; the rules below
    re-judge one written before the field, from its numbers.
    """
    if result.gates:
        return [Gate(g.name, g.side > 0, g.text, g.side != 0) for g in result.gates]
    try:
        fp32, static, sel = (result.variant(n) for n in ("fp32", "static", "selective"))
    except KeyError:
        return [Gate("verify", result.met, result.verdict, result.met or result.decided)]
    gates = [g for g in (_target_gate(result, fp32.metric, static.metric, sel.metric), _sqnr_gate(result, sel))
             if g is not None]  # fmt: skip
    if not gates:
        return [Gate("verify", result.met, result.verdict, result.met or result.decided)]
    # judged otherwise than mirrored here: the record's verdict wins
    if result.met:
        return [Gate(g.name, True, g.detail) for g in gates]
    if not result.decided:
        gates = [Gate(g.name, False, g.detail, g.decided and g.passed) for g in gates]
        if all(g.decided for g in gates):
            gates[0] = Gate(gates[0].name, False, gates[0].detail, False)
        return gates
    gates = [Gate(g.name, g.passed and g.decided, g.detail) if not g.decided else g for g in gates]
    if all(g.passed for g in gates):
        gates[0] = Gate(gates[0].name, False, gates[0].detail)
    return gates


def _judged(estimate: float, interval: tuple[float, float], passes: Any) -> tuple[bool, bool]:
    """(passed, decided) of a gate: by the estimate alone without an interval, else passed when the
    estimate and both bounds pass and decided when they agree (verify's rule, re-stated)."""
    if math.isnan(interval[0]) or math.isnan(interval[1]):
        return bool(passes(estimate)), True
    verdicts = {bool(passes(x)) for x in (interval[0], estimate, interval[1])}
    return verdicts == {True}, len(verdicts) == 1


def _bounds(interval: tuple[float, float], fmt: Any, result: VerifyResult) -> str:
    """`` [95%: 0.20 to 1.40]`` after a gate's measurement (nothing without an interval)."""
    if math.isnan(interval[0]):
        return ""
    return f" [{100 * result.confidence:g}%: {fmt(interval[0])} to {fmt(interval[1])}]"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%" if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _target_gate(result: VerifyResult, fp32: float, static: float, sel: float) -> Gate | None:
    """The drop gate (``--target-drop``), else the recovery gate; ``None`` when FP32 has no value to judge by."""
    metric = result.metric
    if not math.isnan(result.target_drop):
        scale = 100.0 if metric in ACCURACY_METRICS else 1.0
        unit = " points" if scale == 100.0 else ""
        name = f"{metric_title(metric)} drop vs FP32 <= {result.target_drop:g}{unit}"
        if not math.isfinite(fp32):
            return Gate(name, False, f"no FP32 value of {metric_title(metric)} to measure a drop from")
        drop = (fp32 - sel) * scale
        iv = result.drop_interval
        passed, decided = _judged(drop, iv, lambda x: x <= result.target_drop + 1e-9)
        detail = f"the selective model is {drop:.2f}{unit} below FP32{_bounds(iv, lambda x: f'{x:.2f}', result)}"
        return Gate(name, passed, detail, decided)
    if not math.isfinite(fp32):
        return None
    name = f"{metric_title(metric)} recovery >= {100 * result.min_recovery + 0.0:.4g}%"
    if math.isfinite(static) and fp32 - static > 1e-12:
        recovered, iv = result.recovered_fraction, result.recovery_interval
        passed, decided = _judged(recovered, iv, lambda x: x >= result.min_recovery - 1e-12)
        return Gate(name, passed, f"recovered {100 * recovered:.2f}% of the loss{_bounds(iv, _pct, result)}", decided)
    ok = sel >= min(static, fp32) - 1e-12
    return Gate(name, ok, "static lost nothing; the selective model is " + ("not worse" if ok else "worse"))


def _sqnr_gate(result: VerifyResult, sel: object) -> Gate | None:
    target = result.target_sqnr_db
    if math.isnan(target):
        return None
    sqnr = getattr(sel, "output_sqnr_db", math.nan)
    name, iv = f"output SQNR >= {target:g} dB", result.sqnr_interval
    if math.isnan(sqnr):
        return Gate(name, False, "the selective model's output SQNR is undefined")
    passed, decided = _judged(sqnr, iv, lambda x: x >= target - 1e-12)
    return Gate(name, passed, f"the selective model's output SQNR is {fmt_db(sqnr)} dB{_bounds(iv, fmt_db, result)}",
                decided)  # fmt: skip


def verify_junit(result: VerifyResult, suite: str = "qdebug verify") -> str:
    """JUnit XML (``testsuites/testsuite/testcase[/failure]``, with ``tests``/``failures`` counts): one test
    case per gate of :func:`verify_gates`; a failed one's ``failure`` message is the verdict line, its text
    the side-by-side table."""
    gates = verify_gates(result)
    failures = sum(1 for g in gates if not g.passed and g.decided)
    skipped = sum(1 for g in gates if not g.decided)
    counts = {"tests": str(len(gates)), "failures": str(failures), "errors": "0"}
    seconds = f"{result.seconds:.3f}" if math.isfinite(result.seconds) else "0"
    root = ET.Element("testsuites", {"name": suite, **counts, "time": seconds})  # junit-10.xsd: no skipped here
    name = f"{suite} {Path(result.model_path).name}"
    ts = ET.SubElement(root, "testsuite", {"name": name, **counts, "skipped": str(skipped), "time": seconds})
    props = ET.SubElement(ts, "properties")
    for key, value in (("model", result.model_path), ("model_sha256", result.model_sha256),
                       ("proposal", result.proposal), ("metric", result.metric), ("samples", str(result.samples)),
                       ("verdict", result.verdict)):  # fmt: skip
        ET.SubElement(props, "property", {"name": key, "value": value})
    table_text = "\n".join(result.summary_lines()) if result.variants else result.verdict
    for g in gates:
        case = ET.SubElement(ts, "testcase", {"classname": "qdebug.verify", "name": g.name, "time": "0"})
        if not g.decided:  # neither passed nor failed: the interval straddles the target (exit 8)
            ET.SubElement(case, "skipped", {"message": result.verdict}).text = f"{g.detail}\n\n{table_text}\n"
        elif not g.passed:
            failure = ET.SubElement(case, "failure", {"message": result.verdict, "type": "TargetNotMet"})
            failure.text = f"{g.detail}\n\n{table_text}\n"
    out = ET.SubElement(ts, "system-out")
    out.text = "\n".join([table_text, *(f"note: {n}" for n in result.notes)]) + "\n"
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
