"""Calibrate once; cache the ranges on disk; reuse them for every quantization.

Ranges depend on the model, the data, the op types, the method and the
calibrator options -- not on ``nodes_to_exclude`` -- so ``propose`` and
``verify`` rebuild variants from these ranges in a fraction of the time a
fresh ``quantize_static`` call takes (it recalibrates every time). ORT's own
calibration cache has no model hash, so qdebug keys its cache by the model
bytes, a fingerprint of the data, the method, the op types and ORT's version.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qdebug.data import DataSet, ReaderAdapter
from qdebug.errors import ExitCode, QDebugError
from qdebug.output.files import atomic_write_text
from qdebug.records import METHODS


@dataclass(frozen=True, eq=False)
class Ranges:
    """Calibration result: ORT ``TensorsData`` plus the key it is cached under.

    ``tensors`` must be copied (:meth:`private_tensors`) before it is handed to a quantizer: ORT's
    ``QDQQuantizer`` adjusts the ranges it is given in place (Relu/Clip/Softmax).
    """

    method: str
    key: str
    tensors: Any
    cache_path: Path | None
    from_cache: bool

    def private_tensors(self) -> Any:
        """``copy.deepcopy(self.tensors)``, 5x faster for what calibration gives (70 ms against 13 ms over
        3,200 tensors, every static build): a ``TensorsData`` of ``TensorData`` whose attributes are arrays
        (copied), numpy or Python scalars (immutable, shared) and the list of their names (copied). Any other
        shape -- a subclass, an object array, another attribute type -- is deep-copied as before."""
        from onnxruntime.quantization.calibrate import TensorData, TensorsData

        t = self.tensors
        if type(t) is not TensorsData or not all(type(td) is TensorData for td in t.data.values()):
            return copy.deepcopy(t)
        data = {}
        for name, td in t.data.items():
            attrs = {}
            for key, value in vars(td).items():
                if type(value) is np.ndarray and value.dtype != object:
                    attrs[key] = value.copy()
                elif isinstance(value, (np.number, np.bool_, float, int, str)):
                    attrs[key] = value
                elif key == "_attrs" and type(value) is list and all(type(v) is str for v in value):
                    attrs[key] = list(value)
                else:
                    return copy.deepcopy(t)
            fresh = object.__new__(TensorData)
            vars(fresh).update(attrs)
            data[name] = fresh
        out = object.__new__(TensorsData)
        vars(out).update({k: (data if k == "data" else copy.deepcopy(v)) for k, v in vars(t).items()})
        return out

    def minmax(self) -> dict[str, tuple[float, float]]:
        """Per-tensor (lowest, highest) as plain floats (the min and max of each where a range holds several
        values; a single value is taken as it is, without ``np.min``'s reduction machinery: every static
        build calls this twice, over 5,200 tensors at 3,200 nodes)."""
        out = {}
        for name, td in self.tensors.items():
            lo, hi = td.range_value
            out[name] = (_one(lo, np.min), _one(hi, np.max))
        return out


def _one(value: Any, reduce: Any) -> float:
    """``float(reduce(value))``, with a numpy scalar or one-element array read directly (the same number)."""
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        return float(value.reshape(()) if isinstance(value, np.ndarray) else value)
    return float(reduce(value))


def cache_dir() -> Path:
    """``$QDEBUG_CACHE_DIR`` or ``~/.cache/qdebug``."""
    env = os.environ.get("QDEBUG_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "qdebug"


def data_fingerprint(data: DataSet) -> str | None:
    """Content hash of a file data source (None for hooks, which are not cached)."""
    src = Path(data.source)
    if not src.exists():
        return None
    files = sorted(p for p in src.iterdir() if p.suffix == ".npz") if src.is_dir() else [src]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    h.update(f"n={data.n_samples}".encode())
    return h.hexdigest()


def op_types_to_quantize() -> list[str]:
    """Every op type ORT can quantize (what ``quantize_static`` uses by default), sorted."""
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))


def _ort_method(method: str) -> Any:
    from onnxruntime.quantization import CalibrationMethod

    mapping = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
        "distribution": CalibrationMethod.Distribution,
    }
    if method not in mapping:
        raise QDebugError(
            f"unknown calibration method {method!r}", f"use one of {', '.join(METHODS)}", ExitCode.USAGE
        )
    return mapping[method]


def calibrate(
    model_path: Path,
    model_sha256: str,
    data: DataSet,
    method: str = "minmax",
    *,
    use_cache: bool = True,
    on_batch: Callable[[int], None] | None = None,
    providers: Sequence[str] | None = None,
    large: bool = False,
    op_types: Sequence[str] | None = None,
    calib_options: Mapping[str, Any] | None = None,
) -> Ranges:
    """Compute (or load from cache) the activation ranges of ``model_path`` over ``data``.

    ``op_types``: the op types whose tensors are calibrated (None: every op type ORT quantizes), and
    ``calib_options`` the calibrator's options (``percentile``, ``moving_average``, ``symmetric``...), as
    ``quantize_static`` passes a user's ``op_types_to_quantize`` and ``Calib*`` extra options: both are
    part of the key (the options only when given, so the default key is what it was).
    """
    import onnxruntime

    ort_method = _ort_method(method)
    fingerprint = data_fingerprint(data)
    ops = sorted(set(op_types)) if op_types else op_types_to_quantize()
    key_items: list[Any] = [model_sha256, fingerprint, method, ops, onnxruntime.__version__]
    if calib_options:
        key_items.append(sorted(calib_options.items()))
    key_src = json.dumps(key_items)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    path = cache_dir() / "calib" / f"{key}.json" if (use_cache and fingerprint) else None
    if path is not None and path.is_file():
        try:
            return Ranges(method, key, _load_tensors_data(path), path, True)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass  # a corrupt cache entry is recomputed and overwritten
    tensors = _run_calibrator(model_path, data, ort_method, ops, on_batch, providers, large, calib_options)
    if path is not None:
        try:
            atomic_write_text(path, json.dumps(_dump_tensors_data(tensors)))
        except QDebugError:
            path = None  # an unwritable cache only costs time later
    return Ranges(method, key, tensors, path, False)


@contextlib.contextmanager
def quiet_ort_logging() -> Iterator[None]:
    """Silence the quantizer's Python logging warnings (e.g. the pre-processing nag) for the block."""
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(old)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Drop what native code writes to file descriptor 2 during the block, then restore it exactly.

    ORT's calibrator creates its session without options, so ORT's C++ log prints warnings such as
    "Removing initializer ..." (on a model with nothing to calibrate) straight to the terminal. Setting
    ORT's default log severity would silence them, but it is process-wide and ORT has no getter to restore
    an API user's own setting; the descriptor can be restored. Used around session creation only (the
    progress display stays visible during calibration); the calibrator's own errors still raise.
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real descriptor 2 (an embedding host): leave it
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _quiet_calibration_session() -> Iterator[None]:
    """ORT's calibrator creates its session with log severity ERROR for the block (same options otherwise).

    Its own session has default logging, so a model whose declared output shape ORT's result contradicts
    ("VerifyOutputSizes: Expected shape from model of {-1,-1} does not match actual shape of {8,5,8}")
    printed ORT's warning once per calibration batch; verify and bench say it once in their notes. The
    setting is the session's, so nothing process-wide changes (unlike ORT's default logger severity).
    """
    from onnxruntime.quantization.calibrate import CalibraterBase

    def create_inference_session(self: Any) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.log_severity_level = 3
        self.infer_session = ort.InferenceSession(
            self.augmented_model_path, sess_options=opts, providers=self.execution_providers
        )

    original = CalibraterBase.__dict__["create_inference_session"]
    CalibraterBase.create_inference_session = create_inference_session  # type: ignore[method-assign]
    try:
        yield
    finally:
        CalibraterBase.create_inference_session = original  # type: ignore[method-assign]


