"""Every numeric field is bounded at the edge; a request that cannot be decoded or built is answered
with an error, alone, and never fails or hangs anything else."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from strata.config import NUMERIC_RANGES, EngineConfig
from strata.sampling_params import SamplingParams
from strata.server import io
from strata.server.engine_proc import EngineLoop
from strata.server.protocol import APIError, make_sampling_params

VOCAB = 320


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"logprobs": 1.5}, "logprobs"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"top_k": VOCAB + 1}, "top_k"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_new_tokens": 2**40}, "max_new_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"repetition_penalty": 1e-30}, "repetition_penalty"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [1] * 2000}, None),
        ({"stop": [1]}, "stop"),
        ({"n": True}, "n"),
    ],
)
def test_sampling_fields_are_typed_and_bounded(fields, param):
    with pytest.raises(APIError) as info:
        make_sampling_params(fields, VOCAB)
    assert info.value.status == 400 and info.value.message
    if param is not None:
        assert info.value.param == param, info.value.message


def test_edge_values_still_pass():
    params = make_sampling_params(
        {
            "top_k": VOCAB,
            "seed": -(2**63),
            "logprobs": 20,
            "stop": "x",
            "temperature": 1e-7,
        },
        VOCAB,
    )
    assert params.stop == ["x"] and params.is_greedy


NUMERIC_FIELDS = [
    f.name
    for f in dataclasses.fields(EngineConfig)
    if str(f.type).replace(" | None", "") in ("int", "float")
]


def test_every_numeric_engine_flag_is_bounded():
    assert set(NUMERIC_FIELDS) <= set(NUMERIC_RANGES), set(NUMERIC_FIELDS) - set(
        NUMERIC_RANGES
    )


@pytest.mark.parametrize("name", NUMERIC_FIELDS)
def test_out_of_range_engine_flag_names_itself(name):
    low, high = NUMERIC_RANGES[name]
    bad = (
        [float("nan")]
        + ([low - 1] if low is not None else [])
        + ([high * 2 + 1] if high is not None else [])
    )
    for value in bad:
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')}"):
            EngineConfig(**{name: value})


class _Sent(list):
    def send(self, data, copy=False):
        self.append(io.decode_from_engine(bytes(data)))


def test_engine_answers_a_submission_it_cannot_decode():
    raw = msgspec.msgpack.decode(
        io.encode(io.GenerateReq("r-bad", [1, 2], SamplingParams()))
    )
    raw["params"]["logprobs"] = 1.5
    loop = EngineLoop.__new__(EngineLoop)
    loop.push, loop.secrets = _Sent(), []
    loop.reject_undecodable(
        memoryview(msgspec.msgpack.encode(raw)), ValueError("bad logprobs")
    )
    loop.reject_undecodable(
        memoryview(b"\x93garbage"), ValueError("not msgpack")
    )  # logged, no rid
    (answer,) = loop.push
    assert (
        isinstance(answer, io.AddResult) and answer.rid == "r-bad" and not answer.rids
    )
    assert "could not decode" in answer.error


def test_a_request_the_sampler_cannot_hold_fails_alone(llama_dir):
    from strata.engine.engine import Engine

    engine = Engine(model=str(llama_dir), dtype="float32", kv_cache_tokens=256)
    (good,) = engine.add_request(
        [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0)
    )
    engine.step()  # the good request is running when the bad one arrives
    for bad in (
        SamplingParams(top_k=2**70),
        SamplingParams(temperature=1e39),
        SamplingParams(seed=2**64),
    ):
        with pytest.raises(ValueError):
            engine.add_request([1, 2, 3], bad)
    finished = False
    while not finished:
        finished = any(
            o.finished and o.rid == good and o.finish_reason == "length"
            for o in engine.step()
        )
