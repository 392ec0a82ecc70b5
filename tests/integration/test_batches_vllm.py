"""The Batch API with the `openai` SDK, through the real gateway to the real vLLM: a batch uploaded with
`files.create`, made with `batches.create`, the gateway killed (SIGKILL) in the middle of it and started again on its
batch_dir, and `files.content` then holds every line exactly once. A bad line is refused at creation
naming it; another key's batch is absent."""

import io
import json
import re
import signal
import time

import httpx
import openai
import pytest

from serve.gateway.access.keys_cli import main as keys_main
from serve.stack import start_gateway

from .conftest import LLM_MODELS

LINES = 48
TOKENS = 32
CONCURRENCY = 2


def finished_by_vllm(vllm_url: str) -> float:
    """The requests the engine has finished (vllm:request_success_total, over its finish reasons)."""
    text = httpx.get(f"{vllm_url}/metrics").text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def request_line(i: int, **body) -> dict:
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny-llama", "messages": [{"role": "user", "content": f"request number {i}"}],
                     "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, **body}}


def jsonl(lines) -> io.BytesIO:
    return io.BytesIO(b"".join(json.dumps(x).encode() + b"\n" for x in lines))


@pytest.fixture
def keys(tmp_path, capsys):
    path, secrets = tmp_path / "keys.json", {}
    for name in ("alice", "bob"):
        assert keys_main(["--keys", str(path), "create", "--name", name]) == 0
        secrets[name] = capsys.readouterr().out.strip()
    return path, secrets


def test_a_batch_survives_a_gateway_killed_in_its_middle(llm_servers, keys, tmp_path):
    _, vllm_url, _ = llm_servers
    keys_file, secrets = keys
    env = {"RTXSERVE_BATCH_DIR": str(tmp_path / "batches"), "RTXSERVE_KEYS_FILE": str(keys_file),
           "RTXSERVE_BATCH_CONCURRENCY": str(CONCURRENCY)}
    gateway, url = start_gateway("", tmp_path / "first", vllm_url=vllm_url, extra_env=env)
    try:
        alice = openai.OpenAI(base_url=f"{url}/v1", api_key=secrets["alice"], max_retries=0, timeout=60)
        bob = openai.OpenAI(base_url=f"{url}/v1", api_key=secrets["bob"], max_retries=0, timeout=60)
        bad = alice.files.create(file=("bad.jsonl", jsonl([request_line(0), request_line(1, stream=True)])),
                                 purpose="batch")
        with pytest.raises(openai.BadRequestError, match="line 2: a batch request cannot stream"):
            alice.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")

        before = finished_by_vllm(vllm_url)
        upload = alice.files.create(file=("in.jsonl", jsonl(request_line(i) for i in range(LINES))), purpose="batch",
                                    expires_after={"anchor": "created_at", "seconds": 86_400})
        assert upload.expires_at == upload.created_at + 86_400  # the SDK's form fields, as OpenAI reads them
        batch = alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                     metadata={"job": "nightly"},
                                     output_expires_after={"anchor": "created_at", "seconds": 3600})
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)
        deadline = time.monotonic() + 120
        while (done := alice.batches.retrieve(batch.id).request_counts.completed) < 4:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.05)
        gateway.signal(signal.SIGKILL)
        gateway.process.wait(30)
        assert done < LINES, "the batch ended before the gateway was killed: make it longer"

        # a port of its own: the one it had is free for any other test's server to take the moment it dies
        gateway, url = start_gateway("", tmp_path / "second", vllm_url=vllm_url, extra_env=env)
        alice = openai.OpenAI(base_url=f"{url}/v1", api_key=secrets["alice"], max_retries=0, timeout=60)
        deadline = time.monotonic() + 300
        while (batch := alice.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {batch.status} after the restart"
            time.sleep(0.2)
        output = [json.loads(x) for x in alice.files.content(batch.output_file_id).text.splitlines()]
        output_file = alice.files.retrieve(batch.output_file_id)
        sent = finished_by_vllm(vllm_url) - before
    finally:
        gateway.stop()
    assert batch.status == "completed" and batch.error_file_id is None and batch.metadata == {"job": "nightly"}
    assert output_file.expires_at == output_file.created_at + 3600
    assert (batch.request_counts.completed, batch.request_counts.failed, batch.request_counts.total) == (LINES, 0, LINES)
    assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(LINES)]  # each once, in the input's order
    # the restarted gateway sent only what had no answer yet: at most the lines in flight at the kill ran twice (and
    # it sent its start-up canaries, one per model)
    assert LINES <= sent - len(LLM_MODELS) <= LINES + CONCURRENCY, sent
    for o in output:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["model"] == "tiny-llama"
        assert body["usage"]["completion_tokens"] == TOKENS


