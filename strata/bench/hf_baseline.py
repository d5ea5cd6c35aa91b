"""The transformers baseline: the same model directory through `AutoModelForCausalLM`.

    one-batch  a greedy loop over the model's own forward with its KV cache: one prefill forward
               of the whole batch (logits of the last position only), then one forward per decode
               step; the same figures as one_batch.py (prefill tok/s, median decode step)
    offline    static batching with `generate()`: requests in arrival order, `batch_size` at a
               time, left-padded, each batch generating max(output_len) tokens with EOS ignored
               (min_new_tokens = max_new_tokens); a request's extra tokens are wasted time, which
               is exactly what continuous batching saves

It runs in the dtype and thread count Strata picked, so the comparison is of the engines only.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from strata.bench.one_batch import (
    WARMUP_INPUT_LEN,
    WARMUP_OUTPUT_LEN,
    OneBatchResult,
    random_batch,
)


class HFModel:
    """A transformers causal LM loaded from a model directory, ready for inference."""

    def __init__(self, model_dir: str | Path, dtype, device: str = "cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
            .to(device)  # type: ignore[arg-type]  # transformers' decorated .to() hides its signature
            .eval()
        )
        self.device = device
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.pad_id = int(pad[0] if isinstance(pad, list) else (pad or 0))

    def one_batch(
        self,
        batch_size: int,
        input_len: int,
        output_len: int,
        seed: int = 0,
        exclude: set[int] | None = None,
    ) -> OneBatchResult:
        torch = self.torch
        warm = random_batch(
            self.vocab_size,
            batch_size,
            min(WARMUP_INPUT_LEN, input_len),
            seed + 10_000,
            exclude or set(),
        )
        self._greedy_loop(torch.tensor(warm, device=self.device), WARMUP_OUTPUT_LEN)
        ids = torch.tensor(
            random_batch(
                self.vocab_size, batch_size, input_len, seed, exclude or set()
            ),
            device=self.device,
        )
        prefill_s, step_s = self._greedy_loop(ids, output_len)
        step_ms = 1000.0 * statistics.median(step_s) if step_s else None
        return OneBatchResult.measured(
            "transformers",
            batch_size,
            input_len,
            output_len,
            prefill_s,
            step_ms,
            len(step_s),
        )

    def _greedy_loop(self, ids, output_len: int) -> tuple[float, list[float]]:
        """(prefill seconds, decode step seconds) of greedy generation of output_len tokens."""
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            prefill_s = time.perf_counter() - t0
            past = out.past_key_values
            steps = []
            for _ in range(output_len - 1):
                t0 = time.perf_counter()
                out = self.model(
                    input_ids=next_ids, past_key_values=past, use_cache=True
                )
                next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
                past = out.past_key_values
                steps.append(time.perf_counter() - t0)
        return prefill_s, steps

    def generate_batch(
        self, prompts: list[list[int]], output_lens: list[int], batch_size: int
    ) -> list[list[int]]:
        """Greedy answers (output_lens[i] tokens each) by static batches of `batch_size`."""
        torch = self.torch
        answers: list[list[int]] = []
        for lo in range(0, len(prompts), batch_size):
            chunk, lens = (
                prompts[lo : lo + batch_size],
                output_lens[lo : lo + batch_size],
            )
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(
                chunk
            ):  # left padding: every prompt ends at the last column
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            n = max(lens)
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=self.pad_id,
                )
            new = out[:, width:].tolist()
            answers.extend(row[:k] for row, k in zip(new, lens))
        return answers
