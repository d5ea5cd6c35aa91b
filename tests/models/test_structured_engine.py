"""Structured output through the offline Engine on a tiny random model: the grammar mask alone makes
its output valid, constrained and free requests share batches without affecting each other."""

from __future__ import annotations

import json
import re

import pytest

from strata import Engine, SamplingParams
from strata.grammar.spec import GrammarSpec, json_schema_spec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tiny_models import make_model

    model = make_model(tmp_path_factory.mktemp("structured") / "tiny", "llama")
    return Engine(str(model), dtype="float32", kv_cache_tokens=4096)


def check(value: dict) -> None:
    assert set(value) == {"name", "n", "ok"}
    assert (
        len(value["name"]) <= 6
        and -5 <= value["n"] <= 500
        and isinstance(value["ok"], bool)
    )


def test_constrained_rows_are_valid_and_free_rows_are_unchanged(engine):
    free = SamplingParams(temperature=0, max_new_tokens=24)
    alone = [
        r.text for r in engine.generate(["The quick brown fox", "Hello world"], free)
    ]
    prompts = ["The quick brown fox", "Paged attention", "Hello world", "Numbers 0123"]
    params = [
        free,
        SamplingParams(
            temperature=0, max_new_tokens=80, structured=json_schema_spec(SCHEMA)
        ),
        free,
        SamplingParams(
            temperature=1.0,
            seed=7,
            max_new_tokens=80,
            structured=json_schema_spec(SCHEMA),
        ),
    ]
    out = engine.generate(prompts, params)
    assert [out[0].text, out[2].text] == alone
    for r in (out[1], out[3]):
        assert r.finish_reason == "stop", r.text
        check(json.loads(r.text))
    engine.scheduler.check_no_leaks()


def test_sampled_requests_all_satisfy_their_grammar(engine):
    params = [
        SamplingParams(
            temperature=1.2,
            seed=s,
            max_new_tokens=80,
            structured=json_schema_spec(SCHEMA),
        )
        for s in range(12)
    ]
    for r in engine.generate(["Radix trees"] * 12, params):
        assert r.finish_reason == "stop", r.text
        check(json.loads(r.text))
    regex = SamplingParams(
        temperature=1.0,
        seed=1,
        max_new_tokens=40,
        structured=GrammarSpec(kind="regex", source=r"(cat|dog)s? [a-z]{2,5}!"),
    )
    (r,) = engine.generate(["x"], regex)
    assert (
        re.fullmatch(r"(cat|dog)s? [a-z]{2,5}!", r.text) and r.finish_reason == "stop"
    )


def test_the_grammar_applies_only_after_its_trigger(engine):
    """A reasoning model's grammar waits for `</think>`: here the trigger is whatever this model writes
    first when free, so the constrained run must write exactly that, then follow the grammar."""
    (free,) = engine.generate(
        ["Hello world"], SamplingParams(temperature=0, max_new_tokens=3)
    )
    trigger = free.choices[0].token_ids[:3]
    spec = GrammarSpec(kind="regex", source=r"<[0-9]{3}>", start_after=trigger)
    (out,) = engine.generate(
        ["Hello world"],
        SamplingParams(temperature=0, max_new_tokens=30, structured=spec),
    )
    ids = out.choices[0].token_ids
    assert ids[:3] == trigger and out.choices[0].finish_reason == "stop"
    tail = engine.tokenizer.decode(ids[3:])
    assert re.fullmatch(r"<[0-9]{3}>", tail), tail


def test_n_greedy_choices_agree(engine):
    params = SamplingParams(
        temperature=0, n=3, max_new_tokens=80, structured=json_schema_spec(SCHEMA)
    )
    (out,) = engine.generate(["Hello"], params)
    assert len(out.choices) == 3 and len({c.text for c in out.choices}) == 1
    check(json.loads(out.choices[0].text))


def test_an_invalid_grammar_fails_its_request_alone(engine):
    with pytest.raises(ValueError, match="unclosed group"):
        engine.generate(
            ["x"], SamplingParams(structured=GrammarSpec(kind="regex", source="a(b"))
        )
    assert (
        engine.generate(["Hello"], SamplingParams(temperature=0, max_new_tokens=4))[
            0
        ].completion_tokens
        == 4
    )
    engine.scheduler.check_no_leaks()


@pytest.mark.slow
def test_the_default_model_answers_a_schema_with_parseable_json(default_dir):
    from strata.tokenizer import apply_chat_template

    engine = Engine(str(default_dir))
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    prompt = apply_chat_template(
        engine.tokenizer,
        [{"role": "user", "content": "What is the capital of France? JSON."}],
    )
    (r,) = engine.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_new_tokens=60, structured=json_schema_spec(schema)
        ),
    )
    answer = json.loads(r.text)
    assert r.finish_reason == "stop" and set(answer) == {"city", "country"}
    assert "paris" in answer["city"].lower()