def _run_calibrator(
    model_path: Path,
    data: DataSet,
    ort_method: Any,
    ops: list[str],
    on_batch: Callable[[int], None] | None,
    providers: Sequence[str] | None,
    large: bool = False,
    calib_options: Mapping[str, Any] | None = None,
) -> Any:
    from onnxruntime.quantization.calibrate import create_calibrator

    from qdebug.quant.fast_quantize import fast_calibrator_augmentation

    with tempfile.TemporaryDirectory(prefix="qdebug-calib-") as tmp, quiet_ort_logging():
        try:
            # ORT's MinMax augmentation is quadratic in the node count; the fast one writes the same model
            with _native_stderr_silenced(), _quiet_calibration_session(), fast_calibrator_augmentation():
                calibrator = _created_calibrator(
                    create_calibrator,
                    model_path,
                    ops,
                    augmented_model_path=str(Path(tmp) / "augmented.onnx"),
                    calibrate_method=ort_method,
                    use_external_data_format=large,
                    providers=list(providers) if providers else None,
                    extra_options=dict(calib_options or {}),
                )
            # ORT's histogram calibrators (entropy/percentile/distribution) stack every batch's
            # outputs and fail on a smaller last batch, and print progress on stdout (ours is data):
            # their lines ("Collecting tensor data...") are dropped, qdebug draws its own progress on
            # stderr, and -q must mean quiet
            reader = ReaderAdapter(data, on_batch, single_samples=ort_method.name != "MinMax")
            with contextlib.redirect_stdout(io.StringIO()):
                calibrator.collect_data(reader)
                tensors = calibrator.compute_data()
        except QDebugError:
            raise
        except Exception as e:
            raise QDebugError(
                f"ONNX Runtime calibration failed: {e.__class__.__name__}: {str(e).splitlines()[0][:300]}",
                "check that the model runs in onnxruntime on this data",
                ExitCode.MODEL,
            ) from None
        del calibrator
    return tensors


def _created_calibrator(create: Callable[..., Any], *args: Any, providers: list[str] | None, **kwargs: Any) -> Any:
    """ORT's ``create_calibrator(*args, **kwargs)`` on ``providers``: passed to it where its signature takes
    them (ORT 1.21 on), set afterwards with the calibrator's ``set_execution_providers`` (which opens its
    session again) where it does not (ORT 1.20's calibrates on the CPU provider unless told)."""
    import inspect

    if "providers" in inspect.signature(create).parameters:
        return create(*args, providers=providers, **kwargs)
    calibrator = create(*args, **kwargs)
    if providers and list(providers) != list(getattr(calibrator, "execution_providers", [])):
        calibrator.set_execution_providers(list(providers))
    return calibrator


def _dump_tensors_data(tensors: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"method": tensors.calibration_method.name, "tensors": {}}
    for name, td in tensors.items():
        entry = {}
        for k, v in td.to_dict().items():
            if k == "CLS":
                continue
            arr = np.asarray(v)
            entry[k] = {"dtype": str(arr.dtype), "shape": list(arr.shape), "data": arr.ravel().tolist()}
        out["tensors"][name] = entry
    return out


def _load_tensors_data(path: Path) -> Any:
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    raw = json.loads(path.read_text())
    data = {}
    for name, entry in raw["tensors"].items():
        kwargs = {}
        for k, v in entry.items():
            arr = np.asarray(v["data"], dtype=np.dtype(v["dtype"])).reshape(v["shape"])
            kwargs[k] = arr
        data[name] = TensorData(**kwargs)
    return TensorsData(CalibrationMethod[raw["method"]], data)
