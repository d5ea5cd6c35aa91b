"""Mooncake's distributed store (`pip install 'strata[mooncake]'`): KV pages live in memory segments
that the replicas themselves contribute, placed and evicted by a `mooncake_master`.

Where the store is: `--hicache-storage-path mooncake://HOST:PORT` (the master's RPC address; query
parameters set the other keys, e.g. `?local_hostname=10.0.0.5&global_segment_size=4294967296`), or
a JSON file with the keys of Mooncake's own config (`master_server_address`, `metadata_server`,
`local_hostname`, `protocol`, `device_name`, `global_segment_size`, `local_buffer_size`), or that
file in MOONCAKE_CONFIG_PATH. Defaults: peers find each other without a metadata service
(`P2PHANDSHAKE`), over TCP, this host as 127.0.0.1, 1 GiB contributed and a 256 MiB local buffer.

The client connects on first use, on the storage thread, so a master that is down at start-up (or
dies later) costs misses, never the engine: every call that cannot reach it raises StorageError,
and the next call tries again (StorageWorker spaces the retries out). A call the native client does
not answer within `timeout_s` raises too; it is left to finish in the background, and until it does
every call fails at once instead of queueing behind it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from strata.cache.storage.base import StorageError

HOW_TO_INSTALL = (
    "the mooncake backend needs Mooncake: `pip install 'strata[mooncake]'` (the "
    "mooncake-transfer-engine-non-cuda wheel, Linux x86_64; it loads libibverbs.so.1, apt: libibverbs1) "
    "and a running `mooncake_master`; or use --hicache-storage-backend file or redis"
)
DEFAULTS: dict[str, Any] = {
    "metadata_server": "P2PHANDSHAKE",  # peers exchange segment metadata directly, no etcd/HTTP service
    "local_hostname": "127.0.0.1",  # where the other clients reach this one's segment
    "protocol": "tcp",
    "device_name": "",  # RDMA devices, for protocol rdma
    "global_segment_size": 1 << 30,  # bytes of this process's memory lent to the store
    "local_buffer_size": 1 << 28,  # bytes of this process's transfer buffer
}
INT_KEYS = ("global_segment_size", "local_buffer_size")
MIN_SEGMENT_BYTES = 16 << 20  # the smallest segment Mooncake's client allocates


def mooncake_config(target: str | None) -> dict:
    """The client's config from `mooncake://host:port?key=value` or a JSON file (or MOONCAKE_CONFIG_PATH)."""
    target = target or os.environ.get("MOONCAKE_CONFIG_PATH")
    if not target:
        raise ValueError(
            "the mooncake backend needs to know where the master is: --hicache-storage-path "
            "mooncake://HOST:PORT, a JSON config file, or MOONCAKE_CONFIG_PATH"
        )
    if target.startswith("mooncake://"):
        url = urlsplit(target)
        if not url.hostname or not url.port:
            raise ValueError(
                f"a mooncake URL names the master as mooncake://HOST:PORT, got {target!r}"
            )
        cfg: dict[str, Any] = dict(parse_qsl(url.query)) | {
            "master_server_address": f"{url.hostname}:{url.port}"
        }
    else:
        try:
            cfg = json.loads(Path(target).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"cannot read the mooncake config file {target!r}: {exc}"
            ) from exc
        if not isinstance(cfg, dict) or not cfg.get("master_server_address"):
            raise ValueError(
                f"the mooncake config {target!r} must be a JSON object with master_server_address"
            )
    known = {*DEFAULTS, "master_server_address"}
    if set(cfg) - known:
        raise ValueError(
            f"unknown mooncake config keys {sorted(set(cfg) - known)}; known: {sorted(known)}"
        )
    cfg = DEFAULTS | cfg
    for key in INT_KEYS:
        try:
            cfg[key] = int(cfg[key])
        except (TypeError, ValueError):
            raise ValueError(
                f"mooncake config {key} must be a number of bytes, got {cfg[key]!r}"
            ) from None
    if cfg["global_segment_size"] < MIN_SEGMENT_BYTES:
        raise ValueError(
            f"mooncake global_segment_size must be at least {MIN_SEGMENT_BYTES} bytes (16 MiB)"
        )
    return cfg


