"""The `refit` command line as a user meets it: bad input gets exit 2 and a message naming what is
wrong (never a traceback), unknown options get their subcommand's usage, `--fail-at` is refused
before any engine starts, the demo explains its table and ends a failed run with the trace to check,
long commands report progress on stderr without touching their --json stdout, and a failed
`protocol.run` says so in a log warning."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest

from refit import cli, demo, protocol
from refit.cli import main
from refit.progress import Progress
from refit.protocol.ranks import Participant
from refit.reference.model import TinyLlama

from .conftest import CONFIG, perturbed

TRACES = Path(__file__).parent / "traces"
FIXTURE = TRACES / "kill-mid-transfer.jsonl"
REFIT = Path(sys.executable).parent / "refit"  # the installed console script
HEADER = '{"kind": "header", "event": "trace", "schema": 1, "config": {}}\n'
RUN_START = '{"seq": 0, "t": 0.0, "run": "r1", "state": "IDLE", "kind": "run", "event": "start"}\n'
END = '{"seq": 1, "t": 0.1, "kind": "trace", "event": "end"}\n'
FAST_DEMO = ["demo", "--refits", "1", "--steps", "2", "--in-thread"]
RAISE_AT = "transferring:engine=1:bucket=2:kind=raise"


def refit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real `refit` console script, in a fresh process."""
    return subprocess.run([str(REFIT), *args], capture_output=True, text=True, timeout=timeout, check=False)


def fixture_lines() -> list[str]:
    return FIXTURE.read_text().splitlines(keepends=True)


def with_line(n: int, text: str) -> str:
    """The fixture trace with its line `n` (1-based, the header is line 1) replaced by `text`."""
    lines = fixture_lines()
    lines[n - 1] = text + "\n"
    return "".join(lines)


def wrong_seq() -> str:
    lines = fixture_lines()
    record = json.loads(lines[2])
    record["seq"] = "x"
    lines[2] = json.dumps(record) + "\n"
    return "".join(lines)


# name -> (file content, a pattern the reason must match)
NOT_TRACES: dict[str, tuple[str | bytes, str]] = {
    "empty": ("", r"empty|no (event|line|run)"),
    "header-only": (HEADER, r"header|no (event|run)"),
    "binary": (bytes(range(256)) * 4, r"binary|utf-8|decode|not text"),
    "json-object": ('{"name": "model", "layers": 2}\n', r"header|line 1|no run"),
    "text-one-line": ("hello, this is not a trace\n", r"JSON|line 1|header|no run"),
    "text-lines": ("hello\nthis is not\na trace\n", r"JSON|line 1|header"),
    "list-line": (with_line(5, "[1, 2, 3]"), r"line 5"),
    "number-line": (with_line(4, "42"), r"line 4"),
    "string-line": (HEADER + RUN_START + '"run"\n' + END, r"line 3"),
    "wrong-field-type": (wrong_seq(), r"line 3"),
}


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


# ---- traces that are not traces --------------------------------------------------------------------


