"""The DSpark drafter as `strata spec train` trains it: the layers, Markov and confidence heads
over the target's frozen embedding and head (`DSparkTrainModel`), the block objective
(`block_loss`, `block_metrics`), and what it borrows from the target (`target_tables`, `rope_for`).
The serving side of the same weights is `strata.models.dspark`; the phases that feed and run this
are `strata.drafting.train`."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from strata.models.dspark import MarkovHead

# ---------------------------------------------------------------------------- the model in training


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(
        x.dtype
    ) * weight


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms(x, self.weight, self.eps)


class TrainAttention(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = Norm(head_dim, eps)
        self.k_norm = Norm(head_dim, eps)


class TrainMLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TrainLayer(nn.Module):
    def __init__(self, raw: dict[str, Any]):
        super().__init__()
        hidden, eps = raw["hidden_size"], raw["rms_norm_eps"]
        self.self_attn = TrainAttention(
            hidden,
            raw["num_attention_heads"],
            raw["num_key_value_heads"],
            raw["head_dim"],
            eps,
        )
        self.mlp = TrainMLP(hidden, raw["intermediate_size"])
        self.input_layernorm = Norm(hidden, eps)
        self.post_attention_layernorm = Norm(hidden, eps)


class ConfidenceHead(nn.Module):
    """DeepSpec's AcceptRatePredictor: one logit per row (its weights are `proj`)."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)[..., 0]


