"""Messages between the frontend process and the engine process, and their one codec.

Two ZMQ PUSH/PULL pipes, both bound by the frontend (the engine connects):

    frontend ──ToEngine──▶ engine      GenerateReq | AbortReq | FlushCacheReq | StatsReq | EmbedReq
                                       | LoRAReq | ShutdownReq
    frontend ◀─FromEngine── engine     EngineReady | EngineFailed | AddResult | OutputBatch
                                       | FlushCacheResult | StatsResult | EmbedResult | LoRAResult
                                       | Heartbeat

Every message is a tagged msgspec Struct encoded as msgpack; decoding checks the types, nothing is
pickled. Order on one pipe is preserved, so a request's AddResult always arrives before its outputs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from strata.engine.outputs import RequestOutput
from strata.sampling_params import SamplingParams

# ------------------------------------------------------------------ frontend -> engine


class GenerateReq(msgspec.Struct, tag=True):
    """Queue one tokenized prompt. The engine answers with an AddResult naming its request ids."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    bootstrap_room: int | None = (
        None  # PD disaggregation: set by the router for both workers
    )
    bootstrap_addr: str | None = (
        None  # PD disaggregation, decode worker: the prefill worker's KV inbox
    )
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)


class AbortReq(msgspec.Struct, tag=True):
    rids: list[str]  # engine request ids; unknown or finished ones are ignored


class FlushCacheReq(msgspec.Struct, tag=True):
    req_id: int


class StatsReq(msgspec.Struct, tag=True):
    req_id: int
    expert_load: bool = (
        False  # also send EngineStats.expert_load (a MoE model's per-expert counts)
    )


class EmbedReq(msgspec.Struct, tag=True):
    """Embed tokenized inputs (`Engine.embed`), between two steps; answered with an EmbedResult."""

    req_id: int
    inputs: list[list[int]]
    pooling: str = "last"  # last | mean
    normalize: bool = True
    dimensions: int | None = None  # keep the first N values (then normalise)


class LoRAReq(msgspec.Struct, tag=True):
    """Register (`path` given) or unregister a LoRA adapter; answered with a LoRAResult."""

    req_id: int
    name: str
    path: str | None = None


class ShutdownReq(msgspec.Struct, tag=True):
    pass


ToEngine = (
    GenerateReq | AbortReq | FlushCacheReq | StatsReq | EmbedReq | LoRAReq | ShutdownReq
)

# ------------------------------------------------------------------ engine -> frontend


class EngineStats(msgspec.Struct):
    """The scheduler's load, sent with every batch of outputs and on request."""

    num_running: int = 0
    num_waiting: int = 0
    num_pages: int = 0
    num_free_pages: int = 0
    num_cached_pages: int = 0  # held by the prefix cache (locked or not)
    num_evictable_pages: int = 0  # cached and unlocked: reclaimable at once
    page_size: int = 1
    num_retractions: int = 0  # so far
    num_preemptions: int = (
        0  # running requests retracted for a waiting one of higher priority
    )
    num_steps: int = 0
    hicache: dict[str, Any] | None = (
        None  # HiCacheStats.as_dict() when the KV cache hierarchy is on
    )
    spec: dict[str, Any] | None = (
        None  # SpecStats.as_dict() when speculative decoding is on
    )
    leaked_pages: int = (
        0  # pages neither free, cached nor held (the accounting invariant: always 0)
    )
    # per window group of the pool (sliding-window models): its pages, free / cached / held by requests;
    # None in the stats sent with outputs (counting them walks the prefix cache)
    window_groups: list[dict[str, int]] | None = None
    # mixture-of-experts models, None otherwise and in the stats sent with outputs: per MoE layer, the
    # tokens routed to each expert since start (a token counts once per chosen expert) only when the
    # StatsReq asks (GET /metrics; DeepSeek-V3 has 58 x 256 of them), and how uneven they are
    # (strata.layers.expert_load.expert_load_summary: a few numbers per layer) in every requested stats
    expert_load: dict[int, list[int]] | None = None
    expert_load_summary: dict[int, dict[str, Any]] | None = None
    # a replica split over ranks (--tp-size/--ep-size), in requested stats: its workers, health and
    # per-rank expert rows (strata.distributed.runtime.ParallelRuntime.describe); None for one rank
    parallel: dict[str, Any] | None = None
    # CPU, in requested stats: per size of step, the threads it runs on and each option's measured
    # time per token (strata.engine.step_threads); None where the choice is off
    step_threads: dict[str, dict[str, Any]] | None = None

    @property
    def token_usage(self) -> float:
        """Fraction of the KV pool held by requests (evictable cache pages count as free)."""
        if not self.num_pages:
            return 0.0
        return 1.0 - (self.num_free_pages + self.num_evictable_pages) / self.num_pages


