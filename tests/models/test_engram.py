"""Engram (DeepSeek-V4.1's conditional memory) exact against an oracle: transformers' DeepSeek-V4
with the Engram equations added by forward pre-hooks at the Engram layers, written here from the
description (per position, no batching, the hash in Python integers). fp32 logits within 1e-4 and
the same greedy tokens through batched prefills, chunks ending inside an n-gram, decodes, a radix
hit, retraction under a small pool, a prefill/decode pair, a prefix through the host and storage
tiers, and the three table placements.

The tiny checkpoint is tests/tiny_dsv4.py's V4 plus `add_engram`: Engram at layers 0 and 2, 2- and
3-grams, two hash heads, 97-row tables, a 384 -> 200 id map; every test runs it without and with
the demo's short convolution (3 taps, 2 apart), whose inputs depend on the hidden state and so
live in the request's paged state.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_disagg import pd_tokens
from test_hicache import GREEDY as TIER_GREEDY  # what run_one generates
from test_hicache import through_the_tiers
from test_parity import hf_greedy, hf_model
from tiny_dsv4 import CONV, ENGRAM, TINY, add_engram, make_dsv4, prompt

from strata import Engine, SamplingParams
from strata.engine.batch import ScheduleBatch
from strata.engine.request import Req
from strata.models import config_from_dir

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [prompt(40, 1), prompt(23, 2), prompt(2, 3)]

M64 = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, int]:
    state = (state + 0x9E3779B97F4A7C15) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def multipliers(seed: int, layer: int, order: int, head: int) -> list[int]:
    state = (seed << 32) ^ (layer << 16) ^ (order << 8) ^ head
    out = []
    for _ in range(order):
        state, z = splitmix64(state)
        out.append((z >> 33) | 1)
    return out


class EngramOracle:
    """The Engram equations, one position at a time, added to transformers' V4 at the Engram layers.
    It keeps the sequence it has seen by position, so `generate()` (one new token per call) works."""

    def __init__(self, model_dir, ref):
        from safetensors.torch import load_file

        cfg = json.loads((model_dir / "config.json").read_text())
        self.w = load_file(model_dir / "engram.safetensors")
        self.orders, self.heads = cfg["engram_orders"], cfg["engram_heads"]
        self.size, self.seed = cfg["engram_table_size"], cfg["engram_hash_seed"]
        self.vmap = self.w.get("model.engram_vocab_map")
        self.pad = cfg.get("engram_vocab_map") or cfg["vocab_size"]
        self.eps, self.H = cfg["rms_norm_eps"], cfg["hidden_size"]
        self.kernel = cfg.get("engram_conv_kernel") or 0
        self.dilation = cfg.get("engram_conv_dilation") or max(self.orders)
        self.x: dict[int, dict[int, torch.Tensor]] = {
            layer: {} for layer in cfg["engram_layers"]
        }  # the convolution's normalised inputs by layer and position
        self.seq: list[int] = []
        self.handles = []
        for layer in cfg["engram_layers"]:
            hook = self._hook(layer)
            self.handles.append(
                ref.model.layers[layer].register_forward_pre_hook(
                    hook, with_kwargs=True
                )
            )

    def remove(self):
        for h in self.handles:
            h.remove()

    def compressed(self, t: int) -> int:
        if t < 0:
            return self.pad
        tok = self.seq[t]
        return int(self.vmap[tok]) if self.vmap is not None else tok

    def rms(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean() + self.eps))

    def delta(self, layer: int, t: int, streams: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.engram."
        table = self.w[p + "embedding"]
        rows = []
        for o, n in enumerate(self.orders):
            for j in range(self.heads):
                mix = 0
                for i, a in enumerate(multipliers(self.seed, layer, n, j)):
                    mix ^= self.compressed(t - i) * a
                rows.append(table[o * self.heads + j, mix % self.size])
        e = torch.cat(rows)
        k = self.w[p + "key_proj.weight"] @ e
        v = self.w[p + "value_proj.weight"] @ e
        kn = self.rms(k, self.w[p + "key_norm.weight"])
        out = streams.clone()
        values = []
        for s in range(streams.shape[0]):
            hn = self.rms(streams[s], self.w[p + "hidden_norm.weight"])
            gate = torch.sigmoid((hn * kn).sum() / math.sqrt(self.H))
            values.append(gate * v)
            out[s] = streams[s] + gate * v
        if self.kernel:
            # x[t] = a norm per stream of the gated value; y = SiLU(causal depthwise taps over x)
            x = torch.cat(
                [
                    self.rms(val, self.w[p + f"short_conv.norms.{s}.weight"])
                    for s, val in enumerate(values)
                ]
            )
            self.x[layer][t] = x
            w = self.w[p + "short_conv.conv.weight"][:, 0, :]  # [streams * H, K]
            y = torch.zeros_like(x)
            for i in range(self.kernel):
                back = t - (self.kernel - 1 - i) * self.dilation
                if back >= 0:
                    y += w[:, i] * self.x[layer][back]
            out += torch.nn.functional.silu(y).view_as(out)
        return out

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            hidden = args[0]  # [1, S, hc_mult, H]
            positions = kwargs["position_ids"][0].tolist()
            ids = kwargs["input_ids"][0].tolist()
            if layer == min(self.layer_ids):
                del self.seq[positions[0] :]
                self.seq.extend(ids)
            out = hidden.clone()
            for row, t in enumerate(positions):
                out[0, row] = self.delta(layer, t, hidden[0, row])
            return (out, *args[1:]), kwargs

        return hook

    @property
    def layer_ids(self) -> list[int]:
        return list(ENGRAM["engram_layers"])


@pytest.fixture(scope="module", params=["plain", "conv"])
def model_dir(tmp_path_factory, request):
    """The tiny V4.1, without and with the short convolution (whose state is paged)."""
    conv = CONV if request.param == "conv" else {}
    return add_engram(make_dsv4(tmp_path_factory.mktemp("engram")), **conv)


@pytest.fixture(scope="module")
def ref(model_dir):
    model = hf_model(model_dir)
    EngramOracle(model_dir, model)
    return model


@pytest.fixture(scope="module")
def expected(ref):
    return [hf_greedy(ref, p, GREEDY.max_new_tokens) for p in PROMPTS]


def engine(model_dir, **options) -> Engine:
    return Engine(
        str(model_dir), **{"dtype": "float32", "kv_cache_tokens": 1024, **options}
    )


@torch.no_grad()
def ref_logits(ref, seq: list[int]) -> torch.Tensor:
    return ref(torch.tensor([seq])).logits[0]


def engine_logits(
    eng: Engine, reqs: list[Req], extend_lens: list[int], num_decode: int
) -> torch.Tensor:
    """One forward through the engine's runner (n-grams included): logits of every fed token."""
    runner = eng.scheduler.runner
    for req, n in zip(reqs, extend_lens):
        assert eng.scheduler._alloc_for(req, req.kv_len + n)
    fb = runner.prepare(ScheduleBatch(reqs, extend_lens, num_decode))
    assert fb.ngrams is not None
    with torch.inference_mode():
        hidden = eng.model(fb.input_ids, fb.positions, fb.attn, runner.kv, fb.ngrams)
        logits = eng.model.compute_logits(hidden)
    for req, n in zip(reqs, extend_lens):
        req.kv_len += n
    return logits


