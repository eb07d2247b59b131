"""Integrity of a recorded trace: what a lost, reordered, duplicated, spliced or edited line breaks.

The run invariants (`refit.invariants`) trust that the events in front of them are the ones the
runner wrote. These checks make that trust earned: each is a pure function over the trace's
events (and its header), each names the invariant it enforces and the first offending event.

  integrity      sequence numbers start at 0 (for a whole file), are contiguous and increase in
                 file order (nothing lost, reordered or duplicated), time never runs backwards;
                 one header, first; nothing after the trace's end line; every event belongs to a
                 run that started earlier in this trace, is not past that run's end, and names
                 that run's target version; no run starts twice.
  states         a run's transitions replay through the state table from IDLE, each event was
                 recorded in the state the replay is in, and the run ends in the state it reports.
  outcome        a run's end agrees with its calls: it names exactly the engines its start named;
                 an engine reported `updated` published this run's version and was continued, one
                 reported `unchanged` neither published nor received a byte that may have landed
                 and reports the version it was probed at; an engine dropped as dead or hung
                 never answers again; an engine named at start that the run reached has events;
                 a colocated engine's weight-memory resume is paired (its KV memory resumed, its
                 weights released again, or it was quarantined or lost) and a serving colocated
                 engine had its KV memory resumed; under a version policy (the start's
                 `max_staleness` k), no engine left in service is more than k versions behind
                 the version the run published.
  version        across runs: each run's target increases on the runs before it, its previous
                 version is the last version published before it (or the previous run's), and the
                 first run starts from the version the header's configuration names.
  deadline       a call recorded ok took no longer than the budget it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from refit.invariants._core import Event, Violation

LATE_TOLERANCE_S = 0.25  # a driver answering this long past its budget ignored its timeout (less: host scheduling)
_IDLE = "IDLE"
_NOT_LOCKED = ("busy", "lock_error", "incarnation_error")  # runs that ended before taking the lock


def _table() -> dict[tuple[str, str], str]:
    from refit.states._table import TRANSITIONS

    return {(str(trig), str(src)): str(dst) for trig, sources, dst in TRANSITIONS for src in sources}


def _v(inv: str, msg: str, ev: Event | None) -> Violation:
    ev = ev or {}
    return Violation(inv, msg, ev.get("seq"), ev.get("run"))


def check_sequence(events: Sequence[Event], *, whole: bool = True) -> list[Violation]:
    """Contiguous, increasing sequence numbers (from 0 when `whole`), time never backwards, one
    header, nothing after the end line. Reports the first break of each kind."""
    out: list[Violation] = []
    seen: dict[str, bool] = {}

    def once(kind: str, v: Violation) -> None:
        if not seen.get(kind):
            seen[kind] = True
            out.append(v)

    prev: Event | None = None
    for i, e in enumerate(events):
        seq = e.get("seq")
        if e.get("kind") == "header":
            once("header", _v("integrity", "a second trace header inside the trace (two traces spliced?)", e))
            continue
        if prev is not None and prev.get("kind") == "trace" and prev.get("event") == "end":
            once("after_end", _v("integrity", "events after the trace's end line", e))
        if not isinstance(seq, int):
            once("seq_type", _v("integrity", f"event {i + 1} has no sequence number", e))
            prev = e
            continue
        if prev is None:
            if whole and seq != 0:
                once("lost", _v("integrity", f"the first event has seq {seq}: events 0..{seq - 1} were lost", e))
        elif isinstance(prev.get("seq"), int):
            p = prev["seq"]
            if seq == p:
                once("dup", _v("integrity", f"event seq {seq} appears twice (duplicated)", e))
            elif seq < p:
                once("order", _v("integrity", f"event seq {seq} comes after seq {p} (reordered)", e))
            elif seq > p + 1 and _found_later(events, i, range(p + 1, min(seq, p + 9))):
                once("order", _v("integrity", f"event seq {seq} comes before seq {p + 1} (reordered)", e))
            elif seq > p + 1:
                once("lost", _v("integrity", f"events seq {p + 1}..{seq - 1} are missing (lost)", e))
            t, pt = e.get("t"), prev.get("t")
            if isinstance(t, int | float) and isinstance(pt, int | float) and t < pt:
                once("time", _v("integrity", f"event time {t} is before the previous event's {pt}", e))
        prev = e
    return out


def _found_later(events: Sequence[Event], i: int, seqs: range) -> bool:
    """The skipped sequence numbers come a little later in the file: moved, not lost."""
    ahead = {e.get("seq") for e in events[i + 1 : i + 65]}
    return all(n in ahead for n in seqs)


def check_run_membership(events: Sequence[Event]) -> list[Violation]:
    """Every run event belongs to a run that started here and has not ended; no run starts twice;
    every event of a run names the run's target version."""
    out: list[Violation] = []
    started: dict[str, Event] = {}
    ended: set[str] = set()
    flagged: set[str] = set()
    for e in events:
        run = e.get("run")
        if run is None:
            continue
        first = (e.get("kind"), e.get("event")) == ("run", "start")
        if first:
            if run in started:
                out.append(_v("integrity", f"run {run} starts twice", e))
            started[run] = e
            continue
        if run not in started:
            if run not in flagged:
                flagged.add(run)
                out.append(_v("integrity", f"an event of run {run}, which never started in this trace", e))
            continue
        if run in ended and run not in flagged:
            flagged.add(run)
            what = "a second end" if (e.get("kind"), e.get("event")) == ("run", "end") else "an event"
            out.append(_v("integrity", f"{what} of run {run} after the run ended", e))
        if (e.get("kind"), e.get("event")) == ("run", "end"):
            ended.add(run)
        target = started[run].get("version")
        if "version" in e and e.get("version") != target and run not in flagged:
            flagged.add(run)
            out.append(_v("integrity", f"event names version {e.get('version')}; its run refits to {target}", e))
    return out


