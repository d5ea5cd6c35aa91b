"""`--matmul fast`: block-quantized linears of large calls as bf16 matmuls through oneDNN.

The default, `--matmul exact`, runs every block linear on the int8 kernel (strata.layers.quant), whose
rows come out the same whatever shares the call: a prompt's KV and logits do not depend on its
chunking or its batch, and greedy output is bit-identical with speculation on and off. That kernel
pays a float step per 32-channel block for each row, which is what a long prefill spends most of
its linear time on; oneDNN's bf16 matmul over a dequantized copy of the weight has none (on a CPU
with AMX it runs bf16 tiles over the whole K), but it sums a row in an order that depends on the
call's size, and it multiplies bf16 activations by the dequantized weight where the kernel
multiplies int8 ones: another rounding. So it is an opt-in beside the exact default.

With `fast`, the model's largest block linear is timed at FAST_TRIAL_ROWS rows both ways at load,
and calls of at least the fewest rows at which oneDNN wins by FAST_GAIN there and at every larger
count take it (never, if at none: e.g. a CPU whose oneDNN has no bf16 instructions). Every decoder
block linear then keeps a bf16 copy of its weight prepacked for oneDNN (about 3.5x a q4 weight's
bytes); the tied or separate output head stays on the kernel (its calls are a step's few last
rows). The choice is logged and kept in strata.kernels.kernel_info (every bench JSON's path).
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch
from torch import nn

from strata import kernels
from strata.config import MATMUL_MODES
from strata.layers.packed import onednn_linear, onednn_pack, packing_works
from strata.layers.quant import (
    QuantEmbedding,
    QuantLinear,
    fewest_winning_rows,
    median_call_ms,
)

logger = logging.getLogger(__name__)

FAST_TRIAL_ROWS = (16, 64, 256, 1024)
FAST_GAIN = 1.25
FAST_REPEATS = 5
# a number N: block linears from N rows, untimed (for measurements); unset: timed
FAST_ROWS_ENV = "STRATA_FAST_MATMUL_ROWS"


def block_linears(model: nn.Module) -> list[QuantLinear]:
    """The model's block linears, less its output head (the embedding table's blocks, or lm_head)."""
    heads = {id(m.head) for m in model.modules() if isinstance(m, QuantEmbedding)}
    heads |= {
        id(m)
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] == "lm_head"
    }
    return [
        m for m in model.modules() if isinstance(m, QuantLinear) and id(m) not in heads
    ]


def choose_fast_matmul(
    model: nn.Module, dtype: torch.dtype, mode: str
) -> dict[str, object] | None:
    """For `mode` "fast": time the largest block linear at FAST_TRIAL_ROWS rows on the int8 kernel
    and on oneDNN bf16, and give every block linear the bf16 path from the rows chosen (see above).
    Returns what was chosen ({"rows", "layer", "timed": {rows: [kernel ms, oneDNN ms]}}, or
    {"rows": 0, "reason"} where it cannot run), also kept for strata.kernels.kernel_info (the engine
    clears it for "exact"); None for "exact" or a model without block linears."""
    if mode not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {mode!r}")
    layers = block_linears(model) if mode == "fast" else []
    if not layers:
        return None
    ops = kernels.cpu_ops()
    reason = None
    if dtype != torch.bfloat16:
        reason = f"needs bf16 activations, the model runs in {str(dtype).removeprefix('torch.')}"
    elif ops is None:
        reason = "needs the native kernels"
    elif not packing_works():  # e.g. an AVX2-only CPU: oneDNN has no bf16 path there
        reason = "oneDNN cannot multiply bf16 here"
    if reason:
        choice: dict[str, object] = {"rows": 0, "reason": reason}
        kernels.record_fast_matmul(choice)
        logger.warning("--matmul fast: %s; every linear stays exact", reason)
        return choice
    layer = max(layers, key=lambda m: m.in_features * m.out_features)
    forced = os.environ.get(FAST_ROWS_ENV, "").strip()
    if forced.isdigit():
        chosen = int(forced)
        choice = {"rows": chosen, "set_by": FAST_ROWS_ENV}
    else:
        timed = time_both(layer, ops, dtype)
        chosen = fewest_winning_rows(timed, FAST_GAIN)
        choice = {
            "rows": chosen,
            "layer": [layer.out_features, layer.in_features],
            "timed": timed,
        }
    if chosen:
        for m in layers:
            m.fast_weight = onednn_pack(m.dequantize().to(torch.bfloat16))
            m.fast_rows = chosen
    kernels.record_fast_matmul(choice)
    logger.info("--matmul fast: %s", kernels.describe_fast_matmul(choice))
    return choice


def time_both(layer: QuantLinear, ops, dtype: torch.dtype) -> dict[int, list[float]]:
    """{rows: [int8 kernel ms, oneDNN bf16 ms]} for `layer` at FAST_TRIAL_ROWS rows."""
    packed = onednn_pack(layer.dequantize().to(torch.bfloat16))
    generator = torch.Generator().manual_seed(0)
    timed: dict[int, list[float]] = {}
    for rows in FAST_TRIAL_ROWS:
        x = torch.randn(rows, layer.in_features, generator=generator).to(dtype)
        timed[rows] = [
            round(median_call_ms(fn, FAST_REPEATS), 4)
            for fn in (
                partial(layer.kernel_mm, ops, x),
                partial(onednn_linear, x, packed, None),
            )
        ]
    return timed
