"""README's "try the driver yourself" example runs as written (the whole-docs check is issue 25's):
it drives the SGLang driver against an emulated server, verified by SGLang's own checksums."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_sglang_example_runs_as_written() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (block,) = [b for b in blocks if "EmulatedSGLang(" in b]
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)  # the README's own example
    assert set(scope["weights"]) >= {"model.embed_tokens.weight"}  # type: ignore[arg-type]
