"""What engine drivers that speak an HTTP API share: a client bounded by the call's whole budget.

`HttpEngineDriver` owns an httpx client (TCP_NODELAY: control bodies are small and must not wait
for delayed ACKs) and `request(method, route, call, timeout=...)`, which bounds the whole call, not
each read, and names the engine, route and refit call in every error: no answer in time is
`TimeoutError`, a refused or dropped connection `EngineDied`. `call(...)` also turns any non-2xx
answer into the driver's own `EngineError` (`error()`, per backend: each API words its failures
differently). Backends: `refit.drivers.sglang`, `refit.drivers.vllm`.
"""

from __future__ import annotations

import json
import socket
import time
from typing import TYPE_CHECKING, Any

from refit.drivers.base import EngineDriver
from refit.errors import EngineDied, EngineError

if TYPE_CHECKING:
    import httpx

DEFAULT_TIMEOUT = 60.0


class HttpEngineDriver(EngineDriver):
    """Base for a driver of one engine server reached over HTTP (one engine, `tp` TP ranks)."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        api_key: str | None = None,
        tp: int = 1,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        import httpx

        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.name = name
        self.url = url.rstrip("/")
        self._tp = tp
        self._dead = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if transport is None:  # small control bodies: no Nagle delay waiting for an ACK
            transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self._http = httpx.Client(base_url=self.url, headers=headers, transport=transport, timeout=DEFAULT_TIMEOUT)

    @property
    def tp_size(self) -> int:
        return self._tp

    @property
    def alive(self) -> bool:
        return not self._dead

    def close(self) -> None:
        self._http.close()

    def _headers(self, call: str) -> dict[str, str] | None:
        """Extra headers for a request serving refit call `call` (none; a test server may want some)."""
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
    ) -> tuple[int, Any]:
        """One HTTP call bounded by `timeout` in total (however slowly the server answers).
        Returns (status, decoded body) for any HTTP answer; raises TimeoutError / EngineDied."""
        import httpx

        where = f"engine {self.name}: {method} {route} ({call})"
        if timeout <= 0:
            raise TimeoutError(f"{where}: no time left to send it")
        end = time.monotonic() + timeout
        try:
            with self._http.stream(
                method, route, json=body, params=params, timeout=httpx.Timeout(timeout), headers=self._headers(call)
            ) as response:
                chunks = []
                for chunk in response.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() > end:
                        raise TimeoutError(f"{where}: the answer did not finish within {timeout:.3g}s")
                status = response.status_code
        except httpx.TimeoutException:
            raise TimeoutError(f"{where}: no answer within {timeout:.3g}s") from None
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            raise EngineDied(
                f"{where}: the server at {self.url} is unreachable ({type(exc).__name__}: {exc})"
            ) from None
        if time.monotonic() > end:
            raise TimeoutError(f"{where}: answered after its {timeout:.3g}s")
        raw = b"".join(chunks)
        try:
            data: Any = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode("utf-8", "replace")
        return status, data

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
    ) -> Any:
        """`_request`, with any non-2xx answer (or `"success": false`) raised as an EngineError."""
        status, data = self._request(method, route, call, timeout=timeout, body=body, params=params)
        failed = status >= 300 or (isinstance(data, dict) and data.get("success") is False)
        if not failed:
            return data
        raise self._error(method, route, call, status, data, update=update)

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
