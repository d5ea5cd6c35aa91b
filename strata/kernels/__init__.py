"""Native CPU kernels for the forward hot path, compiled on first use with torch's extension tools.

`cpu_ops()` returns the compiled module, or None when it cannot be used: no C++ compiler, a failed
build, a build whose instruction set this CPU lacks, or `STRATA_CPU_KERNELS=0` in the environment.
Every caller (strata/layers: norm, rope, attention, quant; the llama MLP) keeps its pure-PyTorch path
for that case and for non-CPU tensors; tests check the two agree.

Builds ("targets"): `native` (-march=native: AVX-512 where the CPU has it, else AVX2, else scalar),
`x86-64-v3` (AVX2 + FMA + F16C, the fast path of most x86 CPUs) and `x86-64-v4` (AVX-512 without
VNNI or BF16). The default is native; `STRATA_CPU_KERNELS=<target>` selects another, and the tests
run the kernel suites against each this CPU can run, so an AVX-512 machine also proves the AVX2 paths
and the 512-bit paths' fallbacks. A build is loaded only if every ISA extension it was
compiled with is in this CPU's flags (checked before building and again on the loaded module).

Builds are cached by torch (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) under a name
that hashes the sources, their directory, the torch version, the target and this CPU's flags, so a
first start on a new machine compiles once (~1-2 min on two cores) and later starts load the cached
library in well under a second. Processes that start together build once: the first holds an OS lock
beside the build directory (`<build dir>.lock`, flock) while torch builds and loads, and the others
wait on it, saying every WAIT_REPORT_S whose build they wait for. The kernel drops that lock when
its holder dies, so a killed build never stalls a later start (torch's own lock file in the build
directory, which a killed build leaves behind, is removed by whoever holds the OS lock next).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV_VAR = "STRATA_CPU_KERNELS"
_DIR = Path(__file__).parent
SOURCES = (
    _DIR / "cpu_ops.cpp",
    _DIR / "attention_ops.cpp",
    _DIR / "extend_attention.cpp",
    _DIR / "quant_ops.cpp",
    _DIR / "decode_loop.cpp",
    _DIR / "dense_ops.cpp",
    _DIR / "lora_ops.cpp",
)
DEFAULT_TARGET = "native"
WAIT_REPORT_S = (
    15.0  # while another process builds, say whom this one waits for this often
)
# target -> (-march value, CPU flags it needs; None: whatever this CPU has)
TARGETS: dict[str, tuple[str, frozenset[str] | None]] = {
    "native": ("native", None),
    "x86-64-v3": (
        "x86-64-v3",
        frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
    ),
    # AVX-512 F/BW/DQ/VL without VNNI or BF16 (Skylake-X class): the 512-bit paths' fallbacks
    "x86-64-v4": (
        "x86-64-v4",
        frozenset(
            {
                "avx",
                "avx2",
                "fma",
                "f16c",
                "bmi1",
                "bmi2",
                "movbe",
                "avx512f",
                "avx512bw",
                "avx512dq",
                "avx512vl",
                "avx512cd",
            }
        ),
    ),
}
# names the module's compiled_isa() reports -> the /proc/cpuinfo flag each needs
ISA_FLAGS = {
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512bf16": "avx512_bf16",
    "avx512vnni": "avx512_vnni",
    "avxvnni": "avx_vnni",
    "amx_tile": "amx_tile",
    "amx_int8": "amx_int8",
    "amx_bf16": "amx_bf16",
}

_lock = threading.Lock()
_modules: dict[
    str, ModuleType | None
] = {}  # target -> built module (None: unavailable)
_module: ModuleType | None = None  # the selected target's module, once resolved
_tried = False


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where that file does not exist."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _build_name(target: str) -> str:
    digest = hashlib.sha256()
    for source in sorted(_DIR.glob("*.cpp")) + sorted(_DIR.glob("*.h")):
        digest.update(source.read_bytes())
    flags = " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()
    # torch rebuilds a build directory whose recorded source paths differ: two checkouts of the same
    # sources must not share one, or each load in one recompiles what the other just built
    for part in (torch.__version__, target, flags, str(_DIR.resolve())):
        digest.update(part.encode())
    return f"strata_cpu_ops_{target.replace('-', '_')}_{digest.hexdigest()[:12]}"


def selected_target() -> str | None:
    """The build the environment asks for: None when the kernels are switched off."""
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return None
    if value in ("", "1", "true", "yes", "on"):
        return DEFAULT_TARGET
    if value == "avx2":
        return "x86-64-v3"
    if value not in TARGETS:
        logger.warning(
            "%s=%s is not one of %s; using %s",
            ENV_VAR,
            value,
            sorted(TARGETS),
            DEFAULT_TARGET,
        )
        return DEFAULT_TARGET
    return value


def enabled_by_env() -> bool:
    return selected_target() is not None


def cpu_ops() -> ModuleType | None:
    """The selected build, building it on the first call; None if unavailable (logged once)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            target = selected_target()
            if target is None:
                logger.info(
                    "CPU kernels disabled by %s=0; using the PyTorch path", ENV_VAR
                )
            _module = None if target is None else load(target)
            _tried = True
    return _module


