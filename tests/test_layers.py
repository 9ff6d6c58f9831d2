"""The layering of the package, read from its source (issue 17, LAYOUT.md section 7).

Every ``import`` statement under ``qdebug/`` counts: top-level ones, function-level (deferred) ones and those
under ``if TYPE_CHECKING:``. A deferred import hides a cycle from the interpreter, not from the design, and a
``TYPE_CHECKING`` one still ties the two modules together for whoever reads or moves them. Imports by
name at run time (``importlib.import_module``: the subcommand registry in ``cli/main.py``, the lazy public
API in ``qdebug/__init__.py``) are not statements and are not seen.

The layers, each allowed to import only the ones below it::

    front ends   cli/ (the composition root)   tui/ (light only)
    commands     pipeline (analyze)   propose/   verify/   bench/
    prelude      prepare
    engine       analysis/  quant/  recipes/  evaluation/  runtime/  data/  graph/  export/  specialize  versions
    light        records/  output/  progress  errors  graph/ops  diff  vocabulary

The light layer loads neither onnx nor onnxruntime: the TUI and the CLI printers are built on it. The
subprocess probe of that lives in ``tests/test_tui.py``
(``test_model_and_charts_do_not_import_textual_and_the_app_not_onnxruntime``); the one here adds the modules
that probe does not import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qdebug"

LIGHT = (
    "qdebug.records",
    "qdebug.output",  # files, report_io, formatting, snippet, ci_outputs: the light layer's files and text
    "qdebug.progress",
    "qdebug.errors",
    "qdebug.graph.ops",
    "qdebug.diff",  # two reports paired and compared: pure over records (the TUI's comparison column reads it)
    "qdebug.vocabulary",  # propose's fix kinds and recipes: what --allow and --recipes name, one registry
)
COMMANDS = ("qdebug.pipeline", "qdebug.propose", "qdebug.verify", "qdebug.bench")
MEASURING_CHILD = "qdebug.runtime.bench_child"
"""bench's measuring process: a leaf of the engine layer that imports nothing of qdebug (what it measures is
the model's memory), so verify may share its pure helpers."""
FRONT_ENDS = ("qdebug.cli", "qdebug.tui", "qdebug.__main__")
TUI_THIRD_PARTY = ("textual", "rich", "numpy")
GRAPH_MAY_IMPORT = ("qdebug.records", "qdebug.errors", "qdebug.output.files", "qdebug.progress", "qdebug.graph")


@dataclass(frozen=True)
class Import:
    """One imported module: qdebug's own by full dotted name, any other by its top-level name."""

    importer: str
    target: str
    line: int
    kind: str  # "top", "deferred" or "TYPE_CHECKING"
    source: str  # the statement as written

    def __str__(self) -> str:
        path = _path_of(self.importer).relative_to(ROOT)
        return f"{path}:{self.line} ({self.kind}) `{self.source}` -> {self.target}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def _path_of(module: str) -> Path:
    return MODULES[module]


def _is_package(module: str) -> bool:
    return _path_of(module).name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it sits: module level, inside a function, or under TYPE_CHECKING."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, kind))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "deferred" if kind == "top" else kind)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_one(stmt, "TYPE_CHECKING")
                for stmt in child.orelse:
                    visit_one(stmt, kind)
            else:
                visit(child, kind)

    def visit_one(stmt: ast.stmt, kind: str) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            found.append((stmt, kind))
        else:
            visit(stmt, kind)

    visit(tree, "top")
    return found


