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
from strata.layers.quant import quantize_model

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

# Measured on the default model (bf16 activations, 477 tokens, logits one row at a time):
#   bf16 ppl 28.13; int8 28.30 (+0.6%); int4 (groups of 32) 29.01 (+3.1%; +0.5% with the tied
#   output projection left bf16, tied_lm_head=False). Groups of 64 give +59%: the model is a Q4_1
#   GGUF, quantized in blocks of 32 already, and groups that straddle two blocks quantize twice.
MAX_PPL_RATIO = {"int8": 1.02, "int4": 1.06}


def perplexity(engine: Engine, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:], from one forward over the whole sequence.

    Logits are computed one row at a time, as in one-stream decode: a tied output projection then
    uses its quantized copy (TiedQuantHead switches to the float table for many rows)."""
    req = Req(rid="ppl", prompt_ids=list(token_ids), params=SamplingParams())
    scheduler, runner = engine.scheduler, engine.scheduler.runner
    assert scheduler._alloc_for(req, len(token_ids))
    fb = runner.prepare(ScheduleBatch([req], [len(token_ids)], 0))
    with torch.inference_mode():
        hidden = engine.model(fb.input_ids, fb.positions, fb.attn, runner.kv)  # [T, hidden]
        logits = torch.cat(
            [engine.model.compute_logits(row) for row in hidden[:-1].split(1)]
        )  # [T - 1, vocab]
        logprobs = torch.log_softmax(logits, dim=-1)
    scheduler.allocator.free(req.pages)
    targets = torch.tensor(token_ids[1:])
    return math.exp(-logprobs.gather(1, targets[:, None]).mean().item())


@pytest.fixture(scope="module")
def bf16_ppl(default_dir) -> tuple[list[int], float]:
    engine = Engine(None, dtype="bfloat16", kv_cache_tokens=2048)
    ids = engine.encode(TEXT)
    assert 450 <= len(ids) <= 650
    ppl = perplexity(engine, ids)
    assert ppl < 40, f"the bf16 model itself is off: ppl {ppl:.2f} on plain English"
    return ids, ppl


@pytest.mark.parametrize("method", list(MAX_PPL_RATIO))
def test_quantized_perplexity_close_to_bf16(bf16_ppl, method):
    ids, base = bf16_ppl
    engine = Engine(None, dtype="bfloat16", kv_cache_tokens=2048)
    quantize_model(engine.model, method)
    ppl = perplexity(engine, ids)
    assert ppl <= base * MAX_PPL_RATIO[method], (
        f"{method}: ppl {ppl:.3f} vs bf16 {base:.3f} ({ppl / base:.3f}x)"
    )
