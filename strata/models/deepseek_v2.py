"""DeepSeek-V2 and DeepSeek-V3: the pre-norm decoder with multi-head latent attention in every layer
(`strata.layers.mla`; the KV pool keeps one latent row per token and layer, `LatentKVPool`) and
DeepSeek's mixture of experts after the first `first_k_dense_replace` dense layers: routed experts
plus always-on shared experts, routed by model type (`strata.moe_config`): V2 softmax, greedy or
group-limited greedy; V3 sigmoid scores with a per-expert correction bias, group-limited top-k,
both times `routed_scaling_factor`. V3 differs from V2 only in its config (routing, rope_interleave),
so one class serves both.

Its checkpoint names the shared experts `mlp.shared_experts` (ours: `mlp.shared_expert`, one MLP
of n_shared_experts * moe_intermediate_size); q and the latent have projections of their own, so
only gate/up are fused. DeepSeek-V3's published checkpoints hold a multi-token-prediction layer
after the last one (`model.layers.{num_hidden_layers}`), skipped here (`strata.models.mtp` loads it
for `--speculative-algorithm mtp`); their FP8 weights (with
`weight_scale_inv` tensors) are refused with a message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from strata.mla_config import MLATraits
from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec, KVLayout
from strata.moe_config import MoETraits

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
Weight = tuple[str, torch.Tensor]  # (checkpoint name, tensor)


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    # q and the latent have projections of their own: only an MLP's gate/up are fused
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        frag: fused
        for frag, fused in DecoderForCausalLM.FUSED.items()
        if fused[0] == "gate_up_proj"
    }
    RENAMES = (("mlp.shared_experts.", "mlp.shared_expert."),)

    def load_weights(
        self, weights: Iterable[Weight], absent: frozenset[str] = frozenset()
    ) -> None:
        super().load_weights(self._decoder_weights(weights), absent)

    def _decoder_weights(self, weights: Iterable[Weight]) -> Iterator[Weight]:
        """The checkpoint without its multi-token-prediction layers; FP8 weights fail here."""
        for name, tensor in weights:
            if name.endswith("weight_scale_inv"):
                raise ValueError(
                    f"this checkpoint holds FP8 weights ({name}), which Strata does not read; use a bf16 "
                    "checkpoint (e.g. converted with DeepSeek's fp8_cast_bf16.py)"
                )
            layer = _LAYER.match(name)
            if layer is None or int(layer[1]) < self.config.num_layers:
                yield name, tensor


# V2: routing by `topk_method`, never renormalised (as transformers runs it), RoPE always interleaved;
# V3: sigmoid scores with a correction bias, renormalised per `norm_topk_prob`, RoPE per
# `rope_interleave`; both scale by `routed_scaling_factor` and keep shared experts
DEEPSEEK_V2 = ConfigTraits(
    mla=MLATraits(always_interleaved=True),
    moe=MoETraits(
        routing=None, norm_topk_prob=False, routed_scaling=True, shared_experts=True
    ),
)
DEEPSEEK_V3 = ConfigTraits(
    mla=MLATraits(),
    moe=MoETraits(
        routing="sigmoid_group_topk",
        routed_scaling=True,
        correction_bias=True,
        shared_experts=True,
    ),
)

SPEC = FamilySpec(
    name="deepseek_v2",
    architectures={
        "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
        "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    },
    model_types={"deepseek_v2": DEEPSEEK_V2, "deepseek_v3": DEEPSEEK_V3},
    kv_layout=KVLayout.LATENT,
    tensor_parallel=False,
    native_decode=False,
    draft_model=False,
)
