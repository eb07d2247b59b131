"""Atomic refits (stage-then-swap), the reference engine's part (issue 22): a staged session writes
a second copy of the weights while generation goes on serving the first, bucket by bucket between
decode steps; finalize and verify act on the copy; `swap` serves it at a token boundary, the pause
around it only as long as the swap; `discard` drops it and leaves the engine exactly as it was.
Driven by hand here (no protocol yet): every token sampled while the copy is written is the old
weights' own, bit for bit, and every token after the swap the new weights'."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from refit import invariants, protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import ConfigError, EngineError
from refit.invariants.tokens import check_token_versions
from refit.reference.client import start_thread
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama
from refit.replay import replay
from refit.trace import load_trace

from .conftest import perturbed
from .test_reference_engine import plan_for

CFG = ModelConfig(max_seq_len=256)
REQUESTS, TOKENS = 4, 48


def _prompts() -> list[list[int]]:
    return [[i + 1, 7, 3, 9 + i] for i in range(REQUESTS)]


def _fresh(model: TinyLlama | None) -> EngineCore:
    """An engine serving `model`'s weights (None: the checkpoint every engine starts from)."""
    core = EngineCore(CFG, seed=0, max_running=1)
    if model is None:
        return core
    plan, sd = plan_for(model), model.state_dict()
    core.pause("abort")
    core.begin(plan)
    for m in plan:
        core.load(m, [(n, sd[n]) for n in m.names])
    core.finalize()
    core.publish(1)
    core.continue_generation()
    return core


def _again(core: EngineCore, prefix: list[int], n: int) -> dict[str, Any]:
    rid = core.submit(prefix, n)
    while core.has_work():
        core.step()
    return core.result(rid)


def _staged_refit(core: EngineCore, model: TinyLlama, *, steps_between: int = 2) -> None:
    """Begin a staged session and write every bucket of `model`, decoding between buckets."""
    plan, sd = plan_for(model, bucket_bytes=16 << 10), model.state_dict()
    core.begin(plan, staged=True)
    for m in plan:
        core.load(m, [(n, sd[n]) for n in m.names])
        for _ in range(steps_between):
            core.step()
    core.finalize()


def test_generation_goes_on_while_the_copy_is_written_and_switches_only_at_the_swap() -> None:
    core = EngineCore(CFG, seed=0, max_running=REQUESTS)
    rids = [core.submit(p, TOKENS) for p in _prompts()]
    for _ in range(6):
        core.step()
    epoch0 = core.weights_epoch
    model = perturbed(TinyLlama(CFG, seed=0), seed=3)
    before = core.tokens_sampled
    _staged_refit(core, model)
    assert core.tokens_sampled > before + 20  # decoding went on between the buckets
    assert core.weights_epoch == epoch0 and not core.dirty and core.info()["staged"]
    # verify reads the copy it will serve: the trainer's weights, while the old ones are served
    assert {n: t for n, t in core.hf_state_dict().items()}.keys() == model.state_dict().keys()
    assert all(torch.equal(core.hf_state_dict()[n], t) for n, t in model.state_dict().items())
    assert torch.equal(core.score([1, 2, 3]), _fresh(None).score([1, 2, 3]))
    core.pause("retract")  # the held requests' KV is recomputed under the new weights
    assert core.swap() == {"swapped": True}
    core.flush()
    core.publish(1)
    core.continue_generation()
    assert core.weights_epoch == epoch0 + 1 and not core.info()["staged"]
    while core.has_work():
        core.step()
    results = [core.result(r) for r in rids]
    assert [r["finish_reason"] for r in results] == ["length"] * REQUESTS
    assert check_token_versions(core.commits, results, engine="e") == []
    fresh = {0: _fresh(None), 1: _fresh(model)}
    for prompt, r in zip(_prompts(), results, strict=True):
        versions, out = r["weight_versions"], r["output"]
        assert versions[0] == 0 and versions[-1] == 1 and sorted(set(versions)) == [0, 1]
        cut = versions.index(1)
        for a, b in itertools.pairwise([0, cut, TOKENS]):
            again = _again(fresh[versions[a]], prompt + out[:a], b - a)
            assert again["output"] == out[a:b]
            mine = torch.tensor(r["logprobs"][a:b], dtype=torch.float32).view(torch.int32)
            assert torch.equal(mine, torch.tensor(again["logprobs"], dtype=torch.float32).view(torch.int32))


