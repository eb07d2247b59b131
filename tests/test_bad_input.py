"""Bad input never costs an engine its weights: each case gets a clear error naming what was wrong,
and the engine (a real process) keeps serving its previous weights, logits unchanged."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from refit import protocol
from refit.buckets import BucketManifest, TensorMeta
from refit.drivers.base import Payload, Topology
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama

from .conftest import CONFIG, perturbed

pytestmark = pytest.mark.e2e
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def engine() -> Iterator[ReferenceEngine]:
    e = ReferenceEngine.spawn("bad-input", CONFIG, seed=0)
    yield e
    e.close()


def good_state() -> dict[str, torch.Tensor]:
    return dict(perturbed(TinyLlama(CONFIG, seed=0), seed=3).state_dict())


class Evil:
    """Not on the engine's allowlist: the engine must refuse to unpickle it."""


class Sneaky:
    """Unpickles into a call of an arbitrary function (the classic pickle attack)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo this must never run in the engine",))  # (print: Ray replaces builtins.print)


class TruncatingTransport(SharedMemoryTransport):
    """Sends bucket 0 with its last tensor cut off."""

    def payloads(self, manifest: BucketManifest, parts: Sequence[Any], topology: Topology) -> dict[str, Payload]:
        out = super().payloads(manifest, parts, topology)
        if manifest.index:
            return out
        cut = BucketManifest(manifest.index, manifest.entries[:-1], manifest.nbytes)
        return {name: Payload(p.kind, cut, p.fields, p.parts) for name, p in out.items()}


class EvilPayloadTransport(SharedMemoryTransport):
    """Smuggles an object of a non-allowlisted class into bucket 0's payload."""

    smuggled: Any = Evil()

    def payloads(self, manifest: BucketManifest, parts: Sequence[Any], topology: Topology) -> dict[str, Payload]:
        out = super().payloads(manifest, parts, topology)
        if manifest.index:
            return out
        return {
            name: Payload(p.kind, p.manifest, {**p.fields, "extra": self.smuggled}, p.parts) for name, p in out.items()
        }


class SneakyPayloadTransport(EvilPayloadTransport):
    smuggled = Sneaky()


class DuplicateSource(TorchSource):
    """Lists one tensor twice."""

    def metas(self) -> list[TensorMeta]:
        metas = super().metas()
        return [*metas, metas[0]]


def unknown(sd: dict) -> tuple[dict, str]:
    return {
        **sd,
        "model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64),
    }, "unknown tensor 'model.layers.9.mlp.up_proj.weight'"


def wrong_shape(sd: dict) -> tuple[dict, str]:
    return {**sd, "model.norm.weight": torch.ones(65)}, r"model.norm.weight: shape \[65\] != model \[64\]"


def wrong_dtype(sd: dict) -> tuple[dict, str]:
    return {
        **sd,
        "lm_head.weight": sd["lm_head.weight"].to(torch.bfloat16),
    }, "lm_head.weight: dtype bfloat16 != model float32"


def missing(sd: dict) -> tuple[dict, str]:
    return {
        k: v for k, v in sd.items() if k != "model.layers.1.mlp.down_proj.weight"
    }, "1 model tensors missing from the plan, first 'model.layers.1.mlp.down_proj.weight'"


CASES: dict[str, tuple[Callable[..., Any], ...]] = {
    "unknown-name": (unknown,),
    "wrong-shape": (wrong_shape,),
    "wrong-dtype": (wrong_dtype,),
    "missing-tensor": (missing,),
}


def check_unchanged(engine: ReferenceEngine, before_logits: torch.Tensor, before_version: int) -> None:
    info = engine.info()
    assert info["version"] == before_version and not info["paused"] and not info["quarantined"]
    assert torch.equal(engine.score(PROMPT), before_logits)
    assert len(engine.generate(PROMPT, 4)["output"]) == 4


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_bad_manifest_is_refused_before_any_byte(engine: ReferenceEngine, make_ctx, case: str) -> None:
    state, message = CASES[case][0](good_state())
    before, version = engine.score(PROMPT), engine.info()["version"]
    ctx = protocol.RefitContext(
        TorchSource(state), SharedMemoryTransport(), [engine], bucket_bytes=64 << 10, version=version
    )
    result = protocol.run(ctx)
    ctx.close()
    assert not result.ok and result.version is None
    assert result.error.state == "INVALIDATING" and result.error.call == "begin"
    assert "bad_manifest" in str(result.error)
    import re

    assert re.search(message, str(result.error)), str(result.error)
    assert result.engines[engine.name].status == "unchanged"
    check_unchanged(engine, before, version)


@pytest.mark.parametrize(
    ("transport", "source", "message"),
    [
        (TruncatingTransport, TorchSource, "bucket 0 does not match the plan"),
        (EvilPayloadTransport, TorchSource, "blocked class tests.test_bad_input.Evil"),
        (SneakyPayloadTransport, TorchSource, "blocked class posix.system"),
        (SharedMemoryTransport, DuplicateSource, "tensor 'model.embed_tokens.weight' appears twice"),
    ],
    ids=["truncated-bucket", "non-allowlisted-class", "pickled-call", "duplicate-tensor"],
)
def test_a_bad_payload_is_refused_and_nothing_is_lost(engine: ReferenceEngine, transport, source, message: str) -> None:
    before, version = engine.score(PROMPT), engine.info()["version"]
    ctx = protocol.RefitContext(source(good_state()), transport(), [engine], bucket_bytes=64 << 10, version=version)
    result = protocol.run(ctx)
    ctx.close()
    assert not result.ok and result.version is None
    assert message in str(result.error), str(result.error)
    assert result.engines[engine.name].status == "unchanged"  # refused before any byte: not poisoned
    check_unchanged(engine, before, version)


def test_a_second_run_while_one_is_in_flight_fails_at_once(make_ctx) -> None:
    """Real concurrency: run A is stalled inside an engine call when run B starts."""
    engines = [ReferenceEngine.in_thread(f"c{i}", CONFIG, seed=0) for i in range(2)]
    try:
        model = perturbed(TinyLlama(CONFIG, seed=0), seed=4)
        ctx = make_ctx(model, engines)
        engines[0].arm_fault("hang", "pause", bucket=None, seconds=1.0, timeout=5)  # A will sit in PAUSING
        results: list[protocol.RefitResult] = []
        a = threading.Thread(target=lambda: results.append(protocol.run(ctx)))
        a.start()
        time.sleep(0.2)
        owner_a = ctx.lock.holder
        assert owner_a is not None
        t0 = time.monotonic()
        with pytest.raises(protocol.RefitBusyError):
            protocol.run(make_ctx(model, engines, version=0))  # another context over the same engines
        assert time.monotonic() - t0 < 0.5  # at once, not after A
        a.join(30)
        assert results and results[0].ok  # A was not disturbed
        assert ctx.lock.holder is None
        assert ctx.lock.acquire("run-c")
        assert not ctx.lock.release(owner_a)  # A's token, released late: ignored
        assert ctx.lock.holder == "run-c"
        assert ctx.lock.release("run-c")
    finally:
        for e in engines:
            e.close()
