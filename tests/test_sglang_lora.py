"""LoRA refits into SGLang 0.5.23: the driver (`refit.drivers.sglang`, `refit.drivers.sglang_lora`)
against the emulated scheduler behind SGLang's own HTTP app, tokenizer-side LoRA code and
registry (tests/sglang_app.py: `TokenizerControlMixin`'s load, load-from-tensors and unload,
`TokenizerManager`'s per-request resolution, `LoRARegistry`'s counters). The oracle for what is
served is transformers + PEFT with the same adapter."""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import httpx
import pytest

from refit import invariants, protocol
from refit.errors import ConfigError
from refit.invariants.adapters import trace_adapter_moves
from refit.reference.model import ModelConfig
from refit.testing import check_lora_driver
from refit.testing.sglang_server import EmulatedSGLangEngine

from .lora_support import TARGETS, greedy, peft_model, train
from .sglang_app import SGLangAppServer

pytestmark = pytest.mark.e2e
LORA = {"max_lora_rank": 8, "lora_target_modules": TARGETS}
PROMPT = [1, 2, 3, 4]


def _engine(name: str = "s0", **kw: Any) -> EmulatedSGLangEngine:
    kw.setdefault("lora", LORA)
    kw.setdefault("config", ModelConfig(max_seq_len=4096))  # (room for a long request; same tokens as the PEFT model's)
    return EmulatedSGLangEngine.start(name, in_thread=True, server=SGLangAppServer, **kw)


def _ctx(model: Any, engines: list[Any], **kw: Any) -> protocol.RefitContext:
    from refit.drivers.lora_source import LoraSource
    from refit.drivers.sglang_transport import SGLangTensorTransport

    kw.setdefault("max_staleness", 1)
    kw.setdefault("verify", "off")
    kw.setdefault("deadline_s", 30)
    return protocol.RefitContext(LoraSource(model, name="policy"), SGLangTensorTransport(), engines, **kw)


def _listed(e: EmulatedSGLangEngine) -> list[str]:
    """The adapters SGLang's own /v1/models lists (its LoRA registry)."""
    return [c["id"] for c in httpx.get(e.url + "/v1/models", timeout=10).json()["data"][1:]]


