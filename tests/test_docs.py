"""Every fenced code block in README.md and docs/*.md runs (issue 25): the docs cannot rot.

How a block is treated is decided by its language and by an HTML comment on the line right above
its fence, `<!-- docs-test: DIRECTIVE; DIRECTIVE ... -->`:

  ```python   a complete program, run in a fresh interpreter (`sys.executable`, cwd a temporary
              directory, PYTHONPATH with the repository's src); it must exit 0.
              `torchrun N`: run under `python -m torch.distributed.run --nproc-per-node N`.
  ```bash     each command line (continuations joined) runs in order with `bash -c`, in a temporary
              directory holding links to the repository's examples/, tests/ and benchmarks/, with
              `refit` and `python` meaning this interpreter and this checkout; each must exit 0,
              or N where the line ends with the comment `# exits N`.
  ```text     not code: program output (`output`, shown, not compared) or a drawing or listing
              (`figure`); one of the two must be said.
  ```mermaid  a diagram generated from the state table (`refit diagram`; tests/test_diagram.py
              checks it is current); not run.

  `expect "TEXT"`  (repeatable) the block's stdout must contain TEXT.
  `timeout N`      seconds the block may take (default 120).
  `not run (REASON[, REASON])`  the block cannot run on a CPU CI machine without network; REASON
              must be one of REASONS. Any other directive, reason or language fails the test.

Each block is its own test (ids `FILE:LINE`), so `--durations=0` shows the slow ones.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # docs/diagrams is generated
REASONS = frozenset(
    {
        "needs a CUDA GPU",
        "needs two GPUs",
        "needs a real SGLang or vLLM server",
        "CI's own setup step",
        "the test command itself",
    }
)
CODE = frozenset({"python", "bash"})
DEFAULT_TIMEOUT = 120.0
LINKED = ("examples", "tests", "benchmarks")  # what bash blocks may name by a relative path

_FENCE = re.compile(r"^```([\w-]*)\s*$")
_MARK = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_EXITS = re.compile(r"#\s*exits\s+(\d+)\b")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    run: bool = True
    launcher: tuple[str, int] | None = None  # ("torchrun", nprocs)
    reasons: list[str] = field(default_factory=list)
    kind: str = ""  # "output" or "figure" for a text block
    expect: list[str] = field(default_factory=list)
    timeout: float = DEFAULT_TIMEOUT

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _directives(block: Block, text: str) -> None:
    for part in (p.strip() for p in text.split(";") if p.strip()):
        if m := re.fullmatch(r"torchrun (\d+)", part):
            block.launcher = ("torchrun", int(m.group(1)))
        elif m := re.fullmatch(r"not run \((.+)\)", part):
            block.run = False
            block.reasons = [r.strip() for r in m.group(1).split(",")]
            unknown = [r for r in block.reasons if r not in REASONS]
            if unknown:
                raise ValueError(f"{block.id}: unknown reason {unknown} (allowed: {sorted(REASONS)})")
        elif m := re.fullmatch(r'expect "(.+)"', part):
            block.expect.append(m.group(1))
        elif m := re.fullmatch(r"timeout (\d+(?:\.\d+)?)", part):
            block.timeout = float(m.group(1))
        elif part in ("output", "figure"):
            block.kind = part
        else:
            raise ValueError(f"{block.id}: unknown docs-test directive {part!r}")


def parse(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of one Markdown file, with their directives; raises on a block the test
    would not know how to treat."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path}:{start + 1}: unclosed code block")
        block = Block(path, start + 1, lang, "\n".join(lines[start + 1 : end]) + "\n")
        mark = _MARK.match(lines[start - 1]) if start > 0 else None
        if mark:
            _directives(block, mark.group(1))
        if lang in CODE:
            if block.kind:
                raise ValueError(f"{block.id}: a {lang} block is code, not {block.kind}")
        elif lang == "text":
            if not block.kind:
                raise ValueError(f"{block.id}: a text block must be marked `output` or `figure`")
            block.run = False
        elif lang == "mermaid":
            block.run = False
        else:
            raise ValueError(f"{block.id}: fence language {lang!r}: use python, bash, text or mermaid")
        if block.launcher and lang != "python":
            raise ValueError(f"{block.id}: a launcher is for python blocks")
        blocks.append(block)
        i = end + 1
    return blocks


def all_blocks() -> tuple[list[Block], list[str]]:
    """Every file's blocks, and what could not be parsed (a file with a problem adds no block)."""
    blocks, problems = [], []
    for p in DOC_FILES:
        try:
            blocks += parse(p)
        except ValueError as exc:
            problems.append(str(exc))
    return blocks, problems


