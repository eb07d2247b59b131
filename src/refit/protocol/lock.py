"""The engine lock: one owner token at a time; only the holder may release it.

Acquire never queues: a second refit on the same engines fails at once with RefitBusyError
(the runner raises it). A release by a token that does not hold the lock (a late release from a
run that already lost it) is refused and reported, never obeyed.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


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
