"""`strata spec train` on a tiny target: the drafter it writes is served with identical greedy
output and drafts the answers it was trained on; a run killed in any phase resumes where it
stopped (a killed training run ends with the weights of one that never stopped); the block loss's
accept length is the greedy verifier's; the prompts are none of the bench's; bad flags are refused."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from strata import Engine, SamplingParams
from strata.bench import spec as bench_spec
from strata.drafting import prompts as train_prompts
from strata.drafting.cli import add_spec_args, config_from_args
from strata.drafting.model import block_metrics
from strata.drafting.train import (
    ANSWERS_FILE,
    STATE_FILE,
    STREAMS_FILE,
    TrainConfig,
    Trainer,
    default_target_layers,
)
from strata.models.dspark import read_dspark_dir

TINY = dict(
    chat_prompts=6,
    grounded_prompts=2,
    passage_tokens=40,
    answer_len=24,
    batch=2,
    anchors=8,
    block_size=4,
    markov_rank=8,
    draft_layers=1,
    lr=3e-3,
    eval_prompts=2,
    eval_answer_len=16,
    bf16=False,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny_models import make_model

    return make_model(
        tmp_path_factory.mktemp("spec-train") / "target", "llama", num_hidden_layers=4
    )


def engine_options(target) -> dict:
    return {"model": str(target), "dtype": "float32", "kv_cache_tokens": 4096}


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    cfg = TrainConfig(output=str(out), steps=300, **TINY)
    record = Trainer(cfg, engine_options(target)).run()
    return out, record


def test_the_drafter_is_served_with_identical_output_and_drafts_what_it_learned(
    target, trained
):
    out, record = trained
    assert (out / "training.png").is_file() and (out / "training.json").is_file()
    budget = record["budget_s"]
    assert budget["total"] == pytest.approx(
        budget["answers"]
        + budget["streams"]
        + budget["training"]
        + budget["evaluation"]
    )
    assert record["steps"] == 300
    assert set(record["held_out"]) == {"grounded", "chat"}
    dspark, layers = read_dspark_dir(out)
    assert dspark.target_layer_ids == default_target_layers(4)
    assert layers.num_layers == 1
    history = json.loads((out / "training.json").read_text())["history_every_100"]
    assert history[-1]["loss"] < history[0]["loss"] / 2
    stored = json.loads((out / "prompts.json").read_text())
    answers = {
        json.loads(line)["i"]: json.loads(line)["answer"]
        for line in (out / ANSWERS_FILE).read_text().splitlines()
    }
    params = SamplingParams(temperature=0, max_new_tokens=24)
    served = Engine(
        **engine_options(target),
        speculative_algorithm="dspark",
        speculative_draft_model=str(out),
        speculative_fixed_length=True,
        speculative_num_draft_tokens=4,
    )
    got = served.generate(stored["ids"], params)
    assert [r.choices[0].token_ids for r in got] == [
        answers[i] for i in range(len(stored["ids"]))
    ]
    # the answers it was trained on (all but the held-out one) are drafted well past one token
    assert served.scheduler.spec.stats.mean_accept_len > 1.5


def test_a_killed_run_resumes_to_the_weights_of_one_that_never_stopped(
    target, tmp_path, monkeypatch
):
    cfg = dict(TINY, steps=24, checkpoint_every_s=0.0, eval_prompts=0)
    whole = Trainer(
        TrainConfig(output=str(tmp_path / "whole"), **cfg), engine_options(target)
    )
    whole.run()

    killed_dir = tmp_path / "killed"
    saves = {"n": 0}
    real_save = Trainer._save_state

    def save_then_die(self, *a):
        real_save(self, *a)
        saves["n"] += 1
        if saves["n"] == 10:
            raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_save_state", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        Trainer(
            TrainConfig(output=str(killed_dir), **cfg), engine_options(target)
        ).run()
    monkeypatch.setattr(Trainer, "_save_state", real_save)
    state = torch.load(killed_dir / STATE_FILE, weights_only=False)
    assert state["progress"]["step"] == 10

    # the answers already written are not asked for again
    asked = []
    real_generate = Engine.generate

    def counting(self, prompts, params=None):
        asked.extend(prompts)
        return real_generate(self, prompts, params)

    lines = (killed_dir / ANSWERS_FILE).read_text().splitlines()
    (killed_dir / ANSWERS_FILE).write_text("\n".join(lines[:3]) + "\n")
    (killed_dir / STREAMS_FILE).unlink()
    monkeypatch.setattr(Engine, "generate", counting)
    Trainer(TrainConfig(output=str(killed_dir), **cfg), engine_options(target)).run()
    assert len(asked) == len(lines) - 3

    from safetensors.torch import load_file

    a = load_file(tmp_path / "whole" / "model.safetensors")
    b = load_file(killed_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_block_accept_length_is_one_plus_the_leading_hits():
    hits = torch.tensor(
        [[True, True, False, True], [False, True, True, True], [True, True, True, True]]
    )
    valid = torch.tensor(
        [[True] * 4, [True] * 4, [True, True, True, False]]
    )  # the last block runs past its sequence
    m = block_metrics(hits & valid, valid)
    assert m["accept_length"] == pytest.approx((3 + 1 + 4) / 3)
    assert m["acc@0"] == pytest.approx(2 / 3) and m["acc@3"] == pytest.approx(1.0)


def test_training_prompts_are_none_of_the_benchs(target):
    from strata.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    assert not set(train_prompts.chat_prompts()) & set(bench_spec.chat_questions())
    bench_passages = set(bench_spec.doc_passages(tok, 40))
    ours = train_prompts.grounded_prompts(tok, 40)
    assert ours and not any(p in q for p in bench_passages for q in ours)


def test_default_target_layers_spread_below_the_last():
    assert default_target_layers(30) == (1, 10, 19, 28)
    assert default_target_layers(4) == (1, 2)
    assert all(i < 29 for i in default_target_layers(30))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_spec_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["spec", "train", "--output", "x", *argv])


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--block-size", "0"], "--block-size must be at least 1"),
        (["--anchors", "0"], "--anchors must be at least 1"),
        (["--markov-rank", "-1"], "--markov-rank"),
        (["--chat-prompts", "1", "--grounded-prompts", "0"], "at least two prompts"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lr", "0"], "must be positive"),
    ],
)
def test_bad_flags_say_what_to_fix(argv, match):
    with pytest.raises(ValueError, match=match):
        config_from_args(parse(argv))


def test_target_layers_outside_the_target_are_refused(target, tmp_path):
    cfg = TrainConfig(output=str(tmp_path / "d"), target_layers=(1, 3), **TINY)
    with pytest.raises(ValueError, match=r"strictly increasing layers in -1 \.\. 2"):
        Trainer(cfg, engine_options(target)).run()


def test_prompts_that_cannot_fit_the_context_are_left_out(
    target, tmp_path, monkeypatch
):
    """A documentation passage of one long paragraph can outgrow a small model's context: the run
    leaves that prompt out instead of failing."""
    import strata.drafting.prompts as prompts_module

    fits, too_long = "Tell me about kites.", "word " * 2000
    monkeypatch.setattr(
        prompts_module, "training_prompts", lambda *a, **k: [too_long, fits]
    )
    cfg = TrainConfig(output=str(tmp_path / "d"), **TINY)
    trainer = Trainer(cfg, engine_options(target))
    trainer.target_layers = default_target_layers(4)  # what run() sets before the data
    engine = Engine(**engine_options(target))
    try:
        samples = trainer.data(engine)
    finally:
        engine.close()
    stored = json.loads((tmp_path / "d" / "prompts.json").read_text())
    assert stored["texts"] == [fits] and len(samples) == 1
