"""The session: what lasts across runs of one context.

Versions (the last published, the next to publish, the version each engine was left at), the
incarnation last seen per engine, the lock's acquisition count, each engine's call lane, and the
transport's connection: its key (members, plan, mode, storage epochs), the incarnations attached
to it, its topology, and whether it may be reused (the connection table in `refit.states`).

Every disconnect goes through `Session.tear_down` (the session forgets the connection): inside a
run the runner detaches engines and disconnects ranks through its waves (recorded as that run's
calls); outside a run `disconnect` does it for the context.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from refit.drivers.base import Step, outcome_of
from refit.protocol.answers import SLACK_S, first_result
from refit.protocol.ranks import RankStep
from refit.states import Connection, ConnectionEvent, FactMachine

if TYPE_CHECKING:
    from refit.protocol.context import RefitContext


@dataclass
class Session:
    """What consecutive runs of one context share."""

    version: int  # the last version a run published (or the context's initial one)
    next_version: int
    connection: FactMachine = field(default_factory=lambda: FactMachine("connection"))
    connection_key: tuple[Any, ...] | None = None
    attached: set[str] = field(default_factory=set)  # incarnations attached to the open connection
    topology: Any = None  # the open connection's Topology
    engine_versions: dict[str, int | None] = field(default_factory=dict)  # None: stale, must not serve
    incarnations: dict[str, str] = field(default_factory=dict)  # last incarnation seen per engine name
    lock_taken: int | None = None  # the lock's acquisition count at the last run (None: unknown)
    lanes: dict[str, concurrent.futures.ThreadPoolExecutor] = field(default_factory=dict)  # per engine name
    in_use: threading.Lock = field(default_factory=threading.Lock)  # held by a run (leader) while it runs
    planned: tuple[Any, ...] | None = None  # (transport, bucket bytes, metas, plan) of the last run

    def plan_for(self, transport: Any, bucket_bytes: int, metas: Sequence[Any]) -> list[Any]:
        """The transport's plan for `metas`: the last run's very manifests while the trainer sends
        the same tensors (names, dtypes, shapes, order) through the same transport, so what an
        engine checked once is recognised by identity (engines keep them by key: the wire's memo)."""
        key = tuple((m, m.heads) for m in metas)  # (a meta's head count is not part of its equality)
        if not key:  # a source that names no tensors (a replay's: its transport reads each run's plan)
            return transport.plan(metas, bucket_bytes)
        kept = self.planned
        if kept is not None and kept[0] is transport and kept[1] == bucket_bytes and kept[2] == key:
            return list(kept[3])
        plan = transport.plan(metas, bucket_bytes)
        self.planned = (transport, bucket_bytes, key, tuple(plan))
        return plan

    @property
    def closed(self) -> bool:
        return self.connection.state == Connection.CLOSED

    def lane(self, engine: str) -> concurrent.futures.ThreadPoolExecutor:
        lane = self.lanes.get(engine)
        if lane is None:
            lane = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"refit-call-{engine}")
            self.lanes[engine] = lane
        return lane

    def reusable(self, key: tuple[Any, ...], connected: bool, incarnations: Sequence[str]) -> bool:
        """Whether the open connection serves a run whose connection key is `key`."""
        return self.connection_key == key and connected and self.attached >= set(incarnations)

    def has_connection(self, connected: bool) -> bool:
        return connected or self.connection_key is not None

    def building(self) -> None:
        self.connection.fire(ConnectionEvent.BUILD)

    def formed(self, key: tuple[Any, ...], topology: Any) -> None:
        self.connection_key, self.topology = key, topology
        self.connection.fire(ConnectionEvent.FORM)

    def tear_down(self) -> None:
        """The session's side of every disconnect: the connection is forgotten."""
        self.connection_key, self.attached = None, set()
        self.connection.fire(ConnectionEvent.TEAR_DOWN)

    def close(self) -> None:
        self.connection.fire(ConnectionEvent.CLOSE)
        for lane in self.lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)


def disconnect(ctx: RefitContext, *, timeout: float) -> None:
    """Outside a run: engines detach, every trainer rank disconnects; best effort, bounded,
    recorded."""
    session = ctx.session
    if not session.has_connection(ctx.transport_connected):
        return
    attached = list(ctx.engines)  # every engine: detaching one that is not attached changes nothing
    session.tear_down()
    emit = ctx.recorder.emit
    clock = ctx.clock
    budget = max(timeout, 0.05)
    futures = [(d, _detach(d, budget, session.lane(d.name)), clock()) for d in attached]
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


def _detach(driver: Any, budget: float, lane: concurrent.futures.Executor) -> Future[Any]:
    """A detach call; a driver that raises instead of answering is recorded as that failure."""
    try:
        return driver.run_steps_async([Step("detach", "IDLE")], timeout=budget, executor=lane)
    except Exception as exc:
        fut: Future[Any] = Future()
        fut.set_exception(exc)
        return fut
