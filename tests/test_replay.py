"""`refit replay`: recorded runs re-executed through the real runner, divergence reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refit import protocol
from refit.cli import main
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.invariants import check_trace
from refit.reference.model import TinyLlama
from refit.replay import replay
from refit.trace import load_trace

from .conftest import CONFIG, perturbed

TRACES = sorted((Path(__file__).parent / "traces").glob("*.jsonl"))


def test_fixtures_are_there() -> None:
    assert len(TRACES) >= 5


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_a_recorded_failure_replays_exactly(path: Path) -> None:
    """Each shipped trace reaches the same events, final state and failing call today."""
    _, events, torn = load_trace(path)
    assert check_trace(events, torn=torn) == []  # the recorded run kept every invariant
    report = replay(path)
    assert report.divergence is None, str(report.divergence)
    assert report.same and report.recorded[0].state in ("DONE", "FAILED")
    assert report.recorded[0].failing_event is not None  # these are failing runs


def record_demo_like(path: Path, faults: protocol.FaultPlan | None = None, runs: int = 3) -> None:
    engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    model = TinyLlama(CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model),
        SharedMemoryTransport(),
        engines,
        mode="colocated",
        bucket_bytes=64 << 10,
        trace=path,
        faults=faults,
    )
    try:
        for step in range(runs):
            perturbed(model, seed=step)
            protocol.run(ctx)
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_a_fresh_multi_run_trace_replays(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    record_demo_like(path, protocol.FaultPlan().fail_at("transferring", engine=1, bucket=3, kind="kill"))
    report = replay(path)
    assert report.divergence is None and report.runs == 3
    assert [s.state for s in report.replayed] == [s.state for s in report.recorded]


@pytest.mark.parametrize("call", ["probe", "pause", "load"])
def test_a_driver_that_raises_a_plain_error_is_checked_and_replayed(call: str, tmp_path: Path) -> None:
    """A driver bug that raises a plain RuntimeError (no refit error type): the trace it leaves
    passes `refit check` and `refit replay` (replay rebuilt it under another type name, so the
    decisions check and the replay reported a divergence; found by review of issue 20)."""
    path = tmp_path / "t.jsonl"
    engines = [ReferenceEngine.in_thread(f"raise{i}", CONFIG, seed=0) for i in range(2)]
    original = engines[1].run_steps_async

    def raising(steps, *, timeout, executor):  # type: ignore[no-untyped-def]
        if any(s.call == call for s in steps):
            raise RuntimeError(f"driver bug raising on {call}")
        return original(steps, timeout=timeout, executor=executor)

    engines[1].run_steps_async = raising  # type: ignore[method-assign]
    model = TinyLlama(CONFIG, seed=1)
    try:
        with protocol.RefitContext(
            TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=64 << 10, trace=path, retries=0
        ) as ctx:
            result = protocol.run(ctx)
            assert result.engines["raise0"].status == "updated" and result.engines["raise1"].status != "updated"
    finally:
        for e in engines:
            e.close()
    assert "RuntimeError: driver bug" in path.read_text()
    assert main(["check", str(path)]) == 0
    assert main(["replay", str(path)]) == 0


def tamper(src: Path, dst: Path, match: dict, change: dict) -> None:
    lines = []
    done = False
    for line in src.read_text().splitlines():
        event = json.loads(line)
        if not done and all(event.get(k) == v for k, v in match.items()):
            event.update(change)
            done = True
        lines.append(json.dumps(event))
    assert done
    dst.write_text("\n".join(lines) + "\n")


def test_a_different_outcome_diverges_where_the_path_changes(tmp_path: Path) -> None:
    path, bad = tmp_path / "t.jsonl", tmp_path / "bad.jsonl"
    record_demo_like(path, runs=1)
    tamper(
        path,
        bad,
        {"event": "load", "engine": "e1", "bucket": 5},
        {"outcome": "error", "error": "EngineError: internal: x"},
    )
    report = replay(bad)
    d = report.divergence
    assert d is not None
    assert d.got is not None and (d.got["kind"], d.got["event"], d.got["engine"]) == ("engine", "dropped", "e1")
    assert d.expected is not None and d.expected != d.got


def test_changed_code_is_reported_at_its_first_different_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """The corrupt trace was recorded by a runner that retries; a runner that does not diverges at the retry."""
    monkeypatch.setattr("refit.protocol.ledger.RETRY_STATES", ())
    report = replay(Path(__file__).parent / "traces" / "corrupt-then-retried.jsonl")
    d = report.divergence
    assert d is not None
    assert d.expected is not None and (d.expected["kind"], d.expected["event"]) == ("transition", "retry")
    assert d.got is not None and d.got["event"] == "publish"


def test_replay_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(TRACES[0])]) == 0
    assert "reproduced" in capsys.readouterr().out
    path, bad = tmp_path / "t.jsonl", tmp_path / "bad.jsonl"
    record_demo_like(path, runs=1)
    tamper(
        path, bad, {"event": "flush", "engine": "e0"}, {"outcome": "error", "error": "EngineError: flush_refused: x"}
    )
    assert main(["replay", str(bad)]) == 1
    assert "DIVERGED at event" in capsys.readouterr().out
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2


def _check_and_replay(path: Path) -> None:
    """An untouched real trace passes `refit check` (invariants and replayed decisions) and replays."""
    assert main(["check", str(path)]) == 0
    report = replay(path)
    assert report.divergence is None, str(report.divergence)


def test_runs_that_hit_their_deadline_replay(tmp_path: Path) -> None:
    """Every engine hangs on pause and the deadline passes: the calls the runner budgeted before the
    deadline replay as timeouts, not as calls it had no time to send (the replay clock reads when a
    call began, not when it was recorded)."""
    engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    path = tmp_path / "deadline.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(perturbed(TinyLlama(CONFIG, seed=0), seed=1)), SharedMemoryTransport(), engines,
        bucket_bytes=64 << 10, deadline_s=1.0, cleanup_grace_s=0.0, trace=path,
        faults=protocol.FaultPlan().fail_at("pausing", engine=0, kind="hang").fail_at("pausing", engine=1, kind="hang"),
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert not result.ok
    finally:
        ctx.close()
        for e in engines:
            e.close()
    _check_and_replay(path)


def test_an_engine_set_that_changes_between_runs_replays(tmp_path: Path) -> None:
    """Engines join and leave between runs of one context: each run replays with its own engines."""
    pool = {n: ReferenceEngine.in_thread(n, CONFIG, seed=0) for n in ("e0", "e1", "e2")}
    path = tmp_path / "engines.jsonl"
    model = TinyLlama(CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [pool["e0"], pool["e1"]], bucket_bytes=64 << 10, trace=path
    )
    try:
        for names in (["e0", "e1"], ["e0", "e1", "e2"], ["e1", "e2"]):
            perturbed(model, seed=len(names))
            ctx.engines = [pool[n] for n in names]
            protocol.run(ctx)
    finally:
        ctx.close()
        for e in pool.values():
            e.close()
    _check_and_replay(path)


def test_a_context_behind_its_engines_replays(tmp_path: Path) -> None:
    """A second context over engines that already hold version 1 is refused before any byte; the
    refusal (the version the probe found) replays."""
    engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    model = TinyLlama(CONFIG, seed=0)
    try:
        for i in range(2):
            ctx = protocol.RefitContext(
                TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=64 << 10,
                trace=tmp_path / f"ctx{i}.jsonl",
            )  # fmt: skip
            result = protocol.run(ctx)
            ctx.close()
            assert result.ok == (i == 0)
    finally:
        for e in engines:
            e.close()
    _check_and_replay(tmp_path / "ctx1.jsonl")


@pytest.mark.parametrize("state", ["restoring", "connecting"])
def test_a_hang_with_no_call_timeout_keeps_the_deadline_and_replays(state: str, tmp_path: Path) -> None:
    """call_timeout_s=None (each call may take the whole deadline): an engine hangs while the trainer
    restores (its restore answered in time must not be recorded as past its budget), or while a
    restarted engine is connected (the detach before it uses the run's deadline, not the cleanup
    grace). The run ends inside deadline + grace and its trace checks and replays."""
    engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    path = tmp_path / f"{state}.jsonl"
    model = TinyLlama(CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, mode="colocated", bucket_bytes=64 << 10,
        call_timeout_s=None if state == "connecting" else 5.0, deadline_s=2.0, cleanup_grace_s=2.0, trace=path,
    )  # fmt: skip
    try:
        if state == "connecting":  # a new incarnation: the next run reconnects
            assert protocol.run(ctx).ok
            engines[1].close()
            ctx.engines[1] = engines[1] = ReferenceEngine.in_thread("e1", CONFIG, seed=0)
        perturbed(model, seed=2)
        ctx.faults = protocol.FaultPlan().fail_at(state, engine=1 if state == "connecting" else 0, kind="hang")
        result = protocol.run(ctx)  # raises InvariantViolation if the run broke its own deadline
        assert result.seconds <= 2.0 + 2.0 + 1.0
    finally:
        ctx.close()
        for e in engines:
            e.close()
    _check_and_replay(path)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("atomic-stage-hang-ate-the-deadline", "stage did not finish inside the deadline"),
        ("pause-timeout-then-a-load-ate-the-deadline", "pause did not finish inside the deadline"),
    ],
)
def test_the_error_of_a_run_whose_deadline_ran_out_is_replayed_as_recorded(name: str, error: str) -> None:
    """Two traces that once diverged. (1) An atomic run, call_timeout_s=None: an engine hung on
    `stage` until the deadline, and the next call, the first bucket's pack, found no time left.
    (2) A colocated run, call_timeout_s=0.3: one engine's pause timed out, the other's load ran to
    the deadline, and the buffer's abandon found no time left. The recordings report the first
    failure as the run's error (the deadline ran out); the replays reported the last, because
    their clock (when the last call began) had not reached the deadline yet. A call of the run
    that found no time left is now the recorded fact that the deadline ran out."""
    path = Path(__file__).parent / "traces" / "deadline" / f"{name}.jsonl"
    _, events, torn = load_trace(path)
    assert any("NoTimeLeft" in str(e.get("error")) for e in events if e.get("kind") == "call")
    assert check_trace(events, torn=torn) == []
    report = replay(path)
    assert report.divergence is None, str(report.divergence)
    assert error in next(e for e in events if e.get("event") == "error")["error"]


def test_a_prepare_the_recording_process_chose_is_replayed_as_recorded() -> None:
    """A shared-memory transport prepares (hashes ahead, in IDLE) while any arena lives in the
    recording process: a fact of that process, not a decision of the runner. This trace (six real
    runs; its first prepared because another test's arenas were still alive) once failed `refit
    check` as a `decisions` violation; the replay now takes the prepare from the trace."""
    path = Path(__file__).parent / "traces" / "prepared" / "shm-prepared-while-arenas-lived.jsonl"
    _, events, torn = load_trace(path)
    assert any(e.get("event") == "prepare" for e in events)
    assert check_trace(events, torn=torn) == []
    report = replay(path)
    assert report.divergence is None, str(report.divergence)
    assert report.same


def test_a_run_whose_bucket_size_changed_replays_with_its_own_plan(tmp_path: Path) -> None:
    """The runner keeps its plan while the trainer sends the same tensors at the same bucket size:
    a replay sets each run's recorded bucket size, so a run that planned anew is replayed with its
    own plan (found by an adversarial review: the second run replayed the first run's plan)."""
    trace = tmp_path / "buckets.jsonl"
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    engine = ReferenceEngine.in_thread("pb", CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [engine], bucket_bytes=64 << 10, deadline_s=30, trace=trace
    )
    try:
        first = protocol.run(ctx)
        ctx.bucket_bytes = 32 << 10
        second = protocol.run(ctx)
        assert first.ok and second.ok and second.buckets > first.buckets
    finally:
        ctx.close()
        engine.close()
    assert replay(trace).divergence is None
    assert main(["check", str(trace)]) == 0
