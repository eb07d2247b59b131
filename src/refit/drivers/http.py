"""What engine drivers that speak an HTTP API share: a client bounded by the call's whole budget.

`HttpEngineDriver` owns httpx clients (TCP_NODELAY: control bodies are small and must not wait
for delayed ACKs; generation traffic on a client of its own) and `_request(method, route, call,
timeout=...)`, which bounds the whole exchange, not each read (it runs on its own thread; a call
that overruns drops its client so the next call does not queue behind it), and names the engine,
route and refit call in every error: no answer in time is `TimeoutError`, a refused connection
`EngineDied`, a connection lost before an answer `connection_lost` (`EngineDied` when new
connections are then refused). `_call(...)` also turns any non-2xx answer into the driver's own
`EngineError` (`_error()`, per backend: each API words its failures differently), and requires a
weight-changing call's answer to be the API's success answer (`_confirms()`). `UpdateLedger` is
the update session as the driver knows it. Backends: `refit.drivers.sglang`, `refit.drivers.vllm`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest
from refit.drivers.adapter_names import AdapterMirror, parse_version_name
from refit.drivers.base import EngineDriver, Payload
from refit.errors import EngineDied, EngineError
from refit.states import Adapter, FactMachine, Update, UpdateEvent

if TYPE_CHECKING:
    import httpx

DEFAULT_TIMEOUT = 60.0


class UpdateLedger:
    """What a driver knows of the update session it runs (the `update` table in `refit.states`);
    the servers check none of it (SGLang and vLLM label whatever weights they hold). `opening`
    before the begin request (from there the server may hold a partial update); `begin` records
    the plan; `check_load` refuses, before any request, a bucket that is not the next planned one;
    `ack` records each acknowledged bucket; `close` ends the session, then `complete` raises
    `incomplete` unless every planned bucket was acknowledged; `require_complete` refuses a publish
    unless the last session completed. `dirty`: an update opened and not completed since (the probe
    then reports the engine not serving, so the runner never continues it on whatever it holds)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.session = FactMachine("update")
        self.plan: dict[int, BucketManifest] | None = None
        self.acked: set[int] = set()
        # the commit points this driver saw, counted: a session opened (the weights may change from
        # there), a server found mid-update, weights vouched for again (continued, or a new process)
        self.changes = 0

    @property
    def dirty(self) -> bool:
        """Its weights may be a mix whatever label it shows (or, on vLLM, on the meta device)."""
        return self.session.state != Update.NAMED

    @property
    def finalized(self) -> bool:
        return self.session.state == Update.FINALIZED

    def reset(self) -> None:
        self.plan = None
        self.session.fire(UpdateEvent.RESET)

    def taint(self) -> None:
        """Found paused on first contact (a crashed trainer mid-update?): not serving until named."""
        self.plan = None
        self.changes += 1
        self.session.fire(UpdateEvent.TAINT)

    def vouch(self) -> None:
        """The weights are a version again: a continue the runner asked for (it continues only
        weights a version names), or a new server process (its checkpoint)."""
        self.plan = None
        self.changes += 1
        self.session.fire(UpdateEvent.VOUCH)

    def opening(self) -> None:
        """Before the begin request: from here the server may hold a partial update."""
        self.plan = None
        self.changes += 1
        self.session.fire(UpdateEvent.OPEN)

    def begin(self, plan: Sequence[BucketManifest]) -> None:
        self.session.fire(UpdateEvent.BEGIN)
        self.plan = {m.index: m for m in plan}
        self.acked = set()

    def check_load(self, payload: Payload, *, attached: str | None, tp: int) -> None:
        manifest, who = payload.manifest, f"engine {self.engine}"
        if self.plan is None:
            raise EngineError("no_session", f"{who}: load outside a weight-update session (begin first)")
        if attached is None or payload.kind != attached:
            raise EngineError("not_attached", f"{who}: no {payload.kind!r} transport attached")
        if self.plan.get(manifest.index) != manifest:
            raise EngineError("bad_manifest", f"{who}: bucket {manifest.index} is not the planned bucket")
        if manifest.index in self.acked:
            raise EngineError("bad_manifest", f"{who}: bucket {manifest.index} was already loaded")
        if len(payload.parts) != tp:
            raise EngineError(
                "bad_payload", f"{who}: bucket {manifest.index} has {len(payload.parts)} parts for TP {tp}"
            )

    def ack(self, index: int) -> None:
        self.acked.add(index)

    def close(self) -> dict[int, BucketManifest]:
        if self.plan is None or self.session.state != Update.OPEN:
            raise EngineError("no_session", f"engine {self.engine}: finalize without an open weight-update session")
        plan, self.plan = self.plan, None
        self.session.fire(UpdateEvent.CLOSE)
        return plan

    def complete(self, plan: dict[int, BucketManifest]) -> None:
        missing = sorted(set(plan) - self.acked)
        if missing:
            raise EngineError(
                "incomplete",
                f"engine {self.engine}: finalize after {len(self.acked)} of {len(plan)} buckets; missing {missing}",
            )
        self.session.fire(UpdateEvent.COMPLETE)

    def require_complete(self, api: str) -> None:
        if not self.finalized:
            raise EngineError(
                "not_ready",
                f"engine {self.engine}: publish without a complete, finalized update ({api} would label any weights)",
            )

    def published(self) -> None:
        self.session.fire(UpdateEvent.PUBLISH)


