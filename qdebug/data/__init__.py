"""Calibration and evaluation data: sources -> validated, re-iterable batches.

A source is one of

* an ``.npz`` file keyed by model input name (samples stacked on each input's
  batch axis, see below), with an optional ``labels`` key;
* a folder of such files (sorted by name); files may differ in their dynamic
  dimensions (sequence length, image width) -- each is then its own batch;
* a Python hook ``module:function`` or ``path/to/file.py:function`` returning
  an iterable of feed dicts (a ``labels`` key is taken as labels) or an ORT
  ``CalibrationDataReader``.

Each input's batch axis is read off the model (:func:`decide_batch_axes`): the
symbolic dimension the inputs share (``batch``, ``N``), wherever it sits -- a
streaming model's state ``[2, batch, 128]`` has it on axis 1 -- else the only
size they share, else axis 0; with no axis to split on, each file or hook item
is one indivisible batch. ``--batch-axis NAME=AXIS`` overrides it. Everything
that cuts, counts or stacks samples goes through :func:`take_rows`,
:func:`feed_rows` and :func:`join_rows` with those axes.

Everything is checked against the model's inputs (names, dtype, rank, static
dims) before any long work starts, and every problem is one
:class:`~qdebug.errors.QDebugError` naming the file, the input and the fix.
Only one file is held in memory at a time, so memory does not grow with the
number of files.

The modules:

* :mod:`.specs` -- what the model expects: :class:`InputSpec`, :func:`model_input_specs`,
  the batch axes (:func:`decide_batch_axes`, :func:`resolve_batch_axes`, :func:`batch_axes`),
  :func:`fixed_batch`, :func:`output_batch_axes`;
* :mod:`.rows` -- feed dicts and their samples: :class:`Batch`, :data:`Axes`, :func:`take_rows`,
  :func:`feed_rows`, :func:`join_rows`;
* :mod:`.checks` -- the data checks: arrays against the inputs, samples that agree, finite values,
  ids inside their tables, labels as class indices, whole batches of a fixed batch dimension;
* :mod:`.dataset` -- :class:`DataSet`, the batching files and hooks share, and :class:`ReaderAdapter`
  (a data set as ORT's ``CalibrationDataReader``);
* :mod:`.hooks` -- :func:`load_hook` (``module:function``, ``file.py:function``) and hooks as data;
* :mod:`.sources` -- :func:`open_data`: ``.npz`` files, folders of them, or a hook; ``--max-samples``;
* :mod:`.notes` -- :func:`data_notes`: the report's notes about its data.

Imports run one way: specs -> rows -> checks -> dataset -> hooks -> sources; notes reads dataset and
specs. This module re-exports the names other modules, tests and benchmarks use; patch a name in the
submodule that looks it up, not here.
"""

from qdebug.data.dataset import DataSet, ReaderAdapter
from qdebug.data.hooks import load_hook
from qdebug.data.notes import data_notes, defaulted_inputs, ignored_note
from qdebug.data.rows import Axes, Batch, feed_rows, join_rows, take_rows
from qdebug.data.sources import open_data
from qdebug.data.specs import (
    BATCH_AXIS_FLAG,
    LABELS_KEY,
    NO_AXIS_RULE,
    UNDECIDED,
    InputSpec,
    batch_axes,
    batch_axis_note,
    decide_batch_axes,
    fixed_batch,
    model_input_specs,
    output_batch_axes,
    resolve_batch_axes,
)

__all__ = [
    "BATCH_AXIS_FLAG",
    "LABELS_KEY",
    "NO_AXIS_RULE",
    "UNDECIDED",
    "Axes",
    "Batch",
    "DataSet",
    "InputSpec",
    "ReaderAdapter",
    "batch_axes",
    "batch_axis_note",
    "data_notes",
    "decide_batch_axes",
    "defaulted_inputs",
    "feed_rows",
    "fixed_batch",
    "ignored_note",
    "join_rows",
    "load_hook",
    "model_input_specs",
    "open_data",
    "output_batch_axes",
    "resolve_batch_axes",
    "take_rows",
]
