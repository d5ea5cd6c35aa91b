"""`strata bench parallel`: what splitting a replica over ranks does here.

    eplb       a tiny mixture-of-experts model whose router favours a few experts (built in a temp
               dir from a transformers config, or --model), expert parallel over --ep-size ranks with
               --ep-num-redundant-experts spare slots: rows each rank computed per MoE layer (max /
               mean over ranks) on one workload with the initial placement, then, after one EPLB
               rebalance from the measured load, on the same workload again; greedy tokens of both
               runs compared (a placement never changes an answer)
    draft-eplb the same with a mixture-of-experts draft model split over the ranks beside the target
               (--speculative-algorithm draft): for each --speculative-draft-ep-num-redundant-experts
               count, the draft's rows per rank and one batched draft forward's time, before and
               after one rebalance (median of rounds; answers compared with speculation off)
    step-time  decode and prefill step time of one model at --tp-size 1 and N, same run, same
               weights (float: GGUF blocks are not split), median of rounds

Both drive the offline engine (rank 0 in this process, the other ranks its children).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from strata.sampling_params import SamplingParams


@dataclass(frozen=True)
class EPLBBenchConfig:
    model: str | None = None  # None: the skewed tiny model below
    ep_size: int = 2
    num_redundant: int = 2
    num_experts: int = 8
    top_k: int = 2
    # the experts the router favours (2 and 3: on rank 0 before rebalancing, and not among the experts
    # the initial placement's redundant slots copy)
    hot_experts: tuple[int, ...] = (2, 3)
    skew: float = 2.0  # how strongly (router rows aligned with a direction every hidden state shares)
    num_prompts: int = 16
    prompt_len: int = 64
    output_len: int = 16
    seed: int = 0
    hidden_size: int = 64  # of the tiny model
    intermediate_size: int = 128


def make_skewed_moe(out_dir: Path, cfg: EPLBBenchConfig) -> Path:
    """A tiny random Mixtral whose router sends most tokens to `hot_experts`: every embedding row
    shares a direction u, the sublayers' output projections are scaled down so that the residual
    stream keeps it, and the hot experts' router rows get `skew` * u added."""
    import torch
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k,
        max_position_embeddings=1024,
        sliding_window=None,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        initializer_range=0.25,
    )
    torch.manual_seed(cfg.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(cfg.seed)
    u = torch.randn(config.hidden_size, generator=gen)
    u = u / u.norm()
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.add_(u * embed.norm(dim=1, keepdim=True).mean())
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.experts.down_proj.mul_(
                0.2
            )  # transformers' stacked experts [E, H, I]
            router = layer.mlp.gate.weight  # [E, H]
            router[list(cfg.hot_experts)] += cfg.skew * u * router.norm(dim=1).mean()
    model.save_pretrained(out_dir)
    return out_dir


def _workload(cfg: EPLBBenchConfig, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(
        3, vocab, (cfg.num_prompts, cfg.prompt_len), generator=gen
    ).tolist()


def _summary(rank_load: dict[int, list[int]]) -> dict:
    from strata.distributed.eplb import imbalance

    layers = {
        i: {"rows_per_rank": rows, "max_over_mean": imbalance(rows)}
        for i, rows in rank_load.items()
    }
    worst = (
        max((v["max_over_mean"] or 0.0) for v in layers.values()) if layers else None
    )
    return {"layers": layers, "worst_max_over_mean": worst}


def run_eplb(cfg: EPLBBenchConfig, engine_options: dict | None = None) -> dict:
    from strata import Engine

    with tempfile.TemporaryDirectory(prefix="strata-eplb-") as tmp:
        model = cfg.model or str(make_skewed_moe(Path(tmp) / "skewed-mixtral", cfg))
        options = {
            "dtype": "float32",
            "kv_cache_tokens": 8192,
            **(engine_options or {}),
        }
        engine = Engine(
            model,
            ep_size=cfg.ep_size,
            ep_num_redundant_experts=cfg.num_redundant,
            **options,
        )
        try:
            runtime = engine.parallel
            params = SamplingParams(
                temperature=0, max_new_tokens=cfg.output_len, ignore_eos=True
            )
            prompts = _workload(cfg, engine.state.model_config.vocab_size)
            runtime.reset_rank_load()
            before_tokens = [r.token_ids for r in engine.generate(prompts, params)]
            before = _summary(runtime.rank_load())
            start = time.perf_counter()
            placements = runtime.rebalance()
            rebalance_s = time.perf_counter() - start
            runtime.reset_rank_load()
            engine.flush_cache()  # the same prefill work again, not radix hits
            after_tokens = [r.token_ids for r in engine.generate(prompts, params)]
            after = _summary(runtime.rank_load())
        finally:
            engine.close()
    return {
        "config": cfg.__dict__,
        "before": before,
        "after": after,
        "placements": {i: list(p) for i, p in placements.items()},
        "rebalance_seconds": rebalance_s,
        "same_tokens": before_tokens == after_tokens,
    }


def format_eplb(result: dict) -> str:
    cfg = result["config"]
    lines = [
        (
            f"EPLB: {cfg['num_experts']} experts top-{cfg['top_k']} over {cfg['ep_size']} ranks, "
            f"{cfg['num_redundant']} redundant slots; {cfg['num_prompts']} prompts x {cfg['prompt_len']} tokens "
            f"+ {cfg['output_len']} generated"
        ),
        f"{'layer':>5}  {'rows per rank before':>24}  {'max/mean':>8}  {'rows per rank after':>24}  {'max/mean':>8}  placement after",
    ]
    for i, b in result["before"]["layers"].items():
        a = result["after"]["layers"][i]
        lines.append(
            f"{i:>5}  {b['rows_per_rank']!s:>24}  {b['max_over_mean']:8.3f}  {a['rows_per_rank']!s:>24}  "
            f"{a['max_over_mean']:8.3f}  {result['placements'].get(i)}"
        )
    lines.append(
        f"worst layer max/mean: {result['before']['worst_max_over_mean']:.3f} -> "
        f"{result['after']['worst_max_over_mean']:.3f}; rebalance took {result['rebalance_seconds'] * 1000:.0f} ms; "
        f"greedy tokens identical: {result['same_tokens']}"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- a split draft model


@dataclass(frozen=True)
class DraftEPLBConfig:
    eplb: EPLBBenchConfig = EPLBBenchConfig()  # the target (and the tiny models' shape)
    draft_model: str | None = None  # None: a second skewed tiny Mixtral (another seed)
    redundant: tuple[int, ...] = (0, 2)  # the draft's redundant slots, one engine each
    draft_tokens: int = (
        4  # drafted per request per step (fixed length: drafting always runs)
    )
    rounds: int = 5  # timed batched drafts per measure


def _draft_forward_seconds(
    drafter, prompts: list[list[int]], cfg: DraftEPLBConfig
) -> float:
    """Median seconds of one batched draft forward (every prompt a decode row): each round drafts
    `draft_tokens` after the prompts' last token, from the KV the first call wrote."""
    wants = [(f"draft-bench-{i}", p, cfg.draft_tokens) for i, p in enumerate(prompts)]
    drafter.draft(wants)  # the prompts into the draft's KV
    times = []
    for _ in range(cfg.rounds):
        start = time.perf_counter()
        drafter.draft(wants)
        times.append((time.perf_counter() - start) / cfg.draft_tokens)
    for rid, _, _ in wants:
        drafter.finish(rid)
    return statistics.median(times)


def run_draft_eplb(cfg: DraftEPLBConfig, engine_options: dict | None = None) -> dict:
    from strata import Engine

    e = cfg.eplb
    rows = []
    with tempfile.TemporaryDirectory(prefix="strata-draft-eplb-") as tmp:
        model = e.model or str(make_skewed_moe(Path(tmp) / "target", e))
        draft = cfg.draft_model or str(
            make_skewed_moe(
                Path(tmp) / "draft", dataclasses.replace(e, seed=e.seed + 1)
            )
        )
        options = {
            "dtype": "float32",
            "kv_cache_tokens": 8192,
            **(engine_options or {}),
        }
        params = SamplingParams(
            temperature=0, max_new_tokens=e.output_len, ignore_eos=True
        )
        plain = Engine(model, **options)
        try:
            prompts = _workload(e, plain.state.model_config.vocab_size)
            want = [r.token_ids for r in plain.generate(prompts, params)]
        finally:
            plain.close()
        for redundant in cfg.redundant:
            engine = Engine(
                model,
                ep_size=e.ep_size,
                ep_num_redundant_experts=e.num_redundant,
                speculative_algorithm="draft",
                speculative_draft_model=draft,
                speculative_draft_ep_num_redundant_experts=redundant,
                speculative_num_draft_tokens=cfg.draft_tokens,
                speculative_fixed_length=True,
                **options,
            )
            try:
                runtime, drafter = engine.parallel, engine.scheduler.spec.draft_model
                runtime.reset_rank_load()
                outs = engine.generate(prompts, params)
                before = _summary(runtime.rank_load(runtime.draft))
                step_before = _draft_forward_seconds(drafter, prompts, cfg)
                runtime.rebalance()
                runtime.reset_rank_load()
                engine.flush_cache()
                outs += engine.generate(prompts, params)
                after = _summary(runtime.rank_load(runtime.draft))
                step_after = _draft_forward_seconds(drafter, prompts, cfg)
                placements = runtime.draft_placements()
                stats = engine.scheduler.spec.stats
                engine.scheduler.check_no_leaks()
            finally:
                engine.close()
            rows.append(
                {
                    "redundant": redundant,
                    "before": before,
                    "after": after,
                    "draft_forward_s_before": step_before,
                    "draft_forward_s_after": step_after,
                    "placements": {i: list(p) for i, p in placements.items()},
                    "drafted": stats.drafted_tokens,
                    "accepted": stats.accepted_tokens,
                    "same_tokens": [o.token_ids for o in outs] == want + want,
                }
            )
    return {
        "config": {
            **cfg.eplb.__dict__,
            "draft_tokens": cfg.draft_tokens,
            "rounds": cfg.rounds,
        },
        "rows": rows,
    }


def format_draft_eplb(result: dict) -> str:
    c = result["config"]
    lines = [
        (
            f"split draft: {c['num_experts']} experts top-{c['top_k']} over {c['ep_size']} ranks (hidden "
            f"{c['hidden_size']}, expert intermediate {c['intermediate_size']}); "
            f"{c['num_prompts']} prompts x {c['prompt_len']} tokens, {c['draft_tokens']} drafts per step"
        ),
        (
            f"{'redundant':>9}  {'draft max/mean before':>21}  {'after':>6}  "
            f"{'draft forward ms before':>23}  {'after':>6}  {'accepted/drafted':>16}  same tokens"
        ),
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['redundant']:>9}  {r['before']['worst_max_over_mean']:21.3f}  "
            f"{r['after']['worst_max_over_mean']:6.3f}  {r['draft_forward_s_before'] * 1e3:23.2f}  "
            f"{r['draft_forward_s_after'] * 1e3:6.2f}  {r['accepted']:>7}/{r['drafted']:<8}  {r['same_tokens']}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- step time


@dataclass(frozen=True)
class StepTimeConfig:
    model: str | None = None
    tp_sizes: tuple[int, ...] = (1, 2)
    batch_sizes: tuple[int, ...] = (1, 8)
    prompt_len: int = 128
    decode_steps: int = 16
    rounds: int = 3
    engine_options: dict = field(default_factory=dict)


def _time_steps(engine, batch: int, cfg: StepTimeConfig) -> tuple[float, float]:
    """(prefill step seconds for `batch` prompts, median decode step seconds at that batch)."""
    import torch

    gen = torch.Generator().manual_seed(batch)
    vocab = engine.state.model_config.vocab_size
    params = SamplingParams(
        temperature=0, max_new_tokens=cfg.decode_steps + 1, ignore_eos=True
    )
    for _ in range(batch):
        engine.add_request(
            torch.randint(3, vocab, (cfg.prompt_len,), generator=gen).tolist(), params
        )
    start = time.perf_counter()
    engine.step()  # every prompt in one prefill step (chunk and token budgets allow it)
    prefill = time.perf_counter() - start
    decode = []
    while engine.has_requests():
        start = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - start)
    engine.flush_cache()  # the next round prefills again
    return prefill, statistics.median(decode)


def run_step_time(cfg: StepTimeConfig) -> list[dict]:
    import torch

    from strata import Engine

    rows = []
    for tp in cfg.tp_sizes:
        options = {
            "quantization": "none",
            "kv_cache_tokens": 8192,
            **cfg.engine_options,
        }
        engine = Engine(cfg.model, tp_size=tp, **options)
        try:
            _time_steps(engine, max(cfg.batch_sizes), cfg)  # warm-up
            for batch in cfg.batch_sizes:
                runs = [_time_steps(engine, batch, cfg) for _ in range(cfg.rounds)]
                rows.append(
                    {
                        "tp_size": tp,
                        "batch": batch,
                        "prompt_len": cfg.prompt_len,
                        "prefill_ms": 1000 * statistics.median(r[0] for r in runs),
                        "decode_step_ms": 1000 * statistics.median(r[1] for r in runs),
                        "model": engine.state.model_dir.name,
                        "dtype": str(engine.state.dtype).removeprefix("torch."),
                        "threads_per_rank": torch.get_num_threads(),
                    }
                )
        finally:
            engine.close()
    return rows


def format_step_time(rows: list[dict]) -> str:
    base = {(r["batch"]): r for r in rows if r["tp_size"] == 1}
    lines = [
        f"{'tp':>3} {'threads':>7} {'batch':>5} {'prefill ms':>11} {'decode step ms':>15} {'decode vs tp=1':>15}"
    ]
    for r in rows:
        ratio = (
            r["decode_step_ms"] / base[r["batch"]]["decode_step_ms"]
            if r["batch"] in base
            else float("nan")
        )
        lines.append(
            f"{r['tp_size']:>3} {r['threads_per_rank']:>7} {r['batch']:>5} {r['prefill_ms']:>11.1f} "
            f"{r['decode_step_ms']:>15.2f} {ratio:>14.2f}x"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- CLI


def _eplb_args(e) -> None:
    """The target's and the tiny models' flags of `eplb` and `draft-eplb`."""
    d = EPLBBenchConfig()
    e.add_argument(
        "--model",
        default=None,
        help="a MoE model directory (default: a skewed tiny Mixtral)",
    )
    e.add_argument("--ep-size", type=int, default=d.ep_size)
    e.add_argument("--ep-num-redundant-experts", type=int, default=d.num_redundant)
    e.add_argument(
        "--num-experts", type=int, default=d.num_experts, help="of the tiny model"
    )
    e.add_argument("--top-k", type=int, default=d.top_k, help="of the tiny model")
    e.add_argument(
        "--skew",
        type=float,
        default=d.skew,
        help="how strongly the tiny model's router favours its --hot-experts",
    )
    e.add_argument(
        "--hot-experts",
        type=int,
        nargs="+",
        default=list(d.hot_experts),
        help="the experts the tiny model's router favours",
    )
    e.add_argument(
        "--hidden-size", type=int, default=d.hidden_size, help="of the tiny model"
    )
    e.add_argument(
        "--intermediate-size",
        type=int,
        default=d.intermediate_size,
        help="of the tiny model's experts",
    )
    e.add_argument("--num-prompts", type=int, default=d.num_prompts)
    e.add_argument("--prompt-len", type=int, default=d.prompt_len)
    e.add_argument("--output-len", type=int, default=d.output_len)


def _eplb_config(args) -> EPLBBenchConfig:
    return EPLBBenchConfig(
        model=args.model,
        ep_size=args.ep_size,
        num_redundant=args.ep_num_redundant_experts,
        num_experts=args.num_experts,
        top_k=args.top_k,
        skew=args.skew,
        hot_experts=tuple(args.hot_experts),
        num_prompts=args.num_prompts,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
    )


def add_args(parser) -> None:
    """`strata bench parallel eplb | draft-eplb | step-time` and their flags."""
    sub = parser.add_subparsers(dest="parallel_command", required=True)
    e = sub.add_parser(
        "eplb", help="per-rank expert load before/after one EPLB rebalance"
    )
    _eplb_args(e)
    e.add_argument("--output-json", default=None, metavar="FILE")
    r, dr = (
        sub.add_parser(
            "draft-eplb",
            help="a MoE draft model split over the ranks: its per-rank load and forward time "
            "with each count of redundant experts, before/after one rebalance",
        ),
        DraftEPLBConfig(),
    )
    _eplb_args(r)
    r.add_argument(
        "--draft-model",
        default=None,
        help="a MoE draft directory (default: a second skewed tiny Mixtral)",
    )
    r.add_argument(
        "--speculative-draft-ep-num-redundant-experts",
        type=int,
        nargs="+",
        default=list(dr.redundant),
        help="the draft's redundant expert slots: one engine per count",
    )
    r.add_argument("--draft-tokens", type=int, default=dr.draft_tokens)
    r.add_argument("--rounds", type=int, default=dr.rounds)
    r.add_argument("--output-json", default=None, metavar="FILE")
    s, t = (
        sub.add_parser("step-time", help="prefill and decode step time at --tp-sizes"),
        StepTimeConfig(),
    )
    s.add_argument(
        "--model", default=None, help="default: the default model (float weights)"
    )
    s.add_argument("--tp-sizes", type=int, nargs="+", default=list(t.tp_sizes))
    s.add_argument("--batch-sizes", type=int, nargs="+", default=list(t.batch_sizes))
    s.add_argument("--prompt-len", type=int, default=t.prompt_len)
    s.add_argument("--decode-steps", type=int, default=t.decode_steps)
    s.add_argument("--rounds", type=int, default=t.rounds)
    s.add_argument(
        "--dtype", default="float32", choices=["auto", "float32", "bfloat16"]
    )
    s.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads per rank (default: the cores split over the ranks)",
    )
    s.add_argument("--output-json", default=None, metavar="FILE")


def cmd(args) -> int:
    import json

    if args.parallel_command == "eplb":
        result = run_eplb(_eplb_config(args))
        print(format_eplb(result))
    elif args.parallel_command == "draft-eplb":
        result = run_draft_eplb(
            DraftEPLBConfig(
                eplb=_eplb_config(args),
                draft_model=args.draft_model,
                redundant=tuple(args.speculative_draft_ep_num_redundant_experts),
                draft_tokens=args.draft_tokens,
                rounds=args.rounds,
            )
        )
        print(format_draft_eplb(result))
    else:
        cfg = StepTimeConfig(
            model=args.model,
            tp_sizes=tuple(args.tp_sizes),
            batch_sizes=tuple(args.batch_sizes),
            prompt_len=args.prompt_len,
            decode_steps=args.decode_steps,
            rounds=args.rounds,
            engine_options={"dtype": args.dtype, "num_threads": args.num_threads},
        )
        result = run_step_time(cfg)
        print(format_step_time(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0
