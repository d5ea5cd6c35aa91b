"""Benchmark workloads, made locally (nothing is downloaded) and deterministic for a seed.

Every dataset is a list of `Conversation`s; a single-turn request is a one-turn conversation, so
one driver serves all of them. Text is made of real tokens: random ids from the tokenizer's
vocabulary (special tokens excluded) are decoded, and the text is re-encoded and adjusted until
it is exactly the wanted number of tokens for that tokenizer (`token_text`), so a server that
tokenizes the text sees (nearly) the lengths asked for, and the engine path sees them exactly.

    random         num_prompts prompts of input_len tokens (uniform in [input_len*range_ratio,
                   input_len]), output_len likewise
    shared-prefix  num_groups groups x prompts_per_group prompts: one system prompt of system_len
                   tokens per group + a question of question_len tokens (the radix-cache workload);
                   shuffled with the seed, so groups interleave
    multi-turn     num_prompts conversations of num_turns turns; each turn adds input_len user
                   tokens, and its request carries every previous turn and answer
    file           a user's JSONL (or JSON array): {"prompt": str, "output_len": int},
                   ShareGPT {"conversations": [{"from": "human", "value": ...}, ...]}, or
                   {"messages": [{"role": "user", "content": ...}, ...]}
"""

from __future__ import annotations

import json
import random
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "shared-prefix", "multi-turn", "file")
TURN_SEPARATOR = (
    "\n"  # between an answer and the next user turn (completions endpoint and engine)
)


@dataclass(frozen=True)
class Turn:
    """One user message: its text, its token ids (no special tokens), and the answer length wanted."""

    text: str
    ids: tuple[int, ...]
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """An optional system prompt and one or more user turns, answered one after another."""

    turns: tuple[Turn, ...]
    system: Turn | None = None

    @property
    def first_prompt_len(self) -> int:
        return len(self.system.ids if self.system else ()) + len(self.turns[0].ids)


@dataclass(frozen=True)
class DatasetConfig:
    """Which workload and its shape. `num_prompts` counts conversations for multi-turn and is
    ignored by shared-prefix (num_groups x prompts_per_group)."""

    name: str = "random"
    num_prompts: int = 50
    seed: int = 0
    input_len: int = 256  # prompt tokens (random, file when truncating); user tokens per turn (multi-turn)
    output_len: int = 64
    range_ratio: float = 1.0  # lengths uniform in [len * range_ratio, len]; 1.0 = fixed
    num_groups: int = 4  # shared-prefix
    prompts_per_group: int = 8
    system_len: int = 512
    question_len: int = 64
    num_turns: int = 3  # multi-turn
    path: str | None = None  # file
    file_output_len: int | None = None  # file: override every answer length
    file_multi_turn: bool = (
        False  # file: keep every user turn of a conversation (else the first)
    )

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.name!r}")
        if not 0 < self.range_ratio <= 1:
            raise ValueError(f"range_ratio must be in (0, 1], got {self.range_ratio}")
        for name in (
            "num_prompts",
            "input_len",
            "output_len",
            "num_groups",
            "prompts_per_group",
            "num_turns",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_len < 0 or self.question_len < 1:
            raise ValueError("system_len must be >= 0 and question_len >= 1")
        if self.name == "file" and not self.path:
            raise ValueError(
                "the file dataset needs a path: pass --dataset-path FILE.jsonl"
            )


def make_dataset(config: DatasetConfig, tokenizer) -> list[Conversation]:
    """Build the workload `config` describes with `tokenizer` (a Hugging Face tokenizer)."""
    if tokenizer is None:
        raise ValueError(
            "benchmark datasets need a tokenizer; pass a model directory that ships one"
        )
    return _BUILDERS[config.name](config, tokenizer, random.Random(config.seed))


# ----------------------------------------------------------------- text of an exact token length


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its pool


def vocab_pool(tokenizer) -> list[int]:
    """Token ids usable in random text: the vocabulary minus special tokens and minus tokens that
    are not text on their own (byte fragments of a UTF-8 character decode to U+FFFD)."""
    key = tokenizer
    if key not in _POOLS:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        ids = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in ids])
        pool = [i for i, t in zip(ids, texts) if t and "\ufffd" not in t]
        if not pool:
            raise ValueError(
                "the tokenizer has no plain-text tokens to make random prompts from"
            )
        _POOLS[key] = pool
    return _POOLS[key]


def token_text(tokenizer, rng: random.Random, num_tokens: int, pool: list[int]) -> Turn:
    """Random text that encodes to `num_tokens` tokens (re-encoding merges some; we re-adjust)."""
    ids = [rng.choice(pool) for _ in range(num_tokens)]
    for _ in range(6):
        text = tokenizer.decode(ids)
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) == num_tokens:
            return Turn(text, tuple(got), 0)
        ids = (
            got[:num_tokens]
            if len(got) > num_tokens
            else got + [rng.choice(pool) for _ in range(num_tokens - len(got))]
        )
    text = tokenizer.decode(ids)
    return Turn(text, tuple(tokenizer.encode(text, add_special_tokens=False)), 0)


def _length(rng: random.Random, full: int, ratio: float) -> int:
    return rng.randint(max(1, int(full * ratio)), full)


def _with_output(turn: Turn, output_len: int) -> Turn:
    return Turn(turn.text, turn.ids, output_len)


# ----------------------------------------------------------------- generators


