"""The batched paged attention against the per-request reference loop."""

from __future__ import annotations

import contextlib
import itertools
import random
import re

import pytest
import torch

from strata import kernels
from strata.layers.attention import (
    AttentionMetadata,
    paged_attention,
    reference_attention,
)

# decodes (q_len 1) first, then extends with and without a cached prefix; `long` adds a request of
# many tiles and query blocks
BATCHES = {
    "mixed": ([9, 40, 1, 7, 20, 5, 64], [1, 1, 1, 7, 12, 5, 30], 3),
    "mixed-long": ([9, 40, 1, 7, 20, 5, 64, 300], [1, 1, 1, 7, 12, 5, 30, 45], 3),
    "decode-only": ([9, 40, 1, 300, 33], [1, 1, 1, 1, 1], 5),
    "extend-only": ([7, 20, 300, 64], [7, 12, 45, 64], 0),
}
# window 5 cuts every longer request, and its edge falls inside chunks: (kv 20, q 12) has 8 cached
# keys, all before its last query's window, and the chunk spans the edge; window 4096 covers all
FEATURES = {
    "window": {"window": 5},
    "window-past-the-end": {"window": 4096},
    "softcap": {"softcap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window": 5, "softcap": 1.5, "sinks": True},
}


def backend(name: str):
    return kernels.disabled() if name == "pytorch" else contextlib.nullcontext()


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "shape", [(4, 4), (8, 2), (6, 1)], ids=lambda s: f"H{s[0]}-Hkv{s[1]}"
)
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("batch", ["mixed", "mixed-long"])
@pytest.mark.parametrize("backend_name", ["kernels", "pytorch"])
def test_matches_reference(dtype, atol, shape, page_size, batch, backend_name):
    with backend(backend_name):
        check_against_reference(
            dtype, atol, shape, page_size, BATCHES[batch], head_dim=16
        )


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(8, 2), (6, 1)], ids=lambda s: f"H{s[0]}-Hkv{s[1]}")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch", ["mixed-long", "decode-only", "extend-only"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("backend_name", ["kernels", "pytorch"])
def test_window_sinks_softcap_match_reference(
    dtype, atol, shape, page_size, batch, feature, backend_name
):
    with backend(backend_name):
        check_against_reference(
            dtype,
            atol,
            shape,
            page_size,
            BATCHES[batch],
            head_dim=16,
            **FEATURES[feature],
        )


@pytest.mark.parametrize("batch", ["mixed", "mixed-long"])
@pytest.mark.parametrize("feature", [None, "all"])
def test_head_dim_the_kernels_do_not_vectorise(batch, feature):
    options = FEATURES.get(feature, {})
    check_against_reference(
        torch.float32, 1e-5, (4, 2), 1, BATCHES[batch], head_dim=24, **options
    )


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("shape", [(9, 3), (8, 1)], ids=lambda s: f"H{s[0]}-Hkv{s[1]}")
@pytest.mark.parametrize("batch", ["mixed-long", "extend-only"])
@pytest.mark.parametrize("feature", [None, "all"])
def test_bf16_head_dims_of_the_dot_product_paths(
    extend_path, head_dim, shape, batch, feature
):
    """bf16 with head_dim a multiple of 32: with AVX512-BF16 the decode and extend kernels multiply
    by the bf16 dot-product instruction (one, two, three and four 32-dimension chunks here), and with
    AMX extends may take the bf16 tiles instead."""
    check_against_reference(
        torch.bfloat16,
        2e-2,
        shape,
        16,
        BATCHES[batch],
        head_dim=head_dim,
        **FEATURES.get(feature, {}),
    )


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("bad_page", [-1, 10**9], ids=["minus-one", "out-of-range"])
@pytest.mark.parametrize("backend_name", ["kernels", "pytorch"])
def test_pages_before_the_window_are_never_read(page_size, bad_page, backend_name):
    """Sliding layers will free the pages behind their window: those page-table entries may be anything."""
    with backend(backend_name):
        check_against_reference(
            torch.float32,
            1e-5,
            (8, 2),
            page_size,
            BATCHES["mixed-long"],
            head_dim=16,
            window=20,
            sinks=True,
            pages_behind_window=bad_page,
        )


