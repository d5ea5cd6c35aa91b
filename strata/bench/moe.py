"""`strata bench moe`: one mixture-of-experts layer's decode step (one token per sequence, batch 1 /
16 / 64) through Strata's `strata.layers.moe.MoE` and through transformers' own MoE block of the
same family with the same weights, timed in the same run.

Implementations (each one's largest difference from transformers' eager output is reported):
    strata              our block, torch's grouped GEMM over the rows grouped by expert
    strata-loop         our block, one matmul per expert that got rows
    strata-native       our block as the CPU loader leaves it: router and expert stacks packed for the
                        native dense kernel (each token's output independent of the batch)
    transformers        transformers' block, its default experts implementation (grouped_mm)
    transformers-eager  transformers' block, experts_implementation="eager" (a loop over the experts
                        hit, masks built with one_hot)

Rounds alternate the implementations; each round times `iters` forwards; the figure is the median
round. tokens/s = batch / step time.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from strata.bench.moe_config import FAMILIES, MoEBenchConfig


def load_hf_moe_block(ours, hf_block: torch.nn.Module, gpt_oss: bool) -> None:
    """Copy a transformers MoE block's weights (its in-memory names and layouts) into our `MoE`:
    routers, stacked experts (GPT-OSS's converted by its loader), shared experts fused gate/up."""
    from strata.models.gpt_oss import expert_tensor

    with torch.no_grad():
        for name, t in hf_block.state_dict().items():
            name = name.replace("router.", "gate.").replace(
                "shared_experts.", "shared_expert."
            )
            if name.startswith("experts."):
                rest = name.removeprefix("experts.")
                ours.experts.load(rest, expert_tensor(rest, t) if gpt_oss else t)
            elif name.endswith(
                ("gate_proj.weight", "up_proj.weight")
            ):  # the shared expert's, fused
                gate_up = ours.shared_expert.gate_up_proj.weight
                half = gate_up.shape[0] // 2
                (gate_up[:half] if "gate_proj" in name else gate_up[half:]).copy_(t)
            else:
                ours.get_parameter(name).copy_(t)


def build_blocks(cfg: MoEBenchConfig) -> dict[str, torch.nn.Module]:
    """The implementations of one MoE layer, with the same random weights (biases included);
    strata-native only where the native kernels run."""
    import transformers

    from strata.layers.moe import MoE
    from strata.layers.packed import dense_target, pack_linears
    from strata.models import config_from_hf

    cls_name, module, block_name, extra = FAMILIES[cfg.family]
    fields = dict(
        vocab_size=64,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts_per_tok=cfg.top_k,
        num_local_experts=cfg.num_experts,
        num_experts=cfg.num_experts,
    )
    fields.update(
        {k: (cfg.intermediate_size if v is None else v) for k, v in extra.items()}
    )
    hf_cfg = getattr(transformers, cls_name)(**fields)
    modeling = getattr(getattr(transformers.models, module), f"modeling_{module}")
    dtype = getattr(torch, cfg.dtype)
    torch.manual_seed(cfg.seed)
    blocks: dict[str, torch.nn.Module] = {}
    for impl in ("transformers", "transformers-eager"):
        impl_cfg = copy.deepcopy(
            hf_cfg
        )  # the experts read it at every forward: one config per block
        impl_cfg._experts_implementation = (
            "grouped_mm" if impl == "transformers" else "eager"
        )
        block = getattr(modeling, block_name)(impl_cfg)
        if impl == "transformers-eager":
            block.load_state_dict(blocks["transformers"].state_dict())
        else:
            with torch.no_grad():
                for t in block.parameters():
                    t.copy_(torch.randn_like(t) * 0.1)
        blocks[impl] = block.to(dtype).eval()
    moe_cfg = config_from_hf({**hf_cfg.to_dict(), "num_hidden_layers": 1}).moe
    assert moe_cfg is not None  # every FAMILIES entry is a mixture of experts
    for impl in ("strata", "strata-loop", "strata-native"):
        ours = MoE(cfg.hidden_size, moe_cfg)
        load_hf_moe_block(ours, blocks["transformers"], gpt_oss=cfg.family == "gpt_oss")
        ours.experts.backend = "grouped_mm" if impl == "strata" else "loop"
        ours = ours.to(dtype).eval()
        if impl == "strata-native" and (
            dense_target() is None or not pack_linears(ours)
        ):
            continue
        blocks[impl] = ours
    return blocks


def _forward(impl: str, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if impl.startswith("strata"):
        return block(x)
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out)[0]


@torch.inference_mode()
def run_moe_bench(cfg: MoEBenchConfig) -> list[dict]:
    """Rows {batch_size, implementation, step_ms, tok_s, max_abs_diff} (diff vs transformers-eager)."""
    from strata.layers.moe import grouped_mm_works

    blocks = build_blocks(cfg)
    dtype = getattr(torch, cfg.dtype)
    if not grouped_mm_works("cpu", dtype):
        blocks.pop("strata")  # no grouped GEMM in this torch: only the loop runs
    rows = []
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for batch in cfg.batch_sizes:
        x = torch.randn(batch, cfg.hidden_size, generator=gen).to(dtype)
        ref = _forward("transformers-eager", blocks["transformers-eager"], x).float()
        diffs = {
            impl: (_forward(impl, b, x).float() - ref).abs().max().item()
            for impl, b in blocks.items()
        }
        times: dict[str, list[float]] = {impl: [] for impl in blocks}
        for _ in range(cfg.rounds):
            for impl, block in blocks.items():
                _forward(impl, block, x)  # warm
                start = time.perf_counter()
                for _ in range(cfg.iters):
                    _forward(impl, block, x)
                times[impl].append((time.perf_counter() - start) / cfg.iters)
        for impl in blocks:
            step = statistics.median(times[impl])
            rows.append(
                dict(
                    batch_size=batch,
                    implementation=impl,
                    step_ms=step * 1e3,
                    tok_s=batch / step,
                    max_abs_diff=diffs[impl],
                )
            )
    return rows


def format_rows(cfg: MoEBenchConfig, rows: list[dict]) -> str:
    head = (
        f"MoE layer decode step: {cfg.family}, hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
        f"{cfg.intermediate_size}, top-{cfg.top_k}, {cfg.dtype}, {torch.get_num_threads()} threads; "
        f"median of {cfg.rounds} rounds x {cfg.iters} steps"
    )
    lines = [
        head,
        (
            f"{'batch':>5}  {'implementation':<19} {'step ms':>9} {'tokens/s':>10} {'vs transformers':>15} "
            f"{'max |diff|':>10}"
        ),
    ]
    base = {
        r["batch_size"]: r["tok_s"]
        for r in rows
        if r["implementation"] == "transformers"
    }
    for r in rows:
        lines.append(
            f"{r['batch_size']:>5}  {r['implementation']:<19} {r['step_ms']:>9.3f} {r['tok_s']:>10.0f} "
            f"{r['tok_s'] / base[r['batch_size']]:>14.2f}x {r['max_abs_diff']:>10.1e}"
        )
    return "\n".join(lines)
