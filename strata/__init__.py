"""Strata: an LLM inference engine with continuous batching, a paged KV cache and radix prefix sharing.

Public API: `Engine` (offline, in-process) and `SamplingParams`. Importing `strata` is cheap; the
engine's heavy modules load when it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.sampling_params import SamplingParams

if TYPE_CHECKING:
    from strata.engine.engine import Engine

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from strata.engine.engine import Engine

        return Engine
    raise AttributeError(name)
