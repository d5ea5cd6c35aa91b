"""`strata plan memory`: where a large model's bytes go on paper, from its config.json and the
hardware's published figures, and what each choice buys (docs/PLANNING.md, "Memory on paper").

    census         parameters by kind, from the model built on the meta device (Strata's own module
                   tree, so what it counts is what the engine loads; no weights are read)
    Hardware       per-device memory, bandwidth and peak; the host link and host memory; storage
    plan_memory    per Engram table placement (device | host | mmap): bytes per device, KV tokens left,
                   the prefetch's cost and whether the layers before the Engram layer hide it; the
                   KV tiers (device, host, storage) and what reloading a context costs from each
    plan_draft     a mixture-of-experts draft model with and without redundant expert slots: memory
                   per device and the draft forward's step time with EPLB's own placement
                   (`strata.distributed.eplb`) of a skewed expert load

Step times are a roofline (bytes read over the device's bandwidth or FLOPs over its peak, whichever
is longer), not a measurement: pass a measured `decode_step_s` where one exists. Torch is imported
only inside `census` (the meta model).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

GiB = 2**30

# Spec-sheet figures (per device): HBM bytes, HBM bytes/s, dense bf16 FLOP/s, device<->host bytes/s
# one way, host memory per device, NVLink bytes/s one way. Any of them can be overridden.
HARDWARE: dict[str, dict[str, float]] = {
    "h100": dict(
        memory=80e9,
        bandwidth=3.35e12,
        flops=989e12,
        host_link=55e9,
        host_memory=256e9,
        interconnect=450e9,
    ),
    "h200": dict(
        memory=141e9,
        bandwidth=4.8e12,
        flops=989e12,
        host_link=55e9,
        host_memory=256e9,
        interconnect=450e9,
    ),
    # Grace-Blackwell: NVLink-C2C to the Grace CPU (900 GB/s both ways), 480 GB LPDDR5X per two GPUs
    "gb300": dict(
        memory=288e9,
        bandwidth=8e12,
        flops=2.5e15,
        host_link=450e9,
        host_memory=240e9,
        interconnect=900e9,
    ),
}

# bits per parameter of each kind of weight, as a format name or a number
WEIGHT_FORMATS = {"fp4": 4.25, "fp8": 8.0, "bf16": 16.0, "fp16": 16.0, "fp32": 32.0}


def bits_of(fmt: str | float) -> float:
    """Bits per parameter of a format name (fp4 counts its e8m0 scale per 32 values) or a number."""
    if isinstance(fmt, (int, float)):
        return float(fmt)
    if fmt in WEIGHT_FORMATS:
        return WEIGHT_FORMATS[fmt]
    try:
        return float(fmt)
    except ValueError:
        raise ValueError(
            f"unknown weight format {fmt!r}: use one of {', '.join(WEIGHT_FORMATS)} or bits per value"
        ) from None


@dataclass(frozen=True)
class Census:
    """A model's parameters by kind (counts, not bytes)."""

    name: str
    num_layers: int
    hidden_size: int
    dense: int  # attention, dense MLPs, shared experts, routers, norms, Engram's projections
    embeddings: int  # the input embedding and the LM head
    experts: int  # routed experts over every MoE layer
    moe_layers: int
    num_experts: int  # routed experts per MoE layer (0: none)
    top_k: int
    engram_tables: int  # Engram table values over every Engram layer
    engram_layers: tuple[int, ...]
    engram_tables_per_layer: int  # rows one token reads per Engram layer
    engram_dim: int  # values per row
    kv_split: int  # ways one token's KV splits over tensor-parallel devices (KV heads; 1: MQA/latent)
    kv_bytes_per_token: (
        float  # at the planned context, bf16 (scaled by the KV format later)
    )

    @property
    def per_expert(self) -> int:
        """Parameters of one routed expert in one layer."""
        return self.experts // max(self.moe_layers * self.num_experts, 1)

    @property
    def total(self) -> int:
        return self.dense + self.embeddings + self.experts + self.engram_tables

    @property
    def active(self) -> int:
        """Parameters one token computes with: the dense part, its top-k experts, the LM head."""
        return (
            self.dense
            + self.embeddings // 2
            + self.top_k * self.per_expert * self.moe_layers
        )


