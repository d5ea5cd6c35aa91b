"""Random PEFT LoRA adapters of a tiny model, and PEFT's greedy tokens with one applied (the
oracle of the LoRA tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

ADAPTERS = {  # name -> (rank, alpha, target modules, rslora)
    "attn": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"], False),
    "all": (2, 4, ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], True),
}


def base_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: Path, out: Path, name: str, seed: int) -> Path:
    """Adapter `name` of ADAPTERS with random A and B (B scaled up so that greedy tokens change)."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, modules, rslora = ADAPTERS[name]
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=modules,
        init_lora_weights=False,  # random A and B: a zero B would change nothing
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(base_model(model_dir), config)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.mul_(20.0)
    peft_model.save_pretrained(out / name)
    return out / name


@torch.no_grad()
def peft_greedy(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], n: int
) -> list[list[int]]:
    from peft import PeftModel

    model = base_model(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=cfg
        )
        out.append(tokens[0, len(prompt) :].tolist())
    return out
