"""Specializing the model on inputs that hold one value in all the data (issue 35 item 4).

A streaming VAD export takes a scalar ``sr`` (16000 in every sample) and holds its whole network in both
branches of ``If(Equal(sr, 16000))``: ORT's quantizer quantizes no subgraph, so nothing was quantized.
:func:`qdebug.graph.normalize.normalize` inlines such an If under ``--inline-constant-if`` when the inputs
its condition reads hold one value in every calibration and evaluation sample (without the flag a note
names the If, the input, its value and the flag). This module reads the data for it, before calibration:

* :class:`InputScan` answers normalize's question ("the one value of input ``sr``?") by reading that input
  only, in the calibration and evaluation data, and only until a sample holds another value; only inputs
  fed whole with every batch qualify (a scalar, or no axis shared by the inputs), so the value the
  condition is evaluated on is the array every batch feeds;
* :func:`specialized_inputs` turns what was inlined into the records the settings keep
  (:attr:`~qdebug.records.report.QuantSettings.specialized_inputs`), so propose, verify and bench inline
  the same branches (:func:`input_values`), and :meth:`InputScan.require` refuses their data, with one
  line, when a sample holds another value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from qdebug.data import DataSet, model_input_specs, open_data
from qdebug.errors import ExitCode, QDebugError
from qdebug.graph.normalize import DataIf, InputValue, show_value
from qdebug.records.report import SpecializedInput

MAX_VALUE_ELEMENTS = 1024
"""The largest input (elements) a model is specialized on: a switch is a scalar or a few flags, and its
value is written into the report."""


@dataclass(frozen=True)
class DataSource:
    """One data source the specialization must hold on, as the command opens it."""

    what: str
    """``calibration data`` or ``evaluation data`` (for messages)."""
    source: str | Path
    max_samples: int | None = None
    """The samples the command reads of it (None: all)."""
    limit_flag: str | None = ""
    """The flag that limits them, for :func:`~qdebug.data.open_data`'s messages."""


class InputScan:
    """The values of a few inputs over the command's data sources, read when first asked for.

    The sources are opened (headers checked, as the command opens them) on the first question; a model
    with no If decided by its inputs opens nothing here.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        sources: Sequence[DataSource],
        *,
        batch_size: int | None = None,
        batch_axes: Sequence[tuple[str, int | None]] = (),
    ) -> None:
        self._model = model
        self._sources = tuple(sources)
        self._batch_size = batch_size
        self._batch_axes = tuple(batch_axes)
        self._opened: list[tuple[DataSource, DataSet]] | None = None
        self._values: dict[str, np.ndarray | None] = {}

    def _data(self) -> list[tuple[DataSource, DataSet]]:
        if self._opened is None:
            specs = model_input_specs(self._model, self._batch_axes)
            self._opened = [
                (
                    s,
                    open_data(
                        s.source,
                        specs,
                        batch_size=self._batch_size,
                        max_samples=s.max_samples,
                        what=s.what,
                        limit_flag=s.limit_flag,
                    ),
                )
                for s in self._sources
            ]
            self._model = onnx.ModelProto()  # the specs are read: the weights are not held twice
        return self._opened

    def value(self, name: str) -> np.ndarray | None:
        """The one value input ``name`` holds in every sample of every source; None when it varies, is not
        fed whole with every batch, or is larger than :data:`MAX_VALUE_ELEMENTS` (normalize's
        :data:`~qdebug.graph.normalize.InputValue`)."""
        if name not in self._values:
            self._values[name] = self._scan(name)
        return self._values[name]

    def _scan(self, name: str) -> np.ndarray | None:
        found: np.ndarray | None = None
        for _, data in self._data():
            spec = next((s for s in data.specs if s.name == name), None)
            if spec is None or spec.batch_axis is not None:
                return None
            for arrays, _ in data.input_arrays([name]):
                value = np.asarray(arrays[name])
                if value.size > MAX_VALUE_ELEMENTS:
                    return None
                if found is None:
                    found = value
                elif not same_value(found, value):
                    return None
        return found

    def require(self, recorded: SpecializedInput) -> None:
        """Refuse data in which a sample holds another value of ``recorded``'s input than the one the model
        was specialized on (one line: the input, both values, where, the fix)."""
        expected = record_value(recorded)
        for source, data in self._data():
            if not any(s.name == recorded.name for s in data.specs):
                continue
            for arrays, origin in data.input_arrays([recorded.name]):
                value = np.asarray(arrays[recorded.name])
                if same_value(expected, value):
                    continue
                found = show_value(value)
                ifs = " and ".join(f"If {n!r}" for n in recorded.ifs) or "an If"
                raise QDebugError(
                    f"{source.what} {origin} has {recorded.name} = {found}, but the model was specialized on "
                    f"{recorded.name} = {recorded.value} when it was analyzed (--inline-constant-if inlined the "
                    f"branch of {ifs} that value takes)",
                    f"give data whose {recorded.name} is {recorded.value} in every sample, or run qdebug analyze "
                    f"on data with {recorded.name} = {found} for a model of its own",
                    ExitCode.DATA,
                )


def same_value(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two values of an input are the same (one-element arrays whatever their rank: ``16000`` and
    ``[16000]``)."""
    if a.shape != b.shape and not (a.size == b.size == 1):
        return False
    return bool(np.array_equal(a.reshape(-1), b.reshape(-1)))


def record_value(recorded: SpecializedInput) -> np.ndarray:
    """The value a :class:`~qdebug.records.report.SpecializedInput` records, as an array of its dtype."""
    return np.asarray(json.loads(recorded.value), dtype=np.dtype(recorded.dtype))


def specialized_inputs(data_ifs: Sequence[DataIf]) -> tuple[SpecializedInput, ...]:
    """The records of the inputs whose value decided the inlined Ifs (in the order they were met)."""
    values: dict[str, np.ndarray] = {}
    ifs: dict[str, list[str]] = {}
    for d in data_ifs:
        if not d.inlined:
            continue
        for name, value in d.inputs:
            values.setdefault(name, value)
            ifs.setdefault(name, []).append(d.node)
    return tuple(
        SpecializedInput(name, show_value(v), str(np.asarray(v).dtype), tuple(ifs[name])) for name, v in values.items()
    )


def input_values(scan: InputScan, recorded: Sequence[SpecializedInput], *, discover: bool) -> InputValue:
    """Normalize's :data:`~qdebug.graph.normalize.InputValue`: the ``recorded`` values (checked against the
    data by :meth:`InputScan.require` first), and with ``discover`` what the data holds for the others.

    Without ``discover`` (propose, verify and bench on recorded settings) no other input is specialized:
    the model must be the one the report measured."""
    known = {r.name: record_value(r) for r in recorded}

    def value(name: str) -> np.ndarray | None:
        if name in known:
            return known[name]
        return scan.value(name) if discover else None

    return value
