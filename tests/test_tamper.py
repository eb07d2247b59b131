"""`refit check` is tamper-evident: each class of edit to a real trace (lost, reordered, duplicated or
foreign lines, transitions off the table, an end that disagrees with its calls, versions that do not
follow, an engine's events removed, unpaired memory resumes, an ok call past its budget) is
rejected, naming the invariant and the offending event; an edited outcome, effect or decision that
keeps the trace self-consistent is caught by replaying it through the runner (`decisions`). The
untouched trace passes."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from refit import invariants, protocol
from refit.cli import main
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama
from refit.replay import check_decisions
from refit.trace import load_trace

from .conftest import CONFIG, perturbed

Lines = list[dict]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A colocated trace of six real runs: clean, a corrupted bucket retried, an engine hung on pause
    (dropped as timed out), an engine killed mid-transfer, a clean run after restarting it, and a
    failed bucket with no retry (that engine quarantined)."""
    path = tmp_path_factory.mktemp("tamper") / "real.jsonl"
    engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, mode="colocated", bucket_bytes=64 << 10,
        call_timeout_s=0.5, deadline_s=20.0, trace=path,
    )  # fmt: skip
    plans = [
        (None, 1),
        (protocol.FaultPlan().fail_at("transferring", engine=0, bucket=2, kind="corrupt"), 1),
        (protocol.FaultPlan().fail_at("pausing", engine=1, kind="hang"), 1),
        (protocol.FaultPlan().fail_at("transferring", engine=1, bucket=3, kind="kill"), 1),
        (None, 1),
        (protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, call="load"), 0),
    ]
    try:
        for i, (plan, retries) in enumerate(plans):
            perturbed(model, seed=10 + i)
            ctx.faults, ctx.retries = plan, retries
            protocol.run(ctx)
            assert plan is None or not plan.unfired(), plan
            for j, e in enumerate(list(ctx.engines)):
                if not e.alive:
                    e.close()
                    ctx.engines[j] = engines[j] = ReferenceEngine.in_thread(e.name, CONFIG, seed=0)
                else:
                    e.info(timeout=10.0)  # a hung engine answers again before the next run
    finally:
        ctx.close()
        for e in engines:
            e.close()
    return path


def lines_of(path: Path) -> Lines:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write(path: Path, lines: Lines) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def renumber(lines: Lines) -> Lines:
    """What a careful tamperer does after removing or adding events: make the sequence contiguous."""
    for i, e in enumerate(lines[1:]):
        e["seq"] = i
    return lines


def where(lines: Lines, pred: Callable[[dict], bool], nth: int = 0) -> int:
    return [i for i, e in enumerate(lines) if i > 0 and pred(e)][nth]


def call(event: str, engine: str | None = None, state: str | None = None) -> Callable[[dict], bool]:
    return lambda e: (
        e.get("kind") == "call" and e.get("event") == event
        and (engine is None or e.get("engine") == engine) and (state is None or e.get("state") == state)
    )  # fmt: skip


def ends(lines: Lines) -> list[int]:
    return [i for i, e in enumerate(lines) if e.get("kind") == "run" and e.get("event") == "end"]


def run_ids(lines: Lines) -> list[str]:
    return [e["run"] for e in lines if e.get("kind") == "run" and e.get("event") == "start"]


# ---- the tampers: each takes the real trace's lines and returns an edited copy -------------------


def lose_a_line(ls: Lines) -> Lines:
    del ls[where(ls, call("load"), 3)]
    return ls


def reorder_two_lines(ls: Lines) -> Lines:
    i = where(ls, call("load"), 2)
    ls[i], ls[i + 1] = ls[i + 1], ls[i]
    return ls


def duplicate_a_line(ls: Lines) -> Lines:
    i = where(ls, call("publish"))
    ls.insert(i + 1, copy.deepcopy(ls[i]))
    return ls


