"""`strata bench soak`: a router over two replicas sharing an L3 tier and a PD pair, under a mixed
load for a set time while faults are injected on a schedule; then what was lost, what leaked, how
memory moved, and how fast /health told the truth.

    start the cluster (soak_cluster.py) ─▶ warm up ─▶ t0: load (soak_load.py) ∥ faults (soak_faults.py)
        ∥ health probe ∥ RSS samples ─▶ duration over and every fault done: stop the load, let the
        servers go idle ─▶ leaked KV pages, RSS at the end ─▶ table + JSON; exit 1 on any lost or
        hung request or leaked page

A 5xx that reached a client is counted in a fault window (from a fault's injection until the
system was back, plus WINDOW_GRACE_S) or in quiet time, where there should be none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from strata.bench.soak_cluster import Cluster, rss_bytes
from strata.bench.soak_config import ClusterConfig, LoadConfig, SoakConfig
from strata.bench.soak_faults import FaultInjector, FaultResult, HealthProbe
from strata.bench.soak_load import KINDS, OUTCOMES, Load, Record

WINDOW_GRACE_S = (
    5.0  # after a fault is over, answers still in flight from it count in its window
)
RSS_SAMPLE_S = 5.0
IDLE_TIMEOUT_S = (
    60.0  # after the load, how long servers may take to finish what is in flight
)


@dataclass
class MemoryRow:
    """One process's resident memory over the time it was seen (a restart starts a new row)."""

    role: str
    pid: int
    first_at: float
    first_bytes: int
    last_at: float
    last_bytes: int
    max_bytes: int


@dataclass
class SoakResult:
    config: dict[str, Any]
    seconds: float
    records: list[Record]
    faults: list[FaultResult]
    memory: list[MemoryRow]
    kv: dict[
        str, dict[str, Any] | None
    ]  # server name -> its kv_cache figures at the end (None: unreadable)
    notes: list[str]
    died: list[str] = field(
        default_factory=list
    )  # processes that exited without being a fault's target

    def counts(self) -> Counter:
        return Counter(r.outcome for r in self.records)

    def windows(self) -> list[tuple[float, float]]:
        return [
            (f.injected_at, (f.ended_at or self.seconds) + WINDOW_GRACE_S)
            for f in self.faults
            if not f.skipped
        ]

    def server_errors(self) -> dict[str, int]:
        """5xx answers that reached a client: in fault windows vs quiet time."""
        split = {"fault_windows": 0, "quiet": 0}
        for r in self.records:
            if r.status is not None and r.status >= 500:
                inside = any(
                    r.started < end and r.ended > start for start, end in self.windows()
                )
                split["fault_windows" if inside else "quiet"] += 1
        return split

    def quiet_server_errors(self, top: int = 5) -> list[dict[str, Any]]:
        """The commonest 5xx of quiet time: target, status and message (numbers cut out, so one
        message from several workers or requests counts once), with how many."""
        windows = self.windows()
        seen: Counter = Counter()
        for r in self.records:
            if r.status is None or r.status < 500:
                continue
            if any(r.started < end and r.ended > start for start, end in windows):
                continue
            seen[(r.target, r.status, re.sub(r"\d+", "N", r.detail)[:160])] += 1
        return [
            {"target": t, "status": s, "message": m, "count": n}
            for (t, s, m), n in seen.most_common(top)
        ]

    def leaked_pages(self) -> dict[str, int | None]:
        return {name: (kv or {}).get("leaked_pages") for name, kv in self.kv.items()}

    def problems(self) -> list[str]:
        """Why the soak fails (empty: it passed)."""
        out = []
        counts = self.counts()
        for outcome in ("lost", "hung"):
            if counts[outcome]:
                out.append(f"{counts[outcome]} requests {outcome}")
        out += [f"{name} exited on its own during the soak" for name in self.died]
        for name, leaked in self.leaked_pages().items():
            kv = self.kv[name] or {}
            if leaked is None:
                out.append(
                    f"{name}: its KV page accounting could not be read at the end"
                )
            elif leaked:
                out.append(f"{name}: {leaked} KV pages leaked")
            if kv.get("running") or kv.get(
                "queued"
            ):  # held pages of a request nobody waits for
                out.append(
                    f"{name}: {kv['running']} requests running, {kv['queued']} queued after the load stopped"
                )
        return out

    def to_json(self) -> dict[str, Any]:
        counts = self.counts()
        by_kind = {
            k: dict(Counter(r.outcome for r in self.records if r.kind == k))
            for k in KINDS
        }
        by_target = {
            t: dict(Counter(r.outcome for r in self.records if r.target == t))
            for t in ("dp", "pd")
        }
        return {
            "config": self.config,
            "seconds": round(self.seconds, 1),
            "requests": {"sent": len(self.records), **{o: counts[o] for o in OUTCOMES}},
            "by_kind": by_kind,
            "by_target": by_target,
            "server_errors_5xx": self.server_errors(),
            "quiet_5xx_by_message": self.quiet_server_errors(),
            "faults": [dataclasses.asdict(f) for f in self.faults],
            "memory": [dataclasses.asdict(m) for m in self.memory],
            "kv": self.kv,
            "leaked_pages": self.leaked_pages(),
            "not_answered": [
                dataclasses.asdict(r)
                for r in self.records
                if r.outcome in ("lost", "hung", "failed")
            ],
            "notes": self.notes,
            "died": self.died,
            "problems": self.problems(),
        }


