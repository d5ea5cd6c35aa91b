"""Multi-head latent attention (MLA: DeepSeek-V2/V3) over the latent KV pool.

Each token caches ONE row per layer, shared by every head (`strata.cache.kv_pool.LatentKVPool`):

    x -> kv_a_proj_with_mqa -> [ c: kv_lora_rank | k_pe: qk_rope_head_dim ]
         cached row = [ kv_a_layernorm(c) | RoPE(k_pe) ]
    x -> q_proj (or q_a_proj -> q_a_layernorm -> q_b_proj) -> per head [ q_nope | q_pe ];  q_pe -> RoPE

kv_b_proj holds, per head h, W_uk[h]: c -> the key's nope part and W_uv[h]: c -> the value, so
head h attends with key_h(j) = [W_uk[h] c_j | k_pe_j] and value_h(j) = W_uv[h] c_j, i.e.

    q_h . key_h(j)        = (W_uk[h]^T q_nope) . c_j + q_pe . k_pe_j
    sum_j p_j value_h(j)  = W_uv[h] (sum_j p_j c_j)

Absorbed form (decodes; extends that feed few tokens per key): the query becomes
[W_uk[h]^T q_nope | q_pe] and attends over the cached rows themselves, as attention with one KV
head whose head dim is the row (`paged_attention`, with the native decode kernel on the CPU; the
row serves as the value too, and its first kv_lora_rank columns are kept); W_uv[h] then maps the
result into the head's value space. Nothing per head is ever materialised for the cached keys.

Decompressed form (prefills that feed many tokens): the rows an extend reads are expanded through
kv_b_proj into per-head keys and values and attended like MHA (head dims qk_nope + rope and
v_head_dim): fewer multiply-adds once a request feeds more than a few dozen tokens per key it
reads. Per step the form with fewer estimated multiply-adds is used (`MLAttention.prefill_form`
forces one); both equal transformers' attention, which always decompresses.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; taking the even entries then the
odd ones gives the halves layout `RotaryEmbedding` rotates. q_pe and k_pe are permuted alike, so
their dot products are unchanged (transformers' `apply_rotary_pos_emb_interleave` does the same).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.cache.kv_pool import LatentKVPool
from strata.layers.attention import (
    AttentionMetadata,
    paged_attention,
    segment_attention,
)
from strata.layers.norm import RMSNorm
from strata.layers.packed import NativePackable, grouped_dense, pack_groups
from strata.layers.rope import RotaryEmbedding
from strata.model_config import ModelConfig

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm keep their default, not rms_norm_eps
PREFILL_FORMS = ("auto", "absorbed", "decompressed")


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., 2n] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (RoPE's halves layout)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class KVUpProjection(NativePackable, nn.Module):
    """kv_b_proj: a latent c [kv_lora_rank] -> each head's key nope part [qk_nope_head_dim] and value
    [v_head_dim]; weight [H * (qk_nope + v_head_dim), kv_lora_rank], per head its key rows then its
    value rows (HF's layout). A plain parameter, not an nn.Linear: the absorbed form multiplies by
    its per-head blocks, so weight quantization leaves it as it is. On the CPU `pack` adds those
    blocks packed per head for the native dense kernel (W_uk transposed, W_uv as it is), so the
    absorbed products of a token never depend on the other rows of the step; `expand` (long
    prefills) keeps the plain weight."""

    uk_packed: torch.Tensor  # buffers `pack` registers
    uv_packed: torch.Tensor

    def __init__(
        self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, v_head_dim: int
    ):
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = (
            num_heads,
            qk_nope_head_dim,
            v_head_dim,
        )
        self.weight = nn.Parameter(
            torch.empty(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)
        )

    def pack_sources(self) -> list[torch.Tensor]:
        """What `pack` packs, as [H, N, K] stacks: W_uk^T (L rows over qk_nope) and W_uv (v rows over L)."""
        w_uk, w_uv = (w.detach() for w in self._blocks())
        return [w_uk.transpose(1, 2), w_uv]

    def pack(self, target: str) -> None:
        uk, uv = self.pack_sources()
        self.register_buffer("uk_packed", pack_groups(uk), persistent=False)
        self.register_buffer("uv_packed", pack_groups(uv), persistent=False)
        self.packed_target = target

    def _blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, qk_nope, L], W_uv [H, v_head_dim, L]), views of the weight."""
        w = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def absorb_query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, qk_nope] -> [T, H, L]: each head's query nope part as a query over latents."""
        if self.packed_target is not None and q_nope.is_cpu:
            return grouped_dense(
                q_nope, self.uk_packed, self.weight.shape[1], self.packed_target
            )
        w_uk, _ = self._blocks()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def values(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, L] (attention-weighted latents) -> [T, H, v_head_dim]."""
        if self.packed_target is not None and out_latent.is_cpu:
            return grouped_dense(
                out_latent, self.uv_packed, self.v_dim, self.packed_target
            )
        _, w_uv = self._blocks()
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(
            0, 1
        )

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., L] -> (key nope parts [..., H, qk_nope], values [..., H, v_head_dim])."""
        kv = F.linear(latents, self.weight).unflatten(
            -1, (self.num_heads, self.nope_dim + self.v_dim)
        )
        return kv.split([self.nope_dim, self.v_dim], dim=-1)


