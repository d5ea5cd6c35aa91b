"""Reasoning parsers: split a reasoning model's output into `reasoning_content` and `content`.

A parser is a factory of per-choice splitters, picked by `--reasoning-parser` from `REASONING_PARSERS`.
Both kinds here use `<think>...</think>`:

- `qwen3`: the model opens the block itself; text before it, or with no block at all, is content;
- `deepseek_r1`: the output starts inside the block (the template opened it; a `<think>` the model
  writes anyway is dropped), and everything up to `</think>` is reasoning.

Either starts inside the block when the prompt itself ends with an open `<think>`, and as content
when the prompt ends with a closed block (a template that switched thinking off). The splitter is
incremental and chunk-invariant: feeding the text in any pieces yields the same reasoning and content
(a tail that may be the start of a tag is held back until the next piece decides it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start_tag: str = "<think>"
    end_tag: str = "</think>"
    starts_inside: bool = (
        False  # the output begins in reasoning even without a start tag
    )

    def splitter(self, prompt_text_tail: str = "") -> ReasoningSplitter:
        """A splitter for one choice; `prompt_text_tail` is the end of the prompt as text."""
        tail = prompt_text_tail.rstrip()
        splitter = ReasoningSplitter(self, inside=tail.endswith(self.start_tag))
        if tail.endswith(
            self.end_tag
        ):  # the template closed the block (thinking switched off)
            splitter.state = "after"
        return splitter

    def prompt_closes_reasoning(self, prompt_text_tail: str) -> bool:
        """True when the prompt already ends the reasoning block, so the output starts as content."""
        return prompt_text_tail.rstrip().endswith(self.end_tag)


class ReasoningSplitter:
    def __init__(self, parser: ReasoningParser, inside: bool):
        self.p = parser
        # start (a start tag may come) -> inside -> after_trim (newlines after the end tag) -> after
        self.state = "inside" if inside else "start"
        self.pending = ""  # text not classified yet

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) decided by this piece of text."""
        self.pending += text
        reasoning = content = ""
        if self.state == "start":
            stripped = self.pending.lstrip()
            if stripped.startswith(self.p.start_tag):
                self.state, self.pending = "inside", stripped[len(self.p.start_tag) :]
            elif self.p.start_tag.startswith(stripped):
                return "", ""  # may still become the start tag
            else:
                self.state = "inside" if self.p.starts_inside else "after"
        if self.state == "inside":
            idx = self.pending.find(self.p.end_tag)
            if idx < 0:
                keep = _partial_suffix(self.pending, self.p.end_tag)
                cut = len(self.pending) - keep
                reasoning, self.pending = self.pending[:cut], self.pending[cut:]
                return reasoning, ""
            reasoning = self.pending[:idx]
            self.pending = self.pending[idx + len(self.p.end_tag) :].lstrip("\n")
            self.state = "after_trim" if not self.pending else "after"
        if (
            self.state == "after_trim"
        ):  # drop the newlines right after </think>, across pieces
            self.pending = self.pending.lstrip("\n")
            if not self.pending:
                return reasoning, ""
            self.state = "after"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back at the end of the output."""
        rest, self.pending = self.pending, ""
        if self.state == "inside":
            return rest, ""
        if self.state == "start" and self.p.starts_inside:
            return rest, ""
        return "", rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
}
