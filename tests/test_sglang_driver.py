"""The SGLang driver end to end over real HTTP: full refits (colocated, disaggregated over gloo) into
reference engines behind an emulated SGLang server, with the weights and logits checked; SGLang's
version traps; error mapping; and the regressions that cite SGLang and miles bugs, run through the
SGLang driver. The emulated server is `refit.testing.sglang_server` (not SGLang: no SGLang GPU
server runs in CI); SGLang's own code validates every body and decodes tensor payloads here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import torch

from refit import protocol
from refit.drivers.sglang import SGLangEngine
from refit.drivers.sglang_transport import SGLangBroadcastTransport, SGLangTensorTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineDied, EngineError
from refit.reference.model import TinyLlama, greedy, prompt_logits
from refit.testing.sglang_server import EmulatedSGLangEngine

from .conftest import CONFIG, SMALL_BUCKET, Forward, matches, perturbed, restart_before
from .sglang_support import validate_body

pytestmark = pytest.mark.e2e
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture
def sglang_engines() -> Iterator[Callable[..., list[EmulatedSGLangEngine]]]:
    made: list[EmulatedSGLangEngine] = []

    def make(n: int = 2, *, front: str = "emulator", **kw: object) -> list[EmulatedSGLangEngine]:
        """`front`: the HTTP server in front of the emulated scheduler: refit's own (what
        `refit.testing` ships), or SGLang 0.5.23's own FastAPI app (tests/sglang_app.py)."""
        if front == "sglang":
            from .sglang_app import SGLangAppServer

            kw["server"] = SGLangAppServer
        engines = [EmulatedSGLangEngine.start(f"sg{len(made) + i}", config=CONFIG, **kw) for i in range(n)]  # type: ignore[arg-type]
        made.extend(engines)
        return engines

    yield make
    for e in made:
        e.close()


@pytest.fixture
def sglang_ctx() -> Iterator[Callable[..., protocol.RefitContext]]:
    made: list[protocol.RefitContext] = []

    def make(model: TinyLlama, engines: list[SGLangEngine], **kw: object) -> protocol.RefitContext:
        mode = kw.setdefault("mode", "colocated")
        if "transport" not in kw:
            kw["transport"] = SGLangTensorTransport() if mode == "colocated" else SGLangBroadcastTransport()
        kw.setdefault("bucket_bytes", SMALL_BUCKET)
        kw.setdefault("deadline_s", 60.0)
        kw.setdefault("verify", "off")  # (verification by SGLang's own checksums: tests/test_sglang_checksums.py)
        ctx = protocol.RefitContext(source=TorchSource(model), engines=engines, **kw)  # type: ignore[arg-type]
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()


def serves(engine: SGLangEngine, model: TinyLlama, version: int) -> None:
    """Weights read back bit-exact, fresh logits equal to the trainer's, greedy tokens equal, and
    every token labelled with the version."""
    assert matches(engine, model)
    logits = engine.score(PROMPT)
    assert float((logits - prompt_logits(model, PROMPT)).abs().max()) <= 1e-5
    out = engine.generate(PROMPT, 6)
    assert out["output"] == greedy(model, PROMPT, 6)
    assert out["weight_versions"] == [version] * 6
    assert engine.info()["version"] == version


