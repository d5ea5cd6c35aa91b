"""DSpark block drafters (DeepSpec's `Qwen3DSparkModel`, arXiv 2607.05147): a few decoder layers that
draft a whole block of tokens in one forward from the target's own hidden states.

The drafter reads the target's residual stream after a few of its layers (`target_layer_ids`; -1:
the embeddings) at every position the target has computed, and makes each position a context row:

    c_p = hidden_norm(fc([h^{l_1}_p | ... | h^{l_n}_p]))

To draft after the sequence's last token t_a (at position a, not yet fed to the target), the block
[t_a, m, m, ..., m] (m: `mask_token_id`, `block_size` rows) at positions a .. a + B - 1 goes through
the layers. Each is Qwen3's (pre-norm, RMSNorm on each head of q and k, RoPE, SiLU MLP) except for
its keys and values: those of the context rows are k_proj/v_proj of c_p itself in every layer (not
of the layer's input, and without the input norm), those of the block rows are of the block's
hidden states; every block row sees every context row before a and every block row (no causal mask
inside the block). Block row i predicts t_{a+1+i} through the final norm and the LM head (the
target's: DeepSpec trains the drafter with frozen copies of the target's embedding and head), plus:

  * the Markov head: a low-rank bias from the previous token, w2(w1[prev_i]) (prev_0 = t_a, then
    each drafted token), optionally gated by the row's hidden state ("gated") or carried through
    a small recurrent state ("rnn");
  * the confidence head: sigmoid(w . [x_i | w1[prev_i]] + b), the chance that draft i is accepted
    given that the drafts before it were; the engine sets how many drafts to verify from it.

The context rows' K/V are stored once, as the target computes positions; the block's rows are written
past them and overwritten by the next context rows (`strata.engine.dspark` keeps the pool).
Checkpoints are DeepSpec's (`save_pretrained` of a Qwen3DSparkModel): config.json carrying a Qwen3
config plus the DSpark fields, and model.safetensors with `layers.*`, `norm`, `fc`, `hidden_norm`,
`markov_head.*`, `confidence_head.proj` (and the embedding and head copies, which are not read).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from strata.cache.kv_pool import MHAKVPool
from strata.layers.attention import AttentionMetadata, store_kv
from strata.layers.norm import RMSNorm
from strata.model_config import ModelConfig

if TYPE_CHECKING:
    from strata.models.decoder import Attention, DecoderLayer

ARCHITECTURE = "Qwen3DSparkModel"
# Strata's addition beside DeepSpec's files: the token ids a drafter drafts from (EAGLE-3's draft
# vocabulary), {"ids": [...]}: its logits are the target head's rows for them alone
DRAFT_VOCAB_FILE = "draft_vocab.json"
MARKOV_HEADS = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark fields of a drafter's config.json (DeepSpec's names)."""

    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    num_target_layers: int | None
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_head_with_markov: bool = False

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str = "the drafter") -> DSparkConfig:
        archs = raw.get("architectures") or []
        if archs[:1] != [ARCHITECTURE]:
            raise ValueError(
                f"{where}: config.json's architectures is {archs}; a DSpark drafter is a "
                f"{ARCHITECTURE} (DeepSpec's layout)"
            )
        missing = [
            k
            for k in ("target_layer_ids", "block_size", "mask_token_id")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"{where}: config.json lacks {', '.join(missing)}")
        layers = tuple(int(i) for i in raw["target_layer_ids"])
        if (
            not layers
            or any(b <= a for a, b in itertools.pairwise(layers))
            or layers[0] < -1
        ):
            raise ValueError(
                f"{where}: target_layer_ids {list(layers)} must be strictly increasing layer "
                "numbers (-1: the embeddings)"
            )
        rank = int(raw.get("markov_rank", 0) or 0)
        kind = str(raw.get("markov_head_type", "vanilla")).lower()
        if rank < 0 or (rank and kind not in MARKOV_HEADS):
            raise ValueError(
                f"{where}: markov_rank {rank} / markov_head_type {kind!r}; the head is one of "
                f"{MARKOV_HEADS} with a rank >= 0"
            )
        confidence = bool(raw.get("enable_confidence_head", False))
        with_markov = confidence and bool(raw.get("confidence_head_with_markov", False))
        if with_markov and not rank:
            raise ValueError(
                f"{where}: confidence_head_with_markov needs a Markov head (markov_rank > 0)"
            )
        block = int(raw["block_size"])
        if block < 1:
            raise ValueError(f"{where}: block_size must be at least 1, got {block}")
        target_layers = raw.get("num_target_layers")
        return cls(
            target_layer_ids=layers,
            block_size=block,
            mask_token_id=int(raw["mask_token_id"]),
            num_target_layers=None if target_layers is None else int(target_layers),
            markov_rank=rank,
            markov_head_type=kind,
            confidence_head=confidence,
            confidence_head_with_markov=with_markov,
        )


