"""Typed exceptions of omni_rt. Every error a caller can act on has its own class here."""


class OmniRtError(Exception):
    """Base class of every omni_rt error."""


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


class EngineClosedError(OmniRtError, RuntimeError):
    """The engine is not running (not started, or stopped)."""


class StageError(OmniRtError, RuntimeError):
    """A pipeline stage failed while serving a request."""
