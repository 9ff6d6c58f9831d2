"""Report <-> JSON, CSV export, and atomic file writes.

The encoding is generic over the frozen records in :mod:`qdebug.records`:
dataclasses become objects, tuples become lists, and non-finite floats become
the strings ``"inf"``, ``"-inf"`` and ``"nan"`` so the file is strict JSON that
any parser (``jq``, browsers) accepts.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import stat
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from qdebug import records
from qdebug.errors import ExitCode, QDebugError
from qdebug.records import SCHEMA_VERSION, Report

T = TypeVar("T")

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def to_jsonable(obj: Any) -> Any:
    """Convert records (and nested tuples, floats) to plain JSON values."""
    if isinstance(obj, float):  # the most common value: checked first
        return obj if math.isfinite(obj) else _nonfinite_str(obj)
    if isinstance(obj, (list, tuple)):
        if all(type(v) is int for v in obj):  # histogram counts: most of a report's values
            return list(obj)
        return [to_jsonable(v) for v in obj]
    names = _field_names(type(obj))
    if names is not None:
        return {n: to_jsonable(getattr(obj, n)) for n in names}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalar
        return to_jsonable(obj.item())
    return obj


def _nonfinite_str(x: float) -> str:
    if math.isnan(x):
        return "nan"
    return "inf" if x > 0 else "-inf"


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """A record class's field names (None for anything else); cached: a report holds ~50k values."""
    if dataclasses.is_dataclass(cls):
        return tuple(f.name for f in dataclasses.fields(cls))
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A record class's resolved field types; cached: resolving them per record took 8 of the 19 s
    that loading a 5,000-node report took."""
    return typing.get_type_hints(cls, vars(records))


def from_jsonable(tp: Any, value: Any) -> Any:
    """Rebuild a value of type ``tp`` (a record, tuple, float, ...) from JSON data."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        non_none = [a for a in args if a is not type(None)]
        return from_jsonable(non_none[0], value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"expected an object for {tp.__name__}")
        hints = _hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = from_jsonable(hints[f.name], value[f.name])
        return tp(**kwargs)
    if origin is tuple:
        if not isinstance(value, list):  # a string would otherwise become a tuple of its letters
            raise ValueError(f"expected a list, got {type(value).__name__} {str(value)[:40]!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            if args[0] in (int, float):  # histogram counts and edges: ~4M values in a 5,000-node report
                return _numbers(args[0], value)
            return tuple(from_jsonable(args[0], v) for v in value)
        return tuple(from_jsonable(a, v) for a, v in zip(args, value, strict=True))
    if tp is float:
        if isinstance(value, str):
            return _NONFINITE[value]
        return float(value)
    if tp is int:  # 3 and 3.0; not 1.5 (int() had truncated it), true or "3"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected an integer, got {str(value)[:40]!r}")
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError("expected a string")
        return value
    if tp is bool:
        if not isinstance(value, bool):  # bool("false") is True
            raise ValueError(f"expected true or false, got {str(value)[:40]!r}")
        return value
    return value


def _numbers(tp: type, values: list) -> tuple:
    """A list of JSON numbers as ints or floats (``"inf"``/``"-inf"``/``"nan"`` strings for floats), in bulk."""
    if tp is int:
        if all(type(v) is int for v in values):
            return tuple(values)
        # 3.0 was read as 3 before the bulk path (a hand edit, another writer); bool and 1.5 are refused
        if not all(type(v) is int or (type(v) is float and v.is_integer()) for v in values):
            bad = next(v for v in values if not (type(v) is int or (type(v) is float and v.is_integer())))
            raise ValueError(f"expected an integer, got {str(bad)[:40]!r}")
        return tuple(int(v) for v in values)
    if all(type(v) is float or type(v) is int for v in values):
        return tuple(map(float, values))
    return tuple(from_jsonable(float, v) for v in values)


def dumps(obj: Any) -> str:
    """Serialize a record as strict, stable, human-readable JSON.

    Objects and lists of objects are indented down to :data:`_INDENT_DEPTH`
    (one field per line: readable, and a diff shows which field changed);
    anything deeper, and any list of plain values (histogram counts), is one
    compact line. Only those compact pieces go through ``json``'s C encoder:
    ``indent=`` forces its pure-Python encoder, which took 0.5 s of a 7.5 s
    analysis on the BERT benchmark model.
    """
    out: list[str] = []
    _emit(to_jsonable(obj), 0, out)
    out.append("\n")
    return "".join(out)


_INDENT_DEPTH = 4
"""Containers this deep or deeper are written on one line (a tensor's error record is at depth 3)."""

_LINE = 100
"""A list of strings longer than this (the report's notes) is written one item per line."""

_compact = json.JSONEncoder(allow_nan=False, separators=(", ", ": ")).encode


def _emit(value: Any, depth: int, out: list[str]) -> None:
    """Append ``value`` as JSON at nesting ``depth`` (see :func:`dumps`)."""
    if depth >= _INDENT_DEPTH:
        nested = False
    elif isinstance(value, dict):
        nested = bool(value)
    elif isinstance(value, list):  # numbers (histogram counts) and a few names stay on one line
        nested = any(isinstance(v, (dict, list)) for v in value) or (
            any(isinstance(v, str) for v in value) and len(_compact(value)) > _LINE
        )
    else:
        nested = False
    if not nested:
        out.append(_compact(value))
        return
    pad = "\n" + " " * (depth + 1)
    if isinstance(value, dict):
        out.append("{")
        for i, (k, v) in enumerate(value.items()):
            out.append(("," if i else "") + pad + _compact(k) + ": ")
            _emit(v, depth + 1, out)
        out.append("\n" + " " * depth + "}")
    else:
        out.append("[")
        for i, v in enumerate(value):
            out.append(("," if i else "") + pad)
            _emit(v, depth + 1, out)
        out.append("\n" + " " * depth + "]")


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same directory, then rename.

    An interrupted run therefore leaves either the old file or the new one,
    never half a file, and no temp file behind.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write_text`).

    A symlink is written through, like a plain write would: the rename had replaced the user's link with
    a regular file, leaving its target stale.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise QDebugError(
            f"cannot write to {directory}: {e.strerror}",
            "choose a writable output path with -o",
            ExitCode.OUTPUT,
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, output_mode(path))
        os.replace(tmp, path)
    except OSError as e:
        _silent_unlink(tmp)
        raise QDebugError(f"cannot write {path}: {e.strerror}", write_hint(e), ExitCode.OUTPUT) from None
    except BaseException:
        _silent_unlink(tmp)
        raise


def write_hint(e: OSError, flag: str = "-o") -> str:
    """The fix for a failed write: free space when the disk is full, another path otherwise (a missing or
    read-only directory had been told to free disk space)."""
    import errno

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free disk space or choose another {flag} path"
    return f"choose a writable {flag} path"


def output_mode(path: str | Path) -> int:
    """Permissions for a file written through a temp file: those of the file it replaces, else what
    ``open()`` would give a new file (0o666 less the umask). ``mkstemp`` creates 0o600 files, which would
    leave reports unreadable to the rest of a team or a CI artifact store."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask can only be read by setting it)
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _silent_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_writable(path: str | Path, flag: str = "-o") -> None:
    """Fail before long work starts if ``path`` cannot be created (directory missing/unwritable);
    ``flag`` is the option the fix names."""
    path = Path(path)
    ancestor = path.parent if str(path.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QDebugError(
            f"cannot create {path}: {ancestor} is not a directory",
            f"choose another {flag} path",
            ExitCode.OUTPUT,
        )
    if not os.access(ancestor, os.W_OK):
        raise QDebugError(
            f"output directory {ancestor} is not writable", f"choose another {flag} path", ExitCode.OUTPUT
        )
    if path.is_dir():
        raise QDebugError(
            f"output path {path} is a directory", f"give a file name with {flag}", ExitCode.OUTPUT
        )


def check_outputs_spare_inputs(
    outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None]
) -> None:
    """Refuse an output path that is one of the inputs, or another output: the user's files are never
    modified (``-o model.onnx`` had replaced the model with the report, ``--csv`` the same as ``-o``
    the report with the CSV). Keys name the paths for the message; ``None`` entries are skipped, and
    inputs that are not files (a data folder, a ``module:function`` hook) cannot collide."""

    def where(path: str | Path) -> Path:
        return Path(os.path.realpath(path))

    taken: dict[Path, str] = {}
    for what, path in inputs.items():
        if path is not None and Path(path).is_file():
            taken.setdefault(where(path), what)
    for what, path in outputs.items():
        if path is None:
            continue
        key = where(path)
        if key in taken:
            raise QDebugError(
                f"{what} {path} would overwrite {taken[key]} (the same file)",
                "choose another output path",
                ExitCode.USAGE,
            )
        taken[key] = what


def save_report(report: Report, path: str | Path) -> None:
    """Write the report as JSON, atomically."""
    atomic_write_text(path, dumps(report))


def load_record(cls: type[T], path: str | Path, kind: str, schema_version: int = SCHEMA_VERSION) -> T:
    """Load a JSON record file of type ``cls`` and check its schema version.

    Raises :class:`QDebugError` (one line, no traceback) for a missing file,
    invalid JSON, another schema version or a file of another kind.
    """
    path = Path(path)
    if not path.is_file():
        raise QDebugError(f"{kind} file not found: {path}", f"check the path of the {kind}", ExitCode.INPUT)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:  # nesting, huge ints
        raise QDebugError(
            f"{path} is not a valid qdebug {kind} (not JSON: {e.__class__.__name__})",
            f"pass a file written by qdebug ({kind})",
            ExitCode.INPUT,
        ) from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise QDebugError(
            f"{path} is not a qdebug {kind} (no schema_version)",
            "pass a file written by qdebug",
            ExitCode.INPUT,
        )
    found = _kind_of(data)
    if found is not None and found != _KINDS.get(kind, kind):
        raise QDebugError(
            f"{path} is a qdebug {found} file, not a {kind}",
            f"pass the {kind} (qdebug writes one per command: analyze, propose, verify, bench)",
            ExitCode.INPUT,
        )
    if data.get("schema_version") != schema_version:
        found = data.get("schema_version")
        what = f"{found!r} (a {type(found).__name__}, not the integer {schema_version})" if found == str(
            schema_version
        ) else repr(found)
        raise QDebugError(
            f"{path} has {kind} schema version {what}, this qdebug reads version {schema_version}",
            "re-create it with this version of qdebug",
            ExitCode.INPUT,
        )
    try:
        return from_jsonable(cls, data)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise QDebugError(
            f"{path} is not a valid qdebug {kind} ({e.__class__.__name__}: {e})",
            "re-create it with qdebug",
            ExitCode.INPUT,
        ) from None


_KINDS = {"bench result": "bench"}
"""Names used in messages -> the ``kind`` field the files carry."""


def _kind_of(data: dict) -> str | None:
    """The kind of a qdebug JSON file: its ``kind`` field (proposal, verify, bench), else ``report`` for an
    analysis report (which predates the field), else unknown."""
    kind = data.get("kind")
    if isinstance(kind, str):
        return kind
    return "report" if "tensors" in data and "nodes" in data else None


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in chunks (models can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_report(path: str | Path) -> Report:
    """Load and validate an analysis report (node and tensor names are unique in one qdebug wrote)."""
    report = load_record(Report, path, "report")
    depths = [n.depth for n in report.nodes]
    if depths and (min(depths) < 0 or max(depths) > len(depths)):  # a node's depth is at most the node count
        raise QDebugError(
            f"report {path} gives node depths {min(depths)}..{max(depths)} for {len(depths)} nodes "
            "(edited by hand?)",
            "re-run qdebug analyze to write the report again",
            ExitCode.INPUT,
        )
    for what, names in (
        ("node", [n.name for n in report.nodes]),
        ("tensor", [t.name for t in report.tensors]),
    ):
        seen: set[str] = set()
        twice = next((n for n in names if n in seen or seen.add(n)), None)
        if twice is not None:
            raise QDebugError(
                f"report {path} lists {what} {twice!r} twice (edited by hand?)",
                "re-run qdebug analyze to write the report again",
                ExitCode.INPUT,
            )
    return report


CSV_COLUMNS = (
    "node",
    "original_name",
    "op_type",
    "depth",
    "quantized",
    "introduced_db",
    "added_noise_db",
    "local_sqnr_db",
    "accumulated_sqnr_db",
    "kl",
)


def report_to_csv(report: Report) -> str:
    """One row per node with its error numbers (for spreadsheets and quick diffs)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for n in report.nodes:
        writer.writerow(
            [
                n.name,
                n.original_name,
                n.op_type,
                n.depth,
                int(n.quantized),
                _fmt(n.introduced_db),
                _fmt(n.added_noise_db),
                _fmt(n.local_sqnr_db),
                _fmt(n.accumulated_sqnr_db),
                _fmt(n.kl),
            ]
        )
    return buf.getvalue()


def _fmt(x: float) -> str:
    return repr(float(x)) if math.isfinite(x) else str(to_jsonable(float(x)))
