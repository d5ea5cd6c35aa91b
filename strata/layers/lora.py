"""LoRA adapters (PEFT's format) applied per row on top of the base model's linears.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with, for each adapted linear, `lora_A.weight` [r, in] and
`lora_B.weight` [out, r]; the adapted layer computes base(x) + scale * B(A(x)), scale = alpha / r
(alpha / sqrt(r) with use_rslora). Our decoder fuses q/k/v and gate/up into one matmul each, so
an adapter's q_proj, k_proj and v_proj land on row ranges of `qkv_proj`'s output.

`LoRALinear` wraps a base linear (float, packed or block-quantized: whatever it is) and adds,
for each adapter present in the step, its delta on that adapter's rows only, so a batch mixes
requests of different adapters and of the base model and rows of the base model pay nothing.
Two ways, one result:

- on the CPU kernels, a `LoRATable` (strata/kernels/lora_ops.cpp) holds every loaded adapter's
  weights by slot, written once when the adapter loads; a step passes which of its rows use which
  slot (`LoRAState.set_rows`), and each adapted linear is one native call that reads each adapter's
  weights once. The native decode loop (strata.models.native_decode) makes the same call after its
  linears, so decode steps with adapter rows stay in the loop.
- elsewhere (a GPU, kernels off) the step's adapters are stacked per linear (`LoRAState.stack`)
  and applied as batched matmuls over a padded [adapters, rows] layout of the step's rows.

With no adapter rows in a step the wrapper is the base linear plus one check.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from strata import kernels

UNSUPPORTED = {  # PEFT options that change the computation in ways we do not implement
    "use_dora": "DoRA adapters",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "layer_replication": "layer replication",
}


@dataclass
class ModuleDelta:
    """One adapter's delta on one (possibly fused) linear."""

    a: torch.Tensor  # [sum of the parts' ranks, in]
    parts: list[
        tuple[int, int, int, int, torch.Tensor]
    ]  # (out0, out1, r0, r1, (B*scale)^T [r, out])


@dataclass
class LoRAWeights:
    name: str
    path: str
    rank: int
    modules: dict[str, ModuleDelta]  # "layers.3.self_attn.qkv_proj" -> its delta
    nbytes: int = 0


@dataclass
class Stacked:
    """One module's deltas of the adapters present in a step, stacked for batched matmuls: part
    k's ranks sit in A's rows [k0, k1) (zero beyond an adapter's own rank, or where it does not
    adapt that part)."""

    a: torch.Tensor  # [adapters, R, in]
    parts: list[
        tuple[int, int, int, int, torch.Tensor]
    ]  # (out0, out1, k0, k1, B [adapters, k1-k0, out1-out0])
    covers: int = (
        -1
    )  # the output width the parts tile from 0 without a gap (-1: they do not)


