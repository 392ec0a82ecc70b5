"""Start a server process, wait until it answers ready, stop it: used by the CLI, the demo and tests.

Fails fast with the tail of the process log if the process dies before it is ready.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """A server did not become ready; the message carries the end of its log (for its operator), `cause` the last
    exception its log raised in a line, with file paths cut to their last part (for an HTTP client: R15)."""

    def __init__(self, message: str, cause: str = "", returncode: int | None = None):
        super().__init__(message)
        self.cause = cause or "it did not become ready"
        self.returncode = returncode  # None: it was stopped for not becoming ready in time

    @property
    def crashed(self) -> bool:
        """It was killed by a signal while starting (an abort, a segfault: the server's own fault, not its
        configuration's), which a restart policy answers by starting it again."""
        return self.returncode is not None and self.returncode < 0


CRASH_STARTS = 3  # a server killed by a signal while starting is started up to this many times


def starts_under(restart: str) -> int:
    """How many starts a server's `restart` policy gives it (the deployment file's: on-failure, or none)."""
    return CRASH_STARTS if restart == "on-failure" else 1


def crash_restarts(name: str, log=lambda message: None, starts: int = CRASH_STARTS):
    """The attempts at starting one server (tenacity's): one that crashes while starting (Triton's python backend can
    abort as it loads, triton-inference-server/server#8882) is started again, as Docker's and systemd's on-failure
    policies would, up to `starts` starts; one that exits with an error code (its configuration's fault) or is not
    ready in time is not."""
    import tenacity

    def again(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception()
        log(f"{name} crashed while starting (exit code {exc.returncode}); starting it again "
            f"({state.attempt_number} of {starts - 1})")

    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(starts), wait=tenacity.wait_fixed(2),
        retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, ServerStartError) and exc.crashed),
        before_sleep=again, reraise=True)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?[\w.]*(?:Error|Exception): \S")


_PATH = re.compile(r"(?<![\w.])(?:/[^\s/'\"]+)+/([^\s/'\"]+)")


def start_cause(path: Path) -> str:
    """The last exception a server's log raised, one line, its paths cut to their last part (`config.json`, not
    where the model lies): what a client may read of why a server did not start."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    raised = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    if not raised:
        return ""
    line = re.sub(r"^(?:\(\w+ pid=\d+\) )?(?:[\w.]*\.(?=\w+(?:Error|Exception): ))?", "", lines[raised[-1]]).strip()
    detail = lines[raised[-1] + 1] if raised[-1] + 1 < len(lines) else ""
    if detail.startswith("  ") and not detail.lstrip().startswith("File "):  # pydantic's: the error under its title
        line += ": " + re.sub(r" \[type=.*$", "", detail.strip())
    line = _PATH.sub(r"\1", line)
    return line if len(line) <= 400 else line[:line.rfind(". ", 0, 400) + 1 or 400]  # whole sentences where it can


def log_tail(path: Path, lines: int = 40) -> str:
    """The log's last `lines`, after the exceptions raised anywhere in it: a server of several processes (vLLM's API
    server and engine core) fails in one and ends its log with the other's traceback ("See root cause above")."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    tail = text[-lines:]
    raised = [line for line in dict.fromkeys(text[:-lines]) if _EXCEPTION_LINE.match(line)]
    return "\n".join([*(["exceptions earlier in the log:", *raised[:5], "..."] if raised else []), *tail])


class ServerProcess:
    """One server child process with its own log file and process group."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        *,
        ready_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        own_group: bool = True,
    ):
        self.name, self.command, self.ready_url = name, list(command), ready_url
        self.log_path, self.env, self.cwd = Path(log_path), dict(env or os.environ), cwd
        # own_group: a process group of its own, which stop() signals whole; else it stays in its parent's group, where
        # whoever stops the parent's group (serve down) reaches it too, and stop() signals the process alone
        self.own_group = own_group
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> "ServerProcess":
        """Start the process and block until `ready_url` answers 200 (or raise ServerStartError)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=self.own_group,  # own group: stop() reaches its children
            )
        deadline, last = time.monotonic() + timeout_s, "nothing answered"
        with httpx.Client(timeout=2.0) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    self._stop_leftovers()
                    raise ServerStartError(
                        f"{self.name} exited with code {code} before it was ready; end of {self.log_path}:\n"
                        + log_tail(self.log_path), start_cause(self.log_path) or f"it exited with code {code}", code
                    )
                try:
                    answer = client.get(self.ready_url)
                    if answer.status_code == 200:
                        return self
                    last = f"HTTP {answer.status_code}: {answer.text[:500]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(
                        f"{self.name} was not ready after {timeout_s:.0f}s ({self.ready_url} last said {last}); end of "
                        f"{self.log_path}:\n" + log_tail(self.log_path), f"it was not ready after {timeout_s:.0f} s"
                    )
                time.sleep(0.25)

    def _stop_leftovers(self) -> None:
        """What a server that exited leaves of its own group (Triton's python stubs, vLLM's engine core) goes too."""
        if self.own_group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.running:
            if self.own_group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, wait up to `grace_s`, then SIGKILL. Returns the exit code."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
