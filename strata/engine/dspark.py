"""`--speculative-algorithm dspark`: a block of drafts per forward from a DSpark drafter
(`strata.models.dspark`), fed with the target's own hidden states.

The drafter keeps paged KV of its own (its layers: a pool and allocator of its own, sized like the
target's): per request, one context row per position the target has computed (`extend`, after every
step: a prefill chunk's positions, a decode's one, a verification's accepted run plus the target's
own token). A context row costs no attention: only fc, the norm and each layer's key and value
projections of the target's captured streams.

To draft (`propose`), each request's block — its last token and block_size - 1 mask tokens, at the
positions after its context rows — goes through the layers in one batched forward. The block's K/V
are written to the slots after the context rows (overwritten by the next `extend`: nothing needs
undoing when drafts are rejected), and each block row attends as a decode row whose position is its
block's last: every context row and every row of its block, no causal mask inside the block. One
forward drafts the whole block for every request that drafts this step, with the confidence head's
chance that each draft is accepted (given the ones before it); the speculator chooses how many to
verify from those (`strata.engine.speculative`).

Where the target computed no hidden states — a prompt prefix that came from the radix cache, a
prefill done by a PD peer — a request's context rows start at the first position the target
computed here (the drafter does not see the prefix: drafts may be weaker, output never changes). A
request retracted and recomputed starts over the same way. Drafts are argmax: deterministic, so the
target's rejection test keeps its distribution for sampled requests.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from strata.cache.allocator import PageAllocator
from strata.cache.kv_pool import MHAKVPool
from strata.engine.draft_rows import DraftOptions, Rows, RowsByRequest
from strata.layers.attention import AttentionMetadata
from strata.models.decoder import DecoderForCausalLM
from strata.models.dspark import DRAFT_VOCAB_FILE, DSparkDraft, read_dspark_dir

logger = logging.getLogger(__name__)

PENDING_ROWS = (
    4096  # captured rows kept waiting, all requests together, before they are stored
)
# steps a request may go without a block drafted for it before, once PENDING_ROWS wait, its rows
# are given up rather than stored (a large batch, where the speculator prices blocks out)
IDLE_STEPS = 64


@dataclass
class Proposal:
    """A request's drafts, and the chance of each being accepted given the ones before it (None:
    the drafter has no confidence head)."""

    tokens: list[int]
    confidence: list[float] | None = None
    # False: no block was drafted (the request's context rows do not reach its last token, or the
    # pool is short of pages), so this says nothing of what the drafter's blocks buy
    drafted: bool = True


class DSparkDrafter:
    needs_hidden = (
        True  # the model runner keeps each step's captured streams for `extend`
    )
    block = True  # one forward proposes a whole block, with confidences (`propose`)

    def __init__(
        self,
        target: DecoderForCausalLM,
        model_dir: str | Path,
        options: DraftOptions,
        vocab_size: int,
        threshold: float = 0.0,
    ):
        from strata.weights.default_model import resolve_model_path

        resolved = resolve_model_path(str(model_dir))
        assert resolved is not None  # a path given is a path resolved
        model_dir = resolved
        dtype, device, page_size = options.dtype, options.device, options.page_size
        self.model = load_dspark(
            model_dir,
            target,
            dtype,
            device,
            options.context_len,
            options.quantization,
        )
        cfg = self.model.cfg
        # the target's layers whose streams the scheduler keeps while this drafter is attached
        self.capture_after = cfg.target_layer_ids
        self.target = target
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.threshold = threshold
        layers_cfg = self.model.decoder.config
        num_pages = options.num_pages
        self.kv = MHAKVPool(
            layers_cfg.num_layers,
            layers_cfg.num_kv_heads,
            layers_cfg.head_dim,
            num_pages,
            page_size,
            dtype,
            device,
        )
        self.allocator = PageAllocator(num_pages, page_size)
        self.page_size = page_size
        self.device = device
        self.vocab_size = vocab_size
        # each request's context rows: positions [first, end) of the target
        self.rows = RowsByRequest(Rows, self.allocator)
        self.seqs = self.rows.seqs
        # per request, the captured streams of steps whose context rows are not made yet: (p0, [m, ...])
        self.pending: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.pending_rows = 0
        self.idle: dict[
            str, int
        ] = {}  # per request: steps since a block was drafted for it
        # requests whose rows were given up while idle: none kept until a block is asked for them
        self.dormant: set[str] = set()
        logger.info(
            "DSpark drafter %s: %d layers, blocks of %d, reading the target's layers %s; %d KV tokens",
            model_dir.name,
            layers_cfg.num_layers,
            cfg.block_size,
            list(cfg.target_layer_ids),
            num_pages * page_size,
        )

    # ------------------------------------------------------------------ after each step

    @torch.inference_mode()
    def extend(self, items: list[tuple[str, int, torch.Tensor, list[int]]]) -> None:
        """items: (rid, first position p0, the target's captured streams [m, n * hidden] at p0..,
        the tokens after them). The context rows of positions p0 .. p0 + m - 1 are made when the
        request next drafts (`_flush`: one batched call for many steps' rows, and none at all for
        the steps of a request the policy does not draft for), or once PENDING_ROWS wait. Then the
        requests idle for IDLE_STEPS steps give theirs up instead (`keeps`: no more are kept for
        them until a block is asked for them, which starts their rows afresh): where blocks are
        priced out, storing every request's rows would cost every step for drafts never made."""
        for rid, p0, hidden, _ in items:
            if rid in self.dormant:
                continue
            self.idle[rid] = self.idle.get(rid, 0) + 1
            waiting = self.pending.setdefault(rid, [])
            # a request cut back (retracted, recomputed) replaces what it had pending from p0 on
            while waiting and waiting[-1][0] >= p0:
                self.pending_rows -= waiting.pop()[1].shape[0]
            if waiting and waiting[-1][0] + waiting[-1][1].shape[0] > p0:
                q0, h = waiting[-1]
                waiting[-1] = (q0, h[: p0 - q0])
                self.pending_rows -= h.shape[0] - (p0 - q0)
            waiting.append((p0, hidden))
            self.pending_rows += hidden.shape[0]
        if self.pending_rows > PENDING_ROWS:
            for rid in [r for r in self.pending if self.idle[r] >= IDLE_STEPS]:
                self._give_up(rid)
                self.dormant.add(rid)
        if self.pending_rows > PENDING_ROWS:
            self._flush(list(self.pending))

    def keeps(self, rid: str) -> bool:
        """Whether `extend` keeps this request's rows (not while it is dormant)."""
        return rid not in self.dormant

    def _give_up(self, rid: str) -> None:
        """The request's waiting and stored rows dropped (its pages freed)."""
        self.pending_rows -= sum(h.shape[0] for _, h in self.pending.pop(rid, []))
        self.rows.drop(rid)

    @torch.inference_mode()
    def _flush(self, rids: list[str]) -> None:
        """Store the pending context rows of these requests."""
        slots: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        features: list[torch.Tensor] = []
        for rid in rids:
            waiting = self.pending.pop(rid, [])
            self.pending_rows -= sum(h.shape[0] for _, h in waiting)
            for p0, hidden in waiting:
                self._place(rid, p0, hidden, slots, positions, features)
        if not features:
            return
        c = self.model.context(torch.cat(features).to(self.kv.dtype))
        self.model.store_context(
            c,
            torch.from_numpy(np.concatenate(positions)).to(self.device),
            self.kv,
            torch.from_numpy(np.concatenate(slots)).to(self.device),
        )

    def _place(
        self,
        rid: str,
        p0: int,
        hidden: torch.Tensor,
        slots: list[np.ndarray],
        positions: list[np.ndarray],
        features: list[torch.Tensor],
    ) -> None:
        """Rows for positions p0 .. p0 + m - 1 of a request: their slots, positions and streams
        appended to the lists (nothing where the pool is full: the request starts over after them)."""
        m = hidden.shape[0]
        seq = self.rows.seq_at(rid, p0)
        if not self.allocator.grow(seq.pages, seq.length + m):
            self.rows.restart(
                rid, p0 + m
            )  # the pool is full: it starts over after these
            return
        rows = np.arange(seq.length, seq.length + m)
        pages = np.asarray(seq.pages, dtype=np.int64)
        slots.append(
            pages[rows // self.page_size] * self.page_size + rows % self.page_size
        )
        positions.append(np.arange(p0, p0 + m))
        features.append(hidden)
        seq.length += m

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, wants: list[tuple[str, list[int], int]]) -> list[Proposal]:
        """wants: (rid, the target's sequence, most tokens to draft). Returns each one's block of
        drafts (cut to that many, and before the first whose confidence is under the threshold):
        none for a request whose context rows do not reach its last token, or where the pool is
        short of pages for the block."""
        asked = [rid for rid, _, k in wants if k > 0]
        for rid in asked:
            self.idle[rid] = 0
            self.dormant.discard(rid)  # its rows start afresh with the next step's
        self._flush(asked)
        out = [Proposal([], drafted=False) for _ in wants]
        live = []
        B = self.block_size
        for i, (rid, seq_ids, k) in enumerate(wants):
            seq = self.seqs.get(rid)
            # the context rows end just before the last token, which the target feeds next
            if (
                k > 0
                and seq is not None
                and seq.length > 0
                and seq.end == len(seq_ids) - 1
                and self.allocator.grow(seq.pages, seq.length + B)
            ):
                live.append((i, seq, seq_ids[-1]))
        if not live:
            return out
        n = len(live)
        page_table = np.zeros(
            (n, max(len(s.pages) for _, s, _ in live)), dtype=np.int64
        )
        for b, (_, s, _) in enumerate(live):
            page_table[b, : len(s.pages)] = s.pages
        # each block row: a decode whose position (row index) is the block's last, so that it sees
        # every context row and its whole block; its own K/V go to its own slot (out_slots)
        ends = [s.length + B for _, s, _ in live]
        meta = AttentionMetadata.build(
            [1] * (n * B),
            [e for e in ends for _ in range(B)],
            torch.from_numpy(np.repeat(page_table, B, axis=0)),
            self.page_size,
            n * B,
            self.device,
        )
        rows = np.concatenate([np.arange(s.length, s.length + B) for _, s, _ in live])
        owner = np.repeat(np.arange(n), B)
        slots = (
            page_table[owner, rows // self.page_size] * self.page_size
            + rows % self.page_size
        )
        meta = dataclasses.replace(
            meta, out_slots=torch.from_numpy(slots).to(self.device)
        )
        positions = torch.from_numpy(
            np.concatenate([np.arange(s.end, s.end + B) for _, s, _ in live])
        ).to(self.device)
        anchors = torch.tensor(
            [a for _, _, a in live], dtype=torch.int64, device=self.device
        )
        ids = torch.full(
            (n, B), self.mask_token_id, dtype=torch.int64, device=self.device
        )
        ids[:, 0] = anchors
        embeds = self.target.embed_tokens(ids.view(-1))
        hidden = self.model.block(embeds, positions, meta, self.kv)
        if self.model.head is not None:  # the draft vocabulary's rows of the head
            logits = self.model.head(hidden).float()
        else:
            logits = self.target.compute_logits(hidden)[:, : self.vocab_size]
        tokens, confidence = self.model.pick(
            logits.view(n, B, -1), hidden.view(n, B, -1), anchors
        )
        tokens_l = tokens.tolist()
        conf_l = None if confidence is None else confidence.tolist()
        for b, (i, _, _) in enumerate(live):
            k = min(wants[i][2], B)
            if conf_l is None:
                out[i] = Proposal(tokens_l[b][:k])
                continue
            conf = conf_l[b][:k]
            cut = next((j for j, p in enumerate(conf) if p < self.threshold), len(conf))
            out[i] = Proposal(tokens_l[b][:cut], conf[:cut])
        return out

    # ------------------------------------------------------------------ pages

    def finish(self, rid: str) -> None:
        self._give_up(rid)
        self.idle.pop(rid, None)
        self.dormant.discard(rid)


def load_dspark(
    model_dir: Path,
    target: DecoderForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str,
) -> DSparkDraft:
    """The drafter of `model_dir` for `target`, in the target's dtype and weight quantization."""
    from strata.layers.quant import QUANT_METHODS, quantize_model
    from strata.weights.loader import iter_safetensors

    where = f"--speculative-draft-model {model_dir.name}"
    cfg, layers_cfg = read_dspark_dir(model_dir)
    if not isinstance(target, DecoderForCausalLM):
        raise ValueError(
            f"{where}: DSpark drafting reads the target's residual stream, which "
            f"{type(target).__name__} does not expose"
        )
    tc = target.config
    last = tc.num_layers - 1
    if cfg.target_layer_ids[-1] >= last:
        raise ValueError(
            f"{where}: target_layer_ids {list(cfg.target_layer_ids)} reach the target's last layer "
            f"({last}); DeepSpec's drafters read layers before it"
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != tc.num_layers:
        raise ValueError(
            f"{where}: trained on a target of {cfg.num_target_layers} layers; this one has "
            f"{tc.num_layers}"
        )
    if (layers_cfg.hidden_size, layers_cfg.vocab_size) != (
        tc.hidden_size,
        tc.vocab_size,
    ):
        raise ValueError(
            f"{where}: hidden size {layers_cfg.hidden_size} and vocabulary {layers_cfg.vocab_size}; "
            f"the target's are {tc.hidden_size} and {tc.vocab_size}"
        )
    if not 0 <= cfg.mask_token_id < tc.vocab_size:
        raise ValueError(
            f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
            f"({tc.vocab_size})"
        )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = DSparkDraft(cfg, layers_cfg, max_positions, device)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        model.load_weights(
            ((n, t.to(dtype)) for n, t in iter_safetensors(model_dir)), where
        )
        vocab_path = model_dir / DRAFT_VOCAB_FILE
        if vocab_path.is_file():
            ids = draft_vocab(vocab_path, tc.vocab_size, where)
            model.restrict_vocab(
                ids.to(device), output_rows(target, ids).to(device, dtype)
            )
    if quantization in QUANT_METHODS:
        quantize_model(model.decoder, quantization)
        # the context rows' key and value projections, as the layers' own
        quantized = QUANT_METHODS[quantization]
        model.context_kv = nn.ModuleList(
            quantized.from_weight(m.weight, m.bias)
            for m in cast(list[nn.Linear], list(model.context_kv))
        )
    if device.type == "cpu":
        from strata.layers.packed import pack_linears

        pack_linears(model)
    return model.eval()


def draft_vocab(path: Path, vocab_size: int, where: str) -> torch.Tensor:
    """The draft vocabulary's token ids (distinct, inside the target's vocabulary)."""
    import json

    try:
        ids = [int(i) for i in json.loads(path.read_text())["ids"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f'{where}: {path.name} must be {{"ids": [token ids]}} ({exc})'
        ) from exc
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if not ids or bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"{where}: {path.name} must list distinct token ids below {vocab_size}"
            + (f" (got {bad[:4]})" if bad else "")
        )
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def output_rows(target: DecoderForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target output head's rows for `ids` as float32 (dequantized where the head is not)."""
    head = target.lm_head
    if head is None:  # tied: the embedding's rows
        return target.embed_tokens(ids).float()
    weight = getattr(head, "weight", None)
    if (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and weight.is_floating_point()
    ):
        return weight[ids].float()
    dtype = target.embed_tokens(ids[:1]).dtype
    eye = torch.eye(target.config.hidden_size, dtype=dtype)
    return head(eye).float().t()[ids].contiguous()
