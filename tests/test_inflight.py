"""Refit without stopping generation (issue 22's CPU part): requests held at a token boundary, not
aborted, through refits during generation; every token versioned; versions change only at commit
points; with kv="recompute" each token's log-probability after a switch equals, bit for bit
(float32), that of a fresh engine at that version fed the same prefix; with kv="keep" the held
requests keep their KV (off-policy, counted) and no request started after a switch reuses a prefix
cached under the old weights. A real reference engine, refit over shared memory, the trace checked.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit import invariants, protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import ConfigError
from refit.invariants.tokens import check_token_versions, published_versions
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama
from refit.replay import replay
from refit.trace import load_trace

from .conftest import SMALL_BUCKET, perturbed
from .test_reference_engine import plan_for

CFG = ModelConfig(max_seq_len=512)
REQUESTS, TOKENS, REFITS, PROMPT_LEN = 16, 256, 10, 8


def _prompts() -> list[list[int]]:
    """Distinct first tokens: no request's prefix is another's (a shared cached prefix would be a
    different computation from a fresh prefill, and the comparison below is bit for bit)."""
    g = torch.Generator().manual_seed(7)
    return [
        [i + 1, *torch.randint(0, CFG.vocab_size, (PROMPT_LEN - 1,), generator=g).tolist()] for i in range(REQUESTS)
    ]


def _fresh(weights: dict[str, torch.Tensor], version: int) -> EngineCore:
    """A new engine serving `weights` as `version` (loaded by hand, in this process; version 0 is
    the checkpoint both engines start from)."""
    core = EngineCore(CFG, seed=0, max_running=1)
    if version == 0:
        return core
    model = TinyLlama(CFG, seed=0)
    model.load_state_dict(weights)
    plan = plan_for(model)
    core.pause("abort")
    core.flush()
    core.begin(plan)
    for manifest in plan:
        core.load(manifest, [(n, weights[n]) for n in manifest.names])
    core.finalize()
    core.publish(version)
    core.continue_generation()
    return core


def _generate(core: EngineCore, prompt: list[int], n: int) -> dict[str, Any]:
    rid = core.submit(prompt, n)
    while core.has_work():
        core.step()
    return core.result(rid)


def _refits_during_generation(tmp_path: Path, **ctx_kw: Any) -> tuple[list[dict], dict[int, dict], list[dict], Any]:
    """16 requests of 256 tokens on one engine, 10 refits paced by the tokens generated so far."""
    engine = ReferenceEngine.in_thread("g0", CFG, seed=0, max_running=REQUESTS)
    model = TinyLlama(CFG, seed=0)
    weights = {0: {k: v.clone() for k, v in model.state_dict().items()}}
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [engine], bucket_bytes=SMALL_BUCKET, trace=tmp_path / "t.jsonl",
        **ctx_kw,
    )  # fmt: skip
    try:
        futures = [engine.submit(p, TOKENS) for p in _prompts()]
        total = REQUESTS * TOKENS
        for step in range(1, REFITS + 1):
            while engine.info()["tokens_sampled"] < step * total // (REFITS + 2):
                time.sleep(0.005)
            perturbed(model, seed=step)
            result = protocol.run(ctx)
            assert result.ok, result.error
            weights[result.version] = {k: v.clone() for k, v in model.state_dict().items()}
        results = [f.result(timeout=300) for f in futures]
        info = engine.info()
        ctx.close()
        _, events, _ = load_trace(tmp_path / "t.jsonl")
        assert invariants.check_trace(events) == []
        assert replay(tmp_path / "t.jsonl").divergence is None  # the KV policy is replayed too
        return results, weights, events, info
    finally:
        ctx.close()
        engine.close()


def _assert_versioned_at_commit_points(results: list[dict], info: dict, events: list[dict]) -> None:
    assert [r["finish_reason"] for r in results] == ["length"] * REQUESTS  # none aborted
    for r in results:
        assert len(r["output"]) == len(r["weight_versions"]) == len(r["weights_epochs"]) == len(r["logprobs"]) == TOKENS
    assert check_token_versions(info["commits"], results, engine="g0", published=published_versions(events, "g0")) == []
    seen = set().union(*(r["weight_versions"] for r in results))
    assert seen == set(range(REFITS + 1))  # every refit landed while these requests were generating
    assert min(len(set(r["weight_versions"])) for r in results) >= REFITS // 2


@pytest.mark.parametrize("atomic", [False, True], ids=["in_flight", "atomic"])
def test_sixteen_requests_run_through_ten_refits_recomputing_their_kv(tmp_path: Path, atomic: bool) -> None:
    results, weights, events, info = _refits_during_generation(tmp_path, pause_mode="retract", atomic=atomic)
    _assert_versioned_at_commit_points(results, info, events)
    if atomic:  # the copies were written while the requests went on generating with the served weights
        assert info["tokens_while_staged"] > 0
        assert {e["state"] for e in events if e.get("event") == "pause"} == {"SWAPPING"}
    assert all(r["stale_kv_tokens"] == 0 for r in results)
    start = next(e for e in events if e.get("event") == "start")
    assert start["kv"] == "recompute" and start["pause_mode"] == "retract"
    fresh = {v: _fresh(w, v) for v, w in weights.items()}
    compared = 0
    for prompt, r in zip(_prompts(), results, strict=True):
        versions, out = r["weight_versions"], r["output"]
        cuts = [i for i in range(TOKENS) if i == 0 or versions[i] != versions[i - 1]] + [TOKENS]
        for a, b in itertools.pairwise(cuts):
            again = _generate(fresh[versions[a]], prompt + out[:a], b - a)
            assert again["output"] == out[a:b]
            mine = torch.tensor(r["logprobs"][a:b], dtype=torch.float32)
            theirs = torch.tensor(again["logprobs"], dtype=torch.float32)
            assert torch.equal(mine.view(torch.int32), theirs.view(torch.int32)), (r["rid"], a, versions[a])
            compared += b - a
    assert compared == REQUESTS * TOKENS


def test_held_in_place_requests_keep_their_kv_and_new_ones_never_reuse_old_prefixes(tmp_path: Path) -> None:
    results, _, events, info = _refits_during_generation(
        tmp_path, pause_mode="in_place", kv="keep", mode="disaggregated"
    )
    _assert_versioned_at_commit_points(results, info, events)
    assert all(r["num_retractions"] == 0 for r in results)  # held in place, not retracted
    assert all(r["stale_kv_tokens"] > 0 for r in results)  # off-policy: KV from older weights, counted
    start = next(e for e in events if e.get("event") == "start")
    assert start["kv"] == "keep" and start["pause_mode"] == "in_place"


def test_a_request_started_after_an_in_place_refit_reuses_no_old_prefix(tmp_path: Path) -> None:
    engine = ReferenceEngine.in_thread("g1", CFG, seed=0)
    model = TinyLlama(CFG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [engine], bucket_bytes=SMALL_BUCKET, pause_mode="in_place",
        kv="keep", mode="disaggregated",
    )  # fmt: skip
    try:
        prompt = _prompts()[0]
        held = engine.submit(prompt, 200)  # running (holds KV) through the refit
        engine.generate(prompt, 2)  # caches the prompt's prefix under the old weights
        while engine.info()["tokens_sampled"] < 20:
            time.sleep(0.005)
        perturbed(model, seed=1)
        assert protocol.run(ctx).ok
        after = engine.generate(prompt, 4)
        assert after["stale_kv_tokens"] == 0 and after["weight_versions"] == [1] * 4
        assert held.result(timeout=120)["stale_kv_tokens"] > 0  # the held one kept its old KV (off-policy)
    finally:
        ctx.close()
        engine.close()


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"pause_mode": "in_place"}, "pass kv='keep'"),
        ({"kv": "keep"}, "only pause_mode 'in_place' holds"),
        ({"kv": "keep", "pause_mode": "in_place", "mode": "colocated"}, "colocated refit releases"),
        ({"kv": "fresh"}, "kv must be one of"),
    ],
)
def test_a_kv_policy_that_does_not_fit_the_pause_mode_is_refused(kw: dict, match: str) -> None:
    engine = ReferenceEngine.in_thread("g2", CFG, seed=0)
    try:
        with pytest.raises(ConfigError, match=match):
            protocol.RefitContext(TorchSource(TinyLlama(CFG, seed=0)), SharedMemoryTransport(), [engine], **kw)
    finally:
        engine.close()


def test_tokens_sampled_between_buckets_or_under_a_bare_label_break_the_invariant() -> None:
    """What the invariant exists to catch, done for real to an engine: generation continued after
    one bucket landed, and a version label set without an update (SGLang's /update_weight_version)."""
    core = EngineCore(CFG, seed=0)
    model = perturbed(TinyLlama(CFG, seed=0), seed=1)
    plan, sd = plan_for(model), model.state_dict()
    first = _generate(core, [5, 6, 7], 3)
    core.pause("retract")
    core.flush()
    core.begin(plan)
    core.load(plan[0], [(n, sd[n]) for n in plan[0].names])
    core.continue_generation()  # a driver bug: generation resumes between buckets
    mixed = _generate(core, [5, 6, 7], 3)
    (bad,) = check_token_versions(core.commits, [first, mixed])
    assert bad.invariant == "token_version" and "between buckets" in bad.message

    other = EngineCore(CFG, seed=0)
    other.label_version(3)
    (bad,) = check_token_versions(other.commits, [_generate(other, [5, 6, 7], 2)])
    assert "version 3 at weights epoch 0" in bad.message


_SEEN = {"tokens": 0, "switches": 0}  # what the random programs exercised, over all examples
_MODELS = [perturbed(TinyLlama(CFG, seed=0), seed=s) for s in (11, 12)]
_PLAN = plan_for(_MODELS[0])
_ROUNDS = st.lists(
    st.tuples(
        st.integers(0, 3),  # requests submitted this round
        st.integers(1, 30),  # their max_new_tokens
        st.integers(0, 6),  # decode steps before the refit
        st.sampled_from(["retract", "in_place", "abort"]),  # how the refit pauses
        st.one_of(st.just(len(_PLAN)), st.integers(0, len(_PLAN))),  # buckets that land (all: it publishes)
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(rounds=_ROUNDS, steps_between=st.integers(0, 2))
def test_under_any_interleaving_of_requests_and_refits_versions_change_only_at_commit_points(
    rounds: list[tuple], steps_between: int
) -> None:
    """Random programs against a real engine core: requests submitted and decoded, refits paused in
    any mode whose buckets land with decode steps tried between them, some cut short (the engine
    is then quarantined until a whole refit), then everything decoded to the end."""
    core = EngineCore(CFG, seed=0, max_running=4)
    rids: list[int] = []
    version = 0
    kept = any(r[3] == "in_place" for r in rounds)  # some requests may keep old-weight KV (kv="keep")
    for submitted, length, steps, mode, landed in rounds:
        for _ in range(submitted if not core.quarantined else 0):
            rids.append(core.submit([len(rids) % 50 + 1, 2, 3], length))
        for _ in range(steps):
            core.step()
        sd = _MODELS[version % 2].state_dict()
        core.pause(mode)
        core.flush()  # held in place: the prefix cache only, each held request keeps its own KV
        core.begin(_PLAN)
        for manifest in _PLAN[:landed]:
            core.load(manifest, [(n, sd[n]) for n in manifest.names])
            for _ in range(steps_between):
                core.step()  # paused: nothing is decoded between buckets
        if landed < len(_PLAN):
            core.quarantine("cut short")
            continue
        core.finalize()
        version += 1
        core.publish(version)
        core.continue_generation()
    while core.has_work():
        core.step()
    results = [core.result(r) for r in rids]
    assert check_token_versions(core.commits, results) == []
    _SEEN["tokens"] += sum(len(r["output"]) for r in results)
    _SEEN["switches"] += sum(len(set(r["weight_versions"])) > 1 for r in results)
    for r in results:
        assert r["finish_reason"] in ("length", "abort", "quarantined")
        assert r["weight_versions"] == sorted(r["weight_versions"])
        assert kept or r["stale_kv_tokens"] == 0  # recomputed: no token read KV from other weights


def test_the_random_programs_sampled_tokens_across_switches() -> None:
    """The property above is not vacuous: its examples decoded tokens, and requests that ran
    through a version switch."""
    test_under_any_interleaving_of_requests_and_refits_versions_change_only_at_commit_points()
    assert _SEEN["tokens"] > 200 and _SEEN["switches"] > 5, _SEEN


def test_malformed_reports_are_violations_not_exceptions() -> None:
    good = {"rid": 0, "output": [1, 2], "weight_versions": [0, 0], "weights_epochs": [0, 0]}
    assert check_token_versions([(0, 0)], [good]) == []
    cases = [
        ([(0, 0)], [{**good, "weight_versions": [True, True]}], "not counts"),
        ([(0, 0)], [{**good, "weight_versions": [0.0, 0.0]}], "not counts"),
        ([(0, 0)], [{**good, "weights_epochs": [0]}], "2 tokens, 2 versions, 1 epochs"),
        ([(0, 0)], [{**good, "output": 7}], "no list of tokens"),
        ([(0, 0)], ["a string"], "not a mapping"),
        ([(1.9, 0)], [good], "not (version, epoch) counts"),
        ([("0", "0")], [good], "not (version, epoch) counts"),
        ([None], [good], "not (version, epoch) counts"),
        ({"0": 0}, [good], "not (version, epoch) counts"),
        ([(0, 0)], None, "not a list"),
        ([(0, 0), (0, 1)], [{**good, "weights_epochs": [1, 0]}], "at epoch 0 after version 0 at epoch 1"),
    ]
    for commits, requests, match in cases:
        (v,) = check_token_versions(commits, requests)
        assert v.invariant == "token_version" and match in v.message, (match, v.message)
