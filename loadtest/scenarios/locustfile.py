"""The locustfile of every scenario: `locust -f loadtest/scenarios/locustfile.py --scenario ... --model ...`.

Closed loop: each user sends its next request as soon as the last was answered. Open loop (--arrival
poisson | gamma): requests arrive at --rate whatever the answers do, from one arrival schedule per
process (each process takes its share of the rate); an arrival that finds --max-in-flight requests
outstanding waits for one to end, and that wait is recorded with the request, so a report can say when
the load stopped being open.
"""

import random
import time

import gevent
import numpy as np
from gevent.lock import BoundedSemaphore
from gevent.pool import Group
from locust import FastHttpUser, constant, events, task
from locust.runners import STATE_CLEANUP, STATE_STOPPED, STATE_STOPPING, MasterRunner, WorkerRunner

from loadtest.scenarios import samples  # noqa: F401  (registers the raw-sample recorder)
from loadtest.scenarios.apis import Load, call, replay
from loadtest.scenarios.options import add_options, parse_pairs

events.init_command_line_parser.add_listener(add_options)
# A runner stopping its users is in CLEANUP (LocalRunner.stop), a worker told to stop in STOPPING.
ENDING = (STATE_CLEANUP, STATE_STOPPING, STATE_STOPPED)
_process: dict = {}  # this process's Load and arrival schedule, made at test start


class Arrivals:
    """Open-loop arrival times for this process: Poisson, or gamma gaps with a burstiness factor as
    `vllm bench serve` draws them (shape = burstiness, mean gap = 1 / rate), at a rate that may follow stages."""

    def __init__(self, options, share: float, seed: int):
        self.options, self.share = options, share
        self.stages = parse_pairs(options.stages, "--stages")
        self.rng = np.random.default_rng(seed)
        self.slots = BoundedSemaphore(max(1, round(options.max_in_flight * share)))
        self.in_flight = Group()
        self.start = time.perf_counter()
        self.next_at = 0.0  # seconds after start

    def rate_at(self, t: float) -> tuple[float, float]:
        """This process's rate at `t`, and when that rate ends (inf without stages)."""
        if not self.stages:
            return self.options.rate * self.share, float("inf")
        end = 0.0
        for seconds, rate in self.stages:
            end += seconds
            if t < end:
                return rate * self.share, end
        return 0.0, float("inf")

    def take(self) -> float:
        """The next arrival time (seconds after start). A gap that would cross into the next stage is drawn
        again from that stage's start at its rate (for Poisson arrivals, memoryless, that is exact)."""
        while True:
            rate, ends = self.rate_at(self.next_at)
            if rate > 0:
                b = self.options.burstiness if self.options.arrival == "gamma" else 1.0
                due = self.next_at + float(self.rng.gamma(b, 1.0 / (rate * b)))
                if due < ends:
                    self.next_at = due
                    return due
            elif ends == float("inf"):
                return ends
            self.next_at = ends

    def next(self) -> tuple[float, tuple | None]:
        """The next arrival time, and what it sends (None: what the scenario draws)."""
        return self.take(), None


class TraceArrivals(Arrivals):
    """--scenario replay: the trace's own arrivals, every n-th of them in the n processes (this one from its index);
    with --loop-trace, pass after pass (each one the trace's span and a mean gap after the last) until the run ends."""

    def __init__(self, options, share: float, seed: int, trace, index: int, processes: int):
        super().__init__(options, share, seed)
        self.mine = list(enumerate(trace.requests))[index::processes]
        self.queue, self.loop, self.ended = iter(self.mine), 0, False
        self.period = trace.duration_s * len(trace.requests) / max(1, len(trace.requests) - 1)

    def next(self) -> tuple[float, tuple | None]:
        index, request = next(self.queue, (None, None))
        if request is None and self.options.loop_trace and self.mine and self.period > 0:
            self.queue, self.loop = iter(self.mine), self.loop + 1
            index, request = next(self.queue)
        if request is None:
            return float("inf"), None
        return request.at + self.loop * self.period, (index, request, self.loop)


@events.test_start.add_listener
def _prepare(environment, **_kwargs):
    runner, options = environment.runner, environment.parsed_options
    if options is None or isinstance(runner, MasterRunner):  # the master sends nothing itself
        return
    index = max(0, getattr(runner, "worker_index", 0)) if isinstance(runner, WorkerRunner) else 0
    processes = max(1, options.expect_workers) if isinstance(runner, WorkerRunner) else 1
    _process["load"] = Load.from_options(options, index)
    _process["seed"] = options.seed * 10_000 + index * 100
    if options.arrival == "trace":
        _process["arrivals"] = TraceArrivals(options, 1.0 / processes, _process["seed"], _process["load"].trace, index,
                                             processes)
    elif options.arrival != "closed":
        _process["arrivals"] = Arrivals(options, 1.0 / processes, _process["seed"])
    ApiUser.network_timeout = ApiUser.connection_timeout = options.request_timeout


class ApiUser(FastHttpUser):
    wait_time = constant(0)
    concurrency = 1024  # connections one user may hold: an open-loop user has many requests in flight
    _numbers = iter(range(10**9))

    def on_start(self):
        self.load = _process["load"]
        self.rng = random.Random(_process["seed"] + next(self._numbers))
        self.arrivals = _process.get("arrivals")

    @task
    def step(self):
        if self.arrivals is None:
            pause = call(self, *self.load.pick(self.rng), self.rng)
            if pause:
                gevent.sleep(pause)  # Retry-After, honoured after the request was recorded
            return
        offset, replayed = self.arrivals.next()
        if offset == float("inf") and isinstance(self.arrivals, TraceArrivals):
            # the trace is sent: once its requests are answered, this process's run is over (a worker's quit tells
            # the master, which ends the run when its last worker has quit). Quitting waits for each user's task to
            # end, so it is not called from this one, which then only idles in short steps.
            if not self.arrivals.ended:
                self.arrivals.ended = True
                self.arrivals.in_flight.join()
                gevent.spawn(self.environment.runner.quit)
            gevent.sleep(0.1)
            return
        due = self.arrivals.start + offset
        # Wait in short steps: a stop during the wait must not send one more request after the run's end.
        while (left := due - time.perf_counter()) > 0:
            if self.environment.runner.state in ENDING:
                return
            gevent.sleep(min(left, 0.1))
        # Each arrival waits for its slot in a greenlet of its own, so this loop is never held by the in-flight cap:
        # a request that left late was held by the cap (cap_wait_ms) or by this process being busy (the rest).
        self.arrivals.in_flight.spawn(self._one, self.rng.getrandbits(32), due, replayed)

    def _one(self, seed: int, due: float, replayed: tuple | None) -> None:
        # held by the cap only when every slot was taken: on a busy machine the process can be descheduled between
        # the two clocks below with a slot free, and that is the process being busy, not the cap
        capped = self.arrivals.slots.locked()
        free_at = time.perf_counter()
        self.arrivals.slots.acquire()
        try:
            if self.environment.runner.state in ENDING:
                return  # its slot came after the run's end
            now = time.perf_counter()
            lateness = {"wait_ms": (now - due) * 1000, "cap_wait_ms": (now - free_at) * 1000 if capped else 0.0}
            if replayed is not None:
                replay(self, *replayed, lateness)
            else:
                rng = random.Random(seed)
                call(self, *self.load.pick(rng), rng, lateness)
        finally:
            self.arrivals.slots.release()

    def on_stop(self):
        if self.arrivals is not None:  # the requests in flight end within the stop timeout (0: not awaited)
            self.arrivals.in_flight.join(timeout=self.environment.stop_timeout or 0)
