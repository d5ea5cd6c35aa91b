"""The engine process's heartbeat: a thread that tells the frontend every io.HEARTBEAT_S that the
process runs, and how long the step now running has run, whatever the engine loop is doing.

It has its own PUSH socket (a ZMQ socket belongs to one thread) to the frontend's PULL. A
stopped or hung process sends none, and the frontend's /health turns 503 (EngineClient.stalled).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from strata.server import io


class Heartbeat:
    def __init__(
        self, ctx: zmq.Context, out_addr: str, step_started: Callable[[], float | None]
    ):
        """`step_started`: the monotonic time the running step began, None between steps."""
        self._ctx = ctx
        self._out_addr = out_addr
        self._step_started = step_started
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="engine-heartbeat", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * io.HEARTBEAT_S)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 4)  # a frontend that reads nothing gets no backlog
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._out_addr)
        try:
            while not self._stop.wait(io.HEARTBEAT_S):
                started = self._step_started()
                beat = io.Heartbeat(
                    None if started is None else time.monotonic() - started
                )
                try:
                    sock.send(io.encode(beat), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close()
