"""Per-layer attention (sliding windows, Gemma's local/global RoPE, softcaps) and the families built
on it, exact against transformers past their windows: under chunked prefill whose chunks straddle
the window edge, page sizes 1 and 16, and prefix sharing through the radix cache."""

from __future__ import annotations

import pytest
import torch
from test_parity import hf_greedy, hf_model
from tiny_models import make_model

from strata import Engine, SamplingParams
from strata.model_config import ModelConfig
from strata.models import config_from_dir, config_from_hf

WINDOWED = [
    "mistral_sw",
    "qwen2_sw",
    "gemma2",
    "gemma3",
]  # tiny_models.FAMILIES, window 8
WINDOW = 8
# 30 and 23 tokens: several windows long; the second shares the first's 20-token prefix
LONG_PROMPTS = [
    [(7 * i + 3) % 380 + 2 for i in range(30)],
    [(7 * i + 3) % 380 + 2 for i in range(20)] + [11, 12, 13],
]
PARAMS = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_models):
    return {
        family: [
            hf_greedy(hf_model(tiny_models[family]), p, PARAMS.max_new_tokens)
            for p in LONG_PROMPTS
        ]
        for family in WINDOWED
    }


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize(
    "options",
    [
        # chunks of 5 and 3: chunk boundaries fall inside the window, so a chunk's early queries see
        # keys of the previous chunk and its later ones do not
        {"chunked_prefill_size": 5, "page_size": 1},
        {"chunked_prefill_size": 3, "page_size": 16},
    ],
    ids=str,
)
def test_greedy_past_the_window_equals_transformers(
    tiny_models, expected, family, options
):
    engine = Engine(
        str(tiny_models[family]), dtype="float32", kv_cache_tokens=1024, **options
    )
    got = [r.token_ids for r in engine.generate(LONG_PROMPTS, PARAMS)]
    assert got == expected[family]
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("family", ["mistral_sw", "gemma3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_hit_past_the_window_is_exact(tiny_models, expected, family, page_size):
    """The second prompt runs after the first finished: it reuses the cached 20-token prefix (longer
    than the window) and computes only its tail."""
    engine = Engine(
        str(tiny_models[family]),
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=page_size,
    )
    first = engine.generate([LONG_PROMPTS[0]], PARAMS)[0]
    second = engine.generate([LONG_PROMPTS[1]], PARAMS)[0]
    assert (
        second.cached_tokens == (20 // page_size) * page_size
    )  # 20 or 16 tokens: past the window
    assert [first.token_ids, second.token_ids] == expected[family]
    engine.scheduler.check_no_leaks()


# ---------------------------------------------------------------------------- KV by layer group


def _group_pages_in_use(engine) -> int:
    """Pages the (first) window group holds behind primary pages (split or shared pool alike)."""
    return int((engine.scheduler.allocator.groups[0].to_group >= 0).sum())


@pytest.mark.parametrize("family", ["gemma3", "mistral_sw"])
def test_window_layers_hold_about_a_window_per_request(tiny_models, family):
    """Without a prefix cache, a 200-token request's window layers never hold more than the window
    plus a chunk (and a few pages of slack), while its full layers hold all of it; its tokens are
    transformers' own."""
    model_dir = tiny_models[family]
    engine = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=512,
        page_size=2,
        chunked_prefill_size=6,
        disable_radix_cache=True,
    )
    assert engine.scheduler.allocator.groups[0].window == WINDOW
    prompt = [(5 * i + 1) % 380 + 2 for i in range(200)]
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    (_rid,) = engine.add_request(prompt, params)
    peak, tokens = 0, []
    while engine.scheduler.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
        peak = max(peak, _group_pages_in_use(engine))
        engine.scheduler.check_no_leaks()
    assert peak <= (WINDOW + 6) // 2 + 3
    assert tokens == hf_greedy(hf_model(model_dir), prompt, params.max_new_tokens)


def test_window_layers_full_layout_is_exact_too(tiny_models, expected):
    engine = Engine(
        str(tiny_models["gemma3"]),
        dtype="float32",
        kv_cache_tokens=1024,
        sliding_kv="full",
        chunked_prefill_size=5,
    )
    assert engine.scheduler.allocator.groups == ()
    got = [r.token_ids for r in engine.generate(LONG_PROMPTS, PARAMS)]
    assert got == expected["gemma3"]


@pytest.mark.parametrize("pool", ["split", "shared"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_small_window_pool_under_pressure_stays_exact(tiny_models, page_size, pool):
    """Many requests sharing prefixes and continuing earlier turns, through a pool too small to keep
    everything: the cache gives window KV back (interiors, then tails, or whole leaves when the pool
    is shared), requests are retracted when needed, every token is still transformers', no page of
    any group leaks."""
    model_dir = tiny_models["gemma3"]
    ref = hf_model(model_dir)
    engine = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=600 if pool == "split" else 300,
        page_size=page_size,
        chunked_prefill_size=7,
        swa_full_tokens_ratio=0.1,
        swa_pool=pool,
    )
    allocator = engine.scheduler.allocator
    assert allocator.shared == (pool == "shared") and len(allocator.groups) == (
        2 if allocator.shared else 1
    )
    if pool == "split":
        assert allocator.groups[0].num_pages < 600 // page_size
    system = [(3 * i + 5) % 380 + 2 for i in range(40)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [
        system + [(11 * i + j) % 380 + 2 for j in range(5 + i)] for i in range(6)
    ]
    first = engine.generate(prompts, params)
    for p, r in zip(prompts, first):
        assert r.token_ids == hf_greedy(ref, p, params.max_new_tokens)
    engine.scheduler.check_no_leaks()
    # second turns: each continues its first turn
    turns = [p + r.token_ids + [7, 8, 9] for p, r in zip(prompts, first)]
    second = engine.generate(turns, params)
    for p, r in zip(turns, second):
        assert r.token_ids == hf_greedy(ref, p, params.max_new_tokens)
    assert sum(r.cached_tokens for r in second) > 0
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_keeps_hitting_past_the_window(tiny_models, page_size):
    """Multi-turn and shared-prefix hits on a windowed model are what a full-attention model gets:
    turn 2 reuses all of turn 1 (prompt and answer), a new request reuses the shared system prompt."""
    model_dir = tiny_models["gemma3"]
    engine = Engine(
        str(model_dir), dtype="float32", kv_cache_tokens=1024, page_size=page_size
    )
    system = [(3 * i + 5) % 380 + 2 for i in range(40)]
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    turn1 = system + [20, 21, 22]
    r1 = engine.generate([turn1], params)[0]
    turn2 = turn1 + r1.token_ids + [30, 31]
    r2 = engine.generate([turn2], params)[0]
    done = len(turn1) + len(r1.token_ids) - 1  # the last sampled token was never fed
    assert r2.cached_tokens == done // page_size * page_size
    other = engine.generate([system + [40, 41]], params)[0]
    assert other.cached_tokens == len(system) // page_size * page_size
    ref = hf_model(model_dir)
    assert r2.token_ids == hf_greedy(ref, turn2, params.max_new_tokens)
    assert other.token_ids == hf_greedy(ref, system + [40, 41], params.max_new_tokens)
    engine.scheduler.check_no_leaks()


def test_a_prefill_chunk_waits_rather_than_evict_the_cached_window_tails(tiny_models):
    """Two long prompts prefill together through a window pool with room for one of them: the
    second waits for window pages instead of evicting the cached conversation's last window, so the
    conversation's next turn still resumes from all of it."""
    model_dir = tiny_models["gemma3"]
    engine = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=1000,
        page_size=1,
        chunked_prefill_size=9,
        swa_full_tokens_ratio=0.047,
        swa_pool="split",
    )
    # window 8: room for 3 cached turns' windows (from W / 4 and a page before each prompt's end to
    # its answer's end: 15 pages) and a prefill (8 + 9), not two prefills
    assert engine.scheduler.allocator.groups[0].num_pages == 47
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    turn1 = [(5 * i + 1) % 380 + 2 for i in range(30)]
    r1 = engine.generate([turn1], params)[0]
    others = [[(13 * i + k) % 380 + 2 for i in range(60)] for k in (3, 4)]
    ref = hf_model(model_dir)
    for p, r in zip(others, engine.generate(others, params)):
        assert r.token_ids == hf_greedy(ref, p, params.max_new_tokens)
    turn2 = turn1 + r1.token_ids + [30, 31]
    r2 = engine.generate([turn2], params)[0]
    assert r2.cached_tokens == len(turn1) + len(r1.token_ids) - 1
    assert r2.token_ids == hf_greedy(ref, turn2, params.max_new_tokens)
    engine.scheduler.check_no_leaks()


def _conversations(engine, firsts: list[list[int]], params: SamplingParams) -> list:
    """Each conversation's first turn (together), then each one's second turn (one at a time)."""
    r1 = engine.generate(firsts, params)
    seconds = [t + r.token_ids + [30, 31] for t, r in zip(firsts, r1)]
    return [(t2, engine.generate([t2], params)[0]) for t2 in seconds]


def test_a_shared_pool_keeps_the_conversations_a_split_one_loses(tiny_models):
    """Four cached conversations at the same KV memory: the split layout's fixed window pool (a
    tenth of the full layers' pages) cannot hold their last windows beside a running request's,
    so later turns lose hits; the shared pool gives the window layers what the workload needs and
    every second turn resumes from all of its first turn, with transformers' tokens."""
    model_dir = tiny_models["gemma3"]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    firsts = [[(7 * i + 3 * k) % 380 + 2 for i in range(40)] for k in (1, 2, 3, 4)]
    results = {}
    for pool in ("split", "shared"):
        engine = Engine(
            str(model_dir),
            dtype="float32",
            kv_cache_tokens=300,
            page_size=1,
            chunked_prefill_size=8,
            swa_full_tokens_ratio=0.1,
            swa_pool=pool,
        )
        results[pool] = (
            _conversations(engine, firsts, params),
            engine.scheduler.runner.kv.nbytes,
        )
        engine.scheduler.check_no_leaks()
    (split, split_bytes), (shared, shared_bytes) = results["split"], results["shared"]
    assert shared_bytes == split_bytes
    done = [
        len(t) - 2 - 1 for t, _ in shared
    ]  # turn 1 and its answer, less the last sampled token
    assert [r.cached_tokens for _, r in shared] == done
    assert sum(r.cached_tokens for _, r in split) < sum(done)
    ref = hf_model(model_dir)
    for (t, a), (_, b) in zip(shared, split):
        assert a.token_ids == b.token_ids == hf_greedy(ref, t, params.max_new_tokens)


def test_a_next_turn_that_re_tokenizes_the_answer_still_resumes_at_the_prompt_end(
    tiny_models,
):
    """Clients send the previous answer back as text, which may tokenize differently from the tokens
    generated: the next turn then diverges inside the cached chain, between the prompt's end and
    the answer's. Under pressure (interiors swept) it still resumes at the prompt's end, and a
    retry of the same prompt one token before it; tokens are transformers'."""
    model_dir = tiny_models["gemma3"]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    firsts = [[(7 * i + 3 * k) % 380 + 2 for i in range(40)] for k in (1, 2, 3, 4)]
    engine = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=300,
        page_size=1,
        chunked_prefill_size=8,
        swa_full_tokens_ratio=0.1,
    )
    engine.generate(firsts, params)
    retold = [t + [5, 6, 7, 30, 31] for t in firsts]  # not the answer it got
    ref = hf_model(model_dir)
    for t in retold:
        r = engine.generate([t], params)[0]
        assert r.cached_tokens == 40 and r.token_ids == hf_greedy(
            ref, t, params.max_new_tokens
        )
    assert engine.generate([firsts[3]], params)[0].cached_tokens == 39
    engine.scheduler.check_no_leaks()


@pytest.mark.parametrize("kv_tokens", [420, 460])
def test_a_system_prompt_is_resumed_by_its_first_other_question(tiny_models, kv_tokens):
    """Four 40-token system prompts, each cached with one question, then asked another question
    (shorter than the window): that request diverges at the system prompt's end, inside the chain
    the first cached, yet under pressure it resumes from all of the system prompt, with
    transformers' tokens (the window before a chain's guard goes last among its interiors)."""
    model_dir = tiny_models["gemma3"]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    systems = [[(7 * i + 3 * k) % 380 + 2 for i in range(40)] for k in (1, 2, 3, 4)]
    engine = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=kv_tokens,
        page_size=1,
        chunked_prefill_size=16,
        swa_full_tokens_ratio=0.1,
    )
    for s in systems:
        engine.generate([s + [11, 12, 13, 14, 15]], params)
    ref = hf_model(model_dir)
    for s in systems:
        t = s + [21, 22, 23, 24, 25]
        r = engine.generate([t], params)[0]
        assert r.cached_tokens == 40 and r.token_ids == hf_greedy(
            ref, t, params.max_new_tokens
        )
    engine.scheduler.check_no_leaks()


def _drop_cached_window_kv(engine) -> None:
    """Give back every window page the prefix cache holds, as memory pressure may."""
    cache, groups = engine.scheduler.cache, engine.scheduler.allocator.groups
    for g in groups:
        g.drop([p for n in cache._nodes() for p in n.value])


@pytest.mark.parametrize("page_size", [1, 4])
def test_swa_replay_is_exact_when_window_kv_needs_nothing_before_the_window(
    tmp_path, page_size
):
    """One window layer, at the bottom: its KV depends on the token alone, so recomputing the last
    W - 1 positions of a hit whose window KV is gone gives exactly transformers' tokens; without
    replay the same hit is unusable."""
    model = make_model(
        tmp_path / "g",
        "gemma3",
        tokenizer=False,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
    )
    ref = hf_model(model)
    system = [(3 * i + 5) % 380 + 2 for i in range(40)]
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    later = [system + [40 + i, 41, 42 + i] for i in range(3)]
    hits = {}
    for replay in (False, True):
        engine = Engine(
            str(model),
            dtype="float32",
            kv_cache_tokens=1024,
            page_size=page_size,
            chunked_prefill_size=5,
            swa_replay=replay,
        )
        engine.generate([system + [20, 21]], params)
        _drop_cached_window_kv(engine)
        results = engine.generate(
            later, params
        )  # together: replays run in one batch with decodes
        hits[replay] = [r.cached_tokens for r in results]
        if replay:
            for prompt, r in zip(later, results):
                assert r.token_ids == hf_greedy(ref, prompt, params.max_new_tokens)
        engine.scheduler.check_no_leaks()
        assert all(not r.replay_pages for r in engine.scheduler.reqs.values())
    assert hits[False][0] == 0
    # reported as cached: what no layer recomputes, the prefix before the replayed window
    assert hits[True][0] == (len(system) - WINDOW + 1) // page_size * page_size


def test_swa_replay_on_stacked_windows_runs_and_leaks_nothing(tiny_models):
    """Gemma 3's window layers above the first read a replayed position's hidden state, which saw
    only the replayed window: the KV is approximate there (documented), but the accounting holds."""
    engine = Engine(
        str(tiny_models["gemma3"]),
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=4,
        swa_replay=True,
    )
    system = [(3 * i + 5) % 380 + 2 for i in range(40)]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    engine.generate([system + [20, 21]], params)
    _drop_cached_window_kv(engine)
    results = engine.generate([system + [50, 51], system + [60]], params)
    assert all(
        r.cached_tokens == 32 and len(r.token_ids) == 8 for r in results
    )  # 40 matched, 8 replayed
    engine.scheduler.check_no_leaks()


def test_windowed_model_accepts_contexts_longer_than_its_window(tiny_models):
    """The old engine capped the context at the sliding window; now it is the model's full length."""
    model_dir = tiny_models["mistral_sw"]
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024)
    assert (
        engine.scheduler.context_len
        == config_from_dir(model_dir).max_position_embeddings
        == 512
    )
    prompt = [(5 * i + 1) % 380 + 2 for i in range(120)]
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    got = engine.generate([prompt], params)[0].token_ids
    assert got == hf_greedy(hf_model(model_dir), prompt, params.max_new_tokens)