class MooncakeStorage:
    name = "mooncake"

    def __init__(self, target: str | None, timeout_s: float = 2.0):
        self.config = mooncake_config(target)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:  # the package, or a native library it loads
            raise ValueError(f"{HOW_TO_INSTALL} ({exc})") from exc
        self._new_store = MooncakeDistributedStore
        self.timeout_s = timeout_s
        self.master = self.config["master_server_address"]
        self.connect_timeout_s = max(
            timeout_s, 30.0
        )  # joining mounts this process's segment
        self._store = None  # connected on first use
        self._busy = (
            threading.Lock()
        )  # held while a native call runs (maybe past its timeout)

    # The contract's calls, each one native call in batch, bounded by timeout_s.

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._call("exists", lambda s: s.batch_is_exist(keys))
        if any(c < 0 for c in codes):
            raise StorageError(
                f"mooncake exists failed for {sum(c < 0 for c in codes)} of {len(keys)} keys"
            )
        return [c == 1 for c in codes]

    def get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        # a missing key (or one evicted meanwhile) reads as b""; no page is empty
        return [data or None for data in self._call("get", lambda s: s.get_batch(keys))]

    def set(self, items: list[tuple[str, bytes]]) -> None:
        if not items:
            return
        keys, values = [k for k, _ in items], [v for _, v in items]
        # a key present already (another replica wrote the page first) is not an error: same bytes
        rc = self._call("put", lambda s: s.upsert_batch(keys, values))
        if rc != 0:
            raise StorageError(
                f"mooncake put of {len(items)} pages failed with code {rc} (master {self.master})"
            )

    def delete(self, keys: list[str]) -> None:
        """Remove pages (tests, operators); a missing key is fine."""
        self._call("remove", lambda s: s.batch_remove(keys, True))

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None and self._busy.acquire(timeout=self.timeout_s):
            try:
                store.close()
            finally:
                self._busy.release()

    # ------------------------------------------------------------------ connecting, deadlines

    def _connect(self):
        if self._store is None:
            self._probe_master()
            cfg = self.config
            store = self._new_store()
            rc = store.setup(
                cfg["local_hostname"],
                cfg["metadata_server"],
                cfg["global_segment_size"],
                cfg["local_buffer_size"],
                cfg["protocol"],
                cfg["device_name"],
                self.master,
            )
            if rc != 0:
                raise StorageError(
                    f"cannot join the Mooncake store at master {self.master} (setup returned {rc}): is "
                    "mooncake_master running there, and is local_hostname an address the other clients reach?"
                )
            self._store = store
        return self._store

    def _probe_master(self) -> None:
        """StorageError unless the master accepts a TCP connection: the native client's setup, which
        holds the GIL (so no deadline can cut it short), retries an absent master for minutes."""
        host, _, port = self.master.rpartition(":")
        try:
            socket.create_connection(
                (host.strip("[]"), int(port)), timeout=self.timeout_s
            ).close()
        except (OSError, ValueError) as exc:
            raise StorageError(
                f"cannot reach the Mooncake master at {self.master} ({exc}): is mooncake_master running there?"
            ) from None

    def _call(self, what: str, fn):
        """fn(store) on a helper thread, waited for at most timeout_s (connect_timeout_s while not yet
        connected); StorageError on any failure."""
        if not self._busy.acquire(blocking=False):
            raise StorageError(
                f"mooncake {what}: an earlier call to the master at {self.master} has not returned"
            )
        timeout_s = (
            self.timeout_s if self._store is not None else self.connect_timeout_s
        )
        box: list = []

        def run() -> None:
            try:
                box.append((True, fn(self._connect())))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            finally:
                self._busy.release()

        thread = threading.Thread(target=run, name="strata-mooncake-call", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not box:
            raise StorageError(
                f"mooncake {what}: no answer from the store (master {self.master}) in {timeout_s:g}s"
            )
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, StorageError):
            raise value
        raise StorageError(f"mooncake {what} failed: {value}") from value