@pytest.mark.parametrize(
    ("mode", "tp", "flattened", "front"),
    [("colocated", 1, None, "emulator"), ("colocated", 2, None, "emulator"), ("disaggregated", 2, True, "emulator"),
     ("disaggregated", 1, False, "emulator"), ("colocated", 2, None, "sglang"), ("disaggregated", 2, True, "sglang")],
    ids=["colocated-tp1", "colocated-tp2", "disagg-flattened-tp2", "disagg-per-tensor", "colocated-tp2-sglang-app",
         "disagg-flattened-tp2-sglang-app"],
)  # fmt: skip
def test_full_refits_over_http(trainer, sglang_engines, sglang_ctx, mode, tp, flattened, front) -> None:
    """Two refits into two engines, weights and logits checked; `front` sglang: behind SGLang's own
    HTTP server (routes, validation, status codes and auth are SGLang's)."""
    engines = sglang_engines(2, tp=tp, front=front)
    transport = SGLangTensorTransport() if mode == "colocated" else SGLangBroadcastTransport(flattened=bool(flattened))
    ctx = sglang_ctx(trainer, engines, mode=mode, transport=transport)
    for version in (1, 2):
        if mode == "colocated":  # the trainer's step ran with the engines' memory released, as in an RL loop
            for e in engines:
                e.release_memory(["weights", "kv_cache"], timeout=30)
            assert engines[0].server.offload_tags == {"weights", "kv_cache", "cuda_graph"}
        result = protocol.run(ctx)
        assert result.ok, result.error
        assert all(r.status == "updated" for r in result.engines.values())
        for e in engines:
            serves(e, trainer, version)
        perturbed(trainer, seed=version)
    routes = [r for r, _ in engines[0].server.received]
    assert routes.count("/begin_weight_update") == 2
    assert routes.count("/end_weight_update") == 2  # one per refit: the probe only reads
    if mode == "colocated":  # weights back before the load, then KV and CUDA graphs: nothing left released
        resumed = [b["tags"] for r, b in engines[0].server.received if r == "/resume_memory_occupation"]
        assert resumed == [["weights"], ["kv_cache", "cuda_graph"]] * 2
        assert engines[0].server.offload_tags == set()
        # SGLang's continue_generation checks nothing: the KV memory comes back before it
        order = [(r, (b or {}).get("tags")) for r, b in engines[0].server.received]
        kv = [i for i, (r, t) in enumerate(order) if r == "/resume_memory_occupation" and t and "kv_cache" in t]
        go = [i for i, (r, _) in enumerate(order) if r == "/continue_generation"]
        assert len(kv) == len(go) == 2 and all(k < g for k, g in zip(kv, go, strict=True))
    if mode == "disaggregated":
        assert routes.count("/init_weights_update_group") == 1  # one group across refits
    ctx.close()
    if mode == "disaggregated":
        assert [r for r, _ in engines[0].server.received][-1] == "/destroy_weights_update_group"
        assert engines[0].server.groups == {}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_every_body_validates_and_sglang_decodes_every_payload(trainer, sglang_engines, sglang_ctx, mode) -> None:
    """SGLang's request types validate every body the driver sends (the emulator answers 422
    otherwise, and the refit would fail), and SGLang's own MultiprocessingSerializer and
    FlattenedTensorBucket decode every tensor payload inside the engine."""
    engines = sglang_engines(2, in_thread=True, decoder="sglang", validate=validate_body)
    if mode == "colocated":  # released while the trainer trained; nothing runs then
        for e in engines:
            e.release_memory(["weights", "kv_cache"], timeout=30)
        futures = []
    else:
        futures = [e.submit(PROMPT, 40) for e in engines]
        time.sleep(0.05)
    ctx = sglang_ctx(trainer, engines, mode=mode)
    result = protocol.run(ctx)
    assert result.ok, result.error
    for e in engines:
        serves(e, trainer, 1)
    for f in futures:
        assert f.result(timeout=30)["output"]
    routes = {r for e in engines for r, _ in e.server.received}
    updates = (
        {"/update_weights_from_tensor"}
        if mode == "colocated"
        else {"/init_weights_update_group", "/update_weights_from_distributed"}
    )
    assert (
        routes
        >= {
            "/pause_generation",
            "/begin_weight_update",
            "/end_weight_update",
            "/update_weight_version",
            "/continue_generation",
            "/generate",
        }
        | updates
    )
    if mode == "colocated":
        assert {"/release_memory_occupation", "/resume_memory_occupation"} <= routes
    for e in engines:
        for route, body in e.server.received:
            validate_body(route, body)  # already checked on arrival; asserted here too
            if route == "/update_weights_from_tensor":
                assert body["flush_cache"] is False and body["load_format"] == "flattened_bucket"
            if route == "/update_weight_version":
                assert body["abort_all_requests"] is False


# ---- version traps -------------------------------------------------------------------------------


def test_sglang_0_5_20_has_no_session_and_no_usable_retract(trainer, sglang_engines, sglang_ctx) -> None:
    """Before 0.5.21 there is no begin/end session (each update applies on its own) and a flush
    fails while retracted requests wait, so retract is not offered; abort works."""
    engines = sglang_engines(1, version="0.5.20")
    assert engines[0].capabilities is not None and not engines[0].capabilities.session  # read when it connected
    with pytest.raises(ValueError, match="retract"):
        sglang_ctx(trainer, engines, pause_mode="retract")
    result = protocol.run(sglang_ctx(trainer, engines, pause_mode="abort"))
    assert result.ok, result.error
    serves(engines[0], trainer, 1)
    routes = [r for r, _ in engines[0].server.received]
    assert "/begin_weight_update" not in routes and "/end_weight_update" not in routes


@pytest.mark.parametrize("front", ["emulator", "sglang"])
def test_sglang_dangling_session_from_a_crashed_run_is_closed_once_paused(
    trainer, sglang_engines, sglang_ctx, front
) -> None:
    """sgl-project/sglang PR#28001: the update session lives in the scheduler and survives a
    crashed trainer, so the next begin_weight_update fails "already open". The driver ends it at
    begin, after the pause, never in the probe (ending takes the model's writer lock on a serving
    engine)."""
    (engine,) = sglang_engines(1, front=front)
    crashed = httpx.post(f"{engine.url}/begin_weight_update", json={})
    assert crashed.status_code == 200 and engine.server.session_open
    ctx = sglang_ctx(trainer, [engine])
    result = protocol.run(ctx)
    assert result.ok, result.error
    routes = [r for r, _ in engine.server.received]
    assert (
        routes.index("/pause_generation")
        < routes.index("/end_weight_update")
        < routes.index("/update_weights_from_tensor")
    )
    serves(engine, trainer, 1)


