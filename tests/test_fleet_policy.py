"""One version policy for the fleet (`RefitContext(max_staleness=k)`): an engine that did not take
the version others published, and would serve one more than k versions behind it, is held out of
service (STALE) instead of continued, until a refit reaches it. Real reference engines over shared
memory; every trace is checked and replayed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from refit import invariants, protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import ConfigError, EngineError
from refit.reference.model import TinyLlama
from refit.replay import replay
from refit.trace import load_trace

from .conftest import CONFIG, SMALL_BUCKET, perturbed

PROMPT = [3, 1, 4, 1, 5]


def _begin_refused(engine: int) -> protocol.FaultPlan:
    return protocol.FaultPlan().fail_at("invalidating", engine=engine, call="begin", kind="raise")


def _refit(c: protocol.RefitContext, model: TinyLlama, step: int, faults: protocol.FaultPlan | None) -> Any:
    """A training step, then one refit with `faults` armed."""
    c.faults = faults
    perturbed(model, seed=step)
    return protocol.run(c)


def _checked(c: protocol.RefitContext) -> list[dict]:
    """Close the context (its trace ends), then check and replay the whole trace."""
    c.close()
    trace = Path(c.trace)  # type: ignore[arg-type]
    _, events, _ = load_trace(trace)
    assert invariants.check_trace(events) == []
    assert replay(trace).divergence is None
    return events


@pytest.fixture
def fleet(tmp_path: Path):
    engines = [ReferenceEngine.in_thread(f"f{i}", CONFIG, seed=0) for i in range(2)]
    model = TinyLlama(CONFIG, seed=0)
    made: list[protocol.RefitContext] = []

    def ctx(**kw: object) -> protocol.RefitContext:
        c = protocol.RefitContext(
            TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, retries=0,
            trace=tmp_path / f"t{len(made)}.jsonl", **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        made.append(c)
        return c

    yield engines, model, ctx
    for c in made:
        c.close()
    for e in engines:
        e.close()


def test_without_a_policy_an_engine_left_behind_serves_its_old_version(fleet) -> None:
    engines, model, ctx = fleet
    c = ctx(max_staleness=None)
    result = _refit(c, model, 1, _begin_refused(1))
    behind = result.engines["f1"]
    assert result.version == 1 and behind.status == "unchanged" and behind.version == 0 and behind.serving
    assert engines[1].generate(PROMPT, 3)["weight_versions"] == [0, 0, 0]  # two versions in service
    _checked(c)


def test_a_synchronous_fleet_holds_the_engine_left_behind_until_a_refit_reaches_it(fleet) -> None:
    """max_staleness=0: the engine whose begin was refused is not continued on version 0 while the
    other serves version 1: it is held (STALE, told why), refuses requests, and the next refit,
    which reaches it, brings it back."""
    engines, model, ctx = fleet
    c = ctx()  # the default
    assert c.max_staleness == 0
    result = _refit(c, model, 1, _begin_refused(1))
    held = result.engines["f1"]
    assert result.version == 1 and result.engines["f0"].status == "updated"
    assert held.status == "stale" and held.version is None and not held.serving
    with pytest.raises(EngineError, match="stale: it holds version 0, and the fleet now serves version 1"):
        engines[1].generate(PROMPT, 3)
    first_run = result.run_id

    again = _refit(c, model, 2, None)
    assert again.ok and again.version == 2 and again.engines["f1"].status == "updated"
    assert engines[1].generate(PROMPT, 3)["weight_versions"] == [2, 2, 2]
    events = [e for e in _checked(c) if e.get("run") == first_run]
    holds = [e for e in events if e.get("event") == "quarantine" and e.get("engine") == "f1"]
    assert len(holds) == 1 and holds[0]["outcome"] == "ok"
    assert not [e for e in events if e.get("event") == "continue_generation" and e.get("engine") == "f1"]


def test_one_version_behind_is_served_under_a_bound_of_one_and_two_is_not(fleet) -> None:
    _, model, ctx = fleet
    c = ctx(max_staleness=1)
    first = _refit(c, model, 1, _begin_refused(1))
    assert first.engines["f1"].status == "unchanged" and first.engines["f1"].serving  # 1 behind: allowed
    second = _refit(c, model, 2, _begin_refused(1))
    assert second.version == 2 and second.engines["f1"].status == "stale"  # 2 behind: held
    _checked(c)


def test_when_no_engine_published_no_engine_is_held(fleet) -> None:
    """Every engine's begin refused: the fleet still serves one version, the old one, so the policy
    holds no one: every engine is continued unchanged."""
    _, model, ctx = fleet
    c = ctx(max_staleness=0)
    result = _refit(c, model, 1, _begin_refused(0).fail_at("invalidating", engine=1, call="begin", kind="raise"))
    assert result.version is None
    assert {o.status for o in result.engines.values()} == {"unchanged"}
    assert all(o.serving and o.version == 0 for o in result.engines.values())
    _checked(c)


def test_a_trace_that_breaks_the_policy_is_named(fleet) -> None:
    """`refit check`'s outcome invariant: under max_staleness 0, an engine reported in service at
    an older version than the one the run published is a violation (a tampered end line)."""
    _, model, ctx = fleet
    c = ctx(max_staleness=0)
    _refit(c, model, 1, _begin_refused(1))
    c.close()
    _, events, _ = load_trace(Path(c.trace))  # type: ignore[arg-type]
    end = next(e for e in events if (e.get("kind"), e.get("event")) == ("run", "end"))
    end["engine_outcomes"]["f1"] = {"status": "unchanged", "version": 0}
    found = [v for v in invariants.check_run(events) if v.invariant == "outcome"]
    assert any("max_staleness is 0" in v.message for v in found)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "0"])
def test_a_bound_that_is_not_a_count_is_refused(bad: object) -> None:
    engine = ReferenceEngine.in_thread("b0", CONFIG, seed=0)
    try:
        with pytest.raises(ConfigError, match="max_staleness"):
            protocol.RefitContext(TorchSource(TinyLlama(CONFIG, seed=0)), SharedMemoryTransport(), [engine],
                                  max_staleness=bad)  # type: ignore[arg-type]  # fmt: skip
    finally:
        engine.close()


class _Clock:
    """The run's clock, which an engine's continue moves past the deadline."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def test_a_held_engine_is_told_even_when_the_commit_used_up_the_deadline(tmp_path: Path) -> None:
    """The engine that published answers its continue exactly as the run's deadline runs out: the
    hold of the engine left behind is must-run cleanup, sent within the cleanup budget, so it is
    held (not left paused and unaccounted for)."""
    clock = _Clock()
    deadline = 30.0

    class Slow(ReferenceEngine):
        def continue_generation(self, *, timeout: float) -> None:
            super().continue_generation(timeout=timeout)
            clock.offset += deadline  # the deadline has passed once this answer lands

    engines = [Slow.in_thread("s0", CONFIG, seed=0), ReferenceEngine.in_thread("s1", CONFIG, seed=0)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    c = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, retries=0, max_staleness=0,
        deadline_s=deadline, clock=clock, faults=_begin_refused(1), trace=tmp_path / "d.jsonl",
    )  # fmt: skip
    try:
        result = protocol.run(c)
        assert result.engines["s0"].status == "updated" and result.engines["s1"].status == "stale"
        assert "stale: it holds version 0" in engines[1].info()["quarantined"]
    finally:
        c.close()
        for e in engines:
            e.close()