def _resolve_from(importer: str, stmt: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative imports resolved against the importer)."""
    if not stmt.level:
        return stmt.module or ""
    package = importer if _is_package(importer) else importer.rpartition(".")[0]
    base = package.split(".")
    if stmt.level > 1:
        base = base[: -(stmt.level - 1)]
    return ".".join([*base, *([stmt.module] if stmt.module else [])])


def _targets(importer: str, stmt: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(stmt, ast.Import):
        names = [alias.name for alias in stmt.names]
    else:
        base = _resolve_from(importer, stmt)
        # `from qdebug.analysis import notes` imports the submodule qdebug.analysis.notes;
        # `from qdebug.analysis import measure_layers` imports a name of the package qdebug.analysis
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in stmt.names]
    targets = []
    for name in names:
        if name == "qdebug" or name.startswith("qdebug."):
            while name not in MODULES and "." in name:  # `import qdebug.x.y` of a name that is no module
                name = name.rpartition(".")[0]
        else:
            name = name.partition(".")[0]
        if name not in targets:
            targets.append(name)
    return targets


def _scan() -> list[Import]:
    imports = []
    for module, path in MODULES.items():
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for stmt, kind in _statements(ast.parse(text, str(path))):
            source = " ".join(line.strip() for line in lines[stmt.lineno - 1 : stmt.end_lineno])
            for target in _targets(module, stmt):
                if target != module:
                    imports.append(Import(module, target, stmt.lineno, kind, source))
    return imports


IMPORTS = _scan()


def _graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for imp in IMPORTS:
        if imp.target in MODULES:
            graph.add_edge(imp.importer, imp.target)
    return graph


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _light() -> set[str]:
    """The light modules, with the packages above them: importing ``qdebug.graph.ops`` runs
    ``qdebug/__init__.py`` and ``qdebug/graph/__init__.py`` first, so those are held to the same rule."""
    light = {m for m in MODULES if _within(m, LIGHT)}
    for module in list(light):
        parts = module.split(".")
        light.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return light


def _is_stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names


def _violations(importers: set[str], allowed) -> str:
    bad = [str(imp) for imp in IMPORTS if imp.importer in importers and not allowed(imp.target)]
    return "\n  ".join(bad)


def test_the_scan_sees_the_package():
    """The scan itself: it found the modules and the kinds of import the rules are about."""
    assert {"qdebug.records", "qdebug.tui.app", "qdebug.graph.ops", "qdebug.cli.main"} <= set(MODULES)
    kinds = {imp.kind for imp in IMPORTS}
    assert kinds == {"top", "deferred", "TYPE_CHECKING"}, kinds
    assert any(imp.target == "onnx" for imp in IMPORTS)


def test_no_import_cycle_deferred_imports_included():
    graph = _graph()
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    lines = []
    for component in sorted(cycles):
        lines.append("cycle: " + ", ".join(component))
        members = set(component)
        lines.extend(f"    {imp}" for imp in IMPORTS if imp.importer in members and imp.target in members)
    assert not cycles, "import cycles (strongly connected components):\n" + "\n".join(lines)


def test_the_light_layer_imports_only_itself_and_the_standard_library():
    """So no onnx, onnxruntime, numpy, textual or rich, at any level."""
    light = _light()
    bad = _violations(light, lambda target: target in light or (target not in MODULES and _is_stdlib(target)))
    assert not bad, f"the light layer imports beyond itself and the standard library:\n  {bad}"


def test_the_tui_imports_only_the_light_layer_and_itself():
    light = _light()
    tui = {m for m in MODULES if _within(m, ("qdebug.tui",))}
    bad = _violations(
        tui,
        lambda target: (
            target in light
            or target in tui
            or target in TUI_THIRD_PARTY
            or (target not in MODULES and _is_stdlib(target))
        ),
    )
    assert not bad, f"the TUI imports beyond the light layer, qdebug.tui.* and {TUI_THIRD_PARTY}:\n  {bad}"


def test_graph_imports_only_records_errors_files_progress_and_itself():
    graph = {m for m in MODULES if _within(m, ("qdebug.graph",))}
    bad = _violations(
        graph,
        lambda target: target not in MODULES or _within(target, GRAPH_MAY_IMPORT) or target == "qdebug",
    )
    assert not bad, f"qdebug.graph imports qdebug modules other than {GRAPH_MAY_IMPORT}:\n  {bad}"


def _layer(module: str) -> tuple[int, str]:
    """(rank, name) of a module's layer: a module may import from ranks up to its own."""
    if module in _light():
        return 0, "light"
    if module == "qdebug.prepare":
        return 2, "prelude"
    if _within(module, COMMANDS):
        return 3, "commands"
    if _within(module, FRONT_ENDS):
        return 4, "front ends"
    return 1, "engine"


