"""How a run ends: the session learns what the run left behind, the run's end is recorded, and
the result is assembled from the ledger (errors as data: a failed engine is named, with its
cause)."""

from __future__ import annotations

from typing import Any

from refit.errors import DriverCallError
from refit.protocol.context import EngineOutcome, RefitResult
from refit.states import RefitState


def finish(r: Any) -> tuple[dict[str, EngineOutcome], float]:
    """After the lock is released (always runs): the session takes the run's versions,
    incarnations and lock count; the run's end is recorded. Returns the outcomes and the time."""
    ctx, session, ledger = r.ctx, r.session, r.ledger
    session.next_version = r.version + 1
    outcomes = ledger.outcomes(colocated=ctx.colocated)
    published = r.version if any(e.published for e in ledger.engines) else None
    if published is not None:
        session.version = published
    session.engine_versions.update({name: o.version for name, o in outcomes.items()})
    session.incarnations.update({e.name: e.incarnation for e in ledger.engines})
    session.lock_taken = r.lock_taken
    now = ctx.clock()
    state = str(r.machine.state)
    r.phase_seconds[state] = r.phase_seconds.get(state, 0.0) + now - r._phase_t0
    r.emit(
        "run", "end", result=state, published=published,
        engine_outcomes={n: {"status": o.status, "version": o.version} for n, o in outcomes.items()},
        error=None if r.error is None else str(r.error), round_trips=r.waves.round_trips,
    )  # fmt: skip
    return outcomes, now


def assemble(r: Any, outcomes: dict[str, EngineOutcome], t0: float, now: float, stats: list[Any]) -> RefitResult:
    """The run's result; a run that ended DONE with engines that did not take the version reports
    them in one error naming the first and its cause."""
    ctx, ledger = r.ctx, r.ledger
    failed = [o for o in outcomes.values() if o.status != "updated"]
    error = r.error
    if error is None and failed:
        first = next(e for e in ledger.engines if e.name == failed[0].name)
        cause = first.exc
        error = DriverCallError(
            f"{len(failed)} of {len(outcomes)} engines did not take version {r.version} "
            f"({', '.join(f'{o.name} {o.status}' for o in failed)})"
            + (f": {cause.message}" if cause is not None else ""),
            cause=cause,
            state=cause.state if cause is not None else first.failed_in,
            engine=first.name,
            call=cause.call if cause is not None else None,
            bucket=cause.bucket if cause is not None else None,
        )
    result = RefitResult(
        run_id=r.run_id,
        ok=r.machine.state == RefitState.DONE and not failed,
        state=str(r.machine.state),
        version=r.version if any(e.published for e in ledger.engines) else None,
        previous_version=r.previous_version,
        engines=outcomes,
        phase_seconds={k: round(v, 6) for k, v in r.phase_seconds.items()},
        seconds=round(now - t0, 6),
        bytes_moved=r.bytes_moved,
        bytes_delivered=sum(e.bytes_ok for e in ledger.engines),
        buckets=len(r.plan),
        trace_path=str(ctx.recorder.path) if ctx.recorder.path else None,
        error=error,
        round_trips=r.waves.round_trips,
        ranks=ctx.ranks.world if ctx.ranks else 1,
        trainer_peak_bytes=max((getattr(s, "peak_bytes", 0) for s in stats or []), default=0),
        past_deadline_s=round(max(0.0, now - t0 - ctx.deadline_s), 6),
    )
    result.rank_stats = stats or []  # type: ignore[attr-defined]
    return result
