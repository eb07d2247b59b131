"""`wsum`: a tensor digest a GPU computes in one read of its bytes, equal bit for bit to the same
digest computed on the host.

The spec (what both implementations compute): the tensor's raw bytes, zero-padded to a multiple of
4, as little-endian uint32 words w_i (i = 0, 1, ...). Two lanes, each the sum over i of a 31-bit
mix of the word with its index:
    a_i = fmix32(w_i ^ (i * 0x9E3779B1)) >> 1
    b_i = fmix32(w_i ^ (i * 0x85EBCA77) ^ 0x27D4EB2F) >> 1
(fmix32: murmur3's finalizer; products and index taken mod 2^32). A = sum a_i, B = sum b_i, exact
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

K_A, K_B, SALT_B = 0x9E3779B1, 0x85EBCA77, 0x27D4EB2F
M1, M2 = 0x85EBCA6B, 0xC2B2AE35
BLOCK = 4096  # words per GPU program
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
            lb = _fmix32_np(w ^ (i * np.uint32(K_B)) ^ np.uint32(SALT_B)) >> np.uint32(1)
            a += int(la.astype(np.uint64).sum(dtype=np.uint64))
            b += int(lb.astype(np.uint64).sum(dtype=np.uint64))
    return a, b


def host_digest(tensor: torch.Tensor) -> str:
    from refit.buckets import _raw

    raw = _raw(tensor.detach().cpu() if tensor.device.type != "cpu" else tensor)
    return finish(*host_lanes(raw), raw.size)


_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL  # noqa: PLW0603 - compiled once per process
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _fmix32(x):  # noqa: ANN001, ANN202 - a 32-bit value held in uint64 (products masked back to 32 bits)
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def wsum_kernel(src, out, n_words, BLOCK: tl.constexpr):  # noqa: ANN001, ANN202
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_words
        w = tl.load(src + offs, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        i = offs.to(tl.uint64) & 0xFFFFFFFF
        la = _fmix32(w ^ ((i * 0x9E3779B1) & 0xFFFFFFFF)) >> 1
        lb = _fmix32(w ^ ((i * 0x85EBCA77) & 0xFFFFFFFF) ^ 0x27D4EB2F) >> 1
        la = tl.where(mask, la.to(tl.int64), 0)
        lb = tl.where(mask, lb.to(tl.int64), 0)
        tl.store(out + 2 * pid, tl.sum(la, axis=0))
        tl.store(out + 2 * pid + 1, tl.sum(lb, axis=0))

    _KERNEL = wsum_kernel
    return _KERNEL


def gpu_lanes(tensor: torch.Tensor) -> torch.Tensor:
    """(A, B) of a CUDA tensor's bytes as a 2-element int64 tensor on its device (no sync)."""
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    n = raw.numel()
    if n == 0:
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    if n % 4 or raw.data_ptr() % 4:  # a padded, aligned copy (rare: odd-sized or oddly placed)
        padded = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=t.device)
        padded[:n].copy_(raw)
        raw = padded
    words = raw.view(torch.int32)
    programs = (words.numel() + BLOCK - 1) // BLOCK
    partial = torch.empty(programs * 2, dtype=torch.int64, device=t.device)
    _kernel()[(programs,)](words, partial, words.numel(), BLOCK=BLOCK)
    return partial.view(programs, 2).sum(dim=0)


class Batch:
    """Digests of many tensors with one host sync: GPU lanes are queued, `results` reads them all."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.sizes: list[int] = []
        self.lanes: list[Any] = []  # device tensors, or (A, B) already on the host

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            lanes: Any = gpu_lanes(tensor)
        else:
            from refit.buckets import _raw

            lanes = host_lanes(_raw(tensor))
        self.names.append(name)
        self.sizes.append(nbytes)
        self.lanes.append(lanes)

    def results(self) -> dict[str, str]:
        import torch

        on_device = [i for i, x in enumerate(self.lanes) if isinstance(x, torch.Tensor)]
        if on_device:
            host = torch.stack([self.lanes[i] for i in on_device]).cpu().tolist()
            for i, pair in zip(on_device, host, strict=True):
                self.lanes[i] = (pair[0], pair[1])
        return {n: finish(a, b, s) for n, (a, b), s in zip(self.names, self.lanes, self.sizes, strict=True)}
