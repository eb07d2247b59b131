"""Engine driver for a vLLM server's weight-transfer API (vLLM 0.33; `VLLM_SERVER_DEV_MODE=1`).

One driver per server (one engine, however many workers). The server's version is read once
(`GET /version`) into a `Capabilities` record; every version difference is read from it.

Lifecycle, per state (each step is one HTTP call; vLLM has no batch route):
  first engine call       probe(target): the weight version (GET /weight_info); a label back at
                          "default" after this driver published one, or a server answering again
                          after a call found nothing listening, means it restarted (refused as
                          `restarted` when a transfer engine was attached: the next refit
                          reconnects); `version_ahead` when it already holds the target. At first
                          contact GET /is_paused: a server found paused (a crashed trainer
                          mid-update?) is reported not serving, so it is never continued on
                          whatever it holds; so is one whose update this driver opened and never
                          completed.
  OFFLOADING (colocated)  resume_memory(["weights"]): POST /wake_up?tags=weights, only for what the
                          driver released (a wake_up that leaves nothing asleep resumes the
                          scheduler, which would undo a pause or a quarantine).
  CONNECTING              attach(info): POST /init_weight_transfer_engine {"init_info"} (NCCL:
                          while the trainer's group forms; IPC: {"packed": true}).
  PAUSING                 pause(mode): abort -> POST /pause?mode=abort; retract -> mode=keep (frozen
                          requests keep their place; the flush below drops their KV, recomputed
                          after the resume under the new weights). Always clear_cache=false: the
                          parameter is deprecated in 0.33 (its /pause docstring), and the cache
                          is the flush's job. in_place (keep without the flush) would serve
                          old-weight KV and is refused; wait drains instead of pausing.
  INVALIDATING            flush(): POST /reset_prefix_cache?reset_running_requests=true ({"success"}:
                          preempts running and frozen requests, their KV dropped), then POST
                          /reset_encoder_cache (a multimodal encoder's outputs are weight-dependent;
                          vLLM resets neither on its own after an update, vllm#46125);
                          begin(plan): POST /start_weight_update; a session a crashed run left open
                          ("already active") is finished first, then started again.
  TRANSFERRING            load(payload): POST /update_weights {"update_info": names, dtype_names,
                          shapes (+ IPC handles and tensor_sizes)}, always full metadata (an empty
                          list means "reuse the last", which a restarted server does not have).
                          start_weight_update moved every layer to the meta device (vLLM's
                          layerwise reload; `begin_moves_weights`): from `begin` on, the engine
                          holds no usable weights until a complete update finishes, so any
                          failed load is `state_unknown` (quarantined, never continued).
  POST_PROCESSING         finalize(): POST /finish_weight_update {} (no version: publishing is its
                          own step); refused as `incomplete` unless every planned bucket was acked.
  VERIFYING               verify(kind): POST /weight_checker {"action": "checksum"} (0.33+, with
                          checksums=True): vLLM's sha256 of every parameter of its fused layout on
                          every worker (`refit.drivers.vllm_checksums`), for the trainer's to match;
                          answered while paused. No probe (a paused server answers 503).
  CONTINUING              publish(v): refused here unless the session acked every bucket and
                          finished, then POST /update_weight_version {"new_version"};
                          continue_generation(): POST /resume, after waking the KV memory if the
                          driver released it (/resume unpauses whatever sleeps).
  RESTORING (colocated)   resume_memory(["kv_cache"]): POST /wake_up?tags=kv_cache&tags=scheduling.
  QUARANTINING            quarantine(reason): POST /pause?mode=abort&clear_cache=false (new
                          requests get 503 until a refit completes; its refit flushes), and
                          finish any open session.
  abort before pausing    release_memory(["weights"]): POST /sleep?level=2 (level=1 when the
                          server keeps a CPU copy of its weights).
  disconnect              detach(): POST /shutdown_weight_transfer_engine.

LoRA refits (`serves_adapters`; a `LoraSource` over shared memory, max_staleness >= 1, verify off):
each version is its own vLLM adapter name ("policy@v7") in its own directory; nothing pauses.
  CONNECTING              probe(target, adapter): GET /server_info?config_format=json (lora_config,
                          VLLM_ALLOW_RUNTIME_LORA_UPDATING), GET /v1/models (the versions loaded);
                          attach(shm): the driver maps the trainer's shared memory itself (no call).
  STAGING                 stage(plan, kind, adapter): refuses what the server cannot load; unloads
                          a version a failed run left loaded.
  TRANSFERRING            load(payload): the driver reads the bucket out of shared memory.
  POST_PROCESSING         finalize(): writes <lora_dir>/policy@vN/ (adapter_config.json,
                          adapter_model.safetensors), then POST /v1/load_lora_adapter {lora_name,
                          lora_path} (never load_inplace: vLLM keeps the prefix cache of the name).
  DRAINING                drain(hold_s): POST /v1/unload_lora_adapter for each version past
                          max_staleness + 1 (vLLM removes the name; requests already running keep
                          it until they end, the engine evicting its weights later).
  CONTINUING              publish(v): the driver's live version becomes vN (no call);
                          generate(adapter=...) sends model "policy@vN".
  failure path            discard(): POST /v1/unload_lora_adapter of a version this run loaded.

vLLM reports every worker-side failure as HTTP 500 with `error.message` "Call to collective_rpc
method failed: <why>"; the driver maps the known reasons: "must be called before" and "without a
matching start" (`no_session`), "already active" (`session_open`), "Invalid update_info" /
"Invalid init_info" (`bad_payload`), all refused before anything changed; "without
VLLM_ALLOW_INSECURE_SERIALIZATION=1" (`misconfigured`: IPC handles travel pickled over HTTP, and
vLLM refuses to unpickle them unless the server was started with that variable); any other 500 is
`server_error` (effect unknown). 400 is `bad_request`, 503 `paused`, a timeout `TimeoutError`, a
refused connection `EngineDied`, a connection lost before an answer
`connection_lost` (unknown effect).
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest
from refit.drivers.adapter_names import version_name
from refit.drivers.base import ConnectInfo, PauseMode, Payload
from refit.drivers.http import (
    DEFAULT_TIMEOUT,
    HttpEngineDriver,
    label_version,
    message_of,
    version_tuple,
    versions_per_token,
)
from refit.errors import EngineDied, EngineError
from refit.states import Adapter

if TYPE_CHECKING:
    import httpx


@dataclass(frozen=True)
class Capabilities:
    """What one vLLM server's weight-transfer API offers, read once from its version
    (anchor-engine-apis.md, 2.1).

    session          start/finish_weight_update exist (0.22+)
    start_body       start_weight_update's body: {"is_checkpoint_format": true} in 0.22-0.27, none after
    packed_in_init   packed and its buffer sizes travel in init_info (0.28+; update_info before)
    weight_version   /weight_info and /update_weight_version exist (0.28+)
    """

    version: str | None
    session: bool
    start_body: dict[str, Any] | None
    packed_in_init: bool
    weight_version: bool

    @classmethod
    def of(cls, version: str | None) -> Capabilities:
        v = version_tuple(version) or (0, 33, 0)
        return cls(
            version=version,
            session=v >= (0, 22, 0),
            start_body={"is_checkpoint_format": True} if (0, 22, 0) <= v < (0, 28, 0) else None,
            packed_in_init=v >= (0, 28, 0),
            weight_version=v >= (0, 28, 0),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "session": self.session, "start_body": self.start_body,
            "packed_in_init": self.packed_in_init, "weight_version": self.weight_version,
        }  # fmt: skip


# ---- request bodies ----------------------------------------------------------------------------


def nccl_init_info(fields: dict[str, Any]) -> dict[str, Any]:
    """`init_info` for vLLM's NCCL engine (exactly its 8 keys; any other key is an HTTP 500)."""
    return {
        "master_address": fields["addr"],
        "master_port": int(fields["port"]),
        "rank_offset": int(fields["rank_offset"]),
        "world_size": int(fields["world"]),
        "packed": bool(fields["packed"]),
        "packed_buffer_size_bytes": int(fields["packed_buffer_size_bytes"]),
        "packed_num_buffers": int(fields["packed_num_buffers"]),
    }