def check_states(events: Sequence[Event]) -> list[Violation]:
    """One run's transitions replay through the state table from IDLE; every event was recorded
    in the state the replay is in; the end reports the state the run ended in."""
    table = _table()
    state = _IDLE
    for e in events:
        kind = e.get("kind")
        if kind == "transition":
            trig, src, dst = e.get("event"), e.get("src"), e.get("dst")
            legal = table.get((str(trig), state))
            if src != state or legal is None or dst != legal:
                return [
                    _v("states", f"transition {trig} {src}->{dst} does not follow from {state} in the state table", e)
                ]
            state = legal
        elif "state" in e and e.get("state") != state and not _drained(e, state):
            return [_v("states", f"{kind}/{e.get('event')} recorded in {e.get('state')}, the run was in {state}", e)]
        if (kind, e.get("event")) == ("run", "end"):
            result = e.get("result")
            if result not in _NOT_LOCKED and result != state:
                return [_v("states", f"the run reports it ended in {result}; its transitions end in {state}", e)]
    return []


def _began(e: Event) -> float:
    took = e.get("duration_s")
    return float(e.get("t", 0.0)) - (float(took) if isinstance(took, int | float) else 0.0)


def _drained(e: Event, state: str) -> bool:
    """A bucket's answers collected while the run aborts: recorded in the state they were sent in."""
    return (
        state == "ABORTING" and e.get("kind") == "call" and e.get("state") in ("TRANSFERRING", "POST_PROCESSING")
        and e.get("event") in ("load", "finalize", "send", "release", "abandon")
    )  # fmt: skip


def _sent_after(call: Event, dropped: Event) -> bool:
    """Whether `call` was sent after the engine was dropped: by batch number when the drop records
    the newest batch sent by then (a queued call's duration is its execution, not its wait), else
    by when the call began."""
    sent, batch = dropped.get("sent_batches"), call.get("batch")
    if isinstance(sent, int) and isinstance(batch, int):
        return batch > sent
    return _began(call) > float(dropped.get("t", 0.0))


def _engine_calls(events: Sequence[Event], name: str) -> list[Event]:
    return [e for e in events if e.get("kind") == "call" and e.get("side") == "engine" and e.get("engine") == name]


