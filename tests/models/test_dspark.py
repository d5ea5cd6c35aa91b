"""DSpark block drafting (`--speculative-algorithm dspark`) against DeepSpec's drafter math, written
here over transformers' Qwen3 modules (`RefDSpark`, saved in DeepSpec's checkpoint layout) and fed
with transformers' own hidden states of a tiny target: the blocks drafted after a chunked prefill,
after verification steps and after native decode steps equal the oracle's, with each Markov head and
the confidence head; greedy output is unchanged under chunked prefill, radix hits, page sizes 1 and
16, retraction and PD; the confidence threshold cuts blocks where the head says; the drafter's pages
come back with its requests; bad checkpoints are refused with what to fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_parity import PROMPTS, hf_greedy, hf_model
from tiny_models import make_model
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from strata import Engine, SamplingParams
from strata.engine.draft_policy import Candidate, DraftPolicy

TARGET_LAYERS = 4
BLOCK = 4
MASK = 383  # the last id of the tiny vocabulary


def draft_config(**dspark) -> Qwen3Config:
    cfg = Qwen3Config(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    cfg.architectures = ["Qwen3DSparkModel"]
    fields = dict(
        target_layer_ids=[-1, 1, 2],
        num_target_layers=TARGET_LAYERS,
        block_size=BLOCK,
        mask_token_id=MASK,
        num_anchors=64,
        markov_rank=8,
        markov_head_type="vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=True,
    )
    fields.update(dspark)
    for k, v in fields.items():
        setattr(cfg, k, v)
    return cfg


class RefAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.d = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=cfg.rms_norm_eps)

    def forward(self, x, context, cos, sin):
        """DeepSpec's Qwen3DSparkAttention, one sequence: x [B, H] block rows, context [C, H];
        cos/sin over the C + B positions."""
        n, c = x.shape[0], context.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.d)).transpose(0, 1)
        k = torch.cat([self.k_proj(context), self.k_proj(x)]).view(
            c + n, self.kv_heads, self.d
        )
        v = torch.cat([self.v_proj(context), self.v_proj(x)]).view(
            c + n, self.kv_heads, self.d
        )
        k = self.k_norm(k).transpose(0, 1)
        v = v.transpose(0, 1)
        q = q * cos[-n:] + rotate_half(q) * sin[-n:]
        k = k * cos + rotate_half(k) * sin
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        probs = ((q @ k.transpose(1, 2)) * self.d**-0.5).softmax(-1)  # no mask
        return self.o_proj((probs @ v).transpose(0, 1).reshape(n, -1))


class RefLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = RefAttention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(
            cfg.hidden_size, eps=cfg.rms_norm_eps
        )

    def forward(self, x, context, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefMarkov(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        r, h, v = cfg.markov_rank, cfg.hidden_size, cfg.vocab_size
        self.kind = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(v, r)
        self.markov_w2 = nn.Linear(r, v, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(h + r, r)
        if self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + h, 3 * r)


class RefConfidence(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, 1)


class RefDSpark(nn.Module):
    """DeepSpec's Qwen3DSparkModel at inference, for one sequence (its parameter names)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(RefLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(cfg)
        self.fc = nn.Linear(
            len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False
        )
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.markov_head = RefMarkov(cfg) if cfg.markov_rank else None
        if cfg.enable_confidence_head:
            width = cfg.hidden_size + (
                cfg.markov_rank if cfg.confidence_head_with_markov else 0
            )
            self.confidence_head = RefConfidence(width)
        else:
            self.confidence_head = None

    def markov_bias(self, prev, hidden, state):
        m = self.markov_head
        e = m.markov_w1(prev)
        if m.kind == "vanilla":
            return m.markov_w2(e), None
        if m.kind == "gated":
            gate = torch.sigmoid(m.gate_proj(torch.cat([hidden, e], -1)))
            return m.markov_w2(gate * e), None
        state = torch.zeros_like(e) if state is None else state
        g, cand, out = m.joint_proj(torch.cat([state, e, hidden], -1)).chunk(3, -1)
        g = torch.sigmoid(g)
        state = g * state + (1 - g) * torch.tanh(cand)
        return m.markov_w2(torch.tanh(out)), state

    @torch.no_grad()
    def draft(self, features, first: int, anchor: int, vocab=None):
        """features [C, n * H]: the target's streams at positions first .. first + C - 1; the
        anchor is the token at first + C. Returns (block tokens, confidences or None)."""
        c = self.hidden_norm(self.fc(features))
        a = first + features.shape[0]
        ids = torch.full((BLOCK,), MASK)
        ids[0] = anchor
        x = self.embed_tokens(ids)
        positions = torch.arange(first, a + BLOCK)[None]
        cos, sin = self.rotary_emb(x[None], positions)
        cos, sin = cos[0], sin[0]
        for layer in self.layers:
            x = layer(x, c, cos, sin)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        prev, state, tokens, conf = torch.tensor(anchor), None, [], []
        for i in range(BLOCK):
            row = logits[i]
            if self.markov_head is not None:
                bias, state = self.markov_bias(prev[None], hidden[i][None], state)
                row = row + bias[0]
            if vocab is not None:  # a draft vocabulary: its tokens alone
                allowed = torch.zeros_like(row, dtype=torch.bool)
                allowed[vocab] = True
                row = row.masked_fill(~allowed, float("-inf"))
            if self.confidence_head is not None:
                f = hidden[i]
                if self.cfg.confidence_head_with_markov:
                    f = torch.cat([f, self.markov_head.markov_w1(prev)])
                conf.append(float(torch.sigmoid(self.confidence_head.proj(f))))
            prev = row.argmax()
            tokens.append(int(prev))
        return tokens, (conf or None)


