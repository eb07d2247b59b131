"""Refit invariants: pure functions over trace events (dicts as `refit.trace` writes them).

The same functions run live (the runner checks every run's events, and its commit gate asks
`commit_gate` before publishing), offline (`refit check TRACE`) and under Hypothesis. They never
import a driver: they are an independent oracle over what the drivers reported.

  lock            taken once by the run's owner token before any call; released by that owner
                  after the last call, on every exit; never released by another token.
  version         published only in CONTINUING, after every engine of the run acked every bucket
                  and finalized; only the run's own target version; a run that published nothing
                  ends with no version; published versions strictly increase across runs; an
                  engine whose weights changed or were lost is continued only after it published.
  finalize_once   exactly one finalize per engine iff its begin succeeded, after its last load;
                  no load after it.
  pause_continue  every paused engine is continued or quarantined before the run ends; no engine
                  that received any bucket is continued unless it published the new version.
  kv_fresh        an engine's first bucket comes after a successful flush that came after a
                  successful pause.
  paired          trainer offload -> restore in the same run; a transport buffer is released only
                  after every engine acked its bucket; connect/disconnect alternate over a trace
                  and the last connection is closed when the trace is.
  deadline        a run ends within its deadline plus its cleanup grace.
  complete        every run has an end event; a closed trace has its end line (a cut-off trace is a
                  violation, not a pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]

DEADLINE_SLACK_S = 1.0  # scheduling noise allowed past deadline + grace


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    seq: int | None = None
    run: str | None = None

    def __str__(self) -> str:
        where = (
            f" (run {self.run}, event seq {self.seq})"
            if self.seq is not None
            else (f" (run {self.run})" if self.run else "")
        )
        return f"{self.invariant}: {self.message}{where}"


def _calls(
    events: Iterable[Event], call: str | None = None, *, side: str = "engine", engine: str | None = None
) -> list[Event]:
    return [
        e for e in events
        if e.get("kind") == "call" and e.get("side") == side
        and (call is None or e.get("event") == call) and (engine is None or e.get("engine") == engine)
    ]  # fmt: skip


def _ok(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.get("outcome") == "ok"]


def _first(events: Iterable[Event], kind: str, event: str) -> Event | None:
    return next((e for e in events if e.get("kind") == kind and e.get("event") == event), None)


def _start(events: Sequence[Event]) -> Event:
    return _first(events, "run", "start") or {}


def _end(events: Sequence[Event]) -> Event | None:
    return _first(events, "run", "end")


def _engines(events: Sequence[Event]) -> list[str]:
    start = _start(events)
    if start.get("engines"):
        return list(start["engines"])
    return sorted({e["engine"] for e in _calls(events) if e.get("engine")})


def _n_buckets(events: Sequence[Event]) -> int:
    plan = _first(events, "plan", "buckets")
    return int(plan["buckets"]) if plan else 0


def _busy(events: Sequence[Event]) -> bool:
    return any(e.get("kind") == "lock" and e.get("event") == "acquire" and e.get("outcome") == "busy" for e in events)


def _v(inv: str, msg: str, ev: Event | None, events: Sequence[Event]) -> Violation:
    run = (ev or {}).get("run") or (events[0].get("run") if events else None)
    return Violation(inv, msg, None if ev is None else ev.get("seq"), run)


# ---- per-run invariants ---------------------------------------------------------------------------


def check_lock(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    owner = _start(events).get("owner")
    acts = [e for e in events if e.get("kind") in ("call", "transition")]
    locks = [e for e in events if e.get("kind") == "lock"]
    acquires = [e for e in locks if e["event"] == "acquire" and e.get("outcome") == "ok"]
    releases = [e for e in locks if e["event"] == "release" and e.get("outcome") == "ok"]
    if _busy(events):
        if acts:
            out.append(_v("lock", "a run refused as busy still made driver calls or moves", acts[0], events))
        return out
    if len(acquires) != 1 or acquires[0].get("owner") != owner:
        out.append(
            _v(
                "lock",
                f"expected one acquire by owner {owner}, saw {len(acquires)}",
                acquires[0] if acquires else None,
                events,
            )
        )
        return out
    if acts and acts[0]["seq"] < acquires[0]["seq"]:
        out.append(_v("lock", "a driver call or move happened before the lock was taken", acts[0], events))
    for rel in releases:
        if rel.get("owner") != owner:
            out.append(_v("lock", f"the lock was released by {rel.get('owner')}, not its owner {owner}", rel, events))
    mine = [r for r in releases if r.get("owner") == owner]
    if _end(events) is not None:
        if len(mine) != 1:
            out.append(
                _v(
                    "lock",
                    f"the owner released the lock {len(mine)} times, expected once",
                    _end(events),
                    events,
                )
            )
        elif acts and acts[-1]["seq"] > mine[0]["seq"]:
            out.append(_v("lock", "a driver call or move happened after the lock was released", acts[-1], events))
    return out


def commit_gate(events: Sequence[Event], engines: Sequence[str], n_buckets: int) -> list[str]:
    """Reasons the run may not publish yet (empty: every engine acked every bucket and finalized)."""
    problems = []
    for name in engines:
        if not _ok(_calls(events, "begin", engine=name)):
            problems.append(f"engine {name} has no open session")
        acked = {e.get("bucket") for e in _ok(_calls(events, "load", engine=name))}
        missing = sorted(set(range(n_buckets)) - acked)
        if missing:
            problems.append(f"engine {name} did not ack buckets {missing}")
        if [e.get("outcome") for e in _calls(events, "finalize", engine=name)] != ["ok"]:
            problems.append(f"engine {name} has not finalized exactly once")
    return problems


def check_version(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    start, end = _start(events), _end(events)
    target = start.get("version")
    publishes = _calls(events, "publish")
    engines = _engines(events)
    for p in publishes:
        if p.get("state") != "CONTINUING":
            out.append(_v("version", f"engine {p.get('engine')} published in state {p.get('state')}", p, events))
    if publishes:
        first = publishes[0]
        before = [e for e in events if e["seq"] < first["seq"]]
        for problem in commit_gate(before, engines, _n_buckets(events)):
            out.append(_v("version", f"published before the refit was complete: {problem}", first, events))
    if end is not None and end.get("published") is not None:
        if end["published"] != target:
            out.append(
                _v(
                    "version",
                    f"run ended claiming version {end['published']}, its target was {target}",
                    end,
                    events,
                )
            )
        if not _ok(publishes):
            out.append(_v("version", "run claims a published version but no engine published it", end, events))
    if end is not None and end.get("result") == "FAILED" and _ok(publishes) and end.get("published") is None:
        out.append(_v("version", "engines published a version the failed run does not report", end, events))
    for name in engines:
        lost = any(
            (e.get("result") or {}).get("weights_intact") is False
            for e in _ok(_calls(events, "resume_memory", engine=name))
        )
        if not lost:
            continue
        published = _ok(_calls(events, "publish", engine=name))
        for c in _calls(events, "continue_generation", engine=name):
            if not published or published[0]["seq"] > c["seq"]:
                out.append(
                    _v(
                        "version",
                        f"engine {name} lost its weights and was continued before a new version was published",
                        c,
                        events,
                    )
                )
    return out


def check_finalize_once(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    for name in _engines(events):
        begun = bool(_ok(_calls(events, "begin", engine=name)))
        fins = _calls(events, "finalize", engine=name)
        loads = _calls(events, "load", engine=name)
        expected = 1 if begun else 0
        complete = _end(events) is not None
        if len(fins) > expected or (complete and len(fins) != expected):
            out.append(
                _v(
                    "finalize_once",
                    f"engine {name}: {len(fins)} finalize calls, expected {expected} "
                    f"(begin {'ok' if begun else 'not ok'})",
                    fins[-1] if fins else _end(events),
                    events,
                )
            )
        if fins and loads and loads[-1]["seq"] > fins[0]["seq"]:
            out.append(_v("finalize_once", f"engine {name} received a bucket after finalize", loads[-1], events))
    return out


def check_pause_continue(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    end = _end(events)
    for name in _engines(events):
        pauses = _calls(events, "pause", engine=name)
        resumed = _calls(events, "continue_generation", engine=name) + _calls(events, "quarantine", engine=name)
        if pauses and end is not None and not [c for c in resumed if c["seq"] > pauses[0]["seq"]]:
            out.append(
                _v(
                    "pause_continue",
                    f"engine {name} was paused and neither continued nor quarantined",
                    end,
                    events,
                )
            )
        loads = _calls(events, "load", engine=name)
        published = _ok(_calls(events, "publish", engine=name))
        for c in _calls(events, "continue_generation", engine=name):
            got = [ld for ld in loads if ld["seq"] < c["seq"]]
            if got and not [p for p in published if p["seq"] < c["seq"]]:
                out.append(
                    _v(
                        "pause_continue",
                        f"engine {name} was continued after a partial transfer "
                        f"({len(_ok(got))} buckets acked) without publishing",
                        c,
                        events,
                    )
                )
    return out


def check_kv_fresh(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    for name in _engines(events):
        loads = _calls(events, "load", engine=name)
        if not loads:
            continue
        first = loads[0]
        flushes = [f for f in _ok(_calls(events, "flush", engine=name)) if f["seq"] < first["seq"]]
        pauses = _ok(_calls(events, "pause", engine=name))
        if not flushes:
            out.append(
                _v(
                    "kv_fresh",
                    f"engine {name} received bucket {first.get('bucket')} before its KV cache was flushed",
                    first,
                    events,
                )
            )
        elif not [p for p in pauses if p["seq"] < flushes[-1]["seq"]]:
            out.append(
                _v(
                    "kv_fresh",
                    f"engine {name} was flushed before it was paused: requests could refill the cache",
                    flushes[-1],
                    events,
                )
            )
    return out


def check_paired(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    offloads = _calls(events, "offload", side="source")
    restores = _calls(events, "restore", side="source")
    if offloads and _end(events) is not None and not [r for r in restores if r["seq"] > offloads[0]["seq"]]:
        out.append(_v("paired", "the trainer was offloaded and never restored", _end(events), events))
    engines = _engines(events)
    for rel in _calls(events, "release", side="transport"):
        b = rel.get("bucket")
        acked = {e.get("engine") for e in _ok(_calls(events, "load")) if e.get("bucket") == b and e["seq"] < rel["seq"]}
        missing = [n for n in engines if n not in acked]
        if missing:
            out.append(_v("paired", f"buffer of bucket {b} released before engines {missing} acked it", rel, events))
    return out


def check_deadline(events: Sequence[Event]) -> list[Violation]:
    start, end = _start(events), _end(events)
    if not start or end is None or "deadline_s" not in start:
        return []
    budget = float(start["deadline_s"]) + float(start.get("cleanup_grace_s", 0.0))
    took = float(end["t"]) - float(start["t"])
    if took > budget + DEADLINE_SLACK_S:
        return [
            _v(
                "deadline",
                f"run took {took:.3f}s, deadline {start['deadline_s']}s + grace {start.get('cleanup_grace_s', 0)}s",
                end,
                events,
            )
        ]
    return []


def check_complete(events: Sequence[Event]) -> list[Violation]:
    if _end(events) is None:
        last = events[-1] if events else None
        return [_v("complete", "run has no end event: the trace was cut off mid-run", last, events)]
    return []


RUN_CHECKS = (
    check_complete, check_lock, check_version, check_finalize_once, check_pause_continue, check_kv_fresh,
    check_paired, check_deadline,
)  # fmt: skip


def check_run(events: Sequence[Event]) -> list[Violation]:
    """Every per-run invariant over one run's events."""
    return [v for check in RUN_CHECKS for v in check(events)]


