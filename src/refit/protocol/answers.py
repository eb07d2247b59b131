"""What a driver's answer to a wave must be (the step-result contract), checked as data, and how
long past a call's budget the protocol waits for a driver whose own timeout should have fired."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from refit.drivers.base import StepResult, outcome_of
from refit.errors import DeadlineExceeded, DriverCallError, RefitError

SLACK_S = 0.5  # how long past a wave's budget to wait for drivers whose own timeout should fire


def malformed(results: Any, n: int) -> BaseException | None:
    """Why a driver's answer for `n` steps breaks the contract, or None."""
    if not isinstance(results, list) or not results or len(results) > n:
        got = len(results) if isinstance(results, list) else type(results).__name__
        return RuntimeError(f"driver returned {got} results for {n} steps")
    if not all(isinstance(r, StepResult) and r.outcome in ("ok", "error", "timeout") for r in results):
        return RuntimeError(f"driver returned something other than StepResults: {results!r:.200}")
    if any(not r.ok for r in results[:-1]):
        return RuntimeError("driver went on after a failed step")
    if len(results) < n and results[-1].ok:
        return RuntimeError(f"driver returned {len(results)} results for {n} steps, none of them failed")
    return None


def clean(r: StepResult) -> StepResult:
    """The result with its timing fields made numbers (a driver may leave them out)."""
    seconds = r.seconds if isinstance(r.seconds, int | float) else 0.0
    done_at = r.done_at if isinstance(r.done_at, int | float) else None
    if seconds is r.seconds and done_at is r.done_at:
        return r
    return StepResult(r.outcome, r.value, r.error, float(seconds), done_at)


def first_result(fut: Future[list[StepResult]], budget: float) -> StepResult:
    if not fut.done():
        return StepResult("timeout", error=TimeoutError(f"no answer within {budget:.3g}s"))
    exc = fut.exception() or malformed(fut.result(), 1)
    if exc is not None:
        return StepResult(outcome_of(exc), error=exc)
    return clean(fut.result()[0])


def wrap_error(exc: BaseException, call: str, state: str, engine: str | None, bucket: int | None) -> RefitError:
    """`exc` as a RefitError naming where it happened (a RefitError is kept as it is)."""
    if isinstance(exc, RefitError):
        return exc
    where = {"state": state, "engine": engine, "call": call, "bucket": bucket}
    if isinstance(exc, TimeoutError):  # concurrent.futures.TimeoutError is TimeoutError
        return DeadlineExceeded(f"{call} did not finish inside the deadline: {exc}", cause=exc, **where)
    return DriverCallError(f"{call} failed: {type(exc).__name__}: {exc}", cause=exc, **where)
