"""ORT's own quantizer and calibrator in time linear in the graph: the same code over indexed lookups.

ORT's ``ONNXModel`` answers every question by scanning: ``replace_input_of_all_nodes`` walks every node
for each tensor the quantizer rewires, ``find_by_name`` / ``get_initializer`` / ``add_initializer`` scan
the initializer list for each lookup, ``input_name_to_nodes`` rebuilds the whole consumer map per call,
and the MinMax calibrator's ``augment_graph`` searches the node list for each tensor's first reader and
rebuilds a value-info map twice per tensor. All of it is quadratic in the node count (373 s for
``quantize_static`` on 3,200 nodes, docs/benchmarks.md).

Here ORT's ``QDQQuantizer`` / ``ONNXQuantizer`` run unchanged over :class:`IndexedModel`, an
``ONNXModel`` whose scanning methods answer from dicts (name -> nodes reading / writing it, name ->
initializers, node -> position) kept up to date by every mutation that goes through it, and
:func:`augment_graph` is ``MinMaxCalibrater.augment_graph`` with the first-reader search and the
value-info map done once. Each replacement does what the method it replaces does, element for element,
so the model is byte-identical to ORT's plain path (tests/test_fast_quantize.py proves it on the
fixtures and on generated graphs, for every option qdebug passes).

Three linear-but-slow loops are done in bulk the same way: the quantizer's ``new_nodes`` list indexes its
names as it grows (:class:`NamedList`; ORT's dynamic quantizer looks a name up in it per quantized
MatMul), the static quantizer computes a per-channel weight's scales and zero points for all its
channels in one vector pass (:func:`channel_quant_params`, ORT's float32 / float64 steps element for
element) instead of ``compute_data_quant_params`` per channel, and such a weight is quantized in one
pass too (:func:`quantize_onnx_initializer`) instead of ``quantize_nparray`` per channel. And two steps that
repeat work are done once: the shape-inference round trip ORT's quantizer makes of its input (a save, an
``infer_shapes_path`` and a load) runs once per model content (:func:`shape_inferred`), with onnx's
per-weight external-data steps in one pass (:func:`reloaded_with_shape_infer`), and the clean-up of
unused initializers deletes them by position (:func:`clean_initializers`) instead of copying every node out and
back and scanning the list once per removal.

Three guards keep that true:

- the ORT functions replaced (or whose delegation is relied on) must have the source they had when
  this was verified (:data:`VERIFIED_SOURCES`, sha256 of ``inspect.getsource``), and ORT's private
  modules must import as they did; otherwise qdebug runs ORT's plain path and says so in one note of the
  command's report (:func:`notes`, :func:`fallback_note`), never a warning or an error;
- a mutation that bypasses the index (a node appended or a list cleared by other code) is seen by a
  cheap tripwire (length, container and last element identity) and the index is rebuilt from the graph;
- after quantizing, :meth:`IndexedModel.check_in_step` compares the index with one rebuilt from the
  graph; any difference raises :class:`IndexOutOfStep` and qdebug quantizes again on the plain path.

Nothing is patched beyond the call: the quantizer is a subclass whose ``model`` attribute wraps ORT's
``ONNXModel`` into an :class:`IndexedModel`; the module-level ``find_by_name``,
``quantize_onnx_initializer``, ``save_and_reload_model_with_shape_infer``, ``quantize_data`` and
``tensor_proto_to_array`` (which ORT's modules imported by name) are swapped in their namespaces only while
:func:`installed` is active. The swapped ``find_by_name``
answers from an index only for the initializer list of an active :class:`IndexedModel` -- any other list
is scanned as before -- and the other swapped functions give ORT's bytes (or arrays) for every argument
(what they do not do themselves, ORT's own functions do), so other callers in the process see no
difference.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import importlib
import inspect
import json
import linecache
import logging
import math
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

try:  # ORT's private quantizer modules: any release may move or rename them (then ORT's plain path runs)
    from onnxruntime.quantization import calibrate as ort_calibrate
    from onnxruntime.quantization import quant_utils
    from onnxruntime.quantization.base_quantizer import BaseQuantizer
    from onnxruntime.quantization.onnx_model import ONNXModel
    from onnxruntime.quantization.onnx_quantizer import ONNXQuantizer
    from onnxruntime.quantization.qdq_quantizer import (
        QDQQuantizer,
        QDQQuantTensorType,
        QDQScaleZpInitializers,
        QDQTensorQuantParams,
        QuantizationParams,
        TensorData,
    )

    _IMPORT_PROBLEM: str | None = None
except ImportError as _e:  # the names stand in as placeholders that nothing on the plain path calls
    _IMPORT_PROBLEM = f"{_e.__class__.__name__}: {_e}"
    ort_calibrate = quant_utils = types.SimpleNamespace()  # type: ignore[assignment]
    BaseQuantizer = ONNXModel = ONNXQuantizer = QDQQuantizer = object  # type: ignore[assignment,misc]
    QDQQuantTensorType = QDQScaleZpInitializers = QDQTensorQuantParams = QuantizationParams = TensorData = None  # type: ignore[assignment,misc]

PLAIN_ENV = "QDEBUG_PLAIN_QUANTIZER"
"""Set to 1 to run ORT's plain (quadratic) quantizer and calibrator augmentation instead."""

VERIFIED_SOURCES: dict[str, str] = {
    "ONNXModel.__init__": "5cb0dcff7cb2fa5a",
    "ONNXModel.nodes": "a5ed94d099a6fd20",
    "ONNXModel.initializer": "90499463a2594101",
    "ONNXModel.graph": "d478d95d3e3b0bcd",
    "ONNXModel.replace_node_input": "161a2ad57d6b1ee7",
    "ONNXModel.replace_input_of_all_nodes": "dc01c5a634a1e3c1",
    "ONNXModel.replace_input_of_nodes": "3c7b558cd10d1a6e",
    "ONNXModel.replace_node_output": "bcca3f179f2f42bb",
    "ONNXModel.replace_output_of_all_nodes": "c50ea5ed645ee813",
    "ONNXModel.replace_output_of_nodes": "226ca0ba267f2200",
    "ONNXModel.find_node_by_name": "7473866402fc5a00",
    "ONNXModel.input_name_to_nodes": "e507ed8b6d71f027",
    "ONNXModel.add_node": "eaedfdebf0a2d825",
    "ONNXModel.add_nodes": "ad406350150492f3",
    "ONNXModel.remove_node": "f32022433395cf13",
    "ONNXModel.remove_nodes": "c51594ceae8e0dae",
    "ONNXModel.add_initializer": "e0ec2245d91ac7ea",
    "ONNXModel.get_initializer": "9246321687c546d4",
    "ONNXModel.initializer_extend": "97d3149606630924",
    "ONNXModel.remove_initializer": "af14720c5446adb6",
    "ONNXModel.remove_initializers": "a8574eaa4642ff55",
    "ONNXModel._check_init": "7ff484d0442990d9",
    "ONNXModel.save_model_to_file": "5057f82633d31ba6",
    "ONNXModel.clean_initializers": "09b9fb821866a815",
    "ONNXModel.topological_sort": "1feb35a3069478d3",
    "ONNXModel.replace_gemm_with_matmul": "d776dd69a6c46023",
    "ONNXModel._ONNXModel__replace_gemm_with_matmul": "93157c7a38387f1b",
    "onnx_model._clean_initializers_helper": "a9b3358dff2116bd",
    "quant_utils.find_by_name": "40cf7740b42609de",
    "MinMaxCalibrater.augment_graph": "fce1d4bdb6e14d7a",
    "quantize.quantize_dynamic": "c3a8491dedf37111",
    "QDQQuantizer._calc_initializer_quant_params": "1fcb03ec6e2665b1",
    "quant_utils.compute_data_quant_params": "3f573364c4842be1",
    "quant_utils.compute_scale_zp": "615e86f6ccd62968",
    "quant_utils.get_qmin_qmax_for_qType": "8dda1ebb6621c82b",
    "quant_utils.quantize_onnx_initializer": "3474ff8220db56d1",
    "quant_utils.quantize_nparray": "364007f802236d9b",
    "quant_utils.quantize_data": "9ca0430dfbf9e9b4",
    "quant_utils._check_type": "16bf98786c4b4a95",
    "BaseQuantizer.is_weight_symmetric": "940b77944df699dd",
    "QDQQuantizer._make_scale_zp_initializers": "5a2e48273af95ae9",
    "QDQQuantizer.calc_graph_quant_params": "f399feee14e92b90",
    "QDQQuantizer.calc_quant_params": "b9e9fd805bdff3ee",
    "QDQQuantizer._create_qdq_nodes": "d25e122efc424a5a",
    "QDQQuantizer._create_q_node": "d3803c6839ccb502",
    "QDQQuantizer._create_dq_node": "938363f03e2b2020",
    "ONNXModel._check_node": "c05ee572dd8b48fa",
    "onnx_helper.make_node": "deb59d1ea8387283",
    "onnx_helper.make_tensor": "b030e17b9ce1ce23",
    "BaseQuantizer.quantize_initializer_impl": "dc77d19c2ac3181a",
    "BaseQuantizer.quantize_bias_static_impl": "f125a56bba0d00b8",
    "numpy_helper.from_array": "ddc77ea44b79b393",
    "numpy_helper.to_array": "c2ef21e196f36d74",
    "quant_utils.tensor_proto_to_array": "5582547931b25418",
    "BaseQuantizer.__init__": "f582453d7522e2bb",
    "QDQQuantizer.__init__": "3f023aaadb07e484",
    "ONNXQuantizer.__init__": "ab3d406180323ea8",
    "quant_utils.save_and_reload_model_with_shape_infer": "a786368a762a611d",
    "quant_utils.load_model_with_shape_infer": "595bdf9400f3c31b",
    "quant_utils.model_has_infer_metadata": "14e43697e362fff1",
    "quant_utils.add_infer_metadata": "06ce23b138366e59",
    "quant_utils.update_opset_version": "85ff325149f385ea",
    "onnx.save_model": "f387cbf94ec238d0",
    "onnx.load_model": "f3671b2dd59151d5",
    "external_data_helper.convert_model_to_external_data": "be0dee6883c5d032",
    "external_data_helper.set_external_data": "4b0d5976ba6b7c79",
    "external_data_helper.write_external_data_tensors": "e6dc1a71f37dd7e0",
    "external_data_helper.save_external_data": "7e7954e85a8bdaec",
    "external_data_helper.load_external_data_for_model": "ce0e1d7b31037785",
    "external_data_helper.load_external_data_for_tensor": "3dcbaab6e50d8db7",
    "external_data_helper._read_external_data_bytes": "1643387fe26dcd19",
    "external_data_helper.uses_external_data": "6f9a9bfd1d2a61df",
}
"""sha256 (first 16 hex digits) of the source of each ORT (and onnx) function this module replaces or relies
on, as verified byte-identical (onnxruntime 1.32.0, onnx 1.23.2). :func:`current_sources` gives today's;
``python -m qdebug.quant.fast_quantize`` lists the entries an installed release changed (docs/design-notes.md)."""

VERIFIED_ON = {"onnxruntime": "1.32.0", "onnx": "1.23.2"}
"""The releases :data:`VERIFIED_SOURCES` were read from (named in the note a fallback leaves)."""


class IndexOutOfStep(Exception):
    """The index no longer matches the graph: something changed the graph behind its back."""


_NOTES: list[str] = []
_NOTES_LOCK = threading.Lock()


def notes() -> tuple[str, ...]:
    """The distinct notes of this process's fallbacks to ORT's plain path (empty when none happened)."""
    with _NOTES_LOCK:
        return tuple(_NOTES)


def note(text: str) -> None:
    """Record ``text`` once for :func:`notes` (the command's report and summary carry it; nothing is printed)."""
    with _NOTES_LOCK:
        if text not in _NOTES:
            _NOTES.append(text)


def _relied_on_one(label: str) -> Callable[..., Any]:
    """The installed ORT function an entry of :data:`VERIFIED_SOURCES` names."""
    owner, name = label.split(".", 1)
    holder: Any = {
        "ONNXModel": lambda: ONNXModel,
        "quant_utils": lambda: quant_utils,
        "MinMaxCalibrater": lambda: ort_calibrate.MinMaxCalibrater,
        "QDQQuantizer": lambda: QDQQuantizer,
        "BaseQuantizer": lambda: BaseQuantizer,
        "ONNXQuantizer": lambda: ONNXQuantizer,
        "onnx_model": lambda: importlib.import_module("onnxruntime.quantization.onnx_model"),
        "quantize": lambda: importlib.import_module("onnxruntime.quantization.quantize"),  # the module
        "onnx": lambda: onnx,
        "onnx_helper": lambda: onnx.helper,
        "numpy_helper": lambda: numpy_helper,
        "external_data_helper": lambda: importlib.import_module("onnx.external_data_helper"),
    }[owner]()
    fn = getattr(holder, name, None)
    if fn is None:
        return None  # not in this release: hashed as a changed source
    for _, plain, ours in _swaps():  # asked while installed(): ORT's function, not the stand-in swapped in
        if fn is ours:
            return plain
    if fn is _augment_in_scope:  # asked inside fast_calibrator_augmentation(): ORT's method it stands for
        with _AUGMENT_LOCK:
            return _AUGMENT_SWAP[0] if _AUGMENT_SWAP else _PLAIN_AUGMENT
    return fn


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _inspected_source(fn: Callable[..., Any]) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _code_lines_source(fn: Callable[..., Any]) -> str:
    """``inspect.getsource(fn)`` read off the code object's line numbers (its first line, decorators
    included, to the last line any of its instructions or nested functions' ends on) instead of
    tokenizing the file: 12 ms for every entry instead of 65 ms, paid in each process's first build. Only
    trusted when it hashes to the verified digest (:func:`_source_hash`)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return ""
    lines = linecache.getlines(code.co_filename)
    stack, last = [code], code.co_firstlineno
    while stack:
        c = stack.pop()
        last = max([last, *(end for _, end, _, _ in c.co_positions() if end is not None)])
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return "".join(lines[code.co_firstlineno - 1 : last])


_HASHES: dict[str, str] = {}
"""The installed source's digest per entry of :data:`VERIFIED_SOURCES`, computed once per process."""


def _source_hash(label: str) -> str:
    """sha256 prefix of ``inspect.getsource`` of the installed function ``label`` names. The quick reading
    (:func:`_code_lines_source`) answers when it gives the verified digest; any other answer is
    ``inspect.getsource``'s, so a reading that differs can only cost time, never pass a changed source."""
    if label not in _HASHES:
        try:
            fn = _relied_on_one(label)
        except (AttributeError, ImportError, KeyError):  # a module or class this release does not have
            fn = None
        if fn is None:
            _HASHES[label] = "missing"
            return _HASHES[label]
        quick = _digest(_code_lines_source(fn))
        _HASHES[label] = quick if quick == VERIFIED_SOURCES.get(label) else _digest(_inspected_source(fn))
    return _HASHES[label]


