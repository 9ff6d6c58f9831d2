"""The light layer's files and formatting: records to files and text, with neither onnx nor onnxruntime.

Modules:

* :mod:`~qdebug.output.files`: writing outputs safely (atomic writes, output checks, the output transaction);
* :mod:`~qdebug.output.report_io`: records <-> strict JSON and CSV, and every loader;
* :mod:`~qdebug.output.formatting`: plain-text formatting of numbers, sizes and node names;
* :mod:`~qdebug.output.snippet`: the ``quantize_static`` snippet as pure text;
* :mod:`~qdebug.output.ci_outputs`: every command's summary as Markdown, verify's gates as JUnit XML.

The TUI and the CLI printers are built on these: this file imports nothing, the modules only the standard
library and the rest of the light layer (``tests/test_layers.py``).
"""
