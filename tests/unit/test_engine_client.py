"""The server's engine client: its reader must not hold the event loop while outputs queue up."""

from __future__ import annotations

import asyncio

import zmq

from strata.server import io
from strata.server.engine_client import EngineClient

BACKLOG = 2000


def test_a_backlog_of_engine_messages_leaves_the_loop_to_other_tasks(tmp_path):
    """A busy engine can run ahead of the server. While the reader drains what queued, the rest of
    the server (a client's disconnect, /health, streamed writes) must still get the loop: pyzmq
    hands back an already-received message without suspending, so a reader that never yields
    would hold the loop until the queue is empty."""

    async def run() -> tuple[int, int]:
        client = EngineClient(
            f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", stall_timeout=60
        )
        ctx = zmq.Context()
        engine = ctx.socket(zmq.PUSH)
        engine.connect(f"ipc://{tmp_path}/out")
        stats = io.encode(io.OutputBatch([], io.EngineStats(num_running=1)))
        for _ in range(BACKLOG - 1):
            engine.send(stats)
        engine.send(io.encode(io.OutputBatch([], io.EngineStats(num_running=7))))
        await asyncio.sleep(0.3)  # every message has reached the client's socket
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        other = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        start = ticks
        client.start()
        for _ in range(
            100 * BACKLOG
        ):  # bounded: a reader that stopped fails, not hangs
            if client.stats.num_running == 7:
                break
            await asyncio.sleep(0)
        assert client.stats.num_running == 7, "the reader did not drain the backlog"
        drained_in = ticks - start
        other.cancel()
        engine.close(linger=0)
        ctx.term()
        await client.close()
        return drained_in, BACKLOG

    drained_in, backlog = asyncio.run(run())
    # the other task ran about once per message read; a reader holding the loop gives it one turn
    assert drained_in >= backlog // 2, drained_in
