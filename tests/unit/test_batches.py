"""The Files and Batch APIs in process, on a fake vLLM: a batch runs every line once through the gateway's own routes,
bad files are refused at creation naming the line, lines the engine refuses go to the error file, another key's
files and batches are absent, a cancelled batch accounts for every line, a restarted runner runs only what was left,
and a batch's requests carry batch priority. The real vLLM, a real restart and the openai SDK:
tests/integration/test_batches_vllm.py."""

import asyncio
import concurrent.futures
import json
import threading
import time

import orjson
import pytest
from fastapi.testclient import TestClient

from serve.gateway.access.keys_cli import main as keys_main
from serve.gateway.app import create_app
from serve.gateway.backends.base import Backend, ModelInfo
from serve.gateway.batches.store import Store, batches, results
from serve.gateway.exceptions import BackendUnavailable, InvalidRequest
from serve.gateway.settings import GatewaySettings
from tests import until

from .fakes import error_of


class EchoVLLM(Backend):
    """Answers each chat request with its last message's text; "refuse" gets the engine's 400, "busy" a 503 the
    first time, "always busy" every time, "wait" waits for `release`."""

    kind = "vllm"

    def __init__(self):
        self.bodies, self.busy_once, self.release = [], set(), None

    async def discover(self):
        return [ModelInfo("llm", "text-generation", "vllm", True), ModelInfo("other", "text-generation", "vllm", True)]

    async def generate(self, path, body, model):
        self.bodies.append(body)
        text = body["messages"][-1]["content"]
        if text == "refuse":
            raise InvalidRequest("the engine refused this request")
        if text == "always busy" or (text == "busy" and text not in self.busy_once):
            self.busy_once.add(text)
            raise BackendUnavailable("engine busy", retry_after=1)
        if text == "wait":
            await asyncio.wrap_future(self.release)
        return {"object": "chat.completion", "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text.upper()}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def line(custom_id, text, model="llm", url="/v1/chat/completions", **body):
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": text}], **body}}


def jsonl(lines) -> bytes:
    return b"".join(orjson.dumps(x) + b"\n" for x in lines)


@pytest.fixture
def backend():
    return EchoVLLM()


def gateway(backend, tmp_path, **settings):
    settings = GatewaySettings(triton_grpc_url="", batch_dir=tmp_path / "batches", health_interval_s=60, **settings)
    return TestClient(create_app(settings, [backend]), raise_server_exceptions=False)


def upload(client, data: bytes, headers=None, purpose="batch"):
    return client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": purpose}, headers=headers)


def run(client, lines, headers=None, wait=True) -> dict:
    file = upload(client, jsonl(lines), headers)
    assert file.status_code == 200, file.text
    batch = client.post("/v1/batches", json={"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"}, headers=headers)
    assert batch.status_code == 200, batch.text
    return until_ended(client, batch.json()["id"], headers) if wait else batch.json()


def until_ended(client, batch_id, headers=None, timeout_s=30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.get(f"/v1/batches/{batch_id}", headers=headers).json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch['status']} after {timeout_s} s")


def content(client, file_id, headers=None) -> list[dict]:
    answer = client.get(f"/v1/files/{file_id}/content", headers=headers)
    assert answer.status_code == 200
    return [json.loads(x) for x in answer.text.splitlines()]


def test_a_batch_runs_every_line_once_and_refusals_go_to_the_error_file(backend, tmp_path):
    lines = [line(f"req-{i}", f"hello {i}") for i in range(20)] + [line("bad", "refuse"), line("long", "x", max_tokens=10**6)]
    with gateway(backend, tmp_path) as client:
        batch = run(client, lines)
        assert batch["status"] == "completed" and batch["model"] == "llm"
        assert batch["request_counts"] == {"total": 22, "completed": 20, "failed": 2}
        output = content(client, batch["output_file_id"])
        errors = content(client, batch["error_file_id"])
        listed = client.get("/v1/batches").json()
    assert [o["custom_id"] for o in output] == [f"req-{i}" for i in range(20)]  # the input's order, each once
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    assert [o["response"]["body"]["choices"][0]["message"]["content"] for o in output] == [
        f"HELLO {i}" for i in range(20)]
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [("bad", 400), ("long", 400)]
    assert errors[0]["response"]["body"]["error"]["message"] == "the engine refused this request"
    assert "max_tokens" in errors[1]["response"]["body"]["error"]["message"]  # the gateway's bound, as live
    assert len(backend.bodies) == 21
    assert [b["id"] for b in listed["data"]] == [batch["id"]] and listed["has_more"] is False


@pytest.mark.parametrize("bad, why", [
    (b"{not json\n", "line 3: not valid JSON"),
    (orjson.dumps(line("req-0", "again")) + b"\n", "line 3: custom_id 'req-0' is used by an earlier line"),
    (orjson.dumps(line("x", "hi", url="/v1/completions")) + b"\n", "line 3: url '/v1/completions' is not the batch's"),
    (orjson.dumps(line("x", "hi", model="other")) + b"\n", "line 3: model 'other' is not the file's model 'llm'"),
    (orjson.dumps(line("x", "hi", stream=True)) + b"\n", "line 3: a batch request cannot stream"),
    (orjson.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "llm"}}) + b"\n",
     "line 3: messages: Field required"),
])
def test_a_bad_line_refuses_the_batch_at_creation_naming_it(backend, tmp_path, bad, why):
    data = jsonl([line("req-0", "a"), line("req-1", "b")]) + bad
    with gateway(backend, tmp_path) as client:
        file_id = upload(client, data).json()["id"] if not bad.startswith(b"{not") else None
        if file_id is None:  # not JSON: refused at upload already
            assert why in error_of(upload(client, data), 400)["message"]
            return
        answer = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h"})
        assert why in error_of(answer, 400)["message"]
        assert client.get("/v1/batches").json()["data"] == []
    assert backend.bodies == []


