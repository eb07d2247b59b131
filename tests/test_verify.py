"""Verification before publish (`RefitContext(verify="digest")`, the default): each engine reports the
digests of what it will serve, computed from its own layout; only engines that match the trainer's
digests of what it sent publish. The faults are injected for real inside the engine (it acks,
finalizes and would serve wrong weights); a fault that is not real shows as weights that still match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from refit import invariants, protocol
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import ConfigError
from refit.reference.model import TinyLlama
from refit.replay import replay
from refit.trace import load_trace
from refit.verify import SERVED_HEAD, compare, digest, judge, merge

from .conftest import CONFIG, SMALL_BUCKET, perturbed

TRANSPORTS = {"shm": SharedMemoryTransport, "broadcast": BroadcastTransport}
SILENT = ("flip", "swap_qk", "downcast", "skip", "stale_head", "swap_tp", "late_copy")


def test_compare_names_what_differs_what_is_missing_and_what_was_never_sent() -> None:
    sent = {"a": "01", "b": "02", "model.embed_tokens.weight": "03"}
    assert compare(sent, {"a": "01", "b": "02", "model.embed_tokens.weight": "03"}).ok
    v = compare(sent, {"a": "01", "b": "ff", "x": "04"})
    assert not v.ok and v.mismatched == ["b"] and v.missing == ["model.embed_tokens.weight"] and v.unexpected == ["x"]
    assert "1 differ: b" in v.describe() and "1 not reported" in v.describe()
    # a tied head is served from its own copy: reported under the head's name, compared with the embedding
    full = {**sent, SERVED_HEAD: "03"}
    assert compare(sent, full).ok and compare(sent, full).compared == 4
    assert compare(sent, {**full, SERVED_HEAD: "07"}).mismatched == [SERVED_HEAD]
    # ranks that packed the same tensor agree; one that disagrees makes the name unmatchable
    kind, merged = merge([{"kind": "xxh3", "digests": {"a": "01"}}, None, {"kind": "xxh3", "digests": {"a": "02"}}])
    assert kind == "xxh3" and merged == {"a": "conflict"}
    # every tensor differing is named as what it usually is (a server's dtype or layout), one is not
    everything = judge({"kind": "xxh3", "digests": {"a": "ff", "b": "fe"}}, "xxh3", {"a": "01", "b": "02"}, None)
    assert "every tensor differs: does the engine keep the weights in another dtype" in everything["problems"][0]
    one = judge({"kind": "xxh3", "digests": {"a": "01", "b": "fe"}}, "xxh3", {"a": "01", "b": "02"}, None)
    assert "every tensor differs" not in one["problems"][0]


def _run_once(engines: list[ReferenceEngine], model: TinyLlama, **kw: Any) -> protocol.RefitResult:
    """One refit over shared memory in small buckets; the context and the engines are closed after."""
    ctx = protocol.RefitContext(TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, **kw)
    try:
        return protocol.run(ctx)
    finally:
        ctx.close()
        for e in engines:
            e.close()


def _bucket_names(trace: Path, index: int) -> set[str]:
    _, events, _ = load_trace(trace)
    plan = next(e for e in events if e.get("kind") == "plan")
    return set(plan["manifests"][index]["names"])


def _silent_run(tmp_path: Path, transport: str, kind: str, *, retries: int) -> tuple[protocol.RefitResult, Any]:
    tp = 2 if kind == "swap_tp" else 1
    if tp > 1:
        engines = ReferenceEngine.spawn_many(["e0", "e1"], CONFIG, seed=0, tp=tp)
    else:
        engines = [ReferenceEngine.in_thread(f"e{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=3)
    at_finalize = kind == "stale_head"
    plan = protocol.FaultPlan().fail_at(
        "post_processing" if at_finalize else "transferring", engine=0, bucket=None if at_finalize else 1, kind=kind
    )
    trace = tmp_path / "t.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), TRANSPORTS[transport](), engines, bucket_bytes=SMALL_BUCKET, retries=retries,
        faults=plan, trace=trace, deadline_s=30.0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        want = model.state_dict()
        e0, e1 = engines
        tokens = [1, 2, 3, 4, 5]
        wrong = [n for n, t in e0.state_dict().items() if not torch.equal(t, want[n])]
        served_differs = not torch.equal(e0.score(tokens), e1.score(tokens))
    finally:
        ctx.close()
        for e in engines:
            e.close()
    return result, (trace, wrong, served_differs)


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("kind", SILENT)
def test_a_silent_fault_is_caught_named_and_never_published(tmp_path: Path, transport: str, kind: str) -> None:
    result, (trace, wrong, served_differs) = _silent_run(tmp_path, transport, kind, retries=0)
    bad, good = result.engines["e0"], result.engines["e1"]
    assert served_differs  # the fault was real: the engine would have served other logits
    assert bad.status == "quarantined" and bad.version is None and not bad.serving
    assert bad.verify is not None and not bad.verify["ok"] and bad.verify["mismatched"]
    assert "unverified" in (bad.error or "") and bad.verify["mismatched"][0] in (bad.error or "")
    if kind == "stale_head":
        assert bad.verify["mismatched"] == [SERVED_HEAD] and wrong == []  # its weights are right, its head is not
    else:
        assert set(bad.verify["mismatched"]) <= _bucket_names(trace, 1)  # only what the fault touched
        assert set(bad.verify["mismatched"]) == set(wrong)  # named exactly: what differs when read back
    assert good.status == "updated" and good.verify is not None and good.verify["ok"]
    assert good.verify["compared"] == bad.verify["compared"] > 0
    _, events, _ = load_trace(trace)
    assert invariants.check_trace(events) == []
    assert replay(trace).divergence is None


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
@pytest.mark.parametrize("kind", ["flip", "stale_head"])
def test_an_engine_that_failed_verification_is_retried(tmp_path: Path, kind: str, transport: str) -> None:
    """Over a broadcast group the retry first rebuilds the group for the engines it retries (the
    verified one receives nothing more: a group holding it would stall every send)."""
    result, (trace, wrong, served_differs) = _silent_run(tmp_path, transport, kind, retries=1)
    bad = result.engines["e0"]
    assert result.ok and bad.status == "updated" and bad.attempts == 2 and bad.verify and bad.verify["ok"]
    assert wrong == [] and not served_differs  # the retry loaded it whole
    _, events, _ = load_trace(trace)
    verdicts = [e for e in events if e.get("event") == "verified" and e.get("engine") == "e0"]
    assert [v["ok"] for v in verdicts] == [False, True] and [v["attempt"] for v in verdicts] == [0, 1]
    assert invariants.check_trace(events) == []
    assert replay(trace).divergence is None
    sends = [e for e in events if e.get("event") == "send"]
    assert all(e["outcome"] == "ok" for e in sends) and (transport == "shm") == (not sends)


def test_when_the_trainer_cannot_report_its_digests_nothing_publishes_and_the_trace_replays(tmp_path: Path) -> None:
    engines = [ReferenceEngine.in_thread(f"d{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=8)
    trace = tmp_path / "d.jsonl"
    plan = protocol.FaultPlan().fail_at("verifying", call="digests", kind="raise")
    result = _run_once(engines, model, faults=plan, trace=trace)
    assert result.state == "FAILED" and result.error.call == "digests" and result.version is None
    assert {o.status for o in result.engines.values()} == {"quarantined"}  # finalized, never judged: not served
    _, events, _ = load_trace(trace)
    reports = [e for e in events if e.get("kind") == "call" and e.get("event") == "verify"]
    assert len(reports) == 2 and all(e["outcome"] == "ok" for e in reports)  # what the engines did is recorded
    assert invariants.check_trace(events) == []
    assert replay(trace).divergence is None


def test_the_trainers_digests_are_recorded_once_in_verifying_before_any_verdict(tmp_path: Path) -> None:
    """The ranks are asked for their digests as soon as the last bucket is packed (so VERIFYING
    does not wait a round trip for them); the trace still records the answer once, in
    VERIFYING, after every load and before any engine's verdict, as the commit gate reads it."""
    engines = [ReferenceEngine.in_thread(f"o{i}", CONFIG, seed=0) for i in range(2)]
    trace = tmp_path / "o.jsonl"
    result = _run_once(engines, perturbed(TinyLlama(CONFIG, seed=0), seed=5), trace=trace)
    assert result.ok and result.buckets > 2
    _, events, _ = load_trace(trace)
    asked = [e for e in events if e.get("kind") == "call" and e.get("event") == "digests"]
    assert len(asked) == 1 and asked[0]["state"] == "VERIFYING" and asked[0]["outcome"] == "ok"
    last_load = max(e["seq"] for e in events if e.get("event") == "load")
    verdicts = [e["seq"] for e in events if e.get("event") == "verified"]
    assert len(verdicts) == 2 and last_load < asked[0]["seq"] < min(verdicts)
    assert invariants.check_trace(events) == [] and replay(trace).divergence is None


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_clean_refits_raise_no_false_alarm(transport: str) -> None:
    """Refits after real optimizer steps, every one verified: none rejected (200 over shm, 50 over
    a broadcast group)."""
    n = 200 if transport == "shm" else 50
    engines = [ReferenceEngine.in_thread(f"c{i}", CONFIG, seed=0) for i in range(2)]
    model = TinyLlama(CONFIG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx = protocol.RefitContext(TorchSource(model), TRANSPORTS[transport](), engines, bucket_bytes=SMALL_BUCKET)
    gen = torch.Generator().manual_seed(0)
    try:
        for i in range(n):
            loss = model(torch.randint(0, CONFIG.vocab_size, (1, 8), generator=gen)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            result = protocol.run(ctx)
            verdicts = [o.verify for o in result.engines.values()]
            assert result.ok, (i, result.error)
            assert all(v is not None and v["ok"] and v["compared"] > 0 for v in verdicts), (i, verdicts)
        want = model.state_dict()
        assert all(torch.equal(e.state_dict()[k], v) for e in engines for k, v in want.items())
    finally:
        ctx.close()
        for e in engines:
            e.close()


def _verified_trace(tmp_path: Path) -> list[dict[str, Any]]:
    engines = [ReferenceEngine.in_thread(f"t{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=5)
    trace = tmp_path / "v.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, trace=trace
    )
    try:
        assert protocol.run(ctx).ok
    finally:
        ctx.close()
        for e in engines:
            e.close()
    return load_trace(trace)[1]


def test_check_recomputes_each_verdict_from_the_recorded_digests(tmp_path: Path) -> None:
    events = _verified_trace(tmp_path)
    assert invariants.check_run([e for e in events if e.get("run")]) == []
    run = [dict(e) for e in events if e.get("run")]
    verify = next(e for e in run if e.get("event") == "verify" and e.get("engine") == "t0")
    name = sorted(verify["result"]["digests"])[0]
    verify["result"] = {**verify["result"], "digests": {**verify["result"]["digests"], name: "0" * 16}}
    found = [v for v in invariants.check_run(run) if v.invariant == "verified"]
    assert found and name in found[0].message and "t0" in found[0].message  # the run's own verdict is not trusted
    without = [
        e for e in events if e.get("run") and not (e.get("event") in ("verify", "verified") and e.get("engine") == "t1")
    ]
    found = [v for v in invariants.check_run(without) if v.invariant == "verified"]
    assert found and "t1" in found[0].message and "no successful verify" in found[0].message
    off = [dict(e, verify="off") if e.get("event") == "start" else e for e in without]
    assert [v for v in invariants.check_run(off) if v.invariant == "verified"] == []  # verify off: nothing to check


def test_a_driver_that_reports_no_digests_is_refused_up_front() -> None:
    class NoDigests(ReferenceEngine):
        digest_kinds = frozenset()

    engine = NoDigests(ReferenceEngine.in_thread("n0", CONFIG, seed=0).client)
    try:
        with pytest.raises(ConfigError, match=r"engine n0 \(NoDigests\) cannot report digests.*verify='off'"):
            protocol.RefitContext(TorchSource(TinyLlama(CONFIG, seed=0)), SharedMemoryTransport(), [engine])
        with pytest.raises(ConfigError, match="verify must be one of"):
            protocol.RefitContext(
                TorchSource(TinyLlama(CONFIG, seed=0)), SharedMemoryTransport(), [engine], verify="on"
            )
        ctx = protocol.RefitContext(
            TorchSource(perturbed(TinyLlama(CONFIG, seed=0), seed=1)), SharedMemoryTransport(), [engine], verify="off",
            bucket_bytes=SMALL_BUCKET,
        )  # fmt: skip
        result = protocol.run(ctx)
        assert result.ok and result.engines["n0"].verify is None  # trusted, and the result says it was not verified
        ctx.close()
    finally:
        engine.close()


def test_a_verify_answer_without_digests_is_rejected_not_trusted() -> None:
    class Vague(ReferenceEngine):
        def verify(self, kind: str | None, probe: Any = None, *, timeout: float) -> dict[str, Any]:
            return {"kind": kind, "ok": True}  # says it is fine, shows nothing

    engines = [
        Vague(ReferenceEngine.in_thread("v0", CONFIG, seed=0).client),
        ReferenceEngine.in_thread("v1", CONFIG, seed=0),
    ]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=2)
    result = _run_once(engines, model, retries=0)
    vague = result.engines["v0"]
    assert vague.status == "quarantined" and "answered without xxh3 digests" in (vague.error or "")
    assert result.engines["v1"].status == "updated"


def test_the_engine_refuses_to_verify_with_an_update_open() -> None:
    engine = ReferenceEngine.in_thread("o0", CONFIG, seed=0)
    try:
        engine.pause("abort", timeout=5)
        engine.flush(timeout=5)
        engine.client.call("begin", None, timeout=5)  # an update session with no plan checked
        with pytest.raises(Exception, match="session_open"):
            engine.verify("xxh3", timeout=5)
        engine.finalize(timeout=5)
        report = engine.verify("xxh3", timeout=5)
        assert report["kind"] == "xxh3" and report["seconds"] >= 0
        held = {n: digest(t) for n, t in engine.state_dict().items()}
        assert compare(held, report["digests"]).ok  # every tensor as held, and the head it serves
    finally:
        engine.close()


@pytest.mark.parametrize("checksums", [True, False])
def test_a_source_that_casts_on_the_way_is_verified_in_the_dtype_it_sent(checksums: bool) -> None:
    """TorchSource(dtype=bf16) hands out float32 tensors the transport casts while packing: the
    trainer's digests are of the bf16 bytes sent (hashed by the transport, or cast then hashed)."""
    import dataclasses

    config = dataclasses.replace(CONFIG, dtype="bfloat16")
    engines = [ReferenceEngine.in_thread(f"b{i}", config, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=4)  # float32
    ctx = protocol.RefitContext(
        TorchSource(model, dtype=torch.bfloat16), SharedMemoryTransport(checksums=checksums), engines,
        bucket_bytes=SMALL_BUCKET,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert result.ok, result.error
        assert all(o.verify and o.verify["ok"] for o in result.engines.values())
        want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
        assert all(torch.equal(e.state_dict()[k], v) for e in engines for k, v in want.items())
    finally:
        ctx.close()
        for e in engines:
            e.close()


def _probe_run(tmp_path: Path, verify: str, *, rope_theta: float = 10000.0) -> tuple[protocol.RefitResult, Path]:
    """Engine p0 has a wrong config (rope theta) but the same shapes: it takes the bytes as sent."""
    import dataclasses

    engines = [
        ReferenceEngine.in_thread("p0", dataclasses.replace(CONFIG, rope_theta=rope_theta), seed=0),
        ReferenceEngine.in_thread("p1", CONFIG, seed=0),
    ]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=6)
    trace = tmp_path / f"{verify}.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, verify=verify, retries=0,
        trace=trace, mode="colocated",
    )  # fmt: skip
    try:
        return protocol.run(ctx), trace
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_the_probe_catches_a_wrong_engine_config_that_digests_cannot(tmp_path: Path) -> None:
    wrong = 500000.0
    digest, _ = _probe_run(tmp_path, "digest", rope_theta=wrong)
    assert digest.ok and digest.engines["p0"].status == "updated"  # the bytes are right: digests pass
    for mode in ("probe", "both"):
        result, trace = _probe_run(tmp_path, mode, rope_theta=wrong)
        bad, good = result.engines["p0"], result.engines["p1"]
        assert bad.status == "quarantined" and "forward does not match the trainer's model" in (bad.error or "")
        assert bad.verify and not bad.verify["probe"]["ok"] and bad.verify["probe"]["max_diff"] > 1e-3
        assert good.status == "updated" and good.verify and good.verify["probe"]["ok"]
        assert good.verify["probe"]["max_diff"] < 1e-4 and good.verify["probe"]["tolerance"] == 1e-3  # float32
        assert ("compared" in bad.verify) == (mode == "both")  # digest fields only where digests were asked for
        _, events, _ = load_trace(trace)
        assert invariants.check_trace(events) == []
        assert replay(trace).divergence is None
        run = [dict(e) for e in events if e.get("run")]
        call = next(e for e in run if e.get("event") == "verify" and e.get("engine") == "p1")
        call["result"] = {**call["result"], "logprobs": [[x + 0.5 for x in row] for row in call["result"]["logprobs"]]}
        found = [v for v in invariants.check_run(run) if v.invariant == "verified"]
        assert found and "p1" in found[0].message and "log-probability" in found[0].message


def test_a_source_that_cannot_score_fails_the_probe_before_anything_moves() -> None:
    engines = [ReferenceEngine.in_thread("s0", CONFIG, seed=0)]
    state = {k: v.clone() for k, v in perturbed(TinyLlama(CONFIG, seed=0), seed=1).state_dict().items()}
    ctx = protocol.RefitContext(TorchSource(state), SharedMemoryTransport(), engines, verify="probe")
    try:
        result = protocol.run(ctx)
        assert not result.ok and result.state == "FAILED" and result.error.state == "IDLE"
        assert "only an nn.Module can score prompts" in str(result.error)
        assert result.engines["s0"].status == "unchanged" and engines[0].info()["version"] == 0
    finally:
        ctx.close()
        engines[0].close()


def test_wsum_names_bytes_and_their_places() -> None:
    """The GPU digest's host implementation (the same spec the Triton kernel computes: on a GPU,
    tests_gpu/test_wsum.py checks they agree bit for bit)."""
    from refit.wsum import host_digest

    t = torch.randn(1001)
    assert host_digest(t) == host_digest(t.clone()) and len(host_digest(t)) == 16
    flipped = t.clone()
    flipped.view(torch.int32)[500] ^= 1 << 7
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    padded = torch.cat([t, torch.zeros(1)])
    odd = torch.arange(7, dtype=torch.uint8)
    seen = {host_digest(x) for x in (t, flipped, swapped, padded, odd, odd[:6], t.to(torch.bfloat16))}
    assert len(seen) == 7  # a bit, an order, a length (zero padding), a dtype: each changes it


class WsumShm(SharedMemoryTransport):
    digest_kind = "wsum"  # the GPU transports' kind, computed here on the host


@pytest.mark.parametrize("point", ["written", "served"])
def test_a_wsum_refit_hashes_what_it_writes_or_reads_it_back(point: str) -> None:
    """digest_point="written" (the default where the engine can): the engine hashes each tensor as
    it writes it and reads nothing back on a clean refit; "served" reads every tensor back. A bit
    flipped in the engine's memory after its write is seen only when read back: the documented
    limit of "written" (docs/verify.md)."""
    engines = [ReferenceEngine.in_thread(f"w{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=9)
    plan = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="flip")
    ctx = protocol.RefitContext(
        TorchSource(model), WsumShm(), engines, bucket_bytes=SMALL_BUCKET, retries=0, faults=plan, digest_point=point
    )
    try:
        result = protocol.run(ctx)
        good, flipped = result.engines["w0"], result.engines["w1"]
        served = len(ctx.source.metas()) + (SERVED_HEAD not in dict(model.named_parameters()))
        assert good.status == "updated" and good.verify["ok"]
        assert good.verify["read_back"] == (0 if point == "written" else served)
        want = model.state_dict()
        wrong = [n for n, t in engines[1].state_dict().items() if not torch.equal(t, want[n])]
        assert len(wrong) == 1  # the flip is real in both runs
        if point == "served":
            assert flipped.status == "quarantined" and flipped.verify["mismatched"] == wrong
        else:
            assert flipped.status == "updated" and flipped.verify["ok"]  # written whole and right, changed after
        events = ctx.recorder.events
        start = next(e for e in events if e.get("event") == "start")
        assert start["digest"] == "wsum" and start["digest_point"] == point
        assert invariants.check_trace(events, open_ok=True) == []
        rank0 = ctx.ranks.participants[0]  # a resident source: hashed before the pause, not while packing
        assert len(rank0._from_early) == len(ctx.source.metas())
    finally:
        ctx.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize("kind", ["swap_qk", "downcast", "skip", "stale_head", "swap_tp", "late_copy"])
def test_a_fault_in_what_the_engine_writes_is_caught_where_it_is_hashed(kind: str) -> None:
    """The faults a loader commits while writing (a wrong place, a narrower dtype, a tensor never
    written, a head never rebuilt, a copy made after the ack) are caught by the digests taken as it
    writes: each write is credited to the place it lands in, and what was not written whole is
    read back. TP ranks (swap_tp) hash nothing as they write: "written" is refused for them, and
    "auto" reads every tensor back."""
    tp = 2 if kind == "swap_tp" else 1
    names = ["w0", "w1"]
    if tp > 1:
        engines = ReferenceEngine.spawn_many(names, CONFIG, seed=0, tp=tp)
    else:
        engines = [ReferenceEngine.in_thread(n, CONFIG, seed=0) for n in names]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=5)
    at_finalize = kind == "stale_head"
    plan = protocol.FaultPlan().fail_at(
        "post_processing" if at_finalize else "transferring", engine=0, bucket=None if at_finalize else 1, kind=kind
    )
    if tp > 1:  # TP ranks cannot hash as they write: "written" is refused, "auto" reads back
        with pytest.raises(ConfigError, match=r"TP 2.*cannot hash the 'wsum' digest as it writes"):
            protocol.RefitContext(TorchSource(model), WsumShm(), engines, digest_point="written")
    ctx = protocol.RefitContext(
        TorchSource(model), WsumShm(), engines, bucket_bytes=SMALL_BUCKET, retries=0, faults=plan,
        digest_point="written" if tp == 1 else "auto", deadline_s=30.0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        want = model.state_dict()
        wrong = [n for n, t in engines[0].state_dict().items() if not torch.equal(t, want[n])]
        bad, good = result.engines["w0"], result.engines["w1"]
        assert good.status == "updated" and good.verify["ok"]
        assert bad.status == "quarantined" and not bad.verify["ok"]
        if kind == "stale_head":
            assert bad.verify["mismatched"] == [SERVED_HEAD] and wrong == []
        else:
            assert wrong and set(bad.verify["mismatched"]) == set(wrong)
        if tp > 1:
            served = len(ctx.source.metas()) + (SERVED_HEAD not in dict(model.named_parameters()))
            assert good.verify["read_back"] == served
        else:
            assert good.verify["read_back"] == 0 and bad.verify["read_back"] == (kind in ("skip", "stale_head"))
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_written_credits_only_whole_single_writes_and_reads_back_the_rest() -> None:
    """`refit.wsum.Written` on its own: a strided write it does not hash sends every region its
    bytes reach to be read back; a region written half twice and half never is not whole; two
    served names over one memory are refused (a write could be credited to one of them only)."""
    from refit.wsum import Written, host_digest

    w, src = torch.zeros(4, 4), torch.randn(4, 4)
    written = Written({"top": w[0:2], "bottom": w[2:4]})
    written.copy([(w[0:2], src[0:2]), (w[2:4], src[2:4])])
    assert written.missed() == [] and written.results() == {
        "top": host_digest(src[0:2]),
        "bottom": host_digest(src[2:4]),
    }
    again = Written({"top": w[0:2], "bottom": w[2:4]})
    again.copy([(w[0:2], src[0:2]), (w[2:4], src[2:4])])
    again.copy([(w[2:4], src[2:4])])  # all whole once, then one of them again: not once any more
    assert again.missed() == ["bottom"] and again.results() == {"top": host_digest(src[0:2])}
    written.copy([(w[:, 0], torch.full((4,), 7.0))])  # a column: reaches both regions
    assert written.missed() == ["top", "bottom"] and written.results() == {}
    t, want = torch.zeros(8), torch.arange(8, dtype=torch.float32)
    t[4:] = want[4:]
    written = Written({"t": t})
    written.copy([(t[0:4], want[0:4]), (t[0:4], want[0:4])])  # the same half twice, the other never
    assert written.missed() == ["t"] and written.results() == {}
    embed = torch.zeros(16, 4)
    with pytest.raises(ValueError, match="overlap"):
        Written({"embed": embed, "head": embed[8:]})


def test_weights_released_mid_session_are_read_back_not_trusted() -> None:
    """Weights released and resumed while an update session is open (a colocated memory manager
    acting on its own): what the session hashed as it wrote is gone, so verify reads every tensor
    back and names the ones that now hold zeros, as `served` would."""
    from refit.buckets import TensorMeta, plan_buckets
    from refit.reference.engine import EngineCore
    from refit.verify import Digests

    state = {k: v.detach().clone() for k, v in perturbed(TinyLlama(CONFIG, seed=0), seed=9).state_dict().items()}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in state.items()], SMALL_BUCKET)
    core = EngineCore(CONFIG, seed=0)
    core.pause("abort")
    core.begin(plan, "wsum")
    for m in plan[:-1]:
        core.load(m, [(e.meta.name, state[e.meta.name].clone()) for e in m.entries])
    core.release_memory(["weights"])
    core.resume_memory(["weights"])  # zeros: no CPU backup
    core.load(plan[-1], [(e.meta.name, state[e.meta.name].clone()) for e in plan[-1].entries])
    core.finalize()
    report = core.verify("wsum")
    trainer = Digests("wsum")
    for n, t in state.items():
        trainer.add(n, t)
    verdict = compare(trainer.results(), report["digests"])
    zeroed = {e.meta.name for m in plan[:-1] for e in m.entries}
    assert report["read_back"] == len(report["digests"]) and set(verdict.mismatched) == zeroed


def test_digest_point_is_checked_again_at_each_run_and_the_trace_names_who_hashed_as_it_wrote() -> None:
    class KeepsOldBegin(ReferenceEngine):  # an override with the signature before `written_digests`
        def begin(self, plan: Any, *, timeout: float) -> None:  # type: ignore[override]
            super().begin(plan, timeout=timeout)

    engines = [ReferenceEngine.in_thread("w0", CONFIG, seed=0), KeepsOldBegin.in_thread("w1", CONFIG, seed=0)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=4)
    ctx = protocol.RefitContext(TorchSource(model), WsumShm(), engines, bucket_bytes=SMALL_BUCKET)
    try:
        result = protocol.run(ctx)
        assert result.ok and [result.engines[n].verify["read_back"] for n in ("w0", "w1")] == [0, 21]
        start = next(e for e in ctx.recorder.events if e.get("event") == "start")
        assert start["digest_point"] == "auto" and start["digest_written"] == ["w0"]
        ctx.digest_point = "written"  # w1 cannot: refused before anything moves
        with pytest.raises(ConfigError, match=r"w1 .*cannot hash the 'wsum' digest as it writes"):
            protocol.run(ctx)
        ctx.digest_point = "bogus"
        with pytest.raises(ConfigError, match="digest_point must be one of"):
            protocol.run(ctx)
    finally:
        ctx.close()
        for e in engines:
            e.close()
