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

DEFAULT_SPEC: dict[str, Any] = {
    "engines": 2,
    "engine_tp": 1,
    "transport": "shm",
    "mode": "colocated",
    "pause_mode": "retract",
    "kv": "recompute",
    "atomic": False,
    "refits": 2,
    "steps": 3,
    "bucket_bytes": 64 << 10,
    "deadline": 60.0,
    "cleanup_grace": None,  # seconds past the deadline for cleanup (None: RefitContext's default)
    "call_timeout": 10.0,
    "retries": 1,
    "seed": 0,
    "aux_dtype": None,  # e.g. "bfloat16": a one-row tensor of another dtype that rank 1 owns none of
    "faults": {},  # refit number (as a string) -> fault spec ("transferring:engine=1:bucket=2:kind=kill")
    "leader_only": False,  # only rank 0 calls protocol.run (a misuse: it must fail clearly, in time)
    "trace": None,  # rank 0 writes the JSONL trace here
    "echo": False,  # rank 0 prints the demo's table as it goes
    "stop_on_failure": False,
    "lora": False,  # LoRA refits: PEFT adapters on the sharded model; only they move (`lora_worker`)
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
                stdout=None if (spec["echo"] and r == 0) else subprocess.DEVNULL,
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


def worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One trainer rank of the job; returns its report."""
    import torch
    import torch.distributed as dist

    from refit import protocol
    from refit.drivers.torch_source import TorchSource
    from refit.loop import Trainer, make_transport, refit_loop, train
    from refit.reference.model import ModelConfig, TinyLlama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = ModelConfig(aux_dtype=spec["aux_dtype"])
    model = _fsdp_model(config, spec["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(spec["seed"] + 1 + rank)  # each rank trains on its own data

    def reference() -> TinyLlama:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank: a collective
        ref = TinyLlama(config)
        ref.load_state_dict(full)
        return ref

    engines: list[Any] = []
    report: dict[str, Any] = {"rank": rank, "world": world, "refits": []}
    if rank == 0:
        from refit.drivers.reference import ReferenceEngine

        names = [f"engine-{i}" for i in range(spec["engines"])]
        engines = ReferenceEngine.spawn_many(names, config, seed=spec["seed"], tp=spec["engine_tp"])
    try:
        ctx = protocol.RefitContext(
            source=TorchSource(model, optimizer=opt), transport=make_transport(spec["transport"]), engines=engines,
            mode=spec["mode"], pause_mode=spec["pause_mode"], kv=spec.get("kv", "recompute"),
            atomic=bool(spec.get("atomic", False)),
            bucket_bytes=spec["bucket_bytes"],
            deadline_s=spec["deadline"], call_timeout_s=spec["call_timeout"], retries=spec["retries"],
            verify=spec.get("verify", "digest"), trace=spec["trace"] if rank == 0 else None,
            **({} if spec["cleanup_grace"] is None else {"cleanup_grace_s": float(spec["cleanup_grace"])}),
        )  # fmt: skip
        if spec["leader_only"]:  # a misuse: rank 1 never calls protocol.run
            report["refits"] = _leader_only(ctx, rank, spec)
            return report
        report["refits"] = refit_loop(
            ctx, engines, Trainer(lambda n: train(model, opt, gen, n, config.vocab_size), reference),
            refits=spec["refits"], steps=spec["steps"], faults={int(k): v for k, v in spec["faults"].items()},
            leader=rank == 0, stop_on_failure=spec["stop_on_failure"], echo=spec["echo"],
        )  # fmt: skip
        ctx.close()
    finally:
        for e in engines:
            e.close()
    return report


def lora_worker(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a LoRA job: the tiny model wrapped by PEFT (rank 8 on every projection), then
    sharded by FSDP2 (its adapters too: the source hands DTensors to the transport, which gathers
    them); each refit moves the adapter into disaggregated engines (max_staleness 1). After each,
    every rank gathers the adapter (a collective) and rank 0 checks each engine's greedy tokens
    under it against the PEFT model with those tensors, and the bytes moved against the adapter's."""
    import peft
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from refit import protocol
    from refit.drivers.lora_source import LoraSource
    from refit.loop import PROMPTS, make_transport, train
    from refit.reference.lora import LORA_TARGETS
    from refit.reference.model import ModelConfig, TinyLlama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = ModelConfig()
    lora = peft.LoraConfig(  # random B as well as A: the adapter changes the tokens from the first refit
        r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), lora_dropout=0.0, init_lora_weights=False
    )
    torch.manual_seed(spec["seed"])  # every rank draws the same adapter
    model = peft.get_peft_model(TinyLlama(config, seed=spec["seed"]), lora)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model.base_model.model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(spec["seed"] + 1 + rank)
    engines: list[Any] = []
    report: dict[str, Any] = {"rank": rank, "world": world, "refits": []}
    if rank == 0:
        from refit.drivers.reference import ReferenceEngine

        engines = ReferenceEngine.spawn_many([f"engine-{i}" for i in range(spec["engines"])], config, seed=spec["seed"])
    try:
        source = LoraSource(model, name="policy")
        ctx = protocol.RefitContext(
            source=source, transport=make_transport(spec["transport"]), engines=engines, mode="disaggregated",
            max_staleness=1, bucket_bytes=spec["bucket_bytes"], deadline_s=spec["deadline"],
            call_timeout_s=spec["call_timeout"], retries=spec["retries"], verify=spec.get("verify", "digest"),
        )  # fmt: skip
        for _ in range(spec["refits"]):
            train(model, opt, gen, spec["steps"], config.vocab_size)
            result = protocol.run(ctx)
            # a collective either way (peft 0.22 gathers the DTensors itself, 0.21 hands them back)
            saved = peft.get_peft_model_state_dict(model)
            full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in saved.items()}
            entry: dict[str, Any] = {"ok": result.ok, "version": result.version}
            if rank == 0:
                oracle = peft.get_peft_model(TinyLlama(config, seed=spec["seed"]), lora).eval()
                peft.set_peft_model_state_dict(oracle, full)
                want = []
                with torch.no_grad():
                    for prompt in PROMPTS:
                        ids = list(prompt)
                        for _ in range(8):
                            ids.append(int(oracle(torch.tensor([ids]))[0, -1].argmax()))
                        want.append(ids[len(prompt) :])
                got = [[e.generate(p, 8, adapter="policy")["output"] for p in PROMPTS] for e in engines]
                base = [e.generate(p, 8)["output"] for p in PROMPTS for e in engines[:1]]
                entry.update(
                    error=None if result.ok else str(result.error),
                    statuses={k: o.status for k, o in result.engines.items()},
                    bytes_moved=result.bytes_moved,
                    adapter_bytes=sum(t.numel() * t.element_size() for t in full.values()),
                    sharded=any(hasattr(p, "placements") for n, p in model.named_parameters() if "lora_" in n),
                    tokens_equal=all(g == want for g in got),
                    adapter_changes_tokens=base != want,
                )
            report["refits"].append(entry)
        ctx.close()
    finally:
        for e in engines:
            e.close()
    return report


def _leader_only(ctx: Any, rank: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    from refit import protocol
    from refit.loop import summary

    if rank != 0:
        time.sleep(spec["deadline"] + 5.0)
        return [{"skipped": True}]
    t0 = time.monotonic()
    entry = summary(protocol.run(ctx))
    return [{**entry, "wall_s": round(time.monotonic() - t0, 4)}]


def main(argv: list[str]) -> int:
    rank, world, _port, spec, out = int(argv[0]), int(argv[1]), int(argv[2]), json.loads(argv[3]), Path(argv[4])
    report = (lora_worker if spec.get("lora") else worker)(rank, world, spec)
    out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
