"""GPT-OSS: a pre-norm decoder with biased q/k/v/o projections, a learned attention sink per head,
alternating sliding-window (128) and full layers under YaRN RoPE, and a mixture of experts in every
layer: top-k on the router's biased logits, softmax over the k chosen
(`strata.layers.moe_routing.topk_softmax`), experts with biases and a clamped SwiGLU
(`strata.layers.activation.clamped_swiglu`).

Its checkpoint stacks the experts transposed, gate and up interleaved column by column:
gate_up_proj [E, H, 2I] (gate = [..., 0::2], up = [..., 1::2]), gate_up_proj_bias [E, 2I],
down_proj [E, I, H]; `expert_tensor` turns them into our [E, 2I, H] gate-first / [E, H, I] layout.
The router is `mlp.router`, ours `mlp.gate`. (The published checkpoints hold the experts in MXFP4
blocks, which this loader does not read: it takes float checkpoints.)
"""

from __future__ import annotations

import torch

from strata.model_config import ConfigTraits
from strata.models.decoder import DecoderForCausalLM
from strata.models.spec import FamilySpec
from strata.moe_config import MoETraits


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate and up alternating -> [..., 2I] with the I gate entries first."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def expert_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """One of GPT-OSS's stacked expert tensors (`name` relative to the experts) in our layout."""
    if name.endswith(("_blocks", "_scales")):
        raise ValueError(
            f"this GPT-OSS checkpoint holds its experts in MXFP4 blocks ({name}), which Strata does not read; "
            "use a float (bf16) checkpoint, e.g. one saved by transformers after loading with "
            "quantization_config=Mxfp4Config(dequantize=True)"
        )
    if name == "gate_up_proj":  # [E, H, 2I] interleaved -> [E, 2I, H] gate first
        return _deinterleave(tensor).transpose(1, 2).contiguous()
    if name == "gate_up_proj_bias":
        return _deinterleave(tensor)
    if name == "down_proj":  # [E, I, H] -> [E, H, I]
        return tensor.transpose(1, 2).contiguous()
    return tensor


class GptOssForCausalLM(DecoderForCausalLM):
    RENAMES = (("mlp.router.", "mlp.gate."),)

    def expert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return expert_tensor(name, tensor)


SPEC = FamilySpec(
    name="gpt_oss",
    architectures={"GptOssForCausalLM": GptOssForCausalLM},
    model_types={
        "gpt_oss": ConfigTraits(
            sinks=True,
            moe=MoETraits(
                routing="topk_softmax", biases=True, expert_act="clamped_swiglu"
            ),
        )
    },
)
