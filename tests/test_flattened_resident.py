"""SGLang's flattened buckets sent from the trainer's own memory (`TorchSource.flatten_into`): the
trainer's tensors are laid out once as the transport plans its buckets, and every refit then sends
each bucket as a view of that memory (nothing packed, no buffer made). SGLang 0.5.23's own
`MultiprocessingSerializer` and `FlattenedTensorBucket` decode every payload in the emulated
server (`decoder="sglang"`); a trainer that trains in between (an optimizer built before the
layout) refits bit-exact each time."""

from __future__ import annotations

import pytest
import torch

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama
from refit.testing.sglang_server import EmulatedSGLangEngine

from .conftest import CONFIG, SMALL_BUCKET, matches, perturbed
from .sglang_support import validate_body


def _train(model: TinyLlama, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step on a random batch (writes the parameters in place)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=gen)
    optimizer.zero_grad()
    model(tokens).float().logsumexp(-1).mean().backward()
    optimizer.step()


@pytest.mark.e2e
def test_refits_send_the_trainers_own_memory_decoded_by_sglangs_code() -> None:
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before the layout: same tensor objects
    params = {n: p for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    transport = SGLangTensorTransport()
    source = TorchSource(model)
    laid = source.flatten_into(transport, SMALL_BUCKET)
    assert laid >= sum(t.numel() * t.element_size() for t in before.values())
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())  # values kept
    assert {n: p for n, p in model.named_parameters()} == params  # identities kept
    engines = [
        EmulatedSGLangEngine.start(f"fr{i}", config=CONFIG, in_thread=True, decoder="sglang", validate=validate_body)
        for i in range(2)
    ]
    ctx = protocol.RefitContext(
        source, transport, engines, mode="colocated", bucket_bytes=SMALL_BUCKET, deadline_s=60, verify="off"
    )
    try:
        plan_buckets = None
        for step in range(3):
            _train(model, optimizer, seed=step)
            result = protocol.run(ctx)
            assert result.ok, result.error
            plan_buckets = result.buckets
            assert all(matches(e, model) for e in engines)
        assert plan_buckets is not None and plan_buckets > 3
        assert transport.resident_buckets == 3 * plan_buckets  # every bucket of every refit, in place
        assert transport.buffer_bytes == 0 and transport.held == []  # no buffer made, none held at an ack
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_a_bucket_not_laid_out_is_packed_as_before() -> None:
    """A model that was not laid out (or a tensor reallocated since) is packed into a buffer: the
    in-place check looks at where each tensor lies, not at a flag."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    transport = SGLangTensorTransport()
    source = TorchSource(model)
    source.flatten_into(transport, SMALL_BUCKET)
    with torch.no_grad():
        model.model.norm.weight.data = model.model.norm.weight.detach().clone()  # moved out of its bucket
    engine = ReferenceEngine.in_thread("fp", CONFIG, seed=0)
    ctx = protocol.RefitContext(
        source, transport, [engine], mode="colocated", bucket_bytes=SMALL_BUCKET, deadline_s=60, verify="off"
    )
    try:
        result = protocol.run(ctx)
        assert result.ok, result.error
        assert matches(engine, model)
        assert transport.resident_buckets == result.buckets - 1 and transport.buffer_bytes > 0
    finally:
        ctx.close()
        engine.close()


def test_flatten_into_refuses_what_it_cannot_lay_out_in_place() -> None:
    model = TinyLlama(CONFIG, seed=0)
    for source in (
        TorchSource(model, dtype=torch.float16),  # a cast: the bytes sent are not the trainer's
        TorchSource(model, send_aliases=True),  # one tensor under two names
        TorchSource(model.state_dict),  # called per refit: nothing to lay out
    ):
        with pytest.raises(ValueError, match="flatten_into needs"):
            source.flatten_into(SGLangTensorTransport(), SMALL_BUCKET)
    base = torch.zeros(8)
    with pytest.raises(ValueError, match="outside the source"):  # `base` would keep the old memory
        TorchSource({"a": base[:4], "b": base[4:]}).flatten_into(SGLangTensorTransport(), SMALL_BUCKET)
    overlapping = _overlapping_views()
    with pytest.raises(ValueError, match="share memory"):  # two overlapping views would be separated
        TorchSource(overlapping).flatten_into(SGLangTensorTransport(), SMALL_BUCKET)


def _overlapping_views() -> dict[str, torch.Tensor]:
    storage = torch.zeros(8).untyped_storage()  # (gone on return: only the two tensors hold the memory)
    return {"a": torch.empty(0).set_(storage, 0, (6,)), "b": torch.empty(0).set_(storage, 2, (6,))}


def test_an_engine_holding_the_trainers_memory_at_its_ack_fails_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that still holds a resident bucket's export at its ack cannot be given a fresh
    buffer (the memory is the trainer's): the release fails, naming it, instead of letting the next
    optimizer step write under its reads."""
    from refit.drivers import sglang_transport

    _, engine, ctx = _laid_out_refit("fh")
    try:
        assert protocol.run(ctx).ok
        monkeypatch.setattr(sglang_transport, "_still_held", lambda handle, offset: True)
        monkeypatch.setattr(sglang_transport, "serialize", _counting_serialize(sglang_transport.serialize))
        result = protocol.run(ctx)
        assert not result.ok and "still held the trainer's own memory" in str(result.error)
        assert engine.info()["version"] == 1  # the refit that could not release was not published
    finally:
        ctx.close()
        engine.close()


