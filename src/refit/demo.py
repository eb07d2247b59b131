"""`refit demo`: the embedded default. A tiny trainer takes real optimizer steps; between steps the
new weights are refit into reference-engine processes; after each refit the engines must give the
trainer's greedy tokens and logits for fixed prompts, and their weights read back bit for bit.

Colocated (default): like a synchronous RL loop, the engines release their weight and KV memory
while the trainer trains; the refit gives the memory back, moves the weights, restores.
Disaggregated: the engines keep generating while the trainer trains; requests are in flight when
the refit pauses them (retract: they are re-prefilled under the new weights after it).

`--ranks N` trains with FSDP2 on N gloo ranks (processes; every rank calls `protocol.run`, rank 0
leads and prints); `--engine-tp T` gives each engine T TP processes holding shards; `--transport`
picks shared memory or the broadcast side group. The same loop (`refit_loop`) runs either way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.loop import (  # noqa: F401 - re-exported: the loop lived here
    LEGEND,
    LOGIT_TOL,
    MIN_CHANGE,
    NEW_TOKENS,
    PHASES,
    PROMPTS,
    SHORT,
    Trainer,
    check_engine,
    combine,
    header,
    make_api_transport,
    make_transport,
    refit_loop,
    row,
    summary,
    train,
)
from refit.progress import Progress
from refit.reference.model import ModelConfig, TinyLlama


def start_engines(args: argparse.Namespace, names: list[str], config: ModelConfig) -> list[Any]:
    """The demo's engines: reference engines, or reference engines behind an emulated engine API."""
    if args.engine == "sglang":
        from refit.testing.sglang_server import EmulatedSGLangEngine

        return [
            EmulatedSGLangEngine.start(n, config=config, seed=args.seed, tp=args.engine_tp, in_thread=args.in_thread)
            for n in names
        ]
    if args.engine == "vllm":
        from refit.testing.vllm_server import EmulatedVLLMEngine

        backend = "ipc" if args.transport == "shm" else "nccl"
        return [
            EmulatedVLLMEngine.start(
                n, config=config, seed=args.seed, tp=args.engine_tp, in_thread=args.in_thread, backend=backend
            )
            for n in names
        ]
    if getattr(args, "ray", False):
        from refit.drivers.ray_actors import RayEngine, RayLock

        lock = RayLock(f"refit-demo-lock-{os.getpid()}")  # the engine set's lock, hosted by a Ray actor
        return [RayEngine.start(n, config, seed=args.seed, lock=lock, tp=args.engine_tp) for n in names]
    if args.in_thread:
        return [ReferenceEngine.in_thread(n, config, seed=args.seed) for n in names]
    return ReferenceEngine.spawn_many(names, config, seed=args.seed, tp=args.engine_tp)


