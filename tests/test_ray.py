"""Reference engines as Ray actors on a real local Ray cluster (2 CPUs, no dashboard): full refits,
errors keeping their kind across Ray, an actor that dies (between refits and mid-transfer), an
actor Ray restarts (a new incarnation, out of service until refit), and the lock in a Ray actor."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray  # the [ray] extra (scripts/setup installs it)
import torch

from refit import protocol
from refit.drivers.ray_actors import RayEngine, RayLock
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import DriverCallError, EngineDied, EngineError, RefitBusyError
from refit.reference.model import TinyLlama, greedy
from refit.trace import TraceRecorder

from .conftest import CONFIG, SMALL_BUCKET, perturbed

pytestmark = pytest.mark.e2e
PROMPT = [5, 17, 3, 99, 42]


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def engines() -> Iterator[list[RayEngine]]:
    made: list[RayEngine] = []
    yield made
    for e in made:
        e.close()


def _exact(engine: RayEngine, model: TinyLlama) -> bool:
    state = engine.state_dict()
    return all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def _ctx(model: TinyLlama, engines: list[RayEngine], **kw: Any) -> protocol.RefitContext:
    return protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, deadline_s=60, **kw
    )


def _wait_for_restart(e: RayEngine, before: str, within_s: float = 60.0) -> None:
    """Until Ray brings the actor back in a new process (a new incarnation), or `within_s` passed."""
    deadline = time.monotonic() + within_s
    while e.incarnation == before and time.monotonic() < deadline:
        time.sleep(0.2)


def test_refits_into_ray_actor_engines(engines: list[RayEngine]) -> None:
    """Two engines hosted by Ray actors: weights bit for bit, greedy tokens equal, two control
    round trips per refit once connected, the lock held by a Ray actor released after each run."""
    lock = RayLock("refit-test-lock-1")
    engines += [RayEngine.start(f"ray-{i}", CONFIG, seed=0, lock=lock) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    ctx = _ctx(model, engines)
    assert ctx.lock is lock
    try:
        trips = []
        for i in range(3):
            perturbed(model, seed=10 + i)
            result = protocol.run(ctx).raise_for_error()
            trips.append(result.round_trips)
            assert lock.holder is None
            for e in engines:
                assert _exact(e, model)
                assert e.generate(PROMPT, 8)["output"] == greedy(model, PROMPT, 8)
        assert trips[1:] == [2, 2]
    finally:
        ctx.close()


def test_refit_errors_keep_their_kind_across_ray(engines: list[RayEngine]) -> None:
    engines.append(RayEngine.start("ray-err", CONFIG, seed=0))
    e = engines[0]
    with pytest.raises(EngineError) as info:
        e.continue_generation(timeout=10)
        e.publish(1, timeout=10)  # no finalized update: refused by the engine, named
    assert info.value.kind == "not_ready"
    with pytest.raises(EngineError) as info:
        e.pause("sideways", timeout=10)  # type: ignore[arg-type]
    assert info.value.kind == "bad_request" and "sideways" in info.value.message


def test_an_actor_that_dies_is_a_dead_engine(engines: list[RayEngine]) -> None:
    """Killed between refits (ray.kill) or mid-transfer (an armed kill takes the actor down with its
    engine): the run reports that engine failed, inside its deadline, publishes nothing to it, and
    the other engine is updated; the lock is released."""
    lock = RayLock("refit-test-lock-2")
    engines += [RayEngine.start(f"ray-d{i}", CONFIG, seed=0, lock=lock) for i in range(3)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=2)
    ctx = _ctx(model, engines[:2])
    try:
        protocol.run(ctx).raise_for_error()
        ray.kill(engines[1].client.actor)
        perturbed(model, seed=3)
        result = protocol.run(ctx)
        assert {n: o.status for n, o in result.engines.items()} == {"ray-d0": "updated", "ray-d1": "failed"}
        assert "its Ray actor died" in str(result.error)
        assert not engines[1].alive and lock.holder is None
        assert _exact(engines[0], model)
    finally:
        ctx.close()
    kill = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=3, kind="kill")
    ctx = _ctx(model, [engines[0], engines[2]], faults=kill, version=engines[0].info()["version"])
    try:
        perturbed(model, seed=4)
        t0 = time.monotonic()
        result = protocol.run(ctx)
        assert time.monotonic() - t0 < 60
        assert result.engines["ray-d2"].status == "failed" and result.engines["ray-d0"].status == "updated"
        with pytest.raises(EngineDied):
            engines[2].info(timeout=10)
        assert lock.holder is None and _exact(engines[0], model)
    finally:
        ctx.close()


def test_a_restarted_actor_is_a_new_incarnation_out_of_service_until_refit(engines: list[RayEngine]) -> None:
    """Ray restarts the actor (`max_restarts=1`) after its process is killed: the engine comes back
    with the checkpoint, refuses to serve, and reports a new incarnation; the next refit reconnects
    it and refits it fully, after which it serves the trainer's weights."""
    engines.append(RayEngine.start("ray-r", CONFIG, seed=0, max_restarts=1))
    e = engines[0]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=5)
    ctx = _ctx(model, engines)
    try:
        protocol.run(ctx).raise_for_error()
        before = e.incarnation
        os.kill(e.client.pid, signal.SIGKILL)
        with pytest.raises((EngineDied, TimeoutError), match=r"Ray actor (died|is unavailable)"):
            e.info(timeout=30)  # dead, or (Ray's account) unavailable while it restarts
        _wait_for_restart(e, before)
        assert e.incarnation != before and e.alive
        with pytest.raises(EngineError) as info:
            e.generate(PROMPT, 4, timeout=30)
        assert info.value.kind == "quarantined"  # checkpoint weights: out of service
        perturbed(model, seed=6)
        result = protocol.run(ctx).raise_for_error()
        assert any(call == "connect" for call, _, _ in result.rank_stats[0].steps)
        assert _exact(e, model) and e.generate(PROMPT, 8)["output"] == greedy(model, PROMPT, 8)
    finally:
        ctx.close()


