"""Engine driver for an SGLang server, over its HTTP API (httpx).

One driver per server (one engine, however many TP ranks). The server's version decides what it
can do; the driver learns it once, in its first probe, into a `Capabilities` record, and every
version difference is read from that record (never from scattered version checks).

Lifecycle, per state (each step is one HTTP call; SGLang has no batch route):
  first engine call       probe(target): reads only, never a call that takes the model's writer
                          lock (that would stall live generation): GET /server_info (version),
                          then the weight version (GET /model_info; older servers
                          /get_weight_version); refuses with `version_ahead` when the server
                          already holds the target. Restarts are seen here, by the label: SGLang
                          exposes no identity (`startup_time` is a dict of startup durations), but
                          a restarted server comes back at its launch label ("default"), so a label
                          other than the one this driver last read or set means a new server (a new
                          incarnation: nothing of ours is released, no group, no session); so
                          is a server that answers again after a call found nothing listening. A
                          label that changed while the driver holds memory released is refused
                          (`memory_unknown`: a wrong guess kills SGLang; `set_released` says which).
                          At first contact GET /ready: a server found paused (a crashed trainer
                          mid-update?) is reported not serving, so it is never continued on
                          whatever it holds; so is one whose update this driver opened and never
                          completed.
  OFFLOADING (colocated)  resume_memory(["weights"]): POST /resume_memory_occupation {"tags"}, only
                          for tags this driver released (or was told were released: `released=`);
                          SGLang's scheduler raises, and the server dies, on a tag never released.
  CONNECTING              attach(info): nothing for tensors (each payload carries its handles);
                          broadcast: POST /init_weights_update_group while the trainer joins.
  PAUSING                 pause(mode): POST /pause_generation {"mode"} (abort | retract; in_place
                          keeps KV computed by the old weights and SGLang cannot flush it, so
                          refit refuses it).
  INVALIDATING            flush(): POST /flush_cache (refused while requests hold KV);
                          begin(plan): POST /begin_weight_update {} (>= 0.5.21); a session a crashed
                          run left open ("already open") is ended here, now that the engine is
                          paused, and begun again. The plan is kept here (SGLang's session names none).
  TRANSFERRING            load(payload): POST /update_weights_from_tensor (flattened_bucket, one
                          base64 entry per TP rank) or /update_weights_from_distributed (while the
                          trainer broadcasts), always flush_cache=false and abort_all_requests=false:
                          invalidation is the protocol's own step. A tensor load that raises in
                          SGLang's scheduler (a wrong name or shape) kills the server: the call
                          loses its connection and the engine is lost (EngineDied), never continued.
  POST_PROCESSING         finalize(): POST /end_weight_update {}; refused as `incomplete` unless
                          every planned bucket was acknowledged.
  VERIFYING (verify on)   verify("sglang/tp<N>" on the host, "sglang-cuda/tp<N>" on CUDA): POST
                          /weights_checker {"action": "checksum", "selector": "target"}: SGLang's
                          own checksum of each parameter of its fused layout on every TP rank
                          (`refit.drivers.sglang_checksums`; on CUDA its Triton hash, reproduced by
                          `refit.drivers.sglang_tile_hash`), for the trainer's to match.
  CONTINUING              publish(v): refused here unless the session acked every bucket and
                          finalized (SGLang's label checks nothing), then POST
                          /update_weight_version {"new_version", "abort_all_requests": false}
                          (its default aborts every request in flight); continue_generation():
                          POST /continue_generation {}, after resuming the KV memory if the
                          driver released it (SGLang's continue checks nothing).
  RESTORING (colocated)   resume_memory(["kv_cache"]): POST /resume_memory_occupation with tags
                          kv_cache and cuda_graph (the graphs go with the KV cache, as slime does),
                          those of them released.
  QUARANTINING            quarantine(reason): POST /pause_generation {"mode": "abort"}, then POST
                          /end_weight_update {} (a session left open would fail the next begin):
                          it stays paused (requests wait, none is served) until a refit completes.
  abort before pausing    release_memory(["weights"]) (SGLang asserts the engine is idle).
  disconnect              detach(): broadcast: POST /destroy_weights_update_group.

LoRA refits (`serves_adapters`; a `LoraSource`, max_staleness >= 1, verify off, one bucket): each
version is its own SGLang adapter name ("policy@v7", `refit.drivers.sglang_lora`); nothing pauses.
  CONNECTING              probe(target, adapter): GET /server_info (--enable-lora, --max-lora-rank,
                          --lora-target-modules), GET /v1/models (the versions loaded, folded into
                          the driver's `AdapterMirror`); the live version is the adapter's.
  STAGING                 stage(plan, kind, adapter): refuses what SGLang cannot load or serve as
                          the trainer does (rsLoRA, a rank or module the server's pool lacks, more
                          than one bucket, verify on); unloads a version a failed run left loaded.
  TRANSFERRING            load(payload): POST /load_lora_adapter_from_tensors {lora_name:
                          "policy@vN", config_dict, one flattened bucket per TP rank}: servable at
                          once to a request naming it; refit's own requests name the live one only.
  DRAINING                drain(hold_s): POST /unload_lora_adapter for each version the publish
                          would push past max_staleness + 1 (SGLang unregisters the name at once and
                          answers when its requests have finished; asked again until it has).
  CONTINUING              publish(v): the driver's live version becomes vN (no HTTP call: SGLang
                          has no notion of it); generate(adapter=...) sends lora_path "policy@vN".
  failure path            discard(): POST /unload_lora_adapter of the version this run loaded (or
                          found loaded after a load that timed out); quarantine(reason, True,
                          adapter) holds the adapter in this driver only: SGLang cannot hold a
                          name, so a client naming a version itself is still served.

Errors name the engine, the call, the route and the HTTP status: a timeout is `TimeoutError`, a
refused connection `EngineDied`, a connection lost before an answer `connection_lost` (unknown
effect; `EngineDied` when the server then refuses connections: SGLang's scheduler crashed), 401/403
`unauthorized`, 404 `unsupported`, 400 with SGLang's validation body (`"object": "error"`) or 422
`bad_request` (no effect), a 400 from an update `refused` (effect unknown) unless SGLang says nothing
ran (`no_session`) or that weights changed (not flushed, or partially updated: `state_unknown`,
poison, never success), 5xx `server_error`.
"""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest
from refit.drivers.base import ConnectInfo, PauseMode, Payload
from refit.drivers.http import HttpEngineDriver, label_version, message_of, token_versions, version_tuple
from refit.drivers.sglang_lora import (
    load_body,
    plan_problem,
    server_lora,
    server_problem,
    static_problem,
    version_name,
)
from refit.errors import EngineDied, EngineError
from refit.states import Adapter

if TYPE_CHECKING:
    import httpx
    import torch

