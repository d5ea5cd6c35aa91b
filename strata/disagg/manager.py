"""Per-room state on each side of a prefill/decode pair. Each side is the scheduler's
`KVTransferPeer` (strata.engine.hooks): it runs on the scheduler thread, polled once per step;
nothing here blocks, and nothing a peer sends raises out of poll(): a message that fails a check is
counted in stats["rejected"] and dropped. It acts on the scheduler only through the scheduler's
public request operations.

Prefill side, per room:  announced (request arrived) ─▶ KV ready (prefill finished, KV copied out)
                         + Hello from the decode worker ─▶ KV sent ─▶ done
Decode side, per room:   bootstrapping (reserving pages) ─▶ waiting (Hello sent) ─▶ KV installed,
                         request decodes ─▶ done;  any side's timeout or KVFailed ─▶ failed,
                         with the reserved pages freed and a clear error for the request

What each side accepts (see protocol.py for the MAC and the field constraints):
  prefill  only a Hello with a valid MAC; the first one for a room wins; the KV goes out only if the
           Hello's prompt digest is the one of the prompt this worker computed (else KVFailed).
  decode   only a KVHeader or KVFailed for a room waiting here, echoing that room's nonce, with a
           valid MAC. Such a message comes from a peer holding the secret, so when its KV does not
           fit (prompt_len, dtype, shape, payload size, first token, first logprob) that room fails
           with a clear error; every other room goes on.
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch

from strata.cache.kv_pool import KVPool, tensor_bytes
from strata.disagg import protocol
from strata.disagg.auth import MAX_ROOM
from strata.disagg.zmq_transport import KVTransport
from strata.engine.request import Req, TokenLogprob
from strata.sampling_params import SamplingParams

if TYPE_CHECKING:
    from strata.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# how a decode request whose prefill side failed is answered: 503 (retry), not the 500 of a worker
# that broke, so a router's circuit breaker does not hold it against the decode worker
PEER_FAILED = 503

MAX_EARLY_HELLOS = (
    4096  # Hellos kept for rooms whose request has not reached the prefill worker yet
)
_BOOTSTRAP_ADDR = re.compile(r"(tcp://)?(\[[0-9a-fA-F:.]+\]|[^\s/:\[\]]+):([0-9]{1,5})")


def kv_shape(kv: KVPool, num_tokens: int) -> list[int]:
    """The shape of num_tokens positions' KV as sent: [layers, parts, num_tokens, heads, dim] (MHA:
    parts K and V, the KV heads; MLA: one latent row, parts and heads 1)."""
    layers, parts, _, heads, dim = kv.page_shape
    return [layers, parts, num_tokens, heads, dim]


def gather_kv(kv: KVPool, pages: list[int], num_tokens: int) -> torch.Tensor:
    """KV of a request's first num_tokens positions: `kv_shape(kv, num_tokens)`.

    A window layer's positions before its window were given back and read as zeros; the decode
    worker never reads them either (it resumes at num_tokens and reads the last W - 1 at most)."""
    ps = kv.page_size
    data, _ = kv.read_pages(
        pages[: -(-num_tokens // ps)]
    )  # [n, layers, parts, ps, heads, dim]
    n, layers, parts, _, heads, dim = data.shape
    per_token = data.permute(1, 2, 0, 3, 4, 5).reshape(
        layers, parts, n * ps, heads, dim
    )
    return per_token[:, :, :num_tokens].contiguous()


def install_kv(kv: KVPool, pages: list[int], data: torch.Tensor) -> None:
    """Write `gather_kv` data [layers, parts, num_tokens, heads, dim] into a request's pages."""
    ps = kv.page_size
    layers, parts, num_tokens, heads, dim = data.shape
    n = -(-num_tokens // ps)
    padded = data.new_zeros((layers, parts, n * ps, heads, dim))
    padded[:, :, :num_tokens] = data
    kv.write_pages(
        pages[:n],
        padded.view(layers, parts, n, ps, heads, dim).permute(2, 0, 1, 3, 4, 5),
    )


# --------------------------------------------------------------------------- prefill side


@dataclass
class _PrefillRoom:
    rid: str
    created: float
    hello: protocol.Hello | None = None
    # once the prefill finished: the KV header (its nonce comes from the Hello), payload, prompt digest
    header: protocol.KVHeader | None = None
    payload: bytes = b""
    prompt_digest: str = ""
    failed: str | None = None


class _Side:
    """What both sides hold: the scheduler and KV pool they serve, the transport, the shared secret,
    the KV-layout namespace both must agree on, and how long a room may wait for its peer.

    Attaches itself to the scheduler as its `KVTransferPeer`."""

    mode = ""  # "prefill" or "decode": the --disaggregation-mode this side serves
    rooms: dict[int, Any]  # the transfers under way, by bootstrap room

    def __init__(
        self,
        scheduler: Scheduler,
        kv: KVPool,
        transport: KVTransport,
        secret: bytes,
        namespace: str,
        timeout_s: float = 30.0,
    ):
        self.scheduler, self.kv, self.transport = scheduler, kv, transport
        self.secret, self.namespace, self.timeout_s = secret, namespace, timeout_s
        self.stats = {"rejected": 0}
        self._last_reject_log = -math.inf
        scheduler.attach_peer(self)

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        room: int | None,
        bootstrap: str | None,
    ) -> list[str]:
        """Accept a request the router sent with its `room` (and, to a decode worker, `bootstrap`:
        the prefill worker's host:port). Returns the engine rids created; raises ValueError (nothing
        held) if the request can never run here."""
        if room is None:
            raise ValueError(
                f"this is a disaggregated {self.mode} worker: requests need a bootstrap_room (send them via the router)"
            )
        return self._add(rid, prompt_ids, params, room, bootstrap)

    def _add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        room: int,
        bootstrap: str | None,
    ) -> list[str]:
        raise NotImplementedError

    def poll(self) -> None:
        raise NotImplementedError

    def busy(self) -> bool:
        return bool(self.rooms)

    def before_release(self, req: Req) -> None:
        """The scheduler releases a finished request's KV next (nothing to do on this side)."""

    def _receive_all(self) -> None:
        while (frames := self.transport.recv()) is not None:
            try:
                self._on_message(frames)
            except (
                Exception
            ):  # a bug in a check must not fail the step of every running request
                logger.exception("PD: dropping a message that could not be handled")
                self.stats["rejected"] += 1

    def _on_message(self, frames: list[bytes]) -> None:
        raise NotImplementedError

    def _parse(self, frames: list[bytes]) -> protocol.Message | None:
        """The message, if well formed: a bounded header that decodes, with exactly its frames."""
        if not frames or len(frames[0]) > protocol.MAX_HEADER_BYTES:
            return None
        try:
            msg = protocol.decode(frames[0])
        except msgspec.DecodeError:
            return None
        return (
            msg
            if len(frames) == (2 if isinstance(msg, protocol.KVHeader) else 1)
            else None
        )

    def _reject(self, why: str) -> None:
        self.stats["rejected"] += 1
        now = time.monotonic()
        if (
            now - self._last_reject_log > 10
        ):  # a flood of junk must not flood the log too
            logger.warning(
                "PD: rejected a message (%s); %d rejected so far",
                why,
                self.stats["rejected"],
            )
            self._last_reject_log = now