@dataclass
class LoRAState:
    """What every LoRALinear of a model reads: the loaded adapters by id and this step's rows.

    Each loaded adapter has a slot in the kernels' table (`table`, when the model runs on the CPU
    kernels). `set_rows` groups the step's rows by adapter: for the table as `rows` (grouped),
    `seg_off` and `seg_slot`; for the PyTorch path as a padded [adapters, m] layout (`gather`: the
    row each slot reads, `mask`: 0 for padding), so each adapted linear runs two batched matmuls
    over all the step's adapters, with stacked weights kept while the same adapters meet in steps."""

    adapters: dict[int, LoRAWeights] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)  # adapter id -> table slot
    index: dict[str, int] = field(default_factory=dict)  # adapted linear -> its number
    table: Any = None  # the kernels' LoRATable (None: the PyTorch path only)
    dtype: torch.dtype = torch.float32  # of the adapters' weights
    active: bool = False  # this step has adapter rows
    combo: tuple[int, ...] = ()  # the adapters of this step, in slot order
    rows: torch.Tensor | None = None  # the step's adapter rows, grouped by adapter
    seg_off: torch.Tensor | None = (
        None  # [adapters + 1] where each group starts in `rows`
    )
    seg_slot: torch.Tensor | None = None  # [adapters] each group's table slot
    gather: torch.Tensor | None = (
        None  # [adapters * m] row of each slot (padding: row 0)
    )
    mask: torch.Tensor | None = None  # [adapters, m, 1] 1 for real slots
    groups: dict[int, list[int]] = field(default_factory=dict)  # adapter -> its rows
    device: Any = None  # of this step's tensors
    stacks: dict[str, Stacked | None] = field(default_factory=dict)  # for `combo`

    def bind(self, names: list[str], model: Any) -> None:
        """The adapted linears, in order, and where the model runs: a CPU model with the kernels
        gets a table; adapters' weights are float32 there unless the model computes in bf16, and
        in the model's half dtype on a GPU."""
        self.index = {name: i for i, name in enumerate(names)}
        first = next((p for p in model.parameters() if p.dtype.is_floating_point), None)
        ops = kernels.cpu_ops()
        on_cpu = first is None or first.device.type == "cpu"
        self.table = (
            ops.LoRATable(len(names))
            if on_cpu and ops is not None and hasattr(ops, "LoRATable")
            else None
        )
        model_dtype = torch.float32 if first is None else first.dtype
        # the kernel reads bf16 weights; the PyTorch path's bmm wants float32
        if on_cpu:
            bf16 = self.table is not None and model_dtype == torch.bfloat16
            self.dtype = torch.bfloat16 if bf16 else torch.float32
        else:
            half = model_dtype in (torch.bfloat16, torch.float16)
            self.dtype = model_dtype if half else torch.float32

    def add(self, adapter_id: int, weights: LoRAWeights) -> None:
        """An adapter now in memory: into the lowest free slot of the table."""
        taken = set(self.slots.values())
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
        if self.table is not None:
            for name, delta in weights.modules.items():
                self.table.set(slot, self.index[name], delta.a, delta.parts)
        self.adapters[adapter_id] = weights
        self.slots[adapter_id] = slot

    def remove(self, adapter_id: int) -> None:
        slot = self.slots.pop(adapter_id, None)
        self.adapters.pop(adapter_id, None)
        if slot is not None and self.table is not None:
            self.table.clear(slot)
        if adapter_id in self.combo:
            self.combo, self.stacks = (), {}

    def set_rows(self, adapter_ids: list[int], counts: list[int], device) -> None:
        """Each request's adapter id (0: none) and its row count, in the step's row order."""
        groups: dict[int, list[int]] = {}
        start = 0
        for adapter, n in zip(adapter_ids, counts):
            if adapter:
                groups.setdefault(adapter, []).extend(range(start, start + n))
            start += n
        if not groups:
            self.active = False
            return
        combo = tuple(groups)
        if combo != self.combo:
            self.combo, self.stacks = combo, {}
        flat = [r for rows in groups.values() for r in rows]
        offsets = [0]
        for rows in groups.values():
            offsets.append(offsets[-1] + len(rows))
        self.rows = torch.tensor(flat, dtype=torch.int64)
        self.seg_off = torch.tensor(offsets, dtype=torch.int64)
        self.seg_slot = torch.tensor([self.slots[a] for a in combo], dtype=torch.int64)
        self.groups, self.device, self.gather, self.mask = groups, device, None, None
        self.active = True

    def clear_rows(self) -> None:
        self.active = False

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows as the PyTorch path takes them (`gather`, `mask`), built on its first
        use in the step: steps on the kernel's table never need them."""
        if self.gather is None or self.mask is None:
            m = max(len(rows) for rows in self.groups.values())
            gather: list[int] = []
            mask: list[float] = []
            for rows in self.groups.values():
                gather += rows + [0] * (m - len(rows))
                mask += [1.0] * len(rows) + [0.0] * (m - len(rows))
            self.gather = torch.tensor(gather, dtype=torch.int64, device=self.device)
            self.mask = torch.tensor(mask, dtype=self.dtype, device=self.device).view(
                len(self.groups), m, 1
            )
        return self.gather, self.mask

    def native_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """This step's adapter rows as the kernels take them; None without adapter rows."""
        if not self.active:
            return None
        assert (
            self.rows is not None
            and self.seg_off is not None
            and self.seg_slot is not None
        )
        return self.rows, self.seg_off, self.seg_slot

    def stack(self, name: str) -> Stacked | None:
        """Module `name`'s deltas of the step's adapters, stacked (None: none adapts it)."""
        if name in self.stacks:
            return self.stacks[name]
        deltas = [self.adapters[i].modules.get(name) for i in self.combo]
        present = [d for d in deltas if d is not None]
        if not present:
            self.stacks[name] = None
            return None
        ranks: dict[tuple[int, int], int] = {}
        for d in present:
            for o0, o1, r0, r1, _ in d.parts:
                ranks[(o0, o1)] = max(ranks.get((o0, o1), 0), r1 - r0)
        slots, total = {}, 0
        for key in sorted(ranks):
            slots[key] = total
            total += ranks[key]
        ref = present[0].a
        a = torch.zeros(
            len(deltas), total, ref.shape[1], dtype=ref.dtype, device=ref.device
        )
        bs = {
            key: torch.zeros(
                len(deltas), r, key[1] - key[0], dtype=ref.dtype, device=ref.device
            )
            for key, r in ranks.items()
        }
        for i, delta in enumerate(deltas):
            if delta is None:
                continue
            for o0, o1, r0, r1, b in delta.parts:
                k0 = slots[(o0, o1)]
                a[i, k0 : k0 + r1 - r0] = delta.a[r0:r1]
                bs[(o0, o1)][i, : r1 - r0] = b
        parts = [
            (o0, o1, slots[(o0, o1)], slots[(o0, o1)] + ranks[(o0, o1)], bs[(o0, o1)])
            for o0, o1 in sorted(ranks)
        ]
        ends = [0] + [o1 for _, o1, _, _, _ in parts]
        tiled = all(o0 == ends[i] for i, (o0, _, _, _, _) in enumerate(parts))
        stacked = Stacked(a, parts, ends[-1] if tiled else -1)
        self.stacks[name] = stacked
        return stacked


