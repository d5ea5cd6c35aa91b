"""What a server tells about itself, each piece optional (a peer may lack any of them).

/v1/models        the model name to put in requests (first listed)
/get_server_info  Strata/SGLang: config and `cache_hit_rate` (since the server started)
/metrics          Prometheus counters `<prefix>:prompt_tokens_total` and `<prefix>:cached_tokens_total`;
                  read before and after a run, their difference gives this run's hit rate
/flush_cache      Strata/SGLang: empty the prefix cache between rounds (best effort)
/proc/PID/stat    a Strata server on this machine: its frontend's and engine's CPU time (the pids
                  from /get_server_info), read before and after a run, per output token
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import httpx

_COUNTER = re.compile(
    r"^(?:\w+:)?(prompt_tokens_total|cached_tokens_total)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$"
)


@dataclass(frozen=True)
class TokenCounters:
    prompt_tokens: float
    cached_tokens: float


def first_model(base_url: str, api_key: str | None = None) -> str | None:
    """The first model id of GET /v1/models, or None if the server does not list models."""
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=_auth(api_key), timeout=30)
        data = resp.json().get("data") or []
        return str(data[0]["id"]) if resp.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, AttributeError):
        return None


def server_info(base_url: str, api_key: str | None = None) -> dict[str, Any] | None:
    try:
        resp = httpx.get(
            f"{base_url}/get_server_info", headers=_auth(api_key), timeout=30
        )
        return resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def parse_token_counters(text: str) -> TokenCounters | None:
    """Sum `*prompt_tokens_total` / `*cached_tokens_total` samples of a Prometheus text page."""
    sums = {"prompt_tokens_total": 0.0, "cached_tokens_total": 0.0}
    seen = set()
    for line in text.splitlines():
        m = _COUNTER.match(line.strip())
        if m:
            sums[m.group(1)] += float(m.group(2))
            seen.add(m.group(1))
    if seen != set(sums):
        return None
    return TokenCounters(sums["prompt_tokens_total"], sums["cached_tokens_total"])


def token_counters(base_url: str, api_key: str | None = None) -> TokenCounters | None:
    try:
        resp = httpx.get(f"{base_url}/metrics", headers=_auth(api_key), timeout=30)
        return parse_token_counters(resp.text) if resp.status_code == 200 else None
    except httpx.HTTPError:
        return None


def hit_rate_between(
    before: TokenCounters | None, after: TokenCounters | None
) -> float | None:
    if before is None or after is None:
        return None
    prompt = after.prompt_tokens - before.prompt_tokens
    return (after.cached_tokens - before.cached_tokens) / prompt if prompt > 0 else None


def flush_cache(base_url: str, api_key: str | None = None) -> bool:
    try:
        return (
            httpx.post(
                f"{base_url}/flush_cache", headers=_auth(api_key), timeout=30
            ).status_code
            == 200
        )
    except httpx.HTTPError:
        return False


def _auth(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_pids(info: dict[str, Any] | None) -> dict[str, int]:
    """The processes of a Strata server that /get_server_info names and that run on this machine:
    {"frontend": pid, "engine": pid}, either missing when not told or not here."""
    if not info:
        return {}
    engine = info.get("engine")
    if not isinstance(engine, dict):
        engine = {}
    pids = {"frontend": info.get("frontend_pid"), "engine": engine.get("pid")}
    return {
        name: pid
        for name, pid in pids.items()
        if isinstance(pid, int) and os.path.exists(f"/proc/{pid}/stat")
    }


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user + system CPU seconds each process has used so far (Linux /proc; a gone process is left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = (
                    f.read().rsplit(")", 1)[1].split()
                )  # after "pid (comm)": state is fields[0]
        except OSError:
            continue
        out[name] = (
            int(fields[11]) + int(fields[12])
        ) / tick  # utime, stime: fields 14 and 15 of stat
    return out