class HttpEngineDriver(EngineDriver):
    """Base for a driver of one engine server reached over HTTP (one engine, `tp` TP ranks)."""

    holds_adapters_locally = True  # the server cannot hold a name: this driver refuses requests naming it

    def __init__(
        self,
        name: str,
        url: str,
        *,
        api_key: str | None = None,
        tp: int = 1,
        transport: httpx.BaseTransport | None = None,
    ) -> None:

        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.name = name
        self.url = url.rstrip("/")
        self._tp = tp
        self._dead = False
        self._headers_all = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport  # a caller's own transport is kept; otherwise one per client
        self._http = self._new_client()  # protocol calls; replaced when a call is abandoned
        self._serve_http = self._new_client()  # generation traffic, apart from the protocol's
        self._swap = threading.Lock()
        self._ledger = UpdateLedger(name)
        self._quarantined: str | None = None  # why this driver took the engine out of service, if it did
        self._gone = False  # a call found nothing listening at the URL (the server process died)
        # LoRA refits into a server that knows adapters by name only (SGLang, vLLM): its versions as
        # this driver knows them, the refit under way, the adapters the version policy holds here
        self._lora = AdapterMirror()
        self._adapter_run: dict[str, Any] | None = None
        self._adapter_held: dict[str, str] = {}

    def _check_serving(self) -> None:
        """Refuse to continue an engine this driver quarantined until a refit completes."""
        if self._quarantined is not None:
            raise EngineError("quarantined", f"engine {self.name} is quarantined ({self._quarantined}); refit it first")

    # ---- LoRA refits over adapter names (`refit.drivers.adapter_names`) ----------------------------

    def live_adapter(self, adapter: str) -> int:
        """The version of `adapter` this driver published and serves (refused while held or none)."""
        if adapter in self._adapter_held:
            raise EngineError("quarantined", f"engine {self.name}: adapter {adapter!r} is held "
                              f"({self._adapter_held[adapter]}); a refit that reaches it brings it back")  # fmt: skip
        live = self._lora.live(adapter)
        if live is None:
            raise EngineError("bad_request", f"engine {self.name}: no version of adapter {adapter!r} is live here")
        return live

    def _listed_versions(self, adapter: str, call: str, timeout: float) -> list[int]:
        """GET /v1/models: the versions of `adapter` the server lists (its adapters by name)."""
        data = self._call("GET", "/v1/models", call, timeout=timeout, serving=True)  # type: ignore[attr-defined]
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            raise EngineError("server_error", f"engine {self.name}: GET /v1/models answered {str(data)[:200]!r}")
        found = [parse_version_name(str(c.get("id"))) for c in cards if isinstance(c, dict)]
        return sorted(v for a_v in found if a_v is not None for a, v in [a_v] if a == adapter)

    def _adapter_probed(self, target: int, adapter: str, listed: Sequence[int]) -> dict[str, Any]:
        """The probe's answer once the server's versions are `listed`: folded into the mirror (a
        read: the probe changes nothing on the server); the version is the adapter's live one (0:
        none); `version_ahead` when it holds the target. A version the mirror holds loaded that
        the listing leaves out is not taken as gone on its word (a server lists none it is still
        unloading, and a proxy or a partial answer may leave any out): it is kept, a live one
        retired, so it counts against max_staleness + 1 and DRAINING unloads it by name (the
        server's answer to that unload, "does not exist" included, settles it)."""
        self._lora.sync(adapter, listed)
        held = self._lora.live(adapter) or 0
        if held >= target:
            raise EngineError(
                "version_ahead", f"engine {self.name}: adapter {adapter!r} is at version {held}, the refit targets "
                f"{target}", {"version": held},
            )  # fmt: skip
        serving = self._quarantined is None and adapter not in self._adapter_held
        return {"version": held, "serving": serving, "adapter_moves": self._lora.report()}

    def _publish_adapter(self, version: int, timeout: float) -> dict[str, Any]:
        """CONTINUING: the loaded version becomes the one this driver's requests name, once the
        server still lists it (a restart since its load would have it gone)."""
        run = self._adapter_run
        assert run is not None
        name = run["name"]
        if version != run["version"] or self._lora.state(name, version) != Adapter.STAGED:
            raise EngineError("not_ready", f"engine {self.name}: adapter {name!r} v{version} is not loaded")
        if version not in self._listed_versions(name, "publish", timeout):
            gone = f"the server no longer lists {name}@v{version}, loaded in this run"
            raise EngineError("not_ready", f"engine {self.name}: {gone} (it restarted, or another client unloaded it)")
        going = self._lora.going(name)
        if going:
            bound = self._lora.max_live.get(name)
            raise EngineError("busy", f"engine {self.name}: publishing adapter {name!r} v{version} would leave more "
                              f"than {bound} versions loaded: v{going[0]} is still there")  # fmt: skip
        self._lora.publish(name, version)
        self._adapter_held.pop(name, None)
        return {"adapter_moves": self._lora.report()}

    def _hold_adapter(self, adapter: str, reason: str, timeout: float) -> None:
        """The version policy's hold of `adapter` here: its staged version unloaded, and
        `generate(adapter=...)` refused until a refit publishes one (the server cannot hold a name)."""
        self._adapter_held[adapter] = reason  # first: it holds whether or not the server answers below
        if self._adapter_run is not None and self._lora.staged(adapter) is not None:
            self.discard(timeout=timeout)  # type: ignore[attr-defined]

    def submit(self, prompt: Sequence[int], max_new_tokens: int, **kwargs: Any) -> Any:
        """Start a request on a thread; returns a Future of `generate`'s answer (`kwargs`: its own)."""
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(1, thread_name_prefix=f"refit-{self.name}")
        fut = pool.submit(self.generate, prompt, max_new_tokens, **kwargs)  # type: ignore[attr-defined]
        pool.shutdown(wait=False)
        return fut

    def _new_client(self) -> httpx.Client:
        import httpx

        transport = self._transport
        if transport is None:  # small control bodies: no Nagle delay waiting for an ACK
            transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        return httpx.Client(base_url=self.url, headers=self._headers_all, transport=transport, timeout=DEFAULT_TIMEOUT)

    def _abandon(self, client: httpx.Client) -> None:
        """A call overran its budget inside the HTTP exchange (a server that trickles its headers
        passes httpx's per-read timeouts): later calls get a fresh client, and the old one is closed
        so the stuck exchange fails and frees this engine's call lane. Over a caller's own transport
        the old client is left open (closing it would close that transport for every client): the
        stuck exchange ends when the server answers or the transport's own timeouts end it."""
        with self._swap:
            if self._http is client:
                self._http = self._new_client()
        if self._transport is not None:
            return

        def close() -> None:
            with contextlib.suppress(Exception):
                client.close()

        threading.Thread(target=close, daemon=True).start()

    @property
    def tp_size(self) -> int:
        return self._tp

    @property
    def alive(self) -> bool:
        return not self._dead

    def close(self) -> None:
        self._http.close()
        self._serve_http.close()

    def _headers(self, call: str) -> dict[str, str] | None:
        """Extra headers for a request serving refit call `call` (none; a test server may want some)."""
        return None

    def _route_headers(self, route: str) -> dict[str, str] | None:
        """Extra headers for `route` (a backend whose routes take different keys sets them here)."""
        return None

    def _request(
        self,
        method: str,
        route: str,
        call: str,
        *,
        timeout: float,
        body: Any = None,
        params: dict[str, Any] | None = None,
        serving: bool = False,
    ) -> tuple[int, Any]:
        """One HTTP call bounded by `timeout` in total, however slowly the server sends its headers
        or body (httpx bounds each read only). Returns (status, decoded body) for any HTTP answer;
        raises TimeoutError (no answer in time), EngineDied (connection refused: nothing listens)
        or EngineError("connection_lost") (the connection dropped before an answer: the request
        may or may not have run)."""
        where = f"engine {self.name}: {method} {route} ({call})"
        if timeout <= 0:
            raise TimeoutError(f"{where}: no time left to send it")
        client = self._serve_http if serving else self._http
        headers = self._headers(call)  # in the caller's thread (a subclass may read thread-local state)
        extra = self._route_headers(route)
        if extra:
            headers = {**(headers or {}), **extra}
        box: dict[str, Any] = {}

        def exchange() -> None:
            try:
                box["answer"] = self._exchange(client, method, route, call, timeout, body, params, headers)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=exchange, name=f"refit-http-{self.name}", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            if not serving:
                self._abandon(client)
            raise TimeoutError(f"{where}: no complete answer within {timeout:.3g}s")
        if "error" in box:
            if isinstance(box["error"], EngineDied):
                self._gone = True  # nothing listens: whatever answers next at this URL is a new process
            raise box["error"]
        status, raw = box["answer"]
        try:
            data: Any = json.loads(raw) if raw else None
        except (ValueError, RecursionError):  # not JSON, or nested past what the decoder takes
            data = raw.decode("utf-8", "replace")
        return status, data

    def _exchange(
        self,
        client: httpx.Client,
        method: str,
        route: str,
        call: str,
        timeout: float,
        body: Any,
        params: Any,
        headers: dict[str, str] | None,
    ) -> tuple[int, bytes]:
        import httpx

        where = f"engine {self.name}: {method} {route} ({call})"
        try:
            with client.stream(
                method, route, json=body, params=params, timeout=httpx.Timeout(timeout), headers=headers
            ) as response:
                return response.status_code, response.read()
        except httpx.TimeoutException:
            raise TimeoutError(f"{where}: no answer within {timeout:.3g}s") from None
        except httpx.ConnectError as exc:
            raise EngineDied(
                f"{where}: the server at {self.url} is unreachable ({type(exc).__name__}: {exc})"
            ) from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.CloseError) as exc:
            if not self._listening():
                raise EngineDied(
                    f"{where}: the connection to {self.url} was lost and new connections are refused: the server "
                    f"is gone ({type(exc).__name__}: {exc})"
                ) from None
            raise EngineError(
                "connection_lost",
                f"{where}: the connection to {self.url} was lost before an answer ({type(exc).__name__}: {exc}); "
                "the server may have died or dropped the request, and whether it ran is unknown",
            ) from None
        except httpx.HTTPError as exc:  # an answer httpx could not read (a bad encoding, a broken redirect)
            raise EngineError(
                "bad_answer",
                f"{where}: the answer from {self.url} could not be read ({type(exc).__name__}: {exc}); whether the "
                "request ran is unknown",
            ) from None

    def _checksums(
        self, kind: str | None, probe: Any, route: str, body: dict[str, Any], parse: Any, no_probe: str, *,
        timeout: float,
    ) -> dict[str, Any]:  # fmt: skip
        """VERIFYING by a server's own checksums: POST `route` with `body`, its answer read by
        `parse` (ValueError: a malformed answer) into {"<param>@tp<rank>": checksum}; a probe is
        refused with `no_probe` (why this server cannot answer one before it publishes)."""
        if probe is not None:
            raise EngineError("unsupported", f"engine {self.name}: {no_probe}")
        if kind is None:
            return {"kind": None}
        if kind not in self.digest_kinds:
            raise EngineError("unsupported", f"engine {self.name}: no {kind!r} digests from this server")
        t0 = time.monotonic()
        answer = self._call("POST", route, "verify", timeout=timeout, body=body)
        try:
            digests = parse(answer)
        except ValueError as exc:
            raise EngineError("bad_answer", f"engine {self.name}: POST {route} (verify): {exc}") from None
        return {"kind": kind, "digests": digests, "read_back": len(digests), "seconds": round(time.monotonic() - t0, 6)}

    def _listening(self) -> bool:
        """Whether the server still accepts connections (after one was lost: dead, or only dropped)."""
        from urllib.parse import urlparse

        u = urlparse(self.url)
        try:
            socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=0.5).close()
        except ConnectionRefusedError:
            return False
        except OSError:
            return True  # unknown (a slow or filtered network): not proven dead
        return True

    def _call(
        self,
        method: str,
        route: str,
        call: str,
        *,
        timeout: float,
        body: Any = None,
        params: dict[str, Any] | None = None,
        update: bool = False,
        serving: bool = False,
    ) -> Any:
        """`_request`, with any non-2xx answer (or `"success": false`) raised as an EngineError.
        `update`: a weight-changing call, whose 2xx answer must also be the API's own success
        answer (`_confirms`): anything else leaves the engine's state unknown."""
        status, data = self._request(method, route, call, timeout=timeout, body=body, params=params, serving=serving)
        failed = status >= 300 or (isinstance(data, dict) and data.get("success") is False)
        if failed:
            raise self._error(method, route, call, status, data, update=update)
        if update and not self._confirms(route, data):
            raise EngineError(
                "state_unknown",
                f"engine {self.name}: {method} {route} ({call}) -> HTTP {status} without the API's success answer "
                f"({str(data)[:200]!r}): whether it ran is unknown",
            )
        return data

    def _confirms(self, route: str, data: Any) -> bool:
        """Whether a 2xx answer to a weight-changing call is the API's own success answer."""
        return isinstance(data, dict)

    def _error(self, method: str, route: str, call: str, status: int, data: Any, *, update: bool) -> EngineError:
        """The EngineError for a failed answer (a backend maps its own messages to kinds)."""
        return EngineError("server_error", f"engine {self.name}: {method} {route} ({call}) -> HTTP {status}: "
                           f"{message_of(data)}")  # fmt: skip


