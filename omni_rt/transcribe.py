"""What the user said, as text, by the Thinker: one conversation's transcriptions of its spoken turns.

    t = Transcriber(engine, spawn, on_delta=..., on_done=...)
    done = t.add(item_id, turn_audio_16k)    # every spoken turn, when it is committed: a future Transcript
    t.hold(); ...; t.release()               # around the start of a reply: see below

Qwen3-Omni's Thinker is an audio-understanding model, so the transcript is its own: each spoken turn is
sent, alone, to a short-lived engine session with a transcription instruction (text out, a single audio
frame, which the engine needs at least); its text comes to `on_delta` as it is sampled, then the whole of
it to `on_done`. A transcription that cannot run (no free session slot, the engine stopped, the request
failed) is a `Transcript` with `error` = (code, message): never an exception, never dropped silently.
Each transcription holds one engine session slot for as long as it runs.

Never before the reply: a transcription waits while the caller holds it (from a reply's start to its
first audio, or its end), so the user hears the answer no later than without it; turns are transcribed
one at a time, in order. With random weights (the `tiny` preset) the text is noise: the mechanism is the
same. Used by `omni-rt serve` (`server/transcription.py`: the OpenAI events) and the LiveKit and pipecat
adapters. No pydantic, no server: an engine and asyncio.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_rt.errors import OmniRtError

__all__ = ["PROMPT", "Transcriber", "Transcript", "transcribe"]

log = logging.getLogger(__name__)

PROMPT = "Transcribe the speech in this audio word for word. Reply with the transcription only."
RATE = 16000  # the turns' audio: 16 kHz mono float


@dataclass(frozen=True)
class Transcript:
    """One turn's transcription: `text`, or `error` = (code, message) when it could not be made."""

    item_id: str
    text: str
    seconds: float  # the turn's audio
    error: tuple[str, str] | None = None


async def transcribe(
    engine: Any,
    item_id: str,
    audio: np.ndarray,
    *,
    max_output_tokens: int = 256,
    on_delta: Callable[[str, str], Awaitable[None]] | None = None,
) -> Transcript:
    """Transcribe one turn (16 kHz mono) in a short-lived session of `engine`; each piece of text goes to
    `on_delta(item_id, delta)` as it comes. Failures are the Transcript's `error`, never raised."""
    parts: list[str] = []
    error: tuple[str, str] | None = None
    try:
        async with engine.session() as session:
            replies = session.respond(
                PROMPT, audio=audio, audio_sample_rate=RATE, max_output_tokens=max_output_tokens,
                max_audio_frames=1,
            )  # fmt: skip
            async for ev in replies:
                if ev.type == "response.output_audio_transcript.delta" and ev.delta:
                    parts.append(ev.delta)
                    if on_delta is not None:
                        await on_delta(item_id, ev.delta)
                elif ev.type == "error":
                    error = (getattr(ev.error, "code", None) or "transcription_failed", str(ev.error))
                elif ev.type == "response.done" and ev.status != "completed" and error is None:
                    error = ("transcription_failed", f"the transcription ended {ev.status}")
    except asyncio.CancelledError:
        raise
    except OmniRtError as exc:  # no free slot, the engine stopped, a bad request
        error = (exc.code, str(exc))
    except Exception as exc:  # a bug costs this transcript, never the conversation
        log.exception("transcription of %s failed", item_id)
        error = ("server_error", f"transcription failed: {type(exc).__name__}")
    return Transcript(item_id, "".join(parts).strip(), round(len(audio) / RATE, 3), error)


class Transcriber:
    """One conversation's transcriptions of its spoken turns, in order, never while held (module doc).

    `spawn(coro, name)` runs the worker as a task its owner cancels at its end; `on_done(transcript)` gets
    every turn's result, failed or not."""

    def __init__(
        self,
        engine: Any,
        spawn: Callable[[Coroutine[Any, Any, None], str], Any],
        *,
        on_done: Callable[[Transcript], Awaitable[None]],
        on_delta: Callable[[str, str], Awaitable[None]] | None = None,
        max_output_tokens: int = 256,
    ) -> None:
        self.engine, self._spawn = engine, spawn
        self._on_done, self._on_delta = on_done, on_delta
        self.max_output_tokens = max_output_tokens
        self._queue: list[tuple[str, np.ndarray, asyncio.Future[Transcript]]] = []
        self._clear = asyncio.Event()  # set: no reply is getting under way
        self._clear.set()
        self._task: asyncio.Task | None = None

    def add(self, item_id: str, audio: np.ndarray) -> asyncio.Future[Transcript]:
        """Queue a turn; the future is its Transcript once `on_done` has had it (cancelled if the owner
        ends first)."""
        done: asyncio.Future[Transcript] = asyncio.get_running_loop().create_future()
        self._queue.append((item_id, audio, done))
        if self._task is None or self._task.done():
            self._task = self._spawn(self._run(), "transcription")
        return done

    def hold(self) -> None:
        self._clear.clear()

    def release(self) -> None:
        self._clear.set()

    async def _run(self) -> None:
        try:
            while self._queue:
                await self._clear.wait()
                item_id, audio, done = self._queue[0]
                result = await transcribe(
                    self.engine, item_id, audio, max_output_tokens=self.max_output_tokens,
                    on_delta=self._on_delta,
                )  # fmt: skip
                try:
                    await self._on_done(result)
                except Exception:  # the owner's handler: a bug costs this transcript, never the rest
                    log.exception("handling the transcript of %s failed", item_id)
                self._queue.pop(0)
                done.set_result(result)
        finally:  # the owner ended (cancelled): nobody is left waiting on a turn
            for _, _, done in self._queue:
                done.cancel()
            self._queue.clear()
