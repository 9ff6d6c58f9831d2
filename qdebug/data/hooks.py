"""Python hooks as data: ``module:function`` or ``path/to/file.py:function``.

:func:`load_hook` resolves the spec to a callable (the task-metric hooks use it too). A data hook returns
an iterable of feed dicts (a ``labels`` key is taken as labels) or an ORT ``CalibrationDataReader``; its
items are checked one by one, cut into batches and, for a model whose batch dimension is fixed, stacked
into whole batches of it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qdebug.data.checks import batch_size_of, check_array_meta, check_finite, check_same_rows, labels_fed
from qdebug.data.dataset import DataSet, split_batches
from qdebug.data.rows import Axes, Batch, axis_of, join_rows, take_rows
from qdebug.data.specs import LABELS_KEY, UNDECIDED, InputSpec, batch_axes, fixed_batch, resolve_batch_axes
from qdebug.errors import ExitCode, QDebugError


def load_hook(spec: str, what: str) -> Callable[..., Any]:
    """Resolve ``module:function`` or ``file.py:function`` to a callable (clear error if not)."""
    module_name, _, func_name = spec.rpartition(":")
    if not module_name or not func_name:
        raise QDebugError(
            f"{what} {spec!r} is not module:function", "write it as package.module:function", ExitCode.INPUT
        )
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise QDebugError(f"{what} file not found: {path}", "check the path", ExitCode.INPUT)
            # registered under its own name while it runs: a dataclass in a hook file (with postponed
            # annotations) looks its module up in sys.modules, and had failed with an obscure AttributeError
            name = f"qdebug_hook_{path.stem}_{abs(hash(str(path.resolve()))):x}"
            mod_spec = importlib.util.spec_from_file_location(name, path)
            assert mod_spec is not None and mod_spec.loader is not None
            module = importlib.util.module_from_spec(mod_spec)
            folder = str(path.resolve().parent)  # its own imports of modules next to it, as `python file.py`
            if folder not in sys.path:
                sys.path.insert(0, folder)
            sys.modules[name] = module
            try:
                mod_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        else:
            if "" not in sys.path and "." not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_name)
    except QDebugError:
        raise
    except Exception as e:
        raise QDebugError(
            f"cannot import {what} module {module_name!r} ({e.__class__.__name__}: {e})",
            "make sure it is importable from the current directory",
            ExitCode.INPUT,
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise QDebugError(
            f"{module_name} has no function {func_name!r}", f"define {func_name} in it", ExitCode.INPUT
        )
    return func


def hook_dataset(
    spec: str, specs: tuple[InputSpec, ...], batch_size: int | None, max_samples: int | None, what: str
) -> DataSet:
    func = load_hook(spec, what)
    specs = _hook_axes(func, spec, specs)
    bsize = batch_size_of(specs, batch_size, spec)
    axes = batch_axes(specs)

    ignored: set[str] = set()
    labelled: set[bool] = set()  # whether the items carry labels (all must agree)

    used = {s.name for s in specs} | {LABELS_KEY}
    fed = labels_fed(specs)

    def make_iter() -> Iterator[tuple[dict[str, np.ndarray], int, str]]:
        produced = 0
        for i, item in enumerate(_iterate_hook(func, spec)):
            if not isinstance(item, Mapping):
                raise QDebugError(
                    f"{what} hook {spec} yielded {type(item).__name__}, not a dict of input name -> array",
                    "yield {input_name: numpy array}",
                    ExitCode.DATA,
                )
            # only the model's inputs and the labels: another key (a file name, metadata) had reached ORT
            # ("Invalid input name", exit 4) or crashed the batching when it was not an array
            ignored.update(str(k) for k in item if k not in used)
            try:
                arrays = {k: np.asarray(v) for k, v in item.items() if k in used}
            except ValueError as e:  # ragged lists: "inhomogeneous shape"
                raise QDebugError(
                    f"{what} hook {spec} item {i}: a value is not an array ({e})",
                    "yield numpy arrays (one per model input, batch on axis 0)",
                    ExitCode.DATA,
                ) from None
            missing = [s.name for s in specs if s.name not in arrays]
            if missing:
                raise QDebugError(
                    f"{what} hook {spec} item {i} lacks model input(s) {missing}",
                    f"yield all of {[s.name for s in specs]}",
                    ExitCode.DATA,
                )
            for s in specs:
                check_array_meta(s, arrays[s.name].shape, arrays[s.name].dtype, f"{spec} item {i}")
            check_finite(arrays, f"{spec} item {i}")
            n = check_same_rows(arrays, axes, f"{what} hook {spec} item {i}")
            if n == 0:  # an empty item is skipped, like an empty file (it had ended the data there, silently)
                continue
            if max_samples is not None:
                n = min(n, max_samples - produced)
            if n <= 0:
                break
            produced += n
            has = LABELS_KEY in arrays and not fed
            if labelled and has not in labelled:
                raise QDebugError(
                    f"{what} hook {spec}: item {i} {'has' if has else 'has no'} labels, the items before it "
                    f"{'did not' if has else 'did'} (they had been dropped silently: top-1 became agreement)",
                    "give every item labels, or none",
                    ExitCode.DATA,
                )
            labelled.add(has)
            yield arrays, n, f"{spec} item {i}"

    def make_batches() -> Iterator[Batch]:
        items = make_iter()
        if fixed_batch(specs) > 1:
            items = _fill_fixed_batches(items, fixed_batch(specs), spec, what, axes)
        for arrays, n, origin in items:
            yield from split_batches(arrays, n, bsize, origin, LABELS_KEY in arrays and not fed, fed, axes)

    # Validate the first item now, before any long work.
    first = next(iter(make_batches()), None)
    if first is None:
        raise QDebugError(
            f"{what} hook {spec} yields no samples", "yield at least one feed dict", ExitCode.DATA
        )
    return DataSet(spec, specs, make_batches, None, first.labels is not None, tuple(sorted(ignored)))


def _hook_axes(func: Callable[..., Any], spec: str, specs: tuple[InputSpec, ...]) -> tuple[InputSpec, ...]:
    """Batch axes the model left open, read off the hook's first item (one extra call of the hook)."""
    if not any(s.batch_rule == UNDECIDED for s in specs):
        return specs
    item = next(iter(_iterate_hook(func, spec)), None)
    if not isinstance(item, Mapping):
        return specs  # refused with its own message when the items are read
    shapes = {s.name: np.shape(item[s.name]) for s in specs if s.name in item}
    return resolve_batch_axes(specs, shapes, f"{spec} item 0")


