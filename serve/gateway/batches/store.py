"""Where the Files and Batch APIs keep what they hold: a database (SQLAlchemy Core) and the files' bytes.

- **SQLite** under the gateway's `batch_dir` (`batches.sqlite`, WAL: readers never wait for the runner's writes) for
  one box, its workers sharing it; each file's bytes in `files/ID` beside it.
- **PostgreSQL** at `batch_store_url` for several gateways (a box's workers, a fleet's pods): every gateway answers
  every file and batch; the files' bytes are rows of the database too (`file_chunks`), so that no volume has to be
  shared.

Either is brought to the current schema on open (the gateway's shared migrations, `../shared/migrations/`), an older
SQLite store included; two gateways opening one store at once migrate it once.

A file past its `expires_at` is as absent at once, and its row and bytes are deleted by a runner's next sweep
(`expire_files`), unless a batch that has not ended reads it (then after that batch).

A line's answer is one row, keyed by its batch and line number and committed when the answer arrives: a gateway
killed mid-batch loses at most the lines then in flight, which a runner sends again, and no line can be written twice.
The output and error files are written from those rows when the batch ends.

Who runs a batch: the runner holding its lease (`runner`, `lease_until`), renewed every second or so; a lease not
renewed for `batch_lease_s` (its gateway died) is taken by another runner, which carries on from the lines not yet
answered. At most `parallel` batches hold a live lease at once, over every gateway of the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import orjson
import sqlalchemy as sa

from ..shared.db import engine_for, insert_for
from ..shared.migrations import upgrade

# The states a batch passes through (OpenAI's): validating until its runner takes it, then in_progress,
# finalizing while its files are written, and one of the ends.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
CHUNK = 1 << 20  # bytes per row of a file kept in the database

meta = sa.MetaData()
files = sa.Table(
    "files", meta, sa.Column("id", sa.Text, primary_key=True), sa.Column("owner", sa.Text), sa.Column("filename", sa.Text),
    sa.Column("purpose", sa.Text), sa.Column("bytes", sa.Integer), sa.Column("created_at", sa.Integer),
    sa.Column("expires_at", sa.Integer), sa.Column("made_ns", sa.BigInteger))
batches = sa.Table(
    "batches", meta, sa.Column("id", sa.Text, primary_key=True),
    *(sa.Column(c, sa.Text) for c in ("owner", "endpoint", "input_file_id", "completion_window", "model", "status",
                                      "metadata", "errors", "output_file_id", "error_file_id", "runner")),
    *(sa.Column(c, sa.Integer) for c in ("total", "created_at", "expires_at", *TIMES, "output_expires_s")),
    sa.Column("made_ns", sa.BigInteger), sa.Column("lease_until", sa.Float))
results = sa.Table(
    "results", meta, sa.Column("batch_id", sa.Text, primary_key=True), sa.Column("line", sa.Integer, primary_key=True),
    sa.Column("custom_id", sa.Text), sa.Column("request_id", sa.Text), sa.Column("status_code", sa.Integer),
    sa.Column("body", sa.LargeBinary))
file_chunks = sa.Table(
    "file_chunks", meta, sa.Column("file_id", sa.Text, primary_key=True), sa.Column("n", sa.Integer, primary_key=True),
    sa.Column("data", sa.LargeBinary))
SHOWN = {"batches": [c for c in batches.c if c.name not in ("made_ns", "runner", "lease_until")],
         "files": [c for c in files.c if c.name != "made_ns"]}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def _live(now: int):
    """A file not expired at `now`."""
    return sa.or_(files.c.expires_at.is_(None), files.c.expires_at > now)


class Store:
    def __init__(self, root: Path | None = None, url: str = "", password: str | None = None):
        """The store at `url` (PostgreSQL, `password` its user's where the URL holds none), else SQLite under `root`;
        `root` keeps the files' bytes for SQLite."""
        self.root = Path(root) if root else None
        self.on_disk = not url
        if self.on_disk:
            self.files_dir = self.root / "files"
            self.files_dir.mkdir(parents=True, exist_ok=True)
            url = f"sqlite:///{self.root / 'batches.sqlite'}"
        self.engine = engine_for(url, password)
        try:
            upgrade(self.engine)
        except BaseException:  # its database does not answer: no connection pool is left behind
            self.engine.dispose()
            raise
        self._insert = insert_for(self.engine)

    # files

    def path(self, file_id: str) -> Path:
        """Where a file's bytes lie (SQLite's store only)."""
        return self.files_dir / file_id

    def add_file(self, file_id: str, owner: str, filename: str, purpose: str, size: int,
                 expires_s: int | None = None) -> dict:
        """Record a file whose bytes `write_file` wrote, expiring `expires_s` after now (None: never)."""
        now = int(time.time())
        row = {"id": file_id, "owner": owner, "filename": filename, "purpose": purpose, "bytes": size,
               "created_at": now, "expires_at": now + expires_s if expires_s else None}
        insert = self._insert(files).values(**row, made_ns=time.time_ns())
        with self.engine.begin() as db:
            db.execute(insert.on_conflict_do_update(index_elements=["id"], set_=row))
        return row

    def file(self, file_id: str, owner: str) -> dict | None:
        """The file, if `owner` owns it and it has not expired: another key's files, and expired ones, are as absent."""
        with self.engine.connect() as db:
            row = db.execute(sa.select(*SHOWN["files"]).where(
                files.c.id == file_id, files.c.owner == owner, _live(int(time.time())))).mappings().first()
        return dict(row) if row else None

    def expire_files(self) -> list[str]:
        """Delete the files past their expiry (rows and bytes) but those a batch that has not ended reads; their ids."""
        reading = sa.select(batches.c.input_file_id).where(batches.c.status.in_(ACTIVE))
        with self.engine.begin() as db:
            gone = list(db.execute(sa.select(files.c.id).where(
                sa.not_(_live(int(time.time()))), files.c.id.not_in(reading))).scalars())
            if gone:
                db.execute(files.delete().where(files.c.id.in_(gone)))
                db.execute(file_chunks.delete().where(file_chunks.c.file_id.in_(gone)))
        for file_id in gone if self.on_disk else ():
            self.path(file_id).unlink(missing_ok=True)
        return gone

    def files(self, owner: str, purpose: str | None, after: str | None, limit: int, descending: bool) -> list[dict]:
        return self._page(files, owner, after, limit, descending, purpose=purpose)

    def delete_file(self, file_id: str, owner: str) -> bool:
        """False when it is not `owner`'s. A file that an active batch reads is kept (ValueError)."""
        with self.engine.begin() as db:
            if db.execute(sa.select(files.c.id).where(files.c.id == file_id, files.c.owner == owner)
                          .with_for_update()).first() is None:
                return False
            user = db.execute(sa.select(batches.c.id).where(batches.c.input_file_id == file_id,
                                                            batches.c.status.in_(ACTIVE))).scalar()
            if user:
                raise ValueError(f"file {file_id} is the input of batch {user}, which has not ended")
            db.execute(files.delete().where(files.c.id == file_id))
            db.execute(file_chunks.delete().where(file_chunks.c.file_id == file_id))
        if self.on_disk:
            self.path(file_id).unlink(missing_ok=True)
        return True

    def write_file(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Write a file's bytes whole or not at all; its size. SQLite's store: a temporary name, then renamed;
        PostgreSQL's: one transaction."""
        if not self.on_disk:
            size = 0
            with self.engine.begin() as db:
                db.execute(file_chunks.delete().where(file_chunks.c.file_id == file_id))  # a finalisation redone
                for n, data in enumerate(_rechunk(chunks)):
                    db.execute(file_chunks.insert().values(file_id=file_id, n=n, data=data))
                    size += len(data)
            return size
        tmp, size = self.path(file_id).with_suffix(".part"), 0
        try:
            with open(tmp, "wb") as out:
                for chunk in chunks:
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path(file_id))
        return size

    def read_chunks(self, file_id: str) -> Iterator[bytes]:
        """A file's bytes, in order (FileNotFoundError: none kept)."""
        if self.on_disk:
            with open(self.path(file_id), "rb") as f:
                yield from iter(lambda: f.read(CHUNK), b"")
            return
        with self.engine.connect() as db:
            numbers = list(db.execute(sa.select(file_chunks.c.n).where(file_chunks.c.file_id == file_id)
                                      .order_by(file_chunks.c.n)).scalars())
        if not numbers:
            raise FileNotFoundError(f"no bytes of file {file_id} in the store")
        for n in numbers:  # a row at a time: a large file never whole in memory
            with self.engine.connect() as db:
                yield db.execute(sa.select(file_chunks.c.data).where(file_chunks.c.file_id == file_id,
                                                                     file_chunks.c.n == n)).scalar_one()

    @contextlib.contextmanager
    def local(self, file_id: str) -> Iterator[Path]:
        """A path to read the file's bytes at: its own in SQLite's store, a temporary copy of PostgreSQL's rows."""
        if self.on_disk:
            yield self.path(file_id)
            return
        with tempfile.TemporaryDirectory(prefix="rtxserve-batch-") as scratch:
            path = Path(scratch) / file_id
            with open(path, "wb") as out:
                for data in self.read_chunks(file_id):
                    out.write(data)
            yield path

    @contextlib.asynccontextmanager
    async def local_async(self, file_id: str):
        """`local` for the event loop: PostgreSQL's copy is made in a worker thread."""
        held = self.local(file_id)
        path = await asyncio.to_thread(held.__enter__)
        try:
            yield path
        finally:
            await asyncio.to_thread(held.__exit__, None, None, None)

    def discard_bytes(self, file_id: str) -> None:
        """Bytes written for a file that was then refused (never recorded)."""
        if self.on_disk:
            self.path(file_id).unlink(missing_ok=True)
        else:
            with self.engine.begin() as db:
                db.execute(file_chunks.delete().where(file_chunks.c.file_id == file_id))

    # batches

    def add_batch(self, batch: dict) -> None:
        values = {k: orjson.dumps(v).decode() if k in ("metadata", "errors") else v for k, v in batch.items()}
        with self.engine.begin() as db:
            db.execute(batches.insert().values(**values, made_ns=time.time_ns()))

    def batch(self, batch_id: str, owner: str | None = None) -> dict | None:
        """The batch with its request counts; None if absent or (with `owner`) another key's."""
        query = sa.select(*SHOWN["batches"]).where(batches.c.id == batch_id)
        if owner is not None:
            query = query.where(batches.c.owner == owner)
        with self.engine.connect() as db:
            row = db.execute(query).mappings().first()
            return self._with_counts(db, row) if row else None

    def status(self, batch_id: str) -> str | None:
        with self.engine.connect() as db:
            return db.execute(sa.select(batches.c.status).where(batches.c.id == batch_id)).scalar()

    def batches(self, owner: str, after: str | None, limit: int) -> list[dict]:
        return self._page(batches, owner, after, limit, True)

    def active(self) -> list[str]:
        """The batches a runner has to finish, oldest first."""
        with self.engine.connect() as db:
            return list(db.execute(sa.select(batches.c.id).where(batches.c.status.in_(ACTIVE))
                                   .order_by(batches.c.created_at, batches.c.made_ns)).scalars())

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] | None = None, **fields) -> bool:
        """Move a batch to `status` (stamping `<status>_at` the first time), if it is in one of `only_from`."""
        values = {"status": status, **{k: orjson.dumps(v).decode() if k == "errors" else v for k, v in fields.items()}}
        if f"{status}_at" in TIMES:
            values[f"{status}_at"] = sa.func.coalesce(batches.c[f"{status}_at"], int(time.time()))
        update = batches.update().where(batches.c.id == batch_id).values(**values)
        if only_from:
            update = update.where(batches.c.status.in_(only_from))
        with self.engine.begin() as db:
            return db.execute(update).rowcount == 1

    # leases: which runner runs a batch

    def claim(self, batch_id: str, runner: str, lease_s: float, parallel: int) -> bool:
        """Take (or keep) the batch for `runner` for `lease_s`, if it has not ended, no other runner's lease on it is
        live, and fewer than `parallel` other batches hold a live lease."""
        now = time.time()
        held = batches.alias("held")
        others = sa.select(sa.func.count()).select_from(held).where(
            held.c.id != batch_id, held.c.status.in_(ACTIVE), held.c.lease_until >= now).scalar_subquery()
        with self.engine.begin() as db:
            if self.engine.dialect.name == "postgresql":  # claims one at a time: the count below is exact
                db.execute(sa.select(sa.func.pg_advisory_xact_lock(0x7278_6261_7463_68)))
            return db.execute(batches.update().where(
                batches.c.id == batch_id, batches.c.status.in_(ACTIVE),
                sa.or_(batches.c.runner.is_(None), batches.c.runner == runner, batches.c.lease_until < now),
                others < parallel).values(runner=runner, lease_until=now + lease_s)).rowcount == 1

    def renew(self, runner: str, batch_ids: Iterable[str], lease_s: float) -> set[str]:
        """Extend `runner`'s leases on these batches; the ones it still holds."""
        ids = list(batch_ids)
        if not ids:
            return set()
        with self.engine.begin() as db:
            db.execute(batches.update().where(batches.c.id.in_(ids), batches.c.runner == runner)
                       .values(lease_until=time.time() + lease_s))
            return set(db.execute(sa.select(batches.c.id).where(batches.c.id.in_(ids), batches.c.runner == runner))
                       .scalars())

    def release(self, batch_id: str, runner: str) -> None:
        with self.engine.begin() as db:
            db.execute(batches.update().where(batches.c.id == batch_id, batches.c.runner == runner)
                       .values(runner=None, lease_until=None))

    # the answers of a batch's lines

    def done_lines(self, batch_id: str) -> set[int]:
        with self.engine.connect() as db:
            return set(db.execute(sa.select(results.c.line).where(results.c.batch_id == batch_id)).scalars())

    def record(self, batch_id: str, line: int, custom_id: str, request_id: str | None, status_code: int,
               body: bytes) -> None:
        """A line's answer (status 0: no answer; `body` is then the error). A line answered before is kept as it was."""
        with self.engine.begin() as db:
            db.execute(self._insert(results).values(batch_id=batch_id, line=line, custom_id=custom_id,
                                                    request_id=request_id, status_code=status_code, body=body)
                       .on_conflict_do_nothing())

    def results(self, batch_id: str) -> list[dict]:
        with self.engine.connect() as db:
            return [dict(r) for r in db.execute(sa.select(results).where(results.c.batch_id == batch_id)
                                                .order_by(results.c.line)).mappings()]

    def _with_counts(self, db: sa.Connection, row) -> dict:
        batch = dict(row)
        ok = sa.func.coalesce(sa.func.sum(sa.case((results.c.status_code.between(200, 299), 1), else_=0)), 0)
        done, good = db.execute(sa.select(sa.func.count(), ok).where(results.c.batch_id == batch["id"])).one()
        batch["request_counts"] = {"total": batch.pop("total"), "completed": good, "failed": done - good}
        batch["metadata"] = orjson.loads(batch["metadata"]) if batch["metadata"] else None
        batch["errors"] = orjson.loads(batch["errors"]) if batch["errors"] else None
        return batch

    def _page(self, table: sa.Table, owner: str, after: str | None, limit: int, descending: bool,
              purpose=None) -> list[dict]:
        """Up to `limit` + 1 of `owner`'s rows (one more tells the caller there are more), after the row `after`,
        in the order they were made."""
        query = sa.select(*SHOWN[table.name]).where(table.c.owner == owner)
        if table is files:
            query = query.where(_live(int(time.time())))
        if purpose:
            query = query.where(table.c.purpose == purpose)
        if after:
            mark = sa.select(table.c.made_ns).where(table.c.id == after).scalar_subquery()
            query = query.where(table.c.made_ns < sa.func.coalesce(mark, -1) if descending else
                                table.c.made_ns > sa.func.coalesce(mark, 1 << 62))
        order = table.c.made_ns.desc() if descending else table.c.made_ns.asc()
        with self.engine.connect() as db:
            rows = db.execute(query.order_by(order).limit(limit + 1)).mappings().all()
            return [self._with_counts(db, r) if table is batches else dict(r) for r in rows]


