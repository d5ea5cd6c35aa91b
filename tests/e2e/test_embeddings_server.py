"""POST /v1/embeddings of a live `strata serve` through the official OpenAI client and raw HTTP:
the vectors transformers computes, base64 and dimensions as OpenAI defines them, 400s that name
the field, and a generation running meanwhile unaffected."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from live_server import LiveServer, tiny_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.e2e

KEY = "embed-key"
CONTEXT = 256
HIDDEN = 64  # the tiny model's hidden size
VOCAB = 384
TEXTS = ["The quick brown fox", "Hello world! This is", "Paged attention keeps"]


@pytest.fixture(scope="module")
def server():
    with LiveServer(
        "--context-length", str(CONTEXT), "--served-model-name", "tiny", api_key=KEY
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def reference():
    """(tokenizer, last-token and mean embeddings of a token-id list) from transformers."""
    model_dir = tiny_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    @torch.no_grad()
    def embed(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        h = model.model(torch.tensor([ids])).last_hidden_state[0]
        norm = torch.nn.functional.normalize
        return norm(h[-1], dim=-1).numpy(), norm(h.mean(0), dim=-1).numpy()

    return tokenizer, embed


def test_openai_client_gets_the_transformers_vectors(oai, reference):
    tokenizer, embed = reference
    out = oai.embeddings.create(model="tiny", input=TEXTS)
    assert out.object == "list" and out.model == "tiny"
    assert [d.index for d in out.data] == [0, 1, 2]
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for d, t in zip(out.data, ids):
        assert d.object == "embedding" and len(d.embedding) == HIDDEN
        np.testing.assert_allclose(d.embedding, embed(t)[0], atol=1e-4, rtol=0)

    mean = oai.embeddings.create(
        model="tiny", input=ids, extra_body={"pooling": "mean"}
    )
    for d, t in zip(mean.data, ids):
        np.testing.assert_allclose(d.embedding, embed(t)[1], atol=1e-4, rtol=0)

    # one string, one token-id list: the same vector as in the batch
    one = oai.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding
    np.testing.assert_allclose(one, out.data[1].embedding, atol=1e-6, rtol=0)
    one = oai.embeddings.create(model="tiny", input=ids[1]).data[0].embedding
    np.testing.assert_allclose(one, out.data[1].embedding, atol=1e-6, rtol=0)


def test_base64_is_the_same_float32_values(server, oai):
    floats = oai.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    with server.client() as c:
        body = {"model": "tiny", "input": TEXTS, "encoding_format": "base64"}
        raw = c.post("/v1/embeddings", json=body).raise_for_status().json()
    for d, f in zip(raw["data"], floats.data):
        values = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert values.tolist() == f.embedding  # bit for bit
    # the client asks for base64 itself when no format is given, and decodes it
    default = oai.embeddings.create(model="tiny", input=TEXTS)
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]


def test_dimensions_cut_and_renormalise(oai, server):
    full = oai.embeddings.create(model="tiny", input=TEXTS)
    with server.client() as c:
        body = {"input": TEXTS, "normalize": False}
        raw = c.post("/v1/embeddings", json=body).raise_for_status().json()
    cut = oai.embeddings.create(model="tiny", input=TEXTS, dimensions=16)
    for d, r, f in zip(cut.data, raw["data"], full.data):
        assert len(d.embedding) == 16
        head = np.array(r["embedding"][:16])
        np.testing.assert_allclose(d.embedding, head / np.linalg.norm(head), atol=1e-6)
        assert np.linalg.norm(f.embedding) == pytest.approx(1.0, abs=1e-5)
        assert np.linalg.norm(r["embedding"]) != pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "input must be a non-empty string"),
        ({"input": ""}, "input", "input[0] is an empty string"),
        ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
        ({"input": [[]]}, "input", "the input is empty"),
        ({"input": 5}, "input", "input must be"),
        ({"input": [1, "a"]}, "input", "input must be"),
        ({"input": [[1, VOCAB]]}, "input", f"token id {VOCAB}"),
        ({"input": [1, -3]}, "input", "token id -3"),
        ({"input": ["a"] * 2049}, "input", "input has 2049 inputs; at most 2048"),
        (
            {"input": [5] * (CONTEXT + 1)},
            "input",
            f"the input is {CONTEXT + 1} tokens; this model accepts {CONTEXT} tokens",
        ),
        ({"input": "a", "dimensions": 0}, "dimensions", f"between 1 and {HIDDEN}"),
        (
            {"input": "a", "dimensions": HIDDEN + 1},
            "dimensions",
            f"between 1 and {HIDDEN}",
        ),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "hex"),
        ({"input": "a", "pooling": "max"}, "pooling", "max"),
        ({"input": "a", "normalize": "yes"}, "normalize", "bool"),
        ({}, "input", "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(server, body, param, words):
    with server.client() as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


def test_exactly_the_context_is_accepted(oai):
    out = oai.embeddings.create(model="tiny", input=[[5] * CONTEXT])
    assert out.usage.prompt_tokens == CONTEXT


def test_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(model="other", input="a")


def test_generation_meanwhile_is_unaffected(oai, server):
    def greedy_stream():
        return oai.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=240,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )

    alone = "".join(chunk.choices[0].text for chunk in greedy_stream() if chunk.choices)
    vectors = [
        d.embedding for d in oai.embeddings.create(model="tiny", input=TEXTS).data
    ]

    def embed_and_check() -> None:
        out = oai.embeddings.create(model="tiny", input=TEXTS * 20)
        got = [d.embedding for d in out.data[: len(TEXTS)]]
        np.testing.assert_allclose(got, vectors, atol=1e-5, rtol=0)

    overlapped = []
    for _ in range(
        5
    ):  # the tiny model's 240 tokens take ~0.1 s: try until one overlaps
        stream = (
            greedy_stream()
        )  # its response has begun: the generation is running now
        overlapped.append(server.info()["num_running_reqs"] == 1)
        embed_and_check()
        text = ""
        for i, chunk in enumerate(stream):
            text += chunk.choices[0].text if chunk.choices else ""
            if i % 40 == 0:  # embed while the generation goes on
                embed_and_check()
        assert text == alone
        if overlapped[-1]:
            break
    assert any(overlapped), "every generation ended before its embedding was asked for"
