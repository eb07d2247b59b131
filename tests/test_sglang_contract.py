"""Contract tests against SGLang 0.5.23's own code (installed by .ci/run without its GPU deps):
every payload we build is decoded by SGLang's `MultiprocessingSerializer` and `FlattenedTensorBucket`,
every body validated by its request types, and our trainer-side group joins engine ranks built by
SGLang's own `init_custom_process_group`."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from refit.buckets import TensorMeta
from refit.drivers.base import Topology
from refit.drivers.flattened import check_flattened, plan_flattened
from refit.drivers.sglang import Capabilities, distributed_update_body, update_weights_from_tensor_body
from refit.drivers.sglang_transport import SGLangBroadcastTransport, SGLangTensorTransport

from .sglang_support import fields_of, request_type, sglang, validate_body

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int, *, transpose: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=gen).to(dtype)
    else:
        t = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=gen).to(dtype)
    return t.t() if transpose and t.dim() == 2 else t


def _decode_in_fresh_process(entries: list[str], out: Path) -> None:
    """SGLang's deserializer and bucket, in a process that shares nothing with this one but the host."""
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.sglang_support import sglang
        import torch
        sg = sglang()
        results = []
        for entry in json.load(open({str(out) + ".in"!r})):
            obj = sg.MultiprocessingSerializer.deserialize(entry)
            bucket = sg.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
            results.append([(n, t.clone()) for n, t in bucket.reconstruct_tensors()])
        torch.save(results, {str(out)!r})
        """
    )
    Path(str(out) + ".in").write_text(json.dumps(entries))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_sglang_decodes_every_payload_bit_exact_in_another_process(tmp_path: Path) -> None:
    """Mixed dtypes, non-contiguous inputs and several TP ranks: SGLang's code, in a separate
    process, reads back exactly the bytes each TP rank was given, under their names."""
    ranks = []
    for r in range(3):  # three TP ranks, each its own tensors (its shards)
        named = [
            (f"r{r}.{i}.{str(d).removeprefix('torch.')}", _tensor(d, (5, 3), 10 * r + i)) for i, d in enumerate(DTYPES)
        ]
        named.append((f"r{r}.transposed", _tensor(torch.float32, (4, 6), 99 + r, transpose=True)))
        named.append((f"r{r}.strided", _tensor(torch.bfloat16, (8, 8), 7 + r)[::2, 1::3]))
        named.append((f"r{r}.scalar", torch.tensor(3.5 + r)))
        ranks.append(named)
    body = update_weights_from_tensor_body(ranks, weight_version=7)
    req = validate_body("/update_weights_from_tensor", body)
    assert len(req.serialized_named_tensors) == 3 and req.load_format == "flattened_bucket"
    assert req.flush_cache is False and req.abort_all_requests is False and req.weight_version == "7"
    out = tmp_path / "decoded.pt"
    _decode_in_fresh_process(body["serialized_named_tensors"], out)
    decoded = torch.load(out)
    for named, pairs in zip(ranks, decoded, strict=True):
        got = dict(pairs)
        assert sorted(got) == sorted(n for n, _ in named)
        for name, want in named:
            assert got[name].dtype == want.dtype and tuple(got[name].shape) == tuple(want.shape), name
            assert _bits(got[name]) == _bits(want), name


@settings(max_examples=40)
@given(
    st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 5), min_size=0, max_size=3), st.booleans()),
        min_size=1,
        max_size=8,
    ),
    st.integers(1, 3),
)
def test_sglang_reconstructs_any_bucket_we_build(specs, tp) -> None:
    sg = sglang()
    ranks = [
        [(f"t{i}", _tensor(d, tuple(shape), i * 7 + r, transpose=tr)) for i, (d, shape, tr) in enumerate(specs)]
        for r in range(tp)
    ]
    body = update_weights_from_tensor_body(ranks, weight_version=None)
    assert "weight_version" not in body
    validate_body("/update_weights_from_tensor", body)
    for named, entry in zip(ranks, body["serialized_named_tensors"], strict=True):
        obj = sg.MultiprocessingSerializer.deserialize(entry)
        got = dict(
            sg.FlattenedTensorBucket(
                flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
            ).reconstruct_tensors()
        )
        for name, want in named:
            assert got[name].dtype == want.dtype and tuple(got[name].shape) == tuple(want.shape)
            assert _bits(got[name]) == _bits(want)


@settings(max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "bfloat16", "float16", "int64", "int8", "bool"]),
            st.lists(st.integers(1, 9), max_size=3),
        ),
        min_size=1,
        max_size=20,
    ),
    st.integers(8, 4096),
)
def test_planned_buckets_are_what_sglang_receives_for_distributed(metas, bucket_bytes) -> None:
    """SGLang's receiver for `update_weights_from_distributed` computes offsets itself, with no
    padding, refusing a misaligned one: our plan lays every bucket out exactly that way."""
    sg = sglang()
    plan = plan_flattened([TensorMeta(f"w{i}", d, tuple(s)) for i, (d, s) in enumerate(metas)], bucket_bytes)
    assert sorted(n for m in plan for n in m.names) == sorted(f"w{i}" for i in range(len(metas)))
    for manifest in plan:
        check_flattened(manifest)
        body = distributed_update_body(manifest, group_name="weight_update_group", load_format="flattened_bucket")
        validate_body("/update_weights_from_distributed", body)
        bucket = sg.FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        assert [(m.name, m.start_idx, m.end_idx) for m in bucket.get_metadata()] == [
            (e.meta.name, e.offset, e.offset + e.meta.nbytes) for e in manifest.entries
        ]
        assert bucket.get_flattened_tensor().numel() == manifest.nbytes


def test_transport_payloads_decode_with_sglang_per_engine_tp_rank() -> None:
    """The colocated transport's payloads: one entry per engine TP rank, each its own export, each
    decoded by SGLang into the source's tensors."""
    sg = sglang()
    tensors = {f"w{i}": _tensor(d, (3, 4), i) for i, d in enumerate(DTYPES[:5])}
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    transport = SGLangTensorTransport()
    plan = transport.plan(metas, 96)
    topology = Topology.of(1, [("a", 2), ("b", 1)], colocated=True)
    transport.connect(plan, topology, 0)
    try:
        for manifest in plan:
            part = transport.pack(manifest, [(n, tensors[n]) for n in manifest.names])
            payloads = transport.payloads(manifest, [part], topology)
            assert [len(payloads[e].parts) for e in ("a", "b")] == [2, 1]
            entries = [p["serialized"] for e in ("a", "b") for p in payloads[e].parts]
            assert len(entries) == 3  # one serialized entry per consumer (each its own export)
            for entry in entries:
                obj = sg.MultiprocessingSerializer.deserialize(base64.b64encode(entry).decode())
                got = sg.FlattenedTensorBucket(
                    flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                ).reconstruct_tensors()
                assert [n for n, _ in got] == manifest.names
                for name, t in got:
                    assert _bits(t) == _bits(tensors[name])
            transport.release(manifest.index)
    finally:
        transport.disconnect()


