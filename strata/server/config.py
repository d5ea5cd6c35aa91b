"""`ServerConfig`: the HTTP server's knobs (the engine's are `strata.config.EngineConfig`).

Each field is one `strata serve` flag (`--max-queued-requests` for `max_queued_requests`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.redact import SECRET

LOG_LEVELS = ("debug", "info", "warning", "error")
ENGINE_WAITS = (
    "bounded",
    "passive",
    "active",
)  # strata.server.launch.engine_wait_env says what each sets


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(
        default=None, metadata=SECRET
    )  # if set, every endpoint but /health needs `Authorization: Bearer <key>`
    api_key_file: str | None = (
        None  # several keys, one 'NAME KEY' per line; /metrics counts each NAME's usage (strata.server.api_keys)
    )
    served_model_name: str | None = (
        None  # the `model` name clients use; default: the model directory's name
    )
    max_queued_requests: int | None = (
        None  # 503 + Retry-After once this many requests await a first token
    )
    grace_period: float = (
        30.0  # seconds in-flight requests may run on after SIGTERM/SIGINT
    )
    max_request_bytes: int = 16 * 2**20  # larger request bodies get 413
    log_level: str = "info"
    tool_call_parser: str | None = (
        None  # how the model writes tool calls (strata.server.tool_calls); default: from its chat template
    )
    reasoning_parser: str | None = (
        None  # split <think> reasoning into reasoning_content (strata.server.reasoning); default: off
    )
    engine_wait: str = "bounded"  # the engine's OpenMP threads: bounded (spin briefly, then sleep), passive, active
    responses_store_size: int = 4096  # /v1/responses kept for previous_response_id and GET /v1/responses/{id} (the least recently used go first; 0: none)
    batch_dir: str | None = (
        None  # where /v1/files and /v1/batches keep their state (SQLite + files), so a restart resumes a batch; default: a temporary directory (nothing kept)
    )
    batch_concurrency: int = 4  # lines of a batch in flight at once (more: faster batches, slower interactive first tokens; docs/BENCHMARKS.md)
    batch_priority: int = 10  # batch lines are scheduled at this priority or lower (interactive requests: 0)
    health_stall_timeout: float = 3.0  # seconds without a heartbeat from the engine process before /health says 503 (stopped or hung); a long step still sends them

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError(
                "api_key must not be empty; omit --api-key to serve without authentication"
            )
        if self.api_key_file is not None:
            from strata.server.api_keys import load_api_keys

            load_api_keys(self.api_key, self.api_key_file)  # ValueError: what to fix
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(
                f"max_queued_requests must be >= 1, got {self.max_queued_requests}"
            )
        if self.grace_period < 0:
            raise ValueError(
                f"grace_period must be >= 0 seconds, got {self.grace_period}"
            )
        if self.max_request_bytes < 1024:
            raise ValueError(
                f"max_request_bytes must be >= 1024, got {self.max_request_bytes}"
            )
        if self.log_level not in LOG_LEVELS:
            raise ValueError(
                f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}"
            )
        if not self.health_stall_timeout > 0:
            raise ValueError(
                f"health_stall_timeout must be > 0 seconds, got {self.health_stall_timeout}"
            )
        if self.responses_store_size < 0:
            raise ValueError(
                f"responses_store_size must be >= 0, got {self.responses_store_size}"
            )
        if not 1 <= self.batch_concurrency <= 1024:
            raise ValueError(
                f"batch_concurrency must be in [1, 1024], got {self.batch_concurrency}"
            )
        if self.batch_priority < 1:
            raise ValueError(
                f"batch_priority must be >= 1 (interactive requests run at 0), got {self.batch_priority}"
            )
        if self.engine_wait not in ENGINE_WAITS:
            raise ValueError(
                f"engine_wait must be one of {ENGINE_WAITS}, got {self.engine_wait!r}"
            )
        from strata.server.reasoning import REASONING_PARSERS
        from strata.server.tool_calls import TOOL_CALL_PARSERS

        if (
            self.tool_call_parser is not None
            and self.tool_call_parser not in TOOL_CALL_PARSERS
        ):
            raise ValueError(
                f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if (
            self.reasoning_parser is not None
            and self.reasoning_parser not in REASONING_PARSERS
        ):
            raise ValueError(
                f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {self.reasoning_parser!r}"
            )
