"""Embeddings of whole inputs: the model's final hidden states (after the final norm), pooled.

An input is only read, never continued, so nothing of generation is touched: no request, no page
of the KV pool or its allocator, no prefix-cache entry. Each forward gets a scratch KV pool of its
own, sized to its tokens and dropped after it; the model then runs its ordinary prefill over it
(the same attention, kernels and masks as a prompt's prefill, so the result is exactly the hidden
states a generation computes for those tokens). Several inputs share one forward, up to
`EMBED_BATCH_TOKENS` tokens (`strata.engine.limits.embed_batches`; a longer input runs alone):

    forward:   tokens  [ a0 a1 a2 a3 | b0 b1 | c0 c1 c2 ]    one extend (prefill) entry per input
    scratch:   pages   [ a: 0 .. ceil(4 / ps) - 1 | b: next pages | c: ... ]   positions from 0
    pooling:   last = the input's last row (a3, b1, c2); mean = the mean of its rows

A pooled vector may then be cut to its first `dimensions` values (matryoshka-style) and
L2-normalised, in that order, in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from strata.cache.kv_layouts import KV_LAYOUTS
from strata.cache.kv_pool import KVPool
from strata.engine.limits import SizeLimits, embed_batches
from strata.layers.attention import AttentionMetadata
from strata.model_config import ModelConfig
from strata.models import family_spec

POOLINGS = ("last", "mean")


def check_embed_request(
    token_id_lists: Sequence[Sequence[int]],
    pooling: str,
    dimensions: int | None,
    *,
    vocab_size: int,
    hidden_size: int,
    context_len: int,
) -> None:
    """Raise ValueError (a LimitError where a length is wrong) saying what to change."""
    if pooling not in POOLINGS:
        raise ValueError(
            f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}"
        )
    if not token_id_lists:
        raise ValueError("input is empty; send at least one input")
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise ValueError(
            f"dimensions must be between 1 and {hidden_size} (this model's hidden size), "
            f"got {dimensions}"
        )
    limits = SizeLimits(context_len, context_len)
    for ids in token_id_lists:
        limits.check_input(len(ids))
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"input has token id {bad}; this model's token ids are 0 .. {vocab_size - 1}"
            )


def scratch_pool(
    mc: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVPool:
    """A pool for one forward's tokens, in the model's KV layout. Every layer keeps every token (no
    window groups): a sliding layer's window is applied by attention's mask, as with --sliding-kv
    full."""
    flat = KV_LAYOUTS[family_spec(mc.architecture).kv_layout].flat
    if flat is None:
        raise ValueError(
            f"embeddings are not available for {mc.architecture} models (their KV layout has "
            "no scratch pool)"
        )
    return flat(mc, mc.num_layers, num_pages, page_size, dtype, device)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run with `threads` CPU threads (None: as set), then restore the count set before."""
    before = torch.get_num_threads()
    if threads is not None and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@torch.inference_mode()
def embed(
    model: torch.nn.Module,
    mc: ModelConfig,
    token_id_lists: Sequence[Sequence[int]],
    pooling: str = "last",
    *,
    normalize: bool = True,
    dimensions: int | None = None,
    page_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
    threads: int | None = None,
) -> np.ndarray:
    """Pooled final hidden states: float32 [len(token_id_lists), dimensions or hidden].

    The caller has checked the inputs (`check_embed_request`)."""
    out = np.empty(
        (len(token_id_lists), dimensions or mc.hidden_size), dtype=np.float32
    )
    with torch_threads(threads):
        for batch in embed_batches([len(ids) for ids in token_id_lists]):
            inputs = [token_id_lists[i] for i in batch]
            pooled = _embed_batch(
                model, mc, inputs, pooling, page_size, kv_dtype, device
            )  # [len(batch), hidden] float32
            if dimensions is not None:
                pooled = pooled[:, :dimensions]
            if normalize:
                pooled = torch.nn.functional.normalize(pooled, dim=-1)
            out[batch] = pooled.cpu().numpy()
    return out


def _embed_batch(
    model: torch.nn.Module,
    mc: ModelConfig,
    inputs: Sequence[Sequence[int]],
    pooling: str,
    page_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    lengths = [len(ids) for ids in inputs]
    pages_of = [math.ceil(n / page_size) for n in lengths]
    # input b owns pages first[b] .. first[b] + pages_of[b] - 1 of the scratch pool
    first = np.cumsum([0, *pages_of[:-1]])
    page_table = torch.zeros((len(inputs), max(pages_of)), dtype=torch.int64)
    for b, (start, n) in enumerate(zip(first, pages_of)):
        page_table[b, :n] = torch.arange(start, start + n)
    kv = scratch_pool(mc, sum(pages_of), page_size, kv_dtype, device)
    # every input is one extend entry from position 0: q_len = kv_len = its length
    meta = AttentionMetadata.build(lengths, lengths, page_table, page_size, 0, device)
    ids = torch.tensor(
        [t for seq in inputs for t in seq], dtype=torch.int64, device=device
    )
    hidden = model(ids, meta.positions, meta, kv).float()  # [T, hidden]
    ends = torch.tensor(np.cumsum(lengths), device=device)
    if pooling == "last":
        return hidden[ends - 1]
    owner = meta.token_owner.to(device)  # [T] -> its input
    sums = torch.zeros((len(inputs), hidden.shape[1]), device=device)
    sums.index_add_(0, owner, hidden)
    return sums / torch.tensor(lengths, dtype=torch.float32, device=device)[:, None]
