"""SGLang's flattened-bucket wire format, and the transports that speak it.

A flattened bucket is one uint8 tensor holding a bucket's tensors back to back, plus one metadata
record per tensor (name, shape, dtype, byte start/end, byte count), as
`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket` (0.5.6 .. 0.5.23) builds and reads
it. SGLang inserts no padding, and its receiver for `update_weights_from_distributed` computes
the offsets itself (refusing one that is not a multiple of the dtype's size), so `plan_flattened`
keeps each bucket contiguous and orders its tensors by element size, largest first: every offset
is then aligned for its dtype with no padding at all.

Colocated (`SGLangTensorTransport`, kind ``sglang_tensor``): each trainer rank packs a bucket
into a shared buffer and serializes `{"flattened_tensor": buffer, "metadata": [...]}` once per
engine TP rank it feeds (one export per consumer, as SGLang requires; sglang#4446), with the
allow-listed types SGLang's `SafeUnpickler` accepts (torch rebuild functions, `SimpleNamespace`).
CPU buffers travel by shared-memory name (`rebuild_storage_filename`), which any process on the
host can open, whatever its multiprocessing family; CUDA buffers as CUDA IPC handles in SGLang's
form: rebuilt by SGLang's patched `_rebuild_cuda_tensor_modified`, the device given as the GPU's
UUID (refit writes that form itself: SGLang's torch-reduction patch, applied process-wide, would
break CPU tensor pickling in the trainer).

Disaggregated (`SGLangBroadcastTransport`, kind ``sglang_broadcast``): trainer rank 0 broadcasts
each bucket on a group laid out as SGLang's `init_custom_process_group` builds it (a TCPStore
rendezvous, `PrefixStore(group_name)`, then the keys `_new_process_group_helper` adds), without
touching the trainer's default group. With `flattened=True` one uint8 broadcast per bucket (SGLang
`load_format="flattened_bucket"`), else one broadcast per tensor in list order.

Lifecycle (both), per state:
  run start     `plan`: `plan_flattened` (contiguous buckets, aligned by ordering).
  CONNECTING    `connect`: buffers (and, for broadcast, the store) for this engine set;
                `attach_infos`: what the engine side opens (SGLang: nothing for tensors,
                `/init_weights_update_group` for broadcast).
  TRANSFERRING  `pack(k)`: copy bucket k into a free buffer; tensors: serialize it for each engine
                TP rank this rank feeds; broadcast: `send(k)` while the engines receive.
                `release(k)` after every engine acked; `abandon(k)`: the buffer is replaced.
  disconnect    buffers and group dropped; idempotent.
"""

from __future__ import annotations

import functools
import io
import logging
import pickle
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

from refit.buckets import (
    BucketManifest,
    TensorEntry,
    TensorMeta,
    dtype_name,
    itemsize,
    pack_into,
    slot_bytes,
    torch_dtype,
)
from refit.drivers.base import ConnectInfo, EngineSpec, LazyTensors, Payload, Receiver, Topology, Transport
from refit.drivers.broadcast import SOURCE_RANK, BroadcastReceiver, BroadcastTransport, _broadcast, _td
from refit.drivers.pickling import ByNamePickler
from refit.drivers.slots import SlotPool

if TYPE_CHECKING:
    import torch

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for this layout
log = logging.getLogger(__name__)

# ---- layout --------------------------------------------------------------------------------------


