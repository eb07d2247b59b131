"""The storage-sharing transport (kind ``ipc``) on CPU, for real: the trainer's storages move into
named shared memory once, a reference-engine process opens them once and copies out of them
(the same code path CUDA IPC takes on a GPU; tests_gpu/ runs that one). Also the runner's storage
epoch (a reallocated trainer reconnects; replay reproduces it), staging for tensors that lie
elsewhere, references the engine refuses, and the NCCL settings that need no GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from refit import protocol
from refit.buckets import TensorMeta
from refit.drivers.base import ConnectInfo, Payload, Storages, Topology, storage_epoch
from refit.drivers.broadcast import BroadcastTransport, align_cumem, close_group
from refit.drivers.ipc import IPCReceiver, IPCTransport, open_storage
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.invariants import check_trace
from refit.reference.engine import EngineCore
from refit.reference.model import TinyLlama, greedy
from refit.replay import replay
from refit.trace import load_trace

from .conftest import CONFIG, SMALL_BUCKET, perturbed

pytestmark = pytest.mark.e2e
PROMPT = [5, 17, 3, 99, 42]


def _connected(result: protocol.RefitResult) -> bool:
    return any(call == "connect" for call, _, _ in result.rank_stats[0].steps)


def _exact(engine: ReferenceEngine, model: TinyLlama) -> bool:
    state = engine.state_dict()
    return all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.fixture
def engine() -> Any:
    e = ReferenceEngine.spawn("ipc-0", CONFIG, seed=0)
    yield e
    e.close()


def test_engine_copies_straight_from_the_trainers_storages(engine: ReferenceEngine, tmp_path: Path) -> None:
    """Every tensor travels as a reference into a storage shared once: no buffer on the trainer,
    one connect (the first refit moves the storages into shared memory; later ones reuse it), the
    engine's weights bit for bit, greedy tokens equal."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    params = [p.data_ptr() for p in model.parameters()]
    ctx = protocol.RefitContext(
        TorchSource(model), IPCTransport(signal_bytes=0, share_cpu=True), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=SMALL_BUCKET, trace=tmp_path / "t.jsonl",
    )  # fmt: skip
    try:
        connects = []
        for i in range(3):
            perturbed(model, seed=10 + i)
            result = protocol.run(ctx).raise_for_error()
            connects.append(_connected(result))
            assert result.buckets > 4 and result.trainer_peak_bytes == 0
            assert _exact(engine, model)
            assert engine.generate(PROMPT, 8)["output"] == greedy(model, PROMPT, 8)
        assert connects == [True, False, False]
        assert [p.data_ptr() for p in model.parameters()] != params  # moved into shared memory, in place
        perturbed(model, seed=99)  # the optimizer keeps writing the same (now shared) storages
        protocol.run(ctx).raise_for_error()
        assert _exact(engine, model)
    finally:
        ctx.close()
    _, events, _ = load_trace(tmp_path / "t.jsonl")
    assert check_trace(events) == []


def test_a_reallocated_trainer_is_reconnected_and_replays(engine: ReferenceEngine, tmp_path: Path) -> None:
    """New storages are a new epoch: the next refit connects afresh (never a stale handle), the
    weights land bit for bit, and the trace (epochs recorded per rank) replays without divergence."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=2)
    trace = tmp_path / "t.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), IPCTransport(signal_bytes=0, share_cpu=True), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=SMALL_BUCKET, trace=trace,
    )  # fmt: skip
    try:
        protocol.run(ctx).raise_for_error()
        before = storage_epoch(model.parameters())
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone() * 1.5  # the trainer reallocates (offload and reload, a resize...)
        assert storage_epoch(model.parameters()) != before
        result = protocol.run(ctx).raise_for_error()
        assert _connected(result)
        assert _exact(engine, model)
        perturbed(model, seed=3)
        assert not _connected(protocol.run(ctx).raise_for_error())
        assert _exact(engine, model)
    finally:
        ctx.close()
    epochs = [e for e in load_trace(trace)[1] if e.get("event") == "epoch"]
    assert len(epochs) >= 4 and all(isinstance(e["per_rank"], list) for e in epochs)
    report = replay(trace)
    assert report.divergence is None and report.runs == 3


def test_tensors_the_source_makes_anew_are_staged(engine: ReferenceEngine) -> None:
    """A source that casts hands out tensors no storage holds: each bucket goes through one of
    two staging buffers, reused only after the engine's ack; weights bit for bit."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=4)
    source = TorchSource(model, dtype=torch.float32)  # a cast (here to the same dtype): not resident
    assert source.storages() is None
    ctx = protocol.RefitContext(
        source, IPCTransport(signal_bytes=0, share_cpu=True), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=SMALL_BUCKET,
    )  # fmt: skip
    try:
        for i in range(2):
            perturbed(model, seed=20 + i)
            result = protocol.run(ctx).raise_for_error()
            assert 0 < result.trainer_peak_bytes <= 2 * SMALL_BUCKET
            assert _exact(engine, model)
    finally:
        ctx.close()