def check_against_reference(
    dtype,
    atol,
    shape,
    page_size,
    batch,
    head_dim,
    window=None,
    softcap=None,
    sinks=False,
    pages_behind_window=None,
):
    rng = random.Random(0)
    torch.manual_seed(0)
    kv_lens, q_lens, num_decode = batch
    num_heads, num_kv_heads, num_slots = shape[0], shape[1], 1024
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, dtype=dtype)
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
        (torch.tensor(pages).view(-1, 1) * page_size + torch.arange(page_size)).view(
            -1
        )[:n]
        for pages, n in zip(page_lists, kv_lens)
    ]
    if pages_behind_window is not None:
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            key_start = max(
                0, kv_len - q_len - window + 1
            )  # the earliest query's first key
            page_table[b, : key_start // page_size] = pages_behind_window
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, dtype=dtype)
    k_new = torch.randn(total, num_kv_heads, head_dim, dtype=dtype)
    v_new = torch.randn(total, num_kv_heads, head_dim, dtype=dtype)
    sink_logits = torch.randn(num_heads) * 2 if sinks else None
    features = {"window": window, "softcap": softcap, "sinks": sink_logits}
    meta = AttentionMetadata.build(
        q_lens, kv_lens, page_table, page_size, num_decode, torch.device("cpu")
    )
    assert meta.positions.tolist() == [
        p for q, k in zip(q_lens, kv_lens) for p in range(k - q, k)
    ]
    assert meta.out_slots.tolist() == [
        x for s, q in zip(slot_lists, q_lens) for x in s[-q:].tolist()
    ]
    out = paged_attention(
        q, k_new, v_new, k_cache, v_cache, meta, scale=head_dim**-0.5, **features
    )
    ref = reference_attention(
        q, k_cache, v_cache, q_lens, slot_lists, scale=head_dim**-0.5, **features
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=0)


def test_features_change_the_output():
    """The oracle comparisons above would pass if both sides ignored a feature; they do not."""
    q_lens = [1, 30]  # a decode with 40 keys, a fresh 30-token prompt
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(70, 2, 16), torch.randn(70, 2, 16)
    q = torch.randn(31, 4, 16) * 4
    slots = [torch.arange(40), torch.arange(30) + 40]
    plain = reference_attention(q, k_cache, v_cache, q_lens, slots, 0.25)
    for feature in ({"window": 8}, {"softcap": 0.5}, {"sinks": torch.full((4,), 3.0)}):
        changed = reference_attention(
            q, k_cache, v_cache, q_lens, slots, 0.25, **feature
        )
        assert not torch.allclose(changed, plain, atol=1e-3), feature
    # the first 8 queries of the chunk sit inside any 8-key window: only the later ones change
    windowed = reference_attention(q, k_cache, v_cache, q_lens, slots, 0.25, window=8)
    torch.testing.assert_close(windowed[1:9], plain[1:9])


def test_one_view_per_window_size_per_step():
    """Sliding and full layers share one metadata; each window size builds its masks once per step."""
    table = torch.arange(400).view(4, 100)
    with kernels.disabled():
        meta = AttentionMetadata.build(
            [1, 1, 30, 20], [50, 90, 30, 100], table, 1, 2, torch.device("cpu")
        )
        q, kv = torch.randn(52, 4, 16), torch.randn(52, 2, 16)
        caches = torch.zeros(400, 2, 16), torch.zeros(400, 2, 16)
        for _layer in range(3):
            for window in (None, 16):
                paged_attention(q, kv, kv, *caches, meta, 0.25, window=window)
        assert meta.view(16) is not meta.view(None)
        assert meta.view(100) is meta.view(
            None
        )  # a window as long as every request is no window
        alone = meta.view(16).extend_alone  # the torch path takes each extend by itself
        assert set(alone) == {0, 1} and alone[1].kv_slots.shape[1] == 20 + 16 - 1
        assert (alone[0].token_start, alone[0].num_tokens, alone[1].token_start) == (
            2,
            30,
            32,
        )


def test_single_fresh_prefill_takes_the_causal_path():
    table = torch.arange(400).view(1, -1)
    meta = AttentionMetadata.build([10], [10], table, 1, 0, torch.device("cpu"))
    assert meta.extend_segment(meta.view(None)).causal
    assert not meta.extend_segment(meta.view(4)).causal
    meta = AttentionMetadata.build([10], [14], table, 1, 0, torch.device("cpu"))
    assert not meta.extend_segment(meta.view(None)).causal


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"window": 0}, "attention window is 0 tokens; it must be at least 1"),
        (
            {"sinks": torch.zeros(3)},
            "sinks has shape (3,); it must hold one logit per query head (4)",
        ),
        ({"softcap": 0.0}, "softcap is 0.0; it must be positive"),
    ],
)
def test_bad_layer_settings_are_refused(kwargs, message):
    table = torch.arange(64).view(1, -1)
    meta = AttentionMetadata.build([2], [2], table, 1, 0, torch.device("cpu"))
    q, kv = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention(
            q,
            kv,
            kv,
            torch.zeros(64, 2, 16),
            torch.zeros(64, 2, 16),
            meta,
            0.25,
            **kwargs,
        )


