"""Numbered progress lines for long export steps: silence during a minutes-long export looks like a hang."""

from __future__ import annotations

import logging
import time


class Steps:
    """`steps("loading %s", path)` logs "[2/5   3.1s] loading ..." on `log`."""

    def __init__(self, total: int, log: logging.Logger):
        self.total, self.n, self.t0, self.log = total, 0, time.perf_counter(), log

    def __call__(self, message: str, *args) -> None:
        self.n += 1
        self.log.info("[%d/%d %5.1fs] " + message, self.n, self.total, time.perf_counter() - self.t0, *args)

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0
