"""The decoder every family here is made of, driven by `ModelConfig` and its per-layer `LayerSpec`s.

A family file (llama.py, gemma.py, phi3.py, olmo2.py, mixtral.py, qwen_moe.py, gpt_oss.py,
deepseek_v2.py) names its class and states what differs in its checkpoint; everything a config
decides (norm layout, q/k norm, windows, RoPE per layer kind, softcaps, activation, embedding scale,
which layers are mixtures of experts and how they route, latent attention) is read here from the
config, never from the family's name.

Per layer, with the residual stream carried beside the hidden state so that each add fuses into
the next norm (see `ModelConfig` for the three norm layouts):

    x, residual -> [norms] -> qkv_proj -> (q/k norm) -> RoPE -> paged attention -> o_proj
                               (or, with `ModelConfig.mla`: the latent attention of strata.layers.mla)
                -> [norms] -> gate_up_proj -> act(gate) * up -> down_proj -> x, residual
                               (or, where `LayerSpec.moe`: the mixture of experts of strata.layers.moe)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from strata import kernels
from strata.cache.kv_pool import KVPool, MHAKVPool
from strata.layers.activation import check_activation
from strata.layers.attention import AttentionMetadata, paged_attention
from strata.layers.mla import MLAttention
from strata.layers.mlp import MLP
from strata.layers.moe import ExpertLoader, MoE
from strata.layers.norm import RMSNorm
from strata.layers.rope import RotaryEmbedding
from strata.model_config import LayerSpec, ModelConfig
from strata.models.native_decode import NativeDecode


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.spec: LayerSpec = cfg.layers[layer_id]
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # "head": one RMSNorm over each head's head_dim; "full": over all heads of q (of k) at once
        self.qk_norm = cfg.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm != "none":
            full = cfg.qk_norm == "full"
            self.q_norm = RMSNorm(
                self.q_size if full else self.head_dim,
                cfg.rms_norm_eps,
                cfg.norm_unit_offset,
            )
            self.k_norm = RMSNorm(
                self.kv_size if full else self.head_dim,
                cfg.rms_norm_eps,
                cfg.norm_unit_offset,
            )
        self.sinks = (
            nn.Parameter(torch.zeros(self.num_heads)) if self.spec.sinks else None
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv: MHAKVPool,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        if self.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        spec = self.spec
        layer = self.layer_id
        out = paged_attention(
            q,
            k,
            v,
            kv.k[layer],
            kv.v[layer],
            meta.group(kv.group_of[layer]),
            spec.scale,
            window=spec.window,
            sinks=self.sinks,
            softcap=spec.softcap,
        )
        return self.o_proj(out.view(-1, self.q_size))


class DecoderLayer(nn.Module):
    """One layer in its config's norm layout. The norms keep their HF names: in the `pre` layout
    `post_attention_layernorm` is the norm *before* the MLP (Llama's naming)."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layout = cfg.norm_layout
        self.self_attn = (
            MLAttention(cfg, layer_id) if cfg.mla else Attention(cfg, layer_id)
        )
        self.mlp: MoE | MLP
        if cfg.layers[layer_id].moe:
            assert cfg.moe is not None  # a layer is MoE only in an MoE model
            self.mlp = MoE(cfg.hidden_size, cfg.moe, cfg.mlp_bias)
        else:
            act = check_activation(cfg.hidden_act, cfg.architecture)
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act, cfg.mlp_bias)

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)

        if self.layout in ("pre", "sandwich"):
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.layout in ("sandwich", "post"):
            self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, positions, rope, meta, kv):
        """(x, residual): the stream is x + residual (residual None: x alone). Returns the layer's
        last output and the stream before it; the caller adds them (fused into the next norm)."""
        if self.layout == "post":  # OLMo 2: no norm before attention, so no add to fuse
            h = x if residual is None else x + residual
            h = h + self.post_attention_layernorm(
                self.self_attn(h, positions, rope, meta, kv)
            )
            return self.post_feedforward_layernorm(self.mlp(h)), h
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, meta, kv)
        if self.layout == "pre":
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h = self.post_attention_layernorm(h)  # sandwich (Gemma 2/3)
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderForCausalLM(nn.Module):
    """Embeddings, the layers, the final norm and the LM head; weights from HF checkpoint names."""

    # HF checkpoint name fragment -> (our parameter fragment, index of the shard inside the fused
    # weight); a family whose checkpoint already stores fused weights (Phi-3) sets it empty
    FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # checkpoint name fragment -> ours, replaced before anything else (Mixtral: block_sparse_moe -> mlp)
    RENAMES: tuple[tuple[str, str], ...] = ()

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        rope_device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # plain objects, not submodules: their fp32 tables survive dtype casts and meta-device construction;
        # one table per distinct RoPE (Gemma 3: one for sliding layers, one for full ones)
        tables: dict = {}
        for spec in cfg.layers:
            if spec.rope not in tables:
                tables[spec.rope] = RotaryEmbedding(
                    spec.rope,
                    cfg.head_dim,
                    max_positions,
                    cfg.max_position_embeddings,
                    rope_device,
                )
        self.layer_ropes = [tables[spec.rope] for spec in cfg.layers]
        self._native: NativeDecode | Literal[False] | None = (
            False  # False: not built yet
        )
        # the residual stream after these layers (-1: the embeddings) is kept by each forward in
        # `captured` [T, len * hidden], in this order (a DSpark drafter reads the target's layers)
        self.capture_after: tuple[int, ...] = ()
        self.captured: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVPool,
    ) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        if (
            self.config.scale_embeddings
        ):  # Gemma: the factor rounded to the weights' dtype, as trained
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        capture = self.capture_after
        native = self.native_decode()
        if (
            native is not None
            and isinstance(kv, MHAKVPool)
            and native.accepts(x, meta, kv)
        ):
            self.captured = (
                x.new_empty(x.shape[0], len(capture) * x.shape[1]) if capture else None
            )
            # the same kernels as the loop below, from C++
            x, residual = native(x, positions, meta, kv, capture, self.captured)
        else:
            streams = {-1: x} if -1 in capture else {}
            for i, (layer, rope) in enumerate(zip(self.layers, self.layer_ropes)):
                x, residual = layer(x, residual, positions, rope, meta, kv)
                if i in capture:
                    streams[i] = x + residual
            self.captured = (
                torch.cat([streams[i] for i in capture], dim=-1) if capture else None
            )
        return self.norm(x, residual)[0]

    def capture_layers(self, layers: tuple[int, ...]) -> None:
        """Keep the residual stream after `layers` (-1: the embeddings) from every later forward in
        `captured`; () stops."""
        bad = [i for i in layers if not -1 <= i < self.config.num_layers]
        if bad:
            raise ValueError(
                f"layers {bad} are out of range for a model of {self.config.num_layers} layers "
                "(-1 is the embeddings)"
            )
        self.capture_after = tuple(layers)

    def native_decode(self) -> NativeDecode | None:
        """The native layer loop for decode steps (strata.models.native_decode), built on first use,
        once the weights are in their final form; None where the model or machine does not qualify."""
        if self._native is False:
            if (
                kernels.cpu_ops() is None
            ):  # no kernels now (kernels.disabled(), none built): decide later
                return None
            self._native = NativeDecode.build(self, Attention)
        return self._native

    def reset_native_decode(self) -> None:
        """Forget the native loop (after modules are replaced: it holds their tensors); built again on use."""
        self._native = False

    def native_decode_supported(self) -> bool:
        """Whether decode steps will run the native loop where the kernels are available."""
        return NativeDecode.supported(self, Attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [S, hidden] rows to sample -> float32 logits [S, vocab]."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        else:
            logits = self.lm_head(
                hidden
            ).float()  # a module: may be a quantized copy of tied embeddings
        cap = self.config.final_logit_softcap
        return logits if cap is None else softcap(logits, cap)

    def checkpoint_parts(self, module: str) -> list[str]:
        """The checkpoint tensors one of our linear/embedding weights is made of, in row order
        (`layers.0.self_attn.qkv_proj` -> the layer's q_proj, k_proj, v_proj weights)."""
        parent, _, leaf = module.rpartition(".")
        frags = sorted(
            (shard, frag)
            for frag, (fused, shard) in self.FUSED.items()
            if fused == leaf
        )
        prefix = "" if module == "lm_head" else "model."
        names = [f"{parent}.{frag}" for _, frag in frags] if frags else [module]
        return [f"{prefix}{name}.weight" for name in names]

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of each mixture-of-experts layer since the last reset
        ({layer: [count per expert]}; a token counts once for each of its top-k experts)."""
        moe = [
            (i, layer.mlp.expert_load)
            for i, layer in enumerate(self.layers)
            if isinstance(layer.mlp, MoE)
        ]
        if not moe:
            return {}
        counts = torch.stack(
            [c for _, c in moe]
        ).tolist()  # one copy off the device, not one per layer
        return {i: layer_counts for (i, _), layer_counts in zip(moe, counts)}

    def reset_expert_load(self) -> None:
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.expert_load.zero_()

    def expert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor of the experts (`name` relative to them) in our layout; a family whose
        checkpoint stacks its experts differently converts here (GPT-OSS)."""
        return tensor

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        absent: frozenset[str] = frozenset(),
    ) -> None:
        """Copy checkpoint tensors into our parameters; `absent`: parameters the caller fills otherwise."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        expert_pieces: dict[
            str, int
        ] = {}  # stacked expert parameter -> checkpoint tensors copied in
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            for old, new in self.RENAMES:
                name = name.replace(old, new)
            if "rotary_emb" in name:
                continue
            if ".experts." in name:
                module, _, rest = name.partition(".experts.")
                experts = cast(ExpertLoader, self.get_submodule(f"{module}.experts"))
                target, pieces = experts.load(rest, self.expert_tensor(rest, tensor))
                full = f"{module}.experts.{target}"
                expert_pieces[full] = expert_pieces.get(full, 0) + pieces
                if expert_pieces[full] >= experts.num_pieces(target):
                    loaded.add(full)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes store the copy
            for frag, (fused, shard) in self.FUSED.items():
                if f".{frag}." in name:
                    name = name.replace(frag, fused)
                    self._load_shard(params[name], tensor, fused, shard)
                    break
            else:
                if name not in params:
                    raise ValueError(
                        f"unexpected weight {hf_name!r} for {self.config.architecture}"
                    )
                if params[name].shape != tensor.shape:
                    raise ValueError(
                        f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                    )
                params[name].data.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded - absent
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        self.reset_expert_load()  # the counters were allocated uninitialised with the weights

    def _load_shard(
        self, param: nn.Parameter, tensor: torch.Tensor, fused: str, shard: int
    ) -> None:
        cfg = self.config
        if fused == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            offset, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:  # gate_up_proj of a dense MLP or of a shared expert: gate rows, then up rows
            size = param.shape[0] // 2
            offset = shard * size
        if tensor.shape[0] != size:
            raise ValueError(
                f"{fused} shard {shard} has {tensor.shape[0]} rows, expected {size}"
            )
        param.data[offset : offset + size].copy_(tensor)