def test_config_reads_engram(model_dir):
    cfg = config_from_dir(model_dir).dsv4.engram
    assert cfg.layers == (0, 2) and cfg.orders == (2, 3) and cfg.heads == 2
    assert (cfg.table_size, cfg.dim, cfg.hash_seed) == (97, 8, 7)
    assert cfg.vocab_map_size == 200 and cfg.pad_id == 200
    assert cfg.num_tables == 4 and cfg.context_len == 2
    if (
        cfg.conv_kernel
    ):  # 3 taps 2 apart: positions t - 4 .. t, a window group of its own
        assert (cfg.conv_kernel, cfg.conv_dilation, cfg.conv_span) == (3, 2, 5)
        assert cfg.state_width == TINY["hc_mult"] * TINY["hidden_size"]
        v4 = config_from_dir(model_dir).dsv4
        assert v4.state_windows["conv"] == 5
    else:
        assert cfg.conv_span == 0


def test_the_convolution_state_is_paged_with_the_request(model_dir):
    """With the convolution the pool keeps a window group of each Engram layer's inputs, and a
    page read out carries them (what PD and the tiers move)."""
    eng = engine(model_dir)
    kv = eng.scheduler.runner.kv
    cfg = config_from_dir(model_dir).dsv4.engram
    if not cfg.conv_kernel:
        assert "conv" not in kv.group_of and all(c is None for c in kv.conv)
        return
    assert [layer for layer, c in enumerate(kv.conv) if c is not None] == [0, 2]
    assert kv.conv[0].shape[1] == cfg.state_width
    assert kv.windows[kv.group_of["conv"] - 1] == cfg.conv_span
    # the group holds nothing else (its window differs from the others'): two layers' rows per token
    per_page = kv.bytes_by_group()[kv.group_of["conv"]]
    assert per_page == kv.page_size * 2 * cfg.state_width * kv.conv[0].element_size()


