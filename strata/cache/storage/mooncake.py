"""Mooncake's distributed store, where the `mooncake-transfer-engine` package is installed.

It is optional: importing it fails with a message saying how to get it. The store is used through
its key/value API (`put` / `get` / `is_exist`) with a config file naming the master and metadata
servers (MOONCAKE_CONFIG_PATH or the --hicache-storage-path argument).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from strata.cache.storage import StorageError


class MooncakeStorage:
    name = "mooncake"

    def __init__(self, config_path: str | None):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ValueError(
                "the mooncake backend needs `pip install mooncake-transfer-engine` (Linux x86_64 with its "
                "runtime libraries) and a running Mooncake master; use --hicache-storage-backend file or redis"
            ) from exc
        path = config_path or os.environ.get("MOONCAKE_CONFIG_PATH")
        if not path:
            raise ValueError("the mooncake backend needs a config file: --hicache-storage-path or MOONCAKE_CONFIG_PATH")
        cfg = json.loads(Path(path).read_text())
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            cfg.get("local_hostname", "localhost"),
            cfg["metadata_server"],
            int(cfg.get("global_segment_size", 1 << 30)),
            int(cfg.get("local_buffer_size", 1 << 28)),
            cfg.get("protocol", "tcp"),
            cfg.get("device_name", ""),
            cfg["master_server_address"],
        )
        if rc:
            raise ValueError(f"mooncake store setup failed with code {rc}")

    def exists(self, keys: list[str]) -> list[bool]:
        try:
            return [self.store.is_exist(k) == 1 for k in keys]
        except Exception as exc:
            raise StorageError(f"mooncake exists failed: {exc}") from exc

    def get(self, keys: list[str]) -> list[bytes | None]:
        try:
            return [self.store.get(k) or None for k in keys]
        except Exception as exc:
            raise StorageError(f"mooncake get failed: {exc}") from exc

    def set(self, items: list[tuple[str, bytes]]) -> None:
        try:
            for key, data in items:
                self.store.put(key, data)
        except Exception as exc:
            raise StorageError(f"mooncake put failed: {exc}") from exc

    def close(self) -> None:
        self.store.close()
