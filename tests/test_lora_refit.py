"""LoRA refits through `protocol.run`: a PEFT-wrapped trainer model (`LoraSource`) into reference
engines in their own processes, over shared memory, with requests in flight the whole time.

What is asserted: each refit moves the adapter's bytes and nothing else; requests are never
aborted and each keeps the version it was admitted with (its tokens equal a fresh engine serving
only that version); at most max_staleness + 1 versions of the adapter are live; engine memory stays
flat over 200 refits; the trace passes `refit check` and the engines' own records pass the adapter
invariants; a failed step leaves the old version serving, discards the staged one, and the next
refit brings the engine up; what cannot be a LoRA refit is refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peft
import pytest
import torch

from refit import protocol
from refit.drivers.lora_source import LoraSource
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.errors import ConfigError
from refit.invariants import check_engine_audit
from refit.invariants.adapters import (
    adapter_records,
    check_adapter_moves,
    check_adapter_served,
    trace_adapter_moves,
)
from refit.protocol.faults import FaultPlan
from refit.reference.engine import EngineCore
from refit.reference.lora import LORA_TARGETS
from refit.reference.model import ModelConfig, TinyLlama
from refit.trace import load_trace

CFG = ModelConfig()
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]

pytestmark = pytest.mark.e2e


def _peft_model(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    return peft.get_peft_model(TinyLlama(CFG, seed=0), config).eval()


def _train_step(pm: Any, seed: int) -> None:
    """A LoRA 'training step': only the adapter moves (the base model is frozen under PEFT)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))


def _adapter_bytes(pm: Any) -> int:
    return sum(t.numel() * t.element_size() for t in peft.get_peft_model_state_dict(pm).values())


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no VmRSS for {pid}")


def _fresh_tokens(snapshot: dict[str, torch.Tensor], spec: Any, prompt: list[int], n: int) -> list[int]:
    """What an engine serving only this adapter version gives (the same engine code, in-process)."""
    core = EngineCore(CFG, seed=0)
    core.stage_adapter("policy", 1, spec)
    core.load_adapter("policy", list(snapshot.items()))
    core.publish_adapter("policy")
    rid = core.submit(prompt, n, adapter="policy")
    while core.has_work():
        core.step()
    return core.result(rid)["output"]


@pytest.fixture
def engines() -> Iterator[list[ReferenceEngine]]:
    spawned = ReferenceEngine.spawn_many(["e0", "e1"], CFG, seed=0, max_running=8)
    try:
        yield spawned
    finally:
        for e in spawned:
            e.close()