def test_discard_leaves_the_engine_exactly_as_it_was() -> None:
    core = EngineCore(CFG, seed=0, max_running=2)
    rid = core.submit(_prompts()[0], TOKENS)
    old = {n: t.clone() for n, t in core.hf_state_dict().items()}
    epoch, commits = core.weights_epoch, list(core.commits)
    model = perturbed(TinyLlama(CFG, seed=0), seed=4)
    plan, sd = plan_for(model, bucket_bytes=16 << 10), model.state_dict()
    core.begin(plan, staged=True)
    core.load(plan[0], [(n, sd[n]) for n in plan[0].names])  # part of the copy written
    core.step()
    assert core.discard() == {"discarded": True}
    assert core.discard() == {"discarded": False}
    assert core.session is None and core.weights_epoch == epoch and core.commits == commits and not core.dirty
    assert all(torch.equal(core.hf_state_dict()[n], t) for n, t in old.items())
    while core.has_work():
        core.step()
    assert core.result(rid)["finish_reason"] == "length"
    assert set(core.result(rid)["weight_versions"]) == {0}
    # and a crashed run's staged copy is dropped by the next run's probe
    core.begin(plan, staged=True)
    assert core.probe(1)["discarded_staged"] is True and not core.info()["staged"]


def test_what_a_staged_session_refuses_names_the_step() -> None:
    core = EngineCore(CFG, seed=0)
    model = perturbed(TinyLlama(CFG, seed=0), seed=5)
    plan = plan_for(model, bucket_bytes=16 << 10)
    with pytest.raises(EngineError, match="swap without a staged copy"):
        core.swap()
    with pytest.raises(EngineError, match="needs its plan"):
        core.begin(None, staged=True)
    core.begin(plan, staged=True)
    with pytest.raises(EngineError, match="finalize it first"):
        core.swap()
    with pytest.raises(EngineError, match="release_memory of the weights while a staged copy is held"):
        core.release_memory(["weights"])
    sd = model.state_dict()
    core.load(plan[0], [(n, sd[n]) for n in plan[0].names])
    with pytest.raises(EngineError, match="finalize after 1 of"):
        core.finalize()
    assert core.info()["staged"]  # a refused finalize ends the session; the copy waits for discard
    with pytest.raises(EngineError, match="not finalized whole"):
        core.swap()
    core.discard()
    _staged_refit(core, model, steps_between=0)
    with pytest.raises(EngineError, match="a staged copy of the weights is held"):
        core.begin(plan)
    with pytest.raises(EngineError, match="pause first"):
        core.swap()
    core.pause("in_place")
    core.swap()
    assert all(torch.equal(core.hf_state_dict()[n], t) for n, t in sd.items())


def test_the_engine_reports_what_a_staged_copy_needs() -> None:
    core = EngineCore(CFG, seed=0)
    memory = core.probe(1)
    weights = sum(t.numel() * t.element_size() for t in core.params.values())
    assert memory["staging_bytes"] == weights + core.head_serving.numel() * core.head_serving.element_size()
    assert memory["free_bytes"] is None or memory["free_bytes"] > 0


# ---- atomic refits driven by the protocol (`RefitContext(atomic=True)`) --------------------------


def _pauses_only_to_swap(events: list[dict], engine: str) -> None:
    """Each run paused `engine` only in SWAPPING, after its copy was finalized (and verified), and
    its pause, flush, swap, publish and continue went in one engine call (one round trip)."""
    calls = [e for e in events if e.get("kind") == "call" and e.get("engine") == engine and e.get("run")]
    for run in {c["run"] for c in calls}:
        mine = [c for c in calls if c["run"] == run]
        names = [c["event"] for c in mine]
        if "swap" not in names:
            continue
        pauses = [c for c in mine if c["event"] == "pause"]
        assert [p["state"] for p in pauses] == ["SWAPPING"]
        last_write = max(c["seq"] for c in mine if c["event"] in ("load", "finalize", "verify"))
        assert pauses[0]["seq"] > last_write
        wave = [c for c in mine if c.get("batch") == pauses[0]["batch"]]
        assert [c["event"] for c in wave] == ["pause", "flush", "swap", "publish", "continue_generation"]


