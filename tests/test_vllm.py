"""The vLLM driver: contract tests against vLLM 0.33's own code (its routers validate every request
the driver sends, its info dataclasses parse what reaches the workers, its packing functions read
our buckets), then full refits over real HTTP into reference engines behind an emulated vLLM
server (not vLLM: no vLLM GPU server runs in CI), its traps, error mapping, the conformance kit and
the demo. vLLM's workers (CUDA streams, PyNccl, CUDA IPC rebuilds) cannot run without a GPU."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from refit import protocol
from refit.buckets import TensorMeta, pack_into, plan_buckets, torch_dtype
from refit.drivers.flattened import plan_flattened
from refit.drivers.torch_source import TorchSource
from refit.drivers.vllm import Capabilities, VLLMEngine, update_info
from refit.drivers.vllm_transport import VLLMBroadcastTransport, VLLMIPCTransport
from refit.errors import EngineDied, EngineError
from refit.reference.model import TinyLlama, greedy, prompt_logits
from refit.testing.vllm_server import EmulatedVLLMEngine

from .conftest import CONFIG, SMALL_BUCKET, Forward, matches, perturbed, restart_before
from .vllm_support import validate_request, vllm

pytestmark = pytest.mark.e2e
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "int8", "bool"]


# ---- contract: vLLM's own code --------------------------------------------------------------------


def _tensor(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in ("float32", "bfloat16", "float16"):
        return torch.randn(shape, generator=gen).to(torch_dtype(dtype))
    return torch.randint(-100, 100, shape, generator=gen).to(torch_dtype(dtype))


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")  # vLLM's note on an oversized tensor
@settings(max_examples=40)
@given(
    st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 7), max_size=3)), min_size=1, max_size=12),
    st.integers(16, 2048),
)
def test_vllm_packing_reads_our_buckets_bit_exact(metas, bucket_bytes) -> None:
    """vLLM's own `pack_tensors` (the NCCL producer's chunking, buffer = our largest bucket) makes
    exactly our bucket bytes, one chunk per bucket; its `unpack_tensor` (both consumers) views every
    tensor back out: our ordering keeps every offset aligned for its dtype."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    tensors = {f"w{i}": _tensor(d, tuple(s), i) for i, (d, s) in enumerate(metas)}
    plan = plan_flattened([TensorMeta.of(n, t) for n, t in tensors.items()], bucket_bytes)
    buffer_size = max(m.payload_bytes for m in plan if not m.oversized) if any(not m.oversized for m in plan) else 1
    for manifest in plan:
        ours = torch.empty(manifest.nbytes, dtype=torch.uint8)
        pack_into(ours, manifest, [(n, tensors[n]) for n in manifest.names])
        chunk = pack_tensors(iter([(n, tensors[n]) for n in manifest.names]), lambda item: item[1], buffer_size)
        assert chunk is not None and chunk.names == manifest.names  # the whole bucket is one chunk
        assert torch.equal(chunk.packed_tensor, ours)
        body = update_info(manifest)
        unpacked = unpack_tensor(
            ours, body["names"], body["shapes"], [torch_dtype(d) for d in body["dtype_names"]], chunk.tensor_sizes
        )
        for name, t in unpacked:
            want = tensors[name]
            assert t.dtype == want.dtype and tuple(t.shape) == tuple(want.shape)
            assert torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_vllm_unpack_fails_on_a_misaligned_layout_that_ours_avoids() -> None:
    """Why the ordering matters: the same tensors packed in source order (an int64 after a bf16
    vector of odd length) cannot be viewed back by vLLM's consumer; plan_flattened's order can."""
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    tensors = {"b": _tensor("bfloat16", (3,), 1), "i": _tensor("int64", (5,), 2)}
    metas = [TensorMeta.of(n, t) for n, t in tensors.items()]
    naive = plan_buckets(metas, 1 << 20, align=1)[0]
    raw = torch.cat([tensors[n].reshape(-1).view(torch.uint8) for n in naive.names])
    sizes = [e.meta.nbytes for e in naive.entries]
    with pytest.raises(RuntimeError, match="divisible"):
        unpack_tensor(raw, naive.names, [list(e.meta.shape) for e in naive.entries],
                      [torch_dtype(e.meta.dtype) for e in naive.entries], sizes)  # fmt: skip
    (ours,) = plan_flattened(metas, 1 << 20)
    buf = torch.empty(ours.nbytes, dtype=torch.uint8)
    pack_into(buf, ours, [(n, tensors[n]) for n in ours.names])
    out = dict(unpack_tensor(buf, ours.names, [list(e.meta.shape) for e in ours.entries],
                             [torch_dtype(e.meta.dtype) for e in ours.entries], [e.meta.nbytes for e in ours.entries]))  # fmt: skip
    assert all(torch.equal(out[n], t) for n, t in tensors.items())


