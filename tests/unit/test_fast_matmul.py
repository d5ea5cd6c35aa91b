"""`--matmul fast` (strata.layers.fast_matmul): block linears' large calls as oneDNN bf16 matmuls over
a dequantized copy of the weight, from the rows a timing at load picks; the exact default keeps
every call on the int8 kernel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strata import kernels
from strata.config import EngineConfig
from strata.layers.fast_matmul import FAST_ROWS_ENV, block_linears, choose_fast_matmul
from strata.layers.packed import packing_works
from strata.layers.quant import QuantEmbedding
from tests.unit.test_quant import random_layer


@pytest.fixture(autouse=True)
def clean_record():
    yield
    kernels.record_fast_matmul({})


@pytest.fixture
def ops():
    module = kernels.cpu_ops()
    if module is None or not torch.backends.mkldnn.is_available():
        pytest.skip("needs the native kernels and oneDNN")
    if not packing_works():
        pytest.skip("oneDNN has no bf16 path on this CPU (or is held below it)")
    return module


def test_without_onednn_bf16_it_stays_exact_and_says_why(monkeypatch):
    """On a CPU where oneDNN cannot multiply bf16 (AVX2 only, or held to AVX2), fast is exact."""
    from strata.layers import fast_matmul

    if kernels.cpu_ops() is None:
        pytest.skip("needs the native kernels")
    monkeypatch.setattr(fast_matmul, "packing_works", lambda: False)
    model = _Model()
    choice = choose_fast_matmul(model, torch.bfloat16, "fast")
    assert choice == {"rows": 0, "reason": "oneDNN cannot multiply bf16 here"}
    assert model.up.fast_rows == 0 and model.up.fast_weight is None


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = QuantEmbedding(random_layer("q8h", 96, 64, gen), torch.bfloat16)
        self.up = random_layer("q4h", 256, 64, gen)
        self.down = random_layer("q4h", 64, 256, gen)
        self.lm_head = random_layer("q8h", 96, 64, gen)


def test_the_heads_stay_on_the_kernel():
    model = _Model()
    assert block_linears(model) == [model.up, model.down]


def test_forced_rows_split_the_calls_between_the_paths(ops, monkeypatch):
    """From the rows chosen, a call multiplies the bf16 copy through oneDNN (close to the float oracle);
    below them it is the int8 kernel's, bit for bit."""
    monkeypatch.setenv(FAST_ROWS_ENV, "8")
    model = _Model()
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    exact = {n: model.up(x[:n]) for n in (1, 7, 8, 20)}
    choice = choose_fast_matmul(model, torch.bfloat16, "fast")
    assert choice == {"rows": 8, "set_by": FAST_ROWS_ENV}
    assert model.up.fast_rows == model.down.fast_rows == 8
    assert model.lm_head.fast_rows == 0 and model.embed.head.fast_rows == 0
    for n in (1, 7):
        assert torch.equal(model.up(x[:n]), exact[n])
    for n in (8, 20):
        got = model.up(x[:n])
        assert got.dtype == torch.bfloat16 and got.shape == (n, 256)
        want = model.up.reference_forward(x[:n])
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
    info = kernels.kernel_info()
    assert info["fast_matmul"] == choice
    assert "block linears on oneDNN bf16 from 8 rows" in kernels.describe_kernels(info)


def test_the_timing_picks_rows_or_none(ops, monkeypatch):
    monkeypatch.delenv(FAST_ROWS_ENV, raising=False)
    model = _Model()
    choice = choose_fast_matmul(model, torch.bfloat16, "fast")
    assert choice is not None and set(choice["timed"]) == {16, 64, 256, 1024}
    assert choice["layer"] in ([256, 64], [64, 256])
    for layer in (model.up, model.down):
        assert layer.fast_rows == choice["rows"]
        assert (layer.fast_weight is not None) == bool(choice["rows"])


def test_float_models_and_exact_stay_exact(ops):
    model = _Model()
    choice = choose_fast_matmul(model, torch.float32, "fast")
    assert choice is not None and choice["rows"] == 0 and "bf16" in choice["reason"]
    assert model.up.fast_rows == 0
    assert choose_fast_matmul(model, torch.bfloat16, "exact") is None
    assert model.up.fast_rows == 0
    with pytest.raises(ValueError, match="matmul must be one of"):
        choose_fast_matmul(model, torch.bfloat16, "quick")


def test_config_checks_the_mode():
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="quick")
    with pytest.raises(ValueError, match="one engine alone"):
        EngineConfig(matmul="fast", tp_size=2)
    assert EngineConfig(matmul="fast").matmul == "fast"


def test_an_engine_with_fast_matmul_generates_and_records_it(
    ops, llama_dir, monkeypatch
):
    """A tiny int4 model in bf16 with every call of 4+ rows on oneDNN: a prompt's greedy answer stays
    close to the exact engine's (its logits within bf16 rounding), and the engine's path says so."""
    from strata.engine.engine import Engine
    from strata.sampling_params import SamplingParams

    monkeypatch.setenv(FAST_ROWS_ENV, "4")
    params = SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1
    )
    prompt = [[5, 17, 99, 23, 42, 7, 64, 11, 3, 150]]
    answers = {}
    for mode in ("exact", "fast"):
        engine = Engine(
            model=str(llama_dir),
            dtype="bfloat16",
            quantization="int4",
            kv_cache_tokens=512,
            matmul=mode,
        )
        (result,) = engine.generate(prompt, params)
        answers[mode] = result
        info = engine.state.kernels
        assert ("fast_matmul" in info) == (mode == "fast")
        if mode == "fast":
            assert info["fast_matmul"]["rows"] == 4
    first = [lp.logprob for lp in answers["exact"].choices[0].logprobs][:1]
    first_fast = [lp.logprob for lp in answers["fast"].choices[0].logprobs][:1]
    assert answers["fast"].token_ids[0] == answers["exact"].token_ids[0]
    assert abs(first[0] - first_fast[0]) < 0.1
