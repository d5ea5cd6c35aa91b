"""The scheduler's extension points: how other packages plug into `Scheduler` without touching
its internals.

- `KVTransferPeer`: a subsystem that moves requests' KV across the engine's boundary (prefill/decode
  disaggregation, strata.disagg). At most one is attached (`Scheduler.attach_peer`); it is polled
  every step, keeps the scheduler stepping while it has work, and sees a finished request's KV
  before its pages are released. It acts on the scheduler only through the scheduler's public
  request operations (`validate_request`, `reserve_prefilled`, `add_prefilled`,
  `fail_prefilled`, `fail_request`, `abort`).
- `StepObserver`: told what each step does (`Scheduler.add_observer`); tools that model or time
  the engine (the bench's step timer, the planner's calibration) subscribe instead of wrapping the
  scheduler's methods.
- `ForwardObserver`: told where each forward of the model runner is (`ModelRunner.add_observer`):
  its preparation, the model and the logits, for the step timer's pieces.

Both run on the scheduler thread; nothing here needs a lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strata.engine.batch import ScheduleBatch
    from strata.engine.request import Req


class KVTransferPeer(Protocol):
    """A subsystem that hands requests' KV to or from another engine (PD disaggregation).

    Contract (all calls on the scheduler thread, none may block):
      poll()              at the start of every step, before the batch is scheduled. The peer
                          receives and sends its messages here and may call the scheduler's public
                          request operations (e.g. `add_prefilled` once a prompt's KV is in).
                          It must not raise for anything a remote peer sent.
      busy()              True while the peer has work that needs further steps although no request
                          is queued or running (a KV transfer under way); `Scheduler.has_work`
                          includes it.
      before_release(req) a running request has finished (any reason) and its pages still hold
                          its KV: the peer may read `req.pages` (e.g. copy the prompt's KV out). It
                          must not change the request, its pages or the scheduler, and must not
                          raise.
    """

    def poll(self) -> None: ...

    def busy(self) -> bool: ...

    def before_release(self, req: Req) -> None: ...


class StepObserver(Protocol):
    """Told what each `Scheduler.step()` does, in this order:

      on_step_start()          step() entered (before the prefix cache and the peer are polled)
      on_schedule_start()      the batch is about to be picked
      on_scheduled(batch)      the batch picked (None: nothing runs this step)
      on_forward_start(batch)  the runner's forward is called
      on_forward_end(batch)    it returned or raised
      on_results_start(batch)  the forward succeeded; its tokens are about to be appended
      on_results_end(batch)    appended: finished requests are marked finished and released
      on_step_end()            step() returns (also after a failed forward, which fails the
                               batch's requests and skips the two results events)

    The methods here do nothing: an observer subclasses this and overrides what it needs. An
    observer reads; it must not change the scheduler, the batch or its requests. What it raises
    propagates out of step().
    """

    def on_step_start(self) -> None:
        return None

    def on_schedule_start(self) -> None:
        return None

    def on_scheduled(self, batch: ScheduleBatch | None) -> None:
        return None

    def on_forward_start(self, batch: ScheduleBatch) -> None:
        return None

    def on_forward_end(self, batch: ScheduleBatch) -> None:
        return None

    def on_results_start(self, batch: ScheduleBatch) -> None:
        return None

    def on_results_end(self, batch: ScheduleBatch) -> None:
        return None

    def on_step_end(self) -> None:
        return None


class ForwardObserver(Protocol):
    """Told where a `ModelRunner.forward` is: `on_piece_start(piece)` and `on_piece_end(piece)`
    (also when the piece raised) around each of its pieces, in order: "prepare" (the batch's
    tensors), "model" (the model's forward over every fed token) and, when a row samples,
    "logits" (the LM head over the sampled rows). What the forward does outside them (the
    grammar masks, sampling, moving the sampled ids to the host) is in no piece. Same rules as
    `StepObserver`: it reads, and what it raises propagates out of the forward.
    """

    def on_piece_start(self, piece: str) -> None:
        return None

    def on_piece_end(self, piece: str) -> None:
        return None
