"""`strata plan memory`: the parameter census against transformers' own model, the KV and Engram
arithmetic against hand-computed figures, EPLB's placement of a skewed draft load, and the command
end to end with its refusals. Config files only: no weights are made or read."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_dsv4 import ENGRAM, TINY
from tiny_models import tiny_config

from strata.cli import main
from strata.plan.memory import (
    Formats,
    Hardware,
    Layout,
    census,
    expert_load,
    expert_step,
    forward_time,
    plan_draft,
    plan_memory,
    prefetch,
)


def _write(tmp_path, name: str, cfg: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _hf_params(config) -> int:
    """Weights of transformers' model: its parameters, and the routers' correction bias (a buffer
    there, a parameter here)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    bias = sum(
        b.numel()
        for n, b in model.named_buffers()
        if n.endswith("e_score_correction_bias")
    )
    return sum(p.numel() for p in model.parameters()) + bias


@pytest.fixture(scope="module")
def v41(tmp_path_factory) -> str:
    """The tiny V4 of the model tests with Engram at layers 0 and 2 (tables of 97 rows of 8)."""
    import transformers

    cfg = transformers.DeepseekV4Config(**TINY).to_dict()
    cfg.update(ENGRAM, architectures=["DeepseekV4ForCausalLM"])
    return _write(tmp_path_factory.mktemp("plan"), "tiny-v41", cfg)


@pytest.fixture
def hw() -> Hardware:
    """Round figures: 10 GB per device, 1 TB/s, 100 TFLOP/s, a 10 GB/s host link."""
    return Hardware(
        devices=2,
        memory=10e9,
        bandwidth=1e12,
        flops=100e12,
        host_link=10e9,
        host_memory=20e9,
        interconnect=100e9,
        host_gather_rate=1e6,
        storage_bandwidth=1e9,
        storage_iops=1e5,
    )


def test_census_counts_what_transformers_builds_plus_engram(v41):
    import transformers

    c = census(v41, context_len=4096)
    E, L, H, inter = (
        TINY["n_routed_experts"],
        TINY["num_hidden_layers"],
        TINY["hidden_size"],
        TINY["moe_intermediate_size"],
    )
    assert (c.num_experts, c.top_k, c.moe_layers) == (E, TINY["num_experts_per_tok"], L)
    assert c.experts == L * E * 3 * H * inter
    assert c.per_expert == 3 * H * inter
    tables = len(ENGRAM["engram_orders"]) * ENGRAM["engram_heads"]
    assert c.engram_tables_per_layer == tables
    assert c.engram_tables == len(ENGRAM["engram_layers"]) * tables * 97 * 8
    # the Engram projections and norms: key and value [H, tables * dim], two norms of H
    engram_rest = len(ENGRAM["engram_layers"]) * (2 * H * tables * 8 + 2 * H)
    hf = _hf_params(transformers.DeepseekV4Config(**TINY))
    assert c.total - c.engram_tables - engram_rest == hf
    assert c.embeddings == 2 * TINY["vocab_size"] * H
    assert c.kv_split == 1  # V4: one K=V head, held whole by every device of a group
    assert c.name == "tiny-v41"


def test_census_of_a_dense_model(tmp_path):
    cfg = tiny_config("llama").to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    c = census(_write(tmp_path, "llama", cfg), context_len=256)
    assert c.total == _hf_params(tiny_config("llama"))
    assert (c.experts, c.moe_layers, c.engram_tables) == (0, 0, 0)
    assert c.kv_split == 2
    # K and V of 2 heads x 16 values in 2 layers, bf16
    assert c.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_host_and_mmap_tables_give_their_device_bytes_to_kv(v41, hw):
    c = census(v41, context_len=4096)
    fm = Formats(dense=16, experts=16, embeddings=16, engram=16, kv=16)
    lay = Layout(context_len=4096)
    device, host, mmap = plan_memory(c, hw, fm, lay, step_tokens=(4,))
    # the dense part whole on each device (no --tp-size), the experts split over both
    weights = (c.dense + c.embeddings) * 2 + c.experts * 2 / hw.devices
    tables = c.engram_tables * 2 / hw.devices
    assert device.device_bytes == pytest.approx(weights + tables)
    assert device.kv_bytes == pytest.approx(hw.memory * 0.88 - weights - tables)
    assert host.kv_bytes - device.kv_bytes == pytest.approx(tables)
    assert mmap.kv_bytes == host.kv_bytes
    # two data-parallel attention groups, each holding its own requests' KV
    assert device.kv_tokens == 2 * int(device.kv_bytes / c.kv_bytes_per_token)
    assert host.kv_gain == pytest.approx(host.kv_tokens / device.kv_tokens - 1)
    # host tables come out of the host tier's share; mapped ones do not
    per_token = c.kv_bytes_per_token
    assert host.host_kv_tokens == int((hw.host_memory * 0.5 - tables) * 2 / per_token)
    assert (
        mmap.host_kv_tokens == device.host_kv_tokens == int(hw.host_memory / per_token)
    )
    assert device.prefetch == [] and len(host.prefetch) == len(mmap.prefetch) == 1