def current_sources() -> dict[str, str]:
    """sha256 prefix of the installed ORT's source for each entry of :data:`VERIFIED_SOURCES`."""
    return {label: _source_hash(label) for label in VERIFIED_SOURCES}


_PROBLEMS: dict[str, str | None] = {}


def _labels(part: str) -> list[str]:
    """The entries of :data:`VERIFIED_SOURCES` the ``quantizer``, ``dynamic quantizer``, ``calibrator`` or
    ``round trip`` path relies on (the dynamic one: the quantizer's, and ``quantize_dynamic``, whose body it
    replays; the round trip: onnx's save and load with external data, which :func:`reloaded_with_shape_infer`
    replays, and ORT's function it stands for)."""
    calibrator = [label for label in VERIFIED_SOURCES if label.startswith("MinMaxCalibrater.")]
    dynamic = [label for label in VERIFIED_SOURCES if label.startswith("quantize.")]
    trip = [label for label in VERIFIED_SOURCES if label.startswith(_ROUND_TRIP_OWNERS)]
    if part == "calibrator":
        return calibrator
    if part == "round trip":
        return [*trip, *_ROUND_TRIP_ORT]
    quantizer = [label for label in VERIFIED_SOURCES if label not in (*calibrator, *dynamic, *trip)]
    return quantizer + dynamic if part == "dynamic quantizer" else quantizer


_ROUND_TRIP_OWNERS = ("onnx.", "external_data_helper.")
_ROUND_TRIP_ORT = (
    "quant_utils.save_and_reload_model_with_shape_infer",
    "quant_utils.load_model_with_shape_infer",
    "quant_utils.add_infer_metadata",
)


def fast_path_problem(part: str = "quantizer") -> str | None:
    """Why the fast ``quantizer``, ``dynamic quantizer``, ``calibrator`` or ``round trip`` path cannot run
    here (None when it can), in developers' words; the sources are checked once per process."""
    if os.environ.get(PLAIN_ENV, "") not in ("", "0"):
        return f"{PLAIN_ENV} is set"
    if _IMPORT_PROBLEM is not None:
        return f"ORT's quantizer modules could not be imported as verified ({_IMPORT_PROBLEM})"
    if part not in _PROBLEMS:
        changed = [label for label in _labels(part) if _source_hash(label) != VERIFIED_SOURCES[label]]
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        _PROBLEMS[part] = (
            f"{_installed()} changed {', '.join(changed[:4])}{more}, which qdebug's indexed {part} replaces "
            "(it was verified on other sources)"
            if changed
            else None
        )
    return _PROBLEMS[part]


def _installed() -> str:
    """``onnxruntime X / onnx Y`` as installed."""
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__} / onnx {onnx.__version__}"


def fallback_note() -> str:
    """The one line a user reads when ORT's or onnx's sources differ from the verified ones: what ran instead
    and what it costs them (nothing to do; the models are the same)."""
    return (
        f"ORT's own quantizer ran, not qdebug's faster copy of it, which is not yet checked against {_installed()}: "
        "the models are the same, but a graph of thousands of nodes takes minutes to quantize instead of seconds"
    )


def verification_gap() -> str | None:
    """For developers and the tests that prove the fast path: None when every entry of
    :data:`VERIFIED_SOURCES` has its verified source here; otherwise the installed versions and the entries
    that differ (``missing``: not in this release)."""
    if _IMPORT_PROBLEM is not None:
        return f"{_installed()}: {_IMPORT_PROBLEM}"
    changed = [label for label, digest in current_sources().items() if digest != VERIFIED_SOURCES[label]]
    if not changed:
        return None
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    return f"{_installed()} changed {len(changed)} verified source(s): {', '.join(changed[:6])}{more}"


_FORCE_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("qdebug_force_plain", default=False)


@contextlib.contextmanager
def plain_path() -> Iterator[None]:
    """Within the block, quantize and calibrate on ORT's plain path (tests and benchmarks compare both)."""
    token = _FORCE_PLAIN.set(True)
    try:
        yield
    finally:
        _FORCE_PLAIN.reset(token)


def use_fast_path(what: str = "quantizer") -> bool:
    """True when the fast ``quantizer`` (or ``dynamic quantizer``, ``calibrator``) path may run; otherwise
    False, with :func:`fallback_note` among the :func:`notes` (none when the plain path was asked for)."""
    if _FORCE_PLAIN.get():
        return False
    problem = fast_path_problem(what)
    if problem is None:
        return True
    if not problem.startswith(PLAIN_ENV):
        logging.getLogger(__name__).debug("plain %s: %s", what, problem)  # the developers' reason
        note(fallback_note())
    return False


# --- the indexed model --------------------------------------------------------------------------------


class _ReadersView(Mapping):
    """``input_name_to_nodes()`` answered per name from the index; frozen into a plain dict before the
    model changes, so a caller holding it sees the snapshot ORT's dict would be."""

    __hash__ = object.__hash__  # the model keeps its live views in a WeakSet

    def __init__(self, model: IndexedModel) -> None:
        self._model: IndexedModel | None = model
        self._cache: dict[str, list[Any]] = {}
        self._frozen: dict[str, list[Any]] | None = None

    def freeze(self) -> None:
        if self._frozen is None and self._model is not None:
            full = ONNXModel.input_name_to_nodes(self._model)
            full.update((k, v) for k, v in self._cache.items() if k in full)  # lists handed out stay the same
            self._frozen = full
            self._model = None

    def __getitem__(self, name: str) -> list[Any]:
        if self._frozen is not None:
            return self._frozen[name]
        if name in self._cache:
            return self._cache[name]
        assert self._model is not None
        found = self._model.readers(name) if isinstance(name, str) and name else []
        if not found:
            raise KeyError(name)
        self._cache[name] = found
        return found

    def __iter__(self) -> Iterator[str]:
        self.freeze()
        assert self._frozen is not None
        return iter(self._frozen)

    def __len__(self) -> int:
        self.freeze()
        assert self._frozen is not None
        return len(self._frozen)


