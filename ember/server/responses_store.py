"""Stored responses (`store: true`) for `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`.

One SQLite table through the standard library: in memory by default (nothing is written anywhere the
user did not ask), or a file (`--responses-store-path`) that survives restarts. Each entry is a
response and the conversation items that led to it, filed under the API key that made it: a lookup
with another key finds nothing, as if the id did not exist. The store is bounded in entries, in bytes
and in age (`--responses-store-max-entries`, `--responses-store-max-bytes`, `--responses-store-ttl`);
the oldest entries go first. Calls are short SQLite statements under one lock; the endpoints run them
in a worker thread, so a slow disk never stalls the event loop.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass

MEMORY = ":memory:"


@dataclass(frozen=True)
class StoreLimits:
    max_entries: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 30 * 24 * 3600.0  # OpenAI keeps stored responses 30 days


@dataclass(frozen=True)
class StoredResponse:
    response: str  # the response object, JSON
    items: str  # the conversation's input items up to this response, JSON (output items not included)


class ResponseStore:
    def __init__(self, path: str = MEMORY, limits: StoreLimits = StoreLimits()) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.executescript(
            """
            PRAGMA journal_mode = WAL;
            PRAGMA synchronous = NORMAL;
            CREATE TABLE IF NOT EXISTS responses (
                id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                created REAL NOT NULL,
                size INTEGER NOT NULL,
                response TEXT NOT NULL,
                items TEXT NOT NULL
            );
            CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
            """
        )

    def put(self, owner: str, response_id: str, entry: StoredResponse) -> None:
        """Add or replace an entry, then evict what is past the limits (the oldest first)."""
        size = len(entry.response.encode()) + len(entry.items.encode())
        if size > self.limits.max_bytes:
            raise ValueError(f"store: this response takes {size} bytes, more than the store holds")
        with self._lock:
            created = self._created(response_id) or time.time()
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response_id, owner, created, size, entry.response, entry.items),
            )
            self._evict()

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire()
            row = self._db.execute(
                "SELECT response, items FROM responses WHERE id = ? AND owner = ?", (response_id, owner)
            ).fetchone()
        return StoredResponse(*row) if row else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount > 0

    def stats(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        with self._lock:
            count, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        return count, size

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _created(self, response_id: str) -> float | None:
        row = self._db.execute("SELECT created FROM responses WHERE id = ?", (response_id,)).fetchone()
        return row[0] if row else None

    def _expire(self) -> None:
        self._db.execute("DELETE FROM responses WHERE created < ?", (time.time() - self.limits.ttl_s,))

    def _evict(self) -> None:
        self._expire()
        count, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
        if count <= self.limits.max_entries and size <= self.limits.max_bytes:
            return
        newest_first = self._db.execute("SELECT id, size FROM responses ORDER BY created DESC, rowid DESC").fetchall()
        total = 0
        for kept, (_, entry_size) in enumerate(newest_first):
            total += entry_size
            if kept >= self.limits.max_entries or total > self.limits.max_bytes:
                doomed = [(response_id,) for response_id, _ in newest_first[kept:]]
                self._db.executemany("DELETE FROM responses WHERE id = ?", doomed)
                return
