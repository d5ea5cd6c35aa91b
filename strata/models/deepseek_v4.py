"""DeepSeek-V4: sliding-window attention in every layer, compressed sparse (CSA) and heavily
compressed (HCA) attention on top of it (`strata.layers.dsv4_attention`), hyper-connected residual
streams (`strata.layers.hyper_connection`), and a mixture of experts in every layer.

    ids -> embed -> hc_mult copies of the stream
        per layer: attn_hc -> input_layernorm -> attention -> merge;  ffn_hc -> post_attention_layernorm
                   -> experts + shared expert -> merge
    -> hc_head (streams -> one) -> norm -> lm_head

The experts: scores = sqrt(softplus(router logits)) (or sigmoid / softmax per `scoring_func`);
a layer listed as `hash_moe` takes its experts from a token-id table (`tid2eid[input id]`, hence
the input ids in `forward`), the others the top-k of scores + `e_score_correction_bias`; the weights
are the chosen scores renormalised, times `routed_scaling_factor`. Experts and the shared expert
clamp their gate above and their up projection to [-swiglu_limit, swiglu_limit] before SiLU(gate) * up.

V4.1-style configs add Engram (`strata.layers.engram`) at `engram_layers`: before the layer's
attention, each stream gets a gated memory row looked up by hashed n-grams of the token ids. The
n-grams of a step's first positions reach back before what it feeds, so the model asks the runner
for `ngram_context` token ids before each request's fed tokens (`prepare_ngrams`).

The state lives in `strata.cache.dsv4_pool.DSV4KVPool`; checkpoint names are transformers' (the
multi-token-prediction layers, `mtp.*`, are skipped; FP8 checkpoints are refused).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.cache.dsv4_pool import DSV4KVPool
from strata.dsv4_config import dsv4_from_hf
from strata.layers.activation import clamped_silu_mul
from strata.layers.attention import AttentionMetadata
from strata.layers.dsv4_attention import DSV4Attention, RMSNorm32
from strata.layers.engram import Engram, EngramInputs, hash_ngrams
from strata.layers.engram_tables import OffloadedTables
from strata.layers.hyper_connection import HyperConnection, HyperHead
from strata.layers.moe import Experts
from strata.model_config import ConfigTraits, LayerSpec, ModelConfig, rope_from_hf
from strata.models.spec import FamilySpec, KVLayout
from strata.moe_config import MoEConfig


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, size: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, size, bias=False)
        self.up_proj = nn.Linear(hidden, size, bias=False)
        self.down_proj = nn.Linear(size, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(
            clamped_silu_mul(self.gate_proj(x), self.up_proj(x), self.limit)
        )


class DSV4MoE(nn.Module):
    """Router (`gate`: weight, and tid2eid or e_score_correction_bias), the routed experts
    (`strata.layers.moe.Experts` with V4's clamped SiLU, or expert parallel's slots) and the shared
    expert."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        moe, v4 = cfg.moe, cfg.dsv4
        E, k, H = moe.num_experts, moe.top_k, cfg.hidden_size
        self.top_k, self.scale = k, moe.routed_scaling_factor
        self.scoring_func = v4.scoring_func
        self.is_hash = v4.hash_layers[layer_id]
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(E, H))
        if self.is_hash:
            self.gate.register_buffer(
                "tid2eid", torch.empty(cfg.vocab_size, k, dtype=torch.int64)
            )
        else:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.empty(E, dtype=torch.float32)
            )
        self.experts: nn.Module = Experts(H, moe)
        self.shared_experts = SharedExpert(
            H, moe.shared_intermediate_size, moe.swiglu_limit
        )
        self.register_buffer(
            "expert_load", torch.zeros(E, dtype=torch.int64), persistent=False
        )

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        scores = router_scores(
            F.linear(x, self.gate.weight), self.scoring_func
        )  # [T, E]
        if self.is_hash:
            experts = self.gate.tid2eid[input_ids]
        else:
            choice = scores + self.gate.e_score_correction_bias
            experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts).float()
        weights = (
            weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        )  # [T, k]
        counts = torch.bincount(
            experts.reshape(-1), minlength=self.gate.weight.shape[0]
        )
        self.expert_load += counts
        return self.experts(x, weights, experts, counts) + self.shared_experts(x)


class DSV4Layer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, rope_device: torch.device | str
    ):
        super().__init__()
        v4, H, eps = cfg.dsv4, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = DSV4Attention(cfg, layer_id, rope_device)
        self.mlp = DSV4MoE(cfg, layer_id)
        self.input_layernorm = RMSNorm32(H, eps)
        self.post_attention_layernorm = RMSNorm32(H, eps)
        self.attn_hc = HyperConnection(
            H, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, eps
        )
        self.ffn_hc = HyperConnection(
            H, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, eps
        )
        self.engram = (
            Engram(v4.engram, layer_id, H, eps)
            if v4.engram is not None and layer_id in v4.engram.layers
            else None
        )

    def forward(
        self, streams, input_ids, positions, meta, kv, shared, ngrams
    ):  # streams [T, hc_mult, H]
        if self.engram is not None:
            if ngrams is None:
                raise ValueError(
                    "this model has Engram layers: its forward needs `ngrams` "
                    "(ModelRunner.prepare builds them)"
                )
            streams = self.engram(streams, ngrams, positions, meta, kv)
        h, post, comb = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(h), positions, meta, kv, shared)
        streams = HyperConnection.merge(streams, out, post, comb)
        h, post, comb = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(h), input_ids)
        return HyperConnection.merge(streams, out, post, comb)


