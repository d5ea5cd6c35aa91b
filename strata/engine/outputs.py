"""What the engine streams back for a request: torch-free, so the HTTP frontend and the router can
share these types with the engine without importing torch (they cross the IPC socket as msgpack)."""

from __future__ import annotations

import msgspec


class TopLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class TokenLogprob(msgspec.Struct):
    token_id: int
    logprob: float
    top: list[TopLogprob] = msgspec.field(default_factory=list)


class RequestOutput(msgspec.Struct):
    """One update for one request: new tokens/text since the last update, and, at the end, why it ended."""

    rid: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    matched_stop: str | int | None = None
    error: str | None = None
    # the HTTP status the error is (None: 500); 503 where another worker failed this one's request
    error_status: int | None = None
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] = msgspec.field(
        default_factory=dict
    )  # per cache tier
    # speculative decoding, so far: steps that verified drafts, tokens drafted, drafts accepted
    spec_verify_steps: int = 0
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