def test_cuda_payloads_name_the_gpu_by_uuid_in_sglangs_form() -> None:
    """SGLang's senders patch torch's reductions (sglang/srt/utils/patch_torch.py): a CUDA tensor is
    rebuilt by SGLang's `_rebuild_cuda_tensor_modified`, its device argument (index 6) the GPU's
    UUID, so processes that number one GPU differently (CUDA_VISIBLE_DEVICES per Ray actor) agree.
    No CUDA here: a stand-in object takes torch's CUDA reduction's place, and the stream refit writes
    is checked opcode by opcode, against SGLang's own allow-list and its own device mapping."""
    import io
    import pickletools

    sglang()  # SGLang's CUDA-only imports stood in
    from sglang.srt.utils import patch_torch
    from sglang.srt.utils.common import SafeUnpickler

    from refit.drivers import flattened as fl

    class FakeCuda:  # what torch's reduce_tensor returns for a CUDA tensor: (rebuild_cuda_tensor, 15 args)
        pass

    args = (torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.uint8, 2, b"h" * 64, 4, 0, False,
            b"/torch_1_2", 7, b"e" * 64, True)  # fmt: skip
    buf = io.BytesIO()
    pickler = fl._SGLangPickler(buf)
    pickler.dispatch_table[FakeCuda] = lambda obj: (
        fl.rebuild_cuda_tensor_by_uuid,
        (*args[: fl.DEVICE_ARG], "GPU-uuid-of-2", *args[fl.DEVICE_ARG + 1 :]),
    )
    pickler.dump(
        {
            "flattened_tensor": FakeCuda(),
            "metadata": fl.metadata_of(plan_flattened([TensorMeta("w", "uint8", (4,))], 8)[0]),
        }
    )
    globals_named = [
        arg for op, arg, _ in pickletools.genops(buf.getvalue()) if op.name in ("SHORT_BINUNICODE", "BINUNICODE")
    ]
    assert "sglang.srt.utils.patch_torch" in globals_named and "_rebuild_cuda_tensor_modified" in globals_named
    assert "GPU-uuid-of-2" in globals_named
    assert fl.SGLANG_REBUILD in SafeUnpickler.ALLOWED_GLOBALS  # SGLang's receiver accepts the name
    assert patch_torch._REDUCE_TENSOR_ARG_DEVICE_INDEX == fl.DEVICE_ARG  # and reads the UUID where we put it
    assert fl._SafeUnpickler(io.BytesIO(b"")).find_class(*fl.SGLANG_REBUILD) is fl.rebuild_cuda_tensor_by_uuid
    # torch's own reduction, untouched, for a CPU tensor
    cpu = torch.arange(4, dtype=torch.uint8)
    assert fl.sglang_cuda_reduce(cpu)[0] is not fl.rebuild_cuda_tensor_by_uuid


