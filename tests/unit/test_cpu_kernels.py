"""The native CPU kernels against their PyTorch versions and the float32 attention oracle."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from strata import kernels
from strata.layers.attention import reference_attention
from strata.layers.norm import RMSNorm
from strata.layers.packed import (
    DenseLinear,
    PackedLinear,
    grouped_dense,
    pack_dense,
    pack_groups,
    pack_linears,
    unpack_dense,
)
from strata.layers.rope import RotaryEmbedding
from strata.model_config import RopeConfig

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_pages(
    num_slots: int, batch: int, max_len: int, page_size: int, gen: torch.Generator
) -> torch.Tensor:
    pages_per_req = -(-max_len // page_size)
    return torch.randperm(num_slots // page_size, generator=gen)[
        : batch * pages_per_req
    ].view(batch, pages_per_req)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,head_dim,heads,kv_heads,page_size",
    [
        (torch.float32, torch.float32, 64, 8, 2, 1),
        (torch.bfloat16, torch.bfloat16, 64, 9, 3, 1),  # SmolLM2's shape
        (torch.float32, torch.bfloat16, 32, 4, 4, 16),
        (torch.float16, torch.float16, 48, 6, 2, 4),
        (
            torch.float32,
            torch.float32,
            24,
            4,
            1,
            3,
        ),  # head_dim not a multiple of 16: scalar path
        (torch.float32, torch.float32, 128, 16, 1, 1),  # 16 query heads per KV head
    ],
)
def test_paged_attention_matches_oracle(
    ops, q_dtype, kv_dtype, head_dim, heads, kv_heads, page_size
):
    gen = torch.Generator().manual_seed(0)
    kv_lens = [
        1,
        15,
        16,
        17,
        63,
        64,
        65,
        300,
    ]  # either side of the 16-key and 64-key tiles
    num_slots = 4096
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(kv_dtype)
    pages = random_pages(num_slots, len(kv_lens), max(kv_lens), page_size, gen)
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(q_dtype)
    positions = torch.tensor([n - 1 for n in kv_lens])
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ops.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        pages,
        torch.arange(len(kv_lens)),
        positions,
        page_size,
        scale,
    )
    slots = [
        pages[b, torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size
        for b, n in enumerate(kv_lens)
    ]
    expected = reference_attention(
        q.float(), k_cache.float(), v_cache.float(), [1] * len(kv_lens), slots, scale
    )
    torch.testing.assert_close(out.float(), expected, atol=TOL[q_dtype], rtol=0)


def test_paged_attention_several_tokens_per_request_are_causal(ops):
    """Tokens of one request (an extend) each see keys up to their own position."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(512, 2, 16, generator=gen)
    v_cache = torch.randn(512, 2, 16, generator=gen)
    pages = torch.randperm(512, generator=gen)[:40].view(1, 40)
    q = torch.randn(5, 4, 16, generator=gen)
    positions = torch.arange(35, 40)
    out = torch.empty_like(q)
    ops.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        pages,
        torch.zeros(5, dtype=torch.int64),
        positions,
        1,
        0.25,
    )
    expected = reference_attention(q, k_cache, v_cache, [5], [pages[0]], 0.25)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


def test_store_kv_from_strided_views(ops):
    qkv = torch.randn(7, 4 * 8 + 2 * 2 * 8).to(torch.bfloat16)
    k = qkv[:, 32:48].view(7, 2, 8)
    v = qkv[:, 48:].view(7, 2, 8)
    k_cache = torch.zeros(20, 2, 8)
    v_cache = torch.zeros(20, 2, 8)
    slots = torch.tensor([3, 19, 0, 7, 8, 11, 2])
    ops.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], k.float()) and torch.equal(
        v_cache[slots], v.float()
    )
    untouched = [i for i in range(20) if i not in slots.tolist()]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


# Bad arguments: each kernel checks every shape, dtype, layout and index before any pointer
# arithmetic and raises a RuntimeError naming the argument, the value and the valid range. A case is
# (the arguments it replaces, given the valid ones; a fragment of the message).


