"""RefitContext (what to refit, how, within what budget) and RefitResult (what happened).

A context is created once per training job and passed to every `run`: it remembers what runs
must share (the last published version, the open transport connection, the lock, the trace, the
trainer ranks and one ordered call lane per engine). `close()` disconnects and ends the trace.

Hostings. With torch.distributed running more than one rank, every rank builds its context (with
its own source and transport; engines only matter on rank 0) and calls `protocol.run(ctx)`: rank 0
leads, the others follow its decisions. Otherwise the trainer is this one process. Pass `ranks`
to choose explicitly (for example `LocalRanks([...])`, or a Ray hosting).
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from refit.drivers.base import PAUSE_MODES, EngineDriver, PauseMode, Source, Transport
from refit.errors import ConfigError, RefitError
from refit.protocol.faults import FaultPlan
from refit.protocol.lock import EngineLock, lock_for
from refit.protocol.ranks import Ranks, default_ranks
from refit.protocol.session import Session, disconnect
from refit.trace import TraceRecorder

Mode = Literal["colocated", "disaggregated"]
EngineStatus = Literal["updated", "unchanged", "quarantined", "stale", "failed"]


@dataclass
class EngineOutcome:
    """Where one engine stands after a run.

    status: updated (serves the new version), unchanged (its weights and version are those it had
    before the run, and it is in the condition it was in: serving, or with its memory released in a
    colocated job), quarantined (holds weights no version names, or none current: kept out of
    service until a refit completes), stale (was already out of service and this run did not bring
    it current, or the version policy held it out: `RefitContext.max_staleness`), failed
    (died, stopped answering, or could not be brought back to a safe condition:
    the caller must restart it; it is stale until a refit completes).
    `version` is the version the engine serves, None when it must not serve; `serving` whether it
    generates now; `verify` its last verification in this run (None: not verified): `ok`,
    `compared` (tensors), `mismatched` / `missing` / `unexpected` (HF names) and `seconds` (the
    engine's time to compute its digests).
    """

    name: str
    status: EngineStatus
    version: int | None
    buckets: int = 0  # buckets acked in its last attempt
    attempts: int = 0
    error: str | None = None
    serving: bool = False
    verify: dict[str, Any] | None = None


@dataclass
class RefitResult:
    run_id: str
    ok: bool
    state: str
    version: int | None  # the version this run published, None if it published nothing
    previous_version: int
    engines: dict[str, EngineOutcome]
    phase_seconds: dict[str, float]
    seconds: float
    bytes_moved: int  # bytes packed by the trainer ranks that feed engines, per bucket once
    bytes_delivered: int  # bytes acknowledged by engines, summed over engines
    buckets: int
    trace_path: str | None
    error: RefitError | None = None
    violations: list[Any] = field(default_factory=list)
    round_trips: int = 0  # engine fan-out waves outside the bucket loop
    ranks: int = 1
    trainer_peak_bytes: int = 0  # the most trainer memory refit held at once on any rank
    rank_stats: list[Any] = field(default_factory=list)  # per trainer rank: peak bytes, steps run
    # seconds the run went on past its deadline: the cleanup it owed (continue or quarantine each
    # engine, release the lock and buffers, restore the trainer), bounded by `cleanup_grace_s`
    past_deadline_s: float = 0.0

    def raise_for_error(self) -> RefitResult:
        if self.error is not None:
            raise self.error
        return self


@dataclass
class RefitContext:
    """Everything one refit needs.

    source, transport: this trainer rank's source and transport (one per rank). With `ranks` that
        all live in other processes (`ranks.remote`: Ray actors), the leader holds no source (None)
        and its transport, of the ranks' kind, only plans, routes and assembles payloads.
    engines: the engine drivers (read on the leader; followers may pass none).
    mode: "colocated" runs offload the trainer and restore it afterwards; "disaggregated" skips both.
    pause_mode: one of the engines' `pause_modes`: "abort" ends the requests in flight; "retract"
        and "in_place" hold them at a token boundary and continue them after the update (none is
        aborted), "retract" recomputing their KV under the new weights, "in_place" keeping it.
    kv: what the update does to held requests' KV, explicit per run: "recompute" (default; with
        pause_mode abort or retract) or "keep" (pause_mode in_place only, with engines that
        declare `supports_in_place_pause`: they keep each held request's own KV, computed with the
        old weights, and clear the prefix cache so no request started after the switch reuses an
        old entry). "keep" is off-policy: recorded in the run's start line (and replayed); the
        engines count each request's tokens read from old-weight KV.
    atomic: stage-then-swap (disaggregated runs, engines that declare `stages`). Each engine writes
        the new weights into a second copy while it keeps generating with the ones it serves; the
        copies are finalized and verified first, and generation stops only for one wave that
        pauses (in `pause_mode`, with the `kv` policy), flushes the cache, swaps the copy in,
        publishes and continues. The probe reports the memory a copy needs; a run whose copies do
        not fit is refused before connect. A copy that will not be served is discarded, and its
        engine goes on exactly as it was.
    bucket_bytes: target bucket size; a larger tensor travels alone, in a buffer of its own.
    deadline_s: the whole run's budget; cleanup_grace_s: extra time must-run cleanup may take
        after the deadline (lock release, continue-or-quarantine, restore); past both, owed
        finalizes, continues and quarantines are still sent, each wave waiting a short floor. A
        run that hits its deadline so returns up to `deadline_s + cleanup_grace_s` (10 s by
        default) after it started; `RefitResult.past_deadline_s` says how long its cleanup took.
    version: the version the engines hold now (the next successful run publishes a larger one).
    retries: how many more times an engine whose update failed is retried within the run.
    max_staleness: the fleet's version policy. 0 (default, synchronous RL: one version in
        service): once some engine published the new version, an engine that did not is held out
        of service (outcome "stale"; a later refit that reaches it brings it back). An int k: such
        an engine may go on serving while it is at most k versions behind the newest (one whose
        weights no version names is held whatever k). None: no policy; an engine that did not take
        the version is continued on the one it had (the fleet may serve two versions; the
        result's outcomes say which engine serves which).
    call_timeout_s: cap on a single engine call (None: whatever is left of the deadline); set it
        to drop a hung engine early and let the healthy ones finish inside the deadline.
    lock: the engines' owner-token lock (default: shared by every context over the same engines).
    trace: a path for the JSONL trace, a TraceRecorder, or None (events are still kept in memory).
    faults: a FaultPlan for tests and `refit demo --fail-at`.
    ranks: how the trainer ranks are reached (default: SPMD over torch.distributed when it runs
        more than one rank, this process otherwise).
    clock: the monotonic clock every deadline and timing reads (`refit replay` swaps in the
        recorded one, so the replayed run makes the same time-based decisions).
    check_invariants: check every run's events against refit.invariants and raise on violation.
    verify: before an engine publishes, check that what it will serve is what the trainer sent
        (`refit.verify`): "digest" (default) compares each tensor's digest, the trainer's taken
        while packing, the engine's computed from its own layout; an engine that differs is
        retried or quarantined like one whose update failed. "probe": a few prompts' next-token
        log-probabilities on each engine against the trainer's model (the source must score:
        `Source.logprobs`), within a tolerance by dtype; "both"; "off" trusts the engine's finalize.
    probe_prompts: the probe's prompts (token ids); default: four fixed 12-token prompts.
    digest_point: where an engine's digest is taken (docs/verify.md). "written": as the engine
        writes each byte (the digest fused into its copy, nearly free), reading back only what it
        did not write whole; proves every byte written this refit, not that nothing changed them
        after. "served": read back from memory after finalize (one more pass over the weights).
        "auto" (default): "written" where the engine can (`EngineDriver.written_digests`).
    """

    source: Source | None
    transport: Transport
    engines: Sequence[EngineDriver] = ()
    mode: Mode = "disaggregated"
    pause_mode: PauseMode = "retract"
    bucket_bytes: int = 512 << 20
    deadline_s: float = 600.0
    cleanup_grace_s: float = 10.0
    version: int = 0
    retries: int = 1
    max_staleness: int | None = 0
    kv: str = "recompute"
    atomic: bool = False
    call_timeout_s: float | None = None
    lock: EngineLock | None = None
    trace: str | Path | TraceRecorder | None = None
    faults: FaultPlan | None = None
    ranks: Ranks | None = None
    check_invariants: bool = True
    verify: str = "digest"
    probe_prompts: Sequence[Sequence[int]] | None = None
    digest_point: str = "auto"
    clock: Callable[[], float] = time.monotonic
    session: Session = field(init=False, repr=False)  # what lasts across this context's runs
    recorder: TraceRecorder = field(init=False, repr=False)
    # bucket 0 may ride a colocated run's pause wave (`refit replay` turns it off for a trace
    # recorded before colocated runs rode it: its start event has no `colocated_ride`)
    colocated_ride: bool = field(default=True, init=False, repr=False)
    # a steady LoRA run's probe and stage ride with bucket 0 (off for a trace recorded before they did)
    lora_ride: bool = field(default=True, init=False, repr=False)

    def __post_init__(self) -> None:
        self.engines = list(self.engines)
        self.validate()
        if self.ranks is None:
            assert self.source is not None  # validate() refused a missing source
            self.ranks = default_ranks(self.source, self.transport)
        if self.leader:
            self.validate_engines()
        if self.lock is None and self.engines:
            hosted = [lock for lock in (e.engine_lock() for e in self.engines) if lock is not None]
            self.lock = hosted[0] if hosted else lock_for(tuple(e.name for e in self.engines))
        self.recorder = (
            self.trace
            if isinstance(self.trace, TraceRecorder)
            else TraceRecorder(self.trace if self.leader else None, config=self.describe(), clock=self.clock)
        )
        self.session = Session(version=self.version, next_version=self.version + 1)

    def validate(self) -> None:
        """Refuse, before anything starts, what cannot be done safely (every rank)."""
        remote = self.ranks is not None and self.ranks.remote
        if self.source is None and not remote:
            raise ConfigError("source is required (only trainer ranks hosted elsewhere, e.g. RayRanks, need none here)")
        if self.source is not None and not isinstance(self.source, Source):
            hint = " (wrap a torch model: TorchSource(model))" if hasattr(self.source, "state_dict") else ""
            raise ConfigError(f"source must implement refit.drivers.Source, got {type(self.source).__name__}{hint}")
        if not isinstance(self.transport, Transport):
            raise ConfigError(f"transport must implement refit.drivers.Transport, got {type(self.transport).__name__}")
        if self.mode not in ("colocated", "disaggregated"):
            raise ConfigError(f"mode must be 'colocated' or 'disaggregated', got {self.mode!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        _positive("bucket_bytes", self.bucket_bytes, integer=True)
        _positive("deadline_s", self.deadline_s)
        _positive("cleanup_grace_s", self.cleanup_grace_s, zero_ok=True)
        if self.call_timeout_s is not None:
            _positive("call_timeout_s", self.call_timeout_s)
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an integer >= 0, got {self.retries!r}")
        self.check_max_staleness()
        self.check_kv()
        self.check_atomic()
        self.check_adapter()
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ConfigError(f"version must be an integer >= 0, got {self.version!r}")
        from refit.verify import DIGEST_POINTS, VERIFY_MODES

        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.digest_point not in DIGEST_POINTS:
            raise ConfigError(f"digest_point must be one of {DIGEST_POINTS}, got {self.digest_point!r}")
        if not isinstance(self.transport.slots, int) or self.transport.slots < 1:
            raise ConfigError(f"transport.slots must be an integer >= 1, got {self.transport.slots!r}")

    def check_kv(self) -> None:
        """The KV policy against the pause mode and the mode (all may change between runs)."""
        problem = kv_problem(self.kv, self.pause_mode, self.mode)
        if problem:
            raise ConfigError(problem)

    def check_atomic(self) -> None:
        """Atomic mode against the mode and the engines (both may change between runs)."""
        if not isinstance(self.atomic, bool):
            raise ConfigError(f"atomic must be True or False, got {self.atomic!r}")
        if not self.atomic:
            return
        if self.mode == "colocated":
            raise ConfigError(
                "atomic=True keeps generating while a second copy of the weights is written, and a colocated "
                "refit gives the engines' memory to the trainer while it trains: use mode='disaggregated', or "
                "atomic=False"
            )
        unable = [e for e in self.engines if not getattr(e, "stages", False)]
        if unable:
            by_reason: dict[str, list[str]] = {}  # engines that cannot for the same reason, named once
            for e in unable:
                why = getattr(e, "no_stage", None) or "it declares no staged session (EngineDriver.stages)"
                by_reason.setdefault(why, []).append(e.name)
            reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
            raise ConfigError(
                "atomic=True writes the new weights into a second copy while generation goes on, and these engines "
                f"cannot: {reasons}; use atomic=False (pause_mode 'retract' holds requests and continues them)"
            )

    @property
    def adapter(self) -> dict[str, Any] | None:
        """A LoRA refit's adapter ({"name", "r", "lora_alpha", "target_modules", "use_rslora",
        "dtype"}) when the source moves one (`LoraSource`), else None."""
        found = getattr(self.source, "adapter", None)
        return dict(found) if isinstance(found, dict) else None

    @property
    def staged(self) -> bool:
        """The run writes what it moves where nothing serves it until its switch: an atomic run's
        copy of the weights, or a LoRA refit's new adapter version."""
        return self.atomic or self.adapter is not None

    @property
    def max_live(self) -> int | None:
        """A LoRA refit: how many versions of the adapter an engine serves at once (max_staleness + 1)."""
        return None if self.max_staleness is None else self.max_staleness + 1

    def check_adapter(self) -> None:
        """A LoRA refit against the mode, the verify mode and the engines (all may change between runs)."""
        if self.adapter is None:
            return
        if self.mode == "colocated":
            raise ConfigError(
                "a LoRA refit loads the new adapter version beside the ones requests use while generation goes on; "
                "a colocated refit gives the engines' memory to the trainer: use mode='disaggregated'"
            )
        if self.verify in ("probe", "both"):
            raise ConfigError(
                f"verify={self.verify!r}: a LoRA refit verifies by digest ('digest') or not at all ('off')"
            )
        unable = [e.name for e in self.engines if not getattr(e, "serves_adapters", False)]
        if unable:
            raise ConfigError(
                f"a LoRA refit needs engines that load adapters at runtime (EngineDriver.serves_adapters); "
                f"{', '.join(unable)} cannot"
            )
        for e in self.engines:
            no = getattr(e, "no_adapter", None)
            problem = no(self.adapter, verify=self.verify, max_live=self.max_live) if callable(no) else None
            if problem:
                raise ConfigError(f"engine {e.name}: {problem}")

    def check_max_staleness(self) -> None:
        """Refuse a version policy that is not None or a count (it may change between runs)."""
        k = self.max_staleness
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ConfigError(f"max_staleness must be None or an integer >= 0, got {k!r}")

    def check_digest_point(self) -> None:
        """`digest_point` against the engines (when the context is made, and again at each run's
        start: it may be changed between runs)."""
        from refit.drivers.base import hashes_writes
        from refit.verify import DIGEST_POINTS

        if self.digest_point not in DIGEST_POINTS:
            raise ConfigError(f"digest_point must be one of {DIGEST_POINTS}, got {self.digest_point!r}")
        kind = self.digest_kind
        if self.digest_point != "written" or self.verify not in ("digest", "both"):
            return
        for e in self.engines:
            if not hashes_writes(e, kind):
                raise ConfigError(
                    f"engine {e.name} ({type(e).__name__}, TP {e.tp_size}) cannot hash the {kind!r} digest as it "
                    f"writes its weights (it can for {sorted(e.written_digests) or 'none'}); use digest_point='served' "
                    "or 'auto'"
                )

    def validate_engines(self) -> None:
        """The leader's checks of the engine set."""
        if not self.engines:
            raise ConfigError("a refit needs at least one engine (on the leader)")
        bad = [type(e).__name__ for e in self.engines if not isinstance(e, EngineDriver)]
        if bad:
            raise ConfigError(f"engines must implement refit.drivers.EngineDriver, got {bad}")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique, got {names}")
        if self.pause_mode == "in_place":
            unsafe = [e for e in self.engines if not e.supports_in_place_pause]
            if unsafe:
                raise ConfigError(in_place_refusal(unsafe))
        for e in self.engines:
            if self.pause_mode not in e.pause_modes:
                raise ConfigError(
                    f"engine {e.name} supports pause modes {sorted(e.pause_modes)}, not {self.pause_mode!r}"
                )
            kinds = e.transports
            if self.adapter is not None:  # a LoRA refit: what the engine takes adapters over
                kinds = getattr(e, "adapter_transports", None) or kinds
            if self.transport.kind not in kinds:
                raise ConfigError(
                    f"engine {e.name} ({type(e).__name__}) cannot receive the {self.transport.kind!r} transport "
                    f"({type(self.transport).__name__}){' for a LoRA refit' if self.adapter is not None else ''}; "
                    f"it receives {sorted(kinds)}"
                )
            if self.verify in ("digest", "both") and e.digest_kinds and self.digest_kind not in e.digest_kinds:
                none = next((x for x in self.engines if not x.digest_kinds), None)
                if none is not None:  # not a clash of kinds: that engine reports none at all (named, with why)
                    raise ConfigError(self._no_digests(none))
                kinds = {x.name: sorted(x.digest_kinds) for x in self.engines}
                raise ConfigError(
                    f"the engines report digests of different kinds, none common to all ({kinds}) and the transport's "
                    f"is {self.transport.digest_kind!r}: one run verifies every engine with one kind; run them in "
                    "separate contexts, or pass verify='off'"
                )
            if self.verify in ("digest", "both") and self.digest_kind not in e.digest_kinds:
                raise ConfigError(self._no_digests(e))
            if self.verify in ("probe", "both") and not e.probes:
                can = "'digest' or 'off'" if self.digest_kind in e.digest_kinds else "'off' to trust its finalize"
                raise ConfigError(
                    f"engine {e.name} ({type(e).__name__}) cannot answer a probe, so verify={self.verify!r} cannot "
                    f"check it; use verify={can}"
                )
            tp = e.tp_size
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ConfigError(f"engine {e.name} reports tp_size {tp!r}; it must be an integer >= 1")
        self.check_digest_point()

    def _no_digests(self, e: EngineDriver) -> str:
        """Why verify by digest refuses engine `e`, which reports none of the run's kind."""
        return (
            f"engine {e.name} ({type(e).__name__}) cannot report digests of the weights it serves"
            + (f" ({e.no_digests})" if getattr(e, "no_digests", None) else "")
            + f", so verify={self.verify!r} cannot check it before it publishes; pass verify='off' to trust "
            "its finalize" + (", or verify='probe' to check what it computes" if e.probes else "")
        )

    @property
    def leader(self) -> bool:
        return self.ranks is None or self.ranks.leader

    @property
    def transport_connected(self) -> bool:
        """Whether the trainer ranks' transport is connected: as their hosting last heard it when
        they live elsewhere, this process's transport otherwise."""
        remote = self.ranks.connected if self.ranks is not None else None
        return self.transport.connected if remote is None else remote

    @property
    def digest_kind(self) -> str:
        """The digest kind a run verifies with (`digest_kind_for`; the transport's when no kind
        suits every engine: the engines' checks then name the one that cannot)."""
        return digest_kind_for(self.transport.digest_kind, self.engines) or self.transport.digest_kind

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    @property
    def published_version(self) -> int:
        """The last version a run of this context published (or the initial one)."""
        return self.session.version

    def describe(self) -> dict[str, Any]:
        return {
            "source": type(self.source).__name__ if self.source is not None else f"on {type(self.ranks).__name__}",
            "transport": type(self.transport).__name__,
            "engines": [f"{type(e).__name__}:{e.name}" for e in self.engines],
            "mode": self.mode,
            "pause_mode": self.pause_mode,
            "atomic": self.atomic,
            "adapter": self.adapter,
            "bucket_bytes": self.bucket_bytes,
            "deadline_s": self.deadline_s,
            "cleanup_grace_s": self.cleanup_grace_s,
            "retries": self.retries,
            "verify": self.verify,
            "digest_point": self.digest_point,
            "call_timeout_s": self.call_timeout_s,
            "slots": self.transport.slots,
            "version": self.version,
            "ranks": self.ranks.world if self.ranks is not None else 1,
        }

    def lane(self, engine: str) -> concurrent.futures.ThreadPoolExecutor:
        """One engine's own ordered lane: the calls a driver runs on the executor it is handed (the
        default one call per step; incarnation reads) reach that engine in the order they were
        made, and a driver stuck past its timeout holds up only its own engine."""
        return self.session.lane(engine)

    def close(self) -> None:
        """Disconnect the transport (engines detach, every rank frees its buffers) and end the
        trace. Idempotent. Under SPMD every rank calls it."""
        if self.session.closed:
            return
        assert self.ranks is not None
        # a run in progress (another thread) ends first: its cleanup settles every engine; it is
        # bounded by its deadline plus cleanup grace, so this wait is too
        took = self.session.in_use.acquire(timeout=self.deadline_s + self.cleanup_grace_s + 5.0)
        try:
            self._close()
        finally:
            if took:
                self.session.in_use.release()

    def _close(self) -> None:
        assert self.ranks is not None
        if self.session.closed:
            return
        if not self.leader:
            self.session.close()
            try:
                self.ranks.follow(self.deadline_s + self.cleanup_grace_s + 5.0)
            finally:
                self.ranks.close()
            return
        try:
            disconnect(self, timeout=self.cleanup_grace_s or 5.0)
            self.ranks.close()
        finally:
            self.session.close()
            self.recorder.close()

    def __enter__(self) -> RefitContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


