"""SGLang's checksum of a tensor on CUDA, reproduced: the value its `/weights_checker` reports for a
parameter when the server runs on a GPU, computed here from a trainer's tensors on any device.

What SGLang 0.5.23 computes there (read in its source): utils/weight_checker.py `_hash_tensor` calls
managers/mm_utils.py `tensor_hash`, which for a CUDA tensor calls
kernels/ops/memory/gpu_tensor_hash.py `gpu_tensor_hash` with its defaults. That function:
  * views the tensor's bytes as little-endian uint32 words w_i, the last word zero-padded
    (`_as_uint32_words`); n words, i counted from 0 over the whole tensor;
  * for each tile of 8192 words (`hash_tiles32_kernel_blocked`, one Triton program per tile) sums,
    mod 2^32, two lanes of per-word mixes
        k1_i = fmix32(w_i ^ ((i * 0x27D4EB2D + s1) ^ rotl32(i, 15)))
        k2_i = fmix32(w_i ^ ((i * 0x165667B1 + s2) ^ rotl32(i, 13)))
    (fmix32: murmur3's finalizer; s1 and s2 from the seed 0x243F6A88), xors each lane sum with the
    byte count 4n, applies fmix32 again, and stores the tile's value (h1 << 32) | h2;
  * adds the tiles' values mod 2^64 (`add_tree_reduce_u64_kernel`, any tree of additions is the
    same sum) and applies splitmix64's finalizer (`_final_splitmix64`);
  * `_hash_tensor` writes it as 16 hex digits.

`TileHash` computes the same value from pieces fed in order (the bytes of a fused parameter built
from the trainer's q, k and v shards, say), without concatenating them: on the host with numpy; on
CUDA with refit's own Triton kernel (`_kernel`), once a probe on that device agrees with the torch
integer ops (`_triton_ok`), else with those ops. Valid below 2^31 words (8 GiB) a tensor: beyond that SGLang's
kernel indexes its tiles in int32 and reads out of bounds (no Llama/Qwen2 parameter of one rank
comes near it: a 7B embedding is about 6 x 10^8 words). Checked against SGLang's own kernels: run
by Triton's interpreter on a CPU in CI (`tests/test_sglang_tile_hash.py`), and by `gpu_tensor_hash` itself on a GPU
(`tests_gpu/test_sglang_tile_hash_gpu.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FMIX_C1, FMIX_C2 = 0x85EBCA6B, 0xC2B2AE35
POS_A, POS_B = 0x27D4EB2D, 0x165667B1
SEED = 0x243F6A88  # gpu_tensor_hash's default seed
TILE = 8192  # words per tile (gpu_tensor_hash's tile_words default)
MASK32, MASK64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
HOST_CHUNK = 1 << 20  # words per numpy step (a multiple of TILE)
CUDA_CHUNK = 1 << 22  # words per torch step on a GPU: ~8 int64 temporaries of 32 MiB alive, ~256 MiB


def seeds(seed: int = SEED) -> tuple[int, int]:
    """The two lanes' seeds as gpu_tensor_hash derives them from its seed."""
    return seed & MASK32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & MASK32


