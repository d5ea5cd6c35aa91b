"""`strata plan memory`: the flags, and the plan of `strata.plan.memory` as text or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from strata.plan.memory import (
    HARDWARE,
    Census,
    Formats,
    GiB,
    Hardware,
    Layout,
    bits_of,
    census,
    expert_load,
    plan_draft,
    plan_memory,
    tier_reload,
)


def add_memory_args(sub) -> None:
    p = sub.add_parser(
        "memory",
        help="on paper: weights, Engram tables, KV capacity and tiers, a draft with redundant experts",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a model directory or its config.json (no weights are read)",
    )
    hw = p.add_argument_group("hardware (a preset, then any figure overridden)")
    hw.add_argument("--hardware", default="h200", choices=sorted(HARDWARE))
    hw.add_argument("--devices", type=int, default=8, help="devices of one deployment")
    hw.add_argument("--device-memory", type=float, default=None, metavar="GB")
    hw.add_argument("--device-bandwidth", type=float, default=None, metavar="GB/S")
    hw.add_argument("--device-tflops", type=float, default=None, metavar="TFLOPS")
    hw.add_argument(
        "--host-link",
        type=float,
        default=None,
        metavar="GB/S",
        help="device <-> host, one way",
    )
    hw.add_argument(
        "--interconnect",
        type=float,
        default=None,
        metavar="GB/S",
        help="device <-> device, one way",
    )
    hw.add_argument(
        "--host-memory", type=float, default=None, metavar="GB", help="per device"
    )
    hw.add_argument(
        "--host-gather-rate",
        type=float,
        default=None,
        metavar="ROWS/S",
        help="table rows one host thread gathers per second (default 8e6)",
    )
    hw.add_argument("--gather-threads", type=int, default=None)
    hw.add_argument("--storage-bandwidth", type=float, default=None, metavar="GB/S")
    hw.add_argument("--storage-iops", type=float, default=None)
    hw.add_argument("--storage-capacity", type=float, default=None, metavar="TB")
    hw.add_argument(
        "--mmap-hit-rate",
        type=float,
        default=None,
        help="share of mapped table rows already in the page cache (default 0)",
    )
    d = p.add_argument_group("deployment")
    d.add_argument("--tp-size", type=int, default=1)
    d.add_argument(
        "--ep-size",
        type=int,
        default=None,
        help="expert-parallel devices (default: all)",
    )
    d.add_argument("--ep-num-redundant-experts", type=int, default=0)
    d.add_argument("--mem-fraction-static", type=float, default=0.88)
    d.add_argument("--context-len", type=int, default=65536)
    d.add_argument(
        "--host-kv-fraction",
        type=float,
        default=0.5,
        help="of host memory for the host KV tier (host Engram tables come out of it)",
    )
    d.add_argument(
        "--step-tokens",
        type=int,
        nargs="+",
        default=[64, 8192],
        help="tokens per step whose Engram prefetch is priced (a decode batch, a prefill chunk)",
    )
    d.add_argument(
        "--decode-step-ms",
        type=float,
        default=None,
        help="a measured decode step (else the roofline's) for steps of <= 512 tokens",
    )
    f = p.add_argument_group(
        "formats (fp4 | fp8 | bf16 | fp16 | fp32, or bits per value)"
    )
    f.add_argument("--dense-format", default="fp8")
    f.add_argument("--expert-format", default="fp4")
    f.add_argument("--embedding-format", default="bf16")
    f.add_argument("--engram-format", default="bf16")
    f.add_argument("--kv-format", default="bf16")
    s = p.add_argument_group("draft model")
    s.add_argument(
        "--draft",
        default=None,
        help="a mixture-of-experts draft model's directory or config.json",
    )
    s.add_argument(
        "--draft-redundant-experts",
        type=int,
        nargs="+",
        default=[0],
        help="redundant expert slots per draft MoE layer to compare (0 included)",
    )
    s.add_argument(
        "--draft-own-embeddings",
        action="store_true",
        help="the draft holds its own embedding and LM head (default: the target's, as MTP and DSpark)",
    )
    s.add_argument(
        "--draft-tokens", type=int, default=3, help="draft forwards per verify"
    )
    s.add_argument(
        "--draft-batch", type=int, default=64, help="requests decoding at once"
    )
    s.add_argument(
        "--expert-skew",
        type=float,
        default=1.0,
        help="Zipf exponent of the draft's expert load (0: uniform)",
    )
    s.add_argument(
        "--expert-load",
        default=None,
        metavar="FILE",
        help="a measured load instead: JSON {layer: [tokens per expert]} (the engine's expert_load())",
    )
    p.add_argument("--output-json", default=None, metavar="FILE")
    p.set_defaults(func=cmd_memory)


def _hardware(args: argparse.Namespace) -> Hardware:
    def scaled(v: float | None, k: float) -> float | None:
        return None if v is None else v * k

    return Hardware.preset(
        args.hardware,
        args.devices,
        memory=scaled(args.device_memory, 1e9),
        bandwidth=scaled(args.device_bandwidth, 1e9),
        flops=scaled(args.device_tflops, 1e12),
        host_link=scaled(args.host_link, 1e9),
        host_memory=scaled(args.host_memory, 1e9),
        interconnect=scaled(args.interconnect, 1e9),
        host_gather_rate=args.host_gather_rate,
        gather_threads=args.gather_threads,
        storage_bandwidth=scaled(args.storage_bandwidth, 1e9),
        storage_iops=args.storage_iops,
        storage_capacity=scaled(args.storage_capacity, 1e12),
        mmap_hit_rate=args.mmap_hit_rate,
    )


def _measured_load(path: str, num_experts: int) -> list[float]:
    """Per-expert tokens summed over the layers of an expert_load() JSON."""
    raw = json.loads(Path(path).read_text())
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{path}: expected {{layer: [tokens per expert]}}")
    total = [0.0] * num_experts
    for layer, counts in raw.items():
        if not isinstance(counts, list) or len(counts) != num_experts:
            raise ValueError(
                f"{path}: layer {layer} lists {len(counts) if isinstance(counts, list) else 'no'} "
                f"counts; the draft has {num_experts} experts"
            )
        for e, n in enumerate(counts):
            if not isinstance(n, (int, float)) or n < 0:
                raise ValueError(
                    f"{path}: layer {layer}: counts must be non-negative numbers"
                )
            total[e] += n
    return total


def _gib(b: float) -> str:
    return f"{b / GiB:,.1f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:,.3f} ms"


def format_plan(out: dict) -> str:
    c, lines = out["model"], []
    lines.append(
        f"{c['name']}: {c['total'] / 1e9:,.1f}B parameters ({c['active'] / 1e9:,.1f}B active per token): "
        f"dense {c['dense'] / 1e9:,.2f}B, embeddings {c['embeddings'] / 1e9:,.2f}B, "
        f"routed experts {c['experts'] / 1e9:,.1f}B, Engram tables {c['engram_tables'] / 1e9:,.1f}B"
    )
    lines.append(
        f"KV: {c['kv_bytes_per_token']:,.0f} B per token at {out['layout']['context_len']:,} tokens of context "
        f"(bf16; {out['formats']['kv']:g} bits per value planned)"
    )
    lines.append("")
    lines.append(
        "placement | weights+tables/device | tables: device, host/device | KV/device | KV tokens | "
        f"requests at {out['layout']['context_len']:,} | KV gain | host-tier KV tokens"
    )
    for p in out["placements"]:
        lines.append(
            f"{p['placement']:>6} | {_gib(p['device_bytes'])} | {_gib(p['table_bytes_on_device'])}, "
            f"{_gib(p['table_bytes_in_host'])} | {_gib(p['kv_bytes'])} | {p['kv_tokens']:,} | "
            f"{p['requests_at_context']:,} | {p['kv_gain'] * 100:+.1f}% | {p['host_kv_tokens']:,}"
        )
    prefetches = [(p["placement"], f) for p in out["placements"] for f in p["prefetch"]]
    if prefetches:
        lines.append("")
        lines.append(
            "Engram prefetch per step: placement | tokens | rows | bytes | gather+copy | "
            "forward before the first Engram layer | exposed"
        )
        for placement, f in prefetches:
            lines.append(
                f"{placement:>6} | {f['tokens']:,} | {f['rows']:,} | {f['bytes'] / 2**20:,.1f} MiB | "
                f"{_ms(f['seconds'])} | {_ms(f['hidden_by'])} | {_ms(f['exposed'])}"
            )
    t = out["kv_reload"]
    lines.append("")
    lines.append(
        f"One {out['layout']['context_len']:,}-token context ({t['bytes'] / 2**20:,.0f} MiB of KV) back on the "
        f"device: from host memory {_ms(t['host_s'])}, from storage {_ms(t['storage_s'])}, "
        f"recomputed {_ms(t['recompute_s'])}; storage holds "
        f"{out['storage_kv_tokens']:,} tokens"
    )
    if out.get("draft"):
        dr = out["draft"]
        lines.append("")
        lines.append(
            f"Draft {dr['model']['name']} ({dr['model']['total'] / 1e9:,.2f}B parameters), batch "
            f"{dr['batch']}, {dr['draft_tokens']} draft forwards per verify; expert load: {dr['load']}"
        )
        lines.append(
            "redundant slots | draft weights/device | draft forward | busiest device's rows/mean | "
            "most expert slots a device reads | drafts / target step"
        )
        for r in dr["plans"]:
            lines.append(
                f"{r['redundant_experts']:>15} | {_gib(r['device_bytes'])} | {_ms(r['step_s'])} | "
                f"{r['imbalance']:.2f} | {r['busiest_experts']:.1f} | {r['share_of_target_step'] * 100:.1f}%"
            )
    return "\n".join(lines)


def cmd_memory(args: argparse.Namespace) -> int:
    hw = _hardware(args)
    fm = Formats(
        dense=bits_of(args.dense_format),
        experts=bits_of(args.expert_format),
        embeddings=bits_of(args.embedding_format),
        engram=bits_of(args.engram_format),
        kv=bits_of(args.kv_format),
    )
    lay = Layout(
        tp=args.tp_size,
        ep=args.ep_size,
        redundant_experts=args.ep_num_redundant_experts,
        mem_fraction=args.mem_fraction_static,
        context_len=args.context_len,
    )
    if not 0 <= args.host_kv_fraction <= 1:
        raise ValueError(
            f"--host-kv-fraction is a share in [0, 1]; got {args.host_kv_fraction}"
        )
    if args.context_len < 1:
        raise ValueError(f"--context-len must be positive; got {args.context_len}")
    if any(n < 1 for n in args.step_tokens):
        raise ValueError("--step-tokens must be positive")
    if args.decode_step_ms is not None and args.decode_step_ms <= 0:
        raise ValueError(
            f"--decode-step-ms must be positive; got {args.decode_step_ms}"
        )
    c = census(args.model, args.context_len)
    placements = plan_memory(
        c,
        hw,
        fm,
        lay,
        args.step_tokens,
        args.host_kv_fraction,
        None if args.decode_step_ms is None else args.decode_step_ms / 1e3,
    )
    reload = tier_reload(c, hw, fm, lay)
    out: dict = {
        "model": _census_dict(c),
        "hardware": asdict(hw),
        "formats": asdict(fm),
        "layout": asdict(lay),
        "placements": [asdict(p) for p in placements],
        "kv_reload": asdict(reload),
        "storage_kv_tokens": int(
            hw.storage_capacity / (c.kv_bytes_per_token * fm.kv / 16)
        ),
    }
    if args.draft:
        if args.draft_batch < 1 or args.draft_tokens < 1:
            raise ValueError("--draft-batch and --draft-tokens must be positive")
        if any(r < 0 for r in args.draft_redundant_experts):
            raise ValueError("--draft-redundant-experts must not be negative")
        d = census(args.draft, args.context_len)
        measured = (
            _measured_load(args.expert_load, d.num_experts)
            if args.expert_load
            else None
        )
        load = expert_load(d.num_experts, args.expert_skew, measured=measured)
        counts = sorted({0, *args.draft_redundant_experts})
        out["draft"] = {
            "model": _census_dict(d),
            "batch": args.draft_batch,
            "draft_tokens": args.draft_tokens,
            "load": args.expert_load or f"Zipf, exponent {args.expert_skew:g}",
            "plans": [
                asdict(r)
                for r in plan_draft(
                    d,
                    c,
                    hw,
                    fm,
                    lay,
                    args.draft_batch,
                    args.draft_tokens,
                    counts,
                    load,
                    shares_embeddings=not args.draft_own_embeddings,
                )
            ],
        }
    print(format_plan(out))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    return 0


def _census_dict(c: Census) -> dict:
    return {
        **asdict(c),
        "total": c.total,
        "active": c.active,
        "per_expert": c.per_expert,
    }
