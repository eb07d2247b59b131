"""The fault matrix's cases and checks (the tests: test_fault_matrix.py and
test_fault_matrix_broadcast.py): every active state x fault kind x {first, last engine} x
{first, middle, last bucket} (the bucket only matters in TRANSFERRING), each a real refit into
two reference engines."""

from __future__ import annotations

import functools

import torch

from refit import invariants, protocol
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.protocol.faults import FAULT_CALLS
from refit.reference.model import TinyLlama
from refit.states import ACTIVE_STATES

from .conftest import CONFIG, SUMMARY, perturbed

KINDS = ("raise", "hang", "kill", "corrupt")
N_BUCKETS = 8  # the default model in 64 KiB buckets


TRANSPORTS = {
    "shm": SharedMemoryTransport,
    "broadcast": BroadcastTransport,
    # per-tensor broadcasts received straight into the engines' weights, runs of small ones packed
    # (NCCL's layout; 16 KiB: a mix in the default model), no
    # checksums (as over NCCL): a corrupted transfer is undetectable there, so no `corrupt` kind
    "broadcast_direct": lambda: BroadcastTransport(ops="tensor", checksums=False, direct_bytes=16 << 10),
}


def kinds(transport: str) -> tuple[str, ...]:
    return tuple(k for k in KINDS if k != "corrupt") if transport == "broadcast_direct" else KINDS


ATOMIC_ONLY = ("STAGING", "SWAPPING")  # states only atomic runs pass
ATOMIC_SKIPS = ("OFFLOADING", "RESTORING", "PAUSING", "INVALIDATING")  # (atomic runs are disaggregated)
LORA_ONLY = ("DRAINING",)  # LoRA refits only (tests/test_lora_refit.py injects there)


def states(atomic: bool) -> list[str]:
    """The states a run of the matrix passes (RECONNECTING: only where a group is rebuilt)."""
    skipped = (*(ATOMIC_SKIPS if atomic else ATOMIC_ONLY), *LORA_ONLY)
    return [str(s) for s in ACTIVE_STATES if s != "RECONNECTING" and s not in skipped]