@pytest.fixture
def atomic_fleet(tmp_path: Path):
    engines = [ReferenceEngine.in_thread(f"a{i}", CFG, seed=0, max_running=REQUESTS) for i in range(2)]
    model = TinyLlama(CFG, seed=0)
    made: list[protocol.RefitContext] = []

    def ctx(**kw: Any) -> protocol.RefitContext:
        kw.setdefault("retries", 0)
        c = protocol.RefitContext(
            TorchSource(model), SharedMemoryTransport(), kw.pop("engines", engines), bucket_bytes=16 << 10,
            atomic=True, trace=tmp_path / f"t{len(made)}.jsonl", **kw,
        )  # fmt: skip
        made.append(c)
        return c

    yield engines, model, ctx
    for c in made:
        c.close()
    for e in engines:
        e.close()


def _checked(c: protocol.RefitContext) -> list[dict]:
    c.close()
    _, events, _ = load_trace(Path(c.trace))  # type: ignore[arg-type]
    assert invariants.check_trace(events) == []
    assert replay(Path(c.trace)).divergence is None  # type: ignore[arg-type]
    return events


def test_an_atomic_refit_generates_while_the_copies_are_written_and_pauses_only_to_swap(atomic_fleet) -> None:
    engines, model, ctx = atomic_fleet
    c = ctx()
    futures = [engines[0].submit(p, TOKENS * 4) for p in _prompts()]
    for step in (1, 2, 3):
        perturbed(model, seed=step)
        result = protocol.run(c)
        assert result.ok, result.error
        assert {n: o.status for n, o in result.engines.items()} == {"a0": "updated", "a1": "updated"}
        assert set(result.phase_seconds) >= {"STAGING", "TRANSFERRING", "SWAPPING"}
        assert "PAUSING" not in result.phase_seconds and "INVALIDATING" not in result.phase_seconds
    outs = [f.result(timeout=120) for f in futures]
    assert [o["finish_reason"] for o in outs] == ["length"] * REQUESTS  # none aborted
    info = engines[0].info()
    assert info["tokens_while_staged"] > 0  # tokens were sampled while the copies were written
    assert not info["staged"] and info["version"] == 3
    assert check_token_versions(info["commits"], outs, engine="a0") == []
    sd = model.state_dict()
    assert all(torch.equal(engines[1].state_dict()[n], t) for n, t in sd.items())
    events = _checked(c)
    for name in ("a0", "a1"):
        _pauses_only_to_swap(events, name)
    start = next(e for e in events if e.get("event") == "start")
    assert start["atomic"] is True
    staging = next(e for e in events if e.get("event") == "staging")
    assert staging["memory"]["a0"]["staging_bytes"] > 0


def test_a_load_that_fails_strands_the_copy_which_is_discarded_and_staged_again(atomic_fleet) -> None:
    engines, model, ctx = atomic_fleet
    c = ctx(retries=1, faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, call="load"))
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert result.ok and result.engines["a1"].status == "updated" and result.engines["a1"].attempts == 2
    events = _checked(c)
    a1 = [e["event"] for e in events if e.get("kind") == "call" and e.get("engine") == "a1"]
    first, second = a1.index("stage"), len(a1) - 1 - a1[::-1].index("stage")
    assert a1[second - 1] == "discard" and "pause" not in a1[:second]  # generation never stopped for the failure
    assert a1[first:second].count("finalize") == 1  # the stranded session was finalized once, then discarded
    assert all(torch.equal(engines[1].state_dict()[n], t) for n, t in model.state_dict().items())


