"""The soak's faults, injected one after another while the load runs, and how long each took
`/health` to tell the truth.

    kill_replica   SIGKILL a replica's server (its engine dies with it); restart it on its port
    stop_engine    SIGSTOP a replica's engine process for --stop-seconds, then SIGCONT
    restart_redis  SIGKILL Redis (the L3 tier, with --l3 redis) and start it again, empty
    fill_disk      fill the file tier's tmpfs until writes fail with ENOSPC; free it after a while
    kill_prefill   SIGKILL the PD prefill server; restart it on its port

A `HealthProbe` polls every server's and router's /health, and the DP router's /workers, a few
times a second. The truth after a fault: for a killed or stopped process, its /health and the
router's view of it turn bad and, once it is back, good again; Redis and a full disk are only the
L3 tier, which degrades to recomputation, so the truth there is that every /health stays good.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from strata.bench.soak_cluster import Cluster, Proc, pid_alive

PROBE_INTERVAL_S = 0.25
DETECT_TIMEOUT_S = 20.0
QUIET_BEFORE_FAULT_S = 60.0  # a fault waits this long at most for every /health to be good  # a killed process is restarted after this even if no /health noticed


@dataclass
class FaultResult:
    name: str
    target: str
    injected_at: float  # seconds since the soak's start
    skipped: str = ""  # why it did not run
    ended_at: float | None = None  # back to normal (or given up on)
    restored_at: float | None = None  # restarted / resumed / freed
    # seconds from injection until /health turned bad (None: never did), and from the restore until good
    server_unhealthy_after_s: float | None = None
    router_unhealthy_after_s: float | None = None
    server_healthy_after_s: float | None = None
    router_healthy_after_s: float | None = None
    unhealthy_while_it_should_not_s: float = (
        0.0  # L3 faults: seconds any /health was bad
    )
    notes: list[str] = field(default_factory=list)


class HealthProbe:
    """Latest /health status of each process (None: no answer) and the DP router's per-worker view."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.status: dict[str, int | None] = {}  # process name -> /health status
        self.router_view: dict[
            str, bool
        ] = {}  # worker URL -> healthy in the DP router's /workers
        self.stopped = False

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=2.0) as http:
            while not self.stopped:
                procs = [*self.cluster.servers, *self.cluster.routers]
                statuses = await asyncio.gather(*(self._health(http, p) for p in procs))
                self.status = {p.name: s for p, s in zip(procs, statuses)}
                with contextlib.suppress(
                    httpx.HTTPError, ValueError, KeyError, TypeError
                ):
                    workers = (
                        await http.get(self.cluster.router.url + "/workers")
                    ).json()["workers"]
                    self.router_view = {w["url"]: bool(w["healthy"]) for w in workers}
                await asyncio.sleep(PROBE_INTERVAL_S)

    @staticmethod
    async def _health(http: httpx.AsyncClient, p: Proc) -> int | None:
        try:
            return (await http.get(p.url + "/health")).status_code
        except httpx.HTTPError:
            return None

    def healthy(self, name: str) -> bool:
        return self.status.get(name) == 200

    def all_healthy(self) -> bool:
        return bool(self.status) and all(s == 200 for s in self.status.values())


async def first_times(
    predicates: dict[str, Callable[[], bool]], timeout_s: float
) -> dict[str, float | None]:
    """Seconds from now until each predicate first held (polled together), None for those that never
    did within `timeout_s`."""
    start = time.monotonic()
    seen: dict[str, float | None] = dict.fromkeys(predicates)
    while True:
        elapsed = time.monotonic() - start
        for key, predicate in predicates.items():
            if seen[key] is None and predicate():
                seen[key] = elapsed
        if all(v is not None for v in seen.values()) or elapsed >= timeout_s:
            return seen
        await asyncio.sleep(PROBE_INTERVAL_S / 2)


