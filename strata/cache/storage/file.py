"""A directory of page files: a local disk, or a shared mount (NFS, 3FS) seen by several replicas.

Files are fanned out into 256 subdirectories by the key's first byte; writes go to a temporary
name and are renamed into place, so a reader never sees a half-written page.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path


class FileStorage:
    name = "file"

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def exists(self, keys: list[str]) -> list[bool]:
        return [self._path(k).is_file() for k in keys]

    def get(self, keys: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self._path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
        return out

    def set(self, items: list[tuple[str, bytes]]) -> None:
        for key, data in items:
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{key}.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

    def close(self) -> None:
        pass