def test_config_refuses_a_bad_convolution():
    from strata.engram_config import engram_from_hf

    base = {"engram_layers": [0], "engram_table_size": 5, "engram_dim": 2}
    base.update(vocab_size=9, hidden_size=4, hc_mult=2)
    with pytest.raises(ValueError, match="engram_conv_kernel must be >= 0"):
        engram_from_hf({**base, "engram_conv_kernel": -1}, 4)
    with pytest.raises(ValueError, match="engram_conv_dilation >= 1"):
        engram_from_hf({**base, "engram_conv_kernel": 2, "engram_conv_dilation": 0}, 4)


def test_config_refuses_a_layer_out_of_range(tmp_path):
    from strata.engram_config import engram_from_hf

    with pytest.raises(
        ValueError, match="engram_layers must be distinct layer indices below 4"
    ):
        engram_from_hf(
            {
                "engram_layers": [4],
                "engram_table_size": 5,
                "engram_dim": 2,
                "vocab_size": 9,
            },
            4,
        )
    assert engram_from_hf({"vocab_size": 9}, 4) is None


def test_the_oracle_changes_the_logits(model_dir, ref):
    """Engram is not a no-op here: without the hooks, transformers' logits differ."""
    plain = hf_model(model_dir)
    seq = PROMPTS[0]
    assert (ref_logits(plain, seq) - ref_logits(ref, seq)).abs().max() > 1e-2


def test_batched_prefill_and_decode_logits_match(model_dir, ref):
    """Three prompts in one prefill (one shorter than an n-gram), then batched decodes."""
    eng = engine(model_dir, page_size=16)
    reqs = [
        Req(rid=str(i), prompt_ids=list(p), params=SamplingParams())
        for i, p in enumerate(PROMPTS)
    ]
    logits = engine_logits(eng, reqs, [len(p) for p in PROMPTS], num_decode=0)
    start = 0
    for p in PROMPTS:
        torch.testing.assert_close(
            logits[start : start + len(p)], ref_logits(ref, p), atol=1e-4, rtol=0
        )
        start += len(p)
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    last = logits[ends]
    seqs = [list(p) for p in PROMPTS]
    for _ in range(3):
        for req, s, t in zip(reqs, seqs, last.argmax(-1).tolist()):
            req.output_ids.append(t)
            s.append(t)
        last = engine_logits(eng, reqs, [1] * len(reqs), num_decode=len(reqs))
        want = torch.stack([ref_logits(ref, s)[-1] for s in seqs])
        torch.testing.assert_close(last, want, atol=1e-4, rtol=0)


def test_chunks_ending_inside_ngrams_match(model_dir, ref):
    """Chunks of 1, 2 and 5 tokens, each chunk's first n-grams reaching into the previous chunk,
    beside a decoding request."""
    eng = engine(model_dir, page_size=1)
    long, other = PROMPTS[0], PROMPTS[1]
    a = Req(rid="a", prompt_ids=list(long), params=SamplingParams())
    b = Req(rid="b", prompt_ids=list(other), params=SamplingParams())
    engine_logits(eng, [b], [len(other)], num_decode=0)
    full = ref_logits(ref, long)
    done = 0
    for n in (1, 2, 1, 5, 31):
        b.output_ids.append(7 + n)
        logits = engine_logits(eng, [b, a], [1, n], num_decode=1)
        torch.testing.assert_close(logits[1:], full[done : done + n], atol=1e-4, rtol=0)
        torch.testing.assert_close(
            logits[0], ref_logits(ref, other + b.output_ids)[-1], atol=1e-4, rtol=0
        )
        done += n
    assert done == len(long)