# ----------------------------------------------------------------- the run


def run_soak(config: SoakConfig, progress=print) -> SoakResult:
    cluster = Cluster.create(config.cluster)
    notes = [cluster.tmpfs_note] if config.cluster.l3 == "file" else []
    try:
        progress(
            f"soak: starting {len(cluster.all())} processes (logs in {config.cluster.run_dir}) ..."
        )
        cluster.start(config.startup_timeout_s)
        model, context_len = describe(cluster)
        progress(f"soak: model {model}, context {context_len} tokens; warming up ...")
        warm_up(cluster, model)
        return asyncio.run(_run(config, cluster, model, context_len, notes, progress))
    finally:
        cluster.close()


async def _run(
    config: SoakConfig,
    cluster: Cluster,
    model: str,
    context_len: int,
    notes: list[str],
    progress,
) -> SoakResult:
    t0 = time.monotonic()
    memory = MemoryTracker(cluster, t0)
    memory.sample()
    probe = HealthProbe(cluster)
    load = Load(
        config.load, cluster.router.url, cluster.pd_router.url, model, context_len, t0
    )
    injector = FaultInjector(
        cluster, probe, t0, config.stop_s, config.hold_s, config.startup_timeout_s
    )
    stop = asyncio.Event()
    tasks = [
        asyncio.ensure_future(probe.run()),
        asyncio.ensure_future(memory.run(stop)),
    ]
    load_task = asyncio.ensure_future(load.run(stop))
    progress(
        f"soak: {config.duration_s:.0f}s of load, faults: {', '.join(config.faults) or 'none'}"
    )
    reporter = asyncio.ensure_future(
        _report_progress(load, progress, config.duration_s)
    )
    faults = await injector.run(list(config.faults), config.duration_s)
    for f in faults:
        progress(
            f"soak: {f.name} on {f.target}: "
            + (f"skipped ({f.skipped})" if f.skipped else _fault_line(f))
        )
    await asyncio.sleep(max(0.0, config.duration_s - (time.monotonic() - t0)))
    stop.set()
    reporter.cancel()
    await load_task
    seconds = time.monotonic() - t0
    progress(
        f"soak: load stopped after {seconds:.0f}s; waiting for the servers to go idle ..."
    )
    died = [p.name for p in cluster.all() if not p.alive()]
    kv = await asyncio.to_thread(final_kv, cluster)
    memory.sample()
    probe.stopped = True
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
    cfg = {
        **dataclasses.asdict(config),
        "cluster": {
            **dataclasses.asdict(config.cluster),
            "run_dir": str(config.cluster.run_dir),
        },
    }
    return SoakResult(
        cfg, seconds, load.records, faults, memory.rows(), kv, notes, died
    )


def _host_tier(kv: dict[str, Any]) -> str:
    """The host tier's pages written / its size (MiB): engine memory that grows until it is full."""
    touched, total = kv.get("host_touched_bytes"), kv.get("host_bytes")
    if touched is None or not total:
        return "-"
    mib = 2**20
    return f"{touched / mib:.0f} of {total / mib:.0f}"