def census(model: str | Path, context_len: int = 65536, page_size: int = 64) -> Census:
    """Count a model's parameters by building Strata's module tree for its config.json (a model
    directory or the file) on the meta device; the KV bytes per token one request of
    `context_len` tokens holds, in bf16."""
    import torch

    from strata.bench.kv_layout import bytes_at_context, read_config
    from strata.models import get_model_class

    name, mc = read_config(model)
    if Path(model).is_file() and Path(model).stem != "config":
        name = Path(model).stem
    cls = get_model_class(mc.architecture)
    with torch.device("meta"):
        net = cls(mc, max_positions=min(context_len, 4096), rope_device="meta")
    counts = {"dense": 0, "embeddings": 0, "experts": 0, "engram_tables": 0}
    for pname, p in net.named_parameters():
        if ".experts." in pname and ".shared_experts." not in pname:
            counts["experts"] += p.numel()
        elif pname.endswith("engram.embedding"):
            counts["engram_tables"] += p.numel()
        elif pname.startswith(("embed_tokens.", "lm_head.")):
            counts["embeddings"] += p.numel()
        else:
            counts["dense"] += p.numel()
    if mc.tie_word_embeddings:
        counts["embeddings"] *= (
            2  # one tensor, read twice (a lookup and the head's matmul)
        )
    moe = mc.moe
    engram = mc.dsv4.engram if mc.dsv4 is not None else None
    return Census(
        name=name,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        moe_layers=sum(spec.moe for spec in mc.layers) if moe else 0,
        num_experts=moe.num_experts if moe else 0,
        top_k=moe.top_k if moe else 0,
        engram_layers=engram.layers if engram else (),
        engram_tables_per_layer=engram.num_tables if engram else 0,
        engram_dim=engram.dim if engram else 0,
        kv_split=1 if mc.mla is not None or mc.dsv4 is not None else mc.num_kv_heads,
        kv_bytes_per_token=bytes_at_context(mc, torch.bfloat16, context_len, page_size),
        **counts,
    )


@dataclass(frozen=True)
class Hardware:
    devices: int
    memory: float  # bytes per device
    bandwidth: float  # device memory bytes/s
    flops: float  # dense bf16 FLOP/s per device
    host_link: float  # device <-> host bytes/s, one way, per device
    host_memory: float  # bytes of host memory per device
    interconnect: (
        float  # device <-> device bytes/s, one way, per device (expert all-to-all)
    )
    host_gather_rate: float = (
        8e6  # table rows/s one host thread gathers (random 128-byte rows)
    )
    gather_threads: int = 1
    storage_bandwidth: float = 6e9  # bytes/s of the storage a node reads
    storage_iops: float = 1e6  # random 4 KiB reads/s
    storage_capacity: float = 30e12  # bytes of shared storage for the KV tier
    mmap_hit_rate: float = (
        0.0  # share of mapped table rows the page cache already holds
    )

    @classmethod
    def preset(cls, name: str, devices: int, **overrides: float | None) -> Hardware:
        if name not in HARDWARE:
            raise ValueError(
                f"unknown hardware {name!r}: use one of {', '.join(HARDWARE)}"
            )
        figures = {**HARDWARE[name]}
        figures.update({k: v for k, v in overrides.items() if v is not None})
        hw = cls(devices=devices, **figures)  # type: ignore[arg-type]
        hw.check()
        return hw

    def check(self) -> None:
        if self.devices < 1:
            raise ValueError(f"--devices must be at least 1; got {self.devices}")
        for k, v in asdict(self).items():
            if k != "mmap_hit_rate" and v <= 0:
                raise ValueError(f"{k} must be positive; got {v}")
        if not 0 <= self.mmap_hit_rate <= 1:
            raise ValueError(
                f"--mmap-hit-rate is a share in [0, 1]; got {self.mmap_hit_rate}"
            )


@dataclass(frozen=True)
class Formats:
    """Bits per value of each kind of weight and of the KV cache."""

    dense: float = 8.0
    experts: float = 4.25
    embeddings: float = 16.0
    engram: float = 16.0
    kv: float = 16.0