DEFAULT_TIMEOUT = 60.0
# SGLang 0.5.23's texts (managers/scheduler_components/weight_updater.py, model_runner_components/weight_updater.py)
WEIGHTS_UPDATED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
PARTIALLY_UPDATED = "are partially updated"
NO_SESSION_TEXTS = ("must run between begin_weight_update", "no weight-update session is open")
# Routes SGLang guards with --api-key only (no @auth_level(ADMIN_OPTIONAL) in entrypoints/http_server.py)
NORMAL_ROUTES = frozenset(
    {"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/models"}
)
UNLOAD_POLL_S = 0.25  # DRAINING: the least one unload call waits for SGLang's answer before asking again


SAY_WHICH = (
    "Say which: engine.set_released([...]) with what is released on the server now, or "
    "engine.set_released([], restarted=True) after a restart"
)


@dataclass(frozen=True)
class Capabilities:
    """What one SGLang server can do, read once from its version (anchor-engine-apis.md, 1.1).

    session             begin/end_weight_update exist and tensor/distributed updates need them (0.5.21+)
    flush_while_paused  a flush succeeds while paused with retracted requests waiting (0.5.21+):
                        `retract` is usable
    pause_modes         modes /pause_generation takes (abort, retract, in_place from 0.5.6)
    version_route       where the weight version is read: /model_info (0.5.6+; /get_weight_version
                        answers 404 from 0.5.12) or /get_weight_version (0.5.2 .. 0.5.6)
    flattened_bytes     flattened buckets are uint8 with byte offsets (0.5.6+)
    flush_failure_fatal a refused flush inside an update kills the scheduler (<= 0.5.21); refit
                        never asks an update to flush, so this is only reported
    version_spans       a request that straddled an update carries per-token weight_versions spans
                        (read in 0.5.23: utils/weight_versions.py add_weight_versions_to_meta_info),
                        so one without them was sampled under its one label; for an older server
                        refit does not rely on that (a commit point inside the request: unknown)
    """

    version: str | None
    session: bool
    flush_while_paused: bool
    pause_modes: frozenset[str]
    version_route: str
    flattened_bytes: bool
    flush_failure_fatal: bool
    version_spans: bool = True

    @classmethod
    def of(cls, version: str | None) -> Capabilities:
        """The record for a server version; an unknown version is taken as the newest known."""
        v = version_tuple(version) or (0, 5, 23)
        return cls(
            version=version,
            session=v >= (0, 5, 21),
            flush_while_paused=v >= (0, 5, 21),
            pause_modes=frozenset({"abort", "retract", "in_place"}) if v >= (0, 5, 6) else frozenset({"abort"}),
            version_route="/model_info" if v >= (0, 5, 6) else "/get_weight_version",
            flattened_bytes=v >= (0, 5, 6),
            flush_failure_fatal=v <= (0, 5, 21),
            version_spans=v >= (0, 5, 23),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "session": self.session, "flush_while_paused": self.flush_while_paused,
            "pause_modes": sorted(self.pause_modes), "version_route": self.version_route,
            "flattened_bytes": self.flattened_bytes, "flush_failure_fatal": self.flush_failure_fatal,
            "version_spans": self.version_spans,
        }  # fmt: skip


# ---- request bodies ----------------------------------------------------------------------------


def _b64(data: bytes | str) -> str:
    return data if isinstance(data, str) else base64.b64encode(data).decode("ascii")


def tensor_update_body(
    serialized_per_tp_rank: Sequence[bytes | str], *, weight_version: str | int | None = None, flush_cache: bool = False
) -> dict[str, Any]:
    """`/update_weights_from_tensor` body for already-serialized flattened buckets (one per TP rank)."""
    body: dict[str, Any] = {
        "serialized_named_tensors": [_b64(d) for d in serialized_per_tp_rank],
        "load_format": "flattened_bucket",
        "flush_cache": bool(flush_cache),
        "abort_all_requests": False,
    }
    if weight_version is not None:
        body["weight_version"] = str(weight_version)
    return body


def update_weights_from_tensor_body(
    per_tp_rank_named_tensors: Sequence[Sequence[tuple[str, torch.Tensor]]],
    *,
    weight_version: str | int | None,
    flush_cache: bool = False,
) -> dict[str, Any]:
    """The JSON body of SGLang's `POST /update_weights_from_tensor` for one bucket: for each engine
    TP rank, its named tensors flattened into one uint8 buffer (SGLang 0.5.23's `flattened_bucket`
    layout: byte offsets, every offset aligned for its dtype) and serialized on its own (one export
    per consumer), base64 for HTTP. CPU tensors are shared by name (any local process can open
    them); CUDA tensors as IPC handles. `flush_cache` stays False in a refit: flushing is the
    protocol's invalidate step."""
    from refit.drivers.flattened import flatten, serialize

    if not per_tp_rank_named_tensors:
        raise ValueError("update_weights_from_tensor_body: give one list of named tensors per engine TP rank")
    serialized = [serialize(flatten(list(named))) for named in per_tp_rank_named_tensors]
    return tensor_update_body(serialized, weight_version=weight_version, flush_cache=flush_cache)


