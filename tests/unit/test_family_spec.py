"""Model families are declared by their `FamilySpec`s: every HF architecture and model_type belongs
to exactly one spec, a config.json reads with the traits its family declares for its model_type,
what a spec declares is what the engine builds for a tiny model of that family, and the engine
asks the spec instead of branching on the model's type."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import transformers
from tiny_dsv4 import TINY as TINY_DSV4
from tiny_dsv4 import make_dsv4
from tiny_models import FAMILIES, MLA_FAMILIES, MOE_FAMILIES, make_model, tiny_config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import strata
from strata.cache.dsv4_pool import DSV4KVPool
from strata.cache.kv_pool import LatentKVPool, MHAKVPool
from strata.distributed.sharding import check_supported
from strata.engine.engine import Engine
from strata.model_config import ModelConfig
from strata.models import FAMILIES as FAMILY_MODULES
from strata.models import (
    config_from_dir,
    config_from_hf,
    family_spec,
    family_specs,
    get_model_class,
)
from strata.models.spec import KVLayout
from strata.sampling_params import SamplingParams

# one tiny model per spec (tests/tiny_models.py, tests/tiny_dsv4.py)
TINY = {
    "llama": "qwen3",
    "gemma": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "ministral": "ministral",
    "mixtral": "mixtral",
    "qwen_moe": "qwen2_moe",
    "gpt_oss": "gpt_oss",
    "deepseek_v2": "deepseek_v3",
    "deepseek_v4": "deepseek_v4",
}
POOLS = {
    KVLayout.PAGED: MHAKVPool,
    KVLayout.LATENT: LatentKVPool,
    KVLayout.DSV4: DSV4KVPool,
}


def test_every_architecture_and_model_type_has_exactly_one_spec():
    specs = family_specs()
    assert len(specs) == len(FAMILY_MODULES)
    for names in ("architectures", "model_types"):
        listed = [name for spec in specs for name in getattr(spec, names)]
        assert len(listed) == len(set(listed)), names
    for spec in specs:
        assert spec.architectures and spec.model_types
        for arch, cls in spec.architectures.items():
            assert family_spec(arch) is spec and get_model_class(arch) is cls
    assert sorted(TINY) == sorted(spec.name for spec in specs)
    gguf = [arch for spec in specs for arch in spec.gguf]
    assert len({arch.name for arch in gguf}) == len(gguf)
    for spec in specs:
        for (
            arch
        ) in spec.gguf:  # a GGUF converts to a config of the family that declares it
            assert arch.architecture in spec.architectures
            assert arch.model_type in spec.model_types
    with pytest.raises(ValueError, match="not supported; supported: "):
        family_spec("NoSuchForCausalLM")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("family_models")

    def build(name: str) -> Path:
        if name == "deepseek_v4":
            return make_dsv4(root / name)
        return make_model(root / name, name)

    return build


@pytest.mark.parametrize("family", sorted(TINY))
def test_what_a_spec_declares_is_what_the_engine_builds(tiny_dir, family):
    model_dir = tiny_dir(TINY[family])
    engine = Engine(str(model_dir), dtype="float32", kv_cache_tokens=256)
    try:
        mc = engine.state.model_config
        spec = family_spec(mc.architecture)
        assert spec.name == family
        assert mc.model_type in spec.model_types
        assert type(engine.model) is spec.architectures[mc.architecture]
        assert type(engine.scheduler.runner.kv) is POOLS[spec.kv_layout]
        if not spec.native_decode:
            assert engine.state.decode_loop == "python"
        if (
            not spec.tensor_parallel
        ):  # refused, or pointed at expert parallel where it runs
            refusal = (
                "runs it over N ranks"
                if spec.expert_parallel
                else "run it with one rank"
            )
            with pytest.raises(ValueError, match=refusal):
                check_supported(mc, 2, 1)
            if spec.expert_parallel:
                check_supported(mc, 1, 2)
        out = engine.generate(
            [[5, 6, 7, 8]], SamplingParams(temperature=0, max_new_tokens=3)
        )
        assert len(out[0].token_ids) == 3
    finally:
        engine.close()


def test_tiny_models_cover_every_registered_model_type():
    """Each model_type a spec claims is one a tiny model of the tests carries (so the parity tests
    of tests/models/ see every family)."""
    tiny = {**FAMILIES, **MOE_FAMILIES, **MLA_FAMILIES}
    configs = {config for config, _ in tiny.values()} | {"DeepseekV4Config"}
    covered = {getattr(transformers, config).model_type for config in configs}
    for spec in family_specs():
        for model_type in spec.model_types:
            assert model_type in covered, (spec.name, model_type)


def _hf_config(tiny: str) -> dict:
    """The config.json dict of a tiny model of the tests, as transformers writes it."""
    if tiny == "deepseek_v4":
        return transformers.DeepseekV4Config(**TINY_DSV4).to_dict()
    return tiny_config(tiny).to_dict()


def _family_fields(mc: ModelConfig) -> dict:
    """What `ModelConfig` reads from the family's traits rather than from config.json's fields."""
    moe = mc.moe
    return {
        "qk_norm": mc.qk_norm,
        "norm_layout": mc.norm_layout,
        "gemma_norms": (mc.norm_unit_offset, mc.scale_embeddings),
        "bias": (mc.attention_bias, mc.o_proj_bias),
        "hidden_act": mc.hidden_act,
        "windows": [spec.window for spec in mc.layers],
        "sinks": [spec.sinks for spec in mc.layers],
        "rope": {(spec.rope.rope_type, spec.rope.theta) for spec in mc.layers},
        "moe": moe
        and (
            moe.routing,
            moe.norm_topk_prob,
            moe.routed_scaling_factor,
            moe.router_bias and moe.expert_bias,
            moe.correction_bias,
            moe.expert_act,
            moe.shared_intermediate_size,
            moe.shared_expert_gate,
        ),
        "mla_interleave": mc.mla and mc.mla.rope_interleave,
        "dsv4": mc.dsv4 is not None,
    }


LLAMA_FIELDS = {
    "qk_norm": "none",
    "norm_layout": "pre",
    "gemma_norms": (False, False),
    "bias": (False, False),
    "hidden_act": "silu",
    "windows": [None, None],
    "sinks": [False, False],
    "rope": {("default", 10000.0)},
    "moe": None,
    "mla_interleave": None,
    "dsv4": False,
}
# each tiny model's fields that differ from Llama's, with one model per model_type a spec claims:
# what its family's traits (not its config.json's fields) decide
FAMILY_FIELDS: dict[str, dict] = {
    "llama": {},
    "mistral_sw": {
        "windows": [8, 8]
    },  # a window and no layer_types: every layer slides
    "ministral": {"windows": [8, None]},
    "qwen2": {"bias": (True, False)},  # q/k/v biased by default, o_proj never
    "qwen3": {"qk_norm": "head"},
    "gemma2": {
        "norm_layout": "sandwich",
        "gemma_norms": (True, True),
        "hidden_act": "gelu_pytorch_tanh",  # hidden_activation
        "windows": [8, None],
    },
    "gemma3": {
        "qk_norm": "head",
        "norm_layout": "sandwich",
        "gemma_norms": (True, True),
        "hidden_act": "gelu_pytorch_tanh",
        "windows": [8, None, 8],
        "sinks": [False] * 3,
        "rope": {("default", 10_000.0), ("linear", 1_000_000.0)},  # local and global
    },
    "phi3": {"rope": {("longrope", 10000.0)}},
    "olmo2": {"qk_norm": "full", "norm_layout": "post"},
    "mixtral": {  # renormalised although config.json does not say so
        "rope": {("default", 1_000_000.0)},
        "moe": ("softmax_topk", True, 1.0, False, False, "silu", 0, False),
    },
    "qwen2_moe": {
        "bias": (True, False),
        "windows": [None] * 3,
        "sinks": [False] * 3,
        "moe": ("softmax_topk", False, 1.0, False, False, "silu", 48, True),
    },
    "qwen3_moe": {
        "qk_norm": "head",
        "windows": [None] * 4,
        "sinks": [False] * 4,
        "moe": ("softmax_topk", True, 1.0, False, False, "silu", 0, False),
    },
    "gpt_oss": {
        "bias": (True, True),
        "windows": [8, None],
        "sinks": [True, True],
        "rope": {("yarn", 150000.0)},
        "moe": ("topk_softmax", False, 1.0, True, False, "clamped_swiglu", 0, False),
    },
    "deepseek_v2": {  # never renormalised, RoPE interleaved whatever config.json says
        "rope": {("yarn", 10000.0)},
        "moe": ("softmax_greedy", False, 1.0, False, False, "silu", 32, False),
        "mla_interleave": True,
    },
    "deepseek_v3_halves": {
        "moe": ("sigmoid_group_topk", True, 2.5, False, True, "silu", 32, False),
        "mla_interleave": False,
    },
    "deepseek_v3": {
        "rope": {("yarn", 10000.0)},
        "moe": ("sigmoid_group_topk", True, 2.5, False, True, "silu", 32, False),
        "mla_interleave": True,
    },
}


def test_every_model_type_has_a_tiny_config_in_the_table():
    model_types = {_hf_config(tiny)["model_type"] for tiny in FAMILY_FIELDS}
    assert model_types | {"deepseek_v4"} == {
        t for spec in family_specs() for t in spec.model_types
    }


@pytest.mark.parametrize("tiny", sorted(FAMILY_FIELDS))
def test_a_config_reads_with_its_family_traits(tiny):
    raw = _hf_config(tiny)
    mc = config_from_hf(raw)
    assert _family_fields(mc) == {**LLAMA_FIELDS, **FAMILY_FIELDS[tiny]}
    # the same config.json naming its architecture (as a saved one does) reads the same
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[raw["model_type"]]
    named = config_from_hf({**raw, "architectures": [architecture]})
    assert named == dataclasses.replace(mc, architecture=architecture)
    # a tied LM head where config.json does not say: Gemma's, no other family's
    raw.pop("tie_word_embeddings", None)
    assert config_from_hf(raw).tie_word_embeddings == tiny.startswith("gemma")


def test_traits_that_hold_whatever_config_json_says():
    """Mixtral always renormalises its top-k weights; DeepSeek-V2 never does, and always rotates
    interleaved pairs (as transformers runs them)."""
    mixtral = config_from_hf({**_hf_config("mixtral"), "norm_topk_prob": False})
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob
    raw = {
        **_hf_config("deepseek_v2"),
        "norm_topk_prob": True,
        "rope_interleave": False,
    }
    v2 = config_from_hf(raw)
    assert v2.moe is not None and not v2.moe.norm_topk_prob
    assert v2.mla is not None and v2.mla.rope_interleave
    v3 = config_from_hf({**raw, "model_type": "deepseek_v3"})
    assert v3.moe is not None and v3.moe.norm_topk_prob
    assert v3.mla is not None and not v3.mla.rope_interleave


def test_deepseek_v4_reads_its_whole_config_by_its_own_parser():
    mc = config_from_hf(_hf_config("deepseek_v4"))
    assert mc.dsv4 is not None and mc.moe is not None
    assert mc.moe.routing == "deepseek_v4"
    assert all(spec.sinks and spec.moe for spec in mc.layers)
    assert mc.dsv4.layer_kinds == ("sliding", "csa", "hca", "csa")


def test_a_config_no_family_serves_is_refused_with_the_supported_names():
    base = {
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    with pytest.raises(
        ValueError, match=r"model_type 'falcon' is not supported; supported: .*llama"
    ):
        config_from_hf({**base, "model_type": "falcon"})
    with pytest.raises(
        ValueError, match=r"not supported; supported: .*LlamaForCausalLM"
    ):
        config_from_hf(
            {**base, "architectures": ["FalconForCausalLM"], "model_type": "llama"}
        )
    # an architecture of one family with a model_type it does not read
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM with model_type 'gemma2' is not supported; "
        r"its configs have model_type llama, mistral, qwen2, qwen3",
    ):
        config_from_hf(
            {**base, "architectures": ["LlamaForCausalLM"], "model_type": "gemma2"}
        )


def _engine_branches(tree: ast.AST, model_types: set[str]) -> list[str]:
    """Any reading of `.model_type`, a condition on `.mla` / `.dsv4` (if, while, conditional
    expression, comprehension filter), and a comparison with a model_type name."""
    found = []
    conditions = [
        node.test
        for node in ast.walk(tree)
        if isinstance(node, (ast.If, ast.IfExp, ast.While))
    ]
    conditions += [
        cond
        for node in ast.walk(tree)
        if isinstance(node, ast.comprehension)
        for cond in node.ifs
    ]
    for cond in conditions:
        for node in ast.walk(cond):
            if isinstance(node, ast.Attribute) and node.attr in ("mla", "dsv4"):
                found.append(f"line {node.lineno}: a condition on .{node.attr}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "model_type":
            found.append(f"line {node.lineno}: .model_type")
        if isinstance(node, ast.Compare):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and sub.value in model_types:
                    found.append(f"line {node.lineno}: compares with {sub.value!r}")
    return found


def test_the_engine_does_not_branch_on_the_model_type():
    model_types = {t for spec in family_specs() for t in spec.model_types}
    engine_dir = Path(strata.__file__).parent / "engine"
    found = {
        path.name: hits
        for path in sorted(engine_dir.glob("*.py"))
        if (hits := _engine_branches(ast.parse(path.read_text()), model_types))
    }
    assert found == {}
    # the check sees what it looks for
    probe = 'if cfg.mla is not None or cfg.model_type == "qwen2": pass\nx = 1 if c.dsv4 else 2'
    assert len(_engine_branches(ast.parse(probe), model_types)) == 4
    assert _engine_branches(ast.parse("latent = cfg.mla.latent_dim"), model_types) == []


def test_reading_config_json_does_not_branch_on_the_model_type():
    """What differs by family comes from its `ConfigTraits`, not from model_type comparisons."""
    model_types = {t for spec in family_specs() for t in spec.model_types}
    root = Path(strata.__file__).parent
    readers = ("model_config.py", "moe_config.py", "mla_config.py", "dsv4_config.py")
    found = {
        name: hits
        for name in readers
        if (hits := _engine_branches(ast.parse((root / name).read_text()), model_types))
    }
    assert found == {}


def test_ministral_slides_on_the_layers_its_config_says(tiny_dir):
    """Ministral, added as its file and one registry line: its config reads as its family's."""
    mc = config_from_dir(tiny_dir("ministral"))
    assert family_spec(mc.architecture).name == "ministral"
    assert [spec.window for spec in mc.layers] == [8, None]