def test_every_module_imports_downward_and_no_command_imports_another():
    """The whole picture in the module docstring: no layer reaches up, and each command (``pipeline``,
    ``propose/``, ``verify``, ``bench/``) is built from the layers below, not from a sibling command."""
    bad = []
    for imp in IMPORTS:
        if imp.target not in MODULES:
            continue
        (rank, name), (target_rank, target_name) = _layer(imp.importer), _layer(imp.target)
        command = next((c for c in COMMANDS if _within(imp.importer, (c,))), None)
        if target_rank > rank:
            bad.append(f"{imp} ({name} -> {target_name})")
        elif target_rank == rank == 3 and not _within(imp.target, (command,)):
            bad.append(f"{imp} (a command imports another command)")
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize(
    ("rule", "importer", "target"),
    [
        ("cycle", "qdebug.errors", "qdebug.output.files"),  # files imports errors
        ("layers", "qdebug.runtime.capture", "qdebug.prepare"),
        ("layers", "qdebug.bench.run", "qdebug.pipeline"),
        ("light", "qdebug.output.files", "onnx"),
        ("tui", "qdebug.tui.model", "qdebug.verify"),
        ("graph", "qdebug.graph.match", "qdebug.analysis"),
    ],
)
def test_a_planted_violation_is_named_with_its_line(rule, importer, target):
    """The checks above are not vacuous: an import that breaks a rule is reported by module and line."""
    check = {
        "cycle": test_no_import_cycle_deferred_imports_included,
        "layers": test_every_module_imports_downward_and_no_command_imports_another,
        "light": test_the_light_layer_imports_only_itself_and_the_standard_library,
        "tui": test_the_tui_imports_only_the_light_layer_and_itself,
        "graph": test_graph_imports_only_records_errors_files_progress_and_itself,
    }[rule]
    planted = Import(importer, target, 1, "deferred", f"import {target}")
    IMPORTS.append(planted)
    try:
        with pytest.raises(AssertionError, match=rf"{importer.replace('.', '/')}\.py:1 \(deferred\)"):
            check()
    finally:
        IMPORTS.remove(planted)


def test_light_modules_the_tui_probe_does_not_import_load_no_onnx():
    """``tests/test_tui.py`` probes records, report_io, files, snippet, progress, formatting and the
    records submodules; this adds the rest of the light layer."""
    code = (
        "import sys; import qdebug.graph.ops, qdebug.errors, qdebug.records.report, qdebug.records.proposal; "
        "bad = [m for m in ('onnx', 'onnxruntime', 'numpy', 'textual', 'rich') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_measuring_child_imports_nothing_of_qdebug():
    """Its packages neither: ``python -m qdebug.runtime.bench_child`` runs ``qdebug/runtime/__init__.py`` first."""
    parts = MEASURING_CHILD.split(".")
    child = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    own = [i for i in IMPORTS if i.importer in child and i.target.startswith("qdebug")]
    assert not own, "\n".join(map(str, own))


def _private_imports(module: str, tree: ast.Module) -> list[str]:
    """``from <another qdebug module> import _name`` statements of ``module`` (dunders aside), as text."""
    found = []
    for stmt, _ in _statements(tree):
        if not isinstance(stmt, ast.ImportFrom):
            continue
        base = _resolve_from(module, stmt)
        if not (base == "qdebug" or base.startswith("qdebug.")) or base == module:
            continue
        for alias in stmt.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{_path_of(module).relative_to(ROOT)}:{stmt.lineno} {alias.name} from {base}")
    return found


def test_no_private_name_is_imported_from_another_module():
    """A name another module needs is public: a ``_name`` imported across modules is a seam that was split
    but never made one (the newcomer issue counted 50). The rule's own check: a planted import is named."""
    bad = [line for module, path in MODULES.items() for line in _private_imports(module, ast.parse(path.read_text()))]
    assert not bad, "private names imported across modules:\n  " + "\n  ".join(bad)
    planted = ast.parse("from qdebug.propose.search import _hidden, Plan\nfrom qdebug.errors import __all__\n")
    assert _private_imports("qdebug.propose.run", planted) == [
        "qdebug/propose/run.py:1 _hidden from qdebug.propose.search"
    ]
