"""Prefill/decode disaggregation between two engines over TCP (loopback): identical greedy answers,
clear failures and no leaked slots when the prefill worker dies, and no KV from strangers; a room is
used once, a transfer is bound to its prompt and nonce, a signed but unfit KV fails only its own
request, and a fuzzed inbox neither raises nor disturbs a live transfer."""

from __future__ import annotations

import logging
import random
import time

import msgspec
import numpy as np
import pytest
import zmq

from strata import Engine, SamplingParams
from strata.disagg import protocol

GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [
    [5, 17, 33, 91, 120, 7, 64, 200, 13],
    list(range(30, 71)),
    [300, 301, 302, 99, 98],
]


def engine(model_dir, mode, secret="s3cret", **kw):
    return Engine(
        str(model_dir),
        dtype="float32",
        kv_cache_tokens=512,
        page_size=4,
        disaggregation_mode=mode,
        disaggregation_secret=secret,
        **kw,
    )


def run_pair(
    prefill: Engine | None, decode: Engine, rids: list[str], deadline_s: float = 60
) -> dict:
    outs: dict[str, list] = {r: [] for r in rids}
    done: set[str] = set()
    start = time.monotonic()
    while len(done) < len(rids) and time.monotonic() - start < deadline_s:
        if prefill is not None:
            prefill.step()
        for o in decode.step():
            if o.rid in outs:
                outs[o.rid].append(o)
                if o.finished:
                    done.add(o.rid)
    return outs


def pd_tokens(
    prefill: Engine, decode: Engine, prompts, params, first_room: int
) -> list[list[int]]:
    """Each prompt through the pair (its decode side told first; rooms from `first_room`), run to
    the end: the output tokens of each, in order."""
    rids = [f"r{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(rids, prompts)):
        room = first_room + i
        decode.add_request(
            prompt,
            params,
            rid=rid,
            bootstrap_room=room,
            bootstrap_addr=prefill.disagg_endpoint,
        )
        prefill.add_request(prompt, params, rid=rid, bootstrap_room=room)
    outs = run_pair(prefill, decode, rids)
    return [[t for o in outs[r] for t in o.new_token_ids] for r in rids]


@pytest.fixture(scope="module")
def expected(llama_dir):
    single = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=512)
    return [r.token_ids for r in single.generate(PROMPTS, GREEDY)]


def test_prefill_then_decode_equals_a_single_server(llama_dir, expected):
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    rids = []
    for i, prompt in enumerate(PROMPTS):
        room = 1000 + i
        # the decode side may hear of the request first: its Hello waits on the prefill side
        d.add_request(
            prompt,
            GREEDY,
            rid=f"r{i}",
            bootstrap_room=room,
            bootstrap_addr=p.disagg_endpoint,
        )
        p.add_request(prompt, GREEDY, rid=f"r{i}", bootstrap_room=room)
        rids.append(f"r{i}")
    outs = run_pair(p, d, rids)
    got = [[t for o in outs[r] for t in o.new_token_ids] for r in rids]
    assert got == expected
    assert all(outs[r][-1].finish_reason == "length" for r in rids)
    assert p.disagg.stats["sent"] == 3 and d.disagg.stats["received"] == 3
    d.scheduler.check_no_leaks()
    p.scheduler.check_no_leaks()
    p.close()
    d.close()


def test_the_prefill_workers_cache_hits_reach_the_decode_sides_usage(llama_dir):
    """A single worker reports the prompt tokens its prefix cache served; so does a PD pair, from
    the prefill worker's hit (the decode side computes none of the prompt)."""
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    shared = list(range(100, 140))
    prompts = [shared + [7, 8], shared + [9, 10, 11]]
    lasts = []
    for i, prompt in enumerate(
        prompts
    ):  # one after the other: the second finds the first's prefix
        d.add_request(
            prompt,
            GREEDY,
            rid=f"c{i}",
            bootstrap_room=500 + i,
            bootstrap_addr=p.disagg_endpoint,
        )
        p.add_request(prompt, GREEDY, rid=f"c{i}", bootstrap_room=500 + i)
        lasts.append(run_pair(p, d, [f"c{i}"])[f"c{i}"][-1])
    single = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=512, page_size=4)
    want = [single.generate([q], GREEDY)[0].cached_tokens for q in prompts]
    assert [o.cached_tokens for o in lasts] == want and want[0] == 0 and want[1] >= 36
    assert lasts[1].cached_tokens_details["device"] == want[1]
    for e in (p, d, single):
        e.scheduler.check_no_leaks()
        e.close()