def test_phi3_longrope_past_the_original_length(tmp_path):
    """Prompts within original_max_position_embeddings (16) use the short factors; decode steps past
    it the long ones, exactly like transformers' forward with its KV cache. (transformers' generate
    recomputes the whole sequence with the long factors at the crossing; strata keeps the cached
    keys, see strata.layers.rope.)"""
    model_dir = make_model(
        tmp_path / "phi3",
        "phi3",
        tokenizer=False,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.3, 1.9, 2.5],
            "long_factor": [1.1, 2.0, 4.5, 7.0],
            "original_max_position_embeddings": 16,
        },
        original_max_position_embeddings=16,
    )
    ref = hf_model(model_dir)
    prompt = [(7 * i + 3) % 380 + 2 for i in range(12)]
    with torch.no_grad():  # transformers' forward, one token at a time on its KV cache
        out = ref(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(15):
            pos = torch.tensor([[len(prompt) + len(tokens) - 1]])
            out = ref(
                torch.tensor([[tokens[-1]]]),
                past_key_values=out.past_key_values,
                position_ids=pos,
            )
            tokens.append(int(out.logits[0, -1].argmax()))
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=256)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == tokens


# ---------------------------------------------------------------------------- the spec from config.json


def _spec(**text) -> ModelConfig:
    base = {
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
    }
    base["num_attention_heads"] = 4
    return config_from_hf({**base, **text})