@dataclass(frozen=True)
class Layout:
    """How a deployment splits the model over its devices."""

    tp: int = 1  # dense weights split over tp devices; devices // tp attention (data-parallel) groups
    ep: int | None = None  # experts split over ep devices (None: every device)
    redundant_experts: int = 0  # extra expert slots per MoE layer (EPLB)
    mem_fraction: float = 0.88  # of each device's memory for weights, tables and KV
    context_len: int = 65536

    def check(self, c: Census, devices: int) -> None:
        ep = self.ep or devices
        if self.tp < 1 or devices % self.tp:
            raise ValueError(
                f"--tp-size {self.tp} must divide the {devices} devices into attention groups"
            )
        if ep < 1 or ep > devices:
            raise ValueError(f"--ep-size must be between 1 and {devices}; got {ep}")
        if c.moe_layers and (c.num_experts + self.redundant_experts) % ep:
            raise ValueError(
                f"{c.num_experts} experts + {self.redundant_experts} redundant slots do not split "
                f"over {ep} expert-parallel devices; choose a count that makes the sum a multiple of {ep}"
            )
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(
                f"--mem-fraction-static is a share in (0, 1]; got {self.mem_fraction}"
            )
        if self.context_len < 1:
            raise ValueError(f"--context-len must be positive; got {self.context_len}")


def expert_load(
    num_experts: int,
    skew: float,
    seed: int = 0,
    measured: Sequence[float] | None = None,
) -> list[float]:
    """Each expert's share of the routed tokens: a measured load (normalised), else Zipf with
    exponent `skew` over a fixed shuffle of the experts (0: uniform)."""
    if measured is not None:
        if len(measured) != num_experts or sum(measured) <= 0:
            raise ValueError(
                f"an expert load needs {num_experts} non-negative counts with a positive sum"
            )
        total = float(sum(measured))
        return [m / total for m in measured]
    weights = [1.0 / (r + 1) ** skew for r in range(num_experts)]
    random.Random(seed).shuffle(weights)
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class ExpertStep:
    """Each expert-parallel device's share of a MoE layer's work in a step of `tokens` tokens."""

    slots_per_device: int
    rows: list[
        float
    ]  # routed token-rows each device computes (and receives and sends back)
    distinct: list[
        float
    ]  # expected expert slots each device reads at least one row for

    @property
    def imbalance(self) -> float:
        """The busiest device's rows over the mean (1.0: even)."""
        mean = sum(self.rows) / len(self.rows)
        return max(self.rows) / mean if mean else 1.0


def expert_step(
    load: Sequence[float], tokens: float, top_k: int, ep: int, redundant: int
) -> ExpertStep:
    """One MoE layer under EPLB's placement (`strata.distributed.eplb.plan_placement`) of `load`
    with `redundant` extra slots over `ep` devices; a replicated expert's rows split evenly."""
    from strata.distributed.eplb import initial_placement, plan_placement, rank_loads

    E = len(load)
    slots = E + redundant
    initial_placement(
        E, redundant, ep
    )  # the engine's check: slots must split over the ranks
    placement = plan_placement(load, slots, ep)
    copies = [0] * E
    for e in placement:
        copies[e] += 1
    per = slots // ep
    distinct = [0.0] * ep
    for slot, e in enumerate(placement):
        slot_rows = load[e] * tokens * top_k / copies[e]
        distinct[slot // per] += 1 - math.exp(
            -slot_rows
        )  # P(at least one row), Poisson
    rows = [x * tokens * top_k for x in rank_loads(load, placement, ep)]
    return ExpertStep(per, rows, distinct)


