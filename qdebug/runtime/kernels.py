"""What this machine's integer kernels compute, asked of ONNX Runtime itself rather than read off CPU flags.

On x86, ORT's u8s8 MatMul/Conv kernels differ by CPU kind: with VNNI (or AMX) each product pair is summed
exactly into int32; on AVX2 or AVX-512 without VNNI the pair sums pass through a saturating int16
(``vpmaddubsw``), so a quantized model scores differently there. ORT's documentation advises 7-bit weights
(``reduce_range``) for such machines. :func:`u8s8_saturates` probes the kernels themselves instead of
``/proc/cpuinfo``: under an emulator or a hypervisor that hides flags, the flags and the kernels can disagree.
"""

from __future__ import annotations

import functools

import numpy as np

_K = 64


@functools.cache
def u8s8_saturates() -> bool:
    """True when ORT's u8s8 integer kernels saturate their int16 pair sums on this machine.

    The probe multiplies 64 uint8 255s by int8 127s: exactly 64 * 255 * 127; a saturating kernel sums each
    pair to 32767 and gives 32 * 32767 instead. One one-node session, once per process."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.full((_K, 1), 127, np.int8), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])],
        "u8s8_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, _K])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [1, 1])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"a": np.full((1, _K), 255, np.uint8)})
    return int(y[0, 0]) != _K * 255 * 127


def kind() -> str:
    """``saturating`` or ``exact``: this machine's u8s8 kernels."""
    return "saturating" if u8s8_saturates() else "exact"
