"""The steps of a promotion, each taken through the gateway's admin routes, judged from its /metrics, and the rollback
at the first breach. A thread renews the promotion's lease beside the steps: if this process dies, the gateway rolls
the promotion back by itself (or finishes it, once switched) when the lease runs out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from core.reference import ReferenceSet

from .figures import RoleFigures, pooled, scrape, tail, window


class PromoteError(RuntimeError):
    """The gateway refused a step, or could not be reached; one line, its reason."""


class Breach(RuntimeError):
    """A step whose figures break the bounds: the promotion is rolled back, for this reason."""


@dataclass(frozen=True)
class PromoteOptions:
    """How long each step runs and what it must hold. Latency bound: the candidate's P99 (backend time) at most the
    current model's x (1 + latency_margin) + latency_floor_ms; errors: its error rate at most the current's +
    max_error_increase; each judged where the candidate answered at least min_requests in the step."""

    shadow_share: float = 0.2
    shadow_s: float = 20.0
    canary: tuple[int, ...] = (10, 25, 50)
    step_s: float = 15.0
    rollback_window_s: float = 30.0
    lease_s: float = 30.0
    latency_margin: float = 1.0
    latency_floor_ms: float = 10.0
    max_error_increase: float = 0.01
    min_requests: int = 20
    eval_limits: dict = field(default_factory=dict)
    eval_settings: dict | None = None


@dataclass
class Step:
    """What one step did: its name, when, for how long, the candidate's share, each role's figures, the verdict."""

    name: str
    started: float
    seconds: float = 0.0
    weight: int = 0
    figures: dict[str, RoleFigures] = field(default_factory=dict)
    passed: bool = True
    detail: str = ""


class Admin:
    """The gateway's admin routes of a promotion."""

    def __init__(self, url: str, api_key: str, timeout_s: float = 600.0):
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=timeout_s,
                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else {})

    def _call(self, method: str, path: str, **kwargs) -> dict:
        try:
            r = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise PromoteError(f"the gateway at {self.url} did not answer ({type(exc).__name__}: {exc})") from None
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:300]
            raise PromoteError(f"{method} {path}: HTTP {r.status_code}: {message}")
        return r.json()

    def status(self) -> dict:
        return self._call("GET", "/admin/promotions")

    def load(self, name: str) -> dict:
        return self._call("POST", f"/admin/models/{name}/load")

    def begin(self, model: str, candidate: str, lease_s: float) -> dict:
        return self._call("POST", "/admin/promotions", json={"model": model, "candidate": candidate, "lease_s": lease_s})

    def step(self, model: str, pid: str, phase: str, *, weight: int = 0, shadow: float = 0.0, lease_s: float) -> dict:
        return self._call("PATCH", f"/admin/promotions/{model}", json={"id": pid, "phase": phase, "weight": weight,
                                                                       "shadow": shadow, "lease_s": lease_s})

    def rollback(self, model: str, pid: str | None, reason: str) -> dict:
        return self._call("POST", f"/admin/promotions/{model}/rollback", json={"id": pid, "reason": reason[:1000]})

    def finish(self, model: str, pid: str) -> dict:
        return self._call("POST", f"/admin/promotions/{model}/finish", json={"id": pid})


class Lease(threading.Thread):
    """Renews the promotion's lease (its current step again) every third of it; `lost` says why it could not."""

    def __init__(self, admin: Admin, model: str, pid: str, lease_s: float):
        super().__init__(daemon=True, name="promotion-lease")
        self.admin, self.model, self.pid, self.lease_s = admin, model, pid, lease_s
        self.step = {"phase": "started", "weight": 0, "shadow": 0.0}
        self.lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def move(self, phase: str, weight: int = 0, shadow: float = 0.0) -> None:
        with self._lock:
            self.admin.step(self.model, self.pid, phase, weight=weight, shadow=shadow, lease_s=self.lease_s)
            self.step = {"phase": phase, "weight": weight, "shadow": shadow}

    def run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                with self._lock:
                    self.admin.step(self.model, self.pid, lease_s=self.lease_s, **self.step)
            except PromoteError as exc:
                if "did not answer" not in str(exc):  # a gateway restarting is retried; a refusal is final
                    self.lost = str(exc)
                    return

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Outcome:
    model: str
    current: str
    candidate: str
    promotion: dict | None = None
    steps: list[Step] = field(default_factory=list)
    evals: dict = field(default_factory=dict)  # role -> loadtest.eval.run.EvalResult
    result: str = "refused"  # promoted, rolled back, refused
    reason: str = ""


