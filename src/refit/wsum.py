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
`finish` reads a whole batch back with one sync). On the host, numpy (`host_lanes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

K_A, K_B, SALT_B = 0x9E3779B1, 0x85EBCA77, 0xA7D4EB2F
M1, M2 = 0x85EBCA6B, 0xC2B2AE35
BLOCK = 4096  # words per step of a GPU program
ITERS = 4  # steps per program (fewer programs: each finds its tensor once)
MASK32, MASK64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def finish(a: int, b: int, nbytes: int) -> str:
    """The digest from the two lane sums and the byte length (splitmix64, 16 hex digits)."""
    z = (a * 0x9E3779B97F4A7C15 + b * 0xC2B2AE3D27D4EB4F + nbytes) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return f"{z ^ (z >> 31):016x}"


def _fmix32_np(x: Any) -> Any:
    import numpy as np

    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(M1)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(M2)
    return x ^ (x >> np.uint32(16))


def host_lanes(raw: Any) -> tuple[int, int]:
    """(A, B) of a flat uint8 numpy array, in chunks (bounded temporaries)."""
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
            i = np.arange(start, stop, dtype=np.uint64).astype(np.uint32)
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


_KERNEL: Any = None


def _kernel() -> Any:
    """One launch hashes a whole batch: program p finds its tensor by binary search over the
    programs' prefix sums, reads BLOCK words of it and adds its lane sums atomically into that
    tensor's slot (integer adds: the order does not matter)."""
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
    def wsum_kernel(addrs, words, starts, n_tensors, out, BLOCK: tl.constexpr, ITERS: tl.constexpr):  # noqa: ANN001, ANN202
        pid = tl.program_id(0).to(tl.int64)
        lo = 0
        hi = n_tensors - 1
        while lo < hi:  # the last tensor whose first program is at or before this one
            mid = (lo + hi + 1) // 2
            if tl.load(starts + mid) <= pid:
                lo = mid
            else:
                hi = mid - 1
        base = tl.load(addrs + lo).to(tl.pointer_type(tl.int32))
        n = tl.load(words + lo)
        first = (pid - tl.load(starts + lo)) * (BLOCK * ITERS)
        sum_a = tl.sum(tl.zeros((1,), dtype=tl.int64), axis=0)
        sum_b = sum_a
        for k in tl.static_range(ITERS):
            offs = first + k * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            w = tl.load(base + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
            i = offs.to(tl.uint32)  # the index mod 2^32
            la = _fmix32(w ^ (i * 0x9E3779B1)) >> 1
            xb = (w ^ (i * 0x85EBCA77) ^ 0xA7D4EB2F) * 0x85EBCA6B
            lb = (xb ^ (xb >> 15)) >> 1
            sum_a += tl.sum(tl.where(mask, la, 0).to(tl.int64), axis=0)
            sum_b += tl.sum(tl.where(mask, lb, 0).to(tl.int64), axis=0)
        tl.atomic_add(out + 2 * lo, sum_a)
        tl.atomic_add(out + 2 * lo + 1, sum_b)

    _KERNEL = wsum_kernel
    return _KERNEL


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (an aligned, zero-padded copy when they are not)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    n = raw.numel()
    if n % 4 or raw.data_ptr() % 4:  # rare: odd-sized or oddly placed
        padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=t.device)
        padded[:n].copy_(raw)
        raw = padded
    return raw.view(torch.int32)


def gpu_lanes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(A, B) of each CUDA tensor (all on one device), as an [n, 2] int64 tensor on it: one kernel
    launch for all of them, no host sync. The tensors must stay alive until the kernel ran (the
    caller holds them, or frees them in stream order)."""
    import torch

    device = tensors[0].device
    out = torch.zeros((len(tensors), 2), dtype=torch.int64, device=device)
    words = [_words(t) for t in tensors]
    counts = [w.numel() for w in words]
    programs = [(c + BLOCK * ITERS - 1) // (BLOCK * ITERS) for c in counts]
    starts, total = [], 0
    for p in programs:
        starts.append(total)
        total += p
    live = [i for i, c in enumerate(counts) if c]  # empty tensors add nothing (their lanes stay 0)
    if not live:
        return out
    table = torch.tensor(
        [[words[i].data_ptr() for i in live], [counts[i] for i in live], [starts[i] for i in live]], dtype=torch.int64
    ).to(device)
    slots = torch.zeros((len(live), 2), dtype=torch.int64, device=device)
    _kernel()[(total,)](
        table[0], table[1], table[2] - starts[live[0]], len(live), slots, BLOCK=BLOCK, ITERS=ITERS, num_warps=8
    )
    out[torch.tensor(live, device=device)] = slots
    del words  # (the padded copies are freed in stream order, after the kernel)
    return out


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
        out = {}
        for name, lane, size in zip(self.names, self.lanes, self.sizes, strict=True):
            a, b = host[id(lane[0])][lane[1]] if isinstance(lane[0], torch.Tensor) else lane
            out[name] = finish(a, b, size)
        return out
