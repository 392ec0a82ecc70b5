"""Per-key requests and tokens per minute, counted by the `limits` library (fixed one-minute windows).

The counters must be exact across the gateway's workers: uvicorn's workers are processes, and
`limits`' memory storage is per process. So the default storage is a file that every worker of the
box opens (`sqlite:///path`, the small storage class below: `limits` keeps the algorithm, SQLite's
locking makes each increment atomic across processes), and a fleet names Redis
(`RTXSERVE_RATE_LIMIT_STORAGE=async+redis://host:6379`, through coredis, which the install includes).

While the storage cannot be reached (Redis restarting), `rate_limit_unavailable` decides: "open" (the default)
admits requests uncounted, with a warning at most every WARN_EVERY_S and a count (metrics.QUOTA_STORAGE_ERRORS);
"closed" refuses them with 503 + Retry-After. Tokens used meanwhile are not charged. A Redis client gives up
after STORAGE_TIMEOUT_S, so an unreachable one delays no request by more.

Requests are counted when admitted. Tokens are known only after generation: a request is admitted
while the key's token window is not spent, and its prompt + completion tokens are charged when its
usage arrives (as LiteLLM and OpenAI do), so one request may overshoot the quota by its own size.

A key found over its quota is remembered until its window resets (`spent`): its next requests are refused from
memory, before their body is read (admission.py), so a key flooding past its quota costs the other keys no parsing
and no storage round trip (R14). Each worker learns it from its own first refusal.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from limits import RateLimitItemPerMinute
from limits.aio.storage import Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import StorageError
from limits.storage import storage_from_string

from .. import metrics
from ..exceptions import GatewayError
from .keys import ApiKey

log = logging.getLogger("rtxserve.gateway.quotas")
STORAGE_TIMEOUT_S = 1.0
WARN_EVERY_S = 10.0


class RateLimited(GatewayError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class QuotaStorageDown(GatewayError):
    """rate_limit_unavailable = "closed" and the quota storage cannot be reached."""

    status, type, code = 503, "service_unavailable", "quota_storage_unavailable"


class SQLiteStorage(Storage):
    """Fixed-window counters in one SQLite file shared by the processes of one box."""

    STORAGE_SCHEME = ["async+sqlite"]

    def __init__(self, uri: str, wrap_exceptions: bool = False, **options):
        super().__init__(uri, wrap_exceptions=wrap_exceptions, **options)
        path = uri.split("://", 1)[1]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, which takes the write lock up front.
        self.db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=OFF")  # counters, not records: a crash may lose the last minute
        self.db.execute("CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, count INTEGER, expires REAL)")

    @property
    def base_exceptions(self):
        return sqlite3.Error

    async def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        now = time.time()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("DELETE FROM counters WHERE key = ? AND expires <= ?", (key, now))
            (count,) = self.db.execute(
                "INSERT INTO counters VALUES (?, ?, ?) ON CONFLICT(key) DO UPDATE SET count = count + excluded.count "
                "RETURNING count", (key, amount, now + expiry)).fetchone()
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return count

    async def get(self, key: str) -> int:
        row = self.db.execute("SELECT count FROM counters WHERE key = ? AND expires > ?", (key, time.time())).fetchone()
        return row[0] if row else 0

    async def get_expiry(self, key: str) -> float:
        row = self.db.execute("SELECT expires FROM counters WHERE key = ?", (key,)).fetchone()
        return row[0] if row and row[0] > time.time() else time.time()

    async def check(self) -> bool:
        return self.db.execute("SELECT 1").fetchone() == (1,)

    async def reset(self) -> int | None:
        return self.db.execute("DELETE FROM counters").rowcount

    async def clear(self, key: str) -> None:
        self.db.execute("DELETE FROM counters WHERE key = ?", (key,))


class Quotas:
    """Admission by the key's requests per minute, and its tokens per minute."""

    def __init__(self, storage_uri: str, unavailable: str = "open"):
        options = ({"connect_timeout": STORAGE_TIMEOUT_S, "stream_timeout": STORAGE_TIMEOUT_S}
                   if storage_uri.startswith("async+redis") else {})
        self.limiter = FixedWindowRateLimiter(storage_from_string(storage_uri, wrap_exceptions=True, **options))
        self.fail_closed = unavailable == "closed"
        self._warned = 0.0
        # keys refused until their window resets: (name, rpm, tpm) -> (when, message). Refused again from here,
        # before the body is read (admission.py) and without the storage: a flood over quota costs others nothing
        self.spent: dict[tuple, tuple[float, str]] = {}

    def _unavailable(self, exc: StorageError, refuse: bool = True) -> None:
        """The storage could not be reached: count it, warn now and then, refuse (where `refuse`: a request not yet
        answered) if the settings say so."""
        metrics.QUOTA_STORAGE_ERRORS.inc()
        if time.monotonic() - self._warned > WARN_EVERY_S:
            self._warned = time.monotonic()
            log.warning("quota storage unreachable (%s): requests are %s", str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__, "refused (503)" if self.fail_closed else "admitted uncounted")
        if self.fail_closed and refuse:
            raise QuotaStorageDown("per-key quotas cannot be counted right now (their storage is unreachable); retry "
                                   "shortly", retry_after=1.0) from None

    async def _retry_after(self, item, *ids: str) -> float:
        reset, _ = await self.limiter.get_window_stats(item, *ids)
        return max(1.0, reset - time.time())

    def refusal(self, key: ApiKey) -> RateLimited | None:
        """The 429 for a key whose window was found spent and has not reset yet; None otherwise."""
        spent = self.spent.get((key.name, key.rpm, key.tpm))
        if spent is None:
            return None
        left = spent[0] - time.time()
        if left <= 0:
            del self.spent[key.name, key.rpm, key.tpm]
            return None
        return RateLimited(spent[1], retry_after=max(1.0, left))

    async def admit(self, key: ApiKey) -> None:
        """Count one request for `key`; 429 + Retry-After when its minute is spent."""
        refused = self.refusal(key)
        if refused is not None:
            raise refused
        try:
            if key.tpm:
                tokens = RateLimitItemPerMinute(key.tpm)
                if not await self.limiter.test(tokens, "tpm", key.name):
                    await self._spend(key, tokens, "tpm", f"this API key has used its {key.tpm} tokens per minute")
            if key.rpm:
                requests = RateLimitItemPerMinute(key.rpm)
                if not await self.limiter.hit(requests, "rpm", key.name):
                    await self._spend(key, requests, "rpm", f"this API key has used its {key.rpm} requests per minute")
        except StorageError as exc:
            self._unavailable(exc)

    async def _spend(self, key: ApiKey, item, kind: str, what: str) -> None:
        """`key`'s window of `item` is spent: remembered until it resets, and refused."""
        retry_after = await self._retry_after(item, kind, key.name)
        message = f"{what}; retry later"
        self.spent[key.name, key.rpm, key.tpm] = (time.time() + retry_after, message)
        raise RateLimited(message, retry_after=retry_after)

    async def charge_tokens(self, key: ApiKey | None, tokens: int) -> None:
        if key is not None and key.tpm and tokens > 0:
            try:
                await self.limiter.hit(RateLimitItemPerMinute(key.tpm), "tpm", key.name, cost=tokens)
            except StorageError as exc:
                self._unavailable(exc, refuse=False)  # the answer is given already: its tokens go uncounted
