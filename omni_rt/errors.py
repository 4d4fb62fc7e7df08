"""Typed exceptions of omni_rt. Every error a caller can act on has its own class here."""


class OmniRtError(Exception):
    """Base class of every omni_rt error. `code` is its `error.code` in error events: the class name,
    unless a class documents a wire code of its own."""

    @property
    def code(self) -> str:
        return type(self).__name__


class ConfigError(OmniRtError, ValueError):
    """A setting, preset or checkpoint config that cannot be used."""


class WeightError(OmniRtError, ValueError):
    """A checkpoint tensor that is unknown, missing or mis-shaped; the message names the tensor."""


class InvalidRequestError(OmniRtError, ValueError):
    """A request that cannot be served as asked (empty input, unknown voice, too long, bad rate).

    It fails that request only; the engine and other sessions carry on.
    """


class CapacityError(OmniRtError):
    """No free session slot or cache room for this request."""


class SessionLimitError(CapacityError):
    """The engine's ceiling of sessions (`EngineSettings.max_sessions`) is reached: raised at once by
    `Engine.session()`, or, where `EngineSettings.admission_wait_s` > 0, when a session has waited that
    long for one to close. Its code is `session_limit`, as the server's (close 1013, HTTP 503)."""

    code = "session_limit"  # type: ignore[assignment]  # a class constant over the base's property


class EngineClosedError(OmniRtError, RuntimeError):
    """The engine is not running (not started, or stopped)."""


class StageError(OmniRtError, RuntimeError):
    """A pipeline stage failed while serving a request."""


class EngineStalledError(OmniRtError, RuntimeError):
    """A stage call has not returned for `EngineSettings.stall_timeout_s` (the device stopped making
    progress): every response in flight ends with it, and new ones are refused, until the process is
    restarted. Its code is `engine_stalled`."""

    code = "engine_stalled"  # type: ignore[assignment]  # a class constant over the base's property
