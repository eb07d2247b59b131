"""End to end on CPU with real engine processes: the demo, `refit check`, in-flight requests, and the
failure modes each phase exists to prevent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from refit import invariants, protocol
from refit.drivers.reference import ReferenceEngine
from refit.errors import EngineError
from refit.reference.model import TinyLlama, greedy
from refit.trace import load_trace

from .conftest import CONFIG, matches, perturbed

pytestmark = pytest.mark.e2e
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def refit_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "refit.cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    path = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    return refit_cli("demo", "--trace", str(path)), path


def test_demo_refits_three_times_and_matches(demo_trace) -> None:
    proc, path = demo_trace
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"] and [r[1] for r in rows] == ["1", "2", "3"]
    for r in rows:
        assert r[-4:-3] == ["equal"] and r[-1] == "exact"
        assert float(r[-3]) <= 1e-5 and float(r[-2]) > 1e-3  # matches the trainer, differs from the old weights
    assert "all 3 refits matched the trainer" in proc.stdout
    assert "verified before publish: 6 of 6 engine updates (21 tensors' digests matched the trainer's)" in proc.stdout
    _, events, torn = load_trace(path)
    assert not torn and len([e for e in events if e["kind"] == "run" and e["event"] == "end"]) == 3


def test_check_passes_the_demo_trace_and_fails_a_truncated_copy(demo_trace, tmp_path: Path) -> None:
    _, path = demo_trace
    ok = refit_cli("check", str(path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "every invariant holds" in ok.stdout
    lines = path.read_text().splitlines(keepends=True)
    for name, text in {
        "half.jsonl": "".join(lines[: len(lines) // 2]),
        "torn.jsonl": "".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2],
        "no-end.jsonl": "".join(lines[:-1]),
    }.items():
        cut = tmp_path / name
        cut.write_text(text)
        bad = refit_cli("check", str(cut))
        assert bad.returncode == 1, (name, bad.stdout)
        assert "VIOLATION complete" in bad.stdout
    summary = json.loads(refit_cli("check", str(tmp_path / "half.jsonl"), "--json").stdout)
    assert summary["violations"] and summary["violations"][0]["invariant"] == "complete"


def test_demo_with_an_injected_kill_fails_cleanly(tmp_path: Path) -> None:
    """The engine process really dies mid-transfer: the healthy engine still takes the version."""
    path = tmp_path / "kill.jsonl"
    proc = refit_cli("demo", "--fail-at", "transferring:engine=1:bucket=2:kind=kill", "--trace", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "EngineDied" in proc.stdout and "bucket=2" in proc.stdout
    assert "engine-0: updated, serves version 1" in proc.stdout
    assert "engine-1: failed, out of service" in proc.stdout
    assert "lock holder after the run: None" in proc.stdout
    assert "healthy engines match the trainer: True" in proc.stdout
    assert f"trace: {path}  (check it: refit check {path}; replay it: refit replay {path})" in proc.stdout
    assert proc.stdout.rstrip().endswith("FAILED: refit 1 of 3 did not reach every engine (run state DONE)")
    checked = refit_cli("check", str(path))  # the failed run kept every invariant
    assert checked.returncode == 0, checked.stdout
    replayed = refit_cli("replay", str(path))  # and today's runner takes exactly the same path
    assert replayed.returncode == 0 and "reproduced" in replayed.stdout, replayed.stdout


def test_demo_refuses_in_place_pause() -> None:
    proc = refit_cli("demo", "--pause-mode", "in_place", "--refits", "1")
    assert proc.returncode == 2
    assert "in_place" in proc.stderr and "retract" in proc.stderr


# ---- real engine processes -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def procs() -> Iterator[list[ReferenceEngine]]:
    engines = ReferenceEngine.spawn_many(["p0", "p1"], CONFIG, seed=0)
    yield engines
    for e in engines:
        e.close()


def test_engines_really_are_other_processes(procs: list[ReferenceEngine]) -> None:
    pids = {e.client.pid for e in procs}
    assert os.getpid() not in pids and len(pids) == 2


class NoFlush(ReferenceEngine):
    """A driver that skips the KV flush (reports success without doing it)."""

    def flush(self, *, timeout: float) -> None:
        return None


def test_without_invalidate_a_process_engine_serves_stale_kv(procs: list[ReferenceEngine], make_ctx) -> None:
    """INVALIDATING exists because of this: the prefix cached under the old weights is reused."""
    engine = procs[0]
    engine.generate(PROMPT, 4)  # cache PROMPT's KV under the current weights
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=11, scale=0.2)
    broken = NoFlush(engine.client)
    assert protocol.run(make_ctx(model, [broken])).ok
    out = engine.generate(PROMPT, 8)
    assert out["stale_kv_tokens"] > 0 and out["output"] != greedy(model, PROMPT, 8)

    model = perturbed(model, seed=12, scale=0.2)
    assert protocol.run(make_ctx(model, [engine])).ok  # the real driver flushes
    out = engine.generate(PROMPT, 8)
    assert out["stale_kv_tokens"] == 0 and out["output"] == greedy(model, PROMPT, 8)


def test_a_partial_transfer_is_quarantined_not_served(procs: list[ReferenceEngine], make_ctx) -> None:
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=13, scale=0.3)
    before = [e.state_dict() for e in procs]
    ctx = make_ctx(model, procs, faults=protocol.FaultPlan().fail_at("transferring", bucket=3, call="pack"))
    result = protocol.run(ctx)  # the trainer fails after 3 buckets reached both engines
    assert not result.ok and result.state == "FAILED" and result.version is None
    for e, old in zip(procs, before, strict=True):
        assert result.engines[e.name].status == "quarantined"
        with pytest.raises(EngineError, match="quarantined"):
            e.generate(PROMPT, 2)
        state = e.state_dict()  # proof it was mixed: some tensors new, some old
        assert any(torch.equal(state[k], v) for k, v in model.state_dict().items())
        assert any(torch.equal(state[k], old[k]) for k in state if not torch.equal(old[k], model.state_dict()[k]))
    ctx.faults = None
    healed = protocol.run(ctx)
    assert healed.ok and all(matches(e, model) for e in procs)
    assert all(e.generate(PROMPT, 8)["output"] == greedy(model, PROMPT, 8) for e in procs)


@pytest.mark.parametrize("pause_mode", ["retract", "abort"])
def test_in_flight_requests_across_a_refit(procs: list[ReferenceEngine], make_ctx, pause_mode: str) -> None:
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=14)
    ctx = make_ctx(model, procs, mode="disaggregated", pause_mode=pause_mode)
    assert protocol.run(ctx).ok  # connected first, so the refit under test reaches its pause promptly
    model = perturbed(model, seed=140)
    old_version = ctx.published_version
    n = CONFIG.max_seq_len - len(PROMPT)  # as long as the engine allows: still running at the pause
    futures = [e.submit(PROMPT, n) for e in procs]
    time.sleep(0.05)  # let them start generating
    result = protocol.run(ctx)
    assert result.ok
    outs = [f.result(timeout=60) for f in futures]
    for out in outs:
        if pause_mode == "abort":
            assert out["finish_reason"] == "abort" and set(out["weight_versions"]) == {old_version}
        else:
            assert out["finish_reason"] == "length" and out["num_retractions"] >= 1
            switch = out["weight_versions"].index(result.version)
            assert set(out["weight_versions"][:switch]) == {old_version}
            assert out["stale_kv_tokens"] == 0
            assert out["output"][switch:] == greedy(model, PROMPT + out["output"][:switch], n - switch)


def test_a_dead_engine_fails_the_run_fast_and_cleanly(make_ctx) -> None:
    engines = ReferenceEngine.spawn_many(["d0", "d1"], CONFIG, seed=0)
    try:
        model = perturbed(TinyLlama(CONFIG, seed=0), seed=15)
        engines[1].client.process.kill()
        engines[1].client.process.wait(10)
        ctx = make_ctx(model, engines, deadline_s=20.0, version=0)
        t0 = time.monotonic()
        result = protocol.run(ctx)
        assert time.monotonic() - t0 < 5.0  # death is noticed at once, not at the deadline
        assert not result.ok and "EngineDied" in str(result.error) and result.error.engine == "d1"
        assert result.engines["d1"].status == "failed" and result.engines["d1"].version is None
        assert result.engines["d0"].status == "updated" and result.version == 1
        assert engines[0].generate(PROMPT, 8)["output"] == greedy(model, PROMPT, 8)
        assert ctx.lock.holder is None
    finally:
        for e in engines:
            e.close()


def test_a_hung_engine_ends_the_run_inside_its_deadline(make_ctx) -> None:
    engines = ReferenceEngine.spawn_many(["h0", "h1"], CONFIG, seed=0)
    try:
        model = perturbed(TinyLlama(CONFIG, seed=0), seed=16)
        ctx = make_ctx(model, engines, deadline_s=2.0, cleanup_grace_s=1.0)
        os.kill(engines[1].client.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        result = protocol.run(ctx)
        took = time.monotonic() - t0
        assert 2.0 <= took <= 2.0 + 1.0 + invariants.DEADLINE_SLACK_S
        assert isinstance(result.error, protocol.DeadlineExceeded)
        assert result.error.engine == "h1" and result.error.state == "CONNECTING" and result.error.call == "probe"
        assert ctx.lock.holder is None
        assert result.engines["h0"].status == "unchanged"  # it waited out the deadline, then went back to serving
        assert result.engines["h1"].status == "failed"
    finally:
        os.kill(engines[1].client.pid, signal.SIGCONT)
        for e in engines:
            e.close()