@pytest.mark.parametrize("command", ["check", "replay"])
@pytest.mark.parametrize("case", list(NOT_TRACES))
def test_a_file_that_is_not_a_trace_exits_2_with_the_reason(
    command: str, case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, reason = NOT_TRACES[case]
    path = write(tmp_path / f"{case}.jsonl", content)
    assert main([command, str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"refit {command}: not a refit trace: "), err
    assert str(path) in err and re.search(reason, err), err
    assert "reproduced" not in out and "ok:" not in out


def test_the_fixture_lines_used_above_are_a_real_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """The line-numbered cases edit one line of this trace: unedited, it checks and replays."""
    assert main(["check", str(FIXTURE)]) == 0
    assert main(["replay", str(FIXTURE)]) == 0
    assert "reproduced" in capsys.readouterr().out


def test_replay_refuses_a_trace_with_no_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A context opened and closed without a run: never 'reproduced'."""
    path = write(tmp_path / "no-run.jsonl", HEADER + END)
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "not a refit trace" in err and str(path) in err and "reproduced" not in out


@pytest.mark.parametrize("command", ["check", "replay"])
def test_a_missing_path_or_a_directory_exits_2_naming_it(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main([command, str(missing)]) == 2
    assert capsys.readouterr().err == f"refit {command}: cannot read {missing}: no such file\n"
    assert main([command, str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"refit {command}: cannot read {tmp_path}: it is a directory, not a trace file\n"


def test_bad_traces_through_the_real_command(tmp_path: Path) -> None:
    json_file = write(tmp_path / "config.json", '{"name": "model", "layers": 2}\n')
    empty = write(tmp_path / "empty.jsonl", "")
    for args in (["replay", str(json_file)], ["check", str(empty)], ["check", str(tmp_path / "missing.jsonl")]):
        proc = refit(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and args[1] in proc.stderr
        assert proc.stderr.startswith(f"refit {args[0]}: "), proc.stderr
    assert "not a refit trace" in refit("replay", str(json_file)).stderr


# ---- --version, unknown options ----------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"refit {metadata.version('refit-engine')}\n"
    proc = refit("--version")
    assert proc.returncode == 0 and proc.stdout == f"refit {metadata.version('refit-engine')}\n"


@pytest.mark.parametrize(
    "argv",
    [
        ["check", "--bogus", "x.jsonl"],
        ["replay", "x.jsonl", "--bogus"],
        ["demo", "--nope"],
        ["bench", "control", "--foo"],
        ["soak", "--refits", "3", "--fast"],
        ["diagram", "--where"],
    ],
    ids=" ".join,
)
def test_an_unknown_option_prints_its_subcommand_usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    unknown = next(a for a in argv if a.startswith("--") and a not in ("--refits",))
    assert err.startswith(f"usage: refit {argv[0]} "), err
    assert f"refit {argv[0]}: error: unrecognized arguments: {unknown}" in err
    assert "{demo,check" not in err  # not the top-level usage
    assert out == ""


def test_an_unknown_option_through_the_real_command() -> None:
    proc = refit("bench", "control", "--foo")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: refit bench ") and "unrecognized arguments: --foo" in proc.stderr


# ---- --fail-at is refused before any engine starts ------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fail-at", "bogus:engine=0"], "'bogus' is not a state a fault can fire in (offloading, connecting"),
        (["--fail-at", "done"], "'done' is not a state a fault can fire in"),
        (["--fail-at", "transferring:engine=2"], "engine=2 but there are 2 engines"),
        (["--engines", "4", "--fail-at", "pausing:engine=4"], "engine=4 but there are 4 engines"),
        (
            ["--fail-at", "transferring:call=nope"],
            "no 'nope' call is made in transferring, so a fault there could never fire",
        ),
        (["--engine", "vllm", "--verify", "both"], "vllm driver answers no probe; use --verify digest or off"),
        (["--engine", "sglang", "--verify", "probe"], "sglang driver answers no probe; use --verify digest or off"),
        (
            ["--engine", "sglang", "--fail-at", "transferring:engine=0:bucket=1:kind=swap_qk"],
            "kind=swap_qk is a silent fault, injected inside the reference engine; refit's sglang driver cannot host",
        ),
        (
            ["--fail-at", "transferring:kind=boom"],
            "fault kind 'boom'; known ('raise', 'hang', 'kill', 'corrupt', 'flip'",
        ),
        (["--fail-at", "transferring:call=pause"], "pause never runs in transferring (calls there: abandon, load"),
        (["--fail-at", "pausing:bucket=1"], "bucket= only applies in transferring"),
        (["--fail-at", "transferring:bucket=x"], "bucket must be a non-negative integer, got 'x'"),
        (["--fail-at", "transferring:bucket=-1"], "bucket must be a non-negative integer, got '-1'"),
        (["--fail-at", "transferring:engine=one"], "engine must be a non-negative integer, got 'one'"),
        (["--fail-at", "transferring:wat=1"], "bad fault spec part 'wat=1'"),
        (["--fail-at", "transferring:engine"], "bad fault spec part 'engine'"),
        # the engine index counts engines, not their TP processes or the trainer ranks
        (["--engines", "1", "--engine-tp", "2", "--fail-at", "transferring:engine=1"], "engine=1 but there are 1"),
        (["--ranks", "2", "--transport", "broadcast", "--fail-at", "continuing:engine=2"], "engine=2 but there are 2"),
        (["--transport", "broadcast", "--fail-at", "transferring:call=sned"], "no 'sned' call is made in transferring"),
        (["--engine-tp", "3"], "--engine-tp 3: tensor parallelism 3 does not divide"),
        (["--in-thread", "--engine-tp", "2"], "--in-thread engines have TP=1"),
        (["--in-thread", "--ranks", "2"], "--ranks runs engines as processes; drop --in-thread"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_demo_option_exits_2_before_any_engine_starts(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.monotonic()
    assert main(["demo", *extra]) == 2
    out, err = capsys.readouterr()
    assert message in err and err.startswith("refit demo: "), err
    assert out == ""  # the demo prints "starting ... engine ..." before it starts any
    assert time.monotonic() - t0 < 10


def test_every_trainer_call_a_fault_can_name_is_a_participant_step() -> None:
    for call in cli.TRAINER_CALLS:
        assert callable(getattr(Participant, call, None)), call


def test_a_bad_fail_at_through_the_real_command_is_fast() -> None:
    t0 = time.monotonic()
    proc = refit("demo", "--fail-at", "transferring:engine=7:kind=kill")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        proc.stderr
        == "refit demo: --fail-at: fault spec 'transferring:engine=7:kind=kill': engine=7 but there are 2 engines\n"
    )
    assert proc.stdout == ""  # no engine was started, no trainer trained
    assert time.monotonic() - t0 < 20


# ---- the demo's output --------------------------------------------------------------------------------


def test_the_demo_shows_progress_a_legend_and_its_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "demo.jsonl"
    assert main([*FAST_DEMO, "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^starting 2 reference engine threads \.\.\.\nengines ready in \d+\.\ds\n", out), out
    legend = out[out.index("columns:") : out.index(demo.header())]
    columns = demo.header().replace("total s", "total_s").replace("peak KiB", "peak_KiB").split()
    assert len(columns) == 21
    for column in (c.replace("_", " ") for c in columns if c not in demo.SHORT):  # phases: "offload..restore"
        assert re.search(rf"(^|[ ,]){re.escape(column)}[ ,:]", legend, re.M), column
    assert "offload..restore" in legend
    assert f"trace: {trace}  (check it: refit check {trace}; replay it: refit replay {trace})" in out
    assert "weights bit-exact; extra trainer memory at most 128 KiB\nverified before publish: " in out
    assert main(["check", str(trace)]) == 0


def test_a_passing_demo_without_trace_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # torch's inductor (imported by torch itself) makes its cache directory under the temp dir on first use
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path.parent / "torchinductor"))
    assert main(FAST_DEMO) == 0
    assert "trace:" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_failed_demo_without_trace_keeps_one_and_says_how_to_check_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    argv = [*FAST_DEMO, "--refits", "2", "--retries", "0", "--fail-at", RAISE_AT]
    assert main(argv) == 1
    out = capsys.readouterr().out
    (kept,) = tmp_path.glob("refit-demo-*.jsonl")
    assert "refit 1 did not reach every engine" in out and "engine-1: quarantined" in out
    assert f"trace: {kept} (a temporary file, kept because the demo failed)" in out
    assert f"refit check {kept}; replay it: refit replay {kept}" in out
    assert out.rstrip().endswith("FAILED: refit 1 of 2 did not reach every engine (run state DONE)")
    assert main(["check", str(kept)]) == 0
    assert main(["replay", str(kept)]) == 0
    assert "reproduced" in capsys.readouterr().out


def test_a_failed_demo_through_the_real_command(tmp_path: Path) -> None:
    """The trace hint with --trace; the runner's warning is not printed next to the demo's own report."""
    trace = tmp_path / "raise.jsonl"
    proc = refit(*FAST_DEMO, "--retries", "0", "--fail-at", RAISE_AT, "--trace", str(trace), timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"trace: {trace}  (check it: refit check {trace}" in proc.stdout
    assert "FAILED: refit 1 of 1" in proc.stdout
    assert "refit run" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert refit("check", str(trace)).returncode == 0


# ---- progress of long commands ----------------------------------------------------------------------------


def test_soak_reports_progress_lines_on_stderr_and_json_on_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFIT_PROGRESS", "lines")  # as in a log file asked for them
    assert main(["soak", "--refits", "5", "--in-thread", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)  # stdout is the JSON and nothing else
    assert report["refits"] == 5 and report["ok"] == 5 and report["leaks"] == 0
    lines = err.splitlines()
    assert lines[0] == "soak: starting 2 engine threads, one warm-up refit, then 5 refits ..."
    assert [re.match(r"soak: (\d)/5 refits, [\d.]+/s, [\d.]+s$", line).group(1) for line in lines[1:]] == list("12345")


def test_progress_lines_every_tenth_or_every_interval(capsys: pytest.CaptureFixture[str]) -> None:
    progress = Progress("soak", every_s=3600, how="lines")
    for i in range(1001):
        progress(i, 1000)
    counts = [int(m) for m in re.findall(r"^soak: (\d+)/1000 refits", capsys.readouterr().err, re.M)]
    assert counts == list(range(100, 1001, 100))
    progress = Progress("bench control", every_s=0, how="lines")
    for i in range(31):
        progress(i, 30)
    assert len(capsys.readouterr().err.splitlines()) == 30
    with progress.waiting("waiting for ray.init"):  # a wait of unknown length, as a line: said once
        pass
    assert capsys.readouterr().err == "waiting for ray.init ...\n"


def test_progress_is_quiet_when_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped (a CI log, `2>file`): no bar, no lines, no notes; the results and the JSON unchanged."""
    monkeypatch.delenv("REFIT_PROGRESS", raising=False)
    proc = subprocess.run(
        [str(REFIT), "soak", "--refits", "3", "--in-thread", "--json"], capture_output=True, text=True, timeout=120,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] == 3
    assert "soak" not in proc.stderr and "refits" not in proc.stderr and "\r" not in proc.stderr, proc.stderr


def test_progress_on_a_terminal_is_a_live_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """stderr a real pseudo-terminal: tqdm's bar, redrawn in place, ending at 3/3; stdout (a pipe)
    keeps the report alone."""
    import os
    import pty

    monkeypatch.delenv("REFIT_PROGRESS", raising=False)
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [str(REFIT), "soak", "--refits", "3", "--in-thread"], stdout=subprocess.PIPE, stderr=slave, text=True
    )
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.communicate(timeout=120)[0]
    os.close(master)
    assert proc.returncode == 0
    text = seen.decode(errors="replace")
    assert "soak: starting 2 engine threads" in text  # the note, above the bar
    assert re.search(r"soak: 100%.*\| 3/3 \[", text), text  # tqdm's bar, complete
    assert "\r" in text  # redrawn in place
    assert "3 refits into 2 engine threads" in out and "soak:" not in out


@pytest.mark.e2e
def test_bench_control_reports_progress(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFIT_PROGRESS", "lines")
    assert main(["bench", "control", "--engines", "1", "--refits", "2"]) == 0
    out, err = capsys.readouterr()
    assert "round trips per refit" in out and "bench control" not in out
    assert err.splitlines()[0].startswith("bench control: starting 1 engine processes, 3 warm-up refits, then 2")
    assert re.search(r"^bench control: 5/5 refits, [\d.]+/s", err, re.M), err


# ---- a failed protocol.run says so ---------------------------------------------------------------------


def failing_run(thread_engines, make_ctx, trace: Path) -> protocol.RefitResult:
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=7)
    faults = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="raise")
    return protocol.run(make_ctx(model, thread_engines(2), retries=0, faults=faults, trace=str(trace)))


