"""The decoder's layers as one native call for steps in which every token decodes.

At batch 1 a decode step is ~12 Python-level calls per layer (norms, projections, RoPE, the K/V
store, attention, activation), each a few microseconds of dispatch around a kernel that itself
takes tens: on a small model the dispatch is a third of the step. `NativeDecode` hands the layer
loop to the kernels' `DecodeLoop` (strata/kernels/decode_loop.cpp), which calls the same kernels
with the same arguments in the same order, so logits are identical to the Python loop's; that loop
stays the oracle and runs every step that does not qualify.

A model qualifies when its layers are the plain decoder (`strata.models.decoder`): "pre" norm
layout without q/k norms or Gemma's (1 + w) norms, multi-head (not latent) attention, a dense SiLU
MLP, and linears that are q4/q8 blocks, natively packed bf16/float32 weights or plain float weights
(oneDNN-prepacked or mixed-format ones keep the Python loop). A step qualifies when every token decodes, nothing replays a window, and
the tensors are on the CPU in the weights' dtype. `STRATA_DECODE_LOOP=0` switches it off.
LoRA adapters (strata.layers.lora) run inside the loop: it holds their kernels' table and each
linear's number in it, and a step's adapter rows are passed with the step.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from strata import kernels
from strata.cache.kv_pool import MHAKVPool
from strata.layers.attention import AttentionMetadata
from strata.layers.lora import LoRALinear
from strata.layers.mlp import MLP
from strata.layers.packed import DenseLinear
from strata.layers.quant import Q4Linear, Q8Linear, QuantLinear
from strata.models import family_spec

ENV_VAR = "STRATA_DECODE_LOOP"


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def _linear_spec(module: nn.Module) -> tuple | None:
    """(kind, a, b, c, bias, rows) as DecodeLoop.add_layer takes it, or None if the loop cannot run it.
    A LoRA wrapper's base linear (the loop adds the adapters' deltas itself, see set_lora)."""
    if isinstance(module, LoRALinear):
        module = module.base
    bias = (
        module._buffers.get("bias")
        if isinstance(module, QuantLinear)
        else getattr(module, "bias", None)
    )
    if type(module) is Q4Linear:
        return (0, module.qp, module.dp, module.mp, bias, module.out_features)
    if type(module) is Q8Linear:
        return (1, module.qp, module.dp, None, bias, module.out_features)
    if type(module) is nn.Linear:
        return (2, module.weight, None, None, bias, module.out_features)
    if type(module) is DenseLinear and kernels.load(module.target) is kernels.cpu_ops():
        return (3, module.wp, None, None, bias, module.out_features)
    return None


def _has_hooks(root: nn.Module) -> bool:
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in root.modules())


def _plan(
    model: nn.Module, attention_cls: type
) -> tuple[list[tuple], torch.dtype] | None:
    """DecodeLoop.add_layer's arguments for each layer and the activations' dtype; None when the
    model does not qualify.
    Hooks on any layer module (tensor parallel's all-reduces, tracing) keep the Python loop: the
    native one would skip them."""
    cfg = model.config
    if (
        not enabled_by_env()
        or cfg.norm_layout != "pre"
        or cfg.qk_norm != "none"
        or cfg.norm_unit_offset
        or not family_spec(cfg.architecture).native_decode
    ):
        return None
    if _has_hooks(model.layers):
        return None
    layers, dtypes = [], set()
    for layer, rope in zip(model.layers, model.layer_ropes):
        attn, mlp = layer.self_attn, layer.mlp
        if type(attn) is not attention_cls or type(mlp) is not MLP or mlp.act != "silu":
            return None
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        specs = [_linear_spec(m) for m in linears]
        if any(s is None for s in specs):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        dtypes.update(n.weight.dtype for n in norms)
        if (
            any(n.weight.device.type != "cpu" for n in norms)
            or norms[0].eps != norms[1].eps
        ):
            return None
        spec = attn.spec
        sinks = None if attn.sinks is None else attn.sinks.detach().float().contiguous()
        layers.append(
            (
                norms[0].weight,
                norms[1].weight,
                norms[0].eps,
                specs,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                rope.cos,
                rope.sin,
                spec.scale,
                spec.window or 0,
                spec.softcap or 0.0,
                sinks,
            )
        )
    if len(dtypes) != 1:
        return None
    return layers, dtypes.pop()


class NativeDecode:
    """The layer loop of one `DecoderForCausalLM` in native code (see the module docstring)."""

    def __init__(self, loop, dtype: torch.dtype, lora=None):
        self.loop = loop
        self.dtype = dtype
        self.lora = (
            lora  # the model's LoRAState (strata.layers.lora), if adapters are served
        )
        self.steps = 0  # steps run natively (tests and benchmarks read it)

    @classmethod
    def build(cls, model: nn.Module, attention_cls: type) -> NativeDecode | None:
        """The native loop for `model`'s layers (whose plain attention module is `attention_cls`), or
        None when the model or this machine does not qualify. It holds the modules' tensors as they
        are now: a model whose modules are replaced later (quantize_model) builds it again."""
        ops = kernels.cpu_ops()
        plan = _plan(model, attention_cls)
        if ops is None or not hasattr(ops, "DecodeLoop") or plan is None:
            return None
        layers, dtype = plan
        loop = ops.DecodeLoop()
        for args in layers:
            loop.add_layer(*args)
        lora = getattr(model, "lora", None)  # strata.layers.lora.LoRAState
        if lora is not None and isinstance(lora.table, ops.LoRATable):  # this build's
            loop.set_lora(lora.table, _lora_modules(model, lora))
        return cls(loop, dtype, lora)

    @staticmethod
    def supported(model: nn.Module, attention_cls: type) -> bool:
        """Whether `model` qualifies (the kernels aside), without building anything."""
        return _plan(model, attention_cls) is not None

    def accepts(self, x: torch.Tensor, meta: AttentionMetadata, kv) -> bool:
        """Whether this step can run natively (every token decodes, nothing replayed)."""
        rows = x.shape[0]
        if not (0 < rows == meta.num_decode and x.dtype == self.dtype):
            return False
        if (
            kernels.usable(x) is None
        ):  # on another device, or the kernels switched off (kernels.disabled())
            return False
        if type(kv) is not MHAKVPool or meta.key_floor is not None:
            return False
        if self.lora is not None and self.lora.active and not self.loop.has_lora():
            return False  # adapter rows, and a loop without their table
        return all(g.key_floor is None for g in meta.groups)

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: MHAKVPool,
        capture_after: tuple[int, ...] = (),
        captured: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] embeddings -> (x, residual) after the last layer (the stream is their sum).
        The stream after each layer of `capture_after` (-1: the embeddings) is written into
        `captured` [T, len(capture_after) * hidden], in that order."""
        rows = meta.num_decode
        groups = [
            (g.page_table[:rows], g.out_slots)
            for g in (meta.group(i) for i in range(len(meta.groups) + 1))
        ]
        layer_groups = [groups[g] for g in kv.group_of]
        self.steps += 1
        return self.loop.forward(
            x.contiguous(),
            positions,
            kv.k,
            kv.v,
            [g[0] for g in layer_groups],
            [g[1] for g in layer_groups],
            meta.decode_owner,
            meta.page_size,
            None if self.lora is None else self.lora.native_rows(),
            list(capture_after),
            captured,
        )


def _lora_modules(model: nn.Module, lora) -> list[list[int]]:
    """Each layer's [qkv, o, gate_up, down] numbers in the adapters' table (-1: not adapted)."""
    modules = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        modules.append(
            [
                lora.index.get(m.name, -1) if isinstance(m, LoRALinear) else -1
                for m in linears
            ]
        )
    return modules


def decode_loop_name(model: nn.Module) -> str:
    """Which layer loop `model`'s decode steps run here: "native" or "python" (for logs and records)."""
    supported = getattr(model, "native_decode_supported", None)
    ops = kernels.cpu_ops()
    native = (
        callable(supported)
        and supported()
        and ops is not None
        and hasattr(ops, "DecodeLoop")
    )
    return "native" if native else "python"
