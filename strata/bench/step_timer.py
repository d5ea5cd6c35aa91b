"""Times the pieces of `Engine.step()` from outside, without changing the engine.

One scheduler step is:  schedule() -> runner.forward(batch) -> process_results()
and runner.forward is:  prepare(batch) -> model(...) -> model.compute_logits(...) -> sample(...)

`StepTimer(engine)` observes the engine's scheduler (strata.engine.hooks.StepObserver: the step,
its schedule, the forward, its results) and runner (ForwardObserver: the forward's prepare, model
and logits pieces) while it is entered; it changes nothing in the engine. `sample_s` is what
forward spends outside prepare, the model and the logits (grammar masks, sampling and moving the
chosen ids to the CPU). On CUDA each clock read synchronizes the device first, so the pieces are
real durations, not launch times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from strata.engine.hooks import ForwardObserver, StepObserver

PIECES = ("schedule", "prepare", "model", "logits", "sample", "process")


@dataclass
class StepTiming:
    start: float
    end: float = 0.0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    model_s: float = 0.0
    logits_s: float = 0.0
    sample_s: float = 0.0
    process_s: float = 0.0
    num_reqs: int = 0
    num_decode: int = 0  # requests fed one token (decoding)
    num_verify: int = (
        0  # requests fed their drafted tokens after one (verifying a speculation)
    )
    num_tokens: int = 0  # tokens fed to the forward (decode tokens + prefill chunks)
    num_sampled: int = 0  # tokens generated
    num_finished: int = 0  # requests that finished in this step
    kv_bytes: int = 0  # KV memory in use after the step (every group of the pool)

    @property
    def duration_s(self) -> float:
        return self.end - self.start

    @property
    def num_first_tokens(self) -> int:
        """Requests that finished their prefill in this step (every decode samples one token too)."""
        return self.num_sampled - self.num_decode

    @property
    def decode_only(self) -> bool:
        return self.num_reqs > 0 and self.num_decode == self.num_reqs

    @property
    def no_prefill(self) -> bool:
        """Every request decodes or verifies drafts (the step's rows are num_tokens)."""
        return self.num_reqs > 0 and self.num_decode + self.num_verify == self.num_reqs

    def piece_ms(self) -> dict[str, float]:
        return {p: 1000.0 * getattr(self, f"{p}_s") for p in PIECES}


class StepTimer(StepObserver, ForwardObserver):
    """`with StepTimer(engine) as timer: engine.step() ...` -> timer.steps (one StepTiming per step)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.steps: list[StepTiming] = []
        self.current = StepTiming(start=0.0)
        # when the piece being timed began: the scheduler's (schedule, results), the forward's
        # (prepare, model, logits), the forward itself; and the step's prepare + model + logits
        # seconds when the forward began
        self._t0 = self._piece_t0 = self._forward_t0 = 0.0
        self._forward_pieces_s = 0.0
        device = getattr(getattr(engine, "state", None), "device", None)
        self._sync = None
        if device is not None and getattr(device, "type", "cpu") == "cuda":
            import torch

            self._sync = torch.cuda.synchronize

    def clock(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    # ----------------------------------------------------------------- scheduler events

    def on_step_start(self) -> None:
        self.current = StepTiming(start=self.clock())

    def on_schedule_start(self) -> None:
        self._t0 = self.clock()

    def on_scheduled(self, batch) -> None:
        self.current.schedule_s += self.clock() - self._t0
        if batch is not None:
            self.current.num_reqs = len(batch.reqs)
            self.current.num_decode = batch.num_decode
            self.current.num_verify = sum(1 for r in batch.reqs if r.draft_ids)
            self.current.num_tokens = batch.num_tokens
            self.current.num_sampled = len(batch.sampled_reqs())

    def on_results_start(self, batch) -> None:
        self._t0 = self.clock()

    def on_results_end(self, batch) -> None:
        self.current.process_s += self.clock() - self._t0
        self.current.num_finished = sum(1 for r in batch.reqs if r.finished)

    def on_step_end(self) -> None:
        self.current.end = self.clock()
        self.current.kv_bytes = self.engine.scheduler.kv_bytes_in_use()
        if self.current.num_reqs:
            self.steps.append(self.current)

    def on_forward_start(self, batch) -> None:
        self._forward_t0 = self.clock()
        cur = self.current
        self._forward_pieces_s = cur.prepare_s + cur.model_s + cur.logits_s

    def on_forward_end(self, batch) -> None:
        cur = self.current
        pieces = cur.prepare_s + cur.model_s + cur.logits_s - self._forward_pieces_s
        cur.sample_s += self.clock() - self._forward_t0 - pieces

    # ----------------------------------------------------------------- runner events

    def on_piece_start(self, piece: str) -> None:
        self._piece_t0 = self.clock()

    def on_piece_end(self, piece: str) -> None:
        seconds = self.clock() - self._piece_t0
        cur = self.current
        if piece == "prepare":
            cur.prepare_s += seconds
        elif piece == "model":
            cur.model_s += seconds
        elif piece == "logits":
            cur.logits_s += seconds

    def __enter__(self):
        self.engine.scheduler.add_observer(self)
        self.engine.scheduler.runner.add_observer(self)
        return self

    def __exit__(self, *exc) -> None:
        self.engine.scheduler.remove_observer(self)
        self.engine.scheduler.runner.remove_observer(self)


def mean_pieces_ms(steps: list[StepTiming]) -> dict[str, float] | None:
    """Mean milliseconds per piece (and in total) over `steps`; None for no steps."""
    if not steps:
        return None
    out = {p: sum(s.piece_ms()[p] for s in steps) / len(steps) for p in PIECES}
    out["total"] = 1000.0 * sum(s.duration_s for s in steps) / len(steps)
    return out
