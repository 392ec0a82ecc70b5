"""`rtxserve promote` on a real tritonserver behind a real gateway (two workers, keys, a rollout file): the classifier
fixture's second fine-tune put in front of the first under a real locust load with no request failed; candidates whose
label map or tokenizer entry is wrong stopped by the eval gate before any client sees them; one made slow on purpose
taken back at its first canary step with no request failed; a gateway killed in the middle serving one whole state
when it comes back; and a second promotion of a name refused while one runs."""

import contextlib
import io
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from export.encoders.encoder import export_text_classification
from export.triton.entry import EntryOptions
from fixture_models.text import write_text_classifier_v2
from loadtest.runner import LoadSpec, run, scenario_options
from serve.entry_config import read_config, write_config
from serve.gateway.access.keys_cli import main as keys_main
from serve.stack import start_gateway, start_triton
from tests.conftest import built_once

from . import until

V1, V2, SLOW, SHUFFLED, BAD_TOKENIZER = "reviews", "reviews-v2", "reviews-slow", "reviews-shuffled", "reviews-badtok"
# Short steps; and a latency bound set by what the tests tell apart: the slow candidate's 1.5 s from the noise of two
# shared cores under load (the default, 2x + 10 ms, is for a box that serves: here one 4-second window's P99 of the same
# model read 2.4x another's, and in CI a good candidate's P90 over 7 requests read 575 ms against the current's 45 while
# the other test worker rendered images). 2x the current's + 750 ms passes the one and refuses the other as long as the
# current's own P90 stays under 375 ms.
FAST = ["--shadow-seconds", "3", "--step-seconds", "3", "--rollback-window", "3", "--canary", "25,50",
        "--min-requests", "5", "--lease-seconds", "10", "--latency-margin", "1", "--latency-floor-ms", "750"]


@pytest.fixture(scope="module")
def triton(classifier_checkpoint, tmp_path_factory):
    """Triton serving v1, v2 and three broken candidates: v2 made slow (each of its three steps waits 0.5 s for a batch),
    v1 with its postprocess step's label map shuffled, v1 with its tokenizer step's normaliser gone."""
    work = tmp_path_factory.mktemp("promote")
    v2 = built_once(tmp_path_factory, "text-classifier-v2", lambda out: write_text_classifier_v2(classifier_checkpoint, out))
    repo = work / "repo"
    for name, checkpoint, options in ((V1, classifier_checkpoint, {}), (V2, v2, {}),
                                      (SLOW, v2, {"max_queue_delay_us": 500_000}),
                                      (SHUFFLED, classifier_checkpoint, {}), (BAD_TOKENIZER, classifier_checkpoint, {})):
        export_text_classification(checkpoint, EntryOptions(name=name, **options), repo)
    post = repo / f"{SHUFFLED}_postprocess" / "config.pbtxt"
    config = read_config(post)
    labels = json.loads(config.parameters["labels"].string_value)
    config.parameters["labels"].string_value = json.dumps(labels[1:] + labels[:1])
    write_config(post, config)
    tokenizer = repo / f"{BAD_TOKENIZER}_tokenizer" / "1" / "tokenizer.json"
    data = json.loads(tokenizer.read_text())
    assert data["normalizer"] is not None  # the fixture's lower-cases: without it, capitals are unknown words
    data["normalizer"] = None
    tokenizer.write_text(json.dumps(data))
    server, opts = start_triton(repo, work / "logs")
    yield repo, f"127.0.0.1:{opts.grpc_port}", work
    server.stop()


@pytest.fixture(scope="module")
def admin_key(triton):
    keys, out = triton[2] / "keys.json", io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert keys_main(["--keys", str(keys), "create", "--name", "ops", "--admin"]) == 0
    return keys, out.getvalue().strip()