def test_uploads_are_bounded_and_batches_name_what_is_served(backend, tmp_path):
    with gateway(backend, tmp_path, batch_max_file_bytes=2048) as client:
        assert "limit of 2048 bytes" in error_of(upload(client, b"{}\n" * 1000), 413)["message"]
        assert "purpose 'fine-tune'" in error_of(upload(client, b"{}\n", purpose="fine-tune"), 400)["message"]
        assert list((tmp_path / "batches" / "files").iterdir()) == []  # nothing kept of a refused upload
        file_id = upload(client, jsonl([line("a", "x", model="nope")])).json()["id"]
        create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        assert "'nope'" in error_of(client.post("/v1/batches", json=create), 404)["message"]
        assert "/v1/embeddings" in error_of(client.post("/v1/batches", json={**create, "endpoint": "/v1/audio/x"}),
                                            400)["message"]


def test_another_keys_files_and_batches_are_absent(backend, tmp_path, capsys):
    keys = tmp_path / "keys.json"
    secrets = {}
    for name in ("alice", "bob"):
        assert keys_main(["--keys", str(keys), "create", "--name", name]) == 0
        secrets[name] = {"Authorization": f"Bearer {capsys.readouterr().out.strip()}"}
    with gateway(backend, tmp_path, keys_file=keys) as client:
        batch = run(client, [line("a", "x")], secrets["alice"])
        file_id = batch["output_file_id"]
        for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content", f"/v1/batches/{batch['id']}"):
            error_of(client.get(path, headers=secrets["bob"]), 404)
        error_of(client.post(f"/v1/batches/{batch['id']}/cancel", headers=secrets["bob"]), 404)
        error_of(client.delete(f"/v1/files/{file_id}", headers=secrets["bob"]), 404)
        assert client.get("/v1/files", headers=secrets["bob"]).json()["data"] == []
        assert client.get(f"/v1/files/{file_id}", headers=secrets["alice"]).status_code == 200
        error_of(client.get("/v1/files"), 401)


def test_a_cancelled_batch_accounts_for_every_line(backend, tmp_path):
    backend.release = concurrent.futures.Future()
    with gateway(backend, tmp_path, batch_concurrency=1) as client:
        batch = run(client, [line("first", "wait")] + [line(f"r{i}", "x") for i in range(5)], wait=False)
        until(lambda: backend.bodies, "the batch's first line reached the backend")
        cancelling = client.post(f"/v1/batches/{batch['id']}/cancel").json()
        assert cancelling["status"] == "cancelling"
        backend.release.set_result(None)
        batch = until_ended(client, batch["id"])
        output, errors = content(client, batch["output_file_id"]), content(client, batch["error_file_id"])
        again = client.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert batch["status"] == "cancelled" and again["status"] == "cancelled"
    assert [o["custom_id"] for o in output] == ["first"]  # in flight when cancelled: it finished
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"r{i}", "batch_cancelled") for i in range(5)]
    assert len(backend.bodies) == 1