def test_the_lock_actor_is_shared_and_bounded(engines: list[RayEngine]) -> None:
    """Two handles to one named lock actor share it: a run finds it held by another owner and is
    refused as busy, changing nothing; a lock actor that does not answer fails the run in time."""
    first, second = RayLock("refit-test-lock-3"), RayLock("refit-test-lock-3")
    assert first.acquire("someone-else") and not second.acquire("me") and not second.release("me")
    engines.append(RayEngine.start("ray-l", CONFIG, seed=0, lock=second))
    model = TinyLlama(CONFIG, seed=0)
    ctx = _ctx(model, engines)
    try:
        with pytest.raises(RefitBusyError):
            protocol.run(ctx).raise_for_error()
        assert engines[0].info()["version"] == 0
        assert first.release("someone-else") and first.holder is None
        ray.kill(first.actor)  # the lock actor is gone: the run fails on the lock, inside its budget
        end = time.monotonic() + 20  # (ray.kill returns before the actor is dead: a run may still reach it)
        while time.monotonic() < end:
            try:
                _ = first.holder  # raises once the actor is dead
            except Exception:
                break
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(DriverCallError, match=r"lock\.acquire failed: ActorDiedError"):
            protocol.run(ctx)
        assert time.monotonic() - t0 < 15
        assert engines[0].info()["version"] == 0
    finally:
        ctx.close()


