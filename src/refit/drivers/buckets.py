"""Bucket manifests: how a refit names the bytes it moves, without ever storing a tensor.

A bucket is a list of named tensors laid out in one flat byte buffer. Its manifest records each
tensor's name, dtype, shape, byte offset and size; traces, engines and transports all speak in
manifests. Planning needs only metadata, so `plan_buckets` never touches tensor data.

Packing is streaming: `pack_into` takes the bucket's tensors one at a time (a source may produce
them lazily), gathers a sharded tensor (DTensor) straight into its place in the buffer, and hashes
each tensor's bytes right after copying them, while they are still in cache (xxHash3), so
corruption detection costs no second pass over memory. `drain` makes the same collectives on a
rank that packs nothing. Torch is imported lazily, so this module is light.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ALIGN = 64  # byte alignment of every tensor in a bucket: any dtype view is legal at any offset

# dtypes a bucket may carry; anything else is refused by name rather than guessed.
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32 (the form used in manifests and SGLang's `dtypes` field)."""
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one refit moves (known: {', '.join(sorted(ITEMSIZE))})") from None


def torch_dtype(name: str) -> torch.dtype:
    import torch

    itemsize(name)
    return getattr(torch, name)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor as the engine will see it: engine (HF) name, dtype name, global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    meta: TensorMeta
    offset: int  # byte offset inside the bucket buffer


@dataclass(frozen=True, slots=True)
class BucketManifest:
    index: int
    entries: tuple[TensorEntry, ...]
    nbytes: int  # span of the bucket in its buffer, padding included
    oversized: bool = False  # one tensor larger than a bucket: it travels alone, in a buffer of its own

    @property
    def names(self) -> list[str]:
        return [e.meta.name for e in self.entries]

    @property
    def payload_bytes(self) -> int:
        return sum(e.meta.nbytes for e in self.entries)

    def summary(self) -> dict[str, Any]:
        """JSON-safe description for traces (no tensor data)."""
        out: dict[str, Any] = {
            "index": self.index,
            "nbytes": self.nbytes,
            "names": self.names,
            "dtypes": [e.meta.dtype for e in self.entries],
            "shapes": [list(e.meta.shape) for e in self.entries],
        }
        if self.oversized:
            out["oversized"] = True
        return out


def _align(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int, *, align: int = ALIGN) -> list[BucketManifest]:
    """Greedy, order-preserving bucketing by bytes.

    Tensors keep the source's order and start at `align`-byte offsets. A bucket closes when the
    next tensor would push it past `bucket_bytes`; a tensor larger than `bucket_bytes` travels
    alone in an `oversized` bucket (a transport gives it a buffer of its own rather than
    enlarging every slot).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[BucketManifest] = []
    entries: list[TensorEntry] = []
    offset = 0
    seen: set[str] = set()

    def close(oversized: bool = False) -> None:
        nonlocal entries, offset
        if entries:
            buckets.append(BucketManifest(len(buckets), tuple(entries), offset, oversized))
        entries, offset = [], 0

    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor {meta.name!r} appears twice in the source")
        seen.add(meta.name)
        if meta.nbytes > bucket_bytes:
            close()
            entries.append(TensorEntry(meta, 0))
            offset = meta.nbytes
            close(oversized=True)
            continue
        if entries and offset + meta.nbytes > bucket_bytes:
            close()
        entries.append(TensorEntry(meta, offset))
        offset = _align(offset + meta.nbytes, align)
    close()
    return buckets


def slot_bytes(plan: Sequence[BucketManifest]) -> int:
    """The size of a reusable slot: the largest bucket that is not oversized."""
    return max([m.nbytes for m in plan if not m.oversized] + [1])


# ---- packing -----------------------------------------------------------------------------------------


def _is_dtensor(tensor: Any) -> bool:
    return hasattr(tensor, "full_tensor") and hasattr(tensor, "placements")


def _shard0(tensor: Any) -> bool:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout): gathered straight into place."""
    from torch.distributed.tensor import Shard

    return tensor.device_mesh.ndim == 1 and tuple(tensor.placements) == (Shard(0),) and len(tensor.shape) > 0


