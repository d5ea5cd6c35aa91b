"""The llama.cpp peer, through `llama-cpp-python` (an optional extra, never a test dependency:
`pip install 'llama-cpp-python[server]==0.3.36'` compiles llama.cpp, several minutes on 2 cores).

    serving    `python -m llama_cpp.server` on the default model's GGUF (or a --model .gguf)
    one-batch  in-process `llama_cpp.Llama`, batch size 1 only (the binding runs one sequence):
               one eval() of the prompt, then one eval() per generated token

It runs the GGUF as stored (the default model is Q4_1, 4-bit weights), as Strata does by default
(`--quantization auto`). Threads are set to the CPU count, as Strata's torch threads are.
llama-cpp-python's server answers one request at a time; llama.cpp's own C++ `llama-server`
batches (continuous batching over `--parallel` slots) and is the `llama-server` target
(`llama_server_argv`): a binary built from llama.cpp's sources, found on PATH, in
`$STRATA_LLAMA_SERVER`, or given as `llama-server:binary=PATH`.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

from strata.bench.one_batch import (
    WARMUP_INPUT_LEN,
    WARMUP_OUTPUT_LEN,
    OneBatchResult,
    random_batch,
)

INSTALL_HINT = "pip install 'llama-cpp-python[server]==0.3.36' (compiles llama.cpp; several minutes)"
CONTEXT_LEN = 8192


def missing_reason(need_server: bool) -> str | None:
    """None when llama-cpp-python (and its server, if asked) can be imported; else what to install."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    if need_server:
        for mod in (
            "uvicorn",
            "fastapi",
            "sse_starlette",
            "starlette_context",
            "pydantic_settings",
        ):
            if importlib.util.find_spec(mod) is None:
                return f"llama-cpp-python's server extra is missing ({mod}); {INSTALL_HINT}"
    return None


def gguf_path(model: str | None) -> Path:
    """The GGUF llama.cpp runs: `model` if it is a .gguf file, the default model's GGUF if None."""
    if model is None:
        from strata.weights.default_model import find_default_gguf

        return find_default_gguf()
    path = Path(model)
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path
    raise ValueError(
        f"llama.cpp needs a .gguf file, and --model {model!r} is not one; pass --model FILE.gguf"
    )


def gguf_missing_reason(model: str | None) -> str | None:
    """None when `gguf_path(model)` has a file for llama.cpp to run; else why not."""
    try:
        gguf_path(model)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    return None


def server_argv(
    gguf: Path, port: int, threads: int | None = None, alias: str = "llamacpp"
) -> list[str]:
    threads = threads or os.cpu_count() or 1
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(CONTEXT_LEN),
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--interrupt_requests",
        "False",  # its default aborts the running stream when another request arrives
    ]


LLAMA_SERVER_ENV = "STRATA_LLAMA_SERVER"


def llama_server_binary(binary: str | None) -> str | None:
    """The llama-server executable: the given path, $STRATA_LLAMA_SERVER, or `llama-server` on PATH."""
    import shutil

    for candidate in (
        binary,
        os.environ.get(LLAMA_SERVER_ENV),
        shutil.which("llama-server"),
    ):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def llama_server_argv(
    binary: str,
    gguf: Path,
    port: int,
    threads: int | None = None,
    slots: int = 64,
    ctx_per_slot: int = 1024,
) -> list[str]:
    """llama.cpp's C++ server with `slots` parallel sequences of `ctx_per_slot` tokens each
    (continuous batching is its default)."""
    threads = threads or os.cpu_count() or 1
    return [
        binary,
        "--model",
        str(gguf),
        "--alias",
        "llama-server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * ctx_per_slot),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--no-webui",
    ]


class LlamaCppModel:
    """`llama_cpp.Llama` on a GGUF, for batch-1 prefill and decode timing."""

    def __init__(self, gguf: Path, threads: int | None = None):
        from llama_cpp import Llama

        threads = threads or os.cpu_count() or 1
        self.llm = Llama(
            model_path=str(gguf),
            n_ctx=CONTEXT_LEN,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.vocab_size = self.llm.n_vocab()

    def one_batch(
        self,
        batch_size: int,
        input_len: int,
        output_len: int,
        seed: int = 0,
        exclude: set[int] | None = None,
    ) -> OneBatchResult:
        if batch_size != 1:
            raise ValueError(
                "llama-cpp-python's Llama runs one sequence at a time; only --batch-size 1 is measured"
            )
        (warm,) = random_batch(
            self.vocab_size,
            1,
            min(WARMUP_INPUT_LEN, input_len),
            seed + 10_000,
            exclude or set(),
        )
        self._run(warm, WARMUP_OUTPUT_LEN)
        (prompt,) = random_batch(self.vocab_size, 1, input_len, seed, exclude or set())
        prefill_s, steps = self._run(prompt, output_len)
        step_ms = 1000.0 * statistics.median(steps) if steps else None
        return OneBatchResult.measured(
            "llamacpp", 1, input_len, output_len, prefill_s, step_ms, len(steps)
        )

    def _run(self, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        token = self._greedy()
        prefill_s = time.perf_counter() - t0
        steps = []
        for _ in range(output_len - 1):
            t0 = time.perf_counter()
            llm.eval([token])
            token = self._greedy()
            steps.append(time.perf_counter() - t0)
        return prefill_s, steps

    def _greedy(self) -> int:
        """argmax of the last position's logits (Llama.scores holds them only with logits_all)."""
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(
            llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.vocab_size,)
        )
        return int(np.argmax(logits))
