"""POST /v1/embeddings: OpenAI's embeddings over the served decoder model.

The handler decodes and checks the body, tokenizes the inputs, checks each against the context
(the engine's `SizeLimits`) and the vocabulary, then sends them to the engine in batches of up to
`EMBED_BATCH_TOKENS` tokens, one `EmbedReq` at a time, so that the engine runs its generation
steps between them. The engine answers each with the vectors as little-endian float32 bytes:
`encoding_format: "base64"` sends them as they are (as OpenAI does), "float" as JSON numbers.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any

from fastapi import APIRouter, Request, Response

from strata.engine.limits import (
    MAX_EMBEDDING_INPUTS,
    LimitError,
    SizeLimits,
    embed_batches,
)
from strata.server.protocol import (
    APIError,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    decode_body,
)
from strata.server.serving import (
    ClientGone,
    ServerState,
    get_state,
    json_response,
    off_loop,
    read_body,
)

router = APIRouter()

INPUT_SHAPES = "a non-empty string, a list of strings, a list of token ids, or a list of token-id lists"


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x
    )


def embedding_inputs(state: ServerState, raw: Any, vocab_size: int) -> list[list[int]]:
    """OpenAI's four shapes of `input`, as token-id lists (each checked against the vocabulary)."""
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise APIError(400, f"input must be {INPUT_SHAPES}", param="input")
    if len(raw) > MAX_EMBEDDING_INPUTS and not _is_ids(raw):
        raise APIError(
            400,
            f"input has {len(raw)} inputs; at most {MAX_EMBEDDING_INPUTS} per request",
            param="input",
        )
    if all(isinstance(x, str) for x in raw):
        for i, text in enumerate(raw):
            if not text:
                raise APIError(
                    400,
                    f"input[{i}] is an empty string; send some text",
                    param="input",
                )
        lists = [state.encode(text, param="input") for text in raw]
    elif _is_ids(raw):
        lists = [raw]
    elif all(_is_ids(x) for x in raw):
        lists = raw
    else:
        raise APIError(400, f"input must be {INPUT_SHAPES}", param="input")
    for i, ids in enumerate(lists):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            where = f"input[{i}]" if len(lists) > 1 else "input"
            raise APIError(
                400,
                f"{where} has token id {bad}; this model's token ids are 0 .. {vocab_size - 1}",
                param="input",
            )
    return lists


def _floats(data: bytes) -> list[float]:
    values = array("f", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    state = get_state(request)
    body = await read_body(request, state.config.max_request_bytes)
    req: EmbeddingRequest = await off_loop(
        len(body), decode_body, body, EmbeddingRequest
    )
    if state.check_model(req.model) is not None:
        raise APIError(
            400,
            f"embeddings are of the base model; {req.model!r} is a LoRA adapter",
            param="model",
        )
    info = state.engine_info()
    if req.dimensions is not None and not 1 <= req.dimensions <= info.hidden_size:
        raise APIError(
            400,
            f"dimensions must be between 1 and {info.hidden_size} (this model's hidden size), "
            f"got {req.dimensions}",
            param="dimensions",
        )
    inputs = await off_loop(
        len(body), embedding_inputs, state, req.input, info.vocab_size
    )
    limits = SizeLimits(info.context_len, info.num_kv_tokens)
    for ids in inputs:
        try:
            limits.check_input(len(ids))
        except LimitError as exc:
            code = "context_length_exceeded" if ids else None
            raise APIError(400, str(exc), param=exc.param, code=code) from None
    vectors: list[bytes] = []
    for batch in embed_batches([len(ids) for ids in inputs]):
        if vectors and await request.is_disconnected():
            raise ClientGone()
        result = await state.client.embed(
            [inputs[i] for i in batch], req.pooling, req.normalize, req.dimensions
        )
        if result.error is not None:
            raise APIError(500 if result.internal else 400, result.error)
        vectors.extend(result.embeddings)
    encode = (
        (lambda v: base64.b64encode(v).decode())
        if req.encoding_format == "base64"
        else _floats
    )
    data = [EmbeddingData(index=i, embedding=encode(v)) for i, v in enumerate(vectors)]
    num_tokens = sum(len(ids) for ids in inputs)
    return json_response(
        EmbeddingResponse(
            data=data,
            model=state.model_name,
            usage=EmbeddingUsage(num_tokens, num_tokens),
        )
    )