def test_people_go_before_a_batch_that_floods_the_model(llm_servers, keys, tmp_path):
    """The model takes one request at a time (model_concurrency 1) and the batch keeps eight waiting for it. Each of
    a person's requests is served next, whatever the batch has queued: while it waits and runs, at most the one batch
    line that held the model when it came ends, where first come, first served would let all eight before it. Counted
    on the gateway's own clock, from its trace (each request's arrival and end): the batch's lines are long (128
    tokens) and the person's short, so the line that takes the model after the person ends well after it."""
    _, vllm_url, _ = llm_servers
    keys_file, secrets = keys
    env = {"RTXSERVE_BATCH_DIR": str(tmp_path / "batches"), "RTXSERVE_KEYS_FILE": str(keys_file),
           "RTXSERVE_BATCH_CONCURRENCY": "8", "RTXSERVE_MODEL_CONCURRENCY": '{"tiny-llama": 1}',
           "RTXSERVE_TRACE_DIR": str(tmp_path / "trace"),
           # a person waits for the batch line that holds the model: 128 tokens, past the default 10 s wait for a
           # slot on two AVX2 cores shared with the other test worker. Here the order is tested, not that deadline.
           "RTXSERVE_QUEUE_TIMEOUT_S": "120"}
    gateway, url = start_gateway("", tmp_path, vllm_url=vllm_url, extra_env=env)
    try:
        alice = openai.OpenAI(base_url=f"{url}/v1", api_key=secrets["alice"], max_retries=0, timeout=180)
        upload = alice.files.create(file=("in.jsonl", jsonl(request_line(i, max_tokens=128) for i in range(LINES))),
                                    purpose="batch")
        batch = alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while alice.batches.retrieve(batch.id).request_counts.completed < 2:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.05)
        for i in range(5):
            answer = alice.chat.completions.create(model="tiny-llama", max_tokens=8, extra_body={"ignore_eos": True},
                                                   messages=[{"role": "user", "content": f"a person, {i}"}])
            assert answer.usage.completion_tokens == 8
        assert alice.batches.retrieve(batch.id).status == "in_progress"
        assert alice.batches.cancel(batch.id).status == "cancelling"
        while (batch := alice.batches.retrieve(batch.id)).status != "cancelled":
            assert time.monotonic() < deadline + 60, f"the batch is still {batch.status}"
            time.sleep(0.2)
        errors = [json.loads(x) for x in alice.files.content(batch.error_file_id).text.splitlines()] \
            if batch.error_file_id else []
    finally:
        gateway.stop()  # its trace is written as it stops
    trace = [json.loads(x) for f in (tmp_path / "trace").glob("trace-*.jsonl") for x in f.read_text().splitlines()]
    chats = [t for t in trace if t["route"] == "/v1/chat/completions"]
    ends = [t["t"] + t["latency_ms"] / 1000 for t in chats if t.get("batch") and t["status"] == 200]
    people = [t for t in chats if not t.get("batch")]
    passed = [sum(p["t"] < end <= p["t"] + p["latency_ms"] / 1000 for end in ends) for p in people]
    assert len(people) == 5 and max(passed) <= 1, passed
    # cancelled: every line is in one of the two files, those never sent as batch_cancelled
    assert batch.request_counts.completed + len(errors) == LINES
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


