"""Quantization and calibration: the settings, the ranges, and ORT's quantizer.

Modules:

* :mod:`~qdebug.quant.config`: the user's settings (``--config`` files, presets, the settings read off a QDQ model);
* :mod:`~qdebug.quant.calibrate`: calibrate once with ORT's calibrators, ranges cached on disk;
* :mod:`~qdebug.quant.quantize`: the only module that calls ORT's quantizer and spells its options;
* :mod:`~qdebug.quant.fast_quantize`: ORT's own quantizer and MinMax calibrator over indexed lookups;
* :mod:`~qdebug.quant.recalibrate`: the flipped samples added to the calibration, from the cached ranges;
* :mod:`~qdebug.quant.switchable`: one fake-quant model whose every Q/DQ a graph input switches off.

Import the modules themselves; this file imports nothing.
"""
