"""`strata bench lora` on a tiny model: the adapters it writes load as PEFT adapters, every mix
runs, and the report has the medians and ratios."""

from __future__ import annotations

from strata.bench.lora import LoRABenchConfig, run, text


def test_lora_bench_times_every_mix(llama_dir):
    cfg = LoRABenchConfig(
        model=str(llama_dir),
        dtype="float32",
        batch_size=6,
        num_adapters=3,
        rank=4,
        input_len=12,
        steps=2,
        warmup=1,
        rounds=2,
    )
    lines: list[str] = []
    result = run(cfg, log=lines.append)
    assert set(result["median_step_ms"]) == {"base", "few", "all", "no-lora engine"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["step_ms"].values())
    assert result["ratio_to_base"]["base"] == 1.0
    assert len(lines) == 8
    assert "3 rows under 3 adapters, 3 base" in text(result)
