"""A real PostgreSQL server for the tests (Debian's `postgresql` package, `make setup-postgres`): a cluster of its own
made with initdb in a temporary folder, on a free loopback port, trusting local connections, stopped and deleted
after. PostgreSQL refuses to run as root: run as root (CI), the server runs as Debian's `postgres` user."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from serve.launcher import free_port

BINDIRS = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
INSTALLED = bool(BINDIRS)
WHY_NOT = "PostgreSQL is not installed (`make setup-postgres`: Debian's postgresql package)"


def _reachable_temp() -> str:
    """The temp folder, where every folder above it lets others in (run as root, the server runs as the postgres user);
    else /tmp (a TMPDIR made with `mktemp -d` is root's alone: initdb could not reach its data folder in it)."""
    folder = Path(tempfile.gettempdir()).resolve()
    if os.geteuid() != 0 or all(p.stat().st_mode & 0o001 for p in (folder, *folder.parents)):
        return str(folder)
    return "/tmp"


class Postgres:
    def __init__(self, password: str | None = None):
        """`password`: the user rtx's, asked of every connection (SCRAM); without one, any connection is trusted."""
        self.bindir = Path(BINDIRS[-1])
        self.port = free_port()
        # not under pytest's root-only tmp, nor under any folder the postgres user cannot enter
        self.folder = Path(tempfile.mkdtemp(prefix="rtxserve-postgres-", dir=_reachable_temp()))
        self.data = self.folder / "data"
        self.password = password
        self.url = f"postgresql+psycopg://rtx@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*as_user, *argv], capture_output=True, text=True, timeout=120, cwd=self.folder)
        assert done.returncode == 0, f"{argv[0]}: {done.stdout[-2000:]}{done.stderr[-2000:]}"

    def start(self) -> "Postgres":
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
        auth = ["--auth=trust"]
        if self.password is not None:
            pwfile = self.folder / "pwfile"
            pwfile.write_text(self.password + "\n")
            if os.geteuid() == 0:
                shutil.chown(pwfile, "postgres", "postgres")
            auth = ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "rtx", *auth, "-E", "UTF8")
        # fsync off: a test cluster lost with the machine is lost anyway; the socket in the cluster's own folder
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.folder} -c fsync=off"
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.folder / "log"),
                  "-w", "-t", "60", "start")
        return self

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
