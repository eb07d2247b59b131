"""The engine lock: one owner token at a time; only the holder may release it.

Acquire never queues: a second refit on the same engines fails at once with RefitBusyError
(the runner raises it). A release by a token that does not hold the lock (a late release from a
run that already lost it) is refused and reported, never obeyed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from refit.drivers.base import outcome_of
from refit.errors import DeadlineExceeded, RefitBusyError
from refit.protocol.answers import wrap_error
from refit.protocol.deadline import Deadline


class EngineLock(Protocol):
    """What the runner needs from a lock; a Ray-actor lock implements the same two calls."""

    def acquire(self, owner: str) -> bool:
        """Take the lock for `owner`; True if taken (or already held by `owner`), False if busy."""
        ...

    def release(self, owner: str) -> bool:
        """Release if `owner` holds it; False (and no effect) otherwise."""
        ...

    @property
    def holder(self) -> str | None: ...


class LocalLock:
    """An owner-token lock for engines driven from one process."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._holder: str | None = None
        self._acquisitions = 0

    def acquire(self, owner: str) -> bool:
        with self._mutex:
            if self._holder is None or self._holder == owner:
                self._holder = owner
                self._acquisitions += 1
                return True
            return False

    @property
    def acquisitions(self) -> int:
        """How many times the lock was taken: a run that sees it one above what it saw at its
        previous run knows no other run refit these engines in between (optional for locks)."""
        return self._acquisitions

    def release(self, owner: str) -> bool:
        with self._mutex:
            if self._holder != owner:
                return False
            self._holder = None
            return True

    @property
    def holder(self) -> str | None:
        return self._holder


_REGISTRY: weakref.WeakValueDictionary[tuple[str, ...], LocalLock] = weakref.WeakValueDictionary()
_REGISTRY_MUTEX = threading.Lock()


def lock_for(engine_names: tuple[str, ...]) -> LocalLock:
    """The process-wide lock of this set of engines: two contexts over the same engines share it."""
    key = tuple(sorted(engine_names))
    with _REGISTRY_MUTEX:
        lock = _REGISTRY.get(key)
        if lock is None:
            lock = LocalLock()
            _REGISTRY[key] = lock
        return lock


def take_for_run(r: Any) -> None:
    """Take the engines' lock with the run's owner token, both lock calls within one short budget."""
    lock = r.ctx.lock
    if lock is None:
        raise RuntimeError("RefitContext has no lock")
    lock_deadline = Deadline(max(r.budget.short(), 1e-3), clock=time.monotonic)
    acquire: Any = None
    try:
        holder = within(on_thread(lambda: lock.holder), lock_deadline.remaining(), "reading the lock holder")
        acquire = on_thread(lambda: lock.acquire(r.owner))
        acquired = within(acquire, lock_deadline.remaining(), "acquiring the engines' lock")
    except Exception as exc:
        if acquire is not None and not acquire.done():  # it may still take the lock: give it back then
            acquire.add_done_callback(lambda f: f.exception() is None and f.result() and lock.release(r.owner))
        r.emit("lock", "acquire", owner=r.owner, outcome=outcome_of(exc), error=str(exc))
        r.emit("run", "end", result="lock_error")
        raise wrap_error(exc, "lock.acquire", "IDLE", None, None) from exc
    if not acquired:
        r.emit("lock", "acquire", owner=r.owner, outcome="busy", holder=holder)
        r.emit("run", "end", result="busy")
        raise RefitBusyError(f"engines {[e.name for e in r.engines]} are being refit by another run", state="IDLE")
    # optional: lets a steady-state run know nobody refit in between. Looked up on the class: on a
    # remote lock the attribute is a call (hasattr would make it outside this bound and this guard)
    if getattr(type(lock), "acquisitions", None) is not None:
        with contextlib.suppress(Exception):
            r.lock_taken = int(within(on_thread(lambda: lock.acquisitions), lock_deadline.remaining(), "the lock"))
    r.emit("lock", "acquire", owner=r.owner, outcome="ok", holder=holder, taken=r.lock_taken)


def release_for_run(r: Any) -> None:
    """Give the lock back (bounded by the cleanup budget); the outcome is recorded, never raised."""
    lock = r.ctx.lock
    assert lock is not None
    try:
        released = within(on_thread(lambda: lock.release(r.owner)), r.budget.release(), "lock release")
        r.emit("lock", "release", owner=r.owner, outcome="ok" if released else "not_owner", holder=r.owner)
    except Exception as exc:  # recorded; the run's end is still written and the context stays usable
        r.emit("lock", "release", owner=r.owner, outcome=outcome_of(exc), error=f"{type(exc).__name__}: {exc}")


def on_thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run `fn` on a thread of its own (a stuck lock service cannot starve anything else)."""
    fut: Future[Any] = Future()

    def call() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=call, name="refit-lock", daemon=True).start()
    return fut


def within(fut: Future[Any], budget: float, what: str) -> Any:
    """`fut`'s value, waiting at most `budget`; DeadlineExceeded naming `what` otherwise."""
    try:
        return fut.result(timeout=max(budget, 0.0))
    except concurrent.futures.TimeoutError:
        if fut.done():
            raise
        raise DeadlineExceeded(f"{what} did not return within {budget:.3g}s") from None
