"""What `strata bench moe` can be asked for, torch-free so the CLI's parser builds without torch:
the families it benchmarks, its implementations and `MoEBenchConfig` (the run is strata/bench/moe.py)."""

from __future__ import annotations

from dataclasses import dataclass

# family -> (transformers config class, MoE block class's module and name, config fields)
# family -> (transformers config class, module, MoE block class, extra config fields)
FAMILIES: dict[str, tuple[str, str, str, dict[str, int | None]]] = {
    "mixtral": ("MixtralConfig", "mixtral", "MixtralSparseMoeBlock", {}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        {"shared_expert_intermediate_size": None},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        {"norm_topk_prob": True},
    ),
    "gpt_oss": ("GptOssConfig", "gpt_oss", "GptOssMLP", {}),
}
IMPLEMENTATIONS = (
    "strata",
    "strata-loop",
    "strata-native",
    "transformers",
    "transformers-eager",
)


@dataclass(frozen=True)
class MoEBenchConfig:
    family: str = "qwen3_moe"
    hidden_size: int = 512
    intermediate_size: int = 512  # of one expert
    num_experts: int = 16
    top_k: int = 4
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    dtype: str = "float32"
    rounds: int = 5
    iters: int = 20
    seed: int = 0
