"""A directory of page files: a local disk, or a shared mount (NFS, 3FS) seen by several replicas.

Files are fanned out into 256 subdirectories by the key's last two characters; writes go to a
temporary name and are renamed into place, so a reader never sees a half-written page.

The directory is bounded in size and age. Each replica keeps an in-memory index of the page files
it knows (its own writes and hits, plus a periodic scan that learns the other replicas' files), least
recently used first; a file's mtime is its last use (a hit touches it). A write that takes the index
over `max_bytes` deletes least recently used files; a cleaner thread deletes files idle for longer
than `ttl_s`, and reads treat such files as misses. Another replica may delete any file at any time:
a vanished file is a miss, never an error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

STALE_TMP_S = 600.0  # a temporary file this old was left by a crashed writer


class FileStorage:
    name = "file"

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int,
        ttl_s: float | None = None,
        sweep_s: float = 60.0,
        rescan_s: float = 300.0,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.ttl_s = max_bytes, ttl_s
        self.sweep_s = (
            sweep_s if ttl_s is None else min(sweep_s, ttl_s / 2)
        )  # idle pages live < 1.5 x TTL
        self.rescan_s = (
            rescan_s  # how often the whole directory is listed (other replicas' writes)
        )
        # key -> (file bytes, last use in wall-clock seconds, comparable with mtimes); least recent first
        self._index: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.total_bytes = 0  # sum of the index's file bytes
        self._lock = (
            threading.Lock()
        )  # the index: the storage worker and the cleaner both change it
        self._stop = threading.Event()
        self._cleaner = threading.Thread(
            target=self._clean, name="strata-hicache-file-cleaner", daemon=True
        )
        self._cleaner.start()

    def _path(self, key: str) -> Path:
        return self.root / key[-2:] / key

    def _expired(self, mtime: float, now: float) -> bool:
        return self.ttl_s is not None and now - mtime > self.ttl_s

    def exists(self, keys: list[str]) -> list[bool]:
        now = time.time()
        out = []
        for key in keys:
            try:
                out.append(not self._expired(self._path(key).stat().st_mtime, now))
            except FileNotFoundError:
                out.append(False)
        return out

    def get(self, keys: list[str]) -> list[bytes | None]:
        now = time.time()
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                with open(path, "rb") as f:
                    if self._expired(os.fstat(f.fileno()).st_mtime, now):
                        out.append(None)
                        continue
                    data = f.read()
            except FileNotFoundError:
                out.append(None)
                continue
            with contextlib.suppress(OSError):  # gone since, or a read-only share
                os.utime(
                    path
                )  # a hit is a use: keeps the page young for every replica's LRU and TTL
            out.append(data)
            self._touch(key, len(data), now)
        return out

    def set(self, items: list[tuple[str, bytes]]) -> None:
        for key, data in items:
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_name(f".{key}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except (
                OSError
            ):  # e.g. ENOSPC: a half-written temp file would keep the disk full
                _unlink_quietly(tmp)
                raise
            self._touch(key, len(data), time.time())
        self._delete(self._pop_over_size())

    def close(self) -> None:
        self._stop.set()
        self._cleaner.join(timeout=5)

    # ------------------------------------------------------------------ the bounds

    def _touch(self, key: str, size: int, now: float) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            self.total_bytes += size - (old[0] if old else 0)
            self._index[key] = (size, now)

    def _pop_over_size(self) -> list[str]:
        victims = []
        with self._lock:
            while self.total_bytes > self.max_bytes and self._index:
                key, (size, _) = self._index.popitem(last=False)
                self.total_bytes -= size
                victims.append(key)
        return victims

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            _unlink_quietly(self._path(key))  # another replica may have got there first

    def sweep(self) -> None:
        """Delete files idle for longer than the TTL, then least recently used ones over the size."""
        now = time.time()
        expired = []
        with self._lock:
            while self.ttl_s is not None and self._index:
                key, (size, used) = next(iter(self._index.items()))
                if not self._expired(used, now):
                    break
                del self._index[key]
                self.total_bytes -= size
                expired.append(key)
        for key in expired:
            try:  # another replica may have used it since this one did
                mtime = self._path(key).stat().st_mtime
            except FileNotFoundError:
                continue
            if self._expired(mtime, now):
                self._delete([key])
            else:
                self._readd(key, mtime)
        self._delete(self._pop_over_size())

    def _readd(self, key: str, used: float) -> None:
        try:
            size = self._path(key).stat().st_size
        except FileNotFoundError:
            return
        with self._lock:
            if (
                key not in self._index
            ):  # by last use: it is younger than the TTL, so near the end
                self._index[key] = (size, used)
                self.total_bytes += size

    def rescan(self) -> None:
        """Rebuild the index from the directory: learns other replicas' files and forgets vanished ones."""
        started = time.time()
        found: list[tuple[float, str, int]] = []  # (mtime, key, bytes)
        for sub in _scandir(self.root):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            for entry in _scandir(Path(sub.path)):
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                    if started - st.st_mtime > STALE_TMP_S:
                        _unlink_quietly(Path(entry.path))
                elif entry.name[-2:] == sub.name and entry.is_file(
                    follow_symlinks=False
                ):
                    found.append((st.st_mtime, entry.name, st.st_size))
        found.sort()
        with self._lock:
            used_since = [
                (k, v) for k, v in self._index.items() if v[1] >= started
            ]  # during the scan
            self._index = OrderedDict(
                (key, (size, mtime)) for mtime, key, size in found
            )
            for key, value in used_since:
                self._index.pop(key, None)
                self._index[key] = value
            self.total_bytes = sum(size for size, _ in self._index.values())

    def _clean(self) -> None:
        last_scan = float("-inf")
        while True:
            try:
                if time.monotonic() - last_scan >= self.rescan_s:
                    self.rescan()
                    last_scan = time.monotonic()
                self.sweep()
            except OSError as exc:  # a flaky mount must not stop the cleaning for good
                logger.warning(
                    "hicache file storage: cleaning %s failed: %s", self.root, exc
                )
            if self._stop.wait(self.sweep_s):
                return


def _scandir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
