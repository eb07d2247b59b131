"""Conformance kit for engine drivers: property-test your driver against every refit invariant.

    from refit.testing import check_engine_driver

    def test_my_driver_conforms():
        check_engine_driver(lambda name: MyEngineDriver.start(name), max_examples=25)

First a deterministic sweep: one refit with each fault kind (raise, corrupt, kill, hang) in each
state, on two engines. Then a Hypothesis rule-based state machine drives `protocol.run` over
engines built by your factory:
random engine counts (1-3), colocated or disaggregated runs, pause modes, retries, and random
single faults (raise, hang, kill, corrupt) at random (state, engine, bucket); concurrent attempts
while another owner holds the lock, late releases by stale owner tokens, and engines restarted
after they died. After every step it checks

  * every trace invariant (refit.invariants.check_trace) over everything recorded so far, and
  * when the driver exposes `audit()` (what the engine itself did), the engine-side invariants
    (check_engine_audit) and that every acknowledged bucket had really been copied (check_acks).

A failure raises AssertionError naming the invariant, and Hypothesis prints the shortest sequence
of steps that breaks it. Trace checks see what the driver *reported*; only the audit shows what
the engine *did*, so a driver that reports success without doing the work is caught only through
`audit()`. The default model, source and transport are the reference engine's (TinyLlama, torch
source, shared memory); pass `model` / `transport` for drivers of other engines.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
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
from refit.drivers.base import EngineDriver, Transport
from refit.drivers.buckets import plan_buckets
from refit.errors import RefitBusyError
from refit.protocol.faults import Fault
from refit.states import ACTIVE_STATES

FAULT_KINDS = ("kill", "corrupt", "raise", "hang", "corrupt", "raise")  # Hypothesis favours the first ones


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

    def __init__(self) -> None:
        super().__init__()
        self.engines: list[EngineDriver] = []
        self.retired: list[EngineDriver] = []
        self.ctx: protocol.RefitContext | None = None
        self.steps = 0
        self.runs_of: dict[int, set[str]] = {}  # id(engine) -> runs it took part in
        self.audits: dict[int, tuple[list[dict[str, Any]], float]] = {}  # id(engine) -> (audit, taken at)

    # ---- set-up -------------------------------------------------------------------------------

    @initialize(
        n=st.integers(1, 3),
        mode=st.sampled_from(["colocated", "disaggregated"]),
        pause_mode=st.sampled_from(["abort", "retract"]),
    )
    def setup(self, n: int, mode: str, pause_mode: str) -> None:
        from refit.drivers.torch_source import TorchSource

        self.engines = [type(self).factory(f"kit{i}") for i in range(n)]
        self.model = type(self).model_factory()
        self.ctx = protocol.RefitContext(
            source=TorchSource(self.model),
            transport=type(self).transport_factory(),
            engines=self.engines,
            mode=mode,  # type: ignore[arg-type]
            pause_mode=pause_mode,  # type: ignore[arg-type]
            bucket_bytes=type(self).bucket_bytes,
            deadline_s=10.0,
            cleanup_grace_s=2.0,
            call_timeout_s=0.3,
            version=0,
        )
        _note(f"{n} engines, {mode}, pause {pause_mode}")

    # ---- rules --------------------------------------------------------------------------------

    def n_buckets(self) -> int:
        assert self.ctx is not None
        return len(plan_buckets(self.ctx.source.metas(), self.ctx.bucket_bytes))

    def fault_states(self) -> list[str]:
        """States a fault can fire in: offload/restore exist only in colocated runs."""
        assert self.ctx is not None
        return [str(s) for s in ACTIVE_STATES if self.ctx.colocated or s not in ("OFFLOADING", "RESTORING")]

    @rule(data=st.data(), retries=st.integers(0, 1), faulty=st.booleans())
    def refit(self, data: st.DataObject, retries: int, faulty: bool) -> None:
        """A training step, then a refit, maybe with one fault injected somewhere."""
        fault = None
        if faulty:  # only faults that can fire: a bucket only in TRANSFERRING
            state = data.draw(st.sampled_from(self.fault_states()), label="state")
            n = self.n_buckets()
            buckets = sorted({0, n // 2, n - 1}) if state == "TRANSFERRING" else [None]
            fault = Fault(
                state,
                engine=data.draw(st.integers(0, len(self.engines) - 1), label="engine"),
                bucket=data.draw(st.sampled_from(buckets), label="bucket"),
                kind=data.draw(st.sampled_from(FAULT_KINDS), label="kind"),
            )
        self.refit_with(fault, retries)

    def refit_with(self, fault: Fault | None, retries: int) -> None:
        import torch

        assert self.ctx is not None
        self.steps += 1
        with torch.no_grad():
            gen = torch.Generator().manual_seed(self.steps)
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        self.ctx.retries = retries
        self.ctx.faults = protocol.FaultPlan([fault]) if fault else None
        result = protocol.run(self.ctx)  # raises InvariantViolation if the run's own events break one
        for e in self.engines:
            self.runs_of.setdefault(id(e), set()).add(result.run_id)
        _note(f"refit {self.steps}: {fault} -> {result.state} {[(o.name, o.status) for o in result.engines.values()]}")
        assert self.ctx.lock is not None and self.ctx.lock.holder is None, "lock: still held after the run"
        for name, o in result.engines.items():
            if o.status == "updated":
                assert o.version == result.version, f"version: engine {name} updated but reports {o.version}"

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
        self.engines[i] = type(self).factory(self.engines[i].name)
        assert self.ctx is not None
        self.ctx.engines[i] = self.engines[i]
        _note(f"restarted engine {i}")

    @precondition(lambda self: any(_alive(e) and hasattr(e, "submit") for e in self.engines))
    @rule()
    def requests_in_flight(self) -> None:
        """Rollouts running when the next refit starts (exercises pause modes)."""
        for e in self.engines:
            if _alive(e) and hasattr(e, "submit"):
                e.submit([1, 2, 3, 4], 40)

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


def sweep(machine: DriverStateMachine) -> None:
    """Deterministic coverage before the random exploration: one refit with each fault kind in
    each state (middle bucket in TRANSFERRING, on the last engine), no retries, every invariant
    checked after each; dead engines are restarted; then a concurrent attempt."""
    for kind in ("raise", "corrupt", "kill", "hang"):
        for state in machine.fault_states():
            bucket = machine.n_buckets() // 2 if state == "TRANSFERRING" else None
            fault = Fault(state, engine=len(machine.engines) - 1, bucket=bucket, kind=kind)
            try:
                machine.refit_with(fault, retries=0)
                machine.every_invariant_holds()
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n(sweep step: refit with {fault}, no retries)") from None
            for i, e in enumerate(machine.engines):
                if not _alive(e):
                    machine.restart(i)
    machine.refit_with(None, retries=1)
    machine.concurrent_attempt()
    machine.every_invariant_holds()


def check_engine_driver(
    factory: Callable[[str], EngineDriver],
    *,
    max_examples: int = 25,
    steps: int = 6,
    model: Callable[[], Any] | None = None,
    transport: Callable[[], Transport] | None = None,
    shrink: bool = True,
    sweep_first: bool = True,
) -> None:
    """Property-test an engine driver against every refit invariant; raises AssertionError (naming
    the invariant) with a minimal failing sequence if one breaks.

    factory: name -> a fresh EngineDriver (a new engine each call, serving the checkpoint `model`
        is initialized from). model: builds the trainer's nn.Module (default: the reference
        TinyLlama). transport: builds the transport (default: shared memory). steps: rule steps per
        example. shrink: False reports the first failing sequence without minimizing it.
        sweep_first: run the deterministic sweep (every state x fault kind) before exploring.
    """

    class Machine(DriverStateMachine):
        pass

    Machine.factory = staticmethod(factory)  # type: ignore[assignment]
    if model is not None:
        Machine.model_factory = staticmethod(model)  # type: ignore[assignment]
    if transport is not None:
        Machine.transport_factory = staticmethod(transport)  # type: ignore[assignment]
    if sweep_first:
        machine = Machine()
        try:
            machine.setup(n=2, mode="colocated", pause_mode="retract")
            sweep(machine)
        finally:
            machine.teardown()
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            derandomize=True,
            database=None,
            phases=phases,
            suppress_health_check=list(HealthCheck),
        ),
    )


__all__ = ["DriverStateMachine", "check_engine_driver", "sweep"]
