"""`strata spec train` — flags, and the glue to run and report (`strata.drafting.train`).

Wired into the main CLI with one line in strata/cli.py's build_parser:
    from strata.drafting.cli import add_spec_args; add_spec_args(sub)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from strata.drafting.config import TrainConfig


def add_spec_args(sub) -> None:
    from strata.config import add_engine_args

    spec = sub.add_parser("spec", help="speculative decoding: train a drafter")
    spec_sub = spec.add_subparsers(dest="spec_command", required=True)
    p = spec_sub.add_parser(
        "train",
        help="train a DSpark drafter for the target (--model) on its own answers, on this machine",
        description="Train a DSpark drafter for the target on its own greedy answers to prompts "
        "made here (none downloaded, none of the bench's). Resumes from --output after a kill. "
        "Serve it with --speculative-algorithm dspark --speculative-draft-model OUTPUT.",
    )
    d = TrainConfig(output="")
    p.add_argument(
        "--output",
        required=True,
        help="directory of the drafter (and of a run to resume)",
    )
    g = p.add_argument_group("drafter")
    g.add_argument("--draft-layers", type=int, default=d.draft_layers)
    g.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens drafted per block"
    )
    g.add_argument(
        "--target-layers",
        type=int,
        nargs="+",
        default=None,
        help="the target's layers whose streams the drafter reads (-1: embeddings; default: four spread "
        "from the second to the one before the last)",
    )
    g.add_argument(
        "--markov-rank", type=int, default=d.markov_rank, help="0: no Markov head"
    )
    g.add_argument(
        "--markov-head", choices=("vanilla", "gated", "rnn"), default=d.markov_head
    )
    g.add_argument("--no-confidence-head", action="store_true")
    g.add_argument("--mask-token-id", type=int, default=None)
    g.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help="the served drafter drafts from the answers' most frequent tokens, this many (0: every token)",
    )
    g = p.add_argument_group("data")
    g.add_argument("--chat-prompts", type=int, default=d.chat_prompts)
    g.add_argument("--grounded-prompts", type=int, default=d.grounded_prompts)
    g.add_argument("--passage-tokens", type=int, default=d.passage_tokens)
    g.add_argument(
        "--answer-len", type=int, default=d.answer_len, help="most tokens per answer"
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--anchors", type=int, default=d.anchors, help="blocks per sequence per step"
    )
    g.add_argument("--batch", type=int, default=d.batch, help="sequences per step")
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument(
        "--steps", type=int, default=None, help="default: as many as fit --time-budget"
    )
    g.add_argument(
        "--time-budget",
        type=float,
        default=d.time_budget_min,
        help="minutes for every phase",
    )
    g.add_argument(
        "--checkpoint-every", type=float, default=d.checkpoint_every_s, help="seconds"
    )
    g.add_argument(
        "--eval-prompts",
        type=int,
        default=d.eval_prompts,
        help="held-out prompts per workload (0: none)",
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="the drafter's matmuls in training (auto: bf16 autocast where the CPU has bf16 units)",
    )
    add_engine_args(p)
    p.set_defaults(func=spec_train_main)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    checks = {
        "draft_layers": 1,
        "block_size": 1,
        "anchors": 1,
        "batch": 1,
        "answer_len": 2,
        "passage_tokens": 1,
    }
    for name, low in checks.items():
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {low}")
    if (
        args.chat_prompts < 0
        or args.grounded_prompts < 0
        or args.chat_prompts + args.grounded_prompts < 2
    ):
        raise ValueError(
            "--chat-prompts and --grounded-prompts: at least two prompts in all"
        )
    if args.draft_vocab < 0:
        raise ValueError("--draft-vocab must be 0 (every token) or more")
    if args.markov_rank < 0:
        raise ValueError("--markov-rank must be 0 (none) or more")
    if not args.lr > 0 or not args.time_budget > 0:
        raise ValueError("--lr and --time-budget must be positive")
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be at least 1")
    return TrainConfig(
        output=args.output,
        draft_layers=args.draft_layers,
        block_size=args.block_size,
        target_layers=tuple(args.target_layers) if args.target_layers else None,
        markov_rank=args.markov_rank,
        markov_head=args.markov_head,
        confidence_head=not args.no_confidence_head,
        mask_token_id=args.mask_token_id,
        draft_vocab=args.draft_vocab,
        chat_prompts=args.chat_prompts,
        grounded_prompts=args.grounded_prompts,
        passage_tokens=args.passage_tokens,
        answer_len=args.answer_len,
        anchors=args.anchors,
        batch=args.batch,
        lr=args.lr,
        steps=args.steps,
        time_budget_min=args.time_budget,
        checkpoint_every_s=args.checkpoint_every,
        eval_prompts=args.eval_prompts,
        seed=args.seed,
        bf16={"auto": None, "bf16": True, "fp32": False}[args.precision],
    )


def spec_train_main(args: argparse.Namespace) -> int:
    from strata.config import engine_config_from_args
    from strata.drafting.train import Trainer

    cfg = config_from_args(args)
    engine = dataclasses.asdict(engine_config_from_args(args))
    if engine.get("speculative_algorithm", "none") != "none":
        raise ValueError(
            "spec train builds its own engines; leave --speculative-algorithm out"
        )
    record = Trainer(cfg, engine, progress=print).run()
    print(
        json.dumps(
            {k: record[k] for k in ("steps", "validation", "held_out", "budget_s")},
            indent=2,
        )
    )
    return 0
