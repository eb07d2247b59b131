"""Bucket planning and packing: properties over random tensors (Hypothesis) and the error cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refit.buckets import ALIGN, BucketManifest, TensorEntry, TensorMeta, pack_into, plan_buckets, unpack

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


@st.composite
def named_tensors(draw: st.DrawFn) -> list[tuple[str, torch.Tensor]]:
    n = draw(st.integers(1, 12))
    out = []
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        gen = torch.Generator().manual_seed(i)
        t = (torch.randn(shape, generator=gen) * 10).to(dtype)
        if draw(st.booleans()) and t.dim() == 2:
            t = t.t()  # non-contiguous (slime#1608, NeMo RL#2417: non-contiguous tensors broke packing)
        out.append((f"layer.{i}.w", t))
    return out


@given(named_tensors(), st.integers(1, 600))
def test_plan_covers_every_tensor_once_in_order(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    metas = [TensorMeta.of(n, t) for n, t in tensors]
    plan = plan_buckets(metas, bucket_bytes)
    assert [e.meta for b in plan for e in b.entries] == metas
    assert [b.index for b in plan] == list(range(len(plan)))
    for b in plan:
        assert all(e.offset % ALIGN == 0 for e in b.entries)
        last = b.entries[-1]
        assert b.nbytes >= last.offset + last.meta.nbytes
        if len(b.entries) > 1:  # only a lone tensor may exceed the bucket size
            assert last.offset + last.meta.nbytes <= bucket_bytes


@given(named_tensors(), st.integers(1, 600))
def test_pack_unpack_round_trip_is_bit_exact(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors], bucket_bytes)
    source = dict(tensors)
    for manifest in plan:
        buf = torch.full((manifest.nbytes,), 0xAB, dtype=torch.uint8)
        pack_into(buf, manifest, [(n, source[n]) for n in manifest.names])
        for name, view in unpack(buf, manifest):
            assert view.dtype == source[name].dtype and view.shape == source[name].shape
            assert torch.equal(view, source[name])
            assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # zero-copy


def test_oversized_tensor_travels_alone() -> None:
    metas = [TensorMeta("a", "float32", (4,)), TensorMeta("big", "float32", (1000,)), TensorMeta("b", "float32", (4,))]
    plan = plan_buckets(metas, 256)
    assert [b.names for b in plan] == [["a"], ["big"], ["b"]]


def test_duplicate_names_and_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        plan_buckets([TensorMeta("a", "float32", (1,))] * 2, 100)
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([], 0)


def test_pack_refuses_a_tensor_that_does_not_match_the_manifest() -> None:
    (manifest,) = plan_buckets([TensorMeta("w", "float32", (2, 3))], 1 << 20)
    buf = torch.empty(manifest.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not match manifest entry"):
        pack_into(buf, manifest, [("w", torch.zeros(3, 2))])
    with pytest.raises(ValueError, match="source gave 0 tensors"):
        pack_into(buf, manifest, [])


def test_unpack_refuses_a_truncated_buffer_and_unknown_dtypes() -> None:
    (manifest,) = plan_buckets([TensorMeta("w", "float32", (16,))], 1 << 20)
    with pytest.raises(ValueError, match="truncated"):
        unpack(torch.empty(10, dtype=torch.uint8), manifest)
    bad = BucketManifest(0, (TensorEntry(TensorMeta("w", "complex64", (1,)), 0),), 64)
    with pytest.raises(ValueError, match="dtype 'complex64' is not one refit moves"):
        unpack(torch.empty(64, dtype=torch.uint8), bad)


def test_copy_digests_over_many_pairs_matches_hashing_each_source() -> None:
    """One pass over a whole bucket (copy each piece, hash it while in cache) gives each source's
    own digests in order, bit-exact copies, and refuses a destination of another size."""
    from refit.buckets import CHUNK, chunk_digests, copy_digests

    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(n, generator=gen) for n in (1, CHUNK // 4 + 3, 3 * CHUNK // 4, 17)]
    targets = [torch.empty_like(s) for s in sources]
    got = copy_digests(list(zip(targets, sources, strict=True)))
    assert got == [d for s in sources for d in chunk_digests(s)]
    assert all(torch.equal(a, b) for a, b in zip(targets, sources, strict=True))
    with pytest.raises(ValueError, match="bytes into"):
        copy_digests([(torch.empty(3), torch.empty(4))])
    tied = torch.empty(2 * CHUNK // 4)  # one target named twice (tied weights) would end a mix of both
    with pytest.raises(ValueError, match="overlap"):
        copy_digests([(tied, sources[2][: tied.numel()]), (tied[1:], sources[2][1 : tied.numel()])])
    assert copy_digests([(torch.empty(0), torch.empty(0)), (torch.empty(0), torch.empty(0))]) == []


def test_a_tensor_listed_twice_is_sent_once_under_the_first_name_kept() -> None:
    """A tied head (the same tensor under two names) goes once, under the first name `rename`
    keeps; views that differ, and different tensors that are empty, all go; `send_aliases`
    sends every name; the verdict helpers never count a missing (None) digest as a match."""
    from refit.drivers.torch_source import TorchSource
    from refit.verify import compare, uncovered

    w, fused = torch.randn(8, 4), torch.randn(12, 4)
    state = {"model.embed_tokens.weight": w, "q": fused[:4], "k": fused[4:8], "t": w.t(), "lm_head.weight": w,
             "e1": torch.empty(0), "e2": torch.empty(0), "s": torch.randn(3, 3).to_sparse()}  # fmt: skip
    names = [m.name for m in TorchSource(state).metas()]
    assert names == ["model.embed_tokens.weight", "q", "k", "t", "e1", "e2", "s"]
    assert [m.name for m in TorchSource(state, send_aliases=True).metas()] == list(state)
    renamed = TorchSource(state, rename=lambda n: None if n.startswith("model.embed") else n)
    assert "lm_head.weight" in [m.name for m in renamed.metas()]  # the first name was dropped: the alias stands
    assert not compare({"a": None}, {"a": None}).ok and uncovered("xxh3", {"a": None}, ["a"]) == ["a"]


def test_a_plan_crosses_the_engines_wire_whole_through_its_allowlist() -> None:
    """A plan as `EngineClient` encodes it and an engine decodes it (`safe_decode`, which refuses
    any class outside its allowlist): every field back, `heads` (not compared by ==) and
    `oversized` included. Each is pickled as a call with its fields (a slotted dataclass's default,
    an object then its state, costs 3 times as much, per tensor, per bucket, per refit)."""
    import pickletools

    from refit.reference.server import encode, safe_decode

    metas = [TensorMeta("q.weight", "bfloat16", (8, 4), heads=2), TensorMeta("big", "float32", (64, 64))]
    plan = plan_buckets(metas, 1024)
    assert plan[-1].oversized
    (back,), kwargs = safe_decode(encode((plan,), {}))
    assert back == plan and kwargs == {}
    assert [[(e.meta.heads, e.offset) for e in m.entries] for m in back] == [
        [(e.meta.heads, e.offset) for e in m.entries] for m in plan
    ]
    assert [m.oversized for m in back] == [m.oversized for m in plan]
    ops = {op.name for op, _, _ in pickletools.genops(encode((plan,), {}))}
    assert "REDUCE" in ops and "BUILD" not in ops  # built from its fields in one call, no state set after
