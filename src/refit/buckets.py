"""Bucket manifests: how a refit names the bytes it moves, without ever storing a tensor.

A bucket is a list of named tensors laid out in one flat byte buffer. Its manifest records each
tensor's name, dtype, shape, byte offset and size; traces, engines and transports all speak in
manifests. Planning needs only metadata, so `plan_buckets` never touches tensor data.

Packing is streaming: `pack_into` takes the bucket's tensors one at a time (a source may produce
them lazily) and gathers a sharded tensor (DTensor) straight into its place in the buffer; with
`buffer=None` it makes the same collectives on a rank that packs nothing. Checksums (xxHash3) hash
each tensor in 4 MiB pieces on several cores at once. Torch is imported lazily.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
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
    """One tensor as the engine will see it: engine (HF) name, dtype name, global shape, and for an
    attention projection the heads its rows hold when the source knows the model's config (an
    engine layout that replicates KV heads over TP ranks needs it: `attention_heads`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    heads: int | None = field(default=None, compare=False)

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

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by its fields in order (a slotted dataclass's
        return TensorMeta, (self.name, self.dtype, self.shape, self.heads)  # default walks fields())


@dataclass(frozen=True, slots=True)
class TensorEntry:
    meta: TensorMeta
    offset: int  # byte offset inside the bucket buffer

    def __reduce__(self) -> tuple[Any, ...]:
        return TensorEntry, (self.meta, self.offset)


@dataclass(frozen=True)
class BucketManifest:
    """One bucket: its tensors in buffer order. Immutable; what is derived from the entries (names,
    bytes, the trace's summary) is computed once per object (a plan is kept across refits)."""

    index: int
    entries: tuple[TensorEntry, ...]
    nbytes: int  # span of the bucket in its buffer, padding included
    oversized: bool = False  # one tensor larger than a bucket: it travels alone, in a buffer of its own

    def __reduce__(self) -> tuple[Any, ...]:
        return BucketManifest, (self.index, self.entries, self.nbytes, self.oversized)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    @functools.cached_property
    def _names(self) -> tuple[str, ...]:
        return tuple(e.meta.name for e in self.entries)

    @functools.cached_property
    def payload_bytes(self) -> int:
        return sum(e.meta.nbytes for e in self.entries)

    def summary(self) -> dict[str, Any]:
        """JSON-safe description for traces (no tensor data); a fresh dict, its lists shared."""
        return dict(self._summary)

    @functools.cached_property
    def _summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "nbytes": self.nbytes,
            "names": self.names,
            "dtypes": [e.meta.dtype for e in self.entries],
            "shapes": [list(e.meta.shape) for e in self.entries],
        }
        if any(e.meta.heads is not None for e in self.entries):
            out["heads"] = [e.meta.heads for e in self.entries]
        if self.oversized:
            out["oversized"] = True
        return out


# HF attention projections (Llama family) -> which head count their rows hold
HEAD_SUFFIXES = {
    "self_attn.q_proj.weight": "heads", "self_attn.q_proj.bias": "heads",
    "self_attn.k_proj.weight": "kv_heads", "self_attn.k_proj.bias": "kv_heads",
    "self_attn.v_proj.weight": "kv_heads", "self_attn.v_proj.bias": "kv_heads",
}  # fmt: skip


def head_counts(config: Any) -> tuple[int, int] | None:
    """(attention heads, KV heads) of a model config: transformers' (num_attention_heads,
    num_key_value_heads), Megatron's (num_attention_heads, num_query_groups), refit's ModelConfig
    (num_heads, num_kv_heads), or a mapping of the same keys; None when it names no head count."""

    import operator

    def get(key: str) -> Any:
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if value is None or isinstance(value, bool):
            return None
        try:
            return operator.index(value)  # numpy's integers too
        except TypeError:
            return int(value) if isinstance(value, float) and value.is_integer() else None

    heads = get("num_attention_heads") or get("num_heads")
    kv = get("num_key_value_heads") or get("num_query_groups") or get("num_kv_heads") or heads
    if heads is not None and kv is not None and heads > 0 and kv > 0:
        return heads, kv
    return None


def heads_by_name(names: Iterable[str], config: Any) -> dict[str, int]:
    """Name -> the heads its rows hold, for each q/k/v projection among `names`, from `config`
    (`head_counts`); empty when the config names no head count."""
    counts = head_counts(config) if config is not None else None
    if counts is None:
        return {}
    by = {"heads": counts[0], "kv_heads": counts[1]}
    out = {}
    for name in names:
        prefix, _, rest = name.partition("layers.")
        suffix = rest.partition(".")[2]
        if prefix and suffix in HEAD_SUFFIXES:
            out[name] = by[HEAD_SUFFIXES[suffix]]
    return out


