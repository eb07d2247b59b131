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


class NotATrace(ValueError):
    """The file is not a refit trace (empty, header only, binary, not JSON lines, or lines of the
    wrong shape); the message names the reason and, where there is one, the line number."""


_NUMBER = (int, float)
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "seq": ((int,), "an integer"),
    "t": (_NUMBER, "a number"),
    "kind": ((str,), "a string"),
    "event": ((str,), "a string"),
    "run": ((str,), "a string"),
    "state": ((str,), "a string"),
    "engine": ((str,), "a string"),
    "side": ((str,), "a string"),
    "outcome": ((str,), "a string"),
    "owner": ((str,), "a string"),
    "bucket": ((int,), "an integer"),
    "version": ((int,), "an integer"),
    "previous_version": ((int,), "an integer"),
    "published": ((int,), "an integer"),
    "attempt": ((int,), "an integer"),
    "batch": ((int,), "an integer"),
    "buckets": ((int,), "an integer"),
    "duration_s": (_NUMBER, "a number"),
    "budget_s": (_NUMBER, "a number"),
    "deadline_s": (_NUMBER, "a number"),
    "cleanup_grace_s": (_NUMBER, "a number"),
    "max_staleness": ((int,), "an integer"),
    "engines": ((list,), "a list"),
    "engine_outcomes": ((dict,), "an object"),
    "result": ((dict, str), "an object"),
}
_REQUIRED = ("seq", "t", "kind", "event")
_JSON_TYPE = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _check_line(record: Any, n: int) -> dict[str, Any]:
    """The line's record, or NotATrace naming line `n` and the field that is wrong."""
    if not isinstance(record, dict):
        what = "null" if record is None else _JSON_TYPE.get(type(record), type(record).__name__)
        raise NotATrace(f"line {n} is {what}, not a JSON object (an event)")
    for key in _REQUIRED:
        if key not in record:
            raise NotATrace(f"line {n} has no {key!r} field: not a trace event")
    for key, value in record.items():
        spec = _FIELD_TYPES.get(key)
        if spec is None or value is None:
            continue
        types, name = spec
        if isinstance(value, bool) or not isinstance(value, types):
            raise NotATrace(f"line {n}: field {key!r} is {json.dumps(value)[:40]}, expected {name}")
    return record


def load_trace(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]], bool]:
    """(header, events, torn) from a JSONL trace; `torn` is True when the last line was cut mid-way.

    Raises NotATrace when the file cannot be a refit trace: empty, not UTF-8 text, a first line
    that is not a trace header, a header and nothing else, a line (other than a torn last one)
    that is not JSON, not a JSON object, or has a field of the wrong type. A second header inside
    the file is kept as an event: `refit check` reports it as tampering."""
    raw = Path(path).read_bytes()
    if not raw.strip():
        raise NotATrace("the file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotATrace(f"the file is not UTF-8 text (binary?): byte {exc.start} is {raw[exc.start]:#04x}") from None
    if "\x00" in text:
        raise NotATrace("the file contains NUL bytes (binary?)")
    lines = text.split("\n")
    last = max(i for i, line in enumerate(lines) if line.strip())
    header: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    torn = False
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == last and header:  # only the last line may be torn (the job died writing it)
                torn = True
                break
            raise NotATrace(f"line {i + 1} is not JSON: {line[:60]!r}") from None
        if not header:
            if not (isinstance(record, dict) and record.get("kind") == "header" and record.get("event") == "trace"):
                raise NotATrace(f"line {i + 1} is not a refit trace header (kind 'header', event 'trace')")
            if record.get("schema") != SCHEMA:
                raise NotATrace(f"line {i + 1}: trace schema {record.get('schema')!r}, this refit reads {SCHEMA}")
            header = record
            continue
        if isinstance(record, dict) and record.get("kind") == "header":
            events.append(record)  # a second header: tampering, for `refit check` to report
            continue
        events.append(_check_line(record, i + 1))
    if not events:
        raise NotATrace("it has a header but no events" + (" (its only event line is cut off)" if torn else ""))
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


__all__ = ["SCHEMA", "NotATrace", "TraceRecorder", "load_trace", "runs", "write_events"]