def _fill_fixed_batches(
    items: Iterator[tuple[dict[str, np.ndarray], int, str]],
    batch: int,
    spec: str,
    what: str,
    axes: Axes | None = None,
) -> Iterator[tuple[dict[str, np.ndarray], int, str]]:
    """A hook's items joined into whole batches of a model's fixed batch dimension ``batch``.

    A hook often yields one sample at a time; a model exported with a fixed batch of B takes only B, so the
    items are stacked until they fill one (ORT had failed mid-calibration with "invalid dimensions", exit 4).
    Samples left over at the end are refused (exit 5), never padded or dropped; so are items that cannot be
    stacked (other keys or other non-batch dimensions) while a batch is partly filled.
    """
    pending: list[dict[str, np.ndarray]] = []
    rows = 0
    first_origin = ""
    for arrays, n, origin in items:
        arrays = take_rows(arrays, 0, n, axes)
        if pending and not _stackable(pending[0], arrays, axes):
            raise QDebugError(
                f"{what} hook {spec}: {origin} cannot be stacked with the {rows} sample(s) before it (other keys, "
                f"shapes or scalar values), and the model's batch dimension is fixed at {batch}",
                f"yield batches of {batch} samples, or samples of one shape (and one value of each scalar input) "
                f"until each batch of {batch} is full",
                ExitCode.DATA,
            )
        if not pending:
            first_origin = origin
        pending.append(arrays)
        rows += n
        if rows < batch:
            continue
        joined = join_rows(pending, axes)
        whole = rows - rows % batch
        yield take_rows(joined, 0, whole, axes), whole, f"{first_origin}..{origin}"
        pending, rows = ([take_rows(joined, whole, None, axes)], rows - whole) if rows > whole else ([], 0)
        first_origin = origin
    if rows:
        raise QDebugError(
            f"{what} hook {spec}: {rows} sample(s) left at the end do not fill a batch of {batch} "
            f"(the model's batch dimension is fixed at {batch})",
            f"yield a multiple of {batch} samples (or pass a --max-samples that is one), "
            "or export the model with a dynamic batch dimension",
            ExitCode.DATA,
        )


def _stackable(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], axes: Axes | None = None) -> bool:
    """Whether two items have the same keys, the same dimensions but the batch axis and the same scalars
    (an input without a batch axis is one value for the whole batch: items that disagree on it cannot share
    one)."""

    def same(k: str, x: np.ndarray, y: np.ndarray) -> bool:
        axis = axis_of(k, x, axes)
        if axis is not None and y.ndim == x.ndim:
            return np.delete(x.shape, axis).tolist() == np.delete(y.shape, axis).tolist()
        return x.shape == y.shape and np.array_equal(x, y)

    return a.keys() == b.keys() and all(same(k, a[k], b[k]) for k in a)


def _iterate_hook(func: Callable[..., Any], spec: str) -> Iterator[Any]:
    try:
        result = func()
    except Exception as e:
        raise QDebugError(
            f"data hook {spec} raised {e.__class__.__name__}: {e}", "fix the hook", ExitCode.DATA
        ) from None
    if hasattr(result, "get_next") and callable(result.get_next):
        items: Iterator[Any] = iter(result.get_next, None)
    elif isinstance(result, Iterable):
        items = iter(result)
    else:
        raise QDebugError(
            f"data hook {spec} returned {type(result).__name__}",
            "return an iterable of feed dicts or a CalibrationDataReader",
            ExitCode.DATA,
        )
    i = 0
    while True:
        try:  # the hook's own code runs here too: a generator raising midway had given a traceback (exit 1)
            item = next(items)
        except StopIteration:
            return
        except QDebugError:
            raise
        except Exception as e:
            raise QDebugError(
                f"data hook {spec} raised {e.__class__.__name__} at item {i}: {e}", "fix the hook", ExitCode.DATA
            ) from None
        yield item
        i += 1
