"""Paged attention over the KV pool, batched over requests without a Python loop per request.

A forward batch is laid out decode-first:

    tokens: [ d0 d1 ... d(B_d-1) | e0 e0 e0 e1 e1 ... ]      (flattened, T tokens)
             one token per decode   a chunk of q_len tokens per extend (prefill) request

Each request's keys live in pages at arbitrary places in the pool; `page_table[b, i]` is the page
of positions [i * page_size, (i + 1) * page_size), so key j is at slot
page_table[b, j // page_size] * page_size + j % page_size. The new tokens' K/V are written to `out_slots` first, so a request's
query i (absolute position kv_len - q_len + i) attends to keys 0 .. kv_len - q_len + i.

`AttentionMetadata.build` precomputes the gathers and masks once per step; every layer reuses them.
On the CPU the native kernels (strata.kernels) store the new K/V and run decode attention straight
from the pool, one pass per (token, KV head) with an online softmax: no gather, no padding. Extend
(prefill) segments whose requests all have at most EXTEND_KERNEL_MAX_KV keys use the kernels' flash
-style extend attention (2-3x faster than masked SDPA for many short prompts); longer ones use
SDPA, whose blocked matrix multiplies win there (measured on AVX-512, SmolLM2 shapes).
`reference_attention` is the per-request loop kept as the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from strata.kernels import cpu_ops, token_rows, usable


@dataclass
class SegmentMeta:
    """Padded view of one group of requests (all decodes, or all extends)."""

    token_start: int  # first flattened token of this segment
    num_tokens: int
    kv_slots: torch.Tensor  # [B, max_kv] int64
    mask: torch.Tensor  # [B, 1, max_q, max_kv] bool, True = attend
    pad_index: torch.Tensor | None  # [num_tokens] -> row in the [B * max_q] padded query; None when max_q == 1
    max_q: int
    causal: bool = False  # a single request with nothing cached: plain causal attention


EXTEND_KERNEL_MAX_KV = 256


@dataclass
class ExtendKernelArgs:
    """The extend segment as the native kernel takes it; `segment()` builds the SDPA view instead
    (for head dims the kernel does not cover)."""

    token_start: int
    q_start: torch.Tensor  # [B] first flattened token of each request
    q_len: torch.Tensor  # [B]
    kv_len: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, max_pages]

    def segment(self, page_size: int, device: torch.device) -> SegmentMeta:
        return _segment(self.token_start, self.q_len, self.kv_len, self.page_table, page_size, device)


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T] absolute position of each new token
    out_slots: torch.Tensor  # [T] slot that each new token's K/V is written to
    decode: SegmentMeta | None
    extend: SegmentMeta | None
    # for the native decode kernel (set when it is used; then `decode` is None)
    num_decode: int = 0
    page_table: torch.Tensor | None = None  # [B, max_pages] int64
    owner: torch.Tensor | None = None  # [num_decode] request row of each decode token
    page_size: int = 1
    extend_kernel: ExtendKernelArgs | None = None  # set instead of `extend` when the kernel runs it

    @classmethod
    def build(
        cls,
        q_lens: list[int],
        kv_lens: list[int],
        page_table: torch.Tensor,
        page_size: int,
        num_decode: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Per request (decodes, q_len 1, first): tokens fed, tokens in KV after this step, and
        `page_table[b, i]` = the page holding positions [i * page_size, (i + 1) * page_size)."""
        q = torch.tensor(q_lens)
        kv = torch.tensor(kv_lens)
        # token t of request b sits at position kv_len[b] - q_len[b] + (t - first token of b)
        owner = torch.repeat_interleave(torch.arange(len(q_lens)), q)
        first = torch.cumsum(q, 0) - q
        positions = torch.arange(int(q.sum())) - first[owner] + (kv - q)[owner]
        out_slots = page_table[owner, positions // page_size] * page_size + positions % page_size
        decode = extend = extend_kernel = None
        ops = cpu_ops() if device.type == "cpu" else None
        if num_decode and not ops:
            decode = _segment(0, q[:num_decode], kv[:num_decode], page_table[:num_decode], page_size, device)
        if num_decode < len(q_lens):
            eq, ekv, ept = q[num_decode:], kv[num_decode:], page_table[num_decode:]
            if ops and int(ekv.max()) <= EXTEND_KERNEL_MAX_KV and ops.has_simd():
                q_start = torch.cumsum(eq, 0) - eq + num_decode
                extend_kernel = ExtendKernelArgs(num_decode, q_start, eq, ekv, ept.contiguous())
            else:
                extend = _segment(num_decode, eq, ekv, ept, page_size, device)
        meta = cls(positions=positions.to(device), out_slots=out_slots.to(device), decode=decode, extend=extend)
        meta.extend_kernel = extend_kernel
        meta.page_size = page_size
        if num_decode and ops:
            meta.num_decode = num_decode
            meta.page_table = page_table[:num_decode].contiguous()
            meta.owner = owner[:num_decode].contiguous()
        return meta


def _segment(
    token_start: int, q_len: torch.Tensor, kv_len: torch.Tensor, page_table: torch.Tensor, page_size: int,
    device: torch.device,
) -> SegmentMeta:
    batch = len(q_len)
    max_q, max_kv = int(q_len.max()), int(kv_len.max())
    kj = torch.arange(max_kv)
    # slot of key j of request b; past kv_len it points at some valid slot and is masked out
    kv_slots = page_table[:, kj // page_size] * page_size + kj % page_size
    qi = torch.arange(max_q).view(1, max_q, 1)
    # query i of request b sits at absolute position kv_len - q_len + i and sees keys up to it
    query_pos = (kv_len - q_len).view(batch, 1, 1) + qi
    real_query = qi < q_len.view(batch, 1, 1)
    mask = (kj.view(1, 1, max_kv) <= query_pos) & real_query
    mask[:, :, 0] |= ~real_query[..., 0]  # padded query rows see key 0: no NaN rows
    pad_index = None
    if max_q > 1:
        pad_index = torch.nonzero(real_query.view(-1), as_tuple=True)[0].to(device)
    return SegmentMeta(
        token_start=token_start,
        num_tokens=int(q_len.sum()),
        kv_slots=kv_slots.to(device),
        mask=mask.unsqueeze(1).to(device),
        pad_index=pad_index,
        max_q=max_q,
        causal=batch == 1 and max_q > 1 and int(q_len[0]) == int(kv_len[0]),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] (new tokens); caches: [num_slots, Hkv, D]. Returns [T, H, D]."""
    ops = usable(q)
    if ops and token_rows(k) and token_rows(v) and k_cache.is_contiguous() and v_cache.is_contiguous():
        ops.store_kv(k, v, k_cache, v_cache, meta.out_slots)
    else:
        k_cache[meta.out_slots] = k.to(k_cache.dtype)
        v_cache[meta.out_slots] = v.to(v_cache.dtype)
    out = q.new_empty(q.shape)
    if meta.page_table is not None:  # decode tokens through the native kernel
        nd = meta.num_decode
        ops.paged_attention(
            out[:nd], q[:nd], k_cache, v_cache, meta.page_table, meta.owner, meta.positions[:nd], meta.page_size, scale
        )
    ek = meta.extend_kernel
    if ek is not None:
        if q.shape[2] % 16 == 0:
            ops.extend_attention(
                out, q, k_cache, v_cache, ek.page_table, ek.q_start, ek.q_len, ek.kv_len, meta.page_size, scale
            )
        elif meta.extend is None:
            meta.extend = ek.segment(meta.page_size, q.device)  # once per step, shared by the layers
    for seg in (meta.decode, meta.extend):
        if seg is None:
            continue
        end = seg.token_start + seg.num_tokens
        out[seg.token_start : end] = _segment_attention(q[seg.token_start : end], k_cache, v_cache, seg, scale)
    return out


def _segment_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg: SegmentMeta, scale: float
) -> torch.Tensor:
    batch, max_kv = seg.kv_slots.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    keys = k_cache[seg.kv_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, max_kv, D]
    values = v_cache[seg.kv_slots].to(q.dtype).transpose(1, 2)
    if seg.pad_index is None:
        return _decode_attention(q, keys, values, seg.mask, scale)
    if seg.causal:
        # one request, no cached prefix: plain causal attention, no mask to read
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0).transpose(1, 2), keys, values, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(-1, num_heads, head_dim)
    q_pad = q.new_zeros(batch * seg.max_q, num_heads, head_dim)
    q_pad[seg.pad_index] = q
    q_pad = q_pad.view(batch, seg.max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2), keys, values, attn_mask=seg.mask, scale=scale, enable_gqa=True
    )  # [B, H, max_q, D]
    return out.transpose(1, 2).reshape(batch * seg.max_q, num_heads, head_dim)[seg.pad_index]


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per request: two batched matmuls (much faster than masked SDPA on CPU for q_len 1).

    q: [B, H, D]; keys/values: [B, Hkv, max_kv, D]; mask: [B, 1, 1, max_kv]. Query heads are grouped
    by their KV head (head h uses KV head h // (H / Hkv)), so q views as [B, Hkv, group, D].
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, group, max_kv]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, num_heads, head_dim)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_lens: list[int],
    kv_slot_lists: list[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Per-request loop in float32: the oracle for `paged_attention` (caches already hold the new K/V)."""
    outs, start = [], 0
    for q_len, slots in zip(q_lens, kv_slot_lists):
        kv_len = slots.numel()
        qr = q[start : start + q_len].float().transpose(0, 1)  # [H, q_len, D]
        kr = k_cache[slots].float().transpose(0, 1)  # [Hkv, kv_len, D]
        vr = v_cache[slots].float().transpose(0, 1)
        groups = qr.shape[0] // kr.shape[0]
        kr, vr = kr.repeat_interleave(groups, 0), vr.repeat_interleave(groups, 0)
        scores = (qr @ kr.transpose(1, 2)) * scale
        pos = torch.arange(kv_len - q_len, kv_len).view(-1, 1)
        scores = scores.masked_fill(torch.arange(kv_len).view(1, -1) > pos, float("-inf"))
        outs.append((scores.softmax(-1) @ vr).transpose(0, 1))
        start += q_len
    return torch.cat(outs).to(q.dtype)