def test_lora_refits_into_sglang_serve_each_version_and_unload_the_old_after_its_requests() -> None:
    """Four LoRA refits into two servers: each version is a name SGLang loads from tensors and
    serves by `lora_path`; tokens equal PEFT's under that version; a request started on v1 keeps
    v1 to its last token while v2 goes live, and the refit that pushes v1 out (max_staleness 1)
    waits in DRAINING for it (SGLang's unload answers when its requests have finished); the
    servers hold at most 2 versions; bytes moved are the adapter's; the trace checks clean."""
    model = peft_model()
    engines = [_engine("s0"), _engine("s1")]
    ctx = _ctx(model, engines)
    try:
        snaps = {1: train(model, 1)}
        first = protocol.run(ctx).raise_for_error()
        nbytes = sum(t.numel() * t.element_size() for t in snaps[1].values())
        assert first.bytes_moved == nbytes
        long = engines[0].submit(PROMPT, 1200, adapter="policy")  # pinned to v1 (its name) at admission
        ended: dict[str, float] = {}
        long.add_done_callback(lambda _: ended.setdefault("long", time.monotonic()))
        time.sleep(0.3)
        snaps[2] = train(model, 2)
        protocol.run(ctx).raise_for_error()
        assert _listed(engines[0]) == ["policy@v1", "policy@v2"]
        for e in engines:
            out = e.generate(PROMPT, 6, adapter="policy")
            assert out["adapter_version"] == 2 and out["output"] == greedy(model, snaps[2], PROMPT, 6)
        snaps[3] = train(model, 3)
        box: dict[str, Any] = {}

        def third() -> None:
            box["r"] = protocol.run(ctx)
            ended["third"] = time.monotonic()

        assert not long.done()
        worker = threading.Thread(target=third)
        worker.start()
        old = long.result(timeout=120)
        worker.join(timeout=120)
        result = box["r"].raise_for_error()
        # DRAINING: v1's unload answered only once the request on it had finished
        assert ended["third"] >= ended["long"] and result.phase_seconds.get("DRAINING", 0) > 0
        assert old["finish_reason"] == "length" and old["adapter_version"] == 1 and len(old["output"]) == 1200
        assert old["output"][:60] == greedy(model, snaps[1], PROMPT, 60)  # v1's tokens, though v2 went live
        assert result.bytes_moved == nbytes
        snaps[4] = train(model, 4)
        protocol.run(ctx).raise_for_error()
        for e in engines:
            assert _listed(e) == ["policy@v3", "policy@v4"]
            out = e.generate(PROMPT, 6, adapter="policy")
            assert out["adapter_version"] == 4 and out["output"] == greedy(model, snaps[4], PROMPT, 6)
        # a client naming an unloaded version gets SGLang's own refusal (its implicit reload of a
        # tensor adapter, path "__tensor__", cannot work), never the old weights
        stale = httpx.post(engines[0].url + "/generate", json={"input_ids": PROMPT, "lora_path": "policy@v1",
                           "sampling_params": {"max_new_tokens": 2}}, timeout=30)  # fmt: skip
        assert stale.status_code == 400 and "Failed to implicitly load LoRA adapter policy@v1" in stale.text
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
        moves = trace_adapter_moves(ctx.recorder.events)
        assert {m["event"] for m in moves["s0"]} >= {"stage", "complete", "publish", "supersede", "unload"}
    finally:
        ctx.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize(
    ("kw", "peft_kw", "needle"),
    [
        ({"max_staleness": 0}, {}, "needs max_staleness >= 1"),
        ({"max_staleness": None}, {}, "needs max_staleness >= 1"),
        ({"verify": "digest"}, {}, "reports no checksums of a loaded adapter"),
        ({}, {"use_rslora": True}, "SGLang scales every adapter by lora_alpha / r"),
        ({}, {"targets": ["q_proj", "o_proj"]}, "needs v_proj with it"),
        ({}, {"targets": ["k_proj", "v_proj"]}, "k or v without q"),
        ({}, {"targets": ["up_proj", "down_proj"]}, "only from gate_proj"),
    ],
)
def test_what_sglang_can_never_do_is_refused_when_the_context_is_made(kw: Any, peft_kw: Any, needle: str) -> None:
    e = _engine()
    try:
        with pytest.raises(ConfigError, match=needle):
            _ctx(peft_model(**peft_kw), [e], **kw)
        assert _listed(e) == []
    finally:
        e.close()


