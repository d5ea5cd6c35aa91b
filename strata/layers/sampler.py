"""Vectorised sampling over a batch: logit bias, grammar masks, penalties, temperature, top-k, top-p,
min-p, seeded draws, logprobs.

Every operation is over the whole [B, vocab] logits tensor; the only per-request Python work is
drawing one uniform number per sampled row from that request's own generator, which is what makes
a seeded request's output independent of whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels import usable


@dataclass
class SamplingBatch:
    """Per-row sampling tensors, built by the model runner for the rows being sampled."""

    temperatures: torch.Tensor  # [B] float32, 0 for greedy rows
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] int64, vocab size where disabled
    min_ps: torch.Tensor  # [B]
    uniforms: torch.Tensor  # [B] one U(0,1) draw per row from the request's generator
    all_greedy: bool
    # penalties (None when no row in the batch uses them)
    repetition_penalties: torch.Tensor | None = None  # [B]
    frequency_penalties: torch.Tensor | None = None  # [B]
    presence_penalties: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = (
        None  # [B, V] occurrences of each token in the output
    )
    seen_mask: torch.Tensor | None = None  # [B, V] token occurs in prompt or output
    banned_mask: torch.Tensor | None = (
        None  # [B, V] tokens that may not be sampled yet (min_new_tokens)
    )
    # logit_bias (None when no row has one): logits[bias_rows[i], bias_ids[i]] += bias_values[i]
    bias_rows: torch.Tensor | None = None  # [N] int64
    bias_ids: torch.Tensor | None = None  # [N] int64
    bias_values: torch.Tensor | None = None  # [N] float32
    top_logprobs: int | None = (
        None  # max k over the rows that want logprobs; None: nobody does
    )
    # structured output (None when no row is constrained this step): bit t of grammar_bitmask[i] set =
    # token t allowed in row grammar_rows[i]; rows not listed are unconstrained
    grammar_rows: torch.Tensor | None = None  # [G] int64
    grammar_bitmask: torch.Tensor | None = (
        None  # [G, ceil(V' / 32)] int32, V' >= V (the grammar's vocab)
    )
    # speculative decoding (None when no row verifies a draft): the drafted token this row's choice is
    # checked against (-1: none), and a second U(0,1) draw per row for the rejection test
    draft_ids: torch.Tensor | None = None  # [B] int64
    accept_uniforms: torch.Tensor | None = None  # [B]


ROW_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def sampling_row(params, vocab_size: int) -> tuple[torch.Tensor, int]:
    """One request's sampling numbers as a float32 row (ROW_FIELDS order; temperature 0 for greedy)
    and its effective top_k, built once at admission: a value the tensors cannot hold fails that
    request there, never a batch it shares later."""
    values = [0.0 if params.is_greedy else params.temperature] + [
        getattr(params, f) for f in ROW_FIELDS[1:]
    ]
    row = torch.tensor(values, dtype=torch.float32)
    if not bool(torch.isfinite(row).all()):
        raise ValueError(
            f"sampling parameters {dict(zip(ROW_FIELDS, values))} do not fit in float32"
        )
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    return row, top_k


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]
    accepted: torch.Tensor | None = (
        None  # [B] bool: the row's draft was kept (token_ids holds it); with draft_ids
    )


_BIT_VALUES: dict[
    torch.device, torch.Tensor
] = {}  # [8] uint8: 1, 2, 4, ..., 128 per device


def unpack_bitmask(
    bitmask: torch.Tensor, vocab_size: int, *, invert: bool = False
) -> torch.Tensor:
    """[G, words] int32 bitmask -> [G, vocab_size] bool, True where the token is allowed (forbidden
    with invert=True).

    Token t is bit t % 32 of word t // 32; read as little-endian bytes that is bit t % 8 of byte t // 8.
    On the CPU numpy's unpackbits does it in one vectorised pass; elsewhere one broadcast AND."""
    as_bytes = bitmask.contiguous().view(
        torch.uint8
    )  # [G, 4 * words], little-endian on every torch device
    if invert:
        as_bytes = ~as_bytes
    if bitmask.device.type == "cpu":
        bits = np.unpackbits(
            as_bytes.numpy(), axis=-1, bitorder="little"
        )  # [G, 32 * words] uint8
        return torch.from_numpy(bits.view(np.bool_))[:, :vocab_size]
    return unpack_bytes_torch(as_bytes)[:, :vocab_size]


