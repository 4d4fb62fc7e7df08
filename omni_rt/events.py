"""Events a Session yields, named as the OpenAI Realtime API (GA) names them.

Each event is a pydantic model with a literal `type`. In process, audio travels as a numpy int16 array
(`ResponseOutputAudioDelta.pcm`); `to_wire()` gives the JSON-ready dict of the Realtime protocol (audio
as base64 PCM16 little-endian), from `omni_rt.wire`, the serialiser the server uses.
"""

from __future__ import annotations

import base64
import itertools
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "Event",
    "ResponseCreated",
    "ResponseOutputTextDelta",
    "ResponseOutputAudioTranscriptDelta",
    "ResponseOutputAudioDelta",
    "ResponseOutputAudioDone",
    "ResponseDone",
    "ConversationTruncated",
    "InputAudioBufferSpeechStarted",
    "InputAudioBufferSpeechStopped",
    "InputAudioBufferCommitted",
    "InputAudioBufferCleared",
    "ErrorEvent",
    "ErrorInfo",
    "Usage",
    "Metrics",
    "AnyEvent",
]

_ids = itertools.count(1)


def _event_id() -> str:
    return f"event_{next(_ids)}"


class Event(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    type: str
    event_id: str = Field(default_factory=_event_id)

    def to_wire(self, item_id: str | None = None) -> dict[str, Any]:
        """The Realtime protocol's JSON object for this event, as `omni-rt serve` sends it: built by
        `omni_rt.wire`, the one serialiser. A response's events name the assistant item `item_id`."""
        from omni_rt import wire

        return wire.from_event(self, item_id)


class _ResponseEvent(Event):
    response_id: str


class ResponseCreated(_ResponseEvent):
    type: Literal["response.created"] = "response.created"


class ResponseOutputTextDelta(_ResponseEvent):
    """New text of the reply, as soon as the Thinker samples it."""

    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    token_ids: list[int]


class ResponseOutputAudioTranscriptDelta(_ResponseEvent):
    """Text the audio has reached: sent when the Talker consumes those tokens (one per codec frame)."""

    type: Literal["response.output_audio_transcript.delta"] = "response.output_audio_transcript.delta"
    delta: str


class ResponseOutputAudioDelta(_ResponseEvent):
    """A chunk of PCM: mono int16 at `sample_rate`. `frame_index` is the chunk's first codec frame."""

    type: Literal["response.output_audio.delta"] = "response.output_audio.delta"
    pcm: np.ndarray
    sample_rate: int
    frame_index: int
    num_frames: int

    @field_validator("pcm")
    @classmethod
    def _int16_mono(cls, v: np.ndarray) -> np.ndarray:
        if not isinstance(v, np.ndarray) or v.dtype != np.int16 or v.ndim != 1:
            raise ValueError("pcm must be a 1-D numpy int16 array")
        return v

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / self.sample_rate

    def b64(self) -> str:
        """The PCM as the wire carries it: base64 of little-endian int16."""
        return base64.b64encode(self.pcm.astype("<i2", copy=False).tobytes()).decode("ascii")


class ResponseOutputAudioDone(_ResponseEvent):
    type: Literal["response.output_audio.done"] = "response.output_audio.done"


class Usage(BaseModel):
    model_config = ConfigDict(frozen=True)

    input_tokens: int = 0  # new prompt tokens prefilled for this response
    cached_tokens: int = 0  # conversation tokens reused from the session's KV cache
    output_tokens: int = 0  # text tokens generated
    audio_frames: int = 0  # codec frames generated (80 ms each)


class Metrics(BaseModel):
    """Per-response timings, all in ms from `respond()` on one monotonic clock (time.perf_counter)."""

    model_config = ConfigDict(frozen=True)

    ttft_ms: float | None = None  # first text delta handed to the caller
    ttfa_ms: float | None = None  # first audio delta handed to the caller
    thinker_first_token_ms: float | None = None  # Thinker sampled its first token
    talker_first_code_ms: float | None = None  # Talker sampled code 0 of frame 0
    first_pcm_ms: float | None = None  # Code2Wav produced its first PCM
    total_ms: float | None = None
    text_tokens_per_s: float | None = None  # decode tokens after the first over their time
    audio_seconds: float = 0.0
    rtf: float | None = None  # generation time / audio duration
    # a speculative response (Session.speculate): how long its output was held back before release;
    # the other times count from its speculative start
    held_ms: float | None = None
    # how the Thinker's yield to this response's first audio ended (EngineSettings.yield_to_talker_ms):
    # "first_audio" or "frame0" (what it waited for came), "not_needed" (already out), "cap", "stop";
    # None where no yield ran
    thinker_yield: str | None = None


class ErrorInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    type: str  # "invalid_request_error" | "server_error" | ...
    code: str | None = None  # the omni_rt exception class name, e.g. "InvalidRequestError"
    message: str


class ResponseDone(_ResponseEvent):
    """Always the last event of a response, whatever happened."""

    type: Literal["response.done"] = "response.done"
    status: Literal["completed", "cancelled", "failed"]
    usage: Usage = Field(default_factory=Usage)
    metrics: Metrics = Field(default_factory=Metrics)
    error: ErrorInfo | None = None


class ConversationTruncated(_ResponseEvent):
    """The conversation with this response's turn outgrew the context: its oldest turns were dropped
    (the session's `truncation`; the system turn stays). Comes right after response.created."""

    type: Literal["conversation.truncated"] = "conversation.truncated"
    dropped_turns: int
    dropped_tokens: int
    kept_tokens: int  # the conversation before this turn, after the drop
    retention_ratio: float


# -- the input audio buffer (speech input with server VAD) ------------------------------------------------
# Times are milliseconds of audio written to the input buffer since it began, as the Realtime API counts.


class InputAudioBufferSpeechStarted(Event):
    """Speech began at `audio_start_ms` (prefix padding included); it will become user item `item_id`."""

    type: Literal["input_audio_buffer.speech_started"] = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


class InputAudioBufferSpeechStopped(Event):
    """The silence window after the speech completed at `audio_end_ms`."""

    type: Literal["input_audio_buffer.speech_stopped"] = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


class InputAudioBufferCommitted(Event):
    """The turn's audio became user item `item_id`, after `previous_item_id` in the conversation."""

    type: Literal["input_audio_buffer.committed"] = "input_audio_buffer.committed"
    item_id: str
    previous_item_id: str | None = None


class InputAudioBufferCleared(Event):
    type: Literal["input_audio_buffer.cleared"] = "input_audio_buffer.cleared"


class ErrorEvent(Event):
    type: Literal["error"] = "error"
    error: ErrorInfo
    response_id: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, response_id: str | None = None) -> ErrorEvent:
        from omni_rt.errors import InvalidRequestError, OmniRtError

        kind = "invalid_request_error" if isinstance(exc, InvalidRequestError) else "server_error"
        code = exc.code if isinstance(exc, OmniRtError) else type(exc).__name__
        return cls(error=ErrorInfo(type=kind, code=code, message=str(exc)), response_id=response_id)


AnyEvent = Annotated[
    ResponseCreated
    | ResponseOutputTextDelta
    | ResponseOutputAudioTranscriptDelta
    | ResponseOutputAudioDelta
    | ResponseOutputAudioDone
    | ResponseDone
    | ConversationTruncated
    | InputAudioBufferSpeechStarted
    | InputAudioBufferSpeechStopped
    | InputAudioBufferCommitted
    | InputAudioBufferCleared
    | ErrorEvent,
    Field(discriminator="type"),
]
