"""`refit bench control|transport` run and write their JSON (small sizes here; the figures in
docs/benchmarks.md come from the full-size commands). No timing is asserted: only that the
figures exist, are consistent, and that every refit they timed landed bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refit.cli import main

pytestmark = pytest.mark.e2e


def test_bench_control_writes_its_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "control.json"
    assert main(["bench", "control", "--engines", "2", "--refits", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"engines", "refits", "round_trips_per_refit", "control_ms_median", "control_ms_p99"} <= set(report)
    assert report["engines"] == 2 and report["refits"] == 3 and report["round_trips_per_refit"] == 2
    assert 0 < report["control_ms_median"] <= report["control_ms_p99"]
    assert report["stall_ms_median"] >= report["transfer_ms_median"] > 0
    assert "round trips per refit: 2" in capsys.readouterr().out


def test_bench_transport_writes_its_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transport.json"
    assert main(["bench", "transport", "--small", "--refits", "1", "--bucket-mb", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out  # a few MB: no verdict on the goal, and says why
    assert "goal (zero_copy" not in printed and "MISSED" not in printed and "judged on the full-size state" in printed
    report = json.loads(out.read_text())
    assert {"bytes", "gbps", "memcpy_gbps", "ratio"} <= set(report)
    assert report["bit_exact"] and report["bytes"] > 0 and report["buckets"] > 1
    assert set(report["variants"]) == {"zero_copy", "zero_copy_no_checksums", "copy"}
    g, m = report["gbps"], report["memcpy_gbps"]  # each rounded to 3 decimals, as the ratio is
    assert report["ratio"] == pytest.approx(g / m, abs=0.0005 + 0.0005 / m + 0.0005 * g / m**2)