def save_drafter(out_dir, main, seed=1, **dspark) -> RefDSpark:
    """A random drafter for `main` in DeepSpec's layout (its embedding and head copied from the
    target, as DeepSpec initialises them)."""
    cfg = draft_config(**dspark)
    torch.manual_seed(seed)
    ref = RefDSpark(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
        ref.embed_tokens.weight.copy_(main.model.embed_tokens.weight)
        ref.lm_head.weight.copy_(main.lm_head.weight)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in ref.state_dict().items()},
        out_dir / "model.safetensors",
    )
    raw = cfg.to_dict()
    raw["architectures"] = ["Qwen3DSparkModel"]
    (out_dir / "config.json").write_text(json.dumps(raw))
    return ref


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model_dir = make_model(
        tmp_path_factory.mktemp("dspark") / "target",
        "llama",
        tokenizer=False,
        num_hidden_layers=TARGET_LAYERS,
    )
    return model_dir, hf_model(model_dir)


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    """One drafter per Markov head kind (and one with neither head)."""
    root = tmp_path_factory.mktemp("drafters")
    main = target[1]
    made = {}
    for kind, fields in {
        "vanilla": {},
        "gated": {"markov_head_type": "gated", "confidence_head_with_markov": False},
        "rnn": {"markov_head_type": "rnn"},
        "plain": {"markov_rank": 0, "enable_confidence_head": False},
    }.items():
        made[kind] = (root / kind, save_drafter(root / kind, main, **fields))
    return made


@pytest.fixture(scope="module")
def expected(target):
    return [hf_greedy(target[1], p, 12) for p in PROMPTS]


def dspark_engine(model_dir, drafter_dir, **kw) -> Engine:
    options = dict(
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=1,
        speculative_algorithm="dspark",
        speculative_draft_model=str(drafter_dir),
        speculative_fixed_length=True,
        speculative_num_draft_tokens=BLOCK,
        speculative_dspark_only=True,
    )
    options.update(kw)
    return Engine(str(model_dir), **options)


@torch.no_grad()
def oracle_block(main, ref, seq: list[int], first: int = 0, vocab=None):
    """The oracle's block after seq, its context from position `first` on (transformers' hidden
    states: index l + 1 is the stream after layer l, 0 the embeddings)."""
    states = main.model(torch.tensor([seq[:-1]]), output_hidden_states=True)
    streams = states.hidden_states
    features = torch.cat([streams[i + 1][0] for i in ref.cfg.target_layer_ids], dim=-1)
    return ref.draft(features[first:], first, seq[-1], vocab)