class IndexedModel(ONNXModel):
    """ORT's ``ONNXModel`` whose scanning methods answer from indexes (see the module docstring).

    Node index: ``_live`` (id -> (sequence number, node) for every node in the graph; the sequence follows
    graph order, appended nodes get larger ones), ``_readers`` / ``_writers`` (tensor name -> nodes that
    read / write it: a superset, checked on use). Initializer index: ``_ilive`` and ``_by_name`` (name ->
    the initializers of that name in list order). Both hold the protobuf wrappers of the elements in the
    graph, whose identity upb keeps while they are referenced.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model)
        self.rebuilds = 0
        self._nodes_c: Any = None
        self._n = -1
        self._last: Any = None
        self._live: dict[int, tuple[int, Any]] = {}
        self._readers: dict[str, list[Any]] = {}
        self._writers: dict[str, list[Any]] = {}
        self._names: dict[str, list[Any]] = {}
        self._seq = 0
        self._lists: dict[int, tuple[list[Any], int, dict[str, int]]] = {}
        self._inits_c: Any = None
        self._ni = -1
        self._last_init: Any = None
        self._ilive: dict[int, tuple[int, Any]] = {}
        self._by_name: dict[str, list[Any]] = {}
        self._iseq = 0
        self._n_f8 = 0
        self._views: weakref.WeakSet[_ReadersView] = weakref.WeakSet()
        self._changes = 0
        self._checked: int | None = None
        """``_changes`` when the node index was last found in step (None: not since it was built)."""
        self._ichanges = 0
        self._final: tuple[GraphNames, tuple[Any, ...]] | None = None
        self._slots: tuple[list[tuple[list[str], list[str]]], tuple[Any, ...]] | None = None
        self._ichecked: int | None = None
        """The same two for the initializer index: ``_ichanges`` counts the initializers it indexed or forgot."""
        self.prequantized: dict[str, tuple[Any, Any, Any, int, tuple[bytes, bytes], np.ndarray]] = {}
        """name -> (initializer, zero point, scale, type, their bytes, quantized data): per-tensor weights
        quantized in bulk by :func:`calc_initializer_quant_params`, taken by :func:`quantize_onnx_initializer`."""
        self.data_quantized: dict[tuple[Any, ...], dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        """:func:`quantize_data`'s answers for this model's weights, per set of options."""
        _register(self)

    # -- index maintenance ---------------------------------------------------------------------------

    def _nodes_moved(self, c: Any) -> bool:
        """The tripwire: ``c`` is not the node list the index was built over, or other code changed it."""
        n = len(c)
        return c is not self._nodes_c or n != self._n or bool(n and c[n - 1] is not self._last)

    def _sync_nodes(self) -> Any:
        c = self.model.graph.node
        if self._nodes_moved(c):
            self._rebuild_nodes(c)
        return c

    def _rebuild_nodes(self, c: Any) -> None:
        self.rebuilds += 1
        self._checked = None
        self._nodes_c = c
        self._live, self._readers, self._writers, self._names, self._seq = {}, {}, {}, {}, 0
        for node in c:
            self._add_to_index(node)
        self._n = len(c)
        self._last = c[self._n - 1] if self._n else None

    def _add_to_index(self, node: Any, names: tuple[list[str], list[str], str] | None = None) -> None:
        """Index ``node``; ``names``: its inputs, outputs and name as the caller just wrote them, which saves
        reading them back off the message (~1 us a name: 8,400 Q/DQ nodes in a 3,200-node static build)."""
        self._live[id(node)] = (self._seq, node)
        self._seq += 1
        inputs, outputs, name = names if names is not None else (node.input, node.output, node.name)
        for tensor in inputs:
            self._readers.setdefault(tensor, []).append(node)
        for tensor in outputs:
            self._writers.setdefault(tensor, []).append(node)
        self._names.setdefault(name, []).append(node)

    def _is_live(self, node: Any) -> bool:
        entry = self._live.get(id(node))
        return entry is not None and entry[1] is node

    def _unique_live(self, nodes: list[Any]) -> list[Any]:
        seen: set[int] = set()
        out = []
        for node in nodes:
            if id(node) not in seen and self._is_live(node):
                seen.add(id(node))
                out.append(node)
        return out

    def _position(self, c: Any, item: Any, live: dict[int, tuple[int, Any]]) -> int:
        """Index of ``item`` in container ``c``, whose elements are in increasing sequence order."""
        target = live[id(item)][0]
        lo, hi = 0, len(c)
        while lo < hi:
            mid = (lo + hi) // 2
            entry = live.get(id(c[mid]))
            if entry is None:
                raise IndexOutOfStep("the graph holds an element the index does not know")
            if entry[0] < target:
                lo = mid + 1
            else:
                hi = mid
        if lo >= len(c) or c[lo] is not item:
            raise IndexOutOfStep("an element is not where its sequence number puts it")
        return lo

    def _inits_moved(self, c: Any) -> bool:
        n = len(c)
        return c is not self._inits_c or n != self._ni or bool(n and c[n - 1] is not self._last_init)

    def _sync_inits(self, c: Any = None) -> Any:
        """The graph's initializer list (``c``: as the caller just read it), the index rebuilt if it moved."""
        if c is None:
            c = self.model.graph.initializer
        n = len(c)  # the tripwire of ``_inits_moved`` inlined: 58,000 calls in a 3,200-node static build
        if c is not self._inits_c or n != self._ni or (n and c[n - 1] is not self._last_init):
            self._rebuild_inits(c)
        return c

    def _rebuild_inits(self, c: Any) -> None:
        self.rebuilds += 1
        self._ichecked = None
        self._inits_c = c
        self._ilive, self._by_name, self._iseq, self._n_f8 = {}, {}, 0, 0
        for t in c:
            self._add_init_to_index(t)
        self._ni = len(c)
        self._last_init = c[self._ni - 1] if self._ni else None

    def _add_init_to_index(self, t: Any) -> None:
        self._ilive[id(t)] = (self._iseq, t)
        self._iseq += 1
        self._ichanges += 1
        self._by_name.setdefault(t.name, []).append(t)
        if t.data_type == onnx.TensorProto.FLOAT8E4M3FN:
            self._n_f8 += 1

    def _forget_init(self, victim: Any) -> None:
        """Drop ``victim``, just deleted from the initializer list, from the initializer index."""
        del self._ilive[id(victim)]
        self._ichanges += 1
        self._by_name[victim.name] = [t for t in self._by_name[victim.name] if t is not victim]
        if victim.data_type == onnx.TensorProto.FLOAT8E4M3FN:
            self._n_f8 -= 1

    def holds_float8(self) -> bool:
        """The graph holds a float8 initializer (the index synced first): ORT's ``initializer_extend`` then
        checks every initializer, so nothing is added to it in place."""
        self._sync_inits()
        return self._n_f8 > 0

    def _append_init(self, c: Any, tensor: Any) -> None:
        c.append(tensor)  # a copy: the element to index is the one in the list
        self._ni = len(c)
        self._last_init = c[self._ni - 1]
        self._add_init_to_index(self._last_init)

    def _freeze_views(self) -> None:
        """Called by every change of the node list or of a node's inputs or outputs made through the index."""
        self._changes += 1
        if self._views:
            for view in list(self._views):
                view.freeze()
            self._views.clear()

    def readers(self, name: str) -> list[Any]:
        """``ONNXModel.input_name_to_nodes()[name]``: the nodes reading ``name`` in graph order, once per
        input slot (empty when none)."""
        self._sync_nodes()
        nodes = self._unique_live(self._readers.get(name, []))
        nodes = [n for n in nodes if name in n.input]
        self._readers[name] = list(nodes)
        nodes.sort(key=lambda n: self._live[id(n)][0])
        return [n for n in nodes for i in n.input if i == name]

    # -- the replaced methods (each does what ORT's does, element for element) -----------------------

    def replace_node_input(self, node: Any, old_input_name: str, new_input_name: str) -> None:  # type: ignore[override]
        self._sync_nodes()
        self._freeze_views()
        ONNXModel.replace_node_input(node, old_input_name, new_input_name)
        if self._is_live(node) and new_input_name in node.input:
            self._readers.setdefault(new_input_name, []).append(node)

    def _replace(self, old: str, new: str, names: Any, outputs: bool) -> None:
        self._sync_nodes()
        self._freeze_views()
        index = self._writers if outputs else self._readers  # after the sync: a rebuild makes new maps
        replace = ONNXModel.replace_node_output if outputs else ONNXModel.replace_node_input
        kept = []
        for node in self._unique_live(index.get(old, [])):
            slots = node.output if outputs else node.input
            if old not in slots:
                continue
            if names is None or node.name in names:
                replace(node, old, new)
                index.setdefault(new, []).append(node)
            else:
                kept.append(node)
        if old != new:
            index[old] = kept

    def replace_input_of_all_nodes(self, old_input_name: str, new_input_name: str) -> None:
        if not (isinstance(old_input_name, str) and isinstance(new_input_name, str)):
            return ONNXModel.replace_input_of_all_nodes(self, old_input_name, new_input_name)
        self._replace(old_input_name, new_input_name, None, outputs=False)
        return None

    def replace_input_of_nodes(self, old_input_name: str, new_input_name: str, node_names_set: Any) -> None:
        if not (isinstance(old_input_name, str) and isinstance(new_input_name, str)):
            return ONNXModel.replace_input_of_nodes(self, old_input_name, new_input_name, node_names_set)
        self._replace(old_input_name, new_input_name, node_names_set, outputs=False)
        return None

    def replace_output_of_all_nodes(self, old_output_name: str, new_output_name: str) -> None:
        if not (isinstance(old_output_name, str) and isinstance(new_output_name, str)):
            return ONNXModel.replace_output_of_all_nodes(self, old_output_name, new_output_name)
        self._replace(old_output_name, new_output_name, None, outputs=True)
        return None

    def replace_output_of_nodes(self, old_output_name: str, new_output_name: str, node_names_set: Any) -> None:
        if not (isinstance(old_output_name, str) and isinstance(new_output_name, str)):
            return ONNXModel.replace_output_of_nodes(self, old_output_name, new_output_name, node_names_set)
        self._replace(old_output_name, new_output_name, node_names_set, outputs=True)
        return None

    def input_name_to_nodes(self) -> Mapping[str, list[Any]]:  # type: ignore[override]
        view = _ReadersView(self)
        self._views.add(view)
        return view

    def add_node(self, node: Any) -> None:
        c = self._sync_nodes()
        self._freeze_views()
        c.extend([self._check_node(node)])  # a copy: the element to index is the one in the list
        self._n = len(c)
        self._last = c[self._n - 1]
        self._add_to_index(self._last)

    def qdq_node_addable(self, zero_point: str) -> bool:
        """True when ORT's ``_check_node`` passes a DequantizeLinear node reading the zero point ``zero_point``
        (an initializer of a type other than the float ones), as it passes every QuantizeLinear node."""
        init = self.get_initializer(zero_point)
        return init is not None and init.data_type not in _FLOAT_ZERO_POINTS

    def add_qdq_node(self, op_type: str, inputs: list[str], output: str, name: str, domain: str | None) -> None:
        """``add_node(onnx.helper.make_node(op_type, inputs, [output], name, domain=domain))`` for a per-tensor
        Q or DQ node that :meth:`qdq_node_addable` passes, made in place in the graph's node list rather than
        made, checked and copied in (8,400 nodes in a 3,200-node static build): the same message."""
        c = self._sync_nodes()
        self._freeze_views()
        node = c.add()
        node.op_type = op_type
        node.input.extend(inputs)
        node.output.append(output)
        if name:
            node.name = name
        if domain is not None:
            node.domain = domain
        self._n = len(c)
        self._last = c[self._n - 1]
        self._add_to_index(self._last, (inputs, [output], name or ""))

    def remove_node(self, node: Any) -> None:
        c = self._sync_nodes()
        victim = None
        if len(node.output):  # the first node equal to ``node`` (ORT's ``list.remove``) writes its output
            equal = [n for n in self._unique_live(self._writers.get(node.output[0], [])) if n == node]
            victim = min(equal, key=lambda n: self._live[id(n)][0]) if equal else None
        else:
            victim = next((n for n in c if n == node), None)
        if victim is None:
            return
        self._freeze_views()
        del c[self._position(c, victim, self._live)]
        del self._live[id(victim)]
        self._n = len(c)
        self._last = c[self._n - 1] if self._n else None

    def find_node_by_name(self, node_name: str, new_nodes_list: list[Any], graph: Any) -> Any:
        if graph is not self.model.graph or not isinstance(new_nodes_list, list):
            return ONNXModel.find_node_by_name(self, node_name, new_nodes_list, graph)
        self._sync_nodes()
        named = [n for n in self._unique_live(self._names.get(node_name, [])) if n.name == node_name]
        self._names[node_name] = named
        if named:  # the first in graph order, as ORT's scan of list(graph.node) + new_nodes_list finds
            return min(named, key=lambda n: self._live[id(n)][0])
        return self._first_named(new_nodes_list, node_name)

    def _first_named(self, items: list[Any], name: str) -> Any:
        """The first element of the Python list ``items`` named ``name``; the list (ORT's ``new_nodes``,
        which it only appends to) is indexed as it grows."""
        entry = self._lists.get(id(items))
        if entry is None or entry[0] is not items or entry[1] > len(items):
            entry = (items, 0, {})
        _, done, first = entry
        for k in range(done, len(items)):
            first.setdefault(items[k].name, k)
        self._lists[id(items)] = (items, len(items), first)
        k = first.get(name)
        if k is not None and items[k].name != name:  # renamed behind the index: index it again
            self._lists.pop(id(items))
            return self._first_named(items, name)
        return None if k is None else items[k]

    def get_initializer(self, name: str, c: Any = None) -> Any:
        """ORT's ``get_initializer``; ``c``: the graph's initializer list as the caller just read it
        (:func:`find_by_name`: 28,000 lookups in a 3,200-node static build)."""
        self._sync_inits(c)
        found = self._by_name.get(name)
        return found[0] if found else None

    def add_initializer(self, tensor: Any) -> None:
        c = self._sync_inits()
        if not self._by_name.get(tensor.name):
            self._check_init(tensor)
            self._append_init(c, tensor)

    def add_scalar_initializer(self, name: str, data_type: int, value: float) -> Any:
        """``add_initializer(scalar_tensor(name, data_type, value))``, the tensor made in place in the graph's
        initializer list rather than made and copied in (14,000 scales and zero points in a 3,200-node static
        build): the same message, and ORT's check passes it (it tests float8 only). Returns the element made,
        or None when the graph already holds ``name`` (``add_initializer`` then adds nothing)."""
        c = self._sync_inits()
        if self._by_name.get(name):
            return None
        return self.append_initializer(scalar_tensor, name, data_type, value, c=c)

    def append_initializer(self, maker: Callable[..., Any], *args: Any, c: Any = None) -> Any:
        """``initializer_extend([maker(*args)])`` for a tensor of a type other than float8 (whose check is
        ORT's only one) while the graph holds none (ORT then checks them all), made in place: ``maker``
        (:func:`scalar_tensor`, :func:`integer_tensor`) fills the element appended to the list. Returns it.
        ``c``: the initializer list as the caller just synced it."""
        c = self._sync_inits(c)
        maker(*args, into=c.add())
        self._ni = len(c)
        self._last_init = c[self._ni - 1]
        self._add_init_to_index(self._last_init)
        return self._last_init

    def initializer_extend(self, inits: Any) -> None:
        if len(inits) == 0:
            raise ValueError("Can add an empty list.")
        c = self._sync_inits()
        if self.holds_float8():  # only a float8 initializer can fail ORT's check: otherwise the scan is a no-op
            for init in c:
                self._check_init(init, "gain")
        for init in inits:
            self._check_init(init)
            self._append_init(c, init)

    def remove_initializer(self, tensor: Any) -> None:
        c = self._sync_inits()
        victim = next((t for t in self._by_name.get(tensor.name, []) if t == tensor), None)
        if victim is None:
            return
        del c[self._position(c, victim, self._ilive)]
        self._forget_init(victim)
        self._ni = len(c)
        self._last_init = c[self._ni - 1] if self._ni else None
        for graph_input in self.model.graph.input:
            if graph_input.name == tensor.name:
                self.model.graph.input.remove(graph_input)
                break

    def replace_gemm_with_matmul(self) -> dict[str, str]:
        """ORT's ``replace_gemm_with_matmul`` (the dynamic quantizer's first step). On a graph with no Gemm
        node and no node holding a subgraph ORT reads every tensor name (for the names of transposed
        weights it then makes none of), copies every node out of the graph and back -- the same nodes --
        and returns ``{}``: here the graph is left as it is (35 ms of a dynamic build at 3,200 nodes)."""
        if any(n.op_type == "Gemm" or (n.attribute and _holds_subgraph(n)) for n in self.model.graph.node):
            return super().replace_gemm_with_matmul()
        return {}

    def topological_sort(self) -> None:
        """ORT's ``ONNXModel.topological_sort`` step for step (Kahn's algorithm: the nodes without inputs in
        graph order, then those freed by the sorted graph inputs and initializers, then breadth first by
        outputs), each node's inputs and outputs read once -- or taken from the clean-up's reading just before
        (:meth:`_slots_read`) -- and the nodes by position in a Python list rather than through ``graph.node``
        per step; a graph already in that order is left as it is, where ORT clears the list and copies the
        same nodes back in (the dynamic model's save: 6,400 nodes at 3,200)."""
        graph = self.model.graph
        nodes = list(graph.node)
        slots = self._slots_read()
        deps_count = [0] * len(nodes)
        deps_to_nodes: dict[str, list[int]] = {}
        order: list[int] = []
        for k, node in enumerate(nodes):
            names = [name for name in (node.input if slots is None else slots[k][0]) if name]
            deps_count[k] = len(names)
            if not names:
                order.append(k)
            for name in names:
                deps_to_nodes.setdefault(name, []).append(k)
        previous = None
        for name in sorted([t.name for t in graph.initializer] + [i.name for i in graph.input]):
            if name == previous:
                continue
            previous = name
            for k in deps_to_nodes.get(name, ()):
                deps_count[k] -= 1
                if deps_count[k] == 0:
                    order.append(k)
        start = 0
        while start < len(order):
            for output in nodes[order[start]].output if slots is None else slots[order[start]][1]:
                for k in deps_to_nodes.get(output, ()):
                    deps_count[k] -= 1
                    if deps_count[k] == 0:
                        order.append(k)
            start += 1
        assert len(order) == len(graph.node), "Graph is not a DAG"
        if any(k != position for position, k in enumerate(order)):
            self._freeze_views()
            graph.ClearField("node")
            graph.node.extend([nodes[k] for k in order])

    def _slots_read(self) -> list[tuple[list[str], list[str]]] | None:
        """Each node's inputs and outputs as the clean-up read them (:meth:`GraphNames.read_nodes`), while the
        node list is the one it read and nothing changed through the index since -- the dynamic quantizer's
        last steps after its clean-up name itself and add an opset -- else None (read the nodes again)."""
        if self._slots is None:
            return None
        slots, stamp = self._slots
        return slots if self._unchanged_since(stamp) else None

    def clean_initializers(self) -> Any:
        read = GraphNames()
        self.check_in_step(read)  # before the node list may be rewritten (the index is rebuilt after)
        graph = self.model.graph
        if read.reads is None:  # the check did not compare the nodes: one pass for what the clean-up needs
            read.read_nodes(graph, slots=True)
        if _plainly_cleanable(graph, read):  # the nodes stay as they are
            c = self._sync_inits()
            in_step = self._ichecked == self._ichanges
            removed: list[Any] = []
            cleaned = clean_initializers(graph, removed, read)
            for tensor in removed:  # the order of the others is kept, and so are their sequence numbers
                self._forget_init(tensor)
            self._ni = len(c)
            self._last_init = c[self._ni - 1] if self._ni else None
            if in_step:  # the deletions were made by position on both sides: the index is still the list's
                self._ichecked = self._ichanges
                if read.written is not None:
                    self._final = (read, self._stamp())
            if read.slots is not None:  # the nodes were left as read: the sort may take their names
                self._slots = (read.slots, self._stamp())
            return cleaned
        return super().clean_initializers()

    def _stamp(self) -> tuple[Any, ...]:
        """What tells that the graph's lists are still the ones last read: each list, its length and last
        element, and the counts of changes made through the index."""
        nodes, inits = self.model.graph.node, self.model.graph.initializer
        return (
            nodes, len(nodes), nodes[len(nodes) - 1] if len(nodes) else None, self._changes,
            inits, len(inits), inits[len(inits) - 1] if len(inits) else None, self._ichanges,
        )  # fmt: skip

    def final_names(self) -> GraphNames | None:
        """The names the clean-up's index check read off the quantized graph (its outputs in order, their
        producers, the initializers kept), when the graph's lists are still those it read and nothing was
        changed through the index since: after the clean-up ORT's quantizer only names itself in the model
        and adds an opset (``QDQQuantizer.quantize_model``). None otherwise (read the graph again)."""
        final = self._final
        if final is None:
            return None
        read, stamp = final
        return read if self._unchanged_since(stamp) else None

    def _unchanged_since(self, stamp: tuple[Any, ...]) -> bool:
        """The graph's lists are those :meth:`_stamp` gave ``stamp`` for, and nothing changed through the index."""
        return all(a is b or (type(a) is int and a == b) for a, b in zip(self._stamp(), stamp, strict=True))

    # -- the check ------------------------------------------------------------------------------------

    def check_in_step(self, read: GraphNames | None = None) -> bool:
        """Raise :class:`IndexOutOfStep` unless the index says what a fresh scan of the graph says; True when
        the node list was compared. ``read`` gets what the comparison read on the way -- the names the nodes
        read and write and whether one holds a subgraph when the nodes were compared, the initializers' names
        when they were -- for the clean-up of initializers, which needs them all (one pass over 11,200 nodes
        and 16,400 initializers instead of three, at 3,200 nodes).

        A list the tripwire sees changed (ORT rewrote the node list after its last indexed lookup) is not
        compared: the index will be rebuilt from it before it is used again. Nor is a node list this check
        found in step with no change made through the index since: the end-of-run check right after the
        clean-up of initializers (which leaves the nodes alone, :func:`clean_initializers`) would compare
        what the clean-up's own check just compared (0.1 s at 3,200 nodes). The initializer list likewise,
        where the clean-up's own deletions (made by position in the list and the index alike) are the only
        change since (0.03 s).
        """
        c = self.model.graph.node
        compared = not self._nodes_moved(c) and self._checked != self._changes
        if compared:
            self._check_nodes(c, read)
            self._checked = self._changes
        for items, done, first in self._lists.values():
            fresh: dict[str, int] = {}
            for k, item in enumerate(items[:done]):
                fresh.setdefault(item.name, k)
            if fresh != first:
                raise IndexOutOfStep("a list of new nodes changed behind the index")
        inits = self.model.graph.initializer
        if not self._inits_moved(inits) and self._ichecked != self._ichanges:
            self._check_inits(inits, read)
            self._ichecked = self._ichanges
        return compared

    def _check_inits(self, inits: Any, read: GraphNames | None = None) -> None:
        """The initializers of each name, in list order, are the ones the index holds, and no others.

        Where every name is held once (the usual graph) that is: each initializer is the one its name holds,
        and the index holds as many as the list -- a lookup per initializer: 9 ms against 30 ms for building
        and comparing a map of lists over the 14,000 initializers of a 3,200-node static model. A repeated
        name takes that comparison. ``read`` gets the names, in list order."""
        if len(self._ilive) != len(inits) or sum(len(ts) for ts in self._by_name.values()) != len(inits):
            raise IndexOutOfStep("the initializer list changed behind the index")
        names = [t.name for t in inits]
        if read is not None:
            read.initializers = names
        find = self._by_name.get
        for t, name in zip(inits, names):  # noqa: B905 -- one list and its own names
            held = find(name)
            if held is None or len(held) != 1 or held[0] is not t:
                if held is not None and len(held) > 1:
                    break  # a repeated name: compare the lists
                raise IndexOutOfStep("the initializer list changed behind the index")
        else:
            return
        expected: dict[str, list[int]] = {}
        for t, name in zip(inits, names):  # noqa: B905
            expected.setdefault(name, []).append(id(t))
        indexed = {name: [id(t) for t in ts] for name, ts in self._by_name.items() if ts}
        if expected != indexed:  # the counts were compared above
            raise IndexOutOfStep("the initializer list changed behind the index")

    def _check_nodes(self, c: Any, read: GraphNames | None = None) -> None:
        """Every node of ``c`` is indexed where it is, in order, and is among the readers / writers the index
        holds for each of its inputs / outputs (compared by identity: the lists are one or two nodes long);
        ``read`` gets the names the nodes read and write, and whether one holds a subgraph."""
        live, readers, writers = self._live, self._readers, self._writers
        reads: set[str] = set()
        written: list[str] = []
        producer: dict[str, Any] = {}
        subgraph = False
        if len(c) != len(live):
            raise IndexOutOfStep(f"{len(live)} nodes indexed, {len(c)} in the graph")
        last = -1
        for node in c:
            entry = live.get(id(node))
            if entry is None or entry[1] is not node or entry[0] <= last:
                raise IndexOutOfStep(f"node {node.name!r} is not indexed where it is")
            last = entry[0]
            for name in node.input:
                if not _held(readers, name, node):
                    raise IndexOutOfStep(f"the inputs of node {node.name!r} changed behind the index")
                reads.add(name)
            for name in node.output:
                if not _held(writers, name, node):
                    raise IndexOutOfStep(f"the outputs of node {node.name!r} changed behind the index")
                written.append(name)
                producer[name] = node
            if not subgraph and node.attribute:
                subgraph = _holds_subgraph(node)
        if read is not None:
            read.reads, read.writes, read.subgraph = reads, set(written), subgraph
            read.written, read.producer = written, producer


