"""R16: schemathesis fuzzes the gateway's own OpenAPI description with every check it has, against the real
gateway in front of the real tritonserver and vLLM."""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from serve.gateway.access.keys_cli import main as keys_main
from serve.stack import start_gateway

# Valid-by-schema requests for models that do not exist are 404 and the gateway's limits are 400: both are
# the documented answers, not failures to accept valid data.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404", "413"]
"""


@pytest.fixture(scope="module")
def both(stack, llm_servers, tmp_path_factory):
    """(gateway URL, its folder, an admin key): keyed, so that the admin routes are fuzzed past their key check too."""
    logs = tmp_path_factory.mktemp("fuzz")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert keys_main(["--keys", str(logs / "keys.json"), "create", "--name", "fuzz", "--admin"]) == 0
    gateway, url = start_gateway(stack.triton_grpc_url, logs, vllm_url=llm_servers[1],
                                 extra_env={"RTXSERVE_KEYS_FILE": str(logs / "keys.json")})
    yield url, logs, out.getvalue().strip()
    gateway.stop()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(both):
    url, logs, key = both
    config = logs / "schemathesis.toml"
    config.write_text(CONFIG)
    st = Path(sys.executable).with_name("st")
    run = subprocess.run([str(st), "--config-file", str(config), "run", f"{url}/openapi.json", "--checks", "all",
                          "--header", f"Authorization: Bearer {key}", "--max-examples", "25", "--seed", "1",
                          "--report", "junit", "--report-dir", str(logs), "--no-color"],
                         capture_output=True, text=True, timeout=900)
    summary = run.stdout[-6000:]
    print(summary)
    assert run.returncode == 0, summary
