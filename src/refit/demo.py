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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.reference.model import ModelConfig, TinyLlama, greedy, prompt_logits

PROMPTS = ([5, 6, 7, 8], [100, 101, 102], [250, 251, 252, 253, 254], [40])
NEW_TOKENS = 8
# fused q/k/v (and TP partial sums) may add in another order than the trainer: fp32 rounding, which
# grows with the logits' size as training sharpens them; allowed: LOGIT_TOL x max(1, max |logit|)
LOGIT_TOL = 1e-5
MIN_CHANGE = 1e-3  # logits of the previous weights must differ by more, so the check can fail

PHASES = (
    "OFFLOADING",
    "CONNECTING",
    "PAUSING",
    "INVALIDATING",
    "TRANSFERRING",
    "POST_PROCESSING",
    "CONTINUING",
    "RESTORING",
)
SHORT = ("offload", "connect", "pause", "inval", "transfer", "post", "continue", "restore")


def make_transport(kind: str, engine: str = "reference") -> Any:
    if engine in ("sglang", "vllm"):
        return make_api_transport(kind, engine)
    if kind == "shm":
        from refit.drivers.shm import SharedMemoryTransport

        return SharedMemoryTransport()
    if kind == "broadcast":
        from refit.drivers.broadcast import BroadcastTransport

        return BroadcastTransport()
    raise ValueError(f"transport {kind!r}: use shm or broadcast")


def make_api_transport(kind: str, engine: str) -> Any:
    """The transport speaking an engine API's wire format: tensors by reference (shm) or a broadcast."""
    if engine == "sglang":
        from refit.drivers.flattened import SGLangBroadcastTransport, SGLangTensorTransport

        return SGLangTensorTransport() if kind == "shm" else SGLangBroadcastTransport()
    if engine == "vllm":
        from refit.drivers.flattened import VLLMBroadcastTransport, VLLMIPCTransport

        return VLLMIPCTransport() if kind == "shm" else VLLMBroadcastTransport()
    raise ValueError(f"engine {engine!r}: use reference, sglang or vllm")


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
        ray.init(log_to_driver=False)
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster
        print("starting a local Ray cluster (2 CPUs, no dashboard) ...", flush=True)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def train(model: Any, opt: torch.optim.Optimizer, gen: torch.Generator, steps: int, vocab: int) -> float:
    """Counting sequences (t, t+1, t+2, ... mod vocab): a task the model visibly learns."""
    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, vocab, (32, 1), generator=gen)
        ids = (starts + torch.arange(12)[None, :]) % vocab
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def check_engine(engine: ReferenceEngine, model: TinyLlama, previous: list[torch.Tensor]) -> dict[str, Any]:
    """Compare one engine with the trainer: tokens, logits (and their distance to the old weights), weights."""
    tokens_ok, max_diff, min_change, logits_ok = True, 0.0, float("inf"), True
    for prompt, prev in zip(PROMPTS, previous, strict=True):
        out = engine.generate(prompt, NEW_TOKENS)
        tokens_ok &= out["output"] == greedy(model, list(prompt), NEW_TOKENS)
        got, want = engine.score(prompt), prompt_logits(model, list(prompt))
        diff = float((got - want).abs().max())
        logits_ok &= diff <= LOGIT_TOL * max(1.0, float(want.abs().max()))
        max_diff = max(max_diff, diff)
        min_change = min(min_change, float((got - prev).abs().max()))
    state = engine.state_dict()
    weights_ok = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    ok = tokens_ok and weights_ok and logits_ok and min_change > MIN_CHANGE
    return {"ok": ok, "tokens": tokens_ok, "weights": weights_ok, "max_diff": max_diff, "min_change": min_change}


def combine(checks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ok": all(c["ok"] for c in checks),
        "tokens": all(c["tokens"] for c in checks),
        "weights": all(c["weights"] for c in checks),
        "max_diff": max(c["max_diff"] for c in checks),
        "min_change": min(c["min_change"] for c in checks),
    }


LEGEND = f"""columns:
  refit, ver         the refit's number; the version it published
  loss               the trainer's loss after its optimizer steps
  offload..restore   seconds in each phase (offload and restore: colocated only); total s: the whole refit
  rt                 control round trips (2 in steady state; the first refit also connects)
  bkts, KiB          buckets and KiB moved; peak KiB: the most extra trainer memory the refit held
  tokens             the engines' greedy tokens vs the trainer's (equal | DIFFER)
  max|dlogit|        largest logit difference from the trainer (must be <= {LOGIT_TOL:g} x max(1, max|logit|))
  prev               how far the logits moved from the old weights (must be > {MIN_CHANGE:g}, so the check can fail)
  weights            the engines' weights read back vs the trainer's, bit for bit (exact | DIFFER)"""


def header() -> str:
    h = f"{'refit':>5} {'ver':>3} {'loss':>6} " + " ".join(f"{s:>8}" for s in SHORT)
    h += f" {'total s':>8} {'rt':>2} {'bkts':>4} {'KiB':>6} {'peak KiB':>8}"
    return h + f" {'tokens':>6} {'max|dlogit|':>11} {'prev':>8} {'weights':>7}"


def row(r: int, result: protocol.RefitResult, loss: float, check: dict[str, Any]) -> str:
    cells = " ".join(f"{result.phase_seconds.get(p, 0.0):8.4f}" for p in PHASES)
    return (
        f"{r:>5} {result.version:>3} {loss:6.3f} {cells} {result.seconds:8.4f} {result.round_trips:>2} "
        f"{result.buckets:>4} {result.bytes_moved / 1024:6.0f} {result.trainer_peak_bytes / 1024:8.0f}"
        f" {'equal' if check['tokens'] else 'DIFFER':>6} {check['max_diff']:11.2e} {check['min_change']:8.3f}"
        f" {'exact' if check['weights'] else 'DIFFER':>7}"
    )


