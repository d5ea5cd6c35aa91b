"""Load a Hugging Face model directory's safetensors into one of our model classes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from strata.config import ModelConfig
from strata.models import get_model_class


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str | None = None,
    group_size: int = 32,
) -> torch.nn.Module:
    """Build the model without initialising weights (meta device), fill it from the checkpoint, and
    quantize its linear weights if asked (`strata.layers.quant`). On the CPU, bf16 linear weights are
    then prepacked for oneDNN (`strata.layers.packed`)."""
    cls = get_model_class(cfg.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(cfg, max_positions=max_positions, rope_device=device)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        model.load_weights((name, t.to(dtype)) for name, t in iter_safetensors(model_dir))
    if quantization is not None:
        from strata.layers.quant import quantize_model

        model = quantize_model(model, quantization, group_size)
    if torch.device(device).type == "cpu":
        from strata.layers.packed import pack_linears

        pack_linears(model)
    release_freed_memory()
    return model.eval()


def release_freed_memory() -> None:
    """Hand the heap pages freed while loading (dtype copies of the checkpoint, weights replaced by
    quantized or packed ones) back to the OS: glibc keeps them otherwise, ~190 MiB of resident
    memory for the default model. A no-op where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