async def _report_progress(load: Load, progress, duration_s: float) -> None:
    while True:
        await asyncio.sleep(30.0)
        c = Counter(r.outcome for r in load.records)
        progress(
            f"soak: {load.now():.0f}/{duration_s:.0f}s  "
            + "  ".join(f"{o} {c[o]}" for o in OUTCOMES)
        )


def describe(cluster: Cluster) -> tuple[str, int]:
    """The model name clients send and the context length (for prompts that must not fit)."""
    model = httpx.get(cluster.router.url + "/v1/models", timeout=30).json()["data"][0][
        "id"
    ]
    info = httpx.get(cluster.replicas[0].url + "/get_server_info", timeout=30).json()
    return model, int(info["engine"]["context_len"])


def warm_up(cluster: Cluster, model: str) -> None:
    """One answer through each router (first requests pay one-off costs: grammar compiles, paths)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
    }
    for router in cluster.routers:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(router.url + "/v1/chat/completions", json=body, timeout=120)


def final_kv(cluster: Cluster) -> dict[str, dict[str, Any] | None]:
    """Each server's kv_cache figures once it has nothing running or queued (or IDLE_TIMEOUT_S passed)."""
    out: dict[str, dict[str, Any] | None] = {}
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    for p in cluster.servers:
        info = None
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                info = httpx.get(p.url + "/get_server_info", timeout=30).json()
                if (
                    info.get("num_running_reqs") == 0
                    and info.get("num_queue_reqs") == 0
                ):
                    break
            time.sleep(0.5)
        out[p.name] = (
            None
            if info is None
            else {
                **info["kv_cache"],
                "running": info.get("num_running_reqs"),
                "queued": info.get("num_queue_reqs"),
                # the host (L2) tier's pages written so far: resident memory it accounts for
                "host_touched_bytes": (info.get("hicache") or {}).get(
                    "host_touched_bytes"
                ),
                "host_bytes": (info.get("hicache") or {}).get("host_bytes"),
            }
        )
    return out


class MemoryTracker:
    """RSS of the routers and of each server's frontend and engine, sampled every RSS_SAMPLE_S."""

    def __init__(self, cluster: Cluster, t0: float):
        self.cluster = cluster
        self.t0 = t0
        self._rows: dict[tuple[str, int], MemoryRow] = {}

    def processes(self) -> list[tuple[str, int | None]]:
        out: list[tuple[str, int | None]] = [
            (p.name, p.pid) for p in self.cluster.routers
        ]
        for p in self.cluster.servers:
            out += [(f"{p.name} frontend", p.pid), (f"{p.name} engine", p.engine_pid)]
        return out

    def sample(self) -> None:
        now = time.monotonic() - self.t0
        for role, pid in self.processes():
            size = rss_bytes(pid)
            if pid is None or size is None:
                continue
            row = self._rows.get((role, pid))
            if row is None:
                self._rows[(role, pid)] = MemoryRow(
                    role, pid, now, size, now, size, size
                )
            else:
                row.last_at, row.last_bytes, row.max_bytes = (
                    now,
                    size,
                    max(row.max_bytes, size),
                )

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(RSS_SAMPLE_S)
            self.sample()

    def rows(self) -> list[MemoryRow]:
        return list(self._rows.values())


# ----------------------------------------------------------------- the report


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}s"


def _fault_line(f: FaultResult) -> str:
    if f.name in ("restart_redis", "fill_disk"):
        return f"/health bad for {f.unhealthy_while_it_should_not_s:.1f}s (should stay good)"
    return (
        f"unhealthy after: server {_s(f.server_unhealthy_after_s)}, router {_s(f.router_unhealthy_after_s)}; "
        f"back: server {_s(f.server_healthy_after_s)}, router {_s(f.router_healthy_after_s)}"
    )


