"""`wsum`: a tensor digest a GPU computes in one read of its bytes, equal bit for bit to the same
digest computed on the host.

The spec (what both implementations compute): the tensor's raw bytes, zero-padded to a multiple of
4, as little-endian uint32 words w_i (i = 0, 1, ...). Two lanes, each the sum over i of a 31-bit
mix of the word with its index:
    a_i = fmix32(w_i ^ (i * 0x9E3779B1)) >> 1
    b_i = mix(w_i ^ (i * 0x85EBCA77) ^ 0xA7D4EB2F) >> 1,   mix(x) = (x * 0x85EBCA6B) ^ (that >> 15)
(fmix32: murmur3's finalizer; products and index taken mod 2^32; lane B's lighter mix keeps a
GPU memory-bound). A = sum a_i, B = sum b_i, exact
(below 2^63 for any tensor under 16 GiB). The digest is splitmix64 of A, B and the byte length,
as 16 hex digits. A sum of per-word mixes is order-free, so a GPU reduces it in any order and
gets the same value; every word's mix depends on its position, so moved words change it; a
changed word changes each lane with probability 1 - 2^-31.

On CUDA a Triton kernel reads each word once (`gpu_lanes`; results stay on the device until
`finish` reads a whole batch back with one sync); the same kernel can copy each word as it hashes
it (`copy_lanes`, `Written`: an engine that hashes what it writes, at the cost of the copy alone).
On the host, numpy (`host_lanes`). A word's index counts from the start of the tensor it belongs
to, so pieces of one tensor can be hashed apart (at their offsets) and their lanes added.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

K_A, K_B, SALT_B = 0x9E3779B1, 0x85EBCA77, 0xA7D4EB2F
M1, M2 = 0x85EBCA6B, 0xC2B2AE35
BLOCK = 4096  # words per step of a GPU program
ITERS = 4  # steps per program (fewer programs: each finds its tensor once)
WARPS = 8  # warps per program (benchmarks/wsum_tune.py measured the choices: results/wsum_tune_7b_h100_*.json)
MASK32, MASK64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def finish(a: int, b: int, nbytes: int) -> str:
    """The digest from the two lane sums and the byte length (splitmix64, 16 hex digits)."""
    return finish_all([(a, b)], [nbytes])[0]


def finish_all(lanes: Any, sizes: list[int]) -> list[str]:
    """`finish` of many (A, B, byte length) at once (numpy's uint64 products wrap mod 2^64 as
    `finish` masks them): a few microseconds for a model's tensors instead of a Python loop."""
    import numpy as np

    if not len(lanes):
        return []
    with np.errstate(over="ignore"):
        ab = np.asarray(lanes).astype(np.uint64).reshape(-1, 2)
        z = ab[:, 0] * np.uint64(0x9E3779B97F4A7C15) + ab[:, 1] * np.uint64(0xC2B2AE3D27D4EB4F)
        z = z + np.array(sizes, dtype=np.uint64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    text = z.astype(">u8").tobytes().hex()  # big-endian: each 16-digit slice reads as the number
    return [text[i : i + 16] for i in range(0, len(text), 16)]


def _fmix32_np(x: Any) -> Any:
    import numpy as np

    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(M1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(M2)
    return x ^ (x >> np.uint32(16))


def host_lanes(raw: Any, first: int = 0) -> tuple[int, int]:
    """(A, B) of a flat uint8 numpy array whose first word has index `first`, in chunks (bounded
    temporaries)."""
    import numpy as np

    n = raw.size
    words = (n + 3) // 4
    a = b = 0
    step = 1 << 22  # words per chunk
    with np.errstate(over="ignore"):
        for start in range(0, words, step):
            stop = min(words, start + step)
            chunk = raw[start * 4 : min(n, stop * 4)]
            if chunk.size % 4:
                chunk = np.concatenate([chunk, np.zeros(4 - chunk.size % 4, dtype=np.uint8)])
            w = chunk.view("<u4").astype(np.uint32)
            i = np.arange(first + start, first + stop, dtype=np.uint64).astype(np.uint32)
            la = _fmix32_np(w ^ (i * np.uint32(K_A))) >> np.uint32(1)
            xb = (w ^ (i * np.uint32(K_B)) ^ np.uint32(SALT_B)) * np.uint32(M1)
            lb = (xb ^ (xb >> np.uint32(15))) >> np.uint32(1)
            a += int(la.astype(np.uint64).sum(dtype=np.uint64))
            b += int(lb.astype(np.uint64).sum(dtype=np.uint64))
    return a, b


def host_digest(tensor: torch.Tensor) -> str:
    from refit.buckets import _raw

    raw = _raw(tensor.detach().cpu() if tensor.device.type != "cpu" else tensor)
    return finish(*host_lanes(raw), raw.size)


MAX_ROW_WORDS = 1 << 28  # a longer piece is split (its programs index it with int32 offsets)


def plan_rows(
    pieces: list[tuple[int, int | None, int, int, int]], anchor: int
) -> tuple[list[list[int]], list[list[int]]]:
    """The kernel's work table, as pure data. A piece is (source address, destination address or
    None, byte length, slot, index of its first word in the slot's tensor); addresses are 4-byte
    aligned and, with a destination, the length is a whole number of words. Returns (aligned rows,
    other rows), each row [source offset, destination offset, words, first index, slot]: aligned
    rows count offsets and words in 16-byte units (so the compiler can prove every access is a
    whole, aligned 16-byte vector); a piece that is not 16-byte aligned, or its last 1-3 words, go
    to the others, in words. Offsets are from `anchor` (any 16-byte aligned address)."""
    aligned: list[list[int]] = []
    other: list[list[int]] = []
    for src, dst, nbytes, slot, first in pieces:
        words = (nbytes + 3) // 4
        if dst is not None and nbytes % 4:
            raise ValueError(f"a copy of {nbytes} bytes is not a whole number of words")
        d = anchor if dst is None else dst
        head = 0
        if (src - anchor) % 16 == 0 and (d - anchor) % 16 == 0:
            head = words // 4 * 4
            for w0 in range(0, head, MAX_ROW_WORDS):
                n = min(MAX_ROW_WORDS, head - w0)
                aligned.append([(src - anchor) // 16 + w0 // 4, (d - anchor) // 16 + w0 // 4, n // 4, first + w0, slot])
        for w0 in range(head, words, MAX_ROW_WORDS):
            n = min(MAX_ROW_WORDS, words - w0)
            other.append([(src - anchor) // 4 + w0, (d - anchor) // 4 + w0, n, first + w0, slot])
    return aligned, other


_KERNEL: Any = None


def _kernel() -> Any:
    """One launch hashes (and, with COPY, copies) a whole table of pieces: program p finds its row
    by binary search over the rows' first programs, reads BLOCK * ITERS words of it (with COPY,
    writing each where the row says), and adds its lane sums atomically into the row's slot
    (integer adds: the order does not matter). ALIGNED rows count in 16-byte units, so the compiler
    knows every access is a whole 16-byte vector: the kernel runs at memory bandwidth."""
    global _KERNEL  # noqa: PLW0603 - compiled once per process
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _fmix32(x):  # noqa: ANN001, ANN202 - uint32 throughout: products wrap mod 2^32, shifts are logical
        x = x ^ (x >> 16)
        x = x * 0x85EBCA6B
        x = x ^ (x >> 13)
        x = x * 0xC2B2AE35
        return x ^ (x >> 16)

    @triton.jit
    def wsum_kernel(  # noqa: ANN202
        src_base, dst_base, table, starts, n_rows, out,  # noqa: ANN001
        BLOCK: tl.constexpr, ITERS: tl.constexpr, COPY: tl.constexpr, ALIGNED: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        lo = 0
        hi = n_rows - 1
        while lo < hi:  # the last row whose first program is at or before this one
            mid = (lo + hi + 1) // 2
            if tl.load(starts + mid) <= pid:
                lo = mid
            else:
                hi = mid - 1
        row = table + 5 * lo.to(tl.int64)
        if ALIGNED:  # 16-byte units: the compiler can prove 16-byte alignment of every access
            src = src_base + tl.load(row) * 4
            dst = dst_base + tl.load(row + 1) * 4
            n = tl.load(row + 2).to(tl.int32) * 4
        else:
            src = src_base + tl.load(row)
            dst = dst_base + tl.load(row + 1)
            n = tl.load(row + 2).to(tl.int32)
        index0 = tl.load(row + 3).to(tl.uint32)  # the slot's word index of this row's first word, mod 2^32
        slot = tl.load(row + 4)
        first = (pid - tl.load(starts + lo)) * (BLOCK * ITERS)
        sum_a = tl.sum(tl.zeros((1,), dtype=tl.int64), axis=0)
        sum_b = sum_a
        for k in tl.static_range(ITERS):
            offs = first + k * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            w = tl.load(src + offs, mask=mask, other=0)
            if COPY:
                tl.store(dst + offs, w, mask=mask)
            u = w.to(tl.uint32, bitcast=True)
            i = offs.to(tl.uint32) + index0
            la = _fmix32(u ^ (i * 0x9E3779B1)) >> 1
            xb = (u ^ (i * 0x85EBCA77) ^ 0xA7D4EB2F) * 0x85EBCA6B
            lb = (xb ^ (xb >> 15)) >> 1
            # each step's sums reduced at once: per-thread int64 accumulators cost registers, and
            # the occupancy they take made the kernel 1.7x slower (benchmarks/wsum_tune.py)
            sum_a += tl.sum(tl.where(mask, la, 0).to(tl.int64), axis=0)
            sum_b += tl.sum(tl.where(mask, lb, 0).to(tl.int64), axis=0)
        tl.atomic_add(out + 2 * slot, sum_a)
        tl.atomic_add(out + 2 * slot + 1, sum_b)

    _KERNEL = wsum_kernel
    return _KERNEL


_ANCHORS: dict[Any, Any] = {}
_TABLES: dict[tuple[Any, ...], Any] = {}  # work tables already on a device, by content (a refit repeats its buckets')
TABLES_KEPT = 1024


def _anchor(device: Any) -> torch.Tensor:
    """A small int32 tensor per device whose address the kernel's offsets count from."""
    import torch

    t = _ANCHORS.get(device)
    if t is None:
        t = _ANCHORS[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return t


def prepare(pieces: list[tuple[int, int | None, int, int, int]], device: Any) -> list[tuple[Any, int, int, bool]]:
    """The kernel's work tables for `pieces` (see `plan_rows`) on `device`, built once: per launch,
    (table, rows, programs, aligned). A caller that repeats the same pieces (the same addresses)
    keeps them and calls `run`, paying none of this host work again."""
    import torch

    anchor = _anchor(device)
    aligned, other = plan_rows(pieces, anchor.data_ptr())
    out = []
    for rows, is_aligned in ((aligned, True), (other, False)):
        if not rows:
            continue
        units = 4 if is_aligned else 1
        starts, total = [], 0
        for r in rows:
            starts.append(total)
            total += (r[2] * units + BLOCK * ITERS - 1) // (BLOCK * ITERS)
        flat = [v for r in rows for v in r] + starts
        key = (device, BLOCK, ITERS, *flat)
        table = _TABLES.get(key)
        if table is None:  # (the caching host allocator keeps the pinned copy until it has been read)
            if len(_TABLES) >= TABLES_KEPT:
                _TABLES.clear()
            host = torch.tensor(flat, dtype=torch.int64, pin_memory=True)
            table = _TABLES[key] = host.to(device, non_blocking=True)
        out.append((table, len(rows), total, is_aligned))
    return out


def run(prepared: list[tuple[Any, int, int, bool]], out: torch.Tensor, *, copy: bool) -> None:
    """Queue the kernel over `prepare`'s tables, adding lane sums into `out`; no host sync."""
    anchor = _anchor(out.device)
    for table, rows, total, is_aligned in prepared:
        _kernel()[(total,)](
            anchor, anchor, table, table[5 * rows :], rows, out,
            BLOCK=BLOCK, ITERS=ITERS, COPY=copy, ALIGNED=is_aligned, num_warps=WARPS,
        )  # fmt: skip


def launch(pieces: list[tuple[int, int | None, int, int, int]], out: torch.Tensor, *, copy: bool) -> None:
    """Queue the kernel over `pieces` (see `plan_rows`), adding lane sums into `out` ([slots, 2]
    int64 on the device the addresses are on); with `copy`, every piece is also copied to its
    destination. Two launches at most, no host sync (the table goes up from pinned memory)."""
    run(prepare(pieces, out.device), out, copy=copy)


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, contiguous and 4-byte aligned (an aligned, zero-padded copy when they are not)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    if raw.data_ptr() % 4 or raw.numel() % 4:  # rare: oddly placed or sized
        padded = torch.zeros((raw.numel() + 3) // 4 * 4, dtype=torch.uint8, device=t.device)
        padded[: raw.numel()].copy_(raw)
        raw = padded
    return raw


def gpu_lanes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(A, B) of each CUDA tensor (all on one device), as an [n, 2] int64 tensor on it: one kernel
    launch for all of them, no host sync. The tensors must stay alive until the kernel ran (the
    caller holds them, or frees them in stream order)."""
    import torch

    out = torch.zeros((len(tensors), 2), dtype=torch.int64, device=tensors[0].device)
    raws = [_words(t) for t in tensors]  # a partial last word is read from a zero-padded copy
    pieces: list[tuple[int, int | None, int, int, int]] = [
        (r.data_ptr(), None, r.numel(), slot, 0) for slot, r in enumerate(raws) if r.numel()
    ]  # an empty tensor adds nothing (its lanes stay 0)
    if pieces:
        launch(pieces, out, copy=False)
    del raws  # (the aligned copies are freed in stream order, after the kernel)
    return out


def copy_pieces(
    pairs: list[tuple[torch.Tensor, torch.Tensor, int, int]],
) -> tuple[list[tuple[int, int | None, int, int, int]], list[int]]:
    """`copy_lanes`'s pieces for each (dst, src, slot, first word index) it can copy as words (both
    contiguous and 4-byte aligned on one GPU, a whole number of words), and the positions of the
    pairs it cannot."""
    pieces: list[tuple[int, int | None, int, int, int]] = []
    left = []
    for k, (dst, src, slot, first) in enumerate(pairs):
        nbytes = dst.numel() * dst.element_size()
        ok = (
            dst.is_cuda and src.device == dst.device  # (a host source: torch copies it)
            and dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape
            and nbytes % 4 == 0 and dst.data_ptr() % 4 == 0 and src.data_ptr() % 4 == 0
        )  # fmt: skip
        if not ok:
            left.append(k)
        elif nbytes:
            pieces.append((src.data_ptr(), dst.data_ptr(), nbytes, slot, first))
    return pieces, left


def copy_lanes(pairs: list[tuple[torch.Tensor, torch.Tensor, int, int]], out: torch.Tensor) -> list[int]:
    """Copy each (dst, src, slot, first word index) and add the lanes of the bytes written into
    `out[slot]`, in one pass over memory (the digest fused into the copy). Pairs it cannot copy as words (not both
    contiguous and 4-byte aligned, or not a whole number of words) are left alone: their positions
    in `pairs` are returned, for the caller to copy (and hash) another way."""
    pieces, left = copy_pieces(pairs)
    if pieces:
        launch(pieces, out, copy=True)
    return left


class Batch:
    """Digests of many tensors with one host sync: `add` queues, `flush` hashes what is queued in
    one launch per device (drop your references after it: the lanes stay on the device), and
    `results` reads every lane back at once."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.sizes: list[int] = []
        self.lanes: list[Any] = []  # per name: (A, B) on the host, or (device tensor, row)
        self._queued: list[tuple[int, Any]] = []  # (index into names, CUDA tensor)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.names.append(name)
        self.sizes.append(tensor.numel() * tensor.element_size())
        if tensor.device.type == "cuda":
            self.lanes.append(None)
            self._queued.append((len(self.names) - 1, tensor))
        else:
            from refit.buckets import _raw

            self.lanes.append(host_lanes(_raw(tensor)))

    def flush(self) -> None:
        by_device: dict[Any, list[tuple[int, Any]]] = {}
        for i, t in self._queued:
            by_device.setdefault(t.device, []).append((i, t))
        self._queued = []
        for queued in by_device.values():
            lanes = gpu_lanes([t for _, t in queued])
            for row, (i, _) in enumerate(queued):
                self.lanes[i] = (lanes, row)

    def results(self) -> dict[str, str]:
        import torch

        self.flush()
        blocks = {id(x[0]): x[0] for x in self.lanes if isinstance(x[0], torch.Tensor)}
        host = {k: v.cpu().tolist() for k, v in blocks.items()}  # one sync for the lot
        lanes = [host[id(x[0])][x[1]] if isinstance(x[0], torch.Tensor) else x for x in self.lanes]
        return dict(zip(self.names, finish_all(lanes, self.sizes), strict=True))


class Regions:
    """Named regions of memory (an engine's served tensors) indexed by address, built once while
    the tensors stay where they are: what `Written` credits each write to."""

    def __init__(self, regions: dict[str, torch.Tensor]) -> None:
        import torch

        self.names = list(regions)
        self.sizes = [t.numel() * t.element_size() for t in regions.values()]
        tensors = list(regions.values())
        self.spans = sorted(
            (t.data_ptr(), t.data_ptr() + size, slot)
            for slot, (t, size) in enumerate(zip(tensors, self.sizes, strict=True))
            if size and t.is_contiguous()
        )
        self.starts = [s for s, _, _ in self.spans]
        self.device = tensors[0].device if tensors else torch.device("cpu")
        for (_, end, a), (start, _, b) in zip(self.spans, self.spans[1:], strict=False):
            if start < end:  # a write must be credited to one place only
                raise ValueError(f"regions {self.names[a]!r} and {self.names[b]!r} overlap")

    def place(self, dst: torch.Tensor) -> tuple[int, int] | None:
        """(slot, index of the first word) of the region `dst` lies wholly in, or None."""
        ptr = dst.data_ptr()
        k = bisect.bisect_right(self.starts, ptr) - 1
        if k < 0:
            return None
        start, end, slot = self.spans[k]
        nbytes = dst.numel() * dst.element_size()
        if ptr + nbytes > end or (ptr - start) % 4:
            return None
        return slot, (ptr - start) // 4

    def plan(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyPlan:
        """A `Written`'s copy of `pairs` ((dst, src), same shape and dtype), as data: valid for any
        `Written` over these regions while the pairs' tensors stay where they are (a caller copying
        the same pairs again keeps it). On CUDA the kernel's tables are built here (`prepare`: the
        host work a kept plan does not pay again)."""
        hashed: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        plain: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            place = self.place(dst) if dst.is_contiguous() else None
            if place is None:
                plain.append((dst, src))
            else:
                hashed.append((dst, src, *place))
        launches = None
        if self.device.type == "cuda" and hashed:
            pieces, left = copy_pieces(hashed)
            plain += [hashed[k][:2] for k in left]
            skip = set(left)
            hashed = [h for k, h in enumerate(hashed) if k not in skip]
            launches = prepare(pieces, self.device) if pieces else []
        credits = [(slot, first * 4, dst.numel() * dst.element_size()) for dst, _s, slot, first in hashed]
        return CopyPlan(self, hashed, plain, credits, launches)


@dataclass
class CopyPlan:
    """`Written.plan`'s result: the pairs hashed as they are copied ((dst, src, slot, first word)),
    the pairs copied plainly (read back at verify), each hashed write's (slot, byte offset, bytes),
    and on CUDA the kernel's prepared tables (`prepare`)."""

    index: Regions
    hashed: list[tuple[Any, Any, int, int]]
    plain: list[tuple[Any, Any]]
    credits: list[tuple[int, int, int]]
    launches: list[tuple[Any, int, int, bool]] | None


class Written:
    """The lanes of the bytes written into named regions of memory (an engine's served tensors)
    during one update, computed as they are copied: `copy` copies (dst, src) pairs and credits
    each write to the region its destination lies in, found by address (a write into the wrong
    place is credited to that place, at its offset there). `results` gives the digest of each
    region written whole and exactly once; every other region (never written, partly written, or
    written by another path: `missed`) is left for the caller to hash from memory. On CUDA the
    copy and the hash are one kernel pass (`copy_lanes`); on the host, a copy then `host_lanes`."""

    def __init__(self, regions: Regions | dict[str, torch.Tensor]) -> None:
        import torch

        index = regions if isinstance(regions, Regions) else Regions(regions)
        self.index = index
        self._bisect = bisect.bisect_right
        self.names, self.sizes = index.names, index.sizes
        self._starts, self._spans = index.starts, index.spans
        device = index.device
        self.cuda = device.type == "cuda"
        self.lanes: Any = (
            torch.zeros((len(self.names), 2), dtype=torch.int64, device=device)
            if self.cuda
            else [[0, 0] for _ in self.names]
        )
        # per region, the (byte offset, length) of each write credited to it; None: it must be read back
        self.pieces: list[list[tuple[int, int]] | None] = [[] for _ in self.names]
        self._host: Any = None  # CUDA: the lanes staged in pinned host memory (`stage`), while current
        # how many regions so far got exactly one write, of the whole region, and nothing else (while
        # every credit was such a first whole write): when it is all of them, `report` looks at none
        self._whole_once: int | None = 0

    def touched(self, dst: torch.Tensor) -> None:
        """A write not hashed: every region its bytes (strided or not) reach must be read back."""
        if not dst.numel():
            return
        self._whole_once = None
        lo = dst.data_ptr()
        hi = lo + (sum((n - 1) * st for n, st in zip(dst.shape, dst.stride(), strict=True)) + 1) * dst.element_size()
        k = max(self._bisect(self._starts, lo) - 1, 0)
        while k < len(self._spans) and self._spans[k][0] < hi:
            _, stop, slot = self._spans[k]
            if lo < stop:
                self.pieces[slot] = None
            k += 1

    def stage(self) -> None:
        """CUDA: queue the lanes' copy to pinned host memory on the current stream, for a caller
        that is about to synchronize it anyway (an engine's finalize), once every write that feeds
        them is ordered before it: `report` then reads them without a sync of its own. A later
        `copy` makes the staged lanes stale (`report` reads the device's again)."""
        if self.cuda:
            import torch

            host = torch.empty(self.lanes.shape, dtype=self.lanes.dtype, pin_memory=True)
            host.copy_(self.lanes, non_blocking=True)
            self._host = host

    def copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (dst, src) pair (same shape and dtype), hashing what is written."""
        self.run(self.plan(pairs))

    def plan(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyPlan:
        """`copy`'s work for `pairs` (`Regions.plan`)."""
        return self.index.plan(pairs)

    def run(self, plan: CopyPlan) -> None:
        """Do `plan`'s copies (one kernel pass on CUDA), crediting each hashed write to its region."""
        if plan.index is not self.index:
            raise ValueError("a copy plan made for other regions")
        self._host = None
        if plan.launches is not None:
            run(plan.launches, self.lanes, copy=True)
        elif plan.hashed:
            from refit.buckets import _raw

            for dst, src, slot, first in plan.hashed:
                dst.copy_(src)
                a, b = host_lanes(_raw(dst), first)
                self.lanes[slot][0] += a
                self.lanes[slot][1] += b
        once, sizes = self._whole_once, self.sizes
        for slot, offset, nbytes in plan.credits:
            kept = self.pieces[slot]
            if kept is not None:
                if once is not None:
                    once = once + 1 if not kept and offset == 0 and nbytes == sizes[slot] else None
                kept.append((offset, nbytes))
            else:
                once = None
        self._whole_once = once
        for dst, src in plan.plain:
            dst.copy_(src)
            self.touched(dst)

    def _whole(self, slot: int) -> bool:
        """Whether the writes credited to a region cover it exactly once: no gap, no overlap."""
        pieces = self.pieces[slot]
        if pieces is None:
            return False
        if len(pieces) == 1:  # the common case: one write of the whole region
            return pieces[0] == (0, self.sizes[slot])
        at = 0
        for offset, n in sorted(pieces):
            if offset != at:
                return False
            at += n
        return at == self.sizes[slot]

    def missed(self) -> list[str]:
        """The regions whose digest `results` cannot give: read them back."""
        return self.report()[1]

    def results(self) -> dict[str, str]:
        """The digest of every region written whole (one host sync on CUDA)."""
        return self.report()[0]

    def report(self) -> tuple[dict[str, str], list[str]]:
        """(`results`, `missed`) in one pass over the regions."""
        import numpy as np

        sizes = self.sizes
        if self._whole_once == len(sizes):  # every region written whole, once (an adapter's load)
            whole, missed = None, []
        else:
            whole, missed = [], []
            for k, pieces in enumerate(self.pieces):  # (the common case, one write of the whole region, inline)
                ok = pieces is not None and (pieces == [(0, sizes[k])] if len(pieces) == 1 else self._whole(k))
                (whole if ok else missed).append(k)
            if not whole:
                return {}, [self.names[k] for k in missed]
        if self.cuda:
            lanes = (self._host if self._host is not None else self.lanes.cpu()).numpy()
        else:
            lanes = np.array(self.lanes, dtype=np.uint64).reshape(-1, 2)
        if whole is None:
            return dict(zip(self.names, finish_all(lanes, sizes), strict=True)), []
        digests = finish_all(lanes[whole], [sizes[k] for k in whole])
        return dict(zip([self.names[k] for k in whole], digests, strict=True)), [self.names[k] for k in missed]
