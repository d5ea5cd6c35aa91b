"""`GrammarCompiler`: turns `GrammarSpec`s into per-request grammar states, compiling each distinct
grammar once.

One compiler per tokenizer (the engine's scheduler holds one; the HTTP frontend holds one to
validate). `validate` raises `GrammarError` (a ValueError: its message is what a client sees in a
400) for a schema, regex or grammar llguidance cannot compile, including ones past its size
limits. `new_state` compiles (or finds in the LRU cache, keyed by the llguidance grammar text) a
template matcher and hands the request a deep copy, so compiling a schema costs once, and a
request never shares mutable matcher state with another. The cache key is the grammar as the
client wrote it (kind + source text), so a hit costs a dict lookup and the copy.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from strata.grammar.spec import GrammarSpec
from strata.grammar.state import GrammarState

DEFAULT_CACHE_SIZE = 512  # distinct grammars kept compiled


class GrammarError(ValueError):
    """A grammar that cannot be used; the message names the problem."""


@dataclass
class CompileStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # spent compiling misses


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ):
        """tokenizer: a transformers fast tokenizer; vocab_size: the model's (the mask width: ids
        the tokenizer lacks are never allowed); eos_token_ids: what ends a completed grammar."""
        import llguidance.hf

        if tokenizer is None:
            raise GrammarError(
                "this model has no tokenizer, so structured output cannot be used"
            )
        eos = sorted(eos_token_ids) or None
        try:
            self.ll_tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=max(vocab_size, len(tokenizer)), eos_token=eos
            )
        except ValueError as exc:
            raise GrammarError(
                f"structured output needs a fast (Rust) tokenizer: {exc}"
            ) from None
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._templates: OrderedDict[tuple[str, str], Any] = (
            OrderedDict()
        )  # (kind, source) -> LLMatcher, LRU order
        self._lock = threading.Lock()  # the frontend validates from worker threads
        self.stats = CompileStats()

    def _template(self, spec: GrammarSpec) -> Any:
        """The compiled matcher for `spec` (cached); raises GrammarError if it does not compile."""
        from llguidance import LLMatcher

        key = (spec.kind, spec.source)
        with self._lock:
            matcher = self._templates.get(key)
            if matcher is not None:
                self._templates.move_to_end(key)
                self.stats.hits += 1
                return matcher
        start = time.perf_counter()
        try:
            spec.validate_shape()
            text = spec.grammar_text()
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        matcher = LLMatcher(self.ll_tokenizer, text, log_level=0)
        elapsed = time.perf_counter() - start
        if matcher.is_error():
            raise GrammarError(
                f"invalid {_NAMES[spec.kind]}: {_first_lines(matcher.get_error())}"
            )
        with self._lock:
            self.stats.misses += 1
            self.stats.compile_seconds += elapsed
            self._templates[key] = matcher
            while len(self._templates) > self.cache_size:
                self._templates.popitem(last=False)
        return matcher

    def validate(self, spec: GrammarSpec) -> None:
        """Raise GrammarError (naming the problem) unless `spec` compiles."""
        self._template(spec)

    def new_state(self, spec: GrammarSpec) -> GrammarState:
        """A fresh per-request state for `spec`; raises GrammarError if it does not compile."""
        return GrammarState(
            self._template(spec).deep_copy(),
            spec.start_after,
            self.ll_tokenizer.vocab_size,
        )

    def clear(self) -> None:
        with self._lock:
            self._templates.clear()


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "lark": "grammar",
}


def _first_lines(message: str, limit: int = 600) -> str:
    """llguidance's errors can end in a dump of parser state; keep the part a user can act on."""
    message = message.split("\n<state>", 1)[0].strip()
    return message if len(message) <= limit else message[:limit] + "…"
