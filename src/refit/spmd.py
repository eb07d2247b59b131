"""A trainer job on N ranks (FSDP2 `fully_shard` over gloo) that refits into reference engines
between optimizer steps: what `refit demo --ranks N` runs and what the multi-rank tests check.

Every rank builds its own sharded model, optimizer, source and transport and calls
`protocol.run(ctx)`; rank 0 also starts the engines and leads. After each refit every rank
gathers the full weights (a collective) and rank 0 checks each engine against them: weights read
back bit for bit, greedy tokens, logits.

    python -m refit.spmd RANK WORLD PORT SPEC_JSON OUT_JSON      (one process per rank)
    launch(world, spec) -> per-rank reports                        (starts them all, waits)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = ([3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8])
NEW_TOKENS = 12
LOGIT_ATOL = 1e-5

DEFAULT_SPEC: dict[str, Any] = {
    "engines": 2,
    "engine_tp": 1,
    "transport": "shm",
    "mode": "colocated",
    "pause_mode": "retract",
    "refits": 2,
    "steps": 3,
    "bucket_bytes": 64 << 10,
    "deadline": 60.0,
    "call_timeout": 10.0,
    "retries": 1,
    "seed": 0,
    "aux_dtype": None,  # e.g. "bfloat16": a one-row tensor of another dtype that rank 1 owns none of
    "faults": {},  # refit number (1-based, as a string) -> fault spec ("transferring:engine=1:bucket=2:kind=kill")
    "leader_only": False,  # only rank 0 calls protocol.run (a misuse: it must fail clearly, in time)
    "check": True,
    "verbose": False,
}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, spec: dict[str, Any], *, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Start `world` trainer ranks running `spec`, wait for all, return their reports (rank order).
    A rank that exits without a report is reported as {"rank": r, "exit": code, "stderr": ...}."""
    spec = {**DEFAULT_SPEC, **spec}
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="refit-spmd-") as tmp:
        outs = [Path(tmp) / f"rank{r}.json" for r in range(world)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "refit.spmd", str(r), str(world), str(port), json.dumps(spec), str(outs[r])],
                env=env,
                stdout=None if (spec["verbose"] and r == 0) else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        errs = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            errs.append(err or "")
        reports = []
        for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
            if out.exists():
                reports.append(json.loads(out.read_text()))
            else:
                reports.append({"rank": r, "exit": p.returncode, "stderr": errs[r][-4000:]})
        return reports


def _fsdp_model(config: Any, seed: int) -> Any:
    from torch.distributed.fsdp import fully_shard

    from refit.reference.model import TinyLlama

    model = TinyLlama(config, seed=seed)
    for layer in model.model.layers:
        fully_shard(layer)
    if config.aux_dtype is not None:  # FSDP2 groups hold one dtype: the auxiliary tensor gets its own
        fully_shard(model.aux)
    fully_shard(model)
    return model


def _train(model: Any, opt: Any, gen: Any, steps: int, vocab: int) -> float:
    import torch

    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, vocab, (4, 1), generator=gen)
        ids = (starts + torch.arange(17)[None, :]) % vocab
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def _check(engines: list[Any], full: dict[str, Any], config: Any, previous: list[Any]) -> dict[str, Any]:
    import torch

    from refit.reference.model import TinyLlama, greedy, prompt_logits

    ref = TinyLlama(config)
    ref.load_state_dict(full)
    tokens, weights, max_diff, min_change = True, True, 0.0, float("inf")
    for e in engines:
        state = e.state_dict()
        weights &= all(torch.equal(state[k], v) for k, v in full.items())
        for prompt, prev in zip(PROMPTS, previous, strict=True):
            tokens &= e.generate(list(prompt), NEW_TOKENS)["output"] == greedy(ref, list(prompt), NEW_TOKENS)
            got = e.score(list(prompt))
            max_diff = max(max_diff, float((got - prompt_logits(ref, list(prompt))).abs().max()))
            min_change = min(min_change, float((got - prev).abs().max()))
    ok = tokens and weights and max_diff <= LOGIT_ATOL and min_change > 1e-4
    return {"ok": ok, "tokens": tokens, "weights": weights, "max_diff": max_diff, "min_change": min_change}


def worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One trainer rank of the job; returns its report."""
    import torch
    import torch.distributed as dist

    from refit import protocol
    from refit.drivers.torch_source import TorchSource
    from refit.reference.model import ModelConfig, prompt_logits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = ModelConfig(aux_dtype=spec["aux_dtype"])
    model = _fsdp_model(config, spec["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(spec["seed"] + 1 + rank)  # each rank trains on its own data
    engines: list[Any] = []
    report: dict[str, Any] = {"rank": rank, "world": world, "refits": []}
    if rank == 0:
        from refit.drivers.reference import ReferenceEngine

        names = [f"engine-{i}" for i in range(spec["engines"])]
        engines = ReferenceEngine.spawn_many(names, config, seed=spec["seed"], tp=spec["engine_tp"])
    try:
        ctx = protocol.RefitContext(
            source=TorchSource(model, optimizer=opt),
            transport=make_transport(spec["transport"]),
            engines=engines,
            mode=spec["mode"],
            pause_mode=spec["pause_mode"],
            bucket_bytes=spec["bucket_bytes"],
            deadline_s=spec["deadline"],
            call_timeout_s=spec["call_timeout"],
            retries=spec["retries"],
        )
        for n in range(1, spec["refits"] + 1):
            full0 = {k: v.full_tensor() for k, v in model.state_dict().items()}
            previous = []
            if rank == 0:
                from refit.reference.model import TinyLlama

                ref = TinyLlama(config)
                ref.load_state_dict(full0)
                previous = [prompt_logits(ref, list(p)) for p in PROMPTS]
                if spec["mode"] == "colocated":
                    for e in engines:  # rollouts are over: the engines give their memory to training
                        e.release_memory(["weights", "kv_cache"])
            loss = _train(model, opt, gen, spec["steps"], config.vocab_size)
            fault = spec["faults"].get(str(n))
            ctx.faults = protocol.FaultPlan.parse(fault) if (fault and rank == 0) else None
            entry: dict[str, Any] = {"refit": n, "loss": loss}
            t0 = time.monotonic()
            if spec["leader_only"] and rank != 0:
                entry["skipped"] = True  # this rank never calls protocol.run: rank 0 must fail clearly
                time.sleep(spec["deadline"] + 5.0)
            else:
                try:
                    result = protocol.run(ctx)
                    entry.update(_summary(result))
                except protocol.RefitError as exc:
                    entry.update(raised=f"{type(exc).__name__}: {exc}")
            entry["wall_s"] = round(time.monotonic() - t0, 4)
            if not (spec["leader_only"]):
                full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank: a collective
                if rank == 0 and spec["check"] and entry.get("ok"):
                    entry["check"] = _check(engines, full, config, previous)
            report["refits"].append(entry)
            if spec["verbose"] and rank == 0:
                print(json.dumps(entry), flush=True)
        if not spec["leader_only"]:
            ctx.close()
    finally:
        for e in engines:
            e.close()
    return report


def make_transport(kind: str) -> Any:
    if kind == "shm":
        from refit.drivers.shm import SharedMemoryTransport

        return SharedMemoryTransport()
    if kind == "broadcast":
        from refit.drivers.broadcast import BroadcastTransport

        return BroadcastTransport()
    raise ValueError(f"transport {kind!r}: use shm or broadcast")


def _summary(result: Any) -> dict[str, Any]:
    return {
        "ok": result.ok,
        "state": result.state,
        "version": result.version,
        "error": None if result.error is None else str(result.error),
        "round_trips": result.round_trips,
        "seconds": result.seconds,
        "buckets": result.buckets,
        "bytes_moved": result.bytes_moved,
        "trainer_peak_bytes": result.trainer_peak_bytes,
        "phase_seconds": result.phase_seconds,
        "engines": {
            n: {"status": o.status, "version": o.version, "attempts": o.attempts} for n, o in result.engines.items()
        },
        "rank_steps": [list(map(list, s.steps)) for s in result.rank_stats],
        "rank_peak_bytes": [s.peak_bytes for s in result.rank_stats],
    }


def main(argv: list[str]) -> int:
    rank, world, _port, spec, out = int(argv[0]), int(argv[1]), int(argv[2]), json.loads(argv[3]), Path(argv[4])
    report = worker(rank, world, spec)
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