@pytest.mark.parametrize("radix", [True, False])
def test_windowed_model_prefill_then_decode(tiny_models, radix):
    """Gemma 3 (window 8): the prefill worker has given back its window KV before the last W - 1
    positions; what it sends still resumes exactly on the decode worker."""
    model = tiny_models["gemma3"]
    prompts = [list(range(30, 71)), [(i * 7 + 3) % 370 + 5 for i in range(60)]]
    single = Engine(str(model), dtype="float32", kv_cache_tokens=512)
    want = [r.token_ids for r in single.generate(prompts, GREEDY)]
    p = engine(model, "prefill", disable_radix_cache=not radix, chunked_prefill_size=16)
    d = engine(model, "decode")
    assert p.scheduler.allocator.groups and d.scheduler.allocator.groups
    rids = []
    for i, prompt in enumerate(prompts):
        d.add_request(
            prompt,
            GREEDY,
            rid=f"w{i}",
            bootstrap_room=2000 + i,
            bootstrap_addr=p.disagg_endpoint,
        )
        p.add_request(prompt, GREEDY, rid=f"w{i}", bootstrap_room=2000 + i)
        rids.append(f"w{i}")
    # the decode side reserves window KV only for each prompt's last window (page size 4, window 8)
    for g in d.scheduler.allocator.groups:
        held = [
            int((g.to_group[np.asarray(r.pages)] >= 0).sum())
            for r in d.scheduler.prealloc.values()
        ]
        assert held and all(n <= (8 - 1) // 4 + 2 for n in held)
    outs = run_pair(p, d, rids)
    assert [[t for o in outs[r] for t in o.new_token_ids] for r in rids] == want
    d.scheduler.check_no_leaks()
    p.scheduler.check_no_leaks()
    p.close()
    d.close()


def test_dead_prefill_worker_fails_clearly_and_frees_slots(llama_dir):
    p = engine(llama_dir, "prefill")
    d = engine(llama_dir, "decode", disaggregation_timeout=1.0)
    free_before = d.scheduler.allocator.num_free_pages
    d.add_request(
        PROMPTS[1], GREEDY, rid="x", bootstrap_room=7, bootstrap_addr=p.disagg_endpoint
    )
    p.add_request(PROMPTS[1], GREEDY, rid="x", bootstrap_room=7)
    assert (
        d.scheduler.allocator.num_free_pages < free_before
    )  # slots reserved for the transfer
    p.close()  # the prefill worker dies before computing anything
    outs = run_pair(None, d, ["x"], deadline_s=10)
    last = outs["x"][-1]
    assert (
        last.finished
        and last.finish_reason == "error"
        and "did not deliver" in last.error
        and last.error_status == 503
    )  # 503: its peer failed, not this worker (a router retries it, and keeps the worker)
    assert not d.scheduler.prealloc
    d.scheduler.check_no_leaks()
    d.close()


def test_wrong_secret_or_unannounced_room_gets_nothing(llama_dir):
    p = engine(llama_dir, "prefill")
    intruder = engine(llama_dir, "decode", secret="wrong", disaggregation_timeout=1.0)
    stranger = engine(llama_dir, "decode", disaggregation_timeout=1.0)
    p.add_request(PROMPTS[0], GREEDY, rid="a", bootstrap_room=1)
    intruder.add_request(
        PROMPTS[0], GREEDY, rid="a", bootstrap_room=1, bootstrap_addr=p.disagg_endpoint
    )
    stranger.add_request(
        PROMPTS[0], GREEDY, rid="b", bootstrap_room=99, bootstrap_addr=p.disagg_endpoint
    )
    deadline = time.monotonic() + 10
    results = {}
    while len(results) < 2 and time.monotonic() < deadline:
        p.step()
        for name, eng in (("intruder", intruder), ("stranger", stranger)):
            for o in eng.step():
                if o.finished:
                    results[name] = o
    assert results["intruder"].finish_reason == "error"
    assert results["stranger"].finish_reason == "error"
    assert p.disagg.stats["rejected"] >= 1 and p.disagg.stats["sent"] == 0
    for e in (p, intruder, stranger):
        e.scheduler.check_no_leaks()
        e.close()


def test_disaggregated_workers_refuse_plain_requests(llama_dir):
    d = engine(llama_dir, "decode")
    with pytest.raises(ValueError, match="bootstrap_room"):
        d.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="shared secret"):
        Engine(
            str(llama_dir),
            dtype="float32",
            kv_cache_tokens=64,
            disaggregation_mode="prefill",
        )
    d.close()


