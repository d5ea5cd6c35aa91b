"""`strata plan calibrate` on this machine: the in-process Engine -> a fitted CostModel, and the tier rates.

The engine runs batches shaped to cover the model's features — prompts alone (with and without a
cached prefix), decode batches across the kernel switch and at short and long contexts (the long
ones share a prefix so their prefill stays cheap), and decodes mixed with arriving prefills. Every
scheduler step is one sample: its segments (tokens fed, context) and its time (`engine.step()`),
recorded by a step observer on the scheduler (strata.engine.hooks), as strata/bench/step_timer.py
does.
Tier rates are measured here too: a host memory copy (L2 -> L1 on a CPU), reading a file back
(L3 `file`), loopback TCP (a PD transfer between two local workers).

The other sources: remote.py (a running server or router; the PD handoff), figures.py (JSON).
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.engine.hooks import StepObserver
from strata.plan.cost_model import CostModel, Sample, Segment, fit


@dataclass(frozen=True)
class EnginePlan:
    """What the engine calibration runs (the defaults take a few minutes on 2 CPU cores)."""

    prefill_lens: tuple[int, ...] = (32, 128, 512, 1536)
    cached_prefills: tuple[tuple[int, int], ...] = (
        (1024, 128),
        (1024, 512),
        (256, 32),
    )  # (cached, new) tokens
    decode_batches: tuple[int, ...] = (1, 4, 16, 31, 48, 64)
    decode_contexts: tuple[int, ...] = (
        64,
        1024,
    )  # prompt tokens (long ones share all but 32 tokens)
    decode_steps: int = 10
    mixed: bool = True
    seed: int = 0


# ----------------------------------------------------------------- engine


class _BatchRecorder(StepObserver):
    """Observes the scheduler for the run: the segments of the batch each step ran."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.last: list[Segment] | None = None

    def on_scheduled(self, batch) -> None:
        self.last = None
        if batch is not None:
            self.last = [
                Segment(
                    n,
                    r.kv_len,
                    decode=i < batch.num_decode or bool(getattr(r, "draft_ids", None)),
                )
                for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens))
            ]

    def __enter__(self):
        self.scheduler.add_observer(self)
        return self

    def __exit__(self, *exc) -> None:
        self.scheduler.remove_observer(self)


def _drive(
    engine, arrivals: list[tuple[int, list[int], int]], threshold, what: str
) -> list[Sample]:
    """Add each (at_step, prompt ids, max_new) when that many steps have run; step until all finish;
    one Sample per step that ran a batch."""
    from strata.sampling_params import SamplingParams

    samples: list[Sample] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    rids: set[str] = set()
    step = 0
    with _BatchRecorder(engine.scheduler) as rec:
        while pending or engine.has_work():
            while pending and pending[0][0] <= step:
                _, ids, max_new = pending.pop(0)
                params = SamplingParams(
                    max_new_tokens=max_new, temperature=0.0, ignore_eos=True
                )
                rids.update(engine.add_request(ids, params, buffer_outputs=False))
            t0 = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            if rec.last:
                decodes = sum(1 for seg in rec.last if seg.decode)
                kind = (
                    "decode"
                    if decodes == len(rec.last)
                    else "prefill"
                    if not decodes
                    else "mixed"
                )
                samples.append(
                    Sample.of_steps([rec.last], dt, threshold, f"{kind} step: {what}")
                )
            step += 1
    return samples


