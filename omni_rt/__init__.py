"""omni_rt: an embeddable real-time SDK for Qwen3-Omni speech (Thinker → Talker → Code2Wav).

    import omni_rt
    engine = omni_rt.Engine.load("tiny")
    async with engine:
        async with engine.session(voice="ethan") as s:
            async for ev in s.respond("Hello!"):
                ...

Public API only: Engine, Session, settings (EngineSettings, SessionSettings, Sampling), the events, the
preset names and the typed errors. Importing omni_rt does not import torch; loading a model does.
"""

from omni_rt import errors, events
from omni_rt.config import PRESETS, EngineSettings, Sampling, SessionSettings, StageSampling
from omni_rt.engine import Engine
from omni_rt.errors import (
    CapacityError,
    ConfigError,
    EngineClosedError,
    InvalidRequestError,
    OmniRtError,
    SessionLimitError,
    StageError,
    WeightError,
)
from omni_rt.events import (
    ConversationTruncated,
    ErrorEvent,
    Event,
    Metrics,
    ResponseCreated,
    ResponseDone,
    ResponseOutputAudioDelta,
    ResponseOutputAudioDone,
    ResponseOutputAudioTranscriptDelta,
    ResponseOutputTextDelta,
    Usage,
)
from omni_rt.session import Session

__all__ = [
    "Engine",
    "Session",
    "EngineSettings",
    "SessionSettings",
    "Sampling",
    "StageSampling",
    "PRESETS",
    "errors",
    "events",
    "Event",
    "ResponseCreated",
    "ResponseOutputTextDelta",
    "ResponseOutputAudioTranscriptDelta",
    "ResponseOutputAudioDelta",
    "ResponseOutputAudioDone",
    "ResponseDone",
    "ConversationTruncated",
    "ErrorEvent",
    "Usage",
    "Metrics",
    "OmniRtError",
    "ConfigError",
    "WeightError",
    "InvalidRequestError",
    "CapacityError",
    "SessionLimitError",
    "EngineClosedError",
    "StageError",
]