def test_demo_ray_runs_on_the_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    """`refit demo --ray`: two FSDP2 trainer ranks and a TP=2 engine, all Ray actors (on this
    cluster: the demo starts one only when none is connected), refits over the broadcast
    transport, every refit matching the trainer."""
    from refit.cli import main

    argv = ["demo", "--ray", "--ranks", "2", "--engine-tp", "2", "--transport", "broadcast", "--engines", "1"]
    assert main([*argv, "--refits", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 trainer rank actor(s) (FSDP2 over gloo) and 1 reference engine actors (TP=2)" in out
    assert "all 2 refits matched the trainer" in out
    assert main(["demo", "--ray", "--in-thread"]) == 2
    assert "--ray hosts the trainer ranks and reference engines as Ray actors; drop --in-thread" in (
        capsys.readouterr().err
    )


def test_a_restart_no_call_saw_is_still_a_new_incarnation(engines: list[RayEngine]) -> None:
    """Ray restarts the actor between two refits with no call in between: the next run still sees
    a new process (the incarnation is asked of the actor), reconnects it and refits it fully."""
    engines.append(RayEngine.start("ray-s", CONFIG, seed=0, max_restarts=1))
    e = engines[0]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=7)
    ctx = _ctx(model, engines)
    try:
        protocol.run(ctx).raise_for_error()
        before = e.incarnation
        os.kill(e.client.pid, signal.SIGKILL)
        _wait_for_restart(e, before)
        assert e.incarnation != before
        perturbed(model, seed=8)
        result = protocol.run(ctx).raise_for_error()
        assert any(call == "connect" for call, _, _ in result.rank_stats[0].steps)
        assert _exact(e, model) and e.generate(PROMPT, 8)["output"] == greedy(model, PROMPT, 8)
    finally:
        ctx.close()
    e.close()
    assert e.incarnation == e.incarnation and not e.alive  # closed stays closed


def test_a_lock_lease_frees_a_lock_whose_holder_died() -> None:
    lock = RayLock("refit-test-lease", lease_s=0.5)
    assert lock.acquire("died-holding-it") and not lock.acquire("next")
    time.sleep(0.7)
    assert lock.acquire("next") and lock.holder == "next"
    assert not lock.release("died-holding-it") and lock.release("next")


def test_generation_is_bounded_by_the_callers_timeout_while_the_actor_is_busy(engines: list[RayEngine]) -> None:
    """The actor is stuck in a hanging call: a generation asked for meanwhile fails with the
    caller's own timeout (TimeoutError), not the actor's."""
    import threading

    engines.append(RayEngine.start("ray-g", CONFIG, seed=0))
    e = engines[0]
    e.arm_fault("hang", "info", bucket=None, seconds=4.0, timeout=10)
    threading.Thread(target=lambda: e.info(timeout=10), daemon=True).start()
    time.sleep(0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        e.generate(PROMPT, 4, timeout=1.0)
    assert time.monotonic() - t0 < 3.0
    time.sleep(4.0)
    assert e.generate(PROMPT, 4, timeout=30)["output"]  # the actor answers again after the hang


# ---- trainer ranks as Ray actors ------------------------------------------------------------------


class _KillRankAt(TraceRecorder):
    """A trace recorder that kills a trainer rank's actor (ray.kill: its process dies) right after
    the leader recorded the step `call` of bucket `bucket`: a rank lost mid-refit."""

    def __init__(self, actor: Any, call: str, bucket: int) -> None:
        super().__init__()
        self.actor, self.call, self.bucket, self.fired = actor, call, bucket, False

    def emit(self, kind: str, event: str, **fields: Any) -> dict[str, Any]:
        record = super().emit(kind, event, **fields)
        if not self.fired and kind == "call" and event == self.call and fields.get("bucket") == self.bucket:
            self.fired = True
            ray.kill(self.actor, no_restart=True)
        return record


def _ranks_ctx(trainer: Any, engines: list[RayEngine], **kw: Any) -> protocol.RefitContext:
    return protocol.RefitContext(
        source=None, transport=SharedMemoryTransport(), engines=engines, ranks=trainer.ranks,
        bucket_bytes=SMALL_BUCKET, deadline_s=30, call_timeout_s=10, **kw,
    )  # fmt: skip


def test_trainer_ranks_as_ray_actors_refit_and_a_rank_lost_mid_refit_is_handled(engines: list[RayEngine]) -> None:
    """Two FSDP2 trainer ranks as Ray actors (their steps through RankHost, numbered and ordered),
    the driver leading: a refit lands bit-exact; then rank 1's actor is killed mid-transfer: the
    run fails inside its deadline naming rank 1, no engine serves mixed weights, the lock is
    released; a fresh trainer then refits the same engines."""
    from refit.ray_job import start_ranks

    trainer = start_ranks(2, {"seed": 3})
    engines.extend(RayEngine.start(f"ranks-e{i}", CONFIG, seed=0) for i in range(2))
    ctx = _ranks_ctx(trainer, engines)
    try:
        trainer.train(2)
        first = protocol.run(ctx)
        assert first.ok, first.error
        assert first.buckets > 3 and len(first.rank_stats) == 2
        ref = trainer.reference()
        assert all(_exact(e, ref) for e in engines)
        assert greedy(ref, PROMPT, 6) == engines[0].generate(PROMPT, 6)["output"]
        ctx.close()

        trainer.train(2)
        killer = _KillRankAt(trainer.actors[1], "pack", 2)
        ctx = _ranks_ctx(trainer, engines, trace=killer, version=first.version)
        t0 = time.monotonic()
        lost = protocol.run(ctx)
        assert killer.fired and time.monotonic() - t0 < 30 + 10
        assert not lost.ok and "rank 1" in str(lost.error) and "died" in str(lost.error), lost.error
        assert ctx.lock is not None and ctx.lock.holder is None
        for e in engines:  # out of service (quarantined), or serving the old weights whole: never a mix
            info = e.info()
            assert info["quarantined"] or (_exact(e, ref) and not info["dirty"] and not info["paused"]), info
        ctx.close()
    finally:
        trainer.close()

    fresh = start_ranks(2, {"seed": 3})
    try:
        fresh.train(1)
        ctx = _ranks_ctx(fresh, engines, version=first.version)
        again = protocol.run(ctx)
        assert again.ok, again.error
        ref = fresh.reference()
        assert all(_exact(e, ref) and not e.info()["quarantined"] for e in engines)
        ctx.close()
    finally:
        fresh.close()


def test_ray_ranks_refuse_a_context_without_source_unless_hosted_elsewhere() -> None:
    with pytest.raises(protocol.ConfigError, match="source is required"):
        protocol.RefitContext(source=None, transport=SharedMemoryTransport(), engines=[])


def test_the_worked_ray_rl_loop_example_runs_and_the_engines_learn() -> None:
    """examples/ray_rl_loop.py as a user runs it (its own local cluster, in a subprocess): six RL
    iterations, each refit between optimizer steps; rollouts come from the version the last refit
    published, and the reward the engines earn rises."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "ray_rl_loop.py")], capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"iteration (\d): mean reward ([\d.]+) \(rollouts from weight version \[([\d, ]+)\]\); "
                      r"refit to version (\d+)", out.stdout)  # fmt: skip
    assert [int(r[0]) for r in rows] == list(range(6)), out.stdout
    for it, _, versions, published in rows:
        assert {int(v) for v in versions.split(",")} == {int(it)} and int(published) == int(it) + 1
    assert float(rows[-1][1]) > float(rows[0][1]) + 0.3, out.stdout


def test_rank_host_orders_steps_per_leader_and_refuses_a_duplicate() -> None:
    """RankHost on its own (no Ray needed): steps start in each leader's numbering whatever order
    they arrive in; a number seen before is answered with an error at once; two leaders (two
    contexts over the same rank actors) each keep their own numbering (found by an adversarial
    review: a second context made the first one's steps wait forever)."""
    from refit.drivers import ray_actors
    from refit.drivers.ray_actors import RankHost
    from refit.protocol.ranks import RankStep

    host = RankHost(TorchSource(TinyLlama(CONFIG, seed=0)), SharedMemoryTransport(), 0, 1)
    try:
        early = host.submit("a", 1, RankStep("metas", "IDLE"))
        assert not early.done()  # step 1 waits for step 0
        first = host.submit("a", 0, RankStep("metas", "IDLE"))
        assert first.result(timeout=10)[0] == "ok" and early.result(timeout=10)[0] == "ok"
        twice = host.submit("a", 0, RankStep("metas", "IDLE")).result(timeout=1)
        assert twice[0] == "err" and "delivered twice" in twice[1]
        other = host.submit("b", 0, RankStep("metas", "IDLE"))  # another leader: its own numbering
        again = host.submit("a", 2, RankStep("metas", "IDLE"))  # the first one goes on where it was
        assert other.result(timeout=10)[0] == "ok" and again.result(timeout=10)[0] == "ok"
        # a host that never got a leader's earlier steps (a restarted actor's fresh host): it says so
        # once they have not come within GAP_S, and refuses that leader's later steps at once
        stranded = host.submit("c", 7, RankStep("metas", "IDLE"))
        assert not stranded.done()
        tag, why, _ = stranded.result(timeout=ray_actors.GAP_S + 5)
        assert tag == "err" and "never got step 0" in why and "start a new context" in why
        assert host.submit("c", 8, RankStep("metas", "IDLE")).result(timeout=1)[0] == "err"
        assert host.submit("a", 3, RankStep("metas", "IDLE")).result(timeout=10)[0] == "ok"  # others unaffected
    finally:
        host.close()
