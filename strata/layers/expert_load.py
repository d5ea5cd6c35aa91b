"""Arithmetic on a mixture-of-experts model's per-expert load counters, `{layer: [tokens routed to
each expert]}` as `DecoderForCausalLM.expert_load()` returns them (a token counts once for each of
its top-k experts): the difference of two readings and how uneven the load is.

Torch-free: the benchmark reports and the server's engine process use it on plain lists.
"""

from __future__ import annotations

from typing import Any


def expert_load_delta(
    after: dict[int, list[int]], before: dict[int, list[int]]
) -> dict[int, list[int]]:
    """Tokens each expert got between two readings of the counters."""
    return {
        layer: [n - m for n, m in zip(counts, before[layer])]
        for layer, counts in after.items()
    }


def expert_load_summary(load: dict[int, list[int]]) -> dict[int, dict[str, Any]]:
    """Per layer: `tokens` routed, the `busiest_expert` and its `max_tokens`, `mean_tokens` per
    expert, `max_over_mean` (the imbalance: 1.0 is perfectly even, E means one expert got every
    token; None before any token) and `idle_experts` (that got none)."""
    summary = {}
    for layer, counts in load.items():
        tokens = sum(counts)
        busiest = max(range(len(counts)), key=counts.__getitem__)
        mean = tokens / len(counts)
        summary[layer] = {
            "tokens": tokens,
            "busiest_expert": busiest,
            "max_tokens": counts[busiest],
            "mean_tokens": mean,
            "max_over_mean": counts[busiest] / mean if tokens else None,
            "idle_experts": counts.count(0),
        }
    return summary
