"""`--speculative-algorithm mtp`: drafts from the checkpoint's multi-token prediction layer
(`strata.models.mtp`), fed with the target's own final hidden states.

The MTP layer keeps paged KV of its own (one layer: a pool and allocator of its own, sized like the
target's): per request, one row per position p the target has computed and whose next token is
known, made from (h_p, token_{p+1}). After every step (`extend`), each request's newly committed
positions — a prefill chunk's, a decode's one, a verification's accepted run plus the target's own
token — go through the layer in one batched forward; the layer's state at the last of them is kept.

To draft k tokens (`draft`), that state's logits give the first (the token after the one the target
just produced), and k - 1 chained single-row steps give the rest: each feeds the drafted token with
the layer's previous state in place of the target's. Chained rows are written past the committed
ones and overwritten by the next `extend`, so nothing needs undoing when drafts are rejected.

Where the target computed no hidden states — a prompt prefix that came from the radix cache, a
prefill done by a PD peer — the layer's rows start at the first position the target computed here
(its attention does not see the prefix; drafts may be weaker, output never changes). A request that
was retracted and recomputed starts over the same way. Drafts are argmax: deterministic, so the
target's rejection test keeps its distribution for sampled requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from strata.cache.allocator import PageAllocator
from strata.cache.kv_layouts import KV_LAYOUTS
from strata.engine.draft_rows import DraftOptions, Rows, RowsByRequest
from strata.layers.attention import AttentionMetadata
from strata.layers.sampler import argmax_rows
from strata.models import family_spec
from strata.weights.mtp import load_mtp_layer

logger = logging.getLogger(__name__)


@dataclass
class MTPSeq(Rows):
    """One request's rows in the MTP layer, and the layer's state at the last row (None before any)."""

    state: torch.Tensor | None = None


class MTPDrafter:
    needs_hidden = (
        True  # the model runner keeps each step's final hidden states for `extend`
    )

    def __init__(
        self,
        target: torch.nn.Module,
        model_dir: str | Path,
        options: DraftOptions,
        vocab_size: int,
    ):
        cfg = target.config
        self.target = target
        dtype, device, page_size = options.dtype, options.device, options.page_size
        self.layer = load_mtp_layer(
            Path(model_dir),
            target,
            dtype,
            device,
            options.context_len,
            options.quantization,
        )
        if cfg.mtp_layers > 1:
            logger.info(
                "multi-token prediction: %d layers; the first is chained",
                cfg.mtp_layers,
            )
        num_pages = options.num_pages
        # one layer of the target's KV layout
        flat = KV_LAYOUTS[family_spec(cfg.architecture).kv_layout].flat
        if flat is None:
            raise ValueError(
                f"--speculative-algorithm mtp: {cfg.architecture}'s KV layout has no pool for an MTP layer"
            )
        self.kv = flat(cfg, 1, num_pages, page_size, dtype, device)
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.device = device
        self.vocab_size = vocab_size
        self.rows = RowsByRequest(MTPSeq, self.allocator)
        self.seqs = self.rows.seqs  # rid -> MTPSeq

    # ------------------------------------------------------------------ after each step

    @torch.inference_mode()
    def extend(self, items: list[tuple[str, int, torch.Tensor, list[int]]]) -> None:
        """items: (rid, first position p0, the target's hidden states [m, hidden] at p0.., the tokens
        at p0 + 1..). Adds those rows to each request's MTP KV and keeps the layer's last state."""
        work = []
        for rid, p0, hidden, tokens in items:
            seq = self.rows.seq_at(rid, p0)
            if not self.allocator.grow(seq.pages, seq.length + len(tokens)):
                # the pool is full: this request starts over after these rows
                self.rows.restart(rid, p0 + len(tokens))
                continue
            work.append((seq, hidden, tokens))
        if not work:
            return
        work.sort(
            key=lambda w: len(w[2]) != 1
        )  # decodes first, as attention metadata expects
        states = self._forward(
            [s for s, _, _ in work],
            [t for _, _, t in work],
            torch.cat([h for _, h, _ in work]),
        )
        end = 0
        for seq, _, tokens in work:
            end += len(tokens)
            seq.length += len(tokens)
            seq.state = states[end - 1].clone()

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def draft(self, wants: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """wants: (rid, the target's sequence, tokens to draft). Returns each one's drafts: none for
        a request whose rows do not reach its last token yet, fewer where the pool is short."""
        drafts: list[list[int]] = [[] for _ in wants]
        live = []
        for i, (rid, seq_ids, k) in enumerate(wants):
            seq = self.seqs.get(rid)
            # committed rows end one before the sequence's last token (which the target feeds next)
            if (
                k > 0
                and seq is not None
                and seq.state is not None
                and seq.end == len(seq_ids) - 1
            ):
                live.append((i, seq))
        if not live:
            return drafts
        states = torch.stack([s.state for _, s in live])
        prev = {}
        for r, ((i, _), t) in enumerate(zip(live, self._argmax(states))):
            drafts[i].append(t)
            prev[i] = states[r]
        for step in range(1, max(wants[i][2] for i, _ in live)):
            # the row at position end + step - 1: the previous draft after the layer's previous state
            live = [(i, s) for i, s in live if len(drafts[i]) < wants[i][2]]
            live = [
                (i, s) for i, s in live if self.allocator.grow(s.pages, s.length + step)
            ]
            if not live:
                break
            states = self._forward(
                [s for _, s in live],
                [[drafts[i][-1]] for i, _ in live],
                torch.stack([prev[i] for i, _ in live]),
                offsets=[step - 1] * len(live),
            )
            for r, ((i, _), t) in enumerate(zip(live, self._argmax(states))):
                drafts[i].append(t)
                prev[i] = states[r]
        return drafts

    def _argmax(self, states: torch.Tensor) -> list[int]:
        logits = self.target.compute_logits(states)[:, : self.vocab_size]
        return argmax_rows(logits).tolist()

    # ------------------------------------------------------------------ the layer's forward

    def _forward(
        self,
        seqs: list[MTPSeq],
        tokens: list[list[int]],
        hidden: torch.Tensor,
        offsets: list[int] | None = None,
    ) -> torch.Tensor:
        """One batched forward of the MTP layer: per request, `tokens` at its rows from
        `length + offset` on (offsets: 0 unless chaining). Returns the layer's states [T, hidden]."""
        offsets = offsets or [0] * len(seqs)
        q_lens = [len(t) for t in tokens]
        kv_lens = [s.length + o + n for s, o, n in zip(seqs, offsets, q_lens)]
        page_table = np.zeros(
            (len(seqs), max(len(s.pages) for s in seqs)), dtype=np.int64
        )
        for b, s in enumerate(seqs):
            page_table[b, : len(s.pages)] = s.pages
        num_decode = sum(1 for n in q_lens if n == 1)
        meta = AttentionMetadata.build(
            q_lens,
            kv_lens,
            torch.from_numpy(page_table),
            self.page_size,
            num_decode,
            self.device,
        )
        # a row at position p (row index p - first) carries token p + 1, at RoPE position p + 1
        firsts = torch.tensor([s.first for s in seqs], device=self.device)
        positions = meta.positions + firsts[meta.token_owner.to(self.device)] + 1
        ids = torch.tensor(
            [t for ts in tokens for t in ts], dtype=torch.int64, device=self.device
        )
        embeds = self.target.embed_tokens(ids)
        if self.target.config.scale_embeddings:
            embeds = embeds * torch.tensor(
                self.target.config.hidden_size**0.5, dtype=embeds.dtype
            )
        return self.layer(embeds, hidden.to(embeds.dtype), positions, meta, self.kv)

    # ------------------------------------------------------------------ pages

    def finish(self, rid: str) -> None:
        self.rows.drop(rid)
