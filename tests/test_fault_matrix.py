"""The fault matrix: every active state x fault kind x {first, last engine} x {first, middle, last
bucket} (the bucket only matters in TRANSFERRING), each a real refit into two reference engines
whose faults happen inside the engine (hang, kill, corrupt) or at the call (raise), with no
retries so every fault shows its own handling, here over shared memory (the collective broadcast
transports: test_fault_matrix_broadcast.py; the cases and checks: fault_matrix.py). After each: trace
invariants, engine-side audit invariants, acks, the lock, and that no engine serves weights its
version does not name. The count of violations is printed in the test summary; it must be 0."""

from __future__ import annotations

from .conftest import SUMMARY
from .fault_matrix import KINDS, check_matrix, run_case


def test_fault_matrix_shm() -> None:
    check_matrix("shm")


def test_fault_matrix_shm_with_one_version_in_service() -> None:
    """The same matrix under `max_staleness=0`: an engine a fault left behind is held (stale),
    never continued on the old version while the other serves the new one."""
    check_matrix("shm", max_staleness=0)


def test_fault_matrix_atomic() -> None:
    """Atomic runs (stage, then swap): every state they pass (CONNECTING, STAGING, TRANSFERRING,
    POST_PROCESSING, VERIFYING, SWAPPING, CONTINUING) x kind x engine; an engine a fault left
    behind is held (`max_staleness=0`), and no engine ever serves weights its version does not
    name."""
    check_matrix("shm", max_staleness=0, atomic=True)


# the steady state's pause wave (probe, pause, flush, begin, load of bucket 0) and bucket 0's pack
STEADY_STATES = (("CONNECTING", None), ("PAUSING", None), ("INVALIDATING", None), ("TRANSFERRING", 0))


def test_fault_matrix_steady_state_first_bucket_rides_the_pause_wave() -> None:
    """Every fault kind, on either engine, at every step of the wave that carries bucket 0 in the
    steady state (a second refit of a disaggregated context), and at bucket 0's pack (raise, hang):
    the same checks as the matrix above."""
    matrix = [("shm", st, kind, engine, b) for st, b in STEADY_STATES for kind in KINDS for engine in (0, 1)]
    violations = {case: problems for case in matrix if (problems := run_case(*case, steady=True))}
    packs = {("pack", kind): problems for kind in ("raise", "hang")
             if (problems := run_case("shm", "TRANSFERRING", kind, None, 0, steady=True, call="pack"))}  # fmt: skip
    SUMMARY.append(
        f"fault matrix (shm, steady state): {len(matrix) + 2} cases (the wave carrying bucket 0 x 4 kinds x 2 engines, "
        f"+ bucket 0's pack x 2 kinds), {sum(len(v) for v in [*violations.values(), *packs.values()])} violations"
    )
    assert not violations and not packs, {**violations, **packs}
