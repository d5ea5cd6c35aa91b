"""Multi-token prediction drafts (`--speculative-algorithm mtp`) against transformers' `MtpModel`
on a tiny DeepSeek-V3 whose checkpoint holds an MTP layer: the layer's states after a prefill and
after verification steps, and the chained drafts, equal the oracle's (fp32, 1e-4); greedy output is
unchanged with MTP drafts under chunked prefill, radix hits, page sizes 1 and 16 and n > 1; the
layer's KV is released with its requests."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_parity import PROMPTS, hf_greedy, hf_model
from tiny_models import make_model, randomize_constants

from strata import Engine, SamplingParams
from strata.models import config_from_dir

NUM_LAYERS = 2  # tiny_models' default


def add_mtp_layer(model_dir, seed: int = 1) -> torch.nn.Module:
    """Give the checkpoint an MTP layer (DeepSeek's names: model.layers.{num_layers}.*, with the
    embedding and head stored again); returns transformers' MtpModel holding the same weights."""
    from transformers.modeling_layers import MtpModel

    main = hf_model(model_dir)
    torch.manual_seed(seed)
    mtp = MtpModel(main, 1).eval()
    with torch.no_grad():
        for p in mtp.layers.parameters():
            p.normal_(0, 0.25)
    randomize_constants(mtp.layers)
    # the block's names on disk: save it as the last layer of a copy of the main model
    carrier = copy.deepcopy(main)
    carrier.model.layers[-1].load_state_dict(mtp.layers[0].mtp_block.state_dict())
    carrier.save_pretrained(model_dir / "carrier")
    saved = load_file(model_dir / "carrier" / "model.safetensors")
    last, mtp_prefix = f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."
    tensors = {
        mtp_prefix + k.removeprefix(last): v
        for k, v in saved.items()
        if k.startswith(last)
    }
    own = mtp.layers[0]
    tensors.update(
        {
            f"{mtp_prefix}enorm.weight": own.enorm.weight,
            f"{mtp_prefix}hnorm.weight": own.hnorm.weight,
            f"{mtp_prefix}eh_proj.weight": own.eh_proj.weight,
            f"{mtp_prefix}shared_head.norm.weight": own.post_norm.weight,
            f"{mtp_prefix}shared_head.head.weight": main.lm_head.weight,
            f"{mtp_prefix}embed_tokens.weight": main.model.embed_tokens.weight,
        }
    )
    save_file(
        {k: v.detach().contiguous() for k, v in tensors.items()},
        model_dir / "model-mtp.safetensors",
    )
    for f in (model_dir / "carrier").iterdir():
        f.unlink()
    (model_dir / "carrier").rmdir()
    return mtp


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    model_dir = make_model(
        tmp_path_factory.mktemp("mtp") / "v3",
        "deepseek_v3",
        tokenizer=False,
        num_nextn_predict_layers=1,
    )
    mtp = add_mtp_layer(model_dir)
    return model_dir, hf_model(model_dir), mtp


def mtp_engine(model_dir, **kw) -> Engine:
    options = dict(
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=1,
        speculative_algorithm="mtp",
        speculative_fixed_length=True,
        speculative_num_draft_tokens=3,
    )
    options.update(kw)
    return Engine(str(model_dir), **options)


@torch.no_grad()
def oracle_states(main, mtp, seq: list[int]) -> torch.Tensor:
    """transformers: the MTP layer's states at every position p of seq[:-1] (the pair h_p, seq[p+1])."""
    from transformers.cache_utils import MtpCache

    ids = torch.tensor([seq])
    hidden = main.model(ids[:, :-1]).last_hidden_state
    positions = torch.arange(1, len(seq))[None]
    cache = MtpCache(config=main.config.get_mtp_config())
    return mtp.forward_layer(0, hidden, positions, cache, input_ids=ids[:, 1:])[
        0
    ], cache


@torch.no_grad()
def oracle_chain(main, mtp, seq: list[int], k: int) -> list[int]:
    """transformers: k drafts after seq, the one layer chained on its own states (vLLM's, SGLang's)."""
    states, cache = oracle_states(main, mtp, seq)
    state, drafts = states[-1:], []
    for step in range(k):
        token = int(main.lm_head(state[-1]).argmax())
        drafts.append(token)
        if step + 1 < k:
            position = torch.tensor([[len(seq) + step]])
            state = mtp.forward_layer(
                0, state[None], position, cache, input_ids=torch.tensor([[token]])
            )[0]
    return drafts