def check_block(drafter, rid, seq, main, ref, first=0):
    (proposal,) = drafter.propose([(rid, seq, BLOCK)])
    tokens, conf = oracle_block(main, ref, seq, first)
    assert proposal.tokens == tokens
    if conf is None:
        assert proposal.confidence is None
    else:
        assert proposal.confidence == pytest.approx(conf, abs=1e-4)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn", "plain"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_blocks_match_the_oracle_after_prefill_and_verification(
    target, drafters, kind, page_size
):
    model_dir, main = target
    drafter_dir, ref = drafters[kind]
    engine = dspark_engine(
        model_dir, drafter_dir, page_size=page_size, chunked_prefill_size=8
    )
    drafter = engine.scheduler.spec.draft_model
    (rid,) = engine.add_request(
        PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    )
    for _ in range(6):  # five chunks of the 41-token prompt, then the first token
        engine.step()
    req = engine.scheduler.running[0]
    seq = req.prompt_ids + req.output_ids
    assert len(req.output_ids) == 1
    check_block(drafter, rid, seq, main, ref)
    assert drafter.seqs[rid].end == len(seq) - 1
    for _ in range(4):  # verification steps
        engine.step()
    seq = req.prompt_ids + req.output_ids
    assert req.spec_verify_steps > 0
    check_block(drafter, rid, seq, main, ref)
    assert drafter.seqs[rid].end == len(seq) - 1


def test_context_from_native_decode_steps_matches(target, drafters):
    """Steps that feed no drafts run the native decode loop where the kernels are built; the
    streams it captures make the same context rows."""
    model_dir, main = target
    drafter_dir, ref = drafters["vanilla"]
    # every confidence is below 1: nothing is ever verified, every step after the prefill decodes
    engine = dspark_engine(model_dir, drafter_dir, speculative_confidence_threshold=1.0)
    drafter = engine.scheduler.spec.draft_model
    (rid,) = engine.add_request(
        PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    )
    for _ in range(6):
        engine.step()
    req = engine.scheduler.running[0]
    assert req.spec_verify_steps == 0 and len(req.output_ids) == 6
    native = engine.model.native_decode()
    if native is not None:
        assert native.steps >= 5
    drafter.threshold = 0.0
    check_block(drafter, rid, req.prompt_ids + req.output_ids, main, ref)


def test_confidence_threshold_cuts_each_block_where_the_head_says(target, drafters):
    model_dir, main = target
    drafter_dir, ref = drafters["vanilla"]
    engine = dspark_engine(model_dir, drafter_dir)
    drafter = engine.scheduler.spec.draft_model
    (rid,) = engine.add_request(
        PROMPTS[3], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    )
    engine.step()
    req = engine.scheduler.running[0]
    seq = req.prompt_ids + req.output_ids
    tokens, conf = oracle_block(main, ref, seq)
    for threshold in sorted({0.0, *conf, 1.0}):
        drafter.threshold = threshold
        (p,) = drafter.propose([(rid, seq, BLOCK)])
        cut = next((j for j, c in enumerate(conf) if c < threshold), BLOCK)
        assert p.tokens == tokens[:cut]
        assert p.confidence == pytest.approx(conf[:cut], abs=1e-4)


def test_policy_takes_drafts_by_the_product_of_their_confidences():
    """A drafted token at depth j is worth the product of the confidences up to it: with a step
    cost that pays for a token worth at least ~0.3, a block rated [0.9, 0.8, 0.2, 0.99] is verified
    to depth 2 (0.72, then 0.14), and one rated [0.99, 0.99, 0.99, 0.99] whole."""
    policy = DraftPolicy(8)
    for rows in (1, 2, 3, 5, 9) * 10:  # a = 10 ms, b = 3 ms per row
        policy.cost.observe(1, rows, 0, 0.010 + 0.003 * rows)
    low = Candidate("a", [1, 2, 3, 4], 0, 0.5, [0.9, 0.8, 0.2, 0.99])
    high = Candidate("b", [1, 2, 3, 4], 0, 0.5, [0.99] * 4)
    assert policy.choose([low], 1, 1, 64) == [2]
    assert policy.choose([high], 1, 1, 64) == [4]
    assert policy.choose([Candidate("c", [1, 2, 3, 4], 0, 0.5)], 1, 1, 64) == [1]


@pytest.mark.parametrize(
    "page_size,chunk,only", [(1, 0, True), (16, 8, True), (4, 0, False)]
)
def test_greedy_output_is_unchanged(target, drafters, expected, page_size, chunk, only):
    """With the drafter alone, and with each request's n-gram drafts beside it (the one expected to
    yield more is verified)."""
    model_dir, _ = target
    engine = dspark_engine(
        model_dir,
        drafters["vanilla"][0],
        page_size=page_size,
        chunked_prefill_size=chunk,
        speculative_dspark_only=only,
        speculative_fixed_length=only,
    )
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    out = engine.generate(PROMPTS, params)
    assert [r.choices[0].token_ids for r in out] == expected
    stats = engine.scheduler.spec.stats
    assert stats.verify_steps > 0 and stats.drafted_tokens > 0
    # a radix hit: the context rows start where the target computed (no streams for the prefix)
    again = engine.generate(PROMPTS[2], params)
    assert again[0].cached_tokens > 0 and again[0].choices[0].token_ids == expected[2]
    drafter = engine.scheduler.spec.draft_model
    assert drafter.seqs == {} and drafter.pending == {} and drafter.pending_rows == 0
    assert drafter.idle == {} and not drafter.dormant
    assert drafter.allocator.num_free_pages == drafter.allocator.num_pages