def test_the_trainer_speaks_vllms_nccl_rendezvous_to_vllms_own_group_code() -> None:
    """vLLM's workers join a trainer at /init_weight_transfer_engine through vLLM's own
    StatelessProcessGroup (a TCPStore client) and PyNcclCommunicator, whose rank 0 publishes its
    ncclUniqueId with broadcast_obj. Here refit's trainer side (its store, its init_info, its
    pickled unique id) meets vLLM's own code in other processes: vLLM parses the init_info, puts
    each worker at the rank refit planned, and reads back vLLM's own ncclUniqueId class holding
    refit's bytes. (NCCL itself, ncclCommInitRank, the warm-up and the broadcasts, needs two GPUs.)"""
    import json
    import os
    import types

    from vllm.distributed.weight_transfer.nccl_common import _worker_group_rank

    from refit.drivers.base import Topology
    from refit.drivers.vllm import nccl_init_info
    from refit.drivers.vllm_nccl import UNIQUE_ID_BYTES, publish_unique_id

    v = vllm()
    metas = [TensorMeta("w", "float32", (4, 4))]
    transport = VLLMBroadcastTransport(backend="gloo", host="127.0.0.1")  # the store is the same for nccl
    plan = transport.plan(metas, 1 << 20)
    topology = Topology.of(1, [("e0", 2), ("e1", 1)], colocated=False)
    info = transport.connect(plan, topology, 0)
    try:
        infos = transport.attach_infos([info], topology)
        workers = []
        for name, tp in (("e0", 2), ("e1", 1)):
            init = v.NCCLInitInfo(**nccl_init_info(infos[name].fields))  # vLLM's own parse of refit's init_info
            assert init.world_size == 4 and init.nccl_unique_id_bytes is None
            for j in range(tp):
                cfg = types.SimpleNamespace(data_parallel_index=0, world_size=tp, rank=j)
                rank = _worker_group_rank(init.rank_offset, cfg)
                assert rank == infos[name].parts[j]["rank"]
                workers.append(rank)
        assert sorted(workers) == [1, 2, 3]
        uid = os.urandom(UNIQUE_ID_BYTES)
        publish_unique_id(transport._store, uid)
        code = (
            "import sys, json\n"
            "from vllm.distributed.utils import StatelessProcessGroup\n"
            "pg = StatelessProcessGroup.create(host=sys.argv[1], port=int(sys.argv[2]), rank=int(sys.argv[3]),"
            " world_size=4, store_timeout=60)\n"
            "uid = pg.broadcast_obj(None, src=0)\n"
            "print(json.dumps([type(uid).__module__ + '.' + type(uid).__name__, bytes(uid.internal).hex()]))\n"
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, info["addr"], str(info["port"]), str(r)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in workers
        ]
        for p in procs:
            out, err = p.communicate(timeout=180)
            assert p.returncode == 0, err[-2000:]
            cls, raw = json.loads(out.strip().splitlines()[-1])
            assert cls == "vllm.distributed.device_communicators.pynccl_wrapper.ncclUniqueId"
            assert bytes.fromhex(raw) == uid
    finally:
        transport.disconnect()


def test_capability_record_matches_the_installed_vllm() -> None:
    v = vllm()
    caps = Capabilities.of(v.version)
    assert caps.version == "0.33.0" and caps.session and caps.start_body is None and caps.packed_in_init
    import typing

    assert set(typing.get_args(v.PauseMode)) == {"abort", "wait", "keep"}  # what /pause takes
    assert Capabilities.of("0.22.0").start_body == {"is_checkpoint_format": True}
    assert not Capabilities.of("0.17.0").session


def test_the_request_validator_refuses_what_vllm_refuses() -> None:
    """The contract check itself can fail: vLLM's routers and dataclasses reject these."""
    with pytest.raises(ValueError, match="HTTP 422"):
        validate_request("/pause", None, {"mode": ["retract"]})
    with pytest.raises(TypeError, match="packed"):  # the 0.17/0.22-style update_info
        validate_request(
            "/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": [], "packed": True}}
        )
    with pytest.raises(ValueError, match="master_address"):
        validate_request("/init_weight_transfer_engine", {"init_info": {"rank_offset": 1, "world_size": 2}})
    with pytest.raises(ValueError, match="CompletionRequest"):
        validate_request("/v1/completions", {"model": "m", "prompt": [1], "max_token": 3})


