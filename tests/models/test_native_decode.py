"""The native layer loop for decode steps (strata.models.native_decode) computes what the Python
layer loop computes, to the last bit, and runs only where it qualifies."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model

from strata import Engine, SamplingParams, kernels
from strata.models import native_decode

PROMPTS = [
    [5, 17, 33, 91, 120, 7, 64, 200, 13],
    [44, 3, 250],
    list(range(30, 71)),
    [300, 301, 302, 99, 98],
]

needs_kernels = pytest.mark.skipif(
    kernels.cpu_ops() is None, reason="the CPU kernels could not be built here"
)


def run(
    model_dir, loop: bool, monkeypatch, **options
) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy outputs, their logprobs and the steps the native loop ran, with the loop on or off."""
    monkeypatch.setenv(native_decode.ENV_VAR, "1" if loop else "0")
    engine = Engine(str(model_dir), kv_cache_tokens=2048, **options)
    params = SamplingParams(
        temperature=0, max_new_tokens=24, ignore_eos=True, logprobs=0
    )
    outs = engine.generate([list(p) for p in PROMPTS], params)
    native = engine.model.native_decode()
    steps = 0 if native is None else native.steps
    return (
        [o.token_ids for o in outs],
        [[lp.logprob for lp in o.choices[0].logprobs] for o in outs],
        steps,
    )


@needs_kernels
@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("llama", {"dtype": "float32", "page_size": 1}),
        ("llama", {"dtype": "float32", "page_size": 16, "quantization": "int4"}),
        ("llama", {"dtype": "bfloat16", "page_size": 16, "quantization": "int8"}),
        ("llama_tied_llama3", {"dtype": "float32", "page_size": 4}),
        ("qwen2", {"dtype": "float32", "page_size": 16}),  # q/k/v biases
        (
            "mistral_sw",
            {"dtype": "float32", "page_size": 4},
        ),  # window 8 in a window group of its own
        (
            "qwen2_sw",
            {"dtype": "float32", "page_size": 1, "sliding_kv": "full"},
        ),  # one window layer, masked only
        (
            "phi3",
            {"dtype": "float32", "page_size": 16},
        ),  # partial rotary, longrope past its original length
    ],
    ids=lambda v: (
        v if isinstance(v, str) else "-".join(f"{k}={x}" for k, x in v.items())
    ),
)
def test_native_loop_equals_the_python_loop(tiny_models, monkeypatch, family, options):
    """Same tokens and bit-identical logprobs with the loop on and off; the loop ran every decode step
    (the batch's first step prefills, so it keeps the Python loop)."""
    tokens_py, logprobs_py, steps_py = run(
        tiny_models[family], False, monkeypatch, **options
    )
    tokens_nat, logprobs_nat, steps_nat = run(
        tiny_models[family], True, monkeypatch, **options
    )
    assert steps_py == 0 and steps_nat > 0
    assert tokens_nat == tokens_py
    assert logprobs_nat == logprobs_py


@needs_kernels
@pytest.mark.parametrize("family", ["gemma2", "gemma3", "olmo2", "qwen3"])
def test_models_the_loop_cannot_run_keep_the_python_loop(tiny_models, family):
    """Sandwich or post norms, q/k norms and Gemma's (1 + w) norms: no loop."""
    engine = Engine(str(tiny_models[family]), dtype="float32", kv_cache_tokens=512)
    assert engine.model.native_decode() is None


@needs_kernels
def test_hooks_and_the_switch_keep_the_python_loop(tmp_path, monkeypatch):
    model_dir = make_model(tmp_path / "llama", "llama")
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    assert engine.model.native_decode() is not None
    hooked = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    seen = []
    hooked.model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
    assert (
        hooked.model.native_decode() is None
    )  # tensor parallel's all-reduces are such hooks
    hooked.generate([[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=3))
    assert (
        len(seen) == 3
    )  # the prefill and both decode steps went through the hooked module
    monkeypatch.setenv(native_decode.ENV_VAR, "0")
    assert (
        Engine(
            str(model_dir), dtype="float32", kv_cache_tokens=512
        ).model.native_decode()
        is None
    )


@needs_kernels
def test_bad_arguments_raise_instead_of_crashing():
    loop = kernels.cpu_ops().DecodeLoop()
    with pytest.raises(RuntimeError, match="4 linears"):
        loop.add_layer(
            torch.ones(8),
            torch.ones(8),
            1e-6,
            [],
            2,
            1,
            4,
            torch.ones(4, 4),
            torch.ones(4, 4),
            0.5,
            0,
            0.0,
            None,
        )
    with pytest.raises(RuntimeError, match="one k and one v cache per layer"):
        loop.forward(
            torch.ones(1, 8),
            torch.zeros(1, dtype=torch.long),
            [torch.ones(1)],
            [],
            [],
            [],
            torch.zeros(1, dtype=torch.long),
            1,
        )


@needs_kernels
def test_the_loop_follows_replaced_modules_and_the_kernel_switch(tmp_path, monkeypatch):
    """quantize_model on a model whose loop was built: the loop is built again over the new modules
    (same tokens as the Python loop over them); inside kernels.disabled() the Python loop runs."""
    from strata.layers.quant import quantize_model

    model_dir = make_model(tmp_path / "llama", "llama")
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    answers = {}
    for loop in (True, False):
        monkeypatch.setenv(native_decode.ENV_VAR, "1" if loop else "0")
        engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
        engine.generate([[5, 6, 7]], params)  # a loop (or none) over the float linears
        quantize_model(engine.model, "int4")
        answers[loop] = [
            r.token_ids for r in engine.generate([list(p) for p in PROMPTS], params)
        ]
        native = engine.model.native_decode()
        assert (native is not None and native.steps > 0) == loop
    assert answers[True] == answers[False]
    monkeypatch.setenv(native_decode.ENV_VAR, "1")
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=512)
    with kernels.disabled():
        engine.generate([[5, 6, 7]], params)
    assert engine.model.native_decode().steps == 0