def target_supported(target: str) -> bool:
    """Whether this CPU can run the `target` build (the native build always can)."""
    _, needs = TARGETS[target]
    return needs is None or (
        platform.machine() in ("x86_64", "AMD64") and needs <= cpu_flags()
    )


def load(target: str) -> ModuleType | None:
    """The `target` build (cached per process); None if this CPU cannot run it or it fails to build."""
    if target not in _modules:
        if not target_supported(target):
            logger.info("CPU kernels: this CPU cannot run the %s build", target)
            _modules[target] = None
        else:
            _modules[target] = _checked(_build(target), target)
    return _modules[target]


def loaded(target: str) -> ModuleType:
    """`load(target)` where it is known to have loaded: for modules packed for that build."""
    module = load(target)
    if module is None:
        raise RuntimeError(
            f"the {target} CPU kernels are not available in this process"
        )
    return module


# "off": bf16 prefill attention never takes the AMX bf16 tiles (the default: wherever they run)
ATTENTION_TILES_ENV = "STRATA_ATTENTION_TILES"


def attention_tiles_on(module: ModuleType | None) -> bool:
    """Whether `module`'s bf16 extend attention runs on the AMX bf16 tiles."""
    return bool(
        module is not None
        and hasattr(module, "attention_tiles")
        and module.attention_tiles()
    )


def _apply_attention_tiles_env(module: ModuleType) -> None:
    """The tiles are the default wherever they run (2.6-3x the dot products on a Xeon's 2048-token
    prefill, docs/BENCHMARKS.md); ATTENTION_TILES_ENV=off keeps the dot products. A fixed rule rather
    than a timing: the two paths round differently, and a run's bits should not depend on the noise
    of a measurement at start-up."""
    setting = os.environ.get(ATTENTION_TILES_ENV, "").strip().lower()
    if setting in ("0", "off", "false", "no") and hasattr(
        module, "set_attention_tiles"
    ):
        module.set_attention_tiles(False)


def _checked(module: ModuleType | None, target: str) -> ModuleType | None:
    if module is None:
        return None
    flags = cpu_flags()
    missing = [
        isa
        for isa in compiled_isa(module)
        if flags and ISA_FLAGS.get(isa, isa) not in flags
    ]
    if missing:
        logger.warning(
            "CPU kernels (%s) were built for %s, which this CPU lacks; not using them",
            target,
            missing,
        )
        return None
    _apply_attention_tiles_env(module)
    return module


def compiled_isa(module: ModuleType) -> list[str]:
    """The ISA extensions a build was compiled with (its preprocessor macros)."""
    return list(module.compiled_isa())


def _build(target: str) -> ModuleType | None:
    from torch.utils import cpp_extension

    start = time.perf_counter()
    march, _ = TARGETS[target]
    logger.info(
        "loading CPU kernels (%s; compiled once per machine and torch version, ~1-2 min the first time)",
        target,
    )
    # the ninja that pip installed next to this interpreter, even when the venv is not activated
    path = os.environ.get("PATH", "")
    extra = [str(Path(sys.executable).parent)]
    try:
        import ninja

        extra.insert(0, ninja.BIN_DIR)
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join([*extra, path])
    name = _build_name(target)
    try:
        with build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", f"-march={march}", "-fopenmp"],
                extra_include_paths=[str(_DIR)],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - no compiler, missing headers, ...: the PyTorch path still works
        errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
        logger.warning(
            "CPU kernels unavailable (%s); using the slower PyTorch path",
            (errors or [repr(exc)])[-1][:500],
        )
        return None
    finally:
        os.environ["PATH"] = path
    logger.info(
        "CPU kernels (%s: %s) ready in %.1fs",
        target,
        " ".join(compiled_isa(module)) or "scalar",
        time.perf_counter() - start,
    )
    return module