class GraphNames:
    """What the clean-up of initializers reads off a graph, each read once (reading a name off a protobuf
    message is ~1 us from Python): ``reads`` / ``writes``, the names its nodes read and write; ``subgraph``,
    whether a node holds one; ``initializers``, the initializers' names in list order (after the clean-up:
    those it kept). The index check also records ``written`` (every node output in order, empty ones
    included) and ``producer`` (output -> the last node writing it), which the checks after the quantizer
    take for the result's names (:meth:`IndexedModel.final_names`). None: not read yet."""

    __slots__ = ("reads", "writes", "subgraph", "initializers", "written", "producer", "slots")

    def __init__(self) -> None:
        self.reads: set[str] | None = None
        self.writes: set[str] | None = None
        self.subgraph = False
        self.initializers: list[str] | None = None
        self.written: list[str] | None = None
        self.producer: dict[str, Any] | None = None
        self.slots: list[tuple[list[str], list[str]]] | None = None

    def read_nodes(self, graph: Any, slots: bool = False) -> None:
        """The nodes' part, in one pass; ``slots``: keep each node's inputs and outputs too (the dynamic
        model's topological sort reads them next: :meth:`IndexedModel.topological_sort`)."""
        reads: set[str] = set()
        writes: set[str] = set()
        kept: list[tuple[list[str], list[str]]] = []
        subgraph = False
        for node in graph.node:
            if slots:
                inputs, outputs = list(node.input), list(node.output)
                kept.append((inputs, outputs))
                reads.update(inputs)
                writes.update(outputs)
            else:
                reads.update(node.input)
                writes.update(node.output)
            if not subgraph and node.attribute:
                subgraph = _holds_subgraph(node)
        self.reads, self.writes, self.subgraph = reads, writes, subgraph
        self.slots = kept if slots else None

    def initializer_names(self, graph: Any) -> list[str]:
        if self.initializers is None:
            self.initializers = [t.name for t in graph.initializer]
        return self.initializers


_FLOAT_ZERO_POINTS = frozenset(
    (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)
)
"""The zero-point types ORT's ``ONNXModel._check_node`` refuses in a DequantizeLinear node."""

_SUBGRAPH_KINDS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _held(index: dict[str, list[Any]], name: str, node: Any) -> bool:
    """``node`` is among the nodes ``index`` holds for ``name`` (by identity: the lists are one or two long)."""
    for known in index.get(name, ()):
        if known is node:
            return True
    return False


def _holds_subgraph(node: Any) -> bool:
    return any(a.type in _SUBGRAPH_KINDS for a in node.attribute)


def _plainly_cleanable(graph: Any, read: GraphNames | None = None) -> bool:
    """True when :func:`clean_initializers` gives what ORT's ``_clean_initializers_helper`` does: no node holds
    a subgraph (ORT rebuilds such a node) and no initializer or graph input name repeats (ORT removes the
    first element *equal* to each unused one, which a repeated name can make another element). ``read``:
    what was read of the graph already (:class:`GraphNames`)."""
    if read is None:
        read = GraphNames()
        read.read_nodes(graph)
    if read.subgraph:
        return False
    inits = read.initializer_names(graph)
    inputs = [i.name for i in graph.input]
    return len(set(inits)) == len(inits) and len(set(inputs)) == len(inputs)


def clean_initializers(
    graph: Any, removed: list[Any] | None = None, read: GraphNames | None = None
) -> tuple[Any, set[str]]:
    """ORT's ``_clean_initializers_helper`` for a graph :func:`_plainly_cleanable` accepts, in one pass.

    ORT copies every node out of the graph and back (the same nodes, where none holds a subgraph) and
    removes each unused initializer, and its graph input, with ``list.remove`` -- a scan comparing protobuf
    messages, per removal. Here the nodes stay and the unused elements are deleted by position: the same
    graph (13-17 % of a dynamic build at 3,200 nodes). Returns what ORT's returns: the graph and the names
    read but produced by nothing in it; ``removed`` gets the initializers taken out. ``read``: what the
    caller has just read of the graph (:meth:`IndexedModel.check_in_step`, :class:`GraphNames`)."""
    if read is None:
        read = GraphNames()
    if read.reads is None or read.writes is None:
        read.read_nodes(graph)
    assert read.reads is not None and read.writes is not None
    requesting = set(read.reads)
    requesting.discard("")
    requesting.update(out.name for out in graph.output if out.name)
    requesting.difference_update(read.writes)
    names = read.initializer_names(graph)
    unused = [k for k, name in enumerate(names) if name not in requesting]  # the names are unique here
    requesting.difference_update(names)
    gone = {names[k] for k in unused}
    read.initializers = [name for name in names if name not in gone] if gone else names
    if removed is not None:
        removed.extend(graph.initializer[k] for k in unused)
    for k in reversed(unused):
        del graph.initializer[k]
    for k in reversed([k for k, graph_input in enumerate(graph.input) if graph_input.name in gone]):
        del graph.input[k]
    requesting.difference_update(graph_input.name for graph_input in graph.input)
    return graph, requesting


# --- the quantizer subclass and the find_by_name swap -------------------------------------------------

_CLASSES: dict[type, type] = {}


def indexed(quantizer_class: type) -> type:
    """A subclass of ORT's ``quantizer_class`` whose ``model`` is an :class:`IndexedModel` over the same proto,
    whose ``new_nodes`` list indexes its names (:class:`NamedList`), and -- for ``QDQQuantizer`` -- whose
    per-channel weights get their scales and zero points in one pass over all channels
    (:func:`calc_initializer_quant_params`)."""
    if quantizer_class not in _CLASSES:

        def get(self: Any) -> Any:
            return self.__dict__["_qdebug_indexed_model"]

        def put(self: Any, value: Any) -> None:
            if type(value) is ONNXModel:
                value = IndexedModel(value.model)
            self.__dict__["_qdebug_indexed_model"] = value

        def get_new(self: Any) -> Any:
            return self.__dict__["_qdebug_new_nodes"]

        def put_new(self: Any, value: Any) -> None:
            self.__dict__["_qdebug_new_nodes"] = NamedList(value) if type(value) is list else value

        body: dict[str, Any] = {
            "model": property(get, put),
            "new_nodes": property(get_new, put_new),
            "__module__": __name__,
        }
        if issubclass(quantizer_class, ONNXQuantizer) and (
            quantizer_class.quantize_initializer_impl is BaseQuantizer.quantize_initializer_impl
        ):  # not overridden by a subclass: ORT's method is the one replaced
            body["quantize_initializer_impl"] = quantize_initializer_impl
        if issubclass(quantizer_class, QDQQuantizer):
            if quantizer_class.quantize_bias_static_impl is BaseQuantizer.quantize_bias_static_impl:
                body["quantize_bias_static_impl"] = quantize_bias_static_impl
            body["_calc_initializer_quant_params"] = calc_initializer_quant_params
            body["_make_scale_zp_initializers"] = make_scale_zp_initializers
            body["calc_graph_quant_params"] = calc_graph_quant_params
            body["_create_qdq_nodes"] = create_qdq_nodes
            body["_create_q_node"] = create_q_node
            body["_create_dq_node"] = create_dq_node
        _CLASSES[quantizer_class] = type(f"Indexed{quantizer_class.__name__}", (quantizer_class,), body)
    return _CLASSES[quantizer_class]


class NamedList(list):
    """ORT's ``new_nodes`` (the nodes a quantizer makes, appended as it goes) with the first position of each
    name kept as the list grows, so that ``find_by_name(name, quantizer.new_nodes)`` -- asked once per
    quantized MatMul or Conv by ORT's dynamic quantizer, and a miss nearly always -- is a dict lookup, not a
    scan of every node made so far. Appending (``append``, ``extend``, ``+=``) is indexed lazily; any other
    change through the list's methods drops the index. A node renamed after it was appended is seen when
    its old name is asked for (the index is rebuilt) -- ORT names its nodes when it makes them.
    """

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self._first: dict[str, int] = {}
        self._done = 0

    def _forget(self) -> None:
        self._first, self._done = {}, 0

    def first_named(self, name: str) -> Any:
        """What ORT's ``find_by_name(name, self)`` returns: the first element named ``name``, else None."""
        if self._done > len(self):
            self._forget()
        for k in range(self._done, len(self)):
            self._first.setdefault(list.__getitem__(self, k).name, k)
        self._done = len(self)
        k = self._first.get(name)
        if k is None:
            return None
        item = list.__getitem__(self, k)
        if item.name != name:
            self._forget()
            return self.first_named(name)
        return item


def _dropping_index(method: Callable[..., Any]) -> Callable[..., Any]:
    def changed(self: NamedList, *args: Any, **kwargs: Any) -> Any:
        self._forget()
        return method(self, *args, **kwargs)

    changed.__name__ = method.__name__
    return changed


for _name in ("__setitem__", "__delitem__", "insert", "pop", "remove", "sort", "reverse", "clear", "__imul__"):
    setattr(NamedList, _name, _dropping_index(getattr(list, _name)))


def calc_initializer_quant_params(self: Any) -> dict[str, QuantizationParams]:
    """``QDQQuantizer._calc_initializer_quant_params`` with the plain initializers (float32, finite, non-empty,
    an 8- or 16-bit integer type, no scale, zero-point or range override, not block-wise) done in bulk: each
    per-channel weight over all its channels at once (:func:`channel_quant_params`), and the per-tensor ones
    grouped by type, symmetry and reduce_range, one vector pass per group (:func:`range_quant_params`).
    Everything else is ORT's own loop (``compute_data_quant_params`` per tensor and per channel: 12,800 calls
    of ~40 us for the per-channel weights of the 800 MatMuls of a 3,200-node graph, 2,400 of ~80 us for its
    per-tensor initializers). The result has ORT's entries, in ORT's order."""
    everything = self.tensors_to_quantize
    ours: dict[str, QuantizationParams] = {}
    ranged: dict[tuple[int, bool, bool], list[tuple[str, Any, Any]]] = {}
    kept: dict[str, tuple[Any, np.ndarray]] = {}
    room = PREQUANTIZE_MAX_BYTES if isinstance(self.model, IndexedModel) and not self.add_qdq_pair_to_weight else 0
    for name, info in everything.items():
        params = _vector_params(self, name, info)
        if params is not None:
            ours[name] = params
            continue
        found = _tensor_range(self, name, info)
        if found is not None:
            ranged.setdefault(found[0], []).append((name, *found[1]))
            data = found[2]
            if data.dtype == np.float32 and data.size <= PREQUANTIZE_MAX_ELEMENTS and data.nbytes <= room:
                kept[name] = (found[3], data)
                room -= data.nbytes
    for name, zero_point, scale, quant_type in _grouped_params(ranged, self.min_real_range):
        ours[name] = QuantizationParams(zero_point=zero_point, scale=scale, quant_type=quant_type, axis=None)
    if kept:
        self.model.prequantized.update(_prequantized(kept, ours))
    if not ours:
        return QDQQuantizer._calc_initializer_quant_params(self)
    self.tensors_to_quantize = {k: v for k, v in everything.items() if k not in ours}
    try:
        theirs = QDQQuantizer._calc_initializer_quant_params(self)
    finally:
        self.tensors_to_quantize = everything
    return {k: ours[k] if k in ours else theirs[k] for k in everything if k in ours or k in theirs}


PREQUANTIZE_MAX_ELEMENTS = 1 << 16
"""Per-tensor weights up to this size are quantized in bulk (above it ORT's per-call cost is small beside the
arithmetic)."""
PREQUANTIZE_MAX_BYTES = 64 << 20
"""The float data :func:`calc_initializer_quant_params` keeps for that in all; the weights beyond it are ORT's."""
_PREQUANTIZE_CHUNK = 1 << 20


