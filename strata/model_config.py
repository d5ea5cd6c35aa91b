"""`ModelConfig`: what the model code needs, read from a Hugging Face config.json (its rotary
embedding as `RopeConfig`, its layers as `LayerSpec`s; the mixture-of-experts, latent-attention and
DeepSeek-V4 parts in strata/moe_config.py, strata/mla_config.py and strata/dsv4_config.py). A frozen
dataclass, one place for each default.

What a config.json does not spell out (Gemma's norms, Qwen3's q/k norm, ...) the family's file
(`strata.models`) declares for each of its model types as `ConfigTraits`, handed to
`ModelConfig.from_hf_dict`, which never looks at the model_type itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from strata.dsv4_config import DSV4Config
from strata.mla_config import MLAConfig, MLATraits, mla_from_hf, mla_scale
from strata.moe_config import MoEConfig, MoETraits, moe_from_hf, moe_layers
from strata.rope_config import RopeConfig


@dataclass(frozen=True)
class LayerSpec:
    """How one decoder layer attends: the part of a model that may differ from layer to layer
    (Gemma 2/3 alternate sliding-window and full layers, each kind with its own RoPE)."""

    rope: RopeConfig
    scale: float  # attention score scale: head_dim**-0.5, or query_pre_attn_scalar**-0.5 (Gemma)
    window: int | None = (
        None  # sliding window W: the query at p sees keys p-W < j <= p; None = full causal
    )
    softcap: float | None = (
        None  # scores -> softcap * tanh(scores / softcap) before the softmax (Gemma 2)
    )
    sinks: bool = False  # one learned sink logit per head joins the softmax (GPT-OSS)
    moe: bool = False  # the layer's MLP is `ModelConfig.moe`'s mixture of experts; else the dense MLP

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding"


QK_NORMS = (
    "none",
    "head",
    "full",
)  # per-head RMSNorm on q and k (Qwen3, Gemma 3), over all heads (OLMo 2)
NORM_LAYOUTS = ("pre", "sandwich", "post")

# (config.json's text part, number of layers) -> "full_attention" | "sliding_attention" per layer
LayerTypes = Callable[[dict[str, Any], int], list[str]]


def sliding_everywhere(text: dict[str, Any], num_layers: int) -> list[str]:
    """Where a config.json has no `layer_types` and a window, every layer slides (Mistral, Phi-3)."""
    return ["sliding_attention"] * num_layers


@dataclass(frozen=True)
class ConfigTraits:
    """How one HF model_type's config.json reads where the file does not say: declared in its family's
    file (`FamilySpec.model_types` in `strata.models`), handed to `ModelConfig.from_hf_dict`. The
    defaults read a plain Llama config."""

    qk_norm: str = "none"  # one of QK_NORMS
    # q/k/v biased unless config.json's attention_bias (or qkv_bias) says not, o_proj never (Qwen2)
    qkv_bias_only: bool = False
    norm_layout: str = "pre"  # one of NORM_LAYOUTS
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    tied_embeddings: bool = (
        False  # tie_word_embeddings where config.json does not say (Gemma)
    )
    # the gate's activation is `hidden_activation`, `hidden_act` where absent (Gemma: its
    # `hidden_act` is a leftover of Gemma 1)
    hidden_activation: bool = False
    sinks: bool = False  # one learned sink logit per head in every layer (GPT-OSS)
    # which layers slide where config.json has a window but no `layer_types`
    layer_types: LayerTypes = sliding_everywhere
    # config.json's RoPE type -> ours (Phi-3 calls longrope "su" or "yarn")
    rope_aliases: Mapping[str, str] = field(default_factory=dict, hash=False)
    # sliding layers rotate with `rope_local_base_freq` and no scaling, full ones with the global
    # theta and `rope_scaling` (Gemma 3; transformers 5 writes `rope_parameters` by layer kind)
    local_rope: bool = False
    moe: MoETraits | None = None  # how its experts read; None: no mixture of experts
    mla: MLATraits | None = None  # how its latent attention reads; None: none
    # reads the whole config.json instead (DeepSeek-V4, whose layers are not these)
    parse: Callable[[dict[str, Any]], ModelConfig] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """What the model code needs, read from a Hugging Face config.json by `from_hf_dict` (the one
    place that knows HF's spellings; what differs by family it takes from the family's
    `ConfigTraits`). Model-wide choices are fields here; what may vary per layer is one `LayerSpec`
    per layer in `layers`.

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
    layers: tuple[
        LayerSpec, ...
    ] = ()  # one per decoder layer; empty: every layer full attention with `rope`
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False  # Llama/Qwen3 with attention_bias=True; never Qwen2
    mlp_bias: bool = False
    qk_norm: str = "none"  # one of QK_NORMS
    norm_layout: str = "pre"  # one of NORM_LAYOUTS
    norm_unit_offset: bool = (
        False  # Gemma: RMSNorm scales by (1 + weight), computed in float32
    )
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype
    final_logit_softcap: float | None = (
        None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    )
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (the gate of a gated MLP)
    moe: MoEConfig | None = (
        None  # the experts of the layers whose `LayerSpec.moe` is set
    )
    # multi-head latent attention (DeepSeek-V2/V3) in every layer; head_dim is then its RoPE part
    mla: MLAConfig | None = None
    # DeepSeek-V4 (sliding + compressed attention, mHC, hash-routed experts): strata.models.deepseek_v4
    dsv4: DSV4Config | None = None
    mtp_layers: int = (
        0  # multi-token prediction layers stored past the last (strata.models.mtp)
    )
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            spec = LayerSpec(rope=self.rope, scale=self.head_dim**-0.5)
            object.__setattr__(self, "layers", (spec,) * self.num_layers)
        if len(self.layers) != self.num_layers:
            raise ValueError(
                f"{len(self.layers)} layer specs for {self.num_layers} layers"
            )
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {self.qk_norm!r}")
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(
                f"norm_layout must be one of {NORM_LAYOUTS}, got {self.norm_layout!r}"
            )
        if self.moe is None and any(spec.moe for spec in self.layers):
            raise ValueError(
                "layers marked as mixture-of-experts, but the config has no experts"
            )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], traits: ConfigTraits) -> ModelConfig:
        """A config.json's dict, read with its family's `traits` for its model_type
        (`strata.models.config_from_hf` finds them)."""
        if traits.parse is not None:
            return traits.parse(raw)
        archs = raw.get("architectures") or []
        architecture = archs[0] if archs else ""
        model_type = raw.get("model_type", "")
        text = raw.get("text_config") or raw
        num_heads = text["num_attention_heads"]
        hidden = text["hidden_size"]
        mla = mla_from_hf(text, traits.mla)
        head_dim = (
            mla.qk_rope_head_dim if mla else text.get("head_dim") or hidden // num_heads
        )
        num_layers = text["num_hidden_layers"]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        )
        if text.get("use_bidirectional_attention"):
            raise ValueError(
                f"{architecture} with use_bidirectional_attention (an encoder) is not supported"
            )
        # per-layer attention: window, RoPE (Gemma 3: a local one for sliding layers), scale, softcap
        window = text.get("sliding_window")
        if "use_sliding_window" in text and not text.get("use_sliding_window"):
            window = None  # Qwen2/Qwen3 write a window they do not use
        kinds = _layer_types(text, traits.layer_types, num_layers, window)
        full_rope, local_rope = _ropes_from_hf(text, traits)
        scalar = text.get("query_pre_attn_scalar")
        scale = (
            mla_scale(mla, full_rope)
            if mla
            else (scalar if scalar is not None else head_dim) ** -0.5
        )
        moe = moe_from_hf(text, traits.moe)
        sparse = moe_layers(text, num_layers) if moe else [False] * num_layers
        specs = tuple(
            LayerSpec(
                rope=full_rope if kind == "full_attention" else local_rope,
                scale=scale,
                window=window if kind == "sliding_attention" else None,
                softcap=text.get("attn_logit_softcapping"),
                sinks=traits.sinks,
                moe=is_moe,
            )
            for kind, is_moe in zip(kinds, sparse)
        )
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
            tie_word_embeddings=bool(
                raw.get(
                    "tie_word_embeddings",
                    text.get("tie_word_embeddings", traits.tied_embeddings),
                )
            ),
            attention_bias=bool(
                text.get("attention_bias", text.get("qkv_bias", traits.qkv_bias_only))
            ),
            o_proj_bias=bool(text.get("attention_bias", False))
            and not traits.qkv_bias_only,
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            norm_layout=traits.norm_layout,
            norm_unit_offset=traits.norm_unit_offset,
            scale_embeddings=traits.scale_embeddings,
            final_logit_softcap=text.get("final_logit_softcapping"),
            hidden_act=(
                text.get("hidden_activation") if traits.hidden_activation else None
            )
            or text.get("hidden_act", "silu"),
            moe=moe,
            mla=mla,
            mtp_layers=int(
                text.get("num_nextn_predict_layers", text.get("num_mtp_layers")) or 0
            ),
            torch_dtype=text.get("torch_dtype") or text.get("dtype"),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
        )


