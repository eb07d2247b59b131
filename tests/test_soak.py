"""The 50-refit soak (the 1,000-refit one is `refit soak`, figures in docs/benchmarks.md): real
engine processes, a fault every 10th refit; nothing may leak and the weights must match."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import SUMMARY

pytestmark = pytest.mark.e2e


def test_fifty_refits_leak_nothing() -> None:
    """In a process of its own (`refit soak`): fds, threads and segments are counted process-wide,
    so what other tests left running in the pytest process must not be counted as the soak's."""
    proc = subprocess.run(
        [sys.executable, "-m", "refit.cli", "soak", "--refits", "50", "--engines", "2", "--fault-every", "10",
         "--verify-every", "25", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    SUMMARY.append(
        f"soak: {report['refits']} refits, {report['injected_faults']} injected faults, {report['leaks']} leaks "
        f"(shm segments, fds, threads, processes), {report['refits_per_second']} refits/s"
    )
    assert report["mismatches"] == 0
    assert report["injected_faults"] == 5 and report["ok"] == 50  # every fault was retried and caught up
    assert (report["segments_growth"], report["fds_growth"], report["threads_growth"]) == (0, 0, 0)
    assert (report["segments_left"], report["processes_left"], report["threads_left"]) == (0, 0, 0)
