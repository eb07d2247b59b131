"""Manifests once per connection (the reference engine's wire, `refit.reference.server`).

A bucket manifest (hundreds of tensor entries) travels whole only the first time a client sends
it: the client's `ManifestMemo` gives it a key and sends a `ManifestDef`; the engine's `Manifests`
keeps it; later requests carry a `ManifestRef` (the key alone). A client names a key alone only
after a request that defined it was answered (the engine decoded it); an engine refuses a key it
does not hold (`unknown_manifest`). With the runner's plan kept across refits (the same manifest
objects while the trainer sends the same tensors), a refit sends each bucket's index, not its
entries. The classes live here, not in the server module, which runs as `__main__` in an engine
process (its unpickler must find the classes the client pickled).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refit.drivers.base import Payload
from refit.errors import EngineError

MEMO_WINDOW = 512  # a client uses a manifest key alone while it is among its last this many keys (a plan
# has a few hundred buckets at most; a caller that builds a manifest per request gets no hit, so the
# memo keeps at most 2 x MEMO_WINDOW of them alive on each side)
SWAP_DEPTH = 6  # how deep into a request's tuples and lists manifests are looked for (steps, plans)


@dataclass(frozen=True)
class ManifestDef:
    """A manifest sent whole, with the key later requests name it by."""

    key: int
    manifest: Any

    def __reduce__(self) -> tuple[Any, ...]:
        return ManifestDef, (self.key, self.manifest)


@dataclass(frozen=True)
class ManifestRef:
    """A manifest the engine was sent before, named by its key."""

    key: int

    def __reduce__(self) -> tuple[Any, ...]:
        return ManifestRef, (self.key,)


_ATOMS = (int, float, str, bool, bytes, type(None))  # a list starting with one is data (tokens), not calls


def swap(obj: Any, fn: Callable[[Any], Any], kinds: tuple[type, ...], depth: int = 0) -> Any:
    """`obj` with each manifest (or memo entry: `kinds`) in its tuples, lists and payloads replaced
    by `fn(it)`; containers without one are returned as they are (no copy)."""
    kind = type(obj)
    if kind in kinds:
        return fn(obj)
    if kind is Payload:
        manifest = swap(obj.manifest, fn, kinds, depth + 1)
        return obj if manifest is obj.manifest else dataclasses.replace(obj, manifest=manifest)
    if (kind is tuple or (kind is list and obj and type(obj[0]) not in _ATOMS)) and depth < SWAP_DEPTH:
        items = [swap(x, fn, kinds, depth + 1) for x in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return tuple(items) if kind is tuple else items
    return obj


class ManifestMemo:
    """A client's side of the manifest memo: keys for the manifests it sent (kept alive, so an
    object's identity names it), and which of them the engine has acknowledged."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[Any, int]] = {}  # id(manifest) -> (manifest, key)
        self._next = 0
        self._confirmed: set[int] = set()
        self._lock = threading.Lock()

    def out(self, manifest: Any, defined: list[int]) -> ManifestDef | ManifestRef:
        with self._lock:
            kept = self._keys.get(id(manifest))
            if kept is None or self._next - kept[1] > MEMO_WINDOW:  # new, or old enough to be forgotten
                if kept is not None:
                    self._confirmed.discard(kept[1])
                kept = self._keys[id(manifest)] = (manifest, self._next)
                self._next += 1
                if len(self._keys) > 2 * MEMO_WINDOW:
                    floor = self._next - MEMO_WINDOW
                    self._keys = {i: (m, k) for i, (m, k) in self._keys.items() if k >= floor}
                    self._confirmed = {k for k in self._confirmed if k >= floor}
            key = kept[1]
            if key in self._confirmed:
                return ManifestRef(key)
        defined.append(key)
        return ManifestDef(key, manifest)

    def confirm(self, keys: list[int]) -> None:
        """The engine answered a request that defined `keys`: later requests may refer to them."""
        with self._lock:
            self._confirmed.update(keys)


class Manifests:
    """An engine's side of the manifest memo: the manifests its client defined, by key (the last
    2 x MEMO_WINDOW keys: a client never refers to an older one)."""

    def __init__(self) -> None:
        self.by_key: dict[int, Any] = {}

    def into(self, entry: ManifestDef | ManifestRef) -> Any:
        from refit.buckets import BucketManifest

        if type(entry) is ManifestRef:
            manifest = self.by_key.get(entry.key)
            if manifest is None:
                raise EngineError(
                    "unknown_manifest", f"the request names manifest {entry.key!r}, which this engine was not sent"
                )
            return manifest
        if type(entry.key) is not int or type(entry.manifest) is not BucketManifest:
            raise EngineError("bad_payload", "a malformed manifest definition")
        kept = self.by_key.get(entry.key)
        if kept is not None and kept == entry.manifest:
            return kept
        self.by_key[entry.key] = entry.manifest
        if len(self.by_key) > 2 * MEMO_WINDOW:
            for old in sorted(self.by_key)[: len(self.by_key) - 2 * MEMO_WINDOW]:
                del self.by_key[old]
        return entry.manifest
