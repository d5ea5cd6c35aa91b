"""What `strata bench soak` can be asked for, with one default each; import-light (no HTTP client),
so the CLI's parser builds from it without loading the soak (the run is strata/bench/soak.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

FAULTS = (
    "kill_replica",
    "stop_engine",
    "restart_redis",
    "fill_disk",
    "kill_prefill",
)  # soak_faults.py
L3_TIERS = ("file", "redis")


@dataclass(frozen=True)
class LoadConfig:
    concurrency: int = 4  # clients, each with one request in flight
    max_tokens: int = 16  # answer length at most, for most kinds of request
    request_timeout_s: float = 120.0  # no complete answer by then: the request hung
    pd_share: float = 0.3  # fraction of requests sent through the PD router
    shared_prefix_words: int = (
        300  # a few long system prompts, so the L3 tier is written and read
    )
    seed: int = 0


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None  # None: the servers' default model
    run_dir: Path = Path(".")  # logs, the L3 directory or its tmpfs mount point
    server_args: tuple[str, ...] = ()  # added to every `strata serve`
    router_args: tuple[str, ...] = ()  # added to both routers
    l3: str = "file"  # one of L3_TIERS
    l3_tmpfs_mib: int = 512  # the file tier's own tmpfs (so filling it is ENOSPC without touching the disk)
    l3_max_gib: float = 0.25  # the file backend's own size cap; below the tmpfs, so only a fill hits ENOSPC


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    faults: tuple[str, ...] = FAULTS  # spaced evenly over the duration, one at a time
    stop_s: float = 10.0  # an engine stays SIGSTOPped this long
    hold_s: float = 15.0  # the disk stays full / Redis down about this long
    startup_timeout_s: float = (
        300.0  # for a server to load, at the start and after each restart
    )
    load: LoadConfig = field(default_factory=LoadConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
