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
import io
import json
import math
import shlex
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import (  # noqa: F401 -- re-exported: the writers' old home
    atomic_write_bytes,
    atomic_write_text,
    check_outputs_spare_inputs,
    check_writable,
    output_mode,
    sha256_file,
    write_hint,
)
from qdebug.records import SCHEMA_VERSION, Proposal, Report, TensorOverride
from qdebug.records.bench import BENCH_SCHEMA_VERSION, BenchReport

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
    return typing.get_type_hints(cls)  # in the record's own module: every record module imports what it names


def from_jsonable(tp: Any, value: Any) -> Any:
    """Rebuild a value of type ``tp`` (a record, tuple, float, ...) from JSON data."""
    return _decoder(tp)(value)


@functools.cache
def _decoder(tp: Any) -> Callable[[Any], Any]:
    """The function that rebuilds a ``tp`` from JSON data, made once per type: a 3,200-node report holds a
    million values, and working out each one's type again (``typing.get_origin`` per value) took most of the
    3 s its loading took. A record's fields get their decoders on first use, so a record that holds its own
    type needs no recursion here."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(next(a for a in args if a is not type(None)))
        return lambda value: None if value is None else inner(value)
    if dataclasses.is_dataclass(tp):
        return _record_decoder(tp)
    if origin is tuple:
        return _tuple_decoder(args)
    return _SCALARS.get(tp, _as_is)


def _record_decoder(cls: type) -> Callable[[Any], Any]:
    fields: list[tuple[str, Callable[[Any], Any]]] = []

    def decode(value: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError(f"expected an object for {cls.__name__}")
        if not fields:
            hints = _hints(cls)
            fields.extend((f.name, _decoder(hints[f.name])) for f in dataclasses.fields(cls))
        return cls(**{name: dec(value[name]) for name, dec in fields if name in value})

    return decode


def _tuple_decoder(args: tuple) -> Callable[[Any], Any]:
    def checked(value: Any) -> list:
        if not isinstance(value, list):  # a string would otherwise become a tuple of its letters
            raise ValueError(f"expected a list, got {type(value).__name__} {str(value)[:40]!r}")
        return value

    if len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if item in (int, float):  # histogram counts and edges: ~4M values in a 5,000-node report
            return lambda value: _numbers(item, checked(value))
        each = _decoder(item)
        return lambda value: tuple(map(each, checked(value)))
    decoders = tuple(_decoder(a) for a in args)
    return lambda value: tuple(dec(v) for dec, v in zip(decoders, checked(value), strict=True))


def _as_float(value: Any) -> float:
    if isinstance(value, str):
        return _NONFINITE[value]
    return float(value)


def _as_int(value: Any) -> int:
    """3 and 3.0; not 1.5 (int() had truncated it), true or "3"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected an integer, got {str(value)[:40]!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected an integer, got {value!r}")
    return int(value)


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


def _as_bool(value: Any) -> bool:
    if not isinstance(value, bool):  # bool("false") is True
        raise ValueError(f"expected true or false, got {str(value)[:40]!r}")
    return value


def _as_is(value: Any) -> Any:
    return value


_SCALARS: dict[Any, Callable[[Any], Any]] = {float: _as_float, int: _as_int, str: _as_str, bool: _as_bool}


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
    return tuple(map(_as_float, values))


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


def save_report(report: Report, path: str | Path) -> None:
    """Write the report as JSON, atomically."""
    atomic_write_text(path, dumps(report))


def load_record(cls: type[T], path: str | Path, kind: str, schema_version: int = SCHEMA_VERSION) -> T:
    """Load a JSON record file of type ``cls`` and check its schema version.

    Raises :class:`QDebugError` (one line, no traceback) for a missing file,
    invalid JSON, another schema version or a file of another kind.
    """
    path = Path(path)
    if path.is_dir():  # "file not found" for a folder that is there had sent users looking for a typo
        raise QDebugError(
            f"{path} is a directory, not a {kind} file", f"pass the {kind} itself ({_writer(kind)})", ExitCode.INPUT
        )
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
            f"pass the {kind} ({_writer(kind)})",
            ExitCode.INPUT,
        )
    if data.get("schema_version") != schema_version:
        data = _migrated(data, path, kind, schema_version)
    try:
        return from_jsonable(cls, data)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as e:
        raise QDebugError(
            f"{path} is not a valid qdebug {kind} ({e.__class__.__name__}: {e})",
            "re-create it with qdebug",
            ExitCode.INPUT,
        ) from None


