"""Frame transport between workers. `KVTransport` is the interface an RDMA transport (Mooncake,
NIXL) would implement; `ZmqTransport` is the TCP one: one PULL inbox per worker, PUSH sockets
to peers opened on first use."""

from __future__ import annotations

from typing import Protocol

import zmq


class KVTransport(Protocol):
    endpoint: str  # where peers reach this worker's inbox

    def send(self, endpoint: str, frames: list[bytes]) -> None:
        """Queue frames to a peer's inbox; never blocks the caller (drops nothing while the peer lives)."""

    def recv(self) -> list[bytes] | None:
        """One received message's frames, or None when nothing is waiting."""

    def close(self) -> None: ...


class ZmqTransport:
    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.ctx = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.MAXMSGSIZE, 1 << 34)
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
            sock.connect(endpoint)
            self.peers[endpoint] = sock
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the peer is gone or far behind: the room times out on its side
            pass

    def recv(self) -> list[bytes] | None:
        try:
            return [bytes(f.buffer) for f in self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)]
        except zmq.Again:
            return None

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(0)
        self.inbox.close(0)


TRANSPORTS = {"zmq": ZmqTransport}
