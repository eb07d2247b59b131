"""The fault matrix (see test_fault_matrix.py) over the collective broadcast transport, where one
failed member breaks the group for all: checksummed buckets, and per-tensor broadcasts received
straight into the engines' weights (NCCL's layout, no checksums, so no `corrupt` kind). RECONNECTING
(rebuilding the group without a dead member before a retry) is reached by a kill at bucket 1 plus
the fault under test, with one retry."""

from __future__ import annotations

import pytest

from .fault_matrix import check_matrix


@pytest.mark.parametrize("transport", ["broadcast", "broadcast_direct"])
def test_fault_matrix(transport: str) -> None:
    check_matrix(transport)
