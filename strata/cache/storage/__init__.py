"""L3 storage backends for KV pages, behind one small interface, picked by name from a registry.

Contract (`StorageBackend`): keys are short ASCII names (`strata-kv-` and a page's chained hash,
which covers the KV layout's namespace); values are opaque bytes (a serialized, checksummed page,
see `strata.cache.hicache`). Every method works in batches, may be called from a background thread
only, and may raise `StorageError` (or anything else) on a slow or dead backend: callers treat a
failure as a miss and never retry on the scheduler's critical path. Backends never interpret the
bytes, and may drop any page at any time (to stay within their bounds, or because a peer sharing
the store did): a dropped page is a miss.

Bounds: `max_bytes` caps the file backend's directory (least recently used pages go first); pages
unused for `ttl_s` expire from the file and redis backends. Mooncake's master evicts on its own,
from the memory the replicas lend it.
"""

from __future__ import annotations

from strata.cache.storage.base import StorageBackend, StorageError

__all__ = ["STORAGE_BACKENDS", "StorageBackend", "StorageError", "make_storage_backend"]

STORAGE_BACKENDS = ("file", "redis", "mooncake")


def make_storage_backend(
    name: str,
    target: str | None,
    max_bytes: int,
    ttl_s: float | None,
    timeout_s: float = 2.0,
) -> StorageBackend:
    """name: file (target = directory), redis (target = redis://host:port/db), mooncake (target =
    mooncake://master_host:port or a config file)."""
    if name == "file":
        from strata.cache.storage.file import FileStorage

        if not target:
            raise ValueError(
                "--hicache-storage-backend file needs --hicache-storage-path DIR"
            )
        return FileStorage(target, max_bytes=max_bytes, ttl_s=ttl_s)
    if name == "redis":
        from strata.cache.storage.redis import RedisStorage

        return RedisStorage(
            target or "redis://127.0.0.1:6379/0", timeout_s=timeout_s, ttl_s=ttl_s
        )
    if name == "mooncake":
        from strata.cache.storage.mooncake import MooncakeStorage

        return MooncakeStorage(target, timeout_s=timeout_s)
    raise ValueError(
        f"unknown storage backend {name!r}; choose one of {', '.join(STORAGE_BACKENDS)}"
    )
