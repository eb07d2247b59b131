"""What every invariant module shares: the event type and the violation it reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str
    seq: int | None = None
    run: str | None = None

    def __str__(self) -> str:
        if self.seq is not None:
            where = f" (run {self.run}, event seq {self.seq})"
        else:
            where = f" (run {self.run})" if self.run else ""
        return f"{self.invariant}: {self.message}{where}"