def _connect(tensors: dict[str, torch.Tensor]) -> tuple[IPCTransport, list[Any], IPCReceiver]:
    transport = IPCTransport(signal_bytes=0, share_cpu=True)
    plan = transport.plan([TensorMeta.of(n, t) for n, t in tensors.items()], 1 << 20)
    topo = Topology.of(1, [("e", 1)], colocated=True)
    transport.share(Storages(tuple(tensors.values())))
    info = transport.connect(plan, topo, 0)
    (connect,) = transport.attach_infos([info], topo).values()
    return transport, plan, IPCReceiver(connect, 0)


def test_a_tensor_reallocated_without_a_reconnect_is_copied_never_referenced() -> None:
    """Even if a reconnect were missed, a tensor that no longer lies in a shared storage is staged:
    the engine reads the new bytes, never the old storage's."""
    tensors = {"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, 8)}
    transport, plan, receiver = _connect(tensors)
    tensors["a"] = tensors["a"] * -1  # a new storage, after connect
    part = transport.pack(plan[0], [(n, tensors[n]) for n in plan[0].names])
    assert part is not None
    refs = dict(zip(plan[0].names, part["refs"], strict=True))
    assert refs["a"] is None and refs["b"] is not None and part.get("staging")
    (payload,) = transport.payloads(plan[0], [part], Topology.of(1, [("e", 1)], colocated=True)).values()
    got = dict(receiver.read(payload))
    assert torch.equal(got["a"], tensors["a"]) and torch.equal(got["b"], tensors["b"])
    transport.release(0)
    transport.disconnect()
    receiver.close()


@pytest.mark.parametrize(
    ("refs", "match"),
    [
        ([[0, 1 << 20]], "outside its shared storage"),
        ([[7, 0]], "reference to storage 7"),
        ([[0, 2]], "outside its shared storage"),  # misaligned for float32
        ([], "references do not match"),
        ([5], "is not \\[storage index, byte offset\\]"),
        ([[0, 0, 0]], "is not \\[storage index, byte offset\\]"),
        ([["0", "0"]], "is not \\[storage index, byte offset\\]"),
        ([[0.5, 0]], "is not \\[storage index, byte offset\\]"),
        ([[0, -8]], "outside its shared storage"),
    ],
)
def test_the_engine_refuses_references_outside_what_was_shared(refs: list[Any], match: str) -> None:
    tensors = {"w": torch.zeros(16, dtype=torch.float32)}
    transport, plan, receiver = _connect(tensors)
    payload = Payload("ipc", plan[0], parts=({"refs": refs},))
    with pytest.raises(ValueError, match=match):
        receiver.read(payload)
    transport.disconnect()


def test_only_the_trainers_own_segments_are_opened_and_never_grown() -> None:
    """A payload can name only shared-memory segments of the trainer process that connected, no
    larger than the file holds: another process's segment is never opened, grown or unlinked."""
    mine = torch.zeros(64).untyped_storage()
    manager, handle, size = (x.decode() if isinstance(x, bytes) else x for x in mine._share_filename_cpu_())
    pid = os.getpid()
    assert open_storage({"cpu": [manager, handle, size]}, None, pid).numel() == size
    with pytest.raises(ValueError, match="not a torch shared-memory segment of the trainer"):
        open_storage({"cpu": [manager, handle, size]}, None, pid + 1)  # another process's segment
    with pytest.raises(ValueError, match="not a torch shared-memory segment of the trainer"):
        open_storage({"cpu": [manager, "/etc/passwd", 10]}, None, pid)
    on_disk = (Path("/dev/shm") / handle[1:]).stat().st_size
    with pytest.raises(ValueError, match=f"holds {on_disk} bytes, the handle names 1024"):
        open_storage({"cpu": [manager, handle, 4 * size]}, None, pid)
    assert (Path("/dev/shm") / handle[1:]).stat().st_size == on_disk  # not grown
    with pytest.raises(ValueError, match="not a storage handle"):
        open_storage({"disk": 1}, None, pid)
    with pytest.raises(ValueError, match="is not a int"):
        open_storage({"cpu": [manager, handle, -5]}, None, pid)
    with pytest.raises(ValueError, match="needs a local device"):
        open_storage({"cuda": [0, "00", 1, 0, "00", 0, "00", False]}, None)


@pytest.mark.parametrize("staging", ["/torch_1_2_3", ["cpu"], {"cpu": ["m", "/torch_1_2", -1]}])
def test_a_staging_handle_that_is_not_one_is_refused(staging: Any) -> None:
    tensors = {"w": torch.zeros(16, dtype=torch.float32)}
    transport, plan, receiver = _connect(tensors)
    payload = Payload("ipc", plan[0], parts=({"refs": [None], "staging": staging},))
    with pytest.raises(ValueError, match=r"not a storage handle|not a torch shared-memory segment|is not a int"):
        receiver.read(payload)
    transport.disconnect()


def test_cpu_storages_are_staged_unless_sharing_is_asked_for(engine: ReferenceEngine) -> None:
    """By default a CPU trainer's storages are not moved into shared memory (that would stop a
    numpy alias aliasing and forbid resize_): its tensors are staged; bit for bit either way."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=6)
    before = [p.data_ptr() for p in model.parameters()]
    transport = IPCTransport(signal_bytes=0)
    ctx = protocol.RefitContext(
        TorchSource(model), transport, [engine], mode="colocated", pause_mode="abort", bucket_bytes=SMALL_BUCKET
    )
    try:
        result = protocol.run(ctx).raise_for_error()
        assert result.trainer_peak_bytes > 0 and _exact(engine, model)
        assert [p.data_ptr() for p in model.parameters()] == before  # nothing moved
    finally:
        ctx.close()
    assert transport._offered is None  # the source's tensors are not held past the connection


def test_an_engine_in_a_bad_receiver_state_fails_the_bucket_by_name(engine: ReferenceEngine) -> None:
    """A payload naming a storage index the engine never opened fails that bucket (bad_payload,
    naming the tensor) before any byte lands: the run fails and publishes nothing."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=5)

    class Lying(IPCTransport):
        def pack(self, manifest: Any, tensors: Any) -> dict[str, Any] | None:
            part = super().pack(manifest, tensors)
            if part is not None and manifest.index == 2:
                part["refs"] = [[999, 0]] * len(manifest.entries)
            return part

    ctx = protocol.RefitContext(
        TorchSource(model), Lying(signal_bytes=0), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=SMALL_BUCKET, retries=0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert not result.ok and result.version is None
        assert "storage 999" in str(result.error)
        assert engine.info()["version"] == 0
    finally:
        ctx.close()


def test_ipc_is_colocated_only(engine: ReferenceEngine) -> None:
    model = TinyLlama(CONFIG, seed=0)
    ctx = protocol.RefitContext(TorchSource(model), IPCTransport(), [engine], mode="disaggregated")
    try:
        result = protocol.run(ctx)
        assert not result.ok and "colocated only" in str(result.error)
    finally:
        ctx.close()


def test_signal_bytes_sets_the_least_a_bucket_covers() -> None:
    metas = [TensorMeta(f"w{i}", "float32", (1024,)) for i in range(64)]  # 4 KiB each
    assert len(IPCTransport(signal_bytes=0, share_cpu=True).plan(metas, 16 << 10)) == 16
    assert len(IPCTransport(signal_bytes=128 << 10).plan(metas, 16 << 10)) == 2
    with pytest.raises(ValueError, match="signal_bytes"):
        IPCTransport(signal_bytes=-1)


def test_the_storage_epoch_ignores_writes_and_sees_reallocations() -> None:
    t = torch.zeros(10)
    view = t[2:5]
    e0 = storage_epoch([t, view])
    t.add_(1)
    assert storage_epoch([t]) == e0  # in place: same storage, same memory
    t.resize_(1000)  # same storage object, new memory
    assert storage_epoch([t]) != e0


# ---- engine device and NCCL settings that need no GPU ---------------------------------------------


def test_a_gpu_reference_engine_has_one_tp_rank() -> None:
    with pytest.raises(ValueError, match="one TP rank"):
        ReferenceEngine.spawn("x", CONFIG, device="cuda", tp=2)
    with pytest.raises(ValueError, match="one TP rank"):
        from refit.reference.engine import Comm

        EngineCore(CONFIG, 0, comm=Comm(None, 0, 2), device="cuda")


def test_nccl_cumem_setting_is_aligned_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    align_cumem("0")  # unset here: takes the trainer's
    assert os.environ["NCCL_CUMEM_ENABLE"] == "0"
    align_cumem("0")
    align_cumem(None)  # the trainer leaves it to NCCL: nothing to align
    with pytest.raises(EngineError, match="NCCL_CUMEM_ENABLE is '0' in this engine and '1' in the trainer"):
        align_cumem("1")


def test_nccl_broadcast_settings_are_checked_up_front() -> None:
    with pytest.raises(ValueError, match="has none"):
        BroadcastTransport(backend="nccl", checksums=True)
    with pytest.raises(ValueError, match="gloo or nccl"):
        BroadcastTransport(backend="mpi")
    assert BroadcastTransport(backend="nccl").checksums is False
    assert BroadcastTransport().checksums is True


def test_an_nccl_group_is_aborted_on_close_and_gloo_left_to_close() -> None:
    calls: list[str] = []

    class Group:
        def abort(self) -> None:
            calls.append("abort")

    close_group(Group(), "nccl")
    close_group(Group(), "gloo")
    close_group(None, "nccl")
    assert calls == ["abort"]


def test_bench_gpu_refuses_without_a_gpu_or_with_an_unknown_shape(capsys: pytest.CaptureFixture[str]) -> None:
    from refit.cli import main

    assert main(["bench", "gpu", "--shapes", "70b"]) == 2
    assert "known shapes are 7b, 14b, 1.5b" in capsys.readouterr().err
    if torch.cuda.device_count() < 2:
        assert main(["bench", "broadcast", "--shapes", "1.5b"]) == 2
        assert "needs 2 CUDA device(s) on this host" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "gpu", "--shapes", "1.5b"]) == 2
        assert "needs 1 CUDA device(s) on this host, found 0" in capsys.readouterr().err


