"""Refit invariants: pure functions over trace events (dicts as `refit.trace` writes them) and over
engine audit records (what an engine itself did, as `ReferenceEngine.audit()` returns them).

The trace functions run live (the runner checks every run's events; its commit gate asks
`commit_gate` before an engine publishes), offline (`refit check TRACE`) and under Hypothesis
(`refit.testing`). They never import a driver: they are an independent oracle over what drivers
reported. The audit functions check the other side: what the engine did, whatever its driver
claimed. An engine's update is per attempt (`attempt` on each event): a retried engine begins,
loads and finalizes again.

  lock            taken once by the run's owner token before any call, released by that owner
                  after the last call, on every exit; a release by a token that does not hold
                  the lock never succeeds.
  version         an engine publishes only in CONTINUING, only the run's target version, and only
                  after its last attempt acked every bucket and finalized; a run that failed
                  before its commit point publishes nothing; published versions strictly
                  increase; an engine whose weights changed or were lost is continued only after
                  it published; in an atomic run, only after its staged copy was swapped in, after
                  its finalize (a LoRA refit's publish is its switch: the staged adapter version goes
                  live, no swap; `refit.invariants.adapters` checks the versions engine-side).
                  (Audit: no version label while the weights are not finalized.)
  finalize_once   per engine and attempt: one finalize iff its begin (or stage) succeeded (at most one when
                  the engine died or hung), after its last load, and no load after it.
                  (Audit: one finalize per update session.)
  pause_continue  every paused engine is continued or quarantined (or reported dead/hung); a
                  continue or quarantine the engine refused, or that was never sent, does not
                  count; no engine that received a bucket (atomic runs: whose copy was swapped in)
                  is continued unless it published.
                  (Audit: never continued while holding weights no version names.)
  kv_fresh        an attempt's first bucket comes after a successful flush that came after a
                  successful pause; in an atomic run (buckets land in a copy nothing serves) every
                  swap does instead. (Audit: no bucket applied to served weights, and no copy
                  swapped in, without a flush since the pause.)
  paired          trainer offload -> restore in the same run; a transport buffer is released
                  only after every engine it was sent to answered for it (and the trainer's send
                  of it, for collective transports, finished); connect/disconnect
                  alternate and the last connection is closed with the trace. (Audit: an engine
                  acknowledged a bucket only after it finished copying it out.)
  verified        a run that verifies (`verify` at its start, other than "off") publishes an
                  engine only after that engine's attempt reported what it will serve and the
                  report matches the trainer's digests of what it sent; both are recomputed from
                  the recorded digests, not taken from the run's own verdict.
  deadline        a run ends within its deadline plus its cleanup grace.
  complete        every run has an end event; a closed trace has its end line (a cut-off trace is
                  a violation, not a pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from refit.invariants._core import Event, Violation
from refit.invariants.integrity import (
    check_budgets,
    check_outcomes,
    check_run_membership,
    check_sequence,
    check_states,
    check_versions_across_runs,
)

DEADLINE_SLACK_S = 1.0  # scheduling noise allowed past deadline + grace
POST_COMMIT_STATES = ("CONTINUING", "RESTORING")


def _calls(
    events: Iterable[Event],
    call: str | None = None,
    *,
    side: str = "engine",
    engine: str | None = None,
    attempt: int | None = None,
) -> list[Event]:
    return [
        e for e in events
        if e.get("kind") == "call" and e.get("side") == side
        and (call is None or e.get("event") == call) and (engine is None or e.get("engine") == engine)
        and (attempt is None or e.get("attempt", 0) == attempt)
    ]  # fmt: skip


def _ok(events: Iterable[Event]) -> list[Event]:
    return [e for e in events if e.get("outcome") == "ok"]


def _effective(events: Iterable[Event]) -> list[Event]:
    """Calls that may have changed the engine (not refused by it before any effect)."""
    return [e for e in events if e.get("effect") != "none"]


def _first(events: Iterable[Event], kind: str, event: str) -> Event | None:
    return next((e for e in events if e.get("kind") == kind and e.get("event") == event), None)


def _start(events: Sequence[Event]) -> Event:
    return _first(events, "run", "start") or {}


def _end(events: Sequence[Event]) -> Event | None:
    return _first(events, "run", "end")


def _engines(events: Sequence[Event]) -> list[str]:
    """The engines named at run start, and any other engine the run's calls name."""
    named = list(_start(events).get("engines") or [])
    return named + sorted({e["engine"] for e in _calls(events) if e.get("engine")} - set(named))


