"""LoRA adapter versions: pure checks over an engine's adapter records (audit records with
op "adapter", as `refit.reference.lora.AdapterTable` writes them: adapter, adapter_version, event,
state, seq = the engine's token counter at the move) and over the requests it served (`adapter`,
`adapter_version`, `token_seqs`). Used by the tests, the conformance kit and `refit check`.

  adapter_moves    each version moves only as the adapter table allows (stage opens it; complete,
                   publish, supersede, unload, discard as `refit.states` "adapter" lists them):
                   in particular no version is published without a complete load.
  adapter_live     at most `max_live` versions of an adapter are servable (LIVE or RETIRED) at
                   once, where its stage record names a bound; one LIVE version at a time.
  adapter_served   every token a request got under an adapter version was sampled while that
                   version was servable: after its publish, before its unload.

In a refit trace the engines' answers to probe, drain and publish carry the adapter moves no
answer carried yet (`adapter_moves`, numbered), and an engine carries again those of an answer
its caller never got in time (the caller acknowledges the last one it recorded with each call),
so the trace records every version's loads and unloads and `refit check` runs adapter_moves and
adapter_live on them (`check_trace_adapters`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refit.invariants._core import Violation
from refit.states import ADAPTER_TRANSITIONS, SERVABLE_ADAPTER, Adapter

_MOVES = {(src, str(ev)): dest for ev, sources, dest in ADAPTER_TRANSITIONS for src in sources}


def adapter_records(audit: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in audit if r.get("op") == "adapter"]


def _key(r: Mapping[str, Any]) -> tuple[Any, Any]:
    return r.get("adapter"), r.get("adapter_version")


def check_adapter_moves(records: Sequence[Mapping[str, Any]], *, engine: str = "engine") -> list[Violation]:
    """adapter_moves and adapter_live over one engine's adapter records (its audit), in order: the
    same check as over a trace's reported moves (`check_adapter_records`)."""
    return check_adapter_records(records, engine=engine)


def check_adapter_served(
    records: Sequence[Mapping[str, Any]], requests: Iterable[Mapping[str, Any]], *, engine: str = "engine"
) -> list[Violation]:
    """adapter_served: each request's tokens (by `token_seqs`) fall inside its version's servable
    interval [publish, unload) as the engine's records give it. A request whose version has no
    publish record in `records` (trimmed away) is not judged."""
    opened: dict[tuple[Any, Any], int] = {}
    closed: dict[tuple[Any, Any], int] = {}
    for r in records:
        if r.get("event") == "publish":
            opened[_key(r)] = int(r.get("seq", 0))
        elif r.get("event") == "unload":
            closed[_key(r)] = int(r.get("seq", 0))
    out: list[Violation] = []
    for req in requests:
        key = (req.get("adapter"), req.get("adapter_version"))
        if key[0] is None or key not in opened:
            continue
        seqs = req.get("token_seqs") or []
        if not seqs:
            continue
        rid = req.get("rid", "?")
        if seqs[0] < opened[key]:
            out.append(Violation("adapter_served", f"engine {engine}: request {rid}: token at {seqs[0]} under "
                                 f"{key[0]} v{key[1]}, published at {opened[key]}"))  # fmt: skip
        if key in closed and seqs[-1] >= closed[key]:
            out.append(Violation("adapter_served", f"engine {engine}: request {rid}: token at {seqs[-1]} under "
                                 f"{key[0]} v{key[1]}, unloaded at {closed[key]}"))  # fmt: skip
    return out


