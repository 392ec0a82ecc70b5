"""The Files and Batch APIs' store (serve/gateway/batches/store.py) on both its databases: SQLite under a folder and a
real PostgreSQL server started here. The same calls give the same answers on each; a lease is held by one runner at a
time and taken over once it lapses; at most `parallel` batches hold live leases; a store made by the first release is
migrated on open and copied whole into PostgreSQL; two gateways opening a new database at once migrate it once."""

import concurrent.futures
import sqlite3
import time

import pytest
import sqlalchemy as sa

from serve.gateway.batches import store as store_module
from serve.gateway.shared.migrations import current, head
from serve.gateway.batches.store import CHUNK, Store, copy_store
from tests.postgres import INSTALLED, WHY_NOT, Postgres

pytestmark = pytest.mark.skipif(not INSTALLED, reason=WHY_NOT)


@pytest.fixture(scope="module")
def postgres():
    server = Postgres().start()
    yield server
    server.stop()


@pytest.fixture
def fresh_url(postgres):
    """A database of its own on the module's server, for one test."""
    name = f"t{time.time_ns()}"
    admin = sa.create_engine(postgres.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as db:
        db.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return postgres.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        return Store(tmp_path / "batches")
    return Store(url=request.getfixturevalue("fresh_url"))


def batch_row(batch_id: str, owner: str = "alice", file_id: str = "file-in", **kw) -> dict:
    now = int(time.time())
    return {"id": batch_id, "owner": owner, "endpoint": "/v1/chat/completions", "input_file_id": file_id,
            "completion_window": "24h", "model": "m", "status": "validating", "total": 2, "metadata": {"k": "v"},
            "created_at": now, "expires_at": now + 3600, **kw}


def test_files_and_batches_read_back_alike_on_either_database(store):
    data = b"".join(b'{"custom_id": "%d"}\n' % i for i in range(CHUNK // 8))  # over one row of file_chunks
    assert store.write_file("file-in", [data[:1000], data[1000:]]) == len(data)
    store.add_file("file-in", "alice", "in.jsonl", "batch", len(data))
    assert b"".join(store.read_chunks("file-in")) == data
    with store.local("file-in") as path:
        assert path.read_bytes() == data
    assert store.file("file-in", "bob") is None and store.file("file-in", "alice")["bytes"] == len(data)
    for i in range(3):
        store.add_batch(batch_row(f"batch_{i}"))
    assert [b["id"] for b in store.batches("alice", None, 10)] == ["batch_2", "batch_1", "batch_0"]  # newest first
    page = store.batches("alice", "batch_2", 1)  # one more than asked: there are more
    assert [b["id"] for b in page] == ["batch_1", "batch_0"]
    store.record("batch_0", 1, "a", "req-1", 200, b'{"ok": 1}')
    store.record("batch_0", 1, "a", "req-2", 500, b"again")  # a line answered before is kept as it was
    store.record("batch_0", 2, "b", None, 0, b'{"code": "batch_cancelled"}')
    assert store.batch("batch_0", "alice")["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert [(r["line"], r["request_id"]) for r in store.results("batch_0")] == [(1, "req-1"), (2, None)]
    assert store.set_status("batch_0", "cancelling", only_from=("validating",))
    assert not store.set_status("batch_0", "in_progress", only_from=("validating",))
    with pytest.raises(ValueError, match=r"is the input of batch batch_\d, which has not ended"):
        store.delete_file("file-in", "alice")
    for i in range(3):
        store.set_status(f"batch_{i}", "cancelled")
    assert store.delete_file("file-in", "alice") and store.file("file-in", "alice") is None
    with pytest.raises(FileNotFoundError):  # its bytes went with it
        list(store.read_chunks("file-in"))


def test_a_lease_is_one_runner_s_until_it_lapses_and_parallel_bounds_them_all(store):
    for i in range(3):
        store.add_batch(batch_row(f"batch_{i}"))
    assert store.claim("batch_0", "a", 30, parallel=2) and not store.claim("batch_0", "b", 30, parallel=2)
    assert store.claim("batch_0", "a", 30, parallel=2)  # its own, renewed
    assert store.claim("batch_1", "b", 30, parallel=2)
    assert not store.claim("batch_2", "b", 30, parallel=2)  # two batches hold live leases already
    assert store.renew("a", ["batch_0", "batch_1"], 30) == {"batch_0"}
    store.release("batch_1", "b")
    assert store.claim("batch_2", "b", 0.2, parallel=2)
    time.sleep(0.3)  # b's lease on batch_2 lapses (b died)
    assert store.claim("batch_2", "c", 30, parallel=2) and store.renew("b", ["batch_2"], 30) == set()
    store.set_status("batch_0", "completed")
    assert not store.claim("batch_0", "c", 30, parallel=2)  # an ended batch is nobody's


def test_a_first_release_store_is_migrated_on_open_and_copied_into_postgresql(tmp_path, fresh_url):
    root = tmp_path / "batches"
    (root / "files").mkdir(parents=True)
    with sqlite3.connect(root / "batches.sqlite") as db:  # the first release's tables, and a batch it ran
        db.executescript(f"""CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL,
            purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
            CREATE TABLE batches (id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, model TEXT NOT NULL, status TEXT NOT NULL,
            total INTEGER NOT NULL, metadata TEXT, errors TEXT, output_file_id TEXT, error_file_id TEXT,
            created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER,
            completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
            CREATE TABLE results (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
            request_id TEXT, status_code INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (batch_id, line));
            INSERT INTO files VALUES ('file-a', 'alice', 'a.jsonl', 'batch', 3, 1);
            INSERT INTO files VALUES ('file-b', 'alice', 'b.jsonl', 'batch', 3, 2);
            INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, model, status, total,
                created_at, expires_at) VALUES ('batch_x', 'alice', '/v1/completions', 'file-a', '24h', 'm',
                'in_progress', 1, 1, {int(time.time()) + 3600});
            INSERT INTO results VALUES ('batch_x', 1, 'c', 'r', 200, x'7b7d');""")
    for name in ("file-a", "file-b"):
        (root / "files" / name).write_bytes(name.encode())
    old = Store(root)
    assert current(old.engine) == head()
    assert [f["id"] for f in old.files("alice", None, None, 10, False)] == ["file-a", "file-b"]  # as they were made
    assert old.file("file-a", "alice")["expires_at"] is None
    new = Store(url=fresh_url)
    assert copy_store(old, new) == {"files": 2, "batches": 1, "results": 1}
    assert [f["id"] for f in new.files("alice", None, None, 10, False)] == ["file-a", "file-b"]
    assert b"".join(new.read_chunks("file-b")) == b"file-b"
    assert new.batch("batch_x")["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert new.active() == ["batch_x"] and new.claim("batch_x", "runner", 30, parallel=1)


def test_gateways_opening_a_new_database_together_migrate_it_once(fresh_url, monkeypatch):
    upgrades = []
    real = store_module.upgrade
    monkeypatch.setattr(store_module, "upgrade", lambda engine, **kw: upgrades.append(1) or real(engine, **kw))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: Store(url=fresh_url), range(4)))
    assert len(upgrades) == 4 and {current(s.engine) for s in stores} == {head()}
    with stores[0].engine.connect() as db:
        assert db.execute(sa.text("SELECT count(*) FROM alembic_version")).scalar() == 1


def test_a_gateway_started_before_its_database_serves_and_its_batch_api_waits_for_it(tmp_path):
    """A real gateway whose PostgreSQL (password asked, the password in a file, the URL holding none) is not up yet
    starts and answers what needs no store; the Files API answers 503 with Retry-After, which the openai SDK reads as
    a server error to retry, and works once the database starts (the SDK retrying as it does)."""
    import openai

    from serve.stack import start_gateway

    server = Postgres(password="not-in-any-url")
    secret = tmp_path / "store-password"
    secret.write_text("not-in-any-url\n")
    env = {"RTXSERVE_BATCH_STORE_URL": f"postgresql://rtx@127.0.0.1:{server.port}/postgres",
           "RTXSERVE_BATCH_STORE_PASSWORD_FILE": str(secret)}
    gateway, url = start_gateway("", tmp_path / "gateway", extra_env=env, wait_for="/healthz")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=30)
    try:
        assert client.models.list().data == []
        with pytest.raises(openai.InternalServerError) as refused:
            client.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "5"
        assert refused.value.body["code"] == "store_unavailable"
        server.start()
        # the SDK's own retries, which wait the Retry-After (a failed open stands for a second after it failed)
        made = client.with_options(max_retries=2).files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'),
                                                               purpose="batch")
        assert client.files.content(made.id).content == b'{"custom_id": "a"}\n'
    finally:
        gateway.stop()
        server.stop()
    assert "not-in-any-url" not in (tmp_path / "gateway" / "gateway.log").read_text()
