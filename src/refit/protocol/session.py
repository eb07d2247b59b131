"""What lasts across runs of one context: its connection (the transport's groups and buffers, the
engines attached to it). `disconnect` is the one way it ends: every engine detaches, every trainer
rank disconnects, best effort, bounded, recorded. (The rest of the session, now in
`RefitContext`'s shared state, moves here with issue 20.)"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

from refit.drivers.base import Step, outcome_of
from refit.protocol.answers import SLACK_S, first_result
from refit.protocol.ranks import RankStep

if TYPE_CHECKING:
    from refit.protocol.context import RefitContext


def disconnect(ctx: RefitContext, *, timeout: float, run: Any = None) -> None:
    """Engines detach, every trainer rank disconnects; best effort, bounded, recorded."""
    shared = ctx._shared
    if not ctx.transport_connected and shared.connection_key is None:
        return
    attached = list(ctx.engines)  # every engine: detaching one that is not attached changes nothing
    shared.connection_key, shared.attached = None, set()
    emit = run.emit if run is not None else ctx.recorder.emit
    clock = ctx.clock
    budget = max(timeout, 0.05)
    futures = [
        (d, d.run_steps_async([Step("detach", "IDLE")], timeout=budget, executor=ctx.lane(d.name)), clock())
        for d in attached
    ]
    concurrent.futures.wait([f for _, f, _ in futures], timeout=budget + SLACK_S)
    for d, fut, t0 in futures:
        res = first_result(fut, budget)
        emit(
            "call", "detach", side="engine", engine=d.name, outcome=res.outcome, duration_s=round(clock() - t0, 6),
            error=None if res.error is None else f"{type(res.error).__name__}: {res.error}",
        )  # fmt: skip
    t0 = clock()
    outcome, error = "ok", None
    assert ctx.ranks is not None
    try:
        ctx.ranks.start(RankStep("disconnect", "IDLE"), timeout=budget).result(timeout=budget + SLACK_S)
    except Exception as exc:
        outcome, error = outcome_of(exc), f"{type(exc).__name__}: {exc}"
    emit("call", "disconnect", side="transport", outcome=outcome, duration_s=round(clock() - t0, 6), error=error)
