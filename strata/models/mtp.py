"""Multi-token prediction (MTP) layers shipped with a checkpoint (DeepSeek-V3's
`num_nextn_predict_layers`): a decoder layer past the last one that predicts one more token.

For the token at position p + 1 and the target's final hidden state h_p (after its last norm), the
layer computes

    x   = eh_proj([enorm(embed(token_{p+1})) | hnorm(h_p)])
    m_p = norm(decoder_layer(x))              (the layer at RoPE position p + 1; norm: shared_head.norm)

and m_p's logits (the target's LM head) predict token p + 2. Chaining it — m_p in place of the
target's h_{p+1}, the drafted token as token_{p+2} — drafts further (as vLLM and SGLang chain
DeepSeek's one layer); transformers' `MtpModel` computes the same and is the oracle.

The layer attends over its own KV of earlier positions (one row per position p, for the pair
(h_p, token_{p+1})), kept by `strata.engine.mtp.MTPDrafter`. The embedding and LM head are the
target's: only the layer, its three norms and eh_proj are loaded (checkpoint names
`model.layers.{num_layers}.*`; DeepSeek's copies of the embedding and head there are skipped).
Checkpoints with several MTP layers load the first; it is the one chained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from strata.layers.norm import RMSNorm
from strata.model_config import ModelConfig

if TYPE_CHECKING:
    from strata.models.decoder import DecoderForCausalLM

OWN = (
    "enorm.",
    "hnorm.",
    "eh_proj.",
)  # the MTP layer's own modules, beside its decoder layer
SHARED = (
    "embed_tokens.",
    "shared_head.head.",
)  # the target's embedding and head, stored again


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The one-layer config the MTP layer is built from: like the target's last layer, except that
    MTP layers are always mixtures of experts in a mixture-of-experts model (transformers sets
    first_k_dense_replace to 0 for them)."""
    spec = dataclasses.replace(cfg.layers[-1], moe=cfg.moe is not None)
    if spec.window is not None:
        raise ValueError(
            "multi-token prediction over a sliding-window layer is not supported"
        )
    return dataclasses.replace(cfg, num_layers=1, layers=(spec,))


class MTPLayer(nn.Module):
    def __init__(
        self,
        target: DecoderForCausalLM,
        max_positions: int,
        rope_device: torch.device | str = "cpu",
    ):
        super().__init__()
        cfg = target.config
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # the decoder layer and its final norm, in the target's family (its weight names and fusions)
        self.decoder = type(target)(mtp_config(cfg), max_positions, rope_device)
        self.decoder.embed_tokens = None  # type: ignore[assignment]  # the target's, passed to forward
        self.decoder.lm_head = None

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        meta,
        kv,
    ) -> torch.Tensor:
        """embeds: [T, hidden] the next tokens' embeddings; hidden: [T, hidden] the states they
        follow; positions: [T] the next tokens' positions. Returns the layer's states [T, hidden]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        d = self.decoder
        x, residual = d.layers[0](x, None, positions, d.layer_ropes[0], meta, kv)
        return d.norm(x, residual)[0]

    def load_weights(
        self, weights: Iterator[tuple[str, torch.Tensor]], prefix: str
    ) -> None:
        """weights: the checkpoint's tensors named `{prefix}*` (the MTP layer's)."""
        own = {}
        layer = []
        for name, tensor in weights:
            rest = name.removeprefix(prefix)
            if rest.startswith(SHARED):
                continue
            if rest.startswith(OWN):
                own[rest] = tensor
            elif rest.startswith("shared_head.norm."):
                layer.append(
                    ("model.norm." + rest.removeprefix("shared_head.norm."), tensor)
                )
            else:
                layer.append(("model.layers.0." + rest, tensor))
        missing = [f"{prefix}{m}weight" for m in OWN if f"{m}weight" not in own]
        if missing:
            raise ValueError(f"the multi-token prediction layer lacks {missing}")
        params = dict(self.named_parameters())
        for rest, tensor in own.items():
            param = params.get(rest)
            if param is None or param.shape != tensor.shape:
                shape = tuple(tensor.shape)
                raise ValueError(
                    f"unexpected multi-token prediction weight {prefix}{rest} {shape}"
                )
            param.data.copy_(tensor)
        self.decoder.load_weights(layer)
