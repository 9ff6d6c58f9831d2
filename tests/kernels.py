"""What this machine's integer kernels compute, asked of ONNX Runtime itself rather than read off CPU flags.

On x86, ORT's u8s8 MatMul/Conv kernels differ by CPU kind: with VNNI (or AMX) each product pair is summed
exactly into int32; on AVX2 or AVX-512 without VNNI the pair sums pass through a saturating int16
(``vpmaddubsw``), so a quantized model scores differently there. A test that depends on which kernels run asks
:func:`u8s8_saturates` -- a probe of the kernels themselves -- instead of ``/proc/cpuinfo``: under an emulator
(``.ci/other-cpu``) or a hypervisor that hides flags, the flags and the kernels can disagree.

The probe is :mod:`qdebug.runtime.kernels`'s (propose gives the dynamic and mixed recipes 7-bit weights where
it says ``saturating``). ``python -m tests.kernels`` prints ``saturating`` or ``exact`` (``--expect KIND``
exits 1 on the other).
"""

from __future__ import annotations

import sys

from qdebug.runtime.kernels import kind, u8s8_saturates

__all__ = ["kind", "u8s8_saturates"]  # the probe lives in the package: propose asks it too


if __name__ == "__main__":
    found = kind()
    print(found)
    if len(sys.argv) == 3 and sys.argv[1] == "--expect" and sys.argv[2] != found:
        sys.exit(1)
