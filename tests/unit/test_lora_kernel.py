"""The LoRA kernel (strata/kernels/lora_ops.cpp) against a float64 reference of the same sums, the
LoRA linear's kernel path against its PyTorch path, and bad arguments refused before any write."""

from __future__ import annotations

import pytest
import torch

from strata import kernels
from strata.layers.lora import LoRALinear, LoRAState, LoRAWeights, ModuleDelta

IN, OUT = 80, 100  # not multiples of 16: the SIMD loops' tails run too


def delta(parts: list[tuple[int, int, int]], dtype, gen) -> ModuleDelta:
    """(o0, o1, rank) per part: A [sum of ranks, IN], (B*scale)^T per part."""
    rank = sum(r for _, _, r in parts)
    a = (torch.randn(rank, IN, generator=gen) / IN**0.5).to(dtype)
    out, r0 = [], 0
    for o0, o1, r in parts:
        bt = torch.randn(r, o1 - o0, generator=gen).to(dtype)
        out.append((o0, o1, r0, r0 + r, bt))
        r0 += r
    return ModuleDelta(a, out)


def reference(y, x, rows_by_delta: list[tuple[ModuleDelta | None, list[int]]]):
    want = y.double().clone()
    for d, rows in rows_by_delta:
        if d is None:
            continue
        xa = x.double()[rows] @ d.a.double().t()
        for o0, o1, r0, r1, bt in d.parts:
            want[rows, o0:o1] += xa[:, r0:r1] @ bt.double()
    return want


def segments(groups: list[tuple[int, list[int]]]):
    rows = torch.tensor([r for _, g in groups for r in g], dtype=torch.int64)
    off = [0]
    for _, g in groups:
        off.append(off[-1] + len(g))
    return (
        rows,
        torch.tensor(off, dtype=torch.int64),
        torch.tensor([s for s, _ in groups], dtype=torch.int64),
    )


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deltas_land_on_their_rows_only(ops, x_dtype, w_dtype):
    gen = torch.Generator().manual_seed(0)
    table = ops.LoRATable(2)
    d0 = delta([(0, 40, 8), (40, 70, 8), (70, 100, 8)], w_dtype, gen)  # fused, tiled
    d1 = delta([(10, 33, 4), (50, 100, 16)], w_dtype, gen)  # a gap, mixed ranks
    d2 = delta([(0, 100, 3)], w_dtype, gen)
    for slot, d in ((0, d0), (2, d1), (5, d2)):
        table.set(slot, 0, d.a, d.parts)
    table.set(2, 1, d0.a, d0.parts)  # slot 2 adapts module 1 too; slots 0 and 5 do not
    T = 23
    x = torch.randn(T, IN, generator=gen).to(x_dtype)
    y = torch.randn(T, OUT, generator=gen).to(x_dtype)
    groups = [(2, [3, 0, 17]), (0, [5]), (5, list(range(6, 16))), (0, [])]
    for module, by_slot in ((0, {0: d0, 2: d1, 5: d2}), (1, {2: d0})):
        got = y.clone()
        table.apply(module, got, x, *segments(groups))
        want = reference(y, x, [(by_slot.get(s), g) for s, g in groups])
        tol = 2e-5 if x_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        untouched = [r for r in range(T) if r not in {r for _, g in groups for r in g}]
        assert torch.equal(got[untouched], y[untouched])


def test_empty_segments_and_no_rows_change_nothing(ops):
    gen = torch.Generator().manual_seed(1)
    table = ops.LoRATable(1)
    d = delta([(0, OUT, 4)], torch.float32, gen)
    table.set(0, 0, d.a, d.parts)
    x, y = torch.randn(4, IN, generator=gen), torch.randn(4, OUT, generator=gen)
    got = y.clone()
    table.apply(0, got, x, *segments([(0, [])]))
    table.apply(0, got, x, *segments([]))
    assert torch.equal(got, y)


def test_a_cleared_slot_is_refused_and_can_be_set_again(ops):
    gen = torch.Generator().manual_seed(2)
    table = ops.LoRATable(1)
    d = delta([(0, OUT, 4)], torch.float32, gen)
    table.set(1, 0, d.a, d.parts)
    x, y = torch.randn(2, IN, generator=gen), torch.randn(2, OUT, generator=gen)
    table.clear(1)
    with pytest.raises(RuntimeError, match="seg_slot\\[0\\] = 1 holds no adapter"):
        table.apply(0, y, x, *segments([(1, [0])]))
    table.set(1, 0, d.a, d.parts)
    table.apply(0, y, x, *segments([(1, [0])]))


