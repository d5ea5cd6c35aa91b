"""`strata batch INPUT.jsonl -o OUTPUT.jsonl`: an OpenAI batch input file run offline.

It starts a `strata serve` of its own on a loopback port (with the engine flags given, so the
model, dtype and cache options are the same as a server's), or uses `--base-url`, and sends up to
`--concurrency` lines at once, each exactly as a client would (strata.server.batch_jobs), with a
progress bar. Every answer, successful or not, is appended to OUTPUT as it comes (OpenAI's output
line: custom_id, response.status_code, response.body), so an interrupted run keeps what it has:
`--resume` runs only the lines OUTPUT has no answer for. At the end OUTPUT is rewritten in input
order. The exit status is 0 once every line has an answer (however many of them are errors, which
the summary counts), 1 if the server failed before that, 2 for a bad input file or flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from strata.bench.server_process import ServerProcess, serve_argv
from strata.config import add_engine_args
from strata.router.launcher import engine_flags
from strata.server.batch_jobs import (
    BatchInputError,
    InputLine,
    error_text,
    parse_input,
    run_line,
    succeeded,
)


def add_batch_args(sub) -> None:
    p = sub.add_parser(
        "batch",
        help="run an OpenAI batch input file (JSONL) offline and write the answers",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "input",
        help="JSONL, one {custom_id, method, url, body} a line (OpenAI's batch input)",
    )
    p.add_argument("-o", "--output", required=True, help="where the answers go (JSONL)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="lines in flight at once (default: 16)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the answers OUTPUT already holds and run only the other lines",
    )
    p.add_argument(
        "--base-url",
        default=None,
        help="send the lines to this running server instead of starting one",
    )
    p.add_argument(
        "--api-key", default=None, help="the key --base-url's server wants, if any"
    )
    p.add_argument(
        "--no-progress", action="store_true", help="no progress bar (logs, CI)"
    )
    add_engine_args(p)
    p.set_defaults(func=batch_main)


def read_done(output: Path, lines: list[InputLine]) -> dict[str, dict[str, Any]]:
    """The answers an earlier run left in `output`, by custom_id (lines of this input only)."""
    ids = {line.custom_id for line in lines}
    done: dict[str, dict[str, Any]] = {}
    for number, raw in enumerate(output.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:  # a line cut short by the interruption
            if number == len(output.read_text().splitlines()):
                continue
            raise ValueError(
                f"{output}, line {number}: not JSON; it is not an earlier run's output"
            ) from None
        if isinstance(record, dict) and record.get("custom_id") in ids:
            done[record["custom_id"]] = record
    return done


async def run_batch(
    base_url: str,
    lines: list[InputLine],
    output: Path,
    done: dict[str, dict[str, Any]],
    concurrency: int,
    headers: dict[str, str],
    progress: bool,
) -> dict[str, dict[str, Any]]:
    """Run the lines not in `done`, appending each answer to `output`; all answers by custom_id."""
    from tqdm import tqdm

    todo = deque(line for line in lines if line.custom_id not in done)
    answers = dict(done)
    bar = tqdm(
        total=len(lines),
        initial=len(done),
        unit="req",
        disable=not progress,
        file=sys.stderr,
    )
    limits = httpx.Limits(max_connections=concurrency)
    with output.open("a", encoding="utf-8") as sink:
        async with httpx.AsyncClient(
            base_url=base_url, headers=headers, limits=limits
        ) as client:

            async def worker() -> None:
                while todo:
                    line = todo.popleft()
                    record = await run_line(client, line, priority=0)
                    sink.write(json.dumps(record, ensure_ascii=False) + "\n")
                    sink.flush()
                    answers[line.custom_id] = record
                    bar.update(1)

            tasks = [
                asyncio.ensure_future(worker())
                for _ in range(min(concurrency, len(todo)))
            ]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                bar.close()
    return answers


def batch_main(args: argparse.Namespace) -> int:
    source, output = Path(args.input), Path(args.output)
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    try:
        lines = parse_input(source.read_bytes())
    except BatchInputError as exc:
        for error in exc.errors:
            print(f"{source}: {error_text(error)}", file=sys.stderr)
        return 2
    if output.exists() and not args.resume:
        raise ValueError(
            f"{output} exists; pass --resume to keep its answers, or choose another --output"
        )
    done = read_done(output, lines) if output.exists() else {}
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = None
    if args.base_url is None:
        flags, env = engine_flags(args)

        print("strata batch: starting the server ...", file=sys.stderr)
        server = ServerProcess(
            lambda port: serve_argv(port, *flags), "strata", env=env
        ).start()
    base_url = server.base_url if server is not None else args.base_url
    try:
        answers = asyncio.run(
            run_batch(
                base_url,
                lines,
                output,
                done,
                args.concurrency,
                headers,
                not args.no_progress,
            )
        )
    except httpx.HTTPError as exc:
        print(
            f"strata batch: the server stopped answering ({type(exc).__name__}: {exc}); "
            f"{output} keeps the answers so far: rerun with --resume",
            file=sys.stderr,
        )
        return 1
    finally:
        if server is not None:
            server.stop()
    ordered = [answers[line.custom_id] for line in lines]
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(
        "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered),
        encoding="utf-8",
    )
    tmp.replace(output)
    failed = sum(not succeeded(r) for r in ordered)
    print(
        f"strata batch: {len(ordered)} lines answered ({len(ordered) - failed} succeeded, "
        f"{failed} failed; {len(done)} kept from before) -> {output}",
        file=sys.stderr,
    )
    return 0