class DSparkTrainModel(nn.Module):
    """The drafter under training, with DeepSpec's parameter names (its state dict is the
    checkpoint). The embedding and head are frozen copies of the target's."""

    def __init__(
        self, raw: dict[str, Any], embed: torch.Tensor, head: torch.Tensor, rope
    ):
        super().__init__()
        hidden, eps = raw["hidden_size"], raw["rms_norm_eps"]
        self.raw = raw
        self.block = raw["block_size"]
        self.mask = raw["mask_token_id"]
        self.embed_tokens = nn.Embedding.from_pretrained(embed.float(), freeze=True)
        self.lm_head = nn.Linear(hidden, raw["vocab_size"], bias=False)
        self.lm_head.weight = nn.Parameter(head.float(), requires_grad=False)
        self.layers = nn.ModuleList(
            TrainLayer(raw) for _ in range(raw["num_hidden_layers"])
        )
        self.norm = Norm(hidden, eps)
        self.fc = nn.Linear(len(raw["target_layer_ids"]) * hidden, hidden, bias=False)
        self.hidden_norm = Norm(hidden, eps)
        rank = raw["markov_rank"]
        self.markov_head = (
            MarkovHead(raw["markov_head_type"], raw["vocab_size"], rank, hidden)
            if rank
            else None
        )
        self.confidence_head: ConfidenceHead | None = None
        if raw["enable_confidence_head"]:
            width = hidden + (rank if raw["confidence_head_with_markov"] else 0)
            self.confidence_head = ConfidenceHead(width)
        self.rope = (
            rope  # strata.layers.rope.RotaryEmbedding (its torch reference path)
        )

    def init_weights(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not p.requires_grad:
                    continue
                if "norm" in name:
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            if self.markov_head is not None:
                self.markov_head.markov_w2.weight.zero_()  # starts as no bias at all

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """features [L, n * hidden] (the target's streams), tokens [L], anchors [A] (positions
        whose token is known and whose next one is to be drafted) -> logits [A, B, V], labels
        [A, B] (-100 past the sequence), confidence logits [A, B] (or None)."""
        L, B, A = tokens.shape[0], self.block, anchors.shape[0]
        c = self.hidden_norm(self.fc(features))
        ids = torch.full((A, B), self.mask, dtype=torch.int64)
        ids[:, 0] = tokens[anchors]
        x = self.embed_tokens(ids).view(A * B, -1)
        offsets = torch.arange(B)
        qpos = (anchors[:, None] + offsets).reshape(-1)
        kpos = torch.cat([torch.arange(L), qpos])
        owner = torch.arange(A).repeat_interleave(B)
        # a block's rows see the context before its anchor and their whole block
        mask = torch.cat(
            [
                torch.arange(L)[None, :] < anchors[owner][:, None],
                owner[:, None] == owner[None, :],
            ],
            dim=1,
        )
        for module in self.layers:
            layer = cast(TrainLayer, module)
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_norm(attn.q_proj(h).view(A * B, attn.heads, attn.head_dim))
            k = attn.k_norm(
                torch.cat([attn.k_proj(c), attn.k_proj(h)]).view(
                    -1, attn.kv_heads, attn.head_dim
                )
            )
            v = torch.cat([attn.v_proj(c), attn.v_proj(h)]).view(
                -1, attn.kv_heads, attn.head_dim
            )
            q = self.rope.reference(qpos, q, q)[0]
            k = self.rope.reference(kpos, k, k)[0]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                attn_mask=mask[None, None],
                enable_gqa=True,
            )
            x = x + attn.o_proj(out[0].transpose(0, 1).reshape(A * B, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = self.norm(x).view(A, B, -1)
        logits = self.lm_head(hidden)
        label_pos = anchors[:, None] + 1 + offsets
        labels = torch.where(
            label_pos < L,
            tokens[label_pos.clamp(max=L - 1)],
            torch.full_like(label_pos, -100),
        )
        # teacher forcing: row i's previous token is the true token before its label
        prev = torch.cat([tokens[anchors][:, None], labels[:, :-1].clamp(min=0)], dim=1)
        markov = self.markov_head
        if markov is not None:
            if markov.recurrent:  # the state runs along each block's rows
                state, latents = None, []
                for i in range(B):
                    z, state = markov.latent(prev[:, i], hidden[:, i], state)
                    latents.append(z)
                z = torch.stack(latents, dim=1)
            else:  # every row at once
                z = markov.latent(prev.reshape(-1), hidden.reshape(A * B, -1))[0].view(
                    A, B, -1
                )
            logits = logits + markov.markov_w2(z)
        conf = None
        if self.confidence_head is not None:
            f = hidden
            if markov is not None and self.raw["confidence_head_with_markov"]:
                f = torch.cat([f, markov.prev_embeddings(prev)], -1)
            conf = self.confidence_head(f)
        return {"logits": logits, "labels": labels, "confidence": conf}


def block_loss(
    out: dict[str, torch.Tensor], gamma: float, confidence_weight: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted cross-entropy (+ the confidence head's loss), and metrics: per-row accuracy and
    the blocks' greedy accept length."""
    logits, labels, conf = out["logits"], out["labels"], out["confidence"]
    A, B, V = logits.shape
    valid = labels >= 0
    weights = torch.exp(-torch.arange(B, dtype=torch.float32) / gamma)[None] * valid
    ce = F.cross_entropy(
        logits.reshape(-1, V).float(),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    ).view(A, B)
    total = weights.sum().clamp(min=1e-6)
    loss = (ce * weights).sum() / total
    hits = (logits.argmax(-1) == labels) & valid
    metrics = {"ce": float(loss.detach())}
    if conf is not None:
        bce = F.binary_cross_entropy_with_logits(
            conf.float(), hits.float(), reduction="none"
        )
        conf_loss = (bce * weights).sum() / total
        loss = loss + confidence_weight * conf_loss
        metrics["confidence_loss"] = float(conf_loss.detach())
    metrics.update(block_metrics(hits, valid))
    metrics["loss"] = float(loss.detach())
    return loss, metrics


def block_metrics(hits: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Accept length (1 + leading hits) over blocks with a first label, and the per-row accuracy."""
    lead = hits.int().cumprod(dim=1).sum(dim=1)
    has = valid[:, 0]
    out = {"accept_length": float((1 + lead[has]).float().mean()) if has.any() else 1.0}
    for i in range(hits.shape[1]):
        n = valid[:, i].sum()
        out[f"acc@{i}"] = float(hits[:, i].sum() / n) if n else 0.0
    return out


def target_tables(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's embedding and output head as float tables (dequantized where they are not)."""
    from strata.engine.dspark import output_rows

    ids = torch.arange(model.config.vocab_size)
    with torch.no_grad():  # not inference mode: the tables go into autograd (frozen)
        embed = model.embed_tokens(ids).float().clone()
        head = output_rows(model, ids).clone()
    return embed, head


def rope_for(raw: dict[str, Any]):
    from strata.layers.rope import RotaryEmbedding
    from strata.models import config_from_hf

    mc = config_from_hf({**raw, "architectures": ["Qwen3ForCausalLM"]})
    return RotaryEmbedding(
        mc.rope, mc.head_dim, mc.max_position_embeddings, mc.max_position_embeddings
    )