def test_a_line_refused_for_load_until_its_batch_is_cancelled_is_cancelled_not_failed(backend, tmp_path):
    with gateway(backend, tmp_path, batch_concurrency=1) as client:
        batch = run(client, [line("busy", "always busy"), line("next", "x")], wait=False)
        until(lambda: backend.bodies, "the batch's first line reached the backend")
        client.post(f"/v1/batches/{batch['id']}/cancel")
        batch = until_ended(client, batch["id"])
        errors = content(client, batch["error_file_id"])
    assert batch["status"] == "cancelled" and batch["output_file_id"] is None
    assert [(e["custom_id"], e["response"], e["error"]["code"]) for e in errors] == [
        ("busy", None, "batch_cancelled"), ("next", None, "batch_cancelled")]


def test_a_restarted_runner_runs_only_the_lines_left(backend, tmp_path):
    lines = [line(f"r{i}", f"t{i}") for i in range(6)]
    with gateway(backend, tmp_path) as client:
        batch = run(client, lines)
    store = Store(tmp_path / "batches")
    batch_id = batch["id"]
    # as if the gateway died after three answers: the batch in progress, three lines answered, no output yet
    with store.engine.begin() as db:
        db.execute(results.delete().where(results.c.batch_id == batch_id, results.c.line > 3))
        db.execute(batches.update().where(batches.c.id == batch_id).values(
            status="in_progress", output_file_id=None, completed_at=None, finalizing_at=None))
    backend.bodies.clear()
    with gateway(backend, tmp_path) as client:
        batch = until_ended(client, batch_id)
        output = content(client, batch["output_file_id"])
    assert sorted(b["messages"][0]["content"] for b in backend.bodies) == ["t3", "t4", "t5"]  # (sent side by side)
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(6)]
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}


def test_batch_lines_carry_batch_priority_and_are_resent_when_the_engine_is_busy(backend, tmp_path):
    with gateway(backend, tmp_path, vllm_priority=True) as client:
        batch = run(client, [line("a", "busy"), line("b", "x")])
        live = client.post("/v1/chat/completions", json=line("c", "y")["body"])
        assert live.status_code == 200
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert sorted((b["messages"][0]["content"], b.get("priority", 0)) for b in backend.bodies) == [
        ("busy", 10), ("busy", 10), ("x", 10), ("y", 0)]  # "busy" sent again after its 503


def test_a_wrong_method_names_every_method_of_the_path(backend, tmp_path):
    """/v1/files and /v1/batches are two routes each (GET and POST): a 405 names both, as the OpenAPI document does."""
    with gateway(backend, tmp_path) as client:
        assert client.options("/v1/batches").headers["allow"] == "GET, POST"
        assert client.put("/v1/files/file-1").headers["allow"] == "DELETE, GET"