def read_dspark_dir(model_dir: Path) -> tuple[DSparkConfig, ModelConfig]:
    """A drafter directory's DSpark fields and its layers' config (read as Qwen3's)."""
    from strata.models import config_from_hf

    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"--speculative-draft-model {model_dir}: no config.json (a DeepSpec DSpark checkpoint "
            "directory is expected)"
        )
    raw = json.loads(path.read_text())
    where = f"--speculative-draft-model {model_dir.name}"
    dspark = DSparkConfig.from_hf(raw, where)
    layers = config_from_hf(
        {**raw, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    )
    return dspark, layers


class MarkovHead(nn.Module):
    """A bias on each drafted token's logits from the token before it (DeepSpec's names)."""

    def __init__(self, kind: str, vocab_size: int, rank: int, hidden_size: int):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embeddings(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    @property
    def recurrent(self) -> bool:
        """Whether a row's bias depends on the rows before it (beyond its previous token)."""
        return self.kind == "rnn"

    def latent(
        self,
        prev: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev [n] token ids, hidden [n, H] the rows' final hidden states, state the recurrent one
        (rnn; None before the block's first row) -> (the rank-r latent whose markov_w2 is the
        bias, the next state)."""
        e = self.markov_w1(prev)
        if self.kind == "vanilla":
            return e, None
        if self.kind == "gated":
            gate = torch.sigmoid(
                self.gate_proj(torch.cat([hidden, e.to(hidden.dtype)], -1))
            )
            return gate.to(e.dtype) * e, None
        if state is None:
            state = e.new_zeros(e.shape)
        z = torch.cat([state, e, hidden.to(e.dtype)], dim=-1)
        gate, candidate, out = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(out), state

    def step(
        self,
        prev: torch.Tensor,
        hidden: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `latent`, with the bias [n, vocab] in place of the latent."""
        z, state = self.latent(prev, hidden, state)
        return self.markov_w2(z), state


class DSparkDraft(nn.Module):
    """The drafter's own modules: the decoder layers and final norm (a `DecoderForCausalLM` of the
    drafter's Qwen3 config, without embedding or head), fc, hidden_norm and the two heads."""

    def __init__(
        self,
        cfg: DSparkConfig,
        layers_cfg: ModelConfig,
        max_positions: int,
        rope_device: torch.device | str = "cpu",
    ):
        from strata.models.decoder import DecoderForCausalLM

        super().__init__()
        self.cfg = cfg
        hidden = layers_cfg.hidden_size
        self.decoder = DecoderForCausalLM(layers_cfg, max_positions, rope_device)
        self.decoder.embed_tokens = None  # type: ignore[assignment]  # the target's
        self.decoder.lm_head = None
        self.fc = nn.Linear(len(cfg.target_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, layers_cfg.rms_norm_eps)
        self.markov_head = (
            MarkovHead(
                cfg.markov_head_type, layers_cfg.vocab_size, cfg.markov_rank, hidden
            )
            if cfg.markov_rank
            else None
        )
        self.confidence_head: nn.Linear | None = None
        if cfg.confidence_head:
            width = hidden + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
            self.confidence_head = nn.Linear(width, 1)
        # each layer's key and value rows of qkv_proj, for context rows (made by `load_weights`)
        self.context_kv = nn.ModuleList()
        # a draft vocabulary (`restrict_vocab`): its head rows, and the token id of each
        self.head: nn.Linear | None = None
        self.vocab_ids: torch.Tensor | None = None

    def restrict_vocab(self, ids: torch.Tensor, head_rows: torch.Tensor) -> None:
        """Draft from the tokens `ids` alone: logits from `head_rows` [N, hidden] (the target head's
        rows for them), the Markov bias from the same rows of markov_w2."""
        self.head = nn.Linear(head_rows.shape[1], len(ids), bias=False)
        self.head.weight = nn.Parameter(head_rows, requires_grad=False)
        if self.markov_head is not None:
            w2 = self.markov_head.markov_w2.weight
            self.markov_head.markov_w2 = nn.Linear(w2.shape[1], len(ids), bias=False)
            self.markov_head.markov_w2.weight = nn.Parameter(
                w2[ids].clone(), requires_grad=False
            )
        self.vocab_ids = ids

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """The target's captured streams [m, n * hidden] -> context rows c [m, hidden]."""
        return self.hidden_norm(self.fc(features))

    def store_context(
        self,
        c: torch.Tensor,
        positions: torch.Tensor,
        kv: MHAKVPool,
        slots: torch.Tensor,
    ) -> None:
        """Each layer's keys and values of context rows c [m, hidden] (at `positions`) into `slots`."""
        for i, (layer, rope) in enumerate(
            zip(self.decoder.layers, self.decoder.layer_ropes)
        ):
            attn = cast("Attention", cast("DecoderLayer", layer).self_attn)
            k, v = self.context_kv[i](c).split([attn.kv_size, attn.kv_size], dim=-1)
            if attn.k_norm is not None and attn.qk_norm == "full":
                k = attn.k_norm(k)
            k = k.view(-1, attn.num_kv_heads, attn.head_dim)
            if attn.k_norm is not None and attn.qk_norm == "head":
                k = attn.k_norm(k)
            _, k = rope(
                positions, k[:, :0], k
            )  # no queries: a context row attends to nothing
            store_kv(k, v.reshape(k.shape), kv.k[i], kv.v[i], slots)

    def block(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: MHAKVPool,
    ) -> torch.Tensor:
        """The block rows' final hidden states [N, hidden]: `meta` stores their K/V (out_slots) and
        lets each row attend to every key up to its block's last (see strata.engine.dspark)."""
        x, residual = embeds, None
        for layer, rope in zip(self.decoder.layers, self.decoder.layer_ropes):
            x, residual = layer(x, residual, positions, rope, meta, kv)
        return self.decoder.norm(x, residual)[0]

    def pick(
        self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy drafts from a block's base logits [n, B, V] (V: the draft vocabulary's columns
        where there is one) and final hidden states [n, B, H], the
        Markov head chained on each drafted token (the first row's previous token: the anchor [n]).
        Returns (tokens [n, B], the confidence head's probabilities [n, B] or None).

        Only the chain is row by row (each row's bias needs the token drafted before it); the
        confidence head, which reads each row's previous token but decides no token, runs once
        over the whole block afterwards."""
        prev, state = anchors, None
        tokens, prevs = [], []
        for i in range(logits.shape[1]):
            prevs.append(prev)
            row = logits[:, i]
            if self.markov_head is not None:
                bias, state = self.markov_head.step(prev, hidden[:, i], state)
                row = row + bias[:, : row.shape[-1]].float()
            prev = row.argmax(dim=-1)
            if (
                self.vocab_ids is not None
            ):  # a column of the draft vocabulary -> its token
                prev = self.vocab_ids[prev]
            tokens.append(prev)
        drafted = torch.stack(tokens, dim=1)
        if self.confidence_head is None:
            return drafted, None
        features = hidden
        if self.cfg.confidence_head_with_markov:
            assert self.markov_head is not None
            e = self.markov_head.prev_embeddings(torch.stack(prevs, dim=1))
            features = torch.cat([features, e.to(features.dtype)], dim=-1)
        probs = torch.sigmoid(self.confidence_head(features).float()).squeeze(-1)
        return drafted, probs

    def load_weights(self, weights, where: str) -> None:
        """DeepSpec's tensors: the layers and norm into the decoder (its q/k/v and gate/up fusions),
        the rest by name; the embedding and head copies are skipped (the target's are used)."""
        own = dict(self.named_parameters())
        layers = []
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in ("embed_tokens.weight", "lm_head.weight"):
                continue
            if name.startswith(("layers.", "norm.")):
                layers.append((name, tensor))
                continue
            name = name.replace("confidence_head.proj.", "confidence_head.")
            if name not in own:
                raise ValueError(f"{where}: unexpected weight {name!r}")
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"{where}: weight {name!r} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(own[name].shape)}"
                )
            own[name].data.copy_(tensor)
            loaded.add(name)
        self.decoder.load_weights(layers)
        self.context_kv = nn.ModuleList(
            _kv_rows(cast("Attention", cast("DecoderLayer", layer).self_attn))
            for layer in self.decoder.layers
        )
        missing = {
            n for n in own if not n.startswith(("decoder.", "context_kv."))
        } - loaded
        if missing:
            raise ValueError(f"{where}: the checkpoint lacks {sorted(missing)}")


def _kv_rows(attn: Attention) -> nn.Linear:
    """A copy of the key and value rows of an attention's fused projection: a context row needs no
    query, and its rows are most of what storing context costs."""
    qkv = attn.qkv_proj
    w = qkv.weight
    kv = nn.Linear(
        w.shape[1],
        2 * attn.kv_size,
        bias=qkv.bias is not None,
        device=w.device,
        dtype=w.dtype,
    )
    with torch.no_grad():
        kv.weight.copy_(w[attn.q_size :])
        if qkv.bias is not None:
            kv.bias.copy_(qkv.bias[attn.q_size :])
    return kv
