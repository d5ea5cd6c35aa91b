"""The engine process's heartbeat: a thread that tells the frontend every io.HEARTBEAT_S that the
process runs, whatever the engine loop is doing.

It has its own PUSH socket (a ZMQ socket belongs to one thread) to the frontend's PULL. A
stopped or hung process sends none, and the frontend's /health turns 503 (EngineClient.stalled).
"""

from __future__ import annotations

import threading

import zmq

from strata.server import io


class Heartbeat:
    def __init__(self, ctx: zmq.Context, out_addr: str):
        self._ctx = ctx
        self._out_addr = out_addr
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
                try:
                    sock.send(io.encode(io.Heartbeat()), zmq.NOBLOCK)
                except zmq.Again:
                    pass
        finally:
            sock.close()
