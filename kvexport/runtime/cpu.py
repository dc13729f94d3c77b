"""What this CPU offers the runtimes' kernels: the instruction sets that decide which int8 and float16
kernels XNNPACK, ONNX Runtime and llama.cpp pick, and so how fast and how exactly one program runs
on two CPUs (docs/performance.md#the-host)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from ..errors import InvalidOptionError

CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16", "amx_int8", "asimddp", "asimdhp",
                "i8mm", "sve")

# Threads for the runtimes' own pools (ONNX Runtime's intra-op pool, ExecuTorch's threadpool,
# onnxruntime-genai's session): for several processes side by side, which each default to one
# thread per core and then spin against each other. torch follows OMP_NUM_THREADS.
THREADS_ENV = "KVEXPORT_THREADS"


# More threads than any runtime's pool takes (ONNX Runtime's count is a C int): a typo, refused.
MAX_THREADS = 1024


def runtime_threads() -> int | None:
    """``KVEXPORT_THREADS`` as a count, or None where it is unset (each runtime's own default). ASCII
    digits only: ``str.isdigit`` takes superscripts that ``int`` does not."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_THREADS:
        raise InvalidOptionError(
            f"{THREADS_ENV}={value!r}: give a whole number of threads, at least 1 and at most {MAX_THREADS}, or unset it"
        )
    return int(value)


# XNNPACK sums float16 products in float16 on a CPU with float16 arithmetic (x86's AVX512-FP16, Arm's
# FP16 extension: every recent phone), and in float32 elsewhere, as eager float16 does.
FLOAT16_ARITHMETIC = ("avx512_fp16", "asimdhp")


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of ``CPU_FEATURES`` it has (Linux; elsewhere the name only)."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), [f for f in CPU_FEATURES if f in flags]


def xnnpack_sums_float16_in_float16() -> bool:
    """Whether XNNPACK picks its float16-arithmetic kernels on this CPU."""
    if platform.system() == "Darwin":
        return platform.machine() == "arm64"  # every Apple CPU of that architecture has it
    return any(feature in FLOAT16_ARITHMETIC for feature in cpu_info()[1])
