"""People before a batch, with no setting tuned: a batch's request (its key's priority at `batch` or later, as the
Batch API runs them) waits at the gateway while people's requests to the same servers wait for their first token
(a stream's first chunk, an answer), so the batch's new prefills never share the engine's steps with theirs; the
moment people have their first token, the batch goes on. `batch_floor` of the batch's requests per server group
always go (the batch never starves while people keep coming). B14 in ../shared/BENCH.md.

Servers, not models: people chatting with an adapter and a batch on its base share one engine. Each gateway worker
sees its own requests only (a box's batches run in one worker).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable


class PeopleFirst:
    def __init__(self, floor: int):
        self.floor = floor
        self.people_waiting: Counter[tuple] = Counter()  # server group -> people's requests before their first token
        self.batch_running: Counter[tuple] = Counter()  # server group -> the batch's requests in flight
        self._clear: dict[tuple, asyncio.Event] = {}  # set while no person waits there

    def _event(self, group: tuple) -> asyncio.Event:
        event = self._clear.get(group)
        if event is None:
            event = self._clear[group] = asyncio.Event()
            event.set()
        return event

    def person(self, group: tuple) -> Callable[[], None]:
        """A person's request to `group` started; the returned callable says it has its first token (once)."""
        self.people_waiting[group] += 1
        self._event(group).clear()

        def first_token() -> None:
            self.people_waiting[group] -= 1
            if not self.people_waiting[group]:
                self._event(group).set()

        return _once(first_token)

    async def batch_turn(self, group: tuple) -> Callable[[], None]:
        """Wait until no person waits at `group` or the batch has fewer than its floor running there; the returned
        callable says the batch's request ended (once)."""
        while self.people_waiting[group] and self.batch_running[group] >= self.floor:
            await self._event(group).wait()
        self.batch_running[group] += 1
        return _once(lambda: self.batch_running.subtract((group,)))


def _once(action: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return call