KV_POLICIES = ("recompute", "keep")  # RefitContext.kv


def kv_problem(kv: Any, pause_mode: str, mode: str) -> str | None:
    """Why a KV policy does not go with a pause mode and a mode (None: it does). Pure."""
    if kv not in KV_POLICIES:
        return f"kv must be one of {KV_POLICIES}, got {kv!r}"
    if pause_mode == "in_place" and kv != "keep":
        return (
            "pause_mode 'in_place' keeps held requests' KV, computed with the old weights: pass kv='keep' to accept "
            "that (their later tokens are off-policy, and recorded so), or use pause_mode 'retract' to recompute it "
            "under the new weights"
        )
    if kv == "keep" and pause_mode != "in_place":
        what = "recomputes it" if pause_mode == "retract" else "ends the requests"
        return f"kv='keep' keeps held requests' KV, which only pause_mode 'in_place' holds ({pause_mode!r} {what})"
    if kv == "keep" and mode == "colocated":
        return (
            "kv='keep' keeps held requests' KV in the engines' memory, which a colocated refit releases for the "
            "trainer: use mode='disaggregated', or kv='recompute' with pause_mode 'retract'"
        )
    return None


def in_place_refusal(engines: Sequence[Any]) -> str:
    """Why pause_mode 'in_place' (kv='keep') is refused for `engines` (drivers, or classes) that do
    not declare `supports_in_place_pause`: each one's `no_in_place` reason where it gives one."""
    reasons = "; ".join(
        f"{getattr(e, 'name', None) or e.__name__}: {getattr(e, 'no_in_place', None) or 'it declares no way to'}"
        for e in engines
    )
    return (
        "pause_mode 'in_place' (kv='keep') holds requests with their KV while the prefix cache is cleared for "
        f"requests started after the update, and these engines cannot: {reasons}; use pause_mode 'retract' "
        "(kv='recompute') or 'abort'"
    )


def digest_kind_for(transport_kind: str, engines: Sequence[EngineDriver]) -> str | None:
    """The digest kind runs over these engines verify with: the transport's (`Transport.
    digest_kind`) when every engine reports it, else the one other kind every engine reports (an
    engine layout's, such as SGLang's checksums: "sglang/tp<N>"), else None."""
    if all(transport_kind in e.digest_kinds for e in engines):
        return transport_kind
    common = set.intersection(*(set(e.digest_kinds) for e in engines)) if engines else set()
    return next(iter(common)) if len(common) == 1 else None


def _positive(name: str, value: Any, *, integer: bool = False, zero_ok: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        want = "a finite number >= 0" if zero_ok else "a positive finite " + ("integer" if integer else "number")
        raise ConfigError(f"{name} must be {want}, got {value!r}")
