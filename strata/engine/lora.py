"""The engine's LoRA adapters: which are registered, which are in memory, which a request uses.

An adapter is registered by name with its PEFT directory (`--lora-modules name=path`, or at run
time); registering reads and checks it, so a bad adapter is refused at once with what is wrong.
At most `--max-loras` adapters are kept in memory: registering or using one more drops the
least recently used adapter that no live request uses (its registration stays; the next request
for it reads it again). An adapter's id is a hash of its files (31 bits, never 0): requests carry it
(`Req.adapter`) and it keys their prefix-cache entries (`strata.engine.request.adapter_cache_key`),
so KV computed under one adapter is never reused under another, while replicas sharing an L3 tier
key the same adapter alike (and a name loaded again with other files gets another id).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from strata.layers.lora import LoRAState, attach, load_adapter, read_config

logger = logging.getLogger(__name__)


class LoRAError(ValueError):
    """A request or registration the adapters cannot serve; `status` is the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Registered:
    name: str
    path: str
    adapter_id: int  # of its current load; 0 while not in memory
    rank: int
    loaded_at: float


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        in_use: Callable[[], Iterable[int]],
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.in_use = in_use  # the adapter ids live requests carry
        self.state = LoRAState()
        attach(model, self.state)
        reset = getattr(model, "reset_native_decode", None)
        if callable(reset):
            reset()  # the native loop holds the linears it saw; built again on use
        self.registered: dict[str, Registered] = {}
        # id -> the names registered with those files, least recently used first
        self.loaded: OrderedDict[int, list[str]] = OrderedDict()

    # ------------------------------------------------------------------ registration

    def register(self, name: str, path: str) -> Registered:
        if not name or not name.strip():
            raise LoRAError(f"an adapter needs a name, got {name!r}")
        if name in self.registered:
            raise LoRAError(
                f"an adapter named {name!r} is registered already (from "
                f"{self.registered[name].path}); unload it first",
                status=409,
            )
        entry = Registered(name, path, 0, 0, time.time())
        self._load(entry)  # ValueError: what is wrong with it
        self.registered[name] = entry
        logger.info(
            "LoRA adapter %r registered from %s (rank %d)", name, path, entry.rank
        )
        return entry

    def unregister(self, name: str) -> None:
        entry = self.registered.get(name)
        if entry is None:
            raise LoRAError(f"no adapter named {name!r} is registered", status=404)
        if entry.adapter_id and entry.adapter_id in set(self.in_use()):
            raise LoRAError(
                f"adapter {name!r} is in use by running requests; try again when they finish",
                status=409,
            )
        self._drop(entry)
        del self.registered[name]

    def names(self) -> list[str]:
        return sorted(self.registered)

    # ------------------------------------------------------------------ requests

    def acquire(self, name: str) -> int:
        """The id a request for adapter `name` carries (read again if it left memory)."""
        entry = self.registered.get(name)
        if entry is None:
            raise LoRAError(
                f"no LoRA adapter named {name!r}; registered: {self.names() or 'none'}",
                status=404,
            )
        if not entry.adapter_id:
            self._load(entry)
        self.loaded.move_to_end(entry.adapter_id)
        return entry.adapter_id

    def set_rows(self, adapters: list[int], counts: list[int], device) -> None:
        if any(adapters):
            self.state.set_rows(adapters, counts, device)
        else:
            self.state.clear_rows()

    def clear_rows(self) -> None:
        self.state.clear_rows()

    # ------------------------------------------------------------------ memory

    def _load(self, entry: Registered) -> None:
        read_config(Path(entry.path))  # ValueError: what in its config is not supported
        adapter_id = adapter_digest(entry.path)
        if adapter_id in self.loaded:  # the same files under another name: shared
            self.loaded[adapter_id].append(entry.name)
            entry.adapter_id = adapter_id
            entry.rank = self.state.adapters[adapter_id].rank
            return
        self._make_room()
        weights = load_adapter(
            entry.name, entry.path, self.model, self.max_rank, self.state.dtype
        )
        self.state.add(adapter_id, weights)
        self.loaded[adapter_id] = [entry.name]
        entry.adapter_id, entry.rank = adapter_id, weights.rank

    def _make_room(self) -> None:
        if len(self.loaded) < self.max_loras:
            return
        busy = set(self.in_use())
        for adapter_id, names in self.loaded.items():  # least recently used first
            if adapter_id not in busy:
                for name in list(names):
                    self._drop(self.registered[name])
                return
        raise LoRAError(
            f"all {self.max_loras} adapters in memory (--max-loras) are in use by running "
            "requests; retry when some finish",
            status=503,
        )

    def _drop(self, entry: Registered) -> None:
        names = self.loaded.get(entry.adapter_id)
        if names is not None:
            names.remove(entry.name)
            if not names:  # no other name holds these weights
                self.state.remove(entry.adapter_id)
                del self.loaded[entry.adapter_id]
        entry.adapter_id = 0


def adapter_digest(path: str) -> int:
    """A 31-bit id (never 0) of an adapter's files. ValueError when they cannot be read."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            with open(f"{path}/{name}", "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
        except FileNotFoundError:
            raise ValueError(
                f"{path} has no {name}; a LoRA adapter is a PEFT directory with "
                "adapter_config.json and adapter_model.safetensors"
            ) from None
        except OSError as exc:
            raise ValueError(f"cannot read {path}/{name}: {exc.strerror}") from None
    return int.from_bytes(digest.digest()[:4], "big") & 0x7FFFFFFF or 1