def _migrated(data: dict, path: Path, kind: str, schema_version: int) -> dict:
    """``data`` of an older schema version brought to ``schema_version`` (see :data:`_MIGRATIONS`), or the
    one-line refusal naming the version found and the versions this qdebug reads."""
    found = data.get("schema_version")
    steps = _MIGRATIONS.get(_KINDS.get(kind, kind), {}) if schema_version == SCHEMA_VERSION else {}
    if type(found) is int and found in steps:
        return {**steps[found](data), "schema_version": schema_version}
    what = (
        f"{found!r} (a {type(found).__name__}, not the integer {schema_version})"
        if found == str(schema_version)
        else repr(found)
    )
    reads = " and ".join(str(v) for v in (*sorted(steps), schema_version))
    newer = type(found) is int and found > schema_version
    raise QDebugError(
        f"{path} has {kind} schema version {what}, this qdebug reads version{'s' if steps else ''} {reads}",
        "it was written by a newer qdebug: upgrade qdebug, or re-create it with this version"
        if newer
        else "re-create it with this version of qdebug",
        ExitCode.INPUT,
    )


_V2_FOLDED_NOTE = "ORT folded the following"
"""How schema-2 reports marked, in ``TensorRecord.note``, a tensor whose Relu/Clip ORT folded (frozen: the
migration below is the only reader of that text, and only of version-2 files)."""


def _report_from_v2(data: dict) -> dict:
    """Schema 2 -> 3: every tensor gets ``folded_into``, derived from its note as version 2's readers did
    (a tensor whose note carries :data:`_V2_FOLDED_NOTE` was folded into its consumer: ORT folds a Relu/Clip
    only into a tensor that it alone reads). Nothing else changed."""
    tensors = data.get("tensors")
    if not isinstance(tensors, list):
        return data  # from_jsonable explains
    return {**data, "tensors": [_tensor_from_v2(t) for t in tensors]}


def _tensor_from_v2(t: Any) -> Any:
    if not isinstance(t, dict) or "folded_into" in t:
        return t
    note, consumers = t.get("note"), t.get("consumers")
    folded = isinstance(note, str) and _V2_FOLDED_NOTE in note and isinstance(consumers, list) and consumers
    return {**t, "folded_into": consumers[0] if folded else None}


_MIGRATIONS: dict[str, dict[int, Callable[[dict], dict]]] = {
    "report": {2: _report_from_v2},
    "proposal": {2: lambda data: data},  # the version number is shared; these layouts did not change
    "verify": {2: lambda data: data},
}
"""Per kind of file, the older schema versions it is brought up from, each with its step to the current one."""

_KINDS = {"bench result": "bench"}
"""Names used in messages -> the ``kind`` field the files carry."""

_WRITERS = {
    "report": "qdebug analyze",
    "proposal": "qdebug propose",
    "verify": "qdebug verify",
    "bench": "qdebug bench",
    "diff": "qdebug diff A.json B.json --json",
    "comparison": "qdebug diff of three or more reports, --json",
}
"""The ``kind`` of each qdebug file -> the command that writes it, for the hints: "pass the report (qdebug
writes one per command: analyze, propose, verify, bench)" had read as if any of those four files would do."""


def _writer(kind: str) -> str:
    """``the file qdebug analyze writes`` for a report, and so on for each kind of file qdebug writes."""
    command = _WRITERS.get(_KINDS.get(kind, kind))
    return f"the file {command} writes" if command else f"a qdebug {kind} file"


def _kind_of(data: dict) -> str | None:
    """The kind of a qdebug JSON file: its ``kind`` field (proposal, verify, bench), else ``report`` for an
    analysis report (which predates the field), else unknown."""
    kind = data.get("kind")
    if isinstance(kind, str):
        return kind
    return "report" if "tensors" in data and "nodes" in data else None


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


def load_proposal(path: str | Path) -> Proposal:
    """Load a proposal file, refusing other kinds of qdebug files."""
    import json

    from qdebug.output.report_io import load_record

    p = Path(path)
    if p.is_file():
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            data = None  # load_record explains
        if isinstance(data, dict) and "schema_version" in data:
            _check_proposal_kind(p, _kind_of(data))
    return _checked_fields(load_record(Proposal, p, "proposal"), p)


def _check_proposal_kind(path: Path, kind: str | None) -> None:
    """Refuse another qdebug file where a proposal is expected, naming what it is: an analyze report passed
    to ``--proposal`` had been called "not a qdebug proposal (kind None)", which told the user neither what
    the file was nor how to get a proposal from it."""
    if kind == "proposal":
        return
    if kind == "report":
        raise QDebugError(
            f"{path} is an analysis report (written by qdebug analyze), not a proposal",
            f"make a proposal from it: qdebug propose {shlex.quote(str(path))} -o proposal.json",
            ExitCode.INPUT,
        )
    what = f"a qdebug {kind} file" if kind else "a qdebug file of no known kind"
    raise QDebugError(
        f"{path} is {what}, not a proposal",
        "pass the proposal.json written by qdebug propose or exported by the TUI",
        ExitCode.INPUT,
    )


def _checked_fields(proposal: Proposal, path: Path) -> Proposal:
    """Refuse settings no quantization accepts (a hand-edited file); drop repeated names.

    A name listed twice was counted twice ("nodes FP32 8" for 4 nodes); a
    tensor given two different types has no meaning and is refused.
    """
    from qdebug.records import METHODS, QUANT_TYPES

    def bad(field: str, value: str, allowed: Sequence[str]) -> QDebugError:
        return QDebugError(
            f"proposal {path} has {field} {value!r}",
            f"use one of {', '.join(allowed)} (or re-run qdebug propose)",
            ExitCode.INPUT,
        )

    if proposal.method and proposal.method not in METHODS:
        raise bad("method", proposal.method, METHODS)
    for field in ("activation_type", "weight_type"):
        value = getattr(proposal, field)
        if value and value not in QUANT_TYPES:
            raise bad(field, value, QUANT_TYPES)
    overrides: dict[str, TensorOverride] = {}
    for o in proposal.tensor_overrides:
        if o.quant_type not in QUANT_TYPES and (o.quant_type or o.describe() == "no change"):
            raise bad(f"quant_type for tensor {o.tensor!r}:", o.quant_type, QUANT_TYPES)
        _check_range(o, path)
        first = overrides.setdefault(o.tensor, o)
        if first.quant_type != o.quant_type:
            raise QDebugError(
                f"proposal {path} gives tensor {o.tensor!r} two types: {first.quant_type} and {o.quant_type}",
                "keep one override per tensor",
                ExitCode.INPUT,
            )
        if first != o:
            raise QDebugError(
                f"proposal {path} gives tensor {o.tensor!r} two overrides: {first.describe()} and {o.describe()}",
                "keep one override per tensor",
                ExitCode.INPUT,
            )
    return dataclasses.replace(
        proposal,
        nodes_to_exclude=tuple(dict.fromkeys(proposal.nodes_to_exclude)),
        tensor_overrides=tuple(overrides.values()),
    )


def _check_range(o: TensorOverride, path: Path) -> None:
    """A clipped range needs both ends, finite, low below high (ORT refuses one end alone)."""
    if o.rmin is None and o.rmax is None:
        return
    if o.rmin is None or o.rmax is None or not (math.isfinite(o.rmin) and math.isfinite(o.rmax)) or o.rmin >= o.rmax:
        raise QDebugError(
            f"proposal {path} gives tensor {o.tensor!r} the range [{o.rmin}, {o.rmax}]",
            "give both rmin and rmax, finite, rmin < rmax (or re-run qdebug propose)",
            ExitCode.INPUT,
        )


def load_bench(path: str | Path) -> BenchReport:
    """Load and validate a ``bench.json`` file (written by ``qdebug bench -o``)."""
    report = load_record(BenchReport, path, "bench result", BENCH_SCHEMA_VERSION)
    if report.kind != "bench":
        raise QDebugError(
            f"{path} is not a qdebug bench result (kind {report.kind!r})", "pass a bench.json", ExitCode.INPUT
        )
    return report
