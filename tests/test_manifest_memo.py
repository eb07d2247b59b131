"""Manifests once per connection (`refit.reference.memo`): a manifest travels whole the first time a
client sends it and by key after the engine answered that request; a refit whose plan is unchanged
sends no manifest entries at all. Unit tests of the two memos, then a real engine process."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from refit import protocol
from refit.buckets import BucketManifest, TensorEntry, TensorMeta
from refit.drivers.base import Payload
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.reference import client as client_module
from refit.reference.memo import ManifestMemo, Manifests
from refit.reference.model import TinyLlama
from refit.reference.server import encode_defining, safe_decode

from .conftest import CONFIG, SMALL_BUCKET, matches, perturbed


def _manifest(index: int, n: int = 3) -> BucketManifest:
    entries = tuple(TensorEntry(TensorMeta(f"layer.{index}.w{i}", "float32", (4, 2)), 32 * i) for i in range(n))
    return BucketManifest(index, entries, 32 * n)


def test_a_manifest_goes_by_key_only_after_the_engine_answered_its_definition() -> None:
    memo, engine_side = ManifestMemo(), Manifests()
    plan = [_manifest(0), _manifest(1)]
    steps = [("begin", (plan,)), ("load", (Payload("shm", plan[0], {}, ({"name": "x"},)),))]
    body, defined = encode_defining((steps, 1.0), {}, memo)
    assert sorted(set(defined)) == [0, 1] and b"layer.0.w1" in body
    again, defined_again = encode_defining((steps, 1.0), {}, memo)  # not answered yet: defined again
    assert defined_again and b"layer.0.w1" in again
    args, _ = safe_decode(body, engine_side)
    (_, (got_plan,)), (_, (payload,)) = args[0]
    assert got_plan == plan and payload.manifest is got_plan[0]  # one object per key on the engine
    memo.confirm(defined)
    short, none = encode_defining((steps, 1.0), {}, memo)
    assert none == [] and b"layer.0.w1" not in short and len(short) < len(body) // 2
    args, _ = safe_decode(short, engine_side)
    assert args[0][0][1][0][1] is engine_side.by_key[1]
    with pytest.raises(EngineError) as info:  # an engine that never got the definition
        safe_decode(short, Manifests())
    assert info.value.kind == "unknown_manifest"


def test_the_engine_refuses_malformed_definitions_and_foreign_classes() -> None:
    from refit.reference.memo import ManifestDef

    body = pickle.dumps(((ManifestDef(0, "not a manifest"),), {}), protocol=5)
    with pytest.raises(EngineError) as info:
        safe_decode(body, Manifests())
    assert info.value.kind == "bad_payload"
    evil = pickle.dumps(((ManifestDef(0, _manifest(0)), EngineError("x", "y")), {}))  # not an allowed class
    with pytest.raises(EngineError, match="could not be decoded"):
        safe_decode(evil, Manifests())


def test_a_steady_refit_sends_no_manifest_entries_to_an_engine_process(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, bytes, list[int]]] = []
    real = client_module.encode_defining

    def spy(args: tuple[Any, ...], kwargs: dict[str, Any], memo: ManifestMemo) -> tuple[bytes, list[int]]:
        body, defined = real(args, kwargs, memo)
        sent.append((str(args)[:40], body, list(defined)))
        return body, defined

    monkeypatch.setattr(client_module, "encode_defining", spy)
    engine = ReferenceEngine.spawn("memo", CONFIG, seed=0)
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), [engine], bucket_bytes=SMALL_BUCKET, deadline_s=60, verify="off"
    )
    try:
        marks = []
        for seed in (2, 3, 4):
            marks.append(len(sent))
            assert protocol.run(ctx).ok and matches(engine, model)
            perturbed(model, seed=seed)
        first = sent[marks[0] : marks[1]]
        assert sum(len(d) for _, _, d in first) >= 4  # the plan's manifests, defined in the first refit
        for _, body, defined in sent[marks[2] :]:  # the third refit: every manifest by key
            assert defined == [] and b"model.layers.0" not in body
    finally:
        ctx.close()
        engine.close()


def test_a_definition_lost_to_a_damaged_request_is_sent_again() -> None:
    """`corrupt` truncates the request that defines a plan: the engine never decoded it, so the
    client does not take its manifests as known, and the next request defines them again."""
    engine = ReferenceEngine.spawn("memo-corrupt", CONFIG, seed=0)
    plan = SharedMemoryTransport().plan(TorchSource(TinyLlama(CONFIG, seed=0)).metas(), SMALL_BUCKET)
    try:
        engine.client.call("arm_fault", "corrupt", "steps", timeout=10)
        with pytest.raises(EngineError, match="could not be decoded"):
            engine.client.call("steps", [("begin", (plan,))], timeout=10)
        ((ok, value, _),) = engine.client.call("steps", [("begin", (plan,))], timeout=10)
        assert ok, value
        assert len(engine.client._memo._confirmed) == len(plan)  # now known: later requests send keys
    finally:
        engine.close()
