"""An engine for the database several gateways share (SQLAlchemy Core): SQLite or PostgreSQL."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

CONNECT_TIMEOUT_S = 5


def engine_for(url: str, password: str | None = None) -> sa.Engine:
    """An engine for the store at `url` (as its user, with `password` where the URL holds none); SQLite's connections
    in WAL mode, waiting up to 30 s for a writer."""
    if not url.startswith("sqlite"):
        target = sa.make_url(url)
        if target.drivername == "postgresql":  # psycopg (3), not SQLAlchemy's default psycopg2
            target = target.set(drivername="postgresql+psycopg")
        if password is not None:
            target = target.set(password=password)
        # a server that does not answer is given up on in seconds (503 to the client), not after TCP's minutes
        return sa.create_engine(target, pool_pre_ping=True, pool_size=4, max_overflow=8,
                                connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    engine = sa.create_engine(url, connect_args={"timeout": 30}, poolclass=sa.pool.NullPool)

    @sa.event.listens_for(engine, "connect")
    def _wal(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA journal_mode=WAL")
        dbapi_connection.execute("PRAGMA synchronous=NORMAL")  # WAL: a committed answer survives the process killed

    return engine


def insert_for(engine: sa.Engine):
    """The dialect's INSERT, which has ON CONFLICT (both SQLite's and PostgreSQL's)."""
    return (postgresql if engine.dialect.name == "postgresql" else sqlite).insert