@pytest.fixture
def postgres():
    from tests.postgres import INSTALLED, WHY_NOT, Postgres

    if not INSTALLED:
        pytest.skip(WHY_NOT)
    server = Postgres().start()
    yield server
    server.stop()


def lines_sent(url: str) -> float:
    """The batch lines this gateway's runner answered (rtxserve_batch_requests_total, over its status codes)."""
    text = httpx.get(f"{url}/metrics").text
    return sum(float(v) for v in re.findall(r"^rtxserve_batch_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def test_two_gateways_on_postgresql_share_batches_and_one_takes_over_from_the_other_killed(llm_servers, keys,
                                                                                           postgres, tmp_path):
    """Two gateway processes on one PostgreSQL store (no batch_dir: the files' bytes are in the database too): a file
    uploaded through one is read through the other, a batch made through one is cancelled through the other, and the
    gateway running a batch, killed mid-batch, is replaced by the other once its lease lapses: every line answered once,
    the survivor running exactly the lines that had no answer when the other died."""
    import sqlalchemy as sa

    _, vllm_url, _ = llm_servers
    keys_file, secrets = keys
    env = {"RTXSERVE_BATCH_STORE_URL": postgres.url, "RTXSERVE_KEYS_FILE": str(keys_file),
           "RTXSERVE_BATCH_CONCURRENCY": str(CONCURRENCY), "RTXSERVE_BATCH_LEASE_S": "3"}
    gateways = [start_gateway("", tmp_path / name, vllm_url=vllm_url, extra_env=env) for name in ("a", "b")]
    try:
        (a, url_a), (b, url_b) = gateways
        via_a, via_b = (openai.OpenAI(base_url=f"{u}/v1", api_key=secrets["alice"], max_retries=0, timeout=60)
                        for u in (url_a, url_b))
        upload = via_a.files.create(file=("in.jsonl", jsonl(request_line(i) for i in range(LINES))), purpose="batch")
        assert via_b.files.retrieve(upload.id).bytes == upload.bytes
        assert via_b.files.content(upload.id).content == b"".join(jsonl(request_line(i) for i in range(LINES)))
        stopped = via_a.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        assert via_b.batches.cancel(stopped.id).status in ("cancelling", "cancelled")
        batch = via_b.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        store = sa.create_engine(postgres.url)
        deadline = time.monotonic() + 120
        while via_a.batches.retrieve(batch.id).request_counts.completed < 4:
            assert time.monotonic() < deadline, "the batch did not start"
            time.sleep(0.05)
        with store.connect() as db:
            runner = db.execute(sa.text("SELECT runner FROM batches WHERE id = :id"), {"id": batch.id}).scalar()
        holder, survivor = (a, (b, via_b, url_b)) if f":{a.process.pid}:" in runner else (b, (a, via_a, url_a))
        _, via, url = survivor
        before = lines_sent(url)
        holder.signal(signal.SIGKILL)
        holder.process.wait(30)
        with store.connect() as db:
            answered = db.execute(sa.text("SELECT count(*) FROM results WHERE batch_id = :id"), {"id": batch.id}).scalar()
        assert answered < LINES, "the batch ended before its gateway was killed: make it longer"
        deadline = time.monotonic() + 300
        while (batch := via.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {batch.status} after its gateway died"
            time.sleep(0.2)
        output = [json.loads(x) for x in via.files.content(batch.output_file_id).text.splitlines()]
        taken_over = lines_sent(url) - before
        cancelled = via.batches.retrieve(stopped.id)
    finally:
        for gateway, _ in gateways:
            gateway.stop()
    assert cancelled.status == "cancelled"
    assert batch.status == "completed" and batch.request_counts.completed == LINES
    assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(LINES)]  # each once, in the input's order
    assert taken_over == LINES - answered
