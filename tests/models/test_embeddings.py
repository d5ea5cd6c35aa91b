"""`Engine.embed` against transformers (the oracle): the final hidden state after the final norm,
last-token and mean pooled, fp32; and an embedding leaves generation and the KV cache alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import make_model
from transformers import AutoModelForCausalLM

from strata import Engine, SamplingParams
from strata.engine.limits import embed_batches

INPUTS = [
    [5, 17, 33, 91, 120, 7, 64, 200, 13],
    [44, 3, 250],
    list(range(30, 30 + 41)),  # past gemma3's window of 8
    [300],
]
# llama; qwen3 (q/k norms); gemma3 (sandwich norms, scaled embeddings, sliding windows);
# deepseek_v2 (latent attention: a latent scratch pool)
FAMILIES = ["llama", "qwen3", "gemma3", "deepseek_v2"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed-models")
    return {f: make_model(root / f, f) for f in FAMILIES}


@torch.no_grad()
def hf_final_hidden(model, ids: list[int]) -> torch.Tensor:
    """The decoder's output after its final norm: [len(ids), hidden]."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    base = model.model(torch.tensor([ids])).last_hidden_state[0]
    # transformers' last hidden_states entry is the normed output for these families
    torch.testing.assert_close(out.hidden_states[-1][0], base, atol=0, rtol=0)
    return base


def normed(x: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(x, dim=-1).numpy()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_embeddings_match_transformers(model_dirs, family, page_size):
    model_dir = model_dirs[family]
    engine = Engine(
        str(model_dir), dtype="float32", kv_cache_tokens=512, page_size=page_size
    )
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hidden = [hf_final_hidden(ref, ids) for ids in INPUTS]

    last = engine.embed(INPUTS)
    mean = engine.embed(INPUTS, "mean")
    raw = engine.embed(INPUTS, "mean", normalize=False)
    assert (
        last.shape == mean.shape == (len(INPUTS), engine.state.model_config.hidden_size)
    )
    for i, h in enumerate(hidden):
        np.testing.assert_allclose(last[i], normed(h[-1]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(mean[i], normed(h.mean(0)), atol=1e-4, rtol=0)
        np.testing.assert_allclose(raw[i], h.mean(0).numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(last, axis=1), 1.0, atol=1e-5)

    # each input alone gives what it gives in a batch
    for i, ids in enumerate(INPUTS):
        np.testing.assert_allclose(engine.embed([ids])[0], last[i], atol=1e-5, rtol=0)


def test_dimensions_cut_then_renormalise(model_dirs):
    engine = Engine(str(model_dirs["llama"]), dtype="float32", kv_cache_tokens=512)
    full = engine.embed(INPUTS, normalize=False)
    cut = engine.embed(INPUTS, dimensions=16)
    assert cut.shape == (len(INPUTS), 16)
    np.testing.assert_allclose(
        cut,
        full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True),
        atol=1e-5,
    )
    text = engine.embed(["The quick brown fox"])
    np.testing.assert_allclose(
        text, engine.embed([engine.encode("The quick brown fox")]), atol=0, rtol=0
    )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"inputs": []}, "input is empty"),
        ({"inputs": [[]]}, "the input is empty"),
        ({"inputs": [[5, 384]]}, "token id 384"),
        ({"inputs": [[5, -1]]}, "token id -1"),
        ({"inputs": [[5] * 513]}, "the input is 513 tokens; this model accepts 512"),
        ({"inputs": [[5]], "pooling": "max"}, "pooling must be one of last, mean"),
        ({"inputs": [[5]], "dimensions": 0}, "dimensions must be between 1 and 64"),
        ({"inputs": [[5]], "dimensions": 65}, "dimensions must be between 1 and 64"),
    ],
)
def test_bad_inputs_say_what_to_change(model_dirs, kwargs, words):
    engine = Engine(str(model_dirs["llama"]), dtype="float32", kv_cache_tokens=512)
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=words):
        engine.embed(kwargs.pop("inputs"), **kwargs)


def test_embedding_between_steps_leaves_generation_and_cache_alone(model_dirs):
    engine = Engine(str(model_dirs["llama"]), dtype="float32", kv_cache_tokens=512)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    alone = engine.generate([INPUTS[0]], params)[0].token_ids
    before = engine.stats()

    engine.add_request(INPUTS[0], params, buffer_outputs=False)
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    used = engine.stats()["num_free_pages"]
    engine.embed(INPUTS)
    assert engine.stats()["num_free_pages"] == used
    while engine.has_work():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == alone
    after = engine.stats()
    assert after["num_free_pages"] == before["num_free_pages"]
    assert after["num_cached_pages"] == before["num_cached_pages"]
    assert after["leaked_pages"] == 0


def test_embed_batches_bound_tokens():
    assert list(embed_batches([3, 3, 3, 10, 1], max_tokens=6)) == [
        [0, 1],
        [2],
        [3],
        [4],
    ]
    assert list(embed_batches([], max_tokens=6)) == []