@pytest.mark.parametrize("bucket", [0, 1])  # bucket 0 rides the pause wave; bucket 1 is streamed
def test_a_failed_load_is_the_runs_error_not_the_release_of_its_bucket(
    monkeypatch: pytest.MonkeyPatch, bucket: int
) -> None:
    """An engine whose load of a resident bucket failed may still hold its export: its release is
    refused and the run fails with the load's error (the release's chained to it), not the held
    memory's, and the connection is not reused (found by an adversarial review: the release's
    error hid the load's)."""
    from refit.drivers import sglang_transport

    model, engine, ctx = _laid_out_refit("fl")
    try:
        assert protocol.run(ctx).ok
        monkeypatch.setattr(sglang_transport, "_still_held", lambda handle, offset: offset == bucket)  # its export
        monkeypatch.setattr(sglang_transport, "serialize", _counting_serialize(sglang_transport.serialize))
        ctx.faults = protocol.FaultPlan().fail_at("transferring", call="load", bucket=bucket)
        result = protocol.run(ctx)
        assert not result.ok
        assert "injected" in str(result.error) and "still held" not in str(result.error), result.error
        assert engine.info()["version"] == 1
        releases = [
            e for e in ctx.recorder.events
            if e.get("run") == result.run_id and e["event"] == "release" and e.get("bucket") == bucket
        ]  # fmt: skip
        assert [e["outcome"] for e in releases] == ["error"]  # recorded, the load's error reported
        assert "still held" in str(result.error.__cause__)
        ctx.faults = None
        monkeypatch.undo()
        assert protocol.run(ctx).ok and matches(engine, model)  # the next run connects afresh
    finally:
        ctx.close()
        engine.close()


def _laid_out_refit(name: str) -> tuple[TinyLlama, ReferenceEngine, protocol.RefitContext]:
    """A model laid out in an SGLang transport's buckets, refitting into an engine (no retries)."""
    model = TinyLlama(CONFIG, seed=0)
    transport = SGLangTensorTransport()
    source = TorchSource(model)
    source.flatten_into(transport, SMALL_BUCKET)
    engine = ReferenceEngine.in_thread(name, CONFIG, seed=0)
    ctx = protocol.RefitContext(
        source, transport, [engine], mode="colocated", bucket_bytes=SMALL_BUCKET, deadline_s=30, verify="off",
        retries=0,
    )  # fmt: skip
    return model, engine, ctx


def _counting_serialize(serialize):  # type: ignore[no-untyped-def]
    """`serialize` that records a (fake) CUDA counter for each export, so the release checks it:
    the n-th export of the run's call gets offset n (one engine of one rank: bucket n)."""
    exports = iter(range(1 << 30))

    def wrapped(obj, counters=None):  # type: ignore[no-untyped-def]
        if counters is not None:
            counters.append((b"torch_fake", next(exports)))
        return serialize(obj, counters)

    return wrapped


class _ReusingBridge:
    """A megatron-bridge stand-in whose export hands out one buffer per (shape, dtype), overwritten
    for the next tensor (the bridge may reuse its buffers: a consumer copies each before the next)."""

    def __init__(self, model: TinyLlama) -> None:
        self.model = model

    def get_conversion_tasks(self, model: object) -> list[str]:
        return ["tasks"]

    def export_hf_weights(self, model: object, cpu: bool, show_progress: bool, conversion_tasks: object):  # type: ignore[no-untyped-def]
        buffers: dict[tuple[object, ...], torch.Tensor] = {}
        for name, t in self.model.state_dict().items():
            buffer = buffers.setdefault((tuple(t.shape), t.dtype), torch.empty_like(t))
            buffer.copy_(t)
            yield name, buffer


def test_a_lazy_source_is_packed_one_tensor_at_a_time() -> None:
    """The in-place check is asked only of a resident source: a lazy one (a bridge that reuses its
    buffer for the next tensor) is copied tensor by tensor as it is pulled, bit-exact (found by an
    adversarial review: materializing the bucket first packed the last tensor's bytes for all)."""
    from refit.drivers.megatron import MegatronSource

    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    source = MegatronSource(_ReusingBridge(model), [torch.nn.Module()], cpu=True)
    engine = ReferenceEngine.in_thread("lazy", CONFIG, seed=0)
    transport = SGLangTensorTransport()
    ctx = protocol.RefitContext(
        source, transport, [engine], mode="colocated", bucket_bytes=SMALL_BUCKET, deadline_s=60, verify="off"
    )
    try:
        assert protocol.run(ctx).ok and matches(engine, model) and transport.resident_buckets == 0
    finally:
        ctx.close()
        engine.close()


def test_flatten_into_leaves_no_tensor_behind_and_can_lay_out_again() -> None:
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    with pytest.raises(ValueError, match="also used by a tensor outside the source"):
        TorchSource(model.state_dict()).flatten_into(SGLangTensorTransport(), SMALL_BUCKET)  # detached copies
    source = TorchSource(model)
    for bucket in (SMALL_BUCKET, 2 * SMALL_BUCKET):  # a second layout, for another bucket size
        source.flatten_into(SGLangTensorTransport(), bucket)
    engine = ReferenceEngine.in_thread("again", CONFIG, seed=0)
    transport = SGLangTensorTransport()
    ctx = protocol.RefitContext(
        source, transport, [engine], mode="colocated", bucket_bytes=2 * SMALL_BUCKET, deadline_s=60, verify="off"
    )
    try:
        result = protocol.run(ctx)
        assert result.ok and matches(engine, model) and transport.resident_buckets == result.buckets
    finally:
        ctx.close()
        engine.close()
