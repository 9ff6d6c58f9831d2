"""The terminal UI (``qdebug tui``): a Textual view over a saved report.

``qdebug.tui`` itself imports nothing heavy; :mod:`qdebug.tui.model` and
:mod:`qdebug.tui.charts` are plain Python (no Textual), :mod:`qdebug.tui.app`
holds the app and :func:`~qdebug.tui.app.run_tui`. Nothing here imports
onnxruntime or onnx.
"""