@contextlib.contextmanager
def ray_cluster(enabled: bool) -> Iterator[None]:
    """A local Ray cluster for `--ray` (2 CPUs, no dashboard), shut down on the way out."""
    if not enabled:
        yield
        return
    import ray

    if ray.is_initialized():  # the caller's cluster: used, not shut down
        yield
        return
    if os.environ.get("RAY_ADDRESS"):  # inside a Ray job: join its cluster
        print(f"connecting to the Ray cluster at {os.environ['RAY_ADDRESS']} ...", flush=True)
        with Progress("ray").waiting("  waiting for ray.init"):
            ray.init(log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster
        print("starting a local Ray cluster (2 CPUs, no dashboard) ...", flush=True)
        with Progress("ray").waiting("  waiting for ray.init"):
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def verdict(
    entries: list[dict[str, Any]], refits: int, trace: str | None, *, unfired: bool = False, temporary: bool = False
) -> int:
    """Print how the demo ended, with the trace to check and replay; 0 when every refit matched.
    A `temporary` trace (no --trace was given) is kept only when the demo failed."""
    failed = next((e for e in entries if not e["ok"]), None)
    bad = sum(not e.get("check", {}).get("ok", False) for e in entries)
    code = 1 if unfired or failed is not None or len(entries) < refits or bad else 0
    if trace and temporary and code == 0:
        Path(trace).unlink(missing_ok=True)
    elif trace:
        kept = " (a temporary file, kept because the demo failed)" if temporary else ""
        print(f"trace: {trace}{kept}  (check it: refit check {trace}; replay it: refit replay {trace})")
    if unfired:
        print("FAILED: the planned fault never fired: no step matched it (check its state, engine, bucket and call)")
    elif failed is not None:
        print(f"FAILED: refit {failed['refit']} of {refits} did not reach every engine (run state {failed['state']})")
    elif len(entries) < refits:
        print(f"FAILED: {len(entries)} of {refits} refits ran")
    elif bad:
        print(f"MISMATCH in {bad} of {refits} refits")
    else:
        peak = max(e["trainer_peak_bytes"] for e in entries)
        print(
            f"{'all ' if refits > 1 else ''}{refits} refit{'s' if refits > 1 else ''} matched the trainer: tokens "
            f"equal, logits within {LOGIT_TOL:g} x max(1, max|logit|), weights bit-exact; extra trainer memory at most "
            f"{peak / 1024:.0f} KiB"
        )
        print(verified_line(entries))
    return code


def verified_line(entries: list[dict[str, Any]]) -> str:
    """What verification before publish did over the demo's refits, in one line."""
    verdicts = [v for e in entries for v in e.get("verified", [])]
    if not verdicts:
        return "verified before publish: nothing (--verify off: each engine's finalize was trusted)"
    passed = sum(bool(v["ok"]) for v in verdicts)
    what = []
    compared = sorted({v["compared"] for v in verdicts if v.get("compared") is not None})
    if compared:
        what.append(f"{'/'.join(map(str, compared))} tensors' digests matched the trainer's")
    if any(v.get("probe") for v in verdicts):
        worst = max((v["probe"]["max_diff"] or 0.0) for v in verdicts if v.get("probe"))
        what.append(f"probe within tolerance (largest difference {worst:.2g})")
    return f"verified before publish: {passed} of {len(verdicts)} engine updates ({'; '.join(what)})"


def _trace_path(args: argparse.Namespace) -> tuple[str, bool]:
    """Where the demo writes its trace: --trace, or a temporary file (kept only if the demo fails)."""
    if args.trace:
        return args.trace, False
    fd, path = tempfile.mkstemp(prefix="refit-demo-", suffix=".jsonl")
    os.close(fd)
    return path, True


def run_demo(args: argparse.Namespace) -> int:
    """`refit demo` with options already validated by the CLI (`refit.cli._demo_problem`)."""
    if getattr(args, "ray", False):
        with ray_cluster(True):
            return _run_ray(args)
    if args.ranks > 1:
        return _run_ranks(args)
    return _run_one_trainer(args)


def _run_ray(args: argparse.Namespace) -> int:
    """The job as RL frameworks run it on Ray: trainer ranks and engines as actors, this process
    (the loop's controller) leading each refit (refit.ray_job)."""
    from refit.ray_job import start_ranks

    config = ModelConfig()
    names = [f"engine-{i}" for i in range(args.engines)]
    trainers = "FSDP2 over gloo" if args.ranks > 1 else "one process"
    print(
        f"starting {args.ranks} trainer rank actor(s) ({trainers}) and {args.engines} reference engine actors "
        f"(TP={args.engine_tp}) on Ray | mode {args.mode} | transport {args.transport} ...",
        flush=True,
    )
    t0 = time.perf_counter()
    with Progress("ray").waiting("  waiting for the trainer actors"):
        trainer = start_ranks(args.ranks, {"seed": args.seed, "transport": args.transport})
    engines: list[Any] = []
    trace, temporary = _trace_path(args)
    try:
        with Progress("ray").waiting("  waiting for the engine actors"):
            engines = start_engines(args, names, config)
        print(f"actors ready in {time.perf_counter() - t0:.1f}s", flush=True)
        ctx = protocol.RefitContext(
            source=None, transport=make_transport(args.transport), engines=engines, ranks=trainer.ranks,
            mode=args.mode, pause_mode=args.pause_mode, kv=args.kv, atomic=args.atomic, bucket_bytes=args.bucket_bytes,
            deadline_s=args.deadline, retries=args.retries, call_timeout_s=args.call_timeout, trace=trace,
            verify=verify_mode(args),
        )  # fmt: skip
        try:
            faults = {1: args.fail_at} if args.fail_at else None
            entries = refit_loop(
                ctx, engines, Trainer(trainer.train, trainer.reference), refits=args.refits, steps=args.steps,
                faults=faults,
            )  # fmt: skip
        finally:
            ctx.close()
    finally:
        for e in engines:
            e.close()
        trainer.close()
    unfired = any(e.get("fault_unfired") for e in entries)
    return verdict(entries, args.refits, trace, unfired=unfired, temporary=temporary)


def driver_class(args: argparse.Namespace) -> type[Any]:
    """The driver class the demo's engines get (`start_engines`), for its capabilities."""
    engine = getattr(args, "engine", "reference")
    if engine == "sglang":
        from refit.testing.sglang_server import EmulatedSGLangEngine

        return EmulatedSGLangEngine
    if engine == "vllm":
        from refit.testing.vllm_server import EmulatedVLLMEngine

        return EmulatedVLLMEngine
    return ReferenceEngine  # (RayEngine is one: the same capabilities)


def reports_digests(cls: type[Any]) -> bool:
    """Whether the driver class reports digests the demo's runs can verify with: the demo's
    transports' kind (xxh3), or a kind of its own that depends on its server (a property, as
    SGLang's checksums: the run's context refuses it, naming why, when the server cannot)."""
    import inspect

    kinds = inspect.getattr_static(cls, "digest_kinds", frozenset())
    return isinstance(kinds, property) or "xxh3" in kinds


def unverifiable(args: argparse.Namespace) -> bool:
    """The demo's driver reports neither digests nor a probe."""
    cls = driver_class(args)
    return not reports_digests(cls) and not cls.probes


def verify_mode(args: argparse.Namespace) -> str:
    """--verify, or its default: digest where the driver reports digests, else off."""
    if getattr(args, "verify", None):
        return str(args.verify)
    return "digest" if reports_digests(driver_class(args)) else "off"


def _run_one_trainer(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    config = ModelConfig()
    model = TinyLlama(config, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed + 1)
    names = [f"engine-{i}" for i in range(args.engines)]
    if args.in_thread:
        what = f"{args.engines} reference engine threads"
    else:
        what = f"{args.engines} reference engine processes" + (f" of TP={args.engine_tp}" if args.engine_tp > 1 else "")
    if args.engine != "reference":
        api = {"sglang": "SGLang", "vllm": "vLLM"}[args.engine]
        print(
            f"engine API: {api}, EMULATED: each engine is a loopback HTTP server speaking {api}'s weight-update API "
            f"(refit.testing.{args.engine}_server) in front of a reference engine, driven by refit's {api} driver "
            f"(refit.drivers.{args.engine}). No {api} server runs here.",
            flush=True,
        )
    print(f"starting {what} ...", flush=True)
    t0 = time.perf_counter()
    engines = start_engines(args, names, config)
    print(f"engines ready in {time.perf_counter() - t0:.1f}s", flush=True)
    from refit.drivers.torch_source import TorchSource

    trace, temporary = _trace_path(args)
    try:
        ctx = protocol.RefitContext(
            source=TorchSource(model, optimizer=opt), transport=make_transport(args.transport, args.engine),
            engines=engines, mode=args.mode, pause_mode=args.pause_mode, kv=args.kv, atomic=args.atomic,
            bucket_bytes=args.bucket_bytes,
            deadline_s=args.deadline, retries=args.retries, call_timeout_s=args.call_timeout, trace=trace,
            verify=verify_mode(args),
        )  # fmt: skip
    except (protocol.ConfigError, ValueError) as exc:
        for e in engines:
            e.close()
        if temporary:
            Path(trace).unlink(missing_ok=True)
        print(f"refit demo: {exc}", file=sys.stderr)
        return 2
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params:,} fp32 params ({n_params * 4 / 2**20:.2f} MiB) | mode {args.mode}"
        f"{' (atomic: stage, then swap)' if args.atomic else ''} | pause "
        f"{args.pause_mode} | engine {args.engine} | transport {args.transport} | "
        f"bucket {args.bucket_bytes / 1024:.0f} KiB | "
        f"deadline {args.deadline:g}s | verify {verify_mode(args)}{_digest_note(ctx)}"
        + (" (this driver reports no digests or probe yet)" if not args.verify and unverifiable(args) else "")
    )
    trainer = Trainer(lambda n: train(model, opt, gen, n, config.vocab_size), lambda: model)
    try:
        faults = {1: args.fail_at} if args.fail_at else None
        entries = refit_loop(ctx, engines, trainer, refits=args.refits, steps=args.steps, faults=faults)
    finally:
        ctx.close()
        for e in engines:
            e.close()
    unfired = any(e.get("fault_unfired") for e in entries)
    return verdict(entries, args.refits, trace, unfired=unfired, temporary=temporary)