def test_a_run_that_fails_before_the_swap_never_pauses_and_changes_nothing(atomic_fleet) -> None:
    engines, model, ctx = atomic_fleet
    c = ctx(faults=protocol.FaultPlan().fail_at("transferring", bucket=2, call="pack"))
    before = [e.state_dict() for e in engines]
    futures = [engines[1].submit(p, TOKENS) for p in _prompts()]
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert not result.ok and result.state == "FAILED" and result.version is None
    assert {n: (o.status, o.version, o.serving) for n, o in result.engines.items()} == {
        "a0": ("unchanged", 0, True), "a1": ("unchanged", 0, True)
    }  # fmt: skip
    for e, old in zip(engines, before, strict=True):
        info = e.info()
        assert not info["staged"] and info["weights_epoch"] == 0 and not info["quarantined"]
        assert all(torch.equal(e.state_dict()[n], t) for n, t in old.items())
    outs = [f.result(timeout=120) for f in futures]
    assert [o["finish_reason"] for o in outs] == ["length"] * REQUESTS and {
        v for o in outs for v in o["weight_versions"]
    } == {0}
    events = _checked(c)
    assert not [e for e in events if e.get("kind") == "call" and e.get("event") in ("pause", "quarantine")]
    assert {e["engine"] for e in events if e.get("event") == "discard" and e.get("outcome") == "ok"} == {"a0", "a1"}


class _RefusesOneSwap(EngineCore):
    """A reference engine that refuses its first swap before changing anything (as it refuses a
    swap while generating), so the run must leave it on the weights it serves."""

    refused = False

    def swap(self) -> dict[str, Any]:
        if not self.refused:
            self.refused = True
            raise EngineError("not_paused", "swap refused (test): the engine changed nothing")
        return super().swap()


@pytest.mark.parametrize(("max_staleness", "status"), [(0, "stale"), (1, "unchanged")])
def test_a_refused_swap_discards_the_copy_and_the_version_policy_decides_the_rest(
    atomic_fleet, max_staleness: int, status: str
) -> None:
    engines, model, ctx = atomic_fleet
    refusing = ReferenceEngine(start_thread("a2", CFG, 0, core=_RefusesOneSwap, max_running=REQUESTS))
    try:
        c = ctx(max_staleness=max_staleness, engines=[engines[0], refusing])
        futures = [refusing.submit(p, 40) for p in _prompts()]
        perturbed(model, seed=1)
        result = protocol.run(c)
        assert result.version == 1 and result.engines["a0"].status == "updated"
        assert result.engines["a2"].status == status and result.engines["a2"].version == (
            None if status == "stale" else 0
        )
        info = refusing.info()
        assert not info["staged"] and info["weights_epoch"] == 0
        if status == "stale":  # held with its requests kept waiting: the next refit brings it back
            assert info["quarantined"]
            perturbed(model, seed=2)
            again = protocol.run(c)
            assert again.ok and again.engines["a2"].status == "updated"
        outs = [f.result(timeout=120) for f in futures]
        assert [o["finish_reason"] for o in outs] == ["length"] * REQUESTS  # none aborted, held or not
        _checked(c)
    finally:
        refusing.close()


def test_a_swap_whose_effect_is_unknown_quarantines_the_engine(atomic_fleet) -> None:
    engines, model, ctx = atomic_fleet
    c = ctx(faults=protocol.FaultPlan().fail_at("swapping", engine=1, call="swap"))  # raised: effect unknown
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert result.version == 1 and result.engines["a0"].status == "updated"
    assert result.engines["a1"].status == "quarantined" and not engines[1].info()["staged"]
    _checked(c)


def test_a_copy_that_fails_verification_is_discarded_and_staged_again(atomic_fleet) -> None:
    engines, model, ctx = atomic_fleet
    c = ctx(retries=1, faults=protocol.FaultPlan().fail_at("transferring", engine=0, bucket=0, kind="flip"))
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert result.ok and result.engines["a0"].status == "updated" and result.engines["a0"].attempts == 2
    events = _checked(c)
    verdicts = [e["ok"] for e in events if e.get("event") == "verified" and e.get("engine") == "a0"]
    assert verdicts == [False, True]
    assert all(torch.equal(engines[0].state_dict()[n], t) for n, t in model.state_dict().items())


