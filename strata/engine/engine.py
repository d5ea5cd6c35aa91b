"""The offline engine: loads a model, builds the KV pool, prefix cache and scheduler, and drives
the scheduler loop for callers in this process (`generate`, `stream`, `chat`).

    engine = Engine()                                  # default model
    engine.generate(["Hello"], SamplingParams(temperature=0, max_new_tokens=16))
    for out in engine.stream("Tell me a story"): print(out.text_delta, end="")
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import operator
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from strata.cache.allocator import GroupedPageAllocator, PageAllocator
from strata.cache.hicache import HiCache, HiCacheConfig
from strata.cache.kv_layouts import KV_LAYOUTS, PoolRequest
from strata.cache.kv_plan import plan_kv_pool
from strata.cache.kv_pool import KVPool
from strata.cache.radix import NoPrefixCache, PrefixCache, RadixCache
from strata.cache.window_radix import WindowRadixCache
from strata.config import EngineConfig, parse_lora_modules
from strata.engine.batch import ScheduleBatch
from strata.engine.device import DTYPES, pick_device, pick_dtype
from strata.engine.embed import check_embed_request, embed
from strata.engine.lora import LoRAError, LoRAManager
from strata.engine.model_runner import ModelRunner
from strata.engine.outputs import RequestOutput, TokenLogprob
from strata.engine.request import Req
from strata.engine.scheduler import Scheduler
from strata.engine.step_threads import StepThreads
from strata.kernels import describe_kernels, kernel_info, record_fast_matmul
from strata.layers.expert_load import expert_load_summary
from strata.layers.packed import blas_matmuls
from strata.layers.quant import describe_weights
from strata.model_config import ModelConfig
from strata.models import config_from_dir, family_spec
from strata.models.native_decode import decode_loop_name
from strata.sampling_params import SamplingParams
from strata.tokenizer import apply_chat_template, load_tokenizer
from strata.weights.loader import load_model

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeState:
    """What the engine discovered at start-up (never written back into EngineConfig)."""

    model_dir: Path
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    weights: (
        str  # the weight formats the model runs on, e.g. "q4 x210, q8 x1, float x0"
    )
    kernels: dict[
        str, Any
    ]  # strata.kernels.kernel_info(): which native build runs, the CPU's ISA
    decode_loop: str  # "native": decode steps run the layers from C++ (strata.models.native_decode); "python"
    kv_dtype: torch.dtype
    num_kv_tokens: int
    kv_bytes: int
    kv_reason: str
    kv_groups: str  # how the layers' KV is laid out, e.g. "3 full layers; 15 window-512 layers: 1024 pages"
    context_len: int
    eos_token_ids: frozenset[int]
    load_seconds: float


@dataclass
class Completion:
    """One finished answer."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None