def test_a_failed_run_logs_a_warning_naming_state_error_and_trace(
    thread_engines, make_ctx, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = tmp_path / "fail.jsonl"
    with caplog.at_level(logging.WARNING, logger="refit"):
        result = failing_run(thread_engines, make_ctx, trace)
    assert not result.ok
    (record,) = [r for r in caplog.records if r.name == "refit.protocol.runner"]
    text = record.getMessage()
    assert record.levelno == logging.WARNING
    assert f"refit run {result.run_id} failed in TRANSFERRING (ended DONE; engines: t0 updated, t1 quarantined)" in text
    assert str(result.error) in text and "InjectedFault" in text
    assert text.endswith(f"trace: {trace}")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="refit"):
        model = perturbed(TinyLlama(CONFIG, seed=0), seed=8)
        assert protocol.run(make_ctx(model, thread_engines(2))).ok
    assert not [r for r in caplog.records if r.name.startswith("refit")]  # a run that is ok says nothing


SCRIPT = """
from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama

engines = [ReferenceEngine.in_thread(f"e{i}", ModelConfig(), seed=0) for i in range(2)]
ctx = protocol.RefitContext(
    TorchSource(TinyLlama(ModelConfig(), seed=1)), SharedMemoryTransport(), engines, retries=0,
    faults=protocol.FaultPlan().fail_at("pausing", engine=0, kind="raise"),
)
result = protocol.run(ctx)
ctx.close()
for e in engines:
    e.close()
print("ok" if result.ok else "not ok")
"""


