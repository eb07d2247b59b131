"""`refit replay TRACE`: re-execute recorded runs through the real runner.

Only the nondeterminism is fed back: every driver call (each step of a batched engine call, each
trainer-side step) gets the outcome (result or error) that was recorded for it, the engines' lock
answers as it did, and the clock reads the recorded time of the next event (so deadline and retry
decisions come out the same). Everything else, the order of phases, which engine is retried or
quarantined, what is published, is computed again by the code as it is now. Each event the replayed
run emits is compared with the recorded one; the first mismatch is the divergence (event index,
expected vs got).

A replay that does not diverge reaches the same final state and the same failing event as the
recording: a regression fixture. A replay that diverges shows where the code now behaves
differently.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit.buckets import BucketManifest, TensorEntry, TensorMeta
from refit.drivers.base import (
    ConnectInfo,
    EngineDriver,
    LazyTensors,
    Payload,
    Source,
    Step,
    StepResult,
    Topology,
    Transport,
    outcome_of,
)
from refit.errors import EngineDied, EngineError, LateAnswer, NoTimeLeft, RankError, RefitBusyError, RefitError
from refit.protocol.faults import InjectedFault
from refit.protocol.ranks import RECORDED_RESULTS, Ranks, RankStep
from refit.trace import NotATrace, TraceRecorder, load_trace

COMPARED = (
    "kind", "event", "state", "side", "engine", "bucket", "outcome", "attempt", "src", "dst", "failure", "result",
    "published", "version", "engine_outcomes", "effect",
)  # fmt: skip
SKIPPED_KINDS = ("fault",)  # injected faults are not re-injected: their effects are replayed as outcomes


class ReplayedError(RuntimeError):
    """A recorded driver error of a type replay does not rebuild; its text is kept."""


_REPLAYED: dict[str, type[ReplayedError]] = {}


def _replayed(typ: str) -> type[ReplayedError]:
    """A ReplayedError named as the recorded type (`RuntimeError`, `ValueError`, ...), so the
    replayed call records the same type as the original: the runner acts on none of them."""
    if not typ.isidentifier():
        return ReplayedError
    if typ not in _REPLAYED:
        _REPLAYED[typ] = type(typ, (ReplayedError,), {"__module__": __name__})
    return _REPLAYED[typ]


def normalize(event: dict[str, Any]) -> dict[str, Any]:
    """The part of an event a replay must reproduce (no timings, ids, tokens or error wording)."""
    out = {k: event[k] for k in COMPARED if k in event}
    if event.get("error"):
        out["error_type"] = str(event["error"]).split(":", 1)[0]
    return out


@dataclass
class Divergence:
    index: int  # position among the compared events (recorded order, injected faults left out)
    expected: dict[str, Any] | None
    got: dict[str, Any] | None
    seq: int | None = None  # the recorded event's sequence number
    run: str | None = None

    def __str__(self) -> str:
        return f"event {self.index}: expected {self.expected}, got {self.got}"


@dataclass
class RunSummary:
    state: str | None
    failing_event: dict[str, Any] | None

    @classmethod
    def of(cls, events: Sequence[dict[str, Any]]) -> RunSummary:
        end = next((e for e in events if e.get("kind") == "run" and e.get("event") == "end"), None)
        failing = next((e for e in events if e.get("kind") == "call" and e.get("outcome") != "ok"), None)
        return cls(end.get("result") if end else None, normalize(failing) if failing else None)


@dataclass
class ReplayReport:
    path: str
    runs: int  # complete runs replayed
    events: int  # events replayed (the trace's, less `skipped` and the cut-off run's)
    seconds: float
    divergence: Divergence | None
    recorded: list[RunSummary] = field(default_factory=list)
    replayed: list[RunSummary] = field(default_factory=list)
    cut: str | None = None  # how the trace was cut off mid-run (`cut_off`): that run is not replayed
    skipped: dict[str, int] = field(default_factory=dict)  # events not replayed, by why

    @property
    def same(self) -> bool:
        return self.divergence is None and self.recorded == self.replayed


class _Script:
    """The recorded events, the replay's cursor in them, and the outcomes drivers hand back."""

    def __init__(self, events: Sequence[dict[str, Any]]) -> None:
        self.expected = [e for e in events if e.get("kind") not in SKIPPED_KINDS]
        self.cursor = 0
        self.divergence: Divergence | None = None
        self._lock = threading.Lock()
        self._claimed: set[int] = set()
        self._by_key: dict[tuple[Any, ...], list[int]] = {}
        for i, e in enumerate(self.expected):
            if e.get("kind") in ("call", "lock"):
                self._by_key.setdefault(self._key(e), []).append(i)
        self._start_index = [
            i for i, e in enumerate(self.expected) if (e.get("kind"), e.get("event")) == ("run", "start")
        ]
        self.run_starts = [self.expected[i] for i in self._start_index]
        self.plans = [e for e in self.expected if e.get("kind") == "plan"]
        # when each recorded event's work began (a call: its time less its duration), and the
        # earliest such start at or after each position: see clock()
        began = [_began(e) for e in self.expected]
        self._earliest = list(began)
        for i in range(len(began) - 2, -1, -1):
            self._earliest[i] = min(began[i], self._earliest[i + 1])

    @staticmethod
    def _key(e: dict[str, Any]) -> tuple[Any, ...]:
        return (e.get("kind"), e.get("side"), e.get("engine"), e.get("event"), e.get("bucket"))

    def clock(self) -> float:
        """What the recorded clock read at this point of the run: no earlier than the last event
        emitted, no later than the next one, and within that the earliest start of a call still to
        be recorded (a wave's calls are recorded when they end, but the runner read the clock to
        budget them when they began)."""
        if not self.expected:
            return 0.0
        i = min(self.cursor, len(self.expected) - 1)
        nxt = float(self.expected[i].get("t", 0.0))
        prev = float(self.expected[i - 1].get("t", 0.0)) if 0 < self.cursor <= len(self.expected) else 0.0
        if self.cursor >= len(self.expected):
            return nxt
        return max(prev, min(nxt, self._earliest[i]))

    def claim(self, kind: str, event: str, *, side: str | None = None, engine: str | None = None,
              bucket: int | None = None, batch: tuple[Any, Any] | None = None) -> dict[str, Any] | None:  # fmt: skip
        """The next unclaimed recorded event for this call at or after the cursor (within `batch`,
        a (run, batch) pair, when given: batch numbers restart with every run); None once diverged."""
        with self._lock:
            if self.divergence is not None:
                return None
            indexes = self._by_key.get((kind, side, engine, event, bucket), [])
            for i in indexes[bisect.bisect_left(indexes, self.cursor) :]:
                if i in self._claimed:
                    continue
                if batch is not None and _batch_of(self.expected[i]) != batch:
                    return None
                self._claimed.add(i)
                return self.expected[i]
            return None

    def observe(self, record: dict[str, Any]) -> None:
        """The runner emitted `record`: compare it with the recorded event at the cursor."""
        if record.get("kind") in SKIPPED_KINDS:
            return
        with self._lock:
            if self.divergence is None:
                expected = self.expected[self.cursor] if self.cursor < len(self.expected) else None
                got = normalize(record)
                if expected is None or normalize(expected) != got:
                    self.divergence = Divergence(
                        self.cursor, normalize(expected) if expected else None, got,
                        (expected or {}).get("seq"), (expected or record).get("run"),
                    )  # fmt: skip
            self.cursor += 1

    def current_run(self) -> dict[str, Any]:
        """The start event of the run the cursor is in (or about to begin)."""
        k = bisect.bisect_right(self._start_index, self.cursor)
        if k:
            return self.run_starts[k - 1]
        return self.run_starts[0] if self.run_starts else {}