# ---- end to end ---------------------------------------------------------------------------------


@pytest.fixture
def vllm_engines() -> Iterator[Callable[..., list[EmulatedVLLMEngine]]]:
    made: list[EmulatedVLLMEngine] = []

    def make(n: int = 2, **kw: object) -> list[EmulatedVLLMEngine]:
        engines = [EmulatedVLLMEngine.start(f"vl{len(made) + i}", config=CONFIG, **kw) for i in range(n)]  # type: ignore[arg-type]
        made.extend(engines)
        return engines

    yield make
    for e in made:
        e.close()


@pytest.fixture
def vllm_ctx() -> Iterator[Callable[..., protocol.RefitContext]]:
    made: list[protocol.RefitContext] = []

    def make(model: TinyLlama, engines: list[VLLMEngine], **kw: object) -> protocol.RefitContext:
        mode = kw.setdefault("mode", "colocated")
        if "transport" not in kw:
            kw["transport"] = VLLMIPCTransport() if mode == "colocated" else VLLMBroadcastTransport()
        kw.setdefault("bucket_bytes", SMALL_BUCKET)
        kw.setdefault("deadline_s", 60.0)
        kw.setdefault("verify", "off")  # these tests are of the transfer: verification is tests/test_vllm_checksums.py
        ctx = protocol.RefitContext(source=TorchSource(model), engines=engines, **kw)  # type: ignore[arg-type]
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()


def serves(engine: VLLMEngine, model: TinyLlama, version: int) -> None:
    assert matches(engine, model)
    assert float((engine.score(PROMPT) - prompt_logits(model, PROMPT)).abs().max()) <= 1e-5
    out = engine.generate(PROMPT, 6)
    assert out["output"] == greedy(model, PROMPT, 6) and out["weight_versions"] == [version] * 6
    assert engine.info()["version"] == version


@pytest.mark.parametrize(
    ("mode", "tp", "packed"),
    [("colocated", 1, True), ("colocated", 2, True), ("disaggregated", 2, True), ("disaggregated", 1, False)],
    ids=["ipc-tp1", "ipc-tp2", "nccl-packed-tp2", "nccl-unpacked"],
)
def test_full_refits_over_http(trainer, vllm_engines, vllm_ctx, mode, tp, packed) -> None:
    """Every request goes through vLLM's own routers and dataclasses (the emulator answers 422 if
    they refuse it, and the refit fails)."""
    backend = "ipc" if mode == "colocated" else "nccl"
    engines = vllm_engines(2, tp=tp, backend=backend, validate=validate_request)
    transport = VLLMIPCTransport() if mode == "colocated" else VLLMBroadcastTransport(packed=packed)
    ctx = vllm_ctx(trainer, engines, mode=mode, transport=transport)
    futures = [] if mode == "colocated" else [e.submit(PROMPT, 200) for e in engines]
    for version in (1, 2):
        result = protocol.run(ctx)
        assert result.ok, result.error
        for e in engines:
            serves(e, trainer, version)
        perturbed(trainer, seed=version)
    for f in futures:
        assert f.result(timeout=30)["output"]
    routes = [r for r, _ in engines[0].server.received]
    assert routes.count("/start_weight_update") == 2 and routes.count("/finish_weight_update") == 2
    assert routes.count("/init_weight_transfer_engine") == 1  # one transfer engine across refits
    for route, body in engines[0].server.received:
        if route == "/update_weights":
            info = body["update_info"]
            assert info["names"] and len(info["names"]) == len(info["shapes"])  # always full metadata
        if route == "/finish_weight_update":
            assert body == {}  # publishing is its own step
    ctx.close()
    assert engines[0].server.received[-1][0] == "/shutdown_weight_transfer_engine"


def test_vllm_dangling_session_is_finished_and_restarted(trainer, vllm_engines, vllm_ctx) -> None:
    """A crashed trainer left a session open: vLLM refuses start ("already active"); the driver
    finishes it and starts again."""
    (engine,) = vllm_engines(1, backend="ipc")
    assert httpx.post(f"{engine.url}/start_weight_update").status_code == 200
    result = protocol.run(vllm_ctx(trainer, [engine]))
    assert result.ok, result.error
    serves(engine, trainer, 1)