def _prequantized(
    kept: Mapping[str, tuple[Any, np.ndarray]], params: Mapping[str, QuantizationParams]
) -> Iterator[tuple[str, tuple[Any, Any, Any, int, tuple[bytes, bytes], np.ndarray]]]:
    """(name, (initializer, zero point, scale, type, their bytes, quantized data)) for each kept per-tensor
    weight: what ORT's ``quantize_nparray(type, data.ravel(), scale, zero_point)`` gives it, computed for a
    group of weights of one type at once (each element divided by its weight's float32 scale, rounded, its
    zero point added -- an integer array added to float32 gives float32, as the 0-d one does -- clipped and
    cast: the same steps, in the same dtypes), in chunks of about :data:`_PREQUANTIZE_CHUNK` elements.
    ``quantize_nparray`` costs ~0.2 ms a call in numpy's per-call overhead: 800 weights at 3,200 nodes."""
    groups: dict[tuple[int, Any], list[str]] = {}
    for name in kept:
        p = params.get(name)
        zp, scale = (p["zero_point"], p["scale"]) if p is not None else (None, None)
        if not (isinstance(zp, np.ndarray) and isinstance(scale, np.ndarray)):
            continue
        if zp.shape != () or scale.shape != () or scale.dtype != np.float32 or p["quant_type"] not in _VECTOR_TYPES:
            continue
        groups.setdefault((p["quant_type"], zp.dtype), []).append(name)
    for (quant_type, _), names in groups.items():
        entries = [(kept[n][1], params[n]["scale"], params[n]["zero_point"]) for n in names]
        for n, piece in zip(names, _quantized_in_bulk(entries, quant_type), strict=True):
            p = params[n]
            made = (p["zero_point"].tobytes(), p["scale"].tobytes())
            yield n, (kept[n][0], p["zero_point"], p["scale"], quant_type, made, piece)


def _quantized_in_bulk(entries: Sequence[tuple[np.ndarray, Any, Any]], quant_type: int) -> Iterator[np.ndarray]:
    """``quantize_nparray(quant_type, data.ravel(), scale, zero_point)`` of each (float32 data, 0-d float32
    scale, 0-d zero point of one dtype), as one vector pass per chunk of about :data:`_PREQUANTIZE_CHUNK`
    elements: the same division, rounding, addition, clip and cast, in the same dtypes."""
    qmin, qmax = quant_utils.get_qmin_qmax_for_qType(quant_type, reduce_range=False, symmetric=False)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(quant_type)
    start = 0
    while start < len(entries):
        chunk, size = [], 0
        while start < len(entries) and (not chunk or size + entries[start][0].size <= _PREQUANTIZE_CHUNK):
            chunk.append(entries[start])
            size += entries[start][0].size
            start += 1
        sizes = [data.size for data, _, _ in chunk]
        flat = np.concatenate([data.ravel() for data, _, _ in chunk])
        scales = np.repeat(np.array([scale for _, scale, _ in chunk], dtype=np.float32), sizes)
        zps = np.repeat(np.array([zp for _, _, zp in chunk]), sizes)
        q = np.asarray((flat / scales).round() + zps)
        np.clip(q, qmin, qmax, out=q)
        yield from np.split(q.astype(dtype), np.cumsum(sizes)[:-1])


# --- the dynamic (and QOperator) quantizer's weights in bulk ----------------------------------------------

_PLAIN_QUANTIZE_DATA = getattr(quant_utils, "quantize_data", None)


def quantize_data(
    data: Any,
    qType: int,  # noqa: N803 -- ORT's parameter names: its callers pass some by keyword
    symmetric: bool,
    reduce_range: bool = False,
    min_real_range: float | None = None,
    rmin_override: float | None = None,
    rmax_override: float | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ORT's ``quantize_data`` (``BaseQuantizer.quantize_initializer_impl`` calls it once per weight of the
    dynamic and QOperator quantizers: ~0.3 ms each in numpy's per-call overhead, 800 weights at 3,200 nodes).

    The result is a function of the arguments' values only, so it is looked up by them: the first call for
    an active indexed model and a set of options computes (zero point, scale, data) for every small float32
    weight of rank >= 2 in its graph at once -- the ranges through :func:`range_quant_params`, the data
    through :func:`_quantized_in_bulk` -- keyed by those options and the weight's bytes, and each call whose
    flattened data is one of them gets that answer. Anything else (overrides, other dtypes, NaN or inf, a
    weight made after) is ORT's own function."""
    plain = (
        rmin_override is None
        and rmax_override is None
        and isinstance(data, np.ndarray)
        and data.dtype == np.float32
        and data.ndim == 1
        and 0 < data.size <= PREQUANTIZE_MAX_ELEMENTS
        and qType in _VECTOR_TYPES
        and not _NUMPY_1
        and not isinstance(min_real_range, np.ndarray)
    )
    if plain:
        options = (qType, bool(symmetric), bool(reduce_range), min_real_range)
        key = data.tobytes()
        for model in tuple(_ACTIVE):
            table = model.data_quantized.get(options)
            if table is None:
                table = model.data_quantized[options] = _weights_quantized(model.model, *options)
            found = table.get(key)
            if found is not None:
                return found
    return _PLAIN_QUANTIZE_DATA(data, qType, symmetric, reduce_range, min_real_range, rmin_override, rmax_override)


def _weights_quantized(
    model: onnx.ModelProto, quant_type: int, symmetric: bool, reduce_range: bool, min_real_range: float | None
) -> dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """weight bytes -> ``quantize_data``'s (zero point, scale, data) of every small, finite float32
    initializer of rank >= 2 (weights: a bias or norm parameter left to ORT costs nothing but ORT's time),
    :data:`PREQUANTIZE_MAX_BYTES` of them at most."""
    room = PREQUANTIZE_MAX_BYTES
    datas: dict[bytes, np.ndarray] = {}
    for tensor in model.graph.initializer:
        if tensor.data_type != onnx.TensorProto.FLOAT or len(tensor.dims) < 2:
            continue
        size = math.prod(tensor.dims)
        if not 0 < size <= PREQUANTIZE_MAX_ELEMENTS or 4 * size > room:
            continue
        data = float32_array(tensor).flatten()
        if not np.isfinite(data).all():
            continue
        datas.setdefault(data.tobytes(), data)
        room -= data.nbytes
    if not datas:
        return {}
    keys = list(datas)
    rmin = np.array([datas[k].min() for k in keys], dtype=np.float32)
    rmax = np.array([datas[k].max() for k in keys], dtype=np.float32)
    zps, scales = range_quant_params(rmin, rmax, quant_type, symmetric, reduce_range, min_real_range)
    params = [(np.array(zp), np.array(scale)) for zp, scale in zip(zps, scales, strict=True)]
    entries = [(datas[k], scale, zp) for k, (zp, scale) in zip(keys, params, strict=True)]
    pieces = _quantized_in_bulk(entries, quant_type)
    return {k: (zp, scale, piece) for k, (zp, scale), piece in zip(keys, params, pieces, strict=True)}


def quantize_initializer_impl(
    self: Any, weight: onnx.TensorProto, qType: int, reduce_range: bool = False, keep_float_weight: bool = False  # noqa: N803
) -> tuple[str, str, str]:
    """``BaseQuantizer.quantize_initializer_impl`` (the dynamic and QOperator quantizers' per-weight step: 800
    weights at 3,200 nodes) for a float32 weight without overrides quantized to an 8- or 16-bit type, into an
    indexed model holding no float8 initializer: ORT's steps in ORT's order, the scale, zero point and
    quantized weight made in place in the initializer list (:meth:`IndexedModel.append_initializer`) instead
    of by ``make_tensor`` / ``from_array`` and copied in by ``initializer_extend`` -- the same tensors,
    appended in the same order (``initializer_extend`` appends whatever the names). Anything else is ORT's
    own method."""
    model = self.model
    plain = (
        type(model) is IndexedModel
        and not model.holds_float8()
        and weight.data_type == onnx.TensorProto.FLOAT
        and qType in _VECTOR_TYPES
        and self.weight_qType != onnx.TensorProto.FLOAT8E4M3FN
    )
    if not plain:
        return _PLAIN_QUANTIZE_INITIALIZER_IMPL(self, weight, qType, reduce_range, keep_float_weight)
    q_weight_name = weight.name + quant_utils.TENSOR_NAME_QUANT_SUFFIX
    zp_name = weight.name + "_zero_point"
    scale_name = weight.name + "_scale"
    weight_data = float32_array(weight)  # ORT's tensor_proto_to_array: to_array for a float32 weight
    if self.tensor_quant_overrides.get_per_tensor_overrides(weight.name, default_val={}):
        return _PLAIN_QUANTIZE_INITIALIZER_IMPL(self, weight, qType, reduce_range, keep_float_weight)
    symmetric = self.is_weight_symmetric(qType) if qType == self.weight_qType else self.is_activation_symmetric
    zero_point, scale, q_weight_data = quantize_data(
        weight_data.flatten(), qType, symmetric, reduce_range=self.reduce_range and reduce_range,
        min_real_range=self.min_real_range, rmin_override=None, rmax_override=None,
    )  # fmt: skip
    assert isinstance(zero_point, np.ndarray), f"Unexpected type {type(zero_point)}"
    assert zero_point.dtype != np.float32 and zero_point.dtype != np.float16, f"Unexpected dtype {zero_point.dtype}"
    assert isinstance(scale, np.ndarray), f"Unexpected type {type(scale)}"
    if scale.size == 1 and zero_point.size == 1:
        model.append_initializer(scalar_tensor, scale_name, onnx.TensorProto.FLOAT, float(scale.reshape(-1)[0]))
        model.append_initializer(scalar_tensor, zp_name, qType, int(zero_point.reshape(-1)[0]))
    else:  # make_tensor raises on the shape, as in ORT's method
        scale_initializer = onnx.helper.make_tensor(scale_name, weight.data_type, [], scale.reshape((-1,)).tolist())
        zero_initializer = onnx.helper.make_tensor(zp_name, qType, [], zero_point.reshape((-1,)).tolist())
        model.initializer_extend([scale_initializer, zero_initializer])
    if not keep_float_weight:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(qType)
        model.append_initializer(integer_tensor, np.asarray(q_weight_data, dtype=dtype).reshape(weight.dims),
                                 q_weight_name, qType)  # fmt: skip
    return q_weight_name, zp_name, scale_name


_PLAIN_QUANTIZE_INITIALIZER_IMPL = getattr(BaseQuantizer, "quantize_initializer_impl", None)


def quantize_bias_static_impl(
    self: Any, bias_name: str, input_scale: Any, weight_scale: Any, beta: float = 1.0, bias_scale_dtype: Any = None
) -> tuple[str, str, str, np.ndarray, str, int]:
    """``BaseQuantizer.quantize_bias_static_impl`` (the static quantizer's int32 bias, 800 at 3,200 nodes) for a
    float32 bias of an integer-typed weight, into an indexed model holding no float8 initializer: ORT's steps
    in ORT's order -- the scale, the division in float64, the rounding, the range warning, the clip -- with
    the quantized bias, its scale and its zero point made in place in the initializer list
    (:meth:`IndexedModel.append_initializer`) instead of by ``from_array`` / ``make_tensor`` and copied in by
    ``initializer_extend``: the same tensors, appended in the same order. Anything else is ORT's method."""
    model = self.model
    plain = (
        type(model) is IndexedModel
        and not model.holds_float8()
        and self.weight_qType != onnx.TensorProto.FLOAT8E4M3FN
        and bias_scale_dtype is None
    )
    bias_initializer = model.get_initializer(bias_name) if plain else None
    if bias_initializer is None or bias_initializer.data_type != onnx.TensorProto.FLOAT:
        return _PLAIN_QUANTIZE_BIAS_IMPL(self, bias_name, input_scale, weight_scale, beta, bias_scale_dtype)
    bias_data = float32_array(bias_initializer)
    if beta == 0:
        bias_data = np.zeros_like(bias_data)
        beta = 1.0
    quantized_bias_name = bias_name + quant_utils.TENSOR_NAME_QUANT_SUFFIX
    bias_scale = input_scale * weight_scale * beta
    quantized = (np.asarray(bias_data, dtype=np.float64) / np.asarray(bias_scale, dtype=np.float64)).round()
    low, high = np.float64(np.iinfo(np.int32).min), np.float64(np.iinfo(np.int32).max)
    if np.any(quantized < low) or np.any(quantized > high):
        logging.warning(f"Quantized bias `{bias_name}` exceeds the range of a int32. The bias scale is too small.")
    data = np.asarray(np.clip(quantized, low, high).astype(np.int32), dtype=np.int32).reshape(bias_initializer.dims)
    model.append_initializer(raw_tensor, data, quantized_bias_name, onnx.TensorProto.INT32)
    bias_scale_data = np.asarray(bias_scale, dtype=bias_data.dtype).reshape(-1)
    scale_name = quantized_bias_name + "_scale"
    model.append_initializer(raw_tensor, bias_scale_data, scale_name, onnx.TensorProto.FLOAT)
    zp_name = quantized_bias_name + "_zero_point"
    if bias_scale.size > 1:
        zeros = np.zeros(bias_scale.shape, dtype=np.int32).reshape(-1)
        model.append_initializer(raw_tensor, zeros, zp_name, onnx.TensorProto.INT32)
    else:
        model.append_initializer(scalar_tensor, zp_name, onnx.TensorProto.INT32, 0)
    return quantized_bias_name, scale_name, zp_name, bias_scale_data, "DequantizeLinear", self.weight_qType


_PLAIN_QUANTIZE_BIAS_IMPL = getattr(BaseQuantizer, "quantize_bias_static_impl", None)


def calc_graph_quant_params(self: Any) -> dict[str, Any]:
    """``QDQQuantizer.calc_graph_quant_params`` with the plain activation ranges done in bulk: tensors whose
    parameters ORT's ``calc_quant_params`` computes from their own float32 range (finite, one value each;
    an 8- or 16-bit type; no scale, zero-point, range or ``convert`` override; not ORT's restricted-asymmetric
    uint8) are grouped by type, symmetry and reduce_range and computed in one :func:`range_quant_params` pass
    per group -- ORT's ``compute_scale_zp`` steps element for element. The others are ORT's own
    ``calc_quant_params``, as in ORT's loop (5,200 tensors of ~26 us each at 3,200 nodes). Same entries, ORT's
    order, the ranges adjusted first by ORT's ``adjust_tensor_ranges``."""
    if self.tensors_range is None:
        return {}
    self.adjust_tensor_ranges()
    out: dict[str, Any] = {}
    groups: dict[tuple[int, bool, bool], list[tuple[str, Any, Any]]] = {}
    for name in self.tensors_range:
        td = self.tensors_range[name]
        if not isinstance(td, TensorData):
            raise TypeError(f"Unexpected type {type(td)} for {name!r}.")
        overrides = self.tensor_quant_overrides.get_per_tensor_overrides(name, default_val={})
        found = _activation_range(self, td, overrides)
        if found is None:
            original = self.calc_quant_params(td, overrides)
            converted = recv_nodes = None
            if "convert" in overrides:
                converted = self.calc_quant_params(td, overrides["convert"])
                recv_nodes = overrides["convert"].get("recv_nodes")
            out[name] = QDQTensorQuantParams(original, converted, recv_nodes)
        else:
            out[name] = None  # its place in ORT's order
            groups.setdefault(found[0], []).append((name, *found[1]))
    for name, zero_point, scale, quant_type in _grouped_params(groups, self.min_real_range):
        params = QuantizationParams(zero_point=zero_point, scale=scale, quant_type=quant_type)
        out[name] = QDQTensorQuantParams(params, None, None)
    return out


def _grouped_params(
    groups: Mapping[tuple[int, bool, bool], Sequence[tuple[str, Any, Any]]], min_real_range: float | None
) -> Iterator[tuple[str, np.ndarray, np.ndarray, int]]:
    """(name, zero point, scale, type) of each ``(name, lowest, highest)`` of each (type, symmetric,
    reduce_range) group, one :func:`range_quant_params` pass per group; the parameters as ORT's 0-d arrays."""
    for (quant_type, symmetric, reduce_range), entries in groups.items():
        rmin = np.array([e[1] for e in entries], dtype=np.float32)
        rmax = np.array([e[2] for e in entries], dtype=np.float32)
        zps, scales = range_quant_params(rmin, rmax, quant_type, symmetric, reduce_range, min_real_range)
        for (name, _, _), zp, scale in zip(entries, zps, scales, strict=True):
            yield name, np.array(zp), np.array(scale), quant_type


_COMPUTED_ELSEWHERE = ("scale", "zero_point", "convert", "rmin", "rmax")
"""Per-tensor overrides with which ORT's ``calc_quant_params`` takes another branch, or other inputs."""


def _activation_range(
    self: Any, td: Any, overrides: dict[str, Any]
) -> tuple[tuple[int, bool, bool], tuple[Any, Any]] | None:
    """((quant type, symmetric, reduce_range), (lowest, highest)) of a tensor whose parameters ORT's
    ``calc_quant_params`` computes from its own range, where :func:`range_quant_params` gives ORT's bits; None
    for every other branch (ORT's conditions, in its order)."""
    quant_type = overrides["quant_type"].tensor_type if "quant_type" in overrides else self.activation_qType
    if quant_type not in _VECTOR_TYPES or any(k in overrides for k in _COMPUTED_ELSEWHERE):
        return None
    symmetric = bool(overrides.get("symmetric", self.is_activation_symmetric))
    if self.is_activation_restricted_asymmetric and quant_type == onnx.TensorProto.UINT8 and not symmetric:
        return None
    lowest, highest = getattr(td, "lowest", None), getattr(td, "highest", None)
    values = []
    for v in (lowest, highest):
        if not isinstance(v, (np.ndarray, np.floating)) or v.dtype != np.float32 or v.size != 1:
            return None
        value = np.float32(v.reshape(()) if isinstance(v, np.ndarray) else v)
        if not np.isfinite(value):
            return None
        values.append(value)
    return (quant_type, symmetric, bool(overrides.get("reduce_range", False))), (values[0], values[1])


def _tensor_range(
    self: Any, name: str, info: Any
) -> tuple[tuple[int, bool, bool], tuple[Any, Any], np.ndarray, Any] | None:
    """For an initializer ORT's loop quantizes per tensor from its own data: ((quant type, symmetric,
    reduce_range), (min, max of the data), the data, the initializer); None where ORT takes another branch,
    or the data is one :func:`range_quant_params` leaves to ORT (the branch conditions are ORT's, in its
    order)."""
    head = _computed_initializer(self, name, info)
    if head is None:
        return None
    initializer, is_weight, quant_type, overrides = head
    if overrides[0].get("axis", info.axis) is not None or (is_weight and self.block_size > 0):
        return None
    if quant_type not in _VECTOR_TYPES or overrides[0].get("rmin") is not None or overrides[0].get("rmax") is not None:
        return None
    data = float32_array(initializer)
    if data.size == 0 or not np.isfinite(data).all():
        return None  # ORT's empty-data branch; NaN and inf take Python's max and integer casts there
    symmetric = overrides[0].get(
        "symmetric", self.is_weight_symmetric(quant_type) if is_weight else self.is_activation_symmetric
    )
    reduce_range = overrides[0].get("reduce_range", self.reduce_range)
    return (quant_type, bool(symmetric), bool(reduce_range)), (data.min(), data.max()), data, initializer


def make_scale_zp_initializers(
    self: Any, param_name: str, quant_params: QuantizationParams, init_name_suffix: str = ""
) -> Any:
    """``QDQQuantizer._make_scale_zp_initializers`` with a per-tensor float32 scale and an 8- or 16-bit zero
    point made directly rather than by ``onnx.helper.make_tensor``, whose type dispatch and numpy conversions
    were a third of the method, and in place in the graph (:meth:`IndexedModel.add_scalar_initializer`):
    7,000 pairs in a 3,200-node build. The same names, the same tensors, added in the same order; where a
    name is already taken, ORT adds nothing and returns the tensor it made, and so does this. The tensors
    returned are the graph's own where they were added (ORT's callers read their names and types only).
    Anything else is ORT's own method."""
    zero_point, scale = quant_params["zero_point"], quant_params["scale"]
    zero_point_type = quant_params["quant_type"]
    plain = (
        quant_params.get("axis") is None
        and not quant_params.get("block_size", 0)
        and isinstance(scale, np.ndarray)
        and isinstance(zero_point, np.ndarray)
        and scale.shape == ()
        and zero_point.shape == ()
        and scale.dtype == np.float32
        and zero_point_type in _VECTOR_TYPES
        and zero_point.dtype == onnx.helper.tensor_dtype_to_np_dtype(zero_point_type)
    )
    if not plain:
        return QDQQuantizer._make_scale_zp_initializers(self, param_name, quant_params, init_name_suffix)
    made = []
    for name, kind, value in (
        (param_name + "_zero_point" + init_name_suffix, zero_point_type, int(zero_point)),
        (param_name + "_scale" + init_name_suffix, onnx.TensorProto.FLOAT, float(scale)),
    ):
        if type(self.model) is IndexedModel:
            tensor = self.model.add_scalar_initializer(name, kind, value)
            made.append(tensor if tensor is not None else scalar_tensor(name, kind, value))
        else:
            made.append(scalar_tensor(name, kind, value))
            self.model.add_initializer(made[-1])
    return QDQScaleZpInitializers(made[1], made[0])


def _in_place(self: Any, zp_name: str, axis: int | None, block_size: int, dequantizes: bool) -> IndexedModel | None:
    """The indexed model to make a Q/DQ node in place in, or None where ORT's own maker must run: an axis or
    a block size (``make_node`` then sets attributes), another model class, or -- for a DequantizeLinear --
    a zero point ORT's ``_check_node`` refuses (ORT's maker then raises ORT's error)."""
    model = self.model
    if axis is not None or block_size or type(model) is not IndexedModel:
        return None
    if dequantizes and not model.qdq_node_addable(zp_name):
        return None
    return model


def create_qdq_nodes(
    self: Any,
    q_input: str,
    q_output: str,
    quant_node_name: str,
    dq_input: str,
    dq_output: str,
    dequant_node_name: str,
    scale_name: str,
    zp_name: str,
    axis: int | None = None,
    block_size: int = 0,
) -> None:
    """``QDQQuantizer._create_qdq_nodes`` for a per-tensor pair whose DequantizeLinear passes ORT's check
    (:func:`_in_place`): both nodes made in place in the graph (:meth:`IndexedModel.add_qdq_node`), in ORT's
    order. Anything else is ORT's own method."""
    model = _in_place(self, zp_name, axis, block_size, dequantizes=True)
    if model is None:
        return QDQQuantizer._create_qdq_nodes(
            self, q_input, q_output, quant_node_name, dq_input, dq_output, dequant_node_name,
            scale_name, zp_name, axis, block_size,
        )  # fmt: skip
    domain = self.qdq_op_domain
    model.add_qdq_node(quant_utils.QUANT_OP_NAME, [q_input, scale_name, zp_name], q_output, quant_node_name, domain)
    model.add_qdq_node(quant_utils.DEQUANT_OP_NAME, [dq_input, scale_name, zp_name], dq_output, dequant_node_name,
                       domain)  # fmt: skip
    return None


def _one_node(
    self: Any, op_type: str, plain: Callable[..., None], node_input: str, output: str, name: str, scale_name: str,
    zp_name: str, axis: int | None, block_size: int,
) -> None:  # fmt: skip
    """One Q or DQ node the way :func:`create_qdq_nodes` makes each of its pair; ``plain``: ORT's maker of it
    (``_create_q_node`` / ``_create_dq_node``, which take the same arguments)."""
    model = _in_place(self, zp_name, axis, block_size, dequantizes=op_type == quant_utils.DEQUANT_OP_NAME)
    if model is None:
        return plain(self, node_input, output, name, scale_name, zp_name, axis, block_size)
    model.add_qdq_node(op_type, [node_input, scale_name, zp_name], output, name, self.qdq_op_domain)
    return None


def create_q_node(
    self: Any, q_input: str, q_output: str, quant_node_name: str, scale_name: str, zp_name: str,
    axis: int | None = None, block_size: int = 0,
) -> None:  # fmt: skip
    """``QDQQuantizer._create_q_node`` through :func:`_one_node`."""
    return _one_node(self, quant_utils.QUANT_OP_NAME, QDQQuantizer._create_q_node, q_input, q_output,
                     quant_node_name, scale_name, zp_name, axis, block_size)  # fmt: skip


def create_dq_node(
    self: Any, dq_input: str, dq_output: str, dequant_node_name: str, scale_name: str, zp_name: str,
    axis: int | None = None, block_size: int = 0,
) -> None:  # fmt: skip
    """``QDQQuantizer._create_dq_node`` through :func:`_one_node`."""
    return _one_node(self, quant_utils.DEQUANT_OP_NAME, QDQQuantizer._create_dq_node, dq_input, dq_output,
                     dequant_node_name, scale_name, zp_name, axis, block_size)  # fmt: skip


def scalar_tensor(name: str, data_type: int, value: float, into: Any = None) -> onnx.TensorProto:
    """``onnx.helper.make_tensor(name, data_type, (), [value])`` for FLOAT (``float_data``) and the 8- and
    16-bit integer types (``int32_data``), the value already of that type: the same message. ``into``: an
    empty tensor to fill instead of a new one."""
    tensor = onnx.TensorProto() if into is None else into
    tensor.data_type = data_type
    tensor.name = name
    (tensor.float_data if data_type == onnx.TensorProto.FLOAT else tensor.int32_data).append(value)
    return tensor


_VECTOR_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16)