def message_of(data: Any) -> str:
    """The human part of an error body: `error.message`, `message` or `detail`, else the text."""
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
        return json.dumps(data)[:300]
    return str(data or "")[:300]


def label_version(label: Any) -> int | None:
    """refit's integer version from an engine's weight-version label ("default", the label both
    SGLang and vLLM start with: the checkpoint, version 0; a label that is not an integer: None)."""
    if label == "default":
        return 0
    try:
        return int(str(label))
    except (TypeError, ValueError):
        return None


def versions_per_token(spans: Sequence[dict[str, Any]] | None, n: int) -> list[int | None] | None:
    """Each output token's version from the engines' weight_versions spans ({"version", "start",
    "end"} over token indices), or None when the answer carries none."""
    if not spans:
        return None
    versions: list[int | None] = [None] * n
    for span in spans:
        for i in range(int(span["start"]), min(int(span["end"]), n)):
            versions[i] = label_version(span["version"])
    return versions


def token_versions(
    spans: Sequence[dict[str, Any]] | None, label: Any, n: int, *, changed: bool
) -> list[int | None] | None:
    """Each of a request's `n` output tokens' version: from the server's weight_versions spans
    where it gives them; else from its request-level `label` where no commit point fell inside the
    request (`changed`: the driver opened an update, found one, or vouched for weights again while
    it ran), since weights change only at commit points; else None per token (which version
    sampled each is unknown: `refit.staleness` refuses such a sample). None: the server names no
    version at all."""
    versions = versions_per_token(spans, n)
    if versions is not None:
        return versions
    if label is None:
        return None
    return [None] * n if changed else [label_version(label)] * n


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of a server's version string ("0.5.23", "0.33.0rc1"), or None."""
    import re

    if not isinstance(text, str):
        return None
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(x) for x in m.groups()) if m else None
