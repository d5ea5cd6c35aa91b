"""Tokenizer loading, chat templates and incremental detokenization with stop strings.

The incremental detokenizer emits text only once it is final: a token sequence that ends in the
middle of a UTF-8 character is held back, and so is any tail of the text that could still become
a stop string, so a streamed answer never shows text that a later token retracts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase | None:
    """The directory's tokenizer, or None when it ships none (token-id prompts only)."""
    model_dir = Path(model_dir)
    if not any(
        (model_dir / name).exists()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of a conversation; `tools` (OpenAI tool dicts) are rendered as the template
    decides (a template that ignores them shows the model nothing)."""
    if tokenizer is None:
        raise ValueError(
            "this model has no tokenizer, so chat messages cannot be used; send token ids"
        )
    if not messages:
        raise ValueError("messages must be a non-empty list")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "this model's tokenizer has no chat template; use a plain prompt instead"
        )
    ids: Any = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,  # type: ignore[arg-type]  # JSON tool schemas
        add_generation_prompt=True,
        tokenize=True,
    )
    if hasattr(ids, "keys") and "input_ids" in ids:  # BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into final text, with stop-string detection."""

    CONTEXT_TOKENS = (
        4  # prompt tokens decoded with the output so the first word's spacing is right
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT_TOKENS :])
        # ids[prefix_offset:read_offset] were decoded already; text past read_offset is new
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # final output text so far (truncated at a stop string once one is found)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.sent_offset = 0  # chars of self.text already handed out by `take_delta`
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        assert isinstance(text, str)  # one sequence in, one string out
        return text

    def add(self, token_id: int) -> None:
        """Append one token; sets `matched_stop` (and truncates `text`) if a stop string completes."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            search_from = max(0, start - self.max_stop_len + 1)
            hits = [
                (i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0
            ]
            if hits:
                idx, stop = min(hits)
                self.text = self.text[:idx]
                self.matched_stop = stop

    def flush(self) -> None:
        """At the end of a request: decode whatever was held back as an incomplete character."""
        if self.read_offset < len(self.ids) and self.matched_stop is None:
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset :])
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet, minus a tail that may still grow into a stop string."""
        end = len(self.text)
        if not finished and self.stop:
            end -= self._stop_prefix_len()
        delta = self.text[self.sent_offset : end]
        self.sent_offset = max(self.sent_offset, end)
        return delta

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        text = self.text
        for n in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