class EngineInfo(msgspec.Struct):
    """What the engine found at start-up; the frontend validates requests against it."""

    pid: int
    model_dir: str
    architecture: str
    vocab_size: int
    context_len: int
    num_kv_tokens: int
    page_size: int
    dtype: str
    kv_dtype: str
    device: str
    kv_reason: str
    load_seconds: float
    eos_token_ids: list[int]
    bos_token_id: int | None
    disaggregation_mode: str = "null"  # null | prefill | decode
    bootstrap_addr: str | None = None  # a disaggregated worker's KV inbox (host:port)
    dtype_reason: str = ""  # why this compute dtype (measured, or the flag)
    weights: str = ""  # weight formats the model runs on, e.g. "q4 x120, q8 x1"
    kernels: str = (
        ""  # native kernel build and its ISA, e.g. "native (avx2 fma f16c)", or "off"
    )
    decode_loop: str = ""  # "native": decode steps run the layer loop in C++; "python"
    kv_bytes: int = 0  # memory of the whole KV pool (every layer group)
    kv_groups: str = ""  # the KV pool's layer groups, e.g. "3 layers keep every token (...); 15 window-512 ..."
    num_experts: int = (
        0  # routed experts of each mixture-of-experts layer; 0: not a MoE model
    )
    hidden_size: int = 0  # the length of an embedding (before `dimensions`)
    lora_enabled: bool = (
        False  # LoRA adapters can be served (--enable-lora / --lora-modules)
    )
    lora_adapters: list[str] = msgspec.field(
        default_factory=list
    )  # registered at start


class EngineReady(msgspec.Struct, tag=True):
    info: EngineInfo


class EngineFailed(msgspec.Struct, tag=True):
    message: str  # why the engine cannot run (sent before it exits)


class AddResult(msgspec.Struct, tag=True):
    rid: str  # the GenerateReq's rid
    rids: list[str]  # engine request ids created (n of them), empty if rejected
    error: str | None = None  # the validation error a user should see (HTTP 400)
    status: int | None = (
        None  # the HTTP status of `error` when not 400 (a LoRA adapter's 404, 503)
    )


class LoRAResult(msgspec.Struct, tag=True):
    req_id: int
    ok: bool
    message: str
    status: int = 200  # the HTTP status the frontend answers with
    adapters: list[str] = msgspec.field(default_factory=list)  # registered now


class OutputBatch(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: EngineStats


class FlushCacheResult(msgspec.Struct, tag=True):
    req_id: int
    ok: bool
    message: str


class StatsResult(msgspec.Struct, tag=True):
    req_id: int
    stats: EngineStats


class EmbedResult(msgspec.Struct, tag=True):
    req_id: int
    embeddings: list[bytes]  # one per input: little-endian float32 values
    # why the inputs cannot be embedded (HTTP 400); embeddings are then empty
    error: str | None = None
    internal: bool = (
        False  # the error is the engine's fault (HTTP 500), not the input's
    )


class Heartbeat(msgspec.Struct, tag=True):
    """Sent every HEARTBEAT_S by a thread of the engine process, whatever its loop is doing."""


HEARTBEAT_S = 0.5

FromEngine = (
    Heartbeat
    | EngineReady
    | EngineFailed
    | AddResult
    | OutputBatch
    | FlushCacheResult
    | StatsResult
    | EmbedResult
    | LoRAResult
)

# ------------------------------------------------------------------ codec

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)


class _AnyGenerateReq(msgspec.Struct, tag="GenerateReq"):
    rid: str


def request_id_of(data: bytes) -> str | None:
    """The rid of a GenerateReq that failed typed decoding (a field of the wrong type or range), so the
    engine can still answer it; None when the message is not even that."""
    try:
        return msgspec.msgpack.decode(data, type=_AnyGenerateReq).rid
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
