"""The OpenAPI document of `strata serve` and `strata router` (GET /openapi.json), built from the same
msgspec schemas that decode request bodies, so the document cannot drift from what is enforced.
Clients generate from it, and the fuzz suite (tests/e2e/test_fuzz.py) draws its requests from it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from strata.sampling_params import SamplingParams
from strata.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CreateBatchRequest,
    EmbeddingRequest,
    ErrorResponse,
    GenerateRequest,
    LoadLoRARequest,
    UnloadLoRARequest,
)
from strata.server.responses_protocol import ResponsesRequest

REF = "#/components/schemas/{name}"

# POST endpoints with a JSON body: path -> (body schema, summary)
GENERATION_ENDPOINTS: dict[str, tuple[type, str]] = {
    "/v1/chat/completions": (
        ChatCompletionRequest,
        "OpenAI chat completion (streamed with stream: true)",
    ),
    "/v1/completions": (CompletionRequest, "OpenAI legacy completion"),
    "/generate": (
        GenerateRequest,
        "SGLang-style native generation (sampling_params as SamplingParams)",
    ),
}

# other POST endpoints the router proxies as well: path -> (body schema, summary)
ROUTED_POSTS: dict[str, tuple[type, str]] = {
    "/v1/embeddings": (
        EmbeddingRequest,
        "OpenAI embeddings: the final hidden state of each input's last token, or their mean",
    ),
}

# POST endpoints of the server alone (the router does not proxy them): path -> (body schema, summary)
SERVER_POSTS: dict[str, tuple[type, str]] = {
    "/v1/responses": (
        ResponsesRequest,
        (
            "OpenAI Responses API: input items through the chat path (streamed as typed events "
            "with stream: true); stored for previous_response_id unless store: false"
        ),
    ),
    "/v1/load_lora_adapter": (
        LoadLoRARequest,
        "register a LoRA adapter (a PEFT directory the server reads) under a model name",
    ),
    "/v1/unload_lora_adapter": (
        UnloadLoRARequest,
        "unregister a LoRA adapter (409 while requests run under it)",
    ),
    "/v1/batches": (
        CreateBatchRequest,
        "OpenAI Batch API: run an uploaded JSONL of requests behind interactive traffic",
    ),
}


def _id(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": schema}


def _limit(maximum: int) -> dict[str, Any]:
    return _query("limit", {"type": "integer", "minimum": 1, "maximum": maximum})


ORDER = _query("order", {"enum": ["asc", "desc"]})
AFTER = _query("after", {"type": "string"})

# the server's own stored objects (responses, files, batches): path -> method -> (summary, parameters)
STORED_OBJECT_PATHS: dict[str, dict[str, tuple[str, list[dict[str, Any]]]]] = {
    "/v1/responses/{response_id}": {
        "get": (
            "a stored response (404 when not stored, deleted or evicted)",
            [_id("response_id")],
        ),
        "delete": ("forget a stored response", [_id("response_id")]),
    },
    "/v1/responses/{response_id}/input_items": {
        "get": (
            "the items a stored response was given, the conversation before it included",
            [_id("response_id"), _limit(100), ORDER, AFTER],
        )
    },
    "/v1/files": {
        "get": (
            "this key's files, newest first",
            [_query("purpose", {"type": "string"}), _limit(10000), ORDER, AFTER],
        )
    },
    "/v1/files/{file_id}": {
        "get": ("a file's metadata", [_id("file_id")]),
        "delete": ("delete a file", [_id("file_id")]),
    },
    "/v1/files/{file_id}/content": {
        "get": ("a file's bytes (JSONL)", [_id("file_id")]),
    },
    "/v1/batches/{batch_id}": {
        "get": ("a batch: its status and request counts", [_id("batch_id")]),
    },
    "/v1/batches/{batch_id}/cancel": {
        "post": (
            "cancel a batch (409 once it has ended); the lines that finished are kept",
            [_id("batch_id")],
        ),
    },
}

FILE_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"enum": ["batch"]},
                },
                "required": ["file", "purpose"],
            }
        }
    },
}


SERVER_GETS = {
    "/health": "200 once the engine is ready and answering, 503 while loading, failed, stopped or stuck",
    "/health_generate": "200 once a 1-token generation succeeds",
    "/get_server_info": "configuration (secrets redacted), engine facts, KV cache and queue state",
    "/metrics": "Prometheus metrics",
    "/v1/models": "the served model",
    "/openapi.json": "this document",
}

ROUTER_GETS = {
    "/health": "200 while at least one worker is routable",
    "/workers": "the workers, their health and load",
    "/get_server_info": "router configuration (secrets redacted) and per-worker state",
    "/metrics": "Prometheus metrics",
    "/v1/models": "proxied to a worker",
    "/health_generate": "proxied to a worker",
    "/openapi.json": "this document",
}


class WorkerURL(msgspec.Struct):
    url: str  # http://host:port of a `strata serve` worker


def _components() -> dict[str, Any]:
    bodies = {**GENERATION_ENDPOINTS, **ROUTED_POSTS, **SERVER_POSTS}.values()
    types = [body for body, _ in bodies] + [
        SamplingParams,
        ErrorResponse,
        WorkerURL,
    ]
    _, components = msgspec.json.schema_components(types, ref_template=REF)
    # /generate decodes sampling_params as a free dict, then converts it to SamplingParams (unknown
    # keys are a 400): the document states the real contract
    components["GenerateRequest"]["properties"]["sampling_params"] = {
        "anyOf": [{"$ref": REF.format(name="SamplingParams")}, {"type": "null"}]
    }
    # `input` decodes as any JSON value and is checked by hand (msgspec unions take one array type)
    ids = {"type": "array", "items": {"type": "integer"}}
    components["EmbeddingRequest"]["properties"]["input"] = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            ids,
            {"type": "array", "items": ids},
        ]
    }
    return components


def _responses(ok: str) -> dict[str, Any]:
    error = {
        "content": {
            "application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}
        }
    }
    return {
        "200": {"description": ok},
        "400": {
            "description": "invalid request: the message says what to fix",
            **error,
        },
        "401": {"description": "missing or wrong API key", **error},
    }


def _body(schema: str) -> dict[str, Any]:
    return {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": REF.format(name=schema)}}},
    }


def openapi_document(title: str, *, router: bool, secured: bool) -> dict[str, Any]:
    """The document for the server (router=False) or the router; `secured`: an API key is required."""
    paths: dict[str, dict[str, Any]] = {}
    for path, summary in (ROUTER_GETS if router else SERVER_GETS).items():
        paths.setdefault(path, {})["get"] = {
            "summary": summary,
            "responses": _responses("OK"),
        }
    for path, (body, summary) in GENERATION_ENDPOINTS.items():
        paths.setdefault(path, {})["post"] = {
            "summary": summary + (" (proxied to a worker)" if router else ""),
            "requestBody": _body(body.__name__),
            "responses": _responses(
                "the generation (JSON, or text/event-stream when streaming)"
            ),
        }
    for path, (body, summary) in ROUTED_POSTS.items():
        paths[path] = {
            "post": {
                "summary": summary + (" (proxied to a worker)" if router else ""),
                "requestBody": _body(body.__name__),
                "responses": _responses("the result (JSON)"),
            }
        }
    if not router:
        for path, (body, summary) in SERVER_POSTS.items():
            paths[path] = {
                "post": {
                    "summary": summary,
                    "requestBody": _body(body.__name__),
                    "responses": _responses(
                        "the result (JSON, or text/event-stream when streaming)"
                    ),
                }
            }
        for path, methods in STORED_OBJECT_PATHS.items():
            found: dict[str, Any] = {
                **_responses("OK"),
                "404": {"description": "no such object"},
            }
            paths.setdefault(path, {}).update(
                {
                    method: {
                        "summary": summary,
                        "parameters": parameters,
                        "responses": found,
                    }
                    for method, (summary, parameters) in methods.items()
                }
            )
        paths["/v1/files"]["post"] = {
            "summary": "upload a batch input file (multipart: file, purpose)",
            "requestBody": FILE_UPLOAD,
            "responses": _responses("the File object"),
        }
        paths["/v1/batches"]["get"] = {
            "summary": "this key's batches, newest first",
            "parameters": [_limit(100), AFTER],
            "responses": _responses("a page of Batch objects"),
        }
    if router:
        for method, summary in (
            ("post", "register a worker"),
            ("delete", "remove a worker"),
        ):
            paths.setdefault("/workers", {})[method] = {
                "summary": summary,
                "requestBody": _body("WorkerURL"),
                "responses": _responses("the worker"),
            }
        paths["/flush_cache"] = {
            "post": {
                "summary": "flush every worker's prefix cache",
                "responses": _responses("OK"),
            }
        }
    else:
        paths["/flush_cache"] = {
            "post": {
                "summary": "flush the prefix cache (409 while requests run)",
                "responses": _responses("OK"),
            }
        }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {"schemas": _components()},
    }
    if secured:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}
        }
        doc["security"] = [{"bearer": []}]
    return doc