def _malformed(frames: list[bytes]) -> str:
    if len(frames) == 3 and frames[1].startswith(
        b"strata-mooncake-"
    ):  # see mooncake_transport.py
        return (
            "malformed: KV to be pulled with Mooncake, which this worker's transport does not do; use the "
            "same --disaggregation-transfer-backend on both workers"
        )
    return "malformed"


def _check_room(room: int) -> None:
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < MAX_ROOM:
        raise ValueError(
            f"bootstrap_room must be an integer in [0, 2**63), got {room!r}"
        )


class PrefillManager(_Side):
    mode = "prefill"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, _PrefillRoom] = {}
        self.room_of: dict[str, int] = {}
        self.early_hellos: dict[
            int, tuple[float, protocol.Hello]
        ] = {}  # Hello before the request
        self.stats.update({"sent": 0, "failed": 0, "timed_out": 0, "bytes_sent": 0})

    def _add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        room: int,
        bootstrap: str | None,
    ) -> list[str]:
        """Queue the request to compute its prompt and first token, for `room`."""
        rids = self.scheduler.add_request(rid, prompt_ids, self.prefill_params(params))
        self.announce(rid, room)
        return rids

    def announce(self, rid: str, room: int) -> None:
        """The router sent request `rid` (queued just before) with `room`: only announced rooms are
        served. A room that is live already is refused: the new request is aborted and ValueError
        raised; the live room is untouched."""
        try:
            _check_room(room)
            if room in self.rooms:
                raise ValueError(
                    f"bootstrap room {room} is already in use by another request; "
                    "each request needs a fresh room (send requests through the router)"
                )
        except ValueError:
            self.scheduler.abort(rid)
            raise
        self.rooms[room] = _PrefillRoom(rid=rid, created=time.monotonic())
        self.room_of[rid] = room
        early = self.early_hellos.pop(room, None)
        if early is not None:
            self.rooms[room].hello = early[1]

    def prefill_params(self, params: SamplingParams) -> SamplingParams:
        """The prefill worker computes the prompt and one token; the decode worker does the rest."""
        return msgspec.structs.replace(params, max_new_tokens=1, min_new_tokens=0, n=1)

    def before_release(self, req: Req) -> None:
        """A finished prefill: copy its prompt's KV out for the room's decode worker."""
        room_id = self.room_of.pop(req.rid, None)
        if room_id is None or room_id not in self.rooms:
            return
        room = self.rooms[room_id]
        if req.finish_reason in ("abort", "error") or not req.output_ids:
            room.failed = req.error or f"prefill request ended: {req.finish_reason}"
            return
        n = len(req.prompt_ids)
        data = gather_kv(self.kv, req.pages, n)
        lp = req.pending_logprobs[0].logprob if req.pending_logprobs else None
        room.header = protocol.KVHeader(
            room=room_id,
            nonce="",
            prompt_len=n,
            first_token=req.output_ids[0],
            first_logprob=lp,
            dtype=str(data.dtype).removeprefix("torch."),
            shape=list(data.shape),
            cached_tokens=req.num_cached_tokens,
            cached_by_tier=dict(req.cached_tokens_by_tier),
        )
        room.payload = tensor_bytes(data)
        room.prompt_digest = protocol.prompt_digest(req.prompt_ids)

    def poll(self) -> None:
        self._receive_all()
        now = time.monotonic()
        for room_id, room in list(self.rooms.items()):
            if room.hello is not None and (
                room.header is not None or room.failed is not None
            ):
                self._deliver(room_id, room)
            elif now - room.created > self.timeout_s:
                logger.warning(
                    "PD room %d: no decode worker asked for it within %.0fs; dropping",
                    room_id,
                    self.timeout_s,
                )
                self.stats["timed_out"] += 1
                del self.rooms[room_id]
        for room_id, (t, _) in list(self.early_hellos.items()):
            if now - t > self.timeout_s:
                del self.early_hellos[room_id]

    def _on_message(self, frames: list[bytes]) -> None:
        msg = self._parse(frames)
        if msg is None:
            return self._reject(_malformed(frames))
        if not isinstance(msg, protocol.Hello):
            return self._reject(
                f"a prefill worker takes only Hello, got {type(msg).__name__}"
            )
        if not protocol.verify(msg, self.secret):
            return self._reject(
                "bad signature: is --disaggregation-secret the same on every worker?"
            )
        if msg.namespace != self.namespace:
            self._send_failed(
                msg, "prefill and decode workers serve different models or KV layouts"
            )
            return
        room = self.rooms.get(msg.room)
        if room is None:
            if (
                msg.room in self.early_hellos
                or len(self.early_hellos) >= MAX_EARLY_HELLOS
            ):
                return self._reject(
                    f"a second or one too many early Hello (room {msg.room})"
                )
            self.early_hellos[msg.room] = (time.monotonic(), msg)
        elif room.hello is None:
            room.hello = msg
        else:  # the first Hello of a room wins
            self._reject(f"a second Hello for room {msg.room}")

    def _send_failed(self, hello: protocol.Hello, reason: str) -> None:
        fail = protocol.KVFailed(
            hello.room, hello.nonce, protocol.failure_reason(reason)
        )
        self.transport.send(
            hello.kv_endpoint, [protocol.encode(protocol.sign(fail, self.secret))]
        )

    def _deliver(self, room_id: int, room: _PrefillRoom) -> None:
        hello = room.hello
        assert hello is not None
        if room.failed is None and not self._same_prompt(hello, room):
            assert room.header is not None
            room.failed = (
                f"the decode worker's prompt ({hello.prompt_len} tokens) is not the one this prefill worker "
                f"computed ({room.header.prompt_len} tokens); both must get the same request and tokenize "
                "it alike (same model and tokenizer)"
            )
        if room.failed is not None:
            self._send_failed(hello, room.failed)
            self.stats["failed"] += 1
        else:
            assert room.header is not None
            header = msgspec.structs.replace(room.header, nonce=hello.nonce)
            frames = [
                protocol.encode(protocol.sign(header, self.secret, room.payload)),
                room.payload,
            ]
            self.transport.send(hello.kv_endpoint, frames)
            self.stats["sent"] += 1
            self.stats["bytes_sent"] += len(room.payload)
        del self.rooms[room_id]

    @staticmethod
    def _same_prompt(hello: protocol.Hello, room: _PrefillRoom) -> bool:
        """Whether the decode worker waits for the KV of the prompt this worker computed."""
        assert room.header is not None
        same_len = hello.prompt_len == room.header.prompt_len
        return same_len and hmac.compare_digest(hello.prompt_digest, room.prompt_digest)