def test_vllm_abort_pause_rejects_new_requests_and_retract_keeps_them(trainer, vllm_engines, vllm_ctx) -> None:
    """retract (keep + the KV dropped): requests in flight finish with tokens from both versions,
    never on stale KV (checked by teacher forcing in the kit; here: they finish, straddling)."""
    (engine,) = vllm_engines(1, backend="nccl")
    ctx = vllm_ctx(trainer, [engine], mode="disaggregated", pause_mode="retract")
    futures = [engine.submit(PROMPT, 240) for _ in range(2)]
    while not engine.server._engine("info")["running"]:
        time.sleep(0.005)
    assert protocol.run(ctx).ok
    outs = [f.result(timeout=30) for f in futures]
    assert all(o["finish_reason"] == "length" and len(o["output"]) == 240 for o in outs)
    assert any(o["weight_versions"][0] == 0 and o["weight_versions"][-1] == 1 for o in outs)
    # 0.33 deprecates /pause's clear_cache: the driver never asks for it; its flush drops the frozen
    # requests' KV (reset_prefix_cache with reset_running_requests) and the encoder's outputs
    pauses = [b["query"] for r, b in engine.server.received if r == "/pause"]
    assert pauses and all(q.get("clear_cache") == ["false"] for q in pauses), pauses
    routes = [r for r, _ in engine.server.received]
    assert routes.index("/pause") < routes.index("/reset_prefix_cache") < routes.index("/reset_encoder_cache")
    assert httpx.post(f"{engine.url}/pause", params={"mode": "abort"}).status_code == 200
    with pytest.raises(EngineError) as err:
        engine.generate(PROMPT, 2, timeout=5)
    assert err.value.kind == "paused" and "HTTP 503" in str(err.value)


