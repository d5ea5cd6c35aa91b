"""A live `strata serve` (python -m strata.server) on a free port with a tiny random model, for e2e tests."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from strata.bench.soak_cluster import pid_alive
from strata.ports import free_port

_model_dir: Path | None = None


def tiny_model_dir() -> Path:
    """One tiny Llama (random weights, trained byte-level BPE, chat template) per test process."""
    global _model_dir
    if _model_dir is None:
        from tiny_models import make_model

        root = Path(tempfile.mkdtemp(prefix="strata-e2e-"))
        atexit.register(shutil.rmtree, root, True)
        _model_dir = make_model(root / "tiny-llama", "llama")
    return _model_dir


@contextlib.contextmanager
def tool_model(prefix: str) -> Iterator[Path]:
    """A tiny Llama with a chat template that writes tool calls (2,048 positions), removed after."""
    from tiny_models import TOOL_CHAT_TEMPLATE, make_model

    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield make_model(
            root / "tiny-tools",
            "llama",
            chat_template=TOOL_CHAT_TEMPLATE,
            max_position_embeddings=2048,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


# a chat template whose generation prompt opens a <think> block (for --reasoning-parser deepseek_r1)
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@contextlib.contextmanager
def reasoning_server(root: Path) -> Iterator[LiveServer]:
    """A live server over a tiny model that reasons first, with `--reasoning-parser deepseek_r1`."""
    from tiny_models import make_model

    model = make_model(root / "tiny", "llama", chat_template=REASONING_TEMPLATE)
    with LiveServer("--reasoning-parser", "deepseek_r1", model_dir=model) as srv:
        yield srv


class LiveServer:
    def __init__(
        self,
        *args: str,
        model_dir: Path | None = None,
        api_key: str | None = None,
        env: dict[str, str] | None = None,
        entry: tuple[str, ...] = (
            "-m",
            "strata.server",
        ),  # ("-m", "strata.cli", "serve"): as `strata serve` starts
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the server's log, closed in close()
            prefix="strata-serve-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable,
            *entry,
            "--model",
            str(model_dir or tiny_model_dir()),
            "--dtype",
            "float32",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *(["--api-key", api_key] if api_key else []),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        kw.setdefault("timeout", 60)
        return httpx.Client(base_url=self.url, headers=self.headers, **kw)

    def health_status(self) -> int | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = 90) -> list[int | None]:
        """Poll /health until 200; returns every status seen (None: not listening yet)."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.output()}"
                )
            status = self.health_status()
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def info(self) -> dict:
        with self.client() as c:
            return c.get("/get_server_info").raise_for_status().json()

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def __enter__(self) -> LiveServer:
        """`with LiveServer(...) as srv:` waits until it serves, and closes it on the way out."""
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            engine_pid = None
            if self.proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError, KeyError, TypeError):
                    engine_pid = self.info()["engine"]["pid"]
                self.stop()
            if engine_pid is not None and pid_alive(engine_pid):
                os.kill(engine_pid, signal.SIGKILL)
        finally:
            self.log.close()
            os.unlink(self.log.name)