class MLAttention(nn.Module):
    """One layer's latent attention; weights under HF's names (q_proj or q_a_proj/q_a_layernorm/
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        mla = cfg.mla
        if mla is None:
            raise ValueError(f"{cfg.architecture} has no MLA configuration")
        self.mla, self.layer_id, self.num_heads = mla, layer_id, cfg.num_heads
        self.scale = cfg.layers[layer_id].scale
        self.prefill_form = (
            "auto"  # one of PREFILL_FORMS: how extends attend (decodes always absorbed)
        )
        H, L, R = cfg.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
        q_size = H * mla.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(
                cfg.hidden_size, mla.q_lora_rank, bias=cfg.attention_bias
            )
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            cfg.hidden_size, L + R, bias=cfg.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(L, LATENT_NORM_EPS)
        self.kv_b_proj = KVUpProjection(H, L, mla.qk_nope_head_dim, mla.v_head_dim)
        self.o_proj = nn.Linear(
            H * mla.v_head_dim, cfg.hidden_size, bias=cfg.o_proj_bias
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv: LatentKVPool,
    ) -> torch.Tensor:
        mla, T, H = self.mla, x.shape[0], self.num_heads
        L, R = mla.kv_lora_rank, mla.qk_rope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, mla.qk_head_dim).split(
            [mla.qk_nope_head_dim, R], dim=-1
        )
        c, k_pe = self.kv_a_proj_with_mqa(x).split([L, R], dim=-1)
        if mla.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = rope(positions, q_pe, k_pe.reshape(T, 1, R))
        latent = torch.cat([self.kv_a_layernorm(c), k_pe.view(T, R)], dim=-1).unsqueeze(
            1
        )  # [T, 1, L + R]
        cache = kv.latent[self.layer_id]  # [slots, 1, L + R]

        nd = meta.num_decode
        decompress = nd < T and self._decompress_extends(meta)
        rows = nd if decompress else T  # the tokens attending in latent space
        q_absorbed = self.kv_b_proj.absorb_query(q_nope[:rows])  # [rows, H, L]
        q_latent = torch.cat([q_absorbed, q_pe[:rows]], dim=-1)  # [rows, H, L + R]
        # stores every new row; keys are whole rows, values the rows too, of which [:L] is kept
        out = paged_attention(q_latent, latent, latent, cache, cache, meta, self.scale)[
            ..., :L
        ]
        out = self.kv_b_proj.values(out)  # [rows, H, v_head_dim]
        if decompress:
            out = torch.cat(
                [out, self._decompressed_extends(q_nope[nd:], q_pe[nd:], cache, meta)]
            )
        return self.o_proj(out.reshape(T, H * mla.v_head_dim))

    def _decompress_extends(self, meta: AttentionMetadata) -> bool:
        """Whether this step's extends attend decompressed: forced by `prefill_form`, else when that
        costs fewer multiply-adds (per head; q, k: each extend's new tokens and keys)."""
        if self.prefill_form != "auto":
            return self.prefill_form == "decompressed"
        mla = self.mla
        q, k = (
            meta.q_len[meta.num_decode :].double(),
            meta.kv_len[meta.num_decode :].double(),
        )
        pairs = float(
            (q * k).sum()
        )  # (query, key) pairs, causal mask ignored (it cuts both alike)
        up = mla.kv_lora_rank * (
            mla.qk_nope_head_dim + mla.v_head_dim
        )  # one row through kv_b_proj
        # absorbed: each query absorbed and its output up-projected; scores and sums over whole rows
        absorbed = float(q.sum()) * up + pairs * 2 * mla.latent_dim
        # decompressed: each key's row up-projected; scores over qk_head_dim, sums over v_head_dim
        decompressed = float(k.sum()) * up + pairs * (mla.qk_head_dim + mla.v_head_dim)
        return decompressed < absorbed

    def _decompressed_extends(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The extends' queries [Te, H, *] over their keys' rows expanded per head -> [Te, H, v_head_dim]."""
        L = self.mla.kv_lora_rank
        seg = meta.extend_segment(meta.view(None))
        rows = cache[seg.kv_slots].squeeze(2).to(q_nope.dtype)  # [B, max_kv, L + R]
        k_nope, values = self.kv_b_proj.expand(
            rows[..., :L]
        )  # [B, max_kv, H, qk_nope], [.., v_head_dim]
        k_pe = rows[..., None, L:].expand(
            -1, -1, self.num_heads, -1
        )  # one rope key for every head
        keys = torch.cat([k_nope, k_pe], dim=-1)  # [B, max_kv, H, qk_head_dim]
        q = torch.cat([q_nope, q_pe], dim=-1)
        return segment_attention(
            q, keys.transpose(1, 2), values.transpose(1, 2), seg, self.scale
        )