def unpack_bytes_torch(as_bytes: torch.Tensor) -> torch.Tensor:
    """[G, n] uint8 -> [G, 8 * n] bool, bit j of byte i at 8 * i + j, on any device (one broadcast AND)."""
    values = _BIT_VALUES.get(as_bytes.device)
    if values is None:
        values = _BIT_VALUES[as_bytes.device] = torch.tensor(
            [1 << j for j in range(8)], dtype=torch.uint8, device=as_bytes.device
        )
    bits = torch.bitwise_and(as_bytes.unsqueeze(-1), values)  # [G, n, 8]
    return bits.view(as_bytes.shape[0], -1).bool()


def apply_token_bitmask_(
    logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
) -> None:
    """In place: set to -inf every logit a row's grammar forbids (rows[i] is masked by bitmask[i];
    other rows are untouched).

    A row whose grammar allows nothing at all keeps its logits: that happens only past the
    grammar's end, where the scheduler finishes the request before sampling again."""
    usable = bitmask.ne(0).any(dim=-1)  # [G]
    if not bool(usable.all()):
        rows, bitmask = rows[usable], bitmask[usable]
    forbidden = unpack_bitmask(bitmask, logits.shape[-1], invert=True)  # [G, V]
    if (
        rows.shape[0] == logits.shape[0]
    ):  # every row constrained, in order (the runner lists rows ascending)
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))