def _n_buckets(events: Sequence[Event]) -> int:
    plan = _first(events, "plan", "buckets")
    return int(plan["buckets"]) if plan else 0


def _begins(events: Iterable[Event], engine: str, attempt: int | None = None) -> list[Event]:
    """An engine's update-session openings: `begin`, or an atomic run's `stage`."""
    calls = _calls(events, engine=engine, attempt=attempt)
    return [c for c in calls if c.get("event") in ("begin", "stage")]


def _atomic(events: Sequence[Event]) -> bool:
    """The run stages its updates into copies that only a swap serves (`RefitContext.atomic`)."""
    return _start(events).get("atomic") is True


def _adapter(events: Sequence[Event]) -> bool:
    """A LoRA refit: staged into a new adapter version, which its publish makes live (no swap)."""
    return isinstance(_start(events).get("adapter"), dict)


def _attempts(events: Sequence[Event], engine: str) -> list[int]:
    return sorted({e.get("attempt", 0) for e in _begins(events, engine)})


def _unreachable(events: Sequence[Event], engine: str) -> bool:
    """The run reported this engine dead or hung (it may not answer cleanup calls)."""
    drops = [
        e for e in events if e.get("kind") == "engine" and e.get("event") == "dropped" and e.get("engine") == engine
    ]
    return bool(drops) and drops[-1].get("failure") in ("dead", "timeout")


def _after_failed_publish(events: Sequence[Event], call: Event) -> bool:
    """The continue rode in one engine call (`batch`) behind its publish, which failed: the engine
    stops at the first failure, so this continue never ran, whatever its own recorded outcome."""
    batch = call.get("batch")
    if batch is None:
        return False
    return any(
        e.get("kind") == "call" and e.get("event") == "publish" and e.get("engine") == call.get("engine")
        and e.get("batch") == batch and e["seq"] < call["seq"] and e.get("outcome") != "ok"
        for e in events
    )  # fmt: skip


def _continues(events: Sequence[Event], engine: str) -> list[Event]:
    """continue_generation calls that may have taken effect."""
    return [c for c in _calls(events, "continue_generation", engine=engine) if not _after_failed_publish(events, c)]


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
    attempted = [e for e in locks if e["event"] == "release" and e.get("outcome") not in ("ok", "not_owner")]
    if _busy(events):
        if acts:
            out.append(_v("lock", "a run refused as busy still made driver calls or moves", acts[0], events))
        return out
    if len(acquires) != 1 or acquires[0].get("owner") != owner:
        got = acquires[0] if acquires else None
        out.append(_v("lock", f"expected one acquire by owner {owner}, saw {len(acquires)}", got, events))
        return out
    if acts and acts[0]["seq"] < acquires[0]["seq"]:
        out.append(_v("lock", "a driver call or move happened before the lock was taken", acts[0], events))
    for rel in releases:
        if rel.get("owner") != owner:
            out.append(_v("lock", f"the lock was released by {rel.get('owner')}, not its owner {owner}", rel, events))
    mine = [r for r in releases + attempted if r.get("owner") == owner]  # a lock that raised was still released by us
    if _end(events) is not None:
        if len(mine) != 1:
            out.append(
                _v("lock", f"the owner released the lock {len(mine)} times, expected once", _end(events), events)
            )
        elif acts and acts[-1]["seq"] > mine[0]["seq"]:
            out.append(_v("lock", "a driver call or move happened after the lock was released", acts[-1], events))
    return out


