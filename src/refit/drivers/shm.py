"""CPU shared-memory transport: buckets travel through files in /dev/shm mapped by both sides.

Lifecycle (every trainer rank has its own instance; the topology says which engine TP rank reads
which trainer rank's files: colocated, the rank on its own device; disaggregated, rank 0):
  CONNECTING     each rank that feeds an engine creates `slots` buffer files
                 (``refit-<pid>-<token>-<n>``) sized to the largest ordinary bucket and maps them
                 once; a rank that feeds nobody creates none (it only drains). Each engine TP rank
                 maps the files of the rank that feeds it, once, in `SharedMemoryReceiver`.
  TRANSFERRING   `pack` gathers/copies a bucket into a free slot and hashes each tensor's bytes
                 while they are in cache (xxHash3, no second pass); the part names the file and
                 carries the hash. An oversized bucket (one tensor larger than a bucket) gets a
                 file of its own, unlinked once released, instead of enlarging every slot. The
                 engine copies out of zero-copy views and returns (the ack). `release` frees the
                 slot only after every engine acked; `abandon` leaves a slot an engine never
                 answered for alone and maps a new file in its place.
  disconnect     unlink the files and drop the mappings; engines `close` theirs. A file unlinked
                 while an engine still maps it stays valid for that engine (POSIX), so an
                 abandoned slot never turns into a dangling read.

Files are unlinked on `disconnect`, when the transport is garbage-collected and at interpreter
exit; `leaked_segments()` lists what is left (the soak benchmark counts it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refit.drivers.base import ConnectInfo, LazyTensors, Payload, Receiver, Topology, Transport
from refit.drivers.buckets import BucketManifest, checksum, pack_into, slot_bytes, unpack

if TYPE_CHECKING:
    import torch

PREFIX = "refit-"


def _default_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def leaked_segments(directory: Path | None = None, pid: int | None = None) -> list[Path]:
    """Buffer files left behind (by this process when `pid` is given)."""
    d = directory or _default_dir()
    stem = f"{PREFIX}{pid}-" if pid is not None else PREFIX
    return sorted(p for p in d.glob(f"{stem}*") if p.is_file())


def _unlink_all(paths: Sequence[str]) -> None:
    for p in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def _map(path: str, size: int) -> torch.Tensor:
    import torch

    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


class SharedMemoryTransport(Transport):
    kind = "shm"

    def __init__(self, slots: int = 2, directory: str | Path | None = None, *, checksums: bool = True) -> None:
        """`checksums`: put each bucket's xxHash3 in its part so the engine can detect damaged
        bytes (hashed while packing; turn off when the link is trusted)."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        self.slots = slots
        self.checksums = checksums
        self.directory = Path(directory) if directory else _default_dir()
        self.temp_bytes = 0
        self._feeds = False
        self._buffers: list[torch.Tensor] = []
        self._paths: list[str] = []
        self._busy: list[int | None] = []  # bucket index occupying each slot
        self._own: dict[int, tuple[str, torch.Tensor]] = {}  # oversized buckets in flight
        self._all_paths: list[str] = []  # every file made for this connection (abandoned ones too)
        self._slot_bytes = 0
        self._token = ""
        self._finalizer: weakref.finalize | None = None

    @property
    def connected(self) -> bool:
        return self._finalizer is not None

    @property
    def buffer_bytes(self) -> int:
        return len(self._buffers) * self._slot_bytes + sum(int(t.numel()) for _, t in self._own.values())

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        self.disconnect()
        self._token = secrets.token_hex(4)
        self._finalizer = weakref.finalize(self, _unlink_all, self._all_paths)
        self._feeds = self.feeds(topology, rank)
        self._slot_bytes = slot_bytes(plan) if self._feeds else 0
        if self._feeds:
            for _ in range(self.slots):
                self._paths.append(self._new_file(self._slot_bytes))
                self._busy.append(None)
            self._buffers = [_map(p, self._slot_bytes) for p in self._paths]
        return {"rank": rank, "paths": list(self._paths), "slot_bytes": self._slot_bytes}

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        receiver = f"{__name__}:SharedMemoryReceiver"
        return {
            e.name: ConnectInfo(
                self.kind, receiver, parts=tuple(rank_infos[self.route(topology, e, j)] for j in range(e.tp))
            )
            for e in topology.engines
        }

    def _new_file(self, size: int) -> str:
        path = str(self.directory / f"{PREFIX}{os.getpid()}-{self._token}-{len(self._all_paths)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
        finally:
            os.close(fd)
        self._all_paths.append(path)
        return path

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        if not self.connected:
            raise RuntimeError("shm transport: pack() before connect()")
        if not self._feeds:  # this rank feeds no engine: it makes the same gathers and keeps nothing
            self.temp_bytes = pack_into(None, manifest, tensors).temp_bytes
            return None
        if manifest.oversized:
            path = self._new_file(manifest.nbytes)
            buffer = _map(path, manifest.nbytes)
            self._own[manifest.index] = (path, buffer)
            part: dict[str, Any] = {"path": path, "size": manifest.nbytes, "once": True}
        else:
            try:
                slot = self._busy.index(None)
            except ValueError:
                raise RuntimeError(
                    f"shm transport: no free buffer for bucket {manifest.index}; buckets "
                    f"{self._busy} are still waiting for their acknowledgements"
                ) from None
            buffer = self._buffers[slot]
            self._busy[slot] = manifest.index
            part = {"path": self._paths[slot], "size": self._slot_bytes}
        try:
            packed = pack_into(buffer, manifest, tensors, hash_bytes=self.checksums)
        except BaseException:
            self.release(manifest.index)
            raise
        self.temp_bytes = packed.temp_bytes
        if packed.checksum is not None:
            part["xxh3"] = packed.checksum
        return part

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        out = {}
        for e in topology.engines:
            mine = tuple(parts[self.route(topology, e, j)] for j in range(e.tp))
            if any(p is None for p in mine):
                raise RuntimeError(f"shm transport: no trainer rank packed bucket {manifest.index} for {e.name}")
            out[e.name] = Payload(self.kind, manifest, parts=mine)  # type: ignore[arg-type]
        return out

    def _slot_of(self, index: int) -> int:
        try:
            return self._busy.index(index)
        except ValueError:
            raise RuntimeError(f"shm transport: no buffer holds bucket {index} (slots hold {self._busy})") from None

    def release(self, index: int) -> None:
        if not self._feeds:
            return
        own = self._own.pop(index, None)
        if own is not None:
            _unlink_all([own[0]])
            return
        self._busy[self._slot_of(index)] = None

    def abandon(self, index: int) -> None:
        if not self._feeds:
            return
        if self._own.pop(index, None) is not None:
            return  # its file stays linked until disconnect: an engine may still read it
        slot = self._slot_of(index)
        self._paths[slot] = self._new_file(self._slot_bytes)  # the old file stays until disconnect
        self._buffers[slot] = _map(self._paths[slot], self._slot_bytes)
        self._busy[slot] = None

    def disconnect(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlinks the files exactly once
            self._finalizer = None
        self._buffers, self._paths, self._busy, self._own, self._all_paths = [], [], [], {}, []


class SharedMemoryReceiver(Receiver):
    """Engine side (one per engine TP rank): maps its trainer rank's slots once, returns views."""

    def __init__(self, info: ConnectInfo, tp_rank: int = 0) -> None:
        super().__init__(info, tp_rank)
        self._size = int(self.part.get("slot_bytes", 0))
        self._buffers: dict[str, torch.Tensor] = {p: self._map(p, self._size) for p in self.part.get("paths", [])}

    @staticmethod
    def _map(path: str, size: int) -> torch.Tensor:
        if not isinstance(path, str) or not Path(path).name.startswith(PREFIX):
            raise ValueError(f"payload names buffer {path!r}, not a refit shared-memory buffer")
        actual = os.path.getsize(path)  # FileNotFoundError names the path if it is gone
        if actual < size:
            raise ValueError(f"shm buffer {path} has {actual} bytes, expected {size}")
        return _map(path, size)

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        part = payload.parts[self.tp_rank]
        path = part.get("path")
        if part.get("once"):  # an oversized bucket's own file: mapped for this bucket only
            return unpack(self._map(path, int(part["size"])), payload.manifest)
        if path not in self._buffers:  # a replacement for an abandoned slot: mapped once
            self._buffers[path] = self._map(path, self._size)
        return unpack(self._buffers[path], payload.manifest)

    def verify(self, payload: Payload, tensors: list[tuple[str, torch.Tensor]]) -> None:
        expected = payload.parts[self.tp_rank].get("xxh3")
        if expected is not None and checksum(tensors) != expected:
            raise ValueError(f"bucket {payload.manifest.index}: checksum mismatch, the bytes changed in transit")

    def close(self) -> None:
        self._buffers = {}
