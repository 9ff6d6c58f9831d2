#!/usr/bin/env python3
"""Benchmark ``qdebug propose`` against planted culprits (issue 15's proof).

Usage::

    python benchmarks/bench_diagnosis.py [--kinds detector_concat,two_culprits] [--size bench]
        [--out results.json] [--keep DIR] [--no-verify] [--runs 30] [--timeout 600]

For every kind of ``fixtures/planted.py`` (a generated model with a known minimal culprit set, or a
known whole-model recipe that meets the target where no small set does),
generates the model, then runs the CLI as a user would:

1. ``qdebug analyze MODEL --calib C --eval E --metric M -o report.json -q``
2. ``qdebug propose report.json --target-drop D -o P -q`` for two variants: the default ``--allow``
   and ``--allow fp32,int16,per-channel``. ``D`` is one point in the metric's units: 1 for top1 /
   top1_agreement (qdebug counts points), 0.01 for the detectors' custom class agreement in [0, 1]
   (qdebug takes a custom metric's drop in raw units).
3. ``qdebug verify MODEL --calib C --eval E --proposal P --metric M --target-drop D -o V -q`` for the
   selective model's metric and latency (p50) vs FP32 and full static.

Prints a markdown table (kind | quantizable nodes | planted | proposed | evaluations | wall s |
metric FP32 / static / selective | selective p50 vs FP32) and writes every number to ``--out``.
``proposed`` reads: ``= planted`` (exactly the planted set), ``⊇ planted +k`` (the planted set and
k more nodes), ``misses m`` (m planted nodes not in it), ``int16``/``per-channel`` tensor fixes
counted apart. The target is met when the selective metric is within one point of FP32.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "fixtures"))

import planted  # noqa: E402  (fixtures/planted.py: the generators)

RECIPE_FIXES = ("equalize", "smooth", "bias-correction", "mixed", "dynamic", "percentile")
"""The planted kinds whose remedy is a whole-model recipe (no culprit set): propose should answer with it
(``percentile``: each long-tailed activation clipped to its percentile range, propose's whole-model clip fix)."""

VARIANTS = {"default": None, "fp32,int16,per-channel": "fp32,int16,per-channel"}
"""propose's ``--allow`` variants: its default, and every fix it offers."""


def _cli(args: list[str], cwd: Path, timeout: float) -> tuple[int, float, str]:
    """Run ``python -m qdebug ARGS``; (exit code, wall seconds, stderr tail)."""
    cmd = [sys.executable, "-m", "qdebug", *args]
    # this tree's qdebug, not whatever copy is installed (the commands run in the work folder)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return 124, time.perf_counter() - t0, f"timed out after {timeout:.0f} s"
    tail = (p.stderr or "").strip().splitlines()[-3:]
    return p.returncode, time.perf_counter() - t0, " | ".join(tail)


def _compare(proposed: list[str], overrides: list[dict[str, Any]], planted_set: list[str]) -> str:
    """How the proposal relates to the planted set.

    In the planted graphs every tensor is named after the node that computes it, so an int16
    override of tensor T is a cheaper fix of node T: it counts as touching T. The other overrides
    (clipped ranges, per-channel or 7-bit weights) keep their nodes INT8 and are counted by kind.
    """
    got, want = set(proposed), set(planted_set)
    o16 = {o.get("tensor", "") for o in overrides if o.get("quant_type")}
    clipped = sum(1 for o in overrides if o.get("rmin") is not None and not o.get("quant_type"))
    weights = sum(1 for o in overrides if o.get("rmin") is None and not o.get("quant_type"))
    touched = got | o16
    size = len(got) + len(o16)
    parts = [f"{len(got)} fp32"] + ([f"{len(o16)} int16"] if o16 else [])
    parts += [f"{clipped} clipped ranges"] if clipped else []
    parts += [f"{weights} weight overrides"] if weights else []
    txt = " + ".join(parts)
    if not want:
        return f"{txt} (none planted)"
    missing = want - touched
    if touched == want:
        rel = "= planted" if not o16 else "planted nodes, int16 where it sufficed"
    elif not missing:
        rel = f"⊇ planted +{len(touched - want)}"
    elif touched <= want:
        rel = f"{len(want) - len(missing)} of {len(want)} planted, nothing else"
    else:
        rel = f"misses {len(missing)} of {len(want)}, +{len(touched - want)} other"
    if size < len(want) and not missing:
        rel += ", fewer units"
    return f"{txt} ({rel})"


def _p50(verify: dict[str, Any], name: str) -> float | None:
    for v in verify.get("variants", []):
        if v.get("name") == name and v.get("timing"):
            return float(v["timing"]["p50_ms"])
    return None


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def run_kind(kind: str, size: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Generate one planted model and run analyze / propose (both variants) / verify on it."""
    rec = planted.make(kind, work, size)
    row: dict[str, Any] = {"kind": kind, "size": size, "planted": rec.to_json(), "variants": {}}
    metric, drop = rec.metric, rec.target_drop
    data = ["--calib", rec.calib, "--eval", rec.eval, "--metric", metric]
    rc, secs, err = _cli(["analyze", rec.model, *data, "-o", "report.json", "-q"], work, args.timeout)
    row["analyze"] = {"rc": rc, "seconds": secs, "stderr": err}
    if rc != 0:
        return row
    for label, allow in VARIANTS.items():
        if args.variants != "both" and (label == "default") != (args.variants == "default"):
            continue
        stem = "proposal" if allow is None else "proposal_allow"
        cmd = ["propose", "report.json", "--target-drop", str(drop), "-o", f"{stem}.json", "-q"]
        if allow:
            cmd += ["--allow", allow]
        rc, secs, err = _cli(cmd, work, args.timeout)
        res: dict[str, Any] = {"rc": rc, "wall_seconds": secs, "stderr": err}
        ppath = work / f"{stem}.json"
        if ppath.is_file():
            p = json.loads(ppath.read_text())
            names = {r.get("node"): r.get("original_name") or r.get("node") for r in p.get("reasons", [])}
            nodes = [names.get(n, n) for n in p.get("nodes_to_exclude", [])]
            res.update(
                nodes_to_exclude=nodes,
                tensor_overrides=p.get("tensor_overrides", []),
                per_channel=p.get("per_channel"),
                evaluations=p.get("evaluations"),
                search_seconds=p.get("search_seconds"),
                expected_metric=p.get("expected_metric"),
                fp32_metric=p.get("fp32_metric"),
                static_metric=p.get("static_metric"),
                quantizable_nodes=p.get("quantizable_nodes"),
                recipe="+".join((p.get("recipe") or {}).get("steps") or []),
                compare=_compare(nodes, p.get("tensor_overrides", []), rec.culprits),
                reasons=[{k: r.get(k) for k in ("node", "op_type", "action", "reason")} for r in p.get("reasons", [])],
            )
            if args.verify:
                vcmd = ["verify", rec.model, *data, "--proposal", f"{stem}.json", "--target-drop", str(drop)]
                vcmd += ["-o", f"{stem}.verify.json", "--runs", str(args.runs), "-q"]
                vrc, vsecs, verr = _cli(vcmd, work, args.timeout)
                vpath = work / f"{stem}.verify.json"
                res["verify"] = {"rc": vrc, "seconds": vsecs, "stderr": verr}
                if vpath.is_file():
                    v = json.loads(vpath.read_text())
                    metrics = {x["name"]: x.get("metric") for x in v.get("variants", [])}
                    res["verify"].update(
                        met=v.get("met"),
                        verdict=v.get("verdict"),
                        metrics=metrics,
                        p50_ms={n: _p50(v, n) for n in ("fp32", "static", "selective")},
                    )
        row["variants"][label] = res
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table."""
    head = (
        "| kind | allow | quantizable nodes | planted | proposed | evaluations | wall s | "
        "metric FP32 / static / selective | met | selective p50 vs FP32 (static) |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        pl = r["planted"]
        planted_txt = ", ".join(f"`{c}`" for c in pl["culprits"]) or (
            "percentile ranges (whole-model clip)" if pl["fix"] == "percentile"
            else f"recipe {pl['fix']}" if pl["fix"] in RECIPE_FIXES else "none exists"
        )
        if not pl.get("reproduces", True):
            planted_txt += " (does not reproduce on this CPU)"
        if r["analyze"]["rc"] != 0:
            lines.append(f"| {r['kind']} | - | - | {planted_txt} | analyze failed (rc {r['analyze']['rc']}) |||||")
            continue
        for label, v in r["variants"].items():
            if "compare" not in v:
                lines.append(f"| {r['kind']} | {label} | - | {planted_txt} | propose rc {v['rc']}: {v['stderr']} |||||")
                continue
            prop = v["compare"] + (" + per-channel weights" if v.get("per_channel") else "")
            if v.get("recipe"):
                prop = f"recipe {v['recipe']}, " + prop.replace(" (none planted)", "")
            elif pl["fix"] in RECIPE_FIXES:  # a whole-model fix, no recipe: there is no planted node set
                prop = prop.replace(" (none planted)", "")
            ver = v.get("verify", {})
            ms = ver.get("metrics") or {}
            sel = ms.get("selective", v.get("expected_metric"))
            met = ver.get("met") if ver else (v["rc"] == 0)
            p50 = ver.get("p50_ms") or {}
            if p50.get("fp32") and p50.get("selective"):
                speed = f"{p50['selective'] / p50['fp32']:.2f}x ({p50['static'] / p50['fp32']:.2f}x)"
            else:
                speed = "-"
            metric_txt = f"{_fmt(v.get('fp32_metric'))} / {_fmt(v.get('static_metric'))} / {_fmt(sel)}"
            lines.append(
                f"| {r['kind']} | {label} | {v.get('quantizable_nodes')} | {planted_txt} | {prop} | "
                f"{v.get('evaluations')} | {v['wall_seconds']:.1f} | {metric_txt} | "
                f"{'yes' if met else 'no'} (rc {v['rc']}) | {speed} |"
            )
    notes = []
    for r in rows:
        for label, v in r.get("variants", {}).items():
            if v.get("rc") not in (0, None) and v.get("stderr"):
                notes.append(f"- {r['kind']} ({label}): propose exit {v['rc']}: {v['stderr']}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(planted.KINDS), help="comma list (default: all)")
    ap.add_argument("--size", choices=planted.SIZES, default="bench")
    ap.add_argument(
        "--variants",
        choices=("both", "default", "all"),
        default="both",
        help="propose's default --allow, --allow fp32,int16,per-channel ('all'), or both (default)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write every number here (JSON)")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (default: a temp dir)")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip qdebug verify (no latency)")
    ap.add_argument("--runs", type=int, default=30, help="verify's timed runs per variant (default: 30)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per qdebug command (default: 600)")
    ap.add_argument("--table-from", type=Path, default=None, help="only print the table of an earlier --out JSON")
    args = ap.parse_args(argv)
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())["rows"]))
        return 0
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in planted.KINDS]
    if unknown:
        ap.error(f"unknown kind(s) {unknown}; choose from {', '.join(planted.KINDS)}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench-diagnosis-"))
    rows = []
    t0 = time.perf_counter()
    for kind in kinds:
        t = time.perf_counter()
        row = run_kind(kind, args.size, root / kind, args)
        row["seconds"] = time.perf_counter() - t
        rows.append(row)
        print(f"[{kind}: {row['seconds']:.0f} s]", file=sys.stderr, flush=True)
    import onnxruntime

    env = {
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "vnni": planted._has_vnni(),
        "size": args.size,
        "total_seconds": time.perf_counter() - t0,
    }
    print(table(rows))
    print(
        f"\n{env['size']} size; onnxruntime {env['onnxruntime']}; {env['cpu_count']} CPU(s), VNNI: {env['vnni']}; "
        f"total {env['total_seconds']:.0f} s. Command: python benchmarks/bench_diagnosis.py "
        + " ".join(argv if argv is not None else sys.argv[1:])
    )
    if args.out:
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
