"""Bucket manifests: how a refit names the bytes it moves, without ever storing a tensor.

A bucket is a list of named tensors laid out in one flat byte buffer. Its manifest records each
tensor's name, dtype, shape, byte offset and size; traces, engines and transports all speak in
manifests. Planning needs only metadata, so `plan_buckets` never touches tensor data.

Torch is imported lazily (inside `pack_into` / `unpack`), so this module is light.
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
    offset: int  # byte offset inside the bucket buffer, a multiple of ALIGN


@dataclass(frozen=True, slots=True)
class BucketManifest:
    index: int
    entries: tuple[TensorEntry, ...]
    nbytes: int  # span of the bucket in its buffer, padding included

    @property
    def names(self) -> list[str]:
        return [e.meta.name for e in self.entries]

    def summary(self) -> dict[str, Any]:
        """JSON-safe description for traces (no tensor data)."""
        return {
            "index": self.index,
            "nbytes": self.nbytes,
            "names": self.names,
            "dtypes": [e.meta.dtype for e in self.entries],
            "shapes": [list(e.meta.shape) for e in self.entries],
        }


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
    """Greedy, order-preserving bucketing by bytes.

    Tensors keep the source's order. A bucket closes when the next tensor would push it past
    `bucket_bytes`; a tensor larger than `bucket_bytes` travels alone in its own bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[BucketManifest] = []
    entries: list[TensorEntry] = []
    offset = 0
    seen: set[str] = set()

    def close() -> None:
        nonlocal entries, offset
        if entries:
            buckets.append(BucketManifest(len(buckets), tuple(entries), offset))
        entries, offset = [], 0

    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor {meta.name!r} appears twice in the source")
        seen.add(meta.name)
        size = _align(meta.nbytes)
        if entries and offset + meta.nbytes > bucket_bytes:
            close()
        entries.append(TensorEntry(meta, offset))
        offset += size
    close()
    return buckets


def pack_into(buffer: torch.Tensor, manifest: BucketManifest, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy `tensors` into the uint8 `buffer` at the manifest's offsets (non-contiguous input is fine)."""
    if len(tensors) != len(manifest.entries):
        raise ValueError(
            f"bucket {manifest.index}: source gave {len(tensors)} tensors, manifest lists {len(manifest.entries)}"
        )
    if buffer.numel() < manifest.nbytes:
        raise ValueError(f"bucket {manifest.index} needs {manifest.nbytes} bytes, buffer has {buffer.numel()}")
    for (name, tensor), entry in zip(tensors, manifest.entries, strict=True):
        meta = entry.meta
        got = TensorMeta.of(name, tensor)
        if got != meta:
            raise ValueError(f"bucket {manifest.index}: source tensor {got} does not match manifest entry {meta}")
        view = buffer[entry.offset : entry.offset + meta.nbytes].view(tensor.dtype).view(meta.shape)
        view.copy_(tensor)


def crc32(tensors: Sequence[tuple[str, torch.Tensor]]) -> int:
    """CRC-32 over the raw bytes of every tensor, in order (padding excluded, so any transport agrees)."""
    import zlib

    import torch

    crc = 0
    for _, tensor in tensors:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(raw.numpy(), crc)
    return crc


def unpack(buffer: torch.Tensor, manifest: BucketManifest) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of each tensor of the bucket inside `buffer` (valid until the buffer is reused)."""
    if buffer.numel() < manifest.nbytes:
        raise ValueError(
            f"bucket {manifest.index} is truncated: manifest spans {manifest.nbytes} bytes, buffer has {buffer.numel()}"
        )
    out = []
    for entry in manifest.entries:
        meta = entry.meta
        if entry.offset % ALIGN or entry.offset + meta.nbytes > manifest.nbytes:
            raise ValueError(f"bucket {manifest.index}: entry {meta.name!r} has a bad offset {entry.offset}")
        raw = buffer[entry.offset : entry.offset + meta.nbytes]
        out.append((meta.name, raw.view(torch_dtype(meta.dtype)).view(meta.shape)))
    return out
