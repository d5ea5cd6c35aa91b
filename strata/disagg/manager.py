"""Per-room state on each side of a prefill/decode pair. Both run on the scheduler thread,
polled once per step (`Scheduler.disagg.poll()`); nothing here blocks.

Prefill side, per room:  announced (request arrived) ─▶ KV ready (prefill finished, KV copied out)
                         + Hello from the decode worker ─▶ KV sent ─▶ done
Decode side, per room:   bootstrapping (reserving pages) ─▶ waiting (Hello sent) ─▶ KV installed,
                         request decodes ─▶ done;  any side's timeout or KVFailed ─▶ failed,
                         with the reserved pages freed and a clear error for the request
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from strata.cache.kv_pool import MHAKVPool
from strata.disagg import protocol
from strata.disagg.transport import KVTransport
from strata.engine.request import Req, TokenLogprob
from strata.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gather_kv(kv: MHAKVPool, pages: list[int], num_tokens: int) -> torch.Tensor:
    """KV of a request's first num_tokens positions: [layers, 2, num_tokens, kv_heads, head_dim]."""
    slots = kv.slots_of_pages(pages)[:num_tokens].to(kv.k[0].device)
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(kv.k, kv.v)]).cpu()


def install_kv(kv: MHAKVPool, pages: list[int], data: torch.Tensor) -> None:
    slots = kv.slots_of_pages(pages)[: data.shape[2]].to(kv.k[0].device)
    for layer, (k, v) in enumerate(zip(kv.k, kv.v)):
        k[slots] = data[layer, 0].to(k.device, k.dtype)
        v[slots] = data[layer, 1].to(v.device, v.dtype)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# --------------------------------------------------------------------------- prefill side


@dataclass
class _PrefillRoom:
    rid: str
    created: float
    hello: protocol.Hello | None = None
    frames: list[bytes] | None = None  # signed header + payload, once the prefill finished
    failed: str | None = None


class _Side:
    """What both sides hold: the scheduler and KV pool they serve, the transport, the shared secret,
    the KV-layout namespace both must agree on, and how long a room may wait for its peer."""

    def __init__(self, scheduler, kv: MHAKVPool, transport: KVTransport, secret: bytes, namespace: str,
                 timeout_s: float = 30.0):
        self.scheduler, self.kv, self.transport = scheduler, kv, transport
        self.secret, self.namespace, self.timeout_s = secret, namespace, timeout_s
        scheduler.disagg = self


class PrefillManager(_Side):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, _PrefillRoom] = {}
        self.room_of: dict[str, int] = {}
        self.early_hellos: dict[int, tuple[float, protocol.Hello]] = {}  # Hello before the request
        self.stats = {"sent": 0, "failed": 0, "rejected": 0, "timed_out": 0, "bytes_sent": 0}
        self.scheduler.before_release = self._on_release

    def announce(self, rid: str, room: int) -> None:
        """The router sent this request with `room`: only announced rooms may be served."""
        self.rooms[room] = _PrefillRoom(rid=rid, created=time.monotonic())
        self.room_of[rid] = room
        early = self.early_hellos.pop(room, None)
        if early is not None:
            self.rooms[room].hello = early[1]

    def prefill_params(self, params: SamplingParams) -> SamplingParams:
        """The prefill worker computes the prompt and one token; the decode worker does the rest."""
        import msgspec

        return msgspec.structs.replace(params, max_new_tokens=1, min_new_tokens=0, n=1)

    def _on_release(self, req: Req) -> None:
        room_id = self.room_of.pop(req.rid, None)
        if room_id is None or room_id not in self.rooms:
            return
        room = self.rooms[room_id]
        if req.finish_reason in ("abort", "error") or not req.output_ids:
            room.failed = req.error or f"prefill request ended: {req.finish_reason}"
            return
        n = len(req.prompt_ids)
        data = gather_kv(self.kv, req.pages, n)
        payload = tensor_bytes(data)
        lp = req.pending_logprobs[0].logprob if req.pending_logprobs else None
        header = protocol.KVHeader(
            room=room_id, prompt_len=n, first_token=req.output_ids[0], first_logprob=lp,
            dtype=str(data.dtype).removeprefix("torch."), shape=list(data.shape),
        )
        room.frames = [protocol.encode(protocol.sign(header, self.secret, payload)), payload]

    def poll(self) -> None:
        while (frames := self.transport.recv()) is not None:
            self._on_message(frames)
        now = time.monotonic()
        for room_id, room in list(self.rooms.items()):
            if room.hello is not None and (room.frames is not None or room.failed is not None):
                self._deliver(room_id, room)
            elif now - room.created > self.timeout_s:
                logger.warning("PD room %d: no decode worker asked for it within %.0fs; dropping", room_id, self.timeout_s)
                self.stats["timed_out"] += 1
                del self.rooms[room_id]
        for room_id, (t, _) in list(self.early_hellos.items()):
            if now - t > self.timeout_s:
                del self.early_hellos[room_id]

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = protocol.decode(frames[0])
        except Exception:
            self.stats["rejected"] += 1
            return
        if not isinstance(msg, protocol.Hello) or not protocol.verify(msg, self.secret):
            self.stats["rejected"] += 1
            logger.warning("PD: rejected an unauthenticated or unexpected message")
            return
        if msg.namespace != self.namespace:
            fail = protocol.sign(protocol.KVFailed(msg.room, "prefill and decode workers serve different "
                                                   "models or KV layouts"), self.secret)
            self.transport.send(msg.kv_endpoint, [protocol.encode(fail)])
            return
        room = self.rooms.get(msg.room)
        if room is None:
            self.early_hellos[msg.room] = (time.monotonic(), msg)
        else:
            room.hello = msg

    def _deliver(self, room_id: int, room: _PrefillRoom) -> None:
        assert room.hello is not None
        if room.failed is not None:
            fail = protocol.sign(protocol.KVFailed(room_id, room.failed), self.secret)
            self.transport.send(room.hello.kv_endpoint, [protocol.encode(fail)])
            self.stats["failed"] += 1
        else:
            self.transport.send(room.hello.kv_endpoint, room.frames)
            self.stats["sent"] += 1
            self.stats["bytes_sent"] += len(room.frames[1])
        del self.rooms[room_id]

    def busy(self) -> bool:
        return bool(self.rooms)