class FaultInjector:
    def __init__(
        self,
        cluster: Cluster,
        probe: HealthProbe,
        t0: float,
        stop_s: float,
        hold_s: float,
        restart_timeout_s: float,
    ):
        self.cluster = cluster
        self.probe = probe
        self.t0 = t0
        self.stop_s = stop_s
        self.hold_s = hold_s
        self.restart_timeout_s = restart_timeout_s

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self, faults: list[str], duration_s: float) -> list[FaultResult]:
        """Inject each fault at its slot, spaced evenly over the duration; each waits for the last."""
        results = []
        for i, name in enumerate(faults):
            at = duration_s * (i + 1) / (len(faults) + 1)
            if self.now() < at:
                await asyncio.sleep(at - self.now())
            await first_times(
                {"up": self.probe.all_healthy}, QUIET_BEFORE_FAULT_S
            )  # never stack faults
            result = await getattr(self, name)()
            result.ended_at = self.now()
            results.append(result)
        return results

    # ------------------------------------------------------------------ the faults

    async def kill_replica(self) -> FaultResult:
        return await self._kill_and_restart(self.cluster.replicas[0], "kill_replica")

    async def kill_prefill(self) -> FaultResult:
        return await self._kill_and_restart(self.cluster.prefill, "kill_prefill")

    async def _kill_and_restart(self, proc: Proc, name: str) -> FaultResult:
        engine = proc.engine_pid
        r = FaultResult(name, proc.name, self.now())
        router_sees = self._router_sees(proc)
        proc.signal(signal.SIGKILL)
        seen = await first_times(
            {
                "server": lambda: not self.probe.healthy(proc.name),
                "router": lambda: not router_sees(),
            },
            DETECT_TIMEOUT_S,
        )
        r.server_unhealthy_after_s, r.router_unhealthy_after_s = (
            seen["server"],
            seen["router"],
        )
        assert proc.popen is not None  # it was running
        await asyncio.to_thread(proc.popen.wait, 10)
        if (
            engine is not None
            and (await first_times({"gone": lambda: not pid_alive(engine)}, 10.0))[
                "gone"
            ]
            is None
        ):
            r.notes.append(
                f"its engine (pid {engine}) outlived the server; killed by the soak"
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
        proc.start()
        r.restored_at = self.now()
        await self._wait_back(proc, r)
        return r

    async def stop_engine(self) -> FaultResult:
        proc = self.cluster.replicas[1]
        engine = await asyncio.to_thread(proc.find_engine_pid)
        r = FaultResult("stop_engine", f"{proc.name} engine", self.now())
        if engine is None:
            r.skipped = "the engine's pid is unknown"
            return r
        router_sees = self._router_sees(proc)
        os.kill(engine, signal.SIGSTOP)
        try:
            seen = await first_times(
                {
                    "server": lambda: not self.probe.healthy(proc.name),
                    "router": lambda: not router_sees(),
                },
                self.stop_s,
            )
            await asyncio.sleep(max(0.0, self.stop_s - (self.now() - r.injected_at)))
        finally:
            os.kill(engine, signal.SIGCONT)
        r.restored_at = self.now()
        r.server_unhealthy_after_s, r.router_unhealthy_after_s = (
            seen["server"],
            seen["router"],
        )
        if r.server_unhealthy_after_s is None:
            r.notes.append(
                f"/health stayed 200 through {self.stop_s:.0f}s of a stopped engine"
            )
        await self._wait_back(proc, r)
        return r

    async def restart_redis(self) -> FaultResult:
        redis = self.cluster.redis
        r = FaultResult("restart_redis", "redis", self.now())
        if redis is None:
            r.skipped = "the L3 tier is the file backend (--l3 redis to run this one)"
            return r
        watch = self._watch_unhealthy()
        redis.signal(signal.SIGKILL)
        assert redis.popen is not None  # it was running
        await asyncio.to_thread(redis.popen.wait, 10)
        await asyncio.sleep(self.hold_s / 3)
        redis.start()
        r.restored_at = self.now()
        await asyncio.sleep(self.hold_s / 3)
        r.unhealthy_while_it_should_not_s = await watch.finish()
        return r

    async def fill_disk(self) -> FaultResult:
        r = FaultResult("fill_disk", "L3 tmpfs", self.now())
        if self.cluster.redis is not None:
            r.skipped = "the L3 tier is Redis"
            return r
        if self.cluster.tmpfs is None:
            r.skipped = self.cluster.tmpfs_note
            return r
        watch = self._watch_unhealthy()
        filler = self.cluster.tmpfs / "soak-filler"
        written = await asyncio.to_thread(fill, filler)
        r.notes.append(f"filled with {written / 2**20:.0f} MiB until ENOSPC")
        await asyncio.sleep(self.hold_s)
        filler.unlink(missing_ok=True)
        r.restored_at = self.now()
        await asyncio.sleep(2.0)
        r.unhealthy_while_it_should_not_s = await watch.finish()
        return r

    # ------------------------------------------------------------------ helpers

    def _router_sees(self, proc: Proc):
        """A callable: is `proc` up as its router sees it (the DP router's /workers; PD: its /health)?"""
        if proc in self.cluster.replicas:
            return lambda: self.probe.router_view.get(proc.url, False)
        return lambda: self.probe.healthy(self.cluster.pd_router.name)

    async def _wait_back(self, proc: Proc, r: FaultResult) -> None:
        router_sees = self._router_sees(proc)
        seen = await first_times(
            {"server": lambda: self.probe.healthy(proc.name), "router": router_sees},
            self.restart_timeout_s,
        )
        r.server_healthy_after_s, r.router_healthy_after_s = (
            seen["server"],
            seen["router"],
        )
        if r.server_healthy_after_s is None:
            r.notes.append(
                f"not healthy {self.restart_timeout_s:.0f}s after the restore:\n{proc.log_tail(10)}"
            )
        await asyncio.to_thread(proc.find_engine_pid)

    def _watch_unhealthy(self) -> _UnhealthyWatch:
        return _UnhealthyWatch(self.probe)


class _UnhealthyWatch:
    """Adds up the time any /health was bad, from now until `finish()`."""

    def __init__(self, probe: HealthProbe):
        self.probe = probe
        self.bad_s = 0.0
        self.done = False
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not self.done:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if not self.probe.all_healthy():
                self.bad_s += PROBE_INTERVAL_S

    async def finish(self) -> float:
        self.done = True
        await self.task
        return self.bad_s


def fill(path: Path, chunk_bytes: int = 1 << 20) -> int:
    """Write `path` until the file system is full (ENOSPC); returns the bytes written."""
    written = 0
    block = b"\0" * chunk_bytes
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                written += f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if chunk_bytes > 4096:  # fill the last crumbs too
                    block = block[: len(block) // 2]
                    chunk_bytes //= 2
                    continue
                return written
