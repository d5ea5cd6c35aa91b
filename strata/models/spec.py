"""`FamilySpec`: what the engine needs to know about a model family, declared once in the family's
file beside its modules (`SPEC = FamilySpec(...)`) and collected by the registry in
`strata.models`. Reading config.json, the engine, the loader, the tensor-parallel split and the
native decode loop ask the spec instead of branching on `model_type`.

Torch-free: the spec names its model classes, it does not build them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from strata.cache.kv_layout import KVLayout
from strata.model_config import ConfigTraits


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp writes a family in GGUF (`strata.weights.gguf` converts it back to HF)."""

    name: str  # GGUF `general.architecture`
    architecture: str  # the HF architecture and model_type written into config.json
    model_type: str
    # llama.cpp permuted the q/k rows on conversion (HF rotate_half -> ggml's interleaved pairs)
    permuted_qk: bool = False
    # llama.cpp stored every `*norm.weight` plus 1 (RMSNorm scaling by 1 + weight)
    norm_offset: bool = False
    # a layer's tensors whose names differ from Llama's: llama.cpp key (`blk.N.<key>`) -> HF name
    layer_tensor_names: dict[str, str] = field(default_factory=dict, hash=False)
    # transformers' AutoTokenizer takes the tokenizer class by the model_type (`tokenizer_type`)
    named_tokenizer: bool = False
    # tokens that end a turn besides the file's eos token (added to generation_config.json)
    end_of_turn_tokens: tuple[str, ...] = ()
    # config(hf_config, meta): writes into the config.json dict what the file leaves to llama.cpp's
    # runtime; meta(key, default) reads `<name>.<key>` from the file's metadata; ValueError if unusable
    config: Callable[[dict[str, Any], Callable[..., Any]], None] | None = field(
        default=None, hash=False
    )


@dataclass(frozen=True)
class FamilySpec:
    """One model family: the HF names it serves, how their config.json reads and what the engine
    builds for it.

    `architectures` maps each HF architecture name (config.json's `architectures[0]`) to the model
    class that runs it; `model_types` maps each HF `model_type` those configs carry to how its
    config.json reads where the file does not say (`ConfigTraits`; `ConfigTraits()` reads it as
    Llama's). No two specs share an architecture or a model_type (the registry checks)."""

    name: str
    architectures: dict[str, type] = field(hash=False)
    model_types: dict[str, ConfigTraits] = field(hash=False)
    kv_layout: KVLayout = KVLayout.PAGED
    # the model's layers split over ranks (--tp-size / --ep-size); False: refused with a message
    tensor_parallel: bool = True
    # the experts (and Engram tables) split over ranks by --ep-size with the attention replicated,
    # also where tensor_parallel is False; None: as tensor_parallel
    expert_parallel: bool | None = None
    # a decode step's layers may run from C++ (`strata.models.native_decode`), when the model's
    # config and weights also qualify (pre-norm, no q/k norm, SiLU MLP, packed linears)
    native_decode: bool = True
    # a model of this family can be a separate draft model (`--speculative-draft-model`)
    draft_model: bool = True
    # the GGUF architectures that convert to this family
    gguf: tuple[GGUFArch, ...] = ()