def _layer_types(
    text: dict[str, Any], default: LayerTypes, num_layers: int, window: int | None
) -> list[str]:
    """HF's `layer_types` ("full_attention" | "sliding_attention" per layer), or the family's
    `default` where an older config.json has none (`ConfigTraits.layer_types`)."""
    kinds = text.get("layer_types")
    if kinds is None:
        kinds = default(text, num_layers)
    if len(kinds) != num_layers:
        raise ValueError(
            f"layer_types has {len(kinds)} entries for {num_layers} layers"
        )
    unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if unknown:
        supported = "full_attention, sliding_attention"
        raise ValueError(
            f"layer types {unknown} are not supported; supported: {supported}"
        )
    if window is None:
        return ["full_attention"] * num_layers
    return list(kinds)


def _ropes_from_hf(
    text: dict[str, Any], traits: ConfigTraits
) -> tuple[RopeConfig, RopeConfig]:
    """(RoPE of full-attention layers, RoPE of sliding layers). They differ only for a family with a
    `local_rope` (Gemma 3): its sliding layers rotate with `rope_local_base_freq` (10k) and no
    scaling, its full layers with the global theta (1M) and `rope_scaling`; transformers 5 writes
    both under `rope_parameters` by kind."""
    params = text.get("rope_parameters") or {}
    aliases = traits.rope_aliases
    if "full_attention" in params or traits.local_rope:
        full = {
            "rope_theta": text.get("rope_theta", 1_000_000.0),
            **(text.get("rope_scaling") or {}),
        }
        local = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
        full.update(params.get("full_attention") or {})
        local.update(params.get("sliding_attention") or {})
        return rope_from_hf(text, full, aliases), rope_from_hf(text, local, aliases)
    rope = rope_from_hf(text, {**(text.get("rope_scaling") or {}), **params}, aliases)
    return rope, rope