def put(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values, not contiguous (its last dim has stride 2)."""
    return torch.stack([t, t], -1)[..., 0]


def store_kv_args() -> dict:
    """A valid store_kv call: 3 new tokens into a pool of 20 slots."""
    gen = torch.Generator().manual_seed(6)
    return {
        "k": torch.randn(3, 2, 8, generator=gen),
        "v": torch.randn(3, 2, 8, generator=gen),
        "k_cache": torch.zeros(20, 2, 8),
        "v_cache": torch.zeros(20, 2, 8),
        "out_slots": torch.tensor([3, 19, 0]),
    }


STORE_KV_BAD = {
    "slot past the pool": (
        lambda a: {"out_slots": put(a["out_slots"], 1, 20)},
        "out_slots[1] = 20 is outside the KV pool's slots [0, 20)",
    ),
    "negative slot": (
        lambda a: {"out_slots": put(a["out_slots"], 2, -1)},
        "out_slots[2] = -1 is outside the KV pool's slots [0, 20)",
    ),
    "fewer slots than tokens": (
        lambda a: {"out_slots": a["out_slots"][:2]},
        "out_slots has 2 slots for 3 new tokens",
    ),
    "heads unlike the cache": (
        lambda a: {"k": a["k"][:, :1], "v": a["v"][:, :1]},
        "k has 1 heads of 8 but the caches hold 2 KV heads of 8",
    ),
    "v unlike k": (
        lambda a: {"v": a["v"][:2]},
        "v ([2, 2, 8], Float) must match k ([3, 2, 8], Float)",
    ),
    "caches unlike each other": (
        lambda a: {"v_cache": a["v_cache"].bfloat16()},
        "v_cache ([20, 2, 8], BFloat16) must match k_cache ([20, 2, 8], Float)",
    ),
    "int32 slots": (
        lambda a: {"out_slots": a["out_slots"].int()},
        "out_slots must be int64, got Int",
    ),
    "integer k": (
        lambda a: {"k": a["k"].long()},
        "k must be float32, bfloat16, float16 or float64, got Long",
    ),
    "k not 3-d": (
        lambda a: {"k": a["k"].view(3, 16)},
        "k must be [tokens, heads, head_dim]",
    ),
    "k heads not contiguous": (
        lambda a: {"k": strided(a["k"])},
        "k must have each token's heads contiguous",
    ),
    "cache not contiguous": (
        lambda a: {"k_cache": strided(a["k_cache"]), "v_cache": strided(a["v_cache"])},
        "k_cache must be contiguous",
    ),
    "slots not contiguous": (
        lambda a: {"out_slots": strided(a["out_slots"])},
        "out_slots must be contiguous",
    ),
    "k not on the CPU": (lambda a: {"k": a["k"].to("meta")}, "k must be a CPU tensor"),
}


@pytest.mark.parametrize("case", STORE_KV_BAD)
def test_store_kv_rejects_bad_arguments_before_writing(ops, case):
    change, message = STORE_KV_BAD[case]
    args = store_kv_args()
    args.update(change(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.store_kv(*args.values())
    assert not args["k_cache"].any() and not args["v_cache"].any()


def decode_args() -> dict:
    """A valid paged_attention call: 3 tokens of requests with 8, 6 and 7 keys; page_size 2, a pool of
    16 pages. Row 1 is padded with -1 past the 3 pages its keys use: never read, so never checked."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 16, generator=gen)
    return {
        "out": torch.empty_like(q),
        "q": q,
        "k_cache": torch.randn(32, 2, 16, generator=gen),
        "v_cache": torch.randn(32, 2, 16, generator=gen),
        "page_table": torch.tensor([[3, 5, 7, 9], [0, 1, 2, -1], [15, 14, 13, 12]]),
        "owner": torch.tensor([0, 1, 2]),
        "positions": torch.tensor([7, 5, 6]),
        "page_size": 2,
        "scale": 0.25,
    }


def test_paged_attention_reads_only_the_pages_it_needs(ops):
    args = decode_args()
    ops.paged_attention(*args.values())
    pages = args["page_table"]
    slots = [
        pages[b, torch.arange(n) // 2] * 2 + torch.arange(n) % 2
        for b, n in enumerate([8, 6, 7])
    ]
    expected = reference_attention(
        args["q"], args["k_cache"], args["v_cache"], [1, 1, 1], slots, 0.25
    )
    torch.testing.assert_close(args["out"], expected, atol=2e-5, rtol=0)


# what paged_attention and extend_attention both check
ATTENTION_IO_BAD = {
    "page entry past the pool": (
        lambda a: {"page_table": put(a["page_table"], (0, 1), 16)},
        "page_table[0][1] = 16 is outside the KV pool's pages [0, 16)",
    ),
    "negative page entry": (
        lambda a: {"page_table": put(a["page_table"], (0, 0), -2)},
        "page_table[0][0] = -2 is outside the KV pool's pages [0, 16)",
    ),
    "int32 page table": (
        lambda a: {"page_table": a["page_table"].int()},
        "page_table must be int64, got Int",
    ),
    "page table not 2-d": (
        lambda a: {"page_table": a["page_table"].view(-1)},
        "page_table must be [requests, max_pages]",
    ),
    "page table not contiguous": (
        lambda a: {"page_table": strided(a["page_table"])},
        "page_table must be contiguous",
    ),
    "zero page_size": (
        lambda a: {"page_size": 0},
        "page_size must be at least 1, got 0",
    ),
    "heads not a multiple of kv heads": (
        lambda a: {"q": a["q"][:, :3], "out": a["out"][:, :3].contiguous()},
        "q's 3 heads must be a multiple of the caches' 2 KV heads",
    ),
    "cache head_dim unlike q's": (
        lambda a: {
            name: a[name][..., :8].contiguous() for name in ("k_cache", "v_cache")
        },
        "the caches' head_dim (8) must be q's (16)",
    ),
    "caches unlike each other": (
        lambda a: {"v_cache": a["v_cache"][:16].contiguous()},
        "v_cache ([16, 2, 16], Float) must match k_cache ([32, 2, 16], Float)",
    ),
    "out unlike q": (lambda a: {"out": a["out"].double()}, "Double) must match q ("),
    "integer q": (
        lambda a: {"q": a["q"].int(), "out": a["out"].int()},
        "q must be float32, bfloat16, float16 or float64, got Int",
    ),
    "q heads not contiguous": (
        lambda a: {"q": strided(a["q"])},
        "q must have each token's heads contiguous",
    ),
    "out not contiguous": (
        lambda a: {"out": strided(a["out"])},
        "out must be contiguous",
    ),
    "cache not contiguous": (
        lambda a: {"k_cache": strided(a["k_cache"]), "v_cache": strided(a["v_cache"])},
        "k_cache must be contiguous",
    ),
}

DECODE_BAD = {
    "position past the table": (
        lambda a: {"positions": put(a["positions"], 0, 8)},
        "positions[0] = 8 is past the request's pages [0, 8) (4 pages of 2)",
    ),
    "negative position": (
        lambda a: {"positions": put(a["positions"], 2, -1)},
        "positions[2] = -1 is past the request's pages [0, 8)",
    ),
    "position reading a padded entry": (
        lambda a: {"positions": put(a["positions"], 1, 6)},
        "page_table[1][3] = -1 is outside the KV pool's pages [0, 16)",
    ),
    "owner past the table": (
        lambda a: {"owner": put(a["owner"], 1, 3)},
        "owner[1] = 3 is not a row of the page table [0, 3)",
    ),
    "negative owner": (
        lambda a: {"owner": put(a["owner"], 0, -1)},
        "owner[0] = -1 is not a row of the page table [0, 3)",
    ),
    "fewer positions than tokens": (
        lambda a: {"positions": a["positions"][:2]},
        "owner (3) and positions (2) need one entry per query token (3)",
    ),
    "positions not contiguous": (
        lambda a: {"positions": strided(a["positions"])},
        "positions must be contiguous",
    ),
    "int32 owner": (
        lambda a: {"owner": a["owner"].int()},
        "owner must be int64, got Int",
    ),
}


@pytest.mark.parametrize("case", [*ATTENTION_IO_BAD, *DECODE_BAD])
def test_paged_attention_rejects_bad_metadata(ops, case):
    change, message = {**ATTENTION_IO_BAD, **DECODE_BAD}[case]
    args = decode_args()
    args.update(change(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.paged_attention(*args.values())


def extend_args() -> dict:
    """A valid extend_attention call: requests of 3 new tokens (7 keys) and 2 (2 keys: a fresh
    prompt), 5 tokens in all; page_size 2, a pool of 16 pages, row 1 padded with -1."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(5, 4, 16, generator=gen)
    return {
        "out": torch.empty_like(q),
        "q": q,
        "k_cache": torch.randn(32, 2, 16, generator=gen),
        "v_cache": torch.randn(32, 2, 16, generator=gen),
        "page_table": torch.tensor([[3, 5, 7, 9], [0, -1, -1, -1]]),
        "q_start": torch.tensor([0, 3]),
        "q_len": torch.tensor([3, 2]),
        "kv_len": torch.tensor([7, 2]),
        "page_size": 2,
        "scale": 0.25,
    }


def test_extend_attention_reads_only_the_pages_it_needs(ops):
    if not ops.has_simd():
        pytest.skip("the extend kernel needs AVX2 or AVX-512")
    args = extend_args()
    ops.extend_attention(*args.values())
    pages = args["page_table"]
    slots = [
        pages[b, torch.arange(n) // 2] * 2 + torch.arange(n) % 2
        for b, n in enumerate([7, 2])
    ]
    expected = reference_attention(
        args["q"], args["k_cache"], args["v_cache"], [3, 2], slots, 0.25
    )
    torch.testing.assert_close(args["out"], expected, atol=2e-5, rtol=0)


EXTEND_BAD = {
    "kv_len past the table": (
        lambda a: {"kv_len": put(a["kv_len"], 0, 9)},
        "kv_len[0] = 9 is past [0, 8]: request 0 has more keys than pages (4 pages of 2)",
    ),
    "kv_len reading a padded entry": (
        lambda a: {"kv_len": put(a["kv_len"], 1, 3)},
        "page_table[1][1] = -1 is outside the KV pool's pages [0, 16)",
    ),
    "kv_len below q_len": (
        lambda a: {"kv_len": put(a["kv_len"], 1, 1)},
        "kv_len[1] = 1 is less than q_len[1] = 2",
    ),
    "negative q_len": (
        lambda a: {"q_len": put(a["q_len"], 1, -1)},
        "q_len[1] = -1 is outside [0, 5]",
    ),
    "tokens past the end": (
        lambda a: {"q_start": put(a["q_start"], 1, 4)},
        "q_start[1] = 4 is outside [3, 3]",
    ),
    "negative q_start": (
        lambda a: {"q_start": put(a["q_start"], 0, -1)},
        "q_start[0] = -1 is outside [0, 2]",
    ),
    "overlapping requests": (
        lambda a: {"q_start": torch.tensor([0, 2])},
        "q_start[1] = 2 is outside [3, 3]",
    ),
    "fewer lengths than rows": (
        lambda a: {"kv_len": a["kv_len"][:1]},
        "q_start (2), q_len (2) and kv_len (1) need one entry per page-table row (2)",
    ),
    "int32 q_len": (
        lambda a: {"q_len": a["q_len"].int()},
        "q_len must be int64, got Int",
    ),
    "q_start not contiguous": (
        lambda a: {"q_start": strided(a["q_start"])},
        "q_start must be contiguous",
    ),
    "head_dim not a multiple of 16": (
        lambda a: {
            name: a[name][..., :8].contiguous()
            for name in ("q", "out", "k_cache", "v_cache")
        },
        "extend_attention needs head_dim % 16 == 0 and at most 512, got 8",
    ),
}


@pytest.mark.parametrize("case", [*ATTENTION_IO_BAD, *EXTEND_BAD])
def test_extend_attention_rejects_bad_metadata(ops, case):
    """Checked before the kernel's ISA requirement, so on every build."""
    change, message = {**ATTENTION_IO_BAD, **EXTEND_BAD}[case]
    args = extend_args()
    args.update(change(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.extend_attention(*args.values())


NORM_BAD = {
    "weight shorter than hidden": (
        lambda a: {"weight": a["weight"][:95]},
        "weight must be [hidden = 96] (x's last dim), got [95]",
    ),
    "residual unlike x": (
        lambda a: {"residual": a["residual"][:2]},
        "residual ([2, 96], Float) must match x ([3, 96], Float)",
    ),
    "weight dtype unlike x's": (
        lambda a: {"weight": a["weight"].bfloat16()},
        "weight (BFloat16) and x (Float) must share a dtype",
    ),
    "integer x": (
        lambda a: {"x": a["x"].long(), "residual": a["residual"].long()},
        "x must be float32, bfloat16, float16 or float64, got Long",
    ),
    "0-dim x": (
        lambda a: {"x": a["x"][0, 0]},
        "x must be [..., hidden], got a 0-dim tensor",
    ),
    "x not contiguous": (lambda a: {"x": strided(a["x"])}, "x must be contiguous"),
    "residual not contiguous": (
        lambda a: {"residual": strided(a["residual"])},
        "residual must be contiguous",
    ),
}


@pytest.mark.parametrize("case", NORM_BAD)
def test_rms_norm_rejects_bad_shapes(ops, case):
    change, message = NORM_BAD[case]
    args = {
        "x": torch.randn(3, 96),
        "residual": torch.randn(3, 96),
        "weight": torch.rand(96),
        "eps": 1e-6,
    }
    args.update(change(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.add_rms_norm(*args.values())
    if "residual" not in case:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            ops.rms_norm(args["x"], args["weight"], 1e-6)


def test_zero_width_rows_are_empty_not_a_crash(ops):
    """rms_norm once divided by a zero-width hidden dim (SIGFPE: the whole process went down)."""
    assert ops.rms_norm(torch.empty(3, 0), torch.empty(0), 1e-6).shape == (3, 0)
    assert ops.silu_and_mul(torch.empty(3, 0)).shape == (3, 0)


@pytest.mark.parametrize(
    "gate_up,message",
    [
        (
            torch.randn(5, 81),
            "gate_up must be [..., 2 * intermediate], got sizes [5, 81]",
        ),
        (torch.tensor(1.0), "gate_up must be [..., 2 * intermediate], got sizes []"),
        (
            torch.ones(5, 80, dtype=torch.int32),
            "gate_up must be float32, bfloat16, float16 or float64",
        ),
        (strided(torch.randn(5, 80)), "gate_up must be contiguous"),
    ],
    ids=["odd width", "0-dim", "integer", "not contiguous"],
)
def test_silu_and_mul_rejects_bad_shapes(ops, gate_up, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.silu_and_mul(gate_up)


ROPE_BAD = {
    "position past the table": (
        lambda a: {"positions": put(a["positions"], 1, 8)},
        "positions[1] = 8 is outside the rotary table [0, 8)",
    ),
    "negative position": (
        lambda a: {"positions": put(a["positions"], 0, -1)},
        "positions[0] = -1 is outside the rotary table [0, 8)",
    ),
    "fewer positions than tokens": (
        lambda a: {"positions": a["positions"][:1]},
        "positions has 1 entries for 2 tokens",
    ),
    "k tokens unlike q's": (
        lambda a: {"k": a["k"][:1]},
        "k [1, 2, 16] must be [tokens = 2, kv_heads, head_dim = 16] like q",
    ),
    "sin unlike cos": (
        lambda a: {"sin": a["sin"][:4].contiguous()},
        "cos and sin must be [max_positions, rot_dim] alike, got [8, 16] and [4, 16]",
    ),
    "int32 positions": (
        lambda a: {"positions": a["positions"].int()},
        "positions must be int64, got Int",
    ),
}


@pytest.mark.parametrize("case", ROPE_BAD)
def test_rotary_embedding_rejects_bad_positions(ops, case):
    change, message = ROPE_BAD[case]
    rope = RotaryEmbedding(RopeConfig(), 16, 8, 8)
    args = {
        "q": torch.randn(2, 4, 16),
        "k": torch.randn(2, 2, 16),
        "cos": rope.cos,
        "sin": rope.sin,
        "positions": torch.tensor([0, 7]),
    }
    args.update(change(args))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.rotary_embedding(*args.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_and_fused_residual_match_pytorch(ops, dtype, rows):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96, generator=gen) + 0.5
    norm = norm.to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    torch.testing.assert_close(
        ops.rms_norm(x, norm.weight, 1e-6),
        norm.reference(x),
        atol=TOL[dtype],
        rtol=TOL[dtype],
    )
    out, summed = ops.add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(
        out, norm.reference(x + residual), atol=TOL[dtype], rtol=TOL[dtype]
    )
    # the module picks the kernel and returns the same pair
    got, got_sum = norm(x, residual)
    assert torch.equal(got, out) and torch.equal(got_sum, summed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_embedding_in_place_matches_pytorch(ops, dtype, partial):
    rope_cfg = RopeConfig(theta=10000.0, partial_rotary_factor=partial)
    rope = RotaryEmbedding(rope_cfg, 32, 256, 256)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, 4 * 32 + 2 * 2 * 32, generator=gen).to(dtype)
    q, k = qkv[:, :128].view(9, 4, 32), qkv[:, 128:192].view(9, 2, 32)
    positions = torch.tensor([0, 1, 2, 50, 51, 200, 255, 7, 7])
    exp_q, exp_k = rope.reference(positions, q, k)
    v_before = qkv[:, 192:].clone()
    got_q, got_k = rope(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place
    torch.testing.assert_close(got_q, exp_q, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(got_k, exp_k, atol=TOL[dtype], rtol=0)
    assert torch.equal(qkv[:, 192:], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_pytorch(ops, dtype):
    gate_up = (torch.randn(5, 2 * 40) * 4).to(dtype)
    expected = F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    tol = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected, **tol)
    batched = gate_up.view(1, 5, 80)  # [..., 2I]: leading dims are kept
    torch.testing.assert_close(
        ops.silu_and_mul(batched), expected.view(1, 5, 40), **tol
    )


def argmax_cases() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rows = [
        torch.randn(n, generator=gen)
        for n in (1, 7, 16, 255, 256, 257, 1000, 4096, 49152 + 13)
    ]
    ties = torch.zeros(1000)
    ties[[300, 700, 999]] = 2.0  # the first of equal maxima
    masked = torch.full(
        (2000,), -float("inf")
    )  # a grammar's mask: a few allowed tokens
    masked[[1500, 40, 1999]] = torch.tensor([3.0, -7.0, 3.0])
    rows += [ties, masked, torch.zeros(600), torch.full((700,), -float("inf"))]
    signed = torch.full((800,), -1.0)
    signed[[513, 100]] = torch.tensor([0.0, -0.0])  # -0 == +0: the first zero
    rows.append(signed)
    for n, at, value in [
        (1000, 999, float("nan")),
        (1000, 5, float("nan")),
        (1000, 600, float("inf")),
        (1000, 600, -float("inf")),
        (300, 280, float("nan")),
        (300, 290, float("inf")),
    ]:
        row = torch.randint(
            -50, 50, (n,), generator=gen
        ).float()  # integers: ties at the maximum too
        row[at] = value
        rows.append(row)
    two_nans = torch.randn(512, generator=gen)
    two_nans[[400, 30]] = float("nan")
    two_nans[200] = float("inf")
    rows.append(two_nans)
    return rows


def test_argmax_rows_is_torch_argmax(ops):
    """The first maximum, and the first NaN where a row has one, whatever its length and its infinities."""
    for row in argmax_cases():
        assert ops.argmax_rows(row.view(1, -1)).tolist() == [int(row.argmax())], row
    gen = torch.Generator().manual_seed(1)
    batch = torch.randn(9, 1000, generator=gen)
    batch[3, 17] = float("nan")
    wide = torch.randn(5, 1100, generator=gen)
    for x in (
        batch,
        wide[:, :1000],
        wide[1:4, 37:800],
        torch.randn(0, 64),
    ):  # rows with a stride, none at all
        assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("case", ["dtype", "transposed", "empty_row", "three_dims"])
def test_argmax_rows_rejects_what_it_cannot_read(ops, case):
    x = {
        "dtype": torch.zeros(2, 8, dtype=torch.bfloat16),
        "transposed": torch.zeros(8, 2).t(),
        "empty_row": torch.zeros(2, 0),
        "three_dims": torch.zeros(2, 2, 2),
    }[case]
    with pytest.raises(RuntimeError, match="x must be"):
        ops.argmax_rows(x)


def test_disabled_falls_back_to_pytorch():
    with kernels.disabled():
        assert kernels.cpu_ops() is None and kernels.usable(torch.zeros(1)) is None
        norm = RMSNorm(8, 1e-6)
        x = torch.randn(2, 8)
        assert torch.equal(norm(x), norm.reference(x))


DENSE_SHAPES = [(130, 64), (48, 32), (576, 576), (1000, 2048), (17, 34), (1, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k", DENSE_SHAPES)
def test_dense_linear_rows_do_not_depend_on_the_call(ops, dtype, n, k):
    """A row's output bits are the same alone, as the first m rows of any call, and at any place in a
    call (every tile size: 1-9 rows on AVX-512, 1-4 on AVX2, tails of groups, row counts past several
    tiles), and within rounding of F.linear; outputs past N (the padded last group) are never written."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(40, k, generator=gen).to(dtype)
    wp = pack_dense(w)
    full = ops.dense_linear(x, wp, bias, n)
    want = F.linear(x.double(), w.double(), bias.double())
    scale = want.abs().max().item()
    assert (
        full.dtype == dtype
        and (full.double() - want).abs().max().item() <= TOL[dtype] * scale
    )
    for m in [*range(1, 13), 17, 19, 33]:
        assert torch.equal(
            ops.dense_linear(x[:m].contiguous(), wp, bias, n), full[:m]
        ), m
    for r in (0, 5, 9, 39):
        assert torch.equal(
            ops.dense_linear(x[r : r + 1].contiguous(), wp, bias, n), full[r : r + 1]
        ), r
    order = torch.randperm(40, generator=gen)
    assert torch.equal(
        ops.dense_linear(x[order].contiguous(), wp, None, n),
        ops.dense_linear(x, wp, None, n)[order],
    )
    assert torch.equal(unpack_dense(wp, n), w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_dense_grouped_linear_gives_each_row_its_weight(ops, dtype):
    """Rows grouped by expert (some experts with none, one with a lone row): each row gets its own
    expert's product (+ that expert's bias), the bits dense_linear gives that row alone."""
    gen = torch.Generator().manual_seed(7)
    E, n, k = 6, 40, 64
    counts = [3, 0, 11, 1, 0, 9]
    w = torch.randn(E, n, k, generator=gen).to(dtype)
    bias = torch.randn(E, n, generator=gen)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)
    wp = pack_groups(w)
    ends = torch.tensor(counts).cumsum(0)
    got = ops.dense_grouped_linear(x, wp, ends, bias, n)
    start = 0
    for e, count in enumerate(counts):
        rows = x[start : start + count]
        for r in range(count):
            assert torch.equal(
                got[start + r],
                ops.dense_linear(rows[r : r + 1].contiguous(), wp[e], bias[e], n)[0],
            )
        if count:
            want = F.linear(rows.double(), w[e].double(), bias[e].double())
            assert (got[start : start + count].double() - want).abs().max() <= TOL[
                dtype
            ] * want.abs().max()
        start += count
    plain = ops.dense_grouped_linear(x, wp, ends, None, n)
    assert torch.equal(
        plain[3:14], ops.dense_linear(x[3:14].contiguous(), wp[2], None, n)
    )
    bad = [
        ((x, wp, torch.tensor([3, 3, 14, 15, 15]), None, n), "one entry per weight"),
        ((x, wp, torch.tensor([3, 2, 14, 15, 15, 24]), None, n), "must rise"),
        (
            (x, wp, torch.tensor([3, 3, 14, 15, 15, 23]), None, n),
            "must end at the rows",
        ),
        ((x, wp, ends.int(), None, n), "int64"),
        ((x, wp, ends, bias[0], n), r"bias must be \[6, 40\]"),
        ((x, wp[0], ends, None, n), "wp must be"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            ops.dense_grouped_linear(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_grouped_dense_is_a_batched_matmul_whose_rows_stand_alone(ops, dtype):
    """grouped_dense (MLA's per-head products, DeepSeek-V4's grouped projection): slice i of each token
    through weight i, as torch.bmm computes it up to rounding, and each token's bits the same alone."""
    gen = torch.Generator().manual_seed(11)
    tokens, groups, n, k = 13, 5, 24, 32
    w = torch.randn(groups, n, k, generator=gen).to(dtype)
    x = torch.randn(tokens, groups, k, generator=gen).to(dtype)
    packed = pack_groups(w)
    got = grouped_dense(x, packed, n, kernels.selected_target())
    want = torch.bmm(x.transpose(0, 1).double(), w.double().transpose(1, 2)).transpose(
        0, 1
    )
    assert got.shape == (tokens, groups, n)
    assert (got.double() - want).abs().max() <= TOL[dtype] * want.abs().max()
    for t in range(tokens):
        assert torch.equal(
            grouped_dense(x[t : t + 1], packed, n, kernels.selected_target()),
            got[t : t + 1],
        ), t


def test_dense_linear_rejects_bad_arguments(ops):
    w = torch.randn(20, 8)
    wp = pack_dense(w)
    x = torch.randn(3, 8)
    cases = [
        ((x.to(torch.float16), wp, None, 20), "bfloat16 or float32"),
        ((x, wp.to(torch.bfloat16), None, 20), "must have x's dtype"),
        ((x, wp, None, 40), r"wp must be \[3, 8, 16\]"),
        ((x[:, :6].contiguous(), wp, None, 20), r"wp must be \[2, 6, 16\]"),
        ((x, wp, torch.zeros(19), 20), r"bias must be \[20\]"),
        ((x, wp, torch.zeros(20, dtype=torch.float64), 20), "bias must be float32"),
        ((x.t(), wp, None, 20), "x must be contiguous"),
        (
            (
                torch.randn(3, 7).to(torch.bfloat16),
                torch.zeros(2, 3, 16, 2, dtype=torch.bfloat16),
                None,
                20,
            ),
            "even K",
        ),
        ((x, wp, None, 0), "N and K must be positive"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.dense_linear(*args)
    assert ops.dense_linear(x[:0], wp, None, 20).shape == (0, 20)


def test_pack_linears_makes_dense_linears_and_packs_the_tied_head():
    if kernels.cpu_ops() is None:
        pytest.skip("the CPU kernels could not be built here")
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        model = torch.nn.Module()
        model.embed_tokens = torch.nn.Embedding(50, 24).to(dtype)
        model.proj = torch.nn.Linear(24, 40, bias=True).to(dtype)
        model.odd = torch.nn.Linear(7, 5).to(
            dtype
        )  # bf16 needs an even K: left as it is
        model.lm_head = None
        reference, odd = model.proj, model.odd
        x = torch.randn(3, 24).to(dtype)
        expected = reference(x)
        assert pack_linears(model) == (2 if dtype == torch.bfloat16 else 3)
        assert isinstance(model.proj, DenseLinear) and isinstance(
            model.lm_head, DenseLinear
        )
        assert (model.odd is odd) == (dtype == torch.bfloat16)
        torch.testing.assert_close(
            model.proj(x).float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype]
        )
        torch.testing.assert_close(
            model.lm_head(x).float(),
            F.linear(x, model.embed_tokens.weight).float(),
            atol=TOL[dtype],
            rtol=TOL[dtype],
        )
        lead = model.proj(
            torch.stack([x, x])
        )  # leading dims kept, rows independent of the call
        assert lead.shape == (2, 3, 40) and torch.equal(lead[1], model.proj(x))
    with kernels.disabled():  # the switch covers packing too
        other = torch.nn.Module()
        other.proj = torch.nn.Linear(24, 40).to(torch.bfloat16)
        assert pack_linears(other) == 0


def test_onednn_packing_is_the_fallback_without_native_kernels(monkeypatch):
    from strata.layers import packed

    if not packed.packing_works():
        pytest.skip("oneDNN bf16 packing is not available on this CPU/torch build")
    monkeypatch.setattr(packed, "dense_target", lambda: None)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(24, 40).to(torch.bfloat16)
    model.f32 = torch.nn.Linear(24, 40)
    x = torch.randn(3, 24).to(torch.bfloat16)
    expected = model.proj(x)
    assert (
        pack_linears(model) == 1
        and isinstance(model.proj, PackedLinear)
        and type(model.f32) is torch.nn.Linear
    )
    torch.testing.assert_close(
        model.proj(x).float(), expected.float(), atol=0.05, rtol=0.02
    )


@pytest.mark.parametrize(
    "dtype,head_dim,heads,kv_heads,page_size",
    [
        (torch.float32, 64, 9, 3, 1),
        (torch.bfloat16, 64, 9, 3, 4),
        (torch.float16, 32, 4, 4, 1),
        (torch.float32, 128, 16, 1, 16),  # 16 query rows per KV head: row chunks of 4
    ],
)
def test_extend_attention_matches_oracle(
    ops, extend_path, dtype, head_dim, heads, kv_heads, page_size
):
    if not ops.has_simd():
        pytest.skip("the extend kernel needs AVX2 or AVX-512")
    gen = torch.Generator().manual_seed(4)
    q_lens, kv_lens = (
        [1, 16, 17, 40, 5],
        [1, 16, 50, 200, 5],
    )  # fresh and cached prefixes, block edges
    num_slots = 2048
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    pages = random_pages(num_slots, len(kv_lens), max(kv_lens), page_size, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    q_start = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))])
    scale = head_dim**-0.5
    ops.extend_attention(
        out,
        q,
        k_cache,
        v_cache,
        pages,
        q_start,
        torch.tensor(q_lens),
        torch.tensor(kv_lens),
        page_size,
        scale,
    )
    slots = [
        pages[b, torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size
        for b, n in enumerate(kv_lens)
    ]
    expected = reference_attention(
        q.float(), k_cache.float(), v_cache.float(), q_lens, slots, scale
    )
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=0)
    with pytest.raises(RuntimeError, match="more keys than pages"):
        ops.extend_attention(
            out,
            q,
            k_cache,
            v_cache,
            pages[:, :1].contiguous(),
            q_start,
            torch.tensor(q_lens),
            torch.tensor(kv_lens),
            page_size,
            scale,
        )


@pytest.mark.parametrize("kv_len", [257, 1000, 3001])
@pytest.mark.parametrize("kv_heads", [1, 3])
def test_paged_attention_one_long_sequence_splits_keys(ops, kv_len, kv_heads):
    """Fewer (token, KV head) items than threads x 2: keys are split into ranges and merged."""
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(4096, kv_heads, 64, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(4096, kv_heads, 64, generator=gen).to(torch.bfloat16)
    pages = torch.randperm(4096, generator=gen)[:kv_len].view(1, kv_len)
    q = torch.randn(1, 3 * kv_heads, 64, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(q)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):  # the split count depends on the thread count
            torch.set_num_threads(n)
            ops.paged_attention(
                out,
                q,
                k_cache,
                v_cache,
                pages,
                torch.zeros(1, dtype=torch.int64),
                torch.tensor([kv_len - 1]),
                1,
                0.125,
            )
            expected = reference_attention(
                q.float(), k_cache.float(), v_cache.float(), [1], [pages[0]], 0.125
            )
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)
    finally:
        torch.set_num_threads(threads)


# Layer options (sliding window, logit softcap, attention sinks). With a window, the page-table
# entries of pages wholly before a request's first window are set to -1: the kernels must not read
# them (sliding layers will free those pages).


def kernel_case(
    gen, dtype, heads, kv_heads, head_dim, q_lens, kv_lens, page_size, window, sinks
):
    """Caches, pages, queries, the oracle's slots and the kernel's page table (-1 behind the window)."""
    num_slots = 8192
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    pages = random_pages(num_slots, len(kv_lens), max(kv_lens), page_size, gen)
    slots = [
        pages[b, torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size
        for b, n in enumerate(kv_lens)
    ]
    if window is not None:
        pages = pages.clone()
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            pages[b, : max(0, kv_len - q_len - window + 1) // page_size] = -1
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    sink_logits = torch.randn(heads, generator=gen) * 2 if sinks else None
    return k_cache, v_cache, pages, slots, q, sink_logits


def layer_options(window, softcap, sinks) -> tuple[dict, dict]:
    """The options as the kernels take them (0: off) and as the oracle takes them (None: off)."""
    return {"window": window or 0, "softcap": softcap or 0.0, "sinks": sinks}, {
        "window": window,
        "softcap": softcap,
        "sinks": sinks,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 24], ids=["simd", "scalar"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 1, 16, 50, 4096])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_paged_attention_window_softcap_sinks_match_oracle(
    ops, dtype, head_dim, page_size, window, softcap, sinks
):
    gen = torch.Generator().manual_seed(9)
    kv_lens = [1, 15, 16, 17, 63, 64, 65, 300]
    k_cache, v_cache, pages, slots, q, sink_logits = kernel_case(
        gen,
        dtype,
        8,
        2,
        head_dim,
        [1] * len(kv_lens),
        kv_lens,
        page_size,
        window,
        sinks,
    )
    out = torch.empty_like(q)
    kernel_options, oracle_options = layer_options(window, softcap, sink_logits)
    positions = torch.tensor([n - 1 for n in kv_lens])
    scale = head_dim**-0.5
    ops.paged_attention(
        out,
        q,
        k_cache,
        v_cache,
        pages,
        torch.arange(len(kv_lens)),
        positions,
        page_size,
        scale,
        **kernel_options,
    )
    expected = reference_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        [1] * len(kv_lens),
        slots,
        scale,
        **oracle_options,
    )
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 100])
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_extend_attention_window_softcap_sinks_match_oracle(
    ops, extend_path, dtype, page_size, window, softcap, sinks
):
    """Fresh prompts, cached prefixes and chunks across a window's edge: (q 12, kv 20) has 8 cached
    keys, all behind its last token's 5-key window; (q 40, kv 200) spans many 16-key tiles."""
    if not ops.has_simd():
        pytest.skip("the extend kernel needs AVX2 or AVX-512")
    gen = torch.Generator().manual_seed(10)
    q_lens, kv_lens = [1, 16, 17, 40, 5, 12], [1, 16, 50, 200, 5, 20]
    k_cache, v_cache, pages, slots, q, sink_logits = kernel_case(
        gen, dtype, 8, 2, 64, q_lens, kv_lens, page_size, window, sinks
    )
    out = torch.full_like(q, float("nan"))
    kernel_options, oracle_options = layer_options(window, softcap, sink_logits)
    q_start = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))])
    ops.extend_attention(
        out,
        q,
        k_cache,
        v_cache,
        pages,
        q_start,
        torch.tensor(q_lens),
        torch.tensor(kv_lens),
        page_size,
        0.125,
        **kernel_options,
    )
    expected = reference_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        q_lens,
        slots,
        0.125,
        **oracle_options,
    )
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("window", [700, 2000])
def test_paged_attention_split_keys_with_a_window_and_sinks(ops, window):
    """One long sequence: its window's keys are split into ranges (the sink counted once) and merged."""
    gen = torch.Generator().manual_seed(11)
    kv_len = 3001
    k_cache, v_cache, pages, slots, q, sink_logits = kernel_case(
        gen, torch.bfloat16, 6, 2, 64, [1], [kv_len], 1, window, True
    )
    out = torch.empty_like(q)
    expected = reference_attention(
        q.float(),
        k_cache.float(),
        v_cache.float(),
        [1],
        slots,
        0.125,
        window=window,
        sinks=sink_logits,
    )
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            ops.paged_attention(
                out,
                q,
                k_cache,
                v_cache,
                pages,
                torch.zeros(1, dtype=torch.int64),
                torch.tensor([kv_len - 1]),
                1,
                0.125,
                window=window,
                sinks=sink_logits,
            )
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)
    finally:
        torch.set_num_threads(threads)


# (the options, given the valid call's arguments; a fragment of the message): for both kernels
LAYER_OPTIONS_BAD = {
    "negative softcap": (
        lambda a: {"softcap": -1.0},
        "softcap must be finite and >= 0 (0: off), got -1",
    ),
    "sinks for other heads": (
        lambda a: {"sinks": torch.zeros(3)},
        "sinks must be [heads = 4], got sizes [3]",
    ),
    "bf16 sinks": (
        lambda a: {"sinks": torch.zeros(4).bfloat16()},
        "sinks must be float32, got BFloat16",
    ),
    "sinks not contiguous": (
        lambda a: {"sinks": strided(torch.zeros(4))},
        "sinks must be contiguous",
    ),
    "a padded page inside the window": (
        lambda a: {"window": 2, "page_table": put(a["page_table"], (0, 3), -1)},
        "page_table[0][3] = -1 is outside the KV pool's pages [0, 16) (read for the request's keys [",
    ),
}


@pytest.mark.parametrize("case", LAYER_OPTIONS_BAD)
@pytest.mark.parametrize("kernel", ["paged_attention", "extend_attention"])
def test_attention_kernels_reject_bad_layer_options(ops, kernel, case):
    change, message = LAYER_OPTIONS_BAD[case]
    args = decode_args() if kernel == "paged_attention" else extend_args()
    options = change(args)
    if "page_table" in options:
        args["page_table"] = options.pop("page_table")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        getattr(ops, kernel)(*args.values(), **options)


@pytest.mark.parametrize("kernel", ["paged_attention", "extend_attention"])
def test_attention_kernels_never_read_pages_behind_the_window(ops, kernel):
    """With a 2-key window, row 0 of the decode call reads keys 6-7 (page 3) and of the extend call
    keys 3-6 (pages 1-3): the pages before may be -1."""
    if kernel == "extend_attention" and not ops.has_simd():
        pytest.skip("the extend kernel needs AVX2 or AVX-512")
    args = decode_args() if kernel == "paged_attention" else extend_args()
    valid = args["page_table"].clone()
    args["page_table"][0, : 3 if kernel == "paged_attention" else 1] = -1
    getattr(ops, kernel)(*args.values(), window=2)
    kv_lens = [8, 6, 7] if kernel == "paged_attention" else [7, 2]
    q_lens = [1, 1, 1] if kernel == "paged_attention" else [3, 2]
    slots = [
        valid[b, torch.arange(n) // 2] * 2 + torch.arange(n) % 2
        for b, n in enumerate(kv_lens)
    ]
    expected = reference_attention(
        args["q"], args["k_cache"], args["v_cache"], q_lens, slots, 0.25, window=2
    )
    torch.testing.assert_close(args["out"], expected, atol=2e-5, rtol=0)


def test_a_build_for_an_isa_this_cpu_lacks_is_never_loaded(monkeypatch):
    """The check runs before building (target flags) and on the loaded module (its compiled ISA)."""

    class Built:
        @staticmethod
        def compiled_isa():
            return ["avx2", "fma", "avx512f", "avx512bf16"]

    monkeypatch.setattr(
        kernels, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"})
    )
    assert kernels._checked(Built, "native") is None
    monkeypatch.setattr(
        kernels,
        "cpu_flags",
        lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}),
    )
    assert kernels._checked(Built, "native") is Built
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    assert not kernels.target_supported("x86-64-v3")
    monkeypatch.setattr(kernels, "_modules", {})
    assert kernels.load("x86-64-v3") is None  # refused before any build


def test_kernel_info_names_the_build_and_the_cpu(ops):
    info = kernels.kernel_info()
    assert info["cpu_kernels"] in kernels.TARGETS
    assert info["kernel_isa"] == list(ops.compiled_isa())
    assert {kernels.ISA_FLAGS[isa] for isa in info["kernel_isa"]} <= set(
        info["cpu_isa"]
    )
    assert kernels.describe_kernels(info).startswith(info["cpu_kernels"])


def decode_rows(
    ops, q, k_cache, v_cache, table, positions, rows, page_size=1, window=0, sinks=None
):
    """Decode attention of query rows `rows` (indices into q, positions and table's rows) alone."""
    out = torch.empty(len(rows), *q.shape[1:], dtype=q.dtype)
    ops.paged_attention(
        out,
        q[rows].contiguous(),
        k_cache,
        v_cache,
        table,
        torch.tensor(rows),
        positions[rows].contiguous(),
        page_size,
        0.125,
        window=window,
        softcap=0.0,
        sinks=sinks,
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(0, False), (300, True)])
def test_a_decode_token_gets_the_same_bits_whatever_it_is_batched_with(
    ops, window, sinks, dtype
):
    """Long key ranges are split by the token's own keys, not by the batch: a token alone and the
    same token among others (as a speculative verification's k + 1 entries) give identical bits,
    for contexts below, at and past the split size. Alone, a short token's few key ranges are dealt
    to the threads head by head; together, each range with all its heads: the same bits either way."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, page_size = 6, 3, 64, 16
    lengths = [100, 256, 257, 700, 1500]
    pages_per = [-(-n // page_size) for n in lengths]
    k_cache = torch.randn(sum(pages_per) * page_size, kv_heads, dim, generator=gen)
    k_cache = k_cache.to(dtype)
    v_cache = torch.randn_like(k_cache)
    table = torch.zeros(len(lengths), max(pages_per), dtype=torch.int64)
    start = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = torch.arange(start, start + n)
        start += n
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen) if sinks else None
    positions = torch.tensor(lengths) - 1

    def run(rows):
        return decode_rows(
            ops, q, k_cache, v_cache, table, positions, rows, page_size, window, sink
        )

    together = run(list(range(len(lengths))))
    for b in range(len(lengths)):
        assert torch.equal(run([b]), together[b : b + 1]), lengths[b]
        assert torch.equal(run([b] * 4)[2:3], together[b : b + 1]), lengths[b]


def test_a_large_decode_batch_gets_the_bits_each_request_gets_alone(ops):
    """A call reading more keys than the threads' L2 caches hold asks for the next item's rows ahead
    (48 requests of 400 keys, ~15 MB of bf16 K/V, each decoded key in a slot of its own): each
    request's output is still the one it gets alone."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, requests, keys = 9, 3, 64, 48, 400
    k_cache = torch.randn(requests * keys, kv_heads, dim, generator=gen).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(requests * keys, generator=gen).view(requests, keys)
    q = torch.randn(requests, heads, dim, generator=gen).bfloat16()
    positions = torch.full((requests,), keys - 1)

    def run(rows):
        return decode_rows(ops, q, k_cache, v_cache, table, positions, rows)

    together = run(list(range(requests)))
    for b in (0, 17, requests - 1):
        assert torch.equal(run([b]), together[b : b + 1]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (64, 9, 3): the default model; with bf16 on AVX512-BF16, 128, 32 and 576 take the same bf16 kernel (a
# key tile transposed for all the rows of a work item: 3 to 16 query heads per KV head here; 576 x 16 on
# one KV head is MLA's latent attention); 48 and 40 are not multiples of 32 and take the float path
@pytest.mark.parametrize(
    "head_dim,heads,kv_heads",
    [(64, 9, 3), (128, 8, 2), (32, 6, 1), (576, 16, 1), (48, 4, 4), (40, 8, 2)],
)
@pytest.mark.parametrize(
    "window,softcap,sinks",
    [(0, 0.0, False), (300, 0.0, True), (0, 30.0, False), (40, 0.0, False)],
)
def test_a_verifications_rows_get_the_bits_each_would_get_alone(
    ops, dtype, head_dim, heads, kv_heads, window, softcap, sinks
):
    """A speculative verification feeds k + 1 decode entries of one request at consecutive positions
    (one page-table row each, or one row shared), which the kernel attends as one run sharing every
    tile of keys; each entry's output is bit-identical to the same token attended alone, for runs
    that end inside a 16-key chunk, cross a 64-key tile, the 256-key split and a window's start."""
    gen = torch.Generator().manual_seed(11)
    page_size, num_pages = 16, 48
    k_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(
        dtype
    )
    v_cache = torch.randn(num_pages * page_size, kv_heads, head_dim, generator=gen).to(
        dtype
    )
    pages = torch.randperm(num_pages, generator=gen)
    sink = torch.randn(heads, generator=gen) if sinks else None
    for first_pos, rows in [(5, 6), (57, 9), (250, 10), (300, 16), (330, 17), (700, 3)]:
        positions = torch.arange(first_pos, first_pos + rows)
        q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)

        def attend(q_rows, pos_rows, owner, table):
            out = torch.empty_like(q_rows)
            ops.paged_attention(
                out,
                q_rows,
                k_cache,
                v_cache,
                table,
                owner,
                pos_rows,
                page_size,
                0.125,
                window=window,
                softcap=softcap,
                sinks=sink,
            )
            return out

        table = pages.view(1, -1).repeat(rows, 1).contiguous()
        one_row = pages.view(1, -1).contiguous()
        per_entry = attend(
            q, positions, torch.arange(rows), table
        )  # the runner's layout: a row per entry
        shared = attend(q, positions, torch.zeros(rows, dtype=torch.int64), one_row)
        for r in range(rows):
            alone = attend(
                q[r : r + 1].contiguous(),
                positions[r : r + 1].contiguous(),
                torch.zeros(1, dtype=torch.int64),
                one_row,
            )
            assert torch.equal(per_entry[r : r + 1], alone), (first_pos, r)
            assert torch.equal(shared[r : r + 1], alone), (first_pos, r)
        # and it is attention: the reference over each row's own keys
        slots = pages.repeat_interleave(page_size) * page_size + torch.arange(
            page_size
        ).repeat(num_pages)
        ref = torch.cat(
            [
                reference_attention(
                    q[r : r + 1],
                    k_cache,
                    v_cache,
                    [1],
                    [slots[: int(positions[r]) + 1]],
                    0.125,
                    window=window or None,
                    sinks=sink,
                    softcap=softcap or None,
                )
                for r in range(rows)
            ]
        )
        torch.testing.assert_close(
            per_entry.float(),
            ref.float(),
            atol=2e-2 if dtype == torch.bfloat16 else 1e-4,
            rtol=2e-2 if dtype == torch.bfloat16 else 1e-4,
        )
