"""What the simulator serves: conversations (the bench datasets, or a trace file) and when they arrive.

Content comes from `strata.bench.datasets.make_dataset`, the same builders `strata bench serving`
uses, run over `SyntheticTokenizer` (token i is the word "t<i>", so every length is exact and no
model is needed) or over a real tokenizer; prefixes are shared exactly where the dataset shares
them (shared-prefix system prompts, multi-turn histories). Each turn's answer is a run of fresh
synthetic ids, so turn k + 1's prompt = turn k's prompt + its answer + the next user message, as
`turn_prompt_ids` builds it for the engine.

Arrivals (of conversations; later turns follow their previous answer, as in the benchmark):

    poisson   exponential gaps of mean 1 / rate (rate inf: all at t = 0)
    burst     groups of `burst_size` at the same instant, groups Poisson at rate / burst_size
    trace     a JSONL file, one request a line: {"t": seconds, "input_len": n, "output_len": m,
              optional "prefix_id": key, "prefix_len": tokens shared by every line with that key,
              optional "conversation": key — lines with one key are turns of one conversation,
              sent one after another as answers end (only the first line's "t" counts)}

`max_concurrency` caps the requests in flight (closed loop, as `--max-concurrency`). `think_time_s`
(mean of an exponential pause between an answer and the next turn; 0, the benchmark's behaviour,
sends it at once) keeps a conversation's KV idle between turns, as a person typing does.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from strata.bench.datasets import Conversation, DatasetConfig, Turn, make_dataset

ARRIVALS = ("poisson", "burst", "trace")
ANSWER_ID_BASE = (
    1 << 40
)  # synthetic answer ids, above any vocabulary: they never collide with prompt ids


class SyntheticTokenizer:
    """A tokenizer of words "t<id>": decode(ids) joins them, encode splits on whitespace (any other
    word maps to a stable id), so make_dataset gets exactly the lengths it asks for."""

    all_special_ids: ClassVar[list[int]] = []
    added_tokens_decoder: ClassVar[dict] = {}
    chat_template = None

    def __init__(self, vocab_size: int = 32000):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids) -> str:
        return " ".join(f"t{int(i)}" for i in ids)

    def batch_decode(self, batch) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for word in text.split():
            if (
                word[0] == "t"
                and word[1:].isdigit()
                and int(word[1:]) < self.vocab_size
            ):
                out.append(int(word[1:]))
            else:
                out.append(sum(map(ord, word)) * 2654435761 % self.vocab_size)
        return out


@dataclass
class SimTurn:
    """One request: its prompt ids (with the conversation's history), and the answer it gets."""

    conversation: int
    turn: int
    prompt: tuple[int, ...]
    answer: tuple[int, ...]

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def output_len(self) -> int:
        return len(self.answer)


@dataclass
class Workload:
    """Conversations (lists of turns, sent one after another) and each one's arrival time."""

    conversations: list[list[SimTurn]]
    arrivals: list[float]
    max_concurrency: int | None = None
    think_time_s: float = (
        0.0  # mean pause before a conversation's next turn (exponential)
    )

    @property
    def num_requests(self) -> int:
        return sum(len(c) for c in self.conversations)


def answer_ids(conversation: int, turn: int, length: int) -> tuple[int, ...]:
    base = ANSWER_ID_BASE + ((conversation << 12) + turn) * (1 << 20)
    return tuple(range(base, base + length))


def turns_of(conversations: list[Conversation]) -> list[list[SimTurn]]:
    """The requests of each conversation, with histories carried as turn_prompt_ids builds them
    (the separator between an answer and the next message is whitespace, so it has no tokens here)."""
    out = []
    for ci, conv in enumerate(conversations):
        turns: list[SimTurn] = []
        prev_prompt: tuple[int, ...] = ()
        prev_answer: tuple[int, ...] = ()
        for k, t in enumerate(conv.turns):
            if k == 0:
                prompt = tuple(conv.system.ids if conv.system else ()) + tuple(t.ids)
            else:
                prompt = prev_prompt + prev_answer + tuple(t.ids)
            answer = answer_ids(ci, k, max(1, t.output_len))
            turns.append(SimTurn(ci, k, prompt, answer))
            prev_prompt, prev_answer = prompt, answer
        out.append(turns)
    return out


def poisson_arrivals(
    n: int, rate: float, seed: int, burst_size: int = 1
) -> list[float]:
    """n arrival times: Poisson at `rate` per second (inf: all at 0); with burst_size > 1, groups of
    that many at once, the groups Poisson at rate / burst_size."""
    if math.isinf(rate):
        return [0.0] * n
    groups = math.ceil(n / burst_size)
    gaps = np.random.default_rng(seed).exponential(
        burst_size / rate, size=max(groups - 1, 0)
    )
    starts = [0.0] + np.cumsum(gaps).tolist()
    return [starts[i // burst_size] for i in range(n)]


def dataset_workload(
    cfg: DatasetConfig,
    rate: float = math.inf,
    arrival: str = "poisson",
    burst_size: int = 1,
    max_concurrency: int | None = None,
    tokenizer=None,
    think_time_s: float = 0.0,
) -> Workload:
    """A bench dataset as simulator input (synthetic tokens unless a real tokenizer is given)."""
    if arrival not in ("poisson", "burst"):
        raise ValueError(
            f"dataset arrivals are poisson or burst; for a trace use trace_workload, got {arrival!r}"
        )
    convs = make_dataset(cfg, tokenizer or SyntheticTokenizer())
    size = burst_size if arrival == "burst" else 1
    arrivals = poisson_arrivals(len(convs), rate, cfg.seed, size)
    return Workload(turns_of(convs), arrivals, max_concurrency, think_time_s)


def trace_workload(
    path: str | Path, max_concurrency: int | None = None, seed: int = 0
) -> Workload:
    """A trace file (see the module docstring): arrival times and lengths as recorded."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file {p} does not exist")
    rng = random.Random(seed)
    prefixes: dict[str, tuple[int, ...]] = {}
    convs: dict[str, int] = {}
    raw: list[tuple[float, list[Turn], Turn | None]] = []
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            t, n_in, n_out = float(e["t"]), int(e["input_len"]), int(e["output_len"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f'{p}:{lineno}: expected {{"t": seconds, "input_len": n, "output_len": m}} ({exc})'
            ) from None
        if n_in < 1 or n_out < 1 or t < 0:
            raise ValueError(
                f"{p}:{lineno}: input_len and output_len must be >= 1 and t >= 0"
            )
        prefix: tuple[int, ...] = ()
        if "prefix_id" in e:
            key, plen = str(e["prefix_id"]), min(int(e.get("prefix_len", 0)), n_in - 1)
            if key not in prefixes or len(prefixes[key]) < plen:
                prefixes[key] = tuple(rng.randrange(32000) for _ in range(plen))
            prefix = prefixes[key][:plen]
        body = tuple(rng.randrange(32000) for _ in range(n_in - len(prefix)))
        turn = Turn("", body, n_out)
        key = e.get("conversation")
        if key is not None and str(key) in convs:
            idx = convs[str(key)]
            raw[idx][1].append(turn)
            continue
        if key is not None:
            convs[str(key)] = len(raw)
        raw.append((t, [turn], Turn("", prefix, 0) if prefix else None))
    if not raw:
        raise ValueError(f"{p} holds no request")
    order = sorted(range(len(raw)), key=lambda i: raw[i][0])
    convs_out = [Conversation(tuple(raw[i][1]), raw[i][2]) for i in order]
    return Workload(turns_of(convs_out), [raw[i][0] for i in order], max_concurrency)
