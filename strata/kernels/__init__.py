"""Native CPU kernels for the forward hot path, compiled on first use with torch's extension tools.

`cpu_ops()` returns the compiled module, or None when it cannot be used: no C++ compiler, a failed
build, or `STRATA_CPU_KERNELS=0` in the environment. Every caller (strata/layers: norm, rope,
attention; the llama MLP) keeps its pure-PyTorch path for that case and for non-CPU tensors;
tests check the two agree.

The build is cached by torch (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) under a
name that hashes the source, the torch version and this CPU's instruction set (the code is compiled
with -march=native), so a first start on a new machine or after an upgrade compiles once (~30-60 s
on two cores) and later starts load the cached library in well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "STRATA_CPU_KERNELS"
_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), torch.__version__.encode(), _cpu_signature().encode()):
        digest.update(part)
    return f"strata_cpu_ops_{digest.hexdigest()[:12]}"


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def cpu_ops() -> ModuleType | None:
    """The compiled kernels, building them on the first call; None if unavailable (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        if not enabled_by_env():
            logger.info("CPU kernels disabled by %s=0; using the PyTorch path", ENV_VAR)
        else:
            _module = _build()
        _tried = True
    return _module


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    logger.info("loading CPU kernels (compiled once per machine and torch version, ~30-60 s the first time)")
    # the ninja that pip installed next to this interpreter, even when the venv is not activated
    path = os.environ.get("PATH", "")
    extra = [str(Path(sys.executable).parent)]
    try:
        import ninja

        extra.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*extra, path])
    try:
        module = cpp_extension.load(
            name=_build_name(),
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, missing headers, ...: the PyTorch path still works
        errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
        logger.warning(
            "CPU kernels unavailable (%s); using the slower PyTorch path", (errors or [repr(exc)])[-1][:500]
        )
        return None
    finally:
        os.environ["PATH"] = path
    logger.info("CPU kernels ready in %.1fs", time.perf_counter() - start)
    return module


@contextmanager
def disabled():
    """Within the block, behave as if STRATA_CPU_KERNELS=0 (for A/B comparisons and tests).
    Models loaded inside keep plain (unpacked) linears; the native kernels return after the block."""
    global _module, _tried
    saved, saved_env = (_module, _tried), os.environ.get(ENV_VAR)
    _module, _tried = None, True
    os.environ[ENV_VAR] = "0"
    try:
        yield
    finally:
        _module, _tried = saved
        if saved_env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved_env


def usable(x: torch.Tensor) -> ModuleType | None:
    """The kernels if `x` (and so the step's other tensors) is on the CPU and they are available.
    Called several times per layer, so the common case is two attribute reads."""
    if not x.is_cpu:
        return None
    return _module if _tried else cpu_ops()


def token_rows(x: torch.Tensor) -> bool:
    """[tokens, heads, head_dim] with each token's heads contiguous, the layout the kernels take
    (a view of a fused qkv projection qualifies)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