def cases(transport: str = "shm", *, atomic: bool = False) -> list[tuple[str, str, str, int, int | None]]:
    out = []
    for state in states(atomic):
        buckets = [0, N_BUCKETS // 2, N_BUCKETS - 1] if state == "TRANSFERRING" else [None]
        for kind in kinds(transport):
            for engine in (0, 1):
                out.extend((transport, str(state), kind, engine, b) for b in buckets)
    if transport.startswith(
        "broadcast"
    ):  # engine 1 dies at bucket 1; engine 0 meets the fault while the group is rebuilt
        out.extend((transport, "RECONNECTING", kind, 0, None) for kind in kinds(transport))
    return out


def run_case(
    transport: str, state: str, kind: str, engine: int | None, bucket: int | None, *, steady: bool = False,
    call: str | None = None, max_staleness: int | None = None, atomic: bool = False,
) -> list[str]:  # fmt: skip
    """One refit with one fault; returns every violation found (empty: the case passed). `steady`:
    a disaggregated context whose first refit succeeds; the fault hits its second, whose bucket 0
    rides the pause wave (every engine where the first left it). `call`: only that call faults.
    `max_staleness`: the run's version policy (0: an engine left behind is held, not continued).
    `atomic`: a disaggregated run that stages the weights into copies and swaps them in."""
    engines = [ReferenceEngine.in_thread(f"m{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=7)
    versions = {0: TinyLlama(CONFIG, seed=0).state_dict(), 1: {k: v.clone() for k, v in model.state_dict().items()}}
    faults = protocol.FaultPlan()
    retries = 0
    if state == "RECONNECTING":
        faults.fail_at("TRANSFERRING", engine=1, bucket=1, kind="kill")
        retries = 1
    faults.fail_at(state, engine=engine, bucket=bucket, kind=kind, call=call)
    ctx = protocol.RefitContext(
        TorchSource(model), TRANSPORTS[transport](), engines,
        mode="disaggregated" if steady or atomic else "colocated", atomic=atomic, bucket_bytes=64 << 10,
        deadline_s=5.0, cleanup_grace_s=2.0, call_timeout_s=0.3, retries=retries, faults=None if steady else faults,
        max_staleness=max_staleness,
    )  # fmt: skip
    found: list[str] = []
    try:
        if steady:  # the fault-free first refit: a busy CI box must not make it the one that fails
            ctx.call_timeout_s = 5.0
            protocol.run(ctx).raise_for_error()
            ctx.call_timeout_s = 0.3
            perturbed(model, seed=8)
            versions[2] = model.state_dict()
            ctx.faults = faults
        try:
            result = protocol.run(ctx)
        except protocol.InvariantViolation as exc:
            found.append(str(exc))
            result = exc.result  # type: ignore[attr-defined]
        if any(f.fired != 1 for f in faults.faults):
            found.append(f"a fault did not fire: {faults.faults}")
        if ctx.lock.holder is not None:
            found.append("lock: held after the run")
        ctx.close()
        found += [str(v) for v in invariants.check_trace(ctx.recorder.events)]
        found += [  # the table --fail-at is checked against must name every call the runner made
            f"call {e['event']} ran in {e['state']}, which FAULT_CALLS does not list"
            for e in ctx.recorder.events
            if e.get("kind") == "call" and e.get("state") in FAULT_CALLS and e["event"] not in FAULT_CALLS[e["state"]]
        ]
        for e in engines:
            if not e.client.alive:
                if result.engines[e.name].status != "failed":
                    found.append(f"{e.name} died but is reported {result.engines[e.name].status}")
                continue
            audit = e.audit(timeout=10)  # queued behind anything a hung engine still has to do
            failed = result.engines[e.name].status == "failed"
            found += [str(v) for v in invariants.check_engine_audit(audit, engine=e.name, open_session_ok=failed)]
            found += [str(v) for v in invariants.check_acks(audit, ctx.recorder.events, engine=e.name)]
            found += serving_problems(e, versions, result, failed)
    finally:
        for e in engines:
            e.close()
    return found


def serving_problems(
    e: ReferenceEngine, versions: dict[int, dict[str, torch.Tensor]], result: protocol.RefitResult, failed: bool
) -> list[str]:
    info = e.info(timeout=10)
    outcome = result.engines[e.name]
    if info["quarantined"]:
        try:
            e.generate([1, 2, 3], 2)
            return [f"{e.name} is quarantined but still serves"]
        except EngineError:
            return (
                []
                if outcome.status in ("quarantined", "failed", "stale")  # stale: held by the version policy
                else [f"{e.name} quarantined, reported {outcome.status}"]
            )
    if info["paused"]:
        return [] if failed else [f"{e.name} left paused but reported {outcome.status}"]
    state = e.state_dict()
    want = versions.get(info["version"])
    if want is None or any(not torch.equal(state[k], v) for k, v in want.items()):
        return [f"{e.name} serves weights that version {info['version']} does not name"]
    if not failed and outcome.version != info["version"]:  # a hung engine's late answers are unknown
        return [f"{e.name} serves version {info['version']} but is reported at {outcome.version}"]
    return []


def check_matrix(transport: str, *, max_staleness: int | None = None, atomic: bool = False) -> None:
    """Every case of one transport's matrix; no invariant violation in any."""
    matrix = cases(transport, atomic=atomic)
    run = functools.partial(run_case, max_staleness=max_staleness, atomic=atomic)
    n = len(kinds(transport))
    extra = n if transport.startswith("broadcast") else 0
    k = len(states(atomic))  # 9 (colocated: OFFLOADING to RESTORING), 7 (atomic: CONNECTING to CONTINUING)
    assert len(matrix) == k * n * 2 + n * 2 * 2 + extra  # states x kinds x 2 engines, + 2 more buckets in TRANSFERRING
    violations = {case: problems for case in matrix if (problems := run(*case))}
    redone = [case for case, problems in violations.items() if problems == [p for p in problems if "did not fire" in p]]
    for case in redone:  # the fault missed its step because something else failed first (a slow rendezvous): once more
        if not (problems := run(*case)):
            del violations[case]
        else:
            violations[case] = problems
    policy = ("" if max_staleness is None else f", max_staleness {max_staleness}") + (", atomic" if atomic else "")
    SUMMARY.append(
        f"fault matrix ({transport}{policy}): {len(matrix)} cases ({k} states x {n} kinds x 2 engines, x 3 buckets in "
        f"TRANSFERRING"
        + (f", + RECONNECTING x {n} kinds" if extra else "")
        + f"), {sum(len(v) for v in violations.values())} invariant violations"
        + (f"; {len(redone)} case(s) run again because the fault missed its step" if redone else "")
    )
    assert not violations, "\n".join(f"{case}: {problems}" for case, problems in violations.items())
