"""bf16 prefill attention on AMX bf16 tiles (extend_attention.cpp): its own arithmetic, so it is
checked for what the dot-product path promises (the oracle, a row's bits alone or in any batch or
chunking: test_attention.py and test_cpu_kernels.py run those on both paths through the
`extend_path` fixture), and here for the switch and what it records. Skipped without the tiles."""

from __future__ import annotations

import pytest
import torch

from strata import kernels
from strata.layers.attention import reference_attention


@pytest.fixture
def ops():
    module = kernels.cpu_ops()
    if module is None or not module.attention_tiles_available():
        pytest.skip("no AMX bf16 tiles here (build, CPU or OS)")
    saved = module.attention_tiles()
    yield module
    module.set_attention_tiles(saved)


def prompt(n: int, heads: int, kv_heads: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=gen).bfloat16()
    k = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
    v = torch.randn(n, kv_heads, dim, generator=gen).bfloat16()
    return q, k, v


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_the_switch_picks_the_arithmetic_and_both_are_attention(ops, dim):
    """The tiles sum their products in another order than the dot-product instruction, so the switch
    shows in the bits; both stay within bf16 rounding of the float32 oracle."""
    q, k, v = prompt(300, 6, 2, dim, seed=dim)
    gen = torch.Generator().manual_seed(1)
    table = torch.randperm(300, generator=gen)
    outs = {}
    for tiles in (True, False):
        ops.set_attention_tiles(tiles)
        assert ops.attention_tiles() == tiles
        assert kernels.kernel_info()["attention_tiles"] == tiles
        out = torch.full_like(q, float("nan"))
        k_cache, v_cache = torch.zeros_like(k), torch.zeros_like(v)
        k_cache[table], v_cache[table] = k, v
        ops.extend_attention(
            out,
            q,
            k_cache,
            v_cache,
            table.view(1, -1),
            torch.tensor([0]),
            torch.tensor([300]),
            torch.tensor([300]),
            1,
            dim**-0.5,
        )
        outs[tiles] = out
        ref = reference_attention(
            q.float(), k_cache.float(), v_cache.float(), [300], [table], dim**-0.5
        )
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
    assert not torch.equal(outs[True], outs[False])
    ops.set_attention_tiles(True)
    assert "AMX bf16 tiles: prefill attention" in kernels.describe_kernels(
        kernels.kernel_info()
    )


def test_float_and_odd_head_dims_keep_their_paths(ops):
    """The tiles take bf16 with head_dim % 32 == 0 only: float32, and bf16 with head_dim 48, give the
    same bits with the switch on or off."""
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 48)):
        q, k, v = (t.to(dtype) for t in prompt(70, 4, 2, dim, seed=3))
        got = []
        for tiles in (True, False):
            ops.set_attention_tiles(tiles)
            out = torch.empty_like(q)
            ops.extend_attention(
                out,
                q,
                k,
                v,
                torch.arange(70).view(1, -1),
                torch.tensor([0]),
                torch.tensor([70]),
                torch.tensor([70]),
                1,
                0.1,
            )
            got.append(out)
        assert torch.equal(got[0], got[1]), (dtype, dim)


def test_the_environment_switches_them_off(ops, monkeypatch):
    monkeypatch.setenv(kernels.ATTENTION_TILES_ENV, "off")
    kernels._apply_attention_tiles_env(ops)
    assert not ops.attention_tiles()
    assert kernels.kernel_info()["attention_tiles"] is False


def test_switching_on_where_they_cannot_run_is_an_error():
    module = (
        kernels.load("x86-64-v3") if kernels.target_supported("x86-64-v3") else None
    )
    if module is None:
        pytest.skip("no AVX2 build here")
    assert not module.attention_tiles_available()
    with pytest.raises(RuntimeError, match="not available"):
        module.set_attention_tiles(True)
    module.set_attention_tiles(False)  # off is always fine
    assert not module.attention_tiles()


def climbing_prompt(n: int, heads: int, kv_heads: int, dim: int, seed: int):
    """A prompt whose scores climb along it (the keys lean further along one direction the later they
    come, the queries along it too): every row's max moves past the kernel's rescale slack several
    times, in every 512-key span of the tiles."""
    q, k, v = prompt(n, heads, kv_heads, dim, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.randn(dim, generator=gen)
    u = u / u.norm()
    ramp = torch.linspace(0.0, 6.0, n)[:, None, None]
    k = (k.float() + ramp * u).bfloat16()
    q = (q.float() + 8 * dim**0.5 * u).bfloat16()  # scores climb by ~48 over the prompt
    return q, k, v


def tile_call(ops, q, k, v, q_len: int, kv_len: int, **options):
    out = torch.full_like(q, float("nan"))
    ops.extend_attention(
        out,
        q,
        k,
        v,
        torch.arange(k.shape[0]).view(1, -1),
        torch.tensor([0]),
        torch.tensor([q_len]),
        torch.tensor([kv_len]),
        1,
        q.shape[-1] ** -0.5,
        **options,
    )
    return out


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize(
    "options",
    [{}, {"window": 700, "softcap": 30.0}, {"sinks": True}],
    ids=["plain", "window-softcap", "sinks"],
)
def test_long_prompts_with_climbing_scores_match_the_oracle(ops, dim, options):
    """Three spans of key tiles, heads wider than the 64 dims the output tiles hold (the later
    passes replay the first's probabilities and rescales), and maxima that move: within bf16
    rounding of the float32 oracle."""
    ops.set_attention_tiles(True)
    n = 1100
    q, k, v = climbing_prompt(n, 4, 2, dim, seed=dim)
    kernel_options = dict(options)
    oracle_options = {
        "window": options.get("window"),
        "softcap": options.get("softcap"),
    }
    if options.get("sinks"):
        sinks = torch.tensor(
            [0.5, 30.0, -2.0, 60.0]
        )  # one above every score of its rows
        kernel_options["sinks"] = oracle_options["sinks"] = sinks
    out = tile_call(ops, q, k, v, n, n, **kernel_options)
    # the attention leans on few keys here, so outputs reach a value's size (~4): rtol for the bf16
    # rounding of the probabilities and of the output
    ref = reference_attention(
        q.float(),
        k.float(),
        v.float(),
        [n],
        [torch.arange(n)],
        dim**-0.5,
        **oracle_options,
    )
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dim", [64, 128])
def test_a_rows_bits_do_not_depend_on_chunking_or_item_size(ops, dim):
    """The same rows as one 1,100-token prefill (items of 256 rows), as a 700-token prefill and a
    400-token chunk after it, and as single tokens (items of 64 rows) give the same bits: a row's
    reference max moves on its own scores, and span and tile edges sit at fixed positions."""
    ops.set_attention_tiles(True)
    n = 1100
    q, k, v = climbing_prompt(n, 4, 2, dim, seed=7)
    whole = tile_call(ops, q, k, v, n, n)
    head = tile_call(ops, q[:700].contiguous(), k, v, 700, 700)
    tail = tile_call(ops, q[700:].contiguous(), k, v, 400, n)
    assert torch.equal(head, whole[:700])
    assert torch.equal(tail, whole[700:])
    for i in (0, 511, 512, 545, 1099):
        alone = tile_call(ops, q[i : i + 1].contiguous(), k, v, 1, i + 1)
        assert torch.equal(alone, whole[i : i + 1]), i
