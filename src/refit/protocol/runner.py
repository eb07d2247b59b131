"""`run(ctx)`: one refit, driven by the leader through the state tables; cleanup always runs.

This module is the phase script (`_Run.execute`, then `commit`, or `abort`). It decides nothing
about an engine itself: calls go out through `waves.Waves` under one `waves.Budget`, each result is
recorded (`record.Recording`) and handed to the `ledger.Ledger`, which keeps each engine's machines
(position, weights, failure, memory) and derives what it is owed and its outcome; what lasts
across runs is the context's `session.Session`.

How a run proceeds (on the leader; other trainer ranks follow, see `refit.protocol.ranks`):
  1. Take the engines' lock with a fresh owner token (bounded; busy -> RefitBusyError, nothing
     done). Read each engine's incarnation (bounded). Every rank reports its tensor metadata; the
     ranks must agree; the transport plans the buckets.
  2. Engine calls go out in waves. Steady state takes two control waves, [probe, (resume weights),
     pause, flush, begin] and [publish, continue, (resume KV)], around the bucket loop; finalize
     rides on the last bucket's call (and, when nothing can refuse, bucket 0 on the pause wave).
  3. An engine whose call fails leaves the attempt; the others carry on. Engines that failed with
     an error inside the update are retried (a collective group a member broke is rebuilt first).
  4. TRANSFERRING streams buckets through `transport.slots` buffers: ranks pack bucket k while
     engines copy bucket k-1; a buffer is released once every engine answered, else abandoned.
  5. CONTINUING: a commit gate re-checks from the run's own events that an engine's last attempt
     acked every bucket and finalized; those publish and continue. Engines that got no byte
     continue on their old weights; engines holding weights no version names are quarantined.
  6. A failure of the run itself moves to ABORTING: owed finalizes run, the trainer is restored,
     a dirty connection is torn down, clean engines continue, a colocated engine never paused
     gets its memory released again, poisoned ones are quarantined. Cleanup is bounded by the
     deadline plus `cleanup_grace_s`; past that, owed calls are still sent with a short floor.
  7. The run's events are checked against `refit.invariants`; a violation raises.

Atomic runs (`RefitContext(atomic=True)`, `execute_atomic`) keep generation going through the
transfer: the probe wave comes alone (each engine's answer says what a staged copy needs, checked
before connect), then each engine stages (a session into a second copy), the buckets stream and
finalize into the copies, the copies are verified, and one wave pauses each ready engine, flushes
its cache, swaps the copy in and publishes and continues it: generation stops for that wave only.
An engine that will not swap has its copy discarded and goes on as it was.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from refit import invariants
from refit.buckets import BucketManifest
from refit.drivers.base import Step, StepResult, Topology, hashes_writes
from refit.errors import DeadlineExceeded, DriverCallError, EngineError, InvariantViolation, NoTimeLeft, RefitError
from refit.protocol import faults
from refit.protocol.answers import wrap_error
from refit.protocol.context import RefitContext, RefitResult
from refit.protocol.ledger import Engine, Ledger, hold_step
from refit.protocol.lock import release_for_run, take_for_run
from refit.protocol.ranks import RankStep
from refit.protocol.record import Recording
from refit.protocol.result import assemble, finish
from refit.protocol.session import disconnect
from refit.protocol.waves import Budget, RankCall, Wave, Waves
from refit.states import (
    Connection,
    ConnectionEvent,
    EngineState,
    FactMachine,
    Memory,
    RefitMachine,
    RefitState,
    Trainer,
    TrainerEvent,
    Trigger,
)
from refit.verify import (
    PROBE_TOP,
    default_prompts,
    digests_of,
    merge,
    probe_tolerance,
    probes_of,
    uncovered,
    unmappable,
)

S, T, E, CE, M = RefitState, Trigger, EngineState, ConnectionEvent, Memory


@dataclass
class _Bucket:
    manifest: BucketManifest
    wave: Wave
    send: RankCall | None


class _Run(Recording):
    """One run on the leader: the phase script. Calls go out through `waves`, outcomes go into
    `ledger`, and what lasts across runs is in the context's `session`."""

    def __init__(self, ctx: RefitContext) -> None:
        self.ctx = ctx
        self.session = session = ctx.session
        self.run_id = uuid.uuid4().hex[:12]
        self.owner = f"{self.run_id}:{uuid.uuid4().hex[:8]}"
        self.machine = RefitMachine()
        self.previous_version = session.version
        self.version = session.next_version
        self.clock = ctx.clock
        self.budget = Budget.of(ctx.deadline_s, ctx.cleanup_grace_s, ctx.call_timeout_s, ctx.clock)
        self.deadline = self.budget.deadline
        self.transport = ctx.transport
        drivers, ranks = faults.wrap(ctx.faults, ctx.engines, ctx.ranks, self.fault_fired)
        self.waves = Waves(drivers, ranks, session.lane, self.budget, self.clock, ctx.ranks.world if ctx.ranks else 1)
        caps = [
            tuple(bool(getattr(d, cap, False)) for cap in ("begin_moves_weights", "holds_requests",
                                                           "holds_adapters_locally"))
            for d in ctx.engines
        ]  # fmt: skip
        self.ledger = Ledger(
            self.version,
            [Engine(i, d.name, d.tp_size, d.name, None, *caps[i]) for i, d in enumerate(ctx.engines)],
            adapter=None if ctx.adapter is None else ctx.adapter["name"],
        )
        self.engines = self.ledger.engines
        self.trainer = FactMachine("trainer")
        self.attempt = 0
        self.events: list[dict[str, Any]] = []
        self.phase_seconds: dict[str, float] = {}
        self._phase_t0 = self.clock()
        self.plan: list[BucketManifest] = []
        self.epochs: tuple[Any, ...] = ()  # every rank's storage epoch (storage-sharing transports)
        self.topology: Topology | None = None
        self.bytes_moved = 0
        self.inflight: deque[_Bucket] = deque()
        self.held: list[tuple[Engine, Step, StepResult, int]] = []  # finalizes that rode on last buckets
        self.rode = 0  # 1: bucket 0 rode the pause wave (`ride_first_bucket`)
        self.verifying = ctx.verify != "off"
        self.probe: list[tuple[list[int], list[int]]] | None = None  # verify="probe": (prompt, token ids)
        self.digest_kind = ctx.digest_kind if digests_of(ctx.verify) else None
        ctx.check_digest_point()  # (it may have changed since the context was made)
        ctx.check_max_staleness()
        ctx.check_adapter()  # (the mode, verify mode, policy and engines may have changed too)
        ctx.check_kv()
        ctx.check_atomic()
        self.written_kind = [  # per engine: the digest its begin asks it to compute while writing, if any
            self.digest_kind if ctx.digest_point != "served" and hashes_writes(d, self.digest_kind) else None
            for d in ctx.engines
        ]
        self.lock_taken: int | None = None  # the lock's acquisition count once this run took it
        self.error: RefitError | None = None

    # ---- the happy path ------------------------------------------------------------------------

    def execute(self) -> None:
        ctx = self.ctx
        self.prepare()
        if ctx.staged:
            self.execute_atomic()
            return
        state = "OFFLOADING" if ctx.colocated else "CONNECTING"
        if ctx.colocated:
            self.enter(T.OFFLOAD)
            self.trainer.fire(TrainerEvent.OFFLOAD)
            self.rank_call(RankStep("offload", state))
        else:
            self.enter(T.CONNECT)
        head = [Step("probe", state, (self.version,))]
        if ctx.colocated:
            head.append(Step("resume_memory", state, (["weights"],)))

        def tail(e: Engine) -> list[Step]:
            return [Step("pause", "PAUSING", (ctx.pause_mode,)), Step("flush", "INVALIDATING"), self.begin_step(e)]

        members = self.engines
        self.topology = self.session.topology
        if self.needs_connect(members):
            self.wave({e: list(head) for e in members})
            self.check_probes()
            self.require_engines("after the probe")
            if ctx.colocated:
                self.enter(T.CONNECT)
            self.connect([e for e in members if e.active], "CONNECTING")
            self.require_engines("attached to the transport")
            self.wave({e: tail(e) for e in members if e.active})
        elif self.first_bucket_can_ride(members):
            self.ride_first_bucket({e: head + tail(e) for e in members})
            self.check_probes()
        else:
            self.wave({e: head + tail(e) for e in members})
            self.check_probes()
        self.require_engines("paused, flushed and in an update session")
        self.update(E.OPEN, start=self.rode)

    def execute_atomic(self) -> None:
        """CONNECTING (the probe wave alone, the memory check, connect), STAGING, TRANSFERRING,
        POST_PROCESSING, VERIFYING into the staged copies while generation goes on; retries discard
        and stage again (RESTAGE); then SWAPPING and CONTINUING in one wave (`commit`)."""
        self.enter(T.CONNECT)
        members = self.engines
        self.topology = self.session.topology
        if (
            self.ctx.adapter is not None and self.ctx.lora_ride and not self.needs_connect(members)
            and self.first_bucket_can_ride(members)
        ):  # fmt: skip
            # a LoRA refit in steady state (no memory to check before staging: a version's slab is the
            # engine's to find): the probe, the stage and bucket 0's load (with the finalize and
            # verify of a one-bucket plan) go in one wave, one request per engine
            self.ride_first_bucket({e: [self.probe_step("CONNECTING"), self.begin_step(e)] for e in members})
            self.check_probes()
            self.emit("run", "staging", memory={e.name: e.staging for e in self.engines if e.active})
            self.require_engines("staging a version of the adapter")
            self.update(E.STAGING, start=self.rode)
            return
        self.wave({e: [self.probe_step("CONNECTING")] for e in members})
        self.check_probes()
        self.require_engines("after the probe")
        problems = [] if self.ctx.adapter is not None else self.ledger.staging_problems()
        if problems:
            raise RefitError(
                "atomic refit refused before connect, nothing moved: " + "; ".join(problems)
                + " (free memory on the engines, or pass atomic=False to refit in place)",
                state="CONNECTING",
            )  # fmt: skip
        self.emit("run", "staging", memory={e.name: e.staging for e in self.engines if e.active})
        if self.needs_connect(members):
            self.connect([e for e in members if e.active], "CONNECTING")
            self.require_engines("attached to the transport")
        self.enter(T.STAGE)
        self.wave({e: [self.begin_step(e)] for e in members if e.active})
        self.require_engines("staging a copy of the weights")
        self.update(E.STAGING)

    def update(self, opened_state: EngineState, *, start: int = 0) -> None:
        """The engines whose session opened (`opened_state`: OPEN, or STAGING in an atomic run)
        stream from bucket `start`; engines the ledger calls retryable begin again (a retry:
        flush and begin; atomic: discard a stranded copy and stage) while attempts and time
        remain, a broken or changed collective group rebuilt first; then the commit."""
        ctx = self.ctx
        opened = [e for e in self.engines if e.active and e.state == opened_state]
        if self.group_differs(opened):  # a member left before any byte moved: the group without it
            self.enter(T.RECONNECT)
            self.connect(opened, "RECONNECTING")
        self.stream([e for e in opened if e.active], start=start)
        while retry := (self.ledger.retryable(ctx.retries) if self.deadline.remaining() > 0 else []):
            self.attempt += 1
            for e in retry:
                self.ledger.begin_attempt(e, self.attempt)
            if self.session.connection.state == Connection.BROKEN or self.group_differs(retry):
                self.enter(T.RECONNECT)
                self.connect(retry, "RECONNECTING")
            if ctx.staged:
                self.enter(T.RESTAGE)
                again = {e: [*([Step("discard", "STAGING")] if e.state == E.STRANDED else []), self.begin_step(e)]
                         for e in retry if e.active}  # fmt: skip
            else:
                self.enter(T.RETRY)
                again = {e: [Step("flush", "INVALIDATING"), self.begin_step(e)] for e in retry if e.active}
            self.wave(again)
            self.stream([e for e in retry if e.active and e.state == opened_state])
        self.commit()
        self.enter(T.FINISH)

    def begin_step(self, e: Engine) -> Step:
        """INVALIDATING's `begin(plan)`; with the digest kind as well where the engine hashes what
        it writes (`written_digests`) and the run verifies at the write (`digest_point`)."""
        kind = self.written_kind[e.index]
        adapter = self.ctx.adapter
        if adapter is not None:  # a LoRA refit: into a new version of the adapter (`EngineDriver.stage`)
            spec = {**adapter, "version": self.version, "max_live": self.ctx.max_live}
            return Step("stage", "STAGING", (self.plan, kind, spec))
        call, state = ("stage", "STAGING") if self.ctx.atomic else ("begin", "INVALIDATING")
        return Step(call, state, (self.plan,) if kind is None else (self.plan, kind))

    def probe_step(self, state: str) -> Step:
        """The probe: the target version, and in a LoRA refit the adapter whose version it reads."""
        adapter = self.ctx.adapter
        return Step("probe", state, (self.version,) if adapter is None else (self.version, adapter["name"]))

    def group_differs(self, engines: list[Engine]) -> bool:
        """A collective group is all-or-nothing per bucket: an attempt streams through it only when
        its members are exactly the engines that load (a member that does not receive would hold
        every broadcast until the group's timeout). A retry of some engines (a failed finalize, a
        rejected verification) rebuilds it for them."""
        if not self.transport.collective or self.topology is None:
            return False
        return {e.name for e in engines if e.active} != {s.name for s in self.topology.engines}

    def prepare(self) -> None:
        """IDLE: every rank's metadata (which must agree), the plan, storage epochs."""
        per_rank = self.rank_call(RankStep("metas", "IDLE"))
        metas = per_rank[0]
        for rank, other in enumerate(per_rank[1:], start=1):
            if other != metas:
                diff = next((f"{a} vs {b}" for a, b in zip(metas, other, strict=False) if a != b), "a different count")
                raise RefitError(f"trainer rank {rank} sends different tensors than rank 0: {diff}", state="IDLE")
        self.plan = self.ledger.plan = self.session.plan_for(self.transport, self.ctx.bucket_bytes, metas)
        self.emit(
            "plan", "buckets", buckets=len(self.plan), nbytes=sum(m.nbytes for m in self.plan), tensors=len(metas),
            manifests=[m.summary() for m in self.plan],
        )  # fmt: skip
        unreachable = self.ctx.faults.out_of_reach(len(self.plan), len(self.engines)) if self.ctx.faults else []
        if unreachable:  # a fault that cannot fire tests nothing: refused before anything moves
            raise RefitError("planned fault can never fire: " + "; ".join(unreachable), state="IDLE")
        if self.digest_kind is not None:
            heads = {m.name: m.heads for m in metas if m.heads is not None}
            gaps = unmappable(self.digest_kind, {m.name: tuple(m.shape) for m in metas}, heads)
            if gaps:
                raise RefitError(
                    f"verify by {self.digest_kind} digests cannot cover what the trainer sends: {'; '.join(gaps[:3])}"
                    + (f"; and {len(gaps) - 3} more" if len(gaps) > 3 else "")
                    + " (or pass verify='probe' or 'off')",
                    state="IDLE",
                )
        self.read_epochs("IDLE")
        if probes_of(self.ctx.verify):
            self.reference_logprobs(metas)
        if self.digest_kind == "wsum":  # a GPU hashes a resident source now, off the stall (asynchronously)
            self.rank_call(RankStep("predigest", "IDLE", (self.plan, self.digest_kind)))
        if self.transport.wants_prepare:  # work that needs no engine, done before any is paused
            self.rank_call(RankStep("prepare", "IDLE", (self.plan,)))

    def reference_logprobs(self, metas: list[Any]) -> None:
        """verify="probe", IDLE (before the trainer is offloaded): the trainer's model scores the
        probe's prompts with the weights it is about to send; the engines will answer for the same
        prompts at the same tokens."""
        vocab = next((m.shape[0] for m in metas if "embed" in m.name and len(m.shape) == 2), 2)
        prompts = [list(p) for p in self.ctx.probe_prompts] if self.ctx.probe_prompts else default_prompts(vocab)
        tolerance = probe_tolerance([m.dtype for m in metas])
        step = RankStep("logprobs", "IDLE", (prompts, PROBE_TOP))
        answers = self.rank_call(step, prompts=prompts, tolerance=tolerance)
        expected = next((a for a in answers if a is not None), None)
        if not isinstance(expected, list) or len(expected) != len(prompts):
            what = f"the trainer's source scored {type(expected).__name__}, not {len(prompts)} prompts"
            raise RefitError(what, state="IDLE")
        self.ledger.probe = {"expected": expected, "tolerance": tolerance}
        self.probe = [(p, list(a["ids"])) for p, a in zip(prompts, expected, strict=True)]

    def read_epochs(self, state: str) -> None:
        """Every rank's storage epoch, for a transport that shares the source's storages: a
        connection is reused only for the storages it shared (a reallocated trainer reconnects)."""
        if self.transport.shares_storages:
            self.epochs = tuple(self.rank_call(RankStep("epoch", state)))

    def read_incarnations(self) -> None:
        """Each engine's incarnation (a restarted engine is reconnected and fully refit), bounded."""
        session = self.session
        drivers = self.waves.drivers
        reads = [lambda d=drivers[e.index]: d.incarnation for e in self.engines]
        for e, inc in zip(self.engines, self.waves.each(self.engines, reads, "incarnation"), strict=True):
            e.incarnation = inc
            known = session.incarnations.get(e.name)
            restarted = known is not None and known != inc
            e.previous_version = None if restarted else session.engine_versions.get(e.name, session.version)
            e.attempts, e.attempt = 1, 0

    def check_probes(self) -> None:
        """A trainer whose version counter is behind an engine's is refused before any byte moves."""
        if self.ledger.ahead:
            raise RefitError(
                f"engines {self.ledger.ahead} already hold version {self.version} or newer; the trainer's "
                f"version counter ({self.previous_version}) is behind: nothing was moved (a trainer resuming from a "
                f"checkpoint starts its context where the engines are: RefitContext(..., version=<the version they "
                f"hold>))",
                state=str(self.machine.state),
            )

    def needs_connect(self, members: list[Engine]) -> bool:
        """A connection is reused only when nothing spoiled it and it serves these members, this
        plan, this mode and these storages."""
        reusable = self.session.reusable(
            self.connection_key(members), self.ctx.transport_connected, [e.incarnation for e in members]
        )
        return not (reusable and self.session.connection.state == Connection.CLEAN)

    def connection_key(self, members: list[Engine]) -> tuple[Any, ...]:
        return (tuple((e.name, e.incarnation, e.tp) for e in members), tuple(self.plan), self.ctx.mode, self.epochs)

    def connect(self, members: list[Engine], state: str) -> None:
        """Connect the transport on every rank and attach `members` (a collective transport's
        group forms while the engines attach: `join` runs at the same time). A group that did not
        form is torn down and rebuilt without the members to blame (dead, hung, or failing for a
        reason of their own rather than because the group could not form)."""
        ctx, session = self.ctx, self.session
        while True:
            if session.has_connection(ctx.transport_connected):
                self.teardown(cleanup=False)
            session.building()
            topo = Topology.of(
                ctx.ranks.world if ctx.ranks else 1, [(e.name, e.tp) for e in members], colocated=ctx.colocated,
                timeout_s=max(self.budget.engine_call() * 0.7, 0.05),
            )  # fmt: skip
            infos = self.rank_call(RankStep("connect", state, (self.plan, topo)))
            per_engine = self.transport.attach_infos(infos, topo)
            w = self.waves.start({e: [Step("attach", state, (per_engine[e.name],))] for e in members})
            join = self.waves.rank_start(RankStep("join", state)) if self.transport.collective else None
            results = self.waves.wait(w)
            self.absorb(results, w.batch, alongside=join)
            session.attached |= {e.incarnation for e, pairs in results.items() if pairs and pairs[-1][1].ok}
            formed = join is None or (join.future.done() and join.future.exception() is None)
            attached = [e for e in members if e.active]
            if not self.transport.collective or (formed and len(attached) == len(members)):
                members = attached
                break
            blamed = [e for e in members if not _rendezvous_only(e, results.get(e, []))]
            if not blamed or len(blamed) == len(members) or self.deadline.remaining() <= 0:
                self.teardown(cleanup=False)
                raise self.ledger.first_error or DriverCallError("the transport group did not form", state=state)
            members = [e for e in members if e not in blamed]
            for e in members:  # they failed only because the group could not form: they try again
                self.ledger.rejoin(e)
        self.topology = topo
        self.read_epochs(state)  # what was shared (sharing may have moved a CPU storage into shared memory)
        session.formed(self.connection_key(members), topo)

    def teardown(self, *, cleanup: bool) -> None:
        """Engines detach, every rank disconnects; recorded, bounded, never raises."""
        attached = [e for e in self.engines if e.reachable]  # detaching one never attached changes nothing
        self.session.tear_down()
        state = str(self.machine.state)
        if attached:
            # inside the run (before a connect) the run's own deadline bounds it; only cleanup may use the grace
            w = self.waves.start({e: [Step("detach", state)] for e in attached}, cleanup=cleanup)
            for e, pairs in self.waves.wait(w).items():
                for step, res in pairs:
                    self.record(e, step, res, w.batch, state=state)
        self.rank_wait(self.waves.rank_start(RankStep("disconnect", state), cleanup=True))

    # ---- the bucket loop ------------------------------------------------------------------------

    def first_bucket_can_ride(self, members: list[Engine]) -> bool:
        """Whether bucket 0 may ride the pause wave: a run over a point-to-point transport
        (colocated or not: a colocated engine's wave resumes its weights' memory before the load),
        no other run has taken the engines' lock since this context's last run (the
        lock counts its acquisitions; a lock that cannot say means no ride), and every engine is
        the incarnation this context last saw, at a version it knows to be below this run's. So no
        probe can refuse: bytes move only where nothing would stop them."""
        session = self.session
        if self.transport.collective or not self.plan or (self.ctx.colocated and not self.ctx.colocated_ride):
            return False
        if self.lock_taken is None or session.lock_taken is None or self.lock_taken != session.lock_taken + 1:
            return False
        for e in members:
            known = session.engine_versions.get(e.name)
            if session.incarnations.get(e.name) != e.incarnation or not isinstance(known, int) or known >= self.version:
                return False
        return True

    def ride_first_bucket(self, steps: dict[Engine, list[Step]]) -> None:
        """Steady state, every engine where this context left it (`first_bucket_can_ride`): bucket
        0 is packed before any engine pauses and each engine's pause wave carries its load (and
        the finalize, for a one-bucket plan): the engines stall for one round trip less. The
        wave's steps are recorded state by state as any wave's, the pack in TRANSFERRING; a pack
        that fails sends the wave without the load (the run then fails in TRANSFERRING, with no
        byte moved, as it would have)."""
        manifest = self.plan[0]
        step = RankStep("pack", "TRANSFERRING", (0, self.attempt, self.digest_kind), 0)
        pack = self.waves.rank_start(step, manifest=manifest.summary())
        members = list(steps)
        plan = {e: list(s) for e, s in steps.items()}
        if self.waves.rank_settle(pack):
            assert self.topology is not None
            payloads = self.transport.payloads(manifest, pack.future.result(), self.topology)
            self.bytes_moved += manifest.payload_bytes
            for e in members:
                plan[e].append(Step("load", "TRANSFERRING", (payloads[e.name],), 0))
                if len(self.plan) == 1:
                    plan[e].extend(self.closing())
        w = self.waves.start(plan)
        results = self.waves.wait(w)
        later = ("finalize", "verify")
        # a one-bucket plan's finalize (and verify) rode too: it counts only where the load went in;
        # an engine whose call failed before (a refused probe, a death: every step then carries the
        # error) never finalized anything
        held = {
            e: [(s, r) for s, r in pairs if s.call in later]
            if any(s.call == "load" and r.ok for s, r in pairs) else []
            for e, pairs in results.items()
        }  # fmt: skip
        failed = self.absorb(
            {e: [(s, r) for s, r in pairs if s.call not in later] for e, pairs in results.items()},
            w.batch,
            alongside=pack,
        )
        if failed is not None:
            raise wrap_error(failed, "pack", "TRANSFERRING", None, 0) from failed
        for e, pairs in held.items():  # recorded in POST_PROCESSING, as a last bucket's finalize is
            self.held.extend((e, s, r, w.batch) for s, r in pairs)
        timed_out = any(s.call == "load" and r.outcome == "timeout" for pairs in results.values() for s, r in pairs)
        self.free(0, timed_out, load_error=_first_load_error(results))
        self.rode = 1

    def free(
        self, k: int, timed_out: bool, *, cleanup: bool = False, hung: Sequence[RefitError] = (),
        load_error: RefitError | None = None,
    ) -> None:  # fmt: skip
        """Release bucket `k`'s buffer on every rank, or abandon it if an engine did not answer
        (it may still read it: the connection is not reused by the next run). `hung`: the calls of
        this bucket's wave that ran out of time (a last bucket's finalize or verify too): when the
        deadline has passed by the release, the first of them is the run's error, not the release.
        `load_error`: an engine's load of `k` failed; a release refused then (an engine still holds
        the buffer: the one that failed, likely; a bucket of the trainer's own memory cannot be
        replaced) fails the run with the load's error, the release's chained to it, and the
        connection is not reused."""
        if timed_out:
            self.session.connection.fire(CE.ABANDON)
        elif load_error is not None and _kind(load_error) in ("bad_payload", "not_attached"):
            # the engine could not read what this connection sent (its end was attached elsewhere since,
            # by another context over the same engines, say): the next run builds the connection again
            self.session.connection.fire(CE.ABANDON)
        call = "abandon" if timed_out else "release"
        rc = self.waves.rank_start(RankStep(call, "TRANSFERRING", (k,), k), cleanup=cleanup)
        _, exc = self.rank_wait(rc, state=str(self.machine.state) if cleanup else None)
        if exc is not None and load_error is not None and not cleanup:
            if not timed_out:
                self.session.connection.fire(CE.ABANDON)
            raise load_error from exc
        if exc is not None and not cleanup:
            if isinstance(exc, NoTimeLeft) and hung:
                raise hung[0] from exc
            raise wrap_error(exc, call, "TRANSFERRING", None, k) from exc

    def stream(self, engines: list[Engine], start: int = 0) -> None:
        """TRANSFERRING then POST_PROCESSING for one attempt of `engines`, from bucket `start` (1:
        bucket 0 rode the pause wave and the run is in TRANSFERRING already)."""
        if start == 0:
            self.enter(T.TRANSFER)
        n = len(self.plan)
        slots = max(self.transport.slots, 1)
        for manifest in self.plan[start:] if engines else ():
            k = manifest.index
            if k > 0:
                self.enter(T.NEXT_BUCKET, bucket=k)
            while len(self.inflight) >= slots:
                self.drain_oldest()
            live = [e for e in engines if e.active]
            if not live or self.session.connection.state == Connection.BROKEN:
                break
            pack = RankStep("pack", "TRANSFERRING", (k, self.attempt, self.digest_kind), k)
            parts = self.rank_call(pack, manifest=manifest.summary())
            assert self.topology is not None
            payloads = self.transport.payloads(manifest, parts, self.topology)
            self.bytes_moved += manifest.payload_bytes
            steps = {e: [Step("load", "TRANSFERRING", (payloads[e.name],), k)] for e in live}
            if k == n - 1:
                for e in live:
                    steps[e].extend(self.closing())
            w = self.waves.start(steps, count=False)
            collective = self.transport.collective
            send = self.waves.rank_start(RankStep("send", "TRANSFERRING", (k,), k)) if collective else None
            self.inflight.append(_Bucket(manifest, w, send))
        while self.inflight:
            self.drain_oldest()
        self.enter(T.POST_PROCESS)
        self.post_process()

    def drain_oldest(self, *, cleanup: bool = False) -> None:
        """Collect every engine's answer for the oldest in-flight bucket, then free its buffer."""
        b = self.inflight.popleft()
        k = b.manifest.index
        results = self.waves.wait(b.wave)
        sent: BaseException | None = None
        if b.send is not None:
            _, sent = self.rank_wait(b.send)
        timed_out = isinstance(sent, TimeoutError)
        for e in self.engines:
            for step, res in results.get(e, ()):
                if step.call == "load":
                    self.apply(e, step, res, b.wave.batch)
                    timed_out |= res.outcome == "timeout"
                else:
                    self.held.append((e, step, res, b.wave.batch))
        failed = [e.name for e, pairs in results.items() for s, r in pairs if s.call == "load" and not r.ok]
        if self.transport.collective and (failed or sent is not None):
            self.break_group(k, failed)
        hung = [
            wrap_error(r.error, s.call, s.state, e.name, s.bucket)
            for e, pairs in results.items()
            for s, r in pairs
            if r.outcome == "timeout" and r.error is not None and not isinstance(r.error, NoTimeLeft)
        ]
        self.free(k, timed_out, cleanup=cleanup, hung=hung, load_error=_first_load_error(results))

    def break_group(self, k: int, failed: list[str]) -> None:
        """A collective group is all-or-nothing per bucket: once a member failed, no later bucket
        can go through it. Every engine of the attempt that still needs buckets fails with it."""
        self.session.connection.fire(CE.BREAK)
        who = ", ".join(failed) if failed else "the trainer's send"
        for e in self.engines:
            if e.active and e.state in (E.OPEN, E.STAGING) and len(e.acked) < len(self.plan):
                reason = RuntimeError(f"the transport group broke at bucket {k} ({who} failed)")
                self.drop(e, Step("load", "TRANSFERRING", bucket=k), reason)

    def closing(self) -> list[Step]:
        """What follows an engine's last bucket in the same call: its finalize and, when the run
        verifies, its report of what it will serve (no extra round trip)."""
        finalize = Step("finalize", "POST_PROCESSING")
        return [finalize, Step("verify", "VERIFYING", (self.digest_kind, self.probe))] if self.verifying else [finalize]

    def post_process(self, state: str | None = None, *, cleanup: bool = False) -> None:
        """Finalizes that rode on last buckets, then every other finalize owed (POST_PROCESSING,
        or ABORTING on the failure path, where nothing is verified or published: reports are only
        recorded), then VERIFYING for the engines that reported what they will serve."""
        held, self.held = self.held, []
        checks = [h for h in held if h[1].call == "verify"]
        for e, step, res, batch in held:
            if step.call != "verify":
                self.apply(e, step, res, batch, state)
        owed = self.ledger.owes_finalize()
        state = state or "POST_PROCESSING"
        if owed:
            complete = len(self.plan)  # only an engine that acked every bucket may have something to verify
            tails = {
                e: [Step("finalize", state)] if cleanup or len(e.acked) < complete else self.closing() for e in owed
            }
            w = self.waves.start(tails, cleanup=cleanup)
            results = self.waves.wait(w)
            for e in self.engines:
                for step, res in results.get(e, ()):
                    if step.call == "verify":
                        checks.append((e, step, res, w.batch))
                    else:
                        self.apply(e, step, res, w.batch, state)
        if cleanup:  # reports are recorded unjudged (none publishes); a verify that failed fails its engine
            for e, step, res, batch in checks:
                (self.record if res.ok else self.apply)(e, step, res, batch, state)
        elif checks:
            self.verify(checks)

    def verify(self, checks: list[tuple[Engine, Step, StepResult, int]]) -> None:
        """VERIFYING: the trainer's digests of what it sent (taken while packing) against each
        engine's report of what it will serve; the ledger passes the engines that match and
        rejects the others (retried while attempts remain, else quarantined)."""
        self.enter(T.VERIFY)
        checks = sorted(checks, key=lambda c: c[0].index)
        try:
            self.trainer_digests()
        except BaseException:  # the engines' reports are recorded (unjudged: none of them publishes)
            for e, step, res, batch in checks:
                self.record(e, step, res, batch)
            raise
        for e, step, res, batch in checks:
            self.apply(e, step, res, batch)

    def trainer_digests(self) -> None:
        """The ranks' digests of what they sent, checked to cover the plan, into the ledger."""
        if self.digest_kind is None:
            return
        kind, expected = merge(self.rank_call(RankStep("digests", "VERIFYING")))
        missing = uncovered(self.digest_kind, expected, [n for m in self.plan for n in m.names])
        if kind != self.digest_kind or missing:
            what = f"the trainer ranks report no {self.digest_kind} digests of {len(missing)} tensors they sent"
            raise RefitError(f"{what} ({', '.join(missing[:3])}...)", state="VERIFYING")
        self.ledger.expected = expected

    # ---- committing ------------------------------------------------------------------------------

    def commit(self) -> None:
        """CONTINUING (and RESTORING): complete engines publish and continue, clean ones continue,
        poisoned ones are quarantined; one wave, with the trainer's restore alongside."""
        ctx = self.ctx
        ready = self.ledger.ready(verify=self.verifying)
        if ready and ctx.adapter is not None and ctx.max_live is not None:
            self.drain(ready)
            ready = [e for e in ready if e.active]
        if not ready:
            raise self.ledger.first_error or DriverCallError(
                "no engine completed the update", state=str(self.machine.state)
            )
        self.enter(T.SWAP if ctx.atomic and ctx.adapter is None else T.PUBLISH)
        for e in ready:
            problems = invariants.commit_gate(
                self.events, [e.name], len(self.plan), attempt=e.attempt, verified=self.verifying
            )
            if problems:
                raise InvariantViolation("commit gate refused to publish: " + "; ".join(problems), state="CONTINUING")
        kv = [Step("resume_memory", "RESTORING", (["kv_cache"],))] if ctx.colocated else []
        # atomic: generation stops only for this wave; the cache is flushed while paused, before the swap
        swap = [Step("pause", "SWAPPING", (ctx.pause_mode,)), Step("flush", "SWAPPING"), Step("swap", "SWAPPING")]
        # a LoRA refit: its publish is the switch (new requests get the version; nothing pauses)
        publish = [
            *(swap if ctx.atomic and ctx.adapter is None else []), Step("publish", "CONTINUING", (self.version,)),
            Step("continue_generation", "CONTINUING"), *kv,
        ]  # fmt: skip
        plan: dict[Engine, list[Step]] = {}
        for e in self.engines:
            if e in ready:
                plan[e] = list(publish)
            elif self.behind(e):  # held or continued once it is known whether anyone published
                plan[e] = []
            else:
                plan[e] = self.owed(e, "CONTINUING", "CONTINUING", kv="RESTORING")
        restore = self.waves.rank_start(RankStep("restore", "RESTORING")) if ctx.colocated else None
        w = self.waves.start(plan)
        restore_failed = self.absorb(self.waves.wait(w), w.batch, alongside=restore)
        if restore is not None:
            if restore_failed is not None:
                raise wrap_error(restore_failed, "restore", "RESTORING", None, None)
            self.trainer.fire(TrainerEvent.RESTORE)
        if not any(e.published for e in self.engines):
            raise self.ledger.first_error or DriverCallError(
                "no engine published the version", state=str(self.machine.state)
            )
        if self.session.connection.state == Connection.BROKEN:  # a group a member broke is not reused
            self.teardown(cleanup=False)
        # failure path of the commit: engines that did not publish or continue are settled now, and
        # the ones the version policy deferred are held or continued (must-run: the cleanup budget)
        state = str(self.machine.state)
        self.settle(state, state, cleanup=False, hold_last=True)
        if ctx.colocated:
            lacking = [
                e for e in self.engines if e.state == E.SERVING and e.reachable and e.region("kv_cache") == M.AS_FOUND
            ]
            if lacking:
                self.wave({e: [Step("resume_memory", state, (["kv_cache"],))] for e in lacking})

    def drain(self, engines: list[Engine]) -> None:
        """DRAINING (a LoRA refit under a version policy): each engine says whether its staged
        version may go live within max_staleness + 1 versions (`drain`: the versions it pushes out
        have no request left; while the live one is among them, its new requests wait). The call may
        wait for those requests inside it (its budget stops short of the reserve kept for the
        publish: the reference engine answers once they end, SGLang's unload once they finish).
        Engines not ready are asked again when they said those requests will have ended (`eta_s`,
        an upper bound), else after a pause (2 ms, doubling to 50 ms), while generation goes on,
        until every one is or the run's time is spent: one still not ready then leaves the attempt
        (its staged version is discarded, the versions it has serve on)."""
        self.enter(T.DRAIN)
        waiting, pause = list(engines), 0.002
        while waiting:
            hold = self.deadline.remaining() + self.ctx.cleanup_grace_s  # new requests held this long at most
            # the engines that are ready still need the run's time for their publish: a straggler is let
            # go while a tenth of the deadline (up to 1 s) is left. An engine may wait inside the call
            # until its going versions' requests end (the call's budget leaves that much)
            reserve = max(pause + 0.05, min(1.0, 0.1 * self.ctx.deadline_s))
            # (when that leaves little, the call still gets half the time left, up to 1 s: a busy engine
            # needs a decode step or two to take it up and answer)
            left = self.deadline.remaining()
            w = self.waves.start(
                {e: [Step("drain", "DRAINING", (round(max(hold, 0.0), 3),))] for e in waiting},
                limit=max(left - reserve, min(0.5 * left, 1.0)),
            )  # fmt: skip
            results = self.waves.wait(w)
            still = []
            for e in waiting:
                for step, res in results.get(e, ()):
                    self.apply(e, step, res, w.batch)
                    if res.ok and e.active and not (isinstance(res.value, dict) and res.value.get("ready") is True):
                        still.append((e, step, res.value))
            if still and self.deadline.remaining() <= reserve:
                for e, step, value in still:
                    pinned = value.get("pinned") if isinstance(value, dict) else None
                    count = f"{pinned} requests" if isinstance(pinned, int) else "requests (it does not say how many)"
                    self.drop(e, step, NoTimeLeft(
                        f"engine {e.name}: the versions its publish would push past max_staleness + 1 still had "
                        f"{count} when the run's time ran out"
                    ))  # fmt: skip
                return
            waiting = [e for e, _, _ in still]
            if waiting:
                # an engine that says when its going versions' requests end (`eta_s`) is asked again
                # then (the estimate bounds it from above), not polled meanwhile
                etas = [v.get("eta_s") for _, _, v in still if isinstance(v, dict)]
                eta = min((x for x in etas if isinstance(x, int | float) and x > 0), default=0.0)
                wait = max(pause, min(eta, self.deadline.remaining() - reserve))
                time.sleep(wait)
                pause = min(2 * pause, 0.05)

    def owed(self, e: Engine, cont: str, quarantine: str, *, kv: str) -> list[Step]:
        reason = f"refit to version {self.version} (run {self.run_id}) did not complete on this engine"
        return self.ledger.owed(
            e, colocated=self.ctx.colocated, cont=cont, quarantine=quarantine, kv=kv, reason=reason,
            hold=self.hold_reason(e),
        )  # fmt: skip

    def behind(self, e: Engine) -> bool:
        """Whether the version policy would hold `e` were the run's version published without it:
        it would serve one more than `max_staleness` behind (or one no version names)."""
        k = self.ctx.max_staleness
        if k is None or e.published:
            return False
        return e.previous_version is None or self.version - e.previous_version > k

    def hold_reason(self, e: Engine, known: int | None = None) -> str | None:
        """Why the version policy holds `e` out of service now (None: it does not): some engine
        serves the run's version (published and continued) and `e` is `behind`. `known`: the
        version `e` serves as its driver knows it, where the run could not ask `e` itself."""
        if not self.behind(e) or not any(x.published and x.state == E.SERVING for x in self.engines):
            return None
        k = self.ctx.max_staleness
        if e.previous_version is None and known is not None and k is not None and self.version - known <= k:
            return None
        was = e.previous_version if e.previous_version is not None else known
        held = "no version" if was is None else f"version {was}"
        return (
            f"stale: it holds {held}, and the fleet now serves version {self.version} (max_staleness "
            f"{self.ctx.max_staleness}, run {self.run_id}); a refit that reaches it brings it back"
        )

    def settle(self, cont: str, quarantine: str, *, cleanup: bool, hold_last: bool = False) -> None:
        """Continue the clean engines, quarantine the poisoned; an engine that refused its continue
        is quarantined in a second wave (one that refuses that too is left reported failed).
        `hold_last`: the engines the version policy may hold (`behind`) are settled after the
        others, once it is known whether any engine serves the new version, within the cleanup
        budget (telling one it is held is owed cleanup)."""
        later = [e for e in self.engines if hold_last and self.behind(e)]
        self._settle_wave({e: self.owed(e, cont, quarantine, kv=cont) for e in self.engines if e not in later}, cleanup)
        if later:
            self._settle_wave({e: self.owed(e, cont, quarantine, kv=cont) for e in later}, True)
        if self.ctx.staged:
            self.hold_hung(quarantine)
        if self.ledger.adapter is not None:
            self.hold_unreachable(quarantine)

    def hold_unreachable(self, state: str) -> None:
        """LoRA runs: an engine the run lost (it died, stopped answering or cannot be reached) that
        the version policy would hold is held anyway where its driver keeps the hold itself
        (`holds_adapters_locally`: its `generate` refuses the adapter until a refit publishes
        there), within the cleanup budget; its outcome stays "failed". An engine whose hold lives
        on the server cannot be told: the next run that reaches it brings it up to date or holds it."""
        adapter = self.ledger.adapter
        assert adapter is not None
        why = {
            e: self.hold_reason(e, known=self._driver_live(e, adapter)) for e in self.engines
            if not e.reachable and e.holds_adapters_locally and e.held is None
        }  # fmt: skip
        plan = {e: [hold_step(e, state, r, self.ledger.adapter)] for e, r in why.items() if r is not None}
        self._send_holds(plan, state, "the run could not reach it, so its driver holds the adapter until a refit does")

    def hold_hung(self, state: str) -> None:
        """Atomic runs: an engine that stopped answering while it generated serves its old weights
        once it answers again. Where the version policy would hold it, it is sent its discard and
        the hold anyway (its channel keeps them in order, behind whatever it is stuck in: they run
        when it answers); the run waits only the cleanup floor, and its outcome stays "failed"."""
        why = {e: self.hold_reason(e) for e in self.ledger.hung_generating()}
        plan = {
            e: [Step("discard", state), hold_step(e, state, r, self.ledger.adapter)]
            for e, r in why.items() if r is not None
        }  # fmt: skip
        note = "it stopped answering while it generated, so its discard and hold were sent to run once it answers"
        self._send_holds(plan, state, note)

    def _send_holds(self, plan: dict[Engine, list[Step]], state: str, note: str) -> None:
        """Send holds to engines the run lost, within the cleanup budget: each call is recorded, and
        each engine stays reported as it was, its error saying what was sent (`note`)."""
        if not plan:
            return
        w = self.waves.start(plan, cleanup=True)
        for e, pairs in self.waves.wait(w).items():
            for step, res in pairs:
                self.record(e, step, res, w.batch, state=state)
            e.error = f"{e.error}; {note}"

    def _driver_live(self, e: Engine, adapter: str) -> int | None:
        """The live version of `adapter` on `e` as its driver knows it (`live_adapter`, a driver
        that holds adapters locally: no call), or None where it knows none."""
        try:
            return int(self.ctx.engines[e.index].live_adapter(adapter))  # type: ignore[attr-defined]
        except Exception:  # none known, held, or a driver that fails to say: no version known
            return None

    def _settle_wave(self, plan: dict[Engine, list[Step]], cleanup: bool) -> None:
        if not any(plan.values()):
            return
        self.wave(plan, cleanup=cleanup)
        reason = f"refit to version {self.version} (run {self.run_id}): it refused to continue"
        refused = [
            e for e, steps in plan.items()
            if steps and e.reachable and e.state in (E.PAUSED, E.FINALIZED, E.VERIFIED, E.PUBLISHED, E.PAUSED_STAGED)
            and any(s.call == "continue_generation" for s in steps)
        ]  # fmt: skip
        if refused:
            if cleanup and self.machine.can(T.QUARANTINE):
                self.enter(T.QUARANTINE)
            state = str(self.machine.state)
            self.wave({e: [Step("quarantine", state, (reason,))] for e in refused}, cleanup=cleanup)

    # ---- the failure path ----------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """ABORTING -> [QUARANTINING] -> FAILED. Every step is bounded and recorded."""
        state = str(self.machine.state)
        self.error = exc if isinstance(exc, RefitError) else wrap_error(exc, "runner", state, None, None)
        first = self.ledger.first_error
        if isinstance(self.error, DeadlineExceeded) and (self.deadline.expired() or self.ran_out) and first is not None:
            # the deadline ran out (a call that found no time left is that fact as recorded, what
            # a replay's clock may not say yet): what ate it is the error to report
            self.error = first
        self.enter(T.FAIL)
        self.emit("run", "error", error=str(self.error))
        while self.inflight:  # what engines did with in-flight buckets, before buffers are touched
            self.drain_oldest(cleanup=True)
        self.post_process("ABORTING", cleanup=True)
        if self.trainer.state == Trainer.OFFLOADED:
            self.rank_wait(self.waves.rank_start(RankStep("restore", "ABORTING"), cleanup=True))
            self.trainer.fire(TrainerEvent.RESTORE)
        if self.session.connection.state != Connection.CLEAN or self.ledger.touched_unpublished():
            self.teardown(cleanup=True)
        self.settle("ABORTING", "QUARANTINING", cleanup=True)
        self.enter(T.LATCH)


