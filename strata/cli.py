"""`strata generate | chat | serve | router | batch | bench | plan | spec` — one argparse tree."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from strata.config import add_engine_args, engine_config_from_args
from strata.sampling_params import SamplingParams


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=256)
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default)"
    )
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable)"
    )


def _sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=list(args.stop),
    )
    params.validate()
    return params


def _make_engine(args: argparse.Namespace):
    from strata.engine.engine import Engine

    cfg = engine_config_from_args(args)
    return Engine(**dataclasses.asdict(cfg))


def cmd_generate(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _sampling_from_args(args)
    prompt = args.prompt
    if (
        not args.raw
        and engine.tokenizer is not None
        and getattr(engine.tokenizer, "chat_template", None)
    ):
        prompt = engine.chat_ids([{"role": "user", "content": args.prompt}])
    last = None
    for out in engine.stream(prompt, params):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    if last is not None and last.error:
        print(f"error: {last.error}", file=sys.stderr)
        return 1
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _make_engine(args)
    params = _sampling_from_args(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "Chat with the model. Empty line or Ctrl-D to quit; /reset forgets the conversation.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = engine.chat_ids(messages)
            reply = []
            for out in engine.stream(ids, params):
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
                reply.append(out.text_delta)
        except ValueError as exc:  # e.g. the conversation outgrew the context
            print(f"\nerror: {exc}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="LLM inference engine")
    parser.add_argument(
        "--log-level", default=os.environ.get("STRATA_LOG_LEVEL", "INFO")
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one answer to the terminal")
    gen.add_argument("prompt")
    gen.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is, without the chat template",
    )
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    from strata.bench.cli import add_bench_args

    add_bench_args(sub)
    from strata.plan.cli import add_plan_args

    add_plan_args(sub)
    from strata.drafting.cli import add_spec_args

    add_spec_args(sub)

    try:
        from strata.server.launch import add_serve_args, serve_main
    except ImportError:
        pass
    else:
        serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
        add_serve_args(serve)
        serve.set_defaults(func=serve_main)
    from strata.router.cli import add_router_args, router_main

    router = sub.add_parser(
        "router", help="cache-aware gateway over data-parallel `strata serve` replicas"
    )
    add_router_args(router)
    router.set_defaults(func=router_main)
    from strata.offline_batch import add_batch_args

    add_batch_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
