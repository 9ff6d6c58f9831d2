"""Whole-model recipes: what propose tries before any per-node change when static INT8 loses across the model.

A recipe is either a transform of the FP32 model that ORT's quantizer then quantizes as usual (BatchNormalization
folded into Conv, cross-layer equalization, SmoothQuant, bias correction), or a way of calling ORT's quantizer
(dynamic, mixed static/dynamic, per-channel, a calibration method per tensor). Every transform is a pure
function over an ONNX model returning a :class:`~qdebug.recipes.base.Transformed`; the equivalence transforms
are checked against the FP32 model's outputs before they are used.
"""
