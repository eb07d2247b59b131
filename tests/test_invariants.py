"""The invariants pass real traces and catch each kind of broken trace (mutations of a real one)."""

from __future__ import annotations

import copy

import pytest

from refit import invariants, protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama

from .conftest import CONFIG, perturbed


def record(
    mode: str = "colocated", faults: protocol.FaultPlan | None = None, runs: int = 1, retries: int = 1
) -> list[dict]:
    engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    ctx = protocol.RefitContext(
        TorchSource(model),
        SharedMemoryTransport(),
        engines,
        mode=mode,
        bucket_bytes=64 << 10,
        faults=faults,
        retries=retries,
    )
    try:
        for _ in range(runs):
            protocol.run(ctx)
    finally:
        ctx.close()
        for e in engines:
            e.close()
    return copy.deepcopy(list(ctx.recorder.events))


@pytest.fixture(scope="module")
def clean() -> list[dict]:
    return record(runs=2)


@pytest.fixture(scope="module")
def failed() -> list[dict]:
    """The trainer failed mid-transfer: the run fails, both engines are poisoned and quarantined."""
    return record(faults=protocol.FaultPlan().fail_at("transferring", bucket=2, call="pack"))


@pytest.fixture(scope="module")
def partial() -> list[dict]:
    """Engine e1 failed mid-transfer (no retries): e0 takes the version, e1 is quarantined."""
    return record(faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, call="load"), retries=0)


def renumber(events: list[dict]) -> list[dict]:
    for i, e in enumerate(events):
        e["seq"] = i
    return events


def find(events: list[dict], event: str, *, engine: str | None = None, kind: str = "call", nth: int = 0) -> int:
    hits = [
        i
        for i, e in enumerate(events)
        if e["kind"] == kind and e["event"] == event and (engine is None or e.get("engine") == engine)
    ]
    return hits[nth]


def names(violations: list[invariants.Violation]) -> set[str]:
    return {v.invariant for v in violations}


def test_real_traces_are_clean(clean: list[dict], failed: list[dict], partial: list[dict]) -> None:
    assert invariants.check_trace(clean) == []
    assert invariants.check_trace(failed) == []
    assert invariants.check_trace(partial) == []
    assert [e["engine"] for e in failed if e["kind"] == "call" and e["event"] == "quarantine"] == [
        "e0",
        "e1",
    ]  # really failed
    assert [e["engine"] for e in partial if e["kind"] == "call" and e["event"] == "quarantine"] == ["e1"]
    assert [e["engine"] for e in partial if e["kind"] == "call" and e["event"] == "publish"] == ["e0"]