def test_the_engine_left_behind_is_held_once_the_publisher_serves_after_a_refused_continue(fleet) -> None:
    """The engine that published refuses its first continue and takes the second (settle's):
    the hold of the one left behind is decided after that, so it is held, not continued beside
    it (two versions in service)."""
    _, model, ctx = fleet
    c = ctx(max_staleness=0)
    result = _refit(c, model, 1, _begin_refused(1).fail_at("continuing", engine=0, call="continue_generation"))
    assert result.engines["f0"].status == "updated" and result.engines["f1"].status == "stale"
    _checked(c)


def test_no_engine_is_held_when_the_one_that_published_cannot_serve(tmp_path: Path) -> None:
    """The engine that published never continues (it is quarantined): no engine serves the new
    version, so the one left behind is not held; it keeps serving the old one, the only one in
    service."""

    class Stuck(ReferenceEngine):
        def continue_generation(self, *, timeout: float) -> None:
            raise EngineError("flush_refused", "this engine never continues")

    engines = [Stuck.in_thread("n0", CONFIG, seed=0), ReferenceEngine.in_thread("n1", CONFIG, seed=0)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    c = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, retries=0, max_staleness=0,
        faults=_begin_refused(1), trace=tmp_path / "n.jsonl",
    )  # fmt: skip
    try:
        result = protocol.run(c)
        assert result.engines["n0"].status == "quarantined"
        behind = result.engines["n1"]
        assert behind.status == "unchanged" and behind.serving and behind.version == 0
        assert engines[1].generate(PROMPT, 2)["weight_versions"] == [0, 0]
        _checked(c)
    finally:
        c.close()
        for e in engines:
            e.close()


def test_a_bound_changed_to_nonsense_between_runs_is_refused_before_anything_moves(fleet) -> None:
    engines, _, ctx = fleet
    c = ctx(max_staleness=0)
    c.max_staleness = "0"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="max_staleness"):
        protocol.run(c)
    assert not any(e.info()["paused"] for e in engines)


def test_a_held_engine_keeps_its_requests_and_they_go_on_under_the_version_that_reaches_it(tmp_path: Path) -> None:
    """A hold is not a quarantine: the engine merely behind keeps the requests it was generating
    (paused, their KV dropped), refuses new ones, and once a refit reaches it they go on under the
    version it publishes: none ended, each token labelled with the version it was sampled under."""
    from refit.invariants.tokens import check_token_versions, published_versions
    from refit.reference.model import ModelConfig

    config = ModelConfig(max_seq_len=1024)
    engines = [ReferenceEngine.in_thread(f"h{i}", config, seed=0) for i in range(2)]
    model = TinyLlama(config, seed=0)
    c = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, retries=0,
        trace=tmp_path / "t.jsonl",
    )  # fmt: skip
    try:
        running = engines[1].submit(PROMPT, 900)
        while engines[1].info()["tokens_sampled"] < 20:
            time.sleep(0.002)
        result = _refit(c, model, 1, _begin_refused(1))
        assert result.engines["h1"].status == "stale" and result.engines["h0"].status == "updated"
        time.sleep(0.2)
        info = engines[1].info()
        assert not running.done() and info["waiting"] == 1 and info["paused"]  # kept, not ended
        with pytest.raises(EngineError, match="stale: it holds version 0"):
            engines[1].generate(PROMPT, 3)
        again = _refit(c, model, 2, None)
        assert again.ok and again.engines["h1"].status == "updated"
        out = running.result(timeout=120)
        assert out["finish_reason"] == "length" and len(out["weight_versions"]) == 900
        assert out["weight_versions"][0] == 0 and out["weight_versions"][-1] == 2
        assert set(out["weight_versions"]) == {0, 2}  # version 1 never served on this engine
        events = _checked(c)
        commits = engines[1].info()["commits"]
        assert check_token_versions(commits, [out], engine="h1", published=published_versions(events, "h1")) == []
    finally:
        c.close()
        for e in engines:
            e.close()