def test_vllm_errors_name_the_engine_the_call_and_the_status(trainer, vllm_engines) -> None:
    (engine,) = vllm_engines(1, backend="nccl", api_key="sesame")
    with pytest.raises(EngineError) as err:  # vLLM: every worker-side failure is HTTP 500
        engine._call("POST", "/update_weights", "load", timeout=5, update=True,
                     body={"update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}})  # fmt: skip
    assert err.value.kind == "no_session" and err.value.no_effect and "HTTP 500" in str(err.value)
    assert "vl0" in str(err.value) and "(load)" in str(err.value)
    engine.begin([], timeout=5)
    with pytest.raises(EngineError) as err:
        engine._call("POST", "/start_weight_update", "begin", timeout=5)
    assert err.value.kind == "session_open"
    with pytest.raises(EngineError) as err:
        engine._call("POST", "/init_weight_transfer_engine", "attach", timeout=5,
                     body={"init_info": {"rank_offset": 1, "world_size": 2, "backend": "nccl"}})  # fmt: skip
    assert err.value.kind == "bad_payload" and "unexpected keyword argument 'backend'" in str(err.value)
    with pytest.raises(EngineError) as err:
        engine._call("POST", "/pause", "pause", timeout=5, params={"mode": "retract"})
    assert err.value.kind == "bad_request" and "HTTP 400" in str(err.value)
    keyless = VLLMEngine("nokey", engine.url, model="refit-reference")
    with pytest.raises(EngineError) as err:
        keyless.generate(PROMPT, 1, timeout=5)
    assert err.value.kind == "unauthorized" and "HTTP 401" in str(err.value) and "(generate)" in str(err.value)
    keyless.close()
    engine.server.armed[("flush", None)] = ("hang", 3.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"vl0: POST /reset_prefix_cache \(flush\)"):
        engine.flush(timeout=0.5)
    assert time.monotonic() - t0 < 1.5
    engine.server.close()
    with pytest.raises(EngineDied, match=r"vl0: POST /resume \(continue_generation\).*unreachable"):
        engine.continue_generation(timeout=5)


def test_vllm_restart_is_seen_by_the_probe_and_reconnected(trainer, vllm_engines, vllm_ctx) -> None:
    """A real restart behind the same URL (a fresh engine process): vLLM lost its transfer engine
    and labels its weights "default" again; the probe reports `restarted` and the next run
    initializes the transfer engine again."""
    (engine,) = vllm_engines(1, backend="ipc")
    ctx = vllm_ctx(trainer, [engine])
    assert protocol.run(ctx).ok
    engine.server.restart()
    assert engine.server.label == "default" and engine.server.initialized is None
    perturbed(trainer, seed=3)
    first = protocol.run(ctx)
    assert not first.ok and "restarted" in str(first.error)
    second = protocol.run(ctx)
    assert second.ok, second.error
    assert [r for r, _ in engine.server.received].count("/init_weight_transfer_engine") == 2
    serves(engine, trainer, 3)


def test_vllm_ipc_without_insecure_serialization_fails_naming_the_variable(trainer, vllm_engines, vllm_ctx) -> None:
    """vLLM refuses to unpickle `ipc_handles_pickled` unless the server was started with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (IPCWeightTransferUpdateInfo.__post_init__): the error says
    what to set. No byte landed, but start_weight_update had moved the layers to the meta device and
    the failure left them there: the engine is quarantined, never continued, and a refit against a
    server started right gives it its weights back."""
    (engine,) = vllm_engines(1, backend="ipc", env={"VLLM_SERVER_DEV_MODE": "1"})
    ctx = vllm_ctx(trainer, [engine], retries=0)
    result = protocol.run(ctx)
    assert not result.ok and result.engines["vl0"].status == "quarantined"  # its layers are on "meta" now
    error = str(result.engines["vl0"].error)
    assert "misconfigured" in error and "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in error, error
    assert engine.server.crashed is None and engine.server._engine("info")["weights_released"]
    engine.server.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # what the error told the user to set
    second = protocol.run(ctx)
    assert second.ok, second.error
    serves(engine, trainer, second.version)


def test_a_quarantined_vllm_stays_out_of_service_through_the_next_offload(trainer, vllm_engines, vllm_ctx) -> None:
    """vLLM's wake_up resumes the scheduler whenever nothing is left asleep (v1/engine/core.py): a
    wake of memory refit never released would undo the pause that quarantines an engine, and it
    would serve weights no version names. The driver wakes only what it released."""
    (engine,) = vllm_engines(1, backend="ipc")
    ctx = vllm_ctx(trainer, [engine], retries=0,
                   faults=protocol.FaultPlan().fail_at("transferring", engine=0, bucket=2, kind="raise"))  # fmt: skip
    first = protocol.run(ctx)
    assert first.engines["vl0"].status == "quarantined"
    engine.resume_memory(["weights"], timeout=10)  # what the next colocated refit's OFFLOADING asks
    assert "/wake_up" not in [r for _, r in engine.server.requests]
    with pytest.raises(EngineError) as err:
        engine.generate(PROMPT, 2, timeout=5)
    assert err.value.kind == "quarantined"  # the driver refuses it first
    body = {"model": "m", "prompt": list(PROMPT), "max_tokens": 2}  # past the driver: the server itself
    assert httpx.post(f"{engine.url}/v1/completions", json=body, timeout=5).status_code == 503  # nothing resumed it
    assert httpx.get(f"{engine.url}/is_paused", timeout=5).json() == {"is_paused": True}


def test_vllm_without_dev_mode_has_no_weight_routes(vllm_engines) -> None:
    """Without VLLM_SERVER_DEV_MODE=1 vLLM registers none of its RL or dev routes."""
    (engine,) = vllm_engines(1, backend="nccl", env={})
    with pytest.raises(EngineError) as err:
        engine.probe(1, timeout=5)
    assert err.value.kind == "unsupported" and "VLLM_SERVER_DEV_MODE=1" in str(err.value)


def test_demo_runs_through_the_vllm_driver_and_says_it_is_emulated() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "refit.cli", "demo", "--engine", "vllm", "--refits", "2", "--mode", "disaggregated",
         "--transport", "broadcast"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EMULATED" in proc.stdout and "No vLLM server runs here" in proc.stdout
    assert "all 2 refits matched the trainer" in proc.stdout


def test_vllm_broadcast_member_killed_mid_bucket_is_dropped(trainer, vllm_engines, vllm_ctx) -> None:
    """Over the (emulated) NCCL transfer group: engine 1 dies mid-broadcast; refit shuts the
    transfer engine down on the survivor, re-inits it without the dead member and retries."""
    engines = vllm_engines(2, backend="nccl")
    ctx = vllm_ctx(
        trainer, engines, mode="disaggregated", retries=1,
        faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="kill"),
    )  # fmt: skip
    result = protocol.run(ctx)
    assert result.engines["vl0"].status == "updated" and result.engines["vl1"].status == "failed"
    serves(engines[0], trainer, 1)
    routes = [r for r, _ in engines[0].server.received]
    assert routes.count("/init_weight_transfer_engine") == 2 and "/shutdown_weight_transfer_engine" in routes


def test_a_vllm_older_than_the_weight_transfer_api_is_refused_up_front(vllm_engines) -> None:
    (engine,) = vllm_engines(1, version="0.22.0", backend="ipc")
    with pytest.raises(EngineError) as err:
        engine.probe(1, timeout=10)
    assert err.value.kind == "unsupported" and err.value.no_effect and "0.28" in str(err.value)


def test_a_vllm_left_paused_mid_update_by_a_crashed_trainer_is_never_continued(trainer, vllm_engines) -> None:
    """A crashed trainer left vLLM paused with start_weight_update done (its layers on the meta
    device). A new trainer's first probe finds it paused: not serving. Its first refit fails before
    its own begin (a flush fault), and the engine is quarantined, never resumed on what it holds."""
    (engine,) = vllm_engines(1, backend="ipc", in_thread=True)
    for route, params in (("/pause", {"mode": "abort"}), ("/start_weight_update", None)):  # the crashed trainer
        assert httpx.post(engine.url + route, params=params).status_code == 200
    ctx = protocol.RefitContext(source=TorchSource(trainer), engines=[engine], transport=VLLMIPCTransport(), verify="off",
                                mode="colocated", bucket_bytes=SMALL_BUCKET, deadline_s=20, retries=0,
                                faults=protocol.FaultPlan().fail_at("invalidating", engine=0, call="flush",
                                                                    kind="raise"))  # fmt: skip
    result = protocol.run(ctx)
    ctx.close()
    assert result.engines["vl0"].status == "quarantined"
    assert "/resume" not in [r for _, r in engine.server.requests]


def test_a_vllm_driver_built_for_another_worker_count_is_refused(vllm_engines) -> None:
    """A wrong worker count leaves a rank of vLLM's group unfilled (the group never forms): the
    driver reads /get_world_size at first contact and refuses, naming the count."""
    (engine,) = vllm_engines(1, backend="nccl", tp=2)
    short = VLLMEngine("short", engine.url, tp=1)
    try:
        with pytest.raises(EngineError) as err:
            short.probe(1, timeout=10)
        assert err.value.kind == "misconfigured" and "tp=2" in str(err.value)
    finally:
        short.close()


def test_a_vllm_restart_between_the_update_and_its_publish_is_never_published(trainer, vllm_engines, vllm_ctx) -> None:
    """The server restarts after the last bucket and before the label is set: vLLM would take the
    new label over its checkpoint. The driver reads the label before it publishes: changed since
    the probe, nothing is published; the next refits reconnect and go through."""
    (engine,) = vllm_engines(1, backend="ipc")
    ctx = vllm_ctx(trainer, [engine], retries=0)
    assert protocol.run(ctx).ok
    restart_before(engine, "publish")
    perturbed(trainer, seed=11)
    result = protocol.run(ctx)
    assert not result.ok and result.engines[engine.name].status != "updated", result.engines[engine.name]
    assert "before publish" in str(result.engines[engine.name].error)
    assert engine.server.label == "default"
    del engine.publish
    for _ in range(2):  # the first may find the transfer engine gone (`restarted`) and reconnect
        result = protocol.run(ctx)
        if result.ok:
            break
    assert result.ok, result.error
    serves(engine, trainer, result.version)


def test_a_weight_info_of_another_shape_is_named_not_indexed(vllm_engines) -> None:
    (engine,) = vllm_engines(1, backend="ipc")
    engine.server.r_weight_info = lambda *a: ["default"]  # type: ignore[method-assign]
    with pytest.raises(EngineError) as err:
        engine.probe(1, timeout=10)
    assert err.value.kind == "bad_answer" and "/weight_info" in str(err.value), err.value


def test_a_driver_built_before_its_server_was_up_still_checks_it_at_first_contact(vllm_engines) -> None:
    """A VLLMEngine made while nothing listens learns nothing then; its first probe still reads the
    worker count (and whether the server was left paused)."""
    import socket

    (server,) = vllm_engines(1, backend="ipc", tp=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    early = VLLMEngine("early", f"http://127.0.0.1:{port}", tp=1)  # nothing listens there yet
    proxy = Forward(server.server.address, port)  # now the server is up at that address
    try:
        with pytest.raises(EngineError) as err:
            early.probe(1, timeout=10)
        assert err.value.kind == "misconfigured" and "tp=2" in str(err.value), err.value
    finally:
        proxy.down()
        early.close()
