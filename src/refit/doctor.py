"""`refit doctor URL`: a read-only check of a live engine server before refit drives it.

It only reads: every request is a GET of a route that changes nothing (server and model info,
the weight version, the route list FastAPI serves at /openapi.json). What it reports, and why:
the server's version, the routes refit needs, the flags the server was started with where the
server shows them, and for each refit mode and transport whether it will work with this server,
and if not, why and the flag that fixes it.

I/O is here (`read`, one GET per route, bounded); the decisions are each backend's pure
`diagnose(reads)` in its driver module (`refit.drivers.sglang`, `refit.drivers.vllm`), over the
answers read. Exit code of the command: 0 when at least one refit mode works with the server,
1 when none does (or the server cannot be reached), 2 on bad input.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

from refit.diagnosis import Answer, Finding, Verdict

ENGINES = ("sglang", "vllm")


@dataclass
class Report:
    url: str
    engine: str | None
    version: str | None = None
    findings: list[Finding] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return any(v.works for v in self.verdicts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "engine": self.engine,
            "version": self.version,
            "ok": self.ok,
            "findings": [asdict(f) for f in self.findings],
            "modes": [asdict(v) for v in self.verdicts],
        }

    def text(self) -> str:
        mark = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
        lines = [f"refit doctor {self.url}: {self.engine or 'unknown engine'} {self.version or ''}".rstrip()]
        for f in self.findings:
            lines.append(f"  [{mark.get(f.status, f.status)}] {f.check}: {f.detail}")
            if f.fix:
                lines.append(f"         fix: {f.fix}")
        if self.verdicts:
            lines.append("  refit modes with this server:")
        for v in self.verdicts:
            state = "works" if v.works else "will not work"
            lines.append(f"    {v.mode:<14} {v.transport:<42} {state}{': ' + v.why if v.why else ''}")
            if v.fix:
                lines.append(f"{'':<20}fix: {v.fix}")
        lines.append("  (read only: every request was a GET; nothing on the server was changed)")
        return "\n".join(lines)


def read(url: str, paths: list[str], *, headers: dict[str, str], timeout: float) -> dict[str, Answer]:
    """GET each of `paths` (never anything else), each bounded by `timeout` as a whole: a server
    that trickles its answer is given up on at the timeout, whatever httpx's per-read limits."""
    import threading

    import httpx

    out: dict[str, Answer] = {}
    for path in paths:
        box: dict[str, Answer] = {}

        def get(path: str = path, box: dict[str, Answer] = box) -> None:
            try:
                with httpx.Client(base_url=url, headers=headers, timeout=timeout) as client:
                    resp = client.get(path)
                    try:
                        data: Any = resp.json()
                    except (ValueError, RecursionError):  # not JSON, or nested past what the decoder takes
                        data = resp.text
                    box["answer"] = Answer(resp.status_code, data)
            except Exception as exc:  # whatever the read raised is the finding, never a traceback
                box["answer"] = Answer(None, error=f"{type(exc).__name__}: {exc}")

        worker = threading.Thread(target=get, name="refit-doctor-get", daemon=True)
        worker.start()
        worker.join(timeout)
        out[path] = box.get("answer") or Answer(None, error=f"no complete answer within {timeout:.3g}s")
    return out


def _backend(engine: str) -> Any:
    if engine == "sglang":
        from refit.drivers import sglang

        return sglang
    from refit.drivers import vllm

    return vllm


def detect(url: str, *, headers: dict[str, str], timeout: float) -> tuple[str | None, dict[str, Answer]]:
    """Which engine serves `url` (None: not told): SGLang's /server_info names itself (its
    fields, a version); vLLM answers /version and has no SGLang /server_info shape. Reads only."""
    answers = read(url, ["/server_info", "/version"], headers=headers, timeout=timeout)
    info = answers["/server_info"]
    if info.status == 200 and isinstance(info.data, dict) and "tp_size" in info.data and "version" in info.data:
        return "sglang", answers
    version = answers["/version"]
    if version.status == 200 and isinstance(version.data, dict) and "version" in version.data:
        return "vllm", answers
    return None, answers


class BadURL(ValueError):
    """The URL given is not one of a server (bad input: exit 2)."""


def doctor(
    url: str,
    engine: str | None = None,
    *,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    timeout: float = 5.0,
) -> Report:
    """Read the server at `url` and report what refit can do with it (see the module docstring)."""
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        import httpx

        httpx.URL(url)
    except (ValueError, TypeError) as exc:
        raise BadURL(f"{url!r} is not a URL of a server ({exc})") from None
    except Exception as exc:  # httpx.InvalidURL
        raise BadURL(f"{url!r} is not a URL of a server ({type(exc).__name__}: {exc})") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise BadURL(f"{url!r} is not an http(s) URL of a server")
    url = url.rstrip("/")
    # every route read is one SGLang guards with --api-key alone (NORMAL) and vLLM with none but /v1
    key = api_key or admin_api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    report = Report(url, engine)
    probe = read(url, ["/"], headers=headers, timeout=timeout)["/"]
    if probe.status is None:
        report.findings.append(
            Finding(
                "reachable",
                "fail",
                f"no answer from {url} ({probe.error})",
                "start the server, or check the URL and the network between them",
            )
        )
        return report
    if engine is None:
        engine, seen = detect(url, headers=headers, timeout=timeout)
        report.engine = engine
        if engine is None:
            said = {p: a.status or a.error for p, a in seen.items()}
            if any(a.status in (401, 403) for a in seen.values()):
                report.findings.append(Finding("auth", "fail", f"the server refused the reads ({said}): it was "
                                               "started with --api-key", "--api-key KEY"))  # fmt: skip
            else:
                report.findings.append(Finding("engine", "fail", f"neither SGLang's /server_info nor vLLM's /version "
                                               f"answered as those servers do ({said})",
                                               "check the URL; --engine sglang|vllm; --timeout"))  # fmt: skip
            return report
    backend = _backend(engine)
    answers = read(url, list(backend.DOCTOR_READS), headers=headers, timeout=timeout)
    try:
        report.version, report.findings, report.verdicts = backend.diagnose(answers, admin_key=bool(admin_api_key))
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:  # answers of another shape
        why = f"its answers are not what {engine} sends ({type(exc).__name__}: {exc})"
        report.findings = [Finding("answers", "fail", why, "check the URL and --engine")]
        report.verdicts = [Verdict(mode, "-", False, why) for mode in ("colocated", "disaggregated")]
    report.findings.insert(0, Finding("reachable", "ok", f"{url} answers"))
    return report


def render_json(report: Report) -> str:
    return json.dumps(report.as_dict(), indent=1)
