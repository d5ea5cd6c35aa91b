"""The native CPU kernels against their PyTorch versions and the float32 attention oracle."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from strata import kernels
from strata.config import RopeConfig
from strata.layers.attention import reference_attention
from strata.layers.norm import RMSNorm
from strata.layers.packed import PackedLinear, pack_linears
from strata.layers.rope import RotaryEmbedding

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def ops(request):
    """Each build this CPU can run: on an AVX-512 machine the x86-64-v3 build proves the AVX2 paths."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    if not kernels.target_supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    module = kernels.load(request.param)
    assert module is not None, "a C++ compiler is present but the CPU kernels failed to build (see the log)"
    if request.param == "x86-64-v3":
        assert "avx2" in module.compiled_isa() and "avx512f" not in module.compiled_isa()
    with kernels.using(request.param):
        yield module


def random_pages(num_slots: int, batch: int, max_len: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    pages_per_req = -(-max_len // page_size)
    return torch.randperm(num_slots // page_size, generator=gen)[: batch * pages_per_req].view(batch, pages_per_req)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,head_dim,heads,kv_heads,page_size",
    [
        (torch.float32, torch.float32, 64, 8, 2, 1),
        (torch.bfloat16, torch.bfloat16, 64, 9, 3, 1),  # SmolLM2's shape
        (torch.float32, torch.bfloat16, 32, 4, 4, 16),
        (torch.float16, torch.float16, 48, 6, 2, 4),
        (torch.float32, torch.float32, 24, 4, 1, 3),  # head_dim not a multiple of 16: scalar path
        (torch.float32, torch.float32, 128, 16, 1, 1),  # 16 query heads per KV head
    ],
)
def test_paged_attention_matches_oracle(ops, q_dtype, kv_dtype, head_dim, heads, kv_heads, page_size):
    gen = torch.Generator().manual_seed(0)
    kv_lens = [1, 15, 16, 17, 63, 64, 65, 300]  # either side of the 16-key and 64-key tiles
    num_slots = 4096
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(kv_dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(kv_dtype)
    pages = random_pages(num_slots, len(kv_lens), max(kv_lens), page_size, gen)
    q = torch.randn(len(kv_lens), heads, head_dim, generator=gen).to(q_dtype)
    positions = torch.tensor([n - 1 for n in kv_lens])
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ops.paged_attention(out, q, k_cache, v_cache, pages, torch.arange(len(kv_lens)), positions, page_size, scale)
    slots = [pages[b, torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size for b, n in enumerate(kv_lens)]
    expected = reference_attention(q.float(), k_cache.float(), v_cache.float(), [1] * len(kv_lens), slots, scale)
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
    ops.paged_attention(out, q, k_cache, v_cache, pages, torch.zeros(5, dtype=torch.int64), positions, 1, 0.25)
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
    assert torch.equal(k_cache[slots], k.float()) and torch.equal(v_cache[slots], v.float())
    untouched = [i for i in range(20) if i not in slots.tolist()]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


def test_bad_indices_raise_instead_of_reading_out_of_bounds(ops):
    q = torch.randn(2, 4, 16)
    cache = torch.randn(64, 2, 16)
    pages = torch.arange(8).view(2, 4)
    with pytest.raises(RuntimeError, match="past the request's pages"):
        ops.paged_attention(torch.empty_like(q), q, cache, cache, pages, torch.tensor([0, 1]), torch.tensor([3, 4]), 1, 1.0)
    with pytest.raises(RuntimeError, match="not a row of the page table"):
        ops.paged_attention(torch.empty_like(q), q, cache, cache, pages, torch.tensor([0, 2]), torch.tensor([3, 3]), 1, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_attention(torch.empty_like(q), q, cache, cache, pages.int(), torch.tensor([0, 1]), torch.tensor([1, 1]), 1, 1.0)
    rope = RotaryEmbedding(RopeConfig(), 16, 8, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        ops.rotary_embedding(torch.randn(1, 4, 16), torch.randn(1, 2, 16), rope.cos, rope.sin, torch.tensor([8]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_and_fused_residual_match_pytorch(ops, dtype, rows):
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96, generator=gen) + 0.5
    norm = norm.to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    residual = torch.randn(rows, 96, generator=gen).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), norm.reference(x), atol=TOL[dtype], rtol=TOL[dtype])
    out, summed = ops.add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, norm.reference(x + residual), atol=TOL[dtype], rtol=TOL[dtype])
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
    torch.testing.assert_close(ops.silu_and_mul(gate_up), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_disabled_falls_back_to_pytorch():
    with kernels.disabled():
        assert kernels.cpu_ops() is None and kernels.usable(torch.zeros(1)) is None
        norm = RMSNorm(8, 1e-6)
        x = torch.randn(2, 8)
        assert torch.equal(norm(x), norm.reference(x))


def test_packed_linear_matches_linear_and_packs_the_tied_head():
    from strata.layers.packed import packing_works

    if not packing_works():
        pytest.skip("oneDNN bf16 packing is not available on this CPU/torch build")
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Embedding(50, 24).to(torch.bfloat16)
    model.proj = torch.nn.Linear(24, 40, bias=True).to(torch.bfloat16)
    model.lm_head = None
    reference = model.proj
    x = torch.randn(3, 24).to(torch.bfloat16)
    expected = reference(x)
    assert pack_linears(model) == 2
    assert isinstance(model.proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    torch.testing.assert_close(model.proj(x).float(), expected.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(
        model.lm_head(x).float(), F.linear(x, model.embed_tokens.weight).float(), atol=0.05, rtol=0.02
    )
    with kernels.disabled():  # the switch covers packing too
        other = torch.nn.Module()
        other.proj = torch.nn.Linear(24, 40).to(torch.bfloat16)
        assert pack_linears(other) == 0


@pytest.mark.parametrize(
    "dtype,head_dim,heads,kv_heads,page_size",
    [
        (torch.float32, 64, 9, 3, 1),
        (torch.bfloat16, 64, 9, 3, 4),
        (torch.float16, 32, 4, 4, 1),
        (torch.float32, 128, 16, 1, 16),  # 16 query rows per KV head: row chunks of 4
    ],
)
def test_extend_attention_matches_oracle(ops, dtype, head_dim, heads, kv_heads, page_size):
    if not ops.has_simd():
        pytest.skip("the extend kernel needs AVX2 or AVX-512")
    gen = torch.Generator().manual_seed(4)
    q_lens, kv_lens = [1, 16, 17, 40, 5], [1, 16, 50, 200, 5]  # fresh and cached prefixes, block edges
    num_slots = 2048
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype)
    pages = random_pages(num_slots, len(kv_lens), max(kv_lens), page_size, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    q_start = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))])
    scale = head_dim**-0.5
    ops.extend_attention(
        out, q, k_cache, v_cache, pages, q_start, torch.tensor(q_lens), torch.tensor(kv_lens), page_size, scale
    )
    slots = [pages[b, torch.arange(n) // page_size] * page_size + torch.arange(n) % page_size for b, n in enumerate(kv_lens)]
    expected = reference_attention(q.float(), k_cache.float(), v_cache.float(), q_lens, slots, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOL[dtype], rtol=0)
    with pytest.raises(RuntimeError, match="more keys than pages"):
        ops.extend_attention(
            out, q, k_cache, v_cache, pages[:, :1].contiguous(), q_start, torch.tensor(q_lens), torch.tensor(kv_lens), page_size, scale
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
            ops.paged_attention(out, q, k_cache, v_cache, pages, torch.zeros(1, dtype=torch.int64),
                                torch.tensor([kv_len - 1]), 1, 0.125)
            expected = reference_attention(q.float(), k_cache.float(), v_cache.float(), [1], [pages[0]], 0.125)
            torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)
    finally:
        torch.set_num_threads(threads)


def test_a_build_for_an_isa_this_cpu_lacks_is_never_loaded(monkeypatch):
    """The check runs before building (target flags) and on the loaded module (its compiled ISA)."""

    class Built:
        @staticmethod
        def compiled_isa():
            return ["avx2", "fma", "avx512f", "avx512bf16"]

    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    assert kernels._checked(Built, "native") is None
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    assert kernels._checked(Built, "native") is Built
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2", "avx"}))
    assert not kernels.target_supported("x86-64-v3")
    monkeypatch.setattr(kernels, "_modules", {})
    assert kernels.load("x86-64-v3") is None  # refused before any build


def test_kernel_info_names_the_build_and_the_cpu(ops):
    info = kernels.kernel_info()
    assert info["cpu_kernels"] in kernels.TARGETS
    assert info["kernel_isa"] == list(ops.compiled_isa())
    assert {kernels.ISA_FLAGS[isa] for isa in info["kernel_isa"]} <= set(info["cpu_isa"])
    assert kernels.describe_kernels(info).startswith(info["cpu_kernels"])