def test_drafts_after_a_radix_hit_read_the_computed_positions(target, drafters):
    model_dir, main = target
    drafter_dir, ref = drafters["vanilla"]
    engine = dspark_engine(model_dir, drafter_dir, page_size=4)
    params = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    engine.generate(PROMPTS[2], params)
    (rid,) = engine.add_request(
        PROMPTS[2] + [7, 8, 9],
        SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True),
    )
    engine.step()
    req = engine.scheduler.running[0]
    drafter = engine.scheduler.spec.draft_model
    first = req.num_cached_tokens
    assert first > 0
    check_block(drafter, rid, req.prompt_ids + req.output_ids, main, ref, first)
    assert drafter.seqs[rid].first == first


def test_parallel_samples_aborts_and_retraction_release_the_drafter(
    target, drafters, expected
):
    model_dir, _ = target
    engine = dspark_engine(model_dir, drafters["rnn"][0])
    out = engine.generate(
        PROMPTS[0],
        SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, n=2),
    )
    assert [c.token_ids for c in out[0].choices] == [expected[0]] * 2
    rids = engine.add_request(
        PROMPTS[3], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    )
    for _ in range(4):
        engine.step()
    drafter = engine.scheduler.spec.draft_model
    assert drafter.seqs
    engine.abort(rids[0])
    engine.step()
    assert drafter.seqs == {} and drafter.pending == {} and drafter.pending_rows == 0
    assert drafter.idle == {} and not drafter.dormant
    assert drafter.allocator.num_free_pages == drafter.allocator.num_pages

    # a pool too small for every request at once: some are retracted, recomputed and draft again
    params = SamplingParams(temperature=0, max_new_tokens=60, ignore_eos=True)
    prompts = [p[:12] + [i] for i, p in enumerate(PROMPTS * 3)]
    plain = Engine(
        str(model_dir), dtype="float32", kv_cache_tokens=1024, page_size=4
    ).generate(prompts, params)
    tight = dspark_engine(
        model_dir, drafters["vanilla"][0], kv_cache_tokens=160, page_size=4
    )
    got = tight.generate(prompts, params)
    assert [r.choices[0].token_ids for r in got] == [
        r.choices[0].token_ids for r in plain
    ]
    assert tight.scheduler.num_retractions > 0
    assert tight.scheduler.spec.stats.verify_steps > 0
    tight.scheduler.check_no_leaks()
    d = tight.scheduler.spec.draft_model
    assert d.seqs == {} and d.allocator.num_free_pages == d.allocator.num_pages


def test_a_decode_worker_drafts_over_kv_from_its_prefill_worker(
    target, drafters, expected
):
    import time

    model_dir, _ = target
    drafter_dir = drafters["vanilla"][0]
    kw = {"kv_cache_tokens": 512, "page_size": 4, "disaggregation_secret": "s3cret"}
    prefill = dspark_engine(model_dir, drafter_dir, disaggregation_mode="prefill", **kw)
    decode = dspark_engine(model_dir, drafter_dir, disaggregation_mode="decode", **kw)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        decode.add_request(
            prompt,
            params,
            rid=f"r{i}",
            bootstrap_room=900 + i,
            bootstrap_addr=prefill.disagg_endpoint,
        )
        prefill.add_request(prompt, params, rid=f"r{i}", bootstrap_room=900 + i)
        got[f"r{i}"] = []
    finished: set[str] = set()
    deadline = time.monotonic() + 60
    while len(finished) < len(PROMPTS) and time.monotonic() < deadline:
        prefill.step()
        for out in decode.step():
            got[out.rid] += out.new_token_ids
            if out.finished:
                finished.add(out.rid)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert decode.scheduler.spec.stats.verify_steps > 0
    for e in (prefill, decode):
        e.scheduler.check_no_leaks()
        e.close()


