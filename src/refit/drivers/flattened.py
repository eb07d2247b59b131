"""SGLang's flattened-bucket wire format (vLLM's packed buckets are the same bytes).

A flattened bucket is one uint8 tensor holding a bucket's tensors back to back, plus one metadata
record per tensor (name, shape, dtype, byte start/end, byte count), as
`sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket` (0.5.6 .. 0.5.23) builds and reads
it. SGLang inserts no padding, and its receiver for `update_weights_from_distributed` computes
the offsets itself (refusing one that is not a multiple of the dtype's size), so `plan_flattened`
keeps each bucket contiguous and orders its tensors by element size, largest first: every offset
is then aligned for its dtype with no padding at all.

Serialized (`serialize`, one call per consumer: SGLang requires one export per consumer,
sglang#4446), a bucket is `{"flattened_tensor": buffer, "metadata": [...]}` pickled with only the
allow-listed types SGLang's `SafeUnpickler` accepts (torch rebuild functions, `SimpleNamespace`).
CPU buffers travel by shared-memory name (`rebuild_storage_filename`), which any process on the
host can open, whatever its multiprocessing family; CUDA buffers as CUDA IPC handles in SGLang's
form: rebuilt by SGLang's patched `_rebuild_cuda_tensor_modified`, the device given as the GPU's
UUID (refit writes that form itself: SGLang's torch-reduction patch, applied process-wide, would
break CPU tensor pickling in the trainer). `deserialize` reads it back through a safe unpickler
that refuses any other global; `reconstruct` returns each tensor's view, checked against the
manifest. `ipc_refs` reads torch's reference counter of one CUDA export.

The transports that speak it live in `refit.drivers.sglang_transport` (SGLang's tensor and
broadcast transports) and `refit.drivers.vllm_transport` (vLLM's IPC and NCCL transports).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest, TensorEntry, TensorMeta, dtype_name, itemsize, pack_into, torch_dtype
from refit.drivers.pickling import ByNamePickler

if TYPE_CHECKING:
    import torch

FLATTENED_BUCKET = "flattened_bucket"  # SGLang's load_format for this layout

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
            return _Nothing
        return found


class _Nothing:
    """What a peek makes of what would open a storage: called (a rebuild function) or built as
    an object (`multiprocessing.resource_sharer.DupFd`, which torch's file-descriptor sharing
    pickles as a class: SGLang's own serializer on the host), it opens nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Nothing:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


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


def manifest_from_metadata(index: int, metadata: Sequence[Any], *, as_sglang: bool = False) -> BucketManifest:
    """A bucket manifest read from flattened-bucket metadata (what an engine knows from the body).
    `as_sglang`: use only what SGLang 0.5.23 uses (weight_sync/tensor_bucket.py
    `FlattenedTensorBucket.reconstruct_tensors`: name, shape, dtype, start_idx, end_idx; `numel`
    must be there, `_update_weights_from_flattened_bucket` copies it, but its value is never used)
    and accept a bucket with no tensors (SGLang loads nothing and answers success).
    A span its shape and dtype do not fill is refused either way (SGLang's view or reshape raises)."""
    entries, end = [], 0
    for m in metadata:
        try:
            meta = TensorMeta(str(m.name), dtype_name(m.dtype), tuple(int(d) for d in m.shape))
            start, stop = int(m.start_idx), int(m.end_idx)
            if as_sglang:
                _ = m.numel  # copied by `_update_weights_from_flattened_bucket`: it must be there, unused
                numel = meta.nbytes
            else:
                numel = int(m.numel)
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
    if not entries and not as_sglang:
        raise ValueError("a flattened bucket with no tensors")
    return BucketManifest(index, tuple(entries), end)


def reconstruct(
    bucket: dict[str, Any], manifest: BucketManifest, *, as_sglang: bool = False
) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor of a decoded flattened bucket (as SGLang's `reconstruct_tensors`), after
    checking them against the manifest the engine expects (`as_sglang`: the metadata read as SGLang
    reads it, `manifest_from_metadata`)."""
    import torch

    flat = bucket.get("flattened_tensor") if isinstance(bucket, dict) else None
    meta = bucket.get("metadata") if isinstance(bucket, dict) else None
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1 or meta is None:
        raise ValueError("not a flattened bucket: expected a 1-D uint8 'flattened_tensor' and its 'metadata'")
    got = manifest_from_metadata(manifest.index, meta, as_sglang=as_sglang)
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
