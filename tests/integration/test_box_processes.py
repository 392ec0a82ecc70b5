"""The box's processes and ports for real (moved out of the unit tier, which starts no process and opens no
socket): a taken port names its holder; `measure` maps NVML's per-process memory (faked: no GPU here) onto the
process groups of a running deployment; `down` stops a server's whole group even when its leader died."""

import json
import socket

import pytest

from deploy.plan import GIB, plan
from deploy.spec import DeploymentError
from deploy.load import load_deployment, parse_deployment
from tests.plan_fixtures import write_boxes


@pytest.fixture(scope="module")
def boxes(tmp_path_factory):
    return write_boxes(tmp_path_factory.mktemp("boxes"))


def test_a_taken_port_names_the_process_holding_it():
    import os

    from deploy.box import check_ports

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = parse_deployment({"name": "box", "ports": {"gateway": port}, "models": [{"name": "l", "kind": "llm", "path": "l"}]})
        with pytest.raises(DeploymentError, match=f"ports.gateway: port {port} is taken by pid {os.getpid()} "):
            check_ports(d)


def test_measure_sets_each_servers_nvml_memory_beside_its_plan(boxes, tmp_path):
    """NVML faked (no GPU here): pids of a running deployment's process groups, with their memory per GPU."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    from deploy.measure import format_measured, measure

    d = load_deployment(boxes[0])
    p = plan(d)
    # stand-ins for the two servers: process-group leaders with a child each, as tritonserver and vLLM have
    leaders = [subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                                start_new_session=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while any(not psutil.Process(pr.pid).children() for pr in leaders) and time.monotonic() < deadline:
            time.sleep(0.05)
        children = [psutil.Process(pr.pid).children()[0].pid for pr in leaders]
        state = {"name": "one-4090", "servers": [
            {"name": n, "kind": n.split("-")[0], "pid": pr.pid, "started": psutil.Process(pr.pid).create_time(), "url": ""}
            for n, pr in zip(["triton", "vllm-llama-3-8b-0"], leaders)]}
        (tmp_path / "state.json").write_text(json.dumps(state))
        usage = {0: {leaders[0].pid: int(1.0 * GIB), children[0]: int(1.9 * GIB),  # Triton: server + a stub
                     children[1]: int(20.0 * GIB), os.getpid(): 5 * GIB}}  # vLLM's worker; and a stranger
        rows = {r.server: r for r in measure(p, tmp_path, usage)}
    finally:
        for pr in leaders:
            os.killpg(pr.pid, 9)
    assert set(rows) == {"triton", "vllm-llama-3-8b-0"}  # the stranger's memory is nobody's
    assert rows["triton"].measured_gib == pytest.approx(2.9) and rows["triton"].planned_gib == pytest.approx(0.75 + 4 * 0.483, abs=0.01)
    # its share of the card's total, and its CUDA context beside it
    assert rows["vllm-llama-3-8b-0"].planned_gib == pytest.approx(0.84 * 23.64 + 0.6)
    assert rows["vllm-llama-3-8b-0"].error == pytest.approx((0.84 * 23.64 + 0.6 - 20) / 20)
    assert format_measured(list(rows.values())).endswith("2 of 2 within 10 %")  # -7.6 % and +3.2 %


def test_down_stops_a_servers_group_even_when_its_leader_died(tmp_path):
    """vLLM's engine core or Triton's stubs can outlive the process `serve up` started: down still stops them."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    from deploy.box import down

    from deploy.box_state import status

    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"],
                              start_new_session=True)
    deadline = time.monotonic() + 10
    while not psutil.Process(leader.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = psutil.Process(leader.pid).children()[0]
    state = {"name": "box", "servers": [{"name": "vllm-x-0", "kind": "vllm", "pid": leader.pid,
                                         "started": psutil.Process(leader.pid).create_time(), "url": "http://127.0.0.1:9/health"}]}
    (tmp_path / "state.json").write_text(json.dumps(state))
    os.kill(leader.pid, 9)
    leader.wait()
    assert child.is_running() and status(tmp_path)[0]["alive"] is False and status(tmp_path)[0]["processes"] == 1
    assert down(tmp_path, grace_s=5, log=lambda m: None) == []
    assert not child.is_running() and not (tmp_path / "state.json").exists()