@pytest.mark.parametrize("front", ["emulator", "sglang"])
def test_the_probe_only_reads_and_never_stalls_live_generation(trainer, sglang_engines, front) -> None:
    """SGLang's /end_weight_update on an engine that is not paused takes the model's writer lock:
    it waits for every request in flight and keeps new ones out meanwhile. The probe (run on a
    serving engine, before any pause) makes no POST at all, so generation never notices it."""
    (engine,) = sglang_engines(1, front=front)
    running = engine.submit(PROMPT, 200)
    while not engine.server._engine("info")["running"]:
        time.sleep(0.005)
    seen = len(engine.server.received)
    t0 = time.monotonic()
    engine.probe(1, timeout=10)
    probe_s = time.monotonic() - t0
    assert [r for r, _ in engine.server.received[seen:]] == []  # no JSON body: GETs only
    assert engine.server.model_update_lock.readers == 1 and not running.done()  # it ran beside the request
    assert probe_s < 2.0
    assert running.result(timeout=60)["finish_reason"] == "length"


@pytest.mark.parametrize("front", ["emulator", "sglang"])
def test_a_load_that_raises_in_sglangs_scheduler_kills_the_server_and_loses_the_engine(
    trainer, sglang_engines, sglang_ctx, front
) -> None:
    """SGLang catches nothing around a tensor load: a wrong shape raises in the scheduler, which
    SIGQUITs the server. The engine is reported lost (the call's connection dropped, then nothing
    listens), never continued or published; the lock is released; the restarted server refits."""
    (engine,) = sglang_engines(1, front=front)
    bad = {**trainer.state_dict(), "model.norm.weight": torch.ones(CONFIG.hidden_size + 1)}
    ctx = protocol.RefitContext(source=TorchSource(bad), engines=[engine], transport=SGLangTensorTransport(), verify="off",
                                mode="colocated", bucket_bytes=SMALL_BUCKET, retries=1, deadline_s=30)  # fmt: skip
    t0 = time.monotonic()
    result = protocol.run(ctx)
    assert time.monotonic() - t0 < 30
    assert not result.ok and result.engines["sg0"].status == "failed" and result.version is None
    assert engine.server.crashed and "model.norm.weight" in engine.server.crashed
    assert not engine.alive and "the server is gone" in str(result.engines["sg0"].error)
    calls = [(e["event"], e.get("outcome")) for e in ctx.recorder.events if e["kind"] == "call"]
    assert ("continue_generation", "ok") not in calls and ("publish", "ok") not in calls
    assert ctx.lock is not None and ctx.lock.holder is None
    ctx.close()
    engine.server.restart()
    good = sglang_ctx(trainer, [engine])
    assert protocol.run(good).ok
    serves(engine, trainer, 1)


def test_miles_2589_sglang_version_update_does_not_abort_in_flight_requests(
    trainer, sglang_engines, sglang_ctx
) -> None:
    """radixark/miles#2589/#2296: /update_weight_version aborts every request in flight unless told
    not to. Through the SGLang driver, retract-paused requests finish on the new version; the same
    route with SGLang's default aborts them."""
    engines = sglang_engines(1)
    ctx = sglang_ctx(trainer, engines, pause_mode="retract")
    futures = [engines[0].submit(PROMPT, 240) for _ in range(3)]
    while not engines[0].server._engine("info")["running"]:
        time.sleep(0.005)
    assert protocol.run(ctx).ok
    outs = [f.result(timeout=30) for f in futures]
    assert all(out["finish_reason"] == "length" and len(out["output"]) == 240 for out in outs)
    assert any(out["weight_versions"][0] == 0 and out["weight_versions"][-1] == 1 for out in outs)  # straddled
    doomed = engines[0].submit(PROMPT, 240)
    while not engines[0].server._engine("info")["running"]:
        time.sleep(0.005)
    assert httpx.post(f"{engines[0].url}/update_weight_version", json={"new_version": "9"}).status_code == 200
    assert doomed.result(timeout=30)["finish_reason"] == "abort"


@pytest.mark.parametrize("version", ["0.5.23", "0.5.21"])
def test_sglang_flush_inside_an_update_is_why_refit_never_asks_for_it(trainer, sglang_engines, version) -> None:
    """sgl-project/sglang#14062/#12099, AReaL#140: an update asked to flush while requests hold KV.
    0.5.22+ answers HTTP 400 "Weights were updated, but the cache was not flushed" although the
    weights changed: the driver reports `state_unknown` (poison, never success or no-effect). Up to
    0.5.21 the scheduler dies. refit's own updates always send flush_cache=false."""
    from refit.drivers.sglang import update_weights_from_tensor_body

    (engine,) = sglang_engines(1, version=version)
    engine.probe(1, timeout=10)
    running = engine.submit(PROMPT, 240)
    while not engine.server._engine("info")["running"]:
        time.sleep(0.005)
    assert httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert httpx.post(f"{engine.url}/begin_weight_update", json={}).status_code == 200
    before = engine.state_dict()
    name = "model.norm.weight"
    body = update_weights_from_tensor_body(
        [[(name, torch.full_like(before[name], 2.0))]], weight_version=None, flush_cache=True
    )
    if version == "0.5.21":
        with pytest.raises(EngineDied, match=r"sg0.*update_weights_from_tensor.*load.*the server is gone"):
            engine._call("POST", "/update_weights_from_tensor", "load", timeout=30, body=body, update=True)
        with pytest.raises(EngineDied, match="unreachable"):
            engine.probe(1, timeout=5)
        return
    with pytest.raises(EngineError) as err:
        engine._call("POST", "/update_weights_from_tensor", "load", timeout=30, body=body, update=True)
    assert err.value.kind == "state_unknown" and not err.value.no_effect
    assert "HTTP 400" in str(err.value) and "sg0" in str(err.value) and "(load)" in str(err.value)
    assert bool((engine.state_dict()[name] == 2.0).all())  # the weights did change
    httpx.post(f"{engine.url}/continue_generation", json={})
    running.result(timeout=30)