@dataclass
class Trainer:
    """What the loop needs from the training side, however it is hosted."""

    train: Callable[[int], float]  # optimizer steps -> last loss
    reference: Callable[[], TinyLlama]  # the current full weights as a plain model (a collective under FSDP)


def refit_loop(
    ctx: protocol.RefitContext,
    engines: list[ReferenceEngine],
    trainer: Trainer,
    *,
    refits: int,
    steps: int,
    faults: dict[int, str] | None = None,
    leader: bool = True,
    stop_on_failure: bool = True,
    echo: bool = True,
) -> list[dict[str, Any]]:
    """Train, refit, check, `refits` times; every trainer rank runs it (only the leader checks and
    prints). Returns one summary per refit."""
    say = print if (echo and leader) else (lambda *a, **k: None)
    say(LEGEND)
    say(header())
    out: list[dict[str, Any]] = []
    for r in range(1, refits + 1):
        ref = trainer.reference()
        previous = [prompt_logits(ref, list(p)) for p in PROMPTS] if leader else []
        if leader and ctx.colocated:
            for e in engines:  # the rollout phase is over: the engines give their memory to training
                e.release_memory(["weights", "kv_cache"])
        loss = trainer.train(steps)
        inflight = []
        if leader and not ctx.colocated:  # rollouts are still generating when the refit starts
            inflight = [e.submit(list(p), 200) for e in engines for p in PROMPTS[:2]]
        spec = (faults or {}).get(r)
        ctx.faults = protocol.FaultPlan.parse(spec) if (spec and leader) else None
        result = protocol.run(ctx)
        if ctx.faults is not None and ctx.faults.unfired():
            say(f"      note: the planned fault {spec!r} never fired (no step of this refit matched it)")
        ref = trainer.reference()  # every rank: under FSDP this gathers
        entry: dict[str, Any] = {"refit": r, "loss": loss, **summary(result)}
        entry["fault_unfired"] = bool(ctx.faults is not None and ctx.faults.unfired())
        if leader:
            updated = [e for e in engines if result.engines[e.name].status == "updated"]
            if updated:
                entry["check"] = combine([check_engine(e, ref, previous) for e in updated])
            spans, lost = [], 0
            for f in inflight:  # requests on an engine that died are lost with it
                try:
                    spans.append(f.result(timeout=60))
                except Exception:  # counted and reported below
                    lost += 1
            if result.ok:
                say(row(r, result, loss, entry["check"]))
                retried = [o.name for o in result.engines.values() if o.attempts > 1]
                if retried:
                    say(f"      retried and caught up: {', '.join(retried)}")
            else:
                say(f"\nrefit {r} did not reach every engine (run state {result.state}): {result.error}")
                for o in result.engines.values():
                    say(f"  {o.name}: {o.status}, serves version {o.version}, {o.attempts} attempt(s), "
                        f"{o.buckets} buckets acked in the last")  # fmt: skip
                say(f"  lock holder after the run: {ctx.lock.holder if ctx.lock else None}")
                if updated:  # the healthy engines really hold the new weights
                    say(f"  healthy engines match the trainer: {entry['check']['ok']}")
            if spans:
                versions = sorted({v for s in spans for v in s["weight_versions"]})
                retracted = sum(s["num_retractions"] for s in spans)
                reasons = sorted({s["finish_reason"] for s in spans})
                say(f"      {len(spans)} in-flight requests finished ({', '.join(reasons)}); {retracted} retractions; "
                    f"token versions {versions}" + (f"; {lost} lost with a dead engine" if lost else ""))  # fmt: skip
        out.append(entry)
        if stop_on_failure and not result.ok:
            break
    return out


def summary(result: protocol.RefitResult) -> dict[str, Any]:
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
            f"all {refits} refits matched the trainer: tokens equal, logits within {LOGIT_TOL:g} x max(1, max|logit|), "
            f"weights bit-exact; extra trainer memory at most {peak / 1024:.0f} KiB"
        )
    return code


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
    trainer = start_ranks(args.ranks, {"seed": args.seed, "transport": args.transport})
    engines: list[Any] = []
    trace, temporary = _trace_path(args)
    try:
        engines = start_engines(args, names, config)
        print(f"actors ready in {time.perf_counter() - t0:.1f}s", flush=True)
        ctx = protocol.RefitContext(
            source=None, transport=make_transport(args.transport), engines=engines, ranks=trainer.ranks,
            mode=args.mode, pause_mode=args.pause_mode, bucket_bytes=args.bucket_bytes, deadline_s=args.deadline,
            retries=args.retries, call_timeout_s=args.call_timeout, trace=trace,
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
            engines=engines, mode=args.mode, pause_mode=args.pause_mode, bucket_bytes=args.bucket_bytes,
            deadline_s=args.deadline, retries=args.retries, call_timeout_s=args.call_timeout, trace=trace,
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
        f"model: {n_params:,} fp32 params ({n_params * 4 / 2**20:.2f} MiB) | mode {args.mode} | pause "
        f"{args.pause_mode} | engine {args.engine} | transport {args.transport} | "
        f"bucket {args.bucket_bytes / 1024:.0f} KiB | "
        f"deadline {args.deadline:g}s"
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
        "pause_mode": args.pause_mode, "refits": args.refits, "steps": args.steps, "bucket_bytes": args.bucket_bytes,
        "deadline": args.deadline, "call_timeout": args.call_timeout, "retries": args.retries, "seed": args.seed,
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


if __name__ == "__main__":
    from refit.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
