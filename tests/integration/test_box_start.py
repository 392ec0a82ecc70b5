"""How `serve up` starts one server (serve/launcher.py `crash_restarts`, as deploy/box.py and serve/stack.py use it): a real child process that aborts
while starting, as Triton's python backend sometimes does as it loads (triton-inference-server/server#8882), is
started again under the on-failure restart policy, and leaves nothing of its process group behind; a server that
exits with an error code, or a box started with restart no, gets no second start."""

import sys
import textwrap

import psutil
import pytest
import tenacity

from serve.launcher import ServerProcess, ServerStartError, crash_restarts, free_port, starts_under

SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys
    port, marker, first = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if not os.path.exists(marker):  # the first start: a child of its group, then the way it ends
        open(marker, "w").write(str(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid))
        os.abort() if first == "abort" else sys.exit(1)
    http.server.HTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
""")


def _start(tmp_path, restart: str, first: str, logged: list[str]) -> ServerProcess:
    (tmp_path / "server.py").write_text(SERVER)
    port = free_port()
    for attempt in crash_restarts("triton", logged.append, starts_under(restart)):
        with attempt:
            process = ServerProcess("triton", [sys.executable, str(tmp_path / "server.py"), str(port),
                                               str(tmp_path / "marker"), first],
                                    ready_url=f"http://127.0.0.1:{port}/", log_path=tmp_path / "triton.log")
            process.start(timeout_s=30)
    return process


@tenacity.retry(stop=tenacity.stop_after_delay(10), wait=tenacity.wait_fixed(0.1), retry=tenacity.retry_if_result(
    lambda gone: not gone), retry_error_callback=lambda state: False)
def _child_gone(tmp_path) -> bool:
    """The first start's child is gone (or dead and not yet reaped by whoever adopted it) within 10 s of SIGKILL."""
    pid = int((tmp_path / "marker").read_text())
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_that_aborts_while_starting_is_started_again_and_its_group_goes(tmp_path):
    logged: list[str] = []
    process = _start(tmp_path, "on-failure", "abort", logged)
    try:
        assert process.running
        assert logged == ["triton crashed while starting (exit code -6); starting it again (1 of 2)"]
        assert _child_gone(tmp_path)
    finally:
        process.stop()


@pytest.mark.parametrize(("restart", "first", "code"), [("no", "abort", -6), ("on-failure", "exit", 1)])
def test_no_second_start_without_the_policy_or_after_an_exit_code(tmp_path, restart, first, code):
    logged: list[str] = []
    with pytest.raises(ServerStartError) as failed:
        _start(tmp_path, restart, first, logged)
    assert failed.value.returncode == code and failed.value.crashed == (code < 0)
    assert logged == [] and _child_gone(tmp_path)
