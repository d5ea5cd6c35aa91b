"""Perplexity of the default model (SmolLM2-135M-Instruct) with int8 and int4 weights against bf16.

One fixed English passage, one forward over all of it (teacher forcing), perplexity of every token
after the first. Bounds are the measured ratios plus margin (see MAX_PPL_RATIO).
"""

from __future__ import annotations

import math

import pytest
import torch

from strata import Engine, SamplingParams
from strata.engine.batch import ScheduleBatch
from strata.engine.request import Req

pytestmark = pytest.mark.slow

TEXT = """\
The first lighthouses were not towers at all but fires lit on hilltops, kept burning through the night \
by people who lived nearby and were paid, when they were paid at all, by the merchants whose ships \
came home safely. A fire on a hill can be seen from far out at sea on a clear night, but it is easily \
hidden by rain, and the wood it needs must be carried up the slope every evening. Over time, the fires \
were moved onto stone platforms and then into towers, so that the light stood higher and the keepers \
could shelter from the weather while they worked.

For many centuries the light itself changed very little. Coal replaced wood in some places, and oil \
lamps replaced coal in others, but a flame on its own spreads its light in every direction, and most \
of that light is wasted on the sky and the land behind the tower. The great change came in the early \
nineteenth century, when a French engineer designed a lens made of many rings of glass, each ring \
bending the light a little more than the one inside it. The lens gathered the light of a single lamp \
into a narrow beam that could be seen more than twenty miles away, and because it was built from \
rings rather than one thick piece of glass, it was light enough to turn.

Turning the lens made it possible for each lighthouse to have a signature. A sailor who saw two quick \
flashes followed by a long pause could look at a chart and know exactly which light he was watching, \
and therefore where he was. The keepers wound the clockwork that turned the lens, trimmed the wicks, \
polished the glass, and wrote down the weather in a log every few hours. It was lonely work, \
especially on rocks far from the shore, where supplies arrived by boat only when the sea allowed it.

Today almost every lighthouse is automatic. Electric lamps switch on when the daylight fades, and \
satellites tell ships their position to within a few metres, so the old towers matter less than \
they once did. Many of them have become museums, and some are rented to visitors who want to spend \
a quiet week listening to the wind. Yet on a dark night, when the instruments fail or the power goes \
out, a sailor who can still read the pattern of a distant light knows that someone, long ago, thought \
carefully about how to bring him home.
"""

# Perplexity against the GGUF dequantized to float32 (quantization="none"), fp32 activations.
# Measured (477 tokens, logits one row at a time): see MAX_PPL_RATIO's comment in the closing figures
# of docs/BENCHMARKS.md. "auto" is the model as it ships: its own Q4_1/Q8_0 blocks through the int8
# kernels (the only difference from "none" is the int8 rounding of the activations); int8 / int4
# re-quantize the dequantized weights into q8 / q4 blocks.
MAX_PPL_RATIO = {"auto": 1.02, "int8": 1.02, "int4": 1.06}


def perplexity(engine: Engine, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:], from one forward over the whole sequence.

    Logits are computed one row at a time, as in one-stream decode."""
    req = Req(rid="ppl", prompt_ids=list(token_ids), params=SamplingParams())
    scheduler, runner = engine.scheduler, engine.scheduler.runner
    assert scheduler._alloc_for(req, len(token_ids))
    fb = runner.prepare(ScheduleBatch([req], [len(token_ids)], 0))
    with torch.inference_mode():
        hidden = engine.model(
            fb.input_ids, fb.positions, fb.attn, runner.kv
        )  # [T, hidden]
        logits = torch.cat(
            [engine.model.compute_logits(row) for row in hidden[:-1].split(1)]
        )  # [T - 1, vocab]
        logprobs = torch.log_softmax(logits, dim=-1)
    scheduler.allocator.free(req.pages)
    targets = torch.tensor(token_ids[1:])
    return math.exp(-logprobs.gather(1, targets[:, None]).mean().item())


@pytest.fixture(scope="module")
def float_ppl(default_dir) -> tuple[list[int], float]:
    engine = Engine(None, dtype="float32", kv_cache_tokens=2048, quantization="none")
    ids = engine.encode(TEXT)
    assert 450 <= len(ids) <= 650
    ppl = perplexity(engine, ids)
    assert ppl < 40, (
        f"the dequantized model itself is off: ppl {ppl:.2f} on plain English"
    )
    return ids, ppl


@pytest.mark.parametrize("quantization", list(MAX_PPL_RATIO))
def test_quantized_perplexity_close_to_dequantized(float_ppl, quantization):
    ids, base = float_ppl
    engine = Engine(
        None, dtype="float32", kv_cache_tokens=2048, quantization=quantization
    )
    ppl = perplexity(engine, ids)
    print(
        f"{quantization}: ppl {ppl:.3f} vs dequantized {base:.3f} ({ppl / base:.4f}x)"
    )
    assert ppl <= base * MAX_PPL_RATIO[quantization], (
        f"{quantization}: ppl {ppl:.3f} vs dequantized {base:.3f} ({ppl / base:.3f}x)"
    )