def _began(event: dict[str, Any]) -> float:
    t = float(event.get("t", 0.0))
    took = event.get("duration_s")
    return t - float(took) if event.get("kind") == "call" and isinstance(took, int | float) else t


def _batch_of(event: dict[str, Any]) -> tuple[Any, Any]:
    """Which engine call a recorded step rode in: batch numbers restart with every run."""
    return (event.get("run"), event.get("batch"))


def error_of(event: dict[str, Any]) -> BaseException:
    """The recorded error, rebuilt as the type the runner acts on."""
    typ, _, msg = str(event.get("error") or "").partition(": ")
    if event.get("outcome") == "timeout":
        return (NoTimeLeft if typ == "NoTimeLeft" else TimeoutError)(msg)
    if typ == "EngineDied":
        return EngineDied(msg)
    if typ == "EngineError":
        kind, _, text = msg.partition(": ")
        data = event.get("error_data")
        return EngineError(kind, text, data if isinstance(data, dict) else None)
    if typ == "InjectedFault":
        return InjectedFault(msg)
    if typ == "LateAnswer":
        return LateAnswer(msg)
    if typ == "RankError":
        rank, _, text = msg.partition(": ")
        return RankError(int(rank.removeprefix("rank ") or 0), text)
    return _replayed(typ)(msg) if typ.isidentifier() else ReplayedError(f"{typ}: {msg}")