def _computed_initializer(self: Any, name: str, info: Any) -> tuple[Any, bool, int, list[dict[str, Any]]] | None:
    """The head of ORT's initializer loop for ``name``: (initializer, is a weight, quantization type, its
    overrides) where ORT computes the parameters from the float32 data; None where it has no such
    initializer or takes the parameters from a scale / zero-point override (ORT's conditions, in its order)."""
    initializer = self.model.get_initializer(name)
    if not initializer or initializer.data_type != onnx.TensorProto.FLOAT:
        return None
    is_weight = info.tensor_type is QDQQuantTensorType.WEIGHT
    quant_type = self.weight_qType if is_weight else self.activation_qType
    if self.tensor_quant_overrides.overrides_scale_zp(name):
        return None
    overrides = self.tensor_quant_overrides.get(name, [{}])
    if "quant_type" in overrides[0]:
        quant_type = overrides[0]["quant_type"].tensor_type
    return initializer, is_weight, quant_type, overrides


def _vector_params(self: Any, name: str, info: Any) -> QuantizationParams | None:
    """The per-channel branch of ORT's loop for ``name``, vectorized; None where ORT takes another branch
    or the data is one :func:`channel_quant_params` leaves to ORT (the branch conditions are ORT's, in its
    order)."""
    head = _computed_initializer(self, name, info)
    if head is None:
        return None
    initializer, is_weight, quant_type, overrides = head
    axis = overrides[0].get("axis", info.axis)
    if axis is None or (is_weight and self.block_size > 0) or quant_type not in _VECTOR_TYPES:
        return None
    if any(o.get("rmin") is not None or o.get("rmax") is not None for o in overrides):
        return None
    data = numpy_helper.to_array(initializer)
    valid, axis = quant_utils.normalize_axis(axis, data.ndim)
    if not valid or data.size == 0 or not np.isfinite(data).all():
        return None  # ORT raises, or takes its empty-data branch; NaN and inf are cast to integers there
    symmetric = overrides[0].get("symmetric", True)  # ORT: per-channel initializers are always symmetric
    reduce_range = overrides[0].get("reduce_range", self.reduce_range)
    zero_point, scale = channel_quant_params(data, axis, quant_type, symmetric, reduce_range, self.min_real_range)
    return QuantizationParams(zero_point=zero_point, scale=scale, quant_type=quant_type, axis=axis)


def channel_quant_params(
    data: np.ndarray, axis: int, quant_type: int, symmetric: bool, reduce_range: bool, min_real_range: float | None
) -> tuple[np.ndarray, np.ndarray]:
    """ORT's ``compute_data_quant_params`` (and ``compute_scale_zp``) for each slice of the float32, finite,
    non-empty ``data`` along ``axis``, as one vector operation per step (:func:`range_quant_params` over the
    slices' minima and maxima). Returns (zero points, scales), each of shape ``[channels]``, as ORT's
    ``np.asarray`` of its list."""
    rows = np.moveaxis(data, axis, 0).reshape(data.shape[axis], -1)
    return range_quant_params(rows.min(axis=1), rows.max(axis=1), quant_type, symmetric, reduce_range, min_real_range)