@contextmanager
def build_lock(build_dir: Path):
    """Owns `build_dir` for the block: an exclusive flock on `<build_dir>.lock`, which the kernel
    releases when its holder exits or is killed. torch's `lock` file inside the build directory (its
    FileBaton, which a killed build leaves behind and every later load would wait on forever) is
    only ever created under this lock, so one found by the holder is a dead build's and goes at once.
    While another process holds it, this one waits, logging the holder's pid and the lock's path
    every WAIT_REPORT_S."""
    path = build_dir.with_name(build_dir.name + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # whom the next one waits for
        baton = build_dir / "lock"
        if baton.exists():
            logger.warning(
                "removing the kernel build lock a killed build left: %s", baton
            )
            baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, path: Path) -> None:
    start = reported = time.monotonic()
    first = True
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        now = time.monotonic()
        if first or now - reported >= WAIT_REPORT_S:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            logger.warning(
                "waiting %.0fs so far for the CPU kernel build of pid %s to finish (lock %s)",
                now - start,
                holder,
                path,
            )
            first, reported = False, now
        time.sleep(0.1)
    if not first:
        logger.warning(
            "the CPU kernel build lock is ours after %.0fs of waiting",
            time.monotonic() - start,
        )


# the last choice of AMX int8 tiles for block-quantized linears (strata.layers.quant.choose_int8_tiles)
_int8_tiles: dict[str, Any] = {}


def record_int8_tiles(choice: Mapping[str, Any]) -> None:
    """Keep `choice` ({} forgets it, so the next model loaded chooses again)."""
    _int8_tiles.clear()
    _int8_tiles.update(choice)


def int8_tiles_choice() -> dict[str, Any]:
    return dict(_int8_tiles)


def describe_int8_tiles(choice: Mapping[str, Any]) -> str:
    """e.g. "q4 never, q8 from 16 rows" (the choice's "rows" per format; 0: never)."""
    return ", ".join(
        f"{fmt} " + (f"from {c['rows']} rows" if c["rows"] else "never")
        for fmt, c in sorted(choice.items())
    )


# --matmul fast: the rows from which block linears take oneDNN bf16 (strata.layers.fast_matmul)
_fast_matmul: dict[str, Any] = {}


def record_fast_matmul(choice: Mapping[str, Any]) -> None:
    """Keep `choice` ({}: --matmul exact)."""
    _fast_matmul.clear()
    _fast_matmul.update(choice)


def describe_fast_matmul(choice: Mapping[str, Any]) -> str:
    """e.g. "block linears on oneDNN bf16 from 64 rows" (or why never)."""
    if choice.get("rows"):
        return f"block linears on oneDNN bf16 from {choice['rows']} rows"
    return (
        f"block linears exact ({choice.get('reason') or 'oneDNN never 1.25x faster'})"
    )


def kernel_info() -> dict[str, object]:
    """Which kernels a forward step runs here, for start-up logs and benchmark records."""
    module = cpu_ops()
    target = selected_target()
    return {
        "cpu_kernels": None if module is None else target,
        "kernel_isa": [] if module is None else compiled_isa(module),
        "cpu_isa": sorted(f for f in cpu_flags() if f in ISA_FLAGS.values()),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        # block-quantized linears on AMX int8 tiles: per format, the rows from which they run there
        # (0: never) and the timings that chose it; absent where the tiles cannot run
        **(
            {"int8_tiles": dict(_int8_tiles)}
            if module is not None and _int8_tiles
            else {}
        ),
        # bf16 prefill (extend) attention on AMX bf16 tiles
        "attention_tiles": attention_tiles_on(module),
        # --matmul fast: what it chose (absent with --matmul exact)
        **({"fast_matmul": dict(_fast_matmul)} if _fast_matmul else {}),
    }


def describe_kernels(info: Mapping[str, Any]) -> str:
    """One line for logs: the build and its ISA, e.g. "native (avx2 fma f16c)", or "off"."""
    if not info or info.get("cpu_kernels") is None:
        return "off"
    line = f"{info['cpu_kernels']} ({' '.join(info['kernel_isa']) or 'scalar'})"
    tiles = info.get("int8_tiles")
    if tiles:
        line += f", AMX int8 tiles: {describe_int8_tiles(tiles)}"
    if info.get("attention_tiles"):
        line += ", AMX bf16 tiles: prefill attention"
    if info.get("fast_matmul"):
        line += f", --matmul fast: {describe_fast_matmul(info['fast_matmul'])}"
    return line


@contextmanager
def using(target: str | None):
    """Within the block, the kernels are the `target` build (None: none at all, as with
    STRATA_CPU_KERNELS=0). Models loaded inside keep what they were built with (e.g. plain linears)."""
    global _module, _tried
    saved, saved_env = (_module, _tried), os.environ.get(ENV_VAR)
    _module, _tried = (None if target is None else load(target)), True
    os.environ[ENV_VAR] = "0" if target is None else target
    try:
        yield _module
    finally:
        _module, _tried = saved
        if saved_env is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved_env


def disabled():
    """Within the block, behave as if STRATA_CPU_KERNELS=0 (for A/B comparisons and tests)."""
    return using(None)


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