def _random(cfg: DatasetConfig, tokenizer, rng: random.Random) -> list[Conversation]:
    pool = vocab_pool(tokenizer)
    out = []
    for _ in range(cfg.num_prompts):
        turn = token_text(
            tokenizer, rng, _length(rng, cfg.input_len, cfg.range_ratio), pool
        )
        out.append(
            Conversation(
                (_with_output(turn, _length(rng, cfg.output_len, cfg.range_ratio)),)
            )
        )
    return out


def _shared_prefix(
    cfg: DatasetConfig, tokenizer, rng: random.Random
) -> list[Conversation]:
    pool = vocab_pool(tokenizer)
    sep = "\n\n"
    out = []
    for _ in range(cfg.num_groups):
        system = None
        if cfg.system_len > 0:
            body = token_text(tokenizer, rng, cfg.system_len, pool)
            # end the system prompt on a separator so the question's tokens cannot merge into it
            text = body.text + sep
            system = Turn(
                text, tuple(tokenizer.encode(text, add_special_tokens=False)), 0
            )
        for _ in range(cfg.prompts_per_group):
            q = token_text(
                tokenizer, rng, _length(rng, cfg.question_len, cfg.range_ratio), pool
            )
            out.append(
                Conversation(
                    (_with_output(q, _length(rng, cfg.output_len, cfg.range_ratio)),),
                    system,
                )
            )
    rng.shuffle(out)
    return out


def _multi_turn(
    cfg: DatasetConfig, tokenizer, rng: random.Random
) -> list[Conversation]:
    pool = vocab_pool(tokenizer)
    out = []
    for _ in range(cfg.num_prompts):
        turns = tuple(
            _with_output(
                token_text(
                    tokenizer, rng, _length(rng, cfg.input_len, cfg.range_ratio), pool
                ),
                _length(rng, cfg.output_len, cfg.range_ratio),
            )
            for _ in range(cfg.num_turns)
        )
        out.append(Conversation(turns))
    return out


_USER_ROLES = {"human", "user"}
_ASSISTANT_ROLES = {"gpt", "assistant", "bot", "chatgpt", "model"}


def _file(cfg: DatasetConfig, tokenizer, rng: random.Random) -> list[Conversation]:
    entries = read_entries(Path(cfg.path))  # type: ignore[arg-type]
    rng.shuffle(entries)

    def encode(s: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(s, add_special_tokens=False))

    out: list[Conversation] = []
    for lineno, entry in entries:
        conv = _conversation_from_entry(entry, cfg, encode, f"{cfg.path}:{lineno}")
        if conv is not None:
            out.append(conv)
        if len(out) == cfg.num_prompts:
            break
    if not out:
        raise ValueError(
            f"{cfg.path} holds no usable prompt (expected 'prompt', 'conversations' or 'messages' entries)"
        )
    return out


def read_entries(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each entry of a JSONL file or a JSON array."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    text = path.read_text()
    if text.lstrip().startswith("["):
        return [(i + 1, e) for i, e in enumerate(json.loads(text))]
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entries.append((lineno, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{path}:{lineno} is not valid JSON ({exc.msg}); expected one JSON object per line"
            ) from None
    return entries


def _conversation_from_entry(
    entry: Any, cfg: DatasetConfig, encode, where: str
) -> Conversation | None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    if "prompt" in entry:
        ids = encode(str(entry["prompt"]))
        out_len = cfg.file_output_len or int(entry.get("output_len") or cfg.output_len)
        return (
            Conversation((Turn(str(entry["prompt"]), ids, out_len),)) if ids else None
        )
    raw = entry.get("conversations") or entry.get("messages")
    if not isinstance(raw, list):
        raise ValueError(
            f"{where}: expected a 'prompt', 'conversations' (ShareGPT) or 'messages' field"
        )
    system: Turn | None = None
    turns: list[Turn] = []
    pending: str | None = None
    for msg in raw:
        role = str(msg.get("from", msg.get("role", ""))).lower()
        value = str(msg.get("value", msg.get("content", "")))
        if role == "system" and not turns and pending is None:
            system = Turn(value + "\n\n", encode(value + "\n\n"), 0)
        elif role in _USER_ROLES:
            pending = value
        elif role in _ASSISTANT_ROLES and pending is not None:
            out_len = cfg.file_output_len or max(1, len(encode(value)))
            turns.append(Turn(pending, encode(pending), out_len))
            pending = None
            if not cfg.file_multi_turn:
                break
    if pending is not None and (cfg.file_multi_turn or not turns):
        turns.append(
            Turn(pending, encode(pending), cfg.file_output_len or cfg.output_len)
        )
    turns = [t for t in turns if t.ids]
    return Conversation(tuple(turns), system) if turns else None


_BUILDERS = {
    "random": _random,
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "file": _file,
}


# ----------------------------------------------------------------- prompts as token ids (engine path)


def turn_prompt_ids(
    conv: Conversation,
    turn: int,
    previous_prompt: list[int] | None,
    previous_answer: list[int] | None,
    tokenizer,
) -> list[int]:
    """Token ids of turn `turn`'s prompt, for engines fed ids directly (offline, one-batch, transformers).

    turn 0: system ids + the user's ids; turn k: the previous prompt + its answer + separator + ids.
    """
    if turn == 0:
        return list(conv.system.ids if conv.system else ()) + list(conv.turns[0].ids)
    assert previous_prompt is not None and previous_answer is not None
    sep = tokenizer.encode(TURN_SEPARATOR, add_special_tokens=False)
    return previous_prompt + previous_answer + sep + list(conv.turns[turn].ids)


def num_requests(conversations: list[Conversation]) -> int:
    return sum(len(c.turns) for c in conversations)