def test_with_no_logging_configured_the_warning_reaches_stderr() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout == "not ok\n", proc.stderr
    assert re.search(
        r"^refit run \S+ failed in PAUSING \(ended DONE; engines: e0 stale, e1 updated\)", proc.stderr, re.M
    )
    assert "trace: not written (RefitContext(trace=PATH) writes one)" in proc.stderr


def test_demo_logit_check_scales_with_the_logits() -> None:
    """fp32 rounding from a fused matmul grows with the logits' size as training sharpens them: the
    demo allows 1e-5 x max(1, max|logit|), so a long run with large logits is not a false mismatch,
    while twice that allowance still fails."""
    import torch

    from refit.demo import PROMPTS, check_engine
    from refit.reference.model import ModelConfig, TinyLlama, greedy, prompt_logits

    model = TinyLlama(ModelConfig(), seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # large logits, as after long training
    logits = [prompt_logits(model, list(p)) for p in PROMPTS]
    big = float(max(t.abs().max() for t in logits))
    assert big > 10

    class Engine:  # serves the trainer's tokens and weights, and its logits off by `delta`
        def __init__(self, delta: float) -> None:
            self.delta = delta

        def generate(self, prompt: list[int], n: int) -> dict[str, list[int]]:
            return {"output": greedy(model, list(prompt), n)}

        def score(self, prompt: list[int]) -> torch.Tensor:
            return prompt_logits(model, list(prompt)) + self.delta

        def state_dict(self) -> dict[str, torch.Tensor]:
            return model.state_dict()

    previous = [t - 1.0 for t in logits]  # the old weights' logits: far enough for the check to bite
    within = check_engine(Engine(0.5e-5 * big), model, previous)  # type: ignore[arg-type]
    assert within["ok"] and within["max_diff"] > 1e-5
    assert not check_engine(Engine(2e-5 * big), model, previous)["ok"]  # type: ignore[arg-type]


def test_a_demo_whose_engine_served_wrong_weights_says_why_it_was_retried(capsys: pytest.CaptureFixture[str]) -> None:
    """A silent fault (q and k swapped by the engine's loader): verification rejects the engine,
    the retry repairs it, and the demo names the reason and the tensors."""
    argv = [*FAST_DEMO, "--fail-at", "transferring:engine=0:bucket=1:kind=swap_qk"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| verify digest (digest xxh3)" in out  # the header names the digest kind the runs compare by
    assert "retried and caught up: engine-0 (verify failed: EngineError: unverified:" in out
    assert "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.q_proj.weight" in out


def test_the_demos_verify_help_says_what_vllm_verifies_by() -> None:
    """--engine vllm verifies by vLLM's own checksums by default: the help says so (it said off,
    'whose driver reports neither yet')."""
    _, subs = cli._parser()
    text = " ".join(subs["demo"].format_help().split())
    assert "neither yet" not in text
    assert "vLLM's own checksums" in text
    assert demo.verify_mode(cli._parser()[0].parse_args(["demo", "--engine", "vllm"])) == "digest"


def test_demo_atomic_stages_while_generating_and_stops_only_to_swap(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FAST_DEMO, "--mode", "disaggregated", "--atomic"]) == 0
    out = capsys.readouterr().out
    assert "(atomic: stage, then swap)" in out
    head = next(line for line in out.splitlines() if line.startswith("refit ver"))
    assert head.split()[3:10] == ["connect", "stage", "transfer", "post", "verify", "swap", "continue"]
    assert "tokens equal" in out or " equal " in out


def test_demo_atomic_in_a_colocated_run_is_refused_saying_why(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*FAST_DEMO, "--atomic"]) == 2
    err = capsys.readouterr().err
    assert "needs --mode disaggregated (colocated engines give their memory to the trainer)" in err
    assert "Traceback" not in err


