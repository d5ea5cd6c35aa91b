"""`strata serve`: flags, the engine subprocess, uvicorn, and a clean shutdown.

Start-up, in order: parse flags into a frozen EngineConfig + ServerConfig; resolve the model
directory (converting a GGUF once); bind the HTTP port (a busy port fails here, before anything
loads); start the engine process (`python -m strata.server.engine_proc`, the config as JSON); load
the tokenizer; serve HTTP at once (GET /health answers 503 until the engine reports ready); print
one line with the URL when the engine is ready.

Shutdown on SIGINT/SIGTERM: stop accepting connections, let requests in flight finish for up to
--grace-period seconds, abort the rest, tell the engine to stop, wait for it (kill it if it does
not exit), exit 0. The engine also dies with its parent (PDEATHSIG), so
no engine outlives its server. If the engine fails or dies, the server exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from strata.config import (
    SCALAR_TYPES,
    EngineConfig,
    add_engine_args,
    engine_config_from_args,
    field_comments,
)
from strata.process import settle_heap
from strata.redact import install_log_redaction, secret_values, with_env_secrets
from strata.server.api_keys import load_api_keys
from strata.server.config import ENGINE_WAITS, LOG_LEVELS, ServerConfig

logger = logging.getLogger("strata.serve")

ENGINE_STOP_TIMEOUT_S = 10.0

# ------------------------------------------------------------------ flags


def _add_server_args(group) -> None:
    """One flag per ServerConfig field; the field's trailing comment is its help."""
    comments = field_comments(ServerConfig)
    from strata.server.reasoning import REASONING_PARSERS
    from strata.server.tool_calls import TOOL_CALL_PARSERS

    choices = {
        "log_level": LOG_LEVELS,
        "tool_call_parser": sorted(TOOL_CALL_PARSERS),
        "reasoning_parser": sorted(REASONING_PARSERS),
        "engine_wait": ENGINE_WAITS,
    }
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        type_name = str(f.type).replace(" | None", "").strip()
        if type_name not in SCALAR_TYPES:
            raise TypeError(
                f"cannot derive a flag for ServerConfig.{f.name} of type {f.type}; add a case here"
            )
        suffix = f" (default: {f.default})" if f.default is not None else ""
        group.add_argument(
            flag,
            type=SCALAR_TYPES[type_name],
            default=f.default,
            choices=choices.get(f.name),
            help=comments.get(f.name, "") + suffix,
            metavar=None if f.name in choices else f.name.upper(),
        )


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every `strata serve` flag: the ServerConfig fields, then the EngineConfig fields
    (`strata.config.add_engine_args`) unless the parser has them already."""
    _add_server_args(parser.add_argument_group("server"))
    if "--model" not in parser._option_string_actions:
        add_engine_args(parser)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The flags' values; --api-key not given comes from STRATA_API_KEY (off the command line)."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(ServerConfig)
        if hasattr(args, f.name)
    }
    return ServerConfig(**with_env_secrets(ServerConfig, values))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata serve",
        description="Serve a model over an OpenAI-compatible HTTP API (plus /generate, /metrics, /health).",
    )
    add_serve_args(parser)
    return parser


# ------------------------------------------------------------------ processes


class EngineProcess:
    """The engine subprocess: started with the config as JSON on its stdin (a command line is readable
    by every local user), stopped politely, then by force."""

    def __init__(
        self,
        config: EngineConfig,
        in_addr: str,
        out_addr: str,
        log_level: str,
        wait: str = "bounded",
    ):
        cmd = [
            sys.executable,
            "-m",
            "strata.server.engine_proc",
            "--in-addr",
            in_addr,
            "--out-addr",
            out_addr,
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            log_level,
        ]
        wait_env = engine_wait_env(wait, os.environ)
        env = {**os.environ, **wait_env}
        chosen = wait_env or {
            k: os.environ[k] for k in OPENMP_WAIT_VARS if k in os.environ
        }
        logger.info(
            "engine threads wait: %s (%s)",
            wait if wait_env else "as the environment sets",
            " ".join(f"{k}={v}" for k, v in chosen.items()),
        )
        # its own process group: a Ctrl-C in the terminal reaches the server, which then decides
        self.proc = subprocess.Popen(
            cmd, start_new_session=True, env=env, stdin=subprocess.PIPE
        )
        assert self.proc.stdin is not None
        try:
            with (
                self.proc.stdin
            ):  # a pipe buffer holds the few KiB; the engine reads it at once
                self.proc.stdin.write(json.dumps(dataclasses.asdict(config)).encode())
        except BrokenPipeError:
            pass  # the engine died at once; its exit code is reported by the server's watch

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float = ENGINE_STOP_TIMEOUT_S) -> None:
        """Wait for the engine to exit (after ShutdownReq), then SIGTERM... SIGKILL."""
        try:
            self.proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        logger.warning(
            "engine (pid %d) did not exit in %.0fs; killing it", self.proc.pid, timeout
        )
        self.proc.kill()
        self.proc.wait(5)


# libgomp's spin count (GOMP_SPINCOUNT: ~100,000 spins a millisecond by its own estimate, pause
# instructions whose length differs by CPU) and Intel OpenMP's block time (KMP_BLOCKTIME, ms), for
# --engine-wait bounded: a thread spins across the short gaps between the parallel regions of one
# step, and sleeps between steps and whenever the frontend or another process needs the core.
BOUNDED_SPIN_COUNT = 30_000
BOUNDED_BLOCKTIME_MS = 1
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def engine_wait_env(wait: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment variables that give the engine process's OpenMP threads the `wait` policy
    (ServerConfig.engine_wait); none when the environment already sets any OpenMP wait variable,
    which then wins. Measured on 2 cores (docs/BENCHMARKS.md, "How the engine's threads wait"):
    passive threads pay a futex wake at each of a step's ~200 parallel regions (a one-stream step
    ~2x slower); active ones keep spinning while the frontend or another process needs the core."""
    if wait not in ENGINE_WAITS:
        raise ValueError(f"engine_wait must be one of {ENGINE_WAITS}, got {wait!r}")
    if any(var in environ for var in OPENMP_WAIT_VARS):
        return {}
    if wait == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if wait == "active":
        return {"OMP_WAIT_POLICY": "ACTIVE"}
    return {
        "GOMP_SPINCOUNT": str(BOUNDED_SPIN_COUNT),
        "KMP_BLOCKTIME": str(BOUNDED_BLOCKTIME_MS),
    }


