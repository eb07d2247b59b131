"""The state table is the truth: exactly its moves are legal, every other one raises a named error."""

from __future__ import annotations

import pytest

from refit.states import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    IllegalTransition,
    RefitMachine,
    RefitState,
    Trigger,
)

LEGAL = {(src, trig): dst for trig, sources, dst in TRANSITIONS for src in sources}


@pytest.mark.parametrize("state", list(RefitState))
@pytest.mark.parametrize("trigger", list(Trigger))
def test_every_state_trigger_pair(state: RefitState, trigger: Trigger) -> None:
    """Each (state, trigger) pair moves exactly as the table says, or raises IllegalTransition naming both."""
    m = RefitMachine(initial=state)
    if (state, trigger) in LEGAL:
        assert m.can(trigger)
        assert m.fire(trigger) == LEGAL[(state, trigger)]
        assert m.state == LEGAL[(state, trigger)]
    else:
        assert not m.can(trigger)
        with pytest.raises(IllegalTransition) as info:
            m.fire(trigger)
        assert str(state) in str(info.value) and str(trigger) in str(info.value)
        assert m.state == state  # a refused move changes nothing


def test_unknown_trigger_is_refused() -> None:
    with pytest.raises(IllegalTransition, match="'to_DONE' is not legal from state IDLE"):
        RefitMachine().fire("to_DONE")  # transitions' auto-transitions are off


def test_terminal_states_have_no_exits() -> None:
    for state in TERMINAL_STATES:
        assert RefitMachine(initial=state).legal_triggers() == []


def test_every_state_reachable_and_every_run_can_end() -> None:
    """From IDLE every state is reachable, and from every state a terminal state is reachable."""
    graph: dict[RefitState, set[RefitState]] = {s: set() for s in RefitState}
    for (src, _), dst in LEGAL.items():
        graph[src].add(dst)

    def reach(start: RefitState) -> set[RefitState]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert reach(RefitState.IDLE) == set(RefitState)
    for state in RefitState:
        assert reach(state) & set(TERMINAL_STATES), state


def test_failure_is_latched() -> None:
    """Any active state can fail; FAILED is reached only through ABORTING and never left."""
    for state in ACTIVE_STATES:
        m = RefitMachine(initial=state)
        m.fire(Trigger.FAIL)
        assert m.state == RefitState.ABORTING
        m.fire(Trigger.LATCH)
        assert m.state == RefitState.FAILED
        for trigger in Trigger:
            with pytest.raises(IllegalTransition):
                m.fire(trigger)


def test_happy_paths() -> None:
    colocated = [
        "offload",
        "connect",
        "pause",
        "invalidate",
        "transfer",
        "next_bucket",
        "post_process",
        "publish",
        "restore",
        "finish",
    ]
    disaggregated = ["connect", "pause", "invalidate", "transfer", "post_process", "publish", "finish"]
    for path in (colocated, disaggregated):
        m = RefitMachine()
        for trigger in path:
            m.fire(trigger)
        assert m.state == RefitState.DONE
