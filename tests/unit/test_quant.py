"""Block-quantized linears (q4, q8): the formats, the native kernel (AVX2 and scalar builds) against
its torch emulation, the fallback path against the float32 reference, GGUF's types converted without
loss, and quantized tiny models that still compute what their dequantized weights say."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from tiny_models import make_model
from torch import nn

from strata import Engine, SamplingParams, kernels
from strata.engine.batch import ScheduleBatch
from strata.engine.request import Req
from strata.layers import quant
from strata.layers.packed import DenseLinear
from strata.layers.quant import (
    QUANT_METHODS,
    ConcatLinear,
    Q4Linear,
    Q8Linear,
    QuantLinear,
    concat_rows,
    quantize_model,
)
from strata.weights.gguf_blocks import to_blocks

DTYPES = [torch.float32, torch.bfloat16]
# kernel vs its emulation (same integers): float accumulation order / one bf16 rounding of the output
PARITY = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2},
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def linear(
    in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False
) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 1.0)
    return lin.to(dtype)


def random_layer(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantLinear:
    """Arbitrary blocks: every nibble / int8 value, scales and offsets of either sign; a format
    ending in "h" has scales that are exact float16 values (stored so, as GGUF's are)."""
    half = fmt.endswith("h")
    fmt = fmt.removesuffix("h")

    def scales(t: torch.Tensor) -> torch.Tensor:
        return t.half().float() if half else t

    if fmt == "q4":
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        d, m = (
            torch.rand(n, k // 32, generator=gen) * 0.1,
            torch.randn(n, k // 32, generator=gen) * 0.1,
        )
        layer = Q4Linear(qs, scales(d), scales(m))
    else:
        group = 32 if fmt == "q8" else 16
        qs = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        layer = Q8Linear(qs, scales(torch.randn(n, k // group, generator=gen) * 0.01))
    assert layer.d.dtype == (torch.float16 if half else torch.float32)
    return layer


FORMATS = ["q4", "q8", "q8/16", "q4h", "q8h", "q8/16h"]


@pytest.fixture(params=["native", "x86-64-v3", "x86-64-v4"])
def build(request):
    """Each kernel build this CPU can run (on an AVX-512 machine: AVX2, and AVX-512 without VNNI)."""
    if not kernels.target_supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    module = kernels.load(request.param)
    if module is None:
        pytest.skip("the CPU kernels could not be built here (no compiler?)")
    with kernels.using(request.param) as ops:
        yield ops


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 19, 70])
@pytest.mark.parametrize("k", [576, 608, 32])
def test_kernel_matches_its_emulation(build, fmt, rows, k):
    """The int8 dot-product kernel computes exactly the emulated arithmetic (up to float sum order),
    for every tile size (1 to 9 rows, AVX2's and AVX-512's), row counts split into several tiles
    (10, 17, 19) and past its 64-row blocks (70), block counts even, odd and one, and
    130 weight rows: the last group of 16 is partly padding, which no output may show."""
    gen = torch.Generator().manual_seed(rows)
    layer = random_layer(fmt, 130, k, gen)
    x = torch.randn(rows, k, generator=gen)
    want = layer.emulated_mm(x)
    got = layer.kernel_mm(build, x)
    torch.testing.assert_close(
        got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-5
    )


@pytest.mark.parametrize("fmt", ["q4", "q8h"])
@pytest.mark.parametrize("k", [32 * 16, 32 * 19, 32 * 33])
def test_each_activation_block_keeps_its_own_scale(build, fmt, k):
    """Activation blocks 8^0 .. 8^6 apart (blocks of 32 channels, quantized 16 at a time): a block
    given a neighbour's scale would saturate or lose its codes, far outside the emulation's rounding."""
    gen = torch.Generator().manual_seed(k)
    layer = random_layer(fmt, 48, k, gen)
    x = torch.randn(5, k, generator=gen) * 8.0 ** (torch.arange(k) // 32 % 7).float()
    want = layer.emulated_mm(x)
    torch.testing.assert_close(
        layer.kernel_mm(build, x), want, atol=1e-5 * want.abs().max().item(), rtol=0
    )


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_with_and_without_kernels(build, fmt, dtype):
    """forward: the kernel (int8 activations) is within activation-quantization error of the float
    reference; without kernels the chunked dequant path equals the reference."""
    gen = torch.Generator().manual_seed(3)
    layer = random_layer(fmt, 96, 192, gen)
    x = torch.randn(2, 5, 192, generator=gen).to(dtype)  # leading dims are kept
    out = layer(x)
    assert out.dtype == dtype and out.shape == (2, 5, 96)
    torch.testing.assert_close(out, layer.emulated_forward(x), **PARITY[dtype])
    assert rel_err(out, layer.reference_forward(x)) < 0.02
    with kernels.disabled():  # bf16: the weights are rounded to bf16 for the matmul
        assert rel_err(layer(x), layer.reference_forward(x)) < (
            1e-6 if dtype == torch.float32 else 1e-2
        )


# Bad arguments: each raises a RuntimeError naming the argument and the sizes it needs, before any
# pointer arithmetic. A case: the call, given a valid q4 and q8 layer of 64 x 64, and a message fragment.
BAD_CALLS = {
    "K not a multiple of 32": (
        lambda ops, q4, q8: ops.q4_linear(torch.randn(1, 48), q4.qp, q4.dp, q4.mp, 64),
        "K (48) must be a multiple of 32",
    ),
    "x's K unlike the weight's": (
        lambda ops, q4, q8: ops.q4_linear(torch.randn(1, 96), q4.qp, q4.dp, q4.mp, 64),
        "qp must be [4, 3, 4, 16, 4], got [4, 2, 4, 16, 4]",
    ),
    "scale groups unlike the weight's": (
        lambda ops, q4, q8: ops.q4_linear(
            torch.randn(1, 64), q4.qp, q4.dp[:1].contiguous(), q4.mp, 64
        ),
        "dp must be [4, 2, 16], got [1, 2, 16]",
    ),
    "N beyond the groups": (
        lambda ops, q4, q8: ops.q4_linear(torch.randn(1, 64), q4.qp, q4.dp, q4.mp, 65),
        "N (65) must be within the 4 groups of 16 rows of qp",
    ),
    "N a group short": (
        lambda ops, q4, q8: ops.q8_linear(torch.randn(1, 64), q8.qp, q8.dp, 48),
        "N (48) must be within the 4 groups of 16 rows of qp",
    ),
    "q8 scales per 8 channels": (
        lambda ops, q4, q8: ops.q8_linear(
            torch.randn(1, 64), q8.qp, torch.zeros(4, 2, 4, 16), 64
        ),
        "dp must be [G, K / 32, 32 / S, 16] with S = 16 or 32, got sizes [4, 2, 4, 16]",
    ),
    "q8 weight blocks unlike K": (
        lambda ops, q4, q8: ops.q8_linear(
            torch.randn(1, 64), q8.qp[:, :1].contiguous(), q8.dp, 64
        ),
        "qp must be [4, 2, 8, 16, 4], got [4, 1, 8, 16, 4]",
    ),
    "q4 blocks stored as int8": (
        lambda ops, q4, q8: ops.q4_linear(
            torch.randn(1, 64), q4.qp.view(torch.int8), q4.dp, q4.mp, 64
        ),
        "qp must be Byte, got Char",
    ),
    "float64 scales": (
        lambda ops, q4, q8: ops.q8_linear(
            torch.randn(1, 64), q8.qp, q8.dp.double(), 64
        ),
        "dp must be float32 or float16, got Double",
    ),
    "q4 scales and offsets of two dtypes": (
        lambda ops, q4, q8: ops.q4_linear(
            torch.randn(1, 64), q4.qp, q4.dp.half(), q4.mp, 64
        ),
        "dp (Half) and mp (Float) must share a dtype",
    ),
    "integer x": (
        lambda ops, q4, q8: ops.q8_linear(
            torch.ones(1, 64, dtype=torch.int32), q8.qp, q8.dp, 64
        ),
        "x must be float32, bfloat16, float16 or float64, got Int",
    ),
    "x not 2-d": (
        lambda ops, q4, q8: ops.q4_linear(torch.randn(64), q4.qp, q4.dp, q4.mp, 64),
        "x must be [rows, K], got sizes [64]",
    ),
    "x not contiguous": (
        lambda ops, q4, q8: ops.q4_linear(
            torch.randn(64, 2).t(), q4.qp, q4.dp, q4.mp, 64
        ),
        "x must be contiguous",
    ),
    "weight not contiguous": (
        lambda ops, q4, q8: ops.q8_linear(
            torch.randn(1, 64), q8.qp.transpose(1, 2), q8.dp, 64
        ),
        "qp must be contiguous",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_kernel_rejects_bad_arguments(build, case):
    call, message = BAD_CALLS[case]
    gen = torch.Generator().manual_seed(0)
    q4, q8 = random_layer("q4", 64, 64, gen), random_layer("q8", 64, 64, gen)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call(build, q4, q8)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_path_matches_reference_at_any_size(fmt, chunked, monkeypatch):
    if chunked:
        monkeypatch.setattr(quant, "DEQUANT_CHUNK_NUMEL", 16 * 96)
    layer = random_layer(fmt, 208, 96, torch.Generator().manual_seed(1))
    x = torch.randn(7, 96)
    torch.testing.assert_close(
        layer.dequant_mm(x), layer.reference_forward(x), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("cls", [Q8Linear, Q4Linear], ids=["int8", "int4"])
def test_representable_weight_round_trips_exactly(cls):
    """A weight already on the block grid comes back bit for bit from dequantize()."""
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 128
    if cls is Q8Linear:
        scales = torch.rand(n, k // 32, 1, generator=gen) + 0.5
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
        q[..., 0] = 127  # the block's absmax sits on the top level
        weight = (q * scales).view(n, k)
    else:
        scales = torch.rand(n, k // 32, 1, generator=gen) + 0.5
        lows = torch.randn(n, k // 32, 1, generator=gen)
        q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
        q[..., 0], q[..., 1] = 0, 15  # every block spans all 16 levels
        weight = (q * scales + lows).view(n, k)
    layer = cls.from_weight(weight)
    torch.testing.assert_close(layer.dequantize(), weight, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method, max_err", [("int8", 0.01), ("int4", 0.12)])
def test_close_to_float_linear(dtype, method, max_err):
    """The quantization error itself (normal weights): int8 ~0.5%, int4 in blocks of 32 ~8%."""
    lin = linear(256, 128, dtype, bias=True)
    layer = QUANT_METHODS[method].from_weight(lin.weight, lin.bias)
    x = torch.randn(3, 10, 256, dtype=dtype)
    out = layer(x)
    assert out.shape == (3, 10, 128)
    assert rel_err(layer.dequantize(), lin.weight) < max_err
    assert rel_err(out - lin.bias, lin(x) - lin.bias) < max_err + 0.02


def test_shapes_that_cannot_be_blocked_are_refused():
    with pytest.raises(ValueError, match="divisible by 32"):
        Q4Linear.from_weight(torch.randn(16, 80))
    with pytest.raises(ValueError, match="divisible by 32"):
        Q8Linear.from_weight(torch.randn(16, 40))


def test_concat_rows_merges_one_format_and_joins_mixed_ones():
    gen = torch.Generator().manual_seed(2)
    a, b, c = (
        random_layer("q4", 32, 64, gen),
        random_layer("q4", 16, 64, gen),
        random_layer("q8/16", 16, 64, gen),
    )
    x = torch.randn(3, 64, generator=gen)
    merged = concat_rows([a, b])
    assert isinstance(merged, Q4Linear) and merged.out_features == 48
    torch.testing.assert_close(
        merged.dequantize(), torch.cat([a.dequantize(), b.dequantize()])
    )
    mixed = concat_rows([a, c], bias=torch.ones(48))
    assert isinstance(mixed, ConcatLinear)
    torch.testing.assert_close(mixed(x), torch.cat([a(x), c(x)], dim=1) + 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_packed_layout_gives_the_row_major_blocks_back(fmt):
    """The kernels' layout (16 rows interleaved, padded to a whole group) round-trips the blocks it
    was built from, and its groups hold what the layout says."""
    gen = torch.Generator().manual_seed(6)
    layer = random_layer(fmt, 37, 96, gen)
    again = (
        Q4Linear(layer.qs, layer.d, layer.m)
        if fmt.startswith("q4")
        else Q8Linear(layer.qs, layer.d)
    )
    assert torch.equal(again.qp, layer.qp) and torch.equal(again.dp, layer.dp)
    quads = 4 if fmt.startswith("q4") else 8
    assert layer.qp.shape == (3, 3, quads, 16, 4)
    row, block, quad = 21, 2, 1  # group 1, lane 5
    assert torch.equal(
        layer.qp[1, block, quad, 5], layer.qs[row, block * quads * 4 + quad * 4 :][:4]
    )
    assert not layer.qp[2, :, :, 5:].any()  # rows 37.. of the last group are zeros


def test_gather_rows_is_an_embedding_lookup():
    gen = torch.Generator().manual_seed(4)
    for fmt in FORMATS:
        layer = random_layer(fmt, 50, 64, gen)
        ids = torch.tensor([3, 0, 49, 3])
        torch.testing.assert_close(layer.gather_rows(ids), layer.dequantize()[ids])


# ---------------------------------------------------------------------------- GGUF types

_GGUF_BLOCK = {
    Q.Q4_0: (18, 32, [0]),
    Q.Q4_1: (20, 32, [0, 2]),
    Q.Q8_0: (34, 32, [0]),
    Q.Q4_K: (144, 256, [0, 2]),
    Q.Q6_K: (210, 256, [208]),
}


def random_gguf(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in `qtype`'s layout, with finite float16 scales."""
    size, per, f16_offsets = _GGUF_BLOCK[qtype]
    raw = rng.integers(0, 256, (rows, cols // per, size), dtype=np.uint8)
    for off in f16_offsets:
        scale = (rng.standard_normal((rows, cols // per)) * 0.1).astype(np.float16)
        raw[..., off : off + 2] = scale.view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(_GGUF_BLOCK), ids=lambda q: q.name)
def test_gguf_types_convert_without_loss(qtype):
    """Our blocks dequantize to exactly what gguf-py's reference dequantizer reads from the bytes."""
    rows, cols = 6, 512
    raw = random_gguf(qtype, rows, cols, np.random.default_rng(int(qtype)))
    want = torch.from_numpy(
        gguf_dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    )
    blocks = {
        k: torch.from_numpy(v) for k, v in to_blocks(raw, qtype, rows, cols).items()
    }
    layer = Q4Linear(**blocks) if "m" in blocks else Q8Linear(**blocks)
    assert torch.equal(layer.dequantize(), want)


def test_types_without_a_block_format_load_dequantized():
    assert to_blocks(np.zeros((2, 64), np.float32), Q.F32, 2, 64) is None
    assert to_blocks(np.zeros((2, 48), np.uint8), Q.Q5_1, 2, 64) is None


# ---------------------------------------------------------------------------- whole models

PROMPTS = [[5, 17, 33, 91, 120, 7, 64, 200, 13], list(range(100, 200))]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def _hidden(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """Final hidden states of every prompt position through the engine's model: [len(prompt), hidden]."""
    req = Req(rid="probe", prompt_ids=list(prompt), params=SamplingParams())
    runner = engine.scheduler.runner
    assert engine.scheduler._alloc_for(req, len(prompt))
    fb = runner.prepare(ScheduleBatch([req], [len(prompt)], 0))
    with torch.inference_mode():
        hidden = engine.model(fb.input_ids, fb.positions, fb.attn, runner.kv)
    engine.scheduler.allocator.free(req.pages)
    return hidden


def _logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.model.compute_logits(
            _hidden(engine, prompt)
        )  # [len(prompt), vocab]


def _load_dequantized(engine: Engine, quantized: nn.Module) -> None:
    """Give `engine`'s float model the weights `quantized` stands for (each QuantLinear's dequantize())."""
    with torch.no_grad():
        for name, layer in quantized.named_modules():
            if isinstance(layer, QuantLinear) and (
                name.startswith("layers.") or name == "lm_head"
            ):
                target = (
                    engine.model.get_submodule(name)
                    if engine.model.lm_head is not None or name != "lm_head"
                    else None
                )
                if target is not None:
                    target.weight.copy_(layer.dequantize())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_quantized_model_computes_its_dequantized_weights(tiny_models, family, method):
    """Every linear becomes a QuantLinear (the tied qwen2 gets a quantized copy as lm_head). Without
    kernels the model computes exactly what the float model holding the dequantized weights computes
    (prefill of 9 and 100 rows, logits, greedy decode); with them it stays within the int8 rounding
    of the activations."""
    model_dir = tiny_models[family]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    quantize_model(engine.model, method)
    assert [
        name
        for name, m in engine.model.named_modules()
        if isinstance(m, (nn.Linear, DenseLinear))
    ] == []
    head = engine.model.lm_head
    assert isinstance(head, QuantLinear)
    if family == "qwen2":
        assert engine.model.layers[0].self_attn.qkv_proj.bias is not None
    with (
        kernels.disabled()
    ):  # plain nn.Linear weights, for _load_dequantized to overwrite
        ref = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    _load_dequantized(ref, engine.model)
    head_weight = head.dequantize()
    with kernels.disabled():
        for prompt in PROMPTS:
            hidden, want = _hidden(engine, prompt), _hidden(ref, prompt)
            torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
            with torch.inference_mode():
                logits = engine.model.compute_logits(hidden[-1:])
            torch.testing.assert_close(
                logits, F.linear(want[-1:], head_weight), atol=1e-4, rtol=1e-4
            )
        if family != "qwen2":
            with torch.no_grad():
                ref.model.lm_head.weight.copy_(head_weight)
            assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [
                r.token_ids for r in ref.generate(PROMPTS, GREEDY)
            ]
    for prompt in PROMPTS:  # the kernels: int8 activations
        assert rel_err(_hidden(engine, prompt), _hidden(ref, prompt)) < 0.05


# relative logits error against the unquantized model. These tiny random models are chaotic: bf16
# rounding alone moves their logits 1.4-2.5%; int4 in blocks of 32 moves them much more.
MODEL_ERR = {"int8": 0.08, "int4": 0.7}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_quantized_model_stays_close_and_generates(tiny_models, dtype, method):
    ref = Engine(str(tiny_models["llama"]), dtype=dtype, kv_cache_tokens=512)
    engine = Engine(str(tiny_models["llama"]), dtype=dtype, kv_cache_tokens=512)
    quantize_model(engine.model, method)
    for prompt in PROMPTS:
        assert (
            rel_err(_logits(engine, prompt), _logits(ref, prompt)) < MODEL_ERR[method]
        )
    outs = engine.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [GREEDY.max_new_tokens] * len(PROMPTS)


def test_tied_embedding_can_stay_float_for_logits(tiny_models):
    engine = Engine(
        str(tiny_models["llama_tied_llama3"]), dtype="float32", kv_cache_tokens=512
    )
    quantize_model(engine.model, "int8", tied_lm_head=False)
    assert not isinstance(
        engine.model.lm_head, QuantLinear
    )  # the embedding, or the loader's packed copy
    assert isinstance(engine.model.layers[0].mlp.down_proj, Q8Linear)
    assert (
        len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_new_tokens
    )


def test_unquantizable_layers_stay_float(tmp_path, caplog):
    """Blocks need in_features % 32 == 0: o_proj over 4 heads of 12 (48 inputs) stays nn.Linear."""
    model_dir = make_model(
        tmp_path / "odd",
        "llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        intermediate_size=96,
    )
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    with caplog.at_level("WARNING", logger="strata.layers.quant"):
        quantize_model(engine.model, "int4")
    assert "stay unquantized" in caplog.text
    assert isinstance(engine.model.layers[0].self_attn.o_proj, (nn.Linear, DenseLinear))
    assert isinstance(engine.model.layers[0].mlp.gate_up_proj, Q4Linear)
    assert (
        len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_new_tokens
    )


def test_unknown_method_is_rejected(tiny_models):
    engine = Engine(str(tiny_models["llama"]), dtype="float32", kv_cache_tokens=512)
    with pytest.raises(ValueError, match="one of"):
        quantize_model(engine.model, "int3")


def test_engine_quantization_option_quantizes_at_load(tiny_models):
    engine = Engine(
        str(tiny_models["qwen2"]),
        dtype="float32",
        kv_cache_tokens=512,
        quantization="int4",
    )
    assert isinstance(engine.model.layers[0].mlp.down_proj, Q4Linear)
    assert isinstance(engine.model.lm_head, Q4Linear)
    assert "q4" in engine.state.weights
    assert (
        len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_new_tokens
    )
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(str(tiny_models["qwen2"]), quantization="int3")
    with pytest.raises(ValueError, match="no GGUF blocks"):
        Engine(str(tiny_models["qwen2"]), quantization="gguf")


def test_config_choices_cover_the_quantizers():
    from strata.config import QUANTIZATION_METHODS

    assert set(QUANT_METHODS) < set(QUANTIZATION_METHODS)


@pytest.mark.parametrize("fmt", ["q4", "q8/16h"])
def test_a_row_computes_the_same_in_any_call(build, fmt):
    """The kernel takes every row, decode or prefill: a row's output is the same bits alone, in a
    short call or in a long one (a prefill chunk beside decodes, any other chunks, in any order), so a
    request's logits and KV never depend on what shares its step or how its prompt is chunked."""
    gen = torch.Generator().manual_seed(8)
    layer = random_layer(fmt, 48, 96, gen)
    x = torch.randn(150, 96, generator=gen)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(layer(x), alone)
    for perm in (torch.randperm(150, generator=gen), torch.arange(149, -1, -1)):
        assert torch.equal(layer(x[perm]), alone[perm])
    for start, end in ((0, 3), (3, 40), (40, 150), (17, 18)):
        assert torch.equal(layer(x[start:end]), alone[start:end])
    torch.testing.assert_close(
        layer(x), layer.emulated_forward(x), **PARITY[torch.float32]
    )