def bad_apply_cases():
    x, y = torch.zeros(4, IN), torch.zeros(4, OUT)
    ok = segments([(0, [0, 1])])
    return {
        "row_range": ((0, y, x, *segments([(0, [0, 4])])), "outside \\[0, 4\\)"),
        "row_twice": ((0, y, x, *segments([(0, [1]), (0, [1])])), "in rows twice"),
        "off_end": (
            (0, y, x, ok[0], torch.tensor([0, 1]), ok[2]),
            "seg_off must run from 0",
        ),
        "off_len": (
            (0, y, x, ok[0], torch.tensor([0, 1, 2]), ok[2]),
            "one entry more",
        ),
        "module": ((3, y, x, *ok), "module must be in"),
        "width": ((0, y, torch.zeros(4, IN + 1), *ok), "takes 80 inputs"),
        "narrow_y": ((0, torch.zeros(4, OUT - 1), x, *ok), "writes columns up to"),
        "dtypes": ((0, y.bfloat16(), x, *ok), "one dtype"),
        "rows_dtype": ((0, y, x, ok[0].int(), *ok[1:]), "int64"),
    }


@pytest.mark.parametrize("case", sorted(bad_apply_cases()))
def test_bad_apply_arguments_are_refused_before_writing(ops, case):
    gen = torch.Generator().manual_seed(3)
    table = ops.LoRATable(1)
    d = delta([(0, OUT, 4)], torch.float32, gen)
    table.set(0, 0, d.a, d.parts)
    args, message = bad_apply_cases()[case]
    before = args[1].clone()
    with pytest.raises(RuntimeError, match=message):
        table.apply(*args)
    assert torch.equal(args[1], before)


def test_bad_weights_are_refused(ops):
    table = ops.LoRATable(1)
    a = torch.zeros(8, IN)
    with pytest.raises(RuntimeError, match="overlap"):
        table.set(
            0,
            0,
            a,
            [(0, 50, 0, 4, torch.zeros(4, 50)), (40, 90, 4, 8, torch.zeros(4, 50))],
        )
    with pytest.raises(RuntimeError, match="bt must be"):
        table.set(0, 0, a, [(0, 50, 0, 4, torch.zeros(4, 49))])
    with pytest.raises(RuntimeError, match="must lie in"):
        table.set(0, 0, a, [(0, 50, 0, 9, torch.zeros(9, 50))])
    with pytest.raises(RuntimeError, match="a's dtype"):
        table.set(0, 0, a, [(0, 50, 0, 4, torch.zeros(4, 50, dtype=torch.bfloat16))])
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        table.set(0, 0, a.half(), [])
    with pytest.raises(RuntimeError, match="module must be in"):
        table.set(0, 1, a, [])


class Zeros(torch.nn.Module):
    """A base linear whose output is zeros: the delta alone shows."""

    def __init__(self, out_features: int):
        super().__init__()
        self.out_features = out_features

    def forward(self, x):
        return torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_linear_kernel_path_equals_its_pytorch_path(dtype):
    if kernels.cpu_ops() is None:
        pytest.skip("no CPU kernels here")
    gen = torch.Generator().manual_seed(4)
    state = LoRAState()
    state.index = {"m": 0}
    state.table = kernels.cpu_ops().LoRATable(1)
    state.dtype = dtype
    linear = LoRALinear(Zeros(OUT), "m", state)
    weights = {
        7: delta([(0, 60, 8), (60, 100, 8)], dtype, gen),
        9: delta([(20, 80, 4)], dtype, gen),
    }
    for adapter_id, d in weights.items():
        state.add(adapter_id, LoRAWeights(str(adapter_id), "", 8, {"m": d}))
    x = torch.randn(6, IN, generator=gen).to(dtype)
    state.set_rows([9, 0, 7, 7, 0], [1, 1, 2, 1, 1], "cpu")
    native = linear(x)
    with kernels.disabled():
        torch_path = linear(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native, torch_path, atol=tol, rtol=tol)
    assert native[[1, 5]].abs().sum() == 0 and native[[0, 2, 3, 4]].abs().sum() > 0
    state.remove(7)
    state.set_rows([9, 0], [1, 1], "cpu")
    torch.testing.assert_close(linear(x[:2]), native[:2], atol=tol, rtol=tol)
