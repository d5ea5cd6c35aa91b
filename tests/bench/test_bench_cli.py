"""`strata bench ...` end to end on a tiny model: the commands run, print tables, write JSON."""

from __future__ import annotations

import argparse
import json

from strata.bench.cli import add_bench_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_one_batch_command(llama_dir, tmp_path, capsys):
    out = tmp_path / "one.json"
    args = parse(
        [
            "one-batch",
            "--model",
            str(llama_dir),
            "--dtype",
            "float32",
            "--batch-size",
            "1",
            "4",
            "--input-len",
            "24",
            "--output-len",
            "4",
            "--output-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert (
        "prefill tok/s" in text
        and "decode step ms" in text
        and "per-step breakdown" in text
    )
    data = json.loads(out.read_text())
    assert [r["batch_size"] for r in data["results"]] == [1, 4]
    assert all(r["decode_step_ms"] > 0 for r in data["results"])


def test_one_batch_says_when_the_kv_pool_is_too_small(llama_dir):
    import pytest

    args = parse(
        [
            "one-batch",
            "--model",
            str(llama_dir),
            "--kv-cache-tokens",
            "64",
            "--batch-size",
            "4",
            "--input-len",
            "32",
        ]
    )
    with pytest.raises(ValueError, match="--kv-cache-tokens"):
        args.func(args)


def test_offline_command(llama_dir, capsys):
    args = parse(
        [
            "offline",
            "--model",
            str(llama_dir),
            "--dtype",
            "float32",
            "--num-prompts",
            "5",
            "--input-len",
            "12",
            "--output-len",
            "3",
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "total throughput (tok/s)" in text and "steady" in text


def test_compare_offline_reports_medians_and_ratios(llama_dir, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    args = parse(
        [
            "compare",
            "offline",
            "--model",
            str(llama_dir),
            "--dtype",
            "float32",
            "--targets",
            "strata",
            "transformers",
            "--rounds",
            "2",
            "--num-prompts",
            "4",
            "--input-len",
            "10",
            "--output-len",
            "3",
            "--output-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "transformers / strata" in text and "total (tok/s)" in text
    data = json.loads(out.read_text())["results"]
    assert data["targets"] == ["strata", "transformers"]
    assert len(data["values_per_round"]["strata"]["total (tok/s)"]) == 2
    assert data["ratios_vs_first"]["strata"]["total (tok/s)"] == 1.0
    assert data["ratios_vs_first"]["transformers"]["total (tok/s)"] > 0


def test_compare_one_batch_and_serving_against_url_targets(
    llama_dir, fake_server, tmp_path, capsys
):
    fake_server.reset()
    args = parse(
        [
            "compare",
            "serving",
            "--model",
            str(llama_dir),
            "--targets",
            f"url={fake_server.base_url}",
            "transformers",
            "--rounds",
            "2",
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--max-concurrency",
            "2",
            "--disable-progress",
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "c=2: output (tok/s)" in text
    assert "skipped transformers: transformers does not support serving" in text
    # 2 rounds x (1 warm-up + 4 requests); each round has fresh prompts (the warm-up prompt is the same)
    assert fake_server.state.count == 10
    assert len({json.dumps(b["prompt"]) for b in fake_server.state.bodies}) == 9


def test_server_process_reports_a_failed_start_with_its_log():
    import sys

    import pytest

    from strata.bench.server_process import ServerProcess

    srv = ServerProcess(
        lambda port: [
            sys.executable,
            "-c",
            "print('boom: no model'); raise SystemExit(3)",
        ],
        "broken",
    )
    with pytest.raises(RuntimeError, match="exited with code 3") as info:
        srv.start()
    assert "boom: no model" in str(info.value)
    assert srv.log_path.exists()
    srv.log_path.unlink()


def test_grammar_command(llama_dir, tmp_path, capsys):
    out = tmp_path / "grammar.json"
    args = parse(
        [
            "grammar",
            "--model",
            str(llama_dir),
            "--dtype",
            "float32",
            "--batch-size",
            "1",
            "3",
            "--output-len",
            "6",
            "--rounds",
            "1",
            "--num-schemas",
            "3",
            "--output-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    assert "grammar compile (3 JSON schemas)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["compile"]["first_ms"] > data["compile"]["cached_ms"] > 0
    assert [d["batch_size"] for d in data["decode"]] == [1, 3]
    assert all(
        d["free_step_ms"] > 0 and d["grammar_step_ms"] > 0 for d in data["decode"]
    )


def test_offline_command_reports_a_moe_models_expert_load(tmp_path, capsys):
    """Per MoE layer: the tokens each expert got during the run (warm-up excluded; a token counts
    once for each of its top-2 experts) in the JSON, and how uneven they were in the table."""
    from tiny_models import make_model

    model_dir = make_model(
        tmp_path / "tiny-qwen2-moe", "qwen2_moe"
    )  # experts in layers 0 and 2, 8 of them
    out = tmp_path / "offline.json"
    args = parse(
        [
            "offline",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--num-prompts",
            "4",
            "--input-len",
            "12",
            "--output-len",
            "3",
            "--output-json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "expert load of this run" in text and "max/mean" in text
    r = json.loads(out.read_text())["results"]
    # tokens through the model: the uncached prompts, then every output token but each request's last
    forwarded = (
        r["input_tokens"] - r["cached_tokens"] + r["output_tokens"] - r["num_requests"]
    )
    assert {layer: len(counts) for layer, counts in r["expert_load"].items()} == {
        "0": 8,
        "2": 8,
    }
    for layer, counts in r["expert_load"].items():
        summary = r["expert_load_summary"][layer]
        assert summary["tokens"] == sum(counts) == 2 * forwarded
        assert summary["max_over_mean"] == max(counts) / (sum(counts) / 8)


def test_kv_layout_command_from_a_config_alone(llama_dir, tmp_path, capsys):
    """DeepSeek-V2-Lite's published attention fields: a 576-value latent per layer (27 x 576 x 2 bytes
    in bf16) against 16 heads of K 192 + V 128; a dense model's pool is K and V of its KV heads."""
    config = tmp_path / "deepseek-v2-lite" / "config.json"
    config.parent.mkdir()
    config.write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV2ForCausalLM"],
                "model_type": "deepseek_v2",
                "vocab_size": 102400,
                "hidden_size": 2048,
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128,
                "v_head_dim": 128,
                "intermediate_size": 10944,
                "moe_intermediate_size": 1408,
                "n_routed_experts": 64,
                "n_shared_experts": 2,
                "num_experts_per_tok": 6,
                "first_k_dense_replace": 1,
                "topk_method": "greedy",
            }
        )
    )
    out = tmp_path / "kv.json"
    args = parse(
        ["kv-layout", "--model", str(config), str(llama_dir), "--output-json", str(out)]
    )
    assert args.func(args) == 0
    assert "8.9x" in capsys.readouterr().out
    mla, dense = json.loads(out.read_text())["results"]
    assert (mla["bytes_per_token"], mla["per_head_bytes_per_token"]) == (
        27 * 576 * 2,
        27 * 16 * 320 * 2,
    )
    # the tiny Llama: 2 layers x K and V x 2 KV heads x head_dim 16, bf16
    assert (dense["bytes_per_token"], dense["per_head_bytes_per_token"]) == (
        2 * 2 * 2 * 16 * 2,
        None,
    )


def test_peers_see_the_float_checkpoint_without_strata_blocks(tmp_path):
    """vLLM reads every *.safetensors of a directory: a converted GGUF's blocks are left out of the
    directory it gets (links to everything else); a plain checkpoint directory is passed as it is."""
    from strata.bench.targets import checkpoint_only_dir

    model = tmp_path / "model"
    model.mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "blocks.safetensors",
    ):
        (model / name).write_text(name)
    view = checkpoint_only_dir(model, tmp_path / "view" / "model")
    assert sorted(p.name for p in view.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert (view / "model.safetensors").read_text() == "model.safetensors"
    assert (
        checkpoint_only_dir(model, tmp_path / "view" / "model") == view
    )  # again: the same links
    (model / "blocks.safetensors").unlink()
    assert checkpoint_only_dir(model, tmp_path / "other") == model