def logit_bias_tensors(
    logit_bias: dict[int, float], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's validated logit_bias as (token ids [N] int64, biases [N] float32)."""
    ids = torch.tensor(list(logit_bias), dtype=torch.int64, device=device)
    return ids, torch.tensor(
        list(logit_bias.values()), dtype=torch.float32, device=device
    )


def apply_penalties(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """Return biased and penalised logits (a new tensor).

    logit_bias (OpenAI): added first, as if the model had written the biased logits.
    repetition (HF): for tokens seen in prompt or output, logit / p if positive else logit * p.
    frequency / presence (OpenAI): logit - f * count - p * (count > 0), over output tokens.
    """
    if s.bias_ids is not None:
        assert s.bias_rows is not None and s.bias_values is not None  # set together
        logits = logits.index_put(
            (s.bias_rows, s.bias_ids), s.bias_values.to(logits.dtype), accumulate=True
        )
    if s.repetition_penalties is not None and s.seen_mask is not None:
        p = s.repetition_penalties.view(-1, 1)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(s.seen_mask, penalised, logits)
    if s.output_counts is not None:
        counts = s.output_counts.to(logits.dtype)
        if s.frequency_penalties is not None:
            logits = logits - s.frequency_penalties.view(-1, 1) * counts
        if s.presence_penalties is not None:
            logits = logits - s.presence_penalties.view(-1, 1) * (counts > 0).to(
                logits.dtype
            )
    if s.banned_mask is not None:
        logits = logits.masked_fill(s.banned_mask, float("-inf"))
    return logits


def filter_probs(probs_sorted: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """probs sorted descending per row -> same with top-k / top-p / min-p cut-offs zeroed."""
    vocab = probs_sorted.shape[-1]
    ranks = torch.arange(vocab, device=probs_sorted.device).view(1, -1)
    drop = ranks >= s.top_ks.view(-1, 1)
    # top-p keeps the smallest prefix whose mass reaches p (the token crossing p is kept)
    mass_before = probs_sorted.cumsum(-1) - probs_sorted
    drop |= mass_before > s.top_ps.view(-1, 1)
    drop |= probs_sorted < (s.min_ps.view(-1, 1) * probs_sorted[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return probs_sorted.masked_fill(drop, 0.0)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> each row's argmax, as torch.argmax (the first NaN, else the first maximum); the
    CPU kernel reads a float32 row by vector maxima, PyTorch's reduction one value at a time."""
    ops = usable(logits)
    readable = (
        logits.dtype == torch.float32
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    )
    readable = readable and (
        logits.shape[0] <= 1 or logits.stride(0) >= logits.shape[1]
    )  # rows apart
    if ops is not None and readable and hasattr(ops, "argmax_rows"):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(logits: torch.Tensor, s: SamplingBatch) -> SamplerOutput:
    """logits: [B, V] float32 raw model outputs (may be modified in place). Logprobs are reported from
    the raw distribution; logit bias, grammar masks, penalties and the cut-offs shape only the choice.

    Rows with a draft token d (speculative decoding) decide whether to keep it. Greedy: kept iff it is
    the argmax. Sampled, with p the row's final distribution (after penalties, temperature and the
    cut-offs): kept with probability p(d), else a token is drawn from p with d removed. Drafts are
    deterministic, so the token a row yields has distribution exactly p:
    P(x) = p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d]."""
    out = SamplerOutput(token_ids=torch.empty(0))
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1) if s.top_logprobs is not None else None
    )
    logits = apply_penalties(logits, s)
    if s.grammar_bitmask is not None:
        assert s.grammar_rows is not None  # set together
        apply_token_bitmask_(logits, s.grammar_rows, s.grammar_bitmask)
    greedy_ids = argmax_rows(logits)
    drafts = s.draft_ids
    if s.all_greedy:
        out.token_ids = greedy_ids
        if drafts is not None:
            out.accepted = greedy_ids == drafts
    else:
        temps = torch.where(
            s.temperatures > 0, s.temperatures, torch.ones_like(s.temperatures)
        )
        probs = torch.softmax(logits / temps.view(-1, 1), dim=-1)
        probs_sorted, order = probs.sort(dim=-1, descending=True)
        kept = filter_probs(probs_sorted, s)
        accepted = None
        if drafts is not None:
            assert s.accept_uniforms is not None  # drawn with the drafts
            kept, accepted = _judge_drafts(kept, order, drafts, s.accept_uniforms)
        cdf = kept.cumsum(-1)
        target = s.uniforms.view(-1, 1) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
        sampled_ids = order.gather(1, pick).view(-1)
        sampled = s.temperatures > 0
        out.token_ids = torch.where(sampled, sampled_ids, greedy_ids)
        if drafts is not None:
            assert accepted is not None
            out.accepted = torch.where(sampled, accepted, greedy_ids == drafts)
            out.token_ids = torch.where(out.accepted, drafts, out.token_ids)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, out.token_ids.view(-1, 1)).view(-1)
        if s.top_logprobs:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(s.top_logprobs, dim=-1)
    return out


def _judge_drafts(
    kept: torch.Tensor,
    order: torch.Tensor,
    drafts: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection test of `sample` over sorted, cut-off probabilities (unnormalised).

    Returns (the distribution to draw from where the draft is rejected: kept with the draft's mass
    removed on rows that have one, whether each row's draft is kept)."""
    has = drafts >= 0
    rank = (
        (order == drafts.clamp(min=0).view(-1, 1)).int().argmax(dim=-1, keepdim=True)
    )  # [B, 1]
    mass = kept.gather(1, rank).view(-1)
    accepted = has & (uniforms * kept.sum(-1) < mass)
    residual = kept.scatter(1, rank, 0.0)
    # a row whose whole mass was the draft always keeps it; its residual is never drawn from
    return torch.where(has.view(-1, 1), residual, kept), accepted
