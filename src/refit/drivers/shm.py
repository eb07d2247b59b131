"""CPU shared-memory transport: buckets travel through files in /dev/shm mapped by both sides.

Lifecycle:
  CONNECTING     trainer: `connect` creates `slots` buffer files (``refit-<pid>-<token>-<slot>``)
                 sized to the largest planned bucket and maps them once; each engine maps the
                 same files once in `SharedMemoryReceiver.__init__` (no per-bucket opens).
  TRANSFERRING   trainer: `pack` copies a bucket into a free slot; the payload names the slot's
                 file and carries the manifest. Engine: `read` returns zero-copy views into its
                 mapping; the engine copies them into its weights and returns (the ack). The
                 trainer `release`s the slot only after every engine acked, and only then reuses
                 it. A slot an engine never answered for is `abandon`ed: its file is left alone
                 and a new file takes its place (engines map a new file once, on first use).
  disconnect     trainer: unlink the files and drop its mappings; engines `close` theirs. A file
                 unlinked while an engine still maps it stays valid for that engine (POSIX), so
                 an abandoned slot never turns into a dangling read.

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
from typing import TYPE_CHECKING

from refit.drivers.base import ConnectInfo, NamedTensors, Payload, Receiver, Transport
from refit.drivers.buckets import BucketManifest, crc32, pack_into, unpack

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


class SharedMemoryTransport(Transport):
    kind = "shm"

    def __init__(self, slots: int = 2, directory: str | Path | None = None, *, checksums: bool = True) -> None:
        """`checksums`: put each bucket's CRC-32 in its payload so the engine can detect corruption
        (costs one pass over the bytes on each side; turn off when the link is trusted)."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.checksums = checksums
        self.directory = Path(directory) if directory else _default_dir()
        self._buffers: list[torch.Tensor] = []
        self._paths: list[str] = []
        self._busy: list[int | None] = []  # bucket index occupying each slot
        self._all_paths: list[str] = []  # every file made for this connection (abandoned ones too)
        self._slot_bytes = 0
        self._token = ""
        self._finalizer: weakref.finalize | None = None

    @property
    def connected(self) -> bool:
        return bool(self._paths)

    def connect(self, plan: Sequence[BucketManifest], n_engines: int) -> ConnectInfo:

        self.disconnect()
        self._slot_bytes = max([m.nbytes for m in plan] + [1])
        self._token = secrets.token_hex(4)
        self._finalizer = weakref.finalize(self, _unlink_all, self._all_paths)
        for _ in range(self.slots):
            self._paths.append(self._new_file())
            self._busy.append(None)
        self._buffers = [self._map(p) for p in self._paths]
        return ConnectInfo(
            kind=self.kind,
            receiver=f"{__name__}:SharedMemoryReceiver",
            fields={"paths": list(self._paths), "slot_bytes": self._slot_bytes},
        )

    def _new_file(self) -> str:
        path = str(self.directory / f"{PREFIX}{os.getpid()}-{self._token}-{len(self._all_paths)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._slot_bytes)
        finally:
            os.close(fd)
        self._all_paths.append(path)
        return path

    def _map(self, path: str) -> torch.Tensor:
        import torch

        return torch.from_file(path, shared=True, size=self._slot_bytes, dtype=torch.uint8)

    def pack(self, manifest: BucketManifest, tensors: NamedTensors) -> Payload:
        if not self.connected:
            raise RuntimeError("shm transport: pack() before connect()")
        try:
            slot = self._busy.index(None)
        except ValueError:
            raise RuntimeError(
                f"shm transport: no free buffer for bucket {manifest.index}; buckets "
                f"{self._busy} are still waiting for their acknowledgements"
            ) from None
        pack_into(self._buffers[slot], manifest, tensors)
        self._busy[slot] = manifest.index
        fields: dict[str, int | str] = {"slot": slot, "path": self._paths[slot]}
        if self.checksums:
            fields["crc32"] = crc32(tensors)
        return Payload(kind=self.kind, manifest=manifest, fields=fields)

    def release(self, payload: Payload) -> None:
        slot = payload.fields["slot"]
        if self._busy[slot] != payload.manifest.index:
            raise RuntimeError(
                f"shm transport: slot {slot} holds bucket {self._busy[slot]}, not {payload.manifest.index}"
            )
        self._busy[slot] = None

    def abandon(self, payload: Payload) -> None:
        slot = payload.fields["slot"]
        if self._busy[slot] != payload.manifest.index:
            raise RuntimeError(
                f"shm transport: slot {slot} holds bucket {self._busy[slot]}, not {payload.manifest.index}"
            )
        self._paths[slot] = self._new_file()  # the old file stays mapped (and linked) until disconnect
        self._buffers[slot] = self._map(self._paths[slot])
        self._busy[slot] = None

    def disconnect(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # unlinks the files exactly once
            self._finalizer = None
        self._buffers = []
        self._paths = []
        self._busy = []
        self._all_paths = []


class SharedMemoryReceiver(Receiver):
    """Engine side: maps every slot once, returns views into them."""

    def __init__(self, info: ConnectInfo) -> None:

        super().__init__(info)
        self._size = int(info.fields["slot_bytes"])
        self._buffers: dict[str, torch.Tensor] = {p: self._map(p) for p in info.fields["paths"]}

    def _map(self, path: str) -> torch.Tensor:
        import torch

        actual = os.path.getsize(path)  # FileNotFoundError names the path if it is gone
        if actual != self._size:
            raise ValueError(f"shm buffer {path} has {actual} bytes, expected {self._size}")
        return torch.from_file(path, shared=True, size=self._size, dtype=torch.uint8)

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        path = payload.fields.get("path")
        if not isinstance(path, str) or not Path(path).name.startswith(PREFIX):
            raise ValueError(f"payload names buffer {path!r}, not a refit shared-memory buffer")
        if path not in self._buffers:  # a replacement for an abandoned slot: mapped once
            self._buffers[path] = self._map(path)
        return unpack(self._buffers[path], payload.manifest)

    def close(self) -> None:
        self._buffers = {}
