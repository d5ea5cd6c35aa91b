"""The same workload on several targets in one invocation, alternating targets round by round.

Round r runs every target once, in the given order on even rounds and reversed on odd rounds
(A B C, C B A, A B C ...), so a slow drift of the machine (another job, thermal throttling) lands
on every target alike. Each round uses its own dataset seed (seed + r), the same for every target,
so no target is served from a cache warmed by the previous round. Reported per figure: the median
over rounds, and its ratio to the first target's median (direction in the figure's name: `tok/s`,
`req/s` and hit rates are better higher, `ms` better lower).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from strata.bench.metrics import median
from strata.bench.targets import Target

# (target, round index) -> {figure name: value}; raise ValueError to skip a target (message shown)
RunFn = Callable[[Target, int], dict[str, float | None]]


@dataclass
class CompareResult:
    mode: str
    rounds: int
    targets: list[str]  # labels, first is the reference
    # target -> figure -> one value per round
    values: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # target -> why
    figures: list[str] = field(default_factory=list)  # in first-seen order
    # (round, target, 1-minute load average when its run started): a shared machine shows here
    load_averages: list[tuple[int, str, float]] = field(default_factory=list)

    def median(self, target: str, figure: str) -> float | None:
        return median(self.values.get(target, {}).get(figure, []))

    def ratio(self, target: str, figure: str) -> float | None:
        """target's median / the first target's median (None if either is missing or zero)."""
        base = self.median(self.targets[0], figure)
        value = self.median(target, figure)
        if base is None or value is None or base == 0:
            return None
        return value / base


def higher_is_better(figure: str) -> bool:
    return not any(word in figure for word in ("(ms)", "(MiB)", "failed", "short"))


def round_order(targets: list[Target], round_index: int) -> list[Target]:
    return list(targets) if round_index % 2 == 0 else list(reversed(targets))


def run_compare(
    mode: str, targets: list[Target], rounds: int, run: RunFn, log=None
) -> CompareResult:
    """Run `run` for every target, `rounds` times, alternating the order; targets that cannot
    run this mode are skipped with their reason."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = CompareResult(mode=mode, rounds=rounds, targets=[t.label for t in targets])
    live = []
    for t in targets:
        reason = t.unavailable(mode)
        if reason:
            result.skipped[t.label] = reason
            log(f"skipping {t.label}: {reason}")
        else:
            live.append(t)
    for r in range(rounds):
        for t in round_order(live, r):
            if t.label in result.skipped:
                continue
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            result.load_averages.append((r, t.label, load))
            log(f"round {r + 1}/{rounds}: {t.label} (load average {load:.2f})")
            try:
                figures = run(t, r)
            except (ValueError, RuntimeError, FileNotFoundError) as exc:
                result.skipped[t.label] = str(exc)
                log(f"skipping {t.label}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - a broken peer must not lose the other targets' figures
                result.skipped[t.label] = f"failed: {type(exc).__name__}: {exc}"
                log(
                    f"skipping {t.label} after an unexpected error:\n{traceback.format_exc()}"
                )
                continue
            per_target = result.values.setdefault(t.label, {})
            for name, value in figures.items():
                if name not in result.figures:
                    result.figures.append(name)
                per_target.setdefault(name, []).append(value)
    return result