# --------------------------------------------------------------------------- what crosses the wire


class Wire:
    """Holds back what a prefill worker sends, so a test can deliver, alter or replay it."""

    def __init__(self, prefill: Engine):
        self.transport = prefill.disagg.transport
        self.real_send = self.transport.send
        self.sent: list[tuple[str, list[bytes]]] = []
        self.transport.send = lambda endpoint, frames: self.sent.append(
            (endpoint, list(frames))
        )

    def kv(self, room: int) -> tuple[protocol.KVHeader, bytes]:
        for _, frames in self.sent:
            msg = protocol.decode(frames[0])
            if isinstance(msg, protocol.KVHeader) and msg.room == room:
                return msg, frames[1]
        raise KeyError(room)

    def pump(
        self, prefill: Engine, decode: Engine, rooms: list[int], deadline_s: float = 30
    ) -> None:
        """Step both until the prefill worker has sent the KV of every room (held here)."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            prefill.step()
            decode.step()
            if all(any(self._is_kv(f, r) for _, f in self.sent) for r in rooms):
                return
        raise TimeoutError(f"no KV for rooms {rooms}")

    @staticmethod
    def _is_kv(frames: list[bytes], room: int) -> bool:
        msg = protocol.decode(frames[0])
        return isinstance(msg, protocol.KVHeader) and msg.room == room


def signed_kv(
    header: protocol.KVHeader, payload: bytes, secret: bytes = b"s3cret", **change
) -> list[bytes]:
    header = msgspec.structs.replace(header, **change)
    return [protocol.encode(protocol.sign(header, secret, payload)), payload]


def test_a_duplicate_room_is_refused_and_the_live_one_completes(llama_dir, expected):
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    p.add_request(PROMPTS[0], GREEDY, rid="first", bootstrap_room=5)
    with pytest.raises(ValueError, match="room 5 is already in use"):
        p.add_request(PROMPTS[1], GREEDY, rid="second", bootstrap_room=5)
    d.add_request(
        PROMPTS[0],
        GREEDY,
        rid="first",
        bootstrap_room=5,
        bootstrap_addr=p.disagg_endpoint,
    )
    outs = run_pair(p, d, ["first"])
    assert [t for o in outs["first"] for t in o.new_token_ids] == expected[0]
    assert "second" not in p.scheduler.reqs
    for e in (p, d):
        e.scheduler.check_no_leaks()
        e.close()


def test_kv_for_another_prompt_is_refused(llama_dir):
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    prompt = PROMPTS[0]
    d.add_request(
        prompt, GREEDY, rid="x", bootstrap_room=3, bootstrap_addr=p.disagg_endpoint
    )
    p.add_request(
        prompt[::-1], GREEDY, rid="x", bootstrap_room=3
    )  # same length, other tokens
    last = run_pair(p, d, ["x"], deadline_s=20)["x"][-1]
    assert last.finish_reason == "error" and "prompt" in last.error
    assert p.disagg.stats["sent"] == 0
    for e in (p, d):
        e.scheduler.check_no_leaks()
        e.close()


def test_a_replayed_transfer_is_rejected(llama_dir, expected):
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    wire = Wire(p)
    d.add_request(
        PROMPTS[0],
        GREEDY,
        rid="one",
        bootstrap_room=9,
        bootstrap_addr=p.disagg_endpoint,
    )
    p.add_request(PROMPTS[0], GREEDY, rid="one", bootstrap_room=9)
    wire.pump(p, d, [9])
    header, payload = wire.kv(9)
    wire.real_send(d.disagg.transport.endpoint, [protocol.encode(header), payload])
    assert [
        t for o in run_pair(None, d, ["one"])["one"] for t in o.new_token_ids
    ] == expected[0]
    # the same room id again: the first transfer's (validly signed) KV must not be taken for it
    d.add_request(
        PROMPTS[0],
        GREEDY,
        rid="two",
        bootstrap_room=9,
        bootstrap_addr=p.disagg_endpoint,
    )
    rejected = d.disagg.stats["rejected"]
    wire.real_send(d.disagg.transport.endpoint, [protocol.encode(header), payload])
    outs = run_pair(None, d, ["two"], deadline_s=1)
    assert not outs["two"] and d.disagg.stats["rejected"] == rejected + 1
    wire.sent.clear()
    p.add_request(PROMPTS[0], GREEDY, rid="two", bootstrap_room=9)
    wire.pump(p, d, [9])
    header, payload = wire.kv(9)
    wire.real_send(d.disagg.transport.endpoint, [protocol.encode(header), payload])
    assert [
        t for o in run_pair(None, d, ["two"])["two"] for t in o.new_token_ids
    ] == expected[0]
    for e in (p, d):
        e.scheduler.check_no_leaks()
        e.close()


def test_signed_but_invalid_kv_fails_only_its_own_request(llama_dir, expected):
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    vocab = d.scheduler.vocab_size
    bad = {  # what the (authenticated) prefill worker got wrong -> words the decode request's error says
        "first_token": ({"first_token": vocab}, "first token"),
        "nan_logprob": ({"first_logprob": float("nan")}, "logprob"),
        "positive_logprob": ({"first_logprob": 0.5}, "logprob"),
        "prompt_len": ({"prompt_len": len(PROMPTS[0]) + 1}, "prompt"),
        "dtype": ({"dtype": "float16"}, "dtype"),
        "shape": ("shape", "shape"),
        "payload": ("payload", "bytes"),
        "cached_tokens": ({"cached_tokens": len(PROMPTS[0]) + 1}, "cached"),
        "cached_by_tier": (
            {"cached_tokens": 2, "cached_by_tier": {"device": 3}},
            "cached",
        ),
    }
    wire = Wire(p)
    rooms = {name: 200 + i for i, name in enumerate([*bad, "good"])}
    for name, room in rooms.items():
        d.add_request(
            PROMPTS[0],
            GREEDY,
            rid=name,
            bootstrap_room=room,
            bootstrap_addr=p.disagg_endpoint,
        )
        p.add_request(PROMPTS[0], GREEDY, rid=name, bootstrap_room=room)
    wire.pump(p, d, list(rooms.values()))
    for name, room in rooms.items():
        header, payload = wire.kv(room)
        if name == "good":
            frames = signed_kv(header, payload)
        elif name == "shape":
            frames = signed_kv(
                header, payload, shape=[*header.shape[:-1], header.shape[-1] * 2]
            )
        elif name == "payload":
            frames = signed_kv(header, payload[:-4])
        else:
            frames = signed_kv(header, payload, **bad[name][0])
        wire.real_send(d.disagg.transport.endpoint, frames)
    outs = run_pair(None, d, list(rooms))
    for name, (_, words) in bad.items():
        last = outs[name][-1]
        assert last.finish_reason == "error" and words in last.error, (name, last.error)
    assert [t for o in outs["good"] for t in o.new_token_ids] == expected[0]
    for e in (p, d):
        e.scheduler.check_no_leaks()
        e.close()


def fuzz_frames(rng: random.Random, genuine: list[list[bytes]]) -> list[bytes]:
    """Random frames, or a genuine message bit-flipped, truncated, cut short or padded with frames.
    (No genuine message here may turn into a valid one for a live room by such a change.)"""
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(200)) for _ in range(rng.randint(1, 4))]
    frames = [bytes(f) for f in rng.choice(genuine)]
    i = rng.randrange(len(frames))
    if kind == 1 and frames[i]:
        data = bytearray(frames[i])
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        frames[i] = bytes(data)
    elif kind == 2:
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == 3:
        frames = frames[: rng.randrange(len(frames))] or [b""]
    else:
        frames = frames + [rng.randbytes(8)] * rng.randint(1, 3)
    return frames


def test_a_fuzzed_inbox_never_raises_nor_touches_live_rooms(
    llama_dir, expected, caplog
):
    """Junk, tampered, unsigned, wrongly keyed, replayed and misaddressed messages straight into both
    managers (and through their sockets): all rejected, the live transfer then completes as normal."""
    rng = random.Random(20240607)
    p, d = engine(llama_dir, "prefill"), engine(llama_dir, "decode")
    wire = Wire(p)
    # an earlier transfer of the same prompt: its genuine, signed KV is replay material
    d.add_request(
        PROMPTS[0],
        GREEDY,
        rid="old",
        bootstrap_room=1,
        bootstrap_addr=p.disagg_endpoint,
    )
    p.add_request(PROMPTS[0], GREEDY, rid="old", bootstrap_room=1)
    wire.pump(p, d, [1])
    old_header, payload = wire.kv(1)
    wire.real_send(d.disagg.transport.endpoint, [protocol.encode(old_header), payload])
    run_pair(None, d, ["old"])
    wire.sent.clear()

    # the live transfer: both rooms wait (the prefill has its Hello, the decode its KV)
    live = 77
    d.add_request(
        PROMPTS[0],
        GREEDY,
        rid="live",
        bootstrap_room=live,
        bootstrap_addr=p.disagg_endpoint,
    )
    p.add_request(PROMPTS[0], GREEDY, rid="live", bootstrap_room=live)
    deadline = time.monotonic() + 10
    while p.disagg.rooms[live].hello is None and time.monotonic() < deadline:
        p.disagg.poll()
    hello, nonce = p.disagg.rooms[live].hello, d.disagg.rooms[live].nonce
    assert hello is not None and hello.nonce == nonce

    secret, wrong = b"s3cret", b"wrong"
    header = msgspec.structs.replace(
        old_header, room=live, nonce=nonce
    )  # what the real KV will look like

    def kv(h: protocol.KVHeader, key: bytes | None) -> list[bytes]:
        return [protocol.encode(protocol.sign(h, key, payload) if key else h), payload]

    def failed(room: int, nonce_: str, key: bytes | None) -> list[bytes]:
        msg = protocol.KVFailed(room, nonce_, "no")
        return [protocol.encode(protocol.sign(msg, key) if key else msg)]

    def hello_for(key: bytes | None, **change) -> list[bytes]:
        msg = msgspec.structs.replace(hello, mac="", **change)
        return [protocol.encode(protocol.sign(msg, key) if key else msg)]

    to_decode = [  # none may touch the live decode room
        kv(header, None),
        kv(header, wrong),
        failed(live, nonce, None),
        failed(live, nonce, wrong),
        kv(old_header, secret),
        kv(msgspec.structs.replace(old_header, room=live), secret),  # replays
        failed(live, old_header.nonce, secret),
        kv(msgspec.structs.replace(header, room=live + 1), secret),
        failed(live + 1, nonce, secret),
        hello_for(secret),
        [kv(header, secret)[0]],
        [kv(header, secret)[0], payload[:-1]],
        [kv(header, secret)[0], payload[::-1]],
        [
            msgspec.msgpack.encode(
                {
                    "type": "failed",
                    "room": live,
                    "nonce": nonce,
                    "reason": "",
                    "mac": "é" * 9,
                }
            )
        ],
        [msgspec.msgpack.encode({"type": "kv", "room": 2**64 - 1})],
        [b""],
        [],
        [b"\xc1"] * 3,
    ]
    to_prefill = [  # none may replace the live room's Hello
        hello_for(None),
        hello_for(wrong),
        hello_for(secret, kv_endpoint="tcp://127.0.0.1:1"),
        hello_for(secret, room=live + 1, namespace="00"),
        kv(header, secret),
        failed(live, nonce, secret),
        [
            msgspec.msgpack.encode(
                {
                    "type": "hello",
                    "room": live,
                    "kv_endpoint": "tcp://x:1",
                    "mac": "\x00",
                }
            )
        ],
        [b""],
        [],
        [b"\xc1", b"", b""],
    ]
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        for side, messages in ((d.disagg, to_decode), (p.disagg, to_prefill)):
            genuine = [m for m in messages if m]
            sock.connect(side.transport.endpoint)
            for i in range(2500):
                frames = messages[i] if i < len(messages) else fuzz_frames(rng, genuine)
                if i % 3 or not frames:
                    side._on_message(frames)
                else:  # through the socket and poll(), as a peer would
                    sock.send_multipart(frames)
                    side.poll()
            for _ in range(20):
                side.poll()
            sock.disconnect(side.transport.endpoint)
    finally:
        sock.close(0)
    assert d.disagg.stats["rejected"] >= 2000 and p.disagg.stats["rejected"] >= 2000
    assert not [
        r for r in caplog.records if r.levelno >= logging.ERROR
    ]  # poll()'s safety net never caught one
    assert d.disagg.stats["received"] == 1 and d.disagg.stats["failed"] == 0
    assert (
        d.disagg.rooms[live].nonce == nonce and d.disagg.rooms[live].state == "waiting"
    )
    assert p.disagg.rooms[live].hello == hello and "live" in d.scheduler.prealloc

    wire.transport.send = wire.real_send  # the genuine transfer now goes through
    outs = run_pair(p, d, ["live"])
    assert [t for o in outs["live"] for t in o.new_token_ids] == expected[0]
    for e in (p, d):
        e.scheduler.check_no_leaks()
        e.close()
