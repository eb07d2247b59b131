"""Adapter versions on a server that knows only adapter names (SGLang, vLLM): a name per version
("policy@v7", `version_name`), and the driver's account of them (`AdapterMirror`).

`AdapterMirror` is the driver's record of the versions it loaded, published, unloaded or
discarded, kept on the adapter fact table (`refit.states`: STAGING, STAGED, LIVE, RETIRED,
UNLOADED, DISCARDED) and reported as the same self-contained move records the reference engine
gives (`refit.invariants.adapters`), so `refit check` follows such a server's versions too. What
the server itself lists (its `/v1/models`) is folded in at each probe (`sync`): a version the
server lost is unloaded, one found that the mirror never saw is adopted.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any

from refit.states import SERVABLE_ADAPTER, Adapter, AdapterEvent, FactMachine

_NAME = re.compile(r"^(?P<adapter>.+)@v(?P<version>\d+)$")


def version_name(adapter: str, version: int) -> str:
    """The SGLang adapter name of `version` of `adapter` ("policy@v7")."""
    return f"{adapter}@v{int(version)}"


def parse_version_name(name: str) -> tuple[str, int] | None:
    """("policy", 7) from "policy@v7"; None for a name refit did not make."""
    m = _NAME.match(name)
    return (m["adapter"], int(m["version"])) if m else None


class AdapterMirror:
    """The driver's account of its adapters' versions on one server (see the module docstring)."""

    def __init__(self) -> None:
        self.versions: dict[str, dict[int, FactMachine]] = {}
        self.max_live: dict[str, int | None] = {}
        self.moves: list[dict[str, Any]] = []
        self.seq = 0
        self._lock = threading.RLock()  # a publish's two moves, against a request's thread reading `live`
        self.gave_up: dict[str, set[int]] = {}  # versions discarded whose load may still land (a timeout)

    def state(self, adapter: str, version: int) -> Adapter | None:
        m = self.versions.get(adapter, {}).get(version)
        return None if m is None else Adapter(m.state)

    def live(self, adapter: str) -> int | None:
        with self._lock:
            return next((v for v, m in self.versions.get(adapter, {}).items() if m.state == Adapter.LIVE), None)

    def servable(self, adapter: str) -> list[int]:
        return sorted(v for v, m in list(self.versions.get(adapter, {}).items()) if m.state in SERVABLE_ADAPTER)

    def loaded(self, adapter: str) -> list[int]:
        """Versions on the server: staged (loaded, not published) or servable."""
        keep = (Adapter.STAGED, *SERVABLE_ADAPTER)
        return sorted(v for v, m in list(self.versions.get(adapter, {}).items()) if m.state in keep)

    def staged(self, adapter: str) -> int | None:
        pending = (Adapter.STAGING, Adapter.STAGED)
        return next((v for v, m in list(self.versions.get(adapter, {}).items()) if m.state in pending), None)

    def going(self, adapter: str) -> list[int]:
        """The servable versions a publish of the staged one would push past `max_live` (oldest first)."""
        bound, servable = self.max_live.get(adapter), self.servable(adapter)
        return [] if bound is None else servable[: max(0, len(servable) + 1 - bound)]

    def _log(self, adapter: str, version: int, event: str, src: str | None, **fields: Any) -> None:
        self.seq += 1
        m = self.versions[adapter][version]
        self.moves.append({
            "adapter": adapter, "adapter_version": version, "event": event, "src": src, "state": str(m.state),
            "servable": len(self.servable(adapter)), "max_live": self.max_live.get(adapter), "seq": self.seq,
            **fields,
        })  # fmt: skip

    def _move(self, adapter: str, version: int, event: AdapterEvent, **fields: Any) -> None:
        m = self.versions[adapter][version]
        src = str(m.state)
        m.fire(event)
        self._log(adapter, version, str(event), src, **fields)

    def stage(self, adapter: str, version: int, max_live: int | None) -> None:
        with self._lock:
            self.max_live[adapter] = max_live
            self.versions.setdefault(adapter, {})[version] = FactMachine("adapter")
            self._log(adapter, version, "stage", None)

    def complete(self, adapter: str, version: int) -> None:
        with self._lock:
            self._move(adapter, version, AdapterEvent.COMPLETE)

    def publish(self, adapter: str, version: int) -> None:
        """The staged version goes LIVE and the live one before it RETIRED; a reader (`live`, from
        a request's thread) sees one or the other, never neither."""
        with self._lock:
            before = self.live(adapter)
            if before is not None:
                self._move(adapter, before, AdapterEvent.SUPERSEDE)
            self._move(adapter, version, AdapterEvent.PUBLISH)

    def unload(self, adapter: str, version: int, **fields: Any) -> None:
        with self._lock:
            if self.state(adapter, version) == Adapter.LIVE:
                self._move(adapter, version, AdapterEvent.SUPERSEDE, **fields)
            self._move(adapter, version, AdapterEvent.UNLOAD, **fields)
            del self.versions[adapter][version]

    def discard(self, adapter: str, version: int, *, reason: str) -> None:
        with self._lock:
            self._move(adapter, version, AdapterEvent.DISCARD, reason=reason)
            del self.versions[adapter][version]
            self.gave_up.setdefault(adapter, set()).add(version)

    def sync(self, adapter: str, on_server: Iterable[int]) -> None:
        """Fold in the versions the server lists. One never seen here is adopted as retired (a new
        driver over a running server: the server cannot say which one was published, and a loaded
        one may never have been, so none is taken as live: requests naming the adapter wait for
        the next refit's publish; the adopted ones serve only requests already on them and go in
        DRAINING); adoption makes no move record (the first record of an adopted version starts
        there). One this mirror holds loaded that the listing leaves out is not taken as gone on
        its word (a server lists none it is still unloading; a proxy or a partial answer may leave
        any out): it is kept, a live one retired (requests naming the adapter wait for the next
        publish), and the driver unloads it by name when a publish pushes it out."""
        with self._lock:
            found = set(on_server)
            mine = self.versions.setdefault(adapter, {})
            unlisted = [v for v in self.loaded(adapter) if v not in found]
            for v in unlisted:
                if mine[v].state == Adapter.LIVE:
                    self._move(adapter, v, AdapterEvent.SUPERSEDE, reason="not listed by the server")
            found |= set(unlisted)
            for v in [v for v, m in mine.items() if v in found and m.state == Adapter.STAGING]:
                self.complete(adapter, v)  # a load whose answer was lost went in: STAGED, unloaded at the next stage
            for v in sorted(found & self.gave_up.get(adapter, set()) - set(mine)):
                # a load given up on (it did not answer in time) landed after its run: loaded, never
                # published; staged again on the record so the next stage unloads it
                self.stage(adapter, v, self.max_live.get(adapter))
                self.complete(adapter, v)
                self.moves[-1]["reason"] = "its load landed after its run gave up on it"
            for v in sorted(found - set(mine)):
                mine[v] = FactMachine("adapter", Adapter.RETIRED)

    def report(self) -> list[dict[str, Any]]:
        out, self.moves = self.moves, []
        return out

    def describe(self) -> dict[str, dict[int, dict[str, str]]]:
        with self._lock:
            return {a: {v: {"state": str(m.state)} for v, m in vs.items()} for a, vs in self.versions.items() if vs}


__all__ = ["AdapterMirror", "parse_version_name", "version_name"]