def splitmix64(x: int) -> int:
    """splitmix64's finalizer on a 64-bit integer."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class _Host:
    """The per-word lanes with numpy uint32 arithmetic (wraps mod 2^32 by definition)."""

    chunk = HOST_CHUNK

    def __init__(self, s1: int, s2: int) -> None:
        import numpy as np

        self.np = np
        self.s1, self.s2 = np.uint32(s1), np.uint32(s2)

    def fmix32(self, x: Any) -> Any:
        np = self.np
        x ^= x >> np.uint32(16)
        x *= np.uint32(FMIX_C1)
        x ^= x >> np.uint32(13)
        x *= np.uint32(FMIX_C2)
        x ^= x >> np.uint32(16)
        return x

    def tile_sums(self, words: Any, first: int, tile: int) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
        """Each tile's two lane sums (not yet reduced mod 2^32) over words whose indices start at
        `first`, a tile boundary or inside the one tile the words lie in (`_reduce_tiles`)."""
        np = self.np
        with np.errstate(over="ignore"):
            i = np.arange(first, first + len(words), dtype=np.uint64).astype(np.uint32)
            rot1 = (i << np.uint32(15)) | (i >> np.uint32(17))
            rot2 = (i << np.uint32(13)) | (i >> np.uint32(19))
            k1 = self.fmix32(words ^ ((i * np.uint32(POS_A) + self.s1) ^ rot1))
            k2 = self.fmix32(words ^ ((i * np.uint32(POS_B) + self.s2) ^ rot2))
        return _reduce_tiles(k1.astype(np.uint64), first, tile), _reduce_tiles(k2.astype(np.uint64), first, tile)


class _Cuda:
    """The same lanes with torch int64 ops on the tensor's device; every product is masked back to
    32 bits (two's-complement wrap keeps the low bits exact). Slow (~13 GB/s on an H100): used
    where Triton is not installed, and by tests."""

    chunk = CUDA_CHUNK

    def __init__(self, s1: int, s2: int, device: Any) -> None:
        import torch

        self.torch, self.device = torch, device
        self.s1, self.s2 = s1, s2

    def fmix32(self, x: Any) -> Any:
        x = x ^ (x >> 16)
        x = (x * FMIX_C1) & MASK32
        x = x ^ (x >> 13)
        x = (x * FMIX_C2) & MASK32
        return x ^ (x >> 16)

    def tile_sums(self, words: Any, first: int, tile: int) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
        torch = self.torch
        w = words.to(torch.int64) & MASK32
        i = torch.arange(first, first + w.numel(), dtype=torch.int64, device=self.device) & MASK32
        rot1 = ((i << 15) | (i >> 17)) & MASK32
        rot2 = ((i << 13) | (i >> 19)) & MASK32
        k1 = self.fmix32(w ^ ((((i * POS_A) + self.s1) & MASK32) ^ rot1))
        k2 = self.fmix32(w ^ ((((i * POS_B) + self.s2) & MASK32) ^ rot2))
        return _reduce_tiles(k1, first, tile), _reduce_tiles(k2, first, tile)


_KERNEL: Any = None


def _kernel() -> Any:
    """refit's Triton kernel for the lanes: one program per tile a piece overlaps, each reading that
    tile's words of the piece (indexes counted over the whole tensor from `first`) and storing its
    two lane sums mod 2^32 (uint32 arithmetic: products wrap, shifts are logical)."""
    global _KERNEL  # noqa: PLW0603 - compiled once per process
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def tile_lanes(  # noqa: ANN202
        words, out, n, first,  # noqa: ANN001
        S1: tl.constexpr, S2: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0).to(tl.int64)
        start = (first // TILE + pid) * TILE - first  # this tile's first word, in the piece
        lo = tl.maximum(start, 0)
        hi = tl.minimum(start + TILE, n)
        s1 = tl.full((), S1, tl.uint32)
        s2 = tl.full((), S2, tl.uint32)
        h1 = tl.zeros((), dtype=tl.uint32)
        h2 = tl.zeros((), dtype=tl.uint32)
        for off in range(lo, hi, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < hi
            w = tl.load(words + idx, mask=m, other=0).to(tl.uint32, bitcast=True)
            g = (idx + first).to(tl.uint32)  # the word's index in the whole tensor, mod 2^32
            k1 = w ^ ((g * 0x27D4EB2D + s1) ^ ((g << 15) | (g >> 17)))
            k2 = w ^ ((g * 0x165667B1 + s2) ^ ((g << 13) | (g >> 19)))
            k1 = k1 ^ (k1 >> 16)  # fmix32 of each, written out (the interpreter sees no nested jit)
            k2 = k2 ^ (k2 >> 16)
            k1 = k1 * 0x85EBCA6B
            k2 = k2 * 0x85EBCA6B
            k1 = k1 ^ (k1 >> 13)
            k2 = k2 ^ (k2 >> 13)
            k1 = k1 * 0xC2B2AE35
            k2 = k2 * 0xC2B2AE35
            k1 = k1 ^ (k1 >> 16)
            k2 = k2 ^ (k2 >> 16)
            h1 += tl.sum(tl.where(m, k1, 0), axis=0)
            h2 += tl.sum(tl.where(m, k2, 0), axis=0)
        tl.store(out + 2 * pid, h1.to(tl.int64))
        tl.store(out + 2 * pid + 1, h2.to(tl.int64))

    _KERNEL = tile_lanes
    return _KERNEL


class _Triton(_Cuda):
    """The lanes on CUDA by refit's Triton kernel (`_kernel`): one launch per piece, whatever its
    size (the reduction's mixes stay `_Cuda`'s torch ops)."""

    chunk = 1 << 62

    def tile_sums(self, words: Any, first: int, tile: int) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]]]:
        torch = self.torch
        n = words.numel()
        tiles = (first + n - 1) // tile - first // tile + 1
        out = torch.empty((tiles, 2), dtype=torch.int64, device=self.device)
        import contextlib

        on = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with on:  # (the host only under Triton's interpreter)
            _kernel()[(tiles,)](words, out, n, first, S1=self.s1, S2=self.s2, TILE=tile, BLOCK=1024)
        at = first // tile
        return [(at, out[:, 0])], [(at, out[:, 1])]


_KERNEL_CHECKED: dict[str, bool] = {}  # device -> whether refit's kernel agreed with the torch ops there


def _triton_ok(device: Any) -> bool:
    """Whether to hash on `device` with refit's Triton kernel: Triton is installed, and on this
    device (once per process) the kernel gives the torch integer ops' value for a probe that spans
    tiles and pieces; else the torch ops are used, and a warning says why."""
    key = str(device)
    if key not in _KERNEL_CHECKED:
        try:
            import torch

            probe = torch.arange(3 * TILE + 5, dtype=torch.int32, device=device) * 0x3779B1  # wraps: any bits
            a, b = TileHash(torch_ops=True), TileHash(torch_ops=True)  # torch tensors reach the lanes
            a._lanes, a._device = _Triton(*a._seeds, probe.device), probe.device
            for h in (a, b):
                h.update(probe[: TILE + 3])
                h.update(probe[TILE + 3 :])
            _KERNEL_CHECKED[key] = a.intdigest() == b.intdigest()
            why = "it disagreed with the torch ops on a probe"
        except Exception as exc:  # no Triton, or it cannot compile here
            _KERNEL_CHECKED[key] = False
            why = f"{type(exc).__name__}: {exc}"
        if not _KERNEL_CHECKED[key]:
            import warnings

            msg = f"SGLang's CUDA checksum on {key} falls back to torch ops (slow): refit's Triton kernel {why}"
            warnings.warn(msg, stacklevel=3)
    return _KERNEL_CHECKED[key]


def _reduce_tiles(k: Any, first: int, tile: int) -> list[tuple[int, Any]]:
    """Sums of `k` per tile of `tile` words, the first word at index `first` (a tile boundary, or
    the words all lie in one tile), as (tile index, 1-D sums of it and the tiles after) parts."""
    at, n = first // tile, k.shape[0]
    if first % tile:
        return [(at, k.sum().reshape(1))]
    full = n // tile * tile
    parts = [(at, k[:full].reshape(-1, tile).sum(1))] if full else []
    if full < n:
        parts.append((at + full // tile, k[full:].sum().reshape(1)))
    return parts


class TileHash:
    """gpu_tensor_hash of the tensor whose bytes are the pieces `update` is given, in order.

    Pieces may live on the host or on one CUDA device (the lanes are computed where they are;
    only the tiles' sums are read back, once, by `intdigest`)."""

    def __init__(self, seed: int = SEED, *, tile: int = TILE, torch_ops: bool = False) -> None:
        """`seed`, `tile`: gpu_tensor_hash's `seed` and `tile_words` (SGLang's checker passes
        neither). `torch_ops`: compute with torch integer ops, neither numpy on the host nor refit's
        Triton kernel on CUDA (tests check that arithmetic against SGLang's kernel)."""
        if tile < 1 or HOST_CHUNK % tile or CUDA_CHUNK % tile:
            raise ValueError(f"tile {tile}: a power of two up to {HOST_CHUNK} words")
        self._seeds, self._tile, self._torch_ops = seeds(seed), tile, torch_ops
        self._words = 0  # words hashed so far
        self._carry: Any = None  # bytes (uint8 tensor) short of a whole word, waiting for the next piece
        self._tiles: list[tuple[int, int, Any]] = []  # (lane, first tile, sums of it and the next ones)
        self._lanes: Any = None
        self._device: Any = None

    def update(self, piece: torch.Tensor) -> None:
        import torch

        data = piece.detach()
        if not data.is_contiguous():
            data = data.contiguous()
        raw = data.reshape(-1).view(torch.uint8)
        if self._carry is not None:
            raw = torch.cat([self._carry.to(raw.device), raw])
            self._carry = None
        whole = raw.numel() // 4 * 4
        if whole < raw.numel():
            self._carry = raw[whole:].clone()
        if whole:
            self._hash_words(raw[:whole], raw.device)

    def _hash_words(self, raw: torch.Tensor, device: Any) -> None:
        import torch

        if raw.data_ptr() % 4:  # a view at an odd offset cannot be read as words in place
            raw = raw.clone()
        words = raw.view(torch.int32)
        on_host = device.type == "cpu" and not self._torch_ops
        if self._lanes is None:
            if on_host:
                self._lanes = _Host(*self._seeds)
            elif device.type == "cuda" and not self._torch_ops and _triton_ok(device):
                self._lanes = _Triton(*self._seeds, device)
            else:
                self._lanes = _Cuda(*self._seeds, device)
            self._device = device
        elif device != self._device:
            raise ValueError(f"TileHash: a piece on {device} after pieces on {self._device}: one device per tensor")
        lanes, tile, chunk = self._lanes, self._tile, self._lanes.chunk
        host = words.numpy().view("uint32") if on_host else None
        n, at = words.numel(), 0
        while at < n:
            first = self._words + at
            step = min(n - at, tile - first % tile if first % tile else chunk)
            part = host[at : at + step] if host is not None else words[at : at + step]
            for lane, parts in enumerate(lanes.tile_sums(part, first, tile)):
                self._tiles.extend((lane, tile, sums) for tile, sums in parts)
            at += step
        self._words += n

    def intdigest(self) -> int:
        """The 64-bit value gpu_tensor_hash returns (0 for no bytes, as it does). The hash is left
        as it was: more pieces may follow."""
        words, tiles = self._words, len(self._tiles)
        if self._carry is not None:  # the last word, zero-padded (undone below)
            import torch

            pad = torch.zeros(4 - self._carry.numel(), dtype=torch.uint8, device=self._carry.device)
            carry = torch.cat([self._carry, pad])
            self._hash_words(carry, carry.device)
        try:
            return self._reduce()
        finally:
            self._words = words
            del self._tiles[tiles:]

    def _reduce(self) -> int:
        n = self._words
        if n == 0:
            return 0
        tiles = -(-n // self._tile)
        nbytes = (n * 4) & MASK32
        if isinstance(self._lanes, _Cuda):
            torch = self._lanes.torch
            h = torch.zeros((2, tiles), dtype=torch.int64, device=self._lanes.device)
            for lane, first, sums in self._tiles:
                h[lane, first : first + sums.numel()] += sums
            h = self._lanes.fmix32((h & MASK32) ^ nbytes)
            total = int(((h[0] << 32) | h[1]).sum().item())  # int64 additions wrap mod 2^64
            return splitmix64(total & MASK64)
        import numpy as np

        h = np.zeros((2, tiles), dtype=np.uint64)
        for lane, first, sums in self._tiles:
            h[lane, first : first + len(sums)] += sums
        h = ((h & np.uint64(MASK32)) ^ np.uint64(nbytes)).astype(np.uint32)
        h = self._lanes.fmix32(h).astype(np.uint64)
        with np.errstate(over="ignore"):
            total = int(((h[0] << np.uint64(32)) | h[1]).sum(dtype=np.uint64))
        return splitmix64(total)

    def hexdigest(self) -> str:
        """As SGLang's `_hash_tensor` writes it: 16 hex digits."""
        return f"{self.intdigest():016x}"


def tile_hash(*pieces: torch.Tensor) -> str:
    """SGLang's CUDA checksum (`_hash_tensor` over `gpu_tensor_hash`) of the tensor whose bytes are
    these pieces' bytes in order, as 16 hex digits."""
    h = TileHash()
    for p in pieces:
        h.update(p)
    return h.hexdigest()


__all__ = ["TILE", "TileHash", "seeds", "splitmix64", "tile_hash"]