def engine_threads() -> int:
    """Torch threads for the engine when --num-threads is not given: every core the process may use.

    Its OpenMP threads spin only briefly before they sleep (engine_wait_env), so they leave the
    frontend its share of the cores. Measured on 2 cores with SmolLM2-135M, 64 concurrent clients
    (256-token prompts, 128 out): 2 passive threads 263 output tok/s vs 1 thread 153."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def served_names(
    model_arg: str | None, model_dir: Path, served_model_name: str | None
) -> tuple[str, frozenset[str]]:
    from strata.weights.default_model import DEFAULT_MODEL_NAME

    if served_model_name:
        name = served_model_name
    elif model_arg is None:
        name = DEFAULT_MODEL_NAME
    elif Path(model_arg).suffix.lower() == ".gguf":
        name = Path(model_arg).stem
    else:
        name = model_dir.name
    aliases = {name, model_dir.name, str(model_dir)}
    if model_arg is not None:
        aliases.add(model_arg)
    return name, frozenset(aliases)


def ipc_addresses() -> tuple[str, str, str]:
    """(directory to remove at exit, frontend->engine address, engine->frontend address).

    The sockets are files in a fresh directory only this user can enter (mode 0700), so no other
    local user can connect to submit or abort requests (abstract-namespace sockets would have no
    permissions at all). The server removes the directory when it exits.
    """
    ipc_dir = tempfile.mkdtemp(
        prefix="strata-ipc-"
    )  # mkdtemp: mode 0700, owned by this user
    os.chmod(ipc_dir, 0o700)
    return ipc_dir, f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


# ------------------------------------------------------------------ serving


def make_uvicorn_server(
    app, log_level: str, grace_period: float, keep_alive: int, lifespan: str
):
    """uvicorn's server, but a signal ends `serve()` without being re-raised afterwards, so the caller
    can shut down what it owns (the engine, launched replicas) and exit 0. Shared with the router."""
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if (
                threading.current_thread() is not threading.main_thread()
            ):  # e.g. run in a test thread
                yield
                return
            previous = {
                sig: signal.signal(sig, self.handle_exit)
                for sig in (signal.SIGINT, signal.SIGTERM)
            }
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    uv_config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=grace_period,
        timeout_keep_alive=keep_alive,
        lifespan=lifespan,
    )
    return Server(uv_config)


async def _serve(
    server_config: ServerConfig,
    engine_config: EngineConfig,
    model_arg: str | None,
    started: float,
) -> int:
    from strata.server.app import create_app
    from strata.server.engine_client import EngineClient, EngineUnavailable
    from strata.server.metrics import ServerMetrics
    from strata.server.serving import ServerState
    from strata.tokenizer import load_tokenizer

    model_dir = Path(engine_config.model)
    name, aliases = served_names(model_arg, model_dir, server_config.served_model_name)
    sock = bind_socket(server_config.host, server_config.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    ipc_dir, in_addr, out_addr = ipc_addresses()
    metrics = ServerMetrics(name)
    client = EngineClient(
        in_addr, out_addr, metrics, stall_timeout=server_config.health_stall_timeout
    )
    engine = EngineProcess(
        engine_config,
        in_addr,
        out_addr,
        server_config.log_level,
        server_config.engine_wait,
    )
    exit_code = 0
    # until uvicorn takes the signals over, a SIGTERM/SIGINT is remembered (and honoured once it has)
    early_signals: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: early_signals.append(signum))
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        state = ServerState(
            config=server_config,
            engine_config=engine_config,
            client=client,
            tokenizer=tokenizer,
            metrics=metrics,
            model_name=name,
            model_aliases=aliases,
            model_dir=str(model_dir),
            started_at=time.time(),
        )
        app = create_app(state)
        server = make_uvicorn_server(
            app,
            server_config.log_level,
            server_config.grace_period,
            keep_alive=5,
            lifespan="off",
        )
        server.should_exit = bool(early_signals)

        def on_failure(message: str) -> None:
            nonlocal exit_code
            exit_code = 1
            server.should_exit = True

        client.on_failure = on_failure
        client.start()

        async def announce_ready() -> None:
            try:
                info = await client.wait_ready()
            except EngineUnavailable:
                return  # client.fail() logged why, and the server is exiting
            settle_heap()  # the tokenizer, app and engine info are loaded: keep collections short
            tasks.append(asyncio.ensure_future(state.batches.run(app)))
            print(
                f"strata serve: ready at http://{url_host}:{port} (model {name!r}, context {info.context_len}, "
                f"KV cache {info.num_kv_tokens} tokens; {time.perf_counter() - started:.1f}s after start)",
                flush=True,
            )

        async def watch_engine() -> None:
            while True:
                await asyncio.sleep(0.5)
                code = engine.exit_code()
                if code is not None:
                    client.fail(
                        f"the engine process exited unexpectedly (exit code {code}); see its log above"
                    )
                    return

        tasks = [
            asyncio.ensure_future(announce_ready()),
            asyncio.ensure_future(watch_engine()),
        ]
        try:
            await server.serve(sockets=[sock])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            state.batches.store.close()
            loaded = client.info is not None
            await client.close()
            if loaded:
                await asyncio.to_thread(engine.stop)
            logger.info("server exiting")
    finally:
        if (
            engine.exit_code() is None
        ):  # still loading (it ignores SIGTERM), or failed to stop
            engine.proc.kill()
            engine.proc.wait()
        sock.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    return exit_code


def serve_main(argv: list[str] | argparse.Namespace | None = None) -> int:
    """Entry point of `strata serve`: command-line arguments, or flags the CLI already parsed with
    a parser set up by `add_serve_args`. Returns the process exit status."""
    started = time.perf_counter()
    args = (
        argv
        if isinstance(argv, argparse.Namespace)
        else build_parser().parse_args(argv)
    )
    return serve(args, started)


def keep_torch_out() -> None:
    """This process never computes: make torch unimportable in it, so transformers (the tokenizer, a
    GGUF's tokenizer conversion) takes its torch-free paths and the frontend stays ~400 MiB smaller.
    The engine process imports torch as usual. A stray `import torch` here fails loudly (ImportError)
    instead of silently loading it. A process that has torch already (a test) keeps it."""
    sys.modules.setdefault(
        "torch", None
    )  # None in sys.modules: find_spec says absent, import raises
    os.environ.setdefault(
        "TRANSFORMERS_NO_ADVISORY_WARNINGS", "1"
    )  # no "PyTorch was not found" notice


_CONVERT = (
    "import sys\n"
    "from strata.weights.default_model import resolve_model_path\n"
    "try:\n"
    "    print(resolve_model_path(sys.argv[1] or None))\n"
    "except (ValueError, FileNotFoundError) as exc:\n"
    "    sys.exit(f'strata serve: error: {exc}')\n"
)


def resolve_model(model_arg: str | None) -> Path:
    """The model directory for --model. Converting a GGUF needs transformers' GGUF support, which
    imports torch, so a first-time conversion runs in a child process and this one stays torch-free."""
    from strata.weights.default_model import resolve_model_path

    model_dir = resolve_model_path(model_arg, convert=False)
    if model_dir is not None:
        return model_dir
    logger.info(
        "converting %s once into the model cache", model_arg or "the default model"
    )
    child = subprocess.run(
        [sys.executable, "-c", _CONVERT, model_arg or ""],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if child.returncode != 0:
        raise ValueError(
            f"could not convert {model_arg or 'the default model'} (see the message above)"
        )
    return Path(child.stdout.strip().splitlines()[-1])


def serve(args: argparse.Namespace, started: float | None = None) -> int:
    """Run the server from parsed flags (the CLI's `serve` subcommand calls this)."""
    started = time.perf_counter() if started is None else started
    keep_torch_out()
    try:
        server_config = server_config_from_args(args)
        engine_config = engine_config_from_args(args)
    except ValueError as exc:
        print(f"strata serve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=server_config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    file_keys = load_api_keys(None, server_config.api_key_file)  # checked by the config
    secrets = {*secret_values(server_config, engine_config), *file_keys}
    install_log_redaction(sorted(secrets, key=len, reverse=True))  # longest first
    model_arg = engine_config.model
    try:
        model_dir = resolve_model(model_arg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"strata serve: error: {exc}", file=sys.stderr)
        return 2
    engine_config = dataclasses.replace(
        engine_config,
        model=str(model_dir),
        num_threads=engine_config.num_threads or engine_threads(),
    )
    try:
        return asyncio.run(_serve(server_config, engine_config, model_arg, started))
    except OSError as exc:
        print(f"strata serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