def forward_time(
    c: Census,
    hw: Hardware,
    fm: Formats,
    lay: Layout,
    tokens: float,
    context: float,
    load: Sequence[float] | None = None,
    one_group: bool = False,
) -> float:
    """Roofline seconds of one forward of `tokens` tokens over the deployment (spread over its
    attention groups, or all in one with `one_group`: a single request), each reading `context`
    tokens of KV. Each device takes its bytes over its bandwidth or its FLOPs over its peak,
    whichever is longer, plus sending its routed rows' hidden states to their experts' devices and
    back (bf16, over the interconnect, not overlapped); the step is its slowest device's."""
    per_group = tokens if one_group else tokens / (hw.devices // lay.tp)
    dense_bytes = (c.dense * fm.dense + c.embeddings / 2 * fm.embeddings) / 8 / lay.tp
    kv_bytes = per_group * context * c.kv_bytes_per_token * fm.kv / 16
    dense_flops = 2 * per_group * (c.dense + c.embeddings / 2) / lay.tp
    if not c.moe_layers:
        return max((dense_bytes + kv_bytes) / hw.bandwidth, dense_flops / hw.flops)
    ep = lay.ep or hw.devices
    step = expert_step(
        load or [1 / c.num_experts] * c.num_experts,
        tokens,
        c.top_k,
        ep,
        lay.redundant_experts,
    )
    expert_bytes = c.per_expert * fm.experts / 8
    slowest = 0.0
    for rows, distinct in zip(step.rows, step.distinct):
        read = dense_bytes + kv_bytes + c.moe_layers * distinct * expert_bytes
        flops = dense_flops + 2 * c.moe_layers * rows * c.per_expert
        sent = 2 * c.moe_layers * rows * c.hidden_size * 2 if ep > 1 else 0.0
        slowest = max(
            slowest,
            max(read / hw.bandwidth, flops / hw.flops) + sent / hw.interconnect,
        )
    return slowest


@dataclass(frozen=True)
class Prefetch:
    """Engram rows a step of `tokens` tokens gathers ahead, and whether the layers before each
    Engram layer hide it."""

    tokens: int
    rows: int
    bytes: float
    seconds: float  # gather (host) or read (storage), plus the copy over the host link
    hidden_by: (
        float  # seconds of forward before the first Engram layer that needs its rows
    )
    exposed: float  # what the step waits for


@dataclass(frozen=True)
class PlacementPlan:
    placement: str  # device | host | mmap
    device_bytes: float  # per device: weights + tables on it
    table_bytes_on_device: float  # per device
    table_bytes_in_host: float  # per device's share of host memory
    kv_bytes: float  # per device
    kv_tokens: int  # over the deployment
    requests_at_context: int
    kv_gain: float  # kv_tokens over the device placement's, less 1
    host_kv_tokens: (
        int  # what the host tier (L2) holds beside the tables, over the deployment
    )
    prefetch: list[Prefetch] = field(default_factory=list)


def weight_bytes_per_device(c: Census, hw: Hardware, fm: Formats, lay: Layout) -> float:
    ep = lay.ep or hw.devices
    dense = (c.dense * fm.dense + c.embeddings * fm.embeddings) / 8 / lay.tp
    slots = (c.num_experts + lay.redundant_experts) / ep
    return dense + c.moe_layers * slots * c.per_expert * fm.experts / 8


def prefetch(
    c: Census,
    hw: Hardware,
    fm: Formats,
    placement: str,
    tokens: int,
    step_s: float,
) -> Prefetch:
    """The rows of one step, gathered in layer order on `gather_threads` host threads (host) or
    read from the mapped file (mmap: one 4 KiB read per row the page cache lacks), then copied over
    the host link; an Engram layer's rows must have arrived when the forward reaches it, and the
    step's forward reaches layer l after l / num_layers of `step_s` (the step's ids are known only
    when it is scheduled, so nothing earlier hides it)."""
    per_layer_rows = tokens * c.engram_tables_per_layer
    row_bytes = c.engram_dim * fm.engram / 8
    if placement == "host":
        per_row = 1 / (hw.host_gather_rate * hw.gather_threads)
    else:
        misses = 1 - hw.mmap_hit_rate
        per_row = misses * max(1 / hw.storage_iops, 4096 / hw.storage_bandwidth) + (
            1 - misses
        ) / (hw.host_gather_rate * hw.gather_threads)
    copy = row_bytes / hw.host_link
    done, exposed, first = 0.0, 0.0, None
    for layer in c.engram_layers:
        done += per_layer_rows * (per_row + copy)
        window = step_s * layer / c.num_layers
        first = window if first is None else first
        exposed = max(exposed, done - window)
    rows = per_layer_rows * len(c.engram_layers)
    return Prefetch(tokens, rows, rows * row_bytes, done, first or 0.0, exposed)


def plan_memory(
    c: Census,
    hw: Hardware,
    fm: Formats,
    lay: Layout,
    step_tokens: Sequence[int] = (64, 8192),
    host_kv_fraction: float = 0.5,
    decode_step_s: float | None = None,
) -> list[PlacementPlan]:
    """One PlacementPlan per Engram table placement (just `device` for a model without tables).
    Tables on the device are sharded by rows over every device; in host memory or mapped they take
    no device memory, and host tables take their bytes out of the host KV tier's share
    (`host_kv_fraction` of host memory)."""
    lay.check(c, hw.devices)
    usable = hw.memory * lay.mem_fraction
    weights = weight_bytes_per_device(c, hw, fm, lay)
    tables = c.engram_tables * fm.engram / 8
    kv_per_token = c.kv_bytes_per_token * fm.kv / 16
    groups = hw.devices // lay.tp
    placements = ("device", "host", "mmap") if c.engram_tables else ("device",)
    out: list[PlacementPlan] = []
    base_tokens = None
    for placement in placements:
        on_device = tables / hw.devices if placement == "device" else 0.0
        in_host = tables / hw.devices if placement == "host" else 0.0
        kv = usable - weights - on_device
        # an attention group's devices split a token's KV only as far as its KV heads go
        split = min(lay.tp, c.kv_split)
        tokens = int(max(kv, 0.0) * split / kv_per_token) * groups
        base_tokens = tokens if base_tokens is None else base_tokens
        host_left = (hw.host_memory * host_kv_fraction - in_host) * hw.devices
        plan = PlacementPlan(
            placement=placement,
            device_bytes=weights + on_device,
            table_bytes_on_device=on_device,
            table_bytes_in_host=in_host,
            kv_bytes=max(kv, 0.0),
            kv_tokens=tokens,
            requests_at_context=tokens // lay.context_len,
            kv_gain=tokens / base_tokens - 1 if base_tokens else 0.0,
            host_kv_tokens=max(int(host_left / kv_per_token), 0),
        )
        if placement != "device":
            for n in step_tokens:
                step = (
                    decode_step_s
                    if decode_step_s is not None and n <= 512
                    else forward_time(c, hw, fm, lay, n, lay.context_len)
                )
                plan.prefetch.append(prefetch(c, hw, fm, placement, n, step))
        out.append(plan)
    return out


@dataclass(frozen=True)
class TierReload:
    """Bringing one request's `context_len` tokens of KV back, from each place it can live."""

    bytes: float
    host_s: float  # host memory -> device over the host link
    storage_s: float  # shared storage -> host -> device
    recompute_s: float  # prefilling the context again (roofline)


def tier_reload(c: Census, hw: Hardware, fm: Formats, lay: Layout) -> TierReload:
    b = c.kv_bytes_per_token * fm.kv / 16 * lay.context_len
    return TierReload(
        b,
        b / hw.host_link,
        b / hw.storage_bandwidth + b / hw.host_link,
        forward_time(
            c, hw, fm, lay, lay.context_len, lay.context_len / 2, one_group=True
        ),
    )


@dataclass(frozen=True)
class DraftPlan:
    redundant_experts: int
    device_bytes: float  # the draft's weights per device
    step_s: float  # one draft forward at `batch` (roofline)
    imbalance: float  # busiest device's expert rows over the mean
    busiest_experts: float  # most expert slots one device reads per layer
    steps_per_verify: int
    share_of_target_step: (
        float  # the draft forwards of one verify step over the target's decode step
    )


def plan_draft(
    draft: Census,
    target: Census,
    hw: Hardware,
    fm: Formats,
    lay: Layout,
    batch: int,
    draft_tokens: int,
    redundant: Sequence[int],
    load: Sequence[float],
    shares_embeddings: bool = True,
) -> list[DraftPlan]:
    """The draft model's memory and forward time per device with each count of redundant expert
    slots (the draft's experts over the target's expert-parallel devices, placed by EPLB for
    `load`), and what `draft_tokens` draft forwards add to one verify step of the target. A draft
    that `shares_embeddings` (an MTP layer, DSpark) reads the target's embedding and LM head and
    holds no copy of them."""
    if not draft.moe_layers:
        raise ValueError(
            f"{draft.name} has no mixture-of-experts layers: redundant experts do not apply"
        )
    if len(load) != draft.num_experts:
        raise ValueError(
            f"the expert load lists {len(load)} experts; {draft.name} has {draft.num_experts}"
        )
    for r in redundant:
        Layout(ep=lay.ep, redundant_experts=r).check(draft, hw.devices)
    target_step = forward_time(
        target, hw, fm, lay, batch * (draft_tokens + 1), lay.context_len
    )
    out = []
    for r in redundant:
        dl = Layout(
            tp=lay.tp,
            ep=lay.ep,
            redundant_experts=r,
            mem_fraction=lay.mem_fraction,
            context_len=lay.context_len,
        )
        step = forward_time(draft, hw, fm, dl, batch, lay.context_len, load)
        es = expert_step(load, batch, draft.top_k, lay.ep or hw.devices, r)
        out.append(
            DraftPlan(
                redundant_experts=r,
                device_bytes=weight_bytes_per_device(draft, hw, fm, dl)
                - (
                    draft.embeddings * fm.embeddings / 8 / lay.tp
                    if shares_embeddings
                    else 0
                ),
                step_s=step,
                imbalance=es.imbalance,
                busiest_experts=max(es.distinct),
                steps_per_verify=draft_tokens,
                share_of_target_step=draft_tokens * step / target_step,
            )
        )
    return out
