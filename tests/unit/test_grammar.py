"""Structured output below the server: the sampler's bitmask, the compiler's cache and errors, a
request's grammar state, and the tool-call grammars (tiny trained tokenizer, no model)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from strata.grammar.compiler import GrammarCompiler, GrammarError
from strata.grammar.spec import GrammarSpec, json_schema_spec
from strata.grammar.state import fill_bitmasks
from strata.layers.sampler import (
    SamplingBatch,
    apply_token_bitmask_,
    sample,
    unpack_bitmask,
    unpack_bytes_torch,
)
from strata.server.tool_calls import TOOL_CALL_PARSERS

VOCAB = 384  # the tiny models' vocabulary (the tokenizer itself has ~320 tokens)


def bitmask_of(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    bits = np.zeros((len(allowed), words * 32), dtype=bool)
    for row, ids in enumerate(allowed):
        bits[row, ids] = True
    packed = np.packbits(
        bits.reshape(len(allowed), words, 32)[:, :, ::-1], axis=-1, bitorder="big"
    )
    return torch.from_numpy(
        packed.view(">u4")
        .astype(np.uint32)
        .view(np.int32)
        .reshape(len(allowed), words)
        .copy()
    )


# ------------------------------------------------------------------ the sampler's mask


def test_unpack_bitmask_reads_every_bit_including_the_sign_bit():
    allowed = [[0, 31, 32, 63, 64, 99], [5]]
    got = unpack_bitmask(bitmask_of(allowed, 100), 100)
    assert [torch.nonzero(row).view(-1).tolist() for row in got] == allowed
    # the accelerator path (a broadcast AND) agrees with numpy's unpackbits used on the CPU
    words = torch.randint(-(2**31), 2**31 - 1, (3, 7), dtype=torch.int32)
    assert torch.equal(
        unpack_bytes_torch(words.view(torch.uint8))[:, :200], unpack_bitmask(words, 200)
    )


def test_mask_applies_only_to_listed_rows_and_greedy_picks_the_best_allowed_token():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    rows = torch.tensor([1, 3])
    masked = logits.clone()
    apply_token_bitmask_(masked, rows, bitmask_of([[7, 8], [50]], 100))
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched
    assert torch.isinf(masked[1]).sum() == 98 and masked[3].argmax() == 50
    s = SamplingBatch(
        temperatures=torch.zeros(4),
        top_ps=torch.ones(4),
        top_ks=torch.full((4,), 100),
        min_ps=torch.zeros(4),
        uniforms=torch.rand(4),
        all_greedy=True,
        grammar_rows=rows,
        grammar_bitmask=bitmask_of([[7, 8], [50]], 100),
    )
    ids = sample(logits.clone(), s).token_ids.tolist()
    assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()
    assert ids[1] == (7 if logits[1, 7] > logits[1, 8] else 8) and ids[3] == 50


def test_sampled_rows_never_draw_a_forbidden_token():
    logits = torch.zeros(64, 40)
    allowed = [[3, 17, 29]] * 64
    s = SamplingBatch(
        temperatures=torch.ones(64),
        top_ps=torch.ones(64),
        top_ks=torch.full((64,), 40),
        min_ps=torch.zeros(64),
        uniforms=torch.rand(64),
        all_greedy=False,
        grammar_rows=torch.arange(64),
        grammar_bitmask=bitmask_of(allowed, 40),
    )
    ids = set(sample(logits, s).token_ids.tolist())
    assert ids <= {3, 17, 29} and len(ids) == 3


def test_a_row_with_nothing_allowed_keeps_its_logits():
    logits = torch.randn(1, 10)
    masked = logits.clone()
    apply_token_bitmask_(masked, torch.tensor([0]), bitmask_of([[]], 10))
    assert torch.equal(masked, logits)


# ------------------------------------------------------------------ compiler and state


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tiny_models import build_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], cache_size=2)


def allowed_ids(state) -> list[int]:
    bits = unpack_bitmask(torch.from_numpy(fill_bitmasks([state])), VOCAB)[0]
    return torch.nonzero(bits).view(-1).tolist()


def drive(state, tokenizer, text: str) -> bool:
    """Write `text` as a model under the mask would: each step the longest allowed token that continues
    it. True if the whole text was written."""
    while text:
        pieces = [
            (tokenizer.decode([t]), t) for t in allowed_ids(state) if t < len(tokenizer)
        ]
        fits = [(len(p), t) for p, t in pieces if p and text.startswith(p)]
        if not fits:
            return False
        n, token = max(fits)
        assert state.accept(token)
        text = text[n:]
    return True


def test_each_distinct_grammar_compiles_once_and_requests_get_independent_states(
    compiler, tokenizer
):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    first, second = (
        compiler.new_state(json_schema_spec(schema)),
        compiler.new_state(json_schema_spec(dict(schema))),
    )
    assert (compiler.stats.misses, compiler.stats.hits) == (1, 1)
    assert drive(first, tokenizer, '{"a": 12}') and first.is_complete
    assert not second.is_complete and drive(
        second, tokenizer, '{"a": '
    )  # untouched by the first
    assert allowed_ids(first) == [tokenizer.eos_token_id]
    # LRU of 2: a third grammar evicts the least recently used
    compiler.validate(GrammarSpec(kind="regex", source="x+"))
    compiler.validate(GrammarSpec(kind="regex", source="y+"))
    compiler.validate(json_schema_spec(schema))
    assert compiler.stats.misses == 4


@pytest.mark.parametrize(
    "spec, words",
    [
        (GrammarSpec(kind="regex", source="a(b"), "unclosed group"),
        (GrammarSpec(kind="lark", source="start: nothing_here"), "nothing_here"),
        (GrammarSpec(kind="json_schema", source='{"type": "wat"}'), "wat"),
        (GrammarSpec(kind="json_schema", source="{nope"), "not valid JSON"),
        (GrammarSpec(kind="json_schema", source="[1]"), "must be a JSON object"),
        (GrammarSpec(kind="regex", source=""), "empty"),
    ],
)
def test_bad_grammars_raise_a_grammar_error_naming_the_problem(compiler, spec, words):
    with pytest.raises(GrammarError, match=words):
        compiler.validate(spec)


def test_a_rejected_token_breaks_the_state_with_an_error(compiler, tokenizer):
    state = compiler.new_state(GrammarSpec(kind="regex", source="[0-9]+"))
    assert state.accept(tokenizer.encode("7", add_special_tokens=False)[0])
    assert not state.accept(tokenizer.encode("x", add_special_tokens=False)[0])
    assert state.error and not state.is_complete


def test_the_grammar_arms_after_its_trigger_and_rolls_back(compiler, tokenizer):
    trigger = tokenizer.encode("Hello", add_special_tokens=False)
    state = compiler.new_state(
        GrammarSpec(kind="regex", source="(yes|no)", start_after=trigger)
    )
    free = tokenizer.encode("The lazy dog ", add_special_tokens=False)
    for t in free:
        assert not state.needs_mask and state.accept(t)  # thinking: unconstrained
    for t in trigger:
        state.accept(t)
    assert state.needs_mask
    before = len(state.history)
    assert drive(state, tokenizer, "yes") and state.is_complete
    state.rollback(len(state.history) - before)
    assert drive(state, tokenizer, "no") and state.is_complete
    state.rollback(len(state.history) - before + 1)  # back past the trigger
    assert not state.needs_mask and not state.armed
    state.accept(trigger[-1])
    assert state.needs_mask


# ------------------------------------------------------------------ tool-call grammars

FUNCTIONS = [
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
    },
    {
        "name": "echo",
        "parameters": {
            "type": "object",
            "properties": {"s": {"type": "string"}},
            "required": ["s"],
            "additionalProperties": False,
        },
    },
]


@pytest.mark.parametrize(
    "parser, parallel, good, bad",
    [
        (
            "hermes",
            False,
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
            '<tool_call>\n{"name": "add", "arguments": {"s": "x"}}',
        ),
        (
            "hermes",
            True,
            (
                '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
                '<tool_call>\n{"name": "echo", "arguments": {"s": "hi"}}\n</tool_call>'
            ),
            '{"name": "add"',
        ),
        ("json", False, '{"name": "echo", "arguments": {"s": "hi"}}', '{"name": "mul"'),
        (
            "json",
            True,
            '[{"name": "echo", "arguments": {"s": "hi"}}, {"name": "add", "arguments": {"a": 2}}]',
            '[{"name": "echo", "arguments": {"a": 1',
        ),
    ],
)
def test_tool_grammars_accept_valid_calls_only(
    compiler, tokenizer, parser, parallel, good, bad
):
    spec = TOOL_CALL_PARSERS[parser].grammar(FUNCTIONS, parallel)
    state = compiler.new_state(spec)
    assert drive(state, tokenizer, good) and state.matcher.is_accepting()
    splitter = TOOL_CALL_PARSERS[parser].splitter()
    events = splitter.feed(good)
    calls = events.calls + splitter.finish().calls
    assert [c.name for c in calls] == re.findall(r'"name": "(\w+)"', good)
    assert [json.loads(c.arguments) for c in calls] == [
        json.loads(a) for a in re.findall(r'"arguments": ({[^}]*})', good)
    ]
    assert not drive(compiler.new_state(spec), tokenizer, bad + " ]]]}}}")
