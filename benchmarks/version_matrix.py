"""Version matrix: the whole qdebug loop under each (onnxruntime, onnx) pair, with this working tree's qdebug.

For each pair it makes a virtual environment that sees this Python's packages
(``python -m venv --system-site-packages``) and installs only the pinned releases into it
(``pip install --no-deps onnxruntime==X onnx==Y [numpy==Z ...]``), so the pins shadow the global ones; it
checks that ``import onnxruntime, onnx, numpy`` really gives the pinned versions. Then, with
``PYTHONPATH`` at the repository root (this tree's qdebug, not an installed one), it runs in a fresh
folder: ``qdebug demo``, and ``analyze``, ``propose``, ``verify``, ``bench`` on the committed fixture
``fixtures/cnn`` (model.onnx, calib.npz, eval.npz), recording each step's exit code and wall time.

A step *ran* when it exits 0, or 6 / 8 (target not met / undecided: verdicts, not failures). It *crashed*
on exit 1 or a Python traceback, and *failed* on any other exit code (the one-line error is listed under
the table). A raw Python warning on stderr (``file.py:123: SomeWarning: ...``) is listed too: users should
never see one. Steps after a failed one are not run (``-``).

Usage:
  python benchmarks/version_matrix.py                        # the default spread (minutes; downloads wheels)
  python benchmarks/version_matrix.py 1.20.1:1.16.0 1.32.0:1.23.2:numpy==1.26.4 --out table.md
  python benchmarks/version_matrix.py --venv-root /tmp/qdebug-venvs --keep-venvs   # reuse venvs next time

Each argument is ``ORT:ONNX`` followed by any further ``:package==version`` pins (numpy, scipy...).
Venvs live under ``--venv-root`` (default: a temporary folder, removed at the end unless ``--keep-venvs``),
never in the repository. Writes the Markdown table to stdout, and to ``--out`` when given
(docs/versions.md holds the last one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "fixtures" / "cnn"

DEFAULT_SPECS = (
    "1.20.1:1.23.2",
    "1.22.1:1.23.2",
    "1.23.2:1.23.2",
    "1.24.4:1.23.2",
    "1.26.0:1.23.2",
    "1.28.0:1.23.2",
    "1.30.0:1.23.2",
    "1.31.1:1.23.2",
    "1.32.0:1.23.2",
    "1.20.1:1.16.0",
    "1.32.0:1.16.0",
    "1.20.1:1.16.0:numpy==1.24.0:scipy==1.11.4",
)
"""ORT releases across the supported range with the newest onnx (1.23.2: the last without a ConvInteger kernel
for int8 weights), the oldest supported onnx with the oldest and newest ORT, and the oldest numpy with the
oldest of both (scipy pinned to a release that takes it)."""

REPORTED = ("onnxruntime", "onnx", "numpy", "scipy")
"""Packages whose imported version every row shows, pinned or not."""
STEPS = ("demo", "analyze", "propose", "verify", "bench")
RAN = (0, 6, 8)
"""Exit codes of a step that ran: success, target not met, undecided (README, "Exit codes")."""

_WARNING_LINE = re.compile(r"^\S+\.py:\d+: \w*Warning: ", re.MULTILINE)


@dataclasses.dataclass
class Step:
    """One command's outcome."""

    name: str
    code: int | None = None
    """Exit code; None: not run (an earlier step failed), -1: past the timeout."""
    seconds: float = 0.0
    error: str = ""
    """The last line of stderr when the step did not run through."""
    warnings: list[str] = dataclasses.field(default_factory=list)
    """Raw Python warnings printed on stderr."""
    traceback: bool = False

    def ran(self) -> bool:
        """True when the step ran to a verdict (exit 0, 6 or 8, no traceback)."""
        return self.code in RAN and not self.traceback

    def cell(self) -> str:
        """The table cell: exit code and wall time, or what went wrong."""
        if self.code is None:
            return "-"
        if self.code == -1:
            return f"timeout {self.seconds:.0f} s"
        mark = "" if self.ran() else (" **crash**" if self.traceback or self.code == 1 else " **fail**")
        return f"{self.code}{mark} · {self.seconds:.1f} s"


@dataclasses.dataclass
class Row:
    """One version pair: what was asked, what was imported, and the steps."""

    spec: str
    pins: dict[str, str]
    imported: dict[str, str] = dataclasses.field(default_factory=dict)
    setup_error: str = ""
    steps: list[Step] = dataclasses.field(default_factory=list)
    fast: str = ""
    """Whether analyze's quantizer ran on qdebug's fast path ("yes") or ORT's own ("no": the report's note)."""


