from __future__ import annotations

import pytest

from strata.engine.limits import LimitError, SizeLimits
from strata.server.protocol import APIError, resolve_max_tokens

LIMITS = SizeLimits(context_len=512, pool_tokens=300)


@pytest.mark.parametrize(
    ("prompt_len", "max_new", "fits"),
    [
        (10, 502, False),  # 512 in all fits the context, but needs 511 KV slots
        (10, 291, True),  # needs 300 slots: exactly the pool
        (10, 292, False),
        (300, 1, True),  # the last sampled token needs no slot
        (301, 1, False),
        (300, 0, True),
    ],
)
def test_a_request_fits_iff_context_and_pool_allow(prompt_len, max_new, fits):
    if fits:
        LIMITS.check(prompt_len, max_new)
        assert max_new <= max(LIMITS.max_new(prompt_len), 0)
    else:
        with pytest.raises(LimitError):
            LIMITS.check(prompt_len, max_new)


def test_each_limit_has_one_text_named_by_the_callers_fields():
    with pytest.raises(LimitError, match="empty") as e:
        LIMITS.check(0, 4)
    assert e.value.param == "prompt"
    with pytest.raises(LimitError, match="accepts 512 tokens in all") as e:
        SizeLimits(512, 10_000).check(600, 4, prompt_param="messages")
    assert e.value.param == "messages"
    with pytest.raises(LimitError, match="KV cache holds 300;") as e:
        LIMITS.check(400, 4)
    with pytest.raises(LimitError, match="max_tokens to at most 291") as e:
        LIMITS.check(10, 400, param="max_tokens")
    assert e.value.param == "max_tokens"


def test_the_frontend_and_the_engine_refuse_with_the_same_words():
    with pytest.raises(LimitError) as engine_error:
        LIMITS.check(10, 400, param="max_tokens")
    with pytest.raises(APIError) as http_error:
        resolve_max_tokens(400, 10, 512, 300, default=None)
    assert str(engine_error.value) == http_error.value.message
    assert http_error.value.code == "context_length_exceeded"