def test_sampled_requests_keep_their_seeded_output(target, drafters):
    """Sampling with drafts: a seeded request's tokens are a draw from the target's distribution
    (rejection test); here only checked to run, finish and free everything."""
    model_dir, _ = target
    engine = dspark_engine(
        model_dir, drafters["gated"][0], speculative_fixed_length=False
    )
    out = engine.generate(
        PROMPTS,
        SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=3),
    )
    assert all(len(r.choices[0].token_ids) > 0 for r in out)
    engine.scheduler.check_no_leaks()
    d = engine.scheduler.spec.draft_model
    assert d.seqs == {} and d.allocator.num_free_pages == d.allocator.num_pages


def test_bad_drafters_are_refused_with_what_to_fix(target, tmp_path):
    model_dir, main = target

    def refused(match, **fields):
        d = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        save_drafter(d, main, **fields)
        with pytest.raises(ValueError, match=match):
            dspark_engine(model_dir, d)

    refused("reach the target's last layer", target_layer_ids=[0, TARGET_LAYERS - 1])
    refused("strictly increasing", target_layer_ids=[2, 1])
    refused("trained on a target of 9 layers", num_target_layers=9)
    refused("mask_token_id 999", mask_token_id=999)
    refused("needs a Markov head", markov_rank=0)
    d = tmp_path / "other"
    save_drafter(d, main)
    raw = json.loads((d / "config.json").read_text())
    raw["architectures"] = ["Qwen3ForCausalLM"]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="Qwen3DSparkModel"):
        dspark_engine(model_dir, d)
    with pytest.raises(ValueError, match="--speculative-draft-model goes with"):
        Engine(str(model_dir), speculative_algorithm="dspark")


def test_detaching_the_drafter_stops_keeping_the_streams(target, drafters):
    model_dir, _ = target
    engine = dspark_engine(model_dir, drafters["vanilla"][0])
    drafter = engine.scheduler.spec.draft_model
    assert engine.model.capture_after == drafter.capture_after == (-1, 1, 2)
    spec = engine.scheduler.set_speculator(None)
    assert engine.model.capture_after == () and not engine.scheduler.runner.keep_hidden
    engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=3))
    assert engine.model.captured is None and engine.scheduler.runner.hidden is None
    engine.scheduler.set_speculator(spec)
    assert (
        engine.model.capture_after == (-1, 1, 2) and engine.scheduler.runner.keep_hidden
    )


@torch.no_grad()
def test_layer_streams_are_transformers_hidden_states(target):
    model_dir, main = target
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=1024, page_size=4)
    seqs = [PROMPTS[0], PROMPTS[2]]
    got = engine.layer_streams(seqs, (-1, 0, 2))
    for seq, streams in zip(seqs, got):
        states = main.model(
            torch.tensor([seq]), output_hidden_states=True
        ).hidden_states
        expected = torch.cat([states[i + 1][0] for i in (-1, 0, 2)], dim=-1)
        torch.testing.assert_close(streams, expected, atol=1e-4, rtol=1e-4)
    assert engine.model.capture_after == ()
    engine.scheduler.check_no_leaks()
    with pytest.raises(ValueError, match="out of range"):
        engine.layer_streams(seqs, (0, TARGET_LAYERS))