def test_prefetch_is_hidden_only_by_the_layers_before_it(v41, hw):
    c = census(v41, context_len=4096)
    fm = Formats()
    rows_per_layer = 10 * c.engram_tables_per_layer
    row_time = 1 / hw.host_gather_rate + c.engram_dim * 2 / hw.host_link
    # layers 0 and 2 of 4: layer 0 hides nothing, so its rows are exposed whatever the step
    p = prefetch(c, hw, fm, "host", 10, step_s=1.0)
    assert p.rows == 2 * rows_per_layer and p.bytes == p.rows * c.engram_dim * 2
    assert p.seconds == pytest.approx(2 * rows_per_layer * row_time)
    assert p.hidden_by == 0.0
    assert p.exposed == pytest.approx(rows_per_layer * row_time)
    # mapped rows that miss the page cache cost a random read each
    m = prefetch(c, hw, fm, "mmap", 10, step_s=1.0)
    assert m.seconds == pytest.approx(
        2 * rows_per_layer * (1 / hw.storage_iops + c.engram_dim * 2 / hw.host_link)
    )
    warm = prefetch(
        c, Hardware(**{**hw.__dict__, "mmap_hit_rate": 1.0}), fm, "mmap", 10, 1.0
    )
    assert warm.seconds == pytest.approx(p.seconds)


def test_a_late_engram_layer_is_hidden_by_the_layers_before_it(tmp_path, hw):
    import transformers

    cfg = transformers.DeepseekV4Config(**TINY).to_dict()
    cfg.update(ENGRAM, engram_layers=[3], architectures=["DeepseekV4ForCausalLM"])
    c = census(_write(tmp_path, "late", cfg), context_len=4096)
    slow = prefetch(c, hw, Formats(), "host", 10, step_s=1e-6)
    assert slow.hidden_by == pytest.approx(0.75e-6)
    assert slow.exposed == pytest.approx(slow.seconds - 0.75e-6)
    assert prefetch(c, hw, Formats(), "host", 10, step_s=1.0).exposed == 0.0


def test_expert_step_rows_and_balance():
    uniform = expert_step([1 / 8] * 8, tokens=100, top_k=2, ep=4, redundant=0)
    assert sum(uniform.rows) == pytest.approx(200)
    assert uniform.imbalance == pytest.approx(1.0)
    assert uniform.distinct == pytest.approx([2 * (1 - math.exp(-25))] * 4)
    hot = [0.65] + [0.05] * 7
    plain = expert_step(hot, tokens=100, top_k=2, ep=4, redundant=0)
    spread = expert_step(hot, tokens=100, top_k=2, ep=4, redundant=4)
    assert plain.imbalance == pytest.approx(0.7 / 0.25)
    assert spread.imbalance < plain.imbalance
    assert sum(spread.rows) == pytest.approx(200)
    with pytest.raises(ValueError, match="multiple of --ep-size"):
        expert_step(hot, tokens=100, top_k=2, ep=4, redundant=1)


def test_expert_load_is_a_distribution():
    zipf = expert_load(16, 1.0)
    assert sum(zipf) == pytest.approx(1.0) and max(zipf) == pytest.approx(
        1 / sum(1 / r for r in range(1, 17))
    )
    assert expert_load(4, 0.0) == [0.25] * 4
    assert expert_load(3, 1.0, measured=[1, 0, 3]) == [0.25, 0.0, 0.75]
    with pytest.raises(ValueError, match="3 non-negative counts"):
        expert_load(3, 1.0, measured=[1, 2])