def check_outcomes(events: Sequence[Event]) -> list[Violation]:
    """A run's end agrees with its calls (see the module docstring: `outcome`)."""
    out: list[Violation] = []
    start = next((e for e in events if (e.get("kind"), e.get("event")) == ("run", "start")), None)
    end = next((e for e in events if (e.get("kind"), e.get("event")) == ("run", "end")), None)
    if start is None:
        return out
    named = list(start.get("engines") or [])
    target = start.get("version")
    colocated = start.get("mode") == "colocated"
    reached = any(e.get("kind") == "call" and e.get("side") == "engine" for e in events)
    for name in named:
        calls = _engine_calls(events, name)
        if reached and not calls:
            out.append(_v("outcome", f"engine {name} is named at the run's start but has no events", end or start))
            continue
        dropped = next(
            (e for e in events
             if (e.get("kind"), e.get("event"), e.get("engine")) == ("engine", "dropped", name)
             and e.get("failure") in ("dead", "timeout")),
            None,
        )  # fmt: skip
        if dropped is not None:
            # an atomic run's hung engine that never paused is sent its discard and hold regardless (they run
            # once it answers: it would otherwise go on serving its old weights)
            owed = ("discard", "quarantine") if start.get("atomic") is True else ()
            late = [  # a call sent after the drop (one in flight before it, a pipelined bucket, may still answer)
                c for c in calls
                if c["seq"] > dropped["seq"] and c.get("outcome") == "ok" and _sent_after(c, dropped)
                and c.get("event") not in owed
            ]  # fmt: skip
            if late:
                msg = f"engine {name} answered {late[0].get('event')} after it was dropped as {dropped.get('failure')}"
                out.append(_v("outcome", msg, late[0]))
        if colocated and calls:
            out.extend(_memory_pairs(events, name, calls, end, dropped is not None))
    if end is None or end.get("result") in _NOT_LOCKED:
        return out
    outcomes = end.get("engine_outcomes")
    if not isinstance(outcomes, dict):
        return [*out, _v("outcome", "the run's end has no engine outcomes", end)]
    if sorted(outcomes) != sorted(named):
        msg = f"the run's end reports engines {sorted(outcomes)}; its start named {sorted(named)}"
        out.append(_v("outcome", msg, end))
    for name, o in outcomes.items():
        status = o.get("status") if isinstance(o, dict) else None
        version = o.get("version") if isinstance(o, dict) else None
        calls = _engine_calls(events, name)
        published = [c for c in calls if c.get("event") == "publish" and c.get("outcome") == "ok"]
        if status == "updated":
            continued = [
                c for c in calls if c.get("event") == "continue_generation" and c.get("outcome") == "ok"
                and published and c["seq"] > published[0]["seq"]
            ]  # fmt: skip
            if not published or not continued or version != target:
                why = "published nothing" if not published else "was not continued" if not continued else ""
                why = why or f"reports version {version}, the run's target is {target}"
                out.append(_v("outcome", f"engine {name} is reported updated but {why}", end))
        elif status == "unchanged":
            atomic = start.get("atomic") is True  # its buckets land in a copy: only a swap serves them
            landed = [
                c for c in calls if c.get("event") == ("swap" if atomic else "load") and c.get("effect") != "none"
            ]  # a load refused before any effect changes nothing
            if published or landed:
                what = (
                    "published" if published else "swapped its staged copy in" if atomic
                    else f"received bucket {landed[0].get('bucket')}"
                )  # fmt: skip
                out.append(_v("outcome", f"engine {name} is reported unchanged but {what} in this run", end))
            probed = next((c for c in calls if c.get("event") == "probe" and c.get("outcome") == "ok"), None)
            pv = (probed.get("result") or {}).get("version") if probed else None
            if isinstance(pv, int) and not isinstance(pv, bool) and version != pv:
                msg = f"engine {name} is reported unchanged at version {version} but was probed at {pv}"
                out.append(_v("outcome", msg, end))
        if status == "stale" and published:
            out.append(_v("outcome", f"engine {name} is reported stale but published this run's version", end))
        k, published_v = start.get("max_staleness"), end.get("published")
        serves = any(isinstance(x, dict) and x.get("status") == "updated" for x in outcomes.values())
        policy = isinstance(k, int) and isinstance(published_v, int) and serves and status in ("updated", "unchanged")
        if policy and (not isinstance(version, int) or published_v - version > k):
            msg = (
                f"engine {name} is reported {status} at version {version} while the fleet serves "
                f"{published_v}: the run's max_staleness is {k}"
            )
            out.append(_v("outcome", msg, end))
        if colocated and status in ("updated", "unchanged") and calls:
            kv = [
                c for c in calls if c.get("event") == "resume_memory" and c.get("outcome") == "ok"
                and "kv_cache" in _tags(c)
            ]  # fmt: skip
            paused = any(c.get("event") == "pause" for c in calls)
            if paused and not kv:
                out.append(_v("outcome", f"engine {name} is reported serving but its KV memory never resumed", end))
    return out


