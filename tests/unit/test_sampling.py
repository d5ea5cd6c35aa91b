"""Sampling semantics on hand-made logits (no model)."""

from __future__ import annotations

import pytest
import torch

from strata.layers.sampler import SamplingBatch, apply_penalties, argmax_rows, sample
from strata.sampling_params import SamplingParams


def batch(rows: int, vocab: int, **kw) -> SamplingBatch:
    base = dict(
        temperatures=torch.ones(rows),
        top_ps=torch.ones(rows),
        top_ks=torch.full((rows,), vocab, dtype=torch.int64),
        min_ps=torch.zeros(rows),
        uniforms=torch.rand(rows),
        all_greedy=False,
    )
    base.update(kw)
    return SamplingBatch(**base)


def test_top_k_1_is_greedy():
    logits = torch.randn(64, 50)
    s = batch(64, 50, top_ks=torch.ones(64, dtype=torch.int64))
    assert torch.equal(sample(logits, s).token_ids, logits.argmax(-1))


def test_zero_temperature_rows_are_greedy_inside_a_sampled_batch():
    logits = torch.randn(8, 50)
    temps = torch.tensor([0.0, 1.0] * 4)
    out = sample(logits, batch(8, 50, temperatures=temps)).token_ids
    assert torch.equal(out[::2], logits.argmax(-1)[::2])


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    seen = set()
    for u in torch.linspace(0, 0.999, 200):
        s = batch(1, 4, top_ps=torch.tensor([0.7]), uniforms=u.view(1))
        seen.add(int(sample(logits, s).token_ids))
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    seen = {
        int(
            sample(
                logits, batch(1, 4, min_ps=torch.tensor([0.4]), uniforms=u.view(1))
            ).token_ids
        )
        for u in torch.linspace(0, 0.999, 200)
    }
    assert seen == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(20000, 1)
    out = sample(logits, batch(20000, 3)).token_ids
    freq = torch.bincount(out, minlength=3).float() / 20000
    assert torch.allclose(freq, probs, atol=0.02)


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0]).repeat(20000, 1)
    cold = sample(
        logits, batch(20000, 2, temperatures=torch.full((20000,), 0.25))
    ).token_ids
    hot = sample(
        logits, batch(20000, 2, temperatures=torch.full((20000,), 4.0))
    ).token_ids
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[3, 1, 0, 0]], dtype=torch.int32)
    seen = torch.tensor([[True, True, False, True]])
    s = batch(
        1,
        4,
        repetition_penalties=torch.tensor([2.0]),
        seen_mask=seen,
        frequency_penalties=torch.tensor([0.5]),
        presence_penalties=torch.tensor([0.25]),
        output_counts=counts,
    )
    out = apply_penalties(logits, s)
    # repetition: 2/2, -2*2, untouched, 0.5/2; then frequency 0.5*count and presence 0.25 where count>0
    expected = torch.tensor([[1.0 - 1.5 - 0.25, -4.0 - 0.5 - 0.25, 1.0, 0.25]])
    torch.testing.assert_close(out, expected)


def test_banned_tokens_are_never_sampled():
    logits = torch.tensor([[10.0, 0.0, 0.0]]).repeat(100, 1)
    banned = torch.zeros(100, 3, dtype=torch.bool)
    banned[:, 0] = True
    s = batch(100, 3, banned_mask=banned)
    assert (sample(logits, s).token_ids != 0).all()