def commit_gate(
    events: Sequence[Event],
    engines: Sequence[str],
    n_buckets: int,
    *,
    attempt: int | None = None,
    verified: bool = False,
) -> list[str]:
    """Reasons these engines may not publish yet (empty: each one's last attempt, or `attempt`,
    acked every bucket and finalized exactly once, and, when `verified`, passed verification after
    its finalize)."""
    problems = []
    for name in engines:
        tried = _attempts(events, name)
        a = attempt if attempt is not None else (tried[-1] if tried else 0)
        if not _ok(_begins(events, name, a)):
            problems.append(f"engine {name} has no open session in attempt {a}")
        acked = {e.get("bucket") for e in _ok(_calls(events, "load", engine=name, attempt=a))}
        missing = sorted(set(range(n_buckets)) - acked)
        if missing:
            problems.append(f"engine {name} did not ack buckets {missing} in attempt {a}")
        fins = _calls(events, "finalize", engine=name, attempt=a)
        if [e.get("outcome") for e in fins] != ["ok"]:
            problems.append(f"engine {name} has not finalized exactly once in attempt {a}")
        elif verified:
            problem = _verification(events, name, a, after=fins[0]["seq"])
            if problem:
                problems.append(problem)
    return problems


def _verification(events: Sequence[Event], name: str, attempt: int, *, after: int) -> str | None:
    """Why engine `name`'s attempt is not verified (None: it is): its last verify call after its
    finalize must have answered, and its answer, judged again here (`refit.verify.judge`) against
    the trainer's digests and reference log-probabilities recorded before it, must pass."""
    from refit.verify import digests_of, judge, merge, probes_of
    from refit.verify import uncovered as verify_uncovered

    mode = _start(events).get("verify") or "digest"
    calls = [c for c in _calls(events, "verify", engine=name, attempt=attempt) if c["seq"] > after]
    if not calls or calls[-1].get("outcome") != "ok":
        return f"engine {name} has no successful verify after its finalize in attempt {attempt}"
    call = calls[-1]
    kind, expected = None, {}
    if digests_of(mode):
        reports = [
            e for e in events
            if e.get("kind") == "call" and e.get("event") == "digests" and e.get("side") != "engine"
            and e.get("outcome") == "ok" and e["seq"] < call["seq"] and e.get("attempt", 0) == attempt
        ]  # fmt: skip
        if not reports:
            return f"engine {name}: no digests of what the trainer sent were recorded in attempt {attempt}"
        kind, expected = merge(list(reports[-1].get("per_rank") or []))
        plan = _first(events, "plan", "buckets") or {}
        planned = [n for m in plan.get("manifests") or [] for n in m.get("names", [])]
        uncovered = verify_uncovered(kind, expected, planned) if isinstance(kind, str) else planned
        if uncovered or not planned:
            return (
                f"engine {name}: the trainer's digests do not cover the plan ({len(uncovered)} planned tensors missing)"
            )
    reference = None
    if probes_of(mode):
        scored = [
            e for e in events
            if e.get("kind") == "call" and e.get("event") == "logprobs" and e.get("side") != "engine"
            and e.get("outcome") == "ok" and e["seq"] < call["seq"]
        ]  # fmt: skip
        answers = [a for a in (scored[-1].get("per_rank") or []) if a is not None] if scored else []
        if not answers or "tolerance" not in scored[-1]:
            return f"engine {name}: no reference log-probabilities of the trainer's model were recorded"
        reference = {"expected": answers[0], "tolerance": scored[-1]["tolerance"]}
    verdict = judge(call.get("result"), kind, expected, reference)
    if not verdict["ok"]:
        return f"engine {name}: " + "; ".join(verdict["problems"])
    return None


def check_verified(events: Sequence[Event]) -> list[Violation]:
    start = _start(events)
    if start.get("verify") in (None, "off"):
        return []
    out = []
    for p in _ok(_calls(events, "publish")):
        before = [e for e in events if e["seq"] < p["seq"]]
        a = p.get("attempt", 0)
        fins = _ok(_calls(before, "finalize", engine=p["engine"], attempt=a))
        problem = _verification(before, p["engine"], a, after=fins[-1]["seq"] if fins else -1)
        if problem:
            out.append(_v("verified", f"published unverified: {problem}", p, events))
    return out