def plan_flattened(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
    """Greedy bucketing by bytes in the source's order; inside a bucket, tensors are ordered by
    element size (largest first, stable) and laid out back to back, so every byte offset is a
    multiple of its dtype's size without padding (SGLang inserts none). A tensor larger than a
    bucket travels alone."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    groups: list[tuple[list[TensorMeta], bool]] = []
    current: list[TensorMeta] = []
    size = 0
    seen: set[str] = set()
    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor {meta.name!r} appears twice in the source")
        seen.add(meta.name)
        if meta.nbytes > bucket_bytes:
            if current:
                groups.append((current, False))
            groups.append(([meta], True))
            current, size = [], 0
            continue
        if current and size + meta.nbytes > bucket_bytes:
            groups.append((current, False))
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        groups.append((current, False))
    plan = []
    for index, (group, oversized) in enumerate(groups):
        entries, offset = [], 0
        for meta in sorted(group, key=lambda m: -itemsize(m.dtype)):
            entries.append(TensorEntry(meta, offset))
            offset += meta.nbytes
        plan.append(BucketManifest(index, tuple(entries), offset, oversized))
    return plan


def check_flattened(manifest: BucketManifest) -> None:
    """Refuse a manifest SGLang's flattened receiver would not read back as planned: entries must be
    back to back from 0 (no padding) and each offset a multiple of its dtype's size."""
    offset = 0
    for entry in manifest.entries:
        meta = entry.meta
        if entry.offset != offset:
            raise ValueError(
                f"bucket {manifest.index}: {meta.name!r} starts at byte {entry.offset}, SGLang's layout puts it at "
                f"{offset} (no padding between tensors)"
            )
        if offset % itemsize(meta.dtype):
            raise ValueError(
                f"bucket {manifest.index}: {meta.name!r} ({meta.dtype}) at byte {offset} is not aligned for its dtype; "
                "order a bucket's tensors by element size, largest first (plan_flattened)"
            )
        offset += meta.nbytes


def metadata_of(manifest: BucketManifest) -> list[SimpleNamespace]:
    """SGLang's FlattenedTensorMetadata records for a manifest, as SimpleNamespace (an allow-listed
    type: the receiver reads attributes, and needs no refit class to unpickle them)."""
    import torch

    return [
        SimpleNamespace(
            name=e.meta.name,
            shape=torch.Size(e.meta.shape),
            dtype=torch_dtype(e.meta.dtype),
            start_idx=e.offset,
            end_idx=e.offset + e.meta.nbytes,
            numel=e.meta.nbytes,
        )
        for e in manifest.entries
    ]


def flatten(named_tensors: Sequence[tuple[str, torch.Tensor]], *, share: bool = True) -> dict[str, Any]:
    """One flattened bucket `{"flattened_tensor", "metadata"}` from named tensors (any layout,
    contiguous or not), ordered as `plan_flattened` orders a bucket. A CPU buffer is placed in
    shared memory (by name) when `share`, so another process can open it."""
    import torch

    if not named_tensors:
        raise ValueError("a flattened bucket needs at least one tensor")
    metas = [TensorMeta.of(name, t) for name, t in named_tensors]
    total = sum(m.nbytes for m in metas)
    (manifest,) = plan_flattened(metas, max(total, 1))
    device = named_tensors[0][1].device
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    if share and device.type == "cpu":
        share_by_name(buffer)
    by_name = dict(named_tensors)
    pack_into(buffer, manifest, [(e.meta.name, by_name[e.meta.name]) for e in manifest.entries])
    return {"flattened_tensor": buffer, "metadata": metadata_of(manifest)}


def shared_buffer(nbytes: int, device: Any) -> torch.Tensor:
    """A uint8 buffer of `nbytes` (at least 1) on `device`; on CPU, in named shared memory."""
    import torch

    buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    if buffer.device.type == "cpu":
        share_by_name(buffer)
    return buffer


def share_by_name(buffer: torch.Tensor) -> None:
    """Move a CPU tensor's storage into named shared memory (torch's file_system strategy), once."""
    buffer.untyped_storage()._share_filename_cpu_()


# ---- serialization -------------------------------------------------------------------------------


def _reduce_storage_by_name(storage: Any) -> tuple[Any, ...]:
    """A CPU storage as its shared-memory name (torch's `file_system` reduction), whatever the
    process-wide sharing strategy: unrelated processes can open a name, not a passed fd."""
    from torch.multiprocessing.reductions import StorageWeakRef, rebuild_storage_filename, shared_cache

    if storage.device.type != "cpu":
        raise RuntimeError("a CUDA storage is sent inside its tensor (CUDA IPC), never alone")
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # one reference in transit, dropped by the receiver's rebuild
    shared_cache[handle] = StorageWeakRef(storage)
    return (rebuild_storage_filename, (type(storage), manager, handle, size))


# SGLang's receiver rebuilds CUDA tensors with its patched torch reduction: the device travels as
# the GPU's UUID (sglang/srt/utils/patch_torch.py `_reduce_tensor_modified`), so a trainer and an
# engine that see one physical GPU under different CUDA_VISIBLE_DEVICES orderings (Ray gives each
# actor its own) land on the same device. Its senders pickle the rebuild function by this name.
SGLANG_REBUILD = ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified")
DEVICE_ARG = 6  # the device index among torch's rebuild_cuda_tensor arguments (patch_torch's constant)


def gpu_uuid(index: int) -> str:
    """The UUID of local CUDA device `index`, as SGLang and vLLM key devices."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def rebuild_cuda_tensor_by_uuid(*args: Any) -> Any:
    """Engine side of SGLang's form: the device argument, a UUID, mapped to this process's index
    of that GPU, then torch's own rebuild (what SGLang's `_rebuild_cuda_tensor_modified` does)."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = args[DEVICE_ARG]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == device]
        if not found:
            raise ValueError(f"no local CUDA device has UUID {device} (the payload's GPU is not visible here)")
        args = (*args[:DEVICE_ARG], found[0], *args[DEVICE_ARG + 1 :])
    return rebuild_cuda_tensor(*args)


