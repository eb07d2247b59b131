"""Storage-sharing transport (kind ``ipc``): each engine TP rank copies straight out of the trainer's
own storages, opened once; a refit then sends only small references.

Colocated (an engine TP rank on its trainer rank's device). On a GPU the storages travel as CUDA
IPC handles (the engine maps the trainer's memory). On CPU, with `share_cpu=True`, as shared-memory
names: sharing moves each CPU storage into named shared memory once, in place (torch's
`share_memory_` semantics: the trainer's tensors keep working, but a tensor aliasing a numpy
array or a memory map stops aliasing it, and torch cannot `resize_` a shared storage); that is how
CI runs this transport for real without a GPU. By default CPU tensors are staged (copied), never
moved.

Lifecycle, per state (trainer side: every rank; engine side: `IPCReceiver` in each engine TP rank):
  CONNECTING     `share(source.storages())` then `connect`: a rank that feeds an engine exports
                 every storage its source's tensors lie in (each once, whatever the number of
                 tensors in it) and holds them for the life of the connection, so their memory is
                 never freed or reused under an open handle; on a GPU it also makes two
                 interprocess events, `ready` (trainer -> engine) and `done` (engine -> trainer).
                 The engine opens every handle once at attach, on the device with the trainer's
                 GPU UUID. The runner keys the connection by the source's storage epoch: a
                 trainer that reallocates its storages gets a fresh connect, never stale handles.
  run start      `plan`: buckets of at least `signal_bytes` (2 GiB): a bucket is a signal, not a
                 buffer, and each costs a message and the engine's bookkeeping.
  TRANSFERRING   `pack(k)`: per tensor, a reference (storage, byte offset) when it lies, unchanged
                 in form, in a shared storage; otherwise (a cast, a gather, a tensor reallocated
                 since connect) it is copied into a staging buffer (`slots` of them, made on first
                 need and shared in the payload, opened once by the engine). `ready` is recorded
                 on the trainer's stream at the run's first bucket (after the trainer's own writes)
                 and after any staging copy; the engine's stream waits on it then (no host sync).
                 Nothing else is queued in the trainer's GPU context during the loop: on one GPU,
                 work queued by two processes runs by time-slicing their contexts. The engine
                 queues one batched device-to-device copy for the bucket, records `done`
                 (`consumed`) and acks. `release(k)` of a bucket that used a staging buffer makes
                 the trainer's stream wait on `done` before it writes that buffer again: no buffer
                 is reused before the engine's copy of it ran. `abandon(k)`: its staging buffer is
                 never written again (a fresh one replaces it).
  POST_PROCESSING the engine's finalize waits for its queued copies once (not per bucket), so when
                 the refit returns no engine still reads the shared parameters: the trainer's
                 next optimizer step may write them.
  disconnect     handles, events and staging buffers dropped; idempotent.

No `torch.cuda.empty_cache()`, no host sync and no per-tensor call inside the bucket loop; one
message per bucket. The trainer is assumed to write its parameters on the device's default stream
(the stream refit's calls queue on), or to order its own stream after it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest, TensorMeta, itemsize, pack_into, plan_buckets, slot_bytes, torch_dtype
from refit.drivers.base import (
    ConnectInfo,
    LazyTensors,
    Payload,
    Receiver,
    Storages,
    Topology,
    Transport,
    routed_payloads,
)
from refit.drivers.slots import SlotPool

if TYPE_CHECKING:
    import torch


def _staging_buffer(nbytes: int, device: Any) -> tuple[Any, dict[str, Any]]:
    """A staging buffer of `nbytes` (at least 1) on `device`, and its exported storage."""
    import torch

    buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    return buffer, export_storage(buffer.untyped_storage())


def export_storage(storage: Any) -> dict[str, Any]:
    """A JSON-safe handle another process opens with `open_storage`: CUDA IPC on a GPU, a shared
    memory name on CPU (the storage is moved into named shared memory first, in place)."""
    if storage.device.type == "cuda":
        device, handle, size, offset, ref_handle, ref_offset, event_handle, sync = storage._share_cuda_()
        return {
            "cuda": [int(device), handle.hex(), int(size), int(offset), ref_handle.hex(), int(ref_offset),
                     event_handle.hex(), bool(sync)],
            "nbytes": int(storage.nbytes()),
        }  # fmt: skip
    if storage.device.type == "cpu":
        manager, handle, size = storage._share_filename_cpu_()
        return {"cpu": [manager.decode(), handle.decode(), int(size)], "nbytes": int(storage.nbytes())}
    raise ValueError(f"storages on {storage.device.type} cannot be shared between processes")


def _fields(spec: Any, key: str, types: tuple[type, ...]) -> list[Any]:
    """The fields of a handle, each of the expected type (ints >= 0), or ValueError naming it."""
    fields = spec.get(key) if isinstance(spec, dict) else None
    if not isinstance(fields, list) or len(fields) != len(types):
        raise ValueError(f"not a storage handle: {str(spec)[:80]}")
    for value, kind in zip(fields, types, strict=True):
        if not isinstance(value, kind) or isinstance(value, bool) is not (kind is bool) or (kind is int and value < 0):
            raise ValueError(f"storage handle field {value!r} is not a {kind.__name__} (>= 0 for sizes)")
    return fields


def open_storage(spec: dict[str, Any], device_index: int | None, pid: int | None = None) -> torch.Tensor:
    """A flat uint8 tensor over a storage another process exported (mapped, not copied). A CPU
    name must be a torch segment of process `pid` (the trainer rank that connected) whose file
    holds the bytes asked for: no other process's memory is opened, grown or unlinked."""
    import torch

    if isinstance(spec, dict) and "cuda" in spec:
        if device_index is None:
            raise ValueError("a CUDA storage handle needs a local device")
        _, handle, size, offset, ref_handle, ref_offset, event_handle, sync = _fields(
            spec, "cuda", (int, str, int, int, str, int, str, bool)
        )
        try:
            raw = [bytes.fromhex(h) for h in (handle, ref_handle, event_handle)]
        except ValueError:
            raise ValueError("a CUDA storage handle that is not hex") from None
        storage = torch.UntypedStorage._new_shared_cuda(
            device_index, raw[0], size, offset, raw[1], ref_offset, raw[2], sync
        )
    elif isinstance(spec, dict) and "cpu" in spec:
        manager, handle, size = _fields(spec, "cpu", (str, str, int))
        if pid is None or not handle.startswith(f"/torch_{pid}_") or "/" in handle[1:]:
            raise ValueError(f"storage name {handle!r} is not a torch shared-memory segment of the trainer (pid {pid})")
        path = Path("/dev/shm") / handle[1:]
        actual = path.stat().st_size if path.exists() else None
        if actual is None or actual < size:
            raise ValueError(f"shared-memory segment {handle} holds {actual} bytes, the handle names {size}")
        storage = torch.UntypedStorage._new_shared_filename_cpu(manager.encode(), handle.encode(), size)
    else:
        raise ValueError(f"not a storage handle: {str(spec)[:80]}")
    n = int(storage.nbytes())
    if n < int(spec.get("nbytes", 0)):
        raise ValueError(f"shared storage has {n} bytes, expected {spec['nbytes']}")
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def local_device(uuid: str) -> int:
    """The index, in this process, of the GPU with `uuid` (device numbering differs per process)."""
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise ValueError(f"no GPU with UUID {uuid} is visible to this engine process (CUDA IPC needs the same host)")