def _digest_note(ctx: protocol.RefitContext) -> str:
    """The digest kind the runs compare by, when they compare digests (" (digest xxh3)")."""
    from refit.verify import digests_of

    return f" (digest {ctx.digest_kind})" if digests_of(ctx.verify) else ""


def _run_ranks(args: argparse.Namespace) -> int:
    from refit.spmd import launch

    trace, temporary = _trace_path(args)
    print(
        f"starting {args.ranks} FSDP2 trainer ranks (gloo) and {args.engines} reference engines (TP={args.engine_tp}, "
        f"{args.engines * args.engine_tp} processes) | mode {args.mode} | transport {args.transport} ...",
        flush=True,
    )
    spec = {
        "engines": args.engines, "engine_tp": args.engine_tp, "transport": args.transport, "mode": args.mode,
        "pause_mode": args.pause_mode, "kv": args.kv, "atomic": args.atomic, "refits": args.refits, "steps": args.steps,
        "bucket_bytes": args.bucket_bytes,
        "deadline": args.deadline, "call_timeout": args.call_timeout, "retries": args.retries, "seed": args.seed,
        "verify": verify_mode(args),
        "faults": {"1": args.fail_at} if args.fail_at else {}, "trace": trace, "echo": True,
        "stop_on_failure": True,
    }  # fmt: skip
    reports = launch(args.ranks, spec, timeout=max(120.0, args.refits * (args.deadline + 30.0)))
    missing = [r for r in reports if "refits" not in r]
    for r in missing:
        print(f"rank {r['rank']} failed (exit {r.get('exit')}):\n{r.get('stderr', '')}", file=sys.stderr)
    if missing:
        if temporary:
            print(f"trace (kept): {trace}  (check it: refit check {trace})")
        return 1
    entries = reports[0]["refits"]
    unfired = any(e.get("fault_unfired") for e in entries)
    return verdict(entries, args.refits, trace, unfired=unfired, temporary=temporary)