@pytest.mark.parametrize(
    ("lora", "peft_kw", "needle"),
    [
        (None, {}, "LoRA is not enabled on the server"),
        (LORA, {"r": 16}, "rank 16 is above the server's --max-lora-rank 8"),
        ({"max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}, {}, "outside the server's --lora-target"),
    ],
)
def test_what_this_server_cannot_load_fails_the_run_before_any_byte(lora: Any, peft_kw: Any, needle: str) -> None:
    """Known only from the server's /server_info: the run fails in CONNECTING or STAGING, nothing
    moved, nothing loaded, the lock free; the server serves on."""
    e = EmulatedSGLangEngine.start("s0", in_thread=True, server=SGLangAppServer, **({"lora": lora} if lora else {}))
    ctx = _ctx(peft_model(**peft_kw), [e])
    try:
        result = protocol.run(ctx)
        assert not result.ok and needle in str(result.error) and result.bytes_moved == 0
        assert _listed(e) == [] and ctx.lock.holder is None
        assert e.generate(PROMPT, 2)["output"]  # the base model serves on
    finally:
        ctx.close()
        e.close()


def _post_adapter(e: EmulatedSGLangEngine, name: str, targets: list[str]) -> httpx.Response:
    """A raw /load_lora_adapter_from_tensors of a PEFT adapter on `targets`, as any client sends it."""
    import peft

    from refit.drivers.flattened import flatten, serialize
    from refit.drivers.sglang_lora import load_body

    model = peft_model(targets=targets)
    tensors = list(peft.get_peft_model_state_dict(model).items())
    adapter = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    body = load_body(name, adapter, [base64.b64encode(serialize(flatten(tensors))).decode()])
    return httpx.post(e.url + "/load_lora_adapter_from_tensors", json=body, timeout=30)


def test_the_emulator_is_no_kinder_than_sglang_to_adapters_it_cannot_fuse() -> None:
    """SGLang fuses q/k/v only from q (v needed: else the load fails naming it) and gate/up only
    from gate; an adapter with k and v but no q loads (200) and kills the server at the first batch
    that uses it (mem_pool.py: get_target_module_name, uncaught)."""
    e = _engine()
    try:
        q_only = _post_adapter(e, "q-only", ["q_proj", "o_proj"])
        assert q_only.status_code == 400 and "v_proj.lora_A.weight" in q_only.json()["error_message"]
        kv = _post_adapter(e, "kv", ["k_proj", "v_proj"])
        assert kv.status_code == 200 and kv.json()["success"] is True
        assert e.generate(PROMPT, 2)["output"]  # the base model still serves
        with pytest.raises(httpx.TransportError):
            httpx.post(e.url + "/generate", json={"input_ids": PROMPT, "lora_path": "kv",
                       "sampling_params": {"max_new_tokens": 2}}, timeout=30)  # fmt: skip
    finally:
        e.close()


def test_a_load_that_lands_after_its_run_gave_up_is_unloaded_by_the_next_run() -> None:
    """A load that answers after its budget (a hang in the server) fails the run; SGLang still
    registers it when it completes (nothing cancels the handler). The next run finds it, never
    published, and unloads it before its own load: the server holds max_staleness + 1 versions."""
    from refit.protocol.faults import FaultPlan

    model = peft_model()
    e = _engine()
    ctx = _ctx(model, [e], call_timeout_s=1.0)
    try:
        protocol.run(ctx).raise_for_error()
        train(model, 2)
        ctx.faults = FaultPlan().fail_at("transferring", call="load", kind="hang")
        assert not protocol.run(ctx).ok
        ctx.faults = None
        deadline = time.monotonic() + 30
        while "policy@v2" not in _listed(e) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _listed(e) == ["policy@v1", "policy@v2"]  # landed late: loaded, never published
        for step in (3, 4):
            train(model, step)
            protocol.run(ctx).raise_for_error()
            assert len(_listed(e)) <= 2, _listed(e)
        # (the failed run spent version 2) the next run finds v2 loaded, never published, and unloads it
        assert ctx.published_version == 4 and _listed(e) == ["policy@v3", "policy@v4"]
        moves = trace_adapter_moves(ctx.recorder.events)["s0"]
        assert [m["event"] for m in moves if m["adapter_version"] == 2][-1] == "discard"  # never published
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        e.close()


def test_a_new_driver_never_serves_a_version_no_run_published() -> None:
    """A hung load leaves v3 loaded, never published. A new driver over the running server (a
    restarted trainer) cannot tell which listed version was published, so it takes none as live:
    requests naming the adapter are refused until a refit publishes one; that refit unloads the
    never-published v3 (its own name) and loads its own v3."""
    from refit.errors import EngineError
    from refit.protocol.faults import FaultPlan

    model = peft_model()
    e = _engine()
    ctx = _ctx(model, [e], call_timeout_s=1.0)
    try:
        for step in (1, 2):
            train(model, step)
            protocol.run(ctx).raise_for_error()
        train(model, 3)
        ctx.faults = FaultPlan().fail_at("transferring", call="load", kind="hang")
        assert not protocol.run(ctx).ok
        deadline = time.monotonic() + 30
        while "policy@v3" not in _listed(e) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "policy@v3" in _listed(e)
        ctx.close()
        fresh = EmulatedSGLangEngine("s0", e.server)  # a new driver (a restarted trainer), the same server
        with pytest.raises(EngineError, match="no version of adapter 'policy' is live"):
            fresh.generate(PROMPT, 4, adapter="policy")
        ctx = _ctx(model, [fresh], version=2)
        snap = train(model, 4)
        result = protocol.run(ctx).raise_for_error()
        out = fresh.generate(PROMPT, 6, adapter="policy")
        assert out["adapter_version"] == result.version == 3 and out["output"] == greedy(model, snap, PROMPT, 6)
        assert _listed(e) == ["policy@v2", "policy@v3"]
    finally:
        ctx.close()
        e.close()


def _through(e: EmulatedSGLangEngine, transport: httpx.BaseTransport) -> None:
    """The driver's HTTP clients (protocol and generation) go through `transport` from now on."""
    e._transport = transport
    e._http, e._serve_http = e._new_client(), e._new_client()


class _Partition(httpx.BaseTransport):
    """A network between a driver and its server that can be cut: while cut, every request fails
    to connect (httpx's ConnectError, as for a host that cannot be reached)."""

    def __init__(self) -> None:
        self.cut = False
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.cut:
            raise httpx.ConnectError(f"{request.url.host}: no route to host (partition)", request=request)
        return self._inner.handle_request(request)


def test_an_engine_the_run_cannot_reach_is_still_held_by_its_driver() -> None:
    """Two servers, max_staleness 1. s1's load fails in run 2 (it keeps v1, one behind); in run 3
    the network to s1 is cut and s0 publishes v3, so s1 would serve two behind. The run cannot
    reach s1, but the hold lives in its driver: once the network heals, requests naming the
    adapter on s1 are refused (never served by v1), and the refit that reaches it lifts it. Out
    of reach when only one behind, it is not held (its driver knows the version it serves)."""
    from refit.errors import EngineError
    from refit.protocol.faults import FaultPlan

    model = peft_model()
    engines = [_engine("s0"), _engine("s1")]
    net = _Partition()
    s1 = engines[1]
    _through(s1, net)
    ctx = _ctx(model, engines, retries=0)
    try:
        train(model, 1)
        protocol.run(ctx).raise_for_error()
        train(model, 2)
        ctx.faults = FaultPlan().fail_at("transferring", call="load", kind="raise", engine=1)
        r2 = protocol.run(ctx)
        assert (r2.engines["s0"].status, r2.engines["s1"].status) == ("updated", "unchanged")
        assert s1.generate(PROMPT, 3, adapter="policy")["adapter_version"] == 1  # one behind: it serves
        ctx.faults = None
        train(model, 3)
        net.cut = True
        r3 = protocol.run(ctx)
        net.cut = False
        assert r3.engines["s0"].status == "updated" and r3.engines["s1"].status == "failed"
        assert "its driver holds the adapter" in (r3.engines["s1"].error or "")
        assert engines[0].generate(PROMPT, 3, adapter="policy")["adapter_version"] == 3
        with pytest.raises(EngineError, match="held"):
            s1.generate(PROMPT, 3, adapter="policy")
        snap = train(model, 4)
        protocol.run(ctx).raise_for_error()
        for e in engines:
            out = e.generate(PROMPT, 6, adapter="policy")
            assert out["adapter_version"] == 4 and out["output"] == greedy(model, snap, PROMPT, 6)
        # out of reach again, but only one behind once v5 is out: its driver knows it serves v4, so no hold
        # (and a driver that knows no live version answers `live_adapter` with an EngineError: no crash)
        train(model, 5)
        net.cut = True
        r5 = protocol.run(ctx)
        net.cut = False
        assert r5.engines["s1"].status == "failed" and "holds the adapter" not in (r5.engines["s1"].error or "")
        assert s1.generate(PROMPT, 6, adapter="policy")["output"] == greedy(model, snap, PROMPT, 6)
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_a_run_that_cannot_reach_an_engine_from_its_first_run_still_returns() -> None:
    """An engine cut off from the first LoRA run on: its driver knows no live version (its
    `live_adapter` refuses with an EngineError), and the run still returns (s0 updated, s1
    failed) rather than raising while it settles. s1, one version behind (it has none), is within
    max_staleness 1: not held, and requests naming the adapter there are refused for want of a
    version until a refit reaches it."""
    from refit.errors import EngineError

    model = peft_model()
    engines = [_engine("s0"), _engine("s1")]
    net = _Partition()
    s1 = engines[1]
    _through(s1, net)
    net.cut = True
    ctx = _ctx(model, engines, retries=0)
    try:
        train(model, 1)
        r1 = protocol.run(ctx)
        assert (r1.engines["s0"].status, r1.engines["s1"].status) == ("updated", "failed")
        net.cut = False
        assert "holds the adapter" not in (r1.engines["s1"].error or "")
        with pytest.raises(EngineError, match="no version of adapter 'policy' is live here"):
            s1.generate(PROMPT, 3, adapter="policy")
        snap = train(model, 2)
        protocol.run(ctx).raise_for_error()
        assert s1.generate(PROMPT, 6, adapter="policy")["output"] == greedy(model, snap, PROMPT, 6)
    finally:
        ctx.close()
        for e in engines:
            e.close()


class _OmitAdapters(httpx.BaseTransport):
    """A proxy that, while `omit` is set, answers GET /v1/models with the base model's card only
    (a partial answer: the adapters left out) and passes everything else through."""

    def __init__(self) -> None:
        self.omit = 0  # answers left to cut
        self._inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if self.omit and request.url.path == "/v1/models":
            self.omit -= 1
            response.read()
            body = response.json()
            return httpx.Response(200, json={**body, "data": body["data"][:1]}, request=request)
        return response


def test_a_listing_that_leaves_versions_out_does_not_make_them_count_as_gone() -> None:
    """SGLang's /v1/models answer omits the loaded versions once (a proxy, a partial answer).
    The driver does not take them as gone on its word: it keeps them (the live one retired: no
    request names it until the next publish), they count against max_staleness + 1, and DRAINING
    unloads the one the publish pushes out by name, so the server never holds more than two
    versions; the trace records the moves and checks clean."""
    model = peft_model()
    e = _engine()
    proxy = _OmitAdapters()
    _through(e, proxy)
    ctx = _ctx(model, [e])
    try:
        for step in (1, 2):
            train(model, step)
            protocol.run(ctx).raise_for_error()
        assert _listed(e) == ["policy@v1", "policy@v2"]
        proxy.omit = 1
        snap = train(model, 3)
        protocol.run(ctx).raise_for_error()
        assert _listed(e) == ["policy@v2", "policy@v3"]  # v1 unloaded by name in DRAINING; v2 kept
        out = e.generate(PROMPT, 6, adapter="policy")
        assert out["adapter_version"] == 3 and out["output"] == greedy(model, snap, PROMPT, 6)
        moves = trace_adapter_moves(ctx.recorder.events)["s0"]
        assert [m["adapter_version"] for m in moves if m["event"] == "unload"] == [1]
        assert ("supersede", "not listed by the server") in [(m["event"], m.get("reason")) for m in moves]
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        e.close()


def test_a_version_sglang_is_still_unloading_is_asked_again_not_taken_as_gone() -> None:
    """A request pins v1; the run that must push v1 out (max_staleness 1) runs out of time in
    DRAINING, leaving SGLang's unload of v1 pending (unregistered, so /v1/models no longer lists
    it, but loaded until its request ends: SGLang's own `pending_lora_unloads`). The next run does
    not take v1 as gone: its DRAINING asks SGLang again, which answers once the request ended, and
    only then does v4 go live."""
    model = peft_model()
    e = _engine()
    ctx = _ctx(model, [e], deadline_s=2.0, cleanup_grace_s=1.0)
    try:
        for step in (1, 2):
            train(model, step)
            protocol.run(ctx).raise_for_error()
        long = e.submit(PROMPT, 3500, adapter="policy")  # pinned to v2
        ended: dict[str, float] = {}
        long.add_done_callback(lambda _: ended.setdefault("long", time.monotonic()))
        time.sleep(0.3)
        train(model, 3)
        protocol.run(ctx).raise_for_error()  # v3 live; v1 (no request) unloaded; v2 retired, pinned
        train(model, 4)
        r4 = protocol.run(ctx)  # must push v2 out: its request outlives the run's 2 s
        assert not r4.ok and not long.done()
        shim = e.server._shim
        assert "policy@v2" in shim.pending_lora_unloads and "policy@v2" not in _listed(e)
        ctx.deadline_s = 120.0
        snap = train(model, 5)
        r5 = protocol.run(ctx).raise_for_error()
        published = time.monotonic()
        assert long.done() and ended["long"] <= published and r5.phase_seconds.get("DRAINING", 0) > 0
        assert shim.pending_lora_unloads == {} and _listed(e) == ["policy@v3", f"policy@v{r5.version}"]
        # the trace never says v2 went while SGLang still held it: its unload is DRAINING's, once it answered
        v2 = [m for m in trace_adapter_moves(ctx.recorder.events)["s0"] if m["adapter_version"] == 2]
        assert [(m["event"], m.get("reason")) for m in v2][-1] == ("unload", None)
        out = e.generate(PROMPT, 6, adapter="policy")
        assert out["adapter_version"] == r5.version and out["output"] == greedy(model, snap, PROMPT, 6)
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        e.close()


class _OneRankOutOfMemory(SGLangAppServer):
    """A TP=2 server whose second rank runs out of memory loading `policy@v3`: the emulated
    scheduler (standing for rank 0) loads it, and the merged answer is the failure SGLang's
    tokenizer then sees from its ranks."""

    def op_lora_load_tensors(self, obj: Any) -> dict[str, Any]:
        res = super().op_lora_load_tensors(obj)
        if obj.lora_name == "policy@v3":
            return {**res, "success": False, "error_message": "rank 1: CUDA out of memory"}
        return res


def test_a_load_sglang_refused_after_a_rank_loaded_it_is_unloaded_by_the_failed_run() -> None:
    """SGLang answers 400 to a load some TP rank completed: its own tokenizer code keeps the name as
    an incomplete unload (`pending_lora_unloads`, "retry the unload") and the rank keeps the
    adapter. The failed run's discard retries that unload, so nothing stays half-loaded and the
    next runs load and serve as before."""
    model = peft_model()
    e = EmulatedSGLangEngine.start("s0", in_thread=True, server=_OneRankOutOfMemory, lora=LORA,
                                   config=ModelConfig(max_seq_len=4096))  # fmt: skip
    ctx = _ctx(model, [e], retries=0)
    try:
        for step in (1, 2):
            train(model, step)
            protocol.run(ctx).raise_for_error()
        train(model, 3)
        r3 = protocol.run(ctx)
        assert not r3.ok and "rank 1: CUDA out of memory" in str(r3.error)
        held = sorted(ref["name"] for ref in e.server.lora_refs.values())  # what the scheduler holds
        assert held == ["policy@v1", "policy@v2"] and e.server._shim.pending_lora_unloads == {}
        snap = train(model, 4)
        r4 = protocol.run(ctx).raise_for_error()
        out = e.generate(PROMPT, 6, adapter="policy")
        assert out["adapter_version"] == r4.version and out["output"] == greedy(model, snap, PROMPT, 6)
        v3 = [(m["event"], m.get("reason")) for m in trace_adapter_moves(ctx.recorder.events)["s0"]
              if m["adapter_version"] == 3]  # fmt: skip
        assert v3 == [("stage", None), ("discard", "its load was refused")]
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        e.close()


class _UnloadNeverAnswers(SGLangAppServer):
    """A server whose scheduler never answers the unload of `policy@v3` (until `release`)."""

    release = threading.Event()

    def op_lora_unload(self, obj: Any) -> Any:
        if obj.lora_name == "policy@v3":
            self.release.wait(60)
        return super().op_lora_unload(obj)


def test_an_unload_sglang_never_answers_is_named_by_the_runs_it_holds_up() -> None:
    """A failed run's discard of v3 gets no answer from SGLang's scheduler, and SGLang's adapter
    lock stays held behind it. Every later run ends inside its deadline, names that unload as
    what holds it up, and leaves v2 serving; once the unload answers, the next run recovers."""
    from refit.protocol.faults import FaultPlan

    model = peft_model()
    e = EmulatedSGLangEngine.start("s0", in_thread=True, server=_UnloadNeverAnswers, lora=LORA,
                                   config=ModelConfig(max_seq_len=4096))  # fmt: skip
    ctx = _ctx(model, [e], deadline_s=3.0, cleanup_grace_s=1.0)
    try:
        for step in (1, 2):
            train(model, step)
            protocol.run(ctx).raise_for_error()
        train(model, 3)
        ctx.faults = FaultPlan().fail_at("draining", call="drain", kind="raise")
        assert not protocol.run(ctx).ok  # its discard of v3 does not answer
        ctx.faults = None
        for step in (4, 5):
            train(model, step)
            t0 = time.monotonic()
            r = protocol.run(ctx)
            assert not r.ok and time.monotonic() - t0 < 3.0 + 1.0 + 1.0
            assert "policy@v3" in str(r.error) and "SGLang answers an unload once" in str(r.error), r.error
            assert e.generate(PROMPT, 2, adapter="policy")["adapter_version"] == 2
        _UnloadNeverAnswers.release.set()
        time.sleep(0.5)
        snap = train(model, 6)
        r6 = protocol.run(ctx).raise_for_error()
        out = e.generate(PROMPT, 6, adapter="policy")
        assert out["adapter_version"] == r6.version and out["output"] == greedy(model, snap, PROMPT, 6)
        assert len(_listed(e)) <= 2
    finally:
        _UnloadNeverAnswers.release.set()
        ctx.close()
        e.close()


def test_the_plan_is_checked_against_the_adapter_before_sglang_sees_it() -> None:
    """SGLang checks shapes only when a batch first uses an adapter (and dies on a wrong one): the
    driver checks the plan's names, ranks and per-layer shapes itself (`plan_problem`)."""
    from refit.buckets import BucketManifest, TensorEntry, TensorMeta
    from refit.drivers.sglang_lora import plan_problem

    def plan(shapes: dict[str, tuple[int, int]]) -> list[BucketManifest]:
        entries = tuple(TensorEntry(TensorMeta(n, "float32", s), 0) for n, s in shapes.items())
        return [BucketManifest(0, entries, 0)]

    stem = "base_model.model.model.layers.{}.self_attn.{}.lora_{}.weight"
    good = {stem.format(i, p, ab): (4, 64) if ab == "A" else (64, 4) for i in (0, 1) for p in ("q_proj", "v_proj")
            for ab in "AB"}  # fmt: skip
    spec = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    assert plan_problem(spec, plan(good)) is None
    missing = {k: v for k, v in good.items() if k != stem.format(1, "v_proj", "B")}
    assert "layer 1: v_proj.lora_B missing" in str(plan_problem(spec, plan(missing)))
    wrong = {**good, stem.format(1, "q_proj", "A"): (4, 7)}
    assert "differ between layers" in str(plan_problem(spec, plan(wrong)))
    rank = {**good, stem.format(0, "q_proj", "B"): (64, 8)}
    assert "no rank-4 lora_B" in str(plan_problem(spec, plan(rank)))
    stray = {**good, stem.format(0, "o_proj", "A"): (4, 64)}
    assert "not an A or B of a targeted projection" in str(plan_problem(spec, plan(stray)))


def test_a_load_sglang_cannot_decode_kills_the_server_and_the_run_ends_inside_its_deadline() -> None:
    """A payload SGLang's scheduler cannot decode raises outside any handler
    (tp_worker.py deserialize_own_rank): the server dies. The run fails with the engine lost,
    within its deadline; the next run finds nothing listening and says so."""
    from refit.protocol.faults import FaultPlan

    model = peft_model()
    e = _engine()
    ctx = _ctx(model, [e])
    try:
        protocol.run(ctx).raise_for_error()
        train(model, 2)
        ctx.faults = FaultPlan().fail_at("transferring", call="load", kind="kill")
        t0 = time.monotonic()
        result = protocol.run(ctx)
        assert not result.ok and time.monotonic() - t0 < 30
        assert result.engines["s0"].status == "failed"
        ctx.faults = None
        again = protocol.run(ctx)
        assert not again.ok and "s0" in str(again.error)
    finally:
        ctx.close()
        e.close()


def test_the_sglang_driver_passes_the_lora_kit() -> None:
    """`refit.testing.check_lora_driver` on the SGLang driver against SGLang's own app: LoRA refits
    with raise, corrupt or hang in each state and requests in flight; what each server serves is
    checked against PEFT per version (max_staleness 1 or 2: SGLang refuses 0 and None)."""
    from refit.drivers.sglang_transport import SGLangTensorTransport

    check_lora_driver(_engine, max_examples=3, staleness=(1, 2), transport=SGLangTensorTransport, verify="off")