class Gateway:
    """A gateway on the module's Triton with its own rollout file, which it can be killed and started again on."""

    def __init__(self, triton, admin_key, folder):
        self.repo, self.grpc, (self.keys, self.key), self.folder = triton[0], triton[1], admin_key, folder
        self.rollout = folder / "rollout.json"
        self.process, self.url = None, ""

    def start(self):
        self.process, self.url = start_gateway(self.grpc, self.folder, workers=2, extra_env={
            "RTXSERVE_KEYS_FILE": str(self.keys), "RTXSERVE_ROLLOUT_FILE": str(self.rollout)})
        return self

    def kill(self):
        self.process.signal(signal.SIGKILL)  # its whole process group: nothing of the gateway runs after it
        self.process.wait()

    @property
    def headers(self):
        return {"Authorization": f"Bearer {self.key}"}

    def get(self, path):
        return httpx.get(self.url + path, headers=self.headers, timeout=30).json()

    def post(self, path, body):
        return httpx.post(self.url + path, json=body, headers=self.headers, timeout=60)

    def ended(self) -> dict:
        """The promotion that ended last, once the worker asked has it: each reads the rollout file within a second of
        the worker that ended it."""
        seen = []
        until(lambda: seen.extend(self.get("/admin/promotions")["history"]) or seen, "a promotion in the history",
              limit_s=10)
        return seen[-1]

    def answering(self, model=V1) -> str:
        r = self.post("/v1/classify", {"model": model, "input": "I love this product, it works perfectly."})
        assert r.status_code == 200, r.text
        return r.json()["model"]


@pytest.fixture
def gateway(triton, admin_key, tmp_path):
    g = Gateway(triton, admin_key, tmp_path).start()
    yield g
    g.process.stop()


def promote(gateway, candidate, *extra):
    """The real `rtxserve promote` CLI against the gateway."""
    repo = gateway.repo
    return subprocess.run([sys.executable, "-m", "rtxserve.cli", "promote", gateway.url, "--model", V1, "--to", candidate,
                           "--api-key", gateway.key, "--candidate-reference", str(repo / candidate),
                           "--current-reference", str(repo / V1), "--out", str(gateway.folder / "report"), *FAST,
                           *extra], capture_output=True, text=True, timeout=300)


def under_load(gateway, seconds, body):
    """Run `body()` while a real locust sends classify requests for V1 open loop at 10 req/s (light: the other test
    worker starts servers beside it), for at least `seconds` and until `body` has returned (on a busy box a promotion
    can outlast any fixed span); the load's summary and what `body` returned."""
    options = scenario_options(scenario="classify", model=V1, api_key=gateway.key, arrival="poisson", rate=10.0)
    done, ended, started = {}, threading.Event(), time.monotonic()
    thread = threading.Thread(target=lambda: done.setdefault("summary", run(
        LoadSpec(gateway.url, options, users=4, duration_s=600, warmup_s=0), gateway.folder / "load",
        log=lambda *_: None,
        stop_early=lambda row: "done" if ended.is_set() and time.monotonic() - started >= seconds else "").summary))
    thread.start()
    try:
        result = body()
    finally:
        ended.set()
        thread.join()
    return done["summary"], result


def test_a_second_fine_tune_is_promoted_under_load_with_no_request_failed(gateway):
    summary, done = under_load(gateway, 25, lambda: promote(gateway, V2))
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary.requests > 150 and summary.errors == 0, summary.error_kinds
    assert summary.by_model[V1]["requests"] > 0 and summary.by_model[V2]["requests"] > 0  # both answered, in turn
    report = json.loads((gateway.folder / "report" / "promote.json").read_text())
    assert [s["name"] for s in report["steps"]] == ["load", "eval", "shadow", "canary 25 %", "canary 50 %", "switch"]
    assert all(s["passed"] for s in report["steps"]) and report["result"] == "promoted"
    shadow = report["steps"][2]["figures"]["shadow"]
    assert shadow["requests"] > 0 and shadow["outcomes"].get("error", 0) == 0
    # the name now answers with v2, everywhere and after a restart: the file every worker reads says so
    assert {gateway.answering() for _ in range(8)} == {V2}
    state = gateway.get("/admin/promotions")
    assert state["routes"] == {V1: {V2: 100}} and state["retired"] == [V1] and state["promotions"] == []
    listed = {m["id"]: m for m in gateway.get("/v1/models")["data"]}
    assert listed[V1]["alias_of"] == {V2: 100} and listed[V1]["backend"] == "alias"
    gateway.process.stop()
    gateway.start()
    assert gateway.answering() == V2


