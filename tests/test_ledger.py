"""The ledger on its own: no processes, no drivers, no clock. Hypothesis drives engines through
every order of call outcomes the engine table allows, and after each one checks that what the
ledger derives (outcomes, what an engine is owed, whether it may be retried) stays consistent with
the facts it keeps."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from refit.buckets import BucketManifest
from refit.drivers.base import Step, StepResult
from refit.errors import NO_EFFECT_KINDS, EngineDied, EngineError, IllegalTransition, InvariantViolation, NoTimeLeft
from refit.protocol.ledger import Engine, Ledger
from refit.states import FACT_TABLES, EngineEvent, EngineState, FactMachine, Failure, Memory, Weights

E, EV = EngineState, EngineEvent
VERSION = 5
STATE_OF = {
    "probe": "CONNECTING", "resume_memory": "OFFLOADING", "pause": "PAUSING", "flush": "INVALIDATING",
    "begin": "INVALIDATING", "load": "TRANSFERRING", "finalize": "POST_PROCESSING", "publish": "CONTINUING",
    "continue_generation": "CONTINUING", "quarantine": "CONTINUING", "release_memory": "CONTINUING",
}  # fmt: skip


def _plan(n: int) -> list[BucketManifest]:
    return [BucketManifest(index=i, entries=(), nbytes=100) for i in range(n)]


def _step(call: str, bucket: int | None = None) -> Step:
    args: tuple[Any, ...] = ()
    if call in ("resume_memory", "release_memory"):
        args = (["weights"],)
    elif call == "probe":
        args = (VERSION,)
    return Step(call, STATE_OF[call], args, bucket)


ERRORS = {
    "error": lambda: RuntimeError("refused"),
    "no_effect": lambda: EngineError(sorted(NO_EFFECT_KINDS)[0], "refused before any change"),
    "timeout": lambda: TimeoutError("no answer"),
    "deadline": lambda: NoTimeLeft("no time left"),
    "dead": lambda: EngineDied("gone"),
}


ANY_OUTCOME = [*sorted(ERRORS), "ok", "ok", "ok", "ok", "ok"]  # mostly ok: runs reach the end


class LedgerMachine(RuleBasedStateMachine):
    """One engine of a three-bucket plan, driven call by call; the rules' preconditions are what
    the engine table allows (a call the runner would not make there raises, and is checked too)."""

    @initialize(previous=st.sampled_from([None, 3, 4]), moves=st.booleans())
    def start(self, previous: int | None, moves: bool) -> None:
        self.engine = Engine(0, "e0", 1, "inc", previous, begin_moves_weights=moves)
        self.ledger = Ledger(VERSION, [self.engine])
        self.ledger.plan = _plan(3)
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.touched = False  # a load was sent that may have changed the weights

    def _apply(self, call: str, outcome: str, value: Any = None, bucket: int | None = None) -> None:
        step = _step(call, bucket)
        res = StepResult("ok", value) if outcome == "ok" else StepResult("error", error=ERRORS[outcome]())
        before = self.engine.failure.state
        try:
            events = self.ledger.apply(self.engine, step, res)
        except InvariantViolation:
            # the only refusal the ledger makes of a well-formed call: continuing unnamed weights
            assert call == "continue_generation" and self.engine.must_not_serve
            return
        dropped = [ev for ev in events if ev[1] == "dropped"]
        assert len(dropped) == (self.engine.failure.state != before)
        self.events += events

    @precondition(lambda self: self.engine.state == E.JOINED and self.engine.region("weights") == Memory.AS_FOUND)
    @rule(outcome=st.sampled_from(["ok", "ok", "error", "dead"]), intact=st.booleans(), said=st.booleans())
    def resume_weights(self, outcome: str, intact: bool, said: bool) -> None:
        value = {"weights_intact": intact, "resumed": ["weights"] if said else []}
        self._apply("resume_memory", outcome, value)
        if outcome == "ok":  # taken only when the engine says it was released before
            assert self.engine.region("weights") == (Memory.TAKEN if said else Memory.RESUMED)
            assert intact or self.engine.weights.state == Weights.LOST

    @precondition(lambda self: self.engine.position.can(EV.PAUSE) and self.engine.active)
    @rule(outcome=st.sampled_from(ANY_OUTCOME))
    def pause(self, outcome: str) -> None:
        self._apply("pause", outcome)

    @precondition(lambda self: self.engine.state == E.PAUSED and self.engine.active)
    @rule(outcome=st.sampled_from(ANY_OUTCOME))
    def begin(self, outcome: str) -> None:
        self._apply("begin", outcome)

    @precondition(lambda self: self.engine.state == E.OPEN and self.engine.active)
    @rule(bucket=st.integers(0, 2), outcome=st.sampled_from(ANY_OUTCOME))
    def load(self, bucket: int, outcome: str) -> None:
        self._apply("load", outcome, bucket=bucket)
        self.touched |= outcome != "no_effect"

    @precondition(lambda self: self.engine.state == E.OPEN and self.engine.reachable)
    @rule(outcome=st.sampled_from(ANY_OUTCOME))
    def finalize(self, outcome: str) -> None:
        self._apply("finalize", outcome)
        assert self.engine.state != E.OPEN or outcome in ("timeout", "deadline", "dead")

    @precondition(lambda self: self.engine.state == E.FINALIZED and self.engine.active)
    @rule(outcome=st.sampled_from(ANY_OUTCOME))
    def publish(self, outcome: str) -> None:
        self._apply("publish", outcome)

    @precondition(lambda self: self.engine.state == E.PUBLISHED)  # a paused one is continued by `settle`
    @rule(outcome=st.sampled_from(["ok", "ok", "error", "dead"]))
    def continue_generation(self, outcome: str) -> None:
        self._apply("continue_generation", outcome)

    @precondition(lambda self: self.engine.position.can(EV.QUARANTINE) and self.engine.must_not_serve)
    @rule(outcome=st.sampled_from(["ok", "error", "dead"]))
    def quarantine(self, outcome: str) -> None:
        self._apply("quarantine", outcome)

    @rule()
    def retry(self) -> None:
        if self.ledger.retryable(retries=5):
            self.ledger.begin_attempt(self.engine, self.engine.attempt + 1)
            assert self.engine.active and not self.engine.acked

    @precondition(lambda self: not self.engine.active or self.engine.state == E.PUBLISHED)
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        """Whatever the engine is owed is legal from where it stands, and applying it settles it."""
        for step in self.ledger.owed(
            self.engine, colocated=False, cont="CONTINUING", quarantine="CONTINUING", kv="CONTINUING", reason="r"
        ):
            self._apply(step.call, data.draw(st.sampled_from(["ok", "ok", "error"])))
            if not self.engine.reachable:
                break

    @invariant()
    def only_named_weights_serve(self) -> None:
        e = self.engine
        if e.state == E.SERVING:
            assert e.published or (e.weights.state == Weights.KEPT and e.previous_version is not None)

    @invariant()
    def a_load_that_may_have_landed_changes_the_weights(self) -> None:
        if self.touched:
            assert self.engine.weights.state != Weights.KEPT

    @invariant()
    def outcome_follows_the_facts(self) -> None:
        e = self.engine
        o = self.ledger.outcome(e, colocated=False)
        if o.status == "updated":
            assert e.published and e.state == E.SERVING and e.acked == {0, 1, 2} and o.version == VERSION
        if o.status == "unchanged":
            assert e.weights.state == Weights.KEPT and o.version == e.previous_version is not None
        if o.status == "stale":
            assert e.previous_version is None and e.state == E.JOINED
        if e.state == E.GONE:
            assert o.status == "failed" and e.failure.state in (Failure.DEAD, Failure.TIMEOUT)

    @invariant()
    def owed_never_continues_a_poisoned_engine(self) -> None:
        e = self.engine
        steps = [
            s.call
            for s in self.ledger.owed(
                e, colocated=False, cont="CONTINUING", quarantine="CONTINUING", kv="CONTINUING", reason="r"
            )
        ]
        if e.must_not_serve and e.state in (E.PAUSED, E.OPEN, E.FINALIZED):
            assert "continue_generation" not in steps and steps[-1] == "quarantine"
        if e.state == E.PAUSED and not e.must_not_serve:
            assert steps == ["continue_generation"]

    @invariant()
    def retried_only_after_an_error_inside_the_update(self) -> None:
        for e in self.ledger.retryable(retries=5):
            assert e.failure.state == Failure.ERROR and e.state == E.PAUSED


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_a_call_the_engine_table_forbids_raises() -> None:
    e = Engine(0, "e0", 1, "inc", 4)
    ledger = Ledger(VERSION, [e])
    ledger.plan = _plan(1)
    with pytest.raises(IllegalTransition, match="from state JOINED"):
        ledger.apply(e, _step("finalize"), StepResult("ok"))  # JOINED: never opened


def test_a_probe_at_or_past_the_target_version_drops_the_engine_and_is_remembered() -> None:
    e = Engine(0, "e0", 1, "inc", 4)
    ledger = Ledger(VERSION, [e])
    events = ledger.apply(e, _step("probe"), StepResult("ok", {"version": VERSION}))
    assert ledger.ahead == ["e0"] and e.failure.state == Failure.ERROR and e.previous_version == VERSION
    assert events == [("engine", "dropped", {"engine": "e0", "failure": "error", "error": events[0][2]["error"]})]


def test_a_worse_failure_replaces_a_milder_one_and_death_is_final() -> None:
    e = Engine(0, "e0", 1, "inc", 4)
    ledger = Ledger(VERSION, [e])
    ledger.apply(e, _step("pause"), StepResult("ok"))
    assert [ev[2]["failure"] for ev in ledger.drop(e, _step("flush"), RuntimeError("x"))] == ["error"]
    assert [ev[2]["failure"] for ev in ledger.drop(e, _step("flush"), TimeoutError("x"))] == ["timeout"]
    assert e.state == E.GONE and e.failed_in == "INVALIDATING"
    assert ledger.drop(e, _step("flush"), RuntimeError("x")) == []  # milder: no change, no event
    assert [ev[2]["failure"] for ev in ledger.drop(e, _step("flush"), EngineDied("x"))] == ["dead"]
    assert ledger.drop(e, _step("flush"), TimeoutError("x")) == [] and e.failure.state == Failure.DEAD


def test_memory_the_run_took_is_given_back_when_the_engine_never_paused() -> None:
    e = Engine(0, "e0", 1, "inc", 4)
    ledger = Ledger(VERSION, [e])
    ok = StepResult("ok", {"weights_intact": True, "resumed": ["weights"]})
    ledger.apply(e, _step("resume_memory"), ok)
    owed = ledger.owed(e, colocated=True, cont="ABORTING", quarantine="QUARANTINING", kv="ABORTING", reason="r")
    assert [s.call for s in owed] == ["release_memory"]
    ledger.apply(e, owed[0], StepResult("ok"))
    assert e.region("weights") == Memory.AS_FOUND
    assert ledger.outcome(e, colocated=True).status == "unchanged"


@pytest.mark.parametrize("name", sorted(FACT_TABLES))
def test_every_fact_state_is_reachable_and_unlisted_moves_raise(name: str) -> None:
    transitions, initial, _ = FACT_TABLES[name]
    states = set(type(initial))
    reached, frontier = {initial}, [initial]
    while frontier:
        here = frontier.pop()
        for _, sources, dest in transitions:
            if here in sources and dest not in reached:
                reached.add(dest)
                frontier.append(dest)
    assert reached == states, f"{name}: unreachable {states - reached}"
    events = {event for event, _, _ in transitions}
    for state in states:
        for event in events:
            m = FactMachine(name, state)
            if not any(state in sources for ev, sources, _ in transitions if ev == event):
                with pytest.raises(IllegalTransition):
                    m.fire(event)