def test_forward_time_of_a_dense_model_is_its_roofline(tmp_path, hw):
    cfg = tiny_config("llama").to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    c = census(_write(tmp_path, "llama", cfg), context_len=256)
    fm = Formats(dense=16, embeddings=16, kv=16)
    lay = Layout(context_len=256)
    read = (c.dense + c.embeddings / 2) * 2 + 4 * 100 * c.kv_bytes_per_token
    assert forward_time(c, hw, fm, lay, 8, 100) == pytest.approx(read / hw.bandwidth)
    many = 1e6  # compute-bound
    flops = 2 * many / 2 * (c.dense + c.embeddings / 2)
    assert forward_time(c, hw, fm, lay, many, 0) == pytest.approx(flops / hw.flops)


def test_draft_with_redundant_experts_balances_its_load(v41, hw):
    c = census(v41, context_len=4096)
    lay = Layout(context_len=4096)
    load = [0.65] + [0.35 / 7] * 7
    plans = plan_draft(
        c,
        c,
        hw,
        Formats(),
        lay,
        batch=1000,
        draft_tokens=2,
        redundant=[0, 2],
        load=load,
    )
    assert [p.redundant_experts for p in plans] == [0, 2]
    assert plans[1].imbalance < plans[0].imbalance
    # one more expert slot per device and MoE layer
    assert plans[1].device_bytes - plans[0].device_bytes == pytest.approx(
        c.moe_layers * c.per_expert * 4.25 / 8
    )
    assert all(p.share_of_target_step > 0 for p in plans)


def test_the_command_prints_and_writes_json(v41, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        [
            "plan", "memory", "--model", v41, "--hardware", "h100", "--devices", "2",
            "--context-len", "4096", "--draft", v41, "--draft-redundant-experts", "2",
            "--output-json", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert (
        "tiny-v41" in text and "Engram prefetch" in text and "redundant slots" in text
    )
    plan = json.loads(out.read_text())
    assert [p["placement"] for p in plan["placements"]] == ["device", "host", "mmap"]
    assert [d["redundant_experts"] for d in plan["draft"]["plans"]] == [0, 2]
    assert plan["hardware"]["memory"] == 80e9


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tp-size", "3"], "--tp-size 3 must divide"),
        (["--ep-num-redundant-experts", "1"], "multiple of 2"),
        (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
        (["--mmap-hit-rate", "2"], "--mmap-hit-rate"),
        (["--expert-format", "fp5"], "unknown weight format 'fp5'"),
        (["--devices", "0"], "--devices must be at least 1"),
        (["--decode-step-ms", "-1"], "--decode-step-ms must be positive"),
        (["--context-len", "0"], "--context-len must be positive"),
        (["--draft-redundant-experts", "3"], "multiple of 2"),
    ],
)
def test_bad_flags_are_refused_with_what_to_fix(v41, capsys, extra, message):
    rc = main(
        ["plan", "memory", "--model", v41, "--devices", "2", "--draft", v41, *extra]
    )
    assert rc == 2
    assert message in capsys.readouterr().err


def test_a_dense_draft_and_a_bad_load_file_are_refused(v41, tmp_path, capsys):
    cfg = tiny_config("llama").to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    dense = _write(tmp_path, "llama", cfg)
    assert (
        main(["plan", "memory", "--model", v41, "--devices", "2", "--draft", dense])
        == 2
    )
    assert "no mixture-of-experts layers" in capsys.readouterr().err
    bad = tmp_path / "load.json"
    bad.write_text(json.dumps({"0": [1, 2]}))
    rc = main(
        [
            "plan",
            "memory",
            "--model",
            v41,
            "--devices",
            "2",
            "--draft",
            v41,
            "--expert-load",
            str(bad),
        ]
    )
    assert rc == 2
    assert "lists 2 counts; the draft has 8 experts" in capsys.readouterr().err
    assert (
        main(
            ["plan", "memory", "--model", str(tmp_path / "none.json"), "--devices", "2"]
        )
        == 2
    )
    assert "config.json" in capsys.readouterr().err