@dataclass
class GenerateResult:
    """The answer(s) to one prompt; `choices` has n entries, the first mirrored at the top level."""

    choices: list[Completion]
    prompt_tokens: int
    cached_tokens: int

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason

    @property
    def matched_stop(self) -> str | int | None:
        return self.choices[0].matched_stop

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class Engine:
    def __init__(self, model: str | None = None, **options: Any):
        self.parallel = None
        try:
            self._load(model, **options)
        except BaseException:
            if (
                self.parallel is not None
            ):  # its workers and this process's groups: another engine may start
                self.parallel.shutdown()
            raise

    def _load(self, model: str | None, **options: Any) -> None:
        self.config = EngineConfig(model=model, **options)
        start = time.perf_counter()
        from strata.weights.default_model import resolve_model_path

        cfg = self.config
        model_dir = resolve_model_path(cfg.model)
        model_config = config_from_dir(model_dir)
        device = pick_device(cfg.device)
        if device.type == "cpu":
            torch.set_num_threads(cfg.num_threads or os.cpu_count() or 1)
        dtype, dtype_reason = pick_dtype(cfg.dtype, device)
        kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else DTYPES[cfg.kv_cache_dtype]
        context_len = self._context_len(model_config)
        self.tokenizer = load_tokenizer(model_dir)
        # --tp-size/--ep-size > 1: this process is rank 0; it starts the other ranks and loads its shard
        self.parallel = self._make_parallel(
            model_dir, model_config, dtype, device, context_len
        )
        record_fast_matmul({})  # --matmul fast records its choice as the model loads
        self.model = load_model(
            model_dir,
            model_config,
            dtype,
            device,
            max_positions=context_len,
            quantization=cfg.quantization,
            shard=self.parallel.shard if self.parallel else None,
            engram_placement=cfg.engram_placement,
            matmul=cfg.matmul,
        )
        weights = describe_weights(self.model)

        pool_config = (
            self.parallel.local_config() if self.parallel else model_config
        )  # this rank's KV heads
        # a GPU rank sizes its shard of the pool from its own device; CPU ranks share the host's memory
        # the family's KV layout builds the pool (strata.cache.kv_layouts)
        layout = KV_LAYOUTS[family_spec(model_config.architecture).kv_layout]
        plan = plan_kv_pool(
            cfg,
            pool_config if device.type == "cuda" else model_config,
            kv_dtype,
            device,
            context_len,
            shareable=self.parallel is None and layout.shareable,
        )
        plan, kv_pool = layout.build(
            PoolRequest(
                cfg, model_config, pool_config, plan, kv_dtype, device, context_len
            )
        )
        num_pages = plan.num_pages
        if kv_pool.grouped:
            if (
                kv_pool.shared
            ):  # one group per slice of the window layers, every one from the same pool
                groups = list(zip(kv_pool.windows, kv_pool.group_pages))
            else:
                groups = list(plan.group_pages.items())
            allocator = GroupedPageAllocator(
                num_pages, cfg.page_size, groups, shared=kv_pool.shared
            )
            kv_pool.attach_page_maps([g.to_group for g in allocator.groups])
            cache = (
                NoPrefixCache(allocator)
                if cfg.disable_radix_cache
                else WindowRadixCache(allocator, replay=cfg.swa_replay)
            )
        else:
            allocator = PageAllocator(num_pages, cfg.page_size)
            cache = (
                NoPrefixCache(allocator)
                if cfg.disable_radix_cache
                else RadixCache(allocator)
            )
        eos = set(model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        eos.update(_generation_config_eos(model_dir))
        # what a KV page means, for pages shared through L3 storage or sent to a PD peer
        shares_kv = cfg.hierarchical_cache or cfg.disaggregation_mode != "null"
        # whole pages leave through this pool: every KV head, gathered from the ranks when split
        page_pool = (
            self.parallel.page_pool(kv_pool) if self.parallel and shares_kv else kv_pool
        )
        namespace = (
            kv_namespace(model_dir, page_pool, weights, dtype) if shares_kv else b""
        )
        self.hicache = (
            self._make_hicache(namespace, page_pool, cache)
            if cfg.hierarchical_cache
            else None
        )
        runner = ModelRunner(
            self.model,
            kv_pool,
            device,
            model_config.vocab_size,
            cfg.random_seed,
            groups=allocator.groups,
        )
        if (
            self.parallel is not None
        ):  # the workers allocate their KV shards; rank 0 broadcasts each step
            self.parallel.start_kv(plan, cfg.page_size, kv_dtype, self.model)
            runner.parallel = self.parallel
        draft = (
            self._make_draft_model(
                model_dir,
                model_config.vocab_size,
                dtype,
                device,
                num_pages,
                context_len,
            )
            if cfg.speculative_algorithm in ("draft", "mtp", "dspark")
            else None
        )
        if (
            device.type == "cpu"
            and self.parallel is None
            and cfg.step_threads == "auto"
        ):
            runner.step_threads = StepThreads(torch.get_num_threads())
            draft_runner = getattr(
                draft, "runner", None
            )  # a draft model's forwards (MTP runs in the target's)
            if draft_runner is not None:  # timed apart: another model's steps
                draft_runner.step_threads = StepThreads(torch.get_num_threads())
        self.scheduler = Scheduler(
            cfg,
            runner,
            allocator,
            cache,
            self.tokenizer,
            frozenset(eos),
            context_len,
            draft_model=draft,
            tiers=self.hicache,  # listens to the device cache (demotion, L3 writes)
        )
        self.disagg = (
            self._make_disagg(namespace, page_pool)
            if cfg.disaggregation_mode != "null"
            else None
        )
        self.lora: LoRAManager | None = None
        if cfg.lora_enabled:
            scheduler = self.scheduler
            self.lora = LoRAManager(
                self.model,
                cfg.max_loras,
                cfg.max_lora_rank,
                in_use=lambda: (r.adapter for r in scheduler.reqs.values()),
            )
            runner.lora = self.lora
            for name, path in parse_lora_modules(cfg.lora_modules or ""):
                self.lora.register(name, path)
        self.state = RuntimeState(
            model_dir=model_dir,
            model_config=model_config,
            device=device,
            dtype=dtype,
            dtype_reason=dtype_reason,
            weights=weights,
            kernels=kernel_info() if device.type == "cpu" else {},
            decode_loop=decode_loop_name(self.model)
            if device.type == "cpu"
            else "python",
            kv_dtype=kv_dtype,
            num_kv_tokens=plan.context_pages * cfg.page_size,
            kv_bytes=kv_pool.nbytes,
            kv_reason=plan.reason,
            kv_groups=plan.describe(),
            context_len=context_len,
            eos_token_ids=frozenset(eos),
            load_seconds=time.perf_counter() - start,
        )
        self._ids = itertools.count()
        self._outputs: dict[str, list[RequestOutput]] = {}
        blas = blas_matmuls(self.model) if cfg.speculative_algorithm != "none" else []
        if blas:
            logger.warning(
                "speculative decoding over float weights on BLAS: the matmuls of this model's %s modules "
                "(oneDNN/MKL on the CPU, cuBLAS on GPUs) may round a row differently by the call's size, so a "
                "verification's rows can differ in the last bits from the same tokens decoded one at a time and a "
                "greedy answer can turn at a near-tie; the native CPU kernels (block-quantized and packed "
                "bf16/float32 weights) compute a row the same in any call",
                ", ".join(blas),
            )
        logger.info(
            "loaded %s (%s, %s [%s], weights %s, kernels %s, %s decode loop on %s) in %.1fs; "
            "KV cache: %d tokens (%.0f MiB, %s)",
            model_dir.name,
            model_config.architecture,
            str(dtype).removeprefix("torch."),
            dtype_reason,
            self.state.weights,
            describe_kernels(self.state.kernels),
            self.state.decode_loop,
            device,
            self.state.load_seconds,
            self.state.num_kv_tokens,
            self.state.kv_bytes / 2**20,
            plan.reason + (f"; {plan.describe()}" if plan.group_pages else ""),
        )

    def _make_parallel(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        context_len: int,
    ):
        """Tensor/expert parallel: start the worker ranks (strata.distributed); None for one rank."""
        cfg = self.config
        if max(cfg.tp_size, cfg.ep_size) == 1:
            return None
        from strata.distributed.runtime import ParallelRuntime
        from strata.models import get_model_class

        renames = get_model_class(model_config.architecture).RENAMES
        return ParallelRuntime(
            cfg, model_dir, model_config, dtype, device, context_len, renames
        )

    def _make_disagg(self, namespace: bytes, kv_pool: KVPool):
        from strata.disagg.auth import shared_secret
        from strata.disagg.manager import DecodeManager, PrefillManager
        from strata.disagg.transport import make_transport

        cfg = self.config
        secret = shared_secret(cfg.disaggregation_secret)
        if not secret:
            raise ValueError(
                "prefill/decode disaggregation needs a shared secret: pass the same --disaggregation-secret "
                "(or STRATA_DISAGG_SECRET) to every prefill and decode worker and to the router"
            )
        # the inbox reads no frame larger than the largest KV a decode worker can be sent, its longest
        # prompt's [layers, parts, prompt_len, heads, dim]; a prefill worker receives only Hellos
        max_prompt_len = min(self.scheduler.context_len, self.scheduler.pool_tokens)
        per_token = kv_pool.page_bytes // kv_pool.page_size
        max_payload_bytes = (
            0 if cfg.disaggregation_mode == "prefill" else max_prompt_len * per_token
        )
        transport = make_transport(
            cfg.disaggregation_transfer_backend,
            cfg.disaggregation_host,
            cfg.disaggregation_bootstrap_port,
            max_payload_bytes=max_payload_bytes,
        )
        cls = PrefillManager if cfg.disaggregation_mode == "prefill" else DecodeManager
        manager = cls(
            self.scheduler,
            kv_pool,
            transport,
            secret,
            namespace.hex(),
            cfg.disaggregation_timeout,
        )
        logger.info(
            "disaggregation: %s worker, KV inbox %s",
            cfg.disaggregation_mode,
            transport.endpoint,
        )
        return manager

    @property
    def disagg_endpoint(self) -> str | None:
        """host:port of this worker's KV inbox (a prefill worker's bootstrap address), if disaggregated."""
        return (
            None
            if self.disagg is None
            else self.disagg.transport.endpoint.removeprefix("tcp://")
        )

    def _make_hicache(
        self, namespace: bytes, kv_pool: KVPool, device: PrefixCache
    ) -> HiCache:
        from strata.cache.storage import make_storage_backend

        cfg = self.config
        page_bytes = kv_pool.page_bytes
        if cfg.hicache_size is not None:
            host_pages = int(cfg.hicache_size * 2**30) // page_bytes
        else:
            host_pages = int(kv_pool.num_pages * cfg.hicache_ratio)
        storage = None
        if cfg.hicache_storage_backend is not None:
            storage = make_storage_backend(
                cfg.hicache_storage_backend,
                cfg.hicache_storage_path,
                max_bytes=int(cfg.hicache_storage_max_gib * 2**30),
                ttl_s=cfg.hicache_storage_ttl,
            )
        hc = HiCacheConfig(
            host_pages=max(1, host_pages),
            write_policy=cfg.hicache_write_policy,
            prefetch_policy=cfg.hicache_prefetch_policy,
            prefetch_threshold_tokens=cfg.hicache_prefetch_threshold,
            prefetch_timeout_s=cfg.hicache_prefetch_timeout,
            storage_ttl_s=cfg.hicache_storage_ttl,
        )
        logger.info(
            "hierarchical cache: L2 %d pages (%.0f MiB host), L3 %s, write policy %s, prefetch policy %s",
            hc.host_pages,
            hc.host_pages * page_bytes / 2**20,
            cfg.hicache_storage_backend or "off",
            hc.write_policy,
            hc.prefetch_policy,
        )
        return HiCache(hc, kv_pool, device, namespace, storage)

    def _make_draft_model(
        self,
        model_dir: Path,
        vocab: int,
        dtype: torch.dtype,
        device: torch.device,
        num_pages: int,
        context_len: int,
    ):
        """--speculative-algorithm draft: the draft model; mtp: the checkpoint's multi-token
        prediction layer; dspark: the DSpark drafter. Each with as many KV tokens as the target."""
        from strata.engine.draft_model import DraftModelDrafter
        from strata.engine.draft_rows import DraftOptions
        from strata.engine.dspark import DSparkDrafter
        from strata.engine.mtp import MTPDrafter

        cfg = self.config
        options = DraftOptions(
            dtype=dtype,
            device=device,
            num_tokens=num_pages * cfg.page_size,
            page_size=cfg.page_size,
            quantization=cfg.quantization,
            context_len=context_len,
        )
        if cfg.speculative_algorithm == "mtp":
            return MTPDrafter(self.model, model_dir, options, vocab)
        if cfg.speculative_algorithm == "dspark":
            return DSparkDrafter(
                self.model,
                cfg.speculative_draft_model,
                options,
                vocab,
                threshold=cfg.speculative_confidence_threshold,
            )
        return DraftModelDrafter(
            cfg.speculative_draft_model,
            self.tokenizer,
            vocab,
            options,
            parallel=self.parallel,
        )

    def flush_cache(self) -> None:
        """Drop every cached prefix (L1 radix tree and L2); refuses while requests are running."""
        if self.scheduler.running or self.scheduler.waiting:
            raise RuntimeError(
                f"cannot flush the cache while {len(self.scheduler.running)} requests run and "
                f"{len(self.scheduler.waiting)} wait; retry when idle"
            )
        self.scheduler.cache.reset()
        self.scheduler.tiers.reset()

    def close(self) -> None:
        """Stop background threads (the L3 storage worker), sockets and the other parallel ranks."""
        if self.parallel is not None:
            self.parallel.shutdown()
        if self.disagg is not None:
            self.disagg.transport.close()
        if self.hicache is not None:
            self.hicache.flush()
            self.hicache.close()
        tables = getattr(self.model, "engram_tables", None)
        if tables is not None:
            tables.close()

    def _context_len(self, mc: ModelConfig) -> int:
        context = mc.max_position_embeddings
        if self.config.context_length is not None:
            context = min(context, self.config.context_length)
        return context

    # ------------------------------------------------------------------ low-level API

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "this model has no tokenizer; pass token ids instead of text"
                )
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = []
        for t in prompt:
            try:
                if isinstance(t, bool):
                    raise TypeError
                ids.append(operator.index(t))  # int, numpy and torch integers
            except TypeError:
                raise ValueError(
                    f"a prompt must be a string or a list of int token ids, got {t!r}"
                ) from None
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        bootstrap_room: int | None = None,
        bootstrap_addr: str | None = None,
        buffer_outputs: bool = True,
        lora: str | None = None,
    ) -> list[str]:
        """Queue one prompt; returns the engine request ids (n of them for n > 1). `lora`: the
        name of a registered LoRA adapter to run it under (None: the base model).

        Disaggregated workers also take the router's `bootstrap_room` (both sides) and, on a decode
        worker, `bootstrap_addr` (host:port of the prefill worker's KV inbox). With
        buffer_outputs=False the caller consumes `step()`'s outputs itself (a server), and nothing
        is kept for `generate`/`stream`.
        """
        params = params or SamplingParams()
        rid = rid or f"req-{next(self._ids)}"
        ids = self.encode(prompt)
        if lora is not None and self.lora is None:
            raise LoRAError(
                f"this engine serves no LoRA adapters (asked for {lora!r}); start it with "
                "--enable-lora or --lora-modules"
            )
        if self.disagg is not None:  # the PD side admits it (and checks its bootstrap)
            rids = self.disagg.add_request(
                rid, ids, params, bootstrap_room, bootstrap_addr
            )
        else:
            adapter = self.lora.acquire(lora) if lora is not None else 0
            rids = self.scheduler.add_request(rid, ids, params, adapter=adapter)
        if buffer_outputs:
            for r in rids:
                self._outputs[r] = []
        return rids

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    def has_work(self) -> bool:
        """Whether `step()` can make progress (requests, or PD transfers under way)."""
        return self.scheduler.has_work()

    def has_requests(self) -> bool:
        """Whether a request is queued or running, or has outputs `step()` did not return yet;
        False while only background work (a PD transfer, an L3 prefetch's wait) is left."""
        return self.scheduler.has_requests()

    def discard_pending_outputs(self) -> None:
        """Drop the outputs the next `step()` would return (a caller that reported them already,
        e.g. after aborting every request in flight)."""
        self.scheduler.discard_pending_outputs()

    def embed(
        self,
        inputs: Sequence[str | Sequence[int]],
        pooling: str = "last",
        *,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> np.ndarray:
        """Embeddings of whole inputs (strings or token-id lists): float32 [len(inputs), dimensions
        or hidden_size], each the final hidden state (after the final norm) of the input's last
        token (`pooling="last"`) or the mean over its tokens (`"mean"`), cut to its first
        `dimensions` values, then L2-normalised unless `normalize` is False. Runs over a scratch KV
        pool of its own (strata.engine.embed): the requests generating meanwhile, the KV pool and
        the prefix cache are untouched. Raises ValueError for an input that cannot run."""
        if self.parallel is not None:
            raise ValueError(
                "embeddings are not available with --tp-size/--ep-size > 1"
            )
        st = self.state
        mc = st.model_config
        ids = [self.encode(x) for x in inputs]
        check_embed_request(
            ids,
            pooling,
            dimensions,
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            context_len=st.context_len,
        )
        governor = self.scheduler.runner.step_threads
        return embed(
            self.model,
            mc,
            ids,
            pooling,
            normalize=normalize,
            dimensions=dimensions,
            page_size=self.config.page_size,
            kv_dtype=st.kv_dtype,
            device=st.device,
            threads=governor.max_threads if governor is not None else None,
        )

    def stats(self, full: bool = False, expert_load: bool = False) -> dict[str, Any]:
        """The engine's load, by the field names of the server's `EngineStats`. `full` also walks
        the prefix cache for the window groups' pages and checks their accounting, summarises a MoE
        model's expert load (one copy of the counters off the device), and adds the parallel ranks
        and the step-thread choices; `expert_load` adds the expert counts themselves."""
        s = self.scheduler
        load = self.model.expert_load() if full else {}  # {} for a dense model
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            "num_pages": s.allocator.num_pages,
            "num_free_pages": s.allocator.num_free_pages,
            "num_cached_pages": s.cache.total_pages,
            "num_evictable_pages": s.cache.evictable_pages,
            "page_size": s.page_size,
            "num_retractions": s.num_retractions,
            "num_preemptions": s.num_preemptions,
            "num_steps": s.step_count,
            "hicache": self.hicache.stats.as_dict()
            if self.hicache is not None
            else None,
            "spec": s.spec.stats.as_dict() if s.spec is not None else None,
            "leaked_pages": s.leaked_pages(window_groups=full),
            "window_groups": s.window_group_usage()
            if full and s.allocator.groups
            else None,
            "expert_load": load if load and expert_load else None,
            "expert_load_summary": expert_load_summary(load) if load else None,
            "parallel": self.parallel.describe()
            if full and self.parallel is not None
            else None,
            "step_threads": self.step_threads() if full else None,
        }

    def step_threads(self) -> dict[str, dict[str, float | int]] | None:
        """Per size of step, the CPU threads it runs on and each option's measured time per token;
        None when --step-threads is not auto (or not on a CPU)."""
        governor = self.scheduler.runner.step_threads
        return governor.describe() if governor is not None else None

    def step(self) -> list[RequestOutput]:
        if (
            self.parallel is not None
        ):  # RankFailure once a rank is gone; EPLB at this step boundary
            self.parallel.before_step()
        outputs = self.scheduler.step()
        if self.parallel is not None:
            self.parallel.check()  # a collective of this step failed: its requests failed, the engine too
        for out in outputs:
            if out.rid in self._outputs:
                self._outputs[out.rid].append(out)
        return outputs

    # ------------------------------------------------------------------ high-level API

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Run a batch to completion. `prompts`: one or many strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        param_list = (
            list(params)
            if isinstance(params, Sequence)
            else [params or SamplingParams()] * len(prompts)
        )
        if len(param_list) != len(prompts):
            raise ValueError(
                f"got {len(prompts)} prompts but {len(param_list)} sampling params"
            )
        groups = [self.add_request(p, sp) for p, sp in zip(prompts, param_list)]
        pending = {r for g in groups for r in g}
        while pending:
            for out in self.step():
                if out.finished:
                    pending.discard(out.rid)
        return [self._collect(g) for g in groups]

    def _collect(self, rids: list[str]) -> GenerateResult:
        choices = []
        prompt_tokens = cached = 0
        for rid in rids:
            outs = self._outputs.pop(rid)
            last = outs[-1]
            choices.append(
                Completion(
                    text="".join(o.text_delta for o in outs),
                    token_ids=[t for o in outs for t in o.new_token_ids],
                    finish_reason=last.finish_reason,
                    matched_stop=last.matched_stop,
                    logprobs=[lp for o in outs for lp in o.logprobs],
                    error=last.error,
                )
            )
            prompt_tokens, cached = last.prompt_tokens, max(cached, last.cached_tokens)
        return GenerateResult(
            choices=choices, prompt_tokens=prompt_tokens, cached_tokens=cached
        )

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield this request's updates as they come (other queued requests keep running too).

        Closing the iterator early aborts the request and frees its KV.
        """
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() takes n == 1; use generate() for n > 1")
        (rid,) = self.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                self.step()
                outs, self._outputs[rid] = self._outputs[rid], []
                for out in outs:
                    finished = finished or out.finished
                    yield out
        finally:
            self._outputs.pop(rid, None)
            if not finished:
                self.abort(rid)
                self.step()

    @torch.inference_mode()
    def layer_streams(
        self, seqs: Sequence[Sequence[int]], layers: tuple[int, ...]
    ) -> list[torch.Tensor]:
        """The residual stream after each of `layers` (-1: the embeddings) at every position of
        each sequence, [len, len(layers) * hidden] on the CPU: one prefill of them all together,
        through no cache (what a DSpark drafter is trained on). Only while no request runs."""
        sched = self.scheduler
        if sched.running or sched.waiting:
            raise RuntimeError("layer_streams runs only while the engine is idle")
        capture = getattr(self.model, "capture_layers", None)
        if capture is None or self.parallel is not None:
            raise ValueError(
                f"{type(self.model).__name__} does not expose its layers' streams here "
                "(a DecoderForCausalLM family on one rank does)"
            )
        reqs = [
            Req(rid=f"streams-{i}", prompt_ids=list(s), params=SamplingParams())
            for i, s in enumerate(seqs)
        ]
        previous = self.model.capture_after
        try:
            for req in reqs:
                if not sched._alloc_for(req, len(req.prompt_ids)):
                    raise ValueError(
                        f"{sum(len(s) for s in seqs)} tokens do not fit the KV pool at once; "
                        "pass fewer or shorter sequences"
                    )
            capture(layers)
            fb = sched.runner.prepare(
                ScheduleBatch(reqs, [len(r.prompt_ids) for r in reqs], 0)
            )
            self.model(fb.input_ids, fb.positions, fb.attn, sched.runner.kv)
            captured = self.model.captured.cpu()
        finally:
            capture(previous)
            for req in reqs:
                sched.allocator.free(req.pages)
        return list(captured.split([len(s) for s in seqs]))

    def chat(
        self, messages: list[dict[str, Any]], params: SamplingParams | None = None
    ) -> GenerateResult:
        return self.generate([apply_chat_template(self.tokenizer, messages)], params)[0]

    def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return apply_chat_template(self.tokenizer, messages)


def kv_namespace(
    model_dir: Path, kv_pool: KVPool, weights: str, dtype: torch.dtype
) -> bytes:
    """Identity of a KV page's meaning: model (config + a sample of each weight file), the weight
    formats and compute dtype the KV was computed with, and the KV layout."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(size // 2)
            h.update(f"{path.name}:{size}".encode() + f.read(1 << 16))
    h.update(f"weights={weights};compute={dtype}".encode())
    return h.digest() + kv_pool.layout.encode()


def _generation_config_eos(model_dir: Path) -> set[int]:
    import json

    path = model_dir / "generation_config.json"
    if not path.is_file():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {eos}
