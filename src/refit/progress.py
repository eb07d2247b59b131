"""Progress of long commands (`refit soak`, `refit bench`, `refit demo --ray`) on stderr; their
results (and `--json`) stay on stdout.

Three ways to show it, chosen by `mode`:
- "bar": a live `tqdm` bar per count of refits, and for a wait of unknown length (a Ray cluster
  starting) a line whose elapsed time ticks. This is the default when stderr is a terminal.
- "lines": plain lines, for a log file. A count prints a line every tenth of its total, or every
  `every_s` seconds, whichever comes first, and one at the end.
- "off": nothing. This is the default when stderr is not a terminal (a pipe, a file, CI).

`REFIT_PROGRESS=bar|lines|off` overrides the default. tqdm is imported only for a bar; where it is
missing, a bar falls back to lines.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, TextIO

MODES = ("bar", "lines", "off")


def mode(stream: TextIO | None = None) -> str:
    """How progress is shown on `stream` (stderr): `REFIT_PROGRESS` if set, else "bar" on a
    terminal and "off" elsewhere."""
    chosen = os.environ.get("REFIT_PROGRESS", "").strip().lower()
    if chosen in MODES:
        return chosen
    stream = stream if stream is not None else sys.stderr
    try:
        return "bar" if stream.isatty() else "off"
    except (AttributeError, ValueError):  # a closed or odd stream
        return "off"


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # a bar falls back to lines
        return None
    tqdm.monitor_interval = 0  # no monitor thread: a command that counts its threads (soak) sees none of ours
    return tqdm


def _size(stream: TextIO) -> dict[str, int]:
    """The terminal's size as tqdm's `ncols`/`nrows`: 80 x 24 where it says 0 or cannot say (tqdm
    draws nothing on a terminal 0 rows high, such as a pseudo-terminal nobody sized)."""
    try:
        size = os.get_terminal_size(stream.fileno())
        return {"ncols": size.columns or 80, "nrows": size.lines or 24}
    except (AttributeError, OSError, ValueError):
        return {"ncols": 80, "nrows": 24}


class Progress:
    """A long command's progress: `progress(done, total)` counts refits (`done == 0` starts the
    clock: the work proper begins), `note(text)` says what is happening, and `waiting(text)` wraps a
    wait of unknown length."""

    def __init__(
        self, label: str, *, every_s: float = 2.0, how: str | None = None, stream: TextIO | None = None
    ) -> None:
        self.label = label
        self.every_s = every_s
        self.stream = stream if stream is not None else sys.stderr
        self.how = how if how is not None else mode(self.stream)
        self._tqdm = _tqdm() if self.how == "bar" else None
        if self.how == "bar" and self._tqdm is None:
            self.how = "lines"
        self.t0 = self.last = time.monotonic()
        self.step = 1
        self._bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.how == "off":
            return
        if done == 0:
            self.t0 = self.last = now
            self.step = max(1, math.ceil(total / 10))
            if self._tqdm is not None:
                self.close()
                self._bar = self._tqdm(
                    total=total, desc=self.label, unit="refit", file=self.stream, leave=True, **_size(self.stream)
                )
            return
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            if done >= total:
                self.close()
            return
        if done == total or done % self.step == 0 or now - self.last >= self.every_s:
            self.last = now
            elapsed = now - self.t0
            rate = done / elapsed if elapsed > 0 else float("inf")
            self._print(f"{self.label}: {done}/{total} refits, {rate:.3g}/s, {elapsed:.1f}s")

    def note(self, text: str) -> None:
        """A line saying what the command does now (above a bar, if one is showing)."""
        if self.how == "off":
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self._print(text)

    @contextlib.contextmanager
    def waiting(self, text: str) -> Iterator[None]:
        """A wait of unknown length: on a terminal, `text` with its elapsed seconds ticking (the
        line is removed when the wait ends); as lines, `text` once; off, nothing."""
        if self.how == "off":
            yield
            return
        if self._tqdm is None:
            self._print(f"{text} ...")
            yield
            return
        bar = self._tqdm(
            total=None, desc=text, bar_format="{desc}: {elapsed}", file=self.stream, **_size(self.stream),
            leave=False,
        )  # fmt: skip
        stop = threading.Event()

        def tick() -> None:  # tqdm redraws only when told: the elapsed time moves every half second
            while not stop.wait(0.5):
                bar.refresh()

        ticker = threading.Thread(target=tick, name="refit-progress", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            stop.set()
            ticker.join()
            bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
