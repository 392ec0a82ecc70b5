"""API keys: a keys file holding only hashes, and the gateway's live view of it.

A key is `rtx-` + 32 random bytes (urlsafe base64), shown once when it is made. The file stores its
SHA-256 (a fast hash is right for a high-entropy token; passwords would need a slow one), the models
it may use (names, or shell-style patterns such as `support-*`, so that a team's new adapters are its own without a
new key), whether it is an admin key, and its per-minute quotas. The gateway compares a presented
key against every stored hash with `hmac.compare_digest`, so the time taken does not depend on how
much of a key matched, and rereads the file when it changes, so a revoked key fails on its next request.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger("rtxserve.gateway.keys")
PREFIX = "rtx-"
PRIORITIES = {"interactive": 0, "batch": 10}  # lower is served first when requests wait


class KeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and what is wrong, on one line."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    hash: str
    models: tuple[str, ...] = ("*",)  # names or shell-style patterns; "*": every model
    admin: bool = False
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (prompt + completion, as the backend counts them)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    # its requests' place in the queues when the gateway is full: lower first (vLLM's convention); "interactive" 0,
    # "batch" 10 (PRIORITIES), or any whole number
    priority: int = 0

    def __post_init__(self):
        if not self.name or not self.hash.startswith("sha256:"):
            raise ValueError("every key needs a name and a sha256 hash")
        if isinstance(self.priority, str):  # the named priorities, as the keys file and the CLI may give them
            if self.priority not in PRIORITIES:
                raise ValueError(f"key {self.name}: priority {self.priority!r} is none of {', '.join(PRIORITIES)} "
                                 "and not a whole number")
            object.__setattr__(self, "priority", PRIORITIES[self.priority])
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise ValueError(f"key {self.name}: priority is a whole number or one of {', '.join(PRIORITIES)}")
        for quota in (self.rpm, self.tpm):
            if quota is not None and (not isinstance(quota, int) or quota < 1):
                raise ValueError(f"key {self.name}: quotas are positive integers")

    @functools.cached_property
    def _patterns(self) -> tuple[str, ...]:
        return tuple(m for m in self.models if any(c in m for c in "*?["))

    @functools.cached_property
    def scope(self) -> tuple[str, ...]:
        """The models it may use, in one canonical form: keys of equal scope may share what the answer cache keeps."""
        return ("*",) if self.admin or "*" in self.models else tuple(sorted(set(self.models)))

    def allows(self, model: str) -> bool:
        return self.admin or "*" in self.models or model in self.models or any(fnmatch.fnmatchcase(model, p) for p in self._patterns)


def new_secret() -> str:
    return PREFIX + secrets.token_urlsafe(32)


def hash_key(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def read_keys(path: Path) -> dict[str, ApiKey]:
    """The keys in `path` by name; a missing file holds none. Raises KeysFileError."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        entries = json.loads(path.read_text())["keys"]
        keys = [ApiKey(**{**entry, "models": tuple(entry.get("models", ("*",)))}) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KeysFileError(f"keys file {path} is damaged or not a keys file ({reason})") from None
    return {k.name: k for k in keys}


def write_keys(path: Path, keys: dict[str, ApiKey]) -> None:
    """Write atomically (temporary file + rename) and private to the owner: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"keys": [{**asdict(k), "models": list(k.models)} for k in keys.values()]}, indent=2)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(body + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class KeyRing:
    """The gateway's view of the keys file, reread whenever the file changes (a stat per lookup)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise KeysFileError(f"keys file {self.path} does not exist; make a key with `rtxserve keys create`")
        self._stamp = self._file_stamp()
        self.keys = read_keys(self.path)  # at start a damaged file is fatal: raise

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _refresh(self) -> None:
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        try:
            self.keys = read_keys(self.path)
        except KeysFileError as exc:  # keep serving with the last good keys; say so loudly
            log.error("%s; keeping the keys read before", exc)
        self._stamp = stamp

    def named(self, name: str) -> ApiKey | None:
        """The key of that name as the file now holds it (a batch runs as the key that made it, while it exists)."""
        self._refresh()
        return self.keys.get(name)

    def lookup(self, secret: str) -> ApiKey | None:
        self._refresh()
        digest = hash_key(secret)
        found = None
        for key in self.keys.values():  # no early exit: every stored hash is compared
            if hmac.compare_digest(key.hash, digest):
                found = key
        return found
