"""A checkpoint's multi-token prediction layer (`strata.models.mtp.MTPLayer`), loaded beside its
target model for `--speculative-algorithm mtp`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from strata.models.mtp import MTPLayer

if TYPE_CHECKING:
    from strata.models.decoder import DecoderForCausalLM


def mtp_weights(model_dir: Path, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors named `{prefix}*`, read from whichever safetensors files hold them."""
    from strata.weights.gguf import BLOCKS_FILE

    for path in sorted(
        p for p in model_dir.glob("*.safetensors") if p.name != BLOCKS_FILE
    ):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a mapping
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def load_mtp_layer(
    model_dir: Path,
    target: DecoderForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str,
) -> MTPLayer:
    """The first MTP layer of the checkpoint beside `target` (loaded), in the target's dtype and
    weight quantization (int8/int4; a converted GGUF's MTP layer, if it kept one, loads float)."""
    from strata.layers.quant import QUANT_METHODS, quantize_model

    cfg = target.config
    prefix = f"model.layers.{cfg.num_layers}."
    if cfg.dsv4 is not None:
        raise ValueError(
            "--speculative-algorithm mtp: DeepSeek-V4's multi-token prediction layers are not supported"
        )
    if cfg.mtp_layers < 1:
        raise ValueError(
            f"--speculative-algorithm mtp: {model_dir.name} has no multi-token prediction layers "
            "(its config's num_nextn_predict_layers is 0)"
        )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            layer = MTPLayer(target, max_positions, device)
    finally:
        torch.set_default_dtype(default_dtype)
    layer = layer.to_empty(device=device)
    weights = mtp_weights(model_dir, prefix)
    first = next(weights, None)
    if first is None:
        raise ValueError(
            f"--speculative-algorithm mtp: {model_dir.name} declares {cfg.mtp_layers} multi-token prediction "
            f"layer(s) but its checkpoint holds no {prefix}* weights"
        )
    with torch.no_grad():
        layer.load_weights(
            ((n, t.to(dtype)) for n, t in itertools.chain([first], weights)), prefix
        )
    if quantization in QUANT_METHODS:
        quantize_model(layer.decoder, quantization)
    if device.type == "cpu":
        from strata.layers.packed import pack_linears

        pack_linears(layer)
    return layer.eval()
