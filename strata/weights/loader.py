"""Load a Hugging Face model directory's safetensors into one of our model classes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from strata.config import QUANTIZATION_METHODS
from strata.layers.engram_tables import TABLE_PLACEMENTS
from strata.layers.quant import (
    QUANT_METHODS,
    Q4Linear,
    Q8Linear,
    QuantEmbedding,
    QuantLinear,
    concat_rows,
    quantize_model,
)
from strata.model_config import ModelConfig
from strata.models import get_model_class
from strata.weights.gguf import BLOCKS_FILE


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The float safetensors files of a model directory (not the GGUF blocks)."""
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.name != BLOCKS_FILE)
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors files")
    return files


def iter_safetensors(
    model_dir: Path, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a mapping
                if name not in skip:
                    yield name, f.get_tensor(name)


def checkpoint_names(model_dir: Path) -> list[str]:
    names: list[str] = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float tensors in the model's dtype; integer tables (token-id maps) exact as stored."""
    return t.to(dtype) if t.is_floating_point() else t


def load_model(
    model_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str = "auto",
    shard=None,
    engram_placement: str = "memory",
    matmul: str = "exact",
) -> torch.nn.Module:
    """Build the model without initialising weights (meta device) and fill it from the checkpoint.

    quantization: `auto` runs a converted GGUF on its own blocks (strata.layers.quant) and any other
    checkpoint in float; `gguf` insists on the blocks; `none` loads float weights (a GGUF dequantized);
    `int8` / `int4` quantize float weights into q8 / q4 blocks. Blocks run on the CPU only. On the CPU,
    bf16 linear weights left float are then prepacked for oneDNN (`strata.layers.packed`).

    shard (`strata.distributed.layers.ShardedLoad`): one tensor/expert-parallel rank's part, built
    from its local config, each checkpoint tensor sliced as it is read; GGUF blocks are not sliced,
    so such a rank loads float weights.

    engram_placement (`strata.layers.engram_tables`): `host` / `mmap` keep a model's Engram tables
    outside it, read into host memory or mapped from the checkpoint; other models ignore it.

    matmul (`strata.layers.fast_matmul`): `fast` lets the block linears' large calls take oneDNN bf16
    where a timing here finds it faster; `exact` keeps every call on the int8 kernel."""
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_METHODS}, got {quantization!r}"
        )
    on_cpu = torch.device(device).type == "cpu"
    blocks_path = model_dir / BLOCKS_FILE
    if quantization == "gguf" and not (blocks_path.is_file() and on_cpu):
        raise ValueError(
            f"--quantization gguf needs a GGUF model on the CPU; {model_dir} has no GGUF blocks"
            if on_cpu
            else "--quantization gguf runs on the CPU only; use --device cpu or --quantization none"
        )
    if quantization == "gguf" and shard is not None:
        raise ValueError(
            "--quantization gguf cannot be split over ranks; use --quantization auto or none"
        )
    cls = get_model_class(cfg.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(
                shard.local_config() if shard else cfg,
                max_positions=max_positions,
                rope_device=device,
            )
            if shard is not None:
                shard.prepare(model)
    finally:
        torch.set_default_dtype(default_dtype)
    tables: dict[
        str, int
    ] = {}  # Engram tables kept outside the model: {checkpoint name: layer}
    take_tables = getattr(model, "take_engram_tables", None)
    if engram_placement != "memory" and take_tables is not None:
        tables = take_tables(checkpoint_names(model_dir))
    model = model.to_empty(
        device=device
    )  # untouched pages: weights replaced by blocks never become resident
    blocks = {}
    if (
        quantization in ("auto", "gguf")
        and on_cpu
        and blocks_path.is_file()
        and shard is None
    ):
        blocks = block_layers(model, blocks_path)
    covered = frozenset(
        name for module in blocks for name in model.checkpoint_parts(module)
    ) | frozenset(tables)
    with torch.no_grad():
        model.load_weights(
            (
                (name, _as_dtype(shard.shard_tensor(name, t) if shard else t, dtype))
                for name, t in iter_safetensors(model_dir, covered)
            ),
            absent=frozenset(f"{module}.weight" for module in blocks),
        )
    install_block_layers(model, blocks, dtype)
    if tables:
        make_tables = TABLE_PLACEMENTS[engram_placement]
        assert make_tables is not None
        engram = model.config.dsv4.engram  # only Engram models hand tables over
        model.engram_tables = make_tables(
            checkpoint_files(model_dir),
            tables,
            dtype,
            torch.device(device).type == "cuda",
            rows=engram.shard_rows,
        )
    if quantization in QUANT_METHODS:
        model = quantize_model(model, quantization)
    if on_cpu:
        from strata.layers.packed import pack_linears
        from strata.layers.quant import choose_int8_tiles

        pack_linears(model)
        choose_int8_tiles(model, dtype)
        if matmul == "fast":
            from strata.layers.fast_matmul import choose_fast_matmul

            choose_fast_matmul(model, dtype, matmul)
    if shard is not None:
        shard.install(model)
    release_freed_memory()
    return model.eval()


class _CheckpointModel(Protocol):
    def named_modules(self) -> Iterator[tuple[str, torch.nn.Module]]: ...
    def checkpoint_parts(self, module: str) -> list[str]: ...


def block_layers(
    model: _CheckpointModel, blocks_path: Path
) -> dict[str, torch.nn.Module]:
    """Our linear layers (and embedding table) whose checkpoint tensors all come in blocks, built
    from them: {module name: QuantLinear without bias}."""
    with safe_open(str(blocks_path), framework="pt") as f:
        keys = set(f.keys())
        stored = {name.rsplit(".", 1)[0] for name in keys}

        def layer(name: str) -> QuantLinear:
            if f"{name}.m" in keys:
                return Q4Linear(
                    f.get_tensor(f"{name}.qs"),
                    f.get_tensor(f"{name}.d"),
                    f.get_tensor(f"{name}.m"),
                )
            return Q8Linear(f.get_tensor(f"{name}.qs"), f.get_tensor(f"{name}.d"))

        out: dict[str, torch.nn.Module] = {}
        for module, sub in model.named_modules():
            if isinstance(sub, (torch.nn.Linear, torch.nn.Embedding)):
                parts = model.checkpoint_parts(module)
                if all(part in stored for part in parts):
                    out[module] = concat_rows([layer(part) for part in parts])
    return out


def install_block_layers(
    model: torch.nn.Module, blocks: dict[str, torch.nn.Module], dtype: torch.dtype
) -> None:
    """Swap the block layers in (a linear keeps its loaded bias); an embedding in blocks becomes a
    `QuantEmbedding` whose blocks also serve as the tied output projection."""
    for module, layer in blocks.items():
        old = model.get_submodule(module)
        parent, _, leaf = module.rpartition(".")
        if isinstance(old, torch.nn.Embedding):
            assert isinstance(layer, QuantLinear)
            layer, tied = QuantEmbedding(layer, dtype), layer
            if getattr(model, "lm_head", "absent") is None:
                model.lm_head = tied
        elif isinstance(bias := old.bias, torch.Tensor):
            layer.register_buffer("bias", bias.detach().clone())
        setattr(model.get_submodule(parent) if parent else model, leaf, layer)


def release_freed_memory() -> None:
    """Hand the heap pages freed while loading (dtype copies of the checkpoint, weights replaced by
    quantized or packed ones) back to the OS: glibc keeps them otherwise, ~190 MiB of resident
    memory for the default model. A no-op where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
