"""Vectorised sampling over a batch: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Every operation is over the whole [B, vocab] logits tensor; the only per-request Python work is
drawing one uniform number per sampled row from that request's own generator, which is what makes
a seeded request's output independent of whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    output_counts: torch.Tensor | None = None  # [B, V] occurrences of each token in the output
    seen_mask: torch.Tensor | None = None  # [B, V] token occurs in prompt or output
    banned_mask: torch.Tensor | None = None  # [B, V] tokens that may not be sampled yet (min_new_tokens)
    top_logprobs: int | None = None  # max k over the rows that want logprobs; None: nobody does


ROW_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")


def sampling_row(params, vocab_size: int) -> tuple[torch.Tensor, int]:
    """One request's sampling numbers as a float32 row (ROW_FIELDS order; temperature 0 for greedy)
    and its effective top_k, built once at admission: a value the tensors cannot hold fails that
    request there, never a batch it shares later."""
    values = [0.0 if params.is_greedy else params.temperature] + [getattr(params, f) for f in ROW_FIELDS[1:]]
    row = torch.tensor(values, dtype=torch.float32)
    if not bool(torch.isfinite(row).all()):
        raise ValueError(f"sampling parameters {dict(zip(ROW_FIELDS, values))} do not fit in float32")
    top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
    return row, top_k


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] logprob of the chosen token
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


def apply_penalties(logits: torch.Tensor, s: SamplingBatch) -> torch.Tensor:
    """Return penalised logits (a new tensor).

    repetition (HF): for tokens seen in prompt or output, logit / p if positive else logit * p.
    frequency / presence (OpenAI): logit - f * count - p * (count > 0), over output tokens.
    """
    if s.repetition_penalties is not None and s.seen_mask is not None:
        p = s.repetition_penalties.view(-1, 1)
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(s.seen_mask, penalised, logits)
    if s.output_counts is not None:
        counts = s.output_counts.to(logits.dtype)
        if s.frequency_penalties is not None:
            logits = logits - s.frequency_penalties.view(-1, 1) * counts
        if s.presence_penalties is not None:
            logits = logits - s.presence_penalties.view(-1, 1) * (counts > 0).to(logits.dtype)
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


def sample(logits: torch.Tensor, s: SamplingBatch) -> SamplerOutput:
    """logits: [B, V] float32 raw model outputs. Logprobs are reported from the raw distribution."""
    out = SamplerOutput(token_ids=torch.empty(0))
    raw_logprobs = torch.log_softmax(logits, dim=-1) if s.top_logprobs is not None else None
    logits = apply_penalties(logits, s)
    greedy_ids = logits.argmax(dim=-1)
    if s.all_greedy:
        out.token_ids = greedy_ids
    else:
        temps = torch.where(s.temperatures > 0, s.temperatures, torch.ones_like(s.temperatures))
        probs = torch.softmax(logits / temps.view(-1, 1), dim=-1)
        probs_sorted, order = probs.sort(dim=-1, descending=True)
        kept = filter_probs(probs_sorted, s)
        cdf = kept.cumsum(-1)
        target = s.uniforms.view(-1, 1) * cdf[:, -1:]
        pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
        sampled_ids = order.gather(1, pick).view(-1)
        out.token_ids = torch.where(s.temperatures > 0, sampled_ids, greedy_ids)
    if raw_logprobs is not None:
        out.logprobs = raw_logprobs.gather(1, out.token_ids.view(-1, 1)).view(-1)
        if s.top_logprobs:
            out.top_logprobs, out.top_ids = raw_logprobs.topk(s.top_logprobs, dim=-1)
    return out
