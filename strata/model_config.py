"""`ModelConfig`: what the model code needs, read from a Hugging Face config.json (its rotary
embedding as `RopeConfig`, its layers as `LayerSpec`s; the mixture-of-experts, latent-attention and
DeepSeek-V4 parts in strata/moe_config.py, strata/mla_config.py and strata/dsv4_config.py). A frozen
dataclass, one place for each default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strata.dsv4_config import DSV4Config, dsv4_from_hf
from strata.mla_config import MLAConfig, mla_from_hf, mla_scale
from strata.moe_config import MoEConfig, moe_from_hf, moe_layers
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
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{model_dir} has no config.json; expected a Hugging Face model directory"
            )
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
        head_dim = (
            mla.qk_rope_head_dim if mla else text.get("head_dim") or hidden // num_heads
        )
        num_layers = text["num_hidden_layers"]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = (
            tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        )
        gemma = model_type in ("gemma2", "gemma3_text")
        if text.get("use_bidirectional_attention"):
            raise ValueError(
                f"{architecture} with use_bidirectional_attention (an encoder) is not supported"
            )
        # per-layer attention: window, RoPE (Gemma 3: a local one for sliding layers), scale, softcap
        window = text.get("sliding_window")
        if "use_sliding_window" in text and not text.get("use_sliding_window"):
            window = None  # Qwen2/Qwen3 write a window they do not use
        kinds = _layer_types(text, model_type, num_layers, window)
        full_rope, local_rope = _ropes_from_hf(text, model_type)
        scalar = text.get("query_pre_attn_scalar")
        scale = (
            mla_scale(mla, full_rope)
            if mla
            else (scalar if scalar is not None else head_dim) ** -0.5
        )
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
        qk_norm = {
            "qwen3": "head",
            "qwen3_moe": "head",
            "gemma3_text": "head",
            "olmo2": "full",
        }.get(model_type, "none")
        qkv_bias_only = model_type in (
            "qwen2",
            "qwen2_moe",
        )  # q/k/v biased, o_proj never
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
            tie_word_embeddings=bool(
                raw.get("tie_word_embeddings", text.get("tie_word_embeddings", gemma))
            ),
            attention_bias=bool(
                text.get("attention_bias", text.get("qkv_bias", qkv_bias_only))
            ),
            o_proj_bias=bool(text.get("attention_bias", False)) and not qkv_bias_only,
            mlp_bias=bool(text.get("mlp_bias", False)),
            qk_norm=qk_norm,
            norm_layout=layout,
            norm_unit_offset=gemma,
            scale_embeddings=gemma,
            final_logit_softcap=text.get("final_logit_softcapping"),
            # Gemma reads `hidden_activation` (its `hidden_act` is a leftover of Gemma 1)
            hidden_act=(text.get("hidden_activation") if gemma else None)
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

    @classmethod
    def _from_deepseek_v4(
        cls, raw: dict[str, Any], text: dict[str, Any]
    ) -> ModelConfig:
        """DeepSeek-V4: every layer slides (its CSA/HCA layers also read compressed entries: `DSV4Config`),
        with sinks and experts in every layer; sliding layers rotate with the main RoPE, CSA/HCA layers
        with the compressors' (`compress_rope_theta`, YaRN where configured)."""
        params = text.get("rope_parameters") or {}
        main = _rope_from_hf(
            text,
            "deepseek_v4",
            {"rope_theta": text.get("rope_theta", 1e4), **(params.get("main") or {})},
        )
        compress = _rope_from_hf(
            text,
            "deepseek_v4",
            {
                "rope_theta": text.get("compress_rope_theta", 1.6e5),
                **(params.get("compress") or {}),
            },
        )
        v4 = dsv4_from_hf(text, compress)
        head_dim, expert_size = text["head_dim"], text["moe_intermediate_size"]
        specs = tuple(
            LayerSpec(
                rope=main if kind == "sliding" else compress,
                scale=head_dim**-0.5,
                window=v4.sliding_window,
                sinks=True,
                moe=True,
            )
            for kind in v4.layer_kinds
        )
        moe = MoEConfig(
            num_experts=text["n_routed_experts"],
            top_k=text["num_experts_per_tok"],
            intermediate_size=expert_size,
            routing="deepseek_v4",
            norm_topk_prob=True,
            routed_scaling_factor=float(text["routed_scaling_factor"]),
            correction_bias=True,
            swiglu_limit=v4.swiglu_limit,
            shared_intermediate_size=expert_size,
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
            eos_token_ids=tuple(eos)
            if isinstance(eos, list)
            else ((eos,) if eos is not None else ()),
        )


def _layer_types(
    text: dict[str, Any], model_type: str, num_layers: int, window: int | None
) -> list[str]:
    """HF's `layer_types` ("full_attention" | "sliding_attention" per layer), or the family's default
    where an older config.json has none: Gemma 2 alternates (sliding first), Gemma 3 has a full layer
    every `sliding_window_pattern` (6), Qwen2/3 slide from `max_window_layers` on, Mistral and Phi-3
    slide everywhere when they have a window."""
    kinds = text.get("layer_types")
    if kinds is None:
        if model_type == "gemma2":
            kinds = [
                "sliding_attention" if (i + 1) % 2 else "full_attention"
                for i in range(num_layers)
            ]
        elif model_type == "gemma3_text":
            pattern = text.get("sliding_window_pattern", 6)
            kinds = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        elif model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            first = text.get("max_window_layers", num_layers)
            kinds = [
                "sliding_attention" if i >= first else "full_attention"
                for i in range(num_layers)
            ]
        else:
            kinds = ["sliding_attention"] * num_layers
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
    text: dict[str, Any], model_type: str
) -> tuple[RopeConfig, RopeConfig]:
    """(RoPE of full-attention layers, RoPE of sliding layers). They differ only for Gemma 3: its
    sliding layers rotate with `rope_local_base_freq` (10k) and no scaling, its full layers with the
    global theta (1M) and `rope_scaling`; transformers 5 writes both under `rope_parameters` by kind."""
    params = text.get("rope_parameters") or {}
    if "full_attention" in params or model_type == "gemma3_text":
        full = {
            "rope_theta": text.get("rope_theta", 1_000_000.0),
            **(text.get("rope_scaling") or {}),
        }
        local = {"rope_theta": text.get("rope_local_base_freq", 10_000.0)}
        full.update(params.get("full_attention") or {})
        local.update(params.get("sliding_attention") or {})
        return _rope_from_hf(text, model_type, full), _rope_from_hf(
            text, model_type, local
        )
    rope = _rope_from_hf(
        text, model_type, {**(text.get("rope_scaling") or {}), **params}
    )
    return rope, rope


def _rope_from_hf(
    text: dict[str, Any], model_type: str, params: dict[str, Any]
) -> RopeConfig:
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
