"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral (full attention), Qwen2 (qkv bias), Qwen3 (q/k norm).

Weights load from HF names; q/k/v and gate/up are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from strata.cache.kv_pool import MHAKVPool
from strata.config import ModelConfig
from strata.kernels import usable
from strata.layers.attention import AttentionMetadata, paged_attention
from strata.layers.norm import RMSNorm
from strata.layers.rope import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv: MHAKVPool,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = paged_attention(q, k, v, kv.k[self.layer_id], kv.v[self.layer_id], meta, self.scale)
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported for {cfg.architecture}; only silu")
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = usable(gate_up)
        if ops and gate_up.is_contiguous():
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rope, meta, kv):
        """Returns (mlp output, residual stream); the caller adds them (fused into the next norm)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, meta, kv)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, rope_device: torch.device | str = "cpu"):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # a plain object, not a submodule: its fp32 tables survive dtype casts and meta-device construction
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions, cfg.max_position_embeddings, rope_device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: MHAKVPool
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rope, meta, kv)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] rows to sample -> float32 logits [S, vocab]."""
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # a module: may be a quantized copy of tied embeddings

    # HF checkpoint name fragment -> (our parameter fragment, index of the shard inside the fused weight)
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def checkpoint_parts(self, module: str) -> list[str]:
        """The checkpoint tensors one of our linear/embedding weights is made of, in row order
        (`layers.0.self_attn.qkv_proj` -> the layer's q_proj, k_proj, v_proj weights)."""
        parent, _, leaf = module.rpartition(".")
        frags = sorted((shard, frag) for frag, (fused, shard) in self.FUSED.items() if fused == leaf)
        prefix = "" if module == "lm_head" else "model."
        names = [f"{parent}.{frag}" for _, frag in frags] if frags else [module]
        return [f"{prefix}{name}.weight" for name in names]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], absent: frozenset[str] = frozenset()) -> None:
        """Copy checkpoint tensors into our parameters; `absent`: parameters the caller fills otherwise."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy
            for frag, (fused, shard) in self.FUSED.items():
                if f".{frag}." in name:
                    name = name.replace(frag, fused)
                    self._load_shard(params[name], tensor, fused, shard)
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} for {self.config.architecture}")
                if params[name].shape != tensor.shape:
                    raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
                params[name].data.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded - absent
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")

    def _load_shard(self, param: nn.Parameter, tensor: torch.Tensor, fused: str, shard: int) -> None:
        cfg = self.config
        if fused == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            offset, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:
            offset, size = shard * cfg.intermediate_size, cfg.intermediate_size
        if tensor.shape[0] != size:
            raise ValueError(f"{fused} shard {shard} has {tensor.shape[0]} rows, expected {size}")
        param.data[offset : offset + size].copy_(tensor)
