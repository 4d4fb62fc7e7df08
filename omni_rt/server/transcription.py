"""Input audio transcription (`audio.input.transcription`): what the user said, as OpenAI's events.

    t = InputTranscriber(engine, send, spawn)
    t.configure({"model": "omni_rt"})        # from session.update; None turns it off
    t.add(item_id, turn_audio_16k)           # every spoken item, when it is committed
    t.hold(); ...; t.release()               # around the start of a reply: see below

The transcription itself is `omni_rt.transcribe` (shared with the LiveKit and pipecat adapters): each
spoken item is sent, alone, to a short-lived engine session with a transcription instruction, never
before a reply's first audio (`hold` from a reply's start, `release` at its first audio or its end),
items one at a time, in order. Here its text streams to the client as
`conversation.item.input_audio_transcription.delta` events, then `.completed`; a transcription that
cannot run (no free session slot, the engine stopped, the request failed) is
`conversation.item.input_audio_transcription.failed` with the reason; nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_rt import wire
from omni_rt.server import protocol
from omni_rt.server.protocol import ProtocolError
from omni_rt.transcribe import Transcriber, Transcript

__all__ = ["InputTranscriber", "transcription_update"]

PREFIX = "conversation.item.input_audio_transcription"


def transcription_update(
    s: protocol.SessionFields, event_id: str | None = None
) -> tuple[bool, dict[str, Any] | None]:
    """(given, value) of a session config's `audio.input.transcription` (beta:
    `input_audio_transcription`); an object turns it on, null off. Anything else is `invalid_value`."""
    audio_input = s.audio.input if s.audio is not None else None
    for where, extra, key in (
        (
            "session.audio.input.transcription",
            audio_input.model_extra if audio_input else None,
            "transcription",
        ),
        ("session.input_audio_transcription", s.model_extra, "input_audio_transcription"),
    ):
        if extra and key in extra:
            value = extra[key]
            if value is not None and not isinstance(value, dict):
                raise ProtocolError(
                    "invalid_value",
                    "transcription must be an object or null",
                    param=where,
                    event_id=event_id,
                )
            return True, value
    return False, None


class InputTranscriber:
    """One connection's transcriptions of its spoken items, as OpenAI's events (see the module doc)."""

    def __init__(
        self,
        engine: Any,
        send: Callable[[dict[str, Any]], None],
        spawn: Callable[[Any, str], asyncio.Task],
        max_output_tokens: int = 256,
    ) -> None:
        self._send = send
        self.setting: dict[str, Any] | None = None
        self._turns = Transcriber(
            engine, spawn, on_done=self._done, on_delta=self._delta, max_output_tokens=max_output_tokens
        )

    def configure(self, setting: dict[str, Any] | None) -> None:
        self.setting = setting

    def add(self, item_id: str, audio: np.ndarray) -> None:
        if self.setting is not None:
            self._turns.add(item_id, audio)

    def hold(self) -> None:
        self._turns.hold()

    def release(self) -> None:
        self._turns.release()

    async def _delta(self, item_id: str, delta: str) -> None:
        self._send(wire._event(f"{PREFIX}.delta", item_id=item_id, content_index=0, delta=delta))

    async def _done(self, t: Transcript) -> None:
        if t.error is not None:
            code, message = t.error
            error = {"type": "transcription_error", "code": code, "message": message, "param": None}
            self._send(wire._event(f"{PREFIX}.failed", item_id=t.item_id, content_index=0, error=error))
            return
        # OpenAI's event requires usage; billed by audio length, as for whisper-1.
        usage = {"type": "duration", "seconds": t.seconds}
        self._send(
            wire._event(
                f"{PREFIX}.completed", item_id=t.item_id, content_index=0, transcript=t.text, usage=usage
            )
        )
