"""One monotonic deadline per run: every driver call, lock wait and cleanup step is bounded by it."""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """`budget_s` seconds from `start` on `clock` (time.monotonic unless a test injects one)."""

    def __init__(
        self, budget_s: float, *, clock: Callable[[], float] = time.monotonic, start: float | None = None
    ) -> None:
        if budget_s <= 0:
            raise ValueError(f"a deadline needs a positive budget, got {budget_s}")
        self.budget_s = float(budget_s)
        self.clock = clock
        self.start = clock() if start is None else start

    @property
    def at(self) -> float:
        return self.start + self.budget_s

    def elapsed(self) -> float:
        return self.clock() - self.start

    def remaining(self) -> float:
        return max(0.0, self.at - self.clock())

    def expired(self) -> bool:
        return self.clock() >= self.at

    def extended(self, grace_s: float) -> Deadline:
        """The same deadline plus `grace_s`: the budget must-run cleanup gets after a failure."""
        return Deadline(self.budget_s + grace_s, clock=self.clock, start=self.start)

    def __repr__(self) -> str:
        return f"Deadline(budget_s={self.budget_s}, remaining={self.remaining():.3f})"