def test_config_reads_the_mtp_layers(mtp_model):
    assert config_from_dir(mtp_model[0]).mtp_layers == 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_states_and_chained_drafts_match_transformers(mtp_model, page_size):
    model_dir, main, mtp = mtp_model
    engine = mtp_engine(model_dir, page_size=page_size, chunked_prefill_size=8)
    drafter = engine.scheduler.spec.draft_model
    prompt = PROMPTS[2]  # 41 tokens: prefilled in chunks of 8
    (rid,) = engine.add_request(
        prompt, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    )
    for _ in range(6):  # five chunks, then the first token
        engine.step()
    req = engine.scheduler.running[0]
    seq = req.prompt_ids + req.output_ids
    assert len(req.output_ids) == 1
    expected, _ = oracle_states(main, mtp, seq)
    torch.testing.assert_close(
        drafter.seqs[rid].state.cpu(), expected[-1], atol=1e-4, rtol=1e-4
    )
    assert drafter.draft([(rid, seq, 4)]) == [oracle_chain(main, mtp, seq, 4)]
    for _ in range(
        4
    ):  # verification steps (the random layer's drafts are mostly rejected)
        engine.step()
    seq = req.prompt_ids + req.output_ids
    assert req.spec_verify_steps > 0 and drafter.seqs[rid].end == len(seq) - 1
    expected, _ = oracle_states(main, mtp, seq)
    torch.testing.assert_close(
        drafter.seqs[rid].state.cpu(), expected[-1], atol=1e-4, rtol=1e-4
    )
    assert drafter.draft([(rid, seq, 3)]) == [oracle_chain(main, mtp, seq, 3)]


def test_accepted_runs_extend_the_layer_rows(mtp_model, expected):
    """Drafts the target accepts for a while and then rejects (the true continuation with one token
    corrupted): after every verification the layer's rows cover the accepted run and the target's
    token, and its state equals transformers' over the whole sequence."""
    model_dir, main, mtp = mtp_model
    engine = mtp_engine(model_dir, speculative_num_draft_tokens=4)
    drafter = engine.scheduler.spec.draft_model
    truth = PROMPTS[0] + expected[0]
    corrupt = iter([None, 2, 0, None, 1, 3] * 4)

    def draft(wants):
        out = []
        for _, seq, k in wants:
            d = truth[len(seq) : len(seq) + k]
            bad = next(corrupt)
            if bad is not None and bad < len(d):
                d[bad] = (d[bad] + 1) % 300
            out.append(d)
        return out

    drafter.draft = draft
    (rid,) = engine.add_request(
        PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    )
    engine.step()  # the prefill
    runs = set()
    while engine.scheduler.running:
        before = engine.scheduler.running[0].spec_accepted
        engine.step()
        if not engine.scheduler.running:
            break
        req = engine.scheduler.running[0]
        runs.add(req.spec_accepted - before)
        seq = req.prompt_ids + req.output_ids
        assert drafter.seqs[rid].end == len(seq) - 1
        states, _ = oracle_states(main, mtp, seq)
        torch.testing.assert_close(
            drafter.seqs[rid].state.cpu(), states[-1], atol=1e-4, rtol=1e-4
        )
    assert max(runs) >= 3 and 0 in runs
    assert req.output_ids == expected[0]


@pytest.fixture(scope="module")
def expected(mtp_model):
    _, main, _ = mtp_model
    return [hf_greedy(main, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("page_size,chunk", [(1, 0), (16, 8)])
def test_greedy_output_is_unchanged(mtp_model, expected, page_size, chunk):
    engine = mtp_engine(mtp_model[0], page_size=page_size, chunked_prefill_size=chunk)
    out = engine.generate(
        PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    )
    assert [r.choices[0].token_ids for r in out] == expected
    stats = engine.scheduler.spec.stats
    assert stats.verify_steps > 0 and stats.drafted_tokens > 0
    # a radix hit: the layer's rows start where the target computed (no hidden states for the prefix)
    again = engine.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    )
    assert again[0].cached_tokens > 0 and again[0].choices[0].token_ids == expected[2]
    assert engine.scheduler.spec.draft_model.seqs == {}
    drafter = engine.scheduler.spec.draft_model
    assert drafter.allocator.num_free_pages == drafter.allocator.num_pages


def test_parallel_samples_and_aborts_release_the_layer_kv(mtp_model, expected):
    engine = mtp_engine(mtp_model[0])
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
    assert (
        drafter.seqs == {}
        and drafter.allocator.num_free_pages == drafter.allocator.num_pages
    )


def test_checkpoints_without_the_layer_are_refused(tmp_path):
    plain = make_model(
        tmp_path / "plain", "deepseek_v3", tokenizer=False, num_nextn_predict_layers=1
    )
    with pytest.raises(ValueError, match=r"holds no model\.layers\.2"):
        mtp_engine(plain)
    none = make_model(
        tmp_path / "none", "deepseek_v3", tokenizer=False, num_nextn_predict_layers=0
    )
    with pytest.raises(ValueError, match="no multi-token prediction layers"):
        mtp_engine(none)


def test_int8_weights_quantize_the_layer_and_keep_the_output(mtp_model):
    model_dir = mtp_model[0]
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    plain = Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=1024,
        quantization="int8",
        device="cpu",
    )
    engine = mtp_engine(model_dir, quantization="int8", device="cpu")
    drafter = engine.scheduler.spec.draft_model
    assert type(drafter.layer.decoder.layers[0].self_attn.o_proj).__name__ == "Q8Linear"
    expected = [r.choices[0].token_ids for r in plain.generate(PROMPTS, params)]
    assert [
        r.choices[0].token_ids for r in engine.generate(PROMPTS, params)
    ] == expected
    assert engine.scheduler.spec.stats.verify_steps > 0
