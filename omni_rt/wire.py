"""Server events as the Realtime wire carries them (OpenAI Realtime GA names and shapes): the one
serialiser, used by the server for every event it sends and by `omni_rt.events` for `to_wire()`.

Plain dicts, JSON-ready; audio as base64 of little-endian PCM16. numpy and the standard library only:
no socket, no pydantic model, no engine.
"""

from __future__ import annotations

import base64
import secrets
from typing import Any, Literal

import numpy as np

INPUT_SAMPLE_RATE = 24_000  # input_audio_buffer.append carries 24 kHz mono PCM16, as OpenAI's does


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def _event(type: str, **fields: Any) -> dict[str, Any]:
    return {"type": type, "event_id": new_id("event"), **fields}


def error(
    type: str, code: str | None, message: str, *, param: str | None = None, event_id: str | None = None
) -> dict[str, Any]:
    """`event_id`: the client event that caused it."""
    return _event(
        "error", error={"type": type, "code": code, "message": message, "param": param, "event_id": event_id}
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
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] = "auto",
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
        "tools": list(tools or []),
        "tool_choice": tool_choice,
    }


def session_created(session: dict[str, Any]) -> dict[str, Any]:
    return _event("session.created", session=session)


def session_updated(session: dict[str, Any]) -> dict[str, Any]:
    return _event("session.updated", session=session)


def webrtc_answer(sdp: str) -> dict[str, Any]:
    return _event("webrtc.answer", sdp=sdp)


def item_object(item_id: str, role: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A text message item: a user's `input_text`, a system's `input_text`, an assistant's `output_text`."""
    part_type = "output_text" if role == "assistant" else "input_text"
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": role,
        "content": [{"type": part_type, "text": text}],
    }


def assistant_item(item_id: str, status: str, audio: bool, text: str | None) -> dict[str, Any]:
    """The assistant message of a reply: no content while it is announced (`text` None), then one part,
    `output_audio` with its transcript or `output_text`."""
    content = []
    if text is not None:
        content = [
            {"type": "output_audio", "transcript": text} if audio else {"type": "output_text", "text": text}
        ]
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
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


def conversation_item_retrieved(item: dict[str, Any]) -> dict[str, Any]:
    return _event("conversation.item.retrieved", item=item)


def conversation_item_deleted(item_id: str) -> dict[str, Any]:
    return _event("conversation.item.deleted", item_id=item_id)


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
    echo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`echo`: what the response was created with (conversation_id, output_modalities,
    max_output_tokens, audio, metadata), repeated in every event that carries the response."""
    response: dict[str, Any] = {
        "id": response_id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "usage": usage,
        **(echo or {}),
    }
    if metrics is not None:
        response["metrics"] = metrics  # omni_rt's addition: latency figures of this response
    return response


def response_echo(
    *,
    conversation: bool,
    modalities: list[str],
    max_output_tokens: int | str,
    voice: str,
    sample_rate: int,
    metadata: dict[str, str] | None,
) -> dict[str, Any]:
    """The fields of a response object that repeat its request (see `response_object`)."""
    return {
        # "auto" responses join the connection's one conversation; out-of-band ones none.
        "conversation_id": "conv_default" if conversation else None,
        "output_modalities": list(modalities),
        "max_output_tokens": max_output_tokens,
        "audio": {"output": {"format": {"type": "audio/pcm", "rate": sample_rate}, "voice": voice}},
        "metadata": metadata,
    }


def usage_object(usage: Any) -> dict[str, Any] | None:
    """A session's `Usage` in OpenAI's shape (token counts; omni_rt's codec frames as an addition)."""
    if usage is None:
        return None
    u = usage.model_dump() if hasattr(usage, "model_dump") else dict(usage)
    inp, out = int(u.get("input_tokens", 0)), int(u.get("output_tokens", 0))
    cached = int(u.get("cached_tokens", 0))
    return {
        "total_tokens": inp + cached + out,
        "input_tokens": inp + cached,
        "output_tokens": out,
        "input_token_details": {"cached_tokens": cached, "text_tokens": inp + cached, "audio_tokens": 0},
        "output_token_details": {"text_tokens": out, "audio_tokens": 0},
        "audio_frames": int(u.get("audio_frames", 0)),
    }


def response_created(response: dict[str, Any]) -> dict[str, Any]:
    return _event("response.created", response=response)


def response_done(response: dict[str, Any]) -> dict[str, Any]:
    return _event("response.done", response=response)


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def function_call_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "object": "realtime.item",
        "type": "function_call_output",
        "status": "completed",
        "call_id": call_id,
        "output": output,
    }


