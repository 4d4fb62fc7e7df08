"""The realtime JSON events on the wire, both ways, with OpenAI Realtime (GA) names and shapes.

Client events are parsed and validated here (pydantic; unknown fields are tolerated, as OpenAI clients
send more than omni_rt uses); server events are built here as plain dicts. Nothing here touches a
socket: `peer.py` moves the events, `docs/protocol.md` documents them.
"""

from __future__ import annotations

import base64
import json
import secrets
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_MESSAGE_BYTES = 256 * 1024  # an SDP offer is a few kB; a text message far less
MAX_TEXT_CHARS = 16_000  # one user message
INPUT_SAMPLE_RATE = 24_000  # input_audio_buffer.append carries 24 kHz mono PCM16, as OpenAI's does
MAX_APPEND_MS = 2_000  # audio in one append; clients send 20-100 ms at a time
# base64 of MAX_APPEND_MS of PCM16: 4 characters per 3 bytes
MAX_APPEND_CHARS = -(-INPUT_SAMPLE_RATE * MAX_APPEND_MS // 1000 * 2 // 3) * 4


class ProtocolError(Exception):
    """A client event that cannot be served; becomes one `error` event.

    `fatal` errors (unreadable JSON, bad SDP, oversized messages) close the connection after the error
    is sent: the client is not speaking this protocol. The others leave the connection open.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        param: str | None = None,
        event_id: str | None = None,
        fatal: bool = False,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.event_id = event_id
        self.fatal = fatal
        self.type = type


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


# -- client → server ---------------------------------------------------------------------------------


TokenLimit = Annotated[int, Field(ge=1, le=1_000_000)] | Literal["inf"]


class _Event(BaseModel):
    model_config = ConfigDict(extra="allow")
    event_id: str | None = None


class AudioOutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    voice: str | None = Field(default=None, min_length=1, max_length=64)


class TurnDetectionFields(BaseModel):
    """`turn_detection`: `server_vad` or `semantic_vad` (omni_rt.audio.semantic). Missing fields: defaults."""

    model_config = ConfigDict(extra="allow")
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    eagerness: Literal["low", "medium", "high", "auto"] | None = None  # semantic_vad's
    threshold: float | None = Field(default=None, gt=0.0, lt=1.0)
    prefix_padding_ms: int | None = Field(default=None, ge=0, le=5_000)
    silence_duration_ms: int | None = Field(default=None, ge=20, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None


class AudioFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = INPUT_SAMPLE_RATE


class AudioInputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: AudioFormat | None = None
    # null turns server VAD off; an absent key leaves it as it is (see `turn_detection_given`)
    turn_detection: TurnDetectionFields | None = None


class AudioConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    input: AudioInputConfig | None = None
    output: AudioOutputConfig | None = None


class SessionFields(BaseModel):
    """The parts of a session object a client may set. Unset fields keep their value."""

    model_config = ConfigDict(extra="allow")
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output_modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    audio: AudioConfig | None = None
    max_output_tokens: TokenLimit | None = None
    # Older (beta) clients send these flat.
    voice: str | None = Field(default=None, min_length=1, max_length=64)
    modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    turn_detection: TurnDetectionFields | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionFields

    def turn_detection(self) -> tuple[bool, TurnDetectionFields | None]:
        """(given, value): whether the update sets `turn_detection` (GA `audio.input.turn_detection`
        or beta `turn_detection`), and to what; `None` as a value turns server VAD off."""
        s = self.session
        audio_input = s.audio.input if s.audio is not None else None
        if audio_input is not None and "turn_detection" in audio_input.model_fields_set:
            return True, audio_input.turn_detection
        if "turn_detection" in s.model_fields_set:
            return True, s.turn_detection
        return False, None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)


class Item(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = Field(default=None, max_length=64)
    type: Literal["message"] = "message"
    role: Literal["user", "system", "assistant"] = "user"
    content: list[ContentPart] = Field(min_length=1, max_length=64)


class ConversationItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


class ResponseFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output_modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    max_output_tokens: TokenLimit | None = None


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseFields = Field(default_factory=ResponseFields)


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


class OutputAudioBufferClear(_Event):
    type: Literal["output_audio_buffer.clear"]


class WebRtcOffer(_Event):
    type: Literal["webrtc.offer"]
    sdp: str = Field(min_length=1, max_length=MAX_MESSAGE_BYTES)


class InputAudioBufferAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str = Field(max_length=MAX_APPEND_CHARS)  # base64 PCM16, 24 kHz mono, little-endian

    def pcm(self) -> np.ndarray:
        """The samples, int16; malformed audio is an `invalid_value` error."""
        try:
            data = base64.b64decode(self.audio, validate=True)
        except (ValueError, TypeError):
            raise ProtocolError(
                "invalid_value",
                "audio must be base64 (PCM16 little-endian)",
                param="audio",
                event_id=self.event_id,
            ) from None
        if len(data) % 2:
            raise ProtocolError(
                "invalid_value", "audio must be whole PCM16 samples (an even number of bytes)",
                param="audio", event_id=self.event_id,
            )  # fmt: skip
        return np.frombuffer(data, dtype="<i2").astype(np.int16)


class InputAudioBufferCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class InputAudioBufferClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ConversationItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str = Field(min_length=1, max_length=64)
    content_index: int = Field(default=0, ge=0)
    audio_end_ms: int = Field(ge=0)


CLIENT_EVENTS: dict[str, type[_Event]] = {
    "session.update": SessionUpdate,
    "conversation.item.create": ConversationItemCreate,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
    "output_audio_buffer.clear": OutputAudioBufferClear,
    "webrtc.offer": WebRtcOffer,
    "input_audio_buffer.append": InputAudioBufferAppend,
    "input_audio_buffer.commit": InputAudioBufferCommit,
    "input_audio_buffer.clear": InputAudioBufferClear,
    "conversation.item.truncate": ConversationItemTruncate,
}


def parse_client_event(raw: str | bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> _Event:
    """One client message → a validated event, or `ProtocolError`."""
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ProtocolError(
            "message_too_large", f"message of {size} bytes exceeds the limit of {max_bytes}", fatal=True
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("invalid_json", f"message is not valid JSON: {exc}", fatal=True) from None
    except RecursionError:  # a few kB of "[[[[..." exhaust the parser's recursion limit
        raise ProtocolError("invalid_json", "message is nested too deeply", fatal=True) from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError(
            "invalid_event", "an event must be a JSON object with a string 'type'", fatal=True
        )
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    model = CLIENT_EVENTS.get(data["type"])
    if model is None:
        raise ProtocolError(
            "unknown_event", f"unsupported event type {data['type'][:64]!r}", param="type", event_id=event_id
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(
            "invalid_value", f"{data['type']}: {param}: {first['msg']}", param=param, event_id=event_id
        ) from None


def user_text(item: Item) -> str:
    """The text of a user message item (its `input_text` parts, in order)."""
    texts = [p.text for p in item.content if p.type in ("input_text", "text") and p.text]
    if not texts:
        raise ProtocolError(
            "invalid_value",
            "a message needs at least one non-empty 'input_text' content part",
            param="item.content",
        )
    return "\n".join(texts)


# -- server → client ---------------------------------------------------------------------------------


def _event(type: str, **fields: Any) -> dict[str, Any]:
    return {"type": type, "event_id": new_id("event"), **fields}


def error(exc: ProtocolError) -> dict[str, Any]:
    return _event(
        "error",
        error={
            "type": exc.type,
            "code": exc.code,
            "message": exc.message,
            "param": exc.param,
            "event_id": exc.event_id,
        },
    )


def session_object(
    session_id: str,
    model: str,
    voice: str,
    instructions: str,
    output_modalities: list[str],
    sample_rate: int,
    max_output_tokens: int | str = "inf",
    turn_detection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": list(output_modalities),
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": INPUT_SAMPLE_RATE},
                "turn_detection": turn_detection,
            },
            "output": {"format": {"type": "audio/pcm", "rate": sample_rate}, "voice": voice},
        },
    }


def session_created(session: dict[str, Any]) -> dict[str, Any]:
    return _event("session.created", session=session)


def session_updated(session: dict[str, Any]) -> dict[str, Any]:
    return _event("session.updated", session=session)


def webrtc_answer(sdp: str) -> dict[str, Any]:
    return _event("webrtc.answer", sdp=sdp)


def item_object(item_id: str, role: str, text: str, status: str = "completed") -> dict[str, Any]:
    part_type = "input_text" if role == "user" else "output_audio"
    part = {"type": part_type, "text": text} if role == "user" else {"type": part_type, "transcript": text}
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": [part],
    }


def input_audio_item(item_id: str) -> dict[str, Any]:
    """A user message made of the speech the input audio buffer committed (no transcription here)."""
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": "completed",
        "role": "user",
        "content": [{"type": "input_audio", "transcript": None}],
    }


def conversation_item_truncated(item_id: str, content_index: int, audio_end_ms: int) -> dict[str, Any]:
    return _event(
        "conversation.item.truncated", item_id=item_id, content_index=content_index, audio_end_ms=audio_end_ms
    )


def conversation_item_added(item: dict[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return _event("conversation.item.added", previous_item_id=previous_item_id, item=item)


def conversation_item_done(item: dict[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return _event("conversation.item.done", previous_item_id=previous_item_id, item=item)


def response_object(
    response_id: str,
    status: str,
    output: list[dict[str, Any]] | None = None,
    *,
    status_details: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    response: dict[str, Any] = {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "usage": usage,
    }
    if metrics is not None:
        response["metrics"] = metrics  # omni_rt's addition: latency figures of this response
    return response


def response_created(response_id: str) -> dict[str, Any]:
    return _event("response.created", response=response_object(response_id, "in_progress"))


def response_done(response: dict[str, Any]) -> dict[str, Any]:
    return _event("response.done", response=response)


def _part_fields(response_id: str, item_id: str) -> dict[str, Any]:
    return {"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0}


def transcript_delta(response_id: str, item_id: str, delta: str) -> dict[str, Any]:
    return _event("response.output_audio_transcript.delta", **_part_fields(response_id, item_id), delta=delta)


def transcript_done(response_id: str, item_id: str, transcript: str) -> dict[str, Any]:
    return _event(
        "response.output_audio_transcript.done", **_part_fields(response_id, item_id), transcript=transcript
    )


def text_delta(response_id: str, item_id: str, delta: str) -> dict[str, Any]:
    return _event("response.output_text.delta", **_part_fields(response_id, item_id), delta=delta)


def text_done(response_id: str, item_id: str, text: str) -> dict[str, Any]:
    return _event("response.output_text.done", **_part_fields(response_id, item_id), text=text)


def audio_delta(response_id: str, item_id: str, pcm: np.ndarray) -> dict[str, Any]:
    """Audio for clients without a media track: little-endian PCM16, base64, as OpenAI sends it."""
    data = np.asarray(pcm, dtype="<i2").tobytes()
    return _event(
        "response.output_audio.delta",
        **_part_fields(response_id, item_id),
        delta=base64.b64encode(data).decode("ascii"),
    )


def audio_done(response_id: str, item_id: str) -> dict[str, Any]:
    return _event("response.output_audio.done", **_part_fields(response_id, item_id))


def output_audio_buffer(kind: Literal["started", "stopped", "cleared"], response_id: str) -> dict[str, Any]:
    """WebRTC only: the media track began / finished playing a response's audio, or dropped it."""
    return _event(f"output_audio_buffer.{kind}", response_id=response_id)


def metrics_dict(metrics: Any) -> dict[str, Any]:
    """A session's metrics (a pydantic model, a dataclass, a dict or None) as JSON-ready numbers."""
    if metrics is None:
        return {}
    if hasattr(metrics, "model_dump"):
        data = metrics.model_dump()
    elif isinstance(metrics, dict):
        data = dict(metrics)
    else:
        data = {k: v for k, v in vars(metrics).items() if not k.startswith("_")}
    return {k: v for k, v in data.items() if v is None or isinstance(v, int | float | str | bool)}
