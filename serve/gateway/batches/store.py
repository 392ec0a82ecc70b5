"""Where the Files and Batch APIs keep what they hold, under the gateway's `batch_dir`:
- `files/ID`: each file's bytes (uploads, and the output and error files of batches);
- `batches.sqlite`: the files' owners, names and expiry, each batch's state, and each finished line's answer.

A file past its `expires_at` is as absent at once, and its row and bytes are deleted by the runner's next sweep
(`expire_files`), unless a batch that has not ended reads it (then after that batch).

A line's answer is one row, keyed by its batch and line number and committed when the answer arrives: a gateway
killed mid-batch loses at most the lines then in flight, which its runner sends again after the restart, and no
line can be written twice. The output and error files are written from those rows when the batch ends.

Every call opens its own SQLite connection (WAL: readers never wait for the runner's writes), so that the routes
and the runner can call from worker threads (`asyncio.to_thread`), and the gateway's workers, each a process,
share the one database.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL, total INTEGER NOT NULL,
    metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
    completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    output_expires_s INTEGER);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status, created_at);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, request_id TEXT,
    status_code INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (batch_id, line));
"""
# The states a batch passes through (OpenAI's): validating until its runner takes it, then in_progress,
# finalizing while its files are written, and one of the ends.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
# Columns added since the first release: a database made before them gets them on open (NULL: never expires).
ADDED = {"files": ("expires_at INTEGER",), "batches": ("output_expires_s INTEGER",)}
LIVE = "(expires_at IS NULL OR expires_at > ?)"  # a file not expired at the time given


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.root / "batches.sqlite"
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)
            for table, columns in ADDED.items():
                have = {row["name"] for row in db.execute(f"PRAGMA table_info({table})")}
                for column in columns:
                    if column.split()[0] not in have:
                        db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.db_path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a committed answer survives the process being killed
        try:
            yield db
        finally:
            db.close()

    # files

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, file_id: str, owner: str, filename: str, purpose: str, size: int,
                 expires_s: int | None = None) -> dict:
        """Record a file whose bytes are already at `path(file_id)`, expiring `expires_s` after now (None: never)."""
        now = int(time.time())
        row = {"id": file_id, "owner": owner, "filename": filename, "purpose": purpose, "bytes": size,
               "created_at": now, "expires_at": now + expires_s if expires_s else None}
        with self._db() as db:
            db.execute(f"INSERT OR REPLACE INTO files ({', '.join(row)}) VALUES ({', '.join(':' + k for k in row)})",
                       row)
        return row

    def file(self, file_id: str, owner: str) -> dict | None:
        """The file, if `owner` owns it and it has not expired: another key's files, and expired ones, are as absent."""
        with self._db() as db:
            row = db.execute(f"SELECT * FROM files WHERE id = ? AND owner = ? AND {LIVE}",
                             (file_id, owner, int(time.time()))).fetchone()
        return dict(row) if row else None

    def expire_files(self) -> list[str]:
        """Delete the files past their expiry (rows and bytes) but those a batch that has not ended reads; their ids."""
        with self._db() as db:
            gone = [r[0] for r in db.execute(
                f"SELECT id FROM files WHERE NOT {LIVE} AND id NOT IN "
                f"(SELECT input_file_id FROM batches WHERE status IN {ACTIVE})", (int(time.time()),))]
            db.executemany("DELETE FROM files WHERE id = ?", [(i,) for i in gone])
        for file_id in gone:
            self.path(file_id).unlink(missing_ok=True)
        return gone

    def files(self, owner: str, purpose: str | None, after: str | None, limit: int, descending: bool) -> list[dict]:
        return self._page("files", owner, after, limit, descending, purpose=purpose)

    def delete_file(self, file_id: str, owner: str) -> bool:
        """False when it is not `owner`'s. A file that an active batch reads is kept (ValueError)."""
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                if not db.execute("SELECT 1 FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone():
                    return False
                user = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN {ACTIVE}",
                                  (file_id,)).fetchone()
                if user:
                    raise ValueError(f"file {file_id} is the input of batch {user['id']}, which has not ended")
                db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            finally:
                db.execute("COMMIT")
        self.path(file_id).unlink(missing_ok=True)
        return True

    # batches

    def add_batch(self, batch: dict) -> None:
        with self._db() as db:
            db.execute(f"INSERT INTO batches ({', '.join(batch)}) VALUES ({', '.join(':' + k for k in batch)})",
                       {k: orjson.dumps(v).decode() if k in ("metadata", "errors") else v for k, v in batch.items()})

    def batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        """The batch with its request counts; None if absent or (with `owner`) another key's."""
        with self._db() as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?" + (" AND owner = ?" if owner is not None else ""),
                             (batch_id,) + ((owner,) if owner is not None else ())).fetchone()
            return self._with_counts(db, row) if row else None

    def status(self, batch_id: str) -> str | None:
        with self._db() as db:
            row = db.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

    def batches(self, owner: str, after: str | None, limit: int) -> list[dict]:
        return self._page("batches", owner, after, limit, True)

    def active(self) -> list[str]:
        """The batches a runner has to finish, oldest first."""
        with self._db() as db:
            return [r["id"] for r in db.execute(
                f"SELECT id FROM batches WHERE status IN {ACTIVE} ORDER BY created_at, rowid")]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] | None = None, **fields) -> bool:
        """Move a batch to `status` (stamping `<status>_at` the first time), if it is in one of `only_from`."""
        stamp = f"{status}_at"
        sets = ["status = :status"] + ([f"{stamp} = COALESCE({stamp}, :now)"] if stamp in TIMES else [])
        sets += [f"{k} = :{k}" for k in fields]
        where = "id = :id" + (f" AND status IN ({', '.join(repr(s) for s in only_from)})" if only_from else "")
        values = {"status": status, "now": int(time.time()), "id": batch_id,
                  **{k: orjson.dumps(v).decode() if k == "errors" else v for k, v in fields.items()}}
        with self._db() as db:
            return db.execute(f"UPDATE batches SET {', '.join(sets)} WHERE {where}", values).rowcount == 1

    # the answers of a batch's lines

    def done_lines(self, batch_id: str) -> set[int]:
        with self._db() as db:
            return {r[0] for r in db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def record(self, batch_id: str, line: int, custom_id: str, request_id: str | None, status_code: int,
               body: bytes) -> None:
        """A line's answer (status 0: no answer; `body` is then the error). A line answered before is kept as it was."""
        with self._db() as db:
            db.execute("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?, ?, ?)",
                       (batch_id, line, custom_id, request_id, status_code, body))

    def results(self, batch_id: str) -> Iterator[sqlite3.Row]:
        with self._db() as db:
            yield from db.execute("SELECT * FROM results WHERE batch_id = ? ORDER BY line", (batch_id,))

    def write_file(self, file_id: str, lines: Iterable[bytes]) -> int:
        """Write a file's bytes whole or not at all (a temporary name, then renamed); its size."""
        tmp = self.path(file_id).with_suffix(".part")
        size = 0
        try:
            with open(tmp, "wb") as out:
                for line in lines:
                    out.write(line)
                    size += len(line)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path(file_id))
        return size

    def _with_counts(self, db: sqlite3.Connection, row: sqlite3.Row) -> dict:
        batch = dict(row)
        done, ok = db.execute("SELECT COUNT(*), COALESCE(SUM(status_code BETWEEN 200 AND 299), 0) FROM results "
                              "WHERE batch_id = ?", (batch["id"],)).fetchone()
        batch["request_counts"] = {"total": batch.pop("total"), "completed": ok, "failed": done - ok}
        batch["metadata"] = orjson.loads(batch["metadata"]) if batch["metadata"] else None
        batch["errors"] = orjson.loads(batch["errors"]) if batch["errors"] else None
        return batch

    def _page(self, table: str, owner: str, after: str | None, limit: int, descending: bool, purpose=None) -> list[dict]:
        """Up to `limit` + 1 of `owner`'s rows (one more tells the caller there are more), after the row `after`."""
        order = "DESC" if descending else "ASC"
        where, values = ["owner = ?"], [owner]
        if table == "files":
            where.append(LIVE)
            values.append(int(time.time()))
        if purpose:
            where.append("purpose = ?")
            values.append(purpose)
        if after:
            where.append(f"rowid {'<' if descending else '>'} COALESCE((SELECT rowid FROM {table} WHERE id = ?), "
                         f"{'-1' if descending else '1e18'})")
            values.append(after)
        with self._db() as db:
            rows = db.execute(f"SELECT * FROM {table} WHERE {' AND '.join(where)} ORDER BY rowid {order} LIMIT ?",
                              (*values, limit + 1)).fetchall()
            return [self._with_counts(db, r) if table == "batches" else dict(r) for r in rows]