def test_200_lora_refits_with_live_requests(engines: list[ReferenceEngine], tmp_path: Path) -> None:
    pm = _peft_model()
    spec = pm.peft_config["default"]
    source = LoraSource(pm, name="policy")
    trace = tmp_path / "lora.jsonl"
    ctx = protocol.RefitContext(source, SharedMemoryTransport(), engines, max_staleness=1, deadline_s=60, trace=trace)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    futures: list[tuple[int, Any]] = []
    stop = threading.Event()
    admitted = threading.Event()

    def client() -> None:  # keeps requests in flight on both engines, naming the adapter
        i = 0
        while not stop.is_set():
            for e in engines:
                futures.append((i, e.submit(PROMPTS[i % len(PROMPTS)], 12, adapter="policy")))
                i += 1
            admitted.set()
            futures[-1][1].result(timeout=60)

    nbytes = _adapter_bytes(pm)
    live_counts: list[int] = []
    rss: dict[str, list[int]] = {e.name: [] for e in engines}
    thread = None
    try:
        for step in range(1, 201):
            _train_step(pm, step)
            snapshots[step] = {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(pm).items()}
            result = protocol.run(ctx)
            result.raise_for_error()
            assert result.version == step and result.violations == []
            assert result.bytes_moved == nbytes  # the adapter's bytes, exactly: nothing of the base model
            assert {o.status for o in result.engines.values()} == {"updated"}
            if thread is None:  # requests start once a version is live (before it, the adapter is unknown)
                thread = threading.Thread(target=client, daemon=True)
                thread.start()
                assert admitted.wait(30)
            if step % 20 == 0:
                for e in engines:
                    info = e.info()
                    versions = info["adapters"]["policy"]
                    live_counts.append(len(versions))
                    rss[e.name].append(_rss(e.client.pid))
    finally:
        stop.set()
        if thread is not None:
            thread.join(60)
        records = {e.name: e.audit() for e in engines}
        ctx.close()
    results = [(i, f.result(timeout=60)) for i, f in futures]
    assert len(results) > 100
    assert all(r["finish_reason"] == "length" for _, r in results)  # none aborted
    assert all(isinstance(r["adapter_version"], int) and 1 <= r["adapter_version"] <= 200 for _, r in results)
    assert len({r["adapter_version"] for _, r in results}) > 20  # requests really crossed many refits
    assert max(live_counts) <= 2  # max_staleness + 1
    for name, samples in rss.items():  # flat: no growth with the number of refits past the first 40
        assert samples[-1] - samples[1] < 24 << 20, (name, samples)
    for i, r in results[:: max(1, len(results) // 12)]:  # a sample: each request served by its own version
        want = _fresh_tokens(snapshots[r["adapter_version"]], spec, PROMPTS[i % len(PROMPTS)], 12)
        assert r["output"] == want, (i, r["adapter_version"])
    for name, audit in records.items():
        assert audit is not None
        adapters = adapter_records(audit)
        assert check_adapter_moves(adapters, engine=name) == []
        served = [r for i, r in results if engines[i % 2].name == name]
        assert check_adapter_served(adapters, served, engine=name) == []
        assert check_engine_audit(audit, engine=name) == []
    header, events, torn = load_trace(trace)
    starts = [e for e in events if e.get("kind") == "run" and e.get("event") == "start"]
    assert len(starts) == 200 and all(s["adapter"]["name"] == "policy" for s in starts)
    assert not [e for e in events if e.get("event") in ("pause", "flush", "swap")]  # generation never stopped
    from refit.invariants import check_trace

    assert check_trace(events, torn=torn, header=header, whole=True) == []  # the adapter moves the engines reported too
    moves = trace_adapter_moves(events)
    for name in ("e0", "e1"):
        published = [m["adapter_version"] for m in moves[name] if m["event"] == "publish"]
        assert published == list(range(1, 201))  # every version's load, in the trace
        assert len([m for m in moves[name] if m["event"] == "unload"]) >= 190  # and (nearly) every unload


@pytest.mark.parametrize(
    ("state", "call", "kind"),
    [("STAGING", "stage", "raise"), ("TRANSFERRING", "load", "raise"), ("TRANSFERRING", "load", "corrupt"),
     ("POST_PROCESSING", "finalize", "raise"), ("VERIFYING", "verify", "raise"), ("CONTINUING", "publish", "raise")],
)  # fmt: skip
def test_a_failed_step_leaves_the_old_version_serving(
    engines: list[ReferenceEngine], state: str, call: str, kind: str
) -> None:
    pm = _peft_model()
    source = LoraSource(pm, name="policy")
    ctx = protocol.RefitContext(source, SharedMemoryTransport(), engines, max_staleness=1, deadline_s=30, retries=0)
    try:
        protocol.run(ctx).raise_for_error()  # version 1 on both
        before = engines[1].generate(PROMPTS[0], 8, adapter="policy")
        _train_step(pm, 2)
        ctx.faults = FaultPlan().fail_at(state.lower(), engine=1, call=call, kind=kind)
        result = protocol.run(ctx)
        assert result.violations == []
        assert result.engines["e0"].status == "updated"
        failed = result.engines["e1"]
        after = engines[1].generate(PROMPTS[0], 8, adapter="policy")  # it serves on, never paused
        info = engines[1].info()
        if call == "publish":  # which whole version went live is unknown to the run: "failed", not "unchanged"
            assert failed.status == "failed" and after["adapter_version"] in (1, 2)
            assert [v["state"] for v in info["adapters"]["policy"].values()] == ["LIVE"]
        else:  # the staged version was discarded; version 1 serves on, exactly as before
            assert failed.status == "unchanged" and failed.version == 1
            assert after["adapter_version"] == 1 and after["output"] == before["output"]
            assert list(info["adapters"]["policy"]) == ["1"]
        ctx.faults = None
        _train_step(pm, 3)
        result = protocol.run(ctx)  # the next refit brings it up
        result.raise_for_error()
        assert {o.status for o in result.engines.values()} == {"updated"}
        assert engines[1].generate(PROMPTS[0], 8, adapter="policy")["adapter_version"] == 3
    finally:
        ctx.close()


def test_what_cannot_be_a_lora_refit_is_refused_before_anything_starts(engines: list[ReferenceEngine]) -> None:
    source = LoraSource(_peft_model(), name="policy")
    transport = SharedMemoryTransport()
    with pytest.raises(ConfigError, match="use mode='disaggregated'"):
        protocol.RefitContext(source, transport, engines, mode="colocated")
    with pytest.raises(ConfigError, match="verify='probe': a LoRA refit verifies by digest"):
        protocol.RefitContext(source, transport, engines, verify="probe")

    class NoAdapters(ReferenceEngine):
        serves_adapters = False

    plain = NoAdapters(engines[0].client)
    with pytest.raises(ConfigError, match=r"serves_adapters.*e0 cannot"):
        protocol.RefitContext(source, transport, [plain])
    dora = peft.get_peft_model(
        TinyLlama(CFG, seed=0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    )
    with pytest.raises(ValueError, match="use_dora=True"):
        LoraSource(dora, name="policy")
    with pytest.raises(ValueError, match="no PEFT adapter 'default'"):
        LoraSource(TinyLlama(CFG, seed=0), name="policy")


def test_refit_demo_lora_through_the_real_command(tmp_path: Path) -> None:
    """The console script: LoRA refits with requests in flight, tokens equal to PEFT's, the
    adapter's bytes only; its trace passes `refit check` (invariants and replayed decisions) and
    `refit replay` reproduces it."""
    refit = Path(sys.executable).parent / "refit"
    trace = tmp_path / "lora.jsonl"
    run = [str(refit), "demo", "--lora", "--refits", "3", "--steps", "2", "--trace", str(trace)]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[1] for r in rows] == ["1", "2", "3"] and all("equal" in r for r in rows)
    assert all(r[3] == "65536" for r in rows)  # the adapter's bytes (rank 8 on 7 projections x 2 layers, fp32)
    assert "aborted 0" in proc.stdout and "Traceback" not in proc.stderr
    check = subprocess.run([str(refit), "check", str(trace)], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0 and "its decisions replay" in check.stdout, check.stdout + check.stderr
    replay = subprocess.run([str(refit), "replay", str(trace)], capture_output=True, text=True, timeout=60, check=False)
    assert replay.returncode == 0 and "reproduced" in replay.stdout, replay.stdout
    # the versions' loads and unloads are in the trace (the engines' answers carry them), and checked there
    text = trace.read_text()
    for event in ("stage", "complete", "publish", "supersede", "unload"):
        assert f'"event": "{event}", "src": ' in text, event
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(text.replace('"event": "publish", "src": "STAGED"', '"event": "publish", "src": "STAGING"', 1))
    check = subprocess.run(
        [str(refit), "check", str(tampered)], capture_output=True, text=True, timeout=60, check=False
    )
    assert (
        check.returncode == 1
        and "adapter_moves: engine engine-0: policy v1: publish before its load was complete" in (check.stdout)
    ), check.stdout
    # the last run's version published with its stage and complete gone from every answer: a window
    # that starts mid-history may lack a version's load, but not one of a run it has the start of
    events = [json.loads(line) for line in text.splitlines()]
    for e in events:
        moves = (e.get("result") or {}).get("adapter_moves") if isinstance(e.get("result"), dict) else None
        if isinstance(moves, list):
            e["result"]["adapter_moves"] = [
                m for m in moves if not (m["event"] in ("stage", "complete") and m["adapter_version"] == 3)
            ]
    tampered.write_text("".join(json.dumps(e) + "\n" for e in events))
    check = subprocess.run(
        [str(refit), "check", str(tampered)], capture_output=True, text=True, timeout=60, check=False
    )
    assert check.returncode == 1 and "policy v3 published in run" in check.stdout, check.stdout
    assert "with no stage and complete of it on record in that run" in check.stdout


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--atomic"], "--atomic"), (["--engine", "sglang"], "--engine"), (["--ranks", "2"], "--ranks")],
)
def test_refit_demo_lora_refuses_what_it_does_not_take(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from refit.cli import main

    assert main(["demo", "--lora", *flags]) == 2
    err = capsys.readouterr().err
    assert f"it does not take {named}" in err and "Traceback" not in err


def test_refit_demo_lora_says_why_it_is_never_colocated(capsys: pytest.CaptureFixture[str]) -> None:
    from refit.cli import main

    assert main(["demo", "--lora", "--mode", "colocated"]) == 2
    err = capsys.readouterr().err
    assert "a colocated refit gives the engines' memory to the trainer" in err and " yet" not in err


def test_the_docs_lora_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "lora.md").read_text()
    block, sglang = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    exec(compile(block, "docs/lora.md", "exec"), {})  # the doc's own example
    lines = [line.split(" ", 1) for line in capsys.readouterr().out.splitlines()]
    assert [v for v, _ in lines] == ["1", "2", "3"]  # each request pinned to the version just published
    exec(compile(sglang, "docs/lora.md (SGLang)", "exec"), {})  # into an emulated SGLang
    lines = [line.split(" ", 1) for line in capsys.readouterr().out.splitlines()]
    assert [v for v, _ in lines] == ["1", "2", "3"]
    assert [len(eval(versions)) for _, versions in lines] == [1, 2, 2]  # v1; then v1, v2; then v2, v3
    assert len({tokens for _, tokens in lines}) > 1  # and the adapter moved between them


def test_the_lora_bench_path_runs_on_the_cpu() -> None:
    """`refit bench gpu --paths lora`'s harness (`run_lora`), at the tiny shape over shared memory:
    what it measures is there and consistent (the GPU figure itself is measured on the GPU)."""
    from refit.bench_gpu import run_lora

    row = run_lora(CFG, refits=3, bucket_mb=1, r=4, requests=4, tokens=40, device="cpu")
    assert row["bytes"] == row["adapter_bytes"] > 0 and row["adapter_tensors"] == 2 * 2 * 7
    assert 0 < row["ms_blocked_longest_call"] <= row["ms_blocked_calls_only"] <= row["ms_blocked"] < row["ms_refit"]
    assert row["ms_adapter_copy_gpu"] == 0  # no GPU: the copies are in the calls' time
    assert len(row["per_refit"]) == 3 and all(
        {"load", "verify", "stage"} <= set(r["calls_ms"]) for r in row["per_refit"]
    )
    assert sorted(r["ms_blocked"] for r in row["per_refit"])[1] == pytest.approx(row["ms_blocked"], abs=1e-3)
    assert row["requests_done_not_by_length"] == 0 and 1 <= row["versions_live_after"] <= 2
    # the client replaces each finished request: later ones get the later versions
    assert row["requests_done"] > 4 and row["versions_served"] >= 2
    assert set(row["runner_phase_ms"]) >= {"STAGING", "TRANSFERRING", "DRAINING", "CONTINUING"}


def test_fsdp2_sharded_adapters_refit_from_two_ranks() -> None:
    """Two gloo trainer ranks, the PEFT model sharded by FSDP2 (adapters too): each LoRA refit
    gathers the DTensor adapters on the way into the buffers and moves the adapter's bytes only;
    the engines' tokens under it equal the PEFT model's with the gathered adapter (which changes
    them from the base model's)."""
    from refit.spmd import launch

    reports = launch(2, {"lora": True, "refits": 2, "steps": 2, "bucket_bytes": 16 << 10}, timeout=240)
    assert all("refits" in r for r in reports), reports
    lead = reports[0]["refits"]
    assert [e["version"] for e in lead] == [1, 2] and all(e["ok"] for e in lead), lead
    for e in lead:
        assert e["sharded"] and e["tokens_equal"] and e["adapter_changes_tokens"], e
        assert e["bytes_moved"] == e["adapter_bytes"] and set(e["statuses"].values()) == {"updated"}, e
    assert [e["ok"] for e in reports[1]["refits"]] == [True, True]


def test_a_lora_context_after_a_full_context_attached_the_engines_recovers(engines: list[ReferenceEngine]) -> None:
    """Two contexts over the same engines (a LoRA one and a full-weights one): each attaches its
    own buffers, so the LoRA context's connection no longer matches the engines' end. Its next run
    fails naming that (the engine cannot read the buffer), and the run after builds the
    connection again instead of failing the same way forever."""
    from refit.drivers.torch_source import TorchSource

    pm = _peft_model()
    lora = protocol.RefitContext(LoraSource(pm, name="policy"), SharedMemoryTransport(), engines, max_staleness=1)
    full = protocol.RefitContext(
        TorchSource(TinyLlama(CFG, seed=3)), SharedMemoryTransport(), engines, bucket_bytes=1 << 20
    )
    try:
        protocol.run(lora).raise_for_error()
        protocol.run(full).raise_for_error()  # attaches the engines to its own buffers
        _train_step(pm, 2)
        failed = protocol.run(lora)
        assert not failed.ok and "bad_payload" in str(failed.error), failed.error
        again = protocol.run(lora)
        again.raise_for_error()
        assert {o.status for o in again.engines.values()} == {"updated"}
        assert engines[0].generate(PROMPTS[0], 4, adapter="policy")["adapter_version"] == again.version
    finally:
        lora.close()
        full.close()


def _peft_greedy(pm: Any, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(pm(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-split", "kv-head-replicated"])
def test_lora_refits_into_a_tp2_engine_serve_peft_tokens_and_verify_its_shards(kv_heads: int) -> None:
    """A TP=2 engine (two processes, gloo) takes LoRA refits: each rank keeps its shard of A and B
    (B's rows of q/k/v/gate/up, A's columns of o/down; one KV head held by both ranks in the second
    case), a row-parallel update's A @ x is summed over the ranks, verify gathers the shards back
    into the trainer's tensors (digests equal), and greedy tokens equal PEFT's under each version."""
    import dataclasses

    cfg = dataclasses.replace(CFG, num_kv_heads=kv_heads)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    pm = peft.get_peft_model(TinyLlama(cfg, seed=0), config).eval()
    engine = ReferenceEngine.spawn("tp2", cfg, seed=0, tp=2)
    ctx = protocol.RefitContext(
        LoraSource(pm, name="policy"), SharedMemoryTransport(), [engine], max_staleness=1, verify="digest"
    )
    try:
        for step in range(3):
            _train_step(pm, step)
            result = protocol.run(ctx).raise_for_error()
            assert result.engines["tp2"].verify["ok"] and result.bytes_moved == _adapter_bytes(pm)
            for prompt in PROMPTS[:2]:
                out = engine.generate(prompt, 8, adapter="policy")
                assert out["adapter_version"] == result.version and out["output"] == _peft_greedy(pm, prompt, 8)
        assert len(engine.info()["adapters"]["policy"]) <= 2
    finally:
        ctx.close()
        engine.close()


def test_a_tp2_engines_draining_hold_lapses_on_every_rank_at_once() -> None:
    """A TP=2 engine, max_staleness 0: a run whose publish and discard never arrive leaves v2
    staged, and a drain puts new requests naming the adapter on hold (2 s). A request arriving
    then waits, unpinned, and is served by v1 once the hold lapses: the ranks take rank 0's clock
    for the lapse, inside their replicated scheduling only (the head's own look at its work
    meets no other rank), so neither their batches part nor their collectives hang."""
    pm = _peft_model()
    engine = ReferenceEngine.spawn("tp2", CFG, seed=0, tp=2)
    ctx = protocol.RefitContext(LoraSource(pm, name="policy"), SharedMemoryTransport(), [engine], verify="off")
    try:
        protocol.run(ctx).raise_for_error()
        _train_step(pm, 1)
        ctx.faults = FaultPlan().fail_at("continuing", call="publish").fail_at("aborting", call="discard")
        assert not protocol.run(ctx).ok
        ctx.faults = None
        assert engine.info()["adapters"]["policy"]["2"]["state"] == "STAGED"
        engine.client.call("drain", 2.0, timeout=10)
        held = engine.submit([3, 1, 4], 3, adapter="policy")
        time.sleep(1.0)
        assert not held.done()  # held while the drain's hold is on
        out = held.result(timeout=30)
        assert out["adapter_version"] == 1 and out["finish_reason"] == "length"
        assert engine.generate([3, 1, 4], 3, adapter="policy", timeout=10)["adapter_version"] == 1
    finally:
        ctx.close()
        engine.close()


def test_a_silent_fault_planned_on_a_lora_refit_is_refused_not_a_no_op(engines: list[ReferenceEngine]) -> None:
    """A silent fault (the engine mangles what it loads and says nothing) cannot act on a LoRA
    refit's loads, which go into a staged adapter version: the engine refuses to arm it, so the
    load fails loudly and the engine is not reported updated by a run whose verify proved nothing."""
    pm = _peft_model()
    ctx = protocol.RefitContext(LoraSource(pm, name="policy"), SharedMemoryTransport(), engines[:1], retries=0)
    try:
        ctx.faults = FaultPlan().fail_at("transferring", kind="flip")
        result = protocol.run(ctx)
        outcome = result.engines[engines[0].name]
        assert not result.ok and outcome.status != "updated"
        assert "cannot host a silent flip fault" in (outcome.error or ""), outcome.error
    finally:
        ctx.close()


@pytest.mark.parametrize(
    ("state", "call", "first"),
    [("continuing", "publish", False), ("continuing", "continue_generation", False), ("draining", "drain", True)],
)
def test_moves_an_answer_carried_too_late_are_reported_again_and_the_trace_checks(
    engines: list[ReferenceEngine], tmp_path: Path, state: str, call: str, first: bool
) -> None:
    """A LoRA run whose publish (or the continue in the same call, or a drain) answers after its
    call gave up: the moves it carried went into an answer nobody read. The engine keeps its moves
    until the driver acknowledges the last it handed to the run, so later answers carry them
    again, also when that run is the driver's first (it had acknowledged nothing yet): the trace
    holds every move the engine made, once, and passes `refit check` (it flagged a version LIVE
    twice, or silently lacked the first run's moves, before)."""
    from refit.invariants import check_trace

    pm = _peft_model()
    trace = tmp_path / "late.jsonl"
    ctx = protocol.RefitContext(
        LoraSource(pm, name="policy"), SharedMemoryTransport(), engines, max_staleness=1, deadline_s=30, retries=0,
        call_timeout_s=1.0, trace=str(trace),
    )  # fmt: skip
    try:
        if not first:
            protocol.run(ctx).raise_for_error()
            _train_step(pm, 2)
        ctx.faults = FaultPlan().fail_at(state, engine=1, call=call, kind="hang")
        late = protocol.run(ctx)
        assert late.engines["e1"].status == "failed"  # its answer came after the call gave up
        ctx.faults = None
        time.sleep(2.0)  # the hung call ends: the engine carried on meanwhile
        for step in (3, 4):
            _train_step(pm, step)
            assert {o.status for o in protocol.run(ctx).raise_for_error().engines.values()} == {"updated"}
        audit = [(r["n"], r["event"], r["adapter_version"]) for r in engines[1].audit() if r.get("op") == "adapter"]
    finally:
        ctx.close()
    header, events, torn = load_trace(str(trace))
    assert check_trace(events, torn=torn, header=header, whole=True) == []
    moves = [(m["n"], m["event"], m["adapter_version"]) for m in trace_adapter_moves(events)["e1"]]
    assert moves == audit  # every move the engine made, in the trace once, in order


def _pushing_out(
    engine: ReferenceEngine, tokens: int, *, deadline_s: float, trace: Path | None = None, pm: Any = None
) -> tuple[Any, protocol.RefitContext, Any]:
    """A LoRA context over `engine` (max_staleness 1) after two refits, with a request of `tokens`
    tokens pinned to version 1 and the trainer one step on: its next refit pushes version 1 out.
    (the PEFT model, the context, the request's future)"""
    pm = _peft_model() if pm is None else pm
    ctx = protocol.RefitContext(
        LoraSource(pm, name="policy"), SharedMemoryTransport(), [engine], max_staleness=1, deadline_s=deadline_s,
        retries=0, trace=trace,
    )  # fmt: skip
    protocol.run(ctx).raise_for_error()
    long = engine.submit(PROMPTS[0], tokens, adapter="policy")  # pinned to version 1
    time.sleep(0.1)
    _train_step(pm, 2)
    protocol.run(ctx).raise_for_error()  # versions 1 and 2 live: nothing pushed out yet
    _train_step(pm, 3)
    return pm, ctx, long


def _drain_calls(events: list[dict[str, Any]], run: int) -> list[dict[str, Any]]:
    runs = list(dict.fromkeys(e["run"] for e in events if e.get("run") is not None))  # in order
    return [e for e in events if e.get("run") == runs[run] and e.get("kind") == "call" and e.get("event") == "drain"]


def test_a_steady_lora_refit_is_one_request_to_the_engine_then_one_drain_and_the_publish(
    engines: list[ReferenceEngine], tmp_path: Path
) -> None:
    """Steady state (the connection kept, no other run since, each engine the one last seen): the
    probe, the stage, the load and the finalize and verify of the one bucket go to each engine in
    one request (one batch); a refit that connects sends its probe alone first. The trace checks."""
    from refit.invariants import check_trace

    pm = _peft_model()
    trace = tmp_path / "ride.jsonl"
    ctx = protocol.RefitContext(
        LoraSource(pm, name="policy"), SharedMemoryTransport(), engines, max_staleness=1, deadline_s=30, trace=trace
    )
    try:
        for step in (1, 2, 3):
            _train_step(pm, step)
            assert {o.status for o in protocol.run(ctx).raise_for_error().engines.values()} == {"updated"}
    finally:
        ctx.close()
    header, events, torn = load_trace(trace)
    assert check_trace(events, torn=torn, header=header, whole=True) == []
    runs = list(dict.fromkeys(e["run"] for e in events if e.get("run") is not None))
    head = ("probe", "stage", "load", "finalize", "verify")
    for i, run in enumerate(runs):
        for name in ("e0", "e1"):
            calls = [e for e in events if e.get("run") == run and e.get("engine") == name and e.get("kind") == "call"]
            batches = {e["event"]: e["batch"] for e in calls if e["event"] in head}
            assert set(batches) == set(head)
            if i == 0:  # the first connects: the probe alone, then the rest
                assert batches["probe"] != batches["stage"]
            else:
                assert len(set(batches.values())) == 1, (i, name, batches)


def test_a_drain_waits_inside_one_call_while_generation_goes_on(engines: list[ReferenceEngine], tmp_path: Path) -> None:
    """max_staleness 1: the refit to version 3 pushes out version 1, which a long request still
    uses. The engine parks the drain and answers when that request has ended: the run sends one
    drain; the engine looked twice, with the request's last token (version 1 unloaded) between
    the looks, so generation went on during the wait; version 3 goes live after it."""
    from refit.invariants import check_trace

    e0 = engines[0]
    trace = tmp_path / "park.jsonl"
    _pm, ctx, long = _pushing_out(e0, 200, deadline_s=60, trace=trace)
    try:
        since = time.monotonic()
        protocol.run(ctx).raise_for_error()  # pushes version 1 out: waits for `long`
        out = long.result(timeout=30)
        audit = [r for r in e0.audit() if isinstance(r.get("t"), float) and r["t"] >= since]
    finally:
        ctx.close()
    assert out["adapter_version"] == 1 and out["finish_reason"] == "length" and len(out["output"]) == 200
    header, events, torn = load_trace(trace)
    assert check_trace(events, torn=torn, header=header, whole=True) == []
    drains = _drain_calls(events, 2)
    assert len(drains) == 1 and drains[0]["outcome"] == "ok" and drains[0]["result"]["ready"] is True
    assert drains[0]["duration_s"] > 0.01  # the call lasted the wait
    looks = [r for r in audit if r.get("op") == "drain"]
    assert len(looks) == 2 and all(r["ok"] for r in looks)
    unload = [r for r in audit if r.get("op") == "adapter" and r["event"] == "unload" and r["adapter_version"] == 1]
    publish = [r for r in audit if r.get("op") == "adapter" and r["event"] == "publish" and r["adapter_version"] == 3]
    assert len(unload) == 1 and len(publish) == 1
    assert looks[0]["t"] < unload[0]["t"] <= looks[1]["start"] < publish[0]["t"]
    assert "answered" not in looks[0] and looks[1]["answered"] >= looks[1]["t"]  # only the second look answered


def test_a_call_that_arrives_while_a_drain_waits_gets_the_drain_answered_first(
    engines: list[ReferenceEngine], tmp_path: Path
) -> None:
    """A call that may change the engine (here another caller's drain) arriving while a drain is
    parked: the parked drain answers first, not ready, and the run asks again (its next drain
    parks once more) and publishes after the request on the going version ends. The other
    caller's drain, with a short budget, answers not ready before that budget is spent."""
    from refit.invariants import check_trace

    e0 = engines[0]
    trace = tmp_path / "super.jsonl"
    _pm, ctx, long = _pushing_out(e0, 240, deadline_s=60, trace=trace)
    try:
        result: list[Any] = []
        since = time.monotonic()
        runner = threading.Thread(target=lambda: result.append(protocol.run(ctx)), daemon=True)
        runner.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(
            r.get("op") == "drain" and r["t"] >= since for r in e0.audit()[-6:]
        ):  # the run's drain parked
            time.sleep(0.002)
        t0 = time.monotonic()
        other = e0.client.call("steps", [("drain", (5.0,))], 0.3, None, timeout=10)  # the runner's answers first
        other_s = time.monotonic() - t0
        runner.join(30)
        assert result and result[0].ok, result
        out = long.result(timeout=30)
    finally:
        ctx.close()
    assert len(other) == 1 and other[0][0] is True and other[0][1]["ready"] is False and other_s < 0.3
    assert out["finish_reason"] == "length" and out["adapter_version"] == 1
    header, events, torn = load_trace(trace)
    assert check_trace(events, torn=torn, header=header, whole=True) == []
    drains = _drain_calls(events, 2)
    assert len(drains) >= 2 and all(d["outcome"] == "ok" for d in drains)
    assert drains[0]["result"]["ready"] is False and drains[-1]["result"]["ready"] is True


def test_a_drain_still_waiting_when_the_runs_time_runs_out_leaves_the_engine_on_its_old_versions(
    tmp_path: Path,
) -> None:
    """A request on the going version outlasts the run: the parked drain answers not ready before
    its call's budget (not a timeout), the engine leaves the attempt named for the requests still
    there, its staged version is discarded and versions 1 and 2 serve on; all inside the deadline."""
    import dataclasses

    cfg = dataclasses.replace(CFG, max_seq_len=4096)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), init_lora_weights=False)
    pm = peft.get_peft_model(TinyLlama(cfg, seed=0), config).eval()
    (e0,) = ReferenceEngine.spawn_many(["e0"], cfg, seed=0, max_running=8)
    _pm, ctx, long = _pushing_out(e0, 4000, deadline_s=3, pm=pm)
    try:
        t0 = time.monotonic()
        late = protocol.run(ctx)
        took = time.monotonic() - t0
        info = e0.info()
        e0.client.call("abort_requests", timeout=10)
        long.result(timeout=30)
    finally:
        ctx.close()
        e0.close()
    assert not late.ok and late.engines["e0"].status == "unchanged"  # on its old versions
    assert "still had 1 requests when the run's time ran out" in str(late.error)
    assert "did not answer" not in str(late.error)  # a drain's answer, in time: not a timeout
    assert took < 3 + ctx.cleanup_grace_s
    assert sorted(info["adapters"]["policy"]) == ["1", "2"]


class _SlowSteps(EngineCore):
    """A busy engine: each decode step takes 80 ms more (a large batch's)."""

    def _step(self) -> None:
        time.sleep(0.08)
        super()._step()


def test_a_busy_engines_drain_answers_inside_its_budget_and_leaves_it_unchanged() -> None:
    """Decode steps of about 80 ms: a drain parked until near its call's budget answers before a
    step that would end past it, and a run whose going version's request outlasts it ends with the
    engine unchanged on its old versions, named for the requests still there (not a drain that
    did not answer in time, as when the engine's margin ignored its step time)."""
    from refit.reference.client import start_thread

    e0 = ReferenceEngine(start_thread("e0", CFG, 0, max_running=8, core=_SlowSteps))
    pm, ctx, long = _pushing_out(e0, 200, deadline_s=3)  # the request: about 16 s on version 1
    try:
        t0 = time.monotonic()
        late = protocol.run(ctx)
        took = time.monotonic() - t0
        info = e0.info()
        for budget in (0.2, 0.5, 1.0):  # a caller's own drain on the busy engine: answered inside each budget
            _train_step(pm, 4)
            start = time.monotonic()
            assert e0.client.call("steps", [("drain", (5.0,))], budget, None, timeout=budget) is not None
            assert time.monotonic() - start < budget
    finally:
        e0.client.call("abort_requests", timeout=10)
        ctx.close()
        e0.close()
    assert not late.ok and late.engines["e0"].status == "unchanged"
    assert "still had 1 requests when the run's time ran out" in str(late.error), late.error
    assert took < 3 + ctx.cleanup_grace_s
    assert sorted(info["adapters"]["policy"]) == ["1", "2"]
    assert long.result(timeout=30)["finish_reason"] == "abort"


def test_a_lora_trace_recorded_before_runs_rode_still_replays(engines: list[ReferenceEngine], tmp_path: Path) -> None:
    """A trace from before a steady LoRA run's probe and stage rode with bucket 0 (its start events
    have no `lora_ride`: each run probes alone, then stages) replays: the replay does not ride it.
    One recorded now (`lora_ride` true) replays too."""
    from refit.replay import replay

    for ride in (False, True):
        pm = _peft_model()
        trace = tmp_path / f"ride-{ride}.jsonl"
        ctx = protocol.RefitContext(
            LoraSource(pm, name=f"policy{int(ride)}"), SharedMemoryTransport(), engines, max_staleness=1,
            deadline_s=30, trace=trace,
        )  # fmt: skip
        ctx.lora_ride = ride  # (what the runner did before the ride)
        try:
            for step in (1, 2, 3):
                _train_step(pm, step)
                protocol.run(ctx).raise_for_error()
        finally:
            ctx.close()
        if not ride:  # as recorded then: no such key
            lines = [json.loads(line) for line in trace.read_text().splitlines()]
            assert all(e.pop("lora_ride", None) is False for e in lines if e.get("event") == "start")
            trace.write_text("".join(json.dumps(e) + "\n" for e in lines))
        report = replay(str(trace))
        assert report.divergence is None, (ride, report.divergence)


def test_an_engine_restarted_under_its_name_starts_its_adapter_history_afresh_in_the_check(
    tmp_path: Path,
) -> None:
    """An engine process killed and started again under the same name holds no adapter version:
    its new table (another epoch) stages and publishes from nothing. `refit check` follows it
    from there, as the engine's own moves say (it flagged the old process's live version and the
    new one both LIVE, and too many servable, before)."""
    import os
    import signal

    from refit.invariants import check_trace

    pm = _peft_model()
    trace = tmp_path / "restart.jsonl"
    (e0,) = ReferenceEngine.spawn_many(["e0"], CFG, seed=0, max_running=8)
    ctx = protocol.RefitContext(
        LoraSource(pm, name="policy"), SharedMemoryTransport(), [e0], max_staleness=1, deadline_s=30, trace=trace
    )
    again = None
    try:
        for step in (1, 2):
            _train_step(pm, step)
            protocol.run(ctx).raise_for_error()
        os.kill(e0.client.pid, signal.SIGKILL)
        e0.client.close()
        (again,) = ReferenceEngine.spawn_many(["e0"], CFG, seed=0, max_running=8)
        ctx.engines[0] = again
        for step in (3, 4):
            _train_step(pm, step)
            assert protocol.run(ctx).raise_for_error().engines["e0"].status == "updated"
    finally:
        ctx.close()
        e0.close()
        if again is not None:
            again.close()
    header, events, torn = load_trace(trace)
    assert check_trace(events, torn=torn, header=header, whole=True) == []
    epochs = list(dict.fromkeys(m["epoch"] for m in trace_adapter_moves(events)["e0"]))
    assert len(epochs) == 2  # two tables, each followed from its first move