def update_info(manifest: BucketManifest, parts: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`update_info` for one bucket, with full metadata; with `parts` (IPC, packed) one handle per
    engine TP rank's device, pickled and base64 as vLLM's HTTP client sends them, and the byte size
    of each tensor in the buffer."""
    info: dict[str, Any] = {
        "names": [e.meta.name for e in manifest.entries],
        "dtype_names": [e.meta.dtype for e in manifest.entries],
        "shapes": [list(e.meta.shape) for e in manifest.entries],
    }
    if parts is not None:
        handles = {p["device"]: p["args"] for p in parts}
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
        info["tensor_sizes"] = [e.meta.nbytes for e in manifest.entries]
    return info


# ---- the driver --------------------------------------------------------------------------------


class VLLMEngine(HttpEngineDriver):
    """One vLLM server, driven over HTTP. See the module docstring for the route per state."""

    supports_in_place_pause = False  # keep without clearing the cache serves old-weight KV
    no_in_place = (
        "vLLM 0.33's Scheduler.reset_prefix_cache (v1/core/sched/scheduler.py) clears the prefix cache only with "
        "no running request holding KV, or by preempting them all (their KV dropped: recompute, not keep)"
    )
    begin_moves_weights = True  # start_weight_update moves every layer to the meta device (layerwise reload)
    pause_modes = frozenset({"abort", "retract"})
    transports = frozenset({"vllm_nccl", "vllm_ipc"})
    holds_requests = True  # a hold pauses keeping the requests (quarantine's keep_requests)
    no_stage = (
        "vLLM 0.33.0 writes every update into the live parameters (distributed/weight_transfer nccl_engine.py "
        "and ipc_engine.py call model.load_weights; the layerwise reload copies each layer back in place) and has "
        "no second copy to stage into and swap"
    )
    memory_tags = frozenset({"weights", "kv_cache"})
    serves_adapters = True  # LoRA refits: a version per adapter name, loaded from a directory
    adapter_transports = frozenset({"shm"})  # the driver reads the adapter and writes its files

    def __init__(
        self,
        name: str,
        url: str,
        *,
        api_key: str | None = None,
        tp: int = 1,
        model: str | None = None,
        weights_cpu_backup: bool = False,
        released: Sequence[str] = (),
        checksums: bool = False,
        transport: httpx.BaseTransport | None = None,
        lora_dir: str | None = None,
    ) -> None:
        """`url`: the server's base URL (started with VLLM_SERVER_DEV_MODE=1 and a
        --weight-transfer-config). `api_key`: for /v1 routes. `tp`: its worker count (TP x PP).
        `model`: the served model name for /v1/completions (default: the first /v1/models entry).
        `weights_cpu_backup`: released weights are kept on the CPU (sleep level 1). `released`:
        memory tags already asleep when refit takes the server (release through `release_memory`
        instead, and the driver knows): only what is asleep is woken. `checksums`: verify by vLLM's
        own /weight_checker checksums (`digest_kinds`, vLLM 0.33+): each worker reads every
        parameter to the host and hashes it with sha256 (seconds per refit for a 7B model, and the
        trainer hashes what it sends the same way), for a server on a GPU (vLLM's CPU backend
        repacks linear weights, which then hash empty: refused, naming why), one data-parallel
        rank and one pipeline stage, serving the dtype the trainer sends. `lora_dir`: where LoRA
        refits write each adapter version for the server to read (a directory it can see; default
        a folder of this machine's temporary directory, for a server on this host)."""
        super().__init__(name, url, api_key=api_key, tp=tp, transport=transport)
        self.model = model
        self.weights_cpu_backup = weights_cpu_backup
        self.capabilities: Capabilities | None = None
        self._last_capabilities: Capabilities | None = None  # survives a restart's forgetting (`no_digests`)
        self._restarts = 0
        self._seen = False  # probed once: whether it was found paused is known
        self._probe_label: Any = None  # the weight version the last probe read
        self._published: str | None = None
        self._attached: ConnectInfo | None = None
        self._session_unknown = False
        self._released: set[str] = {t for t in released if t in self.memory_tags}
        self.checksums = checksums
        import tempfile
        from pathlib import Path

        self.lora_dir = Path(lora_dir) if lora_dir else Path(tempfile.gettempdir()) / f"refit-lora-{name}"
        self._lora_args: dict[str, Any] = {}
        self._adapter_tensors: dict[str, Any] = {}
        self._lora_receiver: Any = None  # the shared-memory reader of a LoRA refit's connection
        with contextlib.suppress(TimeoutError, EngineDied, EngineError):
            self._read_capabilities(5.0)

    @property
    def digest_kinds(self) -> frozenset[str]:  # type: ignore[override]
        """vLLM's own checksums ("vllm/tp<N>", `refit.drivers.vllm_checksums`), when asked for."""
        if self.no_digests is not None:
            return frozenset()
        from refit.drivers.vllm_checksums import kind_for

        return frozenset({kind_for(self._tp)})

    @property
    def no_digests(self) -> str | None:  # type: ignore[override]
        """Why this driver reports no digests (None: it does)."""
        if not self.checksums:
            return "vLLM's checksums are used only when asked: VLLMEngine(..., checksums=True), see its docstring"
        # a restart found by a probe forgets the capabilities until the server is read again: the
        # version last read stands for it meanwhile (else the next run's digest kind would fall
        # back to the transport's, which no vLLM engine reports, and quarantine every engine)
        caps = self.capabilities or self._last_capabilities
        if caps is None:
            return f"the server at {self.url} has not answered /version yet"
        if (version_tuple(caps.version) or (0, 33, 0)) < (0, 33, 0):
            return f"vLLM {caps.version} has no /weight_checker (0.33.0 added it)"
        return None

    def _read_capabilities(self, timeout: float) -> Capabilities:
        data = self._call("GET", "/version", "connect", timeout=timeout)
        caps = Capabilities.of(data.get("version") if isinstance(data, dict) else None)
        if not (caps.session and caps.packed_in_init and caps.weight_version):
            raise EngineError(
                "unsupported",
                f"engine {self.name}: vLLM {caps.version} predates the weight-transfer API this driver speaks "
                "(start/finish sessions, packing in init_info, weight versions: vLLM 0.28 or newer)",
            )
        self.capabilities = self._last_capabilities = caps
        return caps

    @property
    def incarnation(self) -> str:
        return f"{self.name}@{self.url}#{self._restarts}"

    # ---- HTTP errors --------------------------------------------------------------------------

    def _error(self, method: str, route: str, call: str, status: int, data: Any, *, update: bool) -> EngineError:
        message = message_of(data)
        text = f"engine {self.name}: {method} {route} ({call}) -> HTTP {status}: {message}"
        low = message.lower()
        if status in (401, 403):
            return EngineError("unauthorized", f"{text} (the API key is missing or wrong)")
        if status == 404:
            return EngineError("unsupported", f"{text} (no such route: is VLLM_SERVER_DEV_MODE=1 set?)")
        if route == "/reset_prefix_cache" and status < 300:  # {"success": false}: blocks still held
            return EngineError("flush_refused", text)
        if status == 503:
            return EngineError("paused", text)
        if status in (400, 422):
            return EngineError("bad_request", text)
        if "must be called before" in low or "without a matching start" in low:
            return EngineError("no_session", text)
        if "already active" in low:
            return EngineError("session_open", text)
        if "vllm_allow_insecure_serialization" in low:
            return EngineError(
                "misconfigured",
                f"{text} (IPC handles travel pickled over HTTP: start the vLLM server with "
                "VLLM_ALLOW_INSECURE_SERIALIZATION=1, or use the NCCL transport)",
            )
        if "invalid update_info" in low or "invalid init_info" in low:
            return EngineError("bad_payload", text)
        return EngineError("server_error", text)

    def _caps(self, timeout: float) -> Capabilities:
        return self.capabilities or self._read_capabilities(timeout)

    # ---- protocol calls -----------------------------------------------------------------------

    def _weight_label(self, call: str, timeout: float) -> Any:
        """GET /weight_info's weight_version; an answer of another shape is named, never indexed."""
        data = self._call("GET", "/weight_info", call, timeout=timeout)
        if data is None:
            return None
        if not isinstance(data, dict):
            shown = str(data)[:80]
            where = f"engine {self.name}: GET /weight_info ({call})"
            raise EngineError("bad_answer", f"{where} answered {shown!r}, not an object")
        return data.get("weight_version")

    def _forget_process(self) -> bool:
        """A new server process at this URL: nothing of ours attached, released or published; read
        it afresh (version, workers, paused). Returns whether a transport was attached."""
        attached = self._attached is not None
        self._restarts += 1  # the next run sees a new incarnation and reconnects
        self._attached, self._released, self._published, self._gone = None, set(), None, False
        self._ledger.vouch()  # a new process holds its checkpoint
        self._quarantined = None
        self._seen = False
        self.capabilities = None
        return attached

    def probe(self, target_version: int, adapter: str | None = None, *, timeout: float) -> dict[str, Any]:
        self._adapter_run = None
        if adapter is not None:
            return self._probe_adapter(target_version, adapter, timeout)
        end = time.monotonic() + timeout
        caps = self._caps(timeout)
        label = self._weight_label("probe", end - time.monotonic()) if caps.weight_version else None
        if self._gone or (label == "default" and self._published not in (None, "default")):
            if self._forget_process():
                raise EngineError(
                    "restarted",
                    f"engine {self.name}: the server's weight version is back at 'default' after {self.name} was "
                    "published (or it had stopped answering): it restarted and lost its weight-transfer setup; the "
                    "next refit reconnects it",
                )
            caps = self._caps(end - time.monotonic())
        if not self._seen:  # first contact: its worker count, and whether someone left it paused
            world = self._call("GET", "/get_world_size", "probe", timeout=end - time.monotonic())
            workers = world.get("world_size") if isinstance(world, dict) else None
            if isinstance(workers, int) and workers != self._tp:  # one rank per worker in the group
                raise EngineError(
                    "misconfigured",
                    f"engine {self.name}: the server has {workers} workers (TP x PP), this driver was built with "
                    f"tp={self._tp}: VLLMEngine(..., tp={workers})",
                )
            self._seen = True
            paused = self._call("GET", "/is_paused", "probe", timeout=end - time.monotonic())
            if isinstance(paused, dict) and paused.get("is_paused"):  # a crashed trainer mid-update?
                self._ledger.taint()
        self._probe_label = label
        return self._probed(label, target_version, caps)

    def _probed(self, label: Any, target_version: int, caps: Capabilities) -> dict[str, Any]:
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

    def release_memory(self, tags: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        if "weights" in tags:
            level = 1 if self.weights_cpu_backup else 2
            self._call("POST", "/sleep", "release_memory", timeout=timeout, params={"level": level, "mode": "abort"})
            self._released |= {"weights", "kv_cache"}
        elif "kv_cache" in tags:
            self._call("POST", "/release_kv_cache_memory", "release_memory", timeout=timeout)
            self._released.add("kv_cache")

    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]:
        """Wake only what this driver released: vLLM's wake_up resumes the scheduler whenever nothing
        is left asleep (v1/engine/core.py wake_up), which would undo a pause, or a quarantine."""
        wake = [t for t in tags if t in self.memory_tags and t in self._released]
        if wake:
            if "kv_cache" in wake:
                wake.append("scheduling")
            self._call("POST", "/wake_up", "resume_memory", timeout=timeout, params={"tags": wake})
        resumed = [t for t in tags if t in self._released]
        intact = self.weights_cpu_backup or "weights" not in self._released
        self._released -= set(tags)
        return {"weights_intact": intact, "resumed": resumed}

    def attach(self, info: ConnectInfo, *, timeout: float) -> None:
        if info.kind in self.adapter_transports:  # a LoRA refit's: read here, written to files
            from refit.drivers.shm import SharedMemoryReceiver

            self._lora_receiver = SharedMemoryReceiver(info, 0)
            return
        if info.kind not in self.transports:
            raise EngineError(
                "bad_request", f"engine {self.name}: vLLM receives {sorted(self.transports)}, not {info.kind!r}"
            )
        if len(info.parts) != self._tp:
            raise EngineError(
                "bad_request",
                f"engine {self.name}: connect info has {len(info.parts)} parts, this driver was built with "
                f"tp={self._tp}",
            )
        init = nccl_init_info(info.fields) if info.kind == "vllm_nccl" else {"packed": True}
        try:
            self._call("POST", "/init_weight_transfer_engine", "attach", timeout=timeout, body={"init_info": init})
        except EngineError as exc:
            if info.kind == "vllm_nccl" and exc.kind == "server_error":
                raise EngineError("rendezvous", exc.message) from exc
            if exc.kind == "bad_payload":  # most often: the transport is not the server's backend
                backend = "nccl" if info.kind == "vllm_nccl" else "ipc"
                raise EngineError(
                    "bad_payload",
                    f"{exc.message} (is the server's --weight-transfer-config backend {backend!r}, as "
                    f"{info.kind} needs? `refit doctor {self.url}` shows it)",
                ) from exc
            raise
        self._attached = info

    def detach(self, *, timeout: float) -> None:
        if self._lora_receiver is not None:
            with contextlib.suppress(Exception):
                self._lora_receiver.close()
            self._lora_receiver = None
            return
        if self._attached is not None:
            self._attached = None
            self._call("POST", "/shutdown_weight_transfer_engine", "detach", timeout=timeout)

    def pause(self, mode: PauseMode, *, timeout: float) -> None:
        if mode not in self.pause_modes:
            raise EngineError(
                "bad_request", f"engine {self.name}: pause mode {mode!r}; vLLM takes {sorted(self.pause_modes)}"
            )
        params = {"mode": "abort" if mode == "abort" else "keep", "clear_cache": "false"}
        self._call("POST", "/pause", "pause", timeout=timeout, params=params)

    def flush(self, *, timeout: float) -> None:
        end = time.monotonic() + timeout
        data = self._call(
            "POST", "/reset_prefix_cache", "flush", timeout=timeout, params={"reset_running_requests": "true"}
        )
        if not (isinstance(data, dict) and data.get("success")):  # a 2xx without {"success": true}
            raise EngineError("flush_refused", f"engine {self.name}: POST /reset_prefix_cache (flush) -> {data}")
        self._call("POST", "/reset_encoder_cache", "flush", timeout=end - time.monotonic())

    def begin(self, plan: Sequence[BucketManifest], *, timeout: float) -> None:
        end = time.monotonic() + timeout
        caps = self._caps(timeout)
        self._ledger.opening()
        if caps.session:
            try:
                self._start(caps, end - time.monotonic())
            except EngineError as exc:
                if exc.kind != "session_open":
                    raise
                # a session a crashed run left open: finish it (its weights are replaced below), start again
                self._call("POST", "/finish_weight_update", "begin", timeout=end - time.monotonic(), body={})
                self._start(caps, end - time.monotonic())
        self._ledger.begin(plan)

    def _start(self, caps: Capabilities, timeout: float) -> None:
        self._session_unknown = True
        self._call("POST", "/start_weight_update", "begin", timeout=timeout, body=caps.start_body, update=True)

    def load(self, payload: Payload, *, timeout: float) -> None:
        if self._adapter_run is not None:
            self._load_adapter(payload)
            return
        manifest = payload.manifest
        self._ledger.check_load(payload, attached=self._attached.kind if self._attached else None, tp=self._tp)
        info = update_info(manifest, payload.parts if payload.kind == "vllm_ipc" else None)
        try:
            self._call("POST", "/update_weights", "load", timeout=timeout, body={"update_info": info}, update=True)
        except EngineError as exc:
            if not exc.no_effect:
                raise
            # refused before a byte landed, but after start_weight_update moved the layers to the meta
            # device; vLLM then drops the session without finishing the reload: no usable weights
            raise EngineError(
                "state_unknown",
                f"{exc.message} [{exc.kind}; vLLM left the model's layers on the meta device (its start_weight_update "
                "began a layerwise reload that this failure did not finish): the engine needs a complete refit]",
            ) from exc
        self._ledger.ack(manifest.index)

    def verify(self, kind: str | None, probe: Sequence[Any] | None = None, *, timeout: float) -> dict[str, Any]:
        """VERIFYING: POST /weight_checker {"action": "checksum"}, vLLM's sha256 of every parameter
        on every worker, as {"<param>@tp<rank>": digest} (`vllm_checksums.reported`). No probe: a
        paused vLLM answers new requests 503."""
        from refit.drivers import vllm_checksums

        return self._checksums(
            kind, probe, "/weight_checker", {"action": "checksum"}, vllm_checksums.reported,
            "vLLM rejects requests while paused: no probe", timeout=timeout,
        )  # fmt: skip

    def finalize(self, *, timeout: float) -> None:
        if self._adapter_run is not None:
            self._finalize_adapter(timeout)
            return
        plan = self._ledger.close()
        if self._caps(timeout).session:
            self._call("POST", "/finish_weight_update", "finalize", timeout=timeout, body={}, update=True)
            self._session_unknown = False
        self._ledger.complete(plan)

    def publish(self, version: int, *, timeout: float) -> dict[str, Any] | None:
        if self._adapter_run is not None:
            return self._publish_adapter(version, timeout)
        self._ledger.require_complete("vLLM")
        end = time.monotonic() + timeout
        if self._caps(timeout).weight_version:  # still the process the probe read, at the label it read?
            before = self._weight_label("publish", timeout)
            if str(before) != str(self._probe_label):
                self._forget_process()
                raise EngineError(
                    "state_unknown",
                    f"engine {self.name}: the server reports weight version {before!r} before publish, where this "
                    f"run's probe read {self._probe_label!r}: it restarted (or another client relabelled it) and the "
                    "weights this run sent may be gone; not published",
                )
        body = {"new_version": str(version)}
        self._call("POST", "/update_weight_version", "publish", timeout=end - time.monotonic(), body=body)
        label = self._weight_label("publish", end - time.monotonic())
        if str(label) != str(version):  # a label the server did not set must not be passed on as published
            raise EngineError(
                "state_unknown", f"engine {self.name}: published version {version}, but the server reports {label!r}"
            )
        self._ledger.published()
        self._published = str(version)
        self._quarantined = None
        return None

    def continue_generation(self, *, timeout: float) -> None:
        """Resume, with the KV memory awake first if this driver released it: vLLM's /resume
        unpauses whatever sleeps (v1/engine/core.py resume_scheduler)."""
        self._check_serving()
        if self._adapter_run is not None:  # a LoRA refit paused nothing
            return
        end = time.monotonic() + timeout
        if "kv_cache" in self._released:
            self.resume_memory(["kv_cache"], timeout=timeout)
        self._call("POST", "/resume", "continue_generation", timeout=end - time.monotonic())
        self._ledger.vouch()  # the runner continues only weights a version names

    def quarantine(
        self, reason: str, keep_requests: bool = False, adapter: str | None = None, *, timeout: float
    ) -> None:
        """Stop serving (new requests get 503; this driver refuses them itself) and finish a session
        this run may have left open. A hold (`keep_requests`, the version policy's STALE) pauses with
        mode "keep": vLLM keeps the requests it runs, to go on once it is resumed (v1/engine/core.py
        `pause_scheduler`; keep does not reject new requests, the driver does). `adapter` (a LoRA
        refit's version policy): that adapter alone, in this driver (`generate(adapter=...)` refuses)."""
        if adapter is not None:
            self._hold_adapter(adapter, reason, timeout)
            return
        end = time.monotonic() + timeout
        self._quarantined = reason
        self._ledger.reset()
        params = {"mode": "keep" if keep_requests else "abort", "clear_cache": "false"}
        self._call("POST", "/pause", "quarantine", timeout=timeout, params=params)
        if self._session_unknown:
            status, data = self._request(
                "POST", "/finish_weight_update", "quarantine", timeout=end - time.monotonic(), body={}
            )
            err = self._error("POST", "/finish_weight_update", "quarantine", status, data, update=False)
            if status >= 300 and err.kind != "no_session":
                raise err
            self._session_unknown = False

    # ---- serving ------------------------------------------------------------------------------

    def _model(self, timeout: float) -> str:
        if self.model is None:
            data = self._call("GET", "/v1/models", "generate", timeout=timeout, serving=True)
            self.model = str(data["data"][0]["id"])
        return self.model

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, adapter: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> dict[str, Any]:  # fmt: skip
        """Greedy completion of token ids through POST /v1/completions, with the token ids and the
        weight version of each token: {"output", "weight_versions", "finish_reason"}. Refused
        (EngineError "quarantined") while this driver holds the engine out of service (a hold
        pauses with mode=keep, under which vLLM queues new requests instead of answering 503).
        `adapter`: a LoRA refit's adapter: the request names its live version as its `model`."""
        self._check_serving()
        end = time.monotonic() + timeout
        live = None if adapter is None else self.live_adapter(adapter)
        model = self._model(timeout) if adapter is None else version_name(adapter, live)
        body = {
            "model": model, "prompt": list(prompt), "max_tokens": int(max_new_tokens),
            "temperature": 0.0, "return_token_ids": True, "return_weight_versions": True,
        }  # fmt: skip
        data = self._call(
            "POST", "/v1/completions", "generate", timeout=end - time.monotonic(), body=body, serving=True
        )
        choice = data["choices"][0]
        output = [int(t) for t in choice.get("token_ids") or []]
        out: dict[str, Any] = {"output": output, "prompt": list(prompt), "finish_reason": choice.get("finish_reason")}
        versions = versions_per_token(choice.get("weight_versions"), len(output))
        if versions is not None:
            out["weight_versions"] = versions
        out["num_retractions"] = 0
        if adapter is not None:
            out["adapter"], out["adapter_version"] = adapter, live
        return out

    def info(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        label = self._weight_label("info", timeout)
        caps = self.capabilities or Capabilities.of(None)
        return {
            "version": label_version(label), "capabilities": caps.as_dict(), "adapters": self._lora.describe(),
            "adapters_held": dict(self._adapter_held),
        }  # fmt: skip

    # ---- LoRA refits (see the module docstring; the pure half is refit.drivers.vllm_lora) ----------

    def no_adapter(self, adapter: dict[str, Any], *, verify: str, max_live: int | None) -> str | None:
        from refit.drivers.vllm_lora import static_problem

        return static_problem(adapter, verify=verify, max_live=max_live)

    def _probe_adapter(self, target: int, adapter: str, timeout: float) -> dict[str, Any]:
        """Reads only: /server_info (LoRA on, runtime loading on) and /v1/models, into the mirror."""
        from refit.drivers.vllm_lora import server_lora

        end = time.monotonic() + timeout
        info = self._call("GET", "/server_info", "probe", timeout=timeout, params={"config_format": "json"})
        self._lora_args = server_lora(info if isinstance(info, dict) else {})
        return self._adapter_probed(target, adapter, self._listed_versions(adapter, "probe", end - time.monotonic()))

    def stage(
        self, plan: Sequence[BucketManifest], digest: str | None = None, adapter: dict[str, Any] | None = None,
        *, timeout: float,
    ) -> None:  # fmt: skip
        """A LoRA refit's STAGING (vLLM has no staged copy of its weights: `no_stage`)."""
        from refit.drivers.vllm_lora import server_problem, static_problem

        if adapter is None:
            raise EngineError("unsupported", f"engine {self.name}: {self.no_stage}")
        end = time.monotonic() + timeout
        name, version, max_live = str(adapter["name"]), int(adapter["version"]), adapter.get("max_live")
        problem = static_problem(adapter, verify="off" if digest is None else "digest", max_live=max_live)
        problem = problem or server_problem(adapter, self._lora_args)
        if problem is not None:
            raise EngineError("unsupported", f"engine {self.name}: {problem}")
        if self._lora_receiver is None:
            raise EngineError("not_attached", f"engine {self.name}: no shared-memory connection attached")
        for v in [v for v in self._lora.loaded(name) if self._lora.state(name, v) == Adapter.STAGED or v == version]:
            self._unload(name, v, "stage", end - time.monotonic(), reason="a failed run left it loaded")
        self._lora.stage(name, version, max_live)
        self._adapter_run = {**adapter, "name": name, "version": version}
        self._adapter_tensors = {}
        self._adapter_plan = {e.meta.name for m in plan for e in m.entries}

    def _load_adapter(self, payload: Payload) -> None:
        if payload.kind not in self.adapter_transports or self._lora_receiver is None:
            raise EngineError("bad_payload", f"engine {self.name}: a LoRA refit into vLLM takes shared memory "
                              f"(SharedMemoryTransport), not {payload.kind!r}")  # fmt: skip
        try:
            tensors = self._lora_receiver.read(payload)
        except (ValueError, KeyError, OSError, IndexError, RuntimeError) as exc:
            raise EngineError("bad_payload", f"engine {self.name}: bucket {payload.manifest.index}: {exc}") from exc
        for n, t in tensors:
            self._adapter_tensors[n] = t.detach().clone()  # out of the trainer's buffer before its release

    def _finalize_adapter(self, timeout: float) -> None:
        """Write the version's directory, then POST /v1/load_lora_adapter (vLLM reads it)."""
        from refit.drivers.vllm_lora import write_adapter

        run = self._adapter_run
        assert run is not None
        missing = sorted(self._adapter_plan - set(self._adapter_tensors))
        if missing:
            raise EngineError("incomplete", f"engine {self.name}: {len(missing)} adapter tensors not received, "
                              f"first {missing[0]!r}")  # fmt: skip
        name = version_name(run["name"], run["version"])
        path = write_adapter(self.lora_dir / name, run, self._adapter_tensors)
        self._adapter_tensors = {}
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": False}
        status, data = self._request("POST", "/v1/load_lora_adapter", "finalize", timeout=timeout, body=body)
        if status >= 300:
            raise self._lora_error("/v1/load_lora_adapter", "finalize", name, status, data)
        self._lora.complete(run["name"], run["version"])

    def _lora_error(self, route: str, call: str, name: str, status: int, data: Any) -> EngineError:
        """vLLM answers a refused load or unload before anything registered (the name is added only
        after the engine took the adapter): 400, 404 (no adapter at the path, or an unknown name;
        no route: runtime loading off) and 500 ("Call to add_lora method failed: ...")."""
        where = f"engine {self.name}: POST {route} ({call}, {name!r}) -> HTTP {status}: {message_of(data)}"
        if status in (401, 403):
            return EngineError("unauthorized", where)
        if status == 404 and isinstance(data, dict) and data.get("detail") == "Not Found":
            return EngineError("unsupported", f"{where} (no such route: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 is unset)")
        return EngineError("bad_request", where)

    def _unload(self, adapter: str, version: int, call: str, timeout: float, *, reason: str | None = None) -> bool:
        """POST /v1/unload_lora_adapter (vLLM answers at once: the name goes, running requests keep
        it); an unknown name (404) is already gone. Recorded as an unload, or a discard: True."""
        name = version_name(adapter, version)
        status, data = self._request("POST", "/v1/unload_lora_adapter", call, timeout=timeout, body={"lora_name": name})
        if status >= 300 and not (status == 404 and "cannot be found" in message_of(data)):
            raise self._lora_error("/v1/unload_lora_adapter", call, name, status, data)
        if self._lora.state(adapter, version) in (Adapter.STAGING, Adapter.STAGED):
            self._lora.discard(adapter, version, reason=reason or "discarded")
        elif self._lora.state(adapter, version) is not None:
            self._lora.unload(adapter, version, **({"reason": reason} if reason else {}))
        return True

    def drain(self, hold_s: float, *, timeout: float) -> dict[str, Any]:
        """DRAINING: unload each version the publish would push past max_staleness + 1."""
        from refit.drivers.vllm_lora import prune

        run = self._adapter_run
        if run is None or self._lora.state(run["name"], run["version"]) != Adapter.STAGED:
            raise EngineError("not_ready", f"engine {self.name}: drain without a loaded LoRA refit")
        end = time.monotonic() + timeout
        for v in self._lora.going(run["name"]):
            self._unload(run["name"], v, "drain", end - time.monotonic())
        # directories of versions two back go (vLLM may reload an evicted adapter from its path while
        # a request started before its unload still runs: the last unloaded one is kept)
        oldest = run["version"] - (self._lora.max_live.get(run["name"]) or 1)
        prune(self.lora_dir, run["name"], [version_name(run["name"], v) for v in range(oldest, run["version"] + 1)])
        return {"ready": True, "pinned": None, "going": [], "adapter_moves": self._lora.report()}

    def discard(self, *, timeout: float) -> dict[str, Any]:
        """A LoRA refit that will not publish: unload the version it loaded (after asking the server
        whether a load that did not answer went in) and remove its directory."""
        import shutil

        run = self._adapter_run
        if run is None:
            raise EngineError("unsupported", f"engine {self.name}: {self.no_stage}")
        name, version = run["name"], run["version"]
        end = time.monotonic() + timeout
        self._adapter_tensors = {}
        state = self._lora.state(name, version)
        if state == Adapter.STAGING and version in self._listed_versions(name, "discard", timeout):
            self._lora.complete(name, version)
            state = Adapter.STAGED
        if state == Adapter.STAGED:
            self._unload(name, version, "discard", end - time.monotonic(), reason="its run failed")
        elif state == Adapter.STAGING:
            self._lora.discard(name, version, reason="its load did not complete")
        shutil.rmtree(self.lora_dir / version_name(name, version), ignore_errors=True)
        return {"discarded": state is not None, "adapter_moves": self._lora.report()}


# ---- refit doctor (read only) ------------------------------------------------------------------

DOCTOR_READS = ("/version", "/server_info?config_format=json", "/weight_info", "/get_world_size", "/openapi.json")
DOCTOR_ROUTES = (
    "/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/reset_encoder_cache", "/init_weight_transfer_engine",
    "/start_weight_update", "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_info",
    "/get_world_size",
)  # fmt: skip
_TRUE = (True, 1, "1", "true", "True")


def diagnose(answers: dict[str, Any], *, admin_key: bool) -> tuple[str | None, list[Any], list[Any]]:
    """`refit doctor` for a vLLM server, from the answers to `DOCTOR_READS` (no I/O): its version,
    dev mode (the weight-transfer routes), the weight-transfer backend it was started with, the
    variables and flags each transport needs, its workers, and which modes will work."""
    from refit.diagnosis import Finding, verdicts

    ipc, nccl = (
        ("colocated", "VLLMIPCTransport(device='cuda')"),
        ("disaggregated", "VLLMBroadcastTransport(backend='nccl')"),
    )
    modes = [ipc, nccl]
    ver = answers["/version"]
    version = ver.data.get("version") if ver.status == 200 and isinstance(ver.data, dict) else None
    if not isinstance(version, str):
        finding = Finding(
            "version",
            "fail",
            f"GET /version -> {ver.status or ver.error}: not vLLM's version answer",
            "check the URL; an SGLang server: --engine sglang",
        )
        return None, [finding], verdicts(modes, [finding])
    caps = Capabilities.of(version)
    findings: list[Finding] = []
    if not (caps.session and caps.packed_in_init and caps.weight_version):
        findings.append(
            Finding(
                "version",
                "fail",
                f"vLLM {version} predates the weight-transfer API refit speaks (0.28+)",
                "vLLM 0.28 or newer (refit is tested against 0.33)",
            )
        )
    else:
        findings.append(Finding("version", "ok", f"vLLM {version}"))
    info = answers["/server_info?config_format=json"]
    data = info.data if info.status == 200 and isinstance(info.data, dict) else {}
    config, env = data.get("vllm_config"), data.get("vllm_env")
    if info.status == 404 or not isinstance(config, dict) or not isinstance(env, dict):
        findings.append(
            Finding(
                "dev mode",
                "fail",
                "no dev /server_info: VLLM_SERVER_DEV_MODE is not 1, and vLLM "
                "registers none of its weight-transfer routes",
                "VLLM_SERVER_DEV_MODE=1",
            )
        )
        return version, findings, verdicts(modes, findings)
    findings.append(Finding("dev mode", "ok", "VLLM_SERVER_DEV_MODE=1: the weight-transfer routes are served"))
    api = answers["/openapi.json"]
    paths = api.data.get("paths") if api.status == 200 and isinstance(api.data, dict) else None
    if isinstance(paths, dict):
        missing = [r for r in DOCTOR_ROUTES if r not in paths]
        findings.append(
            Finding(
                "routes",
                "fail" if missing else "ok",
                f"missing: {missing}" if missing else "every route refit calls is served",
                "vLLM 0.33" if missing else None,
            )
        )
    transfer = config.get("weight_transfer_config")
    backend = transfer.get("backend") if isinstance(transfer, dict) else None
    if backend is None:
        findings.append(
            Finding(
                "weight transfer",
                "fail",
                "started without --weight-transfer-config",
                '--weight-transfer-config \'{"backend": "nccl"}\' (or "ipc", colocated)',
            )
        )
    else:
        findings.append(Finding("weight transfer", "ok", f"backend {backend!r}"))
    insecure = env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") in _TRUE
    findings.append(
        Finding(
            "insecure serialization",
            "ok" if insecure else "warn",
            "VLLM_ALLOW_INSECURE_SERIALIZATION=1: pickled IPC handles are accepted"
            if insecure
            else "VLLM_ALLOW_INSECURE_SERIALIZATION is not 1: the IPC backend refuses refit's handles",
            None if insecure else "VLLM_ALLOW_INSECURE_SERIALIZATION=1 (colocated, IPC)",
        )
    )
    world = answers["/get_world_size"]
    workers = world.data.get("world_size") if world.status == 200 and isinstance(world.data, dict) else None
    if workers is not None:
        findings.append(Finding("workers", "ok", f"{workers} (TP x PP x DP): VLLMEngine(..., tp={workers})"))
    label = answers["/weight_info"]
    if label.status == 200 and isinstance(label.data, dict):
        findings.append(
            Finding("weight version", "ok", f"the server labels its weights {label.data.get('weight_version')!r}")
        )
    model = config.get("model_config")
    sleep = bool(model.get("enable_sleep_mode")) if isinstance(model, dict) else False
    findings.append(
        Finding(
            "sleep mode",
            "ok" if sleep else "warn",
            "--enable-sleep-mode: a colocated trainer can borrow the engine's weight and KV memory"
            if sleep
            else "without --enable-sleep-mode a colocated trainer cannot borrow the engine's GPU "
            "memory (/sleep, /wake_up)",
            None if sleep else "--enable-sleep-mode",
        )
    )
    extra = {
        "colocated": ""
        if backend == "ipc" and insecure
        else (
            f"the server's weight-transfer backend is {backend!r}, not 'ipc'"
            if backend != "ipc"
            else "vLLM refuses pickled IPC handles without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
        ),
        "disaggregated": ""
        if backend == "nccl"
        else f"the server's weight-transfer backend is {backend!r}, not 'nccl'",
    }
    import dataclasses

    out = verdicts(modes, findings, extra)
    fixes = {
        "colocated": '--weight-transfer-config \'{"backend": "ipc"}\' and VLLM_ALLOW_INSECURE_SERIALIZATION=1 on a '
        "server beside the trainer",
        "disaggregated": '--weight-transfer-config \'{"backend": "nccl"}\'',
    }
    blocked = any(f.status == "fail" for f in findings)
    for k, v in enumerate(out):
        if not v.works and extra[v.mode] and not blocked:
            out[k] = dataclasses.replace(v, fix=fixes[v.mode])
        elif v.works and v.mode == "disaggregated":
            out[k] = dataclasses.replace(
                v, why="the trainer needs a CUDA torch and the NCCL library, and must reach the server's host"
            )
    return version, findings, out