def format_text(result: SoakResult) -> str:
    from strata.bench.report import table

    data = result.to_json()
    req = data["requests"]
    parts = [f"soak: {result.seconds:.0f}s", ""]
    parts.append(table([[k, str(v)] for k, v in req.items()], ["requests", "count"]))
    kind_rows = [
        [k, *(str(v.get(o, 0)) for o in OUTCOMES)] for k, v in data["by_kind"].items()
    ]
    parts += ["", table(kind_rows, ["kind", *OUTCOMES])]
    errs = data["server_errors_5xx"]
    parts += [
        "",
        f"5xx that reached a client: {errs['fault_windows']} in fault windows, {errs['quiet']} in quiet time",
    ]
    quiet = data["quiet_5xx_by_message"]
    if quiet:
        rows = [
            [q["target"], str(q["status"]), str(q["count"]), q["message"]]
            for q in quiet
        ]
        parts += ["", table(rows, ["target", "status", "count", "quiet-time 5xx"])]
    fault_rows = [
        [
            f.name,
            f.target,
            f"{f.injected_at:.0f}",
            "skipped: " + f.skipped if f.skipped else _fault_line(f),
        ]
        for f in result.faults
    ]
    if fault_rows:
        parts += [
            "",
            table(fault_rows, ["fault", "target", "at s", "/health telling the truth"]),
        ]
    mib = 2**20
    mem_rows = [
        [
            m.role,
            str(m.pid),
            f"{m.first_bytes / mib:.0f}",
            f"{m.last_bytes / mib:.0f}",
            f"{(m.last_bytes - m.first_bytes) / mib:+.0f}",
            f"{m.max_bytes / mib:.0f}",
            f"{m.last_at - m.first_at:.0f}",
        ]
        for m in result.memory
    ]
    parts += [
        "",
        table(
            mem_rows,
            ["process", "pid", "RSS first MiB", "last MiB", "drift", "max", "over s"],
        ),
    ]
    kv_rows = [
        [name, "n/a"]
        if kv is None
        else [
            name,
            str(kv.get("leaked_pages")),
            f"{kv['free_pages']}/{kv['total_pages']}",
            _host_tier(kv),
        ]
        for name, kv in result.kv.items()
    ]
    kv_rows = [r + [""] * (4 - len(r)) for r in kv_rows]
    header = ["server", "leaked KV pages", "free/total pages", "L2 written MiB"]
    parts += ["", table(kv_rows, header)]
    for note in result.notes + [n for f in result.faults for n in f.notes]:
        parts.append(f"note: {note}")
    shown = [r for r in result.records if r.outcome in ("lost", "hung")][:20]
    if shown:
        parts += ["", "lost / hung (first 20):"]
        parts += [
            f"  {r.started:7.1f}s {r.target} {r.kind} [{r.status}] {r.outcome}: {r.detail}"
            for r in shown
        ]
    problems = result.problems()
    parts += [
        "",
        "FAILED: " + "; ".join(problems)
        if problems
        else "PASSED: nothing lost, hung or leaked",
    ]
    return "\n".join(parts)


# ----------------------------------------------------------------- the command


def cmd(args) -> int:
    """`strata bench soak` (flags: cli.py's _add_soak_args): run, print, write JSON; 1 on any problem."""
    import sys

    from strata.bench.report import write_json

    run_dir = (
        Path(args.log_dir)
        if args.log_dir
        else Path(tempfile.mkdtemp(prefix="strata-soak-"))
    )
    load = LoadConfig(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        request_timeout_s=args.request_timeout,
        pd_share=args.pd_share,
        seed=args.seed,
    )
    cluster = ClusterConfig(
        model=args.model,
        run_dir=run_dir,
        server_args=tuple(args.server_args),
        router_args=tuple(args.router_args),
        l3=args.l3,
        l3_tmpfs_mib=args.l3_tmpfs_mib,
    )
    config = SoakConfig(
        duration_s=args.duration,
        faults=tuple(args.faults),
        stop_s=args.stop_seconds,
        hold_s=args.hold_seconds,
        startup_timeout_s=args.startup_timeout,
        load=load,
        cluster=cluster,
    )

    def stop(
        signum, frame
    ):  # SIGTERM: unwind like ^C, so every started process is stopped and the tmpfs unmounted
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        result = run_soak(
            config, progress=lambda line: print(line, file=sys.stderr, flush=True)
        )
    except RuntimeError as exc:  # the cluster did not come up
        print(f"error: {exc}\nlogs: {run_dir}", file=sys.stderr)
        return 1
    print(format_text(result), flush=True)
    if args.output_json:
        write_json(args.output_json, "soak", result.to_json())
    failed = bool(result.problems())
    if failed or args.log_dir:
        print(f"logs: {run_dir}", file=sys.stderr)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if failed else 0