def test_every_control_body_validates_against_sglang_types() -> None:
    """The bodies the driver sends to control routes (SGLang refuses a POST without a JSON body)."""
    for route, body in {
        "/pause_generation": {"mode": "retract"},
        "/continue_generation": {},
        "/begin_weight_update": {},
        "/end_weight_update": {},
        "/update_weight_version": {"new_version": "3", "abort_all_requests": False},
        "/release_memory_occupation": {"tags": ["weights"]},
        "/resume_memory_occupation": {"tags": ["kv_cache", "cuda_graph"]},
        "/destroy_weights_update_group": {"group_name": "weight_update_group"},
        "/init_weights_update_group": {
            "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 3,
            "group_name": "weight_update_group", "backend": "gloo",
        },
    }.items():  # fmt: skip
        validate_body(route, body)
    assert request_type("/update_weight_version")(new_version="1").abort_all_requests is True  # why we send false
    with pytest.raises(ValueError, match="not fields"):
        validate_body(
            "/update_weight_version", {"new_version": "1", "abort_all_request": False}
        )  # a typo SGLang ignores
    assert {"flush_cache", "abort_all_requests", "weight_version", "load_format"} <= fields_of(
        request_type("/update_weights_from_tensor")
    )


def test_capability_record_matches_the_installed_sglang() -> None:
    sg = sglang()
    caps = Capabilities.of(sg.version)
    assert caps.version == "0.5.23"
    assert caps.session == hasattr(sg.io_struct, "BeginWeightUpdateReqInput")
    import typing

    hints = typing.get_type_hints(request_type("/pause_generation"))
    assert caps.pause_modes == set(typing.get_args(hints["mode"]))
    assert caps.flattened_bytes == bool(getattr(sg.FlattenedTensorBucket, "supports_multi_dtypes", False))
    old = Capabilities.of("0.5.20")
    assert not old.session and not old.flush_while_paused and old.version_route == "/model_info"
    assert Capabilities.of("0.5.2").version_route == "/get_weight_version"


ENGINE_RANK = textwrap.dedent(
    """
    import json, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from tests.sglang_support import sglang
    sg = sglang()
    cfg = json.loads(sys.argv[1])
    groups = []
    for group in cfg["groups"]:  # one group per layout, as one /init_weights_update_group each
        pg = sg.init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{{group['port']}}", world_size=group["world"],
            rank=cfg["rank"], group_name=group["group"],
        )
        got = {{}}
        for bucket in group["buckets"]:
            if group["flattened"]:  # as SGLang's weight updater receives a flattened bucket
                b = sg.FlattenedTensorBucket.empty(bucket["names"], bucket["dtypes"], bucket["shapes"], "cpu")
                dist.broadcast(b.get_flattened_tensor(), src=0, group=pg)
                got.update((n, t.clone()) for n, t in b.reconstruct_tensors())
            else:  # one broadcast per tensor, in list order
                for n, d, s in zip(bucket["names"], bucket["dtypes"], bucket["shapes"]):
                    t = torch.empty(s, dtype=getattr(torch, d))
                    dist.broadcast(t, src=0, group=pg)
                    got[n] = t
        torch.save(got, group["out"].format(rank=cfg["rank"]))
        groups.append(pg)
    for pg in groups:  # as /destroy_weights_update_group does; a gloo group left to interpreter exit can abort
        dist.destroy_process_group(pg)
    sys.stdout.flush(); sys.stderr.flush()
    import os; os._exit(0)  # the received bytes are saved: no interpreter teardown (it aborted once under load)
    """
)


