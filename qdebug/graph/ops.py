"""Op-type vocabularies: which ONNX ops carry quantization, move values, or stay float.

Plain sets of names, no onnx import: the graph layer, the analysis notes, propose's structure and the
commands read the same sets, so a new op is taught to qdebug in one place.
"""

Q_OPS = ("QuantizeLinear",)
DQ_OPS = ("DequantizeLinear",)

REMOVABLE = ("Relu", "Clip")
"""Activations ORT folds into their producer's output quantization (asymmetric activations)."""

DATA_SHAPED_OPS = frozenset({"NonZero", "NonMaxSuppression", "Unique", "Compress"})
"""Ops whose output shape depends on input *values*: quantization can change how many elements they keep."""

PERMUTATION_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
"""Ops whose output holds exactly their input's values (in another order or shape)."""

INTEGER_KERNEL_OPS = (
    "QGemm",
    "QAttention",
    "QEmbedLayerNormalization",
    "MatMulInteger",
    "ConvInteger",
    "DynamicQuantizeLinear",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "DynamicQuantizeLSTM",
)
"""Integer-kernel ops besides ``QLinear*`` that mark a model as already quantized."""

QUANT_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger")
"""Ops a quantizer inserts (QDQ or dynamic)."""

INTEGER_OPS = {
    "Conv": ("ConvInteger",),
    "MatMul": ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"),
    "Gemm": ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"),
}
"""FP32 op -> the integer ops ``quantize_dynamic`` replaces it with (a Gemm becomes MatMul + Add)."""

DYNAMIC_Q = "DynamicQuantizeLinear"

WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
"""Ops whose weights are quantized (an initializer input)."""

GLUE_OPS = frozenset({"Mul", "Div", "Add", "Sub", "Where", "Cast", "Identity", "Dropout", "Reshape", "Transpose"})
"""Elementwise and layout ops between an attention Softmax and its MatMuls (scaling, masking, reshapes):
propose walks through them to find the attention core."""