def test_connect_info_is_json_safe() -> None:
    import json

    tensors = {"w": torch.zeros(4)}
    _, _, receiver = _connect(tensors)
    info: ConnectInfo = receiver.info
    json.dumps({"fields": info.fields, "parts": info.parts})


def test_soak_does_not_count_torchs_shared_memory_manager_as_a_leak(capsys: pytest.CaptureFixture[str]) -> None:
    """Sharing a CPU storage by name starts torch's shared-memory manager, a child process that
    lives as long as this one: a soak run afterwards must not report it as a process left over."""
    import json

    from refit.cli import main

    torch.zeros(4).untyped_storage()._share_filename_cpu_()
    assert main(["soak", "--refits", "3", "--in-thread", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["processes_left"] == 0 and report["leaks"] == 0


def test_steady_refits_rerun_each_buckets_checked_copies(engine: ReferenceEngine) -> None:
    """Unverified steady refits over unchanged references: the receiver hands back the views it
    built, and the engine reruns that bucket's checked copies (no per-tensor work); weights bit for
    bit each time, and after the engine's parameters are new objects (memory released and resumed)
    it checks and builds them again."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    ctx = protocol.RefitContext(
        TorchSource(model), IPCTransport(signal_bytes=0, share_cpu=True), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=SMALL_BUCKET, verify="off",
    )  # fmt: skip
    try:
        kept = []
        for i in range(3):
            perturbed(model, seed=20 + i)
            result = protocol.run(ctx).raise_for_error()
            assert _exact(engine, model)
            kept.append(engine.info()["kept_loads"])
        n = result.buckets
        assert n > 4 and kept == [0, n, 2 * n]  # the connecting refit checks and builds; the next ones rerun
        engine.release_memory(["weights"], timeout=30)  # resumed by the next refit: new parameter objects
        perturbed(model, seed=30)
        protocol.run(ctx).raise_for_error()
        assert _exact(engine, model) and engine.info()["kept_loads"] == 2 * n  # built again, none rerun
        perturbed(model, seed=31)
        protocol.run(ctx).raise_for_error()
        assert _exact(engine, model) and engine.info()["kept_loads"] == 3 * n
    finally:
        ctx.close()


def test_fresh_views_of_a_checked_bucket_skip_the_per_tensor_checks(engine: ReferenceEngine) -> None:
    """A receiver that builds new views per request (SGLang's flattened buckets) gets the checks of
    the bucket's first load: names, shapes and dtypes compared as lists, one batched copy; bit for
    bit each refit. A view that differs from what was checked gets the full checks and is refused."""
    from refit.drivers.sglang_transport import SGLangTensorTransport

    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    ctx = protocol.RefitContext(
        TorchSource(model), SGLangTensorTransport(), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=SMALL_BUCKET, verify="off",
    )  # fmt: skip
    try:
        checked = []
        for i in range(3):
            perturbed(model, seed=40 + i)
            result = protocol.run(ctx).raise_for_error()
            assert _exact(engine, model)
            info = engine.info()
            checked.append(info["checked_loads"])
            assert info["kept_loads"] == 0  # no view of the receiver's is kept
        n = result.buckets
        assert n > 4 and checked == [0, n, 2 * n]
    finally:
        ctx.close()
    core = EngineCore(CONFIG, seed=0)
    metas = [TensorMeta.of(k, t) for k, t in model.state_dict().items()]
    plan = SGLangTensorTransport().plan(metas, SMALL_BUCKET)
    views = {k: t.detach().clone() for k, t in model.state_dict().items()}
    for _ in range(2):  # checked and kept, then taken by the kept checks
        core.begin(plan)
        for m in plan:
            core.load(m, [(k, views[k].view(views[k].shape)) for k in m.names])  # new view objects
        core.finalize()
    assert core.checked_loads == len(plan)
    core.begin(plan)
    core.load(plan[0], [(k, views[k]) for k in plan[0].names])
    wrong = [(k, views[k].double()) for k in plan[1].names]  # the same names, another dtype
    with pytest.raises(EngineError, match="payload float64"):
        core.load(plan[1], wrong)
    assert core.checked_loads == len(plan) + 1  # bucket 0 again; the wrong one was checked in full


def test_tp_engines_refit_a_casting_source_again_and_again() -> None:
    """A TP=2 engine over IPC whose source casts (every bucket staged: the receiver's views are a new
    list each refit): sharded tensors are narrowed on each rank every time, never copied whole into
    a shard from a kept check (found by an adversarial review: the second refit failed)."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=4)
    engine = ReferenceEngine.spawn("ipc-tp2-cast", CONFIG, seed=0, tp=2)
    ctx = protocol.RefitContext(
        TorchSource(model, dtype=torch.float32), IPCTransport(signal_bytes=0, share_cpu=True), [engine],
        mode="colocated", pause_mode="abort", bucket_bytes=SMALL_BUCKET, verify="off", retries=0, deadline_s=60,
    )  # fmt: skip
    try:
        for i in range(3):
            perturbed(model, seed=20 + i)
            protocol.run(ctx).raise_for_error()
            assert _exact(engine, model)
    finally:
        ctx.close()
        engine.close()


def test_a_copy_that_fails_on_one_tp_rank_fails_the_bucket_on_every_rank() -> None:
    """Every TP rank reaches the load's closing collective, failed or not: a copy that raises on
    rank 1 only fails the bucket on both ranks (rank 0 names rank 1), and the ranks' next
    collective still pairs up (found by an adversarial review: the ranks fell out of step)."""
    import gc
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from refit.buckets import plan_buckets
    from refit.drivers.base import Receiver
    from refit.reference.engine import Comm
    from refit.reference.server import EngineServer

    class _Given(Receiver):
        def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
            return payload.parts[self.tp_rank]["tensors"]

    store = dist.HashStore()
    state = {k: t.detach().clone() for k, t in perturbed(TinyLlama(CONFIG, seed=0), seed=5).state_dict().items()}
    plan = plan_buckets([TensorMeta.of(k, t) for k, t in state.items()], SMALL_BUCKET)
    outcome: dict[int, Any] = {}

    def rank(r: int) -> None:
        comm = Comm(dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30)), r, 2)
        server = EngineServer(EngineCore(CONFIG, seed=0, comm=comm), "tp", in_process=True)
        server.receivers["given"] = _Given(ConnectInfo("given", "tests:_Given"), r)
        if r == 1:

            def broken(*args: Any, **kwargs: Any) -> None:
                raise RuntimeError("a copy failed part way")

            server.core.load = broken  # type: ignore[method-assign]
        server.core.begin(plan)
        manifest = plan[0]
        named = [(k, state[k]) for k in manifest.names]
        try:
            server._load(Payload("given", manifest, {}, ({"tensors": named}, {"tensors": named})))
            outcome[r] = None
        except EngineError as exc:
            outcome[r] = (exc.kind, exc.message)  # (not the exception: its frames would keep the group)
        outcome[(r, "next")] = comm.gather_objects(r)  # paired with the other rank's

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    gc.collect()  # the ranks' gloo groups go now, not during a later test that counts descriptors
    assert outcome[0] is not None and "TP rank 1" in outcome[0][1], outcome
    assert outcome[1] is not None and outcome[1][0] == "internal", outcome
    assert outcome[(0, "next")] == outcome[(1, "next")] == [0, 1]