def test_staged_copies_that_do_not_fit_are_refused_before_connect(tmp_path: Path) -> None:
    need = _fresh(None).probe(1)["staging_bytes"]
    tight = ReferenceEngine.in_thread("m0", CFG, seed=0, memory_limit=need + need // 2)
    roomy = ReferenceEngine.in_thread("m1", CFG, seed=0, memory_limit=3 * need)
    model = perturbed(TinyLlama(CFG, seed=0), seed=1)
    c = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [tight, roomy], atomic=True, trace=tmp_path / "t.jsonl"
    )
    try:
        result = protocol.run(c)
        assert not result.ok and result.error is not None and result.error.state == "CONNECTING"
        msg = str(result.error)
        assert "engine m0 (" in msg and "m1" not in msg
        assert "MiB" in msg and "atomic=False" in msg
        assert {o.status for o in result.engines.values()} == {"unchanged"}
        events = _checked(c)
        called = {e["event"] for e in events if e.get("kind") == "call" and e.get("side") == "engine"}
        assert called == {"probe"}  # nothing attached, staged or paused
    finally:
        c.close()
        tight.close()
        roomy.close()


def test_engines_sharing_memory_add_their_copies_up() -> None:
    from refit.protocol.ledger import Engine, Ledger

    engines = [Engine(i, f"e{i}", 1, f"e{i}", 0) for i in range(3)]
    for e, free in zip(engines, (300, 250, 100), strict=True):
        e.staging = {"staging_bytes": 100, "free_bytes": free, "pool": "host" if e.index < 2 else "gpu1"}
    assert Ledger(1, engines).staging_problems() == []
    engines[1].staging = {"staging_bytes": 200, "free_bytes": 250, "pool": "host"}
    (problem,) = Ledger(1, engines).staging_problems()
    assert "e0, e1" in problem and "shared" in problem
    engines[2].staging = {"staging_bytes": None, "free_bytes": 100}
    assert any("e2 did not report" in p for p in Ledger(1, engines).staging_problems())
    engines[2].staging = {"staging_bytes": 10**12, "free_bytes": None, "pool": "gpu1"}  # free unknown: not refused
    assert len(Ledger(1, engines).staging_problems()) == 1


def test_atomic_is_refused_where_it_cannot_run() -> None:
    engine = ReferenceEngine.in_thread("r0", CFG, seed=0)
    try:
        with pytest.raises(ConfigError, match="colocated refit gives the engines' memory to the trainer"):
            protocol.RefitContext(
                TorchSource(TinyLlama(CFG, seed=0)), SharedMemoryTransport(), [engine], mode="colocated", atomic=True
            )
        with pytest.raises(ConfigError, match="atomic must be True or False"):
            protocol.RefitContext(TorchSource(TinyLlama(CFG, seed=0)), SharedMemoryTransport(), [engine], atomic=1)
    finally:
        engine.close()


def test_an_engine_that_dies_while_staging_leaves_the_others_to_swap(atomic_fleet) -> None:
    _, model, ctx = atomic_fleet
    c = ctx(faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, call="load", kind="kill"))
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert result.version == 1 and result.engines["a0"].status == "updated" and result.engines["a1"].status == "failed"
    _checked(c)