@pytest.mark.parametrize("native", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_attends_the_same_whatever_shares_its_step(
    extend_path, native, window, dtype
):
    """A request's prefill attention is computed by its own path and shapes (the kernel, or SDPA one
    request at a time), so its output bits are the same alone and beside any other prefills: short,
    long, with a cached prefix or without (bf16 with head_dim 32: the kernel's bf16 paths)."""
    if not native and extend_path == "tiles":
        pytest.skip("the torch path has no tiles")
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim = 4, 2, 16 if dtype == torch.float32 else 32
    # (new tokens, tokens in KV after the step): a short one, a long one, a long chunk after a prefix
    requests = {
        "short": (40, 40),
        "long": (300, 300),
        "chunk": (200, 500),
        "other": (700, 700),
        "mid": (100, 120),
    }
    pages = {
        name: torch.arange(i * 1000, i * 1000 + 1000) for i, name in enumerate(requests)
    }
    tensors = {
        name: [
            torch.randn(q, h, dim, generator=gen).to(dtype)
            for h in (heads, kv_heads, kv_heads)
        ]
        for name, (q, _) in requests.items()
    }
    cache = (
        torch.randn(5000, kv_heads, dim, generator=gen).to(dtype),
        torch.randn(5000, kv_heads, dim, generator=gen).to(dtype),
    )

    def step(names: list[str]) -> dict[str, torch.Tensor]:
        k_cache, v_cache = (
            cache[0].clone(),
            cache[1].clone(),
        )  # cached prefixes as they were
        meta = AttentionMetadata.build(
            [requests[n][0] for n in names],
            [requests[n][1] for n in names],
            torch.stack([pages[n] for n in names]),
            1,
            0,
            torch.device("cpu"),
        )
        q, k, v = (torch.cat([tensors[n][i] for n in names]) for i in range(3))
        with contextlib.nullcontext() if native else kernels.disabled():
            out = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, window=window)
        return dict(zip(names, out.split([requests[n][0] for n in names])))

    alone = {name: step([name])[name] for name in ("short", "long", "chunk", "mid")}
    for names in (
        ["short", "long"],
        ["long", "short", "chunk"],
        ["other", "chunk", "short", "long"],
        ["mid", "short"],
        ["short", "other", "mid"],
    ):
        for name, out in step(names).items():
            if name in alone:
                assert torch.equal(out, alone[name]), (names, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape", [(9, 3), (4, 4), (8, 1)], ids=lambda s: f"H{s[0]}-Hkv{s[1]}"
)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("feature", [None, "window", "all"])
def test_a_prefill_attends_the_same_however_its_prompt_is_chunked(
    extend_path, dtype, shape, page_size, feature
):
    """The extend kernel computes a query row the same whichever rows share its work item and
    wherever its chunk starts: a prompt prefilled at once, in chunks of any size, or after a cached
    prefix (a radix hit) gives the same bits for every token."""
    ops = kernels.usable(torch.zeros(1))
    if ops is None or not ops.has_simd():
        pytest.skip("the extend kernel needs AVX2 or AVX-512")
    options = {
        "window": {"window": 37},
        "all": {"window": 37, "softcap": 1.5, "sinks": True},
    }.get(feature, {})
    heads, kv_heads, dim, n = *shape, 64, 300
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(n, h, dim, generator=gen).to(dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    sinks = torch.randn(heads, generator=gen) if options.pop("sinks", False) else None
    table = torch.arange(n // page_size + 1).view(1, -1)

    def chunk(a: int, b: int) -> torch.Tensor:
        k_cache, v_cache = (
            torch.zeros(n + page_size, kv_heads, dim, dtype=dtype) for _ in range(2)
        )
        k_cache[:a], v_cache[:a] = (
            k[:a],
            v[:a],
        )  # the cached prefix (pages are slots in order)
        meta = AttentionMetadata.build(
            [b - a], [b], table, page_size, 0, torch.device("cpu")
        )
        return paged_attention(
            q[a:b],
            k[a:b],
            v[a:b],
            k_cache,
            v_cache,
            meta,
            dim**-0.5,
            sinks=sinks,
            **options,
        )

    whole = chunk(0, n)
    ref = reference_attention(
        q, k, v, [n], [torch.arange(n)], dim**-0.5, sinks=sinks, **options
    )
    torch.testing.assert_close(
        whole.float(),
        ref.float(),
        atol=1e-5 if dtype == torch.float32 else 2e-2,
        rtol=0,
    )
    for cuts in (
        [0, 1, 300],
        [0, 100, 200, 300],
        [0, 17, 50, 51, 129, 300],
        [0, 299, 300],
        [0, 64, 300],
    ):
        for a, b in itertools.pairwise(cuts):
            assert torch.equal(chunk(a, b), whole[a:b]), (cuts, a, b)