REF_COUNTER_ARGS = (11, 12)  # torch's rebuild_cuda_tensor: the export's ref-counter file and slot


def sglang_cuda_reduce(
    tensor: torch.Tensor, uuid_of: Any = gpu_uuid, counters: list[tuple[bytes, int]] | None = None
) -> tuple[Any, tuple[Any, ...]]:
    """torch's reduction of a tensor, in SGLang's form when it is a CUDA tensor: rebuilt by
    SGLang's patched function, the device given as its GPU's UUID. `counters`: each CUDA export's
    reference counter (torch's, see `ipc_refs`) is appended to it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    fn, args = reduce_tensor(tensor)
    if fn is not rebuild_cuda_tensor:
        return fn, args
    if counters is not None:
        counters.append((args[REF_COUNTER_ARGS[0]], int(args[REF_COUNTER_ARGS[1]])))
    return rebuild_cuda_tensor_by_uuid, (*args[:DEVICE_ARG], uuid_of(args[DEVICE_ARG]), *args[DEVICE_ARG + 1 :])


_COUNTER_FILES: dict[str, tuple[int, Any]] = {}  # name -> (inode, mapping)
COUNTER_HEADER = 64  # at::RefcountedMapAllocator's header (map_alloc_alignment) before the int64 counters


def ipc_refs(handle: bytes | str, offset: int) -> int:
    """How many references a consumer process still holds on one CUDA IPC export: torch keeps a
    counter per export in a shared-memory file (torch/csrc/CudaIPCTypes.cpp: set to 1 when sent,
    decremented by the consumer's deleter once the last tensor on it is dropped, after that
    deleter synchronized the consumer's stream). 0: the consumer let go, its reads are done.
    The file is torch's ref-counter file (/dev/shm/<handle>): a 64-byte header, then int64s.
    Raises ValueError for a slot the file does not hold (read as "held" by the caller)."""
    import mmap
    import os

    name = (handle.decode() if isinstance(handle, bytes) else handle).lstrip("/")
    path = f"/dev/shm/{name}"
    inode = os.stat(path).st_ino
    cached = _COUNTER_FILES.get(name)
    if cached is None or cached[0] != inode:  # a file of that name made anew is another file
        with open(path, "rb") as f:
            _COUNTER_FILES[name] = cached = (inode, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    mm = cached[1]
    at = COUNTER_HEADER + offset * 8
    if offset < 0 or at + 8 > len(mm):
        raise ValueError(f"{path} holds no counter at offset {offset} ({len(mm)} bytes)")
    return int.from_bytes(mm[at : at + 8], "little", signed=True)


class _SGLangPickler(ByNamePickler):
    """Python's pickler with the reducers ForkingPickler has, CPU storages by name, CUDA tensors in
    SGLang's form, and `rebuild_cuda_tensor_by_uuid` written as SGLang's own function (by name:
    SGLang need not be installed where refit serializes)."""

    def __init__(self, file: io.BytesIO, counters: list[tuple[bytes, int]] | None = None) -> None:
        import copyreg
        from multiprocessing.reduction import ForkingPickler

        import torch

        super().__init__(file, {rebuild_cuda_tensor_by_uuid: SGLANG_REBUILD})
        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)
        table[torch.UntypedStorage] = _reduce_storage_by_name
        table[torch.Tensor] = lambda t: sglang_cuda_reduce(t, counters=counters)
        self.dispatch_table = table


def serialize(obj: Any, counters: list[tuple[bytes, int]] | None = None) -> bytes:
    """What SGLang's `MultiprocessingSerializer.serialize` produces for `obj` in a process where
    SGLang patched torch's reductions (a ForkingPickler stream; CUDA tensors rebuilt by SGLang's
    function with the GPU's UUID), except that CPU storages always travel by shared-memory name.
    One call per consumer. `counters`: receives each CUDA export's reference counter."""
    import torch
    from torch.multiprocessing.reductions import init_reductions  # registers torch's reducers

    init_reductions()
    buf = io.BytesIO()
    if _has_cuda(obj):
        _SGLangPickler(buf, counters).dump(obj)
        return buf.getvalue()
    from multiprocessing.reduction import ForkingPickler

    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_name
    pickler.dump(obj)
    return buf.getvalue()


def _has_cuda(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_has_cuda(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_cuda(v) for v in obj)
    return False


# The globals a flattened payload may name (a subset of SGLang 0.5.23's SafeUnpickler allow-list).
ALLOWED_GLOBALS = frozenset(
    {
        ("builtins", "dict"), ("builtins", "list"), ("builtins", "tuple"), ("builtins", "str"), ("builtins", "int"),
        ("types", "SimpleNamespace"), ("copyreg", "__newobj__"), ("torch", "Size"), ("torch", "Tensor"),
        ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        SGLANG_REBUILD,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("multiprocessing.resource_sharer", "DupFd"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    }
)  # fmt: skip


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _dtype_names():
            return super().find_class(module, name)
        if (module, name) == SGLANG_REBUILD:
            return rebuild_cuda_tensor_by_uuid  # SGLang's function, as refit implements it
        if (module, name) in ALLOWED_GLOBALS:
            if module.startswith("sglang."):
                return SimpleNamespace  # its fields are read as attributes; sglang need not be installed
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"payload names {module}.{name}, which a flattened bucket never contains")


class _Peeker(_SafeUnpickler):
    """Reads a payload's metadata without opening any storage (no mapping, no reference taken)."""

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        opens = module.startswith(("torch.multiprocessing", "multiprocessing")) or (module, name) == SGLANG_REBUILD
        if opens or (module, name) == ("torch", "Tensor"):
            return _nothing
        return found


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _dtype_names() -> frozenset[str]:
    from refit.buckets import ITEMSIZE

    return frozenset(ITEMSIZE)


def deserialize(data: bytes | str) -> Any:
    """Decode one serialized payload (bytes, or base64 text as HTTP carries it), refusing any
    global a flattened bucket never names. Opens the storages it references (once per payload)."""
    return _SafeUnpickler(io.BytesIO(_raw(data))).load()


def peek_metadata(data: bytes | str) -> list[Any]:
    """The metadata records of a serialized flattened bucket, without opening its storage."""
    obj = _Peeker(io.BytesIO(_raw(data))).load()
    if not isinstance(obj, dict) or "metadata" not in obj:
        raise ValueError("not a flattened bucket: expected a dict with 'flattened_tensor' and 'metadata'")
    return list(obj["metadata"])


def _raw(data: bytes | str) -> bytes:
    if isinstance(data, str):
        import base64
        import binascii

        try:
            return base64.b64decode(data, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"payload is not valid base64: {exc}") from None
    return bytes(data)


def manifest_from_metadata(index: int, metadata: Sequence[Any]) -> BucketManifest:
    """A bucket manifest read from flattened-bucket metadata (what an engine knows from the body)."""
    entries, end = [], 0
    for m in metadata:
        try:
            meta = TensorMeta(str(m.name), dtype_name(m.dtype), tuple(int(d) for d in m.shape))
            start, stop, numel = int(m.start_idx), int(m.end_idx), int(m.numel)
        except (AttributeError, TypeError, ValueError) as exc:
            raise ValueError(f"bad flattened-bucket metadata record: {exc}") from None
        itemsize(meta.dtype)  # names an unknown dtype
        if stop - start != meta.nbytes or numel != meta.nbytes or start < 0:
            raise ValueError(
                f"{meta.name}: metadata spans bytes [{start}, {stop}) ({numel}), its {meta.dtype}{list(meta.shape)} "
                f"needs {meta.nbytes}"
            )
        entries.append(TensorEntry(meta, start))
        end = max(end, stop)
    if not entries:
        raise ValueError("a flattened bucket with no tensors")
    return BucketManifest(index, tuple(entries), end)


def reconstruct(bucket: dict[str, Any], manifest: BucketManifest) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of a decoded flattened bucket (as SGLang's `reconstruct_tensors`), after
    checking them against the manifest the engine expects."""
    import torch

    flat = bucket.get("flattened_tensor") if isinstance(bucket, dict) else None
    meta = bucket.get("metadata") if isinstance(bucket, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1 or meta is None:
        raise ValueError("not a flattened bucket: expected a 1-D uint8 'flattened_tensor' and its 'metadata'")
    got = manifest_from_metadata(manifest.index, meta)
    if got.entries != manifest.entries:
        raise ValueError(f"bucket {manifest.index}: the payload's metadata does not match the bucket's manifest")
    if flat.numel() < manifest.nbytes:
        raise ValueError(
            f"bucket {manifest.index} is truncated: {flat.numel()} bytes, metadata spans {manifest.nbytes}"
        )
    out = []
    for entry in manifest.entries:
        m = entry.meta
        if entry.offset % itemsize(m.dtype):
            raise ValueError(f"{m.name}: byte offset {entry.offset} is not aligned for {m.dtype}")
        raw = flat[entry.offset : entry.offset + m.nbytes]
        out.append((m.name, raw.view(torch_dtype(m.dtype)).reshape(m.shape)))
    return out


# ---- colocated: tensors by reference -------------------------------------------------------------


class SGLangTensorTransport(Transport):
    """Colocated transport in SGLang's `update_weights_from_tensor` + `flattened_bucket` format."""

    kind = "sglang_tensor"

    def __init__(self, slots: int = 2, *, device: str = "cpu", decoder: str = "refit") -> None:
        """`device`: where buffers live (cpu: shared memory by name; cuda: CUDA IPC). `decoder`
        (engine side of the reference emulator): ``refit`` or ``sglang`` (SGLang's own code)."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if decoder not in ("refit", "sglang"):
            raise ValueError(f"decoder {decoder!r}: use refit or sglang")
        self.slots = slots
        self.device = device
        self.decoder = decoder
        self.temp_bytes = 0
        self._own: dict[int, torch.Tensor] = {}
        self._slot_bytes = 0
        self._pool = self._new_pool(0)
        self._consumers: list[tuple[str, int]] = []
        self._connected = False
        self._counters: dict[int, list[tuple[str, bytes, int]]] = {}  # bucket -> (consumer, CUDA ref counter)
        self.held: list[dict[str, Any]] = []  # buffers a consumer still held at its ack (never rewritten)

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        return plan_flattened(metas, bucket_bytes)

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def buffer_bytes(self) -> int:
        return len(self._pool.buffers) * self._slot_bytes + sum(int(t.numel()) for t in self._own.values())

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        return shared_buffer(nbytes, self.device)

    def _new_pool(self, count: int) -> SlotPool[torch.Tensor]:
        return SlotPool(
            count, functools.partial(shared_buffer, self._slot_bytes, self.device), owner=type(self).__name__
        )

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        self.disconnect()
        for manifest in plan:
            check_flattened(manifest)
        self._consumers = [
            (e.name, j) for e in topology.engines for j in range(e.tp) if self.route(topology, e, j) == rank
        ]
        if self._consumers:
            self._slot_bytes = slot_bytes(plan)
            self._pool = self._new_pool(self.slots)
        self._connected = True
        return {}

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        return {
            e.name: ConnectInfo(
                self.kind, f"{__name__}:FlattenedTensorReceiver", fields={"decoder": self.decoder}, parts=({},) * e.tp
            )
            for e in topology.engines
        }

    payload_fields: ClassVar[dict[str, Any]] = {"load_format": FLATTENED_BUCKET}

    def _export(self, view: torch.Tensor, manifest: BucketManifest, tp_rank: int) -> Any:
        """What one consumer (an engine TP rank) receives of a packed bucket: its own serialization
        (its CUDA export's reference counter kept, for the check at release)."""
        counters: list[tuple[bytes, int]] = []
        out = serialize({"flattened_tensor": view, "metadata": metadata_of(manifest)}, counters)
        self._counted(manifest.index, tp_rank, counters)
        return out

    def _counted(self, index: int, tp_rank: int, counters: Sequence[tuple[bytes, int]]) -> None:
        self._counters.setdefault(index, []).extend((f"TP rank {tp_rank}", h, o) for h, o in counters)

    def _part(self, export: Any) -> dict[str, Any]:
        """One engine TP rank's `Payload.parts` entry from its export."""
        return {"serialized": export}

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        if not self._connected:
            raise RuntimeError(f"{type(self).__name__}: pack() before connect()")
        if not self._consumers:  # same gathers as the ranks that feed an engine, nothing kept
            self.temp_bytes = pack_into(None, manifest, tensors).temp_bytes
            return None
        buffer = self._buffer_for(manifest)
        try:
            packed = pack_into(buffer, manifest, tensors)
            view = buffer[: manifest.nbytes]
            exports = {f"{name}/{j}": self._export(view, manifest, j) for name, j in self._consumers}
        except BaseException:
            self.release(manifest.index)
            raise
        self.temp_bytes = packed.temp_bytes
        return {"exports": exports}

    def _buffer_for(self, manifest: BucketManifest) -> torch.Tensor:
        if manifest.oversized:
            self._own[manifest.index] = self._new_buffer(manifest.nbytes)
            return self._own[manifest.index]
        return self._pool.take(manifest.index)

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        out = {}
        for e in topology.engines:
            per_rank = []
            for j in range(e.tp):
                part = parts[self.route(topology, e, j)] or {}
                per_rank.append(self._part(part["exports"][f"{e.name}/{j}"]))
            out[e.name] = Payload(self.kind, manifest, dict(self.payload_fields), tuple(per_rank))
        return out

    def release(self, index: int) -> None:
        """Every engine acked bucket `index`: its buffer may be written again, unless a consumer
        still holds a reference to it (CUDA: torch's counter of that export is not back to 0). An
        engine that acks before its copies from our buffer ran, keeping the tensors it was given,
        would read the next bucket's bytes: that buffer is replaced instead, never rewritten
        (torch keeps the old memory alive until the consumer lets go)."""
        held = [c for c in self._counters.pop(index, []) if _still_held(c[1], c[2])]
        if held:
            self.held.append({"bucket": index, "consumers": sorted({c[0] for c in held})})
            log.warning(
                "bucket %d: %s still held its CUDA buffer at the ack; the buffer is replaced, never rewritten",
                index, ", ".join(sorted({c[0] for c in held})),
            )  # fmt: skip
            self.abandon(index)
            return
        if self._own.pop(index, None) is not None:
            return
        if index in self._pool:
            self._pool.release(index)

    def abandon(self, index: int) -> None:
        """An engine may still read the buffer: it is never written again (a fresh one replaces it)."""
        if self._own.pop(index, None) is not None or index not in self._pool:
            return
        self._pool.abandon(index)

    def disconnect(self) -> None:
        self._pool, self._own, self._consumers, self._counters = self._new_pool(0), {}, [], {}
        self._connected = False


def _still_held(handle: bytes, offset: int) -> bool:
    """Whether a consumer still holds a CUDA export (an unreadable or impossible counter counts as
    held: the buffer is replaced, never rewritten under a reader)."""
    try:
        return ipc_refs(handle, offset) != 0
    except (OSError, ValueError):
        return True


class FlattenedTensorReceiver(Receiver):
    """Engine side (one TP rank): decodes its own serialized entry and returns views of the bucket.
    With ``decoder: sglang`` it decodes with SGLang's own `MultiprocessingSerializer` and
    `FlattenedTensorBucket` (SGLang must be importable in the engine's process). A CUDA bucket's
    handle is opened per bucket (torch's CUDA IPC: the open waits on the sender's event). As
    SGLang's updater does, it keeps nothing: the engine copies out of the views and drops them
    before its ack, and torch's IPC deleter synchronizes the engine's stream when the last
    reference goes, so the copies have run when the sender hears the ack. No sync of its own: an
    extra one would hide an engine (or a receiver) that keeps a reference past its ack."""

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        return self._read(payload)

    def _read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        data = payload.parts[self.tp_rank].get("serialized")
        if data is None:
            raise ValueError(f"bucket {payload.manifest.index}: no serialized entry for TP rank {self.tp_rank}")
        if self.info.fields.get("decoder") == "sglang":
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            obj = MultiprocessingSerializer.deserialize(data)
            views = FlattenedTensorBucket(
                flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
            ).reconstruct_tensors()
            got = manifest_from_metadata(payload.manifest.index, obj["metadata"])
            if got.entries != payload.manifest.entries:
                raise ValueError(f"bucket {payload.manifest.index}: metadata does not match the manifest")
            return views
        return reconstruct(deserialize(data), payload.manifest)


# ---- disaggregated: broadcast on SGLang's group layout --------------------------------------------

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def sglang_group(store: Any, group_name: str, rank: int, size: int, timeout_s: float, backend: str) -> Any:
    """A process group keyed as SGLang's `init_custom_process_group` keys it (PrefixStore(group_name),
    then `_new_process_group_helper`'s "<group_name>/" and "<device>/"), built from `store` alone:
    never split from the default group, whatever device it is bound to."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), rank, size, _td(timeout_s))
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        opts.is_high_priority_stream = False
        group = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefixed), rank, size, opts)
    else:
        raise ValueError(f"backend {backend!r}: use gloo or nccl")
    group._set_sequence_number_for_group()
    return group


class SGLangBroadcastTransport(BroadcastTransport):
    """Disaggregated transport for SGLang's `init_weights_update_group` +
    `update_weights_from_distributed`: trainer rank 0 is group rank 0, engine i's TP rank j is
    rank 1 + rank_offset_i + j (SGLang's `rank_offset + tp_rank`)."""

    kind = "sglang_broadcast"
    make_group = staticmethod(sglang_group)

    def __init__(
        self,
        slots: int = 2,
        *,
        backend: str = "gloo",
        host: str | None = None,
        flattened: bool = True,
        group_name: str = DEFAULT_GROUP,
    ) -> None:
        super().__init__(slots, backend=backend, host=host, checksums=False, ops="bucket")
        self.flattened = flattened
        self.group_name = group_name

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        return plan_flattened(metas, bucket_bytes)

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        for manifest in plan:
            check_flattened(manifest)
        info = super().connect(plan, topology, rank)
        if self._sender:
            info["group"] = self._info["group"] = self.group_name
        return info

    def route(self, topology: Topology, engine: EngineSpec, tp_rank: int) -> int:
        return SOURCE_RANK

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        shared = dict(rank_infos[SOURCE_RANK])
        return {
            e.name: ConnectInfo(
                self.kind,
                f"{__name__}:SGLangBroadcastReceiver",
                fields={**shared, "rank_offset": 1 + e.rank_offset, "flattened": self.flattened},
                parts=tuple({"rank": 1 + e.rank_offset + j} for j in range(e.tp)),
            )
            for e in topology.engines
        }

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        fields = {"load_format": FLATTENED_BUCKET if self.flattened else None, "group_name": self.group_name}
        return {e.name: Payload(self.kind, manifest, fields, parts=({},) * e.tp) for e in topology.engines}

    def _send(self, index: int) -> None:
        manifest, buffer = self._sending(index)
        if self.flattened:
            _broadcast(self._group, buffer[: manifest.nbytes])
            return
        for entry in manifest.entries:  # one broadcast per tensor, in list order
            m = entry.meta
            _broadcast(self._group, buffer[entry.offset : entry.offset + m.nbytes].view(torch_dtype(m.dtype)))


class SGLangBroadcastReceiver(BroadcastReceiver):
    """Engine side of `SGLangBroadcastTransport` (one TP rank), as SGLang's weight updater does it:
    joins the group at attach (`init_custom_process_group`'s layout) and receives each bucket as
    one uint8 buffer (flattened) or one tensor at a time."""

    make_group = staticmethod(sglang_group)

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        import torch

        manifest = payload.manifest
        if payload.fields.get("load_format") == FLATTENED_BUCKET:
            check_flattened(manifest)
            buffer = torch.empty(manifest.nbytes, dtype=torch.uint8)
            _broadcast(self._group, buffer)
            return [
                (
                    e.meta.name,
                    buffer[e.offset : e.offset + e.meta.nbytes].view(torch_dtype(e.meta.dtype)).view(e.meta.shape),
                )
                for e in manifest.entries
            ]
        out = []
        for entry in manifest.entries:
            m = entry.meta
            tensor = torch.empty(m.shape, dtype=torch_dtype(m.dtype))
            _broadcast(self._group, tensor)
            out.append((m.name, tensor))
        return out


# ---- vLLM's packed layout: the same bytes ------------------------------------------------------
#
# vLLM 0.33's packed weight transfer concatenates tensors as raw uint8 with no padding, exactly as
# above; its consumer rebuilds the boundaries from names/dtype_names/shapes (NCCL: a chunk closes
# once its size exceeds packed_buffer_size_bytes, which refit sets to its largest bucket, so one
# bucket is one chunk) or from tensor_sizes (IPC). Offsets must be aligned for each dtype (vLLM's
# consumer fails otherwise, and its producer does not notice): plan_flattened's ordering does it.


class VLLMBroadcastTransport(SGLangBroadcastTransport):
    """Disaggregated transport for vLLM's NCCL weight transfer (`init_weight_transfer_engine` with
    master_address/master_port, then `update_weights` while trainer rank 0 broadcasts): packed, one
    uint8 broadcast per bucket; unpacked, one per tensor in `names` order. Engine i's workers are
    ranks 1 + rank_offset_i + j (vLLM's rank_offset + TP rank, one DP replica per engine).

    Backend ``nccl``: what a real vLLM server joins. The trainer speaks vLLM's rendezvous itself
    (`refit.drivers.vllm_nccl`: vLLM's StatelessProcessGroup store key and pickled ncclUniqueId,
    the NCCL library through ctypes as vLLM's own wrapper calls it, vLLM's one-element all-reduce
    warm-up). It needs a CUDA build of torch and a GPU on the trainer.
    Backend ``gloo``: the CPU stand-in that refit's emulated vLLM server joins (vLLM's own
    receiver is NCCL-only)."""

    kind = "vllm_nccl"

    def __init__(self, slots: int = 2, *, backend: str = "gloo", host: str | None = None, packed: bool = True) -> None:
        super().__init__(slots, backend=backend, host=host, flattened=packed, group_name="vllm_weight_transfer")
        if backend == "nccl":
            from refit.drivers.vllm_nccl import vllm_group

            self.make_group = vllm_group

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        if self.backend == "nccl" and rank == SOURCE_RANK:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(
                    "VLLMBroadcastTransport(backend='nccl') sends from a GPU: this trainer's torch sees no CUDA "
                    "device. A real vLLM server needs it; backend='gloo' only reaches refit's emulated vLLM server"
                )
        return super().connect(plan, topology, rank)

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        infos = super().attach_infos(rank_infos, topology)
        extra = {
            "packed": self.flattened,
            "packed_buffer_size_bytes": max(int(rank_infos[SOURCE_RANK].get("slot_bytes", 1)), 1),
            "packed_num_buffers": self.slots,
        }
        return {name: ConnectInfo(i.kind, i.receiver, {**i.fields, **extra}, i.parts) for name, i in infos.items()}


def device_key(tensor: torch.Tensor, tp_rank: int) -> str:
    """The key vLLM's IPC receiver looks its handle up by: the physical GPU's UUID (CUDA), or, for
    a CPU buffer (refit's emulated server only), ``cpu:<TP rank>``."""
    import torch

    if tensor.device.type == "cuda":
        return str(torch.cuda.get_device_properties(tensor.device).uuid)
    return f"cpu:{tp_rank}"


def ipc_args(buffer: torch.Tensor) -> Any:
    """What vLLM rebuilds a shared buffer from: CUDA, `reduce_tensor`'s rebuild_cuda_tensor args
    (vLLM overwrites the device index); CPU, the buffer serialized by shared-memory name (vLLM
    itself cannot open those: they serve refit's emulated server)."""
    if buffer.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(buffer)[1]
    return serialize(buffer)


class VLLMIPCTransport(SGLangTensorTransport):
    """Colocated transport for vLLM's IPC weight transfer, packed: each bucket is one shared uint8
    buffer; `update_weights` carries names/dtype_names/shapes, `tensor_sizes` and one handle per
    engine TP rank's device (`ipc_handles_pickled`)."""

    kind = "vllm_ipc"

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        return {
            e.name: ConnectInfo(self.kind, f"{__name__}:VLLMIPCReceiver", fields={"packed": True}, parts=({},) * e.tp)
            for e in topology.engines
        }

    payload_fields: ClassVar[dict[str, Any]] = {"packed": True}

    def _export(self, view: torch.Tensor, manifest: BucketManifest, tp_rank: int) -> Any:
        args = ipc_args(view)
        if view.is_cuda:
            self._counted(manifest.index, tp_rank, [(args[REF_COUNTER_ARGS[0]], int(args[REF_COUNTER_ARGS[1]]))])
        return device_key(view, tp_rank), args

    def _part(self, export: Any) -> dict[str, Any]:
        key, args = export
        return {"device": key, "args": args}


class VLLMIPCReceiver(Receiver):
    """Engine side of `VLLMIPCTransport` in refit's emulated vLLM server (one TP rank): looks its
    handle up by its device key and returns views of the bucket, as vLLM's packed IPC consumer
    splits it by `tensor_sizes`."""

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        handles = payload.fields.get("handles") or {}
        key = f"cpu:{self.tp_rank}"
        if key not in handles:
            raise ValueError(f"IPC handle not found for device {key}. Available: {sorted(handles)}")
        buffer = deserialize(handles[key])
        check_flattened(payload.manifest)
        return reconstruct({"flattened_tensor": buffer, "metadata": metadata_of(payload.manifest)}, payload.manifest)