def test_the_async_rl_example_runs_without_stopping_generation_for_the_transfer() -> None:
    """examples/async_rl.py as a user runs it (a subprocess, two engine processes): five atomic
    refits while requests are in flight, none aborted, tokens generated while the copies were
    written, samples filtered by their staleness."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "async_rl.py")], capture_output=True, text=True, timeout=300,
        check=False, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("iteration ") for line in lines) == 5
    assert "published version 5" in proc.stdout
    last = re.fullmatch(
        r"0 requests aborted; (\d+) tokens were generated while the new weights were written", lines[-1]
    )
    assert last is not None and int(last.group(1)) > 0, lines[-1]


def test_a_probe_verifies_the_staged_copy_not_the_weights_still_served(atomic_fleet) -> None:
    _, model, ctx = atomic_fleet
    c = ctx(verify="probe")
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert result.ok, result.error
    assert all(o.verify is not None and o.verify["ok"] for o in result.engines.values())
    _checked(c)


def test_atomic_over_a_broadcast_group(tmp_path: Path) -> None:
    """A collective transport: bucket-wise (a member whose load is corrupted is retried, its
    group rebuilt, and the healthy member is not held for it) and per-tensor broadcasts received
    straight into the copy (nothing served changes until the swap: every token at a commit point)."""
    from refit.drivers.broadcast import BroadcastTransport

    for transport, faults in (
        (BroadcastTransport(), protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, kind="corrupt")),
        (BroadcastTransport(ops="tensor", checksums=False, direct_bytes=16 << 10), None),
    ):
        engines = [ReferenceEngine.in_thread(f"b{i}", CFG, seed=0, max_running=REQUESTS) for i in range(2)]
        model = perturbed(TinyLlama(CFG, seed=0), seed=1)
        c = protocol.RefitContext(
            TorchSource(model), transport, engines, bucket_bytes=16 << 10, atomic=True, retries=1, faults=faults,
            trace=tmp_path / f"{transport.ops}.jsonl", deadline_s=60.0, call_timeout_s=5.0,
        )  # fmt: skip
        try:
            futures = [engines[0].submit(p, TOKENS) for p in _prompts()]
            result = protocol.run(c)
            assert result.ok and {o.status for o in result.engines.values()} == {"updated"}, result.engines
            outs = [f.result(timeout=120) for f in futures]
            info = engines[0].info()
            assert check_token_versions(info["commits"], outs, engine="b0") == [] and not info["dirty"]
            for e in engines:
                assert all(torch.equal(e.state_dict()[n], t) for n, t in model.state_dict().items())
            _checked(c)
        finally:
            c.close()
            for e in engines:
                e.close()


def test_an_engine_that_hangs_while_staging_is_held_once_it_answers(atomic_fleet) -> None:
    """It stopped answering while it generated (never paused): it is reported failed, and its
    discard and the version policy's hold, sent anyway, run once it answers, so it does not go on
    serving the old version beside the new one."""
    from refit.protocol.faults import HANG_SLACK_S

    engines, model, ctx = atomic_fleet
    c = ctx(call_timeout_s=1.0, faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, kind="hang"))
    perturbed(model, seed=1)
    result = protocol.run(c)
    assert result.version == 1 and result.engines["a0"].status == "updated"
    hung = result.engines["a1"]
    assert hung.status == "failed" and not hung.serving and "discard and hold were sent" in (hung.error or "")
    deadline = time.monotonic() + 10 + HANG_SLACK_S
    while engines[1].info()["staged"] or not engines[1].info()["quarantined"]:
        assert time.monotonic() < deadline, engines[1].info()
        time.sleep(0.05)
    with pytest.raises(EngineError):
        engines[1].generate([1, 2, 3], 2, timeout=0.5)  # held: it refuses, rather than serve version 0
    c.faults = None
    perturbed(model, seed=2)
    assert protocol.run(c).engines["a1"].status == "updated"  # the next refit brings it back
    _checked(c)


@pytest.mark.parametrize(
    ("tamper", "invariant"),
    [("stage_as_begin", "kv_fresh"), ("no_flush", "kv_fresh"), ("no_swap", "version"), ("no_pause", "kv_fresh")],
)
def test_a_tampered_atomic_trace_is_refused_naming_the_invariant(atomic_fleet, tamper: str, invariant: str) -> None:
    _, model, ctx = atomic_fleet
    c = ctx()
    perturbed(model, seed=1)
    assert protocol.run(c).ok
    events = _checked(c)
    calls = [e for e in events if e.get("kind") == "call" and e.get("engine") == "a0"]
    if tamper == "stage_as_begin":  # an ordinary session opened while it generates: buckets into what it serves
        events = [
            {**e, "event": "begin"} if e is next(x for x in calls if x["event"] == "stage") else e for e in events
        ]
    else:
        gone = {"no_flush": "flush", "no_swap": "swap", "no_pause": "pause"}[tamper]
        drop = next(x for x in calls if x["event"] == gone)
        events = [e for e in events if e is not drop]
    found = invariants.check_trace(events)
    assert any(v.invariant == invariant and "a0" in v.message for v in found), found