def parse_spec(spec: str) -> dict[str, str]:
    """``"1.20.1:1.16.0:numpy==1.24.4"`` -> ``{"onnxruntime": "1.20.1", "onnx": "1.16.0", "numpy": "1.24.4"}``."""
    ort, onnx_version, *more = spec.split(":")
    pins = {"onnxruntime": ort, "onnx": onnx_version}
    for item in more:
        name, _, version = item.partition("==")
        if not version:
            raise SystemExit(f"version_matrix: {item!r} in {spec!r} is not package==version")
        pins[name.strip()] = version.strip()
    return pins


def venv_for(pins: dict[str, str], root: Path, log: Path) -> tuple[Path, str]:
    """A venv seeing this Python's packages, with ``pins`` installed over them; (its python, an error)."""
    name = "_".join(f"{k}-{v}" for k, v in pins.items())
    folder = root / name
    python = folder / "bin" / "python"
    done = folder / ".pinned"
    if not done.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        made = subprocess.run(
            [sys.executable, "-m", "venv", "--system-site-packages", str(folder)], capture_output=True, text=True
        )
        if made.returncode:
            return python, f"venv failed: {_last_line(made.stderr)}"
        wanted = [f"{k}=={v}" for k, v in pins.items()]
        pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", *wanted]
        installed = subprocess.run(pip, capture_output=True, text=True)
        log.write_text(installed.stdout + installed.stderr)
        if installed.returncode:
            return python, f"pip failed: {_last_line(installed.stderr)}"
        done.write_text(json.dumps(pins))
    return python, ""


def imported_versions(python: Path, names: list[str]) -> dict[str, str]:
    """The version each module reports when imported by ``python`` (outside the repository)."""
    code = (
        "import importlib, json, sys\n"
        "out = {}\n"
        f"for name in {names!r}:\n"
        "    try:\n"
        "        out[name] = importlib.import_module(name).__version__\n"
        "    except Exception as e:\n"
        "        out[name] = f'import failed: {e.__class__.__name__}: {e}'\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir())
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {name: f"python failed: {_last_line(proc.stderr)}" for name in names}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_loop(python: Path, work: Path, timeout: float) -> list[Step]:
    """The five steps in ``work``, each stopped at ``timeout`` seconds; the first failure ends the loop."""
    data = ["--calib", str(FIXTURE / "calib.npz"), "--eval", str(FIXTURE / "eval.npz")]
    model = str(FIXTURE / "model.onnx")
    commands = {
        "demo": ["demo", "--output-dir", "demo", "-q"],
        "analyze": ["analyze", model, *data, "-o", "report.json", "-q"],
        "propose": ["propose", "report.json", "-o", "proposal.json", "-q"],
        "verify": ["verify", model, *data, "--proposal", "proposal.json", "-q"],
        "bench": ["bench", model, *data, "--proposal", "proposal.json", "-o", "bench.json", "-q"],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the warnings filters a user has
    env.pop("QDEBUG_PLAIN_QUANTIZER", None)
    steps: list[Step] = []
    failed = False
    for name in STEPS:
        step = Step(name)
        steps.append(step)
        if failed:
            continue
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [str(python), "-m", "qdebug", *commands[name]],
                cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            step.code, step.seconds, failed = -1, time.perf_counter() - start, True
            continue
        step.seconds = time.perf_counter() - start
        step.code = proc.returncode
        (work / f"{name}.stderr.txt").write_text(proc.stderr)
        step.traceback = "Traceback (most recent call last)" in proc.stderr
        step.warnings = [_last_line(m.group(0) + proc.stderr[m.end() :].split("\n", 1)[0])
                         for m in _WARNING_LINE.finditer(proc.stderr)]  # fmt: skip
        if not step.ran():
            errors = [line for line in proc.stderr.splitlines() if line.startswith("qdebug: error:")]
            errors += [line for line in proc.stdout.splitlines() if " failed: " in line]  # bench's variants
            step.error = errors[0][:300] if errors else _last_line(proc.stderr)
            failed = True
    return steps


def fast_path_note(work: Path) -> str:
    """The note analyze's report carries when ORT's quantizer ran on its plain path ("" when none)."""
    try:
        notes = json.loads((work / "report.json").read_text()).get("notes", [])
    except (OSError, json.JSONDecodeError):
        return ""
    return next((n for n in notes if n.startswith("ORT's own quantizer ran")), "")


def machine() -> str:
    """The CPU model and core count (``lscpu``), the OS and Python."""
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), model
        )
    except OSError:
        pass
    return (
        f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, Python {platform.python_version()}"
    )