def range_quant_params(
    rmin: np.ndarray,
    rmax: np.ndarray,
    quant_type: int,
    symmetric: bool,
    reduce_range: bool,
    min_real_range: float | None,
) -> tuple[np.ndarray, np.ndarray]:
    """ORT's ``compute_data_quant_params`` for data of each float32 minimum and maximum in ``rmin`` / ``rmax``
    (finite), as one vector operation per step: the same float32 / float64 steps element for element, so the
    same bits (tests/test_fast_quantize.py and tests/test_fast_quantize_vector_params.py compare them with ORT's
    per channel and per tensor). Returns (zero points, scales) of ``rmin``'s shape."""
    qmin, qmax = quant_utils.get_qmin_qmax_for_qType(quant_type, reduce_range, symmetric=symmetric)
    rmin = np.minimum(rmin, np.array(0, dtype=rmin.dtype))
    rmax = np.maximum(rmax, np.array(0, dtype=rmax.dtype))
    if min_real_range is not None:  # ORT: Python's max(rmax, rmin + r), rmax unless the other is larger
        rmax = np.maximum(rmax, rmin + np.asarray(min_real_range, dtype=rmin.dtype))
    if symmetric:
        absmax = np.maximum(np.abs(rmin), np.abs(rmax))
        rmin, rmax = -absmax, +absmax
    dq = np.array(qmax, dtype=np.float64) - np.array(qmin, dtype=np.float64)
    scale = (rmax.astype(np.float64) - rmin.astype(np.float64)) / dq
    tiny = scale < np.finfo(rmax.dtype).tiny
    if symmetric:
        zp = np.full(scale.shape, np.round((qmin + qmax) / np.array(2.0, dtype=np.float64)))
    else:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            zp = np.round(qmin - rmin / np.where(tiny, 1.0, scale))
    zero_point = np.where(tiny, 0, zp).astype(qmin.dtype)
    return zero_point, np.where(tiny, np.array(1.0, dtype=rmax.dtype), scale.astype(rmax.dtype))


def quantize_onnx_initializer(
    weight: onnx.TensorProto,
    quant_type: int,
    zero_point: Any,
    scale: Any,
    axis: int | None = None,
    quant_weight_name: str | None = None,
    block_size: int = 0,
) -> onnx.TensorProto:
    """ORT's ``quantize_onnx_initializer``, its per-channel branch for the 8- and 16-bit integer types done for
    all channels at once (:func:`channel_quantized`); every other case is ORT's own function. A 3,200-node
    graph quantized per channel has 800 weights of 16 channels: 12,800 calls of ``quantize_nparray``, 0.4 s,
    against 0.07 s in bulk."""
    data = channel_quantized(weight, quant_type, zero_point, scale, axis, block_size)
    if data is None and axis is None and not block_size:
        data = _taken_prequantized(weight, quant_type, zero_point, scale)
    if data is None:
        return _PLAIN_QUANTIZE_INITIALIZER(weight, quant_type, zero_point, scale, axis, quant_weight_name, block_size)
    name = quant_weight_name if quant_weight_name else f"{weight.name}{quant_utils.TENSOR_NAME_QUANT_SUFFIX}"
    return integer_tensor(data.reshape(tuple(weight.dims)), name, quant_type)


def float32_array(tensor: onnx.TensorProto) -> np.ndarray:
    """``onnx.numpy_helper.to_array(tensor)`` for a float32 tensor in memory (``raw_data`` on a little-endian
    machine, or ``float_data``): to_array's own last step without its dispatch on the type (~15 us a call, and
    ORT's quantizer reads each weight, bias and scale through it: 6,000 calls in a 3,200-node static build).
    Any other tensor is to_array's."""
    if tensor.data_type == onnx.TensorProto.FLOAT and not tensor.HasField("segment"):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            if tensor.HasField("raw_data"):
                if sys.byteorder == "little":
                    return np.frombuffer(tensor.raw_data, dtype=np.float32).reshape(tensor.dims)
            else:
                return np.asarray(tensor.float_data, dtype=np.float32).astype(np.float32).reshape(tensor.dims)
    return numpy_helper.to_array(tensor)


def tensor_proto_to_array(initializer: onnx.TensorProto) -> np.ndarray:
    """ORT's ``tensor_proto_to_array`` (swapped in while :func:`installed`), a float32 tensor read by
    :func:`float32_array`."""
    if initializer.data_type == onnx.TensorProto.FLOAT:
        return float32_array(initializer)
    return _PLAIN_TENSOR_PROTO_TO_ARRAY(initializer)


_PLAIN_TENSOR_PROTO_TO_ARRAY = getattr(quant_utils, "tensor_proto_to_array", None)


def raw_tensor(data: np.ndarray, name: str, data_type: int, into: Any = None) -> onnx.TensorProto:
    """:func:`integer_tensor` for the int32 and float32 arrays of a quantized bias and its scale too (which
    ``from_array`` also stores as raw little-endian bytes)."""
    if data_type in (onnx.TensorProto.INT32, onnx.TensorProto.FLOAT) and (
        data.dtype == onnx.helper.tensor_dtype_to_np_dtype(data_type)
    ):
        tensor = onnx.TensorProto() if into is None else into
        tensor.dims.extend(data.shape)
        if name:
            tensor.name = name
        tensor.raw_data = data.tobytes() if sys.byteorder == "little" else numpy_helper.tobytes_little_endian(data)
        tensor.data_type = data_type
        return tensor
    return integer_tensor(data, name, data_type, into)


def integer_tensor(data: np.ndarray, name: str, data_type: int, into: Any = None) -> onnx.TensorProto:
    """``onnx.numpy_helper.from_array(data, name)`` for an array of an 8- or 16-bit integer type whose ONNX type
    is ``data_type``: the shape, the name, the bytes (little-endian) and the type, without from_array's dispatch
    on the dtype (14 us of its ~17 per weight, 3,200 weights in a 3,200-node static build). ``into``: an empty
    tensor to fill (an element just added to a graph's list) instead of a new one."""
    if data_type not in _VECTOR_TYPES or data.dtype != onnx.helper.tensor_dtype_to_np_dtype(data_type):
        made = numpy_helper.from_array(data, name)
        if into is None:
            return made
        into.CopyFrom(made)
        return into
    tensor = onnx.TensorProto() if into is None else into
    tensor.dims.extend(data.shape)
    if name:
        tensor.name = name
    tensor.raw_data = data.tobytes() if sys.byteorder == "little" else numpy_helper.tobytes_little_endian(data)
    tensor.data_type = data_type
    return tensor


def _taken_prequantized(weight: onnx.TensorProto, quant_type: int, zero_point: Any, scale: Any) -> np.ndarray | None:
    """The bulk-quantized data of ``weight`` (:func:`_prequantized`) when it was made for these very arguments
    -- the same initializer object, zero-point and scale arrays (holding the same values) and type -- else
    None. ORT's ``_adjust_weight_quant_params_for_bias_tensors`` runs in between and replaces a weight's
    scale it enlarges: that weight is then ORT's own."""
    for model in tuple(_ACTIVE):
        entry = model.prequantized.get(weight.name)
        if entry is None:
            continue
        initializer, zp, sc, qtype, made, data = entry
        same = initializer is weight and zp is zero_point and sc is scale and qtype == quant_type
        if same and made == (zp.tobytes(), sc.tobytes()):  # the arrays not changed in place since
            del model.prequantized[weight.name]
            return data
    return None


def channel_quantized(
    weight: onnx.TensorProto, quant_type: int, zero_point: Any, scale: Any, axis: Any, block_size: int
) -> np.ndarray | None:
    """The weight ORT's per-channel loop quantizes (``quantize_nparray`` on each slice along ``axis``, then
    concatenated), computed as one broadcast: each element sees the same division, rounding, addition, clip
    and cast, in the same dtypes (numpy >= 2 types a numpy scalar as it types a one-element array), so the
    bytes are ORT's (tests/test_fast_quantize.py compares them). None where ORT takes another branch or
    would raise, or the arguments are not the plain arrays ORT passes (a scale or zero point of another
    shape or dtype), or the weight holds NaN or inf (their cast to an integer is not specified)."""
    if axis is None or block_size or quant_type not in _VECTOR_TYPES or _NUMPY_1:
        return None
    if weight.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
        return None
    if not (isinstance(scale, np.ndarray) and isinstance(zero_point, np.ndarray)):
        return None
    if scale.dtype not in (np.float32, np.float64) or zero_point.dtype.kind not in "iu":
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        return None
    data = quant_utils.tensor_proto_to_array(weight)
    if not -data.ndim <= axis < data.ndim or data.size == 0:
        return None
    axis = int(axis) % data.ndim
    channels = data.shape[axis]
    if scale.shape != (channels,) or zero_point.shape != (channels,) or not np.isfinite(data).all():
        return None
    shape = [1] * data.ndim
    shape[axis] = channels
    qmin, qmax = quant_utils.get_qmin_qmax_for_qType(quant_type, reduce_range=False, symmetric=False)
    q = (data.astype(np.float32) / scale.reshape(shape)).round() + zero_point.reshape(shape)
    np.clip(q, qmin, qmax, out=q)
    return q.astype(onnx.helper.tensor_dtype_to_np_dtype(quant_type))


_NUMPY_1 = int(np.__version__.split(".")[0]) < 2
"""numpy 1 types a numpy scalar by its value (a float64 scale would divide a float32 slice in float32), an
array by its dtype: the bulk quantization is left to ORT there."""
_PLAIN_FIND_BY_NAME = getattr(quant_utils, "find_by_name", None)
_PLAIN_QUANTIZE_INITIALIZER = getattr(quant_utils, "quantize_onnx_initializer", None)
_LOCK = threading.Lock()
_ACTIVE: list[IndexedModel] = []
_DEPTH = [0]
_SCOPE: contextvars.ContextVar[list[IndexedModel] | None] = contextvars.ContextVar("qdebug_scope", default=None)


def find_by_name(item_name: str, item_list: Any) -> Any:
    """ORT's ``find_by_name``, from the index when ``item_list`` is an active indexed model's initializers or
    an indexed quantizer's ``new_nodes``."""
    if type(item_list) is NamedList:
        return item_list.first_named(item_name)
    for model in tuple(_ACTIVE):  # the list the index was built over first: 0.4 us less than reading the graph's
        known = model._inits_c
        if (item_list is known and known is not None) or item_list is model.model.graph.initializer:
            return model.get_initializer(item_name, item_list)
    return _PLAIN_FIND_BY_NAME(item_name, item_list)


def _register(model: IndexedModel) -> None:
    scope = _SCOPE.get()
    if scope is None:
        return  # outside installed(): the model still works, find_by_name just scans its list
    scope.append(model)
    with _LOCK:
        _ACTIVE.append(model)


def _swaps() -> tuple[tuple[str, Any, Any], ...]:
    """(name, ORT's function, qdebug's) for each function swapped in ORT's modules by :func:`installed`."""
    return (
        ("find_by_name", _PLAIN_FIND_BY_NAME, find_by_name),
        ("quantize_onnx_initializer", _PLAIN_QUANTIZE_INITIALIZER, quantize_onnx_initializer),
        ("save_and_reload_model_with_shape_infer", _PLAIN_RELOAD, reloaded_with_shape_infer),
        ("quantize_data", _PLAIN_QUANTIZE_DATA, quantize_data),
        ("tensor_proto_to_array", _PLAIN_TENSOR_PROTO_TO_ARRAY, tensor_proto_to_array),
    )


def _ort_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("onnxruntime.quantization") and m]


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Within the block, ORT's modules call qdebug's stand-ins for the functions :func:`_swaps` names;
    indexed models made here register."""
    token = _SCOPE.set([])
    with _LOCK:
        if _DEPTH[0] == 0:
            for module in _ort_modules():
                for name, plain, ours in _swaps():
                    if plain is not None and getattr(module, name, None) is plain:
                        setattr(module, name, ours)
        _DEPTH[0] += 1
    try:
        yield
    finally:
        mine = _SCOPE.get() or []
        _SCOPE.reset(token)
        with _LOCK:
            for model in mine:
                with contextlib.suppress(ValueError):
                    _ACTIVE.remove(model)
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                for module in _ort_modules():
                    for name, plain, ours in _swaps():
                        if getattr(module, name, None) is ours:
                            setattr(module, name, plain)


# --- the quantizer's shape-inference round trip, once per model ------------------------------------

_INFERRED: dict[bytes, onnx.ModelProto] = {}
_INFERRED_LOCK = threading.Lock()
INFERRED_MAX_BYTES = 256 << 20
"""Models larger than this are not kept by :func:`shape_inferred` (the round trip runs each time)."""


def content_key(model: onnx.ModelProto) -> bytes | None:
    """A digest of ``model``'s content (blake2b of its deterministic serialization: 4 ms at 3,200 nodes), or
    None above :data:`INFERRED_MAX_BYTES`, where serializing costs more than what the key saves."""
    if model.ByteSize() > INFERRED_MAX_BYTES:
        return None
    return hashlib.blake2b(model.SerializeToString(deterministic=True), digest_size=20).digest()


def shape_inferred(model: onnx.ModelProto, key: bytes | None = None) -> onnx.ModelProto:
    """A fresh copy of what ORT's ``BaseQuantizer.__init__`` quantizes when given ``model``: ``model`` itself
    when it carries ORT's shape-inference mark, else ``save_and_reload_model_with_shape_infer(model)`` (a
    save with external data, ``infer_shapes_path``, a load and the mark), which the quantizer then takes as
    it is.

    That round trip is 8 % of a static build at 3,200 nodes and its result depends only on ``model``, while
    propose and verify build tens of variants of one normalized model: it runs once per model content (a
    blake2b digest of the serialized model, 4 ms there against the round trip's 60-130 ms) and each build
    gets a deep copy. Only the latest model is kept, and none above :data:`INFERRED_MAX_BYTES`. A copy another
    process saved for the same content (:func:`save_inferred`, :func:`offer_inferred`: analyze's, read by
    propose) is taken instead of making it. ``key``: the model's :func:`content_key`, when the caller has it."""
    if quant_utils.model_has_infer_metadata(model):
        return copy.deepcopy(model)
    key = key if key is not None else content_key(model)
    if key is None:
        return reloaded_with_shape_infer(model)
    with _INFERRED_LOCK:
        kept = _INFERRED.get(key)
    if kept is None:
        kept = _offered_copy(key) if not _FORCE_PLAIN.get() else None
    if kept is None:
        kept = reloaded_with_shape_infer(model)
        with _INFERRED_LOCK:
            _INFERRED.clear()
            _INFERRED[key] = kept
    return copy.deepcopy(kept)


INFERRED_FILE = "normalized.inferred.onnx"
"""In a report's files: the normalized model as ORT's quantizer shape-infers it (:func:`save_inferred`), which
propose takes instead of making that round trip again (:func:`offer_inferred`)."""
_OFFERED: dict[bytes, Any] = {}
"""content key -> the file another process saved its shape-inferred copy in (:func:`offer_inferred`)."""


def _versions() -> dict[str, str]:
    import onnxruntime

    from qdebug import __version__

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "qdebug": __version__}