def check_version(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    start, end = _start(events), _end(events)
    target = start.get("version")
    n = _n_buckets(events)
    publishes = _calls(events, "publish")
    for p in publishes:
        if p.get("state") != "CONTINUING":
            out.append(_v("version", f"engine {p.get('engine')} published in state {p.get('state')}", p, events))
        before = [e for e in events if e["seq"] < p["seq"]]
        for problem in commit_gate(before, [p["engine"]], n):
            out.append(_v("version", f"published before its refit was complete: {problem}", p, events))
        if _atomic(events) and not _adapter(events) and p.get("outcome") == "ok":
            a = p.get("attempt", 0)
            fins = _ok(_calls(before, "finalize", engine=p["engine"], attempt=a))
            swaps = [
                s
                for s in _ok(_calls(before, "swap", engine=p["engine"], attempt=a))
                if fins and s["seq"] > fins[0]["seq"]
            ]
            if not swaps:
                msg = f"engine {p['engine']} published in an atomic run without its finalized copy swapped in"
                out.append(_v("version", msg, p, events))
    if end is not None and end.get("published") is not None:
        if end["published"] != target:
            out.append(
                _v("version", f"run ended claiming version {end['published']}, its target was {target}", end, events)
            )
        if not _ok(publishes):
            out.append(_v("version", "run claims a published version but no engine published it", end, events))
    if end is not None and _ok(publishes) and end.get("published") is None:
        out.append(_v("version", "engines published a version the run does not report", end, events))
    fail = _first(events, "transition", "fail")
    if fail is not None and _ok(publishes) and fail.get("src") not in POST_COMMIT_STATES:
        out.append(_v("version", f"a run that failed in {fail.get('src')} (before its commit) published", fail, events))
    for name in _engines(events):
        resumes = [e for e in _calls(events, "resume_memory", engine=name) if e.get("state") == "OFFLOADING"]
        lost = [  # failed, or not reported intact: the contents are unknown
            e for e in resumes if e.get("outcome") != "ok" or (e.get("result") or {}).get("weights_intact") is not True
        ]
        if not lost:  # a weight-memory resume that failed or came back empty: the weights are gone
            continue
        published = _ok(_calls(events, "publish", engine=name))
        for c in _continues(events, name):
            if not published or published[0]["seq"] > c["seq"]:
                msg = f"engine {name} lost its weights and was continued before a new version was published"
                out.append(_v("version", msg, c, events))
    return out


def check_finalize_once(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    complete = _end(events) is not None
    for name in _engines(events):
        for a in sorted({e.get("attempt", 0) for e in _calls(events, engine=name)}):
            begun = bool(_ok(_begins(events, name, a)))
            fins = _calls(events, "finalize", engine=name, attempt=a)
            loads = _calls(events, "load", engine=name, attempt=a)
            expected = 1 if begun else 0
            lenient = _unreachable(events, name)  # a dead or hung engine cannot always be finalized
            if len(fins) > expected or (complete and not lenient and len(fins) != expected):
                msg = f"engine {name}: {len(fins)} finalize calls in attempt {a}, expected {expected}"
                out.append(_v("finalize_once", msg, fins[-1] if fins else _end(events), events))
            if fins and loads and loads[-1]["seq"] > fins[0]["seq"]:
                out.append(_v("finalize_once", f"engine {name} received a bucket after finalize", loads[-1], events))
    return out


def check_pause_continue(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    end = _end(events)
    for name in _engines(events):
        pauses = _calls(events, "pause", engine=name)
        resumed = [  # a quarantine the engine refused still discharges the run: it is reported failed
            c for c in _calls(events, "continue_generation", engine=name) + _calls(events, "quarantine", engine=name)
            if c.get("sent") is not False
            and (c.get("outcome") in ("ok", "timeout") or (c["event"] == "quarantine" and c.get("outcome") == "error"))
        ]  # fmt: skip
        after = [c for c in resumed if pauses and c["seq"] > pauses[0]["seq"]]
        if pauses and end is not None and not after and not _unreachable(events, name):
            out.append(
                _v("pause_continue", f"engine {name} was paused and neither continued nor quarantined", end, events)
            )
        # what changes the served weights: buckets, or in an atomic run the swap of a staged copy
        loads = _effective(_calls(events, "swap" if _atomic(events) else "load", engine=name))
        published = _ok(_calls(events, "publish", engine=name))
        for c in _continues(events, name):
            got = [ld for ld in loads if ld["seq"] < c["seq"]]
            if got and not [p for p in published if p["seq"] < c["seq"]]:
                acked = len(_ok(_calls(events, "load", engine=name)))
                what = "a swap" if _atomic(events) else "a partial transfer"
                msg = f"engine {name} was continued after {what} ({acked} buckets acked) without publishing"
                out.append(_v("pause_continue", msg, c, events))
    return out


def _covers(before: Event, after: Event) -> bool:
    """`before` (a step that must precede `after` on the engine) covers it: it succeeded, or `after`
    came in the same batch and its own effect is unknown or nil (not ok): an engine runs a batch's
    steps in order and stops at the first that fails, so `after` can have had an effect only if
    `before` succeeded. An `after` that succeeded needs a `before` that succeeded."""
    if before.get("outcome") == "ok":
        return True
    same = before.get("batch") is not None and before.get("batch") == after.get("batch")
    return same and after.get("outcome") != "ok"


def check_kv_fresh(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    atomic = _atomic(events)
    for name in _engines(events):
        # the first call that changes what the engine serves, per attempt: its first bucket, or
        # (atomic runs, whose buckets land in a copy) each swap
        attempts = sorted({e.get("attempt", 0) for e in _calls(events, "load", engine=name)})
        if atomic:  # and an attempt whose session was not staged loads into what it serves
            firsts = [s for s in _calls(events, "swap", engine=name) if s.get("effect") != "none"]
            attempts = [a for a in attempts if _calls(events, "begin", engine=name, attempt=a)]
        else:
            firsts = []
        firsts += [_calls(events, "load", engine=name, attempt=a)[0] for a in attempts]
        for first in firsts:
            what = "swapped its copy in" if first["event"] == "swap" else f"received bucket {first.get('bucket')}"
            flushes = [f for f in _calls(events, "flush", engine=name) if f["seq"] < first["seq"] and _covers(f, first)]
            pauses = [p for p in _calls(events, "pause", engine=name) if flushes and _covers(p, flushes[-1])]
            if not flushes:
                msg = f"engine {name} {what} before its KV cache was flushed"
                out.append(_v("kv_fresh", msg, first, events))
            elif not (before := [p for p in pauses if p["seq"] < flushes[-1]["seq"]]):
                msg = f"engine {name} was flushed before it was paused: requests could refill the cache"
                out.append(_v("kv_fresh", msg, flushes[-1], events))
            else:  # paused, flushed, changed: with no continue in between that could have run requests
                resumed = [  # any that may have taken effect (a late answer's effect is unknown)
                    c for c in _effective(_continues(events, name))
                    if before[-1]["seq"] < c["seq"] < first["seq"] and c.get("sent") is not False
                ]  # fmt: skip
                if resumed:
                    msg = (
                        f"engine {name} was continued between its pause and the point it {what}: requests "
                        "could refill the cache under the old weights"
                    )
                    out.append(_v("kv_fresh", msg, resumed[0], events))
    return out


def check_paired(events: Sequence[Event]) -> list[Violation]:
    out: list[Violation] = []
    offloads = _calls(events, "offload", side="source")
    restores = _calls(events, "restore", side="source")
    if offloads and _end(events) is not None and not [r for r in restores if r["seq"] > offloads[0]["seq"]]:
        out.append(_v("paired", "the trainer was offloaded and never restored", _end(events), events))
    for rel in _calls(events, "release", side="transport"):
        b, a = rel.get("bucket"), rel.get("attempt", 0)
        sent = [e for e in _calls(events, "load") if e.get("bucket") == b and e.get("attempt", 0) == a]
        late = [e.get("engine") for e in sent if e["seq"] > rel["seq"] or e.get("outcome") == "timeout"]
        sends = [
            e for e in _calls(events, "send", side="transport") if e.get("bucket") == b and e.get("attempt", 0) == a
        ]
        late += ["the trainer's send" for e in sends if e["seq"] > rel["seq"] or e.get("outcome") == "timeout"]
        if late:
            out.append(
                _v("paired", f"buffer of bucket {b} released before engines {late} answered for it", rel, events)
            )
    return out


def check_deadline(events: Sequence[Event]) -> list[Violation]:
    start, end = _start(events), _end(events)
    if not start or end is None or "deadline_s" not in start:
        return []
    budget = float(start["deadline_s"]) + float(start.get("cleanup_grace_s", 0.0))
    took = float(end["t"]) - float(start["t"])
    if took > budget + DEADLINE_SLACK_S:
        msg = f"run took {took:.3f}s, deadline {start['deadline_s']}s + grace {start.get('cleanup_grace_s', 0)}s"
        return [_v("deadline", msg, end, events)]
    return []


def check_complete(events: Sequence[Event]) -> list[Violation]:
    out = []
    if _end(events) is None:
        last = events[-1] if events else None
        out.append(_v("complete", "run has no end event: the trace was cut off mid-run", last, events))
    loads = _calls(events, "load")
    if loads and _first(events, "plan", "buckets") is None:
        out.append(_v("complete", "the run moved buckets but its plan event is missing", loads[0], events))
    return out


RUN_CHECKS = (
    check_complete, check_states, check_lock, check_version, check_verified, check_finalize_once,
    check_pause_continue, check_kv_fresh, check_paired, check_deadline, check_budgets, check_outcomes,
)  # fmt: skip


def check_run(events: Sequence[Event]) -> list[Violation]:
    """Every per-run invariant over one run's events."""
    return [v for check in RUN_CHECKS for v in check(events)]


# ---- whole-trace invariants -------------------------------------------------------------------------


def check_trace(
    events: Sequence[Event],
    *,
    torn: bool = False,
    open_ok: bool = False,
    header: dict[str, Any] | None = None,
    whole: bool = False,
) -> list[Violation]:
    """The trace's integrity, per-run invariants for every run, then what spans runs: versions,
    lock, connections, completeness. `open_ok`: the trace is still being written (a live check
    between runs): no end line required. `whole`: `events` are a whole file from its first event
    (`header` its header line), not a window of a live recorder: sequence numbers start at 0 and
    every run's start is in view."""
    out: list[Violation] = check_sequence(events, whole=whole)
    by_run: dict[str, list[Event]] = {}
    for e in events:
        if e.get("run") is not None:
            by_run.setdefault(e["run"], []).append(e)
    if whole:
        out.extend(check_run_membership(events))
    else:  # a window: runs whose start scrolled out of it are not judged
        by_run = {k: v for k, v in by_run.items() if (v[0].get("kind"), v[0].get("event")) == ("run", "start")}
    for run_events in by_run.values():
        out.extend(check_run(run_events))
    out.extend(check_versions_across_runs(header if whole else None, list(by_run.values())))
    from refit.invariants.adapters import check_trace_adapters

    out.extend(check_trace_adapters(events))  # LoRA refits: the adapter versions' moves the engines reported

    last: int | None = None
    for run_events in by_run.values():
        end = _end(run_events)
        if end is None or end.get("published") is None:
            continue
        if last is not None and end["published"] <= last:
            out.append(
                _v("version", f"published version {end['published']} does not increase on {last}", end, run_events)
            )
        last = end["published"]

    for e in events:  # lock probes outside runs (a stale owner's late release, for example)
        stale = e.get("holder") is not None and e.get("owner") != e.get("holder")
        if (e.get("kind"), e.get("event"), e.get("outcome")) == ("lock", "release", "ok") and stale:
            msg = f"{e.get('owner')} released a lock held by {e.get('holder')}"
            out.append(Violation("lock", msg, e.get("seq"), e.get("run")))

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
    if not closed and not open_ok:
        last_ev = events[-1] if events else {}
        cut_run = next(
            (
                i for i, v in enumerate(out)
                if v.invariant == "complete" and v.message.startswith("run has no end event")
                and (v.seq, v.run) == (last_ev.get("seq"), last_ev.get("run"))
            ),
            None,
        )  # fmt: skip
        if cut_run is not None:  # one cut: the last run's missing end and the trace's are the same fact
            out[cut_run] = Violation(
                "complete",
                "the trace was cut off mid-run (or the job died): the run has no end event, the trace no end line",
                last_ev.get("seq"),
                last_ev.get("run"),
            )
        else:
            out.append(
                Violation(
                    "complete",
                    "the trace has no end line: it was cut off (or the job died)",
                    last_ev.get("seq"),
                    last_ev.get("run"),
                )
            )
    elif connected is not None and closed:
        out.append(
            Violation(
                "paired",
                "the trace was closed with the transport still connected",
                connected.get("seq"),
                connected.get("run"),
            )
        )
    return out


# ---- engine-side audit invariants --------------------------------------------------------------------


def check_engine_audit(
    records: Sequence[dict[str, Any]], *, engine: str = "engine", open_session_ok: bool = False
) -> list[Violation]:
    """What one engine did, whatever its driver reported. Records are dicts with `t`, `op`, `ok`,
    `session`, `dirty_before`, `ready_before`, `bucket`, `version` (see refit.reference.server)."""
    out: list[Violation] = []
    paused = flushed = staged = False
    finalizes: dict[int, int] = {}
    sessions: list[int] = []
    voided: set[int] = set()  # sessions a quarantine closed without finalizing
    for rec in records:
        op, ok = rec.get("op"), rec.get("ok")
        if op == "truncated":  # older records were dropped at a point where nothing was open or paused
            paused = flushed = False
            continue
        if op == "probe" and ok and rec.get("session_open_before"):
            voided.add(rec["session"])  # a crashed run's session, closed by the next run's probe
        if op in ("pause", "quarantine") and ok:
            paused, flushed = True, False
            if op == "quarantine" and rec.get("session_open_before"):
                voided.add(rec["session"])
        elif op == "continue_generation" and ok:
            if rec.get("dirty_before"):
                out.append(Violation("pause_continue", f"engine {engine} continued serving weights no version names"))
            paused = flushed = False
        elif op == "flush" and ok and paused:
            flushed = True
        elif op in ("begin", "stage") and ok:
            sessions.append(rec["session"])
            staged = op == "stage"  # its buckets land in a copy nothing serves until the swap
        elif op == "discard" and ok and staged:
            if rec.get("session_open_before"):
                voided.add(rec["session"])  # a staged session dropped unfinished
            staged = False
        elif op == "swap" and ok:
            if not (paused and flushed):
                out.append(
                    Violation(
                        "kv_fresh", f"engine {engine} swapped its staged copy in without a KV flush since it was paused"
                    )
                )
            staged = False
        elif op == "load" and ok and not flushed and not staged:
            msg = f"engine {engine} applied bucket {rec.get('bucket')} without a KV flush since it was paused"
            out.append(Violation("kv_fresh", msg))
        elif op == "finalize":
            finalizes[rec["session"]] = finalizes.get(rec["session"], 0) + 1
        elif op in ("publish", "label_version") and ok and not rec.get("ready_before"):
            msg = f"engine {engine} was labelled version {rec.get('version')} before its update was finalized"
            out.append(Violation("version", msg))
    for s in sessions:
        count = finalizes.get(s, 0)
        if count > 1 or (count == 0 and s not in voided and not (open_session_ok and s == sessions[-1])):
            out.append(Violation("finalize_once", f"engine {engine}: update session {s} was finalized {count} times"))
    return out


def check_acks(
    records: Sequence[dict[str, Any]], events: Sequence[Event], *, engine: str, until: float | None = None
) -> list[Violation]:
    """The driver acknowledged each bucket only after the engine finished copying it out.

    The n-th copy of bucket b in the engine's audit (its end time `t`) is paired with the n-th
    successful `load` of bucket b for this engine in the trace (`done_at`: when the driver
    returned). Both are CLOCK_MONOTONIC readings on one host. `until`: when the audit was taken;
    acknowledgements after it are not checked (the audit cannot show those copies yet)."""
    out: list[Violation] = []
    copies: dict[int, list[float]] = {}
    for rec in records:
        if rec.get("op") == "load" and rec.get("ok"):
            copies.setdefault(rec.get("bucket"), []).append(rec["t"])
    acks: dict[int, list[Event]] = {}
    for e in _ok(_calls(events, "load", engine=engine)):
        if e.get("done_at") is not None and (until is None or e["done_at"] <= until):
            acks.setdefault(e.get("bucket"), []).append(e)
    for bucket, evs in acks.items():
        for n, ack in enumerate(evs):
            done = copies.get(bucket, [])
            if n >= len(done) or done[n] > ack["done_at"]:
                msg = f"engine {engine}'s driver acknowledged bucket {bucket} before the engine finished copying it"
                out.append(Violation("paired", msg, ack.get("seq"), ack.get("run")))
    return out


__all__ = [
    "RUN_CHECKS",
    "Violation",
    "check_acks",
    "check_budgets",
    "check_complete",
    "check_deadline",
    "check_engine_audit",
    "check_finalize_once",
    "check_kv_fresh",
    "check_lock",
    "check_outcomes",
    "check_paired",
    "check_pause_continue",
    "check_run",
    "check_run_membership",
    "check_sequence",
    "check_states",
    "check_trace",
    "check_version",
    "check_versions_across_runs",
    "commit_gate",
]