def table(rows: list[Row]) -> str:
    """The Markdown table, the failures under it."""
    extra = [*REPORTED[2:], *sorted({k for row in rows for k in row.pins} - set(REPORTED))]
    head = ["onnxruntime", "onnx", *extra, *STEPS, "whole loop", "fast quantizer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    footnotes: list[str] = []
    for row in rows:
        shown = [(k, row.imported.get(k, row.pins.get(k, ""))) for k in ("onnxruntime", "onnx", *extra)]
        versions = [f"**{v}**" if k in row.pins else v for k, v in shown]
        if row.setup_error:
            cells = ["-"] * len(STEPS) + [f"not set up: {row.setup_error}", "-"]
        else:
            ran = all(s.ran() for s in row.steps)
            warned = any(s.warnings for s in row.steps)
            verdict = "runs" if ran and not warned else ("runs, with Python warnings" if ran else "**breaks**")
            cells = [s.cell() for s in row.steps] + [verdict, row.fast or "-"]
            for s in row.steps:
                if s.error:
                    footnotes.append(f"- {row.spec} {s.name}: `{s.error}`")
                footnotes.extend(f"- {row.spec} {s.name} warned: `{w}`" for w in dict.fromkeys(s.warnings))
        lines.append("| " + " | ".join([*versions, *cells]) + " |")
    return "\n".join(lines + ([""] + footnotes if footnotes else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the matrix; exit 1 when a row breaks or could not be set up."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="*", default=list(DEFAULT_SPECS), help="ORT:ONNX[:package==version...]")
    parser.add_argument("--venv-root", type=Path, help="where the venvs go (default: a temporary folder)")
    parser.add_argument("--keep-venvs", action="store_true", help="leave the venvs for the next run")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per step (default 900)")
    parser.add_argument("--out", type=Path, help="also write the table (with its header) to this file")
    args = parser.parse_args(argv)

    root = args.venv_root or Path(tempfile.mkdtemp(prefix="qdebug-venvs-"))
    if root.resolve().is_relative_to(ROOT):
        parser.error("--venv-root must be outside the repository")
    root.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    try:
        for spec in args.specs:
            row = Row(spec, parse_spec(spec))
            rows.append(row)
            print(f"[version_matrix] {spec}: setting up", file=sys.stderr, flush=True)
            python, row.setup_error = venv_for(row.pins, root, root / f"pip-{len(rows)}.log")
            if not row.setup_error:
                row.imported = imported_versions(python, list(dict.fromkeys([*row.pins, *REPORTED])))
                wrong = {k: v for k, v in row.imported.items() if k in row.pins and v != row.pins[k]}
                if wrong:
                    row.setup_error = f"imported {wrong}, not the pins"
            if row.setup_error:
                print(f"[version_matrix] {spec}: {row.setup_error}", file=sys.stderr, flush=True)
                continue
            with tempfile.TemporaryDirectory(prefix="qdebug-matrix-") as work:
                row.steps = run_loop(python, Path(work), args.timeout)
                note = fast_path_note(Path(work))
                if row.steps[1].ran():
                    row.fast = "no" if note else "yes"
            codes = " ".join(s.cell() for s in row.steps)
            print(f"[version_matrix] {spec}: {codes}{' | ' + note if note else ''}", file=sys.stderr, flush=True)
    finally:
        if not args.keep_venvs and not args.venv_root:
            shutil.rmtree(root, ignore_errors=True)
    command = "python benchmarks/version_matrix.py" + (
        "" if args.specs == list(DEFAULT_SPECS) else " " + " ".join(args.specs)
    )
    header = (
        f"`{command}` -- {time.strftime('%Y-%m-%d')}, qdebug at this tree, on {machine()}; cells: exit code · "
        "wall time (0 success, 6 target not met, 8 undecided: all three ran); fast quantizer: whether analyze "
        "quantized with qdebug's indexed copy of ORT's quantizer (yes) or, its sources differing from the "
        "verified ones, with ORT's own (no: same models, slower on large graphs); **bold**: pinned in the row's "
        "venv, the others are the base environment's\n\n"
    )
    text = header + table(rows)
    print(text)
    if args.out:
        args.out.write_text(text)
    broken = any(r.setup_error or not all(s.ran() for s in r.steps) for r in rows)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