def _first_load_error(results: dict[Engine, list[tuple[Step, StepResult]]]) -> RefitError | None:
    """The error of the first engine whose call list failed at its load (it ran, or may have: the
    engine may still hold the bucket), not at a step before it (every step after a failure carries
    its error); None when none did."""
    for e, pairs in results.items():
        first = next(((s, r) for s, r in pairs if not r.ok), None)
        if first is not None and first[0].call == "load" and first[1].error is not None:
            step, res = first
            return wrap_error(res.error, step.call, step.state, e.name, step.bucket)
    return None


def _kind(err: BaseException) -> str | None:
    """The engine's kind of error behind `err` (an EngineError, or the cause a RefitError wraps)."""
    for e in (err, getattr(err, "cause", None), err.__cause__):
        kind = getattr(e, "kind", None)
        if isinstance(kind, str):
            return kind
    return None


def _rendezvous_only(e: Engine, attach: list[tuple[Step, StepResult]]) -> bool:
    """This attach went through, or failed only because the collective group did not form."""
    if not e.reachable or not attach:
        return False
    _, res = attach[-1]
    return res.ok or (isinstance(res.error, EngineError) and res.error.kind == "rendezvous")


def run(ctx: RefitContext) -> RefitResult:
    """Drive one whole refit. Returns a RefitResult whether it succeeded or failed (errors are data:
    `result.ok`, `result.error`, per-engine `result.engines`); raises RefitBusyError when another
    run holds the engines, and InvariantViolation when the run's own events break an invariant.
    Under SPMD every rank calls it; the followers get the leader's result."""
    if ctx.session.closed:
        raise RuntimeError("this RefitContext is closed")
    assert ctx.ranks is not None
    if not ctx.leader:
        outcome = ctx.ranks.follow(ctx.deadline_s + ctx.cleanup_grace_s + 5.0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    # close() from another thread waits for this run; a second run does not queue: the lock refuses it
    took = ctx.session.in_use.acquire(blocking=False)
    try:
        if ctx.session.closed:
            raise RuntimeError("this RefitContext is closed")
        result = _lead(ctx)
    except BaseException as exc:
        ctx.ranks.finish(exc)
        raise
    finally:
        if took:
            ctx.session.in_use.release()
    ctx.ranks.finish(result)
    log = logging.getLogger(__name__)
    unfired = ctx.faults.unfired() if ctx.faults is not None else []
    if unfired:  # an injected fault that matched no step tested nothing: say so
        log.warning(
            "refit run %s: %d planned fault(s) never fired (no step matched): %s", result.run_id, len(unfired),
            "; ".join(str(f.describe()) for f in unfired),
        )  # fmt: skip
    if not result.ok:  # errors are data, but a failed refit is said out loud: a WARNING on this module's logger
        engines = ", ".join(f"{n} {o.status}" for n, o in result.engines.items())
        log.warning(
            "refit run %s failed in %s (ended %s; engines: %s): %s; trace: %s",
            result.run_id, getattr(result.error, "state", None) or result.state, result.state, engines or "none",
            result.error, result.trace_path or "not written (RefitContext(trace=PATH) writes one)",
        )  # fmt: skip
    return result


def _lead(ctx: RefitContext) -> RefitResult:
    r = _Run(ctx)
    try:
        r.read_incarnations()
    except RefitError:
        r.emit("run", "start", previous_version=r.previous_version, owner=r.owner, engines=[e.name for e in r.engines])
        r.emit("run", "end", result="incarnation_error")
        raise
    r.emit(
        "run", "start", previous_version=r.previous_version, owner=r.owner, engines=[e.name for e in r.engines],
        incarnations=[e.incarnation for e in r.engines], engine_tp=[e.tp for e in r.engines], mode=ctx.mode,
        max_staleness=ctx.max_staleness, kv=ctx.kv, atomic=ctx.staged or None, adapter=ctx.adapter,
        pause_mode=ctx.pause_mode, bucket_bytes=ctx.bucket_bytes, deadline_s=ctx.deadline_s,
        cleanup_grace_s=ctx.cleanup_grace_s, retries=ctx.retries, call_timeout_s=ctx.call_timeout_s, verify=ctx.verify,
        digest=r.digest_kind, digest_point=ctx.digest_point, layout_heads=True, colocated_ride=ctx.colocated_ride,
        lora_ride=ctx.lora_ride,
        digest_written=[e.name for e, k in zip(r.engines, r.written_kind, strict=True) if k],
        ranks=ctx.ranks.world if ctx.ranks else 1, transport=ctx.transport.kind, collective=ctx.transport.collective,
        shares_storages=ctx.transport.shares_storages or None,
    )  # fmt: skip
    take_for_run(r)
    interrupt: BaseException | None = None
    t0 = ctx.clock()
    stats: list[Any] = []
    try:
        try:
            r.execute()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                interrupt = exc  # KeyboardInterrupt / SystemExit: clean up, then re-raise
            r.abort(exc)
        stats = r.waves.end_of_run(ctx.ranks, str(r.machine.state))
    finally:
        release_for_run(r)
        outcomes, now = finish(r)
    result = assemble(r, outcomes, t0, now, stats)
    if interrupt is not None:
        raise interrupt
    if ctx.check_invariants:
        result.violations = invariants.check_run(r.events)
        if result.violations:
            err = InvariantViolation("; ".join(str(v) for v in result.violations))
            err.result = result  # type: ignore[attr-defined]
            raise err
    return result


__all__ = ["disconnect", "run"]