def test_gemma3_hub_config_layers_and_ropes():
    """An older Gemma 3 config.json (no layer_types, no rope_parameters): one full layer in
    `sliding_window_pattern`, local theta on sliding layers, global theta + scaling on full ones."""
    cfg = _spec(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        head_dim=16,
        sliding_window=512,
        sliding_window_pattern=3,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh",
    )
    assert [s.window for s in cfg.layers] == [512, 512, None, 512, 512, None]
    local, full = cfg.layers[0].rope, cfg.layers[2].rope
    assert (local.theta, local.rope_type) == (10_000.0, "default")
    assert (full.theta, full.rope_type, full.factor) == (1_000_000.0, "linear", 8.0)
    assert cfg.layers[0].scale == 256**-0.5
    assert (cfg.norm_layout, cfg.qk_norm) == ("sandwich", "head")
    assert cfg.norm_unit_offset and cfg.scale_embeddings
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings


def test_window_sources():
    mistral = _spec(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=4096
    )
    assert {s.window for s in mistral.layers} == {4096}
    qwen_off = _spec(
        model_type="qwen2",
        sliding_window=4096,
        use_sliding_window=False,
        max_window_layers=2,
    )
    assert {s.window for s in qwen_off.layers} == {None}
    qwen_on = _spec(
        model_type="qwen2",
        sliding_window=64,
        use_sliding_window=True,
        max_window_layers=2,
    )
    assert [s.window for s in qwen_on.layers] == [None, None, 64, 64, 64, 64]
    gemma2 = _spec(
        model_type="gemma2",
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    assert [s.window for s in gemma2.layers] == [4096, None] * 3
    assert {s.softcap for s in gemma2.layers} == {
        50.0
    } and gemma2.final_logit_softcap == 30.0
    olmo2 = _spec(model_type="olmo2")
    assert (olmo2.norm_layout, olmo2.qk_norm) == ("post", "full")
    with pytest.raises(ValueError, match="not supported"):
        _spec(
            model_type="llama", sliding_window=8, layer_types=["chunked_attention"] * 6
        )


# ---------------------------------------------------------------------------- GPT-OSS attention


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gpt_oss_attention_equals_transformers(layer_type):
    """GPT-OSS's attention (q/k/v/o biases, a learned sink per head, window 8, YaRN RoPE) against
    transformers' own module, fed chunk by chunk through the paged pool and then decoded token by
    token (its mixture-of-experts MLP comes with the MoE model, not here)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import (
        GptOssAttention,
        GptOssRotaryEmbedding,
    )

    from strata.cache.kv_pool import MHAKVPool
    from strata.layers.attention import AttentionMetadata
    from strata.layers.rope import RotaryEmbedding
    from strata.models.decoder import Attention

    torch.manual_seed(0)
    hf_cfg = GptOssConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=[layer_type, layer_type],
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 64,
            "truncate": False,
        },
    )
    hf_cfg._attn_implementation = "eager"
    cfg = config_from_hf(hf_cfg.to_dict())
    spec = cfg.layers[0]
    assert spec.sinks and spec.window == (
        WINDOW if layer_type == "sliding_attention" else None
    )
    ref = GptOssAttention(hf_cfg, 0).eval()
    with torch.no_grad():
        ref.sinks.normal_(0.0, 1.0)
        for lin in (ref.q_proj, ref.k_proj, ref.v_proj, ref.o_proj):
            lin.bias.normal_(0.0, 0.5)
    ours = Attention(cfg, 0).eval()
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(
            torch.cat([ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight])
        )
        ours.qkv_proj.bias.copy_(
            torch.cat([ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias])
        )
        ours.o_proj.weight.copy_(ref.o_proj.weight)
        ours.o_proj.bias.copy_(ref.o_proj.bias)
        ours.sinks.copy_(ref.sinks)

    total = 30
    x = torch.randn(total, 64)
    pos = torch.arange(total)
    i, j = pos.view(-1, 1), pos.view(1, -1)
    allowed = (j <= i) & ((i - j < WINDOW) if spec.window else True)
    mask = (
        torch.zeros(total, total)
        .masked_fill(~allowed, float("-inf"))
        .view(1, 1, total, total)
    )
    with torch.no_grad():
        cos_sin = GptOssRotaryEmbedding(hf_cfg)(x, pos.view(1, -1))
        expected = ref(x.unsqueeze(0), cos_sin, mask)[0][0]

    page_size = 4
    pool = MHAKVPool(
        [spec.window],
        cfg.num_kv_heads,
        cfg.head_dim,
        16,
        page_size,
        torch.float32,
        torch.device("cpu"),
    )
    page_table = torch.arange(8).view(1, -1)
    rope = RotaryEmbedding(
        spec.rope, cfg.head_dim, 256, cfg.max_position_embeddings, torch.device("cpu")
    )
    got, done = [], 0
    for n in [5, 5, 5, 3] + [
        1
    ] * 12:  # chunks across the window edge, then decode steps
        meta = AttentionMetadata.build(
            [n], [done + n], page_table, page_size, int(n == 1), torch.device("cpu")
        )
        with torch.no_grad():
            got.append(ours(x[done : done + n], meta.positions, rope, meta, pool))
        done += n
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)