def attention_heads(metas: Iterable[TensorMeta], config: Any) -> list[TensorMeta]:
    """`metas` with `heads` set on each q/k/v projection from `config` (`heads_by_name`)."""
    metas = list(metas)
    heads = heads_by_name((m.name for m in metas), config)
    return [replace(m, heads=heads[m.name]) if m.name in heads else m for m in metas]


def plan_heads(plan: Iterable[BucketManifest]) -> dict[str, int]:
    """Name -> heads of every planned tensor whose meta carries them."""
    return {e.meta.name: e.meta.heads for m in plan for e in m.entries if e.meta.heads is not None}


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


CHUNK = 1 << 20  # checksums hash each tensor's bytes in pieces of this size (small enough to stay in cache)
_POOL: Any = None


def _pool() -> Any:
    global _POOL  # noqa: PLW0603 - one lazily made pool per process
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(_workers(), thread_name_prefix="refit-hash")
    return _POOL


def _workers() -> int:
    import os

    return max(1, min(4, os.cpu_count() or 1))


def _raw(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a flat numpy uint8 array (no copy for a contiguous CPU tensor), read
    through its address: `Tensor.numpy()` would mark the storage unresizable, and a source may free
    what it handed out (`storage.resize_(0)`) once the next tensor is taken."""
    import ctypes

    import numpy as np

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return np.empty(0, dtype=np.uint8)
    if t.device.type != "cpu":
        raise ValueError(f"hashing reads host memory; this tensor is on {t.device}")
    view = (ctypes.c_uint8 * n).from_address(t.data_ptr())
    view.keep = t  # type: ignore[attr-defined]  # the array's buffer holds the tensor (a contiguous copy: its only owner)
    return np.frombuffer(view, dtype=np.uint8)


def _spread(pairs: Sequence[tuple[Any, Any]]) -> list[int]:
    """xxHash3-64 of every CHUNK-byte piece of each `(dst, src)` pair's `src` bytes, in order; with
    a `dst`, each piece is first copied there and hashed right after, while it is in cache. All
    pieces of all pairs are split in contiguous runs, one per core (xxhash and numpy's copy release
    the GIL), so many small tensors keep every core busy as one large one does."""
    import numpy as np
    import xxhash

    pieces = [(i, c) for i, (_, src) in enumerate(pairs) for c in range(0, src.size, CHUNK)]

    def work(a: int, b: int) -> list[int]:
        out = []
        for i, c in pieces[a:b]:
            dst, src = pairs[i]
            piece = src[c : c + CHUNK]
            if dst is not None:
                np.copyto(dst[c : c + CHUNK], piece)
                piece = dst[c : c + CHUNK]
            out.append(xxhash.xxh3_64_intdigest(piece))
        return out

    parts = min(_workers(), len(pieces))
    if parts <= 1:
        return work(0, len(pieces))
    bounds = [len(pieces) * i // parts for i in range(parts + 1)]
    out: list[int] = []
    for digests in _pool().map(work, bounds[:-1], bounds[1:]):
        out.extend(digests)
    return out


def chunk_digests(tensor: torch.Tensor) -> list[int]:
    """xxHash3-64 of each CHUNK-byte piece of the tensor's raw bytes."""
    return _spread([(None, _raw(tensor))])


def copy_digests(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Copy each `src` into its contiguous `dst` piece by piece and hash each piece right after
    copying it, while it is in cache: the same digests as `chunk_digests(src)` for each pair in
    turn, at almost no extra cost (one pass over memory for the whole bucket). Destinations must not
    overlap (tied weights): the pieces are copied in parallel, so a shared target would end mixed."""
    raws = []
    for dst, src in pairs:
        d, s = _raw_out(dst), _raw(src)
        if d.size != s.size:
            raise ValueError(f"copy of {s.size} bytes into {d.size}")
        raws.append((d, s))
    starts = [int(dst.data_ptr()) for dst, _ in pairs]
    spans = sorted((p, p + d.size) for p, (d, _) in zip(starts, raws, strict=True) if d.size)
    if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
        raise ValueError("copy_digests: two destinations overlap (the pieces are copied in parallel)")
    return _spread(raws)


def _raw_out(tensor: torch.Tensor) -> Any:
    import torch

    if not tensor.is_contiguous():
        raise ValueError("copy_digests writes into contiguous tensors only")
    return tensor.reshape(-1).view(torch.uint8).numpy()


def combine(digests: Sequence[int]) -> int:
    import array

    import xxhash

    return xxhash.xxh3_64_intdigest(array.array("Q", digests).tobytes())


def tensor_digest(tensor: torch.Tensor) -> int:
    """One tensor's xxHash3 digest of its raw bytes (read to the host when on a device)."""
    return combine(chunk_digests(tensor.detach().contiguous().cpu()))


def tensor_identity(tensor: Any) -> tuple[int, int]:
    """Where a tensor's bytes lie and how many times torch saw it written in place (its version
    counter): a digest taken earlier still holds while both are unchanged."""
    return int(tensor.data_ptr()), int(tensor._version)


def checksum(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """A bucket's checksum: xxHash3-64 over the per-chunk digests of every tensor's raw bytes, in
    order (padding excluded, so any transport and any copy of the bytes agree)."""
    return combine([d for _, tensor in tensors for d in chunk_digests(tensor)])


@dataclass
class Packed:
    checksum: int | None
    temp_bytes: int  # the largest temporary a gather needed while packing
    refs: list[Any] | None = None  # per entry: where it already lies (zero-copy), or None: copied into the buffer
    used_buffer: bool = False


def pack_into(
    buffer: torch.Tensor | Callable[[], torch.Tensor] | None,
    manifest: BucketManifest,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    hash_bytes: bool = False,
    refer: Callable[[TensorMeta, Any], Any] | None = None,
    known: Callable[[str, Any], list[int] | None] | None = None,
    views: dict[tuple[Any, ...], torch.Tensor] | None = None,
    per_tensor: dict[str, int] | None = None,
) -> Packed:
    """Copy (or gather) the bucket's tensors, taken one at a time, into the uint8 `buffer` at the
    manifest's offsets; `buffer=None` drains (same collectives, nothing kept). `buffer` may be a
    function that hands the buffer out on first need. `refer(meta, tensor)` may name where a tensor
    already lies in memory the engine can read (zero-copy): it is then not copied (and `known(name,
    tensor)` may already have its digests). `views`: a cache of the typed views into a buffer that
    is reused (building a view costs microseconds on a GPU). `per_tensor`: when the bytes are hashed
    (`hash_bytes`), each tensor's digest (`tensor_digest`, from the same pieces) is put there by
    name, so verification need not read it again. Refuses a tensor whose name or shape does not
    match its manifest entry, naming it."""
    digests: list[int] | None = [] if hash_bytes and buffer is not None else None
    entries = iter(manifest.entries)
    peak = 0
    count = 0
    refs: list[Any] = []
    buf: torch.Tensor | None = None
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
        count += 1
        ref = refer(meta, tensor) if (refer is not None and buffer is not None) else None
        refs.append(ref)
        if ref is not None:
            if digests is not None:
                _add(
                    digests,
                    (known(name, tensor) if known is not None else None) or chunk_digests(tensor),
                    name,
                    per_tensor,
                )
            continue
        dtype = torch_dtype(meta.dtype)
        view = None
        if buffer is not None:
            if buf is None:
                buf = buffer() if callable(buffer) else buffer
                if buf.numel() < manifest.nbytes:
                    raise ValueError(f"bucket {manifest.index} needs {manifest.nbytes} bytes, buffer has {buf.numel()}")
            key = (buf.data_ptr(), entry.offset, meta.dtype, meta.shape)
            view = views.get(key) if views is not None else None
            if view is None:
                view = buf[entry.offset : entry.offset + meta.nbytes].view(dtype).view(meta.shape)
                if views is not None:
                    views[key] = view
        plain = not hasattr(tensor, "placements") and tensor.dtype == dtype
        if plain and view is not None and digests is None:
            view.copy_(tensor.detach() if tensor.requires_grad else tensor)  # a plain tensor: no gather
            continue
        plain = plain and tensor.device.type == "cpu" and tensor.is_contiguous()
        if digests is not None and view is not None and plain:
            _add(
                digests, copy_digests([(view, tensor)]), name, per_tensor
            )  # one pass: each piece hashed while in cache
            continue
        peak = max(peak, gather_into(view, tensor, dtype))
        if digests is not None and view is not None:
            _add(digests, chunk_digests(view), name, per_tensor)
    if count != len(manifest.entries):
        raise ValueError(
            f"bucket {manifest.index}: source gave {count} tensors, manifest lists {len(manifest.entries)}"
        )
    zero_copy = any(r is not None for r in refs)
    return Packed(combine(digests) if digests is not None else None, peak, refs if zero_copy else None, buf is not None)


def _add(digests: list[int], pieces: list[int], name: str, per_tensor: dict[str, int] | None) -> None:
    digests.extend(pieces)
    if per_tensor is not None:
        per_tensor[name] = combine(pieces)


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