def _tags(call: Event) -> list[str]:
    tags = call.get("tags")
    if isinstance(tags, list):
        return [str(t) for t in tags]
    return {"OFFLOADING": ["weights"], "RESTORING": ["kv_cache"]}.get(call.get("state") or "", [])


def _resumed(call: Event) -> list[str]:
    """What a resume took back (released before it); drivers that do not say took everything asked."""
    result = call.get("result")
    said = result.get("resumed") if isinstance(result, dict) else None
    return [str(t) for t in said] if isinstance(said, list) else _tags(call)


def _memory_pairs(
    events: Sequence[Event], name: str, calls: list[Event], end: Event | None, lost: bool
) -> list[Violation]:
    resumes = [c for c in calls if c.get("event") == "resume_memory"]
    weights = [c for c in resumes if "weights" in _tags(c) and c.get("outcome") == "ok"]
    kv = [c for c in resumes if "kv_cache" in _tags(c)]
    if kv and not weights:
        return [_v("outcome", f"engine {name}'s KV memory resumed without a weight-memory resume before it", kv[0])]
    taken = [c for c in weights if "weights" in _resumed(c)]
    if end is None or not taken or lost:
        return []
    released = [c for c in calls if c.get("event") == "release_memory" and c["seq"] > weights[0]["seq"]]
    quarantined = [c for c in calls if c.get("event") == "quarantine" and c["seq"] > weights[0]["seq"]]
    if not kv and not released and not quarantined:
        msg = f"engine {name}'s weight memory resumed, and it was neither given its KV memory, released nor quarantined"
        return [_v("outcome", msg, weights[0])]
    return []


def check_versions_across_runs(header: dict[str, Any] | None, runs: Sequence[Sequence[Event]]) -> list[Violation]:
    """Runs that took the lock, in order: targets increase; each starts from the last version
    published before it (or the previous run's own starting point)."""
    out: list[Violation] = []
    config = (header or {}).get("config") or {}
    expected_prev: Any = config.get("version") if isinstance(config.get("version"), int) else None
    last_target: int | None = None
    for evs in runs:
        start = evs[0] if evs and (evs[0].get("kind"), evs[0].get("event")) == ("run", "start") else None
        end = next((e for e in evs if (e.get("kind"), e.get("event")) == ("run", "end")), None)
        if start is None or end is None or end.get("result") in _NOT_LOCKED:
            continue
        target, prev = start.get("version"), start.get("previous_version")
        if expected_prev is not None and prev != expected_prev:
            msg = f"the run starts from version {prev}, but the version before it is {expected_prev}"
            out.append(_v("version", msg, start))
        if isinstance(target, int) and last_target is not None and target <= last_target:
            out.append(_v("version", f"the run's target {target} does not increase on {last_target}", start))
        if isinstance(target, int) and isinstance(prev, int) and target <= prev:
            out.append(_v("version", f"the run's target {target} is not above its previous version {prev}", start))
        last_target = target if isinstance(target, int) else last_target
        published = end.get("published")
        expected_prev = published if published is not None else prev
    return out


def check_budgets(events: Sequence[Event]) -> list[Violation]:
    """No call recorded ok took longer than its budget."""
    out = []
    for e in events:
        if e.get("kind") != "call" or e.get("outcome") != "ok":
            continue
        budget, took = e.get("budget_s"), e.get("duration_s")
        if isinstance(budget, int | float) and isinstance(took, int | float) and took > budget + LATE_TOLERANCE_S:
            who = f"engine {e.get('engine')}'s" if e.get("engine") else f"the {e.get('side')}'s"
            msg = f"{who} {e.get('event')} is recorded ok but took {took:.3f}s of a {budget:.3f}s budget"
            out.append(_v("deadline", msg, e))
    return out


__all__ = [
    "LATE_TOLERANCE_S",
    "check_budgets",
    "check_outcomes",
    "check_run_membership",
    "check_sequence",
    "check_states",
    "check_versions_across_runs",
]