def check_adapter_records(records: Iterable[Mapping[str, Any]], *, engine: str = "engine") -> list[Violation]:
    """adapter_moves and adapter_live over move records as the engines' answers carry them into the
    refit trace (`adapter_moves`), in order. Each record names where its version came from (`src`)
    and how many of its adapter serve after it (`servable`, with the bound `max_live`), so a window
    can be judged without the history before it: a version first seen mid-way is taken to be where
    its first record says it came from; from then on each move must start where the last one left
    it (a move lost, repeated or invented breaks the chain), be one the adapter table allows, and
    leave at most one LIVE version of its adapter and no more servable than the bound. A record of
    another table epoch than the last (the engine restarted under the same name) starts afresh."""
    out: list[Violation] = []
    state: dict[tuple[Any, Any], Any] = {}
    epoch: Any = None
    for r in records:
        if r.get("epoch") is not None:
            if epoch is not None and r["epoch"] != epoch:  # another table: the engine restarted under this
                state = {}  # name, and every version it held went with the process that held it
            epoch = r["epoch"]
        name, version, event = r.get("adapter"), r.get("adapter_version"), str(r.get("event"))
        src, dest, key = r.get("src"), r.get("state"), (r.get("adapter"), r.get("adapter_version"))
        known = state.get(key)
        where = f"engine {engine}: {name} v{version}: {event}"
        if event == "stage":
            if src is not None or dest != Adapter.STAGING:
                out.append(Violation("adapter_moves", f"{where} into {dest}"))
            elif known is not None and known not in (Adapter.UNLOADED, Adapter.DISCARDED):
                out.append(Violation("adapter_moves", f"{where} again while {known}"))
        else:
            legal = None if src is None else _MOVES.get((src, event))
            if legal is None or legal != dest:
                what = "before its load was complete" if (event, src) == ("publish", "STAGING") else f"from {src}"
                out.append(Violation("adapter_moves", f"{where} {what} to {dest}"))
            elif known is not None and known != src:
                what = "before its load was complete" if (event, known) == ("publish", "STAGING") else f"from {src}"
                out.append(Violation("adapter_moves", f"{where} {what}, but its last move left it {known}"))
        state[key] = dest
        live = sorted(v for (n, v), s in state.items() if n == name and s == Adapter.LIVE)
        if len(live) > 1:
            out.append(Violation("adapter_live", f"engine {engine}: {name}: versions {live} all LIVE after {event}"))
        servable = sum(1 for (n, _), s in state.items() if n == name and s in SERVABLE_ADAPTER)
        bound, reported = r.get("max_live"), r.get("servable")
        for count, whose in ((reported, "it reports"), (servable, "its moves leave")):
            if isinstance(bound, int) and isinstance(count, int) and count > bound:
                out.append(Violation("adapter_live", f"engine {engine}: {name}: {count} versions servable ({whose}) "
                                     f"after {event} of v{version}, max {bound}"))  # fmt: skip
                break
    return out


def trace_adapter_moves(events: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Per engine, the adapter moves its answers carried in a refit trace (`result.adapter_moves`
    of its probe, drain and publish calls), in trace order. A move an engine numbered (its table's
    `epoch` and `n`) counts once: an engine reports again what an answer that came too late
    carried, and a caller that did get it may record it twice."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    seen: set[tuple[str, Any, Any]] = set()
    for e in events:
        result = e.get("result")
        moves = result.get("adapter_moves") if isinstance(result, Mapping) else None
        if e.get("kind") != "call" or not isinstance(moves, list):
            continue
        engine = str(e.get("engine"))
        for m in moves:
            if not isinstance(m, Mapping):
                continue
            key = (engine, m.get("epoch"), m.get("n"))
            if key[2] is not None:
                if key in seen:
                    continue
                seen.add(key)
            out.setdefault(engine, []).append(m)
    return out


def check_trace_adapters(events: Sequence[Mapping[str, Any]]) -> list[Violation]:
    """The adapter checks over a refit trace: every engine's reported moves (`check_adapter_records`),
    and each LoRA run's own version (`check_run_loads`)."""
    out: list[Violation] = []
    for engine, moves in trace_adapter_moves(events).items():
        out.extend(check_adapter_records(moves, engine=engine))
    out.extend(check_run_loads(events))
    return out


def check_run_loads(events: Sequence[Mapping[str, Any]]) -> list[Violation]:
    """adapter_moves, per LoRA run whose start is in the trace: the run's own version is staged and
    loaded whole within the run, so an engine's publish of it must follow its stage and complete on
    that engine in the run's own records (a window may begin mid-history, but never mid-way through
    a run it has the start of)."""
    out: list[Violation] = []
    run: Mapping[str, Any] | None = None
    seen: dict[str, set[str]] = {}  # engine -> this run's moves of the run's version so far
    for e in events:
        if e.get("kind") == "run" and e.get("event") == "start":
            adapter = e.get("adapter")
            run = e if isinstance(adapter, Mapping) and isinstance(e.get("version"), int) else None
            seen = {}
            continue
        if run is None or e.get("kind") != "call" or e.get("run") != run.get("run"):
            continue
        result = e.get("result")
        moves = result.get("adapter_moves") if isinstance(result, Mapping) else None
        if not isinstance(moves, list):
            continue
        name, version, engine = run["adapter"].get("name"), run["version"], str(e.get("engine"))
        for m in moves:
            if not isinstance(m, Mapping) or (m.get("adapter"), m.get("adapter_version")) != (name, version):
                continue
            event = str(m.get("event"))
            if event == "stage":
                seen[engine] = {"stage"}
            elif event == "publish" and not {"stage", "complete"} <= seen.get(engine, set()):
                lacking = " and ".join(x for x in ("stage", "complete") if x not in seen.get(engine, set()))
                out.append(Violation("adapter_moves", f"engine {engine}: {name} v{version} published in run "
                                     f"{run.get('run')} with no {lacking} of it on record in that run"))  # fmt: skip
            else:
                seen.setdefault(engine, set()).add(event)
    return out