# ---- whole-trace invariants -------------------------------------------------------------------------


def check_trace(events: Sequence[Event], *, torn: bool = False) -> list[Violation]:
    """Per-run invariants for every run, then what spans runs: versions, connections, completeness."""
    out: list[Violation] = []
    by_run: dict[str, list[Event]] = {}
    for e in events:
        if e.get("run") is not None:
            by_run.setdefault(e["run"], []).append(e)
    for run_events in by_run.values():
        out.extend(check_run(run_events))

    last: int | None = None
    for run_events in by_run.values():
        end = _end(run_events)
        if end is None or end.get("published") is None:
            continue
        if last is not None and end["published"] <= last:
            out.append(
                _v(
                    "version",
                    f"published version {end['published']} does not increase on {last}",
                    end,
                    run_events,
                )
            )
        last = end["published"]

    connected: Event | None = None
    for e in _calls(events, side="transport"):
        if e.get("event") == "connect" and e.get("outcome") == "ok":
            if connected is not None:
                out.append(
                    Violation("paired", "transport connected again without a disconnect", e.get("seq"), e.get("run"))
                )
            connected = e
        elif e.get("event") == "disconnect":
            connected = None
    closed = bool(events) and events[-1].get("kind") == "trace" and events[-1].get("event") == "end"
    if torn:
        out.append(Violation("complete", "the last line of the trace is cut off"))
    if not closed:
        last_ev = events[-1] if events else {}
        out.append(
            Violation(
                "complete",
                "the trace has no end line: it was cut off (or the job died)",
                last_ev.get("seq"),
                last_ev.get("run"),
            )
        )
    elif connected is not None:
        out.append(
            Violation(
                "paired",
                "the trace was closed with the transport still connected",
                connected.get("seq"),
                connected.get("run"),
            )
        )
    return out


__all__ = [
    "RUN_CHECKS",
    "Violation",
    "check_complete",
    "check_deadline",
    "check_finalize_once",
    "check_kv_fresh",
    "check_lock",
    "check_paired",
    "check_pause_continue",
    "check_run",
    "check_trace",
    "check_version",
    "commit_gate",
]
