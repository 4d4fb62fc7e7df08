"""Input audio transcription (`audio.input.transcription`): what the user said, as text, by the Thinker.

    t = InputTranscriber(engine, send, spawn)
    t.configure({"model": "omni_rt"})        # from session.update; None turns it off
    t.add(item_id, turn_audio_16k)           # every spoken item, when it is committed
    t.hold(); ...; t.release()               # around the start of a reply: see below

Qwen3-Omni's Thinker is an audio-understanding model, so the transcript is its own: each spoken item
is sent, alone, to a short-lived engine session with a transcription instruction (text out, a single
audio frame, which the engine needs at least), and its text streams to the client as
`conversation.item.input_audio_transcription.delta` events, then `.completed`. A transcription that
cannot run (no free session slot, the engine stopped, the request failed) is
`conversation.item.input_audio_transcription.failed` with the reason; nothing is dropped silently.

Never before the reply: a transcription waits while a reply is getting under way (from its start to
its first audio, or its end), so the user hears the answer no later than without it; items are
transcribed one at a time, in order. With random weights (the `tiny` preset) the text is noise: the
mechanism is the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from omni_rt import wire
from omni_rt.errors import OmniRtError
from omni_rt.server import protocol
from omni_rt.server.protocol import ProtocolError

__all__ = ["InputTranscriber", "transcription_update"]

log = logging.getLogger(__name__)

PROMPT = "Transcribe the speech in this audio word for word. Reply with the transcription only."
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
    """One connection's transcriptions of its spoken items (see the module doc)."""

    def __init__(
        self,
        engine: Any,
        send: Callable[[dict[str, Any]], None],
        spawn: Callable[[Any, str], asyncio.Task],
        max_output_tokens: int = 256,
    ) -> None:
        self.engine, self._send, self._spawn = engine, send, spawn
        self.max_output_tokens = max_output_tokens
        self.setting: dict[str, Any] | None = None
        self._queue: asyncio.Queue[tuple[str, np.ndarray]] = asyncio.Queue()
        self._clear = asyncio.Event()  # set: no reply is getting under way
        self._clear.set()
        self._task: asyncio.Task | None = None

    def configure(self, setting: dict[str, Any] | None) -> None:
        self.setting = setting

    def add(self, item_id: str, audio: np.ndarray) -> None:
        if self.setting is None:
            return
        self._queue.put_nowait((item_id, audio))
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run(), "transcription")

    def hold(self) -> None:
        self._clear.clear()

    def release(self) -> None:
        self._clear.set()

    async def _run(self) -> None:
        while not self._queue.empty():
            item_id, audio = self._queue.get_nowait()
            await self._clear.wait()
            await self._transcribe(item_id, audio)

    async def _transcribe(self, item_id: str, audio: np.ndarray) -> None:
        parts: list[str] = []
        reason: tuple[str, str] | None = None
        try:
            async with self.engine.session() as session:
                replies = session.respond(
                    PROMPT,
                    audio=audio,
                    audio_sample_rate=16000,
                    max_output_tokens=self.max_output_tokens,
                    max_audio_frames=1,
                )
                async for ev in replies:
                    if ev.type == "response.output_audio_transcript.delta" and ev.delta:
                        parts.append(ev.delta)
                        self._send(
                            wire._event(f"{PREFIX}.delta", item_id=item_id, content_index=0, delta=ev.delta)
                        )
                    elif ev.type == "error":
                        reason = (getattr(ev.error, "code", None) or "transcription_failed", str(ev.error))
                    elif ev.type == "response.done" and ev.status != "completed" and reason is None:
                        reason = ("transcription_failed", f"the transcription ended {ev.status}")
        except asyncio.CancelledError:
            raise
        except OmniRtError as exc:  # no free slot, the engine stopped, a bad request
            reason = (exc.code, str(exc))
        except Exception as exc:  # a bug costs this transcript, never the connection
            log.exception("transcription of %s failed", item_id)
            reason = ("server_error", f"transcription failed: {type(exc).__name__}")
        if reason is not None:
            code, message = reason
            error = {"type": "transcription_error", "code": code, "message": message, "param": None}
            self._send(wire._event(f"{PREFIX}.failed", item_id=item_id, content_index=0, error=error))
        else:
            transcript = "".join(parts).strip()
            # OpenAI's event requires usage; billed by audio length, as for whisper-1.
            usage = {"type": "duration", "seconds": round(len(audio) / 16000, 3)}
            self._send(
                wire._event(
                    f"{PREFIX}.completed",
                    item_id=item_id,
                    content_index=0,
                    transcript=transcript,
                    usage=usage,
                )
            )