def distributed_update_body(manifest: BucketManifest, *, group_name: str, load_format: str | None) -> dict[str, Any]:
    """`/update_weights_from_distributed` body for one bucket, in the order the trainer broadcasts."""
    body: dict[str, Any] = {
        "names": [e.meta.name for e in manifest.entries],
        "dtypes": [e.meta.dtype for e in manifest.entries],
        "shapes": [list(e.meta.shape) for e in manifest.entries],
        "group_name": group_name,
        "flush_cache": False,
        "abort_all_requests": False,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


# ---- the driver --------------------------------------------------------------------------------


class SGLangEngine(HttpEngineDriver):
    """One SGLang server, driven over HTTP. See the module docstring for the route per state."""

    supports_in_place_pause = False  # in_place keeps old-weight KV and SGLang refuses to flush it
    no_in_place = (
        "SGLang 0.5.23's Scheduler.flush_cache (managers/scheduler.py) refuses while requests run, so requests "
        "held in place keep its radix cache, and requests started after the update would reuse prefixes cached "
        "under the old weights"
    )
    transports = frozenset({"sglang_tensor", "sglang_broadcast"})
    holds_requests = True  # a hold pauses keeping the requests (quarantine's keep_requests)
    no_stage = (
        "SGLang 0.5.23 writes every update into the live model (model_runner_components/weight_updater.py: "
        "update_weights_from_tensor, _from_distributed and _from_disk end in model.load_weights) and has no "
        "second copy to stage into and swap"
    )
    memory_tags = frozenset({"weights", "kv_cache", "cuda_graph"})
    serves_adapters = True  # LoRA refits: a version per adapter name (see the module docstring)
    adapter_transports = frozenset({"sglang_tensor"})  # an adapter loads from tensors, one request

    def __init__(
        self,
        name: str,
        url: str,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        tp: int = 1,
        weights_cpu_backup: bool = False,
        released: Sequence[str] = (),
        checksums: bool = False,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """`url`: the server's base URL. `api_key`: the server's --api-key, if it set one (sent on
        every route). `admin_api_key`: its --admin-api-key, if it set one (sent instead on the weight
        and control routes, which SGLang guards with it). `tp`: its TP size (one payload entry per
        TP rank). `weights_cpu_backup`: the server runs with --enable-weights-cpu-backup (released
        weights come back intact). `released`: memory tags already released on the server when
        refit takes it (release through `release_memory` instead, and the driver knows): SGLang
        dies resuming a tag not released. `checksums`: verify by SGLang's own /weights_checker
        checksums (`digest_kinds`), for a server that keeps the weights as it loaded them: on the
        host (not CUDA), without AMX weight packing (an Intel CPU with AMX repacks linear weights
        after loading), heads and intermediate size dividing by its TP size (a CPU server pads
        them otherwise), in the dtype the trainer sends; anything else fails every verification."""
        super().__init__(name, url, api_key=api_key, tp=tp, transport=transport)
        self.weights_cpu_backup = weights_cpu_backup
        self._admin = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else None
        self.capabilities: Capabilities | None = None
        self._label: Any = None  # the weight-version label this driver last read or set
        self._restarts = 0
        self._unanswered: set[str] = set()  # adapter names whose unload (ours) has not answered yet
        self._unsure: str | None = None  # why which memory is released is not known (set_released clears it)
        self._restarted_since_attach = False
        self._server_tp: Any = None  # the server's tp_size, as its /server_info reports it
        self._server_device: Any = None  # its device ("cpu", "cuda", ...), as /server_info reports it
        self._server_offloads = False  # it keeps some weights on the host (CPU offload)
        self._server_attn_dp: str | None = None  # its attention data-parallel setting, when it has one
        self.checksums = checksums
        self._attached: ConnectInfo | None = None
        self._released: set[str] = set(self._server_tags(released))
        self._lora_args: dict[str, Any] = {}  # the server's LoRA settings, from /server_info
        self._read_capabilities(5.0)

    def _read_capabilities(self, timeout: float) -> None:
        """The server's version and TP size, read once here so the first refit connects once; a
        server not up yet (or one this driver cannot use) is read by the first probe instead, which
        says why."""
        with contextlib.suppress(TimeoutError, EngineDied, EngineError, ValueError):
            self._read_server_info(timeout)

    # ---- capabilities -------------------------------------------------------------------------

    @property
    def digest_kinds(self) -> frozenset[str]:  # type: ignore[override]
        """SGLang's own checksums (`refit.drivers.sglang_checksums`), from a 0.5.23+ server (whose
        /weights_checker the mapping was read from): "sglang/tp<N>" on the host, "sglang-cuda/tp<N>"
        on CUDA (its Triton hash, `refit.drivers.sglang_tile_hash`)."""
        if self.no_digests is not None:
            return frozenset()
        from refit.drivers.sglang_checksums import kind_for

        return frozenset({kind_for(self._tp, self._server_device)})

    @property
    def no_digests(self) -> str | None:
        """Why this driver reports no digests (None: it does)."""
        caps = self.capabilities
        if not self.checksums:
            return "SGLang's checksums are used only when asked: SGLangEngine(..., checksums=True), see its docstring"
        if caps is None:
            return f"the server at {self.url} has not answered /server_info yet"
        if (version_tuple(caps.version) or (0, 5, 23)) < (0, 5, 23):
            return f"SGLang {caps.version}: /weights_checker as refit maps it is 0.5.23's"
        from refit.drivers.sglang_checksums import SGLANG_DEVICES

        if self._server_device not in SGLANG_DEVICES:
            where, mapped = self._server_device, sorted(SGLANG_DEVICES)
            return f"the server runs on {where!r}: refit maps SGLang's checksums on {mapped} only"
        if self._server_offloads and self._server_device != "cpu":
            return (
                "the server offloads weights to the host (--cpu-offload-gb or --offload-group-size): SGLang hashes "
                "those on the host and the rest on the GPU, a mix refit does not map"
            )
        if self._server_attn_dp is not None:
            return (
                f"the server runs attention data-parallel ({self._server_attn_dp}): SGLang then splits the embedding "
                "(and a DP LM head) over the attention-TP group, not tp_size (models/qwen2.py, models/llama.py), a "
                "vocabulary split refit does not map"
            )
        return None

    @property
    def pause_modes(self) -> frozenset[str]:  # type: ignore[override]
        caps = self.capabilities or Capabilities.of(None)
        modes = set(caps.pause_modes) - {"in_place"}  # in_place keeps old-weight KV: refit refuses it
        if not caps.flush_while_paused:
            modes.discard("retract")  # the waiting queue blocks the flush before 0.5.21
        return frozenset(modes)

    @property
    def incarnation(self) -> str:
        return f"{self.name}@{self.url}#{self._restarts}"

    def _route_headers(self, route: str) -> dict[str, str] | None:
        return None if route in NORMAL_ROUTES else self._admin

    # ---- HTTP errors --------------------------------------------------------------------------

    def _confirms(self, route: str, data: Any) -> bool:
        return isinstance(data, dict) and data.get("success") is True  # SGLang's update answers carry it

    def _error(self, method: str, route: str, call: str, status: int, data: Any, *, update: bool) -> EngineError:
        message = message_of(data)
        text = f"engine {self.name}: {method} {route} ({call}) -> HTTP {status}: {message}"
        if status in (401, 403):
            return EngineError("unauthorized", f"{text} (the admin API key is missing or wrong)")
        if status == 404:
            return EngineError("unsupported", f"{text} (this server has no such route)")
        if status == 422 or (status == 400 and isinstance(data, dict) and data.get("object") == "error"):
            return EngineError("bad_request", f"{text} (SGLang refused the request body; nothing ran)")
        if status >= 500:
            return EngineError("server_error", text)
        if WEIGHTS_UPDATED_NOT_FLUSHED in message or PARTIALLY_UPDATED in message:
            return EngineError("state_unknown", f"{text} (the weights changed)")
        if any(t in message for t in NO_SESSION_TEXTS):
            return EngineError("no_session", text)
        if "already" in message.lower() and route == "/begin_weight_update":
            return EngineError("session_open", text)
        if route == "/flush_cache":
            return EngineError("flush_refused", text)
        return EngineError("refused" if update else "server_refused", text)

    # ---- protocol calls -----------------------------------------------------------------------

    def probe(self, target_version: int, adapter: str | None = None, *, timeout: float) -> dict[str, Any]:
        """Reads only (see the module docstring): version, label; a changed label is a restart.
        `adapter` (a LoRA refit): that adapter's live version instead (`_probe_adapter`)."""
        self._adapter_run = None
        if adapter is not None:
            return self._probe_adapter(target_version, adapter, timeout)
        end = time.monotonic() + timeout
        left = lambda: end - time.monotonic()  # noqa: E731
        if self._unsure is not None:
            raise EngineError("memory_unknown", f"engine {self.name}: {self._unsure}. {SAY_WHICH}")
        if self.capabilities is None:
            self._read_server_info(left())
        label = self._read_version(self._caps(), left())
        first = self._label is None  # first contact (or after an unknown label): what is it doing?
        if self._gone and not first and str(label) == str(self._label):
            # it refused a connection and answers with the label it had: a dropped connection (a
            # proxy) or a restart that kept its label; only what we released can tell them apart
            if self._released:
                raise EngineError(
                    "memory_unknown",
                    f"engine {self.name}: the server at {self.url} refused a connection and answers again with the "
                    f"weight version it had ({label!r}), while this driver holds {sorted(self._released)} released: "
                    f"the same process behind a dropped connection, or a restart that kept its label. {SAY_WHICH}",
                )
            self._gone = False  # nothing of ours to lose either way: taken as the same process
        elif self._gone or (not first and str(label) != str(self._label)):
            if self._released and not self._gone:  # a restart or another client's label: SGLang dies on a wrong guess
                raise EngineError(
                    "memory_unknown",
                    f"engine {self.name}: the server at {self.url} reports weight version {label!r} where this driver "
                    f"last saw {self._label!r}, while it holds {sorted(self._released)} released: a restarted server "
                    "has nothing released, and SGLang's scheduler dies resuming a tag it never released (or loading "
                    f"into released memory). {SAY_WHICH}",
                )
            self._new_process()  # gone and back under another label, or relabelled with nothing released
            self._read_server_info(left())  # a relaunch may run another version or TP size
        self._check_tp()
        caps = self._caps()
        self._label = label
        if self._restarted_since_attach and self._attached is not None:
            self._restarted_since_attach = False
            if self._attached.kind == "sglang_broadcast":  # tensor payloads need no server-side setup
                self._attached = None
                raise EngineError(
                    "restarted",
                    f"engine {self.name}: the server at {self.url} restarted (its weight version is now {label!r}, "
                    "or it had stopped answering) and lost its weight-update group; the next refit connects it again",
                )
        if first and self._paused(left()):  # left paused by someone (a crashed trainer mid-update?)
            self._ledger.taint()
        else:
            self._ledger.reset()
        version = label_version(label)
        if version is not None and version >= target_version:
            raise EngineError(
                "version_ahead",
                f"engine {self.name} holds weight version {label!r}, the refit targets {target_version}",
                {"version": version},
            )
        return {
            "version": version,
            "serving": self._quarantined is None and not self._ledger.dirty,
            "server_version": caps.version,
        }

    def _read_server_info(self, timeout: float) -> None:
        """GET /server_info (older servers /get_server_info): the version and the TP size."""
        end = time.monotonic() + timeout
        status, info = self._request("GET", "/server_info", "probe", timeout=timeout)
        if status == 404:
            status, info = self._request("GET", "/get_server_info", "probe", timeout=end - time.monotonic())
        if status >= 300 or not isinstance(info, dict):
            raise self._error("GET", "/server_info", "probe", status, info, update=False)
        self.capabilities = self._supported(Capabilities.of(info.get("version")))
        self._server_tp = info.get("tp_size")
        self._server_device = info.get("device")
        # weights offloaded to the host (exec.offload: --cpu-offload-gb, --offload-group-size) are
        # hashed there (sha256) while the rest are hashed on the GPU: a mix refit does not map
        gb, group = info.get("cpu_offload_gb") or 0, info.get("offload_group_size") or -1
        self._server_offloads = (isinstance(gb, int | float) and gb > 0) or (isinstance(group, int) and group > 0)
        self._server_attn_dp = attention_dp(info)
        self._lora_args = server_lora(info)

    def _check_tp(self) -> None:
        """One payload entry per TP rank: a driver built with fewer than the server has makes a rank
        index past the list, which SGLang's scheduler answers by dying (deserialize_own_rank)."""
        tp = self._server_tp
        if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
            raise EngineError(
                "misconfigured", f"engine {self.name}: the server at {self.url} reports tp_size {tp!r}, not a TP size"
            )
        if tp is not None and tp != self._tp:
            raise EngineError(
                "misconfigured",
                f"engine {self.name}: the server runs tp_size {tp}, this driver was built with "
                f"tp={self._tp}: SGLangEngine(..., tp={tp})",
            )

    def _new_process(self) -> None:
        """A new server process at this URL: its checkpoint's weights, nothing released, no session,
        no group, no quarantine of ours."""
        self._restarts += 1
        self._gone = False
        self._released = set()
        self._quarantined = None
        self._ledger.vouch()
        self._restarted_since_attach = self._attached is not None

    def set_released(self, tags: Sequence[str], *, restarted: bool = False) -> None:
        """Tell the driver which memory tags are released on the server now (memory released by
        another client, or `[]` after a restart it could not tell from a relabel), and accept the
        label it shows. `restarted=True` says the server is a new process (a new incarnation: no
        group, no session, no quarantine of ours). Call it between runs, never while a run holds
        the engine (the run reads the released set as it goes; nothing refuses a call mid-run)."""
        if restarted:
            self._new_process()
            self.capabilities = None  # a relaunch may run another version or TP size: read again
        self._released = set(self._server_tags(tags))
        self._label = None
        self._gone = False
        self._unsure = None

    def _paused(self, timeout: float) -> bool:
        """GET /ready: 503 while SGLang is paused (TokenizerManager.is_ready), a read."""
        status, _ = self._request("GET", "/ready", "probe", timeout=timeout)
        return status == 503

    def _supported(self, caps: Capabilities) -> Capabilities:
        if not caps.flattened_bytes:
            raise EngineError(
                "unsupported",
                f"engine {self.name}: SGLang {caps.version} reads flattened buckets in element offsets; refit's "
                "flattened_bucket wire format needs SGLang 0.5.6 or newer",
            )
        return caps

    def _read_version(self, caps: Capabilities, timeout: float) -> Any:
        data = self._call("GET", caps.version_route, "probe", timeout=timeout)
        return data.get("weight_version") if isinstance(data, dict) else data

    @staticmethod
    def _server_tags(tags: Sequence[str]) -> list[str]:
        """SGLang's memory tags for refit's: the CUDA graphs go with the KV cache (they are captured
        against it; slime and miles release and resume them together)."""
        out = list(tags)
        if "kv_cache" in out and "cuda_graph" not in out:
            out.append("cuda_graph")
        return out

    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]:
        """Resume the tags this driver knows are released (SGLang dies on any other)."""
        wanted = self._server_tags(tags)
        send = [t for t in wanted if t in self._released]
        if send:
            self._call("POST", "/resume_memory_occupation", "resume_memory", timeout=timeout, body={"tags": send})
        resumed = [t for t in tags if t in self._released]
        intact = self.weights_cpu_backup or "weights" not in self._released
        self._released -= set(send)
        return {"weights_intact": intact, "resumed": resumed}

    def release_memory(self, tags: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Release memory (SGLang asserts the engine is idle: pause it, or drain it, first)."""
        send = [t for t in self._server_tags(tags) if t not in self._released]
        if send:
            self._call("POST", "/release_memory_occupation", "release_memory", timeout=timeout, body={"tags": send})
        self._released |= set(send)

    def attach(self, info: ConnectInfo, *, timeout: float) -> None:
        if info.kind not in self.transports:
            raise EngineError(
                "bad_request", f"engine {self.name}: SGLang receives {sorted(self.transports)}, not {info.kind!r}"
            )
        if len(info.parts) != self._tp:
            raise EngineError(
                "bad_request",
                f"engine {self.name}: connect info has {len(info.parts)} TP parts, this driver was built with "
                f"tp={self._tp}",
            )
        self._restarted_since_attach = False
        if info.kind == "sglang_broadcast":
            f = info.fields
            body = {
                "master_address": f["addr"], "master_port": int(f["port"]), "rank_offset": int(f["rank_offset"]),
                "world_size": int(f["world"]), "group_name": f["group"], "backend": f["backend"],
            }  # fmt: skip
            try:
                self._call("POST", "/init_weights_update_group", "attach", timeout=timeout, body=body)
            except EngineError as exc:
                raise EngineError("rendezvous", exc.message) from exc
        self._attached = info

    def detach(self, *, timeout: float) -> None:
        info, self._attached = self._attached, None
        if info is not None and info.kind == "sglang_broadcast":
            self._call(
                "POST",
                "/destroy_weights_update_group",
                "detach",
                timeout=timeout,
                body={"group_name": info.fields["group"]},
            )

    def pause(self, mode: PauseMode, *, timeout: float) -> None:
        if mode not in self.pause_modes:
            raise EngineError("bad_request", f"engine {self.name}: pause mode {mode!r} is not usable on this server")
        self._call("POST", "/pause_generation", "pause", timeout=timeout, body={"mode": mode})

    def flush(self, *, timeout: float) -> None:
        self._call("POST", "/flush_cache", "flush", timeout=timeout)

    def begin(self, plan: Sequence[BucketManifest], *, timeout: float) -> None:
        end = time.monotonic() + timeout
        self._ledger.opening()
        if self._caps().session:
            try:
                self._call("POST", "/begin_weight_update", "begin", timeout=timeout, body={}, update=True)
            except EngineError as exc:
                if exc.kind != "session_open":
                    raise
                # a session a crashed run left open: end it now that the engine is paused (its weights
                # are all replaced below), then begin again
                self._call("POST", "/end_weight_update", "begin", timeout=end - time.monotonic(), body={}, update=True)
                self._call(
                    "POST", "/begin_weight_update", "begin", timeout=end - time.monotonic(), body={}, update=True
                )
        self._ledger.begin(plan)

    def load(self, payload: Payload, *, timeout: float) -> None:
        if self._adapter_run is not None:
            self._load_adapter(payload, timeout)
            return
        manifest = payload.manifest
        self._ledger.check_load(payload, attached=self._attached.kind if self._attached else None, tp=self._tp)
        if payload.kind == "sglang_tensor":
            body = tensor_update_body([p["serialized"] for p in payload.parts])
            route = "/update_weights_from_tensor"
        else:
            body = distributed_update_body(
                manifest, group_name=payload.fields["group_name"], load_format=payload.fields.get("load_format")
            )
            route = "/update_weights_from_distributed"
        self._call("POST", route, "load", timeout=timeout, body=body, update=True)
        self._ledger.ack(manifest.index)

    def verify(self, kind: str | None, probe: Sequence[Any] | None = None, *, timeout: float) -> dict[str, Any]:
        """VERIFYING: POST /weights_checker {"action": "checksum", "selector": "target"}, SGLang's
        checksum of every parameter on every TP rank, as {"<param>@tp<rank>": checksum}."""
        from refit.drivers import sglang_checksums

        return self._checksums(
            kind, probe, "/weights_checker", {"action": "checksum", "selector": "target"}, sglang_checksums.reported,
            "SGLang cannot be probed while paused", timeout=timeout,
        )  # fmt: skip

    def finalize(self, *, timeout: float) -> None:
        run = self._adapter_run
        if run is not None:  # the load was the whole adapter, in one request
            if self._lora.state(run["name"], run["version"]) != Adapter.STAGED:
                raise EngineError("incomplete", f"engine {self.name}: adapter {run['name']!r} v{run['version']} "
                                  "was not loaded")  # fmt: skip
            return
        plan = self._ledger.close()
        if self._caps().session:
            self._call("POST", "/end_weight_update", "finalize", timeout=timeout, body={}, update=True)
        self._ledger.complete(plan)

    def publish(self, version: int, *, timeout: float) -> dict[str, Any] | None:
        if self._adapter_run is not None:
            return self._publish_adapter(version, timeout)
        self._ledger.require_complete("SGLang")
        end = time.monotonic() + timeout
        body = {"new_version": str(version), "abort_all_requests": False}
        before = self._read_version(self._caps(), timeout)  # the label must still be the one the probe read
        was = self._label
        if was is not None and str(before) != str(was):
            # restarted (back at its launch weights) or relabelled by another client since the probe:
            # what this run sent may be gone; a label now would name weights the server may not hold
            if self._released:
                self._unsure = (
                    f"the server's weight version changed from {was!r} to {before!r} during a refit while "
                    f"this driver held {sorted(self._released)} released"
                )
            else:
                self._new_process()
            self._label = before
            raise EngineError(
                "state_unknown",
                f"engine {self.name}: the server at {self.url} reports weight version {before!r} before publish, "
                f"where this run's probe read {was!r}: it restarted or another client relabelled "
                "it, and the weights this run sent may be gone; not published",
            )
        try:
            self._call("POST", "/update_weight_version", "publish", timeout=end - time.monotonic(), body=body)
        except BaseException:
            self._label = None  # it may or may not have taken the label: no restart can be read from it
            raise
        label = self._label = self._read_version(self._caps(), end - time.monotonic())
        if str(label) != str(version):  # SGLang answered success: a label it did not set is a lie we must not pass on
            raise EngineError(
                "state_unknown", f"engine {self.name}: published version {version}, but the server reports {label!r}"
            )
        self._ledger.published()
        self._quarantined = None
        return None

    def continue_generation(self, *, timeout: float) -> None:
        """Continue, with the KV memory back first if this driver released it: SGLang's
        continue_generation checks nothing, and its scheduler would run requests in released KV."""
        self._check_serving()
        if self._adapter_run is not None:  # a LoRA refit paused nothing
            return
        end = time.monotonic() + timeout
        if "kv_cache" in self._released:
            self.resume_memory(["kv_cache"], timeout=timeout)
        self._call("POST", "/continue_generation", "continue_generation", timeout=end - time.monotonic(), body={})
        self._ledger.vouch()  # the runner continues only weights a version names

    def quarantine(
        self, reason: str, keep_requests: bool = False, adapter: str | None = None, *, timeout: float
    ) -> None:
        """Stop serving (pause, aborting what runs) and close any update session this run left open
        (a later begin would fail on it); the server stays paused until a refit completes. A hold
        (`keep_requests`, the version policy's STALE) pauses with "retract" instead where the server
        has it: SGLang keeps the requests queued, their KV recomputed once generation continues
        (managers/scheduler.py `pause_generation`); this driver refuses new ones meanwhile.
        `adapter` (a LoRA refit's version policy): that adapter alone, in this driver (its staged
        version unloaded): `generate(adapter=...)` refuses until a refit publishes one here."""
        if adapter is not None:
            self._hold_adapter(adapter, reason, timeout)
            return
        end = time.monotonic() + timeout
        self._quarantined = reason
        self._ledger.reset()
        mode = "retract" if keep_requests and "retract" in self.pause_modes else "abort"  # (0.5.21+: retract)
        self._call("POST", "/pause_generation", "quarantine", timeout=timeout, body={"mode": mode})
        if self._caps().session:  # paused now: closing a session takes no lock from generation
            status, data = self._request(
                "POST", "/end_weight_update", "quarantine", timeout=end - time.monotonic(), body={}
            )
            err = self._error("POST", "/end_weight_update", "quarantine", status, data, update=False)
            if status >= 300 and err.kind != "no_session":
                raise err
            if status < 300 and not self._confirms("/end_weight_update", data):
                raise err

    # ---- LoRA refits (see the module docstring; the pure half is refit.drivers.sglang_lora) ----------

    def no_adapter(self, adapter: dict[str, Any], *, verify: str, max_live: int | None) -> str | None:
        """What no SGLang server can do for this LoRA refit (checked when a run starts)."""
        return static_problem(adapter, verify=verify, max_live=max_live)

    def _probe_adapter(self, target: int, adapter: str, timeout: float) -> dict[str, Any]:
        """Reads only: /server_info (its LoRA settings; refused without --enable-lora) and
        /v1/models, folded into the mirror. The version is the adapter's live one (0: none)."""
        end = time.monotonic() + timeout
        self._read_server_info(timeout)
        self._check_tp()
        if not self._lora_args.get("enable_lora"):
            raise EngineError("unsupported", f"engine {self.name}: LoRA is not enabled on the server at {self.url}: "
                              "launch it with --enable-lora --max-lora-rank R --lora-target-modules ...")  # fmt: skip
        listed = self._listed_versions(adapter, "probe", end - time.monotonic())
        return {**self._adapter_probed(target, adapter, listed), "server_version": self._caps().version}

    def stage(
        self, plan: Sequence[BucketManifest], digest: str | None = None, adapter: dict[str, Any] | None = None,
        *, timeout: float,
    ) -> None:  # fmt: skip
        """A LoRA refit's STAGING (SGLang has no staged copy of its weights: `no_stage`)."""
        if adapter is None:
            raise EngineError("unsupported", f"engine {self.name}: {self.no_stage}")
        end = time.monotonic() + timeout
        name, version, max_live = str(adapter["name"]), int(adapter["version"]), adapter.get("max_live")
        problem = static_problem(adapter, verify="off" if digest is None else "digest", max_live=max_live)
        problem = problem or server_problem(adapter, self._lora_args, len(plan))
        if problem is not None:
            raise EngineError("unsupported", f"engine {self.name}: {problem}")
        problem = plan_problem(adapter, plan)
        if problem is not None:
            raise EngineError("bad_manifest", f"engine {self.name}: {problem}")
        leftovers = [
            v for v in self._lora.loaded(name) if self._lora.state(name, v) == Adapter.STAGED or v == version
        ]  # a failed run's, never published; one under this run's name (adopted from a crashed trainer's run)
        for v in leftovers:
            if not self._unload(name, v, "stage", timeout=end - time.monotonic(), reason="a failed run left it loaded"):
                raise TimeoutError(
                    f"engine {self.name}: unloading {version_name(name, v)} (loaded, never published, left by a "
                    "failed run) did not answer (SGLang answers an unload once the requests on its version end)"
                )
        self._lora.stage(name, version, max_live)
        self._adapter_run = {**adapter, "name": name, "version": version}

    def _load_adapter(self, payload: Payload, timeout: float) -> None:
        run = self._adapter_run
        assert run is not None
        if payload.kind != "sglang_tensor":
            raise EngineError("bad_payload", f"engine {self.name}: SGLang loads an adapter from tensors: a LoRA refit "
                              f"into it takes SGLangTensorTransport, not {payload.kind!r}")  # fmt: skip
        name = version_name(run["name"], run["version"])
        body = load_body(name, run, [_b64(p["serialized"]) for p in payload.parts])
        try:
            self._lora_call("/load_lora_adapter_from_tensors", "load", body, timeout)
        except EngineError as exc:  # refused: some TP ranks may hold it all the same (see `discard`)
            run["refused"] = exc.message
            raise
        self._lora.complete(run["name"], run["version"])

    def _lora_call(self, route: str, call: str, body: dict[str, Any], timeout: float) -> None:
        """One LoRA route: 200 {"success": true} or 400 {"success": false, "error_message"}
        (nothing changed: SGLang registers a name only on success, and unregisters it only when
        its unload is under way). A call that times out while an unload this driver sent has not
        answered says so: SGLang runs adapter loads and unloads one at a time, under one lock
        (tokenizer_control_mixin.py: `lora_update_lock`), which that unload holds until the
        requests on its version end."""
        try:
            status, data = self._request("POST", route, call, timeout=timeout, body=body)
        except TimeoutError as exc:
            waiting = sorted(self._unanswered - {body.get("lora_name")})
            if not waiting:
                raise
            raise TimeoutError(
                f"{exc} (behind SGLang's adapter lock, held by the unload of {', '.join(waiting)} this driver sent "
                "earlier: it answers once the requests on that version end)"
            ) from exc
        if status < 300 and isinstance(data, dict) and data.get("success") is True:
            return
        text = data.get("error_message") if isinstance(data, dict) and data.get("error_message") else message_of(data)
        where = f"engine {self.name}: POST {route} ({call}, {body.get('lora_name')!r}) -> HTTP {status}: {text}"
        if status in (401, 403):
            raise EngineError("unauthorized", f"{where} (the admin API key is missing or wrong)")
        if status == 404:
            raise EngineError("unsupported", f"{where} (this server has no such route)")
        if status >= 500 or status < 300:
            raise EngineError("server_error", where)
        raise EngineError("bad_request", where)

    def _unload(self, adapter: str, version: int, call: str, *, timeout: float, reason: str | None = None) -> bool:
        """POST /unload_lora_adapter for one version: True once SGLang has unloaded it (it answers
        when the requests using it have finished); False if that takes longer than `timeout` (it
        goes on: the name is unregistered; asked again, SGLang waits for the same unload). Recorded
        as an unload (or a discard, for a version never published)."""
        name = version_name(adapter, version)
        try:
            self._lora_call("/unload_lora_adapter", call, {"lora_name": name}, timeout)
        except TimeoutError:
            self._unanswered.add(name)  # it may hold SGLang's adapter lock until it answers (`_lora_call`)
            return False
        except EngineError as exc:  # "does not exist": an earlier unload of ours finished meanwhile
            self._unanswered.discard(name)
            if exc.kind != "bad_request" or "does not exist" not in exc.message:
                raise
            if version in self._listed_versions(adapter, call, max(timeout, 1.0)):
                raise
        self._unanswered.discard(name)
        if self._lora.state(adapter, version) in (Adapter.STAGING, Adapter.STAGED):
            self._lora.discard(adapter, version, reason=reason or "discarded")
        elif self._lora.state(adapter, version) is not None:
            self._lora.unload(adapter, version, **({"reason": reason} if reason else {}))
        return True

    def drain(self, hold_s: float, *, timeout: float) -> dict[str, Any]:
        """DRAINING: unload each version the publish would push past max_staleness + 1 (never the
        live one: max_staleness >= 1). SGLang answers an unload when the version's requests have
        finished; one still waiting when the call's time is nearly up leaves this answer not ready
        (asked again)."""
        run = self._adapter_run
        if run is None or self._lora.state(run["name"], run["version"]) != Adapter.STAGED:
            raise EngineError("not_ready", f"engine {self.name}: drain without a loaded LoRA refit")
        end = time.monotonic() + timeout
        for v in self._lora.going(run["name"]):
            # one unload request per drain call, waiting as long as the call may (each one abandoned
            # stays queued in SGLang behind its update lock, to answer "does not exist" to nobody)
            self._unload(run["name"], v, "drain", timeout=max(UNLOAD_POLL_S, end - time.monotonic() - 0.25))
        going = self._lora.going(run["name"])
        return {"ready": not going, "pinned": None, "going": going, "adapter_moves": self._lora.report()}

    def discard(self, *, timeout: float) -> dict[str, Any]:
        """A LoRA refit that will not publish: unload the version it loaded (no request of refit's
        names it), after asking the server whether a load that did not answer went in."""
        run = self._adapter_run
        if run is None:
            raise EngineError("unsupported", f"engine {self.name}: {self.no_stage}")
        name, version = run["name"], run["version"]
        end = time.monotonic() + timeout
        if self._lora.state(name, version) == Adapter.STAGING:
            if version not in self._listed_versions(name, "discard", timeout):
                if run.get("refused"):  # a load SGLang refused after some TP ranks loaded it: it keeps
                    # the name as an incomplete unload (tokenizer_control_mixin.py, load_lora_adapter_from_tensors:
                    # pending_lora_unloads), the ranks' copies held until an unload of the name is retried
                    if not self._unload(name, version, "discard", timeout=end - time.monotonic(),
                                        reason="its load was refused"):  # fmt: skip
                        raise TimeoutError(f"engine {self.name}: unloading {version_name(name, version)} after its "
                                           "refused load did not answer")  # fmt: skip
                    return {"discarded": True, "adapter_moves": self._lora.report()}
                self._lora.discard(name, version, reason="its load did not complete")
                return {"discarded": True, "adapter_moves": self._lora.report()}
            self._lora.complete(name, version)
        if self._lora.state(name, version) == Adapter.STAGED:
            if not self._unload(name, version, "discard", timeout=end - time.monotonic(), reason="its run failed"):
                raise TimeoutError(f"engine {self.name}: unloading {version_name(name, version)} did not answer")
            return {"discarded": True, "adapter_moves": self._lora.report()}
        return {"discarded": False, "adapter_moves": self._lora.report()}

    def _caps(self) -> Capabilities:
        if self.capabilities is None:
            raise EngineError("not_probed", f"engine {self.name}: probe the server before any other call")
        return self.capabilities

    # ---- serving ------------------------------------------------------------------------------

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, adapter: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> dict[str, Any]:  # fmt: skip
        """Greedy generation through POST /generate: {"output", "weight_versions" (one per token)}.
        Refused (EngineError "quarantined") while this driver holds the engine out of service: the
        server itself would only queue the request until a refit continues it. `adapter`: a LoRA
        refit's adapter: the request names its live version (`lora_path`), and the answer says
        which ("adapter", "adapter_version")."""
        self._check_serving()
        body: dict[str, Any] = {
            "input_ids": list(prompt),
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
        }
        live = None if adapter is None else self.live_adapter(adapter)
        if adapter is not None:
            body["lora_path"] = version_name(adapter, live)
        changes = self._ledger.changes
        data = self._call("POST", "/generate", "generate", timeout=timeout, body=body, serving=True)
        meta = data.get("meta_info") or {}
        output = [int(t) for t in data.get("output_ids") or []]
        reason = meta.get("finish_reason")
        out: dict[str, Any] = {
            "output": output,
            "prompt": list(prompt),
            "finish_reason": reason.get("type") if isinstance(reason, dict) else reason,
            "num_retractions": int(meta.get("num_retractions") or 0),
        }
        # spans only for a request that straddled an update (0.5.23): one without was sampled under its
        # label; from an older server, the label holds per token only where no commit point of this
        # driver fell inside the request
        spans = self.capabilities is not None and self.capabilities.version_spans
        changed = not spans and self._ledger.changes != changes
        versions = token_versions(meta.get("weight_versions"), meta.get("weight_version"), len(output), changed=changed)
        if versions is not None:
            out["weight_versions"] = versions
        if adapter is not None:
            out["adapter"], out["adapter_version"] = adapter, live
        return out

    def info(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        """The weight version, the capabilities, and each adapter's versions as this driver knows them."""
        caps = self.capabilities or Capabilities.of(None)
        return {
            "version": label_version(self._read_version(caps, timeout)), "capabilities": caps.as_dict(),
            "adapters": self._lora.describe(), "adapters_held": dict(self._adapter_held),
        }  # fmt: skip


# ---- refit doctor (read only) ------------------------------------------------------------------

DOCTOR_READS = ("/server_info", "/model_info", "/openapi.json")
ROUTES_ALWAYS = ("/pause_generation", "/continue_generation", "/flush_cache", "/update_weight_version", "/model_info")
ROUTES_SESSION = ("/begin_weight_update", "/end_weight_update")
ROUTES_COLOCATED = ("/update_weights_from_tensor",)
ROUTES_MEMORY = ("/release_memory_occupation", "/resume_memory_occupation")
ROUTES_BROADCAST = ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")


def attention_dp(info: dict[str, Any]) -> str | None:
    """The server's attention data-parallel setting, in words (None: it runs none): 0.5.23's
    --attn-dp-size N (the deprecated --dp-size N --enable-dp-attention resolves to it) or
    --enable-dp-lm-head, as its /server_info reports them."""
    size = info.get("attn_dp_size")
    if isinstance(size, int) and size > 1:
        return f"attn_dp_size {size}"
    if info.get("enable_dp_attention"):
        return "enable_dp_attention"
    if info.get("enable_dp_lm_head"):
        return "enable_dp_lm_head"
    return None


def diagnose(answers: dict[str, Any], *, admin_key: bool) -> tuple[str | None, list[Any], list[Any]]:
    """`refit doctor` for an SGLang server, from the answers to `DOCTOR_READS` (no I/O): its
    version, the routes and server flags refit needs, and which modes and transports will work.
    `admin_key`: the caller has an admin key (which no read-only route can check)."""
    from refit.diagnosis import Finding, verdicts

    modes = [
        ("colocated", "SGLangTensorTransport(device='cuda')"),
        ("disaggregated", "SGLangBroadcastTransport(backend='nccl')"),
    ]
    info = answers["/server_info"]
    if info.status in (401, 403):
        fix = "--api-key KEY (SGLangEngine(api_key=...))"
        finding = Finding("auth", "fail", "the server refused /server_info: it was started with --api-key", fix)
        return None, [finding], verdicts(modes, [finding])
    data = info.data if info.status == 200 and isinstance(info.data, dict) else None
    if data is None or not isinstance(data.get("version"), str) or "tp_size" not in data:
        got = info.status or info.error
        finding = Finding(
            "server info",
            "fail",
            f"GET /server_info -> {got}: not SGLang's server info",
            "check the URL; a vLLM server: --engine vllm",
        )
        return None, [finding], verdicts(modes, [finding])
    version = data["version"]
    caps = Capabilities.of(version)
    findings: list[Finding] = []
    if not caps.flattened_bytes:
        findings.append(
            Finding(
                "version",
                "fail",
                f"SGLang {version} reads flattened buckets in element offsets: refit needs 0.5.6 or newer",
                "SGLang 0.5.21 or newer",
            )
        )
    elif not caps.session:
        findings.append(
            Finding(
                "version",
                "warn",
                f"SGLang {version}: no begin/end session (before 0.5.21), each "
                "update post-processes alone; retract, refit's default pause, is not usable",
                "RefitContext(pause_mode='abort'), or SGLang 0.5.21 or newer",
            )
        )
    else:
        findings.append(Finding("version", "ok", f"SGLang {version}"))
    model = answers["/model_info"]
    label = model.data.get("weight_version") if model.status == 200 and isinstance(model.data, dict) else None
    if label is not None:
        findings.append(Finding("weight version", "ok", f"the server labels its weights {label!r}"))
    else:
        findings.append(Finding("weight version", "warn", f"GET /model_info -> {model.status or model.error}"))
    api = answers["/openapi.json"]
    paths = api.data.get("paths") if api.status == 200 and isinstance(api.data, dict) else None
    listed = set(paths) if isinstance(paths, dict) else None
    needed = {
        "all": ROUTES_ALWAYS + (ROUTES_SESSION if caps.session else ()),
        "colocated": ROUTES_COLOCATED,
        "disaggregated": ROUTES_BROADCAST,
        "memory": ROUTES_MEMORY,
    }
    missing = {k: [r for r in v if listed is not None and r not in listed] for k, v in needed.items()}
    route_fix = "an SGLang build with the weight-update API (0.5.21+)"
    if listed is None:
        findings.append(
            Finding(
                "routes",
                "warn",
                "the server does not list its routes (/openapi.json: "
                f"{api.status or api.error}); assumed from its version",
            )
        )
    elif missing["all"]:
        findings.append(Finding("routes", "fail", f"missing: {missing['all']}", route_fix))
    elif any(missing.values()):
        findings.append(
            Finding("routes", "warn", f"missing: {sorted({r for v in missing.values() for r in v})}", route_fix)
        )
    else:
        findings.append(Finding("routes", "ok", "every route refit calls is served"))
    dp = data.get("dp_size") or 1
    if dp != 1:
        findings.append(
            Finding(
                "data parallel",
                "fail",
                f"dp_size {dp}: SGLang's tokenizer manager asserts dp_size == 1 for weight updates",
                "one server per DP replica, each its own refit engine",
            )
        )
    elif (attn := attention_dp(data)) is not None:
        findings.append(
            Finding(
                "data parallel",
                "warn",
                f"attention data-parallel ({attn}): its checksums split the vocabulary over the attention-TP group, "
                "which refit does not map (SGLangEngine(..., checksums=True) reports no digests)",
                "verify='probe' (or 'off') against this server",
            )
        )
    else:
        findings.append(Finding("data parallel", "ok", "dp_size 1"))
    cache = data.get("weight_cache_mode", "off")
    if cache not in (None, "off"):
        findings.append(
            Finding(
                "weight cache",
                "fail",
                f"--weight-cache-mode {cache}: SGLang refuses weight updates",
                "--weight-cache-mode off",
            )
        )
    else:
        findings.append(Finding("weight cache", "ok", "off"))
    tp = data.get("tp_size")
    if isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1:
        findings.append(Finding("tensor parallel", "ok", f"tp_size {tp}: SGLangEngine(..., tp={tp})"))
    else:  # the driver refuses it too (misconfigured): one payload entry per TP rank needs the count
        findings.append(
            Finding("tensor parallel", "fail", f"tp_size {tp!r} is not a TP size", "check the server's --tp-size")
        )
    if (data.get("pp_size") or 1) != 1:
        findings.append(
            Finding(
                "pipeline parallel",
                "warn",
                f"pp_size {data['pp_size']}: refit has not been run against pipeline-parallel SGLang",
            )
        )
    saver = bool(data.get("enable_memory_saver"))
    if saver:
        findings.append(
            Finding(
                "memory saver",
                "ok",
                "--enable-memory-saver: a colocated trainer can borrow the engine's weight and KV memory",
            )
        )
    else:
        findings.append(
            Finding(
                "memory saver",
                "warn",
                "without --enable-memory-saver, release/resume free nothing: "
                "a colocated trainer cannot borrow the engine's GPU memory",
                "--enable-memory-saver",
            )
        )
    if data.get("enable_weights_cpu_backup"):
        findings.append(
            Finding(
                "weights backup",
                "ok",
                "--enable-weights-cpu-backup: released weights come back "
                "intact (SGLangEngine(weights_cpu_backup=True))",
            )
        )
    if not admin_key:
        findings.append(
            Finding(
                "admin key",
                "warn",
                "not checked: no read-only route takes it; if the server was "
                "started with --admin-api-key, refit's first pause is refused without it",
                "--admin-api-key KEY here, SGLangEngine(admin_api_key=...) in the run",
            )
        )
    usable = sorted(caps.pause_modes - {"in_place"} - (set() if caps.flush_while_paused else {"retract"}))
    findings.append(Finding("pause modes", "ok", f"{usable} (in_place keeps old-weight KV: refused by refit)"))
    extra = {
        "colocated": missing["colocated"] + (missing["memory"] if saver else []),
        "disaggregated": missing["disaggregated"],
    }
    return (
        version,
        findings,
        verdicts(modes, findings, {m: (f"routes missing: {r}" if r else "") for m, r in extra.items()}),
    )
