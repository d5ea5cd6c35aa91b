from __future__ import annotations

import torch

from strata.engine.device import cpu_has_fast_bf16, pick_dtype


def _native_bf16_flags() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def test_auto_dtype_follows_the_cpu_flags_and_is_the_same_every_time(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    expected = torch.bfloat16 if _native_bf16_flags() else torch.float32
    picks = {pick_dtype("auto", torch.device("cpu"))[0] for _ in range(5)}
    assert picks == {expected}


def test_onednn_held_to_avx2_means_no_native_bf16(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not cpu_has_fast_bf16()
    assert pick_dtype("auto", torch.device("cpu"))[0] == torch.float32
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert cpu_has_fast_bf16() == _native_bf16_flags()
