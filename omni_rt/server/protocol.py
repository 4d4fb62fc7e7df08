"""The realtime JSON events on the wire, both ways, with OpenAI Realtime (GA) names and shapes.

Client events are parsed and validated here (pydantic; unknown fields are tolerated, as OpenAI clients
send more than omni_rt uses); server events are built by `omni_rt.wire`, the one serialiser. Nothing here touches a
socket: `peer.py` moves the events, `docs/protocol.md` documents them.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from omni_rt import wire
from omni_rt.conversation import input_limit
from omni_rt.errors import OmniRtError, SessionLimitError
from omni_rt.server.tools import ToolChoice, Tools
from omni_rt.tools import tool_call_text, tool_response

INPUT_SAMPLE_RATE = wire.INPUT_SAMPLE_RATE
# Audio in one append: clients stream 20-100 ms at a time, but OpenAI takes up to 15 MiB in one and
# its guide appends a whole recorded file so; 30 s is what the input buffer holds (and the rate limit's
# burst). The peer hears a long one in slices (SpeechInput.append).
MAX_APPEND_MS = 30_000
# One client message: an append of MAX_APPEND_MS as base64 (1.9 MB); every other event is far smaller,
# and its fields have their own limits. A larger one fails alone (parse_client_event).
MAX_MESSAGE_BYTES = 2 * 1024 * 1024
MAX_SDP_BYTES = 256 * 1024  # an SDP offer is a few kB
MAX_TEXT_CHARS = 16_000  # one user message
# base64 of MAX_APPEND_MS of PCM16: 4 characters per 3 bytes
MAX_APPEND_CHARS = -(-INPUT_SAMPLE_RATE * MAX_APPEND_MS // 1000 * 2 // 3) * 4


def unopened_code(exc: OmniRtError) -> str:
    """The error code for a session the engine did not open: `session_limit` at the engine's ceiling
    (as at the server's own), else `session_unavailable` (the engine stopped, ...)."""
    return exc.code if isinstance(exc, SessionLimitError) else "session_unavailable"


class ProtocolError(Exception):
    """A client event that cannot be served; becomes one `error` event.

    `fatal` errors (a WebRTC offer that cannot be answered) close the connection after the error is
    sent. The others, unreadable JSON too, fail only their message: the connection and what was said
    in it stay.
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


# OpenAI's voice names, for clients that send them (a default such as `alloy` or `marin`), mapped to
# Qwen3-Omni's speakers by their register; docs/protocol.md carries this table. A model voice name is
# taken as it is.
OPENAI_VOICES = {
    "alloy": "chelsie",
    "ash": "aiden",
    "ballad": "aiden",
    "coral": "chelsie",
    "echo": "ethan",
    "sage": "chelsie",
    "shimmer": "chelsie",
    "verse": "ethan",
    "marin": "chelsie",
    "cedar": "ethan",
}


# -- client → server ---------------------------------------------------------------------------------


TokenLimit = Annotated[int, Field(ge=1, le=1_000_000)] | Literal["inf"]


class _Event(BaseModel):
    model_config = ConfigDict(extra="allow")
    event_id: str | None = None


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
    # omni_rt's: start the reply at a pause that may end the turn, held back until it does (speculative.py)
    speculative_response: bool | None = None


class AudioFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = INPUT_SAMPLE_RATE


class AudioOutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Checked as the input's is: a client that asked for G.711 must not get PCM16 it would misread.
    format: AudioFormat | None = None
    voice: str | None = Field(default=None, min_length=1, max_length=64)


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
    # A transcription session (OpenAI's other kind) is not served: refused rather than answered.
    type: Literal["realtime"] | None = None
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output_modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    audio: AudioConfig | None = None
    max_output_tokens: TokenLimit | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    # Older (beta) clients send these flat.
    voice: str | None = Field(default=None, min_length=1, max_length=64)
    modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    turn_detection: TurnDetectionFields | None = None
    input_audio_format: Literal["pcm16"] | None = None
    output_audio_format: Literal["pcm16"] | None = None


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: SessionFields


def turn_detection_of(s: SessionFields) -> tuple[bool, TurnDetectionFields | None]:
    """(given, value): whether a session configuration sets `turn_detection` (GA
    `audio.input.turn_detection` or beta `turn_detection`), and to what; `None` turns server VAD off."""
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
    """A message (its role and content), a function call the assistant made (`call_id`, `name`,
    `arguments`), or its result (`call_id`, `output`)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = Field(default=None, max_length=64)
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "system", "assistant"] = "user"
    content: list[ContentPart] = Field(default_factory=list, max_length=64)
    call_id: str | None = Field(default=None, min_length=1, max_length=64)
    name: str | None = Field(default=None, min_length=1, max_length=64)
    arguments: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)

    @model_validator(mode="after")
    def _complete(self) -> Item:
        if self.type == "message" and not self.content:
            raise ValueError("a message needs content")
        if self.type == "function_call" and (self.call_id is None or self.name is None):
            raise ValueError("a function_call needs call_id and name")
        if self.type == "function_call_output" and (self.call_id is None or self.output is None):
            raise ValueError("a function_call_output needs call_id and output")
        return self


class ConversationItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = None
    item: Item


Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


class ResponseFields(BaseModel):
    model_config = ConfigDict(extra="allow")
    instructions: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    output_modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)
    modalities: list[Literal["audio", "text"]] | None = Field(default=None, min_length=1)  # beta name
    max_output_tokens: TokenLimit | None = None
    metadata: Metadata | None = Field(default=None, max_length=16)
    audio: AudioConfig | None = None
    conversation: Literal["auto", "none"] = "auto"
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None

    @property
    def voice(self) -> str | None:
        return self.audio.output.voice if self.audio is not None and self.audio.output is not None else None


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
    sdp: str = Field(min_length=1, max_length=MAX_SDP_BYTES)


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


class ConversationItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str = Field(min_length=1, max_length=64)


class ConversationItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str = Field(min_length=1, max_length=64)


CLIENT_EVENTS: dict[str, type[_Event]] = {
    "conversation.item.retrieve": ConversationItemRetrieve,
    "conversation.item.delete": ConversationItemDelete,
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
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("invalid_json", f"message is not valid JSON: {exc}") from None
    except RecursionError:  # a few kB of "[[[[..." exhaust the parser's recursion limit
        raise ProtocolError("invalid_json", "message is nested too deeply") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError("invalid_event", "an event must be a JSON object with a string 'type'")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        # Only this event fails (a recording appended whole: OpenAI takes 15 MiB): it was read whole,
        # and parsing it was bounded by the WebSocket's own frame limit, twice this one (app.py).
        raise ProtocolError(
            "message_too_large",
            f"message of {size} bytes exceeds the limit of {max_bytes}: append long audio in parts",
            event_id=event_id,
        )
    model = CLIENT_EVENTS.get(data["type"])
    if model is None:
        raise ProtocolError(
            "unknown_event", f"unsupported event type {data['type'][:64]!r}", param="type", event_id=event_id
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = field_path(data, first)
        raise ProtocolError(
            "invalid_value", f"{data['type']}: {param}: {first['msg']}", param=param, event_id=event_id
        ) from None


def field_path(data: Any, error: Any) -> str:
    """The field a pydantic error is about, as the client wrote it (`session.max_output_tokens`):
    the error's `loc` also names the union member that was tried (`constrained-int`,
    `literal['auto','none','required']`), which is no field of the client's."""
    path, node, loc = [], data, error["loc"]
    for i, part in enumerate(loc):
        if (
            isinstance(node, dict)
            and part in node
            or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        ):
            path.append(str(part))
            node = node[part]
        elif i == len(loc) - 1 and error["type"] == "missing":
            path.append(str(part))  # a required field the client left out
    return ".".join(path)


_TEXT_PARTS = ("input_text", "output_text", "text")


def message_text(item: Item) -> str:
    """The text of a message item (its `input_text` / `output_text` / `text` parts, in order). Other
    parts (`input_audio`, `input_image`, `output_audio`) are refused: dropping them would leave the model
    a different message than the client sent. Speech comes through the input audio buffer."""
    for i, part in enumerate(item.content):
        if part.type not in _TEXT_PARTS:
            raise ProtocolError(
                "unsupported_value",
                f"content parts of type {part.type[:64]!r} are not supported in conversation.item.create: "
                "send text parts, and speech with input_audio_buffer.append and .commit",
                param=f"item.content.{i}.type",
            )
    texts = [p.text for p in item.content if p.text]
    if not texts:
        raise ProtocolError(
            "invalid_value",
            "a message needs at least one non-empty 'input_text' (or, for the assistant, 'output_text') "
            "content part",
            param="item.content",
        )
    return "\n".join(texts)


def item_turn(item: Item) -> tuple[str, str]:
    """(role, text) of an item as a turn of the chat template: a function's result is a user turn
    (`<tool_response>`), a call the assistant's turn that made it."""
    if item.type == "function_call_output":
        return "user", tool_response(item.output or "")
    if item.type == "function_call":
        try:
            arguments = json.loads(item.arguments or "{}")
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ProtocolError("invalid_value", "arguments must be a JSON object", param="item.arguments")
        return "assistant", tool_call_text(item.name or "", json.dumps(arguments))
    return item.role, message_text(item)


def item_wire(item: Item, item_id: str, text: str) -> dict[str, Any]:
    """The item as the server echoes it (`conversation.item.added` / `.done` / `.retrieved`)."""
    if item.type == "function_call_output":
        return wire.function_call_output_item(item_id, item.call_id or "", item.output or "")
    if item.type == "function_call":
        return wire.function_call_item(
            item_id, item.call_id or "", item.name or "", item.arguments or "{}", "completed"
        )
    return wire.item_object(item_id, item.role, text)


# -- server → client: built by omni_rt.wire (the one serialiser) ------------------------------------


def error(exc: ProtocolError) -> dict[str, Any]:
    """The `error` event a ProtocolError becomes."""
    return wire.error(exc.type, exc.code, exc.message, param=exc.param, event_id=exc.event_id)


def model_voice(engine: Any, name: str) -> str:
    """A voice a client named (the model's own, or an OpenAI name, by `OPENAI_VOICES`)."""
    voice = OPENAI_VOICES.get(name.lower(), name)
    try:
        engine.speaker_id(voice)
    except OmniRtError as exc:
        known = ", ".join(sorted(OPENAI_VOICES))
        raise ProtocolError("invalid_value", f"{exc} (or an OpenAI voice: {known})") from None
    return voice


def check_system_turn(
    engine: Any, system: str, kept: str, max_tokens: int, param: str, event_id: str | None
) -> None:
    """`ProtocolError` (invalid_value) for a system turn (instructions, tools) that no reply could carry:
    after `kept`, the session's opening system prompt (the one turn truncation never drops; "" for none),
    it leaves no room in the context for the shortest user turn and a reply of `max_tokens`. Accepted,
    it would fail every reply, and those failures would delete the input they read (conversation.py).
    Counted as the Session counts it (`omni_rt.conversation.input_limit`); an engine without settings
    (a test's stand-in) is not checked."""
    settings = getattr(engine, "settings", None)
    if not system or settings is None:
        return
    turns = [("system", kept)] if kept else []
    need = len(engine.tokenizer.chat_prompt([*turns, ("system", system), ("user", "")]))
    limit = input_limit(settings.max_context, max_tokens)
    if need > limit:
        raise ProtocolError(
            "invalid_value",
            f"the system prompt (instructions and tools) needs {need} tokens of the {limit} that the "
            f"context ({settings.max_context} tokens, less a reply of {max_tokens}) has for a prompt: "
            "shorten it",
            param=param,
            event_id=event_id,
        )
