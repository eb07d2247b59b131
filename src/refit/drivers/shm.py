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

Zero-copy. `share_memory(model)` moves a trainer's weights into one shared-memory arena once (its
parameters keep training in place there). Each engine TP rank maps the arenas of the rank that
feeds it at attach; a tensor that still lies in an arena is then sent as a reference, not copied
(the trainer only hashes it), so a refit costs the engine's one copy. A tensor the trainer has
since reallocated elsewhere is simply copied: a stale reference cannot happen.

Files are unlinked on `disconnect`, when the transport is garbage-collected and at interpreter
exit; `leaked_segments()` lists what is left (the soak benchmark counts it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refit.buckets import (
    BucketManifest,
    chunk_digests,
    itemsize,
    pack_into,
    slot_bytes,
    tensor_identity,
    torch_dtype,
    unpack,
)
from refit.drivers.base import ConnectInfo, LazyTensors, Payload, Receiver, Topology, Transport, routed_payloads
from refit.drivers.slots import SlotPool

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


def _new_file(directory: Path, token: str, made: list[str], size: int) -> str:
    """A new buffer file of `size` bytes, numbered and recorded in `made` (a connection's files)."""
    path = str(directory / f"{PREFIX}{os.getpid()}-{token}-{len(made)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
    finally:
        os.close(fd)
    made.append(path)
    return path


def _new_slot(directory: Path, token: str, made: list[str], size: int) -> tuple[str, torch.Tensor]:
    """A slot: a new buffer file and its mapping."""
    path = _new_file(directory, token, made, size)
    return path, _map(path, size)


class _Arena:
    """A shared-memory file holding a trainer's tensors in place."""

    def __init__(self, path: str, buffer: torch.Tensor) -> None:
        self.path = path
        self.size = int(buffer.numel())
        self.base = int(buffer.data_ptr())
        self.buffer = buffer

    def offset_of(self, tensor: Any) -> int | None:
        ptr, n = int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size())
        return ptr - self.base if self.base <= ptr and ptr + n <= self.base + self.size else None


_ARENAS: list[weakref.ref[_Arena]] = []  # alive while their model is


def _live_arenas() -> list[_Arena]:
    alive = [a for a in (ref() for ref in _ARENAS) if a is not None]
    _ARENAS[:] = [weakref.ref(a) for a in alive]
    return alive


def share_memory(model: Any, directory: str | Path | None = None) -> str:
    """Move every parameter and buffer of `model` (an nn.Module) into one shared-memory arena, in
    place: the module keeps training on the same Parameter objects, now backed by the arena, and
    the shared-memory transport sends them to engines without copying. Returns the arena's path;
    the file is unlinked when the interpreter exits. Not for sharded (DTensor) models."""
    import torch
    from torch import nn

    if not isinstance(model, nn.Module):
        raise TypeError(f"share_memory takes an nn.Module, got {type(model).__name__}")
    owners: list[tuple[nn.Module, str, bool, torch.Tensor]] = []
    seen: dict[int, int] = {}
    offset = 0
    for module in model.modules():
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is None or hasattr(t, "placements") or t.device.type != "cpu":
                    continue
                owners.append((module, name, kind, t))
                if id(t) not in seen:
                    seen[id(t)] = offset
                    offset = (offset + t.numel() * t.element_size() + 63) // 64 * 64
    path = str(Path(directory or _default_dir()) / f"{PREFIX}arena-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(offset, 1))
    finally:
        os.close(fd)
    buffer = _map(path, max(offset, 1))
    placed: dict[int, torch.Tensor] = {}
    for module, name, is_param, t in owners:
        view = placed.get(id(t))
        if view is None:
            start = seen[id(t)]
            view = buffer[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            with torch.no_grad():
                view.copy_(t.detach())
            placed[id(t)] = view
        if is_param:
            module._parameters[name].data = view  # the same Parameter (the optimizer's), new storage
        else:
            module._buffers[name] = view
    arena = _Arena(path, buffer)
    weakref.finalize(arena, _unlink_all, [path])  # the file goes with the model (or at exit)
    model._refit_arena = arena  # the model keeps its arena alive
    _ARENAS.append(weakref.ref(arena))
    return path


class SharedMemoryTransport(Transport):
    kind = "shm"

    def __init__(
        self, slots: int = 2, directory: str | Path | None = None, *, checksums: bool = True, zero_copy: bool = True
    ) -> None:
        """`checksums`: put each bucket's xxHash3 in its part so the engine can detect damaged
        bytes (turn off when the link is trusted). `zero_copy`: send tensors that lie in a
        `share_memory` arena by reference."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        self.slots = slots
        self.checksums = checksums
        self.zero_copy = zero_copy
        self._arenas: list[_Arena] = []  # the arenas the engines map (known at connect)
        self._digests: dict[str, tuple[tuple[int, int], list[int]]] = {}  # name -> (identity, digests) from prepare
        self._packed: set[int] = set()  # buckets packed since the last prepare: a repack is a retry
        self.directory = Path(directory) if directory else _default_dir()
        self.temp_bytes = 0
        self._feeds = False
        self._own: dict[int, tuple[str, torch.Tensor]] = {}  # oversized buckets in flight
        self._by_ref: set[int] = set()  # buckets in flight that took no buffer (all sent by reference)
        self._all_paths: list[str] = []  # every file made for this connection (abandoned ones too)
        self._slot_bytes = 0
        self._token = ""
        self._pool = self._new_pool(0)  # each slot: its file and the file's mapping
        self._finalizer: weakref.finalize | None = None

    @property
    def connected(self) -> bool:
        return self._finalizer is not None

    @property
    def buffer_bytes(self) -> int:
        return len(self._pool.buffers) * self._slot_bytes + sum(int(t.numel()) for _, t in self._own.values())

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        kept = self._digests  # prepare ran before this connect: its digests still hold
        self.disconnect()
        self._digests = kept
        self._token = secrets.token_hex(4)
        self._finalizer = weakref.finalize(self, _unlink_all, self._all_paths)
        self._feeds = self.feeds(topology, rank)
        self._slot_bytes = slot_bytes(plan) if self._feeds else 0
        self._pool = self._new_pool(self.slots if self._feeds else 0)
        self._arenas = _live_arenas() if (self.zero_copy and self._feeds) else []
        return {
            "rank": rank, "paths": [p for p, _ in self._pool.buffers], "slot_bytes": self._slot_bytes,
            "arenas": [[a.path, a.size] for a in self._arenas],
        }  # fmt: skip

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        receiver = f"{__name__}:SharedMemoryReceiver"
        return {
            e.name: ConnectInfo(
                self.kind, receiver, parts=tuple(rank_infos[self.route(topology, e, j)] for j in range(e.tp))
            )
            for e in topology.engines
        }

    def _new_pool(self, count: int) -> SlotPool[tuple[str, torch.Tensor]]:
        """This connection's slots: each a file and its mapping (the factory holds no reference to
        the transport, whose garbage collection unlinks the files)."""
        return SlotPool(
            count, functools.partial(_new_slot, self.directory, self._token, self._all_paths, self._slot_bytes),
            owner="shm transport",
            full="{owner}: no free buffer for bucket {bucket}; buckets {held} are still waiting for their "
            "acknowledgements",
        )  # fmt: skip

    def _new_file(self, size: int) -> str:
        return _new_file(self.directory, self._token, self._all_paths, size)

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        if not self.connected:
            raise RuntimeError("shm transport: pack() before connect()")
        if not self._feeds:  # this rank feeds no engine: it makes the same gathers and keeps nothing
            self.temp_bytes = pack_into(None, manifest, tensors).temp_bytes
            return None
        if manifest.index in self._packed:  # a retry: the source may have been written since, hash anew
            self._digests = {}
        self._packed.add(manifest.index)
        self._by_ref.discard(manifest.index)
        part: dict[str, Any] = {}

        def take_buffer() -> torch.Tensor:  # only once a tensor of the bucket has to be copied
            if manifest.oversized:
                path = self._new_file(manifest.nbytes)
                self._own[manifest.index] = (path, _map(path, manifest.nbytes))
                part.update(path=path, size=manifest.nbytes, once=True)
                return self._own[manifest.index][1]
            path, buffer = self._pool.take(manifest.index)
            part.update(path=path, size=self._slot_bytes)
            return buffer

        try:
            packed = pack_into(
                take_buffer, manifest, tensors, hash_bytes=self.checksums,
                refer=self._refer if self._arenas else None, known=self._known, per_tensor=self.tensor_digests,
            )  # fmt: skip
        except BaseException:
            if manifest.index in self._pool or manifest.index in self._own:  # give back what it took
                self.release(manifest.index)
            raise
        self.temp_bytes = packed.temp_bytes
        if "path" not in part:
            self._by_ref.add(manifest.index)
        if packed.refs is not None:
            part["refs"] = packed.refs
        if packed.checksum is not None:
            part["xxh3"] = packed.checksum
        return part

    @property
    def wants_prepare(self) -> bool:
        return self.zero_copy and self.checksums and bool(_live_arenas())

    def prepare(self, manifest: BucketManifest, tensors: LazyTensors) -> None:
        """Hash, before the engines are paused, the tensors that lie in an arena (they will travel
        by reference). Pack reuses a digest once, on the first attempt only, and only while the
        tensor's storage and torch version counter are unchanged. A write that bypasses the counter
        (`p.data.copy_`, numpy views, CPU fused Adam) during a refit leaves a stale digest: the
        engine's verify then fails that bucket as corrupted and the retry hashes anew; wrong bytes
        are never loaded silently."""
        if manifest.index == 0:  # a new run: nothing kept from one that stopped before packing
            self._digests, self._packed = {}, set()
        arenas = _live_arenas()
        for (name, tensor), entry in zip(tensors, manifest.entries, strict=False):
            if self._eligible(entry.meta, tensor) and any(a.offset_of(tensor) is not None for a in arenas):
                self._digests[name] = (tensor_identity(tensor), chunk_digests(tensor))

    def _known(self, name: str, tensor: Any) -> list[int] | None:
        hit = self._digests.pop(name, None)
        return hit[1] if hit is not None and hit[0] == tensor_identity(tensor) else None

    @staticmethod
    def _eligible(meta: Any, tensor: Any) -> bool:
        return not hasattr(tensor, "placements") and tensor.is_contiguous() and tensor.dtype == torch_dtype(meta.dtype)

    def _refer(self, meta: Any, tensor: Any) -> list[int] | None:
        """[arena index, byte offset] of a tensor that lies, unchanged in form, in a mapped arena."""
        if not self._eligible(meta, tensor):
            return None
        for i, arena in enumerate(self._arenas):
            offset = arena.offset_of(tensor)
            if offset is not None:
                return [i, offset]
        return None

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        return routed_payloads(self, manifest, parts, topology)

    def release(self, index: int) -> None:
        if not self._feeds:
            return
        own = self._own.pop(index, None)
        if own is not None:
            _unlink_all([own[0]])
            return
        if index in self._by_ref:
            self._by_ref.discard(index)
            return
        self._pool.release(index)  # a bucket neither held nor sent by reference: a double release (raises)

    def abandon(self, index: int) -> None:
        if not self._feeds:
            return
        if index in self._by_ref:
            self._by_ref.discard(index)
            return
        if self._own.pop(index, None) is not None or index not in self._pool:
            return  # its file stays linked until disconnect
        self._pool.abandon(index)  # a new file; the old one stays until disconnect

    def disconnect(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlinks the files exactly once
            self._finalizer = None
        self._pool, self._own, self._all_paths, self._by_ref = self._new_pool(0), {}, [], set()
        self._arenas = []
        self._digests = {}


class SharedMemoryReceiver(Receiver):
    """Engine side (one per engine TP rank): maps its trainer rank's slots once, returns views."""

    def __init__(self, info: ConnectInfo, tp_rank: int = 0) -> None:
        super().__init__(info, tp_rank)
        # buffers may only come from where this connection's files are (or the shm directory)
        named = [*self.part.get("paths", []), *(p for p, _ in self.part.get("arenas", []))]
        self._dirs = {Path(p).resolve().parent for p in named} | {_default_dir().resolve()}
        self._size = int(self.part.get("slot_bytes", 0))
        self._buffers: dict[str, torch.Tensor] = {p: self._map(p, self._size) for p in self.part.get("paths", [])}
        self._arenas = [self._map(path, int(size)) for path, size in self.part.get("arenas", [])]

    def _map(self, path: str, size: int) -> torch.Tensor:
        p = Path(path) if isinstance(path, str) else None
        if p is None or not p.name.startswith(PREFIX) or p.is_symlink() or p.resolve().parent not in self._dirs:
            raise ValueError(f"payload names buffer {path!r}, not a refit shared-memory buffer")
        actual = os.path.getsize(path)  # FileNotFoundError names the path if it is gone
        if actual < size:
            raise ValueError(f"shm buffer {path} has {actual} bytes, expected {size}")
        return _map(path, size)

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        part = payload.parts[self.tp_rank]
        manifest = payload.manifest
        refs = part.get("refs") or [None] * len(manifest.entries)
        copied = None
        if any(r is None for r in refs):
            path = part.get("path")
            if part.get("once"):  # an oversized bucket's own file: mapped for this bucket only
                copied = unpack(self._map(path, int(part["size"])), manifest)
            else:
                if path not in self._buffers:  # a replacement for an abandoned slot: mapped once
                    self._buffers[path] = self._map(path, self._size)
                copied = unpack(self._buffers[path], manifest)
        if len(refs) != len(manifest.entries):
            raise ValueError(f"bucket {manifest.index}: {len(refs)} references for {len(manifest.entries)} tensors")
        return [
            copied[i] if ref is None else self._referenced(entry.meta, ref)
            for i, (entry, ref) in enumerate(zip(manifest.entries, refs, strict=True))
        ]  # type: ignore[index]

    def _referenced(self, meta: Any, ref: Any) -> tuple[str, torch.Tensor]:
        """A tensor that lies in the trainer's arena (zero-copy): a view of it, bounds checked."""
        arena, offset = int(ref[0]), int(ref[1])
        if not 0 <= arena < len(self._arenas):
            raise ValueError(f"{meta.name}: reference to arena {arena}, {len(self._arenas)} mapped")
        buffer = self._arenas[arena]
        if offset < 0 or offset % itemsize(meta.dtype) or offset + meta.nbytes > buffer.numel():
            raise ValueError(f"{meta.name}: reference to bytes {offset}..{offset + meta.nbytes} outside its arena")
        return meta.name, buffer[offset : offset + meta.nbytes].view(torch_dtype(meta.dtype)).view(meta.shape)

    def expected(self, payload: Payload) -> int | None:
        return payload.parts[self.tp_rank].get("xxh3")

    def close(self) -> None:
        self._buffers = {}