def function_call_arguments(
    kind: Literal["delta", "done"], response_id: str, item: dict[str, Any], output_index: int
) -> dict[str, Any]:
    fields = {
        "response_id": response_id,
        "item_id": item["id"],
        "output_index": output_index,
        "call_id": item["call_id"],
    }
    if kind == "delta":
        return _event("response.function_call_arguments.delta", **fields, delta=item["arguments"])
    return _event(
        "response.function_call_arguments.done", **fields, name=item["name"], arguments=item["arguments"]
    )


def output_item(
    kind: Literal["added", "done"], response_id: str, item: dict[str, Any], output_index: int = 0
) -> dict[str, Any]:
    return _event(
        f"response.output_item.{kind}", response_id=response_id, output_index=output_index, item=item
    )


def content_part(
    kind: Literal["added", "done"], response_id: str, item_id: str, audio: bool, text: str
) -> dict[str, Any]:
    part = {"type": "audio", "transcript": text} if audio else {"type": "text", "text": text}
    return _event(f"response.content_part.{kind}", **_part_fields(response_id, item_id), part=part)


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


# -- the input audio buffer ----------------------------------------------------------------------------


def speech_started(audio_start_ms: int, item_id: str) -> dict[str, Any]:
    return _event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id)


def speech_stopped(audio_end_ms: int, item_id: str) -> dict[str, Any]:
    return _event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)


def committed(item_id: str, previous_item_id: str | None) -> dict[str, Any]:
    return _event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous_item_id)


def cleared() -> dict[str, Any]:
    return _event("input_audio_buffer.cleared")


# -- a Session's own events (omni_rt.events), for callers of Event.to_wire() ----------------------------


def from_event(ev: Any, item_id: str | None = None) -> dict[str, Any]:
    """An `omni_rt.events` event on the wire, in the shape the server sends it (with the event's own
    `event_id`). A Session knows no conversation items: `item_id` names the assistant item its
    response events belong to."""
    return {**_from_event(ev, item_id), "event_id": ev.event_id}


def _from_event(ev: Any, item_id: str | None) -> dict[str, Any]:
    kind = ev.type
    item = item_id or ""
    if kind == "response.created":
        return response_created(response_object(ev.response_id, "in_progress"))
    if kind == "response.output_text.delta":
        return text_delta(ev.response_id, item, ev.delta)
    if kind == "response.output_audio_transcript.delta":
        return transcript_delta(ev.response_id, item, ev.delta)
    if kind == "response.output_audio.delta":
        return audio_delta(ev.response_id, item, ev.pcm)
    if kind == "response.output_audio.done":
        return audio_done(ev.response_id, item)
    if kind == "response.done":
        details = None
        if ev.error is not None:
            details = {"type": ev.status, "error": ev.error.model_dump()}
        return response_done(
            response_object(
                ev.response_id,
                ev.status,
                status_details=details,
                usage=usage_object(ev.usage),
                metrics=metrics_dict(ev.metrics),
            )
        )
    if kind == "input_audio_buffer.speech_started":
        return speech_started(ev.audio_start_ms, ev.item_id)
    if kind == "input_audio_buffer.speech_stopped":
        return speech_stopped(ev.audio_end_ms, ev.item_id)
    if kind == "input_audio_buffer.committed":
        return committed(ev.item_id, ev.previous_item_id)
    if kind == "input_audio_buffer.cleared":
        return cleared()
    if kind == "error":
        return error(ev.error.type, ev.error.code, ev.error.message)
    raise ValueError(f"no wire form for {kind!r}")