BLOCKS, PROBLEMS = all_blocks()


def commands(code: str) -> list[tuple[str, int]]:
    """A bash block's command lines (continuations joined, comments and blank lines dropped), each
    with the exit status it must have (`# exits N` at its end; 0 otherwise)."""
    out: list[tuple[str, int]] = []
    pending = ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _EXITS.search(line)
        out.append((line, int(m.group(1)) if m else 0))
    return out


def _env(bindir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(bindir), env.get("PATH", "")))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("REFIT_PROGRESS", None)  # as a user's: progress on stderr only on a terminal
    return env


def _shims(tmp: Path) -> Path:
    """`refit` and `python` for bash blocks: this interpreter, this checkout (an installed `refit`
    script may import another)."""
    bindir = tmp / ".bin"
    bindir.mkdir()
    for name, cmd in (
        ("refit", f"{shlex.quote(sys.executable)} -m refit.cli"),
        ("python", shlex.quote(sys.executable)),
    ):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nexec {cmd} "$@"\n')
        shim.chmod(0o755)
    return bindir


def _report(what: str, proc: subprocess.CompletedProcess[str]) -> str:
    return f"{what}: exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.run], ids=lambda b: b.id)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    env = _env(_shims(tmp_path))
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
        if block.launcher:
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(block.launcher[1]),
                str(script),
            ]
        proc = subprocess.run(
            argv, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=block.timeout
        )
        assert proc.returncode == 0, _report(block.id, proc)
        stdout = proc.stdout
    else:
        for name in LINKED:
            (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
        stdout = ""
        lines = commands(block.code)
        assert lines, f"{block.id}: a bash block with no command"
        for line, status in lines:
            proc = subprocess.run(
                ["bash", "-c", line],
                check=False,
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=block.timeout,
            )
            assert proc.returncode == status, _report(f"{block.id}: `{line}` (must exit {status})", proc)
            assert "Traceback (most recent call last)" not in proc.stderr, _report(f"{block.id}: `{line}`", proc)
            stdout += proc.stdout
    for text in block.expect:
        assert text in stdout, f"{block.id}: expected {text!r} in its output:\n{stdout[-3000:]}"


def test_every_block_is_accounted_for() -> None:
    """Each block runs or says, from the fixed list, why it cannot; the count is printed."""
    from .conftest import SUMMARY

    assert not PROBLEMS, "\n".join(PROBLEMS)
    not_run = [b for b in BLOCKS if b.lang in CODE and not b.run]
    for b in not_run:
        assert b.reasons, f"{b.id}: not run without a reason"
    ran = [b for b in BLOCKS if b.run]
    assert ran, "no runnable block found"
    assert {p.name for p in DOC_FILES} >= {"README.md"}
    listed = ", ".join(f"{b.id} [{'; '.join(b.reasons)}]" for b in not_run)
    SUMMARY.append(f"docs: {len(ran)} code blocks run, {len(not_run)} not run ({listed})")


def test_the_parser_refuses_what_it_cannot_treat() -> None:
    fake = ROOT / "fake.md"
    ok = parse(
        fake,
        "<!-- docs-test: not run (needs a CUDA GPU) -->\n```python\nx\n```\n"
        '<!-- docs-test: torchrun 2; expect "hi"; timeout 30 -->\n```python\nprint("hi")\n```\n'
        "<!-- docs-test: output -->\n```text\nout\n```\n"
        "```bash\nrefit demo --fail-at x   # exits 1\nrefit check \\\n  t.jsonl\n```\n",
    )
    assert [(b.lang, b.run) for b in ok] == [("python", False), ("python", True), ("text", False), ("bash", True)]
    assert ok[1].launcher == ("torchrun", 2) and ok[1].expect == ["hi"] and ok[1].timeout == 30
    assert commands(ok[3].code) == [("refit demo --fail-at x   # exits 1", 1), ("refit check    t.jsonl", 0)]
    for bad in (
        "<!-- docs-test: not run (too slow) -->\n```python\nx\n```\n",  # not an allowed reason
        "<!-- docs-test: skip -->\n```python\nx\n```\n",  # not a directive
        "```text\nx\n```\n",  # output or figure?
        "```\nx\n```\n",  # no language
        "```js\nx\n```\n",
        "```python\nx\n",  # unclosed
    ):
        with pytest.raises(ValueError):
            parse(fake, bad)
