"""`refit demo`: the embedded default. A tiny trainer takes real optimizer steps; between steps the
new weights are refit into reference-engine processes; after each refit the engines must give the
trainer's greedy tokens and logits for fixed prompts, and their weights read back bit for bit.

Colocated (default): like a synchronous RL loop, the engines release their weight and KV memory
while the trainer trains; the refit gives the memory back, moves the weights, restores.
Disaggregated: the engines keep generating while the trainer trains; requests are in flight when
the refit pauses them (retract: they are re-prefilled under the new weights after it).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama, greedy, prompt_logits

PROMPTS = ([5, 6, 7, 8], [100, 101, 102], [250, 251, 252, 253, 254], [40])
NEW_TOKENS = 8
LOGIT_ATOL = 1e-5  # fused q/k/v may sum in another order than separate matmuls (0.0 is typical)
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


def _batch(gen: torch.Generator, vocab: int, batch: int = 32, length: int = 12) -> torch.Tensor:
    """Counting sequences (t, t+1, t+2, ... mod vocab): a task the model visibly learns."""
    starts = torch.randint(0, vocab, (batch, 1), generator=gen)
    return (starts + torch.arange(length)[None, :]) % vocab


def _train(model: TinyLlama, opt: torch.optim.Optimizer, gen: torch.Generator, steps: int) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        ids = _batch(gen, model.config.vocab_size)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return float(loss.detach())


def check_engine(engine: ReferenceEngine, model: TinyLlama, previous: list[torch.Tensor]) -> dict[str, Any]:
    """Compare one engine with the trainer: tokens, logits (and their distance to the old weights), weights."""
    tokens_ok, max_diff, min_change = True, 0.0, float("inf")
    for prompt, prev in zip(PROMPTS, previous, strict=True):
        out = engine.generate(prompt, NEW_TOKENS)
        tokens_ok &= out["output"] == greedy(model, list(prompt), NEW_TOKENS)
        got, want = engine.score(prompt), prompt_logits(model, list(prompt))
        max_diff = max(max_diff, float((got - want).abs().max()))
        min_change = min(min_change, float((got - prev).abs().max()))
    state = engine.state_dict()
    weights_ok = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    ok = tokens_ok and weights_ok and max_diff <= LOGIT_ATOL and min_change > MIN_CHANGE
    return {
        "ok": ok,
        "tokens": tokens_ok,
        "weights": weights_ok,
        "max_diff": max_diff,
        "min_change": min_change,
    }


def run_demo(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    config = ModelConfig()
    model = TinyLlama(config, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(args.seed + 1)
    names = [f"engine-{i}" for i in range(args.engines)]
    kind = "threads" if args.in_thread else "processes"
    print(f"starting {args.engines} reference engines ({kind}) ...", flush=True)
    if args.in_thread:
        engines = [ReferenceEngine.in_thread(n, config, seed=args.seed) for n in names]
    else:
        engines = ReferenceEngine.spawn_many(names, config, seed=args.seed)
    try:
        ctx = protocol.RefitContext(
            source=TorchSource(model, optimizer=opt),
            transport=SharedMemoryTransport(),
            engines=engines,
            mode=args.mode,
            pause_mode=args.pause_mode,
            bucket_bytes=args.bucket_bytes,
            deadline_s=args.deadline,
            retries=args.retries,
            call_timeout_s=args.call_timeout,
            trace=args.trace,
            faults=protocol.FaultPlan.parse(args.fail_at) if args.fail_at else None,
        )
    except (protocol.ConfigError, ValueError) as exc:
        for e in engines:
            e.close()
        print(f"refit demo: {exc}", file=sys.stderr)
        return 2
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params:,} fp32 params ({n_params * 4 / 2**20:.2f} MiB) | mode {args.mode} "
        f"| pause {args.pause_mode} "
        f"| bucket {args.bucket_bytes / 1024:.0f} KiB | deadline {args.deadline:g}s"
    )
    header = f"{'refit':>5} {'ver':>3} {'loss':>6} " + " ".join(f"{s:>8}" for s in SHORT)
    header += f" {'total s':>8} {'bkts':>4} {'KiB':>6} {'tokens':>6} {'max|dlogit|':>11} {'vs prev':>8} {'weights':>7}"
    failures = 0
    try:
        print(header)
        for r in range(1, args.refits + 1):
            previous = [prompt_logits(model, list(p)) for p in PROMPTS]
            inflight = []
            if args.mode == "colocated":
                for e in engines:  # the rollout phase is over: the engines give their memory to training
                    e.release_memory(["weights", "kv_cache"])
            loss = _train(model, opt, gen, args.steps)
            if args.mode == "disaggregated":  # rollouts are still generating when the refit starts
                inflight = [e.submit(list(p), 200) for e in engines for p in PROMPTS[:2]]
            result = protocol.run(ctx)
            if not result.ok:
                print(f"\nrefit {r} did not reach every engine (run state {result.state}): {result.error}")
                for o in result.engines.values():
                    print(
                        f"  {o.name}: {o.status}, serves version {o.version}, {o.attempts} attempt(s), "
                        f"{o.buckets} buckets acked in the last"
                    )
                print(f"  lock holder after the run: {ctx.lock.holder if ctx.lock else None}")
                updated = [e for e in engines if result.engines[e.name].status == "updated"]
                if updated:  # the healthy engines really hold the new weights
                    checks = [check_engine(e, model, previous) for e in updated]
                    print(f"  healthy engines match the trainer: {all(c['ok'] for c in checks)}")
                return 1
            retried = [o.name for o in result.engines.values() if o.attempts > 1]
            checks = [check_engine(e, model, previous) for e in engines]
            spans = [f.result(timeout=60) for f in inflight]
            ok = all(c["ok"] for c in checks)
            failures += not ok
            cells = [f"{result.phase_seconds.get(p, 0.0):8.4f}" for p in PHASES]
            print(
                f"{r:>5} {result.version:>3} {loss:6.3f} "
                + " ".join(cells)
                + f" {result.seconds:8.4f} {result.buckets:>4} {result.bytes_moved / 1024:6.0f}"
                + f" {'equal' if all(c['tokens'] for c in checks) else 'DIFFER':>6}"
                + f" {max(c['max_diff'] for c in checks):11.2e} {min(c['min_change'] for c in checks):8.3f}"
                + f" {'exact' if all(c['weights'] for c in checks) else 'DIFFER':>7}"
            )
            if retried:
                print(f"      retried and caught up: {', '.join(retried)}")
            if spans:
                versions = sorted({v for s in spans for v in s["weight_versions"]})
                retracted = sum(s["num_retractions"] for s in spans)
                reasons = sorted({s["finish_reason"] for s in spans})
                print(
                    f"      {len(spans)} in-flight requests finished ({', '.join(reasons)}); {retracted} retractions; "
                    f"token versions {versions}"
                )
    finally:
        ctx.close()
        for e in engines:
            e.close()
    if args.trace:
        print(f"trace: {args.trace}  (check it: refit check {args.trace})")
    if failures:
        print(f"MISMATCH in {failures} of {args.refits} refits")
        return 1
    print(
        f"all {args.refits} refits matched the trainer: tokens equal, logits within {LOGIT_ATOL:g}, weights bit-exact"
    )
    return 0


if __name__ == "__main__":
    from refit.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