# --------------------------------------------------------------------------- decode side


@dataclass
class _DecodeRoom:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: str  # tcp://host:port of the prefill worker's inbox
    created: float
    reserved: bool = False
    state: str = "bootstrapping"  # bootstrapping | waiting (Hello sent); then removed: done or failed


class DecodeManager(_Side):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, _DecodeRoom] = {}
        self.stats = {"received": 0, "failed": 0, "rejected": 0, "timed_out": 0, "bytes_received": 0}

    def add(self, rid: str, prompt_ids: list[int], params: SamplingParams, room: int, bootstrap: str) -> None:
        """Accept a request whose prompt KV comes from the prefill worker at `bootstrap` (host:port).

        Raises ValueError for a request that can never run here (as Scheduler.add_request does).
        """
        if room in self.rooms:
            raise ValueError(f"bootstrap room {room} is already in use")
        self.scheduler._validate([rid], prompt_ids, params)
        endpoint = bootstrap if bootstrap.startswith("tcp://") else f"tcp://{bootstrap}"
        self.rooms[room] = _DecodeRoom(rid, list(prompt_ids), params, endpoint, time.monotonic())
        self._try_reserve(room, self.rooms[room])

    def _try_reserve(self, room_id: int, room: _DecodeRoom) -> None:
        req = self.scheduler.reserve_prefilled(room.rid, room.prompt_ids, room.params)
        if req is None:
            return  # no KV room yet: retried at the next poll
        room.reserved, room.state = True, "waiting"
        hello = protocol.Hello(room_id, self.transport.endpoint, len(room.prompt_ids), self.namespace)
        self.transport.send(room.bootstrap, [protocol.encode(protocol.sign(hello, self.secret))])

    def poll(self) -> None:
        while (frames := self.transport.recv()) is not None:
            self._on_message(frames)
        now = time.monotonic()
        for room_id, room in list(self.rooms.items()):
            if room.reserved and room.rid not in self.scheduler.prealloc:
                del self.rooms[room_id]  # aborted by its client meanwhile
            elif not room.reserved:
                self._try_reserve(room_id, room)
            if room_id in self.rooms and now - room.created > self.timeout_s:
                self.stats["timed_out"] += 1
                self._fail(room_id, f"the prefill worker at {room.bootstrap} did not deliver the KV cache within "
                                    f"{self.timeout_s:.0f}s (it may have died); retry the request")

    def _fail(self, room_id: int, reason: str) -> None:
        room = self.rooms.pop(room_id)
        self.stats["failed"] += 1
        if room.reserved:
            self.scheduler.fail_prefilled(room.rid, reason)
        else:  # never reserved: report it through the scheduler anyway
            req = self.scheduler._new_req(room.rid, room.prompt_ids, room.params, None, None)
            req.error = reason
            self.scheduler._finish(req, "error")

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = protocol.decode(frames[0])
        except Exception:
            self.stats["rejected"] += 1
            return
        payload = frames[1] if len(frames) > 1 else b""
        room = self.rooms.get(getattr(msg, "room", -1))
        if room is None or not room.reserved or not protocol.verify(msg, self.secret, payload):
            self.stats["rejected"] += 1
            logger.warning("PD: rejected a message for an unknown room or with a bad signature")
            return
        if isinstance(msg, protocol.KVFailed):
            self._fail(msg.room, f"prefill failed: {msg.reason}")
            return
        if not isinstance(msg, protocol.KVHeader):
            self.stats["rejected"] += 1
            return
        expected = [len(self.kv.k), 2, len(room.prompt_ids), *self.kv.k[0].shape[1:]]
        if msg.shape != expected or msg.dtype not in _DTYPES:
            self._fail(msg.room, f"KV from the prefill worker has shape {msg.shape} ({msg.dtype}), expected {expected}")
            return
        dtype = _DTYPES[msg.dtype]
        data = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8).copy()).view(dtype).view(msg.shape)
        req = self.scheduler.prealloc[room.rid]
        install_kv(self.kv, req.pages, data)
        del self.rooms[msg.room]
        self.stats["received"] += 1
        self.stats["bytes_received"] += len(payload)
        logprob = TokenLogprob(msg.first_token, msg.first_logprob) if msg.first_logprob is not None else None
        self.scheduler.add_prefilled(room.rid, msg.first_token, logprob)

    def busy(self) -> bool:
        return bool(self.rooms)