class LoRALinear(nn.Module):
    """A base linear plus the deltas of the step's adapters on their rows."""

    def __init__(self, base: nn.Module, name: str, state: LoRAState):
        super().__init__()
        self.base = base
        self.name = name
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        st = self.state
        if not st.active:
            return y
        if (
            st.table is not None
            and kernels.usable(x) is not None
            and y.dtype == x.dtype
            and y.is_contiguous()
        ):
            st.table.apply(
                st.index[self.name], y, x.contiguous(), st.rows, st.seg_off, st.seg_slot
            )
            return y
        stacked = st.stack(self.name)
        if stacked is None:
            return y
        gather, mask = st.padded()
        n, m = mask.shape[:2]
        xs = x.index_select(0, gather).to(stacked.a.dtype).view(n, m, -1)
        xa = torch.bmm(xs, stacked.a.transpose(1, 2)).mul_(mask)  # padding slots: 0
        deltas = [torch.bmm(xa[:, :, k0:k1], b) for _, _, k0, k1, b in stacked.parts]
        if stacked.covers == y.shape[-1]:  # the parts tile the output: one scatter
            delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=2)
            y.index_add_(0, gather, delta.view(n * m, -1).to(y.dtype))
            return y
        for (o0, o1, _, _, _), delta in zip(stacked.parts, deltas):
            y[:, o0:o1].index_add_(0, gather, delta.view(n * m, -1).to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return self.name


def fused_layout(model: Any) -> dict[str, tuple[str, int]]:
    """PEFT's module name (the last part: q_proj) -> ours and the part it is (qkv_proj, 0)."""
    return dict(getattr(model, "FUSED", {}))


def _base(module: Any) -> Any:
    return module.base if isinstance(module, LoRALinear) else module


def _parts(module_name: str, layer: Any) -> list[int]:
    """The output sizes of a (fused) linear's parts, in order."""
    attn = layer.self_attn
    if module_name == "qkv_proj":
        return [attn.q_size, attn.kv_size, attn.kv_size]
    if module_name == "o_proj":
        return [_base(attn.o_proj).out_features]
    out = _base(getattr(layer.mlp, module_name)).out_features
    return [out // 2, out // 2] if module_name == "gate_up_proj" else [out]


def targets(model: Any) -> dict[str, Any]:
    """Our linears an adapter may adapt: 'layers.i.self_attn.qkv_proj' -> the module."""
    from strata.layers.mlp import MLP

    found: dict[str, Any] = {}
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "self_attn", None)
        if all(hasattr(attn, a) for a in ("qkv_proj", "o_proj", "q_size", "kv_size")):
            found[f"layers.{i}.self_attn.qkv_proj"] = attn
            found[f"layers.{i}.self_attn.o_proj"] = attn
        mlp = getattr(layer, "mlp", None)
        if type(mlp) is MLP:
            found[f"layers.{i}.mlp.gate_up_proj"] = mlp
            found[f"layers.{i}.mlp.down_proj"] = mlp
    return found


def attach(model: Any, state: LoRAState) -> int:
    """Wrap every linear an adapter may adapt; returns how many. ValueError when none can be."""
    owners = targets(model)
    if not owners:
        raise ValueError(
            f"LoRA adapters need a decoder with standard attention or dense MLP layers; "
            f"{type(model).__name__} has none"
        )
    for name, owner in owners.items():
        attr = name.rsplit(".", 1)[1]
        base = getattr(owner, attr)
        if not isinstance(base, LoRALinear):
            setattr(owner, attr, LoRALinear(base, name, state))
    state.bind(list(owners), model)
    model.lora = state
    return len(owners)


def read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path} has no adapter_config.json; a LoRA adapter is a PEFT directory"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{path}/adapter_config.json is not JSON: {exc}") from None
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type {peft_type!r} is not LoRA")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{path}: {what} are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{path}: bias {config['bias']!r} is not supported (only 'none')"
        )
    if config.get("fan_in_fan_out"):
        raise ValueError(
            f"{path}: fan_in_fan_out adapters (Conv1D bases) are not supported"
        )
    return config


