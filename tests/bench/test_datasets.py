"""Dataset generators: deterministic for a seed, the lengths asked for, the shapes described."""

from __future__ import annotations

import json

import pytest

from strata.bench.datasets import (
    DatasetConfig,
    make_dataset,
    num_requests,
    turn_prompt_ids,
)


def test_random_is_deterministic_for_a_seed(tiny_tokenizer):
    cfg = DatasetConfig(
        name="random", num_prompts=5, input_len=24, output_len=7, seed=3
    )
    a, b = make_dataset(cfg, tiny_tokenizer), make_dataset(cfg, tiny_tokenizer)
    assert a == b
    c = make_dataset(
        DatasetConfig(name="random", num_prompts=5, input_len=24, output_len=7, seed=4),
        tiny_tokenizer,
    )
    assert [x.turns[0].text for x in a] != [x.turns[0].text for x in c]


def test_random_lengths_are_real_tokens_of_the_asked_length(tiny_tokenizer):
    convs = make_dataset(
        DatasetConfig(name="random", num_prompts=6, input_len=40, output_len=5),
        tiny_tokenizer,
    )
    for conv in convs:
        (turn,) = conv.turns
        assert len(turn.ids) == 40
        assert tiny_tokenizer.encode(turn.text, add_special_tokens=False) == list(
            turn.ids
        )
        assert turn.output_len == 5
        assert not set(turn.ids) & set(tiny_tokenizer.all_special_ids)


def test_range_ratio_bounds_lengths(tiny_tokenizer):
    convs = make_dataset(
        DatasetConfig(
            name="random", num_prompts=30, input_len=40, output_len=20, range_ratio=0.5
        ),
        tiny_tokenizer,
    )
    ins = [len(c.turns[0].ids) for c in convs]
    outs = [c.turns[0].output_len for c in convs]
    assert all(20 <= n <= 40 for n in ins) and len(set(ins)) > 1
    assert all(10 <= n <= 20 for n in outs) and len(set(outs)) > 1


def test_shared_prefix_groups_share_their_system_prompt(tiny_tokenizer):
    cfg = DatasetConfig(
        name="shared-prefix",
        num_groups=3,
        prompts_per_group=4,
        system_len=30,
        question_len=8,
        output_len=4,
    )
    convs = make_dataset(cfg, tiny_tokenizer)
    assert len(convs) == 12
    systems = {c.system.ids for c in convs}
    assert len(systems) == 3
    assert all(sum(c.system.ids == s for c in convs) == 4 for s in systems)
    ids = turn_prompt_ids(convs[0], 0, None, None, tiny_tokenizer)
    assert ids[: len(convs[0].system.ids)] == list(convs[0].system.ids)
    assert make_dataset(cfg, tiny_tokenizer) == convs


def test_multi_turn_prompts_grow_with_history(tiny_tokenizer):
    convs = make_dataset(
        DatasetConfig(
            name="multi-turn", num_prompts=2, num_turns=3, input_len=10, output_len=4
        ),
        tiny_tokenizer,
    )
    assert len(convs) == 2 and num_requests(convs) == 6
    first = turn_prompt_ids(convs[0], 0, None, None, tiny_tokenizer)
    second = turn_prompt_ids(convs[0], 1, first, [5, 6, 7], tiny_tokenizer)
    assert second[: len(first) + 3] == first + [5, 6, 7]
    assert second[-10:] == list(convs[0].turns[1].ids)


def test_file_dataset_reads_sharegpt_and_prompt_lines(tmp_path, tiny_tokenizer):
    path = tmp_path / "data.jsonl"
    lines = [
        {
            "conversations": [
                {"from": "human", "value": "hello world"},
                {"from": "gpt", "value": "the quick brown fox"},
                {"from": "human", "value": "and then?"},
                {"from": "gpt", "value": "dog"},
            ]
        },
        {"prompt": "Paged attention keeps", "output_len": 9},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "Numbers 0123"},
            ]
        },
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    convs = make_dataset(
        DatasetConfig(name="file", path=str(path), num_prompts=10, output_len=3),
        tiny_tokenizer,
    )
    by_text = {c.turns[0].text: c for c in convs}
    assert set(by_text) == {"hello world", "Paged attention keeps", "Numbers 0123"}
    assert (
        len(by_text["hello world"].turns) == 1
    )  # first turn only unless file_multi_turn
    assert by_text["hello world"].turns[0].output_len == len(
        tiny_tokenizer.encode("the quick brown fox", add_special_tokens=False)
    )
    assert by_text["Paged attention keeps"].turns[0].output_len == 9
    assert by_text["Numbers 0123"].system.text.startswith("be brief")
    assert by_text["Numbers 0123"].turns[0].output_len == 3
    multi = make_dataset(
        DatasetConfig(
            name="file", path=str(path), file_multi_turn=True, file_output_len=2
        ),
        tiny_tokenizer,
    )
    conv = next(c for c in multi if c.turns[0].text == "hello world")
    assert [t.text for t in conv.turns] == ["hello world", "and then?"] and {
        t.output_len for t in conv.turns
    } == {2}


def test_file_dataset_errors_name_the_line(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        make_dataset(DatasetConfig(name="file", path=str(path)), tiny_tokenizer)
    with pytest.raises(FileNotFoundError):
        make_dataset(
            DatasetConfig(name="file", path=str(tmp_path / "missing.jsonl")),
            tiny_tokenizer,
        )
    with pytest.raises(ValueError, match="--dataset-path"):
        DatasetConfig(name="file")
