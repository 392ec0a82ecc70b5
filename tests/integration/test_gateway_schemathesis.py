"""R16: schemathesis fuzzes the gateway's own OpenAPI description with every check it has, against the real
gateway in front of the real tritonserver and vLLM."""

import subprocess
import sys
from pathlib import Path

import pytest

from serve.stack import start_gateway

# Valid-by-schema requests for models that do not exist are 404 and the gateway's limits are 400: both are
# the documented answers, not failures to accept valid data.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404", "413"]
"""


@pytest.fixture(scope="module")
def both(stack, llm_servers, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    gateway, url = start_gateway(stack.triton_grpc_url, logs, vllm_url=llm_servers[1])
    yield url, logs
    gateway.stop()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(both):
    url, logs = both
    config = logs / "schemathesis.toml"
    config.write_text(CONFIG)
    st = Path(sys.executable).with_name("st")
    run = subprocess.run([str(st), "--config-file", str(config), "run", f"{url}/openapi.json", "--checks", "all",
                          "--max-examples", "25", "--seed", "1", "--report", "junit", "--report-dir", str(logs),
                          "--no-color"], capture_output=True, text=True, timeout=900)
    summary = run.stdout[-6000:]
    print(summary)
    assert run.returncode == 0, summary