def gather_into(out: torch.Tensor | None, tensor: Any, dtype: torch.dtype) -> int:
    """Write the full value of `tensor` (plain or DTensor) into `out`, cast to `dtype`; with
    `out=None` make the same collectives and drop the result (a rank that packs nothing). Every
    rank takes the same branch for the same tensor, so the collectives match. Returns the bytes
    of any temporary it had to allocate."""
    import torch
    import torch.distributed as dist

    if not _is_dtensor(tensor):
        if out is not None:
            out.copy_(tensor.detach())
        return 0
    temp = 0
    if _shard0(tensor):
        local = tensor.to_local().detach()
        if local.dtype != dtype:
            local = local.to(dtype)
            temp += local.nbytes
        local = local.contiguous()
        group = tensor.device_mesh.get_group()
        world, n = tensor.device_mesh.size(), tensor.shape[0]
        if n % world == 0:  # equal pieces: one all-gather into place
            target = out
            if target is None:
                target = torch.empty(tuple(tensor.shape), dtype=dtype, device=local.device)
                temp += target.nbytes
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(target, local, group=group)
            return temp
        # unequal pieces (torch.chunk's split, as FSDP2 uses; a rank may own none): each owner
        # broadcasts its rows straight into their place; empty pieces are skipped by every rank
        me, rows = dist.get_rank(group), -(-n // world)
        for r in range(world):
            lo, hi = r * rows, min((r + 1) * rows, n)
            if hi <= lo:
                continue
            if out is not None:
                piece = out[lo:hi]
            else:
                piece = torch.empty((hi - lo, *tensor.shape[1:]), dtype=dtype, device=local.device)
                temp = max(temp, piece.nbytes)
            if r == me:
                piece.copy_(local)
            dist.broadcast(piece, src=dist.get_global_rank(group, r), group=group)
        return temp
    full = tensor.detach().full_tensor()  # other layouts (several mesh dims, other dims): DTensor gathers
    temp += full.nbytes
    if out is not None:
        out.copy_(full)
    return temp


class _Hasher:
    def __init__(self) -> None:
        import xxhash

        self._h = xxhash.xxh3_64()

    def update(self, tensor: torch.Tensor) -> None:
        import torch

        raw = tensor.detach().reshape(-1)
        if raw.numel():
            self._h.update(raw.view(torch.uint8).numpy())

    def digest(self) -> int:
        return self._h.intdigest()


def checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """xxHash3-64 over the raw bytes of every tensor, in order (padding excluded, so any
    transport and any copy of the bytes agree)."""
    h = _Hasher()
    for _, tensor in tensors:
        h.update(tensor.contiguous() if not tensor.is_contiguous() else tensor)
    return h.digest()


@dataclass
class Packed:
    checksum: int | None
    temp_bytes: int  # the largest temporary a gather needed while packing


def pack_into(
    buffer: torch.Tensor | None,
    manifest: BucketManifest,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    hash_bytes: bool = False,
) -> Packed:
    """Copy (or gather) the bucket's tensors, taken one at a time, into the uint8 `buffer` at the
    manifest's offsets; `buffer=None` drains (same collectives, nothing kept). Refuses a tensor
    whose name, shape or dtype class does not match its manifest entry, naming it."""
    if buffer is not None and buffer.numel() < manifest.nbytes:
        raise ValueError(f"bucket {manifest.index} needs {manifest.nbytes} bytes, buffer has {buffer.numel()}")
    hasher = _Hasher() if hash_bytes and buffer is not None else None
    entries = iter(manifest.entries)
    peak = 0
    count = 0
    for name, tensor in tensors:
        entry = next(entries, None)
        if entry is None:
            raise ValueError(f"bucket {manifest.index}: the source gave more tensors than the {count} planned")
        meta = entry.meta
        if name != meta.name or tuple(int(d) for d in tensor.shape) != meta.shape:
            raise ValueError(
                f"bucket {manifest.index}: source tensor {name!r} {list(tensor.shape)} does not match manifest "
                f"entry {meta.name!r} {list(meta.shape)}"
            )
        dtype = torch_dtype(meta.dtype)
        view = None
        if buffer is not None:
            view = buffer[entry.offset : entry.offset + meta.nbytes].view(dtype).view(meta.shape)
        peak = max(peak, gather_into(view, tensor, dtype))
        if hasher is not None and view is not None:
            hasher.update(view)  # still in cache: no second pass over memory
        count += 1
    if count != len(manifest.entries):
        raise ValueError(
            f"bucket {manifest.index}: source gave {count} tensors, manifest lists {len(manifest.entries)}"
        )
    return Packed(hasher.digest() if hasher is not None else None, peak)


def unpack(buffer: torch.Tensor, manifest: BucketManifest) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of each tensor of the bucket inside `buffer` (valid until the buffer is reused)."""
    if buffer.numel() < manifest.nbytes:
        raise ValueError(
            f"bucket {manifest.index} is truncated: manifest spans {manifest.nbytes} bytes, buffer has {buffer.numel()}"
        )
    out = []
    for entry in manifest.entries:
        meta = entry.meta
        if entry.offset % itemsize(meta.dtype) or entry.offset + meta.nbytes > manifest.nbytes:
            raise ValueError(f"bucket {manifest.index}: entry {meta.name!r} has a bad offset {entry.offset}")
        raw = buffer[entry.offset : entry.offset + meta.nbytes]
        out.append((meta.name, raw.view(torch_dtype(meta.dtype)).view(meta.shape)))
    return out