def second_header(ls: Lines) -> Lines:
    ls.insert(len(ls) // 2, copy.deepcopy(ls[0]))
    return renumber(ls)


def foreign_run_id(ls: Lines) -> Lines:
    ls[where(ls, call("load"), 5)]["run"] = "0123456789ab"
    return ls


def spliced_trace(ls: Lines) -> Lines:
    """The runs of another trace (here: this one's first run, as if from another job) appended."""
    first = ls[1 : ends(ls)[0] + 1]
    return renumber(ls[:-1] + copy.deepcopy(first) + ls[-1:])


def transition_off_the_table(ls: Lines) -> Lines:
    """A run that skipped INVALIDATING: the invalidate transition removed."""
    del ls[where(ls, lambda e: e.get("kind") == "transition" and e.get("event") == "invalidate")]
    return renumber(ls)


def event_in_another_state(ls: Lines) -> Lines:
    ls[where(ls, call("flush"))]["state"] = "TRANSFERRING"
    return ls


def end_claims_updated(ls: Lines) -> Lines:
    """The hung engine (dropped in run 3) reported updated."""
    end = ls[ends(ls)[2]]
    name = next(n for n, o in end["engine_outcomes"].items() if o["status"] != "updated")
    end["engine_outcomes"][name] = {"status": "updated", "version": end["version"]}
    return ls


def end_drops_an_engine(ls: Lines) -> Lines:
    end = ls[ends(ls)[0]]
    end["engine_outcomes"].pop("e1")
    return ls


def end_hides_the_publish(ls: Lines) -> Lines:
    ls[ends(ls)[0]]["published"] = None
    return ls


def end_unchanged_after_loads(ls: Lines) -> Lines:
    """An engine that took buckets (and published) reported unchanged at its old version."""
    end = ls[ends(ls)[0]]
    end["engine_outcomes"]["e0"] = {"status": "unchanged", "version": end["version"] - 1}
    return ls


def target_skips_back(ls: Lines) -> Lines:
    """Run 4's target version set back to run 2's (every event of the run edited consistently)."""
    run = run_ids(ls)[3]
    for e in ls[1:]:
        if e.get("run") == run:
            e["version"] = e["version"] - 2
    return ls


def previous_version_disagrees(ls: Lines) -> Lines:
    start = next(e for e in ls if e.get("run") == run_ids(ls)[1] and e.get("event") == "start")
    start["previous_version"] += 5
    return ls


def engine_events_removed(ls: Lines) -> Lines:
    run = run_ids(ls)[0]
    ls = [e for e in ls if not (e.get("run") == run and e.get("engine") == "e1")]
    return renumber(ls)


def kv_resume_removed(ls: Lines) -> Lines:
    del ls[where(ls, call("resume_memory", "e0", "RESTORING"))]
    return renumber(ls)


def ok_call_past_budget(ls: Lines) -> Lines:
    e = ls[where(ls, call("load"), 1)]
    e["duration_s"] = e["budget_s"] + 2.0
    return ls


def timed_out_engine_answers(ls: Lines) -> Lines:
    """After e1 was dropped as hung in run 3, a call sent to it later is recorded as answered ok (a
    copy of the other engine's publish, renamed)."""
    run = run_ids(ls)[2]
    drop = where(ls, lambda e: e.get("run") == run and e.get("event") == "dropped")
    name = ls[drop]["engine"]
    i = where(
        ls,
        lambda e: (
            e.get("run") == run and e.get("kind") == "call" and e.get("event") == "publish" and ls.index(e) > drop
        ),
    )
    fake = {**copy.deepcopy(ls[i]), "engine": name}
    ls.insert(i + 1, fake)
    return renumber(ls)


def end_moved_earlier(ls: Lines) -> Lines:
    """Run 1's end moved before its last calls (and the sequence renumbered)."""
    i = ends(ls)[0]
    end = ls.pop(i)
    ls.insert(i - 4, end)
    return renumber(ls)


def second_end(ls: Lines) -> Lines:
    i = ends(ls)[0]
    ls.insert(i + 1, copy.deepcopy(ls[i]))
    return renumber(ls)


def publish_of_another_version(ls: Lines) -> Lines:
    ls[where(ls, call("publish"))]["version"] += 7
    return ls


def trace_end_line_not_last(ls: Lines) -> Lines:
    ls.insert(len(ls) - 3, copy.deepcopy(ls[-1]))
    return renumber(ls)


def failed_load_made_ok(ls: Lines) -> Lines:
    """Run 2's corrupted bucket recorded as acked: the retry that follows no longer follows from it."""
    i = where(ls, lambda e: e.get("kind") == "call" and e.get("event") == "load" and e.get("outcome") == "error")
    ls[i]["outcome"] = "ok"
    ls[i].pop("error", None)
    ls[i].pop("effect", None)
    return ls


def effect_edited(ls: Lines) -> Lines:
    """A bucket the engine refused before any effect recorded as one whose effect is unknown."""
    i = where(ls, lambda e: e.get("kind") == "call" and e.get("effect") == "none")
    del ls[i]["effect"]
    return ls


def effect_added(ls: Lines) -> Lines:
    """The killed engine's failed load (effect unknown) recorded as refused before any effect."""
    died = [i for i, e in enumerate(ls) if e.get("event") == "load" and "EngineDied" in str(e.get("error"))]
    ls[died[0]]["effect"] = "none"
    return ls


def quarantine_made_continue(ls: Lines) -> Lines:
    """Run 6's quarantine of the engine whose bucket failed recorded as a continue."""
    i = where(ls, call("quarantine"))
    ls[i]["event"] = "continue_generation"
    return ls


TAMPERS: dict[str, tuple[Callable[[Lines], Lines], str]] = {
    "lost line": (lose_a_line, "integrity"),
    "reordered lines": (reorder_two_lines, "integrity"),
    "duplicated line": (duplicate_a_line, "integrity"),
    "second header": (second_header, "integrity"),
    "foreign run id": (foreign_run_id, "integrity"),
    "spliced trace": (spliced_trace, "integrity"),
    "transition off the table": (transition_off_the_table, "states"),
    "event in another state": (event_in_another_state, "states"),
    "end claims updated": (end_claims_updated, "outcome"),
    "end drops an engine": (end_drops_an_engine, "outcome"),
    "end hides the publish": (end_hides_the_publish, "version"),
    "end says unchanged after loads": (end_unchanged_after_loads, "outcome"),
    "target skips back": (target_skips_back, "version"),
    "previous version disagrees": (previous_version_disagrees, "version"),
    "engine events removed": (engine_events_removed, "outcome"),
    "KV resume removed": (kv_resume_removed, "outcome"),
    "ok call past its budget": (ok_call_past_budget, "deadline"),
    "timed-out engine answers": (timed_out_engine_answers, "outcome"),
    "end moved earlier": (end_moved_earlier, "integrity"),
    "second end": (second_end, "integrity"),
    "publish of another version": (publish_of_another_version, "integrity"),
    "trace end line not last": (trace_end_line_not_last, "integrity"),
    "failed load made ok": (failed_load_made_ok, "decisions"),
    "effect removed": (effect_edited, "decisions"),
    "effect added": (effect_added, "decisions"),
    "quarantine made a continue": (quarantine_made_continue, "pause_continue"),
}


def violations_of(path: Path) -> list[invariants.Violation]:
    """What `refit check` reports: the invariants, then (when they hold) the replayed decisions."""
    header, events, torn = load_trace(path)
    found = invariants.check_trace(events, torn=torn, header=header, whole=True)
    return found or check_decisions(path)


def test_the_real_trace_passes(real: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert violations_of(real) == []
    assert main(["check", str(real)]) == 0
    assert "every invariant holds" in capsys.readouterr().out


@pytest.mark.parametrize("name", TAMPERS, ids=list(TAMPERS))
def test_a_tampered_trace_is_rejected_naming_the_invariant_and_event(
    name: str, real: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tamper, invariant = TAMPERS[name]
    lines = tamper(lines_of(real))
    assert lines != lines_of(real)
    path = write(tmp_path / "tampered.jsonl", lines)
    found = violations_of(path)
    assert invariant in {v.invariant for v in found}, [str(v) for v in found]
    hit = next(v for v in found if v.invariant == invariant)
    assert hit.seq is not None, str(hit)  # names the offending event
    assert main(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"VIOLATION {invariant}:" in out and "event: {" in out, out
