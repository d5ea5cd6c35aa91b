"""The frontend's side of the engine socket: submit generations, route outputs back to them.

One `Generation` is one HTTP request: a list of jobs (a tokenized prompt + SamplingParams each);
job j with n samples becomes engine requests whose outputs arrive tagged with choice indices
j*n .. j*n+n-1. Iterating a Generation yields `(choice_index, RequestOutput)` until every choice
has finished; closing it (the client went away) aborts whatever is unfinished, which frees the KV.

    client.submit(gen, jobs) ──GenerateReq──▶ engine ──AddResult──▶ routes[engine_rid] = Route(gen, index)
                                             engine ──OutputBatch──▶ route.gen.queue.put((index, out))

A single reader task receives everything the engine sends; nothing here waits on the model except
the awaiting request itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from strata.engine.outputs import RequestOutput
from strata.sampling_params import SamplingParams
from strata.server import io
from strata.server.api_keys import current_key

DEFAULT_STALL_TIMEOUT_S = 5.0  # ServerConfig.health_stall_timeout's default
PROBE_AFTER_S = (
    1.0  # seconds of quiet before the watchdog asks the engine for its stats
)
CONTROL_TIMEOUT_S = 30.0  # a control message's answer (flush, stats)
# one EmbedReq's answer: a forward of up to EMBED_BATCH_TOKENS tokens, or of one long input
EMBED_TIMEOUT_S = 600.0
LORA_TIMEOUT_S = 300.0  # reading an adapter (a large one from slow storage)

logger = logging.getLogger(__name__)


class RequestRejected(Exception):
    """The engine refused a job (invalid parameters, too long, cannot fit): a 400 for the client,
    or `status` (a LoRA adapter unknown: 404, all busy: 503)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineUnavailable(Exception):
    """The engine is not ready yet, or has died: a 503 for the client."""


@dataclass
class Job:
    input_ids: list[int]
    params: SamplingParams
    bootstrap_room: int | None = None  # PD disaggregation (see io.GenerateReq)
    bootstrap_addr: str | None = None
    lora: str | None = None  # the LoRA adapter it runs under (None: the base model)


@dataclass
class Route:
    """Where one engine request's outputs go, and its timings for the metrics."""

    gen: Generation
    index: int
    first_output_at: float | None = None
    last_output_at: float | None = None


