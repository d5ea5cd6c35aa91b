"""The model runner: turns a `ScheduleBatch` into tensors, runs one forward, samples.

It owns the model and the KV pool; it never decides what runs (the scheduler does).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from strata.cache.allocator import WindowGroup
from strata.cache.kv_pool import KVPool
from strata.engine.batch import ForwardBatch, SampleRow, ScheduleBatch, sample_rows_of
from strata.engine.hooks import ForwardObserver
from strata.engine.request import Req
from strata.engine.step_threads import StepThreads
from strata.grammar.state import bitmask_words, fill_bitmasks
from strata.layers.attention import AttentionMetadata
from strata.layers.sampler import (
    SamplerOutput,
    SamplingBatch,
    logit_bias_tensors,
    sample,
    sampling_row,
)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: KVPool,
        device: torch.device,
        vocab_size: int,
        seed: int,
        groups: Sequence[WindowGroup] = (),
    ):
        self.model = model
        self.kv = kv_pool
        # each window group's page map (primary page -> its page), sharing the allocator's memory
        self.group_maps = [torch.from_numpy(g.to_group) for g in groups]
        self.device = device
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(
            seed
        )  # for requests without a seed
        # tensor/expert parallel (strata.distributed.runtime.ParallelRuntime): the other ranks run each step too
        self.parallel = None
        # --speculative-algorithm mtp reads the last step's final hidden states (every fed token's),
        # dspark the residual stream after the layers it captures (`DecoderForCausalLM.captured`)
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        # CPU: how many threads each forward runs on, chosen by measurement (None: torch's setting)
        self.step_threads: StepThreads | None = None
        self._threads = 0  # the count last set
        self.observers: list[ForwardObserver] = []  # `add_observer`
        # Engram models: token ids before each request's fed tokens its n-grams read (0: none)
        self.ngram_context: int = getattr(model, "ngram_context", 0)
        self.lora: Any = None  # strata.engine.lora.LoRAManager when adapters are served

    def add_observer(self, observer: ForwardObserver) -> None:
        """Tell `observer` where every later forward is (see `ForwardObserver`)."""
        self.observers.append(observer)

    def remove_observer(self, observer: ForwardObserver) -> None:
        """Stop telling `observer`; a no-op if it was not added."""
        if observer in self.observers:
            self.observers.remove(observer)

    def _piece(self, piece: str) -> contextlib.AbstractContextManager:
        """Tells the observers (if any) when `piece` of the forward starts and ends."""
        return _Piece(self.observers, piece) if self.observers else _NO_PIECE

    def prepare(self, batch: ScheduleBatch) -> ForwardBatch:
        ids: list[int] = []
        sample_rows: list[int] = []
        # attention entries: one per request, except that a request feeding drafts is k + 1 decode
        # entries (position j sees keys up to its own). Its queries then take the decode kernel's path,
        # arithmetic identical to decoding them one by one, so speculation cannot change greedy output.
        entries: list[Req] = []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        spans: list[tuple[Req, int]] = []  # (request, its entries)
        num_decode = batch.num_decode
        ngram_rows: list[np.ndarray] = []
        for req, n in zip(batch.reqs, batch.extend_lens):
            end = req.kv_len + n
            ids.extend(req.seq_slice(req.kv_len, min(end, req.seq_len)))
            ids.extend(req.draft_ids[: max(0, end - req.seq_len)])
            if self.ngram_context:
                ngram_rows.append(self._ngram_rows(req, ids[len(ids) - n :]))
            verifying = bool(req.draft_ids) and n == 1 + len(req.draft_ids)
            spans.append((req, n if verifying else 1))
            if verifying:
                entries.extend([req] * n)
                q_lens.extend([1] * n)
                kv_lens.extend(range(req.kv_len + 1, end + 1))
                num_decode += n
            else:
                entries.append(req)
                q_lens.append(n)
                kv_lens.append(end)
            if (
                end == req.fed_len
            ):  # the last position samples, and so does each drafted one
                sample_rows.extend(range(len(ids) - 1 - len(req.draft_ids), len(ids)))
        max_pages = max(len(r.pages) for r in entries)
        page_table = np.zeros((len(entries), max_pages), dtype=np.int64)
        e = 0
        for (
            req,
            rows,
        ) in spans:  # a verification's entries share one row of pages, converted once
            page_table[e : e + rows, : len(req.pages)] = req.pages
            e += rows
        attn = AttentionMetadata.build(
            q_lens,
            kv_lens,
            torch.from_numpy(page_table),
            self.kv.page_size,
            num_decode,
            self.device,
        )
        if self.group_maps:  # window groups: the same positions in their own pages
            replaying = [e for e, r in enumerate(entries) if r.replay_from is not None]
            for g, to_group in enumerate(self.group_maps):
                table = to_group[attn.page_table]
                if replaying:
                    self._map_replayed_pages(entries, replaying, g, table)
                group_meta = attn.with_page_table(table)
                if replaying:
                    group_meta.key_floor = self._replay_floor(entries, replaying, g)
                attn.groups.append(group_meta)
            if replaying:
                self._keep_cached_full_kv(entries, attn)
        rows = sample_rows_of(batch.sampled_reqs())
        return ForwardBatch(
            rows=rows,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=attn.positions,
            attn=attn,
            sample_rows=torch.tensor(
                sample_rows, dtype=torch.int64, device=self.device
            ),
            sampling=self.sampling_batch(rows) if rows else None,
            ngrams=self.model.prepare_ngrams(
                torch.from_numpy(np.concatenate(ngram_rows))
            )
            if ngram_rows
            else None,
        )

    def _ngram_rows(self, req: Req, fed: list[int]) -> np.ndarray:
        """[len(fed), K + 1]: for each fed position t, the ids at t - K .. t of its sequence, -1
        before position 0. The K ids before the first fed position come from the request's own token
        list, so a chunk, a decode, a radix hit or a recompute after retraction reads the same ones.

            seq:  ... [kv_len - K, kv_len) | fed: [kv_len, kv_len + n)
                       history                row j = ctx[j : j + K + 1]"""
        k = self.ngram_context
        history = req.seq_slice(max(0, req.kv_len - k), req.kv_len)
        ctx = np.array([-1] * (k - len(history)) + history + fed, dtype=np.int64)
        return np.lib.stride_tricks.sliding_window_view(ctx, k + 1)

    def _map_replayed_pages(
        self, entries: list[Req], rows: list[int], g: int, table: torch.Tensor
    ) -> None:
        """--swa-replay: window group g reads and writes a replaying request's recomputed pages."""
        ps = self.kv.page_size
        for b in rows:
            req = entries[b]
            first = req.replay_from // ps
            table[b, first : first + len(req.replay_pages[g])] = torch.tensor(
                req.replay_pages[g]
            )

    def _replay_floor(
        self, entries: list[Req], rows: list[int], g: int
    ) -> torch.Tensor | None:
        """The first key each request may read in window group g: its replay start while some of its
        queries could still reach back past it (None once none can)."""
        if all(
            entries[b].kv_len >= entries[b].replay_from + self.kv.windows[g] - 1
            for b in rows
        ):
            return None
        floor = torch.zeros(len(entries), dtype=torch.int64)
        for b in rows:
            floor[b] = entries[b].replay_from
        return floor

    def _keep_cached_full_kv(self, entries: list[Req], attn: AttentionMetadata) -> None:
        """Replayed positions (before replay_end) write their full-layer KV to the scratch page: the
        tree's copy, computed with the whole context, stays what every layer reads."""
        scratch = self.kv.scratch_page * self.kv.page_size
        positions = attn.positions.cpu()
        limit = torch.tensor(
            [r.replay_end if r.replay_from is not None else 0 for r in entries]
        )
        replayed = positions < limit[attn.token_owner]
        attn.out_slots[replayed.to(self.device)] = (
            scratch + positions[replayed].to(self.device) % self.kv.page_size
        )

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch) -> SamplerOutput | None:
        if self.step_threads is None:
            return self._forward(batch)
        num_tokens = batch.num_tokens
        threads = self.step_threads.threads_for(num_tokens)
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads
        start = time.perf_counter()
        out = self._forward(batch)
        self.step_threads.record(num_tokens, threads, time.perf_counter() - start)
        return out

    def _forward(self, batch: ScheduleBatch) -> SamplerOutput | None:
        with self._piece("prepare"):
            fb = self.prepare(batch)
        if self.parallel is not None:
            self.parallel.send_step(fb)
        if self.lora is not None:  # each row's adapter, for the LoRA linears
            self.lora.set_rows(
                [r.adapter for r in batch.reqs], batch.extend_lens, self.device
            )
        try:
            with self._piece("model"):
                if fb.ngrams is None:
                    hidden = self.model(fb.input_ids, fb.positions, fb.attn, self.kv)
                else:
                    hidden = self.model(
                        fb.input_ids, fb.positions, fb.attn, self.kv, ngrams=fb.ngrams
                    )
        finally:
            if self.lora is not None:
                self.lora.clear_rows()
        self.hidden = None
        if self.keep_hidden:  # a DSpark drafter reads the target's layers it asked for
            captured = getattr(self.model, "captured", None)
            self.hidden = hidden if captured is None else captured
        if fb.sampling is None:
            return None
        # grammar masks are computed on the CPU while an accelerator runs the forward
        self.add_grammar_masks(fb.rows, fb.sampling)
        sampled_hidden = hidden[fb.sample_rows]  # [num_sampled_rows, hidden]
        with self._piece("logits"):
            logits = self.model.compute_logits(sampled_hidden)
        logits = logits[:, : self.vocab_size]
        out = sample(logits, fb.sampling)
        out.token_ids = out.token_ids.cpu()
        if out.accepted is not None:
            out.accepted = out.accepted.cpu()
        return out

    def add_grammar_masks(self, rows: list[SampleRow], s: SamplingBatch) -> None:
        """Structured output: the next-token bitmask of each sampled row whose grammar is armed (a
        drafted row's: its request's grammar advanced over the drafts before it)."""
        grammars = {id(r.req): r.req.grammar for r in rows if r.req.grammar is not None}
        if not grammars:
            return
        if all(not r.req.draft_ids for r in rows):
            masked = [
                i
                for i, r in enumerate(rows)
                if r.req.grammar is not None and r.req.grammar.needs_mask
            ]
            if not masked:
                return
            bitmask = fill_bitmasks(
                [rows[i].req.grammar for i in masked]
            )  # [G, words] int32
        else:
            masked, bitmask = self._draft_grammar_masks(rows)
            if not masked:
                return
        s.grammar_rows = torch.tensor(masked, dtype=torch.int64, device=self.device)
        s.grammar_bitmask = torch.from_numpy(bitmask).to(self.device, non_blocking=True)

    @staticmethod
    def _draft_grammar_masks(rows: list[SampleRow]) -> tuple[list[int], np.ndarray]:
        """Masks row by row: each request's grammar is advanced over its drafts and rolled back."""
        words = bitmask_words(
            max(r.req.grammar.vocab_size for r in rows if r.req.grammar is not None)
        )
        bitmask = np.empty((len(rows), words), dtype=np.int32)
        masked: list[int] = []
        for i, row in enumerate(rows):
            grammar = row.req.grammar
            if grammar is None:
                continue
            if (
                row.before
            ):  # one more draft consumed since the previous row of this request
                grammar.accept(row.before[-1])
            if grammar.needs_mask:
                grammar.fill_bitmask(bitmask, len(masked))
                masked.append(i)
            if row.draft < 0:  # the request's last row
                grammar.rollback(len(row.before))
        return masked, bitmask[: len(masked)]

    def sampling_batch(self, rows: list[SampleRow]) -> SamplingBatch:
        """The sampler's tensors for these rows. A row after drafts sees them as output already
        (penalties, min_new_tokens), as the request will if they are accepted."""
        dev, vocab = self.device, self.vocab_size
        reqs = [r.req for r in rows]
        params = [r.params for r in reqs]

        def col(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        for r in reqs:
            if (
                r.sampling_row is None
            ):  # a Req made outside the scheduler (which builds it at admission)
                r.sampling_row, r.top_k = sampling_row(r.params, vocab)
        table = torch.stack([r.sampling_row for r in reqs]).to(
            dev
        )  # [B, len(ROW_FIELDS)]
        greedy = [p.is_greedy for p in params]
        drafting = any(row.draft >= 0 for row in rows)
        uniforms, accept_uniforms = [0.0] * len(rows), [0.0] * len(rows)
        for i, row in enumerate(rows):
            if not greedy[
                i
            ]:  # draw only for sampled rows, so a seeded stream does not depend on its neighbours
                gen = row.req.generator or self.generator
                uniforms[i] = torch.rand(1, generator=gen).item()
                if row.draft >= 0:
                    accept_uniforms[i] = torch.rand(1, generator=gen).item()
        s = SamplingBatch(
            temperatures=table[:, 0],
            top_ps=table[:, 1],
            top_ks=col([r.top_k for r in reqs], torch.int64),
            min_ps=table[:, 2],
            uniforms=col(uniforms),
            all_greedy=all(greedy),
        )
        if drafting:
            s.draft_ids = col([row.draft for row in rows], torch.int64)
            s.accept_uniforms = col(accept_uniforms)
        wants = [p.logprobs for p in params if p.logprobs is not None]
        s.top_logprobs = max(wants) if wants else None
        outputs = [
            r.req.output_ids + r.before if r.before else r.req.output_ids for r in rows
        ]
        if any(p.repetition_penalty != 1.0 for p in params):
            s.repetition_penalties = table[:, 3]
            s.seen_mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
            for i, r in enumerate(reqs):
                s.seen_mask[
                    i,
                    torch.tensor(
                        r.prompt_ids + outputs[i], dtype=torch.int64, device=dev
                    ),
                ] = True
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            s.frequency_penalties = table[:, 4]
            s.presence_penalties = table[:, 5]
            s.output_counts = torch.zeros(
                len(rows), vocab, dtype=torch.int32, device=dev
            )
            for i, out in enumerate(outputs):
                if out:
                    ids = torch.tensor(out, dtype=torch.int64, device=dev)
                    s.output_counts[i].index_add_(
                        0, ids, torch.ones_like(ids, dtype=torch.int32)
                    )
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            self._add_logit_bias(reqs, biased, s)
        banned = [
            (i, r)
            for i, r in enumerate(reqs)
            if len(outputs[i]) < r.params.min_new_tokens
        ]
        if banned:
            s.banned_mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=dev)
            for i, r in banned:
                stop_ids = set(r.params.stop_token_ids) | (
                    set() if r.params.ignore_eos else set(r.eos_token_ids)
                )
                ids = [t for t in stop_ids if t < vocab]
                if ids:
                    s.banned_mask[i, torch.tensor(ids, device=dev)] = True
        return s

    def _add_logit_bias(
        self, reqs: list[Req], biased: list[int], s: SamplingBatch
    ) -> None:
        """The biases of rows `biased` as flat (row, token id, bias) tensors; each request's own pair of
        tensors is built once, on its first step."""
        for i in biased:
            if reqs[i].logit_bias is None:
                reqs[i].logit_bias = logit_bias_tensors(
                    reqs[i].params.logit_bias, self.device
                )
        pairs = [reqs[i].logit_bias for i in biased]
        counts = torch.tensor([len(ids) for ids, _ in pairs], device=self.device)
        s.bias_rows = torch.tensor(
            biased, dtype=torch.int64, device=self.device
        ).repeat_interleave(counts)
        s.bias_ids = torch.cat([ids for ids, _ in pairs])
        s.bias_values = torch.cat([values for _, values in pairs])


_NO_PIECE = contextlib.nullcontext()


class _Piece:
    """`ForwardObserver.on_piece_start` / `on_piece_end` around one piece of a forward."""

    def __init__(self, observers: list[ForwardObserver], piece: str):
        self.observers, self.piece = list(observers), piece

    def __enter__(self) -> None:
        for o in self.observers:
            o.on_piece_start(self.piece)

    def __exit__(self, *exc) -> None:
        for o in self.observers:
            o.on_piece_end(self.piece)