@pytest.mark.parametrize("candidate, why", [(SHUFFLED, "agreement 0 ("), (BAD_TOKENIZER, "max |Δlogit|")])
def test_a_candidate_that_does_not_answer_as_trained_is_stopped_by_the_eval_gate(gateway, candidate, why):
    summary, done = under_load(gateway, 6, lambda: promote(gateway, candidate))
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((gateway.folder / "report" / "promote.json").read_text())
    assert [(s["name"], s["passed"]) for s in report["steps"]] == [("load", True), ("eval", False)]
    assert report["result"] == "rolled back" and "the eval gate" in report["reason"]
    assert why in report["evals"]["candidate"]["verdict"]
    assert report["evals"]["current"]["passed"]  # the model serving it answers as it was trained
    assert summary.errors == 0 and set(summary.by_model or {V1: 0}) == {V1}  # no client ever saw the candidate
    assert gateway.get("/admin/promotions")["routes"] == {}


def test_a_candidate_made_slow_is_taken_back_at_its_first_canary_step_with_no_request_failed(gateway):
    # its eval gate takes 6 inputs x 1.5 s, then the canary's first step: within the load's 25 s
    summary, done = under_load(gateway, 25, lambda: promote(gateway, SLOW, "--shadow-share", "0"))
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((gateway.folder / "report" / "promote.json").read_text())
    assert [(s["name"], s["passed"]) for s in report["steps"]] == [("load", True), ("eval", True),
                                                                    ("canary 25 %", False)]
    breach = report["steps"][2]
    # a step of 3 s at 10 req/s holds under 100 requests of each model: its tail is their P90
    assert "P90" in breach["detail"] and breach["figures"]["candidate"]["p90_ms"] > 1000  # 0.5 s a step
    assert summary.errors == 0 and summary.by_model[SLOW]["requests"] > 0  # clients met it, and all were answered
    # the worker asked may be the one that follows the other's rollback from the rollout file, within a second
    until(lambda: gateway.get("/admin/promotions")["routes"] == {}, "the rollback's routes in both workers", limit_s=10)
    assert gateway.answering() == V1
    ended = gateway.ended()
    assert ended["phase"] == "rolled_back" and "P90" in ended["reason"]


@pytest.mark.parametrize("killed_at, serving", [("canary", V1), ("switched", V2)])
def test_a_gateway_killed_mid_promotion_comes_back_serving_one_whole_state(gateway, killed_at, serving):
    begun = gateway.post("/admin/promotions", {"model": V1, "candidate": V2, "lease_s": 600})
    assert begun.status_code == 201, begun.text
    pid = begun.json()["id"]
    step = httpx.patch(f"{gateway.url}/admin/promotions/{V1}", json={"id": pid, "phase": killed_at, "weight": 50,
                                                                     "lease_s": 600}, headers=gateway.headers, timeout=30)
    assert step.status_code == 200, step.text
    during = {V1, V2} if killed_at == "canary" else {V2}  # half-switched while it runs, or switched
    until(lambda: {gateway.answering() for _ in range(20)} == during, f"both workers following the {killed_at} step",
          limit_s=10)
    gateway.kill()
    gateway.start()
    # both workers start at once and one of them ends the promotion; the other follows its file within a second
    until(lambda: gateway.get("/admin/promotions")["promotions"] == [], "the promotion ended after the restart",
          limit_s=10)
    state = gateway.get("/admin/promotions")
    assert state["promotions"] == [] and state["history"][-1]["id"] == pid
    assert state["history"][-1]["phase"] == ("rolled_back" if killed_at == "canary" else "done")
    assert "restarted" in state["history"][-1]["reason"]
    assert {gateway.answering() for _ in range(20)} == {serving}


def test_a_second_promotion_of_a_name_is_refused_while_one_runs_and_one_is_taken_back_by_hand(gateway):
    # a driver that holds its promotion for long: nothing but the second request may end it before the CLI asks (in CI
    # the gateway's second worker, ready late, once rolled it back: test_rollout's worker test holds that mended)
    first = gateway.post("/admin/promotions", {"model": V1, "candidate": V2, "lease_s": 600})
    assert first.status_code == 201, first.text
    again = gateway.post("/admin/promotions", {"model": V1, "candidate": SLOW})
    assert again.status_code == 409 and first.json()["id"] in again.json()["error"]["message"]
    cli = promote(gateway, SLOW)
    assert cli.returncode == 2 and "a promotion of reviews is running" in cli.stderr
    back = subprocess.run([sys.executable, "-m", "rtxserve.cli", "promote", gateway.url, "--model", V1, "--rollback",
                           "--api-key", gateway.key], capture_output=True, text=True, timeout=60)
    assert back.returncode == 0 and "rolled back" in back.stdout, back.stderr
    assert gateway.ended()["reason"].startswith("rolled back by hand")
