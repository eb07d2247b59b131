"""docs/diagrams is generated from the table; the committed copy must be current."""

from __future__ import annotations

from pathlib import Path

import pytest

from refit import diagram
from refit.cli import main
from refit.states import TRANSITIONS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "diagrams"


def test_committed_diagram_is_current() -> None:
    assert diagram.is_current(DOCS, ROOT / "README.md"), "stale: run `refit diagram` and commit the result"
    assert diagram.README_START in (ROOT / "README.md").read_text()


def test_diagram_has_every_edge() -> None:
    text = diagram.mermaid()
    for trigger, sources, dest in TRANSITIONS:
        for src in sources:
            assert f"{src} --> {dest}: {trigger}" in text


def test_diagram_command_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{diagram.README_START}\nold\n{diagram.README_END}\nrest\n")
    args = ["diagram", "--out", str(tmp_path / "d"), "--readme", str(readme)]
    assert main([*args, "--check"]) == 1  # nothing there yet
    assert "does not exist" in capsys.readouterr().err
    assert main(args) == 0
    assert main([*args, "--check"]) == 0
    assert "old" not in readme.read_text() and "IDLE --> CONNECTING: connect" in readme.read_text()
    assert readme.read_text().endswith("rest\n")
    (tmp_path / "d" / diagram.DIAGRAM_FILE).write_text("stale", encoding="utf-8")
    assert main([*args, "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
