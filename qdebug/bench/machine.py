"""The machine a benchmark runs on: CPU model, INT8-relevant instruction sets, OS and ORT.

INT8 speed depends on the CPU more than on the model: without VNNI/AMX on
x86, or the dot-product instructions on Arm, ORT's INT8 kernels emulate the
int8 dot product and quantized variants are often no faster than FP32. The
machine is therefore part of every ``bench.json``, with a warning when
speed-ups are unlikely.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

import onnxruntime

from qdebug.records.bench import MachineInfo

X86_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "amx_tile", "avx512bw", "avx2")
"""x86 flags that decide ORT's INT8 kernels, reported when present (in this order)."""
X86_FAST = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
"""x86 flags with an int8 dot-product instruction (VNNI) or matrix unit (AMX)."""
ARM_INT8_FLAGS = ("asimddp", "i8mm", "sve", "sve2")
"""Arm features that decide ORT's INT8 kernels, reported when present (in this order)."""
ARM_FAST = frozenset({"asimddp", "i8mm"})
"""Arm features with an int8 dot-product instruction."""


def parse_cpuinfo(text: str) -> tuple[str, set[str]]:
    """(CPU model, flag set) from ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    model = ""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def int8_flags(arch: str, flags: set[str]) -> tuple[str, ...]:
    """The INT8-relevant flags present, in a fixed order."""
    wanted = ARM_INT8_FLAGS if _is_arm(arch) else X86_INT8_FLAGS
    return tuple(f for f in wanted if f in flags)


def _is_arm(arch: str) -> bool:
    """Whether ``platform.machine()`` names an Arm CPU (its flags are Arm features)."""
    return arch.lower().startswith(("arm", "aarch64"))


def int8_warning(arch: str, flags: set[str] | None, providers: Sequence[str]) -> str:
    """A warning when INT8 variants are unlikely to beat FP32 on this CPU (empty if they may).

    Only the CPU provider is judged: other providers run INT8 on their own hardware.
    ``flags=None`` means the flags could not be read.
    """
    if not providers or providers[0] != "CPUExecutionProvider":
        return ""
    if flags is None:
        return "could not read the CPU flags: cannot tell whether INT8 kernels are accelerated on this CPU"
    if _is_arm(arch):
        if flags & ARM_FAST:
            return ""
        return (
            "this Arm CPU has no int8 dot-product instructions (asimddp/i8mm): INT8 variants are likely "
            "no faster than FP32"
        )
    if flags & X86_FAST:
        return ""
    have = "AVX-512BW" if "avx512bw" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return (
        f"this CPU has no VNNI/AMX (only {have}): ORT's INT8 kernels emulate the int8 dot product, so INT8 "
        "variants are often no faster, and dynamic quantization can be several times slower, than FP32"
    )


def machine_info(providers: Sequence[str], threads: int, cpuinfo: str = "/proc/cpuinfo") -> MachineInfo:
    """Describe the CPU, OS and ORT this benchmark runs on."""
    arch = platform.machine()
    model, flags_read = "", None
    try:
        model, flags = parse_cpuinfo(Path(cpuinfo).read_text(errors="replace"))
        flags_read = flags if flags else None
    except OSError:
        pass
    if not model:
        model = platform.processor() or arch
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 0
    return MachineInfo(
        cpu_model=model,
        arch=arch,
        logical_cpus=os.cpu_count() or 0,
        cpus_available=available,
        int8_flags=int8_flags(arch, flags_read or set()),
        os=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
        ort_version=onnxruntime.__version__,
        providers=tuple(providers),
        threads=threads,
        warning=int8_warning(arch, flags_read, providers),
    )
