"""Weight-only int8/int4 linears: packing round trip, every fast path against the pure-torch reference,
the reference against the float linear, and quantized tiny models that still generate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_model
from torch import nn

from strata import Engine, SamplingParams
from strata.engine.batch import ScheduleBatch
from strata.engine.request import Req
from strata.layers import quant
from strata.layers.quant import (
    QUANT_METHODS,
    Int4Linear,
    Int8Linear,
    QuantLinear,
    TiedQuantHead,
    quantize_model,
    unpack_int4_cpu,
)

DTYPES = [torch.float32, torch.bfloat16]
# packed kernel vs reference (same integers and scales): fp32 accumulation order / one bf16 rounding
PARITY = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1.6e-2}}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_(0, 1.0)
    return lin.to(dtype)


@pytest.mark.parametrize("out_features", [16, 48, 64, 80, 192, 208])
def test_int4_unpack_inverts_torch_packing(out_features):
    """Our reading of the CPU int4 layout (full 64-row blocks, then the rest) matches torch's packer."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (out_features, 96), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(unpack_int4_cpu(packed, out_features, 96).t().to(torch.int32), q)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear], ids=["int8", "int4"])
def test_representable_weight_round_trips_exactly(cls):
    """A weight that is already on the quantization grid comes back bit for bit from dequantize()."""
    torch.manual_seed(0)
    n, k, g = 64, 128, 32
    if cls is Int8Linear:
        scales = torch.rand(n, 1) + 0.5
        q = torch.randint(-127, 128, (n, k)).float()
        q[:, 0] = 127  # the row's absmax sits on the top level
        weight = q * scales
    else:
        scales = (torch.rand(n, k // g, 1) + 0.5).bfloat16().float()
        lows = torch.randn(n, k // g, 1).bfloat16().float()
        q = torch.randint(0, 16, (n, k // g, g)).float()
        q[..., 0], q[..., 1] = 0, 15  # every group spans all 16 levels
        weight = (q * scales + lows).view(n, k)  # = (q - 8) * scale + (low + 8 * scale)
    layer = cls.from_weight(weight, group_size=g)
    torch.testing.assert_close(layer.dequantize(), weight, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", list(QUANT_METHODS))
@pytest.mark.parametrize("where", ["one row", "last packed", "first dequant"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_forward_matches_reference(dtype, method, where, bias):
    """forward (packed kernel up to packed_max_rows, dequant+matmul above) vs the float32 reference."""
    lin = linear(192, 96, dtype, bias)
    layer = QUANT_METHODS[method].from_weight(lin.weight, lin.bias)
    last = layer.packed_max_rows
    rows = {"one row": 1, "last packed": last, "first dequant": last + 1}[where]
    torch.manual_seed(1)
    x = torch.randn(rows, 192, dtype=dtype)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, layer.out_features)
    torch.testing.assert_close(out, layer.reference_forward(x), **PARITY[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method", list(QUANT_METHODS))
@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_both_paths_match_reference_at_any_row_count(dtype, method, chunked, monkeypatch):
    """208 output rows = 3 packed blocks of 64 + a 16-row rest; chunked: dequantized 64 rows at a time."""
    if chunked:
        monkeypatch.setattr(quant, "DEQUANT_CHUNK_NUMEL", 64 * 96)
    lin = linear(96, 208, dtype)
    layer = QUANT_METHODS[method].from_weight(lin.weight, group_size=32)
    torch.manual_seed(1)
    for rows in (1, 16, 64):
        x = torch.randn(rows, 96, dtype=dtype)
        want = layer.reference_forward(x)
        torch.testing.assert_close(layer.packed_mm(x), want, **PARITY[dtype])
        torch.testing.assert_close(layer.dequant_mm(x), want, **PARITY[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("method, max_err", [("int8", 0.01), ("int4", 0.12)])
def test_close_to_float_linear(dtype, method, max_err):
    """The quantization error itself (normal weights): int8 per channel ~0.6%, int4 in groups of 32 ~8%."""
    lin = linear(256, 128, dtype, bias=True)
    layer = QUANT_METHODS[method].from_weight(lin.weight, lin.bias)
    torch.manual_seed(1)
    x = torch.randn(3, 10, 256, dtype=dtype)  # leading dims are kept
    out = layer(x)
    assert out.shape == (3, 10, 128)
    assert rel_err(layer.dequantize(), lin.weight) < max_err
    assert rel_err(out - lin.bias, lin(x) - lin.bias) < max_err


def test_int4_smaller_groups_are_more_accurate():
    lin = linear(512, 64, torch.float32)
    errs = [
        rel_err(Int4Linear.from_weight(lin.weight, group_size=g).dequantize(), lin.weight)
        for g in (256, 128, 32)
    ]
    assert errs[0] > errs[1] > errs[2]


def test_input_dtype_may_differ_from_weight_dtype():
    """A bf16-quantized layer takes fp32 input: the scales are cast to the input dtype."""
    lin = linear(128, 64, torch.bfloat16)
    for cls in (Int8Linear, Int4Linear):
        layer = cls.from_weight(lin.weight)
        x = torch.randn(2, 128)
        torch.testing.assert_close(layer(x), layer.reference_forward(x), **PARITY[torch.bfloat16])


def test_int4_group_size_falls_back_to_a_divisor():
    """576 input channels (SmolLM2's hidden size) are not a multiple of 128: groups of 64 are used."""
    assert Int4Linear.from_weight(linear(576, 64, torch.float32).weight, group_size=128).group_size == 64
    assert Int4Linear.from_weight(linear(1536, 64, torch.float32).weight, group_size=128).group_size == 128
    with pytest.raises(ValueError, match="divisible by a group size"):
        Int4Linear.from_weight(linear(80, 64, torch.float32).weight)
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        Int4Linear.from_weight(linear(64, 40, torch.float32).weight)


# ---------------------------------------------------------------------------- whole models

PROMPTS = [[5, 17, 33, 91, 120, 7, 64, 200, 13], list(range(100, 200))]  # 100 rows > int4's packed_max_rows
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
        return engine.model.compute_logits(_hidden(engine, prompt))  # [len(prompt), vocab]


def _load_dequantized(engine: Engine, quantized: nn.Module) -> None:
    """Give `engine`'s float model the decoder weights `quantized` stands for (each QuantLinear's dequantize())."""
    with torch.no_grad():
        for name, layer in quantized.named_modules():
            if isinstance(layer, QuantLinear) and name.startswith("layers."):
                engine.model.get_submodule(name).weight.copy_(layer.dequantize())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_quantized_model_computes_its_dequantized_weights(tiny_models, family, method):
    """Every linear becomes a QuantLinear (the tied qwen2 gets a TiedQuantHead), and the model computes
    what the float model holding the dequantized weights computes: prefill (9 and 100 rows), logits of
    one row (the quantized output projection), and greedy decode (the packed kernels)."""
    model_dir = tiny_models[family]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    quantize_model(engine.model, method, group_size=32)
    assert [name for name, m in engine.model.named_modules() if isinstance(m, nn.Linear)] == []
    head = engine.model.lm_head
    assert isinstance(head, TiedQuantHead if family == "qwen2" else QuantLinear)
    head_weight = (head.quantized if family == "qwen2" else head).dequantize()
    if family == "qwen2":
        assert engine.model.layers[0].self_attn.qkv_proj.bias is not None
    ref = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    _load_dequantized(ref, engine.model)
    for prompt in PROMPTS:
        hidden, want = _hidden(engine, prompt), _hidden(ref, prompt)
        torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-4)
        with torch.inference_mode():
            logits = engine.model.compute_logits(hidden[-1:])
        torch.testing.assert_close(logits, F.linear(want[-1:], head_weight), atol=1e-4, rtol=1e-4)
    if family != "qwen2":  # ref's tied logits use the float table, the quantized model's decode does not
        with torch.no_grad():
            ref.model.lm_head.weight.copy_(head_weight)
        assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [
            r.token_ids for r in ref.generate(PROMPTS, GREEDY)
        ]


@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_tied_head_uses_the_quantized_copy_for_few_rows_and_the_table_for_many(method):
    torch.manual_seed(0)
    table = torch.randn(384, 64) * 0.05  # [vocab, hidden]
    quantized = QUANT_METHODS[method].from_weight(table, group_size=32)
    head = TiedQuantHead(quantized, table)
    few, many = torch.randn(quantized.dense_max_rows, 64), torch.randn(quantized.dense_max_rows + 1, 64)
    torch.testing.assert_close(head(few), quantized.reference_forward(few), **PARITY[torch.float32])
    torch.testing.assert_close(head(many), F.linear(many, table))
    assert head.embedding_weight.data_ptr() == table.data_ptr()  # the embedding's memory, not a copy
    assert [n for n, _ in head.named_parameters()] == []


# relative logits error against the unquantized model. These tiny random models are chaotic: bf16
# rounding alone moves their logits 1.4-2.5%; measured int8 2.7-4.9%, int4 (groups of 32) 34-49%.
MODEL_ERR = {"int8": 0.08, "int4": 0.7}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", list(QUANT_METHODS))
def test_quantized_model_stays_close_and_generates(tiny_models, dtype, method):
    ref = Engine(str(tiny_models["llama"]), dtype=dtype, kv_cache_tokens=512)
    engine = Engine(str(tiny_models["llama"]), dtype=dtype, kv_cache_tokens=512)
    quantize_model(engine.model, method, group_size=32)
    for prompt in PROMPTS:
        assert rel_err(_logits(engine, prompt), _logits(ref, prompt)) < MODEL_ERR[method]
    outs = engine.generate(PROMPTS, GREEDY)
    assert [len(o.token_ids) for o in outs] == [GREEDY.max_new_tokens] * len(PROMPTS)


def test_tied_embedding_can_stay_float_for_logits(tiny_models):
    engine = Engine(str(tiny_models["llama_tied_llama3"]), dtype="float32", kv_cache_tokens=512)
    quantize_model(engine.model, "int8", tied_lm_head=False)
    assert engine.model.lm_head is None
    assert isinstance(engine.model.layers[0].mlp.down_proj, Int8Linear)
    assert len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


def test_unquantizable_layers_stay_float(tmp_path, caplog):
    """int4 needs out_features % 16 == 0: a 40-wide kv projection stays nn.Linear, with a warning."""
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
        quantize_model(engine.model, "int4", group_size=32)
    assert "stay unquantized" in caplog.text
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, nn.Linear)
    assert isinstance(engine.model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


def test_unknown_method_is_rejected(tiny_models):
    engine = Engine(str(tiny_models["llama"]), dtype="float32", kv_cache_tokens=512)
    with pytest.raises(ValueError, match="one of"):
        quantize_model(engine.model, "int3")


def test_engine_quantization_option_quantizes_at_load(tiny_models):
    engine = Engine(str(tiny_models["qwen2"]), dtype="float32", kv_cache_tokens=512, quantization="int4")
    assert isinstance(engine.model.layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(engine.model.lm_head, TiedQuantHead)
    assert len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_new_tokens
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(str(tiny_models["qwen2"]), quantization="int3")


def test_config_choices_are_the_registry():
    from strata.config import QUANTIZATION_METHODS

    assert set(QUANTIZATION_METHODS) == set(QUANT_METHODS)
