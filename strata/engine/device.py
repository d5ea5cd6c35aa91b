"""Where the engine runs and in what precision: the device, and the compute dtype with the reason
for it (`--dtype auto` decides from the CPU's flags or the GPU's support)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """The CPU computes bf16 natively (AVX-512 BF16 or AMX tiles), and oneDNN may use it."""
    held = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if held and held != "ALL" and not ("BF16" in held or "AMX" in held):
        return (
            False  # oneDNN held below bf16 (e.g. AVX2): bf16 matmuls would be emulated
        )
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """bf16 where the CPU computes it natively, else fp32 (emulated bf16 matmuls run several
    times slower than fp32). Decided from the CPU's flags, not by timing: every process on one
    machine must choose the same, or a PD pair or replicas sharing an L3 tier would hold KV of
    different dtypes (a timing on a busy machine once picked fp32 beside bf16)."""
    if cpu_has_fast_bf16():
        return torch.bfloat16, "the CPU has native bf16 (avx512_bf16 / amx_bf16)"
    return torch.float32, "the CPU has no native bf16, so bf16 would be emulated"


def pick_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The compute dtype and why it was chosen."""
    if name != "auto":
        return DTYPES[name], f"--dtype {name}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "auto: the GPU supports bf16"
        return torch.float16, "auto: the GPU has no bf16"
    dtype, reason = cpu_auto_dtype()
    return dtype, f"auto: {reason}"
