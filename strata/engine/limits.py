"""A request's size limits, in one place with one error text each (torch-free).

A request of `prompt_len` tokens asking for up to `max_new` more must fit the model's context
(prompt_len + max_new <= context_len) and the KV pool: the last sampled token never needs KV, so
it needs prompt_len + max_new - 1 slots (pool_tokens). The HTTP frontend (server/protocol.py)
checks these before it sends a request and the scheduler checks them again (the offline API and
PD decode workers reach it directly); both call `SizeLimits.check`, so they cannot disagree.
An embedding input is only read, never extended: `SizeLimits.check_input` (the context alone; it
never touches the KV pool).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request (OpenAI's limit)
EMBED_BATCH_TOKENS = 2048  # tokens of one embedding forward; a longer input runs alone


def embed_batches(
    lengths: Sequence[int], max_tokens: int = EMBED_BATCH_TOKENS
) -> Iterator[list[int]]:
    """Indices of inputs of these lengths, in order, grouped into batches of at most max_tokens
    tokens (an input longer than that in a batch of its own): one forward each in the engine, one
    message each from the HTTP frontend, so that generation steps run between them."""
    batch: list[int] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if batch and tokens + n > max_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(i)
        tokens += n
    if batch:
        yield batch


class LimitError(ValueError):
    """A request that can never run here; `param` names the field to change."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SizeLimits:
    context_len: int  # tokens of prompt + output the model accepts
    pool_tokens: int  # KV slots of the whole pool

    def max_new(self, prompt_len: int) -> int:
        """The largest output a prompt of prompt_len tokens can ask for (< 1: none fits)."""
        return min(self.context_len - prompt_len, self.pool_tokens - prompt_len + 1)

    def check(
        self,
        prompt_len: int,
        max_new: int,
        *,
        param: str = "max_new_tokens",
        prompt_param: str = "prompt",
    ) -> None:
        """Raise LimitError saying what to change if this request can never run.

        `param` / `prompt_param`: what the caller's user calls the output budget and the prompt.
        """
        if prompt_len == 0:
            raise LimitError(
                "the prompt is empty; send at least one token", prompt_param
            )
        context_ok = prompt_len + max_new <= self.context_len
        pool_ok = prompt_len + max(max_new - 1, 0) <= self.pool_tokens
        if context_ok and pool_ok:
            return
        if not context_ok and prompt_len >= self.context_len:
            raise LimitError(
                f"the prompt is {prompt_len} tokens; this model accepts "
                f"{self.context_len} tokens in all (prompt + output), so shorten the "
                f"prompt to at most {self.context_len - 1} tokens",
                prompt_param,
            )
        if prompt_len > self.pool_tokens:
            raise LimitError(
                f"the prompt is {prompt_len} tokens but the KV cache holds "
                f"{self.pool_tokens}; shorten the prompt or give the server a larger "
                "--kv-cache-tokens",
                prompt_param,
            )
        what = (
            f"this model accepts {self.context_len} tokens in all"
            if not context_ok
            else f"the KV cache holds {self.pool_tokens} tokens"
        )
        raise LimitError(
            f"the prompt is {prompt_len} tokens and {param} is {max_new} "
            f"({prompt_len + max_new} in all); {what}: lower {param} to at most "
            f"{max(self.max_new(prompt_len), 0)} or shorten the prompt",
            param,
        )

    def check_input(self, input_len: int, *, param: str = "input") -> None:
        """Raise LimitError if an input that is only read (an embedding's) cannot run: it must fit
        the context; it needs no KV slots of the pool."""
        if input_len == 0:
            raise LimitError("the input is empty; send at least one token", param)
        if input_len > self.context_len:
            raise LimitError(
                f"the input is {input_len} tokens; this model accepts "
                f"{self.context_len} tokens in all, so shorten the input to at most "
                f"{self.context_len} tokens",
                param,
            )
