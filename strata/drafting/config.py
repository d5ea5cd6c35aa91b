"""`strata spec train`'s settings (torch-free: the CLI builds its flags from them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    output: str
    draft_layers: int = 2
    block_size: int = 8
    target_layers: tuple[int, ...] | None = None  # None: four spread over the target's
    markov_rank: int = 64
    markov_head: str = "vanilla"
    confidence_head: bool = True
    mask_token_id: int | None = (
        None  # None: an added token the chat template does not use
    )
    draft_vocab: int = 8192  # the answers' most frequent tokens the served drafter drafts from (0: all)
    chat_prompts: int = 1904  # every template x topic
    grounded_prompts: int = 300
    passage_tokens: int = 320
    answer_len: int = 256
    anchors: int = 32  # blocks drawn per sequence per step
    batch: int = 4  # sequences per optimizer step
    lr: float = 1e-3
    warmup: float = 0.04
    loss_decay_gamma: float = 4.0
    confidence_weight: float = 1.0
    steps: int | None = None  # None: as many as fit the time budget
    time_budget_min: float = 60.0  # every phase together
    eval_reserve_min: float = 3.0  # kept back from training for the held-out evaluation
    validation_share: float = 0.05
    checkpoint_every_s: float = 120.0
    eval_prompts: int = 8
    eval_answer_len: int = 128
    seed: int = 0
    bf16: bool | None = (
        None  # matmuls under bf16 autocast; None: where the CPU has bf16 units
    )

    def use_bf16(self) -> bool:
        if self.bf16 is not None:
            return self.bf16
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def data_key(self) -> dict:
        """What the answers and streams depend on (a resumed run with others starts them over)."""
        keys = (
            "chat_prompts",
            "grounded_prompts",
            "passage_tokens",
            "answer_len",
            "seed",
        )
        return {k: getattr(self, k) for k in keys}
