"""What `refit doctor` decides, as data and pure functions (no I/O): the answer to one read, a
finding, a verdict per refit mode. Each driver module's `diagnose` turns a server's answers into
findings and verdicts; `refit.doctor` does the reads and the printing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    """One GET's outcome: an HTTP status and its decoded body, or `error` (no answer)."""

    status: int | None
    data: Any = None
    error: str | None = None


@dataclass(frozen=True)
class Finding:
    """One thing checked: `status` ok, warn (works, with a caveat) or fail; `fix` what to change."""

    check: str
    status: str
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Verdict:
    """Whether refit can run `mode` over `transport` against this server, why not, and the fix."""

    mode: str
    transport: str
    works: bool
    why: str = ""
    fix: str | None = None


def verdicts(
    modes: list[tuple[str, str]], findings: list[Finding], extra: dict[str, str] | None = None
) -> list[Verdict]:
    """Each (mode, transport): works unless a check failed (every failed check blocks every mode),
    or `extra` names what blocks that mode alone; why not, and the fixes of what failed."""
    failed = [f for f in findings if f.status == "fail"]
    fixes = list(dict.fromkeys(f.fix for f in failed if f.fix))
    out = []
    for mode, transport in modes:
        why = "; ".join([f.detail for f in failed] + ([extra[mode]] if extra and extra.get(mode) else []))
        out.append(Verdict(mode, transport, not why, why, "; ".join(fixes) or None if why else None))
    return out


__all__ = ["Answer", "Finding", "Verdict", "verdicts"]
