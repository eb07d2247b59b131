"""Batched decoding in the reference engine (`batch_decode=True`): one forward per step for every
running request that holds KV, each from its own slot of a static KV cache, as serving engines
batch (what `refit bench gpu --paths atomic` decodes 64 requests with). Its tokens equal the
one-request-per-forward engine's; refits through it keep versions at commit points and the KV
policy (held KV kept and counted stale, or recomputed); the cache goes with the KV's memory."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from refit import invariants, protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.invariants.tokens import check_token_versions, published_versions
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama
from refit.trace import load_trace

from .conftest import SMALL_BUCKET, perturbed
from .test_reference_engine import refit_directly

CFG = ModelConfig(max_seq_len=128)


class _Counting(EngineCore):
    """Counts the batched forwards and the rows each had."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[int]] = []

    def _forward_slots(self, tokens: list[int], slots: list[int], positions: list[int], ad: Any = None) -> torch.Tensor:
        self.batches.append(list(slots))
        return super()._forward_slots(tokens, slots, positions, ad)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [[i + 1, *torch.randint(0, CFG.vocab_size, (4 + i % 5,), generator=g).tolist()] for i in range(n)]


def _run(core: EngineCore, n: int) -> list[dict[str, Any]]:
    rids = [core.submit(p, 40 - 2 * i) for i, p in enumerate(_prompts(n))]  # unequal lengths: slots free unevenly
    while core.has_work():
        core.step()
    return [core.result(r) for r in rids]


def test_batched_decoding_gives_the_per_request_engines_tokens_from_one_forward_per_step() -> None:
    """10 requests through 4 slots: later requests take the slots earlier ones left (a gather of
    the cache, not a slice) and each step decodes every running request that holds KV at once."""
    one = _run(EngineCore(CFG, seed=0, max_running=4), 10)
    core = _Counting(CFG, seed=0, max_running=4, batch_decode=True)
    batched = _run(core, 10)
    for a, b in zip(one, batched, strict=True):
        assert a["output"] == b["output"]
        assert len(b["logprobs"]) == len(b["output"])
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-4
    assert max(len(s) for s in core.batches) == 4  # four requests in one forward
    assert any(s != sorted(s) or s != list(range(s[0], s[0] + len(s))) for s in core.batches)  # holes reused
    assert sum(len(s) for s in core.batches) == sum(len(r["output"]) for r in batched) - 10  # all but prefills
    assert core._slot_of == {}  # every slot given back


def test_the_static_cache_goes_with_the_kv_memory_and_comes_back_on_the_next_request() -> None:
    core = EngineCore(CFG, seed=0, max_running=3, batch_decode=True)
    rid = core.submit(_prompts(1)[0], 5)
    core.step()
    core.step()
    with pytest.raises(EngineError, match="hold KV"):
        core.release_memory(["kv_cache"])
    while core.has_work():
        core.step()
    core.release_memory(["kv_cache"])
    assert core._slots is None
    core.resume_memory(["kv_cache"])
    again = core.submit(_prompts(1)[0], 5)
    while core.has_work():
        core.step()
    assert core.result(again)["output"] == core.result(rid)["output"]


def test_a_slot_left_holding_nan_poisons_no_later_request() -> None:
    """Weights that made NaN (a diverged training step, published) fill both slots with NaN KV;
    after a clean refit, a short request batched beside a longer one reads past its own end only
    as masked positions, which must be zeros, not what the slot's last occupant left."""

    def load(core: EngineCore, model: TinyLlama, version: int) -> None:
        core.pause("abort")
        refit_directly(core, model, version=version)
        core.continue_generation()

    core = EngineCore(CFG, seed=0, max_running=2, batch_decode=True)
    bad = TinyLlama(CFG, seed=0)
    with torch.no_grad():
        bad.model.layers[0].self_attn.v_proj.weight.fill_(float("nan"))
    load(core, bad, 1)
    poisoned = [core.submit([1, 2, 3], 40), core.submit([4, 5, 6], 40)]
    while core.has_work():
        core.step()
    assert all(math.isnan(core.result(r)["logprobs"][0]) for r in poisoned)
    load(core, TinyLlama(CFG, seed=0), 2)
    long, short = core.submit(list(range(7, 27)), 30), core.submit([10, 11, 12], 5)
    while core.has_work():
        core.step()
    clean = EngineCore(CFG, seed=0, max_running=1)
    want = clean.submit([10, 11, 12], 5)
    while clean.has_work():
        clean.step()
    for rid in (long, short):
        assert not any(math.isnan(x) for x in core.result(rid)["logprobs"])
    assert core.result(short)["output"] == clean.result(want)["output"]


@pytest.mark.parametrize(
    ("atomic", "kv"), [(False, "keep"), (False, "recompute"), (True, "recompute")], ids=["keep", "recompute", "atomic"]
)
def test_refits_during_batched_decoding_keep_versions_at_commit_points(tmp_path: Path, atomic: bool, kv: str) -> None:
    """8 requests of 400 tokens decoded in batches through 4 refits paced by the tokens sampled:
    none aborted, every token versioned at a commit point; a request that decoded across a switch
    kept its KV and counted it stale (keep) or recomputed it (none stale). How many refits land
    inside the requests depends on the machine's load (a batched step is fast): at least one must."""
    config = ModelConfig(max_seq_len=512)
    engine = ReferenceEngine.in_thread("b0", config, seed=0, max_running=8, batch_decode=True)
    model = TinyLlama(config, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [engine], bucket_bytes=SMALL_BUCKET, trace=tmp_path / "t.jsonl",
        mode="disaggregated", atomic=atomic, kv=kv, pause_mode="in_place" if kv == "keep" else "retract",
    )  # fmt: skip
    try:
        futures = [engine.submit(p, 400) for p in _prompts(8)]
        for step in range(1, 5):
            while engine.info()["tokens_sampled"] < step * 8 * 400 // 8:
                time.sleep(0.001)
            perturbed(model, seed=step)
            assert protocol.run(ctx).ok
        results = [f.result(timeout=120) for f in futures]
        info = engine.info()
    finally:
        ctx.close()
        engine.close()
    _, events, _ = load_trace(tmp_path / "t.jsonl")
    assert invariants.check_trace(events) == []
    assert [r["finish_reason"] for r in results] == ["length"] * 8
    assert check_token_versions(info["commits"], results, engine="b0", published=published_versions(events, "b0")) == []
    across = [r for r in results if len(set(r["weight_versions"])) > 1]
    assert across, "no refit landed while the requests decoded"
    stale = [r["stale_kv_tokens"] for r in across]
    assert all(s > 0 for s in stale) if kv == "keep" else all(s == 0 for s in stale)
    if atomic:
        assert info["tokens_while_staged"] > 0