# DeepSeek's MLP names (`ffn.experts.E.w1`, `ffn.shared_experts.w3`) -> ours: plain replacements,
# part of `our_name` and, alone, what a parallel rank's slicing and EPLB's reload read
_MLP_RENAMES: tuple[tuple[str, str], ...] = (
    (".ffn.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


class DeepseekV4ForCausalLM(nn.Module):
    RENAMES = _MLP_RENAMES  # what `strata.distributed` applies; loading goes through `our_name`

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        rope_device: torch.device | str = "cpu",
    ):
        super().__init__()
        if cfg.dsv4 is None:
            raise ValueError(f"{cfg.architecture} needs a deepseek_v4 config.json")
        self.config = cfg
        v4, H = cfg.dsv4, cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.layers = nn.ModuleList(
            DSV4Layer(cfg, i, rope_device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm32(H, cfg.rms_norm_eps)
        self.hc_head = HyperHead(H, v4.hc_mult, v4.hc_eps, cfg.rms_norm_eps)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(H, cfg.vocab_size, bias=False)
        )
        engram = v4.engram
        # token ids before each request's fed tokens that a forward needs (0: none)
        self.ngram_context = engram.context_len if engram is not None else 0
        if engram is not None and engram.vocab_map_size is not None:
            self.register_buffer(
                "engram_vocab_map", torch.empty(cfg.vocab_size, dtype=torch.int64)
            )
        # --engram-placement host | mmap: the tables outside the model (the loader sets them)
        self.engram_tables: OffloadedTables | None = None
        self._vocab_map_cpu: torch.Tensor | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: DSV4KVPool,
        ngrams: EngramInputs | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; ngrams: `prepare_ngrams`' (models with Engram layers).
        Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.dsv4.hc_mult, -1).contiguous()
        shared: dict = {}  # what every layer of this step computes alike (strata.layers.dsv4_attention)
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, meta, kv, shared, ngrams)
        return self.norm(self.hc_head(streams))

    def prepare_ngrams(self, ngram_ids: torch.Tensor) -> EngramInputs:
        """ngram_ids: [T, ngram_context + 1] CPU int64, row t the ids at t - K .. t of its sequence
        (-1 before the sequence's first token). Hashes every Engram layer's rows, and starts gathering
        them where the tables live outside the model."""
        engram = self.config.dsv4.engram
        assert engram is not None
        if engram.vocab_map_size is not None:
            if self._vocab_map_cpu is None:  # the map is read on the host, once
                self._vocab_map_cpu = self.engram_vocab_map.cpu()
            compressed = self._vocab_map_cpu[ngram_ids.clamp(min=0)]
        else:
            compressed = ngram_ids.clone()
        compressed[ngram_ids < 0] = engram.pad_id
        indices = {}
        for layer in self.layers:
            if layer.engram is not None:
                indices[layer.engram.layer_id] = hash_ngrams(
                    compressed, layer.engram.multipliers, engram.table_size
                )  # [T, num_tables] on the CPU
        if self.engram_tables is not None:
            return EngramInputs(indices, self.engram_tables.start(indices), ngram_ids)
        device = self.embed_tokens.weight.device
        return EngramInputs(
            {k: v.to(device) for k, v in indices.items()}, ids=ngram_ids
        )

    def take_engram_tables(self, checkpoint_names: Iterable[str]) -> dict[str, int]:
        """Drop the Engram tables from the model (they will live outside it) and name the checkpoint
        tensors that hold them: {checkpoint name: layer}."""
        want = {}
        for layer in self.layers:
            if layer.engram is not None:
                layer.engram.embedding = None
                want[f"layers.{layer.engram.layer_id}.engram.embedding"] = (
                    layer.engram.layer_id
                )
        return {
            n: want[ours] for n in checkpoint_names if (ours := our_name(n)) in want
        }

    def expert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor of the experts in our layout (EPLB's reload): already is."""
        return tensor

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of each layer since the last reset."""
        counts = torch.stack([layer.mlp.expert_load for layer in self.layers]).tolist()
        return dict(enumerate(counts))

    def reset_expert_load(self) -> None:
        for layer in self.layers:
            layer.mlp.expert_load.zero_()

    def checkpoint_parts(self, module: str) -> list[str]:
        return [f"{'' if module == 'lm_head' else 'model.'}{module}.weight"]

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        absent: frozenset[str] = frozenset(),
    ) -> None:
        """Copy checkpoint tensors in: DeepSeek's own names (as published, and as transformers saves
        them) or transformers' in-memory ones; per-expert w1/w3/w2 are stacked into gate_up_proj and
        down_proj; the token-id tables come back as int64 (the loader hands every tensor over in the
        model's dtype)."""
        targets = dict(self.named_parameters())
        targets.update(
            (n, b)
            for n, b in self.named_buffers()
            if n.endswith(("tid2eid", "engram_vocab_map"))
        )
        loaded: set[str] = set()
        pieces: dict[
            str, int
        ] = {}  # stacked expert parameter -> per-expert tensors copied in
        for ckpt_name, tensor in weights:
            if "scale_inv" in ckpt_name or ckpt_name.endswith("weight_scale"):
                raise ValueError(
                    f"this checkpoint holds FP8 weights ({ckpt_name}), which Strata does not read; "
                    "use a bf16 checkpoint"
                )
            name = our_name(ckpt_name)
            if name is None:
                continue
            expert = _EXPERTS.fullmatch(name)
            if (
                expert is not None
            ):  # to the experts module: ours, or expert parallel's slots
                layer, rest = int(expert[1]), expert[2]
                experts = self.layers[layer].mlp.experts
                target, count = experts.load(rest, tensor)
                stacked = f"layers.{layer}.mlp.experts.{target}"
                pieces[stacked] = pieces.get(stacked, 0) + count
                if pieces[stacked] >= experts.num_pieces(target):
                    loaded.add(stacked)
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(
                    f"unexpected weight {ckpt_name!r} for {self.config.architecture}"
                )
            if (
                name.endswith(("tid2eid", "engram_vocab_map"))
                and tensor.is_floating_point()
            ):
                tensor = tensor.round()
            _copy(target.data, tensor, ckpt_name)
            loaded.add(name)
        missing = set(targets) - loaded - absent
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:8]}")
        self.reset_expert_load()
        self._vocab_map_cpu = None


