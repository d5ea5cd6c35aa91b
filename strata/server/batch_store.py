"""Where `/v1/files` and `/v1/batches` keep their state: one SQLite database and a directory of
file contents (`--batch-dir`; without it, a temporary directory that goes with the process).

    files     (id, owner, filename, purpose, bytes, created_at): the content in files/<id>
    batches   (id, owner, created_at, doc): the Batch object as JSON, rewritten on each change
    results   (batch_id, line, ok, record): one output line per finished input line, written
              as it finishes (a restart resumes with the lines that have none)

`owner` is the name of the API key that made it (strata.server.api_keys; "" without keys): a key
sees its own files and batches only. Every write is its own transaction; SQLite's WAL journal
keeps a finished line across a crash of the process.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at INTEGER NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
"""


class BatchStore:
    def __init__(self, directory: str | Path | None):
        self.temporary = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="strata-batches-"))
        (self.dir / "files").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.dir / "batches.sqlite3", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self.temporary:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _rows(self, sql: str, *args: Any) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _write(self, sql: str, *args: Any) -> None:
        with self._lock:
            self._db.execute(sql, args)

    # ------------------------------------------------------------------ files

    def add_file(self, owner: str, filename: str, purpose: str, data: bytes) -> dict:
        file_id = f"file-{uuid.uuid4().hex}"
        path = self.dir / "files" / file_id
        tmp = path.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(path)
        now = int(time.time())
        self._write(
            "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
            file_id,
            owner,
            filename,
            purpose,
            len(data),
            now,
        )
        return _file_doc(file_id, filename, purpose, len(data), now)

    def get_file(self, owner: str, file_id: str) -> dict | None:
        rows = self._rows(
            "SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ? AND owner = ?",
            file_id,
            owner,
        )
        return _file_doc(*rows[0]) if rows else None

    def list_files(
        self, owner: str, purpose: str | None, limit: int, after: str | None, order: str
    ) -> list[dict]:
        sql = (
            "SELECT id, filename, purpose, bytes, created_at FROM files WHERE owner = ?"
        )
        args: list[Any] = [owner]
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        direction = "DESC" if order == "desc" else "ASC"
        if after is not None:
            sign = "<" if order == "desc" else ">"
            sql += f" AND (created_at, id) {sign} (SELECT created_at, id FROM files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
        args.append(limit)
        return [_file_doc(*row) for row in self._rows(sql, *args)]

    def file_content(self, file_id: str) -> bytes:
        return (self.dir / "files" / file_id).read_bytes()

    def delete_file(self, owner: str, file_id: str) -> bool:
        if self.get_file(owner, file_id) is None:
            return False
        self._write("DELETE FROM files WHERE id = ?", file_id)
        (self.dir / "files" / file_id).unlink(missing_ok=True)
        return True

    # ------------------------------------------------------------------ batches

    def add_batch(self, owner: str, doc: dict) -> None:
        self._write(
            "INSERT INTO batches VALUES (?, ?, ?, ?)",
            doc["id"],
            owner,
            doc["created_at"],
            json.dumps(doc),
        )

    def save_batch(self, doc: dict) -> None:
        self._write(
            "UPDATE batches SET doc = ? WHERE id = ?", json.dumps(doc), doc["id"]
        )

    def get_batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        """The stored Batch object (`owner` None: whoever made it)."""
        if owner is None:
            rows = self._rows("SELECT doc FROM batches WHERE id = ?", batch_id)
        else:
            rows = self._rows(
                "SELECT doc FROM batches WHERE id = ? AND owner = ?", batch_id, owner
            )
        return json.loads(rows[0][0]) if rows else None

    def batch_owner(self, batch_id: str) -> str | None:
        rows = self._rows("SELECT owner FROM batches WHERE id = ?", batch_id)
        return rows[0][0] if rows else None

    def list_batches(self, owner: str, limit: int, after: str | None) -> list[dict]:
        sql = "SELECT doc FROM batches WHERE owner = ?"
        args: list[Any] = [owner]
        if after is not None:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            args.append(after)
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(limit)
        return [json.loads(row[0]) for row in self._rows(sql, *args)]

    def unfinished(self) -> list[dict]:
        """Batches still to run or finish, oldest first."""
        marks = ",".join("?" * len(UNFINISHED))
        rows = self._rows(
            "SELECT doc FROM batches WHERE json_extract(doc, '$.status') IN "
            f"({marks}) ORDER BY created_at, id",
            *UNFINISHED,
        )
        return [json.loads(row[0]) for row in rows]

    # ------------------------------------------------------------------ results

    def add_result(self, batch_id: str, line: int, ok: bool, record: dict) -> None:
        self._write(
            "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)",
            batch_id,
            line,
            int(ok),
            json.dumps(record, ensure_ascii=False),
        )

    def done_lines(self, batch_id: str) -> set[int]:
        return {
            row[0]
            for row in self._rows(
                "SELECT line FROM results WHERE batch_id = ?", batch_id
            )
        }

    def counts(self, batch_id: str) -> tuple[int, int]:
        """(completed, failed) lines so far."""
        rows = self._rows(
            "SELECT ok, COUNT(*) FROM results WHERE batch_id = ? GROUP BY ok", batch_id
        )
        by_ok = dict(rows)
        return by_ok.get(1, 0), by_ok.get(0, 0)

    def results(self, batch_id: str, ok: bool) -> Iterator[dict]:
        """The output lines that succeeded (ok) or failed, in input order."""
        rows = self._rows(
            "SELECT record FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
            batch_id,
            int(ok),
        )
        for row in rows:
            yield json.loads(row[0])


def _file_doc(
    file_id: str, filename: str, purpose: str, size: int, created_at: int
) -> dict:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "expires_at": None,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }
