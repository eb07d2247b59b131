"""The conformance kit for engine drivers (Hypothesis: a dev extra; `refit.testing` loads it only
when the kit is asked for): property-test your driver against every refit invariant, and
against what its engine actually serves.

    from refit.testing import check_engine_driver

    def test_my_driver_conforms():
        report = check_engine_driver(lambda name: MyEngineDriver.start(name), max_examples=25)
        print(report.summary())

First a deterministic sweep (two engines, colocated): every fault kind (raise, corrupt, kill, hang)
in every state, at the first, middle and last bucket, with retries off and on; faults that hit the
retry attempt itself; engines that released their memory (as a colocated engine does while the
trainer trains) and must be refit in full, with and without a fault before any byte; restarts and a
concurrent attempt. Then a Hypothesis rule-based state machine explores: 1-3 engines, colocated
or disaggregated, pause modes, retries, faults weighted towards the bucket loop and the retry
path, requests in flight, memory releases, concurrent attempts, stale owners' late releases,
restarts. After every refit it checks outcomes, not claims:

  * every trace invariant (refit.invariants.check_trace) over everything recorded so far, and the
    engine-side audit when the driver has `audit()`;
  * served     each engine the run reports `updated` (at the new version) or `unchanged` (at its
               old one) really serves that version's weights: its weights read back equal the
               trainer's bit for bit (when the driver has `state_dict`), and the greedy tokens it
               generates are the ones the trainer's model gives with those weights (checked by
               teacher forcing, so near-ties cannot flake); a quarantined engine, or one held as
               stale by the version policy (drawn: the default, 0, or none), refuses requests;
  * version    the version an engine labels its tokens with (and reports in `info()`) is the one
               the run published for it;
  * token_version  where the engine reports each token's weights epoch and its commit points
               (`info()["commits"]`), a request in flight across a refit changed version only at
               a commit point (refit.invariants.tokens);
  * kv_fresh   requests it submitted before the refit, and prompts whose prefixes were cached
               under the old weights, produce only tokens that their own version's weights give
               (a token computed on KV from other weights does not);
  * progress   a refit with no fault updates every engine; an engine restarted (new incarnation)
               is attached again and refit in full before the run reports it updated;
  * deadline   no call answered after the budget it was given (a driver that ignores its
               `timeout` is reported as such, never as a success).

A failure raises AssertionError naming the invariant; Hypothesis prints the shortest sequence of
steps that breaks it. The coverage (runs, faults per state and per path, outcomes) is returned.

What the kit needs from a driver besides the protocol calls: `generate(prompt, max_new_tokens, *,
timeout) -> {"output": [token ids], "weight_versions": [one per token] (optional)}`; optional
`state_dict(*, timeout)` (weights read back, engine-side names as the trainer's), `score(tokens, *,
timeout)` (fresh logits, to tell stale KV from wrong weights), `info(*, timeout) -> {"version"}`,
`submit(prompt, max_new_tokens) -> Future` (requests in flight), `release_memory(tags, *, timeout)`
(colocated engines), `audit(*, timeout)`, `alive`, `close()`. The default model, source and
transport are the reference engine's (TinyLlama, torch source, shared memory); pass `model` /
`transport` for drivers of other engines (`model(ids [1, T])` returns logits or an object with
`.logits`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from refit import invariants, protocol
from refit.buckets import plan_buckets
from refit.drivers.base import EngineDriver, Transport
from refit.errors import RefitBusyError
from refit.protocol.context import digest_kind_for
from refit.protocol.faults import LOUD_KINDS, SILENT_CALLS, SILENT_KINDS, TP_KINDS, Fault
from refit.states import ACTIVE_STATES, RETRY_STATES

PROMPTS: tuple[tuple[int, ...], ...] = (  # the served check: short prompts, and a long one (caches may keep those)
    (3, 1, 4, 1, 5, 9, 2, 6),
    (2, 7, 1, 8, 2, 8),
    (5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5),
)
CHECK_TOKENS = 6
INFLIGHT_PROMPT = (1, 2, 3, 4)
INFLIGHT_TOKENS = 40
LOGIT_TOLERANCE = 1e-3  # a served token may trail the trainer's best by this much (summation order)
SERVE_TIMEOUT_S = 5.0  # an engine reported serving answers a short request within this
CALL_GRACE_S = 0.5  # a driver's call returns within its timeout plus this, whatever its engine does
SWEEP_KINDS = ("raise", "corrupt", "kill", "hang")  # hangs last: they cost the most time


@dataclass
class Coverage:
    """What the kit exercised: runs, injected faults per state / kind / path, engine outcomes, and
    how many served checks ran (weights read back, prompts generated, in-flight requests)."""

    runs: int = 0
    faults: Counter[str] = field(default_factory=Counter)  # per state
    kinds: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)  # first attempt | retry | cleanup | trainer
    outcomes: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)

    def summary(self) -> str:
        def fmt(c: Counter[str]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none"

        return (
            f"{self.runs} refits, {sum(self.faults.values())} faults fired; per state: {fmt(self.faults)}; "
            f"per kind: {fmt(self.kinds)}; per path: {fmt(self.paths)}; engine outcomes: {fmt(self.outcomes)}; "
            f"served checks: {fmt(self.checks)}"
        )


def _default_model() -> Any:
    from refit.reference.model import ModelConfig, TinyLlama

    return TinyLlama(ModelConfig(), seed=0)


def _default_transport() -> Transport:
    from refit.drivers.shm import SharedMemoryTransport

    return SharedMemoryTransport()


class DriverStateMachine(RuleBasedStateMachine):
    """The kit's state machine; `check_engine_driver` subclasses it with your factory."""

    factory: Callable[[str], EngineDriver]
    model_factory: Callable[[], Any] = staticmethod(_default_model)
    transport_factory: Callable[[], Transport] = staticmethod(_default_transport)
    bucket_bytes = 64 << 10
    call_timeout_s = 0.3
    logit_tolerance = LOGIT_TOLERANCE
    coverage: Coverage = Coverage()

    def __init__(self) -> None:
        super().__init__()
        self.engines: list[EngineDriver] = []
        self.retired: list[EngineDriver] = []
        self.ctx: protocol.RefitContext | None = None
        self.steps = 0
        self.runs_of: dict[int, set[str]] = {}  # id(engine) -> runs it took part in
        self.audits: dict[int, tuple[list[dict[str, Any]], float]] = {}  # id(engine) -> (audit, taken at)
        self.snapshots: dict[int, dict[str, Any]] = {}  # version -> the trainer's weights it names
        self.inflight: list[tuple[EngineDriver, Any]] = []  # requests submitted before the next refit
        self.restarted: dict[str, bool] = {}  # engines replaced since their last full refit -> attached
        self.released: set[str] = set()  # engines whose memory the kit released since they last served
        self._scratch: Any = None
        self.last: protocol.RefitResult | None = None
        self._logits: dict[tuple[int, tuple[int, ...]], Any] = {}

    # ---- set-up -------------------------------------------------------------------------------

    @initialize(
        n=st.integers(1, 3),
        mode=st.sampled_from(["colocated", "disaggregated"]),
        pause_mode=st.sampled_from(["abort", "retract", "in_place"]),
        max_staleness=st.sampled_from([0, None]),
        atomic=st.booleans(),
    )
    def setup(self, n: int, mode: str, pause_mode: str, max_staleness: int | None, atomic: bool = False) -> None:
        from refit.drivers.torch_source import TorchSource

        self.engines = [self.timed(type(self).factory(f"kit{i}")) for i in range(n)]
        # stage-then-swap: disaggregated runs of engines that stage (`EngineDriver.stages`)
        atomic = atomic and mode == "disaggregated" and all(getattr(e, "stages", False) for e in self.engines)
        if pause_mode == "in_place" and (
            mode == "colocated" or not all(e.supports_in_place_pause for e in self.engines)
        ):  # held in place with their own KV: disaggregated runs of engines that can (kv="keep")
            pause_mode = "retract"
        self.model = type(self).model_factory()
        self.snapshots[0] = _clone(self.model.state_dict())  # every engine starts from this checkpoint
        self.ctx = protocol.RefitContext(
            source=TorchSource(self.model),
            transport=(transport := type(self).transport_factory()),
            engines=self.engines,
            mode=mode,  # type: ignore[arg-type]
            pause_mode=pause_mode,  # type: ignore[arg-type]
            kv="keep" if pause_mode == "in_place" else "recompute",
            bucket_bytes=type(self).bucket_bytes,
            deadline_s=10.0,
            cleanup_grace_s=2.0,
            call_timeout_s=type(self).call_timeout_s,
            version=0,
            # the default policy holds an engine left behind out of service (stale); with none, the
            # runner continues it on its old version, which is where a driver's wrong answers show
            max_staleness=max_staleness,
            # a driver that reports digests is verified before every publish, as users get it by default
            verify="digest" if digest_kind_for(transport.digest_kind, self.engines) else "off",
            atomic=atomic,
        )
        _note(
            f"{n} engines, {mode}{', atomic' if atomic else ''}, pause {pause_mode}, verify {self.ctx.verify}, "
            f"max_staleness {max_staleness}"
        )

    # ---- rules --------------------------------------------------------------------------------

    def n_buckets(self) -> int:
        assert self.ctx is not None
        return len(plan_buckets(self.ctx.source.metas(), self.ctx.bucket_bytes))

    def fault_states(self) -> list[str]:
        """States a fault can fire in: offload/restore exist only in colocated runs, RECONNECTING
        only with a collective transport, VERIFYING only when the run verifies, STAGING and
        SWAPPING only in atomic runs (which never pass PAUSING or INVALIDATING), DRAINING only in
        LoRA refits under a version policy."""
        assert self.ctx is not None
        skipped = ("PAUSING", "INVALIDATING") if self.ctx.atomic else ("STAGING", "SWAPPING")
        if self.ctx.adapter is None or self.ctx.max_live is None:
            skipped = (*skipped, "DRAINING")
        return [
            str(s) for s in ACTIVE_STATES
            if (self.ctx.colocated or s not in ("OFFLOADING", "RESTORING"))
            and (self.ctx.transport.collective or s != "RECONNECTING")
            and (self.ctx.verify != "off" or s != "VERIFYING")
            and s not in skipped
        ]  # fmt: skip

    @rule(data=st.data(), retries=st.integers(0, 1), path=st.sampled_from(["transfer", "retry", "transfer", "other"]))
    def refit(self, data: st.DataObject, retries: int, path: str) -> None:
        """A training step, then a refit; faults favour the bucket loop and the retry attempt."""
        engine = data.draw(st.integers(0, len(self.engines) - 1), label="engine")
        kind = data.draw(st.sampled_from(LOUD_KINDS), label="kind")
        n = self.n_buckets()
        faults: list[Fault] = []
        if path == "transfer":
            bucket = data.draw(st.sampled_from(sorted({0, n // 2, n - 1})), label="bucket")
            faults = [Fault("TRANSFERRING", engine=engine, bucket=bucket, kind=kind)]
        elif path == "retry":
            retries = 1
            faults = self.retry_path(engine, data.draw(st.sampled_from(self.retry_targets()), label="target"), kind)
        elif data.draw(st.booleans(), label="faulty"):
            state = data.draw(st.sampled_from(self.fault_states()), label="state")
            faults = [Fault(state, engine=engine, kind=kind)] if state != "TRANSFERRING" else []
        self.refit_with(faults, retries)

    def retry_targets(self) -> list[tuple[str, str | None, int | None, int]]:
        """Steps of an engine's retry attempt, as (state, call, bucket, matches before it fires)
        after a raise at the middle bucket dropped it from the first attempt."""
        n = self.n_buckets()
        mid = n // 2  # the first attempt's loads before `mid` pass a fault keyed to them; `mid` fails
        atomic = self.ctx is not None and self.ctx.atomic
        return [
            ("STAGING", "stage", None, 1) if atomic else ("INVALIDATING", "begin", None, 1),
            ("TRANSFERRING", "load", 0, 1 if mid > 0 else 0),
            ("TRANSFERRING", "load", n - 1, 0),
            ("POST_PROCESSING", "finalize", None, 0),
        ]

    def retry_path(self, engine: int, target: tuple[str, str | None, int | None, int], kind: str) -> list[Fault]:
        state, call, bucket, after = target
        first = Fault("TRANSFERRING", engine=engine, bucket=self.n_buckets() // 2, call="load", kind="raise")
        return [first, Fault(state, engine=engine, bucket=bucket, call=call, kind=kind, after=after)]

    def refit_with(self, faults: Fault | Sequence[Fault] | None, retries: int) -> protocol.RefitResult:
        """One training step and one refit; then every check of the module docstring."""
        import torch

        assert self.ctx is not None
        plan = [faults] if isinstance(faults, Fault) else list(faults or [])
        if any(f.state == "CONNECTING" for f in plan):  # engine calls of CONNECTING happen on a new connection
            from refit.protocol.session import disconnect

            disconnect(self.ctx, timeout=SERVE_TIMEOUT_S)
        self.steps += 1
        with torch.no_grad():  # a large step: stale KV or a missed bucket changes the tokens served
            gen = torch.Generator().manual_seed(self.steps)
            for p in self.model.parameters():
                scale = float(p.detach().float().std()) if p.numel() > 1 else 0.0
                p.add_((max(scale, 0.02) * torch.randn(p.shape, generator=gen)).to(p.dtype))
        sent = _clone(self.model.state_dict())
        self.await_hung()
        self.ctx.retries = retries
        hang = any(f.kind == "hang" for f in plan)  # a short call budget only where a hang must be waited out
        self.ctx.call_timeout_s = type(self).call_timeout_s if hang else max(type(self).call_timeout_s, 1.0)
        self.ctx.faults = protocol.FaultPlan(plan) if plan else None
        result = protocol.run(self.ctx)  # raises InvariantViolation if the run's own events break one
        if result.version is not None:
            self.snapshots[result.version] = sent
        for e in self.engines:
            self.runs_of.setdefault(id(e), set()).add(result.run_id)
        events = [e for e in self.ctx.recorder.events if e.get("run") == result.run_id]
        self.count(result, events)
        _note(f"refit {self.steps}: {plan} -> {result.state} {[(o.name, o.status) for o in result.engines.values()]}")
        assert self.ctx.lock is not None and self.ctx.lock.holder is None, "lock: still held after the run"
        self.every_invariant_holds()
        self.check_answers_in_time(events)
        self.check_calls_return_in_time()
        self.check_progress(result, events, plan)
        self.check_outcomes(result)
        self.last = result
        return result

    def await_hung(self) -> None:
        """Engines the last run dropped as hung answer again before the next refit (an injected hang
        stalls the engine a little past the runner's wait; a real engine would be restarted)."""
        hung = {
            e.get("engine") for e in self.last_events() if e.get("event") == "dropped" and e.get("failure") == "timeout"
        }
        for e in self.engines:
            if e.name in hung and _alive(e) and hasattr(e, "info"):
                with contextlib.suppress(Exception):
                    e.info(timeout=SERVE_TIMEOUT_S)

    def last_events(self) -> list[dict[str, Any]]:
        if self.ctx is None or self.last is None:
            return []
        return [e for e in self.ctx.recorder.events if e.get("run") == self.last.run_id]

    @rule()
    def concurrent_attempt(self) -> None:
        """Another refit holds the engines: a new run must fail at once; a stale owner's late
        release must be refused."""
        assert self.ctx is not None and self.ctx.lock is not None
        lock, rec = self.ctx.lock, self.ctx.recorder
        other, stale = f"in-flight-{uuid.uuid4().hex[:6]}", f"stale-{uuid.uuid4().hex[:6]}"
        assert lock.acquire(other), "lock: free lock could not be taken"
        t0 = time.monotonic()
        try:
            protocol.run(self.ctx)
        except RefitBusyError:
            pass
        else:
            raise AssertionError("lock: a second run started while another owner held the engines' lock")
        assert time.monotonic() - t0 < 1.0, "lock: a busy run did not fail at once"
        released = lock.release(stale)
        rec.emit("lock", "release", owner=stale, holder=other, outcome="ok" if released else "not_owner")
        if lock.holder == other:
            lock.release(other)

    @precondition(lambda self: any(not _alive(e) for e in self.engines))
    @rule(data=st.data())
    def restart_dead_engine(self, data: st.DataObject) -> None:
        """A dead engine is replaced by a fresh process with the same name: a new incarnation that
        must be reconnected and fully refit before it serves."""
        dead = [i for i, e in enumerate(self.engines) if not _alive(e)]
        self.restart(data.draw(st.sampled_from(dead), label="engine"))

    def restart(self, i: int) -> None:
        self._audit(self.engines[i])  # keep what it did before it was replaced
        self.retired.append(self.engines[i])
        self.engines[i] = self.timed(type(self).factory(self.engines[i].name))
        self.restarted[self.engines[i].name] = False
        assert self.ctx is not None
        self.ctx.engines[i] = self.engines[i]
        _note(f"restarted engine {i}")

    @precondition(lambda self: any(_alive(e) and hasattr(e, "submit") for e in self.engines))
    @rule()
    def requests_in_flight(self) -> None:
        """Rollouts running when the next refit starts (exercises pause modes and KV freshness)."""
        for e in self.engines:
            if _alive(e) and hasattr(e, "submit"):
                self.inflight.append((e, e.submit(list(INFLIGHT_PROMPT), INFLIGHT_TOKENS)))

    @precondition(lambda self: self.ctx is not None and self.ctx.colocated)
    @rule()
    def release_memory(self) -> None:
        """The trainer trains: colocated engines give their weight and KV memory back (weights
        released without a backup are gone; the next refit must restore them in full)."""
        self.release_all()

    def release_all(self) -> None:
        self.settle_requests()
        for e in self.engines:
            if _alive(e):
                with contextlib.suppress(Exception):  # an engine that cannot release keeps its memory
                    e.release_memory(["kv_cache", "weights"], timeout=SERVE_TIMEOUT_S)
                    self.released.add(e.name)
        type(self).coverage.checks["memory released"] += 1

    # ---- checks ---------------------------------------------------------------------------------

    @invariant()
    def every_invariant_holds(self) -> None:
        if self.ctx is None:
            return
        events = self.ctx.recorder.events
        found = invariants.check_trace(events, open_ok=True)
        for engine in [*self.engines, *self.retired]:
            snapshot = self._audit(engine)
            if snapshot is None:
                continue
            records, taken_at = snapshot
            runs = self.runs_of.get(id(engine), set())
            mine = [e for e in events if e.get("run") in runs]
            lenient = not _alive(engine) or _dropped_unreachable(mine, engine.name)
            found += invariants.check_engine_audit(records, engine=engine.name, open_session_ok=lenient)
            found += invariants.check_acks(records, mine, engine=engine.name, until=taken_at)
        if found:
            raise AssertionError("refit invariant violated:\n" + "\n".join(f"  {v}" for v in found))

    def timed(self, driver: EngineDriver) -> EngineDriver:
        """Record when each of the driver's calls returns: the runner stops waiting for a call at its
        budget, so a driver that keeps its caller waiting far past its timeout (for a late reply it
        then reports as a success, say) passes every run; under another caller it would hang."""
        calls: list[tuple[str, list[str], float, float, Future[Any], list[float]]] = self.__dict__.setdefault(
            "_timed_calls", []
        )
        original = driver.run_steps_async

        def run_steps_async(steps: Sequence[Any], *, timeout: float, executor: Any) -> Future[Any]:
            start = time.monotonic()
            fut = original(steps, timeout=timeout, executor=executor)
            returned: list[float] = []
            fut.add_done_callback(lambda _: returned.append(time.monotonic()))
            calls.append((driver.name, [s.call for s in steps], start, timeout, fut, returned))
            return fut

        driver.run_steps_async = run_steps_async  # type: ignore[method-assign]
        return driver

    def check_calls_return_in_time(self) -> None:
        """Every call of the run returned within its timeout plus CALL_GRACE_S (waited for until then)."""
        calls = self.__dict__.get("_timed_calls", [])
        self.__dict__["_timed_calls"] = []
        for name, steps, start, timeout, fut, returned in calls:
            limit = start + timeout + CALL_GRACE_S
            concurrent.futures.wait([fut], timeout=max(limit - time.monotonic(), 0.0))
            if not fut.done() or (returned and returned[0] > limit):
                took = f"{returned[0] - start:.2f}s" if returned else f"more than {timeout + CALL_GRACE_S:.2f}s"
                raise AssertionError(
                    f"deadline: engine {name}'s driver returned {steps} after {took}, past its {timeout:.3g}s timeout: "
                    "it ignores its timeout (the runner stops waiting at the budget, so a run hides it; under "
                    "another caller the call would hang)"
                )

    def check_answers_in_time(self, events: list[dict[str, Any]]) -> None:
        """Engine drivers answer within their budget (the trainer side is the transport's and the
        source's business, not the engine driver's under test)."""
        late = [e for e in events if e.get("late") and e.get("side") == "engine"]
        if late:
            e = late[0]
            who = f"engine {e.get('engine')}'s driver" if e.get("engine") else f"the {e.get('side')} driver"
            raise AssertionError(
                f"deadline: {who} answered {e.get('event')} after its {e.get('budget_s')}s budget: it ignores its "
                f"timeout ({e.get('error')})"
            )

    def check_progress(self, result: protocol.RefitResult, events: list[dict[str, Any]], plan: list[Fault]) -> None:
        """A fault-free refit updates every engine; a refit whose faults all target given engines (over a
        transport where members do not share a group) that completes updates every other engine."""
        assert self.ctx is not None
        targeted = {f.engine for f in plan}
        hang = any(f.kind == "hang" for f in plan)  # judged on a 1 s call budget, not the 0.3 s a hang run uses
        judged = not plan or (
            None not in targeted and not hang and not self.ctx.transport.collective and result.state == "DONE"
        )
        for i, (name, o) in enumerate(result.engines.items()):
            driver = next(e for e in self.engines if e.name == name)
            if judged and i not in targeted and _alive(driver) and o.status != "updated":
                why = "with no fault" if not plan else f"whose faults all targeted engine(s) {sorted(targeted)}"
                raise AssertionError(f"progress: a refit {why} left engine {name} {o.status} (error: {o.error})")
        for e in events:  # a restarted engine's new incarnation must attach before any bucket reaches it
            name = e.get("engine")
            if e.get("kind") != "call" or name not in self.restarted:
                continue
            if e.get("event") == "attach" and e.get("outcome") == "ok":
                self.restarted[name] = True
            elif e.get("event") == "detach":
                self.restarted[name] = False
            elif e.get("event") == "load" and e.get("outcome") == "ok" and not self.restarted[name]:
                raise AssertionError(f"progress: restarted engine {name} took bucket {e.get('bucket')} unattached")
        for name, o in result.engines.items():
            if name in self.restarted and o.status == "updated":
                del self.restarted[name]

    def check_outcomes(self, result: protocol.RefitResult) -> None:
        """What each engine serves, against the trainer's weights of the version it reports."""
        cov = type(self).coverage
        serving = {}
        refusals: list[tuple[EngineDriver, Future[bool]]] = []  # asked at once, judged after the rest
        for name, o in result.engines.items():
            driver = next(e for e in self.engines if e.name == name)
            if not _alive(driver):
                continue
            if o.status == "updated" and o.version != result.version:
                raise AssertionError(
                    f"version: engine {name} updated to {o.version}, the run published {result.version}"
                )
            claimed = o.serving or (o.status == "unchanged" and name not in self.released)
            if o.serving:
                self.released.discard(name)
            if o.status in ("updated", "unchanged") and claimed and o.version in self.snapshots:
                serving[name] = o.version
                self.check_serves(driver, o.version)
            elif o.status in ("quarantined", "stale"):  # held out of service: it must refuse requests
                refusals.append((driver, self.ask_quarantined(driver)))
        for driver, fut in self.inflight:  # on every engine: one that served them half-updated may be quarantined now
            if _alive(driver) and self.check_request(driver, fut, serving=driver.name in serving):
                cov.checks["in-flight requests"] += 1
                if self.ctx is not None and self.ctx.kv == "keep":
                    cov.checks["in-flight requests held in place"] += 1
        self.inflight = []
        for driver, served in refusals:
            self.check_refuses(driver, served)

    def check_serves(self, engine: EngineDriver, version: int) -> None:
        cov = type(self).coverage
        name = engine.name
        weights = self.snapshots[version]
        if hasattr(engine, "state_dict"):
            read = engine.state_dict(timeout=SERVE_TIMEOUT_S)
            for key, want in weights.items():
                got = read.get(key)
                if got is None or got.shape != want.shape or got.dtype != want.dtype or not bool((got == want).all()):
                    raise AssertionError(
                        f"served: engine {name} is reported at version {version} but its weights read back differ "
                        f"from the trainer's version {version} (first: {key})"
                    )
            cov.checks["weights read back"] += 1
        if hasattr(engine, "info"):
            reported = (engine.info(timeout=SERVE_TIMEOUT_S) or {}).get("version")
            if reported is not None and reported != version:
                raise AssertionError(f"version: engine {name} reports version {reported}, the run says {version}")
        for prompt in PROMPTS:
            try:
                out = engine.generate(list(prompt), CHECK_TOKENS, timeout=SERVE_TIMEOUT_S)
            except Exception as exc:
                raise AssertionError(
                    f"served: engine {name} is reported serving version {version} but a request failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from None
            self.check_tokens(engine, list(prompt), out, default_version=version, fresh=True)
            cov.checks["prompts generated"] += 1

    @staticmethod
    def ask_quarantined(engine: EngineDriver) -> Future[bool]:
        """A one-token request to a quarantined engine, on a thread (its 0.5 s wait overlaps the
        other engines' checks): True if it was served."""
        served: Future[bool] = Future()

        def ask() -> None:
            try:
                engine.generate(list(PROMPTS[0]), 1, timeout=0.5)
            except Exception:
                served.set_result(False)
                return
            served.set_result(True)

        threading.Thread(target=ask, name=f"kit-ask-{engine.name}", daemon=True).start()
        return served

    def check_refuses(self, engine: EngineDriver, served: Future[bool] | None = None) -> None:
        """A quarantined engine does not serve: a request is refused (or never answered)."""
        try:
            was_served = (served or self.ask_quarantined(engine)).result(timeout=SERVE_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(
                f"deadline: engine {engine.name}'s driver held a generate call with a 0.5 s timeout past "
                f"{SERVE_TIMEOUT_S}s: it ignores its timeout"
            ) from None
        if was_served:
            raise AssertionError(f"pause_continue: engine {engine.name} was quarantined but still serves requests")
        type(self).coverage.checks["quarantined refused"] += 1

    def check_request(self, engine: EngineDriver, fut: Any, *, serving: bool) -> bool:
        """A request that was in flight across the refit: on a serving engine it must finish (with
        tokens or aborted), and every token it got must be what its version's weights give."""
        with contextlib.suppress(Exception):
            fut.result(timeout=SERVE_TIMEOUT_S if serving else 0.5)
        if not fut.done():
            if serving:
                raise AssertionError(
                    f"served: engine {engine.name} serves, but a request in flight across the refit never finished "
                    f"(lost when it was paused?)"
                )
            return False  # an engine out of service may keep it
        if fut.exception() is not None:
            return False  # refused, or lost with the engine: nothing was served
        out = fut.result()
        if isinstance(out, dict) and out.get("weight_versions") is not None:  # tokens are checked per version
            checked = out
            if self.ctx is not None and self.ctx.kv == "keep":  # held in place with KV of older weights
                checked = self._kept_kv(engine, out)
            self.check_tokens(engine, list(out.get("prompt") or INFLIGHT_PROMPT), checked, default_version=None)
            self.check_commit_points(engine, out)
            return True
        return False

    def _kept_kv(self, engine: EngineDriver, out: dict[str, Any]) -> dict[str, Any]:
        """kv="keep": a request held in place across a switch goes on with KV computed under the old
        weights (off-policy by design, docs/async.md), so only its tokens before the first switch are
        held to their version's weights; an engine that counts the KV positions its forwards read
        from other weights (`stale_kv_tokens`) must count none for a request whose tokens all came
        from one weights epoch (such a read is a prefix cached under old weights, reused)."""
        versions = list(out["weight_versions"])
        first = next((i for i in range(1, len(versions)) if versions[i] != versions[i - 1]), len(versions))
        epochs, stale = out.get("weights_epochs"), out.get("stale_kv_tokens")
        if isinstance(stale, int) and stale and isinstance(epochs, list) and len(set(epochs)) <= 1:
            raise AssertionError(
                f"kv_keep: engine {engine.name} read {stale} KV positions of other weights for a request whose "
                "every token came from one weights epoch (an old prefix reused after a switch?)"
            )
        return {**out, "output": list(out.get("output") or [])[:first], "weight_versions": versions[:first]}

    def check_commit_points(self, engine: EngineDriver, out: dict[str, Any]) -> None:
        """token_version: where the engine reports each token's weights epoch and its commit points
        (`info()["commits"]`, the reference engine), every token's (version, epoch) is a commit
        point, and its versions never go back (refit.invariants.tokens)."""
        from refit.invariants.tokens import check_token_versions

        if out.get("weights_epochs") is None:
            return
        commits = None
        with contextlib.suppress(Exception):  # an engine that cannot say (gone, or no such field): not checked
            commits = engine.info(timeout=2.0).get("commits")  # type: ignore[attr-defined]
        if commits is None:
            return
        problems = check_token_versions(commits, [out], engine=engine.name)
        if problems:
            raise AssertionError(str(problems[0]))
        type(self).coverage.checks["token versions at commit points"] += 1

    def check_tokens(
        self,
        engine: EngineDriver,
        prompt: list[int],
        out: dict[str, Any],
        *,
        default_version: int | None,
        fresh: bool = False,
    ) -> None:
        """Each token is what its version's weights give on everything before it (teacher forcing)."""
        tokens = [int(t) for t in out.get("output") or []]
        versions = out.get("weight_versions") or [default_version] * len(tokens)
        if fresh and not tokens:
            raise AssertionError(f"served: engine {engine.name} answered a request with no tokens")
        labelled = list(zip(tokens, versions, strict=False))
        for i, (tok, v) in enumerate(labelled):
            if default_version is not None and v != default_version:
                raise AssertionError(
                    f"version: engine {engine.name} labelled a token with version {v}; it was reported at "
                    f"{default_version}"
                )
            if v not in self.snapshots:
                raise AssertionError(
                    f"version: engine {engine.name} labelled a token with version {v}, never published"
                )
            # one causal forward per run of tokens under one version: position p's logits depend
            # only on the tokens up to p, so row len(prompt) + i - 1 is token i's teacher-forced row
            end = i
            while end + 1 < len(labelled) and labelled[end + 1][1] == v:
                end += 1
            logits = self.trainer_logits(v, (*prompt, *tokens[:end]))[len(prompt) + i - 1]
            gap = float(logits.max() - logits[tok])
            if gap > type(self).logit_tolerance:
                raise AssertionError(self._diagnose(engine, prompt, tokens, i, v, gap))

    def _diagnose(self, engine: EngineDriver, prompt: list[int], tokens: list[int], i: int, v: int, gap: float) -> str:
        """A wrong token: stale KV when the engine's own fresh forward agrees with the trainer."""
        where = (
            f"token {i} of a request (prompt {prompt[:4]}...) under version {v} trails the trainer's best by {gap:.3g}"
        )
        score = getattr(engine, "score", None)
        if score is not None:
            with contextlib.suppress(Exception):
                seq = (*prompt, *tokens[:i])
                fresh = score(list(seq), timeout=SERVE_TIMEOUT_S)[-1]
                want = self.trainer_logits(v, seq)[-1]
                if float((fresh.float() - want.float()).abs().max()) <= type(self).logit_tolerance:
                    return (
                        f"kv_fresh: engine {engine.name} served a token computed on stale KV: {where}, while its own "
                        f"fresh forward agrees with the trainer (the cache held KV from other weights)"
                    )
        return f"served: engine {engine.name} serves tokens its version's weights do not give: {where}"

    def trainer_logits(self, version: int, tokens: tuple[int, ...]) -> Any:
        import torch

        key = (version, tokens)
        if key not in self._logits:
            if self._scratch is None:
                self._scratch = copy.deepcopy(self.model)
            self._scratch.load_state_dict(self.snapshots[version])
            with torch.no_grad():
                out = self._scratch(torch.tensor([list(tokens)]))
            self._logits[key] = (getattr(out, "logits", out))[0].float()
        return self._logits[key]

    def settle_requests(self) -> None:
        """Let requests in flight finish before memory is released (engines refuse it meanwhile)."""
        for _, fut in self.inflight:
            with contextlib.suppress(Exception):
                fut.result(timeout=SERVE_TIMEOUT_S)

    def count(self, result: protocol.RefitResult, events: list[dict[str, Any]]) -> None:
        cov = type(self).coverage
        cov.runs += 1
        for e in events:
            if (e.get("kind"), e.get("event")) == ("fault", "injected"):
                fault = e.get("fault") or {}
                cov.faults[str(fault.get("state"))] += 1
                cov.kinds[str(fault.get("kind"))] += 1
                path = "cleanup" if e.get("state") in ("ABORTING", "QUARANTINING") else (
                    "retry" if e.get("attempt", 0) > 0 else "first attempt"
                )  # fmt: skip
                cov.paths[path] += 1
        for o in result.engines.values():
            cov.outcomes[o.status] += 1
        if self.ctx is not None and self.ctx.atomic:
            cov.checks["atomic runs"] += 1

    def _audit(self, engine: EngineDriver) -> tuple[list[dict[str, Any]], float] | None:
        """The engine's own record of what it did, and when that record was taken."""
        if _alive(engine):
            with contextlib.suppress(Exception):  # died or hung just now: keep the last audit it gave
                records = engine.audit(timeout=5.0)
                if records is not None:
                    self.audits[id(engine)] = (records, time.monotonic())
        return self.audits.get(id(engine))

    def teardown(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
        for e in [*self.engines, *self.retired]:
            close = getattr(e, "close", None)
            if close is not None:
                close()


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in state.items()}


def _note(message: str) -> None:
    """Hypothesis' note() inside a test case; silent in the sweep (which names its step on failure)."""
    with contextlib.suppress(InvalidArgument):
        note(message)


def _alive(engine: EngineDriver) -> bool:
    return engine.alive


def _dropped_unreachable(events: list[dict[str, Any]], name: str) -> bool:
    return any(
        e.get("kind") == "engine" and e.get("engine") == name and e.get("failure") in ("timeout", "dead", "deadline")
        for e in events
    )


def _settle(machine: DriverStateMachine) -> None:
    """After a hang or a kill: hung engines answer again, dead ones are restarted."""
    for i, e in enumerate(machine.engines):
        if not _alive(e):
            machine.restart(i)
            continue
        with contextlib.suppress(Exception):  # a stalled engine carries on after its injected hang
            getattr(e, "info", lambda **_: None)(timeout=SERVE_TIMEOUT_S)


def sweep(machine: DriverStateMachine) -> None:
    """Deterministic coverage before the random exploration (see the module docstring); every
    check runs after each refit, and a failure names the sweep step."""
    n = machine.n_buckets()
    last = len(machine.engines) - 1
    machine.concurrent_attempt()
    machine.every_invariant_holds()
    # (label, faults, retries, before): before = "release" (memory released first), "requests" (requests
    # in flight when the refit starts) or ""
    steps: list[tuple[str, list[Fault], int, str]] = [("requests in flight, no fault", [], 1, "requests")]
    if machine.ctx is not None and machine.ctx.colocated:  # memory released while the trainer trained
        steps += [
            ("released memory, no fault", [], 1, "release"),
            ("released memory, pause fails", [Fault("PAUSING", engine=last, kind="raise")], 1, "release"),
            ("released memory, connect fails", [Fault("CONNECTING", call="connect", kind="raise")], 1, "release"),
        ]
    for retries in (0, 1):
        for kind in SWEEP_KINDS:
            for state in machine.fault_states():
                if state == "RECONNECTING":  # reached when a member died mid-transfer and the group is rebuilt
                    if retries:
                        died = Fault("TRANSFERRING", engine=0, bucket=min(1, n - 1), kind="kill")
                        steps.append((f"{kind} in {state}", [died, Fault(state, engine=last, kind=kind)], 1, ""))
                    continue
                if retries and (state not in RETRY_STATES or kind in ("hang", "kill")):
                    continue  # retries change nothing outside the update, nor for a hung or dead engine
                buckets: list[int | None] = sorted({0, n // 2, n - 1}) if state == "TRANSFERRING" else [None]  # type: ignore[assignment]
                before = "requests" if state == "TRANSFERRING" and kind in ("raise", "corrupt") else ""
                for b in buckets:
                    faults = [Fault(state, engine=last, bucket=b, kind=kind)]
                    steps.append((f"{kind} in {state}", faults, retries, before))
    for kind in SWEEP_KINDS:
        for target in machine.retry_targets():
            steps.append((f"{kind} in the retry's {target[0]}", machine.retry_path(last, target, kind), 1, ""))
    if machine.ctx is not None and machine.ctx.verify != "off":  # wrong weights the engine does not notice
        for kind in (k for k in SILENT_KINDS if k not in TP_KINDS):
            at_load = SILENT_CALLS.get(kind, "load") == "load"
            state, bucket = ("TRANSFERRING", n // 2) if at_load else ("POST_PROCESSING", None)
            steps.append((f"silent {kind}", [Fault(state, engine=last, bucket=bucket, kind=kind)], 0, ""))
    for label, faults, retries, before in steps:
        if before == "release":
            machine.release_all()
        elif before == "requests":
            machine.requests_in_flight()
        _sweep_step(machine, label, faults, retries)
        _settle(machine)
    machine.every_invariant_holds()


def _sweep_step(machine: DriverStateMachine, label: str, faults: list[Fault], retries: int) -> None:
    for _ in (1, 2):  # a fault can miss its step when something else failed first (a slow rendezvous)
        plan = [copy.copy(f) for f in faults]
        try:
            machine.refit_with(plan, retries=retries)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n(sweep step: {label}: {plan}, retries={retries})") from None
        missed = [f for f in plan if not f.fired]
        if not missed:
            return
        _settle(machine)
    last = machine.last
    how = (
        ""
        if last is None
        else f"; the run ended {last.state}, engines: "
        + ", ".join(f"{o.name} {o.status}" + (f" ({o.error})" if o.error else "") for o in last.engines.values())
    )
    raise AssertionError(f"kit: sweep step {label!r} planned {missed} but it never fired, twice{how}")


def check_engine_driver(
    factory: Callable[[str], EngineDriver],
    *,
    max_examples: int = 25,
    steps: int = 6,
    model: Callable[[], Any] | None = None,
    transport: Callable[[], Transport] | None = None,
    shrink: bool = True,
    sweep_first: bool = True,
    logit_tolerance: float = LOGIT_TOLERANCE,
    call_timeout_s: float = 0.3,
    sweep_atomic: bool = True,
) -> Coverage:
    """Property-test an engine driver against every refit invariant and against what its engines
    serve; raises AssertionError (naming the invariant) with a minimal failing sequence if one
    breaks. Returns the coverage.

    factory: name -> a fresh EngineDriver (a new engine each call, serving the checkpoint `model`
        is initialized from, at version 0). model: builds the trainer's nn.Module (default: the
        reference TinyLlama). transport: builds the transport (default: shared memory). steps: rule
        steps per example. shrink: False reports the first failing sequence without minimizing it.
        sweep_first: run the deterministic sweep before exploring. logit_tolerance: how far a
        served token's logit may trail the trainer's best (raise it for low-precision models).
        call_timeout_s: the engine-call budget in runs with a hang fault (other runs allow at
        least 1 s); raise it for a driver whose wave takes several round trips (one per step).
        sweep_atomic: with `sweep_first`, sweep atomic runs too where the driver's engines stage
        (False: only the random exploration draws them).
    """

    class Machine(DriverStateMachine):
        coverage = Coverage()

    Machine.factory = staticmethod(factory)  # type: ignore[assignment]
    Machine.logit_tolerance = logit_tolerance
    Machine.call_timeout_s = call_timeout_s
    if model is not None:
        Machine.model_factory = staticmethod(model)  # type: ignore[assignment]
    if transport is not None:
        Machine.transport_factory = staticmethod(transport)  # type: ignore[assignment]
    if sweep_first:
        machine = Machine()
        try:
            machine.setup(n=2, mode="colocated", pause_mode="retract", max_staleness=None)
            sweep(machine)
        finally:
            machine.teardown()
    if sweep_first and sweep_atomic:  # and atomic runs, where the driver's engines stage
        machine = Machine()
        try:
            machine.setup(n=2, mode="disaggregated", pause_mode="retract", max_staleness=0, atomic=True)
            if machine.ctx is not None and machine.ctx.atomic:
                sweep(machine)
        finally:
            machine.teardown()
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    run_state_machine_as_test(Machine, settings=kit_settings(max_examples, steps, phases))
    return Machine.coverage


def kit_settings(max_examples: int, steps: int, phases: Sequence[Phase]) -> settings:
    """The kits' Hypothesis settings: derandomized, no database, no deadline, no health checks."""
    return settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, derandomize=True, database=None,
        phases=tuple(phases), suppress_health_check=list(HealthCheck),
    )  # fmt: skip


__all__ = ["Coverage", "DriverStateMachine", "check_engine_driver", "sweep"]