def _copy(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


_EXPERTS = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.(.+)"
)  # -> the experts module's name
# DeepSeek's checkpoint names -> ours (transformers' in-memory names), applied in order
_RENAMES = [
    (re.compile(a), b)
    for a, b in (
        (r"\.attn\.", ".self_attn."),
        *((re.escape(a), b) for a, b in _MLP_RENAMES),
        (r"\.indexer\.compressor\.", ".compressor.indexer."),
        (r"^embed\.weight", "embed_tokens.weight"),
        (r"^head\.weight", "lm_head.weight"),
        (r"^hc_head_(fn|base|scale)", r"hc_head.hc_\1"),
        (r"\.attn_norm\.", ".input_layernorm."),
        (r"\.ffn_norm\.", ".post_attention_layernorm."),
        (r"\.hc_attn_(fn|base|scale)", r".attn_hc.\1"),
        (r"\.hc_ffn_(fn|base|scale)", r".ffn_hc.\1"),
        (r"\.attn_sink", ".sinks"),
        (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        (r"\.norm\.", ".kv_norm."),
        (r"\.ape$", ".position_bias"),
        (r"\.wq_a\.", ".q_a_proj."),
        (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
        (r"\.wkv\.", ".kv_proj."),
        (r"\.wgate\.", ".gate_proj."),
        (r"\.wo_a\.", ".o_a_proj."),
        (r"\.wo_b\.", ".o_b_proj."),
        (r"\.q_norm\.", ".q_a_norm."),
        (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    )
]


def our_name(ckpt_name: str) -> str | None:
    """A checkpoint tensor's parameter name here; None for what is not loaded (the MTP layers)."""
    name = ckpt_name.removeprefix("model.")
    if name.startswith("mtp.") or ".mtp." in name or "rotary_emb" in name:
        return None
    for pattern, replacement in _RENAMES:
        name = pattern.sub(replacement, name)
    return name


def read_config(raw: dict[str, Any]) -> ModelConfig:
    """A `deepseek_v4` config.json: every layer slides (its CSA/HCA layers also read compressed
    entries: `DSV4Config`), with sinks and experts in every layer; sliding layers rotate with the
    main RoPE, CSA/HCA layers with the compressors' (`compress_rope_theta`, YaRN where configured)."""
    text = raw.get("text_config") or raw
    params = text.get("rope_parameters") or {}
    main = rope_from_hf(
        text,
        {"rope_theta": text.get("rope_theta", 1e4), **(params.get("main") or {})},
        {},
    )
    compress = rope_from_hf(
        text,
        {
            "rope_theta": text.get("compress_rope_theta", 1.6e5),
            **(params.get("compress") or {}),
        },
        {},
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
        expert_act="clamped_silu",
        swiglu_limit=v4.swiglu_limit,
        shared_intermediate_size=expert_size,
    )
    eos = text.get("eos_token_id")
    return ModelConfig(
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


SPEC = FamilySpec(
    name="deepseek_v4",
    architectures={"DeepseekV4ForCausalLM": DeepseekV4ForCausalLM},
    model_types={"deepseek_v4": ConfigTraits(parse=read_config)},
    kv_layout=KVLayout.DSV4,
    tensor_parallel=False,
    expert_parallel=True,
    native_decode=False,
    draft_model=False,
)
