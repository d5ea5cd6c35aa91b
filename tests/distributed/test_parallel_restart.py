"""A process starts one split replica after another: closing an engine, a load that failed and an
engine dropped unclosed all leave torch.distributed's groups, so the next `Engine(tp_size=2)` or
`Engine(ep_size=2)` in the process starts and gives the same tokens; a second split engine while
one is open is refused with what to do, before any worker starts."""

from __future__ import annotations

import gc

import pytest
from tiny_models import make_model

from strata import Engine, SamplingParams

PROMPTS = [[5, 17, 33, 91, 120, 7], [44, 3, 250]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
ENGINE = {"dtype": "float32", "kv_cache_tokens": 256, "page_size": 4}
SPLITS = {"tp2": ("llama", {"tp_size": 2}), "ep2": ("qwen3_moe", {"ep_size": 2})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_restart")
    return {
        family: make_model(root / family, family, tokenizer=False)
        for family in ("llama", "qwen3_moe")
    }


def tokens(engine: Engine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("split", list(SPLITS))
def test_a_closed_split_engine_lets_the_process_start_another(models, split):
    family, options = SPLITS[split]
    results = []
    for _ in range(2):
        engine = Engine(str(models[family]), **ENGINE, **options)
        try:
            results.append(tokens(engine))
        finally:
            engine.close()
    assert results[0] == results[1]
    assert all(len(t) == GREEDY.max_new_tokens for t in results[0])


def test_a_split_engine_whose_load_failed_leaves_the_process_free(models):
    """The draft model is resolved after the workers have started and loaded their shards."""
    with pytest.raises(ValueError, match="Cannot use model"):
        Engine(
            str(models["llama"]),
            **ENGINE,
            tp_size=2,
            speculative_algorithm="draft",
            speculative_draft_model="/nonexistent/draft",
        )
    engine = Engine(str(models["llama"]), **ENGINE, tp_size=2)
    try:
        assert len(tokens(engine)[0]) == GREEDY.max_new_tokens
    finally:
        engine.close()


def test_an_unclosed_split_engine_frees_the_process_when_collected(models):
    engine = Engine(str(models["llama"]), **ENGINE, tp_size=2)
    want = tokens(engine)
    (worker,) = engine.parallel.procs
    del engine
    gc.collect()
    assert worker.poll() is not None
    engine = Engine(str(models["llama"]), **ENGINE, tp_size=2)
    try:
        assert tokens(engine) == want
    finally:
        engine.close()


def test_a_second_split_engine_while_one_is_open_is_refused_clearly(models):
    engine = Engine(str(models["llama"]), **ENGINE, tp_size=2)
    try:
        with pytest.raises(RuntimeError, match=r"close\(\) that Engine"):
            Engine(str(models["llama"]), **ENGINE, tp_size=2)
        assert len(engine.parallel.procs) == 1  # the refused one started no worker
        assert (
            len(tokens(engine)[0]) == GREEDY.max_new_tokens
        )  # and the open one still runs
    finally:
        engine.close()
