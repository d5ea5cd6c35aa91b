"""LoRA adapters against the oracle: PEFT applied to the transformers model. One batch mixes
requests of three adapters and of the base model; greedy tokens equal PEFT's for each. The prefix
cache is keyed by adapter, adapters leave memory least recently used first and come back, and bad
adapters are refused saying why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lora_adapters import ADAPTERS, make_adapter, peft_greedy
from test_parity import PROMPTS

from strata import Engine, SamplingParams, kernels
from strata.engine.lora import LoRAError
from strata.models import native_decode

GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("lora")
    return {
        name: make_adapter(llama_dir, out, name, seed)
        for seed, name in enumerate(ADAPTERS)
    }


@pytest.fixture(scope="module")
def expected(llama_dir, adapters) -> dict[str | None, list[list[int]]]:
    result = {None: peft_greedy(llama_dir, None, PROMPTS, 12)}
    for name, path in adapters.items():
        result[name] = peft_greedy(llama_dir, path, PROMPTS, 12)
    assert result["attn"] != result[None] and result["mlp"] != result[None]
    return result


def modules(adapters: dict[str, Path]) -> str:
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def run(engine: Engine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    groups = [engine.add_request(p, GREEDY, lora=lora) for p, lora in jobs]
    pending = {r for g in groups for r in g}
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.rid)
    return [engine._collect(g).token_ids for g in groups]


# how a step's adapter rows run: in the native decode loop (decode steps; the Python loop with the
# LoRA kernel for prefills), in the Python loop with the kernel, or as PyTorch batched matmuls
WAYS = {
    "native-loop": {},
    "kernel": {native_decode.ENV_VAR: "0"},
    "pytorch": {native_decode.ENV_VAR: "0", kernels.ENV_VAR: "0"},
}


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_mixed_batch_of_three_adapters_and_the_base_matches_peft(
    llama_dir, adapters, expected, page_size, way, monkeypatch
):
    for var, value in WAYS[way].items():
        monkeypatch.setenv(var, value)
    with kernels.using(kernels.selected_target()):
        engine = Engine(
            str(llama_dir),
            dtype="float32",
            kv_cache_tokens=2048,
            page_size=page_size,
            lora_modules=modules(adapters),
        )
        names = [None, *ADAPTERS]
        jobs = [
            (p, names[(i + j) % 4]) for i, p in enumerate(PROMPTS) for j in range(4)
        ]
        got = run(engine, jobs)
    for (prompt, lora), tokens in zip(jobs, got):
        assert tokens == expected[lora][PROMPTS.index(prompt)], lora
    engine.scheduler.check_no_leaks()
    native = engine.model.native_decode()
    assert (native is not None and native.steps > 0) == (way == "native-loop")
    assert (engine.model.lora.table is not None) == (way != "pytorch")


def test_the_prefix_cache_is_keyed_by_adapter(llama_dir, adapters, expected):
    engine = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=2048,
        lora_modules=modules(adapters),
    )
    prompt = PROMPTS[2]
    base = _one(engine, prompt, None)
    a1 = _one(engine, prompt, "attn")
    a2 = _one(engine, prompt, "attn")
    m1 = _one(engine, prompt, "mlp")
    assert base.token_ids == expected[None][2]
    assert a1.cached_tokens == 0  # the base model's KV of the same prompt is not reused
    assert a2.cached_tokens > 0  # the adapter's own is
    assert m1.cached_tokens == 0
    assert a1.token_ids == a2.token_ids == expected["attn"][2]
    assert m1.token_ids == expected["mlp"][2]
    engine.scheduler.check_no_leaks()


def _one(engine: Engine, prompt: list[int], lora: str | None):
    rids = engine.add_request(prompt, GREEDY, lora=lora)
    pending = set(rids)
    while pending:
        for out in engine.step():
            if out.finished:
                pending.discard(out.rid)
    return engine._collect(rids)


def test_adapters_leave_memory_least_recently_used_first_and_come_back(
    llama_dir, adapters, expected
):
    engine = Engine(
        str(llama_dir),
        dtype="float32",
        kv_cache_tokens=2048,
        lora_modules=modules(adapters),
        max_loras=2,
    )
    assert (
        len(engine.lora.loaded) == 2 and engine.lora.registered["attn"].adapter_id == 0
    )
    for name in ["attn", "mlp", "all", "attn"]:
        assert _one(engine, PROMPTS[0], name).token_ids == expected[name][0]
        assert len(engine.lora.loaded) <= 2
    assert engine.lora.registered["mlp"].adapter_id == 0  # the least recently used left
    # registered later, unregistered when idle; unknown names are 404s
    engine.lora.unregister("all")
    with pytest.raises(LoRAError) as err:
        engine.add_request(PROMPTS[0], GREEDY, lora="all")
    assert err.value.status == 404 and "all" in str(err.value)
    engine.lora.register("again", str(adapters["all"]))
    assert _one(engine, PROMPTS[1], "again").token_ids == expected["all"][1]


def test_bad_adapters_are_refused_saying_why(llama_dir, adapters, tmp_path):
    engine = Engine(
        str(llama_dir), dtype="float32", kv_cache_tokens=1024, enable_lora=True
    )
    with pytest.raises(ValueError, match=r"adapter_config\.json"):
        engine.lora.register("x", str(tmp_path))
    with pytest.raises(ValueError, match="max-lora-rank"):
        Engine(
            str(llama_dir),
            dtype="float32",
            kv_cache_tokens=1024,
            lora_modules=f"big={adapters['mlp']}",
            max_lora_rank=4,
        )
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text(
        (adapters["attn"] / "adapter_config.json").read_text()
    )
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapters["attn"] / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(3, tensors[key].shape[1])
    save_file(tensors, wrong / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="needs A"):
        engine.lora.register("wrong", str(wrong))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["attn"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        engine.lora.register("dora", str(dora))
    engine.lora.register("attn", str(adapters["attn"]))
    with pytest.raises(LoRAError, match="registered already"):
        engine.lora.register("attn", str(adapters["attn"]))
    plain = Engine(str(llama_dir), dtype="float32", kv_cache_tokens=1024)
    with pytest.raises(LoRAError, match="no LoRA adapters"):
        plain.add_request(PROMPTS[0], GREEDY, lora="attn")
    with pytest.raises(ValueError, match="NAME=PATH"):
        Engine(str(llama_dir), dtype="float32", lora_modules="nopath")


def test_an_adapter_id_is_its_files_so_replicas_key_alike(
    llama_dir, adapters, expected
):
    """Two engines (replicas sharing an L3 tier) give one adapter the same id; the same files
    under two names share one copy, which stays while either name does."""
    one = Engine(str(llama_dir), dtype="float32", lora_modules=f"x={adapters['attn']}")
    two = Engine(
        str(llama_dir),
        dtype="float32",
        lora_modules=f"y={adapters['mlp']},z={adapters['attn']},w={adapters['attn']}",
    )
    assert one.lora.registered["x"].adapter_id == two.lora.registered["z"].adapter_id
    assert two.lora.registered["z"].adapter_id == two.lora.registered["w"].adapter_id
    assert len(two.lora.state.adapters) == 2
    two.lora.unregister("z")
    assert _one(two, PROMPTS[1], "w").token_ids == expected["attn"][1]
