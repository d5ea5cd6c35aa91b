"""Model families are declared by their `FamilySpec`s: every HF architecture and model_type belongs
to exactly one spec, what a spec declares is what the engine builds for a tiny model of that
family, and the engine asks the spec instead of branching on the model's type."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tiny_dsv4 import make_dsv4
from tiny_models import FAMILIES, MLA_FAMILIES, MOE_FAMILIES, make_model

import strata
from strata.cache.dsv4_pool import DSV4KVPool
from strata.cache.kv_pool import LatentKVPool, MHAKVPool
from strata.distributed.sharding import check_supported
from strata.engine.engine import Engine
from strata.models import FAMILIES as FAMILY_MODULES
from strata.models import config_from_dir, family_spec, family_specs, get_model_class
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
        if not spec.tensor_parallel:
            with pytest.raises(ValueError, match="run it with one rank"):
                check_supported(mc, 2, 1)
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
    import transformers

    covered = {getattr(transformers, config).model_type for config in configs}
    for spec in family_specs():
        for model_type in spec.model_types:
            assert model_type in covered, (spec.name, model_type)


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


def test_ministral_slides_on_the_layers_its_config_says(tiny_dir):
    """Ministral, added as its file and one registry line: its config reads as its family's."""
    mc = config_from_dir(tiny_dir("ministral"))
    assert family_spec(mc.architecture).name == "ministral"
    assert [spec.window for spec in mc.layers] == [8, None]
