"""`refit soak`: many consecutive refits into reference-engine processes, then count what leaked.

A benchmark, not a unit test. Every `fault_every`-th refit injects a fault (raise or corrupt, on a
seeded engine and bucket) so the failure paths are soaked too; every `verify_every`-th refit the
engines' weights are compared with the trainer's. Leaks are counted twice: while the context is
still open (against a baseline taken after a warm-up refit: buffers, fds and threads must not
grow), and after everything is closed (no buffer file, no child process, no extra thread left).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _children() -> list[int]:
    """This process's child processes, with the engines its fork server forked
    (`refit.reference.forkserver`, started once and kept for the process's life, as torch's
    shared-memory manager is) in place of the fork server itself."""
    from refit.reference import forkserver

    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    helpers = set(forkserver.server_pids())
    mine = parents.get(os.getpid(), [])
    return [p for p in mine if p not in helpers] + [p for h in helpers if h in mine for p in parents.get(h, [])]


# Fixed-size pools made lazily and kept for reuse: the context's call pool, and the process's
# checksum pool (used in this process when engines run on threads); the reader of the process's
# engine fork server. None is a leak.
POOLS = ("refit-call", "refit-hash", "refit-forkserver")


def _threads() -> set[threading.Thread]:
    """Threads other than the fixed-size pools (which grow lazily up to their size)."""
    return {t for t in threading.enumerate() if not t.name.startswith(POOLS)}


def _pool_threads() -> int:
    return sum(t.name.startswith("refit-call") for t in threading.enumerate())


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class SoakReport:
    refits: int
    ok: int  # refits after which every engine held the new version (injected faults are retried)
    injected_faults: int
    seconds: float
    refits_per_second: float
    engines: int
    mode: str
    bucket_bytes: int
    buckets_per_refit: int
    # growth while open (after a warm-up refit) and what is left after closing everything
    segments_growth: int
    fds_growth: int
    threads_growth: int  # threads outside the call pool
    pool_threads: int  # the call pool's workers at the end (bounded by its size)
    rss_growth_mib: float
    segments_left: int
    processes_left: int
    threads_left: int
    mismatches: int

    @property
    def leaks(self) -> int:
        return (
            max(self.segments_growth, 0) + max(self.fds_growth, 0) + max(self.threads_growth, 0)
            + self.segments_left + self.processes_left + max(self.threads_left, 0)
        )  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "leaks": self.leaks}


def soak(
    refits: int = 1000,
    *,
    engines: int = 2,
    mode: str = "disaggregated",
    bucket_bytes: int = 64 << 10,
    fault_every: int = 10,
    verify_every: int = 100,
    in_thread: bool = False,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> SoakReport:
    """`refits` refits (after one warm-up) into `engines` reference engines; see the module docstring.
    `progress(done, refits)` is called once the warm-up is done (done = 0) and after each refit."""
    import torch

    from refit import protocol
    from refit.buckets import plan_buckets
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport, leaked_segments
    from refit.drivers.torch_source import TorchSource
    from refit.reference.model import ModelConfig, TinyLlama

    rng = random.Random(seed)
    threads_before = set(threading.enumerate())  # by identity: other threads ending meanwhile do not count
    children_before = set(_children())  # e.g. torch's shared-memory manager, started by an earlier share
    config = ModelConfig()
    model = TinyLlama(config, seed=seed)
    names = [f"soak-{i}" for i in range(engines)]
    pool = (
        [ReferenceEngine.in_thread(n, config, seed=seed) for n in names]
        if in_thread
        else ReferenceEngine.spawn_many(names, config, seed=seed)
    )
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), pool, mode=mode,  # type: ignore[arg-type]
        bucket_bytes=bucket_bytes, deadline_s=60.0,
    )  # fmt: skip
    n_buckets = len(plan_buckets(ctx.source.metas(), bucket_bytes))

    def step() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=gen))

    def matches() -> bool:
        want = model.state_dict()
        return all(all(torch.equal(e.state_dict()[k], v) for k, v in want.items()) for e in pool)

    gen = torch.Generator().manual_seed(seed)
    ok = injected = mismatches = 0
    try:
        step()
        protocol.run(ctx).raise_for_error()  # warm-up: connection, pool threads, lazy imports
        base = (len(leaked_segments(pid=os.getpid())), _fds(), _threads(), _rss_mib())
        t0 = time.perf_counter()
        if progress is not None:
            progress(0, refits)
        for i in range(1, refits + 1):
            step()
            ctx.faults = None
            if fault_every and i % fault_every == 0:
                kind = rng.choice(["raise", "corrupt"])
                ctx.faults = protocol.FaultPlan().fail_at(
                    "transferring", engine=rng.randrange(engines), bucket=rng.randrange(n_buckets), kind=kind
                )
            result = protocol.run(ctx)
            ok += result.ok
            injected += ctx.faults is not None
            if (verify_every and i % verify_every == 0) or i == refits:
                mismatches += not matches()
            if progress is not None:
                progress(i, refits)
        seconds = time.perf_counter() - t0
        growth = (
            len(leaked_segments(pid=os.getpid())) - base[0], _fds() - base[1],
            len(_threads() - base[2]), _rss_mib() - base[3],
        )  # fmt: skip
        pool_threads = _pool_threads()
    finally:
        ctx.close()
        for e in pool:
            e.close()
    time.sleep(0.2)  # let closed threads finish exiting
    return SoakReport(
        refits=refits,
        ok=ok,
        injected_faults=injected,
        seconds=round(seconds, 3),
        refits_per_second=round(refits / seconds, 1),
        engines=engines,
        mode=mode,
        bucket_bytes=bucket_bytes,
        buckets_per_refit=n_buckets,
        segments_growth=growth[0],
        fds_growth=growth[1],
        threads_growth=growth[2],
        pool_threads=pool_threads,
        rss_growth_mib=round(growth[3], 1),
        segments_left=len(leaked_segments(pid=os.getpid())),
        processes_left=len(set(_children()) - children_before),
        threads_left=len({t for t in set(threading.enumerate()) - threads_before if not t.name.startswith(POOLS)}),
        mismatches=mismatches,
    )