class IPCTransport(Transport):
    """Colocated transport whose engines copy straight out of the trainer's shared storages."""

    kind = "ipc"
    shares_storages = True
    digest_kind = "wsum"  # verification hashes on the GPU, where the weights are

    def __init__(
        self, slots: int = 2, *, signal_bytes: int = 2 << 30, share_cpu: bool = False, same_devices: bool = False
    ) -> None:
        """`signal_bytes`: the least a bucket covers. A referenced bucket costs no memory, only a
        message and the engine's bookkeeping (about a millisecond on a busy host), so buckets are
        planned at `max(bucket_bytes, signal_bytes)` (0: the context's `bucket_bytes` as given);
        staging buffers, made only for tensors that cannot be referenced, take the plan's size.
        `share_cpu`: move CPU storages into named shared memory and reference them (see the module
        docstring for what that changes for the trainer); else CPU tensors are staged.
        `same_devices`: the engines run on the trainer's devices although the run is disaggregated
        (no offload or restore: an atomic refit into an engine that shares the trainer's GPU)."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if not isinstance(signal_bytes, int) or signal_bytes < 0:
            raise ValueError(f"signal_bytes must be an integer >= 0, got {signal_bytes!r}")
        self.slots = slots
        self.signal_bytes = signal_bytes
        self.same_devices = same_devices
        self.share_cpu = share_cpu
        self.temp_bytes = 0
        self._offered: Storages | None = None
        self._storages: list[Any] = []  # held while connected: their memory stays theirs
        self._where: dict[int, int] = {}  # storage data_ptr -> index in _storages
        self._device: Any = None
        self._events: tuple[Any, Any] | None = None  # (ready, done) on a GPU
        self._cuda: dict[str, Any] | None = None  # their handles and the GPU's UUID, as engines get them
        self._slot_bytes = 0
        self._staging = self._new_pool(0)  # each slot: (tensor, exported handle), made on first need
        self._own: dict[int, tuple[Any, dict[str, Any]]] = {}  # oversized buckets' own buffers in flight
        self._feeds = False
        self._connected = False

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        return plan_buckets(metas, max(bucket_bytes, self.signal_bytes))

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def buffer_bytes(self) -> int:
        return sum(int(t.numel()) for t, _ in self._staging.buffers) + sum(
            int(t.numel()) for t, _ in self._own.values()
        )

    def share(self, storages: Storages | None) -> None:
        self._offered = storages

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:

        if not topology.colocated and not self.same_devices:
            raise ValueError(
                "the ipc transport is colocated only (engines on the trainer's devices; a disaggregated run on the "
                "same devices: IPCTransport(same_devices=True))"
            )
        offered = self._offered  # `share` ran right before: the reset below must not drop it
        self.disconnect()
        self._offered = offered
        self._feeds = self.feeds(topology, rank)
        self._slot_bytes = slot_bytes(plan)
        self._connected = True
        if not self._feeds:
            return {}
        tensors = list(self._offered.tensors) if self._offered is not None else []
        self._offered = None  # held through the storages below, not through the source's tensors
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"the source's storages lie on several devices ({sorted(map(str, devices))})")
        self._device = devices.pop() if devices else None  # else: the first packed tensor's device
        exported = []
        for t in tensors:
            st = t.untyped_storage()
            if (
                st.nbytes() == 0
                or int(st.data_ptr()) in self._where
                or (st.device.type == "cpu" and not self.share_cpu)
            ):
                continue
            exported.append(export_storage(st))  # on CPU this may move it: index by its address after
            self._where[int(st.data_ptr())] = len(self._storages)
            self._storages.append(st)
        info: dict[str, Any] = {"storages": exported, "slot_bytes": self._slot_bytes, "pid": os.getpid()}
        if self._device is not None and self._device.type == "cuda":
            info["cuda"] = self._cuda_events()
        return info

    def _cuda_events(self) -> dict[str, Any]:
        """The interprocess events `ready` and `done` on this rank's GPU, made once per connection."""
        import torch

        if self._cuda is None:
            device = self._device
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._device = torch.device("cuda", index)
            ready, done = (torch.cuda.Event(interprocess=True) for _ in range(2))
            stream = torch.cuda.current_stream(self._device)
            ready.record(stream)  # creates the events before their handles are taken
            done.record(stream)
            self._events = (ready, done)
            self._cuda = {
                "uuid": device_uuid(index),
                "ready": ready.ipc_handle().hex(),
                "done": done.ipc_handle().hex(),
            }
        return self._cuda

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        return {
            e.name: ConnectInfo(
                self.kind,
                f"{__name__}:IPCReceiver",
                parts=tuple(rank_infos[self.route(topology, e, j)] for j in range(e.tp)),
            )
            for e in topology.engines
        }

    def _refer(self, meta: Any, tensor: Any) -> list[int] | None:
        """[storage index, byte offset] of a tensor that lies, unchanged in form, in a shared storage."""
        if hasattr(tensor, "placements") or not tensor.is_contiguous() or tensor.dtype != torch_dtype(meta.dtype):
            return None
        st = tensor.untyped_storage()
        index = self._where.get(int(st.data_ptr()))
        if index is None or st.device != self._device:
            return None
        shared = self._storages[index]
        if int(shared.nbytes()) != int(st.nbytes()):  # resized in place since connect: not what was shared
            return None
        offset = int(tensor.data_ptr()) - int(st.data_ptr())
        return [index, offset]

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        if not self._connected:
            raise RuntimeError("ipc transport: pack() before connect()")
        if not self._feeds:  # the same gathers as the ranks that feed an engine, nothing kept
            self.temp_bytes = pack_into(None, manifest, tensors).temp_bytes
            return None
        part: dict[str, Any] = {}
        tensors = self._placed(tensors)

        def take_buffer() -> torch.Tensor:  # only once a tensor of the bucket has to be copied
            if manifest.oversized:
                buffer, handle = self._new_buffer(manifest.nbytes)
                self._own[manifest.index] = (buffer, handle)
                part["staging"] = handle
                return buffer
            if not len(self._staging):  # the staging device is known from the bucket's first tensor on
                self._staging = self._new_pool(self.slots)
            buffer, handle = self._staging.take(manifest.index)
            part["staging"] = handle
            return buffer

        try:
            packed = pack_into(take_buffer, manifest, tensors, refer=self._refer)
        except BaseException:
            self.release(manifest.index)
            raise
        self.temp_bytes = packed.temp_bytes
        part["refs"] = packed.refs if packed.refs is not None else [None] * len(manifest.entries)
        if self._events is not None:
            part["cuda"] = self._cuda
            if manifest.index == 0 or packed.used_buffer:  # the trainer's writes before the run, or staging copies
                import torch

                self._events[0].record(torch.cuda.current_stream(self._device))
                part["wait"] = True
        return part

    def _placed(self, tensors: LazyTensors) -> LazyTensors:
        """The bucket's tensors; the first one seen fixes the staging device when the source offered
        no storages (a source that casts or gathers on a GPU stages on that GPU)."""
        for name, tensor in tensors:
            if self._device is None:
                self._device = tensor.device
                if self._device.type == "cuda":
                    self._cuda_events()
            yield name, tensor

    def _new_buffer(self, nbytes: int) -> tuple[Any, dict[str, Any]]:
        return _staging_buffer(nbytes, self._device)

    def _new_pool(self, count: int) -> SlotPool[tuple[Any, dict[str, Any]]]:
        """`count` staging slots on this connection's device, each made on its first need."""
        return SlotPool(
            count, functools.partial(_staging_buffer, self._slot_bytes, self._device), owner="ipc transport",
            lazy=True,
            full="{owner}: no free staging buffer for bucket {bucket}; buckets {held} wait for their acknowledgements",
        )  # fmt: skip

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        return routed_payloads(self, manifest, parts, topology)

    def _after_engines(self) -> None:
        """Order everything the trainer queues from now on after the engines' copies (no host sync)."""
        if self._events is not None:
            import torch

            torch.cuda.current_stream(self._device).wait_event(self._events[1])

    def release(self, index: int) -> None:
        """A staging buffer is free again once the trainer's stream waits for the engine's copies
        (no host sync). A bucket of references needs nothing: the engines' finalize waits for their
        copies before the refit returns, so the trainer's next step cannot overtake them."""
        if not self._feeds:
            return
        if self._own.pop(index, None) is not None:
            self._after_engines()
            return
        if index in self._staging:
            self._after_engines()
            self._staging.release(index)

    def abandon(self, index: int) -> None:
        """An engine may still read bucket `index`: its staging buffer is never written again."""
        if not self._feeds or self._own.pop(index, None) is not None or index not in self._staging:
            return
        self._staging.abandon(index)

    def disconnect(self) -> None:
        self._events, self._cuda, self._device = None, None, None
        self._storages, self._where, self._staging, self._own = [], {}, self._new_pool(0), {}
        self._offered = None  # the source's tensors are not kept past the connection
        self._connected = False