def test_miles_2782_in_place_pause_is_refused_for_sglang(trainer, sglang_engines, sglang_ctx) -> None:
    """radixark/miles#2782: in_place keeps KV computed by the old weights and SGLang cannot flush it."""
    engines = sglang_engines(1)
    with pytest.raises(ValueError, match="in_place"):
        sglang_ctx(trainer, engines, pause_mode="in_place")


def test_sglang_session_left_open_by_a_hang_does_not_block_the_next_refit(trainer, sglang_engines, sglang_ctx) -> None:
    """A driver that gave up mid-update (hung server) leaves SGLang's session open; the hung engine
    is quarantined (kept paused, not served) and the next refit closes the session and updates it."""
    engines = sglang_engines(2)
    ctx = sglang_ctx(
        trainer,
        engines,
        call_timeout_s=1.0,  # (0.5 s: a loaded 2-core CI machine once kept the healthy engine's load past it)
        faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=3, kind="hang"),
    )
    first = protocol.run(ctx)
    assert first.engines["sg0"].status == "updated" and first.engines["sg1"].status == "failed"
    with pytest.raises(TimeoutError):
        engines[1].generate(PROMPT, 2, timeout=0.5)  # quarantined: paused, nothing served
    time.sleep(3.0)  # the hung call completes on the server
    ctx.faults = None
    perturbed(trainer, seed=5)
    second = protocol.run(ctx)
    assert second.ok, second.error
    for e in engines:
        serves(e, trainer, 2)


def test_an_engine_killed_mid_bucket_is_reported_and_the_other_updated(trainer, sglang_engines, sglang_ctx) -> None:
    engines = sglang_engines(2)
    ctx = sglang_ctx(
        trainer,
        engines,
        retries=0,
        faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="kill"),
    )
    t0 = time.monotonic()
    result = protocol.run(ctx)
    assert time.monotonic() - t0 < 60
    assert result.engines["sg0"].status == "updated" and result.engines["sg1"].status == "failed"
    error = str(result.engines["sg1"].error)
    assert "connection_lost" in error or "EngineDied" in error, error  # the answer never came: the server died
    serves(engines[0], trainer, 1)
    assert ctx.lock is not None and ctx.lock.holder is None


def test_a_distributed_load_that_fails_is_answered_partially_updated_and_quarantined(trainer, sglang_engines) -> None:
    """SGLang catches a failed load from a broadcast ("Failed to update parameter online ... the full
    weights ... are partially updated"): HTTP 400, the server lives. refit takes it as
    `state_unknown` (the weights changed), quarantines the engine and publishes nothing. SGLang
    receives what the request names before it loads (weight_updater.py), so the trainer's
    broadcast of that bucket completes: no send waits out its timeout."""
    (engine,) = sglang_engines(1)
    bad = {**trainer.state_dict(), "model.norm.weight": torch.ones(CONFIG.hidden_size + 1)}
    ctx = protocol.RefitContext(source=TorchSource(bad), engines=[engine], transport=SGLangBroadcastTransport(), verify="off",
                                mode="disaggregated", bucket_bytes=SMALL_BUCKET, retries=0, deadline_s=30)  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert not result.ok and result.version is None and result.engines["sg0"].status == "quarantined"
        error = str(result.engines["sg0"].error)
        assert "state_unknown" in error and "partially updated" in error, error
        assert engine.server.crashed is None and engine.alive
        sends = [e for e in ctx.recorder.events if (e.get("side"), e.get("event")) == ("transport", "send")]
        assert sends and not [e for e in sends if e.get("error")], sends
    finally:
        ctx.close()


# ---- error mapping -------------------------------------------------------------------------------


