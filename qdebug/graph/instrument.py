"""Instrumented copies of a model: extra graph outputs, nothing else changed.

A pure, deterministic function: the same model and names give byte-identical
output, and the input model is never mutated. Outputs are declared with a bare
``ValueInfoProto(name=...)`` -- ORT infers type and shape itself, whereas
tools that copy value_info silently drop tensors that lack it.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """Return a copy of ``model`` that also outputs ``names`` (deduplicated, in the order given).

    Graph inputs and initializers are skipped (their values are known without
    running the model), and so are names that already are graph outputs.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    skip = {o.name for o in g.output} | {i.name for i in g.input} | {i.name for i in g.initializer}
    added = set()
    for name in names:
        if not name or name in skip or name in added:
            continue
        g.output.append(onnx.ValueInfoProto(name=name))
        added.add(name)
    return out