class Generation:
    """One client request's outputs, in arrival order."""

    def __init__(self, client: EngineClient, num_choices: int):
        self.client = client
        self.created = time.perf_counter()
        self.num_choices = num_choices
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self.unfinished: set[str] = set()  # engine rids
        self.pending_adds = 0
        self.closed = False
        self.num_finished = 0
        self.key = current_key.get()  # the API key's name it came with (None: no keys)

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.num_finished < self.num_choices:
            index, out = await self.queue.get()
            if out.finished:
                self.num_finished += 1
            yield index, out

    def close(self) -> None:
        """Abort every unfinished engine request of this generation (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self.unfinished:
            self.client.abort(sorted(self.unfinished))


@dataclass
class _PendingAdd:
    gen: Generation
    first_index: int
    num: int
    future: asyncio.Future[io.AddResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class EngineClient:
    """Owns the two ZMQ sockets (bound here; the engine connects) and the routing table."""

    def __init__(
        self,
        in_addr: str,
        out_addr: str,
        metrics=None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
    ):
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(in_addr)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.bind(out_addr)
        self.metrics = metrics
        self.info: io.EngineInfo | None = None
        self.stats = io.EngineStats()
        self.ready = asyncio.Event()
        self.failure: str | None = (
            None  # set once the engine failed or died; then nothing is served
        )
        self.on_failure: Callable[[str], None] | None = None
        self.routes: dict[str, Route] = {}
        self.pending_adds: dict[str, _PendingAdd] = {}
        self.pending_control: dict[int, asyncio.Future] = {}
        self.num_queued = (
            0  # engine requests submitted that have produced no output yet
        )
        self.num_aborted = 0
        self._control_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        # liveness: a loaded engine that sends nothing, not even a heartbeat, for stall_timeout
        # seconds is stopped or hung: /health says so
        self.stall_timeout = stall_timeout
        self.last_heard = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(
            self._read_loop(), name="engine-reader"
        )

    async def wait_ready(self) -> io.EngineInfo:
        await self.ready.wait()
        if self.info is None:
            raise EngineUnavailable(self.failure or "the engine is not running")
        return self.info

    async def close(self) -> None:
        if self.info is not None and self.failure is None:
            try:
                await asyncio.wait_for(self.push.send(io.encode(io.ShutdownReq())), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
        if self._reader is not None:
            self._reader.cancel()
        self.push.close(linger=200)
        self.pull.close(linger=0)
        self.ctx.term()

    def fail(self, message: str) -> None:
        """The engine is gone: every request in flight ends with an error, later ones get 503."""
        if self.failure is not None:
            return
        self.failure = message
        logger.error("%s", message)
        for rid, route in self.routes.items():
            route.gen.queue.put_nowait(
                (
                    route.index,
                    RequestOutput(
                        rid, [], "", True, finish_reason="error", error=message
                    ),
                )
            )
        self.routes.clear()
        for pending in self.pending_adds.values():
            if not pending.future.done():
                pending.future.set_exception(EngineUnavailable(message))
        self.pending_adds.clear()
        for fut in self.pending_control.values():
            if not fut.done():
                fut.set_exception(EngineUnavailable(message))
        self.pending_control.clear()
        self.num_queued = 0
        self.ready.set()
        if self.on_failure is not None:
            self.on_failure(message)

    @property
    def serving(self) -> bool:
        """The engine has loaded and not failed (what check_available checks, as a bool)."""
        return self.info is not None and self.failure is None

    def stalled(self) -> str | None:
        """Why the engine counts as unresponsive now (None: it is heard from).

        A thread of the engine process sends a Heartbeat every io.HEARTBEAT_S whatever the loop
        does, so silence for stall_timeout seconds means the process is stopped (SIGSTOP, a
        debugger) or hung whole; a long step alone is not a stall.
        """
        if not self.serving:
            return None
        silent = time.monotonic() - self.last_heard
        if silent < self.stall_timeout:
            return None
        return (
            f"the engine process has not been heard from for {silent:.0f}s "
            f"(stopped or hung; --health-stall-timeout is {self.stall_timeout:g}s)"
        )

    def check_available(self) -> None:
        if self.failure is not None:
            raise EngineUnavailable(self.failure)
        if self.info is None:
            raise EngineUnavailable(
                "the model is still loading; retry when GET /health returns 200"
            )

    # ------------------------------------------------------------------ requests

    async def submit(self, gen: Generation, jobs: list[Job]) -> None:
        """Send every job; return once the engine accepted all of them.

        Raises RequestRejected (nothing left running) if the engine refused any job.
        """
        self.check_available()
        rid_base = uuid.uuid4().hex
        rids = [
            f"{rid_base}-{j}" if len(jobs) > 1 else rid_base for j in range(len(jobs))
        ]
        try:  # encode all first: a job that cannot be sent must leave nothing registered or counted
            messages = [
                io.encode(
                    io.GenerateReq(
                        rid,
                        job.input_ids,
                        job.params,
                        job.bootstrap_room,
                        job.bootstrap_addr,
                        job.lora,
                    )
                )
                for rid, job in zip(rids, jobs)
            ]
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
            raise RequestRejected(f"invalid request: {exc}") from None
        pendings = []
        index = 0
        for rid, job, message in zip(rids, jobs, messages):
            pending = _PendingAdd(gen, index, job.params.n)
            self.pending_adds[rid] = pending
            pendings.append(pending)
            index += job.params.n
            self.num_queued += job.params.n
            gen.pending_adds += 1
            await self.push.send(message)
        errors = []
        status = 400
        for pending in pendings:
            result = await pending.future
            if result.error is not None:
                errors.append(result.error)
                status = result.status or status
        if errors:
            gen.close()
            raise RequestRejected(
                errors[0]
                if len(set(errors)) == 1
                else "; ".join(dict.fromkeys(errors)),
                status,
            )

    def abort(self, rids: list[str]) -> None:
        if self.failure is None and rids:
            self.push.send(
                io.encode(io.AbortReq(rids))
            )  # a PUSH with no HWM never blocks

    async def flush_cache(self) -> io.FlushCacheResult:
        return await self._control(io.FlushCacheReq)

    async def lora(self, name: str, path: str | None) -> io.LoRAResult:
        """Register (path given) or unregister a LoRA adapter in the engine."""
        result = await self._control(
            io.LoRAReq, timeout=LORA_TIMEOUT_S, name=name, path=path
        )
        assert isinstance(result, io.LoRAResult)
        return result

    async def fetch_stats(self, expert_load: bool = False) -> io.EngineStats:
        """The engine's full stats, now; `expert_load`: with a MoE model's per-expert counts."""
        return (await self._control(io.StatsReq, expert_load=expert_load)).stats

    async def embed(
        self,
        inputs: list[list[int]],
        pooling: str,
        normalize: bool,
        dimensions: int | None,
    ) -> io.EmbedResult:
        """Embeddings of tokenized inputs, computed by the engine between two steps."""
        result = await self._control(
            io.EmbedReq,
            timeout=EMBED_TIMEOUT_S,
            inputs=inputs,
            pooling=pooling,
            normalize=normalize,
            dimensions=dimensions,
        )
        assert isinstance(result, io.EmbedResult)
        return result

    async def _control(
        self, kind, timeout: float = CONTROL_TIMEOUT_S, **fields
    ) -> io.FlushCacheResult | io.StatsResult | io.EmbedResult | io.LoRAResult:
        self.check_available()
        req_id = next(self._control_ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending_control[req_id] = fut
        await self.push.send(io.encode(kind(req_id, **fields)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.pending_control.pop(req_id, None)

    # ------------------------------------------------------------------ the reader

    async def _read_loop(self) -> None:
        while True:
            data = await self.pull.recv(copy=False)
            self.last_heard = time.monotonic()
            try:
                message = io.decode_from_engine(data.buffer)
            except Exception:
                logger.exception("dropping a malformed message from the engine")
                continue
            try:
                self._dispatch(message)
            except Exception:
                logger.exception("failed to dispatch %s", type(message).__name__)
            # pyzmq returns a message that already arrived without suspending: while the engine runs
            # ahead, a reader that never yields holds the loop (no client's disconnect seen, no
            # streamed write, no /health) until the queue is empty
            await asyncio.sleep(0)

    def _dispatch(self, message: io.FromEngine) -> None:
        if isinstance(message, io.Heartbeat):
            pass  # the reader loop noted when the engine was last heard from
        elif isinstance(message, io.OutputBatch):
            self.stats = message.stats
            now = time.perf_counter()
            for out in message.outputs:
                self._route_output(out, now)
            if self.metrics is not None:
                self.metrics.on_stats(message.stats)
        elif isinstance(message, io.AddResult):
            self._on_add_result(message)
        elif isinstance(
            message,
            (io.FlushCacheResult, io.StatsResult, io.EmbedResult, io.LoRAResult),
        ):
            if isinstance(message, io.StatsResult):
                self.stats = message.stats
                if self.metrics is not None:
                    self.metrics.on_stats(message.stats)
            fut = self.pending_control.get(message.req_id)
            if fut is not None and not fut.done():
                fut.set_result(message)
        elif isinstance(message, io.EngineReady):
            self.info = message.info
            self.ready.set()
        elif isinstance(message, io.EngineFailed):
            self.fail(f"the engine failed: {message.message}")

    def _on_add_result(self, result: io.AddResult) -> None:
        pending = self.pending_adds.pop(result.rid, None)
        if pending is None:
            return
        gen = pending.gen
        gen.pending_adds -= 1
        if result.error is not None:
            self.num_queued -= pending.num
        else:
            # engine rids arrive in choice order; register them before any of their outputs is read
            for i, rid in enumerate(result.rids):
                self.routes[rid] = Route(gen, pending.first_index + i)
                gen.unfinished.add(rid)
            if gen.closed:  # the client left while we waited for this answer
                self.abort(result.rids)
        if not pending.future.done():
            pending.future.set_result(result)

    def _route_output(self, out: RequestOutput, now: float) -> None:
        route = self.routes.get(out.rid)
        if route is None:
            return  # e.g. a late output of a request that was failed already
        if route.first_output_at is None:
            route.first_output_at = now
            self.num_queued -= 1
        if self.metrics is not None:
            self.metrics.on_output(route, out, now)
        route.last_output_at = now
        if out.finished:
            del self.routes[out.rid]
            route.gen.unfinished.discard(out.rid)
            if out.finish_reason == "abort":
                self.num_aborted += 1
        if not route.gen.closed:
            route.gen.queue.put_nowait((route.index, out))