def test_trainer_group_joins_engine_ranks_built_by_sglang(tmp_path: Path) -> None:
    """Two engine TP ranks join with SGLang's own `init_custom_process_group` (as its weight
    updater does on /init_weights_update_group) and receive as SGLang does, flattened and per
    tensor; the trainer side is `SGLangBroadcastTransport`, which never touches a default group."""
    tensors = {f"w{i}": _tensor(d, (6, 5), i) for i, d in enumerate(DTYPES)}
    topology = Topology.of(1, [("e", 2)], colocated=False, timeout_s=60)
    transports, groups = [], []
    for flattened in (True, False):
        transport = SGLangBroadcastTransport(flattened=flattened, group_name=f"weight_update_group_{flattened}")
        plan = transport.plan([TensorMeta.of(n, t) for n, t in tensors.items()], 200)
        assert len(plan) > 2
        info = transport.connect(plan, topology, 0)
        (connect,) = transport.attach_infos([info], topology).values()
        transports.append((transport, plan))
        groups.append({
            "port": connect.fields["port"], "world": connect.fields["world"], "group": connect.fields["group"],
            "flattened": flattened, "out": str(tmp_path / f"{flattened}-{{rank}}.pt"),
            "buckets": [distributed_update_body(m, group_name=connect.fields["group"], load_format=None) for m in plan],
        })  # fmt: skip
    code = ENGINE_RANK.format(root=str(ROOT))
    procs = [
        subprocess.Popen([sys.executable, "-c", code, json.dumps({"rank": part["rank"], "groups": groups})],
                         stderr=subprocess.PIPE, text=True)
        for part in connect.parts
    ]  # fmt: skip
    try:
        for transport, plan in transports:
            transport.join()
            for manifest in plan:
                transport.pack(manifest, [(n, tensors[n]) for n in manifest.names])
                transport.send(manifest.index)
                transport.release(manifest.index)
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for transport, _ in transports:
            transport.disconnect()
        for p in procs:
            p.kill()
    for group in groups:
        for part in connect.parts:
            got = torch.load(group["out"].format(rank=part["rank"]))
            assert sorted(got) == sorted(tensors)
            for name, want in tensors.items():
                assert _bits(got[name]) == _bits(want), (group["flattened"], name)


def test_a_buffer_a_consumer_still_holds_at_its_ack_is_replaced_not_rewritten() -> None:
    """Unit test of the check at release (the H200 run is the evidence with real CUDA IPC): a
    consumer whose torch IPC counter is not back to 0 at the ack still holds the buffer, so that
    buffer is replaced, never written again; a counter at 0 frees the slot for the next bucket."""
    import os
    import uuid

    from refit.drivers import flattened as fl
    from refit.drivers.sglang_transport import _still_held

    name = f"refit_test_counters_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    counters = bytearray(64 + 8 * 16)  # torch's layout: a 64-byte header, then an int64 per export
    counters[64 + 3 * 8] = 1  # export 3: its consumer still holds it
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(bytes(counters))
    try:
        assert fl.ipc_refs(f"/{name}".encode(), 3) == 1 and fl.ipc_refs(name, 4) == 0
        tensors = {f"w{i}": torch.full((8,), float(i)) for i in range(4)}
        transport = SGLangTensorTransport(slots=1)
        plan = transport.plan([TensorMeta.of(n, t) for n, t in tensors.items()], 64)
        transport.connect(plan, Topology.of(1, [("a", 1)], colocated=True), 0)
        transport.pack(plan[0], [(n, tensors[n]) for n in plan[0].names])
        first = transport._pool.buffers[0]
        transport._counters[plan[0].index] = [("TP rank 0", f"/{name}".encode(), 3)]
        transport.release(plan[0].index)
        assert transport._pool.buffers[0] is not first  # replaced: the holder keeps reading the old bytes
        assert transport.held == [{"bucket": plan[0].index, "consumers": ["TP rank 0"]}]
        transport.pack(plan[1], [(n, tensors[n]) for n in plan[1].names])
        second = transport._pool.buffers[0]
        transport._counters[plan[1].index] = [("TP rank 0", f"/{name}".encode(), 4)]
        transport.release(plan[1].index)
        assert transport._pool.buffers[0] is second and len(transport.held) == 1  # let go: reused
        transport.disconnect()
        # a counter the file does not hold, or an impossible one, counts as held (fails closed)
        assert _still_held(f"/{name}".encode(), 40) and _still_held(f"/{name}".encode(), -1)
        assert _still_held(b"/refit_no_such_counter_file", 0)
    finally:
        os.unlink(f"/dev/shm/{name}")
