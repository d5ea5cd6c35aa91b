"""The model runner: turns a `ScheduleBatch` into tensors, runs one forward, samples.

It owns the model and the KV pool; it never decides what runs (the scheduler does).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from strata.cache.allocator import WindowGroup
from strata.cache.kv_pool import MHAKVPool
from strata.engine.batch import ForwardBatch, ScheduleBatch
from strata.engine.request import Req
from strata.grammar.state import fill_bitmasks
from strata.layers.attention import AttentionMetadata
from strata.layers.sampler import SamplerOutput, SamplingBatch, sample, sampling_row


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, kv_pool: MHAKVPool, device: torch.device, vocab_size: int, seed: int,
        groups: Sequence[WindowGroup] = (),
    ):
        self.model = model
        self.kv = kv_pool
        # each window group's page map (primary page -> its page), sharing the allocator's memory
        self.group_maps = [torch.from_numpy(g.to_group) for g in groups]
        self.device = device
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def prepare(self, batch: ScheduleBatch) -> ForwardBatch:
        ids: list[int] = []
        kv_lens: list[int] = []
        sample_rows: list[int] = []
        max_pages = max(len(r.pages) for r in batch.reqs)
        page_table = np.zeros((len(batch.reqs), max_pages), dtype=np.int64)
        row = 0
        for b, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            end = req.kv_len + n
            ids.extend(req.seq_slice(req.kv_len, end))
            page_table[b, : len(req.pages)] = req.pages
            kv_lens.append(end)
            row += n
            if end == req.seq_len:
                sample_rows.append(row - 1)
        attn = AttentionMetadata.build(
            batch.extend_lens, kv_lens, torch.from_numpy(page_table), self.kv.page_size, batch.num_decode, self.device
        )
        if self.group_maps:  # window groups: the same positions in their own pages
            replaying = [b for b, r in enumerate(batch.reqs) if r.replay_from is not None]
            for g, to_group in enumerate(self.group_maps):
                table = to_group[attn.page_table]
                if replaying:
                    self._map_replayed_pages(batch, replaying, g, table)
                group_meta = attn.with_page_table(table)
                if replaying:
                    group_meta.key_floor = self._replay_floor(batch, replaying, g)
                attn.groups.append(group_meta)
            if replaying:
                self._keep_cached_full_kv(batch, replaying, attn)
        sampled = batch.sampled_reqs()
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=attn.positions,
            attn=attn,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sampling=self.sampling_batch(sampled) if sampled else None,
        )

    def _map_replayed_pages(self, batch: ScheduleBatch, rows: list[int], g: int, table: torch.Tensor) -> None:
        """--swa-replay: window group g reads and writes a replaying request's recomputed pages."""
        ps = self.kv.page_size
        for b in rows:
            req = batch.reqs[b]
            first = req.replay_from // ps
            table[b, first : first + len(req.replay_pages[g])] = torch.tensor(req.replay_pages[g])

    def _replay_floor(self, batch: ScheduleBatch, rows: list[int], g: int) -> torch.Tensor | None:
        """The first key each request may read in window group g: its replay start while some of its
        queries could still reach back past it (None once none can)."""
        if all(batch.reqs[b].kv_len >= batch.reqs[b].replay_from + self.kv.windows[g] - 1 for b in rows):
            return None
        floor = torch.zeros(len(batch.reqs), dtype=torch.int64)
        for b in rows:
            floor[b] = batch.reqs[b].replay_from
        return floor

    def _keep_cached_full_kv(self, batch: ScheduleBatch, rows: list[int], attn: AttentionMetadata) -> None:
        """Replayed positions (before replay_end) write their full-layer KV to the scratch page: the
        tree's copy, computed with the whole context, stays what every layer reads."""
        scratch = self.kv.scratch_page * self.kv.page_size
        positions = attn.positions.cpu()
        limit = torch.tensor([r.replay_end if r.replay_from is not None else 0 for r in batch.reqs])
        replayed = positions < limit[attn.token_owner]
        attn.out_slots[replayed.to(self.device)] = scratch + positions[replayed].to(self.device) % self.kv.page_size

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch) -> SamplerOutput | None:
        fb = self.prepare(batch)
        hidden = self.model(fb.input_ids, fb.positions, fb.attn, self.kv)
        if fb.sampling is None:
            return None
        # grammar masks are computed on the CPU while an accelerator runs the forward
        self.add_grammar_masks(batch.sampled_reqs(), fb.sampling)
        logits = self.model.compute_logits(hidden[fb.sample_rows])[:, : self.vocab_size]
        out = sample(logits, fb.sampling)
        out.token_ids = out.token_ids.cpu()
        return out

    def add_grammar_masks(self, reqs: list[Req], s: SamplingBatch) -> None:
        """Structured output: the next-token bitmask of each sampled request whose grammar is armed."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.needs_mask]
        if not rows:
            return
        bitmask = fill_bitmasks([reqs[i].grammar for i in rows])  # [G, words] int32
        s.grammar_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
        s.grammar_bitmask = torch.from_numpy(bitmask).to(self.device, non_blocking=True)

    def sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        dev, vocab = self.device, self.vocab_size
        params = [r.params for r in reqs]

        def col(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        for r in reqs:
            if r.sampling_row is None:  # a Req made outside the scheduler (which builds it at admission)
                r.sampling_row, r.top_k = sampling_row(r.params, vocab)
        rows = torch.stack([r.sampling_row for r in reqs]).to(dev)  # [B, len(ROW_FIELDS)]
        greedy = [p.is_greedy for p in params]
        uniforms = [0.0] * len(reqs)
        for i, r in enumerate(reqs):
            if not greedy[i]:  # draw only for sampled rows, so a seeded stream does not depend on its neighbours
                uniforms[i] = torch.rand(1, generator=r.generator or self.generator).item()
        s = SamplingBatch(
            temperatures=rows[:, 0],
            top_ps=rows[:, 1],
            top_ks=col([r.top_k for r in reqs], torch.int64),
            min_ps=rows[:, 2],
            uniforms=col(uniforms),
            all_greedy=all(greedy),
        )
        wants = [p.logprobs for p in params if p.logprobs is not None]
        s.top_logprobs = max(wants) if wants else None
        if any(p.repetition_penalty != 1.0 for p in params):
            s.repetition_penalties = rows[:, 3]
            s.seen_mask = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=dev)
            for i, r in enumerate(reqs):
                s.seen_mask[i, torch.tensor(r.prompt_ids + r.output_ids, dtype=torch.int64)] = True
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            s.frequency_penalties = rows[:, 4]
            s.presence_penalties = rows[:, 5]
            s.output_counts = torch.zeros(len(reqs), vocab, dtype=torch.int32, device=dev)
            for i, r in enumerate(reqs):
                if r.output_ids:
                    out = torch.tensor(r.output_ids, dtype=torch.int64)
                    s.output_counts[i].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        banned = [(i, r) for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens]
        if banned:
            s.banned_mask = torch.zeros(len(reqs), vocab, dtype=torch.bool, device=dev)
            for i, r in banned:
                stop_ids = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                ids = [t for t in stop_ids if t < vocab]
                if ids:
                    s.banned_mask[i, torch.tensor(ids)] = True
        return s