# --------------------------------------------------------------------------- decode side


@dataclass
class _DecodeRoom:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: str  # tcp://host:port of the prefill worker's inbox
    created: float
    nonce: str = field(
        default_factory=protocol.new_nonce
    )  # every answer for this room must echo it
    reserved: bool = False
    state: str = "bootstrapping"  # bootstrapping | waiting (Hello sent); then removed: done or failed


class DecodeManager(_Side):
    mode = "decode"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, _DecodeRoom] = {}
        self.stats.update(
            {"received": 0, "failed": 0, "timed_out": 0, "bytes_received": 0}
        )

    def _add(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        room: int,
        bootstrap: str | None,
    ) -> list[str]:
        """Hold a request whose prompt KV comes from the prefill worker at `bootstrap` (host:port)."""
        if not bootstrap:
            raise ValueError(
                "a decode worker needs bootstrap_addr: the prefill worker's host:port"
            )
        _check_room(room)
        if room in self.rooms:
            raise ValueError(f"bootstrap room {room} is already in use")
        match = (
            _BOOTSTRAP_ADDR.fullmatch(bootstrap) if isinstance(bootstrap, str) else None
        )
        if match is None or not 0 < int(match[3]) < 65536:
            raise ValueError(
                f"bootstrap_addr must be the prefill worker's host:port, got {bootstrap!r:.200}"
            )
        self.scheduler.validate_request([rid], prompt_ids, params)
        endpoint = bootstrap if bootstrap.startswith("tcp://") else f"tcp://{bootstrap}"
        self.rooms[room] = _DecodeRoom(
            rid, list(prompt_ids), params, endpoint, time.monotonic()
        )
        try:
            self._try_reserve(room, self.rooms[room])
        except ValueError:  # e.g. n > 1: refused now, and never retried by poll() (it would fail each step)
            del self.rooms[room]
            raise
        return [rid]

    def _try_reserve(self, room_id: int, room: _DecodeRoom) -> None:
        req = self.scheduler.reserve_prefilled(room.rid, room.prompt_ids, room.params)
        if req is None:
            return  # no KV room yet: retried at the next poll
        room.reserved, room.state = True, "waiting"
        hello = protocol.Hello(
            room_id,
            self.transport.endpoint,
            len(room.prompt_ids),
            protocol.prompt_digest(room.prompt_ids),
            self.namespace,
            room.nonce,
        )
        self.transport.send(
            room.bootstrap, [protocol.encode(protocol.sign(hello, self.secret))]
        )

    def poll(self) -> None:
        self._receive_all()
        now = time.monotonic()
        for room_id, room in list(self.rooms.items()):
            if room.reserved and self.scheduler.reserved(room.rid) is None:
                del self.rooms[room_id]  # aborted by its client meanwhile
            elif not room.reserved:
                self._try_reserve(room_id, room)
            if room_id in self.rooms and now - room.created > self.timeout_s:
                self.stats["timed_out"] += 1
                self._fail(
                    room_id,
                    f"the prefill worker at {room.bootstrap} did not deliver the KV cache within "
                    f"{self.timeout_s:.0f}s (it may have died); retry the request",
                    PEER_FAILED,
                )

    def _fail(self, room_id: int, reason: str, status: int | None = None) -> None:
        room = self.rooms.pop(room_id)
        self.stats["failed"] += 1
        if room.reserved:
            self.scheduler.fail_prefilled(room.rid, reason, status)
        else:  # never reserved: report it through the scheduler anyway
            self.scheduler.fail_request(
                room.rid, room.prompt_ids, room.params, reason, status
            )

    def _on_message(self, frames: list[bytes]) -> None:
        msg = self._parse(frames)
        if msg is None:
            return self._reject(_malformed(frames))
        if isinstance(msg, protocol.Hello):
            return self._reject("a decode worker takes no Hello")
        room = self.rooms.get(msg.room)
        if room is None or not room.reserved:
            return self._reject(f"no transfer is waiting for room {msg.room}")
        if not hmac.compare_digest(msg.nonce, room.nonce):
            return self._reject(
                f"not this transfer of room {msg.room} (a stale or replayed message)"
            )
        payload = frames[1] if isinstance(msg, protocol.KVHeader) else b""
        if not protocol.verify(msg, self.secret, payload):
            return self._reject(
                "bad signature: is --disaggregation-secret the same on every worker?"
            )
        if isinstance(msg, protocol.KVFailed):
            self._fail(msg.room, f"prefill failed: {msg.reason}", PEER_FAILED)
            return
        problem = self._kv_problem(msg, room, payload)
        if problem is not None:
            self._fail(
                msg.room,
                f"the KV cache from the prefill worker at {room.bootstrap} is unusable: "
                f"{problem}",
            )
            return
        raw = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy())
        data = raw.view(self.kv.dtype).view(msg.shape)  # kv_shape(self.kv, prompt_len)
        req = self.scheduler.reserved(room.rid)
        assert (
            req is not None
        )  # a reserved room's request is held until it is added or fails
        install_kv(self.kv, req.pages, data)
        del self.rooms[msg.room]
        self.stats["received"] += 1
        self.stats["bytes_received"] += len(payload)
        logprob = (
            TokenLogprob(msg.first_token, msg.first_logprob)
            if msg.first_logprob is not None
            else None
        )
        self.scheduler.add_prefilled(
            room.rid, msg.first_token, logprob, msg.cached_tokens, msg.cached_by_tier
        )

    def _kv_problem(
        self, msg: protocol.KVHeader, room: _DecodeRoom, payload: bytes
    ) -> str | None:
        """What is wrong with an authenticated KV message for `room`, or None if it fits."""
        prompt_len = len(room.prompt_ids)
        if msg.prompt_len != prompt_len:
            return f"it is for a {msg.prompt_len}-token prompt; this request's prompt has {prompt_len} tokens"
        dtype = str(self.kv.dtype).removeprefix("torch.")
        if msg.dtype != dtype:
            return f"its dtype is {msg.dtype!r}, this worker's KV cache holds {dtype!r}"
        shape = kv_shape(self.kv, prompt_len)
        if msg.shape != shape:
            return f"its shape is {msg.shape}, expected {shape} [layers, parts, prompt_len, heads, dim]"
        num_bytes = math.prod(shape) * self.kv.dtype.itemsize
        if len(payload) != num_bytes:
            return f"it carries {len(payload)} payload bytes for a shape of {num_bytes} bytes"
        if msg.cached_tokens > prompt_len or any(
            n > msg.cached_tokens for n in msg.cached_by_tier.values()
        ):
            return f"it says {msg.cached_tokens} of the prompt's {prompt_len} tokens were cached ({msg.cached_by_tier})"
        vocab = self.scheduler.vocab_size
        if not 0 <= msg.first_token < vocab:
            return f"its first token {msg.first_token} is outside the vocabulary [0, {vocab})"
        lp = msg.first_logprob
        if lp is not None and not (math.isfinite(lp) and lp <= 0):
            return f"its first token's logprob {lp} is not a finite number <= 0"
        return None
