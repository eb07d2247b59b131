"""`refit doctor URL`: a read-only check of a live server, against both emulated servers, SGLang's
own HTTP app, servers with routes or flags missing, and a server that is down. Every request it
makes is a GET (the servers record each one)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from refit.doctor import Answer, doctor, read
from refit.testing.sglang_server import EmulatedSGLangEngine
from refit.testing.vllm_server import EmulatedVLLMEngine

from .conftest import CONFIG

pytestmark = pytest.mark.e2e


@pytest.fixture
def servers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for e in made:
        e.close()


def _only_reads(engine: Any, since: int) -> None:
    made = engine.server.requests[since:]
    assert made and {m for m, _ in made} == {"GET"}, made


def _verdicts(report: Any) -> dict[str, bool]:
    return {v.mode: v.works for v in report.verdicts}


def test_an_sglang_server_as_docs_launch_it_works_in_both_modes(servers) -> None:
    engine = EmulatedSGLangEngine.start("s", config=CONFIG, in_thread=True, tp=1)
    servers.append(engine)
    seen = len(engine.server.requests)
    report = doctor(engine.url)
    _only_reads(engine, seen)
    assert report.engine == "sglang" and report.version == "0.5.23" and report.ok
    assert _verdicts(report) == {"colocated": True, "disaggregated": True}
    checks = {f.check: f.status for f in report.findings}
    assert checks["routes"] == "ok" and checks["memory saver"] == "ok"


def test_sglangs_own_server_without_memory_saver_is_told_the_flag(servers) -> None:
    """SGLang's own FastAPI app and ServerArgs (enable_memory_saver off by default): its real route
    list and server info are read; colocated refits work, the memory hand-over needs a flag."""
    from .sglang_app import SGLangAppServer

    engine = EmulatedSGLangEngine.start("s", config=CONFIG, in_thread=True, server=SGLangAppServer)
    servers.append(engine)
    seen = len(engine.server.requests)
    report = doctor(engine.url, "sglang")
    _only_reads(engine, seen)
    assert report.ok and report.version == "0.5.23"
    saver = next(f for f in report.findings if f.check == "memory saver")
    assert saver.status == "warn" and saver.fix == "--enable-memory-saver"
    assert next(f for f in report.findings if f.check == "routes").status == "ok"  # SGLang's own /openapi.json


@pytest.mark.parametrize(("version", "works"), [("0.5.20", True), ("0.5.2", False)])
def test_an_old_sglang_is_named_and_what_it_lacks(servers, version, works) -> None:
    engine = EmulatedSGLangEngine.start("s", config=CONFIG, in_thread=True, version=version)
    servers.append(engine)
    report = doctor(engine.url, "sglang")
    status = next(f for f in report.findings if f.check == "version")
    assert report.ok is works and status.status == ("warn" if works else "fail")
    assert status.fix is not None


def test_a_vllm_without_dev_mode_has_no_routes_and_is_told_the_variable(servers) -> None:
    engine = EmulatedVLLMEngine.start("v", config=CONFIG, in_thread=True, backend="nccl", env={})
    servers.append(engine)
    seen = len(engine.server.requests)
    report = doctor(engine.url)
    _only_reads(engine, seen)
    assert report.engine == "vllm" and not report.ok
    assert all(v.fix == "VLLM_SERVER_DEV_MODE=1" for v in report.verdicts)


@pytest.mark.parametrize(
    ("backend", "env", "expected"),
    [
        ("ipc", {"VLLM_SERVER_DEV_MODE": "1"}, {"colocated": False, "disaggregated": False}),
        ("ipc", {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
         {"colocated": True, "disaggregated": False}),
        ("nccl", {"VLLM_SERVER_DEV_MODE": "1"}, {"colocated": False, "disaggregated": True}),
    ],
    ids=["ipc-without-insecure-serialization", "ipc", "nccl"],
)  # fmt: skip
def test_vllm_modes_follow_its_backend_and_variables(servers, backend, env, expected) -> None:
    engine = EmulatedVLLMEngine.start("v", config=CONFIG, in_thread=True, backend=backend, env=env)
    servers.append(engine)
    report = doctor(engine.url, "vllm")
    assert _verdicts(report) == expected
    colocated = next(v for v in report.verdicts if v.mode == "colocated")
    if backend == "ipc" and not expected["colocated"]:
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION=1" in (colocated.fix or "")


def test_a_server_that_is_down_is_reported_not_raised() -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    report = doctor(f"http://127.0.0.1:{port}", timeout=2)
    assert not report.ok and report.findings[0].status == "fail" and "no answer" in report.findings[0].detail


def test_sglang_diagnosis_refuses_data_parallel_and_an_active_weight_cache() -> None:
    """The pure decision over answers (what /server_info shows for such servers)."""
    from refit.drivers.sglang import diagnose

    info = {"version": "0.5.23", "tp_size": 2, "dp_size": 2, "weight_cache_mode": "shared", "enable_memory_saver": True}
    answers = {"/server_info": Answer(200, info), "/model_info": Answer(200, {"weight_version": "7"}),
               "/openapi.json": Answer(404, {})}  # fmt: skip
    version, findings, verdicts = diagnose(answers, admin_key=False)
    assert version == "0.5.23" and not any(v.works for v in verdicts)
    failed = {f.check for f in findings if f.status == "fail"}
    assert failed == {"data parallel", "weight cache"}
    assert "dp_size 2" in verdicts[0].why and "--weight-cache-mode shared" in verdicts[0].why
    denied = diagnose({**answers, "/server_info": Answer(401, {"error": "Unauthorized"})}, admin_key=False)
    assert denied[1][0].check == "auth" and "--api-key" in denied[1][0].fix


def test_the_command_exits_by_what_works_and_prints_json(servers) -> None:
    engine = EmulatedVLLMEngine.start("v", config=CONFIG, in_thread=True, backend="nccl")
    servers.append(engine)
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "doctor", engine.url, "--json"],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["engine"] == "vllm" and data["ok"] and "Traceback" not in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "refit.cli", "doctor", "localhost:30000"],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode == 2 and "not an http(s) URL" in bad.stderr and "Traceback" not in bad.stderr


def test_a_server_of_another_shape_or_a_slow_one_is_reported_not_raised() -> None:
    """Answers in shapes no SGLang sends, and a server that trickles its answer: a report, inside
    the timeout, never a traceback or a non-GET."""
    import socketserver
    import threading
    import time

    seen: list[str] = []

    class Odd(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            request = self.request.recv(65536).decode(errors="replace")
            seen.append(request.split(" ", 1)[0])
            path = request.split(" ")[1] if " " in request else "/"
            body = {"/server_info": b'{"version": "0.5.23", "tp_size": [1], "dp_size": "two"}',
                    "/openapi.json": b'{"paths": null}'}.get(path, b"{}")  # fmt: skip
            if path == "/model_info":  # one byte every 0.3 s
                head = b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n"
                try:
                    self.request.sendall(head)
                    for _ in range(40):
                        self.request.sendall(b" ")
                        time.sleep(0.3)
                except OSError:
                    pass
                return
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Odd)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        report = doctor(f"http://127.0.0.1:{server.server_address[1]}", "sglang", timeout=1.0)
        assert time.monotonic() - t0 < 6.0  # 4 GETs, each bounded by 1 s as a whole
        assert not report.ok and any(f.status == "fail" for f in report.findings)
        assert set(seen) == {"GET"}
    finally:
        server.shutdown()


def test_a_key_protected_or_misnamed_server_is_told_plainly(servers) -> None:
    """A server started with --api-key, read without a key: the refusal is named, not "no engine
    answered". The wrong --engine: a plain "not vLLM's answer", no check of the other server
    passing for one of this one."""
    keyed = EmulatedSGLangEngine.start("k", config=CONFIG, in_thread=True, api_key="sesame")
    servers.append(keyed)
    report = doctor(keyed.url)
    assert not report.ok and report.findings[-1].check == "auth" and report.findings[-1].fix == "--api-key KEY"
    assert doctor(keyed.url, api_key="sesame").ok
    sglang = EmulatedSGLangEngine.start("s", config=CONFIG, in_thread=True)
    servers.append(sglang)
    wrong = doctor(sglang.url, "vllm")
    assert not wrong.ok and [f.check for f in wrong.findings] == ["reachable", "version"]
    assert "--engine sglang" in (wrong.findings[1].fix or "")


@pytest.mark.parametrize(
    "args", [["http://[::1"], ["http://127.0.0.1:abc"], ["http://127.0.0.1:1", "--timeout", "1e12"]]
)
def test_a_url_or_timeout_that_is_not_one_exits_2_without_a_traceback(args) -> None:
    proc = subprocess.run([sys.executable, "-m", "refit.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "refit doctor" in proc.stderr or "not a URL" in proc.stderr, proc.stderr


@pytest.mark.parametrize("tp", ["two", None, 0, -1])
def test_a_tp_size_that_is_not_one_fails_the_diagnosis(tp) -> None:
    from refit.drivers.sglang import diagnose

    info = {"version": "0.5.23", "tp_size": tp, "dp_size": 1, "enable_memory_saver": True}
    answers = {"/server_info": Answer(200, info), "/model_info": Answer(200, {"weight_version": "7"}),
               "/openapi.json": Answer(404, {})}  # fmt: skip
    _, findings, verdicts = diagnose(answers, admin_key=False)
    assert [f.status for f in findings if f.check == "tensor parallel"] == ["fail"]
    assert not any(v.works for v in verdicts)


def test_a_read_that_raises_anything_is_a_finding() -> None:
    """An answer nested past what the JSON decoder takes is read as text, never a thread traceback."""
    import http.server
    import threading

    class Deep(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"[" * 100000 + b"]" * 100000
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Deep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        answer = read(url, ["/server_info"], headers={}, timeout=10)["/server_info"]
        assert answer.status == 200 and isinstance(answer.data, str), answer
    finally:
        server.shutdown()
