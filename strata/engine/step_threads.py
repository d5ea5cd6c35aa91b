"""How many CPU threads run each forward: chosen by measurement, per size of step.

A CPU step runs its kernels as OpenMP parallel regions, about 200 for one decode step of a small
model. Between regions the threads wait: spinning keeps a core that the HTTP frontend or another
process may need (under load a spinning step can be 20x slower), sleeping costs a wake-up of tens
of microseconds per region (a one-stream step ~2x slower). A step on one thread has no region to
wait at, and for a few rows it is nearly as fast as two; a step of many rows needs every core.
Which wins depends on the step's size and on what else the machine runs, so it is measured:

    size class   = the step's token count, in powers of two (1, 2-3, 4-7, ...)
    per class    = the mean time per token of its steps on 1 thread and on all of them
                   (an exponential moving average for the choice's steps, the last trial for the
                   other's, so both follow the machine's load)
    trials       = one thread is timed in a class only while the next smaller class that has
                   chosen runs on one thread (a larger step parallelises at least as well) and
                   lies at most TRIAL_REACH classes below, or, before any has chosen, for steps
                   of at most 8 tokens: a burst of prefills or a 64-stream decode never pays for
                   a one-thread trial, nor does a server's first long prompt after its decodes
    choice       = the faster; the other is tried again after `interval` steps of the class,
                   an interval that doubles each time the choice holds (up to max_interval) and
                   falls back to min_interval when it flips; the choice flips at once when its
                   own steps slow down past 1.25x the other's last measure (a neighbour started)

Threads never change a row's result: every kernel splits work so that a row's arithmetic is the
same on any number of threads (tests/unit/test_step_threads.py checks the model's logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the largest step (tokens) that times one thread before any smaller step has: one stream's decode
# and a verification of a few drafts; a burst of prefills and a 64-stream decode run on every core
# until smaller steps say otherwise
FIRST_TRIAL_MAX_TOKENS = 8
# a one-thread trial reaches at most this many size classes (a factor of 2 each) past the largest
# size that chose one thread: one-token decodes that run faster on one thread say nothing about a
# 2048-token prefill
TRIAL_REACH = 2
# the choice's own steps must be this much slower than the other's last measure to switch at once
# (one slow step, a collection or a page fault, is not a neighbour)
SWITCH_MARGIN = 1.25


@dataclass
class _SizeClass:
    seconds_per_token: dict[int, float] = field(
        default_factory=dict
    )  # threads -> moving average
    choice: int = 0  # threads, once both have been timed
    steps: int = 0  # steps of this class since the last trial of the other choice
    interval: int = 0


class StepThreads:
    """Picks 1 or `max_threads` threads for a step of `num_tokens` tokens (`threads_for`) and learns
    from each step's time (`record`). Pure bookkeeping: the caller sets the threads and times the step."""

    def __init__(
        self,
        max_threads: int,
        alpha: float = 0.25,
        min_interval: int = 8,
        max_interval: int = 512,
    ):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.options = (1, max_threads) if max_threads > 1 else (1,)
        self.alpha = alpha
        self.min_interval = min_interval
        self.max_interval = max_interval
        self.classes: dict[int, _SizeClass] = {}

    @staticmethod
    def size_class(num_tokens: int) -> int:
        return max(1, num_tokens).bit_length()

    def threads_for(self, num_tokens: int) -> int:
        if len(self.options) == 1:
            return self.options[0]
        k = self.size_class(num_tokens)
        c = self.classes.setdefault(k, _SizeClass(interval=self.min_interval))
        one, every = self.options
        if every not in c.seconds_per_token:
            return every  # all threads first: the usual winner
        if not c.choice:  # one thread still untimed
            return one if self._may_try_one(k) else every
        if c.steps >= c.interval and (c.choice == one or self._may_try_one(k)):
            return self._other(c.choice)  # a trial of the choice not taken
        return c.choice

    def _may_try_one(self, k: int) -> bool:
        """One thread is worth a (slow) trial in class k unless the nearest smaller class that has
        chosen runs on all threads: a larger step parallelises at least as well as a smaller one.
        So trials happen only up to the size where one thread stops winning."""
        smaller = [j for j, c in self.classes.items() if j < k and c.choice]
        decode_sized = k <= self.size_class(FIRST_TRIAL_MAX_TOKENS)
        if not smaller:
            return decode_sized  # nothing measured below: only a step small enough to be a decode's
        nearest = max(smaller)
        return self.classes[nearest].choice == self.options[0] and (
            decode_sized or k - nearest <= TRIAL_REACH
        )

    def record(self, num_tokens: int, threads: int, seconds: float) -> None:
        if len(self.options) == 1 or threads not in self.options:
            return
        c = self.classes.setdefault(
            self.size_class(num_tokens), _SizeClass(interval=self.min_interval)
        )
        per_token = seconds / max(1, num_tokens)
        old = c.seconds_per_token.get(threads)
        if old is None or (c.choice and threads != c.choice):
            c.seconds_per_token[threads] = (
                per_token  # a trial: the machine may have changed since
            )
        else:
            c.seconds_per_token[threads] = old + self.alpha * (per_token - old)
        if len(c.seconds_per_token) < len(self.options):
            return  # all threads until one thread is worth a trial here (_may_try_one)
        best = min(self.options, key=lambda t: (c.seconds_per_token[t], -t))
        if not c.choice:  # both timed for the first time
            c.choice, c.steps = best, 0
        elif threads != c.choice:  # the trial of the other choice
            c.steps = 0
            if best == c.choice:
                c.interval = min(self.max_interval, 2 * c.interval)
            else:
                c.choice, c.interval = best, self.min_interval
        elif (
            c.seconds_per_token[threads]
            > SWITCH_MARGIN * c.seconds_per_token[self._other(threads)]
        ):
            c.choice, c.steps, c.interval = (
                self._other(threads),
                0,
                self.min_interval,
            )  # a neighbour: now
        else:
            c.steps += 1

    def _other(self, threads: int) -> int:
        return self.options[0] if threads == self.options[1] else self.options[1]

    def describe(self) -> dict[str, dict[str, float | int]]:
        """Per size class ("tokens 4-7"): the choice and each option's microseconds per token."""
        out: dict[str, dict[str, float | int]] = {}
        for k, c in sorted(self.classes.items()):
            lo, hi = 1 << (k - 1), (1 << k) - 1
            name = f"tokens {lo}" if lo == hi else f"tokens {lo}-{hi}"
            out[name] = {
                "threads": c.choice,
                **{
                    f"us_per_token_{t}t": round(s * 1e6, 1)
                    for t, s in sorted(c.seconds_per_token.items())
                },
            }
        return out