def load_adapter(
    name: str,
    path: str | Path,
    model: Any,
    max_rank: int,
    dtype: torch.dtype = torch.float32,
) -> LoRAWeights:
    """Read a PEFT LoRA directory for `model`: every tensor checked against the model's shapes;
    the weights in `dtype` (LoRAState.dtype)."""
    from safetensors.torch import load_file

    path = Path(path)
    config = read_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.exists():
        raise ValueError(
            f"{path} has no adapter_model.safetensors (.bin adapters are not read; save with "
            f"safe_serialization=True)"
        )
    tensors = load_file(str(weights_file))
    owners = targets(model)
    fused = fused_layout(model)
    alpha = float(config.get("lora_alpha", 8))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for which in ("lora_A", "lora_B"):
            marker = f".{which}."
            if marker in key:
                module = key.split(marker)[0]
                pairs.setdefault(module, {})[which] = tensor
                break
        else:
            raise ValueError(
                f"{path}: tensor {key!r} is neither lora_A nor lora_B "
                "(adapters that train other weights are not supported)"
            )
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, float]]] = {}
    max_seen = 0
    for module, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(
                f"{path}: {module} has {sorted(ab)} but needs lora_A and lora_B"
            )
        # base_model.model.model.layers.3.self_attn.q_proj -> layers.3.self_attn, q_proj
        tail = module.split("layers.", 1)
        if len(tail) != 2:
            raise ValueError(f"{path}: {module} is not inside a decoder layer")
        parent, _, leaf = ("layers." + tail[1]).rpartition(".")
        ours, part = fused.get(leaf, (leaf, 0))
        target = f"{parent}.{ours}"
        if target not in owners:
            raise ValueError(
                f"{path}: {module} adapts {target}, which this model does not have as a plain "
                "linear (adapters of attention q/k/v/o and dense MLP gate/up/down are supported)"
            )
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(
                f"{path}: {module} has rank {r}, above --max-lora-rank {max_rank}"
            )
        max_seen = max(max_seen, r)
        layer = model.layers[int(parent.split(".")[1])]
        sizes = _parts(ours, layer)
        base = _base(getattr(owners[target], ours))
        if a.shape != (r, base.in_features) or b.shape != (sizes[part], r):
            raise ValueError(
                f"{path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, but this model "
                f"needs A ({r}, {base.in_features}) and B ({sizes[part]}, {r})"
            )
        leaf_alpha = float(_pattern(alpha_pattern, module, alpha))
        _pattern(rank_pattern, module, r)  # the rank is the tensors' own
        scale = leaf_alpha / (math.sqrt(r) if config.get("use_rslora") else r)
        pieces.setdefault(target, []).append((part, a, b, scale))
    if not pieces:
        raise ValueError(f"{path}: the adapter holds no LoRA weights")
    modules: dict[str, ModuleDelta] = {}
    nbytes = 0
    for target, items in pieces.items():
        items.sort(key=lambda item: item[0])
        layer = model.layers[int(target.split(".")[1])]
        sizes = _parts(target.rsplit(".", 1)[1], layer)
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        a_cat = torch.cat([a for _, a, _, _ in items]).to(dtype).contiguous()
        parts, r0 = [], 0
        for part, a, b, scale in items:
            r1 = r0 + a.shape[0]
            parts.append(
                (
                    offsets[part],
                    offsets[part + 1],
                    r0,
                    r1,
                    (b.float() * scale).t().to(dtype).contiguous(),
                )
            )
            r0 = r1
        modules[target] = ModuleDelta(a_cat, parts)
        nbytes += a_cat.nbytes + sum(p[4].nbytes for p in parts)
    return LoRAWeights(name, str(path), max_seen, modules, nbytes)


def _pattern(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key (a regex) that matches the
    end of the module's name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