def outcome_of_event(event: dict[str, Any] | None) -> Any:
    """Return the recorded result, or raise the recorded error."""
    if event is None:  # diverged, or a call the recording does not have: answer neutrally
        return None
    if event.get("outcome") == "ok":
        return event.get("result")
    raise error_of(event)


class ReplayRecorder(TraceRecorder):
    """In memory; every emitted event is checked against the script."""

    def __init__(self, script: _Script) -> None:
        self.script = script
        super().__init__(None, clock=script.clock)

    def emit(self, kind: str, event: str, **fields: Any) -> dict[str, Any]:
        record = super().emit(kind, event, **fields)
        self.script.observe(record)
        return record


def _done(value: Any = None, exc: BaseException | None = None) -> Future[Any]:
    fut: Future[Any] = Future()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
    return fut


class ReplayRanks(Ranks):
    """Every trainer-side step answers as it did on every rank."""

    def __init__(self, script: _Script, world: int, transport: ReplayTransport | None = None) -> None:
        self.script = script
        self.world = world
        self.transport = transport  # the leader's: a recorded disconnect disconnects it

    def start(self, step: RankStep, *, timeout: float) -> Future[list[Any]]:
        if step.call == "end_run":
            return _done([])
        event = self.script.claim("call", step.call, side=step.side, bucket=step.bucket)
        try:
            value = outcome_of_event(event)
        except BaseException as exc:  # the recorded error, as recorded (a rank's, an injected fault...)
            return _done(exc=exc)
        if step.call == "metas":
            value = self._metas()
        if step.call in RECORDED_RESULTS:  # per-rank values the leader decided on, as recorded
            recorded = (event or {}).get("per_rank")
            return _done(list(recorded) if isinstance(recorded, list) else [None] * self.world)
        if step.call == "disconnect" and self.transport is not None:
            self.transport.disconnect()
        return _done([value] * self.world)

    def _metas(self) -> list[TensorMeta]:
        plans = [e for e in self.script.plans if e["seq"] >= self.script.current_run().get("seq", 0)]
        manifests = plans[0].get("manifests", []) if plans else []
        metas = [
            TensorMeta(name, dtype, tuple(shape), heads)
            for m in manifests
            for name, dtype, shape, heads in zip(
                m["names"], m["dtypes"], m["shapes"], m.get("heads") or [None] * len(m["names"]), strict=True
            )
        ]
        return _legacy_heads(metas, self.script.current_run())


def _legacy_heads(metas: list[TensorMeta], start: dict[str, Any]) -> list[TensorMeta]:
    """A trace recorded before runs knew head counts (its start has no `layout_heads`) verified an
    engine layout splitting k and v evenly over its TP ranks: as many KV heads as ranks does the same."""
    from dataclasses import replace

    from refit.buckets import HEAD_SUFFIXES
    from refit.drivers.sglang_checksums import tp_of

    tp = tp_of(str(start.get("digest") or ""))
    if start.get("layout_heads") or tp is None:
        return metas
    kv = {s for s, what in HEAD_SUFFIXES.items() if what == "kv_heads"}
    return [replace(m, heads=tp) if m.heads is None and m.name.partition("layers.")[2].partition(".")[2] in kv
            else m for m in metas]  # fmt: skip


class ReplaySource(Source):
    kind = "replay"
    adapter: dict[str, Any] | None = None  # a LoRA refit's adapter, as its run's start recorded it

    def metas(self) -> list[TensorMeta]:
        return []

    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[LazyTensors]:
        return iter(())


