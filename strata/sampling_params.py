"""Per-request sampling parameters, validated once when a request arrives.

Every numeric field is bounded by what the model and the sampler's tensors can hold (top_k and
token ids by the vocabulary, seeds by 64 bits, floats finite and within float32, counts within
int32), so a request that passes validation cannot fail a batch it joins later.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from strata.grammar.spec import GrammarSpec

INT32_MAX = 2**31 - 1
SEED_LIMIT = 2**63  # seeds are signed 64-bit integers
FLOAT32_MAX = 3.4028234663852886e38
_TOKEN_ID = re.compile(r"-?[0-9]+")


LOGIT_BIAS_RANGE = (-100.0, 100.0)


def logit_bias_of(logit_bias: Any, vocab_size: int | None = None) -> dict[int, float]:
    """logit_bias checked and keyed by token id: JSON writes the ids as strings ("50256"), Python may
    use ints. Raises ValueError naming the offending id or bias."""
    if not isinstance(logit_bias, dict):
        raise ValueError(
            f"logit_bias must be a map from token id to bias, got {type(logit_bias).__name__}"
        )
    low, high = LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if isinstance(key, str) and _TOKEN_ID.fullmatch(key):
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool):
            token_id = key
        else:
            raise ValueError(
                f"logit_bias key {key!r} is not a token id (in JSON, a string of an integer)"
            )
        if not 0 <= token_id < (vocab_size or INT32_MAX):
            where = (
                f"outside the vocabulary [0, {vocab_size})"
                if vocab_size
                else "not a token id (negative)"
            )
            raise ValueError(f"logit_bias names token id {token_id}, which is {where}")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not (number and low <= bias <= high):  # NaN fails the comparison
            raise ValueError(
                f"logit_bias for token id {token_id} must be a number in [{low:g}, {high:g}], got {bias!r}"
            )
        out[token_id] = float(bias)
    return out


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
    logprobs: int | None = (
        None  # None: no logprobs; k >= 0: the chosen token's and k alternatives
    )
    skip_special_tokens: bool = True
    structured: GrammarSpec | None = (
        None  # constrain the output to a JSON schema / regex / grammar
    )
    # OpenAI's logit_bias: token id -> a bias added to its logit before penalties and sampling (greedy
    # too); -100 / 100 all but ban / force the token
    logit_bias: dict[int, float] | None = None
    # scheduling order, as vLLM's `priority`: lower is admitted first and may preempt running
    # requests of a higher value; 0 for interactive traffic, batch jobs run at a larger value
    priority: int = 0

    MAX_N = 16
    MAX_TOP_LOGPROBS = 20
    MAX_STOP_TOKEN_IDS = 1024
    REPETITION_PENALTY_RANGE = (0.01, 100.0)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """Typed conversion of a JSON object (e.g. /generate's sampling_params): a wrong type raises
        ValueError naming the field ("logprobs: Expected `int | null`, got `float`")."""
        if isinstance(fields.get("stop"), str):
            fields = {**fields, "stop": [fields["stop"]]}
        if fields.get("logit_bias") is not None:
            fields = {**fields, "logit_bias": logit_bias_of(fields["logit_bias"])}
        try:
            return msgspec.convert(fields, cls)
        except msgspec.ValidationError as exc:
            text = str(exc)
            field = (
                text.rsplit("at `$.", 1)[-1].rstrip("`").split("[")[0]
                if "at `$." in text
                else ""
            )
            raise ValueError(
                f"{field} has the wrong type: {text}" if field else text
            ) from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field and the accepted range."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ):
            value = getattr(self, name)
            if not (
                isinstance(value, (int, float))
                and math.isfinite(value)
                and abs(value) <= FLOAT32_MAX
            ):
                raise ValueError(f"{name} must be a finite number, got {value}")
        low, high = self.REPETITION_PENALTY_RANGE
        checks = [
            (
                0 <= self.max_new_tokens <= INT32_MAX,
                f"max_new_tokens must be in [0, {INT32_MAX}], got {self.max_new_tokens}",
            ),
            (
                self.min_new_tokens >= 0,
                f"min_new_tokens must be >= 0, got {self.min_new_tokens}",
            ),
            (
                self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})",
            ),
            (
                self.temperature >= 0,
                f"temperature must be >= 0, got {self.temperature}",
            ),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (
                self.top_k == -1 or 0 <= self.top_k <= (vocab_size or INT32_MAX),
                (
                    f"top_k must be -1 or 0 (disabled) or at most the vocabulary size ({vocab_size or INT32_MAX}), "
                    f"got {self.top_k}"
                ),
            ),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                low <= self.repetition_penalty <= high,
                f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                1 <= self.n <= self.MAX_N,
                f"n must be in [1, {self.MAX_N}], got {self.n}",
            ),
            (
                self.seed is None or -SEED_LIMIT <= self.seed < SEED_LIMIT,
                f"seed must be a 64-bit signed integer, got {self.seed}",
            ),
            (
                self.logprobs is None
                or 0
                <= self.logprobs
                <= min(self.MAX_TOP_LOGPROBS, vocab_size or INT32_MAX),
                f"logprobs must be in [0, {min(self.MAX_TOP_LOGPROBS, vocab_size or INT32_MAX)}], got {self.logprobs}",
            ),
            (
                len(self.stop_token_ids) <= self.MAX_STOP_TOKEN_IDS,
                f"at most {self.MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop must be a list of non-empty strings",
            ),
            (len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}"),
            (
                -INT32_MAX <= self.priority <= INT32_MAX,
                f"priority must be in [{-INT32_MAX}, {INT32_MAX}], got {self.priority}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.structured is not None:
            self.structured.validate_shape()
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
                )
        if self.logit_bias is not None:
            self.logit_bias = logit_bias_of(self.logit_bias, vocab_size)