def test_greedy_tokens_equal_the_oracle_with_small_chunks(model_dir, expected):
    eng = engine(model_dir, page_size=4, chunked_prefill_size=3)
    assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == expected
    eng.scheduler.check_no_leaks()


def test_radix_hit_reads_the_history_from_the_prompt(model_dir, ref, expected):
    """A second prompt sharing the first 34 tokens hits the cache at a page boundary (32): its
    first fed n-grams read tokens the cache covered."""
    eng = engine(model_dir, page_size=16)
    assert eng.generate([PROMPTS[0]], GREEDY)[0].token_ids == expected[0]
    shared = PROMPTS[0][:34] + prompt(9, 9)
    again = eng.generate([shared], GREEDY)[0]
    assert again.cached_tokens == 32
    assert again.token_ids == hf_greedy(ref, shared, GREEDY.max_new_tokens)
    eng.scheduler.check_no_leaks()


def test_retraction_under_pressure_stays_exact(model_dir, ref):
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    prompts = [prompt(n, seed) for seed, n in zip(range(10, 13), (11, 25, 6))]
    eng = engine(model_dir, kv_cache_tokens=96, page_size=4, chunked_prefill_size=5)
    got = [r.token_ids for r in eng.generate(prompts * 2, params)]
    assert eng.scheduler.num_retractions > 0
    assert got == [hf_greedy(ref, p, params.max_new_tokens) for p in prompts] * 2
    eng.scheduler.check_no_leaks()


@pytest.mark.parametrize("placement", ["host", "mmap"])
def test_placements_give_the_same_tokens(model_dir, expected, placement):
    """Tables outside the model (a host pool, or mapped from the checkpoint), their rows gathered
    ahead on a thread: the tables are not parameters of the model, and the tokens are the same."""
    eng = engine(
        model_dir, page_size=4, chunked_prefill_size=7, engram_placement=placement
    )
    assert eng.model.engram_tables is not None
    assert not any("engram.embedding" in n for n, _ in eng.model.named_parameters())
    assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == expected
    eng.close()


def test_placements_are_the_flags_choices():
    from strata.config import ENGRAM_PLACEMENTS
    from strata.layers.engram_tables import TABLE_PLACEMENTS

    assert tuple(TABLE_PLACEMENTS) == ENGRAM_PLACEMENTS


@pytest.mark.parametrize("decode_ranks", [1, 2])
def test_prefill_decode_pair_equals_the_oracle(model_dir, expected, decode_ranks):
    """The decode side reads the n-gram history from the request's prompt and first token: nothing
    moves but the KV pages (the convolution's window among them); a decode side over two ranks
    (--ep-size 2) stores them on both."""
    kw = dict(
        dtype="float32",
        kv_cache_tokens=1024,
        page_size=4,
        disaggregation_secret="s3cret",
    )
    p = Engine(str(model_dir), disaggregation_mode="prefill", **kw)
    d = Engine(
        str(model_dir),
        disaggregation_mode="decode",
        engram_placement="mmap",
        ep_size=decode_ranks,
        **kw,
    )
    assert pd_tokens(p, d, PROMPTS, GREEDY, 3000) == expected
    d.scheduler.check_no_leaks()
    p.scheduler.check_no_leaks()
    p.close()
    d.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_prefix_through_the_host_and_storage_tiers_stays_exact(
    model_dir, ref, tmp_path, ranks
):
    """A prefix promoted from L2 or restored from L3 by a restarted engine: its continuation's
    n-grams read the prompt's ids, and the convolution's window comes back with the pages (the
    oracle: transformers with the Engram hooks); over two ranks (--ep-size 2) every rank stores
    the pages it gets back."""
    doc = prompt(120, 21)
    want = hf_greedy(ref, doc, TIER_GREEDY.max_new_tokens)
    through_the_tiers(model_dir, doc, want, str(tmp_path / "l3"), ep_size=ranks)


