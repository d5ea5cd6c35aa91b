"""`RopeConfig`: a model's rotary embedding parameters, normalised from HF's config.json by
`strata.model_config` (which re-exports it); the latent-attention and DeepSeek-V4 parts of the config
(strata/mla_config.py, strata/dsv4_config.py) read it too."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from HF's `rope_parameters` / `rope_scaling`."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn | dynamic | longrope
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3 "su"): per-frequency divisors below / from original_max_position_embeddings on
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def yarn_mscale(self, m: float = 1.0) -> float:
        """YaRN's attention temperature for `factor`: 0.1 * m * ln(factor) + 1 (1 when not stretched)."""
        return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0
