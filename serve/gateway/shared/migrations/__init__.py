"""The shared store's schema, migrated by alembic (`versions/`): on open, every gateway brings the store to the newest
revision, one at a time (PostgreSQL: an advisory lock; SQLite: a file lock beside the database). A store made before
the revisions existed (SQLite, the first releases) is taken up by the first one, which adds what it lacks."""

from __future__ import annotations

import contextlib
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from filelock import FileLock

HERE = Path(__file__).parent
LOCK_KEY = 0x7278_6d69_6772  # PostgreSQL's advisory lock for migrations ("rxmigr")


def _config(connection: sa.Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(HERE))
    config.attributes["connection"] = connection
    return config


def head() -> str:
    return ScriptDirectory.from_config(_config(None)).get_current_head()


def current(engine: sa.Engine) -> str | None:
    with engine.connect() as db:
        return MigrationContext.configure(db).get_current_revision()


def upgrade(engine: sa.Engine) -> None:
    """Bring the store to the newest revision (nothing to do when it is there)."""
    if current(engine) == head():
        return
    on_disk = engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:")
    lock = FileLock(f"{engine.url.database}.migrate.lock", timeout=120) if on_disk else contextlib.nullcontext()
    with lock, engine.begin() as db:
        if engine.dialect.name == "postgresql":
            db.execute(sa.select(sa.func.pg_advisory_xact_lock(LOCK_KEY)))
        command.upgrade(_config(db), "head")