def _rechunk(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The bytes of `chunks` again, in pieces of CHUNK (the last one shorter)."""
    pending = bytearray()
    for chunk in chunks:
        pending += chunk
        while len(pending) >= CHUNK:
            yield bytes(pending[:CHUNK])
            del pending[:CHUNK]
    if pending:
        yield bytes(pending)


def copy_store(source: Store, target: Store) -> dict[str, int]:
    """Every row and file of `source` into `target` (moving a box's SQLite store into PostgreSQL); the rows copied
    per table. Leases are not copied: the target's runners take the batches afresh."""
    copied = {}
    with source.engine.connect() as src, target.engine.begin() as db:
        for table in (files, batches, results):
            copied[table.name] = 0
            for rows in src.execute(sa.select(table)).mappings().partitions(500):
                rows = [dict(r) | ({"runner": None, "lease_until": None} if table is batches else {}) for r in rows]
                db.execute(target._insert(table).values(rows).on_conflict_do_nothing())
                copied[table.name] += len(rows)
        file_ids = list(src.execute(sa.select(files.c.id)).scalars())
    for file_id in file_ids:
        if target.on_disk:
            shutil.copyfile(source.path(file_id), target.path(file_id))
        else:
            target.write_file(file_id, source.read_chunks(file_id))
    return copied
