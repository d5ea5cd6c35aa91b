"""Expert-parallel load balancing (EPLB): redundant expert slots and where each expert goes.

From one MoE layer's measured load (tokens routed to each logical expert since the last placement,
`DecoderForCausalLM.expert_load()`), with P = E + R physical slots over N ranks of S = P / N slots:

1. replicate: each expert starts with one slot; each of the R extra slots goes to the expert with the
   highest load per replica at that moment (a replicated expert's rows are split evenly over its
   copies: row t goes to replica t mod replicas, `EPExperts`);
2. pack: the P (expert, load / replicas) items, heaviest first, each go to the rank with the least
   load so far that has a free slot and does not already hold that expert (greedy balanced
   packing; every rank ends with exactly S slots);
3. since copies are whole items, fewer replicas of the hot experts can pack better: every count k
   of step 1's spare slots is tried (the rest copy the coldest experts) and the packing with the
   lowest busiest rank is kept.

`plan_placement` is pure arithmetic (torch-free) and deterministic, so it can be tested on numbers;
`rank_loads` predicts the per-rank load of a placement; `load_placements` installs placements into a
model's `EPExperts`, reading the slots' weights back from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def initial_placement(
    num_experts: int,
    num_redundant: int,
    world_size: int,
    flag: str = "--ep-num-redundant-experts",
) -> tuple[int, ...]:
    """Before any load is measured: experts in order, the redundant slots holding experts 0, 1, ...
    (`flag`: the option that set num_redundant, named in the error)."""
    slots = num_experts + num_redundant
    if slots % world_size:
        raise ValueError(
            f"{num_experts} experts + {num_redundant} redundant slots do not split over {world_size} ranks; "
            f"choose {flag} so that the sum is a multiple of --ep-size"
        )
    return tuple(range(num_experts)) + tuple(
        e % num_experts for e in range(num_redundant)
    )


def replication_order(load: Sequence[float], num_spare: int) -> list[int]:
    """The expert each spare slot goes to, in turn: the highest load per replica at that moment
    (ties: the lower expert id)."""
    replicas, order = [1] * len(load), []
    for _ in range(num_spare):
        best = max(range(len(load)), key=lambda e: (load[e] / replicas[e], -e))
        replicas[best] += 1
        order.append(best)
    return order


def replicate(load: Sequence[float], num_slots: int) -> list[int]:
    """Replicas per expert: one each, then the spare slots in `replication_order`."""
    replicas = [1] * len(load)
    for e in replication_order(load, num_slots - len(load)):
        replicas[e] += 1
    return replicas


def pack(
    load: Sequence[float], replicas: Sequence[int], world_size: int
) -> tuple[int, ...]:
    """Physical slots -> logical experts, rank by rank (S slots each), balanced greedily."""
    num_slots = sum(replicas)
    per_rank = num_slots // world_size
    items = sorted(
        (
            (load[e] / replicas[e], e)
            for e in range(len(load))
            for _ in range(replicas[e])
        ),
        key=lambda item: (-item[0], item[1]),
    )
    totals = [0.0] * world_size
    held: list[list[int]] = [[] for _ in range(world_size)]
    for weight, e in items:
        free = [r for r in range(world_size) if len(held[r]) < per_rank]
        fresh = [
            r for r in free if e not in held[r]
        ] or free  # two copies on one rank balance nothing
        rank = min(fresh, key=lambda r: (totals[r], r))
        held[rank].append(e)
        totals[rank] += weight
    return tuple(e for r in range(world_size) for e in sorted(held[r]))


def plan_placement(
    load: Sequence[float], num_slots: int, world_size: int
) -> tuple[int, ...]:
    """The placement of one layer for this measured load (see the module docstring).

    Copies come in whole items, so more replicas of a hot expert can pack worse (two hot experts in
    3 copies each over 4 ranks leave two ranks with two copies; 2 copies each would give every rank
    one). So the first k of replicate()'s spare slots are tried for every k, the other spare slots
    holding copies of the coldest experts (which cost nothing), and the best packing is kept."""
    if num_slots % world_size or num_slots < len(load):
        raise ValueError(
            f"{num_slots} slots for {len(load)} experts over {world_size} ranks"
        )
    E, spare = len(load), num_slots - len(load)
    order = replication_order(load, spare)
    cold = sorted(range(E), key=lambda e: (load[e], e))
    best: tuple[float, tuple[int, ...]] | None = None
    for k in range(spare, -1, -1):
        replicas = [1] * E
        for e in order[:k]:
            replicas[e] += 1
        for i in range(spare - k):
            replicas[cold[i % E]] += 1
        placement = pack(load, replicas, world_size)
        worst = max(rank_loads(load, placement, world_size))
        if best is None or worst < best[0]:
            best = (worst, placement)
    assert best is not None  # at least one placement was tried
    return best[1]


def rank_loads(
    load: Sequence[float], placement: Sequence[int], world_size: int
) -> list[float]:
    """Expected load of each rank under a placement: each expert's load split evenly over its copies."""
    copies = [0] * len(load)
    for e in placement:
        copies[e] += 1
    per_rank = len(placement) // world_size
    out = [0.0] * world_size
    for slot, e in enumerate(placement):
        out[slot // per_rank] += load[e] / copies[e]
    return out


def imbalance(loads: Sequence[float]) -> float | None:
    """max / mean over ranks (1.0: perfectly even); None before any load."""
    total = sum(loads)
    return max(loads) / (total / len(loads)) if total else None


def load_placements(
    model, model_dir: str | Path, placements: dict[int, Sequence[int]], dtype
) -> None:
    """Give each listed MoE layer's `EPExperts` its new placement and refill its slots from the
    checkpoint (memory-mapped safetensors: only the experts' tensors of those layers are read)."""
    from safetensors import safe_open

    from strata.distributed.layers import expert_layers
    from strata.weights.loader import checkpoint_files

    layers = expert_layers(model)
    for i, placement in placements.items():
        layers[int(i)].set_placement(tuple(placement))
    wanted = {f"layers.{int(i)}." for i in placements}
    for path in checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safetensors handles are not mappings
                name = hf_name.removeprefix("model.")
                for old, new in model.RENAMES:
                    name = name.replace(old, new)
                if ".experts." not in name:
                    continue
                module, _, rest = name.partition(".experts.")
                if not any(module.startswith(prefix) for prefix in wanted):
                    continue
                layer = int(module.split(".")[1])
                layers[layer].load(
                    rest, model.expert_tensor(rest, f.get_tensor(hf_name).to(dtype))
                )
