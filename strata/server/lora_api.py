"""LoRA adapters at run time, as vLLM's server takes them:

    POST /v1/load_lora_adapter     {"lora_name": "...", "lora_path": "/dir/of/a/peft/adapter"}
    POST /v1/unload_lora_adapter   {"lora_name": "..."}

A loaded adapter is served by its name: a request whose `model` is the adapter's name runs under
it (strata.server.serving.ServerState.check_model), and GET /v1/models lists it with the base
model as its `parent`. The engine reads and checks the adapter between two steps
(strata.engine.lora); a bad one is a 400 saying what is wrong, a name in use a 409, unloading an
adapter that requests still run under a 409.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from strata.server.protocol import (
    APIError,
    LoadLoRARequest,
    UnloadLoRARequest,
    decode_body,
)
from strata.server.serving import ServerState, get_state, json_response, read_body

router = APIRouter()


async def _change(state: ServerState, name: str, path: str | None) -> Response:
    info = state.engine_info()
    if not info.lora_enabled:
        raise APIError(
            400,
            "this server serves no LoRA adapters; start it with --enable-lora (or --lora-modules)",
        )
    if path is not None and name in state.model_aliases:
        raise APIError(
            400,
            f"lora_name {name!r} is the base model's name; choose another",
            param="lora_name",
        )
    result = await state.client.lora(name, path)
    state.set_adapters(result.adapters)
    if not result.ok:
        raise APIError(
            result.status,
            result.message,
            param="lora_name" if result.status in (404, 409) else None,
        )
    return json_response({"message": result.message, "adapters": result.adapters})


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    req = decode_body(
        await read_body(request, state.config.max_request_bytes), LoadLoRARequest
    )
    if not req.lora_name.strip() or not req.lora_path.strip():
        raise APIError(400, "lora_name and lora_path must not be empty")
    return await _change(state, req.lora_name, req.lora_path)


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    req = decode_body(
        await read_body(request, state.config.max_request_bytes), UnloadLoRARequest
    )
    return await _change(state, req.lora_name, None)