class ReplayTransport(Transport):
    """The leader's transport-side decisions, as recorded: the plan, who is collective."""

    kind = "replay"

    def __init__(self, script: _Script, slots: int, collective: bool, shares_storages: bool = False) -> None:
        self.script = script
        self.slots = slots
        self.collective = collective  # type: ignore[misc]
        self.shares_storages = shares_storages  # type: ignore[misc]
        self._connected = False

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        plans = [e for e in self.script.plans if e["seq"] >= self.script.current_run().get("seq", 0)]
        out = []
        for m in plans[0].get("manifests", []) if plans else []:
            heads = m.get("heads") or [None] * len(m["names"])
            entries = tuple(
                TensorEntry(TensorMeta(n, d, tuple(sh), hd), 0)
                for n, d, sh, hd in zip(m["names"], m["dtypes"], m["shapes"], heads, strict=True)
            )
            out.append(BucketManifest(m["index"], entries, m["nbytes"], bool(m.get("oversized"))))
        return out

    @property
    def wants_prepare(self) -> bool:
        """Whether the recorded run prepared in IDLE: a shared-memory transport does while any
        arena lives in the recording process, a fact of that process the trace records as the call."""
        run = self.script.current_run().get("run")
        return any(
            (e.get("run"), e.get("kind"), e.get("event"), e.get("side")) == (run, "call", "prepare", "transport")
            for e in self.script.expected
        )

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        self._connected = True
        return {}

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        self._connected = True
        return {e.name: ConnectInfo(self.kind, f"{__name__}:none", parts=({},) * e.tp) for e in topology.engines}

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        return None

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        return {e.name: Payload(self.kind, manifest, parts=({},) * e.tp) for e in topology.engines}

    def release(self, index: int) -> None:
        pass

    def disconnect(self) -> None:
        self._connected = False


