"""Atomic refits (stage-then-swap), the reference engine's part (issue 22): a staged session writes
a second copy of the weights while generation goes on serving the first, bucket by bucket between
decode steps; finalize and verify act on the copy; `swap` serves it at a token boundary, the pause
around it only as long as the swap; `discard` drops it and leaves the engine exactly as it was.
Driven by hand here (no protocol yet): every token sampled while the copy is written is the old
weights' own, bit for bit, and every token after the swap the new weights'."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from refit.errors import EngineError
from refit.invariants.tokens import check_token_versions
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama

from .conftest import perturbed
from .test_reference_engine import plan_for

CFG = ModelConfig(max_seq_len=256)
REQUESTS, TOKENS = 4, 48


def _prompts() -> list[list[int]]:
    return [[i + 1, 7, 3, 9 + i] for i in range(REQUESTS)]


def _fresh(model: TinyLlama | None) -> EngineCore:
    """An engine serving `model`'s weights (None: the checkpoint every engine starts from)."""
    core = EngineCore(CFG, seed=0, max_running=1)
    if model is None:
        return core
    plan, sd = plan_for(model), model.state_dict()
    core.pause("abort")
    core.begin(plan)
    for m in plan:
        core.load(m, [(n, sd[n]) for n in m.names])
    core.finalize()
    core.publish(1)
    core.continue_generation()
    return core


def _again(core: EngineCore, prefix: list[int], n: int) -> dict[str, Any]:
    rid = core.submit(prefix, n)
    while core.has_work():
        core.step()
    return core.result(rid)


def _staged_refit(core: EngineCore, model: TinyLlama, *, steps_between: int = 2) -> None:
    """Begin a staged session and write every bucket of `model`, decoding between buckets."""
    plan, sd = plan_for(model, bucket_bytes=16 << 10), model.state_dict()
    core.begin(plan, staged=True)
    for m in plan:
        core.load(m, [(n, sd[n]) for n in m.names])
        for _ in range(steps_between):
            core.step()
    core.finalize()


def test_generation_goes_on_while_the_copy_is_written_and_switches_only_at_the_swap() -> None:
    core = EngineCore(CFG, seed=0, max_running=REQUESTS)
    rids = [core.submit(p, TOKENS) for p in _prompts()]
    for _ in range(6):
        core.step()
    epoch0 = core.weights_epoch
    model = perturbed(TinyLlama(CFG, seed=0), seed=3)
    before = core.tokens_sampled
    _staged_refit(core, model)
    assert core.tokens_sampled > before + 20  # decoding went on between the buckets
    assert core.weights_epoch == epoch0 and not core.dirty and core.info()["staged"]
    # verify reads the copy it will serve: the trainer's weights, while the old ones are served
    assert {n: t for n, t in core.hf_state_dict().items()}.keys() == model.state_dict().keys()
    assert all(torch.equal(core.hf_state_dict()[n], t) for n, t in model.state_dict().items())
    assert torch.equal(core.score([1, 2, 3]), _fresh(None).score([1, 2, 3]))
    core.pause("retract")  # the held requests' KV is recomputed under the new weights
    assert core.swap() == {"swapped": True}
    core.flush()
    core.publish(1)
    core.continue_generation()
    assert core.weights_epoch == epoch0 + 1 and not core.info()["staged"]
    while core.has_work():
        core.step()
    results = [core.result(r) for r in rids]
    assert [r["finish_reason"] for r in results] == ["length"] * REQUESTS
    assert check_token_versions(core.commits, results, engine="e") == []
    fresh = {0: _fresh(None), 1: _fresh(model)}
    for prompt, r in zip(_prompts(), results, strict=True):
        versions, out = r["weight_versions"], r["output"]
        assert versions[0] == 0 and versions[-1] == 1 and sorted(set(versions)) == [0, 1]
        cut = versions.index(1)
        for a, b in itertools.pairwise([0, cut, TOKENS]):
            again = _again(fresh[versions[a]], prompt + out[:a], b - a)
            assert again["output"] == out[a:b]
            mine = torch.tensor(r["logprobs"][a:b], dtype=torch.float32).view(torch.int32)
            assert torch.equal(mine, torch.tensor(again["logprobs"], dtype=torch.float32).view(torch.int32))


def test_discard_leaves_the_engine_exactly_as_it_was() -> None:
    core = EngineCore(CFG, seed=0, max_running=2)
    rid = core.submit(_prompts()[0], TOKENS)
    old = {n: t.clone() for n, t in core.hf_state_dict().items()}
    epoch, commits = core.weights_epoch, list(core.commits)
    model = perturbed(TinyLlama(CFG, seed=0), seed=4)
    plan, sd = plan_for(model, bucket_bytes=16 << 10), model.state_dict()
    core.begin(plan, staged=True)
    core.load(plan[0], [(n, sd[n]) for n in plan[0].names])  # part of the copy written
    core.step()
    assert core.discard() == {"discarded": True}
    assert core.discard() == {"discarded": False}
    assert core.session is None and core.weights_epoch == epoch and core.commits == commits and not core.dirty
    assert all(torch.equal(core.hf_state_dict()[n], t) for n, t in old.items())
    while core.has_work():
        core.step()
    assert core.result(rid)["finish_reason"] == "length"
    assert set(core.result(rid)["weight_versions"]) == {0}
    # and a crashed run's staged copy is dropped by the next run's probe
    core.begin(plan, staged=True)
    assert core.probe(1)["discarded_staged"] is True and not core.info()["staged"]


def test_what_a_staged_session_refuses_names_the_step() -> None:
    core = EngineCore(CFG, seed=0)
    model = perturbed(TinyLlama(CFG, seed=0), seed=5)
    plan = plan_for(model, bucket_bytes=16 << 10)
    with pytest.raises(EngineError, match="swap without a staged copy"):
        core.swap()
    with pytest.raises(EngineError, match="needs its plan"):
        core.begin(None, staged=True)
    core.begin(plan, staged=True)
    with pytest.raises(EngineError, match="finalize it first"):
        core.swap()
    with pytest.raises(EngineError, match="release_memory of the weights while a staged copy is held"):
        core.release_memory(["weights"])
    sd = model.state_dict()
    core.load(plan[0], [(n, sd[n]) for n in plan[0].names])
    with pytest.raises(EngineError, match="finalize after 1 of"):
        core.finalize()
    assert core.info()["staged"]  # a refused finalize ends the session; the copy waits for discard
    with pytest.raises(EngineError, match="not finalized whole"):
        core.swap()
    core.discard()
    _staged_refit(core, model, steps_between=0)
    with pytest.raises(EngineError, match="a staged copy of the weights is held"):
        core.begin(plan)
    with pytest.raises(EngineError, match="pause first"):
        core.swap()
    core.pause("in_place")
    core.swap()
    assert all(torch.equal(core.hf_state_dict()[n], t) for n, t in sd.items())


def test_the_engine_reports_what_a_staged_copy_needs() -> None:
    core = EngineCore(CFG, seed=0)
    memory = core.probe(1)
    weights = sum(t.numel() * t.element_size() for t in core.params.values())
    assert memory["staging_bytes"] == weights + core.head_serving.numel() * core.head_serving.element_size()
    assert memory["free_bytes"] is None or memory["free_bytes"] > 0
