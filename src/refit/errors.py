"""Every error refit raises, in one small hierarchy (re-exported by `refit.protocol.errors`).

Each error names where it happened: the run's state, the engine, the driver call and, in the
bucket loop, the bucket. Messages are written for the person reading a failed job's log.
"""

from __future__ import annotations


class RefitError(Exception):
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

    def __init__(self, message: str, *, cause: BaseException | None = None, **where: object) -> None:
        self.cause = cause
        super().__init__(message, **where)  # type: ignore[arg-type]


class DeadlineExceeded(DriverCallError):
    """A driver call (or lock wait) did not finish inside the run's deadline. Its effect is unknown."""


class InvariantViolation(RefitError):
    """A refit invariant failed on the run's own events: the protocol or a driver is broken."""


NO_EFFECT_KINDS = frozenset(
    {"bad_manifest", "bad_payload", "bad_request", "not_attached", "no_session", "session_open", "session_broken"}
)


class EngineError(RuntimeError):
    """Raised by a rollout engine for a request it refuses (bad manifest, flush refused, ...).

    `kind` is a short machine-readable tag (for example ``flush_refused``) that survives the trip
    across a process boundary. `no_effect` is True when the engine guarantees it changed nothing
    (the request was rejected by validation before any byte was applied): a bucket refused that
    way does not poison the engine.
    """

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        self.message = message
        super().__init__(f"{kind}: {message}")

    @property
    def no_effect(self) -> bool:
        return self.kind in NO_EFFECT_KINDS


class NoTimeLeft(TimeoutError):
    """The run's budget was spent before a call could start: the engine itself is not to blame."""


class EngineDied(RuntimeError):
    """The engine's process or connection is gone."""
