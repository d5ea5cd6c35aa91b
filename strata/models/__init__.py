"""Model families: a registry of their `FamilySpec`s (`strata.models.spec`), one per family file,
imported on first use; from it, the model class of an HF architecture name, and a config.json read
as a `ModelConfig` with its family's `ConfigTraits` (`config_from_hf`, `config_from_dir`).

Every family is the decoder of `decoder.py` (plain PyTorch over `strata.layers`), configured by
`ModelConfig` and its per-layer `LayerSpec`s (a layer's MLP is dense or a mixture of experts,
`strata.layers.moe`; its attention is paged attention, or DeepSeek's latent attention,
`strata.layers.mla`); each family's small file says what is particular to it. A model's forward
takes a `ForwardBatch` and the KV pool and returns hidden states; `compute_logits` runs the LM head
only on the rows that are sampled.
"""

from __future__ import annotations

import importlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from strata.model_config import ModelConfig
from strata.models.spec import FamilySpec

# One line per family: the module that declares its `SPEC` beside its model classes.
FAMILIES: tuple[str, ...] = (
    "strata.models.llama",
    "strata.models.ministral",
    "strata.models.gemma",
    "strata.models.phi3",
    "strata.models.olmo2",
    "strata.models.mixtral",
    "strata.models.qwen_moe",
    "strata.models.gpt_oss",
    "strata.models.deepseek_v2",
    "strata.models.deepseek_v4",
)


@cache
def family_specs() -> tuple[FamilySpec, ...]:
    """Every family's spec, imported on first use; no two claim an architecture or a model_type."""
    specs = tuple(importlib.import_module(module).SPEC for module in FAMILIES)
    for names in ("architectures", "model_types"):
        seen: dict[str, str] = {}
        for spec in specs:
            for name in getattr(spec, names):
                if name in seen:
                    raise RuntimeError(
                        f"{name} is claimed by {seen[name]} and {spec.name}"
                    )
                seen[name] = spec.name
    return specs


def supported_architectures() -> list[str]:
    return sorted(arch for spec in family_specs() for arch in spec.architectures)


def family_spec(architecture: str) -> FamilySpec:
    """The spec of the family that runs HF `architecture` (config.json's `architectures[0]`)."""
    for spec in family_specs():
        if architecture in spec.architectures:
            return spec
    raise ValueError(
        f"model architecture {architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
    )


def get_model_class(architecture: str) -> type:
    return family_spec(architecture).architectures[architecture]


def supported_model_types() -> list[str]:
    return sorted(name for spec in family_specs() for name in spec.model_types)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """A config.json's dict as a `ModelConfig`, read with the `ConfigTraits` its family declares for
    its model_type. The family is the one that runs its architecture (`architectures[0]`) or, for a
    config naming none, the one that claims its model_type; ValueError if no family serves it."""
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type", "")
    if archs:
        spec = family_spec(archs[0])
        if model_type not in spec.model_types:
            raise ValueError(
                f"{archs[0]} with model_type {model_type!r} is not supported; its configs have "
                f"model_type {', '.join(spec.model_types)}"
            )
        return ModelConfig.from_hf_dict(raw, spec.model_types[model_type])
    for spec in family_specs():
        if model_type in spec.model_types:
            return ModelConfig.from_hf_dict(raw, spec.model_types[model_type])
    raise ValueError(
        f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
    )


def config_from_dir(model_dir: str | Path) -> ModelConfig:
    """The `ModelConfig` of an HF model directory (its config.json, read by `config_from_hf`)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json; expected a Hugging Face model directory"
        )
    return config_from_hf(json.loads(path.read_text()))
