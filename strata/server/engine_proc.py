"""The engine process: builds the Engine, then loops receiving messages and stepping the scheduler.

Started by `strata.server.launch` as `python -m strata.server.engine_proc`; the config (a frozen
EngineConfig, as JSON) arrives on stdin, never on the command line, which every local user can read
in /proc; the messages travel as msgspec (see io.py). Secrets of the config are scrubbed from the
engine's logs and from every error message it sends.

Loop: drain every waiting message (add / abort / flush / stats / embed), run one `Engine.step()`
if there is work, push its outputs back in one OutputBatch. With no work it blocks on the socket
(waking once a second to check that its parent is alive) instead of spinning. A heartbeat thread
(heartbeat.py) reports to the frontend twice a second however long a step runs, so the frontend's
/health can tell a stopped or hung process from a busy one.

A request the engine rejects (invalid parameters, prompt too long, can never fit) gets an AddResult
with the error message; a step that raises fails the requests in flight with an error output and
the engine keeps serving. The process ignores SIGINT/SIGTERM: the frontend decides when it stops
(ShutdownReq, after its grace period), and the kernel kills it if the frontend dies.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback

import zmq

from strata.config import EngineConfig
from strata.distributed.errors import RankFailure
from strata.engine.outputs import RequestOutput
from strata.process import die_with_parent, settle_heap
from strata.redact import install_log_redaction, scrub, secret_values
from strata.server import io
from strata.server.heartbeat import Heartbeat

logger = logging.getLogger("strata.engine_proc")

IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent still lives
BACKGROUND_POLL_MS = 1  # the pause between steps that can only make background progress
MAX_CONSECUTIVE_STEP_FAILURES = (
    3  # then the engine gives up and exits (the frontend reports it)
)


class EngineLoop:
    def __init__(
        self,
        engine,
        pull: zmq.Socket,
        push: zmq.Socket,
        parent_pid: int,
        secrets: list[str],
    ):
        self.engine = engine
        self.secrets = secrets
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.live: set[str] = set()  # engine rids added and not yet reported finished
        self.stopping = False
        self.step_failures = 0

    def send(self, message: io.FromEngine) -> None:
        self.push.send(io.encode(message), copy=False)

    def stats(self, full: bool = False, expert_load: bool = False) -> io.EngineStats:
        """The engine's load (`Engine.stats`); `full` (on request) also walks the prefix cache
        for the window groups' pages and checks their accounting, and summarises a MoE model's
        expert load; `expert_load` adds the counts themselves."""
        return io.EngineStats(**self.engine.stats(full=full, expert_load=expert_load))

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        while not self.stopping:
            if not self.engine.has_work() and not self.pull.poll(IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("the server process is gone; engine exiting")
                    return
                if not self.ranks_alive():
                    return
                continue
            if not self.engine.has_requests():
                # only background work is pending (a PD KV transfer, an L3 prefetch): wait a little
                # for a message instead of spinning on empty steps
                self.pull.poll(BACKGROUND_POLL_MS)
            self.drain()
            if not self.stopping and self.engine.has_work():
                self.step()

    def drain(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                message = io.decode_to_engine(data.buffer)
            # a malformed message is the frontend's bug; never die of it
            except Exception as exc:  # noqa: BLE001
                self.reject_undecodable(data.buffer, exc)
                continue
            self.handle(message)
            if self.stopping:
                return

    def reject_undecodable(self, data: memoryview, exc: Exception) -> None:
        """Answer a submission the engine cannot decode with an error (its sender waits for one);
        anything else undecodable is logged and dropped."""
        rid = io.request_id_of(data)
        if rid is None:
            logger.error("dropping a malformed message: %s", exc)
            return
        logger.warning(
            "rejecting request %s: its message could not be decoded: %s", rid, exc
        )
        self.send(
            io.AddResult(
                rid, [], f"invalid request: the engine could not decode it ({exc})"
            )
        )

    def handle(self, message: io.ToEngine) -> None:
        if isinstance(message, io.GenerateReq):
            self.add(message)
        elif isinstance(message, io.AbortReq):
            for rid in message.rids:
                self.engine.abort(rid)
        elif isinstance(message, io.StatsReq):
            self.send(
                io.StatsResult(
                    message.req_id,
                    self.stats(full=True, expert_load=message.expert_load),
                )
            )
        elif isinstance(message, io.FlushCacheReq):
            self.send(self.flush_cache(message.req_id))
        elif isinstance(message, io.EmbedReq):
            self.send(self.embed(message))
        elif isinstance(message, io.LoRAReq):
            self.send(self.lora(message))
        elif isinstance(message, io.ShutdownReq):
            self.stopping = True

    def add(self, req: io.GenerateReq) -> None:
        try:
            rids = self.engine.add_request(
                req.input_ids,
                req.params,
                req.rid,
                bootstrap_room=req.bootstrap_room,
                bootstrap_addr=req.bootstrap_addr,
                buffer_outputs=False,  # the server streams outputs as they come
                lora=req.lora,
            )
        except ValueError as exc:  # a LoRAError carries its own status (404, 503)
            status = getattr(exc, "status", None)
            self.send(io.AddResult(req.rid, [], str(exc), status=status))
            return
        except (
            Exception
        ) as exc:  # e.g. a seed torch cannot take: still the request's fault, not ours
            logger.exception("rejecting request %s", req.rid)
            self.send(
                io.AddResult(
                    req.rid, [], scrub(f"invalid request: {exc}", self.secrets)
                )
            )
            return
        self.live.update(rids)
        self.send(io.AddResult(req.rid, rids))

    def lora(self, req: io.LoRAReq) -> io.LoRAResult:
        """Register (with a path) or unregister an adapter, between two steps."""
        manager = self.engine.lora
        if manager is None:
            return io.LoRAResult(
                req.req_id,
                False,
                "this server serves no LoRA adapters; start it with --enable-lora",
                400,
            )
        try:
            if req.path is not None:
                entry = manager.register(req.name, req.path)
                message = f"LoRA adapter {req.name!r} loaded (rank {entry.rank})"
            else:
                manager.unregister(req.name)
                message = f"LoRA adapter {req.name!r} unloaded"
        except (
            ValueError,
            OSError,
        ) as exc:  # LoRAError (its status), or the adapter's files
            status = getattr(exc, "status", 400)
            return io.LoRAResult(req.req_id, False, str(exc), status, manager.names())
        return io.LoRAResult(req.req_id, True, message, 200, manager.names())

    def flush_cache(self, req_id: int) -> io.FlushCacheResult:
        load = self.engine.stats()
        running, waiting = load["num_running"], load["num_waiting"]
        if running or waiting:
            return io.FlushCacheResult(
                req_id,
                False,
                f"cannot flush the cache while requests are in flight ({running} running, "
                f"{waiting} waiting); retry when the server is idle",
            )
        num_pages = load["num_cached_pages"]
        try:
            self.engine.flush_cache()  # the radix tree and, with --enable-hierarchical-cache, L2
        except RuntimeError as exc:
            return io.FlushCacheResult(req_id, False, str(exc))
        return io.FlushCacheResult(req_id, True, f"flushed {num_pages} cached pages")

    def embed(self, req: io.EmbedReq) -> io.EmbedResult:
        """Embed between two steps (a scratch KV pool: the requests in flight are untouched)."""
        try:
            vectors = self.engine.embed(
                req.inputs,
                req.pooling,
                normalize=req.normalize,
                dimensions=req.dimensions,
            )
        except ValueError as exc:
            return io.EmbedResult(req.req_id, [], str(exc))
        except Exception as exc:  # a failed embedding fails that request alone
            logger.exception("embedding %d inputs failed", len(req.inputs))
            message = f"internal engine error: {type(exc).__name__}: {exc}"
            return io.EmbedResult(
                req.req_id, [], scrub(message, self.secrets), internal=True
            )
        return io.EmbedResult(req.req_id, [v.astype("<f4").tobytes() for v in vectors])

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.step_failures += 1
            logger.exception("engine step failed (%d in a row)", self.step_failures)
            outputs = self.fail_live(
                scrub(
                    f"internal engine error: {type(exc).__name__}: {exc}", self.secrets
                )
            )
            if isinstance(
                exc, RankFailure
            ):  # a parallel rank is gone: no later step can run
                self.send(io.OutputBatch(outputs, self.stats()))
                self.send(io.EngineFailed(scrub(str(exc), self.secrets)))
                self.stopping = True
                return
            if self.step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                self.send(io.OutputBatch(outputs, self.stats()))
                message = (
                    f"the engine failed {self.step_failures} steps in a row: {exc}"
                )
                self.send(io.EngineFailed(scrub(message, self.secrets)))
                self.stopping = True
                return
        else:
            self.step_failures = 0
        for out in outputs:
            if out.finished:
                self.live.discard(out.rid)
        if outputs or not self.engine.has_work():
            self.send(io.OutputBatch(outputs, self.stats()))

    def ranks_alive(self) -> bool:
        """Tensor/expert parallel: False (after failing the requests in flight and telling the
        frontend, whose health check then fails) once a worker rank has died."""
        parallel = getattr(self.engine, "parallel", None)
        if parallel is None or parallel.healthy:
            return True
        message = f"a tensor/expert-parallel rank is gone: {parallel.failed}; restart the server"
        self.send(io.OutputBatch(self.fail_live(message), self.stats()))
        self.send(io.EngineFailed(scrub(message, self.secrets)))
        self.stopping = True
        return False

    def fail_live(self, message: str) -> list[RequestOutput]:
        """Abort every request in flight and report each as failed with `message`."""
        failed = []
        for rid in sorted(self.live):
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            failed.append(
                RequestOutput(rid, [], "", True, finish_reason="error", error=message)
            )
        self.live.clear()
        self.engine.discard_pending_outputs()  # the aborts' own outputs: reported above
        return failed


def engine_info(engine) -> io.EngineInfo:
    from strata.kernels import describe_kernels

    st = engine.state
    tok = engine.tokenizer
    return io.EngineInfo(
        pid=os.getpid(),
        model_dir=str(st.model_dir),
        architecture=st.model_config.architecture,
        vocab_size=st.model_config.vocab_size,
        context_len=st.context_len,
        num_kv_tokens=st.num_kv_tokens,
        page_size=engine.config.page_size,
        dtype=str(st.dtype).removeprefix("torch."),
        kv_dtype=str(st.kv_dtype).removeprefix("torch."),
        device=str(st.device),
        kv_reason=st.kv_reason,
        load_seconds=st.load_seconds,
        eos_token_ids=sorted(st.eos_token_ids),
        bos_token_id=(tok.bos_token_id if tok is not None else None)
        or st.model_config.bos_token_id,
        disaggregation_mode=getattr(engine.config, "disaggregation_mode", "null"),
        bootstrap_addr=getattr(
            engine, "disagg_endpoint", None
        ),  # a property: host:port or None
        dtype_reason=st.dtype_reason,
        weights=st.weights,
        kernels=describe_kernels(st.kernels),
        decode_loop=st.decode_loop,
        kv_groups=st.kv_groups,
        kv_bytes=st.kv_bytes,
        num_experts=st.model_config.moe.num_experts
        if st.model_config.moe is not None
        else 0,
        hidden_size=st.model_config.hidden_size,
        lora_enabled=engine.lora is not None,
        lora_adapters=engine.lora.names() if engine.lora is not None else [],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Strata engine process (started by `strata serve`)."
    )
    parser.add_argument(
        "--in-addr", required=True, help="ZMQ address the frontend pushes requests to"
    )
    parser.add_argument(
        "--out-addr", required=True, help="ZMQ address the frontend pulls outputs from"
    )
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(args.parent_pid)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )

    config_json = (
        sys.stdin.read()
    )  # EngineConfig fields as a JSON object, written by the server
    secrets: list[str] = []
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.connect(args.in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)  # never block the engine on a slow frontend
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(args.out_addr)
    try:
        from strata.engine.engine import Engine

        config = EngineConfig(**json.loads(config_json))
        secrets = secret_values(config)
        install_log_redaction(secrets)
        engine = Engine(**{f: getattr(config, f) for f in config.__dataclass_fields__})
        settle_heap()
        push.send(io.encode(io.EngineReady(engine_info(engine))))
    except Exception as exc:  # noqa: BLE001 -- whatever stops the load, the server must hear why
        logger.error("engine failed to start:\n%s", traceback.format_exc())
        push.send(
            io.encode(io.EngineFailed(scrub(f"{type(exc).__name__}: {exc}", secrets)))
        )
        push.close()  # lingers up to 2 s to deliver the message
        pull.close(linger=0)
        ctx.term()
        return 1
    loop = EngineLoop(engine, pull, push, args.parent_pid, secrets)
    heartbeat = Heartbeat(ctx, args.out_addr)
    heartbeat.start()
    try:
        loop.run()
    finally:
        heartbeat.stop()
        engine.close()  # background storage threads, PD sockets
    push.close()
    pull.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
