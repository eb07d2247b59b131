"""Every error refit raises, in one small hierarchy (re-exported by `refit.protocol.errors`).

Each error names where it happened: the run's state, the engine, the driver call and, in the
bucket loop, the bucket. Messages are written for the person reading a failed job's log. Every
error survives pickling (across a process, a Ray actor or a trace) with its kind, its message,
where it happened and whether it had no effect.
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], state: dict[str, Any], args: tuple[Any, ...]) -> BaseException:
    err = cls.__new__(cls)
    err.__dict__.update(state)
    err.args = args
    return err


class _Picklable(Exception):
    """Pickles by state, not by constructor arguments (so keyword-only fields survive)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), dict(self.__dict__), self.args))


class RefitError(_Picklable):
    """Base class. Not raised directly."""

    def __init__(
        self,
        message: str,
        *,
        state: str | None = None,
        engine: str | None = None,
        call: str | None = None,
        bucket: int | None = None,
    ) -> None:
        self.message = message
        self.state = state
        self.engine = engine
        self.call = call
        self.bucket = bucket
        super().__init__(self._render())

    def _render(self) -> str:
        where = [
            f"{k}={v}"
            for k, v in (
                ("state", self.state),
                ("engine", self.engine),
                ("call", self.call),
                ("bucket", self.bucket),
            )
            if v is not None
        ]
        return f"{self.message} [{', '.join(where)}]" if where else self.message

    @property
    def no_effect(self) -> bool:
        """True when the failed call is known to have changed nothing."""
        return bool(getattr(getattr(self, "cause", None), "no_effect", False))


class ConfigError(RefitError, ValueError):
    """The RefitContext asks for something the drivers cannot do safely; nothing was started."""


class IllegalTransition(RefitError):
    """The state table refuses this trigger from this state (a runner or driver bug)."""

    def __init__(self, state: str, trigger: str) -> None:
        self.trigger = trigger
        super().__init__(f"trigger {trigger!r} is not legal from state {state}", state=state)


class RefitBusyError(RefitError):
    """Another run holds the engines' lock; this run did nothing."""


class DriverCallError(RefitError):
    """A driver call failed; `cause` is the driver's own exception."""

    def __init__(self, message: str, *, cause: BaseException | None = None, **where: Any) -> None:
        self.cause = cause
        super().__init__(message, **where)


class DeadlineExceeded(DriverCallError):
    """A driver call (or lock wait) did not finish inside the run's deadline. Its effect is unknown."""


class LateAnswer(DriverCallError):
    """A driver answered after the budget it was given: it ignores its `timeout`, a driver bug.
    Its answer is not trusted (the effect of the call is unknown) and the trace marks it `late`."""

    @property
    def no_effect(self) -> bool:
        return False


class InvariantViolation(RefitError):
    """A refit invariant failed on the run's own events: the protocol or a driver is broken."""


NO_EFFECT_KINDS = frozenset(
    {
        "bad_manifest", "bad_payload", "bad_request", "not_attached", "no_session", "session_open", "session_broken",
        "version_ahead", "unauthorized", "unsupported", "not_probed", "restarted", "misconfigured",
        "memory_unknown", "staged", "no_staged", "not_paused", "busy", "not_serving",
    }
)  # fmt: skip


class EngineError(_Picklable, RuntimeError):
    """Raised by a rollout engine for a request it refuses (bad manifest, flush refused, ...).

    `kind` is a short machine-readable tag (for example ``flush_refused``) that survives the trip
    across a process boundary. `no_effect` is True when the engine guarantees it changed nothing
    (the request was rejected by validation before any byte was applied): a bucket refused that
    way does not poison the engine.
    """

    def __init__(self, kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.message = message
        self.data = data or {}  # small JSON-safe facts for the runner (the version a probe found, ...)
        super().__init__(f"{kind}: {message}")

    @property
    def no_effect(self) -> bool:
        return self.kind in NO_EFFECT_KINDS


class NoTimeLeft(_Picklable, TimeoutError):
    """The run's budget was spent before a call could start: the engine itself is not to blame."""


class EngineDied(_Picklable, RuntimeError):
    """The engine's process or connection is gone."""


class RankError(_Picklable, RuntimeError):
    """A trainer rank's share of a step failed (or did not answer); `rank` names it."""

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        self.message = message
        super().__init__(f"rank {rank}: {message}")
