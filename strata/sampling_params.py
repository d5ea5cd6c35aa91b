"""Per-request sampling parameters, validated once when a request arrives."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # HF semantics, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and k alternatives
    skip_special_tokens: bool = True

    MAX_N = 16
    MAX_TOP_LOGPROBS = 20

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field and the accepted range."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"),
            (self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}"),
            (
                self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})",
            ),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 0, f"top_k must be -1 (disabled) or >= 0, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (1 <= self.n <= self.MAX_N, f"n must be in [1, {self.MAX_N}], got {self.n}"),
            (
                self.logprobs is None or 0 <= self.logprobs <= self.MAX_TOP_LOGPROBS,
                f"logprobs must be in [0, {self.MAX_TOP_LOGPROBS}], got {self.logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