# ---------------------------------------------------------------------------- over two ranks


@pytest.mark.parametrize(
    "placement, redundant, eplb", [("memory", 0, 0), ("host", 2, 3), ("mmap", 0, 0)]
)
def test_two_ranks_split_the_tables_by_rows_and_give_the_oracle_tokens(
    model_dir, ref, expected, placement, redundant, eplb
):
    """--ep-size 2: each rank holds half of every table's rows (and half the experts' slots, with or
    without redundant ones, re-placed by EPLB every few steps) and sums its rows with the other's;
    the attention (and the convolution's window) is replicated. Chunked prefill, decode and a radix
    hit give the oracle's tokens."""
    eng = engine(
        model_dir,
        page_size=16,
        chunked_prefill_size=7,
        engram_placement=placement,
        ep_size=2,
        ep_num_redundant_experts=redundant,
        eplb_interval=eplb,
    )
    try:
        size = ENGRAM["engram_table_size"]
        rank0 = eng.model.layers[0].engram
        assert rank0.all_reduce is not None and rank0.row_start == 0
        if placement == "memory":
            assert rank0.embedding.shape[1] == size // 2  # rows 0 .. 47 of 97 here
        else:
            assert eng.model.engram_tables.rows == (0, size // 2)
            assert eng.model.engram_tables.tables[0].shape[1] == size // 2
        assert type(eng.model.layers[1].mlp.experts).__name__ == "EPExperts"
        assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == expected
        shared = PROMPTS[0][:34] + prompt(9, 9)
        again = eng.generate([shared], GREEDY)[0]
        assert again.cached_tokens == 32
        assert again.token_ids == hf_greedy(ref, shared, GREEDY.max_new_tokens)
        eng.scheduler.check_no_leaks()
        if eplb:
            assert eng.parallel.rebalances > 0
    finally:
        eng.close()


def test_deepseek_checkpoint_names_load_on_one_rank_and_two(
    model_dir, expected, tmp_path
):
    """DeepSeek's own names (`ffn.experts.E.w1/w3/w2`, `ffn.shared_experts.w1/w3/w2`, `attn.`) in
    place of transformers': the same tokens, and expert parallel slices the shared expert right."""
    import shutil

    from safetensors.torch import load_file, save_file

    renamed = tmp_path / "deepseek_names"
    shutil.copytree(model_dir, renamed)
    path = renamed / "model.safetensors"
    tensors, out = load_file(path), {}
    for name, t in tensors.items():
        new = name.removeprefix("model.").replace(".mlp.", ".ffn.")
        new = new.replace(".self_attn.", ".attn.")
        if ".ffn.experts.gate_up_proj" in new:  # [E, 2I, H], gate rows first
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                stem = new.replace("gate_up_proj", str(e))
                out[f"{stem}.w1.weight"], out[f"{stem}.w3.weight"] = (
                    t[e, :half],
                    t[e, half:],
                )
            continue
        if ".ffn.experts.down_proj" in new:
            for e in range(t.shape[0]):
                out[new.replace("down_proj", f"{e}.w2.weight")] = t[e]
            continue
        for ours, theirs in (
            ("gate_proj", "w1"),
            ("up_proj", "w3"),
            ("down_proj", "w2"),
        ):
            new = new.replace(f".shared_experts.{ours}.", f".shared_experts.{theirs}.")
        out[new] = t
    assert any(".ffn.experts.3.w3.weight" in n for n in out)
    path.unlink()
    save_file(out, path)
    for options in ({}, {"ep_size": 2}):
        eng = engine(renamed, page_size=4, **options)
        try:
            assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == expected
        finally:
            eng.close()


def test_tensor_parallel_is_refused_with_what_to_use(model_dir):
    with pytest.raises(ValueError, match="--ep-size N runs it over N ranks"):
        engine(model_dir, tp_size=2)