def rope_from_hf(
    text: dict[str, Any], params: dict[str, Any], aliases: Mapping[str, str]
) -> RopeConfig:
    """One RoPE of a config.json: `params` are its rope_parameters (or rope_scaling), `aliases` the
    family's names for our RoPE types (`ConfigTraits.rope_aliases`)."""
    # transformers 5 writes `rope_parameters` (theta inside); older configs write
    # `rope_theta` + `rope_scaling`.
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope_type = aliases.get(rope_type, rope_type)
    names = {f.name for f in dataclasses.fields(RopeConfig)}
    kwargs = {k: v for k, v in params.items() if k in names and v is not None}
    kwargs.update(theta=float(theta), rope_type=rope_type)
    for name in ("short_factor", "long_factor"):
        if name in kwargs:
            kwargs[name] = tuple(float(x) for x in kwargs[name])
    if "partial_rotary_factor" in text:
        kwargs["partial_rotary_factor"] = text["partial_rotary_factor"]
    if rope_type == "longrope":
        old_len = kwargs.get(
            "original_max_position_embeddings",
            text.get("original_max_position_embeddings"),
        )
        if (
            old_len is None
            or not kwargs.get("short_factor")
            or not kwargs.get("long_factor")
        ):
            raise ValueError(
                "longrope needs original_max_position_embeddings, short_factor and long_factor"
            )
        kwargs["original_max_position_embeddings"] = old_len
        if (
            "factor" not in kwargs
        ):  # Phi-3: the ratio of the extended to the pretrained length
            kwargs["factor"] = text.get("max_position_embeddings", old_len) / old_len
    return RopeConfig(**kwargs)
