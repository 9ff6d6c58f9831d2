"""The graph engine (the default) computes KL from in-graph subsamples of the reference, the candidate and the
fake-quantized reference. test_graph_and_numpy_engines_agree compares SQNR, max-abs and cosine only, so feeding
the reference in place of either subsample (KL 0 everywhere) passed the suite."""

from __future__ import annotations

import math

import numpy as np

from qdebug.cli.main import main
from qdebug.output.report_io import load_report


def test_graph_engine_kl_follows_the_numpy_engine_when_ranges_clip(cnn, tmp_path):
    """A QDQ model calibrated on half-scale data clips the full-scale data: local KL is then > 0 (clipping),
    and both engines must see it, as they see the accumulated KL."""
    model, calib = cnn
    with np.load(calib) as z:
        np.savez(tmp_path / "half.npz", input=z["input"] * 0.5, labels=z["labels"])
    assert (
        main(["analyze", str(model), "--calib", str(tmp_path / "half.npz"), "-o", str(tmp_path / "h.json"), "-q"]) == 0
    )
    quantized = tmp_path / "h_files" / "quantized.onnx"
    reports = {}
    for engine in ("graph", "numpy"):
        out = tmp_path / f"{engine}.json"
        args = ["analyze", str(model), "--calib", str(calib), "--quantized", str(quantized), "-o", str(out), "-q"]
        assert main([*args, "--engine", engine]) == 0
        reports[engine] = load_report(out)
    g, n = reports["graph"], reports["numpy"]
    compared = {"local": 0, "accumulated": 0}
    for tn in n.tensors:
        tg = g.tensor(tn.name)
        for kind in compared:
            a, b = getattr(tg, kind), getattr(tn, kind)
            if b is None or math.isnan(b.kl) or b.kl < 0.1:
                continue
            # subsampled in-graph vs every element in numpy: same order of magnitude, never ~0
            assert 0.5 * b.kl <= a.kl <= 2.0 * b.kl, (tn.name, kind, a.kl, b.kl)
            compared[kind] += 1
    assert compared["local"] >= 3 and compared["accumulated"] >= 3, compared
