"""KV payloads moved by Mooncake's transfer engine (`--disaggregation-transfer-backend mooncake`).

Control messages (Hello, KVFailed, and the KV header) still travel through the worker's ZMQ inbox;
only a KV message's payload frame goes through the transfer engine, pulled by the receiver:

    prefill: send(decode inbox, [header, payload])
        registers the payload with its transfer engine, sends [header, PULL, Pull(its engine's
        session, address, length, ticket, its own inbox)] through ZMQ
    decode:  recv() sees the Pull: checks the length against its cap, and a thread of its own
        reads the bytes from the prefill's engine into a buffer it registers for them;
        the next recv() returns [header, payload], as the built-in path would, and an Ack(ticket)
        goes back to the prefill's inbox, which then unregisters and drops the payload
        (unacknowledged payloads are dropped after `stage_ttl_s`)

The manager sees the same frames either way and checks them the same way (MAC over the header and
the payload, then every field against the room). What the transfer engine carries is not trusted:
a wrong or damaged payload fails its MAC. Both workers of a pair must use the same backend: a Pull
reaching a built-in inbox is three frames, rejected as malformed. Mooncake's TCP transport does not
authenticate peers, so, as with any Mooncake deployment, its ports belong on a private network.

Only the transfer engine is used (no store, no master): peers find each other's segments through
Mooncake's P2P handshake, so nothing else has to run.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import secrets
import threading
import time
from collections import deque
from typing import Annotated

import msgspec

from strata.disagg.zmq_transport import ZmqTransport

logger = logging.getLogger(__name__)

PULL = b"strata-mooncake-pull/1"  # the middle frame of a KV message whose payload is to be pulled
ACK = b"strata-mooncake-ack/1"  # [ACK, ticket]: the receiver has the payload; the sender may drop it
CHUNK_BYTES = 64 << 20  # the most one read asks of the peer
MAX_PENDING_PULLS = (
    256  # pulls queued at the receiver; more are dropped (their rooms time out)
)

Ticket = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class Pull(msgspec.Struct, forbid_unknown_fields=True):
    """Where the receiver reads a payload: `length` bytes at `address` in the engine `session`."""

    session: Annotated[
        str, msgspec.Meta(max_length=300, pattern=r"^[^\s/]+:[0-9]{1,5}$")
    ]  # host:rpc_port
    address: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    length: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
    ticket: Ticket
    ack_endpoint: Annotated[
        str, msgspec.Meta(max_length=300, pattern=r"^tcp://[^\s/]+:[0-9]{1,5}$")
    ]


_pull_decoder = msgspec.msgpack.Decoder(Pull)
_ticket_decoder = msgspec.msgpack.Decoder(Ticket)
_encoder = msgspec.msgpack.Encoder()


def new_transfer_engine(host: str):
    """A TCP transfer engine on `host` with a free RPC port, found by P2P handshake (no metadata service)."""
    try:
        from mooncake.engine import TransferEngine
    except (
        ImportError
    ) as exc:  # the package, or a native library it loads (libibverbs.so.1)
        raise ValueError(
            "--disaggregation-transfer-backend mooncake needs Mooncake: `pip install 'strata[mooncake]'` "
            "(mooncake-transfer-engine-non-cuda, Linux x86_64; it loads libibverbs.so.1, apt: libibverbs1); "
            f"or use the built-in tcp backend ({exc})"
        ) from exc
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise ValueError(
            f"Mooncake's transfer engine did not start on {host} (initialize returned {rc})"
        )
    return engine


class MooncakeTransport:
    """A `KVTransport`: ZMQ for the messages, Mooncake's transfer engine for KV payloads."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_payload_bytes: int = 0,
        stage_ttl_s: float = 120.0,
    ):
        self.zmq = ZmqTransport(host, port, max_payload_bytes=max_payload_bytes)
        self.endpoint = self.zmq.endpoint
        self.max_payload_bytes = max_payload_bytes
        self.stage_ttl_s = stage_ttl_s
        self.engine = new_transfer_engine(host)
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        # sender: payloads registered for peers to pull, by ticket: (address, payload, staged at)
        self.staged: dict[str, tuple[int, bytes, float]] = {}
        # receiver: pulls waiting for the puller thread; finished ones, with the ack to send
        self.pulls: queue.Queue[tuple[bytes, Pull] | None] = queue.Queue(
            MAX_PENDING_PULLS
        )
        self.pulled: deque[tuple[list[bytes], Pull]] = deque()
        self.stats = {"pulled_bytes": 0, "pull_failures": 0, "staged_bytes": 0}
        self._puller: threading.Thread | None = None

    # ------------------------------------------------------------------ sending (prefill side)

    def send(self, endpoint: str, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return self.zmq.send(endpoint, frames)
        header, payload = frames
        payload = bytes(payload)
        address = ctypes.cast(ctypes.c_char_p(payload), ctypes.c_void_p).value or 0
        rc = self.engine.register_memory(address, len(payload)) if payload else -1
        if rc != 0:
            logger.warning(
                "PD: cannot register %d bytes of KV with the transfer engine (code %d); dropping "
                "the message (the room times out on the decode side)",
                len(payload),
                rc,
            )
            return None
        ticket = secrets.token_hex(16)
        self.staged[ticket] = (address, payload, time.monotonic())
        self.stats["staged_bytes"] += len(payload)
        pull = Pull(self.session, address, len(payload), ticket, self.endpoint)
        self.zmq.send(endpoint, [header, PULL, _encoder.encode(pull)])
        return None

    def _unstage(self, ticket: str) -> None:
        staged = self.staged.pop(ticket, None)
        if staged is not None:
            self.engine.unregister_memory(staged[0])
            self.stats["staged_bytes"] -= len(staged[1])

    def _expire_staged(self) -> None:
        now = time.monotonic()
        for ticket in [
            t for t, (_, _, at) in self.staged.items() if now - at > self.stage_ttl_s
        ]:
            self._unstage(ticket)

    # ------------------------------------------------------------------ receiving

    def recv(self) -> list[bytes] | None:
        self._expire_staged()
        while True:
            if self.pulled:
                frames, pull = self.pulled.popleft()
                self.zmq.send(pull.ack_endpoint, [ACK, _encoder.encode(pull.ticket)])
                return frames
            frames = self.zmq.recv()
            if frames is None:
                return None
            if len(frames) == 2 and frames[0] == ACK:
                self._on_ack(frames[1])
            elif len(frames) == 3 and frames[1] == PULL:
                self._on_pull(frames[0], frames[2])
            else:
                return frames  # a message without a payload to pull (or a malformed one: the manager's)

    def _on_ack(self, data: bytes) -> None:
        try:
            self._unstage(_ticket_decoder.decode(data))
        except msgspec.DecodeError:
            pass

    def _on_pull(self, header: bytes, data: bytes) -> None:
        try:
            pull = _pull_decoder.decode(data)
        except msgspec.DecodeError:
            logger.warning(
                "PD: dropping a KV message whose pull descriptor does not decode"
            )
            return
        if (
            pull.length > self.max_payload_bytes
        ):  # the cap the built-in inbox puts on a payload frame
            logger.warning(
                "PD: dropping a KV message of %d bytes; this worker accepts at most %d",
                pull.length,
                self.max_payload_bytes,
            )
            return
        if self._puller is None:
            self._puller = threading.Thread(
                target=self._pull_loop, name="strata-pd-mooncake-pull", daemon=True
            )
            self._puller.start()
        try:
            self.pulls.put_nowait((header, pull))
        except queue.Full:
            logger.warning(
                "PD: %d KV pulls are queued already; dropping one (its room times out)",
                MAX_PENDING_PULLS,
            )

    def _pull_loop(self) -> None:
        while (item := self.pulls.get()) is not None:
            header, pull = item
            try:
                payload = self._read(pull)
            except Exception:  # a bug here must not stop every later transfer
                logger.exception("PD: pulling KV from %s failed", pull.session)
                payload = None
            if payload is None:
                self.stats["pull_failures"] += 1
                continue
            self.stats["pulled_bytes"] += len(payload)
            self.pulled.append(([header, payload], pull))

    def _read(self, pull: Pull) -> bytes | None:
        """The payload, read straight into a registered buffer; None if the peer fails."""
        out = bytearray(pull.length)
        local = ctypes.addressof((ctypes.c_char * pull.length).from_buffer(out))
        if self.engine.register_memory(local, pull.length) != 0:
            logger.warning(
                "PD: cannot register a %d-byte receive buffer with the transfer engine",
                pull.length,
            )
            return None
        try:
            for offset in range(0, pull.length, CHUNK_BYTES):
                n = min(CHUNK_BYTES, pull.length - offset)
                rc = self.engine.transfer_sync_read(
                    pull.session, local + offset, pull.address + offset, n
                )
                if rc != 0:
                    logger.warning(
                        "PD: reading %d bytes of KV from the transfer engine at %s failed (code %d); "
                        "the room will time out",
                        pull.length,
                        pull.session,
                        rc,
                    )
                    return None
        finally:
            self.engine.unregister_memory(local)
        return bytes(out)

    def close(self) -> None:
        if self._puller is not None:
            self.pulls.put(None)
            self._puller.join(timeout=5)
        for ticket in list(self.staged):
            self._unstage(ticket)
        self.zmq.close()
