"""`--speculative-algorithm draft`: greedy drafts from a smaller model with the same tokenizer.

The draft model has its own paged KV (a pool and allocator of its own, no prefix cache) and runs
through a `ModelRunner` of its own, one batched forward per drafted position over every request
drafting this step. Per request it remembers which tokens its KV holds (`DraftSeq.fed`). Before
drafting, that is compared with the target's sequence: the common prefix is kept, and everything
after it is fed again — a request whose prompt came from the target's prefix cache, a retracted
one, or one whose drafts were rejected, all catch up the same way, by replaying the tokens the
draft's KV lacks (the draft never reuses KV it did not compute for this very sequence).

Drafts are the draft model's argmax: deterministic, so the target's rejection test
(`strata.layers.sampler.sample`) keeps the target's distribution for sampled requests too.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from strata.cache.allocator import PageAllocator
from strata.cache.kv_pool import MHAKVPool
from strata.engine.batch import ScheduleBatch
from strata.engine.draft_rows import DraftOptions
from strata.engine.model_runner import ModelRunner
from strata.engine.request import Req
from strata.models import config_from_dir, family_spec
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0, max_new_tokens=1 << 20, ignore_eos=True)


@dataclass
class DraftSeq:
    """One request's state in the draft model: the tokens whose KV it holds, and their pages."""

    fed: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


class DraftModelDrafter:
    def __init__(
        self,
        model_dir: str | Path,
        target_tokenizer,
        target_vocab: int,
        options: DraftOptions,
        parallel=None,
    ):
        """parallel: the replica's ParallelRuntime; with a split draft (a mixture-of-experts draft of
        an expert-parallel target) this rank loads its shard and each forward runs on every rank."""
        from strata.tokenizer import load_tokenizer
        from strata.weights.default_model import resolve_model_path
        from strata.weights.loader import load_model

        model_dir = resolve_model_path(str(model_dir))
        mc = config_from_dir(model_dir)
        if not family_spec(mc.architecture).draft_model:
            raise ValueError(
                f"--speculative-draft-model: {mc.architecture} draft models are not supported "
                "(their KV is not the paged layout a draft model keeps)"
            )
        check_same_tokenizer(load_tokenizer(model_dir), target_tokenizer, model_dir)
        self.vocab_size = min(mc.vocab_size, target_vocab)
        dtype, device, page_size = options.dtype, options.device, options.page_size
        split = None if parallel is None else parallel.draft
        self.model = load_model(
            model_dir,
            mc,
            dtype,
            device,
            max_positions=options.context_len,
            quantization=options.quantization,
            shard=None if split is None else split.shard,
        )
        local = (
            mc if split is None else split.plan.local_config()
        )  # this rank's KV heads
        num_pages = options.num_pages
        pool = MHAKVPool(
            len(mc.layers),
            local.num_kv_heads,
            local.head_dim,
            num_pages,
            page_size,
            dtype,
            device,
        )
        self.allocator = PageAllocator(num_pages, page_size)
        self.runner = ModelRunner(self.model, pool, device, mc.vocab_size, seed=0)
        if split is not None:
            parallel.start_draft_kv(
                len(mc.layers), num_pages, page_size, dtype, self.model
            )
            self.runner.parallel = parallel.draft_link()
        self.page_size = page_size
        self.seqs: dict[str, DraftSeq] = {}
        logger.info(
            "draft model %s: %d KV tokens", model_dir.name, num_pages * page_size
        )

    def draft(self, wants: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """wants: (rid, the target's sequence, tokens to draft). Returns each one's drafts (fewer, or
        none, where the draft's KV pool is short)."""
        reqs: list[tuple[int, Req]] = []
        drafts: list[list[int]] = [[] for _ in wants]
        for i, (rid, seq, k) in enumerate(wants):
            if k <= 0:
                continue
            state = self.seqs.setdefault(rid, DraftSeq())
            keep = _common_prefix(state.fed, seq)
            if keep == len(
                seq
            ):  # always feed at least the last token, to sample after it
                keep -= 1
            del state.fed[keep:]
            self._trim(state)
            req = Req(rid=rid, prompt_ids=list(seq), params=GREEDY)
            req.pages, req.kv_len = state.pages, keep
            reqs.append((i, req))
        live = reqs
        for _ in range(max((k for _, _, k in wants), default=0)):
            step = [
                (i, r)
                for i, r in live
                if len(drafts[i]) < wants[i][2] and self._alloc(r)
            ]
            if not step:
                break
            step.sort(
                key=lambda ir: ir[1].extend_len != 1
            )  # decodes first, as the runner expects
            batch = ScheduleBatch(
                [r for _, r in step],
                [r.extend_len for _, r in step],
                sum(r.extend_len == 1 for _, r in step),
            )
            sampled = self.runner.forward(batch)
            for row, (i, req) in enumerate(step):
                token = int(sampled.token_ids[row])
                req.kv_len = req.seq_len
                req.prompt_ids.append(token)
                drafts[i].append(token)
            live = step
        for i, req in reqs:
            state = self.seqs[wants[i][0]]
            state.fed = req.prompt_ids[: req.kv_len]
            state.pages = req.pages
        return [d if all(t < self.vocab_size for t in d) else [] for d in drafts]

    def _alloc(self, req: Req) -> bool:
        return self.allocator.grow(req.pages, req.seq_len)

    def _trim(self, state: DraftSeq) -> None:
        keep = math.ceil(len(state.fed) / self.page_size)
        self.allocator.free(state.pages[keep:])
        del state.pages[keep:]

    def finish(self, rid: str) -> None:
        state = self.seqs.pop(rid, None)
        if state is not None:
            self.allocator.free(state.pages)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def check_same_tokenizer(draft, target, model_dir: Path) -> None:
    """Drafts are token ids: the two tokenizers must give every shared id the same meaning."""
    if draft is None or target is None:
        return
    dv, tv = draft.get_vocab(), target.get_vocab()
    differ = [t for t, i in dv.items() if tv.get(t, i) != i]
    if differ or len(dv) > len(tv):
        raise ValueError(
            f"--speculative-draft-model {model_dir}: its tokenizer differs from the target's "
            f"({len(differ)} tokens with other ids, vocabularies of {len(dv)} and {len(tv)}); "
            "a draft model must share the target's tokenizer"
        )
