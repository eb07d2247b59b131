"""`refit replay TRACE`: re-execute recorded runs through the real runner.

Only the nondeterminism is fed back: every driver call gets the outcome (result or error) that
was recorded for it, the engines' lock answers as it did, and the clock reads the recorded time of
the next event (so deadline and retry decisions come out the same). Everything else, the order of
phases, which engine is retried or quarantined, what is published, is computed again by the code
as it is now. Each event the replayed run emits is compared with the recorded one; the first
mismatch is the divergence (event index, expected vs got).

A replay that does not diverge reaches the same final state and the same failing event as the
recording: a regression fixture. A replay that diverges shows where the code now behaves
differently.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refit.drivers.base import ConnectInfo, EngineDriver, NamedTensors, PauseMode, Payload, Source, Transport
from refit.drivers.buckets import BucketManifest, TensorMeta
from refit.errors import EngineDied, EngineError, NoTimeLeft, RefitBusyError, RefitError
from refit.protocol.faults import InjectedFault
from refit.trace import TraceRecorder, load_trace

COMPARED = (
    "kind", "event", "state", "side", "engine", "bucket", "outcome", "attempt", "src", "dst", "failure", "result",
    "published", "version", "engine_outcomes", "effect",
)  # fmt: skip
SKIPPED_KINDS = ("fault",)  # injected faults are not re-injected: their effects are replayed as outcomes


class ReplayedError(RuntimeError):
    """A recorded driver error of a type replay does not rebuild; its text is kept."""


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
    runs: int
    events: int
    seconds: float
    divergence: Divergence | None
    recorded: list[RunSummary] = field(default_factory=list)
    replayed: list[RunSummary] = field(default_factory=list)

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

    @staticmethod
    def _key(e: dict[str, Any]) -> tuple[Any, ...]:
        return (e.get("kind"), e.get("side"), e.get("engine"), e.get("event"), e.get("bucket"))

    def clock(self) -> float:
        """The recorded time of the next event the runner will emit."""
        if not self.expected:
            return 0.0
        return float(self.expected[min(self.cursor, len(self.expected) - 1)].get("t", 0.0))

    def claim(self, kind: str, event: str, *, side: str | None = None, engine: str | None = None,
              bucket: int | None = None) -> dict[str, Any] | None:  # fmt: skip
        """The next recorded event for this call at or after the cursor; None once diverged."""
        with self._lock:
            if self.divergence is not None:
                return None
            indexes = self._by_key.get((kind, side, engine, event, bucket), [])
            for i in indexes[bisect.bisect_left(indexes, self.cursor) :]:
                if i not in self._claimed:
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
                    self.divergence = Divergence(self.cursor, normalize(expected) if expected else None, got)
            self.cursor += 1

    def current_run(self) -> dict[str, Any]:
        """The start event of the run the cursor is in (or about to begin)."""
        k = bisect.bisect_right(self._start_index, self.cursor)
        if k:
            return self.run_starts[k - 1]
        return self.run_starts[0] if self.run_starts else {}


def outcome_of(event: dict[str, Any] | None) -> Any:
    """Return the recorded result, or raise the recorded error as the type the runner acts on."""
    if event is None:  # diverged, or a call the recording does not have: answer neutrally
        return None
    if event.get("outcome") == "ok":
        return event.get("result")
    typ, _, msg = str(event.get("error") or "").partition(": ")
    if event.get("outcome") == "timeout":
        raise (NoTimeLeft if typ == "NoTimeLeft" else TimeoutError)(msg)
    if typ == "EngineDied":
        raise EngineDied(msg)
    if typ == "EngineError":
        kind, _, text = msg.partition(": ")
        raise EngineError(kind, text)
    if typ == "InjectedFault":
        raise InjectedFault(msg)
    raise ReplayedError(f"{typ}: {msg}")


class ReplayRecorder(TraceRecorder):
    """In memory; every emitted event is checked against the script."""

    def __init__(self, script: _Script) -> None:
        self.script = script
        super().__init__(None, clock=script.clock)

    def emit(self, kind: str, event: str, **fields: Any) -> dict[str, Any]:
        record = super().emit(kind, event, **fields)
        self.script.observe(record)
        return record


class ReplaySource(Source):
    kind = "replay"

    def __init__(self, script: _Script) -> None:
        self.script = script

    def _call(self, call: str, bucket: int | None = None) -> Any:
        return outcome_of(self.script.claim("call", call, side="source", bucket=bucket))

    def offload(self) -> None:
        self._call("offload")

    def restore(self) -> None:
        self._call("restore")

    def metas(self) -> list[TensorMeta]:
        self._call("metas")
        plans = [e for e in self.script.plans if e["seq"] >= self.script.current_run().get("seq", 0)]
        manifests = plans[0].get("manifests", []) if plans else []
        return [
            TensorMeta(name, dtype, tuple(shape))
            for m in manifests
            for name, dtype, shape in zip(m["names"], m["dtypes"], m["shapes"], strict=True)
        ]

    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[NamedTensors]:
        for manifest in plan:
            self._call("materialize", manifest.index)
            yield [(name, None) for name in manifest.names]  # type: ignore[misc]


class ReplayTransport(Transport):
    kind = "replay"

    def __init__(self, script: _Script, slots: int) -> None:
        self.script = script
        self.slots = slots
        self._connected = False

    def _call(self, call: str, bucket: int | None = None) -> Any:
        return outcome_of(self.script.claim("call", call, side="transport", bucket=bucket))

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self, plan: Sequence[BucketManifest], n_engines: int) -> ConnectInfo:
        self._call("connect")
        self._connected = True
        return ConnectInfo(self.kind, f"{__name__}:none")

    def pack(self, manifest: BucketManifest, tensors: NamedTensors) -> Payload:
        self._call("pack", manifest.index)
        return Payload(self.kind, manifest)

    def release(self, payload: Payload) -> None:
        self._call("release", payload.manifest.index)

    def abandon(self, payload: Payload) -> None:
        self._call("abandon", payload.manifest.index)

    def disconnect(self) -> None:
        self._connected = False
        self._call("disconnect")


class ReplayEngine(EngineDriver):
    transports = frozenset({"replay"})

    def __init__(self, name: str, script: _Script) -> None:
        self.name = name
        self.script = script

    @property
    def incarnation(self) -> str:
        run = self.script.current_run()
        names, incarnations = run.get("engines", []), run.get("incarnations", [])
        return incarnations[names.index(self.name)] if self.name in names and incarnations else self.name

    def _call(self, call: str, bucket: int | None = None) -> Any:
        return outcome_of(self.script.claim("call", call, side="engine", engine=self.name, bucket=bucket))

    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]:
        return self._call("resume_memory") or {}

    def attach(self, info: ConnectInfo, *, timeout: float) -> None:
        self._call("attach")

    def detach(self, *, timeout: float) -> None:
        self._call("detach")

    def pause(self, mode: PauseMode, *, timeout: float) -> None:
        self._call("pause")

    def flush(self, *, timeout: float) -> None:
        self._call("flush")

    def begin(self, plan: Sequence[BucketManifest], *, timeout: float) -> None:
        self._call("begin")

    def load(self, payload: Payload, *, timeout: float) -> None:
        self._call("load", payload.manifest.index)

    def finalize(self, *, timeout: float) -> None:
        self._call("finalize")

    def publish(self, version: int, *, timeout: float) -> None:
        self._call("publish")

    def continue_generation(self, *, timeout: float) -> None:
        self._call("continue_generation")

    def quarantine(self, reason: str, *, timeout: float) -> None:
        self._call("quarantine")


class ReplayLock:
    """Answers acquire/release as the recorded lock did (another run holding it, for example)."""

    def __init__(self, script: _Script) -> None:
        self.script = script

    def acquire(self, owner: str) -> bool:
        event = self.script.claim("lock", "acquire")
        return event is None or event.get("outcome") == "ok"

    def release(self, owner: str) -> bool:
        event = self.script.claim("lock", "release")
        return event is None or event.get("outcome") == "ok"

    @property
    def holder(self) -> str | None:
        return None


def replay(path: str | Path) -> ReplayReport:
    """Replay every run of the trace at `path` through the real runner; see the module docstring."""
    from refit import protocol

    t0 = time.perf_counter()
    header, events, _torn = load_trace(path)
    script = _Script(events)
    config = header.get("config", {})
    starts = script.run_starts
    names = starts[0]["engines"] if starts else []
    ctx = protocol.RefitContext(
        source=ReplaySource(script),
        transport=ReplayTransport(script, int(config.get("slots", 2))),
        engines=[ReplayEngine(n, script) for n in names] or [ReplayEngine("none", script)],
        mode=starts[0]["mode"] if starts else "disaggregated",
        pause_mode=starts[0]["pause_mode"] if starts else "retract",
        bucket_bytes=int(starts[0]["bucket_bytes"]) if starts else 1,
        deadline_s=float(starts[0]["deadline_s"]) if starts else 1.0,
        cleanup_grace_s=float(starts[0].get("cleanup_grace_s", 10.0)) if starts else 1.0,
        retries=int(starts[0].get("retries", 1)) if starts else 1,
        call_timeout_s=starts[0].get("call_timeout_s") if starts else None,
        version=int(starts[0]["previous_version"]) if starts else 0,
        lock=ReplayLock(script),  # type: ignore[arg-type]
        trace=ReplayRecorder(script),
        check_invariants=False,
        clock=script.clock,
    )
    for _ in starts:
        if script.divergence is not None:
            break
        try:
            protocol.run(ctx)
        except RefitBusyError:
            pass
        except RefitError:  # the replayed run raised where the recorded one did not: the events show it
            pass
    if script.divergence is None and events and events[-1].get("kind") == "trace":
        ctx.close()  # the recording was closed: replay its disconnect and end line too
    if script.divergence is None and script.cursor < len(script.expected):  # the replay stopped short
        script.divergence = Divergence(script.cursor, normalize(script.expected[script.cursor]), None)
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
    )


def _by_run(events: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("run") is not None:
            runs.setdefault(e["run"], []).append(e)
    return list(runs.values())


__all__ = ["Divergence", "ReplayReport", "RunSummary", "normalize", "replay"]