class ReplayEngine(EngineDriver):
    transports = frozenset({"replay"})
    digest_kinds = frozenset({"xxh3", "wsum"})
    written_digests = frozenset({"wsum"})
    probes = True
    pause_modes = frozenset({"abort", "retract", "in_place"})
    supports_in_place_pause = True
    stages = True
    serves_adapters = True

    def __init__(self, name: str, script: _Script) -> None:
        self.name = name
        self.script = script

    def _run_field(self, key: str, default: Any) -> Any:
        run = self.script.current_run()
        names, values = run.get("engines", []), run.get(key, [])
        return (
            values[names.index(self.name)] if self.name in names and len(values) > names.index(self.name) else default
        )

    @property
    def incarnation(self) -> str:
        return self._run_field("incarnations", self.name)

    @property
    def tp_size(self) -> int:
        return int(self._run_field("engine_tp", 1))

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Executor) -> Future[list[StepResult]]:
        """The recorded outcome of each step of this call: the recorded batch is followed exactly
        (a call whose every step failed the same way failed as a whole)."""
        claimed: list[dict[str, Any]] = []
        batch = None
        for step in steps:
            event = self.script.claim(
                "call", step.call, side="engine", engine=self.name, bucket=step.bucket, batch=batch
            )
            if event is None:
                break
            claimed.append(event)
            batch = _batch_of(event)
            if event.get("outcome") != "ok" and not self._more_in_batch(steps, len(claimed), batch):
                break
        if not claimed:
            return _done([StepResult("ok")] * 1)
        failures = [e for e in claimed if e.get("outcome") != "ok"]
        if len(claimed) > 1 and len(failures) == len(claimed):
            return _done(exc=error_of(claimed[0]))  # the whole call failed (died, hung)
        results = []
        for e in claimed:
            if e.get("outcome") == "ok":
                results.append(StepResult("ok", e.get("result")))
            else:
                err = error_of(e)
                results.append(StepResult(outcome_of(err), error=err))
        return _done(results)

    def _more_in_batch(self, steps: Sequence[Step], n: int, batch: tuple[Any, Any] | None) -> bool:
        if n >= len(steps):
            return False
        nxt = steps[n]
        with self.script._lock:
            indexes = self.script._by_key.get(("call", "engine", self.name, nxt.call, nxt.bucket), [])
            return any(
                i not in self.script._claimed and _batch_of(self.script.expected[i]) == batch
                for i in indexes[bisect.bisect_left(indexes, self.script.cursor) :]
            )

    def _unused(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("replay engines answer through run_steps_async")

    resume_memory = attach = detach = pause = flush = begin = load = finalize = _unused  # type: ignore[assignment]
    publish = continue_generation = quarantine = stage = swap = discard = _unused  # type: ignore[assignment]


class ReplayLock:
    """Answers acquire/release as the recorded lock did (another run holding it, for example)."""

    def __init__(self, script: _Script) -> None:
        self.script = script
        self._taken: int | None = None

    def acquire(self, owner: str) -> bool:
        event = self.script.claim("lock", "acquire")
        self._taken = None if event is None else event.get("taken")
        return event is None or event.get("outcome") == "ok"

    @property
    def acquisitions(self) -> int | None:
        """The acquisition count the recorded lock reported (None: not recorded)."""
        return self._taken

    def release(self, owner: str) -> bool:
        event = self.script.claim("lock", "release")
        if event is not None and event.get("outcome") not in ("ok", "not_owner"):
            raise error_of(event)
        return event is None or event.get("outcome") == "ok"

    @property
    def holder(self) -> str | None:
        return None


def cut_off(events: Sequence[dict[str, Any]], torn: bool) -> tuple[str | None, int]:
    """Whether the trace was cut off mid-run, as data: (why, or None; how many of its events come
    before the run it cut, which replay takes). Pure: what `refit check` reports as `complete`."""
    starts = [i for i, e in enumerate(events) if e.get("kind") == "run" and e.get("event") == "start"]
    if not starts:
        return None, len(events)
    last = starts[-1]
    run = events[last].get("run")
    ended = any(e.get("kind") == "run" and e.get("event") == "end" and e.get("run") == run for e in events[last:])
    if ended:  # every run ended (a torn last line after them loses nothing of a run)
        return None, len(events)
    why = f"run {run} (the {len(starts)}{_th(len(starts))}) has no end event"
    return (f"{why}, and the trace's last line is cut off" if torn else why), last


def _th(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def replay(path: str | Path, loaded: tuple[dict[str, Any], list[dict[str, Any]], bool] | None = None) -> ReplayReport:
    """Replay every run of the trace at `path` through the real runner; see the module docstring.
    A trace cut off mid-run (`cut_off`) is replayed up to that run, which is reported as cut."""
    from refit import protocol

    t0 = time.perf_counter()
    header, events, torn = loaded if loaded is not None else load_trace(path)  # `loaded`: load_trace's answer
    if not any(e.get("kind") == "run" and e.get("event") == "start" for e in events):
        raise NotATrace(f"{path}: no run in it (a trace has a run/start event for every run)")
    cut, keep = cut_off(events, torn)
    skipped = {"of the cut-off run": len(events) - keep} if cut else {}
    events = events[:keep]
    faults = sum(1 for e in events if e.get("kind") in SKIPPED_KINDS)
    if faults:
        skipped["injected faults (their effects are replayed, as recorded outcomes)"] = faults
    script = _Script(events)
    config = header.get("config", {})
    starts = script.run_starts
    first = starts[0] if starts else {}
    names = first.get("engines", [])
    transport = ReplayTransport(
        script, int(config.get("slots", 2)), bool(first.get("collective", False)),
        bool(first.get("shares_storages", False)),
    )  # fmt: skip
    ctx = protocol.RefitContext(
        source=ReplaySource(),
        transport=transport,
        engines=[ReplayEngine(n, script) for n in names] or [ReplayEngine("none", script)],
        mode=first.get("mode", "disaggregated"),
        pause_mode=first.get("pause_mode", "retract"),
        kv=first.get("kv", "recompute"),  # none recorded: a run before the policy was explicit
        bucket_bytes=int(first.get("bucket_bytes", 1)),
        deadline_s=float(first.get("deadline_s", 1.0)),
        cleanup_grace_s=float(first.get("cleanup_grace_s", 10.0)),
        retries=int(first.get("retries", 1)),
        call_timeout_s=first.get("call_timeout_s"),
        verify=first.get("verify", "off"),  # a run recorded before verification existed verified nothing
        version=int(first.get("previous_version", 0)),
        lock=ReplayLock(script),  # type: ignore[arg-type]
        trace=ReplayRecorder(script),
        ranks=ReplayRanks(script, int(first.get("ranks", 1)), transport),
        check_invariants=False,
        clock=script.clock,
    )
    for start in starts:
        if script.divergence is not None:
            break
        per_run = ("mode", "retries", "pause_mode", "deadline_s", "cleanup_grace_s", "call_timeout_s", "bucket_bytes")
        for key in per_run:  # per run
            if key in start:
                setattr(ctx, key, start[key])
        ctx.max_staleness = start.get("max_staleness")  # none recorded: a run before the policy existed
        if ctx.max_staleness is not None and ctx.max_staleness < 0:
            raise NotATrace(f"run {start.get('run')}: max_staleness {ctx.max_staleness} is not a count")
        ctx.kv = start.get("kv", "recompute")  # none recorded: a run before the policy was explicit
        ctx.atomic = start.get("atomic") is True  # none recorded: a run that paused for the transfer
        adapter = start.get("adapter")
        ctx.source.adapter = adapter if isinstance(adapter, dict) else None  # type: ignore[union-attr]
        ctx.colocated_ride = start.get("colocated_ride") is True  # none: recorded before colocated runs rode
        ctx.lora_ride = start.get("lora_ride") is True  # none: recorded before LoRA runs' probe and stage rode
        ctx.verify = start.get("verify", "off")
        transport.digest_kind = start.get("digest") or "xxh3"
        ctx.digest_point = start.get("digest_point", "served")
        if start.get("engines") and [e.name for e in ctx.engines] != list(start["engines"]):  # the set changed
            ctx.engines = [ReplayEngine(n, script) for n in start["engines"]]
        try:
            with _quiet():
                protocol.run(ctx)
        except RefitBusyError:
            pass
        except RefitError:  # the replayed run raised where the recorded one did not: the events show it
            pass
    if script.divergence is None and events and events[-1].get("kind") == "trace":
        ctx.close()  # the recording was closed: replay its disconnect and end line too
    if script.divergence is None and script.cursor < len(script.expected):  # the replay stopped short
        stopped = script.expected[script.cursor]
        script.divergence = Divergence(script.cursor, normalize(stopped), None, stopped.get("seq"), stopped.get("run"))
    recorded_runs = _by_run(script.expected)
    replayed_runs = _by_run(ctx.recorder.events)
    return ReplayReport(
        path=str(path),
        runs=len(starts),
        events=len(script.expected),
        seconds=round(time.perf_counter() - t0, 4),
        divergence=script.divergence,
        recorded=[RunSummary.of(r) for r in recorded_runs],
        replayed=[RunSummary.of(r) for r in replayed_runs],
        cut=cut,
        skipped=skipped,
    )


def check_decisions(
    path: str | Path, loaded: tuple[dict[str, Any], list[dict[str, Any]], bool] | None = None
) -> list[Any]:
    """`refit check`'s `decisions` invariant: the recorded runs follow from their recorded outcomes.
    Replays the trace through this runner; a divergence means the trace's decisions (moves,
    retries, quarantines, publishes, outcomes) are not what the runner makes of the outcomes the
    trace records: an edited outcome, effect or decision, or a trace from other code."""
    from refit.invariants import Violation

    report = replay(path, loaded)
    d = report.divergence
    if d is None:
        return []
    runner = "nothing more" if d.got is None else d.got
    msg = f"the runner, fed this trace's recorded outcomes, gives {runner} where the trace has {d.expected}"
    return [Violation("decisions", msg, d.seq, d.run)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """A replayed run that fails is the recording's failure, already reported: the runner's warning
    about it is dropped while replaying."""
    logger = logging.getLogger("refit.protocol.runner")
    drop = logging.Filter("refit-replay-drops-everything")  # matches no logger name: filters every record
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _by_run(events: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("run") is not None:
            runs.setdefault(e["run"], []).append(e)
    return list(runs.values())


__all__ = ["Divergence", "ReplayReport", "RunSummary", "normalize", "replay"]
