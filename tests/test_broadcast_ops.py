"""The broadcast transport's per-tensor wire layout (`BroadcastTransport(ops="tensor")`, NCCL's
default, here on gloo): each tensor is broadcast from where it lies in the trainer and received
straight into a single-rank engine's parameter (no pack, no copy-out); a TP engine in the same
group receives the same broadcasts into its buffer and copies its shards out. A bucket that fails
after part of it was written straight into the weights is never taken as one of no effect."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from refit import protocol
from refit.buckets import BucketManifest, TensorMeta
from refit.drivers.base import LazyTensors, Source
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.reference.model import ModelConfig, TinyLlama

from .conftest import CONFIG, SMALL_BUCKET, matches, perturbed


class MadeAnewSource(Source):
    """Not resident, like a conversion (megatron-bridge's export) or an all-gather-then-reshard:
    `reuse` hands every tensor out in one scratch buffer per shape and dtype, refilled for the
    next; `free` hands out a fresh copy and frees its storage once the next one is taken."""

    def __init__(self, model: TinyLlama, how: str) -> None:
        self.model, self.how = model, how

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t) for n, t in self.model.state_dict().items()]

    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[LazyTensors]:
        state = self.model.state_dict()
        scratch: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

        def tensors(manifest: BucketManifest) -> LazyTensors:
            last = None
            for name in manifest.names:
                src = state[name]
                if self.how == "reuse":
                    out = scratch.setdefault((tuple(src.shape), src.dtype), torch.empty_like(src))
                    out.copy_(src)
                else:
                    if last is not None:
                        last.untyped_storage().resize_(0)
                    out = last = src.clone()
                yield name, out

        for manifest in plan:
            yield tensors(manifest)


@pytest.mark.parametrize("direct_bytes", [0, 16 << 10])
def test_tensor_ops_write_straight_into_a_single_rank_engine_and_through_the_buffer_for_a_tp_engine(
    direct_bytes: int,
) -> None:
    """direct_bytes=0: every tensor is its own broadcast; 16 KiB: the default model's smaller
    tensors (norms, the 8 KiB projections) go packed in runs between the larger ones."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    one = ReferenceEngine.spawn("direct-1", CONFIG, seed=0)
    two = ReferenceEngine.spawn("direct-2", CONFIG, seed=0, tp=2)
    transport = BroadcastTransport(ops="tensor", checksums=False, direct_bytes=direct_bytes)
    ctx = protocol.RefitContext(
        TorchSource(model), transport, [one, two], mode="disaggregated", bucket_bytes=SMALL_BUCKET, deadline_s=60
    )
    state = model.state_dict()
    direct = sum(1 for t in state.values() if t.numel() * t.element_size() >= direct_bytes)
    assert 0 < direct <= len(state) and (direct < len(state)) == (direct_bytes > 0)
    try:
        for refit, seed in enumerate((2, 3), start=1):
            result = protocol.run(ctx)
            assert result.ok, result.error
            assert result.buckets > 1
            assert matches(one, model) and matches(two, model), f"refit {refit} is not bit-exact"
            assert one.info()["direct_tensors"] == refit * direct  # straight into their parameters
            assert two.info()["direct_tensors"] == 0  # TP shards: received into the buffer, copied out
            assert [one.info()["version"], two.info()["version"]] == [refit, refit]
            perturbed(model, seed=seed)
    finally:
        ctx.close()
        one.close()
        two.close()


@pytest.mark.parametrize("how", ["reuse", "free"])
def test_a_source_that_reuses_or_frees_what_it_handed_out_is_copied_never_sent_as_it_lies(how: str) -> None:
    """Found by an adversarial review: keeping such a tensor until its broadcast sent other
    bytes (reuse: engines held wrong weights under a published version) or freed memory (free:
    gloo aborted the trainer process). Only a resident source's tensors are sent as they lie."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=5)
    source = MadeAnewSource(model, how)
    assert not source.resident
    one = ReferenceEngine.spawn(f"anew-{how}-1", CONFIG, seed=0)
    two = ReferenceEngine.spawn(f"anew-{how}-2", CONFIG, seed=0, tp=2)
    ctx = protocol.RefitContext(
        source, BroadcastTransport(ops="tensor", checksums=False, direct_bytes=0), [one, two], mode="disaggregated",
        bucket_bytes=SMALL_BUCKET, deadline_s=60,
    )  # fmt: skip
    try:
        for seed in (6, 7):
            result = protocol.run(ctx)
            assert result.ok, result.error
            assert matches(one, model) and matches(two, model)
            perturbed(model, seed=seed)
        assert one.info()["direct_tensors"] == 2 * len(model.state_dict())  # still received straight in
    finally:
        ctx.close()
        one.close()
        two.close()


def test_a_bucket_refused_after_it_was_written_straight_into_the_weights_is_never_served() -> None:
    """A tied-head engine (tie_word_embeddings) refuses a trainer whose head is its own, at the
    bucket holding the head, after the embedding of that bucket was written into the parameter.
    With the buffer layout that refusal changes nothing and the engine keeps serving its version;
    read straight into the weights it is `partial_load`: the engine is quarantined, never served."""
    tied = ModelConfig(tie_word_embeddings=True)
    outcomes = {}
    for ops, direct_bytes in (("bucket", 0), ("tensor", 0), ("tensor", 1 << 30)):
        case = f"{ops}-{direct_bytes}"
        engine = ReferenceEngine.spawn(f"tied-{case}", tied, seed=0)
        old = engine.state_dict()
        model = perturbed(TinyLlama(CONFIG, seed=0), seed=4)  # its lm_head is not its embedding
        ctx = protocol.RefitContext(
            TorchSource(model), BroadcastTransport(ops=ops, checksums=False, direct_bytes=direct_bytes), [engine],
            mode="disaggregated",
            bucket_bytes=1 << 30, deadline_s=60, retries=0,
        )  # fmt: skip
        try:
            result = protocol.run(ctx)
            assert not result.ok
            outcomes[case] = result.engines[engine.name].status
            info = engine.info()
            embed = engine.state_dict()["model.embed_tokens.weight"]
            if case == "tensor-0":
                assert "partial_load" in str(result.error) or "partial_load" in str(result.engines[engine.name].error)
                assert torch.equal(embed, model.state_dict()["model.embed_tokens.weight"])  # it did land
                assert info["quarantined"] and info["dirty"]
                with pytest.raises(EngineError):
                    engine.generate([1, 2, 3], 2)
            else:  # nothing was read straight in (1 GiB: every tensor went through the buffer)
                assert "partial_load" not in str(result.error)
                assert all(torch.equal(engine.state_dict()[k], v) for k, v in old.items())  # nothing landed
                assert not info["quarantined"] and not info["paused"] and info["version"] == 0
                engine.generate([1, 2, 3], 2)
        finally:
            ctx.close()
            engine.close()
    assert outcomes == {"bucket-0": "unchanged", "tensor-0": "quarantined", "tensor-1073741824": "unchanged"}


def test_settings_default_per_backend_and_bad_ones_are_refused_naming_them() -> None:
    nccl, gloo = BroadcastTransport(backend="nccl"), BroadcastTransport()
    assert (nccl.ops, nccl.slots, nccl.direct_bytes, nccl.checksums) == ("tensor", 3, 16 << 20, False)
    assert (gloo.ops, gloo.slots, gloo.checksums) == ("bucket", 2, True)
    assert BroadcastTransport(ops="tensor").slots == 2
    for kwargs, match in (
        ({"ops": "x"}, "ops 'x'"),
        ({"direct_bytes": -1}, "direct_bytes must be an integer >= 0, got -1"),
        ({"direct_bytes": 16.0}, "direct_bytes"),
        ({"slots": True}, "slots must be an integer >= 1, got True"),
        ({"slots": 0}, "slots must be an integer >= 1, got 0"),
    ):
        with pytest.raises(ValueError, match=match):
            BroadcastTransport(**kwargs)  # type: ignore[arg-type]