@pytest.mark.parametrize(
    "ngram_rate,confidence,wins",
    [(0.1, 0.99, "block"), (0.1, 0.05, "ngram"), (0.95, 0.99, "ngram unblocked")],
)
def test_a_request_drafts_whichever_of_block_and_ngram_should_yield_more(
    ngram_rate, confidence, wins
):
    """The block drafter runs for a request unless its n-gram match is expected to yield as much
    as a block at the request's measured acceptance; then the draft expected to yield more wins."""
    from strata.engine.request import Req

    asked: list[int] = []
    spec = _block_speculator(confidence, asked, fixed_length=True)
    for _ in range(200):  # what 3-gram drafts achieved so far
        spec.policy.record(3, 1, 1 if spec.policy._prior(3) < ngram_rate else 0)
    req = Req(rid="r", prompt_ids=[1, 2, 3, 4, 5, 1, 2, 3], params=SamplingParams())
    ((got, draft, match),) = spec.plan([(req, 8)], 1, 1, 64)
    assert got is req
    if wins == "block":
        assert (draft, match) == ([7, 7, 7, 7], 0)
    else:
        assert (draft, match) == ([4, 5, 1, 2], 3)
    assert bool(asked) == (wins != "ngram unblocked")


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_a_draft_vocabulary_drafts_from_its_tokens_alone(
    target, drafters, tmp_path, kind
):
    import shutil

    model_dir, main = target
    src, ref = drafters[kind]
    drafter_dir = tmp_path / "vocab"
    shutil.copytree(src, drafter_dir)
    vocab = sorted(set(range(0, 384, 3)) | set(range(100, 160)))
    (drafter_dir / "draft_vocab.json").write_text(json.dumps({"ids": vocab}))
    engine = dspark_engine(model_dir, drafter_dir, chunked_prefill_size=8)
    drafter = engine.scheduler.spec.draft_model
    assert drafter.model.head.out_features == len(vocab)
    (rid,) = engine.add_request(
        PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    )
    for _ in range(8):
        engine.step()
    req = engine.scheduler.running[0]
    seq = req.prompt_ids + req.output_ids
    (proposal,) = drafter.propose([(rid, seq, BLOCK)])
    tokens, conf = oracle_block(main, ref, seq, vocab=vocab)
    assert proposal.tokens == tokens and all(t in vocab for t in tokens)
    assert proposal.confidence == pytest.approx(conf, abs=1e-4)
    for bad in ({"ids": [1, 1]}, {"ids": [999]}, {"tokens": [1]}, {"ids": []}):
        (drafter_dir / "draft_vocab.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"draft_vocab\.json"):
            dspark_engine(model_dir, drafter_dir)


def test_rows_wait_until_the_request_drafts_and_a_cut_back_replaces_them(
    target, drafters
):
    model_dir, main = target
    drafter_dir, ref = drafters["vanilla"]
    engine = dspark_engine(model_dir, drafter_dir)
    drafter = engine.scheduler.spec.draft_model
    seq = PROMPTS[2][:12]
    streams = engine.layer_streams([seq[:-1]], drafter.capture_after)[0]
    noise = torch.randn_like(streams)
    drafter.extend([("x", 0, streams[:5], [])])
    drafter.extend([("x", 5, noise[5:8], [])])  # rows later cut back
    drafter.extend([("x", 3, streams[3:11], [])])  # positions 3.. again (a recompute)
    assert [(p0, h.shape[0]) for p0, h in drafter.pending["x"]] == [(0, 3), (3, 8)]
    assert drafter.pending_rows == 11 and "x" not in drafter.seqs
    check_block(drafter, "x", seq, main, ref)  # drafting stores them first
    assert drafter.pending == {} and drafter.pending_rows == 0
    assert drafter.seqs["x"].end == len(seq) - 1
    drafter.finish("x")
    assert drafter.allocator.num_free_pages == drafter.allocator.num_pages


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_context_rows_project_the_layers_own_keys_and_values(
    target, drafters, quantization
):
    """A context row's keys and values come from copies of the key and value rows of each layer's
    fused projection, in the same format: exactly what the layer's own projection gives."""
    model_dir, _ = target
    drafter_dir, _ = drafters["vanilla"]
    engine = dspark_engine(model_dir, drafter_dir, quantization=quantization)
    model = engine.scheduler.spec.draft_model.model
    c = torch.randn(5, model.decoder.config.hidden_size)
    for kv, layer in zip(model.context_kv, model.decoder.layers, strict=True):
        attn = layer.self_attn
        assert type(kv) is type(attn.qkv_proj)
        assert torch.equal(kv(c), attn.qkv_proj(c)[:, attn.q_size :])


def test_idle_requests_give_their_rows_up_once_too_many_wait(
    target, drafters, monkeypatch
):
    """Once more than PENDING_ROWS rows wait, a request no block was drafted for in IDLE_STEPS
    steps drops its rows instead of storing them, and none are kept for it until a block is asked
    for it; its rows then start afresh, and its blocks are the oracle's from there."""
    from strata.engine import dspark as dspark_module

    model_dir, main = target
    drafter_dir, ref = drafters["vanilla"]
    engine = dspark_engine(model_dir, drafter_dir)
    drafter = engine.scheduler.spec.draft_model
    monkeypatch.setattr(dspark_module, "PENDING_ROWS", 8)
    monkeypatch.setattr(dspark_module, "IDLE_STEPS", 3)
    seq = PROMPTS[2][:14]
    streams = engine.layer_streams([seq[:-1]], drafter.capture_after)[0]
    for p0, p1 in ((0, 6), (6, 7), (7, 8)):  # three steps: 8 rows wait, none stored
        drafter.extend([("idle", p0, streams[p0:p1], [])])
    drafter.extend(
        [("busy", 0, streams[:3], [])]
    )  # 11 wait: "idle" has been idle 3 steps
    assert drafter.dormant == {"idle"} and list(drafter.pending) == ["busy"]
    assert drafter.pending_rows == 3 and "idle" not in drafter.seqs
    drafter.extend([("idle", 8, streams[8:9], [])])  # not kept
    assert "idle" not in drafter.pending and drafter.pending_rows == 3
    (nothing,) = drafter.propose(
        [("idle", seq[:10], BLOCK)]
    )  # asked: it wakes, no rows yet
    assert nothing.tokens == [] and not drafter.dormant
    drafter.extend([("idle", 9, streams[9:13], [])])
    check_block(drafter, "idle", seq, main, ref, first=9)
    for rid in ("idle", "busy"):
        drafter.finish(rid)
    assert drafter.pending == {} and drafter.idle == {} and drafter.seqs == {}
    assert drafter.allocator.num_free_pages == drafter.allocator.num_pages


def _block_speculator(confidence: float, asked: list, fixed_length: bool = False):
    from strata.config import EngineConfig
    from strata.engine.dspark import Proposal
    from strata.engine.speculative import Speculator

    class Block:
        block, needs_hidden, capture_after = True, False, ()

        def propose(self, wants):
            asked.append(len(wants))
            return [Proposal([7, 7, 7, 7], [confidence] * 4) for _ in wants]

        def finish(self, rid):
            pass

    config = EngineConfig(
        speculative_algorithm="dspark",
        speculative_draft_model="unused",
        speculative_num_draft_tokens=4,
        speculative_fixed_length=fixed_length,
    )
    spec = Speculator(config, Block())
    for _ in range(40):  # a step of 1 + n rows costs 5 + 0.2 n ms
        for rows in (1, 3, 5):
            spec.policy.cost.observe(1, rows, 0, 0.005 + 0.0002 * rows)
    return spec


@pytest.mark.parametrize(
    "rate,forward_ms,runs",
    [(0.8, 1.0, True), (0.8, 30.0, False), (0.3, 4.0, False), (0.3, 0.2, True)],
)
def test_the_block_forward_runs_only_where_its_drafts_should_pay_for_it(
    rate, forward_ms, runs
):
    """A block costs its forward whether or not its drafts are verified: the drafter runs only
    where the tokens the blocks are expected to add (at the requests' measured acceptance) raise
    the step's output rate after the forward's measured time; a declined forward is still tried
    now and then, so that its cost and acceptance stay measured."""
    from strata.engine.request import Req

    asked: list[int] = []
    spec = _block_speculator(0.99, asked)
    for _ in range(20):
        spec.draft_cost.observe(1, forward_ms / 1e3)
    req = Req(rid="r", prompt_ids=[1, 2, 3, 4, 5, 6], params=SamplingParams())
    req.spec_history = (99.0, 100.0)  # its n-gram drafts: not what its blocks achieve
    req.block_history = (100 * rate, 100.0)  # what its blocks achieved
    for _ in range(8):
        spec.plan([(req, 8)], 1, 1, 64)
    if runs:  # every step the guard let draft (it measures plain steps too at first)
        assert asked == [1] * (8 - spec.stats.vetoed) and len(asked) >= 5
    else:  # declined, but tried once in a while
        assert len(asked) <= 1
    fresh = _block_speculator(0.99, asked := [])
    fresh.plan([(req, 8)], 1, 1, 64)
    assert asked == [1]  # an unmeasured forward is run, to measure it
    assert fresh.draft_cost.seconds(1) is not None


def test_a_request_whose_blocks_miss_still_drafts_its_n_grams():
    from strata.engine.request import Req

    asked: list[int] = []
    spec = _block_speculator(0.99, asked)
    for _ in range(20):
        spec.draft_cost.observe(1, 0.004)
    req = Req(rid="r", prompt_ids=[1, 2, 3, 4, 5, 1, 2, 3], params=SamplingParams())
    req.spec_history = (95.0, 100.0)  # its n-gram drafts are accepted
    req.block_history = (5.0, 100.0)  # its blocks are not
    got = [spec.plan([(req, 8)], 1, 1, 64) for _ in range(8)]
    drafted = [g[0][1] for g in got if g]
    assert drafted and all(d == [4, 5, 1, 2] for d in drafted)
    assert len(drafted) == 8 - spec.stats.vetoed
    assert len(asked) <= 1  # the block drafter is not run for it (bar a rare re-try)


@pytest.mark.parametrize(
    "forwards_bought,runs", [((20.0, 6.0, 8.0), False), ((20.0, 60.0, 70.0), True)]
)
def test_the_block_forward_is_priced_at_what_the_requests_forwards_bought(
    forwards_bought, runs
):
    """The drafter's confidence cuts its blocks short: a request whose verified drafts were
    mostly accepted, but whose forwards bought few tokens (blocks cut to one draft or none), is
    priced at what its forwards bought, not at a block of the policy's length at that acceptance."""
    from strata.engine.request import Req

    asked: list[int] = []
    spec = _block_speculator(0.99, asked)
    for _ in range(20):
        spec.draft_cost.observe(1, 0.003)  # 3 ms, against a 5.2 ms step
    req = Req(rid="r", prompt_ids=[1, 2, 3, 4, 5, 6], params=SamplingParams())
    req.block_history = (90.0, 100.0)  # what it verified of its blocks was accepted
    req.block_yield = spec.block_yield = forwards_bought  # (forwards, accepted, rows)
    for _ in range(8):
        spec.plan([(req, 8)], 1, 1, 64)
    if runs:
        assert len(asked) >= 5
    else:  # 0.3 tokens a forward: declined, bar a rare re-try
        assert len(asked) <= 1


def test_after_every_requests_blocks_fell_out_of_favour_n_grams_still_draft_and_blocks_are_retried():
    """Blocks measured poor across requests (another kind of traffic) must neither keep a fresh
    request from its n-gram drafts nor stop the drafter for good: a block is tried once in
    EXPLORE_DECLINED steps, so that its acceptance is measured again."""
    from strata.engine.request import Req
    from strata.engine.speculative import EXPLORE_DECLINED

    asked: list[int] = []
    spec = _block_speculator(0.99, asked)
    for _ in range(20):
        spec.draft_cost.observe(1, 0.004)
    spec.policy.by_match[0] = [1.0, 100.0]  # every request's blocks: 1% accepted
    repeats = Req(rid="a", prompt_ids=[1, 2, 3, 4, 5, 1, 2, 3], params=SamplingParams())
    got = [spec.plan([(repeats, 8)], 1, 1, 64) for _ in range(8)]
    drafted = [g[0][1] for g in got if g]
    assert len(drafted) == 8 - spec.stats.vetoed
    assert all(d == [4, 5, 1, 2][: len(d)] for d in drafted)
    assert asked == []
    plain = Req(rid="b", prompt_ids=[1, 2, 3, 4, 5, 6], params=SamplingParams())
    steps = 3 * EXPLORE_DECLINED
    vetoed = spec.stats.vetoed
    for _ in range(steps):
        spec.plan([(plain, 8)], 1, 1, 64)
    planned = steps - (spec.stats.vetoed - vetoed)
    assert 1 <= len(asked) <= planned // EXPLORE_DECLINED + 1


def test_what_a_block_forward_bought_is_recorded_once_verified_or_cut_to_nothing():
    from strata.engine.request import Req

    spec = _block_speculator(0.01, asked := [])  # the confidence head cuts every block
    req = Req(rid="r", prompt_ids=[1, 2, 3, 4, 5, 6], params=SamplingParams())
    assert (
        spec.plan([(req, 8)], 1, 1, 64) == []
    )  # an unmeasured forward runs: nothing drafted
    assert asked == [1] and req.block_yield == (1.0, 0.0, 0.0)
    sure = _block_speculator(0.99, asked := [])
    (planned,) = sure.plan([(req, 8)], 1, 1, 64)
    assert planned[1] == [7, 7, 7, 7] and req.block_yield == (1.0, 0.0, 0.0)
    req.draft_match = planned[2]
    sure.verified(req, 4, 3)  # counted when verified
    assert req.block_yield == (1.9, 3.0, 4.0) and sure.block_yield == (1.0, 3.0, 4.0)
    # no block drafted (its context rows not made yet): not a forward that bought nothing
    from strata.engine.dspark import Proposal

    unmade = _block_speculator(0.99, [])
    unmade.draft_model.propose = lambda wants: (
        [Proposal([], drafted=False)] * len(wants)
    )
    fresh = Req(rid="f", prompt_ids=[1, 2, 3, 4, 5, 6], params=SamplingParams())
    assert unmade.plan([(fresh, 8)], 1, 1, 64) == []
    assert fresh.block_yield == (0.0, 0.0, 0.0) and unmade.stats.draft_calls == 1