def test_errors_name_the_engine_the_call_and_the_status(trainer, sglang_engines) -> None:
    (engine,) = sglang_engines(1, api_key="sesame")
    keyless = SGLangEngine("nokey", engine.url)
    with pytest.raises(EngineError) as err:  # with --api-key, SGLang guards even /server_info
        keyless.probe(1, timeout=5)
    assert err.value.kind == "unauthorized" and err.value.no_effect
    assert "nokey" in str(err.value) and "(probe)" in str(err.value) and "HTTP 401" in str(err.value)
    keyless.close()
    (admin,) = sglang_engines(1, admin_api_key="root")  # --admin-api-key only: reads are open, control is not
    keyless = SGLangEngine("nokey", admin.url)
    assert keyless.probe(1, timeout=5)["version"] == 0
    with pytest.raises(EngineError) as err:
        keyless.pause("abort", timeout=5)
    assert err.value.kind == "unauthorized" and "HTTP 401" in str(err.value)
    keyless.close()
    admin.probe(1, timeout=5)
    admin.pause("abort", timeout=5)  # its driver sends the admin key on control routes
    admin.continue_generation(timeout=5)

    engine.probe(1, timeout=10)
    with pytest.raises(EngineError) as err:  # 400 outside a session: SGLang refused before any byte
        engine._call("POST", "/update_weights_from_distributed", "load", timeout=5, update=True,
                     body={"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})  # fmt: skip
    assert err.value.kind == "no_session" and err.value.no_effect and "HTTP 400" in str(err.value)
    with pytest.raises(EngineError) as err:
        engine._call("POST", "/no_such_route", "probe", timeout=5, body={})
    assert err.value.kind == "unsupported" and "HTTP 404" in str(err.value)
    with pytest.raises(EngineError) as err:  # a POST without a JSON body: SGLang's validation answer, 400
        engine._call("POST", "/pause_generation", "pause", timeout=5)
    assert err.value.kind == "bad_request" and err.value.no_effect and "HTTP 400" in str(err.value)

    def boom(*a: object) -> None:
        raise RuntimeError("scheduler exploded")

    engine.server.r_flush_cache = boom  # type: ignore[method-assign]
    with pytest.raises(EngineError) as err:
        engine.flush(timeout=5)
    assert err.value.kind == "server_error" and "HTTP 500" in str(err.value) and "scheduler exploded" in str(err.value)

    engine.server.armed[("pause", None)] = ("hang", 3.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"sg0: POST /pause_generation \(pause\)"):
        engine.pause("abort", timeout=0.5)
    assert time.monotonic() - t0 < 1.5  # bounded by the timeout, not by the server

    engine.server.close()
    with pytest.raises(EngineDied, match=r"sg0: POST /continue_generation \(continue_generation\).*unreachable"):
        engine.continue_generation(timeout=5)


def test_a_server_trickling_its_answer_is_bounded_by_the_timeout() -> None:
    """httpx bounds each read, not the whole answer: the driver bounds the whole call."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.05)

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    driver = SGLangEngine("slow", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="slow"):
            driver.continue_generation(timeout=0.5)
        assert time.monotonic() - t0 < 1.5
    finally:
        driver.close()
        server.shutdown()


# ---- the conformance kit and the demo ------------------------------------------------------------


def test_demo_runs_through_the_sglang_driver_and_says_it_is_emulated() -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "refit.cli", "demo", "--engine", "sglang", "--refits", "2"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "EMULATED" in proc.stdout and "No SGLang server runs here" in proc.stdout
    assert "all 2 refits matched the trainer" in proc.stdout


def test_a_broadcast_member_killed_mid_bucket_is_dropped_and_the_group_rebuilt(
    trainer, sglang_engines, sglang_ctx
) -> None:
    """Disaggregated over SGLang's group: engine 1 dies mid-broadcast, which breaks the group for
    everyone; refit destroys it on the survivor, re-inits it without the dead member and retries,
    so engine 0 takes the version; the next refit (with a replacement) forms a fresh group."""
    engines = sglang_engines(2)
    ctx = sglang_ctx(
        trainer, engines, mode="disaggregated", retries=1,
        faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="kill"),
    )  # fmt: skip
    result = protocol.run(ctx)
    assert result.engines["sg0"].status == "updated" and result.engines["sg1"].status == "failed"
    serves(engines[0], trainer, 1)
    routes = [r for r, _ in engines[0].server.received]
    assert routes.count("/init_weights_update_group") == 2 and "/destroy_weights_update_group" in routes
    last_init = max(i for i, r in enumerate(routes) if r == "/init_weights_update_group")
    assert "/destroy_weights_update_group" in routes[:last_init]  # the old group went before the new one
    ctx.close()  # a new engine set is a new context: the old one destroys its group on sg0
    (replacement,) = sglang_engines(1)
    perturbed(trainer, seed=9)
    ctx2 = sglang_ctx(trainer, [engines[0], replacement], mode="disaggregated", version=1)
    second = protocol.run(ctx2)
    assert second.engines["sg0"].status == "updated", second.error
    serves(engines[0], trainer, 2)


# ---- servers that misbehave (from an adversarial review) ---------------------------------------


def _slow_server(head: bytes, tail: bytes, delay: float | list[float]) -> tuple[object, str]:
    """A server that sends `head` one byte every `delay` seconds, then `tail` (`delay` a list: its
    first item, read as each byte goes, so a test can change it)."""
    import socketserver
    import threading

    class Slow(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            try:
                for b in head:
                    self.request.sendall(bytes([b]))
                    time.sleep(delay[0] if isinstance(delay, list) else delay)
                self.request.sendall(tail)
            except OSError:
                pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Slow)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_server_trickling_its_headers_is_bounded_and_frees_the_call_lane() -> None:
    """httpx bounds each read: a status line sent one byte at a time never trips it. The driver
    bounds the whole call, and drops that connection, so its next call is not stuck behind it."""
    server, url = _slow_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", b"{}", 0.2)
    driver = SGLangEngine("trickle", url)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"trickle.*no complete answer"):
            driver.continue_generation(timeout=0.5)
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            driver.pause("abort", timeout=0.5)  # a fresh connection, its own budget
        assert time.monotonic() - t0 < 1.0
    finally:
        driver.close()
        server.shutdown()


def test_an_update_answered_without_sglangs_success_answer_is_state_unknown(sglang_engines) -> None:
    """A 200 whose body is not SGLang's {"success": true} does not count as applied."""
    (engine,) = sglang_engines(1)
    engine.probe(1, timeout=10)
    engine.server.r_begin_weight_update = lambda *a: "ok, I guess"  # type: ignore[method-assign]
    with pytest.raises(EngineError) as err:
        engine.begin([], timeout=5)
    assert err.value.kind == "state_unknown" and not err.value.no_effect and "begin_weight_update" in str(err.value)


def test_a_version_label_the_server_did_not_set_fails_the_publish(trainer, sglang_engines, sglang_ctx) -> None:
    """A server that answers success to /update_weight_version but keeps its old label: the run
    does not report the engine at the new version (its tokens would carry the old one)."""
    (engine,) = sglang_engines(1)
    engine.server.r_update_weight_version = lambda *a: {"success": True, "message": "sure"}  # type: ignore[method-assign]
    result = protocol.run(sglang_ctx(trainer, [engine], retries=0))
    assert not result.ok and result.engines["sg0"].status != "updated"
    assert "published version 1, but the server reports 'default'" in str(result.error)


@pytest.mark.parametrize(("mode", "front"), [("colocated", "emulator"), ("disaggregated", "emulator"),
                                             ("colocated", "sglang")])  # fmt: skip
def test_a_restarted_sglang_server_is_seen_by_its_label_and_refit(
    trainer, sglang_engines, sglang_ctx, mode, front
) -> None:
    """A real restart behind the same URL (a fresh engine process, label "default", no session, no
    group, nothing released): SGLang exposes no identity, so the driver reads the restart from the
    label it last set. Colocated, the driver held memory released: a relabel by another client
    looks the same, and a wrong guess kills SGLang, so the probe refuses (`memory_unknown`, the
    server untouched) until the user says `set_released([], restarted=True)`; then the refit goes
    through on a new incarnation, resuming nothing. Disaggregated, the probe reports `restarted`
    (its group is gone) and the refit after it forms a new group."""
    (engine,) = sglang_engines(1, front=front)
    ctx = sglang_ctx(trainer, [engine], mode=mode, retries=0)
    if mode == "colocated":
        engine.release_memory(["weights", "kv_cache"], timeout=30)
    assert protocol.run(ctx).ok
    before = engine.incarnation
    if mode == "colocated":
        engine.release_memory(["weights", "kv_cache"], timeout=30)
    engine.server.restart()
    assert engine.server.label == "default" and not engine.server.offload_tags
    perturbed(trainer, seed=4)
    result = protocol.run(ctx)
    if mode == "colocated":
        assert not result.ok and "memory_unknown" in str(result.engines["sg0"].error)
        assert result.engines["sg0"].status == "unchanged", result.engines["sg0"]
        assert engine.server.crashed is None and not engine.server.offload_tags  # nothing was resumed
        assert engine.incarnation == before
        engine.set_released([], restarted=True)
        result = protocol.run(ctx)
    assert engine.incarnation != before
    if mode == "disaggregated":
        assert not result.ok and "restarted" in str(result.engines["sg0"].error)
        assert engine.server.crashed is None and engine.alive  # refused up front, nothing sent to the new server
        result = protocol.run(ctx)
    assert result.ok, result.error
    serves(engine, trainer, result.version)
    assert engine.server.crashed is None


def test_a_dropped_connection_to_a_live_server_is_connection_lost_not_death(sglang_engines) -> None:
    """A connection dropped before an answer while the server still listens (a proxy reset, a stale
    keep-alive) may or may not have run the request: `connection_lost`, effect unknown; only a
    server that also refuses new connections is dead."""
    (engine,) = sglang_engines(1)
    engine.probe(1, timeout=10)
    from refit.testing.emulated import _Drop

    def drop(*a: object) -> None:
        raise _Drop()

    engine.server.r_pause_generation = drop  # type: ignore[method-assign]
    with pytest.raises(EngineError) as err:
        engine.pause("abort", timeout=5)
    assert err.value.kind == "connection_lost" and not err.value.no_effect and "(pause)" in str(err.value)
    engine.continue_generation(timeout=5)  # the server is alive: the next call works


def test_a_session_the_server_would_not_end_is_not_taken_as_closed(sglang_engines) -> None:
    """/end_weight_update answering 200 {"success": false}: the session is still open, and the
    quarantine that tried to close it says so."""
    (engine,) = sglang_engines(1)
    engine.probe(1, timeout=10)
    engine.server.r_end_weight_update = lambda *a: {"success": False, "message": "busy"}  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="busy"):
        engine.quarantine("test", timeout=10)


@pytest.mark.parametrize("version", ["0.5.2", "0.4.10"])
def test_an_sglang_too_old_for_byte_offset_buckets_is_refused_up_front(sglang_engines, version) -> None:
    (engine,) = sglang_engines(1, version=version)
    with pytest.raises(EngineError) as err:
        engine.probe(1, timeout=10)
    assert err.value.kind == "unsupported" and err.value.no_effect and "0.5.6" in str(err.value)


# ---- what an engine holds across runs (from an adversarial review) ----------------------------


@pytest.mark.parametrize("where", ["load", "begin"])
def test_an_update_a_run_opened_and_never_finished_is_never_continued_by_the_next(
    trainer, sglang_engines, where
) -> None:
    """Run 1 hangs inside the update (a load, or begin itself) and writes the engine off without a
    quarantine; run 2 fails before its own begin. The driver remembers the update it opened and
    never completed: its probe says the engine is not serving, so run 2 quarantines it instead of
    continuing it on a mix of weights labelled with the old version."""
    (engine,) = sglang_engines(1, in_thread=True)
    hang = (protocol.FaultPlan().fail_at("transferring", engine=0, bucket=1, call="load", kind="hang") if where == "load"
            else protocol.FaultPlan().fail_at("invalidating", engine=0, call="begin", kind="hang"))  # fmt: skip

    def ctx(faults: protocol.FaultPlan) -> protocol.RefitContext:
        return protocol.RefitContext(source=TorchSource(trainer), engines=[engine], transport=SGLangTensorTransport(), verify="off",
                                     mode="colocated", bucket_bytes=SMALL_BUCKET, deadline_s=20, retries=0,
                                     call_timeout_s=1.0, faults=faults)  # fmt: skip

    first = ctx(hang)
    protocol.run(first)
    first.close()
    time.sleep(2.5)  # the hung call lands
    perturbed(trainer, seed=2)
    second = ctx(protocol.FaultPlan().fail_at("invalidating", engine=0, call="flush", kind="raise"))
    result = protocol.run(second)
    second.close()
    assert result.engines["sg0"].status == "quarantined", result.engines["sg0"]
    routes = [r for r, _ in engine.server.received]
    last_begin = max(i for i, r in enumerate(routes) if r == "/begin_weight_update")
    assert "/continue_generation" not in routes[last_begin:]


def test_a_label_changed_by_another_client_while_memory_is_released_is_refused_not_guessed(
    trainer, sglang_engines, sglang_ctx
) -> None:
    """A restart (nothing released) and another client's /update_weight_version look alike to the
    driver; a wrong guess kills SGLang (resume of a tag never released, or a load into released
    memory). With memory released it refuses, naming the way out, and the server lives."""
    (engine,) = sglang_engines(1)
    ctx = sglang_ctx(trainer, [engine])
    engine.release_memory(["weights", "kv_cache"], timeout=30)
    assert protocol.run(ctx).ok
    engine.release_memory(["weights", "kv_cache"], timeout=30)
    httpx.post(f"{engine.url}/update_weight_version", json={"new_version": "1-canary", "abort_all_requests": False})
    perturbed(trainer, seed=3)
    refused = protocol.run(ctx)
    assert not refused.ok and "memory_unknown" in str(refused.engines["sg0"].error)
    assert "set_released" in str(refused.engines["sg0"].error)
    assert engine.server.crashed is None and engine.server.offload_tags == {"weights", "kv_cache", "cuda_graph"}
    engine.set_released(["weights", "kv_cache"])  # the user says what is released
    result = protocol.run(ctx)
    assert result.ok, result.error
    serves(engine, trainer, result.version)


def test_a_server_that_died_and_came_back_is_a_new_process_to_the_driver(trainer, sglang_engines, sglang_ctx) -> None:
    """The server dies while refit labels it, and its orchestrator restarts it. The driver saw
    nothing listening: what answers next is a new process, with nothing released, so the next
    refit resumes nothing it never released (SGLang dies on that) and goes through."""
    (engine,) = sglang_engines(1)
    ctx = sglang_ctx(trainer, [engine], retries=0)
    engine.release_memory(["weights", "kv_cache"], timeout=30)
    assert protocol.run(ctx).ok
    engine.release_memory(["weights", "kv_cache"], timeout=30)

    def die(*a: object) -> None:
        raise engine.server.crash("killed while labelling")

    engine.server.r_update_weight_version = die  # type: ignore[method-assign]
    perturbed(trainer, seed=1)
    assert not protocol.run(ctx).ok
    engine.server.restart()
    del engine.server.r_update_weight_version
    perturbed(trainer, seed=2)
    result = protocol.run(ctx)
    assert result.ok, result.error
    assert engine.server.crashed is None
    serves(engine, trainer, result.version)


def test_a_driver_built_for_another_tp_size_is_refused_before_it_kills_the_server(sglang_engines) -> None:
    """One payload entry per TP rank: a TP=2 server given one entry dies in its scheduler (rank 1
    indexes past the list). The driver reads tp_size from /server_info and refuses first."""
    (engine,) = sglang_engines(1, tp=2)
    short = SGLangEngine("short", engine.url, tp=1)
    try:
        with pytest.raises(EngineError) as err:
            short.probe(1, timeout=10)
        assert err.value.kind == "misconfigured" and err.value.no_effect and "tp=2" in str(err.value)
        assert engine.server.crashed is None
    finally:
        short.close()


@pytest.mark.parametrize("version", ["0.5.23", "0.5.20"])
def test_a_restart_between_the_update_and_its_publish_is_never_published(
    trainer, sglang_engines, sglang_ctx, version
) -> None:
    """The server restarts (back at its checkpoint, label "default") after the last bucket and
    before the label is set: SGLang would take the new label over its launch weights (0.5.20 has
    no session to lose, so even a restart mid-transfer lands here). The driver reads the label
    before it publishes: changed since the probe, nothing is published, and the next refit (told
    of the restart) goes through."""
    (engine,) = sglang_engines(1, version=version)
    ctx = sglang_ctx(trainer, [engine], pause_mode="abort", retries=0)
    assert protocol.run(ctx).ok
    restart_before(engine, "publish")
    perturbed(trainer, seed=11)
    result = protocol.run(ctx)
    assert not result.ok and result.engines["sg0"].status != "updated", result.engines["sg0"]
    assert "before publish" in str(result.engines["sg0"].error)
    assert engine.server.label == "default" and engine.server.crashed is None
    del engine.publish
    result = protocol.run(ctx)
    if not result.ok and "memory_unknown" in str(result.engines["sg0"].error):
        engine.set_released([], restarted=True)  # colocated: the user says what a restart left released
        result = protocol.run(ctx)
    assert result.ok, result.error
    serves(engine, trainer, result.version)


def test_a_dropped_connection_to_a_server_holding_released_memory_is_not_taken_for_a_restart(
    trainer, sglang_engines, sglang_ctx
) -> None:
    """One refused connection (a proxy restarting in front of a live server) then the same label:
    the same process or a restart that kept its label. With memory released, a wrong guess kills
    SGLang, so the probe refuses (`memory_unknown`); the server lives and keeps what it released."""
    (server,) = sglang_engines(1)
    proxy = Forward(server.server.address)
    engine = SGLangEngine("sg0", f"http://127.0.0.1:{proxy.port}")
    try:
        ctx = sglang_ctx(trainer, [engine], retries=0)
        engine.release_memory(["weights", "kv_cache"], timeout=30)
        assert protocol.run(ctx).ok
        engine.release_memory(["weights", "kv_cache"], timeout=30)
        proxy.down()  # for a moment: open connections dropped, new ones refused
        with pytest.raises(EngineDied):
            engine.probe(99, timeout=2)
        proxy.up()
        perturbed(trainer, seed=12)
        refused = protocol.run(ctx)
        assert not refused.ok and "memory_unknown" in str(refused.engines["sg0"].error), refused.engines["sg0"]
        assert server.server.crashed is None and server.server.offload_tags == {"weights", "kv_cache", "cuda_graph"}
        engine.set_released(["weights", "kv_cache"])  # the same process: what it still holds released
        result = protocol.run(ctx)
        assert result.ok, result.error
        assert server.server.crashed is None
    finally:
        proxy.down()
        engine.close()


def test_a_relaunch_under_another_tp_size_is_refused_at_the_next_probe(trainer, sglang_engines, sglang_ctx) -> None:
    """A restart is read again from /server_info: a relaunch with another --tp-size is refused
    before a payload with the wrong number of entries kills it."""
    (engine,) = sglang_engines(1)
    ctx = sglang_ctx(trainer, [engine], retries=0)
    assert protocol.run(ctx).ok
    engine.server.restart()
    launched = engine.server.server_info
    engine.server.server_info = lambda: {**launched(), "tp_size": 2}  # type: ignore[method-assign]
    perturbed(trainer, seed=13)
    result = protocol.run(ctx)
    assert not result.ok and "misconfigured" in str(result.engines["sg0"].error), result.engines["sg0"]
    assert engine.server.crashed is None


def test_a_driver_on_the_callers_own_transport_works_after_a_call_overran() -> None:
    """With `transport=` (the caller's own, shared by its clients), an overrun must not close it:
    the driver moves to a fresh client over the same transport, and its next call is answered (it
    stopped working after one overrun: closing the stuck client closed the caller's transport)."""
    import httpx

    delay = [0.2]  # the first answer trickles its status line; later ones come at once
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
    server, url = _slow_server(head, b"{}", delay)
    transport = httpx.HTTPTransport()
    driver = SGLangEngine("own", url, transport=transport)
    try:
        with pytest.raises(TimeoutError, match=r"own.*no complete answer"):
            driver.continue_generation(timeout=0.5)
        delay[0] = 0.0
        driver.continue_generation(timeout=5)  # answered, over the caller's transport
        with httpx.Client(transport=transport) as other:  # and the caller's transport is still open for it
            assert other.post(f"{url}/x").status_code == 200
    finally:
        driver.close()
        server.shutdown()