def test_logit_bias_is_added_before_the_choice_greedy_or_sampled():
    logits = torch.randn(4, 10)
    weakest = logits.argmin(-1)
    rows = torch.tensor([0, 1, 3])  # row 2 has no bias
    bias = dict(
        bias_rows=rows, bias_ids=weakest[rows], bias_values=torch.full((3,), 100.0)
    )
    s = batch(
        4, 10, temperatures=torch.tensor([0.0, 1.0, 0.0, 1.0]), top_logprobs=0, **bias
    )
    out = sample(logits.clone(), s)
    assert (
        out.token_ids[rows].tolist() == weakest[rows].tolist()
    )  # +100 outweighs any randn logit
    assert out.token_ids[2] == logits[2].argmax()
    raw = torch.log_softmax(logits, -1)  # logprobs stay the model's own
    torch.testing.assert_close(
        out.logprobs, raw.gather(1, out.token_ids.view(-1, 1)).view(-1)
    )
    banned = logits.argmax(-1)
    bias = dict(
        bias_rows=torch.arange(4), bias_ids=banned, bias_values=torch.full((4,), -100.0)
    )
    s = batch(4, 10, temperatures=torch.zeros(4), all_greedy=True, **bias)
    assert (sample(logits.clone(), s).token_ids != banned).all()


def test_logprobs_are_raw_log_softmax():
    logits = torch.randn(4, 10)
    s = batch(4, 10, temperatures=torch.zeros(4), all_greedy=True, top_logprobs=3)
    out = sample(logits, s)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.max(-1).values)
    torch.testing.assert_close(out.top_logprobs, ref.topk(3).values)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"n": 100}, "n must be"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        (
            {"logit_bias": {1000: 5.0}},
            "logit_bias names token id 1000, which is outside the vocabulary",
        ),
        ({"logit_bias": {"-3": 5.0}}, "token id -3"),
        ({"logit_bias": {"abc": 5.0}}, "logit_bias key 'abc' is not a token id"),
        (
            {"logit_bias": {"7": 100.5}},
            r"logit_bias for token id 7 must be .* \[-100, 100\], got 100.5",
        ),
        ({"logit_bias": {"7": "high"}}, "logit_bias for token id 7"),
    ],
)
def test_invalid_params_say_what_is_wrong(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs).validate(vocab_size=1000)


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_a_rejection_tested_draft_leaves_the_distribution_unchanged(draft):
    """Rows verifying a drafted token yield exactly the target distribution after temperature and
    top-k / top-p (the draft's probability, high, middling or cut off, does not matter); each
    token's frequency over 200,000 rows is within 5 standard deviations of its probability."""
    torch.manual_seed(draft)
    rows, vocab = 200_000, 8
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    s = batch(
        rows,
        vocab,
        temperatures=torch.full((rows,), 0.8),
        top_ks=torch.full((rows,), 6, dtype=torch.int64),
        top_ps=torch.full((rows,), 0.97),
    )
    s.draft_ids = torch.full((rows,), draft, dtype=torch.int64)
    s.accept_uniforms = torch.rand(rows)
    out = sample(logits.repeat(rows, 1), s)
    # the target: softmax(logits / T), the top 6, the smallest prefix reaching 0.97, renormalised
    probs = torch.softmax(logits / 0.8, dim=-1)
    probs[6:] = 0
    keep = (probs.cumsum(0) - probs) <= 0.97
    probs = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
    freq = torch.bincount(out.token_ids, minlength=vocab).double() / rows
    sigma = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)
    assert torch.equal(out.accepted, out.token_ids == draft)


def test_greedy_rows_keep_a_draft_only_if_it_is_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [0.1, 2.0, 0.3], [5.0, 0.0, 0.0]])
    s = batch(3, 3, temperatures=torch.zeros(3), all_greedy=True)
    s.draft_ids = torch.tensor([1, 2, -1])
    s.accept_uniforms = torch.zeros(3)
    out = sample(logits, s)
    assert out.token_ids.tolist() == [1, 1, 0]
    assert out.accepted.tolist() == [True, False, False]


def test_greedy_argmax_is_torch_argmax_for_any_layout():
    """The kernel where it can read the rows, torch.argmax elsewhere: the same answers either way."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 700, generator=gen)
    wide[2, 100] = float("nan")
    wide[3, :] = -float("inf")
    cases = [
        wide,
        wide[:, :600],
        wide[:1].expand(3, 700),
        wide.t(),
        wide.double(),
        torch.randn(2, 3, 40, generator=gen),
    ]
    for x in cases:
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