def test_the_apis_are_off_without_a_batch_dir(backend, tmp_path):
    settings = GatewaySettings(triton_grpc_url="", health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as client:
        assert "RTXSERVE_BATCH_DIR" in error_of(client.get("/v1/batches"), 404)["message"]


def test_files_expire_as_openais_do_and_the_runner_deletes_them(backend, tmp_path, monkeypatch):
    import serve.gateway.batches.store as store_module

    with gateway(backend, tmp_path) as client:
        kept = upload(client, jsonl([line("a", "hi")])).json()  # no expires_after: the gateway's 30 days
        short = client.post("/v1/files", files={"file": ("in.jsonl", jsonl([line("a", "hi")]))},
                            data={"purpose": "batch", "expires_after[anchor]": "created_at",
                                  "expires_after[seconds]": "3600"}).json()
        for bad in ({"expires_after[anchor]": "created_at"}, {"expires_after[anchor]": "last_used", "expires_after[seconds]": "3600"},
                    {"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}):
            refused = client.post("/v1/files", files={"file": ("in.jsonl", jsonl([line("a", "hi")]))},
                                  data={"purpose": "batch", **bad})
            assert error_of(refused, 400)["param"] == "expires_after"
        file = client.post("/v1/files", files={"file": ("in.jsonl", jsonl([line("a", "hi")]))}, data={"purpose": "batch"})
        batch = client.post("/v1/batches", json={"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h",
                                                 "output_expires_after": {"anchor": "created_at", "seconds": 7200}})
        done = until_ended(client, batch.json()["id"])
        output = client.get(f"/v1/files/{done['output_file_id']}").json()
        assert kept["expires_at"] == kept["created_at"] + 30 * 24 * 3600
        assert short["expires_at"] == short["created_at"] + 3600
        assert output["expires_at"] == output["created_at"] + 7200
        store = Store(tmp_path / "batches")
        real = time.time
        monkeypatch.setattr(store_module.time, "time", lambda: real() + 3601)  # an hour later
        assert client.get(f"/v1/files/{short['id']}").status_code == 404  # as absent at once
        assert short["id"] not in [f["id"] for f in client.get("/v1/files").json()["data"]]
        assert client.get(f"/v1/files/{output['id']}").status_code == 200
        assert store.expire_files() == [short["id"]] and not store.path(short["id"]).exists()
        assert store.path(kept["id"]).exists()


def test_a_database_made_before_file_expiry_gets_its_columns_and_keeps_its_files(tmp_path):
    import sqlite3

    root = tmp_path / "batches"
    root.mkdir()
    with sqlite3.connect(root / "batches.sqlite") as db:  # the first release's tables
        db.executescript("""CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL,
            purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
            INSERT INTO files VALUES ('file-old', 'alice', 'in.jsonl', 'batch', 3, 1);""")
    store = Store(root)
    assert store.file("file-old", "alice")["expires_at"] is None  # made before expiry: kept until deleted
    assert store.expire_files() == []


@pytest.mark.parametrize("parallel", [1, 2])
def test_batches_run_side_by_side_up_to_batch_parallel(backend, tmp_path, parallel, monkeypatch):
    backend.release = concurrent.futures.Future()
    with gateway(backend, tmp_path, batch_concurrency=1, batch_parallel=parallel) as client:
        store, scans = client.portal.call(client.app.state.gateway.batches.open), []
        active = store.active
        monkeypatch.setattr(store, "active", lambda: scans.append(1) or active())  # each of the runner's scans
        long = run(client, [line("first", "wait"), line("second", "x")], wait=False)  # held by its first line
        until(lambda: backend.bodies, "the batch's first line reached the backend")
        short = run(client, [line("other", "y")], wait=False)
        if parallel == 2:  # the other key's short batch does not wait for the long one
            assert until_ended(client, short["id"])["status"] == "completed"
            assert client.get(f"/v1/batches/{long['id']}").json()["status"] == "in_progress"
        else:  # one at a time: it waits, validating, behind the long one, through the runner's scans after it came
            seen = len(scans)
            until(lambda: len(scans) >= seen + 2, "two of the runner's scans after the short batch came")
            assert client.get(f"/v1/batches/{short['id']}").json()["status"] == "validating"
        backend.release.set_result(None)
        assert until_ended(client, long["id"])["status"] == until_ended(client, short["id"])["status"] == "completed"


def test_a_store_that_goes_down_answers_503_and_its_batches_finish_once_it_is_back(backend, tmp_path, caplog):
    """The database unreachable (an OperationalError from every store call, as psycopg raises with PostgreSQL down):
    the APIs answer 503 with Retry-After, the runner outlives it, and the batch made before completes after it with
    every line, none failed for the outage."""
    import sqlalchemy as sa

    down = threading.Event()
    backend.release = concurrent.futures.Future()
    with gateway(backend, tmp_path, batch_concurrency=1) as client:
        engine = client.portal.call(client.app.state.gateway.batches.open).engine

        def refuse(conn, cursor, statement, parameters, context, executemany):
            if down.is_set():
                raise sa.exc.OperationalError(statement, parameters, ConnectionRefusedError("the database is down"))

        sa.event.listen(engine, "before_cursor_execute", refuse)
        batch = run(client, [line("first", "wait"), line("second", "x")], wait=False)
        until(lambda: backend.bodies, "the batch's first line reached the backend")
        down.set()
        refused = client.get(f"/v1/batches/{batch['id']}")
        assert error_of(refused, 503)["code"] == "store_unavailable" and refused.headers["retry-after"] == "5"
        backend.release.set_result(None)  # the first line's answer cannot be recorded: the store is down
        until(lambda: f"batch {batch['id']}: the batch store is unreachable" in caplog.text,
              "the batch's runner met the outage")
        down.clear()
        done = until_ended(client, batch["id"])
        output = content(client, done["output_file_id"])
    assert done["status"] == "completed" and done["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [o["custom_id"] for o in output] == ["first", "second"]