def save_inferred(model: onnx.ModelProto, path: Any) -> bool:
    """Save the shape-inferred copy :func:`shape_inferred` keeps for ``model``'s content to ``path`` (and its
    content key, the versions that made it and its sha256 to ``path`` + ``.json``), each atomically, for a
    later process to take instead of making the round trip again (:func:`offer_inferred`: analyze's, for
    propose). False, writing nothing, when no copy is kept for that content."""
    from qdebug.output.files import atomic_write_bytes, atomic_write_text

    key = content_key(model)
    with _INFERRED_LOCK:
        kept = _INFERRED.get(key) if key is not None else None
    if kept is None:
        return False
    data = kept.SerializeToString()
    atomic_write_bytes(path, data)
    sidecar = {"key": key.hex(), "sha256": hashlib.sha256(data).hexdigest(), **_versions()}
    atomic_write_text(Path(str(path) + ".json"), json.dumps(sidecar, sort_keys=True))
    return True


def offer_inferred(path: Any) -> bool:
    """Let :func:`shape_inferred` take the copy :func:`save_inferred` wrote at ``path`` for its content key,
    when it was made by the same onnx, ORT and qdebug; True when offered. The file is read, and its sha256
    checked, only when a build asks for that content."""
    try:
        sidecar = json.loads(Path(str(path) + ".json").read_text())
        key = bytes.fromhex(sidecar["key"])
        made = {name: sidecar[name] for name in ("onnx", "onnxruntime", "qdebug")}
        sha = str(sidecar["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if made != _versions() or not Path(path).is_file():
        return False
    with _INFERRED_LOCK:
        _OFFERED[key] = (Path(path), sha)
    return True


def _offered_copy(key: bytes) -> onnx.ModelProto | None:
    """The model offered for ``key`` (:func:`offer_inferred`), read and checked; None when none is, or the file
    is not the one offered any more."""
    with _INFERRED_LOCK:
        entry = _OFFERED.pop(key, None)
    if entry is None:
        return None
    path, sha = entry
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != sha:
        return None
    loaded = onnx.ModelProto()
    loaded.ParseFromString(data)
    return loaded


_PLAIN_RELOAD = getattr(quant_utils, "save_and_reload_model_with_shape_infer", None)
_EXTERNAL_MIN_BYTES = 1024
"""``onnx.save_model``'s default ``size_threshold``: a tensor whose ``sys.getsizeof(raw_data)`` reaches it goes
to the external file."""


def reloaded_with_shape_infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """ORT's ``save_and_reload_model_with_shape_infer(model)``, with onnx's per-tensor external-data steps done
    in one pass.

    ORT saves a copy of the model with its large weights as external data, runs ``infer_shapes_path`` on the
    file and loads the result, external data included: at 3,200 nodes 0.10 s of the save and 0.08 s of the
    load are onnx's Python opening, seeking and writing (then reading) the data file once per weight, against
    0.02 s for the inference itself. Here the same two files are written -- the model proto with the same
    tensors moved out in the same order, each weight's ``location`` / ``offset`` / ``length`` as
    ``save_external_data`` writes them, and the weights' bytes back to back -- so ``infer_shapes_path`` reads
    what it reads there; then each external tensor gets its bytes back from memory, ``data_location`` reset
    and its ``external_data`` cleared, as ``load_external_data_for_tensor`` does, and ORT's mark is added with
    ORT's own ``add_infer_metadata``. The data file's name is a uuid in both (so nothing of it can reach the
    result). A model this does not cover plainly (a subgraph, a tensor already external, or onnx's or ORT's
    functions changed: the ``round trip`` entries of :data:`VERIFIED_SOURCES`) takes ORT's function."""
    import tempfile
    import uuid

    if _FORCE_PLAIN.get() or fast_path_problem("round trip") is not None or not _plainly_saved(model):
        return _PLAIN_RELOAD(model)
    with tempfile.TemporaryDirectory(prefix="ort.quant.") as tmp:
        work = copy.deepcopy(model)
        location = f"{uuid.uuid1()}.data"
        blobs: list[bytes] = []
        offset = 0
        for tensor in work.graph.initializer:
            if tensor.HasField("raw_data") and sys.getsizeof(tensor.raw_data) >= _EXTERNAL_MIN_BYTES:
                data = tensor.raw_data
                del tensor.external_data[:]
                tensor.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", location), ("offset", offset), ("length", len(data))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, str(value)
                tensor.ClearField("raw_data")
                blobs.append(data)
                offset += len(data)
        blob = b"".join(blobs)
        path = Path(tmp) / "model.onnx"
        (Path(tmp) / location).write_bytes(blob)
        path.write_bytes(work.SerializeToString())
        inferred = quant_utils.generate_identified_filename(path, "-inferred")
        onnx.shape_inference.infer_shapes_path(str(path), str(inferred))
        loaded = onnx.ModelProto()
        loaded.ParseFromString(inferred.read_bytes())
    for tensor in loaded.graph.initializer:
        if tensor.HasField("data_location") and tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {entry.key: entry.value for entry in tensor.external_data}
            if set(info) != {"location", "offset", "length"} or info["location"] != location:
                return _PLAIN_RELOAD(model)  # not what was written: leave it to onnx's reading
            start, length = int(info["offset"]), int(info["length"])
            tensor.raw_data = blob[start : start + length]
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
    quant_utils.add_infer_metadata(loaded)
    return loaded


def _plainly_saved(model: onnx.ModelProto) -> bool:
    """True when onnx's save and load with external data touch only the main graph's initializers: no node
    holds a subgraph (whose initializers onnx would move too) and no tensor, initializer or attribute, in
    the graph or a function, is external already (onnx's load would read it from the model's folder)."""
    kinds = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    external = onnx.TensorProto.EXTERNAL

    def is_external(tensor: Any) -> bool:
        return tensor.HasField("data_location") and tensor.data_location == external

    if any(is_external(t) for t in model.graph.initializer):
        return False
    for nodes in [model.graph.node, *(f.node for f in model.functions)]:
        for node in nodes:
            for attribute in node.attribute:
                if attribute.type in kinds:
                    return False
                if attribute.HasField("t") and is_external(attribute.t):
                    return False
                if any(is_external(t) for t in attribute.tensors):
                    return False
    return True


# --- the calibrator's augmentation --------------------------------------------------------------------

_PLAIN_AUGMENT = getattr(getattr(ort_calibrate, "MinMaxCalibrater", None), "augment_graph", None)
_REDUCE_OPS = ("ReduceMin", "ReduceMax")


def augment_graph(self: Any) -> None:
    """``MinMaxCalibrater.augment_graph`` in linear time: the same model, node for node.

    ORT inserts each tensor's ReduceMin then ReduceMax (each followed by its Reshape) before the first
    node reading the tensor, searching the node list every time: the ReduceMax pair lands before the
    ReduceMin pair, the pairs of several tensors read first by one node come in the order the tensors
    are processed, and a tensor nothing reads gets its pairs at the end. The inserted nodes read only
    their tensor, their own intermediate and two fresh uuid names, so the first original reader is all
    the search ever finds -- unless a tensor to calibrate is itself named like another's intermediate,
    where ORT's own code runs.
    """
    import uuid

    model = self.model
    graph = model.graph
    tensors, _ = self.select_tensors_to_calibrate(model)
    suffixes = [f"_{op}_Reshape" for op in _REDUCE_OPS]
    if any(t + s in tensors for t in tensors for s in suffixes):
        return _PLAIN_AUGMENT(self)
    reshape_shape_name = str(uuid.uuid4())
    reshape_shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), reshape_shape_name)
    graph.initializer.append(reshape_shape)

    value_infos = {vi.name: vi for vi in graph.value_info}
    value_infos.update({o.name: o for o in graph.output})
    value_infos.update({i.name: i for i in graph.input})
    graph_inputs = {i.name for i in graph.input}
    originals = list(graph.node)
    first_reader: dict[str, int] = {}
    for k, node in enumerate(originals):
        for name in node.input:
            first_reader.setdefault(name, k)
    before: dict[int, list[onnx.NodeProto]] = {}
    tail: list[onnx.NodeProto] = []
    for tensor_name in tensors:
        pairs: list[onnx.NodeProto] = []
        for op in _REDUCE_OPS:
            pairs[:0] = _reduce_pair(self, tensor_name, op, reshape_shape_name, value_infos)
            out = onnx.helper.make_tensor_value_info(tensor_name + "_" + op, _elem(value_infos, tensor_name), [None])
            graph.output.append(out)
            if graph.output[-1].name not in graph_inputs:  # ORT rebuilds the map from the graph per call
                value_infos[graph.output[-1].name] = graph.output[-1]
        where = first_reader.get(tensor_name)
        (tail if where is None else before.setdefault(where, [])).extend(pairs)
    nodes: list[onnx.NodeProto] = []
    for k, node in enumerate(originals):
        nodes.extend(before.get(k, ()))
        nodes.append(node)
    nodes.extend(tail)
    graph.ClearField("node")
    graph.node.extend(nodes)
    onnx.save(model, self.augmented_model_path, save_as_external_data=self.use_external_data_format)
    return None


def _elem(value_infos: dict[str, Any], tensor_name: str) -> int:
    if tensor_name not in value_infos:
        raise ValueError(
            f"Unable to guess tensor type for tensor {tensor_name!r}, "
            "running shape inference before quantization may resolve this issue."
        )
    return value_infos[tensor_name].type.tensor_type.elem_type


def _reduce_pair(
    self: Any, tensor_name: str, op: str, reshape_shape_name: str, value_infos: dict[str, Any]
) -> list[onnx.NodeProto]:
    """ORT's ``add_reduce_min_max`` nodes for one tensor and op (the per-channel axes as ORT writes them)."""
    import uuid

    from onnx import helper

    reduce_output = tensor_name + "_" + op
    intermediate_output = reduce_output + "_Reshape"
    reduce_node = helper.make_node(op, [tensor_name], [intermediate_output], keepdims=1, name=reduce_output)
    reshape_node = helper.make_node(
        "Reshape", inputs=[intermediate_output, reshape_shape_name], outputs=[reduce_output], name=intermediate_output
    )
    _elem(value_infos, tensor_name)
    if self.per_channel:
        tensor_rank = len(value_infos[tensor_name].type.tensor_type.shape.dim)
        reduced_axes = [0, *range(2, tensor_rank)]
        if _op_version(op, self.model) < 18:
            reduce_node.attribute.append(helper.make_attribute("axes", reduced_axes))
        else:
            reduce_axes_name = str(uuid.uuid4())
            reduce_axes = numpy_helper.from_array(np.array(reduced_axes, dtype=np.int64), reduce_axes_name)
            reduce_node.input.append(reduce_axes_name)
            self.model.graph.initializer.append(reduce_axes)
    return [reduce_node, reshape_node]


def _op_version(op_type: str, model: onnx.ModelProto) -> int:
    for opset_import in model.opset_import:
        if onnx.defs.has(op_type, opset_import.domain):
            return opset_import.version
    raise RuntimeError(f"Model does not contain a version for '{op_type}'.")


_AUGMENT_LOCK = threading.Lock()
_AUGMENT_SWAP: list[Any] = []
"""While any block of :func:`fast_calibrator_augmentation` is open: [ORT's ``augment_graph`` it replaced,
the number of blocks open]."""
_AUGMENTING: contextvars.ContextVar[bool] = contextvars.ContextVar("qdebug_augmenting", default=False)


def _augment_in_scope(self: Any) -> None:
    """What ``MinMaxCalibrater.augment_graph`` is while a block is open: :func:`augment_graph` for the
    calibrators made inside a block (this thread or task), ORT's own for any other caller."""
    if _AUGMENTING.get():
        return augment_graph(self)
    with _AUGMENT_LOCK:
        original = _AUGMENT_SWAP[0] if _AUGMENT_SWAP else _PLAIN_AUGMENT
    return original(self)


@contextlib.contextmanager
def fast_calibrator_augmentation() -> Iterator[None]:
    """Within the block, ORT's MinMax calibrator augments its model with :func:`augment_graph` (when the
    fast path may run). The class attribute is swapped under a lock by the first block open in the process
    and put back by the last one to close (threads may nest and interleave blocks), exception or not;
    calibrators outside every block get ORT's own."""
    if not use_fast_path("calibrator"):
        yield
        return
    cls = ort_calibrate.MinMaxCalibrater
    with _AUGMENT_LOCK:
        if not _AUGMENT_SWAP:
            _AUGMENT_SWAP[:] = [cls.__dict__["augment_graph"], 0]
            cls.augment_graph = _augment_in_scope  # type: ignore[method-assign]
        _AUGMENT_SWAP[1] += 1
    token = _AUGMENTING.set(True)
    try:
        yield
    finally:
        _AUGMENTING.reset(token)
        with _AUGMENT_LOCK:
            _AUGMENT_SWAP[1] -= 1
            if _AUGMENT_SWAP[1] == 0:
                cls.augment_graph = _AUGMENT_SWAP[0]  # type: ignore[method-assign]
                _AUGMENT_SWAP.clear()


# --- for developers: the installed release against the verified sources ----------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qdebug.quant.fast_quantize [--digests]``: which entries of :data:`VERIFIED_SOURCES` the installed
    ORT and onnx changed, and which fast paths that turns off; with ``--digests``, the installed digests as a
    ``VERIFIED_SOURCES`` literal, to paste once the byte-identity tests pass on this release
    (docs/design-notes.md, "Re-verifying a new ORT"). Exit 0 when nothing changed, 1 otherwise."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qdebug.quant.fast_quantize", description=main.__doc__)
    parser.add_argument("--digests", action="store_true", help="print the installed digests as a dict literal")
    args = parser.parse_args(argv)
    verified = f"onnxruntime {VERIFIED_ON['onnxruntime']} / onnx {VERIFIED_ON['onnx']}"
    print(f"installed: {_installed()}; verified: {verified}")
    if _IMPORT_PROBLEM is not None:
        print(f"ORT's quantizer modules do not import as verified: {_IMPORT_PROBLEM}")
        return 1
    now = current_sources()
    changed = [label for label in VERIFIED_SOURCES if now[label] != VERIFIED_SOURCES[label]]
    for label in changed:
        print(f"  changed  {label}: {VERIFIED_SOURCES[label]} -> {now[label]}")
    parts = ("quantizer", "dynamic quantizer", "calibrator", "round trip")
    state = {part: "off" if any(label in changed for label in _labels(part)) else "on" for part in parts}
    print(f"{len(changed)} of {len(VERIFIED_SOURCES)} sources changed; fast path: "
          + ", ".join(f"{part} {on}" for part, on in state.items()))  # fmt: skip
    if args.digests:
        print("VERIFIED_SOURCES: dict[str, str] = {")
        for label, digest in now.items():
            print(f'    "{label}": "{digest}",')
        print("}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