class IPCReceiver(Receiver):
    """Engine side (one TP rank): opens the trainer rank's storages and events once; each bucket
    is views of them (or of a staging buffer, opened on first sight). A bucket of references
    that did not change gets the views built the first time (`stable_views`)."""

    stable_views = True

    def __init__(self, info: ConnectInfo, tp_rank: int = 0) -> None:
        super().__init__(info, tp_rank)
        part = self.part
        self._device: int | None = None
        self._events: tuple[Any, Any] | None = None
        self._cuda: dict[str, Any] | None = None
        if part.get("cuda"):
            self._open_events(part["cuda"])
        self._pid = part.get("pid") if isinstance(part.get("pid"), int) else None
        self._storages = [open_storage(spec, self._device, self._pid) for spec in part.get("storages", [])]
        self._staging: dict[str, Any] = {}
        self._views: dict[int, tuple[Any, Any, list[tuple[str, torch.Tensor]]]] = {}  # bucket -> manifest, refs, views

    def _open_events(self, cuda: dict[str, Any]) -> None:
        """The trainer's GPU (by UUID) and its `ready`/`done` events, opened once."""
        if cuda == self._cuda:
            return
        import torch

        device = local_device(str(cuda["uuid"]))
        if self._device is not None and device != self._device:
            raise ValueError(f"the trainer's events are on GPU {cuda['uuid']}, its storages on another")
        self._device = device
        self._events = (
            torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(cuda["ready"])),
            torch.cuda.Event.from_ipc_handle(device, bytes.fromhex(cuda["done"])),
        )
        self._cuda = dict(cuda)

    def _staged(self, spec: dict[str, Any]) -> torch.Tensor:
        if not isinstance(spec, dict):
            raise ValueError(f"staging buffer handle {str(spec)[:80]} is not a storage handle")
        key = repr(spec.get("cuda") or spec.get("cpu"))
        buffer = self._staging.get(key)
        if buffer is None:
            buffer = self._staging[key] = open_storage(spec, self._device, self._pid)
        return buffer

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        manifest = payload.manifest
        part = payload.parts[self.tp_rank]
        refs = part.get("refs")
        if not isinstance(refs, list) or len(refs) != len(manifest.entries):
            raise ValueError(f"bucket {manifest.index}: references do not match its {len(manifest.entries)} tensors")
        if part.get("cuda"):
            self._open_events(part["cuda"])
        staging = self._staged(part["staging"]) if part.get("staging") else None
        if self._events is not None and part.get("wait"):
            import torch

            torch.cuda.current_stream(self._device).wait_event(self._events[0])  # the trainer's bytes are final
        kept = self._views.get(manifest.index)
        if kept is not None and staging is None and kept[1] == refs and kept[0] == manifest:
            return kept[2]  # the same references into the same open storages: the views built last time
        out = []
        for entry, ref in zip(manifest.entries, refs, strict=True):
            meta = entry.meta
            if ref is None:
                if staging is None:
                    raise ValueError(f"{meta.name}: copied into a staging buffer the payload does not name")
                buffer, offset = staging, entry.offset
            else:
                if not isinstance(ref, list) or len(ref) != 2 or not all(type(v) is int for v in ref):
                    raise ValueError(f"{meta.name}: reference {str(ref)[:40]} is not [storage index, byte offset]")
                index, offset = ref
                if not 0 <= index < len(self._storages):
                    raise ValueError(f"{meta.name}: reference to storage {index}, {len(self._storages)} shared")
                buffer = self._storages[index]
            if offset < 0 or offset % itemsize(meta.dtype) or offset + meta.nbytes > buffer.numel():
                raise ValueError(f"{meta.name}: bytes {offset}..{offset + meta.nbytes} lie outside its shared storage")
            view = buffer[offset : offset + meta.nbytes].view(torch_dtype(meta.dtype)).view(meta.shape)
            out.append((meta.name, view))
        if staging is None:  # views of the storages opened at attach stay valid while attached
            self._views[manifest.index] = (manifest, refs, out)
        return out

    def consumed(self, payload: Payload) -> None:
        if self._events is not None:
            import torch

            self._events[1].record(torch.cuda.current_stream(self._device))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self._events is not None:
                import torch

                torch.cuda.current_stream(self._device).synchronize()  # nothing queued still reads their memory
        self._storages, self._staging, self._events, self._views = [], {}, None, {}