def calibrate_engine(
    engine, plan: EnginePlan = EnginePlan(), progress=None
) -> tuple[CostModel, list[Sample]]:
    """Measure `engine` (a strata.Engine) per EnginePlan and fit; also measures the tier rates."""
    from strata.bench.one_batch import special_ids

    say = progress or (lambda line: None)
    rng = random.Random(plan.seed)
    vocab = engine.state.model_config.vocab_size
    exclude = special_ids(engine.tokenizer) | set(engine.state.eos_token_ids)
    pool = [i for i in range(vocab) if i not in exclude]
    # every prompt + its outputs must fit the model's context (and the pool): longer ones are cut
    longest = min(engine.state.context_len, engine.state.num_kv_tokens) - 48
    fresh = lambda n: [rng.choice(pool) for _ in range(max(1, min(n, longest)))]  # noqa: E731
    thr = None  # the engine computes a row the same way at every step size: one regime
    samples: list[Sample] = []

    _drive(engine, [(0, fresh(16), 4) for _ in range(4)], thr, "warm-up")
    for n in plan.prefill_lens:
        say(f"calibrate: prefill of {n} tokens")
        samples += _drive(engine, [(0, fresh(n), 2)], thr, f"prefill {n}")
    for cached, n in plan.cached_prefills:
        say(f"calibrate: prefill of {n} tokens after {cached} cached")
        prefix = fresh(cached)
        _drive(engine, [(0, prefix, 1)], thr, "prefix")
        samples += _drive(
            engine,
            [(0, (prefix + fresh(n))[:longest], 2)],
            thr,
            f"prefill {n} on {cached}",
        )
    for ctx in plan.decode_contexts:
        ctx = min(ctx, longest)
        shared = fresh(max(0, ctx - 32)) if ctx > 64 else []
        if shared:
            _drive(engine, [(0, shared, 1)], thr, "prefix")
        for b in plan.decode_batches:
            say(f"calibrate: decode batch {b}, context ~{ctx}")
            prompts = [shared + fresh(ctx - len(shared)) for _ in range(b)]
            samples += _drive(
                engine,
                [(0, p, plan.decode_steps) for p in prompts],
                thr,
                f"decode {b}x{ctx}",
            )
    if plan.mixed:
        say("calibrate: decodes mixed with arriving prefills")
        arrivals = [(0, fresh(64), 40) for _ in range(8)]
        arrivals += [
            (4, fresh(512), 8),
            (10, fresh(256), 8),
            (16, fresh(96), 8),
            (22, fresh(1024), 4),
        ]
        samples += _drive(engine, arrivals, thr, "mixed")
    engine.flush_cache()
    st = engine.state
    say("calibrate: tier rates (host copy, file read, loopback TCP)")
    rates = measure_rates()
    model = fit(
        samples,
        thr,
        kv_bytes_per_token=int(st.kv_bytes // max(st.num_kv_tokens, 1)),
        source=f"engine on this machine ({st.model_dir.name}, {st.dtype}, {st.weights})",
        **rates,
    )
    return model, samples


# ----------------------------------------------------------------- tier rates


def _best_of(fn, rounds: int = 3) -> float:
    return min(fn() for _ in range(rounds))


def measure_rates(
    num_bytes: int = 64 * 2**20, directory: str | None = None
) -> dict[str, float]:
    """Bytes/s of a host memory copy, of reading a just-written file, and of loopback TCP."""
    src = np.random.default_rng(0).integers(0, 255, num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)

    def copy() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    host = num_bytes / _best_of(copy)
    with tempfile.TemporaryDirectory(dir=directory) as d:
        path = Path(d) / "kv.bin"
        with open(path, "wb") as f:
            f.write(src.tobytes())
            f.flush()
            os.fsync(f.fileno())

        def read() -> float:
            t0 = time.perf_counter()
            with open(path, "rb") as f:
                while f.read(1 << 22):
                    pass
            return time.perf_counter() - t0

        storage = num_bytes / _best_of(read)
    tcp, latency = _loopback()
    return {
        "host_bytes_per_s": host,
        "storage_bytes_per_s": storage,
        "pd_bytes_per_s": tcp,
        "pd_latency_s": latency,
    }


def _loopback(num_bytes: int = 32 * 2**20) -> tuple[float, float]:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got = threading.Event()

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            left = num_bytes
            while left > 0:
                left -= len(conn.recv(1 << 20))
            conn.sendall(b"k")
        got.set()

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    payload = b"x" * (1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for _ in range(num_bytes // len(payload)):
            c.sendall(payload)
        c.recv(1)
        seconds = time.perf_counter() - t0
    thread.join(5)
    server.close()
    # round trip of a small message: the handshake part of a transfer
    a, b = socket.socketpair()
    t0 = time.perf_counter()
    for _ in range(100):
        a.sendall(b"p")
        b.recv(1)
        b.sendall(b"q")
        a.recv(1)
    latency = (time.perf_counter() - t0) / 100
    a.close()
    b.close()
    return num_bytes / seconds, latency
