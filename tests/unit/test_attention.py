"""The batched paged attention against the per-request reference loop."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from strata.layers.attention import AttentionMetadata, paged_attention, reference_attention


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(4, 4), (8, 2), (6, 1)], ids=lambda s: f"H{s[0]}-Hkv{s[1]}")
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("long_context", [False, True], ids=["short", "long"])  # long: SDPA for extends
@pytest.mark.parametrize("backend", ["kernels", "pytorch"])
def test_matches_reference(dtype, atol, shape, page_size, long_context, backend):
    from strata import kernels

    with kernels.disabled() if backend == "pytorch" else contextlib.nullcontext():
        check_against_reference(dtype, atol, shape, page_size, long_context, head_dim=16)


@pytest.mark.parametrize("long_context", [False, True], ids=["short", "long"])
def test_head_dim_the_kernels_do_not_vectorise(long_context):
    check_against_reference(torch.float32, 1e-5, (4, 2), 1, long_context, head_dim=24)


def check_against_reference(dtype, atol, shape, page_size, long_context, head_dim):
    rng = random.Random(0)
    torch.manual_seed(0)
    num_heads, num_kv_heads, num_slots = shape[0], shape[1], 1024
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    # decodes first (q_len 1), then extends with and without a cached prefix
    kv_lens = [9, 40, 1, 7, 20, 5, 64] + ([300] if long_context else [])
    q_lens = [1, 1, 1, 7, 12, 5, 30] + ([45] if long_context else [])
    perm = list(range(num_slots // page_size))
    rng.shuffle(perm)
    page_lists, start = [], 0
    for n in kv_lens:
        num_pages = -(-n // page_size)
        page_lists.append(perm[start : start + num_pages])
        start += num_pages
    page_table = torch.zeros(len(kv_lens), max(map(len, page_lists)), dtype=torch.int64)
    for b, pages in enumerate(page_lists):
        page_table[b, : len(pages)] = torch.tensor(pages)
    slot_lists = [
        (torch.tensor(pages).view(-1, 1) * page_size + torch.arange(page_size)).view(-1)[:n]
        for pages, n in zip(page_lists, kv_lens)
    ]
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, dtype=dtype)
    k_new = torch.randn(total, num_kv_heads, head_dim, dtype=dtype)
    v_new = torch.randn(total, num_kv_heads, head_dim, dtype=dtype)
    meta = AttentionMetadata.build(q_lens, kv_lens, page_table, page_size, num_decode=3, device=torch.device("cpu"))
    assert meta.positions.tolist() == [p for q, k in zip(q_lens, kv_lens) for p in range(k - q, k)]
    assert meta.out_slots.tolist() == [x for s, q in zip(slot_lists, q_lens) for x in s[-q:].tolist()]
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale=head_dim**-0.5)
    ref = reference_attention(q, k_cache, v_cache, q_lens, slot_lists, scale=head_dim**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_single_fresh_prefill_takes_the_causal_path():
    from strata import kernels

    table = torch.arange(400).view(1, -1)
    with kernels.disabled():
        meta = AttentionMetadata.build([10], [10], table, 1, 0, torch.device("cpu"))
        assert meta.extend.causal
        meta = AttentionMetadata.build([10], [14], table, 1, 0, torch.device("cpu"))
        assert not meta.extend.causal
    # with the kernels, short extends go to the extend kernel and long ones to (causal) SDPA
    meta = AttentionMetadata.build([400], [400], table, 1, 0, torch.device("cpu"))
    assert meta.extend.causal and meta.extend_kernel is None
