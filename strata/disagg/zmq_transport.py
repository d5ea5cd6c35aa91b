"""The `KVTransport` interface and `ZmqTransport`, the `tcp` backend, which the other backends build
on (strata.disagg.transport names them all).

Anyone who can reach the inbox can send to it, so it bounds what it reads before any MAC is
checked: a frame larger than the largest legitimate one is never read (ZMQ drops it and the
connection), and of a message with too many frames only the first `MAX_FRAMES + 1` are kept, so
the receiver sees the excess and rejects the message.
"""

from __future__ import annotations

import logging
from typing import Protocol

import zmq

from strata.disagg.protocol import MAX_FRAMES, MAX_HEADER_BYTES

logger = logging.getLogger(__name__)


class KVTransport(Protocol):
    endpoint: str  # where peers reach this worker's inbox

    def send(self, endpoint: str, frames: list[bytes]) -> None:
        """Queue frames to a peer's inbox; never blocks or raises (a bad endpoint or a peer far
        behind drops the message, and the room times out on the peer's side)."""

    def recv(self) -> list[bytes] | None:
        """One received message's frames (at most MAX_FRAMES + 1 of them, none larger than the
        inbox's cap), or None when nothing is waiting."""

    def close(self) -> None: ...


class ZmqTransport:
    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, max_payload_bytes: int = 0
    ):
        """`max_payload_bytes`: the largest KV payload this worker accepts (0 on a prefill worker,
        which only receives headers)."""
        self.ctx = zmq.Context.instance()
        self.max_frame_bytes = max(max_payload_bytes, MAX_HEADER_BYTES)
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # per frame
        if port:
            self.inbox.bind(f"tcp://{host}:{port}")
        else:
            port = self.inbox.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.peers: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, frames: list[bytes]) -> None:
        sock = self.peers.get(endpoint)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 64)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                sock.close(0)
                logger.warning(
                    "PD: cannot reach peer %r (%s); dropping the message",
                    endpoint[:300],
                    exc,
                )
                return
            self.peers[endpoint] = sock
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except (
            zmq.Again
        ):  # the peer is gone or far behind: the room times out on its side
            pass

    def recv(self) -> list[bytes] | None:
        try:
            first = self.inbox.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [bytes(first.buffer)]
        more = first.more
        while more:  # a message arrives whole, so its other frames are here already
            frame = self.inbox.recv(copy=False)
            if len(frames) <= MAX_FRAMES:
                frames.append(bytes(frame.buffer))
            more = frame.more
        return frames

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(0)
        self.inbox.close(0)