def test_lock_never_released(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    del ev[find(ev, "release", kind="lock")]
    assert "lock" in names(invariants.check_trace(renumber(ev)))


def test_lock_released_by_another_owner(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    ev[find(ev, "release", kind="lock")]["owner"] = "someone-else"
    found = invariants.check_trace(ev)
    assert "lock" in names(found)
    assert any("released by someone-else" in v.message for v in found)


def test_call_after_lock_release(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    i = find(ev, "release", kind="lock")
    ev.insert(i + 1, {**ev[find(ev, "pause")], "seq": -1})
    assert "lock" in names(invariants.check_trace(renumber(ev)))


def test_publish_before_the_last_bucket(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    pub = ev.pop(find(ev, "publish", engine="e0"))
    ev.insert(find(ev, "load", engine="e1", nth=5), pub)
    found = invariants.check_trace(renumber(ev))
    assert "version" in names(found)
    assert any("published before its refit was complete" in v.message for v in found)


def test_versions_must_increase(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    ends = [e for e in ev if e["kind"] == "run" and e["event"] == "end"]
    ends[1]["published"] = ends[0]["published"]
    assert any("does not increase" in v.message for v in invariants.check_trace(ev))


def test_failed_run_that_claims_a_version(failed: list[dict]) -> None:
    ev = copy.deepcopy(failed)
    ev[find(ev, "end", kind="run")]["published"] = 1
    assert "version" in names(invariants.check_trace(ev))


def test_finalize_twice(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    i = find(ev, "finalize", engine="e1")
    ev.insert(i + 1, copy.deepcopy(ev[i]))
    assert "finalize_once" in names(invariants.check_trace(renumber(ev)))


def test_finalize_skipped(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    del ev[find(ev, "finalize", engine="e0")]
    assert {"finalize_once", "version"} <= names(invariants.check_trace(renumber(ev)))


def test_paused_engine_left_paused(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    del ev[find(ev, "continue_generation", engine="e1")]
    assert "pause_continue" in names(invariants.check_trace(renumber(ev)))


def test_poisoned_engine_continued(partial: list[dict]) -> None:
    ev = copy.deepcopy(partial)
    q = find(ev, "quarantine", engine="e1")
    ev[q] = {**ev[q], "event": "continue_generation"}
    found = invariants.check_trace(renumber(ev))
    assert any(v.invariant == "pause_continue" and "partial transfer" in v.message for v in found)


def test_bucket_before_flush(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    del ev[find(ev, "flush", engine="e0")]
    found = invariants.check_trace(renumber(ev))
    assert any(v.invariant == "kv_fresh" and "before its KV cache was flushed" in v.message for v in found)


def test_flush_before_pause(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    flush = ev.pop(find(ev, "flush", engine="e0"))
    ev.insert(find(ev, "pause", engine="e0"), flush)
    assert "kv_fresh" in names(invariants.check_trace(renumber(ev)))


@pytest.mark.parametrize(
    ("after", "answer"),
    [
        ("pause", {}),
        ("flush", {}),
        ("pause", {"outcome": "error", "late": True, "error": "LateAnswer: answered after its budget"}),
    ],
    ids=["after-pause", "after-flush", "late-answer"],
)
def test_continued_between_pause_and_first_bucket(clean: list[dict], after: str, answer: dict) -> None:
    """A continue that may have run (answered ok, or late: its effect unknown) between the pause
    and the first bucket; one the engine refused before any effect would not count."""
    ev = copy.deepcopy(clean)
    resume = {**copy.deepcopy(ev[find(ev, "continue_generation", engine="e0")]), **answer}
    ev.insert(find(ev, after, engine="e0") + 1, resume)
    found = invariants.check_trace(renumber(ev))
    assert any(v.invariant == "kv_fresh" and "continued between its pause" in v.message for v in found)
    refused = {**resume, "outcome": "error", "effect": "none", "error": "EngineError: refused"}
    ev[find(ev, after, engine="e0") + 1] = refused
    found = invariants.check_trace(renumber(ev))
    assert not any(v.invariant == "kv_fresh" and "continued between its pause" in v.message for v in found)


def test_trainer_never_restored(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    del ev[find(ev, "restore")]
    assert "paired" in names(invariants.check_trace(renumber(ev)))


def test_buffer_released_before_its_ack(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    rel = ev.pop(find(ev, "release", kind="call"))
    bucket = rel["bucket"]
    ev.insert(next(i for i, e in enumerate(ev) if e["event"] == "load" and e.get("bucket") == bucket), rel)
    found = invariants.check_trace(renumber(ev))
    assert any(v.invariant == "paired" and "released before engines" in v.message for v in found)


def test_connected_twice_and_never_disconnected(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    ev.insert(find(ev, "connect") + 1, copy.deepcopy(ev[find(ev, "connect")]))
    assert any("connected again" in v.message for v in invariants.check_trace(renumber(ev)))
    ev = copy.deepcopy(clean)
    del ev[find(ev, "disconnect")]
    assert any("still connected" in v.message for v in invariants.check_trace(renumber(ev)))


def test_run_past_its_deadline(clean: list[dict]) -> None:
    ev = copy.deepcopy(clean)
    ev[find(ev, "end", kind="run")]["t"] += 1000.0
    assert "deadline" in names(invariants.check_trace(ev))


@pytest.mark.parametrize("cut", [0.25, 0.5, 0.9, 0.999])
def test_a_cut_off_trace_is_a_violation(clean: list[dict], cut: float) -> None:
    ev = copy.deepcopy(clean)[: int(len(clean) * cut)]
    found = invariants.check_trace(ev)
    assert "complete" in names(found)


def test_commit_gate_names_what_is_missing(clean: list[dict]) -> None:
    run = [e for e in clean if e.get("run") == clean[0]["run"]]
    before_finalize = run[: find(run, "finalize", engine="e0")]
    problems = invariants.commit_gate(before_finalize, ["e0", "e1"], 8)
    assert problems == [
        "engine e0 has not finalized exactly once in attempt 0",
        "engine e1 has not finalized exactly once in attempt 0",
    ]
    assert invariants.commit_gate(run, ["e0", "e1"], 8) == []
