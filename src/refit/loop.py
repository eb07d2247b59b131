"""The refit loop the demo and the multi-rank jobs share (refit.demo, refit.spmd, refit.ray_job):
a training step, a refit, then the engines checked against the trainer's model; the table it
prints. Pure of the CLI: it imports neither `refit.demo` nor `refit.cli`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.reference.model import TinyLlama, greedy, prompt_logits

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
    "VERIFYING",
    "CONTINUING",
    "RESTORING",
)
SHORT = ("offload", "connect", "pause", "inval", "transfer", "post", "verify", "continue", "restore")
# atomic runs (stage, then swap): no offload, pause or invalidate; generation stops only in SWAPPING
ATOMIC_PHASES = ("CONNECTING", "STAGING", "TRANSFERRING", "POST_PROCESSING", "VERIFYING", "SWAPPING", "CONTINUING")
ATOMIC_SHORT = ("connect", "stage", "transfer", "post", "verify", "swap", "continue")


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
        from refit.drivers.sglang_transport import SGLangBroadcastTransport, SGLangTensorTransport

        return SGLangTensorTransport() if kind == "shm" else SGLangBroadcastTransport()
    if engine == "vllm":
        from refit.drivers.vllm_transport import VLLMBroadcastTransport, VLLMIPCTransport

        return VLLMIPCTransport() if kind == "shm" else VLLMBroadcastTransport()
    raise ValueError(f"engine {engine!r}: use reference, sglang or vllm")


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
  offload..restore   seconds in each phase (offload and restore: colocated only; verify: comparing what each
                     engine reports it will serve with what the trainer sent); total s: the whole refit
                     (--atomic: connect, stage, transfer, post, verify while the engines generate, then swap:
                     the one wave that stops generation, and continue)
  rt                 control round trips (2 in steady state, 3 with --atomic: the probe, the stage, the swap;
                     the first refit also connects)
  bkts, KiB          buckets and KiB moved; peak KiB: the most extra trainer memory the refit held
  tokens             the engines' greedy tokens vs the trainer's (equal | DIFFER)
  max|dlogit|        largest logit difference from the trainer (must be <= {LOGIT_TOL:g} x max(1, max|logit|))
  prev               how far the logits moved from the old weights (must be > {MIN_CHANGE:g}, so the check can fail)
  weights            the engines' weights read back vs the trainer's, bit for bit (exact | DIFFER)"""


def header(atomic: bool = False) -> str:
    h = f"{'refit':>5} {'ver':>3} {'loss':>6} " + " ".join(f"{s:>8}" for s in (ATOMIC_SHORT if atomic else SHORT))
    h += f" {'total s':>8} {'rt':>2} {'bkts':>4} {'KiB':>6} {'peak KiB':>8}"
    return h + f" {'tokens':>6} {'max|dlogit|':>11} {'prev':>8} {'weights':>7}"


def row(r: int, result: protocol.RefitResult, loss: float, check: dict[str, Any], atomic: bool = False) -> str:
    cells = " ".join(f"{result.phase_seconds.get(p, 0.0):8.4f}" for p in (ATOMIC_PHASES if atomic else PHASES))
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
    say(header(ctx.atomic))
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
                say(row(r, result, loss, entry["check"], ctx.atomic))
                retried = [o for o in result.engines.values() if o.attempts > 1]
                if retried:  # why each was retried: its first attempt's error, without the bracketed context
                    why = [f"{o.name} ({(o.error or 'failed').split(' [')[0]})" for o in retried]
                    say(f"      retried and caught up: {'; '.join(why)}")
            else:
                say(f"\nrefit {r} did not reach every engine (run state {result.state}): {result.error}")
                for o in result.engines.values():
                    serves = "out of service" if not o.serving else f"serves version {o.version}"
                    say(f"  {o.name}: {o.status}, {serves}, {o.attempts} attempt(s), "
                        f"{o.buckets} buckets acked in the last")  # fmt: skip
                say(f"  lock holder after the run: {ctx.lock.holder if ctx.lock else None}")
                if updated:  # the healthy engines really hold the new weights
                    say(f"  healthy engines match the trainer: {entry['check']['ok']}")
            if spans:
                versions = sorted({v for s in spans for v in s["weight_versions"]})
                retracted = sum(s["num_retractions"] for s in spans)
                reasons = sorted({s["finish_reason"] for s in spans})
                stale = sum(int(s.get("stale_kv_tokens") or 0) for s in spans)  # kv="keep": off-policy reads
                old_kv = f"; {stale} reads of KV positions older weights computed" if stale else ""
                dead = f"; {lost} lost with a dead engine" if lost else ""
                say(f"      {len(spans)} in-flight requests finished ({', '.join(reasons)}); {retracted} retractions; "
                    f"token versions {versions}{old_kv}{dead}")  # fmt: skip
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
        "verified": [  # each updated engine's verdict before it published (none when the run does not verify)
            {"ok": o.verify.get("ok"), "compared": o.verify.get("compared"), "probe": o.verify.get("probe")}
            for o in result.engines.values()
            if o.status == "updated" and o.verify is not None
        ],
        "rank_steps": [list(map(list, s.steps)) for s in result.rank_stats],
        "rank_peak_bytes": [s.peak_bytes for s in result.rank_stats],
    }
