"""Structured traces: one JSON line per transition and per driver call, written through structlog.

Line 1 is a header (schema, package versions, configuration). Every later line is an event with
`seq` (0, 1, 2, ... across the file), `t` (seconds since the trace began), `run` (the run's id),
`state` (the run's state when the event happened), `version` (the version the run refits to),
`kind` and `event`:
  run/start, run/end     configuration, owner token, deadline; the end says the final state, the
                         version `published` (or null) and each engine's status and version
  lock/acquire|release   owner token and outcome (ok, busy, not_owner)
  transition/<trigger>   `src` and `dst` states (and `bucket` in the bucket loop)
  plan/buckets           how many buckets, tensors and bytes the run will move
  call/<driver call>     `side` (engine, source, transport), `engine`, `bucket`, `outcome`
                         (ok / error / timeout), `duration_s`, `error`, `effect: "none"` when
                         the engine refused the call before changing anything, small `result` dicts;
                         `pack` calls carry the bucket's manifest (names, dtypes, shapes, bytes)
  fault/injected         a planned fault that fired
Tensors are never stored.

A trace that was closed ends with ``{"kind": "trace", "event": "end"}``; one without that line,
or with a run that has no ``end`` event, was cut off, and `refit check` says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

import structlog

SCHEMA = 1
_FIRST = ("seq", "t", "run", "state", "kind", "event")


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("refit-engine", "torch", "transitions", "structlog"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def _canonical_order(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    ordered = {k: event_dict.pop(k) for k in _FIRST if k in event_dict}
    ordered.update(event_dict)
    return ordered


class TraceRecorder:
    """Keeps the most recent `max_events` events in memory (for live checks; the runner keeps
    each run's own events separately) and, given a path, appends every event as a JSON line and
    flushes it, so a crashed job leaves a readable prefix and a long job a complete file."""

    def __init__(
        self,
        path: str | Path | None = None,
        *,
        config: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_events: int = 10_000,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._clock = clock
        self._t0 = clock()
        self._seq = 0
        self._lock = threading.Lock()
        self._file: io.TextIOBase | None = None
        self._log: Any = None
        self.closed = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
            self._log = structlog.wrap_logger(
                structlog.WriteLogger(self._file),
                processors=[
                    _canonical_order,
                    structlog.processors.JSONRenderer(sort_keys=False, default=str),
                ],
            )
        self.header = {
            "kind": "header",
            "event": "trace",
            "schema": SCHEMA,
            "versions": _versions(),
            "config": config or {},
        }
        self._write(self.header)

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is not None:
            fields = dict(record)
            event = fields.pop("event")
            self._log.msg(event, **fields)

    def emit(self, kind: str, event: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            record: dict[str, Any] = {
                "seq": self._seq,
                "t": round(self._clock() - self._t0, 6),
                "kind": kind,
                "event": event,
            }
            record.update((k, v) for k, v in fields.items() if v is not None)
            self._seq += 1
            self.events.append(record)
            self._write(record)
            return record

    def close(self) -> None:
        """Mark the trace complete and close its file. Idempotent."""
        if self.closed:
            return
        self.emit("trace", "end")
        self.closed = True
        if self._file is not None:
            self._file.close()


def load_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], bool]:
    """(header, events, torn) from a JSONL trace; `torn` is True when the last line was cut mid-way."""
    header: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    torn = False
    with Path(path).open(encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # only the last line may be torn
                torn = True
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        if record.get("kind") == "header" and not header and not events:
            header = record
        else:
            events.append(record)
    return header, events, torn


def runs(events: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Events grouped by run id, in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("run") is not None:
            out.setdefault(e["run"], []).append(e)
    return out


def write_events(path: str | Path, header: dict[str, Any], events: Iterable[dict[str, Any]]) -> None:
    """Write a trace from records (used to build fixtures and truncated copies)."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for record in [header, *events]:
            fh.write(json.dumps(record, default=str) + "\n")


__all__ = ["SCHEMA", "TraceRecorder", "load_trace", "runs", "write_events"]
