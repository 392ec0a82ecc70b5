"""API keys: the keys CLI, 401 / 403 at the gateway, per-key model lists, revocation mid-run, no key
in any file, log or error body, and no open gateway beyond loopback."""

import json
import logging

import pytest
from fastapi.testclient import TestClient

from serve.cli import main as serve_main
from serve.gateway.access.keys import read_keys
from serve.gateway.access.keys_cli import main as keys_main
from serve.gateway.app import create_app
from serve.gateway.settings import GatewaySettings

from .fakes import error_of


def make_key(path, capsys, *args) -> str:
    assert keys_main(["--keys", str(path), "create", *args]) == 0
    return capsys.readouterr().out.strip()


@pytest.fixture
def keyfile(tmp_path, capsys):
    path = tmp_path / "keys.json"
    secrets = {"clf-only": make_key(path, capsys, "--name", "clf-only", "--models", "clf"),
               "admin": make_key(path, capsys, "--name", "admin", "--admin", "--models", "")}
    return path, secrets


@pytest.fixture
def gateway(backend, keyfile):
    settings = GatewaySettings(keys_file=keyfile[0], health_interval_s=60)
    with TestClient(create_app(settings, [backend]), raise_server_exceptions=False) as c:
        yield c


def bearer(secret):
    return {"Authorization": f"Bearer {secret}"}


def test_the_file_holds_hashes_only_and_list_shows_no_secret(keyfile, capsys):
    path, secrets = keyfile
    text = path.read_text()
    assert all(s.startswith("rtx-") and s not in text for s in secrets.values())
    assert {k["name"]: k["models"] for k in json.loads(text)["keys"]} == {"clf-only": ["clf"], "admin": ["*"]}
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert keys_main(["--keys", str(path), "list"]) == 0
    out = capsys.readouterr().out
    assert "clf-only" in out and not any(s in out for s in secrets.values())


def test_missing_and_wrong_keys_are_401_and_never_echoed(gateway, keyfile, caplog):
    body = {"model": "clf", "input": "good"}
    missing = gateway.post("/v1/classify", json=body)
    assert "Authorization: Bearer" in error_of(missing, 401)["message"]
    assert missing.headers["www-authenticate"] == "Bearer"
    with caplog.at_level(logging.DEBUG):
        wrong = gateway.post("/v1/classify", json=body, headers=bearer("rtx-not-a-real-key-123"))
    assert error_of(wrong, 401)["code"] == "invalid_api_key"
    assert "rtx-not-a-real-key-123" not in wrong.text + caplog.text
    assert error_of(gateway.get("/v1/models"), 401)


def test_a_key_uses_only_its_models_and_lists_only_them(gateway, keyfile):
    secrets = keyfile[1]
    ok = gateway.post("/v1/classify", json={"model": "clf", "input": "good"}, headers=bearer(secrets["clf-only"]))
    assert ok.status_code == 200 and ok.json()["data"][0]["label"] == "pos"
    denied = gateway.post("/v1/embeddings", json={"model": "emb", "input": "x"}, headers=bearer(secrets["clf-only"]))
    assert error_of(denied, 403)["param"] == "model"
    unknown = gateway.post("/v1/embeddings", json={"model": "secret-model", "input": "x"}, headers=bearer(secrets["clf-only"]))
    error_of(unknown, 403)  # no probing for which models exist
    listed = gateway.get("/v1/models", headers=bearer(secrets["clf-only"])).json()["data"]
    assert [m["id"] for m in listed] == ["clf"]
    assert len(gateway.get("/v1/models", headers=bearer(secrets["admin"])).json()["data"]) == 4


def test_a_key_may_name_its_models_by_pattern(gateway, keyfile, capsys):
    """`support-*`-style scopes: a team's models that appear later are its own without a new key."""
    team = make_key(keyfile[0], capsys, "--name", "team", "--models", "cl?,x-*")
    listed = gateway.get("/v1/models", headers=bearer(team)).json()["data"]
    assert [m["id"] for m in listed] == ["clf"]
    assert gateway.post("/v1/classify", json={"model": "clf", "input": "good"}, headers=bearer(team)).status_code == 200
    error_of(gateway.post("/v1/embeddings", json={"model": "emb", "input": "x"}, headers=bearer(team)), 403)
    key = read_keys(keyfile[0])["team"]
    assert key.allows("x-new-adapter") and not key.allows("X-new") and not key.allows("clfx")


def test_a_key_revoked_mid_run_fails_on_its_next_request(gateway, keyfile, capsys):
    path, secrets = keyfile
    body, auth = {"model": "clf", "input": "good"}, bearer(secrets["clf-only"])
    assert gateway.post("/v1/classify", json=body, headers=auth).status_code == 200
    assert keys_main(["--keys", str(path), "revoke", "clf-only"]) == 0
    error_of(gateway.post("/v1/classify", json=body, headers=auth), 401)
    assert gateway.post("/v1/classify", json=body, headers=bearer(secrets["admin"])).status_code == 200


def test_probes_and_metrics_stay_open(gateway):
    for path in ("/healthz", "/health", "/metrics"):
        assert gateway.get(path).status_code == 200


def test_a_damaged_keys_file_stops_the_gateway_in_one_line(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "keys.json"
    bad.write_text('{"keys": [{"name": "a"')
    monkeypatch.delenv("RTXSERVE_CONFIG", raising=False)
    monkeypatch.setenv("RTXSERVE_KEYS_FILE", str(bad))  # the CLI sets it for its workers; restored after the test
    assert serve_main(["gateway", "--keys", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "damaged" in err


def test_no_open_gateway_beyond_loopback(tmp_path, keyfile):
    with pytest.raises(ValueError, match="not loopback and no keys_file"):
        GatewaySettings(host="0.0.0.0")
    assert GatewaySettings(host="0.0.0.0", keys_file=keyfile[0]).host == "0.0.0.0"
    assert GatewaySettings(host="::1").keys_file is None


@pytest.mark.parametrize("where", ["before", "after"])
def test_the_keys_file_is_taken_before_or_after_the_subcommand(tmp_path, capsys, monkeypatch, where):
    monkeypatch.chdir(tmp_path)  # a default keys.json here would hide a --keys that was dropped
    path = tmp_path / "team" / "keys.json"
    path.parent.mkdir()
    for command in (["create", "--name", "me"], ["list"], ["revoke", "me"]):
        argv = ["--keys", str(path), *command] if where == "before" else [*command, "--keys", str(path)]
        assert keys_main(argv) == 0
        out = capsys.readouterr().out.splitlines()
        if command[0] == "create":
            assert "me" in read_keys(path)
        if command[0] == "list":
            assert out[-1].startswith("me ")
    assert read_keys(path) == {} and not (tmp_path / "keys.json").exists()


def test_an_x_api_key_header_is_a_key_as_anthropics_clients_send_it(gateway, keyfile):
    """On the hot path (classify) and on FastAPI's routes (models) alike; Bearer wins when both are sent."""
    _, secrets = keyfile
    body = {"model": "clf", "input": "good"}
    assert gateway.post("/v1/classify", json=body, headers={"x-api-key": secrets["clf-only"]}).status_code == 200
    assert gateway.get("/v1/models", headers={"x-api-key": secrets["admin"]}).status_code == 200
    error_of(gateway.post("/v1/classify", json=body, headers={"x-api-key": "rtx-not-a-real-key-123"}), 401)
    both = {"x-api-key": secrets["clf-only"], **bearer("rtx-not-a-real-key-123")}
    error_of(gateway.post("/v1/classify", json=body, headers=both), 401)