def test_demo_refuses_a_trace_path_it_cannot_write_before_any_engine_starts(tmp_path: Path) -> None:
    """`refit demo --trace` naming a directory, a folder that does not exist (nothing is created) or
    a place that cannot be written: exit 2 at once, naming the path and why, no traceback."""
    cases = [
        (str(tmp_path), "it is a directory"),
        (str(tmp_path / "missing" / "x.jsonl"), "does not exist (refit demo creates none)"),
        ("/proc/refit-trace.jsonl", "cannot write there"),
    ]
    for path, why in cases:
        proc = refit("demo", "--trace", path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (path, proc.stdout, proc.stderr)
        assert proc.stderr.startswith(f"refit demo: --trace {path}: ") and why in proc.stderr, proc.stderr
        assert proc.stdout == ""  # refused before any engine started (the demo reports each refit here)
    assert not (tmp_path / "missing").exists()


def test_replay_of_a_trace_cut_mid_run_says_so_first_and_counts_what_it_left_out(tmp_path: Path) -> None:
    """`refit replay` on a trace cut off mid-run says so before anything else (as `refit check` does),
    replays the complete runs before it, and never reports the cut as a divergence. Both commands
    account for the same events: check counts every event, replay the ones it replayed and, by
    why, the ones it did not."""
    lines = fixture_lines()
    whole = refit("replay", str(FIXTURE))
    check = refit("check", str(FIXTURE))
    counted = int(re.search(r"(\d+) events", check.stdout).group(1))
    replayed = int(re.search(r"replayed 1 run\(s\), (\d+) events", whole.stdout).group(1))
    assert whole.returncode == 0 and replayed + 1 == counted == len(lines) - 1  # the header is not an event
    assert "(not replayed: 1 injected faults" in whole.stdout
    for name, text in (("cut.jsonl", "".join(lines[:40])), ("torn.jsonl", "".join(lines[:40]) + lines[40][:25])):
        path = write(tmp_path / name, text)
        proc = refit("replay", str(path))
        assert proc.returncode == 1 and "DIVERGED" not in proc.stdout and "Traceback" not in proc.stderr, proc.stdout
        first = proc.stdout.splitlines()[0]
        assert first.startswith("the trace was cut off mid-run: run ") and "has no end event" in first, first
        assert ("the trace's last line is cut off" in first) == (name == "torn.jsonl")
        assert "the cut-off run cannot be replayed" in proc.stdout
        assert "nothing reproduced: the trace holds no complete run" in proc.stdout  # its only run was cut
        assert "reproduced the complete runs" not in proc.stdout
        checked = refit("check", str(path))
        assert checked.returncode == 1
        if name == "cut.jsonl":  # one cut, one violation: the run's missing end and the trace's are one fact
            assert checked.stdout.count("VIOLATION complete") == 1, checked.stdout
            assert "the trace was cut off mid-run (or the job died): the run has no end event" in checked.stdout


def test_a_fault_that_could_never_fire_is_refused_when_planned_naming_the_calls_that_exist() -> None:
    """`FaultPlan.fail_at` refuses a (state, call) pair the runner never makes (a trainer call from
    an older release, a call of another state), naming the calls that state has; the demo refuses
    an empty --fail-at instead of taking it as no fault."""
    from refit.protocol.faults import FaultPlan

    with pytest.raises(ValueError, match=r"no 'metas' call is made in transferring, so a fault there could never "
                       r"fire \(its calls: abandon, load, pack, release, send\)"):  # fmt: skip
        FaultPlan().fail_at("transferring", call="metas")
    with pytest.raises(ValueError, match="'resting' is not a state a fault can fire in"):
        FaultPlan().fail_at("resting")
    assert FaultPlan().fail_at("draining", call="drain").faults[0].call == "drain"
    proc = refit("demo", "--fail-at", "")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith("refit demo: --fail-at: fault spec '': ") and "is not a state" in proc.stderr


def test_diagram_outside_the_repository_writes_nothing_and_says_where_to_run_it(tmp_path: Path) -> None:
    """`refit diagram` in a folder with no docs/diagrams/ (not the repository) writes nothing and
    exits 2 saying so; with --out it writes there and prints the absolute path it wrote."""
    proc = subprocess.run(
        [str(REFIT), "diagram"], capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []
    assert "no docs/diagrams/ here" in proc.stderr and "give --out DIR" in proc.stderr, proc.stderr
    out = tmp_path / "diagrams"
    proc = subprocess.run([str(REFIT), "diagram", "--out", str(out)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout == f"wrote {out / 'refit-states.md'}\n", proc.stdout + proc.stderr


def test_help_shows_every_options_default() -> None:
    """Each option of each command with a default (not None, not off) says it in `--help`; the
    real console script's `refit soak --help` shows them (it showed none before)."""
    import argparse

    _, subs = cli._parser()
    for name, parser in subs.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (
                not action.option_strings
                or action.default is None
                or action.default is False
                or action.default == argparse.SUPPRESS
            ):
                continue
            shown = formatter._get_help_string(action) or ""
            assert "default" in shown, (name, action.option_strings, shown)
    proc = refit("soak", "--help")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    flat = " ".join(proc.stdout.split())
    for text in ("consecutive refits (default: 1000)", "reference engines (default: 2)", "(default: disaggregated)"):
        assert text in flat, proc.stdout
    demo_help = " ".join(refit("demo", "--help").stdout.split())
    assert "in_place keeping it (--engine reference only, with --kv keep and --mode disaggregated" in demo_help


def test_a_wait_of_unknown_length_ticks_on_a_terminal_then_clears() -> None:
    """`Progress.waiting` on a real pseudo-terminal: its text with the elapsed time, redrawn while
    the wait lasts (tqdm is told to redraw every half second), and gone when the wait ends."""
    import os
    import pty

    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:
        progress = Progress("ray", how="bar", stream=tty)
        with progress.waiting("waiting for ray.init"):
            time.sleep(1.3)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    text = seen.decode(errors="replace")
    assert "waiting for ray.init: 00:00" in text and "waiting for ray.init: 00:01" in text, text
    assert not [t for t in threading.enumerate() if t.name == "refit-progress"]  # its ticker ended


def test_a_tp_fault_the_demos_engines_cannot_take_is_refused_before_they_start(thread_engines, make_ctx) -> None:
    """`--fail-at ...kind=swap_tp` with TP=1 engines (or kv_replica where no KV head is shared) was
    turned into a loud fault named 'no arm_fault', and the demo passed: it is refused up front,
    naming the --engine-tp it needs; in a user's own run, the error says why the engine refused."""
    for spec, need in (("kind=swap_tp", "--engine-tp 2 or more"), ("kind=kv_replica", "--engine-tp 4 or more")):
        proc = refit("demo", "--fail-at", f"transferring:engine=0:bucket=1:{spec}", "--engine-tp", "2"
                     if spec == "kind=kv_replica" else "1", "--refits", "1")  # fmt: skip
        assert proc.returncode == 2 and need in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert "engines ready" not in proc.stdout
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=3)
    faults = protocol.FaultPlan().fail_at("transferring", engine=0, bucket=0, kind="swap_tp")
    result = protocol.run(make_ctx(model, thread_engines(1), faults=faults, retries=0))
    assert not result.ok and "it refused" in str(result.error) and "it needs TP ranks" in str(result.error)


def test_demo_atomic_without_a_mode_that_stages_is_refused_before_any_engine_starts() -> None:
    """`refit demo --atomic` (the default mode is colocated) was refused only after the engines
    started, in the library's words (mode='disaggregated'); now up front, in the CLI's."""
    for args, want in (
        (["--atomic"], "needs --mode disaggregated"),
        (["--atomic", "--mode", "disaggregated", "--engine", "vllm"], "vllm driver cannot stage"),
    ):
        proc = refit("demo", *args, "--refits", "1")
        assert proc.returncode == 2 and want in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert "engines ready" not in proc.stdout and "starting" not in proc.stdout


def test_bench_gpu_passes_the_lora_tokens_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """`refit bench gpu --paths lora --lora-tokens N` hands N to the lora path (the GPU itself is
    not needed to see the argument arrive: the bench is stubbed past the device check)."""
    from refit import bench_gpu

    seen: dict[str, object] = {}
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    monkeypatch.setattr(bench_gpu, "gpu", lambda *a, **kw: seen.update(kw) or {"shapes": {}})
    monkeypatch.setattr(bench_gpu, "table", lambda report: "")
    assert main(["bench", "gpu", "--shapes", "7b", "--paths", "lora", "--lora-tokens", "24"]) == 0
    assert seen["lora_tokens"] == 24 and seen["paths"] == ("lora",)
    assert main(["bench", "gpu", "--lora-tokens", "0"]) == 2  # a count: refused
