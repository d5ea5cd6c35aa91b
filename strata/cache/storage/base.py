"""What every L3 storage backend shares (the contract is in `strata.cache.storage`, which
re-exports these): the `StorageBackend` interface and `StorageError`. A backend module imports them
from here, so the registry can import its backends on first use without a circle."""

from __future__ import annotations

from typing import Protocol


class StorageError(Exception):
    pass


class StorageBackend(Protocol):
    name: str

    def exists(self, keys: list[str]) -> list[bool]: ...
    def get(self, keys: list[str]) -> list[bytes | None]: ...
    def set(self, items: list[tuple[str, bytes]]) -> None: ...
    def close(self) -> None: ...