class Driver:
    """One promotion of `model` (served by `current`) to `candidate`, step by step."""

    def __init__(self, admin: Admin, model: str, current: str, candidate: str, references: dict[str, ReferenceSet | None],
                 options: PromoteOptions, api_key: str = "", say: Callable[[str], None] = print):
        self.admin, self.options, self.api_key, self.say = admin, options, api_key, say
        self.references = references
        self.outcome = Outcome(model, current, candidate)
        self.lease: Lease | None = None

    def run(self) -> Outcome:
        o, opts = self.outcome, self.options
        o.promotion = self.admin.begin(o.model, o.candidate, opts.lease_s)  # refused here: nothing loaded, nothing moved
        self.lease = Lease(self.admin, o.model, o.promotion["id"], opts.lease_s)
        self.lease.start()
        try:
            self._step("load", lambda s: self._load())
            self._step("eval", self._eval)
            if opts.shadow_share > 0 and opts.shadow_s > 0:
                self._step("shadow", self._shadow)
            for weight in opts.canary:
                self._step(f"canary {weight} %", lambda s, w=weight: self._hold(s, "canary", w, opts.step_s))
            self._step("switch", lambda s: self._hold(s, "switched", 100, opts.rollback_window_s))
            self.lease.stop()
            o.promotion = self.admin.finish(o.model, o.promotion["id"])
            o.result, o.reason = "promoted", o.promotion.get("reason", "")
        except (Breach, KeyboardInterrupt) as exc:
            self._roll_back(str(exc) or "stopped by the user (Ctrl-C)")
        except PromoteError as exc:
            self._roll_back(f"a step failed: {exc}")
        finally:
            if self.lease is not None:
                self.lease.stop()
        return o

    def _step(self, name: str, body: Callable[[Step], None]) -> None:
        step = Step(name, time.time())
        self.outcome.steps.append(step)
        self.say(f"[{len(self.outcome.steps)}] {name} ...")
        try:
            body(step)
        except Breach as exc:
            step.passed, step.detail = False, str(exc)
            raise
        finally:
            step.seconds = time.time() - step.started
        self.say(f"    {step.detail or 'held'} ({step.seconds:.1f} s)")
        if self.lease is not None and self.lease.lost:
            raise PromoteError(f"the promotion's lease was lost: {self.lease.lost}")

    def _load(self) -> None:
        answer = self.admin.load(self.outcome.candidate)
        self.outcome.steps[-1].detail = f"{self.outcome.candidate} loaded" + (" (on demand)" if answer.get("on_demand")
                                                                              else "")

    def _eval(self, step: Step) -> None:
        """The candidate held to its reference set (the gate); the current model to its own, for comparison."""
        from loadtest.eval.run import evaluate

        o = self.outcome
        for role, name in (("candidate", o.candidate), ("current", o.current)):
            ref = self.references.get(role)
            if ref is not None:
                o.evals[role] = evaluate(self.admin.url, name, ref, limits=self.options.eval_limits,
                                         api_key=self.api_key, settings=self.options.eval_settings)
        gate = o.evals["candidate"]
        step.detail = f"{o.candidate}: {gate.verdict()}"
        if not gate.passed:
            raise Breach(f"the eval gate: {o.candidate} does not answer as it was trained ({gate.verdict()})")

    def _shadow(self, step: Step) -> None:
        opts = self.options
        step.figures = self._window(lambda: self.lease.move("shadow", shadow=opts.shadow_share), opts.shadow_s)
        shadow, current = step.figures.get("shadow"), step.figures.get("current")
        if shadow is None:
            step.detail = "no live requests during the shadow step: nothing was compared"
            return
        agreement = shadow.agreement
        step.detail = (f"{shadow.requests} requests shadowed" + (f", {agreement:.1%} agreed" if agreement is not None
                                                                  else "") + f", {shadow.errors} failed")
        self._judge(shadow, current, "in the shadow step")

    def _hold(self, step: Step, phase: str, weight: int, seconds: float) -> None:
        step.weight = weight
        step.figures = self._window(lambda: self.lease.move(phase, weight=weight), seconds)
        candidate, current = step.figures.get("candidate"), step.figures.get("current")
        step.detail = (f"{candidate.requests if candidate else 0} requests to {self.outcome.candidate}, "
                       f"{current.requests if current else 0} to {self.outcome.current}")
        if phase == "switched":  # the current model answers only what it had in flight: held to its earlier steps
            current = pooled([s.figures["current"] for s in self.outcome.steps[:-1] if "current" in s.figures])
            if current is not None:
                step.detail += f" (against {self.outcome.current}'s {current.requests} requests of the steps before)"
        self._judge(candidate, current, f"at {weight} %")

    def _window(self, begin: Callable[[], None], seconds: float) -> dict[str, RoleFigures]:
        """The step's figures: the scrape before it begins, and after `seconds` (held longer, up to 3x, while the
        candidate has answered fewer than min_requests)."""
        before = self._scrape()
        begin()
        deadline, longest = time.monotonic() + seconds, time.monotonic() + 3 * seconds
        while True:
            time.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
            if self.lease.lost:
                raise PromoteError(f"the promotion's lease was lost: {self.lease.lost}")
            if time.monotonic() < deadline:
                continue
            figures = window(before, self._scrape())
            asked = figures.get("candidate") or figures.get("shadow")
            if (asked is not None and asked.requests >= self.options.min_requests) or time.monotonic() >= longest \
                    or not any(figures.values()):
                return figures
            deadline = time.monotonic() + 1.0

    def _scrape(self):
        try:
            return scrape(self.admin.client, self.outcome.model)
        except httpx.HTTPError as exc:
            raise PromoteError(f"the gateway at {self.admin.url} did not answer ({type(exc).__name__}: {exc})") from None

    def _judge(self, candidate: RoleFigures | None, current: RoleFigures | None, where: str) -> None:
        opts = self.options
        if candidate is None or candidate.requests < opts.min_requests:
            n = candidate.requests if candidate else 0
            self.outcome.steps[-1].detail += f" (judged on {n} requests, fewer than {opts.min_requests}: not judged)"
            return
        base_errors = current.error_rate if current else 0.0
        if candidate.error_rate > base_errors + opts.max_error_increase:
            raise Breach(f"{self.outcome.candidate} failed {candidate.errors} of {candidate.requests} requests "
                         f"({candidate.error_rate:.1%}) {where}, against {base_errors:.1%} for {self.outcome.current}")
        if current is None:
            return
        name, theirs, ours = tail(candidate, current)
        if theirs > ours * (1 + opts.latency_margin) + opts.latency_floor_ms:
            raise Breach(f"{self.outcome.candidate}'s {name} {theirs:.1f} ms {where} is over {self.outcome.current}'s "
                         f"{ours:.1f} ms x {1 + opts.latency_margin:g} + {opts.latency_floor_ms:g} ms")

    def _roll_back(self, reason: str) -> None:
        o = self.outcome
        self.say(f"rolling back: {reason}")
        o.result, o.reason = "rolled back", reason
        if o.promotion is None:
            return
        try:
            o.promotion = self.admin.rollback(o.model, o.promotion["id"], reason)
        except PromoteError as exc:  # ended already (the gateway restarted, the lease ran out): its state says how
            o.reason += f"; the gateway's own account: {exc}"
