"""AMX int8 tiles for block-quantized linears (strata/kernels/quant_ops.cpp, `int8_tile_rows`).

The tiles must give every row the same bits as the dot-product kernel, whatever else shares the
call: a row alone, and the same row among 1..512 others, on either path. They run only on CPUs with
AMX whose OS grants the tile state; elsewhere these tests skip and say so, and the choice at load
reports nothing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strata import kernels
from strata.layers.quant import QuantLinear, choose_int8_tiles
from tests.unit.test_quant import random_layer


@pytest.fixture
def ops():
    module = kernels.load("native")
    if module is None:
        pytest.skip("the native CPU kernels could not be built here")
    if not module.int8_tiles_available():
        pytest.skip(
            "no AMX int8 tiles here (the CPU lacks amx_int8, or the OS refused the tile state)"
        )
    saved = module.int8_tile_rows()
    choice = kernels.int8_tiles_choice()
    with kernels.using("native"):
        yield module
    module.set_int8_tile_rows(*saved)
    kernels.record_int8_tiles(choice)


def on_tiles(ops, layer: QuantLinear, x: torch.Tensor, from_rows: int) -> torch.Tensor:
    ops.set_int8_tile_rows(from_rows, from_rows)
    return layer.kernel_mm(ops, x)


@pytest.mark.parametrize("fmt", ["q4", "q4h", "q8", "q8h", "q8/16", "q8/16h"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,n", [(576, 80), (64, 40), (1536, 33)])
def test_tiles_give_each_row_the_dot_products_bits(ops, fmt, dtype, k, n):
    gen = torch.Generator().manual_seed(k + n)
    layer = random_layer(fmt, n, k, gen)
    x = torch.randn(512, k, generator=gen).to(dtype)
    alone = on_tiles(ops, layer, x[:1], 0)  # the dot products, one row
    for rows in (1, 5, 16, 17, 33, 512):
        part = x[:rows].contiguous()
        dots = on_tiles(ops, layer, part, 0)
        tiles = on_tiles(ops, layer, part, 1)
        assert torch.equal(tiles, dots), f"{rows} rows: tiles and dot products differ"
        assert torch.equal(tiles[0], alone[0]), (
            f"row 0 among {rows} differs from it alone"
        )
    # a row in the middle and the last row of a padded tile, alone vs among others
    every = on_tiles(ops, layer, x, 1)
    for row in (7, 300, 511):
        assert torch.equal(every[row], on_tiles(ops, layer, x[row : row + 1], 0)[0])


def test_tiles_are_taken_from_the_rows_set(ops):
    ops.set_int8_tile_rows(16, 0)
    assert tuple(ops.int8_tile_rows()) == (16, 0)
    with pytest.raises(RuntimeError, match=">= 0"):
        ops.set_int8_tile_rows(-1, 0)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = random_layer("q4h", 256, 128, gen)
        self.b = random_layer("q8h", 512, 128, gen)


def test_choice_at_load_times_both_formats_and_is_reported(ops, monkeypatch):
    kernels.record_int8_tiles({})
    choice = choose_int8_tiles(_Blocks(), torch.bfloat16)
    assert choice is not None and set(choice) == {"q4", "q8"}
    for made in choice.values():
        assert made["rows"] in (0, 16, 64, 256)
        assert set(made["timed"]) == {16, 64, 256}
        assert all(len(pair) == 2 and min(pair) > 0 for pair in made["timed"].values())
    assert tuple(ops.int8_tile_rows()) == (choice["q4"]["rows"], choice["q8"]["rows"])
    info = kernels.kernel_info()
    assert info["int8_tiles"] == choice
    assert "AMX int8 tiles: q4 " in kernels.describe_kernels(info)
    # a second model (a draft) keeps the first one's choice
    assert choose_int8_tiles(_Blocks(), torch.bfloat16) == choice
    # set by the environment: from that many rows, untimed
    kernels.record_int8_tiles({})
    monkeypatch.setenv("STRATA_INT8_TILES", "32")
    forced = choose_int8_tiles(_Blocks(), torch.bfloat16)
    assert forced is not None and {f: c["rows"] for f, c in forced.items()} == {
        "q4": 32,
        "q8": 32,
    }
    assert tuple(ops.int8_tile_rows()) == (32, 32)
    # switched off by the environment: nothing chosen
    kernels.record_int8_tiles({})
    monkeypatch.setenv("STRATA_INT8_TILES", "off")
    assert choose_int8_tiles(_Blocks(), torch.bfloat16) is None
    assert tuple(ops.int8_tile_rows()) == (0, 0) and not kernels.int8_tiles_choice()


def test_without_tiles_nothing_is_chosen_or_reported():
    with kernels.using("x86-64-v3") as module:  # the AVX2 build has no tiles
        if module is None:
            pytest.skip("the AVX2 build cannot run or be built here")
        assert not module.int8_tiles_available()
        with pytest.raises(RuntimeError, match="not available"):
            module.set_int8_tile_rows(16, 16)
        saved = kernels.int8_tiles_choice()
        kernels.record_int8_tiles({})
        try:
            assert choose_int8_tiles(_Blocks(), torch.bfloat16) is None
            assert "int8_tiles" not in kernels.kernel_info()
        finally:
            kernels.record_int8_tiles(saved)
