"""`strata bench lora`: what serving LoRA adapters costs a decode step.

On the offline engine (the default model unless --model), with --num-adapters random adapters
of rank --rank on every attention and MLP projection (written in PEFT's format to a temporary
directory, so they load as users' adapters do), it times decode steps of --batch-size requests
in three mixes, the same prompts and lengths in each:

    base        every row on the base model (the engine serves adapters, none is used)
    few         --num-adapters rows, each under its own adapter; the others on the base model
    all         every row under an adapter, spread evenly over the --num-adapters adapters

and reports each mix's median step time over --steps decode steps (after --warmup), repeated
--rounds times in alternating order, with the ratios to `base`. A fourth line times the base
mix on an engine without LoRA, which is what turning adapters on costs when none is used.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRABenchConfig:
    model: str | None = None
    batch_size: int = 32
    num_adapters: int = 8
    rank: int = 16
    input_len: int = 64
    steps: int = 16
    warmup: int = 3
    rounds: int = 3
    dtype: str = "auto"
    seed: int = 0


def write_adapter(out: Path, model_config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter for every projection of `model_config`'s layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, inter = model_config.hidden_size, model_config.intermediate_size
    q = model_config.num_heads * model_config.head_dim
    kv = model_config.num_kv_heads * model_config.head_dim
    shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            )
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(fan_out, rank, generator=g) * 0.01
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": MODULES,
                "bias": "none",
            }
        )
    )
    return out


def _decode_steps(engine, loras: list[str | None], cfg: LoRABenchConfig) -> float:
    """Median decode step (ms) of len(loras) requests, request i under loras[i]."""
    from strata.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0, max_new_tokens=cfg.warmup + cfg.steps + 2, ignore_eos=True
    )
    vocab = engine.scheduler.vocab_size
    g = torch.Generator().manual_seed(cfg.seed)
    rids = []
    for lora in loras:
        prompt = torch.randint(10, vocab - 1, (cfg.input_len,), generator=g).tolist()
        rids += engine.add_request(prompt, params, lora=lora)
    scheduler = engine.scheduler
    while any(r.extend_len > 1 for r in scheduler.running) or scheduler.waiting:
        engine.step()  # the prompts
    times = []
    for i in range(cfg.warmup + cfg.steps):
        start = time.perf_counter()
        engine.step()
        if i >= cfg.warmup:
            times.append(time.perf_counter() - start)
    while engine.has_requests():
        engine.step()
    for rid in rids:
        engine._outputs.pop(rid, None)
    engine.flush_cache()
    return 1e3 * statistics.median(times)


def run(cfg: LoRABenchConfig, log=print) -> dict:
    from strata.engine.engine import Engine
    from strata.weights.default_model import resolve_model_path

    model = str(resolve_model_path(cfg.model))
    n, k = cfg.batch_size, cfg.num_adapters
    if not 1 <= k <= n:
        raise ValueError(f"--num-adapters must be in [1, --batch-size], got {k}")
    with tempfile.TemporaryDirectory(prefix="strata-bench-lora-") as root:
        plain = Engine(
            model, dtype=cfg.dtype, max_running_requests=n, kv_cache_tokens=None
        )
        paths = [
            write_adapter(Path(root) / f"a{i}", plain.state.model_config, cfg.rank, i)
            for i in range(k)
        ]
        modules = ",".join(f"a{i}={p}" for i, p in enumerate(paths))
        served = Engine(
            model,
            dtype=cfg.dtype,
            max_running_requests=n,
            lora_modules=modules,
            max_loras=k,
            max_lora_rank=cfg.rank,
        )
        names = [f"a{i}" for i in range(k)]
        mixes: dict[str, tuple[Any, list[str | None]]] = {
            "base": (served, [None] * n),
            "few": (served, names + [None] * (n - k)),
            "all": (served, [names[i % k] for i in range(n)]),
            "no-lora engine": (plain, [None] * n),
        }
        times: dict[str, list[float]] = {name: [] for name in mixes}
        for r in range(cfg.rounds):
            order = list(mixes) if r % 2 == 0 else list(reversed(mixes))
            for name in order:
                engine, loras = mixes[name]
                ms = _decode_steps(engine, loras, cfg)
                times[name].append(ms)
                log(f"  round {r} {name}: {ms:.2f} ms/step")
    medians = {name: statistics.median(v) for name, v in times.items()}
    return {
        "config": asdict(cfg),
        "step_ms": times,
        "median_step_ms": medians,
        "ratio_to_base": {name: medians[name] / medians["base"] for name in medians},
    }


def text(result: dict) -> str:
    from strata.bench.report import fmt, table

    cfg = result["config"]
    k, n = cfg["num_adapters"], cfg["batch_size"]
    what = {
        "base": f"{n} rows, base model (adapters served, none used)",
        "few": f"{k} rows under {k} adapters, {n - k} base",
        "all": f"{n} rows under {k} adapters",
        "no-lora engine": f"{n} rows, an engine without LoRA",
    }
    rows = [
        [
            name,
            what[name],
            fmt(result["median_step_ms"][name]),
            " ".join(fmt(v) for v in result["step_ms"][name]),
            fmt(result["ratio_to_base"][name], 3),
        ]
        for name in result["median_step_ms"]
    ]
    return table(rows, ["mix", "rows", "median ms/step", "rounds", "x base"])
