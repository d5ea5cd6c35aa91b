"""One-batch measurements with vLLM's offline `LLM`, run by the `vllm` bench target in vLLM's own
Python environment (it imports nothing from strata).

    python vllm_runner.py MODEL_DIR [--prefix-caching]

reads one JSON request per stdin line, {"prompts": [[ids...], ...], "warmup": [[ids...], ...],
"output_len": N}, and answers one JSON line per request: {"prefill_s", "total_s", "decode_step_ms"}.
Prefill is timed as generate(max_tokens=1) of the whole batch; decode as the extra time of
generate(max_tokens=N) over that, per step: (total - prefill) / (N - 1). Greedy, ignore_eos.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir = sys.argv[1]
    with open(f"{model_dir}/config.json") as f:
        context = json.load(f).get("max_position_embeddings") or 8192
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enable_prefix_caching="--prefix-caching" in sys.argv,
        max_model_len=min(
            8192, context
        ),  # its KV space is sized for this; long enough for the benches
        max_num_seqs=256,
    )

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return time.perf_counter() - start

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        run(req["warmup"], 4)
        prefill_s = run(req["prompts"], 1)
        total_s = run(req["prompts"], req["output_len"])
        steps = max(1, req["output_len"] - 1)
        step_ms = 1000.0 * max(0.0, total_s - prefill_s) / steps
        print(
            json.dumps(
                {"prefill_s": prefill_s, "total_s": total_s, "decode_step_ms": step_ms}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
